//! What a worker gets besides the body, written once for every endpoint: the client headers passed on, and for
//! kvgate workers the gateway's token, its signed assertion of the request's tenant scope, salt, model, fingerprint
//! and handed-off ids (`kvgate_shared::handoff`), a split's prefill grant, and the body with the prompt's ids
//! (`--prompt-handoff`).
//!
//! Invariants: a pod that is not a kvgate worker never gets the gateway's token or assertion, and gets the client's
//! `authorization` only with `--forward-authorization`; with a report secret, a kvgate worker never gets the
//! client's `authorization` (it gets the gateway's token; without a secret, which needs `--insecure-reports`, it is
//! sent what any pod is);
//! through an endpoint picker's proxy a kvgate worker gets a per-request credential, never the token
//! (`Outbound::per_request`); the salt header is dropped when a tenant's salt replaced it in the body; a data-parallel rank header is only ever
//! the gateway's (`upstream/send.rs`).

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use kvgate_router::route::Candidate;
use kvgate_shared::{credential, handoff};

use crate::config::GatewayConfig;
use crate::serve::prepare::{PreparedRequest, CACHE_SALT_HEADER, SESSION_HEADER};
use crate::serve::stages::{Header, Incoming, Prepared};

/// The client headers a worker may get (the read stage keeps these, `Incoming::forwardable`).
pub const FORWARDABLE: [&str; 4] = [SESSION_HEADER, "accept", CACHE_SALT_HEADER, "authorization"];

/// The client headers workers get: the session id, the cache salt (unless a keyed caller's tenant salt replaced
/// it; the body carries that), `accept`, and `authorization` only with `--forward-authorization` to pods that are
/// not kvgate workers (`foreign`).
pub fn forwarded_headers(
    cfg: &GatewayConfig,
    incoming: &Incoming,
    salt_rewritten: bool,
    foreign: bool,
) -> Vec<Header> {
    incoming
        .forwardable
        .iter()
        .filter(|(n, _)| match *n {
            CACHE_SALT_HEADER => !salt_rewritten,
            "authorization" => cfg.forward_authorization && foreign,
            _ => true,
        })
        .map(|(n, v)| (HeaderName::from_static(n), v.clone()))
        .collect()
}

/// The gateway's token for kvgate workers.
fn token(secret: &str) -> Option<Header> {
    let v = HeaderValue::from_str(&format!("Bearer {}", handoff::gateway_token(secret))).ok()?;
    Some((hyper::header::AUTHORIZATION, v))
}

/// What a gateway adds for a kvgate worker: its token, and its assertion of the tokenized request's tenant scope,
/// salt, model, fingerprint and handed-off ids (`ids`: the field's value), issued now.
pub fn gateway_headers(secret: &str, p: &PreparedRequest, ids: Option<&str>) -> Vec<Header> {
    let assertion = handoff::Assertion {
        issued_ms: credential::now_ms(),
        fingerprint: p.fingerprint,
        scope: p.scope.as_ref(),
        model: &p.fields.model,
        salt: p.salt.as_deref(),
        ids,
    };
    let mut out = Vec::with_capacity(2);
    out.extend(token(secret));
    if let Ok(v) = HeaderValue::from_str(&handoff::sign(secret, &assertion)) {
        out.push((HeaderName::from_static(handoff::ASSERTION_HEADER), v));
    }
    out
}

/// The decode worker's headers of a split: the prefill peer and the gateway's grant for it (for this prompt and
/// this decode worker, one use: `kvgate_shared::handoff::PREFILL_GRANT_HEADER`).
pub fn split_headers(secret: &str, g: &handoff::GrantFor<'_>) -> Vec<Header> {
    let nonce = u64::from_le_bytes(kvgate_shared::trace::new_id::<8>());
    let grant = handoff::sign_prefill_grant(secret, credential::now_ms(), nonce, g);
    [(handoff::PREFILL_PEER_HEADER, g.peer.to_owned()), (handoff::PREFILL_GRANT_HEADER, grant)]
        .into_iter()
        .filter_map(|(n, v)| Some((HeaderName::from_static(n), HeaderValue::from_str(&v).ok()?)))
        .collect()
}

