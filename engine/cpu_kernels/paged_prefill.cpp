// Paged prefill attention on the CPU in bf16, reading K/V from the engine's pool: AMX-BF16
// tiles where the compiler targets AMX (Sapphire Rapids and later), AVX512-BF16's vdpbf16ps
// elsewhere (Cooper Lake, Zen 4); the two share everything but the two matrix products.
//
// Query rows of one or more sequences (whole prompts or chunks after a cached context),
// causal, over a bf16 pool; head_dim a multiple of 32. No sliding window, no soft cap, no
// other dtype: the torch backend keeps its gather + SDPA path for those (and on CPUs without
// AVX512-BF16, where this op is not built: `cpu_kernels.prefills_in_place`).
// Contract and reference: `paged_prefill` in engine/cpu_kernels/__init__.py and the torch
// backend's `_prefill` (gather + SDPA) it replaces.
//
// Two phases, each over ATen's intra-op threads:
//  1. per (sequence, kv head): its keys and values, read once from their blocks, are packed
//     as AMX B operands (also vdpbf16ps's second operands, 16 lanes at a time): K^T in
//     32-bit pairs (scores = Q K^T), V in row pairs (out = P V), zero past the sequence's end.
//  2. per (sequence, query head, tile of 16 query tokens), the longest first: the tile's
//     scores against every key it sees (16 x 16 tiles, fp32), then the softmax of each row in
//     fp32 (exact max, libmvec exp; keys past the row's position masked), the probabilities
//     rounded to bf16 (as torch's CPU flash attention does before its P V product), then
//     P V accumulated in fp32 tiles and divided by the row's sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDSERVE_PREFILL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

using pdserve_vec::exp16;
using pdserve_vec::load16;
using pdserve_vec::vec16;

constexpr int64_t kTile = 16;  // rows of every tile; keys per score tile; query tokens per item

#if PDSERVE_PREFILL_AMX
constexpr const char* kIsa = "amx";

// Linux hands out AMX tile state only after a process asks (once).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes: A (16 x 32 bf16), B (16 x 32 bf16 pairs), C (16 x 16 fp32).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = kTile;
  }
};
#else
constexpr const char* kIsa = "avx512_bf16";
#endif

using bf16 = c10::BFloat16;

struct Sequence {
  int64_t q_start, q_len, seq_len;  // query rows [q_start, q_start + q_len) are positions seq_len - q_len ..
  const int32_t* table;
};

// Packed operands of one (sequence, kv head), in a buffer the call owns.
struct Packed {
  uint16_t* k;  // [key blocks of 16][D / 32][16 dim pairs][16 keys][2]
  uint16_t* v;  // [key pairs of 32][D / 16][16 key pairs][16 dims][2]
};

// Element counts of a sequence's packed K and V (per kv head).
inline int64_t packed_k_size(int64_t n, int64_t D) { return (n + 15) / 16 * D * 16; }
inline int64_t packed_v_size(int64_t n, int64_t D) { return (n + 31) / 32 * D * 32; }

// Scratch that lives as long as its thread and only grows: the buffers are rewritten on every
// call, and fresh allocations of this size cost page faults on every touch.
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Keys in blocks of 16 (the pool's block size is a multiple of 16, so a block's 16 rows are
// consecutive in one page): each 32-dim chunk becomes K^T in 32-bit pairs, one gather of
// the 16 keys' pair r per output row. Rows past the sequence's end hold whatever the block
// holds; their scores are never read. Values in blocks of 32 keys, each pair of rows
// interleaved per 16-dim chunk; rows past the end are zero (P = 0 must not meet a NaN).
void pack(const Sequence& s, const uint16_t* pool, int64_t h, int64_t D, int64_t B, int64_t L, int64_t layer,
          int64_t block, int64_t page, int64_t row, const Packed& out) {
  const int64_t n = s.seq_len, k_blocks = (n + 15) / 16;
  std::fill(out.v, out.v + packed_v_size(n, D), 0);
  auto row_at = [&](int64_t key, int64_t kv) {
    return pool + s.table[key / B] * block + ((h * L + layer) * 2 + kv) * page + (key % B) * row;
  };
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(row * sizeof(uint16_t))));
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* first = row_at(kb * 16, 0);
    uint16_t* dst = out.k + kb * D * 16;
    for (int64_t pair = 0; pair < D / 2; ++pair)  // chunk pair / 16, row pair % 16
      _mm512_storeu_si512(dst + (pair / 16) * 512 + (pair % 16) * 32,
                          _mm512_i32gather_epi32(offsets, first + 2 * pair, 1));
  }
  for (int64_t key = 0; key < n; key += 2) {
    const uint16_t* a = row_at(key, 1);
    const uint16_t* b = key + 1 < n ? row_at(key + 1, 1) : nullptr;
    uint16_t* dst = out.v + (key / 32) * D * 32 + ((key % 32) / 2) * 32;
    for (int64_t c = 0; c < D / 16; ++c) {
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c * 16));
      const __m256i vb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c * 16)) : _mm256_setzero_si256();
      const __m256i lo = _mm256_unpacklo_epi16(va, vb), hi = _mm256_unpackhi_epi16(va, vb);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 512), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 512 + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
}

