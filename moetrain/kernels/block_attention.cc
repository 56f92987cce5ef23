// One step of blockwise (flash / ring) attention: a tile of query rows against one range of keys, with a
// causal offset and document ids, returning the output and its log-sum-exp so that the steps over
// several key blocks merge exactly (context parallelism's all_gather and ring paths,
// moetrain/parallel/context_parallel.py). fp32, the per-row merge terms in double.
//
//   BlockAttentionForward   q [B, H, G, R, D] (pre-scaled), k [B, H, K, D], v [B, H, K, Dv],
//                           query_docs [B, R], key_docs [B, K] (fp32 ids; any shape without documents),
//                           prev_out [B, H, G, T, Dv], prev_lse [B, H, G, T, 1], meta int32 [7]
//                           -> out [B, H, G, T, Dv], lse [B, H, G, T, 1]
//   BlockAttentionBackward  q, k, v, query_docs, key_docs, out [B, H, G, R, Dv], lse [B, H, G, R, 1],
//                           dout [B, H, G, R, Dv], dlse [B, H, G, R, 1], dq_acc [B, H, G, T, D],
//                           dk_acc [B, H, N, D], dv_acc [B, H, N, Dv], meta
//                           -> dq_acc + dq, dk_acc + dk, dv_acc + dv (same shapes)
//
// meta = (r0, k0, keys, causal, offset, documents, prior): the tile is query rows [r0, r0 + T) of q, the
// key range keys [k0, k0 + keys) of k and v (the backward's N = keys: its dk / dv accumulators cover the
// range). Query row i of the tile sees key j of the range iff (causal: j <= offset + i) and (documents:
// query_docs[b, r0 + i] == key_docs[b, k0 + j]). Query head (h, g) reads K/V head h (the G query heads of
// a GQA group side by side). The forward merges its step with (prev_out, prev_lse) when `prior` is 1:
//   lse = log(e^lse_prev + e^lse_step),  out = out_prev e^(lse_prev - lse) + out_step e^(lse_step - lse)
// (prior 0: the previous values are not read). A row that sees no key of the range has lse_step =
// kEmpty (-1e30, finite: the kernels are built with -ffast-math) and contributes nothing.
// The backward takes the merged out and lse of all the steps (FlashAttention's): P = exp(S - lse) on
// this range, dP = dO V^T, dS = P (dP - rowsum(dO O) + dlse), dq += dS K, dk += dS^T q, dv += P^T dO.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

