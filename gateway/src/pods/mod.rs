//! What the gateway learns from pods by itself rather than from kvgate reports: `discovery` (a pool's pods from a
//! headless Service's DNS records), `scrape` (queue metrics of vLLM/SGLang pods), `vllm_events` and
//! `vllm_subscriber` (their KV event streams, decoded and followed into the exact index of
//! `kvgate_router::registry::event_index`, over the bounded ZeroMQ client `zmtp`), and `link_probe` (timed samples
//! of each prefill -> decode link before its first split).

pub mod discovery;
pub mod link_probe;
pub mod scrape;
pub mod vllm_events;
pub mod vllm_subscriber;
pub mod zmtp;
