//! The GET routes the gateway answers itself: `/v1/models` and `/v1/models/{id}` (the models some healthy worker
//! serves now and their LoRA adapters: the gateway knows the pools; 404 `model_not_found` for any other id) and
//! `/health`.
//!
//! Invariants: the model routes identify the caller as a POST does (401 without a key under `--require-api-key`)
//! and list only what its key may use (a key's `models`): one tenant's adapters are not another's to see.

use std::time::Instant;

use bytes::Bytes;
use kvgate_shared::openai::{ModelCard, ModelList};

use crate::errors::{ApiError, GatewayErrors};
use crate::serve::downstream::{write_json, Downstream, HeadError};
use crate::serve::exchange;
use crate::serve::host::ServeHost;
use crate::serve::stages::Ctx;

/// `GET /v1/models/{id}` (an id may hold slashes).
const MODEL_PATH: &str = "/v1/models/";

/// Answers `GET path`, or 404 for a path that is not one of these.
pub async fn answer<D: Downstream>(
    host: &dyn ServeHost,
    down: &mut D,
    ctx: &mut Ctx,
    path: &str,
) -> Result<(), ApiError> {
    let body = match path {
        "/health" => "{\"status\":\"ok\"}".to_owned(),
        "/v1/models" => {
            let caller =
                exchange::identify(host, path, down.header_str("authorization"), |n| down.header(n))?.caller;
            let data = model_cards(host).into_iter().filter(|c| caller.allows(&c.id)).collect();
            to_json(&ModelList { object: "list".into(), data })?
        }
        p if p.starts_with(MODEL_PATH) => {
            let caller =
                exchange::identify(host, path, down.header_str("authorization"), |n| down.header(n))?.caller;
            let id = &p[MODEL_PATH.len()..];
            let card = model_cards(host).into_iter().find(|c| c.id == id && caller.allows(&c.id));
            to_json(&card.ok_or_else(|| ApiError::model_not_found(id))?)?
        }
        _ => return Err(ApiError::not_found_route(path)),
    };
    ctx.status = 200;
    match write_json(down, 200, Bytes::from(body)).await {
        Ok(()) | Err(HeadError::Gone) => Ok(()),
        Err(HeadError::Invalid(e)) => Err(ApiError::internal(e)),
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, ApiError> {
    serde_json::to_string(v).map_err(|e| ApiError::internal(e.to_string()))
}

/// The cards of the models some healthy worker serves now, then their LoRA adapters (`parent`: the base model):
/// those a healthy worker holds, and those of the `--lora` catalogue (loaded on a pod when first asked for).
fn model_cards(host: &dyn ServeHost) -> Vec<ModelCard> {
    let now = Instant::now();
    let (models, mut adapters) = {
        let reg = host.registry();
        let models: Vec<(String, Option<u32>)> =
            reg.models(now).into_iter().map(|m| (m.clone(), reg.max_model_len(&m))).collect();
        (models, reg.adapters(now))
    };
    let base = host.cfg().lora_base.clone().or_else(|| match models.as_slice() {
        [(one, _)] => Some(one.clone()),
        _ => None,
    });
    for name in host.adapter_loads().names() {
        if let (Some(b), false) = (&base, adapters.iter().any(|(a, _)| *a == name)) {
            adapters.push((name, b.clone()));
        }
    }
    adapters.sort();
    let len = |m: &str| models.iter().find(|(id, _)| id == m).and_then(|(_, l)| *l);
    let card = |id: String, parent: Option<String>| ModelCard {
        max_model_len: len(parent.as_deref().unwrap_or(&id)),
        parent,
        id,
        object: "model".into(),
        created: 0,
        owned_by: "kvgate".into(),
        device: None,
        role: None,
    };
    let bases = models.iter().map(|(m, _)| card(m.clone(), None));
    bases.chain(adapters.into_iter().map(|(a, b)| card(a, Some(b)))).collect()
}
