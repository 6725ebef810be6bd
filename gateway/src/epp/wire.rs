//! The endpoint picker protocol's messages (GIE `docs/proposals/004-endpoint-picker-protocol`, over Envoy's
//! `envoy.service.ext_proc.v3`): what the proxy's [`ProcessingRequest`]s carry (headers, the subset hint, the
//! endpoint that served) and the [`ProcessingResponse`]s the picker answers with (the pick as a header and as
//! `envoy.lb` dynamic metadata, body chunks passed back, an immediate answer for a request that is refused).
//!
//! Pure: messages in, messages out. Invariants: the destination header and the `envoy.lb` metadata always carry the
//! same value (the pick, then its fallbacks, comma separated); a header a pod would trust that the client sent is
//! removed from what the pod gets unless the picker sets it itself; no streamed body message is larger than
//! [`MAX_BODY_MESSAGE_BYTES`] (a buffered body is answered in one message: the proxy sent it in one).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response::Response, BodyMutation, BodyResponse, CommonResponse,
    HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// An answer to the proxy.
pub type Message = ProcessingResponse;
pub use envoy_types::pb::envoy::service::ext_proc::v3::HeaderMutation;

/// The header the proxy routes by: the pick, then its fallbacks (`ip:port[,ip:port...]`).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace the pick is also written to, and the served endpoint read from.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The key (under [`LB_NAMESPACE`]) the proxy reports the endpoint that served the request with.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the candidate subset the proxy may pass.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset (under [`SUBSET_NAMESPACE`]): a list of `ip:port` (or one comma-separated string).
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The largest body chunk one response message carries (llm-d's picker sends 62,000-byte chunks; Envoy's own
/// body chunks are of that order).
pub const MAX_BODY_MESSAGE_BYTES: usize = 62_000;
/// Most endpoints a subset hint may name (the rest are ignored).
pub const MAX_SUBSET: usize = 1024;

/// How the proxy sends a body (its `processing_mode`, told in the first message's `protocol_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyMode {
    /// Not sent.
    None,
    /// Chunk by chunk, each answered with its (possibly replaced) chunk (`STREAMED`, `FULL_DUPLEX_STREAMED`).
    Streamed,
    /// Chunk by chunk, answered with streamed mutations whenever the picker is ready (`FULL_DUPLEX_STREAMED`).
    Duplex,
    /// Whole, after the headers were answered (`BUFFERED`).
    Buffered,
    /// A mode the picker does not serve (`BUFFERED_PARTIAL`: a body past the proxy's buffer never ends; any
    /// mode this build does not know).
    Unsupported,
}

impl BodyMode {
    fn of(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => Self::None,
            Ok(BodySendMode::Streamed) => Self::Streamed,
            Ok(BodySendMode::Buffered) => Self::Buffered,
            Ok(BodySendMode::FullDuplexStreamed) => Self::Duplex,
            _ => Self::Unsupported,
        }
    }
}

/// The request and response body modes the first message announces (`FULL_DUPLEX_STREAMED`, the protocol's
/// reference mode, when it does not).
pub fn body_modes(first: &ProcessingRequest) -> (BodyMode, BodyMode) {
    match &first.protocol_config {
        Some(p) => (BodyMode::of(p.request_body_mode), BodyMode::of(p.response_body_mode)),
        None => (BodyMode::Duplex, BodyMode::Duplex),
    }
}

/// The headers of a message, names lowercased, values as bytes (`raw_value`, else `value`); pseudo-headers
/// (`:path`, `:method`, `:status`) included.
pub fn header_list(h: &HttpHeaders) -> Vec<(String, Vec<u8>)> {
    let Some(map) = &h.headers else { return Vec::new() };
    map.headers
        .iter()
        .map(|v| {
            let value =
                if v.raw_value.is_empty() { v.value.as_bytes().to_vec() } else { v.raw_value.clone() };
            (v.key.to_ascii_lowercase(), value)
        })
        .collect()
}

/// One header's value as text.
pub fn header_text<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n == name).and_then(|(_, v)| std::str::from_utf8(v).ok())
}

fn string_of(v: &Value) -> Option<&str> {
    match &v.kind {
        Some(Kind::StringValue(s)) => Some(s),
        _ => None,
    }
}

/// `ip:port` entries of a string (comma separated) or a list of strings, trimmed, at most [`MAX_SUBSET`].
fn endpoints_of(v: &Value) -> Vec<String> {
    let items: Vec<&str> = match &v.kind {
        Some(Kind::StringValue(s)) => s.split(',').collect(),
        Some(Kind::ListValue(l)) => {
            l.values.iter().filter_map(string_of).flat_map(|s| s.split(',')).collect()
        }
        _ => Vec::new(),
    };
    items.into_iter().map(str::trim).filter(|s| !s.is_empty()).take(MAX_SUBSET).map(str::to_owned).collect()
}

fn metadata_value<'a>(md: Option<&'a Metadata>, namespace: &str, key: &str) -> Option<&'a Value> {
    md?.filter_metadata.get(namespace)?.fields.get(key)
}

