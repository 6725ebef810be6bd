//! The endpoints the exchange serves, one `exchange::Endpoint` each: what a kind of request does in the prepare
//! stage. [`completions`]: `/v1/completions` and `/v1/chat/completions`, tokenized and hashed here and routed by
//! prefix; [`passthrough`]: the other OpenAI and vLLM endpoints, routed by load, their prompts sized by
//! [`sizing`].

pub mod completions;
pub mod passthrough;
pub mod sizing;
