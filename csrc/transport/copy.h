// Bulk copies into and out of mapped (shared) memory, chosen by size for the CPU at hand.
#pragma once
#include <cstddef>

namespace mk {

// Who copies: one same-host window put or get (a single copier), or a collective's copies into and out of
// its shared segments (every rank of the host copying at once).
enum class CopyUse { window, collective };

// Copy n bytes between non-overlapping buffers; the stores are globally visible when it returns.
//   - window: one memcpy up to half the last-level cache (source and destination can stay in the cache);
//   - collective: one memcpy below 1 MiB, then memcpy in 64 KiB pieces up to half the last-level cache;
//   - both, larger: non-temporal (streaming) AVX2 stores where the CPU has them, so the copy does not first
//     read every destination line into the cache and then evict the source; else 64 KiB pieces (glibc turns
//     one large memcpy into a single `rep movsb`, which on AMD Zen ran at 60-70% of the speed of the same
//     bytes in pieces beyond the cache).
// Measured on the AMD EPYC VM (2026-11-25): a single window copier is level with the pieces within the cache
// (bench/window_copy.py) and faster in same-host window gets (16 MiB: 17-25 against 7-9 GB/s,
// bench/memory.py); 2-rank allgathers of 4 MiB were slower with one memcpy (366-472 against 339-351 us,
// bench/collectives.py), so collectives keep the pieces.
// SUPERKERNEL_STREAM_COPY_BYTES overrides the streaming threshold (0: never stream).
void copy_bytes(void* dst, const void* src, size_t n, CopyUse use = CopyUse::collective);

// How copy_bytes copies n bytes: "memcpy", "pieces" or "stream" (for tests and benchmarks).
const char* copy_method(size_t n, CopyUse use = CopyUse::collective);

}  // namespace mk
