//! A client request's path through the gateway: accepted by `listener`, answered by the pingora service `proxy`
//! (completions through the staged `pipeline`, other OpenAI/vLLM endpoints through `passthrough`), forwarded to one
//! worker per attempt by `upstream`; `request` parses bodies within bounds, `prepare` tokenizes and hashes them on
//! the `tokenize` pool, `meter` reads what a response cost, `spans` records the request's trace.

pub mod listener;
pub mod meter;
pub mod passthrough;
pub mod pipeline;
pub mod prepare;
pub mod proxy;
pub mod request;
pub mod spans;
pub mod tokenize;
pub mod upstream;
