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

#define DEC_THREADS 256

// grid: (seqs, kv_heads, splits); block: DEC_THREADS; dynamic smem: (G + 1) * part floats (scores, then
// probabilities; the split's slots). part_acc: [seqs, heads, splits, hd] f32; part_ml: [seqs, heads, splits, 2] f32.
// G = query heads per KV head. Each lane keeps its 8 dims of the G queries in registers and has DEC_UNROLL keys'
// 16-byte loads in flight; the split's slots are resolved once through the block table into shared memory.
#ifndef DEC_UNROLL
#define DEC_UNROLL 4
#endif
template <typename T, int G>
__device__ void paged_decode(const T* q, const int* q_rows, const T* kc, const T* vc, const int* block_tables,
                             int max_blocks, const int* ctx_lens, int block_size, int heads, int kv_heads, int hd,
                             float scale, int part, float* part_acc, float* part_ml) {
  extern __shared__ float smem[];
  const int b = blockIdx.x, kh = blockIdx.y, s = blockIdx.z, splits = gridDim.z;
  const int kvd = kv_heads * hd, tid = threadIdx.x;
  const int ctx = ctx_lens[b];
  const int k0 = s * part, k1 = min(ctx, k0 + part);
  float* sc = smem;                         // [G, part]
  int* slot_s = (int*)(smem + G * part);    // [part]
  __shared__ float acc_s[G * 256];
  __shared__ float ml[2 * G];
  const i64 out_base = ((i64)b * heads + (i64)kh * G) * splits + s;  // + gi * splits
  if (k0 >= k1) {
    for (int i = tid; i < G * hd; i += blockDim.x) {
      int gi = i / hd, d = i % hd;
      part_acc[(out_base + (i64)gi * splits) * hd + d] = 0.0f;
    }
    if (tid < G) {
      part_ml[(out_base + (i64)tid * splits) * 2] = NEG_INF;
      part_ml[(out_base + (i64)tid * splits) * 2 + 1] = 0.0f;
    }
    return;
  }
  for (int i = tid; i < G * hd; i += blockDim.x) acc_s[i] = 0.0f;
  const int* table = block_tables + (i64)b * max_blocks;
  for (int jj = tid; jj < k1 - k0; jj += blockDim.x) {
    int j = k0 + jj;
    slot_s[jj] = table[j / block_size] * block_size + j % block_size;
  }
  __syncthreads();
  const int lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const int lpk = hd / 8, kpw = 32 / lpk, sub = lane / lpk, dl = lane % lpk;
  const T* qrow = q + (i64)q_rows[b] * heads * hd + (i64)kh * G * hd + dl * 8;
  float qr[G][8];
#pragma unroll
  for (int gi = 0; gi < G; gi++) {
    load8(qrow + gi * hd, qr[gi]);
#pragma unroll
    for (int e = 0; e < 8; e++) qr[gi][e] *= scale;
  }
  const int step = nw * kpw;  // keys per block iteration per unrolled slot

  // 1. scores
  for (int base = k0 + warp * kpw; base < k1; base += step * DEC_UNROLL) {
    float kv[DEC_UNROLL][8];
#pragma unroll
    for (int u = 0; u < DEC_UNROLL; u++) {
      int j = base + u * step + sub;
      if (j < k1) {
        load8(kc + (i64)slot_s[j - k0] * kvd + (i64)kh * hd + dl * 8, kv[u]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; e++) kv[u][e] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < DEC_UNROLL; u++) {
      int j = base + u * step + sub;
#pragma unroll
      for (int gi = 0; gi < G; gi++) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) d += qr[gi][e] * kv[u][e];
        for (int o = lpk / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (j < k1 && dl == 0) sc[gi * part + (j - k0)] = d;
      }
    }
  }
  __syncthreads();

  // 2. softmax pieces of this split: warp w handles heads w, w + nw, ...
  const int n = k1 - k0;
  for (int gi = warp; gi < G; gi += nw) {
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
  float acc[G][8];
#pragma unroll
  for (int gi = 0; gi < G; gi++)
#pragma unroll
    for (int e = 0; e < 8; e++) acc[gi][e] = 0.0f;
  for (int base = k0 + warp * kpw; base < k1; base += step * DEC_UNROLL) {
    float vv[DEC_UNROLL][8];
#pragma unroll
    for (int u = 0; u < DEC_UNROLL; u++) {
      int j = base + u * step + sub;
      if (j < k1) load8(vc + (i64)slot_s[j - k0] * kvd + (i64)kh * hd + dl * 8, vv[u]);
    }
#pragma unroll
    for (int u = 0; u < DEC_UNROLL; u++) {
      int j = base + u * step + sub;
      if (j < k1) {
#pragma unroll
        for (int gi = 0; gi < G; gi++) {
          float p = sc[gi * part + (j - k0)];
#pragma unroll
          for (int e = 0; e < 8; e++) acc[gi][e] += p * vv[u][e];
        }
      }
    }
  }
  // Sum the keys-in-flight of the warp (lanes with equal dl), then across warps in shared memory.
#pragma unroll
  for (int gi = 0; gi < G; gi++) {
#pragma unroll
    for (int e = 0; e < 8; e++) {
      float v = acc[gi][e];
      for (int o = lpk; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[gi][e] = v;
    }
  }
  __syncthreads();
  if (sub == 0) {
#pragma unroll
    for (int gi = 0; gi < G; gi++)
#pragma unroll
      for (int e = 0; e < 8; e++) atomicAdd(&acc_s[gi * hd + dl * 8 + e], acc[gi][e]);
  }
  __syncthreads();
  for (int i = tid; i < G * hd; i += blockDim.x) {
    int gi = i / hd, d = i % hd;
    part_acc[(out_base + (i64)gi * splits) * hd + d] = acc_s[i];
  }
  if (tid < G) {
    part_ml[(out_base + (i64)tid * splits) * 2] = ml[2 * tid];
    part_ml[(out_base + (i64)tid * splits) * 2 + 1] = ml[2 * tid + 1];
  }
}

// Merges the splits: grid (seqs, heads); block: 128; splits <= DEC_MAX_SPLITS. out row q_rows[b], columns of head
// h. Split weights are computed once into shared memory, then every output dim sums its splits with independent
// loads.
#define DEC_MAX_SPLITS 1024
template <typename T>
__device__ void decode_reduce(T* out, const int* q_rows, const float* part_acc, const float* part_ml, int heads,
                              int hd, int splits) {
  __shared__ float w[DEC_MAX_SPLITS];
  const int b = blockIdx.x, h = blockIdx.y;
  const i64 base = ((i64)b * heads + h) * splits;
  float m = NEG_INF;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) m = fmaxf(m, part_ml[(base + s) * 2]);
  m = block_max(m);
  float l = 0.0f;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    float ms = part_ml[(base + s) * 2];
    float e = (ms == NEG_INF) ? 0.0f : expf(ms - m);
    w[s] = e;
    l += part_ml[(base + s) * 2 + 1] * e;
  }
  l = block_sum(l);  // also publishes w
  float inv = l > 0.0f ? 1.0f / l : 0.0f;
  T* o = out + (i64)q_rows[b] * heads * hd + (i64)h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float v = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; s++) v += part_acc[(base + s) * hd + d] * w[s];
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

