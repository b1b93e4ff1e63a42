// A one-line progress bar on stderr for long phases, drawn only when stderr
// is a terminal (logs and CI stay clean) and redrawn at most ~10 times a second.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace questkv::cli {

class Progress {
 public:
  Progress(std::string label, int64_t total, bool enabled);
  ~Progress();  // finishes the line
  void Update(int64_t done);

 private:
  void Draw(int64_t done);
  std::string label_;
  int64_t total_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_, last_;
  int64_t done_ = 0;
};

}  // namespace questkv::cli
