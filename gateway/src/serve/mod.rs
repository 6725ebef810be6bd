//! A client request's path through the gateway. The walk, entering each room once:
//!
//! `listener` (connections) -> `proxy` (the pingora service: adapts its session to a `downstream::Downstream` and
//! dispatches) -> `exchange` (read, identify, the endpoint's prepare, price, admit, route; the stage values in
//! `stages`) -> `attempts` (candidates in rank order; what a worker gets besides the body in `outbound`) ->
//! `upstream` (one attempt: send, refusal, head, body) -> `charge` (each outcome settled by the charging rules).
//!
//! The endpoints (`endpoints/`: completions and chat, tokenized by `prepare` on the `tokenize` pool from bodies parsed
//! within bounds by `request`; the pass-through endpoints) differ in their prepare stage; after it the stages branch
//! only on whether the prompt was tokenized here (`exchange.rs`). `models` answers the
//! GET routes; `meter` reads what a response cost (`usage_scan` finds a
//! whole answer's usage); `spans` records the request's trace; `learned` keeps each class's
//! output lengths. Everything here reaches the gateway through `host::ServeHost`, never its whole state.

pub mod adapters;
pub mod attempts;
pub mod charge;
pub mod downstream;
pub mod endpoints;
pub mod exchange;
pub mod host;
pub mod learned;
pub mod listener;
pub mod lora_catalog;
pub mod meter;
pub mod models;
pub mod outbound;
pub mod prepare;
pub mod proxy;
pub mod request;
pub mod spans;
pub mod stages;
pub mod tokenize;
pub mod upstream;
pub mod usage_scan;
