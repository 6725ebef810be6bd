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

// Four 8x8 b16 matrices (lanes 8i..8i+7 address matrix i's rows): B fragments of two k-steps of K.
__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p)));
}
// The same, transposed: B fragments (k = key, n = dim) of V for two n-tiles.
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p)));
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
      for (int kk = 0; kk < HD / 16; kk += 2) {
        u32 b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, &Ks[buf + nt * 8 + (lane & 7)][kk * 16 + (lane >> 3) * 8]);
        mma16816(s[nt], qf[kk], b0, b1, T());
        mma16816(s[nt], qf[kk + 1], b2, b3, T());
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
      for (int nt = 0; nt < HD / 8; nt += 2) {
        u32 b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, &Vs[buf + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][nt * 8 + (lane >> 4) * 8]);
        mma16816(oacc[nt], a, b0, b1, T());
        mma16816(oacc[nt + 1], a, b2, b3, T());
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

// ---------------------------------------------------------------------------------------------------------------
// Decode on tensor cores for grouped-query attention (one query token per sequence). Block (seq, kv_head, split),
// FD_WARPS warps each taking a quarter of the split's keys in tiles of FD_TILE; the G <= 8 query heads of the KV
// head are rows 0..G of the 16-row A operand (rows G..16 are zero: the tensor cores idle on them, the kernel is
// memory-bound anyway). Operands go from global memory straight into registers in permuted orders that make each
// thread's fragment elements contiguous 16-byte loads: Q and K share a permutation of the head dim (it is summed
// over), and P.V's output dims come out permuted and are stored back in order. Writes paged_decode's partials
// (max in natural-log units), merged by decode_reduce.
#define FD_WARPS 4
#define FD_TILE 64

