// The fused ops' argument agreement on other backends with CPU tensors (Gloo) when the group spans hosts: a
// communicator of the mk transport of its own (TCP to other hosts, shared memory on a host, every connection
// presenting the job secret), bootstrapped through the process group's store, instead of the backend's
// send/recv.
//
// Why: on Gloo between two namespace hosts at 10 Gbit/s, any small exchange through Gloo before a product and
// Gloo's allreduce of it cost far more than the exchange alone, while the same 384 B over TCP connections of
// their own cost nothing measurable (bench/exchange_channel.py; bf16 1024x768x1024, slowest rank's median,
// ratio to the unfused product + allreduce: Gloo send/recv first 1.12x and 1.30x, an 8-element Gloo
// allreduce first 1.11x and 1.28x, the socket first 0.92x and 0.96x; bench/README.md). A fused op's
// agreement is exactly such an exchange.
//
// How a group gets there (group.h's Agreement, pipeline.cc's start_agree): each rank says in its descriptor
// whether it may open one (side_channel_possible); after an agreement in which every rank may and not every
// rank is on one host, every rank opens it at the start of its next fused call (the same call everywhere:
// decided from the exchanged words), whose agreement still travels on the backend and says who opened it;
// if every rank did, agreements use it from the call after that on, else every rank closes it and the group
// keeps the backend's exchange for good. SUPERKERNEL_OPS_SIDE_CHANNEL=0 on any rank keeps it off.
#pragma once
#include <chrono>
#include <memory>

namespace mk {
class Comm;
}  // namespace mk

namespace mk::kernels {

struct Group;

// The longest the opening waits for the other ranks (or a quarter of the group's timeout, if shorter): a rank
// that failed to open publishes nothing, and its peers give up after this instead of the group's timeout,
// while that rank waits for them in the next agreement (through the backend, up to the group's timeout).
constexpr std::chrono::seconds kSideOpenTimeout{60};

// Whether this rank may open one for g: a backend other than mk with CPU tensors, more than one rank, a store
// on the process group, and SUPERKERNEL_OPS_SIDE_CHANNEL not 0.
bool side_channel_possible(const Group& g);

// Opens it: a rendezvous of every rank of g through the group's store (keys under "superkernel/agree/"),
// listening on SUPERKERNEL_SOCKET_IFNAME's interface, else GLOO_SOCKET_IFNAME's (its first), else the first
// one up. Null, after a warning on stderr that names the group, the rank and the reason, when it cannot be
// opened; the agreement then keeps the backend's exchange.
std::shared_ptr<Comm> open_side_channel(const Group& g);

}  // namespace mk::kernels
