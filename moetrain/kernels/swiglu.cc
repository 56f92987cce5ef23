// SwiGLU on the fused gate|up projection: one pass forward, one pass backward, instead of the
// five to seven elementwise ops MindSpore runs for silu(gate) * up and its gradient.
//
//   SwiGLUForward   gu [R, 2F] (gate = gu[:, :F], up = gu[:, F:]) -> h [R, F] = silu(gate) * up
//   SwiGLUBackward  gu [R, 2F], dh [R, F] -> dgu [R, 2F]:
//                   dgate = dh * up * s * (1 + gate * (1 - s)), dup = dh * gate * s, s = sigmoid(gate)
//
// Leading dimensions are flattened into R. Compiled with -ffast-math so that expf vectorises; the
// exponent is clamped so that no intermediate is infinite, and a NaN input still yields NaN output
// (it enters every product), which the loss-scaling overflow check relies on.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "common.h"

namespace {

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(std::min(-x, 80.0f))); }

}  // namespace

// Shape inference for MindSpore (see grouped_gemm.cc); -1 / -2 mark dynamic dimensions / rank.
extern "C" std::vector<int64_t> SwiGLUForwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  std::vector<int64_t> shape(shapes[0], shapes[0] + ndims[0]);
  if (!shape.empty() && shape.back() > 0) shape.back() /= 2;
  return shape;
}
extern "C" std::vector<int64_t> SwiGLUBackwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" int SwiGLUForwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int SwiGLUBackwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int SwiGLUForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 2 || !moetrain::Float32(dtypes[0]) || shapes[0][ndims[0] - 1] % 2) return 1;
  const float *gu = static_cast<const float *>(params[0]);
  float *h = static_cast<float *>(params[1]);
  const int64_t f = shapes[0][ndims[0] - 1] / 2, rows = moetrain::Rows(ndims[0], shapes[0]);
  moetrain::ParallelSplit(rows, moetrain::TasksFor(rows, 64), [=](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = gu + r * 2 * f, *up = gate + f;
      float *out = h + r * f;
      for (int64_t i = 0; i < f; ++i) out[i] = gate[i] * Sigmoid(gate[i]) * up[i];
    }
  });
  return 0;
}

extern "C" int SwiGLUBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 3 || !moetrain::Float32(dtypes[0]) || !moetrain::Float32(dtypes[1]) || shapes[0][ndims[0] - 1] % 2) return 1;
  const float *gu = static_cast<const float *>(params[0]);
  const float *dh = static_cast<const float *>(params[1]);
  float *dgu = static_cast<float *>(params[2]);
  const int64_t f = shapes[0][ndims[0] - 1] / 2, rows = moetrain::Rows(ndims[0], shapes[0]);
  if (shapes[1][ndims[1] - 1] != f || moetrain::Rows(ndims[1], shapes[1]) != rows) return 1;
  moetrain::ParallelSplit(rows, moetrain::TasksFor(rows, 64), [=](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = gu + r * 2 * f, *up = gate + f, *grad = dh + r * f;
      float *dgate = dgu + r * 2 * f, *dup = dgate + f;
      for (int64_t i = 0; i < f; ++i) {
        const float s = Sigmoid(gate[i]);
        dgate[i] = grad[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
        dup[i] = grad[i] * gate[i] * s;
      }
    }
  });
  return 0;
}

// bf16 storage (bf16.h): gate|up, h and their gradients bf16 containers, read and written directly
// (fp32 math in between; half the memory traffic of the fp32 kernels). Same results as the fp32
// kernels on the decoded values with the outputs rounded to nearest even.
namespace {

inline float Load(const uint16_t *x, int64_t i) {
  const uint32_t bits = uint32_t{x[i]} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t Store(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(moetrain::RoundBF16Bits(bits) >> 16);
}

}  // namespace

extern "C" std::vector<int64_t> SwiGLUForwardBF16InferShape(int *ndims, int64_t **shapes, void *extra) {
  return SwiGLUForwardInferShape(ndims, shapes, extra);
}
extern "C" std::vector<int64_t> SwiGLUBackwardBF16InferShape(int *ndims, int64_t **shapes, void *extra) {
  return SwiGLUBackwardInferShape(ndims, shapes, extra);
}
extern "C" int SwiGLUForwardBF16InferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int SwiGLUBackwardBF16InferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int SwiGLUForwardBF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  if (nparam != 2 || !moetrain::Float16(dtypes[0]) || !moetrain::Float16(dtypes[1]) || shapes[0][ndims[0] - 1] % 2)
    return 1;
  const uint16_t *gu = static_cast<const uint16_t *>(params[0]);
  uint16_t *h = static_cast<uint16_t *>(params[1]);
  const int64_t f = shapes[0][ndims[0] - 1] / 2, rows = moetrain::Rows(ndims[0], shapes[0]);
  moetrain::ParallelSplit(rows, moetrain::TasksFor(rows, 64), [=](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *gate = gu + r * 2 * f, *up = gate + f;
      uint16_t *out = h + r * f;
      for (int64_t i = 0; i < f; ++i) {
        const float g = Load(gate, i);
        out[i] = Store(g * Sigmoid(g) * Load(up, i));
      }
    }
  });
  return 0;
}

extern "C" int SwiGLUBackwardBF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  if (nparam != 3 || !moetrain::Float16(dtypes[0]) || !moetrain::Float16(dtypes[1]) ||
      !moetrain::Float16(dtypes[2]) || shapes[0][ndims[0] - 1] % 2)
    return 1;
  const uint16_t *gu = static_cast<const uint16_t *>(params[0]);
  const uint16_t *dh = static_cast<const uint16_t *>(params[1]);
  uint16_t *dgu = static_cast<uint16_t *>(params[2]);
  const int64_t f = shapes[0][ndims[0] - 1] / 2, rows = moetrain::Rows(ndims[0], shapes[0]);
  if (shapes[1][ndims[1] - 1] != f || moetrain::Rows(ndims[1], shapes[1]) != rows) return 1;
  moetrain::ParallelSplit(rows, moetrain::TasksFor(rows, 64), [=](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *gate = gu + r * 2 * f, *up = gate + f, *grad = dh + r * f;
      uint16_t *dgate = dgu + r * 2 * f, *dup = dgate + f;
      for (int64_t i = 0; i < f; ++i) {
        const float g = Load(gate, i), u = Load(up, i), d = Load(grad, i), s = Sigmoid(g);
        dgate[i] = Store(d * u * s * (1.0f + g * (1.0f - s)));
        dup[i] = Store(d * g * s);
      }
    }
  });
  return 0;
}
