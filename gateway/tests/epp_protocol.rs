//! The endpoint picker against a proxy that misbehaves (`epp/`): a gRPC ext_proc client (Envoy's protos, tonic)
//! that sends what Envoy would not: no headers first, a body past the limit, a body that stops coming, a mode the
//! picker cannot route with, more streams than `--epp-max-streams`, an answer that goes silent, a stream dropped
//! after the pick. Each gets the documented answer, and whatever the picker held is given back.

mod common;

use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// One stream to the picker: what we send, what it answers.
struct Stream {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(port: u16) -> Stream {
        let mut client =
            ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}")).await.expect("connect");
        let (tx, rx) = mpsc::channel(16);
        let rx = client.process(ReceiverStream::new(rx)).await.expect("process").into_inner();
        Stream { tx: Some(tx), rx }
    }

    /// A stream opened with `token` in its metadata (`authorization: Bearer`), as Envoy's `initial_metadata` sends
    /// it; the picker's refusal when it does not admit the stream.
    async fn open_with(port: u16, token: Option<&str>) -> Result<Stream, tonic::Status> {
        let mut client =
            ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}")).await.expect("connect");
        let (tx, rx) = mpsc::channel(16);
        let mut req = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(t) = token {
            req.metadata_mut().insert("authorization", format!("Bearer {t}").parse().expect("metadata"));
        }
        let rx = client.process(req).await?.into_inner();
        Ok(Stream { tx: Some(tx), rx })
    }

    /// The pick's request headers to set, the body the pod gets (a duplex stream's answers after the body), and
    /// the pick's dynamic metadata (as text).
    async fn pick(&mut self) -> (Vec<(String, String)>, Vec<u8>, String) {
        let pick = self.next().await.expect("ok").expect("a message");
        let Some(Response::RequestHeaders(h)) = &pick.response else { panic!("the pick: {pick:?}") };
        let set =
            &h.response.as_ref().expect("common").header_mutation.as_ref().expect("mutation").set_headers;
        let set = set
            .iter()
            .filter_map(|o| o.header.as_ref())
            .map(|h| (h.key.clone(), String::from_utf8_lossy(&h.raw_value).into_owned()))
            .collect();
        let mut body = Vec::new();
        loop {
            let m = self.next().await.expect("ok").expect("a message");
            let Some(Response::RequestBody(b)) = m.response else { panic!("body chunks: {m:?}") };
            let mutation = b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation);
            let Some(body_mutation::Mutation::StreamedResponse(c)) = mutation else { panic!("streamed") };
            body.extend(c.body);
            if c.end_of_stream {
                return (set, body, format!("{:?}", pick.dynamic_metadata));
            }
        }
    }

    async fn send(&self, r: Request) {
        self.send_msg(ProcessingRequest { request: Some(r), ..Default::default() }).await;
    }

    async fn send_msg(&self, m: ProcessingRequest) {
        self.tx.as_ref().expect("open").send(m).await.expect("send");
    }

    async fn next(&mut self) -> Result<Option<ProcessingResponse>, tonic::Status> {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message()).await.expect("an answer in time")
    }

    /// The immediate answer: (status, body).
    async fn immediate(&mut self) -> (i32, serde_json::Value) {
        match self.next().await.expect("ok").and_then(|m| m.response) {
            Some(Response::ImmediateResponse(i)) => (
                i.status.expect("status").code,
                serde_json::from_slice(&i.body).unwrap_or(serde_json::Value::Null),
            ),
            other => panic!("an immediate response, got {other:?}"),
        }
    }
}

fn headers(method: &str, path: &str, end: bool) -> Request {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![h(":method", method), h(":path", path), h("content-type", "application/json")],
        }),
        end_of_stream: end,
        ..Default::default()
    })
}

/// A chat completion's headers, opening a stream whose body modes (request and response) are `mode` (Envoy's
/// `BodySendMode`: 1 STREAMED, 2 BUFFERED, 4 FULL_DUPLEX_STREAMED).
fn chat_headers_in_mode(mode: i32) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(headers("POST", "/v1/chat/completions", false)),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: mode,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn body(b: &[u8], end: bool) -> Request {
    Request::RequestBody(HttpBody { body: b.to_vec(), end_of_stream: end, ..Default::default() })
}

fn chat_body() -> Vec<u8> {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        .to_string()
        .into_bytes()
}

