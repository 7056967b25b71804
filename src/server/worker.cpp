// Single-threaded model worker and metrics (see worker.h).
#include "server/worker.h"

#include <sstream>

#include "core/common.h"

namespace lily {

bool Job::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu);
  return cv.wait_for(lk, timeout, [&] { return done || !events.empty(); });
}

Worker::Worker(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {
  engine_stats_ = engine_->stats();
  thread_ = std::thread([this] { loop(); });
}

Worker::~Worker() { stop(); }

void Worker::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard lk(mu_);
    if (!stopping_) {
      queue_.push_back(job);
      cv_.notify_one();
      return;
    }
  }
  std::lock_guard lk(job->mu);
  job->error = ApiError(503, "the server is shutting down");
  job->done = true;
  job->cv.notify_all();
}

void Worker::stop() {
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard lk(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    left.swap(queue_);
    cv_.notify_all();
  }
  for (auto& job : left) {
    std::lock_guard lk(job->mu);
    job->error = ApiError(503, "the server is shutting down");
    job->done = true;
    job->cv.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void Worker::cancel_all() {
  std::lock_guard lk(mu_);
  for (auto& job : queue_) job->cancel = true;
  if (current_) current_->cancel = true;
}

int Worker::queue_depth() const {
  std::lock_guard lk(mu_);
  return int(queue_.size()) + (busy_ ? 1 : 0);
}

void Worker::count_failed_request() {
  std::lock_guard lk(mu_);
  ++m_.requests;
  ++m_.failed;
}

void Worker::loop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job = queue_.front();
      queue_.pop_front();
      busy_ = true;
      current_ = job;
    }
    run(*job);
    std::lock_guard lk(mu_);
    busy_ = false;
    current_.reset();
  }
}

void Worker::run(Job& job) {
  GenerationResult r;
  std::optional<ApiError> err;
  try {
    if (job.cancel.load()) {
      r.finish_reason = "cancelled";
    } else {
      r = engine_->generate(job.req, [&](const GenerationEvent& ev) {
        std::lock_guard lk(job.mu);
        job.events.push_back(ev);
        job.cv.notify_all();
      });
    }
  } catch (const Error& e) {
    err = ApiError(400, e.what());
  } catch (const std::exception& e) {
    err = ApiError(500, std::string("generation failed: ") + e.what());
  }
  if (!err && r.finish_reason == "timeout")
    err = ApiError(504, "the request timed out", "", "timeout");
  // Only a client that went away or a shutdown cancels; neither has a reader for a normal result.
  const bool cancelled = !err && r.finish_reason == "cancelled";
  if (cancelled) err = ApiError(503, "the request was cancelled (client disconnected or server shutting down)");
  {
    std::lock_guard lk(mu_);
    ++m_.requests;
    if (err && !cancelled) ++m_.failed;
    if (cancelled) ++m_.cancelled;
    if (r.finish_reason == "timeout") ++m_.timeouts;
    m_.prompt_tokens += r.prompt_tokens;
    m_.cached_tokens += r.cached_tokens;
    m_.completion_tokens += r.completion_tokens;
    const int prefilled = r.prompt_tokens - r.cached_tokens;
    if (prefilled > 0 && r.prefill_seconds > 0) m_.last_prefill_tps = prefilled / r.prefill_seconds;
    if (r.completion_tokens > 1 && r.decode_seconds > 0)
      m_.last_decode_tps = (r.completion_tokens - 1) / r.decode_seconds;
    engine_stats_ = engine_->stats();
  }
  std::lock_guard lk(job.mu);
  job.result = std::move(r);
  job.error = std::move(err);
  job.done = true;
  job.cv.notify_all();
}

std::string Worker::metrics_text() const {
  std::lock_guard lk(mu_);
  std::ostringstream o;
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n'
      << name << ' ' << v << '\n';
  };
  const EngineStats& s = engine_stats_;
  metric("lily_requests_total", "counter", "Generation requests handled.", double(m_.requests));
  metric("lily_requests_failed_total", "counter", "Requests that ended in an error.", double(m_.failed));
  metric("lily_requests_cancelled_total", "counter", "Requests cancelled by client disconnect.",
         double(m_.cancelled));
  metric("lily_requests_timeout_total", "counter", "Requests past their deadline.", double(m_.timeouts));
  metric("lily_prompt_tokens_total", "counter", "Prompt tokens of all requests.", double(m_.prompt_tokens));
  metric("lily_prompt_tokens_cached_total", "counter", "Prompt tokens restored from the session cache.",
         double(m_.cached_tokens));
  metric("lily_prefill_tokens_total", "counter", "Prompt tokens run through the model.",
         double(s.prefill_tokens));
  metric("lily_generation_tokens_total", "counter", "Generated tokens.", double(m_.completion_tokens));
  metric("lily_prefill_seconds_total", "counter", "Time spent in prefill.", s.prefill_seconds);
  metric("lily_decode_seconds_total", "counter", "Time spent in decode.", s.decode_seconds);
  metric("lily_prefill_tokens_per_second", "gauge", "Prefill throughput of the last request.",
         m_.last_prefill_tps);
  metric("lily_decode_tokens_per_second", "gauge", "Decode throughput of the last request.",
         m_.last_decode_tps);
  metric("lily_cache_hits_total", "counter", "Session snapshot lookups that found a prefix.",
         double(s.cache.hits));
  metric("lily_cache_misses_total", "counter", "Session snapshot lookups without a prefix.",
         double(s.cache.misses));
  metric("lily_cache_snapshots", "gauge", "Session snapshots held.", double(s.cache.snapshots));
  metric("lily_cache_bytes", "gauge", "Bytes held by session snapshots.", double(s.cache.bytes));
  metric("lily_cache_evictions_total", "counter", "Snapshots evicted (LRU).", double(s.cache.evicted));
  metric("lily_queue_depth", "gauge", "Requests queued or running.",
         double(queue_.size() + (busy_ ? 1 : 0)));
  return o.str();
}

}  // namespace lily
