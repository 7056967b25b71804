// A one-line byte-progress bar on stderr (shown only when stderr is a terminal).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace lily {

class Progress {
 public:
  // enabled=false (or stderr not a terminal) makes every call a no-op.
  Progress(std::string label, uint64_t total_bytes, bool enabled = true);
  ~Progress();
  void add(uint64_t bytes);   // redraws at most ~10 times a second
  void finish();              // final line with total time and rate; idempotent

 private:
  void draw(bool final);
  std::string label_;
  uint64_t total_ = 0, done_ = 0;
  bool active_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace lily
