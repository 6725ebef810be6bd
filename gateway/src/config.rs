//! Gateway configuration: flags with environment fallbacks (`KVGATE_GATEWAY_*`) over a TOML file (`--config`)
//! over defaults; precedence defaults < TOML < environment < flags. `validate()` runs at start and lists every
//! problem. Every field's default is in its doc comment (`kvgate-gateway --help`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use crate::admission::{default_classes, ClassConfig};
use crate::routing::{Weights, POLICIES};

/// Flags (and environment) of `kvgate-gateway`. `None` = not given here.
#[derive(Parser, Debug, Default, Clone, Deserialize)]
#[command(
    name = "kvgate-gateway",
    version,
    about = "kvgate: an OpenAI-compatible gateway that routes by KV cache"
)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct GatewayArgs {
    /// TOML file with any of these settings (kebab-case keys; weights under `[weights]`).
    #[arg(long, env = "KVGATE_GATEWAY_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Public listener (OpenAI API). Default 0.0.0.0:8080.
    #[arg(long, env = "KVGATE_GATEWAY_LISTEN")]
    pub listen: Option<String>,
    /// Control listener (metrics, report ingest, admin). Default 0.0.0.0:8081.
    #[arg(long, env = "KVGATE_GATEWAY_CONTROL_LISTEN")]
    pub control_listen: Option<String>,
    /// Static worker base URL (repeatable; env: comma-separated). Workers also register by reporting.
    #[arg(long = "worker", env = "KVGATE_GATEWAY_WORKERS", value_delimiter = ',')]
    pub workers: Option<Vec<String>>,
    /// Routing policy: cache_aware, round_robin, least_load, consistent_hash. Default cache_aware.
    #[arg(long, env = "KVGATE_GATEWAY_POLICY")]
    pub policy: Option<String>,
    /// Shared secret workers send with reports (`Authorization: Bearer`). Default none: reports are accepted
    /// without authentication (a warning is logged at start).
    #[arg(long, env = "KVGATE_REPORT_SECRET", hide_env_values = true)]
    pub report_secret: Option<String>,
    /// No report for this long: the worker's cache summary is ignored. Default 3s.
    #[arg(long, env = "KVGATE_GATEWAY_STALE_AFTER")]
    pub stale_after: Option<String>,
    /// No report for this long (or refused connections): the worker leaves the ring until it reports again.
    /// Default 10s.
    #[arg(long, env = "KVGATE_GATEWAY_DEAD_AFTER")]
    pub dead_after: Option<String>,
    /// How long what this gateway routed to a worker counts as cached there (the overlay). Default 3s.
    #[arg(long, env = "KVGATE_GATEWAY_OVERLAY_TTL")]
    pub overlay_ttl: Option<String>,
    /// Virtual nodes per worker on the ring. Default 64.
    #[arg(long, env = "KVGATE_GATEWAY_VNODES")]
    pub vnodes: Option<u32>,
    /// Largest request body in bytes; beyond it 413. Default 32 MiB.
    #[arg(long, env = "KVGATE_GATEWAY_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Timeout to connect to a worker. Default 1s.
    #[arg(long, env = "KVGATE_GATEWAY_CONNECT_TIMEOUT")]
    pub connect_timeout: Option<String>,
    /// Worker threads of the proxy. Default 2.
    #[arg(long, env = "KVGATE_GATEWAY_THREADS")]
    pub threads: Option<usize>,
    /// On SIGTERM, how long requests in flight get to finish before the proxy exits. Default 10s.
    #[arg(long, env = "KVGATE_GATEWAY_SHUTDOWN_GRACE")]
    pub shutdown_grace: Option<String>,
    /// Scoring weights of cache_aware (TOML `[weights]`; see routing/cache_aware.rs for the formula).
    #[arg(skip)]
    pub weights: Option<Weights>,
    /// cache_aware prefix weight. Default 1.0.
    #[arg(long, env = "KVGATE_GATEWAY_W_PREFIX")]
    #[serde(skip)]
    pub w_prefix: Option<f64>,
    /// cache_aware ring weight. Default 0.3.
    #[arg(long, env = "KVGATE_GATEWAY_W_RING")]
    #[serde(skip)]
    pub w_ring: Option<f64>,
    /// cache_aware load weight. Default 0.5.
    #[arg(long, env = "KVGATE_GATEWAY_W_LOAD")]
    #[serde(skip)]
    pub w_load: Option<f64>,
    /// Logs as JSON lines.
    #[arg(long, env = "KVGATE_GATEWAY_LOG_JSON")]
    pub log_json: Option<bool>,
    /// Bearer token of the admin API (control listener). Default none: the admin routes are off (404).
    #[arg(long, env = "KVGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// File where admin changes (weights, budgets) are kept across restarts. Default none (changes are lost on
    /// restart; the Helm chart sets one).
    #[arg(long, env = "KVGATE_GATEWAY_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// Request classes and their token budgets (TOML `[[classes]]`; default: short / long / reasoning, see
    /// admission/classes.rs).
    #[arg(skip)]
    pub classes: Option<Vec<ClassConfig>>,
}

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    pub listen: String,
    pub control_listen: String,
    pub workers: Vec<String>,
    pub policy: String,
    pub report_secret: Option<String>,
    pub stale_after: Duration,
    pub dead_after: Duration,
    pub overlay_ttl: Duration,
    pub vnodes: u32,
    pub max_body_bytes: usize,
    pub connect_timeout: Duration,
    pub threads: usize,
    pub shutdown_grace: Duration,
    pub weights: Weights,
    pub log_json: bool,
    pub classes: Vec<ClassConfig>,
    pub admin_token: Option<String>,
    pub state_file: Option<PathBuf>,
}

