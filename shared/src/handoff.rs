//! What a gateway vouches for when it forwards a request to a kvgate worker, and how the worker checks it.
//!
//! Three things travel, all keyed by the shared report secret (each under its own key, separated by BLAKE3's key
//! derivation), so no client and no other pod can forge them:
//! - **the gateway token** ([`gateway_token`]): `Authorization: Bearer <token>` on every request a gateway sends a
//!   kvgate worker; a worker started with `--require-gateway-token` answers its API to nobody else;
//! - **the prompt handoff**: the token ids the gateway computed, in the body field `kvgate_prompt_ids` (base64 of
//!   the ids as little-endian u32), so the worker does not render and tokenize the prompt again;
//! - **the tenant scope** ([`TenantScope`]): which tenant a salted request belongs to and whether its salt was
//!   forced by the tenant's API key, so the worker keys its blocks in the same namespace as the gateway
//!   (`prompt::RequestPrompt::extra_keys`).
//!
//! The ids and the scope are bound by one assertion header, `x-kvgate-gateway-auth`:
//! ```text
//! v1.<issued: unix ms>.<fingerprint: 16 hex>.<scope id: 32 hex, or ->.<kind: f (forced) | c (client) | ->.<mac: 64 hex>
//! mac = keyed BLAKE3 under derive_key(ASSERTION_CONTEXT, secret) of, each length-prefixed (u32 LE):
//!       "v1", issued, fingerprint, scope id, kind, model, salt (or empty, with a presence byte), blake3(ids field)
//!       (or empty, with a presence byte)
//! ```
//! A worker accepts an assertion only if the code verifies under its own secret for the request as it reads it
//! (model, salt, ids field) and `issued` is within [`ASSERTION_WINDOW_MS`] of its clock; then it uses the scope,
//! and the ids only if the fingerprint is its own (the gateway also hands ids only to workers whose reported
//! fingerprint matched). A request with an assertion that does not verify is refused (401), never served in
//! another namespace. Without the header a request is a plain client's: no scope, handed-off ids ignored.
//!
//! BLAKE3 rather than HMAC-SHA256: several times faster on the 100 KB of a long prompt's ids, on every request.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// The body field carrying the ids.
pub const PROMPT_IDS_FIELD: &str = "kvgate_prompt_ids";
/// The header carrying the gateway's assertion.
pub const ASSERTION_HEADER: &str = "x-kvgate-gateway-auth";
/// How far an assertion's issue time may be from the worker's clock (either way), in milliseconds.
pub const ASSERTION_WINDOW_MS: u64 = 300_000;
/// Longest assertion header accepted.
pub const MAX_ASSERTION_BYTES: usize = 256;

/// How every salt [`tenant_salt`] derives begins; gateways refuse client salts that do.
pub const TENANT_SALT_PREFIX: &str = "kvgate-salt-";

const ASSERTION_CONTEXT: &str = "kvgate 2026-12 gateway assertion v1";
const TOKEN_CONTEXT: &str = "kvgate 2026-12 worker api bearer v1";
const SALT_CONTEXT: &str = "kvgate 2026-12 cache salt namespace v1";
const SCOPE_CONTEXT: &str = "kvgate 2026-12 tenant scope id v1";

/// The tenant a request's salt is scoped to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantScope {
    /// [`scope_id`] of the tenant's name (32 hex digits).
    pub id: String,
    /// The salt was forced by the tenant's API key (else the tenant's client sent it).
    pub forced: bool,
}

impl TenantScope {
    pub fn new(tenant: &str, forced: bool) -> Self {
        Self { id: scope_id(tenant), forced }
    }
}

