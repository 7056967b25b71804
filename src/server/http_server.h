// OpenAI-compatible HTTP server over one Worker: /v1/chat/completions, /v1/completions,
// /v1/models, /health, /tokenize, /detokenize, /apply-template, /metrics.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "server/openai_request.h"
#include "server/worker.h"

namespace httplib {
class Server;
}

namespace lily {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                      // 0 = any free port
  std::string api_key;                  // empty = no authentication
  std::string model_name = "lily";
  size_t max_body_bytes = 16u << 20;
  double request_timeout_s = 600;       // 0 = none
  double ping_interval_s = 5;           // SSE keep-alive comment when nothing else was sent
  int http_threads = 32;
  // Idle keep-alive connections close after this. cpp-httplib (0.11) checks for shutdown only
  // between requests, so it also bounds how long stop() waits on an idle client (was 5 s).
  int keep_alive_s = 2;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions opt);
  ~HttpServer();

  // Binds the socket (health answers 503 until attach()). Returns the bound port.
  int bind();
  // Serves until stop(); call after bind(), typically on its own thread.
  void listen();
  void stop();
  // Hands over the loaded model: starts the worker and opens the API. keep_alive owns what the
  // engine points into (the model); it is released after the worker has stopped.
  void attach(std::unique_ptr<Engine> engine, std::shared_ptr<const Tokenizer> tok,
              SamplingDefaults defaults, std::shared_ptr<void> keep_alive = {});
  bool ready() const { return ready_.load(); }

 private:
  void routes();
  bool authorized(const std::string& header) const;

  ServerOptions opt_;
  std::unique_ptr<httplib::Server> http_;
  std::shared_ptr<void> keep_alive_;   // declared before worker_: destroyed after it
  std::unique_ptr<Worker> worker_;
  std::shared_ptr<const Tokenizer> tok_;
  SamplingDefaults defaults_;
  int ctx_ = 0;
  std::atomic<bool> ready_{false};
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace lily
