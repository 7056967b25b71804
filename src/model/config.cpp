// config.json → ModelConfig: nested text_config or flat text-only form, plus the MLX quantization block.
#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/common.h"

namespace lily {

using nlohmann::json;

int ModelConfig::num_full_attention_layers() const {
  int n = 0;
  for (bool f : is_full_attention) n += f;
  return n;
}

namespace {

// Reads fields of the text section (`text_config` or the top level) and names them fully in errors.
struct Fields {
  const json& obj;
  std::string prefix;  // "text_config." or ""

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error("config: field '" + prefix + key + "' " + what);
  }
  bool has(const std::string& key) const { return obj.contains(key) && !obj[key].is_null(); }
  int integer(const std::string& key) const {
    if (!has(key)) fail(key, "is missing");
    const json& v = obj[key];
    if (!v.is_number_integer()) fail(key, "must be an integer, got " + v.dump());
    const int64_t x = v.get<int64_t>();
    if (x <= 0 || x > (int64_t(1) << 30)) fail(key, "must be a positive integer, got " + v.dump());
    return int(x);
  }
  int integer_or(const std::string& key, int def) const { return has(key) ? integer(key) : def; }
  double real_or(const std::string& key, double def) const {
    if (!has(key)) return def;
    const json& v = obj[key];
    if (!v.is_number()) fail(key, "must be a number, got " + v.dump());
    return v.get<double>();
  }
  bool boolean_or(const std::string& key, bool def) const {
    if (!has(key)) return def;
    if (!obj[key].is_boolean()) fail(key, "must be true or false, got " + obj[key].dump());
    return obj[key].get<bool>();
  }
};

void check_model_type(const json& obj, const std::string& field, bool required) {
  if (!obj.contains("model_type")) {
    if (required) throw Error("config: field '" + field + "' is missing");
    return;
  }
  const json& v = obj["model_type"];
  const std::string t = v.is_string() ? v.get<std::string>() : v.dump();
  if (t != "qwen3_5_moe" && t != "qwen3_5_moe_text")
    throw Error("config: field '" + field + "' is '" + t +
                "'; lily supports only Qwen3.6-35B-A3B (qwen3_5_moe / qwen3_5_moe_text)");
}

void parse_layer_types(const Fields& f, ModelConfig& c) {
  if (f.has("layer_types")) {
    const json& lt = f.obj["layer_types"];
    if (!lt.is_array()) f.fail("layer_types", "must be a list");
    if (int(lt.size()) != c.num_hidden_layers)
      f.fail("layer_types", "has " + std::to_string(lt.size()) + " entries but num_hidden_layers is " +
                                std::to_string(c.num_hidden_layers));
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (t != "full_attention" && t != "linear_attention")
        f.fail("layer_types[" + std::to_string(i) + "]",
               "is '" + t + "' (expected full_attention or linear_attention)");
      c.is_full_attention.push_back(t == "full_attention");
    }
    return;
  }
  // Same rule as the reference config class when the explicit list is absent.
  if (!f.has("full_attention_interval")) f.fail("layer_types", "is missing (and no full_attention_interval)");
  const int every = f.integer("full_attention_interval");
  for (int i = 0; i < c.num_hidden_layers; ++i) c.is_full_attention.push_back((i + 1) % every == 0);
}

