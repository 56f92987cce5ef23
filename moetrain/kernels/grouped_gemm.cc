// Grouped matrix products for MoE experts on CPU: row n of the token matrix is multiplied by
// the weight matrix of expert row_expert[n]. Every maximal run of rows with the same expert is one
// dnnl_sgemm call (oneDNN ships with MindSpore), so sorted rows (the dropless dispatcher's layout)
// cost one GEMM per expert per task: no padding rows and no per-block weight copies. A row whose
// expert id is E (one past the last expert) is padding: it is skipped (no GEMM) and its NN/NT
// output row is zero, so a static buffer longer than the real rows costs no arithmetic.
//
// MindSpore AOT kernel ABI (ops.Custom(func_type="aot")): params holds the inputs, then the
// outputs; a non-zero return value fails the op. `<Kernel>InferShape` / `<Kernel>InferType` are the
// C++ shape and dtype inference MindSpore calls (they keep working where a graph is compiled
// without the Python primitive, e.g. a jit graph returning a dict).
//
//   GroupedMatmulNN  x [N, K], w [E, K, F], row_expert [N] -> y [N, F]   y_n  = x_n @ w[e_n]
//   GroupedMatmulNT  g [N, F], w [E, K, F], row_expert [N] -> y [N, K]   y_n  = g_n @ w[e_n]^T
//   GroupedMatmulTN  x [N, K], g [N, F], row_expert [N], w [E, K, F] -> y [E, K, F]
//                    y[e] = sum over rows n of expert e of x_n^T g_n (w: only its shape is read)
//
// The Pair variants take two weights of one K, [E, K, Fa] and [E, K, Fb], as if concatenated along
// F (the experts' gate and up projections) without the copy the concatenation would make:
//
//   GroupedMatmulPairNN  x [N, K], wa, wb, row_expert -> y [N, Fa + Fb] = [x_n @ wa[e_n] | x_n @ wb[e_n]]
//   GroupedMatmulPairNT  g [N, Fa + Fb], wa, wb, row_expert -> y [N, K] = g_n[:Fa] wa[e_n]^T + g_n[Fa:] wb[e_n]^T
//   GroupedMatmulPairTN  x [N, K], g [N, Fa + Fb], row_expert, wa, wb -> ya [E, K, Fa], yb [E, K, Fb]
//
// Work is split into tasks for the kernel thread pool (common.h): row blocks for NN/NT, (weight,
// expert, output-column block) triples for TN, so no two tasks write the same element.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "common.h"

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

