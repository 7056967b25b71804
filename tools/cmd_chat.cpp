// `lily chat`: interactive terminal chat with streaming output, reasoning shown dimmed, and the
// same engine (prefix reuse across turns) as the server. Commands: /reset, /stats, /quit.
#include <cstdio>
#include <iostream>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "engine/engine.h"
#include "engine/model_loader.h"
#include "server/openai_request.h"
#include "tokenizer/chat_template.h"

namespace lily {
namespace {

using OJ = nlohmann::ordered_json;

int chat_main(int argc, char** argv) {
  Options o("chat", "Interactive chat in the terminal (/reset, /stats, /quit).",
            {{"model", "", "checkpoint directory", "LILY_MODEL"},
             {"backend", "cpu", "cpu | cuda", "LILY_BACKEND"},
             {"threads", "0", "CPU threads (0 = all cores)", "LILY_THREADS"},
             {"ctx", "8192", "context length in tokens", ""},
             {"cache-mb", "1024", "memory for session snapshots, MiB", ""},
             {"system", "", "system prompt", ""},
             {"no-think", "false", "thinking off (enable_thinking = false)", "", true},
             {"max-tokens", "2048", "output tokens per reply", ""},
             {"temperature", "", "override the mode's default temperature", ""},
             {"seed", "", "sampling seed (reproducible replies)", ""},
             {"quiet", "false", "no load progress", "", true}});
  if (!o.parse(argc, argv)) return 0;
  ModelLoadOptions mo;
  mo.dir = o.str("model");
  mo.max_context = std::max(0, o.num("ctx"));
  mo.backend = o.str("backend");
  mo.threads = o.num("threads");
  mo.progress = !o.flag("quiet");
  auto loaded = load_model(mo);
  EngineOptions eo;
  eo.ctx = o.num("ctx");
  eo.cache_bytes = int64_t(o.real("cache-mb") * (1 << 20));
  Engine engine(loaded->lm(), loaded->tokenizer(), eo);
  const SamplingDefaults defaults = load_sampling_defaults(mo.dir);
  ChatTemplateOptions topt;
  topt.enable_thinking = !o.flag("no-think");

  const bool tty = isatty(STDOUT_FILENO);
  const char* dim = tty ? "\x1b[2m" : "";
  const char* plain = tty ? "\x1b[0m" : "";
  OJ messages = OJ::array();
  if (!o.str("system").empty()) messages.push_back({{"role", "system"}, {"content", o.str("system")}});
  GenerationResult last;
  std::printf("lily chat: %s on %s, context %d. /reset, /stats, /quit\n", mo.dir.c_str(),
              loaded->backend_name().c_str(), eo.ctx);
  std::string line;
  while (true) {
    std::printf("%s> ", tty ? "\n" : "");
    std::fflush(stdout);
    if (!std::getline(std::cin, line) || line == "/quit" || line == "/exit") break;
    if (line.empty()) continue;
    if (line == "/reset") {
      messages = OJ::array();
      if (!o.str("system").empty()) messages.push_back({{"role", "system"}, {"content", o.str("system")}});
      engine.reset_sessions();
      std::printf("(conversation cleared)\n");
      continue;
    }
    if (line == "/stats") {
      const EngineStats s = engine.stats();
      std::printf("requests %lld, prompt tokens %lld (cached %lld, prefilled %lld), generated %lld\n"
                  "snapshots %lld (%.1f MiB of %.0f MiB), last reply: prefill %.1f tok/s, decode %.1f tok/s\n",
                  (long long)s.requests, (long long)s.prompt_tokens, (long long)s.cached_tokens,
                  (long long)s.prefill_tokens, (long long)s.decode_tokens, (long long)s.cache.snapshots,
                  s.cache.bytes / 1048576.0, s.cache.budget / 1048576.0,
                  last.prefill_seconds > 0 ? (last.prompt_tokens - last.cached_tokens) / last.prefill_seconds : 0.0,
                  last.decode_seconds > 0 && last.completion_tokens > 1
                      ? (last.completion_tokens - 1) / last.decode_seconds : 0.0);
      continue;
    }
    messages.push_back({{"role", "user"}, {"content", line}});
    GenerationRequest req;
    std::string prompt;
    try {
      prompt = render_chat(messages, OJ(), topt);
    } catch (const Error& e) {
      std::printf("error: %s\n", e.what());
      messages.erase(messages.end() - 1);
      continue;
    }
    req.prompt = engine.tokenizer().encode(prompt, true);
    req.sampling = topt.enable_thinking ? defaults.thinking : defaults.instruct;
    if (!o.str("temperature").empty()) req.sampling.temperature = float(o.real("temperature"));
    if (!o.str("seed").empty()) {
      req.sampling.has_seed = true;
      req.sampling.seed = uint64_t(o.i64("seed"));
    }
    req.max_tokens = o.num("max-tokens");
    req.parse_output = true;
    req.starts_in_reasoning = prompt.size() >= 8 && prompt.compare(prompt.size() - 8, 8, "<think>\n") == 0;
    bool in_reasoning = false;
    try {
      last = engine.generate(req, [&](const GenerationEvent& ev) {
        if (!ev.parsed.reasoning.empty()) {
          std::printf("%s%s", in_reasoning ? "" : dim, ev.parsed.reasoning.c_str());
          in_reasoning = true;
        }
        if (!ev.parsed.content.empty()) {
          std::printf("%s%s", in_reasoning ? plain : "", ev.parsed.content.c_str());
          in_reasoning = false;
        }
        for (const auto& d : ev.parsed.tool_calls)
          std::printf("%s%s%s", in_reasoning ? plain : "", d.name.empty() ? "" : ("[tool call " + d.name + "] ").c_str(),
                      d.arguments.c_str()), in_reasoning = false;
        std::fflush(stdout);
      });
    } catch (const Error& e) {
      std::printf("%s\nerror: %s\n", plain, e.what());
      messages.erase(messages.end() - 1);
      continue;
    }
    std::printf("%s\n", in_reasoning ? plain : "");
    const double tps = last.decode_seconds > 0 && last.completion_tokens > 1
                           ? (last.completion_tokens - 1) / last.decode_seconds : 0.0;
    std::printf("%s[%d tokens, %.1f tok/s, %d of %d prompt tokens cached, finish: %s]%s\n", dim,
                last.completion_tokens, tps, last.cached_tokens, last.prompt_tokens,
                last.finish_reason.c_str(), plain);
    OJ am = {{"role", "assistant"}, {"content", last.content}};
    if (!last.reasoning.empty()) am["reasoning_content"] = last.reasoning;
    messages.push_back(am);
  }
  return 0;
}

const RegisterCommand kRegister({"chat", "interactive terminal chat", chat_main});

}  // namespace
}  // namespace lily
