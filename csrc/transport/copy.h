// Bulk copies into and out of mapped (shared) memory, chosen by size for the CPU at hand.
#pragma once
#include <cstddef>

namespace mk {

// Copy n bytes between non-overlapping buffers; the stores are globally visible when it returns.
//   - up to half the last-level cache: one memcpy (source and destination can stay in the cache);
//   - larger: non-temporal (streaming) AVX2 stores where the CPU has them, so the copy does not first read
//     every destination line into the cache and then evict the source; else memcpy in 64 KiB pieces (glibc
//     turns one large memcpy into a single `rep movsb`, which on AMD Zen ran at 60-70% of the speed of the
//     same bytes in pieces beyond the cache).
// Up to 2026-11-25 the 64 KiB pieces started at 1 MiB; a single memcpy is level with them there in
// bench/window_copy.py and faster in same-host window gets (16 MiB: 20-21 against 8 GB/s, bench/memory.py).
// SUPERKERNEL_STREAM_COPY_BYTES overrides the streaming threshold (0: never stream).
void copy_bytes(void* dst, const void* src, size_t n);

// How copy_bytes copies n bytes: "memcpy", "pieces" or "stream" (for tests and benchmarks).
const char* copy_method(size_t n);

}  // namespace mk
