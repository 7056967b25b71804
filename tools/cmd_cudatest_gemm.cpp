// `lily cuda-test-gemm`: the prefill matrix path of the cuda backend (tensor-core GEMM with fused
// dequantisation, MoE prefill with device routing) against the cpu backend on the full-width
// synthetic weights: every real matmul shape at several T with P1 on and off, in fp16 and bf16
// operands (LILY_GEMM_BF16), the MoE block with P2 on and off and every expert M-tile (P3). Each
// case is compared with the exact f32 cpu result and with the cpu emulation of the GPU's operand
// rounding (LILY_CPU_EMULATE, gemm_emulate.h): against the latter only summation order remains, so
// its bound is tight and catches a wrong exponent, scale or rounding that the f32 bound would
// tolerate. One PASS/FAIL line per case with its errors, the failures repeated at the end; exits
// non-zero on any failure. P10: the mma.sync cases also run with 128- and 256-wide CTA tiles forced
// (LILY_GEMM_BN), and each 256 case says whether it equals the 128 case bit for bit ("== BN128");
// the MoE block also with 512 (the grouped GEMMs' widest tile, same check).
// `--bench` times the shapes at T=4096 and the MoE block with CUDA events (with both widths).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/gemm_emulate.h"
#include "core/thread_pool.h"
#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "model/synthetic.h"
#include "model/weights.h"
#ifdef LILY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
namespace lily::cuda {   // backend/cuda/gemm.h (a CUDA header): the P13 test entry, synchronous
void gemm_f16_raw(int kernel, const uint16_t* a, const float* rs, int T, int K, const uint16_t* b, int N, float* y,
                  int64_t ldy, bool accumulate);
// backend/cuda/gemm.h: the P14 test entry (grouped MoE GEMM on raw buffers), synchronous
void gemm_moe_raw(int kernel, int bm, bool swiglu, const uint16_t* a, const float* rs, const int8_t* aexp,
                  const int* a_rows, int K, int N, int E, const void* codes, const void* scales, const void* biases,
                  const void* codes2, const void* scales2, const void* biases2, const int* tiles, int n_tiles,
                  const int* dst, const float* scale, float* y, uint16_t* act, int8_t* act_exp);
// backend/cuda/gemm.h: the P25 test entry (fused rmsnorm + conversion vs the two kernels), synchronous
int64_t gemm_rmsnorm_convert_probe(int n, int T, bool add, bool f16, bool split, int dot, unsigned seed,
                                   int slots);
// backend/cuda/gemm.h: the P30 test entry (segmented GEMM vs one output), synchronous
int64_t gemm_segmented_probe(int T, int K, int nseg, const int* rows, unsigned seed, int h16);
// backend/cuda/gemm.h: the P28 test entry (fused GDN gated norm + conversion vs the two kernels), synchronous
int64_t gemm_gdn_norm_convert_probe(int nv, int T, bool f16, bool split, unsigned seed, bool z16 = false);
bool gemm_set_p75(bool on);
bool gemm_set_p81(bool on);
double gemm_splitk_probe(int T, int N, int K, int ksplit, int bm, unsigned seed);
double gemm_router16_probe(int T, int N, int K, int ksplit, unsigned seed);
}  // namespace lily::cuda
#endif

