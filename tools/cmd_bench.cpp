// `lily bench decode`: batch-1 greedy decode throughput per context length (BENCHMARK.md), with
// matched ablations in alternating order, copy-bandwidth ceiling, per-op time breakdown and expert
// load balance; writes JSON + markdown. Long contexts are filled with random KV/state instead of a
// prefill (stated in the results). `lily bench prefill` lives in bench_prefill.cpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

#include "backend/backend.h"
#include "bench_common.h"
#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "model/qwen36.h"
#include "model/synthetic.h"
#include "model/weights.h"
#ifdef LILY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace lily {


namespace {

using Clock = std::chrono::steady_clock;

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// Weight bytes one decode token must read (active experts only), per MODEL.md §5.
double active_weight_bytes(const ModelWeights& w) {
  auto mb = [](const QMatrix& m) {
    const double per = m.type == WType::kAffine4 ? 0.5 : m.type == WType::kAffine8 ? 1 : m.type == WType::kBF16 ? 2 : 4;
    return m.rows * m.cols * per + (m.quantized() ? 2.0 * m.rows * (m.cols / m.group_size) * (m.sb_f32 ? 4 : 2) : 0);
  };
  const ModelConfig& c = w.config;
  double b = mb(w.lm_head) + mb(w.embed_tokens) / w.embed_tokens.rows;
  for (const auto& L : w.layers) {
    if (L.full_attention)
      b += mb(L.self_attn.q_proj) + mb(L.self_attn.k_proj) + mb(L.self_attn.v_proj) + mb(L.self_attn.o_proj);
    else
      b += mb(L.linear_attn.in_proj_qkv) + mb(L.linear_attn.in_proj_z) + mb(L.linear_attn.in_proj_a) +
           mb(L.linear_attn.in_proj_b) + mb(L.linear_attn.out_proj);
    const MoeWeights& m = L.mlp;
    b += mb(m.gate) + mb(m.shared_expert_gate) + mb(m.shared_gate_proj) + mb(m.shared_up_proj) + mb(m.shared_down_proj);
    b += c.num_experts_per_tok * (mb(m.experts_gate.first) + mb(m.experts_up.first) + mb(m.experts_down.first));
  }
  return b;
}

// Cache + recurrent-state bytes one token reads (and the state it writes) at context L (KV elements
// of kv_bytes, recurrent state f32).
double state_bytes_per_token(const ModelConfig& c, int L, int kv_bytes) {
  const double kv = 2.0 * L * c.num_key_value_heads * c.head_dim * kv_bytes * c.num_full_attention_layers();
  const int gdn_layers = c.num_hidden_layers - c.num_full_attention_layers();
  const double S = 2.0 * gdn_layers * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
  return kv + S;
}

void fill_random(Backend& be, float* p, int64_t n, float scale, uint64_t seed) {
#ifdef LILY_HAVE_CUDA
  if (be.name() == "cuda") return cuda_tools::fill_uniform(be, p, n, scale, seed);
#endif
  std::vector<float> h(std::min<int64_t>(n, 1 << 20));
  uint64_t z = seed;
  for (int64_t i = 0; i < n; i += int64_t(h.size())) {
    const int64_t m = std::min<int64_t>(n - i, int64_t(h.size()));
    for (int64_t j = 0; j < m; ++j) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      h[j] = scale * (float(z >> 40) / 8388608.f - 1.f);
    }
    be.copy_from_host(p + i, h.data(), 4 * m);
  }
}

struct Sample {
  std::vector<double> tok_s, ms_steady;
};


}  // namespace

BenchWeights load_bench_weights(bool use_model, const std::string& model_dir, int layers) {
  if (use_model) return {std::make_shared<ModelWeights>(load_weights(model_dir)), model_dir};
  SyntheticOptions so;
  so.layers = layers;
  return {std::make_shared<ModelWeights>(make_synthetic_weights(so)),
          "synthetic qwen3.6-35b-a3b 4-bit (" + std::to_string(layers) + " layers, random weights)"};
}

