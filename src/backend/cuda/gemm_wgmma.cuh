// Hopper (sm_90a) mainloop of the prefill GEMM for 4-bit weights and fp16 operands (P1w): a
// warp-specialised CTA of 3 warpgroups. Warpgroup 0 (producer) streams the packed codes, scales/biases
// and activation rows of each 64-column K step into shared memory with cp.async, dequantises every
// weight stage ONCE into an fp16 tile in the 128-byte-swizzled K-major layout that wgmma reads, and
// signals the stage on an mbarrier; warpgroups 1 and 2 (consumers) each issue wgmma.mma_async
// m64nBMk16 on 64 of the CTA's 128 weight rows with both operands taken from shared memory by
// descriptor. Orientation is swapped w.r.t. gemm_kernel: wgmma's M is the weight rows (fixed 128 per
// CTA) and its N the tokens (BM = 32/64/128), so the small expert tiles of the MoE stay legal wgmma
// shapes. Epilogues, tiles, operand scaling and rounding are those of gemm_kernel (same results up to
// summation order). Included by gemm.cu inside its anonymous namespace; layouts: docs/CUDA.md
// "wgmma GEMM".

#include "backend/cuda/gemm_wgmma_mma.inc"

constexpr int kWgThreads = 384;   // producer warpgroup + 2 consumer warpgroups

