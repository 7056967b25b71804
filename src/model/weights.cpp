// Checkpoint directory → ModelWeights: resolves MLX / HF tensor names, validates every text tensor
// against the config, exposes big matrices as views into the mmap and small vectors as f32 copies.
#include "model/weights.h"

#include <algorithm>
#include <map>
#include <set>

#include "core/common.h"
#include "core/mapped_file.h"
#include "core/progress.h"
#include "core/safetensors.h"

namespace lily {

// ---- QMatrix / QStack -------------------------------------------------------------------------

int64_t QMatrix::data_bytes_per_row() const {
  switch (type) {
    case WType::kAffine4: return cols / 2;
    case WType::kAffine8: return cols;
    case WType::kBF16: return cols * 2;
    case WType::kF32: return cols * 4;
  }
  return 0;
}

int64_t QMatrix::sb_bytes_per_row() const {
  if (!quantized()) return 0;
  return cols / group_size * (sb_f32 ? 4 : 2);
}

QMatrix QMatrix::row_slice(int64_t r0, int64_t n) const {
  LILY_CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows, "row_slice out of range");
  QMatrix m = *this;
  m.rows = n;
  m.data = static_cast<const uint8_t*>(data) + r0 * data_bytes_per_row();
  if (quantized()) {
    m.scales = static_cast<const uint8_t*>(scales) + r0 * sb_bytes_per_row();
    m.biases = static_cast<const uint8_t*>(biases) + r0 * sb_bytes_per_row();
  }
  return m;
}

