// What this process knows about its host: an identity that tells "same machine, same network namespace"
// (ranks with equal identities share memory), and the address its TCP listener binds to.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <string>

namespace mk {

// hostname/boot_id/netns-inode, or $SUPERKERNEL_HOST_ID when set.
std::string host_identity();
// Human-readable host name for messages and %info.
std::string host_name();
// IPv4 address for the TCP listener: interface `ifname`'s address when given, else $SUPERKERNEL_SOCKET_IFNAME's
// when set, else the first non-loopback interface that is up, else 127.0.0.1. `loopback_only` forces
// 127.0.0.1 (single-host jobs).
std::string listen_address(bool loopback_only, const std::string& ifname = {});
// Online CPUs (for deciding how long to spin before sleeping).
int online_cpus();
// How long a wait for a peer on this host spins before it sleeps, with `local_ranks` ranks of the job on
// this host: 50 us when they fit on its cores (peers in step arrive within that, and waking a sleeper costs
// tens of microseconds on a VM), 2 us when they outnumber them (the peer needs our core);
// $SUPERKERNEL_SPIN_US overrides both.
std::chrono::microseconds spin_time(int local_ranks);

// A pidfd for process `pid` (-1 where the kernel has none: then process_exited falls back to kill(pid, 0)).
int open_pidfd(pid_t pid);
// Whether process `pid` (with `pidfd` from open_pidfd, or -1) has exited. Never blocks.
bool process_exited(int pidfd, pid_t pid);

// Name the calling thread (at most 15 characters; shown by top -H, gdb, py-spy). Best effort.
void name_this_thread(const char* name);

}  // namespace mk
