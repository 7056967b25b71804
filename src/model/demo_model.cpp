// Writer of the built-in demo model (see demo_model.h): random zero-mean affine 4-bit weights with
// the real Qwen3.6 head dims, and a byte-level BPE tokenizer trained on a short built-in text.
#include "model/demo_model.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/common.h"
#include "core/safetensors.h"

namespace lily {

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

// ---- deterministic randomness (splitmix64; std distributions differ between libraries) -------

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }           // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

 private:
  uint64_t s_;
};

// ---- tokenizer --------------------------------------------------------------------------------

// Training text for the demo BPE merges (written for this project).
constexpr const char* kCorpus =
    "The little engine reads a prompt, turns the words into tokens and predicts the next token "
    "one step at a time. Each step looks at the tokens that came before, mixes them through the "
    "layers of the model and writes out a score for every token in the vocabulary. The sampler "
    "then picks one of the likely tokens, and the story goes on until the model says it is done. "
    "This demo model has random weights, so the text it writes is not meant to make sense; it is "
    "here so that the server, the chat command and the tests can run on any machine in a second. "
    "A real model learns its weights from a very large amount of text. It learns that the word "
    "after the is often a noun, that a question is followed by an answer, and that a story has a "
    "beginning, a middle and an end. The weights of this model are stored with four bits for "
    "every number and one scale and one bias for every group of sixty four numbers, which is the "
    "same format that the real checkpoint uses. When you ask the server a question, it renders the "
    "conversation with the chat template, encodes it, runs the model over the prompt, and then "
    "streams the answer back to you while it is being generated. Thank you for trying the engine; "
    "we hope that it is fast, that it is correct, and that the code is easy to read and to change. "
    "Every morning the baker opens the shop before the sun comes up. She mixes flour, water, salt "
    "and a little yeast, folds the dough, and leaves it to rest while she makes the coffee. By the "
    "time the first customers arrive the bread is warm, the windows are bright, and the street "
    "smells of butter and sugar. People come in to talk about the weather, the news and their "
    "children; some of them buy a loaf, some only want a cup of tea and a quiet place to sit. In "
    "the afternoon she writes down what sold well and what did not, and she plans the next day. "
    "Questions, answers, numbers and names: a good tokenizer should handle all of them, from short "
    "words like a, an, in and on to longer ones such as information, understanding, development, "
    "international, performance and responsibility, without losing a single byte of the input.";

// GPT-2 byte ↔ unicode table: printable bytes keep their code point, the rest map to 256+n.
std::vector<std::string> byte_strings() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<int> cs = bs;
  std::set<int> have(bs.begin(), bs.end());
  for (int b = 0, n = 0; b < 256; ++b)
    if (!have.count(b)) bs.push_back(b), cs.push_back(256 + n++);
  auto utf8 = [](int cp) {
    std::string s;
    if (cp < 0x80) s += char(cp);
    else s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
    return s;
  };
  std::vector<std::string> out(256);  // out[token id] for ids 0..255, in table order
  for (size_t i = 0; i < bs.size(); ++i) out[i] = utf8(cs[i]);
  return out;
}

std::vector<int> byte_to_id() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::set<int> have(bs.begin(), bs.end());
  for (int b = 0; b < 256; ++b)
    if (!have.count(b)) bs.push_back(b);
  std::vector<int> id(256);
  for (size_t i = 0; i < bs.size(); ++i) id[size_t(bs[i])] = int(i);
  return id;
}

struct Bpe {
  std::vector<std::string> vocab;                       // id → byte-level string
  std::vector<std::pair<std::string, std::string>> merges;
};

