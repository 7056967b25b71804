// The CPU backend: the portable default and the correctness reference for every other backend.
// Activations f32; weights read in place from the mmap'd checkpoint.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <numeric>
#include <optional>
#include <vector>

#include "backend/cpu/dot8.h"
#include "backend/cpu/gemm_emulate.h"
#include "backend/cpu/qmatmul.h"
#include "core/common.h"
#include "core/thread_pool.h"

namespace lily {
namespace {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Grow-only scratch vector: reallocates only when a larger T is seen, never per decoded token.
inline float* scratch(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
  return v.data();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& opt)
      : pool_(opt.threads), emu_(gemm_emu_from_env()), emu_min_t_(gemm_emu_min_t()),
        emu_skinny_(!with_env(opt.ablations).has("P7")), emu_slot16_(gemm_emu_slot16_from_env()),
        emu_r16_(!with_env(opt.ablations).has("P68")) {}
  ~CpuBackend() override {
    for (void* p : allocs_) std::free(p);
  }

  std::string name() const override { return "cpu"; }

  ModelWeights upload(const ModelWeights& host) override { return host; }

  void* raw_alloc(int64_t bytes) {
    const size_t sz = size_t((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, sz);
    if (!p) throw Error("out of host memory allocating " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, sz);
    allocs_.push_back(p);
    return p;
  }
  float* alloc(int64_t n) override { return static_cast<float*>(raw_alloc(n * 4)); }
  int32_t* alloc_i32(int64_t n) override { return static_cast<int32_t*>(raw_alloc(n * 4)); }
  void free(void* p) override {
    auto it = std::find(allocs_.begin(), allocs_.end(), p);
    if (it == allocs_.end()) return;
    std::free(p);
    allocs_.erase(it);
  }
  void copy_to_host(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_from_host(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }
  void fill_zero(void* p, int64_t bytes) override { std::memset(p, 0, bytes); }

  void embed(const QMatrix& E, const int32_t* tokens, int T, float* out) override {
    for (int t = 0; t < T; ++t) dequant_row(E, tokens[t], out + int64_t(t) * E.cols);
  }

  void rmsnorm(const float* x, const FVec& w, int T, float eps, float* out) override {
    const int64_t n = w.n;
    for (int t = 0; t < T; ++t) rmsnorm_row(x + t * n, w.data, n, eps, out + t * n);
  }

  void matmul(const QMatrix& W, const float* x, int T, float* y) override { mm(W, x, T, y, T); }

  void add(float* h, const float* r, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) h[i] += r[i];
  }

  void gdn(const ModelConfig& c, const GdnWeights& w, GdnState& st, const float* qkv, const float* z,
           const float* a, const float* b, int T, float* y) override;
  void attention(const ModelConfig& c, const AttnWeights& w, KvCache& kv, int pos0,
                 const int32_t* pos_dev, const float* q, const float* k, const float* v, int T,
                 float* o) override;
  void moe(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* out) override;

  void argmax(const float* logits, int T, int n, int32_t* ids) override {
    for (int t = 0; t < T; ++t) {
      const float* l = logits + int64_t(t) * n;
      ids[t] = int32_t(std::max_element(l, l + n) - l);   // first maximum = lowest index
    }
  }
  void increment(int32_t* p, int by) override { *p += by; }
  void sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id) override {
    cpu_sample(logits, n, cfg, counts, id);
  }

