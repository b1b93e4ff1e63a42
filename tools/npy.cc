#include "tools/npy.h"

#include "core/half.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <new>
#include <optional>

namespace questkv {

static_assert(std::endian::native == std::endian::little, "npy.cc reads little-endian data in place");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicLen = 6;
constexpr int kMaxRank = 64;                        // NumPy's own limit (NPY_MAXDIMS)
constexpr uint32_t kMaxHeaderBytes = 1u << 20;      // NumPy refuses > 10000 by default
constexpr std::size_t kAlign = 64;                  // data offset alignment NumPy writes
constexpr int64_t kChunkElems = int64_t(1) << 20;   // f16 conversion buffer

std::string Errno() { return std::strerror(errno); }

// Closes the descriptor on every path out.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { if (fd_ >= 0) ::close(fd_); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now and reports the result (close can surface a deferred write error).
  int Close() { const int rc = ::close(fd_); fd_ = -1; return rc; }

 private:
  int fd_;
};

// Reads exactly n bytes at offset; IOError on a short read or OS error.
Status ReadExact(int fd, int64_t offset, void* dst, std::size_t n, const std::string& path) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Status::IOError(path + ": read failed: " + Errno());
    if (got == 0) return Status::IOError(path + ": unexpected end of file while reading");
    p += got;
    n -= std::size_t(got);
    offset += got;
  }
  return Status::Ok();
}

Status WriteAll(int fd, const void* src, std::size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return Status::IOError(path + ": write failed: " + Errno());
    p += put;
    n -= std::size_t(put);
  }
  return Status::Ok();
}

