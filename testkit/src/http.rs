//! One HTTP helper for tests and benches: a whole response ([`request`], [`get`], [`post`]), a stream read piece by
//! piece ([`open_stream`], [`read_until`], [`read_rest`]), a timed request for benches ([`timed`]), the payloads of an
//! SSE body ([`sse_events`]) and one Prometheus series ([`metric`]). Every request is plain HTTP/1 on loopback.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The HTTP client of tests and benches.
pub type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// A new client (its own connection pool).
pub fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A complete response.
pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Resp {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// A header's value as text ("" when absent).
    pub fn header(&self, name: &str) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
    }
}

/// A JSON request (`content-type: application/json` plus `headers`).
pub async fn request(method: &str, url: &str, body: Option<String>, headers: &[(&str, &str)]) -> Resp {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    request_bytes(method, url, body.unwrap_or_default().into_bytes(), &all).await
}

/// A request with a raw body and exactly the given headers.
pub async fn request_bytes(method: &str, url: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Resp {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).expect("request");
    let resp = client().request(req).await.expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    Resp { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
}

pub async fn get(url: &str) -> Resp {
    request("GET", url, None, &[]).await
}

/// POSTs `body` as JSON with extra `headers`.
pub async fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> Resp {
    request("POST", url, Some(body.to_string()), headers).await
}

/// The status of `GET url`; `None` when there was none (a refused connection, for one).
pub async fn try_get(url: &str) -> Option<u16> {
    let req = hyper::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    client().request(req).await.ok().map(|r| r.status().as_u16())
}

/// A streamed POST of `body` to `url`: the response with its body unread (read it with [`read_until`] and
/// [`read_rest`]).
pub async fn open_stream(url: &str, body: &Value) -> hyper::Response<hyper::body::Incoming> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("req");
    client().request(req).await.expect("resp")
}

/// Reads `body` until what came holds `n` times `needle` (each frame within `each`); returns what came.
pub async fn read_until(body: &mut hyper::body::Incoming, needle: &str, n: usize, each: Duration) -> String {
    let mut text = String::new();
    while text.matches(needle).count() < n {
        let frame = tokio::time::timeout(each, body.frame()).await.expect("chunk in time");
        text.push_str(&String::from_utf8_lossy(
            &frame.expect("frame").expect("ok").into_data().unwrap_or_default(),
        ));
    }
    text
}

/// The rest of `body` up to EOF or an error, which must come within `within`.
pub async fn read_rest(body: &mut hyper::body::Incoming, within: Duration) -> String {
    tokio::time::timeout(within, async {
        let mut rest = String::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => rest.push_str(&String::from_utf8_lossy(&f.into_data().unwrap_or_default())),
                Err(_) => break,
            }
        }
        rest
    })
    .await
    .unwrap_or_else(|_| panic!("no EOF within {within:?}"))
}

/// One JSON request on `client`, timed to the end of its body: (status, milliseconds).
pub async fn timed(client: &Http, method: &str, url: &str, body: String) -> (u16, f64) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("req");
    let t = Instant::now();
    let resp = client.request(req).await.expect("resp");
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await.expect("body");
    (status, t.elapsed().as_secs_f64() * 1e3)
}

/// The `data:` payloads of an SSE body.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
}

/// The value of one Prometheus series (`name{labels}` exactly as exported), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}
