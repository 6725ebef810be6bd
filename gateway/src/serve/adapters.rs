//! The placement stage of LoRA adapter requests ([`place`], between admission and routing): loads an adapter where
//! `kvgate_router::placement` says before the request goes there. Which `model` names an adapter is `prepare.rs`'s
//! (`resolve_adapter`); the catalogue and its locks are `lora_catalog.rs`'s.
//!
//! A load is a pod's own `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`, vLLM's API, which kvgate
//! workers answer too), with a credential for that call for a kvgate worker (`kvgate_shared::credential`, made with
//! the report secret: the static gateway token loads nothing) or `--lora-load-token` for another pod, to the pod's
//! URL (a data-parallel rank's without its `#dpN`), within
//! `--lora-load-timeout`. Its latency is measured into the registry (the placement's `load` term); a failure keeps
//! that pod from being asked again for that adapter for a while (`FAILED_LOAD_BACKOFF`).
//!
//! Invariants: one load of an adapter at a time per gateway (a cold adapter's burst waits for the one load, then
//! finds the holder; a hot adapter's spread is skipped while one is running, its requests going to the holders);
//! the lock map holds catalogue names only (a client cannot grow it); a request pinned to the worker that loaded
//! its adapter is routed within that one worker (`Incoming::subset`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use kvgate_router::placement::{place as placement, Choice, Placement};
use kvgate_router::registry::WorkerRef;

use crate::errors::{ApiError, GatewayErrors};
use crate::serve::host::ServeHost;
use crate::serve::lora_catalog::AdapterRef;
use crate::serve::stages::{Incoming, Prepared};

/// Largest answer read from a load call.
const MAX_LOAD_ANSWER_BYTES: usize = 64 * 1024;
/// The pods' load call (vLLM's).
const LOAD_PATH: &str = "/v1/load_lora_adapter";

/// The placement stage: for an adapter request, loads its adapter first where placement says, and pins the
/// request there. Returns the placement (explain and the logs show it); `None` for a request without an adapter.
pub async fn place(
    host: &Arc<dyn ServeHost>,
    prep: &Prepared,
    incoming: &mut Incoming,
) -> Result<Option<Placement>, ApiError> {
    let Some(adapter) = prep.prompt.as_ref().and_then(|p| p.adapter.clone()) else { return Ok(None) };
    let loads = host.adapter_loads();
    let loadable = loads.path(&adapter.name).is_some();
    let decide = |incoming: &Incoming| {
        let reg = host.registry();
        placement(&reg, &incoming.within(prep.route_input()), loadable, &loads.place, Instant::now())
    };
    if host.cfg().lora_anywhere {
        return anywhere(host, prep, incoming, &adapter).await;
    }
    let Some(mut p) = decide(incoming) else { return Ok(None) };
    // Held until this request's load (if any) is over: one load of an adapter at a time.
    let mut _one = None;
    if let Choice::Load { reason, .. } = &p.choice {
        let lock = loads.lock_for(&adapter.name);
        _one = Some(match *reason {
            // A copy beside busy holders is an optimisation: not while another load of it runs.
            "hot" => match lock.try_lock_owned() {
                Ok(g) => g,
                Err(_) => return Ok(Some(Placement { choice: Choice::Holders, ..p })),
            },
            _ => lock.lock_owned().await,
        });
        // Decided again: the load this request waited for may have made a holder.
        p = decide(incoming).unwrap_or(p);
    }
    match &p.choice {
        Choice::Holders => {}
        Choice::Nowhere => return Err(ApiError::no_worker(&prep.model)),
        Choice::Load { wref, worker, url, reason } => {
            let path = loads.path(&adapter.name).unwrap_or_default();
            match load(host, *wref, url, &adapter.name, path, reason).await {
                Ok(()) => incoming.subset = Some(vec![kvgate_router::input::url_address(url).to_owned()]),
                Err(e) => {
                    let holders = p.terms.iter().any(|t| t.holds);
                    tracing::warn!(adapter = %adapter.name, %worker, error = %e, holders, "adapter load failed");
                    if !holders {
                        return Err(ApiError::unavailable(
                            "adapter_load_failed",
                            format!(
                                "the adapter {:?} could not be loaded on a pod ({e}); retry later",
                                adapter.name
                            ),
                        ));
                    }
                    p.choice = Choice::Holders;
                }
            }
        }
    }
    Ok(Some(p))
}

/// `--lora-placement anywhere`: the policy's pick among all the model's workers, as if the adapter did not matter;
/// the adapter is loaded there first when it lacks it.
async fn anywhere(
    host: &Arc<dyn ServeHost>,
    prep: &Prepared,
    incoming: &mut Incoming,
    adapter: &AdapterRef,
) -> Result<Option<Placement>, ApiError> {
    let pick = |incoming: &Incoming| {
        let reg = host.registry();
        let input = kvgate_router::route::RouteInput { adapter: None, ..incoming.within(prep.route_input()) };
        let c = host.router().dry_run(&reg, &input, 1, Instant::now())?.candidates.into_iter().next()?;
        let holds =
            reg.workers().iter().any(|w| w.uid == c.wref.uid && w.lora.holds(&adapter.name, Instant::now()));
        Some((c, holds))
    };
    let (c, holds) = pick(incoming).ok_or_else(|| ApiError::no_worker(&prep.model))?;
    let choice = match holds {
        true => Choice::Holders,
        false => {
            let path =
                host.adapter_loads().path(&adapter.name).ok_or_else(|| ApiError::no_worker(&prep.model))?;
            let lock = host.adapter_loads().lock_for(&adapter.name);
            let _one = lock.lock_owned().await;
            if !pick(incoming).is_some_and(|(again, h)| again.wref == c.wref && h) {
                load(host, c.wref, &c.url, &adapter.name, path, "anywhere").await.map_err(|e| {
                    ApiError::unavailable(
                        "adapter_load_failed",
                        format!(
                            "the adapter {:?} could not be loaded on a pod ({e}); retry later",
                            adapter.name
                        ),
                    )
                })?;
            }
            Choice::Load { wref: c.wref, worker: c.id.clone(), url: c.url.clone(), reason: "anywhere" }
        }
    };
    incoming.subset = Some(vec![kvgate_router::input::url_address(&c.url).to_owned()]);
    Ok(Some(Placement { adapter: adapter.name.clone(), choice, terms: Vec::new() }))
}

