// DSpark's ONNX Runtime custom-op library: ai.dspark.MatMulGGUF, Y = X · Wᵀ over a GGUF's own K-quant blocks.
//
// Inputs: X float32 [..., K]; W uint8 [total bytes]: the weight's rows as the GGUF stores them (row n of W is
// output channel n: K/256 blocks of block_q4_K, 144 bytes, or block_q6_K, 210 bytes, in ggml's layout).
// Output: Y float32 [..., N]. Attributes: K, N, segment_rows (ints: rows per segment, summing to N) and
// segment_types (ints: the GGML type id of each segment, 12 = Q4_K, 14 = Q6_K), so projections of one input
// (q/k/v, gate/up) are one node even where their block types differ.
//
// Numerics (llama.cpp's scheme): each row of X is quantized per 256 values to int8 with one fp32 scale
// (amax / 127, round to nearest even) and the int8 sums of each 16; a block's dot product is integer per
// sub-block, scaled by the block's 6-bit (Q4_K) or int8 (Q6_K) sub-block scales, then by the fp16 super-block
// scale times the row's scale, and accumulated in fp32 in a fixed order. Every output element depends on its own
// row of X and its own row of W only, computed the same way whatever the number of rows of the call or the
// threads: results are row-invariant by construction (what exact speculative decoding needs).
//
// Paths: AVX-512 (F, BW, VL, VNNI) where the CPU has it, else AVX2 (+FMA, F16C), else portable C++ (the same integer
// math, fp32 sums in another order; $DSPARK_KERNEL_PATH=avx2 / portable forces one); threads: ONNX Runtime's intra-op pool (KernelContext_ParallelFor) over chunks of output rows.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// the code paths' instruction sets (functions compiled for them, called only where the CPU has them)
#define DSPARK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define DSPARK_AVX2 __attribute__((target("avx2,fma,f16c")))


constexpr int64_t kQK = 256;           // values per K-quant super-block
constexpr int64_t kTypeQ4K = 12;       // GGML type ids
constexpr int64_t kTypeQ6K = 14;
constexpr size_t kQ4KBytes = 144;      // 2 fp16 + 12 scale bytes + 128 nibble bytes
constexpr size_t kQ6KBytes = 210;      // 128 low-nibble bytes + 64 high-bit bytes + 16 int8 scales + fp16
constexpr int64_t kRowsPerTask = 32;   // output rows per parallel task
constexpr int kRowTile = 8;            // rows of X computed per pass over a weight row
constexpr int kPrefetchBlocks = 8;     // weight blocks prefetched ahead of the one being computed

// one super-block of one activation row
struct alignas(64) Q8Block {
  int8_t qs[kQK];
  float d;          // the row's scale for these 256 values
  int16_t bsum[16]; // sum of each 16 quantized values
};

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit minimums (as bytes, little-endian in a uint64)
void q4k_scales(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  *sc = (uint64_t)(a & 0x3f3f3f3fu) | ((uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32);
  *mn = (uint64_t)(b & 0x3f3f3f3fu) | ((uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32);
}

// ---------------------------------------------------------------- activation quantization (per row of X)

void quantize_row_portable(const float* x, Q8Block* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.f;
    for (int i = 0; i < kQK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    y[b].d = amax / 127.f;
    for (int i = 0; i < kQK; ++i) y[b].qs[i] = (int8_t)std::lrint(xb[i] * id);
    for (int s = 0; s < 16; ++s) {
      int t = 0;
      for (int i = 0; i < 16; ++i) t += y[b].qs[16 * s + i];
      y[b].bsum[s] = (int16_t)t;
    }
  }
}

DSPARK_AVX512
void quantize_row_avx512(const float* x, Q8Block* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQK;
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < kQK; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
    const float amax = _mm512_reduce_max_ps(m);
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    y[b].d = amax / 127.f;
    const __m512 vid = _mm512_set1_ps(id);
    for (int i = 0; i < kQK; i += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vid));  // round to nearest even
      _mm_storeu_si128((__m128i*)(y[b].qs + i), _mm512_cvtsepi32_epi8(q));
      y[b].bsum[i / 16] = (int16_t)_mm512_reduce_add_epi32(q);
    }
  }
}

