// Prefill matrix path of the CUDA backend (P1–P3): an fp16 (or bf16) tensor-core GEMM (mma.sync m16n8k16,
// f32 accumulation, cp.async multi-stage pipeline) that dequantises MLX 4/8-bit weights inside its
// mainloop, and the MoE block for T tokens built on it with routing on the device (gemm.cu,
// moe_prefill.cu). Every launcher is asynchronous on the given stream, except the host-routing
// ablation (P2 off), which synchronises by design.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_ops.h"

namespace lily::cuda {

// ---- gemm.cu -----------------------------------------------------------------------------
// Activations enter the GEMM as fp16/bf16 in the "mma k-order": inside every 64-column group, column
// L of the staged row holds input column gemm_kperm(L). The order matches how a thread's packed
// 4-bit (or 8-bit) codes map onto its mma B fragment, so codes are dequantised straight from the
// shared-memory copy of the MLX layout into fragments; A is permuted instead of the weights.
__host__ __device__ constexpr int gemm_kperm(int L) {
  return 16 * ((L >> 1) & 3) + 8 * (L >> 5) + 2 * ((L >> 4) & 1) + ((L >> 3) & 1) + 4 * (L & 1);
}
__host__ __device__ constexpr int gemm_kperm_inv(int P) {
  return 16 * (2 * ((P >> 3) & 1) + ((P >> 1) & 1)) + 8 * (P & 1) + 2 * (P >> 4) + ((P >> 2) & 1);
}

// Operand precision: fp16 with power-of-two scales (default) or bf16 when LILY_GEMM_BF16 is set
// to anything but 0 (read on every call, so a test may switch it). 8-bit matrices always run in bf16
// split precision. The CPU backend emulates either (LILY_CPU_EMULATE, gemm_emulate.h).
bool gemm_f16();
constexpr int kGemmF16WExp = 8;   // fp16: weights enter as (s·2^8)·q + b·2^8

// P1w: dense 4-bit matrices with fp16 operands run on the Hopper wgmma kernel (gemm_wgmma.cuh:
// producer warpgroup dequantising each stage once, consumer warpgroups on wgmma.mma_async; +13 % on
// the 8192x2048 projections at T = 4096); everything else, and P1w off, on the mma.sync kernel. The
// MoE's grouped GEMMs stay on mma.sync: on wgmma the MoE block at T = 4096 took 2.45 ms vs 1.68 ms
// (LILY_GEMM_WGMMA_GRP=1 puts them on wgmma, for tests). Opt-in: end to end, prefill at 4K was 4 %
// slower with it (24.9K vs 26.0K tok/s) although each dense GEMM alone is faster. gemm_set_wgmma is
// the process-wide switch, set by the backend from LILY_GEMM_WGMMA=1 unless P1w is ablated.
void gemm_set_wgmma(bool on);
bool gemm_wgmma();

// True when the GEMM handles W: 4/8-bit affine with group 64 and bf16 scales, cols % 512 == 0.
bool gemm_ok(const QMat& w);
// Matrices with fewer rows than gemm_small_n(T) go to the f32 GEMV kernels even in prefill. The
// GEMV reads the matrix once per token (in_proj_a/b, 32 x 2048: 0.283 ms at T = 4096), the GEMM walks
// all of K once per 128-token tile for a half-empty 64-row tile (0.049 ms at T = 4096) but has a
// fixed cost that loses at small T. So: rows >= LILY_GEMM_SMALL_N (default 64) always, and with P7
// on, rows >= LILY_GEMM_SKINNY_N (default 32: in_proj_a/b) from T >= LILY_GEMM_SKINNY_T (default
// 256). shared_expert_gate (1 row) always stays on the GEMV. gemm_set_skinny is the P7 switch.
void gemm_set_skinny(bool on);
// P10: the mma.sync kernel computes 128 x 256 (BM = 128) or 64 x 256 tiles instead of BM x 128 for
// 4-bit and 16-bit B: 64x64 warp tiles (BM = 128) or one warp row (BM = 64, 32), i.e. more MMAs per
// shared-memory read and per barrier, and each 4-bit weight unpacked by fewer warps. Dense GEMMs
// take it from T >= LILY_GEMM_BN_MIN_T (512) when the wider grid still fills the GPU with BM >= 64,
// the MoE's grouped GEMMs always. LILY_GEMM_BN=128|256 (read per call) forces the width (not on
// the wgmma kernel or for 8-bit B, which stay 128); LILY_GEMM_RASTER=R walks dense 256-wide grids in
// bands of R M tiles. gemm_set_wide is the P10 switch (on by default).
// P10 at 512 (session 6): the MoE's grouped GEMMs with fp16 operands and M-tiles of 64 / 32 run
// 512-wide CTAs (1x8 warps of 64x64 / 32x64, one CTA per SM); LILY_MOE_BN=128|256|512 picks their
// width (default 512, M-tile 128 and bf16: 256), LILY_GEMM_BN=512 forces it (dense GEMMs: 256).
void gemm_set_wide(bool on);
bool gemm_wide();
// P13: dense GEMMs on the 16-bit weight copy (P8, P1 off) with fp16 operands run on a Hopper wgmma
// kernel (gemm_wg16.cuh: persistent, producer warpgroup + 2 consumer warpgroups on m64n256k16,
// 128 x 256 tiles) instead of the mma.sync kernel, when the grid has at least
// LILY_GEMM_WG16_MIN_TILES (default 3/4 of the SMs) such tiles. LILY_GEMM_WG16=0/1 (read per call)
// forces it off/on for any shape (2: on, TMA form); a forced LILY_GEMM_BN keeps mma.sync. The TMA
// form (one thread loads a stage with two tensor copies instead of 128 threads with cp.async) is
// opt-in: LILY_GEMM_WG16_TMA=1. gemm_set_wg16 is the P13 switch (on by default).
void gemm_set_wg16(bool on);
// P52: the P13 kernel (and P30's stacked GEMM, which needs it) from this many output tiles; 0 = 3/4 of the SMs.
void gemm_set_wg16_min_tiles(int n);
bool gemm_wg16();
// P14 / P15: the MoE's grouped GEMMs with fp16 operands on Hopper wgmma kernels (gemm_moe_wg.cuh),
// LILY_MOE_WG (read per call; unset: 2, or 0 when gemm_set_moe_p15(false), the P15 ablation;
// 0 = gemm_kernel on mma.sync for both GEMMs):
//   1 = P14: producer warpgroup dequantising 256 weight rows per tile into the swizzled fp16 stage,
//       2 consumer warpgroups on m64nBMk16 with both operands from shared memory (BM = 64 / 128);
//       0.71x mma.sync on the T = 4,096 block (session 7);
//   2 = P15 for the gate/up GEMM, the down GEMM on gemm_kernel; 3 = P15 for both. P15: the producer
//       only copies; the consumers dequantise their rows straight into wgmma's A registers (BM = 64;
//       tile lists of 128 run gemm_kernel).
// Takes precedence over LILY_GEMM_WGMMA_GRP.
int gemm_moe_wg();
void gemm_set_moe_p15(bool on);
// P17: the P15 kernel also runs M-tile 128 (off: gemm_kernel runs those tiles).
void gemm_set_moe_p17(bool on);
bool gemm_moe_p17();
// P18: the P17 kernel with 4 consumer warpgroups, 256 weight rows per CTA (half the activation reads).
void gemm_set_moe_p18(bool on);
bool gemm_moe_p18();
// P32: the P18 kernel's step loop in fewer instructions (running counters and pointers, one-LOP3 unpacking).
void gemm_set_moe_p32(bool on);
bool gemm_moe_p32();
// P34 (with P32): two 64-k steps per ring stage, the per-stage waits and bookkeeping once per two steps.
void gemm_set_moe_p34(bool on);
void gemm_set_moe_p38(bool on);   // P38: the P34 MoE kernel's wgmma N by the tile's rows (same bits)
// P75 (opt-in): the GDN gated norm + conversion (P28, fp16 z) at 5 CTAs per SM, bf16 halves skipped. Returns the
// old setting.
bool gemm_set_p75(bool on);
// P81 (default on): the P13 kernel's fp16 output segments (P62) stored as whole 128-byte rows via shared memory (same
// values). Returns the old setting.
bool gemm_set_p81(bool on);
void gemm_set_p70(bool on);   // P70: the fused prefill norm + conversion's 8-bit dot and bf16 halves, cheaper (same bits)
void gemm_set_moe_p39(bool on);   // P39: the MoE down GEMM (mma.sync) skips m16 tiles past the tile's rows (same bits)
void gemm_set_moe_p43(bool on);   // P43: the MoE down GEMM's CTAs in N-tile-fastest order
void gemm_set_moe_p46(bool on);   // P46: the MoE down GEMM's unpacking mask and exponent OR in one LOP3 (same bits)
void gemm_set_moe_p47(bool on);   // P47: the MoE down GEMM's odd nibble pairs unpacked in place (same bits)
void gemm_set_moe_p48(bool on);   // P48: the MoE down GEMM's main loop without P39's checks for full warps (same bits)
void gemm_set_moe_p50(bool on);   // P50: the P34 gate/up kernel's odd nibble pairs unpacked in place (same bits)
// P35: the MoE down GEMM's scatter destinations and routing weights staged in shared memory before its mainloop.
void gemm_set_moe_p35(bool on);
bool gemm_moe_p34();
bool gemm_moe_p50();
// P53 (default on): below LILY_P53_ROWS (default 16) expected rows per expert the prefill MoE's gate/up GEMM keeps
// M-tile 32 (P40 would take 128) and runs the P34 kernel at M-tile 32: an 8-stage ring whose codes lead by 12 steps
// instead of 4 (gemm_moe_wg.cuh, Rs4Cfg). Same products in the same order as P38's wgmma N 32: the same bits.
// Session 24 call 7: +14.4 % at 128 tokens, +2.9 % at 256, +0.4 % at 384.
void gemm_set_moe_p53(bool on);
bool gemm_moe_p53();
// P55 (default on since session 25): the prefill MoE's down GEMM at M-tile 128 (from LILY_P55_ROWS, default 16,
// expected rows per expert) on a register-A wgmma kernel whose tile activations (128 x 512 fp16) stay in shared memory
// while the CTA streams nb (4; 8 with P55n8) blocks of 256 weight rows; fp16 slot rows as P16. With P16 off the same
// bits as the P15 "both" form at M-tile 128 (LILY_MOE_WG=3). Session 25: +7.0 % prefill at 4K, +3.0 % at 512.
void gemm_set_moe_p55(bool on, int nb);
void gemm_set_moe_p78(bool on);   // P78 (default on): P55's fp16 slot rows stored 16 bytes per lane via shared memory
bool gemm_moe_p55();
int gemm_small_n(int T);
// gemm_ok(w) and w.rows >= gemm_small_n(T): the prefill matmul path for W at T tokens.
bool gemm_takes(const QMat& w, int T);

// The GEMM's view of one input x [T, K], all in the mma k-order (device buffers of T·K halves,
// rs of T floats):
//   a:  operand of 4-bit matrices: fp16 of x·2^s per row (f16) with rs[row] = 2^-s, or bf16 of x;
//   hi, lo: bf16 split x = hi + lo for 8-bit matrices (bf16 mode: hi is `a`, leave hi null).
struct GemmA {
  const uint16_t* a = nullptr;
  const float* rs = nullptr;
  const uint16_t* hi = nullptr;
  const uint16_t* lo = nullptr;
  bool f16 = true;
};
// Fills the non-null buffers of `o` from x f32 [T, K] (K % 64 == 0).
// dot_y (optional, P19): also dot_y[t] = x[t] · dot_w row 0 in f32 (dot_w: one row of K).
void gemm_convert_a(const float* x, int T, int K, const GemmA& o, cudaStream_t s, const QMat* dot_w = nullptr,
                    float* dot_y = nullptr);
// P25: h += r (r optional), out = rmsnorm(h) · w (out optional) and gemm_convert_a(out) in one kernel
// per row, bit-identical to rmsnorm followed by gemm_convert_a; n % 128 == 0, 1024 <= n <= 4096 (_ok).
bool gemm_rmsnorm_convert_ok(int n);
// P59: `slots` (optional, r null) gives the residual as the prefill MoE's combine of its slot rows
// (moe_prefill_slots; the same sums in the same order as its combine stage), which then need not run.
struct MoeSlots {
  const void* p = nullptr;   // [T·K routed rows, then T shared rows] × n, fp16 (f16) or f32
  bool f16 = false;
  int T = 0, K = 0;
};
void gemm_rmsnorm_convert(float* h, const float* r, const float* w, int n, int T, float eps, float* out,
                          const GemmA& o, cudaStream_t s, const QMat* dot_w = nullptr, float* dot_y = nullptr,
                          const MoeSlots* slots = nullptr);
// P25 test entry (synchronous): the fused kernel against rmsnorm + gemm_convert_a on the same random
// inputs; returns the number of differing bytes over h, out, rs, the dot, xa, xh, xl (0 = identical).
// slots (P59): 1 / 2 = the residual from fp16 / f32 MoE slot rows (fused) against the combine stage + the two.
// dot (P19): 0 none, 1 an f32 row, 2 an 8-bit row (group 64, bf16 scales: P70's path in the fused kernel).
int64_t gemm_rmsnorm_convert_probe(int n, int T, bool add, bool f16, bool split, int dot, unsigned seed,
                                   int slots = 0);
// P28: the GDN output's gated RMSNorm (gdn_prefill_norm on the raw y [T, nv·128], z, w) and
// gemm_convert_a of its result in one kernel per row, bit-identical to the two; y is only read, out
// (optional) receives the f32 normalised rows. dv == 128, nv <= 8 or a multiple of 8 up to 32 (_ok).
bool gemm_gdn_norm_convert_ok(int nv, int dv);
// z16 (P62): z's buffer holds fp16 values.
void gemm_gdn_norm_convert(const float* y, const float* z, const float* w, int nv, int dv, int T, float eps,
                           float* out, const GemmA& o, cudaStream_t s, bool z16 = false);
// P28 test entry (synchronous): the fused kernel against gdn_prefill_norm + gemm_convert_a on the same
// random inputs; returns the number of differing bytes over the f32 rows, rs, xa, xh, xl, plus any
// byte of the fused kernel's input y that it changed.
int64_t gemm_gdn_norm_convert_probe(int nv, int T, bool f16, bool split, unsigned seed, bool z16 = false);
// Ablation P1 off (4-bit only): W dequantised once into bf16/fp16 [rows, cols] in the mma k-order.
int64_t gemm_dequant_bytes(const QMat& w);
void gemm_dequant(const QMat& w, bool f16, uint16_t* wb, cudaStream_t s);

// P30: several 4-bit matrices that read the same x, as one GEMM over their 16-bit copies stacked by
// rows (wb: rows[0] + rows[1] + ... rows of K, the P21 copies made into one buffer), matrix q's
// product written to ys[q] (row stride rows[q]). fp16 activations, the P13 kernel only (_ok).
constexpr int kGemmMaxSegs = 4;
bool gemm_segmented_ok(int T, int N, int K, bool f16);
// h16 (P62): bit q set = product q written as saturated fp16 [T, rows[q]] into ys[q]'s buffer instead of f32.
void gemm_segmented(const GemmA& x, int T, int K, const uint16_t* wb, int nseg, const int* rows, float* const* ys,
                    cudaStream_t s, int h16 = 0);
// P30 test entry (synchronous): random fp16 x and stacked weights through gemm_segmented with the
// given segments and with one segment of all rows; returns the number of token rows whose segment
// output differs in any byte from the slice of the one-output product (0 = identical).
int64_t gemm_segmented_probe(int T, int K, int nseg, const int* rows, unsigned seed, int h16 = 0);
// y[T, w.rows] (row stride ldy) = x · Wᵀ, or += when `accumulate`. wb: the P1-off copy of a 4-bit W
// (same precision as x; nullptr: fused dequantisation). bm: M-tile 32/64/128, 0 = chosen from T
// and the grid size (LILY_GEMM_BM overrides). ksplit > 1 (P37; store mode, 8-bit weights, K a multiple of
// 512·ksplit): K in ksplit slices, slice z's partial product at y + z·T·ldy; the caller sums them.
void gemm(const QMat& w, const GemmA& x, int T, float* y, int64_t ldy, bool accumulate, const uint16_t* wb, int bm,
          cudaStream_t s, int ksplit = 1);
// P68: the fp16 copy (x 2^8, mma k-order; gemm_dequant_bytes) of an 8-bit matrix, each weight rounded once from f32.
void gemm_dequant8(const QMat& w, uint16_t* wb, cudaStream_t s);
// P68: y[T, N] = x · Wᵀ from the fp16 operand (x.a, x.rs) and a 16-bit copy wb [N, K] on the P13 kernel (TMA form)
// with K in ksplit slices of whole 64-column steps: slice z's partial product at y + z·T·N (the caller sums them).
void gemm_f16_ksplit(const GemmA& x, int T, const uint16_t* wb, int N, int K, float* y, int ksplit, cudaStream_t s);
// P68 check: the router-shaped 8-bit GEMM through gemm_dequant8 + gemm_f16_ksplit (slices summed on the host)
// against the split-precision GEMM on the same x: the largest |difference| over the largest |y| (1e30 if any
// output is not finite, e.g. a slice left unwritten).
double gemm_router16_probe(int T, int N, int K, int ksplit, unsigned seed);
// P37 check: an 8-bit (router-shaped, N × K) GEMM of T rows in split precision with K cut into ksplit slices
// (partials summed on the host) against the same GEMM unsplit: the largest |difference| over the largest |y|.
double gemm_splitk_probe(int T, int N, int K, int ksplit, int bm, unsigned seed);
// Test aid (P13): y[T, N] (row stride ldy) = rs[row]·2^-8 · a·bᵀ (or += when `accumulate`) on raw
// fp16 device buffers a [T, K], b [N, K] (row-major, K % 64 == 0; any common column order), with
// kernel 0 = the mma.sync kernel (BM 128, BN 256: what P8 runs without P13), 1 = gemm_wg16_kernel,
// 2 = its TMA form.
// Synchronous (waits for the device before and after, own stream). Plain C++ signature: the test
// tool declares it itself (this header is not includable from host-only C++).
void gemm_f16_raw(int kernel, const uint16_t* a, const float* rs, int T, int K, const uint16_t* b, int N, float* y,
                  int64_t ldy, bool accumulate);

// Test aid (P14/P15): one grouped GEMM on raw device buffers, kernel 0 = the mma.sync kernel (as the
// engine runs it with LILY_MOE_WG=0, width from moe_bn), 1 = gemm_moe_wg_kernel, 2 = gemm_moe_rs_kernel
// (bm 32 / 64; the raw entry runs it for either GEMM). swiglu: act/act_exp
// (row stride N halves, N/64 exponents) = SwiGLU of the gate (codes/scales/biases) and up
// (codes2/...) matrices, N rows each, on the fp16 rows a[a_rows[p]] with row scales rs; else y[dst[p], 0:N) (row
// stride N) = scale[p] · (a_p · Wᵀ) with a's per-(row, group) exponents aexp [rows, K/64]. Weights:
// E experts stacked, each [N, K] MLX 4-bit with bf16 scales/biases. tiles: n_tiles int4 entries
// {expert, first row, rows, 0} (rows <= bm). Synchronous, own stream; plain C++ signature (the test
// tool declares it itself).
void gemm_moe_raw(int kernel, int bm, bool swiglu, const uint16_t* a, const float* rs, const int8_t* aexp,
                  const int* a_rows, int K, int N, int E, const void* codes, const void* scales, const void* biases,
                  const void* codes2, const void* scales2, const void* biases2, const int* tiles, int n_tiles,
                  const int* dst, const float* scale, float* y, uint16_t* act, int8_t* act_exp);

// ---- grouped GEMM (used by moe_prefill.cu) -------------------------------------------------
// Rows are processed in M-tiles listed by a device tile map {group, first row, rows, 0}; the grid
// is launched for the worst-case tile count and CTAs past *n_tiles exit. Group g < n_groups takes
// B from the stacked matrices (base + g·stride); group n_groups from the `extra` matrices (the
// shared expert).
struct GroupedB {
  QMat w[2];                    // group 0 of each matrix (SwiGLU: gate, up; else w[0] only)
  QMat extra[2];                // group n_groups
  int64_t stride = 0, sb_stride = 0;   // bytes between groups in data / scales+biases
  int n_groups = 0;
};
// act[r, 0:I) (mma k-order, row stride ld_act) = silu(x_r·Gᵀ)·(x_r·Uᵀ), x_r = row a_rows[r] of x.a
// (x.rs for fp16). fp16: act holds v·2^e with one exponent e per (row, 64-column group) in
// act_exp[r·(ld_act/64) + group]; bf16: act holds bf16(v), act_exp unused.
void gemm_grouped_swiglu(const GroupedB& b, const GemmA& x, const int* a_rows, const int4* tiles, const int* n_tiles,
                         int max_tiles, int bm, uint16_t* act, int8_t* act_exp, int ld_act, cudaStream_t s);
// y[dst[r], :] = scale[r] · (act_r · Dᵀ), act_r = row r of act as the SwiGLU GEMM wrote it. With y16
// (P16) y is written as fp16 (saturated at ±65504, ldy in halves) where the kernel taken supports it
// (the mma.sync kernel); returns whether it did (else y holds f32).
bool gemm_grouped_scatter(const GroupedB& b, const uint16_t* act, const int8_t* act_exp, bool f16, const int4* tiles,
                          const int* n_tiles, int max_tiles, int bm, const int* dst, const float* scale, float* y,
                          int64_t ldy, cudaStream_t s, bool y16 = false);

// ---- moe_prefill.cu ------------------------------------------------------------------------
struct MoePrefillOpts {
  int bm = 0;                   // expert M-tile 32/64/128; 0 = moe_prefill_tile()
  bool host_routing = false;    // ablation P2 off: groups built on the host (synchronises)
  int stages = 31;              // bits: 1 router, 2 routing, 4 gate/up, 8 down, 16 combine; the router
                                // stage's parts alone (profiling): 32 operand conversion, 64 router GEMM,
                                // 128 shared-expert gate; the routing's: 256 top-k, 512 plan + scatter
  bool slot16 = true;           // P16: the down GEMM's (token, slot) rows in fp16 (off: f32)
  bool sg_in_convert = true;    // P19: the shared-expert gate's dot in the operand conversion (off: own GEMV)
  bool skip_x = false;          // P42 (with P19, P25): the f32 x, which no MoE kernel then reads, is not written
  bool router_split = false;    // P37: the router GEMM with K in slices (router_split())
  bool rank_in_topk = false;    // P71: the scatter's arrival order from the top-k kernel's count atomics
  bool topk_batch = false;      // P72 (the backend's default: on): the top-k kernel's slice loads issued at once
  bool tiles_full_first = false;   // P56: from 16 to below 96 expected rows per expert (LILY_P56_MIN_ROWS,
                                   // LILY_P56_ROWS) the tile lists' full tiles first, the partial ones largest first
  // P25: x is produced by this rmsnorm (not launched yet): the router stage's conversion runs it too
  // (gemm_rmsnorm_convert; h += r first when r is set). Unset: x is ready.
  struct PreNorm {
    float* h = nullptr;
    const float* r = nullptr;
    const float* w = nullptr;
    float eps = 0.f;
  } pre_norm;
};
// P37: the router GEMM's K slices (k) and M-tile (bm; 0 = gemm's choice) for T tokens; k = 1: unsplit.
constexpr int kRouterMaxSplit = 8;
struct RouterSplit {
  int k = 1, bm = 0;
};
RouterSplit router_split(const MoeDev& m, int T, bool on);
// P68: the K slices of the router GEMM on its fp16 copy for T tokens (LILY_ROUTER16_SPLIT overrides, read per call).
int router16_split(const MoeDev& m, int T);
// True when moe_prefill handles these weights (4-bit experts, H and I multiples of 512, I == Is).
bool moe_prefill_ok(const MoeDev& m);
// P3: the expert M-tile for T tokens (expected rows per expert T·K/E); LILY_MOE_TILE overrides.
int moe_prefill_tile(const MoeDev& m, int T);
// P3 off (--ablate P3): M-tile 64 for both expert GEMMs whatever the rows per expert.
void moe_prefill_set_p3(bool on);
// P17: the gate/up GEMM can run M-tile 128 on the P15 kernel (fp16 operands, P15 and P17 on).
bool moe_prefill_p17(const MoeDev& m, bool f16);
// P40: P17's gate/up at M-tile 128 from 16 expected rows per expert (T >= 512 on this model) instead of 128: with
// P38 a short tile runs a narrower wgmma, so the 128 kernel serves short prompts too (+7 to +13 % at 512 / 1K / 2K).
void moe_prefill_set_p40(bool on);
int64_t moe_prefill_workspace_bytes(const MoeDev& m, int T);
// out [T, H] = MoE(x) (MODEL.md §2.4). `work` of moe_prefill_workspace_bytes.
void moe_prefill(const MoeDev& m, const float* x, int T, float* out, void* work, const MoePrefillOpts& o,
                 cudaStream_t s);
// Whether the last moe_prefill call's slot rows were fp16 (P16 taken; tests).
bool moe_prefill_last_slot16();
// P59: the slot rows of the last moe_prefill call that used `work` (its down stage has run; the combine stage,
// bit 16, may be left out and done by gemm_rmsnorm_convert). Valid until `work` is reused.
MoeSlots moe_prefill_slots(const MoeDev& m, int T, const void* work);
// The combine stage alone on given slot rows: out [T, H] (tests).
void moe_prefill_combine(const MoeSlots& sl, int H, float* out, cudaStream_t s);
// Device pointer to the [T, K] expert ids of the last call that used `work` (tests).
const int32_t* moe_prefill_ids(const MoeDev& m, int T, const void* work);

}  // namespace lily::cuda
