// `lily bench prefill`: batch-1 prefill throughput per prompt length (BENCHMARK.md) on a fresh state
// per measurement, optionally followed by greedy decode after that real context; matched ablations
// in alternating order, wall and CPU time, peak host (and device) memory; JSON + markdown results.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "backend/backend.h"
#include "bench_common.h"
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

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::string fmtd(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
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
  std::vector<double> tok_s, cpu_s;   // per round
};

// One engine variant: its own backend and model on the CPU (ablations are fixed at creation there);
// on CUDA one backend whose switches are flipped at run time, so the weights are uploaded once.
struct Variant {
  std::vector<std::string> off;
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
             {"chunk", "512", "prefill chunk size in tokens (P5)"},
             {"decode-tokens", "0", "after each prefill, time this many greedy tokens (0 = none)"},
             {"ids", "", "raw int32 token-id file to use as the prompt (default: random ids)"},
             {"seed", "1", "seed of the random prompt ids"},
             {"ablate", "", "optimization ids; each is measured as its own variant (e.g. P1,P5)"},
             {"out", "docs/benchmarks", "directory for the JSON and markdown results"},
             {"tag", "prefill", "file name stem of the results"},
             {"commit", "", "commit recorded in the results", "LILY_COMMIT"}});
  if (!o.parse(argc, argv)) return 0;
  std::string cmdline = "lily bench prefill";
  for (int i = 0; i < argc; ++i) cmdline += std::string(" ") + argv[i];

  const double t_load = wall_s();
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
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  const std::vector<int32_t> ids = prompt_tokens(o.str("ids"), max_len, c.vocab_size, uint64_t(o.i64("seed")));

  std::vector<Variant> vars(1);
  for (const auto& id : split_list(o.str("ablate"))) vars.push_back(Variant{{id}, nullptr, nullptr});
  const std::string backend = o.str("backend");
  ModelOptions mo;
  mo.max_chunk = o.num("chunk");
  for (size_t v = 0; v < vars.size(); ++v) {
    if (backend == "cuda" && v > 0) continue;   // shares variant 0's backend and model
    BackendOptions bo;
    bo.name = backend;
    bo.threads = o.num("threads");
    bo.ablations.off = vars[v].off;
    vars[v].be = make_backend(bo);
    vars[v].model = std::make_unique<Qwen36>(host, *vars[v].be, mo);
  }
  auto engine = [&](size_t v) -> Qwen36& {
    Qwen36& m = *vars[backend == "cuda" ? 0 : v].model;
#ifdef LILY_HAVE_CUDA
    if (backend == "cuda") {
      Ablations a;
      a.off = vars[v].off;
      cuda_tools::set_ablations(m.backend(), a);
    }
#endif
    return m;
  };
  std::fprintf(stderr, "bench prefill: model ready in %.1f s\n", wall_s() - t_load);
  std::string machine = cpu_model_name();
#ifdef LILY_HAVE_CUDA
  if (backend == "cuda") machine = cuda_tools::device_name() + " (host: " + machine + ")";