 private:
  static void rmsnorm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
    const float inv = float(1.0 / std::sqrt(ss / double(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
  }

  static Ablations with_env(Ablations a) {   // LILY_ABLATE applies to the CUDA side's P7 too
    a.merge_env();
    return a;
  }

  // TEST AID (LILY_CPU_EMULATE, gemm_emulate.h): ops with op_T >= the CUDA GEMM threshold round
  // their matmul operands as the GPU GEMM does. op_T is the op's token count, not the rows of this
  // product (an expert sees fewer rows than the MoE op's T).
  // router: the MoE router (the CUDA P68 rounds its prefill GEMM's operands to fp16, emu_r16_).
  void mm(const QMatrix& W, const float* x, int T, float* y, int op_T, bool router = false) {
    if (emu_ != GemmEmu::kOff && op_T >= emu_min_t_ && gemm_emu_applies(W, op_T, emu_skinny_))
      qmatmul_emulated(emu_, W, x, T, y, pool_, router && emu_r16_);
    else qmatmul(W, x, T, y, pool_);
  }

  ThreadPool pool_;
  GemmEmu emu_ = GemmEmu::kOff;
  int emu_min_t_ = 16;
  bool emu_skinny_ = true;   // the CUDA ablation P7 (gemm_emulate.h)
  bool emu_slot16_ = true;   // the CUDA P16: prefill MoE slot rows in fp16 (gemm_emulate.h)
  bool emu_r16_ = true;      // the CUDA P68: the prefill router (8-bit) on fp16 operands (gemm_emulate.h)
  std::vector<void*> allocs_;
  std::vector<float> conv_out_, gates_, router_, xe_, ge_, ue_, de_, sh_g_, sh_u_, sh_d_, sh_s_;
  std::vector<int32_t> topk_idx_;
  std::vector<int> order_, start_, fill_, slot_;
  std::vector<float> topk_w_;

 public:
  // TEST AID (cpu_tools::set_routing_override): expert ids [T, k] per coming MoE call, used instead
  // of this backend's own top-k (weights renormalised from its own probabilities); stats of where its
  // own choice differed.
  std::deque<std::vector<int32_t>> route_override_;
  cpu_tools::RoutingStats route_stats_;
};

// Gated DeltaNet core (MODEL.md §2.2): conv + SiLU, l2norm, gates, delta rule, gated RMSNorm.
void CpuBackend::gdn(const ModelConfig& c, const GdnWeights& w, GdnState& st, const float* qkv,
                     const float* z, const float* a, const float* b, int T, float* y) {
  const int64_t CD = c.conv_dim(), K = c.linear_conv_kernel_dim, KD = c.linear_key_dim();
  const int nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const float eps = c.rms_norm_eps;
  float* u = scratch(conv_out_, int64_t(T) * CD);   // [T, CD] post-conv, post-SiLU

  // Causal depthwise conv over q|k|v; tap K-1 multiplies the current token. The state holds the
  // last K-1 raw inputs, oldest first.
  pool_.parallel_for(CD, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<float> win_buf;
    float* win = scratch(win_buf, K + T - 1);
    for (int64_t ch = c0; ch < c1; ++ch) {
      for (int64_t j = 0; j < K - 1; ++j) win[j] = st.conv[j * CD + ch];
      for (int t = 0; t < T; ++t) win[K - 1 + t] = qkv[int64_t(t) * CD + ch];
      const float* wc = w.conv1d.data + ch * K;
      for (int t = 0; t < T; ++t) {
        float s = 0;
        for (int64_t j = 0; j < K; ++j) s += wc[j] * win[t + j];
        u[int64_t(t) * CD + ch] = silu(s);
      }
      for (int64_t j = 0; j < K - 1; ++j) st.conv[j * CD + ch] = win[T + j];
    }
  });

  // l2-normalise q and k per key head (f32, eps 1e-6 inside the sqrt); q also scaled by dk^-1/2.
  const float qscale = 1.0f / std::sqrt(float(dk));
  for (int t = 0; t < T; ++t) {
    for (int hh = 0; hh < 2 * nk; ++hh) {
      float* p = u + int64_t(t) * CD + int64_t(hh) * dk;
      double ss = 0;
      for (int i = 0; i < dk; ++i) ss += double(p[i]) * p[i];
      float inv = float(1.0 / std::sqrt(ss + 1e-6));
      if (hh < nk) inv *= qscale;
      for (int i = 0; i < dk; ++i) p[i] *= inv;
    }
  }

  // Per value head: the recurrence over all T tokens (heads are independent).
  pool_.parallel_for(nv, [&](int64_t j0, int64_t j1) {
    thread_local std::vector<float> m_buf, o_buf;
    float* m = scratch(m_buf, dv);
    float* o = scratch(o_buf, dv);
    for (int64_t j = j0; j < j1; ++j) {
      float* S = st.S + j * int64_t(dk) * dv;   // [dk][dv]
      const int64_t kh = j / (nv / nk);         // value head j reads key head j/(nv/nk)
      const float A = std::exp(w.A_log.data[j]);
      for (int t = 0; t < T; ++t) {
        const float* ut = u + int64_t(t) * CD;
        const float* qh = ut + kh * dk;
        const float* kk = ut + KD + kh * dk;
        const float* vv = ut + 2 * KD + j * dv;
        const float beta = sigmoid(b[int64_t(t) * nv + j]);
        const float alpha = std::exp(-A * softplus(a[int64_t(t) * nv + j] + w.dt_bias.data[j]));
        // 1. decay, 2. read with k, 3. delta, 4. rank-1 write, 5. read with q (updated state).
        std::fill(m, m + dv, 0.0f);
        for (int r = 0; r < dk; ++r) {
          float* Sr = S + int64_t(r) * dv;
          for (int cc = 0; cc < dv; ++cc) {
            Sr[cc] *= alpha;
            m[cc] += Sr[cc] * kk[r];
          }
        }
        for (int cc = 0; cc < dv; ++cc) m[cc] = beta * (vv[cc] - m[cc]);   // δ
        std::fill(o, o + dv, 0.0f);
        for (int r = 0; r < dk; ++r) {
          float* Sr = S + int64_t(r) * dv;
          for (int cc = 0; cc < dv; ++cc) {
            Sr[cc] += kk[r] * m[cc];
            o[cc] += Sr[cc] * qh[r];
          }
        }
        // Gated RMSNorm over dv with plain gain and silu(z).
        double ss = 0;
        for (int cc = 0; cc < dv; ++cc) ss += double(o[cc]) * o[cc];
        const float inv = float(1.0 / std::sqrt(ss / dv + eps));
        const float* zz = z + int64_t(t) * c.linear_value_dim() + j * dv;
        float* yy = y + int64_t(t) * c.linear_value_dim() + j * dv;
        for (int cc = 0; cc < dv; ++cc) yy[cc] = o[cc] * inv * w.norm.data[cc] * silu(zz[cc]);
      }
    }
  });
}

// Gated attention core (MODEL.md §2.3): query/gate split, q/k norm, partial RoPE, KV append,
// causal GQA softmax attention, sigmoid output gate.
void CpuBackend::attention(const ModelConfig& c, const AttnWeights& w, KvCache& kv, int pos0,
                           const int32_t* pos_dev, const float* q, const float* k, const float* v,
                           int T, float* o) {
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int rd = c.rotary_dim(), half = rd / 2;
  const float eps = c.rms_norm_eps;
  LILY_CHECK(pos0 + T <= kv.capacity, "KV cache overflow");
  LILY_CHECK(kv.type == KvType::f32, "cpu attention: the KV cache must be f32");
  float* const kc = static_cast<float*>(kv.k);
  float* const vc = static_cast<float*>(kv.v);
  thread_local std::vector<float> inv_freq_buf;
  float* inv_freq = scratch(inv_freq_buf, half);
  for (int i = 0; i < half; ++i) inv_freq[i] = float(std::pow(double(c.rope_theta), -2.0 * i / rd));
  auto rope = [&](float* x, int pos) {
    for (int i = 0; i < half; ++i) {
      const float ang = float(pos) * inv_freq[i];
      const float cs = std::cos(ang), sn = std::sin(ang);
      const float x0 = x[i], x1 = x[i + half];
      x[i] = x0 * cs - x1 * sn;
      x[i + half] = x1 * cs + x0 * sn;
    }
  };
  // Keys and values of the new tokens into the cache.
  for (int t = 0; t < T; ++t) {
    for (int g = 0; g < nkv; ++g) {
      const int64_t off = (int64_t(pos0 + t) * nkv + g) * hd;
      float* kd = kc + off;
      rmsnorm_row(k + (int64_t(t) * nkv + g) * hd, w.k_norm.data, hd, eps, kd);
      rope(kd, pos0 + t);
      std::memcpy(vc + off, v + (int64_t(t) * nkv + g) * hd, size_t(hd) * 4);
    }
  }
  const float scale = 1.0f / std::sqrt(float(hd));
  const int group = nh / nkv;
  // Queries in blocks of TB tokens x HB heads of one KV group, so that each cached K / V row is read once per
  // block (prefill: 8 tokens x the group's heads; decode: one token and head per item, as many items as heads),
  // over keys in blocks of KB with an online softmax (the scores buffer stays KB wide at any context).
  constexpr int KB = 128, kMaxRows = 64;
  const int TB = T >= 8 ? 8 : 1, HB = T >= 8 && group * TB <= kMaxRows ? group : 1;
  const int ntb = (T + TB - 1) / TB, nhb = nh / HB;
  pool_.parallel_for(int64_t(ntb) * nhb, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> qv_buf, sc_buf, acc_buf;
    float* qv = scratch(qv_buf, int64_t(kMaxRows) * hd);
    float* sc = scratch(sc_buf, int64_t(kMaxRows) * KB);
    float* acc = scratch(acc_buf, int64_t(kMaxRows) * hd);
    float m[kMaxRows];
    double l[kMaxRows];
    int lim[kMaxRows];   // keys [0, lim) are visible to row r (causal)
    for (int64_t i = i0; i < i1; ++i) {
      // Token blocks zig-zag (first, last, second, ...): a thread's contiguous range mixes short and long spans.
      const int64_t slot = i / nhb;
      const int tb = int(slot % 2 == 0 ? slot / 2 : ntb - 1 - slot / 2);
      const int h0 = int(i % nhb) * HB, g = h0 / group;
      const int t0 = tb * TB, t1 = std::min(T, t0 + TB), R = (t1 - t0) * HB;
      for (int r = 0; r < R; ++r) {   // row r: token t0 + r / HB, head h0 + r % HB
        const int t = t0 + r / HB, h = h0 + r % HB;
        rmsnorm_row(q + int64_t(t) * nh * 2 * hd + int64_t(h) * 2 * hd, w.q_norm.data, hd, eps, qv + int64_t(r) * hd);
        rope(qv + int64_t(r) * hd, pos0 + t);
        m[r] = -INFINITY;
        l[r] = 0.0;
        lim[r] = pos0 + t + 1;
      }
      std::fill(acc, acc + int64_t(R) * hd, 0.0f);
      const int n_hi = pos0 + t1;
      for (int s0 = 0; s0 < n_hi; s0 += KB) {
        const int s1 = std::min(n_hi, s0 + KB);
        for (int s = s0; s < s1; ++s) {
          const float* ks = kc + (int64_t(s) * nkv + g) * hd;
          for (int r = 0; r < R; ++r)
            sc[r * KB + (s - s0)] = s < lim[r] ? dot8(qv + int64_t(r) * hd, ks, hd) * scale : -INFINITY;
        }
        for (int r = 0; r < R; ++r) {
          if (s0 >= lim[r]) continue;
          float* sr = sc + r * KB;
          const int se = std::min(s1, lim[r]) - s0;
          float bm = -INFINITY;
          for (int j = 0; j < se; ++j) bm = std::max(bm, sr[j]);
          if (bm > m[r]) {   // a new running max: rescale what was summed so far
            const float corr = std::exp(m[r] - bm);
            l[r] *= corr;
            float* ar = acc + int64_t(r) * hd;
            for (int e = 0; e < hd; ++e) ar[e] *= corr;
            m[r] = bm;
          }
          double bs = 0;
          for (int j = 0; j < se; ++j) bs += (sr[j] = std::exp(sr[j] - m[r]));
          l[r] += bs;
        }
        for (int s = s0; s < s1; ++s) {
          const float* vs = vc + (int64_t(s) * nkv + g) * hd;
          for (int r = 0; r < R; ++r) {
            if (s >= lim[r]) continue;
            const float p = sc[r * KB + (s - s0)];
            float* ar = acc + int64_t(r) * hd;
            for (int e = 0; e < hd; ++e) ar[e] += p * vs[e];
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const int t = t0 + r / HB, h = h0 + r % HB;
        const float* gate = q + int64_t(t) * nh * 2 * hd + int64_t(h) * 2 * hd + hd;
        float* out = o + int64_t(t) * nh * hd + int64_t(h) * hd;
        const float inv = float(1.0 / l[r]);
        for (int e = 0; e < hd; ++e) out[e] = acc[int64_t(r) * hd + e] * inv * sigmoid(gate[e]);
      }
    }
  });
}

// Sparse MoE (MODEL.md §2.4): tokens are grouped by expert so each expert's weights are read once
// per chunk; the shared expert runs over all tokens.
void CpuBackend::moe(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* out) {
  const int E = c.num_experts, k = c.num_experts_per_tok;
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  float* logits = scratch(router_, int64_t(T) * E);
  mm(w.gate, x, T, logits, T, true);
  topk_idx_.resize(size_t(T) * k);
  topk_w_.resize(size_t(T) * k);
  order_.resize(size_t(E));
  std::vector<int>& order = order_;
  std::optional<std::vector<int32_t>> route_now;   // this call's forced routing (test aid), if any
  if (!route_override_.empty()) {
    route_now = std::move(route_override_.front());
    route_override_.pop_front();
    if (route_now->empty()) route_now.reset();   // the producer had none for this call: own routing
    else if (route_now->size() != size_t(T) * k) throw Error("cpu moe: routing override of the wrong size");
  }
  for (int t = 0; t < T; ++t) {
    float* l = logits + int64_t(t) * E;   // softmax over all experts in f32
    const float mx = *std::max_element(l, l + E);
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (l[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) l[e] = float(l[e] / sum);
    std::iota(order.begin(), order.end(), 0);
    const int ks = route_now ? std::min(E, k + 1) : k;   // k + 1: the runner-up's margin (override stats)
    std::partial_sort(order.begin(), order.begin() + ks, order.end(),
                      [&](int p, int q) { return l[p] > l[q] || (l[p] == l[q] && p < q); });
    const int32_t* forced = route_now && route_now->size() == size_t(T) * k ? route_now->data() + size_t(t) * k
                                                                             : nullptr;
    if (forced) {
      ++route_stats_.tokens;
      std::vector<int32_t> own(order.begin(), order.begin() + k), given(forced, forced + k);
      std::sort(own.begin(), own.end());
      std::sort(given.begin(), given.end());
      if (own != given) {
        ++route_stats_.differing;
        const double gap = ks > k ? std::log(double(l[order[k - 1]])) - std::log(double(l[order[k]])) : 0.0;
        route_stats_.max_gap = std::max(route_stats_.max_gap, gap);
      }
    }
    double top = 0;
    for (int j = 0; j < k; ++j) top += l[forced ? forced[j] : order[j]];
    for (int j = 0; j < k; ++j) {
      const int e = forced ? forced[j] : order[j];
      if (e < 0 || e >= E) throw Error("cpu moe: routing override with an expert id out of range");
      topk_idx_[size_t(t) * k + j] = e;
      topk_w_[size_t(t) * k + j] = float(l[e] / top);   // renormalised
    }
  }

  // Shared expert: s = down(silu(gate x) * up x) * sigmoid(w_sg · x).
  float* sg = scratch(sh_g_, int64_t(T) * Is);
  float* su = scratch(sh_u_, int64_t(T) * Is);
  mm(w.shared_gate_proj, x, T, sg, T);
  mm(w.shared_up_proj, x, T, su, T);
  for (int64_t i = 0; i < int64_t(T) * Is; ++i) sg[i] = silu(sg[i]) * su[i];
  mm(w.shared_down_proj, sg, T, out, T);
  float* gate = scratch(sh_s_, T);
  mm(w.shared_expert_gate, x, T, gate, T);
  // Emulating the CUDA prefill path with P16: every slot row is rounded to fp16 before the sum.
  const bool slot16 = emu_ != GemmEmu::kOff && emu_slot16_ && T >= emu_min_t_;
  for (int t = 0; t < T; ++t) {
    const float s = sigmoid(gate[t]);
    for (int64_t i = 0; i < H; ++i) out[t * H + i] = slot16 ? round_fp16_sat(out[t * H + i] * s) : out[t * H + i] * s;
  }

  // Routed experts, grouped by expert (counting sort of the T*k assignments).
  start_.assign(size_t(E) + 1, 0);
  for (int i = 0; i < T * k; ++i) ++start_[size_t(topk_idx_[i]) + 1];
  for (int e = 0; e < E; ++e) start_[e + 1] += start_[e];
  slot_.resize(size_t(T) * k);
  fill_ = start_;
  for (int i = 0; i < T * k; ++i) slot_[size_t(fill_[topk_idx_[i]]++)] = i;   // i = t*k + j
  for (int e = 0; e < E; ++e) {
    const int n = start_[e + 1] - start_[e];
    if (n == 0) continue;
    const int* r = slot_.data() + start_[e];
    float* xe = scratch(xe_, n * H);
    for (int i = 0; i < n; ++i) std::memcpy(xe + i * H, x + (r[i] / k) * H, size_t(H) * 4);
    float* ge = scratch(ge_, n * I);
    float* ue = scratch(ue_, n * I);
    mm(w.experts_gate.expert(e), xe, n, ge, T);
    mm(w.experts_up.expert(e), xe, n, ue, T);
    for (int64_t i = 0; i < n * I; ++i) ge[i] = silu(ge[i]) * ue[i];
    float* de = scratch(de_, n * H);
    mm(w.experts_down.expert(e), ge, n, de, T);
    for (int i = 0; i < n; ++i) {
      float* o = out + (r[i] / k) * H;
      const float wt = topk_w_[size_t(r[i])];
      if (slot16)
        for (int64_t d = 0; d < H; ++d) o[d] += round_fp16_sat(wt * de[i * H + d]);
      else
        for (int64_t d = 0; d < H; ++d) o[d] += wt * de[i * H + d];
    }
  }
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opt) {
  return std::make_unique<CpuBackend>(opt);
}

namespace cpu_tools {
namespace {
CpuBackend& as_cpu(Backend& be) {
  auto* p = dynamic_cast<CpuBackend*>(&be);
  LILY_CHECK(p, "cpu_tools: not the cpu backend");
  return *p;
}
}  // namespace
void set_routing_override(Backend& be, std::vector<std::vector<int32_t>> per_call) {
  CpuBackend& c = as_cpu(be);
  c.route_override_.assign(std::make_move_iterator(per_call.begin()), std::make_move_iterator(per_call.end()));
  c.route_stats_ = {};
}
RoutingStats routing_stats(Backend& be) { return as_cpu(be).route_stats_; }
size_t routing_override_left(Backend& be) { return as_cpu(be).route_override_.size(); }
}  // namespace cpu_tools

}  // namespace lily
