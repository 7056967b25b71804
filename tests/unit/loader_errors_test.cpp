// Checkpoint loading, bad inputs: each error names the tensor, the file or the config field.
#include "loader_fixture.h"

namespace lily::loader_test {
namespace {

TEST(LoaderErrors, TruncatedFile) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  write_ckpt(d, c);
  const fs::path f = d.path / "model.safetensors";
  fs::resize_file(f, fs::file_size(f) - 2);
  const std::string msg = load_error(d);
  EXPECT_HAS(msg, f.string());
  EXPECT_HAS(msg, c.t.back().name);  // the last tensor's data is cut off
  EXPECT_HAS(msg, "truncated");
  fs::resize_file(f, 5);
  EXPECT_HAS(load_error(d), "too small");
}

TEST(LoaderErrors, CorruptHeaderJson) {
  TmpDir d;
  write_ckpt(d, make_ckpt(Opt{}));
  const fs::path f = d.path / "model.safetensors";
  std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
  io.seekp(8 + 1);
  io.write("#!@", 3);
  io.close();
  const std::string msg = load_error(d);
  EXPECT_HAS(msg, f.string());
  EXPECT_HAS(msg, "corrupt safetensors header");
  // A header length past the end of the file.
  std::fstream io2(f, std::ios::in | std::ios::out | std::ios::binary);
  const uint8_t big[8] = {0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0};
  io2.write(reinterpret_cast<const char*>(big), 8);
  io2.close();
  EXPECT_HAS(load_error(d), "header length");
}

TEST(LoaderErrors, WrongDtype) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  const std::string norm = "language_model.model.layers.0.input_layernorm.weight";
  TensorOut* t = c.find(norm);
  *t = tensor_u32(norm, {H}, std::vector<uint32_t>(H, 1));
  write_ckpt(d, c);
  std::string msg = load_error(d);
  EXPECT_HAS(msg, norm);
  EXPECT_HAS(msg, "dtype U32");
  EXPECT_HAS(msg, (d.path / "model.safetensors").string());

  // Scales must be BF16 or F32.
  c = make_ckpt(Opt{});
  const std::string sc = "language_model.model.layers.1.self_attn.k_proj.scales";
  t = c.find(sc);
  t->dtype = DType::kF16;
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, sc);
  EXPECT_HAS(msg, "F16");

  // A dtype safetensors allows but lily does not (patched into the header: I32 has U32's size).
  c = make_ckpt(Opt{});
  const std::string alog = "language_model.model.layers.0.linear_attn.A_log";
  write_ckpt(d, c);
  const fs::path f = d.path / "model.safetensors";
  std::ifstream in(f, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const size_t at_key = bytes.find("\"" + alog + "\"");
  ASSERT_NE(at_key, std::string::npos);
  const size_t at_dtype = bytes.find("\"F32\"", at_key);
  ASSERT_NE(at_dtype, std::string::npos);
  bytes.replace(at_dtype, 5, "\"I32\"");
  std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
  msg = load_error(d);
  EXPECT_HAS(msg, alog);
  EXPECT_HAS(msg, "dtype I32");
}

TEST(LoaderErrors, ShapeMismatch) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  const std::string q = "language_model.model.layers.1.self_attn.q_proj";
  for (const char* s : {".weight", ".scales", ".biases"}) c.erase(q + s);
  c.quant(q, 0, NH * HD, H, 4, false);  // missing the gate half
  write_ckpt(d, c);
  std::string msg = load_error(d);
  EXPECT_HAS(msg, q + ".");
  EXPECT_HAS(msg, (d.path / "model.safetensors").string());
  EXPECT_HAS(msg, "expected [256, ");

  c = make_ckpt(Opt{});
  const std::string conv = "language_model.model.layers.0.linear_attn.conv1d.weight";
  *c.find(conv) = tensor_bf16(conv, {CONV, K}, std::vector<float>(CONV * K, 0.f));
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, conv);
  EXPECT_HAS(msg, "[256, 4, 1]");
}

