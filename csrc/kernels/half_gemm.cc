// Which form the ops multiply half types (bf16, fp16) in on the CPU: as they are (oneDNN) or on operands
// widened to fp32 and rounded once (see native_half_gemm and small_half_limit in kernels/pipeline.h).
#include "kernels/pipeline.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mk::kernels {

namespace {

// SUPERKERNEL_OPS_WIDEN_HALF: the half types to widen ("1": both; "bfloat16", "float16", or both with a comma).
struct WidenHalf {
  bool bf16 = false, fp16 = false;
  std::string problem;
};
WidenHalf widen_half_from_env() {
  WidenHalf w;
  const char* v = std::getenv("SUPERKERNEL_OPS_WIDEN_HALF");
  const std::string value = v ? v : "";
  if (value.empty() || value == "0") return w;
  if (value == "1") {
    w.bf16 = w.fp16 = true;
    return w;
  }
  size_t begin = 0;
  while (begin <= value.size()) {
    const size_t end = std::min(value.find(',', begin), value.size());
    const std::string name = value.substr(begin, end - begin);
    if (name == "bfloat16") {
      w.bf16 = true;
    } else if (name == "float16") {
      w.fp16 = true;
    } else {
      w.problem = c10::str("SUPERKERNEL_OPS_WIDEN_HALF=", value, ": expected 1, 0, or bfloat16 and/or float16 "
                           "separated by a comma (", name.empty() ? "an empty name" : "'" + name + "'", ")");
      return w;
    }
    begin = end + 1;
  }
  return w;
}

}  // namespace

bool native_half_gemm(at::ScalarType t, const c10::Device& device) {
  if (!device.is_cpu() || (t != at::kBFloat16 && t != at::kHalf)) return false;
  static const WidenHalf widen = widen_half_from_env();
  TORCH_CHECK(widen.problem.empty(), widen.problem);
  if (t == at::kBFloat16 ? widen.bf16 : widen.fp16) return false;
  // ATen registers oneDNN's device checks as ops (absent from a build without oneDNN: then false).
  auto supported = [](const char* name) {
    auto op = c10::Dispatcher::singleton().findSchema({name, ""});
    return op.has_value() && op->typed<bool()>().call();
  };
  static const bool bf16 = supported("mkldnn::_is_mkldnn_bf16_supported");
  static const bool fp16 = supported("mkldnn::_is_mkldnn_fp16_supported");
  return t == at::kBFloat16 ? bf16 : fp16;
}

namespace {

// The median seconds of `reps` calls of each of f and g, called in turn (so that the machine's drift reaches
// both alike), after `warm` untimed calls of each.
template <typename F, typename G>
std::pair<double, double> median_seconds(F&& f, G&& g, int warm, int reps) {
  for (int i = 0; i < warm; ++i) {
    f();
    g();
  }
  std::vector<double> sf(size_t(reps), 0.0), sg(size_t(reps), 0.0);
  auto time = [](auto& call) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (size_t i = 0; i < size_t(reps); ++i) {
    sf[i] = time(f);
    sg[i] = time(g);
  }
  const size_t mid = size_t(reps / 2);
  std::nth_element(sf.begin(), sf.begin() + long(mid), sf.end());
  std::nth_element(sg.begin(), sg.begin() + long(mid), sg.end());
  return {sf[mid], sg[mid]};
}

// The small-GEMM limit of `t` on this CPU, with this process's ATen threads: a [rows, k] x [k, n] product as
// it is (oneDNN) and widened (a widened on every call, b once, as Products does) and rounded, timed at two
// sizes, 32x64x64 (2^17 multiply-adds, where oneDNN's fixed cost per call dominates) and 128x256x256
// (kSmallHalfGemm), the two forms in turn, 15 calls each. Each form is a line, fixed cost plus a cost per
// multiply-add, through its two medians; the limit is where the lines cross, rounded down to a power of two
// (ranks on one host then mostly agree): 0 when widening is not faster even at the small size,
// kSmallHalfGemm when it is faster at both. 7-25 ms at a process's first half-type GEMM op (AMD EPYC VM).
// SUPERKERNEL_OPS_TRACE prints the medians and the limit.
int64_t calibrate_small_half(at::ScalarType t) {
  struct Size {
    int64_t rows, k, n;
  };
  const Size sizes[2] = {{32, 64, 64}, {128, 256, 256}};
  double native[2], widened[2], macs[2];
  for (size_t i = 0; i < 2; ++i) {
    const Size z = sizes[i];
    const auto o = at::TensorOptions().dtype(t);
    // (values that keep every product finite in both types; the GEMM's time does not depend on them)
    const at::Tensor a = at::empty({z.rows, z.k}, o).fill_(0.5), b = at::empty({z.k, z.n}, o).fill_(0.25);
    const at::Tensor b_wide = b.to(at::kFloat);
    at::Tensor out = at::empty({z.rows, z.n}, o);
    std::tie(native[i], widened[i]) = median_seconds([&] { at::mm_out(out, a, b); },
                                                     [&] { out.copy_(at::mm(a.to(at::kFloat), b_wide)); }, 3, 15);
    macs[i] = double(z.rows) * double(z.k) * double(z.n);
  }
  int64_t limit = 0;
  if (widened[1] <= native[1]) {
    limit = int64_t(kSmallHalfGemm);
  } else if (widened[0] < native[0]) {
    // (widened is faster at the small size and slower at the large one, so the lines cross between them)
    const double per_native = (native[1] - native[0]) / (macs[1] - macs[0]);
    const double per_widened = (widened[1] - widened[0]) / (macs[1] - macs[0]);
    const double cross = macs[0] + (native[0] - widened[0]) / (per_widened - per_native);
    limit = int64_t(std::exp2(std::floor(std::log2(std::clamp(cross, macs[0], kSmallHalfGemm)))));
  }
  if (Pipeline::tracing())
    std::fprintf(stderr, "[mk small_half_limit %s] as it is / widened, ms: %.4f / %.4f (32x64x64), %.4f / %.4f "
                 "(128x256x256): at most %lld multiply-adds widened\n", c10::toString(t), native[0] * 1e3,
                 widened[0] * 1e3, native[1] * 1e3, widened[1] * 1e3, (long long)limit);
  return limit;
}

}  // namespace

int64_t small_half_setting() {
  static const std::pair<int64_t, std::string> from_env = [] {
    std::string problem;
    const int64_t v = env_integer("SUPERKERNEL_OPS_SMALL_HALF_GEMM", -1, 0, problem);
    return std::make_pair(v, problem);
  }();
  TORCH_CHECK(from_env.second.empty(), from_env.second, " (the most multiply-adds of a half-type GEMM the ops make ",
              "widened to fp32; unset: measured on this CPU)");
  return from_env.first;
}

int64_t small_half_limit(at::ScalarType t) {
  if ((t != at::kBFloat16 && t != at::kHalf) || !native_half_gemm(t, c10::Device(c10::kCPU))) return 0;
  if (small_half_setting() >= 0) return small_half_setting();
  static const int64_t bf16 = calibrate_small_half(at::kBFloat16);
  if (t == at::kBFloat16) return bf16;
  static const int64_t fp16 = calibrate_small_half(at::kHalf);
  return fp16;
}

}  // namespace mk::kernels