// ---------------------------------------------------------------- dot products, portable

// out[m] = dot(W row, X row m) for the rows of one tile; w: the weight row's blocks
void q4k_rows_portable(const uint8_t* w, int64_t nb, const Q8Block* const* y, int rows, float* out) {
  for (int m = 0; m < rows; ++m) {
    float acc = 0.f, macc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * kQ4KBytes;
      const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
      uint64_t sc, mn;
      q4k_scales(blk + 4, &sc, &mn);
      const uint8_t* qs = blk + 16;
      const Q8Block& q8 = y[m][b];
      int32_t sumi = 0, summ = 0;
      for (int j = 0; j < 8; ++j) {
        const int s = (int)((sc >> (8 * j)) & 0xff), mj = (int)((mn >> (8 * j)) & 0xff);
        int32_t dot = 0;
        for (int i = 0; i < 32; ++i) {
          const int q = (j & 1) ? (qs[32 * (j / 2) + i] >> 4) : (qs[32 * (j / 2) + i] & 15);
          dot += q * q8.qs[32 * j + i];
        }
        sumi += s * dot;
        summ += mj * (q8.bsum[2 * j] + q8.bsum[2 * j + 1]);
      }
      acc += d * q8.d * (float)sumi;
      macc += dmin * q8.d * (float)summ;
    }
    out[m] = acc - macc;
  }
}

void q6k_rows_portable(const uint8_t* w, int64_t nb, const Q8Block* const* y, int rows, float* out) {
  for (int m = 0; m < rows; ++m) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * kQ6KBytes;
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* sc = (const int8_t*)(blk + 192);
      const float d = fp16_to_fp32(load_u16(blk + 208));
      const Q8Block& q8 = y[m][b];
      int32_t sumi = 0;
      for (int h = 0; h < 2; ++h) {
        for (int p = 0; p < 128; p += 16) {  // 16 values share a scale
          int32_t dot = 0;
          for (int i = p; i < p + 16; ++i) {
            const int l = i & 31, quarter = i >> 5;  // quarter 0..3 of this half
            const int low = (quarter & 1) ? ql[64 * h + l + 32] : ql[64 * h + l];
            const int lo4 = (quarter < 2) ? (low & 15) : (low >> 4);
            const int hi2 = (qh[32 * h + l] >> (2 * quarter)) & 3;
            dot += ((lo4 | (hi2 << 4)) - 32) * q8.qs[128 * h + i];
          }
          sumi += sc[8 * h + p / 16] * dot;
        }
      }
      acc += d * q8.d * (float)sumi;
    }
    out[m] = acc;
  }
}

// ---------------------------------------------------------------- dot products, AVX-512 VNNI

// The weight blocks a few ahead (the next rows' where a row ends; past the buffer's end harmless), into L1: the
// hardware prefetcher alone leaves calls of several rows waiting on memory (measured: docs/precision.md).
inline void prefetch_ahead(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(p + o), _MM_HINT_T0);
}

// one block's 256 codes (four registers of 64, in the order of the row's values) times one row's int8 values, each
// 16-bit pair product scaled by its sub-block scale (sv): 16 int32 partial sums
DSPARK_AVX512 inline __m512i block_dot(const __m512i* wv, const __m512i* sv, const Q8Block& q8) {
  __m512i acc = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j)
    acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(wv[j], _mm512_load_si512((const void*)(q8.qs + 64 * j))), sv[j]);
  return acc;
}

// the sum of a row's 16 accumulator lanes minus its 8 correction lanes
DSPARK_AVX512 inline float sum_minus(__m512 acc, __m256 correction) {
  const __m256 lo = _mm512_castps512_ps256(acc);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  const __m256 t = _mm256_sub_ps(_mm256_add_ps(lo, hi), correction);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}

