// tools/npy: round trips, the exact float16 widening, and every kind of
// malformed file the reader must refuse with a message naming the file.
#include "core/half.h"
#include "tools/npy.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "tests/tools/cli_test_files.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

using test::Bytes;
using test::NpyFile;
using test::NpyPreamble;
using test::ScratchDir;
using test::WriteBytes;

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(NpyTest, F32RoundTripIsBitExactForEveryRank) {
  ScratchDir dir;
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {1}, {7}, {2, 3}, {0, 5}, {2, 3, 4}, {1, 1, 1, 1, 1, 7}};
  uint64_t seed = 1;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> data = test::RandomNormal(std::size_t(n), seed++);
    const float specials[] = {0.f, -0.f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                              std::numeric_limits<float>::max()};
    for (std::size_t i = 0; i < data.size() && i < std::size(specials); ++i) data[i] = specials[i];
    const std::string path = dir / "a.npy";
    ASSERT_TRUE(WriteNpyF32(path, shape, data).ok());
    Result<NpyArray> a = ReadNpy(path);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->dtype, NpyDType::kF32);
    EXPECT_EQ(a->shape, shape);
    EXPECT_EQ(a->elements(), n);
    EXPECT_TRUE(a->i32.empty());
    ASSERT_EQ(a->f32.size(), data.size());
    for (std::size_t i = 0; i < data.size(); ++i) EXPECT_EQ(Bits(a->f32[i]), Bits(data[i])) << "element " << i;
  }
}

TEST(NpyTest, I32RoundTrip) {
  ScratchDir dir;
  const std::vector<int32_t> data = {0, -1, 1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                                     42};
  const std::vector<int64_t> shape = {2, 3};
  ASSERT_TRUE(WriteNpyI32(dir / "i.npy", shape, data).ok());
  Result<NpyArray> a = ReadNpy(dir / "i.npy");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->dtype, NpyDType::kI32);
  EXPECT_EQ(a->shape, shape);
  EXPECT_EQ(a->i32, data);
  EXPECT_TRUE(a->f32.empty());
}

TEST(NpyTest, WrittenHeaderIsWhatNumpyWrites) {
  ScratchDir dir;
  const std::vector<float> data(6, 1.f);
  const std::vector<int64_t> shape = {2, 3};
  ASSERT_TRUE(WriteNpyF32(dir / "h.npy", shape, data).ok());
  const std::string bytes = ReadAll(dir / "h.npy");
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const std::size_t len = uint8_t(bytes[8]) | std::size_t(uint8_t(bytes[9])) << 8;
  EXPECT_EQ((10 + len) % 64, 0u);
  ASSERT_EQ(bytes.size(), 10 + len + data.size() * 4);
  const std::string header = bytes.substr(10, len);
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 0), 0u) << header;
  EXPECT_EQ(header.back(), '\n');

  ASSERT_TRUE(WriteNpyF32(dir / "r1.npy", std::vector<int64_t>{5}, std::vector<float>(5)).ok());
  EXPECT_NE(ReadAll(dir / "r1.npy").find("'shape': (5,)"), std::string::npos);
  ASSERT_TRUE(WriteNpyF32(dir / "r0.npy", std::vector<int64_t>{}, std::vector<float>(1)).ok());
  EXPECT_NE(ReadAll(dir / "r0.npy").find("'shape': ()"), std::string::npos);
}

