//! A data-parallel rank of a vLLM pod as a worker of its own. A pod started with `--data-parallel-size N` runs N
//! engines behind one HTTP port, each with its own KV cache and its own event stream (`/kv_event_sources` lists them,
//! rank r on the configured port + r), and serves a request on the engine its `X-data-parallel-rank` header names.
//! A `vllm` pool lists such a pod once per rank, `http://pod:8000#dp<r>`: each is routed, indexed (rank r's events),
//! loaded (the `engine="r"` series of the pod's metrics) and health-checked like a pod, and every request built from
//! it goes to the pod's URL with the header set. The header a client sends is never passed on: only the gateway
//! picks a rank.
//!
//! Pure: the URL in, the pod's URL and the rank out.

/// The header vLLM's front end reads the rank from (vllm/entrypoints/generate/base/serving.py).
pub const RANK_HEADER: &str = "x-data-parallel-rank";
/// Highest rank a worker URL may name (as `event_sources::MAX_DP_RANKS`).
pub const MAX_RANK: u32 = 63;

/// `(the pod's URL, the rank)` of a worker URL: `http://pod:8000#dp1` is rank 1 of `http://pod:8000`; a URL
/// without a rank is itself, rank `None`.
pub fn split(url: &str) -> (&str, Option<u32>) {
    match url.rsplit_once("#dp") {
        Some((base, r)) if !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()) && r.len() <= 2 => {
            match r.parse::<u32>() {
                Ok(rank) if rank <= MAX_RANK => (base, Some(rank)),
                _ => (url, None),
            }
        }
        _ => (url, None),
    }
}

/// The pod's URL of a worker URL, for requests (`split(url).0`, without a trailing slash).
pub fn base(url: &str) -> &str {
    split(url).0.trim_end_matches('/')
}

/// Whether `url` names a rank that [`split`] cannot read (a `#` fragment other than `#dp<0..=63>`).
pub fn malformed(url: &str) -> bool {
    url.contains('#') && split(url).1.is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_is_read_from_the_fragment_and_nothing_else_is() {
        assert_eq!(split("http://pod:8000#dp1"), ("http://pod:8000", Some(1)));
        assert_eq!(split("http://pod:8000/#dp0"), ("http://pod:8000/", Some(0)));
        assert_eq!(base("http://pod:8000/#dp0"), "http://pod:8000");
        assert_eq!(split("http://pod:8000"), ("http://pod:8000", None));
        for bad in [
            "http://pod:8000#dp",
            "http://pod:8000#dp64",
            "http://pod:8000#dpx",
            "http://pod:8000#x",
            "http://pod:8000#dp001",
        ] {
            assert_eq!(split(bad).1, None, "{bad}");
            assert!(malformed(bad), "{bad}");
        }
        assert!(!malformed("http://pod:8000#dp63"));
    }
}
