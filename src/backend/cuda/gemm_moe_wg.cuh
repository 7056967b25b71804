// Hopper (sm_90a) grouped GEMM for the MoE prefill (P14, opt-in: LILY_MOE_WG=1): the two expert
// GEMMs of moe_prefill (gate/up with the SwiGLU epilogue, down with the scatter epilogue) on
// wgmma with 256 weight rows per CTA tile, 4-bit weights dequantised ONCE per tile by a producer
// warpgroup. A CTA of 3 warpgroups computes one tile-list entry (expert, first row, rows <= BM)
// against 256 weight rows (blockIdx.x): warpgroup 0 (producer) streams each 64-column K step's
// packed codes and scales/biases with cp.async into a private ring 4 steps ahead, the BM gathered
// activation rows 1 step ahead into the operand ring, dequantises the codes with gemm_kernel's fp16
// rounding (dq4_pair: s·2^8, b·2^8, one HFMA2) into the 128-byte-swizzled K-major fp16 tile, and
// signals the step on its "full" mbarrier; warpgroups 1 and 2 (consumers) each issue two
// wgmma.mma_async m64nBMk16 per k16 (weight rows 128·wgc + 0..63 and 64..127, tokens as wgmma N, as
// in P1w) and release a step on its "empty" mbarrier once the wgmma group that read it completed.
// Codes and scales are only ever read by the thread that copied them (thread r owns weight rows r
// and r + 128), so their ring needs no barrier: the cp.async group order alone (codes of step kg
// committed before the activations of step kg) lets one wait_group cover both.
// Epilogues are gemm_kernel's (same factors, same fp16 rounding of the SwiGLU activations, one
// exponent per (row, 64-column group)); only the summation order differs.
// Every mbarrier wait is bounded (mw_wait: a trap after ~2 s or 2^30 polls), so a deadlock becomes
// a launch error instead of a hang. Non-persistent (grid = 256-row blocks x worst-case tile
// count; CTAs past *n_tiles exit): ~205-219 KB of shared memory, one CTA per SM.
// Included by gemm.cu after gemm_wgmma.cuh and gemm_wg16.cuh, inside its anonymous namespace.

constexpr int kMwThreads = 384;   // producer warpgroup + 2 consumer warpgroups
constexpr int kMwBN = 256;        // weight rows per tile (wgmma M: 2 warpgroups x 2 m64 blocks)

template <int BM>
struct MwCfg {
  static constexpr int S = BM == 128 ? 3 : 4;   // operand ring (fp16 weights + activations)
  static constexpr int SR = 5;                  // codes ring, producer-private
  static constexpr int DR = SR - 1;             // steps the codes are requested ahead
  static constexpr int W_BYTES = kMwBN * 128;   // fp16 weights, 256 rows x 64 k
  static constexpr int X_BYTES = BM * 128;      // fp16 activations, BM rows x 64 k
  static constexpr int STAGE = W_BYTES + X_BYTES;
  static constexpr int R_BYTES = kMwBN * 32;    // packed codes, 256 rows x 32 bytes
  static constexpr int OFF_R = S * STAGE;
  static constexpr int OFF_SB = OFF_R + SR * R_BYTES;              // [2 slots][2 kinds][256 rows][8] bf16
  static constexpr int OFF_GF = OFF_SB + 2 * 2 * kMwBN * 16;       // AM 2: [BM][16] fp16 factors
  static constexpr int OFF_RF = OFF_GF + BM * (kMaxGrpK / 64) * 2;   // [BM] f32 epilogue factors (mw_row_factors)
  static constexpr int OFF_BAR = OFF_RF + BM * 4;                  // full[S], empty[S]
  static constexpr int BYTES = OFF_BAR + 2 * S * 8;
  static constexpr int SMEM = BYTES + 1024;                        // slack to align the base to 1024
  static constexpr int XCH = BM * 8 / 128;                         // 16-byte activation chunks per producer thread
  static constexpr int SVLD = kMwBN / 2 + 4;                       // SwiGLU staging row stride (floats)
  static_assert(STAGE % 1024 == 0 && W_BYTES % 1024 == 0 && OFF_BAR % 8 == 0, "swizzle atoms are 1024-aligned");
  static_assert(BM * SVLD * 4 <= S * STAGE, "SwiGLU staging tile fits in the operand ring");
  static_assert(DR >= 2 && DR < 8, "codes lead: older than the step's activations, inside one scale block");
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

// Bounded mbarrier wait: try_wait in a loop; after 2^30 polls or ~2 s (%globaltimer, read every
// 1024 polls) the thread traps, so a protocol error shows up as a launch failure, not a hang.
__device__ __forceinline__ bool mw_try(uint32_t bar, int parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ uint64_t mw_clock() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __noinline__ void mw_wait_slow(uint32_t bar, int parity) {
  const uint64_t t0 = mw_clock();
  for (uint32_t n = 1;; ++n) {
    if (mw_try(bar, parity)) return;
    if ((n & 1023u) == 0 && (mw_clock() - t0 > 2000000000ull || n >= (1u << 30))) __trap();
  }
}
__device__ __forceinline__ void mw_wait(uint32_t bar, int parity) {
  if (!mw_try(bar, parity)) mw_wait_slow(bar, parity);
}

// Activation chunk idx (row idx / 8 of the tile, 16-byte column chunk idx % 8) of a step: the gathered
// row's address at k = 0; rows past the tile's end copy nothing (zero fill) from a valid address.
__device__ __forceinline__ const uint16_t* mr_act_src(const GemmArgs& a, int pos0, int rows, int idx, bool& valid) {
  const int m = idx >> 3, c = idx & 7;
  valid = m < rows;
  int src = pos0;
  if (valid) src = a.a_rows ? a.a_rows[pos0 + m] : pos0 + m;
  else if (a.a_rows) src = a.a_rows[pos0];
  return a.a + int64_t(src) * a.K + c * 8;
}

// Per-row factors of a tile, by threads tid < BM before the kernel's first barrier: srf[m] = the
// epilogue factor of tile row m (AM 1: the gathered row's scale 2^-s · 2^-8, read once here instead of
// by every epilogue thread; AM 2: 2^-(s_row + 8)), and for AM 2 the fp16 factors 2^(s_row - s_group)
// applied to the activations (s_row = min over the row's groups), as gemm_kernel.
template <int BM, int AM>
__device__ __forceinline__ void mw_row_factors(const GemmArgs& a, uint16_t* sgf, float* srf, int tid, int pos0,
                                               int rows, int K) {
  if (tid >= BM) return;
  if constexpr (AM == kAmF16Grp) {
    grp_row_factors(a, tid, pos0, rows, K, sgf, srf);
  } else {
    srf[tid] = tid < rows ? a.a_scale[a.a_rows ? a.a_rows[pos0 + tid] : pos0 + tid] * kInvW : 0.f;
  }
}

// Epilogue of the P14/P15 kernels (256 consumer threads; the accumulator layout of wgmma's D, the
// same whether A came from shared memory or registers). Accumulator i of block h (warp w of its
// warpgroup, lane 4g + t): weight row 128·wgc + 64·h + 16w + g + 8·((i >> 1) & 1) of the tile's 256,
// token 8·(i >> 2) + 2t + (i & 1). `smem` is the operand ring, free once every consumer is past its
// mainloop (the SwiGLU staging tile reuses it).
template <int BM, int AM, int SVLD, int NH = 2, int NC = 2>
__device__ __forceinline__ void mw_epilogue(const GemmArgs& a, const float* acc0, const float* acc1, uint8_t* smem,
                                            const float* srf, int by, int pos0, int rows, int ct, int wgc, int warp,
                                            int g, int t) {
  auto row_factor = [&](int m) -> float { return srf[m]; };   // mw_row_factors
  if (a.mode == kSwiGLU) {
    // Row 128·wgc + 64h + 16w + 8hh + g is the gate (hh = 0) or up (hh = 1) row of CTA column
    // cc = 64·wgc + 32h + 8w + g (gemm_kernel's interleave), so one thread holds both halves of a pair.
    named_sync(1, 128 * NC);   // all consumers done with the operand ring (the producer wrote its last step)
    float* sv = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      const float* acc = h ? acc1 : acc0;
      const int cc = 32 * NH * wgc + 32 * h + 8 * warp + g;
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = 8 * j + 2 * t + e;
          const float rf = m < rows ? row_factor(m) : 0.f;
          const float gv = rf * acc[4 * j + e], uv = rf * acc[4 * j + 2 + e];
          sv[m * SVLD + cc] = gv / (1.f + __expf(-gv)) * uv;
        }
    }
    named_sync(1, 128 * NC);
    // Eight threads per (row, 64-column group) write 16 bytes each in the down GEMM's k-order, with
    // the group's exponent from the max over the 8 (gemm_kernel's step 2; BM·2 is a multiple of 32,
    // so the loop is uniform across a warp for the shuffles).
    constexpr int GPC = NH * NC / 2;   // 64-column groups per CTA
    const int L0 = 8 * (ct & 7);
    for (int mg = ct >> 3; mg < BM * GPC; mg += 128 * NC / 8) {
      const int m = mg / GPC, gi = mg % GPC, G = by * GPC + gi;
      float v[8], amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = sv[m * SVLD + gi * 64 + gemm_kperm(L0 + i)];
        amax = fmaxf(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (m >= rows || G * 64 >= a.N) continue;
      const int64_t pos = pos0 + m;
      const int se = f16_row_exp(amax);
      const float up = pow2f(se);
      uint32_t o[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) o[u] = h2_bits(__floats2half2_rn(v[2 * u] * up, v[2 * u + 1] * up));
      if ((ct & 7) == 0) a.act_exp[pos * a.ld_exp + G] = int8_t(se);
      *reinterpret_cast<uint4*>(a.act + pos * a.ld_act + G * 64 + L0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
    return;
  }
  // Scatter (the down GEMM): y[dst[pos], n] = scale[pos] · factor · acc.
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
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int n = by * (64 * NH * NC) + 64 * NH * wgc + 64 * h + 16 * warp + 8 * hh + g;
          if (n >= a.N) continue;
          const float v = sc * (h ? acc1 : acc0)[4 * j + 2 * hh + e];
          yrow[n] = a.mode == kAccum ? yrow[n] + v : v;
        }
    }
}

template <int BM, int AM>
__global__ void __launch_bounds__(kMwThreads, 1) gemm_moe_wg_kernel(const __grid_constant__ GemmArgs a) {
  using C = MwCfg<BM>;
  constexpr int S = C::S, SR = C::SR, DR = C::DR;
  static_assert(AM == kAmF16 || AM == kAmF16Grp, "P14: fp16 operands only");
  extern __shared__ __align__(1024) uint8_t mw_smem_raw[];
  const uint32_t raw0 = smem_addr(mw_smem_raw);
  const uint32_t pad = ((raw0 + 1023u) & ~1023u) - raw0;
  uint8_t* smem = mw_smem_raw + pad;
  const uint32_t sm0 = raw0 + pad;
  uint16_t* sgf = reinterpret_cast<uint16_t*>(smem + C::OFF_GF);
  float* srf = reinterpret_cast<float*>(smem + C::OFF_RF);
  const uint32_t bar_full = sm0 + C::OFF_BAR, bar_empty = bar_full + 8 * S;

  const int tid = threadIdx.x;
  const int by = blockIdx.x;   // 256-row block of the weights (SwiGLU: 128 gate + 128 up rows)
  pdl_trigger();
  pdl_wait();   // the tile list, the activations and the outputs all come from the kernels before
  if (int(blockIdx.y) >= *a.n_tiles) return;
  const int4 tl = a.tiles[blockIdx.y];
  const int group = tl.x, pos0 = tl.y, rows = tl.z;
  const int K = a.K, nk = K / kBK;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full + 8 * s, 128);    // every producer thread arrives once per step
      mbar_init(bar_empty + 8 * s, 256);   // every consumer thread arrives once per step
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  mw_row_factors<BM, AM>(a, sgf, srf, tid, pos0, rows, K);
  __syncthreads();   // barrier init and the row factors visible to all 384 threads