/// The candidate subset the proxy allows, when it passed one (`None`: any endpoint), sorted and without
/// repeats (the router looks each worker up in it by binary search: `RouteInput::only`).
pub fn subset_hint(md: Option<&Metadata>) -> Option<Vec<String>> {
    metadata_value(md, SUBSET_NAMESPACE, SUBSET_KEY).map(|v| {
        let mut list = endpoints_of(v);
        list.sort_unstable();
        list.dedup();
        list
    })
}

/// The endpoint that served the request, when the proxy reported it.
pub fn served(md: Option<&Metadata>) -> Option<String> {
    metadata_value(md, LB_NAMESPACE, SERVED_KEY).and_then(|v| endpoints_of(v).into_iter().next())
}

fn set_header(name: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: name.to_owned(), raw_value: value.to_vec(), ..Default::default() }),
        // OVERWRITE_IF_EXISTS_OR_ADD
        append_action: 2,
        ..Default::default()
    }
}

/// A header mutation: `set` (overwriting), then `remove`.
pub fn mutation(set: &[(String, Vec<u8>)], remove: Vec<String>) -> HeaderMutation {
    HeaderMutation {
        set_headers: set.iter().map(|(n, v)| set_header(n, v)).collect(),
        remove_headers: remove,
    }
}

/// The `envoy.lb` dynamic metadata carrying the pick (the same value as the header).
fn lb_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION_HEADER.to_owned(),
            Value { kind: Some(Kind::StringValue(destination.to_owned())) },
        )]),
    };
    Struct {
        fields: HashMap::from([(LB_NAMESPACE.to_owned(), Value { kind: Some(Kind::StructValue(inner)) })]),
    }
}

/// What the request's headers get: the pick as header and metadata, and `headers` (the route cache cleared, so
/// the proxy routes again with the new header). `body`: in buffered mode the body (and the pick) answer the body
/// message; in streamed modes they answer the headers.
pub fn pick(
    destination: &str,
    headers: HeaderMutation,
    buffered_body: Option<Vec<u8>>,
) -> ProcessingResponse {
    let mut headers = headers;
    headers.set_headers.push(set_header(DESTINATION_HEADER, destination.as_bytes()));
    let common = |body_mutation| CommonResponse {
        header_mutation: Some(headers.clone()),
        body_mutation,
        clear_route_cache: true,
        ..Default::default()
    };
    let response = match buffered_body {
        Some(body) => Response::RequestBody(BodyResponse {
            response: Some(common(Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(body)),
            }))),
        }),
        None => Response::RequestHeaders(HeadersResponse { response: Some(common(None)) }),
    };
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: Some(lb_metadata(destination)),
        ..Default::default()
    }
}

/// Headers answered with no change (a buffered request's headers, before its body; a response's headers).
pub fn headers_continue(request: bool) -> ProcessingResponse {
    headers_with(request, None)
}

/// Headers answered with `m`.
pub fn headers_with(request: bool, m: Option<HeaderMutation>) -> ProcessingResponse {
    let r = HeadersResponse { response: Some(CommonResponse { header_mutation: m, ..Default::default() }) };
    let response = if request { Response::RequestHeaders(r) } else { Response::ResponseHeaders(r) };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// `body` as streamed body messages of at most [`MAX_BODY_MESSAGE_BYTES`] (`end`: the last one ends the body;
/// an empty body that ends is one empty message).
pub fn streamed_body(request: bool, body: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(MAX_BODY_MESSAGE_BYTES).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let s = StreamedBodyResponse {
                body: c.to_vec(),
                end_of_stream: end && i + 1 == n,
                ..Default::default()
            };
            body_response(request, body_mutation::Mutation::StreamedResponse(s))
        })
        .collect()
}

/// A (non-duplex) body chunk answered with `body` in its place.
pub fn replaced_body(request: bool, body: Vec<u8>) -> ProcessingResponse {
    body_response(request, body_mutation::Mutation::Body(body))
}

fn body_response(request: bool, m: body_mutation::Mutation) -> ProcessingResponse {
    let r = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation { mutation: Some(m) }),
            ..Default::default()
        }),
    };
    let response = if request { Response::RequestBody(r) } else { Response::ResponseBody(r) };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// Trailers answered with no change.