namespace {

bool IsType(const char *dtype, const char *want) { return std::strcmp(dtype, want) == 0; }

// Calls fn(first_row, end_row, expert) for each run of equal experts inside rows [begin, end), and
// skip(first_row, end_row) for each run of padding rows (expert id == num_experts). False for an
// id outside [0, num_experts].
template <typename Fn, typename Skip>
bool ForEachRun(const int32_t *row_expert, int64_t begin, int64_t end, int64_t num_experts, Fn fn, Skip skip) {
  int64_t start = begin;
  for (int64_t r = begin + 1; r <= end; ++r) {
    if (r == end || row_expert[r] != row_expert[start]) {
      int64_t e = row_expert[start];
      if (e < 0 || e > num_experts) return false;
      if (e == num_experts)
        skip(start, r);
      else
        fn(start, r, e);
      start = r;
    }
  }
  return true;
}

// One weight of a grouped product: [E, k, f] floats; `column` is where its f columns start in the
// concatenated [.., F total] operand (y for NN, the gradient for NT and TN).
struct Weight {
  const float *data;
  int64_t k, f, column;
};

// The weights of inputs [first, first + count) (all [E, K, F_i] with one E and K), laid side by side.
bool ReadWeights(int64_t **shapes, int *ndims, const char **dtypes, void **params, int first, int count,
                 std::vector<Weight> *weights, int64_t *num_experts, int64_t *total_f) {
  *total_f = 0;
  for (int i = first; i < first + count; ++i) {
    if (ndims[i] != 3 || !IsType(dtypes[i], "float32")) return false;
    if (i > first && (shapes[i][0] != shapes[first][0] || shapes[i][1] != shapes[first][1])) return false;
    weights->push_back({static_cast<const float *>(params[i]), shapes[i][1], shapes[i][2], *total_f});
    *total_f += shapes[i][2];
  }
  *num_experts = shapes[first][0];
  return true;
}

// NN: y [N, F] = [a @ w_0[e] | a @ w_1[e] | ...] (a [N, K]); NT: y [N, K] = sum_i a[:, cols_i] @ w_i[e]^T
// (a [N, F]). Rows in tasks of a few hundred (any expert runs inside a task are separate GEMMs; a
// row's result does not depend on the task it falls in).
//
// bf16 (`bf16`): `a` and `y` are bf16 containers (bf16.h) and the weights are read as bf16 values. Each
// task decodes its rows of `a` into fp32 scratch, always copies (and rounds) the expert's weights, and
// encodes its rows of `y` from fp32 scratch: no fp32 copy of a whole operand.
bool RowGrouped(const void *a_data, const std::vector<Weight> &weights, const int32_t *row_expert, void *y_data,
                int64_t rows, int64_t num_experts, int64_t total_f, bool transpose_w, bool bf16 = false) {
  const int64_t k = weights[0].k, a_cols = transpose_w ? total_f : k, y_cols = transpose_w ? k : total_f;
  const int64_t tasks = moetrain::TasksFor(rows, 128);
  const float *a = static_cast<const float *>(a_data);
  float *y = static_cast<float *>(y_data);
  const int64_t task_rows = tasks > 0 ? (rows + tasks - 1) / tasks + 1 : 0;
  moetrain::Scratch a_scratch, y_scratch;
  if (bf16) {
    a_scratch.Get(moetrain::Slots() * task_rows * a_cols);
    y_scratch.Get(moetrain::Slots() * task_rows * y_cols);
  }
  // NN reads w[e] row by row, f floats apart: where that stride is a multiple of 1 KB the rows
  // collide in the cache's sets and oneDNN's sgemm runs ~20 % slower (gate|up, f = 2F = 1024:
  // 93 vs 115 GFLOP/s a core), so the expert's matrix is first copied with rows 16 floats longer
  // (once per thread, weight and expert: consecutive tasks of one thread mostly share the expert).
  const int slots = moetrain::Slots();
  std::vector<int64_t> padded_ld(weights.size(), 0);
  int64_t padded_floats = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!transpose_w && weights[i].f % 256 == 0) padded_ld[i] = weights[i].f + 16;
    else if (bf16) padded_ld[i] = weights[i].f;   // bf16: always a (rounded) copy
    padded_floats += k * padded_ld[i];
  }
  std::vector<float> padded(slots * padded_floats);
  std::vector<int64_t> padded_expert(slots * weights.size(), -1);
  std::vector<char> ok(tasks, 1);
  moetrain::ParallelFor(tasks, [&](int64_t task, int slot) {
    const int64_t begin = rows * task / tasks, end = rows * (task + 1) / tasks;
    // Row r of the operands is at a_rows + (r - first) * a_cols (and y_rows likewise).
    const float *a_rows = a;
    float *y_rows = y;
    int64_t first = 0;
    if (bf16) {
      float *a_task = a_scratch.get() + slot * task_rows * a_cols;
      const uint16_t *a16 = static_cast<const uint16_t *>(a_data) + begin * a_cols;
      uint32_t *out = reinterpret_cast<uint32_t *>(a_task);
      for (int64_t i = 0; i < (end - begin) * a_cols; ++i) out[i] = uint32_t{a16[i]} << 16;
      a_rows = a_task;
      y_rows = y_scratch.get() + slot * task_rows * y_cols;
      first = begin;
    }
    ok[task] = ForEachRun(
        row_expert, begin, end, num_experts,
        [&](int64_t r0, int64_t r1, int64_t e) {
          float *copy = padded.data() + slot * padded_floats;
          for (size_t i = 0; i < weights.size(); ++i) {
            const Weight &w = weights[i];
            const float *we = w.data + e * w.k * w.f;
            int64_t ldw = w.f;
            if (padded_ld[i] && (bf16 || r1 - r0 >= 128)) {   // fewer rows: the copy costs about what it saves
              if (padded_expert[slot * weights.size() + i] != e) {
                if (bf16)
                  for (int64_t j = 0; j < k; ++j) moetrain::RoundRow(we + j * w.f, copy + j * padded_ld[i], w.f);
                else
                  for (int64_t j = 0; j < k; ++j) std::memcpy(copy + j * padded_ld[i], we + j * w.f, w.f * sizeof(float));
                padded_expert[slot * weights.size() + i] = e;
              }
              we = copy;
              ldw = padded_ld[i];
            }
            copy += k * padded_ld[i];
            if (transpose_w)
              dnnl_sgemm('N', 'T', r1 - r0, k, w.f, 1.0f, a_rows + (r0 - first) * a_cols + w.column, a_cols, we, ldw,
                         i == 0 ? 0.0f : 1.0f, y_rows + (r0 - first) * y_cols, y_cols);
            else
              dnnl_sgemm('N', 'N', r1 - r0, w.f, k, 1.0f, a_rows + (r0 - first) * a_cols, a_cols, we, ldw, 0.0f,
                         y_rows + (r0 - first) * y_cols + w.column, y_cols);
          }
        },
        [&](int64_t r0, int64_t r1) {
          std::memset(y_rows + (r0 - first) * y_cols, 0, (r1 - r0) * y_cols * sizeof(float));
        });
    if (bf16) {
      uint16_t *y16 = static_cast<uint16_t *>(y_data) + begin * y_cols;
      const uint32_t *in = reinterpret_cast<const uint32_t *>(y_rows);
      for (int64_t i = 0; i < (end - begin) * y_cols; ++i)
        y16[i] = static_cast<uint16_t>(moetrain::RoundBF16Bits(in[i]) >> 16);
    }
  });
  return std::all_of(ok.begin(), ok.end(), [](char v) { return v; });
}

