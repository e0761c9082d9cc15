#include "transport/reduce.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "transport/error.h"

namespace mk {
namespace {

constexpr size_t kBlock = 2048;  // elements per accumulation block (fits in L1 as fp32)

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                      // round to nearest even
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return float(v);
}
inline uint16_t f32_to_f16(float f) {
  _Float16 v = _Float16(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

// fp16 <-> fp32 in bulk with F16C (vcvtph2ps / vcvtps2ph, 8 at a time, round to nearest even as the
// _Float16 conversion; every x86-64 since 2013). The element-by-element loop through _Float16 is not
// vectorised: mk's allreduce of 1 Mi fp16 elements on 2 ranks, one host, took 8.7 ms against 1.2 ms for bf16.
bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}
__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* s, float* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) d[i] = _cvtsh_ss(s[i]);
}
__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* s, uint16_t* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) d[i] = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
template <bool BF16>
inline void half_to_f32(const uint16_t* s, float* d, size_t n, bool f16c) {
  if constexpr (!BF16) {
    if (f16c) return f16_to_f32_f16c(s, d, n);
  }
  for (size_t i = 0; i < n; ++i) d[i] = BF16 ? bf16_to_f32(s[i]) : f16_to_f32(s[i]);
}
template <bool BF16>
inline void f32_to_half(const float* s, uint16_t* d, size_t n, bool f16c) {
  if constexpr (!BF16) {
    if (f16c) return f32_to_f16_f16c(s, d, n);
  }
  for (size_t i = 0; i < n; ++i) d[i] = BF16 ? f32_to_bf16(s[i]) : f32_to_f16(s[i]);
}

template <typename T, typename Acc>
struct Ops {
  static Acc apply(RedOp op, Acc a, Acc b) {
    switch (op) {
      case RedOp::sum:
      case RedOp::avg:
        return a + b;
      case RedOp::prod:
        return a * b;
      case RedOp::min:
        return b < a ? b : a;
      case RedOp::max:
        return a < b ? b : a;
      default:
        if constexpr (std::is_integral_v<Acc>) {
          if (op == RedOp::band) return a & b;
          if (op == RedOp::bor) return a | b;
          return a ^ b;
        } else {
          return a;  // unreachable: check_reducible rejects bitwise ops on floats
        }
    }
  }
};

// The same loop for every op, specialised per op so the compiler vectorises it.
template <typename Acc, RedOp OP>
inline void combine(Acc* __restrict acc, const Acc* __restrict in, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if constexpr (OP == RedOp::sum || OP == RedOp::avg) acc[i] += in[i];
    else if constexpr (OP == RedOp::prod) acc[i] *= in[i];
    else if constexpr (OP == RedOp::min) acc[i] = in[i] < acc[i] ? in[i] : acc[i];
    else if constexpr (OP == RedOp::max) acc[i] = acc[i] < in[i] ? in[i] : acc[i];
    else acc[i] = Ops<Acc, Acc>::apply(OP, acc[i], in[i]);
  }
}

template <typename T, RedOp OP>
__attribute__((target_clones("arch=haswell", "default"))) void reduce_plain(
    T* out, const void* const* srcs, int nsrc, size_t count) {
  T acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    std::memcpy(acc, static_cast<const T*>(srcs[0]) + base, n * sizeof(T));
    for (int j = 1; j < nsrc; ++j) combine<T, OP>(acc, static_cast<const T*>(srcs[j]) + base, n);
    std::memcpy(out + base, acc, n * sizeof(T));
  }
}

// (WIDE_OUT: the fp32 result is written as it is, not rounded; `out` is then float*)
template <bool BF16, RedOp OP, bool WIDE_OUT = false>
__attribute__((target_clones("arch=haswell", "default"))) void reduce_half(
    void* out, const void* const* srcs, int nsrc, size_t count) {
  float acc[kBlock];
  float tmp[kBlock];
  const bool f16c = has_f16c();
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    half_to_f32<BF16>(static_cast<const uint16_t*>(srcs[0]) + base, acc, n, f16c);
    for (int j = 1; j < nsrc; ++j) {
      half_to_f32<BF16>(static_cast<const uint16_t*>(srcs[j]) + base, tmp, n, f16c);
      combine<float, OP>(acc, tmp, n);
    }
    if constexpr (WIDE_OUT)
      std::memcpy(static_cast<float*>(out) + base, acc, n * sizeof(float));
    else
      f32_to_half<BF16>(acc, static_cast<uint16_t*>(out) + base, n, f16c);
  }
}

template <template <RedOp> class F, typename... A>
void dispatch_op(RedOp op, A&&... a) {
  switch (op) {
    case RedOp::sum: return F<RedOp::sum>::run(a...);
    case RedOp::avg: return F<RedOp::sum>::run(a...);
    case RedOp::prod: return F<RedOp::prod>::run(a...);
    case RedOp::min: return F<RedOp::min>::run(a...);
    case RedOp::max: return F<RedOp::max>::run(a...);
    case RedOp::band: return F<RedOp::band>::run(a...);
    case RedOp::bor: return F<RedOp::bor>::run(a...);
    case RedOp::bxor: return F<RedOp::bxor>::run(a...);
  }
}