/// Permits and in-flight slots held (both 0 at rest).
async fn held(control: &str) -> f64 {
    let m = get(&format!("{control}/metrics")).await.body;
    m.lines()
        .filter(|l| {
            l.starts_with("kvgate_gateway_admission_permits_held{")
                || l.starts_with("kvgate_gateway_worker_inflight{")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_misbehaving_proxy_gets_the_documented_answers_and_holds_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let epp = free_port();
    let listen = format!("127.0.0.1:{epp}");
    let (_g, control) = gateway(&[
        "--epp-listen",
        &listen,
        "--epp-max-streams",
        "2",
        "--max-body-bytes",
        "4096",
        "--request-read-timeout",
        "1s",
        "--stream-idle-timeout",
        "1s",
        "--header-read-timeout",
        "1s",
    ]);
    let w = worker("w0", &dir.path().join("tiny"), Some(&control), &[]);
    wait_healthy(&control, 1).await;

    // No headers first: the stream is refused.
    let mut s = Stream::open(epp).await;
    s.send(body(b"{}", true)).await;
    let e = s.next().await.expect_err("a gRPC error");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");

    // A body past --max-body-bytes: 413, as on the proxy path.
    let mut s = Stream::open(epp).await;
    s.send(headers("POST", "/v1/chat/completions", false)).await;
    s.send(body(&vec![b' '; 3000], false)).await;
    s.send(body(&vec![b' '; 3000], false)).await;
    let (status, b) = s.immediate().await;
    assert_eq!((status, b["error"]["code"].clone()), (413, serde_json::json!("request_too_large")));

    // A body that stops coming: 408 after --request-read-timeout.
    let mut s = Stream::open(epp).await;
    s.send(headers("POST", "/v1/chat/completions", false)).await;
    s.send(body(b"{\"model\":", false)).await;
    let (status, _) = s.immediate().await;
    assert_eq!(status, 408);

    // A route the picker does not serve: 404; a proxy that will not wait for the pick (STREAMED): 500, said why.
    let mut s = Stream::open(epp).await;
    s.send(headers("GET", "/v1/models", true)).await;
    assert_eq!(s.immediate().await.0, 404);
    let mut s = Stream::open(epp).await;
    s.send_msg(chat_headers_in_mode(1)).await;
    let (status, b) = s.immediate().await;
    assert_eq!(status, 500);
    assert!(b["error"]["message"].as_str().unwrap_or("").contains("FULL_DUPLEX_STREAMED"), "{b}");

    // A pick: the destination is the worker's address, in the header and the metadata; the body comes back whole.
    let mut s = Stream::open(epp).await;
    s.send(headers("POST", "/v1/chat/completions", false)).await;
    s.send(body(&chat_body(), true)).await;
    let (set, echoed, metadata) = s.pick().await;
    let dest = set.iter().find(|(k, _)| k == "x-gateway-destination-endpoint").expect("destination");
    assert_eq!(dest.1, format!("127.0.0.1:{}", w.port));
    assert!(metadata.contains(&format!("127.0.0.1:{}", w.port)), "{metadata}");
    let sent: serde_json::Value = serde_json::from_slice(&echoed).expect("json");
    assert_eq!(sent["model"], MODEL);
    // The response head comes (the proxy naming a pod the picker did not rank: counted, credited to none) and then
    // nothing: after --stream-idle-timeout the stream ends, the permit settled.
    let served = Struct {
        fields: [(
            "x-gateway-destination-endpoint-served".to_owned(),
            Value { kind: Some(Kind::StringValue("10.9.9.9:1".into())) },
        )]
        .into(),
    };
    let status = HeaderValue { key: ":status".into(), raw_value: b"200".to_vec(), ..Default::default() };
    s.send_msg(ProcessingRequest {
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers: vec![status] }),
            ..Default::default()
        })),
        metadata_context: Some(Metadata {
            filter_metadata: [("envoy.lb".to_owned(), served)].into(),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await;
    let _head = s.next().await.expect("ok");
    let e = s.next().await.expect_err("deadline");
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e}");
    wait_until(Duration::from_secs(5), || async { held(&control).await == 0.0 }).await;
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_epp_served_total{by=\"unranked\"}"), Some(1.0), "{m}");

    // A stream dropped right after the pick: nothing stays held.
    let mut s = Stream::open(epp).await;
    s.send(headers("POST", "/v1/chat/completions", false)).await;
    s.send(body(&chat_body(), true)).await;
    let _pick = s.next().await.expect("ok");
    s.tx.take();
    drop(s);
    wait_until(Duration::from_secs(5), || async { held(&control).await == 0.0 }).await;

    // Past --epp-max-streams (2): the third open stream is answered 503 epp_overloaded, unread.
    let (a, b) = (Stream::open(epp).await, Stream::open(epp).await);
    a.send(headers("POST", "/v1/chat/completions", false)).await;
    b.send(headers("POST", "/v1/chat/completions", false)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut c = Stream::open(epp).await;
    c.send(headers("POST", "/v1/chat/completions", false)).await;
    let (status, b3) = c.immediate().await;
    assert_eq!((status, b3["error"]["code"].clone()), (503, serde_json::json!("epp_overloaded")));
    drop((a, b));

    // Silent streams (no first message) give their slots back after --header-read-timeout.
    let (_a, _b) = (Stream::open(epp).await, Stream::open(epp).await);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut s = Stream::open(epp).await;
    s.send(headers("GET", "/v1/models", true)).await;
    assert_eq!(s.immediate().await.0, 404, "served again, not epp_overloaded");

    // BUFFERED with trailers: Envoy holds the trailers until its one body message is answered, which does not say
    // it ends the body; a message with no request (a window update) is skipped, not taken for the stream's end.
    let mut s = Stream::open(epp).await;
    s.send_msg(chat_headers_in_mode(2)).await;
    let cont = s.next().await.expect("ok").expect("a message");
    assert!(matches!(cont.response, Some(Response::RequestHeaders(_))), "headers answered first: {cont:?}");
    s.send_msg(ProcessingRequest::default()).await;
    s.send(body(&chat_body(), false)).await;
    let pick = s.next().await.expect("ok").expect("a message");
    let Some(Response::RequestBody(b)) = &pick.response else { panic!("the pick on the body: {pick:?}") };
    assert!(b.response.as_ref().is_some_and(|c| c.clear_route_cache && c.header_mutation.is_some()));

    // A 504 (the proxy's upstream timeout) is charged the prefill, not refunded.
    let refunds = |m: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("kvgate_gateway_class_refunds_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let before = refunds(&get(&format!("{control}/metrics")).await.body);
    s.send(Request::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":status".into(),
                raw_value: b"504".to_vec(),
                ..Default::default()
            }],
        }),
        ..Default::default()
    }))
    .await;
    let _ = s.next().await;
    drop(s);
    wait_until(Duration::from_secs(5), || async { held(&control).await == 0.0 }).await;
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(refunds(&m), before, "{m}");
    assert!(m.contains("kvgate_gateway_epp_requests_total{"), "{m}");
}

