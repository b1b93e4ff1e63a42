// A minimal JSON writer for the CLI's reports: objects, arrays, numbers,
// strings, booleans, with commas placed automatically. Not a parser.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace questkv::cli {

class JsonWriter {
 public:
  JsonWriter& BeginObject(std::string_view key = {});
  JsonWriter& EndObject();
  JsonWriter& BeginArray(std::string_view key = {});
  JsonWriter& EndArray();
  JsonWriter& Field(std::string_view key, std::string_view value);
  JsonWriter& Field(std::string_view key, const char* value) { return Field(key, std::string_view(value)); }
  JsonWriter& Field(std::string_view key, double value);
  JsonWriter& Field(std::string_view key, int64_t value);
  JsonWriter& Field(std::string_view key, int value) { return Field(key, int64_t(value)); }
  JsonWriter& Field(std::string_view key, uint64_t value);
  JsonWriter& Field(std::string_view key, bool value);
  JsonWriter& Value(int64_t value);  // array element

  const std::string& str() const { return out_; }

 private:
  void Key(std::string_view key);
  std::string out_;
  std::vector<bool> first_{true};
};

}  // namespace questkv::cli
