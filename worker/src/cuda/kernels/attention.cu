// Attention over the paged KV pool (per layer: [slot, kv_heads, head_dim], slot = block * block_size + offset).
//
// Decode (one query per sequence), FlashDecoding-style split-K: block (seq, kv_head, split) scores the split's
// keys for all query heads of the KV head (GQA: K/V read once per group), keeps its softmax max and sum, and
// accumulates unnormalised P*V; `decode_reduce` merges the splits. Lanes split a key's head_dim in 8-element
// vectors (head_dim / 8 lanes per key, 32 / that many keys per warp at once), so K and V are read as coalesced
// 16-byte loads.
//
// Prefill over paged K/V (any chunk, with or without a cached prefix) runs as cuBLAS batched GEMMs on tensor cores
// around two kernels here: `gather_kv` (the sequence's K/V to contiguous [kv_heads, ctx, head_dim]) and
// `causal_softmax` (mask, softmax in f32, probabilities rounded to T as eager attention does).

#define MAX_GROUP 8   // query heads per KV head supported by the decode kernel
#define DEC_THREADS 256

// grid: (seqs, kv_heads, splits); block: DEC_THREADS; dynamic smem: (2 * g * hd + g * part) floats.
// part_acc: [seqs, heads, splits, hd] f32; part_ml: [seqs, heads, splits, 2] f32.
template <typename T>
__device__ void paged_decode(const T* q, const int* q_rows, const T* kc, const T* vc, const int* block_tables,
                             int max_blocks, const int* ctx_lens, int block_size, int heads, int kv_heads, int hd,
                             float scale, int part, float* part_acc, float* part_ml) {
  extern __shared__ float smem[];
  const int b = blockIdx.x, kh = blockIdx.y, s = blockIdx.z, splits = gridDim.z;
  const int g = heads / kv_heads, kvd = kv_heads * hd, tid = threadIdx.x;
  const int ctx = ctx_lens[b];
  const int k0 = s * part, k1 = min(ctx, k0 + part);
  float* qs = smem;              // [g, hd] scaled queries
  float* sc = qs + g * hd;       // [g, part] scores, then probabilities
  float* acc_s = sc + g * part;  // [g, hd] output accumulator
  const T* qrow = q + (i64)q_rows[b] * heads * hd + (i64)kh * g * hd;
  for (int i = tid; i < g * hd; i += blockDim.x) {
    qs[i] = to_f(qrow[i]) * scale;
    acc_s[i] = 0.0f;
  }
  __syncthreads();
  i64 out_base = ((i64)b * heads + (i64)kh * g) * splits + s;  // + gi * splits
  if (k0 >= k1) {
    for (int i = tid; i < g * hd; i += blockDim.x) {
      int gi = i / hd, d = i % hd;
      part_acc[(out_base + (i64)gi * splits) * hd + d] = 0.0f;
    }
    if (tid < g) {
      part_ml[(out_base + (i64)tid * splits) * 2] = NEG_INF;
      part_ml[(out_base + (i64)tid * splits) * 2 + 1] = 0.0f;
    }
    return;
  }
  const int lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const int lpk = hd / 8, kpw = 32 / lpk, sub = lane / lpk, dl = lane % lpk;
  const int* table = block_tables + (i64)b * max_blocks;

  // 1. scores
  for (int base = k0 + warp * kpw; base < k1; base += nw * kpw) {
    int j = base + sub;
    bool valid = j < k1;
    float kv[8];
    if (valid) {
      i64 slot = (i64)table[j / block_size] * block_size + j % block_size;
      load8(kc + slot * kvd + (i64)kh * hd + dl * 8, kv);
    } else {
#pragma unroll
      for (int e = 0; e < 8; e++) kv[e] = 0.0f;
    }
#pragma unroll
    for (int gi = 0; gi < MAX_GROUP; gi++) {
      if (gi < g) {
        const float* qq = qs + gi * hd + dl * 8;
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) d += qq[e] * kv[e];
        for (int o = lpk / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (valid && dl == 0) sc[gi * part + (j - k0)] = d;
      }
    }
  }
  __syncthreads();

  // 2. softmax pieces of this split: warp w handles heads w, w + nw, ...
  const int n = k1 - k0;
  __shared__ float ml[2 * MAX_GROUP];
  for (int gi = warp; gi < g; gi += nw) {
    float m = NEG_INF;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[gi * part + j]);
    m = warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
      float p = expf(sc[gi * part + j] - m);
      sc[gi * part + j] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) {
      ml[2 * gi] = m;
      ml[2 * gi + 1] = l;
    }
  }
  __syncthreads();

  // 3. unnormalised P * V
  float acc[MAX_GROUP][8];
#pragma unroll
  for (int gi = 0; gi < MAX_GROUP; gi++)
#pragma unroll
    for (int e = 0; e < 8; e++) acc[gi][e] = 0.0f;
  for (int base = k0 + warp * kpw; base < k1; base += nw * kpw) {
    int j = base + sub;
    if (j < k1) {
      float vv[8];
      i64 slot = (i64)table[j / block_size] * block_size + j % block_size;
      load8(vc + slot * kvd + (i64)kh * hd + dl * 8, vv);
#pragma unroll
      for (int gi = 0; gi < MAX_GROUP; gi++) {
        if (gi < g) {
          float p = sc[gi * part + (j - k0)];
#pragma unroll
          for (int e = 0; e < 8; e++) acc[gi][e] += p * vv[e];
        }
      }
    }
  }
  // Sum the keys-in-flight of the warp (lanes with equal dl), then across warps in shared memory.