TEST(NpyTest, ReadsVersions2And3AndHeaderSpellings) {
  ScratchDir dir;
  const std::vector<float> data = {1.5f, -2.f, 3.25f};
  struct Case {
    std::string name, bytes;
  };
  const std::vector<Case> cases = {
      {"v2", NpyFile("<f4", "(3,)", Bytes(data), 2)},
      {"v3", NpyFile("<f4", "(3,)", Bytes(data), 3)},
      {"double quotes, other key order, no trailing comma",
       NpyPreamble("{\"shape\": (3,), \"fortran_order\": False, \"descr\": \"<f4\"}\n") + Bytes(data)},
      {"tight spacing, no padding, no newline", NpyPreamble("{'descr':'<f4','fortran_order':False,'shape':(3,)}") + Bytes(data)},
      {"spaces inside the tuple", NpyPreamble("{'descr': '<f4', 'fortran_order': False, 'shape': ( 3 , ) }  \n") + Bytes(data)},
      {"2-D written as (1,3)", NpyPreamble("{'descr': '<f4', 'fortran_order': False, 'shape': (1,3)}\n") + Bytes(data)},
  };
  for (const Case& c : cases) {
    WriteBytes(dir / "v.npy", c.bytes);
    Result<NpyArray> a = ReadNpy(dir / "v.npy");
    ASSERT_TRUE(a.ok()) << c.name << ": " << a.status().ToString();
    EXPECT_EQ(a->f32, data) << c.name;
    EXPECT_EQ(a->elements(), 3) << c.name;
  }
}

TEST(NpyTest, HalfWideningIsExactForAll65536Patterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = uint16_t(b);
    const float got = HalfBitsToFloat(h);
    const double want = test::HalfBitsToDoubleByDefinition(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << b;
      ASSERT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << b;
      ASSERT_EQ((Bits(got) >> 13) & 0x3ff, h & 0x3ffu) << "NaN payload lost for " << std::hex << b;
    } else {
      // Every binary16 value is a binary32 value, so equality must be exact,
      // the sign of zero included.
      ASSERT_EQ(double(got), want) << std::hex << b;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << b;
    }
#if defined(__FLT16_MANT_DIG__)
    // A second, compiler-provided conversion.
    const _Float16 f16 = std::bit_cast<_Float16>(h);
    if (!std::isnan(want)) {
      ASSERT_EQ(Bits(got), Bits(float(f16))) << std::hex << b;
    }
#endif
  }
}

TEST(NpyTest, HalfFileReadsEveryPatternExactly) {
  ScratchDir dir;
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = uint16_t(b);
  WriteBytes(dir / "h.npy", NpyFile("<f2", "(256, 256)", Bytes(all)));
  Result<NpyArray> a = ReadNpy(dir / "h.npy");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->dtype, NpyDType::kF16);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{256, 256}));
  ASSERT_EQ(a->f32.size(), 65536u);
  int mismatches = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const double want = test::HalfBitsToDoubleByDefinition(uint16_t(b));
    const float got = a->f32[b];
    const bool same = std::isnan(want) ? std::isnan(got) : (double(got) == want && std::signbit(got) == std::signbit(want));
    mismatches += !same;
  }
  EXPECT_EQ(mismatches, 0);
}

struct BadFile {
  const char* name;
  std::string bytes;
  Code code;
  const char* message;  // expected substring
};

