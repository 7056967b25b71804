// The MLX checkpoint writer round-trips: demo model -> load -> write -> load gives bit-identical
// logits (every tensor kind, attention and GDN layers, 8-bit overrides in config.json), and the
// written config parses to the same config.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "loader_fixture.h"
#include "model/checkpoint_writer.h"
#include "model/demo_model.h"
#include "model/qwen36.h"
#include "model/synthetic.h"

namespace lily::loader_test {
namespace {

std::vector<float> logits_of(std::shared_ptr<const ModelWeights> w, const std::vector<int32_t>& ids) {
  std::unique_ptr<Backend> be = make_backend(BackendOptions{});
  Qwen36 m(w, *be, ModelOptions{8});
  auto st = m.new_state(64);
  std::vector<float> out(ids.size() * size_t(w->config.vocab_size));
  m.forward(*st, ids, out.data(), true);
  return out;
}

TEST(CheckpointWriter, DemoModelRoundTripIsBitIdentical) {
  TmpDir src, dst;
  write_demo_model(src.str(), 7);
  auto a = std::make_shared<ModelWeights>(load_weights(src.str(), LoadOptions{false}));
  CheckpointWriteOptions wo;
  wo.shard_bytes = 1 << 20;   // several shards plus the index
  int64_t last_done = -1;
  wo.progress = [&](int64_t done, int64_t total) {
    EXPECT_GT(done, last_done);
    EXPECT_LE(done, total);
    last_done = done;
  };
  const int64_t bytes = write_mlx_checkpoint(*a, dst.str(), wo);
  EXPECT_GT(bytes, 0);
  EXPECT_EQ(last_done, bytes);
  EXPECT_TRUE(fs::exists(dst.path / "model.safetensors.index.json"));
  auto b = std::make_shared<ModelWeights>(load_weights(dst.str(), LoadOptions{false}));
  EXPECT_EQ(a->config.num_hidden_layers, b->config.num_hidden_layers);
  EXPECT_EQ(a->config.is_full_attention, b->config.is_full_attention);
  EXPECT_EQ(b->layers[0].mlp.gate.bits(), 8);
  EXPECT_EQ(b->layers[0].mlp.shared_expert_gate.bits(), 8);
  const std::vector<int32_t> ids = {3, 17, 250, 9, 100, 42, 7, 300, 5, 11, 64};
  const std::vector<float> la = logits_of(a, ids), lb = logits_of(b, ids);
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * 4));
}

TEST(CheckpointWriter, SyntheticConfigParsesBack) {
  const ModelConfig c = synthetic_config(40, 0);
  const ModelConfig p = parse_config(mlx_config_json(c));
  EXPECT_EQ(p.hidden_size, 2048);
  EXPECT_EQ(p.num_hidden_layers, 40);
  EXPECT_EQ(p.num_full_attention_layers(), 10);
  EXPECT_EQ(p.num_experts, 256);
  EXPECT_EQ(p.vocab_size, 248320);
  EXPECT_FLOAT_EQ(p.rope_theta, 1e7f);
  EXPECT_EQ(p.quant.bits, 4);
  EXPECT_EQ(p.quant.overrides.size(), 80u);
}

}  // namespace
}  // namespace lily::loader_test
