// The Qwen3.6-35B-A3B forward pass (MODEL.md §2), written once against backend.h.
#include "model/qwen36.h"

#include <algorithm>
#include <string>

#include "core/common.h"

namespace lily {

Qwen36State::~Qwen36State() {
  if (!backend) return;
  for (auto& g : gdn) {
    if (g.conv) backend->free(g.conv);
    if (g.S) backend->free(g.S);
  }
  for (auto& kv : kv) {
    if (kv.k) backend->free(kv.k);
    if (kv.v) backend->free(kv.v);
  }
}

Qwen36::Qwen36(std::shared_ptr<const ModelWeights> host, Backend& backend, ModelOptions opt)
    : host_(std::move(host)), be_(backend), opt_(opt) {
  if (opt_.max_chunk < 1) throw Error("prefill chunk size must be at least 1");
  w_ = be_.upload(*host_);
  const ModelConfig& c = w_.config;
  const int64_t C = opt_.max_chunk, H = c.hidden_size;
  const int64_t attn_q = int64_t(c.num_attention_heads) * c.head_dim;   // query (or gate) width
  const int64_t attn_kv = int64_t(c.num_key_value_heads) * c.head_dim;
  tok_ = be_.alloc_i32(C);
  pos_dev_ = be_.alloc_i32(1);
  h_ = be_.alloc(C * H);
  xn_ = be_.alloc(C * H);
  r_ = be_.alloc(C * H);
  proj1_ = be_.alloc(C * std::max<int64_t>(c.conv_dim(), 2 * attn_q));           // qkv | q+gate
  proj2_ = be_.alloc(C * c.linear_value_dim());                                   // z
  pa_ = be_.alloc(C * std::max<int64_t>(c.linear_num_value_heads, attn_kv));      // a | k
  pb_ = be_.alloc(C * std::max<int64_t>(c.linear_num_value_heads, attn_kv));      // b | v
  mix_ = be_.alloc(C * std::max<int64_t>(c.linear_value_dim(), attn_q));          // mixer output
  logits_ = be_.alloc(c.vocab_size);
}

int64_t Qwen36::state_bytes(int capacity) const {
  const ModelConfig& c = w_.config;
  const int64_t eb = kv_elem_bytes(be_.kv_type());   // the type new_state would allocate
  int64_t bytes = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_full_attention[l])
      bytes += 2LL * capacity * c.num_key_value_heads * c.head_dim * eb;
    else
      bytes += 4 * (int64_t(c.linear_conv_kernel_dim - 1) * c.conv_dim() +
                    int64_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim);
  }
  return bytes;
}

std::unique_ptr<Qwen36State> Qwen36::new_state(int capacity) {
  const ModelConfig& c = w_.config;
  auto st = std::make_unique<Qwen36State>();
  st->backend = &be_;
  st->capacity = capacity;
  st->gdn.resize(c.num_hidden_layers);
  st->kv.resize(c.num_hidden_layers);
  const KvType kt = be_.kv_type();
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_full_attention[l]) {
      const int64_t bytes = int64_t(capacity) * c.num_key_value_heads * c.head_dim * kv_elem_bytes(kt);
      st->kv[l].k = be_.alloc((bytes + 3) / 4);
      st->kv[l].v = be_.alloc((bytes + 3) / 4);
      st->kv[l].capacity = capacity;
      st->kv[l].type = kt;
    } else {
      st->gdn[l].conv = be_.alloc(int64_t(c.linear_conv_kernel_dim - 1) * c.conv_dim());
      st->gdn[l].S = be_.alloc(int64_t(c.linear_num_value_heads) * c.linear_key_head_dim *
                               c.linear_value_head_dim);
    }
  }
  return st;
}

void Qwen36::reset(Qwen36State& st) {
  const ModelConfig& c = w_.config;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_full_attention[l]) continue;   // KV rows beyond pos are never read
    be_.fill_zero(st.gdn[l].conv, 4LL * (c.linear_conv_kernel_dim - 1) * c.conv_dim());
    be_.fill_zero(st.gdn[l].S, 4LL * c.linear_num_value_heads * c.linear_key_head_dim *
                                   c.linear_value_head_dim);
  }
  st.pos = 0;
}

void Qwen36::copy_state(const Qwen36State& src, Qwen36State& dst) {
  const ModelConfig& c = w_.config;
  LILY_CHECK(dst.capacity >= src.pos, "copy_state: destination too small");
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_full_attention[l]) {
      LILY_CHECK(dst.kv[l].type == src.kv[l].type, "copy_state: KV caches of different element types");
      const int64_t bytes = int64_t(kv_elem_bytes(src.kv[l].type)) * src.pos * c.num_key_value_heads * c.head_dim;
      if (bytes) {
        be_.copy(dst.kv[l].k, src.kv[l].k, bytes);
        be_.copy(dst.kv[l].v, src.kv[l].v, bytes);
      }
    } else {
      be_.copy(dst.gdn[l].conv, src.gdn[l].conv,
               4LL * (c.linear_conv_kernel_dim - 1) * c.conv_dim());
      be_.copy(dst.gdn[l].S, src.gdn[l].S,
               4LL * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim);
    }
  }
  dst.pos = src.pos;
}

