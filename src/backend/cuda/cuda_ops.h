// Host-side launchers of the CUDA kernels (one .cu per op family). All take the stream they
// enqueue on and never synchronise, so a whole decode step can be captured into a CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/cuda_common.cuh"

namespace lily::cuda {

// ---- gemv.cu -------------------------------------------------------------------------------
constexpr int kMaxGemvJobs = 8;
struct GemvJob {
  QMat w;
  const float* x = nullptr;   // [T, w.cols]
  float* y = nullptr;         // [T, w.rows]
  float* res = nullptr;       // D9: also res += y (residual add folded into the epilogue); rows == H
  bool y16 = false;           // P62 (prefill): fp16 output wanted (written so only by P30's stacked GEMM; see f16_out_)
};
// D9, decode: the RMSNorm that produces the jobs' common x, folded into their staging. Every CTA
// stages g ⊙ h and Σh² itself and scales its dot products by rsqrt(mean h² + eps) (the norm is a
// scalar per token, so it commutes with W); one CTA also writes x = rmsnorm(h) for later readers.
struct GemvNorm {
  const float* h = nullptr;   // [1, cols] raw residual
  const float* w = nullptr;   // [cols] gain
  float eps = 0.f;
};
// Runs every job (y = x · Wᵀ for T tokens) in as few launches as possible. `fast` false forces
// the generic kernel (ablation D1). With `norm`, every job's x is rmsnorm(norm->h) and is written
// by the launch (all jobs must share x and satisfy gemv_norm_ok).
// `pf` (D13): weights of the next launch to prefetch into L2 while this batch runs.
void gemv_batch(const GemvJob* jobs, int n, int T, bool fast, cudaStream_t s, const GemvNorm* norm = nullptr,
                const L2Prefetch* pf = nullptr);
// D39 (decode): router logits before the MoE launch. With h_new = h + W_o·a (the out-projection's folded
// residual add) and the MoE's x = s·(w2 ⊙ h_new), the router logits are s·(Q_h·h + Q_a·a) with the per-layer
// products Q_h = W_r·diag(w2) and Q_a = W_r·diag(w2)·W_o (fp32, built once: build_router_fold; row E from the
// shared-expert gate). The in-projection launch (whose CTAs all load h for its folded norm) computes Q_h·h, the
// out-projection launch adds Q_a·a, one row per CTA; the MoE kernel multiplies by s and starts its top-k at once
// instead of after its router rows and a grid handoff. Set through gemv_router_next() for the next gemv_batch
// (row b · x, x as loaded: the raw h when a norm is folded, plus add[b]); `used` says whether it ran.
struct GemvRouterRows {
  const float* q = nullptr;     // row b at q + b · qstride + qoff, cols floats
  const int16_t* qi = nullptr;  // D76: the same rows as int16 codes (used instead of q when set), same indexing,
  const float* qscale = nullptr;   // times qscale[(b · qstride + qoff + c) / 64] for column c (64-value groups)
  int64_t qstride = 0, qoff = 0;
  int cols = 0;
  const float* add = nullptr;   // [n] added (the in-projection's Q_h·h), or null
  float* out = nullptr;         // [n]
  int n = 0;
  bool used = false;
  bool early_add = false;       // D53: add[b] read by thread 0 right after the PDL wait (with x), not after the barrier
};
GemvRouterRows& gemv_router_next();
// Q for one layer: rows e < E from the 8-bit router, row E from the shared-expert gate, each times w2
// (the post-mixer norm gain), then times W_o (4-bit, H × C) for the a part. q: (E + 1) × (H + C) floats.
void build_router_fold(const QMat& router, const QMat& shared_gate, const float* w2, const QMat& wo, float* q,
                       cudaStream_t s);
// D14: the 4-/8-bit decode GEMV batch fits in one wave of CTAs (process-wide switch, ablation D14).
bool& gemv_one_wave_enabled();
// D76: D39's folded router rows as int16 codes with an fp32 scale per 64 values (n floats of q, n % 64 == 0).
void router_fold_to_i16(const float* q, int16_t* qi, float* qscale, int64_t n, cudaStream_t s);
// True when the specialised 4-bit decode kernel handles this matrix.
bool gemv_fast_ok(const QMat& w);
// True when gemv_batch runs this matrix on a kernel that can fold a GemvNorm (T == 1 only).
bool gemv_norm_ok(const QMat& w, int T, bool fast);

void embed(const QMat& E, const int32_t* tokens, int T, float* out, cudaStream_t s);
// If r != nullptr: h += r first (written back), then out = rmsnorm(h) * w.
void rmsnorm(float* h, const float* r, const float* w, int n, int T, float eps, float* out,
             cudaStream_t s);
void add(float* h, const float* r, int64_t n, cudaStream_t s);
// Test aid (P62): n floats rounded to saturated fp16 (as the projection GEMM's fp16 segments), into out16, or back
// into p as floats when out16 is null.
void f16_convert(float* p, int64_t n, __half* out16, cudaStream_t s);

// ---- sample.cu -----------------------------------------------------------------------------
// ids[t] = argmax(logits[t, 0:n)), lowest index on ties. `scratch` from argmax_scratch_bytes.
int64_t argmax_scratch_bytes(int T);
void argmax(const float* logits, int T, int n, int32_t* ids, void* scratch, cudaStream_t s);
void increment(int32_t* p, int by, cudaStream_t s);
// Keeps the stream busy for `ns` nanoseconds, so that the host can enqueue a whole eager step
// behind it and per-op events then measure device time rather than launch gaps.
void spin(uint64_t ns, cudaStream_t s);
// Fills n floats with uniform values in [-scale, scale) from a counter-based hash (bench only).
void fill_uniform(float* p, int64_t n, float scale, uint64_t seed, cudaStream_t s);

// ---- sampling.cu ---------------------------------------------------------------------------
// The sample op (backend.h Backend::sample): three kernels, no host synchronisation. `ws` from
// sample_workspace_bytes(n), zeroed once at allocation (the kernels leave it ready for the next call).
int64_t sample_workspace_bytes(int n);
void sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id, void* ws, cudaStream_t s);
// How the last pick was made: 0 greedy, 1 index-order draw, 2 sorted candidates, 3 radix fallback
// (synchronous; tests only).
int sample_last_path(const void* ws);

