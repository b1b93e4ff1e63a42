// A small, strict reader and writer of NumPy .npy files: how `questkv attend`
// takes K/V/Q from a user's model and hands back outputs and selections.
//
// Accepted: format versions 1.0, 2.0 and 3.0; dtypes '<f4', '<f2' (widened to
// float32 exactly, subnormals, ±inf and NaN included) and '<i4'; C order;
// shapes of any rank up to 64 (rank 0 holds one element). Everything else is
// refused rather than guessed at: bad magic, an unknown version, a header that
// is not exactly the dict NumPy writes, Fortran order, big-endian or other
// dtypes, shapes whose byte size overflows, data shorter or longer than the
// shape says.
//
// Errors name the file and the problem: IOError when the OS refuses (missing
// file, directory, short write), Corruption when the bytes are not a valid
// .npy file, InvalidArgument when the file is valid but asks for something
// this reader does not support (dtype, byte order, Fortran order),
// ResourceExhausted when a valid file's data does not fit in memory (with
// the bytes asked for). Data buffers are sized only after the shape is
// checked against the file's size; failing to get them is that status, not
// a std::bad_alloc.
//
// Free functions, no shared state: safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "questkv/status.h"

namespace questkv {

enum class NpyDType : uint8_t { kF32, kF16, kI32 };
// "float32", "float16", "int32".
std::string_view NpyDTypeName(NpyDType d);

// The contents of one .npy file. Floating-point files (f32, f16) fill `f32`;
// int32 files fill `i32`; the other vector stays empty. `dtype` records what
// the file held.
struct NpyArray {
  NpyDType dtype = NpyDType::kF32;
  std::vector<int64_t> shape;
  std::vector<float> f32;
  std::vector<int32_t> i32;

  // Product of the shape (1 for rank 0).
  int64_t elements() const;
  // "(3, 4)" — the shape as NumPy prints it.
  std::string ShapeString() const;
};

// Reads a whole file. On success every element is present and nothing follows
// the data.
Result<NpyArray> ReadNpy(const std::string& path);

// Writes a version 1.0 file, C order, little-endian, header padded so the data
// starts on a 64-byte boundary (as NumPy does). InvalidArgument when the rank
// exceeds 64, a dimension is negative, or data.size() differs from the product
// of the shape; IOError when the file cannot be written (a partly written file
// may remain).
Status WriteNpyF32(const std::string& path, std::span<const int64_t> shape, std::span<const float> data);
Status WriteNpyI32(const std::string& path, std::span<const int64_t> shape, std::span<const int32_t> data);

}  // namespace questkv
