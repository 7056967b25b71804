// ThreadPool: workers spin briefly on a generation counter (decode issues hundreds of small ops per
// token, so waking through the kernel each time would dominate), then sleep on a condition variable.
#include "core/thread_pool.h"

#include <algorithm>
#include <string>

#include "core/common.h"

namespace lily {

namespace {

// Pool whose parallel_for is running on this thread (worker or caller); nested calls run inline.
thread_local const ThreadPool* tl_active_pool = nullptr;

// About 50-200 µs of polling before sleeping: covers the gap between consecutive ops of one decode
// step without burning a core while the engine is idle.
constexpr int kSpinIters = 2000;

// generation_ layout: call sequence above kChunkBits, range count below.
constexpr uint64_t kChunkBits = 24, kChunkMask = (uint64_t(1) << kChunkBits) - 1;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  LILY_CHECK(n_threads < (1 << 24), "thread count " + std::to_string(n_threads) + " too large");
  n_threads_ = n_threads;
  workers_.reserve(size_t(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker_main(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_range(int index, int chunks) {
  const int64_t begin = n_ * index / chunks, end = n_ * (index + 1) / chunks;
  try {
    call_(ctx_, begin, end);
  } catch (...) {
    std::lock_guard<std::mutex> lk(error_mu_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::work_on(uint64_t seq, int chunks) {
  const uint64_t tag = seq & 0xffffffffu;
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if ((c >> 32) != tag || int(c & 0xffffffffu) >= chunks) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire))
      continue;
    // The call cannot finish before this range is counted done, so call_, ctx_, n_ stay valid.
    run_range(int(c & 0xffffffffu), chunks);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
      std::lock_guard<std::mutex> lk(mu_);
      done_cv_.notify_one();
    }
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_main() {
  tl_active_pool = this;
  uint64_t seen = 0;
  for (;;) {
    uint64_t g = generation_.load(std::memory_order_acquire);
    for (int i = 0; g == seen && i < kSpinIters; ++i) {
      cpu_relax();
      g = generation_.load(std::memory_order_acquire);
    }
    if (g == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      wake_cv_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
      if (stop_) return;
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    work_on(g >> kChunkBits, int(g & kChunkMask));
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  run(n, [](const void* c, int64_t b, int64_t e) { (*static_cast<const std::function<void(int64_t, int64_t)>*>(c))(b, e); },
      &fn);
}

void ThreadPool::run(int64_t n, Call call, const void* ctx) {
  if (n <= 0) return;
  if (n_threads_ == 1 || n == 1 || tl_active_pool == this) {
    call(ctx, 0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lk(call_mu_);
  call_ = call;
  ctx_ = ctx;
  n_ = n;
  const int chunks = int(std::min<int64_t>(n, n_threads_));
  error_ = nullptr;
  done_.store(0, std::memory_order_relaxed);
  const uint64_t seq = (generation_.load(std::memory_order_relaxed) >> kChunkBits) + 1;
  claim_.store((seq & 0xffffffffu) << 32, std::memory_order_release);
  {
    // Published under mu_ so a worker between its predicate check and its wait cannot miss it.
    std::lock_guard<std::mutex> lk(mu_);
    generation_.store((seq << kChunkBits) | uint64_t(chunks), std::memory_order_release);
  }
  wake_cv_.notify_all();

  const ThreadPool* outer = tl_active_pool;
  tl_active_pool = this;
  work_on(seq, chunks);
  tl_active_pool = outer;

  for (int i = 0; done_.load(std::memory_order_acquire) != chunks && i < kSpinIters; ++i) cpu_relax();
  if (done_.load(std::memory_order_acquire) != chunks) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == chunks; });
  }
  call_ = nullptr;
  ctx_ = nullptr;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace lily
