// The attention core's row-wise steps around its matmuls, each one pass per row
// (MindSpore custom-operator "aot" entry points; float32 only, contiguous buffers).
//
//   Softmax         p_ij = exp(s_ij - max_j s_ij) / sum_j exp(s_ij - max_j s_ij)    over the last dim
//   ScoresGradient  ds_ij = p_ij (dp_ij - D_i)        D: one value per row, (..., rows, 1)
//
// (FlashAttention's backward: dp = do v^T, D_i = do_i . out_i; ds then gives dq = ds k, dk = ds^T q.)
#include <algorithm>
#include <cmath>

#include "common.h"

namespace {

using mm::Float32;
using mm::Parallel;

// Below -80 (exp ~ 1.8e-35 next to the row's largest term, 1) a probability is 0 exactly: exp stays clear of
// underflow under -ffast-math, and a masked key (score -1e30) gets no probability and no gradient at all.
constexpr float kLimit = 80.0f;

}  // namespace

extern "C" int Softmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  if (nparam != 2 || !Float32(nparam, dtypes)) return 1;
  const float *scores = static_cast<const float *>(params[0]);
  float *probs = static_cast<float *>(params[1]);
  const auto [rows, keys] = mm::RowsOf(ndims[0], shapes[0]);
  Parallel(rows, keys, [=](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; row++) {
      const float *s = scores + row * keys;
      float *p = probs + row * keys;
      float top = s[0];
      for (int64_t j = 1; j < keys; j++) top = std::max(top, s[j]);
      float total = 0.0f;
      for (int64_t j = 0; j < keys; j++) {
        const float shifted = s[j] - top;
        p[j] = shifted < -kLimit ? 0.0f : std::exp(std::max(shifted, -kLimit));
        total += p[j];
      }
      const float inverse = 1.0f / total;
      for (int64_t j = 0; j < keys; j++) p[j] *= inverse;
    }
  });
  return 0;
}

extern "C" int ScoresGradient(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 4 || !Float32(nparam, dtypes)) return 1;
  const float *probs = static_cast<const float *>(params[0]);
  const float *dprobs = static_cast<const float *>(params[1]);
  const float *row_dot = static_cast<const float *>(params[2]);
  float *dscores = static_cast<float *>(params[3]);
  const auto [rows, keys] = mm::RowsOf(ndims[0], shapes[0]);
  Parallel(rows, keys, [=](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; row++) {
      const float *p = probs + row * keys, *dp = dprobs + row * keys;
      float *ds = dscores + row * keys;
      const float d = row_dot[row];
      for (int64_t j = 0; j < keys; j++) ds[j] = p[j] * (dp[j] - d);
    }
  });
  return 0;
}
