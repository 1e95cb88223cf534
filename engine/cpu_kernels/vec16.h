// 16 fp32 lanes of a row of float32, bfloat16 or float16 (AVX-512), shared by the kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // libmvec's 16-lane expf (link with -lmvec)

namespace pdserve_vec {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// fp32 -> bfloat16, round to nearest even (c10::BFloat16's rounding; NaN stays NaN).
inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16));
#endif
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T's precision, back in fp32 (what storing and reloading it gives).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

}  // namespace pdserve_vec
#endif

namespace pdserve_vec {

// The largest of x[0..n) (16 lanes under AVX-512); -inf for n == 0.
inline float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#ifdef __AVX512F__
  __m512 acc = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(acc);
#endif
  for (; i < n; ++i) m = m < x[i] ? x[i] : m;
  return m;
}

// x[i] = exp(x[i] - m) for i < n; returns their sum (16 lanes with libmvec's expf under
// AVX-512, summed in a fixed order).
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

}  // namespace pdserve_vec
