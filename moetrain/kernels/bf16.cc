// bfloat16 values in fp32 storage (bf16 compute emulated on the CPU, docs/precision.md):
//
//   RoundBF16  x [...] fp32 -> y [...] fp32, each value rounded to bfloat16 (to nearest, ties to even;
//              infinities stay, a NaN stays a NaN)
//
// One multi-threaded pass, where MindSpore's two casts (fp32 -> bf16 -> fp32) are two single-threaded
// passes and a bf16 temporary. The backward of a rounding point is the same rounding of the gradient.
//
// bf16 storage (bf16.h: a bf16 container is a float16-typed tensor holding bf16 bits):
//
//   ToBF16    x [...] fp32 -> [...] bf16 container (rounded to nearest even)
//   FromBF16  x [...] bf16 container -> [...] fp32 (exact)
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "common.h"
#include "mindapi/base/type_id.h"

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
    for (int64_t i = begin; i < end; ++i) y[i] = moetrain::RoundBF16Bits(x[i]);
  });
  return 0;
}

extern "C" std::vector<int64_t> ToBF16InferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" int ToBF16InferType(std::vector<int> type_ids, void *extra) { return mindspore::kNumberTypeFloat16; }
extern "C" std::vector<int64_t> FromBF16InferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" int FromBF16InferType(std::vector<int> type_ids, void *extra) { return mindspore::kNumberTypeFloat32; }

extern "C" int ToBF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  if (nparam != 2 || !moetrain::Float32(dtypes[0]) || !moetrain::Float16(dtypes[1])) return 1;
  moetrain::EncodeBF16(static_cast<const float *>(params[0]), static_cast<uint16_t *>(params[1]),
                       moetrain::Size(ndims[0], shapes[0]));
  return 0;
}

extern "C" int FromBF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                        void *extra) {
  if (nparam != 2 || !moetrain::Float16(dtypes[0]) || !moetrain::Float32(dtypes[1])) return 1;
  moetrain::DecodeBF16(static_cast<const uint16_t *>(params[0]), static_cast<float *>(params[1]),
                       moetrain::Size(ndims[0], shapes[0]));
  return 0;
}
