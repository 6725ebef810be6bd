//! kvgate-gateway: public OpenAI listener (pingora) + control listener (reports, metrics).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kvgate_gateway::config::{GatewayArgs, WorkerKind};
use kvgate_gateway::control::IngestQueue;
use kvgate_gateway::serve::listener::{ConnLimits, PublicListener};
use kvgate_gateway::serve::proxy::Gateway;
use kvgate_gateway::state::GatewayState;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use pingora::server::configuration::ServerConf;
use pingora::server::Server;

fn main() -> ExitCode {
    let cfg = match GatewayArgs::from_command_line().resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvgate-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if cfg.log_json {
        fmt.json().init();
    } else {
        fmt.init();
    }
    let buckets = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0];
    let prometheus = match PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
        .and_then(|b| b.install_recorder())
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!("kvgate-gateway: metrics: {e}");
            return ExitCode::FAILURE;
        }
    };
    if cfg.admin_token.is_none() {
        tracing::warn!("no --admin-token: the admin API is off");
    }
    if cfg.report_secret.is_none() {
        tracing::warn!("--insecure-reports: reports are accepted without authentication");
    }
    let state = match GatewayState::new(cfg.clone(), prometheus) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("kvgate-gateway: {e}");
            return ExitCode::from(2);
        }
    };

    let queue = match IngestQueue::spawn(state.clone()) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("kvgate-gateway: cannot start report ingest: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Control listener and background work on their own runtime.
    let control_state = state.clone();
    let control_addr = cfg.control_listen.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvgate-control".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::bind(&control_addr).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot listen on {control_addr}: {e}")));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                // Static workers: learn their tokenizer and id, retrying until each answers.
                let s = control_state.clone();
                tokio::spawn(async move {
                    let mut pending: Vec<String> = s.cfg.workers.clone();
                    let kvgate_pools = s.cfg.models.iter().filter(|m| m.kind == WorkerKind::Kvgate);
                    pending.extend(kvgate_pools.flat_map(|m| m.workers.iter().cloned()));
                    while !pending.is_empty() {
                        let mut left = Vec::new();
                        for url in pending {
                            if let Err(e) = s.fetch_tokenizer(&url).await {
                                if s.is_refused(&url) {
                                    tracing::error!(error = %e, "static worker refused");
                                    continue;
                                }
                                tracing::debug!(error = %e, "static worker not ready yet");
                                left.push(url);
                            }
                        }
                        pending = left;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                });
                tokio::spawn(kvgate_gateway::control::upkeep(control_state.clone()));
                kvgate_gateway::pods::vllm_subscriber::spawn_all(&control_state);
                kvgate_gateway::pods::scrape::spawn_all(&control_state);
                kvgate_gateway::pods::discovery::spawn_all(&control_state);
                tokio::spawn(kvgate_gateway::replicas::sync::run(control_state.clone()));
                tokio::spawn(kvgate_gateway::replicas::budgets::run(control_state.clone()));
                let app = kvgate_gateway::control::router(control_state, queue)
                    .into_make_service_with_connect_info::<std::net::SocketAddr>();
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(error = %e, "control listener failed");
                }
            });
        })
        .ok();
    match ready_rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            eprintln!("kvgate-gateway: {e}");
            return ExitCode::FAILURE;
        }
        Err(_) => {
            eprintln!("kvgate-gateway: the control listener did not start");
            return ExitCode::FAILURE;
        }
    }

    if let Some(addr) = &cfg.epp_listen {
        if let Err(e) = kvgate_gateway::epp::spawn(state.clone(), addr, cfg.epp_max_streams, cfg.threads) {
            let retry = if e.retryable() { " (starting again may succeed)" } else { "" };
            eprintln!("kvgate-gateway: endpoint picker: {e}{retry}");
            return ExitCode::FAILURE;
        }
        println!("kvgate-gateway endpoint picker (ext_proc, gRPC) listening on {addr}");
    }
    let conf = ServerConf {
        threads: cfg.threads,
        pid_file: std::env::temp_dir()
            .join(format!("kvgate-gateway-{}.pid", std::process::id()))
            .display()
            .to_string(),
        upgrade_sock: std::env::temp_dir()
            .join(format!("kvgate-gateway-{}.sock", std::process::id()))
            .display()
            .to_string(),
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(cfg.shutdown_grace.as_secs().max(1)),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let proxy = pingora::proxy::http_proxy(&server.configuration, Gateway { host: state });
    let limits = ConnLimits {
        max_connections: cfg.max_connections,
        header_read_timeout: cfg.header_read_timeout,
        keepalive_timeout: cfg.keepalive_timeout,
    };
    match PublicListener::bind(&cfg.listen, proxy, limits, cfg.threads) {
        Ok(l) => {
            server.add_service(l);
        }
        Err(e) => {
            eprintln!("kvgate-gateway: cannot listen on {}: {e}", cfg.listen);
            return ExitCode::FAILURE;
        }
    }
    println!(
        "kvgate-gateway listening on http://{} (control http://{}), policy {}",
        cfg.listen, cfg.control_listen, cfg.policy
    );
    server.run_forever()
}
