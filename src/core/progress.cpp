// Terminal progress bar: "label [#####.....]  42%  812/1930 MB  1450 MB/s".
#include "core/progress.h"

#include <unistd.h>

#include <cstdio>

namespace lily {

Progress::Progress(std::string label, uint64_t total_bytes, bool enabled)
    : label_(std::move(label)), total_(total_bytes), active_(enabled && ::isatty(2)) {
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

Progress::~Progress() { finish(); }

void Progress::add(uint64_t bytes) {
  if (!active_) return;
  done_ += bytes;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  draw(false);
}

void Progress::finish() {
  if (!active_) return;
  draw(true);
  active_ = false;
}

void Progress::draw(bool final) {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double mb = double(done_) / 1e6, total_mb = double(total_) / 1e6;
  const double frac = total_ ? double(done_) / double(total_) : 1.0;
  char bar[31];
  const int filled = int(frac * 30 + 0.5);
  for (int i = 0; i < 30; ++i) bar[i] = i < filled ? '#' : '.';
  bar[30] = 0;
  std::fprintf(stderr, "\r%s [%s] %3d%%  %.0f/%.0f MB  %.0f MB/s%s", label_.c_str(), bar, int(frac * 100 + 0.5),
               mb, total_mb, secs > 0 ? mb / secs : 0.0, final ? "" : "   ");
  if (final) std::fprintf(stderr, "  (%.1f s)\n", secs);
  std::fflush(stderr);
}

}  // namespace lily
