//! The typed values a request's exchange produces, one per stage (`exchange.rs` has the walk): who asked
//! ([`Incoming`]), the request made ready ([`Prepared`]), priced ([`Priced`]), admitted ([`Admitted`]) and routed
//! ([`RoutedRequest`]), and what the front end logs of it ([`Ctx`]). Plain data: no stage logic lives here, so every
//! stage module may import this one and none imports another's internals.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use kvgate_router::route::Routed;
use kvgate_router::split::plan::SplitAsk;

use crate::admission::Permit;
use crate::control::keys::Caller;
use crate::route::RouteInput;
use crate::serve::host::InflightGuard;
use crate::serve::prepare::PreparedRequest;
use crate::serve::spans::RequestTrace;

/// Status logged for a request whose client went away before its answer (nginx's convention).
pub const CLIENT_CLOSED: u16 = 499;

/// Who asked, and how: what the read and identify stages take from the request besides its body.
pub struct Incoming {
    /// The path forwarded to.
    pub path: String,
    pub caller: Arc<Caller>,
    /// `x-kvgate-cache-salt` (refused at read when it is not text).
    pub cache_salt: Option<String>,
    /// `x-session-id`.
    pub session: Option<String>,
    /// `x-kvgate-class`.
    pub class: Option<String>,
    /// The client headers a worker may get (`outbound::forwarded_headers` picks among them).
    pub forwardable: Vec<(&'static str, HeaderValue)>,
    /// The workers it may go to, by address (an endpoint picker's subset hint); `None`: any.
    pub subset: Option<Vec<String>>,
}

impl Incoming {
    /// `input` kept to the workers this request may go to.
    pub fn within<'a>(&'a self, input: RouteInput<'a>) -> RouteInput<'a> {
        RouteInput { only: self.subset.as_deref(), ..input }
    }
}

/// A request made ready by its endpoint: what every later stage reads, whatever the endpoint.
pub struct Prepared {
    pub model: String,
    /// The body every worker gets (a keyed caller's salt replaced; a stream asked for its usage).
    pub body: Bytes,
    pub stream: bool,
    /// A keyed caller's tenant salt replaced the client's (in the body): the salt header is not forwarded.
    pub salt_rewritten: bool,
    /// Prompt tokens: counted when tokenized, else estimated from the body.
    pub prompt_tokens: u64,
    /// The most prompt tokens a pod's usage is believed: the count when tokenized, else a bound from the body
    /// (`endpoints/passthrough.rs`).
    pub prompt_cap: u64,
    pub reasoning: bool,
    /// The most output tokens the body asks for per choice (`max_tokens`, `max_output_tokens`).
    pub max_output: Option<u64>,
    /// Sequences it generates (`n`, `best_of`; 1 for every other request): output is priced and capped per
    /// choice times this.
    pub choices: u64,
    /// Whether it generates text: without `max_output`, its output is priced at its class's expected output.
    pub generates: bool,
    /// The model's context length, when a worker told it.
    pub max_model_len: Option<u32>,
    /// The gateway asked the stream for usage the client did not ask for: take it out again.
    pub strip_usage: bool,
    /// The prompt tokenized and hashed as the workers will: routed by prefix; `None`: routed by load.
    pub prompt: Option<PreparedRequest>,
}

impl Prepared {
    /// What the router needs to know: the prompt's blocks, or (routed by load) its size alone.
    pub fn route_input(&self) -> RouteInput<'_> {
        match &self.prompt {
            Some(p) => p.route_input(),
            None => RouteInput {
                model: &self.model,
                hashes: &[],
                prompt_tokens: self.prompt_tokens as usize,
                session_key: 0,
                shared_blocks: 0,
                block_size: 1,
                only: None,
                adapter: None,
                output_tokens: 0,
                slo: kvgate_router::routing::Slo::default(),
            },
        }
    }
}

/// Its class, expected output, price and the split it may get.
pub struct Priced<'s> {
    pub class: usize,
    pub class_name: String,
    /// The output it is priced with: `max_output`, else the class's expected output when it generates, times
    /// its choices.
    pub output: u64,
    /// The most output one choice may have (`max_output`, else the model's context; 0 when it generates none).
    pub output_cap: u64,
    pub choices: u64,
    /// What admission reserves: the predicted uncached prompt + output.
    pub cost: f64,
    /// The output it will probably produce (the class's learned output, capped by `max_tokens`; all choices) and
    /// its class's SLOs: what the routing objective weighs (`RouteInput::with_goal`).
    pub likely_output: u64,
    pub slo: kvgate_router::routing::Slo,
    /// The most a pod's usage is believed: the prompt's cap and the output the request may have (all choices).
    pub cap: u64,
    /// The model's pool runs kvgate workers.
    pub kvgate_pool: bool,
    pub ask: Option<SplitAsk<'s>>,
    /// The dry run that priced a prefix-routed request (explain shows it).
    pub dry: Option<Routed>,
}

/// Admitted: its class budget's permit.
pub struct Admitted<'s> {
    pub priced: Priced<'s>,
    pub permit: Permit,
}

/// Routed, with the guards of the sends it recorded.
pub struct RoutedRequest {
    pub routed: Routed,
    pub first: Option<InflightGuard>,
    pub prefill: Option<InflightGuard>,
}

/// What the front end logs of one request (its counters, its trace).
pub struct Ctx {
    pub started: Instant,
    pub status: u16,
    pub route: &'static str,
    pub class: String,
    /// Time spent waiting for the class budget.
    pub admission_wait: Duration,
    /// The request's trace, when traced (`spans.rs`).
    pub trace: Option<RequestTrace>,
    /// The worker that answered (traces).
    pub worker: Option<String>,
}

impl Ctx {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            status: 0,
            route: "none",
            class: String::new(),
            admission_wait: Duration::ZERO,
            trace: None,
            worker: None,
        }
    }
}

impl Default for Ctx {
    fn default() -> Self {
        Self::new()
    }
}

/// A header pair for a worker.
pub type Header = (HeaderName, HeaderValue);
