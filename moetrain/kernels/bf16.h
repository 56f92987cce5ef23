// bfloat16 storage for the fp32 kernels (docs/precision.md, "bfloat16 on the CPU").
//
// MindSpore 2.10's CPU backend has no bf16 Reshape, Transpose, StridedSlice, Gather or AddN, so a bf16
// activation travels between the kernels as a 2-byte tensor of dtype float16 that holds bf16 bits (a
// "bf16 container"; no fp16 arithmetic ever runs on it: its producers and consumers are these kernels
// and MindSpore's data-movement ops). `RunBF16` gives an fp32 kernel a bf16 sibling: each input or
// output is converted around the fp32 body as its spec says, so every product still runs on oneDNN's
// fp32 GEMM on bf16 values (exact products, fp32 accumulation) and every stored value is a bf16 value.
//
// Spec: one letter per input, '|', one letter per output.
//   a  activation: a float16 input is a bf16 container, decoded to fp32; a float32 one is rounded to
//      bf16 values on read. A float16 output is written as a container; a float32 one is rounded.
//   w  fp32 tensor whose bf16 values the product uses (a master weight) / an fp32 output rounded to bf16
//      values (a weight gradient, as the rounding cast's backward rounds it).
//   -  passed through (ids, tables, statistics, the loss).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common.h"

