// LM head + softmax cross-entropy without the [N, V] logits: rows are processed in chunks whose logits
// live only in a per-thread scratch buffer (a few MB), fp32.
//
//   LMHeadLogitStats          h [N, H], w [Vs, H], labels [N] -> m [N], s [N], t [N]: over this vocabulary
//                             slice, m = max_j z_j, s = sum_j exp(z_j - m), t = z_label, or 0 when the
//                             label is outside [0, Vs). The partials a vocabulary-parallel loss reduces
//                             over ranks: loss = log(sum_r s_r exp(m_r - M)) + M - sum_r t_r, M = max_r m_r.
//   LMHeadLogitStatsStrict    the same, but a label outside [0, Vs) fails the op (whole vocabulary).
//   LMHeadLogitStatsBackward  h, w, labels, m, ds, dt -> dh [N, H], dw [Vs, H] for the upstream gradients
//                             ds, dt of s and t (m is a shift that no loss depends on): recomputes z per
//                             chunk, dz = ds exp(z - m) + dt onehot(label).
//
// Training uses the stats and their backward (one GEMM forward, three backward): the head weight's
// gradient is made in the backward, where it is the gradient itself, not a [V, H] tensor returned by
// the forward and kept to the backward (which, for the main head and again for DeepSeek's MTP head,
// held two head-sized fp32 tensors through the whole pass, docs/plan.md).
//
// The gradients go through the rows in groups of a few hundred, each in three sets of tasks on the
// thread pool (common.h): by vocabulary block, the group's logits z[:, block] = h w[block]^T into one
// [group, V] buffer; by row chunk, z -> dz = dloss/dz (whole rows: the softmax); by vocabulary block
// again, dw[block] (+)= dz[:, block]^T h and the block's share of dh, dz[:, block] w[block], which are
// then added in block order. Every element is summed in a fixed order (groups in row order, blocks
// in vocabulary order), so results do not depend on which thread ran
// what; a block of w is read twice per group and dw once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16.h"
#include "common.h"

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

namespace {

// Logits per chunk: 4 MB (128 rows at V = 8192; 64 to 512 rows measured within 10 % of each other).
constexpr int64_t kChunkFloats = 1 << 20;
// The dz buffer of a gradient group: 16 MB (4 chunks of 128 rows at V = 8192).
constexpr int64_t kGroupFloats = 1 << 22;

struct Problem {
  const float *h, *w;
  const int32_t *labels;
  int64_t rows, hidden, vocab;
  // At least 64 rows: the GEMMs of fewer rows run well below their peak.
  int64_t ChunkRows() const { return std::max<int64_t>(64, kChunkFloats / vocab); }
  // Rows of a gradient group: its dz buffer holds about kGroupFloats, at least one chunk.
  int64_t GroupRows() const { return ChunkRows() * std::max<int64_t>(1, kGroupFloats / (ChunkRows() * vocab)); }
};

bool ReadProblem(int *ndims, int64_t **shapes, const char **dtypes, void **params, Problem *p) {
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || !moetrain::Float32(dtypes[0]) ||
      !moetrain::Float32(dtypes[1]) || std::strcmp(dtypes[2], "int32") != 0)
    return false;
  *p = {static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
        static_cast<const int32_t *>(params[2]), shapes[0][0], shapes[0][1], shapes[1][0]};
  return shapes[1][1] == p->hidden && shapes[2][0] == p->rows && p->vocab > 0;
}

// z [c, V] = h[r0 : r0 + c] w^T
void Logits(const Problem &p, int64_t r0, int64_t c, float *z) {
  dnnl_sgemm('N', 'T', c, p.vocab, p.hidden, 1.0f, p.h + r0 * p.hidden, p.hidden, p.w, p.hidden, 0.0f, z, p.vocab);
}

inline float RowMax(const float *z, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < v; ++j) m = std::max(m, z[j]);
  return m;
}

// z <- exp(z - m); returns the sum.
inline float ExpInPlace(float *z, int64_t v, float m) {
  float s = 0.0f;
  for (int64_t j = 0; j < v; ++j) {
    z[j] = std::exp(z[j] - m);
    s += z[j];
  }
  return s;
}

