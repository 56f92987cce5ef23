// Grouped matrix products for MoE experts on CPU: row n of the token matrix is multiplied by
// the weight matrix of expert row_expert[n]. Every maximal run of rows with the same expert is one
// dnnl_sgemm call (oneDNN ships with MindSpore), so sorted rows (the dropless dispatcher's layout)
// cost one GEMM per expert per thread: no padding rows and no per-block weight copies. A row whose
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
// Work is split into tasks for the kernel thread pool (common.h): row blocks for NN/NT, (expert,
// output-column block) pairs for TN, so no two tasks write the same element.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

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

// Shared by NN and NT: y[rows] = a[rows] @ op(w[e]), rows in tasks of a few hundred (any expert runs
// inside a task are separate GEMMs; a row's result does not depend on the task it falls in).
int RowGrouped(void **params, int64_t **shapes, bool transpose_w) {
  const float *a = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const int32_t *row_expert = static_cast<const int32_t *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], a_cols = shapes[0][1];
  const int64_t num_experts = shapes[1][0], k = shapes[1][1], f = shapes[1][2];
  const int64_t y_cols = transpose_w ? k : f;
  if (a_cols != (transpose_w ? f : k) || shapes[2][0] != rows) return 1;
  const int64_t tasks = moetrain::TasksFor(rows, 128);
  // NN reads w[e] row by row, f floats apart: where that stride is a multiple of 1 KB the rows
  // collide in the cache's sets and oneDNN's sgemm runs ~20 % slower (gate|up, f = 2F = 1024:
  // 93 vs 115 GFLOP/s a core), so the expert's matrix is first copied with rows 16 floats longer
  // (once per thread and expert: consecutive tasks of one thread mostly share the expert).
  const int64_t padded_ld = !transpose_w && f % 256 == 0 ? f + 16 : 0;
  const int slots = moetrain::Slots();
  std::vector<float> padded(padded_ld ? slots * k * padded_ld : 0);
  std::vector<int64_t> padded_expert(slots, -1);
  std::vector<char> ok(tasks, 1);
  moetrain::ParallelFor(tasks, [&](int64_t task, int slot) {
    const int64_t begin = rows * task / tasks, end = rows * (task + 1) / tasks;
    ok[task] = ForEachRun(
        row_expert, begin, end, num_experts,
        [&](int64_t r0, int64_t r1, int64_t e) {
          const float *we = w + e * k * f;
          int64_t ldw = f;
          if (padded_ld && r1 - r0 >= 128) {   // fewer rows: the copy costs about what it saves
            float *copy = padded.data() + slot * k * padded_ld;
            if (padded_expert[slot] != e) {
              for (int64_t i = 0; i < k; ++i) std::memcpy(copy + i * padded_ld, we + i * f, f * sizeof(float));
              padded_expert[slot] = e;
            }
            we = copy;
            ldw = padded_ld;
          }
          dnnl_sgemm('N', transpose_w ? 'T' : 'N', r1 - r0, y_cols, a_cols, 1.0f, a + r0 * a_cols, a_cols, we, ldw,
                     0.0f, y + r0 * y_cols, y_cols);
        },
        [&](int64_t r0, int64_t r1) { std::memset(y + r0 * y_cols, 0, (r1 - r0) * y_cols * sizeof(float)); });
  });
  return std::all_of(ok.begin(), ok.end(), [](char v) { return v; }) ? 0 : 2;
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
extern "C" int GroupedMatmulNNInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int GroupedMatmulNTInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }
extern "C" int GroupedMatmulTNInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int GroupedMatmulNN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 3 || ndims[2] != 1 || !IsType(dtypes[0], "float32") ||
      !IsType(dtypes[1], "float32") || !IsType(dtypes[2], "int32"))
    return 1;
  return RowGrouped(params, shapes, false);
}

extern "C" int GroupedMatmulNT(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 3 || ndims[2] != 1 || !IsType(dtypes[0], "float32") ||
      !IsType(dtypes[1], "float32") || !IsType(dtypes[2], "int32"))
    return 1;
  return RowGrouped(params, shapes, true);
}

extern "C" int GroupedMatmulTN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || ndims[4] != 3 ||
      !IsType(dtypes[0], "float32") || !IsType(dtypes[1], "float32") || !IsType(dtypes[2], "int32"))
    return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *g = static_cast<const float *>(params[1]);
  const int32_t *row_expert = static_cast<const int32_t *>(params[2]);
  float *y = static_cast<float *>(params[4]);
  const int64_t rows = shapes[0][0], k = shapes[0][1], f = shapes[1][1];
  const int64_t num_experts = shapes[4][0];
  if (shapes[1][0] != rows || shapes[2][0] != rows || shapes[4][1] != k || shapes[4][2] != f) return 1;
  // The runs of rows of each expert (an expert may own several when rows are not sorted).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs(num_experts);
  if (!ForEachRun(
          row_expert, 0, rows, num_experts, [&](int64_t r0, int64_t r1, int64_t e) { runs[e].push_back({r0, r1}); },
          [](int64_t, int64_t) {}))
    return 2;
  // A task is one expert's block of output columns (multiples of 16 floats, one AVX-512 register):
  // y[e][:, c0:c1] = sum over the expert's runs, in row order.
  const int64_t column_blocks = std::max<int64_t>(1, std::min<int64_t>(f / 16, 2));
  moetrain::ParallelFor(num_experts * column_blocks, [&](int64_t task, int) {
    const int64_t e = task / column_blocks, b = task % column_blocks;
    const int64_t c0 = (f / 16) * b / column_blocks * 16;
    const int64_t c1 = b + 1 == column_blocks ? f : (f / 16) * (b + 1) / column_blocks * 16;
    float *ye = y + e * k * f;
    for (int64_t i = 0; i < k; ++i) std::memset(ye + i * f + c0, 0, (c1 - c0) * sizeof(float));
    for (const auto &run : runs[e])
      dnnl_sgemm('T', 'N', k, c1 - c0, run.second - run.first, 1.0f, x + run.first * k, k, g + run.first * f + c0, f,
                 1.0f, ye + c0, f);
  });
  return 0;
}