std::string FormatShape(std::span<const int64_t> shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// Product of the dims, or nullopt on a negative dim or int64 overflow.
std::optional<int64_t> CheckedProduct(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

// ---- header dict ---------------------------------------------------------------

struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// Parses exactly the Python dict literal NumPy writes:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// keys in any order, each exactly once, whitespace and a trailing comma
// allowed, nothing but whitespace after the closing brace.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  Status Parse(Header* h) {
    SkipSpace();
    if (!Eat('{')) return Bad("does not start with '{'");
    bool seen_descr = false, seen_order = false, seen_shape = false;
    for (;;) {
      SkipSpace();
      if (Eat('}')) break;
      std::string key;
      QKV_RETURN_IF_ERROR(ParseString(&key, "a key"));
      SkipSpace();
      if (!Eat(':')) return Bad("expected ':' after key '" + key + "'");
      SkipSpace();
      if (key == "descr") {
        if (seen_descr) return Bad("key 'descr' appears twice");
        seen_descr = true;
        if (Peek() == '[' || Peek() == '{')
          return Status::InvalidArgument(path_ + ": structured dtypes are not supported "
                                         "(expected '<f4', '<f2' or '<i4')");
        QKV_RETURN_IF_ERROR(ParseString(&h->descr, "the 'descr' value"));
      } else if (key == "fortran_order") {
        if (seen_order) return Bad("key 'fortran_order' appears twice");
        seen_order = true;
        QKV_RETURN_IF_ERROR(ParseBool(&h->fortran_order));
      } else if (key == "shape") {
        if (seen_shape) return Bad("key 'shape' appears twice");
        seen_shape = true;
        QKV_RETURN_IF_ERROR(ParseShape(&h->shape));
      } else {
        return Bad("unexpected key '" + key + "'");
      }
      SkipSpace();
      if (Eat(',')) continue;
      if (Eat('}')) break;
      return Bad("expected ',' or '}' after the value of '" + key + "'");
    }
    SkipSpace();
    if (pos_ != s_.size()) return Bad("unexpected text after the closing '}'");
    if (!seen_descr) return Bad("missing key 'descr'");
    if (!seen_order) return Bad("missing key 'fortran_order'");
    if (!seen_shape) return Bad("missing key 'shape'");
    return Status::Ok();
  }

 private:
  Status Bad(const std::string& what) const {
    return Status::Corruption(path_ + ": malformed .npy header (" + what + ")");
  }
  char Peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  bool Eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) { ++pos_; return true; }
    return false;
  }
  bool EatWord(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }
  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }

  // A quoted string without escapes (NumPy never writes any in these fields).
  Status ParseString(std::string* out, std::string_view what) {
    const char quote = Peek();
    if (quote != '\'' && quote != '"') return Bad("expected a quoted string for " + std::string(what));
    ++pos_;
    const std::size_t end = s_.find(quote, pos_);
    if (end == std::string_view::npos) return Bad("unterminated string");
    std::string_view body = s_.substr(pos_, end - pos_);
    if (body.find('\\') != std::string_view::npos) return Bad("escape sequence in a string");
    *out = std::string(body);
    pos_ = end + 1;
    return Status::Ok();
  }

  Status ParseBool(bool* out) {
    if (EatWord("True")) { *out = true; return Status::Ok(); }
    if (EatWord("False")) { *out = false; return Status::Ok(); }
    return Bad("'fortran_order' must be True or False");
  }

  Status ParseDim(int64_t* out) {
    if (Peek() == '-') return Bad("negative dimension in 'shape'");
    if (Peek() < '0' || Peek() > '9') return Bad("'shape' must be a tuple of integers");
    int64_t v = 0;
    while (Peek() >= '0' && Peek() <= '9') {
      if (__builtin_mul_overflow(v, int64_t(10), &v) || __builtin_add_overflow(v, int64_t(Peek() - '0'), &v))
        return Bad("dimension in 'shape' overflows int64");
      ++pos_;
    }
    *out = v;
    return Status::Ok();
  }

  // "()", "(3,)", "(2, 3)", "(2, 3,)". "(3)" is an int in Python, not a tuple.
  Status ParseShape(std::vector<int64_t>* shape) {
    if (!Eat('(')) return Bad("'shape' must be a tuple");
    shape->clear();
    bool trailing_comma = false;
    for (;;) {
      SkipSpace();
      if (Eat(')')) break;
      if (int(shape->size()) == kMaxRank)
        return Status::InvalidArgument(path_ + ": rank above " + std::to_string(kMaxRank) + " is not supported");
      int64_t d = 0;
      QKV_RETURN_IF_ERROR(ParseDim(&d));
      shape->push_back(d);
      SkipSpace();
      trailing_comma = Eat(',');
      if (trailing_comma) continue;
      if (Eat(')')) break;
      return Bad("expected ',' or ')' in 'shape'");
    }
    if (shape->size() == 1 && !trailing_comma) return Bad("'shape' (n) without a comma is not a tuple");
    return Status::Ok();
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  const std::string& path_;
};

// Maps a descr to a supported dtype, or explains why not.
Result<NpyDType> ParseDescr(const std::string& descr, const std::string& path) {
  if (descr == "<f4") return NpyDType::kF32;
  if (descr == "<f2") return NpyDType::kF16;
  if (descr == "<i4") return NpyDType::kI32;
  if (!descr.empty() && descr[0] == '>')
    return Status::InvalidArgument(path + ": big-endian dtype '" + descr +
                                   "' is not supported (save with a little-endian dtype)");
  return Status::InvalidArgument(path + ": unsupported dtype '" + descr +
                                 "' (expected float32 '<f4', float16 '<f2' or int32 '<i4')");
}

std::size_t ItemBytes(NpyDType d) { return d == NpyDType::kF16 ? 2 : 4; }

