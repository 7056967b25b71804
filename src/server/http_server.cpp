// HTTP routes, authentication, SSE streaming and error mapping (see http_server.h).
#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <random>

#include "core/common.h"
#include "server/openai_response.h"

namespace lily {
namespace {

using OJ = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

void send_json(httplib::Response& res, int status, const OJ& j) {
  res.status = status;
  res.set_content(dump_json(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.status, e.body()); }

std::string random_hex(int n) {
  thread_local std::mt19937_64 rng(std::random_device{}() ^ uint64_t(Clock::now().time_since_epoch().count()));
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += hex[rng() & 15];
  return s;
}

OJ parse_body(const httplib::Request& req) {
  try {
    OJ body = OJ::parse(req.body);
    if (!body.is_object()) throw bad_request("", "the request body must be a JSON object");
    return body;
  } catch (const nlohmann::json::exception& e) {
    throw bad_request("", std::string("the request body is not valid JSON: ") + e.what());
  }
}

void log_request(const httplib::Request& req, int status, const GenerationResult* r) {
  if (r) {
    const double pf = r->prefill_seconds > 0 ? (r->prompt_tokens - r->cached_tokens) / r->prefill_seconds : 0;
    const double dc = r->decode_seconds > 0 && r->completion_tokens > 1
                          ? (r->completion_tokens - 1) / r->decode_seconds : 0;
    std::fprintf(stderr,
                 "%s %s %d prompt=%d cached=%d completion=%d finish=%s prefill=%.1f tok/s decode=%.1f tok/s\n",
                 req.method.c_str(), req.path.c_str(), status, r->prompt_tokens, r->cached_tokens,
                 r->completion_tokens, r->finish_reason.c_str(), pf, dc);
  } else {
    std::fprintf(stderr, "%s %s %d\n", req.method.c_str(), req.path.c_str(), status);
  }
}

}  // namespace

HttpServer::HttpServer(ServerOptions opt) : opt_(std::move(opt)), http_(std::make_unique<httplib::Server>()) {
  const int threads = std::max(4, opt_.http_threads);
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  http_->set_payload_max_length(opt_.max_body_bytes);
  http_->set_keep_alive_timeout(std::max(1, opt_.keep_alive_s));
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (req.path == "/health" || authorized(req.get_header_value("Authorization")))
      return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, ApiError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY')", "",
                             "invalid_api_key"));
    log_request(req, 401, nullptr);
    return httplib::Server::HandlerResponse::Handled;
  });
  http_->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const int st = res.status;
    std::string msg = st == 404 ? "no route for " + req.method + " " + req.path
                      : st == 413 ? "the request body is too large"
                      : st == 405 ? "method not allowed"
                                  : "request failed";
    send_json(res, st, ApiError(st, msg, "", st == 413 ? "request_too_large" : "").body());
  });
  routes();
}

HttpServer::~HttpServer() {
  stop();
  if (worker_) worker_->stop();
}

bool HttpServer::authorized(const std::string& header) const {
  return opt_.api_key.empty() || header == "Bearer " + opt_.api_key;
}

int HttpServer::bind() {
  int port = opt_.port == 0 ? http_->bind_to_any_port(opt_.host)
                            : (http_->bind_to_port(opt_.host, opt_.port) ? opt_.port : -1);
  if (port < 0)
    throw Error("cannot listen on " + opt_.host + ":" + std::to_string(opt_.port) +
                " (address in use or not available)");
  opt_.port = port;
  return port;
}

void HttpServer::listen() { http_->listen_after_bind(); }

void HttpServer::stop() {
  // Running generations end at their next token, so shutdown does not wait for long outputs.
  if (worker_) worker_->cancel_all();
  if (http_) http_->stop();
}

void HttpServer::attach(std::unique_ptr<Engine> engine, std::shared_ptr<const Tokenizer> tok,
                        SamplingDefaults defaults, std::shared_ptr<void> keep_alive) {
  keep_alive_ = std::move(keep_alive);
  tok_ = std::move(tok);
  defaults_ = std::move(defaults);
  ctx_ = engine->context_length();
  worker_ = std::make_unique<Worker>(std::move(engine));
  ready_ = true;
}