// ---- gdn.cu --------------------------------------------------------------------------------
struct GdnDims {
  int nk, nv, dk, dv, conv_dim, kconv;
  float eps;
};
// Prefill (gdn_prefill.cu): the gated RMSNorm of the raw GDN outputs in place: per token and value
// head, y = y · rsqrt(mean y² + eps) · norm_w · silu(z) (one 128-thread block per head; dv == 128).
// z16 (P62): z's buffer holds fp16 values [T, nv·128].
void gdn_prefill_norm(const GdnDims& d, const float* norm_w, const float* z, int T, float* y, cudaStream_t s,
                      bool z16 = false);
// D12: decode (T == 1) over dv/32 CTAs per value head (process-wide switch, ablation D12).
bool& gdn_split_enabled();
// D42: the D12 kernel pushes its partial Σo² to the head's CTAs before its cluster barrier and needs no
// second one (process-wide switch, ablation D42).
bool& gdn_push_enabled();
// D45: the D12 kernel writes its updated state back after the cluster barrier (whose release would
// otherwise wait for those stores) instead of before it (process-wide switch, ablation D45).
bool& gdn_s_late_enabled();
// D55: the D12 kernel loads its state and conv state rows into registers before its PDL wait (ablation D55).
bool& gdn_early_state_enabled();
bool& moe_lean_act_enabled();   // D63: the persistent MoE's down activations staged in fewer instructions (same bits)
bool& gdn_mbar_enabled();   // D60: D12's Σo² exchange on an mbarrier (st.async) instead of a cluster barrier
void gdn(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
         const float* norm_w, float* conv_state, float* S, const float* qkv, const float* z,
         const float* a, const float* b, int T, float* y, cudaStream_t s, const L2Prefetch* pf = nullptr);

