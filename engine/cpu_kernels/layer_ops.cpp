// A decoder layer's small ops on the CPU, one pass each: RMSNorm (optionally fused with the
// residual add before it), RoPE in place on q and k, SiLU-and-mul, and the store of a step's
// K/V rows into the paged pool.
//
// Contracts and references: the Triton kernels of the same names (kernels/rms_norm.py,
// kernels/rope.py, kernels/silu_and_mul.py) and their plain-torch references; wrappers in
// engine/cpu_kernels/__init__.py. Each replaces 4-10 ATen ops whose cost at decode sizes is
// dispatch, not arithmetic (docs/benchmarks/decode_profile.md).
//
// Numerics follow the torch path they replace (engine/models/layers.py): statistics and
// products in fp32, rounded to the model's dtype at the same points (the normalised value
// before the weight multiply, silu before the multiply by up, the residual sum before its
// norm). Sums run in another order than ATen's, so fp32 results differ in the last bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "vec16.h"

#ifdef PDSERVE_VEC16
using namespace pdserve_vec;
#endif

// RoPE's rotate-and-add must round as the torch path does (a product, then the sum), not as
// one fused multiply-add.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kRowsPerTask = 16;  // rows per parallel task: decode batches run serially

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

template <typename T>
inline T cast(float v) { return static_cast<T>(v); }

// out[r] = T(T(x[r] * inv_rms) * w): HF LlamaRMSNorm.
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef PDSERVE_VEC16
  vec16 acc = zero16();
  for (; i + 16 <= H; i += 16) {
    const vec16 v = load16(x + i);
    acc = fmadd16(v, v, acc);
  }
  ss = sum16(acc);
#endif
  for (; i < H; ++i) ss += f32(x[i]) * f32(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  i = 0;
#ifdef PDSERVE_VEC16
  const vec16 iv = set16(inv);
  for (; i + 16 <= H; i += 16) store16(out + i, mul16(round16<T>(mul16(load16(x + i), iv)), load16(w + i)));
#endif
  for (; i < H; ++i) out[i] = cast<T>(f32(cast<T>(f32(x[i]) * inv)) * f32(w[i]));
}

// sum[i] = T(x[i] + r[i])
template <typename T>
void add_row(const T* x, const T* r, T* sum, int64_t H) {
  int64_t i = 0;
#ifdef PDSERVE_VEC16
  for (; i + 16 <= H; i += 16) store16(sum + i, add16(load16(x + i), load16(r + i)));
#endif
  for (; i < H; ++i) sum[i] = cast<T>(f32(x[i]) + f32(r[i]));
}

at::Tensor rows_of(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), name, ": contiguous [..., hidden]");
  return x.view({-1, x.size(-1)});
}

void check_weight(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1), "weight: [hidden], contiguous");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight: x's dtype");
}

template <typename F>
void for_each_dtype(const at::Tensor& x, const char* op, F&& body) {
  switch (x.scalar_type()) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16");
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor rows = rows_of(x, "x");
  check_weight(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t R = rows.size(0), H = rows.size(1);
  for_each_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = rows.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, R, kRowsPerTask, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * H, wp, op + r * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  const at::Tensor rows = rows_of(x, "x"), res = rows_of(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual: x's shape and dtype");
  check_weight(x, weight);
  at::Tensor out = at::empty_like(x), summed = at::empty_like(x);
  const int64_t R = rows.size(0), H = rows.size(1);
  for_each_dtype(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = rows.data_ptr<T>();
    const T* rp = res.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* sp = summed.data_ptr<T>();
    at::parallel_for(0, R, kRowsPerTask, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        add_row(xp + r * H, rp + r * H, sp + r * H, H);
        norm_row(sp + r * H, wp, op + r * H, H, static_cast<float>(eps));
      }
    });
  });
  return {out, summed};
}

// x[..half) and x[half..2 half) of each head rotate: x1 c - x2 s | x2 c + x1 s.
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t head_stride, const float* cs, int64_t half) {
  const float* sn = cs + half;
  for (int64_t h = 0; h < heads; ++h) {
    T* p = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = f32(p[i]), x2 = f32(p[i + half]);
      const float a = x1 * cs[i], b = x2 * -sn[i], c = x2 * cs[i], d = x1 * sn[i];
      p[i] = cast<T>(a + b);
      p[i + half] = cast<T>(c + d);
    }
  }
}

