// Host-side launchers of the prefill kernels of the two token mixers (T > 1 tokens per call):
// Gated DeltaNet prefill (gdn_prefill.cu: parallel pre-pass, then a register-resident scan with the
// state columns spread over many CTAs, then the gated RMSNorm) and causal flash attention with
// bf16 tensor-core MMA (attention_prefill.cu). Decode (T = 1) keeps the kernels of gdn.cu and
// attention.cu. Like cuda_ops.h: every launcher only enqueues on `s`.
#pragma once
#include <cuda_bf16.h>

#include "backend/cuda/cuda_ops.h"

namespace lily::cuda {

// ---- asynchronous global -> shared copies (sm_80+), used to stage tiles of the prefill kernels --
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sa), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- bf16 tensor-core fragments (mma.sync m16n8k16, operands through ldmatrix) --------------
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
}
__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Split precision: x ≈ hi + lo with both bf16 (~16-bit mantissa; bf16 keeps the fp32 exponent range).
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}
// kOne (P24): acc += ah·bh only (one bf16 MMA, the lo operands unused), else mma_bf16x3.
template <bool kOne>
__device__ __forceinline__ void mma_bf16x(float* c, const uint32_t* ah, const uint32_t* al, uint32_t bh0, uint32_t bh1,
                                          uint32_t bl0, uint32_t bl1);