// ---- attention.cu --------------------------------------------------------------------------
struct AttnDims {
  int heads, kv_heads, head_dim, rot_dim;
  float theta, eps;
  int capacity;
  int min_chunk = 64;   // decode split-KV: positions per slice at least this (D41; off: 32)
};
// D11: decode merge with warps across splits (process-wide switch, ablation D11).
bool& merge_warps_enabled();
// P66: the attention prep of T > 1 tokens (prefill) with a warp per head row, a CTA per token (ablation P66).
bool& attn_prep_rows_enabled();
// D21: decode kernels stage x / activations from registers (every load in flight at once).
bool& stage_regs_enabled();
// D24: the 4-bit decode GEMV and the D19 kernel's 4-bit rows against x (and the down activations)
// quantised to int16 per 32 values, dp2a (off: float x, 3 instructions per weight).
bool& gemv_x16_enabled();
int& gemv_fused_stage_mode();   // D89 (1) / D90 (2; the default): the decode GEMVs' x staging with its chains interleaved
// D26: the lm_head (>= 32,768 rows) runs on the int16 GEMV of D24 instead of the mma.sync GEMV (D1m)
// when D24 and D21 are on (process-wide switch, ablation D26).
bool& lmhead_i16_enabled();
// D27: the decode MoE top-k (router + top-k kernel, D19's per-CTA top-k) on one warp with each lane's
// 8 logits sorted in registers (off: two rounds of warp selection over 4 warps).
bool& topk_lanes_enabled();
// D31: the persistent MoE kernel (D19) in its default configuration runs as its own template instance
// with every other path compiled out (code size; off: the generic instance).
bool& moe_persist_special_enabled();
// D36: in the D31 instance each CTA's warps load their first routed rows once that slot is picked (warp 0 goes on
// picking; named barriers) instead of after the whole top-k.
bool& moe_early_pick_enabled();
// D50: in D39's MoE instance warp 0 picks the experts from logits loaded into its registers while warps 1..7
// stage x (process-wide switch, ablation D50).
bool& moe_w0_pick_enabled();
bool& moe_regs88_enabled();   // D88: the D50 MoE instance at 88 registers (same bits)
bool& moe_stage_il_enabled();   // D91 (with D88): that instance's x staging as D89 + D90
// D28: at T == 1 on the D20 path, the attention prep (q/k norms, RoPE, KV append) runs inside the
// split-KV kernel (off: the separate prep kernel).
bool& attn_prep_fused_enabled();
// Test aid: runs select_topk_block (lanes = false) or select_topk_lanes on rows of E logits (host in/out).
void topk_select_test(const float* host_logits, int rows, int E, int K, bool lanes, int* host_ids);
// Tuning aid (env LILY_PDL_LATE, a bit mask; 0 = every kernel triggers its dependents at entry): a decode
// kernel triggers its PDL dependents only once its own critical loads have arrived, so that the next
// kernel's pre-wait loads do not queue ahead of them. Bits: kLateGdn (GDN step, after the state update),
// kLateSplit (split-KV, after its KV loop), kLateGemvRes (GEMVs with a residual add, after x staging),
// kLateGemvNorm (GEMVs with a folded norm, after x staging).
enum : int { kLateGdn = 1, kLateSplit = 2, kLateGemvRes = 4, kLateGemvNorm = 8 };
int& pdl_late_mask();
// Investigation aid: the trace slot for the next 4-bit decode GEMV launch (consumed by it).
unsigned long long*& gemv_trace_next();
// Investigation aid: the trace slot for the next GDN decode launch (consumed by it; its phases are
// named in kernel_trace_summary).
unsigned long long*& gdn_trace_next();
// Investigation aid: trace slots for the next decode attention's split-KV (D20) and merge launches.
std::array<unsigned long long*, 2>& attn_trace_next();
// With an fp16 cache, the split-KV kernel keeps 4 positions per warp in flight (raw fp16, converted
// where used) instead of 2 (process-wide switch, env LILY_ATTN_KV16_U4=1; off by default).
bool& kv16_u4_enabled();
// D20: with an fp16 cache, head_dim 256 and 8 query heads per KV head, the decode split-KV pass runs
// on tensor cores (attn_split_mma_kernel; process-wide switch, ablation D20).
bool& attn_mma_decode_enabled();
// D43: the D20 kernel's CTAs prefetch their K / V rows into L2 before the PDL wait (ablation D43).
bool& attn_kv_prefetch_enabled();
bool& attn_combine_v4_enabled();   // D66: the D20 kernel's cross-warp combine with 4 dims per thread (same bits)
bool& attn_kv_prefetch_bulk_enabled();   // D73: D43's prefetch as two bulk copies per CTA (every KV head's rows)
bool& attn_q_first_enabled();      // D67: the D20 kernel's q / k / v loads issued first after its PDL wait
bool& attn_merge_early_gate_enabled();   // D56: the merge's output gate loaded with the partials
bool& attn_merge_early_parts_enabled();   // D68: the merge's partials loaded before its slice count is known
// D20's load schedule (attn_split_mma_kernel's PM): 2 by default, 0 with ablation D25.
int& attn_mma_pipe_mode();
// Workspace floats needed for T tokens (prepared queries + split-KV partials).
int64_t attention_workspace_floats(const AttnDims& d, int T);
// `splits`: KV blocks per (token, kv head) for decode (D7); `pack_gqa`: one KV pass per KV head (D6).
// kc, vc: the cache, fp16 when kv16 (D18) else f32.
void attention(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
               int pos0, const int32_t* pos_dev, const float* q, const float* k, const float* v,
               int T, float* o, float* work, int splits, bool pack_gqa, cudaStream_t s,
               const L2Prefetch* pf = nullptr);
