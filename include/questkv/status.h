// Status and Result<T>: how every recoverable error in questkv is reported.
//
// A Status is OK or carries a code and a message; the OK case holds no
// allocation, so returning Status::Ok() on the hot path costs a null pointer.
// Result<T> is a value or a non-OK Status. No exception crosses the public
// API. Both are plain values: thread-compatible, not internally synchronised.
#pragma once

#include <cassert>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace questkv {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,    // bad shape, dtype, id, budget, flag
  kNotFound = 2,           // unknown sequence / page id
  kOutOfRange = 3,         // index past the end (rollback past the start, layer id)
  kResourceExhausted = 4,  // a fixed pool or budget is full
  kFailedPrecondition = 5, // call not valid in the current state
  kIOError = 6,            // the OS said no
  kCorruption = 7,         // bytes read back do not match their checksum / format
  kUnimplemented = 8,      // valid request this build cannot serve (e.g. CUDA absent)
  kInternal = 9,           // an invariant broke: a bug
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message);

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status OutOfRange(std::string m) { return {Code::kOutOfRange, std::move(m)}; }
  static Status ResourceExhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }
  static Status IOError(std::string m) { return {Code::kIOError, std::move(m)}; }
  static Status Corruption(std::string m) { return {Code::kCorruption, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {Code::kUnimplemented, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  bool ok() const { return state_ == nullptr; }
  Code code() const { return state_ ? state_->code : Code::kOk; }
  // Empty for OK.
  const std::string& message() const;
  // "OK" or "InvalidArgument: <message>".
  std::string ToString() const;

 private:
  struct State {
    Code code;
    std::string message;
  };
  std::unique_ptr<State> state_;
};

// A T or a non-OK Status. Constructing from an OK Status is a bug (asserted).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok() && "Result built from an OK Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }
  T& value() & { assert(ok()); return std::get<T>(v_); }
  const T& value() const& { assert(ok()); return std::get<T>(v_); }
  T&& value() && { assert(ok()); return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace questkv

// Early-return helpers. Kept to two, used everywhere the same way.
#define QKV_RETURN_IF_ERROR(expr)                \
  do {                                           \
    ::questkv::Status qkv_status_ = (expr);      \
    if (!qkv_status_.ok()) return qkv_status_;   \
  } while (0)

#define QKV_CONCAT_INNER(a, b) a##b
#define QKV_CONCAT(a, b) QKV_CONCAT_INNER(a, b)
#define QKV_ASSIGN_OR_RETURN(lhs, expr)                                   \
  auto QKV_CONCAT(qkv_result_, __LINE__) = (expr);                        \
  if (!QKV_CONCAT(qkv_result_, __LINE__).ok())                            \
    return QKV_CONCAT(qkv_result_, __LINE__).status();                    \
  lhs = std::move(QKV_CONCAT(qkv_result_, __LINE__)).value()