void rope_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q, k: [T, heads, head_dim] with unit last stride");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.scalar_type() == k.scalar_type(),
              "q, k: the same tokens, head_dim and dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.is_contiguous() &&
              positions.scalar_type() == at::kLong, "positions: int64 [T], contiguous");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.scalar_type() == at::kFloat &&
              cos_sin.size(1) % 2 == 0 && cos_sin.size(1) <= q.size(2),
              "cos_sin: fp32 [positions, rotary_dim], contiguous, rotary_dim even and <= head_dim");
  const int64_t T_ = q.size(0), half = cos_sin.size(1) / 2, P = cos_sin.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the RoPE table of ", P);
  for_each_dtype(q, "rope", [&](auto tag) {
    using T = decltype(tag);
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, T_, kRowsPerTask, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* cs = table + pos[t] * 2 * half;
        rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), cs, half);
        rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), cs, half);
      }
    });
  });
}

template <typename T>
inline float silu(float g) { return f32(cast<T>(g / (1.f + std::exp(-g)))); }

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_VEC16
  const vec16 one = set16(1.f);
  for (; i + 16 <= n; i += 16) {
    const vec16 g = load16(gate + i);
    const vec16 e = exp16(sub16(zero16(), g));
    store16(out + i, mul16(round16<T>(div16(g, add16(one, e))), load16(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = cast<T>(silu<T>(f32(gate[i])) * f32(up[i]));
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const at::Tensor rows = rows_of(x, "x");
  TORCH_CHECK(rows.size(1) % 2 == 0, "x: an even last dim (gate | up)");
  const int64_t R = rows.size(0), W = rows.size(1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = W;
  at::Tensor out = at::empty(shape, x.options());
  for_each_dtype(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = rows.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, R, kRowsPerTask, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_row(xp + r * 2 * W, xp + r * 2 * W + W, op + r * W, W);
    });
  });
  return out;
}

// K/V rows of this step's tokens into one layer of the paged pool, in place: key[t] and
// value[t] ([Hkv, D] each, strided views of the fused qkv allowed) at slot_mapping[t] =
// block * B + offset (-1: not stored). The pool holds the same dtype (quantized pools keep
// the torch path). One memcpy per row: what two index_copy_ calls and the row arithmetic
// around them did in ~10 ATen ops per layer.
void store_kv_(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, int64_t layer,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
              key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "key, value: [T, kv_heads, head_dim], each token's heads contiguous");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.scalar_type() == key.scalar_type() &&
              value.scalar_type() == key.scalar_type(),
              "kv_cache: a contiguous 6-D pool in key's dtype");
  TORCH_CHECK(kv_cache.size(1) == key.size(1) && kv_cache.size(5) == key.size(2),
              "kv_cache: key's kv_heads and head_dim");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(2), "layer out of range");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous() &&
              slot_mapping.scalar_type() == at::kLong, "slot_mapping: int64 [T], contiguous");
  // The pool is [N, Hkv, L, 2, B, D] (engine/kv/kv_pool.py): a token's heads land in Hkv pages.
  const int64_t T_ = key.size(0), N = kv_cache.size(0), H = kv_cache.size(1), L = kv_cache.size(2);
  const int64_t B = kv_cache.size(4);
  const int64_t row_bytes = key.size(2) * key.element_size();  // one head of one token
  const int64_t page_bytes = B * row_bytes;  // one head's rows of one layer's K (or V) of a block
  const int64_t head_bytes = L * 2 * page_bytes, block_bytes = H * head_bytes;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(slots[t] < N * B, "slot ", slots[t], " outside the pool of ", N, " blocks");
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* pool = static_cast<char*>(kv_cache.data_ptr());
  const int64_t k_tok = key.stride(0) * key.element_size(), v_tok = value.stride(0) * value.element_size();
  at::parallel_for(0, T_, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / B, offset = slots[t] % B;
      char* k_row = pool + block * block_bytes + layer * 2 * page_bytes + offset * row_bytes;
      for (int64_t h = 0; h < H; ++h, k_row += head_bytes) {
        std::memcpy(k_row, kp + t * k_tok + h * row_bytes, row_bytes);
        std::memcpy(k_row + page_bytes, vp + t * v_tok + h * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("store_kv_(Tensor key, Tensor value, Tensor(a!) kv_cache, int layer, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kv_", &store_kv_);
}
