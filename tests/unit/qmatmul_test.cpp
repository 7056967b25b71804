// qmatmul: every SIMD path (forced per ISA) and the scalar reference against a plain
// dequantise-then-matmul written here from the generator's own codes, scales and biases.
#include "backend/cpu/qmatmul.h"

#include <gtest/gtest.h>

#include "backend/cpu/gemm_emulate.h"

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/common.h"

namespace lily {
namespace {

// A random weight matrix in one storage format plus the values it is meant to hold, computed
// from the generated q, s, b directly (never by unpacking the stored bits).
struct TestMatrix {
  QMatrix W;
  std::vector<uint32_t> codes;
  std::vector<uint16_t> s16, b16, w16;
  std::vector<float> s32, b32, w32;
  std::vector<double> dense;  // [rows, cols] intended weights
  std::vector<double> mag;    // [rows, cols] |s·q| + |b| (affine) or |w|: scale of rounding error
};

float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

TestMatrix make_matrix(WType type, int64_t rows, int64_t cols, int gs, bool sb_f32, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  TestMatrix m;
  m.W.type = type;
  m.W.rows = rows;
  m.W.cols = cols;
  m.W.group_size = gs;
  m.W.sb_f32 = sb_f32;
  m.dense.resize(size_t(rows * cols));
  m.mag.resize(size_t(rows * cols));
  if (type == WType::kBF16 || type == WType::kF32) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = uni(rng);
      if (type == WType::kBF16) {
        m.w16.push_back(f32_to_bf16(v));
        m.dense[size_t(i)] = bf16_to_f32(m.w16.back());
      } else {
        m.w32.push_back(v);
        m.dense[size_t(i)] = v;
      }
      m.mag[size_t(i)] = std::fabs(m.dense[size_t(i)]);
    }
    m.W.data = type == WType::kBF16 ? static_cast<const void*>(m.w16.data()) : m.w32.data();
    return m;
  }
  const int bits = type == WType::kAffine4 ? 4 : 8, per_word = 32 / bits, qmax = (1 << bits) - 1;
  const int64_t groups = cols / gs;
  m.codes.assign(size_t(rows * cols / per_word), 0u);
  std::uniform_int_distribution<int> qd(0, qmax);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      // Negative scales occur in MLX checkpoints (MODEL.md §4.2): half the groups get one.
      float s = (0.002f + 0.05f * std::fabs(uni(rng))) * (rng() % 2 ? -1.0f : 1.0f);
      float b = 0.5f * uni(rng);
      if (sb_f32) {
        m.s32.push_back(s);
        m.b32.push_back(b);
      } else {
        s = round_bf16(s);
        b = round_bf16(b);
        m.s16.push_back(f32_to_bf16(s));
        m.b16.push_back(f32_to_bf16(b));
      }
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
        const int q = qd(rng);
        m.codes[size_t(r * (cols / per_word) + k / per_word)] |= uint32_t(q) << (bits * (k % per_word));
        m.dense[size_t(r * cols + k)] = double(s) * q + double(b);
        m.mag[size_t(r * cols + k)] = std::fabs(double(s) * q) + std::fabs(double(b));
      }
    }
  }
  m.W.data = m.codes.data();
  m.W.scales = sb_f32 ? static_cast<const void*>(m.s32.data()) : m.s16.data();
  m.W.biases = sb_f32 ? static_cast<const void*>(m.b32.data()) : m.b16.data();
  return m;
}

std::vector<float> random_x(int T, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(T * cols));
  for (auto& v : x) v = nd(rng);
  return x;
}

// Expected y and its error scale Σ_k mag·|x| (f32 rounding of any summation order stays far
// below 1e-5 of it, while a single wrong code, scale or group costs ~|s·x_k|, well above).
void expected(const TestMatrix& m, const std::vector<float>& x, int T, std::vector<double>& y,
              std::vector<double>& scale) {
  const int64_t rows = m.W.rows, cols = m.W.cols;
  y.assign(size_t(T * rows), 0.0);
  scale.assign(size_t(T * rows), 0.0);
  for (int t = 0; t < T; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      double acc = 0, sc = 0;
      for (int64_t k = 0; k < cols; ++k) {
        acc += m.dense[size_t(r * cols + k)] * x[size_t(t * cols + k)];
        sc += m.mag[size_t(r * cols + k)] * std::fabs(x[size_t(t * cols + k)]);
      }
      y[size_t(t * rows + r)] = acc;
      scale[size_t(t * rows + r)] = sc;
    }
}

constexpr double kRelTol = 1e-5;

void expect_close(const std::vector<float>& got, const std::vector<double>& want,
                  const std::vector<double>& scale, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    if (!(err <= kRelTol * scale[i] + 1e-12)) {
      ADD_FAILURE() << what << ": y[" << i << "] = " << got[i] << ", want " << want[i]
                    << " (err " << err << ", allowed " << kRelTol * scale[i] << ")";
      ++bad;
    }
  }
}

