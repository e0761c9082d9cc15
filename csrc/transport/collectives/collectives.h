// Collective algorithms over a Comm. Each picks the shared-memory segment algorithm when every rank is on
// this host (Comm::all_local), otherwise point-to-point algorithms over the providers (ring for bandwidth,
// recursive doubling for latency). Buffers are contiguous host memory; counts are in elements.
// Every rank passes the same arguments; a disagreement (size, dtype, op, root, collective) is detected
// and reported on every rank that can see it, never turned into a hang or a wrong answer.
#pragma once
#include <cstddef>
#include <functional>
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

// In-place variants for one host (every rank local, shared-memory provider), for fused operators: the caller
// produces its input straight into the staging slots and consumes the peers' data straight from them, so
// no staging copy is made. Data moves in chunks of whole rows (row_bytes each); `rows_per_chunk` must be in
// [1, shm_rows_per_chunk(c, row_bytes, pieces)]. Callbacks run on the calling thread, in chunk order; slot
// pointers are valid only during the callback. Every rank must make the same call (size, dtype); a
// disagreement is reported on every rank (MismatchError), as for the collectives above.
//
// Rows of a chunk a slot holds (0 when a row does not fit, or the group is not one host with shm). pieces:
// how many row ranges one chunk holds (the group size for reduce_scatter, else 1).
size_t shm_rows_per_chunk(const Comm& c, size_t row_bytes, size_t pieces);
// Sum over ranks of a [rows, row_elems] matrix each rank produces: fill(dst, row, nrows) writes rows
// [row, row + nrows) of this rank's term into dst; the sum lands in out ([rows, row_elems]).
void shm_allreduce_rows(Comm& c, void* out, size_t rows, size_t row_elems, DType t, size_t rows_per_chunk,
                        const std::function<void(char* dst, size_t row, size_t nrows)>& fill);
// Each rank's term is size blocks of [rows, row_elems]; out gets this rank's block of the sum.
// fill(dst, row, nrows) writes rows [row, row + nrows) of every block of the term into dst, laid out
// [size][nrows][row_elems] (block j's rows at dst + j * nrows * row_elems elements). When one chunk holds
// every row (nrows == rows), that is the term's own [size * rows, row_elems] layout: one producer (a GEMM)
// can write all blocks at once.
void shm_reduce_scatter_rows(Comm& c, void* out, size_t rows, size_t row_elems, DType t, size_t rows_per_chunk,
                             const std::function<void(char* dst, size_t row, size_t nrows)>& fill);
// Every rank contributes `rows` rows of row_bytes: fill(dst, row, nrows) writes its rows [row, row + nrows);
// use(rank, src, row, nrows) is then called for every rank (this one included) with that rank's rows.
void shm_allgather_rows(Comm& c, size_t rows, size_t row_bytes, size_t rows_per_chunk,
                        const std::function<void(char* dst, size_t row, size_t nrows)>& fill,
                        const std::function<void(int rank, const char* src, size_t row, size_t nrows)>& use);

}  // namespace mk::coll