// Classic BPE training over " word" pre-tokens: repeatedly merge the most frequent adjacent pair
// (ties → smallest id pair, so the result is deterministic).
Bpe train_bpe(int max_merges) {
  Bpe bpe;
  bpe.vocab = byte_strings();
  const std::vector<int> id_of = byte_to_id();
  std::map<std::vector<int>, int> words;
  const std::string text = kCorpus;
  for (size_t i = 0; i < text.size();) {
    if (!std::isalpha(static_cast<unsigned char>(text[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && std::isalpha(static_cast<unsigned char>(text[j]))) ++j;
    std::vector<int> w;
    if (i > 0 && text[i - 1] == ' ') w.push_back(id_of[' ']);
    for (size_t k = i; k < j; ++k) w.push_back(id_of[static_cast<unsigned char>(text[k])]);
    words[w]++;
    i = j;
  }
  std::map<std::string, int> ids;
  for (size_t i = 0; i < bpe.vocab.size(); ++i) ids[bpe.vocab[i]] = int(i);
  for (int m = 0; m < max_merges; ++m) {
    std::map<std::pair<int, int>, int> pairs;
    for (const auto& [w, n] : words)
      for (size_t k = 0; k + 1 < w.size(); ++k) pairs[{w[k], w[k + 1]}] += n;
    std::pair<int, int> best{-1, -1};
    int best_n = 1;
    for (const auto& [p, n] : pairs)
      if (n > best_n) best = p, best_n = n;
    if (best.first < 0) break;
    const std::string merged = bpe.vocab[size_t(best.first)] + bpe.vocab[size_t(best.second)];
    auto [it, fresh] = ids.emplace(merged, int(bpe.vocab.size()));
    if (fresh) bpe.vocab.push_back(merged);
    bpe.merges.emplace_back(bpe.vocab[size_t(best.first)], bpe.vocab[size_t(best.second)]);
    std::map<std::vector<int>, int> next;
    for (const auto& [w, n] : words) {
      std::vector<int> out;
      for (size_t k = 0; k < w.size(); ++k) {
        if (k + 1 < w.size() && w[k] == best.first && w[k + 1] == best.second) out.push_back(it->second), ++k;
        else out.push_back(w[k]);
      }
      next[out] += n;
    }
    words = std::move(next);
  }
  return bpe;
}

struct Special {
  const char* text;
  bool special;  // the tokenizers "special" flag: think / tool markers are plain added tokens
};
constexpr Special kSpecials[] = {
    {"<|endoftext|>", true}, {"<|im_start|>", true},     {"<|im_end|>", true},
    {"<tool_call>", false},  {"</tool_call>", false},    {"<tool_response>", false},
    {"</tool_response>", false}, {"<think>", false},     {"</think>", false},
};

// Qwen3.5/3.6 pre-tokenizer pattern (FRONTEND.md §1.2).
constexpr const char* kPretokRegex =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

void write_json(const fs::path& path, const ojson& j) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw Error(path.string() + ": cannot create");
  out << j.dump(2) << "\n";
  if (!out) throw Error(path.string() + ": write failed");
}

int write_tokenizer(const fs::path& dir, const Bpe& bpe) {
  const int n_vocab = int(bpe.vocab.size());
  ojson added = ojson::array(), decoder = ojson::object();
  for (int i = 0; i < int(std::size(kSpecials)); ++i) {
    const Special& s = kSpecials[i];
    added.push_back({{"id", n_vocab + i}, {"content", s.text}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", s.special}});
    decoder[std::to_string(n_vocab + i)] = {{"content", s.text}, {"lstrip", false}, {"normalized", false},
                                            {"rstrip", false}, {"single_word", false}, {"special", s.special}};
  }
  const ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  ojson vocab = ojson::object();
  for (int i = 0; i < n_vocab; ++i) vocab[bpe.vocab[size_t(i)]] = i;
  ojson merges = ojson::array();
  for (const auto& [a, b] : bpe.merges) merges.push_back({a, b});
  ojson tok = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", kPretokRegex}}}, {"behavior", "Isolated"}, {"invert", false}},
          byte_level}}}},
      {"post_processor", byte_level}, {"decoder", byte_level},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merges}}}};
  write_json(dir / "tokenizer.json", tok);
  ojson cfg = {{"add_bos_token", false}, {"add_prefix_space", false}, {"added_tokens_decoder", decoder},
               {"additional_special_tokens", {"<|im_start|>", "<|im_end|>"}}, {"bos_token", nullptr},
               {"clean_up_tokenization_spaces", false}, {"eos_token", "<|im_end|>"}, {"errors", "replace"},
               {"model_max_length", 262144}, {"pad_token", "<|endoftext|>"}, {"split_special_tokens", false},
               {"tokenizer_class", "Qwen2Tokenizer"}, {"unk_token", nullptr}};
  write_json(dir / "tokenizer_config.json", cfg);
  return n_vocab + int(std::size(kSpecials));
}