/// A tenant's scope id: 128 bits of BLAKE3 of its name (the name itself never travels).
pub fn scope_id(tenant: &str) -> String {
    let h = blake3::derive_key(SCOPE_CONTEXT, tenant.as_bytes());
    hex(&h[..16])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bearer token gateways present to kvgate workers (`--require-gateway-token`), as hex.
pub fn gateway_token(secret: &str) -> String {
    hex(&blake3::derive_key(TOKEN_CONTEXT, secret.as_bytes()))
}

/// Whether `authorization` (the whole header value) carries the gateway token of `secret` (constant time).
pub fn check_gateway_token(secret: &str, authorization: Option<&str>) -> bool {
    bearer_is(&gateway_token(secret), authorization)
}

/// Whether `authorization` (the whole header value) is `Bearer <want>` (constant time in the token's bytes).
pub fn bearer_is(want: &str, authorization: Option<&str>) -> bool {
    let Some(token) = authorization.and_then(|a| a.strip_prefix("Bearer ")).map(str::trim) else {
        return false;
    };
    token.len() == want.len() && token.bytes().zip(want.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The salt a tenant's request is keyed with, as sent to pods: an opaque value derived from the tenant, whether
/// its key forced the salt, and the salt, under a key from `secret` (without one the derivation is public, so the
/// namespace is only as private as the tenant name and salt). No client-chosen salt can equal it without the
/// secret (and gateways refuse client salts of its form, [`TENANT_SALT_PREFIX`], so even without a secret none
/// reaches it through a gateway), and pods that take a body `cache_salt` (vLLM) isolate by it too.
pub fn tenant_salt(secret: Option<&str>, tenant: &str, forced: bool, salt: &str) -> String {
    let key = blake3::derive_key(SALT_CONTEXT, secret.unwrap_or("").as_bytes());
    let mut h = blake3::Hasher::new_keyed(&key);
    for part in [if forced { "forced" } else { "client" }, tenant, salt] {
        h.update(&(part.len() as u32).to_le_bytes());
        h.update(part.as_bytes());
    }
    format!("{TENANT_SALT_PREFIX}v1:{}", &h.finalize().to_hex()[..32])
}

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

/// What a gateway asserts about one request.
#[derive(Clone, Debug)]
pub struct Assertion<'a> {
    pub issued_ms: u64,
    /// The scheme fingerprint the gateway tokenized and hashed with.
    pub fingerprint: u64,
    pub scope: Option<&'a TenantScope>,
    pub model: &'a str,
    /// The salt the request's blocks are keyed with (as the worker will read it from the body or header).
    pub salt: Option<&'a str>,
    /// The `kvgate_prompt_ids` field's value, when ids are handed off.
    pub ids: Option<&'a str>,
}

/// What a verified assertion tells the worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub fingerprint: u64,
    pub scope: Option<TenantScope>,
}

/// Why an assertion is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AssertionError {
    /// Not of the format above.
    Malformed,
    /// The code does not verify (another secret, or the request was changed).
    BadCode,
    /// Issued outside the window around this clock.
    Expired { skew_ms: u64 },
    /// This worker has no secret to check it with.
    NoSecret,
}

impl std::error::Error for AssertionError {}

impl std::fmt::Display for AssertionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed => write!(f, "the {ASSERTION_HEADER} header is malformed"),
            Self::BadCode => write!(f, "the {ASSERTION_HEADER} header does not verify for this request"),
            Self::Expired { skew_ms } => write!(
                f,
                "the {ASSERTION_HEADER} header was issued {skew_ms} ms away from this worker's clock (at most \
                 {ASSERTION_WINDOW_MS} ms)"
            ),
            Self::NoSecret => write!(f, "this worker has no --report-secret to check {ASSERTION_HEADER} with"),
        }
    }
}

fn kind_char(scope: Option<&TenantScope>) -> &'static str {
    match scope {
        None => "-",
        Some(s) if s.forced => "f",
        Some(_) => "c",
    }
}

fn code(secret: &str, a: &Assertion<'_>) -> blake3::Hash {
    let key = blake3::derive_key(ASSERTION_CONTEXT, secret.as_bytes());
    let mut h = blake3::Hasher::new_keyed(&key);
    let mut part = |b: &[u8]| {
        h.update(&(b.len() as u32).to_le_bytes());
        h.update(b);
    };
    part(b"v1");
    part(&a.issued_ms.to_le_bytes());
    part(&a.fingerprint.to_le_bytes());
    part(a.scope.map_or("-", |s| s.id.as_str()).as_bytes());
    part(kind_char(a.scope).as_bytes());
    part(a.model.as_bytes());
    part(&[u8::from(a.salt.is_some())]);
    part(a.salt.unwrap_or("").as_bytes());
    part(&[u8::from(a.ids.is_some())]);
    part(a.ids.map_or([0u8; 32], |ids| *blake3::hash(ids.as_bytes()).as_bytes()).as_slice());
    h.finalize()
}

