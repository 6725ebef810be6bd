//! kvgate-gateway: the OpenAI-compatible front door that routes each request to the worker holding its KV cache.
//!
//! - [`routing`]: the policies (pure; shared with the simulator);

pub mod routing;