namespace {

int bench_main(int argc, char** argv) {
  if (argc > 0 && std::string(argv[0]) == "prefill") return bench_prefill_main(argc - 1, argv + 1);
  Options o("bench", "lily bench decode: batch-1 decode throughput per context length (BENCHMARK.md).",
            {{"model", "", "checkpoint directory (default: full-size synthetic model)", "LILY_MODEL"},
             {"synthetic", "false", "use the synthetic full-size model", "", true},
             {"layers", "40", "synthetic model layers"},
             {"backend", "cuda", "cuda | cpu", "LILY_BACKEND"},
             {"threads", "0", "CPU threads (0 = all cores)", "LILY_THREADS"},
             {"contexts", "256,512,1024,2048,4096,8192,16384,32768,65536,131072", "context lengths"},
             {"tokens", "128", "generated tokens per measurement"},
             {"rounds", "3", "rounds (variants alternate order in each round)"},
             {"ablate", "", "optimization ids; each is measured as its own variant (e.g. D2,D6,D7; D9+D10 = both off)"},
             {"profile-context", "4096", "context of the per-op breakdown (0 = none)"},
             {"profile-ablate", "", "ids switched off during the per-op breakdown only (e.g. D13)"},
             {"out", "docs/benchmarks", "directory for the JSON and markdown results"},
             {"tag", "decode", "file name stem of the results"},
             {"commit", "", "commit recorded in the results", "LILY_COMMIT"}});
  if (!o.parse(argc, argv)) return 0;
  const auto& pos = o.positional();
  if (pos.empty() || pos[0] != "decode") throw Error("usage: lily bench decode|prefill [options]");
  std::string cmdline = "lily bench";
  for (int i = 0; i < argc; ++i) cmdline += std::string(" ") + argv[i];

  const double t_load = now_s();
  const BenchWeights bw = load_bench_weights(!o.str("model").empty(), o.str("model"), o.num("layers"));
  const std::shared_ptr<ModelWeights>& host = bw.host;
  const std::string& model_name = bw.name;
  const ModelConfig& c = host->config;
  std::fprintf(stderr, "bench: weights ready in %.1f s\n", now_s() - t_load);
  BackendOptions bo;
  bo.name = o.str("backend");
  bo.threads = o.num("threads");
  auto be = make_backend(bo);
  ModelOptions mo;
  mo.max_chunk = 16;
  Qwen36 model(host, *be, mo);
  std::fprintf(stderr, "bench: uploaded in %.1f s total\n", now_s() - t_load);

  std::vector<int> ctxs = parse_int_list(o.str("contexts"), "--contexts");
  const int N = o.num("tokens"), rounds = o.num("rounds"), warm = 32;
  const int max_ctx = *std::max_element(ctxs.begin(), ctxs.end());
  // One state per KV cache type: a variant with D18 off (f32 cache) decodes from its own state.
  std::map<int, std::unique_ptr<Qwen36State>> states;
  std::vector<std::vector<std::string>> variants = {{}};
  for (const auto& id : split_list(o.str("ablate")))   // "D9+D10": one variant with both off
    variants.push_back(Ablations::variant(id).off);
  auto set_variant = [&](const std::vector<std::string>& v) {
    Ablations a;
    a.off = v;
#ifdef LILY_HAVE_CUDA
    if (be->name() == "cuda") cuda_tools::set_ablations(*be, a);
#endif
  };
  // Random state: KV rows, conv and recurrent state (scale keeps the recurrence bounded). The same
  // seeds for every cache type; 16-bit caches get the f32 values rounded.
  auto make_state = [&]() {
    auto st = model.new_state(max_ctx + warm + N + 8);
    uint64_t seed = 7;
    float* tmp = nullptr;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (c.is_full_attention[l]) {
        const int64_t n = int64_t(st->capacity) * c.num_key_value_heads * c.head_dim;
        for (void* dst : {st->kv[l].k, st->kv[l].v}) {
          if (st->kv[l].type == KvType::f32) {
            fill_random(*be, static_cast<float*>(dst), n, 1.f, seed++);
          } else {
            if (!tmp) tmp = be->alloc(n);
            fill_random(*be, tmp, n, 1.f, seed++);
            be->kv_from_f32(dst, st->kv[l].type, tmp, n);
          }
        }
      } else {
        fill_random(*be, st->gdn[l].conv, int64_t(c.linear_conv_kernel_dim - 1) * c.conv_dim(), 1.f, seed++);
        fill_random(*be, st->gdn[l].S,
                    int64_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim, 0.05f,
                    seed++);
      }
    }
    be->synchronize();
    if (tmp) be->free(tmp);
    return st;
  };
  // The state for the backend's current cache type (made on first use, after set_variant).
  auto state = [&]() -> Qwen36State& {
    auto& p = states[int(be->kv_type())];
    if (!p) p = make_state();
    return *p;
  };
  state();

