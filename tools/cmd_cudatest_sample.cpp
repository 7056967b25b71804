// `lily cuda-test-sample`: the device sample op (D2) against the cpu one. 1. Parity: the same
// logits (peaked, flat, tied, masked, degenerate rows at the real vocabulary) through both backends
// for many (temperature, top-k, top-p, min-p, penalties, logit_bias, n_valid, seed) combinations,
// several chained steps each (penalty counts and the draw counter carried on the device): every
// pick, the final counts and the counter must be identical. 2. Time of one op (captured, replayed)
// per path. 3. End to end on a synthetic model: Qwen36::generate at temperature 0 equals
// generate_greedy over 64 tokens, the consumed-token count is exact, decode ms/token with and
// without sampling. Exits non-zero on any mismatch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
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
double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int last_path(Backend& be) {
#ifdef LILY_HAVE_CUDA
  return cuda_tools::last_sample_path(be);
#else
  return -1;
#endif
}

const char* kDistNames[] = {"peaked", "flat", "tied", "masked", "spike", "all-equal", "gauss"};

std::vector<float> make_row(int dist, int V, std::mt19937& rng) {
  std::vector<float> l(V);
  std::normal_distribution<float> g(0.0f, 2.5f);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  switch (dist) {
    case 0:   // an LLM-like row: gaussian body, a few strong candidates holding most of the mass
      for (auto& x : l) x = 0.6f * g(rng);
      for (int i = 0; i < 20; ++i) l[rng() % V] = 16.0f + 5.0f * (u(rng) + 1.0f) / 2;
      break;
    case 1:   // flat: huge nucleus (radix fallback for top-p)
      for (auto& x : l) x = u(rng);
      break;
    case 2:   // values on a 0.5 grid: many exact ties
      for (auto& x : l) x = 0.5f * float(int(rng() % 17) - 8);
      break;
    case 3:   // masked: -inf and NaN entries
      for (auto& x : l) x = g(rng);
      for (int i = 0; i < V / 3; ++i) l[rng() % V] = -INFINITY;
      for (int i = 0; i < 5; ++i) l[rng() % V] = NAN;
      break;
    case 4:   // one dominant token
      for (auto& x : l) x = g(rng);
      l[rng() % V] = 40.0f;
      break;
    case 5:   // all equal
      std::fill(l.begin(), l.end(), 0.0f);
      break;
    default:  // plain gaussian with a wide spread
      for (auto& x : l) x = 2.0f * g(rng);
      break;
  }
  return l;
}

struct Combo {
  int dist;
  SampleConfig cfg;
  bool seed_prompt;
  std::string text;
};

// The decode MoE top-k (router logits -> k expert ids, largest first, ties to the lower index, as
// the cpu backend's top-k) on the device, both forms (D27 on and off), against a host reference on
// rows with exact ties, -0/+0, infinities and E below 256. Returns the number of mismatching rows.
int check_moe_topk(std::mt19937& rng) {
#ifdef LILY_HAVE_CUDA
  int bad = 0, rows_total = 0;
  for (int E : {256, 255, 128, 64, 9}) {
    for (int K : {8, 4, 1}) {
      if (K > E) continue;
      const int rows = 96;
      std::vector<float> lg(size_t(rows) * E);
      std::normal_distribution<float> g(0.0f, 1.5f);
      for (int r = 0; r < rows; ++r) {
        float* l = lg.data() + size_t(r) * E;
        const int kind = r % 6;
        for (int e = 0; e < E; ++e) {
          switch (kind) {
            case 0: l[e] = g(rng); break;                                      // distinct values
            case 1: l[e] = 0.25f * float(int(rng() % 9) - 4); break;            // many exact ties
            case 2: l[e] = 1.0f; break;                                        // all equal
            case 3: l[e] = (rng() % 3 == 0) ? -INFINITY : g(rng); break;       // masked experts
            case 4: l[e] = (rng() % 2) ? 0.0f : -0.0f; break;                  // signed zeros tie
            default: l[e] = (rng() % 4 == 0) ? 3.0f : g(rng) - 4.0f; break;    // ties at the top
          }
        }
        if (kind == 3) l[rng() % E] = INFINITY;
      }
      std::vector<int> ref(size_t(rows) * K);
      for (int r = 0; r < rows; ++r) {
        std::vector<int> idx(E);
        for (int e = 0; e < E; ++e) idx[e] = e;
        const float* l = lg.data() + size_t(r) * E;
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return l[a] > l[b]; });
        for (int k = 0; k < K; ++k) ref[size_t(r) * K + k] = idx[k];
      }
      for (bool lanes : {false, true}) {
        const std::vector<int> got = cuda_tools::moe_topk_ids(lg, rows, E, K, lanes);
        int rb = 0;
        for (int r = 0; r < rows; ++r)
          if (!std::equal(got.begin() + size_t(r) * K, got.begin() + size_t(r + 1) * K, ref.begin() + size_t(r) * K))
            ++rb;
        rows_total += rows;
        bad += rb;
        if (rb) std::printf("  moe top-k E=%d K=%d %s: %d of %d rows differ from the reference  FAIL\n", E, K,
                            lanes ? "one warp (D27)" : "two rounds (D27 off)", rb, rows);
      }
    }
  }
  std::printf("  moe top-k (both forms, %d rows: ties, -0/+0, infinities, E < 256): %s\n", rows_total,
              bad ? "FAIL" : "ok");
  return bad;