TEST(LoaderErrors, BitsDisagreeWithConfig) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  const std::string g = "language_model.model.layers.0.mlp.gate";
  for (const char* s : {".weight", ".scales", ".biases"}) c.erase(g + s);
  c.quant(g, 0, E, H, 4, false);  // config says 8-bit for the router
  write_ckpt(d, c);
  std::string msg = load_error(d);
  EXPECT_HAS(msg, g + ".weight");
  EXPECT_HAS(msg, "4-bit");
  EXPECT_HAS(msg, "8-bit");

  c = make_ckpt(Opt{});
  c.config.erase("quantization");
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, "no quantization block");
}

TEST(LoaderErrors, MissingTensor) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  const std::string k = "language_model.model.layers.1.self_attn.k_norm.weight";
  c.erase(k);
  write_ckpt(d, c);
  std::string msg = load_error(d);
  EXPECT_HAS(msg, "missing tensor " + k);
  EXPECT_HAS(msg, (d.path / "model.safetensors").string());

  c = make_ckpt(Opt{});
  c.erase("language_model.lm_head.weight");
  c.erase("language_model.lm_head.scales");
  c.erase("language_model.lm_head.biases");
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, "missing tensor language_model.lm_head.weight");

  Opt hf;
  hf.hf = true;
  hf.model = "model.language_model.";
  hf.head = "lm_head";
  c = make_ckpt(hf);
  c.erase("model.language_model.layers.0.mlp.experts.down_proj");
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, "missing tensor model.language_model.layers.0.mlp.experts.down_proj");
}

TEST(LoaderErrors, ExtraTensor) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  c.plain("language_model.model.layers.0.mlp.extra_proj.weight", {4, 4}, DType::kBF16);
  write_ckpt(d, c);
  std::string msg = load_error(d);
  EXPECT_HAS(msg, "language_model.model.layers.0.mlp.extra_proj.weight");
  EXPECT_HAS(msg, "unexpected tensor");
  EXPECT_HAS(msg, (d.path / "model.safetensors").string());

  c = make_ckpt(Opt{});
  c.plain("something_else.weight", {4}, DType::kBF16);
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, "something_else.weight");
  EXPECT_HAS(msg, "unexpected tensor");

  // A layer beyond num_hidden_layers is extra too.
  c = make_ckpt(Opt{});
  c.plain("language_model.model.layers.2.input_layernorm.weight", {H}, DType::kBF16);
  write_ckpt(d, c);
  EXPECT_HAS(load_error(d), "language_model.model.layers.2.input_layernorm.weight");
}

TEST(LoaderErrors, ConfigProblems) {
  TmpDir d;
  Ckpt c = make_ckpt(Opt{});
  c.config["text_config"].erase("moe_intermediate_size");
  write_ckpt(d, c);
  std::string msg = load_error(d);
  EXPECT_HAS(msg, (d.path / "config.json").string());
  EXPECT_HAS(msg, "text_config.moe_intermediate_size");

  c = make_ckpt(Opt{});
  c.config["model_type"] = "mixtral";
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, "model_type");
  EXPECT_HAS(msg, "mixtral");

  // A config whose dims disagree with the tensors fails on the first tensor it checks.
  c = make_ckpt(Opt{});
  c.config["text_config"]["vocab_size"] = V + 1;
  write_ckpt(d, c);
  msg = load_error(d);
  EXPECT_HAS(msg, "language_model.model.embed_tokens");
  EXPECT_HAS(msg, "shape");
}

TEST(LoaderErrors, NotACheckpoint) {
  TmpDir d;
  std::string msg = load_error(d);
  EXPECT_HAS(msg, "config.json");
  std::ofstream(d.path / "config.json") << make_ckpt(Opt{}).config.dump();
  msg = load_error(d);
  EXPECT_HAS(msg, d.str());
  EXPECT_HAS(msg, "safetensors");
}

}  // namespace
}  // namespace lily::loader_test