// Both kernels multiply unsigned codes by the row's int8 values in 16-bit pairs (vpmaddubsw: at most 63·127·2, no
// saturation), then by the sub-block scales into 32-bit sums (vpdpwssd); each row keeps a float accumulator of 16
// lanes for the scaled block sums and one of 8 lanes for the minimum (Q4_K) or the +32 code offset (Q6_K), summed
// once at the end.
template <int R>
DSPARK_AVX512
void q4k_rows_avx512(const uint8_t* w, int64_t nb, const Q8Block* const* y, float* out) {
  __m512 facc[R];
  __m256 macc[R];
  for (int m = 0; m < R; ++m) { facc[m] = _mm512_setzero_ps(); macc[m] = _mm256_setzero_ps(); }
  const __m256i low4 = _mm256_set1_epi8(15);
  // 16-bit lane i of a 64-value product covers values 2i, 2i+1: lanes 0..15 take scale 2j, lanes 16..31 scale 2j+1
  const __m512i half = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kQ4KBytes;
    prefetch_ahead(blk + kPrefetchBlocks * kQ4KBytes, kQ4KBytes);
    const float d = _cvtsh_ss(load_u16(blk)), dmin = _cvtsh_ss(load_u16(blk + 2));
    uint64_t sc, mn;
    q4k_scales(blk + 4, &sc, &mn);
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    // minimums as int16, each twice (m0 m0 m1 m1 ...), against the 16 sums of 16
    const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)mn),
                                                                 _mm_cvtsi64_si128((long long)mn)));
    __m512i wv[4], sv[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * j));
      const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      wv[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      sv[j] = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16((short)(2 * j))), sc16);
    }
    for (int m = 0; m < R; ++m) {
      const Q8Block& q8 = y[m][b];
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(wv, sv, q8)), _mm512_set1_ps(d * q8.d), facc[m]);
      const __m256i pm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)q8.bsum), mn16);
      macc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * q8.d), macc[m]);
    }
  }
  for (int m = 0; m < R; ++m) out[m] = sum_minus(facc[m], macc[m]);
}

template <int R>
DSPARK_AVX512
void q6k_rows_avx512(const uint8_t* w, int64_t nb, const Q8Block* const* y, float* out) {
  __m512 facc[R];
  __m256 moff[R];
  for (int m = 0; m < R; ++m) { facc[m] = _mm512_setzero_ps(); moff[m] = _mm256_setzero_ps(); }
  const __m512i low4 = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
  // 16-bit lane i of a 64-value product covers values 2i, 2i+1: scale i/8 of the quarter's four
  const __m512i quarter = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                           1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kQ6KBytes;
    prefetch_ahead(blk + kPrefetchBlocks * kQ6KBytes, kQ6KBytes);
    const float d = _cvtsh_ss(load_u16(blk + 208));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));
    const __m512i sc16z = _mm512_castsi256_si512(sc16);
    __m512i wv[4], sv[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512((const void*)(blk + 64 * h));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
      const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      const __m512i hi_a = _mm512_slli_epi16(_mm512_and_si512(qh2, two), 4);
      const __m512i hi_b = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh2, 4), two), 4);
      wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), hi_a);                              // values 0..63
      wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), hi_b);    // values 64..127
      sv[2 * h] = _mm512_permutexvar_epi16(_mm512_add_epi16(quarter, _mm512_set1_epi16((short)(8 * h))), sc16z);
      sv[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(quarter, _mm512_set1_epi16((short)(8 * h + 4))), sc16z);
    }
    for (int m = 0; m < R; ++m) {
      const Q8Block& q8 = y[m][b];
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(wv, sv, q8)), _mm512_set1_ps(d * q8.d), facc[m]);
      // the codes are stored +32: subtract 32 · Σ scale · (sum of each 16)
      const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)q8.bsum), sc16);
      moff[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.f * d * q8.d), moff[m]);
    }
  }
  for (int m = 0; m < R; ++m) out[m] = sum_minus(facc[m], moff[m]);
}

// ---------------------------------------------------------------- dot products, AVX2 (CPUs without AVX-512 VNNI)

DSPARK_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