  if (tid < 128) {
    // ---- producer warpgroup: thread r owns weight rows r and r + 128 of the tile ----
    const int r = tid;
    const uint8_t* bsrc[2];
    const uint8_t* ssrc[2];
    const uint8_t* bisrc[2];
    bool bval[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int R = r + 128 * hh;
      int mat, col;
      if (a.swiglu) {   // 8 gate + 8 up rows per 16, as gemm_kernel: columns by·128 + 0..127
        mat = (R >> 3) & 1;
        col = by * (kMwBN / 2) + (R >> 4) * 8 + (R & 7);
      } else {
        mat = 0;
        col = by * kMwBN + R;
      }
      bval[hh] = col < a.N;
      const QMat& w = group < a.b.n_groups ? a.b.w[mat] : a.b.extra[mat];
      const int64_t goff = group < a.b.n_groups ? int64_t(group) * a.b.stride : 0;
      const int64_t gsoff = group < a.b.n_groups ? int64_t(group) * a.b.sb_stride : 0;
      const int64_t c = bval[hh] ? col : 0;   // rows past N read nothing from a valid address
      bsrc[hh] = static_cast<const uint8_t*>(w.data) + goff + c * (K / 2);
      ssrc[hh] = static_cast<const uint8_t*>(w.scales) + gsoff + c * (K / 64) * 2;
      bisrc[hh] = static_cast<const uint8_t*>(w.biases) + gsoff + c * (K / 64) * 2;
    }
    // Codes of step q: slot q % SR, row R at R·32. Scales/biases of 8 groups per 16-byte copy,
    // loaded with the codes of every 8th step: [slot][kind][row][8] (the block's slot was last read
    // at step 8b - 9, before the copy issued at step 8b - DR).
    auto load_codes = [&](int q) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int R = r + 128 * hh;
        const uint32_t rd = sm0 + C::OFF_R + (q % SR) * C::R_BYTES + R * 32;
        cp_async16(rd, bsrc[hh] + int64_t(q) * 32, bval[hh]);
        cp_async16(rd + 16, bsrc[hh] + int64_t(q) * 32 + 16, bval[hh]);
        if ((q & 7) == 0) {
          const uint32_t sd = sm0 + C::OFF_SB + ((q >> 3) & 1) * (2 * kMwBN * 16) + R * 16;
          cp_async16(sd, ssrc[hh] + (q >> 3) * 16, bval[hh]);
          cp_async16(sd + kMwBN * 16, bisrc[hh] + (q >> 3) * 16, bval[hh]);
        }
      }
    };
    // Activation chunks of this thread: row m = idx >> 3, k-order chunk c = idx & 7.
    const uint16_t* asrc[C::XCH];
    bool aval[C::XCH];
#pragma unroll
    for (int j = 0; j < C::XCH; ++j) {
      asrc[j] = mr_act_src(a, pos0, rows, tid + j * 128, aval[j]);
    }
    auto xdst = [&](int j) { return swz((tid + j * 128) >> 3, tid & 7); };
    auto load_x = [&](int q) {
      const uint32_t xs = sm0 + (q % S) * C::STAGE + C::W_BYTES;
#pragma unroll
      for (int j = 0; j < C::XCH; ++j) cp_async16(xs + xdst(j), asrc[j] + q * kBK, aval[j]);
    };
    // Commit order: C0 .. C(DR-2), X0, C(DR-1), then per step kg: X(kg+1), C(kg+DR). After step
    // kg's two commits exactly three groups are newer than X(kg), and C(kg) is older than X(kg),
    // so wait_group 3 completes both (empty groups complete at once).
    for (int q = 0; q < DR - 1; ++q) {
      if (q < nk) load_codes(q);
      cp_commit();
    }
    load_x(0);
    cp_commit();
    if (DR - 1 < nk) load_codes(DR - 1);
    cp_commit();
    for (int kg = 0; kg < nk; ++kg) {
      const int q = kg + 1;
      if (q < nk) {
        // Slot q % S last held step q - S: wait until both consumer warpgroups released it.
        if (q >= S) mw_wait(bar_empty + 8 * (q % S), ((q / S) + 1) & 1);
        load_x(q);
      }
      cp_commit();
      if (kg + DR < nk) load_codes(kg + DR);
      cp_commit();
      cp_wait<3>();   // X(kg) and C(kg) of this thread have landed
      const int s = kg % S;
      uint8_t* ws = smem + s * C::STAGE;
      const int slot = (kg >> 3) & 1;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int R = r + 128 * hh;
        const uint4* rw = reinterpret_cast<const uint4*>(smem + C::OFF_R + (kg % SR) * C::R_BYTES + R * 32);
        const uint4 w0 = rw[0], w1 = rw[1];
        const uint32_t wd[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
        const uint16_t* sb = reinterpret_cast<const uint16_t*>(smem + C::OFF_SB + slot * (2 * kMwBN * 16) + R * 16);
        const uint16_t sv = sb[kg & 7], bv = sb[kMwBN * 8 + (kg & 7)];
        const uint32_t s2 = h2_bits(__float2half2_rn(__uint_as_float(uint32_t(sv) << 16) * float(1 << kGemmF16WExp)));
        const uint32_t b2 = h2_bits(__float2half2_rn(__uint_as_float(uint32_t(bv) << 16) * float(1 << kGemmF16WExp)));
#pragma unroll
        for (int c = 0; c < 8; ++c) {   // chunk c: staged columns 8c..8c+7 (wg_chunk_map_ok)
          uint32_t o[4];
#pragma unroll
          for (int v = 0; v < 4; ++v) o[v] = dq4_pair<true>(wd[2 * v + (c >> 2)], c & 3, s2, b2);
          *reinterpret_cast<uint4*>(ws + swz(R, c)) = make_uint4(o[0], o[1], o[2], o[3]);
        }
      }
      if constexpr (AM == kAmF16Grp) {   // this group's factor on the thread's own activation chunks
        uint8_t* xs = ws + C::W_BYTES;
#pragma unroll
        for (int j = 0; j < C::XCH; ++j) {
          if (!aval[j]) continue;
          grp_scale_chunk(xs + xdst(j), sgf, (tid + j * 128) >> 3, kg);
        }
      }
      fence_proxy_async();   // st.shared / cp.async writes -> wgmma operand reads (async proxy)
      mbar_arrive(bar_full + 8 * s);
    }
    cp_wait<0>();
    return;
  }

  // ---- consumer warpgroups: wgc 0/1 computes weight rows 128·wgc .. 128·wgc + 127 of the tile, as
  // two m64 blocks h = 0, 1 ----
  const int ct = tid - 128, wgc = ct >> 7, warp = (ct >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int R = BM / 2;   // accumulators per thread per m64 block: 64 x BM over 128 threads
  float acc0[R], acc1[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = 0.f;
  for (int kg = 0; kg < nk; ++kg) {
    const int s = kg % S;
    mw_wait(bar_full + 8 * s, (kg / S) & 1);
    const uint32_t wa = sm0 + s * C::STAGE + wgc * 128 * 128;
    const uint32_t xa = sm0 + s * C::STAGE + C::W_BYTES;
    wg_fence_regs<R>(acc0);
    wg_fence_regs<R>(acc1);
    wg_fence();
#pragma unroll
    for (int i = 0; i < 4; ++i) {   // k16 steps: 32 bytes further inside each 128-byte swizzled row
      wgmma_tile<BM>(acc0, wg_desc(wa + 32 * i), wg_desc(xa + 32 * i));
      wgmma_tile<BM>(acc1, wg_desc(wa + 64 * 128 + 32 * i), wg_desc(xa + 32 * i));
    }
    wg_commit();
    wg_wait<1>();   // step kg - 1 has finished reading its slot
    wg_fence_regs<R>(acc0);
    wg_fence_regs<R>(acc1);
    if (kg > 0) mbar_arrive(bar_empty + 8 * ((kg - 1) % S));
  }
  wg_wait<0>();
  wg_fence_regs<R>(acc0);
  wg_fence_regs<R>(acc1);

  mw_epilogue<BM, AM, C::SVLD>(a, acc0, acc1, smem, srf, by, pos0, rows, ct, wgc, warp, g, t);
}

// ---- P15: the same grouped MoE GEMMs with the weights dequantised straight into wgmma's A registers ----
// P14 (above) stages the dequantised fp16 weights in shared memory, so every wgmma reads both
// operands from it and the producer warpgroup alone unpacks 256 rows x 64 k per step: 0.71x the
// mma.sync kernel at T = 4,096 (session 7). Here the producer only copies (cp.async) each step's
// packed codes, the 8-group scale/bias blocks and the gathered activation rows into a 6-stage ring
// and publishes a step with cp.async.mbarrier.arrive.noinc (the barrier completes when the copies
// have landed; the producer never waits for its own data, only for free slots). The consumer
// threads read their rows' codes from shared memory and unpack them with dq4_pair (the same fp16
// bits as gemm_kernel and P14) into the m16n8k16-layout A fragments of wgmma.mma_async (A from
// registers, B = activations K-major in the 128-byte-swizzled ring). Thread (warp w, lane 4g + t)
// of consumer warpgroup c holds rows R = 128c + 64h + 16w + g + 8hh (blocks h, halves hh); with the
// activations in gemm_kperm order, its k16 step i needs word 2t + (i >> 1) of each row's 8 words:
// nibbles (2i & 3, +4) for A columns 2t, 2t+1 and ((2i + 1) & 3, +4) for 2t + 8, 2t + 9
// (mw_rs_map_ok), i.e. one 8-byte load per row and step. A fragments are double-buffered across
// steps (the wgmma of step kg reads them while step kg + 1 is unpacked). The down GEMM's per-(row,
// group) activation factors are applied by the consumers (2 chunks each, then a 256-thread barrier).
// History: the first form (session 7, call 3) had the producer publish a step only after waiting
// for its copies and scaling them, S - 1 steps behind the issue but also behind its wait for a free
// slot, which tied publishing step q to the release of step q - 2: 0.72x mma.sync, as slow as P14.
constexpr bool mw_rs_map_ok() {
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < 4; ++t)
      for (int f = 0; f < 2; ++f)
        for (int e = 0; e < 2; ++e) {
          const int L = 16 * i + 8 * f + 2 * t + e;   // A column (wgmma k) inside the 64-column step
          const int want = 8 * (2 * t + (i >> 1)) + ((2 * i + f) & 3) + 4 * e;
          if (gemm_kperm(L) != want) return false;
        }
  return true;
}
static_assert(mw_rs_map_ok(), "P15: A fragment nibbles must match the activation k-order");

