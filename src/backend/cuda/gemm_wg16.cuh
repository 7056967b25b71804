// Hopper (sm_90a) GEMM for 16-bit weights (P13): the P8 path's y = x · Wᵀ once W has been
// dequantised into its fp16 copy (gemm_dequant), on wgmma instead of mma.sync. A persistent,
// warp-specialised CTA of 3 warpgroups computes 128-token x 256-weight-row output tiles:
// warpgroup 0 (producer) copies each 64-column K step of activations (128 rows) and weights (256
// rows) with cp.async into a 4-stage ring in the 128-byte-swizzled K-major layout that wgmma reads,
// and signals a stage on its "full" mbarrier once its own copies have landed; warpgroups 1 and 2
// (consumers) each issue wgmma.mma_async m64n256k16 on 64 of the tile's tokens with both operands
// taken from shared memory by descriptor (A = activations, B = weights, both K-major), keep one
// wgmma group in flight, and release a stage on its "empty" mbarrier once the group that read it
// has completed. The epilogue stores from the accumulators (128 f32 per thread) with the factors
// of gemm_kernel (fp16 row scale 2^-s · 2^-8), while the producer already fills the ring for the
// CTA's next tile. Orientation is gemm_kernel's (wgmma M = tokens, N = weight rows), unlike P1w.
// Both operands are in the mma k-order (gemm.h); a common permutation of K changes nothing.
// TMA variant (LILY_GEMM_WG16_TMA=1 or LILY_GEMM_WG16=2, opt-in until measured): one producer thread
// loads each stage with two cp.async.bulk.tensor copies (tensor maps with the 128-byte swizzle, the
// same smem layout; rows past T or N filled with zeros) that complete on the full mbarrier by
// transaction count; no per-thread copies, no proxy fence.
// Included by gemm.cu after gemm_wgmma.cuh (descriptor, mbarrier and fence helpers), inside its
// anonymous namespace.

constexpr int kW16Threads = 384;   // producer warpgroup + 2 consumer warpgroups
constexpr int kW16BM = 128;        // tokens per tile (64 per consumer warpgroup)
constexpr int kW16BN = 256;        // weight rows per tile (wgmma N)

struct W16Cfg {
  static constexpr int S = 4;                   // stages in the ring
  static constexpr int D = S - 1;               // steps the producer's copies run ahead of its arrivals
  static constexpr int A_BYTES = kW16BM * 128;  // fp16 activations, 128 rows x 64 k
  static constexpr int B_BYTES = kW16BN * 128;  // fp16 weights, 256 rows x 64 k
  static constexpr int STAGE = A_BYTES + B_BYTES;
  static constexpr int OFF_BAR = S * STAGE;     // full[S], empty[S]
  static constexpr int BYTES0 = OFF_BAR + 2 * S * 8;
  static constexpr int OFF_STG = (BYTES0 + 15) / 16 * 16;   // P81: 8 consumer warps x 16 rows x 128 bytes
  static constexpr int BYTES = OFF_STG + 8 * 16 * 128;
  static constexpr int SMEM = BYTES + 1024;     // slack to align the base to 1024
  static_assert(A_BYTES % 1024 == 0 && STAGE % 1024 == 0, "swizzle atoms are 1024-aligned");
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

// D[64 x 256] += A[64 x 16] · B[16 x 256]: A and B K-major in shared memory (descriptors), fp16 in,
// f32 accumulators (generated text: the accumulator list is long).
__device__ __forceinline__ void wg16_mma(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(1));
}

