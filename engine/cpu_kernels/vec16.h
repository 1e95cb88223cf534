// 16 fp32 lanes of a row of float32, bfloat16 or float16, shared by the kernels: one zmm
// register under AVX-512, two ymm registers under AVX2 (+ FMA, F16C: x86-64-v3). The kernels
// write their loops once against `vec16` and these functions; PDSERVE_VEC16 says whether
// either ISA is there (else they keep their plain loops).
//
// Results are deterministic per ISA: a reduction sums its lanes in a fixed tree. The two ISAs'
// trees differ, so fp32 sums can differ in the last bits between an AVX-512 and an AVX2 build.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#define PDSERVE_VEC16 1
#define PDSERVE_VEC16_ISA "avx512"
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // libmvec's 16-lane expf (link with -lmvec)

namespace pdserve_vec {

using vec16 = __m512;
// Registers of 16 lanes the kernels size their register blocks by.
constexpr int kVecRegisters = 32;

inline vec16 zero16() { return _mm512_setzero_ps(); }
inline vec16 set16(float v) { return _mm512_set1_ps(v); }
inline vec16 add16(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
inline vec16 sub16(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
inline vec16 mul16(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
inline vec16 div16(vec16 a, vec16 b) { return _mm512_div_ps(a, b); }
inline vec16 max16(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
inline vec16 fmadd16(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float sum16(vec16 v) { return _mm512_reduce_add_ps(v); }
inline float hmax16(vec16 v) { return _mm512_reduce_max_ps(v); }
inline vec16 exp16(vec16 v) { return _ZGVeN16v_expf(v); }
inline vec16 round_nearest16(vec16 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n where x >= t or x is NaN, 0 where x < t (-inf included): one masked vscalefps.
inline vec16 scale_by_pow2_from16(vec16 p, vec16 n, vec16 x, float t) {
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_NLT_UQ), p, n);
}

inline vec16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, vec16 v) { _mm512_storeu_ps(p, v); }
// Bit i set where lane i of a equals lane i of b (NaN equals nothing) / where lane i is NaN.
inline uint32_t eq_mask16(vec16 a, vec16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline uint32_t nan_mask16(vec16 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
// 16 float16 bit patterns (fp8 rows are widened through them).
inline vec16 from_halves16(__m256i h) { return _mm512_cvtph_ps(h); }
// 16 bfloat16 bit patterns, each in the low half of a 32-bit lane.
inline vec16 from_bf16_words(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline vec16 load16(const c10::BFloat16* p) {
  return from_bf16_words(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
inline vec16 load16(const c10::Half* p) {
  return from_halves16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 int8 values.
inline vec16 from_i8x16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }

// fp32 -> bfloat16, round to nearest even (c10::BFloat16's rounding; NaN stays NaN).
inline __m256i to_bf16(vec16 v) {
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
inline __m256i to_halves16(vec16 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }
// v rounded to bfloat16, back in fp32.
inline vec16 round_bf16(vec16 v) { return from_bf16_words(_mm512_cvtepu16_epi32(to_bf16(v))); }

// The four sums of a, b, c and d's lanes, in that order.
inline __m128 sum4(vec16 a, vec16 b, vec16 c, vec16 d) {
  // Per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3), the same for c and d.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per 128-bit lane: partial sums of a, b, c, d.
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

}  // namespace pdserve_vec

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_VEC16 1
#define PDSERVE_VEC16_ISA "avx2"
#include <immintrin.h>
extern "C" __m256 _ZGVdN8v_expf(__m256);  // libmvec's 8-lane expf (link with -lmvec)

namespace pdserve_vec {

// Lanes 0-7 in `lo`, 8-15 in `hi`.
struct vec16 {
  __m256 lo, hi;
};
constexpr int kVecRegisters = 8;  // 16 ymm registers, two per vec16

inline vec16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec16 set16(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline vec16 add16(vec16 a, vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec16 sub16(vec16 a, vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec16 mul16(vec16 a, vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec16 div16(vec16 a, vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec16 max16(vec16 a, vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vec16 fmadd16(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float sum16(vec16 v) { return sum8(_mm256_add_ps(v.lo, v.hi)); }
inline float hmax16(vec16 v) {
  const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline vec16 exp16(vec16 v) { return {_ZGVdN8v_expf(v.lo), _ZGVdN8v_expf(v.hi)}; }
inline vec16 round_nearest16(vec16 v) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode)};
}
// p * 2^n for integral n in [-126, 127] (what fast_exp16 passes): n + 127 in the exponent bits.
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec16 scale_by_pow2_from16(vec16 p, vec16 n, vec16 x, float t) {
  const __m256 tv = _mm256_set1_ps(t);
  auto half = [&](__m256 ph, __m256 nh, __m256 xh) {
    return _mm256_andnot_ps(_mm256_cmp_ps(xh, tv, _CMP_LT_OQ), _mm256_mul_ps(ph, pow2_8(nh)));
  };
  return {half(p.lo, n.lo, x.lo), half(p.hi, n.hi, x.hi)};
}

inline vec16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, vec16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline uint32_t eq_mask16(vec16 a, vec16 b) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ))
         | _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)) << 8;
}
inline uint32_t nan_mask16(vec16 v) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q))
         | _mm256_movemask_ps(_mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q)) << 8;
}
inline vec16 from_halves16(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
inline vec16 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  auto widen = [](__m128i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16)); };
  return {widen(_mm256_castsi256_si128(raw)), widen(_mm256_extracti128_si256(raw, 1))};
}
inline vec16 load16(const c10::Half* p) {
  return from_halves16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec16 from_i8x16(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}

// fp32 -> bfloat16, round to nearest even (c10::BFloat16's rounding; NaN stays NaN).
inline __m256i bf16_words8(__m256 v) {  // 8 results, each in the low half of a 32-bit lane
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan), 16);
}
inline __m256i to_bf16(vec16 v) {
  // packus interleaves 128-bit lanes (lo0-3 hi0-3 | lo4-7 hi4-7); the permute restores order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_words8(v.lo), bf16_words8(v.hi)), 0b11011000);
}
inline vec16 round_bf16(vec16 v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_words8(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_words8(v.hi), 16))};
}
inline __m256i to_halves16(vec16 v) {
  return _mm256_set_m128i(_mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT),
                          _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT));
}