// Rows of scores [heads, len, keys] (already scaled; in T, as eager attention keeps them); row (h, i) is the
// query at position first_pos + i and may see keys 0..=first_pos + i. Writes probabilities (masked ones 0) as T,
// in place allowed (every read of a row happens before its writes). grid: heads * len; block: 256.
template <typename T, typename S>
__device__ void causal_softmax(T* p, const S* scores, int len, int keys, int first_pos) {
  const i64 row = blockIdx.x;
  const int i = (int)(row % len);
  const int visible = min(keys, first_pos + i + 1);
  const S* s = scores + row * keys;
  T* o = p + row * keys;
  float m = NEG_INF;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) m = fmaxf(m, to_f(s[j]));
  m = block_max(m);
  float l = 0.0f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) l += expf(to_f(s[j]) - m);
  l = block_sum(l);
  float inv = 1.0f / l;
  __syncthreads();
  for (int j = threadIdx.x; j < keys; j += blockDim.x) o[j] = from_f<T>(j < visible ? expf(to_f(s[j]) - m) * inv : 0.0f);
}

// Queries of rows row0..row0+len of q [rows, heads, hd] stacked per KV head: qs[kh][gi * len + i][hd].
// grid: (len, heads); block: hd.
template <typename T>
__device__ void q_stack(T* qs, const T* q, int row0, int len, int heads, int kv_heads, int hd) {
  const int i = blockIdx.x, h = blockIdx.y, g = heads / kv_heads, kh = h / g, gi = h % g;
  const T* src = q + ((i64)(row0 + i) * heads + h) * hd;
  T* dst = qs + (((i64)kh * g + gi) * len + i) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) dst[d] = src[d];
}

