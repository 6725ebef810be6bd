//! The admin API's state file: what it holds ([`Persisted`]: weights and classes, each with its version) and how it
//! is read at start and written before a change takes effect (atomically and durably).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::admission::ClassConfig;
use crate::routing::Weights;

/// What the state file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Persisted {
    pub weights: Weights,
    pub weights_version: u64,
    pub classes: Vec<ClassConfig>,
    pub classes_version: u64,
}

/// Reads a state file (missing: `None`; unreadable or invalid: an error naming the file).
pub fn load_state(path: &Path) -> Result<Option<Persisted>, String> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let p: Persisted = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut problems = p.weights.validate();
    problems.extend(crate::admission::classes::validate(&p.classes));
    if problems.is_empty() {
        Ok(Some(p))
    } else {
        Err(format!("{}: {}", path.display(), problems.join("; ")))
    }
}

/// Reads the state file at start. A file that cannot be used (empty, not JSON, invalid values) is moved aside to
/// `<file>.corrupt-<unix seconds>` with a loud error, and the gateway starts from its configuration: a bad file
/// must not keep the gateway down, and must not be overwritten by the next admin change either (it is evidence).
pub fn load_or_set_aside(path: &Path) -> Option<Persisted> {
    match load_state(path) {
        Ok(p) => p,
        Err(e) => {
            let secs =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let aside = path.with_file_name(format!(
                "{}.corrupt-{secs}",
                path.file_name().map_or("state".into(), |n| n.to_string_lossy())
            ));
            match std::fs::rename(path, &aside) {
                Ok(()) => tracing::error!(
                    "the admin state file cannot be used ({e}); moved it to {} and starting from the configuration",
                    aside.display()
                ),
                Err(m) => tracing::error!(
                    "the admin state file cannot be used ({e}) and could not be moved aside ({m}); starting from the \
                     configuration"
                ),
            }
            None
        }
    }
}

/// Writes the state file atomically and durably: a temporary file of a unique name (two writers never share
/// one), fsync, rename over the file, fsync of the directory.
pub fn save_state(path: &Path, p: &Persisted) -> Result<(), String> {
    use std::io::Write;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_file_name(format!(
        ".{}.{}.{n}.tmp",
        path.file_name().map_or("state".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    let text = serde_json::to_string_pretty(p).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: {e}", tmp.display()));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: {e}", path.display()));
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| format!("{}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> Persisted {
        Persisted {
            weights: Weights::default(),
            weights_version: 3,
            classes: crate::admission::default_classes(),
            classes_version: 2,
        }
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn saves_atomically_into_a_new_directory_and_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nested").join("gateway-state.json");
        assert_eq!(load_state(&path).expect("missing is fine"), None);
        save_state(&path, &state()).expect("saves");
        save_state(&path, &state()).expect("saves over");
        assert_eq!(load_or_set_aside(&path), Some(state()));
        assert_eq!(files(&dir.path().join("nested")), ["gateway-state.json"], "no temporary file is left");
    }

    #[test]
    fn an_unusable_file_is_moved_aside_and_the_gateway_starts_from_its_config() {
        for (name, text) in [("empty", ""), ("not json", "{\"weights\": "), ("invalid", "{}")] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("gateway-state.json");
            std::fs::write(&path, text).expect("write");
            assert_eq!(load_or_set_aside(&path), None, "{name}");
            let left = files(dir.path());
            assert_eq!(left.len(), 1, "{name}: {left:?}");
            assert!(left[0].starts_with("gateway-state.json.corrupt-"), "{name}: {left:?}");
            assert_eq!(std::fs::read_to_string(dir.path().join(&left[0])).expect("kept"), text, "{name}");
            save_state(&path, &state()).expect("the next change writes a new file");
            assert_eq!(load_or_set_aside(&path), Some(state()), "{name}");
        }
    }
}