// ---- weights ----------------------------------------------------------------------------------

struct Dims {
  int hidden = 256, layers = 4, heads = 4, kv_heads = 1, head_dim = 256;
  int lin_k_heads = 2, lin_v_heads = 4, lin_dim = 128, conv_k = 4;
  int experts = 8, top_k = 2, moe_inter = 128, shared_inter = 128;
  int conv_dim() const { return 2 * lin_k_heads * lin_dim + lin_v_heads * lin_dim; }
  bool full(int l) const { return (l + 1) % 4 == 0; }
};

constexpr const char* kPrefix = "language_model.model.";

// Affine-quantized random matrix stack [n, rows, cols]: uniform codes, per-group scale of random
// sign (the MLX encoder also yields negative scales) and bias = -scale * (levels-1)/2, so each
// group is zero-mean with standard deviation about `std`.
void add_quantized(std::vector<TensorOut>& out, Rng& rng, const std::string& name, int n, int rows, int cols,
                   int bits, double std) {
  const int per_word = 32 / bits, groups = cols / 64, levels = 1 << bits;
  const int64_t mats = n ? n : 1;
  std::vector<uint32_t> codes(size_t(mats * rows * cols / per_word));
  std::vector<float> scales(size_t(mats * rows * groups)), biases(scales.size());
  for (uint32_t& w : codes)
    for (int k = 0; k < per_word; ++k) w |= uint32_t(rng.next() >> 40) % uint32_t(levels) << (k * bits);
  const double unit = std / std::sqrt((double(levels) * levels - 1) / 12.0);
  for (size_t g = 0; g < scales.size(); ++g) {
    const double s = unit * rng.uniform(0.5, 1.5) * (rng.next() & 1 ? 1 : -1);
    scales[g] = bf16_to_f32(f32_to_bf16(float(s)));
    biases[g] = -scales[g] * float(levels - 1) / 2;
  }
  std::vector<int64_t> lead;
  if (n) lead.push_back(n);
  auto shape = [&](int64_t last) {
    std::vector<int64_t> s = lead;
    s.push_back(rows);
    s.push_back(last);
    return s;
  };
  out.push_back(tensor_u32(name + ".weight", shape(cols / per_word), codes));
  out.push_back(tensor_bf16(name + ".scales", shape(groups), scales));
  out.push_back(tensor_bf16(name + ".biases", shape(groups), biases));
}

std::vector<float> around(Rng& rng, int n, double center, double spread) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = float(center + rng.uniform(-spread, spread));
  return v;
}

