#include "transport/error.h"

#include <cstring>

namespace mk {

void throw_errno(const std::string& what, int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may not be buf).
  const char* msg = strerror_r(err, buf, sizeof(buf));
  throw Error(cat(what, ": ", msg, " (errno ", err, ")"));
}

}  // namespace mk