  double copy_gbs = 0, floor_us = 0, floor_pdl_us = 0;
  std::string machine = be->name();
#ifdef LILY_HAVE_CUDA
  if (be->name() == "cuda") {
    copy_gbs = cuda_tools::copy_bandwidth_gbs(*be, int64_t(1) << 30);
    machine = cuda_tools::device_name();
    floor_us = cuda_tools::launch_floor_us(*be, false);
    floor_pdl_us = cuda_tools::launch_floor_us(*be, true);
    std::fprintf(stderr, "bench: graph node floor %.2f us (%.2f us with PDL)\n", floor_us, floor_pdl_us);
  }
#endif
  const double wbytes = active_weight_bytes(*host);
  std::fprintf(stderr, "bench: %s, copy bandwidth %.0f GB/s, active weights %.3f GB/token\n", machine.c_str(),
               copy_gbs, wbytes / 1e9);

  std::vector<int32_t> out;
  auto run = [&](int L, int n) {
    Qwen36State& st = state();
    st.pos = L;
    out.clear();
    be->synchronize();
    const double t0 = now_s();
    model.generate_greedy(st, 1, n, out);
    return now_s() - t0;
  };
  auto label = [](const std::vector<std::string>& v) {
    std::string s = v.empty() ? "all on" : "-";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? "+" : "") + v[i];
    return s;
  };
  std::map<std::pair<int, size_t>, Sample> res;
  for (int L : ctxs) {
    for (size_t v = 0; v < variants.size(); ++v) {   // warm-up per variant, discarded
      set_variant(variants[v]);
      run(L, 8);
    }
    for (int r = 0; r < rounds; ++r)
      for (size_t k = 0; k < variants.size(); ++k) {
        const size_t v = r % 2 ? variants.size() - 1 - k : k;
        set_variant(variants[v]);
        const double t_full = run(L, N);
        const double t_short = run(L, warm);
        const double t_long = run(L, warm + N);
        res[{L, v}].tok_s.push_back(N / t_full);
        res[{L, v}].ms_steady.push_back(1e3 * (t_long - t_short) / N);
      }
    const Sample& s = res[{L, 0}];
    std::fprintf(stderr, "bench: ctx %6d  %.1f tok/s  (steady %.3f ms/token)\n", L, median_of(s.tok_s),
                 median_of(s.ms_steady));
  }
  set_variant({});
  // Device memory held by lily after the timed runs (weights, the one state sized for the largest context,
  // workspaces, D39's router folds): the peak of the runs, since nothing is freed between them.
  double dev_mib = -1;
#ifdef LILY_HAVE_CUDA
  if (be->name() == "cuda") dev_mib = double(cuda_tools::device_bytes(*be)) / 1048576.0;
#endif

  // Per-op breakdown (eager, instrumented) and expert balance at the profile context.
  std::vector<std::string> prof_lines;
  std::string balance;
  const int Lp = o.num("profile-context");
