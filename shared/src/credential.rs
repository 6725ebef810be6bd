//! Per-request credentials: what a gateway hands a kvgate worker when the request does not travel on the
//! gateway's own connection (an endpoint picker's proxy sends it, `gateway/src/epp`), so that nothing the proxy,
//! or anyone who reads the proxy's header mutations, holds can be reused for another request or another call.
//!
//! The static gateway token (`handoff::gateway_token`) authorizes any request on a `--require-gateway-token`
//! worker for ever: it only ever travels on a gateway's own connections to its workers. A picker's answer carries
//! instead `Authorization: Bearer kvr1.<issued: unix ms>.<mac: 64 hex>`,
//! ```text
//! mac = keyed BLAKE3 under derive_key(REQUEST_CONTEXT, secret) of, each length-prefixed (u32 LE):
//!       "kvr1", issued, the request's path, blake3(body), the cache-salt header (a presence byte, then its value)
//! ```
//! A worker accepts it for exactly that path, body and salt header, within `handoff::ASSERTION_WINDOW_MS` of its
//! clock; never for its admin calls (runtime LoRA loading), which a request credential does not name.
//! The model, the handed-off ids and the salt are in the body, so the credential is bound to them; the tenant
//! scope is bound by the assertion header (`handoff::verify`), which travels with it.
//!
//! Replay: the same request (same path, body and salt) may be sent again within the window by whoever saw it,
//! which is the proxy's own retry; a different body, path or salt does not verify.

use crate::handoff::{AssertionError, ASSERTION_WINDOW_MS};

/// What a request credential's bearer value begins with.
pub const REQUEST_PREFIX: &str = "kvr1.";
/// Longest request credential accepted (the prefix, 20 digits, a dot, 64 hex digits).
pub const MAX_REQUEST_CREDENTIAL_BYTES: usize = 96;

const REQUEST_CONTEXT: &str = "kvgate 2026-12 per-request worker credential v1";

/// This machine's clock in unix milliseconds (0 before 1970), as credentials are issued and checked with.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// What a request credential binds: the request as the worker reads it.
#[derive(Clone, Copy, Debug)]
pub struct RequestFor<'a> {
    pub path: &'a str,
    pub body: &'a [u8],
    /// The `x-kvgate-cache-salt` header's value, when the request carries one.
    pub salt_header: Option<&'a [u8]>,
}

fn code(secret: &str, issued_ms: u64, r: &RequestFor<'_>) -> blake3::Hash {
    let key = blake3::derive_key(REQUEST_CONTEXT, secret.as_bytes());
    let mut h = blake3::Hasher::new_keyed(&key);
    let mut part = |b: &[u8]| {
        h.update(&(b.len() as u32).to_le_bytes());
        h.update(b);
    };
    part(b"kvr1");
    part(&issued_ms.to_le_bytes());
    part(r.path.as_bytes());
    part(blake3::hash(r.body).as_bytes());
    part(&[u8::from(r.salt_header.is_some())]);
    part(r.salt_header.unwrap_or(b""));
    h.finalize()
}

/// The credential for `r`, issued at `issued_ms`, under `secret` (the bearer value, without `Bearer `).
pub fn sign_request(secret: &str, issued_ms: u64, r: &RequestFor<'_>) -> String {
    format!("{REQUEST_PREFIX}{issued_ms}.{}", code(secret, issued_ms, r).to_hex())
}

/// Whether `authorization` (the whole header value) is a request credential at all (then the body must be read
/// to check it).
pub fn is_request_credential(authorization: Option<&str>) -> bool {
    authorization
        .and_then(|a| a.strip_prefix("Bearer "))
        .is_some_and(|t| t.trim_start().starts_with(REQUEST_PREFIX))
}

/// Checks the bearer value `token` for the request `r` at `now_ms`, under `secret`.
pub fn verify_request(
    secret: Option<&str>,
    token: &str,
    r: &RequestFor<'_>,
    now_ms: u64,
) -> Result<(), AssertionError> {
    let secret = secret.ok_or(AssertionError::NoSecret)?;
    let token = token.trim();
    if token.len() > MAX_REQUEST_CREDENTIAL_BYTES {
        return Err(AssertionError::Malformed);
    }
    let rest = token.strip_prefix(REQUEST_PREFIX).ok_or(AssertionError::Malformed)?;
    let (issued, mac) = rest.split_once('.').ok_or(AssertionError::Malformed)?;
    if mac.len() != 64 || !mac.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(AssertionError::Malformed);
    }
    let issued_ms: u64 = issued.parse().map_err(|_| AssertionError::Malformed)?;
    let given = blake3::Hash::from_hex(mac).map_err(|_| AssertionError::Malformed)?;
    // `blake3::Hash` compares in constant time.
    if given != code(secret, issued_ms, r) {
        return Err(AssertionError::BadCode);
    }
    let skew_ms = now_ms.abs_diff(issued_ms);
    if skew_ms > ASSERTION_WINDOW_MS {
        return Err(AssertionError::Expired { skew_ms });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_credential_binds_path_body_salt_secret_and_time() {
        let r = RequestFor { path: "/v1/chat/completions", body: b"{\"model\":\"m\"}", salt_header: None };
        let t = sign_request("s", 1_000, &r);
        assert!(t.starts_with(REQUEST_PREFIX) && t.len() <= MAX_REQUEST_CREDENTIAL_BYTES);
        assert_eq!(verify_request(Some("s"), &t, &r, 1_000), Ok(()));
        assert!(is_request_credential(Some(&format!("Bearer {t}"))));
        assert!(!is_request_credential(Some("Bearer 0123abcd")));
        let bad = Err(AssertionError::BadCode);
        for wrong in [
            RequestFor { path: "/v1/completions", ..r },
            RequestFor { body: b"{\"model\":\"n\"}", ..r },
            RequestFor { salt_header: Some(b"x"), ..r },
        ] {
            assert_eq!(verify_request(Some("s"), &t, &wrong, 1_000), bad, "{wrong:?}");
        }
        // An empty salt header is not the absence of one.
        let salted = RequestFor { salt_header: Some(b""), ..r };
        assert_eq!(verify_request(Some("s"), &sign_request("s", 1_000, &salted), &r, 1_000), bad);
        assert_eq!(verify_request(Some("t"), &t, &r, 1_000), bad);
        assert_eq!(verify_request(None, &t, &r, 1_000), Err(AssertionError::NoSecret));
        assert!(matches!(
            verify_request(Some("s"), &t, &r, 1_000 + ASSERTION_WINDOW_MS + 1),
            Err(AssertionError::Expired { .. })
        ));
        for malformed in ["", "kvr1.", "kvr1.x.00", &t.replace("kvr1", "kvr2"), &format!("{t}0")] {
            assert_eq!(verify_request(Some("s"), malformed, &r, 1_000), Err(AssertionError::Malformed));
        }
        // Another issue time moves the code: the time cannot be edited into the window.
        let later = t.replacen("1000", "2000", 1);
        assert_eq!(verify_request(Some("s"), &later, &r, 2_000), bad);
    }
}
