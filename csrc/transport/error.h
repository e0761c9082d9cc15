// Errors of the mk transport: every message names the rank, the peer and the operation it concerns.
#pragma once
#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>

namespace mk {

// Base class; the torch adapter turns it into a RuntimeError/DistBackendError for Python.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A wait ran past the group's timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};
// The peer went away (closed its connection, exited, or aborted the communicator).
class PeerError : public Error {
 public:
  using Error::Error;
};
// The ranks called the collective with different arguments. Every rank detected it at the same step, so
// the communicator stays usable.
class MismatchError : public Error {
 public:
  using Error::Error;
};
// An interrupt (cancel_all) stopped the wait.
class CancelledError : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// "what: strerror(errno) (errno N)" as an Error.
[[noreturn]] void throw_errno(const std::string& what, int err = errno);

}  // namespace mk

// Check a system call that returns -1 on failure.
#define MK_SYSCHECK(expr, what)                 \
  do {                                          \
    if ((expr) == -1) ::mk::throw_errno((what)); \
  } while (0)