template <int BM, int NS = 6, int NH = 2, int NC = 2, int NSB = 3, int KSUB = 1>
struct MrCfg {
  static constexpr int NCT = 128 * NC;           // consumer threads (NC warpgroups)
  static constexpr int RW = 64 * NH * NC;        // weight rows per CTA (NH m64 blocks per consumer warpgroup)
  static constexpr int S = NS;                   // ring stages
  static constexpr int X_BYTES = BM * 128 * KSUB;   // fp16 activations, KSUB blocks of BM rows x 64 k (1024-aligned)
  static constexpr int C_BYTES = RW * 32 * KSUB;     // packed codes, KSUB blocks of RW rows x 32 bytes
  static constexpr int STAGE = X_BYTES + C_BYTES;
  static constexpr int SBS = NSB;                // scale-block slots: block b (steps 8b..8b+7) in slot b % SBS
  static constexpr int OFF_SB = S * STAGE;                         // [SBS slots][2 kinds][256 rows][8] bf16
  static constexpr int OFF_GF = OFF_SB + SBS * 2 * RW * 16;        // AM 2: [BM][16] fp16 factors
  static constexpr int OFF_RF = OFF_GF + BM * (kMaxGrpK / 64) * 2;   // [BM] f32 epilogue factors (mw_row_factors)
  static constexpr int OFF_BAR = OFF_RF + BM * 4;                  // full[S], empty[S]
  static constexpr int BYTES = OFF_BAR + 2 * S * 8;
  static constexpr int SMEM = BYTES + 1024;
  static constexpr int XCH = BM * 8 / 128;       // 16-byte activation chunks per producer thread
  static constexpr int SVLD = RW / 2 + 4;
  static_assert(STAGE % 1024 == 0 && X_BYTES % 1024 == 0 && OFF_BAR % 8 == 0, "swizzle atoms are 1024-aligned");
  static_assert(BM * SVLD * 4 <= S * STAGE, "SwiGLU staging tile fits in the ring");
  static_assert(NH == 1 || NH == 2, "one or two m64 blocks per consumer warpgroup");
  static_assert(NC == 2 || (NC == 4 && NH == 1), "2 consumer warpgroups, or 4 with one m64 block each (P18)");
  static_assert(BM * 8 % NCT == 0 || NCT % (BM * 8) == 0, "the activation chunks split evenly over the consumers");
  // Slot b % SBS was last read by block b - SBS (steps up to 8b - 8·SBS + 7); issuing step 8b waits for
  // the release of step 8b - S, so S <= 8·SBS - 7.
  static_assert(S <= 8 * SBS - 7, "scale blocks: a slot is free when its block's first step is issued");
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

// The consumers' bounded wait, all inline (traps after 2^28 polls). With mw_wait (a call in its slow
// path) and a conditional second step in the unrolled loop, ptxas serialised the register-A wgmmas
// (C7513, 96 registers); with both gone it does not (154 registers, no spills).
__device__ __forceinline__ void mr_wait(uint32_t bar, int parity) {
  uint32_t n = 0;
  while (!mw_try(bar, parity))
    if (++n == (1u << 28)) __trap();
}
template <int BM>
__device__ __forceinline__ void wgmma_rs_tile(float* d, const uint32_t* a, uint64_t db) {
  if constexpr (BM == 32) wgmma_f16_rs_n32(d, a, db);
  else if constexpr (BM == 64) wgmma_f16_rs_n64(d, a, db);
  else if constexpr (BM == 96) wgmma_f16_rs_n96(d, a, db);
  else wgmma_f16_rs_n128(d, a, db);
}
template <int N>
__device__ __forceinline__ void mr_fence_u32(uint32_t* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Where weight row R (0 .. RW-1) of CTA column block `by` of expert `group` lives: its packed codes,
// scales and biases (SwiGLU: gemm_kernel's interleave, gate rows 8·(2j) .. and up rows 8·(2j+1) ..).
template <int RW>
__device__ __forceinline__ void mr_row_src(const GemmArgs& a, int group, int by, int R, bool& valid,
                                           const uint8_t*& codes, const uint8_t*& sc, const uint8_t*& bi) {
  int mat, col;
  if (a.swiglu) {
    mat = (R >> 3) & 1;
    col = by * (RW / 2) + (R >> 4) * 8 + (R & 7);
  } else {
    mat = 0;
    col = by * RW + R;
  }
  valid = col < a.N;
  const QMat& w = group < a.b.n_groups ? a.b.w[mat] : a.b.extra[mat];
  const int64_t goff = group < a.b.n_groups ? int64_t(group) * a.b.stride : 0;
  const int64_t gsoff = group < a.b.n_groups ? int64_t(group) * a.b.sb_stride : 0;
  const int64_t c = valid ? col : 0;
  const int K = a.K;
  codes = static_cast<const uint8_t*>(w.data) + goff + c * (K / 2);
  sc = static_cast<const uint8_t*>(w.scales) + gsoff + c * (K / 64) * 2;
  bi = static_cast<const uint8_t*>(w.biases) + gsoff + c * (K / 64) * 2;
}

// The copy sources of thread tid of a 512-thread CTA over RW = 256 weight rows (column block by) and one tile (P18's
// and P55's kernels): activation chunks tid and tid + NCT (rows tid / 8 and NCT / 8 + tid / 8) at k = 0, the code half
// (tid & 1) of weight row tid >> 1, and the scale (tid < 256) or bias (tid >= 256) block of row tid & 255.
template <int RW, int NCT>
__device__ __forceinline__ void mr4_copy_srcs(const GemmArgs& a, int group, int by, int pos0, int rows, int tid,
                                              const uint16_t* (&asrc)[2], bool (&aval)[2], const uint8_t*& csrc,
                                              bool& cval, const uint8_t*& bsrc, bool& bval) {
#pragma unroll
  for (int j = 0; j < 2; ++j) asrc[j] = mr_act_src(a, pos0, rows, tid + NCT * j, aval[j]);
  const uint8_t *sc, *bi, *cd;
  mr_row_src<RW>(a, group, by, tid >> 1, cval, csrc, sc, bi);
  csrc += (tid & 1) * 16;
  mr_row_src<RW>(a, group, by, tid & 255, bval, cd, sc, bi);
  bsrc = tid < 256 ? sc : bi;
}

// Consumers' entry to step kg: wait for its stage; for AM 2 scale its activation chunks by the down
// GEMM's per-(row, group) factors (BM·8 / NCT per consumer thread, then a barrier of the NCT consumers
// before any wgmma reads them). The proxy fence orders the cp.async-landed (and st.shared) data before
// the wgmma operand reads (async proxy).
template <int BM, int AM, int NCT, bool kFence = true>
__device__ __forceinline__ void mr_arrive_stage(uint8_t* smem, int stage_bytes, const uint16_t* sgf, uint32_t bar_full,
                                                int S, int kg, int ct) {
  const int s = kg % S;
  mr_wait(bar_full + 8 * s, (kg / S) & 1);
  if constexpr (AM == kAmF16Grp) {
    uint8_t* xs = smem + s * stage_bytes;
#pragma unroll
    for (int j = 0; j < BM * 8 / NCT; ++j) {
      const int idx = ct + NCT * j, m = idx >> 3;
      grp_scale_chunk(xs + swz(m, idx & 7), sgf, m, kg);
    }
    fence_proxy_async();
    named_sync(1, NCT);
  } else {
    if constexpr (kFence) fence_proxy_async();
  }
}

// A consumer thread's operands of one step and one m64 block: the packed codes of weight rows Rw and
// Rw + 8 (8 k each, lane t's quarter) and their fp16 scale / bias (gemm_kernel's s·2^8, b·2^8).
template <int RW>
__device__ __forceinline__ void mr_load_codes(const uint8_t* cs, const uint16_t* sb, int Rw, int kg, int t, uint2* wv,
                                              uint32_t* s2, uint32_t* b2) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = Rw + 8 * hh;
    wv[hh] = *reinterpret_cast<const uint2*>(cs + r * 32 + t * 8);
    const uint16_t sv = sb[r * 8 + (kg & 7)], bv = sb[RW * 8 + r * 8 + (kg & 7)];
    s2[hh] = h2_bits(__float2half2_rn(__uint_as_float(uint32_t(sv) << 16) * float(1 << kGemmF16WExp)));
    b2[hh] = h2_bits(__float2half2_rn(__uint_as_float(uint32_t(bv) << 16) * float(1 << kGemmF16WExp)));
  }
}