#else
  (void)rng;
  return 0;
#endif
}

int test_sample_main(int argc, char** argv) {
  Options o("cuda-test-sample", "Compare the cuda sample op (and the sampling decode loop) with the cpu one.",
            {{"vocab", "248320", "logits per row"},
             {"steps", "4", "chained picks per combination"},
             {"combos", "300", "random parameter combinations"},
             {"seeds", "200", "extra single-pick checks with distinct seeds"},
             {"seed", "1", "random seed of the test"},
             {"iters", "300", "replays per timing"},
             {"layers", "4", "end-to-end synthetic model layers (0 = skip)"},
             {"tokens", "64", "end-to-end decode tokens"},
             {"verbose", "false", "print every combination", "", true}});
  if (!o.parse(argc, argv)) return 0;
  BackendOptions cpu_opt, cuda_opt;
  cuda_opt.name = "cuda";
  auto cpu = make_backend(cpu_opt);
  auto gpu = make_backend(cuda_opt);
  const int V = o.num("vocab"), steps = o.num("steps");
  const bool verbose = o.flag("verbose");
  std::mt19937 rng(uint32_t(o.i64("seed")));

  // Device buffers of the op.
  float* d_logits = gpu->alloc(V);
  int32_t* d_counts = gpu->alloc_i32(V);
  int32_t* d_id = gpu->alloc_i32(1);
  auto* d_cfg = reinterpret_cast<SampleConfig*>(gpu->alloc_i32((sizeof(SampleConfig) + 3) / 4));

  // ---- 1. parity ---------------------------------------------------------------------------
  const int n_dist = 7;
  std::vector<std::vector<float>> rows;
  for (int d = 0; d < n_dist; ++d) rows.push_back(make_row(d, V, rng));
  std::vector<int32_t> prompt(300);
  for (auto& t : prompt) t = int32_t(rng() % uint32_t(V));
  struct Trunc {
    int k;
    float p, m;
  };
  const Trunc truncs[] = {{0, 1.0f, 0.0f}, {0, 0.95f, 0.0f}, {0, 0.8f, 0.0f},   {20, 1.0f, 0.0f},
                          {20, 0.8f, 0.0f}, {64, 0.95f, 0.05f}, {1000, 0.9f, 0.0f}, {5000, 1.0f, 0.0f},
                          {0, 1.0f, 0.1f}, {0, 0.9f, 0.02f}, {1, 1.0f, 0.0f},   {0, 0.5f, 0.0f},
                          {3, 1.0f, 0.0f}, {0, 0.999f, 0.0f}};
  const float temps[] = {0.0f, 0.3f, 0.6f, 1.0f, 1.5f, 3.0f};
  std::vector<Combo> combos;
  for (int i = 0; i < o.num("combos"); ++i) {
    Combo c;
    c.dist = int(rng() % n_dist);
    const Trunc t = truncs[rng() % (sizeof(truncs) / sizeof(truncs[0]))];
    const float temp = temps[rng() % 6];
    const bool pen = rng() % 2;
    c.cfg = make_sample_config(temp, t.p, t.k, t.m, pen ? 0.5f : 0.0f, pen ? 0.3f : 0.0f, pen ? 1.3f : 1.0f,
                               rng(), rng() % 4 == 0 ? V - 100 : 0);
    if (rng() % 3 == 0) {
      c.cfg.n_bias = 1 + int(rng() % 8);
      for (int j = 0; j < c.cfg.n_bias; ++j) {
        c.cfg.bias_id[j] = int32_t(rng() % uint32_t(V));
        c.cfg.bias[j] = j == 0 ? 100.0f * ((rng() % 2) ? 1.0f : -1.0f) : float(int(rng() % 11) - 5);
      }
    }
    c.seed_prompt = pen;
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s T=%.2f top_k=%d top_p=%.3f min_p=%.2f pen=%d bias=%d n_valid=%d",
                  kDistNames[c.dist], temp, t.k, t.p, t.m, int(pen), c.cfg.n_bias, c.cfg.n_valid);
    c.text = buf;
    combos.push_back(c);
  }
  // Many seeds on two configurations (one pick each).
  for (int i = 0; i < o.num("seeds"); ++i) {
    Combo c;
    c.dist = i % 2 ? 0 : 6;
    c.cfg = make_sample_config(1.0f, i % 2 ? 0.95f : 1.0f, i % 4 == 1 ? 40 : 0, 0.0f, 0, 0, 1, 1000 + i, 0);
    c.seed_prompt = false;
    c.text = std::string(kDistNames[c.dist]) + " seed " + std::to_string(1000 + i);
    combos.push_back(c);
  }
  int mismatches = 0, picks = 0;
  std::map<int, int> path_hist;
  std::vector<int32_t> zero(V, 0), seeded(V, 0);
  for (int32_t t : prompt) seeded[t] = 1;
  int uploaded = -1;
  const auto t_parity = Clock::now();
  for (size_t ci = 0; ci < combos.size(); ++ci) {
    const Combo& c = combos[ci];
    const std::vector<float>& l = rows[c.dist];
    if (uploaded != c.dist) {
      gpu->copy_from_host(d_logits, l.data(), 4LL * V);
      uploaded = c.dist;
    }
    SampleConfig hc = c.cfg;
    std::vector<int32_t> hcounts = c.seed_prompt ? seeded : zero;
    gpu->copy_from_host(d_cfg, &c.cfg, sizeof(SampleConfig));
    gpu->copy_from_host(d_counts, hcounts.data(), 4LL * V);
    const int n_steps = ci < size_t(o.num("combos")) ? steps : 1;
    bool bad = false;
    std::string trace;
    for (int s = 0; s < n_steps; ++s) {
      int32_t a = -1, b = -1;
      cpu->sample(l.data(), V, &hc, hcounts.data(), &a);
      gpu->sample(d_logits, V, d_cfg, d_counts, d_id);
      gpu->copy_to_host(&b, d_id, 4);
      const int path = last_path(*gpu);
      path_hist[path]++;
      ++picks;
      trace += " " + std::to_string(a) + (a == b ? "" : "/" + std::to_string(b)) + "[p" + std::to_string(path) + "]";
      if (a != b) bad = true;
    }
    SampleConfig dc;
    std::vector<int32_t> dcounts(V);
    gpu->copy_to_host(&dc, d_cfg, sizeof(SampleConfig));
    gpu->copy_to_host(dcounts.data(), d_counts, 4LL * V);
    const bool state_ok = dc.step == hc.step && dcounts == hcounts;
    if (bad || !state_ok) ++mismatches;
    if (verbose || bad || !state_ok)
      std::printf("  %s %-78s picks cpu/cuda:%s%s\n", bad || !state_ok ? "MISMATCH" : "ok      ", c.text.c_str(),
                  trace.c_str(), state_ok ? "" : "  (counts/step differ)");
  }
  const double parity_s = secs(t_parity, Clock::now());
  std::printf("cuda-test-sample: vocab %d, %zu combinations, %d picks compared in %.1f s: %d mismatching\n", V,
              combos.size(), picks, parity_s, mismatches);
  std::printf("  paths taken (0 greedy, 1 index-order draw, 2 sorted candidates, 3 radix fallback):");
  for (auto [p, n] : path_hist) std::printf(" p%d=%d", p, n);
  std::printf("\n");

  // ---- 2. timing of one op -------------------------------------------------------------------
  struct TimeCase {
    const char* name;
    int dist;
    SampleConfig cfg;
  };
  const TimeCase tcs[] = {
      {"greedy (T=0)", 0, make_sample_config(0.0f, 1.0f, 0, 0.0f, 0, 0, 1, 1, 0)},
      {"plain T=1", 0, make_sample_config(1.0f, 1.0f, 0, 0.0f, 0, 0, 1, 1, 0)},
      {"T=0.7 top_k=20 top_p=0.8", 0, make_sample_config(0.7f, 0.8f, 20, 0.0f, 0, 0, 1, 1, 0)},
      {"T=0.6 top_k=20 top_p=0.95 +penalties", 0, make_sample_config(0.6f, 0.95f, 20, 0.0f, 0.5f, 0.3f, 1.1f, 1, 0)},
      {"T=1 top_p=0.95 (peaked)", 0, make_sample_config(1.0f, 0.95f, 0, 0.0f, 0, 0, 1, 1, 0)},
      {"T=1 min_p=0.05", 0, make_sample_config(1.0f, 1.0f, 0, 0.05f, 0, 0, 1, 1, 0)},
      {"T=1 top_p=0.95 (flat: fallback)", 1, make_sample_config(1.0f, 0.95f, 0, 0.0f, 0, 0, 1, 1, 0)},
  };
  const int iters = o.num("iters");
  std::printf("  one op at vocab %d, captured and replayed %d times (device time per op incl. graph launch):\n", V,
              iters);
  for (const TimeCase& tc : tcs) {
    gpu->copy_from_host(d_logits, rows[tc.dist].data(), 4LL * V);
    gpu->copy_from_host(d_cfg, &tc.cfg, sizeof(SampleConfig));
    gpu->copy_from_host(d_counts, zero.data(), 4LL * V);
    gpu->sample(d_logits, V, d_cfg, d_counts, d_id);   // eager first: sizes the workspace
    const int path = last_path(*gpu);
    if (!gpu->begin_capture()) break;
    gpu->sample(d_logits, V, d_cfg, d_counts, d_id);
    gpu->end_capture();
    gpu->replay();
    gpu->synchronize();
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) gpu->replay();
    gpu->synchronize();
    std::printf("    %-40s %7.2f us  (path %d)\n", tc.name, 1e6 * secs(t0, Clock::now()) / iters, path);
  }
  {
    gpu->argmax(d_logits, 1, V, d_id);
    if (gpu->begin_capture()) {
      gpu->argmax(d_logits, 1, V, d_id);
      gpu->end_capture();
      gpu->replay();
      gpu->synchronize();
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) gpu->replay();
      gpu->synchronize();
      std::printf("    %-40s %7.2f us  (reference: the argmax op)\n", "argmax", 1e6 * secs(t0, Clock::now()) / iters);
    }
  }

  // ---- 3. end to end -------------------------------------------------------------------------
  bool e2e_ok = true;
  if (o.num("layers") > 0) {
    SyntheticOptions so;
    so.layers = o.num("layers");
    so.vocab = V;
    so.seed = 7;
    auto host = std::make_shared<ModelWeights>(make_synthetic_weights(so));
    Qwen36 m(host, *gpu, ModelOptions{});
    const int P = 24, N = o.num("tokens");
    std::vector<int32_t> seq(P);
    for (auto& t : seq) t = int32_t(rng() % uint32_t(V));
    const int cap = P + 2 * N + 300;
    auto collect = [](std::vector<int32_t>& out) {
      return [&out](int32_t id) {
        out.push_back(id);
        return true;
      };
    };
    // a) temperature 0 through the sampling loop == generate_greedy
    std::vector<int32_t> g1, g2;
    {
      auto sa = m.new_state(cap), sb = m.new_state(cap);
      m.forward(*sa, std::span<const int32_t>(seq.data(), P - 1), nullptr);
      m.forward(*sb, std::span<const int32_t>(seq.data(), P - 1), nullptr);
      m.generate_greedy(*sa, seq[P - 1], N, g1);
      const int c = m.generate(*sb, seq[P - 1], N, make_sample_config(0, 1, 0, 0, 0, 0, 1, 1, 0), {}, collect(g2));
      int first = -1;
      for (int i = 0; i < N && first < 0; ++i)
        if (g1[i] != g2[i]) first = i;
      const bool ok = first < 0 && c == N - 1 && sa->pos == sb->pos;
      e2e_ok = e2e_ok && ok;
      std::printf("  e2e (%d layers): generate(T=0) vs generate_greedy over %d tokens: %s", so.layers, N,
                  ok ? "identical" : "DIFFERENT");
      if (first >= 0) std::printf(" (first at %d: %d vs %d)", first, g1[first], g2[first]);
      std::printf(", consumed %d, pos %d/%d\n", c, sa->pos, sb->pos);
    }
    // b) consumed-token count: stop after 10 picks; the state's logits equal a prefill of the record
    {
      auto st = m.new_state(cap);
      std::vector<float> logits(V), want(V);
      m.forward(*st, seq, logits.data());
      std::vector<int32_t> picks;
      const int c = m.generate_from_logits(*st, logits.data(), N, make_sample_config(0.8f, 0.9f, 40, 0, 0.2f, 0, 1.1f, 5, 0),
                                           seq, [&](int32_t id) {
                                             picks.push_back(id);
                                             return picks.size() < 10;
                                           });
      std::vector<int32_t> rec = seq;
      rec.insert(rec.end(), picks.begin(), picks.begin() + c);
      auto ref = m.new_state(cap);
      m.forward(*ref, rec, want.data());
      double dot = 0, na = 0, nb = 0;
      for (int i = 0; i < V; ++i) {
        dot += double(logits[i]) * want[i];
        na += double(logits[i]) * logits[i];
        nb += double(want[i]) * want[i];
      }
      const double cos = dot / std::sqrt(na * nb + 1e-300);
      const int am = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
      const int bm = int(std::max_element(want.begin(), want.end()) - want.begin());
      const bool ok = c == 10 && st->pos == P + 10 && cos >= 0.999 && am == bm;
      e2e_ok = e2e_ok && ok;
      std::printf("  e2e: stop after 10 sampled picks: consumed %d (want 10), pos %d (want %d), logits vs prefill of "
                  "the record: cosine %.6f, top-1 %s: %s\n", c, st->pos, P + 10, cos, am == bm ? "same" : "DIFF",
                  ok ? "ok" : "FAIL");
    }
    // c) decode speed: steady ms/token from the difference of a long and a short run
    auto run = [&](int n, int kind) {
      auto st = m.new_state(cap);
      m.forward(*st, std::span<const int32_t>(seq.data(), P - 1), nullptr);
      gpu->synchronize();
      std::vector<int32_t> out;
      const auto t0 = Clock::now();
      if (kind == 0) m.generate_greedy(*st, seq[P - 1], n, out);
      else if (kind == 1) m.generate(*st, seq[P - 1], n, make_sample_config(0, 1, 0, 0, 0, 0, 1, 1, 0), {}, collect(out));
      else m.generate(*st, seq[P - 1], n, make_sample_config(0.7f, 0.9f, 20, 0, 0.3f, 0, 1.05f, 1, 0), seq, collect(out));
      gpu->synchronize();
      return secs(t0, Clock::now());
    };
    const char* names[] = {"generate_greedy (ids copied at the end)", "generate T=0 (ids per step, async)",
                           "generate T=0.7 top_k=20 top_p=0.9 +penalties"};
    const int n_short = 16, n_long = std::max(N, 16) + 128;
    for (int kind = 0; kind < 3; ++kind) {
      run(n_short, kind);   // warm-up
      const double a = run(n_short, kind), b = run(n_long, kind);
      std::printf("    %-46s %.3f ms/token (steady), %.1f ms for %d tokens incl. capture\n", names[kind],
                  1e3 * (b - a) / (n_long - n_short), 1e3 * b, n_long);
    }
  }
  const int topk_bad = check_moe_topk(rng);
  const bool ok = mismatches == 0 && e2e_ok && topk_bad == 0;
  std::printf("cuda-test-sample: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

RegisterCommand reg{{"cuda-test-sample", "compare the cuda sample op and sampling decode loop with the cpu ones",
                     test_sample_main}};

}  // namespace
}  // namespace lily
