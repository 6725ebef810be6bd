// Shared by every kernel file (prepended before NVRTC compiles it): storage types, conversions, vector loads,
// reductions. Self-contained: no CUDA headers, so NVRTC needs no include path (the NVRTC wheel ships none).
// Storage types are structs so that overloads tell bf16 and f16 apart; math is always f32.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

struct bf16 { u16 x; };
struct f16 { u16 x; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __uint_as_float(((u32)v.x) << 16); }
__device__ __forceinline__ float to_f(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
  return f;
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
// Round to nearest even, as torch does; NaN stays NaN.
template <> __device__ __forceinline__ bf16 from_f<bf16>(float v) {
  u32 u = __float_as_uint(v);
  bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.x = (u16)((u >> 16) | 0x40);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.x = (u16)(u >> 16);
  }
  return r;
}
template <> __device__ __forceinline__ f16 from_f<f16>(float v) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(v));
  return r;
}

// Rounds through the storage type (what a framework computing in T would have stored).
template <typename T> __device__ __forceinline__ float round_t(float v) { return to_f(from_f<T>(v)); }

// Eight consecutive elements as floats (16-byte aligned for 2-byte types, 32-byte for f32).
__device__ __forceinline__ void load8(const float* p, float* o) {
  float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
template <typename H> __device__ __forceinline__ void load8(const H* p, float* o) {
  uint4 v = *(const uint4*)p;
  u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    H lo, hi;
    lo.x = (u16)(w[i] & 0xffffu);
    hi.x = (u16)(w[i] >> 16);
    o[2 * i] = to_f(lo);
    o[2 * i + 1] = to_f(hi);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float red[32];
  __syncthreads();
  v = warp_sum(v);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v) {
  __shared__ float redm[32];
  __syncthreads();
  v = warp_max(v);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) redm[warp] = v;
  __syncthreads();
  v = lane < nw ? redm[lane] : NEG_INF;
  return warp_max(v);
}

// One extern "C" entry point per storage type: NAME_f32, NAME_bf16, NAME_f16.
#define FOR_EACH_DTYPE(M) M(float, f32) M(bf16, bf16) M(f16, f16)
