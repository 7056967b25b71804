// qmatmul dispatcher: validates W, picks the SIMD path, prepares x once per call (group sums, 4-bit
// lane order) and splits output rows over the thread pool; plus the scalar reference and dequant_row.
#include "backend/cpu/qmatmul.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/simd_qmatmul.h"
#include "core/common.h"

namespace lily {

namespace {

void check_matrix(const QMatrix& W) {
  LILY_CHECK(W.rows >= 0 && W.cols >= 0, "negative matrix shape");
  LILY_CHECK(W.data != nullptr || W.rows * W.cols == 0, "matrix without data");
  if (!W.quantized()) return;
  LILY_CHECK(W.group_size > 0 && W.cols % W.group_size == 0,
             "cols " + std::to_string(W.cols) + " not a multiple of group_size " +
                 std::to_string(W.group_size));
  LILY_CHECK(W.cols % (32 / W.bits()) == 0, "affine row does not fill whole u32 words");
  LILY_CHECK(W.scales != nullptr && W.biases != nullptr, "affine matrix without scales/biases");
}

int64_t row_bytes(const QMatrix& W) {
  switch (W.type) {
    case WType::kAffine4: return W.cols / 2;
    case WType::kAffine8: return W.cols;
    case WType::kBF16: return W.cols * 2;
    case WType::kF32: return W.cols * 4;
  }
  return W.cols * 4;
}

bool pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// Below this many multiply-adds a call runs on the caller alone: waking workers costs more.
constexpr int64_t kInlineWork = int64_t(1) << 18;
// Rows processed together while looping over token blocks, sized so their weights stay in L1/L2
// and are fetched from memory once per call however large T is.
constexpr int64_t kRowChunkBytes = 32 * 1024;

struct Dispatch {
  const qmm::Job* job;
  qmm::RowsFn fn;
  int max_tb;
  int64_t chunk_rows;
};

void run_rows(const Dispatch& d, int64_t r0, int64_t r1) {
  thread_local std::vector<float> scratch;
  const size_t need = size_t(qmm::scratch_floats(*d.job));
  if (scratch.size() < need) scratch.resize(need);
  for (int64_t rc = r0; rc < r1; rc += d.chunk_rows) {
    const int64_t re = std::min(r1, rc + d.chunk_rows);
    for (int t0 = 0; t0 < d.job->T; t0 += d.max_tb)
      d.fn(*d.job, rc, re, t0, std::min(d.max_tb, d.job->T - t0), scratch.data());
  }
}

}  // namespace

namespace qmm {

void permute_x4(const float* x, int64_t cols, int lanes, float* out) {
  int64_t e = 0;
  auto block = [&](int L) {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < L; ++l) out[e + j * L + l] = x[e + 8 * l + j];
    e += 8 * L;
  };
  if (lanes == 16)
    while (e + 128 <= cols) block(16);
  while (e + 64 <= cols) block(8);
}

}  // namespace qmm

// ---- ISA selection ----------------------------------------------------------------------------

SimdIsa cpu_best_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma"))
    return SimdIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdIsa::kAvx2;
#endif
  return SimdIsa::kScalar;
}

const char* simd_isa_name(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::kAvx512: return "avx512";
    case SimdIsa::kAvx2: return "avx2";
    case SimdIsa::kScalar: return "scalar";
  }
  return "scalar";
}

SimdIsa simd_isa_from_env(const char* value) {
  const SimdIsa best = cpu_best_isa();
  if (value == nullptr || *value == '\0') return best;
  SimdIsa want;
  if (std::strcmp(value, "scalar") == 0) want = SimdIsa::kScalar;
  else if (std::strcmp(value, "avx2") == 0) want = SimdIsa::kAvx2;
  else if (std::strcmp(value, "avx512") == 0) want = SimdIsa::kAvx512;
  else
    throw Error(std::string("LILY_CPU_SIMD: unknown value '") + value +
                "' (expected scalar, avx2 or avx512)");
  return std::min(want, best);
}

namespace {
SimdIsa selected_isa() {
  static const SimdIsa isa = simd_isa_from_env(std::getenv("LILY_CPU_SIMD"));
  return isa;
}
}  // namespace

const char* qmatmul_isa() { return simd_isa_name(selected_isa()); }

SimdIsa qmatmul_effective_isa(SimdIsa want, const QMatrix& W) {
  SimdIsa isa = std::min(want, cpu_best_isa());
  // The SIMD kernels take whole groups of 16·2^k elements and, for 4 bits, whole 64-element blocks
  // (MLX writes group sizes 32, 64, 128); anything else runs the portable kernel.
  if (W.quantized() && (!pow2(W.group_size) || W.group_size < 16 ||
                        (W.type == WType::kAffine4 && W.cols % 64 != 0)))
    isa = SimdIsa::kScalar;
  return isa;
}

// ---- fast path --------------------------------------------------------------------------------

