// Scratch resources for tests: a fresh directory removed when the test ends,
// and 4096-aligned buffers (O_DIRECT I/O needs them).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

namespace questkv::test {

class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "questkv_test_XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr) << "mkdtemp failed";
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<char, FreeDeleter>;
// `bytes` rounded up to a multiple of 4096, 4096-aligned.
inline AlignedBytes AllocateAligned(std::size_t bytes) {
  return AlignedBytes(static_cast<char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)));
}

}  // namespace questkv::test
