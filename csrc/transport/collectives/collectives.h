// Collective algorithms over a Comm. Each picks the shared-memory segment algorithm when every rank is on
// this host (Comm::all_local), otherwise point-to-point algorithms over the providers (ring for bandwidth,
// recursive doubling for latency). Buffers are contiguous host memory; counts are in elements.
// Every rank passes the same arguments; a disagreement (size, dtype, op, root, collective) is detected
// and reported on every rank that can see it, never turned into a hang or a wrong answer.
#pragma once
#include <cstddef>
#include <vector>

#include "transport/comm.h"
#include "transport/reduce.h"

namespace mk::coll {

void allreduce(Comm& c, void* buf, size_t count, DType t, RedOp op);
// Result at root; other ranks' buffers are left unchanged.
void reduce(Comm& c, void* buf, size_t count, DType t, RedOp op, int root);
// in: size*count elements; out: count elements (this rank's block of the reduction).
void reduce_scatter(Comm& c, const void* in, void* out, size_t count, DType t, RedOp op);
void broadcast(Comm& c, void* buf, size_t bytes, int root);
// in: `bytes` from each rank; out: size*bytes, rank r's part at r*bytes.
void allgather(Comm& c, const void* in, void* out, size_t bytes);
// out significant at root only (size*bytes).
void gather(Comm& c, const void* in, void* out, size_t bytes, int root);
// in significant at root only (size*bytes); out: bytes.
void scatter(Comm& c, const void* in, void* out, size_t bytes, int root);
// Byte counts and offsets per peer (uneven splits allowed; the two sides of every pair must agree).
void alltoall(Comm& c, const void* in, void* out, const std::vector<size_t>& send_bytes,
              const std::vector<size_t>& send_off, const std::vector<size_t>& recv_bytes,
              const std::vector<size_t>& recv_off);
void barrier(Comm& c);

}  // namespace mk::coll