// Reads the magic, version and header dict; leaves *data_offset at the first
// data byte.
Status ReadHeader(int fd, int64_t file_bytes, const std::string& path, Header* h, int64_t* data_offset) {
  if (file_bytes < 10) return Status::Corruption(path + ": too short to be a .npy file (" +
                                                 std::to_string(file_bytes) + " bytes)");
  unsigned char pre[12] = {};
  QKV_RETURN_IF_ERROR(ReadExact(fd, 0, pre, 10, path));
  if (std::memcmp(pre, kMagic, kMagicLen) != 0) return Status::Corruption(path + ": not a .npy file (bad magic)");
  const int major = pre[6], minor = pre[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0)
    return Status::Corruption(path + ": unsupported .npy format version " + std::to_string(major) + "." +
                              std::to_string(minor) + " (1.0, 2.0 or 3.0)");
  uint32_t header_len = 0;
  int64_t preamble = 10;
  if (major == 1) {
    header_len = uint32_t(pre[8]) | uint32_t(pre[9]) << 8;
  } else {
    if (file_bytes < 12) return Status::Corruption(path + ": truncated .npy header");
    QKV_RETURN_IF_ERROR(ReadExact(fd, 10, pre + 10, 2, path));
    header_len = uint32_t(pre[8]) | uint32_t(pre[9]) << 8 | uint32_t(pre[10]) << 16 | uint32_t(pre[11]) << 24;
    preamble = 12;
  }
  if (header_len > kMaxHeaderBytes)
    return Status::Corruption(path + ": .npy header length " + std::to_string(header_len) + " is implausibly large");
  if (preamble + int64_t(header_len) > file_bytes)
    return Status::Corruption(path + ": truncated .npy header (header says " + std::to_string(header_len) +
                              " bytes, file has " + std::to_string(file_bytes - preamble) + ")");
  std::string text(header_len, '\0');
  QKV_RETURN_IF_ERROR(ReadExact(fd, preamble, text.data(), header_len, path));
  if (text.find('\0') != std::string::npos) return Status::Corruption(path + ": malformed .npy header (NUL byte)");
  QKV_RETURN_IF_ERROR(HeaderParser(text, path).Parse(h));
  *data_offset = preamble + header_len;
  return Status::Ok();
}

// Sizes a data buffer. The shape already matches the file's size, so a
// failure here is a large valid file meeting a memory limit: said with the
// bytes asked for, never thrown past the reader.
template <typename T>
Status Allocate(std::vector<T>* v, int64_t n, const std::string& path, const std::string& what) {
  try {
    v->resize(std::size_t(n));
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("out of memory reading " + path + " (" +
                                     std::to_string(uint64_t(n) * sizeof(T)) + " bytes for " + what + ")");
  }
  return Status::Ok();
}

Status ReadF16(int fd, int64_t offset, int64_t n, const std::string& path, const std::string& what,
               std::vector<float>* out) {
  QKV_RETURN_IF_ERROR(Allocate(out, n, path, what + " widened to float32"));
  std::vector<uint16_t> buf;
  QKV_RETURN_IF_ERROR(Allocate(&buf, std::min(n, kChunkElems), path, "a float16 read buffer"));
  for (int64_t done = 0; done < n;) {
    const int64_t c = std::min(n - done, kChunkElems);
    QKV_RETURN_IF_ERROR(ReadExact(fd, offset + done * 2, buf.data(), std::size_t(c) * 2, path));
    for (int64_t i = 0; i < c; ++i) (*out)[std::size_t(done + i)] = HalfBitsToFloat(buf[std::size_t(i)]);
    done += c;
  }
  return Status::Ok();
}

Status WriteNpy(const std::string& path, std::string_view descr, std::span<const int64_t> shape,
                const void* data, std::size_t count, std::size_t item_bytes) {
  if (shape.size() > std::size_t(kMaxRank))
    return Status::InvalidArgument(path + ": rank " + std::to_string(shape.size()) + " exceeds " +
                                   std::to_string(kMaxRank));
  const std::optional<int64_t> n = CheckedProduct(shape);
  if (!n) return Status::InvalidArgument(path + ": shape " + FormatShape(shape) + " is negative or overflows");
  if (uint64_t(*n) != count)
    return Status::InvalidArgument(path + ": shape " + FormatShape(shape) + " holds " + std::to_string(*n) +
                                   " elements, data has " + std::to_string(count));
  std::string header = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': " +
                       FormatShape(shape) + ", }";
  const std::size_t unpadded = 10 + header.size() + 1;  // preamble + dict + '\n'
  header.append((kAlign - unpadded % kAlign) % kAlign, ' ');
  header += '\n';
  std::string pre(kMagic, kMagicLen);
  pre += char(1);
  pre += char(0);
  pre += char(header.size() & 0xff);
  pre += char(header.size() >> 8);

  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Status::IOError(path + ": cannot create: " + Errno());
  QKV_RETURN_IF_ERROR(WriteAll(fd.get(), pre.data(), pre.size(), path));
  QKV_RETURN_IF_ERROR(WriteAll(fd.get(), header.data(), header.size(), path));
  QKV_RETURN_IF_ERROR(WriteAll(fd.get(), data, count * item_bytes, path));
  if (fd.Close() != 0) return Status::IOError(path + ": close failed: " + Errno());
  return Status::Ok();
}

}  // namespace