void HttpServer::routes() {
  auto guarded = [this](auto fn) {
    return [this, fn](const httplib::Request& req, httplib::Response& res) {
      try {
        if (!ready_) throw ApiError(503, "the model is still loading", "", "model_loading");
        fn(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
        if (worker_) worker_->count_failed_request();
        log_request(req, e.status, nullptr);
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
        log_request(req, 500, nullptr);
      }
    };
  };

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (ready_) send_json(res, 200, {{"status", "ok"}});
    else send_json(res, 503, {{"status", "loading"}, {"error", ApiError(503, "Loading model").body()["error"]}});
  });

  auto models = guarded([this](const httplib::Request&, httplib::Response& res) {
    OJ m = {{"id", opt_.model_name}, {"object", "model"}, {"created", int64_t(std::time(nullptr))},
            {"owned_by", "lily"}, {"max_model_len", ctx_}};
    send_json(res, 200, {{"object", "list"}, {"data", OJ::array({m})}});
  });
  http_->Get("/v1/models", models);
  http_->Get("/models", models);

  http_->Get("/metrics", guarded([this](const httplib::Request&, httplib::Response& res) {
    res.set_content(worker_->metrics_text(), "text/plain; version=0.0.4");
  }));

  http_->Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
    const OJ body = parse_body(req);
    std::string text;
    if (body.contains("messages")) {
      text = render_request_prompt(body, parse_template_options(body));
    } else {
      const char* key = body.contains("content") ? "content" : "prompt";
      if (!body.contains(key) || !body[key].is_string())
        throw bad_request("content", "'content' (or 'prompt') must be a string");
      text = body[key].get<std::string>();
    }
    const bool parse_special = body.value("parse_special", true);
    const auto ids = tok_->encode(text, parse_special);
    OJ out = {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", ctx_}};
    if (body.value("with_pieces", false)) {
      OJ pieces = OJ::array();
      for (int32_t id : ids) pieces.push_back({{"id", id}, {"piece", tok_->token_bytes(id)}});
      out["tokens"] = pieces;
    }
    send_json(res, 200, out);
  }));

  http_->Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
    const OJ body = parse_body(req);
    if (!body.contains("tokens") || !body["tokens"].is_array())
      throw bad_request("tokens", "'tokens' must be a list of token ids");
    std::vector<int32_t> ids;
    for (const auto& x : body["tokens"]) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= tok_->vocab_size())
        throw bad_request("tokens", "token ids must be integers in [0, " + std::to_string(tok_->vocab_size()) + ")");
      ids.push_back(x.get<int32_t>());
    }
    send_json(res, 200, {{"content", tok_->decode(ids, false)}});
  }));

  http_->Post("/apply-template", guarded([](const httplib::Request& req, httplib::Response& res) {
    const OJ body = parse_body(req);
    send_json(res, 200, {{"prompt", render_request_prompt(body, parse_template_options(body))}});
  }));

  auto generation = [this, guarded](bool chat) {
    return guarded([this, chat](const httplib::Request& req, httplib::Response& res) {
      const OJ body = parse_body(req);
      const ApiContext ctx{*tok_, defaults_, opt_.model_name, ctx_};
      auto api = std::make_shared<ApiRequest>(chat ? parse_chat_request(body, ctx)
                                                   : parse_completion_request(body, ctx));
      auto job = std::make_shared<Job>();
      job->req = api->gen;
      job->req.cancel = &job->cancel;
      if (opt_.request_timeout_s > 0)
        job->req.deadline = Clock::now() + std::chrono::milliseconds(int64_t(opt_.request_timeout_s * 1000));
      const std::string id = (chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
      const int64_t created = int64_t(std::time(nullptr));
      worker_->submit(job);

      if (!api->stream) {
        {
          std::unique_lock lk(job->mu);
          job->cv.wait(lk, [&] { return job->done; });
        }
        if (job->error) {   // already counted by the worker
          send_error(res, *job->error);
          log_request(req, job->error->status, nullptr);
          return;
        }
        const OJ out = chat ? chat_response(*api, job->result, id, created, opt_.model_name, *tok_)
                            : completion_response(*api, job->result, id, created, opt_.model_name, *tok_);
        send_json(res, 200, out);
        log_request(req, 200, &job->result);
        return;
      }

      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      const auto ping = std::chrono::milliseconds(int64_t(std::max(0.05, opt_.ping_interval_s) * 1000));
      auto tok = tok_;
      const std::string model = opt_.model_name;
      const httplib::Request* reqp = &req;
      res.set_chunked_content_provider(
          "text/event-stream", [api, job, tok, model, id, created, ping, reqp](size_t, httplib::DataSink& sink) {
            ChunkWriter w(*api, id, created, model, *tok);
            auto send = [&](const std::string& s) {
              if (s.empty()) return true;
              if (sink.write(s.data(), s.size())) return true;
              job->cancel = true;   // the client went away: stop at the next token
              return false;
            };
            if (!send(w.start())) return false;
            while (true) {
              const bool woke = job->wait(ping);
              std::deque<GenerationEvent> evs;
              bool done;
              {
                std::lock_guard lk(job->mu);
                evs.swap(job->events);
                done = job->done;
              }
              for (const auto& ev : evs)
                if (!send(w.on_event(ev))) return false;
              if (!woke && !send(": ping\n\n")) return false;
              if (!done) continue;
              if (job->error) {
                // Streaming already started: the error travels as an SSE event, never a late 500.
                send(sse_event(job->error->body()) + "data: [DONE]\n\n");
                log_request(*reqp, job->error->status, nullptr);
              } else {
                send(w.finish(job->result));
                log_request(*reqp, 200, &job->result);
              }
              sink.done();
              return true;
            }
          });
    });
  };
  http_->Post("/v1/chat/completions", generation(true));
  http_->Post("/chat/completions", generation(true));
  http_->Post("/v1/completions", generation(false));
  http_->Post("/completions", generation(false));
}

}  // namespace lily
