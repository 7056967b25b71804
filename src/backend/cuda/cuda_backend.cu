// The CUDA backend: device memory and weight upload, op dispatch onto one stream, small op fusions
// done behind the interface (independent projections batched into one launch, the residual add
// folded into the next RMSNorm; for decode steps the add folded into the producer's epilogue and
// the RMSNorm into its consumers, D9), CUDA-graph capture of a decode step (D2) and per-op timing.
#include "backend/cuda/cuda_backend.h"

#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled (tma_map_f16)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/prefill_attn.h"
#include "backend/cuda/gemm.h"

namespace lily {

namespace cuda {
bool& pdl_enabled() {
  static bool on = true;
  return on;
}
void cuda_fail(cudaError_t e, const char* expr, const char* file, int line) {
  throw Error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") in " +
              expr + " at " + file + ":" + std::to_string(line));
}
CUresult tma_map_f16_nd(CUtensorMap* m, const void* p, int rank, const uint64_t* dims, const uint64_t* strides,
                        const uint32_t* box) {
  static PFN_cuTensorMapEncodeTiled_v12000 enc = nullptr;
  if (!enc) {
    cudaDriverEntryPointQueryResult q{};
    void* fn = nullptr;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    LILY_CHECK(fn && q == cudaDriverEntryPointSuccess, "cuTensorMapEncodeTiled not available");
    enc = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  LILY_CHECK(rank >= 1 && rank <= 5, "tma_map_f16_nd: rank 1..5");
  cuuint64_t d[5], st[4];
  cuuint32_t b[5], es[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    es[i] = 1;
    if (i + 1 < rank) st[i] = strides[i];
  }
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, cuuint32_t(rank), const_cast<void*>(p), d, st, b, es,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}
void tma_map_f16(CUtensorMap* m, const void* p, uint64_t inner, uint64_t rows, uint64_t row_bytes, uint32_t box_inner,
                 uint32_t box_rows, const char* what) {
  const uint64_t dims[2] = {inner, rows};
  const uint32_t box[2] = {box_inner, box_rows};
  const CUresult r = tma_map_f16_nd(m, p, 2, dims, &row_bytes, box);
  LILY_CHECK(r == CUDA_SUCCESS, std::string(what) + ": cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
}
}  // namespace cuda

namespace {

using namespace lily::cuda;

int64_t type_bytes(const QMatrix& m) {
  switch (m.type) {
    case WType::kAffine4: return m.rows * m.cols / 2;
    case WType::kAffine8: return m.rows * m.cols;
    case WType::kBF16: return m.rows * m.cols * 2;
    default: return m.rows * m.cols * 4;
  }
}
int64_t sb_bytes(const QMatrix& m) {
  return m.quantized() ? m.rows * (m.cols / m.group_size) * (m.sb_f32 ? 4 : 2) : 0;
}

QMat to_qmat(const QMatrix& m) {
  QMat q;
  q.type = int(m.type);
  q.rows = int(m.rows);
  q.cols = int(m.cols);
  q.gs = m.group_size;
  q.sb_f32 = m.sb_f32 ? 1 : 0;
  q.data = m.data;
  q.scales = m.scales;
  q.biases = m.biases;
  return q;
}

struct PendingAdd {
  float* h = nullptr;
  const float* r = nullptr;
  int64_t n = 0;
};

// D9 (decode, T == 1): an rmsnorm not launched yet; the next matmul batch or MoE reading `out`
// absorbs it (their kernels stage rmsnorm(x) themselves and one CTA writes `out`).
struct PendingNorm {
  const float* x = nullptr;
  const float* w = nullptr;
  int n = 0;
  float eps = 0.f;
  float* out = nullptr;
};

// P25 (prefill, T >= gemm_min_t_): an rmsnorm (with a pending residual add) not launched yet; the
// next GEMM batch or prefill MoE reading `out` runs it fused with its operand conversion
// (gemm_rmsnorm_convert, bit-identical), anything else launches it first (flush_pn).
struct PendingPNorm {
  float* h = nullptr;
  const float* r = nullptr;
  const float* w = nullptr;
  int n = 0, T = 0;
  float eps = 0.f;
  float* out = nullptr;
};

// P28 (prefill, T >= gemm_min_t_): the chunked GDN's gated RMSNorm of its raw outputs y, not launched
// yet; the next GEMM batch reading y (the out-projection) runs it fused with its operand conversion
// (gemm_gdn_norm_convert, bit-identical; y itself stays raw), anything else launches it first (flush_gn).
struct PendingGNorm {
  GdnDims d{};
  const float* w = nullptr;
  const float* z = nullptr;
  int T = 0;
  float* y = nullptr;
  bool z16 = false;   // P62: z's buffer holds fp16
};

// P59 (prefill): the MoE's combine (its [T, H] output = Σ of its slot rows) not launched yet; the next
// layer's P25 norm + conversion reads the slot rows instead of the output (gemm_rmsnorm_convert with slots,
// bit-identical), anything else that needs the output, its workspace or the stream's order launches it
// first (flush_comb).
struct PendingComb {
  cuda::MoeSlots sl{};
  float* out = nullptr;
  int H = 0;
};

// D9/D10 (decode): an MoE block held back until the next op, so that a following add(h, out)
// becomes the down kernel's epilogue.
struct PendingMoe {
  bool on = false;
  MoeDev m{};
  const float* x = nullptr;
  float* out = nullptr;
  float* ws = nullptr;
  MoeDecode dec{};
  int T = 1;
  double bytes[3] = {0, 0, 0};   // profiler: router, gate/up, down
  int record = -1;               // test aid: the recorded_ids_ entry this call's expert ids go to
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& opt) : abl_(opt.ablations) {
    int n = 0;
    CUDA_CHECK(cudaGetDeviceCount(&n));
    if (n == 0) throw Error("cuda backend: no CUDA device found");
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    set_ablations(abl_);
    if (const char* v = std::getenv("LILY_GEMM_MIN_T"); v && *v) gemm_min_t_ = std::atoi(v);
    argmax_ws_ = alloc_bytes(argmax_scratch_bytes(4096));
    router_ticket_ = static_cast<int*>(alloc_bytes(64));
    persist_ctr_ = static_cast<int*>(alloc_bytes(4096));   // D19: counters (64 B), tagged logits
    d39_logits_ = static_cast<float*>(alloc_bytes(4 * 2 * 1028));   // D39: E + 1 logits (E <= 1024), Q_h·h
    d39_lh_ = d39_logits_ + 1028;
  }
  ~CudaBackend() override {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    for (auto& e : events_) cudaEventDestroy(e);
    for (auto& e : slot_ev_)
      if (e) cudaEventDestroy(e);
    for (void* p : allocs_) cudaFree(p);
    cudaStreamDestroy(s_);
  }
  std::string name() const override { return "cuda"; }

  // ---- memory -----------------------------------------------------------------------------
  ModelWeights upload(const ModelWeights& host) override {
    drop_d39_folds(nullptr);   // D39: folds belong to the weights they were built from
    ModelWeights d;
    d.config = host.config;
    d.hf_layout = host.hf_layout;
    d.embed_tokens = up(host.embed_tokens);
    d.lm_head = up(host.lm_head);
    d.norm = up(host.norm);
    for (const LayerWeights& l : host.layers) {
      LayerWeights o;
      o.full_attention = l.full_attention;
      o.input_layernorm = up(l.input_layernorm);
      o.post_attention_layernorm = up(l.post_attention_layernorm);
      if (l.full_attention) {
        const AttnWeights& a = l.self_attn;
        o.self_attn = {up(a.q_proj), up(a.k_proj), up(a.v_proj), up(a.o_proj), up(a.q_norm), up(a.k_norm)};
      } else {
        const GdnWeights& g = l.linear_attn;
        o.linear_attn = {up(g.in_proj_qkv), up(g.in_proj_z), up(g.in_proj_a), up(g.in_proj_b), up(g.conv1d),
                         up(g.A_log), up(g.dt_bias), up(g.norm), up(g.out_proj)};
      }
      const MoeWeights& m = l.mlp;
      o.mlp = {up(m.gate), up(m.experts_gate), up(m.experts_up), up(m.experts_down), up(m.shared_gate_proj),
               up(m.shared_up_proj), up(m.shared_down_proj), up(m.shared_expert_gate)};
      d.layers.push_back(std::move(o));
    }
    wait_stream();
    uploaded_.clear();
    return d;
  }
  float* alloc(int64_t n) override { return static_cast<float*>(alloc_bytes(n * 4)); }
  KvType kv_type() const override { return kv16_ ? KvType::f16 : KvType::f32; }
  void kv_from_f32(void* dst, KvType t, const float* src, int64_t n) override {
    flush();
    kv_convert(dst, t == KvType::f16, src, false, n, s_);
  }
  void kv_to_f32(float* dst, const void* src, KvType t, int64_t n) override {
    flush();
    kv_convert(dst, false, src, t == KvType::f16, n, s_);
  }
  int32_t* alloc_i32(int64_t n) override { return static_cast<int32_t*>(alloc_bytes(n * 4)); }
  void free(void* p) override {
    flush_comb();   // P59: it may write the buffer being freed
    drop_d39_folds(p);
    auto it = std::find(allocs_.begin(), allocs_.end(), p);
    if (it == allocs_.end()) return;
    flush();
    wait_stream();
    bytes_ -= alloc_size_[p];
    alloc_size_.erase(p);
    allocs_.erase(it);
    CUDA_CHECK(cudaFree(p));
  }
  void copy_to_host(void* dst, const void* src, int64_t bytes) override {
    flush();
    waiting([&] {   // a copy from or to pageable memory blocks inside the call: all of it counts as waiting
      CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s_));
      CUDA_CHECK(cudaStreamSynchronize(s_));
    });
  }
  void copy_from_host(void* dst, const void* src, int64_t bytes) override {
    flush();
    waiting([&] {   // a copy from or to pageable memory blocks inside the call: all of it counts as waiting
      CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s_));
      CUDA_CHECK(cudaStreamSynchronize(s_));
    });
  }
  void copy(void* dst, const void* src, int64_t bytes) override {
    flush();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_));
  }
  void fill_zero(void* p, int64_t bytes) override {
    flush();
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s_));
  }
  void synchronize() override {
    flush();
    wait_stream();
  }

  // ---- ops --------------------------------------------------------------------------------
  void embed(const QMatrix& E, const int32_t* tokens, int T, float* out) override {
    d39_last_ = {};   // D39: an out-projection's logits are for the MoE right after it
    d39_in_ = {};
    flush();
    unit_ = 0;   // D13: a forward pass starts here
    timed("embed", 0, [&] { cuda::embed(to_qmat(E), tokens, T, out, s_); });
  }
  void rmsnorm(const float* x, const FVec& w, int T, float eps, float* out) override {
    flush_gn();
    flush_moe();
    flush_norm();
    flush_pn();
    flush_mm();
    // P25: held back for the conversion of the GEMM batch or prefill MoE that reads `out`.
    if (p25_ && T >= gemm_min_t_ && cuda::gemm_rmsnorm_convert_ok(int(w.n)) && x != out) {
      if (pend_add_.h && pend_add_.h == x && pend_add_.n == int64_t(T) * w.n && pend_add_.r != out) {
        pend_pn_ = {pend_add_.h, pend_add_.r, w.data, int(w.n), T, eps, out};
        pend_add_ = {};
        return;
      }
      if (!pend_add_.h) {
        pend_pn_ = {const_cast<float*>(x), nullptr, w.data, int(w.n), T, eps, out};
        return;
      }
    }
    flush_comb();   // P59: the norms below read the combine's output
    if (fold_norm_ && T == 1 && !pend_add_.h && w.n % 4 == 0 && x != out) {   // D9: left to the consumer
      pend_norm_ = {x, w.data, int(w.n), eps, out};
      return;
    }
    if (pend_add_.h && pend_add_.h == x && pend_add_.n == int64_t(T) * w.n) {
      PendingAdd p = pend_add_;
      pend_add_ = {};
      timed("add+rmsnorm", 0, [&] { cuda::rmsnorm(p.h, p.r, w.data, int(w.n), T, eps, out, s_); });
      return;
    }
    flush_add();
    timed("rmsnorm", 0, [&] { cuda::rmsnorm(const_cast<float*>(x), nullptr, w.data, int(w.n), T, eps, out, s_); });
  }
  void matmul(const QMatrix& W, const float* x, int T, float* y) override {
    d39_last_ = {};   // D39: an out-projection's logits are for the MoE right after it
    if (pend_comb_.out && (x == pend_comb_.out || y == pend_comb_.out)) flush_comb();   // P59
    flush_moe();
    flush_add();
    const QMat q = to_qmat(W);
    // P28: a held-back GDN norm of x becomes the conversion of the batch this job starts.
    if (pend_gn_.y) {
      if (x == pend_gn_.y && T == pend_gn_.T && gemm_takes(q, T) && q.cols == pend_gn_.d.nv * pend_gn_.d.dv &&
          !mm_gn_.y && !pend_pn_.h && y != pend_gn_.z) {
        flush_mm();
        mm_gn_ = pend_gn_;
        pend_gn_ = {};
      } else {
        flush_gn();
      }
    }
    // P25: a pending prefill rmsnorm producing x joins the batch this job starts or extends.
    if (pend_pn_.h) {
      if (x == pend_pn_.out && T == pend_pn_.T && gemm_takes(q, T) && q.cols == pend_pn_.n && !mm_pn_.h) {
        flush_mm();   // a batch before the norm (none expected: rmsnorm flushed it)
        mm_pn_ = pend_pn_;
        pend_pn_ = {};
      } else {
        flush_pn();
      }
    }
    // D9: a pending rmsnorm producing x becomes part of this batch when its kernel can fold it.
    if (pend_norm_.x) {
      if (x == pend_norm_.out && gemv_norm_ok(q, T, fast_) && q.cols == pend_norm_.n && y != pend_norm_.x) {
        flush_mm();
        mm_norm_ = pend_norm_;
        pend_norm_ = {};
      } else {
        flush_norm();
      }
    }
    bool conflict = pend_T_ != T || int(pend_.size()) == kMaxGemvJobs;
    for (const GemvJob& j : pend_)
      conflict = conflict || j.y == x || j.y == y || j.x == y;
    // A batch with a folded norm reads mm_norm_.x and writes mm_norm_.out (= every job's x).
    if (mm_norm_.x)
      conflict = conflict || x != mm_norm_.out || !gemv_norm_ok(q, T, fast_) || q.cols != mm_norm_.n ||
                 y == mm_norm_.x;
    // A batch with a P25 norm (mm_pn_) runs it before every job: each of its jobs came after the rmsnorm.
    if (conflict) flush_mm();
    pend_T_ = T;
    pend_.push_back({q, x, y});
    if (!batch_) flush_mm();
  }
  void add(float* h, const float* r, int64_t n) override {
    flush_gn();
    // D9: the add becomes the epilogue of the kernel that produces r (it also still writes r).
    // The MoE may read h itself (folded norm, router stage): that is two launches before the down
    // stage, whose writes come after its PDL wait, so the read has completed.
    if (fold_norm_ && pend_moe_.on && pend_moe_.out == r && n == pend_moe_.m.H && pend_moe_.x != h) {
      pend_moe_.dec.res = h;
      flush_moe();
      return;
    }
    if (fold_norm_ && pend_T_ == 1 && !pend_.empty() && pend_.back().y == r && n == pend_.back().w.rows &&
        (!mm_norm_.x || mm_norm_.x != h)) {
      bool reads_h = false;
      for (const GemvJob& j : pend_) reads_h = reads_h || j.x == h || j.y == h || (j.y == r && &j != &pend_.back());
      if (!reads_h) {
        pend_.back().res = h;
        // D39: the in-projection launch of this layer computed Q_h·h (a fold exists: built at an earlier step's
        // MoE); this launch adds Q_a·a; moe() checks that the MoE follows.
        const QMat wo = pend_.back().w;
        const D39In in = d39_in_;
        d39_in_ = {};
        auto f = in.w1 && in.h == h ? d39_folds_.find(in.w1) : d39_folds_.end();
        GemvRouterRows& rt = gemv_router_next();
        rt = {};
        if (d39_ && pend_.size() == 1 && in.attached && f != d39_folds_.end() && f->second.wo == wo.data)
          rt = d39_rows(f->second, true);
        flush_mm();
        d39_last_ = {wo, h, rt.used, in.h == h ? in.w1 : nullptr};
        rt = {};
        return;
      }
    }
    // P59: an add of the held-back combine's output stays held back with it (the next norm may take both).
    if (!(fuse_add_ && pend_comb_.out && r == pend_comb_.out && h != r)) flush_comb();
    flush_rest();
    if (fuse_add_) {
      pend_add_ = {h, r, n};
      return;
    }
    timed("add", 0, [&] { cuda::add(h, r, n, s_); });
  }
  void gdn(const ModelConfig& c, const GdnWeights& w, GdnState& st, const float* qkv, const float* z,
           const float* a, const float* b, int T, float* y) override {
    d39_last_ = {};   // D39: an out-projection's logits are for the MoE right after it
    GdnDims d{c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
              c.conv_dim(), c.linear_conv_kernel_dim, c.rms_norm_eps};
    const bool chunked = gdn_chunked_ > 0 || (gdn_chunked_ < 0 && T >= gdn_chunked_min_t_);
    const bool prefill = prefill_gdn_ && T >= gdn_min_t_ && gdn_prefill_ok(d);
    // P62: the chunked path's raw inputs qkv and z, still pending in the projection batch, asked for in fp16 (half
    // the bytes written by the GEMM and read by the prep and the gated norm); what the batch wrote so is in f16_out_.
    if (p62_ && prefill && chunked && pend_T_ == T && T >= gemm_min_t_ &&
        gdn_prep_wide_ok(d, w.conv1d.data, st.conv, qkv, nullptr)) {   // (the workspace is 256-byte aligned)
      for (GemvJob& j : pend_)
        if ((j.y == qkv && j.w.rows == d.conv_dim) || (j.y == z && j.w.rows == d.nv * d.dv)) j.y16 = true;
    }
    flush();
    const bool qkv16 = f16_out_.erase(qkv) > 0, z16 = f16_out_.erase(z) > 0;
    f16_out_.clear();   // nothing else reads a P62 output
    LILY_CHECK(prefill || (!qkv16 && !z16), "cuda gdn: fp16 inputs only on the prefill path");
    const double bytes = 2.0 * d.nv * d.dk * d.dv * 4;
    // Prefill (P4): parallel pre-pass + column-split register scan; T = 1 stays on the decode kernel.
    if (prefill) {
      // P4c: chunked form (tensor cores) from gdn_chunked_min_t_ tokens on; LILY_GDN_CHUNKED=0|1 forces it.
      LILY_CHECK(chunked || (!qkv16 && !z16), "cuda gdn: fp16 inputs only on the chunked path");
      float* ws = workspace(chunked ? gdn_chunked_workspace_floats(d, T) : gdn_prefill_workspace_floats(d, T));
      const __half* q16 = qkv16 ? reinterpret_cast<const __half*>(qkv) : nullptr;
      timed("gdn_prefill.prep", double(T) * d.conv_dim * 12, [&] {
        gdn_prefill_prep(d, w.conv1d.data, w.A_log.data, w.dt_bias.data, st.conv, qkv, a, b, T, ws, s_, q16);
      });
      if (chunked) {
        timed("gdn_prefill.chunk", double(T) * d.nv * (d.dk * 4 * 4 + 64 * 4 * 2), [&] { gdn_chunked_intra(d, T, ws, s_); });
        timed("gdn_prefill.cscan", bytes + double(T) * d.nv * d.dv * 16, [&] {
          gdn_chunked_scan(d, w.norm.data, st.conv, st.S, q16 ? nullptr : qkv, z, T, ws, y, s_, false);
        });
        if (q16) timed("gdn_prefill.conv_shift16", 0, [&] { gdn_conv_shift16(d, st.conv, q16, T, s_); });
        const PendingGNorm gn{d, w.norm.data, z, T, y, z16};
        // P28: held back for the out-projection's operand conversion (y stays raw until then).
        if (p28_ && T >= gemm_min_t_ && cuda::gemm_gdn_norm_convert_ok(d.nv, d.dv)) pend_gn_ = gn;
        else launch_gn(gn);
        return;
      }
      timed("gdn_prefill.scan", bytes + double(T) * d.nv * d.dv * 16, [&] {
        gdn_prefill_scan(d, w.norm.data, st.conv, st.S, qkv, z, T, ws, y, gdn_nc_, s_);
      });
      return;
    }
    L2Prefetch mine;   // D13: the recurrent state and conv state are what this launch waits for
    pf_add(mine, st.S, int64_t(d.nv) * d.dk * d.dv * 4);
    pf_add(mine, st.conv, int64_t(d.kconv - 1) * d.conv_dim * 4);
    pf_add(mine, w.conv1d.data, w.conv1d.n * 4);
    const L2Prefetch pf = unit_prefetch(mine, T, 1);
    if (T == 1) gdn_trace_next() = trace_slot("gdn");
    timed("gdn", bytes, [&] {
      cuda::gdn(d, w.conv1d.data, w.A_log.data, w.dt_bias.data, w.norm.data, st.conv, st.S, qkv, z, a, b, T, y, s_,
                &pf);
    });
  }
  void attention(const ModelConfig& c, const AttnWeights& w, KvCache& kv, int pos0, const int32_t* pos_dev,
                 const float* q, const float* k, const float* v, int T, float* o) override {
    d39_last_ = {};   // D39: an out-projection's logits are for the MoE right after it
    flush();
    AttnDims d{c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim(), c.rope_theta,
               c.rms_norm_eps, kv.capacity};
    d.min_chunk = d41_ ? 64 : 32;   // D41
    const bool kv16 = kv.type == KvType::f16;   // the cache's own type, not the current switch
    LILY_CHECK(kv16 || kv.type == KvType::f32, "cuda attention: unknown KV cache type");
    const double bytes = 2.0 * (pos0 + T) * d.kv_heads * d.head_dim * kv_elem_bytes(kv.type);
    // Prefill (P6): causal flash attention on tensor cores instead of one split-KV pass per token.
    if (prefill_attn_ && T >= attn_min_t_ && attention_prefill_ok(d)) {
      const bool copy16 = !kv16 && attn_bf16_kv_;   // an fp16 cache needs no 16-bit copy
      float* ws = workspace(attention_prefill_workspace_floats(d, T, pos0, copy16));
      timed("attn_prefill", bytes, [&] {
        attention_prefill(d, w.q_norm.data, w.k_norm.data, kv.k, kv.v, kv16, pos0, q, k, v, T, o, ws, copy16,
                          !attn_bf16_ops_, s_);
      });
      return;
    }
    float* ws = workspace(attention_workspace_floats(d, T));
    const L2Prefetch pf = unit_prefetch(L2Prefetch{}, T, 2);
    if (T == 1) attn_trace_next() = {trace_slot("attn.split"), trace_slot("attn.merge")};
    timed("attention", bytes, [&] {
      cuda::attention(d, w.q_norm.data, w.k_norm.data, kv.k, kv.v, kv16, pos0, pos_dev, q, k, v, T, o, ws,
                      capturing_ ? cap_splits_ : splits_, pack_gqa_, s_, &pf);
    });
  }
  void moe(const ModelConfig& c, const MoeWeights& w, const float* x, int T, float* out) override {
    flush_comb();   // P59: the workspace is about to be reused
    flush_gn();
    flush_moe();
    flush_add();
    MoeDev m{};
    m.E = c.num_experts;
    m.K = c.num_experts_per_tok;
    m.H = c.hidden_size;
    m.I = c.moe_intermediate_size;
    m.Is = c.shared_expert_intermediate_size;
    m.router = to_qmat(w.gate);
    m.shared_gate = to_qmat(w.shared_expert_gate);
    m.gate0 = to_qmat(w.experts_gate.first);
    m.up0 = to_qmat(w.experts_up.first);
    m.down0 = to_qmat(w.experts_down.first);
    m.gate_stride = w.experts_gate.data_stride;
    m.gate_sb_stride = w.experts_gate.sb_stride;
    m.up_stride = w.experts_up.data_stride;
    m.up_sb_stride = w.experts_up.sb_stride;
    m.down_stride = w.experts_down.data_stride;
    m.down_sb_stride = w.experts_down.sb_stride;
    m.sh_gate = to_qmat(w.shared_gate_proj);
    m.sh_up = to_qmat(w.shared_up_proj);
    m.sh_down = to_qmat(w.shared_down_proj);
    // D9: a pending rmsnorm producing x is folded into the router stage when it can be.
    MoeDecode dec{};
    if (pend_norm_.x) {
      if (x == pend_norm_.out && pend_norm_.n == m.H && moe_norm_ok(m, T, fast_) && out != pend_norm_.x) {
        dec.norm = {pend_norm_.x, pend_norm_.w, pend_norm_.eps};
        pend_norm_ = {};
      } else {
        flush_norm();
      }
    }
    // P25: a held-back prefill rmsnorm producing x runs in the prefill MoE's operand conversion.
    PendingPNorm pn{};
    if (pend_pn_.h) {
      if (x == pend_pn_.out && T == pend_pn_.T && pend_pn_.n == m.H && T >= gemm_min_t_ && cuda::moe_prefill_ok(m) &&
          out != pend_pn_.h) {
        pn = pend_pn_;
        pend_pn_ = {};
      } else {
        flush_pn();
      }
    }
    flush_mm();
    // D39: the out-projection launch right before completed this MoE's router logits (or, outside a capture,
    // build the fold for this layer, keyed by its input norm's gain, so that later steps do).
    const D39Last last = d39_last_;
    d39_last_ = {};
    d39_in_ = {};
    if (d39_ && T == 1 && dec.norm.w && last.h && last.w1 && last.h == dec.norm.h && m.router.type == kQ8 &&
        m.shared_gate.type == kQ8 && m.router.rows <= 1024 && last.wo.type == kQ4 && last.wo.rows == m.H) {
      auto f = d39_folds_.find(last.w1);
      if (f != d39_folds_.end()) {
        const D39Fold& fd = f->second;
        if (last.attached && fd.router == m.router.data && fd.sg == m.shared_gate.data && fd.w2 == dec.norm.w &&
            fd.wo == last.wo.data)
          dec.router_logits = d39_logits_;
      } else if (!capturing_) {
        D39Fold fd{nullptr, nullptr, nullptr, m.router.data, m.shared_gate.data, dec.norm.w, last.wo.data, m.E + 1, m.H,
                   last.wo.cols};
        const int64_t nq = int64_t(fd.n) * (m.H + last.wo.cols);
        fd.q = static_cast<float*>(alloc_bytes(nq * 4));
        cuda::build_router_fold(m.router, m.shared_gate, dec.norm.w, last.wo, fd.q, s_);
        // D76: the int16 copy (both kept: a benchmark alternates variants with and without D76 on one model).
        fd.qi = static_cast<int16_t*>(alloc_bytes(nq * 2));
        fd.qscale = static_cast<float*>(alloc_bytes(nq / 64 * 4));
        cuda::router_fold_to_i16(fd.q, fd.qi, fd.qscale, nq, s_);
        d39_folds_[last.w1] = fd;
      }
    }
    if (fuse_router_ && moe_router_topk_ok(m, T, fast_)) {
      dec.counter = router_ticket_;
      dec.early_down = early_down_;
      if (persist_) dec.persist = persist_ctr_;
      dec.flags = moep_flags_ | (abl_.has("D33") ? 2048 : 0);   // D33 off = moep bit 2048
    }
    if (hist_on_) {
      if (!hist_) hist_ = alloc_i32(int64_t(c.num_hidden_layers) * m.E);
      hist_layers_ = c.num_hidden_layers;
      hist_E_ = m.E;
      m.hist = hist_ + int64_t(moe_calls_ % c.num_hidden_layers) * m.E;
    }
    ++moe_calls_;
    if (pn.h) LILY_CHECK(T >= gemm_min_t_ && moe_prefill_ok(m), "cuda moe: P25 norm without the prefill MoE");
    if (T >= gemm_min_t_ && moe_prefill(m, x, T, out, pn)) {
      if (record_ids_) recorded_ids_.push_back(last_moe_ids());   // test aid: synchronises
      return;
    }
    float* ws = workspace(moe_workspace_floats(m, T));
    auto expert_bytes = [](const QStack& s) { return double(type_bytes(s.first) + 2 * sb_bytes(s.first)); };
    auto mat_bytes = [](const QMatrix& q) { return double(type_bytes(q) + 2 * sb_bytes(q)); };
    PendingMoe p;
    p.on = true;
    p.m = m;
    p.x = x;
    p.out = out;
    p.ws = ws;
    p.dec = dec;
    p.T = T;
    if (record_ids_) {   // test aid: filled in once the kernels ran (flush_moe)
      p.record = int(recorded_ids_.size());
      recorded_ids_.emplace_back();
    }
    p.bytes[0] = mat_bytes(w.gate);
    p.bytes[1] = m.K * (expert_bytes(w.experts_gate) + expert_bytes(w.experts_up)) + mat_bytes(w.shared_gate_proj) +
                 mat_bytes(w.shared_up_proj);
    p.bytes[2] = m.K * expert_bytes(w.experts_down) + mat_bytes(w.shared_down_proj);
    pend_moe_ = p;
    // D9: held back for one op so that the residual add can become the down kernel's epilogue.
    if (!(fold_norm_ && T == 1)) flush_moe();
  }
  void argmax(const float* logits, int T, int n, int32_t* ids) override {
    flush();
    LILY_CHECK(T <= 4096, "cuda argmax: at most 4096 rows per call");
    timed("argmax", double(T) * n * 4, [&] { cuda::argmax(logits, T, n, ids, argmax_ws_, s_); });
  }
  void increment(int32_t* p, int by) override {
    flush();
    timed("increment", 0, [&] { cuda::increment(p, by, s_); });
  }

  // ---- sampling and the asynchronous id hand-off (D2) -------------------------------------
  void sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id) override {
    flush();
    const int64_t need = cuda::sample_workspace_bytes(n);
    if (need > sample_ws_bytes_) {
      LILY_CHECK(!capturing_, "cuda backend: the sample workspace must grow before graph capture");
      if (sample_ws_) free(sample_ws_);
      sample_ws_ = alloc_bytes(need);   // zeroed: the kernels rely on it
      sample_ws_bytes_ = need;
    }
    timed("sample", double(n) * 12, [&] { cuda::sample(logits, n, cfg, counts, id, sample_ws_, s_); });
  }
  void* alloc_host(int64_t bytes) override {
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, std::max<int64_t>(bytes, 16)));
    std::memset(p, 0, std::max<int64_t>(bytes, 16));
    return p;
  }
  void free_host(void* p) override {
    if (p) CUDA_CHECK(cudaFreeHost(p));
  }
  void copy_to_host_async(void* dst, const void* src, int64_t bytes) override {
    flush();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s_));
  }
  void record_event(int slot) override {
    flush();
    LILY_CHECK(slot >= 0 && slot < 8, "cuda record_event: slot out of range");
    if (!slot_ev_[slot]) CUDA_CHECK(cudaEventCreateWithFlags(&slot_ev_[slot], cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(slot_ev_[slot], s_));
  }
  void wait_event(int slot) override {
    LILY_CHECK(slot >= 0 && slot < 8 && slot_ev_[slot], "cuda wait_event: slot never recorded");
    waiting([&] { CUDA_CHECK(cudaEventSynchronize(slot_ev_[slot])); });
  }
  bool can_capture() const override { return !abl_.has("D2"); }
  int last_sample_path() { return sample_ws_ ? cuda::sample_last_path(sample_ws_) : -1; }

  // ---- capture (D2) -----------------------------------------------------------------------
  // D44: a step over at most short_len_ positions is captured with short_splits_ slices per KV head (the
  // split-KV grid cannot change inside a graph: the long-context grid costs its launch and merge at 4K).
  int capture_variant(int64_t len) const override { return short_splits_ > 0 && len <= short_len_ ? 1 : 0; }
  bool begin_capture(int variant = 0) override {
    if (abl_.has("D2")) return false;
    // A variant may launch fewer CTAs than the eager steps before it (D44): no stale stamps in its slots.
    if (trace_on_) fill_zero(trace_buf_, int64_t(kTraceSlots) * kTraceCtas * kTracePhases * 8);
    flush();
    wait_stream();
    CUDA_CHECK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    cap_splits_ = variant == 1 && short_splits_ > 0 ? short_splits_ : splits_;
    trace_call_ = 0;   // the step's traced launches fill slots 0, 1, ... at every replay
    return true;
  }
  void end_capture() override {
    flush();
    CUDA_CHECK(cudaStreamEndCapture(s_, &graph_next_));
    capturing_ = false;
    cap_splits_ = splits_;
    if (exec_) CUDA_CHECK(cudaGraphExecDestroy(exec_));
    if (graph_) CUDA_CHECK(cudaGraphDestroy(graph_));
    graph_ = graph_next_;
    CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  void replay() override {
    LILY_CHECK(exec_ != nullptr, "cuda replay: no captured step");
    CUDA_CHECK(cudaGraphLaunch(exec_, s_));
  }

  // ---- tool hooks -------------------------------------------------------------------------
  // Turning profiling on (again) arms a 30 ms spin before the next op: the step queues up behind
  // it and runs back to back, as it would from a graph.
  // P62 test aids (cuda_tools::f16_round / f16_pack / mark_f16).
  void f16_convert(float* p, int64_t n, bool pack) {
    flush();
    float* tmp = pack ? static_cast<float*>(alloc_bytes(n * 2 + 16)) : nullptr;
    cuda::f16_convert(p, n, pack ? reinterpret_cast<__half*>(tmp) : nullptr, s_);
    if (pack) CUDA_CHECK(cudaMemcpyAsync(p, tmp, size_t(n) * 2, cudaMemcpyDeviceToDevice, s_));
    wait_stream();
    if (pack) free(tmp);
  }
  void mark_f16(const float* p) { f16_out_.insert(p); }
  void set_profiling(bool on) {
    synchronize();
    profiling_ = on;
    hold_ = on;
  }
  std::vector<cuda_tools::OpTime> take_profile() {
    synchronize();
    std::map<std::string, cuda_tools::OpTime> acc;
    for (const Mark& m : marks_) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, events_[m.ev0], events_[m.ev0 + 1]));
      auto& o = acc[m.name];
      o.name = m.name;
      o.ms += ms;
      o.calls += 1;
      o.bytes += m.bytes;
    }
    marks_.clear();
    std::vector<cuda_tools::OpTime> out;
    for (auto& [k, v] : acc) out.push_back(v);
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
    return out;
  }
  int64_t device_bytes() const { return bytes_; }
  void set_ablations(const Ablations& a) {
    flush();
    abl_ = a;
    // LILY_ABLATE (comma-separated ids): switched off in every setting, on top of the caller's (a
    // process-wide default, e.g. to run a server or a whole benchmark without one optimization).
    abl_.merge_env();
    skip_.clear();
    moep_flags_ = 0;
    pf_skip_abl_ = 0;
    for (const std::string& id : abl_.off) {
      if (id.rfind("skip=", 0) == 0 && id.size() > 5) skip_.push_back(id.substr(5));
      if (id.rfind("moep=", 0) == 0) moep_flags_ = std::atoi(id.c_str() + 5);   // D19 experiments
      if (id.rfind("pfskip=", 0) == 0) pf_skip_abl_ |= std::atoi(id.c_str() + 7);   // D13 off for some launch kinds
    }
    gemv_x16_enabled() = !abl_.has("D24");      // D24: int16 x, dp2a in the 4-bit decode kernels
    fast_ = !abl_.has("D1");
    mma_q4_enabled() = !abl_.has("D1m");   // D1m: no mma.sync 4-bit kernels (f44444c FFMA ones)
    lmhead_i16_enabled() = !abl_.has("D26");   // D26: lm_head on the int16 GEMV (D24) rather than D1m's mma.sync
    topk_lanes_enabled() = !abl_.has("D27");     // D27: decode MoE top-k on one warp, lanes' logits sorted in registers
    moe_persist_special_enabled() = !abl_.has("D31");   // D31: D19 default configuration as its own instance
    moe_early_pick_enabled() = !abl_.has("D36");   // D36: D31 loads a CTA's first slot before the whole top-k
    d39_ = !abl_.has("D39");   // D39: router logits from the out-projection launch (folded Q = W_r diag(w2) [I | W_o])
    attn_prep_fused_enabled() = !abl_.has("D28");   // D28: attention prep inside the D20 split-KV kernel (T == 1)
    batch_ = !abl_.has("D3b");
    pdl_enabled() = !abl_.has("D3");
    fuse_add_ = !abl_.has("D8");
    fold_norm_ = !abl_.has("D9");     // D9: decode add → producer epilogue, rmsnorm → consumer staging
    fuse_router_ = !abl_.has("D10");  // D10: decode router + top-k in one many-CTA kernel
    stage_regs_enabled() = !abl_.has("D21");     // D21: x / activations staged from registers
    merge_warps_enabled() = !abl_.has("D11");   // D11: split-KV merge with warps across splits
    gdn_split_enabled() = !abl_.has("D12");     // D12: GDN decode step over 4 CTAs per value head
    auto env_int = [](const char* n, int def) { const char* e = std::getenv(n); return e && *e ? std::atoi(e) : def; };
    // Switches written but not yet measured on the device are off unless LILY_TRY=ID,... names them.
    Ablations trial;
    trial.merge_env("LILY_TRY");
    auto tried = [&](const char* id) { return trial.has(id) && !abl_.has(id); };
    attn_merge_early_parts_enabled() = !abl_.has("D68");   // D68: the merge's partials loaded before its slice count
    attn_combine_v4_enabled() = !abl_.has("D66");   // D66: the split-KV combine, 4 dims per thread (same bits)
    attn_q_first_enabled() = !abl_.has("D67");   // D67: the split-KV q / k / v and position loads first after the wait
    gemm_set_moe_p43(!abl_.has("P43"));   // P43: the MoE down GEMM walked N tile fastest
    gemm_set_moe_p46(!abl_.has("P46"));   // P46: the MoE down GEMM's unpacking in one LOP3 fewer per pair
    gemm_set_moe_p47(!abl_.has("P47"));   // P47: the MoE down GEMM's odd pairs unpacked in place
    gemm_set_moe_p48(!abl_.has("P48"));   // P48: the MoE down GEMM's loop without P39's checks for full warps
    gemm_set_moe_p50(!abl_.has("P50"));   // P50: the gate/up kernel's odd pairs unpacked in place
    gemm_set_moe_p53(!abl_.has("P53"));   // P53: short prompts' gate/up at M-tile 32 on a deeper ring
    gemm_set_moe_p55(!abl_.has("P55"), tried("P55n8") ? 8 : 4);   // P55: the down GEMM with its activations resident
    gemm_set_p81(!abl_.has("P81"));   // P81: the P13 kernel's fp16 outputs stored as whole 128-byte rows (same values)
    gemm_set_moe_p78(!abl_.has("P78"));   // P78: the P55 down GEMM's fp16 rows stored as whole sectors (same bits)
    p42_ = !abl_.has("P42");   // P42: the prefill MoE's norm + conversion without its unread f32 x
    p72_ = !abl_.has("P72");   // P72: the prefill top-k's slice loads issued at once (+0.7 % at 1K, session 29)
    gdn_prep_wide_enabled() = !abl_.has("P41");   // P41: the GDN prefill prep a warp per head, float4 per lane
    moe_prefill_set_p3(!abl_.has("P3"));     // P3: the expert M-tile by rows per expert (off: 64 for both GEMMs)
    moe_prefill_set_p40(!abl_.has("P40"));   // P40: the MoE gate/up at M-tile 128 (P34 + P38) from 8 expected rows
    gemm_set_p75(tried("P75"));   // P75 (opt-in): the GDN gated norm + conversion at 5 CTAs per SM (same bits)
    gdn_prep_lean_enabled() = !abl_.has("P74");   // P74: the GDN prefill prep's fp16 window, 8 CTAs per SM (same bits)
    gemm_set_p70(!abl_.has("P70"));   // P70: the prefill norm + conversion's 8-bit dot and bf16 halves, cheaper
    gemm_set_moe_p39(!abl_.has("P39"));   // P39: the MoE down GEMM skips m16 tiles past its tile's rows
    gemm_set_moe_p38(!abl_.has("P38"));   // P38: the P34 MoE kernel's wgmma N = the tile's rows rounded up to 32
    moe_lean_act_enabled() = !abl_.has("D63");   // D63: the MoE's down activations staged in fewer instructions
    d53_ = !abl_.has("D53");   // D53: the out-projection's router-row add loaded with x
    p37_ = !abl_.has("P37");   // P37: the prefill router GEMM with K in slices
    p59_ = !abl_.has("P59");   // P59: the prefill MoE combine folded into the next layer's norm + conversion
    p62_ = !abl_.has("P62");   // P62: the chunked GDN's qkv and z in fp16 from the projection GEMM
    p56_ = !abl_.has("P56");   // P56: the MoE tile lists' full tiles first (16 to 96 expected rows per expert)
    moe_w0_pick_enabled() = !abl_.has("D50");   // D50: the MoE picks on warp 0 while x is staged
    moe_regs88_enabled() = !abl_.has("D88");   // D88: that instance at 88 registers, so a GEMV CTA fits beside it
    // D89: the GEMVs' router-row / norm sums and x staging as interleaved chains (same bits); D90 (with D89): the
    // staging scale by __fdividef. `--ablate D89` turns both off.
    gemv_fused_stage_mode() = abl_.has("D89") ? 0 : abl_.has("D90") ? 1 : 2;
    moe_stage_il_enabled() = !abl_.has("D91");   // D91: the D88 MoE instance's x staging as D89 + D90
    gdn_push_enabled() = !abl_.has("D42");   // D42: D12's Σo² pushed before its cluster barrier
    gdn_s_late_enabled() = !abl_.has("D45");   // D45: D12's state written after its cluster barrier
    gdn_early_state_enabled() = !abl_.has("D55");   // D55: D12's state / conv rows loaded before the PDL wait
    attn_merge_early_gate_enabled() = !abl_.has("D56");   // D56: the merge's output gate loaded with the partials
    gdn_mbar_enabled() = !abl_.has("D60");   // D60: the GDN step's Σo² on an mbarrier (st.async), not a cluster barrier
    // Tuning aid: late PDL triggers (a mask of cuda_ops.h's kLate* bits; none paid in session 17, see CUDA.md).
    pdl_late_mask() = env_int("LILY_PDL_LATE", 0);
    prefetch_ = !abl_.has("D13");               // D13: L2 prefetch of the next launch's weights
    // Tuning aid: D13 off for some launch kinds (unit_prefetch's mask), from LILY_PF_SKIP or the ablation id
    // `pfskip=N` (so that `bench --ablate pfskip=N` alternates it with the defaults).
    pf_skip_ = env_int("LILY_PF_SKIP", 0) | pf_skip_abl_;
    gemv_one_wave_enabled() = !abl_.has("D14");  // D14: one wave of CTAs per decode GEMV batch
    // D15 (router as one 8-CTA cluster) and D16 (its L2 prefetch of the chosen experts) were measured
    // slower than the D10 router and removed (docs/CUDA.md, "D15-D17").
    early_down_ = !abl_.has("D17");       // D17: MoE down loads its rows before its PDL wait
    persist_ = !abl_.has("D19");          // D19: decode MoE block as one persistent kernel
    pack_gqa_ = !abl_.has("D6");
    splits_ = abl_.has("D7") ? 1 : 0;   // 0: sized from the SM count
    d41_ = !abl_.has("D41");   // D41: decode split-KV slices of at least 64 positions (off: 32)
    if (const char* e = std::getenv("LILY_ATTN_SPLITS"); e && *e && !abl_.has("D7")) splits_ = std::atoi(e);   // tuning aid
    // D44: the short-context graph's split count and length bound (LILY_ATTN_SHORT_SPLITS / _MAX: tuning aids).
    short_splits_ = !abl_.has("D44") && splits_ == 0 ? env_int("LILY_ATTN_SHORT_SPLITS", 64) : 0;
    short_len_ = env_int("LILY_ATTN_SHORT_MAX", 12288);
    cap_splits_ = splits_;
    attn_mma_decode_enabled() = !abl_.has("D20");   // D20: tensor-core split-KV decode (fp16 cache)
    attn_kv_prefetch_enabled() = !abl_.has("D43");   // D43: D20's K / V rows prefetched pre-wait
    d76_ = !abl_.has("D76");   // D76: D39's folded router rows read as int16 codes with an fp32 scale per 64
    attn_kv_prefetch_bulk_enabled() = tried("D73");   // D73 (opt-in): that prefetch as 2 bulk copies per CTA, not 128
    attn_mma_pipe_mode() = abl_.has("D25") ? 0 : 2;  // D25: D20's V rows with its K rows, K one step ahead
    kv16_ = !abl_.has("D18");           // D18: fp16 KV cache (off = f32); applies to caches allocated later
    // Prefill mixers: P4 off = the decode GDN kernel for every T, P6 off = per-token split-KV
    // attention for every T. Thresholds and the scan's columns per lane come from the environment.
    prefill_gdn_ = !abl_.has("P4");
    prefill_attn_ = !abl_.has("P6");
    gdn_prep_batched_enabled() = !abl_.has("P9");   // P9: GDN prefill prep with a CTA's loads at once
    attn_prefill_bk64_enabled() = !abl_.has("P12");   // P12: flash attention prefill with 64-key tiles
    gdn_min_t_ = std::max(2, env_int("LILY_GDN_PREFILL_MIN_T", 2));
    gdn_nc_ = env_int("LILY_GDN_SCAN_NC", 0);
    gdn_chunked_ = abl_.has("P4c") ? 0 : env_int("LILY_GDN_CHUNKED", -1);   // P4c off = the scan
    gdn_chunked_min_t_ = std::max(2, env_int("LILY_GDN_CHUNKED_MIN_T", 64));
    // P11: faster chunked GDN kernels; LILY_GDN_P11 = 1 (per-chunk pass only) or 2 (scan only) for
    // tests, 7 = both with q̂ / k̂ shared by the value heads of a key head (experimental), bit 4 (19)
    // = scan3: Q~ = diag(γ)Q − PW and O0 = PU precomputed per chunk, the scan keeps only the
    // state-dependent products (its M = P·T on tensor cores; + bit 3 (27) = M in fp32 FMAs, for tests).
    gdn_chunk_p11() = abl_.has("P11") ? 0 : (env_int("LILY_GDN_P11", 3) & 31);
    gdn_chunk_one() = !abl_.has("P24");   // P24: the chunk scan's products in one bf16 MMA (split bf16 off)
    gdn_scan_nb16() = !abl_.has("P27");   // P27: the P24 chunk scan on 16 state columns per CTA
    gdn_scan_halves() = !abl_.has("P36");   // P36: P27 with two column halves per CTA sharing the tiles
    attn_min_t_ = std::max(1, env_int("LILY_ATTN_PREFILL_MIN_T", 16));
    attn_bf16_kv_ = env_int("LILY_ATTN_BF16KV", 1) != 0;   // flash attention reads a 16-bit copy of the cache
    attn_bf16_ops_ = env_int("LILY_ATTN_BF16", 0) != 0;    // flash MMA operands bf16 (default fp16)
    kv16_u4_enabled() = env_int("LILY_ATTN_KV16_U4", 0) != 0;   // fp16 split-KV: 4 positions per warp in flight
    attn_prefill_qreg_enabled() = env_int("LILY_ATTN_QREG", 0) != 0;   // P12 experiment: Q in registers
    // P12's products: 2 (default) = S and P·V on wgmma, 1 = S only, 0 = both on mma.sync (64-key tiles).
    attn_prefill_wg_mode() = env_int("LILY_ATTN_WG", 2);
    attn_prefill_p33_enabled() = !abl_.has("P33");   // P33: attention prefill Q / gate loads batched
    attn_prefill_p63_enabled() = !abl_.has("P63");   // P63: attention prefill K / V tiles by TMA, producer warp
    attn_prep_rows_enabled() = !abl_.has("P66");   // P66: the prefill attention prep with a warp per head row
    attn_prefill_p67_enabled() = !abl_.has("P67");   // P67: P63's Q tile as fp16 from the prep, loaded by TMA
    p68_ = !abl_.has("P68");   // P68: the prefill router GEMM on the experts' fp16 operand and a kept fp16 copy
    p25_ = !abl_.has("P25");   // P25: prefill rmsnorm fused with the GEMM / MoE operand conversion
    p30_ = !abl_.has("P30");   // P30: dense projections of one input stacked into one GEMM
    p28_ = !abl_.has("P28");   // P28: prefill GDN gated norm fused with the out-projection's conversion
    slot16_ = !abl_.has("P16");   // P16: prefill MoE (token, slot) rows in fp16 between the down GEMM and the combine
    p1_off_ = abl_.has("P1");   // P1: separate dequantisation pass into bf16 before the GEMM
    // P8: dense 4-bit GEMMs of T >= LILY_P8_MIN_T tokens (default 512) dequantise first as P1 off
    // does: the fused mainloop's per-warp unpacking costs more than one pass over the weights once
    // a chunk is long (P1 off measured +1.9 % at 512, +2.1 % at 1K, +4.2 % at 4K end to end; shorter
    // chunks not measured). --ablate P8: always fused.
    p21_ = !abl_.has("P21");   // P21: P8's 16-bit copies of the dense matrices kept across chunks
    // P51 (default on): with P21's copies kept (no dequantisation pass per call), P8 from LILY_P51_MIN_T tokens
    // (default 128) instead of 512, where it was measured when every call still paid the pass (session 24 call 2:
    // +10.8 % at 128 tokens, +8.7 % at 256, +6.5 % at 384).
    const int p8_def = !abl_.has("P51") && p21_ ? std::max(16, env_int("LILY_P51_MIN_T", 128)) : 512;
    p8_min_t_ = abl_.has("P8") ? INT32_MAX : std::max(1, env_int("LILY_P8_MIN_T", p8_def));
    // P52 (default on): the 16-bit-B wgmma GEMM (P13), and so P30's stacked projections, from 72 output tiles instead
    // of 3/4 of the SMs (99 on H200): a 256-token chunk's GDN projections are 2 x 49 tiles and the attention ones
    // 2 x 36. Session 24 call 3 (from 32 tiles): +10.5 % at 256 tokens (GDN projections 2.93 -> 1.10 ms, attention
    // 0.70 -> 0.36 ms per prefill), but -3.8 % at 128 (49 and 36 tiles) and -1.6 % at 1K (the 2048x4096
    // out-projection, 64 tiles): 72 takes the 256-token cases only.
    gemm_set_wg16_min_tiles(abl_.has("P52") ? 0 : std::max(1, env_int("LILY_P52_TILES", 72)));   // tuning aid
    p21_reserve_mb_ = std::max(0, env_int("LILY_P21_RESERVE_MB", 8192));
    p2_off_ = abl_.has("P2");   // P2: MoE prefill groups built on the host
    // P1w: wgmma mainloop for 4-bit fp16 dense GEMMs; opt-in (LILY_GEMM_WGMMA=1): measured 4 % slower
    // end to end than mma.sync at 4K although faster in isolation (docs/CUDA.md). --ablate P1w turns it off.
    gemm_set_wgmma(!abl_.has("P1w") && env_int("LILY_GEMM_WGMMA", 0) != 0);
    gemm_set_skinny(!abl_.has("P7"));   // P7: 32-row projections (in_proj_a/b) on the GEMM from T >= 256
    gemm_set_wide(!abl_.has("P10"));    // P10: 256-wide CTA tiles on the mma.sync GEMM (gemm.h)
    gemm_set_wg16(!abl_.has("P13"));    // P13: P8's 16-bit-B GEMMs on the wgmma kernel (gemm_wg16.cuh)
    gemm_set_moe_p15(!abl_.has("P15"));   // P15: the MoE gate/up GEMM on register-A wgmma (gemm_moe_wg.cuh)
    gemm_set_moe_p18(!abl_.has("P18"));   // P18: P17 with 4 consumer warpgroups (256 weight rows per CTA)
    gemm_set_moe_p32(!abl_.has("P32"));   // P32: P18's step loop in fewer instructions (same bits)
    gemm_set_moe_p34(!abl_.has("P34"));   // P34: P32 with two 64-k steps per ring stage (same bits)
    gemm_set_moe_p35(!abl_.has("P35"));   // P35: down GEMM scatter rows / weights staged before the mainloop
    gemm_set_moe_p17(!abl_.has("P17"));   // P17: the P15 kernel at M-tile 128 too (gemm_moe_wg.cuh, NH = 1)
  }
  // Counting starts at the next MoE call of layer 0; counts are per layer.
  void set_expert_histogram(bool on) {
    synchronize();
    hist_on_ = on;
    moe_calls_ = 0;
    if (hist_) fill_zero(hist_, 4LL * hist_layers_ * hist_E_);
  }
  std::vector<std::vector<int64_t>> expert_histogram() {
    std::vector<std::vector<int64_t>> out;
    if (!hist_) return out;
    std::vector<int32_t> h(size_t(hist_layers_) * hist_E_);
    copy_to_host(h.data(), hist_, 4LL * h.size());
    for (int l = 0; l < hist_layers_; ++l) out.emplace_back(h.begin() + l * hist_E_, h.begin() + (l + 1) * hist_E_);
    return out;
  }
  cudaStream_t stream() const { return s_; }
  std::vector<double> time_ops(const std::function<void()>& op, int warmup, int reps) {
    for (int i = 0; i < warmup; ++i) op();
    synchronize();
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
    for (int i = 0; i < reps; ++i) {
      CUDA_CHECK(cudaEventRecord(ev[2 * i], s_));
      op();
      flush();
      CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], s_));
    }
    synchronize();
    std::vector<double> ms(reps);
    for (int i = 0; i < reps; ++i) {
      float f = 0;
      CUDA_CHECK(cudaEventElapsedTime(&f, ev[2 * i], ev[2 * i + 1]));
      ms[i] = f;
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return ms;
  }
  void record_moe_ids(bool on) {
    LILY_CHECK(!capturing_, "cuda backend: MoE id recording during graph capture");
    record_ids_ = on;
    recorded_ids_.clear();
  }
  std::vector<std::vector<int32_t>> take_moe_ids() { return std::exchange(recorded_ids_, {}); }
  void set_kernel_trace(bool on) {
    LILY_CHECK(!capturing_, "cuda backend: kernel trace switched during graph capture");
    synchronize();
    const int64_t n = int64_t(kTraceSlots) * kTraceCtas * kTracePhases;
    if (on && !trace_buf_) trace_buf_ = static_cast<unsigned long long*>(alloc_bytes(n * 8));
    if (on) fill_zero(trace_buf_, n * 8);
    trace_on_ = on;
    trace_call_ = 0;
    trace_names_.assign(kTraceSlots, std::string());
  }
  // The next trace slot ([CTA][kTracePhases] timestamps) for a launch named `name`; null when off.
  unsigned long long* trace_slot(const std::string& name) {
    if (!trace_on_) return nullptr;
    const int slot = trace_call_++ % kTraceSlots;
    trace_names_[slot] = name;
    return trace_buf_ + int64_t(slot) * kTraceCtas * kTracePhases;
  }
  std::vector<unsigned long long> kernel_trace(std::vector<std::string>& names) {
    synchronize();
    std::vector<unsigned long long> t;
    names = trace_names_;
    if (!trace_buf_) return t;
    t.resize(size_t(kTraceSlots) * kTraceCtas * kTracePhases);
    copy_to_host(t.data(), trace_buf_, int64_t(t.size()) * 8);
    return t;
  }
  std::vector<int32_t> last_moe_ids() {
    std::vector<int32_t> ids;
    if (!last_moe_.ws) return ids;
    ids.resize(size_t(last_moe_.T) * last_moe_.m.K);
    copy_to_host(ids.data(), moe_prefill_ids(last_moe_.m, last_moe_.T, last_moe_.ws), 4LL * ids.size());
    return ids;
  }

 private:
  struct Mark {
    std::string name;
    size_t ev0;
    double bytes;
  };

  // D39: forget (and free) the router folds built from `p` (every fold when p is null): a later model may reuse
  // the addresses.
  void drop_d39_folds(const void* p) {
    for (auto it = d39_folds_.begin(); it != d39_folds_.end();) {
      const D39Fold& f = it->second;
      if (!p || p == it->first || p == f.router || p == f.sg || p == f.w2 || p == f.wo) {
        float* q = f.q;
        int16_t* qi = f.qi;
        float* qscale = f.qscale;
        it = d39_folds_.erase(it);
        d39_last_ = {};
        d39_in_ = {};
        free(q);
        if (qi) free(qi);
        if (qscale) free(qscale);
      } else {
        ++it;
      }
    }
  }
  // Runs f, a call that blocks the host on the device, and adds its time to wait_s_ (benchmarks subtract it from the
  // wall time: what is left is the host's own work, e.g. enqueueing a forward pass); wait_stream: until s_ is idle.
  template <class F>
  void waiting(F&& f) {
    const auto w0 = std::chrono::steady_clock::now();
    f();
    wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  }
  void wait_stream() {
    waiting([&] { CUDA_CHECK(cudaStreamSynchronize(s_)); });
  }
  double host_wait_s() const override { return wait_s_; }
  void* alloc_bytes(int64_t bytes) {
    void* p = nullptr;
    LILY_CHECK(!capturing_, "cuda backend: allocation during graph capture");
    CUDA_CHECK(cudaMalloc(&p, std::max<int64_t>(bytes, 16)));
    // On s_ and waited for: s_ is a non-blocking stream, so a cudaMemset (legacy default stream, asynchronous to
    // the host) could land after a later write on s_ and zero it (session 22: the intermittent cuda-test-attn
    // failures, inputs uploaded by copy_from_host then zeroed).
    CUDA_CHECK(cudaMemsetAsync(p, 0, std::max<int64_t>(bytes, 16), s_));
    wait_stream();
    allocs_.push_back(p);
    alloc_size_[p] = bytes;
    bytes_ += bytes;
    return p;
  }
  const void* up_bytes(const void* host, int64_t bytes) {
    if (!host || bytes <= 0) return nullptr;
    auto it = uploaded_.find(host);
    if (it != uploaded_.end() && it->second.second >= bytes) return it->second.first;
    void* d = alloc_bytes(bytes);
    // On s_ and waited for (a cudaMemcpy from pageable memory may return before its DMA has landed, and the
    // kernels that read the copy run on the non-blocking s_).
    CUDA_CHECK(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, s_));
    wait_stream();
    uploaded_[host] = {d, bytes};
    return d;
  }
  QMatrix up(const QMatrix& m) {
    QMatrix d = m;
    d.data = up_bytes(m.data, type_bytes(m));
    d.scales = up_bytes(m.scales, sb_bytes(m));
    d.biases = up_bytes(m.biases, sb_bytes(m));
    return d;
  }
  QStack up(const QStack& s) {
    QStack d = s;
    QMatrix f = s.first;
    d.first.data = up_bytes(f.data, (s.n - 1) * s.data_stride + type_bytes(f));
    d.first.scales = up_bytes(f.scales, f.quantized() ? (s.n - 1) * s.sb_stride + sb_bytes(f) : 0);
    d.first.biases = up_bytes(f.biases, f.quantized() ? (s.n - 1) * s.sb_stride + sb_bytes(f) : 0);
    return d;
  }
  FVec up(const FVec& v) {
    return {static_cast<const float*>(up_bytes(v.data, v.n * 4)), v.n};
  }
  // P21: the P8 path's 16-bit copy of a dense 4-bit matrix, made once and kept (every later chunk's
  // GEMM reads it instead of dequantising again: ~2.6 ms per 4,096-token chunk, ~2 GB for this
  // model's dense projections). Null (dequantise into the workspace as before) when P21 is off, during
  // graph capture, or when the copy would leave less than LILY_P21_RESERVE_MB (default 8192) of device
  // memory free. Same kernel, same bits as the per-chunk copy.
  uint16_t* kept_dequant(const QMat& w, bool f16) {
    return kept_copy(kept_[f16 ? 1 : 0], std::make_tuple(w.data, w.rows, w.cols), &w, 1, f16);
  }
  // P30: the P21 copies of jobs [i, e) (same input, same cols) stacked by rows in one buffer, made
  // once and kept (keyed by the first matrix's codes, the total rows and the count). Null as for
  // kept_dequant.
  uint16_t* kept_dequant_stack(const std::vector<GemvJob>& jobs, size_t i, size_t e, bool f16) {
    std::vector<QMat> ws;
    int rows = 0;
    for (size_t k = i; k < e; ++k) {
      ws.push_back(jobs[k].w);
      rows += jobs[k].w.rows;
    }
    return kept_copy(kept_stack_[f16 ? 1 : 0], std::make_tuple(jobs[i].w.data, rows, int(e - i)), ws.data(),
                     int(ws.size()), f16);
  }
  // The 16-bit copies of the n matrices ws (same cols) stacked by rows, cached under key; null (and
  // not tried again) when P21 is off, during capture, or when it would leave less than the reserve.
  using KeptKey = std::tuple<const void*, int, int>;
  uint16_t* kept_copy(std::map<KeptKey, uint16_t*>& cache, const KeptKey& key, const QMat* ws, int n, bool f16) {
    if (!p21_ || capturing_) return nullptr;
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    int64_t bytes = 0;
    for (int k = 0; k < n; ++k) bytes += gemm_dequant_bytes(ws[k]);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (int64_t(free_b) - bytes < (int64_t(p21_reserve_mb_) << 20)) {
      cache[key] = nullptr;   // not again for this key
      return nullptr;
    }
    uint16_t* p = static_cast<uint16_t*>(alloc_bytes(bytes));
    int64_t off = 0;
    for (int k = 0; k < n; ++k) {
      const QMat& w = ws[k];
      const std::string shape = std::to_string(w.rows) + "x" + std::to_string(w.cols);
      timed("gemm.dequant.kept " + shape, 2.5 * w.rows * w.cols, [&] { gemm_dequant(w, f16, p + off, s_); });
      off += gemm_dequant_bytes(w) / 2;
    }
    cache[key] = p;
    return p;
  }
  // P68: the router's fp16 copy (gemm_dequant8: 1 MB per layer on this model), made once per matrix and kept;
  // null during a capture before it exists (the prefill is not captured).
  uint16_t* router16(const QMat& w) {
    if (w.type != kQ8) return nullptr;
    auto it = router16_.find(w.data);
    if (it != router16_.end()) return it->second;
    if (capturing_) return nullptr;
    uint16_t* p = static_cast<uint16_t*>(alloc_bytes(gemm_dequant_bytes(w)));
    timed("gemm.dequant8.router", 3.0 * w.rows * w.cols, [&] { gemm_dequant8(w, p, s_); });
    router16_[w.data] = p;
    return p;
  }
  float* workspace(int64_t floats) {
    if (floats > ws_floats_) {
      LILY_CHECK(!capturing_, "cuda backend: workspace must grow before graph capture");
      flush_comb();   // P59: its slot rows are in the old workspace
      if (ws_) free(ws_);
      ws_ = alloc(floats);
      ws_floats_ = floats;
    }
    return ws_;
  }

  // Investigation aid: ablation ids "skip=TEXT" leave out every op whose name contains TEXT (the
  // step's in-graph time without it, by subtraction; the results are wrong on purpose).
  bool skipped(const std::string& name) const {
    for (const std::string& k : skip_)
      if (name.find(k) != std::string::npos) return true;
    return false;
  }
  template <class F>
  void timed(const std::string& name, double bytes, F&& launch) {
    if (skipped(name)) return;
    if (!profiling_ || capturing_) {
      launch();
      return;
    }
    if (hold_) {
      cuda::spin(30000000ull, s_);
      hold_ = false;
    }
    const size_t ev0 = next_event_pair();
    CUDA_CHECK(cudaEventRecord(events_[ev0], s_));
    launch();
    CUDA_CHECK(cudaEventRecord(events_[ev0 + 1], s_));
    marks_.push_back({name, ev0, bytes});
  }
  size_t next_event_pair() {
    const size_t i = marks_.size() * 2;
    while (events_.size() < i + 2) {
      cudaEvent_t e;
      CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    return i;
  }

  void flush_add() {
    if (!pend_add_.h) return;
    if (pend_add_.r == pend_comb_.out) flush_comb();
    PendingAdd p = pend_add_;
    pend_add_ = {};
    timed("add", 0, [&] { cuda::add(p.h, p.r, p.n, s_); });
  }
  void flush_norm() {
    if (!pend_norm_.x) return;
    PendingNorm p = pend_norm_;
    pend_norm_ = {};
    timed("rmsnorm", 0,
          [&] { cuda::rmsnorm(const_cast<float*>(p.x), nullptr, p.w, p.n, 1, p.eps, p.out, s_); });
  }
  void flush_moe() {
    if (!pend_moe_.on) return;
    PendingMoe p = pend_moe_;
    pend_moe_ = {};
    launch_moe(p);
    if (p.record >= 0) {   // test aid: synchronises
      std::vector<int32_t>& ids = recorded_ids_[size_t(p.record)];
      ids.resize(size_t(p.T) * p.m.K);
      copy_to_host(ids.data(), cuda::moe_ids(p.m, p.T, p.ws), 4LL * ids.size());
    }
  }
  void launch_moe(PendingMoe& p) {
    {  // D13: record this launch's fixed weights, prefetch the next launch's
      L2Prefetch mine;
      for (const QMat* q : {&p.m.router, &p.m.sh_gate, &p.m.sh_up, &p.m.sh_down}) pf_add_mat(mine, *q);
      p.dec.pf = unit_prefetch(mine, p.T, 4);
      p.dec.pf_down = prefetch_ && p.T == 1;
    }
    if (p.T == 1 && p.dec.persist) p.dec.trace = trace_slot("moe.persist");
    const MoeDecode* dec = &p.dec;
    const int T = p.T;
    if (profiling_ && !capturing_ && p.dec.persist && T == 1 && cuda::moe_persist_ok(p.m, T, fast_)) {
      timed(p.dec.res ? "moe.persist+add" : "moe.persist", p.bytes[0] + p.bytes[1] + p.bytes[2],
            [&] { cuda::moe(p.m, p.x, T, p.out, p.ws, fast_, 7, s_, dec); });
      return;
    }
    if (profiling_ && !capturing_) {
      const char* names[3] = {p.dec.norm.w ? "moe.router+norm" : "moe.router", "moe.gate_up",
                              p.dec.res ? "moe.down+add" : "moe.down"};
      for (int st = 0; st < 3; ++st)
        timed(names[st], p.bytes[st], [&] { cuda::moe(p.m, p.x, T, p.out, p.ws, fast_, 1 << st, s_, dec); });
      return;
    }
    timed("moe", 0, [&] { cuda::moe(p.m, p.x, T, p.out, p.ws, fast_, 7, s_, dec); });
  }
  void flush_mm() {
    if (pend_.empty()) return;
    if (pend_T_ >= gemm_min_t_) {   // prefill: the GEMM for what it takes, GEMV for the rest
      std::vector<GemvJob> big, small;
      for (const GemvJob& j : pend_) (gemm_takes(j.w, pend_T_) ? big : small).push_back(j);
      if (!big.empty()) {
        pend_.swap(big);
        flush_gemm();   // empties pend_
      }
      pend_.swap(small);
      if (pend_.empty()) return;
    }
    if (mm_pn_.h) {   // P25 norm of a batch without a GEMM (defensive: matmul attaches it to a GEMM job)
      launch_pn(mm_pn_);
      mm_pn_ = {};
    }
    if (mm_gn_.y) {   // P28 likewise
      launch_gn(mm_gn_);
      mm_gn_ = {};
    }
    std::string name = "gemv ";
    double bytes = 0;
    for (size_t i = 0; i < pend_.size(); ++i) {
      const QMat& w = pend_[i].w;
      name += (i ? "+" : "") + std::to_string(w.rows) + "x" + std::to_string(w.cols);
      const double per = w.type == kQ4 ? 0.5 : w.type == kQ8 ? 1 : w.type == kBF ? 2 : 4;
      bytes += double(w.rows) * w.cols * per + (w.type <= kQ8 ? double(w.rows) * (w.cols / w.gs) * 4 : 0);
    }
    std::vector<GemvJob> jobs;
    jobs.swap(pend_);
    GemvNorm norm{mm_norm_.x, mm_norm_.w, mm_norm_.eps};
    const bool has_norm = mm_norm_.x != nullptr;
    mm_norm_ = {};
    if (has_norm) name = "norm+" + name;
    if (jobs.back().res) name += "+add";
    L2Prefetch mine;
    for (const GemvJob& j : jobs) pf_add_mat(mine, j.w);
    const L2Prefetch pf = unit_prefetch(mine, pend_T_, 8);
    gemv_trace_next() = trace_slot(name);
    // D39: a decode batch with a folded norm whose layer has a router fold computes Q_h·h (h as loaded).
    GemvRouterRows& rt = gemv_router_next();   // (add() may have set it for an out-projection: no norm)
    if (has_norm && pend_T_ == 1) {
      rt = {};
      auto f = d39_ && !jobs.back().res ? d39_folds_.find(norm.w) : d39_folds_.end();
      if (f != d39_folds_.end() && f->second.H == jobs[0].w.cols) rt = d39_rows(f->second, false);
    }
    timed(name, bytes, [&] {
      gemv_batch(jobs.data(), int(jobs.size()), pend_T_, fast_, s_, has_norm ? &norm : nullptr, &pf);
    });
    if (has_norm && pend_T_ == 1) {
      d39_in_ = {norm.w, norm.h, rt.used};
      rt = {};
    }
    gemv_trace_next() = nullptr;   // unused when the batch went to the mma or generic kernels
  }
  // ---- D13: L2 prefetch one launch ahead ----------------------------------------------------
  // Every weight-reading launch of a forward pass (GEMV batch, GDN, attention, MoE) is a numbered
  // unit; unit i records the byte ranges it reads and, in decode steps, is handed the ranges that
  // unit i+1 recorded in the previous pass (the step is the same every token; a stale plan only
  // wastes bandwidth, since prefetches change no data). Ranges over kPfCap in total are skipped
  // (the lm_head does not fit in L2).
  static constexpr int64_t kPfCap = 24LL << 20;
  static void pf_add(L2Prefetch& pf, const void* p, int64_t bytes) {
    bytes &= ~int64_t(15);
    if (!p || bytes <= 0 || bytes > kPfCap) return;
    int64_t total = bytes;
    for (int i = 0; i < pf.n; ++i) total += pf.bytes[i];
    if (total > kPfCap) return;
    if (pf.n < L2Prefetch::kMax) {
      pf.p[pf.n] = p;
      pf.bytes[pf.n++] = uint32_t(bytes);
      return;
    }
    int small = 0;   // full: replace the smallest range if this one is larger
    for (int i = 1; i < pf.n; ++i)
      if (pf.bytes[i] < pf.bytes[small]) small = i;
    if (uint32_t(bytes) > pf.bytes[small]) {
      pf.p[small] = p;
      pf.bytes[small] = uint32_t(bytes);
    }
  }
  static void pf_add_mat(L2Prefetch& pf, const QMat& w) {
    const int64_t n = int64_t(w.rows) * w.cols;
    const int64_t data = w.type == kQ4 ? n / 2 : w.type == kQ8 ? n : w.type == kBF ? 2 * n : 4 * n;
    pf_add(pf, w.data, data);
    if (w.type == kQ4 || w.type == kQ8) {
      const int64_t sb = int64_t(w.rows) * (w.cols / w.gs) * (w.sb_f32 ? 4 : 2);
      pf_add(pf, w.scales, sb);
      pf_add(pf, w.biases, sb);
    }
  }
  // `kind` (1 GDN step, 2 attention, 4 MoE, 8 GEMV): the issuing launch, for the LILY_PF_SKIP tuning mask
  // (a launch whose kind is in the mask prefetches nothing).
  L2Prefetch unit_prefetch(const L2Prefetch& mine, int T, int kind) {
    if (int(plan_.size()) <= unit_) plan_.resize(unit_ + 1);
    plan_[unit_] = mine;
    ++unit_;
    if (!prefetch_ || T != 1 || unit_ >= int(plan_.size()) || (pf_skip_ & kind)) return {};
    return plan_[unit_];
  }

  void flush() {
    flush_rest();   // takes the combine where a batch's norm reads it, launches it where anything else does
    flush_comb();
  }
  // P59: the held-back MoE combine, on its own.
  void flush_comb() {
    if (!pend_comb_.out) return;
    const PendingComb p = pend_comb_;
    pend_comb_ = {};
    timed("moe_prefill.combine", 0, [&] { cuda::moe_prefill_combine(p.sl, p.H, p.out, s_); });
  }
  // Every held-back op but the combine.
  void flush_rest() {
    flush_gn();
    flush_moe();
    flush_add();
    flush_norm();
    flush_pn();
    flush_mm();
  }
  // P25: launch a held-back prefill rmsnorm on its own (its reader is not a GEMM conversion).
  void launch_pn(const PendingPNorm& p) {
    if (p.r && p.r == pend_comb_.out) flush_comb();
    timed(p.r ? "add+rmsnorm" : "rmsnorm", 0,
          [&] { cuda::rmsnorm(p.h, p.r, p.w, p.n, p.T, p.eps, p.out, s_); });
  }
  void flush_pn() {
    if (!pend_pn_.h) return;
    const PendingPNorm p = pend_pn_;
    pend_pn_ = {};
    launch_pn(p);
  }
  // P28: launch a held-back GDN norm on its own.
  void launch_gn(const PendingGNorm& p) {
    timed("gdn_prefill.norm", double(p.T) * p.d.nv * p.d.dv * 12,
          [&] { cuda::gdn_prefill_norm(p.d, p.w, p.z, p.T, p.y, s_, p.z16); });
  }
  void flush_gn() {
    if (!pend_gn_.y) return;
    const PendingGNorm p = pend_gn_;
    pend_gn_ = {};
    launch_gn(p);
  }
  // Prefill matmuls (P1): each distinct input converted once (fp16 + row scales, or bf16; bf16 hi/lo
  // too when an 8-bit matrix reads it), one tensor-core GEMM per matrix.
  void flush_gemm() {
    std::vector<GemvJob> jobs;
    jobs.swap(pend_);
    const int T = pend_T_;
    const bool f16 = gemm_f16();
    // P1 off, P8 (not for lm_head-sized matrices: their 16-bit copy would take ~1 GB of workspace)
    auto dequant_first = [&](const QMat& w) { return w.type == kQ4 && (p1_off_ || (T >= p8_min_t_ && w.rows <= 16384)); };
    auto al = [](int64_t b) { return (b + 255) / 256 * 256; };
    std::vector<int64_t> xoff(jobs.size());
    std::vector<int> first(jobs.size(), -1);   // job that converts this input
    std::vector<char> split(jobs.size(), 0);    // input also read by an 8-bit matrix
    int64_t bytes = 0, wb_bytes = 0;
    for (size_t i = 0; i < jobs.size(); ++i) {
      for (size_t k = 0; k < i && first[i] < 0; ++k)
        if (jobs[k].x == jobs[i].x && jobs[k].w.cols == jobs[i].w.cols) first[i] = first[k];
      if (first[i] < 0) first[i] = int(i);
      split[first[i]] = split[first[i]] || jobs[i].w.type == kQ8;
      if (dequant_first(jobs[i].w)) wb_bytes = std::max(wb_bytes, gemm_dequant_bytes(jobs[i].w));
    }
    for (size_t i = 0; i < jobs.size(); ++i)   // per input: a | rs | hi | lo
      if (first[i] == int(i)) {
        const int64_t h = al(int64_t(T) * jobs[i].w.cols * 2);
        xoff[i] = bytes;
        bytes += h + al(int64_t(T) * 4) + (split[i] ? 2 * h : 0);
      }
    char* ws = reinterpret_cast<char*>(workspace((bytes + wb_bytes) / 4 + 1));
    // P59: a held-back combine whose slot rows this batch's buffers would overwrite goes first.
    if (pend_comb_.out && static_cast<const char*>(pend_comb_.sl.p) < ws + bytes + wb_bytes) flush_comb();
    auto operand = [&](size_t f) {   // input f's conversion buffers
      const int64_t h = al(int64_t(T) * jobs[f].w.cols * 2), o = xoff[f];
      GemmA x;
      x.f16 = f16;
      x.a = reinterpret_cast<uint16_t*>(ws + o);
      x.rs = f16 ? reinterpret_cast<float*>(ws + o + h) : nullptr;
      if (split[f]) {
        x.hi = f16 ? reinterpret_cast<uint16_t*>(ws + o + h + al(int64_t(T) * 4)) : nullptr;
        x.lo = reinterpret_cast<uint16_t*>(ws + o + 2 * h + al(int64_t(T) * 4));
      }
      return x;
    };
    // P25: the batch's held-back rmsnorm first, fused with the conversion of its output when a job reads it.
    int fused = -1, fused_gn = -1;
    if (mm_pn_.h) {
      const PendingPNorm p = mm_pn_;
      mm_pn_ = {};
      for (size_t i = 0; i < jobs.size() && fused < 0; ++i)
        if (first[i] == int(i) && jobs[i].x == p.out && jobs[i].w.cols == p.n && p.T == T) fused = int(i);
      // P59: r is the held-back MoE combine's output: read from its slot rows instead (past this batch's buffers).
      const bool comb = fused >= 0 && p.r && p.r == pend_comb_.out && pend_comb_.sl.T == T && pend_comb_.H == p.n;
      if (comb) {
        const GemmA x = operand(size_t(fused));
        const cuda::MoeSlots sl = pend_comb_.sl;
        pend_comb_ = {};
        timed("gemm.combine+norm+convert", 0,
              [&] { gemm_rmsnorm_convert(p.h, nullptr, p.w, p.n, T, p.eps, p.out, x, s_, nullptr, nullptr, &sl); });
      } else if (fused >= 0) {
        if (p.r && p.r == pend_comb_.out) flush_comb();
        const GemmA x = operand(size_t(fused));
        timed("gemm.norm+convert", 0,
              [&] { gemm_rmsnorm_convert(p.h, p.r, p.w, p.n, T, p.eps, p.out, x, s_); });
      } else {
        launch_pn(p);
      }
    }
    // P28: the batch's held-back GDN norm, fused with the conversion of the job that reads its output.
    if (mm_gn_.y) {
      const PendingGNorm p = mm_gn_;
      mm_gn_ = {};
      int g = -1;
      for (size_t i = 0; i < jobs.size() && g < 0; ++i)
        if (first[i] == int(i) && int(i) != fused && jobs[i].x == p.y && jobs[i].w.cols == p.d.nv * p.d.dv && p.T == T)
          g = int(i);
      if (g >= 0) {
        const GemmA x = operand(size_t(g));
        timed("gemm.gdnnorm+convert", 0, [&] {
          gemm_gdn_norm_convert(p.y, p.z, p.w, p.d.nv, p.d.dv, T, p.d.eps, nullptr, x, s_, p.z16);
        });
        fused_gn = g;
      } else {
        launch_gn(p);
      }
    }
    for (size_t i = 0; i < jobs.size();) {
      const GemvJob& j = jobs[i];
      const int f = first[i];
      const GemmA x = operand(size_t(f));
      if (f == int(i) && f != fused && f != fused_gn)
        timed("gemm.convert", 6.0 * T * j.w.cols, [&] { gemm_convert_a(j.x, T, j.w.cols, x, s_); });
      // P30: the jobs from i on that read the same input (all 4-bit with P21 copies) as one GEMM over
      // their copies stacked by rows, each product to its own output.
      size_t e = i;
      int rows = 0;
      if (p30_ && f16 && !p1_off_)
        while (e < jobs.size() && e - i < size_t(kGemmMaxSegs) && first[e] == f && dequant_first(jobs[e].w) &&
               jobs[e].w.cols == j.w.cols && jobs[e].w.rows % 2 == 0)
          rows += jobs[e++].w.rows;
      if (e - i >= 2 && gemm_segmented_ok(T, rows, j.w.cols, f16)) {
        if (const uint16_t* wb = kept_dequant_stack(jobs, i, e, f16)) {
          int seg_rows[kGemmMaxSegs];
          float* seg_y[kGemmMaxSegs];
          std::string shape = "gemm ";
          double wbytes = 0;
          for (size_t k = i; k < e; ++k) {
            seg_rows[k - i] = jobs[k].w.rows;
            seg_y[k - i] = jobs[k].y;
            shape += (k > i ? "+" : "") + std::to_string(jobs[k].w.rows) + "x" + std::to_string(jobs[k].w.cols);
            wbytes += double(jobs[k].w.rows) * jobs[k].w.cols * 0.5 + jobs[k].w.rows * (jobs[k].w.cols / 16.0);
          }
          int h16 = 0;   // P62: the outputs asked for in fp16
          for (size_t k = i; k < e; ++k) h16 |= jobs[k].y16 ? 1 << (k - i) : 0;
          timed(shape, wbytes, [&] { gemm_segmented(x, T, j.w.cols, wb, int(e - i), seg_rows, seg_y, s_, h16); });
          for (size_t k = i; k < e; ++k)
            if (jobs[k].y16) f16_out_.insert(jobs[k].y);
          i = e;
          continue;
        }
      }
      const std::string shape = std::to_string(j.w.rows) + "x" + std::to_string(j.w.cols);
      uint16_t* wb = nullptr;
      if (dequant_first(j.w)) {
        wb = p1_off_ ? nullptr : kept_dequant(j.w, f16);   // P21
        if (!wb) {
          wb = reinterpret_cast<uint16_t*>(ws + bytes);
          timed("gemm.dequant " + shape, 2.5 * j.w.rows * j.w.cols, [&] { gemm_dequant(j.w, f16, wb, s_); });
        }
      }
      const double wbytes = double(j.w.rows) * j.w.cols * (j.w.type == kQ4 ? 0.5 : 1) + j.w.rows * (j.w.cols / 16.0);
      timed("gemm " + shape, wbytes, [&] { gemm(j.w, x, T, j.y, j.w.rows, false, wb, 0, s_); });
      ++i;
    }
  }
  // Prefill MoE (P2, P3) when the weights suit it; false: use the decode kernels.
  bool moe_prefill(const MoeDev& m0, const float* x, int T, float* out, const PendingPNorm& pn = {}) {
    if (!moe_prefill_ok(m0)) return false;
    MoeDev m = m0;
    if (p68_ && gemm_f16()) m.router16 = router16(m.router);   // P68 (null: the split-precision GEMM)
    void* ws = workspace(moe_prefill_workspace_bytes(m, T) / 4 + 1);
    last_moe_ = {m, T, ws};
    MoePrefillOpts o;
    o.host_routing = p2_off_;
    o.slot16 = slot16_;
    o.sg_in_convert = !abl_.has("P19");   // P19: shared-expert gate in the router's operand conversion
    o.skip_x = p42_;                       // P42: no f32 x from that conversion (nothing reads it)
    o.router_split = p37_;                // P37: the router GEMM with K in 4 slices
    o.rank_in_topk = !abl_.has("P71");    // P71: the scatter places rows by the top-k kernel's arrival order
    o.topk_batch = p72_;                  // P72: the top-k kernel's slice loads issued at once
    o.tiles_full_first = p56_;            // P56: full tiles first, partial ones largest first (512-3K prompts)
    if (pn.h) o.pre_norm = {pn.h, pn.r, pn.w, pn.eps};   // P25 (x = pn.out)
    // P59: the combine held back for the next norm (flush_comb launches it when anything else comes first).
    const bool comb_later = p59_ && !skip_.size();
    if (comb_later) o.stages &= ~16;
    auto hold = [&] {
      if (comb_later) pend_comb_ = {cuda::moe_prefill_slots(m, T, ws), out, m.H};
    };
    if (!profiling_ || capturing_) {
      timed("moe_prefill", 0, [&] { cuda::moe_prefill(m, x, T, out, ws, o, s_); });   // (skip= applies)
      hold();
      return true;
    }
    // The router stage timed in its three parts (same kernels, same order as stage bit 1).
    const char* names[8] = {"moe_prefill.router.convert", "moe_prefill.router.gemm", "moe_prefill.router.shared_gate",
                            "moe_prefill.route.topk", "moe_prefill.route.plan", "moe_prefill.gate_up", "moe_prefill.down",
                            "moe_prefill.combine"};
    const int bits[8] = {32, 64, 128, 256, 512, 4, 8, 16};
    for (int i = 0; i < (comb_later ? 7 : 8); ++i) {
      o.stages = bits[i];
      timed(names[i], 0, [&] { cuda::moe_prefill(m, x, T, out, ws, o, s_); });
    }
    hold();
    return true;
  }

  Ablations abl_;
  cudaStream_t s_ = nullptr;
  bool fast_ = true, batch_ = true, fuse_add_ = true, pack_gqa_ = true, fold_norm_ = true, fuse_router_ = true;
  int splits_ = 0;
  int pf_skip_ = 0;
  int pf_skip_abl_ = 0;   // `pfskip=N` ablation ids
  int short_splits_ = 0, short_len_ = 0, cap_splits_ = 0;   // D44
  bool d41_ = true;
  bool kv16_ = true;
  bool prefill_gdn_ = true, prefill_attn_ = true;
  int gdn_min_t_ = 2, gdn_nc_ = 0, attn_min_t_ = 16, gdn_chunked_ = -1, gdn_chunked_min_t_ = 64;
  bool attn_bf16_kv_ = true, attn_bf16_ops_ = false;
  int gemm_min_t_ = 16;             // prefill path from this many tokens (LILY_GEMM_MIN_T)
  bool p1_off_ = false, p2_off_ = false;
  int p8_min_t_ = 512;              // P8: dense GEMMs dequantise first from this many tokens
  bool p21_ = true;                 // P21: keep P8's 16-bit copies (kept_dequant)
  int p21_reserve_mb_ = 8192;       // P21: device memory left free (LILY_P21_RESERVE_MB)
  std::map<KeptKey, uint16_t*> kept_[2];         // P21: [bf16, fp16] copies by (codes, rows, cols)
  std::map<KeptKey, uint16_t*> kept_stack_[2];   // P30: by (first codes, rows, count)
  bool p30_ = true;   // P30: the dense projections of one input as one GEMM
  bool p68_ = true;   // P68: the prefill router GEMM on fp16 operands (router16)
  bool p72_ = true;   // P72: the prefill top-k's slice loads issued at once
  std::map<const void*, uint16_t*> router16_;   // P68: the routers' fp16 copies by codes
  bool d53_ = true;   // D53
  bool p42_ = true;   // P42
  bool p37_ = true;   // P37: the router GEMM with K in slices
  bool p56_ = true;   // P56: the MoE tile lists' full tiles first, partial ones largest first
  bool p59_ = true;   // P59: the prefill MoE's combine read by the next norm from its slot rows
  bool p62_ = true;   // P62: the chunked GDN's raw inputs (qkv, z) as fp16 from the projection GEMM
  std::set<const float*> f16_out_;   // P62: outputs the last GEMM batch wrote as fp16
  PendingComb pend_comb_;
  struct {
    MoeDev m;
    int T;
    void* ws;
  } last_moe_{{}, 0, nullptr};
  std::vector<void*> allocs_;
  std::map<void*, int64_t> alloc_size_;
  std::map<const void*, std::pair<const void*, int64_t>> uploaded_;
  int64_t bytes_ = 0;
  void* argmax_ws_ = nullptr;
  void* sample_ws_ = nullptr;
  int64_t sample_ws_bytes_ = 0;
  cudaEvent_t slot_ev_[8] = {};
  double wait_s_ = 0;   // host seconds blocked on the device (waiting)
  float* ws_ = nullptr;
  int64_t ws_floats_ = 0;
  std::vector<GemvJob> pend_;
  int pend_T_ = 1;
  PendingAdd pend_add_;
  PendingNorm pend_norm_, mm_norm_;   // D9: not launched yet / folded into the pending GEMV batch
  PendingPNorm pend_pn_, mm_pn_;      // P25: not launched yet / fused into the pending GEMM batch's conversion
  PendingGNorm pend_gn_, mm_gn_;      // P28: likewise for the GDN's gated norm
  bool p28_ = true;
  bool p25_ = true;
  PendingMoe pend_moe_;               // D9: MoE held back for the residual add
  // D39: per layer (keyed by its input norm's gain), the folded router rows Q ((E + 1) × (H + C) floats: Q_h | Q_a)
  // and what they fold.
  struct D39Fold {
    float* q;
    int16_t* qi;    // D76: q as int16 codes (built with the fold)
    float* qscale;  // D76: their scales, one per 64 values
    const void* router;
    const void* sg;
    const float* w2;
    const void* wo;
    int n, H, C;
  };
  struct D39In {   // the last decode in-projection batch with a folded norm
    const float* w1 = nullptr;
    const float* h = nullptr;
    bool attached = false;   // it computed Q_h·h into d39_lh_
  };
  struct D39Last {   // the last out-projection launch with a folded residual add
    QMat wo{};
    const float* h = nullptr;
    bool attached = false;   // it completed the router logits in d39_logits_
    const float* w1 = nullptr;   // its layer's input norm gain (the fold's key)
  };
  bool d39_ = true;
  bool d76_ = true;   // D76: the fold's rows read as int16 codes + scales
  std::unordered_map<const float*, D39Fold> d39_folds_;
  D39In d39_in_;
  D39Last d39_last_;
  float* d39_logits_ = nullptr;
  float* d39_lh_ = nullptr;
  // D39: the fold's rows for the in-projection launch (Q_h·h into d39_lh_) or the out-projection launch
  // (Q_a·a + d39_lh_ into d39_logits_).
  GemvRouterRows d39_rows(const D39Fold& f, bool a_part) const {
    GemvRouterRows r;
    r.q = f.q;
    if (d76_ && f.qi) {   // D76
      r.qi = f.qi;
      r.qscale = f.qscale;
    }
    r.qstride = int64_t(f.H) + f.C;
    r.qoff = a_part ? f.H : 0;
    r.cols = a_part ? f.C : f.H;
    r.add = a_part ? d39_lh_ : nullptr;
    r.early_add = d53_;   // D53
    r.out = a_part ? d39_logits_ : d39_lh_;
    r.n = f.n;
    return r;
  }
  int* router_ticket_ = nullptr;      // D10: arrival counter of the fused router kernel (self-resetting)
  bool prefetch_ = true;              // D13
  bool early_down_ = true;            // D17
  bool persist_ = true;               // D19
  bool slot16_ = true;                // P16
  bool record_ids_ = false;           // test aid: the expert ids of every MoE call
  std::vector<std::vector<int32_t>> recorded_ids_;
  int* persist_ctr_ = nullptr;        // D19: the persistent MoE kernel's handoff counters (self-resetting)
  std::vector<L2Prefetch> plan_;      // D13: byte ranges per launch unit of the last forward pass
  int unit_ = 0;
  bool capturing_ = false;
  cudaGraph_t graph_ = nullptr, graph_next_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  bool profiling_ = false, hold_ = false;
  std::vector<std::string> skip_;   // "skip=" ids (see skipped)
  int moep_flags_ = 0;              // "moep=N": MoeDecode::flags
  static constexpr int kTraceSlots = 224;   // traced launches per step (40 MoE + 81 GEMV + 30 GDN + 20 attention)
  unsigned long long* trace_buf_ = nullptr;
  bool trace_on_ = false;
  int trace_call_ = 0;
  std::vector<std::string> trace_names_;
  bool hist_on_ = false;
  int32_t* hist_ = nullptr;
  int hist_layers_ = 0, hist_E_ = 0;
  int64_t moe_calls_ = 0;
  std::vector<cudaEvent_t> events_;
  std::vector<Mark> marks_;
};