namespace lily {
namespace {

#ifdef LILY_HAVE_CUDA

// Errors of `got` against `ref` over the listed rows: RMS of the difference relative to the RMS of
// ref, and max |difference| relative to max |ref|.
struct Err {
  double rms = 0, maxrel = 0, shrink = 0;   // shrink: sum((got-ref)*ref) / sum(ref^2)
  bool finite = true;
};
Err compare(const float* got, int64_t ld_got, const float* ref, int64_t ld_ref, int64_t cols, const std::vector<int>& rows) {
  double se = 0, sr = 0, me = 0, mr = 0, sd = 0;
  bool fin = true;
  for (int r : rows)
    for (int64_t j = 0; j < cols; ++j) {
      const double a = got[r * ld_got + j], b = ref[r * ld_ref + j];
      if (!std::isfinite(a)) fin = false;
      se += (a - b) * (a - b);
      sd += (a - b) * b;
      sr += b * b;
      me = std::max(me, std::fabs(a - b));
      mr = std::max(mr, std::fabs(b));
    }
  Err e;
  e.rms = std::sqrt(se / std::max(sr, 1e-300));
  e.maxrel = me / std::max(mr, 1e-300);
  e.shrink = sd / std::max(sr, 1e-300);
  e.finite = fin;
  return e;
}

// Bounds: bf16 rounding of activations and weights gives RMS ~2e-3 and max ~2e-3 of max|ref| on
// these shapes; a wrong fragment, tile edge or group shows up far above both.
constexpr double kRmsBound = 1e-2, kMaxBound = 5e-2;
// Against the emulated rounding only the accumulation differs, and the GPU's is not f32 round-to-
// nearest: mma.sync aligns the products of a k-block to the largest exponent and truncates the
// shifted significands, an error of up to ~1 ulp(|acc|) ~ 2^-24 |acc| per product that does not
// average out (the MoE block, K = 2048 then 512, measured 5.6e-5; dense K = 4096 exceeded a flat
// 1e-4 on the first run). The dense bound therefore grows with K: kEmuRmsPerK·K, at least 1e-4.
// What it still catches: a wrong exponent, scale, group, fragment or tile edge (errors O(1)),
// bf16 rounding where fp16 is meant (~1e-3), a lost 2^8 weight factor (fp16 subnormals, >1e-3).
// Not caught: one-ulp fp16 rounding-mode slips (~1e-4, harmless next to the f32 bound's purpose).
// Printed `shrink` (the part of the difference along ref) tells the two apart: truncation toward
// zero makes it negative with |shrink| close to rms; errors unrelated to ref (a wrong fragment,
// group or rounding) leave it near 0.
// Plus, for the MoE, rare one-ulp differences of a rounded SwiGLU activation.
constexpr double kEmuRmsBound = 1e-4, kEmuMaxBound = 2e-3, kEmuRmsPerK = 6e-8;
// MoE in bf16: the SwiGLU activation v = silu(g)·u is computed from the GPU's own f32 g, u (another
// summation order, __expf) and then rounded to bf16 by both sides in the same way (RNE). An element
// whose v differs by δ (relative ~1e-6, more where g or u is near 0) rounds to the other neighbour
// with probability ~2δ/u (u = bf16 spacing, ~2^-8 relative); each flip is an error of one spacing.
// The RMS of the activation's difference, hence of the output's, is ~sqrt(2δu) ~ 1e-4..2e-4 in bf16
// (measured 1.97e-4 at T=16, 1.14e-4 at T=200, 9.7e-5 at T=1024) and sqrt(8) smaller in fp16 (5.4e-5
// measured). No rounding step is missing from the emulation: dropping the activation rounding there
// would leave a difference of ~1.5e-3 (bf16 RNE error of the activation, 2^-8/sqrt(12) relative
// and more). 4e-4 stays well below that and 2x above what was measured.
constexpr double kEmuRmsMoeBf16 = 4e-4;
// MoE in fp16 with P16 (the (token, slot) rows stored as fp16 before the combine): both sides round each
// slot value to fp16, but from f32 values that differ by the summation order (relative ~5e-5, the fp16
// MoE's own emulated RMS without P16), so a few per cent of them round to the other neighbour, one fp16
// spacing (~2^-10 relative) each. Measured (session 8, call 6): 1.35e-4..1.39e-4 at T = 16 / 200 / 1024
// against 5.4e-5..5.6e-5 with f32 slots, i.e. ~1.2e-4 added in quadrature; bf16 2.25e-4 (was 1.97e-4).
// A reference that did not round the slots at all would differ by the whole fp16 rounding (~2.9e-4),
// above this bound.
constexpr double kEmuRmsMoeSlot16 = 2e-4;

struct Tally {
  int pass = 0, fail = 0;
  std::vector<std::string> failed;   // repeated at the end so that a tail of the output shows them
  // K: reduction length of a dense GEMM (0: the MoE block, flat bound). emu_floor: the smallest
  // emulated RMS bound (kEmuRmsMoeBf16 for the MoE block in bf16).
  void report(const std::string& what, const Err& e, const Err& emu, const std::string& extra = "", int K = 0,
              double emu_floor = kEmuRmsBound) {
    const double emu_rms = std::max(emu_floor, kEmuRmsPerK * K);
    const bool ok = e.finite && e.rms <= kRmsBound && e.maxrel <= kMaxBound && emu.finite && emu.rms <= emu_rms &&
                    emu.maxrel <= kEmuMaxBound;
    (ok ? pass : fail) += 1;
    char line[512];
    std::snprintf(line, sizeof line,
                  "%-4s %-58s rms %.2e  max %.2e | vs emulated rms %.2e (<= %.1e)  max %.2e  shrink %+.1e%s",
                  ok ? "PASS" : "FAIL", what.c_str(), e.rms, e.maxrel, emu.rms, emu_rms, emu.maxrel, emu.shrink,
                  extra.c_str());
    std::printf("%s\n", line);
    std::fflush(stdout);
    if (!ok) failed.push_back(line);
  }
};
void set_gemm_precision(bool f16) { setenv("LILY_GEMM_BF16", f16 ? "0" : "1", 1); }

std::vector<float> random_vec(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = u(rng);
  return v;
}

std::vector<int> all_rows(int T) {
  std::vector<int> r(T);
  for (int i = 0; i < T; ++i) r[i] = i;
  return r;
}

// Top-k of softmax(logits) as the cpu backend picks it (lowest id on ties), as a sorted set.
std::vector<int> topk_set(const float* l, int E, int k) {
  std::vector<int> o(E);
  for (int i = 0; i < E; ++i) o[i] = i;
  std::partial_sort(o.begin(), o.begin() + k, o.end(),
                    [&](int p, int q) { return l[p] > l[q] || (l[p] == l[q] && p < q); });
  o.resize(k);
  std::sort(o.begin(), o.end());
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Shape {
  std::string name;
  QMatrix host, dev;
  bool big = false;   // lm_head: small T only, reference on row slices
};

// ---- P13 probe: the wgmma GEMM of the P8 path (gemm_wg16.cuh) on raw fp16 buffers ----------------
// Structured operands whose exact product names the element that was read, so that one run tells
// which part of the kernel is wrong (the same cases run on the mma.sync kernel as a control):
//   kmap:  A[m,k] = 1 at k = km(m) only, B[n,k] = k      -> y = km(m); a wrong value is the k that
//          met A's one (A and B tiles disagree on the k order: swizzle, descriptor k-offset);
//   nmap:  A as kmap, B[n,k] = n mod 2048               -> y = n mod 2048; else the weight row that
//          landed in column n (B layout along N, or the epilogue's columns);
//   mmap:  A[m,k] = m mod 2048 at k = km(m), B = 1      -> y = m mod 2048; else the token that landed
//          in row m (A layout along M, or the epilogue's rows);
//   rand / accum: random operands and power-of-two row scales against a double reference, store
//          and += mode (scales, accumulation, pipeline races between stages and tiles).
// Row scales are 256 (factor rs·2^-8 = 1) in the structured cases. Each runs with the default grid
// and with LILY_GEMM_WG16_GRID=4 (several tiles per CTA: the persistent loop's phases), in the
// cp.async form and the TMA form (tensor maps: a TMA-only failure is the map or the expect-tx count).
uint16_t f16_exact(float f) {   // f exactly representable as a normal fp16 (or 0)
  if (f == 0.f) return 0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const int e = int((u >> 23) & 255u) - 127 + 15;
  return uint16_t(((u >> 16) & 0x8000u) | (uint32_t(e) << 10) | ((u >> 13) & 0x3ffu));
}

void probe_p13(Backend& gpu, Tally& tally) {
  const int T = 600, K = 2048, NS = 2112, NR = 576;   // 5 M tiles (last 88 rows); 9 / 3 N tiles (last 64)
  std::vector<uint16_t> ha(size_t(T) * K), hb(size_t(NS) * K);
  std::vector<float> fa(size_t(T) * K), fb(size_t(NS) * K), rs(T, 256.f), y(size_t(T) * NS), y0(size_t(T) * NS);
  auto km = [&](int m) { return (m * 37 + 11) % K; };
  float* da = gpu.alloc(int64_t(T) * K / 2);
  float* db = gpu.alloc(int64_t(NS) * K / 2);
  float* drs = gpu.alloc(T);
  float* dy = gpu.alloc(int64_t(T) * NS);
  auto upload = [&] {
    for (size_t i = 0; i < fa.size(); ++i) ha[i] = f16_exact(fa[i]);
    for (size_t i = 0; i < fb.size(); ++i) hb[i] = f16_exact(fb[i]);
    gpu.copy_from_host(da, ha.data(), 2LL * T * K);
    gpu.copy_from_host(db, hb.data(), 2LL * NS * K);
    gpu.copy_from_host(drs, rs.data(), 4LL * T);
  };
  // Runs kernel `kern` (0 mma.sync, 1 wgmma; grid cap for 1) on N columns, y from y0 (accum) or zero.
  auto run = [&](int kern, const char* grid, int N, bool accum) {
    setenv("LILY_GEMM_WG16_GRID", grid, 1);
    if (accum) gpu.copy_from_host(dy, y0.data(), 4LL * T * N);
    else gpu.fill_zero(dy, 4LL * T * N);
    lily::cuda::gemm_f16_raw(kern, reinterpret_cast<const uint16_t*>(da), drs, T, K,
                             reinterpret_cast<const uint16_t*>(db), N, dy, N, accum);
    gpu.copy_to_host(y.data(), dy, 4LL * T * N);
    unsetenv("LILY_GEMM_WG16_GRID");
  };
  struct Case {
    const char* kern;
    int k;
    const char* grid;
  };
  const Case cases[5] = {
      {"mma.sync", 0, ""}, {"wgmma", 1, ""}, {"wgmma grid 4", 1, "4"}, {"wgmma tma", 2, ""}, {"tma grid 4", 2, "4"}};
  // Exact cases: count mismatches, show the first ones as (token, column): expected -> got.
  auto exact = [&](const char* name, const std::function<float(int, int)>& want) {
    upload();
    for (const Case& c : cases) {
      run(c.k, c.grid, NS, false);
      int64_t bad = 0;
      std::string first;
      for (int m = 0; m < T; ++m)
        for (int n = 0; n < NS; ++n) {
          const float w = want(m, n), got = y[size_t(m) * NS + n];
          if (got == w) continue;
          if (++bad <= 6) {
            char b[96];
            std::snprintf(b, sizeof b, " (%d,%d): %g -> %g", m, n, double(w), double(got));
            first += b;
          }
        }
      Err e{}, ee{};
      e.finite = ee.finite = bad == 0;
      char what[160];
      std::snprintf(what, sizeof what, "P13 probe %-5s %-12s T=%d N=%d K=%d", name, c.kern, T, NS, K);
      tally.report(what, e, ee, "  mismatches " + std::to_string(bad) + first);
    }
  };
  std::fill(fa.begin(), fa.end(), 0.f);
  for (int m = 0; m < T; ++m) fa[size_t(m) * K + km(m)] = 1.f;
  for (int n = 0; n < NS; ++n)
    for (int k = 0; k < K; ++k) fb[size_t(n) * K + k] = float(k);
  exact("kmap", [&](int m, int) { return float(km(m)); });
  for (int n = 0; n < NS; ++n)
    for (int k = 0; k < K; ++k) fb[size_t(n) * K + k] = float(n % 2048);
  exact("nmap", [&](int, int n) { return float(n % 2048); });
  for (int m = 0; m < T; ++m) fa[size_t(m) * K + km(m)] = float(m % 2048);
  std::fill(fb.begin(), fb.end(), 1.f);
  exact("mmap", [&](int m, int) { return float(m % 2048); });

  // Random operands q/256 (exact in fp16), row scales 2^-3..2^3 · 256; y0 random for the += case.
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> q(-256, 256), ex(-3, 3);
  for (auto& v : fa) v = float(q(rng)) / 256.f;
  for (auto& v : fb) v = float(q(rng)) / 256.f;
  for (auto& v : rs) v = std::ldexp(256.f, ex(rng));
  for (auto& v : y0) v = float(q(rng)) / 16.f;
  upload();
  std::vector<double> ref(size_t(T) * NR), mag(size_t(T) * NR);
  for (int m = 0; m < T; ++m)
    for (int n = 0; n < NR; ++n) {
      double sacc = 0, sabs = 0;
      const float *ar = &fa[size_t(m) * K], *br = &fb[size_t(n) * K];
      for (int k = 0; k < K; ++k) {
        sacc += double(ar[k]) * br[k];
        sabs += std::fabs(double(ar[k]) * br[k]);
      }
      const double f = rs[m] / 256.0;
      ref[size_t(m) * NR + n] = f * sacc;
      mag[size_t(m) * NR + n] = f * sabs;
    }
  std::vector<float> ctrl(size_t(T) * NR);
  for (int accum = 0; accum < 2; ++accum)
    for (const Case& c : cases) {
      run(c.k, c.grid, NR, accum);
      // Bound per element: 2^-20 of sum |a·b| (f32 accumulation over K = 2048, any order) + the
      // += rounding; a wrong stage, scale or tile is O(|y|).
      int64_t bad = 0;
      double worst = 0, md = 0;
      std::string first;
      for (int m = 0; m < T; ++m)
        for (int n = 0; n < NR; ++n) {
          const size_t i = size_t(m) * NR + n;
          const double want = ref[i] + (accum ? y0[i] : 0.0), got = y[i];
          const double tol = std::ldexp(mag[i], -20) + std::ldexp(std::fabs(want), -22) + 1e-30;
          const double r = std::fabs(got - want) / tol;
          worst = std::max(worst, r);
          if (c.k == 0) ctrl[i] = y[i];
          else md = std::max(md, double(std::fabs(y[i] - ctrl[i])));
          if (r > 1 && ++bad <= 4) {
            char b[96];
            std::snprintf(b, sizeof b, " (%d,%d): %.6g -> %.6g", m, n, want, got);
            first += b;
          }
        }
      Err e{}, ee{};
      e.finite = ee.finite = bad == 0;
      char what[160], extra[256];
      std::snprintf(what, sizeof what, "P13 probe %-5s %-12s T=%d N=%d K=%d", accum ? "accum" : "rand", c.kern, T, NR, K);
      std::snprintf(extra, sizeof extra, "  mismatches %lld, worst error %.2f of bound%s%s", (long long)bad, worst,
                    c.k == 0 ? "" : (md == 0 ? ", == mma.sync" : (", max |diff| to mma.sync " + std::to_string(md)).c_str()),
                    first.c_str());
      tally.report(what, e, ee, extra);
    }
}


// The GEMM's k-order inside a 64-column group (gemm.h's gemm_kperm, which is not includable here):
// staged column L holds input column cuda_kperm(L).
constexpr int cuda_kperm(int L) {
  return 16 * ((L >> 1) & 3) + 8 * (L >> 5) + 2 * ((L >> 4) & 1) + ((L >> 3) & 1) + 4 * (L & 1);
}

// ---- P14 probe: the grouped MoE GEMMs on raw buffers (gemm_moe_raw), kernel 0 = mma.sync (control),
// 1 = the wgmma kernel of P14, 2 = P15 (register-A wgmma; gemm_moe_wg.cuh), at tile-list M-tiles 32 / 64 / 128 ---
// 3 experts with 200 / 37 / 130 rows plus 50 rows of group E (the "shared expert" slot, here expert
// 0's matrices), K = 1024 (16 steps: the rings wrap, two scale blocks), rows scattered to
// dst[p] = (7p + 3) mod P. Down (scatter) mode, exact structured cases (aexp 0, scale 1):
//   kmap1: A[p, staged column km(p)] = 1, W[n, k] = (k mod 16) + 16·(k / 64)  -> y = that of k
//   kmap2: same A, W[n, k] = ((k mod 64) >> 4) + 4·(k / 64)                      (k = km's input column)
//          (a wrong value names the k that met A's one: the dequantised tile's k order or swizzle);
//   nmap:  same A, W[n, k] = (n + 37·e) mod 256 (scale 0)  -> y = that of (n, expert e): else the
//          weight row / expert that landed in column n (N layout, group offset, epilogue columns);
//   mmap:  A[p, km(p)] = p + 1, W = 1                      -> y[dst[p]] = p + 1: else the token row
//          that landed there (activation rows, tile rows, dst scatter);
//   rand:  random activations with per-(row, group) exponents in [-3, 3] and random weights,
//          against a double reference (bound 2^-20 of sum |a·w|) and kernel 0.
// SwiGLU (gate/up) mode, random: rows gathered through a_rows from 300 x rows with power-of-two row
// scales, 512 gate + 512 up rows; the decoded activations act·2^-e against a double reference
// (bound: 2^-9 of the row group's max + 2^-18 of the sums' magnitude) and kernel 0 (exponents equal,
// activations within 1 fp16 ulp).
void probe_p14(Backend& gpu, Tally& tally) {
  // One probe case's name ("P14 probe <what> <kernel> tile <bm> K=<K> N=<N>"), announced before it runs.
  auto announce = [](char (&out)[160], const std::string& what, int kern, int bm, int K, int N) {
    std::snprintf(out, sizeof out, "P14 probe %s %-9s tile %-3d K=%d N=%d", what.c_str(),
                  kern == 0 ? "mma.sync" : kern == 1 ? "P14 wgmma" : "P15 rs", bm, K, N);
    std::printf("  running %s\n", out);
    std::fflush(stdout);
  };
  const int K = 1024, NS = 768, E = 3;
  const int cnt[4] = {200, 37, 130, 50};   // group E last
  int P = 0;
  for (int c : cnt) P += c;
  const int G = K / 64;
  auto km = [&](int p) { return (p * 37 + 11) % K; };                                  // staged column
  auto kin = [&](int L) { return 64 * (L / 64) + cuda_kperm(L % 64); };          // its input column
  auto bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t(u >> 16);   // exact for the values used (<= 8 significant bits)
  };
  std::vector<int> dst(P), arows(P);
  std::vector<float> scale(P, 1.f);
  for (int p = 0; p < P; ++p) dst[p] = (7 * p + 3) % P;
  // Host weights as (code, scale, bias) per expert; 2 matrices for SwiGLU.
  struct HostW {
    std::vector<uint32_t> codes;
    std::vector<uint16_t> sc, bi;
    std::vector<float> w;   // dequantised value s·q + b
  };
  auto make_w = [&](int N, const std::function<void(int e, int n, int k, int& q, float& s, float& b)>& f) {
    HostW h;
    h.codes.assign(size_t(E) * N * K / 8, 0);
    h.sc.assign(size_t(E) * N * G, 0);
    h.bi.assign(size_t(E) * N * G, 0);
    h.w.assign(size_t(E) * N * K, 0.f);
    for (int e = 0; e < E; ++e)
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) {
          int q;
          float sv, bv;
          f(e, n, k, q, sv, bv);
          const size_t row = size_t(e) * N + n;
          h.codes[row * (K / 8) + k / 8] |= uint32_t(q & 15) << (4 * (k % 8));
          h.sc[row * G + k / 64] = bf16(sv);
          h.bi[row * G + k / 64] = bf16(bv);
          h.w[row * K + k] = sv * float(q) + bv;
        }
    return h;
  };
  auto dev_copy = [&](const void* src, int64_t bytes) {
    float* d = gpu.alloc((bytes + 3) / 4);
    gpu.copy_from_host(d, src, bytes);
    return d;
  };
  auto up = [&](const void* src, int64_t bytes) { return dev_copy(src, bytes); };
  // Tile list for M-tile bm; group of row p.
  std::vector<int> grp(P);
  {
    int p = 0;
    for (int e = 0; e < 4; ++e)
      for (int i = 0; i < cnt[e]; ++i) grp[p++] = e;
  }
  auto tiles_for = [&](int bm) {
    std::vector<int> t;
    int off = 0;
    for (int e = 0; e < 4; ++e) {
      for (int i = 0; i * bm < cnt[e]; ++i) {
        t.push_back(e);
        t.push_back(off + i * bm);
        t.push_back(std::min(bm, cnt[e] - i * bm));
        t.push_back(0);
      }
      off += cnt[e];
    }
    return t;
  };
  auto wexp = [&](const HostW& h, int e, int N, int n, int k) {   // group E uses expert 0
    return h.w[(size_t(e == E ? 0 : e) * N + n) * K + k];
  };
  float* dy = gpu.alloc(int64_t(P) * NS);
  std::vector<float> y(size_t(P) * NS), y0(size_t(P) * NS);
  const int bms[3] = {32, 64, 128};
  {   // kernel 0 = the engine's mma.sync path: P1w (opted into by this tool) off for the gate/up GEMM
    Ablations ab;
    ab.off = {"P1w"};
    cuda_tools::set_ablations(gpu, ab);
  }
  std::printf("P14 probe: grouped MoE GEMMs on raw buffers (K=%d, N=%d, %d rows in 4 groups)\n", K, NS, P);
  std::fflush(stdout);