// TN: y_i [E, K, F_i] = sum over the rows of expert e of x^T g[:, cols_i] (x [N, K], g [N, F]).
//
// bf16 (`bf16`): x and g are bf16 containers, decoded run by run into per-slot fp32 scratch, and each
// output block is rounded to bf16 values when its sum is complete.
bool ColumnGrouped(const void *x_data, const void *g_data, const int32_t *row_expert, const std::vector<Weight> &weights,
                   const std::vector<float *> &outputs, int64_t rows, int64_t num_experts, int64_t total_f,
                   bool bf16 = false) {
  const float *x = static_cast<const float *>(x_data), *g = static_cast<const float *>(g_data);
  const int64_t k = weights[0].k;
  // The runs of rows of each expert (an expert may own several when rows are not sorted).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs(num_experts);
  if (!ForEachRun(
          row_expert, 0, rows, num_experts, [&](int64_t r0, int64_t r1, int64_t e) { runs[e].push_back({r0, r1}); },
          [](int64_t, int64_t) {}))
    return false;
  // A task is one weight's expert and block of output columns (multiples of 16 floats, one AVX-512
  // register): y_i[e][:, c0:c1] = sum over the expert's runs, in row order.
  std::vector<int64_t> blocks(weights.size()), first_task(weights.size() + 1, 0);
  for (size_t i = 0; i < weights.size(); ++i) {
    blocks[i] = std::max<int64_t>(1, std::min<int64_t>(weights[i].f / 16, 2));
    first_task[i + 1] = first_task[i] + num_experts * blocks[i];
  }
  int64_t longest_run = 0, widest_block = 0;
  moetrain::Scratch x_scratch, g_scratch;
  if (bf16) {
    for (const auto &expert_runs : runs)
      for (const auto &run : expert_runs) longest_run = std::max(longest_run, run.second - run.first);
    for (size_t i = 0; i < weights.size(); ++i) widest_block = std::max(widest_block, weights[i].f - (weights[i].f / 16) * (blocks[i] - 1) / blocks[i] * 16);
    x_scratch.Get(moetrain::Slots() * longest_run * k);
    g_scratch.Get(moetrain::Slots() * longest_run * widest_block);
  }
  moetrain::ParallelFor(first_task.back(), [&](int64_t task, int slot) {
    const size_t i = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    const Weight &w = weights[i];
    const int64_t local = task - first_task[i], e = local / blocks[i], b = local % blocks[i];
    const int64_t c0 = (w.f / 16) * b / blocks[i] * 16;
    const int64_t c1 = b + 1 == blocks[i] ? w.f : (w.f / 16) * (b + 1) / blocks[i] * 16;
    float *ye = outputs[i] + e * k * w.f;
    for (int64_t j = 0; j < k; ++j) std::memset(ye + j * w.f + c0, 0, (c1 - c0) * sizeof(float));
    for (const auto &run : runs[e]) {
      const int64_t n = run.second - run.first;
      if (!bf16) {
        dnnl_sgemm('T', 'N', k, c1 - c0, n, 1.0f, x + run.first * k, k, g + run.first * total_f + w.column + c0,
                   total_f, 1.0f, ye + c0, w.f);
        continue;
      }
      float *xs = x_scratch.get() + slot * longest_run * k, *gs = g_scratch.get() + slot * longest_run * widest_block;
      moetrain::DecodeRow(static_cast<const uint16_t *>(x_data) + run.first * k, xs, n * k);
      const uint16_t *g16 = static_cast<const uint16_t *>(g_data);
      for (int64_t r = 0; r < n; ++r)
        moetrain::DecodeRow(g16 + (run.first + r) * total_f + w.column + c0, gs + r * (c1 - c0), c1 - c0);
      dnnl_sgemm('T', 'N', k, c1 - c0, n, 1.0f, xs, k, gs, c1 - c0, 1.0f, ye + c0, w.f);
    }
    if (bf16)
      for (int64_t j = 0; j < k; ++j) moetrain::RoundRow(ye + j * w.f + c0, ye + j * w.f + c0, c1 - c0);
  });
  return true;
}

