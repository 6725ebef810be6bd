// Causal prefill attention straight from the paged KV pool on tensor cores (FlashAttention-2 style, mma.sync
// m16n8k16 with f32 accumulation; bf16/f16 only). A block is FA_BQ = 128 queries of one head (8 warps x 16 rows);
// it walks the keys its last query may see in tiles of FA_BK = 64, K and V tiles double-buffered in shared memory
// by cp.async through the block table (the next tile loads while this one computes), keeps the online-softmax max
// and sum per row in registers, and never materialises the scores. Warps whose rows see none of a tile skip it.
// Queries are the chunk's rows row0..row0+len at positions start..start+len; the chunk's own K/V must already be in
// the pool. grid: (ceil(len / FA_BQ), heads); block: FA_THREADS; dynamic smem: 4 * FA_BK * (HD + 8) elements.
// The GEMM path in attention.rs stays the reference (and f32's path); the backend checks this kernel against it at
// start and falls back if they disagree.

#define FA_BQ 128
#define FA_BK 64
#define FA_THREADS 256

__device__ __forceinline__ u32 pack2(float lo, float hi, bf16) {
  return (u32)from_f<bf16>(lo).x | ((u32)from_f<bf16>(hi).x << 16);
}
__device__ __forceinline__ u32 pack2(float lo, float hi, f16) {
  return (u32)from_f<f16>(lo).x | ((u32)from_f<f16>(hi).x << 16);
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1, bf16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1, f16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes global -> shared, asynchronously; zero-filled when !ok.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Two 8x8 b16 matrices, transposed: the B fragment (k = key, n = dim) of V for mma.m16n8k16.
__device__ __forceinline__ void ldmatrix_x2_trans(u32& r0, u32& r1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(smem_addr(p)));
}

template <typename T, int HD>
__device__ void flash_prefill(const T* q, T* o, const T* kc, const T* vc, const int* table, int block_size, int heads,
                              int kv_heads, int row0, int start, int len, float scale) {
  extern __shared__ __align__(16) unsigned char fa_smem[];
  typedef T Row[HD + 8];
  Row* Ks = (Row*)fa_smem;            // [2 * FA_BK] rows: buffer b at b * FA_BK
  Row* Vs = Ks + 2 * FA_BK;
  const int h = blockIdx.y, kh = h / (heads / kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3, r = lane >> 2;
  const int q0 = blockIdx.x * FA_BQ;
  const int kvd = kv_heads * HD;
  const int qr = q0 + warp * 16 + r;  // this thread's rows: qr and qr + 8 (relative to the chunk)
  const float sl2 = scale * 1.4426950408889634f;

  // Q fragments (A operand, row-major 16 x 16 per k-step).
  u32 qf[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk++) {
    int c = kk * 16 + quad * 2;
#pragma unroll
    for (int half = 0; half < 2; half++) {
      int row = qr + half * 8;
      u32 lo = 0, hi = 0;
      if (row < len) {
        const T* src = q + ((i64)(row0 + row) * heads + h) * HD;
        lo = *(const u32*)(src + c);
        hi = *(const u32*)(src + c + 8);
      }
      qf[kk][half] = lo;      // a0 (row r) / a1 (row r + 8): cols c, c+1
      qf[kk][2 + half] = hi;  // a2 / a3: cols c + 8, c + 9
    }
  }
  float oacc[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; i++) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.0f;
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
  const int pos0 = start + qr, pos1 = pos0 + 8;  // positions of the thread's two rows
  const int kend = start + min(len, q0 + FA_BQ);  // keys the block's last query sees
  // The last position any row of this warp has (warps past the chunk's end have none).
  const int warp_last = (q0 + warp * 16 < len) ? start + min(len - 1, q0 + warp * 16 + 15) : -1;
  const int ntiles = (kend + FA_BK - 1) / FA_BK;

  auto load_tile = [&](int t) {
    const int kb = t * FA_BK, buf = (t & 1) * FA_BK;
    for (int c = threadIdx.x; c < FA_BK * HD / 8; c += blockDim.x) {
      int key = c / (HD / 8), part = (c % (HD / 8)) * 8, j = kb + key;
      bool ok = j < kend;
      i64 slot = ok ? (i64)table[j / block_size] * block_size + j % block_size : 0;
      i64 off = slot * kvd + (i64)kh * HD + part;
      cp_async16(&Ks[buf + key][part], kc + off, ok);
      cp_async16(&Vs[buf + key][part], vc + off, ok);
    }
    cp_async_commit();
  };

  load_tile(0);
  for (int t = 0; t < ntiles; t++) {
    const int kb = t * FA_BK, buf = (t & 1) * FA_BK;
    if (t + 1 < ntiles) {
      load_tile(t + 1);
      cp_async_wait_one();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    if (kb <= warp_last) {
  // S = Q K^T (16 rows x 64 keys per warp).
    float s[FA_BK / 8][4];
#pragma unroll
    for (int nt = 0; nt < FA_BK / 8; nt++) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
        u32 b0 = *(const u32*)&Ks[buf + nt * 8 + r][kk * 16 + quad * 2];
        u32 b1 = *(const u32*)&Ks[buf + nt * 8 + r][kk * 16 + quad * 2 + 8];
        mma16816(s[nt], qf[kk], b0, b1, T());
      }
    }
    // Mask (causal), scale into log2 units, online softmax.
    float mx[2] = {mrow[0], mrow[1]};
#pragma unroll
    for (int nt = 0; nt < FA_BK / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int j = kb + nt * 8 + quad * 2 + (e & 1);
        int pos = (e < 2) ? pos0 : pos1;
        float v = (j <= pos && j < kend) ? s[nt][e] * sl2 : NEG_INF;
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      alpha[i] = (mrow[i] == NEG_INF) ? 0.0f : exp2f(mrow[i] - mx[i]);
      mrow[i] = mx[i];
      lrow[i] *= alpha[i];
    }
#pragma unroll
    for (int nt = 0; nt < FA_BK / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float m = mrow[e >> 1];
        float p = (m == NEG_INF || s[nt][e] == NEG_INF) ? 0.0f : exp2f(s[nt][e] - m);
        s[nt][e] = p;
        lrow[e >> 1] += p;
      }
    }
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
      oacc[i][0] *= alpha[0];
      oacc[i][1] *= alpha[0];
      oacc[i][2] *= alpha[1];
      oacc[i][3] *= alpha[1];
    }
    // O += P V: P (rounded to T) is the A operand, 16 keys per k-step.
#pragma unroll
    for (int kk = 0; kk < FA_BK / 16; kk++) {
      u32 a[4];
      a[0] = pack2(s[2 * kk][0], s[2 * kk][1], T());
      a[1] = pack2(s[2 * kk][2], s[2 * kk][3], T());
      a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T());
      a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T());
