// Causal grouped-query attention with rotary position embedding, softmax(rope(q) rope(k)^T / sqrt(D) + causal
// mask) v, straight from the projection layout (no transposes), with the causal structure exploited:
// row block [r0, r1) only multiplies keys [k0, r1) (k0 = 0 without documents). fp32.
//
//   CausalAttentionForward     q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, D], cos [S, D], sin [S, D]
//                              -> o [B, S, Hq, D]
//   CausalAttentionBackward    q, k, v, cos, sin, o, do -> dq [B, S, Hq, D], dk, dv [B, S, Hkv, D]
//   DocumentAttentionForward   q, k, v, cos [P, D], sin [P, D], positions [B, S] int32, documents [B, S] int32
//                              -> o: query t sees key u iff u <= t and documents[t] == documents[u]
//                              (packed sequences), and token t is rotated at position positions[t] (0 <= it < P:
//                              positions may restart per document)
//   DocumentAttentionBackward  q, k, v, cos, sin, positions, documents, o, do -> dq, dk, dv
//
// q and k are taken before RoPE; rope(x)_i = x_i cos_i + x_{i~} sin_i with i~ = i +- D/2 (Hugging Face
// rotate_half, `sin` carrying its sign: moetrain.layers.rope_tables). Each head is rotated (and q
// scaled by 1/sqrt(D)) into a contiguous scratch buffer once per use; the backward applies the
// transposed rotation, (R^T g)_i = g_i cos_i + g_{i~} sin_{i~}, to the gradients of the rotated q, k.
// Query head h reads key/value head h / (Hq / Hkv) (Hugging Face repeat_kv). The backward
// recomputes the probabilities block by block (FlashAttention style) instead of storing [S, S]
// per head, and uses rowsum(dP * P) = rowsum(dO * O).
//
// Documents: where the ids never decrease along a row (the packed layout moetrain.data yields), the
// keys a query may see are one run [start of its document, t], so a row block skips every key before
// the earliest document start among its rows; any other id pattern is masked key by key over [0, t].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

namespace {

constexpr int64_t kBlock = 64;   // query rows per block

struct Dims {
  int64_t batch, seq, q_heads, kv_heads, dim;
  int64_t table_rows;   // rows of the RoPE tables: S, or with positions any P
  int64_t q_stride() const { return q_heads * dim; }    // between consecutive positions
  int64_t kv_stride() const { return kv_heads * dim; }
};

// Checks q, k, v (inputs 0-2), the RoPE tables (3-4), with `documents` positions and document ids
// (5-6, int32 [B, S]), and `extra_q_like` more [B, S, Hq, D] inputs after them.
bool ReadDims(int *ndims, int64_t **shapes, const char **dtypes, bool documents, int extra_q_like, Dims *d) {
  const int side = documents ? 2 : 0;
  for (int i = 0; i < 5 + side + extra_q_like; ++i) {
    const bool table = i == 3 || i == 4, ids = i >= 5 && i < 5 + side;
    if (std::strcmp(dtypes[i], ids ? "int32" : "float32") != 0 || ndims[i] != (table || ids ? 2 : 4)) return false;
  }
  *d = {shapes[0][0], shapes[0][1], shapes[0][2], shapes[1][2], shapes[0][3], shapes[3][0]};
  if (d->kv_heads < 1 || d->q_heads % d->kv_heads || d->dim % 2) return false;
  for (int i = 1; i < 3; ++i)
    if (shapes[i][0] != d->batch || shapes[i][1] != d->seq || shapes[i][2] != d->kv_heads || shapes[i][3] != d->dim)
      return false;
  for (int i = 3; i < 5; ++i)
    if (shapes[i][0] != (documents ? d->table_rows : d->seq) || shapes[i][1] != d->dim) return false;
  for (int i = 5; i < 5 + side; ++i)
    if (shapes[i][0] != d->batch || shapes[i][1] != d->seq) return false;
  for (int i = 5 + side; i < 5 + side + extra_q_like; ++i)
    for (int a = 0; a < 4; ++a)
      if (shapes[i][a] != shapes[0][a]) return false;
  return true;
}

// Every position id indexes a row of the RoPE tables.
bool PositionsInRange(const Dims &d, const int32_t *positions) {
  if (positions == nullptr) return true;
  for (int64_t i = 0; i < d.batch * d.seq; ++i)
    if (positions[i] < 0 || positions[i] >= d.table_rows) return false;
  return true;
}

struct Rope {
  const float *cos, *sin;
  int64_t dim;
  // out [S, D] (contiguous) = scale * rope(x) for one head of x, rows `stride` floats apart; token s
  // is rotated at position pos[s] (pos == nullptr: at s).
  void Rotate(const float *x, int64_t stride, int64_t seq, const int32_t *pos, float scale, float *out) const {
    const int64_t half = dim / 2;
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t p = pos ? pos[s] : s;
      const float *xs = x + s * stride, *c = cos + p * dim, *sn = sin + p * dim;
      float *o = out + s * dim;
      for (int64_t i = 0; i < half; ++i) o[i] = scale * (xs[i] * c[i] + xs[i + half] * sn[i]);
      for (int64_t i = half; i < dim; ++i) o[i] = scale * (xs[i] * c[i] + xs[i - half] * sn[i]);
    }
  }
  // out (one head, rows `stride` apart) = scale * R^T g for g [S, D] contiguous: the gradient of x.
  void RotateBack(const float *g, int64_t seq, const int32_t *pos, float scale, float *out, int64_t stride) const {
    const int64_t half = dim / 2;
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t p = pos ? pos[s] : s;
      const float *gs = g + s * dim, *c = cos + p * dim, *sn = sin + p * dim;
      float *o = out + s * stride;
      for (int64_t i = 0; i < half; ++i) o[i] = scale * (gs[i] * c[i] + gs[i + half] * sn[i + half]);
      for (int64_t i = half; i < dim; ++i) o[i] = scale * (gs[i] * c[i] + gs[i - half] * sn[i - half]);
    }
  }
};