// TMA: the tensor maps of A [M, K] (box 64 x 128) and B [N, K] (box 64 x 256), fp16, 128-byte swizzle.
struct W16Maps {
  CUtensorMap a, b;
};
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Tile t of the persistent walk: M tiles fastest, so that the CTAs running at once share the
// weight tiles (each read from DRAM about once; the activations of a 4K chunk fit in L2 anyway).
__device__ __forceinline__ void wg16_tile(int t, int gm, int& bx, int& by) {
  by = t / gm;
  bx = t - by * gm;
}
// Work unit u of the persistent walk: with SPLIT (P68: K in a.ksplit slices) unit u is tile u % tiles
// of K slice kz = u / tiles (the slices of a tile far apart, so that the CTAs running at once read
// every tile's activations once per slice); without, kz = 0 and u is the tile.
template <bool SPLIT>
__device__ __forceinline__ void wg16_unit(int u, int tiles, int gm, int& bx, int& by, int& kz) {
  if constexpr (SPLIT) {
    kz = u / tiles;
    wg16_tile(u - kz * tiles, gm, bx, by);
  } else {
    kz = 0;
    wg16_tile(u, gm, bx, by);
  }
}

// SPLIT (P68, TMA and plain store mode only): K in a.ksplit slices, slice z's partial product written at
// a.y + z · a.zstride.
template <bool TMA, bool SEG = false, bool SPLIT = false>
__global__ void __launch_bounds__(kW16Threads, 1)
    gemm_wg16_kernel(const __grid_constant__ GemmArgs a, const __grid_constant__ W16Maps maps) {
  using C = W16Cfg;
  constexpr int S = C::S, D = C::D;
  extern __shared__ __align__(1024) uint8_t w16_smem_raw[];
  // The 128-byte swizzle is a function of address bits 4-9, so tiles must start 1024-aligned.
  const uint32_t raw0 = smem_addr(w16_smem_raw);
  const uint32_t sm0 = (raw0 + 1023u) & ~1023u;
  const uint32_t bar_full = sm0 + C::OFF_BAR, bar_empty = bar_full + 8 * S;

  const int tid = threadIdx.x;
  const int K = a.K, nk = K / kBK / (SPLIT ? a.ksplit : 1), M = a.M, N = a.N;   // nk: k-steps per unit
  const int gm = (M + kW16BM - 1) / kW16BM, tiles = gm * ((N + kW16BN - 1) / kW16BN);
  const int units = SPLIT ? tiles * a.ksplit : tiles;
  const int my_tiles = int(blockIdx.x) < units ? (units - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full + 8 * s, TMA ? 1 : 128);   // TMA: one arrival + the transaction bytes
      mbar_init(bar_empty + 8 * s, 256);   // every consumer thread arrives once per use
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  pdl_trigger();
  __syncthreads();   // barrier init visible to all 384 threads
  // Both operands come from the kernels just before (gemm_convert_a, gemm_dequant), and y may still
  // be read by an earlier kernel: nothing global is touched before the wait.
  pdl_wait();

  if (TMA && tid < 128) {
    // ---- producer, TMA: thread 0 alone; per step wait for the slot, announce 48 KB, two copies ----
    if (tid == 0) {
      const int total = my_tiles * nk;
      int pos0 = 0, n0 = 0, k0 = 0;
      for (int q = 0; q < total; ++q) {
        if (q >= S) mbar_wait(bar_empty + 8 * (q % S), ((q / S) + 1) & 1);
        const int i = q / nk, kg = q - i * nk;
        if (kg == 0) {
          int bx, by, kz;
          wg16_unit<SPLIT>(int(blockIdx.x) + i * int(gridDim.x), tiles, gm, bx, by, kz);
          pos0 = bx * kW16BM;
          n0 = by * kW16BN;
          k0 = kz * nk * kBK;
        }
        const uint32_t st = sm0 + (q % S) * C::STAGE, fb = bar_full + 8 * (q % S);
        mbar_expect_tx(fb, C::STAGE);
        tma_load_2d(st, &maps.a, k0 + kg * kBK, pos0, fb);
        tma_load_2d(st + C::A_BYTES, &maps.b, k0 + kg * kBK, n0, fb);
      }
    }
    return;
  }
  if (!TMA && tid < 128) {
    static_assert(TMA || !SPLIT, "P68's K slices are on the TMA producer only");
    // ---- producer warpgroup. Thread (r0 = tid / 8, c = tid % 8) copies 16-byte chunk c of rows
    // r0 + 16j: activation rows j < 8, weight rows j < 16. Its swizzled destination is swz(r0, c)
    // + 2048j (r & 7 is the same for all j). Steps run continuously over the CTA's tiles: global
    // step q = tile i · nk + kg uses slot q % S. ----
    const int r0 = tid >> 3, c = tid & 7;
    const uint32_t dst0 = uint32_t(swz(r0, c));
    const uint16_t* bmat = static_cast<const uint16_t*>(a.b.w[0].data);
    int cur = -1, arows = 0, brows = 0;
    const uint16_t *abase = nullptr, *bbase = nullptr;
    const int total = my_tiles * nk;
    for (int q = 0; q < total; ++q) {
      if (q >= D) {   // this thread's copies of step q - D have landed (groups 0..q-1 committed)
        cp_wait<D - 1>();
        fence_proxy_async();   // cp.async writes (generic proxy) -> wgmma operand reads (async proxy)
        mbar_arrive(bar_full + 8 * ((q - D) % S));
      }
      // Slot q % S last held step q - S: wait until both consumer warpgroups released it.
      if (q >= S) mbar_wait(bar_empty + 8 * (q % S), ((q / S) + 1) & 1);
      const int i = q / nk, kg = q - i * nk;
      if (i != cur) {
        cur = i;
        int bx, by;
        wg16_tile(int(blockIdx.x) + i * int(gridDim.x), gm, bx, by);
        const int pos0 = bx * kW16BM, n0 = by * kW16BN;
        arows = min(kW16BM, M - pos0);
        brows = min(kW16BN, N - n0);
        // Rows past the end read nothing (src-size 0) from a valid address: the tile's first row.
        abase = a.a + int64_t(pos0 + (r0 < arows ? r0 : 0)) * K + c * 8;
        bbase = bmat + int64_t(n0 + (r0 < brows ? r0 : 0)) * K + c * 8;
      }
      const uint32_t st = sm0 + (q % S) * C::STAGE + dst0;
#pragma unroll
      for (int j = 0; j < kW16BM / 16; ++j) {
        const bool v = r0 + 16 * j < arows;
        cp_async16(st + 2048 * j, v ? abase + int64_t(16 * j) * K + kg * kBK : abase, v);
      }
#pragma unroll
      for (int j = 0; j < kW16BN / 16; ++j) {
        const bool v = r0 + 16 * j < brows;
        cp_async16(st + C::A_BYTES + 2048 * j, v ? bbase + int64_t(16 * j) * K + kg * kBK : bbase, v);
      }
      cp_commit();
    }
    cp_wait<0>();
    fence_proxy_async();
    for (int q = max(0, total - D); q < total; ++q) mbar_arrive(bar_full + 8 * (q % S));
    return;
  }

  // ---- consumer warpgroups: wgc 0/1 computes tokens 64·wgc .. 64·wgc + 63 of each tile ----
  const int ct = tid - 128, wgc = ct >> 7, warp = (ct >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  float acc[128];
  int it = 0;   // global step
  for (int i = 0; i < my_tiles; ++i) {
#pragma unroll
    for (int e = 0; e < 128; ++e) acc[e] = 0.f;
    for (int kg = 0; kg < nk; ++kg, ++it) {
      const int s = it % S;
      mbar_wait(bar_full + 8 * s, (it / S) & 1);
      const uint32_t xa = sm0 + s * C::STAGE + wgc * 64 * 128;   // this warpgroup's 64 token rows
      const uint32_t wa = sm0 + s * C::STAGE + C::A_BYTES;       // all 256 weight rows
      wg_fence_regs<128>(acc);
      wg_fence();
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16)   // k16 steps: 32 bytes further inside each 128-byte swizzled row
        wg16_mma(acc, wg_desc(xa + 32 * k16), wg_desc(wa + 32 * k16));
      wg_commit();
      wg_wait<1>();   // the previous step's group has finished reading its slot
      wg_fence_regs<128>(acc);
      if (kg > 0) mbar_arrive(bar_empty + 8 * ((it - 1) % S));
    }
    wg_wait<0>();
    wg_fence_regs<128>(acc);
    mbar_arrive(bar_empty + 8 * ((it - 1) % S));   // the tile's last step

    // ---- epilogue. Accumulator 4j + 2h + e of a thread (warp w of its warpgroup, lane 4g + t):
    // token 16w + g + 8h of the warpgroup's 64, weight row 8j + 2t + e of the tile's 256. ----
    int bx, by, kz;
    wg16_unit<SPLIT>(int(blockIdx.x) + i * int(gridDim.x), tiles, gm, bx, by, kz);
    const int pos0 = bx * kW16BM, rows = min(kW16BM, M - pos0), n0 = by * kW16BN;
    // P30 (SEG): with output segments, column n of segment q (seg_n0[q] <= n < seg_n0[q + 1]) goes
    // to seg_y[q] at column n - seg_n0[q]. A tile inside one segment keeps the plain path.
    int sg = 0;
    if constexpr (SEG)
      for (int q = 1; q < a.nseg; ++q)
        if (n0 >= a.seg_n0[q]) sg = q;
    const bool mixed = SEG && sg + 1 < a.nseg && n0 + kW16BN > a.seg_n0[sg + 1];
    float* const ybase = SEG ? a.seg_y[sg] : SPLIT ? a.y + kz * a.zstride : a.y;
    const int64_t ld = SEG ? a.seg_ld[sg] : a.ldy;
    const int nb = SEG ? a.seg_n0[sg] : 0;
    const bool h16 = SEG && ((a.seg_h16 >> sg) & 1);   // P62: this segment as saturated fp16
    if constexpr (SEG) {
      // P81: a whole 256-column tile inside an fp16 segment goes out in four 64-column quarters through the warp's
      // 2 KB staging block (16 rows x 8 chunks of 16 bytes, chunk c of row r at c ^ (r & 7): neither side shares a
      // bank), then as 16-byte stores, each instruction 4 whole 128-byte rows. The values are the path's below.
      const int seg_end = sg + 1 < a.nseg ? a.seg_n0[sg + 1] : N;
      if (h16 && !mixed && a.p81 && n0 + kW16BN <= seg_end && ((ld | (n0 - nb)) & 7) == 0 &&
          (reinterpret_cast<uintptr_t>(ybase) & 15) == 0) {
        uint32_t* stg = reinterpret_cast<uint32_t*>(w16_smem_raw + (sm0 - raw0) + C::OFF_STG) + (ct >> 5) * 512;
        float sc[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = wgc * 64 + warp * 16 + g + 8 * h;
          sc[h] = m < rows ? a.a_scale[pos0 + m] * kInvW : 0.f;
        }
        __half* const hbase = reinterpret_cast<__half*>(ybase) + (n0 - nb);
#pragma unroll
        for (int cq = 0; cq < 4; ++cq) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int j = 8 * cq + jj, r = g + 8 * h;
              const float v0 = sc[h] * acc[4 * j + 2 * h], v1 = sc[h] * acc[4 * j + 2 * h + 1];
              const __half2 hv = __halves2half2(sat_half(v0), sat_half(v1));
              stg[r * 32 + ((jj ^ (r & 7)) << 2) + t] = *reinterpret_cast<const uint32_t*>(&hv);
            }
          __syncwarp();
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int r = 4 * k + (lane >> 3), c = lane & 7, m = wgc * 64 + warp * 16 + r;
            if (m < rows) {
              const uint4 v = *reinterpret_cast<const uint4*>(stg + r * 32 + ((c ^ (r & 7)) << 2));
              *reinterpret_cast<uint4*>(hbase + (pos0 + m) * ld + 64 * cq + 8 * c) = v;
            }
          }
          __syncwarp();   // the block is rewritten by the next quarter
        }
        continue;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = wgc * 64 + warp * 16 + g + 8 * h;
      if (m >= rows) continue;
      const int64_t pos = pos0 + m;
      const float sc = a.a_scale[pos] * kInvW;   // gemm_kernel's row_factor (AM 1, no gather)
      float* yrow = ybase + pos * ld;
#pragma unroll
      for (int j = 0; j < kW16BN / 8; ++j) {
        const int n = n0 + 8 * j + 2 * t;
        const float v0 = sc * acc[4 * j + 2 * h], v1 = sc * acc[4 * j + 2 * h + 1];
        if (SEG && mixed) {   // segment starts are even: n and n + 1 share one
          if (n < N) {
            int q = sg;
            while (q + 1 < a.nseg && n >= a.seg_n0[q + 1]) ++q;
            const int64_t off = pos * a.seg_ld[q] + (n - a.seg_n0[q]);
            if ((a.seg_h16 >> q) & 1) {
              __half* hq = reinterpret_cast<__half*>(a.seg_y[q]) + off;
              hq[0] = sat_half(v0);
              if (n + 1 < N) hq[1] = sat_half(v1);
            } else {
              float* yq = a.seg_y[q] + off;
              yq[0] = v0;
              if (n + 1 < N) yq[1] = v1;
            }
          }
          continue;
        }
        const int col = n - nb;
        if (SEG && h16) {   // ld and the segment starts are even: 4-byte pair stores
          __half* hrow = reinterpret_cast<__half*>(ybase) + pos * ld;
          if (n + 1 < N) *reinterpret_cast<__half2*>(hrow + col) = __halves2half2(sat_half(v0), sat_half(v1));
          else if (n < N) hrow[col] = sat_half(v0);
          continue;
        }
        if (n + 1 < N && (ld & 1) == 0) {
          float2* p = reinterpret_cast<float2*>(yrow + col);
          if (a.mode == kAccum) {
            const float2 o = *p;
            *p = make_float2(o.x + v0, o.y + v1);
          } else {
            *p = make_float2(v0, v1);
          }
        } else {
          if (n < N) yrow[col] = a.mode == kAccum ? yrow[col] + v0 : v0;
          if (n + 1 < N) yrow[col + 1] = a.mode == kAccum ? yrow[col + 1] + v1 : v1;
        }
      }
    }
  }
}