namespace {

constexpr float kEmpty = -1e30f;   // the lse of a row that sees no key

struct Step {
  int64_t batch, heads, group, rows, keys_total, dim, vdim;   // q [B, H, G, R, D], k [B, H, K, D], v [.., Dv]
  int64_t r0, k0, keys, offset, tile;                         // the tile: rows [r0, r0 + tile)
  bool causal, documents, prior;
  // keys of the range any row of the tile may see (a causal range stops after the tile's last row)
  int64_t cols() const { return causal ? std::min(keys, offset + tile) : keys; }
  // keys [0, end(i)) of the range precede or are row i (the document check comes on top)
  int64_t end(int64_t i) const { return causal ? std::min(keys, offset + i + 1) : keys; }
};

bool Is(const char *dtype, const char *want) { return std::strcmp(dtype, want) == 0; }

bool Same(int ndim, const int64_t *a, const int64_t *b) {
  for (int i = 0; i < ndim; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// q, k, v, the document ids and meta (at `meta_index`), and the tile's rows T from `tile_shape`
// ([B, H, G, T, *]); false for any inconsistency (the op then fails).
bool ReadStep(void **params, int *ndims, int64_t **shapes, const char **dtypes, int meta_index,
              const int64_t *tile_shape, Step *s) {
  for (int i = 0; i < 5; ++i)
    if (!Is(dtypes[i], "float32")) return false;
  if (ndims[0] != 5 || ndims[1] != 4 || ndims[2] != 4) return false;
  if (ndims[meta_index] != 1 || shapes[meta_index][0] != 7 || !Is(dtypes[meta_index], "int32")) return false;
  const int32_t *m = static_cast<const int32_t *>(params[meta_index]);
  const int64_t *q = shapes[0], *k = shapes[1], *v = shapes[2];
  *s = {q[0], q[1], q[2], q[3], k[2], q[4], v[3], m[0], m[1], m[2], m[4], tile_shape[3], m[3] != 0, m[5] != 0,
        m[6] != 0};
  if (k[0] != s->batch || k[1] != s->heads || k[3] != s->dim || v[0] != s->batch || v[1] != s->heads ||
      v[2] != s->keys_total)
    return false;
  if (tile_shape[0] != s->batch || tile_shape[1] != s->heads || tile_shape[2] != s->group) return false;
  if (s->r0 < 0 || s->tile < 1 || s->r0 + s->tile > s->rows || s->k0 < 0 || s->keys < 1 ||
      s->k0 + s->keys > s->keys_total || s->offset < 0)
    return false;
  if (s->documents && (ndims[3] != 2 || shapes[3][0] != s->batch || shapes[3][1] != s->rows || ndims[4] != 2 ||
                       shapes[4][0] != s->batch || shapes[4][1] != s->keys_total))
    return false;
  return true;
}

// probs [T, cols] = exp(scores - base[i]) on the keys row i sees, 0 elsewhere. With `base` nullptr, the
// row's own maximum is used and each row is normalised; lse[i] (double) gets its log-sum-exp (kEmpty for
// a row that sees nothing). `qd` / `kd`: the tile's and the range's document ids (nullptr: none).
void Probabilities(const Step &s, float *probs, const float *base, const float *qd, const float *kd,
                   double *lse) {
  const int64_t cols = s.cols();
  for (int64_t i = 0; i < s.tile; ++i) {
    float *row = probs + i * cols;
    const int64_t hi = s.end(i);
    if (qd == nullptr) {
      float top = base ? base[i] : row[0];
      if (base == nullptr)
        for (int64_t j = 1; j < hi; ++j) top = std::max(top, row[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j < hi; ++j) {
        row[j] = std::exp(row[j] - top);
        sum += row[j];
      }
      std::fill(row + hi, row + cols, 0.0f);
      if (base == nullptr) {
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < hi; ++j) row[j] *= inv;
        lse[i] = static_cast<double>(top) + std::log(static_cast<double>(sum));
      }
      continue;
    }
    const float doc = qd[i];
    bool any = false;
    float top = 0.0f;
    if (base) {
      top = base[i];
    } else {
      for (int64_t j = 0; j < hi; ++j) {
        if (kd[j] != doc) continue;
        top = any ? std::max(top, row[j]) : row[j];
        any = true;
      }
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      row[j] = j < hi && kd[j] == doc ? std::exp(row[j] - top) : 0.0f;
      sum += row[j];
    }
    if (base) continue;
    if (!any) {
      lse[i] = kEmpty;
      continue;
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < hi; ++j) row[j] *= inv;
    lse[i] = static_cast<double>(top) + std::log(static_cast<double>(sum));
  }
}

void Forward(const Step &s, const float *q, const float *k, const float *v, const float *query_docs,
             const float *key_docs, const float *prev_out, const float *prev_lse, float *out, float *lse) {
  const int64_t cols = s.cols(), units = s.batch * s.heads * s.group;
  const int64_t scratch = s.tile * cols + s.tile * s.vdim;   // probs, the step's out; and its lse (double)
  std::vector<float> buffers(moetrain::Slots() * scratch);
  std::vector<double> lse_buffers(moetrain::Slots() * s.tile);
  moetrain::ParallelFor(units, [&](int64_t unit, int slot) {
    float *probs = buffers.data() + slot * scratch, *step_out = probs + s.tile * cols;
    double *step_lse = lse_buffers.data() + slot * s.tile;
    const int64_t b = unit / (s.heads * s.group), kv = unit / s.group;   // kv: (b, h)
    const float *q_tile = q + (unit * s.rows + s.r0) * s.dim;
    const float *k_range = k + (kv * s.keys_total + s.k0) * s.dim;
    const float *v_range = v + (kv * s.keys_total + s.k0) * s.vdim;
    const float *qd = s.documents ? query_docs + b * s.rows + s.r0 : nullptr;
    const float *kd = s.documents ? key_docs + b * s.keys_total + s.k0 : nullptr;
    dnnl_sgemm('N', 'T', s.tile, cols, s.dim, 1.0f, q_tile, s.dim, k_range, s.dim, 0.0f, probs, cols);
    Probabilities(s, probs, nullptr, qd, kd, step_lse);
    dnnl_sgemm('N', 'N', s.tile, s.vdim, cols, 1.0f, probs, cols, v_range, s.vdim, 0.0f, step_out, s.vdim);
    float *o = out + unit * s.tile * s.vdim, *l = lse + unit * s.tile;
    const float *po = prev_out + unit * s.tile * s.vdim, *pl = prev_lse + unit * s.tile;
    for (int64_t i = 0; i < s.tile; ++i) {
      const float *so = step_out + i * s.vdim;
      float *oi = o + i * s.vdim;
      if (!s.prior) {
        std::memcpy(oi, so, s.vdim * sizeof(float));
        l[i] = static_cast<float>(step_lse[i]);
        continue;
      }
      const double a = pl[i], c = step_lse[i], top = std::max(a, c);
      const double wa = std::exp(a - top), wc = std::exp(c - top), total = wa + wc;
      const float fa = static_cast<float>(wa / total), fc = static_cast<float>(wc / total);
      const float *pi = po + i * s.vdim;
      for (int64_t j = 0; j < s.vdim; ++j) oi[j] = pi[j] * fa + so[j] * fc;
      l[i] = static_cast<float>(top + std::log(total));
    }
  });
}

void Backward(const Step &s, const float *q, const float *k, const float *v, const float *query_docs,
              const float *key_docs, const float *out, const float *lse, const float *dout, const float *dlse,
              float *dq, float *dk, float *dv) {
  const int64_t cols = s.cols(), units = s.batch * s.heads;   // a unit owns its K/V head's dk, dv
  const int64_t scratch = 2 * s.tile * cols + 2 * s.tile;     // probs, dprobs, the rows' lse and delta
  std::vector<float> buffers(moetrain::Slots() * scratch);
  moetrain::ParallelFor(units, [&](int64_t unit, int slot) {
    float *probs = buffers.data() + slot * scratch, *dprobs = probs + s.tile * cols;
    float *base = dprobs + s.tile * cols, *delta = base + s.tile;
    const int64_t b = unit / s.heads;
    const float *k_range = k + (unit * s.keys_total + s.k0) * s.dim;
    const float *v_range = v + (unit * s.keys_total + s.k0) * s.vdim;
    const float *qd = s.documents ? query_docs + b * s.rows + s.r0 : nullptr;
    const float *kd = s.documents ? key_docs + b * s.keys_total + s.k0 : nullptr;
    float *dk_range = dk + unit * s.keys * s.dim, *dv_range = dv + unit * s.keys * s.vdim;
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t head = unit * s.group + g, row0 = head * s.rows + s.r0;
      const float *q_tile = q + row0 * s.dim, *o_tile = out + row0 * s.vdim, *do_tile = dout + row0 * s.vdim;
      for (int64_t i = 0; i < s.tile; ++i) {
        base[i] = lse[row0 + i];
        float dot = 0.0f;
        for (int64_t j = 0; j < s.vdim; ++j) dot += do_tile[i * s.vdim + j] * o_tile[i * s.vdim + j];
        delta[i] = dot - dlse[row0 + i];
      }
      dnnl_sgemm('N', 'T', s.tile, cols, s.dim, 1.0f, q_tile, s.dim, k_range, s.dim, 0.0f, probs, cols);
      Probabilities(s, probs, base, qd, kd, nullptr);
      dnnl_sgemm('N', 'T', s.tile, cols, s.vdim, 1.0f, do_tile, s.vdim, v_range, s.vdim, 0.0f, dprobs, cols);
      for (int64_t i = 0; i < s.tile; ++i) {
        float *dp = dprobs + i * cols;
        const float *p = probs + i * cols;
        for (int64_t j = 0; j < cols; ++j) dp[j] = p[j] * (dp[j] - delta[i]);
      }
      // dq += dS K; dk += dS^T q; dv += P^T dO   (keys [0, cols) of the range)
      dnnl_sgemm('N', 'N', s.tile, s.dim, cols, 1.0f, dprobs, cols, k_range, s.dim, 1.0f,
                 dq + head * s.tile * s.dim, s.dim);
      dnnl_sgemm('T', 'N', cols, s.dim, s.tile, 1.0f, dprobs, cols, q_tile, s.dim, 1.0f, dk_range, s.dim);
      dnnl_sgemm('T', 'N', cols, s.vdim, s.tile, 1.0f, probs, cols, do_tile, s.vdim, 1.0f, dv_range, s.vdim);
    }
  });
}

template <typename T>
const T *In(void **params, int i) {
  return static_cast<const T *>(params[i]);
}

std::vector<int64_t> ShapeOf(int *ndims, int64_t **shapes, int i) {
  return std::vector<int64_t>(shapes[i], shapes[i] + ndims[i]);
}

}  // namespace

extern "C" std::vector<std::vector<int64_t>> BlockAttentionForwardInferShape(int *ndims, int64_t **shapes,
                                                                             void *extra) {
  return {ShapeOf(ndims, shapes, 5), ShapeOf(ndims, shapes, 6)};
}
extern "C" std::vector<int> BlockAttentionForwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0]};
}
extern "C" std::vector<std::vector<int64_t>> BlockAttentionBackwardInferShape(int *ndims, int64_t **shapes,
                                                                              void *extra) {
  return {ShapeOf(ndims, shapes, 9), ShapeOf(ndims, shapes, 10), ShapeOf(ndims, shapes, 11)};
}
extern "C" std::vector<int> BlockAttentionBackwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0], type_ids[0]};
}