// The two products of one item, each in an AMX and a vdpbf16ps version.
//  score_block: scores[r][0..16) (row stride `width` floats) = the 16 query rows of qbuf
//    (bf16 [16][D]) times one packed key block (k: [D / 32][16 dim pairs][16 keys][2]).
//  probs_times_values: acc[r][0..16 * chunks) (row stride 64 floats) = probs (bf16 [16]
//    [width], zero past each row's keys) times `chunks` 16-dim chunks of the packed values
//    (v: the first chunk of key pair block 0; blocks D * 32 apart, chunks 512 apart), for
//    rows r < `rows` at least (AMX computes all 16; vdpbf16ps stops at the next 4).
#if PDSERVE_PREFILL_AMX
inline void score_block(const uint16_t* qbuf, const uint16_t* k, int64_t D, float* scores, int64_t width) {
  _tile_zero(0);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(1, &qbuf[c * 32], D * sizeof(uint16_t));
    _tile_loadd(2, k + c * 512, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, scores, width * sizeof(float));
}

inline void probs_times_values(const uint16_t* probs, int64_t width, const uint16_t* v, int64_t D,
                               int64_t v_pairs, int64_t chunks, int64_t, float* acc) {
  for (int64_t c = 0; c < chunks; ++c) {
    switch (c) {
      case 0: _tile_zero(4); break;
      case 1: _tile_zero(5); break;
      case 2: _tile_zero(6); break;
      default: _tile_zero(7);
    }
  }
  const int64_t p_stride = width * sizeof(uint16_t);
  for (int64_t kp = 0; kp < v_pairs; ++kp) {
    _tile_loadd(1, &probs[kp * 32], p_stride);
    const uint16_t* vb = v + kp * D * 32;
    _tile_loadd(2, vb, 64);
    _tile_dpbf16ps(4, 1, 2);
    if (chunks > 1) { _tile_loadd(3, vb + 512, 64); _tile_dpbf16ps(5, 1, 3); }
    if (chunks > 2) { _tile_loadd(2, vb + 1024, 64); _tile_dpbf16ps(6, 1, 2); }
    if (chunks > 3) { _tile_loadd(3, vb + 1536, 64); _tile_dpbf16ps(7, 1, 3); }
  }
  const int64_t a_stride = 64 * sizeof(float);
  _tile_stored(4, &acc[0], a_stride);
  if (chunks > 1) _tile_stored(5, &acc[16], a_stride);
  if (chunks > 2) _tile_stored(6, &acc[32], a_stride);
  if (chunks > 3) _tile_stored(7, &acc[48], a_stride);
}
#else
// A bf16 pair as one 32-bit word, broadcast to every lane: vdpbf16ps's first operand.
inline __m512bh pair_at(const uint16_t* pair) {
  int32_t word;
  std::memcpy(&word, pair, sizeof(word));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(word));
}

inline __m512bh load_pairs(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

// 16 accumulators, one per query row; each packed key vector (16 keys' dim pair) meets all 16.
inline void score_block(const uint16_t* qbuf, const uint16_t* k, int64_t D, float* scores, int64_t width) {
  __m512 acc[kTile];
  for (int64_t r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < D / 2; ++pair) {
    const __m512bh keys = load_pairs(k + (pair / 16) * 512 + (pair % 16) * 32);
    for (int64_t r = 0; r < kTile; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], pair_at(&qbuf[r * D + 2 * pair]), keys);
  }
  for (int64_t r = 0; r < kTile; ++r) _mm512_storeu_ps(scores + r * width, acc[r]);
}

// Four rows x `Chunks` 16-dim chunks of accumulators; each packed value vector (one key pair,
// 16 dims) meets the four rows' probability pairs.
template <int Chunks>
inline void probs_times_values_rows(const uint16_t* probs, int64_t width, const uint16_t* v, int64_t D,
                                    int64_t v_pairs, int64_t rows, float* acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    __m512 a[4][Chunks];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < Chunks; ++c) a[r][c] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < v_pairs; ++kp)
      for (int64_t j = 0; j < 16; ++j) {
        const uint16_t* vb = v + kp * D * 32 + j * 32;
        __m512bh values[Chunks];
        for (int c = 0; c < Chunks; ++c) values[c] = load_pairs(vb + c * 512);
        for (int r = 0; r < 4; ++r) {
          const __m512bh p = pair_at(&probs[(r0 + r) * width + kp * 32 + 2 * j]);
          for (int c = 0; c < Chunks; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], p, values[c]);
        }
      }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(&acc[(r0 + r) * 64 + c * 16], a[r][c]);
  }
}

