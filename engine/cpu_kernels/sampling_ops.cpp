// The sampler's full-vocabulary pass on the CPU (engine/sampler.py).
//
// `exp_chunk_totals_`: softmax numerators in place and their sums per chunk of the
// vocabulary, which is all the chunked inverse CDF (`inverse_cdf`) needs — no division by
// the row's total (the draw scales its uniform by the total instead), no second pass for the
// chunk sums.
// `draw_rows`: the same sums without writing the numerators, then the inverse CDF's draw
// itself, recomputing the numerators of the one chunk the draw lands in: the row is read
// twice (max, sums) and never written.
//
// Contract and reference: `exp_chunk_totals_` / `draw_rows` in engine/cpu_kernels/__init__.py
// and `draw` (softmax + `inverse_cdf`, its plain-torch fallback) in engine/sampler.py. Each row is one task; its
// sums run in a fixed order (16 lanes, then a fixed tree), so results do not depend on the
// thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// Running sums of `values` as torch's CPU cumsum of float32 forms them (a double accumulator,
// each prefix rounded to float), so the draw lands where `inverse_cdf` would.
void cumulative(const float* values, int64_t n, float* out) {
  double running = 0.0;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(running += values[i]);
}

// The first index whose running sum exceeds `target` (searchsorted, right=True), at most the
// last index whose value is positive (0 when none is): the draw never lands on a zero.
int64_t first_above(const float* values, const float* sums, int64_t n, float target) {
  const int64_t above = std::upper_bound(sums, sums + n, target) - sums;
  int64_t last_positive = 0;
  for (int64_t i = n - 1; i > 0; --i)
    if (values[i] > 0) { last_positive = i; break; }
  return std::min(above, last_positive);
}

// x [rows, vocab] float32 (unit last stride; read only), uniforms [rows] float32 in [0, 1):
// per row the token `inverse_cdf` draws from `exp_chunk_totals_`'s numerators and chunk sums
// of x: int64 [rows].
at::Tensor draw_rows(const at::Tensor& x, const at::Tensor& uniforms, int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x: float32 [rows, vocab] with unit last stride");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous() && uniforms.numel() == x.size(0),
              "uniforms: float32 [rows], contiguous");
  TORCH_CHECK(chunk > 0, "chunk must be positive");
  const int64_t rows = x.size(0), vocab = x.size(1), chunks = (vocab + chunk - 1) / chunk;
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> totals(chunks), cdf(chunks), values(chunk), inside(chunk);
    for (int64_t r = begin; r < end; ++r) {
      float* row = const_cast<float*>(data + r * stride);  // read only: kStore is false
      const float m = row_max(row, vocab);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t start = c * chunk;
        totals[c] = exp_sub_sum<true, false>(row + start, std::min(chunk, vocab - start), m);
      }
      cumulative(totals.data(), chunks, cdf.data());
      const float target = u[r] * cdf[chunks - 1];
      const int64_t c = first_above(totals.data(), cdf.data(), chunks, target);
      const float before = c > 0 ? cdf[c - 1] : 0.f;
      // The chunk's numerators as the pass above summed them (same start, same lanes), zero
      // past the vocabulary.
      const int64_t start = c * chunk, len = std::min(chunk, vocab - start);
      std::memcpy(values.data(), row + start, len * sizeof(float));
      exp_sub_sum<true, true>(values.data(), len, m);
      std::fill(values.begin() + len, values.end(), 0.f);
      cumulative(values.data(), chunk, inside.data());
      out[r] = start + first_above(values.data(), inside.data(), chunk, target - before);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("exp_chunk_totals_(Tensor(a!) x, int chunk) -> Tensor");
  m.def("draw_rows(Tensor x, Tensor uniforms, int chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("exp_chunk_totals_", &exp_chunk_totals_);
  m.impl("draw_rows", &draw_rows);
}
