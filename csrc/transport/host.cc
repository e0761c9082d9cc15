#include "transport/host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "transport/error.h"

namespace mk {

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

std::string host_identity() {
  if (const char* env = std::getenv("SUPERKERNEL_HOST_ID"); env && *env) return env;
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  struct stat st {};
  std::string netns = "?";
  if (stat("/proc/self/ns/net", &st) == 0) netns = std::to_string(st.st_ino);
  return cat(host_name(), "/", boot, "/", netns);
}

std::string listen_address(bool loopback_only, const std::string& ifname) {
  if (loopback_only) return "127.0.0.1";
  const char* want = ifname.empty() ? std::getenv("SUPERKERNEL_SOCKET_IFNAME") : ifname.c_str();
  ifaddrs* raw = nullptr;
  MK_SYSCHECK(getifaddrs(&raw), "mk: getifaddrs");
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> list(raw, &freeifaddrs);
  for (ifaddrs* it = raw; it; it = it->ifa_next) {
    if (!it->ifa_addr || it->ifa_addr->sa_family != AF_INET) continue;
    if (!(it->ifa_flags & IFF_UP)) continue;
    const bool loop = it->ifa_flags & IFF_LOOPBACK;
    if (want && *want) {
      if (std::string(it->ifa_name) != want) continue;
    } else if (loop) {
      continue;
    }
    char addr[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(it->ifa_addr)->sin_addr, addr, sizeof(addr));
    return addr;
  }
  if (want && *want)
    throw Error(cat("mk: ", ifname.empty() ? "SUPERKERNEL_SOCKET_IFNAME=" : "interface ", want,
                    " has no IPv4 address that is up"));
  return "127.0.0.1";
}

int online_cpus() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

std::chrono::microseconds spin_time(int local_ranks) {
  if (const char* v = std::getenv("SUPERKERNEL_SPIN_US"); v && *v) return std::chrono::microseconds(std::atoi(v));
  return std::chrono::microseconds(local_ranks > online_cpus() ? 2 : 50);
}

void name_this_thread(const char* name) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%s", name);
  (void)pthread_setname_np(pthread_self(), buf);  // fails only for names over 15 characters (truncated above)
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return int(syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

bool process_exited(int pidfd, pid_t pid) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace mk
