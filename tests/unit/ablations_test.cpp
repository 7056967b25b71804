// The ablation set's environment merge (LILY_ABLATE) and the CPU emulation's copy of the CUDA
// prefill GEMM's small-matrix rule (gemm_small_n(T), P7), which cuda-check relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>

#include "backend/backend.h"
#include "backend/cpu/gemm_emulate.h"
#include "core/common.h"
#include "model/weights.h"

namespace lily {
namespace {

struct EnvGuard {
  const char* name;
  explicit EnvGuard(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~EnvGuard() { unsetenv(name); }
};

TEST(Ablations, MergeEnvAppendsNewIdsOnce) {
  EnvGuard e("LILY_ABLATE_TEST", " D20, P7 ,,D20,D3");
  Ablations a;
  a.off = {"D3"};
  a.merge_env("LILY_ABLATE_TEST");
  EXPECT_EQ(a.off, (std::vector<std::string>{"D3", "D20", "P7"}));
  EXPECT_TRUE(a.has("P7"));
  EXPECT_FALSE(a.has("D2"));
}

TEST(Ablations, MergeEnvUnsetOrEmptyIsANoOp) {
  unsetenv("LILY_ABLATE_TEST");
  Ablations a;
  a.off = {"D2"};
  a.merge_env("LILY_ABLATE_TEST");
  EnvGuard e("LILY_ABLATE_TEST2", "");
  a.merge_env("LILY_ABLATE_TEST2");
  EXPECT_EQ(a.off, (std::vector<std::string>{"D2"}));
}

TEST(Ablations, VariantSplitsOnPlus) {
  EXPECT_EQ(Ablations::variant("P46+P47+P48").off, (std::vector<std::string>{"P46", "P47", "P48"}));
  EXPECT_EQ(Ablations::variant("D3").off, (std::vector<std::string>{"D3"}));
  EXPECT_EQ(Ablations::variant("D9++D10+D9+").off, (std::vector<std::string>{"D9", "D10"}));
  EXPECT_TRUE(Ablations::variant("").off.empty());
  EXPECT_TRUE(Ablations::variant("D3+P46").has("P46"));
}

QMatrix affine4(int64_t rows, int64_t cols) {
  QMatrix w;
  w.type = WType::kAffine4;
  w.rows = rows;
  w.cols = cols;
  w.group_size = 64;
  return w;
}

TEST(GemmEmulation, SmallMatrixRuleFollowsTheCudaGemm) {
  unsetenv("LILY_GEMM_SMALL_N");
  unsetenv("LILY_GEMM_SKINNY_N");
  unsetenv("LILY_GEMM_SKINNY_T");
  const QMatrix a32 = affine4(32, 2048), a64 = affine4(64, 2048), gate1 = affine4(1, 2048);
  EXPECT_TRUE(gemm_emu_applies(a64, 16));          // 64 rows: always the GEMM
  EXPECT_FALSE(gemm_emu_applies(a32, 255));        // in_proj_a/b: GEMV below T = 256
  EXPECT_TRUE(gemm_emu_applies(a32, 256));         // P7: the GEMM from T = 256
  EXPECT_FALSE(gemm_emu_applies(a32, 4096, false));   // P7 off: the GEMV at every T
  EXPECT_FALSE(gemm_emu_applies(gate1, 4096));     // the 1-row shared-expert gate: always the GEMV
  QMatrix odd = affine4(64, 2000);                  // cols % 512 != 0: the GEMM does not take it
  EXPECT_FALSE(gemm_emu_applies(odd, 4096));
  {
    EnvGuard t("LILY_GEMM_SKINNY_T", "1024");
    EXPECT_FALSE(gemm_emu_applies(a32, 512));
    EXPECT_TRUE(gemm_emu_applies(a32, 1024));
  }
  {
    EnvGuard n("LILY_GEMM_SMALL_N", "0");   // 0: the GEMM for every matrix it supports
    EXPECT_TRUE(gemm_emu_applies(gate1, 16));
  }
}

}  // namespace
}  // namespace lily

namespace lily {
namespace {

// The emulation's rounding against independent references: the compiler's _Float16 conversion
// (round to nearest even, subnormals, overflow to inf) and core's f32_to_bf16.
TEST(GemmEmulation, RoundingMatchesReferences) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mant(1.f, 2.f);
  std::uniform_int_distribution<int> ex(-30, 20), sign(0, 1);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::ldexp(mant(rng), ex(rng)) * (sign(rng) ? -1.f : 1.f);
    ASSERT_EQ(round_fp16(f), float(static_cast<_Float16>(f))) << f;
    ASSERT_EQ(round_bf16(f), bf16_to_f32(f32_to_bf16(f))) << f;
  }
  for (float f : {0.f, -0.f, 65504.f, 65520.f, 1e6f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1p-14f})
    EXPECT_EQ(round_fp16(f), float(static_cast<_Float16>(f))) << f;
}

}  // namespace
}  // namespace lily
