// One fp32 right-hand matrix b, packed once for several products rows @ b (MKL's packed sgemm).
//
// ATen's fp32 matmul on x86 calls MKL's sgemm, which packs b into its blocked layout on every call. The ops
// split one product into row chunks (pipelined behind their transfers), and each chunk's GEMM packed all of
// b again: on the 2-core VM, 1024x1536x2048 fp32 made as eight 128-row GEMMs took 55 ms against 40 ms as one
// (bench/packed_gemm.py). PackedB packs b once per op call and multiplies each chunk from the packed copy.
//
// MKL's packed routines are found at run time in the libtorch this process loaded (torch's x86 wheels carry
// MKL and export its CBLAS symbols); where they are absent (another BLAS, another architecture), or with
// SUPERKERNEL_OPS_PACKED_B=0, nothing is packed and the ops multiply with ATen as before. A packed product may
// differ from ATen's in the last bit, so the ops pack only where every rank of the group offers to
// (packed_gemm_offer, agreed): allgather_gemm's output is the same bytes on every rank only when every rank
// makes each block the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mk::kernels {

// Whether MKL's packed sgemm was found in this process (whatever SUPERKERNEL_OPS_PACKED_B says).
bool packed_gemm_present();

// Whether this process can pack (MKL's packed sgemm found) and SUPERKERNEL_OPS_PACKED_B does not say 0 (read
// on every call, so a benchmark can compare both in one process).
bool packed_gemm_available();

// Whether `gemms` products of at most `rows` rows each against b [k, n] are worth packing b for: at least
// kPackedMinGemms GEMMs and b of at least kPackedMinElements elements (SUPERKERNEL_OPS_PACKED_B=all: any two
// or more). Measured on the 2-core VM, one thread (bench/packed_gemm.py, 2026-11-30): in 8 row blocks,
// 1024x1536x2048 1.25x, 1024x768x2048 1.36x, 512x1024x1024 1.10x faster packed; in 2 blocks 0.99-1.02x; b of
// 128x1024 0.97-1.03x, 256x256 0.84-0.88x (MKL's own per-call work on a small b costs less than a packed call).
bool packed_gemm_pays(int64_t gemms, int64_t rows, int64_t k, int64_t n);
constexpr int64_t kPackedMinGemms = 3;
constexpr int64_t kPackedMinElements = int64_t(1) << 18;

// Whether packing pays on this processor at all, timed once per process (the first time an op asks): a
// 512x1024x1024 product in four 128-row blocks, with ATen's matmul and from b packed once, interleaved, the
// best of four each. Packing pays when the packed blocks took at most kPackedProbeRatio of the plain ones. MKL
// does not pack alike on every processor: on the Intel VM (2026-11-30) packed row blocks were 1.00-1.36x faster
// than plain ones, 512x1024x1024 in 4 blocks 1.10x; on an AMD EPYC of family 26 (2026-12-01, one thread,
// bench/packed_gemm.py) 0.84-1.04x, 512-row blocks of 1536x2048 b 0.90-0.93x, 512x1024x1024 in 4 blocks 0.96x.
struct PackProbe {
  double plain_ms = 0, packed_ms = 0;  // the best time of each form (0 when nothing was timed)
  bool pays = false;
};
constexpr double kPackedProbeRatio = 0.97;
PackProbe packed_gemm_probe();  // (times it on the first call; MKL's packed sgemm absent: nothing timed)
// What this process offers to a GEMM op's agreement for its fp32 products: SUPERKERNEL_OPS_PACKED_B unset, the
// probe's verdict; "1" or "all", yes (the size rule alone, without the probe); "0" or no MKL, no. Every rank's
// offer is agreed (the smallest) before b is packed, so ranks that differ in it (another processor, another
// setting) make every block alike, and allgather_gemm's output stays the same bytes on every rank.
bool packed_gemm_offer();
// How many products were made from a packed b in this process (the tests' proof that packing ran).
int64_t packed_products();

class PackedB {
 public:
  // Packs b (fp32, on the CPU, 2-D with a unit stride in either dimension); empty() when it cannot (then
  // into() always declines). `rows`: the most rows one product will have (what MKL sizes the packing for).
  PackedB(const at::Tensor& b, int64_t rows);
  bool empty() const { return !buf_.defined(); }
  // dst = rows @ b from the packed b: dst fp32 [r, n] and rows fp32 [r, k], each with unit stride along its
  // rows. false (dst untouched) where that does not hold: the caller multiplies with ATen.
  bool into(const at::Tensor& dst, const at::Tensor& rows) const;

 private:
  at::Tensor buf_;  // MKL's packed copy of b (bytes); it must not move once packed
  int64_t k_ = 0, n_ = 0;
};

}  // namespace mk::kernels
