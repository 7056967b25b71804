// MLX-layout checkpoint writer (see checkpoint_writer.h). Tensor names and shapes follow what
// mlx-lm writes for qwen3_5_moe (MODEL.md §4): language_model.model.* plus language_model.lm_head,
// expert stacks under mlp.switch_mlp, conv1d as [C, K, 1].
#include "model/checkpoint_writer.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/common.h"
#include "core/safetensors.h"

namespace lily {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

constexpr const char* kPrefix = "language_model.model.";

void add_matrix(std::vector<TensorView>& out, const std::string& name, const QMatrix& m, int64_t count = 0) {
  if (!m.quantized() || m.sb_f32)
    throw Error("checkpoint writer: " + name + " must be affine-quantized with bf16 scales");
  const int64_t n = count ? count : 1, words = m.cols * m.bits() / 32, groups = m.cols / m.group_size;
  std::vector<int64_t> lead;
  if (count) lead.push_back(count);
  auto shape = [&](int64_t last) {
    std::vector<int64_t> s = lead;
    s.push_back(m.rows);
    s.push_back(last);
    return s;
  };
  out.push_back({name + ".weight", DType::kU32, shape(words), m.data, size_t(n * m.rows * words * 4)});
  out.push_back({name + ".scales", DType::kBF16, shape(groups), m.scales, size_t(n * m.rows * groups * 2)});
  out.push_back({name + ".biases", DType::kBF16, shape(groups), m.biases, size_t(n * m.rows * groups * 2)});
}

void add_stack(std::vector<TensorView>& out, const std::string& name, const QStack& s) {
  const QMatrix& f = s.first;
  if (s.data_stride != f.data_bytes_per_row() * f.rows || s.sb_stride != f.sb_bytes_per_row() * f.rows)
    throw Error("checkpoint writer: " + name + " is not a contiguous expert stack");
  add_matrix(out, name, f, s.n);
}

void add_vec(std::vector<TensorView>& out, const std::string& name, const FVec& v, std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {v.n};
  out.push_back({name, DType::kF32, std::move(shape), v.data, size_t(v.n * 4)});
}

}  // namespace

std::string mlx_config_json(const ModelConfig& c) {
  ojson layer_types = ojson::array();
  for (int l = 0; l < c.num_hidden_layers; ++l)
    layer_types.push_back(c.is_full_attention[l] ? "full_attention" : "linear_attention");
  ojson text = {{"model_type", "qwen3_5_moe_text"}, {"hidden_size", c.hidden_size},
                {"num_hidden_layers", c.num_hidden_layers}, {"layer_types", layer_types},
                {"full_attention_interval", 4}, {"num_attention_heads", c.num_attention_heads},
                {"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
                {"attn_output_gate", c.attn_output_gate}, {"attention_bias", false},
                {"linear_num_key_heads", c.linear_num_key_heads}, {"linear_num_value_heads", c.linear_num_value_heads},
                {"linear_key_head_dim", c.linear_key_head_dim}, {"linear_value_head_dim", c.linear_value_head_dim},
                {"linear_conv_kernel_dim", c.linear_conv_kernel_dim}, {"mamba_ssm_dtype", "float32"},
                {"num_experts", c.num_experts}, {"num_experts_per_tok", c.num_experts_per_tok},
                {"moe_intermediate_size", c.moe_intermediate_size},
                {"shared_expert_intermediate_size", c.shared_expert_intermediate_size},
                {"vocab_size", c.vocab_size}, {"hidden_act", "silu"}, {"rms_norm_eps", c.rms_norm_eps},
                {"max_position_embeddings", c.max_position_embeddings},
                {"partial_rotary_factor", c.partial_rotary_factor},
                {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta},
                                     {"partial_rotary_factor", c.partial_rotary_factor}, {"mrope_interleaved", true},
                                     {"mrope_section", {11, 11, 10}}}},
                {"tie_word_embeddings", c.tie_word_embeddings}, {"dtype", "bfloat16"}};
  if (!c.eos_token_ids.empty()) text["eos_token_id"] = c.eos_token_ids.size() == 1 ? ojson(c.eos_token_ids[0]) : ojson(c.eos_token_ids);
  ojson quant = {{"group_size", c.quant.group_size}, {"bits", c.quant.bits}, {"mode", "affine"}};
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = std::string(kPrefix) + "layers." + std::to_string(l) + ".mlp.";
    quant[p + "gate"] = {{"group_size", 64}, {"bits", 8}};
    quant[p + "shared_expert_gate"] = {{"group_size", 64}, {"bits", 8}};
  }
  return ojson{{"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"model_type", "qwen3_5_moe"},
               {"text_config", text}, {"tie_word_embeddings", c.tie_word_embeddings}, {"quantization", quant},
               {"quantization_config", quant}}
      .dump(2);
}