// The checks and the call shared by the NN / NT kernels: inputs a, `count` weights, row_expert; one output.
int RowKernel(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int count,
              bool transpose_w, bool bf16 = false) {
  const char *activation = bf16 ? "float16" : "float32";
  if (nparam != count + 3 || ndims[0] != 2 || ndims[count + 1] != 1 || !IsType(dtypes[0], activation) ||
      !IsType(dtypes[count + 1], "int32") || !IsType(dtypes[count + 2], activation))
    return 1;
  std::vector<Weight> weights;
  int64_t num_experts, total_f;
  if (!ReadWeights(shapes, ndims, dtypes, params, 1, count, &weights, &num_experts, &total_f)) return 1;
  const int64_t rows = shapes[0][0];
  if (shapes[0][1] != (transpose_w ? total_f : weights[0].k) || shapes[count + 1][0] != rows) return 1;
  return RowGrouped(params[0], weights, static_cast<const int32_t *>(params[count + 1]), params[count + 2], rows,
                    num_experts, total_f, transpose_w, bf16)
             ? 0
             : 2;
}

// The TN kernels: inputs x, g, row_expert, then `count` weights (only their shapes are read); `count` outputs.
int ColumnKernel(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int count,
                 bool bf16 = false) {
  const char *activation = bf16 ? "float16" : "float32";
  if (nparam != 3 + 2 * count || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || !IsType(dtypes[0], activation) ||
      !IsType(dtypes[1], activation) || !IsType(dtypes[2], "int32"))
    return 1;
  std::vector<Weight> weights;
  int64_t num_experts, total_f;
  if (!ReadWeights(shapes, ndims, dtypes, params, 3, count, &weights, &num_experts, &total_f)) return 1;
  const int64_t rows = shapes[0][0];
  if (shapes[0][1] != weights[0].k || shapes[1][0] != rows || shapes[1][1] != total_f || shapes[2][0] != rows) return 1;
  std::vector<float *> outputs;
  for (int i = 0; i < count; ++i) outputs.push_back(static_cast<float *>(params[3 + count + i]));
  return ColumnGrouped(params[0], params[1], static_cast<const int32_t *>(params[2]), weights, outputs, rows,
                       num_experts, total_f, bf16)
             ? 0
             : 2;
}

}  // namespace