template <typename T, int HD>
__device__ void flash_decode(const T* q, const int* q_rows, const T* kc, const T* vc, const int* block_tables,
                             int max_blocks, const int* ctx_lens, int block_size, int heads, int kv_heads, float scale,
                             int part, float* part_acc, float* part_ml) {
  extern __shared__ __align__(16) unsigned char fd_smem[];
  int* slot_s = (int*)fd_smem;                 // [part]
  float* red = (float*)(fd_smem + part * 4);   // [FD_WARPS][8][HD + 2]: acc, then m, l
  const int b = blockIdx.x, kh = blockIdx.y, s = blockIdx.z, splits = gridDim.z;
  const int G = heads / kv_heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, quad = lane & 3, r = lane >> 2;
  const int kvd = kv_heads * HD;
  const int ctx = ctx_lens[b];
  const int k0 = s * part, k1 = min(ctx, k0 + part);
  const i64 out_base = ((i64)b * heads + (i64)kh * G) * splits + s;  // + gi * splits
  if (k0 >= k1) {
    for (int i = tid; i < G * HD; i += blockDim.x) part_acc[(out_base + (i64)(i / HD) * splits) * HD + i % HD] = 0.0f;
    if (tid < G) {
      part_ml[(out_base + (i64)tid * splits) * 2] = NEG_INF;
      part_ml[(out_base + (i64)tid * splits) * 2 + 1] = 0.0f;
    }
    return;
  }
  const int* table = block_tables + (i64)b * max_blocks;
  for (int jj = tid; jj < k1 - k0; jj += blockDim.x) {
    int j = k0 + jj;
    slot_s[jj] = table[j / block_size] * block_size + j % block_size;
  }
  __syncthreads();
  const float sl2 = scale * 1.4426950408889634f;
  constexpr int QW = HD / 8;   // 32-bit words of a thread's Q/K chunk (HD / 4 elements)
  constexpr int VE = HD / 8;   // elements of a thread's V chunk per key
  // Q chunk: head kh * G + r, dims [quad * HD / 4, +HD / 4); words 2kk / 2kk + 1 are a0 / a2 of k-step kk.
  u32 qw[QW];
#pragma unroll
  for (int i = 0; i < QW; i++) qw[i] = 0u;
  if (r < G) {
    const uint4* src = (const uint4*)(q + ((i64)q_rows[b] * heads + kh * G + r) * HD + quad * (HD / 4));
#pragma unroll
    for (int i = 0; i < QW / 4; i++) {
      uint4 v = src[i];
      qw[4 * i] = v.x;
      qw[4 * i + 1] = v.y;
      qw[4 * i + 2] = v.z;
      qw[4 * i + 3] = v.w;
    }
  }
  float oacc[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; i++) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.0f;
  float m = NEG_INF, l = 0.0f;
  const int wpart = part / FD_WARPS;
  const int wk0 = k0 + warp * wpart, wk1 = min(k1, wk0 + wpart);
  for (int kb = wk0; kb < wk1; kb += FD_TILE) {
    float sc[FD_TILE / 8][4];
#pragma unroll
    for (int nt = 0; nt < FD_TILE / 8; nt++) {
      int j = min(kb + nt * 8 + r, k1 - 1);
      const uint4* kp = (const uint4*)(kc + (i64)slot_s[j - k0] * kvd + (i64)kh * HD + quad * (HD / 4));
      u32 kw[QW];
#pragma unroll
      for (int i = 0; i < QW / 4; i++) {
        uint4 v = kp[i];
        kw[4 * i] = v.x;
        kw[4 * i + 1] = v.y;
        kw[4 * i + 2] = v.z;
        kw[4 * i + 3] = v.w;
      }
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
        u32 a[4] = {qw[2 * kk], 0u, qw[2 * kk + 1], 0u};
        mma16816(sc[nt], a, kw[2 * kk], kw[2 * kk + 1], T());
      }
    }
    // Row r's scores (c0, c1 of each n-tile): mask past the warp's keys, log2 units, online softmax.
    float mx = m;
#pragma unroll
    for (int nt = 0; nt < FD_TILE / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        int j = kb + nt * 8 + quad * 2 + e;
        float v = j < wk1 ? sc[nt][e] * sl2 : NEG_INF;
        sc[nt][e] = v;
        mx = fmaxf(mx, v);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float alpha = (m == NEG_INF) ? 0.0f : exp2f(m - mx);
    m = mx;
    l *= alpha;
#pragma unroll
    for (int nt = 0; nt < FD_TILE / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        float p = sc[nt][e] == NEG_INF ? 0.0f : exp2f(sc[nt][e] - m);
        sc[nt][e] = p;
        l += p;
      }
    }
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
      oacc[i][0] *= alpha;
      oacc[i][1] *= alpha;
    }
    // O += P V, 16 keys per k-step: keys kk*16 + 2q + {0,1} (b0) and + 8 (b1); dims r * VE + nt.
#pragma unroll
    for (int kk = 0; kk < FD_TILE / 16; kk++) {
      u32 a[4] = {pack2(sc[2 * kk][0], sc[2 * kk][1], T()), 0u, pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1], T()), 0u};
      u32 vw[4][VE / 2];
#pragma unroll
      for (int t = 0; t < 4; t++) {
        int j = min(kb + kk * 16 + quad * 2 + (t & 1) + (t >> 1) * 8, k1 - 1);
        const uint4* vp = (const uint4*)(vc + (i64)slot_s[j - k0] * kvd + (i64)kh * HD + r * VE);
#pragma unroll
        for (int i = 0; i < VE / 8; i++) {
          uint4 v = vp[i];
          vw[t][4 * i] = v.x;
          vw[t][4 * i + 1] = v.y;
          vw[t][4 * i + 2] = v.z;
          vw[t][4 * i + 3] = v.w;
        }
      }
