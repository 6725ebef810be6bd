// After the fused QKV projection: bias (Qwen2), rotate-half RoPE on q and k, q to its own buffer, k and v written
// into the paged KV pool at each token's slot (pool layout [slot, kv_heads, head_dim] per layer).
// grid: (tokens, heads + 2 * kv_heads); block: head_dim / 2 (at least 32 is not required).

template <typename T>
__device__ void qkv_rope_store(const T* qkv, const T* bias, T* q_out, T* k_cache, T* v_cache, const int* pos,
                               const i64* slots, const float* inv_freq, int heads, int kv_heads, int hd) {
  int t = blockIdx.x, h = blockIdx.y, half = hd / 2, i = threadIdx.x;
  int qd = heads * hd, kvd = kv_heads * hd;
  const T* row = qkv + (i64)t * (qd + 2 * kvd);
  int col;  // first column of this head in the fused row
  T* dst;
  bool rope = true;
  if (h < heads) {
    col = h * hd;
    dst = q_out + (i64)t * qd + h * hd;
  } else if (h < heads + kv_heads) {
    col = qd + (h - heads) * hd;
    dst = k_cache + slots[t] * kvd + (h - heads) * hd;
  } else {
    col = qd + kvd + (h - heads - kv_heads) * hd;
    dst = v_cache + slots[t] * kvd + (h - heads - kv_heads) * hd;
    rope = false;
  }
  for (; i < half; i += blockDim.x) {
    float a = to_f(row[col + i]), b = to_f(row[col + half + i]);
    if (bias) {
      a = round_t<T>(a + to_f(bias[col + i]));
      b = round_t<T>(b + to_f(bias[col + half + i]));
    }
    if (rope) {
      float ang = (float)pos[t] * inv_freq[i];
      float c = cosf(ang), s = sinf(ang);
      float a2 = a * c - b * s, b2 = b * c + a * s;
      a = a2;
      b = b2;
    }
    dst[i] = from_f<T>(a);
    dst[half + i] = from_f<T>(b);
  }
}

#define ROPE(T, S)                                                                                            \
  extern "C" __global__ void qkv_rope_store_##S(const T* qkv, const T* bias, T* q, T* kc, T* vc, const int* pos, \
                                                const i64* slots, const float* f, int heads, int kvh, int hd) {  \
    qkv_rope_store<T>(qkv, bias, q, kc, vc, pos, slots, f, heads, kvh, hd);                                      \
  }
FOR_EACH_DTYPE(ROPE)
