// ThreadPool: every index is visited exactly once in contiguous balanced ranges, for uneven splits,
// n smaller than the pool, nested and concurrent calls, and exceptions.
#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace lily {
namespace {

struct Ranges {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> seen;
};

void check_cover(ThreadPool& pool, int64_t n) {
  std::vector<std::atomic<int>> hits(size_t(std::max<int64_t>(n, 1)));
  for (auto& h : hits) h = 0;
  Ranges rs;
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    {
      std::lock_guard<std::mutex> lk(rs.mu);
      rs.seen.emplace_back(b, e);
    }
    for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "index " << i << " n=" << n;
  if (n <= 0) {
    EXPECT_TRUE(rs.seen.empty());
    return;
  }
  const size_t expect_calls = size_t(std::min<int64_t>(n, pool.size()));
  ASSERT_EQ(rs.seen.size(), expect_calls) << "n=" << n << " threads=" << pool.size();
  std::sort(rs.seen.begin(), rs.seen.end());
  int64_t next = 0, lo = n, hi = 0;
  for (auto [b, e] : rs.seen) {
    EXPECT_EQ(b, next);
    EXPECT_LT(b, e) << "empty range";
    lo = std::min(lo, e - b);
    hi = std::max(hi, e - b);
    next = e;
  }
  EXPECT_EQ(next, n);
  EXPECT_LE(hi - lo, 1) << "unbalanced split of " << n << " over " << pool.size();
}

TEST(ThreadPool, SizeCountsCaller) {
  EXPECT_EQ(ThreadPool(3).size(), 3);
  EXPECT_EQ(ThreadPool(1).size(), 1);
  EXPECT_EQ(ThreadPool(0).size(), int(std::max(1u, std::thread::hardware_concurrency())));
}

TEST(ThreadPool, CoversEveryIndexOnceWithUnevenSplits) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 3, 5, 7, 8, 9, 100, 1001}) check_cover(pool, n);
  }
}

TEST(ThreadPool, ManyConsecutiveCalls) {
  ThreadPool pool(4);
  std::atomic<int64_t> total{0};
  const int calls = 20000;
  for (int c = 0; c < calls; ++c) {
    const int64_t n = 1 + c % 13;
    pool.parallel_for(n, [&](int64_t b, int64_t e) {
      int64_t s = 0;
      for (int64_t i = b; i < e; ++i) s += i + 1;
      total += s;
    });
  }
  int64_t expect = 0;
  for (int c = 0; c < calls; ++c) {
    const int64_t n = 1 + c % 13;
    expect += n * (n + 1) / 2;
  }
  EXPECT_EQ(total.load(), expect);
}

TEST(ThreadPool, NestedCallRunsInline) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(30 * 17);
  for (auto& h : hits) h = 0;
  pool.parallel_for(30, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(17, [&](int64_t b2, int64_t e2) {
        for (int64_t k = b2; k < e2; ++k) hits[size_t(i * 17 + k)]++;
      });
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(3);
  std::atomic<int64_t> a{0}, b{0};
  auto caller = [&](std::atomic<int64_t>& sum) {
    for (int c = 0; c < 2000; ++c)
      pool.parallel_for(10, [&](int64_t lo, int64_t hi) { sum += hi - lo; });
  };
  std::thread t1(caller, std::ref(a)), t2(caller, std::ref(b));
  t1.join();
  t2.join();
  EXPECT_EQ(a.load(), 20000);
  EXPECT_EQ(b.load(), 20000);
}

TEST(ThreadPool, StdFunctionAndLargeCaptures) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  const std::function<void(int64_t, int64_t)> f = [&](int64_t b, int64_t e) { sum += e - b; };
  pool.parallel_for(10, f);
  EXPECT_EQ(sum.load(), 10);
  // A lambda holding more than std::function's small buffer, captured by value and mutable.
  const int64_t a = 1, b = 2, c = 3, d = 4, e = 5;
  std::vector<std::atomic<int64_t>> out(7);
  pool.parallel_for(7, [=, &out](int64_t lo, int64_t hi) mutable {
    for (int64_t i = lo; i < hi; ++i) out[size_t(i)] = a + b + c + d + e + i;
  });
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(out[size_t(i)].load(), 15 + i);
}

TEST(ThreadPool, ExceptionReachesCallerAndPoolStaysUsable) {
  ThreadPool pool(4);
  EXPECT_THROW(pool.parallel_for(100,
                                 [&](int64_t b, int64_t e) {
                                   if (b <= 60 && 60 < e) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  check_cover(pool, 57);
}

}  // namespace
}  // namespace lily
