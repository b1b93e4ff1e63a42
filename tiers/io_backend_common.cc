#include "tiers/io_backend_common.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace questkv {

bool IoRegion::Contains(const void* p, std::size_t len) const {
  const auto* c = static_cast<const char*>(p);
  return c >= base && len <= bytes && std::size_t(c - base) <= bytes - len;
}

Status CheckRequest(const IoRequest& r, int file_count, const IoRegion& region, bool direct) {
  if (file_count == 0 || !region.registered())
    return Status::FailedPrecondition("io: Submit before OpenFiles and RegisterRegion");
  if (r.file < 0 || r.file >= file_count)
    return Status::InvalidArgument("io: file index " + std::to_string(r.file) + " outside [0, " +
                                   std::to_string(file_count) + ")");
  if (r.len == 0 || r.len > kMaxRequestBytes)
    return Status::InvalidArgument("io: request length " + std::to_string(r.len) + " outside [1, 2^30]");
  if (r.buf == nullptr || !region.Contains(r.buf, r.len))
    return Status::InvalidArgument("io: buffer of " + std::to_string(r.len) +
                                   " bytes is not inside the registered region");
  if (r.offset > (uint64_t(1) << 62))
    return Status::InvalidArgument("io: offset " + std::to_string(r.offset) + " too large");
  const bool aligned = r.offset % kDirectAlignBytes == 0 && r.len % kDirectAlignBytes == 0 &&
                       reinterpret_cast<uintptr_t>(r.buf) % kDirectAlignBytes == 0;
  if (direct && !aligned)
    return Status::InvalidArgument("io: offset, length and buffer must be multiples of 4096 for O_DIRECT");
  return Status::Ok();
}

Status CheckRegion(const IoRegion& current, void* base, std::size_t bytes) {
  if (current.registered()) return Status::FailedPrecondition("io: a region is already registered");
  if (base == nullptr || bytes == 0) return Status::InvalidArgument("io: empty region");
  if (reinterpret_cast<uintptr_t>(base) % kDirectAlignBytes != 0)
    return Status::InvalidArgument("io: region base is not 4096-aligned");
  return Status::Ok();
}

Result<int> OpenForIo(const std::string& path, bool* direct) {
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC;
  int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
  *direct = fd >= 0;
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) return Status::IOError(ErrnoMessage("open " + path, errno));
  return fd;
}

std::string ErrnoMessage(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

}  // namespace questkv