  // ---- down (scatter) mode ----
  std::vector<uint16_t> ha(size_t(P) * K);
  std::vector<int8_t> hexp(size_t(P) * G, 0);
  auto run_scatter = [&](const HostW& w, int kern, int bm) {
    float* da = up(ha.data(), 2LL * ha.size());
    float* dx = up(hexp.data(), int64_t(hexp.size()));
    float* dc = up(w.codes.data(), 4LL * w.codes.size());
    float* ds = up(w.sc.data(), 2LL * w.sc.size());
    float* db = up(w.bi.data(), 2LL * w.bi.size());
    float* dd = up(dst.data(), 4LL * P);
    float* dsc = up(scale.data(), 4LL * P);
    gpu.fill_zero(dy, 4LL * P * NS);
    const std::vector<int> t = tiles_for(bm);
    lily::cuda::gemm_moe_raw(kern, bm, false, reinterpret_cast<const uint16_t*>(da), nullptr,
                             reinterpret_cast<const int8_t*>(dx), nullptr, K, NS, E, dc, ds, db, nullptr, nullptr,
                             nullptr, t.data(), int(t.size() / 4), reinterpret_cast<const int*>(dd), dsc, dy, nullptr,
                             nullptr);
    gpu.copy_to_host(y.data(), dy, 4LL * P * NS);
  };
  auto exact = [&](const char* name, const HostW& w, const std::function<float(int p, int n)>& want) {
    for (int bm : bms)
      for (int kern = 0; kern < 3; ++kern) {
        char what[160], nm[8];
        std::snprintf(nm, sizeof nm, "%-5s", name);
        announce(what, std::string("down ") + nm, kern, bm, K, NS);
        run_scatter(w, kern, bm);
        int64_t bad = 0;
        std::string first;
        for (int p = 0; p < P; ++p)
          for (int n = 0; n < NS; ++n) {
            const float wv = want(p, n), got = y[size_t(dst[p]) * NS + n];
            if (got == wv) continue;
            if (++bad <= 6) {
              char b[112];
              std::snprintf(b, sizeof b, " (row %d grp %d, col %d): %g -> %g", p, grp[p], n, double(wv), double(got));
              first += b;
            }
          }
        Err e{}, ee{};
        e.finite = ee.finite = bad == 0;
        tally.report(what, e, ee, "  mismatches " + std::to_string(bad) + first);
      }
  };
  std::fill(ha.begin(), ha.end(), 0);
  for (int p = 0; p < P; ++p) ha[size_t(p) * K + km(p)] = f16_exact(1.f);
  {
    const HostW w1 = make_w(NS, [&](int, int, int k, int& q, float& sv, float& bv) {
      q = k & 15;
      sv = 1.f;
      bv = float(16 * (k / 64));
    });
    exact("kmap1", w1, [&](int p, int) { const int k = kin(km(p)); return float((k & 15) + 16 * (k / 64)); });
    const HostW w2 = make_w(NS, [&](int, int, int k, int& q, float& sv, float& bv) {
      q = (k & 63) >> 4;
      sv = 1.f;
      bv = float(4 * (k / 64));
    });
    exact("kmap2", w2, [&](int p, int) { const int k = kin(km(p)); return float(((k & 63) >> 4) + 4 * (k / 64)); });
    const HostW w3 = make_w(NS, [&](int e, int n, int, int& q, float& sv, float& bv) {
      q = 5;
      sv = 0.f;
      bv = float((n + 37 * e) % 256);
    });
    exact("nmap", w3, [&](int p, int n) { const int e = grp[p] == E ? 0 : grp[p]; return float((n + 37 * e) % 256); });
    for (int p = 0; p < P; ++p) ha[size_t(p) * K + km(p)] = f16_exact(float(p + 1));
    const HostW w4 = make_w(NS, [&](int, int, int, int& q, float& sv, float& bv) {
      q = 0;
      sv = 0.f;
      bv = 1.f;
    });
    exact("mmap", w4, [&](int p, int) { return float(p + 1); });
  }
  std::mt19937 rng(4321);
  std::uniform_int_distribution<int> qd(-256, 256), ex(-3, 3), c16(0, 15), b17(-8, 8);
  // Random weights, exact in the kernels' fp16 form: s = 1/16, b = j/16 (s·2^8·q + b·2^8 <= 368).
  // The bias is one per (row, 64-column group), as the format stores it: drawn at the group's first
  // column and kept for the rest (make_w stores the value of the group's last column).
  auto rand_w = [&](int N) {
    float bcur = 0.f;
    return make_w(N, [&, bcur](int, int, int k, int& q, float& sv, float& bv) mutable {
      q = c16(rng);
      sv = 1.f / 16;
      if (k % 64 == 0) bcur = float(b17(rng)) / 16;
      bv = bcur;
    });
  };
  {
    // Activations q/256 stored as act = v·2^e (per (row, group) exponent e).
    std::vector<double> v(size_t(P) * K);
    for (int p = 0; p < P; ++p)
      for (int g = 0; g < G; ++g) {
        const int e = ex(rng);
        hexp[size_t(p) * G + g] = int8_t(e);
        for (int i = 0; i < 64; ++i) {
          const int L = 64 * g + i;
          const float a = float(qd(rng)) / 256.f;
          ha[size_t(p) * K + L] = f16_exact(a);
          v[size_t(p) * K + kin(L)] = std::ldexp(double(a), -e);
        }
      }
    for (int p = 0; p < P; ++p) scale[p] = std::ldexp(1.f, ex(rng));
    const HostW w = rand_w(NS);
    std::vector<double> ref(size_t(P) * NS), mag(size_t(P) * NS);
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < NS; ++n) {
        double sa = 0, sb = 0;
        for (int k = 0; k < K; ++k) {
          const double t = v[size_t(p) * K + k] * wexp(w, grp[p], NS, n, k);
          sa += t;
          sb += std::fabs(t);
        }
        ref[size_t(p) * NS + n] = scale[p] * sa;
        mag[size_t(p) * NS + n] = scale[p] * sb;
      }
    for (int bm : bms)
      for (int kern = 0; kern < 3; ++kern) {
        char what[160];
        announce(what, "down rand ", kern, bm, K, NS);
        run_scatter(w, kern, bm);
        int64_t bad = 0;
        double worst = 0, md = 0;
        std::string first;
        for (int p = 0; p < P; ++p)
          for (int n = 0; n < NS; ++n) {
            const size_t i = size_t(dst[p]) * NS + n;
            const double want = ref[size_t(p) * NS + n], got = y[i];
            const double tol = std::ldexp(mag[size_t(p) * NS + n], -20) + 1e-30;
            worst = std::max(worst, std::fabs(got - want) / tol);
            if (kern == 0) y0[i] = y[i];
            else md = std::max(md, double(std::fabs(y[i] - y0[i])));
            if (std::fabs(got - want) > tol && ++bad <= 4) {
              char b[112];
              std::snprintf(b, sizeof b, " (row %d grp %d, col %d): %.6g -> %.6g", p, grp[p], n, want, got);
              first += b;
            }
          }
        Err e{}, ee{};
        e.finite = ee.finite = bad == 0;
        char extra[320];
        std::snprintf(extra, sizeof extra, "  mismatches %lld, worst %.2f of bound%s%s", (long long)bad, worst,
                      kern == 0 ? "" : (md == 0 ? ", == mma.sync" : (", max |diff| to mma.sync " + std::to_string(md)).c_str()),
                      first.c_str());
        tally.report(what, e, ee, extra);
      }
  }

  // ---- gate/up (SwiGLU) mode ----
  {
    const int NG = 512, TX = 300;   // gate rows (= output columns), x rows
    std::vector<uint16_t> hx(size_t(TX) * K);
    std::vector<double> xv(size_t(TX) * K);
    std::vector<float> rs(TX);
    for (int r = 0; r < TX; ++r) {
      rs[r] = std::ldexp(1.f, ex(rng));   // x = a·rs, the kernel's factor rs·2^-8 on the 2^8 weights
      for (int L = 0; L < K; ++L) {
        const float a = float(qd(rng)) / 256.f;
        hx[size_t(r) * K + L] = f16_exact(a);
        xv[size_t(r) * K + kin(L)] = double(a) * rs[r];
      }
    }
    for (int p = 0; p < P; ++p) arows[p] = (5 * p + 1) % TX;
    const HostW wg = rand_w(NG), wu = rand_w(NG);
    std::vector<double> ref(size_t(P) * NG), mag(size_t(P) * NG);
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < NG; ++n) {
        double gs = 0, us = 0, gm = 0, um = 0;
        for (int k = 0; k < K; ++k) {
          const double xk = xv[size_t(arows[p]) * K + k];
          const double a1 = xk * wexp(wg, grp[p], NG, n, k), a2 = xk * wexp(wu, grp[p], NG, n, k);
          gs += a1;
          us += a2;
          gm += std::fabs(a1);
          um += std::fabs(a2);
        }
        const double sg = gs / (1.0 + std::exp(-gs));
        ref[size_t(p) * NG + n] = sg * us;
        mag[size_t(p) * NG + n] = (gm * std::fabs(us) + std::fabs(sg) * um);
      }
    float* dx = up(hx.data(), 2LL * hx.size());
    float* drs = up(rs.data(), 4LL * TX);
    float* dar = up(arows.data(), 4LL * P);
    float* gc = up(wg.codes.data(), 4LL * wg.codes.size());
    float* gsc = up(wg.sc.data(), 2LL * wg.sc.size());
    float* gbi = up(wg.bi.data(), 2LL * wg.bi.size());
    float* uc = up(wu.codes.data(), 4LL * wu.codes.size());
    float* usc = up(wu.sc.data(), 2LL * wu.sc.size());
    float* ubi = up(wu.bi.data(), 2LL * wu.bi.size());
    float* dact = gpu.alloc(int64_t(P) * NG / 2);
    float* dexp = gpu.alloc(int64_t(P) * (NG / 64) / 4 + 1);
    std::vector<uint16_t> act(size_t(P) * NG), act0(size_t(P) * NG);
    std::vector<int8_t> aex(size_t(P) * (NG / 64)), aex0(size_t(P) * (NG / 64));
    auto h2f = [](uint16_t h) {
      const int e = (h >> 10) & 31, m = h & 1023;
      const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(m | 1024), e - 25);
      return (h & 0x8000) ? -v : v;
    };
    for (int bm : bms)
      for (int kern = 0; kern < 3; ++kern) {
        char what[160];
        announce(what, "gate_up rand", kern, bm, K, NG);
        gpu.fill_zero(dact, 2LL * P * NG);
        gpu.fill_zero(dexp, int64_t(P) * (NG / 64));
        const std::vector<int> t = tiles_for(bm);
        lily::cuda::gemm_moe_raw(kern, bm, true, reinterpret_cast<const uint16_t*>(dx), drs, nullptr,
                                 reinterpret_cast<const int*>(dar), K, NG, E, gc, gsc, gbi, uc, usc, ubi, t.data(),
                                 int(t.size() / 4), nullptr, nullptr, nullptr, reinterpret_cast<uint16_t*>(dact),
                                 reinterpret_cast<int8_t*>(dexp));
        gpu.copy_to_host(act.data(), dact, 2LL * P * NG);
        gpu.copy_to_host(aex.data(), dexp, int64_t(P) * (NG / 64));
        if (kern == 0) {
          act0 = act;
          aex0 = aex;
        }
        int64_t bad = 0, exp_diff = 0, ulp_diff = 0;
        double worst = 0;
        std::string first;
        for (int p = 0; p < P; ++p)
          for (int g = 0; g < NG / 64; ++g) {
            double gmax = 0;
            for (int i = 0; i < 64; ++i) gmax = std::max(gmax, std::fabs(ref[size_t(p) * NG + 64 * g + i]));
            const int e = aex[size_t(p) * (NG / 64) + g];
            if (kern >= 1 && e != aex0[size_t(p) * (NG / 64) + g]) ++exp_diff;
            for (int L = 0; L < 64; ++L) {
              const size_t i = size_t(p) * NG + 64 * g + L;
              const int n = 64 * g + cuda_kperm(L);
              const double got = std::ldexp(h2f(act[i]), -e), want = ref[size_t(p) * NG + n];
              const double tol = std::ldexp(gmax, -9) + std::ldexp(mag[size_t(p) * NG + n], -18) + 1e-30;
              worst = std::max(worst, std::fabs(got - want) / tol);
              if (kern >= 1 && std::abs(int(act[i]) - int(act0[i])) > 1) ++ulp_diff;
              if (std::fabs(got - want) > tol && ++bad <= 4) {
                char b[112];
                std::snprintf(b, sizeof b, " (row %d grp %d, col %d): %.6g -> %.6g", p, grp[p], n, want, got);
                first += b;
              }
            }
          }
        Err er{}, ee{};
        er.finite = ee.finite = bad == 0 && exp_diff == 0 && ulp_diff == 0;
        char extra[320];
        std::snprintf(extra, sizeof extra, "  mismatches %lld, worst %.2f of bound%s%s", (long long)bad, worst,
                      kern == 0 ? ""
                                : (", vs mma.sync: " + std::to_string(exp_diff) + " exponents differ, " +
                                   std::to_string(ulp_diff) + " values > 1 ulp apart").c_str(),
                      first.c_str());
        tally.report(what, er, ee, extra);
      }
  }
  cuda_tools::set_ablations(gpu, Ablations{});
}

