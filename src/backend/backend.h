// The op set of this model, implemented once per backend (cpu, cuda). The model's forward pass is
// written only against this interface; pointers passed to ops live in the backend's memory
// (host memory for cpu, device memory for cuda). Activations are f32, row-major [T, n].
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/weights.h"

namespace lily {

// Per-sequence state of one Gated DeltaNet layer.
struct GdnState {
  float* conv = nullptr;   // [K-1=3, conv_dim] last raw (pre-conv) projections, oldest first
  float* S = nullptr;      // [nv=32, dk=128, dv=128] recurrent state, f32, S[j][r][c]
};

// Element type of a KV cache. The cpu backend keeps f32; the cuda backend stores fp16 (D18): half
// the bytes a decode step reads at long context, and the flash prefill reads the tiles directly.
enum class KvType : int { f32 = 0, f16 = 1 };
inline int kv_elem_bytes(KvType t) { return t == KvType::f32 ? 4 : 2; }

// Per-sequence KV cache of one full-attention layer: post-norm, post-RoPE keys and raw values.
// The element type is fixed when the cache is allocated (Backend::kv_type() at that time); every
// op dispatches on it, so caches of both types may coexist (e.g. a benchmark toggling D18).
struct KvCache {
  void* k = nullptr;       // [capacity, kv_heads, head_dim] of `type`
  void* v = nullptr;       // [capacity, kv_heads, head_dim] of `type`
  int capacity = 0;
  KvType type = KvType::f32;
};

// Optimization switches shared by all backends (BENCHMARK.md ablations); a backend ignores the
// ones that do not apply to it.
// Sampling parameters of the sample op (D2), kept in backend memory: the host rewrites them with
// copy_from_host between steps and a captured step reads them at replay time. Semantics follow the
// host Sampler (engine/sampler.h): logit_bias, repetition / presence / frequency penalties, then
// temperature (0 = greedy), top-k, top-p, min-p. Plain old data; build with make_sample_config.
constexpr int kMaxLogitBias = 64;
struct SampleConfig {
  float temperature = 1.0f;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float log_min_p = -INFINITY;   // ln(min_p), computed once by the host so backends agree bitwise
  float presence_penalty = 0.0f, frequency_penalty = 0.0f, repetition_penalty = 1.0f;
  int32_t top_k = 0;
  int32_t n_valid = 0;           // ids >= n_valid are never picked (0 = the whole row)
  int32_t n_bias = 0;
  uint64_t seed = 0;
  uint64_t step = 0;             // draw counter: the random number is hash(seed, step); the op adds 1
  int32_t bias_id[kMaxLogitBias] = {};
  float bias[kMaxLogitBias] = {};
};
SampleConfig make_sample_config(float temperature, float top_p, int top_k, float min_p, float presence,
                                float frequency, float repetition, uint64_t seed, int n_valid);

struct Ablations {
  std::vector<std::string> off;   // ids switched off, e.g. {"D2", "P1"}
  bool has(const std::string& id) const;
  // One benchmark variant's ids: "D9+D10" switches both off (an --ablate list is comma-separated variants).
  static Ablations variant(const std::string& spec);
  // Appends the comma-separated ids of environment variable `var` (LILY_ABLATE: switched off
  // process-wide, on top of any --ablate) that are not already in `off`.
  void merge_env(const char* var = "LILY_ABLATE");
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // ---- memory -------------------------------------------------------------------------------
  // Returns views of `host` that point at this backend's memory (cpu: the same views).
  virtual ModelWeights upload(const ModelWeights& host) = 0;
  virtual float* alloc(int64_t n_floats) = 0;          // zero-filled; lives as long as the backend
  virtual int32_t* alloc_i32(int64_t n) = 0;
  virtual void free(void* p) = 0;
  virtual void copy_to_host(void* dst, const void* src, int64_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* src, int64_t bytes) = 0;
  virtual void copy(void* dst, const void* src, int64_t bytes) = 0;   // within the backend
  virtual void fill_zero(void* p, int64_t bytes) = 0;
  virtual void synchronize() {}
  // Host seconds spent blocked waiting for the device so far (synchronize, copies to the host, event waits); the
  // wall time of a call minus its share of this is the host's own work (cpu: 0, the host is the device).
  virtual double host_wait_s() const { return 0; }
  // Element type of KV caches allocated from now on (cuda: fp16 unless ablation D18 is off).
  virtual KvType kv_type() const { return KvType::f32; }
  // n elements between f32 (backend memory) and a KV buffer of type t (tests, benchmarks).
  virtual void kv_from_f32(void* dst, KvType t, const float* src, int64_t n);
  virtual void kv_to_f32(float* dst, const void* src, KvType t, int64_t n);

