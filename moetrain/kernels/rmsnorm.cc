// RMSNorm in one pass per row each way (MindSpore runs ~6 elementwise/reduction ops forward and
// ~12 backward for it), fp32:
//
//   RMSNormForward       x [R, H], weight [H], eps [1]      -> y [R, H]  = x * r * weight
//   RMSNormBackwardInput x [R, H], weight [H], eps [1], dy  -> dx [R, H] = r * g - x * r^3 * mean(g * x)
//   RMSNormBackwardWeight x [R, H], eps [1], dy [R, H]      -> dweight [H] = sum over rows of dy * x * r
//
// with r = 1 / sqrt(mean(x^2) + eps) per row and g = dy * weight; leading dimensions are flattened
// into R. r is recomputed in the backward (one pass over a row) instead of being stored.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

int Parts(int64_t rows) { return moetrain::TasksFor(rows, 128); }

inline float InverseRms(const float *x, int64_t h, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < h; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
}

}  // namespace

extern "C" std::vector<int64_t> RMSNormForwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" std::vector<int64_t> RMSNormBackwardInputInferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" std::vector<int64_t> RMSNormBackwardWeightInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][ndims[0] - 1]};
}
extern "C" int RMSNormForwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int RMSNormBackwardInputInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int RMSNormBackwardWeightInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int RMSNormForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 4 || !moetrain::Float32(dtypes[0]) || !moetrain::Float32(dtypes[1]) || !moetrain::Float32(dtypes[2])) return 1;
  const int64_t h = shapes[0][ndims[0] - 1], rows = moetrain::Rows(ndims[0], shapes[0]);
  if (ndims[1] != 1 || shapes[1][0] != h) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  moetrain::ParallelSplit(rows, Parts(rows), [=](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *xr = x + r * h;
      float *yr = y + r * h;
      const float inv = InverseRms(xr, h, eps);
      for (int64_t i = 0; i < h; ++i) yr[i] = xr[i] * inv * w[i];
    }
  });
  return 0;
}

extern "C" int RMSNormBackwardInput(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  if (nparam != 5 || !moetrain::Float32(dtypes[0]) || !moetrain::Float32(dtypes[1]) || !moetrain::Float32(dtypes[2]) || !moetrain::Float32(dtypes[3]))
    return 1;
  const int64_t h = shapes[0][ndims[0] - 1], rows = moetrain::Rows(ndims[0], shapes[0]);
  if (ndims[1] != 1 || shapes[1][0] != h || moetrain::Rows(ndims[3], shapes[3]) != rows) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  const float *dy = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  moetrain::ParallelSplit(rows, Parts(rows), [=](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *xr = x + r * h, *dyr = dy + r * h;
      float *dxr = dx + r * h;
      const float inv = InverseRms(xr, h, eps);
      float dot = 0.0f;
      for (int64_t i = 0; i < h; ++i) dot += dyr[i] * w[i] * xr[i];
      const float coef = inv * inv * inv * dot / static_cast<float>(h);
      for (int64_t i = 0; i < h; ++i) dxr[i] = inv * dyr[i] * w[i] - xr[i] * coef;
    }
  });
  return 0;
}

extern "C" int RMSNormBackwardWeight(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                     void *stream, void *extra) {
  if (nparam != 4 || !moetrain::Float32(dtypes[0]) || !moetrain::Float32(dtypes[1]) || !moetrain::Float32(dtypes[2])) return 1;
  const int64_t h = shapes[0][ndims[0] - 1], rows = moetrain::Rows(ndims[0], shapes[0]);
  if (moetrain::Rows(ndims[2], shapes[2]) != rows) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float eps = *static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  float *dw = static_cast<float *>(params[3]);
  const int parts = Parts(rows);
  std::vector<float> partial(parts * h, 0.0f);   // one row of sums per part, added in a fixed order
  moetrain::ParallelSplit(rows, parts, [&](int p, int64_t begin, int64_t end) {
    float *acc = partial.data() + p * h;
    for (int64_t r = begin; r < end; ++r) {
      const float *xr = x + r * h, *dyr = dy + r * h;
      const float inv = InverseRms(xr, h, eps);
      for (int64_t i = 0; i < h; ++i) acc[i] += dyr[i] * xr[i] * inv;
    }
  });
  for (int64_t i = 0; i < h; ++i) {
    float total = 0.0f;
    for (int p = 0; p < parts; ++p) total += partial[p * h + i];
    dw[i] = total;
  }
  return 0;
}