int run(const Options& o) {
  // wgmma (P1w) is opt-in in the backend; the tests and benches here run it and its ablation.
  setenv("LILY_GEMM_WGMMA", "1", 1);
  BackendOptions cpu_opt;
  cpu_opt.name = "cpu";
  cpu_opt.threads = o.num("threads");
  BackendOptions cuda_opt;
  cuda_opt.name = "cuda";
  auto cpu = make_backend(cpu_opt);
  // Emulating cpu backends (they read LILY_CPU_EMULATE when made); [0] bf16, [1] fp16.
  std::unique_ptr<Backend> emu[2];
  const char* old_emu = std::getenv("LILY_CPU_EMULATE");
  const std::string keep = old_emu ? old_emu : "";
  setenv("LILY_CPU_EMULATE", "bf16", 1);
  emu[0] = make_backend(cpu_opt);
  setenv("LILY_CPU_EMULATE", "fp16", 1);
  emu[1] = make_backend(cpu_opt);
  // The same two with the MoE's (token, slot) rows kept in f32 (the GPU's P16 off, or a kernel without it).
  std::unique_ptr<Backend> emu32[2];
  setenv("LILY_CPU_EMULATE_SLOT16", "0", 1);
  setenv("LILY_CPU_EMULATE", "bf16", 1);
  emu32[0] = make_backend(cpu_opt);
  setenv("LILY_CPU_EMULATE", "fp16", 1);
  emu32[1] = make_backend(cpu_opt);
  unsetenv("LILY_CPU_EMULATE_SLOT16");
  setenv("LILY_CPU_EMULATE", keep.c_str(), 1);
  auto gpu = make_backend(cuda_opt);
  SyntheticOptions so;
  so.layers = 4;   // layer 0: GDN, layer 3: attention
  so.seed = uint64_t(o.i64("seed"));
  auto host = std::make_shared<ModelWeights>(make_synthetic_weights(so));
  const ModelWeights dev = gpu->upload(*host);
  const ModelConfig& c = host->config;
  std::printf("cuda-test-gemm: %s; synthetic weights seed %lld\n", cuda_tools::device_name().c_str(),
              (long long)o.i64("seed"));

  const LayerWeights &hg = host->layers[0], &dg = dev.layers[0], &ha = host->layers[3], &da = dev.layers[3];
  std::vector<Shape> shapes = {
      {"gdn.in_proj_qkv", hg.linear_attn.in_proj_qkv, dg.linear_attn.in_proj_qkv},
      {"gdn.in_proj_z", hg.linear_attn.in_proj_z, dg.linear_attn.in_proj_z},
      {"gdn.in_proj_a", hg.linear_attn.in_proj_a, dg.linear_attn.in_proj_a},
      {"gdn.out_proj", hg.linear_attn.out_proj, dg.linear_attn.out_proj},
      {"attn.q_proj", ha.self_attn.q_proj, da.self_attn.q_proj},
      {"attn.k_proj", ha.self_attn.k_proj, da.self_attn.k_proj},
      {"attn.o_proj", ha.self_attn.o_proj, da.self_attn.o_proj},
      {"moe.router(8b)", hg.mlp.gate, dg.mlp.gate},
      {"moe.shared_expert_gate(8b)", hg.mlp.shared_expert_gate, dg.mlp.shared_expert_gate},
      {"moe.expert_gate[7]", hg.mlp.experts_gate.expert(7), dg.mlp.experts_gate.expert(7)},
      {"moe.expert_down[7]", hg.mlp.experts_down.expert(7), dg.mlp.experts_down.expert(7)},
      {"moe.shared_up", hg.mlp.shared_up_proj, dg.mlp.shared_up_proj},
      {"lm_head", host->lm_head, dev.lm_head, true},
  };
  const bool bench = o.flag("bench");
  const std::vector<int> Ts = {16, 17, 100, 512, 600, 2048};
  const int64_t max_x = 4096LL * 4096, max_y = 4096LL * 8192;
  float* xd = gpu->alloc(max_x);
  float* yd = gpu->alloc(max_y);
  Tally tally;
  // Every case here names its MoE GEMM kernels: P15 (the engine's default gate/up GEMM) is ablated so
  // that the cases labelled by their mma.sync variant run it; the P14/P15 cases choose their kernels
  // with LILY_MOE_WG, which takes precedence.
  auto set_abl = [&](std::vector<std::string> off) {
    Ablations a;
    a.off = std::move(off);
    a.off.push_back("P15");
    cuda_tools::set_ablations(*gpu, a);
  };

  // --p14: only the P14 cases (check: the raw probe and the MoE block with LILY_MOE_WG=1; bench: the
  // MoE block with LILY_MOE_WG=0 vs 1).
  const bool p14 = o.flag("p14");
  if (!bench) {
    // P25: the fused prefill rmsnorm + operand conversion must be bit-identical to rmsnorm followed by
    // gemm_convert_a (every output byte: h, the f32 rows, row scales, the P19 dot, fp16 / bf16 hi / lo).
    // P59 (last element 1 / 2): the residual read from fp16 / f32 MoE slot rows against the combine stage first.
    if (!p14)
      for (const auto& cs : std::vector<std::array<int, 7>>{{2048, 1, 1, 1, 1, 1, 0}, {2048, 37, 1, 1, 1, 1, 0},
                                                            {2048, 300, 0, 1, 0, 0, 0}, {2048, 300, 1, 0, 1, 0, 0},
                                                            {4096, 64, 1, 1, 1, 1, 0}, {1024, 5, 1, 1, 0, 1, 0},
                                                            {2048, 1, 1, 1, 0, 0, 1}, {2048, 37, 1, 1, 0, 0, 1},
                                                            {2048, 300, 1, 1, 1, 1, 1}, {2048, 77, 1, 0, 1, 0, 2},
                                                            {2048, 130, 1, 1, 0, 1, 2}, {1024, 5, 1, 1, 0, 0, 1},
                                                            // P70: the dot over an 8-bit row (the MoE's shared gate)
                                                            {2048, 300, 1, 1, 0, 2, 0}, {2048, 37, 1, 1, 1, 2, 1},
                                                            {4096, 64, 1, 1, 0, 2, 0}, {1024, 5, 1, 0, 1, 2, 0}}) {
        const int64_t d =
            lily::cuda::gemm_rmsnorm_convert_probe(cs[0], cs[1], cs[2], cs[3], cs[4], cs[5], 7u + cs[1], cs[6]);
        char line[200];
        std::snprintf(line, sizeof line,
                      "%-4s P25 rmsnorm+convert n=%d T=%d add=%d f16=%d hi/lo=%d dot=%d%s: %lld bytes differ",
                      d == 0 ? "PASS" : "FAIL", cs[0], cs[1], cs[2], cs[3], cs[4], cs[5],
                      cs[6] == 1 ? " P59 fp16 slots" : cs[6] == 2 ? " P59 f32 slots" : "",
                      (long long)d);
        std::printf("%s\n", line);
        (d == 0 ? tally.pass : tally.fail) += 1;
        if (d != 0) tally.failed.push_back(line);
      }
    // P28: the fused GDN gated norm + operand conversion, bit-identical to gdn_prefill_norm + gemm_convert_a.
    if (!p14)
      // z16: P62's fp16 z, with P75 (opt-in; its kernel where the block has 256 threads, nv >= 8) off (1) and on (2).
      for (const auto& cs : std::vector<std::array<int, 5>>{{32, 1, 1, 0, 0}, {32, 300, 1, 0, 0}, {32, 77, 0, 1, 0},
                                                            {32, 64, 1, 1, 0}, {8, 33, 1, 0, 0}, {4, 16, 0, 0, 0},
                                                            {16, 9, 1, 0, 0}, {32, 300, 1, 0, 1}, {32, 77, 0, 1, 1},
                                                            {32, 64, 1, 1, 1}, {8, 33, 1, 0, 1}, {4, 16, 1, 0, 1},
                                                            {32, 300, 1, 0, 2}, {32, 77, 0, 1, 2}, {32, 64, 1, 1, 2},
                                                            {8, 33, 1, 0, 2}}) {
        const bool was = lily::cuda::gemm_set_p75(cs[4] == 2);
        const int64_t d = lily::cuda::gemm_gdn_norm_convert_probe(cs[0], cs[1], cs[2], cs[3], 11u + cs[1], cs[4] > 0);
        lily::cuda::gemm_set_p75(was);
        char line[200];
        std::snprintf(line, sizeof line, "%-4s P28 gdn norm+convert nv=%d T=%d f16=%d hi/lo=%d%s: %lld bytes differ",
                      d == 0 ? "PASS" : "FAIL", cs[0], cs[1], cs[2], cs[3],
                      cs[4] == 2 ? " z16 P75" : cs[4] ? " z16" : "", (long long)d);
        std::printf("%s\n", line);
        (d == 0 ? tally.pass : tally.fail) += 1;
        if (d != 0) tally.failed.push_back(line);
      }
    // P37: the router-shaped 8-bit GEMM with K in slices (summed in slice order) == unsplit up to fp32 summation order.
    if (!p14)
      for (const auto& cs : std::vector<std::array<int, 3>>{{4096, 4, 128}, {4096, 2, 128}, {2048, 4, 64}, {300, 2, 32},
                                                            {256, 4, 32}, {128, 4, 32}, {77, 4, 128}, {64, 4, 0}}) {
        const double d = lily::cuda::gemm_splitk_probe(cs[0], 256, 2048, cs[1], cs[2], 13u + cs[0]);
        const bool ok = d < 1e-5;
        char line[200];
        std::snprintf(line, sizeof line, "%-4s P37 router split K T=%d slices=%d bm=%d: max |diff| / max |y| = %.2e",
                      ok ? "PASS" : "FAIL", cs[0], cs[1], cs[2], d);
        std::printf("%s\n", line);
        (ok ? tally.pass : tally.fail) += 1;
        if (!ok) tally.failed.push_back(line);
      }
    // P68: the router GEMM on fp16 operands (x with its row scale, the weights' fp16 copy; K in slices on the P13
    // kernel) against the split-precision GEMM (~16-bit operands): both operands rounded to 11 bits give ~1e-4 of
    // max |y| on these data; a wrong k-order, slice or scale gives O(1), an unwritten slice NaN.
    if (!p14)
      for (const auto& cs : std::vector<std::array<int, 2>>{{4096, 4}, {4096, 1}, {2048, 8}, {1000, 8}, {300, 2},
                                                            {128, 8}, {77, 4}, {16, 8}}) {
        const double d = lily::cuda::gemm_router16_probe(cs[0], 256, 2048, cs[1], 17u + cs[0]);
        const bool ok = d < 1e-3;
        char line[200];
        std::snprintf(line, sizeof line, "%-4s P68 router fp16 T=%d slices=%d: max |diff| / max |y| vs split precision = %.2e",
                      ok ? "PASS" : "FAIL", cs[0], cs[1], d);
        std::printf("%s\n", line);
        (ok ? tally.pass : tally.fail) += 1;
        if (!ok) tally.failed.push_back(line);
      }
    // P30: stacked projections with per-matrix outputs == the slices of one stacked product.
    if (!p14)
      for (const auto& [rs, h16] : std::vector<std::pair<std::vector<int>, int>>{
               {{8192, 4096, 32, 32}, 0}, {{8192, 512, 512}, 0}, {{4096, 32, 32}, 0},
               {{8192, 4096, 32, 32}, 3}, {{96, 4096, 32, 64}, 5}, {{4096, 32, 32}, 2}}) {
        // P62 (h16 bits): those segments as fp16, equal to the f32 slices rounded (the mixed tiles included).
        // P81 (with fp16 segments): the same through its staged stores, at T = 4,096 and at 1,000 (a partial tile).
        for (const int p81 : h16 ? std::vector<int>{0, 1} : std::vector<int>{0})
          for (const int T : p81 ? std::vector<int>{4096, 1000} : std::vector<int>{4096}) {
            const bool was = lily::cuda::gemm_set_p81(p81 != 0);
            const int64_t d = lily::cuda::gemm_segmented_probe(T, 2048, int(rs.size()), rs.data(), 5u + unsigned(rs[1]), h16);
            lily::cuda::gemm_set_p81(was);
            std::string segs;
            for (int r : rs) segs += (segs.empty() ? "" : "+") + std::to_string(r);
            const std::string mask = h16 ? " P62 fp16 mask " + std::to_string(h16) : "";
            char line[200];
            std::snprintf(line, sizeof line, "%-4s P30 segmented GEMM T=%d K=2048 rows %s%s%s: %lld token rows differ",
                          d == 0 ? "PASS" : "FAIL", T, segs.c_str(), mask.c_str(), p81 ? " P81" : "", (long long)d);
            std::printf("%s\n", line);
            (d == 0 ? tally.pass : tally.fail) += 1;
            if (d != 0) tally.failed.push_back(line);
          }
      }
    probe_p14(*gpu, tally);
    if (!p14) probe_p13(*gpu, tally);
    // ---- dense GEMMs ----
    if (!p14)
    for (const Shape& s : shapes) {
      const int N = int(s.host.rows), K = int(s.host.cols);
      for (int T : Ts) {
        if (s.big && T > 17) continue;
        const std::vector<float> x = random_vec(int64_t(T) * K, uint32_t(T * 7919 + K), 1.7f);
        // Reference: whole matrix, or two row slices of lm_head (first and last 8192 rows).
        std::vector<std::pair<int64_t, int64_t>> slices = {{0, N}};
        if (s.big) slices = {{0, 8192}, {N - 8192, 8192}};
        std::vector<std::vector<float>> ref, eref[2];
        for (auto [r0, n] : slices) {
          const QMatrix w = s.big ? s.host.row_slice(r0, n) : s.host;
          ref.emplace_back(size_t(T) * n);
          cpu->matmul(w, x.data(), T, ref.back().data());
          for (int f = 0; f < 2; ++f) {
            eref[f].emplace_back(size_t(T) * n);
            emu[f]->matmul(w, x.data(), T, eref[f].back().data());
          }
        }
        gpu->copy_from_host(xd, x.data(), 4LL * T * K);
        std::vector<float> y(size_t(T) * N), y128(size_t(T) * N);
        // p1 0: default (fp16: wgmma, opted in above; from T >= 512 P8 = 16-bit B on mma.sync),
        // 1: P1 off (16-bit B at every T), 2: P1w and P8 off (fused 4-bit mma.sync at every T).
        // bn: LILY_GEMM_BN ("": P10's own choice; 128 / 256 forced, not on wgmma nor for 8-bit B).
        // A forced-256 case is also compared with the forced-128 case before it: the same MMAs in
        // the same k-order, so it should be bitwise identical ("== BN128").
        // wg: LILY_GEMM_WG16 ("": P13's own choice; "0" / "1" / "2" forced): P1 off with the wgmma kernel
        // of P13 forced off, then on (16-bit B at every T), then on in its TMA form, each compared with
        // the first ("== mma.sync P8": bitwise equal, else the largest difference; summation orders differ).
        struct DV {
          int f16, p1;
          const char* bn;
          const char* wg = "";
        };
        const bool q8 = s.host.type == WType::kAffine8;
        std::vector<float> ymma;
        for (const DV& v : {DV{1, 0, ""}, DV{1, 1, ""}, DV{1, 2, ""}, DV{0, 0, ""}, DV{0, 1, ""}, DV{1, 1, "128"},
                            DV{1, 1, "256"}, DV{1, 2, "128"}, DV{1, 2, "256"}, DV{0, 0, "128"}, DV{0, 0, "256"},
                            DV{0, 1, "128"}, DV{0, 1, "256"}, DV{1, 1, "", "0"}, DV{1, 1, "", "1"},
                            DV{1, 1, "", "2"}}) {
          const int f16 = v.f16, p1 = v.p1;
          const std::string bn = v.bn, wg = v.wg;
          if (q8 && !bn.empty()) continue;   // 8-bit B: always 128 wide
          if (q8 && !wg.empty()) continue;   // 8-bit B: no 16-bit copy, no P13
          set_gemm_precision(f16);
          setenv("LILY_GEMM_BN", v.bn, 1);
          setenv("LILY_GEMM_WG16", v.wg, 1);
          set_abl(p1 == 1   ? std::vector<std::string>{"P1"}
                  : p1 == 2 ? std::vector<std::string>{"P1w", "P8"}
                            : std::vector<std::string>{});
          gpu->fill_zero(yd, 4LL * T * N);
          gpu->matmul(s.dev, xd, T, yd);
          gpu->copy_to_host(y.data(), yd, 4LL * T * N);
          std::string same;
          if (wg == "0") ymma = y;
          if (wg == "1" || wg == "2") {
            double md = 0;
            for (size_t i = 0; i < y.size(); ++i) md = std::max(md, double(std::fabs(y[i] - ymma[i])));
            same = md == 0 ? "  == mma.sync P8" : "  differs from mma.sync P8 by " + std::to_string(md);
          }
          if (bn == "128") y128 = y;
          if (bn == "256") {
            double md = 0;
            for (size_t i = 0; i < y.size(); ++i) md = std::max(md, double(std::fabs(y[i] - y128[i])));
            same = md == 0 ? "  == BN128" : "  differs from BN128 by " + std::to_string(md);
          }
          Err e{}, ee{};
          for (size_t i = 0; i < slices.size(); ++i) {
            const Err ei = compare(y.data() + slices[i].first, N, ref[i].data(), slices[i].second,
                                   slices[i].second, all_rows(T));
            const Err ej = compare(y.data() + slices[i].first, N, eref[f16][i].data(), slices[i].second,
                                   slices[i].second, all_rows(T));
            e.rms = std::max(e.rms, ei.rms);
            e.maxrel = std::max(e.maxrel, ei.maxrel);
            e.finite = e.finite && ei.finite;
            ee.rms = std::max(ee.rms, ej.rms);
            ee.maxrel = std::max(ee.maxrel, ej.maxrel);
            ee.finite = ee.finite && ej.finite;
          }
          char what[160];
          std::snprintf(what, sizeof what, "gemm %-26s %6dx%-4d T=%-4d %s %s%s%s", s.name.c_str(), N, K, T,
                        f16 ? "fp16" : "bf16", p1 == 1 ? "P1 off" : p1 == 2 ? "fused mma.sync" : f16 ? "default" : "",
                        bn.empty() ? "" : " BN", v.bn);
          if (!wg.empty()) std::snprintf(what + std::strlen(what), sizeof what - std::strlen(what), " P13 %s",
                                         wg == "1" ? "wgmma" : wg == "2" ? "wgmma tma" : "off");
          tally.report(what, e, ee, same, K);
        }
      }
    }
    unsetenv("LILY_GEMM_BN");
    unsetenv("LILY_GEMM_WG16");
    set_abl({});

    // ---- MoE block ----
    const MoeWeights &hm = hg.mlp, &dm = dg.mlp;
    const int H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
    for (int T : {16, 200, 1024}) {
      const std::vector<float> x = random_vec(int64_t(T) * H, uint32_t(T * 31 + 5), 1.7f);
      std::vector<float> ref(size_t(T) * H), logits(size_t(T) * E), y(size_t(T) * H);
      std::vector<float> eref[2] = {std::vector<float>(size_t(T) * H), std::vector<float>(size_t(T) * H)};
      std::vector<float> eref32[2] = {std::vector<float>(size_t(T) * H), std::vector<float>(size_t(T) * H)};
      std::vector<float> elogits[2] = {std::vector<float>(size_t(T) * E), std::vector<float>(size_t(T) * E)};
      cpu->moe(c, hm, x.data(), T, ref.data());
      cpu->matmul(hm.gate, x.data(), T, logits.data());
      for (int f = 0; f < 2; ++f) {
        emu[f]->moe(c, hm, x.data(), T, eref[f].data());
        emu32[f]->moe(c, hm, x.data(), T, eref32[f].data());
      }
      // The emulated routers: bf16 mode, split precision; fp16 mode, P68's fp16 operands (the prefill router; T >= 16).
      emu[0]->matmul(hm.gate, x.data(), T, elogits[0].data());
      {
        ThreadPool pool;
        qmatmul_emulated(GemmEmu::kFp16, hm.gate, x.data(), T, elogits[1].data(), pool, true);
      }
      gpu->copy_from_host(xd, x.data(), 4LL * T * H);
      // One MoE block on the GPU (current switches) into y, compared with the f32 reference and with
      // `emu` (the CPU emulation of the GPU's operand rounding). Tokens whose top-k set differs from
      // the reference routing (router near-ties) are excluded from the error and counted in diff;
      // more than 2% of them is a failure by itself. `esame` uses the emulated router's routing.
      // emu_ref / emu_ref32: the emulation with the slot rows in fp16 (P16) / f32, whichever the GPU used.
      // f16: which emulated router's routing `esame` follows (the GPU's precision mode).
      auto run_moe_case = [&](const std::vector<float>& emu_ref16, const std::vector<float>& emu_ref32, int& diff,
                              Err& e, Err& ee, bool f16 = true) {
        gpu->fill_zero(yd, 4LL * T * H);
        gpu->moe(c, dm, xd, T, yd);
        gpu->copy_to_host(y.data(), yd, 4LL * T * H);
        const std::vector<float>& emu_ref = cuda_tools::last_moe_slot16(*gpu) ? emu_ref16 : emu_ref32;
        const std::vector<int32_t> ids = cuda_tools::last_moe_ids(*gpu);
        std::vector<int> same, esame;
        diff = 0;
        for (int t = 0; t < T; ++t) {
          std::vector<int> a = topk_set(logits.data() + int64_t(t) * E, E, k);
          std::vector<int> ae = topk_set(elogits[f16].data() + int64_t(t) * E, E, k);
          std::vector<int> b;
          if (ids.size() == size_t(T) * k) b.assign(ids.begin() + int64_t(t) * k, ids.begin() + int64_t(t + 1) * k);
          std::sort(b.begin(), b.end());
          if (a == b) same.push_back(t);
          else ++diff;
          if (ae == b) esame.push_back(t);
        }
        e = compare(y.data(), H, ref.data(), H, H, same);
        ee = compare(y.data(), H, emu_ref.data(), H, H, esame);
        if (diff > std::max(1, T / 50)) e.finite = false;
        // Likewise against the emulation's own routing: an emulated router that is wrong (not near-ties) leaves
        // esame short, and the comparison over the tokens left would pass for nothing.
        if (T - int(esame.size()) > std::max(1, T / 50)) ee.finite = false;
      };
      struct Variant {
        const char* tile;
        bool p2off;
        bool f16;
        bool mmasync = false;   // P1w off: fp16 on the mma.sync kernel instead of wgmma
        const char* bn = "";    // LILY_GEMM_BN (mma.sync only; "": P10's choice, 256 unless ablated)
      };
      // P10: every mma.sync configuration with 128- and 256-wide tiles forced; the 256 case is
      // compared with the 128 case just before it (same MMAs, same k-order: expect bitwise equal).
      std::vector<float> y128(size_t(T) * H);
      const char* try_env = std::getenv("LILY_TRY");   // restored after the variants (the opt-in ones set it)
      const std::string try0 = try_env ? try_env : "";
      for (const Variant& v :
           {Variant{"", false, true}, Variant{"32", false, true}, Variant{"64", false, true},
            Variant{"128", false, true}, Variant{"", true, true}, Variant{"", false, true, true},
            Variant{"32", false, true, true}, Variant{"64", false, true, true}, Variant{"128", false, true, true},
            Variant{"", false, false}, Variant{"32", false, false}, Variant{"128", false, false},
            Variant{"", true, false}, Variant{"", false, true, true, "128"}, Variant{"", false, true, true, "256"},
            Variant{"32", false, true, true, "128"}, Variant{"32", false, true, true, "256"},
            Variant{"64", false, true, true, "128"}, Variant{"64", false, true, true, "256"},
            // The down GEMM's forms (bn "P...": LILY_GEMM_BN unset, the ids named switched on through LILY_TRY,
            // "-ID" switched off; "P" alone: the default, P46-P48) must equal BN128 bit for bit.
            Variant{"64", false, true, true, "P"}, Variant{"64", false, true, true, "P,-P46"},
            Variant{"64", false, true, true, "P,-P47"}, Variant{"64", false, true, true, "P,-P48"},
            Variant{"64", false, true, true, "P,-P46,-P47,-P48"},
            Variant{"128", false, true, true, "128"}, Variant{"128", false, true, true, "256"},
            Variant{"", true, true, true, "128"}, Variant{"", true, true, true, "256"},
            // P10 at 512 (the MoE's grouped GEMMs; tile 128 runs 256 wide): compared with the 128 case
            // just before it.
            Variant{"", true, true, true, "512"}, Variant{"", false, true, true, "128"},
            Variant{"", false, true, true, "512"}, Variant{"32", false, true, true, "128"},
            Variant{"32", false, true, true, "512"}, Variant{"64", false, true, true, "128"},
            Variant{"64", false, true, true, "512"}, Variant{"128", false, true, true, "128"},
            Variant{"128", false, true, true, "512"},
            Variant{"", false, false, false, "128"}, Variant{"", false, false, false, "256"},
            Variant{"32", false, false, false, "128"}, Variant{"32", false, false, false, "256"},
            Variant{"128", false, false, false, "128"}, Variant{"128", false, false, false, "256"}}) {
        if (p14) break;
        const std::string bn = v.bn;
        setenv("LILY_MOE_TILE", v.tile, 1);
        setenv("LILY_GEMM_WGMMA_GRP", "1", 1);   // the grouped GEMMs' wgmma form stays tested (off by default)
        const bool opt_in = !bn.empty() && bn[0] == 'P';
        std::vector<std::string> off;
        std::string tries;   // opt_in: the ids to switch on (LILY_TRY); "-ID": switched off
        if (opt_in) {
          for (const std::string& id : split_list(bn)) {
            if (id[0] == '-') off.push_back(id.substr(1));
            else if (id != "P") tries += (tries.empty() ? "" : ",") + id;
          }
        }
        setenv("LILY_GEMM_BN", opt_in ? "" : v.bn, 1);
        if (opt_in) setenv("LILY_TRY", tries.c_str(), 1);
        else if (try0.empty()) unsetenv("LILY_TRY");
        else setenv("LILY_TRY", try0.c_str(), 1);
        set_gemm_precision(v.f16);
        if (v.p2off) off.push_back("P2");
        if (v.mmasync) off.push_back("P1w");
        set_abl(off);
        int diff = 0;
        Err e, ee;
        run_moe_case(eref[v.f16], eref32[v.f16], diff, e, ee, v.f16);
        std::string ident;
        if (bn == "128") y128 = y;
        if (bn == "256" || bn == "512" || opt_in) {
          double md = 0;
          for (size_t i = 0; i < y.size(); ++i) md = std::max(md, double(std::fabs(y[i] - y128[i])));
          ident = md == 0 ? "  == BN128" : "  differs from BN128 by " + std::to_string(md);
          if (opt_in && md != 0) {   // the same MMAs in the same k-order as BN128: any difference is a bug
            char b[200];
            std::snprintf(b, sizeof b, "FAIL moe T=%-4d tile %s %s differs from BN128 by %.3g", T, v.tile, v.bn, md);
            std::printf("%s\n", b);
            tally.fail += 1;
            tally.failed.push_back(b);
          }
        }
        char what[160], extra[160];
        std::snprintf(what, sizeof what, "moe T=%-4d tile %-4s %s %s%s%s", T, *v.tile ? v.tile : "auto",
                      v.f16 ? (v.mmasync ? "fp16 P1w off" : "fp16 wgmma") : "bf16",
                      v.p2off ? "P2 off (host routing)" : "", bn.empty() ? "" : " BN", v.bn);
        std::snprintf(extra, sizeof extra, "  routing differs on %d/%d tokens%s%s", diff, T,
                      diff > std::max(1, T / 50) ? " (too many)" : "", ident.c_str());
        tally.report(what, e, ee, extra, 0,
                     v.f16 ? (cuda_tools::last_moe_slot16(*gpu) ? kEmuRmsMoeSlot16 : kEmuRmsBound) : kEmuRmsMoeBf16);
      }
      if (try0.empty()) unsetenv("LILY_TRY");
      else setenv("LILY_TRY", try0.c_str(), 1);
      // P14: the grouped GEMMs on the wgmma kernel (LILY_MOE_WG=1), fp16, each case against the CPU
      // references as above and against the engine's mma.sync path (LILY_MOE_WG=0, P1w off) in the
      // same configuration just before it.
      unsetenv("LILY_GEMM_WGMMA_GRP");
      unsetenv("LILY_GEMM_BN");
      set_gemm_precision(true);
      std::vector<float> ymma(size_t(T) * H);
      // y against ref bit for bit (the same products in the same order: any difference is a bug), printed and tallied.
      auto same_bits = [&](const std::vector<float>& ref, const std::string& what, const std::string& same_as) {
        double m = y.size() == ref.size() ? 0 : 1;
        for (size_t i = 0; i < y.size() && i < ref.size(); ++i) m = std::max(m, double(std::fabs(y[i] - ref[i])));
        const std::string line = (m == 0 ? "PASS " : "FAIL ") + what +
                                 (m == 0 ? " == " + same_as + " bit for bit" : " differs from " + same_as + " by " + std::to_string(m));
        std::printf("%s\n", line.c_str());
        if (m == 0) {
          tally.pass += 1;
        } else {
          tally.fail += 1;
          tally.failed.push_back(line);
        }
      };
      for (const char* tile : {"", "32", "64", "128", "host", "host64"}) {
        const std::string ts = tile;
        const bool host = ts.rfind("host", 0) == 0;
        const std::string tl = host ? ts.substr(4) : ts;
        setenv("LILY_MOE_TILE", tl.c_str(), 1);
        // P16 off here: P14 / P15-both write f32 slot rows, so the mma.sync case they are compared with
        // bit for bit must too (the default, P16 on, is covered by the variants above).
        const std::vector<std::string> off0 =
            host ? std::vector<std::string>{"P1w", "P2", "P16"} : std::vector<std::string>{"P1w", "P16"};
        set_abl(off0);
        // wg 4 (tile 128 only): P15 both with P18 off, i.e. P17's kernel (P18's is the default at 128);
        // wg 5 / 6: P15 both with P34 off (P32's one-step stages) / P32 off (P18's loop as first written).
        // wg 7: P15 both with P38 off (wgmma N = 128 for every tile), which must equal wg 3 (P38: N = the tile's
        // rows rounded up to 32) bit for bit.
        std::vector<float> yp38;
        for (int wg = 0; wg < 8; ++wg) {
          if (wg >= 4 && tl != "128") continue;
          if (wg == 4) set_abl({"P1w", "P16", "P18"});
          if (wg == 5) set_abl({"P1w", "P16", "P34"});
          if (wg == 6) set_abl({"P1w", "P16", "P32"});
          if (wg == 7) set_abl({"P1w", "P16", "P38"});
          char what[160];
          std::snprintf(what, sizeof what, "moe T=%-4d tile %-4s fp16 %s P14 %s", T, tl.empty() ? "auto" : tl.c_str(),
                        host ? "P2 off (host routing)" : "",
                        wg == 0   ? "off (mma.sync)"
                        : wg == 1 ? "wgmma (LILY_MOE_WG=1)"
                        : wg == 2 ? "P15 rs gate/up (LILY_MOE_WG=2)"
                        : wg == 3 ? "P15 rs both (LILY_MOE_WG=3)"
                        : wg == 4 ? "P15 rs both, P18 off (P17)"
                        : wg == 5 ? "P15 rs both, P34 off (P32)"
                        : wg == 6 ? "P15 rs both, P32 off (P18)"
                                  : "P15 rs both, P38 off (wgmma N 128)");
          std::printf("  running %s\n", what);
          std::fflush(stdout);
          setenv("LILY_MOE_WG", std::to_string(wg >= 4 ? 3 : wg).c_str(), 1);
          int diff = 0;
          Err e, ee;
          run_moe_case(eref[1], eref32[1], diff, e, ee);
          if ((wg == 2 || wg == 3) && tl == "128") {
            // P50 (default: the P34 gate/up kernel's odd nibble pairs unpacked in place) must not change a bit.
            const std::vector<float> y0 = y;
            std::vector<std::string> off50 = off0;
            off50.push_back("P50");
            set_abl(off50);
            int d50 = 0;
            Err e50, ee50;
            run_moe_case(eref[1], eref32[1], d50, e50, ee50);
            char b[200];
            std::snprintf(b, sizeof b, "moe T=%-4d tile %s%s wg %d: P50 off", T, tl.c_str(), host ? " host" : "", wg);
            same_bits(y0, b, "P50 on");
            set_abl(off0);
            y = y0;
          }
          if (wg == 3) yp38 = y;
          if (wg == 7) {
            char b[200];
            std::snprintf(b, sizeof b, "moe T=%-4d tile %s P38 off", T, tl.c_str());
            same_bits(yp38, b, "P38 (wg 3)");
          }
          std::string ident;
          if (wg == 0) {
            ymma = y;
          } else {
            double md = 0, mr = 0;
            for (size_t i = 0; i < y.size(); ++i) {
              md = std::max(md, double(std::fabs(y[i] - ymma[i])));
              mr = std::max(mr, double(std::fabs(ymma[i])));
            }
            const Err dm2 = compare(y.data(), H, ymma.data(), H, H, all_rows(T));
            char b[160];
            std::snprintf(b, sizeof b, "  vs mma.sync: max |diff| %.3g (%.2e of max), rms %.2e%s", md,
                          md / std::max(mr, 1e-300), dm2.rms, md == 0 ? " (== mma.sync)" : "");
            ident = b;
          }
          char extra[320];
          std::snprintf(extra, sizeof extra, "  routing differs on %d/%d tokens%s%s", diff, T,
                        diff > std::max(1, T / 50) ? " (too many)" : "", ident.c_str());
          tally.report(what, e, ee, extra, 0, kEmuRmsBound);
        }
        if (tl == "128" && !host) {
          // The MoE block with LILY_MOE_WG, LILY_MOE_TILE, LILY_MOE_TILE_DOWN ("": unset) and LILY_TRY extended by
          // `tries` for one run, the switches off0 and also_off off (with p16, P16 on); y holds its output, e / ee its
          // errors against the references.
          auto moe_with = [&](const char* wg, const char* tile, const char* tile_down, const char* tries, Err& e, Err& ee,
                              const std::vector<std::string>& also_off = {}, bool p16 = false) {
            setenv("LILY_MOE_WG", wg, 1);
            setenv("LILY_MOE_TILE", tile, 1);
            if (*tile_down) setenv("LILY_MOE_TILE_DOWN", tile_down, 1);
            else unsetenv("LILY_MOE_TILE_DOWN");
            const std::string t = try0.empty() ? std::string(tries) : *tries ? try0 + "," + tries : try0;
            if (t.empty()) unsetenv("LILY_TRY");
            else setenv("LILY_TRY", t.c_str(), 1);
            std::vector<std::string> off;
            for (const std::string& id : off0)
              if (!p16 || id != "P16") off.push_back(id);
            off.insert(off.end(), also_off.begin(), also_off.end());
            set_abl(off);   // LILY_TRY is read when the switches are set
            int d = 0;
            run_moe_case(eref[1], eref32[1], d, e, ee);
          };
          Err e0, ee0, e1, ee1;
          char b[200];
          // P53: the gate/up GEMM at M-tile 32 on the P34 kernel's 8-stage form must equal the same GEMM at M-tile 128
          // (P38: each tile's wgmma N = its rows rounded up to 32) bit for bit, the down GEMM at M-tile 32 in both.
          moe_with("2", "128", "32", "", e0, ee0);
          const std::vector<float> y0 = y;
          moe_with("2", "32", "32", "", e1, ee1);   // P53 (default on) takes the M-tile 32 gate/up GEMM
          std::snprintf(b, sizeof b, "moe T=%-4d P53 (gate/up M-tile 32, 8 stages)", T);
          same_bits(y0, b, "M-tile 128");
          // P15's both-GEMMs form at M-tile 128 (LILY_MOE_WG=3: the down GEMM on the M-tile 128 kernel, wgmma N = the
          // tile's rows rounded up to 32), f32 slot rows: P55 below must equal it bit for bit.
          moe_with("3", "128", "", "", e0, ee0);
          const std::vector<float> y2 = y;
          // P55: the down GEMM at M-tile 128 with the tile's activations resident, 2, 4 and 8 weight blocks per
          // CTA: with P16 off (f32 slot rows) the same bits as P15's both-GEMMs form at M-tile 128 (y2 above); with
          // P16 on (fp16 slot rows) against the references.
          for (const char* nb : {"2", "4", "8"}) {
            setenv("LILY_P55_NB", nb, 1);
            moe_with("2", "128", "", "P55", e1, ee1);
            std::snprintf(b, sizeof b, "moe T=%-4d P55 (down, activations resident, %s blocks per CTA), P16 off", T, nb);
            same_bits(y2, b, "P15 both at M-tile 128");
            moe_with("2", "128", "", "P55", e1, ee1, {"P78"}, true);   // P16 on: fp16 slot rows (P78 off)
            const bool s16 = cuda_tools::last_moe_slot16(*gpu);
            std::snprintf(b, sizeof b, "moe T=%-4d P55 (%s blocks per CTA), P16 on (%s slot rows), vs the references", T, nb,
                          s16 ? "fp16" : "f32: WRONG");
            if (!s16) ee1.finite = false;   // P55 with P16 must write fp16 slot rows
            tally.report(b, e1, ee1, "", 0, s16 ? kEmuRmsMoeSlot16 : kEmuRmsBound);
            // P78 (default on): the same fp16 slot rows stored 16 bytes per lane through shared memory: the same bits.
            const std::vector<float> y16 = y;
            moe_with("2", "128", "", "P55", e1, ee1, {}, true);
            std::snprintf(b, sizeof b, "moe T=%-4d P55 (%s blocks per CTA), P16 on, P78 (staged stores)", T, nb);
            same_bits(y16, b, "P78 off");
          }
          unsetenv("LILY_P55_NB");
          // P56: the tile lists reordered (full tiles first, the partial ones largest first) change no bit, with the
          // automatic tiles (T = 1,024: both GEMMs at M-tile 128, the down GEMM on P55) and with P55 off (T = 1,024: the
          // down GEMM on its own list at M-tile 64); taken here from 0 rows per expert (T = 16 and 200 too).
          setenv("LILY_P56_MIN_ROWS", "0", 1);
          for (const bool p55 : {true, false}) {
            const std::vector<std::string> off55 = p55 ? std::vector<std::string>{} : std::vector<std::string>{"P55"};
            std::vector<std::string> off56 = off55;
            off56.push_back("P56");
            moe_with("2", "", "", "", e0, ee0, off56);
            const std::vector<float> y3 = y;
            moe_with("2", "", "", "", e1, ee1, off55);
            std::snprintf(b, sizeof b, "moe T=%-4d P56 (tile order)%s", T, p55 ? "" : ", P55 off");
            same_bits(y3, b, "P56 off");
          }
          unsetenv("LILY_P56_MIN_ROWS");

          if (try0.empty()) unsetenv("LILY_TRY");   // the loop's environment back
          else setenv("LILY_TRY", try0.c_str(), 1);
          set_abl(off0);
          setenv("LILY_MOE_TILE", tl.c_str(), 1);
        }
      }
      unsetenv("LILY_MOE_WG");
      set_abl({});
    }
    unsetenv("LILY_MOE_TILE");
    unsetenv("LILY_GEMM_WGMMA_GRP");
    unsetenv("LILY_GEMM_BN");
    set_abl({});
    unsetenv("LILY_GEMM_BF16");
    if (!tally.failed.empty()) {
      std::printf("failed cases:\n");
      for (const std::string& f : tally.failed) std::printf("%s\n", f.c_str());
    }
    std::printf("cuda-test-gemm: %s (%d passed, %d failed; bounds rms <= %.0e, max <= %.0e of max|ref|; "
                "vs emulated rms <= max(%.0e, %.0e*K), max <= %.0e)\n",
                tally.fail ? "FAIL" : "PASS", tally.pass, tally.fail, kRmsBound, kMaxBound, kEmuRmsBound, kEmuRmsPerK,
                kEmuMaxBound);
    return tally.fail ? 1 : 0;
  }

  // ---- bench ----
  const double peak = 790.0;   // H200 nominal dense bf16 tensor-core TFLOP/s
  {
    // P14: the MoE block with the grouped GEMMs on mma.sync (LILY_MOE_WG=0, the engine's default) and
    // on the wgmma kernel (=1), tile auto / 64 / 128, alternating in one process (3 rounds, median of
    // 20 each); then the per-stage split (profiler events, mean of 5 calls) of each.
    set_abl({"P1w"});
    set_gemm_precision(true);
    const int H = c.hidden_size, I = c.moe_intermediate_size, k = c.num_experts_per_tok;
    gpu->fill_zero(xd, 4 * max_x);
    cuda_tools::fill_uniform(*gpu, xd, max_x, 1.7f, 7);
    std::printf("P14 bench: MoE block, LILY_MOE_WG=0 (mma.sync) vs 1 (P14 wgmma) vs 2 (P15 gate/up) vs 3 (P15 both), 3 alternating rounds of median-of-20\n");
    const char* only_env = std::getenv("LILY_P14_BENCH_T");   // one T only (device-time budgets)
    const int only_t = only_env ? std::atoi(only_env) : 0;
    for (int T : {1024, 2048, 4096}) {
      if (only_t > 0 && T != only_t) continue;
      const double flop = 2.0 * T * (double(k) * 3 * I * H + 3.0 * I * H + double(c.num_experts) * H);
      struct BV {
        const char* name;
        const char* wg;
        const char* tile;
      };
      // Rows of 4: mma.sync, P14, P15 for gate/up only, P15 for both, at one tile setting (P15 at 128
      // runs P18's kernel, or with P18 off, the last row of 4, P17's).
      const BV vs[18] = {{"mma.sync auto", "0", ""},    {"wgmma auto", "1", ""},    {"P15 gu auto", "2", ""},
                         {"P15 rs auto", "3", ""},       {"mma.sync t64", "0", "64"}, {"wgmma t64", "1", "64"},
                         {"P15 gu t64", "2", "64"},      {"P15 rs t64", "3", "64"},   {"mma.sync t128", "0", "128"},
                         {"wgmma t128", "1", "128"},     {"P15 gu t128", "2", "128"}, {"P15 rs t128", "3", "128"},
                         {"-P18 gu auto", "2", ""},      {"-P18 rs auto", "3", ""},   {"-P18 gu t128", "2", "128"},
                         {"-P18 rs t128", "3", "128"}, {"-P32 gu auto", "2", ""},
                         {"-P34 gu auto", "2", ""}};
      constexpr int NV = 18;
      auto set_variant = [&](int i) {
        setenv("LILY_MOE_WG", vs[i].wg, 1);
        setenv("LILY_MOE_TILE", vs[i].tile, 1);
        set_abl(i == 17   ? std::vector<std::string>{"P1w", "P34"}
                : i == 16 ? std::vector<std::string>{"P1w", "P32"}
                : i >= 12 ? std::vector<std::string>{"P1w", "P18"}
                          : std::vector<std::string>{"P1w"});
      };
      // LILY_P14_BENCH_ONLY=2,16: only these rows (device-time budgets).
      std::vector<bool> run_v(NV, true);
      if (const char* only_v = std::getenv("LILY_P14_BENCH_ONLY")) {
        std::fill(run_v.begin(), run_v.end(), false);
        for (const char* p = only_v; *p;) {
          char* end = nullptr;
          const long v = std::strtol(p, &end, 10);
          if (end == p) break;
          if (v >= 0 && v < NV) run_v[v] = true;
          p = *end ? end + 1 : end;
        }
      }
      std::vector<double> best(NV, 1e30);
      for (int round = 0; round < 3; ++round)
        for (int i = 0; i < NV; ++i) {
          if (!run_v[i]) continue;
          set_variant(i);
          const double ms =
              median(cuda_tools::time_ops(*gpu, [&] { gpu->moe(c, dev.layers[0].mlp, xd, T, yd); }, 3, 20));
          best[i] = std::min(best[i], ms);
          std::printf("  round %d moe T=%-4d %-14s %8.3f ms\n", round, T, vs[i].name, ms);
          std::fflush(stdout);
        }
      for (int i = 0; i < NV; ++i) {
        if (!run_v[i]) continue;
        const double tf = flop / (best[i] * 1e-3) / 1e12;
        const int base = i < 12 ? i - i % 4 : 0;   // the row's mma.sync counterpart
        std::printf("P14 moe T=%-4d %-14s %8.3f ms (best of 3)  %6.1f TFLOP/s  %5.3fx mma.sync\n", T, vs[i].name,
                    best[i], tf, run_v[base] ? best[base] / best[i] : 0.0);
      }
      for (int i = 0; i < NV; ++i) {
        if (!run_v[i]) continue;
        set_variant(i);
        gpu->moe(c, dev.layers[0].mlp, xd, T, yd);   // warm
        cuda_tools::set_profiling(*gpu, true);
        for (int r = 0; r < 5; ++r) gpu->moe(c, dev.layers[0].mlp, xd, T, yd);
        for (const auto& op : cuda_tools::take_profile(*gpu))
          std::printf("    T=%-4d %-14s %-28s %8.3f ms\n", T, vs[i].name, op.name.c_str(), op.ms / op.calls);
        cuda_tools::set_profiling(*gpu, false);
      }
    }
    unsetenv("LILY_MOE_WG");
    unsetenv("LILY_MOE_TILE");
    set_abl({});
    if (p14) return 0;
  }
  std::printf("bench: median of 20 after 3 warm-up calls; whole op = x conversion + GEMM; "
              "nominal bf16 dense peak %.0f TFLOP/s\n", peak);
  gpu->fill_zero(xd, 4 * max_x);
  cuda_tools::fill_uniform(*gpu, xd, max_x, 1.7f, 7);
  for (const Shape& s : shapes) {
    const int N = int(s.host.rows), K = int(s.host.cols);
    const int T = s.big ? 128 : 4096;
    if (int64_t(T) * N > max_y) continue;
    // fp16 (auto tile), bf16, fp16 with P1 off, fp16 with the M-tile forced to 64 / 128; matrices
    // under 64 rows run the f32 GEMV with P7 off (timed so) and on the GEMM (P7 on, T >= 256).
    // v >= 6: the same fp16 cases on the mma.sync kernel (P1w off); fp16 defaults to wgmma.
    const char* names[9] = {"fp16 wgmma", "bf16",        "fp16 P1 off",  "wgmma BM=64", "wgmma BM=128",
                            "fp16 on GEMM", "mma.sync",  "mma.sync BM64", "mma.sync BM128"};
    for (int v = 0; v < 9; ++v) {
      const bool small = N < 64;
      if ((small && (v == 3 || v == 4 || v >= 6)) || (!small && v == 5)) continue;
      set_gemm_precision(v != 1);
      set_abl(v == 2   ? std::vector<std::string>{"P1"}
              : v >= 6 ? std::vector<std::string>{"P1w"}
              : small && v == 0 ? std::vector<std::string>{"P7"}   // the f32 GEMV (P7 off)
                                : std::vector<std::string>{});
      setenv("LILY_GEMM_BM", v == 3 || v == 7 ? "64" : v == 4 || v == 8 ? "128" : "", 1);
      setenv("LILY_GEMM_SMALL_N", v == 5 ? "0" : "", 1);
      const double ms = median(cuda_tools::time_ops(*gpu, [&] { gpu->matmul(s.dev, xd, T, yd); }, 3, 20));
      const double tf = 2.0 * T * N * K / (ms * 1e-3) / 1e12;
      std::printf("gemm %-26s %6dx%-4d T=%-4d %-12s %8.3f ms  %6.1f TFLOP/s (%4.1f%% of peak)\n", s.name.c_str(), N,
                  K, T, small && v == 0 ? "f32 GEMV" : names[v], ms, tf, 100 * tf / peak);
    }
    // P10: 128- vs 256-wide tiles on mma.sync (LILY_GEMM_BN forced), fp16: the engine's path at this
    // T (P8: dequantise, then 16-bit B), with the 256-wide grid rasterised in bands of 8 / 16 M tiles,
    // and the fused 4-bit path (P8 and P1w off). Whole op as above, then the GEMM kernel alone
    // (profiler events around the launch, mean of 10 calls).
    if (N >= 64 && !s.big) {
      // "P13 wg16" / "P13 wg16 tma": the P8 path on the wgmma kernel (LILY_GEMM_WG16=1 / 2: cp.async /
      // TMA loads; the other rows force it off).
      struct BV {
        const char* name;
        const char* bn;
        const char* raster;
        bool fused;
        const char* wg = "0";
      };
      for (const BV& b : {BV{"P8 BN128", "128", "", false}, BV{"P8 BN256", "256", "", false},
                          BV{"P13 wg16", "", "", false, "1"}, BV{"P13 wg16 tma", "", "", false, "2"},
                          BV{"P8 BN256 r8", "256", "8", false},
                          BV{"P8 BN256 r16", "256", "16", false}, BV{"fused BN128", "128", "", true},
                          BV{"fused BN256", "256", "", true}}) {
        setenv("LILY_GEMM_WG16", b.wg, 1);
        set_gemm_precision(true);
        set_abl(b.fused ? std::vector<std::string>{"P1w", "P8"} : std::vector<std::string>{"P1w"});
        setenv("LILY_GEMM_BM", "", 1);
        setenv("LILY_GEMM_SMALL_N", "", 1);
        setenv("LILY_GEMM_BN", b.bn, 1);
        setenv("LILY_GEMM_RASTER", b.raster, 1);
        auto op = [&] { gpu->matmul(s.dev, xd, T, yd); };
        const double ms = median(cuda_tools::time_ops(*gpu, op, 3, 20));
        cuda_tools::set_profiling(*gpu, true);
        for (int i = 0; i < 10; ++i) op();
        double kms = 0;
        for (const auto& o : cuda_tools::take_profile(*gpu))
          if (o.name.rfind("gemm ", 0) == 0) kms += o.ms / o.calls;   // not gemm.convert / gemm.dequant
        cuda_tools::set_profiling(*gpu, false);
        const double flop = 2.0 * T * N * K;
        std::printf("gemm %-26s %6dx%-4d T=%-4d %-12s %8.3f ms  %6.1f TFLOP/s (%4.1f%% of peak) | GEMM kernel %7.3f ms "
                    "%6.1f TFLOP/s\n",
                    s.name.c_str(), N, K, T, b.name, ms, flop / (ms * 1e-3) / 1e12, 100 * flop / (ms * 1e-3) / 1e12 / peak,
                    kms, flop / (kms * 1e-3) / 1e12);
      }
      unsetenv("LILY_GEMM_BN");
      unsetenv("LILY_GEMM_RASTER");
      unsetenv("LILY_GEMM_WG16");
    }
    // Split of one call into conversion and GEMM (profiler events), fp16 vs bf16: where the fp16
    // path's extra time goes.
    if (N >= 64) {
      setenv("LILY_GEMM_BM", "", 1);
      set_abl({});
      for (int f16 = 1; f16 >= 0; --f16) {
        set_gemm_precision(f16);
        gpu->matmul(s.dev, xd, T, yd);   // warm
        cuda_tools::set_profiling(*gpu, true);
        gpu->matmul(s.dev, xd, T, yd);
        std::printf("    %s:", f16 ? "fp16" : "bf16");
        for (const auto& op : cuda_tools::take_profile(*gpu)) std::printf("  %s %.3f ms", op.name.c_str(), op.ms / op.calls);
        std::printf("\n");
        cuda_tools::set_profiling(*gpu, false);
      }
    }
  }
  unsetenv("LILY_GEMM_BM");
  unsetenv("LILY_GEMM_SMALL_N");
  set_abl({});
  set_gemm_precision(true);
  const int H = c.hidden_size, I = c.moe_intermediate_size, k = c.num_experts_per_tok;
  for (int T : {512, 1024, 2048, 4096}) {
    const double flop = 2.0 * T * (double(k) * 3 * I * H + 3.0 * I * H + double(c.num_experts) * H);
    // P10 variants: "BN128 …" / "BN256 …" force the grouped GEMMs' width (tile auto, or 32/64/128), on
    // mma.sync as in the engine (P1w off: this tool opts into wgmma, which would take gate/up).
    for (const char* tile : {"", "32", "64", "128", "P2", "bf16", "P1w", "P1w32", "P1w64", "P1w128", "BN128",
                             "BN256", "BN128 t64", "BN256 t64", "BN256 t32", "BN256 t128", "BN128 bf16",
                             "BN256 bf16", "BN512", "BN512 t64", "BN512 t32"}) {
      const std::string ts = tile;
      if (ts.rfind("BN", 0) == 0) {
        const bool bf = ts.find("bf16") != std::string::npos;
        const size_t tp = ts.find(" t");
        setenv("LILY_GEMM_BN", ts.substr(2, 3).c_str(), 1);
        setenv("LILY_MOE_TILE", tp == std::string::npos ? "" : ts.substr(tp + 2).c_str(), 1);
        set_gemm_precision(!bf);
        set_abl({"P1w"});
        const double ms =
            median(cuda_tools::time_ops(*gpu, [&] { gpu->moe(c, dev.layers[0].mlp, xd, T, yd); }, 3, 20));
        const double tf = flop / (ms * 1e-3) / 1e12;
        std::printf("moe T=%-4d %-14s %8.3f ms  %6.1f TFLOP/s (%4.1f%% of peak)  %8.0f tok/s per layer\n", T, tile,
                    ms, tf, 100 * tf / peak, T / (ms * 1e-3));
        unsetenv("LILY_GEMM_BN");
        continue;
      }
      const bool p2 = ts == "P2", bf = ts == "bf16", mmasync = ts.rfind("P1w", 0) == 0;
      setenv("LILY_MOE_TILE", p2 || bf ? "" : mmasync ? tile + 3 : tile, 1);
      set_gemm_precision(!bf);
      set_abl(p2 ? std::vector<std::string>{"P2"} : mmasync ? std::vector<std::string>{"P1w"} : std::vector<std::string>{});
      const double ms =
          median(cuda_tools::time_ops(*gpu, [&] { gpu->moe(c, dev.layers[0].mlp, xd, T, yd); }, 3, 20));
      const double tf = flop / (ms * 1e-3) / 1e12;
      std::printf("moe T=%-4d %-14s %8.3f ms  %6.1f TFLOP/s (%4.1f%% of peak)  %8.0f tok/s per layer\n", T,
                  p2 ? "P2 off" : bf ? "bf16 tile auto"
                  : mmasync ? (std::string("mma.sync ") + (tile[3] ? tile + 3 : "auto")).c_str()
                  : *tile ? (std::string("tile ") + tile).c_str() : "tile auto", ms, tf,
                  100 * tf / peak, T / (ms * 1e-3));
    }
    // Per-stage split of the default configuration (profiler events, one call), fp16 then bf16,
    // then fp16 with 128-, 256- and 512-wide tiles forced (P10; mean of 5 calls; 512: the MoE's grouped
    // GEMMs only, tile 128 runs 256 wide).
    unsetenv("LILY_MOE_TILE");
    set_abl({});
    for (int f16 = 1; f16 >= 0; --f16) {
      set_gemm_precision(f16);
      cuda_tools::set_profiling(*gpu, true);
      gpu->moe(c, dev.layers[0].mlp, xd, T, yd);
      for (const auto& op : cuda_tools::take_profile(*gpu))
        std::printf("    %-28s %s %8.3f ms\n", op.name.c_str(), f16 ? "fp16" : "bf16", op.ms / op.calls);
      cuda_tools::set_profiling(*gpu, false);
    }
    set_gemm_precision(true);
    set_abl({"P1w"});
    for (const char* bn : {"128", "256", "512"}) {
      setenv("LILY_GEMM_BN", bn, 1);
      gpu->moe(c, dev.layers[0].mlp, xd, T, yd);   // warm
      cuda_tools::set_profiling(*gpu, true);
      for (int i = 0; i < 5; ++i) gpu->moe(c, dev.layers[0].mlp, xd, T, yd);
      for (const auto& op : cuda_tools::take_profile(*gpu))
        std::printf("    %-28s fp16 BN%s %8.3f ms\n", op.name.c_str(), bn, op.ms / op.calls);
      cuda_tools::set_profiling(*gpu, false);
    }
    unsetenv("LILY_GEMM_BN");
    set_abl({});
  }
  unsetenv("LILY_MOE_TILE");
  return 0;
}

#endif

int cudatest_gemm_main(int argc, char** argv) {
  Options o("cuda-test-gemm", "Check (or --bench) the cuda prefill GEMM and MoE against the cpu backend.",
            {{"seed", "1", "synthetic weights seed"},
             {"threads", "0", "cpu threads"},
             {"bench", "false", "time the GEMM shapes and the MoE block instead of checking", "", true},
             {"p14", "false", "only the P14 cases (grouped wgmma MoE GEMMs): probe + MoE block, or its bench", "", true}});
  if (!o.parse(argc, argv)) return 0;
#ifdef LILY_HAVE_CUDA
  return run(o);
#else
  throw Error("cuda-test-gemm: built without the cuda backend");
#endif
}

RegisterCommand reg{{"cuda-test-gemm", "check the cuda prefill GEMM and MoE against the cpu backend",
                     cudatest_gemm_main}};

}  // namespace
}  // namespace lily