// DIAG (timing diagnostics, LILY_P15_DIAG, gate/up only; results are wrong for 2 and 4): 1 = no proxy
// fence in the consumers, 2 = no unpacking (the raw code words as A), 4 = no wgmma.
// NH (P17): m64 weight blocks per consumer warpgroup, 2 (256 weight rows per CTA) or 1 (128 rows: at
// BM = 128 the 64 accumulators of one m64n128 block fit the 168 registers a 384-thread CTA gets, where two
// blocks' 128 + 64 A-fragment registers do not, even with setmaxnreg 40 / 232).
template <int BM, int AM, int DIAG = 0, int NS = 6, int NH = 2>
__global__ void __launch_bounds__(kMwThreads, 1) gemm_moe_rs_kernel(const __grid_constant__ GemmArgs a) {
  using C = MrCfg<BM, NS, NH>;
  constexpr int NCT = C::NCT;
  constexpr int RW = C::RW;
  constexpr int S = C::S;
  static_assert(AM == kAmF16 || AM == kAmF16Grp, "P15: fp16 operands only");
  extern __shared__ __align__(1024) uint8_t mr_smem_raw[];
  const uint32_t raw0 = smem_addr(mr_smem_raw);
  const uint32_t pad = ((raw0 + 1023u) & ~1023u) - raw0;
  uint8_t* smem = mr_smem_raw + pad;
  const uint32_t sm0 = raw0 + pad;
  uint16_t* sgf = reinterpret_cast<uint16_t*>(smem + C::OFF_GF);
  float* srf = reinterpret_cast<float*>(smem + C::OFF_RF);
  const uint32_t bar_full = sm0 + C::OFF_BAR, bar_empty = bar_full + 8 * S;

  const int tid = threadIdx.x;
  const int by = blockIdx.x;
  pdl_trigger();
  pdl_wait();
  if (int(blockIdx.y) >= *a.n_tiles) return;
  const int4 tl = a.tiles[blockIdx.y];
  const int group = tl.x, pos0 = tl.y, rows = tl.z;
  const int K = a.K, nk = K / kBK;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full + 8 * s, 128);
      mbar_init(bar_empty + 8 * s, NCT);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  mw_row_factors<BM, AM>(a, sgf, srf, tid, pos0, rows, K);
  __syncthreads();

  if (tid < 128) {
    // ---- producer warpgroup: copies only. Codes: thread r copies 16-byte half (r & 1) of rows
    // (r >> 1) + 64j (two threads per row: a warp's copy is 16 rows x 32 bytes, whole sectors);
    // scale blocks: rows r and r + 128; activation chunks tid + 128j. ----
    const int r = tid;
    auto row_src = [&](int R, bool& valid, const uint8_t*& codes, const uint8_t*& sc, const uint8_t*& bi) {
      mr_row_src<RW>(a, group, by, R, valid, codes, sc, bi);
    };
    constexpr int CJ = RW / 64, HB = RW / 128;   // code rows and scale rows per producer thread
    const uint8_t* csrc[CJ];
    bool cval[CJ];
    const uint8_t* ssrc[HB];
    const uint8_t* bisrc[HB];
    bool bval[HB];
#pragma unroll
    for (int j = 0; j < CJ; ++j) {
      const uint8_t *sc, *bi;
      row_src((r >> 1) + 64 * j, cval[j], csrc[j], sc, bi);
      csrc[j] += (r & 1) * 16;
    }
#pragma unroll
    for (int hh = 0; hh < HB; ++hh) {
      const uint8_t* cd;
      row_src(r + 128 * hh, bval[hh], cd, ssrc[hh], bisrc[hh]);
    }
    const uint16_t* asrc[C::XCH];
    bool aval[C::XCH];
#pragma unroll
    for (int j = 0; j < C::XCH; ++j) {
      asrc[j] = mr_act_src(a, pos0, rows, tid + j * 128, aval[j]);
    }
    auto xdst = [&](int j) { return swz((tid + j * 128) >> 3, tid & 7); };
    auto issue = [&](int q) {
      const int s = q % S;
      const uint32_t st = sm0 + s * C::STAGE;
#pragma unroll
      for (int j = 0; j < C::XCH; ++j) cp_async16(st + xdst(j), asrc[j] + q * kBK, aval[j]);
#pragma unroll
      for (int j = 0; j < CJ; ++j)
        cp_async16(st + C::X_BYTES + ((r >> 1) + 64 * j) * 32 + (r & 1) * 16, csrc[j] + int64_t(q) * 32, cval[j]);
      if ((q & 7) == 0) {
#pragma unroll
        for (int hh = 0; hh < HB; ++hh) {
          const uint32_t sd = sm0 + C::OFF_SB + ((q >> 3) % C::SBS) * (2 * RW * 16) + (r + 128 * hh) * 16;
          cp_async16(sd, ssrc[hh] + (q >> 3) * 16, bval[hh]);
          cp_async16(sd + RW * 16, bisrc[hh] + (q >> 3) * 16, bval[hh]);
        }
      }
    };
    // Step q: wait until the consumers released step q - S, copy, and let the mbarrier count this
    // thread's arrival when its copies have landed (cp.async.mbarrier.arrive.noinc): publishing a
    // step never waits for the thread, so the ring runs S steps ahead of the consumers.
    for (int q = 0; q < nk; ++q) {
      if (q >= S) mw_wait(bar_empty + 8 * (q % S), ((q / S) + 1) & 1);
      issue(q);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_full + 8 * (q % S)) : "memory");
    }
    cp_wait<0>();
    return;
  }

  // ---- consumer warpgroups ----
  const int ct = tid - 128, wgc = ct >> 7, warp = (ct >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int R = BM / 2;
  constexpr int R1 = NH == 2 ? R : 1;   // acc1: the second block's accumulators
  float acc0[R], acc1[R1];
#pragma unroll
  for (int i = 0; i < R; ++i) acc0[i] = 0.f;
#pragma unroll
  for (int i = 0; i < R1; ++i) acc1[i] = 0.f;
  uint32_t af[2][NH][4][4];   // [buffer][block h][k16 step i][fragment register]
  const int rowb = 64 * NH * wgc + 16 * warp + g;   // + 64h + 8hh
  auto arrive_stage = [&](int kg) { mr_arrive_stage<BM, AM, NCT, !(DIAG & 1)>(smem, C::STAGE, sgf, bar_full, S, kg, ct); };
  auto step = [&](auto bufc, int kg) {
    constexpr int buf = decltype(bufc)::value;
    const int s = kg % S;
    arrive_stage(kg);
    const uint8_t* cs = smem + s * C::STAGE + C::X_BYTES;
    const uint16_t* sb = reinterpret_cast<const uint16_t*>(smem + C::OFF_SB + ((kg >> 3) % C::SBS) * (2 * RW * 16));
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      uint2 wv[2];
      uint32_t s2[2], b2[2];
      mr_load_codes<RW>(cs, sb, rowb + 64 * h, kg, t, wv, s2, b2);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t w0 = (i >> 1) ? wv[0].y : wv[0].x, w1 = (i >> 1) ? wv[1].y : wv[1].x;
        if constexpr ((DIAG & 2) != 0) {
          af[buf][h][i][0] = w0 ^ s2[0];
          af[buf][h][i][1] = w1 ^ s2[1];
          af[buf][h][i][2] = w0 ^ b2[0];
          af[buf][h][i][3] = w1 ^ b2[1];
          continue;
        }
        af[buf][h][i][0] = dq4_pair<true>(w0, (2 * i) & 3, s2[0], b2[0]);
        af[buf][h][i][1] = dq4_pair<true>(w1, (2 * i) & 3, s2[1], b2[1]);
        af[buf][h][i][2] = dq4_pair<true>(w0, (2 * i + 1) & 3, s2[0], b2[0]);
        af[buf][h][i][3] = dq4_pair<true>(w1, (2 * i + 1) & 3, s2[1], b2[1]);
      }
    }
    const uint32_t xa = sm0 + s * C::STAGE;
    wg_fence_regs<R>(acc0);
    if constexpr (NH == 2) wg_fence_regs<R>(acc1);
    mr_fence_u32<16 * NH>(&af[buf][0][0][0]);
    wg_fence();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr ((DIAG & 4) != 0) {
        acc0[i] += __uint_as_float(af[buf][0][i][0] ^ af[buf][0][i][3]);
        if constexpr (NH == 2) acc1[i] += __uint_as_float(af[buf][NH - 1][i][1] ^ af[buf][NH - 1][i][2]);
        continue;
      }
      wgmma_rs_tile<BM>(acc0, af[buf][0][i], wg_desc(xa + 32 * i));
      if constexpr (NH == 2) wgmma_rs_tile<BM>(acc1, af[buf][NH - 1][i], wg_desc(xa + 32 * i));
    }
    wg_commit();
    wg_wait<1>();   // step kg - 1 is done: its ring slot and its A buffer (buf ^ 1) are free
    wg_fence_regs<R>(acc0);
    if constexpr (NH == 2) wg_fence_regs<R>(acc1);
    mr_fence_u32<16 * NH>(&af[buf ^ 1][0][0][0]);
    if (kg > 0) mbar_arrive(bar_empty + 8 * ((kg - 1) % S));
  };
  for (int kg = 0; kg < nk; kg += 2) {   // nk even (launch_moe_wg checks K % 128 == 0)
    step(std::integral_constant<int, 0>{}, kg);
    step(std::integral_constant<int, 1>{}, kg + 1);
  }
  wg_wait<0>();
  wg_fence_regs<R>(acc0);
  if constexpr (NH == 2) wg_fence_regs<R>(acc1);
  mr_fence_u32<16 * NH>(&af[0][0][0][0]);
  mr_fence_u32<16 * NH>(&af[1][0][0][0]);
  mw_epilogue<BM, AM, C::SVLD, NH>(a, acc0, acc1, smem, srf, by, pos0, rows, ct, wgc, warp, g, t);
}

// wgmma descriptor halves (wg_desc): the high word is a constant; the low word of a 32-byte k16 step
// inside a 1,024-aligned stage is the stage's plus 2·i (the 14-bit address field cannot carry: shared
// addresses are < 2^18).
__device__ __forceinline__ uint64_t wg_desc_lo(uint32_t lo) {
  return (uint64_t(wg_desc(0) >> 32) << 32) | lo;
}