std::vector<TensorOut> demo_tensors(const Dims& d, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<TensorOut> t;
  const int H = d.hidden;
  const double s_in = 1.0 / std::sqrt(double(H));
  const std::string P = kPrefix;
  add_quantized(t, rng, P + "embed_tokens", 0, vocab, H, 4, 1.0);
  // Logit spread of a few units so greedy decoding varies with the context.
  add_quantized(t, rng, "language_model.lm_head", 0, vocab, H, 4, 4.0 * s_in);
  t.push_back(tensor_bf16(P + "norm.weight", {H}, around(rng, H, 1.0, 0.1)));
  for (int l = 0; l < d.layers; ++l) {
    const std::string p = P + "layers." + std::to_string(l) + ".";
    t.push_back(tensor_bf16(p + "input_layernorm.weight", {H}, around(rng, H, 1.0, 0.1)));
    t.push_back(tensor_bf16(p + "post_attention_layernorm.weight", {H}, around(rng, H, 1.0, 0.1)));
    if (d.full(l)) {
      const int q_out = d.heads * d.head_dim;
      add_quantized(t, rng, p + "self_attn.q_proj", 0, 2 * q_out, H, 4, s_in);
      add_quantized(t, rng, p + "self_attn.k_proj", 0, d.kv_heads * d.head_dim, H, 4, s_in);
      add_quantized(t, rng, p + "self_attn.v_proj", 0, d.kv_heads * d.head_dim, H, 4, s_in);
      add_quantized(t, rng, p + "self_attn.o_proj", 0, H, q_out, 4, 1.0 / std::sqrt(double(q_out)));
      t.push_back(tensor_bf16(p + "self_attn.q_norm.weight", {d.head_dim}, around(rng, d.head_dim, 1.0, 0.1)));
      t.push_back(tensor_bf16(p + "self_attn.k_norm.weight", {d.head_dim}, around(rng, d.head_dim, 1.0, 0.1)));
    } else {
      const int nv = d.lin_v_heads, vdim = nv * d.lin_dim;
      add_quantized(t, rng, p + "linear_attn.in_proj_qkv", 0, d.conv_dim(), H, 4, s_in);
      add_quantized(t, rng, p + "linear_attn.in_proj_z", 0, vdim, H, 4, s_in);
      add_quantized(t, rng, p + "linear_attn.in_proj_a", 0, nv, H, 4, s_in);
      add_quantized(t, rng, p + "linear_attn.in_proj_b", 0, nv, H, 4, s_in);
      t.push_back(tensor_bf16(p + "linear_attn.conv1d.weight", {d.conv_dim(), d.conv_k, 1},
                              around(rng, d.conv_dim() * d.conv_k, 0.0, 0.8)));
      // A = U(1, 16) and dt in [1e-3, 1e-1] through an inverse softplus, as the reference init does.
      std::vector<float> a_log(static_cast<size_t>(nv)), dt_bias(static_cast<size_t>(nv));
      for (int j = 0; j < nv; ++j) {
        a_log[size_t(j)] = float(std::log(rng.uniform(1.0, 16.0)));
        const double dt = std::exp(rng.uniform(std::log(1e-3), std::log(1e-1)));
        dt_bias[size_t(j)] = float(dt + std::log(-std::expm1(-dt)));
      }
      t.push_back(tensor_f32(p + "linear_attn.A_log", {nv}, a_log));
      t.push_back(tensor_bf16(p + "linear_attn.dt_bias", {nv}, dt_bias));
      t.push_back(tensor_bf16(p + "linear_attn.norm.weight", {d.lin_dim}, around(rng, d.lin_dim, 1.0, 0.1)));
      add_quantized(t, rng, p + "linear_attn.out_proj", 0, H, vdim, 4, 1.0 / std::sqrt(double(vdim)));
    }
    const double s_mid = 1.0 / std::sqrt(double(d.moe_inter));
    add_quantized(t, rng, p + "mlp.gate", 0, d.experts, H, 8, 2.0 * s_in);
    add_quantized(t, rng, p + "mlp.switch_mlp.gate_proj", d.experts, d.moe_inter, H, 4, s_in);
    add_quantized(t, rng, p + "mlp.switch_mlp.up_proj", d.experts, d.moe_inter, H, 4, s_in);
    add_quantized(t, rng, p + "mlp.switch_mlp.down_proj", d.experts, H, d.moe_inter, 4, s_mid);
    add_quantized(t, rng, p + "mlp.shared_expert.gate_proj", 0, d.shared_inter, H, 4, s_in);
    add_quantized(t, rng, p + "mlp.shared_expert.up_proj", 0, d.shared_inter, H, 4, s_in);
    add_quantized(t, rng, p + "mlp.shared_expert.down_proj", 0, H, d.shared_inter, 4, 1.0 / std::sqrt(double(d.shared_inter)));
    add_quantized(t, rng, p + "mlp.shared_expert_gate", 0, 1, H, 8, s_in);
  }
  return t;
}

