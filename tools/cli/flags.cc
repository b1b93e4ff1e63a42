#include "tools/cli/flags.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

namespace questkv::cli {

namespace {
// Exactly an optional '-' and decimal digits: no whitespace, no '+', nothing
// after, so "16 " or "+16" is a typo to report, not a value to guess at.
Result<int64_t> ParseInt(const std::string& flag, const std::string& text) {
  if (text.empty()) return Status::InvalidArgument("--" + flag + ": empty value");
  int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc::result_out_of_range)
    return Status::InvalidArgument("--" + flag + ": '" + text + "' is outside the 64-bit integer range");
  if (ec != std::errc() || ptr != end)
    return Status::InvalidArgument("--" + flag + ": '" + text + "' is not an integer");
  return v;
}

// A bound as a user would write it: "1", "0.5", "1e+06".
std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

Status Flags::Parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) return Status::InvalidArgument("unexpected argument '" + arg + "'");
    arg = arg.substr(2);
    std::string value;
    const auto eq = arg.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (values_.count(arg)) return Status::InvalidArgument("--" + arg + " given twice");
    if (booleans_.count(arg)) {
      if (inline_value) return Status::InvalidArgument("--" + arg + " takes no value");
      values_[arg] = "1";
    } else if (valued_.count(arg)) {
      if (!inline_value) {
        if (i + 1 >= argc) return Status::InvalidArgument("--" + arg + " needs a value");
        value = argv[++i];
      }
      values_[arg] = value;
    } else {
      return Status::InvalidArgument("unknown flag --" + arg);
    }
  }
  return Status::Ok();
}

Result<std::string> Flags::String(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

Result<int64_t> Flags::Int(const std::string& name, int64_t fallback, int64_t min, int64_t max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  QKV_ASSIGN_OR_RETURN(int64_t v, ParseInt(name, it->second));
  if (v < min || v > max)
    return Status::InvalidArgument("--" + name + " = " + std::to_string(v) + " is outside " + std::to_string(min) +
                                   ".." + std::to_string(max));
  return v;
}

Result<double> Flags::Double(const std::string& name, double fallback, double min, double max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& text = it->second;
  double v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end || !std::isfinite(v))
    return Status::InvalidArgument("--" + name + ": '" + text + "' is not a number");
  if (v < min || v > max)
    return Status::InvalidArgument("--" + name + " = " + text + " is outside " + Number(min) + ".." + Number(max));
  return v;
}

Result<std::vector<int64_t>> Flags::IntList(const std::string& name, std::vector<int64_t> fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  std::vector<int64_t> out;
  const std::string& text = it->second;
  if (text.empty() || text == "none") return out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    if (comma == start) return Status::InvalidArgument("--" + name + ": empty item in '" + text + "'");
    const std::string item = text.substr(start, comma - start);
    Result<int64_t> v = ParseInt(name, item);
    if (!v.ok()) return Status::InvalidArgument("--" + name + ": '" + item + "' in '" + text + "' is not an integer");
    out.push_back(*v);
    start = comma + 1;
  }
  return out;
}

Result<uint64_t> Flags::Bytes(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& given = it->second;
  std::string digits = given;
  uint64_t scale = 1;
  if (!digits.empty()) {
    const char unit = char(std::toupper(static_cast<unsigned char>(digits.back())));
    const std::string units = "KMGT";
    if (const auto pos = units.find(unit); pos != std::string::npos) {
      scale = uint64_t(1) << (10 * (pos + 1));
      digits.pop_back();
    }
  }
  // Byte counts travel as int64 (reports, tier accounting): a larger size
  // is refused rather than wrapped.
  const Status too_large = Status::InvalidArgument("--" + name + " " + given + " is more than 2^63-1 bytes");
  const bool all_digits = !digits.empty() && std::all_of(digits.begin(), digits.end(), [](char c) {
    return c >= '0' && c <= '9';
  });
  Result<int64_t> v = ParseInt(name, digits);
  if (!v.ok() && all_digits) return too_large;
  if (!v.ok()) return Status::InvalidArgument("--" + name + ": '" + given + "' is not a size (digits, then K, M, G or T)");
  if (*v < 0) return Status::InvalidArgument("--" + name + " must not be negative");
  if (uint64_t(*v) > uint64_t(std::numeric_limits<int64_t>::max()) / scale) return too_large;
  return uint64_t(*v) * scale;
}

}  // namespace questkv::cli
