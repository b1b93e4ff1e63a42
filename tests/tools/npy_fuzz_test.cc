// A seeded fuzz of the .npy reader: valid files of each supported dtype,
// version and rank, mutated (byte flips, every truncation, huge header
// lengths, huge, negative and overflowing shapes, garbage dtypes, Fortran
// order, extra and missing keys, non-ASCII bytes). Every case must end in
// OK with a shape the file's size holds, or in an error with a message; no
// crash, and no allocation beyond what the file's size implies (a header
// claiming 2^62 elements is refused before any buffer is sized for it).
// `questkv attend` is run on a share of the cases too.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tools/npy.h"
#include "tests/tools/cli_test_files.h"

// The largest single allocation while tracking is on: the reader's buffers.
namespace {
std::atomic<bool> g_track{false};
std::atomic<std::size_t> g_largest{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_track.load(std::memory_order_relaxed)) {
    std::size_t seen = g_largest.load(std::memory_order_relaxed);
    while (n > seen && !g_largest.compare_exchange_weak(seen, n)) {
    }
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
// GCC pairs the new-expressions it inlines with these frees and warns,
// not seeing that operator new above is the malloc they match.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace questkv {
namespace {

using test::NpyFile;
using test::NpyPreamble;
using test::ScratchDir;

constexpr int kRandomCasesPerSeed = 1000;

// A valid file to start from, and the header it was built from.
struct Seed {
  std::string descr, shape;
  std::size_t item_bytes, elements;
  int major;
};

std::vector<Seed> Seeds() {
  return {{"<f4", "(2, 3)", 4, 6, 1},  {"<f2", "(5,)", 2, 5, 1},       {"<i4", "()", 4, 1, 1},
          {"<f4", "(1, 2, 3, 1)", 4, 6, 2}, {"<f2", "(3, 0)", 2, 0, 3}, {"<i4", "(4,)", 4, 4, 3},
          {"<f4", "(2, 1, 4)", 4, 8, 1}};
}

std::string Payload(std::size_t bytes, std::mt19937_64& rng) {
  std::string p(bytes, '\0');
  for (char& c : p) c = char(rng());
  return p;
}

std::string Build(const Seed& s, std::mt19937_64& rng) {
  return NpyFile(s.descr, s.shape, Payload(s.item_bytes * s.elements, rng), s.major);
}

// A header dict as given, padded and preambled like a real file, then `payload`.
std::string WithDict(const std::string& dict, const std::string& payload, int major = 1) {
  std::string h = dict;
  const std::size_t pre = major >= 2 ? 12 : 10;
  while ((pre + h.size() + 1) % 64 != 0) h += ' ';
  return NpyPreamble(h + '\n', major) + payload;
}

std::string Dict(const std::string& descr, const std::string& order, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': " + order + ", 'shape': " + shape + ", }";
}

// Headers that lie about the data: shapes past int64 or the file, garbage
// dtypes, Fortran order, keys extra and missing, non-ASCII text.
std::vector<std::string> CraftedFiles(std::mt19937_64& rng) {
  const std::string data = Payload(24, rng);
  std::vector<std::string> files;
  for (const char* shape : {"(4611686018427387904,)", "(1152921504606846976, 4)", "(-1, 6)", "(6, -1)",
                            "(9223372036854775807,)", "(9223372036854775808,)", "(99999999999999999999999,)",
                            "(4294967296, 4294967296)", "(3037000500, 3037000500)", "(2147483648, 2147483648, 2)",
                            "(0, 9223372036854775807, 9223372036854775807)", "(6)", "(6,,)", "(,)", "(2 3)",
                            "(1e3,)", "(0x6,)", "(6.0,)", "(+6,)", "(6L,)", "[6]", "(6,", "()", "(7,)", "(5,)"})
    for (const char* descr : {"<f4", "<f2", "<i4"}) files.push_back(WithDict(Dict(descr, "False", shape), data));
  for (const char* descr : {"<f8", ">f4", "|b1", "", "<", "f4", "<f4\xff", "\xc3\xa9", "<i8", "<u4", "O"})
    files.push_back(WithDict(Dict(descr, "False", "(6,)"), data));
  files.push_back(WithDict("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", data));
  files.push_back(WithDict(Dict("<f4", "True", "(2, 3)"), data));
  files.push_back(WithDict(Dict("<f4", "1", "(2, 3)"), data));
  files.push_back(WithDict(Dict("<f4", "Tru", "(2, 3)"), data));
  files.push_back(WithDict("{'descr': '<f4', 'shape': (6,), }", data));
  files.push_back(WithDict("{'descr': '<f4', 'fortran_order': False, }", data));
  files.push_back(WithDict("{'fortran_order': False, 'shape': (6,), }", data));
  files.push_back(WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'extra': 1, }", data));
  files.push_back(WithDict("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,), }", data));
  files.push_back(WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), } trailing", data));
  files.push_back(WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (6,)", data));
  files.push_back(WithDict("{'d\xe9scr': '<f4', 'fortran_order': False, 'shape': (6,), }", data));
  files.push_back(WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), '\x80\xff': 0}", data));
  files.push_back(WithDict("{'descr': '<f4\\x00', 'fortran_order': False, 'shape': (6,), }", data));
  files.push_back(WithDict(Dict("<f4", "False", "(6,)") + '\0', data));
  files.push_back(WithDict("{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (6,)}", data));
  files.push_back(WithDict("{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::string(65, '1') + ",)}", data));
  std::string deep = "(";
  for (int i = 0; i < 65; ++i) deep += "1, ";
  files.push_back(WithDict(Dict("<f4", "False", deep + ")"), data));
  return files;
}

// The preamble's header length set huge or just past the file, each version.
std::vector<std::string> HugeLengthFiles(const Seed& s, std::mt19937_64& rng) {
  std::vector<std::string> files;
  for (int major : {1, 2, 3}) {
    const std::string valid = NpyFile(s.descr, s.shape, Payload(s.item_bytes * s.elements, rng), major);
    const std::size_t len_at = 8, len_bytes = major == 1 ? 2 : 4;
    for (uint64_t len : {uint64_t(0), uint64_t(1), uint64_t(valid.size()), uint64_t(0xffff), uint64_t(0x10000),
                         uint64_t(1) << 20, (uint64_t(1) << 20) + 1, uint64_t(0x7fffffff), uint64_t(0xffffffff),
                         uint64_t(rng())}) {
      std::string f = valid;
      for (std::size_t i = 0; i < len_bytes; ++i) f[len_at + i] = char((len >> (8 * i)) & 0xff);
      files.push_back(f);
    }
  }
  return files;
}

// One random mutation of a valid file.
std::string Mutate(std::string f, std::mt19937_64& rng) {
  const int kind = int(rng() % 6);
  const auto at = [&](std::size_t n) { return std::size_t(rng() % std::max<std::size_t>(n, 1)); };
  // An index in the first 64 bytes of the header dict (f.size() > 10).
  const auto header_at = [&] { return 10 + at(std::min<std::size_t>(f.size() - 10, 64)); };
  switch (kind) {
    case 0:  // a few byte flips anywhere
      for (int i = 0, n = 1 + int(rng() % 4); i < n && !f.empty(); ++i) f[at(f.size())] ^= char(1 + rng() % 255);
      break;
    case 1:  // a flip inside the header text
      if (f.size() > 10) f[header_at()] = char(rng());
      break;
    case 2:  // truncated
      f.resize(at(f.size()));
      break;
    case 3:  // extended
      f += Payload(1 + at(16), rng);
      break;
    case 4:  // a byte inserted into the header
      if (f.size() > 10) f.insert(f.begin() + std::ptrdiff_t(header_at()), char(rng()));
      break;
    default:  // a byte removed from the header
      if (f.size() > 10) f.erase(f.begin() + std::ptrdiff_t(header_at()));
      break;
  }
  return f;
}

// A file in memory, opened by path through /proc: thousands of cases cost
// no disk writes.
class MemFile {
 public:
  MemFile() : fd_(::memfd_create("npy_fuzz", MFD_CLOEXEC)), path_("/proc/self/fd/" + std::to_string(fd_)) {
    EXPECT_GE(fd_, 0) << "memfd_create failed";
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  const std::string& path() const { return path_; }
  void Set(const std::string& bytes) {
    ASSERT_EQ(::ftruncate(fd_, 0), 0);
    ASSERT_EQ(::pwrite(fd_, bytes.data(), bytes.size(), 0), ssize_t(bytes.size()));
  }

 private:
  int fd_;
  std::string path_;
};

struct Tally {
  int ok = 0, refused = 0;
};

// Reads `bytes` back through ReadNpy and checks the contract.
void Check(MemFile& file, const std::string& bytes, Tally& tally) {
  file.Set(bytes);
  const std::string& path = file.path();
  g_largest = 0;
  g_track = true;
  Result<NpyArray> a = ReadNpy(path);
  g_track = false;
  // f16 data widens to f32 (twice its bytes); the rest is headers and text.
  const std::size_t allowed = 2 * bytes.size() + 4096;
  ASSERT_LE(g_largest.load(), allowed) << "allocated " << g_largest.load() << " bytes for a file of " << bytes.size();
  if (!a.ok()) {
    ++tally.refused;
    ASSERT_FALSE(a.status().message().empty());
    ASSERT_NE(a.status().message().find(path), std::string::npos) << a.status().message();
    return;
  }
  ++tally.ok;
  int64_t n = 1;
  for (int64_t d : a->shape) {
    ASSERT_GE(d, 0);
    ASSERT_FALSE(__builtin_mul_overflow(n, d, &n));
  }
  ASSERT_EQ(a->elements(), n);
  // The data is exactly what follows the header the preamble announces.
  ASSERT_GE(bytes.size(), 10u);
  const bool v1 = bytes[6] == 1;
  const auto byte = [&](std::size_t i) { return uint64_t(uint8_t(bytes[i])); };
  const uint64_t header_len = v1 ? byte(8) | byte(9) << 8 : byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24;
  const uint64_t data_offset = (v1 ? 10 : 12) + header_len;
  const uint64_t item = a->dtype == NpyDType::kF16 ? 2 : 4;
  ASSERT_EQ(data_offset + uint64_t(n) * item, bytes.size()) << "shape " << a->ShapeString() << ", header " << header_len;
  if (a->dtype == NpyDType::kI32) {
    ASSERT_EQ(a->i32.size(), std::size_t(n));
    ASSERT_TRUE(a->f32.empty());
  } else {
    ASSERT_EQ(a->f32.size(), std::size_t(n));
    ASSERT_TRUE(a->i32.empty());
  }
}

TEST(NpyFuzz, EveryTruncationOfEveryVersionIsRefused) {
  MemFile file;
  std::mt19937_64 rng(1);
  Tally tally;
  for (const Seed& s : Seeds()) {
    const std::string valid = Build(s, rng);
    for (std::size_t len = 0; len < valid.size(); ++len) {
      SCOPED_TRACE(testing::Message() << s.descr << " " << s.shape << " v" << s.major << " cut at " << len);
      const int before = tally.ok;
      Check(file, valid.substr(0, len), tally);
      ASSERT_EQ(tally.ok, before) << "a truncated file read as OK";
    }
    Check(file, valid, tally);
  }
  EXPECT_EQ(tally.ok, int(Seeds().size()));
}

TEST(NpyFuzz, LyingHeadersAreRefusedBeforeAllocating) {
  MemFile file;
  std::mt19937_64 rng(2);
  Tally tally;
  int i = 0;
  for (const std::string& f : CraftedFiles(rng)) {
    SCOPED_TRACE(testing::Message() << "crafted file " << i++);
    Check(file, f, tally);
  }
  for (const Seed& s : Seeds())
    for (const std::string& f : HugeLengthFiles(s, rng)) {
      SCOPED_TRACE(testing::Message() << s.descr << " " << s.shape << " huge length, file " << i++);
      Check(file, f, tally);
    }
  // One crafted file is valid: the dict in double quotes, '<f4' (6,) over
  // its 24 data bytes.
  EXPECT_EQ(tally.ok, 1);
  EXPECT_GT(tally.refused, 100);
}

TEST(NpyFuzz, RandomMutationsAreReadOrRefused) {
  MemFile file;
  Tally tally;
  uint64_t seed = 1000;
  for (const Seed& s : Seeds()) {
    std::mt19937_64 rng(++seed);
    for (int i = 0; i < kRandomCasesPerSeed; ++i) {
      const uint64_t case_seed = rng();
      std::mt19937_64 case_rng(case_seed);
      std::string f = Build(s, case_rng);
      for (int m = 0, n = 1 + int(case_rng() % 3); m < n; ++m) f = Mutate(std::move(f), case_rng);
      SCOPED_TRACE(testing::Message() << s.descr << " " << s.shape << " v" << s.major << ", case seed " << case_seed);
      Check(file, f, tally);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(tally.refused, 0);
  EXPECT_GT(tally.ok, 0);  // payload flips leave a valid file
}

// `questkv attend` over mutated keys: exit 0 on a file that still reads as
// keys of the right shape, else exit 1 with a message; never a crash.
TEST(NpyFuzz, AttendRefusesMutatedKeysWithAMessage) {
  ScratchDir dir;
  const std::string v = dir / "v.npy", q = dir / "q.npy", o = dir / "o.npy", valid_k = dir / "k.npy";
  const std::vector<float> kv(2 * 8 * 4, 0.25f), qv(4 * 4, 0.5f);
  ASSERT_TRUE(WriteNpyF32(v, std::vector<int64_t>{2, 8, 4}, kv).ok());
  ASSERT_TRUE(WriteNpyF32(q, std::vector<int64_t>{4, 4}, qv).ok());
  ASSERT_TRUE(WriteNpyF32(valid_k, std::vector<int64_t>{2, 8, 4}, kv).ok());
  const std::string valid = test::ReadBytes(valid_k);
  std::mt19937_64 rng(7);
  std::vector<std::string> files = CraftedFiles(rng);
  for (int i = 0; i < 120; ++i) files.push_back(Mutate(valid, rng));
  MemFile keys;
  for (std::size_t i = 0; i < files.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "keys file " << i);
    keys.Set(files[i]);
    const test::Outcome r = test::RunCommand(cli::AttendMain, "attend",
                                             {"--keys", keys.path(), "--values", v, "--query", q, "--page-size", "2",
                                              "--token-budget", "4", "--output", o});
    ASSERT_TRUE(r.code == 0 || r.code == 1) << r.code << ": " << r.err;
    if (r.code == 1) {
      EXPECT_NE(r.err.find("questkv attend: "), std::string::npos) << r.err;
    }
    if (r.code == 0) {
      EXPECT_TRUE(ReadNpy(keys.path()).ok());
    }
  }
}

}  // namespace
}  // namespace questkv
