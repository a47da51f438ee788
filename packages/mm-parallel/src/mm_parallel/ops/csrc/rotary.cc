// Rotary position embedding from given tables, forward and backward, one pass over x
// (MindSpore custom-operator "aot" entry points; float32 only, contiguous buffers).
//
// x (batch, seq, heads, dim); cos, sin (batch or 1, seq, 1, dim). Dims pair up as (a, b):
// interleaved (2i, 2i + 1), half-split (i, i + dim/2); rotate(x)_a = -x_b, rotate(x)_b = x_a.
//   out = x cos + rotate(x) sin:   out_a = x_a c_a - x_b s_a,     out_b = x_b c_b + x_a s_b
//   dx  = dy cos - rotate(dy sin): dx_a  = dy_a c_a + dy_b s_b,   dx_b  = dy_b c_b - dy_a s_a
#include "common.h"

namespace {

using mm::Elements;
using mm::Float32;
using mm::Parallel;

// One direction over every (batch, seq, head) row; backward selects the dx formula.
int Rotary(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool interleaved,
           bool backward) {
  if (nparam != 4 || !Float32(nparam, dtypes) || ndims[0] != 4 || ndims[1] != 4) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *cos = static_cast<const float *>(params[1]);
  const float *sin = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t seq = shapes[0][1], heads = shapes[0][2], dim = shapes[0][3];
  const bool table_per_batch = shapes[1][0] > 1;
  const int64_t half = dim / 2;
  Parallel(Elements(3, shapes[0]), dim, [=](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; row++) {
      const int64_t position = row / heads, batch = position / seq;
      const int64_t table = ((table_per_batch ? batch : 0) * seq + position % seq) * dim;
      const float *xr = x + row * dim, *c = cos + table, *s = sin + table;
      float *o = out + row * dim;
      for (int64_t i = 0; i < half; i++) {
        const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        if (backward) {
          o[a] = xr[a] * c[a] + xr[b] * s[b];
          o[b] = xr[b] * c[b] - xr[a] * s[a];
        } else {
          o[a] = xr[a] * c[a] - xr[b] * s[a];
          o[b] = xr[b] * c[b] + xr[a] * s[b];
        }
      }
    }
  });
  return 0;
}

}  // namespace

extern "C" int RotaryInterleaved(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  return Rotary(nparam, params, ndims, shapes, dtypes, true, false);
}

extern "C" int RotaryInterleavedBackward(int nparam, void **params, int *ndims, int64_t **shapes,
                                         const char **dtypes, void *stream, void *extra) {
  return Rotary(nparam, params, ndims, shapes, dtypes, true, true);
}

extern "C" int RotaryHalf(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  return Rotary(nparam, params, ndims, shapes, dtypes, false, false);
}

extern "C" int RotaryHalfBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  return Rotary(nparam, params, ndims, shapes, dtypes, false, true);
}
