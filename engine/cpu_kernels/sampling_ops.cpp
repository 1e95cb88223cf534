// The sampler's full-vocabulary passes on the CPU (engine/sampling/sampler.py).
//
// `sample_rows`: one token per row of logits, float32 or the LM head's bfloat16 (widened as
// read, so the engine never makes an fp32 copy of them): a row of temperature 0 takes its
// argmax, any other draws by inverse CDF from softmax(x / temperature) — the chunk sums of the
// numerators exp(x / t - max) (none written: no division by the row's total either, the draw
// scales its uniform by the total instead), then the one chunk the draw lands in, its
// numerators recomputed. A drawn row is read twice (max, sums) and never written.
// `argmax_rows`: the argmax rows alone. `first_uniforms`: the rows' uniforms from their seeds.
// `exp_chunk_totals_`: the numerators in place and their chunk sums — the tests' view of
// what the draw sums.
//
// Contract and reference: engine/cpu_kernels/__init__.py, and `argmax_rows` / `draw` (softmax +
// `inverse_cdf`, their plain-torch fallbacks) in engine/sampling/sampler.py. Each row is one task; its
// sums run in a fixed order (16 lanes, then a fixed tree), so results do not depend on the
// thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "vec16.h"

namespace {

using namespace pdserve_vec;

// A row's value as the draw sees it: widened to fp32, divided by the temperature when kScaled
// (IEEE division: what the sampler's in-place `div_` of fp32 logits computes).
template <bool kScaled, typename T>
inline float scaled(T x, float t) {
  const float v = static_cast<float>(x);
  if constexpr (kScaled) return v / t;
  return v;
}

// Sum of exp(x[i] / t - m) for i < n (written to out[i] when out is not null): 16 lanes with
// `fast_exp16` where PDSERVE_VEC16 (no result here is held to bit equality with torch, and
// the exps are most of the pass), summed in a fixed order. Each exp depends on its own element
// only, so a later pass over a part of the row recomputes exactly the values this one summed.
template <bool kScaled, typename T>
float exp_sum(const T* x, int64_t n, float m, float t, float* out) {
  int64_t i = 0;
  float total = 0.f;
#ifdef PDSERVE_VEC16
  vec16 acc = zero16();
  const vec16 mv = set16(m), tv = set16(t);
  for (; i + 16 <= n; i += 16) {
    vec16 v = load16(x + i);
    if constexpr (kScaled) v = div16(v, tv);
    const vec16 e = fast_exp16(sub16(v, mv));
    if (out != nullptr) store16(out + i, e);
    acc = add16(acc, e);
  }
  total = sum16(acc);
#endif
  for (; i < n; ++i) {
    const float e = std::exp(scaled<kScaled>(x[i], t) - m);
    if (out != nullptr) out[i] = e;
    total += e;
  }
  return total;
}

// torch's argmax of a row: the first index of its maximum, or of its first NaN if it has one
// (a NaN compares above everything); 0 for a row of -inf.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#ifdef PDSERVE_VEC16
  vec16 acc = set16(m);
  uint32_t nans = 0;
  for (; i + 16 <= n; i += 16) {
    const vec16 v = load16(x + i);
    acc = max16(acc, v);
    nans |= nan_mask16(v);
  }
  m = hmax16(acc);  // the maximum when no lane saw a NaN
  nan = nans != 0;
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    nan = nan || std::isnan(v);
    m = m < v ? v : m;
  }
  i = 0;
#ifdef PDSERVE_VEC16
  const vec16 mv = set16(m);
  for (; i + 16 <= n; i += 16) {
    const vec16 v = load16(x + i);
    const uint32_t hit = nan ? nan_mask16(v) : eq_mask16(v, mv);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (nan ? std::isnan(v) : v == m) return i;
  }
  return 0;
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

// Scratch of one task's draws: the chunk sums and their running sums, the landing chunk's
// numerators and theirs.
struct DrawScratch {
  std::vector<float> totals, cdf, values, inside;
  DrawScratch(int64_t chunks, int64_t chunk) : totals(chunks), cdf(chunks), values(chunk), inside(chunk) {}
};

// The token `inverse_cdf` draws for uniform u from the numerators exp(x / t - max) of a row
// (their chunk sums as `exp_chunk_totals_` forms them).
template <bool kScaled, typename T>
int64_t draw_row(const T* row, int64_t vocab, int64_t chunk, float u, float t, DrawScratch& s) {
  const int64_t chunks = static_cast<int64_t>(s.totals.size());
  // max(x / t) is max(x) / t: division by t > 0 and its rounding never change the order.
  const float m = scaled<kScaled>(row_max(row, vocab), t);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = c * chunk;
    s.totals[c] = exp_sum<kScaled>(row + start, std::min(chunk, vocab - start), m, t, nullptr);
  }
  cumulative(s.totals.data(), chunks, s.cdf.data());
  const float target = u * s.cdf[chunks - 1];
  const int64_t c = first_above(s.totals.data(), s.cdf.data(), chunks, target);
  const float before = c > 0 ? s.cdf[c - 1] : 0.f;
  // The chunk's numerators as the pass above summed them (same start, same lanes), zero past
  // the vocabulary.
  const int64_t start = c * chunk, len = std::min(chunk, vocab - start);
  exp_sum<kScaled>(row + start, len, m, t, s.values.data());
  std::fill(s.values.begin() + len, s.values.end(), 0.f);
  cumulative(s.values.data(), chunk, s.inside.data());
  return start + first_above(s.values.data(), s.inside.data(), chunk, target - before);
}

