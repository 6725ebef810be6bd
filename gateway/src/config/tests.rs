//! Configuration: defaults, precedence (flags over the file over defaults), validation.

use super::*;
use std::str::FromStr;

fn secured() -> GatewayArgs {
    GatewayArgs { report_secret: Some("s".into()), ..Default::default() }
}

#[test]
fn models_come_from_flags_or_the_toml_file_and_are_checked() {
    let a =
        GatewayArgs::from_iter_args(["g", "--model", "m1=/tok/m1", "--model", "m2=/tok/m2"]).expect("flags");
    let m = a.models.clone().expect("models");
    assert_eq!((m[0].name.as_str(), m[0].block_size, m[0].kind), ("m1", 16, WorkerKind::Kvgate));
    assert_eq!(m[1].tokenizer, PathBuf::from("/tok/m2"));
    assert!("no-equals".parse::<ModelSpec>().is_err());
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("g.toml");
    std::fs::write(
        &path,
        "[[models]]\nname = \"llama\"\ntokenizer = \"/t\"\nkind = \"vllm\"\nblock-size = 32\n\
         workers = [\"http://10.0.0.1:8000\"]\n",
    )
    .expect("write");
    let cfg = GatewayArgs { config: Some(path.clone()), ..secured() }.resolve().expect("toml");
    assert_eq!(cfg.models[0].kind, WorkerKind::Vllm);
    assert_eq!((cfg.models[0].block_size, cfg.models[0].workers.len()), (32, 1));
    std::fs::write(&path, "[[models]]\nname = \"x\"\ntokenizer = \"/t\"\nkind = \"tgi\"\n").expect("write");
    assert!(GatewayArgs { config: Some(path.clone()), ..secured() }.resolve().is_err(), "unknown kind");
    let bad = GatewayArgs {
        models: Some(vec![
            ModelSpec { block_size: 0, ..ModelSpec::from_str("a=/t").expect("a") },
            ModelSpec { workers: vec!["ftp://x".into()], ..ModelSpec::from_str("a=/t").expect("a") },
        ]),
        ..secured()
    };
    let err = bad.resolve().and_then(|c| c.validate()).expect_err("bad models");
    assert!(err.contains("block-size 0") && err.contains("unique") && err.contains("ftp://x"), "{err}");
    // A pod's own event endpoints: read from the TOML, checked (tcp:// only, a vllm or sglang pool).
    std::fs::write(
        &path,
        "[[models]]\nname = \"v\"\ntokenizer = \"/t\"\nkind = \"vllm\"\nworkers = [\"http://10.0.0.1:8000\"]\n\
         [[models.kv-events-pods]]\nworker = \"http://10.0.0.1:8000\"\nendpoint = \"tcp://10.0.0.1:5560\"\n",
    )
    .expect("write");
    let cfg = GatewayArgs { config: Some(path.clone()), ..secured() }.resolve().expect("toml");
    assert!(cfg.models[0].kv_events_sources, "asking the pods is the default");
    assert_eq!(cfg.models[0].kv_events_pods[0].endpoint, "tcp://10.0.0.1:5560");
    cfg.validate().expect("valid");
    let pods = |kind: WorkerKind, endpoint: &str| GatewayConfig {
        models: vec![ModelSpec {
            kind,
            kv_events_pods: vec![crate::config::PodEvents {
                worker: "http://10.0.0.1:8000".into(),
                endpoint: endpoint.into(),
                replay: None,
                topic: None,
            }],
            ..cfg.models[0].clone()
        }],
        ..cfg.clone()
    };
    let err = pods(WorkerKind::Vllm, "http://10.0.0.1:5560").validate().expect_err("not tcp");
    assert!(err.contains("tcp:// endpoints"), "{err}");
    let err = pods(WorkerKind::Openai, "tcp://10.0.0.1:5560").validate().expect_err("not vllm");
    assert!(err.contains("need kind vllm or sglang"), "{err}");
}

