// MoE top-k routing in one pass per token each way (MindSpore runs ~10 ops forward and ~20 backward for
// it), fp32:
//
//   RouterForward   logits [T, E], bias [E], config [k, 3]
//                   -> topk_idx [T, k] int32, topk_weight [T, k], probs [T, E], tokens_per_expert [E]
//   RouterBackward  logits [T, E], topk_idx [T, k], config [k, 3], d_topk_weight [T, k], d_probs [T, E]
//                   -> d_logits [T, E]
//
// config: k identical rows (k is read from the shape by the shape inference) of (score function: 0
// softmax, 1 sigmoid; norm_topk_prob: 0 or 1; route_scale). Scores s = softmax(logits) or
// sigmoid(logits); the k experts with the largest s + bias are chosen (best first, ties to the lower
// expert id, as ops.topk), the bias steering the choice only; topk_weight = s of the chosen experts,
// divided by their sum (+ 1e-20) with norm_topk_prob, times route_scale; probs = s for softmax and
// s / (sum s + 1e-20) for sigmoid (DeepSeek-V3's balance-loss probabilities); tokens_per_expert counts
// the assignments (no gradient). The backward recomputes s from the logits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "mindapi/base/type_id.h"   // MindSpore's dtype ids, for the shape/dtype inference

namespace {

constexpr float kTiny = 1e-20f;

struct Config {
  bool sigmoid, norm;
  float scale;
  int64_t top_k;
};

bool ReadConfig(int index, int *ndims, int64_t **shapes, const char **dtypes, void **params, int64_t experts,
                Config *c) {
  if (ndims[index] != 2 || shapes[index][1] != 3 || !moetrain::Float32(dtypes[index])) return false;
  const float *v = static_cast<const float *>(params[index]);
  *c = {v[0] != 0.0f, v[1] != 0.0f, v[2], shapes[index][0]};
  return c->top_k >= 1 && c->top_k <= experts;
}

// s [E] = softmax or sigmoid of the logits row.
inline void Scores(const float *logits, int64_t experts, bool sigmoid, float *s) {
  if (sigmoid) {
    for (int64_t e = 0; e < experts; ++e) s[e] = 1.0f / (1.0f + std::exp(std::min(-logits[e], 80.0f)));
    return;
  }
  float top = logits[0], sum = 0.0f;
  for (int64_t e = 1; e < experts; ++e) top = std::max(top, logits[e]);
  for (int64_t e = 0; e < experts; ++e) sum += s[e] = std::exp(logits[e] - top);
  for (int64_t e = 0; e < experts; ++e) s[e] /= sum;
}

// idx [k]: the k largest of choice [E], best first, ties to the lower id. A NaN never wins a comparison,
// so the ids stay valid (distinct, in range) whatever the input.
inline void TopK(const float *choice, int64_t experts, int64_t k, int32_t *idx, std::vector<char> &taken) {
  std::fill(taken.begin(), taken.end(), 0);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)
      if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
    taken[best] = 1;
    idx[j] = static_cast<int32_t>(best);
  }
}

int Parts(int64_t tokens) { return moetrain::PartsFor(tokens, 2048); }

}  // namespace

extern "C" std::vector<std::vector<int64_t>> RouterForwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  const int64_t tokens = shapes[0][0], experts = shapes[0][1], k = shapes[2][0];
  return {{tokens, k}, {tokens, k}, {tokens, experts}, {experts}};
}
extern "C" std::vector<int> RouterForwardInferType(std::vector<int> type_ids, void *extra) {
  return {mindspore::kNumberTypeInt32, type_ids[0], type_ids[0], type_ids[0]};
}
extern "C" std::vector<int64_t> RouterBackwardInferShape(int *ndims, int64_t **shapes, void *extra) {
  return {shapes[0][0], shapes[0][1]};
}
extern "C" int RouterBackwardInferType(std::vector<int> type_ids, void *extra) { return type_ids[0]; }