// The inverse of q_stack for the attention output. grid: (len, heads); block: hd.
template <typename T>
__device__ void o_scatter(T* o, const T* os, int row0, int len, int heads, int kv_heads, int hd) {
  const int i = blockIdx.x, h = blockIdx.y, g = heads / kv_heads, kh = h / g, gi = h % g;
  const T* src = os + (((i64)kh * g + gi) * len + i) * hd;
  T* dst = o + ((i64)(row0 + i) * heads + h) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) dst[d] = src[d];
}

#define DECODE_G(T, S, G)                                                                                      \
  extern "C" __global__ void __launch_bounds__(DEC_THREADS) paged_decode_##S##_g##G(                           \
      const T* q, const int* q_rows, const T* kc, const T* vc, const int* bt, int max_blocks, const int* ctx,   \
      int bs, int heads, int kvh, int hd, float scale, int part, float* pa, float* pml) {                      \
    paged_decode<T, G>(q, q_rows, kc, vc, bt, max_blocks, ctx, bs, heads, kvh, hd, scale, part, pa, pml);      \
  }
#define ATTENTION(T, S)                                                                                        \
  DECODE_G(T, S, 1) DECODE_G(T, S, 2) DECODE_G(T, S, 3) DECODE_G(T, S, 4)                                      \
  DECODE_G(T, S, 5) DECODE_G(T, S, 6) DECODE_G(T, S, 7) DECODE_G(T, S, 8)                                      \
  extern "C" __global__ void decode_reduce_##S(T* out, const int* q_rows, const float* pa, const float* pml,   \
                                               int heads, int hd, int splits) {                                \
    decode_reduce<T>(out, q_rows, pa, pml, heads, hd, splits);                                                 \
  }                                                                                                            \
  extern "C" __global__ void gather_kv_##S(T* ko, T* vo, const T* kc, const T* vc, const int* table, int bs,   \
                                           int kvh, int hd, int ctx) {                                         \
    gather_kv<T>(ko, vo, kc, vc, table, bs, kvh, hd, ctx);                                                     \
  }                                                                                                            \
  extern "C" __global__ void causal_softmax_##S(T* p, const T* s, int len, int keys, int first_pos) {          \
    causal_softmax<T, T>(p, s, len, keys, first_pos);                                                          \
  }                                                                                                            \
  extern "C" __global__ void q_stack_##S(T* qs, const T* q, int row0, int len, int heads, int kvh, int hd) {   \
    q_stack<T>(qs, q, row0, len, heads, kvh, hd);                                                              \
  }                                                                                                            \
  extern "C" __global__ void o_scatter_##S(T* o, const T* os, int row0, int len, int heads, int kvh, int hd) { \
    o_scatter<T>(o, os, row0, len, heads, kvh, hd);                                                            \
  }
FOR_EACH_DTYPE(ATTENTION)