// Stages in the ring and the producer's load lead (steps between a stage's cp.async and its
// dequantisation). The producer may reuse a slot once the consumers finished the step S before, so
// the lead is S - 2: it then waits for step kg - 2 while the consumers work on kg - 1.
template <int BM>
struct WgCfg {
  static constexpr int S = BM == 128 ? 5 : 7;
  static constexpr int D = S - 2;
  static constexpr int W_BYTES = kBN * 128;     // fp16 weights, 128 rows x 64 k
  static constexpr int X_BYTES = BM * 128;      // fp16 activations, BM rows x 64 k
  static constexpr int R_BYTES = kBN * 32;      // packed 4-bit codes, 128 rows x 32 bytes
  static constexpr int OFF_X = S * W_BYTES;
  static constexpr int OFF_R = OFF_X + S * X_BYTES;
  static constexpr int OFF_SB = OFF_R + S * R_BYTES;            // [2 kinds][2 slots][128 rows][8 groups] bf16
  static constexpr int OFF_GF = OFF_SB + 2 * 2 * kBN * 16;      // AM 2: [BM][16] fp16 factors
  static constexpr int OFF_RF = OFF_GF + BM * (kMaxGrpK / 64) * 2;   // AM 2: [BM] f32 epilogue factors
  static constexpr int OFF_BAR = OFF_RF + BM * 4;               // full[S], empty[S]
  static constexpr int BYTES = OFF_BAR + 2 * S * 8;
  static constexpr int SMEM = BYTES + 1024;                     // slack to align the base to 1024
  static constexpr int XCH = BM * 8 / 128;                      // 16-byte activation chunks per producer thread
  static_assert(W_BYTES % 1024 == 0 && X_BYTES % 1024 == 0 && OFF_BAR % 8 == 0, "swizzle atoms are 1024-aligned");
  static_assert(BM * kSvLd * 4 <= S * W_BYTES, "SwiGLU staging tile fits in the weight ring");
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

// The producer turns words of a row's 64-column group into 16-byte chunks in k-order: chunk c holds
// staged columns L = 8c + u (u = 0..7), input columns gemm_kperm(L). That is nibble p = c & 3 (u even)
// and p + 4 (u odd) of word 2(u >> 1) + (c >> 2), i.e. exactly the pair dq4_pair(word, p) returns.
constexpr bool wg_chunk_map_ok() {
  for (int c = 0; c < 8; ++c)
    for (int u = 0; u < 8; ++u)
      if (gemm_kperm(8 * c + u) != 8 * (2 * (u >> 1) + (c >> 2)) + (c & 3) + 4 * (u & 1)) return false;
  return true;
}
static_assert(wg_chunk_map_ok(), "producer chunk map must match the activation k-order");

// Shared-memory matrix descriptor (PTX ISA, wgmma "matrix descriptor"): bits 0-13 start address >> 4,
// 16-29 leading byte offset >> 4 (unused for swizzled K-major operands; 1), 32-45 stride byte offset
// >> 4 (1024: the distance between 8-row core-matrix groups, rows being 128 bytes), 49-51 base
// offset 0 (every tile starts on a 1024-byte boundary), 62-63 swizzle mode 1 = 128 bytes.
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  return uint64_t((saddr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
template <int R>
__device__ __forceinline__ void wg_fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Generic-proxy writes (st.shared, cp.async) made visible to the async proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int BM>
__device__ __forceinline__ void wgmma_tile(float* d, uint64_t da, uint64_t db) {
  if constexpr (BM == 32) wgmma_f16_n32(d, da, db);
  else if constexpr (BM == 64) wgmma_f16_n64(d, da, db);
  else wgmma_f16_n128(d, da, db);
}

template <int BM, int AM>
__global__ void __launch_bounds__(kWgThreads, 1) gemm_wgmma_kernel(const __grid_constant__ GemmArgs a) {
  using C = WgCfg<BM>;
  constexpr int S = C::S, D = C::D;
  static_assert(AM == kAmF16 || AM == kAmF16Grp, "wgmma path: fp16 operands only");
  extern __shared__ __align__(1024) uint8_t wg_smem_raw[];
  // The 128-byte swizzle is a function of address bits 4-9, so tiles must start 1024-aligned.
  const uint32_t raw0 = smem_addr(wg_smem_raw);
  const uint32_t pad = ((raw0 + 1023u) & ~1023u) - raw0;
  uint8_t* smem = wg_smem_raw + pad;
  const uint32_t sm0 = raw0 + pad;
  uint16_t* sgf = reinterpret_cast<uint16_t*>(smem + C::OFF_GF);
  float* srf = reinterpret_cast<float*>(smem + C::OFF_RF);
  const uint32_t bar_full = sm0 + C::OFF_BAR, bar_empty = bar_full + 8 * S;

  const int tid = threadIdx.x;
  const bool producer = tid < 128;
  const bool plain = a.tiles == nullptr;
  pdl_trigger();
  if (!plain || !producer) pdl_wait();
  int group = 0, pos0, rows;
  if (!plain) {
    if (int(blockIdx.x) >= *a.n_tiles) return;
    const int4 tl = a.tiles[blockIdx.x];
    group = tl.x;
    pos0 = tl.y;
    rows = tl.z;
  } else {
    pos0 = blockIdx.x * BM;
    rows = min(BM, a.M - pos0);
  }
  const int K = a.K, nk = K / kBK;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full + 8 * s, 128);    // every producer thread arrives once per fill
      mbar_init(bar_empty + 8 * s, 256);   // every consumer thread arrives once per use
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  if (producer) {
    // ---- producer warpgroup: thread r owns weight row r of the tile (codes, scale, bias) ----
    const int r = tid;
    int mat, col;
    if (a.swiglu) {   // 64 gate + 64 up rows interleaved per 8, as gemm_kernel
      mat = (r >> 3) & 1;
      col = blockIdx.y * (kBN / 2) + (r >> 4) * 8 + (r & 7);
    } else {
      mat = 0;
      col = blockIdx.y * kBN + r;
    }
    const bool bval = col < a.N;
    const QMat& w = group < a.b.n_groups ? a.b.w[mat] : a.b.extra[mat];
    const int64_t goff = group < a.b.n_groups ? int64_t(group) * a.b.stride : 0;
    const int64_t gsoff = group < a.b.n_groups ? int64_t(group) * a.b.sb_stride : 0;
    const uint8_t* bsrc = static_cast<const uint8_t*>(w.data) + goff + int64_t(bval ? col : 0) * (K / 2);
    const uint8_t* ssrc = static_cast<const uint8_t*>(w.scales) + gsoff + int64_t(bval ? col : 0) * (K / 64) * 2;
    const uint8_t* bisrc = static_cast<const uint8_t*>(w.biases) + gsoff + int64_t(bval ? col : 0) * (K / 64) * 2;
    // Scales/biases of 8 groups per 16-byte copy, two slots: [kind][slot][row][8].
    const uint32_t sb_dst = sm0 + C::OFF_SB + r * 16;
    auto load_b = [&](int q) {
      const uint32_t rd = sm0 + C::OFF_R + (q % S) * C::R_BYTES + r * 32;
      cp_async16(rd, bsrc + int64_t(q) * 32, bval);
      cp_async16(rd + 16, bsrc + int64_t(q) * 32 + 16, bval);
      if ((q & 7) == 0) {
        const int slot = (q >> 3) & 1;
        cp_async16(sb_dst + (0 * 2 + slot) * kBN * 16, ssrc + (q >> 3) * 16, bval);
        cp_async16(sb_dst + (1 * 2 + slot) * kBN * 16, bisrc + (q >> 3) * 16, bval);
      }
    };
    // Activation chunks of this thread: row m = idx >> 3, k-order chunk c = idx & 7.
    const uint16_t* asrc[C::XCH];
    bool aval[C::XCH];
    int adst[C::XCH], am[C::XCH];
#pragma unroll
    for (int j = 0; j < C::XCH; ++j) {
      const int idx = tid + j * 128, m = idx >> 3, c = idx & 7;
      am[j] = m;
      aval[j] = m < rows;
      int src = 0;
      if (aval[j]) src = a.a_rows ? a.a_rows[pos0 + m] : pos0 + m;
      asrc[j] = a.a + int64_t(src) * K + c * 8;
      adst[j] = swz(m, c);
    }
    auto load_x = [&](int q) {
      const uint32_t xs = sm0 + C::OFF_X + (q % S) * C::X_BYTES;
#pragma unroll
      for (int j = 0; j < C::XCH; ++j) cp_async16(xs + adst[j], asrc[j] + q * kBK, aval[j]);
    };
    // AM 2: per-row factors 2^(s_row - s_group) (fp16) and the epilogue factor 2^-(s_row + 8), as
    // gemm_kernel; visible to the consumers after the CTA barrier below.
    if constexpr (AM == kAmF16Grp) {
      if (tid < BM) grp_row_factors(a, tid, pos0, rows, K, sgf, srf);
    }
    // Prologue: steps 0..D-1 (slots never used yet). Plain mode: the weights (immutable) are requested
    // before the PDL wait (and before the CTA barrier, which the consumers reach only after theirs)
    // and join the first commit group.
    if (plain)
      for (int q = 0; q < D; ++q)
        if (q < nk) load_b(q);
    __syncthreads();   // barrier init and AM-2 factors visible to all 384 threads
    if (plain) pdl_wait();
    for (int q = 0; q < D; ++q) {
      if (q < nk) {
        if (!plain) load_b(q);
        load_x(q);
      }
      cp_commit();
    }
    for (int kg = 0; kg < nk; ++kg) {
      const int q = kg + D;
      if (q < nk) {
        // Slot q % S last held step q - S: wait until both consumer warpgroups released it.
        if (q >= S) mbar_wait(bar_empty + 8 * (q % S), ((q / S) + 1) & 1);
        load_b(q);
        load_x(q);
      }
      cp_commit();
      cp_wait<D>();   // this thread's copies of steps <= kg have landed
      const int s = kg % S;
      const uint4* rw = reinterpret_cast<const uint4*>(smem + C::OFF_R + s * C::R_BYTES + r * 32);
      const uint4 w0 = rw[0], w1 = rw[1];
      const uint32_t wd[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      const int slot = (kg >> 3) & 1;
      const uint16_t sv = reinterpret_cast<const uint16_t*>(smem + C::OFF_SB + (0 * 2 + slot) * kBN * 16 + r * 16)[kg & 7];
      const uint16_t bv = reinterpret_cast<const uint16_t*>(smem + C::OFF_SB + (1 * 2 + slot) * kBN * 16 + r * 16)[kg & 7];
      const uint32_t s2 = h2_bits(__float2half2_rn(__uint_as_float(uint32_t(sv) << 16) * float(1 << kGemmF16WExp)));
      const uint32_t b2 = h2_bits(__float2half2_rn(__uint_as_float(uint32_t(bv) << 16) * float(1 << kGemmF16WExp)));
      uint8_t* ws = smem + s * C::W_BYTES;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        uint32_t o[4];
#pragma unroll
        for (int v = 0; v < 4; ++v) o[v] = dq4_pair<true>(wd[2 * v + (c >> 2)], c & 3, s2, b2);
        *reinterpret_cast<uint4*>(ws + swz(r, c)) = make_uint4(o[0], o[1], o[2], o[3]);
      }
      if constexpr (AM == kAmF16Grp) {   // this group's factor on the thread's own activation chunks
        uint8_t* xs = smem + C::OFF_X + s * C::X_BYTES;
#pragma unroll
        for (int j = 0; j < C::XCH; ++j) {
          if (!aval[j]) continue;
          grp_scale_chunk(xs + adst[j], sgf, am[j], kg);
        }
      }
      fence_proxy_async();
      mbar_arrive(bar_full + 8 * s);
    }
    cp_wait<0>();
    return;
  }

  // ---- consumer warpgroups: wgc 0/1 computes weight rows 64·wgc .. 64·wgc + 63 of the tile ----
  __syncthreads();
  const int ct = tid - 128, wgc = ct >> 7, warp = (ct >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int R = BM / 2;   // accumulators per thread: 64 x BM over 128 threads
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
  for (int kg = 0; kg < nk; ++kg) {
    const int s = kg % S;
    mbar_wait(bar_full + 8 * s, (kg / S) & 1);
    const uint32_t wa = sm0 + s * C::W_BYTES + wgc * 64 * 128;
    const uint32_t xa = sm0 + C::OFF_X + s * C::X_BYTES;
    wg_fence_regs<R>(acc);
    wg_fence();
#pragma unroll
    for (int i = 0; i < 4; ++i)   // k16 steps: 32 bytes further inside each 128-byte swizzled row
      wgmma_tile<BM>(acc, wg_desc(wa + 32 * i), wg_desc(xa + 32 * i));
    wg_commit();
    wg_wait<1>();   // step kg - 1 has finished reading its slot
    wg_fence_regs<R>(acc);
    if (kg > 0) mbar_arrive(bar_empty + 8 * ((kg - 1) % S));
  }
  wg_wait<0>();
  wg_fence_regs<R>(acc);

  // ---- epilogue. Accumulator i of a thread (warp w of its warpgroup, lane 4g + t): weight row
  // 16w + g + 8·((i >> 1) & 1) of the warpgroup's 64, token 8·(i >> 2) + 2t + (i & 1). ----
  auto row_factor = [&](int m) -> float {
    if constexpr (AM == kAmF16Grp) return srf[m];
    return a.a_scale[a.a_rows ? a.a_rows[pos0 + m] : pos0 + m] * kInvW;
  };
  if (a.mode == kSwiGLU) {
    // Row r = 16·(4·wgc + w) + 8h + g is the gate (h = 0) or up (h = 1) row of column (4·wgc + w)·8 + g
    // of the CTA's 64 (gemm_kernel's interleave), so one thread holds both halves of every pair.
    named_sync(1, 256);   // all consumers done with the pipeline's shared memory
    float* sv = reinterpret_cast<float*>(smem);
    const int cc = (4 * wgc + warp) * 8 + g;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = 8 * j + 2 * t + e;
        const float rf = m < rows ? row_factor(m) : 0.f;
        const float gv = rf * acc[4 * j + e], uv = rf * acc[4 * j + 2 + e];
        sv[m * kSvLd + cc] = gv / (1.f + __expf(-gv)) * uv;
      }
    named_sync(1, 256);
    // Eight threads per row write 16 bytes each in the down GEMM's k-order (as gemm_kernel).
    const int L0 = 8 * (ct & 7);
    for (int m = ct >> 3; m < BM; m += 256 / 8) {
      float v[8], amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = sv[m * kSvLd + gemm_kperm(L0 + i)];
        amax = fmaxf(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (m >= rows) continue;
      const int64_t pos = pos0 + m;
      const int se = f16_row_exp(amax);
      const float up = pow2f(se);
      uint32_t o[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) o[u] = h2_bits(__floats2half2_rn(v[2 * u] * up, v[2 * u + 1] * up));
      if ((ct & 7) == 0) a.act_exp[pos * a.ld_exp + blockIdx.y] = int8_t(se);
      *reinterpret_cast<uint4*>(a.act + pos * a.ld_act + blockIdx.y * (kBN / 2) + L0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 8 * j + 2 * t + e;
      if (m >= rows) continue;
      const int64_t pos = pos0 + m;
      float sc = row_factor(m);
      int64_t orow = pos;
      if (a.mode == kScatter) {
        orow = a.dst[pos];
        sc *= a.scale[pos];
      }
      float* yrow = a.y + orow * a.ldy;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = blockIdx.y * kBN + wgc * 64 + warp * 16 + 8 * h + g;
        if (n >= a.N) continue;
        const float v = sc * acc[4 * j + 2 * h + e];
        yrow[n] = a.mode == kAccum ? yrow[n] + v : v;
      }
    }
}

template <int BM, int AM>
void launch_gemm_wgmma(const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_wgmma_kernel<BM, AM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    WgCfg<BM>::SMEM));
    attr = true;
  }
  launch(gemm_wgmma_kernel<BM, AM>, dim3(grid_m, grid_n), dim3(kWgThreads), size_t(WgCfg<BM>::SMEM), s, a);
}

template <int AM>
void launch_wgmma_bm(int bm, const GemmArgs& a, int grid_m, int grid_n, cudaStream_t s) {
  if (bm == 128) launch_gemm_wgmma<128, AM>(a, grid_m, grid_n, s);
  else if (bm == 64) launch_gemm_wgmma<64, AM>(a, grid_m, grid_n, s);
  else launch_gemm_wgmma<32, AM>(a, grid_m, grid_n, s);
}