extern "C" int RouterForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 7 || ndims[0] != 2 || ndims[1] != 1 || !moetrain::Float32(dtypes[0]) ||
      !moetrain::Float32(dtypes[1]))
    return 1;
  const int64_t tokens = shapes[0][0], experts = shapes[0][1];
  Config c;
  if (shapes[1][0] != experts || !ReadConfig(2, ndims, shapes, dtypes, params, experts, &c)) return 1;
  const float *logits = static_cast<const float *>(params[0]), *bias = static_cast<const float *>(params[1]);
  int32_t *topk_idx = static_cast<int32_t *>(params[3]);
  float *topk_weight = static_cast<float *>(params[4]), *probs = static_cast<float *>(params[5]);
  float *tokens_per_expert = static_cast<float *>(params[6]);
  const int parts = Parts(tokens);
  std::vector<int64_t> counts(parts * experts, 0);
  moetrain::ParallelSplit(tokens, parts, [&](int part, int64_t begin, int64_t end) {
    std::vector<float> s(experts), choice(experts);
    std::vector<char> taken(experts);
    int64_t *count = counts.data() + part * experts;
    for (int64_t t = begin; t < end; ++t) {
      Scores(logits + t * experts, experts, c.sigmoid, s.data());
      for (int64_t e = 0; e < experts; ++e) choice[e] = s[e] + bias[e];
      int32_t *idx = topk_idx + t * c.top_k;
      TopK(choice.data(), experts, c.top_k, idx, taken);
      float *w = topk_weight + t * c.top_k, picked = 0.0f;
      for (int64_t j = 0; j < c.top_k; ++j) {
        picked += w[j] = s[idx[j]];
        ++count[idx[j]];
      }
      const float factor = c.norm ? c.scale / (picked + kTiny) : c.scale;
      for (int64_t j = 0; j < c.top_k; ++j) w[j] *= factor;
      float *p = probs + t * experts;
      if (c.sigmoid) {
        float total = 0.0f;
        for (int64_t e = 0; e < experts; ++e) total += s[e];
        for (int64_t e = 0; e < experts; ++e) p[e] = s[e] / (total + kTiny);
      } else {
        std::memcpy(p, s.data(), experts * sizeof(float));
      }
    }
  });
  for (int64_t e = 0; e < experts; ++e) {
    int64_t total = 0;
    for (int part = 0; part < parts; ++part) total += counts[part * experts + e];
    tokens_per_expert[e] = static_cast<float>(total);
  }
  return 0;
}

extern "C" int RouterBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 6 || ndims[0] != 2 || ndims[1] != 2 || ndims[3] != 2 || ndims[4] != 2 ||
      !moetrain::Float32(dtypes[0]) || std::strcmp(dtypes[1], "int32") != 0 || !moetrain::Float32(dtypes[3]) ||
      !moetrain::Float32(dtypes[4]))
    return 1;
  const int64_t tokens = shapes[0][0], experts = shapes[0][1];
  Config c;
  if (!ReadConfig(2, ndims, shapes, dtypes, params, experts, &c) || shapes[1][0] != tokens ||
      shapes[1][1] != c.top_k || shapes[3][0] != tokens || shapes[3][1] != c.top_k || shapes[4][0] != tokens ||
      shapes[4][1] != experts)
    return 1;
  const float *logits = static_cast<const float *>(params[0]);
  const int32_t *topk_idx = static_cast<const int32_t *>(params[1]);
  const float *d_weight = static_cast<const float *>(params[3]), *d_probs = static_cast<const float *>(params[4]);
  float *d_logits = static_cast<float *>(params[5]);
  std::vector<char> ok(Parts(tokens), 1);
  moetrain::ParallelSplit(tokens, Parts(tokens), [&](int part, int64_t begin, int64_t end) {
    std::vector<float> s(experts), ds(experts);
    for (int64_t t = begin; t < end; ++t) {
      Scores(logits + t * experts, experts, c.sigmoid, s.data());
      const float *dp = d_probs + t * experts, *dw = d_weight + t * c.top_k;
      const int32_t *idx = topk_idx + t * c.top_k;
      // through probs
      if (c.sigmoid) {
        float total = kTiny, dot = 0.0f;
        for (int64_t e = 0; e < experts; ++e) total += s[e];
        for (int64_t e = 0; e < experts; ++e) dot += dp[e] * s[e];
        for (int64_t e = 0; e < experts; ++e) ds[e] = dp[e] / total - dot / (total * total);
      } else {
        std::memcpy(ds.data(), dp, experts * sizeof(float));
      }
      // through topk_weight = scale * g / (sum g + tiny) (or scale * g), g = s[idx]
      float picked = kTiny, dot = 0.0f;
      for (int64_t j = 0; j < c.top_k; ++j) {
        if (idx[j] < 0 || idx[j] >= experts) ok[part] = 0;
      }
      if (!ok[part]) continue;
      for (int64_t j = 0; j < c.top_k; ++j) {
        picked += s[idx[j]];
        dot += dw[j] * s[idx[j]];
      }
      for (int64_t j = 0; j < c.top_k; ++j)
        ds[idx[j]] += c.norm ? c.scale * (dw[j] / picked - dot / (picked * picked)) : c.scale * dw[j];
      // through the score function
      float *dl = d_logits + t * experts;
      if (c.sigmoid) {
        for (int64_t e = 0; e < experts; ++e) dl[e] = ds[e] * s[e] * (1.0f - s[e]);
      } else {
        float inner = 0.0f;
        for (int64_t e = 0; e < experts; ++e) inner += s[e] * ds[e];
        for (int64_t e = 0; e < experts; ++e) dl[e] = s[e] * (ds[e] - inner);
      }
    }
  });
  return std::all_of(ok.begin(), ok.end(), [](char v) { return v; }) ? 0 : 2;
}