DSPARK_AVX2 void quantize_row_avx2(const float* x, Q8Block* y, int64_t nb) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQK;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < kQK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    y[b].d = amax / 127.f;
    const __m256 vid = _mm256_set1_ps(id);
    for (int i = 0; i < kQK; i += 32) {
      __m256i q[4];
      for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * k), vid));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256((__m256i*)(y[b].qs + i), packed);
      for (int h = 0; h < 2; ++h) {
        const __m256i t = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        y[b].bsum[i / 16 + h] = (int16_t)_mm_cvtsi128_si32(t4);
      }
    }
  }
}

// 32 unsigned codes times 32 int8 values, in 16-bit pairs, then by a scale per 16 values (lo: values 0..15)
DSPARK_AVX2 inline __m256i dot32(__m256i codes, const int8_t* y, __m256i scales) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i*)y)), scales);
}

DSPARK_AVX2 inline __m256i two_scales(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

DSPARK_AVX2 void q4k_rows_avx2(const uint8_t* w, int64_t nb, const Q8Block* const* y, int rows, float* out) {
  __m256 facc[kRowTile], macc[kRowTile];
  for (int m = 0; m < rows; ++m) { facc[m] = _mm256_setzero_ps(); macc[m] = _mm256_setzero_ps(); }
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kQ4KBytes;
    prefetch_ahead(blk + kPrefetchBlocks * kQ4KBytes, kQ4KBytes);
    const float d = _cvtsh_ss(load_u16(blk)), dmin = _cvtsh_ss(load_u16(blk + 2));
    uint64_t sc, mn;
    q4k_scales(blk + 4, &sc, &mn);
    const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)mn),
                                                                 _mm_cvtsi64_si128((long long)mn)));
    __m256i lo[4], hi[4], slo[4], shi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * j));
      lo[j] = _mm256_and_si256(q, low4);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      const int s0 = (int)((sc >> (16 * j)) & 0xff), s1 = (int)((sc >> (16 * j + 8)) & 0xff);
      slo[j] = two_scales(s0, s0);
      shi[j] = two_scales(s1, s1);
    }
    for (int m = 0; m < rows; ++m) {
      const Q8Block& q8 = y[m][b];
      __m256i acc = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        acc = _mm256_add_epi32(acc, dot32(lo[j], q8.qs + 64 * j, slo[j]));
        acc = _mm256_add_epi32(acc, dot32(hi[j], q8.qs + 64 * j + 32, shi[j]));
      }
      facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(d * q8.d), facc[m]);
      const __m256i pm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)q8.bsum), mn16);
      macc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * q8.d), macc[m]);
    }
  }
  for (int m = 0; m < rows; ++m) out[m] = hsum256(_mm256_sub_ps(facc[m], macc[m]));
}

DSPARK_AVX2 void q6k_rows_avx2(const uint8_t* w, int64_t nb, const Q8Block* const* y, int rows, float* out) {
  __m256 facc[kRowTile], moff[kRowTile];
  for (int m = 0; m < rows; ++m) { facc[m] = _mm256_setzero_ps(); moff[m] = _mm256_setzero_ps(); }
  const __m256i low4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kQ6KBytes;
    prefetch_ahead(blk + kPrefetchBlocks * kQ6KBytes, kQ6KBytes);
    const float d = _cvtsh_ss(load_u16(blk + 208));
    const int8_t* sc = (const int8_t*)(blk + 192);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
    __m256i codes[8], scales[8];  // 32 values each, in order
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
      const __m256i lows[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
      for (int k = 0; k < 4; ++k) {
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), two), 4);
        codes[4 * h + k] = _mm256_or_si256(lows[k], high);
        scales[4 * h + k] = two_scales(sc[8 * h + 2 * k], sc[8 * h + 2 * k + 1]);
      }
    }
    for (int m = 0; m < rows; ++m) {
      const Q8Block& q8 = y[m][b];
      __m256i acc = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) acc = _mm256_add_epi32(acc, dot32(codes[c], q8.qs + 32 * c, scales[c]));
      facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(d * q8.d), facc[m]);
      const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)q8.bsum), sc16);
      moff[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.f * d * q8.d), moff[m]);
    }
  }
  for (int m = 0; m < rows; ++m) out[m] = hsum256(_mm256_sub_ps(facc[m], moff[m]));
}