/// Counts a load in `kvgate_gateway_lora_loads_running` until it is dropped (a request whose client left mid-load
/// drops it too).
struct Running;

impl Running {
    fn start() -> Self {
        metrics::gauge!("kvgate_gateway_lora_loads_running").increment(1.0);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        metrics::gauge!("kvgate_gateway_lora_loads_running").decrement(1.0);
    }
}

/// Why a load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadFailure {
    #[error("no answer within --lora-load-timeout")]
    Timeout,
    #[error("{0}")]
    Connect(String),
    #[error("HTTP {status}: {body}")]
    Refused { status: u16, body: String },
}

/// Loads `name` from `path` on the worker at `url` and records the outcome and its latency in the registry.
async fn load(
    host: &Arc<dyn ServeHost>,
    wref: WorkerRef,
    url: &str,
    name: &str,
    path: &str,
    reason: &str,
) -> Result<(), LoadFailure> {
    let started = Instant::now();
    let running = Running::start();
    let outcome = call(host.as_ref(), wref, url, name, path).await;
    drop(running);
    let secs = started.elapsed().as_secs_f64();
    let label = if outcome.is_ok() { "loaded" } else { "failed" };
    metrics::counter!("kvgate_gateway_lora_loads_total", "outcome" => label, "reason" => reason.to_owned())
        .increment(1);
    metrics::histogram!("kvgate_gateway_lora_load_seconds").record(secs);
    tracing::info!(adapter = name, url, reason, secs, outcome = label, "adapter load");
    let recorded = outcome.as_ref().map(|k| k.clone()).map_err(|_| ());
    let mut reg = host.registry();
    reg.record_adapter_load(wref, name, recorded, secs, Instant::now());
    // A pod that refuses the connection is down: out of the ring until a probe or a report brings it back, as a
    // refused request's would be.
    if matches!(outcome, Err(LoadFailure::Connect(_))) {
        reg.record_fault(wref, kvgate_router::registry::Fault::Refused, Instant::now());
    }
    drop(reg);
    outcome.map(|_| ())
}

/// The load call; `Ok(key)`: the key a kvgate worker answered (a vLLM pod answers text: `None`). A vLLM pod that
/// already holds it answers 400 "already been loaded": that is a load.
async fn call(
    host: &dyn ServeHost,
    wref: WorkerRef,
    url: &str,
    name: &str,
    path: &str,
) -> Result<Option<String>, LoadFailure> {
    let reports = host.registry().workers().iter().any(|w| w.uid == wref.uid && w.report.is_some());
    let body = serde_json::json!({"lora_name": name, "lora_path": path}).to_string();
    // A kvgate worker gets a credential for this call alone (its body: this name, this path), which only a
    // gateway holding the report secret can make: the static gateway token loads nothing.
    let token = match (reports, host.cfg().report_secret.as_deref()) {
        (true, Some(secret)) => {
            let r = kvgate_shared::credential::RequestFor {
                path: LOAD_PATH,
                body: body.as_bytes(),
                salt_header: None,
            };
            Some(kvgate_shared::credential::sign_request(secret, kvgate_shared::credential::now_ms(), &r))
        }
        _ => host.cfg().lora_load_token.clone(),
    };
    // A data-parallel rank's URL names its pod and rank (`#dpN`): the pod loads the adapter for all its ranks.
    let pod = crate::pods::dp_rank::base(url);
    let mut req = hyper::Request::post(format!("{pod}{LOAD_PATH}"))
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(v) = token.and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
        req = req.header(AUTHORIZATION, v);
    }
    let req = req
        .body(http_body_util::Full::new(Bytes::from(body)))
        .map_err(|e| LoadFailure::Connect(e.to_string()))?;
    let timeout = host.cfg().lora_load_timeout;
    let answer = async {
        let resp = host.client().request(req).await.map_err(|e| LoadFailure::Connect(e.to_string()))?;
        let status = resp.status().as_u16();
        let limited = http_body_util::Limited::new(resp.into_body(), MAX_LOAD_ANSWER_BYTES);
        let body = limited.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        Ok::<_, LoadFailure>((status, String::from_utf8_lossy(&body).into_owned()))
    };
    let (status, body) = tokio::time::timeout(timeout, answer).await.map_err(|_| LoadFailure::Timeout)??;
    match status {
        200..=299 => {
            let key = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["key"].as_str().map(str::to_owned))
                .filter(|k| kvgate_shared::report::HeldAdapter::key_is_valid(name, k));
            Ok(key)
        }
        400 if body.contains("already been loaded") => Ok(None),
        _ => Err(LoadFailure::Refused { status, body: body.chars().take(200).collect() }),
    }
}