// P18: the P17 configuration (M-tile 128, tokens as wgmma N = 128, one m64n128 block per warpgroup)
// with FOUR warpgroups and no producer warpgroup: 256 weight rows per CTA, so each gathered activation
// row copied into shared memory feeds twice the weight rows of P17 and the kernel reads half the
// activation bytes from L2 (the gate/up GEMM at M-tile 128 keeps ~80 % of its time with the wgmmas
// taken out, LILY_P15_DIAG=4 in session 10: the copies, not unpacking or tensor work, set its pace).
// Every thread copies its share of each step (2 activation chunks, 1 code chunk, every 8th step 1
// scale or bias chunk) LEAD = S - 2 steps ahead into the slot released two steps earlier (an
// empty-mbarrier wait with a step of slack) and arrives on the step's full mbarrier when its copies
// land. 512 threads keep a 128-register budget (a producer warpgroup would make 640 and cap every
// thread at 96, where ptxas serialises the wgmmas, C7512, even with setmaxnreg). A fragments: one
// buffer per half step (k16 sub-steps 0-1 and 2-3) and one wgmma group per half, so half j of step kg
// is unpacked once half j of step kg - 1 has retired.
// The P18 kernel's ring: P18 6 stages, 3 scale-block slots; P32 an 8-stage ring, 2 slots; P34 (with P32) 4
// stages of two 64-k steps each.
// P53 (BM = 32, with P32 and P34): an M-tile of 32 tokens, so a stage's activation block is 8 KB instead of 32 and the
// ring holds 8 stages (LEAD 6: 12 steps, 96 KB of codes requested ahead instead of 32; three scale-block slots).
template <bool P32, bool P34, int BM = 128>
using Rs4Cfg = MrCfg<BM, BM == 32 ? 8 : P34 ? 4 : P32 ? 8 : 6, 1, 4, BM == 32 ? 3 : P32 ? 2 : 3, P34 ? 2 : 1>;
// P50 (with P34): odd nibble pairs unpacked in place (dq4_pair_odd: one shift per code word instead of three; the
// same bits).
template <int AM, bool P32 = false, bool P34 = false, bool P50 = false, int BM = 128>
__global__ void __launch_bounds__(512, 1) gemm_moe_rs4_kernel(const __grid_constant__ GemmArgs a) {
  constexpr int KS = P34 ? 2 : 1;   // 64-k steps per ring stage
  using C = Rs4Cfg<P32, P34, BM>;
  static_assert(!P34 || P32, "P34 is a form of the P32 loop");
  static_assert(!P50 || P34, "P50: the P34 loop only");
  static_assert(BM == 128 || (BM == 32 && P34 && AM == kAmF16), "P53: M-tile 32 on the P34 loop, gate/up only");
  constexpr int RW = C::RW, S = C::S, NCT = C::NCT, LEAD = S - 2;
  constexpr int XA = BM * 8 / NCT;   // activation chunks per thread: 2, or (P53) 0 with threads < BM * 8 copying one
  static_assert(AM == kAmF16 || AM == kAmF16Grp, "P18: fp16 operands only");
  static_assert((XA == 2 || (XA == 0 && BM * 8 * 2 == NCT)) && RW * 2 == NCT,
                "P18: 2 activation chunks (P53: threads < 256 one) and 1 code chunk per thread");
  extern __shared__ __align__(1024) uint8_t mr_smem_raw[];
  const uint32_t raw0 = smem_addr(mr_smem_raw);
  const uint32_t pad = ((raw0 + 1023u) & ~1023u) - raw0;
  uint8_t* smem = mr_smem_raw + pad;
  const uint32_t sm0 = raw0 + pad;
  uint16_t* sgf = reinterpret_cast<uint16_t*>(smem + C::OFF_GF);
  float* srf = reinterpret_cast<float*>(smem + C::OFF_RF);
  const uint32_t bar_full = sm0 + C::OFF_BAR, bar_empty = bar_full + 8 * S;

  const int tid = threadIdx.x, by = blockIdx.x;
  pdl_trigger();
  pdl_wait();
  if (int(blockIdx.y) >= *a.n_tiles) return;
  const int4 tl = a.tiles[blockIdx.y];
  const int group = tl.x, pos0 = tl.y, rows = tl.z;
  const int nk = a.K / kBK;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full + 8 * s, NCT);
      mbar_init(bar_empty + 8 * s, NCT);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  mw_row_factors<BM, AM>(a, sgf, srf, tid, pos0, rows, a.K);

  // This thread's copies: activation chunks tid and tid + 512, the code half (tid & 1) of weight row
  // tid >> 1, and every 8th step the scale (tid < 256) or bias (tid >= 256) block of row tid & 255.
  bool aval[2], cval, bval;
  const uint16_t* asrc[2];
  const uint8_t* csrc;
  const uint8_t* bsrc;
  mr4_copy_srcs<RW, NCT>(a, group, by, pos0, rows, tid, asrc, aval, csrc, cval, bsrc, bval);
  const uint32_t xoff0 = swz(tid >> 3, tid & 7), xoff1 = swz((tid + NCT) >> 3, tid & 7);
  const uint32_t coff = C::X_BYTES + (tid >> 1) * 32 + (tid & 1) * 16;
  const uint32_t soff = C::OFF_SB + (tid >> 8) * (RW * 16) + (tid & 255) * 16;
  auto issue = [&](int q) {
    const int s = q % S;
    if (q >= S) mr_wait(bar_empty + 8 * s, ((q / S) + 1) & 1);   // inline: a call here serialises the wgmmas
    const uint32_t st = sm0 + s * C::STAGE;
    cp_async16(st + xoff0, asrc[0] + q * kBK, aval[0]);
    cp_async16(st + xoff1, asrc[1] + q * kBK, aval[1]);
    cp_async16(st + coff, csrc + int64_t(q) * 32, cval);
    if ((q & 7) == 0) cp_async16(sm0 + soff + ((q >> 3) % C::SBS) * (2 * RW * 16), bsrc + (q >> 3) * 16, bval);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_full + 8 * s) : "memory");
  };
  __syncthreads();   // barriers initialised, row factors written
  if constexpr (!P32)
    for (int q = 0; q < LEAD && q < nk; ++q) issue(q);

  const int wgc = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  constexpr int R = BM / 2;
  float acc0[R], acc1[1];
#pragma unroll
  for (int i = 0; i < R; ++i) acc0[i] = 0.f;
  uint32_t af[2][2][4];   // [half][sub-step][fragment register]
  const int rowb = 64 * wgc + 16 * warp + g;
  if constexpr (P32) {
    // P32: the same schedule in fewer instructions per step: an 8-stage ring (S = 8, LEAD = 6: stage and
    // parity are masks and shifts, not q % 6 and q / 6 on the uniform datapath; two scale-block slots,
    // enough for S <= 9, so the slot is a bit, not (q >> 3) % 3), source pointers advanced per step
    // instead of base + q·stride, per-thread shared-memory offsets computed once, descriptors as the
    // stage's low word + 2·i, mask and fp16 magic in one LOP3, the scale / bias conversions packed per
    // row pair. P34: a ring stage holds KS = 2 consecutive 64-k steps (4 stages, the refill LEAD = 2
    // stages = 4 steps ahead), so the barrier waits, the proxy fence, the refill's bookkeeping and the
    // empty arrival run once per two steps. Same operands, same fp16 roundings, same wgmma order: the
    // same bits either way.
    static_assert((S & (S - 1)) == 0, "P32: power-of-two ring");
    // Scale block b (steps 8b .. 8b + 7, stages 8b / KS ..) goes to slot b % SBS when its first stage is
    // issued, which waits for the release of the stage S earlier; that stage must be past block b - SBS.
    static_assert(8 * C::SBS >= KS * S + 8 - KS, "P32: scale-block slots");
    // The magic in a register ptxas cannot fold (K >= 0, so bit 31 is clear): one LOP3 per pair.
    const uint32_t magic = 0x64006400u ^ (uint32_t(a.K) & 0x80000000u);
    const uint16_t* ap0 = asrc[0];
    const uint16_t* ap1 = asrc[1];
    const uint8_t* cp = csrc;
    const uint8_t* bp = bsrc;
    const int nst = nk / KS;   // stages (launch_moe_wg checks K % 128 == 0)
    int iq = 0;                // next stage to issue
    auto issue2 = [&]() {
      const int s = iq & (S - 1);
      if (iq >= S) mr_wait(bar_empty + 8 * s, ((iq / S) + 1) & 1);
      const uint32_t st = sm0 + s * C::STAGE;
#pragma unroll
      for (int u = 0; u < KS; ++u) {
        if (XA == 2 || tid < BM * 8) cp_async16(st + u * (BM * 128) + xoff0, ap0 + u * kBK, aval[0]);
        if (XA == 2) cp_async16(st + u * (BM * 128) + xoff1, ap1 + u * kBK, aval[1]);
        cp_async16(st + u * (RW * 32) + coff, cp + u * 32, cval);
      }
      if (((iq * KS) & 7) == 0) {
        cp_async16(sm0 + soff + (((iq * KS) >> 3) % C::SBS) * (2 * RW * 16), bp, bval);
        bp += 16;
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_full + 8 * s) : "memory");
      ap0 += KS * kBK;
      ap1 += KS * kBK;
      cp += KS * 32;
      ++iq;
    };
    for (int q = 0; q < LEAD && q < nst; ++q) issue2();
    // This thread's rows Rw = rowb and Rw + 8: codes at stage + X_BYTES + u·RW·32 + Rw·32 + t·8 (+ 256),
    // scale of group k8 at OFF_SB + slot·2·RW·16 + Rw·16 + 2·k8 (+ 128; the bias RW·16 further).
    const uint8_t* crd = smem + C::X_BYTES + rowb * 32 + t * 8;
    const uint8_t* srd = smem + C::OFF_SB + rowb * 16;
    // P38: the wgmmas span NT = the tile's rows rounded up to 32 tokens (activation rows NT.. of the stage are
    // the zero fill; accumulators NT/2.. stay 0 and the epilogue skips rows >= rows): the same products in
    // the same order for every token the tile has, so the same bits, with up to 4x fewer MMAs on short tiles.
    // Each instance has its own accumulators (NT / 2 per thread) and epilogue: with one array shared by the
    // four instances ptxas serialised the wgmmas (C7511).
    auto mainloop = [&](auto ntag) {
      constexpr int NT = decltype(ntag)::value;
      float acc[NT / 2];
#pragma unroll
      for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;
      for (int kq = 0; kq < nst; ++kq) {
        const int s = kq & (S - 1);
        mr_wait(bar_full + 8 * s, (kq / S) & 1);
        if constexpr (AM == kAmF16Grp) {
#pragma unroll
          for (int u = 0; u < KS; ++u) {
            uint8_t* xs = smem + s * C::STAGE + u * (BM * 128);
#pragma unroll
            for (int j = 0; j < XA; ++j) {
              const int idx = tid + NCT * j, m = idx >> 3;
              grp_scale_chunk(xs + swz(m, idx & 7), sgf, m, kq * KS + u);
            }
          }
          fence_proxy_async();
          named_sync(1, NCT);
        } else {
          fence_proxy_async();
        }
#pragma unroll
        for (int u = 0; u < KS; ++u) {
          const int kg = kq * KS + u;   // the 64-k step
          uint2 wv[2];
          __half2 sp, bq;
          {
            const uint8_t* cs = crd + s * C::STAGE + u * (RW * 32);
            wv[0] = *reinterpret_cast<const uint2*>(cs);
            wv[1] = *reinterpret_cast<const uint2*>(cs + 256);
            const uint16_t* sb =
                reinterpret_cast<const uint16_t*>(srd + ((kg >> 3) % C::SBS) * (2 * RW * 16)) + (kg & 7);
            const float s0 = __uint_as_float(uint32_t(sb[0]) << 16) * float(1 << kGemmF16WExp);
            const float s1 = __uint_as_float(uint32_t(sb[64]) << 16) * float(1 << kGemmF16WExp);
            const float b0 = __uint_as_float(uint32_t(sb[RW * 8]) << 16) * float(1 << kGemmF16WExp);
            const float b1 = __uint_as_float(uint32_t(sb[RW * 8 + 64]) << 16) * float(1 << kGemmF16WExp);
            sp = __floats2half2_rn(s0, s1);
            bq = __floats2half2_rn(b0, b1);
          }
          const __half2 s0 = __low2half2(sp), s1 = __high2half2(sp), b0 = __low2half2(bq), b1 = __high2half2(bq);
          const uint32_t dlo = uint32_t(wg_desc(sm0 + s * C::STAGE + u * (BM * 128)));
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            wg_wait<1>();   // half j of step kg - 1 has retired: af[j] is free
            wg_fence_regs<NT / 2>(acc);
            mr_fence_u32<8>(&af[j][0][0]);
            // All of stage kq - 1 retired (its last half is step kg - 1's half 1).
            if (u == 0 && j == 1 && kq > 0) mbar_arrive(bar_empty + 8 * ((kq - 1) & (S - 1)));
            const uint32_t w0 = j ? wv[0].y : wv[0].x, w1 = j ? wv[1].y : wv[1].x;
#pragma unroll
            for (int v = 0; v < 2; ++v) {
              const int i = 2 * j + v;
              if constexpr (P50) {
                af[j][v][0] = dq4_pair_odd<true>(w0, w0 >> 8, (2 * i) & 3, s0, b0, magic);
                af[j][v][1] = dq4_pair_odd<true>(w1, w1 >> 8, (2 * i) & 3, s1, b1, magic);
                af[j][v][2] = dq4_pair_odd<true>(w0, w0 >> 8, (2 * i + 1) & 3, s0, b0, magic);
                af[j][v][3] = dq4_pair_odd<true>(w1, w1 >> 8, (2 * i + 1) & 3, s1, b1, magic);
              } else {
                af[j][v][0] = dq4_pair_m(w0, (2 * i) & 3, s0, b0, magic);
                af[j][v][1] = dq4_pair_m(w1, (2 * i) & 3, s1, b1, magic);
                af[j][v][2] = dq4_pair_m(w0, (2 * i + 1) & 3, s0, b0, magic);
                af[j][v][3] = dq4_pair_m(w1, (2 * i + 1) & 3, s1, b1, magic);
              }
            }
            mr_fence_u32<8>(&af[j][0][0]);
            wg_fence();
            wgmma_rs_tile<NT>(acc, af[j][0], wg_desc_lo(dlo + 2 * (2 * j)));
            wgmma_rs_tile<NT>(acc, af[j][1], wg_desc_lo(dlo + 2 * (2 * j + 1)));
            wg_commit();
          }
        }
        if (iq < nst) issue2();   // stage kq + LEAD into the slot of stage kq - 2 (released during kq - 1)
      }
      wg_wait<0>();
      wg_fence_regs<NT / 2>(acc);
      mr_fence_u32<16>(&af[0][0][0]);
      mw_epilogue<NT, AM, C::SVLD, 1, 4>(a, acc, acc1, smem, srf, by, pos0, rows, tid, wgc, warp, g, t);
    };
    if constexpr (BM == 32) {   // P53: every tile has at most 32 rows
      mainloop(std::integral_constant<int, 32>{});
    } else {
      const int nt = a.var_n ? (rows + 31) / 32 * 32 : BM;
      if (nt <= 32) mainloop(std::integral_constant<int, 32>{});
      else if (nt <= 64) mainloop(std::integral_constant<int, 64>{});
      else if (nt <= 96) mainloop(std::integral_constant<int, 96>{});
      else mainloop(std::integral_constant<int, BM>{});
    }
    return;
  } else {
    for (int kg = 0; kg < nk; ++kg) {
      const int s = kg % S;
      mr_arrive_stage<BM, AM, NCT>(smem, C::STAGE, sgf, bar_full, S, kg, tid);
      uint2 wv[2];
      uint32_t s2[2], b2[2];
      mr_load_codes<RW>(smem + s * C::STAGE + C::X_BYTES,
                        reinterpret_cast<const uint16_t*>(smem + C::OFF_SB + ((kg >> 3) % C::SBS) * (2 * RW * 16)), rowb,
                        kg, t, wv, s2, b2);
      const uint32_t xa = sm0 + s * C::STAGE;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wg_wait<1>();   // half j of step kg - 1 has retired: af[j] is free
        wg_fence_regs<R>(acc0);
        mr_fence_u32<8>(&af[j][0][0]);
        if (j == 1 && kg > 0) mbar_arrive(bar_empty + 8 * ((kg - 1) % S));   // all of step kg - 1 retired
        const uint32_t w0 = j ? wv[0].y : wv[0].x, w1 = j ? wv[1].y : wv[1].x;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int i = 2 * j + u;
          af[j][u][0] = dq4_pair<true>(w0, (2 * i) & 3, s2[0], b2[0]);
          af[j][u][1] = dq4_pair<true>(w1, (2 * i) & 3, s2[1], b2[1]);
          af[j][u][2] = dq4_pair<true>(w0, (2 * i + 1) & 3, s2[0], b2[0]);
          af[j][u][3] = dq4_pair<true>(w1, (2 * i + 1) & 3, s2[1], b2[1]);
        }
        mr_fence_u32<8>(&af[j][0][0]);
        wg_fence();
        wgmma_rs_tile<BM>(acc0, af[j][0], wg_desc(xa + 32 * (2 * j)));
        wgmma_rs_tile<BM>(acc0, af[j][1], wg_desc(xa + 32 * (2 * j + 1)));
        wg_commit();
      }
      // Refill: step kg + LEAD goes into the slot of step kg + LEAD - S = kg - 2, which every thread
      // released during its step kg - 1.
      if (kg + LEAD < nk) issue(kg + LEAD);
    }
  }
  wg_wait<0>();
  wg_fence_regs<R>(acc0);
  mr_fence_u32<16>(&af[0][0][0]);
  mw_epilogue<BM, AM, C::SVLD, 1, 4>(a, acc0, acc1, smem, srf, by, pos0, rows, tid, wgc, warp, g, t);
}