extern "C" int BlockAttentionForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                     void *stream, void *extra) {
  Step s;
  if (nparam != 10 || ndims[5] != 5 || ndims[6] != 5 || !ReadStep(params, ndims, shapes, dtypes, 7, shapes[5], &s))
    return 1;
  if (shapes[5][4] != s.vdim || shapes[6][3] != s.tile || shapes[6][4] != 1) return 1;
  if (!Is(dtypes[5], "float32") || !Is(dtypes[6], "float32")) return 1;
  Forward(s, In<float>(params, 0), In<float>(params, 1), In<float>(params, 2), In<float>(params, 3),
          In<float>(params, 4), In<float>(params, 5), In<float>(params, 6), static_cast<float *>(params[8]),
          static_cast<float *>(params[9]));
  return 0;
}

extern "C" int BlockAttentionBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  Step s;
  if (nparam != 16 || ndims[9] != 5 || !ReadStep(params, ndims, shapes, dtypes, 12, shapes[9], &s)) return 1;
  for (int i = 5; i < 12; ++i)
    if (!Is(dtypes[i], "float32")) return 1;
  const int64_t *q = shapes[0];
  const int64_t out_shape[5] = {q[0], q[1], q[2], q[3], s.vdim}, lse_shape[5] = {q[0], q[1], q[2], q[3], 1};
  const int64_t dk_shape[4] = {s.batch, s.heads, s.keys, s.dim}, dv_shape[4] = {s.batch, s.heads, s.keys, s.vdim};
  if (ndims[5] != 5 || !Same(5, shapes[5], out_shape) || ndims[7] != 5 || !Same(5, shapes[7], out_shape) ||
      ndims[6] != 5 || !Same(5, shapes[6], lse_shape) || ndims[8] != 5 || !Same(5, shapes[8], lse_shape) ||
      shapes[9][4] != s.dim || ndims[10] != 4 || !Same(4, shapes[10], dk_shape) || ndims[11] != 4 ||
      !Same(4, shapes[11], dv_shape))
    return 1;
  float *dq = static_cast<float *>(params[13]), *dk = static_cast<float *>(params[14]);
  float *dv = static_cast<float *>(params[15]);
  std::memcpy(dq, params[9], moetrain::Size(5, shapes[9]) * sizeof(float));
  std::memcpy(dk, params[10], moetrain::Size(4, shapes[10]) * sizeof(float));
  std::memcpy(dv, params[11], moetrain::Size(4, shapes[11]) * sizeof(float));
  Backward(s, In<float>(params, 0), In<float>(params, 1), In<float>(params, 2), In<float>(params, 3),
           In<float>(params, 4), In<float>(params, 5), In<float>(params, 6), In<float>(params, 7),
           In<float>(params, 8), dq, dk, dv);
  return 0;
}
