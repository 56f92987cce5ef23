// The optimizer's passes over flat fp32 buffers: AdamW in one pass, updating param, exp_avg and
// exp_avg_sq in place, and the squared norm the gradient clipping needs.
//
//   SumOfSquares x [...] -> [1]: sum of x^2, accumulated in double (no gradient)
//   AdamWUpdate  param [N], exp_avg [N], exp_avg_sq [N], grad [N], hyper [4], lr [1], step [1],
//                grad_scale [1], segment_ends [K] int64, segment_decay [K] -> status [1] (0)
//
// hyper = (beta1, beta2, eps, decoupled: 1 AdamW, 0 Adam with L2). Elements [segment_ends[k-1],
// segment_ends[k]) use weight decay segment_decay[k] (segment_ends ascending, the last equal to N), so a
// flat buffer of many parameters (or a ZeRO shard of it) decays matrices and not norms without a
// per-element mask. The same arithmetic as torch.optim.AdamW (decoupled) / Adam (L2):
//
//   g = grad * grad_scale   (+ wd * p for L2)          grad_scale: loss-scale unscale x clip factor
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd)       (decoupled only)
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// The buffers are MindSpore Parameters written through the pointers MindSpore passes; the Python op
// marks them RW_WRITE (side effect), which orders the update against every read in a jitted graph.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"

extern "C" std::vector<int64_t> SumOfSquaresInferShape(int *ndims, int64_t **shapes, void *extra) { return {1}; }
extern "C" int SumOfSquaresInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int SumOfSquares(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 2 || !moetrain::Float32(dtypes[0])) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int64_t n = moetrain::Size(ndims[0], shapes[0]);
  const int parts = moetrain::PartsFor(n, 1 << 16);
  std::vector<double> partial(parts, 0.0);
  moetrain::ParallelSplit(n, parts, [&](int part, int64_t begin, int64_t end) {
    double total = 0.0;
    for (int64_t b = begin; b < end; b += 4096) {   // float sums over short blocks vectorise; blocks add in double
      float block = 0.0f;
      for (int64_t i = b; i < std::min(end, b + 4096); ++i) block += x[i] * x[i];
      total += block;
    }
    partial[part] = total;
  });
  double total = 0.0;
  for (double v : partial) total += v;
  *static_cast<float *>(params[1]) = static_cast<float>(total);
  return 0;
}

extern "C" std::vector<int64_t> AdamWUpdateInferShape(int *ndims, int64_t **shapes, void *extra) { return {1}; }
extern "C" int AdamWUpdateInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int AdamWUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 11) return 1;
  for (int i = 0; i < 10; ++i)
    if (i != 8 && !moetrain::Float32(dtypes[i])) return 1;
  if (std::strcmp(dtypes[8], "int64") != 0) return 1;
  const int64_t n = moetrain::Size(ndims[0], shapes[0]);
  for (int i = 1; i < 4; ++i)
    if (moetrain::Size(ndims[i], shapes[i]) != n) return 1;
  if (ndims[4] != 1 || shapes[4][0] != 4 || ndims[8] != 1 || ndims[9] != 1 || shapes[8][0] != shapes[9][0] ||
      shapes[8][0] < 1)
    return 1;
  float *p = static_cast<float *>(params[0]), *m = static_cast<float *>(params[1]);
  float *v = static_cast<float *>(params[2]);
  const float *g = static_cast<const float *>(params[3]), *hyper = static_cast<const float *>(params[4]);
  const float lr = *static_cast<const float *>(params[5]), step = *static_cast<const float *>(params[6]);
  const float grad_scale = *static_cast<const float *>(params[7]);
  const int64_t *ends = static_cast<const int64_t *>(params[8]);
  const float *decay = static_cast<const float *>(params[9]);
  const int64_t segments = shapes[8][0];
  if (ends[segments - 1] != n) return 2;
  for (int64_t k = 0; k < segments; ++k)
    if (ends[k] < (k ? ends[k - 1] : 0)) return 2;
  const float b1 = hyper[0], b2 = hyper[1], eps = hyper[2];
  const bool decoupled = hyper[3] != 0.0f;
  const double c1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(step));
  const double c2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(step));
  const float step_size = static_cast<float>(lr / c1), inv_sqrt_c2 = static_cast<float>(1.0 / std::sqrt(c2));
  moetrain::ParallelSplit(n, moetrain::PartsFor(n, 1 << 16), [&](int, int64_t begin, int64_t end) {
    int64_t k = std::upper_bound(ends, ends + segments, begin) - ends;
    for (int64_t start = begin; start < end; ++k) {
      const int64_t stop = std::min(end, ends[k]);
      const float wd = decay[k], shrink = decoupled ? 1.0f - lr * wd : 1.0f, l2 = decoupled ? 0.0f : wd;
      for (int64_t i = start; i < stop; ++i) {
        const float gi = g[i] * grad_scale + l2 * p[i];
        const float mi = b1 * m[i] + (1.0f - b1) * gi, vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * shrink - step_size * mi / (std::sqrt(vi) * inv_sqrt_c2 + eps);
      }
      start = stop;
    }
  });
  *static_cast<float *>(params[10]) = 0.0f;
  return 0;
}
