//! FP8 E4M3 (OCP `E4M3FN`: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities; `S.1111.111` is
//! NaN; largest finite 448) for the KV cache, and the reference math the CPU engine applies with
//! `--kv-cache-dtype fp8` so the CUDA kernels have something to be checked against.
//!
//! Scaling: one f32 scale per (token, KV head), `max |x| / 448` over that head's `head_dim` values, so a row is
//! quantized when it is written and never again (a block fills a token at a time; a per-block scale would change
//! under the tokens already stored). Stored as `code = e4m3(x / scale)`, read as `decode(code) * scale`. Encoding
//! rounds to nearest, ties to even, and saturates at +-448 (a scaled value never exceeds it; rounding noise can).
//!
//! The CPU engine keeps its KV in f32 and rounds each row through FP8 as it is written ([`round_heads`]): the same
//! values a device FP8 cache would hold, not its memory saving.

/// `--kv-cache-dtype`: what the KV cache stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The engine's own: f32 on the CPU, the `--dtype` on CUDA.
    #[default]
    Auto,
    /// FP8 E4M3 with a scale per (token, KV head). The CPU engine applies it as reference math; the CUDA kernels
    /// for it are not built yet, so a CUDA worker refuses it at start.
    Fp8,
}

impl KvCacheDtype {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8),
            other => Err(format!("kv-cache-dtype {other:?} is not auto or fp8")),
        }
    }
}

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an E4M3 code.
pub fn decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = (code >> 3) & 0x0f;
    let man = code & 0x07;
    if exp == 0x0f && man == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: 0.mmm x 2^-6.
        f32::from(man) / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + f32::from(man) / 8.0) * 2f32.powi(i32::from(exp) - 7)
    };
    sign * magnitude
}

/// The E4M3 code nearest `x` (ties to the even code), saturating at +-448; NaN gives the NaN code.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Codes 0..=0x7e are ordered by magnitude: find the nearest by bisection over the positive codes.
    let (mut lo, mut hi) = (0u8, 0x7e);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if decode(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - decode(lo), decode(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) { lo } else { hi };
    sign | code
}

/// The scale of one head's values: `max |x| / 448` (1 for an all-zero head).
pub fn scale_of(values: &[f32]) -> f32 {
    let m = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    if m > 0.0 && m.is_finite() {
        m / E4M3_MAX
    } else {
        1.0
    }
}

/// Rounds a K or V row of `heads x head_dim` values through FP8 in place, each head with its own scale.
pub fn round_heads(row: &mut [f32], head_dim: usize) {
    for head in row.chunks_mut(head_dim) {
        let s = scale_of(head);
        for v in head.iter_mut() {
            *v = decode(encode(*v / s)) * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_to_the_e4m3fn_value_and_encodes_back() {
        // Known points of the format.
        assert_eq!(decode(0x00), 0.0);
        assert_eq!(decode(0x01), 2f32.powi(-9), "smallest subnormal");
        assert_eq!(decode(0x08), 2f32.powi(-6), "smallest normal");
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x7e), 448.0);
        assert_eq!(decode(0xfe), -448.0);
        assert!(decode(0x7f).is_nan() && decode(0xff).is_nan());
        for c in 0..=255u8 {
            let v = decode(c);
            if v.is_nan() {
                continue;
            }
            let back = encode(v);
            // +0 and -0 are both exact.
            assert!(back == c || (v == 0.0 && back & 0x7f == 0), "code {c:#04x} -> {v} -> {back:#04x}");
        }
        // Monotone over the positive codes (the encoder's search relies on it).
        assert!((0..0x7e).all(|c| decode(c) < decode(c + 1)));
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code, 1.0.
        assert_eq!(encode(1.0625), 0x38);
        assert_eq!(encode(1.07), 0x39);
        // Between 1.125 (0x39) and 1.25 (0x3a): the midpoint goes to 0x3a.
        assert_eq!(encode(1.1875), 0x3a);
        assert_eq!(encode(1e6), 0x7e);
        assert_eq!(encode(-1e6), 0xfe);
        assert_eq!(encode(f32::NAN), 0x7f);
    }

    #[test]
    fn a_head_keeps_its_largest_value_and_a_small_relative_error() {
        let mut row: Vec<f32> =
            (0..256).map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i / 128) as f32 * 9.0)).collect();
        let orig = row.clone();
        round_heads(&mut row, 128);
        for (h, (r, o)) in row.chunks(128).zip(orig.chunks(128)).enumerate() {
            let max = o.iter().fold(0f32, |m, v| m.max(v.abs()));
            let at = o.iter().position(|v| v.abs() == max).expect("max");
            assert!((r[at].abs() - max).abs() <= max * 1e-6, "head {h}: the largest value is exact");
            for (a, b) in r.iter().zip(o) {
                // 3 mantissa bits: at most 1/16 relative for normals; the scale keeps every value normal or tiny.
                assert!((a - b).abs() <= b.abs() / 16.0 + max / 448.0 * 2f32.powi(-9) * 8.0, "{a} vs {b}");
            }
        }
        let mut zeros = vec![0.0f32; 128];
        round_heads(&mut zeros, 128);
        assert!(zeros.iter().all(|v| *v == 0.0));
    }
}
