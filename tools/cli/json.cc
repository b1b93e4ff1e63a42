#include "tools/cli/json.h"

#include <cmath>
#include <cstdio>

namespace questkv::cli {

namespace {
std::string Quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}
}  // namespace

void JsonWriter::Key(std::string_view key) {
  if (!first_.back()) out_ += ',';
  first_.back() = false;
  if (!key.empty()) out_ += Quote(key) + ':';
}

JsonWriter& JsonWriter::BeginObject(std::string_view key) {
  Key(key);
  out_ += '{';
  first_.push_back(true);
  return *this;
}
JsonWriter& JsonWriter::EndObject() {
  out_ += '}';
  first_.pop_back();
  return *this;
}
JsonWriter& JsonWriter::BeginArray(std::string_view key) {
  Key(key);
  out_ += '[';
  first_.push_back(true);
  return *this;
}
JsonWriter& JsonWriter::EndArray() {
  out_ += ']';
  first_.pop_back();
  return *this;
}
JsonWriter& JsonWriter::Field(std::string_view key, std::string_view value) {
  Key(key);
  out_ += Quote(value);
  return *this;
}
JsonWriter& JsonWriter::Field(std::string_view key, double value) {
  Key(key);
  if (!std::isfinite(value)) {
    out_ += "null";  // JSON has no NaN/Inf
  } else {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", value);
    out_ += buf;
  }
  return *this;
}
JsonWriter& JsonWriter::Field(std::string_view key, int64_t value) {
  Key(key);
  out_ += std::to_string(value);
  return *this;
}
JsonWriter& JsonWriter::Field(std::string_view key, uint64_t value) {
  Key(key);
  out_ += std::to_string(value);
  return *this;
}
JsonWriter& JsonWriter::Field(std::string_view key, bool value) {
  Key(key);
  out_ += value ? "true" : "false";
  return *this;
}
JsonWriter& JsonWriter::Value(int64_t value) {
  Key({});
  out_ += std::to_string(value);
  return *this;
}

}  // namespace questkv::cli