#pragma unroll
      for (int nt = 0; nt < HD / 8; nt++) {
        const u32 sel = (nt & 1) ? 0x7632u : 0x5410u;
        u32 b0 = __byte_perm(vw[0][nt / 2], vw[1][nt / 2], sel);
        u32 b1 = __byte_perm(vw[2][nt / 2], vw[3][nt / 2], sel);
        mma16816(oacc[nt], a, b0, b1, T());
      }
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  // Warp partials to shared memory (row r = query head kh * G + r), dims in order.
  float* mine = red + (warp * 8 + r) * (HD + 2);
  if (r < G) {
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
      mine[(2 * quad) * VE + nt] = oacc[nt][0];
      mine[(2 * quad + 1) * VE + nt] = oacc[nt][1];
    }
    if (quad == 0) {
      mine[HD] = m;
      mine[HD + 1] = l;
    }
  }
  __syncthreads();
  for (int i = tid; i < G * HD; i += blockDim.x) {
    int gi = i / HD, d = i % HD;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < FD_WARPS; w++) M = fmaxf(M, red[(w * 8 + gi) * (HD + 2) + HD]);
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < FD_WARPS; w++) {
      float mw = red[(w * 8 + gi) * (HD + 2) + HD];
      if (mw != NEG_INF) acc += red[(w * 8 + gi) * (HD + 2) + d] * exp2f(mw - M);
    }
    part_acc[(out_base + (i64)gi * splits) * HD + d] = acc;
  }
  if (tid < G) {
    float M = NEG_INF, L = 0.0f;
    for (int w = 0; w < FD_WARPS; w++) M = fmaxf(M, red[(w * 8 + tid) * (HD + 2) + HD]);
    for (int w = 0; w < FD_WARPS; w++) {
      float mw = red[(w * 8 + tid) * (HD + 2) + HD];
      if (mw != NEG_INF) L += red[(w * 8 + tid) * (HD + 2) + HD + 1] * exp2f(mw - M);
    }
    part_ml[(out_base + (i64)tid * splits) * 2] = M * 0.6931471805599453f;  // log2 -> natural-log units
    part_ml[(out_base + (i64)tid * splits) * 2 + 1] = L;
  }
}

extern "C" __global__ void __launch_bounds__(FD_WARPS * 32)
flash_decode_bf16_hd64(const bf16* q, const int* q_rows, const bf16* kc, const bf16* vc, const int* bt, int max_blocks,
                       const int* ctx, int bs, int heads, int kvh, float scale, int part, float* pa, float* pml) {
  flash_decode<bf16, 64>(q, q_rows, kc, vc, bt, max_blocks, ctx, bs, heads, kvh, scale, part, pa, pml);
}
extern "C" __global__ void __launch_bounds__(FD_WARPS * 32)
flash_decode_bf16_hd128(const bf16* q, const int* q_rows, const bf16* kc, const bf16* vc, const int* bt, int max_blocks,
                        const int* ctx, int bs, int heads, int kvh, float scale, int part, float* pa, float* pml) {
  flash_decode<bf16, 128>(q, q_rows, kc, vc, bt, max_blocks, ctx, bs, heads, kvh, scale, part, pa, pml);
}
extern "C" __global__ void __launch_bounds__(FD_WARPS * 32)
flash_decode_f16_hd64(const f16* q, const int* q_rows, const f16* kc, const f16* vc, const int* bt, int max_blocks,
                      const int* ctx, int bs, int heads, int kvh, float scale, int part, float* pa, float* pml) {
  flash_decode<f16, 64>(q, q_rows, kc, vc, bt, max_blocks, ctx, bs, heads, kvh, scale, part, pa, pml);
}
extern "C" __global__ void __launch_bounds__(FD_WARPS * 32)
flash_decode_f16_hd128(const f16* q, const int* q_rows, const f16* kc, const f16* vc, const int* bt, int max_blocks,
                       const int* ctx, int bs, int heads, int kvh, float scale, int part, float* pa, float* pml) {
  flash_decode<f16, 128>(q, q_rows, kc, vc, bt, max_blocks, ctx, bs, heads, kvh, scale, part, pa, pml);
}
