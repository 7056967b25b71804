// `lily run`: greedy generation from token ids, with throughput and an optional logits dump that
// any reference implementation can be compared against from outside.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "model/qwen36.h"
#include "model/weights.h"
#ifdef LILY_HAVE_FRONTEND
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#endif

namespace lily {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int32_t argmax_host(const float* l, int n) { return int32_t(std::max_element(l, l + n) - l); }

int run_main(int argc, char** argv) {
  Options o("run", "Greedy generation from prompt token ids; prints the ids and tokens/s.",
            {{"model", "", "checkpoint directory (MLX 4-bit or HF bf16)", "LILY_MODEL"},
             {"prompt-ids", "", "comma-separated prompt token ids"},
             {"prompt", "", "prompt text, encoded with the model's tokenizer.json (instead of --prompt-ids)"},
             {"chat", "false", "with --prompt: wrap it as one user turn with the chat template", "", true},
             {"n", "16", "number of tokens to generate", "", false, 'n'},
             {"backend", "cpu", "cpu | cuda", "LILY_BACKEND"},
             {"threads", "0", "CPU threads (0 = all cores)", "LILY_THREADS"},
             {"chunk", "0", "prefill chunk size in tokens (0 = 16384 on cuda, 512 on cpu)"},
             {"ctx", "0", "context capacity (0 = prompt + n)"},
             {"dump-logits", "", "write f32 logits [rows, vocab] here (+ .json sidecar)"},
             {"ablate", "", "comma-separated optimization ids to switch off (e.g. D2,P1)"},
             {"quiet", "false", "no progress or timing on stderr", "", true}});
  if (!o.parse(argc, argv)) return 0;
  if (o.str("model").empty()) throw Error("--model DIR is required");
  const int n_gen = o.num("n");
  if (n_gen < 1) throw Error("-n must be at least 1");
  std::vector<int32_t> prompt;
#ifdef LILY_HAVE_FRONTEND
  std::shared_ptr<Tokenizer> tokenizer;
  if (!o.str("prompt").empty()) {
    if (o.given("prompt-ids")) throw Error("give either --prompt or --prompt-ids, not both");
    tokenizer = Tokenizer::load(o.str("model"));
    std::string text = o.str("prompt");
    if (o.flag("chat")) {
      nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
      msgs.push_back({{"role", "user"}, {"content", text}});
      text = render_chat(msgs, nullptr, ChatTemplateOptions{});
    }
    prompt = tokenizer->encode(text);
  }
#else
  if (!o.str("prompt").empty()) throw Error("--prompt needs a build with the tokenizer (front-end)");
#endif
  if (prompt.empty()) {
    const std::vector<int> ids = parse_int_list(o.str("prompt-ids"), "--prompt-ids");
    prompt.assign(ids.begin(), ids.end());
  }
  if (prompt.empty()) throw Error("give the prompt with --prompt-ids 1,2,3 (or --prompt TEXT)");

  LoadOptions lo;
  lo.progress = !o.flag("quiet");
  auto host = std::make_shared<ModelWeights>(load_weights(o.str("model"), lo));
  const int V = host->config.vocab_size;
  for (int32_t id : prompt)
    if (id < 0 || id >= V)
      throw Error("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                  std::to_string(V) + ")");

  BackendOptions bo;
  bo.name = o.str("backend");
  bo.threads = o.num("threads");
  bo.ablations.off = split_list(o.str("ablate"));
  auto backend = make_backend(bo);
  ModelOptions mo;
  if (o.num("chunk") < 0) throw Error("--chunk must be >= 0 (0 = the backend's default)");
  mo.max_chunk = o.num("chunk") > 0 ? o.num("chunk") : default_prefill_chunk(backend->name());
  Qwen36 model(host, *backend, mo);
  const int P = int(prompt.size());
  const int cap = o.num("ctx") > 0 ? o.num("ctx") : P + n_gen;
  auto st = model.new_state(cap);

  const bool dump = !o.str("dump-logits").empty();
  std::vector<float> logits(size_t(dump ? int64_t(P + n_gen - 1) * V : V));
  auto t0 = Clock::now();
  model.forward(*st, prompt, logits.data(), dump);
  backend->synchronize();
  const double t_prefill = seconds_since(t0);

  std::vector<int32_t> gen;
  int32_t tok = argmax_host(logits.data() + (dump ? int64_t(P - 1) * V : 0), V);
  gen.push_back(tok);
  auto t1 = Clock::now();
  for (int i = 1; i < n_gen; ++i) {
    float* row = logits.data() + (dump ? int64_t(P + i - 1) * V : 0);
    model.forward(*st, {&tok, 1}, row, false);
    tok = argmax_host(row, V);
    gen.push_back(tok);
  }
  backend->synchronize();
  const double t_decode = seconds_since(t1);

  std::printf("generated:");
  for (size_t i = 0; i < gen.size(); ++i) std::printf("%s%d", i ? "," : " ", gen[i]);
  std::printf("\n");
#ifdef LILY_HAVE_FRONTEND
  if (tokenizer) std::printf("text: %s\n", tokenizer->decode(gen).c_str());
#endif
  if (!o.flag("quiet")) {
    std::fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tok/s)\n", P, t_prefill, P / t_prefill);
    if (n_gen > 1)
      std::fprintf(stderr, "decode: %d tokens in %.3f s (%.1f tok/s)\n", n_gen - 1, t_decode,
                   (n_gen - 1) / t_decode);
  }
  if (dump) {
    const std::string path = o.str("dump-logits");
    const int64_t rows = int64_t(P) + n_gen - 1;
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(rows * V * 4));
    if (!f) throw Error("cannot write logits to " + path);
    std::ofstream j(path + ".json");
    j << "{\"rows\": " << rows << ", \"vocab\": " << V << ", \"dtype\": \"float32\", \"prompt_tokens\": "
      << P << ", \"generated\": [";
    for (size_t i = 0; i < gen.size(); ++i) j << (i ? ", " : "") << gen[i];
    j << "]}\n";
    if (!j) throw Error("cannot write " + path + ".json");
  }
  return 0;
}

RegisterCommand reg_run({"run", "greedy generation from token ids (throughput, logits dump)", run_main});

}  // namespace
}  // namespace lily