std::vector<SimdIsa> available_isas() {
  std::vector<SimdIsa> out;
  for (SimdIsa isa : {SimdIsa::kScalar, SimdIsa::kAvx2, SimdIsa::kAvx512})
    if (isa <= cpu_best_isa()) out.push_back(isa);
  return out;
}

struct Variant {
  WType type;
  bool sb_f32;
  const char* name;
};
const Variant kVariants[] = {
    {WType::kAffine4, false, "affine4/bf16-sb"}, {WType::kAffine4, true, "affine4/f32-sb"},
    {WType::kAffine8, false, "affine8/bf16-sb"}, {WType::kAffine8, true, "affine8/f32-sb"},
    {WType::kBF16, false, "bf16"},               {WType::kF32, false, "f32"},
};

TEST(Qmatmul, IsaSelection) {
  const SimdIsa best = cpu_best_isa();
  EXPECT_EQ(simd_isa_from_env(nullptr), best);
  EXPECT_EQ(simd_isa_from_env(""), best);
  EXPECT_EQ(simd_isa_from_env("scalar"), SimdIsa::kScalar);
  EXPECT_EQ(simd_isa_from_env("avx2"), std::min(SimdIsa::kAvx2, best));
  EXPECT_EQ(simd_isa_from_env("avx512"), best);
  EXPECT_THROW(simd_isa_from_env("sse9"), Error);
  const std::string chosen = qmatmul_isa();
  EXPECT_TRUE(chosen == "scalar" || chosen == "avx2" || chosen == "avx512") << chosen;
  std::printf("qmatmul path on this machine: %s (best %s)\n", chosen.c_str(), simd_isa_name(best));
}

TEST(Qmatmul, DequantRowMatchesGenerator) {
  for (const Variant& v : kVariants)
    for (int64_t cols : {64, 576, 2048}) {
      TestMatrix m = make_matrix(v.type, 5, cols, 64, v.sb_f32, 11u + uint32_t(cols));
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < 5; ++r) {
        dequant_row(m.W, r, row.data());
        for (int64_t k = 0; k < cols; ++k)
          ASSERT_NEAR(row[size_t(k)], m.dense[size_t(r * cols + k)], 1e-6 * m.mag[size_t(r * cols + k)] + 1e-30)
              << v.name << " row " << r << " col " << k;
      }
    }
}

// Every format × shape × T through the reference and through each SIMD path.
TEST(Qmatmul, AllPathsMatchDenseAndReference) {
  ThreadPool pool(3);
  const std::vector<SimdIsa> isas = available_isas();
  uint32_t seed = 1;
  for (const Variant& v : kVariants)
    for (int64_t rows : {1, 3, 33, 257})
      for (int64_t cols : {64, 128, 2048, 512 + 64}) {
        TestMatrix m = make_matrix(v.type, rows, cols, 64, v.sb_f32, seed++);
        for (int T : {1, 2, 3, 5, 17}) {
          const std::string tag = std::string(v.name) + " rows=" + std::to_string(rows) +
                                  " cols=" + std::to_string(cols) + " T=" + std::to_string(T);
          const std::vector<float> x = random_x(T, cols, seed++);
          std::vector<double> want, scale;
          expected(m, x, T, want, scale);
          std::vector<float> y(size_t(T * rows), std::numeric_limits<float>::quiet_NaN());
          qmatmul_ref(m.W, x.data(), T, y.data());
          expect_close(y, want, scale, "ref " + tag);
          for (SimdIsa isa : isas) {
            // gs = 64 and cols % 64 == 0: every path must really run its own kernel here.
            ASSERT_EQ(qmatmul_effective_isa(isa, m.W), isa) << tag;
            std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
            qmatmul_with(isa, m.W, x.data(), T, y.data(), pool);
            expect_close(y, want, scale, std::string(simd_isa_name(isa)) + " " + tag);
          }
        }
      }
}

