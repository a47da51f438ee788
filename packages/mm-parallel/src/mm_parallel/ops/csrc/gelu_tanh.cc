// gelu with the tanh approximation, forward and backward, each one pass over the tensor
// (MindSpore custom-operator "aot" entry points; float32 only, contiguous buffers).
//
//   y  = x s,   s = sigmoid(2 c (x + a x^3)) = 0.5 (1 + tanh(c (x + a x^3))),  c = sqrt(2/pi), a = 0.044715
//   dx = dy (s + x s (1 - s) 2 c (1 + 3 a x^2))
//
// Compiled with -O3 -ffast-math (object only: the shared library is linked without it, so loading
// it leaves the process's floating-point mode alone); expf then vectorises through glibc's libmvec.
#include <algorithm>
#include <cmath>

#include "common.h"

namespace {

using mm::Elements;
using mm::Float32;
using mm::Parallel;

constexpr float kTwoC = 1.5957691216057308f;  // 2 sqrt(2/pi)
constexpr float kA = 0.044715f;
// |exponent| kept below 80: exp stays finite (-ffast-math assumes no inf; s is then 1.8e-35 or 1 - 1.8e-35,
// which float32 rounds as the unclamped value rounds)
constexpr float kLimit = 80.0f;

// sigmoid(2 c (x + a x^3))
inline float Gate(float x, float square) {
  float exponent = std::min(std::max(-kTwoC * (x + kA * square * x), -kLimit), kLimit);
  return 1.0f / (1.0f + std::exp(exponent));
}

}  // namespace

extern "C" int GeluTanh(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                        void *stream, void *extra) {
  if (nparam != 2 || !Float32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  Parallel(Elements(ndims[0], shapes[0]), 1, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
      float v = x[i];
      y[i] = v * Gate(v, v * v);
    }
  });
  return 0;
}

extern "C" int GeluTanhBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  if (nparam != 3 || !Float32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *dy = static_cast<const float *>(params[1]);
  float *dx = static_cast<float *>(params[2]);
  Parallel(Elements(ndims[0], shapes[0]), 1, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
      float v = x[i], square = v * v;
      float s = Gate(v, square);
      dx[i] = dy[i] * (s + v * (s - s * s) * kTwoC * (1.0f + 3.0f * kA * square));
    }
  });
  return 0;
}
