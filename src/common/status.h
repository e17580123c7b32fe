// One status type for every C++ entry point; the Cython layer turns a failed
// Status into ddlfast.DdlfastError.
#pragma once

#include <string>
#include <utility>

namespace ddlfast {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kMpiError = 2,
  kTimeout = 3,
  kInternal = 4,
  // The communicator is out of step (an earlier stall or failure left
  // messages in flight, or the context was closed mid-wait): abort the job.
  kBroken = 5,
  // Refused on every rank alike at the same point, with nothing in flight (a
  // check on data every rank holds identically): the context stays usable.
  kConsistent = 6,
  // A signal handler raised while this rank waited (Ctrl-C: KeyboardInterrupt):
  // the collective was abandoned and the other ranks were told.
  kInterrupted = 7,
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  static Status invalid(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
  }
  static Status consistent(std::string message) { return Status(StatusCode::kConsistent, std::move(message)); }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  int code_int() const { return static_cast<int>(code_); }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace ddlfast

#define DDLFAST_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ::ddlfast::Status status_ = (expr);      \
    if (!status_.is_ok()) return status_;    \
  } while (0)
