#include "tools/cli/progress.h"

#include <unistd.h>

#include <cstdio>

namespace questkv::cli {

Progress::Progress(std::string label, int64_t total, bool enabled)
    : label_(std::move(label)), total_(total > 0 ? total : 1), enabled_(enabled && isatty(STDERR_FILENO)),
      log_(enabled && !enabled_), start_(std::chrono::steady_clock::now()), last_(start_) {}

Progress::~Progress() {
  if (!enabled_) return;
  Draw(total_);
  std::fputc('\n', stderr);
}

void Progress::Update(int64_t done) {
  done_ = done;
  if (log_) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::seconds(60)) return;
    last_ = now;
    std::fprintf(stderr, "%s: %.1f%% after %.0f s\n", label_.c_str(), 100.0 * double(done) / double(total_),
                 std::chrono::duration<double>(now - start_).count());
    std::fflush(stderr);
    return;
  }
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  Draw(done);
}

void Progress::Draw(int64_t done) {
  constexpr int kWidth = 30;
  const double frac = double(done) / double(total_);
  const int filled = int(frac * kWidth);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\r%-10s [%s] %5.1f%% %6.1fs", label_.c_str(), bar.c_str(), 100 * frac, secs);
  std::fflush(stderr);
}

}  // namespace questkv::cli