extern "C" std::vector<int64_t> GroupedMatmulNNInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[1][2]};
}
extern "C" std::vector<int64_t> GroupedMatmulNTInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[1][1]};
}
extern "C" std::vector<int64_t> GroupedMatmulTNInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[3][0], shapes[3][1], shapes[3][2]};
}
extern "C" std::vector<int64_t> GroupedMatmulPairNNInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[1][2] + shapes[2][2]};
}
extern "C" std::vector<int64_t> GroupedMatmulPairNTInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[1][1]};
}
extern "C" std::vector<std::vector<int64_t>> GroupedMatmulPairTNInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {{shapes[3][0], shapes[3][1], shapes[3][2]}, {shapes[4][0], shapes[4][1], shapes[4][2]}};
}
extern "C" int GroupedMatmulNNInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int GroupedMatmulNTInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int GroupedMatmulTNInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int GroupedMatmulPairNNInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int GroupedMatmulPairNTInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" std::vector<int> GroupedMatmulPairTNInferType(std::vector<int> type_ids, void *extra) {
  return {type_ids[0], type_ids[0]};
}

extern "C" int GroupedMatmulNN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  return RowKernel(nparam, params, ndims, shapes, dtypes, 1, false);
}
extern "C" int GroupedMatmulNT(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  return RowKernel(nparam, params, ndims, shapes, dtypes, 1, true);
}
extern "C" int GroupedMatmulTN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  return ColumnKernel(nparam, params, ndims, shapes, dtypes, 1);
}
extern "C" int GroupedMatmulPairNN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  return RowKernel(nparam, params, ndims, shapes, dtypes, 2, false);
}
extern "C" int GroupedMatmulPairNT(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  return RowKernel(nparam, params, ndims, shapes, dtypes, 2, true);
}
extern "C" int GroupedMatmulPairTN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  return ColumnKernel(nparam, params, ndims, shapes, dtypes, 2);
}

// bf16 storage (bf16.h): activations as bf16 containers converted block by block inside the tasks,
// the fp32 master weights read as bf16 values (rounded as each task copies its expert's matrix), the
// weight gradients rounded to bf16 values. The shapes are those of the fp32 kernels.
#define MOETRAIN_GROUPED_BF16(NAME, TYPE, BODY)                                                               \
  extern "C" decltype(NAME##InferShape(nullptr, nullptr, nullptr)) NAME##BF16InferShape(                      \
      int *ndims, int64_t **shapes, void *extra) {                                                            \
    return NAME##InferShape(ndims, shapes, extra);                                                            \
  }                                                                                                           \
  TYPE                                                                                                        \
  extern "C" int NAME##BF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,      \
                            void *stream, void *extra) {                                                      \
    return BODY;                                                                                              \
  }
MOETRAIN_GROUPED_BF16(GroupedMatmulNN, MOETRAIN_BF16_TYPE(GroupedMatmulNN, 0),
                      RowKernel(nparam, params, ndims, shapes, dtypes, 1, false, true))
MOETRAIN_GROUPED_BF16(GroupedMatmulNT, MOETRAIN_BF16_TYPE(GroupedMatmulNT, 0),
                      RowKernel(nparam, params, ndims, shapes, dtypes, 1, true, true))
MOETRAIN_GROUPED_BF16(GroupedMatmulTN, MOETRAIN_BF16_TYPE(GroupedMatmulTN, 3),
                      ColumnKernel(nparam, params, ndims, shapes, dtypes, 1, true))
MOETRAIN_GROUPED_BF16(GroupedMatmulPairNN, MOETRAIN_BF16_TYPE(GroupedMatmulPairNN, 0),
                      RowKernel(nparam, params, ndims, shapes, dtypes, 2, false, true))
MOETRAIN_GROUPED_BF16(GroupedMatmulPairNT, MOETRAIN_BF16_TYPE(GroupedMatmulPairNT, 0),
                      RowKernel(nparam, params, ndims, shapes, dtypes, 2, true, true))
MOETRAIN_GROUPED_BF16(GroupedMatmulPairTN, MOETRAIN_BF16_TYPES(GroupedMatmulPairTN, 3, 4),
                      ColumnKernel(nparam, params, ndims, shapes, dtypes, 2, true))