/// The header value of `a` under `secret`.
pub fn sign(secret: &str, a: &Assertion<'_>) -> String {
    format!(
        "v1.{}.{:016x}.{}.{}.{}",
        a.issued_ms,
        a.fingerprint,
        a.scope.map_or("-", |s| s.id.as_str()),
        kind_char(a.scope),
        code(secret, a).to_hex()
    )
}

/// Checks the header value `header` for the request as the worker read it (`model`, `salt`, the `ids` field) at
/// `now_ms`, under `secret`.
pub fn verify(
    secret: Option<&str>,
    header: &str,
    model: &str,
    salt: Option<&str>,
    ids: Option<&str>,
    now_ms: u64,
) -> Result<Verified, AssertionError> {
    let secret = secret.ok_or(AssertionError::NoSecret)?;
    if header.len() > MAX_ASSERTION_BYTES {
        return Err(AssertionError::Malformed);
    }
    let parts: Vec<&str> = header.split('.').collect();
    let [version, issued, fp, scope, kind, mac] = parts[..] else {
        return Err(AssertionError::Malformed);
    };
    let is_hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if version != "v1" || !is_hex(fp, 16) || !is_hex(mac, 64) {
        return Err(AssertionError::Malformed);
    }
    let issued_ms: u64 = issued.parse().map_err(|_| AssertionError::Malformed)?;
    let fingerprint = u64::from_str_radix(fp, 16).map_err(|_| AssertionError::Malformed)?;
    let scope = match (scope, kind) {
        ("-", "-") => None,
        (id, "f" | "c") if is_hex(id, 32) => Some(TenantScope { id: id.to_owned(), forced: kind == "f" }),
        _ => return Err(AssertionError::Malformed),
    };
    let a = Assertion { issued_ms, fingerprint, scope: scope.as_ref(), model, salt, ids };
    let given = blake3::Hash::from_hex(mac).map_err(|_| AssertionError::Malformed)?;
    // `blake3::Hash` compares in constant time.
    if given != code(secret, &a) {
        return Err(AssertionError::BadCode);
    }
    let skew_ms = now_ms.abs_diff(issued_ms);
    if skew_ms > ASSERTION_WINDOW_MS {
        return Err(AssertionError::Expired { skew_ms });
    }
    Ok(Verified { fingerprint, scope })
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

/// Header naming the prefill worker a decode worker fetches a request's KV from (`host:port` of its KV transfer
/// listener), for prefill/decode disaggregation. Honoured only with a valid [`PREFILL_GRANT_HEADER`].
pub const PREFILL_PEER_HEADER: &str = "x-kvgate-prefill-peer";
/// Header carrying the gateway's grant for [`PREFILL_PEER_HEADER`]: `v2.<issued: unix ms>.<nonce: 16 hex>.<prompt
/// digest: 32 hex>.<mac: 64 hex>`, mac = keyed BLAKE3 under [`grant_key`] of "v2", issued, nonce, model, peer, the
/// decode worker's id and the prompt's digest (each length-prefixed). No client can make a worker dial an address
/// of its choosing; a grant serves one request (the prompt it was made for, on the decode worker it was made for:
/// the prefill worker recomputes the code from the Hello's prompt) and one transfer (the prefill worker keeps the
/// codes it served for the window). The digest travels in clear so that a decode worker whose own tokens differ
/// from the gateway's can tell that case (it computes the request whole) from a forged grant.
pub const PREFILL_GRANT_HEADER: &str = "x-kvgate-prefill-grant";
/// Longest prefill peer address accepted.
pub const MAX_PEER_BYTES: usize = 256;
/// Longest decode worker id a grant names.
pub const MAX_WORKER_ID_BYTES: usize = 128;

const GRANT_CONTEXT: &str = "kvgate 2026-12 prefill peer grant v2";
const TRANSFER_CONTEXT: &str = "kvgate 2026-12 kv transfer v1";

/// The key KV transfer handshakes are authenticated with (both workers derive it from the report secret).
pub fn transfer_key(secret: &str) -> [u8; 32] {
    blake3::derive_key(TRANSFER_CONTEXT, secret.as_bytes())
}

/// The key prefill grants are made and checked with (gateways and workers derive it from the report secret).
pub fn grant_key(secret: &str) -> [u8; 32] {
    blake3::derive_key(GRANT_CONTEXT, secret.as_bytes())
}

/// What a prefill grant lets: the decode worker `decode` serving `model` fetch the KV of `prompt` from `peer`.
/// A link probe's grant names no prompt (empty) and no decode worker ("").
#[derive(Clone, Copy, Debug)]
pub struct GrantFor<'a> {
    pub model: &'a str,
    pub peer: &'a str,
    pub decode: &'a str,
    pub prompt: &'a [u32],
}