void check_logits(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                  && x.stride(1) == 1,
              "x: float32 or bfloat16 [rows, vocab] with unit last stride");
}

void check_row_values(const at::Tensor& v, const at::Tensor& x, const char* name) {
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.is_contiguous() && v.numel() == x.size(0),
              name, ": float32 [rows], contiguous");
}

template <typename T>
void sample_typed(const at::Tensor& x, const float* u, const float* temps, int64_t chunk, int64_t* out) {
  const int64_t rows = x.size(0), vocab = x.size(1), stride = x.stride(0);
  const int64_t chunks = (vocab + chunk - 1) / chunk;
  const T* data = x.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::optional<DrawScratch> scratch;  // only where a row draws
    for (int64_t r = begin; r < end; ++r) {
      const T* row = data + r * stride;
      const float t = temps == nullptr ? 1.f : temps[r];
      if (t == 0.f) {
        out[r] = argmax_row(row, vocab);
        continue;
      }
      if (!scratch) scratch.emplace(chunks, chunk);
      out[r] = t == 1.f ? draw_row<false>(row, vocab, chunk, u[r], t, *scratch)
                        : draw_row<true>(row, vocab, chunk, u[r], t, *scratch);
    }
  });
}

// x [rows, vocab] float32 or bfloat16 (unit last stride; read only), uniforms [rows] float32
// in [0, 1), temperatures [rows] float32 or None (all 1): int64 [rows].
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& uniforms,
                       const std::optional<at::Tensor>& temperatures, int64_t chunk) {
  check_logits(x);
  check_row_values(uniforms, x, "uniforms");
  if (temperatures) check_row_values(*temperatures, x, "temperatures");
  TORCH_CHECK(chunk > 0, "chunk must be positive");
  at::Tensor tokens = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* temps = temperatures ? temperatures->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    sample_typed<float>(x, uniforms.data_ptr<float>(), temps, chunk, tokens.data_ptr<int64_t>());
  else
    sample_typed<c10::BFloat16>(x, uniforms.data_ptr<float>(), temps, chunk, tokens.data_ptr<int64_t>());
  return tokens;
}

template <typename T>
void argmax_typed(const at::Tensor& x, int64_t* out) {
  const int64_t vocab = x.size(1), stride = x.stride(0);
  const T* data = x.data_ptr<T>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(data + r * stride, vocab);
  });
}

// x [rows, vocab] float32 or bfloat16 (unit last stride): torch's x.argmax(-1), int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x) {
  check_logits(x);
  at::Tensor tokens = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat)
    argmax_typed<float>(x, tokens.data_ptr<int64_t>());
  else
    argmax_typed<c10::BFloat16>(x, tokens.data_ptr<int64_t>());
  return tokens;
}

// splitmix64's finalizer (engine/sampling/sampler.py `_splitmix64`).
inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// keys int64 [rows, 3]: each row's (seed mod 2^64, completion index, output position), as
// engine/sampling/sampler.py `draw_keys` packs them. Returns float32 [rows]: the first of the row's
// uniforms (`row_uniforms`: splitmix64 of its `draw_seed` plus the golden gamma, top 53 bits
// scaled to [0, 1) in double) rounded to float32 — what the draw takes.
at::Tensor first_uniforms(const at::Tensor& keys) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 3 && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "keys: int64 [rows, 3], contiguous");
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
  const int64_t rows = keys.size(0);
  at::Tensor out = at::empty({rows}, keys.options().dtype(at::kFloat));
  const uint64_t* k = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  float* u = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t seed = mix64(k[3 * r] * kGamma + k[3 * r + 1] * 0xBF58476D1CE4E5B9ULL + k[3 * r + 2])
                          & 0x7FFFFFFFFFFFFFFFULL;  // draw_seed
    u[r] = static_cast<float>(static_cast<double>(mix64(seed + kGamma) >> 11) * 0x1p-53);
  }
  return out;
}

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
        out[r * chunks + c] = exp_sum<false>(row + start, std::min(chunk, vocab - start), m, 1.f, row + start);
      }
    }
  });
  return totals;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("exp_chunk_totals_(Tensor(a!) x, int chunk) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor uniforms, Tensor? temperatures, int chunk) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("first_uniforms(Tensor keys) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("exp_chunk_totals_", &exp_chunk_totals_);
  m.impl("sample_rows", &sample_rows);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("first_uniforms", &first_uniforms);
}