ojson demo_config(const Dims& d, int vocab, int eos) {
  ojson layer_types = ojson::array();
  for (int l = 0; l < d.layers; ++l) layer_types.push_back(d.full(l) ? "full_attention" : "linear_attention");
  ojson text = {{"model_type", "qwen3_5_moe_text"}, {"hidden_size", d.hidden}, {"num_hidden_layers", d.layers},
                {"layer_types", layer_types}, {"full_attention_interval", 4},
                {"num_attention_heads", d.heads}, {"num_key_value_heads", d.kv_heads}, {"head_dim", d.head_dim},
                {"attn_output_gate", true}, {"attention_bias", false},
                {"linear_num_key_heads", d.lin_k_heads}, {"linear_num_value_heads", d.lin_v_heads},
                {"linear_key_head_dim", d.lin_dim}, {"linear_value_head_dim", d.lin_dim},
                {"linear_conv_kernel_dim", d.conv_k}, {"mamba_ssm_dtype", "float32"},
                {"num_experts", d.experts}, {"num_experts_per_tok", d.top_k},
                {"moe_intermediate_size", d.moe_inter}, {"shared_expert_intermediate_size", d.shared_inter},
                {"vocab_size", vocab}, {"hidden_act", "silu"}, {"rms_norm_eps", 1e-6},
                {"max_position_embeddings", 262144}, {"partial_rotary_factor", 0.25},
                {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000000}, {"partial_rotary_factor", 0.25},
                                     {"mrope_interleaved", true}, {"mrope_section", {11, 11, 10}}}},
                {"tie_word_embeddings", false}, {"eos_token_id", eos}, {"dtype", "bfloat16"}};
  ojson quant = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"}};
  for (int l = 0; l < d.layers; ++l) {
    const std::string p = std::string(kPrefix) + "layers." + std::to_string(l) + ".mlp.";
    quant[p + "gate"] = {{"group_size", 64}, {"bits", 8}};
    quant[p + "shared_expert_gate"] = {{"group_size", 64}, {"bits", 8}};
  }
  return {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"model_type", "qwen3_5_moe"},
          {"text_config", text}, {"tie_word_embeddings", false}, {"quantization", quant},
          {"quantization_config", quant}, {"lily_demo", true}};
}

}  // namespace

DemoModelInfo write_demo_model(const std::string& dir_str, uint64_t seed) {
  const fs::path dir(dir_str);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir_str + ": cannot create directory: " + ec.message());
  const Bpe bpe = train_bpe(400);
  DemoModelInfo info;
  info.num_merges = int(bpe.merges.size());
  info.vocab_size = write_tokenizer(dir, bpe);
  const int endoftext = int(bpe.vocab.size()), im_end = endoftext + 2;
  const Dims d;
  write_json(dir / "config.json", demo_config(d, info.vocab_size, endoftext));
  write_json(dir / "generation_config.json",
             ojson{{"bos_token_id", endoftext}, {"eos_token_id", {im_end, endoftext}}, {"pad_token_id", endoftext},
                   {"do_sample", true}, {"temperature", 1.0}, {"top_k", 20}, {"top_p", 0.95}});
  const std::vector<TensorOut> tensors = demo_tensors(d, info.vocab_size, seed);
  for (const TensorOut& t : tensors) info.weight_bytes += t.data.size();
  write_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "mlx"}});
  return info;
}

}  // namespace lily