  // ---- ops ----------------------------------------------------------------------------------
  // out[t] = row tokens[t] of E (dequantised). tokens in backend memory.
  virtual void embed(const QMatrix& E, const int32_t* tokens, int T, float* out) = 0;
  // out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w   (w is the effective gain)
  virtual void rmsnorm(const float* x, const FVec& w, int T, float eps, float* out) = 0;
  // y[T, W.rows] = x[T, W.cols] · Wᵀ
  virtual void matmul(const QMatrix& W, const float* x, int T, float* y) = 0;
  // h[i] += r[i]
  virtual void add(float* h, const float* r, int64_t n) = 0;

  // Gated DeltaNet core for T consecutive tokens (MODEL.md §2.2), between the input projections and
  // out_proj: causal conv (state carried in st.conv) + SiLU, split q|k|v, l2norm q,k, q/sqrt(dk),
  // gates β=σ(b), g=-exp(A_log)·softplus(a+dt_bias), delta rule in f32, gated RMSNorm with silu(z).
  // qkv [T, conv_dim], z [T, value_dim], a, b [T, nv] -> y [T, value_dim].
  virtual void gdn(const ModelConfig& c, const GdnWeights& w, GdnState& st, const float* qkv,
                   const float* z, const float* a, const float* b, int T, float* y) = 0;

  // Gated attention core for T tokens at positions pos0..pos0+T-1 (MODEL.md §2.3) between the
  // projections and o_proj: per-head query/gate split of q [T, heads*2*head_dim], q/k zero-centred
  // norm (effective gains in w), partial RoPE, append k, v [T, kv_heads*head_dim] to the cache,
  // causal GQA softmax attention over positions [0, pos0+T), output × σ(gate) -> o [T, heads*head_dim].
  // pos0 is the host value; pos_dev holds the same value in backend memory so that a captured
  // decode step (CUDA graph) can read the current position at replay time.
  virtual void attention(const ModelConfig& c, const AttnWeights& w, KvCache& kv, int pos0,
                         const int32_t* pos_dev, const float* q, const float* k, const float* v,
                         int T, float* o) = 0;

  // Sparse MoE block (MODEL.md §2.4) on normalised input x [T, H]: router softmax (f32) over all
  // experts, top-k renormalised, SwiGLU experts, sigmoid-gated shared expert. out [T, H] (overwritten).
  virtual void moe(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* out) = 0;

  // ids[t] = argmax of logits[t, 0:n) (lowest index on ties); ids in backend memory.
  virtual void argmax(const float* logits, int T, int n, int32_t* ids) = 0;
  // *p += by for a scalar in backend memory (advances pos_dev inside a captured step).
  virtual void increment(int32_t* p, int by) = 0;

  // Picks one id from logits[0, n) with the parameters in *cfg (backend memory), writes it to *id,
  // records it in counts[id] (+2, and bit 0 "seen") and advances cfg->step. counts [n] in backend
  // memory: bit 0 = seen (prompt or generated: repetition penalty), bits 1.. = times generated
  // (presence / frequency). Every backend picks the same id for the same inputs (sample_math.h);
  // the exact rule is written in docs/CUDA.md "Sampling on the device". No host synchronisation.
  virtual void sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id) = 0;

  // ---- asynchronous hand-off of ids to the host (D2); the defaults are synchronous ------------
  // Host memory that copy_to_host_async may target (pinned on cuda).
  virtual void* alloc_host(int64_t bytes);
  virtual void free_host(void* p);
  // Enqueues a copy into host memory from alloc_host; complete once wait_event(slot) returned for
  // an event recorded after it.
  virtual void copy_to_host_async(void* dst, const void* src, int64_t bytes) { copy_to_host(dst, src, bytes); }
  // Marks the current end of the backend's queue as event `slot` (0 <= slot < 8); wait_event blocks
  // the host until everything enqueued before that mark has finished.
  virtual void record_event(int slot) {}
  virtual void wait_event(int slot) {}
  virtual bool can_capture() const { return false; }   // whether begin_capture would succeed

  // ---- optional: capture of one decode step for replay (D2); cpu returns false ---------------
  // A step whose attention reads `len` positions may be captured in a form of its own, a variant
  // numbered from 0 (e.g. a smaller split-KV grid for short contexts); the decode loops capture again
  // when the variant changes. A step captured as any variant replays correctly at any length.
  virtual int capture_variant(int64_t len) const {
    (void)len;
    return 0;
  }
  virtual bool begin_capture(int variant = 0) {
    (void)variant;
    return false;
  }
  virtual void end_capture() {}
  virtual void replay() {}
};

struct BackendOptions {
  std::string name = "cpu";       // "cpu" | "cuda"
  int threads = 0;                // cpu: 0 = all cores
  Ablations ablations;
};

// Creates a backend by name; throws lily::Error if it is unknown or not compiled in.
std::unique_ptr<Backend> make_backend(const BackendOptions& opt);

}  // namespace lily