// P55: the MoE down GEMM (K = 512, the scatter epilogue) on the P34 loop with the tile's activations RESIDENT: a CTA
// of 512 threads (4 consumer warpgroups, every thread also copies) takes one tile (expert, 128 rows, wgmma N = the
// rows rounded up to 32 as P38) and NB consecutive 256-row weight blocks. Its 128 x 512 fp16 activation block (128
// KB, 8 swizzled 64-k blocks) is copied once, each 64-k block on its own mbarrier, and scaled by the rows' group
// factors once, in the first weight block's steps; then only the weight codes stream through a 4-stage ring of two
// 64-k steps each (8 KB per step), continuously across the NB weight blocks (the refill runs on during a block's
// epilogue), one scale / bias block (8 groups) per weight block in two slots. Against gemm_kernel (mma.sync, M-tile
// 64, 8 K steps per CTA with its fill and epilogue unhidden, 25 % of the tensor rate at 4K) and the P34 kernel as the
// down GEMM (LILY_MOE_WG=3: the activations copied and scaled again for every 256 weight rows, 8 steps per CTA): the
// same fill per tile serves NB weight blocks. Same operands, same unpacking (P50), same wgmma order as the P34 kernel
// at M-tile 128: with f32 slot rows (Y16 false) the same bits as LILY_MOE_WG=3; Y16 writes P16's saturated fp16 slot
// rows (a lane-pair exchange makes each store two consecutive columns). 214 KB of shared memory, one CTA per SM.
struct RdCfg {
  static constexpr int BM = 128, RW = 256, NCT = 512;
  static constexpr int KB = 8;                        // 64-k blocks of K = 512
  static constexpr int KS = 2, S = 4, SBS = 2;        // steps per stage, ring stages, scale-block slots
  static constexpr int A_BLK = BM * 128;              // one 64-k block of the activations, swizzled (16 KB)
  static constexpr int C_STEP = RW * 32;              // codes of one step (8 KB)
  static constexpr int STAGE = KS * C_STEP;
  static constexpr int OFF_RING = KB * A_BLK;
  static constexpr int OFF_SB = OFF_RING + S * STAGE;               // [SBS][2 kinds][RW rows][8] bf16
  static constexpr int OFF_GF = OFF_SB + SBS * 2 * RW * 16;         // [BM][16] fp16 group factors
  static constexpr int OFF_RF = OFF_GF + BM * (kMaxGrpK / 64) * 2;  // [BM] f32 2^-(s_row + 8)
  static constexpr int OFF_FAC = OFF_RF + BM * 4;                   // [BM] f32 epilogue factors (· routing weight)
  static constexpr int OFF_DST = OFF_FAC + BM * 4;                  // [BM] destination slot rows
  static constexpr int OFF_BAR = OFF_DST + BM * 4;                  // full[S], empty[S], a_full[KB]
  static constexpr int BYTES = OFF_BAR + (2 * S + KB) * 8;
  static constexpr int SMEM = BYTES + 1024;
  // P78 (YM 2): each warp's 16 tile rows x 16 columns of fp16 staged (512 bytes, 8 words per row XOR-swizzled)
  static constexpr int OFF_STG = BYTES;
  static constexpr int SMEM_STG = OFF_STG + (NCT / 32) * 512 + 1024;
  static_assert(A_BLK % 1024 == 0 && OFF_RING % 1024 == 0 && STAGE % 1024 == 0, "swizzle atoms are 1024-aligned");
  static_assert(KB % KS == 0 && S >= 3 && (S & (S - 1)) == 0, "ring");
  // Slot b & 1 was last read by weight block b - 2 (stages up to SPB·b - SPB - 1); the first stage of block b waits
  // for the release of stage SPB·b - S >= SPB·b - SPB - 1.
  static_assert(S <= KB / KS + 1, "scale-block slots");
  static_assert(SMEM_STG <= 227 * 1024 && OFF_STG % 16 == 0, "shared memory");
};

