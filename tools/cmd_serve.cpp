// `lily serve`: loads the model once (health answers 503 meanwhile) and serves the OpenAI API.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <pthread.h>
#include <unistd.h>

#include "command.h"
#include "core/common.h"
#include "core/options.h"
#include "engine/engine.h"
#include "engine/model_loader.h"
#include "server/http_server.h"

namespace lily {
namespace {

int serve_main(int argc, char** argv) {
  Options o("serve", "Serve the model over an OpenAI-compatible HTTP API (one request at a time).",
            {{"model", "", "checkpoint directory (MLX 4-bit or HF bf16)", "LILY_MODEL"},
             {"model-name", "", "model id reported by the API (default: the directory's name)", ""},
             {"backend", "cpu", "cpu | cuda", "LILY_BACKEND"},
             {"threads", "0", "CPU threads (0 = all cores)", "LILY_THREADS"},
             {"ctx", "0", "context length in tokens (0 = min(model maximum, 32768))", ""},
             {"cache-mb", "2048", "memory for session snapshots (prefix reuse), MiB; 0 = none", ""},
             {"snapshot-every", "-1",
              "also snapshot every N prompt tokens (0 = only turn boundaries; -1 = max(2048, the prefill chunk))", ""},
             {"no-prefix-cache", "false", "never reuse earlier requests' state (every request cold)", "", true},
             {"chunk", "0", "prefill chunk size in tokens (0 = 16384 on cuda, 512 on cpu)", ""},
             {"device-sampling", "auto", "decode loop with sampling on the backend (D2): auto (cuda) | on | off", ""},
             {"max-tokens", "0", "default max_tokens when a request gives none (0 = until the context is full)", ""},
             {"host", "127.0.0.1", "address to bind", ""},
             {"port", "8080", "port to bind (0 = any free port)", ""},
             {"api-key", "", "require 'Authorization: Bearer KEY'", "LILY_API_KEY"},
             {"max-body-mb", "16", "largest accepted request body, MiB", ""},
             {"keep-alive", "2", "seconds an idle keep-alive connection stays open (also bounds shutdown with idle clients)", ""},
             {"timeout", "600", "per-request time limit in seconds (0 = none)", ""},
             {"ping-interval", "5", "SSE keep-alive comment after this many idle seconds", ""},
             {"http-threads", "32", "HTTP worker threads (concurrent connections)", ""},
             {"ablate", "", "comma-separated optimization ids to switch off", ""},
             {"quiet", "false", "no load progress", "", true}});
  if (!o.parse(argc, argv)) return 0;
  const std::string dir = o.str("model");
  if (dir.empty()) throw Error("--model DIR is required");
  if (!std::filesystem::is_directory(dir)) throw Error("--model: '" + dir + "' is not a directory");

  ServerOptions so;
  so.host = o.str("host");
  so.port = o.num("port");
  so.api_key = o.str("api-key");
  so.model_name = o.str("model-name");
  if (so.model_name.empty()) {
    std::filesystem::path p = std::filesystem::weakly_canonical(dir);
    so.model_name = p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  }
  so.max_body_bytes = size_t(o.real("max-body-mb") * (1 << 20));
  so.keep_alive_s = o.num("keep-alive");
  so.request_timeout_s = o.real("timeout");
  so.ping_interval_s = o.real("ping-interval");
  so.http_threads = o.num("http-threads");

  // SIGINT/SIGTERM are handled by one thread via sigwait; every other thread inherits the mask.
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  HttpServer server(so);
  const int port = server.bind();
  std::fprintf(stderr, "lily serve: listening on http://%s:%d (loading %s)\n", so.host.c_str(), port, dir.c_str());
  const bool loopback = so.host == "127.0.0.1" || so.host == "localhost" || so.host == "::1";
  if (!loopback && so.api_key.empty())
    std::fprintf(stderr, "lily serve: warning: listening on %s without --api-key: anyone who can reach "
                         "this address can use the model\n", so.host.c_str());
  std::thread listener([&] { server.listen(); });
  std::thread([&server, sigs] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (!server.ready()) {
      std::fprintf(stderr, "lily serve: interrupted while loading\n");
      _exit(130);
    }
    std::fprintf(stderr, "lily serve: shutting down\n");
    server.stop();
  }).detach();

  try {
    ModelLoadOptions mo;
    mo.dir = dir;
    mo.backend = o.str("backend");
    mo.threads = o.num("threads");
    mo.chunk = o.num("chunk");
    mo.max_context = std::max(0, o.num("ctx"));
    mo.progress = !o.flag("quiet");
    mo.ablate = o.str("ablate");
    auto loaded = load_model(mo);
    EngineOptions eo;
    eo.ctx = o.num("ctx") > 0 ? o.num("ctx") : std::min(loaded->max_position_embeddings(), 32768);
    if (eo.ctx > loaded->max_position_embeddings())
      throw Error("--ctx " + std::to_string(eo.ctx) + " exceeds the model's max_position_embeddings " +
                  std::to_string(loaded->max_position_embeddings()));
    eo.cache_bytes = int64_t(o.real("cache-mb") * (1 << 20));
    // A snapshot point also cuts the prefill there: by default never more often than the chunk (on cuda a
    // 2,048-token chunk ran at 36.7K tok/s, a 4,096 one at 42.6K in session 10's call 6; 16,384 is the chunk since
    // session 32).
    eo.snapshot_every = o.num("snapshot-every") >= 0 ? o.num("snapshot-every") : std::max(2048, loaded->lm().max_chunk());
    eo.prefix_reuse = !o.flag("no-prefix-cache");
    const std::string ds = o.str("device-sampling");
    if (ds != "auto" && ds != "on" && ds != "off") throw Error("--device-sampling must be auto, on or off");
    eo.device_sampling = ds == "auto" ? -1 : ds == "on" ? 1 : 0;
    auto engine = std::make_unique<Engine>(loaded->lm(), loaded->tokenizer(), eo);
    SamplingDefaults defaults = load_sampling_defaults(dir);
    if (o.num("max-tokens") > 0) defaults.max_tokens = o.num("max-tokens");
    server.attach(std::move(engine), loaded->tokenizer(), defaults, loaded);
    std::fprintf(stderr, "lily serve: ready: model '%s', backend %s, context %d tokens, cache %.0f MiB\n",
                 so.model_name.c_str(), loaded->backend_name().c_str(), eo.ctx, o.real("cache-mb"));
  } catch (...) {
    server.stop();
    listener.join();
    throw;
  }
  listener.join();
  return 0;
}

const RegisterCommand kRegister({"serve", "OpenAI-compatible HTTP server", serve_main});

}  // namespace
}  // namespace lily
