// Causal grouped-query attention with rotary position embedding, softmax(rope(q) rope(k)^T / sqrt(D) + causal
// mask) v, straight from the projection layout (no transposes), with the causal structure exploited:
// row block [r0, r1) only multiplies keys [0, r1). fp32.
//
//   CausalAttentionForward   q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, D], cos [S, D], sin [S, D]
//                            -> o [B, S, Hq, D]
//   CausalAttentionBackward  q, k, v, cos, sin, o, do -> dq [B, S, Hq, D], dk, dv [B, S, Hkv, D]
//
// q and k are taken before RoPE; rope(x)_i = x_i cos_i + x_{i~} sin_i with i~ = i +- D/2 (Hugging Face
// rotate_half, `sin` carrying its sign: moetrain.layers.rope_tables). Each head is rotated (and q
// scaled by 1/sqrt(D)) into a contiguous scratch buffer once per use; the backward applies the
// transposed rotation, (R^T g)_i = g_i cos_i + g_{i~} sin_{i~}, to the gradients of the rotated q, k.
// Query head h reads key/value head h / (Hq / Hkv) (Hugging Face repeat_kv). The backward
// recomputes the probabilities block by block (FlashAttention style) instead of storing [S, S]
// per head, and uses rowsum(dP * P) = rowsum(dO * O).
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
  int64_t q_stride() const { return q_heads * dim; }    // between consecutive positions
  int64_t kv_stride() const { return kv_heads * dim; }
};

// Checks q, k, v (inputs 0-2), the RoPE tables (3-4) and `extra_q_like` more [B, S, Hq, D] inputs after them.
bool ReadDims(int *ndims, int64_t **shapes, const char **dtypes, int extra_q_like, Dims *d) {
  for (int i = 0; i < 5 + extra_q_like; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0 || ndims[i] != (i == 3 || i == 4 ? 2 : 4)) return false;
  *d = {shapes[0][0], shapes[0][1], shapes[0][2], shapes[1][2], shapes[0][3]};
  if (d->kv_heads < 1 || d->q_heads % d->kv_heads || d->dim % 2) return false;
  for (int i = 1; i < 3; ++i)
    if (shapes[i][0] != d->batch || shapes[i][1] != d->seq || shapes[i][2] != d->kv_heads || shapes[i][3] != d->dim)
      return false;
  for (int i = 3; i < 5; ++i)
    if (shapes[i][0] != d->seq || shapes[i][1] != d->dim) return false;
  for (int i = 5; i < 5 + extra_q_like; ++i)
    for (int a = 0; a < 4; ++a)
      if (shapes[i][a] != shapes[0][a]) return false;
  return true;
}

struct Rope {
  const float *cos, *sin;
  int64_t dim;
  // out [S, D] (contiguous) = scale * rope(x) for one head of x, rows `stride` floats apart.
  void Rotate(const float *x, int64_t stride, int64_t seq, float scale, float *out) const {
    const int64_t half = dim / 2;
    for (int64_t s = 0; s < seq; ++s) {
      const float *xs = x + s * stride, *c = cos + s * dim, *sn = sin + s * dim;
      float *o = out + s * dim;
      for (int64_t i = 0; i < half; ++i) o[i] = scale * (xs[i] * c[i] + xs[i + half] * sn[i]);
      for (int64_t i = half; i < dim; ++i) o[i] = scale * (xs[i] * c[i] + xs[i - half] * sn[i]);
    }
  }
  // out (one head, rows `stride` apart) = scale * R^T g for g [S, D] contiguous: the gradient of x.
  void RotateBack(const float *g, int64_t seq, float scale, float *out, int64_t stride) const {
    const int64_t half = dim / 2;
    for (int64_t s = 0; s < seq; ++s) {
      const float *gs = g + s * dim, *c = cos + s * dim, *sn = sin + s * dim;
      float *o = out + s * stride;
      for (int64_t i = 0; i < half; ++i) o[i] = scale * (gs[i] * c[i] + gs[i + half] * sn[i + half]);
      for (int64_t i = half; i < dim; ++i) o[i] = scale * (gs[i] * c[i] + gs[i - half] * sn[i - half]);
    }
  }
};

