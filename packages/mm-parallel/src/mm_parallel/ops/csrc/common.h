// Shared helpers of the native CPU kernels (MindSpore custom-operator "aot" entry points).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace mm {

// Below this many elements per thread, starting a thread costs more than it saves.
constexpr int64_t kPerThread = 1 << 16;

inline int64_t Elements(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

// A tensor as rows of its last dim.
struct Rows {
  int64_t rows, length;
};

inline Rows RowsOf(int ndim, const int64_t *shape) {
  const int64_t length = shape[ndim - 1];
  return {length ? Elements(ndim, shape) / length : 0, length};
}

inline bool Float32(int nparam, const char **dtypes) {
  for (int i = 0; i < nparam; i++)
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  return true;
}

// work(lo, hi) over the items [0, n), each item `cost` elements, on up to hardware_concurrency
// threads (at most 8), each with at least kPerThread elements.
template <typename Work>
void Parallel(int64_t n, int64_t cost, Work work) {
  int64_t threads = std::min<int64_t>(
      {n * cost / kPerThread, static_cast<int64_t>(std::thread::hardware_concurrency()), int64_t{8}, n});
  if (threads <= 1) {
    work(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  int64_t step = (n + threads - 1) / threads;
  for (int64_t t = 1; t < threads; t++) pool.emplace_back(work, t * step, std::min(n, (t + 1) * step));
  work(int64_t{0}, std::min(n, step));
  for (auto &thread : pool) thread.join();
}

}  // namespace mm