// Other MLX group sizes (power-of-two ones run the SIMD kernels; others fall back to the portable
// kernel), a long prompt (T = 64: several token blocks per row chunk) and a single-thread pool.
TEST(Qmatmul, GroupSizesLongPromptAndPools) {
  ThreadPool pool3(3), pool1(1);
  uint32_t seed = 1000;
  struct Case {
    WType type;
    int64_t rows, cols;
    int gs, T;
    bool simd;
  };
  const Case cases[] = {
      {WType::kAffine4, 70, 256, 32, 5, true},   {WType::kAffine4, 70, 576, 32, 3, true},
      {WType::kAffine4, 70, 768, 128, 9, true},  {WType::kAffine4, 70, 256, 16, 2, true},
      {WType::kAffine8, 70, 256, 32, 5, true},   {WType::kAffine8, 70, 768, 128, 9, true},
      {WType::kAffine4, 65, 192, 96, 4, false},  {WType::kAffine8, 65, 96, 96, 3, false},
      {WType::kAffine4, 300, 2048, 64, 64, true}, {WType::kAffine8, 300, 1024, 64, 64, true},
      {WType::kBF16, 300, 1000, 64, 64, true},   {WType::kF32, 70, 77, 64, 19, true},
  };
  for (const Case& c : cases)
    for (bool sb_f32 : {false, true}) {
      TestMatrix m = make_matrix(c.type, c.rows, c.cols, c.gs, sb_f32, seed++);
      const std::vector<float> x = random_x(c.T, c.cols, seed++);
      std::vector<double> want, scale;
      expected(m, x, c.T, want, scale);
      for (SimdIsa isa : available_isas())
        for (ThreadPool* pool : {&pool3, &pool1}) {
          const std::string tag = std::string(simd_isa_name(isa)) + " type=" +
                                  std::to_string(int(c.type)) + " cols=" + std::to_string(c.cols) +
                                  " gs=" + std::to_string(c.gs) + " T=" + std::to_string(c.T) +
                                  " threads=" + std::to_string(pool->size());
          EXPECT_EQ(qmatmul_effective_isa(isa, m.W), c.simd ? isa : SimdIsa::kScalar) << tag;
          std::vector<float> y(size_t(c.T * c.rows), std::numeric_limits<float>::quiet_NaN());
          qmatmul_with(isa, m.W, x.data(), c.T, y.data(), *pool);
          expect_close(y, want, scale, tag);
        }
    }
}

// Views that start mid-tensor (a row slice, an expert of a stack) must be read from their own
// first row: the kernels may not assume aligned or tensor-start pointers.
TEST(Qmatmul, RowOffsetViews) {
  ThreadPool pool(2);
  TestMatrix m = make_matrix(WType::kAffine4, 200, 2048, 64, false, 77);
  const int64_t r0 = 37, n = 129;
  QMatrix v = m.W;
  v.rows = n;
  v.data = m.codes.data() + r0 * (2048 / 8);
  v.scales = m.s16.data() + r0 * 32;
  v.biases = m.b16.data() + r0 * 32;
  const int T = 3;
  const std::vector<float> x = random_x(T, 2048, 78);
  std::vector<double> want_all, scale_all, want, scale;
  expected(m, x, T, want_all, scale_all);
  for (int t = 0; t < T; ++t)
    for (int64_t r = 0; r < n; ++r) {
      want.push_back(want_all[size_t(t * 200 + r0 + r)]);
      scale.push_back(scale_all[size_t(t * 200 + r0 + r)]);
    }
  std::vector<float> y(size_t(T * n));
  qmatmul(v, x.data(), T, y.data(), pool);
  expect_close(y, want, scale, std::string("qmatmul ") + qmatmul_isa());
}

// The CPU emulation of the CUDA prefill router (P68: 8-bit weights on fp16 operands). With one-hot rows x = e_k,
// y[t][r] is the emulated weight itself: round_fp16(fmaf(q, s, b)·2^8)·2^-8, bit for bit (the weights of a
// wrong row, column or group would not be); the split-precision emulation (P68 off) gives the f32 weight to
// ~16 bits.
TEST(GemmEmulate, RouterFp16Weights) {
  ThreadPool pool(2);
  const int64_t rows = 64, cols = 512, G = cols / 64;
  const TestMatrix m = make_matrix(WType::kAffine8, rows, cols, 64, false, 91);
  const std::vector<int64_t> ks = {0, 1, 63, 64, 130, 257, 511};
  const int T = int(ks.size());
  std::vector<float> x(size_t(T * cols), 0.f);
  for (int t = 0; t < T; ++t) x[size_t(t * cols + ks[size_t(t)])] = 1.f;
  std::vector<float> y16(size_t(T * rows)), ysplit(size_t(T * rows));
  qmatmul_emulated(GemmEmu::kFp16, m.W, x.data(), T, y16.data(), pool, true);
  qmatmul_emulated(GemmEmu::kFp16, m.W, x.data(), T, ysplit.data(), pool, false);
  int bad = 0;
  for (int t = 0; t < T && bad < 5; ++t)
    for (int64_t r = 0; r < rows && bad < 5; ++r) {
      const int64_t k = ks[size_t(t)];
      const float q = float((m.codes[size_t(r * (cols / 4) + k / 4)] >> (8 * (k % 4))) & 255u);
      const float sc = bf16_to_f32(m.s16[size_t(r * G + k / 64)]), bi = bf16_to_f32(m.b16[size_t(r * G + k / 64)]);
      const float w32 = std::fmaf(q, sc, bi);
      const float want = float(double(lily::round_fp16(double(w32) * (1 << kFp16WExp))) / (1 << kFp16WExp));
      const float got = y16[size_t(t * rows + r)], split = ysplit[size_t(t * rows + r)];
      if (got != want || !(std::fabs(double(split) - w32) <= 2e-5 * std::fabs(w32) + 1e-9)) {
        ADD_FAILURE() << "row " << r << " col " << k << ": fp16 " << got << " (want " << want << "), split " << split
                      << " (want " << w32 << ")";
        ++bad;
      }
    }
}

}  // namespace
}  // namespace lily
