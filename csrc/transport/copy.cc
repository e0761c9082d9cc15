#include "transport/copy.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mk {
namespace {

constexpr size_t kSmall = size_t(1) << 20;
constexpr size_t kPiece = size_t(64) << 10;

// The size of one last-level cache instance: sysfs first (what the kernel was told about this core's cache),
// then sysconf (glibc reads cpuid, which in a VM can report the whole host's cache: 384 MiB seen here where
// each core's L3 is 32 MiB). 0 when unknown.
size_t last_level_cache_bytes() {
  for (int index = 4; index >= 2; --index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level(dir + "level"), size(dir + "size");
    int lv = 0;
    std::string text;
    if (!(level >> lv) || !(size >> text) || lv < 2 || text.empty()) continue;
    size_t n = size_t(std::strtoull(text.c_str(), nullptr, 10));
    const char unit = text.back();
    if (unit == 'K') n <<= 10;
    if (unit == 'M') n <<= 20;
    if (n) return n;
  }
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);  // 0 or -1 when unknown
  return l3 > 0 ? size_t(l3) : 0;
}

// Half the last-level cache: up to here a copy's source and destination can both stay in the cache.
size_t cache_half() {
  static const size_t half = [] {
    const size_t l3 = last_level_cache_bytes();
    return l3 ? l3 / 2 : size_t(16) << 20;
  }();
  return half;
}

size_t stream_threshold() {
  static const size_t threshold = [] {
    if (const char* v = std::getenv("SUPERKERNEL_STREAM_COPY_BYTES"); v && *v) {
      const long long n = std::atoll(v);
      return n <= 0 ? SIZE_MAX : size_t(n);
    }
    return cache_half();
  }();
  return threshold;
}

#if defined(__x86_64__)
bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

__attribute__((target("avx2"))) void stream_copy(char* d, const char* s, size_t n) {
  const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;  // align the stores to 32 bytes
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before anything that follows
}
#endif

// Streaming stores only from 1 MiB, whatever the threshold says (stream_copy's alignment head needs n >= 32,
// and a smaller block is cheaper to bring through the cache).
bool streams(size_t n) {
#if defined(__x86_64__)
  return n >= kSmall && n > stream_threshold() && have_avx2();
#else
  (void)n;
  return false;
#endif
}

// Up to here (inclusive) a copy is one memcpy, when it does not stream.
size_t single_copy_limit(CopyUse use) { return use == CopyUse::window ? cache_half() : kSmall - 1; }

}  // namespace

const char* copy_method(size_t n, CopyUse use) {
  if (streams(n)) return "stream";
  return n <= single_copy_limit(use) ? "memcpy" : "pieces";
}

void copy_bytes(void* dst, const void* src, size_t n, CopyUse use) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__x86_64__)
  if (streams(n)) {
    stream_copy(d, s, n);
    return;
  }
#endif
  if (n <= single_copy_limit(use)) {
    if (n) std::memcpy(d, s, n);
    return;
  }
  for (size_t i = 0; i < n; i += kPiece) std::memcpy(d + i, s + i, n - i < kPiece ? n - i : kPiece);
}

}  // namespace mk
