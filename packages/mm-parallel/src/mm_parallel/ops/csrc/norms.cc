// Row normalisations over the last dim, forward and backward, each one pass per row
// (MindSpore custom-operator "aot" entry points; float32 only, contiguous buffers; eps a (1,) tensor).
//
//   Standardize  n = (h - mean(h)) r,  r = 1 / sqrt(var(h) + eps)     (biased variance; layer norm's core)
//                dh = r (dn - mean(dn) - n mean(dn n))
//   RmsScale     n = h r,              r = 1 / sqrt(mean(h^2) + eps)   (rms norm's core)
//                dh = r (dn - n mean(dn n))
//
// Each takes (h, eps) -> (n, r) forward and (n, r, dn) -> dh backward; r is (rows, 1).
#include <cmath>

#include "common.h"

namespace {

using mm::Float32;
using mm::Parallel;
using mm::RowsOf;

// (n, r) of every row; centre: subtract the row mean (Standardize) or not (RmsScale).
int Forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool centre) {
  if (nparam != 4 || !Float32(nparam, dtypes)) return 1;
  const float *h = static_cast<const float *>(params[0]);
  const float eps = *static_cast<const float *>(params[1]);
  float *n = static_cast<float *>(params[2]);
  float *r = static_cast<float *>(params[3]);
  const mm::Rows s = RowsOf(ndims[0], shapes[0]);
  Parallel(s.rows, s.length, [=](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; row++) {
      const float *x = h + row * s.length;
      float *y = n + row * s.length;
      double mean = 0.0;
      if (centre) {
        for (int64_t j = 0; j < s.length; j++) mean += x[j];
        mean /= s.length;
      }
      const float m = static_cast<float>(mean);
      double squares = 0.0;
      for (int64_t j = 0; j < s.length; j++) squares += (x[j] - m) * (x[j] - m);
      const float scale = 1.0f / std::sqrt(static_cast<float>(squares / s.length) + eps);
      for (int64_t j = 0; j < s.length; j++) y[j] = (x[j] - m) * scale;
      r[row] = scale;
    }
  });
  return 0;
}

int Backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool centre) {
  if (nparam != 4 || !Float32(nparam, dtypes)) return 1;
  const float *n = static_cast<const float *>(params[0]);
  const float *r = static_cast<const float *>(params[1]);
  const float *dn = static_cast<const float *>(params[2]);
  float *dh = static_cast<float *>(params[3]);
  const mm::Rows s = RowsOf(ndims[0], shapes[0]);
  Parallel(s.rows, s.length, [=](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; row++) {
      const float *y = n + row * s.length, *g = dn + row * s.length;
      float *out = dh + row * s.length;
      double sum_g = 0.0, sum_gy = 0.0;
      for (int64_t j = 0; j < s.length; j++) {
        sum_g += g[j];
        sum_gy += g[j] * y[j];
      }
      const float mean_g = centre ? static_cast<float>(sum_g / s.length) : 0.0f;
      const float mean_gy = static_cast<float>(sum_gy / s.length);
      for (int64_t j = 0; j < s.length; j++) out[j] = r[row] * (g[j] - mean_g - y[j] * mean_gy);
    }
  });
  return 0;
}

}  // namespace

extern "C" int Standardize(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  return Forward(nparam, params, ndims, shapes, dtypes, true);
}

extern "C" int StandardizeBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  return Backward(nparam, params, ndims, shapes, dtypes, true);
}

extern "C" int RmsScale(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                        void *stream, void *extra) {
  return Forward(nparam, params, ndims, shapes, dtypes, false);
}

extern "C" int RmsScaleBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  return Backward(nparam, params, ndims, shapes, dtypes, false);
}
