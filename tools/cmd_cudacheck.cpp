// `lily cuda-check`: runs the same tokens through the cpu and cuda backends and compares logits per
// position (prefill path and decode path), teacher-forced top-1 agreement and greedy tokens (the
// CUDA side decoding through its captured step). Exits non-zero when a bound is missed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#ifdef LILY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "model/qwen36.h"
#include "model/synthetic.h"
#include "model/weights.h"

namespace lily {
namespace {

struct Cmp {
  double min_cos = 1, max_abs = 0;
  int top1_same = 0, n = 0;
};

int argmax_of(const float* l, int V) { return int(std::max_element(l, l + V) - l); }

void compare_rows(const float* a, const float* b, int rows, int V, Cmp& c, const char* what, bool verbose,
                  int pos0 = 0) {
  for (int r = 0; r < rows; ++r) {
    const float* x = a + int64_t(r) * V;
    const float* y = b + int64_t(r) * V;
    double dot = 0, nx = 0, ny = 0, mx = 0;
    for (int i = 0; i < V; ++i) {
      dot += double(x[i]) * y[i];
      nx += double(x[i]) * x[i];
      ny += double(y[i]) * y[i];
      mx = std::max(mx, double(std::fabs(x[i] - y[i])));
    }
    const double cos = dot / std::sqrt(nx * ny + 1e-300);
    const bool same = argmax_of(x, V) == argmax_of(y, V);
    c.min_cos = std::min(c.min_cos, cos);
    c.max_abs = std::max(c.max_abs, mx);
    c.top1_same += same;
    c.n += 1;
    if (verbose || !std::isfinite(cos) || cos < 0.999)
      std::printf("  %s pos %4d  cosine %.6f  max|diff| %.3g  top1 %s\n", what, pos0 + r, cos, mx, same ? "same" : "DIFF");
  }
}

int cudacheck_main(int argc, char** argv) {
  Options o("cuda-check", "Compare the cuda backend against the cpu backend on one model.",
            {{"model", "", "checkpoint directory (default: full-width synthetic model)", "LILY_MODEL"},
             {"layers", "4", "synthetic model: layers (every 4th is attention)"},
             {"vocab", "0", "synthetic model: vocabulary rows (0 = real 248,320)"},
             {"seed", "1", "synthetic weights and prompt seed"},
             {"prompt", "24", "prompt tokens (random ids)"},
             {"tokens", "64", "decode steps compared (>= 64 for the acceptance bound)"},
             {"chunk", "16", "prefill chunk size (small: exercises chunk boundaries)"},
             {"threads", "0", "cpu threads"},
             {"ablate", "", "optimization ids switched off on the cuda side"},
             {"min-cosine", "0.999", "pass bound on every position's logits cosine"},
             {"cpu-emulate", "", "test aid: cpu reference rounds prefill GEMM operands as the GPU does (bf16|fp16)"},
             {"follow-routing", "false", "test aid: the cpu reference uses the gpu's expert ids in every comparison "
              "(routing differences are counted, with their router margins, instead)", "", true},
             {"verbose", "false", "print every position", "", true}});
  if (!o.parse(argc, argv)) return 0;
  // Backends first: a build or machine without CUDA fails before any weights are built.
  // --cpu-emulate: the cpu backend reads LILY_CPU_EMULATE when it is made (gemm_emulate.h).
  if (!o.str("cpu-emulate").empty()) setenv("LILY_CPU_EMULATE", o.str("cpu-emulate").c_str(), 1);
  BackendOptions cpu_opt;
  cpu_opt.name = "cpu";
  cpu_opt.threads = o.num("threads");
  BackendOptions cuda_opt;
  cuda_opt.name = "cuda";
  cuda_opt.ablations.off = split_list(o.str("ablate"));
  auto cpu_be = make_backend(cpu_opt);
  auto cuda_be = make_backend(cuda_opt);
  std::shared_ptr<ModelWeights> host;
  if (!o.str("model").empty()) {
    host = std::make_shared<ModelWeights>(load_weights(o.str("model")));
  } else {
    SyntheticOptions so;
    so.layers = o.num("layers");
    so.vocab = o.num("vocab");
    so.seed = uint64_t(o.i64("seed"));
    host = std::make_shared<ModelWeights>(make_synthetic_weights(so));
  }
  const ModelConfig& c = host->config;
  const int V = c.vocab_size, P = o.num("prompt"), N = o.num("tokens");
  if (P < 1 || N < 1) throw Error("--prompt and --tokens must be at least 1");
  std::mt19937 rng(uint32_t(o.i64("seed")));
  std::vector<int32_t> seq(P + N);
  for (auto& t : seq) t = int32_t(rng() % uint32_t(V));

  ModelOptions mo;
  mo.max_chunk = o.num("chunk");
  Qwen36 cpu(host, *cpu_be, mo), gpu(host, *cuda_be, mo);
  const bool verbose = o.flag("verbose");
  const int cap = P + N + 8;

  // --follow-routing: the gpu runs first, recording its expert ids per MoE call, and the cpu
  // reference routes every call the same way (its own top-k differences are counted with their
  // router margins): separates router near-ties flipped by rounding from kernel errors.
  const bool follow = o.flag("follow-routing");
  size_t calls = 0, followed = 0;
  cpu_tools::RoutingStats rst;
  auto run_pair = [&](Qwen36State& sa, Qwen36State& sb, std::span<const int32_t> toks, float* la, float* lb,
                      bool all) {
    if (!follow) {
      cpu.forward(sa, toks, la, all);
      gpu.forward(sb, toks, lb, all);
      return;
    }
#ifdef LILY_HAVE_CUDA
    cuda_tools::record_moe_ids(*cuda_be, true);
    gpu.forward(sb, toks, lb, all);
    std::vector<std::vector<int32_t>> ids = cuda_tools::take_moe_ids(*cuda_be);
    cuda_tools::record_moe_ids(*cuda_be, false);
    calls += ids.size();
    for (const auto& v : ids) followed += !v.empty();
    cpu_tools::set_routing_override(*cpu_be, std::move(ids));
    cpu.forward(sa, toks, la, all);
    const cpu_tools::RoutingStats st = cpu_tools::routing_stats(*cpu_be);
    rst.tokens += st.tokens;
    rst.differing += st.differing;
    rst.max_gap = std::max(rst.max_gap, st.max_gap);
    const size_t left = cpu_tools::routing_override_left(*cpu_be);
    cpu_tools::set_routing_override(*cpu_be, {});
    if (left) throw Error("cuda-check --follow-routing: the cpu made fewer MoE calls than the gpu recorded");
#else
    throw Error("cuda-check --follow-routing: this build has no CUDA backend");
#endif
  };

  // 1. Prefill path: all positions at once (chunks of --chunk), every row of logits.
  std::vector<float> la(size_t(P + N) * V), lb(size_t(P + N) * V);
  {
    auto sa = cpu.new_state(cap), sb = gpu.new_state(cap);
    run_pair(*sa, *sb, seq, la.data(), lb.data(), true);
  }
  Cmp pre;
  compare_rows(la.data(), lb.data(), P + N, V, pre, "prefill", verbose);

  // 2. Decode path, teacher-forced: prompt, then one token per call.
  Cmp dec;
  {
    auto sa = cpu.new_state(cap), sb = gpu.new_state(cap);
    run_pair(*sa, *sb, std::span<const int32_t>(seq.data(), P), nullptr, nullptr, false);
    std::vector<float> a(V), b(V);
    for (int i = 0; i < N; ++i) {
      run_pair(*sa, *sb, std::span<const int32_t>(&seq[P + i], 1), a.data(), b.data(), false);
      compare_rows(a.data(), b.data(), 1, V, dec, "decode", verbose, P + i);
    }
  }

  // 3. Greedy: cpu plain loop vs cuda generate_greedy (captured step unless D2 is ablated). With
  //    --follow-routing also an eager greedy loop in which the cpu follows the gpu's experts, each
  //    side picking its own argmax; at a divergence, the cpu's logit margin between the two tokens.
  std::vector<int32_t> ga, gb;
  {
    auto sa = cpu.new_state(cap), sb = gpu.new_state(cap);
    cpu.forward(*sa, std::span<const int32_t>(seq.data(), P - 1), nullptr);
    gpu.forward(*sb, std::span<const int32_t>(seq.data(), P - 1), nullptr);
    cpu.generate_greedy(*sa, seq[P - 1], N, ga);
    gpu.generate_greedy(*sb, seq[P - 1], N, gb);
  }
  int follow_diff = -1, follow_a = 0, follow_b = 0;
  double follow_margin = 0;
  if (follow) {
    auto sa = cpu.new_state(cap), sb = gpu.new_state(cap);
    run_pair(*sa, *sb, std::span<const int32_t>(seq.data(), P - 1), nullptr, nullptr, false);
    std::vector<float> a(V), b(V);
    int32_t tok = seq[P - 1];
    for (int i = 0; i < N && follow_diff < 0; ++i) {
      run_pair(*sa, *sb, std::span<const int32_t>(&tok, 1), a.data(), b.data(), false);
      const int ta = argmax_of(a.data(), V), tb = argmax_of(b.data(), V);
      if (ta != tb) {
        follow_diff = i;
        follow_a = ta;
        follow_b = tb;
        follow_margin = double(a[ta]) - a[tb];
      }
      tok = ta;
    }
  }
  // 4. Chunk boundary on the cuda side alone: prefill(P) then one decode step must give the logits of
  //    prefill(P+1) at its last position (the matrix path and the vector path agree).
  Cmp pd;
  {
    auto sa = gpu.new_state(cap), sb = gpu.new_state(cap);
    std::vector<float> a(V), b(V);
    gpu.forward(*sa, std::span<const int32_t>(seq.data(), P), nullptr);
    gpu.forward(*sa, std::span<const int32_t>(&seq[P], 1), a.data());
    gpu.forward(*sb, std::span<const int32_t>(seq.data(), P + 1), b.data());
    compare_rows(a.data(), b.data(), 1, V, pd, "prefill(P)+decode vs prefill(P+1)", verbose, P);
  }

  int first_diff = -1;
  for (int i = 0; i < N; ++i)
    if (ga[i] != gb[i]) {
      first_diff = i;
      break;
    }

  const char* emu = std::getenv("LILY_CPU_EMULATE");
  const char* g16 = std::getenv("LILY_GEMM_BF16");
  std::printf("cuda-check: %s, %d layers, vocab %d, prompt %d, %d decode steps; gpu GEMM operands %s, "
              "gpu KV cache %s, cpu reference %s%s\n",
              o.str("model").empty() ? "synthetic" : o.str("model").c_str(), c.num_hidden_layers, V, P, N,
              g16 && *g16 && *g16 != '0' ? "bf16" : "fp16", cuda_be->kv_type() == KvType::f16 ? "fp16" : "f32",
              emu && *emu ? "emulating " : "f32", emu && *emu ? emu : "");
  std::printf("  prefill path: min cosine %.6f  max|diff| %.4g  top-1 %d/%d%s\n", pre.min_cos, pre.max_abs,
              pre.top1_same, pre.n, follow ? " (cpu following the gpu's experts)" : "");
  std::printf("  decode path:  min cosine %.6f  max|diff| %.4g  top-1 %d/%d (teacher-forced%s)\n", dec.min_cos,
              dec.max_abs, dec.top1_same, dec.n, follow ? ", cpu following the gpu's experts" : "");
  if (follow)
    std::printf("  routing: followed in %zu of %zu MoE calls (%lld token-layers); the cpu's own top-%d differed on "
                "%lld, its largest k-th vs (k+1)-th log-probability gap among those %.3g\n",
                followed, calls, (long long)rst.tokens, c.num_experts_per_tok, (long long)rst.differing, rst.max_gap);
  std::printf("  greedy:       %s", first_diff < 0 ? "identical" : "DIVERGED");
  if (first_diff >= 0) std::printf(" at step %d (cpu %d, cuda %d)", first_diff, ga[first_diff], gb[first_diff]);
  std::printf(" over %d tokens (cuda: captured step%s)\n", N, follow ? ", own routing" : "");
  if (follow) {
    std::printf("  greedy, cpu following the gpu's experts (eager): %s", follow_diff < 0 ? "identical" : "DIVERGED");
    if (follow_diff >= 0)
      std::printf(" at step %d (cpu %d, cuda %d; the cpu's logit margin between them %.3g)", follow_diff, follow_a,
                  follow_b, follow_margin);
    std::printf(" over %d tokens\n", N);
  }
  std::printf("  prefill(P)+decode vs prefill(P+1), cuda: cosine %.6f  max|diff| %.4g  top-1 %s\n", pd.min_cos,
              pd.max_abs, pd.top1_same == pd.n ? "same" : "DIFF");
  const double top1 = double(pre.top1_same + dec.top1_same) / double(pre.n + dec.n);
  const double mc = o.real("min-cosine");
  // With --follow-routing the greedy bound applies to the loop with routing followed (the captured
  // step's own line is printed above, for the record).
  const bool greedy_ok = follow ? follow_diff < 0 : first_diff < 0;
  const bool ok = pre.min_cos >= mc && dec.min_cos >= mc && greedy_ok && top1 >= 0.99 && pd.min_cos >= mc &&
                  pd.top1_same == pd.n;
  std::printf("cuda-check: %s (bounds: cosine >= %g every position, identical greedy tokens, top-1 >= 99%%; "
              "top-1 %.2f%%)\n", ok ? "PASS" : "FAIL", mc, 100 * top1);
  return ok ? 0 : 1;
}

RegisterCommand reg{{"cuda-check", "compare the cuda backend against the cpu backend", cudacheck_main}};

}  // namespace
}  // namespace lily