int64_t write_mlx_checkpoint(const ModelWeights& w, const std::string& dir, const CheckpointWriteOptions& opt) {
  const ModelConfig& c = w.config;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir + ": cannot create directory: " + ec.message());

  std::vector<TensorView> t;
  const std::string P = kPrefix;
  add_matrix(t, P + "embed_tokens", w.embed_tokens);
  if (!c.tie_word_embeddings) add_matrix(t, "language_model.lm_head", w.lm_head);
  add_vec(t, P + "norm.weight", w.norm);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    const std::string p = P + "layers." + std::to_string(l) + ".";
    add_vec(t, p + "input_layernorm.weight", L.input_layernorm);
    add_vec(t, p + "post_attention_layernorm.weight", L.post_attention_layernorm);
    if (L.full_attention) {
      const AttnWeights& a = L.self_attn;
      add_matrix(t, p + "self_attn.q_proj", a.q_proj);
      add_matrix(t, p + "self_attn.k_proj", a.k_proj);
      add_matrix(t, p + "self_attn.v_proj", a.v_proj);
      add_matrix(t, p + "self_attn.o_proj", a.o_proj);
      add_vec(t, p + "self_attn.q_norm.weight", a.q_norm);
      add_vec(t, p + "self_attn.k_norm.weight", a.k_norm);
    } else {
      const GdnWeights& g = L.linear_attn;
      add_matrix(t, p + "linear_attn.in_proj_qkv", g.in_proj_qkv);
      add_matrix(t, p + "linear_attn.in_proj_z", g.in_proj_z);
      add_matrix(t, p + "linear_attn.in_proj_a", g.in_proj_a);
      add_matrix(t, p + "linear_attn.in_proj_b", g.in_proj_b);
      add_vec(t, p + "linear_attn.conv1d.weight", g.conv1d, {c.conv_dim(), c.linear_conv_kernel_dim, 1});
      add_vec(t, p + "linear_attn.A_log", g.A_log);
      add_vec(t, p + "linear_attn.dt_bias", g.dt_bias);
      add_vec(t, p + "linear_attn.norm.weight", g.norm);
      add_matrix(t, p + "linear_attn.out_proj", g.out_proj);
    }
    const MoeWeights& m = L.mlp;
    add_matrix(t, p + "mlp.gate", m.gate);
    add_stack(t, p + "mlp.switch_mlp.gate_proj", m.experts_gate);
    add_stack(t, p + "mlp.switch_mlp.up_proj", m.experts_up);
    add_stack(t, p + "mlp.switch_mlp.down_proj", m.experts_down);
    add_matrix(t, p + "mlp.shared_expert.gate_proj", m.shared_gate_proj);
    add_matrix(t, p + "mlp.shared_expert.up_proj", m.shared_up_proj);
    add_matrix(t, p + "mlp.shared_expert.down_proj", m.shared_down_proj);
    add_matrix(t, p + "mlp.shared_expert_gate", m.shared_expert_gate);
  }

  // Shards in order, each at most shard_bytes (a single tensor larger than that gets its own shard).
  std::vector<std::vector<TensorView>> shards(1);
  int64_t cur = 0, total = 0;
  for (TensorView& v : t) {
    if (cur > 0 && cur + int64_t(v.nbytes) > opt.shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    cur += int64_t(v.nbytes);
    total += int64_t(v.nbytes);
    shards.back().push_back(std::move(v));
  }
  ojson weight_map = ojson::object();
  int64_t done = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    write_safetensors((fs::path(dir) / name).string(), shards[i], {{"format", "mlx"}});
    for (const TensorView& v : shards[i]) {
      weight_map[v.name] = name;
      done += int64_t(v.nbytes);
    }
    if (opt.progress) opt.progress(done, total);
  }
  auto write_text = [&](const char* file, const std::string& text) {
    std::ofstream out(fs::path(dir) / file, std::ios::trunc);
    out << text << "\n";
    if (!out) throw Error(dir + "/" + file + ": write failed");
  };
  write_text("model.safetensors.index.json",
             ojson{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2));
  write_text("config.json", mlx_config_json(c));
  return total;
}

}  // namespace lily