/// The first 16 bytes of the BLAKE3 of a prompt's token ids (u32 LE), as a grant carries them.
pub fn prompt_digest(prompt: &[u32]) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    h.update(&(prompt.len() as u64).to_le_bytes());
    for t in prompt {
        h.update(&t.to_le_bytes());
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

fn grant_code(
    key: &[u8; 32],
    issued_ms: u64,
    nonce: u64,
    g: &GrantFor<'_>,
    digest: &[u8; 16],
) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    let (issued, nonce) = (issued_ms.to_le_bytes(), nonce.to_le_bytes());
    let parts: [&[u8]; 7] =
        [b"v2", &issued, &nonce, g.model.as_bytes(), g.peer.as_bytes(), g.decode.as_bytes(), digest];
    for part in parts {
        h.update(&(part.len() as u32).to_le_bytes());
        h.update(part);
    }
    h.finalize()
}

fn hex_bytes<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The [`PREFILL_GRANT_HEADER`] value for `g`, issued at `issued_ms` with a `nonce` of the gateway's.
pub fn sign_prefill_grant(secret: &str, issued_ms: u64, nonce: u64, g: &GrantFor<'_>) -> String {
    let digest = prompt_digest(g.prompt);
    let mac = grant_code(&grant_key(secret), issued_ms, nonce, g, &digest);
    format!("v2.{issued_ms}.{nonce:016x}.{}.{}", to_hex(&digest), mac.to_hex())
}

/// A verified grant: its code (what a prefill worker remembers to serve it once) and when it was issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granted {
    pub code: [u8; 32],
    pub issued_ms: u64,
}

/// Why a grant was not honoured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("{0}")]
    Assertion(#[from] AssertionError),
    /// It verifies for another prompt (its digest is not this prompt's): a grant for another request, or this
    /// worker tokenized the prompt otherwise than the gateway did.
    #[error("the grant was made for another prompt")]
    OtherPrompt,
}

/// Checks a [`PREFILL_GRANT_HEADER`] value for `g` at `now_ms` (within [`ASSERTION_WINDOW_MS`]) under `key`
/// ([`grant_key`]).
pub fn verify_prefill_grant_with(
    key: &[u8; 32],
    grant: &str,
    g: &GrantFor<'_>,
    now_ms: u64,
) -> Result<Granted, GrantError> {
    if g.peer.len() > MAX_PEER_BYTES
        || g.decode.len() > MAX_WORKER_ID_BYTES
        || grant.len() > MAX_ASSERTION_BYTES
    {
        return Err(AssertionError::Malformed.into());
    }
    let parts: Vec<&str> = grant.split('.').collect();
    let ["v2", issued, nonce, digest, mac] = parts[..] else {
        return Err(AssertionError::Malformed.into());
    };
    let issued_ms: u64 = issued.parse().map_err(|_| AssertionError::Malformed)?;
    let nonce = u64::from_str_radix(nonce, 16).map_err(|_| AssertionError::Malformed)?;
    let digest = hex_bytes::<16>(digest).ok_or(AssertionError::Malformed)?;
    let given = blake3::Hash::from_hex(mac).map_err(|_| AssertionError::Malformed)?;
    if given != grant_code(key, issued_ms, nonce, g, &digest) {
        return Err(AssertionError::BadCode.into());
    }
    let skew_ms = now_ms.abs_diff(issued_ms);
    if skew_ms > ASSERTION_WINDOW_MS {
        return Err(AssertionError::Expired { skew_ms }.into());
    }
    if digest != prompt_digest(g.prompt) {
        return Err(GrantError::OtherPrompt);
    }
    Ok(Granted { code: *given.as_bytes(), issued_ms })
}