void parse_rope(const Fields& f, ModelConfig& c) {
  // rope_parameters (transformers >= 5) wins over the legacy top-level keys.
  double theta = f.real_or("rope_theta", c.rope_theta);
  double partial = f.real_or("partial_rotary_factor", c.partial_rotary_factor);
  if (f.has("rope_parameters")) {
    const json& rp = f.obj["rope_parameters"];
    if (!rp.is_object()) f.fail("rope_parameters", "must be an object");
    const Fields r{rp, f.prefix + "rope_parameters."};
    theta = r.real_or("rope_theta", theta);
    partial = r.real_or("partial_rotary_factor", partial);
    const std::string type = rp.contains("rope_type") && rp["rope_type"].is_string() ? rp["rope_type"].get<std::string>()
                             : rp.contains("type") && rp["type"].is_string()         ? rp["type"].get<std::string>()
                                                                                     : "default";
    if (type != "default" && type != "mrope") r.fail("rope_type", "is '" + type + "'; only default RoPE is supported");
  }
  // Legacy scaling block: text-only mRoPE reduces to plain RoPE; anything else (yarn, linear...)
  // would change the frequencies, so refuse it rather than ignore it.
  if (f.has("rope_scaling")) {
    const json& rs = f.obj["rope_scaling"];
    const std::string type = !rs.is_object() ? rs.dump()
                             : rs.contains("rope_type") && rs["rope_type"].is_string() ? rs["rope_type"].get<std::string>()
                             : rs.contains("type") && rs["type"].is_string()           ? rs["type"].get<std::string>()
                                                                                       : "default";
    if (type != "default" && type != "mrope")
      f.fail("rope_scaling", "has type '" + type + "'; only default RoPE is supported");
  }
  if (!(theta > 0)) f.fail("rope_theta", "must be positive");
  if (!(partial > 0 && partial <= 1)) f.fail("partial_rotary_factor", "must be in (0, 1]");
  c.rope_theta = float(theta);
  c.partial_rotary_factor = float(partial);
  const double rot = c.head_dim * partial;
  if (rot != std::floor(rot) || int(rot) % 2 != 0)
    f.fail("partial_rotary_factor", "times head_dim " + std::to_string(c.head_dim) + " must be an even integer");
}

void parse_quant_params(const json& q, const std::string& field, int& group_size, int& bits) {
  if (q.contains("group_size")) {
    if (!q["group_size"].is_number_integer()) throw Error("config: field '" + field + ".group_size' must be an integer");
    group_size = q["group_size"].get<int>();
  }
  if (group_size != 64)
    throw Error("config: field '" + field + ".group_size' is " + std::to_string(group_size) + "; only 64 is supported");
  if (q.contains("bits")) {
    if (!q["bits"].is_number_integer()) throw Error("config: field '" + field + ".bits' must be an integer");
    bits = q["bits"].get<int>();
  }
  if (bits != 4 && bits != 8)
    throw Error("config: field '" + field + ".bits' is " + std::to_string(bits) + "; only 4 and 8 are supported");
  if (q.contains("mode")) {
    const std::string mode = q["mode"].is_string() ? q["mode"].get<std::string>() : q["mode"].dump();
    if (mode != "affine") throw Error("config: field '" + field + ".mode' is '" + mode + "'; only affine is supported");
  }
}

void parse_quant(const json& root, const json& text, ModelConfig& c) {
  // Top level per the MLX converters; `quantization_config` is the HF-compatible duplicate.
  const json* q = nullptr;
  std::string field;
  for (const auto& [obj, pre] : {std::pair<const json*, std::string>{&root, ""}, {&text, "text_config."}}) {
    for (const char* key : {"quantization", "quantization_config"}) {
      if (!q && obj->contains(key) && !(*obj)[key].is_null()) {
        q = &(*obj)[key];
        field = pre + key;
      }
    }
  }
  if (!q) return;
  if (!q->is_object()) throw Error("config: field '" + field + "' must be an object");
  // HF-style quantization_config from other quantizers (quant_method: fp8, gptq, ...) is not MLX affine.
  if (q->contains("quant_method")) {
    const std::string m = (*q)["quant_method"].is_string() ? (*q)["quant_method"].get<std::string>() : "?";
    throw Error("config: field '" + field + ".quant_method' is '" + m + "'; only MLX affine quantization is supported");
  }
  c.quant.present = true;
  parse_quant_params(*q, field, c.quant.group_size, c.quant.bits);
  c.quant.mode = "affine";
  for (auto it = q->begin(); it != q->end(); ++it) {
    if (!it.value().is_object()) continue;  // scalars are the defaults; booleans mark unquantized modules
    QuantOverride o{c.quant.group_size, c.quant.bits};
    parse_quant_params(it.value(), field + "['" + it.key() + "']", o.group_size, o.bits);
    c.quant.overrides[it.key()] = o;
  }
}

