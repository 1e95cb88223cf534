// Paged decode attention on the CPU, reading K/V in place from the engine's pool.
//
// One query token per sequence (decode rows), any GQA group, optional sliding window and
// logit soft-capping; the pool holds the model's dtype (float32, bfloat16 or float16) or one
// of the quantized KV formats of engine/kv/kv_format.py: fp8 e4m3 / e5m2 (scale 1), or int8 with
// a float32 scale per token and kv head after its head_dim values. Quantized rows are widened
// to fp32 as they are read (an int8 row's scale multiplies its dot products and its
// probabilities), never dequantized into new tensors.
// Contract and reference: engine/attention/cpu_kernels.py (`paged_decode`) and the torch
// backend's gather + SDPA decode path it replaces.
//
// Work item = (sequence, kv head), longest first, taken by ATen's intra-op threads as each
// becomes free. For each item the group's query heads are converted to fp32 once; pass 1 walks
// the sequence's keys block by block (scores = q.k * scale, soft cap), pass 2 the softmax,
// pass 3 the values. Everything is fp32; the output is rounded once to the model's dtype.
// Dots and axpys run in 16 fp32 lanes (vec16.h: AVX-512, or AVX2 in two halves); exp is
// libmvec's vector expf. Without either ISA, or for other head sizes, plain loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "vec16.h"


namespace {

constexpr int64_t kLanes = 16;
#ifndef PDSERVE_PREFETCH_BLOCKS
#define PDSERVE_PREFETCH_BLOCKS 2
#endif
constexpr int64_t kPrefetchBlocks = PDSERVE_PREFETCH_BLOCKS;  // see prefetch_rows

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Quantized pool elements (engine/kv/kv_format.py). fp8 e5m2 is the upper byte of a float16;
// e4m3's bits sit at float16's bit 7 upwards, x 2^8 fixes the exponent bias (its NaN pattern
// reads as +-480, as the torch path's `_fp8_to_fp16`; quantize never writes it).
struct E4M3 { uint8_t bits; };
struct E5M2 { uint8_t bits; };

inline float widen(E5M2 v) { return static_cast<float>(c10::Half(static_cast<uint16_t>(v.bits << 8), c10::Half::from_bits())); }
inline float widen(E4M3 v) {
  const uint16_t half = static_cast<uint16_t>(((v.bits & 0x80) << 8) | ((v.bits & 0x7F) << 7));
  return static_cast<float>(c10::Half(half, c10::Half::from_bits())) * 256.f;
}

inline void load_row(const E4M3* src, float* dst, int64_t n) { for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]); }
inline void load_row(const E5M2* src, float* dst, int64_t n) { for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]); }
inline void load_row(const int8_t* src, float* dst, int64_t n) { for (int64_t i = 0; i < n; ++i) dst[i] = src[i]; }

// The factor a stored row's values are multiplied by: an int8 row's scale (4 bytes after its
// D values), 1 for every other pool.
template <typename P>
inline float row_scale(const P* row, int64_t D) {
  if constexpr (std::is_same_v<P, int8_t>) {
    float scale;
    std::memcpy(&scale, row + D, sizeof(float));
    return scale;
  } else {
    return 1.f;
  }
}
template <typename P>
constexpr bool kScaled = std::is_same_v<P, int8_t>;

// sum_i a[i] * b[i], in 16 partial sums then a fixed-order tree (deterministic).
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) part[i % kLanes] += a[i] * b[i];
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t j = 0; j < w; ++j) part[j] += part[j + w];
  return part[0];
}

using pdserve_vec::exp_sub_sum;

// Softmax numerators of each query head's `len` scores in place; returns 1 / their sums.
inline std::vector<float> softmax_numerators(float* scores, int64_t G, int64_t len) {
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    inv[g] = 1.f / exp_sub_sum(sg, len, pdserve_vec::row_max(sg, len));
  }
  return inv;
}

inline float capped(float score, float cap) { return cap > 0.f ? cap * std::tanh(score / cap) : score; }