#endif

  std::vector<float> logits(size_t(c.vocab_size));
  std::vector<int32_t> gen;
  double peak_dev = 0;
  // One measurement: fresh state (allocated and zeroed outside the timing), prompt of L tokens;
  // the clock stops when forward() has returned the last token's logits to the host.
  auto measure = [&](Qwen36& m, int L, int n_dec, Series* pre, Series* dec) {
    auto st = m.new_state(L + n_dec + 1);
    m.backend().synchronize();
    double w0 = wall_s(), c0 = cpu_s();
    m.forward(*st, std::span<const int32_t>(ids.data(), size_t(L)), logits.data(), false);
    m.backend().synchronize();
    double w1 = wall_s(), c1 = cpu_s();
    if (pre) {
      pre->tok_s.push_back(L / (w1 - w0));
      pre->cpu_s.push_back(c1 - c0);
    }
#ifdef LILY_HAVE_CUDA
    if (m.backend().name() == "cuda") peak_dev = std::max(peak_dev, double(cuda_tools::device_bytes(m.backend())));
#endif
    if (n_dec <= 0) return;
    const int32_t first = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    gen.clear();
    w0 = wall_s();
    c0 = cpu_s();
    m.generate_greedy(*st, first, n_dec, gen);
    m.backend().synchronize();
    w1 = wall_s();
    c1 = cpu_s();
    if (dec) {
      dec->tok_s.push_back(n_dec / (w1 - w0));
      dec->cpu_s.push_back(c1 - c0);
    }
  };

  std::map<std::pair<int, size_t>, Series> pre, dec;
  std::map<int, double> peak_host, peak_device;
  for (int L : lengths) {
    for (size_t v = 0; v < vars.size(); ++v) measure(engine(v), L, std::min(N, 8), nullptr, nullptr);   // warm-up
    for (int r = 0; r < rounds; ++r)
      for (size_t k = 0; k < vars.size(); ++k) {
        const size_t v = r % 2 ? vars.size() - 1 - k : k;
        measure(engine(v), L, N, &pre[{L, v}], &dec[{L, v}]);
      }
    peak_host[L] = peak_rss_bytes();
    peak_device[L] = peak_dev;
    std::fprintf(stderr, "bench prefill: %6d tokens  %.1f tok/s (cpu %.3f s)%s\n", L, median_of(pre[{L, 0}].tok_s),
                 median_of(pre[{L, 0}].cpu_s),
                 N > 0 ? fmtd("  decode %.1f tok/s", median_of(dec[{L, 0}].tok_s)).c_str() : "");
  }

  // ---- results ------------------------------------------------------------------------------
  std::time_t tt = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&tt));
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = load[1] = load[2] = -1;
  std::ostringstream js, md;
  js << "{\n  \"date\": \"" << date << "\",\n  \"machine\": \"" << machine << "\",\n  \"commit\": \""
     << o.str("commit") << "\",\n  \"command\": \"" << cmdline << "\",\n  \"model\": \"" << model_name
     << "\",\n  \"backend\": \"" << backend << "\",\n  \"chunk\": " << mo.max_chunk << ",\n  \"load_average_end\": ["
     << load[0] << ", " << load[1] << ", " << load[2] << "],\n  \"notes\": \"prefill tok_s = L / wall time from the "
     << "first token fed to the last token's logits on the host, fresh zeroed state per measurement, warm-up "
     << "discarded; decode tok_s = N / wall time of N greedy tokens after that real prefill; cpu_s = process CPU "
     << "time (all threads) of the same span\",\n  \"results\": [\n";
  md << "# Prefill benchmark (" << date << ")\n\n- machine: " << machine << " (" << backend << " backend)\n- commit: "
     << o.str("commit") << "\n- command: `" << cmdline << "`\n- model: " << model_name
     << "\n- prompt: " << (o.str("ids").empty() ? "random token ids" : "token ids from " + o.str("ids"))
     << ", fresh state per measurement, chunk " << mo.max_chunk << ", median of " << rounds
     << " rounds (variants alternate order), warm-up discarded\n- load average at the end: " << fmtd("%.2f", load[0])
     << " / " << fmtd("%.2f", load[1]) << " / " << fmtd("%.2f", load[2])
     << "\n\n| phase | length | variant | tok/s (median) | min | max | CPU s (median) | peak host MiB | peak device MiB |\n"
     << "|---|---:|---|---:|---:|---:|---:|---:|---:|\n";
  bool first = true;
  auto emit = [&](const char* phase, int L, size_t v, const Series& s) {
    const double med = median_of(s.tok_s), cs = median_of(s.cpu_s);
    const double mn = *std::min_element(s.tok_s.begin(), s.tok_s.end());
    const double mx = *std::max_element(s.tok_s.begin(), s.tok_s.end());
    std::string ab = "[";
    for (size_t i = 0; i < vars[v].off.size(); ++i) ab += (i ? ",\"" : "\"") + vars[v].off[i] + "\"";
    ab += "]";
    js << (first ? "" : ",\n") << "    {\"engine\": \"lily\", \"phase\": \"" << phase << "\", \"length\": " << L
       << ", \"tok_s_median\": " << med << ", \"tok_s_min\": " << mn << ", \"tok_s_max\": " << mx
       << ", \"cpu_s_median\": " << cs << ", \"peak_host_bytes\": " << peak_host[L]
       << ", \"peak_device_bytes\": " << peak_device[L] << ", \"rounds\": " << rounds
       << (phase[0] == 'd' ? ", \"tokens\": " + std::to_string(N) : std::string()) << ", \"ablate\": " << ab << "}";
    first = false;
    md << "| " << phase << " | " << L << " | " << (vars[v].off.empty() ? "all on" : "-" + vars[v].off[0]) << " | "
       << fmtd("%.1f", med) << " | " << fmtd("%.1f", mn) << " | " << fmtd("%.1f", mx) << " | " << fmtd("%.3f", cs)
       << " | " << fmtd("%.0f", peak_host[L] / 1048576.0) << " | "
       << (peak_device[L] > 0 ? fmtd("%.0f", peak_device[L] / 1048576.0) : "") << " |\n";
  };
  for (int L : lengths)
    for (size_t v = 0; v < vars.size(); ++v) emit("prefill", L, v, pre[{L, v}]);
  if (N > 0)
    for (int L : lengths)
      for (size_t v = 0; v < vars.size(); ++v) emit("decode", L, v, dec[{L, v}]);
  js << "\n  ]\n}\n";
  std::filesystem::create_directories(o.str("out"));
  const std::string stem = o.str("out") + "/" + o.str("tag");
  std::ofstream(stem + ".json") << js.str();
  std::ofstream(stem + ".md") << md.str();
  std::fputs(md.str().c_str(), stdout);
  return 0;
}

}  // namespace lily