#[test]
fn a_worker_url_may_name_a_data_parallel_rank_only_in_a_vllm_pool() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("g.toml");
    let cfg = |kind: &str, worker: &str| {
        std::fs::write(
            &path,
            format!(
                "[[models]]\nname = \"m\"\ntokenizer = \"/t\"\nkind = \"{kind}\"\nworkers = [\"{worker}\"]\n"
            ),
        )
        .expect("write");
        GatewayArgs { config: Some(path.clone()), ..secured() }.resolve()
    };
    assert!(cfg("vllm", "http://10.0.0.1:8000#dp1").is_ok());
    for (kind, worker) in [
        ("openai", "http://10.0.0.1:8000#dp1"),
        ("vllm", "http://10.0.0.1:8000#dp64"),
        ("vllm", "http://10.0.0.1:8000#rank1"),
    ] {
        assert!(cfg(kind, worker).is_err(), "{kind} {worker}");
    }
}

#[test]
fn a_redis_user_name_without_a_password_is_refused() {
    let with = |url: &str, password: Option<&str>| {
        let a = GatewayArgs {
            redis_url: Some(url.into()),
            redis_username: Some("kvgate".into()),
            redis_password: password.map(str::to_owned),
            ..secured()
        };
        a.resolve().and_then(|c| c.validate())
    };
    let err = with("redis://127.0.0.1:6379", None).expect_err("no password");
    assert!(err.contains("redis-username needs a password"), "{err}");
    assert!(with("redis://u@127.0.0.1:6379/0", None).is_err(), "a user in the URL is no password");
    assert!(with("redis://127.0.0.1:6379", Some("pw")).is_ok());
    assert!(with("redis://:pw@127.0.0.1:6379", None).is_ok());
    assert!(with("rediss://u:pw@h:6380/1", None).is_ok());
}

#[test]
fn no_report_secret_is_refused_unless_insecure_reports() {
    let err = GatewayArgs::default().resolve().expect_err("no secret");
    assert!(err.contains("report secret"), "{err}");
    let cfg = GatewayArgs { insecure_reports: Some(true), ..Default::default() }.resolve().expect("insecure");
    assert!(cfg.insecure_reports && cfg.report_secret.is_none());
}

#[test]
fn first_byte_timeout_scales_with_uncached_tokens_and_output_between_floor_and_cap() {
    let t = FirstByteTimeout {
        floor: Duration::from_secs(2),
        per_prompt_token: Duration::from_millis(1),
        per_output_token: Duration::from_millis(10),
        cap: Duration::from_secs(20),
    };
    assert_eq!(t.for_request(0, 100, true), Duration::from_secs(2));
    assert_eq!(t.for_request(3000, 100, true), Duration::from_secs(5));
    assert_eq!(t.for_request(3000, 100, false), Duration::from_secs(6));
    assert_eq!(t.for_request(10_000_000, 0, true), Duration::from_secs(20));
    // A route predicted from measured speeds stretches it to twice the prediction, never past the cap, never
    // below the formula; a prediction that is not a number changes nothing.
    let base = t.for_request(3000, 100, true);
    assert_eq!(t.stretched(base, Some(4.0)), Duration::from_secs(8));
    assert_eq!(t.stretched(base, Some(1.0)), base);
    assert_eq!(t.stretched(base, Some(1e9)), Duration::from_secs(20));
    for bad in [None, Some(f64::NAN), Some(f64::INFINITY), Some(-3.0)] {
        assert_eq!(t.stretched(base, bad), base);
    }
}

#[test]
fn defaults_validate_and_problems_are_listed() {
    let cfg = secured().resolve().expect("defaults");
    assert_eq!(cfg.max_body_bytes, 8 << 20);
    assert!(!cfg.forward_authorization);
    assert_eq!(cfg.listen, "0.0.0.0:8080");
    assert_eq!(cfg.policy, kvgate_router::routing::DEFAULT_POLICY);
    assert_eq!(cfg.stale_after, Duration::from_secs(3));
    let err = GatewayArgs {
        policy: Some("random".into()),
        listen: Some("nowhere".into()),
        advertise_allow: Some(vec!["10.0.0.0/99".into()]),
        ..secured()
    }
    .resolve()
    .expect_err("bad");
    assert!(err.contains("policy") && err.contains("listen") && err.contains("advertise-allow"), "{err}");
}

