// Persistent worker pool for the CPU backend: one blocking parallel_for over contiguous index ranges.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace lily {

class ThreadPool {
 public:
  // n_threads counts the caller too: n_threads - 1 workers are started. 0 = hardware_concurrency.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(begin, end) over [0, n) split into min(n, size()) contiguous ranges of balanced size;
  // the caller and the workers claim ranges until none is left, so a worker the OS has not
  // scheduled yet costs nothing (the caller takes its range). Blocks until all are done. Nothing is allocated per call. A call made from
  // inside a running parallel_for (any thread of this pool) runs fn(0, n) inline, so ops that nest
  // cannot deadlock. The first exception thrown by fn is rethrown here after every range finished.
  // Calls from different outside threads are serialised.
  void parallel_for(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn);

  // Same for any callable, without wrapping it in a std::function (which allocates when a lambda
  // captures more than two pointers): preferred by overload resolution for lambdas.
  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run(n, [](const void* c, int64_t b, int64_t e) { (*static_cast<Fn*>(const_cast<void*>(c)))(b, e); },
        static_cast<const void*>(&fn));
  }

 private:
  using Call = void (*)(const void* ctx, int64_t begin, int64_t end);
  void run(int64_t n, Call call, const void* ctx);
  void worker_main();
  // Claims and runs ranges of call `seq` until none is left (or that call is over).
  void work_on(uint64_t seq, int chunks);
  void run_range(int index, int chunks);

  int n_threads_ = 1;
  std::vector<std::thread> workers_;

  std::mutex call_mu_;                 // one parallel_for at a time
  std::mutex mu_;                      // guards the sleeping side of wake/done
  std::condition_variable wake_cv_, done_cv_;
  // (call sequence number << 24) | number of ranges of that call; workers watch it. Carrying the
  // range count in the same word lets a worker with no range skip a call without reading anything
  // the next call may already be rewriting.
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> claim_{0};       // (call sequence << 32) | next unclaimed range
  std::atomic<int> done_{0};             // ranges of the current call finished
  bool stop_ = false;

  // The current call (written before generation_ is bumped, read by workers after they see it).
  Call call_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t n_ = 0;

  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace lily
