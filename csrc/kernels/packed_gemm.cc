// MKL's packed sgemm, found at run time (see packed_gemm.h).
#include "kernels/packed_gemm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>

// MKL's CBLAS packed routines (LP64: 32-bit integers), declared weak: null where the process has no MKL.
// The enumerations are MKL's (mkl_cblas.h), passed as ints as C passes them.
extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace mk::kernels {

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// SUPERKERNEL_OPS_PACKED_B: "0" never packs, "all" packs for any two or more products (the tests' way onto
// this path at small shapes), else where packed_gemm_pays says so: unset, where the probe found packing
// faster too (packed_gemm_offer); "1", whatever the probe would find.
enum class PackSetting { off, pays, all };
PackSetting pack_setting(bool* forced = nullptr) {
  const char* v = std::getenv("SUPERKERNEL_OPS_PACKED_B");
  if (forced) *forced = v && *v;
  if (v && std::strcmp(v, "0") == 0) return PackSetting::off;
  if (v && std::strcmp(v, "all") == 0) return PackSetting::all;
  return PackSetting::pays;
}

std::atomic<int64_t> g_packed_products{0};

}  // namespace

bool packed_gemm_present() { return cblas_sgemm_pack_get_size && cblas_sgemm_pack && cblas_sgemm_compute; }

bool packed_gemm_available() { return packed_gemm_present() && pack_setting() != PackSetting::off; }

bool packed_gemm_pays(int64_t gemms, int64_t rows, int64_t k, int64_t n) {
  if (!packed_gemm_present() || rows <= 0 || gemms < 2) return false;
  switch (pack_setting()) {
    case PackSetting::off: return false;
    case PackSetting::all: return true;
    case PackSetting::pays: break;
  }
  return gemms >= kPackedMinGemms && k * n >= kPackedMinElements;
}

PackProbe packed_gemm_probe() {
  static std::mutex mu;
  static std::optional<PackProbe> done;
  std::lock_guard<std::mutex> lock(mu);  // (a second caller waits for the first one's timing)
  if (done) return *done;
  if (!packed_gemm_present()) return *(done = PackProbe{});
  if (!packed_gemm_available()) return {};  // (SUPERKERNEL_OPS_PACKED_B=0 for now: timed once it allows packing)
  [&] {
    constexpr int64_t m = 512, k = 1024, n = 1024, blocks = 4, rows = m / blocks;
    // (constant operands: a GEMM's time does not depend on normal values, and the process's RNG stays untouched)
    at::Tensor a = at::full({m, k}, 0.5f), b = at::full({k, n}, 0.25f), c = at::empty({m, n});
    int64_t made = 0;  // (the probe's products are not the ops': taken off packed_products() after)
    auto plain = [&] {
      for (int64_t i = 0; i < blocks; ++i) {
        at::Tensor dst = c.narrow(0, i * rows, rows);
        at::mm_out(dst, a.narrow(0, i * rows, rows), b);
      }
    };
    auto packed = [&] {  // (the packing itself inside, as an op pays it once per call)
      PackedB pb(b, rows);
      for (int64_t i = 0; i < blocks; ++i, ++made)
        if (pb.empty() || !pb.into(c.narrow(0, i * rows, rows), a.narrow(0, i * rows, rows))) return false;
      return true;
    };
    auto ms = [](auto&& fn) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    plain();  // warm-up of each
    if (!packed()) {
      g_packed_products.fetch_sub(made);
      done = PackProbe{};
      return;
    }
    double best_plain = std::numeric_limits<double>::infinity(), best_packed = best_plain;
    for (int i = 0; i < 4; ++i) {
      best_plain = std::min(best_plain, ms(plain));
      best_packed = std::min(best_packed, ms(packed));
    }
    g_packed_products.fetch_sub(made);
    done = PackProbe{best_plain, best_packed, best_packed <= kPackedProbeRatio * best_plain};
  }();
  return *done;
}

bool packed_gemm_offer() {
  if (!packed_gemm_present()) return false;
  bool forced = false;
  switch (pack_setting(&forced)) {
    case PackSetting::off: return false;
    case PackSetting::all: return true;
    case PackSetting::pays: return forced || packed_gemm_probe().pays;
  }
  return false;
}

int64_t packed_products() { return g_packed_products.load(); }

PackedB::PackedB(const at::Tensor& b, int64_t rows) {
  if (!packed_gemm_available() || !b.defined() || b.dim() != 2 || b.scalar_type() != at::kFloat ||
      !b.device().is_cpu())
    return;
  const int64_t k = b.size(0), n = b.size(1);
  if (k == 0 || n == 0 || !fits_int(k) || !fits_int(n) || !fits_int(rows) || rows == 0) return;
  // row-major b [k, n] with leading dimension stride(0), or its transpose stored row-major [n, k]
  int trans = 0;
  int64_t ld = 0;
  if (b.stride(1) == 1 && b.stride(0) >= n) {
    trans = kNoTrans;
    ld = b.stride(0);
  } else if (b.stride(0) == 1 && b.stride(1) >= k) {
    trans = kTrans;
    ld = b.stride(1);
  } else {
    return;
  }
  if (!fits_int(ld) || ld == 0) return;
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, int(rows), int(n), int(k));
  if (bytes == 0) return;
  at::Tensor buf = at::empty({int64_t(bytes)}, b.options().dtype(at::kByte));  // (64-byte aligned)
  cblas_sgemm_pack(kRowMajor, kBMatrix, trans, int(rows), int(n), int(k), 1.0f, b.const_data_ptr<float>(),
                   int(ld), static_cast<float*>(buf.data_ptr()));
  buf_ = std::move(buf);
  k_ = k;
  n_ = n;
}

bool PackedB::into(const at::Tensor& dst, const at::Tensor& rows) const {
  if (empty() || dst.scalar_type() != at::kFloat || rows.scalar_type() != at::kFloat || dst.dim() != 2 ||
      rows.dim() != 2 || !dst.device().is_cpu() || !rows.device().is_cpu())
    return false;
  const int64_t m = rows.size(0);
  if (rows.size(1) != k_ || dst.size(0) != m || dst.size(1) != n_ || !fits_int(m)) return false;
  if (m == 0) return true;
  // (a 1-row tensor's stride(0) may be anything: the leading dimension is then only required to be >= k / n)
  int transa = 0;
  int64_t lda = 0;
  if (rows.stride(1) == 1 && (rows.stride(0) >= k_ || m == 1)) {
    transa = kNoTrans;
    lda = m == 1 ? k_ : rows.stride(0);
  } else if (rows.stride(0) == 1 && (rows.stride(1) >= m || k_ == 1)) {
    transa = kTrans;
    lda = k_ == 1 ? m : rows.stride(1);
  } else {
    return false;
  }
  if (dst.stride(1) != 1 || !(dst.stride(0) >= n_ || m == 1)) return false;
  const int64_t ldc = m == 1 ? n_ : dst.stride(0);
  if (!fits_int(lda) || !fits_int(ldc) || lda == 0 || ldc == 0) return false;
  cblas_sgemm_compute(kRowMajor, transa, kPacked, int(m), int(n_), int(k_), rows.const_data_ptr<float>(), int(lda),
                      static_cast<const float*>(buf_.const_data_ptr()), int(n_), 0.0f, dst.data_ptr<float>(),
                      int(ldc));
  g_packed_products.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace mk::kernels
