// A linear layer's matrix products on the kernel thread pool (common.h), fp32, weight in the HF
// layout [out, in]:
//
//   LinearForward   x [N, K], w [F, K]            -> y [N, F] = x w^T
//   LinearBackward  x [N, K], w [F, K], dy [N, F] -> dx [N, K] = dy w, dw [F, K] = dy^T x
//
// The backward's two products are one set of tasks (row blocks of dx and of dw), so neither waits for
// the other and one call replaces MindSpore's two MatMul ops. Each output element is written by one
// task, its sum over the inner dimension in oneDNN's order, so results do not depend on the threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "common.h"

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

namespace {

// Row blocks of at least 64 rows (fewer run well below the GEMM's peak), about four per thread.
int64_t Blocks(int64_t rows) { return moetrain::TasksFor(rows, 64); }

bool ReadShapes(int *ndims, int64_t **shapes, const char **dtypes, int inputs, int64_t *n, int64_t *k, int64_t *f) {
  for (int i = 0; i < inputs; ++i)
    if (ndims[i] != 2 || !moetrain::Float32(dtypes[i])) return false;
  *n = shapes[0][0];
  *k = shapes[0][1];
  *f = shapes[1][0];
  return shapes[1][1] == *k && (inputs < 3 || (shapes[2][0] == *n && shapes[2][1] == *f));
}

}  // namespace

extern "C" std::vector<int64_t> LinearForwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[1][0]};
}
extern "C" int LinearForwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<std::vector<int64_t>> LinearBackwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {{shapes[0][0], shapes[0][1]}, {shapes[1][0], shapes[1][1]}};
}
extern "C" std::vector<int> LinearBackwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0]};
}

extern "C" int LinearForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  int64_t n, k, f;
  if (nparam != 3 || !ReadShapes(ndims, shapes, dtypes, 2, &n, &k, &f)) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  if (k == 0) {
    std::memset(y, 0, n * f * sizeof(float));
    return 0;
  }
  const int64_t blocks = Blocks(n);
  moetrain::ParallelFor(blocks, [&](int64_t b, int) {
    const int64_t r0 = n * b / blocks, r1 = n * (b + 1) / blocks;
    if (r1 > r0) dnnl_sgemm('N', 'T', r1 - r0, f, k, 1.0f, x + r0 * k, k, w, k, 0.0f, y + r0 * f, f);
  });
  return 0;
}

extern "C" int LinearBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  int64_t n, k, f;
  if (nparam != 5 || !ReadShapes(ndims, shapes, dtypes, 3, &n, &k, &f)) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  float *dx = static_cast<float *>(params[3]), *dw = static_cast<float *>(params[4]);
  if (n == 0 || f == 0) {   // empty sums
    std::memset(dx, 0, n * k * sizeof(float));
    std::memset(dw, 0, f * k * sizeof(float));
    return 0;
  }
  const int64_t dx_blocks = Blocks(n), dw_blocks = Blocks(f);
  moetrain::ParallelFor(dx_blocks + dw_blocks, [&](int64_t task, int) {
    if (task < dx_blocks) {   // dx[r0:r1] = dy[r0:r1] w
      const int64_t r0 = n * task / dx_blocks, r1 = n * (task + 1) / dx_blocks;
      if (r1 > r0) dnnl_sgemm('N', 'N', r1 - r0, k, f, 1.0f, dy + r0 * f, f, w, k, 0.0f, dx + r0 * k, k);
    } else {                  // dw[o0:o1] = dy[:, o0:o1]^T x
      const int64_t b = task - dx_blocks, o0 = f * b / dw_blocks, o1 = f * (b + 1) / dw_blocks;
      if (o1 > o0) dnnl_sgemm('T', 'N', o1 - o0, k, n, 1.0f, dy + o0, f, x, k, 0.0f, dw + o0 * k, k);
    }
  });
  return 0;
}

// bf16 storage (bf16.h): x and y bf16 containers (or fp32 tensors read as / rounded to bf16 values), the
// fp32 weight read as bf16 values, dweight rounded.
//
// The forward converts per row block inside its tasks: each task decodes (or rounds) its rows of x into
// its own scratch, runs the same fp32 GEMM on them and encodes (or rounds) its rows of y, so no fp32 copy
// of the whole x or y is made and a block's conversion runs while it is in cache. The weight is rounded
// once per call (every task reads all of it). Bitwise what `RunBF16` around `LinearForward` computes: the
// same blocks, the same GEMM calls on the same values.
extern "C" int LinearForwardBF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2) return 1;
  const bool half_in = moetrain::Float16(dtypes[0]), half_out = moetrain::Float16(dtypes[2]);
  if ((!half_in && !moetrain::Float32(dtypes[0])) || !moetrain::Float32(dtypes[1]) ||
      (!half_out && !moetrain::Float32(dtypes[2])))
    return 1;
  const int64_t n = shapes[0][0], k = shapes[0][1], f = shapes[1][0];
  if (shapes[1][1] != k) return 1;
  if (k == 0) {
    std::memset(params[2], 0, n * f * (half_out ? 2 : 4));
    return 0;
  }
  moetrain::Scratch weight;
  moetrain::RoundToBF16(static_cast<const float *>(params[1]), weight.Get(f * k), f * k);
  const float *w = weight.get();
  const int64_t blocks = Blocks(n);
  moetrain::ParallelFor(blocks, [&](int64_t b, int) {
    const int64_t r0 = n * b / blocks, r1 = n * (b + 1) / blocks, rows = r1 - r0;
    if (rows <= 0) return;
    moetrain::Scratch xs, ys;
    float *xb = xs.Get(rows * k);
    if (half_in) moetrain::DecodeRow(static_cast<const uint16_t *>(params[0]) + r0 * k, xb, rows * k);
    else moetrain::RoundRow(static_cast<const float *>(params[0]) + r0 * k, xb, rows * k);
    float *yb = half_out ? ys.Get(rows * f) : static_cast<float *>(params[2]) + r0 * f;
    dnnl_sgemm('N', 'T', rows, f, k, 1.0f, xb, k, w, k, 0.0f, yb, f);
    if (half_out) moetrain::EncodeRow(yb, static_cast<uint16_t *>(params[2]) + r0 * f, rows * f);
    else moetrain::RoundRow(yb, yb, rows * f);
  });
  return 0;
}
extern "C" std::vector<int64_t> LinearForwardBF16InferShape(int *ndims, int64_t **shapes, void *extra) {
  return LinearForwardInferShape(ndims, shapes, extra);
}
MOETRAIN_BF16_TYPE(LinearForward, 0)
MOETRAIN_BF16_KERNEL(LinearBackward, "awa|aw")
MOETRAIN_BF16_TYPES(LinearBackward, 0, 1)
