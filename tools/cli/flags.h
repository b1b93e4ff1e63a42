// A small strict flag parser for the CLI: `--name value` or `--name=value`,
// bare `--name` for booleans. Unknown flags, missing values and malformed
// numbers are InvalidArgument naming the flag. Numbers are plain: an optional
// '-' and digits (a fraction and exponent for reals), no spaces, no '+'.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "questkv/status.h"

namespace questkv::cli {

class Flags {
 public:
  // `booleans` take no value; every other known flag takes one.
  Flags(std::set<std::string> valued, std::set<std::string> booleans)
      : valued_(std::move(valued)), booleans_(std::move(booleans)) {}

  // Parses argv[1..argc); argv[0] is the subcommand.
  Status Parse(int argc, char** argv);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  Result<std::string> String(const std::string& name, const std::string& fallback) const;
  Result<int64_t> Int(const std::string& name, int64_t fallback, int64_t min, int64_t max) const;
  // A real number in [min, max] ("0.5", "1e-3"); NaN and infinities refused.
  Result<double> Double(const std::string& name, double fallback, double min, double max) const;
  // Comma-separated integers ("0,1"); "" or "none" is the empty list.
  Result<std::vector<int64_t>> IntList(const std::string& name, std::vector<int64_t> fallback) const;
  // Sizes with an optional K/M/G/T suffix (powers of 1024), at most 2^63-1 bytes.
  Result<uint64_t> Bytes(const std::string& name, uint64_t fallback) const;

 private:
  std::set<std::string> valued_, booleans_;
  std::map<std::string, std::string> values_;
};

}  // namespace questkv::cli
