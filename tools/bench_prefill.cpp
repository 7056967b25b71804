// `lily bench prefill`: batch-1 prefill throughput per prompt length (BENCHMARK.md) on a fresh state
// per measurement, optionally followed by greedy decode after that real context; matched ablations
// in alternating order, wall and CPU time, peak host memory, device memory split into the state and
// the rest (which must not grow with the prompt once it fills a chunk), expert load balance, and a
// time budget that skips lengths predicted not to fit; JSON + markdown results.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "bench_common.h"
#include "nvml_energy.h"
#include "core/common.h"
#include "core/options.h"
#include "model/op_flops.h"
#include "model/qwen36.h"
#include "model/synthetic.h"
#include "model/weights.h"
#ifdef LILY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace lily {
namespace {

std::string join_ids(const std::vector<std::string>& ids) {   // a variant's label: "P46+P47+P48"
  std::string out;
  for (const std::string& id : ids) out += (out.empty() ? "" : "+") + id;
  return out;
}

double wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Process CPU time (all threads): the secondary metric on a shared machine, where wall time also
// counts other people's work.
double cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) * 1024.0;
}

// JSON string body: quotes, backslashes and control characters escaped.
std::string jesc(const std::string& in) {
  static const char* hex = "0123456789abcdef";
  std::string o;
  for (char ch : in) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (u < 0x20) {
      o += "\\u00";
      o += hex[u >> 4];
      o += hex[u & 15];
    } else {
      o += ch;
    }
  }
  return o;
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto p = line.find(':');
      if (p != std::string::npos) return line.substr(line.find_first_not_of(' ', p + 1));
    }
  return "unknown cpu";
}

// Token ids from a raw little-endian int32 file (the same ids another engine is fed), else random.
std::vector<int32_t> prompt_tokens(const std::string& path, int n, int vocab, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  if (!path.empty()) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw Error("--ids: cannot open " + path);
    f.read(reinterpret_cast<char*>(ids.data()), std::streamsize(4) * n);
    if (f.gcount() != std::streamsize(4) * n)
      throw Error("--ids: " + path + " holds fewer than " + std::to_string(n) + " int32 token ids");
    for (int32_t id : ids)
      if (id < 0 || id >= vocab) throw Error("--ids: " + path + " has id " + std::to_string(id) + " outside the vocabulary");
    return ids;
  }
  std::mt19937_64 rng(seed);
  for (auto& id : ids) id = int32_t(rng() % uint64_t(vocab));
  return ids;
}

struct Series {
  std::vector<double> tok_s, cpu_s, host_s, joules;   // per round (host_s: wall minus the time blocked on the
                                                       // device; joules: the board's energy, when NVML reads it)
};

// One engine variant: its own backend and model on the CPU (ablations are fixed at creation there);
// on CUDA one backend whose switches are flipped at run time, so the weights are uploaded once.
struct Variant {
  std::vector<std::string> off;
  int chunk = 0;   // this variant's prefill chunk (0 = --chunk); set by --chunks, or by P5 off (the longest length)
  std::unique_ptr<Backend> be;
  std::unique_ptr<Qwen36> model;
};

}  // namespace

