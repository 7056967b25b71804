// Checkpoint loading: tiny MLX and HF checkpoints written by the fixture, read back through
// load_weights and checked element by element (dequantized with the MLX affine formula).
#include "loader_fixture.h"

namespace lily::loader_test {
namespace {

TEST(Loader, MlxLayoutBf16Scales) {
  TmpDir d;
  Opt o;
  o.extras = true;
  Ckpt c = make_ckpt(o);
  write_ckpt(d, c);
  const ModelWeights w = load_weights(d.str(), quiet());
  check_mlx(w, c, o);
  ASSERT_EQ(w.files.size(), 1u);
  // Big tensors are views into the mapping, not copies.
  const uint8_t* lo = w.files[0]->data();
  const uint8_t* hi = lo + w.files[0]->size();
  for (const void* p : {w.embed_tokens.data, w.embed_tokens.scales, w.lm_head.biases, w.layers[1].self_attn.q_proj.data,
                        w.layers[0].mlp.experts_down.expert(E - 1).data})
    EXPECT_TRUE(p >= lo && p < hi);
}

TEST(Loader, MlxLayoutF32Scales) {
  TmpDir d;
  Opt o;
  o.sb_f32 = true;
  Ckpt c = make_ckpt(o);
  write_ckpt(d, c);
  const ModelWeights w = load_weights(d.str(), quiet());
  EXPECT_TRUE(w.layers[0].mlp.experts_down.first.sb_f32);
  check_mlx(w, c, o);
}

TEST(Loader, FlatTextOnlyNamesAndTiedEmbeddings) {
  TmpDir d;
  Opt o;
  o.model = "model.";
  o.tie = true;
  Ckpt c = make_ckpt(o);
  c.config["quantization"] = json::parse(c.config["quantization"].dump());
  for (int l = 0; l < L; ++l) {  // override keys follow the file's module paths
    for (const char* m : {".mlp.gate", ".mlp.shared_expert_gate"}) {
      c.config["quantization"].erase("language_model.model.layers." + std::to_string(l) + m);
      c.config["quantization"]["model.layers." + std::to_string(l) + m] = {{"group_size", 64}, {"bits", 8}};
    }
  }
  write_ckpt(d, c);
  const ModelWeights w = load_weights(d.str(), quiet());
  check_mlx(w, c, o);
  EXPECT_EQ(w.lm_head.data, w.embed_tokens.data);
  EXPECT_EQ(w.lm_head.scales, w.embed_tokens.scales);
}

TEST(Loader, UnquantizedMatrixInMlxFile) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  const std::string m = "language_model.model.layers.0.linear_attn.in_proj_a";
  for (const char* s : {".weight", ".scales", ".biases"}) c.erase(m + s);
  c.plain(m + ".weight", {LVH, H}, DType::kF32);
  write_ckpt(d, c);
  const ModelWeights w = load_weights(d.str(), quiet());
  EXPECT_EQ(w.layers[0].linear_attn.in_proj_a.type, WType::kF32);
  expect_matrix(w.layers[0].linear_attn.in_proj_a, c.ref[m + ".weight"], 0, "in_proj_a");
}

TEST(Loader, HfLayout) {
  TmpDir d;
  Opt o;
  o.hf = true;
  o.model = "model.language_model.";
  o.head = "lm_head";
  o.extras = true;
  Ckpt c = make_ckpt(o);
  write_ckpt(d, c);
  const ModelWeights w = load_weights(d.str(), quiet());
  const std::string P = o.model;
  EXPECT_TRUE(w.hf_layout);
  EXPECT_EQ(w.embed_tokens.type, WType::kBF16);
  expect_matrix(w.embed_tokens, c.ref[P + "embed_tokens.weight"], 0, "embed");
  expect_matrix(w.lm_head, c.ref["lm_head.weight"], 0, "lm_head");
  // The five zero-centred norms get +1; the GDN gated norm stays a plain gain.
  expect_vec(w.norm, c.ref[P + "norm.weight"], 1.f, "norm");
  for (int l = 0; l < L; ++l) {
    const std::string p = P + "layers." + std::to_string(l) + ".";
    const LayerWeights& lw = w.layers[size_t(l)];
    expect_vec(lw.input_layernorm, c.ref[p + "input_layernorm.weight"], 1.f, "input_layernorm");
    expect_vec(lw.post_attention_layernorm, c.ref[p + "post_attention_layernorm.weight"], 1.f, "post_attention_layernorm");
    if (l == 1) {
      expect_vec(lw.self_attn.q_norm, c.ref[p + "self_attn.q_norm.weight"], 1.f, "q_norm");
      expect_vec(lw.self_attn.k_norm, c.ref[p + "self_attn.k_norm.weight"], 1.f, "k_norm");
      expect_matrix(lw.self_attn.q_proj, c.ref[p + "self_attn.q_proj.weight"], 0, "q_proj");
    } else {
      expect_vec(lw.linear_attn.norm, c.ref[p + "linear_attn.norm.weight"], 0.f, "linear_attn.norm");
      // [C, 1, K] → [C][K]: element (c, k) is stored at c*K + k in both layouts.
      expect_vec(lw.linear_attn.conv1d, c.ref[p + "linear_attn.conv1d.weight"], 0.f, "conv1d");
      expect_vec(lw.linear_attn.dt_bias, c.ref[p + "linear_attn.dt_bias"], 0.f, "dt_bias");
      expect_matrix(lw.linear_attn.out_proj, c.ref[p + "linear_attn.out_proj.weight"], 0, "out_proj");
    }
    // gate = rows [0, I) and up = rows [I, 2I) of each [2I, H] expert slab.
    const std::vector<float>& gu = c.ref[p + "mlp.experts.gate_up_proj"];
    for (int e = 0; e < E; ++e) {
      expect_matrix(lw.mlp.experts_gate.expert(e), gu, int64_t(e) * 2 * I * H, "gate e" + std::to_string(e));
      expect_matrix(lw.mlp.experts_up.expert(e), gu, int64_t(e) * 2 * I * H + I * H, "up e" + std::to_string(e));
    }
    expect_stack(lw.mlp.experts_down, c.ref[p + "mlp.experts.down_proj"], "down");
    EXPECT_EQ(lw.mlp.experts_gate.first.rows, I);
    EXPECT_EQ(lw.mlp.experts_down.first.rows, H);
    EXPECT_EQ(lw.mlp.experts_down.first.cols, I);
    expect_matrix(lw.mlp.gate, c.ref[p + "mlp.gate.weight"], 0, "router");
  }
}

TEST(Loader, ShardedIndex) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  std::ofstream(d.path / "config.json") << c.config.dump();
  std::vector<TensorOut> a(c.t.begin(), c.t.begin() + long(c.t.size() / 2)), b(c.t.begin() + long(c.t.size() / 2), c.t.end());
  write_safetensors((d.path / "model-00001-of-00002.safetensors").string(), a);
  write_safetensors((d.path / "model-00002-of-00002.safetensors").string(), b);
  json idx = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (const TensorOut& x : a) idx["weight_map"][x.name] = "model-00001-of-00002.safetensors";
  for (const TensorOut& x : b) idx["weight_map"][x.name] = "model-00002-of-00002.safetensors";
  std::ofstream(d.path / "model.safetensors.index.json") << idx.dump();
  const ModelWeights w = load_weights(d.str(), quiet());
  EXPECT_EQ(w.files.size(), 2u);
  check_mlx(w, c, Opt{});