void Qwen36::forward(Qwen36State& st, std::span<const int32_t> tokens, float* logits_out,
                     bool all_logits) {
  const int64_t n = int64_t(tokens.size());
  if (n == 0) return;
  if (st.pos + n > st.capacity)
    throw Error("context length exceeded: " + std::to_string(st.pos) + " + " + std::to_string(n) +
                " tokens > capacity " + std::to_string(st.capacity));
  const int vocab = w_.config.vocab_size;
  for (int64_t i = 0; i < n; i += opt_.max_chunk) {
    const int T = int(std::min<int64_t>(opt_.max_chunk, n - i));
    const bool last = i + T == n;
    float* out = nullptr;
    if (logits_out && all_logits) out = logits_out + i * vocab;
    else if (logits_out && last) out = logits_out;
    forward_chunk(st, tokens.data() + i, T, out, all_logits);
  }
}

void Qwen36::run_layers(Qwen36State& st, int T) {
  const ModelConfig& c = w_.config;
  const int64_t H = c.hidden_size;
  const float eps = c.rms_norm_eps;
  be_.embed(w_.embed_tokens, tok_, T, h_);                                 // h   [T, H]
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = w_.layers[l];
    be_.rmsnorm(h_, L.input_layernorm, T, eps, xn_);                     // x̃   [T, H]
    if (L.full_attention) {
      const AttnWeights& a = L.self_attn;
      be_.matmul(a.q_proj, xn_, T, proj1_);                              // [T, heads*2*hd]
      be_.matmul(a.k_proj, xn_, T, pa_);                                 // [T, kv*hd]
      be_.matmul(a.v_proj, xn_, T, pb_);                                 // [T, kv*hd]
      be_.attention(c, a, st.kv[l], st.pos, pos_dev_, proj1_, pa_, pb_, T, mix_);
      be_.matmul(a.o_proj, mix_, T, r_);                                 // [T, H]
    } else {
      const GdnWeights& g = L.linear_attn;
      be_.matmul(g.in_proj_qkv, xn_, T, proj1_);                         // [T, conv_dim]
      be_.matmul(g.in_proj_z, xn_, T, proj2_);                           // [T, value_dim]
      be_.matmul(g.in_proj_a, xn_, T, pa_);                              // [T, nv]
      be_.matmul(g.in_proj_b, xn_, T, pb_);                              // [T, nv]
      be_.gdn(c, g, st.gdn[l], proj1_, proj2_, pa_, pb_, T, mix_);       // [T, value_dim]
      be_.matmul(g.out_proj, mix_, T, r_);                               // [T, H]
    }
    be_.add(h_, r_, T * H);
    be_.rmsnorm(h_, L.post_attention_layernorm, T, eps, xn_);
    be_.moe(c, L.mlp, xn_, T, r_);                                       // [T, H]
    be_.add(h_, r_, T * H);
  }
  be_.rmsnorm(h_, w_.norm, T, eps, xn_);
}

void Qwen36::forward_chunk(Qwen36State& st, const int32_t* tokens_host, int T, float* logits_out,
                           bool all_logits) {
  const ModelConfig& c = w_.config;
  for (int t = 0; t < T; ++t)
    if (tokens_host[t] < 0 || tokens_host[t] >= c.vocab_size)
      throw Error("token id " + std::to_string(tokens_host[t]) + " out of range [0, " +
                  std::to_string(c.vocab_size) + ")");
  be_.copy_from_host(tok_, tokens_host, 4LL * T);
  const int32_t pos = st.pos;
  be_.copy_from_host(pos_dev_, &pos, 4);
  run_layers(st, T);
  st.pos += T;
  if (!logits_out) return;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  if (all_logits) {
    if (logits_rows_ < T) {   // grown once to the chunk size, never per token
      be_.free(logits_);
      logits_ = be_.alloc(int64_t(opt_.max_chunk) * V);
      logits_rows_ = opt_.max_chunk;
    }
    be_.matmul(w_.lm_head, xn_, T, logits_);
    be_.copy_to_host(logits_out, logits_, 4LL * T * V);
  } else {
    be_.matmul(w_.lm_head, xn_ + (T - 1) * H, 1, logits_);
    be_.copy_to_host(logits_out, logits_, 4LL * V);
  }
}

}  // namespace lily
