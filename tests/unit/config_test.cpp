// config.json parsing: the published nested config, the flat form mlx-lm writes, and each error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/common.h"
#include "model/config.h"

namespace lily {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kRef = fs::path(LILY_SHARED_DIR) / "reference" / "qwen3.6-35b-a3b";

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

// A flat text-only config as mlx-lm's save_config writes it (no layer_types, rope_parameters).
json flat_config() {
  return json::parse(R"({
    "model_type": "qwen3_5_moe", "hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 48, "linear_conv_kernel_dim": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96,
    "vocab_size": 300, "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "full_attention_interval": 4,
    "tie_word_embeddings": true,
    "rope_parameters": {"type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}})");
}

// Expects parse_config to throw an Error whose message contains every one of `parts`.
void expect_error(const json& j, std::initializer_list<const char*> parts) {
  try {
    parse_config(j.dump());
    FAIL() << "no error for " << j.dump().substr(0, 200);
  } catch (const Error& e) {
    for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

TEST(Config, PublishedNestedConfig) {
  if (!fs::exists(kRef / "config.json")) GTEST_SKIP() << "reference data absent: " << kRef;
  const ModelConfig c = load_config(kRef.string());
  // Values from MODEL.md §1 (the published text_config).
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 40);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e7f);
  EXPECT_FLOAT_EQ(c.partial_rotary_factor, 0.25f);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{248044});
  EXPECT_EQ(c.conv_dim(), 8192);
  EXPECT_EQ(c.linear_value_dim(), 4096);
  ASSERT_EQ(c.is_full_attention.size(), 40u);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(c.is_full_attention[i], (i + 1) % 4 == 0) << "layer " << i;
  EXPECT_EQ(c.num_full_attention_layers(), 10);
  EXPECT_FALSE(c.quant.present);
}

TEST(Config, PublishedMlxQuantization) {
  const fs::path p = kRef / "config.mlx-4bit.json";
  if (!fs::exists(p)) GTEST_SKIP() << "reference data absent: " << p;
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  const ModelConfig c = parse_config(ss.str());
  ASSERT_TRUE(c.quant.present);
  EXPECT_EQ(c.quant.group_size, 64);
  EXPECT_EQ(c.quant.bits, 4);
  EXPECT_EQ(c.quant.mode, "affine");
  EXPECT_EQ(c.quant.overrides.size(), 80u);  // router + shared_expert_gate for each of 40 layers
  for (int l = 0; l < 40; ++l) {
    const std::string p2 = "language_model.model.layers." + std::to_string(l) + ".mlp.";
    ASSERT_TRUE(c.quant.overrides.count(p2 + "gate")) << p2;
    EXPECT_EQ(c.quant.overrides.at(p2 + "gate").bits, 8);
    EXPECT_EQ(c.quant.overrides.at(p2 + "shared_expert_gate").bits, 8);
  }
}

TEST(Config, FlatTextOnlyForm) {
  const ModelConfig c = parse_config(flat_config().dump());
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.linear_value_head_dim, 48);
  EXPECT_EQ(c.conv_dim(), 2 * 2 * 32 + 4 * 48);
  EXPECT_EQ(c.shared_expert_intermediate_size, 96);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.f);
  EXPECT_FLOAT_EQ(c.partial_rotary_factor, 0.5f);
  EXPECT_EQ(c.rotary_dim(), 32);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.eos_token_ids.empty());
  // full_attention_interval fallback: layers 3 and 7.
  EXPECT_EQ(c.is_full_attention, (std::vector<bool>{false, false, false, true, false, false, false, true}));
  ASSERT_TRUE(c.quant.present);
  EXPECT_EQ(c.quant.overrides.at("language_model.model.layers.0.mlp.gate").bits, 8);
}

TEST(Config, LegacyRopeKeysAndEosList) {
  json j = flat_config();
  j.erase("rope_parameters");
  j["rope_theta"] = 12345.0;
  j["partial_rotary_factor"] = 0.25;
  j["eos_token_id"] = {7, 9};
  j["layer_types"] = json::array();
  for (int i = 0; i < 8; ++i) j["layer_types"].push_back(i % 2 ? "full_attention" : "linear_attention");
  j.erase("quantization");
  j["quantization_config"] = {{"group_size", 64}, {"bits", 8}};
  const ModelConfig c = parse_config(j.dump());
  EXPECT_FLOAT_EQ(c.rope_theta, 12345.f);
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{7, 9}));
  EXPECT_EQ(c.num_full_attention_layers(), 4);
  EXPECT_TRUE(c.is_full_attention[1]);
  EXPECT_FALSE(c.is_full_attention[0]);
  EXPECT_TRUE(c.quant.present);
  EXPECT_EQ(c.quant.bits, 8);
}