using RowsFn = void (*)(const uint8_t*, int64_t, const Q8Block* const*, int, float*);
using TileFn = void (*)(const uint8_t*, int64_t, const Q8Block* const*, float*);

// the AVX-512 kernels for 1..kRowTile rows, each with its accumulators in registers
template <int R>
void q4k_tile(const uint8_t* w, int64_t nb, const Q8Block* const* y, float* out) { q4k_rows_avx512<R>(w, nb, y, out); }
template <int R>
void q6k_tile(const uint8_t* w, int64_t nb, const Q8Block* const* y, float* out) { q6k_rows_avx512<R>(w, nb, y, out); }

const TileFn kQ4KTiles[kRowTile] = {q4k_tile<1>, q4k_tile<2>, q4k_tile<3>, q4k_tile<4>,
                                    q4k_tile<5>, q4k_tile<6>, q4k_tile<7>, q4k_tile<8>};
const TileFn kQ6KTiles[kRowTile] = {q6k_tile<1>, q6k_tile<2>, q6k_tile<3>, q6k_tile<4>,
                                    q6k_tile<5>, q6k_tile<6>, q6k_tile<7>, q6k_tile<8>};

void q4k_rows_avx512_any(const uint8_t* w, int64_t nb, const Q8Block* const* y, int rows, float* out) {
  kQ4KTiles[rows - 1](w, nb, y, out);
}
void q6k_rows_avx512_any(const uint8_t* w, int64_t nb, const Q8Block* const* y, int rows, float* out) {
  kQ6KTiles[rows - 1](w, nb, y, out);
}
using QuantFn = void (*)(const float*, Q8Block*, int64_t);

struct Paths {
  QuantFn quantize;
  RowsFn q4k, q6k;
  const char* name;
};

