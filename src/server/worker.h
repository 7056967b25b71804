// The single model worker: requests queue and run one at a time (batch 1) on a thread that owns
// the Engine; HTTP threads wait on their Job and read its events. Also keeps the /metrics counters.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "engine/engine.h"
#include "server/api_error.h"

namespace lily {

struct Job {
  GenerationRequest req;
  std::atomic<bool> cancel{false};

  std::mutex mu;
  std::condition_variable cv;
  std::deque<GenerationEvent> events;   // produced by the worker, drained by the HTTP thread
  bool done = false;
  GenerationResult result;
  std::optional<ApiError> error;

  // Waits until an event is queued or the job is done, at most `timeout`. Returns false on timeout.
  bool wait(std::chrono::milliseconds timeout);
};

struct ServerMetrics {
  int64_t requests = 0, failed = 0, cancelled = 0, timeouts = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  double last_prefill_tps = 0, last_decode_tps = 0;
};

class Worker {
 public:
  explicit Worker(std::unique_ptr<Engine> engine);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void submit(const std::shared_ptr<Job>& job);
  void stop();                       // fails queued jobs, joins the thread
  void cancel_all();                 // cancels the running and queued jobs (shutdown)
  int queue_depth() const;
  std::string metrics_text() const;  // Prometheus exposition format
  void count_failed_request();       // rejected before reaching the queue
  const Engine& engine() const { return *engine_; }

 private:
  void loop();
  void run(Job& job);

  std::unique_ptr<Engine> engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  bool busy_ = false;
  std::shared_ptr<Job> current_;
  ServerMetrics m_;
  EngineStats engine_stats_;          // copied after each request (engine is worker-only)
  std::thread thread_;
};

}  // namespace lily