std::vector<BadFile> BadFiles() {
  const std::string f6 = Bytes(std::vector<float>(6, 1.f));
  const auto header = [](const std::string& dict) { return NpyPreamble(dict + "\n"); };
  std::string rank65 = "(";
  for (int i = 0; i < 65; ++i) rank65 += "1, ";
  rank65 += ")";
  return {
      {"empty", "", Code::kCorruption, "too short"},
      {"short preamble", std::string("\x93NUMPY\x01", 7), Code::kCorruption, "too short"},
      {"bad magic", "\x93NUMPZ" + NpyFile("<f4", "(6,)", f6).substr(6), Code::kCorruption, "bad magic"},
      {"text file", "descr,shape\n1,2,3,4,5,6\n", Code::kCorruption, "bad magic"},
      {"version 4.0", NpyFile("<f4", "(6,)", f6).replace(6, 1, 1, '\x04'), Code::kCorruption, "version 4.0"},
      {"version 1.1", NpyFile("<f4", "(6,)", f6).replace(7, 1, 1, '\x01'), Code::kCorruption, "version 1.1"},
      {"header length past the end", NpyPreamble("{'descr': '<f4'").substr(0, 10) + "{'descr'", Code::kCorruption,
       "truncated .npy header"},
      {"v2 header length past the end", std::string("\x93NUMPY\x02\x00\xff\xff\x00\x00{", 13), Code::kCorruption,
       "truncated .npy header"},
      {"implausible header length", std::string("\x93NUMPY\x02\x00\x00\x00\x00\x7f{", 13), Code::kCorruption,
       "implausibly large"},
      {"not a dict", header("['descr', '<f4']") + f6, Code::kCorruption, "does not start with"},
      {"garbage", header("\x01\x02garbage") + f6, Code::kCorruption, "malformed .npy header"},
      {"NUL in header", NpyPreamble("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }" + std::string(1, '\0') + "\n") + f6,
       Code::kCorruption, "NUL"},
      {"missing shape", header("{'descr': '<f4', 'fortran_order': False}") + f6, Code::kCorruption, "missing key 'shape'"},
      {"missing descr", header("{'fortran_order': False, 'shape': (6,)}") + f6, Code::kCorruption, "missing key 'descr'"},
      {"missing fortran_order", header("{'descr': '<f4', 'shape': (6,)}") + f6, Code::kCorruption,
       "missing key 'fortran_order'"},
      {"unknown key", header("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}") + f6,
       Code::kCorruption, "unexpected key 'x'"},
      {"duplicate key", header("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}") + f6,
       Code::kCorruption, "appears twice"},
      {"lower-case bool", header("{'descr': '<f4', 'fortran_order': false, 'shape': (6,)}") + f6, Code::kCorruption,
       "True or False"},
      {"(6) is not a tuple", header("{'descr': '<f4', 'fortran_order': False, 'shape': (6)}") + f6, Code::kCorruption,
       "not a tuple"},
      {"shape as list", header("{'descr': '<f4', 'fortran_order': False, 'shape': [6]}") + f6, Code::kCorruption,
       "must be a tuple"},
      {"negative dim", header("{'descr': '<f4', 'fortran_order': False, 'shape': (-6,)}") + f6, Code::kCorruption,
       "negative dimension"},
      {"float dim", header("{'descr': '<f4', 'fortran_order': False, 'shape': (6.0,)}") + f6, Code::kCorruption,
       "expected ',' or ')'"},
      {"text dim", header("{'descr': '<f4', 'fortran_order': False, 'shape': ('6',)}") + f6, Code::kCorruption,
       "tuple of integers"},
      {"unterminated string", header("{'descr': '<f4, 'fortran_order': False, 'shape': (6,)}") + f6,
       Code::kCorruption, "malformed"},
      {"unterminated dict", header("{'descr': '<f4', 'fortran_order': False, 'shape': (6,)") + f6, Code::kCorruption,
       "expected ',' or '}'"},
      {"text after dict", header("{'descr': '<f4', 'fortran_order': False, 'shape': (6,)} x") + f6, Code::kCorruption,
       "after the closing"},
      {"escape in string", header("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (6,)}") + f6,
       Code::kCorruption, "escape"},
      {"dim overflows int64", header("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}") + f6,
       Code::kCorruption, "overflows int64"},
      {"shape product overflows", header("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}") + f6,
       Code::kCorruption, "overflows"},
      {"byte size overflows", header("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904,)}") + f6,
       Code::kCorruption, "overflows"},
      {"huge shape, small file", NpyFile("<f4", "(1099511627776,)", f6), Code::kCorruption, "truncated data"},
      {"truncated data", NpyFile("<f4", "(2, 3)", f6.substr(0, 23)), Code::kCorruption, "truncated data"},
      {"no data", NpyFile("<f4", "(2, 3)", ""), Code::kCorruption, "truncated data"},
      {"trailing bytes", NpyFile("<f4", "(2, 3)", f6 + "x"), Code::kCorruption, "1 trailing bytes"},
      {"f16 with f32 payload", NpyFile("<f2", "(2, 3)", f6), Code::kCorruption, "12 trailing bytes"},
      {"fortran order", NpyFile("<f4", "(2, 3)", f6, 1, true), Code::kInvalidArgument, "Fortran"},
      {"big-endian f4", NpyFile(">f4", "(2, 3)", f6), Code::kInvalidArgument, "big-endian"},
      {"big-endian i4", NpyFile(">i4", "(2, 3)", f6), Code::kInvalidArgument, "big-endian"},
      {"float64", NpyFile("<f8", "(3,)", f6), Code::kInvalidArgument, "unsupported dtype '<f8'"},
      {"int64", NpyFile("<i8", "(3,)", f6), Code::kInvalidArgument, "unsupported dtype '<i8'"},
      {"uint8", NpyFile("|u1", "(24,)", f6), Code::kInvalidArgument, "unsupported dtype '|u1'"},
      {"bool", NpyFile("|b1", "(24,)", f6), Code::kInvalidArgument, "unsupported dtype"},
      {"complex", NpyFile("<c8", "(3,)", f6), Code::kInvalidArgument, "unsupported dtype"},
      {"numpy-native name", NpyFile("float32", "(6,)", f6), Code::kInvalidArgument, "unsupported dtype"},
      {"structured", header("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,)}") + f6,
       Code::kInvalidArgument, "structured"},
      {"rank 65", NpyFile("<f4", rank65, Bytes(std::vector<float>(1))), Code::kInvalidArgument, "rank above 64"},
  };
}

