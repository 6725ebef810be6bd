//! Offered load: how busy a request makes a worker, from the timing model alone, so a trace can be replayed at a
//! chosen fraction of the fleet's capacity (`--target-load`).
//!
//! ```text
//! work(r)      = prefill(r) + decode(r)                               (seconds of one worker)
//! prefill(r)   = sum over chunks of max_num_batched_tokens after the oracle's cached prefix:
//!                prefill_base_s + prefill_per_token_s * n + prefill_attention_s * n * (start + n / 2)
//! decode(r)    = output_length * (decode_per_seq_s + decode_per_kv_token_s * (input_length + output_length / 2))
//!                (the marginal cost of a token in a batch; step bases are shared by the batch and not counted)
//! offered_load = sum of work(r) / (workers * trace span * time_scale)
//! ```
//! With the oracle's hits, the load is what a perfect cache would leave; a policy with fewer hits sees more.

use kvgate_worker::engine::timing::TimingModel;

/// Seconds of worker time one request needs with `cached` prompt tokens served from cache.
pub fn request_work_s(
    t: &TimingModel,
    max_batched: usize,
    input: usize,
    cached: usize,
    output: usize,
) -> f64 {
    let chunk = max_batched.max(1);
    let mut start = cached.min(input);
    let mut s = 0.0;
    while start < input {
        let n = (input - start).min(chunk);
        s += t.prefill(start, n);
        start += n;
    }
    let out = output as f64;
    s + out * (t.decode_per_seq_s + t.decode_per_kv_token_s * (input as f64 + out / 2.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_after_the_cached_prefix() {
        let t = TimingModel {
            prefill_base_s: 1.0,
            prefill_per_token_s: 0.001,
            prefill_attention_s: 0.0,
            decode_base_s: 5.0,
            decode_per_seq_s: 0.01,
            decode_per_kv_token_s: 0.0,
            host_load_s_per_byte: 0.0,
            disk_load_s_per_byte: 0.0,
        };
        // 3000 tokens, 1000 cached, chunks of 1024: 1024 + 976 -> two bases + 2 s of tokens; 10 outputs 0.1 s.
        let w = request_work_s(&t, 1024, 3000, 1000, 10);
        assert!((w - (2.0 + 2.0 + 0.1)).abs() < 1e-9, "{w}");
        assert!((request_work_s(&t, 1024, 3000, 3000, 0)).abs() < 1e-12);
    }
}