// Which keys each query of one sequence may see: key u <= t with ids[u] == ids[t] (ids == nullptr:
// every u <= t). first[t] is the lowest key t may see: its document's start where the ids never
// decrease along the sequence, else 0 (then every key of [0, t] is checked).
struct Visibility {
  const int32_t *ids = nullptr;
  std::vector<int64_t> first;
  bool runs = true;   // every query sees exactly the keys [first[t], t]: no key-by-key check

  Visibility(const int32_t *document_ids, int64_t seq) : ids(document_ids), first(seq, 0) {
    if (ids == nullptr) return;
    for (int64_t t = 1; t < seq; ++t)
      if (ids[t] < ids[t - 1]) {                               // not a packed layout: check every key
        runs = false;
        return;
      }
    for (int64_t t = 1; t < seq; ++t) first[t] = ids[t] == ids[t - 1] ? first[t - 1] : t;
  }
  bool Visible(int64_t t, int64_t u) const { return ids == nullptr || ids[u] == ids[t]; }
  // The lowest key any query of rows [r0, r1) may see (first[] never decreases).
  int64_t BlockStart(int64_t r0) const { return first[r0]; }
};

// probs[i, :cols] = masked softmax of the scores of query r0 + i over keys [k0, k0 + cols); a key
// the query may not see (vis) gets probability 0. Key r0 + i itself is always visible. Where the
// visible keys are one run (causal, packed documents) the exp loop has no branch, so the compiler
// vectorises it (libmvec expf, -ffast-math): the scalar expf was most of this kernel's time.
void MaskedSoftmax(float *probs, int64_t rows, int64_t cols, int64_t r0, int64_t k0, const Visibility &vis) {
  for (int64_t i = 0; i < rows; ++i) {
    float *row = probs + i * cols;
    const int64_t t = r0 + i, lo = vis.first[t] - k0, hi = t - k0 + 1;   // candidate keys [lo, hi)
    float top = row[hi - 1];
    if (vis.runs) {
      for (int64_t j = lo; j < hi; ++j) top = std::max(top, row[j]);
      float sum = 0.0f;
      for (int64_t j = lo; j < hi; ++j) {
        row[j] = std::exp(row[j] - top);
        sum += row[j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = lo; j < hi; ++j) row[j] *= inv;
      std::fill(row, row + lo, 0.0f);
      std::fill(row + hi, row + cols, 0.0f);
      continue;
    }
    for (int64_t j = lo; j < hi; ++j)
      if (vis.Visible(t, k0 + j)) top = std::max(top, row[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      const bool seen = j >= lo && j < hi && vis.Visible(t, k0 + j);
      row[j] = seen ? std::exp(row[j] - top) : 0.0f;
      sum += row[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = lo; j < hi; ++j) row[j] *= inv;
  }
}

// Scores and probabilities of query rows [r0, r1) of one head against keys [k0, r1); qr, kr are the
// rotated (and for q scaled) heads, [S, D] contiguous.
void BlockProbs(const Dims &d, const float *qr, const float *kr, int64_t r0, int64_t r1, int64_t k0,
                const Visibility &vis, float *probs) {
  dnnl_sgemm('N', 'T', r1 - r0, r1 - k0, d.dim, 1.0f, qr + r0 * d.dim, d.dim, kr + k0 * d.dim, d.dim, 0.0f, probs,
             r1 - k0);
  MaskedSoftmax(probs, r1 - r0, r1 - k0, r0, k0, vis);
}

// The forward pass; positions / documents nullptr for plain causal attention at positions 0..S-1.
void Forward(const Dims &d, const float *q, const float *k, const float *v, const Rope &rope, const int32_t *positions,
             const int32_t *documents, float *o) {
  const int64_t group = d.q_heads / d.kv_heads;
  const int64_t q_units = d.batch * d.q_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.dim));
  // One task per (batch, query head); scratch per thread: probs [kBlock, S], qr, kr [S, D].
  const int64_t scratch = kBlock * d.seq + 2 * d.seq * d.dim;
  std::vector<float> buffers(moetrain::Slots() * scratch);
  moetrain::ParallelFor(q_units, [&](int64_t unit, int slot) {
    float *probs = buffers.data() + slot * scratch, *qr = probs + kBlock * d.seq, *kr = qr + d.seq * d.dim;
    const int64_t b = unit / d.q_heads, h = unit % d.q_heads;
    const int64_t q_offset = b * d.seq * d.q_stride() + h * d.dim;
    const int64_t kv_offset = b * d.seq * d.kv_stride() + (h / group) * d.dim;
    const int32_t *pos = positions ? positions + b * d.seq : nullptr;
    const Visibility vis(documents ? documents + b * d.seq : nullptr, d.seq);
    rope.Rotate(q + q_offset, d.q_stride(), d.seq, pos, scale, qr);
    rope.Rotate(k + kv_offset, d.kv_stride(), d.seq, pos, 1.0f, kr);
    for (int64_t r0 = 0; r0 < d.seq; r0 += kBlock) {
      const int64_t r1 = std::min(d.seq, r0 + kBlock), k0 = vis.BlockStart(r0);
      BlockProbs(d, qr, kr, r0, r1, k0, vis, probs);
      dnnl_sgemm('N', 'N', r1 - r0, d.dim, r1 - k0, 1.0f, probs, r1 - k0, v + kv_offset + k0 * d.kv_stride(),
                 d.kv_stride(), 0.0f, o + q_offset + r0 * d.q_stride(), d.q_stride());
    }
  });
}

void Backward(const Dims &d, const float *q, const float *k, const float *v, const Rope &rope,
              const int32_t *positions, const int32_t *documents, const float *o, const float *dout, float *dq,
              float *dk, float *dv) {
  const int64_t group = d.q_heads / d.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.dim));
  // A unit is one (batch, kv head): it owns that slice of dk / dv, accumulated over its query heads.
  const int64_t kv_units = d.batch * d.kv_heads;
  // One task per (batch, kv head); scratch per thread: probs, dprobs [kBlock, S], qr, kr, dqr, dkr [S, D].
  const int64_t block = kBlock * d.seq, head = d.seq * d.dim, scratch = 2 * block + 4 * head;
  std::vector<float> buffers(moetrain::Slots() * scratch);
  moetrain::ParallelFor(kv_units, [&](int64_t unit, int slot) {
    float *probs = buffers.data() + slot * scratch, *dprobs = probs + block;
    float *qr = dprobs + block, *kr = qr + head, *dqr = kr + head, *dkr = dqr + head;
    const int64_t b = unit / d.kv_heads, kvh = unit % d.kv_heads;
    const int64_t kv_offset = b * d.seq * d.kv_stride() + kvh * d.dim;
    const int32_t *pos = positions ? positions + b * d.seq : nullptr;
    const Visibility vis(documents ? documents + b * d.seq : nullptr, d.seq);
    rope.Rotate(k + kv_offset, d.kv_stride(), d.seq, pos, 1.0f, kr);
    std::fill(dkr, dkr + head, 0.0f);
    for (int64_t s = 0; s < d.seq; ++s) std::memset(dv + kv_offset + s * d.kv_stride(), 0, d.dim * sizeof(float));
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      const int64_t q_offset = b * d.seq * d.q_stride() + h * d.dim;
      rope.Rotate(q + q_offset, d.q_stride(), d.seq, pos, scale, qr);
      for (int64_t r0 = 0; r0 < d.seq; r0 += kBlock) {
        const int64_t r1 = std::min(d.seq, r0 + kBlock), rows = r1 - r0;
        const int64_t k0 = vis.BlockStart(r0), cols = r1 - k0;
        const int64_t row_offset = q_offset + r0 * d.q_stride();
        const float *v_block = v + kv_offset + k0 * d.kv_stride();
        BlockProbs(d, qr, kr, r0, r1, k0, vis, probs);
        // dP = dO V^T; dS = P * (dP - rowsum(dO * O))
        dnnl_sgemm('N', 'T', rows, cols, d.dim, 1.0f, dout + row_offset, d.q_stride(), v_block, d.kv_stride(), 0.0f,
                   dprobs, cols);
        for (int64_t i = 0; i < rows; ++i) {
          const float *do_row = dout + row_offset + i * d.q_stride(), *o_row = o + row_offset + i * d.q_stride();
          float dot = 0.0f;
          for (int64_t c = 0; c < d.dim; ++c) dot += do_row[c] * o_row[c];
          float *dp = dprobs + i * cols;
          const float *p = probs + i * cols;
          for (int64_t j = 0; j < cols; ++j) dp[j] = p[j] * (dp[j] - dot);
        }
        // dQr = dS Kr; dKr += dS^T Qr; dV += P^T dO   (keys [k0, r1))
        dnnl_sgemm('N', 'N', rows, d.dim, cols, 1.0f, dprobs, cols, kr + k0 * d.dim, d.dim, 0.0f,
                   dqr + r0 * d.dim, d.dim);
        dnnl_sgemm('T', 'N', cols, d.dim, rows, 1.0f, dprobs, cols, qr + r0 * d.dim, d.dim, 1.0f,
                   dkr + k0 * d.dim, d.dim);
        dnnl_sgemm('T', 'N', cols, d.dim, rows, 1.0f, probs, cols, dout + row_offset, d.q_stride(), 1.0f,
                   dv + kv_offset + k0 * d.kv_stride(), d.kv_stride());
      }
      rope.RotateBack(dqr, d.seq, pos, scale, dq + q_offset, d.q_stride());
    }
    rope.RotateBack(dkr, d.seq, pos, 1.0f, dk + kv_offset, d.kv_stride());
  });
}

