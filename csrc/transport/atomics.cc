#include "transport/atomics.h"

#include <algorithm>
#include <cstring>

#include "transport/error.h"

namespace mk {
namespace {

template <typename T>
T apply(T a, T b, RedOp op) {
  switch (op) {
    case RedOp::min: return std::min(a, b);
    case RedOp::max: return std::max(a, b);
    default: return T(a + b);
  }
}

// Integers: fetch_add for sums, CAS loops for min/max.
template <typename T>
void acc_int(void* dst, const void* src, size_t count, RedOp op) {
  T* d = static_cast<T*>(dst);
  const char* s = static_cast<const char*>(src);
  for (size_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, s + i * sizeof(T), sizeof(T));
    if (op == RedOp::sum) {
      __atomic_fetch_add(d + i, v, __ATOMIC_SEQ_CST);
      continue;
    }
    T old = __atomic_load_n(d + i, __ATOMIC_RELAXED);
    while (true) {
      T next = apply(old, v, op);
      if (next == old) break;  // min/max that changes nothing needs no store
      if (__atomic_compare_exchange_n(d + i, &old, next, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) break;
    }
  }
}

// Floating types: CAS loop on the element's bits. Half types widen to fp32 for the operation.
template <typename Bits, typename Compute>
void acc_float(void* dst, const void* src, size_t count, RedOp op, DType t) {
  Bits* d = static_cast<Bits*>(dst);
  const char* s = static_cast<const char*>(src);
  for (size_t i = 0; i < count; ++i) {
    Bits vbits;
    std::memcpy(&vbits, s + i * sizeof(Bits), sizeof(Bits));
    Bits old = __atomic_load_n(d + i, __ATOMIC_RELAXED);
    while (true) {
      Bits next;
      if constexpr (sizeof(Bits) == sizeof(Compute)) {
        Compute a, b;
        std::memcpy(&a, &old, sizeof(a));
        std::memcpy(&b, &vbits, sizeof(b));
        Compute r = apply(a, b, op);
        std::memcpy(&next, &r, sizeof(next));
      } else {  // fp16 / bf16
        float a, b;
        to_f32(&a, &old, 1, t);
        to_f32(&b, &vbits, 1, t);
        float r = apply(a, b, op);
        from_f32(&next, &r, 1, t);
      }
      if (next == old && op != RedOp::sum) break;
      if (__atomic_compare_exchange_n(d + i, &old, next, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) break;
    }
  }
}

}  // namespace

void check_accumulate(DType t, RedOp op, const char* what) {
  if (op != RedOp::sum && op != RedOp::min && op != RedOp::max)
    throw Error(cat(what, ": accumulate supports the ops sum, min and max, not ", redop_name(op)));
  if (t == DType::boolean) throw Error(cat(what, ": accumulate is not defined for bool windows"));
}

void atomic_accumulate(void* dst, const void* src, size_t count, DType t, RedOp op) {
  check_accumulate(t, op, "mk accumulate");
  switch (t) {
    case DType::f32: return acc_float<uint32_t, float>(dst, src, count, op, t);
    case DType::f64: return acc_float<uint64_t, double>(dst, src, count, op, t);
    case DType::f16:
    case DType::bf16: return acc_float<uint16_t, float>(dst, src, count, op, t);
    case DType::i8: return acc_int<int8_t>(dst, src, count, op);
    case DType::u8: return acc_int<uint8_t>(dst, src, count, op);
    case DType::i16: return acc_int<int16_t>(dst, src, count, op);
    case DType::i32: return acc_int<int32_t>(dst, src, count, op);
    case DType::i64: return acc_int<int64_t>(dst, src, count, op);
    case DType::boolean: break;
  }
  throw Error("mk accumulate: unsupported dtype");
}

int64_t atomic_i64(void* p, AmoOp op, int64_t a, int64_t b) {
  auto* q = static_cast<int64_t*>(p);
  if (op == AmoOp::fetch_add) return __atomic_fetch_add(q, a, __ATOMIC_SEQ_CST);
  int64_t expected = a;
  __atomic_compare_exchange_n(q, &expected, b, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;  // the old value whether or not the swap happened
}

}  // namespace mk
