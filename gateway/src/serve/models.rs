//! The GET routes the gateway answers itself: `/v1/models` and `/v1/models/{id}` (the models some healthy worker
//! serves now: the gateway knows the pools; 404 `model_not_found` for any other id) and `/health`.

use std::time::Instant;

use bytes::Bytes;
use kvgate_shared::openai::{ModelCard, ModelList};

use crate::errors::{ApiError, GatewayErrors};
use crate::serve::downstream::{write_json, Downstream, HeadError};
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
        "/v1/models" => to_json(&ModelList { object: "list".into(), data: model_cards(host) })?,
        p if p.starts_with(MODEL_PATH) => {
            let id = &p[MODEL_PATH.len()..];
            let card = model_cards(host).into_iter().find(|c| c.id == id);
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

/// The cards of the models some healthy worker serves now.
fn model_cards(host: &dyn ServeHost) -> Vec<ModelCard> {
    let reg = host.registry();
    reg.models(Instant::now())
        .into_iter()
        .map(|id| ModelCard {
            parent: None,
            max_model_len: reg.max_model_len(&id),
            id,
            object: "model".into(),
            created: 0,
            owned_by: "kvgate".into(),
            device: None,
            role: None,
        })
        .collect()
}
