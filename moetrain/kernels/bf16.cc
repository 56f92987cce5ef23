// bfloat16 values in fp32 storage (bf16 compute emulated on the CPU, docs/precision.md):
//
//   RoundBF16  x [...] fp32 -> y [...] fp32, each value rounded to bfloat16 (to nearest, ties to even;
//              infinities stay, a NaN stays a NaN)
//
// One multi-threaded pass, where MindSpore's two casts (fp32 -> bf16 -> fp32) are two single-threaded
// passes and a bf16 temporary. The backward of a rounding point is the same rounding of the gradient.
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

inline uint32_t RoundBits(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u | 0x00400000u) & 0xffff0000u;   // NaN: keep it quiet
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

}  // namespace

extern "C" std::vector<int64_t> RoundBF16InferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" int RoundBF16InferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int RoundBF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                         void *stream, void *extra) {
  if (nparam != 2 || !moetrain::Float32(dtypes[0])) return 1;
  const int64_t n = moetrain::Size(ndims[0], shapes[0]);
  const uint32_t *x = static_cast<const uint32_t *>(params[0]);
  uint32_t *y = static_cast<uint32_t *>(params[1]);
  moetrain::ParallelSplit(n, moetrain::PartsFor(n, int64_t{1} << 15), [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = RoundBits(x[i]);
  });
  return 0;
}
