// Useful floating-point work of the prefill ops that `lily bench prefill --profile-length` times, so the
// per-op table can show each main kernel's achieved rate next to the measured matrix ceiling (issue E):
// the FLOPs the model's math needs (2 per multiply-add), not what a kernel spends (padding rows, split
// precision's extra products, recomputation). 0 for ops with no such count here (norms, GDN, routing).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/config.h"

namespace lily {

// name: the op's profile label; tokens: the prompt length of the profiled prefill (one forward from an
// empty state, any chunking); calls: how often the label ran in it. Returns the op's total useful FLOPs.
//  - "gemm NxK+NxK+..." (one GEMM batch, P30's stacked projections included): 2·T·N·K summed, per call.
//  - "moe_prefill.gate_up" / ".down": the routed experts' and the shared expert's products (both run in the
//    grouped GEMMs); ".router.gemm": the router's T × E × H.
//  - "attn_prefill": causal Q·Kᵀ and P·V of every head over all earlier positions of the prompt,
//    4·heads·head_dim·T(T+1)/2 per layer (calls = full-attention layers).
inline double prefill_op_flops(const std::string& name, const ModelConfig& c, int64_t tokens, int calls) {
  const double T = double(tokens), H = c.hidden_size;
  if (name.rfind("gemm ", 0) == 0) {
    double f = 0;
    const char* p = name.c_str() + 5;
    while (*p) {
      char* e = nullptr;
      const long n = std::strtol(p, &e, 10);
      if (e == p || *e != 'x') return 0;
      const char* q = e + 1;
      const long k = std::strtol(q, &e, 10);
      if (e == q) return 0;
      f += 2 * T * double(n) * double(k);
      if (*e == '+') ++e;
      else if (*e) return 0;
      p = e;
    }
    return f * calls;
  }
  const double k = c.num_experts_per_tok, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  if (name == "moe_prefill.gate_up") return 2 * T * (k * 2 * I + 2 * Is) * H * calls;
  if (name == "moe_prefill.down") return 2 * T * (k * I + Is) * H * calls;
  if (name == "moe_prefill.router.gemm") return 2 * T * double(c.num_experts) * H * calls;
  if (name == "attn_prefill")
    return 4.0 * c.num_attention_heads * c.head_dim * (T * (T + 1) / 2) * calls;
  return 0;
}

}  // namespace lily