TEST(Config, WrongModelType) {
  json j = flat_config();
  j["model_type"] = "llama";
  expect_error(j, {"model_type", "llama"});
  if (!fs::exists(kRef / "config.json")) return;
  json n = read_json(kRef / "config.json");
  n["text_config"]["model_type"] = "qwen3_next";
  expect_error(n, {"text_config.model_type", "qwen3_next"});
  n = read_json(kRef / "config.json");
  n.erase("model_type");
  expect_error(n, {"model_type", "missing"});
}

TEST(Config, MissingRequiredField) {
  json j = flat_config();
  j.erase("num_experts");
  expect_error(j, {"'num_experts'", "missing"});
  if (!fs::exists(kRef / "config.json")) return;
  json n = read_json(kRef / "config.json");
  n["text_config"].erase("hidden_size");
  expect_error(n, {"'text_config.hidden_size'", "missing"});
  n = read_json(kRef / "config.json");
  n["text_config"].erase("layer_types");
  n["text_config"].erase("full_attention_interval");
  expect_error(n, {"text_config.layer_types", "missing"});
}

TEST(Config, BadValues) {
  json j = flat_config();
  j["hidden_size"] = "128";
  expect_error(j, {"'hidden_size'", "integer"});
  j = flat_config();
  j["num_hidden_layers"] = 0;
  expect_error(j, {"'num_hidden_layers'", "positive"});
  j = flat_config();
  j["num_key_value_heads"] = 3;
  expect_error(j, {"num_key_value_heads", "num_attention_heads", "divide"});
  j = flat_config();
  j["linear_num_key_heads"] = 3;
  expect_error(j, {"linear_num_key_heads", "linear_num_value_heads"});
  j = flat_config();
  j["num_experts_per_tok"] = 9;
  expect_error(j, {"num_experts_per_tok", "num_experts"});
  j = flat_config();
  j["rope_parameters"]["partial_rotary_factor"] = 0.3;  // 64 * 0.3 is not an even integer
  expect_error(j, {"partial_rotary_factor"});
  j = flat_config();
  j["rope_parameters"]["type"] = "yarn";
  expect_error(j, {"rope_parameters.rope_type", "yarn"});
  j = flat_config();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  expect_error(j, {"'rope_scaling'", "yarn"});
  j["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {11, 11, 10}}};
  EXPECT_NO_THROW(parse_config(j.dump()));
}

TEST(Config, LayerTypes) {
  json j = flat_config();
  j["layer_types"] = {"linear_attention", "linear_attention", "full_attention"};
  expect_error(j, {"'layer_types'", "3 entries", "num_hidden_layers is 8"});
  j["layer_types"] = json::array();
  for (int i = 0; i < 8; ++i) j["layer_types"].push_back(i == 5 ? "sliding_attention" : "full_attention");
  expect_error(j, {"layer_types[5]", "sliding_attention"});
}

TEST(Config, QuantizationErrors) {
  json j = flat_config();
  j["quantization"]["group_size"] = 32;
  expect_error(j, {"quantization.group_size", "32", "only 64"});
  j = flat_config();
  j["quantization"]["mode"] = "mxfp4";
  expect_error(j, {"quantization.mode", "mxfp4", "affine"});
  j = flat_config();
  j["quantization"]["bits"] = 3;
  expect_error(j, {"quantization.bits", "3"});
  j = flat_config();
  j["quantization"]["language_model.model.layers.0.mlp.gate"]["group_size"] = 128;
  expect_error(j, {"language_model.model.layers.0.mlp.gate", "group_size", "128"});
  j = flat_config();
  j.erase("quantization");
  j["quantization_config"] = {{"quant_method", "fp8"}};
  expect_error(j, {"quantization_config.quant_method", "fp8"});
}

TEST(Config, InvalidJsonAndFileErrors) {
  try {
    parse_config("{\"model_type\": ");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid JSON"), std::string::npos) << e.what();
  }
  const fs::path dir = fs::temp_directory_path() / ("lily_config_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  try {
    load_config(dir.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "config.json").string()), std::string::npos) << e.what();
  }
  json j = flat_config();
  j.erase("vocab_size");
  std::ofstream(dir / "config.json") << j.dump();
  try {
    load_config(dir.string());
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find((dir / "config.json").string()), std::string::npos) << m;
    EXPECT_NE(m.find("vocab_size"), std::string::npos) << m;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lily
