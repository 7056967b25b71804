// Test fixture shared by loader_test.cpp and loader_errors_test.cpp: writes tiny MLX / HF
// checkpoints with known values and reads views back with the MLX affine dequant formula.
#pragma once
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "core/common.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "model/weights.h"

namespace lily::loader_test {

namespace fs = std::filesystem;
using nlohmann::json;

// Tiny model: H 64, layer 0 GDN, layer 1 attention; every input dim a multiple of 64.
constexpr int H = 64, L = 2, NH = 2, NKV = 1, HD = 64, LKH = 1, LVH = 2, LD = 64, K = 4;
constexpr int E = 4, TOPK = 2, I = 64, IS = 64, V = 96;
constexpr int CONV = 2 * LKH * LD + LVH * LD, VDIM = LVH * LD;

struct TmpDir {
  fs::path path;
  TmpDir() {
    static int n = 0;
    static const unsigned tag = std::random_device{}();
    path = fs::temp_directory_path() / ("lily_loader_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(tag) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TmpDir() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
};

struct Opt {
  bool hf = false;                    // HF layout: bf16, fused experts, zero-centred norms, [C,1,K] conv
  bool sb_f32 = false;                // MLX: f32 scales/biases
  std::string model = "language_model.model.", head = "language_model.lm_head";
  bool tie = false;                   // tie_word_embeddings, no lm_head tensor
  bool extras = false;                // add mtp.* and vision tensors that must be skipped
};

// A checkpoint in memory: tensors to write, the config, and the f32 value of every element.
struct Ckpt {
  std::vector<TensorOut> t;
  json config;
  std::map<std::string, std::vector<float>> ref;   // by tensor (for quantized: by module) name
  uint64_t s = 12345;
  float rnd() {  // deterministic in [-1, 1)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return float(int32_t(s >> 32)) / 2147483648.f;
  }
  float rbf16(float scale) { return bf16_to_f32(f32_to_bf16(scale * rnd())); }

  void plain(const std::string& name, std::vector<int64_t> shape, DType dt, float center = 0.f) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dt == DType::kF32 ? center + 0.5f * rnd() : bf16_to_f32(f32_to_bf16(center + 0.5f * rnd()));
    ref[name] = v;
    t.push_back(dt == DType::kF32 ? tensor_f32(name, shape, v) : tensor_bf16(name, shape, v));
  }
  // Quantized [n?, rows, cols]: random codes, random (possibly negative) scales and biases.
  void quant(const std::string& mod, int n, int rows, int cols, int bits, bool sb_f32) {
    const int per = 32 / bits, groups = cols / 64, mats = n ? n : 1;
    std::vector<uint32_t> codes(static_cast<size_t>(mats * rows * cols / per));
    std::vector<float> sc(static_cast<size_t>(mats * rows * groups)), bi(sc.size());
    for (float& x : sc) x = sb_f32 ? 0.01f * rnd() : rbf16(0.01f);
    for (float& x : bi) x = sb_f32 ? 0.1f * rnd() : rbf16(0.1f);
    std::vector<float> deq(static_cast<size_t>(mats * rows * cols));
    for (int64_t i = 0; i < int64_t(deq.size()); ++i) {
      const uint32_t q = uint32_t(s >> 33) % (1u << bits);
      rnd();
      codes[size_t(i / per)] |= q << (bits * (i % per));
      const int64_t row = i / cols, g = (i % cols) / 64;
      deq[size_t(i)] = sc[size_t(row * groups + g)] * float(q) + bi[size_t(row * groups + g)];
    }
    std::vector<int64_t> lead;
    if (n) lead.push_back(n);
    auto shp = [&](int64_t last) {
      auto v = lead;
      v.push_back(rows);
      v.push_back(last);
      return v;
    };
    ref[mod] = deq;
    t.push_back(tensor_u32(mod + ".weight", shp(cols / per), codes));
    t.push_back(sb_f32 ? tensor_f32(mod + ".scales", shp(groups), sc) : tensor_bf16(mod + ".scales", shp(groups), sc));
    t.push_back(sb_f32 ? tensor_f32(mod + ".biases", shp(groups), bi) : tensor_bf16(mod + ".biases", shp(groups), bi));
  }
  void matrix(const Opt& o, const std::string& mod, int rows, int cols, int bits = 4) {
    if (o.hf) plain(mod + ".weight", {rows, cols}, DType::kBF16);
    else quant(mod, 0, rows, cols, bits, o.sb_f32);
  }
  void erase(const std::string& name) {
    std::erase_if(t, [&](const TensorOut& x) { return x.name == name; });
  }
  TensorOut* find(const std::string& name) {
    for (TensorOut& x : t)
      if (x.name == name) return &x;
    return nullptr;
  }
};

inline Ckpt make_ckpt(const Opt& o) {
  Ckpt c;
  const std::string P = o.model;
  const float norm_center = o.hf ? 0.f : 1.f;
  c.matrix(o, P + "embed_tokens", V, H);
  if (!o.tie) c.matrix(o, o.head, V, H);
  c.plain(P + "norm.weight", {H}, DType::kBF16, norm_center);
  for (int l = 0; l < L; ++l) {
    const std::string p = P + "layers." + std::to_string(l) + ".";
    c.plain(p + "input_layernorm.weight", {H}, DType::kBF16, norm_center);
    c.plain(p + "post_attention_layernorm.weight", {H}, DType::kBF16, norm_center);
    if (l == 1) {
      c.matrix(o, p + "self_attn.q_proj", 2 * NH * HD, H);
      c.matrix(o, p + "self_attn.k_proj", NKV * HD, H);
      c.matrix(o, p + "self_attn.v_proj", NKV * HD, H);
      c.matrix(o, p + "self_attn.o_proj", H, NH * HD);
      c.plain(p + "self_attn.q_norm.weight", {HD}, DType::kBF16, norm_center);
      c.plain(p + "self_attn.k_norm.weight", {HD}, DType::kF32, norm_center);
    } else {
      c.matrix(o, p + "linear_attn.in_proj_qkv", CONV, H);
      c.matrix(o, p + "linear_attn.in_proj_z", VDIM, H);
      c.matrix(o, p + "linear_attn.in_proj_a", LVH, H);
      c.matrix(o, p + "linear_attn.in_proj_b", LVH, H);
      if (o.hf) c.plain(p + "linear_attn.conv1d.weight", {CONV, 1, K}, DType::kBF16);
      else c.plain(p + "linear_attn.conv1d.weight", {CONV, K, 1}, DType::kBF16);
      c.plain(p + "linear_attn.A_log", {LVH}, DType::kF32);
      c.plain(p + "linear_attn.dt_bias", {LVH}, DType::kBF16);
      c.plain(p + "linear_attn.norm.weight", {LD}, DType::kBF16, 1.f);
      c.matrix(o, p + "linear_attn.out_proj", H, VDIM);
    }
    c.matrix(o, p + "mlp.gate", E, H, 8);
    if (o.hf) {
      c.plain(p + "mlp.experts.gate_up_proj", {E, 2 * I, H}, DType::kBF16);
      c.plain(p + "mlp.experts.down_proj", {E, H, I}, DType::kBF16);
    } else {
      c.quant(p + "mlp.switch_mlp.gate_proj", E, I, H, 4, o.sb_f32);
      c.quant(p + "mlp.switch_mlp.up_proj", E, I, H, 4, o.sb_f32);
      c.quant(p + "mlp.switch_mlp.down_proj", E, H, I, 4, o.sb_f32);
    }
    c.matrix(o, p + "mlp.shared_expert.gate_proj", IS, H);
    c.matrix(o, p + "mlp.shared_expert.up_proj", IS, H);
    c.matrix(o, p + "mlp.shared_expert.down_proj", H, IS);
    c.matrix(o, p + "mlp.shared_expert_gate", 1, H, 8);
  }
  if (o.extras) {
    c.plain("mtp.fc.weight", {H, 2 * H}, DType::kBF16);
    c.plain("mtp.layers.0.input_layernorm.weight", {H}, DType::kBF16);
    c.plain(o.hf ? "model.visual.blocks.0.attn.qkv.weight" : "vision_tower.blocks.0.attn.qkv.weight", {8, 8}, DType::kBF16);
  }
  json text = {{"model_type", "qwen3_5_moe_text"}, {"hidden_size", H}, {"num_hidden_layers", L},
               {"layer_types", {"linear_attention", "full_attention"}}, {"num_attention_heads", NH},
               {"num_key_value_heads", NKV}, {"head_dim", HD}, {"linear_num_key_heads", LKH},
               {"linear_num_value_heads", LVH}, {"linear_key_head_dim", LD}, {"linear_value_head_dim", LD},
               {"linear_conv_kernel_dim", K}, {"num_experts", E}, {"num_experts_per_tok", TOPK},
               {"moe_intermediate_size", I}, {"shared_expert_intermediate_size", IS}, {"vocab_size", V},
               {"tie_word_embeddings", o.tie}};
  c.config = {{"model_type", "qwen3_5_moe"}, {"text_config", text}};
  if (!o.hf) {
    json q = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"}};
    for (int l = 0; l < L; ++l) {
      q[P + "layers." + std::to_string(l) + ".mlp.gate"] = {{"group_size", 64}, {"bits", 8}};
      q[P + "layers." + std::to_string(l) + ".mlp.shared_expert_gate"] = {{"group_size", 64}, {"bits", 8}};
    }
    c.config["quantization"] = q;
  }
  return c;
}

inline void write_ckpt(const TmpDir& d, const Ckpt& c, const std::string& file = "model.safetensors") {
  std::ofstream(d.path / "config.json") << c.config.dump(2);
  write_safetensors((d.path / file).string(), c.t, {{"format", "mlx"}});
}

// Element (r, c) of a view, dequantized with w = scale * q + bias (MODEL.md §4.2).
inline float at(const QMatrix& m, int64_t r, int64_t c) {
  const auto* d = static_cast<const uint8_t*>(m.data);
  if (m.type == WType::kBF16) {
    uint16_t h;
    std::memcpy(&h, d + (r * m.cols + c) * 2, 2);
    return bf16_to_f32(h);
  }
  if (m.type == WType::kF32) {
    float f;
    std::memcpy(&f, d + (r * m.cols + c) * 4, 4);
    return f;
  }
  const int bits = m.bits(), per = 32 / bits;
  uint32_t w;
  std::memcpy(&w, d + r * m.data_bytes_per_row() + (c / per) * 4, 4);
  const uint32_t q = (w >> (bits * (c % per))) & ((1u << bits) - 1);
  auto sb = [&](const void* p) {
    const auto* b = static_cast<const uint8_t*>(p) + r * m.sb_bytes_per_row();
    if (m.sb_f32) {
      float f;
      std::memcpy(&f, b + (c / 64) * 4, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, b + (c / 64) * 2, 2);
    return bf16_to_f32(h);
  };
  return sb(m.scales) * float(q) + sb(m.biases);
}

// Compares every element of `m` with rows [row0, row0 + m.rows) of the reference matrix
// (width m.cols) starting at element offset `base`.
inline void expect_matrix(const QMatrix& m, const std::vector<float>& ref, int64_t base, const std::string& what,
                   int64_t ref_cols = -1, int64_t col0 = 0) {
  if (ref_cols < 0) ref_cols = m.cols;
  ASSERT_NE(m.data, nullptr) << what;
  int bad = 0;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const float want = ref[size_t(base + r * ref_cols + col0 + c)];
      if (at(m, r, c) != want && ++bad < 4) ADD_FAILURE() << what << " (" << r << ", " << c << "): " << at(m, r, c) << " vs " << want;
    }
}

inline void expect_vec(const FVec& v, const std::vector<float>& ref, float add, const std::string& what) {
  ASSERT_EQ(v.n, int64_t(ref.size())) << what;
  for (int64_t i = 0; i < v.n; ++i) ASSERT_FLOAT_EQ(v.data[i], ref[size_t(i)] + add) << what << " [" << i << "]";
}

inline void expect_stack(const QStack& s, const std::vector<float>& ref, const std::string& what) {
  ASSERT_EQ(s.n, E) << what;
  for (int e = 0; e < E; ++e) expect_matrix(s.expert(e), ref, e * s.first.rows * s.first.cols, what + " expert " + std::to_string(e));
}

// Checks every view of an MLX-layout load against the written values.
inline void check_mlx(const ModelWeights& w, Ckpt& c, const Opt& o) {
  const std::string P = o.model;
  EXPECT_FALSE(w.hf_layout);
  EXPECT_EQ(w.embed_tokens.type, WType::kAffine4);
  EXPECT_EQ(w.embed_tokens.sb_f32, o.sb_f32);
  expect_matrix(w.embed_tokens, c.ref[P + "embed_tokens"], 0, "embed");
  if (!o.tie) expect_matrix(w.lm_head, c.ref[o.head], 0, "lm_head");
  expect_vec(w.norm, c.ref[P + "norm.weight"], 0.f, "norm");
  ASSERT_EQ(w.layers.size(), 2u);
  for (int l = 0; l < L; ++l) {
    const std::string p = P + "layers." + std::to_string(l) + ".";
    const LayerWeights& lw = w.layers[size_t(l)];
    EXPECT_EQ(lw.full_attention, l == 1);
    expect_vec(lw.input_layernorm, c.ref[p + "input_layernorm.weight"], 0.f, "input_layernorm");
    expect_vec(lw.post_attention_layernorm, c.ref[p + "post_attention_layernorm.weight"], 0.f, "post_attention_layernorm");
    if (l == 1) {
      expect_matrix(lw.self_attn.q_proj, c.ref[p + "self_attn.q_proj"], 0, "q_proj");
      expect_matrix(lw.self_attn.o_proj, c.ref[p + "self_attn.o_proj"], 0, "o_proj");
      expect_vec(lw.self_attn.k_norm, c.ref[p + "self_attn.k_norm.weight"], 0.f, "k_norm");
    } else {
      expect_matrix(lw.linear_attn.in_proj_qkv, c.ref[p + "linear_attn.in_proj_qkv"], 0, "in_proj_qkv");
      expect_matrix(lw.linear_attn.in_proj_b, c.ref[p + "linear_attn.in_proj_b"], 0, "in_proj_b");
      expect_vec(lw.linear_attn.conv1d, c.ref[p + "linear_attn.conv1d.weight"], 0.f, "conv1d");
      expect_vec(lw.linear_attn.A_log, c.ref[p + "linear_attn.A_log"], 0.f, "A_log");
      expect_vec(lw.linear_attn.norm, c.ref[p + "linear_attn.norm.weight"], 0.f, "linear_attn.norm");
    }
    EXPECT_EQ(lw.mlp.gate.type, WType::kAffine8);
    EXPECT_EQ(lw.mlp.shared_expert_gate.type, WType::kAffine8);
    EXPECT_EQ(lw.mlp.experts_gate.first.type, WType::kAffine4);
    expect_matrix(lw.mlp.gate, c.ref[p + "mlp.gate"], 0, "router");
    expect_matrix(lw.mlp.shared_expert_gate, c.ref[p + "mlp.shared_expert_gate"], 0, "shared_expert_gate");
    expect_stack(lw.mlp.experts_gate, c.ref[p + "mlp.switch_mlp.gate_proj"], "switch gate");
    expect_stack(lw.mlp.experts_up, c.ref[p + "mlp.switch_mlp.up_proj"], "switch up");
    expect_stack(lw.mlp.experts_down, c.ref[p + "mlp.switch_mlp.down_proj"], "switch down");
    expect_matrix(lw.mlp.shared_down_proj, c.ref[p + "mlp.shared_expert.down_proj"], 0, "shared down");
  }
}

inline LoadOptions quiet() {
  LoadOptions lo;
  lo.progress = false;
  return lo;
}

// Runs load_weights and returns the error message ("" if it loaded).
inline std::string load_error(const TmpDir& d) {
  try {
    load_weights(d.str(), quiet());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "'" << (part) << "' not in: " << (msg)

}  // namespace lily::loader_test