// YM: 0 = f32 slot rows, 1 = fp16 (P16, sat_half per value), 2 = fp16 stored through shared memory (P78).
template <int NB, int YM>
__global__ void __launch_bounds__(512, 1) gemm_moe_down_res_kernel(const __grid_constant__ GemmArgs a) {
  using C = RdCfg;
  constexpr bool Y16 = YM == 1;
  constexpr int BM = C::BM, RW = C::RW, S = C::S, KS = C::KS, NCT = C::NCT, KB = C::KB, LEAD = S - 2;
  constexpr int SPB = KB / KS;   // stages per weight block
  constexpr int NST = NB * SPB;  // stages per CTA
  static_assert(NST >= LEAD, "ring lead");
  extern __shared__ __align__(1024) uint8_t rd_smem_raw[];
  const uint32_t raw0 = smem_addr(rd_smem_raw);
  const uint32_t pad = ((raw0 + 1023u) & ~1023u) - raw0;
  uint8_t* smem = rd_smem_raw + pad;
  const uint32_t sm0 = raw0 + pad;
  uint16_t* sgf = reinterpret_cast<uint16_t*>(smem + C::OFF_GF);
  float* srf = reinterpret_cast<float*>(smem + C::OFF_RF);
  float* sfac = reinterpret_cast<float*>(smem + C::OFF_FAC);
  int* sdst = reinterpret_cast<int*>(smem + C::OFF_DST);
  const uint32_t bar_full = sm0 + C::OFF_BAR, bar_empty = bar_full + 8 * S, bar_a = bar_empty + 8 * S;

  const int tid = threadIdx.x, by0 = blockIdx.x * NB;
  pdl_trigger();
  pdl_wait();
  if (int(blockIdx.y) >= *a.n_tiles) return;
  const int4 tl = a.tiles[blockIdx.y];
  const int group = tl.x, pos0 = tl.y, rows = tl.z;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full + 8 * s, NCT);
      mbar_init(bar_empty + 8 * s, NCT);
    }
    for (int b = 0; b < KB; ++b) mbar_init(bar_a + 8 * b, NCT);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  mw_row_factors<BM, kAmF16Grp>(a, sgf, srf, tid, pos0, rows, a.K);
  if (tid < BM) {   // mw_epilogue's scatter factors, once per tile: sc = srf · scale[pos], row dst[pos]
    sfac[tid] = tid < rows ? srf[tid] * a.scale[pos0 + tid] : 0.f;
    sdst[tid] = tid < rows ? a.dst[pos0 + tid] : 0;
  }

  // This thread's copies: activation chunks tid and tid + 512 of every 64-k block (rows tid / 8 and 64 + tid / 8),
  // the code half (tid & 1) of weight row tid >> 1 of every step, and per weight block the scale (tid < 256) or
  // bias (tid >= 256) block of row tid & 255.
  bool aval[2], cval, bval;
  const uint16_t* asrc[2];
  const uint8_t* csrc;
  const uint8_t* bsrc;
  mr4_copy_srcs<RW, NCT>(a, group, by0, pos0, rows, tid, asrc, aval, csrc, cval, bsrc, bval);
  const uint32_t xoff0 = swz(tid >> 3, tid & 7), xoff1 = swz((tid + NCT) >> 3, tid & 7);
  const uint32_t coff = C::OFF_RING + (tid >> 1) * 32 + (tid & 1) * 16;
  const uint32_t soff = C::OFF_SB + (tid >> 8) * (RW * 16) + (tid & 255) * 16;
  constexpr int64_t kCodesPerBlock = int64_t(RW) * (KB * kBK / 2);   // bytes of one 256-row weight block's codes
  constexpr int64_t kSbPerBlock = int64_t(RW) * KB * 2;              // bytes of its scales (or biases)
  __syncthreads();   // barriers initialised, row factors written

  auto issue_a = [&](int kb) {
    const uint32_t d = sm0 + kb * C::A_BLK;
    cp_async16(d + xoff0, asrc[0] + kb * kBK, aval[0]);
    cp_async16(d + xoff1, asrc[1] + kb * kBK, aval[1]);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_a + 8 * kb) : "memory");
  };
  int iq = 0;   // next stage to issue (over the CTA's NB weight blocks)
  auto issue2 = [&]() {
    const int s = iq & (S - 1);
    if (iq >= S) mr_wait(bar_empty + 8 * s, ((iq / S) + 1) & 1);
    const int nb = iq / SPB, kq = iq % SPB;
    const uint32_t st = sm0 + s * C::STAGE;
    const uint8_t* cp = csrc + nb * kCodesPerBlock + kq * (KS * 32);
#pragma unroll
    for (int u = 0; u < KS; ++u) cp_async16(st + u * C::C_STEP + coff, cp + u * 32, cval);
    if (kq == 0) cp_async16(sm0 + soff + (nb & 1) * (2 * RW * 16), bsrc + nb * kSbPerBlock, bval);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_full + 8 * s) : "memory");
    ++iq;
  };
  // The first stages' activation blocks go first, then their codes; the rest of the activations after the lead.
  for (int q = 0; q < LEAD; ++q) {
#pragma unroll
    for (int u = 0; u < KS; ++u) issue_a(q * KS + u);
    issue2();
  }
  for (int kb = LEAD * KS; kb < KB; ++kb) issue_a(kb);

  const int wgc = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rowb = 64 * wgc + 16 * warp + g;
  const uint32_t magic = 0x64006400u ^ (uint32_t(a.K) & 0x80000000u);   // P32: one LOP3 per pair
  const uint8_t* crd = smem + C::OFF_RING + rowb * 32 + t * 8;
  const uint8_t* srd = smem + C::OFF_SB + rowb * 16;
  uint32_t af[2][2][4];   // [half][sub-step][fragment register]

  auto mainloop = [&](auto ntag) {
    constexpr int NT = decltype(ntag)::value;
    float acc[NT / 2];
    int kq = 0;   // stage being consumed
    // One weight block: its SPB stages (the first block also scales the activation blocks as they land), then
    // the scatter epilogue of its 256 columns.
    auto block = [&](int nb) {
#pragma unroll
      for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;
#pragma unroll 1
      for (int kb0 = 0; kb0 < KB; kb0 += KS, ++kq) {
        const int s = kq & (S - 1);
        mr_wait(bar_full + 8 * s, (kq / S) & 1);
        if (nb == 0) {
#pragma unroll
          for (int u = 0; u < KS; ++u) {
            mr_wait(bar_a + 8 * (kb0 + u), 0);
            uint8_t* xs = smem + (kb0 + u) * C::A_BLK;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int idx = tid + NCT * j, m = idx >> 3;
              grp_scale_chunk(xs + swz(m, idx & 7), sgf, m, kb0 + u);
            }
          }
          fence_proxy_async();
          named_sync(1, NCT);
        }
#pragma unroll
        for (int u = 0; u < KS; ++u) {
          const int kg = kb0 + u;   // the 64-k block
          uint2 wv[2];
          __half2 sp, bq;
          {
            const uint8_t* cs = crd + s * C::STAGE + u * C::C_STEP;
            wv[0] = *reinterpret_cast<const uint2*>(cs);
            wv[1] = *reinterpret_cast<const uint2*>(cs + 256);
            const uint16_t* sb = reinterpret_cast<const uint16_t*>(srd + (nb & 1) * (2 * RW * 16)) + kg;
            const float s0 = __uint_as_float(uint32_t(sb[0]) << 16) * float(1 << kGemmF16WExp);
            const float s1 = __uint_as_float(uint32_t(sb[64]) << 16) * float(1 << kGemmF16WExp);
            const float b0 = __uint_as_float(uint32_t(sb[RW * 8]) << 16) * float(1 << kGemmF16WExp);
            const float b1 = __uint_as_float(uint32_t(sb[RW * 8 + 64]) << 16) * float(1 << kGemmF16WExp);
            sp = __floats2half2_rn(s0, s1);
            bq = __floats2half2_rn(b0, b1);
          }
          const __half2 s0 = __low2half2(sp), s1 = __high2half2(sp), b0 = __low2half2(bq), b1 = __high2half2(bq);
          const uint32_t dlo = uint32_t(wg_desc(sm0 + kg * C::A_BLK));
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            wg_wait<1>();   // half j of the previous step has retired: af[j] is free
            wg_fence_regs<NT / 2>(acc);
            mr_fence_u32<8>(&af[j][0][0]);
            // All of stage kq - 1 retired (its last half is the previous step's half 1).
            if (u == 0 && j == 1 && kq > 0) mbar_arrive(bar_empty + 8 * ((kq - 1) & (S - 1)));
            const uint32_t w0 = j ? wv[0].y : wv[0].x, w1 = j ? wv[1].y : wv[1].x;
#pragma unroll
            for (int v = 0; v < 2; ++v) {
              const int i = 2 * j + v;
              af[j][v][0] = dq4_pair_odd<true>(w0, w0 >> 8, (2 * i) & 3, s0, b0, magic);
              af[j][v][1] = dq4_pair_odd<true>(w1, w1 >> 8, (2 * i) & 3, s1, b1, magic);
              af[j][v][2] = dq4_pair_odd<true>(w0, w0 >> 8, (2 * i + 1) & 3, s0, b0, magic);
              af[j][v][3] = dq4_pair_odd<true>(w1, w1 >> 8, (2 * i + 1) & 3, s1, b1, magic);
            }
            mr_fence_u32<8>(&af[j][0][0]);
            wg_fence();
            wgmma_rs_tile<NT>(acc, af[j][0], wg_desc_lo(dlo + 2 * (2 * j)));
            wgmma_rs_tile<NT>(acc, af[j][1], wg_desc_lo(dlo + 2 * (2 * j + 1)));
            wg_commit();
          }
        }
        if (iq < NST) issue2();   // stage kq + LEAD into the slot of stage kq - 2 (released during kq - 1)
      }
      wg_wait<0>();
      wg_fence_regs<NT / 2>(acc);
      mr_fence_u32<16>(&af[0][0][0]);
      // Scatter: accumulator i is weight row 64·wgc + 16·warp + g + 8·((i >> 1) & 1) of this block, tile row
      // 8·(i >> 2) + 2t + (i & 1); slot row dst[pos], value sfac[m] · acc (mw_epilogue's product).
      if constexpr (YM == 2) {
        // P78: YM 1's values, stored as 16 bytes per lane. Per pair of 8-row groups the warp's 16 rows x 16 columns
        // go through its 512-byte staging block (row r: 8 words of two columns, word w at w ^ 4·((r >> 2) & 1), so
        // neither side's accesses share a bank), then each lane stores 8 columns of one row: every store instruction
        // writes 16 rows x 32 bytes (whole sectors) instead of 8 rows x 16 bytes.
        uint32_t* stg = reinterpret_cast<uint32_t*>(smem + C::OFF_STG) + (tid >> 5) * 128;
        const int nw0 = (by0 + nb) * RW + 64 * wgc + 16 * warp;   // the warp's first column
#pragma unroll
        for (int pp = 0; pp < NT / 16; ++pp) {
#pragma unroll
          for (int jl = 0; jl < 2; ++jl)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int jj = 2 * pp + jl;
              const float v0 = acc[4 * jj + 2 * hh], v1 = acc[4 * jj + 2 * hh + 1];
              const float recv = __shfl_xor_sync(0xffffffffu, (g & 1) ? v0 : v1, 4);
              const int r = 8 * jl + 2 * t + (g & 1);
              const float sc = sfac[16 * pp + r];
              const float lo = (g & 1) ? recv : v0, hi = (g & 1) ? v1 : recv;
              stg[r * 8 + (((g >> 1) + 4 * hh) ^ (((r >> 2) & 1) << 2))] =
                  h2_bits(__halves2half2(sat_half(sc * lo), sat_half(sc * hi)));
            }
          __syncwarp();
          const int r = lane >> 1, hc = lane & 1, m = 16 * pp + r;
          if (m < rows) {
            const uint4 v = *reinterpret_cast<const uint4*>(stg + r * 8 + 4 * (hc ^ ((r >> 2) & 1)));
            __half* hrow = reinterpret_cast<__half*>(a.y) + int64_t(sdst[m]) * a.ldy;
            *reinterpret_cast<uint4*>(hrow + nw0 + 8 * hc) = v;
          }
          __syncwarp();   // the block is rewritten by the next pair
        }
      } else {
        const int n0 = (by0 + nb) * RW + 64 * wgc + 16 * warp + g;
#pragma unroll
        for (int jj = 0; jj < NT / 8; ++jj)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float v0 = acc[4 * jj + 2 * hh], v1 = acc[4 * jj + 2 * hh + 1];
            const int m0 = 8 * jj + 2 * t, n = n0 + 8 * hh;
            if constexpr (Y16) {
              // Lanes g and g ^ 1 swap one value each: the even lane then holds columns n, n + 1 of row m0, the odd
              // lane columns n - 1, n of row m0 + 1 (P16's fp16 pair store).
              const float recv = __shfl_xor_sync(0xffffffffu, (g & 1) ? v0 : v1, 4);
              const int m = m0 + (g & 1);
              if (m < rows) {
                const float sc = sfac[m];
                const float lo = (g & 1) ? recv : v0, hi = (g & 1) ? v1 : recv;
                __half* hrow = reinterpret_cast<__half*>(a.y) + int64_t(sdst[m]) * a.ldy;
                *reinterpret_cast<__half2*>(hrow + (n & ~1)) = __halves2half2(sat_half(sc * lo), sat_half(sc * hi));
              }
            } else {
              if (m0 < rows) a.y[int64_t(sdst[m0]) * a.ldy + n] = sfac[m0] * v0;
              if (m0 + 1 < rows) a.y[int64_t(sdst[m0 + 1]) * a.ldy + n] = sfac[m0 + 1] * v1;
            }
          }
      }
    };
    // One loop instance over the blocks: with block 0 (the scaling) as its own copy ahead of the loop, or the
    // stage loop unrolled, ptxas serialised the wgmmas (C7511, "insufficient register resources").
