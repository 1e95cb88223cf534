// 16 fp32 lanes of a row of float32, bfloat16 or float16 (AVX-512), shared by the kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#ifdef __AVX512F__
#include <immintrin.h>

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
