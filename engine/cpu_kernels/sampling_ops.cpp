// The sampler's one full-vocabulary pass on the CPU (engine/sampler.py): softmax numerators
// in place and their sums per chunk of the vocabulary, which is all the chunked inverse CDF
// (`inverse_cdf`) needs — no division by the row's total (the draw scales its uniform by the
// total instead), no second pass for the chunk sums.
//
// Contract and reference: `exp_chunk_totals_` in engine/cpu_kernels/__init__.py and its
// plain-torch fallback in engine/sampler.py. Each row is one task; its sums run in a fixed
// order (16 lanes, then a fixed tree), so results do not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

namespace {

using pdserve_vec::exp_sub_sum;
using pdserve_vec::row_max;

// x [rows, vocab] float32 with unit last stride: x = exp(x - rowmax) in place; returns the
// sums of each `chunk` consecutive columns, [rows, ceil(vocab / chunk)] (the last chunk may be
// shorter). A row of -inf only becomes NaN, as torch's softmax makes it.
at::Tensor exp_chunk_totals_(at::Tensor& x, int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x: float32 [rows, vocab] with unit last stride");
  TORCH_CHECK(chunk > 0, "chunk must be positive");
  const int64_t rows = x.size(0), vocab = x.size(1), chunks = (vocab + chunk - 1) / chunk;
  at::Tensor totals = at::empty({rows, chunks}, x.options());
  float* data = x.data_ptr<float>();
  float* out = totals.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * stride;
      const float m = row_max(row, vocab);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t start = c * chunk;
        out[r * chunks + c] = exp_sub_sum<true>(row + start, std::min(chunk, vocab - start), m);
      }
    }
  });
  return totals;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) { m.def("exp_chunk_totals_(Tensor(a!) x, int chunk) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("exp_chunk_totals_", &exp_chunk_totals_); }