void check_divides(int a, const std::string& fa, int b, const std::string& fb, const std::string& prefix) {
  if (b % a != 0)
    throw Error("config: field '" + prefix + fa + "' (" + std::to_string(a) + ") must divide '" + prefix + fb +
                "' (" + std::to_string(b) + ")");
}

}  // namespace

ModelConfig parse_config(const std::string& json_text) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw Error(std::string("config: invalid JSON: ") + e.what());
  }
  if (!root.is_object()) throw Error("config: top level must be a JSON object");
  check_model_type(root, "model_type", true);
  const bool nested = root.contains("text_config") && !root["text_config"].is_null();
  if (nested && !root["text_config"].is_object()) throw Error("config: field 'text_config' must be an object");
  const json& text = nested ? root["text_config"] : root;
  if (nested) check_model_type(text, "text_config.model_type", false);
  const Fields f{text, nested ? "text_config." : ""};

  ModelConfig c;
  c.model_type = (nested && text.contains("model_type")) ? text["model_type"].get<std::string>()
                                                         : root["model_type"].get<std::string>();
  c.hidden_size = f.integer("hidden_size");
  c.num_hidden_layers = f.integer("num_hidden_layers");
  c.num_attention_heads = f.integer("num_attention_heads");
  c.num_key_value_heads = f.integer("num_key_value_heads");
  // Same fallback as the references when head_dim is absent (the real model sets 256 explicitly).
  c.head_dim = f.has("head_dim") ? f.integer("head_dim") : c.hidden_size / c.num_attention_heads;
  c.attn_output_gate = f.boolean_or("attn_output_gate", true);
  c.linear_num_key_heads = f.integer("linear_num_key_heads");
  c.linear_num_value_heads = f.integer("linear_num_value_heads");
  c.linear_key_head_dim = f.integer("linear_key_head_dim");
  c.linear_value_head_dim = f.integer("linear_value_head_dim");
  c.linear_conv_kernel_dim = f.integer("linear_conv_kernel_dim");
  c.num_experts = f.integer("num_experts");
  c.num_experts_per_tok = f.integer("num_experts_per_tok");
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.shared_expert_intermediate_size = f.integer("shared_expert_intermediate_size");
  c.vocab_size = f.integer("vocab_size");
  c.max_position_embeddings = f.integer_or("max_position_embeddings", 262144);
  const double eps = f.real_or("rms_norm_eps", c.rms_norm_eps);
  if (!(eps > 0 && eps < 1)) f.fail("rms_norm_eps", "must be in (0, 1)");
  c.rms_norm_eps = float(eps);
  // The flag may sit in text_config or at the top level (HF writes both).
  c.tie_word_embeddings = f.has("tie_word_embeddings") ? f.boolean_or("tie_word_embeddings", false)
                                                       : Fields{root, ""}.boolean_or("tie_word_embeddings", false);
  if (f.has("eos_token_id")) {
    const json& e = text["eos_token_id"];
    if (e.is_number_integer()) c.eos_token_ids.push_back(e.get<int>());
    else if (e.is_array()) {
      for (const json& x : e) {
        if (!x.is_number_integer()) f.fail("eos_token_id", "must be an integer or a list of integers");
        c.eos_token_ids.push_back(x.get<int>());
      }
    } else f.fail("eos_token_id", "must be an integer or a list of integers");
  }
  parse_layer_types(f, c);
  parse_rope(f, c);
  parse_quant(root, text, c);

  check_divides(c.num_key_value_heads, "num_key_value_heads", c.num_attention_heads, "num_attention_heads", f.prefix);
  check_divides(c.linear_num_key_heads, "linear_num_key_heads", c.linear_num_value_heads, "linear_num_value_heads", f.prefix);
  if (c.num_experts_per_tok > c.num_experts)
    f.fail("num_experts_per_tok", "(" + std::to_string(c.num_experts_per_tok) + ") exceeds num_experts (" +
                                      std::to_string(c.num_experts) + ")");
  if (c.linear_conv_kernel_dim < 2) f.fail("linear_conv_kernel_dim", "must be at least 2");
  return c;
}

ModelConfig load_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open (is " + dir + " a checkpoint directory?)");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return parse_config(ss.str());
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace lily