/// [`verify_prefill_grant_with`] under the key of `secret` (`NoSecret` without one).
pub fn verify_prefill_grant(
    secret: Option<&str>,
    grant: &str,
    g: &GrantFor<'_>,
    now_ms: u64,
) -> Result<Granted, GrantError> {
    let secret = secret.ok_or(AssertionError::NoSecret)?;
    verify_prefill_grant_with(&grant_key(secret), grant, g, now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_grant_binds_model_peer_decode_worker_prompt_and_time() {
        let prompt = [1u32, 2, 3];
        let g = GrantFor { model: "m", peer: "10.0.0.1:9000", decode: "d0", prompt: &prompt };
        let grant = sign_prefill_grant("s", 1_000_000, 7, &g);
        let ok = verify_prefill_grant(Some("s"), &grant, &g, 1_000_000).expect("verifies");
        assert_eq!(ok.issued_ms, 1_000_000);
        let other = sign_prefill_grant("s", 1_000_000, 8, &g);
        assert_ne!(
            verify_prefill_grant(Some("s"), &other, &g, 1_000_000).expect("ok").code,
            ok.code,
            "a nonce each"
        );
        let bad = Err(GrantError::Assertion(AssertionError::BadCode));
        for wrong in [
            GrantFor { peer: "10.0.0.2:9000", ..g },
            GrantFor { model: "n", ..g },
            GrantFor { decode: "d1", ..g },
        ] {
            assert_eq!(verify_prefill_grant(Some("s"), &grant, &wrong, 1_000_000), bad, "{wrong:?}");
        }
        assert_eq!(verify_prefill_grant(Some("t"), &grant, &g, 1_000_000), bad);
        let longer = [1u32, 2, 3, 4];
        assert_eq!(
            verify_prefill_grant(Some("s"), &grant, &GrantFor { prompt: &longer, ..g }, 1_000_000),
            Err(GrantError::OtherPrompt)
        );
        assert!(matches!(
            verify_prefill_grant(Some("s"), &grant, &g, 1_000_000 + ASSERTION_WINDOW_MS + 1),
            Err(GrantError::Assertion(AssertionError::Expired { .. }))
        ));
        assert_eq!(
            verify_prefill_grant(None, &grant, &g, 1_000_000),
            Err(GrantError::Assertion(AssertionError::NoSecret))
        );
        assert_eq!(
            verify_prefill_grant(Some("s"), "v2.x.y.z.w", &g, 0),
            Err(GrantError::Assertion(AssertionError::Malformed))
        );
        assert!(verify_prefill_grant(Some("s"), &grant.replacen("v2", "v1", 1), &g, 1_000_000).is_err());
        assert_ne!(transfer_key("s"), transfer_key("t"));
    }

    fn assertion<'a>(scope: Option<&'a TenantScope>, ids: Option<&'a str>) -> Assertion<'a> {
        Assertion { issued_ms: 1_000_000, fingerprint: 0xabc, scope, model: "m", salt: Some("s"), ids }
    }

    #[test]
    fn an_assertion_verifies_only_for_the_request_it_was_made_for() {
        let scope = TenantScope::new("team-a", true);
        let enc = encode_ids(&[1, 2, 3]);
        let a = assertion(Some(&scope), Some(&enc));
        let h = sign("s3cret", &a);
        let ok = verify(Some("s3cret"), &h, "m", Some("s"), Some(&enc), 1_000_500).expect("verifies");
        assert_eq!(ok, Verified { fingerprint: 0xabc, scope: Some(scope.clone()) });
        // Every input is bound.
        let bad =
            |secret, model, salt, ids: Option<&str>| verify(Some(secret), &h, model, salt, ids, 1_000_500);
        assert_eq!(bad("other", "m", Some("s"), Some(&enc)), Err(AssertionError::BadCode));
        assert_eq!(bad("s3cret", "m2", Some("s"), Some(&enc)), Err(AssertionError::BadCode));
        assert_eq!(bad("s3cret", "m", Some("t"), Some(&enc)), Err(AssertionError::BadCode));
        assert_eq!(bad("s3cret", "m", None, Some(&enc)), Err(AssertionError::BadCode));
        assert_eq!(bad("s3cret", "m", Some("s"), Some(&encode_ids(&[1, 2]))), Err(AssertionError::BadCode));
        assert_eq!(bad("s3cret", "m", Some("s"), None), Err(AssertionError::BadCode));
        // The scope, kind, fingerprint and time in the header are bound too.
        let forged_kind = h.replacen(".f.", ".c.", 1);
        assert_eq!(
            verify(Some("s3cret"), &forged_kind, "m", Some("s"), Some(&enc), 1_000_500),
            Err(AssertionError::BadCode)
        );
        let forged_time = h.replacen("v1.1000000.", "v1.1000001.", 1);
        assert_eq!(
            verify(Some("s3cret"), &forged_time, "m", Some("s"), Some(&enc), 1_000_500),
            Err(AssertionError::BadCode)
        );
        // Outside the window either way.
        let late =
            verify(Some("s3cret"), &h, "m", Some("s"), Some(&enc), 1_000_000 + ASSERTION_WINDOW_MS + 1);
        assert!(matches!(late, Err(AssertionError::Expired { .. })));
        let early = verify(Some("s3cret"), &h, "m", Some("s"), Some(&enc), 0);
        assert!(matches!(early, Err(AssertionError::Expired { .. })));
        assert_eq!(verify(None, &h, "m", Some("s"), Some(&enc), 1_000_500), Err(AssertionError::NoSecret));
        for junk in ["", "v1", "v2.1.0000000000000abc.-.-.00", &"v1.".repeat(100), &h.replacen("v1", "v2", 1)]
        {
            assert_eq!(
                verify(Some("s3cret"), junk, "m", None, None, 0),
                Err(AssertionError::Malformed),
                "{junk}"
            );
        }
    }

    #[test]
    fn without_scope_or_ids_the_code_still_binds_model_and_salt() {
        let a = Assertion { issued_ms: 5, fingerprint: 1, scope: None, model: "m", salt: None, ids: None };
        let h = sign("k", &a);
        assert!(h.contains(".-.-."), "{h}");
        assert_eq!(verify(Some("k"), &h, "m", None, None, 5), Ok(Verified { fingerprint: 1, scope: None }));
        assert_eq!(verify(Some("k"), &h, "m", Some("x"), None, 5), Err(AssertionError::BadCode));
    }

    #[test]
    fn tokens_salts_and_scopes_are_keyed_and_separated() {
        let t = gateway_token("s3cret");
        assert_eq!(t.len(), 64);
        assert!(check_gateway_token("s3cret", Some(&format!("Bearer {t}"))));
        assert!(!check_gateway_token("other", Some(&format!("Bearer {t}"))));
        assert!(!check_gateway_token("s3cret", Some(&t)), "a bearer, not a bare token");
        assert!(!check_gateway_token("s3cret", None));
        assert_ne!(gateway_token("s3cret"), hex(&blake3::derive_key(ASSERTION_CONTEXT, b"s3cret")));
        // A forced salt, the same salt sent by the tenant's client, and another tenant's: all different, and none
        // is the salt itself.
        let forced = tenant_salt(Some("k"), "team-a", true, "team-a");
        let client = tenant_salt(Some("k"), "team-a", false, "team-a");
        let other = tenant_salt(Some("k"), "team-b", true, "team-a");
        assert!(forced != client && forced != other && client != other);
        assert!(forced.starts_with("kvgate-salt-v1:") && forced.len() == 15 + 32);
        assert_ne!(tenant_salt(Some("k2"), "team-a", true, "team-a"), forced, "keyed by the secret");
        // Length-prefixed: moving a boundary between tenant and salt changes it.
        assert_ne!(tenant_salt(None, "ab", true, "c"), tenant_salt(None, "a", true, "bc"));
        assert_eq!(scope_id("team-a").len(), 32);
        assert_ne!(scope_id("team-a"), scope_id("team-b"));
    }

    #[test]
    fn ids_round_trip() {
        let ids = vec![0, 1, 128_000, u32::MAX, 42];
        let enc = encode_ids(&ids);
        assert_eq!(decode_ids(&enc), Some(ids));
        assert_eq!(decode_ids("not base64!"), None);
        assert_eq!(decode_ids(&STANDARD.encode([1u8, 2, 3])), None, "not a whole number of ids");
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
