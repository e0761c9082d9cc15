// Element types and reductions of the mk transport (no torch types here; the adapter maps them).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mk {

enum class DType : uint8_t { f32, f64, f16, bf16, i8, u8, i16, i32, i64, boolean };
enum class RedOp : uint8_t { sum, prod, min, max, band, bor, bxor, avg };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* redop_name(RedOp op);
bool is_floating(DType t);

// Throws mk::Error naming `what` when op is not defined for dtype (bitwise ops on floats).
void check_reducible(DType t, RedOp op, const std::string& what);

// out[i] = op(srcs[0][i], ..., srcs[n-1][i]) for i < count. fp16/bf16 accumulate in fp32 and round once.
// out may alias any of srcs. AVG is summed here; call finish_avg afterwards.
void reduce_many(void* out, const void* const* srcs, int nsrc, size_t count, DType t, RedOp op);

// The same for fp16/bf16 terms, with the fp32 result left unrounded in `out` (a host's partial sum that
// still has terms to meet elsewhere). Throws mk::Error for other types.
void reduce_many_to_f32(float* out, const void* const* srcs, int nsrc, size_t count, DType t, RedOp op);

// AVG: divide the summed buffer by `n` (integers: truncating division, as torch does for integer AVG).
void finish_avg(void* buf, size_t count, DType t, int n);

// Widen half types to fp32 and back (rings over TCP carry fp32 partial sums for half inputs).
void to_f32(float* out, const void* in, size_t count, DType t);
void from_f32(void* out, const float* in, size_t count, DType t);

}  // namespace mk