#[test]
fn toml_then_flags() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("g.toml");
    std::fs::write(&path, "policy = \"least_load\"\nworkers = [\"http://a:1\"]\n[weights]\nw_ring = 0.9\n")
        .expect("w");
    let cfg =
        GatewayArgs { config: Some(path.clone()), w_load: Some(0.1), ..secured() }.resolve().expect("ok");
    assert_eq!(cfg.policy, "least_load");
    assert_eq!(cfg.workers, vec!["http://a:1".to_string()]);
    assert_eq!(cfg.weights.w_ring, 0.9);
    assert_eq!(cfg.weights.w_load, 0.1);
    let cfg = GatewayArgs { config: Some(path), policy: Some("round_robin".into()), ..secured() }
        .resolve()
        .expect("ok");
    assert_eq!(cfg.policy, "round_robin");
}

#[test]
fn a_default_is_written_once_and_loses_to_the_file_which_loses_to_a_flag() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("g.toml");
    std::fs::write(&path, "report-secret = \"s\"\nstale-after = \"7s\"\nvnodes = 8\n").expect("write");
    let p = path.to_str().expect("path");
    let cfg = GatewayArgs::from_iter_args(["g", "--config", p]).expect("flags").resolve().expect("ok");
    assert_eq!((cfg.stale_after, cfg.vnodes), (Duration::from_secs(7), 8), "the file beats clap's defaults");
    assert_eq!(cfg.dead_after, Duration::from_secs(10), "the declared default");
    let cfg = GatewayArgs::from_iter_args(["g", "--config", p, "--stale-after", "9s"])
        .expect("flags")
        .resolve()
        .expect("ok");
    assert_eq!(cfg.stale_after, Duration::from_secs(9), "a flag beats the file");
    // The same defaults without clap (a struct built in code).
    assert_eq!(secured().resolve().expect("ok").dead_after, Duration::from_secs(10));
}

#[test]
fn the_committed_configuration_reference_is_what_the_flags_declare() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/gateway.md");
    kvgate_shared::settings::check_reference(&path, &GatewayArgs::reference())
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_picker_off_loopback_must_say_who_may_drive_it() {
    let resolve = |flags: &[&str]| {
        let mut args = vec!["g", "--report-secret", "s"];
        args.extend_from_slice(flags);
        GatewayArgs::from_iter_args(args).expect("flags").resolve().and_then(|c| c.validate().map(|()| c))
    };
    let e = resolve(&["--epp-listen", "0.0.0.0:9002"]).expect_err("anyone could drive it");
    assert!(e.contains("--epp-token") && e.contains("--epp-trust-network"), "{e}");
    assert!(resolve(&["--epp-listen", "127.0.0.1:9002"]).is_ok(), "loopback: only this host's processes");
    assert!(resolve(&["--epp-listen", "[::1]:9002"]).is_ok());
    let c = resolve(&["--epp-listen", "0.0.0.0:9002", "--epp-token", "0123456789abcdef"]).expect("a token");
    assert_eq!(c.epp_auth.token.as_deref(), Some("0123456789abcdef"));
    assert!(resolve(&["--epp-listen", "0.0.0.0:9002", "--epp-trust-network"]).is_ok());
    let e = resolve(&["--epp-listen", "0.0.0.0:9002", "--epp-token", "short"]).expect_err("too short");
    assert!(e.contains("at least 16"), "{e}");
    let e = resolve(&["--epp-listen", "0.0.0.0:9002", "--epp-client-ca", "/ca.pem"]).expect_err("no TLS");
    assert!(e.contains("epp-tls-cert"), "{e}");
    let c = resolve(&[
        "--epp-listen",
        "0.0.0.0:9002",
        "--epp-client-ca",
        "/ca.pem",
        "--epp-tls-cert",
        "/c",
        "--epp-tls-key",
        "/k",
    ])
    .expect("mutual TLS");
    assert_eq!(c.epp_auth.client_ca, Some(PathBuf::from("/ca.pem")));
    assert_eq!(c.epp_max_buffered_bytes, DEFAULT_EPP_MAX_BUFFERED_BYTES);
}