template <typename T>
struct Plain {
  template <RedOp OP>
  struct F {
    static void run(void* out, const void* const* s, int n, size_t c) {
      if constexpr (!std::is_integral_v<T> &&
                    (OP == RedOp::band || OP == RedOp::bor || OP == RedOp::bxor)) {
        return;
      } else {
        reduce_plain<T, OP>(static_cast<T*>(out), s, n, c);
      }
    }
  };
};
template <bool BF16, bool WIDE_OUT = false>
struct Half {
  template <RedOp OP>
  struct F {
    static void run(void* out, const void* const* s, int n, size_t c) {
      if constexpr (OP == RedOp::band || OP == RedOp::bor || OP == RedOp::bxor) {
        return;
      } else {
        reduce_half<BF16, OP, WIDE_OUT>(out, s, n, c);
      }
    }
  };
};

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: case DType::i16: return 2;
    case DType::i8: case DType::u8: case DType::boolean: return 1;
  }
  return 1;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i8: return "int8";
    case DType::u8: return "uint8";
    case DType::i16: return "int16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::boolean: return "bool";
  }
  return "?";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::sum: return "SUM";
    case RedOp::prod: return "PRODUCT";
    case RedOp::min: return "MIN";
    case RedOp::max: return "MAX";
    case RedOp::band: return "BAND";
    case RedOp::bor: return "BOR";
    case RedOp::bxor: return "BXOR";
    case RedOp::avg: return "AVG";
  }
  return "?";
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

void check_reducible(DType t, RedOp op, const std::string& what) {
  if (is_floating(t) && (op == RedOp::band || op == RedOp::bor || op == RedOp::bxor))
    throw Error(cat(what, ": ReduceOp ", redop_name(op), " is not defined for ", dtype_name(t)));
  if (t == DType::boolean && op == RedOp::avg)
    throw Error(cat(what, ": ReduceOp AVG is not defined for bool"));
}

void reduce_many(void* out, const void* const* srcs, int nsrc, size_t count, DType t, RedOp op) {
  if (count == 0) return;
  if (nsrc == 1) {
    if (out != srcs[0]) std::memmove(out, srcs[0], count * dtype_size(t));
    return;
  }
  switch (t) {
    case DType::f32: return dispatch_op<Plain<float>::F>(op, out, srcs, nsrc, count);
    case DType::f64: return dispatch_op<Plain<double>::F>(op, out, srcs, nsrc, count);
    case DType::i8: return dispatch_op<Plain<int8_t>::F>(op, out, srcs, nsrc, count);
    case DType::u8: return dispatch_op<Plain<uint8_t>::F>(op, out, srcs, nsrc, count);
    case DType::i16: return dispatch_op<Plain<int16_t>::F>(op, out, srcs, nsrc, count);
    case DType::i32: return dispatch_op<Plain<int32_t>::F>(op, out, srcs, nsrc, count);
    case DType::i64: return dispatch_op<Plain<int64_t>::F>(op, out, srcs, nsrc, count);
    case DType::f16: return dispatch_op<Half<false>::F>(op, out, srcs, nsrc, count);
    case DType::bf16: return dispatch_op<Half<true>::F>(op, out, srcs, nsrc, count);
    case DType::boolean: {
      // bool as 0/1 bytes: SUM/MAX are OR, PRODUCT/MIN are AND; bitwise ops act on the bytes.
      RedOp b = op;
      if (op == RedOp::sum) b = RedOp::max;
      if (op == RedOp::prod) b = RedOp::min;
      return dispatch_op<Plain<uint8_t>::F>(b, out, srcs, nsrc, count);
    }
  }
}

void reduce_many_to_f32(float* out, const void* const* srcs, int nsrc, size_t count, DType t, RedOp op) {
  if (count == 0) return;
  if (t == DType::f16) return dispatch_op<Half<false, true>::F>(op, out, srcs, nsrc, count);
  if (t == DType::bf16) return dispatch_op<Half<true, true>::F>(op, out, srcs, nsrc, count);
  throw Error(cat("mk reduce_many_to_f32: ", dtype_name(t), " is not a half type"));
}

void finish_avg(void* buf, size_t count, DType t, int n) {
  auto div = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (size_t i = 0; i < count; ++i) p[i] = T(p[i] / T(n));
  };
  switch (t) {
    case DType::f32: return div(static_cast<float*>(buf));
    case DType::f64: return div(static_cast<double*>(buf));
    case DType::i8: return div(static_cast<int8_t*>(buf));
    case DType::u8: return div(static_cast<uint8_t*>(buf));
    case DType::i16: return div(static_cast<int16_t*>(buf));
    case DType::i32: return div(static_cast<int32_t*>(buf));
    case DType::i64: return div(static_cast<int64_t*>(buf));
    case DType::f16:
    case DType::bf16: {
      uint16_t* p = static_cast<uint16_t*>(buf);
      const bool bf = t == DType::bf16;
      for (size_t i = 0; i < count; ++i) {
        float f = (bf ? bf16_to_f32(p[i]) : f16_to_f32(p[i])) / float(n);
        p[i] = bf ? f32_to_bf16(f) : f32_to_f16(f);
      }
      return;
    }
    case DType::boolean:
      return;
  }
}

void to_f32(float* out, const void* in, size_t count, DType t) {
  const uint16_t* p = static_cast<const uint16_t*>(in);
  if (t == DType::bf16)
    half_to_f32<true>(p, out, count, false);
  else
    half_to_f32<false>(p, out, count, has_f16c());
}

void from_f32(void* out, const float* in, size_t count, DType t) {
  uint16_t* p = static_cast<uint16_t*>(out);
  if (t == DType::bf16)
    f32_to_half<true>(in, p, count, false);
  else
    f32_to_half<false>(in, p, count, has_f16c());
}

}  // namespace mk
