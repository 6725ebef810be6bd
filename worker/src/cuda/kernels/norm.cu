// RMSNorm, alone and fused with the residual add before it. Numerics follow HF's LlamaRMSNorm: the sum of squares
// in f32, the normalised row rounded to T, then multiplied by the weight in T.

template <typename T>
__device__ void rms_row(T* out, const T* x, const T* w, int hidden, float eps) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_f(x[i]);
    ss += v * v;
  }
  float r = rsqrtf(block_sum(ss) / (float)hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[i] = from_f<T>(to_f(w[i]) * round_t<T>(to_f(x[i]) * r));
}

// out = rmsnorm(x) * w. grid: rows; block: 256.
template <typename T>
__device__ void rmsnorm(T* out, const T* x, const T* w, int hidden, float eps) {
  i64 off = (i64)blockIdx.x * hidden;
  rms_row<T>(out + off, x + off, w, hidden, eps);
}

// x += y (rounded to T); out = rmsnorm(x) * w. grid: rows; block: 256.
template <typename T>
__device__ void add_rmsnorm(T* x, const T* y, T* out, const T* w, int hidden, float eps) {
  i64 off = (i64)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[off + i] = from_f<T>(to_f(x[off + i]) + to_f(y[off + i]));
  __syncthreads();
  rms_row<T>(out + off, x + off, w, hidden, eps);
}

#define NORM(T, S)                                                                                           \
  extern "C" __global__ void rmsnorm_##S(T* o, const T* x, const T* w, int h, float eps) {                   \
    rmsnorm<T>(o, x, w, h, eps);                                                                             \
  }                                                                                                          \
  extern "C" __global__ void add_rmsnorm_##S(T* x, const T* y, T* o, const T* w, int h, float eps) {         \
    add_rmsnorm<T>(x, y, o, w, h, eps);                                                                      \
  }
FOR_EACH_DTYPE(NORM)
