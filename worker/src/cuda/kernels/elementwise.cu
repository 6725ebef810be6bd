// Row-wise element kernels: embedding gather, gated-SiLU, row gather, random fill, dtype conversion.
// CPU references: `cuda::selftest` (embedding rows, candle's silu, HF's `act(gate) * up` rounding order).

// out[t, :] = table[ids[t], :]. grid: tokens; block: 256.
template <typename T>
__device__ void embed(T* out, const T* table, const u32* ids, int hidden) {
  const T* src = table + (i64)ids[blockIdx.x] * hidden;
  T* dst = out + (i64)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i], each op rounded to T as the reference framework does.
// grid: (tokens, ceil(inter / 256)); block: 256.
template <typename T>
__device__ void silu_mul(T* out, const T* gu, int inter) {
  int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const T* row = gu + (i64)blockIdx.x * 2 * inter;
  float g = to_f(row[i]);
  float s = round_t<T>(g / (1.0f + expf(-g)));
  out[(i64)blockIdx.x * inter + i] = from_f<T>(s * to_f(row[inter + i]));
}

// out[r, :] = x[rows[r], :]. grid: rows; block: 256.
template <typename T>
__device__ void gather_rows(T* out, const T* x, const int* rows, int hidden) {
  const T* src = x + (i64)rows[blockIdx.x] * hidden;
  T* dst = out + (i64)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// Uniform values in [-scale, scale] from a counter hash (synthetic weights made on the device).
template <typename T>
__device__ void fill_uniform(T* out, i64 n, u64 seed, float scale) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    u64 z = seed + 0x9E3779B97F4A7C15ull * (u64)(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);
    out[i] = from_f<T>((2.0f * u - 1.0f) * scale);
  }
}

// out[i] = T(in[i]) from f32 (weights and test inputs are uploaded as f32 and converted on the device).
template <typename T>
__device__ void from_f32(T* out, const float* in, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = from_f<T>(in[i]);
}

// out[i] = f32(in[i]).
template <typename T>
__device__ void to_f32(float* out, const T* in, i64 n) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = to_f(in[i]);
}

#define ELEMENTWISE(T, S)                                                                                  \
  extern "C" __global__ void embed_##S(T* o, const T* t, const u32* ids, int h) { embed<T>(o, t, ids, h); } \
  extern "C" __global__ void silu_mul_##S(T* o, const T* gu, int inter) { silu_mul<T>(o, gu, inter); }     \
  extern "C" __global__ void gather_rows_##S(T* o, const T* x, const int* r, int h) {                      \
    gather_rows<T>(o, x, r, h);                                                                            \
  }                                                                                                        \
  extern "C" __global__ void fill_uniform_##S(T* o, i64 n, u64 seed, float scale) {                        \
    fill_uniform<T>(o, n, seed, scale);                                                                    \
  }                                                                                                        \
  extern "C" __global__ void from_f32_##S(T* o, const float* in, i64 n) { from_f32<T>(o, in, n); }         \
  extern "C" __global__ void to_f32_##S(float* o, const T* in, i64 n) { to_f32<T>(o, in, n); }
FOR_EACH_DTYPE(ELEMENTWISE)