/// The body with the handoff field, and the field's value, when the handoff is on (`--prompt-handoff`), the
/// gateway has a report secret (shared with its workers), the prompt was tokenized here (chat or text) and the
/// body stays within `--max-body-bytes` (workers are expected to allow at least as much). Used only for kvgate
/// workers whose reported fingerprint is the gateway's.
pub fn handoff(cfg: &GatewayConfig, p: &PreparedRequest) -> Option<(Bytes, String)> {
    cfg.report_secret.as_deref()?;
    if !cfg.prompt_handoff || !p.tokenized || p.ids.is_empty() {
        return None;
    }
    let encoded = handoff::encode_ids(&p.ids);
    if p.body.len() + encoded.len() + 32 > cfg.max_body_bytes {
        return None;
    }
    let body = handoff::with_ids_field(&p.body, &encoded)?;
    Some((Bytes::from(body), encoded))
}

/// What every attempt of one request shares: its headers for kvgate workers and for other pods, the handoff.
pub struct Outbound<'a> {
    cfg: &'a GatewayConfig,
    prep: &'a Prepared,
    kvgate_pool: bool,
    forwarded: Vec<Header>,
    to_kvgate: Vec<Header>,
    handoff: Option<(Bytes, String)>,
}

impl<'a> Outbound<'a> {
    /// Pods that are not kvgate workers get the client's headers (and `authorization` with
    /// --forward-authorization); kvgate workers get the gateway's token (and, for a tokenized prompt, its
    /// assertion and the ids computed here when their tokenizer is the gateway's) instead.
    pub fn new(cfg: &'a GatewayConfig, incoming: &Incoming, prep: &'a Prepared, kvgate_pool: bool) -> Self {
        Self {
            cfg,
            prep,
            kvgate_pool,
            forwarded: forwarded_headers(cfg, incoming, prep.salt_rewritten, true),
            to_kvgate: forwarded_headers(cfg, incoming, prep.salt_rewritten, false),
            handoff: prep.prompt.as_ref().and_then(|p| handoff(cfg, p)),
        }
    }

    /// The body and headers for candidate `t`; `split_peer`: the prefill peer of a split's decode worker.
    pub fn for_candidate(&self, t: &Candidate, split_peer: Option<&str>) -> (&Bytes, Vec<Header>) {
        let secret = match self.cfg.report_secret.as_deref() {
            Some(s) if self.kvgate_pool => s,
            _ => return (&self.prep.body, self.forwarded.clone()),
        };
        let mut h = self.to_kvgate.clone();
        let Some(p) = &self.prep.prompt else {
            h.extend(token(secret));
            return (&self.prep.body, h);
        };
        let ids = self.handoff.as_ref().filter(|_| t.reports && t.fingerprint_ok);
        h.extend(gateway_headers(secret, p, ids.map(|(_, enc)| enc.as_str())));
        if let Some(peer) = split_peer {
            let g = handoff::GrantFor { model: &p.fields.model, peer, decode: &t.id, prompt: &p.ids };
            h.extend(split_headers(secret, &g));
        }
        let body = match ids {
            Some((body, _)) => body,
            None => &self.prep.body,
        };
        (body, h)
    }

