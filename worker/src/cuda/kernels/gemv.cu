// Skinny matrix products for decode steps: y[m, n] = x[m, k] . w[n, k]^T with m <= GEMV_MAX_ROWS, bandwidth-bound
// (the weights are read once per step). One warp per output column: 32 lanes x 8 elements stream a weight row as
// 16-byte loads, GEMV_UNROLL loads in flight, the m input rows read through L1. k % 8 == 0, rows 16-byte aligned.
// cuBLAS picks far slower kernels for m = 1..8 with bf16 inputs. grid: ceil(n / 8); block: 256.

#define GEMV_MAX_ROWS 8
#define GEMV_UNROLL 4

template <typename T, typename Y, int M>
__device__ void gemv(Y* y, int ldy, const T* x, int ldx, const T* w, int n, int k) {
  const int lane = threadIdx.x & 31;
  const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (j >= n) return;
  const T* wr = w + (i64)j * k;
  float acc[M];
#pragma unroll
  for (int t = 0; t < M; t++) acc[t] = 0.0f;
  const int span = 32 * 8;
  int c = lane * 8;
  for (; c + (GEMV_UNROLL - 1) * span < k; c += GEMV_UNROLL * span) {
    float wv[GEMV_UNROLL][8];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; u++) load8(wr + c + u * span, wv[u]);
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; u++) {
#pragma unroll
      for (int t = 0; t < M; t++) {
        float xv[8];
        load8(x + (i64)t * ldx + c + u * span, xv);
#pragma unroll
        for (int e = 0; e < 8; e++) acc[t] += wv[u][e] * xv[e];
      }
    }
  }
  for (; c < k; c += span) {
    float wv[8];
    load8(wr + c, wv);
#pragma unroll
    for (int t = 0; t < M; t++) {
      float xv[8];
      load8(x + (i64)t * ldx + c, xv);
#pragma unroll
      for (int e = 0; e < 8; e++) acc[t] += wv[e] * xv[e];
    }
  }
#pragma unroll
  for (int t = 0; t < M; t++) {
    float v = warp_sum(acc[t]);
    if (lane == 0) y[(i64)t * ldy + j] = from_f<Y>(v);
  }
}

#define GEMV_M(T, S, M)                                                                                         \
  extern "C" __global__ void gemv_##S##_m##M(T* y, int ldy, const T* x, int ldx, const T* w, int n, int k) {    \
    gemv<T, T, M>(y, ldy, x, ldx, w, n, k);                                                                     \
  }                                                                                                             \
  extern "C" __global__ void gemv_##S##_f32out_m##M(float* y, int ldy, const T* x, int ldx, const T* w, int n,  \
                                                    int k) {                                                    \
    gemv<T, float, M>(y, ldy, x, ldx, w, n, k);                                                                 \
  }
#define GEMV(T, S)                                                                                              \
  GEMV_M(T, S, 1) GEMV_M(T, S, 2) GEMV_M(T, S, 3) GEMV_M(T, S, 4)                                               \
  GEMV_M(T, S, 5) GEMV_M(T, S, 6) GEMV_M(T, S, 7) GEMV_M(T, S, 8)
FOR_EACH_DTYPE(GEMV)
