//! API keys: who a caller is. A caller presents `Authorization: Bearer <key>`; the key table (`--api-keys-file`)
//! maps the key to a tenant (its own fair queue inside each class), the classes it may choose with
//! `x-kvgate-class`, and optionally a cache salt forced on all its requests (tenant isolation of the prefix cache).
//!
//! Nothing a caller sends without a known key buys anything: unknown or missing keys are the one
//! [`ANONYMOUS_TENANT`], classes come from the server's rules, and a salt is whatever the caller sets (it only
//! narrows what the caller can hit). Keys are kept as SHA-256 digests and compared in constant time.
//!
//! File format (TOML):
//! ```toml
//! [[keys]]
//! key = "sk-team-a-..."          # or key_sha256 = "<64 hex digits>" to keep the secret out of the file
//! tenant = "team-a"
//! classes = ["long"]             # classes this key may name in x-kvgate-class (default: none)
//! cache_salt = "team-a"          # optional: replaces any cache_salt the caller sends
//! models = ["base", "sql-lora"]  # optional: the only models (base models or LoRA adapters) it may name
//! ```

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The tenant of every caller without a known key.
pub const ANONYMOUS_TENANT: &str = kvgate_router::admission::ANONYMOUS;
/// Most keys in a table.
pub const MAX_KEYS: usize = 100_000;

/// What a known key grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    /// Classes this caller may choose with `x-kvgate-class`.
    pub classes: Vec<String>,
    /// Salt forced on this caller's requests.
    pub cache_salt: Option<String>,
    /// Whether a key identified the caller.
    pub known: bool,
    /// The only models it may name (base models or LoRA adapters); `None`: any.
    pub models: Option<Vec<String>>,
}

impl Caller {
    pub fn anonymous() -> Self {
        Self {
            tenant: ANONYMOUS_TENANT.into(),
            classes: Vec::new(),
            cache_salt: None,
            known: false,
            models: None,
        }
    }

    /// Whether it may name `model` (403 `model_not_allowed` otherwise).
    pub fn allows(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.iter().any(|x| x == model))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    key: Option<String>,
    key_sha256: Option<String>,
    tenant: String,
    #[serde(default)]
    classes: Vec<String>,
    cache_salt: Option<String>,
    models: Option<Vec<String>>,
}

/// The key table.
#[derive(Debug, Default)]
pub struct KeyTable {
    by_digest: HashMap<[u8; 32], Arc<Caller>>,
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

fn parse_hex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl KeyTable {
    /// Reads a key file; every problem is listed.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let file: KeyFile = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.keys.len() > MAX_KEYS {
            return Err(format!("{} keys (at most {MAX_KEYS})", file.keys.len()));
        }
        let mut problems = Vec::new();
        let mut by_digest = HashMap::new();
        for (i, k) in file.keys.into_iter().enumerate() {
            let d = match (&k.key, &k.key_sha256) {
                (Some(key), None) if key.len() >= 16 => Some(digest(key.as_bytes())),
                (Some(_), None) => {
                    problems.push(format!("keys[{i}]: a key must have at least 16 characters"));
                    None
                }
                (None, Some(hex)) => {
                    let d = parse_hex(hex);
                    if d.is_none() {
                        problems.push(format!("keys[{i}]: key_sha256 must be 64 hex digits"));
                    }
                    d
                }
                _ => {
                    problems.push(format!("keys[{i}]: give exactly one of key and key_sha256"));
                    None
                }
            };
            if k.tenant.is_empty() || k.tenant.len() > 256 {
                problems.push(format!("keys[{i}]: tenant must have 1 to 256 characters"));
            }
            if k.tenant == ANONYMOUS_TENANT {
                problems.push(format!("keys[{i}]: the tenant name {ANONYMOUS_TENANT:?} is reserved"));
            }
            if let Some(d) = d {
                let caller = Caller {
                    tenant: k.tenant,
                    classes: k.classes,
                    cache_salt: k.cache_salt.filter(|s| !s.is_empty()),
                    known: true,
                    models: k.models,
                };
                if by_digest.insert(d, Arc::new(caller)).is_some() {
                    problems.push(format!("keys[{i}]: the same key appears twice"));
                }
            }
        }
        if problems.is_empty() {
            Ok(Self { by_digest })
        } else {
            Err(problems.join("; "))
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The caller behind an `Authorization` header value (`Bearer <key>`), if the key is known. The table is
    /// indexed by the key's SHA-256 (so the lookup's timing says nothing about the key) and the found digest is
    /// compared again in constant time.
    pub fn identify(&self, authorization: Option<&str>) -> Option<Arc<Caller>> {
        let key = authorization?.strip_prefix("Bearer ")?.trim();
        if key.is_empty() || key.len() > 4096 {
            return None;
        }
        let d = digest(key.as_bytes());
        let (found, caller) = self.by_digest.get_key_value(&d)?;
        crate::control::auth::secrets_equal(found, &d).then(|| caller.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_unknown_keys_to_nobody() {
        let hashed: String = digest(b"second-key-0123456789").iter().map(|b| format!("{b:02x}")).collect();
        let t = KeyTable::parse(&format!(
            "[[keys]]\nkey = \"first-key-0123456789\"\ntenant = \"a\"\nclasses = [\"long\"]\ncache_salt = \"sa\"\n\
             [[keys]]\nkey_sha256 = \"{hashed}\"\ntenant = \"b\"\n"
        ))
        .expect("parses");
        let a = t.identify(Some("Bearer first-key-0123456789")).expect("a");
        assert_eq!(
            (a.tenant.as_str(), a.classes.clone(), a.cache_salt.as_deref()),
            ("a", vec!["long".into()], Some("sa"))
        );
        assert_eq!(t.identify(Some("Bearer second-key-0123456789")).expect("b").tenant, "b");
        assert!(t.identify(Some("Bearer nope")).is_none());
        assert!(t.identify(Some("first-key-0123456789")).is_none(), "Bearer scheme required");
        assert!(t.identify(None).is_none());
    }

    #[test]
    fn bad_tables_list_every_problem() {
        let err = KeyTable::parse(
            "[[keys]]\nkey = \"short\"\ntenant = \"\"\n[[keys]]\ntenant = \"anonymous\"\n\
             [[keys]]\nkey_sha256 = \"zz\"\ntenant = \"x\"\n",
        )
        .expect_err("bad");
        for needle in ["16 characters", "tenant must", "exactly one", "reserved", "64 hex"] {
            assert!(err.contains(needle), "{needle}: {err}");
        }
        assert!(KeyTable::parse("[[keys]]\nkey = \"k\"\ntenant = \"t\"\nsurprise = 1\n").is_err());
    }
}