CudaBackend& as_cuda(Backend& be) {
  auto* p = dynamic_cast<CudaBackend*>(&be);
  if (!p) throw Error("backend '" + be.name() + "' is not the cuda backend");
  return *p;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opt) {
  return std::make_unique<CudaBackend>(opt);
}

namespace cuda_tools {

void f16_round(Backend& be, float* p, int64_t n) { as_cuda(be).f16_convert(p, n, false); }
void f16_pack(Backend& be, float* p, int64_t n) { as_cuda(be).f16_convert(p, n, true); }
void mark_f16(Backend& be, const float* p) { as_cuda(be).mark_f16(p); }
void set_profiling(Backend& be, bool on) { as_cuda(be).set_profiling(on); }
void set_ablations(Backend& be, const Ablations& a) { as_cuda(be).set_ablations(a); }
void set_expert_histogram(Backend& be, bool on) { as_cuda(be).set_expert_histogram(on); }
std::vector<std::vector<int64_t>> expert_histogram(Backend& be) { return as_cuda(be).expert_histogram(); }
std::vector<OpTime> take_profile(Backend& be) { return as_cuda(be).take_profile(); }
std::vector<double> time_ops(Backend& be, const std::function<void()>& op, int warmup, int reps) {
  return as_cuda(be).time_ops(op, warmup, reps);
}
std::vector<int32_t> last_moe_ids(Backend& be) { return as_cuda(be).last_moe_ids(); }
void record_moe_ids(Backend& be, bool on) { as_cuda(be).record_moe_ids(on); }
std::vector<std::vector<int32_t>> take_moe_ids(Backend& be) { return as_cuda(be).take_moe_ids(); }
void set_kernel_trace(Backend& be, bool on) { as_cuda(be).set_kernel_trace(on); }
std::vector<std::string> kernel_trace_summary(Backend& be) {
  static const char* moe_names[kTracePhases] = {
      "entry", "past PDL wait", "x staged, norm folded", "router rows done", "shared-expert rows done",
      "past handoff 1 (logits)", "top-k + weights", "routed gate/up done", "past handoff 2 (activations)",
      "down: activations staged", "down: rows done (thread 0)", "end (CTA)", "top-k: picks done (warp 0)",
      "top-k: weights done (warp 0)", "", "top-k: lanes sorted (warp 0)"};
  static const char* gdn_names[kTracePhases] = {
      "entry", "past PDL wait", "conv + SiLU staged (barrier 1)", "end (thread 0)", "l2 norms (barrier 2)",
      "m = S^T k reduced (barrier 3)", "S updated, o reduced (barrier 4)", "past cluster barrier 1",
      "y written (warp 0)", "conv state written", "", "", "", "", "", ""};
  static const char* attn_names[kTracePhases] = {"entry", "past PDL wait", "q ready (split)", "end (thread 0)",
                                                 "KV loop done (split)", "K rows arrived (warp 0)",
                                                 "scores done (warp 0)", "V rows arrived, P ready (warp 0)",
                                                 "P V done (warp 0)", "merge: first partials arrived (warp 0)",
                                                 "merge: slices folded (warp 0)", "", "", "", "", ""};
  static const char* gemv_names[8] = {"entry", "past PDL wait", "x staged, norm folded (after the barrier)",
                                      "end (thread 0)", "x arrived (thread 0)", "x in shared memory (thread 0)",
                                      "x all arrived (thread 0)", "router row copied (thread 0, D39)"};
  // A launch's phase names, how many there are, and its end phase (MoE: the CTA's end, else thread 0's).
  struct Phases {
    const char* const* names;
    int n, end;
  };
  auto phases_of = [&](const std::string& n) -> Phases {
    if (n.rfind("moe", 0) == 0) return {moe_names, kTracePhases, 11};
    if (n.rfind("gdn", 0) == 0) return {gdn_names, kTracePhases, 3};
    if (n.rfind("attn", 0) == 0) return {attn_names, kTracePhases, 3};
    return {gemv_names, 8, 3};
  };
  // CTAs that wrote stamps into a slot (their entry stamps are non-zero, in CTA order).
  auto slot_ctas = [](const unsigned long long* b) {
    int G = 0;
    while (G < kTraceCtas && b[size_t(G) * kTracePhases] != 0) ++G;
    return G;
  };
  std::vector<std::string> slot_names;
  const std::vector<unsigned long long> t = as_cuda(be).kernel_trace(slot_names);
  const size_t per = size_t(kTraceCtas) * kTracePhases;
  // Per traced launch: each phase's time since the launch's first CTA entered, at the median CTA
  // and at the last CTA; then, per launch name, the median of those over its launches.
  struct Acc {
    std::vector<std::vector<double>> med, last;
    std::vector<std::vector<std::vector<double>>> cta;   // LILY_TRACE_CTAS: [CTA][phase] over the launches
    int calls = 0, ctas = 0;
  };
  // Investigation aid: LILY_TRACE_CTAS=<launch name prefix> adds a table of every CTA's phases (median over
  // that name's launches), to find which CTAs straggle.
  const char* cta_env = std::getenv("LILY_TRACE_CTAS");
  const std::string cta_name = cta_env ? cta_env : "";
  std::map<std::string, Acc> acc;
  std::vector<std::string> order;
  for (size_t c = 0; c * per < t.size() && c < slot_names.size(); ++c) {
    const unsigned long long* b = t.data() + c * per;
    const int G = slot_ctas(b);
    if (G == 0 || slot_names[c].empty()) continue;
    if (!acc.count(slot_names[c])) order.push_back(slot_names[c]);
    Acc& a = acc[slot_names[c]];
    a.med.resize(kTracePhases);
    a.last.resize(kTracePhases);
    unsigned long long t0 = ~0ull;
    for (int g = 0; g < G; ++g) t0 = std::min(t0, b[size_t(g) * kTracePhases]);
    for (int ph = 0; ph < kTracePhases; ++ph) {
      std::vector<double> v;
      for (int g = 0; g < G; ++g) {
        const unsigned long long x = b[size_t(g) * kTracePhases + ph];
        if (x >= t0) v.push_back(double(x - t0) * 1e-3);
      }
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      a.med[ph].push_back(v[v.size() / 2]);
      a.last[ph].push_back(v.back());
    }
    if (!cta_name.empty() && slot_names[c].rfind(cta_name, 0) == 0) {
      a.cta.resize(std::max<size_t>(a.cta.size(), size_t(G)), std::vector<std::vector<double>>(kTracePhases));
      for (int g = 0; g < G; ++g)
        for (int ph = 0; ph < kTracePhases; ++ph) {
          const unsigned long long x = b[size_t(g) * kTracePhases + ph];
          if (x >= t0) a.cta[g][ph].push_back(double(x - t0) * 1e-3);
        }
    }
    ++a.calls;
    a.ctas = G;
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<std::string> out;
  out.push_back("Kernel phase trace: us since each launch's first CTA entered (median over the launches of one step)");
  for (const std::string& n : order) {
    const Acc& a = acc[n];
    const Phases ph_of = phases_of(n);
    out.push_back("");
    out.push_back("| " + n + " (" + std::to_string(a.calls) + " launches, " + std::to_string(a.ctas) +
                  " CTAs) | median CTA | last CTA |");
    out.push_back("|---|---:|---:|");
    for (int ph = 0; ph < ph_of.n; ++ph) {
      if (a.med[ph].empty()) continue;
      char buf[200];
      std::snprintf(buf, sizeof buf, "| %d %s | %.2f | %.2f |", ph, ph_of.names[ph],
                    median(a.med[ph]), median(a.last[ph]));
      out.push_back(buf);
    }
    if (a.cta.empty()) continue;
    out.push_back("");
    std::string head = "| " + n + ": CTA |", rule = "|---:|";
    for (int ph = 0; ph < ph_of.n; ++ph)
      if (!a.med[ph].empty()) {
        head += " " + std::to_string(ph) + " |";
        rule += "---:|";
      }
    out.push_back(head);
    out.push_back(rule);
    for (size_t g = 0; g < a.cta.size(); ++g) {
      std::string row = "| " + std::to_string(g) + " |";
      for (int ph = 0; ph < ph_of.n; ++ph) {
        if (a.med[ph].empty()) continue;
        char buf[32];
        if (a.cta[g][ph].empty()) std::snprintf(buf, sizeof buf, " |");
        else std::snprintf(buf, sizeof buf, " %.2f |", median(a.cta[g][ph]));
        row += buf;
      }
      out.push_back(row);
    }
  }
  // The step as a chain: traced launches in time order over the last whole step (after the previous
  // lm_head launch, up to the last one). For each launch: the release gap from the previous traced
  // launch's last end stamp to this launch's first CTA past its PDL wait (untraced kernels between
  // them fall inside the gap), and its busy time from there to its own last end
  // stamp (thread 0's; MoE: the CTA's). Medians per transition.
  struct Launch {
    double entry, wait, end;
    std::string name;
  };
  std::vector<Launch> tl;
  for (size_t c = 0; c * per < t.size() && c < slot_names.size(); ++c) {
    const unsigned long long* b = t.data() + c * per;
    if (slot_names[c].empty()) continue;
    const int end_ph = phases_of(slot_names[c]).end;
    // A slot can hold stamps of an earlier launch (an earlier step, or more CTAs): only CTAs that
    // entered within 500 us before the slot's latest end stamp count.
    unsigned long long e = ~0ull, w = ~0ull, z = 0;
    const int G = slot_ctas(b);
    for (int g = 0; g < G; ++g) z = std::max(z, b[size_t(g) * kTracePhases + end_ph]);
    for (int g = 0; g < G; ++g) {
      const unsigned long long x = b[size_t(g) * kTracePhases];
      if (x + 500000ull < z || x > z) continue;
      e = std::min(e, x);
      w = std::min(w, b[size_t(g) * kTracePhases + 1]);
    }
    if (e == ~0ull || w == 0 || z < w) continue;
    tl.push_back({double(e) * 1e-3, double(w) * 1e-3, double(z) * 1e-3, slot_names[c]});
  }
  std::sort(tl.begin(), tl.end(), [](const Launch& x, const Launch& y) { return x.entry < y.entry; });
  std::vector<size_t> heads;   // lm_head launches: the step's last GEMV
  for (size_t i = 0; i < tl.size(); ++i)
    if (tl[i].name.find("248320x") != std::string::npos) heads.push_back(i);
  if (!heads.empty()) {   // a replayed graph overwrites the same slots: often one step, one lm_head
    const size_t i1 = heads.back();
    const size_t first = heads.size() >= 2 ? heads[heads.size() - 2] + 1 : 0;   // the step's first launch
    struct Tr {
      std::vector<double> gap, busy;
    };
    std::map<std::string, Tr> tr;
    std::vector<std::string> tr_order;
    for (size_t i = first + 1; i <= i1; ++i) {
      const std::string key = tl[i - 1].name + " -> " + tl[i].name;
      if (!tr.count(key)) tr_order.push_back(key);
      tr[key].gap.push_back(tl[i].wait - tl[i - 1].end);
      tr[key].busy.push_back(tl[i].end - tl[i].wait);
    }
    char buf[400];
    out.push_back("");
    std::snprintf(buf, sizeof buf,
                  "Step timeline: %zu traced launches, %.2f us from the first one's entry to the lm_head's end "
                  "(median per transition; gap = previous launch's last end stamp -> first CTA past the PDL wait)",
                  i1 - first + 1, tl[i1].end - tl[first].entry);
    out.push_back(buf);
    out.push_back("");
    out.push_back("| previous -> launch | count | gap us | busy us | gap + busy, all counts us |");
    out.push_back("|---|---:|---:|---:|---:|");
    double tot = 0;
    for (const std::string& k : tr_order) {
      const Tr& x = tr[k];
      double sum = 0;
      for (size_t j = 0; j < x.gap.size(); ++j) sum += x.gap[j] + x.busy[j];
      tot += sum;
      std::snprintf(buf, sizeof buf, "| %s | %zu | %.2f | %.2f | %.1f |", k.c_str(), x.gap.size(), median(x.gap),
                    median(x.busy), sum);
      out.push_back(buf);
    }
    std::snprintf(buf, sizeof buf, "| total | %zu | | | %.1f |", i1 - first, tot);
    out.push_back(buf);
  }
  return out;
}
int64_t device_bytes(Backend& be) { return as_cuda(be).device_bytes(); }
bool last_moe_slot16(Backend& be) {
  as_cuda(be).synchronize();
  return cuda::moe_prefill_last_slot16();
}
std::vector<int> moe_topk_ids(const std::vector<float>& logits, int rows, int E, int K, bool lanes) {
  LILY_CHECK(int64_t(logits.size()) == int64_t(rows) * E, "moe_topk_ids: logits size");
  std::vector<int> ids(size_t(rows) * K);
  cuda::topk_select_test(logits.data(), rows, E, K, lanes, ids.data());
  return ids;
}
int last_sample_path(Backend& be) {
  as_cuda(be).synchronize();
  return as_cuda(be).last_sample_path();
}

double copy_bandwidth_gbs(Backend& be, int64_t bytes) {
  CudaBackend& cb = as_cuda(be);
  cb.synchronize();
  void *a = nullptr, *b = nullptr;
  CUDA_CHECK(cudaMalloc(&a, bytes));
  CUDA_CHECK(cudaMalloc(&b, bytes));
  CUDA_CHECK(cudaMemsetAsync(a, 1, bytes, cb.stream()));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cb.stream()));
  const int reps = 20;
  CUDA_CHECK(cudaEventRecord(e0, cb.stream()));
  for (int i = 0; i < reps; ++i)
    CUDA_CHECK(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, cb.stream()));
  CUDA_CHECK(cudaEventRecord(e1, cb.stream()));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  return 2.0 * double(bytes) * reps / (ms * 1e-3) / 1e9;
}

