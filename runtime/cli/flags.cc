#include "runtime/cli/flags.h"

#include <cerrno>
#include <cstdlib>

namespace questkv::cli {

namespace {
Result<int64_t> ParseInt(const std::string& flag, const std::string& text) {
  if (text.empty()) return Status::InvalidArgument("--" + flag + ": empty value");
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0')
    return Status::InvalidArgument("--" + flag + ": '" + text + "' is not an integer");
  return int64_t(v);
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

Result<std::vector<int64_t>> Flags::IntList(const std::string& name, std::vector<int64_t> fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  std::vector<int64_t> out;
  const std::string& text = it->second;
  if (text.empty() || text == "none") return out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    QKV_ASSIGN_OR_RETURN(int64_t v, ParseInt(name, text.substr(start, comma - start)));
    out.push_back(v);
    start = comma + 1;
  }
  return out;
}

Result<uint64_t> Flags::Bytes(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  std::string text = it->second;
  uint64_t scale = 1;
  if (!text.empty()) {
    const char unit = char(std::toupper(static_cast<unsigned char>(text.back())));
    const std::string units = "KMGT";
    if (const auto pos = units.find(unit); pos != std::string::npos) {
      scale = uint64_t(1) << (10 * (pos + 1));
      text.pop_back();
    }
  }
  QKV_ASSIGN_OR_RETURN(int64_t v, ParseInt(name, text));
  if (v < 0) return Status::InvalidArgument("--" + name + " must not be negative");
  return uint64_t(v) * scale;
}

}  // namespace questkv::cli
