// Greedy sampling on the device: the arg-max of each logits row (lowest index on ties, as the CPU sampler), so a
// greedy step copies 4 bytes per sequence back instead of the vocabulary's logits. grid: rows; block: 1024.

// Warp-wide arg-max of (best, idx) pairs; every lane gets the winner.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, best, o);
    int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > best || (ov == best && oi < idx)) {
      best = ov;
      idx = oi;
    }
  }
}

extern "C" __global__ void argmax_rows(u32* out, const float* logits, int vocab) {
  const float* row = logits + (i64)blockIdx.x * vocab;
  float best = NEG_INF;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    float v = row[i];
    if (v > best || (v == best && i < idx)) {
      best = v;
      idx = i;
    }
  }
  __shared__ float bv[32];
  __shared__ int bi[32];
  warp_argmax(best, idx);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    bv[warp] = best;
    bi[warp] = idx;
  }
  __syncthreads();
  if (warp == 0) {
    int nw = blockDim.x >> 5;
    best = lane < nw ? bv[lane] : NEG_INF;
    idx = lane < nw ? bi[lane] : 0x7fffffff;
    warp_argmax(best, idx);
    if (lane == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0u : (u32)idx;
  }
}
