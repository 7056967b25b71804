// TEST AID: the CPU backend's emulation of the CUDA prefill GEMM's operand rounding
// (LILY_CPU_EMULATE=bf16|fp16). With it, `lily cuda-check --cpu-emulate fp16` compares the CUDA
// prefill against a reference that rounds matmul inputs and dequantised weights exactly as the
// tensor-core GEMM does (src/backend/cuda/gemm.cu), so that what remains is summation order and
// kernel bugs, not the precision of the operands. Off by default; never used in serving.
#pragma once
#include <cstdint>

#include "core/thread_pool.h"
#include "model/weights.h"

namespace lily {

enum class GemmEmu : int { kOff = 0, kBf16 = 1, kFp16 = 2 };

// Mode from LILY_CPU_EMULATE ("", "off", "bf16", "fp16"); throws on anything else.
GemmEmu gemm_emu_from_env();
// The CUDA backend's GEMM threshold (LILY_GEMM_MIN_T, default 16): ops with T below it run the
// exact f32 GEMV on the GPU, so the emulation applies from the same T.
int gemm_emu_min_t();
// True when the CUDA GEMM would take W in an op of T tokens (4/8-bit affine, group 64, bf16 scales,
// cols % 512 == 0, rows >= gemm_small_n(T) of the CUDA backend: LILY_GEMM_SMALL_N, default 64, and
// unless `skinny` is off (ablation P7) LILY_GEMM_SKINNY_N, default 32, from T >= LILY_GEMM_SKINNY_T,
// default 256; smaller ones run the exact f32 GEMV on the GPU).
bool gemm_emu_applies(const QMatrix& W, int T, bool skinny = true);

// Rounding to nearest-even of a double to bf16 / fp16 (subnormals included, fp16 overflow to inf).
float round_bf16(double v);
float round_fp16(double v);
// P16: the CUDA prefill MoE keeps each (token, slot) row (w_k·down_k, shared: σ(gate)·down) in fp16,
// saturated at ±65504. The emulation rounds those rows the same way unless LILY_CPU_EMULATE_SLOT16=0
// (for comparisons with the ablation P16 off); it applies where the emulation does (T >= gemm_emu_min_t).
bool gemm_emu_slot16_from_env();
float round_fp16_sat(float v);
// The per-row power-of-two exponent s of the fp16 path: max|x|·2^s in [2^14, 2^15).
int fp16_row_exp(float amax);
// Weights are pre-scaled by 2^kFp16WExp in the fp16 path (keeps small scales out of subnormals).
constexpr int kFp16WExp = 8;

// y[T, W.rows] = x·Wᵀ with the GPU GEMM's operand rounding for `mode` (W must satisfy
// gemm_emu_applies). 4-bit: x rounded (bf16, or fp16 with the per-row exponent), weights
// round(q·s + b) once (fp16: with s, b scaled by 2^8 and rounded to fp16 first). 8-bit (both
// modes): split precision x_hi·w_hi + x_lo·w_hi + x_hi·w_lo with bf16 halves, unless `q8_fp16` (the CUDA
// P68, the prefill router on fp16 operands) in fp16 mode: x as the 4-bit fp16 path rounds it, each weight
// round_fp16(fmaf(q, s, b)·2^8) once.
void qmatmul_emulated(GemmEmu mode, const QMatrix& W, const float* x, int T, float* y, ThreadPool& pool,
                      bool q8_fp16 = false);

}  // namespace lily
