//! Control-port auth pieces shared by report ingest and the admin API: the bearer token of a request, constant-time
//! secret comparison, and the error both answer with (kvgate's one `ApiError`, through its axum adapter).

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::errors::ApiError;

/// An OpenAI-shaped error response (`type` from the status: authentication, permission, server or request error).
pub fn error_response(status: StatusCode, code: &'static str, msg: String) -> Response {
    let kind = match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    ApiError::new(status.as_u16(), kind, code, msg).into_response()
}

/// Constant-time comparison of secrets.
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "))
}