std::string_view NpyDTypeName(NpyDType d) {
  switch (d) {
    case NpyDType::kF32: return "float32";
    case NpyDType::kF16: return "float16";
    case NpyDType::kI32: return "int32";
  }
  return "?";
}

int64_t NpyArray::elements() const { return CheckedProduct(shape).value_or(-1); }

std::string NpyArray::ShapeString() const { return FormatShape(shape); }

Result<NpyArray> ReadNpy(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Status::IOError(path + ": cannot open: " + Errno());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::IOError(path + ": cannot stat: " + Errno());
  if (!S_ISREG(st.st_mode)) return Status::IOError(path + ": not a regular file");
  const int64_t file_bytes = st.st_size;

  Header h;
  int64_t offset = 0;
  QKV_RETURN_IF_ERROR(ReadHeader(fd.get(), file_bytes, path, &h, &offset));
  QKV_ASSIGN_OR_RETURN(const NpyDType dtype, ParseDescr(h.descr, path));
  if (h.fortran_order)
    return Status::InvalidArgument(path + ": Fortran-order arrays are not supported (save a C-contiguous array, "
                                   "e.g. np.ascontiguousarray)");
  const std::optional<int64_t> n = CheckedProduct(h.shape);
  int64_t data_bytes = 0;
  if (!n || __builtin_mul_overflow(*n, int64_t(ItemBytes(dtype)), &data_bytes))
    return Status::Corruption(path + ": shape " + FormatShape(h.shape) + " overflows");
  const int64_t have = file_bytes - offset;
  if (have < data_bytes)
    return Status::Corruption(path + ": truncated data: shape " + FormatShape(h.shape) + " of " +
                              std::string(NpyDTypeName(dtype)) + " needs " + std::to_string(data_bytes) +
                              " bytes, file has " + std::to_string(have));
  if (have > data_bytes)
    return Status::Corruption(path + ": " + std::to_string(have - data_bytes) + " trailing bytes after the " +
                              std::to_string(data_bytes) + " data bytes of shape " + FormatShape(h.shape));

  NpyArray a;
  a.dtype = dtype;
  const std::string what = "shape " + FormatShape(h.shape) + " of " + std::string(NpyDTypeName(dtype));
  a.shape = std::move(h.shape);
  switch (dtype) {
    case NpyDType::kF32:
      QKV_RETURN_IF_ERROR(Allocate(&a.f32, *n, path, what));
      QKV_RETURN_IF_ERROR(ReadExact(fd.get(), offset, a.f32.data(), std::size_t(data_bytes), path));
      break;
    case NpyDType::kF16:
      QKV_RETURN_IF_ERROR(ReadF16(fd.get(), offset, *n, path, what, &a.f32));
      break;
    case NpyDType::kI32:
      QKV_RETURN_IF_ERROR(Allocate(&a.i32, *n, path, what));
      QKV_RETURN_IF_ERROR(ReadExact(fd.get(), offset, a.i32.data(), std::size_t(data_bytes), path));
      break;
  }
  return a;
}

Status WriteNpyF32(const std::string& path, std::span<const int64_t> shape, std::span<const float> data) {
  return WriteNpy(path, "<f4", shape, data.data(), data.size(), sizeof(float));
}

Status WriteNpyI32(const std::string& path, std::span<const int64_t> shape, std::span<const int32_t> data) {
  return WriteNpy(path, "<i4", shape, data.data(), data.size(), sizeof(int32_t));
}

}  // namespace questkv
