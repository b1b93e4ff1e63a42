// Helpers for the CLI tests: running a subcommand in-process, raw .npy bytes
// built by hand (so malformed files can be written on purpose), plus an
// independent float16 decoding.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/testing/scratch.h"

namespace questkv::test {

// What a CLI subcommand returned and printed.
struct Outcome {
  int code = -1;
  std::string out, err;
};

// Runs a subcommand's main in-process with argv = {name, args...}.
inline Outcome RunCommand(int (*main_fn)(int, char**), const std::string& name, std::vector<std::string> args) {
  args.insert(args.begin(), name);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Outcome o;
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  o.code = main_fn(int(args.size()), argv.data());
  std::fflush(stdout);
  o.out = testing::internal::GetCapturedStdout();
  o.err = testing::internal::GetCapturedStderr();
  return o;
}

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

inline std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Magic + version + length + header text exactly as given (no padding added),
// so tests control every byte.
inline std::string NpyPreamble(const std::string& header, int major = 1, int minor = 0) {
  std::string s("\x93NUMPY", 6);
  s += char(major);
  s += char(minor);
  const uint32_t n = uint32_t(header.size());
  s += char(n & 0xff);
  s += char((n >> 8) & 0xff);
  if (major >= 2) {
    s += char((n >> 16) & 0xff);
    s += char((n >> 24) & 0xff);
  }
  return s + header;
}

// A well-formed file: the dict NumPy writes, padded to 64 bytes, then payload.
inline std::string NpyFile(const std::string& descr, const std::string& shape, const std::string& payload,
                           int major = 1, bool fortran = false) {
  std::string h = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                  ", 'shape': " + shape + ", }";
  const std::size_t pre = major >= 2 ? 12 : 10;
  while ((pre + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  return NpyPreamble(h, major) + payload;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// binary16 -> double from the definition, independent of the code under test:
// (-1)^s · 2^(e−15) · (1 + m/1024), subnormals 2^−14 · m/1024; NaN for e = 31
// with m != 0.
inline double HalfBitsToDoubleByDefinition(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double sign = s ? -1.0 : 1.0;
  if (e == 31) return m ? std::nan("") : sign * HUGE_VAL;
  if (e == 0) return sign * std::ldexp(double(m), -24);
  return sign * std::ldexp(1024.0 + m, e - 25);
}

}  // namespace questkv::test