void wg16_map(CUtensorMap* m, const void* p, int K, int rows, int box_rows) {
  tma_map_f16(m, p, uint64_t(K), uint64_t(rows), uint64_t(K) * 2, uint32_t(kBK), uint32_t(box_rows), "gemm");
}

// One CTA per SM (193 KB of shared memory), each walking tiles blockIdx.x + i·gridDim.x.
template <bool TMA, bool SEG, bool SPLIT = false>
void launch_wg16_t(const GemmArgs& a, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_wg16_kernel<TMA, SEG, SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    W16Cfg::SMEM));
    attr = true;
  }
  W16Maps maps;
  std::memset(&maps, 0, sizeof maps);
  if (TMA) {
    wg16_map(&maps.a, a.a, a.K, a.M, kW16BM);
    wg16_map(&maps.b, a.b.w[0].data, a.K, a.N, kW16BN);
  }
  const int tiles = ((a.M + kW16BM - 1) / kW16BM) * ((a.N + kW16BN - 1) / kW16BN) * (SPLIT ? a.ksplit : 1);
  // LILY_GEMM_WG16_GRID (tests): fewer CTAs, i.e. more tiles per CTA.
  const int cap = env_int("LILY_GEMM_WG16_GRID", 0);
  const int grid = std::min(tiles, cap > 0 ? cap : sm_count());
  launch(gemm_wg16_kernel<TMA, SEG, SPLIT>, dim3(grid), dim3(kW16Threads), size_t(W16Cfg::SMEM), s, a, maps);
  CUDA_LAUNCH_CHECK();
}
void launch_wg16(const GemmArgs& a, bool tma, cudaStream_t s) {
  if (a.ksplit > 1) {   // P68
    LILY_CHECK(tma && a.nseg == 0 && a.mode == kStore && (a.K / kBK) % a.ksplit == 0,
               "gemm_wg16: K slices need the TMA form, one output, store mode, whole k-steps per slice");
    launch_wg16_t<true, false, true>(a, s);
  } else if (a.nseg > 0) {   // P30
    if (tma) launch_wg16_t<true, true>(a, s);
    else launch_wg16_t<false, true>(a, s);
  } else if (tma) {
    launch_wg16_t<true, false>(a, s);
  } else {
    launch_wg16_t<false, false>(a, s);
  }
}