const EPP_TOKEN: &str = "picker-token-0123456789";

/// The answer of a pod, as a proxy reports it to the picker: a 200 head, then one JSON body whose `usage` says
/// `completion` tokens.
async fn answer(s: &mut Stream, completion: u64) {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    s.send(Request::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![h(":status", "200"), h("content-type", "application/json")],
        }),
        ..Default::default()
    }))
    .await;
    let _head = s.next().await.expect("ok");
    let usage = serde_json::json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": completion, "total_tokens": completion}});
    s.send(Request::ResponseBody(HttpBody {
        body: usage.to_string().into_bytes(),
        end_of_stream: true,
        ..Default::default()
    }))
    .await;
    let _ = s.next().await;
}

#[tokio::test]
async fn only_its_proxies_drive_the_picker_and_what_it_hands_out_serves_one_request() {
    let dir = tempfile::tempdir().expect("tmp");
    let epp = free_port();
    let listen = format!("127.0.0.1:{epp}");
    let (_g, control) = gateway(&[
        "--epp-listen",
        &listen,
        "--epp-token",
        EPP_TOKEN,
        "--stream-idle-timeout",
        "1s",
        "--admin-token",
        "picker-admin-token",
    ]);
    let w = worker("w0", &dir.path().join("tiny"), Some(&control), &["--require-gateway-token"]);
    wait_healthy(&control, 1).await;

    // No token, or another one: the stream ends UNAUTHENTICATED before anything is read.
    for t in [None, Some("not-the-picker-token-0000")] {
        let e = match Stream::open_with(epp, t).await {
            Err(e) => e,
            Ok(mut s) => {
                s.send(headers("POST", "/v1/chat/completions", false)).await;
                s.next().await.expect_err("refused")
            }
        };
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    }
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_epp_unauthenticated_total"), Some(2.0), "{m}");

    // The proxy's stream: the pick carries a credential for this request, never the gateway's static token.
    let mut s = Stream::open_with(epp, Some(EPP_TOKEN)).await.expect("admitted");
    s.send(headers("POST", "/v1/chat/completions", false)).await;
    s.send(body(&chat_body(), true)).await;
    let (set, sent, _) = s.pick().await;
    let auth = set.iter().find(|(k, _)| k == "authorization").map(|(_, v)| v.clone()).expect("a credential");
    assert!(auth.starts_with("Bearer kvr1."), "{auth}");
    let token = format!("Bearer {}", kvgate_shared::handoff::gateway_token("test-secret"));
    assert!(set.iter().all(|(_, v)| *v != token), "the static gateway token left the gateway: {set:?}");
    let to_pod: Vec<(&str, &str)> = set
        .iter()
        .filter(|(k, _)| !k.starts_with("x-gateway-destination"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain([("content-type", "application/json")])
        .collect();
    // What the proxy sends the pod is served...
    let chat = format!("{}/v1/chat/completions", w.base);
    let r = request_bytes("POST", &chat, sent.clone(), &to_pod).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // ...and nothing else: another body, another path, an admin call (loading an adapter) are all refused.
    let mut other: serde_json::Value = serde_json::from_slice(&sent).expect("json");
    other["messages"][0]["content"] = "something the picker never saw".into();
    let r = request_bytes("POST", &chat, other.to_string().into_bytes(), &to_pod).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].clone()),
        (401, serde_json::json!("gateway_token_required"))
    );
    let r = request_bytes("POST", &format!("{}/v1/completions", w.base), sent.clone(), &to_pod).await;
    assert_eq!(r.status, 401, "{}", r.body);
    let load = serde_json::json!({"lora_name": "evil", "lora_path": dir.path().display().to_string()});
    let r = request_bytes(
        "POST",
        &format!("{}/v1/load_lora_adapter", w.base),
        load.to_string().into_bytes(),
        &to_pod,
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.body);

    // The proxy then reports a head and goes silent: the stream ends after --stream-idle-timeout, charged, and the
    // pod stays in every client's rotation (the proxy's word faults no pod).
    let h = HeaderValue { key: ":status".into(), raw_value: b"200".to_vec(), ..Default::default() };
    s.send(Request::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap { headers: vec![h] }),
        ..Default::default()
    }))
    .await;
    let _head = s.next().await.expect("ok");
    assert_eq!(s.next().await.expect_err("deadline").code(), tonic::Code::DeadlineExceeded);
    wait_until(Duration::from_secs(5), || async { held(&control).await == 0.0 }).await;
    let state = worker_state(&control, "w0").await.expect("listed");
    assert_eq!(
        (state["suspect"].clone(), state["healthy"].clone()),
        (serde_json::json!(false), serde_json::json!(true)),
        "{state}"
    );
    let m = get(&format!("{control}/metrics")).await.body;
    assert_eq!(metric(&m, "kvgate_gateway_epp_unconfirmed_faults_total"), Some(1.0), "{m}");

    // Eight forged answers claiming 10^11 output tokens each: the class learns at most the model's context per
    // choice, so a chat without max_tokens is still priced within its prompt plus the context.
    for _ in 0..8 {
        let mut s = Stream::open_with(epp, Some(EPP_TOKEN)).await.expect("admitted");
        s.send(headers("POST", "/v1/chat/completions", false)).await;
        let plain = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]});
        s.send(body(plain.to_string().as_bytes(), true)).await;
        let _ = s.pick().await;
        answer(&mut s, 100_000_000_000).await;
    }
    wait_until(Duration::from_secs(5), || async { held(&control).await == 0.0 }).await;
    let plain = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]});
    let ex = request(
        "POST",
        &format!("{control}/admin/v1/route/explain"),
        Some(plain.to_string()),
        &[("authorization", "Bearer picker-admin-token")],
    )
    .await;
    assert_eq!(ex.status, 200, "{}", ex.body);
    let cost = ex.json()["cost_tokens"].as_f64().expect("cost");
    let context =
        worker_state(&control, "w0").await.expect("listed")["max_model_len"].as_f64().expect("context");
    assert!(cost <= 64.0 + context, "a chat without max_tokens priced at {cost} (context {context})");
}
