//! The prompt handoff: token ids the gateway computed, passed to a kvgate worker with the request so the worker
//! does not render and tokenize the prompt a second time.
//!
//! Wire format: the gateway adds the body field `kvgate_prompt_ids` (a string: base64 of the ids as little-endian
//! u32) and the header `x-kvgate-prompt-auth` (hex keyed BLAKE3 of that string, under a key derived from the shared
//! report secret with BLAKE3's key derivation; BLAKE3 rather than HMAC-SHA256 because it is several times faster on
//! the 100 KB of a long prompt's ids, and this is on every request's path, twice). A worker uses the ids only when
//! the header verifies under its own `--report-secret`; otherwise it ignores them and tokenizes the prompt itself,
//! so a client cannot choose ids that differ from its messages (the gateway also refuses a client body that carries
//! the field). Both sides tokenize with the same `Prompter`
//! (same tokenizer digest), so the ids are the ones the worker would compute.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// The body field carrying the ids.
pub const PROMPT_IDS_FIELD: &str = "kvgate_prompt_ids";
/// The header carrying the ids' authentication code.
pub const PROMPT_AUTH_HEADER: &str = "x-kvgate-prompt-auth";

/// Base64 of the ids as little-endian u32.
pub fn encode_ids(ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    STANDARD.encode(bytes)
}

/// The ids of [`encode_ids`]' output; `None` if it is not that.
pub fn decode_ids(s: &str) -> Option<Vec<u32>> {
    let bytes = STANDARD.decode(s).ok()?;
    if bytes.len() % 4 != 0 {
        return None;
    }
    Some(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The handoff key: the report secret, separated from its other use by BLAKE3's key derivation.
fn key(secret: &str) -> [u8; 32] {
    blake3::derive_key("kvgate 2026-11 prompt handoff ids v2", secret.as_bytes())
}

fn mac(secret: &str, encoded: &str) -> blake3::Hash {
    blake3::keyed_hash(&key(secret), encoded.as_bytes())
}

/// The authentication code of `encoded` (the field's value) under `secret`, as hex.
pub fn sign(secret: &str, encoded: &str) -> String {
    mac(secret, encoded).to_hex().to_string()
}

/// Whether `auth` is the code of `encoded` under `secret` (`blake3::Hash` compares in constant time).
pub fn verify(secret: &str, encoded: &str, auth: &str) -> bool {
    blake3::Hash::from_hex(auth).is_ok_and(|given| given == mac(secret, encoded))
}

/// `body` (a JSON object) with the field added as its first member; `None` if `body` does not start with an
/// object.
pub fn with_ids_field(body: &[u8], encoded: &str) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()).is_none_or(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + encoded.len() + PROMPT_IDS_FIELD.len() + 8);
    out.extend_from_slice(&body[..=open]);
    out.push(b'"');
    out.extend_from_slice(PROMPT_IDS_FIELD.as_bytes());
    out.extend_from_slice(b"\":\"");
    out.extend_from_slice(encoded.as_bytes());
    out.push(b'"');
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_is_keyed_blake3_under_a_derived_key() {
        // BLAKE3's keyed mode of the field's text under the derived key: an independent computation of both steps.
        let key = blake3::derive_key("kvgate 2026-11 prompt handoff ids v2", b"s3cret");
        assert_eq!(sign("s3cret", "AAAA"), blake3::keyed_hash(&key, b"AAAA").to_hex().to_string());
        assert_eq!(sign("s3cret", "AAAA").len(), 64);
        assert_ne!(sign("s3cret", "AAAA"), blake3::hash(b"AAAA").to_hex().to_string(), "keyed");
    }

    #[test]
    fn ids_round_trip_and_the_code_binds_them_to_the_secret() {
        let ids = vec![0, 1, 128_000, u32::MAX, 42];
        let enc = encode_ids(&ids);
        assert_eq!(decode_ids(&enc), Some(ids));
        assert_eq!(decode_ids("not base64!"), None);
        assert_eq!(decode_ids(&STANDARD.encode([1u8, 2, 3])), None, "not a whole number of ids");
        let auth = sign("s3cret", &enc);
        assert!(verify("s3cret", &enc, &auth));
        assert!(!verify("other", &enc, &auth));
        assert!(!verify("s3cret", &encode_ids(&[0, 1]), &auth));
        assert!(!verify("s3cret", &enc, &auth[..10]));
    }

    #[test]
    fn the_field_is_added_as_the_first_member() {
        let out = with_ids_field(b"  {\"model\":\"m\"}", "AAAA").expect("object");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(v[PROMPT_IDS_FIELD], "AAAA");
        assert_eq!(v["model"], "m");
        let out = with_ids_field(b"{ }", "AAAA").expect("object");
        assert!(serde_json::from_slice::<serde_json::Value>(&out).is_ok());
        assert_eq!(with_ids_field(b"[1]", "AAAA"), None);
        assert_eq!(with_ids_field(b"", "AAAA"), None);
    }
}