pub fn trailers_continue(request: bool) -> ProcessingResponse {
    let r = TrailersResponse::default();
    let response = if request { Response::RequestTrailers(r) } else { Response::ResponseTrailers(r) };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// The proxy answers the client itself: `status`, `headers`, `body` (the picker refused the request: 503 when no
/// endpoint can serve it, 429 when it is shed, any other error the gateway gives).
pub fn immediate(
    status: u16,
    headers: &[(String, Vec<u8>)],
    body: Vec<u8>,
    details: &str,
) -> ProcessingResponse {
    let r = ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(status) }),
        headers: Some(mutation(headers, Vec::new())),
        body,
        grpc_status: None,
        details: details.to_owned(),
    };
    ProcessingResponse { response: Some(Response::ImmediateResponse(r)), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::google::protobuf::ListValue;

    fn text(s: &str) -> Value {
        Value { kind: Some(Kind::StringValue(s.into())) }
    }

    fn md(namespace: &str, key: &str, v: Value) -> Metadata {
        let inner = Struct { fields: HashMap::from([(key.to_owned(), v)]) };
        Metadata { filter_metadata: HashMap::from([(namespace.to_owned(), inner)]), ..Default::default() }
    }

    #[test]
    fn the_pick_is_the_same_in_the_header_and_the_metadata_and_clears_the_route_cache() {
        let r = pick("10.0.0.1:8000,10.0.0.2:8000", mutation(&[], vec!["authorization".into()]), None);
        let Some(Response::RequestHeaders(h)) = &r.response else { panic!("a headers response: {r:?}") };
        let common = h.response.as_ref().expect("common");
        assert!(common.clear_route_cache);
        let m = common.header_mutation.as_ref().expect("mutation");
        let set: Vec<_> = m.set_headers.iter().filter_map(|o| o.header.as_ref()).collect();
        assert_eq!(set[0].key, DESTINATION_HEADER);
        assert_eq!(set[0].raw_value, b"10.0.0.1:8000,10.0.0.2:8000");
        assert_eq!(m.remove_headers, vec!["authorization".to_owned()]);
        let lb = r.dynamic_metadata.as_ref().and_then(|s| s.fields.get(LB_NAMESPACE)).expect("envoy.lb");
        let Some(Kind::StructValue(lb)) = &lb.kind else { panic!("a struct") };
        assert_eq!(string_of(&lb.fields[DESTINATION_HEADER]), Some("10.0.0.1:8000,10.0.0.2:8000"));
        // Buffered: the body message carries the pick and the body.
        let r = pick("10.0.0.1:8000", mutation(&[], vec![]), Some(b"{}".to_vec()));
        let Some(Response::RequestBody(b)) = &r.response else { panic!("a body response") };
        let common = b.response.as_ref().expect("common");
        assert!(common.clear_route_cache && common.header_mutation.is_some());
        let body = common.body_mutation.as_ref().and_then(|m| m.mutation.as_ref());
        assert_eq!(body, Some(&body_mutation::Mutation::Body(b"{}".to_vec())));
    }

    #[test]
    fn subset_hints_and_served_endpoints_are_read_in_both_shapes_and_bounded() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![text("10.0.0.1:8000"), text(" 10.0.0.2:8000 ")],
            })),
        };
        assert_eq!(
            subset_hint(Some(&md(SUBSET_NAMESPACE, SUBSET_KEY, list))),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
        );
        assert_eq!(
            subset_hint(Some(&md(SUBSET_NAMESPACE, SUBSET_KEY, text("b:2,a:1,b:2")))),
            Some(vec!["a:1".to_owned(), "b:2".to_owned()]),
            "sorted, each once"
        );
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&md(LB_NAMESPACE, SERVED_KEY, text("a:1")))), None);
        let many: Vec<String> = (0..MAX_SUBSET * 2).map(|i| format!("x:{i}")).collect();
        assert_eq!(
            subset_hint(Some(&md(SUBSET_NAMESPACE, SUBSET_KEY, text(&many.join(","))))).map(|v| v.len()),
            Some(MAX_SUBSET)
        );
        assert_eq!(
            served(Some(&md(LB_NAMESPACE, SERVED_KEY, text("10.0.0.2:8000")))),
            Some("10.0.0.2:8000".into())
        );
        assert_eq!(
            served(Some(&md(LB_NAMESPACE, SERVED_KEY, Value { kind: Some(Kind::NumberValue(1.0)) }))),
            None
        );
    }

    #[test]
    fn a_large_body_goes_back_in_bounded_messages_and_only_the_last_ends_it() {
        let body = vec![b'x'; 2 * MAX_BODY_MESSAGE_BYTES + 5];
        let msgs = streamed_body(true, &body, true);
        assert_eq!(msgs.len(), 3);
        let parts: Vec<(usize, bool)> = msgs
            .iter()
            .map(|m| match &m.response {
                Some(Response::RequestBody(BodyResponse { response: Some(c) })) => {
                    match c.body_mutation.as_ref().and_then(|b| b.mutation.as_ref()) {
                        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.len(), s.end_of_stream),
                        other => panic!("a streamed response: {other:?}"),
                    }
                }
                other => panic!("a request body response: {other:?}"),
            })
            .collect();
        assert_eq!(parts, vec![(MAX_BODY_MESSAGE_BYTES, false), (MAX_BODY_MESSAGE_BYTES, false), (5, true)]);
        assert_eq!(streamed_body(false, b"", true).len(), 1, "an empty end is still sent");
    }

    #[test]
    fn headers_are_read_from_raw_values_lowercased() {
        let h = HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue {
                        key: ":path".into(),
                        raw_value: b"/v1/chat/completions".to_vec(),
                        ..Default::default()
                    },
                    HeaderValue { key: "X-Session-Id".into(), value: "s1".into(), ..Default::default() },
                ],
            }),
            ..Default::default()
        };
        let l = header_list(&h);
        assert_eq!(header_text(&l, ":path"), Some("/v1/chat/completions"));
        assert_eq!(header_text(&l, "x-session-id"), Some("s1"));
    }
}