const Paths& paths() {
  static const Paths p = [] {
    __builtin_cpu_init();
    // $DSPARK_KERNEL_PATH=avx2 / portable: the tests' way to check those paths on a CPU that has AVX-512 VNNI
    const char* forced = std::getenv("DSPARK_KERNEL_PATH");
    const std::string want = forced != nullptr ? forced : "";
    if (want.empty() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma")) {
      return Paths{quantize_row_avx512, q4k_rows_avx512_any, q6k_rows_avx512_any, "avx512-vnni"};
    }
    if ((want.empty() || want == "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return Paths{quantize_row_avx2, q4k_rows_avx2, q6k_rows_avx2, "avx2"};
    }
    return Paths{quantize_row_portable, q4k_rows_portable, q6k_rows_portable, "portable"};
  }();
  return p;
}

// ---------------------------------------------------------------- the kernel

struct Segment {
  int64_t first_row, rows, type;
  size_t offset, row_bytes;  // byte offset of the segment in W; bytes per row
};

struct MatMulGGUFKernel {
  int64_t K, N;
  std::vector<Segment> segments;
  size_t total_bytes = 0;

  MatMulGGUFKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    const std::vector<int64_t> rows = ki.GetAttributes<int64_t>("segment_rows");
    const std::vector<int64_t> types = ki.GetAttributes<int64_t>("segment_types");
    const std::string node = ki.GetNodeName();
    if (K <= 0 || K % kQK != 0) throw std::invalid_argument(node + ": K must be a positive multiple of 256");
    if (rows.empty() || rows.size() != types.size())
      throw std::invalid_argument(node + ": segment_rows and segment_types must be non-empty and of one length");
    int64_t first = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (types[i] != kTypeQ4K && types[i] != kTypeQ6K)
        throw std::invalid_argument(node + ": segment type " + std::to_string(types[i]) + " is not Q4_K (12) or Q6_K (14)");
      const size_t rb = (size_t)(K / kQK) * (types[i] == kTypeQ4K ? kQ4KBytes : kQ6KBytes);
      segments.push_back(Segment{first, rows[i], types[i], total_bytes, rb});
      total_bytes += rb * (size_t)rows[i];
      first += rows[i];
    }
    if (first != N) throw std::invalid_argument(node + ": segment_rows sum to " + std::to_string(first) + ", not N");
  }

  struct Job {
    const MatMulGGUFKernel* k;
    const uint8_t* w;
    const Q8Block* y;  // [rows][K/256]
    int64_t rows;
    float* out;        // [rows][N]
  };

  static void run_task(void* data, size_t task) {
    const Job& j = *static_cast<const Job*>(data);
    const MatMulGGUFKernel& k = *j.k;
    const int64_t nb = k.K / kQK;
    const int64_t n0 = (int64_t)task * kRowsPerTask, n1 = std::min(k.N, n0 + kRowsPerTask);
    const Paths& p = paths();
    const Q8Block* yrows[kRowTile];
    float vals[kRowTile];
    for (int64_t m0 = 0; m0 < j.rows; m0 += kRowTile) {
      const int tile = (int)std::min<int64_t>(kRowTile, j.rows - m0);
      for (int t = 0; t < tile; ++t) yrows[t] = j.y + (m0 + t) * nb;
      for (int64_t n = n0; n < n1; ++n) {
        const Segment* s = &k.segments[0];
        while (n >= s->first_row + s->rows) ++s;
        const uint8_t* wrow = j.w + s->offset + (size_t)(n - s->first_row) * s->row_bytes;
        (s->type == kTypeQ4K ? p.q4k : p.q6k)(wrow, nb, yrows, tile, vals);
        for (int t = 0; t < tile; ++t) j.out[(m0 + t) * k.N + n] = vals[t];
      }
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0), w = ctx.GetInput(1);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != K)
      throw std::invalid_argument("MatMulGGUF: X's last dimension must be K = " + std::to_string(K));
    if (w.GetTensorTypeAndShapeInfo().GetElementCount() != total_bytes)
      throw std::invalid_argument("MatMulGGUF: W has " + std::to_string(w.GetTensorTypeAndShapeInfo().GetElementCount()) +
                                  " bytes, the segments need " + std::to_string(total_bytes));
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = N;
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (rows == 0) return;
    const int64_t nb = K / kQK;
    thread_local std::vector<Q8Block> q8;
    q8.resize((size_t)(rows * nb));
    const float* xs = x.GetTensorData<float>();
    const Paths& p = paths();
    for (int64_t r = 0; r < rows; ++r) p.quantize(xs + r * K, q8.data() + r * nb, nb);
    Job job{this, w.GetTensorData<uint8_t>(), q8.data(), rows, y.GetTensorMutableData<float>()};
    const size_t tasks = (size_t)((N + kRowsPerTask - 1) / kRowsPerTask);
    ctx.ParallelFor(run_task, tasks, 0, &job);
  }
};

struct MatMulGGUFOp : Ort::CustomOpBase<MatMulGGUFOp, MatMulGGUFKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MatMulGGUFKernel(api, info); }
  const char* GetName() const { return "MatMulGGUF"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  static Ort::Status InferOutputShape(Ort::ShapeInferContext& ctx) {
    Ort::ShapeInferContext::Shape s = ctx.GetInputShape(0);
    if (!s.empty()) s.back() = Ort::ShapeInferContext::SymbolicInteger(ctx.GetAttrInt("N"));
    return ctx.SetOutputShape(0, s);
  }
};

}  // namespace

extern "C" {

// the path the library computes with on this CPU: "avx512-vnni" or "portable"
__attribute__((visibility("default"))) const char* DSparkKernelPath() { return paths().name; }

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                 const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static MatMulGGUFOp op;
  static std::vector<Ort::CustomOpDomain> domains;
  static std::mutex lock;
  Ort::Status status{nullptr};
  try {
    std::lock_guard<std::mutex> guard(lock);
    Ort::CustomOpDomain domain{"ai.dspark"};
    domain.Add(&op);
    Ort::UnownedSessionOptions(options).Add(domain);
    domains.push_back(std::move(domain));  // must outlive every session that uses it
  } catch (const std::exception& e) {
    status = Ort::Status{e};
  }
  return status.release();
}

}  // extern "C"