#pragma unroll
      for (int nt = 0; nt < HD / 8; nt++) {
        u32 b0, b1;
        ldmatrix_x2_trans(b0, b1, &Vs[buf + kk * 16 + (lane & 15)][nt * 8]);
        mma16816(oacc[nt], a, b0, b1, T());
      }
    }
    }  // kb <= warp_last
    __syncthreads();  // the next iteration's load overwrites the other buffer
  }
  // Normalise and write.
#pragma unroll
  for (int i = 0; i < 2; i++) {
    lrow[i] += __shfl_xor_sync(0xffffffffu, lrow[i], 1);
    lrow[i] += __shfl_xor_sync(0xffffffffu, lrow[i], 2);
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {
    int row = qr + half * 8;
    if (row >= len) continue;
    float inv = lrow[half] > 0.0f ? 1.0f / lrow[half] : 0.0f;
    T* dst = o + ((i64)(row0 + row) * heads + h) * HD;
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
      *(u32*)(dst + nt * 8 + quad * 2) = pack2(oacc[nt][2 * half] * inv, oacc[nt][2 * half + 1] * inv, T());
    }
  }
}

// Entry points (explicit: the runtime looks kernels up by these names).
extern "C" __global__ void __launch_bounds__(FA_THREADS)
flash_prefill_bf16_hd64(const bf16* q, bf16* o, const bf16* kc, const bf16* vc, const int* table, int bs, int heads,
                        int kvh, int row0, int start, int len, float scale) {
  flash_prefill<bf16, 64>(q, o, kc, vc, table, bs, heads, kvh, row0, start, len, scale);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS)
flash_prefill_bf16_hd128(const bf16* q, bf16* o, const bf16* kc, const bf16* vc, const int* table, int bs, int heads,
                         int kvh, int row0, int start, int len, float scale) {
  flash_prefill<bf16, 128>(q, o, kc, vc, table, bs, heads, kvh, row0, start, len, scale);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS)
flash_prefill_f16_hd64(const f16* q, f16* o, const f16* kc, const f16* vc, const int* table, int bs, int heads,
                       int kvh, int row0, int start, int len, float scale) {
  flash_prefill<f16, 64>(q, o, kc, vc, table, bs, heads, kvh, row0, start, len, scale);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS)
flash_prefill_f16_hd128(const f16* q, f16* o, const f16* kc, const f16* vc, const int* table, int bs, int heads,
                        int kvh, int row0, int start, int len, float scale) {
  flash_prefill<f16, 128>(q, o, kc, vc, table, bs, heads, kvh, row0, start, len, scale);
}
