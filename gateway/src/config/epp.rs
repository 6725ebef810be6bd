//! The endpoint picker's side of the configuration: who may drive it (`--epp-token`, `--epp-client-ca`,
//! `--epp-trust-network`), and the rule that a picker on a non-loopback address must say so.

use std::path::PathBuf;

use super::GatewayConfig;

/// Default of `--epp-max-buffered-bytes`: 1 GiB.
pub const DEFAULT_EPP_MAX_BUFFERED_BYTES: usize = 1 << 30;
/// Shortest `--epp-token` accepted.
pub const MIN_EPP_TOKEN_CHARS: usize = 16;

/// Who may drive the endpoint picker (`epp/auth.rs` enforces it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EppAuth {
    /// The bearer token each stream's metadata must carry.
    pub token: Option<String>,
    /// PEM CA file the proxies' client certificates must chain to.
    pub client_ca: Option<PathBuf>,
    /// Neither, on a non-loopback address: the network is trusted to keep others out.
    pub trust_network: bool,
}

/// The endpoint picker's port is a way in: who may drive it must be said (`EppAuth`).
pub(super) fn problems(c: &GatewayConfig, p: &mut Vec<String>) {
    let Some(addr) = c.epp_listen.as_deref() else { return };
    let a = &c.epp_auth;
    if a.token.as_ref().is_some_and(|t| t.chars().count() < MIN_EPP_TOKEN_CHARS) {
        p.push(format!("epp-token must have at least {MIN_EPP_TOKEN_CHARS} characters"));
    }
    if a.client_ca.is_some() && c.epp_tls.is_none() {
        p.push("epp-client-ca needs epp-tls-cert and epp-tls-key (mutual TLS is TLS first)".into());
    }
    let loopback = addr.parse::<std::net::SocketAddr>().is_ok_and(|s| s.ip().is_loopback());
    if !loopback && a.token.is_none() && a.client_ca.is_none() && !a.trust_network {
        p.push(format!(
            "epp-listen {addr} is not a loopback address, and the endpoint picker would take requests (and hand out \
             picks) to whoever connects: give it --epp-token (the proxy sends it as gRPC metadata), \
             --epp-client-ca (mutual TLS), or --epp-trust-network true where a NetworkPolicy admits only the proxies"
        ));
    }
}