double launch_floor_us(Backend& be, bool pdl) {
  CudaBackend& cb = as_cuda(be);
  cb.synchronize();
  const bool saved = pdl_enabled();
  pdl_enabled() = pdl;
  int32_t* p = cb.alloc_i32(1);
  const int nodes = 400;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(cb.stream(), cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < nodes; ++i) cuda::increment(p, 1, cb.stream());
  CUDA_CHECK(cudaStreamEndCapture(cb.stream(), &g));
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  pdl_enabled() = saved;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaGraphLaunch(ge, cb.stream()));
  CUDA_CHECK(cudaEventRecord(e0, cb.stream()));
  for (int r = 0; r < 5; ++r) CUDA_CHECK(cudaGraphLaunch(ge, cb.stream()));
  CUDA_CHECK(cudaEventRecord(e1, cb.stream()));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cb.free(p);
  return 1e3 * ms / (5.0 * nodes);
}

void fill_uniform(Backend& be, float* p, int64_t n, float scale, uint64_t seed) {
  CudaBackend& cb = as_cuda(be);
  cb.synchronize();
  cuda::fill_uniform(p, n, scale, seed, cb.stream());
}

std::string device_name() {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  return std::string(prop.name) + " (" + std::to_string(prop.multiProcessorCount) + " SMs, " +
         std::to_string(prop.totalGlobalMem >> 20) + " MiB)";
}

}  // namespace cuda_tools
}  // namespace lily
