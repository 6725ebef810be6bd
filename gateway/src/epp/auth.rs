//! Who may drive the endpoint picker (`config::EppAuth`): a picker answers with picks, the headers a worker
//! trusts and an immediate answer of its choosing, and learns from what the proxy reports, so only the inference
//! gateway's own proxies may open a stream.
//!
//! - `--epp-token`: each ext_proc stream's gRPC metadata must carry `authorization: Bearer <token>` (compared in
//!   constant time), checked before the stream's first message is read; without it the stream ends
//!   `UNAUTHENTICATED` and nothing is held. The health service stays open (kubelets and Envoy's health checks
//!   probe it, and it says nothing but up or down).
//! - `--epp-client-ca`: mutual TLS; a connection without a client certificate that chains to the CA fails its
//!   handshake, before any stream.
//! - Neither: only on a loopback address, or with `--epp-trust-network` (config validation refuses the rest).
//!
//! What a stream can do once admitted is bounded elsewhere: its answers never carry the gateway's token
//! (`serve::outbound::Outbound::per_request`), and what it reports faults no pod (`serve::charge`).

use tonic::metadata::MetadataMap;
use tonic::Status;

/// Checks a stream's metadata against the configured token (`None`: no token asked for).
pub fn check(token: Option<&str>, metadata: &MetadataMap) -> Result<(), Status> {
    let Some(want) = token else { return Ok(()) };
    let given = metadata.get("authorization").and_then(|v| v.to_str().ok());
    if kvgate_shared::handoff::bearer_is(want, given) {
        return Ok(());
    }
    metrics::counter!("kvgate_gateway_epp_unauthenticated_total").increment(1);
    Err(Status::unauthenticated(
        "the endpoint picker takes streams only from its proxies: send gRPC metadata `authorization: Bearer \
         <--epp-token>` (Envoy: the ext_proc grpc_service's initial_metadata)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_configured_bearer_opens_a_stream() {
        let mut m = MetadataMap::new();
        assert!(check(None, &m).is_ok(), "no token configured");
        assert_eq!(
            check(Some("0123456789abcdef"), &m).expect_err("none sent").code(),
            tonic::Code::Unauthenticated
        );
        m.insert("authorization", "Bearer 0123456789abcdeX".parse().expect("value"));
        assert!(check(Some("0123456789abcdef"), &m).is_err(), "another token");
        m.insert("authorization", "Bearer 0123456789abcdef".parse().expect("value"));
        assert!(check(Some("0123456789abcdef"), &m).is_ok());
        m.insert("authorization", "0123456789abcdef".parse().expect("value"));
        assert!(check(Some("0123456789abcdef"), &m).is_err(), "not a bearer");
    }
}
