// The optimizer's passes over flat fp32 buffers: AdamW in one pass, updating param, exp_avg and
// exp_avg_sq in place, and the squared norm the gradient clipping needs.
//
//   SumOfSquares x [...] -> [2]: sum of x^2 accumulated in double, returned as (hi, lo) with
//                hi = float(total), lo = float(total - hi): hi + lo in double keeps ~48 bits (no gradient)
//   AdamWUpdate  param_1..param_T, exp_avg_1..exp_avg_T, exp_avg_sq_1..exp_avg_sq_T, grad [N], hyper [4],
//                lr [1], step [1], grad_scale [1], segment_ends [K] int64, segment_decay [K] -> status [1] (0)
//
// The T tensors (param_t, exp_avg_t, exp_avg_sq_t of equal size) laid end to end are the N elements of
// `grad` (T = 1: one flat buffer, e.g. a ZeRO master row; T > 1: the separate parameters whose
// gradients one flat buffer holds, updated where they live, so no copy back).
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

extern "C" std::vector<int64_t> SumOfSquaresInferShape(int *ndims, int64_t **shapes, void *extra) { return {2}; }
extern "C" int SumOfSquaresInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int SumOfSquares(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 2 || !moetrain::Float32(dtypes[0])) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int64_t n = moetrain::Size(ndims[0], shapes[0]);
  const int parts = moetrain::TasksFor(n, 1 << 16);
  std::vector<double> partial(parts, 0.0);
  moetrain::ParallelSplit(n, parts, [&](int part, int64_t begin, int64_t end) {
    // Each square is a float (the same wherever the element sits) added in double, in 16 lanes
    // (vectorised without reassociating: this file is built without -ffast-math). Float lanes
    // rounded at every add, so the same gradients cut into other buffers (another layout, other
    // ranks) gave a norm an ulp apart, and through the clip factor every update with it; in
    // double the total is the same to ~1e-10 relative however the elements are cut.
    double lanes[16] = {};
    const int64_t whole = begin + (end - begin) / 16 * 16;
    for (int64_t i = begin; i < whole; i += 16)
      for (int l = 0; l < 16; ++l) {
        const float square = x[i + l] * x[i + l];
        lanes[l] += square;
      }
    for (int64_t i = whole; i < end; ++i) {
      const float square = x[i] * x[i];
      lanes[i - whole] += square;
    }
    double total = 0.0;
    for (double lane : lanes) total += lane;
    partial[part] = total;
  });
  double total = 0.0;
  for (double v : partial) total += v;
  float *out = static_cast<float *>(params[1]);
  out[0] = static_cast<float>(total);
  out[1] = std::isfinite(out[0]) ? static_cast<float>(total - static_cast<double>(out[0])) : 0.0f;
  return 0;
}

namespace {

// One contiguous piece of the update. Every scalar is a by-value argument and every array a
// restrict pointer: read through a lambda's captured references, the loop did not vectorise (GCC
// could not prove the stores leave b1, eps, ... unchanged) and ran at a third of memory speed.
void AdamWSpan(float *__restrict p, float *__restrict m, float *__restrict v, const float *__restrict g, int64_t n,
               float b1, float b2, float eps, float grad_scale, float shrink, float l2, float step_size,
               float inv_sqrt_c2) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale + l2 * p[i];
    const float mi = b1 * m[i] + (1.0f - b1) * gi, vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * shrink - step_size * mi / (std::sqrt(vi) * inv_sqrt_c2 + eps);
  }
}

}  // namespace

extern "C" std::vector<int64_t> AdamWUpdateInferShape(int *ndims, int64_t **shapes, void *extra) { return {1}; }
extern "C" int AdamWUpdateInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int AdamWUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  // inputs: K params, K exp_avgs, K exp_avg_sqs, then the 7 shared ones; one output
  if (nparam < 11 || (nparam - 8) % 3 != 0) return 1;
  const int tensors = (nparam - 8) / 3, shared = 3 * tensors;
  for (int i = 0; i < shared + 7; ++i)
    if (i != shared + 5 && !moetrain::Float32(dtypes[i])) return 1;
  if (std::strcmp(dtypes[shared + 5], "int64") != 0) return 1;
  std::vector<int64_t> tensor_ends(tensors);   // where each tensor ends in the concatenated index space
  for (int t = 0; t < tensors; ++t) {
    const int64_t size = moetrain::Size(ndims[t], shapes[t]);
    if (moetrain::Size(ndims[tensors + t], shapes[tensors + t]) != size ||
        moetrain::Size(ndims[2 * tensors + t], shapes[2 * tensors + t]) != size)
      return 1;
    tensor_ends[t] = (t ? tensor_ends[t - 1] : 0) + size;
  }
  const int64_t n = tensor_ends[tensors - 1];
  if (moetrain::Size(ndims[shared], shapes[shared]) != n) return 3;
  const int64_t *hyper_shape = shapes[shared + 1], *ends_shape = shapes[shared + 5];
  if (ndims[shared + 1] != 1 || hyper_shape[0] != 4 || ndims[shared + 5] != 1 || ndims[shared + 6] != 1 ||
      ends_shape[0] != shapes[shared + 6][0] || ends_shape[0] < 1)
    return 1;
  float **p = reinterpret_cast<float **>(params), **m = p + tensors, **v = p + 2 * tensors;
  const float *g = static_cast<const float *>(params[shared]);
  const float *hyper = static_cast<const float *>(params[shared + 1]);
  const float lr = *static_cast<const float *>(params[shared + 2]);
  const float step = *static_cast<const float *>(params[shared + 3]);
  const float grad_scale = *static_cast<const float *>(params[shared + 4]);
  const int64_t *ends = static_cast<const int64_t *>(params[shared + 5]);
  const float *decay = static_cast<const float *>(params[shared + 6]);
  const int64_t segments = ends_shape[0];
  if (ends[segments - 1] != n) return 2;
  for (int64_t k = 0; k < segments; ++k)
    if (ends[k] < (k ? ends[k - 1] : 0)) return 2;
  const float b1 = hyper[0], b2 = hyper[1], eps = hyper[2];
  const bool decoupled = hyper[3] != 0.0f;
  const double c1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(step));
  const double c2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(step));
  const float step_size = static_cast<float>(lr / c1), inv_sqrt_c2 = static_cast<float>(1.0 / std::sqrt(c2));
  const int64_t *tensor_end = tensor_ends.data();
  moetrain::ParallelSplit(n, moetrain::TasksFor(n, 1 << 16), [&](int, int64_t begin, int64_t end) {
    int64_t k = std::upper_bound(ends, ends + segments, begin) - ends;
    int64_t t = std::upper_bound(tensor_end, tensor_end + tensors, begin) - tensor_end;
    for (int64_t start = begin; start < end;) {   // pieces of one segment inside one tensor
      const int64_t stop = std::min({end, ends[k], tensor_end[t]}), offset = start - (t ? tensor_end[t - 1] : 0);
      const float wd = decay[k];
      AdamWSpan(p[t] + offset, m[t] + offset, v[t] + offset, g + start, stop - start, b1, b2, eps, grad_scale,
                decoupled ? 1.0f - lr * wd : 1.0f, decoupled ? 0.0f : wd, step_size, inv_sqrt_c2);
      start = stop;
      while (k < segments && ends[k] <= start) ++k;          // past empty segments and tensors too
      while (t < tensors && tensor_end[t] <= start) ++t;
    }
  });
  *static_cast<float *>(params[nparam - 1]) = 0.0f;
  return 0;
}