#ifdef PDSERVE_VEC16
using namespace pdserve_vec;
using pdserve_vec::load16;  // overloaded below for the quantized formats

inline vec16 load16(const E5M2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return from_halves16(_mm256_slli_epi16(b, 8));
}
inline vec16 load16(const E4M3* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return mul16(from_halves16(half), set16(256.f));
}
inline vec16 load16(const int8_t* p) { return from_i8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Asks (into L2) for the rows of this head in the block kPrefetchBlocks ahead (K or V page)
// while the current one is read: blocks sit anywhere in the pool, so the hardware prefetcher
// loses the stream at each one. Cold-cache microbenchmark, batch 16, bf16: no prefetch 2.07,
// next block into L1 1.66, two blocks ahead into L2 1.59 ms per layer.
template <typename T>
inline void prefetch_rows(const T* page_head, int64_t B, int64_t row, int64_t D) {
  for (int64_t t = 0; t < B; ++t)
    for (int64_t b = 0; b < static_cast<int64_t>(D * sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(page_head + t * row) + b, _MM_HINT_T1);
}

// The dot products of GB query heads with one key row, each in 16 lanes.
template <typename T, int V, int GB>
inline void dots_of(const float* qf, const T* k, vec16 (&acc)[GB]) {
  constexpr int64_t D = 16 * V;
  vec16 kr[V];
  for (int v = 0; v < V; ++v) kr[v] = load16(k + 16 * v);
  for (int g = 0; g < GB; ++g) {
    acc[g] = mul16(load16(qf + g * D), kr[0]);
    for (int v = 1; v < V; ++v) acc[g] = fmadd16(load16(qf + g * D + 16 * v), kr[v], acc[g]);
  }
}

// scores[g][key] = q[g] . k[key] * scale (soft-capped) for GB query heads of one kv head.
// Block by block (one table lookup and division per block, none per key); four keys at a
// time within a block: each key row is loaded (and widened to fp32) once for all GB heads,
// and the 4 * GB dot products are reduced across lanes together (sum4), not one by one.
template <typename T, int V, int GB>
inline void key_pass(const float* qf, const T* kv, const int32_t* table, int64_t first, int64_t n,
                     int64_t B, int64_t N, int64_t block, int64_t page, int64_t row,
                     int64_t h, int64_t DS, float scale, float cap, float* scores) {
  constexpr int64_t D = 16 * V;
  const int64_t len = n - first;
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t pos = first; pos < n;) {
    const int64_t bi = pos / B, blk = table[bi], stop = std::min(n, (bi + 1) * B);
    TORCH_CHECK(blk >= 0 && blk < N, "block id ", blk, " outside the pool of ", N);
    if ((bi + kPrefetchBlocks) * B < n) {
      const int64_t ahead = table[bi + kPrefetchBlocks];
      if (ahead >= 0 && ahead < N) prefetch_rows(kv + ahead * block, B, row, DS);
    }
    const T* k = kv + blk * block + (pos - bi * B) * row;
    float* dst = scores + (pos - first);
    for (; pos + 4 <= stop; pos += 4, k += 4 * row, dst += 4) {
      vec16 acc[4][GB];
      for (int j = 0; j < 4; ++j) dots_of<T, V, GB>(qf, k + j * row, acc[j]);
      __m128 ks = scale4;
      if constexpr (kScaled<T>)
        ks = _mm_mul_ps(_mm_setr_ps(row_scale(k, D), row_scale(k + row, D), row_scale(k + 2 * row, D),
                                    row_scale(k + 3 * row, D)), scale4);
      for (int g = 0; g < GB; ++g) {
        float* out = dst + g * len;
        _mm_storeu_ps(out, _mm_mul_ps(sum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]), ks));
        if (cap > 0.f)
          for (int j = 0; j < 4; ++j) out[j] = capped(out[j], cap);
      }
    }
    for (; pos < stop; ++pos, k += row, ++dst) {
      vec16 acc[GB];
      dots_of<T, V, GB>(qf, k, acc);
      for (int g = 0; g < GB; ++g) {
        const float dot = sum16(acc[g]);
        dst[g * len] = capped((kScaled<T> ? dot * row_scale(k, D) : dot) * scale, cap);
      }
    }
  }
}