#pragma unroll 1
    for (int nb = 0; nb < NB; ++nb) block(nb);
  };
  const int nt = a.var_n ? (rows + 31) / 32 * 32 : BM;
  if (nt <= 32) mainloop(std::integral_constant<int, 32>{});
  else if (nt <= 64) mainloop(std::integral_constant<int, 64>{});
  else if (nt <= 96) mainloop(std::integral_constant<int, 96>{});
  else mainloop(std::integral_constant<int, BM>{});
}

// Grid (weight-row blocks, worst-case tiles): the 256-row blocks of one tile run next to each
// other (they share the tile's gathered activation rows in L2).
template <int BM, int AM>
void launch_moe_wg_t(const GemmArgs& a, int max_tiles, int grid_n, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_moe_wg_kernel<BM, AM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    MwCfg<BM>::SMEM));
    attr = true;
  }
  launch(gemm_moe_wg_kernel<BM, AM>, dim3(grid_n, max_tiles), dim3(kMwThreads), size_t(MwCfg<BM>::SMEM), s, a);
  CUDA_LAUNCH_CHECK();
}
template <int AM, int DIAG = 0, int NS = 6, int BM = 64, int NH = 2>
void launch_moe_rs_t(const GemmArgs& a, int max_tiles, int grid_n, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_moe_rs_kernel<BM, AM, DIAG, NS, NH>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, MrCfg<BM, NS, NH>::SMEM));
    attr = true;
  }
  launch(gemm_moe_rs_kernel<BM, AM, DIAG, NS, NH>, dim3(grid_n, max_tiles), dim3(kMwThreads),
         size_t(MrCfg<BM, NS, NH>::SMEM), s, a);
  CUDA_LAUNCH_CHECK();
}
template <int AM, bool P32, bool P34 = false, bool P50 = false, int BM = 128>
void launch_moe_rs4_t(const GemmArgs& a, int max_tiles, int grid_n, cudaStream_t s) {
  using C = Rs4Cfg<P32, P34, BM>;
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_moe_rs4_kernel<AM, P32, P34, P50, BM>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
    attr = true;
  }
  launch(gemm_moe_rs4_kernel<AM, P32, P34, P50, BM>, dim3(grid_n, max_tiles), dim3(C::NCT), size_t(C::SMEM), s, a);
  CUDA_LAUNCH_CHECK();
}
template <int NB, int YM>
void launch_moe_down_res_t(const GemmArgs& a, int max_tiles, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_moe_down_res_kernel<NB, YM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    YM == 2 ? RdCfg::SMEM_STG : RdCfg::SMEM));
    attr = true;
  }
  launch(gemm_moe_down_res_kernel<NB, YM>, dim3(a.N / (RdCfg::RW * NB), max_tiles), dim3(RdCfg::NCT),
         size_t(YM == 2 ? RdCfg::SMEM_STG : RdCfg::SMEM), s, a);
  CUDA_LAUNCH_CHECK();
}
// P55: the down GEMM at M-tile 128 with the activation tile resident, nb (2, 4 or 8) weight blocks of 256 rows per
// CTA, fp16 slot rows when y16 (with p78, stored 16 bytes per lane through shared memory: the same values). False
// where the shape is not the kernel's (K = 512, N a multiple of 256·nb).
bool launch_moe_down_res(const GemmArgs& a, int max_tiles, int nb, bool y16, bool p78, cudaStream_t s) {
  if (a.K != RdCfg::KB * kBK || a.mode != kScatter || (nb != 2 && nb != 4 && nb != 8) || a.N % (RdCfg::RW * nb) != 0)
    return false;
  const int ym = !y16 ? 0 : p78 && a.ldy % 8 == 0 && reinterpret_cast<uintptr_t>(a.y) % 16 == 0 ? 2 : 1;
  auto go = [&](auto nbc) {
    constexpr int NB = decltype(nbc)::value;
    if (ym == 2) launch_moe_down_res_t<NB, 2>(a, max_tiles, s);
    else if (ym == 1) launch_moe_down_res_t<NB, 1>(a, max_tiles, s);
    else launch_moe_down_res_t<NB, 0>(a, max_tiles, s);
  };
  if (nb == 8) go(std::integral_constant<int, 8>{});
  else if (nb == 4) go(std::integral_constant<int, 4>{});
  else go(std::integral_constant<int, 2>{});
  return true;
}
// mode 1: P14, mode 2: P15. bm: the tile list's M-tile (32 runs the 64 kernel, rows <= 32 of 64, unless P53
// takes it on the P34 kernel at M-tile 32).
// Returns false where the mode has no kernel for bm (P15 at 128 with P17 off: the caller runs gemm_kernel).
bool launch_moe_wg(int mode, int am, int bm, const GemmArgs& a, int max_tiles, int grid_n, cudaStream_t s) {
  LILY_CHECK(a.K % kBK == 0 && a.K / kBK >= 1 && (am != kAmF16Grp || a.K <= kMaxGrpK), "gemm: P14/P15 shape");
  if (mode == 2) {
    if (a.K % 128 != 0 || (bm == 128 && !gemm_moe_p17())) return false;
    // P53: the SwiGLU GEMM at M-tile 32 on the P18 kernel with P34's loop and an 8-stage ring.
    if (bm == 32 && a.swiglu && am == kAmF16 && gemm_moe_p53() && gemm_moe_p18() && gemm_moe_p32() && gemm_moe_p34() &&
        gemm_moe_p50()) {
      launch_moe_rs4_t<kAmF16, true, true, true, 32>(a, max_tiles, a.N / 128, s);
      return true;
    }
    if (bm == 128) {   // P17: m64n128k16, 128 weight rows per CTA (one m64 block per consumer warpgroup)
      if (gemm_moe_p18()) {   // P18: 4 warpgroups, 256 weight rows per CTA
        const int gn = a.swiglu ? a.N / 128 : (a.N + 255) / 256;
        if (gemm_moe_p32() && gemm_moe_p34() && gemm_moe_p50()) {   // P50: odd pairs unpacked in place
          if (am == kAmF16Grp) launch_moe_rs4_t<kAmF16Grp, true, true, true>(a, max_tiles, gn, s);
          else launch_moe_rs4_t<kAmF16, true, true, true>(a, max_tiles, gn, s);
        } else if (gemm_moe_p32() && gemm_moe_p34()) {   // P34: two 64-k steps per ring stage
          if (am == kAmF16Grp) launch_moe_rs4_t<kAmF16Grp, true, true>(a, max_tiles, gn, s);
          else launch_moe_rs4_t<kAmF16, true, true>(a, max_tiles, gn, s);
        } else if (gemm_moe_p32()) {   // P32: the same kernel's step loop in fewer instructions
          if (am == kAmF16Grp) launch_moe_rs4_t<kAmF16Grp, true>(a, max_tiles, gn, s);
          else launch_moe_rs4_t<kAmF16, true>(a, max_tiles, gn, s);
        } else if (am == kAmF16Grp) {
          launch_moe_rs4_t<kAmF16Grp, false>(a, max_tiles, gn, s);
        } else {
          launch_moe_rs4_t<kAmF16, false>(a, max_tiles, gn, s);
        }
        return true;
      }
      const int gn = a.swiglu ? a.N / 64 : (a.N + 127) / 128;
      if (am == kAmF16Grp) launch_moe_rs_t<kAmF16Grp, 0, 6, 128, 1>(a, max_tiles, gn, s);
      else switch (env_int("LILY_P15_DIAG", 0)) {   // timing diagnostics, as for the 64 kernel below
          case 2: launch_moe_rs_t<kAmF16, 2, 6, 128, 1>(a, max_tiles, gn, s); break;
          case 4: launch_moe_rs_t<kAmF16, 4, 6, 128, 1>(a, max_tiles, gn, s); break;
          case 6: launch_moe_rs_t<kAmF16, 6, 6, 128, 1>(a, max_tiles, gn, s); break;
          default: launch_moe_rs_t<kAmF16, 0, 6, 128, 1>(a, max_tiles, gn, s);
        }
      return true;
    }
    // LILY_P15_STAGES=12: a 12-stage ring (219 KB of shared memory) instead of 6 (123 KB).
    const bool deep = env_int("LILY_P15_STAGES", 6) == 12;
    if (am == kAmF16Grp) {
      if (deep) launch_moe_rs_t<kAmF16Grp, 0, 12>(a, max_tiles, grid_n, s);
      else launch_moe_rs_t<kAmF16Grp>(a, max_tiles, grid_n, s);
      return true;
    }
    if (deep) {
      launch_moe_rs_t<kAmF16, 0, 12>(a, max_tiles, grid_n, s);
      return true;
    }
    switch (env_int("LILY_P15_DIAG", 0)) {   // timing diagnostics (gemm_moe_rs_kernel's DIAG)
      case 1: launch_moe_rs_t<kAmF16, 1>(a, max_tiles, grid_n, s); break;
      case 2: launch_moe_rs_t<kAmF16, 2>(a, max_tiles, grid_n, s); break;
      case 4: launch_moe_rs_t<kAmF16, 4>(a, max_tiles, grid_n, s); break;
      case 6: launch_moe_rs_t<kAmF16, 6>(a, max_tiles, grid_n, s); break;
      case 16: launch_moe_rs_t<kAmF16, 6, 12>(a, max_tiles, grid_n, s); break;   // 6 with 12 stages
      default: launch_moe_rs_t<kAmF16>(a, max_tiles, grid_n, s);
    }
    return true;
  }
  if (bm == 128) {
    if (am == kAmF16Grp) launch_moe_wg_t<128, kAmF16Grp>(a, max_tiles, grid_n, s);
    else launch_moe_wg_t<128, kAmF16>(a, max_tiles, grid_n, s);
  } else {
    if (am == kAmF16Grp) launch_moe_wg_t<64, kAmF16Grp>(a, max_tiles, grid_n, s);
    else launch_moe_wg_t<64, kAmF16>(a, max_tiles, grid_n, s);
  }
  return true;
}