// probs[i, :cols] = causal softmax of scores rows [r0, r0 + rows) over keys [0, cols): key j is
// visible to query r0 + i when j <= r0 + i; hidden entries become 0.
void CausalSoftmax(float *probs, int64_t rows, int64_t cols, int64_t r0) {
  for (int64_t i = 0; i < rows; ++i) {
    float *row = probs + i * cols;
    const int64_t visible = r0 + i + 1;
    float top = row[0];
    for (int64_t j = 1; j < visible; ++j) top = std::max(top, row[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < visible; ++j) {
      row[j] = std::exp(row[j] - top);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < visible; ++j) row[j] *= inv;
    for (int64_t j = visible; j < cols; ++j) row[j] = 0.0f;
  }
}

// Scores and probabilities of query rows [r0, r1) of one head against keys [0, r1); qr, kr are the
// rotated (and for q scaled) heads, [S, D] contiguous.
void BlockProbs(const Dims &d, const float *qr, const float *kr, int64_t r0, int64_t r1, float *probs) {
  dnnl_sgemm('N', 'T', r1 - r0, r1, d.dim, 1.0f, qr + r0 * d.dim, d.dim, kr, d.dim, 0.0f, probs, r1);
  CausalSoftmax(probs, r1 - r0, r1, r0);
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

extern "C" int CausalAttentionForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  Dims d;
  if (nparam != 6 || !ReadDims(ndims, shapes, dtypes, 0, &d)) return 1;
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const Rope rope{static_cast<const float *>(params[3]), static_cast<const float *>(params[4]), d.dim};
  float *o = static_cast<float *>(params[5]);
  const int64_t group = d.q_heads / d.kv_heads;
  const int64_t q_units = d.batch * d.q_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.dim));
  moetrain::ParallelSplit(q_units, moetrain::PartsFor(q_units, 1), [&](int, int64_t first, int64_t end) {
    std::vector<float> probs(kBlock * d.seq), qr(d.seq * d.dim), kr(d.seq * d.dim);
    for (int64_t unit = first; unit < end; ++unit) {
      const int64_t b = unit / d.q_heads, h = unit % d.q_heads;
      const int64_t q_offset = b * d.seq * d.q_stride() + h * d.dim;
      const int64_t kv_offset = b * d.seq * d.kv_stride() + (h / group) * d.dim;
      rope.Rotate(q + q_offset, d.q_stride(), d.seq, scale, qr.data());
      rope.Rotate(k + kv_offset, d.kv_stride(), d.seq, 1.0f, kr.data());
      for (int64_t r0 = 0; r0 < d.seq; r0 += kBlock) {
        const int64_t r1 = std::min(d.seq, r0 + kBlock);
        BlockProbs(d, qr.data(), kr.data(), r0, r1, probs.data());
        dnnl_sgemm('N', 'N', r1 - r0, d.dim, r1, 1.0f, probs.data(), r1, v + kv_offset, d.kv_stride(), 0.0f,
                   o + q_offset + r0 * d.q_stride(), d.q_stride());
      }
    }
  });
  return 0;
}

extern "C" int CausalAttentionBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  Dims d;
  if (nparam != 10 || !ReadDims(ndims, shapes, dtypes, 2, &d)) return 1;
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const Rope rope{static_cast<const float *>(params[3]), static_cast<const float *>(params[4]), d.dim};
  const float *o = static_cast<const float *>(params[5]), *dout = static_cast<const float *>(params[6]);
  float *dq = static_cast<float *>(params[7]), *dk = static_cast<float *>(params[8]);
  float *dv = static_cast<float *>(params[9]);
  const int64_t group = d.q_heads / d.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.dim));
  // A unit is one (batch, kv head): it owns that slice of dk / dv, accumulated over its query heads.
  const int64_t kv_units = d.batch * d.kv_heads;
  moetrain::ParallelSplit(kv_units, moetrain::PartsFor(kv_units, 1), [&](int, int64_t first, int64_t end) {
    std::vector<float> probs(kBlock * d.seq), dprobs(kBlock * d.seq);
    std::vector<float> qr(d.seq * d.dim), kr(d.seq * d.dim), dqr(d.seq * d.dim), dkr(d.seq * d.dim);
    for (int64_t unit = first; unit < end; ++unit) {
      const int64_t b = unit / d.kv_heads, kvh = unit % d.kv_heads;
      const int64_t kv_offset = b * d.seq * d.kv_stride() + kvh * d.dim;
      rope.Rotate(k + kv_offset, d.kv_stride(), d.seq, 1.0f, kr.data());
      std::fill(dkr.begin(), dkr.end(), 0.0f);
      for (int64_t s = 0; s < d.seq; ++s) std::memset(dv + kv_offset + s * d.kv_stride(), 0, d.dim * sizeof(float));
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        const int64_t q_offset = b * d.seq * d.q_stride() + h * d.dim;
        rope.Rotate(q + q_offset, d.q_stride(), d.seq, scale, qr.data());
        for (int64_t r0 = 0; r0 < d.seq; r0 += kBlock) {
          const int64_t r1 = std::min(d.seq, r0 + kBlock), rows = r1 - r0;
          const int64_t row_offset = q_offset + r0 * d.q_stride();
          BlockProbs(d, qr.data(), kr.data(), r0, r1, probs.data());
          // dP = dO V^T; dS = P * (dP - rowsum(dO * O))
          dnnl_sgemm('N', 'T', rows, r1, d.dim, 1.0f, dout + row_offset, d.q_stride(), v + kv_offset, d.kv_stride(),
                     0.0f, dprobs.data(), r1);
          for (int64_t i = 0; i < rows; ++i) {
            const float *do_row = dout + row_offset + i * d.q_stride(), *o_row = o + row_offset + i * d.q_stride();
            float dot = 0.0f;
            for (int64_t c = 0; c < d.dim; ++c) dot += do_row[c] * o_row[c];
            float *dp = dprobs.data() + i * r1;
            const float *p = probs.data() + i * r1;
            for (int64_t j = 0; j < r1; ++j) dp[j] = p[j] * (dp[j] - dot);
          }
          // dQr = dS Kr; dKr += dS^T Qr; dV += P^T dO
          dnnl_sgemm('N', 'N', rows, d.dim, r1, 1.0f, dprobs.data(), r1, kr.data(), d.dim, 0.0f,
                     dqr.data() + r0 * d.dim, d.dim);
          dnnl_sgemm('T', 'N', r1, d.dim, rows, 1.0f, dprobs.data(), r1, qr.data() + r0 * d.dim, d.dim, 1.0f,
                     dkr.data(), d.dim);
          dnnl_sgemm('T', 'N', r1, d.dim, rows, 1.0f, probs.data(), r1, dout + row_offset, d.q_stride(), 1.0f,
                     dv + kv_offset, d.kv_stride());
        }
        rope.RotateBack(dqr.data(), d.seq, scale, dq + q_offset, d.q_stride());
      }
      rope.RotateBack(dkr.data(), d.seq, 1.0f, dk + kv_offset, d.kv_stride());
    }
  });
  return 0;
}