// out[g] = sum over keys of p[g][key] * v[key], for GB query heads of one kv head at once: each
// value row is loaded (and widened to fp32) once for all of them; GB * V accumulators and the
// row stay in registers. Block by block, as key_pass.
template <typename T, int V, int GB>
inline void value_pass(const float* probs, int64_t len, const float* inv, const T* kv, const int32_t* table,
                       int64_t first, int64_t n, int64_t B, int64_t block, int64_t page,
                       int64_t row, int64_t h, int64_t DS, float* out) {
  constexpr int64_t D = 16 * V;
  vec16 acc[GB][V];
  for (int g = 0; g < GB; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = zero16();
  for (int64_t pos = first; pos < n;) {
    const int64_t bi = pos / B, stop = std::min(n, (bi + 1) * B);
    const T* vr = kv + table[bi] * block + page + (pos - bi * B) * row;
    if (stop + (kPrefetchBlocks - 1) * B < n)
      prefetch_rows(kv + table[bi + kPrefetchBlocks] * block + page, B, row, DS);
    // The block's sums in registers (a block-local array GCC keeps there; the long-lived
    // `acc` it would store back to the stack on every row), added to `acc` once per block.
    vec16 part[GB][V];
    for (int g = 0; g < GB; ++g)
      for (int v = 0; v < V; ++v) part[g][v] = zero16();
    const float* p = probs + (pos - first);
    for (; pos < stop; ++pos, vr += row, ++p) {
      vec16 vrow[V];
      for (int v = 0; v < V; ++v) vrow[v] = load16(vr + 16 * v);
      const float vs = row_scale(vr, D);
      for (int g = 0; g < GB; ++g) {
        const vec16 pg = set16(kScaled<T> ? p[g * len] * vs : p[g * len]);
        for (int v = 0; v < V; ++v) part[g][v] = fmadd16(pg, vrow[v], part[g][v]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int v = 0; v < V; ++v) acc[g][v] = add16(acc[g][v], part[g][v]);
  }
  for (int g = 0; g < GB; ++g) {
    const vec16 iv = set16(inv[g]);
    for (int v = 0; v < V; ++v) store16(out + g * D + 16 * v, mul16(acc[g][v], iv));
  }
}

// One (sequence, kv head) item with head_dim = 16 * V (V <= 8) and G query heads, in
// registers: the group's queries (fp32) and output accumulators stay in vector registers.
template <typename T, int V>
void item_vec16(const float* qf, int64_t G, const T* kv, const int32_t* table, int64_t first,
                 int64_t n, int64_t B, int64_t N, int64_t block, int64_t page,
                 int64_t row, int64_t h, int64_t DS, float scale, float cap, float* scores, float* out) {
  constexpr int64_t D = 16 * V;
  const int64_t len = n - first;
  int64_t g = 0;
  // Four heads per key pass under AVX2 too: its accumulators spill from the 16 ymm registers,
  // yet 1, 2 and 4 heads measured the same (fp32, batch 16: the pass waits on memory).
  for (; g + 4 <= G; g += 4) key_pass<T, V, 4>(qf + g * D, kv, table, first, n, B, N, block, page, row, h, DS, scale, cap, scores + g * len);
  switch (G - g) {
    case 1: key_pass<T, V, 1>(qf + g * D, kv, table, first, n, B, N, block, page, row, h, DS, scale, cap, scores + g * len); break;
    case 2: key_pass<T, V, 2>(qf + g * D, kv, table, first, n, B, N, block, page, row, h, DS, scale, cap, scores + g * len); break;
    case 3: key_pass<T, V, 3>(qf + g * D, kv, table, first, n, B, N, block, page, row, h, DS, scale, cap, scores + g * len); break;
    default: break;
  }
  const std::vector<float> inv = softmax_numerators(scores, G, len);
  // kHeads * V accumulators, V row registers and a broadcast fit the registers (32 zmm: 4
  // heads up to head_dim 64, 2 at 128; AVX2's 16 ymm hold 8 vec16: 2 heads at 32, else 1).
  constexpr int kHeads = std::clamp((kVecRegisters - V - 1) / V, 1, 4);
  g = 0;
  for (; g + kHeads <= G; g += kHeads) value_pass<T, V, kHeads>(scores + g * len, len, inv.data() + g, kv, table, first, n, B, block, page, row, h, DS, out + g * D);
  switch (G - g) {
    case 1: value_pass<T, V, 1>(scores + g * len, len, inv.data() + g, kv, table, first, n, B, block, page, row, h, DS, out + g * D); break;
    case 2: value_pass<T, V, 2>(scores + g * len, len, inv.data() + g, kv, table, first, n, B, block, page, row, h, DS, out + g * D); break;
    case 3: value_pass<T, V, 3>(scores + g * len, len, inv.data() + g, kv, table, first, n, B, block, page, row, h, DS, out + g * D); break;
    default: break;
  }
}
#endif

// The same for any head_dim (and without AVX-512), in plain loops.
template <typename T>
void item_generic(const float* qf, int64_t G, int64_t D, const T* kv, const int32_t* table,
                  int64_t first, int64_t n, int64_t B, int64_t N, int64_t block,
                  int64_t page, int64_t row, int64_t h, int64_t DS, float scale, float cap,
                  float* scores, float* out) {
  const int64_t len = n - first;
  std::vector<float> buf(D);
  for (int64_t pos = first; pos < n;) {
    const int64_t blk = table[pos / B], stop = std::min(n, (pos / B + 1) * B);
    TORCH_CHECK(blk >= 0 && blk < N, "block id ", blk, " outside the pool of ", N);
    const T* k = kv + blk * block + (pos % B) * row;
    for (; pos < stop; ++pos, k += row) {
      load_row(k, buf.data(), D);
      const float ks = row_scale(k, D) * scale;
      for (int64_t g = 0; g < G; ++g) {
        scores[g * len + (pos - first)] = capped(dot(qf + g * D, buf.data(), D) * ks, cap);
      }
    }
  }
  const std::vector<float> inv = softmax_numerators(scores, G, len);
  std::fill(out, out + G * D, 0.f);
  for (int64_t pos = first; pos < n;) {
    const int64_t blk = table[pos / B], stop = std::min(n, (pos / B + 1) * B);
    const T* v = kv + blk * block + page + (pos % B) * row;
    for (; pos < stop; ++pos, v += row) {
      load_row(v, buf.data(), D);
      const float vs = row_scale(v, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * len + (pos - first)] * vs;
        for (int64_t d = 0; d < D; ++d) out[g * D + d] += p * buf[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv[g];
}

// T: the query's (and the output's) dtype; P: the pool's element (T, or a quantized format).
template <typename T, typename P>
void decode(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale_d,
            int64_t window, double cap_d, at::Tensor& out) {
  const int64_t S = query.size(0), Hq = query.size(1), D = query.size(2);
  // The pool is [N, Hkv, L, 2, B, DS] (engine/kv/kv_pool.py): one head's rows of one layer's K
  // (or V) of one block are one page of B consecutive rows.
  const int64_t N = kv_cache.size(0), Hkv = kv_cache.size(1), L = kv_cache.size(2), B = kv_cache.size(4);
  const int64_t G = Hq / Hkv;
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t DS = kv_cache.size(5);  // stored head_dim: D, or D + 4 (int8's scale)
  const int64_t row = DS, page = B * row, head = L * 2 * page, block = Hkv * head;
  const T* q = query.data_ptr<T>();
  const P* kv = reinterpret_cast<const P*>(kv_cache.data_ptr());
  T* o = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float scale = static_cast<float>(scale_d), cap = static_cast<float>(cap_d);

  // Items (sequence, kv head), the most keys first, each taken by whichever thread is free
  // next: contexts differ in length, and a static split of the batch can leave one thread with
  // most of the keys. An item is one thread's whole work, so results do not depend on who ran it.
  auto first_key = [&](int64_t n) { return window > 0 ? std::max<int64_t>(0, n - window) : int64_t{0}; };
  const int64_t items = S * Hkv;
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t na = lens[a / Hkv], nb = lens[b / Hkv];
    return na - first_key(na) > nb - first_key(nb);
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t k = next++; k < items; k = next++) {
      const int64_t item = order[k], s = item / Hkv, h = item % Hkv;
      const int64_t n = lens[s];
      const int64_t first = first_key(n);
      for (int64_t g = 0; g < G; ++g) load_row(q + s * q_tok + (h * G + g) * q_head, &qf[g * D], D);
      scores.resize(G * (n - first));
      const int32_t* table = tables + s * table_stride;
      const P* kvh = kv + h * head + layer * 2 * page;  // this head's layer K page in block 0
#ifdef PDSERVE_VEC16
#define PDSERVE_ITEM(V) item_vec16<P, V>(qf.data(), G, kvh, table, first, n, B, N, block, page, \
                                          row, h, DS, scale, cap, scores.data(), acc.data())
      switch (D) {
        case 32: PDSERVE_ITEM(2); break;
        case 64: PDSERVE_ITEM(4); break;
        case 128: PDSERVE_ITEM(8); break;
        default:
          item_generic<P>(qf.data(), G, D, kvh, table, first, n, B, N, block, page, row, h, DS, scale,
                          cap, scores.data(), acc.data());
      }
#undef PDSERVE_ITEM
#else
      item_generic<P>(qf.data(), G, D, kvh, table, first, n, B, N, block, page, row, h, DS, scale,
                      cap, scores.data(), acc.data());
#endif
      for (int64_t g = 0; g < G; ++g) {
        T* dst = o + (s * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [S, Hq, D] with unit last stride");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache: contiguous 6-D pool");
  const bool int8_pool = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() || int8_pool ||
              kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2,
              "kv_cache: the query's dtype, float8_e4m3fn, float8_e5m2 or int8");
  TORCH_CHECK(kv_cache.size(5) == query.size(2) + (int8_pool ? 4 : 0),
              "kv_cache: the query's head_dim (+ 4 scale bytes for int8)");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "query heads: a multiple of kv heads");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(2), "layer out of range");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
              block_tables.stride(1) == 1 && block_tables.size(0) == query.size(0),
              "block_tables: int32 [S, max_blocks], unit last stride");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
              seq_lens.numel() == query.size(0), "seq_lens: int32 [S], contiguous");
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  auto with_pool = [&](auto query_tag) {
    using T = decltype(query_tag);
    switch (kv_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: decode<T, E4M3>(query, kv_cache, layer, block_tables, seq_lens, scale, window, soft_cap, out); break;
      case at::kFloat8_e5m2: decode<T, E5M2>(query, kv_cache, layer, block_tables, seq_lens, scale, window, soft_cap, out); break;
      case at::kChar: decode<T, int8_t>(query, kv_cache, layer, block_tables, seq_lens, scale, window, soft_cap, out); break;
      default: decode<T, T>(query, kv_cache, layer, block_tables, seq_lens, scale, window, soft_cap, out);
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: with_pool(float{}); break;
    case at::kBFloat16: with_pool(c10::BFloat16{}); break;
    case at::kHalf: with_pool(c10::Half{}); break;
    default: TORCH_CHECK(false, "dtype: float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor kv_cache, int layer, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float soft_cap) -> Tensor");
  // The ISA the library's 16-lane paths were built for (vec16.h): avx512, avx2 or scalar.
  m.def("vector_isa() -> str", [] { return std::string(pdserve_vec::vector_isa()); });
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
