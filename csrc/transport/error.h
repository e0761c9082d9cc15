// Errors of the mk transport: every message names the rank, the peer and the operation it concerns.
#pragma once
#include <cerrno>
#include <charconv>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

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

namespace detail {
// One argument of cat(): strings and integers are appended directly; anything else (floating point, bool,
// char types, pointers, types with an operator<<) goes through a stream, so the text is what `os << x` gives.
// Labels are built on hot paths (every fused-op message names its op, rank and peer): a stream costs a
// locale and facet lookups per call.
template <typename T>
void cat_one(std::string& out, const T& x) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, std::string> || std::is_same_v<D, std::string_view>) {
    out.append(x.data(), x.size());
  } else if constexpr (std::is_same_v<D, const char*> || std::is_same_v<D, char*>) {
    out += x ? x : "(null)";  // (a stream refuses a null char pointer; say so instead)
  } else if constexpr (std::is_integral_v<D> && !std::is_same_v<D, bool> && sizeof(D) > 1) {
    char buf[24];
    auto r = std::to_chars(buf, buf + sizeof(buf), x);
    out.append(buf, size_t(r.ptr - buf));
  } else {
    std::ostringstream os;
    os << x;
    out += os.str();
  }
}
}  // namespace detail

// The arguments' text joined, as `(os << ... << args)` writes it.
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  out.reserve(64);
  (detail::cat_one(out, args), ...);
  return out;
}

// "what: strerror(errno) (errno N)" as an Error.
[[noreturn]] void throw_errno(const std::string& what, int err = errno);

}  // namespace mk

// Check a system call that returns -1 on failure.
#define MK_SYSCHECK(expr, what)                 \
  do {                                          \
    if ((expr) == -1) ::mk::throw_errno((what)); \
  } while (0)
