// Token permutation to the expert-sorted rows and back (the dropless MoE layout), one pass each way
// instead of MindSpore's gather + concat + batched matmul and their scatter-add / slice backward.
// `slot` [N = T k] int32 is a permutation of [0, N): assignment a = t k + j (token t, choice j) sits
// at row slot[a] (moetrain.moe.permutation.permute_by_id). fp32.
//
//   PermuteRows             x [T, H], slot [N]         -> out [N, H]:  out[slot[t k + j]] = x[t]
//   PermuteRowsBackward     x [T, H], dout [N, H], slot -> dx [T, H]:  dx[t] = sum_j dout[slot[t k + j]]
//   UnpermuteRows           rows [N, H], slot, w [T, k]  -> y [T, H]:   y[t] = sum_j w[t, j] rows[slot[t k + j]]
//   UnpermuteRowsBackward   rows, slot, w, dy [T, H]     -> drows [N, H]: drows[slot[t k + j]] = w[t, j] dy[t],
//                                                          dw [T, k]:  dw[t, j] = <rows[slot[t k + j]], dy[t]>
//
// Sums over j run in order j = 0, 1, ..., so results do not depend on the thread count. Every op
// first checks that slot is a permutation of [0, N) (each row written exactly once, so threads split
// by token never write the same row) and fails otherwise.
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

bool IsPermutation(const int32_t *slot, int64_t n) {
  std::vector<char> seen(n, 0);
  for (int64_t a = 0; a < n; ++a) {
    if (slot[a] < 0 || slot[a] >= n || seen[slot[a]]) return false;
    seen[slot[a]] = 1;
  }
  return true;
}

// T, k, H from x or y [T, H] and slot [N] (N = T k); false where the shapes disagree.
bool ReadDims(int64_t tokens, int64_t hidden, int64_t rows, int64_t rows_hidden, int64_t *top_k) {
  if (tokens <= 0 || rows % tokens != 0 || rows_hidden != hidden) return false;
  *top_k = rows / tokens;
  return true;
}

// fn(t) for every token, tokens split over the threads.
template <typename Fn>
void ForTokens(int64_t tokens, Fn fn) {
  moetrain::ParallelSplit(tokens, moetrain::TasksFor(tokens, 64), [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

}  // namespace

extern "C" std::vector<int64_t> PermuteRowsInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[1][0], shapes[0][1]};
}
extern "C" int PermuteRowsInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<int64_t> PermuteRowsBackwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[0][1]};
}
extern "C" int PermuteRowsBackwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<int64_t> UnpermuteRowsInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[2][0], shapes[0][1]};
}
extern "C" int UnpermuteRowsInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<std::vector<int64_t>> UnpermuteRowsBackwardInferShape(int *ndims, int64_t **shapes,
                                                                             void *extra) {
  return {{shapes[0][0], shapes[0][1]}, {shapes[2][0], shapes[2][1]}};
}
extern "C" std::vector<int> UnpermuteRowsBackwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0]};
}

extern "C" int PermuteRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  int64_t k;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1 || !moetrain::Float32(dtypes[0]) ||
      !ReadDims(shapes[0][0], shapes[0][1], shapes[1][0], shapes[0][1], &k))
    return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *slot = static_cast<const int32_t *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t tokens = shapes[0][0], hidden = shapes[0][1];
  if (!IsPermutation(slot, tokens * k)) return 2;
  ForTokens(tokens, [&](int64_t t) {
    for (int64_t j = 0; j < k; ++j) std::memcpy(out + slot[t * k + j] * hidden, x + t * hidden, hidden * sizeof(float));
  });
  return 0;
}

extern "C" int PermuteRowsBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  int64_t k;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || !moetrain::Float32(dtypes[1]) ||
      shapes[1][0] != shapes[2][0] || !ReadDims(shapes[0][0], shapes[0][1], shapes[1][0], shapes[1][1], &k))
    return 1;
  const float *dout = static_cast<const float *>(params[1]);
  const int32_t *slot = static_cast<const int32_t *>(params[2]);
  float *dx = static_cast<float *>(params[3]);
  const int64_t tokens = shapes[0][0], hidden = shapes[0][1];
  if (!IsPermutation(slot, tokens * k)) return 2;
  ForTokens(tokens, [&](int64_t t) {
    float *d = dx + t * hidden;
    std::memcpy(d, dout + slot[t * k] * hidden, hidden * sizeof(float));
    for (int64_t j = 1; j < k; ++j) {
      const float *g = dout + slot[t * k + j] * hidden;
      for (int64_t i = 0; i < hidden; ++i) d[i] += g[i];
    }
  });
  return 0;
}

extern "C" int UnpermuteRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  int64_t k;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || !moetrain::Float32(dtypes[0]) ||
      !moetrain::Float32(dtypes[2]) || shapes[1][0] != shapes[0][0] ||
      !ReadDims(shapes[2][0], shapes[0][1], shapes[0][0], shapes[0][1], &k) || k != shapes[2][1])
    return 1;
  const float *rows = static_cast<const float *>(params[0]);
  const int32_t *slot = static_cast<const int32_t *>(params[1]);
  const float *w = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  const int64_t tokens = shapes[2][0], hidden = shapes[0][1];
  if (!IsPermutation(slot, tokens * k)) return 2;
  ForTokens(tokens, [&](int64_t t) {
    float *out = y + t * hidden;
    const float *r0 = rows + slot[t * k] * hidden;
    const float w0 = w[t * k];
    for (int64_t i = 0; i < hidden; ++i) out[i] = w0 * r0[i];
    for (int64_t j = 1; j < k; ++j) {
      const float *r = rows + slot[t * k + j] * hidden;
      const float wj = w[t * k + j];
      for (int64_t i = 0; i < hidden; ++i) out[i] += wj * r[i];
    }
  });
  return 0;
}

extern "C" int UnpermuteRowsBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                     void *stream, void *extra) {
  int64_t k;
  if (nparam != 6 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || ndims[3] != 2 ||
      !moetrain::Float32(dtypes[0]) || !moetrain::Float32(dtypes[2]) || !moetrain::Float32(dtypes[3]) ||
      shapes[1][0] != shapes[0][0] || !ReadDims(shapes[2][0], shapes[0][1], shapes[0][0], shapes[0][1], &k) ||
      k != shapes[2][1] || shapes[3][0] != shapes[2][0] || shapes[3][1] != shapes[0][1])
    return 1;
  const float *rows = static_cast<const float *>(params[0]);
  const int32_t *slot = static_cast<const int32_t *>(params[1]);
  const float *w = static_cast<const float *>(params[2]);
  const float *dy = static_cast<const float *>(params[3]);
  float *drows = static_cast<float *>(params[4]), *dw = static_cast<float *>(params[5]);
  const int64_t tokens = shapes[2][0], hidden = shapes[0][1];
  if (!IsPermutation(slot, tokens * k)) return 2;
  ForTokens(tokens, [&](int64_t t) {
    const float *g = dy + t * hidden;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = slot[t * k + j];
      const float *r = rows + row * hidden;
      float *d = drows + row * hidden;
      const float wj = w[t * k + j];
      float dot = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) {
        d[i] = wj * g[i];
        dot += r[i] * g[i];
      }
      dw[t * k + j] = dot;
    }
  });
  return 0;
}