#pragma unroll
  for (int gi = 0; gi < MAX_GROUP; gi++) {
    if (gi < g) {
#pragma unroll
      for (int e = 0; e < 8; e++) {
        float v = acc[gi][e];
        for (int o = lpk; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[gi][e] = v;
      }
      if (sub == 0) {
#pragma unroll
        for (int e = 0; e < 8; e++) atomicAdd(&acc_s[gi * hd + dl * 8 + e], acc[gi][e]);
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < g * hd; i += blockDim.x) {
    int gi = i / hd, d = i % hd;
    part_acc[(out_base + (i64)gi * splits) * hd + d] = acc_s[i];
  }
  if (tid < g) {
    part_ml[(out_base + (i64)tid * splits) * 2] = ml[2 * tid];
    part_ml[(out_base + (i64)tid * splits) * 2 + 1] = ml[2 * tid + 1];
  }
}

// Merges the splits: grid (seqs, heads); block: 128. out row q_rows[b], columns of head h.
template <typename T>
__device__ void decode_reduce(T* out, const int* q_rows, const float* part_acc, const float* part_ml, int heads,
                              int hd, int splits) {
  const int b = blockIdx.x, h = blockIdx.y;
  const i64 base = ((i64)b * heads + h) * splits;
  float m = NEG_INF;
  for (int s = 0; s < splits; s++) m = fmaxf(m, part_ml[(base + s) * 2]);
  float l = 0.0f;
  for (int s = 0; s < splits; s++) {
    float ms = part_ml[(base + s) * 2];
    if (ms != NEG_INF) l += part_ml[(base + s) * 2 + 1] * expf(ms - m);
  }
  float inv = l > 0.0f ? 1.0f / l : 0.0f;
  T* o = out + (i64)q_rows[b] * heads * hd + (i64)h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < splits; s++) {
      float ms = part_ml[(base + s) * 2];
      if (ms != NEG_INF) v += part_acc[(base + s) * hd + d] * expf(ms - m);
    }
    o[d] = from_f<T>(v * inv);
  }
}

// K and V of one sequence's first ctx positions to [kv_heads, ctx, hd] each. grid: (ctx, kv_heads); block: 64.
template <typename T>
__device__ void gather_kv(T* k_out, T* v_out, const T* kc, const T* vc, const int* table, int block_size,
                          int kv_heads, int hd, int ctx) {
  const int j = blockIdx.x, kh = blockIdx.y;
  const i64 slot = (i64)table[j / block_size] * block_size + j % block_size;
  const i64 src = slot * kv_heads * hd + (i64)kh * hd;
  const i64 dst = ((i64)kh * ctx + j) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    k_out[dst + d] = kc[src + d];
    v_out[dst + d] = vc[src + d];
  }
}

// Rows of scores [heads, len, keys] (f32, already scaled); row (h, i) is the query at position first_pos + i and
// may see keys 0..=first_pos + i. Writes probabilities (masked ones 0) as T. grid: heads * len; block: 256.
template <typename T>
__device__ void causal_softmax(T* p, const float* scores, int len, int keys, int first_pos) {
  const i64 row = blockIdx.x;
  const int i = (int)(row % len);
  const int visible = min(keys, first_pos + i + 1);
  const float* s = scores + row * keys;
  T* o = p + row * keys;
  float m = NEG_INF;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) m = fmaxf(m, s[j]);
  m = block_max(m);
  float l = 0.0f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) l += expf(s[j] - m);
  l = block_sum(l);
  float inv = 1.0f / l;
  for (int j = threadIdx.x; j < keys; j += blockDim.x) o[j] = from_f<T>(j < visible ? expf(s[j] - m) * inv : 0.0f);
}

#define ATTENTION(T, S)                                                                                        \
  extern "C" __global__ void __launch_bounds__(DEC_THREADS) paged_decode_##S(                                  \
      const T* q, const int* q_rows, const T* kc, const T* vc, const int* bt, int max_blocks, const int* ctx,   \
      int bs, int heads, int kvh, int hd, float scale, int part, float* pa, float* pml) {                      \
    paged_decode<T>(q, q_rows, kc, vc, bt, max_blocks, ctx, bs, heads, kvh, hd, scale, part, pa, pml);         \
  }                                                                                                            \
  extern "C" __global__ void decode_reduce_##S(T* out, const int* q_rows, const float* pa, const float* pml,   \
                                               int heads, int hd, int splits) {                                \
    decode_reduce<T>(out, q_rows, pa, pml, heads, hd, splits);                                                 \
  }                                                                                                            \
  extern "C" __global__ void gather_kv_##S(T* ko, T* vo, const T* kc, const T* vc, const int* table, int bs,   \
                                           int kvh, int hd, int ctx) {                                         \
    gather_kv<T>(ko, vo, kc, vc, table, bs, kvh, hd, ctx);                                                     \
  }                                                                                                            \
  extern "C" __global__ void causal_softmax_##S(T* p, const float* s, int len, int keys, int first_pos) {      \
    causal_softmax<T>(p, s, len, keys, first_pos);                                                             \
  }
FOR_EACH_DTYPE(ATTENTION)
