// swiglu(gate, up) = silu(gate) up, forward and backward, each one pass over the tensors
// (MindSpore custom-operator "aot" entry points; float32 only, contiguous buffers of one shape).
//
//   y = g s u,  s = sigmoid(g)
//   dup = dy g s,   dgate = dy u s (1 + g (1 - s))
#include <algorithm>
#include <cmath>

#include "common.h"

namespace {

using mm::Elements;
using mm::Float32;
using mm::Parallel;

constexpr float kLimit = 80.0f;  // |g| clamped inside exp only: exp stays finite under -ffast-math

inline float Sigmoid(float g) { return 1.0f / (1.0f + std::exp(std::min(std::max(-g, -kLimit), kLimit))); }

}  // namespace

extern "C" int Swiglu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  if (nparam != 3 || !Float32(nparam, dtypes)) return 1;
  const float *gate = static_cast<const float *>(params[0]);
  const float *up = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  Parallel(Elements(ndims[0], shapes[0]), 1, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) y[i] = gate[i] * Sigmoid(gate[i]) * up[i];
  });
  return 0;
}

extern "C" int SwigluBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 5 || !Float32(nparam, dtypes)) return 1;
  const float *gate = static_cast<const float *>(params[0]);
  const float *up = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  float *dgate = static_cast<float *>(params[3]);
  float *dup = static_cast<float *>(params[4]);
  Parallel(Elements(ndims[0], shapes[0]), 1, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
      float g = gate[i], s = Sigmoid(g);
      dup[i] = dy[i] * g * s;
      dgate[i] = dy[i] * up[i] * s * (1.0f + g * (1.0f - s));
    }
  });
  return 0;
}