void qmatmul_with(SimdIsa want, const QMatrix& W, const float* x, int T, float* y,
                  ThreadPool& pool) {
  check_matrix(W);
  if (T <= 0 || W.rows == 0) return;
  if (W.cols == 0) {
    std::fill(y, y + int64_t(T) * W.rows, 0.0f);
    return;
  }
  const SimdIsa isa = qmatmul_effective_isa(want, W);

  qmm::Job job;
  job.W = W;
  job.rows = W.rows;
  job.cols = W.cols;
  job.T = T;
  job.x = x;
  job.y = y;
  // Per-call x preparation lives in per-thread buffers that only grow: no allocation in steady state.
  thread_local std::vector<float> xsum_buf, xp_buf;
  if (W.quantized()) {
    const int gs = W.group_size;
    job.groups = W.cols / gs;
    job.xsum_stride = job.groups + 32;
    if (xsum_buf.size() < size_t(T * job.xsum_stride)) xsum_buf.resize(size_t(T * job.xsum_stride));
    for (int t = 0; t < T; ++t) {
      const float* xt = x + int64_t(t) * W.cols;
      float* st = xsum_buf.data() + t * job.xsum_stride;
      for (int64_t g = 0; g < job.groups; ++g) {
        float s = 0.0f;
        for (int k = 0; k < gs; ++k) s += xt[g * gs + k];
        st[g] = s;
      }
      std::fill(st + job.groups, st + job.xsum_stride, 0.0f);
    }
    job.xsum = xsum_buf.data();
    if (W.type == WType::kAffine4 && isa != SimdIsa::kScalar) {
      if (xp_buf.size() < size_t(T * W.cols)) xp_buf.resize(size_t(T * W.cols));
      const int lanes = isa == SimdIsa::kAvx512 ? 16 : 8;
      for (int t = 0; t < T; ++t)
        qmm::permute_x4(x + int64_t(t) * W.cols, W.cols, lanes, xp_buf.data() + int64_t(t) * W.cols);
      job.xp = xp_buf.data();
    }
  }

  Dispatch d{&job, qmm::rows_scalar, qmm::kMaxTbScalar, 1};
  if (isa == SimdIsa::kAvx512) d = {&job, qmm::rows_avx512, qmm::kMaxTbAvx512, 1};
  if (isa == SimdIsa::kAvx2) d = {&job, qmm::rows_avx2, qmm::kMaxTbAvx2, 1};
  d.chunk_rows = std::max<int64_t>(1, kRowChunkBytes / std::max<int64_t>(1, row_bytes(W)));

  const int64_t work = W.rows * W.cols * T;
  if (pool.size() == 1 || W.rows < 64 || work < kInlineWork) {
    run_rows(d, 0, W.rows);
    return;
  }
  // One pointer captured: the std::function stays in its small buffer (no allocation).
  const Dispatch* dp = &d;
  pool.parallel_for(W.rows, [dp](int64_t r0, int64_t r1) { run_rows(*dp, r0, r1); });
}

void qmatmul(const QMatrix& W, const float* x, int T, float* y, ThreadPool& pool) {
  qmatmul_with(selected_isa(), W, x, T, y, pool);
}

// ---- reference --------------------------------------------------------------------------------

void dequant_row(const QMatrix& W, int64_t r, float* out) {
  check_matrix(W);
  LILY_CHECK(r >= 0 && r < W.rows, "row " + std::to_string(r) + " out of range");
  const int64_t cols = W.cols;
  switch (W.type) {
    case WType::kF32:
      std::memcpy(out, static_cast<const float*>(W.data) + r * cols, size_t(cols) * 4);
      return;
    case WType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(W.data) + r * cols;
      for (int64_t k = 0; k < cols; ++k) out[k] = bf16_to_f32(p[k]);
      return;
    }
    case WType::kAffine4:
    case WType::kAffine8: {
      const int bits = W.bits(), per_word = 32 / bits;
      const uint32_t mask = (1u << bits) - 1;
      const int64_t groups = cols / W.group_size;
      const uint32_t* words = static_cast<const uint32_t*>(W.data) + r * (cols / per_word);
      for (int64_t k = 0; k < cols; ++k) {
        const uint32_t q = (words[k / per_word] >> (bits * (k % per_word))) & mask;
        const int64_t g = r * groups + k / W.group_size;
        const float s = qmm::sb_at(W.scales, W.sb_f32, g), b = qmm::sb_at(W.biases, W.sb_f32, g);
        out[k] = s * float(q) + b;
      }
      return;
    }
  }
}

void qmatmul_ref(const QMatrix& W, const float* x, int T, float* y) {
  check_matrix(W);
  std::vector<float> w(size_t(W.cols));
  for (int64_t r = 0; r < W.rows; ++r) {
    dequant_row(W, r, w.data());
    for (int t = 0; t < T; ++t) {
      const float* xt = x + int64_t(t) * W.cols;
      double acc = 0.0;
      for (int64_t k = 0; k < W.cols; ++k) acc += double(w[size_t(k)]) * double(xt[k]);
      y[int64_t(t) * W.rows + r] = float(acc);
    }
  }
}

}  // namespace lily