    /// [`Self::for_candidate`]'s body and headers with the gateway's token replaced by a credential for this
    /// request alone (its `path`, body and salt header: `kvgate_shared::credential`), for a proxy that carries the
    /// request to the worker (the endpoint picker's): nothing it is handed serves another request or an admin call.
    pub fn per_request(&self, t: &Candidate, split_peer: Option<&str>, path: &str) -> (&Bytes, Vec<Header>) {
        let (body, mut h) = self.for_candidate(t, split_peer);
        let Some(secret) = self.cfg.report_secret.as_deref().filter(|_| self.kvgate_pool) else {
            return (body, h);
        };
        h.retain(|(n, _)| n != hyper::header::AUTHORIZATION);
        let salt = h.iter().find(|(n, _)| n == CACHE_SALT_HEADER).map(|(_, v)| v.as_bytes());
        let r = credential::RequestFor { path, body, salt_header: salt };
        let bearer = format!("Bearer {}", credential::sign_request(secret, credential::now_ms(), &r));
        if let Ok(v) = HeaderValue::from_str(&bearer) {
            h.push((hyper::header::AUTHORIZATION, v));
        }
        (body, h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GatewayArgs;
    use crate::registry::WorkerRef;

    fn cfg(flags: &[&str]) -> GatewayConfig {
        let mut args = vec!["g", "--report-secret", "s"];
        args.extend_from_slice(flags);
        GatewayArgs::from_iter_args(args).expect("flags").resolve().expect("config")
    }

    fn incoming() -> Incoming {
        let caller = std::sync::Arc::new(crate::control::keys::Caller::anonymous());
        let v = |s: &str| HeaderValue::from_str(s).expect("value");
        Incoming {
            path: "/v1/embeddings".into(),
            caller,
            cache_salt: Some("salt".into()),
            session: Some("s1".into()),
            class: None,
            forwardable: vec![
                (SESSION_HEADER, v("s1")),
                ("accept", v("application/json")),
                (CACHE_SALT_HEADER, v("salt")),
                ("authorization", v("Bearer client-key")),
            ],
            subset: None,
        }
    }

    fn names(h: &[Header]) -> Vec<String> {
        h.iter().map(|(n, _)| n.as_str().to_owned()).collect()
    }

    #[test]
    fn a_clients_authorization_reaches_only_foreign_pods_and_only_when_asked() {
        let inc = incoming();
        let off = cfg(&[]);
        let on = cfg(&["--forward-authorization", "true"]);
        assert!(!names(&forwarded_headers(&off, &inc, false, true)).contains(&"authorization".into()));
        assert!(names(&forwarded_headers(&on, &inc, false, true)).contains(&"authorization".into()));
        assert!(!names(&forwarded_headers(&on, &inc, false, false)).contains(&"authorization".into()));
        // A tenant's salt replaced the client's in the body: the client's salt header is not passed on.
        assert!(names(&forwarded_headers(&off, &inc, false, true)).contains(&CACHE_SALT_HEADER.into()));
        assert!(!names(&forwarded_headers(&off, &inc, true, true)).contains(&CACHE_SALT_HEADER.into()));
        assert!(names(&forwarded_headers(&off, &inc, true, true)).contains(&SESSION_HEADER.into()));
    }

    #[test]
    fn a_kvgate_worker_gets_the_gateways_token_and_a_pod_the_clients_headers() {
        let (c, inc) = (cfg(&["--forward-authorization", "true"]), incoming());
        let prep = Prepared {
            model: "m".into(),
            body: Bytes::from_static(b"{}"),
            stream: false,
            salt_rewritten: false,
            prompt_tokens: 1,
            prompt_cap: 1,
            choices: 1,
            reasoning: false,
            max_output: None,
            generates: false,
            max_model_len: None,
            strip_usage: false,
            prompt: None,
        };
        let t = Candidate {
            wref: WorkerRef { idx: 0, uid: 1 },
            id: "w".into(),
            url: "http://127.0.0.1:1".into(),
            reports: true,
            fingerprint_ok: true,
        };
        let token = format!("Bearer {}", handoff::gateway_token("s"));
        let auth = |h: &[Header]| -> Vec<String> {
            h.iter()
                .filter(|(n, _)| n == hyper::header::AUTHORIZATION)
                .map(|(_, v)| v.to_str().unwrap_or("").to_owned())
                .collect()
        };
        let to_kvgate = Outbound::new(&c, &inc, &prep, true);
        let (body, h) = to_kvgate.for_candidate(&t, None);
        assert_eq!(body, &prep.body);
        assert_eq!(
            auth(&h),
            vec![token],
            "the gateway's token, never the client's, and no assertion without a prompt"
        );
        assert!(!names(&h).contains(&handoff::ASSERTION_HEADER.into()));
        let (_, h) = Outbound::new(&c, &inc, &prep, false).for_candidate(&t, None);
        assert_eq!(
            auth(&h),
            vec!["Bearer client-key".to_owned()],
            "a vLLM pod: the client's, as --forward-authorization asks"
        );
    }
}