inline void probs_times_values(const uint16_t* probs, int64_t width, const uint16_t* v, int64_t D,
                               int64_t v_pairs, int64_t chunks, int64_t rows, float* acc) {
  if (chunks == 4) probs_times_values_rows<4>(probs, width, v, D, v_pairs, rows, acc);
  else probs_times_values_rows<2>(probs, width, v, D, v_pairs, rows, acc);  // D % 64 == 32: the last 32 dims
}
#endif

// One item: query head hq's tokens [t0, t0 + 16) of sequence s (rows past q_len are padding).
void tile_item(const Sequence& s, int64_t t0, int64_t hq, const bf16* query, int64_t q_tok,
               int64_t q_head, const Packed& p, int64_t D, float scale, bf16* out, int64_t o_tok,
               uint16_t* qbuf, float* scores, uint16_t* probs, float* acc) {
  const int64_t rows = std::min(kTile, s.q_len - t0);
  const int64_t first_pos = s.seq_len - s.q_len + t0;         // position of the tile's first row
  const int64_t keys = std::min(s.seq_len, first_pos + kTile);  // keys any row of the tile sees
  const int64_t k_blocks = (keys + 15) / 16, v_pairs = (keys + 31) / 32, width = v_pairs * 32;
  // The tile's queries, zero-padded to 16 rows.
  std::fill(qbuf + rows * D, qbuf + kTile * D, 0);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&qbuf[r * D], query + (s.q_start + t0 + r) * q_tok + hq * q_head, D * sizeof(uint16_t));
  // Scores, 16 keys at a time.
  for (int64_t kb = 0; kb < k_blocks; ++kb) score_block(qbuf, p.k + kb * D * 16, D, &scores[kb * 16], width);
  // Softmax of each row over keys 0..its position; probabilities rounded to bf16.
  std::fill(probs, probs + kTile * width, 0);
  float inv[kTile] = {};
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = &scores[r * width];
    const int64_t n = first_pos + r + 1;  // keys this row sees
    const float m = pdserve_vec::row_max(sr, n);
    const vec16 mv = _mm512_set1_ps(m * scale), sv = _mm512_set1_ps(scale);
    vec16 sum = _mm512_setzero_ps();
    uint16_t* pr = &probs[r * width];
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
      const vec16 e = exp16(_mm512_fmsub_ps(load16(sr + k), sv, mv));
      const __m256i eb = pdserve_vec::to_bf16(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + k), eb);
      sum = _mm512_add_ps(sum, pdserve_vec::from_bf16_words(_mm512_cvtepu16_epi32(eb)));
    }
    if (k < n) {
      const __mmask16 live = static_cast<__mmask16>((1u << (n - k)) - 1);
      const vec16 e = _mm512_maskz_mov_ps(live, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, sr + k), sv, mv)));
      const __m256i eb = pdserve_vec::to_bf16(e);
      _mm256_mask_storeu_epi16(pr + k, live, eb);
      sum = _mm512_add_ps(sum, pdserve_vec::from_bf16_words(_mm512_cvtepu16_epi32(eb)));
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // P V, 64 output dims at a time.
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t chunks = std::min<int64_t>(4, (D - d0) / 16);
    probs_times_values(probs, width, p.v + (d0 / 16) * 512, D, v_pairs, chunks, rows, acc);
    for (int64_t r = 0; r < rows; ++r) {
      bf16* dst = out + (s.q_start + t0 + r) * o_tok + hq * D + d0;
      const vec16 iv = _mm512_set1_ps(inv[r]);
      for (int64_t c = 0; c < chunks; ++c) pdserve_vec::store16(dst + c * 16, _mm512_mul_ps(load16(&acc[r * 64 + c * 16]), iv));
    }
  }
}

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_lens, double scale) {
#if PDSERVE_PREFILL_AMX
  TORCH_CHECK(amx_permitted(), "paged_prefill: the kernel did not get AMX tile state from Linux");
#endif
  TORCH_CHECK(scale > 0, "scale: positive");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.scalar_type() == at::kBFloat16,
              "query: bfloat16 [T, Hq, D] with unit last stride");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache: a contiguous bfloat16 6-D pool");
  const int64_t T_ = query.size(0), Hq = query.size(1), D = query.size(2);
  // The pool is [N, Hkv, L, 2, B, D] (engine/kv/kv_pool.py).
  const int64_t N = kv_cache.size(0), Hkv = kv_cache.size(1), L = kv_cache.size(2), B = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == D && D % 32 == 0, "kv_cache: the query's head_dim, a multiple of 32");
  TORCH_CHECK(B % 16 == 0, "kv_cache: a block size that is a multiple of 16");
  TORCH_CHECK(Hq % Hkv == 0, "query heads: a multiple of kv heads");
  TORCH_CHECK(layer >= 0 && layer < L, "layer out of range");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
              block_tables.size(0) == S, "block_tables: int32 [S, max_blocks], unit last stride");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && query_lens.scalar_type() == at::kInt &&
              query_lens.is_contiguous() && query_lens.numel() == S, "seq_lens, query_lens: int32 [S], contiguous");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<Sequence> seqs(S);
  int64_t rows = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(qlens[s] > 0 && qlens[s] <= lens[s], "sequence ", s, ": query_len in 1..seq_len");
    TORCH_CHECK((lens[s] + B - 1) / B <= block_tables.size(1), "sequence ", s, ": table shorter than its blocks");
    const int32_t* table = tables + s * block_tables.stride(0);
    for (int64_t b = 0; b < (lens[s] + B - 1) / B; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < N, "block id ", table[b], " outside the pool of ", N);
    seqs[s] = {rows, qlens[s], lens[s], table};
    rows += qlens[s];
  }
  TORCH_CHECK(rows == T_, "query: as many rows as query_lens sum to");
  at::Tensor out = at::empty({T_, Hq, D}, query.options());
  const uint16_t* pool = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr());
  const int64_t row = D, page = B * row, block = Hkv * L * 2 * page, G = Hq / Hkv;

  // Phase 1: each (sequence, kv head)'s packed K and V, in one buffer of the calling thread.
  std::vector<Packed> packed(S * Hkv);
  std::vector<int64_t> offset(S + 1, 0);
  for (int64_t s = 0; s < S; ++s)
    offset[s + 1] = offset[s] + Hkv * (packed_k_size(lens[s], D) + packed_v_size(lens[s], D));
  thread_local std::vector<uint16_t> packed_buffer;
  uint16_t* buffer = scratch(packed_buffer, offset[S]);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < Hkv; ++h) {
      uint16_t* k = buffer + offset[s] + h * (packed_k_size(lens[s], D) + packed_v_size(lens[s], D));
      packed[s * Hkv + h] = {k, k + packed_k_size(lens[s], D)};
    }
  at::parallel_for(0, S * Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pack(seqs[i / Hkv], pool, i % Hkv, D, B, L, layer, block, page, row, packed[i]);
  });

  // Phase 2: items (sequence, query head, 16-token tile), the most keys first, taken as
  // threads free up.
  struct Item { int64_t s, hq, t0, keys; };
  std::vector<Item> items;
  int64_t widest = 0;
  for (int64_t s = 0; s < S; ++s) {
    widest = std::max<int64_t>(widest, (lens[s] + 31) / 32 * 32);
    for (int64_t t0 = 0; t0 < seqs[s].q_len; t0 += kTile)
      for (int64_t hq = 0; hq < Hq; ++hq)
        items.push_back({s, hq, t0, std::min<int64_t>(seqs[s].seq_len, seqs[s].seq_len - seqs[s].q_len + t0 + kTile)});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const bf16* q = query.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  const float sc = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    thread_local std::vector<uint16_t> qbuf, probs;
    thread_local std::vector<float> scores, acc;
    uint16_t* qb = scratch(qbuf, kTile * D);
    uint16_t* pb = scratch(probs, kTile * widest);
    float* sb = scratch(scores, kTile * widest);
    float* ab = scratch(acc, kTile * 64);
#if PDSERVE_PREFILL_AMX
    TileConfig config;
    _tile_loadconfig(&config);
#endif
    for (int64_t k = next++; k < n_items; k = next++) {
      const Item& it = items[k];
      tile_item(seqs[it.s], it.t0, it.hq, q, query.stride(0), query.stride(1), packed[it.s * Hkv + it.hq / G],
                D, sc, o, Hq * D, qb, sb, pb, ab);
    }
#if PDSERVE_PREFILL_AMX
    _tile_release();
#endif
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("prefill_isa() -> str", [] { return std::string(kIsa); });  // "amx" or "avx512_bf16"
  m.def("paged_prefill(Tensor query, Tensor kv_cache, int layer, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
#endif
