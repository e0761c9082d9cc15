// Element-wise atomic read-modify-write on memory that other threads and processes update concurrently
// (window memory mapped by several ranks). The shm origin and the tcp target's progress thread both use
// these functions, so an accumulate from a local peer and one from a remote peer are atomic against each
// other. Each element is updated atomically on its own (not the whole range at once).
#pragma once
#include <cstddef>
#include <cstdint>

#include "transport/reduce.h"

namespace mk {

// dst[i] = op(dst[i], src[i]) for i < count, each element with one atomic compare-and-swap (or fetch_add
// for integer sums). op is sum, min or max; fp16/bf16 compute in fp32 and round once. dst must be
// aligned to the element size; src need not be.
void atomic_accumulate(void* dst, const void* src, size_t count, DType t, RedOp op);
// Throws mk::Error naming `what` when atomic_accumulate does not support (t, op).
void check_accumulate(DType t, RedOp op, const char* what);

enum class AmoOp : uint8_t { fetch_add = 0, compare_swap = 1 };
// On an aligned int64: fetch_add returns the old value and adds a; compare_swap stores b when the value
// equals a and returns the old value (equal to a when it stored). Sequentially consistent.
int64_t atomic_i64(void* p, AmoOp op, int64_t a, int64_t b);

}  // namespace mk
