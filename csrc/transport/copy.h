// Bulk copies into and out of mapped (shared) memory, chosen by size for the CPU at hand.
#pragma once
#include <cstddef>

namespace mk {

// Copy n bytes between non-overlapping buffers; the stores are globally visible when it returns.
//   - below 1 MiB: memcpy (fastest for blocks that stay in cache);
//   - up to half the last-level cache: memcpy in 64 KiB pieces (glibc turns one large memcpy into a single
//     `rep movsb`, which on AMD Zen runs at 60-70% of the speed of the same bytes in pieces: measured in
//     bench/window_copy.py);
//   - larger: non-temporal (streaming) AVX2 stores where the CPU has them, so the copy does not first
//     read every destination line into the cache and then evict the source; pieces otherwise.
// SUPERKERNEL_STREAM_COPY_BYTES overrides the streaming threshold (0: never stream).
void copy_bytes(void* dst, const void* src, size_t n);

// How copy_bytes copies n bytes: "memcpy", "pieces" or "stream" (for tests and benchmarks).
const char* copy_method(size_t n);

}  // namespace mk