namespace moetrain {

// Branch-free (a select), so that the conversion loops vectorise.
inline uint32_t RoundBF16Bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (u | 0x00400000u) & 0xffff0000u;   // a NaN stays a (quiet) NaN
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

template <typename Fn>
void ParallelElements(int64_t n, Fn fn) {
  ParallelSplit(n, PartsFor(n, int64_t{1} << 15), [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

inline void DecodeBF16(const uint16_t *x, float *y, int64_t n) {
  uint32_t *out = reinterpret_cast<uint32_t *>(y);
  ParallelElements(n, [&](int64_t i) { out[i] = uint32_t{x[i]} << 16; });
}

inline void EncodeBF16(const float *x, uint16_t *y, int64_t n) {
  const uint32_t *in = reinterpret_cast<const uint32_t *>(x);
  ParallelElements(n, [&](int64_t i) { y[i] = static_cast<uint16_t>(RoundBF16Bits(in[i]) >> 16); });
}

inline void RoundToBF16(const float *x, float *y, int64_t n) {
  const uint32_t *in = reinterpret_cast<const uint32_t *>(x);
  uint32_t *out = reinterpret_cast<uint32_t *>(y);
  ParallelElements(n, [&](int64_t i) { out[i] = RoundBF16Bits(in[i]); });
}

// Serial helpers for the kernels' own tasks: n floats rounded to bf16 values; n bf16 bits decoded; n
// floats encoded as bf16 bits.
inline void RoundRow(const float *x, float *y, int64_t n) {
  const uint32_t *in = reinterpret_cast<const uint32_t *>(x);
  uint32_t *out = reinterpret_cast<uint32_t *>(y);
  for (int64_t i = 0; i < n; ++i) out[i] = RoundBF16Bits(in[i]);
}
inline void DecodeRow(const uint16_t *x, float *y, int64_t n) {
  uint32_t *out = reinterpret_cast<uint32_t *>(y);
  for (int64_t i = 0; i < n; ++i) out[i] = uint32_t{x[i]} << 16;
}
inline void EncodeRow(const float *x, uint16_t *y, int64_t n) {
  const uint32_t *in = reinterpret_cast<const uint32_t *>(x);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<uint16_t>(RoundBF16Bits(in[i]) >> 16);
}

inline bool Float16(const char *dtype) { return std::strcmp(dtype, "float16") == 0; }

// fp32 scratch for the conversions, kept for reuse: a fresh allocation of a few MB per call is fresh
// pages, whose faults and zeroing cost about what the conversion does. A buffer is lent to one call at
// a time (MindSpore may run two kernels at once); the pool only grows, to what the calls at the same
// time needed.
class ScratchPool {
 public:
  static ScratchPool &Instance() {
    static ScratchPool *pool = new ScratchPool();   // never deleted: used until the process ends
    return *pool;
  }
  std::unique_ptr<float[]> Take(int64_t n, int64_t *capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    int best = -1;
    for (int i = 0; i < static_cast<int>(free_.size()); ++i)
      if (free_[i].first >= n && (best < 0 || free_[i].first < free_[best].first)) best = i;
    if (best < 0) {   // none large enough: replace the largest free one (its memory goes back), or add one
      for (int i = 0; i < static_cast<int>(free_.size()); ++i)
        if (best < 0 || free_[i].first > free_[best].first) best = i;
      if (best >= 0) free_.erase(free_.begin() + best);
      *capacity = std::max<int64_t>(n, 1);
      return std::unique_ptr<float[]>(new float[*capacity]);
    }
    std::unique_ptr<float[]> buffer = std::move(free_[best].second);
    *capacity = free_[best].first;
    free_.erase(free_.begin() + best);
    return buffer;
  }
  void Give(std::unique_ptr<float[]> buffer, int64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.emplace_back(capacity, std::move(buffer));
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<int64_t, std::unique_ptr<float[]>>> free_;
};

// A buffer of at least n floats from the pool, given back when this goes out of scope.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch &) = delete;
  Scratch &operator=(const Scratch &) = delete;
  ~Scratch() {
    if (buffer_) ScratchPool::Instance().Give(std::move(buffer_), capacity_);
  }
  float *Get(int64_t n) {
    buffer_ = ScratchPool::Instance().Take(n, &capacity_);
    return buffer_.get();
  }
  explicit operator bool() const { return static_cast<bool>(buffer_); }
  float *get() const { return buffer_.get(); }

 private:
  std::unique_ptr<float[]> buffer_;
  int64_t capacity_ = 0;
};

using KernelFn = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);

// Runs the fp32 kernel `body` with its inputs and outputs converted as `spec` says (see above).
inline int RunBF16(KernelFn body, const char *spec, int nparam, void **params, int *ndims, int64_t **shapes,
                   const char **dtypes, void *stream, void *extra) {
  const char *bar = std::strchr(spec, '|');
  if (bar == nullptr || static_cast<int>(std::strlen(spec)) - 1 != nparam) return 1;
  const int inputs = static_cast<int>(bar - spec);
  std::vector<void *> p(params, params + nparam);
  std::vector<const char *> d(dtypes, dtypes + nparam);
  std::vector<Scratch> scratch(nparam);
  for (int i = 0; i < nparam; ++i) {
    const char kind = spec[i < inputs ? i : i + 1];
    if (kind == '-') continue;
    const bool half = Float16(dtypes[i]);
    if (!half && !Float32(dtypes[i])) return 1;
    if (kind == 'w' && half) return 1;
    const int64_t n = Size(ndims[i], shapes[i]);
    d[i] = "float32";
    if (i < inputs) {   // inputs: an fp32 copy holding bf16 values
      scratch[i].Get(n);
      if (half) DecodeBF16(static_cast<const uint16_t *>(params[i]), scratch[i].get(), n);
      else RoundToBF16(static_cast<const float *>(params[i]), scratch[i].get(), n);
      p[i] = scratch[i].get();
    } else if (half) {   // a container output: the body writes fp32 scratch, encoded below
      p[i] = scratch[i].Get(n);
    }
  }
  const int status = body(nparam, p.data(), ndims, shapes, d.data(), stream, extra);
  if (status != 0) return status;
  for (int i = inputs; i < nparam; ++i) {
    if (spec[i + 1] == '-') continue;
    const int64_t n = Size(ndims[i], shapes[i]);
    if (scratch[i]) EncodeBF16(scratch[i].get(), static_cast<uint16_t *>(params[i]), n);
    else RoundToBF16(static_cast<const float *>(params[i]), static_cast<float *>(params[i]), n);
  }
  return 0;
}

}  // namespace moetrain

// NAME##BF16: the kernel NAME on bf16 storage (spec above), with NAME's shape inference. Its output
// dtypes are given separately (MOETRAIN_BF16_TYPE / MOETRAIN_BF16_TYPES): the dtype of input i each.
#define MOETRAIN_BF16_KERNEL(NAME, SPEC)                                                                        \
  extern "C" int NAME##BF16(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,      \
                            void *stream, void *extra) {                                                      \
    return moetrain::RunBF16(NAME, SPEC, nparam, params, ndims, shapes, dtypes, stream, extra);              \
  }                                                                                                           \
  extern "C" decltype(NAME##InferShape(nullptr, nullptr, nullptr)) NAME##BF16InferShape(                     \
      int *ndims, int64_t **shapes, void *extra) {                                                            \
    return NAME##InferShape(ndims, shapes, extra);                                                            \
  }
#define MOETRAIN_BF16_TYPE(NAME, I) \
  extern "C" int NAME##BF16InferType(std::vector<int> type_ids, void *extra) { return type_ids[I]; }
#define MOETRAIN_BF16_TYPES(NAME, I, J)                                                    \
  extern "C" std::vector<int> NAME##BF16InferType(std::vector<int> type_ids, void *extra) { \
    return {type_ids[I], type_ids[J]};                                                     \
  }