// acc += a·b with a = ah + al, b = bh + bl (al·bl dropped: ~2^-16 relative), small terms first.
__device__ __forceinline__ void mma_bf16x3(float* c, const uint32_t* ah, const uint32_t* al, uint32_t bh0, uint32_t bh1,
                                           uint32_t bl0, uint32_t bl1) {
  mma_bf16(c, al[0], al[1], al[2], al[3], bh0, bh1);
  mma_bf16(c, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
  mma_bf16(c, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
}
template <bool kOne>
__device__ __forceinline__ void mma_bf16x(float* c, const uint32_t* ah, const uint32_t* al, uint32_t bh0, uint32_t bh1,
                                          uint32_t bl0, uint32_t bl1) {
  if constexpr (kOne) mma_bf16(c, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
  else mma_bf16x3(c, ah, al, bh0, bh1, bl0, bl1);
}

// ---- gdn_prefill.cu ------------------------------------------------------------------------
// Shapes the prefill kernels handle (dk == dv == 128, conv kernel <= 9); others use gdn().
bool gdn_prefill_ok(const GdnDims& d);
// Workspace floats for T tokens: u [T, conv_dim] (post conv+SiLU, q/k normalised), β and g [T, nv].
int64_t gdn_prefill_workspace_floats(const GdnDims& d, int T);
// Pre-pass: causal conv with the carried conv state + SiLU, l2norm of q and k (q also × dk^-1/2),
// β = σ(b), g = −exp(A_log)·softplus(a + dt_bias). Reads conv_state, does not change it.
// qkv16 (P62, optional): the raw inputs as fp16 [T, conv_dim] instead of qkv (P41's kernel; gdn_prep_wide_ok).
void gdn_prefill_prep(const GdnDims& d, const float* conv_w, const float* A_log, const float* dt_bias,
                      const float* conv_state, const float* qkv, const float* a, const float* b, int T,
                      float* work, cudaStream_t s, const __half* qkv16 = nullptr);
// Whether the prep runs P41's kernel for these buffers (the one that also reads fp16 inputs, P62).
bool gdn_prep_wide_ok(const GdnDims& d, const float* conv_w, const float* conv_state, const void* qkv,
                      const float* work);
// P9: the prep with a CTA's loads in flight at once and one barrier per 8 tokens (off: a loop that
// loads and reduces token by token).
bool& gdn_prep_batched_enabled();
// P41 (with P9, conv kernel 4): the prep with a warp per 128-channel head and 4 channels per lane (float4 rows of
// 512 bytes per warp, one butterfly per q / k head and token; the sum of squares in another order).
bool& gdn_prep_wide_enabled();
// P74 (with P62's fp16 inputs): P41's kernel with its window of raw inputs held as fp16 and 8 CTAs per SM; same values.
bool& gdn_prep_lean_enabled();
// The delta rule over the T tokens with S in registers (read and written once), then the gated
// RMSNorm with silu(z) into y; also shifts the carried conv state (last K-1 raw rows of qkv).
// `nc`: state columns per lane of the scan (1, 2 or 4; 0 = default = 1).
void gdn_prefill_scan(const GdnDims& d, const float* norm_w, float* conv_state, float* S, const float* qkv,
                      const float* z, int T, const float* work, float* y, int nc, cudaStream_t s);

// Chunked form (P4c; chunks of 64 tokens, tensor cores in split bf16 precision), after
// gdn_prefill_prep on the same workspace: the per-chunk pass (U, W, P, scaled Q and K', all chunks
// and heads in parallel), then the state over the chunks + the gated RMSNorm (+ conv-state shift).
// Workspace: gdn_chunked_workspace_floats (includes the prep's part).
int64_t gdn_chunked_workspace_floats(const GdnDims& d, int T);
void gdn_chunked_intra(const GdnDims& d, int T, float* work, cudaStream_t s);
// P11: bit 0 = the per-chunk pass with (I + A)⁻¹ formed by 16×16 blocks and applied by split-bf16
// MMAs (off: forward substitution, one column per thread); bit 1 = the chunk scan with Δ alone in
// its first phase, rescheduled loads and an L2 prefetch two chunks ahead. 0 = the P4c kernels.
// Same buffers, same results to rounding; either part works with the other's old form. 7 (both +
// bit 2, experimental): q̂ / k̂ stored once per key head, row factors applied in the scan. Bit 4
// (scan3, overrides bits 0-2): the per-chunk pass also forms Q~ = diag(γ)Q − P W and O0 = P U, and
// the scan keeps only Δ = U − W S, O = Q~ S + O0, S ← γ_C S + K'ᵀ Δ.
int& gdn_chunk_p11();
// P24: the P11 chunk scan's products (W S, diag(γ)Q S, K'ᵀ Δ, P Δ) in one bf16 MMA each (operands
// rounded to bf16, fp32 accumulation; the state stays fp32) instead of split bf16 (three MMAs), and
// the per-chunk pass writes only the hi planes. Default on; --ablate P24 = split.
bool& gdn_chunk_one();
// P27 (with P24): the chunk scan with 16 state columns per CTA (256 CTAs, two per SM: two
// independent chunk chains per SM) instead of 32 (128 CTAs, one per SM). Default on; --ablate P27.
bool& gdn_scan_nb16();
// P36 (with P27): two 16-column halves per CTA (16 warps, 128 CTAs) sharing one copy of the head's W / Q / K' / P
// tiles. Default on; --ablate P36.
bool& gdn_scan_halves();
// norm = false: y is left raw (o = Sᵀq̂ per head) for gdn_prefill_norm or P28's fused conversion.
// qkv null: the conv state is not shifted here (P62: gdn_conv_shift16 does it from the fp16 inputs).
void gdn_chunked_scan(const GdnDims& d, const float* norm_w, float* conv_state, float* S, const float* qkv,
                      const float* z, int T, float* work, float* y, cudaStream_t s, bool norm = true);
// P62: the carried conv state ← the last K-1 raw inputs, read as fp16 [T, conv_dim]; after the prep has read it.
void gdn_conv_shift16(const GdnDims& d, float* conv_state, const __half* qkv16, int T, cudaStream_t s);
// (gdn_prefill_norm: cuda_ops.h)

// ---- attention_prefill.cu --------------------------------------------------------------------
// Shapes the flash kernel handles (head_dim 256, 8 query heads per KV head); others use attention().
bool attention_prefill_ok(const AttnDims& d);
// Workspace floats for T tokens at pos0 (prepared queries + partial softmaxes of a split KV range
// + with bf16_kv a bf16 copy of the cache rows [0, pos0 + T); pass false for an fp16 cache: no copy).
int64_t attention_prefill_workspace_floats(const AttnDims& d, int T, int pos0, bool bf16_kv);
// Causal attention of T tokens at positions pos0.. over the cache [0, pos0 + T): prep (norms, RoPE,
// KV append; attention.cu) then the flash kernel (and a merge when the KV range is split over CTAs
// to fill the GPU), output × σ(gate). Requires pos0 + T <= capacity. kv16: the cache is fp16 (D18)
// and its tiles are read directly (implies fp16 MMA; bf16_kv and f16 are ignored). Else, f32 cache:
// bf16_kv: the cache rows are converted to 16 bits once per call (otherwise every K/V tile in
// every CTA). f16: MMA operands in fp16 (|v| < 65504 assumed, saturated), else bf16.
// P12 (default on): the flash kernel's 16-bit-KV path (fp16 cache, or the per-call 16-bit copy) takes
// keys in tiles of 64 through a 2-slot cp.async ring; off: tiles of 32 in a 3-slot ring (P6 as first
// built). The f32-staging path (LILY_ATTN_BF16KV=0 with an f32 cache) keeps tiles of 32 either way.
bool& attn_prefill_bk64_enabled();
// Experiment (LILY_ATTN_QREG=1, only with P12): Q fragments kept in registers, 3 slots of 64 keys.
bool& attn_prefill_qreg_enabled();
// P12's products (LILY_ATTN_WG, only with P12 and fp16 operands): 2 (default) = S = Q·Kᵀ and O += P·V
// on wgmma; 1 = S on wgmma, P·V on mma.sync; 0 = both on mma.sync; 3 = 2 with V's descriptor strides
// exchanged (diagnostic only).
int& attn_prefill_wg_mode();
// P33 (default on; only the wgmma kernel, mode 2): Q tile and output-gate loads batched 8 per thread
// (off: one dependent load at a time).
bool& attn_prefill_p33_enabled();
// P63 (default on; the wgmma kernel of mode 2 with P33): K / V tiles loaded by TMA from a producer warp into an
// mbarrier ring (off: every thread copies with cp.async and the CTA meets at a barrier per tile).
bool& attn_prefill_p63_enabled();
// P67 (default on, with P63 and P66 on the fp16 cache): the prep writes the queries as P63's fp16 operand and the
// producer loads the Q tile by TMA (off: f32 queries converted by the consumers).
bool& attn_prefill_p67_enabled();
void attention_prefill(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
                       int pos0, const float* q, const float* k, const float* v, int T, float* o, float* work,
                       bool bf16_kv, bool f16, cudaStream_t s);

// ---- attention.cu (shared with the decode path) ----------------------------------------------
// The decode path's prep kernel alone: queries (normalised, rotated, × hd^-1/2) to qbuf [T, heads, hd],
// keys and values appended to the cache rows pos0..pos0+T-1 (fp16 when kv16, else f32).
// q16 (P67; requires attention_prep_q16_ok): the queries as fp16 × log2 e [T, heads, hd] in qbuf's space instead.
void attention_prep(const AttnDims& d, const float* q_norm, const float* k_norm, void* kc, void* vc, bool kv16,
                    int pos0, const int32_t* pos_dev, const float* q, const float* k, const float* v, int T,
                    float* qbuf, cudaStream_t s, bool q16 = false);
bool attention_prep_q16_ok(const AttnDims& d, int T, bool kv16);

}  // namespace lily::cuda