template <typename T>
const T *In(void **params, int i) {
  return static_cast<const T *>(params[i]);
}

}  // namespace

extern "C" std::vector<int64_t> CausalAttentionForwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}
extern "C" std::vector<std::vector<int64_t>> CausalAttentionBackwardInferShape(int *ndims, int64_t **shapes,
                                                                               void *extra) {
  return {std::vector<int64_t>(shapes[0], shapes[0] + 4), std::vector<int64_t>(shapes[1], shapes[1] + 4),
          std::vector<int64_t>(shapes[2], shapes[2] + 4)};
}
extern "C" int CausalAttentionForwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<int> CausalAttentionBackwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0], type_ids[0]};
}

extern "C" std::vector<int64_t> DocumentAttentionForwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return CausalAttentionForwardInferShape(ndims, shapes, extra);
}
extern "C" std::vector<std::vector<int64_t>> DocumentAttentionBackwardInferShape(int *ndims, int64_t **shapes,
                                                                                 void *extra) {
  return CausalAttentionBackwardInferShape(ndims, shapes, extra);
}
extern "C" int DocumentAttentionForwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<int> DocumentAttentionBackwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0], type_ids[0]};
}

extern "C" int CausalAttentionForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  Dims d;
  if (nparam != 6 || !ReadDims(ndims, shapes, dtypes, false, 0, &d)) return 1;
  const Rope rope{In<float>(params, 3), In<float>(params, 4), d.dim};
  Forward(d, In<float>(params, 0), In<float>(params, 1), In<float>(params, 2), rope, nullptr, nullptr,
          static_cast<float *>(params[5]));
  return 0;
}