  // The index must agree with the shards.
  idx["weight_map"][a[0].name] = "model-00002-of-00002.safetensors";
  std::ofstream(d.path / "model.safetensors.index.json") << idx.dump();
  std::string msg = load_error(d);
  EXPECT_HAS(msg, a[0].name);
  EXPECT_HAS(msg, "model.safetensors.index.json");
  idx["weight_map"][a[0].name] = "model-00003-of-00003.safetensors";
  std::ofstream(d.path / "model.safetensors.index.json") << idx.dump();
  msg = load_error(d);
  EXPECT_HAS(msg, "model-00003-of-00003.safetensors");
  EXPECT_HAS(msg, "does not exist");
}

TEST(Loader, AllSafetensorsWithoutIndex) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  std::ofstream(d.path / "config.json") << c.config.dump();
  std::vector<TensorOut> a(c.t.begin(), c.t.begin() + 10), b(c.t.begin() + 10, c.t.end());
  write_safetensors((d.path / "part-a.safetensors").string(), a);
  write_safetensors((d.path / "part-b.safetensors").string(), b);
  const ModelWeights w = load_weights(d.str(), quiet());
  EXPECT_EQ(w.files.size(), 2u);
  check_mlx(w, c, Opt{});
  write_safetensors((d.path / "part-c.safetensors").string(), {a[3]});  // same tensor twice
  const std::string msg = load_error(d);
  EXPECT_HAS(msg, a[3].name);
  EXPECT_HAS(msg, "part-c.safetensors");
}

TEST(Loader, QMatrixViews) {
  QMatrix m{WType::kAffine4, 10, 256};
  EXPECT_EQ(m.data_bytes_per_row(), 128);
  EXPECT_EQ(m.sb_bytes_per_row(), 8);
  m.sb_f32 = true;
  EXPECT_EQ(m.sb_bytes_per_row(), 16);
  QMatrix m8{WType::kAffine8, 10, 256};
  EXPECT_EQ(m8.data_bytes_per_row(), 256);
  EXPECT_EQ((QMatrix{WType::kBF16, 3, 5}.data_bytes_per_row()), 10);
  EXPECT_EQ((QMatrix{WType::kF32, 3, 5}.data_bytes_per_row()), 20);
  EXPECT_EQ((QMatrix{WType::kF32, 3, 5}.sb_bytes_per_row()), 0);
  static uint8_t buf[4096], sb[512];
  m.data = buf;
  m.scales = sb;
  m.biases = sb + 256;
  const QMatrix s = m.row_slice(3, 4);
  EXPECT_EQ(s.rows, 4);
  EXPECT_EQ(s.data, buf + 3 * 128);
  EXPECT_EQ(s.scales, sb + 3 * 16);
  EXPECT_EQ(s.biases, sb + 256 + 3 * 16);
}

}  // namespace
}  // namespace lily::loader_test