TEST(NpyTest, RefusesEveryMalformedFileNamingIt) {
  ScratchDir dir;
  for (const BadFile& bad : BadFiles()) {
    const std::string path = dir / "bad.npy";
    WriteBytes(path, bad.bytes);
    Result<NpyArray> a = ReadNpy(path);
    ASSERT_FALSE(a.ok()) << bad.name << " was accepted";
    EXPECT_EQ(a.status().code(), bad.code) << bad.name << ": " << a.status().ToString();
    EXPECT_NE(a.status().message().find(path), std::string::npos) << bad.name << ": " << a.status().ToString();
    EXPECT_NE(a.status().message().find(bad.message), std::string::npos)
        << bad.name << ": expected '" << bad.message << "' in " << a.status().ToString();
  }
}

TEST(NpyTest, RefusesWhatIsNotAReadableFile) {
  ScratchDir dir;
  Result<NpyArray> missing = ReadNpy(dir / "missing.npy");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kIOError);
  EXPECT_NE(missing.status().message().find("missing.npy"), std::string::npos);
  EXPECT_NE(missing.status().message().find("No such file"), std::string::npos) << missing.status().ToString();

  std::filesystem::create_directory(dir / "d.npy");
  Result<NpyArray> directory = ReadNpy(dir / "d.npy");
  ASSERT_FALSE(directory.ok());
  EXPECT_EQ(directory.status().code(), Code::kIOError);
  EXPECT_NE(directory.status().message().find("not a regular file"), std::string::npos);
}

TEST(NpyTest, WriterRefusesInconsistentRequests) {
  ScratchDir dir;
  const std::vector<float> six(6);
  Status s = WriteNpyF32(dir / "a.npy", std::vector<int64_t>{2, 4}, six);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("8 elements, data has 6"), std::string::npos) << s.ToString();
  s = WriteNpyF32(dir / "a.npy", std::vector<int64_t>{-2, -3}, six);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  s = WriteNpyI32(dir / "a.npy", std::vector<int64_t>(65, 1), std::vector<int32_t>(1));
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  s = WriteNpyF32(dir / "no/such/dir/a.npy", std::vector<int64_t>{6}, six);
  EXPECT_EQ(s.code(), Code::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("no/such/dir/a.npy"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace questkv