// The four sums of a, b, c and d's lanes, in that order.
inline __m128 sum4(vec16 a, vec16 b, vec16 c, vec16 d) {
  const __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi));
  const __m256 cd = _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // a b c d partial sums in each 128-bit lane
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

}  // namespace pdserve_vec
#endif

#ifdef PDSERVE_VEC16
namespace pdserve_vec {

inline void store16(c10::BFloat16* p, vec16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store16(c10::Half* p, vec16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_halves16(v));
}

// v rounded to T's precision, back in fp32 (what storing and reloading it gives).
template <typename T>
inline vec16 round16(vec16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(v);
  } else {
    return from_halves16(to_halves16(v));
  }
}

// exp(x) for x <= 88 (the sampler passes x - row max <= 0), within 1.7e-7 relative of exp
// on [-87, 0], in ~12 instructions where libmvec's takes about twice as many: x = n ln2 + r
// (Cody-Waite, |r| <= ln2 / 2), exp(r) by a degree-5 polynomial (minimax for relative error,
// constant term exactly 1: exp(0) is 1), times 2^n. Inputs below -87 (exp < 1.7e-38) and
// -inf give exactly 0; NaN stays NaN (max keeps its second operand when either is NaN).
inline vec16 fast_exp16(vec16 x) {
  const vec16 xc = max16(set16(-87.f), x);
  const vec16 n = round_nearest16(mul16(xc, set16(1.44269504088896341f)));
  vec16 r = fmadd16(n, set16(-0.693359375f), xc);  // ln2 in two parts: n * 0.693359375 is exact
  r = fmadd16(n, set16(2.12194440e-4f), r);
  vec16 p = set16(0.00829028058797121f);
  p = fmadd16(p, r, set16(0.041897863149642944f));
  p = fmadd16(p, r, set16(0.1666763573884964f));
  p = fmadd16(p, r, set16(0.4999915063381195f));
  p = fmadd16(p, r, set16(0.9999997019767761f));
  p = fmadd16(p, r, set16(1.f));
  return scale_by_pow2_from16(p, n, x, -87.f);
}

}  // namespace pdserve_vec
#endif

namespace pdserve_vec {

// The ISA the 16-lane paths were built for: "avx512", "avx2", or "scalar" (plain loops).
inline const char* vector_isa() {
#ifdef PDSERVE_VEC16
  return PDSERVE_VEC16_ISA;
#else
  return "scalar";
#endif
}

// The largest of x[0..n) (16 lanes where PDSERVE_VEC16), widened to fp32; -inf for n == 0.
// A NaN may or may not win (max16 keeps its second operand when either is NaN).
template <typename T>
inline float row_max(const T* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#ifdef PDSERVE_VEC16
  vec16 acc = set16(m);
  for (; i + 16 <= n; i += 16) acc = max16(acc, load16(x + i));
  m = hmax16(acc);
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    m = m < v ? v : m;
  }
  return m;
}

// x[i] = exp(x[i] - m) for i < n, with libmvec's expf (16 lanes where PDSERVE_VEC16); returns
// their sum, in a fixed order.
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.f;
#ifdef PDSERVE_VEC16
  vec16 acc = zero16();
  const vec16 mv = set16(m);
  for (; i + 16 <= n; i += 16) {
    const vec16 e = exp16(sub16(load16(x + i), mv));
    store16(x + i, e);
    acc = add16(acc, e);
  }
  total = sum16(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

}  // namespace pdserve_vec