int bench_prefill_main(int argc, char** argv) {
#ifdef LILY_HAVE_CUDA
  const char* def_backend = "cuda";
#else
  const char* def_backend = "cpu";
#endif
  Options o("bench prefill", "lily bench prefill: batch-1 prefill throughput per prompt length (BENCHMARK.md).",
            {{"model", "", "checkpoint directory (default: full-size synthetic model)", "LILY_MODEL"},
             {"synthetic", "false", "use the synthetic full-size model", "", true},
             {"layers", "40", "synthetic model layers"},
             {"backend", def_backend, "cuda | cpu", "LILY_BACKEND"},
             {"threads", "0", "CPU threads (0 = all cores)", "LILY_THREADS"},
             {"lengths", "256,512,1024,2048,4096,8192,16384,32768,65536,131072", "prompt lengths"},
             {"rounds", "3", "rounds (variants alternate order in each round)"},
             {"chunk", "0", "prefill chunk size in tokens (P5); 0 = 16384 on cuda, 512 on cpu"},
             {"warmup-max", "8192", "warm-up prefill (discarded) of min(L, this) tokens per length and variant; 0 = L"},
             {"max-seconds", "0", "time budget: skip a length whose predicted time would exceed it (0 = none)"},
             {"balance-tokens", "4096", "expert load balance over one untimed prefill of this many tokens (cuda; 0 = none)"},
             {"profile-length", "0", "per-op breakdown (eager, CUDA events) of one prefill of this many tokens (cuda; 0 = none)"},
             {"peak-tflops", "790", "matrix-rate ceiling for the breakdown's % column (bf16 on H200, measured: device KINDS.md)"},
             {"decode-tokens", "0", "after each prefill, time this many greedy tokens (0 = none)"},
             {"cooldown-ms", "0", "idle time before each measured prefill (a board at its power limit recovers; 0 = none)"},
             {"ids", "", "raw int32 token-id file to use as the prompt (default: random ids)"},
             {"seed", "1", "seed of the random prompt ids"},
             {"ablate", "", "optimization ids; each is measured as its own variant (e.g. P1,P5; P5 = the whole prompt as one chunk)"},
             {"chunks", "", "more chunk sizes, each measured as its own variant against --chunk (a tuning sweep of P5)"},
             {"out", "docs/benchmarks", "directory for the JSON and markdown results"},
             {"tag", "prefill", "file name stem of the results"},
             {"commit", "", "commit recorded in the results", "LILY_COMMIT"}});
  if (!o.parse(argc, argv)) return 0;
  std::string cmdline = "lily bench prefill";
  for (int i = 0; i < argc; ++i) cmdline += std::string(" ") + argv[i];
  const double t_start = wall_s();

  const BenchWeights bw =
      load_bench_weights(!o.str("model").empty() && !o.flag("synthetic"), o.str("model"), o.num("layers"));
  const std::shared_ptr<ModelWeights>& host = bw.host;
  const std::string& model_name = bw.name;
  const ModelConfig& c = host->config;
  std::vector<int> lengths = parse_int_list(o.str("lengths"), "--lengths");
  if (lengths.empty()) throw Error("--lengths must list at least one prompt length");
  for (int L : lengths)
    if (L < 1) throw Error("--lengths: " + std::to_string(L) + " is not a positive length");
  const int rounds = o.num("rounds"), N = o.num("decode-tokens");
  if (rounds < 1) throw Error("--rounds must be at least 1");
  if (N < 0) throw Error("--decode-tokens must be >= 0");
  const int warm_max = o.num("warmup-max");
  const int cooldown_ms = o.num("cooldown-ms");
  if (cooldown_ms < 0) throw Error("--cooldown-ms must be >= 0");
  const NvmlEnergy nvml;
  // NVML's energy counter did not move within 25 ms spans and read 750 W over 84 ms ones at a 700 W limit (session
  // 24 call 2): it advances in steps, so only spans of at least half a second get an energy reading.
  constexpr double kMinEnergySpan = 0.5;
  const double budget_s = o.real("max-seconds");
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  const std::vector<int32_t> ids = prompt_tokens(o.str("ids"), max_len, c.vocab_size, uint64_t(o.i64("seed")));

  std::vector<Variant> vars(1);
  // "P46+P47+P48": one variant with the three off (until session 24 this took the whole string as one unknown id, so
  // such variants ran with everything on).
  for (const auto& id : split_list(o.str("ablate"))) vars.push_back(Variant{Ablations::variant(id).off, 0, nullptr, nullptr});
  const std::string backend = o.str("backend");
  const bool cuda = backend == "cuda";
  ModelOptions mo;
  mo.max_chunk = o.num("chunk") > 0 ? o.num("chunk") : default_prefill_chunk(cuda ? "cuda" : "cpu");
  // Variants with their own chunk: P5 off (--ablate P5) is the whole prompt as one chunk, i.e. a model whose buffers
  // and workspace are sized for the longest length measured; --chunks adds one variant per chunk size. On cuda each
  // such variant is a second model on the shared backend: another copy of the weights.
  auto p5_off = [](const Variant& v) { return std::find(v.off.begin(), v.off.end(), "P5") != v.off.end(); };
  const int whole_chunk = std::max(mo.max_chunk, max_len);
  for (Variant& v : vars)
    if (p5_off(v)) v.chunk = whole_chunk;
  for (int ch : parse_int_list(o.str("chunks"), "--chunks")) {
    if (ch < 1) throw Error("--chunks: " + std::to_string(ch) + " is not a positive chunk size");
    if (ch != mo.max_chunk) vars.push_back(Variant{{}, ch, nullptr, nullptr});
  }
  auto chunk_of = [&](const Variant& v) { return v.chunk > 0 ? v.chunk : mo.max_chunk; };
  bool own_chunk = false;   // some variant runs with another chunk than --chunk
  for (size_t v = 0; v < vars.size(); ++v) {
    ModelOptions mv = mo;
    mv.max_chunk = chunk_of(vars[v]);
    own_chunk = own_chunk || mv.max_chunk != mo.max_chunk;
    if (cuda && v > 0) {   // shares variant 0's backend (and, with the same chunk, its model)
      if (mv.max_chunk != mo.max_chunk) vars[v].model = std::make_unique<Qwen36>(host, *vars[0].be, mv);
      continue;
    }
    BackendOptions bo;
    bo.name = backend;
    bo.threads = o.num("threads");
    bo.ablations.off = vars[v].off;
    vars[v].be = make_backend(bo);
    vars[v].model = std::make_unique<Qwen36>(host, *vars[v].be, mv);
  }
  auto label = [&](const Variant& v) {
    std::string s = v.off.empty() ? std::string() : "-" + join_ids(v.off);
    if (v.chunk > 0 && !p5_off(v)) {
      if (!s.empty()) s += ' ';
      s += "chunk " + std::to_string(v.chunk);
    }
    return s.empty() ? std::string("all on") : s;
  };
  auto engine = [&](size_t v) -> Qwen36& {
    Qwen36& m = *(vars[v].model ? vars[v].model : vars[0].model);
#ifdef LILY_HAVE_CUDA
    if (cuda) {
      Ablations a;
      a.off = vars[v].off;
      cuda_tools::set_ablations(m.backend(), a);
    }
#endif
    return m;
  };
  auto dev_bytes = [&](Backend& be) -> double {
#ifdef LILY_HAVE_CUDA
    if (be.name() == "cuda") return double(cuda_tools::device_bytes(be));
#endif
    (void)be;
    return 0;
  };
  std::fprintf(stderr, "bench prefill: model ready in %.1f s (chunk %d)\n", wall_s() - t_start, mo.max_chunk);
  std::string machine = cpu_model_name();
#ifdef LILY_HAVE_CUDA
  if (cuda) machine = cuda_tools::device_name() + " (host: " + machine + ")";
#endif

  std::vector<float> logits(size_t(c.vocab_size));
  std::vector<int32_t> gen;
  // Device bytes of the current length: peak (weights + buffers + workspace + state), the state
  // alone, and the rest (must stay constant once the prompt is longer than a chunk).
  struct Mem {
    double peak = 0, state = 0, rest = 0;
  } mem;
  // Runs f and waits for the device; into out (when given): tokens / wall time, CPU time, host time (wall minus the
  // time blocked on the device) and energy. The energy readings bracket the span from outside: an NVML call takes
  // milliseconds (session 24 calls 2-4 read it inside the span and lost ~2.6 ms per prefill).
  auto timed = [&](Backend& be, int tokens, Series* out, const std::function<void()>& f) {
    const double e0 = nvml.joules();
    const double w0 = wall_s(), c0 = cpu_s(), b0 = be.host_wait_s();
    f();
    be.synchronize();
    const double w1 = wall_s(), c1 = cpu_s(), b1 = be.host_wait_s();
    const double e1 = nvml.joules();
    if (!out) return;
    out->tok_s.push_back(tokens / (w1 - w0));
    out->cpu_s.push_back(c1 - c0);
    out->host_s.push_back((w1 - w0) - (b1 - b0));
    if (e0 >= 0 && e1 >= 0 && w1 - w0 >= kMinEnergySpan) out->joules.push_back(e1 - e0);
  };
  // One measurement: fresh state (allocated and zeroed outside the timing), prompt of L tokens;
  // the clock stops when forward() has returned the last token's logits to the host.
  auto measure = [&](Qwen36& m, int L, int n_dec, Series* pre, Series* dec) {
    const double before = dev_bytes(m.backend());
    auto st = m.new_state(L + n_dec + 1);
    m.backend().synchronize();
    const double state = dev_bytes(m.backend()) - before;
    if (cooldown_ms > 0 && pre) std::this_thread::sleep_for(std::chrono::milliseconds(cooldown_ms));
    timed(m.backend(), L, pre, [&] {
      m.forward(*st, std::span<const int32_t>(ids.data(), size_t(L)), logits.data(), false);
    });
    const double after = dev_bytes(m.backend());
    mem.peak = std::max(mem.peak, after);
    mem.state = std::max(mem.state, state);
    mem.rest = std::max(mem.rest, after - state);
    if (n_dec <= 0) return;
    const int32_t first = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    gen.clear();
    timed(m.backend(), n_dec, dec, [&] { m.generate_greedy(*st, first, n_dec, gen); });
  };

  std::map<std::pair<int, size_t>, Series> pre, dec;
  // Each variant's last-token logits against variant 0's (same prompt, fresh state): a chunk variant must agree
  // (another chunk only moves where the prompt is cut); an ablation may differ by its own rounding.
  struct Agree {
    double cosine = 0;
    bool argmax_same = false;
  };
  std::map<std::pair<int, size_t>, Agree> agree;
  std::vector<std::vector<float>> last_logits(vars.size());
  std::map<int, double> peak_host;
  std::map<int, Mem> mem_at;
  std::vector<int> done, skipped;
  int prev_L = 0;
  double prev_s = 0;
  for (int L : lengths) {
    // Budget: the previous length's time scaled by the length ratio, +25% for attention's growth.
    // The first length always runs, so every run reports something.
    const double elapsed = wall_s() - t_start;
    const double predicted = prev_L > 0 ? prev_s * double(L) / prev_L * 1.25 : 0;
    if (budget_s > 0 && prev_L > 0 && elapsed + predicted > budget_s) {
      std::fprintf(stderr, "bench prefill: %6d tokens skipped (predicted %.1f s, %.1f s of %g s used)\n", L,
                   predicted, elapsed, budget_s);
      skipped.push_back(L);
      continue;
    }
    const double t0 = wall_s();
    mem = Mem{};
    const int Lw = warm_max > 0 ? std::min(L, warm_max) : L;
    for (size_t v = 0; v < vars.size(); ++v) measure(engine(v), Lw, std::min(N, 8), nullptr, nullptr);   // warm-up
    for (int r = 0; r < rounds; ++r)
      for (size_t k = 0; k < vars.size(); ++k) {
        const size_t v = r % 2 ? vars.size() - 1 - k : k;
        measure(engine(v), L, N, &pre[{L, v}], &dec[{L, v}]);
        last_logits[v] = logits;   // the prefill's last-token logits (the greedy decode after it has its own)
      }
    for (size_t v = 1; v < vars.size(); ++v) {
      const std::vector<float>&a = last_logits[0], &b = last_logits[v];
      double ab = 0, aa = 0, bb = 0;
      for (size_t i = 0; i < a.size(); ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
      const Agree g{ab / std::sqrt(std::max(aa * bb, 1e-300)),
                    std::max_element(a.begin(), a.end()) - a.begin() == std::max_element(b.begin(), b.end()) - b.begin()};
      agree[{L, v}] = g;
      std::fprintf(stderr, "bench prefill: %6d tokens  %s: last-token logits vs %s cosine %.6f, argmax %s\n", L,
                   label(vars[v]).c_str(), label(vars[0]).c_str(), g.cosine, g.argmax_same ? "same" : "DIFFERENT");
    }
    peak_host[L] = peak_rss_bytes();
    mem_at[L] = mem;
    done.push_back(L);
    prev_L = L;
    prev_s = wall_s() - t0;
    std::fprintf(stderr, "bench prefill: %6d tokens  %.1f tok/s (cpu %.3f s, host %.4f s%s)%s  [%.1f s, device %.0f MiB: state %.0f + rest %.0f]\n",
                 L, median_of(pre[{L, 0}].tok_s), median_of(pre[{L, 0}].cpu_s), median_of(pre[{L, 0}].host_s),
                 pre[{L, 0}].joules.empty() ? "" : fmtd(", %.2f J", median_of(pre[{L, 0}].joules)).c_str(),
                 N > 0 ? fmtd("  decode %.1f tok/s", median_of(dec[{L, 0}].tok_s)).c_str() : "", prev_s,
                 mem.peak / 1048576.0, mem.state / 1048576.0, mem.rest / 1048576.0);
  }
  engine(0);   // all optimizations back on

  // Non-state device memory (weights, activation buffers, workspace) must not depend on the prompt
  // length once the prompt fills a whole chunk: the workspace is sized by the chunk.
  bool ws_constant = true;
  double ws_bytes = -1;
  int ws_from = 0;
  for (int L : done)
    if (L >= mo.max_chunk) {
      if (ws_bytes < 0) ws_bytes = mem_at[L].rest, ws_from = L;
      ws_constant = ws_constant && mem_at[L].rest == ws_bytes;
    }
  std::string ws_note;
  if (cuda && ws_bytes >= 0)
    ws_note = "device memory other than the state (weights, buffers, workspace) at lengths " + std::to_string(ws_from) +
              "…" + std::to_string(done.back()) + ": " +
              (ws_constant ? "constant, " + fmtd("%.0f", ws_bytes / 1048576.0) + " MiB"
                           : std::string("NOT constant (see the per-length rows)"));

  // Expert load balance over one untimed prefill (BENCHMARK.md: report it with every synthetic run).
  std::string balance;
#ifdef LILY_HAVE_CUDA
  const int Tb = std::min(o.num("balance-tokens"), max_len);
  if (cuda && Tb > 0) {
    Qwen36& m = engine(0);
    auto st = m.new_state(Tb + 1);
    cuda_tools::set_expert_histogram(m.backend(), true);
    m.forward(*st, std::span<const int32_t>(ids.data(), size_t(Tb)), logits.data(), false);
    auto hist = cuda_tools::expert_histogram(m.backend());
    cuda_tools::set_expert_histogram(m.backend(), false);
    double worst = 0, mean_ratio = 0, total = 0;
    for (const auto& h : hist) {
      double tot = 0, mx = 0;
      for (auto x : h) tot += double(x), mx = std::max(mx, double(x));
      const double ratio = tot > 0 ? mx / tot * double(h.size()) : 0;
      worst = std::max(worst, ratio);
      mean_ratio += ratio / double(hist.size());
      total += tot;
    }
    const double K = c.num_experts_per_tok, E = c.num_experts;
    balance = total <= 0 ? "not counted (the prefill MoE path keeps no histogram)"
                         : "busiest expert's share / uniform share over " + std::to_string(Tb) +
                               " prompt tokens: mean over layers " + fmtd("%.2f", mean_ratio) + ", worst layer " +
                               fmtd("%.2f", worst) + " (uniform routing gives ≈" +
                               fmtd("%.2f", 1 + 3 * std::sqrt(E / (K * Tb))) + " by chance)";
    // Tile padding of the grouped expert GEMMs (P3): rows computed / rows routed when each expert's rows
    // are cut into M-tiles of 64 or 128, or into tiles of <= 128 rows rounded up to 16 (exact-N tiles).
    if (total > 0) {
      double ex64 = 0, ex128 = 0, ex16 = 0, t128 = 0;
      for (const auto& h : hist)
        for (auto x : h) {
          const double n = double(x);
          ex64 += std::ceil(n / 64) * 64;
          ex128 += std::ceil(n / 128) * 128;
          ex16 += std::floor(n / 128) * 128 + std::ceil(std::fmod(n, 128.0) / 16) * 16;
          t128 += std::ceil(n / 128);
        }
      balance += "; routed rows computed / routed at M-tile 64: " + fmtd("%.3f", ex64 / total) + ", 128: " +
                 fmtd("%.3f", ex128 / total) + ", <=128 rounded to 16: " + fmtd("%.3f", ex16 / total) +
                 " (128-tiles per layer " + fmtd("%.1f", t128 / double(hist.size())) + ")";
    }
    std::fprintf(stderr, "bench prefill: expert balance: %s\n", balance.c_str());
  }
#endif

  // Per-op breakdown of one prefill (eager; each op between CUDA events, so the sum exceeds the timed
  // run by the events' cost): where the prefill time goes, op by op.
  std::vector<std::string> prof_lines;
#ifdef LILY_HAVE_CUDA
  const int Lp = std::min(o.num("profile-length"), max_len);
  if (cuda && Lp > 0) {
    Qwen36& m = engine(0);
    auto st = m.new_state(Lp + 1);
    m.forward(*st, std::span<const int32_t>(ids.data(), size_t(Lp)), logits.data(), false);   // warm
    st = m.new_state(Lp + 1);
    cuda_tools::set_profiling(m.backend(), true);
    m.forward(*st, std::span<const int32_t>(ids.data(), size_t(Lp)), logits.data(), false);
    auto prof = cuda_tools::take_profile(m.backend());
    cuda_tools::set_profiling(m.backend(), false);
    double total = 0;   // (take_profile sorts by time, largest first)
    for (const auto& p : prof) total += p.ms;
    // Achieved rate of the ops with a useful-FLOP count (model/op_flops.h) against --peak-tflops.
    const double peak = std::max(o.real("peak-tflops"), 1e-9);
    prof_lines.push_back("| op (prefill of " + std::to_string(Lp) + " tokens) | calls | ms | share | useful TFLOP/s | % of " +
                         fmtd("%g", peak) + " |");
    prof_lines.push_back("|---|---:|---:|---:|---:|---:|");
    for (const auto& p : prof) {
      const double fl = prefill_op_flops(p.name, c, Lp, p.calls), tf = fl / (p.ms * 1e-3) / 1e12;
      prof_lines.push_back("| " + p.name + " | " + std::to_string(p.calls) + " | " + fmtd("%.3f", p.ms) + " | " +
                           fmtd("%.1f%%", 100 * p.ms / std::max(total, 1e-9)) + " | " +
                           (fl > 0 && p.ms > 0 ? fmtd("%.1f", tf) + " | " + fmtd("%.1f%%", 100 * tf / peak) : " | ") +
                           " |");
    }
    prof_lines.push_back("| **sum of ops (eager, between events)** | | " + fmtd("%.3f", total) + " | | | |");
    for (const auto& l : prof_lines) std::fprintf(stderr, "bench prefill: %s\n", l.c_str());
  }
#endif

  // ---- results ------------------------------------------------------------------------------
  std::time_t tt = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&tt));
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = load[1] = load[2] = -1;
  auto int_list = [](const std::vector<int>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  std::ostringstream js, md;
  js << "{\n  \"date\": \"" << date << "\",\n  \"machine\": \"" << jesc(machine) << "\",\n  \"commit\": \""
     << jesc(o.str("commit")) << "\",\n  \"command\": \"" << jesc(cmdline) << "\",\n  \"model\": \"" << jesc(model_name)
     << "\",\n  \"backend\": \"" << backend << "\",\n  \"chunk\": " << mo.max_chunk << ",\n  \"warmup_max\": " << warm_max
     << ",\n  \"max_seconds\": " << budget_s << ",\n  \"total_seconds\": " << fmtd("%.1f", wall_s() - t_start)
     << ",\n  \"skipped_lengths\": " << int_list(skipped) << ",\n  \"load_average_end\": [" << load[0] << ", "
     << load[1] << ", " << load[2] << "],\n  \"workspace_constant\": " << (ws_constant ? "true" : "false")
     << ",\n  \"workspace_note\": \"" << jesc(ws_note) << "\",\n  \"expert_balance\": \"" << jesc(balance)
     << "\",\n  \"notes\": \"prefill tok_s = L / wall time from the first token fed to the last token's logits on "
     << "the host, fresh zeroed state per measurement (capacity L + decode tokens + 1), warm-up of min(L, warmup_max) "
     << "tokens per length and variant discarded; decode tok_s = N / wall time of N greedy tokens after that real "
     << "prefill; cpu_s = process CPU time (all threads) of the same span; host_s = the span's wall time minus the time the "
     << "host was blocked waiting for the device (the host's own work: enqueueing, copies; on cpu the whole span); joules = the "
     << "GPU board's energy over the same span (NVML; absent without it or for spans under 0.5 s, where its counter's steps "
     << "dominate), watts = joules / wall time; state_device_bytes = KV cache + conv + "
     << "recurrent state, rest_device_bytes = all other device memory after the prefill\",\n  \"results\": [\n";
  md << "# Prefill benchmark (" << date << ")\n\n- machine: " << machine << " (" << backend << " backend)\n- commit: "
     << o.str("commit") << "\n- command: `" << cmdline << "`\n- model: " << model_name
     << "\n- prompt: " << (o.str("ids").empty() ? "random token ids" : "token ids from " + o.str("ids"))
     << ", fresh state per measurement, chunk " << mo.max_chunk << ", median of " << rounds
     << " rounds (variants alternate order), warm-up of min(L, " << warm_max << ") tokens discarded\n- load average at the end: "
     << fmtd("%.2f", load[0]) << " / " << fmtd("%.2f", load[1]) << " / " << fmtd("%.2f", load[2]) << "\n";
  if (nvml.ok()) md << "- GPU board power limit: " << fmtd("%.0f", nvml.power_limit_w()) << " W (NVML)\n";
  if (cooldown_ms > 0) md << "- idle " << cooldown_ms << " ms before each measured prefill (--cooldown-ms)\n";
  if (std::any_of(vars.begin(), vars.end(), p5_off))
    md << "- P5 off: the whole prompt as one chunk (a model with buffers and workspace for " << whole_chunk << " tokens)\n";
  if (own_chunk)
    md << "- variants with another chunk run their own model" << (cuda ? " on the shared backend, each with its own copy of "
       "the weights on the device: the device-memory columns count every model" : "") << "\n";
  if (!skipped.empty())
    md << "- skipped (predicted to exceed --max-seconds " << fmtd("%g", budget_s) << " s): " << int_list(skipped) << "\n";
  if (!ws_note.empty()) md << "- " << ws_note << "\n";
  if (!balance.empty()) md << "- expert load balance: " << balance << "\n";
  if (!agree.empty()) {
    md << "- last-token logits of each variant vs " << label(vars[0]) << " (same prompt, last round):";
    for (const auto& [k, g] : agree)
      md << " " << label(vars[k.second]) << " at " << k.first << ": cosine " << fmtd("%.6f", g.cosine) << ", argmax "
         << (g.argmax_same ? "same" : "DIFFERENT") << ";";
    md << "\n";
  }
  md << "\n| phase | length | variant | tok/s (median) | min | max | CPU s (median) | host s (median) | J (median) | W (median) | peak host MiB | peak device MiB "
     << "| state MiB | rest MiB |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  bool first = true;
  auto emit = [&](const char* phase, int L, size_t v, const Series& s) {
    const double med = median_of(s.tok_s), cs = median_of(s.cpu_s);
    const double hs = s.host_s.empty() ? 0.0 : median_of(s.host_s);
    // Watts per round (its joules over its wall time: tok_s is L / wall, or N / wall for decode).
    std::vector<double> watts;
    for (size_t i = 0; i < s.joules.size() && i < s.tok_s.size(); ++i)
      watts.push_back(s.joules[i] * s.tok_s[i] / double(phase[0] == 'd' ? N : L));
    const std::string jm = s.joules.empty() ? "" : fmtd("%.3f", median_of(s.joules));
    const std::string wm = watts.empty() ? "" : fmtd("%.0f", median_of(watts));
    const double mn = *std::min_element(s.tok_s.begin(), s.tok_s.end());
    const double mx = *std::max_element(s.tok_s.begin(), s.tok_s.end());
    const Mem& mm = mem_at[L];
    std::string ab = "[";
    for (size_t i = 0; i < vars[v].off.size(); ++i) ab += (i ? ",\"" : "\"") + vars[v].off[i] + "\"";
    ab += "]";
    js << (first ? "" : ",\n") << "    {\"engine\": \"lily\", \"phase\": \"" << phase << "\", \"length\": " << L
       << ", \"tok_s_median\": " << med << ", \"tok_s_min\": " << mn << ", \"tok_s_max\": " << mx
       << ", \"cpu_s_median\": " << cs << ", \"host_s_median\": " << hs
       << (jm.empty() ? std::string() : ", \"joules_median\": " + jm + ", \"watts_median\": " + wm) << ", \"peak_host_bytes\": " << peak_host[L]
       << ", \"peak_device_bytes\": " << mm.peak << ", \"state_device_bytes\": " << mm.state
       << ", \"rest_device_bytes\": " << mm.rest << ", \"rounds\": " << rounds << ", \"chunk\": " << chunk_of(vars[v])
       << (phase[0] == 'p' && agree.count({L, v}) ? ", \"logits_cosine_vs_first\": " + fmtd("%.6f", agree[{L, v}].cosine) +
                                                      ", \"argmax_same_as_first\": " + (agree[{L, v}].argmax_same ? "true" : "false")
                                                : std::string())
       << (phase[0] == 'd' ? ", \"tokens\": " + std::to_string(N) : std::string()) << ", \"ablate\": " << ab << "}";
    first = false;
    auto mib = [](double b) { return b > 0 ? fmtd("%.0f", b / 1048576.0) : std::string(); };
    md << "| " << phase << " | " << L << " | " << label(vars[v]) << " | "
       << fmtd("%.1f", med) << " | " << fmtd("%.1f", mn) << " | " << fmtd("%.1f", mx) << " | " << fmtd("%.3f", cs)
       << " | " << fmtd("%.4f", hs) << " | " << jm << " | " << wm << " | " << fmtd("%.0f", peak_host[L] / 1048576.0) << " | " << mib(mm.peak) << " | " << mib(mm.state) << " | "
       << mib(mm.rest) << " |\n";
  };
  for (int L : done)
    for (size_t v = 0; v < vars.size(); ++v) emit("prefill", L, v, pre[{L, v}]);
  if (N > 0)
    for (int L : done)
      for (size_t v = 0; v < vars.size(); ++v) emit("decode", L, v, dec[{L, v}]);
  js << "\n  ]\n}\n";
  std::filesystem::create_directories(o.str("out"));
  const std::string stem = o.str("out") + "/" + o.str("tag");
  if (!prof_lines.empty()) {
    md << "\n";
    for (const auto& l : prof_lines) md << l << "\n";
  }
  std::ofstream(stem + ".json") << js.str();
  std::ofstream(stem + ".md") << md.str();
  std::fputs(md.str().c_str(), stdout);
  return 0;
}

}  // namespace lily