#ifdef LILY_HAVE_CUDA
  if (be->name() == "cuda" && Lp > 0) {
    {   // prefetches (D13) move HBM traffic between ops: the breakdown without them separates that
      std::vector<std::string> v;
      const std::string ids = o.str("profile-ablate");
      for (size_t a = 0, b; a <= ids.size(); a = b + 1) {
        b = ids.find_first_of("+,", a);
        if (b == std::string::npos) b = ids.size();
        if (b > a) v.push_back(ids.substr(a, b - a));
      }
      set_variant(v);
    }
    const int reps = 5;
    for (int i = 0; i < reps; ++i) {
      cuda_tools::set_profiling(*be, true);   // re-arms the queue-up spin (see set_profiling)
      run(Lp, 1);
    }
    auto prof = cuda_tools::take_profile(*be);
    cuda_tools::set_profiling(*be, false);
    set_variant({});
    double total = 0;
    for (const auto& p : prof) total += p.ms / reps;
    prof_lines.push_back("| op | calls/token | ms/token | share | GB/s |");
    prof_lines.push_back("|---|---:|---:|---:|---:|");
    for (const auto& p : prof) {
      const double ms = p.ms / reps;
      prof_lines.push_back("| " + p.name + " | " + std::to_string(p.calls / reps) + " | " + fmtd("%.4f", ms) + " | " +
                           fmtd("%.1f%%", 100 * ms / total) + " | " +
                           (p.bytes > 0 ? fmtd("%.0f", p.bytes / (p.ms * 1e-3) / 1e9) : std::string("")) + " |");
    }
    prof_lines.push_back("| **sum of ops (eager, queued behind a spin, events)** | | " + fmtd("%.4f", total) + " | | |");
    cuda_tools::set_expert_histogram(*be, true);
    run(Lp, N);
    auto hist = cuda_tools::expert_histogram(*be);
    cuda_tools::set_expert_histogram(*be, false);
    double worst = 0, mean_ratio = 0;
    for (const auto& h : hist) {
      double tot = 0, mx = 0;
      for (auto x : h) {
        tot += double(x);
        mx = std::max(mx, double(x));
      }
      const double ratio = tot > 0 ? mx / tot * double(h.size()) : 0;
      worst = std::max(worst, ratio);
      mean_ratio += ratio / double(hist.size());
    }
    balance = "busiest expert's share / uniform share over " + std::to_string(N + 1) + " tokens: mean over layers " +
              fmtd("%.2f", mean_ratio) + ", worst layer " + fmtd("%.2f", worst) +
              " (uniform routing of 8 of 256 experts over this many tokens gives ≈" +
              fmtd("%.1f", 1 + 3 * std::sqrt(256.0 / (8.0 * (N + 1)))) + " by chance)";
  }
#endif

  // Investigation aid (LILY_KERNEL_TRACE=1): phase timestamps of the persistent MoE kernel (D19)
  // and the decode GEMVs inside the replayed step at the first context.
  std::vector<std::string> trace_lines;
#ifdef LILY_HAVE_CUDA
  if (const char* e = std::getenv("LILY_KERNEL_TRACE"); e && *e && *e != '0' && be->name() == "cuda") {
    cuda_tools::set_kernel_trace(*be, true);
    run(ctxs.front(), 16);
    trace_lines = cuda_tools::kernel_trace_summary(*be);
    cuda_tools::set_kernel_trace(*be, false);
    for (const auto& l : trace_lines) std::fprintf(stderr, "bench: %s\n", l.c_str());
  }