// dh and dw for the rows, group by group (file comment): fill_dz(r0, c, z) turns the logits of rows
// [r0, r0 + c) in z into dloss/dz.
template <typename FillDz>
void HeadGradients(const Problem &p, float *dh, float *dw, FillDz fill_dz) {
  const int64_t chunk = p.ChunkRows(), group = p.GroupRows();
  if (p.rows == 0) {
    std::memset(dw, 0, p.vocab * p.hidden * sizeof(float));
    return;
  }
  const int64_t group_rows = std::min(group, p.rows);
  // Vocabulary blocks: a multiple of 64 rows of w, about four per thread. Each product below reads a
  // block of w once per group (row chunks each reading the whole of w streamed it ~4x more often).
  const int64_t block = std::max<int64_t>(64, (p.vocab / (4 * moetrain::NumThreads()) + 63) / 64 * 64);
  const int64_t blocks = (p.vocab + block - 1) / block;
  std::vector<float> dz(group_rows * p.vocab), dh_part(blocks * group_rows * p.hidden);
  for (int64_t g0 = 0; g0 < p.rows; g0 += group) {
    const int64_t rows = std::min(group, p.rows - g0);
    const float *hg = p.h + g0 * p.hidden;
    moetrain::ParallelFor(blocks, [&](int64_t b, int) {   // z[:, block] = h[group] w[block]^T
      const int64_t v0 = b * block, v1 = std::min(p.vocab, v0 + block);
      dnnl_sgemm('N', 'T', rows, v1 - v0, p.hidden, 1.0f, hg, p.hidden, p.w + v0 * p.hidden, p.hidden, 0.0f,
                 dz.data() + v0, p.vocab);
    });
    moetrain::ParallelFor((rows + chunk - 1) / chunk, [&](int64_t task, int) {   // whole rows: z -> dz
      const int64_t r0 = g0 + task * chunk, c = std::min(chunk, g0 + rows - r0);
      fill_dz(r0, c, dz.data() + (r0 - g0) * p.vocab);
    });
    moetrain::ParallelFor(blocks, [&](int64_t b, int) {
      // dw[block] (+)= dz[:, block]^T h[group]; this block's share of dh: dz[:, block] w[block]
      const int64_t v0 = b * block, v1 = std::min(p.vocab, v0 + block);
      dnnl_sgemm('T', 'N', v1 - v0, p.hidden, rows, 1.0f, dz.data() + v0, p.vocab, hg, p.hidden,
                 g0 == 0 ? 0.0f : 1.0f, dw + v0 * p.hidden, p.hidden);
      dnnl_sgemm('N', 'N', rows, p.hidden, v1 - v0, 1.0f, dz.data() + v0, p.vocab, p.w + v0 * p.hidden, p.hidden,
                 0.0f, dh_part.data() + b * group_rows * p.hidden, p.hidden);
    });
    moetrain::ParallelFor((rows + chunk - 1) / chunk, [&](int64_t task, int) {   // dh = the blocks' shares, in order
      const int64_t r0 = task * chunk, r1 = std::min(rows, r0 + chunk);
      float *out = dh + (g0 + r0) * p.hidden;
      std::memcpy(out, dh_part.data() + r0 * p.hidden, (r1 - r0) * p.hidden * sizeof(float));
      for (int64_t b = 1; b < blocks; ++b) {
        const float *part = dh_part.data() + (b * group_rows + r0) * p.hidden;
        for (int64_t i = 0; i < (r1 - r0) * p.hidden; ++i) out[i] += part[i];
      }
    });
  }
}

int LogitStats(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool strict) {
  Problem p;
  if (nparam != 6 || !ReadProblem(ndims, shapes, dtypes, params, &p)) return 1;
  float *m_out = static_cast<float *>(params[3]), *s_out = static_cast<float *>(params[4]);
  float *t_out = static_cast<float *>(params[5]);
  const int64_t chunk = p.ChunkRows(), chunks = (p.rows + chunk - 1) / chunk;
  std::vector<char> ok(chunks, 1);
  std::vector<float> scratch(moetrain::Slots() * std::min(chunk, std::max<int64_t>(p.rows, 1)) * p.vocab);
  moetrain::ParallelFor(chunks, [&](int64_t task, int slot) {
    const int64_t r0 = task * chunk, c = std::min(chunk, p.rows - r0);
    float *z = scratch.data() + slot * std::min(chunk, p.rows) * p.vocab;
    Logits(p, r0, c, z);
    for (int64_t i = 0; i < c; ++i) {
      float *zi = z + i * p.vocab;
      const int64_t r = r0 + i, label = p.labels[r];
      const bool inside = label >= 0 && label < p.vocab;
      if (strict && !inside) ok[task] = 0;
      t_out[r] = inside ? zi[label] : 0.0f;
      m_out[r] = RowMax(zi, p.vocab);
      s_out[r] = ExpInPlace(zi, p.vocab, m_out[r]);
    }
  });
  return std::all_of(ok.begin(), ok.end(), [](char v) { return v; }) ? 0 : 2;
}

}  // namespace

