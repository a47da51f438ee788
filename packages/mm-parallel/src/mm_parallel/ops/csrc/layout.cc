// Layout changes MindSpore's CPU path copies slowly (its ContiguousCpuKernel: ~4.6 ms, one thread, for the
// 1M floats of a (1, 2048, 4, 128) query), as multi-threaded copies of contiguous runs
// (MindSpore custom-operator "aot" entry points; float32 only).
//
//   SwapAxes12  (a, b, c, d) -> (a, c, b, d)     attention's (batch, seq, heads, dim) <-> (batch, heads, seq, dim);
//                                               its own inverse, so also its backward
#include "common.h"

namespace {

using mm::Float32;
using mm::Parallel;

}  // namespace

extern "C" int SwapAxes12(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  if (nparam != 2 || !Float32(nparam, dtypes) || ndims[0] != 4) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[1]);
  const int64_t outer = shapes[0][0], rows = shapes[0][1], columns = shapes[0][2], run = shapes[0][3];
  // one item per (outer, column): the rows of that column, each a run of `run` floats
  Parallel(outer * columns, rows * run, [=](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; item++) {
      const int64_t a = item / columns, c = item % columns;
      const float *from = x + (a * rows * columns + c) * run;
      float *to = out + (a * columns + c) * rows * run;
      for (int64_t b = 0; b < rows; b++) std::memcpy(to + b * run, from + b * columns * run, run * sizeof(float));
    }
  });
  return 0;
}