#endif

  // ---- results ------------------------------------------------------------------------------
  std::time_t tt = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&tt));
  std::ostringstream js, md;
  js << "{\n  \"date\": \"" << date << "\",\n  \"machine\": \"" << machine << "\",\n  \"commit\": \"" << o.str("commit")
     << "\",\n  \"command\": \"" << cmdline << "\",\n  \"model\": \"" << model_name
     << "\",\n  \"notes\": \"context filled with random KV/conv/recurrent state instead of a prefill; tok_s = N / wall "
        "time of generate_greedy (capture included); ms_steady from the difference of two run lengths\",\n"
     << "  \"copy_gbs\": " << copy_gbs << ",\n  \"graph_node_floor_us\": " << floor_us
     << ",\n  \"graph_node_floor_pdl_us\": " << floor_pdl_us << ",\n  \"active_weight_bytes\": " << wbytes
     << ",\n  \"device_mib\": " << (dev_mib >= 0 ? fmtd("%.0f", dev_mib) : "null") << ",\n  \"results\": [\n";
  md << "# Decode benchmark (" << date << ")\n\n- machine: " << machine << "\n- commit: " << o.str("commit")
     << "\n- command: `" << cmdline << "`\n- model: " << model_name
     << "\n- context: random KV cache / conv / recurrent state (no prefill); greedy, batch 1, " << N
     << " tokens, median of " << rounds << " rounds (variants alternate order)\n- device-to-device copy: "
     << fmtd("%.0f", copy_gbs) << " GB/s (read+write); active weights " << fmtd("%.3f", wbytes / 1e9)
     << " GB/token\n- graph node floor (chain of no-op kernels): " << fmtd("%.2f", floor_us) << " us, "
     << fmtd("%.2f", floor_pdl_us) << " us with programmatic dependent launch\n"
     << (dev_mib >= 0 ? "- device memory held by lily after the runs (weights, state for " + std::to_string(state().capacity) +
                            " tokens, workspaces): " + fmtd("%.0f", dev_mib) + " MiB\n"
                      : std::string())
     << "\n| context | variant | tok/s (median) | min | max | ms/token steady | GB/s achieved | % of copy bw |\n"
     << "|---:|---|---:|---:|---:|---:|---:|---:|\n";
  bool first = true;
  for (int L : ctxs)
    for (size_t v = 0; v < variants.size(); ++v) {
      const Sample& s = res[{L, v}];
      const double med = median_of(s.tok_s), ms = median_of(s.ms_steady);
      const double mn = *std::min_element(s.tok_s.begin(), s.tok_s.end());
      const double mx = *std::max_element(s.tok_s.begin(), s.tok_s.end());
      // The steady time is a difference of two timed runs; on tiny models it can drown in timing noise
      // (capture time varies by more than a whole run): then it is reported as unmeasured, not negative.
      const bool ms_ok = ms > 0;
      const bool f32_kv = be->name() != "cuda" ||
                          std::find(variants[v].begin(), variants[v].end(), "D18") != variants[v].end();
      const double gbs = ms_ok ? (wbytes + state_bytes_per_token(c, L, f32_kv ? 4 : 2)) / (ms * 1e-3) / 1e9 : 0;
      std::string ab = "[";
      for (size_t i = 0; i < variants[v].size(); ++i) ab += (i ? ",\"" : "\"") + variants[v][i] + "\"";
      ab += "]";
      js << (first ? "" : ",\n") << "    {\"engine\": \"lily\", \"phase\": \"decode\", \"length\": " << L
         << ", \"tok_s_median\": " << med << ", \"tok_s_min\": " << mn << ", \"tok_s_max\": " << mx
         << ", \"ms_per_token_steady\": " << (ms_ok ? fmtd("%.6g", ms) : "null")
         << ", \"achieved_gbs\": " << (ms_ok ? fmtd("%.6g", gbs) : "null") << ", \"rounds\": " << rounds
         << ", \"ablate\": " << ab << "}";
      first = false;
      md << "| " << L << " | " << label(variants[v]) << " | " << fmtd("%.1f", med)
         << " | " << fmtd("%.1f", mn) << " | " << fmtd("%.1f", mx) << " | " << (ms_ok ? fmtd("%.3f", ms) : "n/a") << " | "
         << (ms_ok ? fmtd("%.0f", gbs) : "n/a") << " | "
         << (copy_gbs > 0 && ms_ok ? fmtd("%.0f%%", 100 * gbs / copy_gbs) : "") << " |\n";
    }
  js << "\n  ]";
  if (!balance.empty()) js << ",\n  \"expert_balance\": \"" << balance << "\"";
  js << "\n}\n";
  if (!trace_lines.empty()) {
    md << "\n## " << trace_lines[0] << " (context " << ctxs.front() << ")\n";
    for (size_t i = 1; i < trace_lines.size(); ++i) md << trace_lines[i] << "\n";
  }
  if (!prof_lines.empty()) {
    md << "\n## Per-op time, one eager instrumented step at context " << Lp << " (CUDA events"
       << (o.str("profile-ablate").empty() ? std::string() : ", off: " + o.str("profile-ablate")) << ")\n\n";
    for (const auto& l : prof_lines) md << l << "\n";
  }
  if (!balance.empty()) md << "\nExpert load balance: " << balance << ".\n";
  std::filesystem::create_directories(o.str("out"));
  const std::string stem = o.str("out") + "/" + o.str("tag");
  std::ofstream(stem + ".json") << js.str();
  std::ofstream(stem + ".md") << md.str();
  std::fputs(md.str().c_str(), stdout);
  return 0;
}

RegisterCommand reg{{"bench", "decode / prefill throughput benchmark (BENCHMARK.md)", bench_main}};

}  // namespace
}  // namespace lily