QMatrix QStack::expert(int64_t e) const {
  LILY_CHECK(e >= 0 && e < n, "expert index out of range");
  QMatrix m = first;
  m.data = static_cast<const uint8_t*>(first.data) + e * data_stride;
  if (first.quantized()) {
    m.scales = static_cast<const uint8_t*>(first.scales) + e * sb_stride;
    m.biases = static_cast<const uint8_t*>(first.biases) + e * sb_stride;
  }
  return m;
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

// Tensors outside the text model that every reference loader drops (MTP head, vision tower).
bool skipped(const std::string& n) {
  for (const char* p : {"mtp.", "model.mtp", "language_model.mtp", "model.language_model.mtp",
                        "language_model.model.mtp", "model.visual.", "vision_tower.", "model.vision_tower.",
                        "visual."})
    if (starts_with(n, p)) return true;
  return false;
}

// Prefixes of the published layouts, mapped to the canonical (prefix-free) name.
struct PrefixRule {
  const char* file_prefix;
  const char* canon_prefix;
};
constexpr PrefixRule kPrefixes[] = {
    {"language_model.model.", ""},            // MLX (mlx-lm / mlx-vlm conversions)
    {"language_model.lm_head.", "lm_head."},  // MLX
    {"model.language_model.", ""},            // HF multimodal checkpoint
    {"model.", ""},                           // flat text-only (HF or MLX)
    {"lm_head.", "lm_head."},                 // HF
};

class Loader {
 public:
  Loader(const std::string& dir, const LoadOptions& opt) : dir_(dir), opt_(opt) {}
  ModelWeights run();

 private:
  struct Ref {
    const TensorInfo* t = nullptr;
    bool used = false;
  };

  void index_names();
  void detect_layout();
  [[noreturn]] void bad(const TensorInfo& t, const std::string& msg) const {
    throw Error("tensor " + t.name + " in " + t.path() + ": " + msg);
  }
  std::string display(const std::string& canon) const {
    return starts_with(canon, "lm_head.") ? head_prefix_ + canon.substr(8) : model_prefix_ + canon;
  }
  const TensorInfo* find(const std::string& canon) {
    auto it = refs_.find(canon);
    if (it == refs_.end()) return nullptr;
    it->second.used = true;
    return it->second.t;
  }
  const TensorInfo& get(const std::string& canon) {
    if (const TensorInfo* t = find(canon)) return *t;
    throw Error("missing tensor " + display(canon) + " in " + set_.describe());
  }
  void expect_shape(const TensorInfo& t, const std::vector<int64_t>& want, const std::string& what) const {
    if (t.shape != want) bad(t, "shape " + t.shape_str() + " does not match the config (expected " + shape_str(want) + what + ")");
  }
  QStack load_q(const std::string& mod, int64_t n, int64_t rows, int64_t cols);
  QMatrix matrix(const std::string& mod, int64_t rows, int64_t cols) { return load_q(mod, 0, rows, cols).first; }
  QStack stack(const std::string& mod, int64_t n, int64_t rows, int64_t cols) { return load_q(mod, n, rows, cols); }
  void hf_experts(const std::string& p, MoeWeights& m);
  QStack hf_split_experts(const std::string& p, const std::string& proj, int64_t rows, int64_t cols);
  FVec vec(const std::string& canon, int64_t n, float add = 0.f);
  FVec conv(const std::string& canon);
  FVec to_f32(const TensorInfo& t, float add);
  void load_layer(int l, LayerWeights& L);
  void prefault();

  std::string dir_;
  LoadOptions opt_;
  TensorSet set_;
  ModelWeights w_;
  std::map<std::string, Ref> refs_;                // canonical name → tensor
  std::string model_prefix_ = "language_model.model.", head_prefix_ = "language_model.lm_head.";
  float norm_shift_ = 0.f;                          // 1.0 for raw HF zero-centred norms
};

void Loader::index_names() {
  std::map<std::string, int> prefix_count;
  for (const auto& [name, info] : set_.all()) {
    if (skipped(name)) continue;
    std::string canon;
    for (const PrefixRule& r : kPrefixes) {
      if (starts_with(name, r.file_prefix)) {
        canon = r.canon_prefix + name.substr(std::string(r.file_prefix).size());
        if (!*r.canon_prefix) prefix_count[r.file_prefix]++;
        break;
      }
    }
    if (canon.empty()) bad(info, "unexpected tensor (not part of the Qwen3.6 text model)");
    auto [it, fresh] = refs_.emplace(canon, Ref{&info, false});
    if (!fresh) bad(info, "names the same weight as " + it->second.t->name + " in " + it->second.t->path());
  }
  // Name absent tensors in the checkpoint's own convention.
  int best = -1;
  for (const auto& [p, n] : prefix_count)
    if (n > best) best = n, model_prefix_ = p;
  head_prefix_ = model_prefix_ == "language_model.model." ? "language_model.lm_head." : "lm_head.";
}

// Raw HF checkpoints keep zero-centred norms and conv1d as [C, 1, K]; MLX conversions fold the +1
// and store [C, K, 1]. The conv layout decides, as in the reference sanitize (MODEL.md §4.3).
void Loader::detect_layout() {
  const TensorInfo* first = nullptr;
  for (int l = 0; l < w_.config.num_hidden_layers; ++l) {
    if (w_.config.is_full_attention[l]) continue;
    auto it = refs_.find("layers." + std::to_string(l) + ".linear_attn.conv1d.weight");
    if (it == refs_.end()) continue;
    const TensorInfo& t = *it->second.t;
    const bool hf = t.shape.size() == 3 && t.shape[1] == 1 && t.shape[2] != 1;
    if (!first) {
      first = &t;
      w_.hf_layout = hf;
    } else if (hf != w_.hf_layout) {
      bad(t, "conv1d layout " + t.shape_str() + " disagrees with " + first->name + " " + first->shape_str() +
                 " (mixed HF and MLX layouts)");
    }
  }
  if (!first)
    w_.hf_layout = model_prefix_ == "model.language_model." || refs_.count("layers.0.mlp.experts.gate_up_proj") ||
                   refs_.count("layers.0.mlp.experts.0.gate_proj.weight");
  norm_shift_ = w_.hf_layout ? 1.f : 0.f;
}

// One matrix (n == 0) or a stack of n matrices, quantized (weight/scales/biases) or plain.
QStack Loader::load_q(const std::string& mod, int64_t n, int64_t rows, int64_t cols) {
  const TensorInfo& w = get(mod + ".weight");
  const TensorInfo* s = find(mod + ".scales");
  std::vector<int64_t> lead;
  if (n) lead.push_back(n);
  auto with_lead = [&](std::vector<int64_t> s2) {
    s2.insert(s2.begin(), lead.begin(), lead.end());
    return s2;
  };
  QStack st;
  st.n = n ? n : 1;
  QMatrix& m = st.first;
  m.rows = rows;
  m.cols = cols;
  if (!s) {
    if (w.dtype != DType::kBF16 && w.dtype != DType::kF32)
      bad(w, "dtype " + w.dtype_str + " is not supported for an unquantized matrix (expected BF16 or F32" +
                 (w.dtype == DType::kU32 ? "; U32 codes need " + display(mod + ".scales") + ")" : ")"));
    expect_shape(w, with_lead({rows, cols}), "");
    m.type = w.dtype == DType::kBF16 ? WType::kBF16 : WType::kF32;
    m.data = w.data;
    st.data_stride = rows * m.data_bytes_per_row();
    return st;
  }
  const TensorInfo& b = get(mod + ".biases");
  if (!w_.config.quant.present) bad(w, "is quantized (has .scales) but config.json has no quantization block");
  if (w.dtype != DType::kU32) bad(w, "dtype " + w.dtype_str + " for quantized codes (expected U32)");
  if (s->dtype != DType::kBF16 && s->dtype != DType::kF32)
    bad(*s, "dtype " + s->dtype_str + " is not supported for scales (expected BF16 or F32)");
  if (b.dtype != s->dtype) bad(b, "dtype " + b.dtype_str + " differs from the scales' " + s->dtype_str);
  if (cols % 64 != 0) bad(w, "is quantized but its input dim " + std::to_string(cols) + " is not a multiple of 64");
  expect_shape(*s, with_lead({rows, cols / 64}), " for group size 64");
  expect_shape(b, with_lead({rows, cols / 64}), " for group size 64");
  // Bits from the shapes (MODEL.md §4.2), then cross-checked with the config's per-module entry.
  const int64_t words = w.shape.empty() ? 0 : w.shape.back();
  const int bits = words * 32 == cols * 4 ? 4 : words * 32 == cols * 8 ? 8 : 0;
  if (!bits || w.shape.size() != lead.size() + 2)
    expect_shape(w, with_lead({rows, cols * 4 / 32}), " for 4-bit codes, or " + shape_str(with_lead({rows, cols / 4})) + " for 8-bit");
  expect_shape(w, with_lead({rows, cols * bits / 32}), "");
  const std::string path = w.name.substr(0, w.name.size() - std::string(".weight").size());
  auto ov = w_.config.quant.overrides.find(path);
  const int want = ov != w_.config.quant.overrides.end() ? ov->second.bits : w_.config.quant.bits;
  if (bits != want)
    bad(w, "holds " + std::to_string(bits) + "-bit codes but config.json quantization says " + std::to_string(want) +
               "-bit for " + path);
  m.type = bits == 4 ? WType::kAffine4 : WType::kAffine8;
  m.group_size = 64;
  m.sb_f32 = s->dtype == DType::kF32;
  m.data = w.data;
  m.scales = s->data;
  m.biases = b.data;
  st.data_stride = rows * m.data_bytes_per_row();
  st.sb_stride = rows * m.sb_bytes_per_row();
  return st;
}

// HF fused experts: gate_up_proj [E, 2I, H] (gate = first I rows of each slab), down_proj [E, H, I].
void Loader::hf_experts(const std::string& p, MoeWeights& m) {
  const ModelConfig& c = w_.config;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  const TensorInfo& gu = get(p + "mlp.experts.gate_up_proj");
  const TensorInfo& dn = get(p + "mlp.experts.down_proj");
  for (const TensorInfo* t : {&gu, &dn})
    if (t->dtype != DType::kBF16 && t->dtype != DType::kF32)
      bad(*t, "dtype " + t->dtype_str + " is not supported for fused experts (expected BF16 or F32)");
  expect_shape(gu, {E, 2 * I, H}, "");
  expect_shape(dn, {E, H, I}, "");
  const WType gt = gu.dtype == DType::kBF16 ? WType::kBF16 : WType::kF32;
  QMatrix g{gt, I, H};
  const int64_t half = I * g.data_bytes_per_row();
  m.experts_gate = QStack{g, E, 2 * half, 0};
  m.experts_gate.first.data = gu.data;
  m.experts_up = m.experts_gate;
  m.experts_up.first.data = gu.data + half;
  QMatrix d{dn.dtype == DType::kBF16 ? WType::kBF16 : WType::kF32, H, I};
  d.data = dn.data;
  m.experts_down = QStack{d, E, H * d.data_bytes_per_row(), 0};
}

// HF per-expert tensors mlp.experts.E.{gate,up,down}_proj.weight (what transformers 5.x
// save_pretrained writes by default): stacked once into an owned buffer so that every expert sits at
// a fixed stride, as the QStack view requires. Costs one copy of the expert weights at load.
QStack Loader::hf_split_experts(const std::string& p, const std::string& proj, int64_t rows, int64_t cols) {
  const int64_t E = w_.config.num_experts;
  const TensorInfo& t0 = get(p + "mlp.experts.0." + proj + ".weight");
  if (t0.dtype != DType::kBF16 && t0.dtype != DType::kF32)
    bad(t0, "dtype " + t0.dtype_str + " is not supported for experts (expected BF16 or F32)");
  const size_t slab = t0.nbytes;
  auto buf = std::make_shared<std::vector<float>>((slab * size_t(E) + 3) / 4);
  uint8_t* dst = reinterpret_cast<uint8_t*>(buf->data());
  for (int64_t e = 0; e < E; ++e) {
    const TensorInfo& t = get(p + "mlp.experts." + std::to_string(e) + "." + proj + ".weight");
    if (t.dtype != t0.dtype) bad(t, "dtype " + t.dtype_str + " differs from expert 0 (" + t0.dtype_str + ")");
    expect_shape(t, {rows, cols}, "");
    std::memcpy(dst + size_t(e) * slab, t.data, slab);
  }
  w_.f32_arena.push_back(buf);
  QMatrix m{t0.dtype == DType::kBF16 ? WType::kBF16 : WType::kF32, rows, cols};
  m.data = dst;
  return QStack{m, E, int64_t(slab), 0};
}

FVec Loader::to_f32(const TensorInfo& t, float add) {
  auto buf = std::make_shared<std::vector<float>>(size_t(t.numel()));
  float* out = buf->data();
  for (int64_t i = 0; i < t.numel(); ++i) {
    float v;
    if (t.dtype == DType::kF32) {
      std::memcpy(&v, t.data + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * i, 2);
      v = t.dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    out[i] = v + add;
  }
  w_.f32_arena.push_back(buf);
  return FVec{out, t.numel()};
}

FVec Loader::vec(const std::string& canon, int64_t n, float add) {
  const TensorInfo& t = get(canon);
  if (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32)
    bad(t, "dtype " + t.dtype_str + " is not supported for a small tensor (expected BF16, F16 or F32)");
  expect_shape(t, {n}, "");
  return to_f32(t, add);
}

// Both [C, 1, K] (HF) and [C, K, 1] (MLX) are [C][K] in memory; tap K-1 multiplies the current token.
FVec Loader::conv(const std::string& canon) {
  const TensorInfo& t = get(canon);
  const int64_t C = w_.config.conv_dim(), K = w_.config.linear_conv_kernel_dim;
  if (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32)
    bad(t, "dtype " + t.dtype_str + " is not supported for conv1d (expected BF16, F16 or F32)");
  expect_shape(t, w_.hf_layout ? std::vector<int64_t>{C, 1, K} : std::vector<int64_t>{C, K, 1},
               w_.hf_layout ? ", HF layout" : ", MLX layout");
  return to_f32(t, 0.f);
}

void Loader::load_layer(int l, LayerWeights& L) {
  const ModelConfig& c = w_.config;
  const int64_t H = c.hidden_size;
  const std::string p = "layers." + std::to_string(l) + ".";
  L.full_attention = c.is_full_attention[l];
  L.input_layernorm = vec(p + "input_layernorm.weight", H, norm_shift_);
  L.post_attention_layernorm = vec(p + "post_attention_layernorm.weight", H, norm_shift_);
  if (L.full_attention) {
    AttnWeights& a = L.self_attn;
    const int64_t hd = c.head_dim, q_rows = c.num_attention_heads * hd * (c.attn_output_gate ? 2 : 1);
    a.q_proj = matrix(p + "self_attn.q_proj", q_rows, H);
    a.k_proj = matrix(p + "self_attn.k_proj", c.num_key_value_heads * hd, H);
    a.v_proj = matrix(p + "self_attn.v_proj", c.num_key_value_heads * hd, H);
    a.o_proj = matrix(p + "self_attn.o_proj", H, c.num_attention_heads * hd);
    a.q_norm = vec(p + "self_attn.q_norm.weight", hd, norm_shift_);
    a.k_norm = vec(p + "self_attn.k_norm.weight", hd, norm_shift_);
  } else {
    GdnWeights& g = L.linear_attn;
    const int64_t nv = c.linear_num_value_heads;
    g.in_proj_qkv = matrix(p + "linear_attn.in_proj_qkv", c.conv_dim(), H);
    g.in_proj_z = matrix(p + "linear_attn.in_proj_z", c.linear_value_dim(), H);
    g.in_proj_a = matrix(p + "linear_attn.in_proj_a", nv, H);
    g.in_proj_b = matrix(p + "linear_attn.in_proj_b", nv, H);
    g.conv1d = conv(p + "linear_attn.conv1d.weight");
    g.A_log = vec(p + "linear_attn.A_log", nv);
    g.dt_bias = vec(p + "linear_attn.dt_bias", nv);
    g.norm = vec(p + "linear_attn.norm.weight", c.linear_value_head_dim);  // plain gain: never shifted
    g.out_proj = matrix(p + "linear_attn.out_proj", H, c.linear_value_dim());
  }
  MoeWeights& m = L.mlp;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  m.gate = matrix(p + "mlp.gate", E, H);
  const bool fused = refs_.count(p + "mlp.experts.gate_up_proj") ||
                     (w_.hf_layout && !refs_.count(p + "mlp.switch_mlp.gate_proj.weight"));
  if (refs_.count(p + "mlp.experts.0.gate_proj.weight")) {   // transformers' per-expert save
    m.experts_gate = hf_split_experts(p, "gate_proj", I, H);
    m.experts_up = hf_split_experts(p, "up_proj", I, H);
    m.experts_down = hf_split_experts(p, "down_proj", H, I);
  } else if (fused) {
    hf_experts(p, m);
  } else {
    m.experts_gate = stack(p + "mlp.switch_mlp.gate_proj", E, I, H);
    m.experts_up = stack(p + "mlp.switch_mlp.up_proj", E, I, H);
    m.experts_down = stack(p + "mlp.switch_mlp.down_proj", E, H, I);
  }
  m.shared_gate_proj = matrix(p + "mlp.shared_expert.gate_proj", Is, H);
  m.shared_up_proj = matrix(p + "mlp.shared_expert.up_proj", Is, H);
  m.shared_down_proj = matrix(p + "mlp.shared_expert.down_proj", H, Is);
  m.shared_expert_gate = matrix(p + "mlp.shared_expert_gate", 1, H);
}

// Faults the used tensors in (file order) so the first forward pass does not stall on page faults.
void Loader::prefault() {
  std::vector<const TensorInfo*> used;
  uint64_t total = 0;
  for (const auto& [canon, r] : refs_)
    if (r.used) used.push_back(r.t), total += r.t->nbytes;
  std::sort(used.begin(), used.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->file != b->file ? a->path() < b->path() : a->offset < b->offset;
  });
  Progress bar("loading " + dir_, total, opt_.progress);
  uint64_t sink = 0;
  constexpr size_t kChunk = size_t(32) << 20;
  for (const TensorInfo* t : used) {
    for (size_t off = 0; off < t->nbytes; off += kChunk) {
      const size_t len = std::min(kChunk, t->nbytes - off);
      sink += t->file->touch(t->offset + off, len);
      bar.add(len);
    }
  }
  bar.finish();
  volatile uint64_t keep = sink;
  (void)keep;
}

ModelWeights Loader::run() {
  w_.config = load_config(dir_);
  set_ = TensorSet::open_dir(dir_);
  w_.files = set_.files();
  index_names();
  detect_layout();
  const ModelConfig& c = w_.config;
  w_.embed_tokens = matrix("embed_tokens", c.vocab_size, c.hidden_size);
  w_.norm = vec("norm.weight", c.hidden_size, norm_shift_);
  if (refs_.count("lm_head.weight") || !c.tie_word_embeddings)
    w_.lm_head = matrix("lm_head", c.vocab_size, c.hidden_size);
  else
    w_.lm_head = w_.embed_tokens;
  w_.layers.resize(size_t(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) load_layer(l, w_.layers[size_t(l)]);
  for (const auto& [canon, r] : refs_)
    if (!r.used) bad(*r.t, "unexpected tensor (not part of the Qwen3.6 text model as configured)");
  prefault();
  return std::move(w_);
}

}  // namespace

ModelWeights load_weights(const std::string& dir, const LoadOptions& opt) {
  return Loader(dir, opt).run();
}

}  // namespace lily