fn duration(v: Option<String>, default: &str, name: &str) -> Result<Duration, String> {
    kvgate_shared::duration::parse_duration(v.as_deref().unwrap_or(default))
        .map_err(|e| format!("--{name}: {e}"))
}

impl GatewayArgs {
    /// Merges flags/env over the TOML file over defaults and validates.
    pub fn resolve(self) -> Result<GatewayConfig, String> {
        let file = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                toml::from_str::<GatewayArgs>(&text).map_err(|e| format!("{}: {e}", p.display()))?
            }
            None => GatewayArgs::default(),
        };
        macro_rules! pick {
            ($f:ident) => {
                self.$f.clone().or(file.$f.clone())
            };
        }
        let mut weights = pick!(weights).unwrap_or_default();
        if let Some(v) = self.w_prefix {
            weights.w_prefix = v;
        }
        if let Some(v) = self.w_ring {
            weights.w_ring = v;
        }
        if let Some(v) = self.w_load {
            weights.w_load = v;
        }
        let cfg = GatewayConfig {
            listen: pick!(listen).unwrap_or_else(|| "0.0.0.0:8080".into()),
            control_listen: pick!(control_listen).unwrap_or_else(|| "0.0.0.0:8081".into()),
            workers: pick!(workers).unwrap_or_default().into_iter().filter(|w| !w.is_empty()).collect(),
            policy: pick!(policy).unwrap_or_else(|| "cache_aware".into()),
            report_secret: pick!(report_secret).filter(|s| !s.is_empty()),
            stale_after: duration(pick!(stale_after), "3s", "stale-after")?,
            dead_after: duration(pick!(dead_after), "10s", "dead-after")?,
            overlay_ttl: duration(pick!(overlay_ttl), "3s", "overlay-ttl")?,
            vnodes: pick!(vnodes).unwrap_or(64),
            max_body_bytes: pick!(max_body_bytes).unwrap_or(32 << 20),
            connect_timeout: duration(pick!(connect_timeout), "1s", "connect-timeout")?,
            shutdown_grace: duration(pick!(shutdown_grace), "10s", "shutdown-grace")?,
            threads: pick!(threads).unwrap_or(2),
            weights,
            log_json: pick!(log_json).unwrap_or(false),
            classes: pick!(classes).unwrap_or_else(default_classes),
            admin_token: pick!(admin_token).filter(|t| !t.is_empty()),
            state_file: pick!(state_file),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl GatewayConfig {
    /// Every problem at once.
    pub fn validate(&self) -> Result<(), String> {
        let mut p = Vec::new();
        if !POLICIES.contains(&self.policy.as_str()) {
            p.push(format!("policy {:?} is not one of {}", self.policy, POLICIES.join(", ")));
        }
        for (name, addr) in [("listen", &self.listen), ("control-listen", &self.control_listen)] {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                p.push(format!("{name} {addr:?} is not an address like 0.0.0.0:8080"));
            }
        }
        for w in &self.workers {
            if !w.starts_with("http://") {
                p.push(format!("worker {w:?} is not an http:// URL"));
            }
        }
        if self.stale_after > self.dead_after {
            p.push("stale-after must not exceed dead-after".into());
        }
        if self.vnodes == 0 || self.threads == 0 {
            p.push("vnodes and threads must be at least 1".into());
        }
        if self.max_body_bytes < 1024 {
            p.push("max-body-bytes must be at least 1024".into());
        }
        p.extend(self.weights.validate());
        p.extend(crate::admission::classes::validate(&self.classes));
        if p.is_empty() {
            Ok(())
        } else {
            Err(format!("invalid configuration: {}", p.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_problems_are_listed() {
        let cfg = GatewayArgs::default().resolve().expect("defaults");
        assert_eq!(cfg.listen, "0.0.0.0:8080");
        assert_eq!(cfg.policy, "cache_aware");
        assert_eq!(cfg.stale_after, Duration::from_secs(3));
        let err = GatewayArgs {
            policy: Some("random".into()),
            listen: Some("nowhere".into()),
            ..Default::default()
        }
        .resolve()
        .expect_err("bad");
        assert!(err.contains("policy") && err.contains("listen"), "{err}");
    }

    #[test]
    fn toml_then_flags() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("g.toml");
        std::fs::write(
            &path,
            "policy = \"least_load\"\nworkers = [\"http://a:1\"]\n[weights]\nw_ring = 0.9\n",
        )
        .expect("w");
        let cfg = GatewayArgs { config: Some(path.clone()), w_load: Some(0.1), ..Default::default() }
            .resolve()
            .expect("ok");
        assert_eq!(cfg.policy, "least_load");
        assert_eq!(cfg.workers, vec!["http://a:1".to_string()]);
        assert_eq!(cfg.weights.w_ring, 0.9);
        assert_eq!(cfg.weights.w_load, 0.1);
        let cfg =
            GatewayArgs { config: Some(path), policy: Some("round_robin".into()), ..Default::default() }
                .resolve()
                .expect("ok");
        assert_eq!(cfg.policy, "round_robin");
    }
}