// n cache elements between f32 and fp16 buffers (either direction; a copy when the types match).
void kv_convert(void* dst, bool dst16, const void* src, bool src16, int64_t n, cudaStream_t s);

// ---- moe.cu --------------------------------------------------------------------------------
struct MoeDev {
  int E, K, H, I, Is;
  QMat router, shared_gate;           // [E, H], [1, H]
  QMat gate0, up0, down0;             // expert 0 of each stack
  int64_t gate_stride, gate_sb_stride, up_stride, up_sb_stride, down_stride, down_sb_stride;
  QMat sh_gate, sh_up, sh_down;
  int* hist = nullptr;                // optional [E] counts of routed tokens per expert
  const uint16_t* router16 = nullptr;   // P68 (prefill): the router's fp16 copy (gemm_dequant8), or null
};
// Decode-step (T == 1) fusions of the MoE block; all optional.
struct MoeDecode {
  GemvNorm norm;              // D9: x = rmsnorm(norm.h) is computed by the router stage (norm.w set)
  float* res = nullptr;       // D9: the down stage also adds its output into res (residual h)
  int* counter = nullptr;     // D10: router + softmax + top-k in one many-CTA kernel (zeroed int)
  L2Prefetch pf;              // D13: the next launch's weights, prefetched by the router stage
  bool pf_down = false;       // D13: the gate/up stage prefetches the chosen experts' down rows
  bool early_down = false;    // D17: down issues its expert-row loads before its PDL wait (D10 on)
  int* persist = nullptr;     // D19: one persistent kernel's counters and tagged logits (4 KB zeroed; moe.cu)
  // Investigation aid (cuda_tools::set_kernel_trace): the D19 kernel's CTAs write %globaltimer at
  // each phase boundary here, [CTA][kTracePhases]; null = off.
  unsigned long long* trace = nullptr;
  // Experiment switches of the D19 kernel (ablation ids "moep=N", bits): 1 releases PDL dependents
  // only at the end, 16 takes 2 down rows per warp (128 CTAs), 64 uses the self-resetting counters
  // instead of tickets (separate memory; both schemes stay consistent when launches alternate), 128
  // hands the logits over through the counter instead of tagged slots, 256 keeps the down stage on
  // float activations with D24 on, 2048 (= ablation D33) arrives at the D31 instance's second handoff with
  // __threadfence + atomicAdd instead of one red.release.gpu. (2 and 4, pinning the down loads and spinning
  // without sleep, had no effect and were removed in session 5.)
  int flags = 0;
  // D39: the unscaled router logits [E] and shared-expert gate logit [E] of this token, completed by the
  // out-projection launch right before this one (GemvRouterRows: Q_h·h from the in-projection launch + Q_a·a);
  // the D36 instance then skips its router rows and the logits handoff.
  const float* router_logits = nullptr;
};
int64_t moe_workspace_floats(const MoeDev& m, int T);
// Where moe() leaves the chosen expert ids [T, K] in its workspace (test aid).
const int32_t* moe_ids(const MoeDev& m, int T, const float* work);
// `fast` false uses the generic kernels (ablation D1). `stages` bits: 1 router, 2 gate/up, 4 down
// (the profiler launches them one at a time).
void moe(const MoeDev& m, const float* x, int T, float* out, float* work, bool fast, int stages, cudaStream_t s,
         const MoeDecode* dec = nullptr);
// What of `dec` the kernels can do for these weights (T == 1): folding the norm, the fused router.
bool moe_norm_ok(const MoeDev& m, int T, bool fast);
bool moe_router_topk_ok(const MoeDev& m, int T, bool fast);
// D19: the persistent kernel can run the block (T == 1, the model's shapes, FFMA kernels).
bool moe_persist_ok(const MoeDev& m, int T, bool fast);

}  // namespace lily::cuda
