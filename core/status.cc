#include "questkv/status.h"

namespace questkv {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "InvalidArgument";
    case Code::kNotFound: return "NotFound";
    case Code::kOutOfRange: return "OutOfRange";
    case Code::kResourceExhausted: return "ResourceExhausted";
    case Code::kFailedPrecondition: return "FailedPrecondition";
    case Code::kIOError: return "IOError";
    case Code::kCorruption: return "Corruption";
    case Code::kUnimplemented: return "Unimplemented";
    case Code::kInternal: return "Internal";
  }
  return "Unknown";
}

Status::Status(Code code, std::string message) {
  assert(code != Code::kOk && "use Status::Ok()");
  state_ = std::make_unique<State>(State{code, std::move(message)});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(state_->code)) + ": " + state_->message;
}

}  // namespace questkv
