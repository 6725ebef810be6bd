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

/// Writes the state file atomically and durably: temporary file, fsync, rename, fsync of the directory.
pub fn save_state(path: &Path, p: &Persisted) -> Result<(), String> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(p).map_err(|e| e.to_string())?;
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()
    };
    write().map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| format!("{}: {e}", dir.display()))
}