extern "C" std::vector<std::vector<int64_t>> LMHeadLogitStatsInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {{shapes[0][0]}, {shapes[0][0]}, {shapes[0][0]}};
}
extern "C" std::vector<int> LMHeadLogitStatsInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0], type_ids[0]};
}
extern "C" std::vector<std::vector<int64_t>> LMHeadLogitStatsStrictInferShape(int *ndims, int64_t **shapes,
                                                                              void *extra) {
  return LMHeadLogitStatsInferShape(ndims, shapes, extra);
}
extern "C" std::vector<int> LMHeadLogitStatsStrictInferType(std::vector<int> type_ids, void *extra) {
  return LMHeadLogitStatsInferType(type_ids, extra);
}
extern "C" std::vector<std::vector<int64_t>> LMHeadLogitStatsBackwardInferShape(int *ndims, int64_t **shapes,
                                                                                void *extra) {
  return {{shapes[0][0], shapes[0][1]}, {shapes[1][0], shapes[1][1]}};
}
extern "C" std::vector<int> LMHeadLogitStatsBackwardInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0]};
}

extern "C" int LMHeadLogitStats(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  return LogitStats(nparam, params, ndims, shapes, dtypes, false);
}

extern "C" int LMHeadLogitStatsStrict(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  return LogitStats(nparam, params, ndims, shapes, dtypes, true);
}

extern "C" int LMHeadLogitStatsBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                        void *stream, void *extra) {
  Problem p;
  if (nparam != 8 || !ReadProblem(ndims, shapes, dtypes, params, &p)) return 1;
  for (int i = 3; i < 6; ++i)
    if (ndims[i] != 1 || shapes[i][0] != p.rows || !moetrain::Float32(dtypes[i])) return 1;
  const float *m = static_cast<const float *>(params[3]), *ds = static_cast<const float *>(params[4]);
  const float *dt = static_cast<const float *>(params[5]);
  float *dh = static_cast<float *>(params[6]), *dw = static_cast<float *>(params[7]);
  HeadGradients(p, dh, dw, [&](int64_t r0, int64_t c, float *z) {
    for (int64_t i = 0; i < c; ++i) {
      float *zi = z + i * p.vocab;
      const int64_t r = r0 + i, label = p.labels[r];
      const float shift = m[r], scale = ds[r];
      for (int64_t j = 0; j < p.vocab; ++j) zi[j] = scale * std::exp(zi[j] - shift);
      if (label >= 0 && label < p.vocab) zi[label] += dt[r];
    }
  });
  return 0;
}

// bf16 (bf16.h): h and the head weight read as bf16 values (an fp32 copy of each, rounded, for the call);
// the logits, the statistics and the loss stay fp32; the gradients (already scaled by the upstream ones)
// are rounded to bf16 values, as the rounding casts' backward rounds them.
MOETRAIN_BF16_KERNEL(LMHeadLogitStats, "ww-|---")
extern "C" std::vector<int> LMHeadLogitStatsBF16InferType(std::vector<int> type_ids, void *extra) {
  return LMHeadLogitStatsInferType(type_ids, extra);
}
MOETRAIN_BF16_KERNEL(LMHeadLogitStatsStrict, "ww-|---")
extern "C" std::vector<int> LMHeadLogitStatsStrictBF16InferType(std::vector<int> type_ids, void *extra) {
  return LMHeadLogitStatsInferType(type_ids, extra);
}
MOETRAIN_BF16_KERNEL(LMHeadLogitStatsBackward, "ww----|ww")
MOETRAIN_BF16_TYPES(LMHeadLogitStatsBackward, 0, 1)
