//! The prompt handoff: token ids the gateway computed, passed to a kvgate worker with the request so the worker
//! does not render and tokenize the prompt a second time.
//!
//! Wire format: the gateway adds the body field `kvgate_prompt_ids` (a string: base64 of the ids as little-endian
//! u32) and the header `x-kvgate-prompt-auth` (hex HMAC-SHA256 of that string under a key derived from the shared
//! report secret). A worker uses the ids only when the header verifies under its own `--report-secret`; otherwise
//! it ignores them and tokenizes the prompt itself, so a client cannot choose ids that differ from its messages
//! (the gateway also refuses a client body that carries the field). Both sides tokenize with the same `Prompter`
//! (same tokenizer digest), so the ids are the ones the worker would compute.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use sha2::{Digest, Sha256};

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

fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
    for i in 0..64 {
        ipad[i] ^= k[i];
        opad[i] ^= k[i];
    }
    let inner = Sha256::new().chain_update(ipad).chain_update(msg).finalize();
    Sha256::new().chain_update(opad).chain_update(inner).finalize().into()
}

/// The handoff key: the report secret, separated from its other use.
fn key(secret: &str) -> [u8; 32] {
    hmac_sha256(secret.as_bytes(), b"kvgate/prompt-ids/v1")
}

/// The authentication code of `encoded` (the field's value) under `secret`, as hex.
pub fn sign(secret: &str, encoded: &str) -> String {
    hmac_sha256(&key(secret), encoded.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `auth` is the code of `encoded` under `secret` (constant time in the code).
pub fn verify(secret: &str, encoded: &str, auth: &str) -> bool {
    let want = sign(secret, encoded);
    want.len() == auth.len() && want.bytes().zip(auth.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
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
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test case 2.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // Test case 6: a key longer than the block.
        let mac = hmac_sha256(&[0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
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