extern "C" int CausalAttentionBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  Dims d;
  if (nparam != 10 || !ReadDims(ndims, shapes, dtypes, false, 2, &d)) return 1;
  const Rope rope{In<float>(params, 3), In<float>(params, 4), d.dim};
  Backward(d, In<float>(params, 0), In<float>(params, 1), In<float>(params, 2), rope, nullptr, nullptr,
           In<float>(params, 5), In<float>(params, 6), static_cast<float *>(params[7]), static_cast<float *>(params[8]),
           static_cast<float *>(params[9]));
  return 0;
}

extern "C" int DocumentAttentionForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                        void *stream, void *extra) {
  Dims d;
  if (nparam != 8 || !ReadDims(ndims, shapes, dtypes, true, 0, &d)) return 1;
  const int32_t *positions = In<int32_t>(params, 5);
  if (!PositionsInRange(d, positions)) return 1;
  const Rope rope{In<float>(params, 3), In<float>(params, 4), d.dim};
  Forward(d, In<float>(params, 0), In<float>(params, 1), In<float>(params, 2), rope, positions, In<int32_t>(params, 6),
          static_cast<float *>(params[7]));
  return 0;
}

extern "C" int DocumentAttentionBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  Dims d;
  if (nparam != 12 || !ReadDims(ndims, shapes, dtypes, true, 2, &d)) return 1;
  const int32_t *positions = In<int32_t>(params, 5);
  if (!PositionsInRange(d, positions)) return 1;
  const Rope rope{In<float>(params, 3), In<float>(params, 4), d.dim};
  Backward(d, In<float>(params, 0), In<float>(params, 1), In<float>(params, 2), rope, positions,
           In<int32_t>(params, 6), In<float>(params, 7), In<float>(params, 8), static_cast<float *>(params[9]),
           static_cast<float *>(params[10]), static_cast<float *>(params[11]));
  return 0;
}
