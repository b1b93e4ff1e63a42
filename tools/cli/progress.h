// A one-line progress bar on stderr for long phases, drawn when stderr is a
// terminal and redrawn at most ~10 times a second. Into a log (stderr not a
// terminal) a phase that lasts more than a minute writes one plain line a
// minute, so a long run cut short shows how far it got; short runs, CI and
// tests stay silent.
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
  bool log_;  // stderr is not a terminal: a plain line a minute
  std::chrono::steady_clock::time_point start_, last_;
  int64_t done_ = 0;
};

}  // namespace questkv::cli
