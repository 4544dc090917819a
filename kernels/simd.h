/* simd.h: a 16-lane fp32 vector, the unit of the canonical reduction order.
 *
 * Every dot product in the engine is computed the same way (see kernels.h):
 * element i goes to lane i % 16 and is fused-multiply-added into that lane in
 * ascending i (missing tail elements count as 0*0); the 16 lanes are then
 * summed by a fixed tree: lanes l and l+8, then l and l+4, l+2, l+1.
 *
 * Three implementations, chosen when compiling, give that same order:
 * AVX-512 (one zmm), AVX2 (two ymm: lanes 0-7 and 8-15) and portable C
 * (16 floats with fmaf). Only this file knows which one is in use.
 *
 * A 16-lane vector is held in SIMD_PARTS registers ("parts", type vp) of VP_LANES
 * lanes: one zmm, two ymm, or one array of 16 floats. Lanes never mix before the final
 * tree, so the parts of an accumulator are independent chains; matmul computes them in
 * separate passes where registers are few (AVX2 has 16). */
#ifndef SIMD_H
#define SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/isa.h"

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* e4m3 (bias 7) to float, exactly: its bits moved into a float's places (sign; exponent and
 * mantissa from bit 20) stand for the value times 2^-120 (a subnormal too), so one exact product. */
static inline float f8_to_f32(uint8_t x) {
    const uint32_t u = (uint32_t)(x & 0x80u) << 24 | (uint32_t)(x & 0x7Fu) << 20;
    float f;
    memcpy(&f, &u, sizeof f);
    return f * 0x1p120f;
}

#if ISA_AVX512
#include <immintrin.h>
#define SIMD_NAME "avx512"
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline __mmask16 v16_mask(int n) { return (__mmask16)((n >= 16) ? 0xFFFF : ((1u << n) - 1)); }
/* the first n (<= 16) elements; the rest are 0 */
static inline v16 v16_load_f32(const float *p, int n) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(v16_mask(n), p);
}
static inline v16 v16_load_bf16(const bf16 *p, int n) {
    __m256i h = n >= 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(v16_mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
/* the first n (<= 16) int8 values, widened exactly; the rest are 0 */
static inline v16 v16_load_i8(const int8_t *p, int n) {
    __m128i b = n >= 16 ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(v16_mask(n), p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
/* lane l: the 4-bit code at bit 8 * (l % 8) + 4 * (l / 8) of x (kernels.h's int4 order) */
static inline v16 v16_from_4bit(uint64_t x) {
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i shift = _mm512_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24, 4, 12, 20, 28, 4, 12, 20, 28);
    const __m512i words = _mm512_permutexvar_epi32(half, _mm512_castsi128_si512(_mm_cvtsi64_si128((long long)x)));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift), _mm512_set1_epi32(15)));
}
/* lane l: the 2-bit code at bit 8 * (l % 4) + 2 * (l / 4) of x (kernels.h's int2 order):
 * one broadcast and one shift per lane, instead of spreading the codes to bytes */
static inline v16 v16_from_2bit(uint32_t x) {
    const __m512i shift = _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)x), shift), _mm512_set1_epi32(3));
    return _mm512_cvtepi32_ps(codes);
}
/* the first n (<= 16) e4m3 values, exactly (f8_to_f32); the rest are 0 */
static inline v16 v16_load_f8(const uint8_t *p, int n) {
    const __m512i x = _mm512_cvtepu8_epi32(n >= 16 ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(v16_mask(n), p));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

#define SIMD_PARTS 1
enum { VP_LANES = 16 };
typedef __m512 vp;
static inline vp vp_zero(void) { return v16_zero(); }
static inline vp vp_fma(vp a, vp b, vp acc) { return _mm512_fmadd_ps(a, b, acc); }
/* the first n elements, n <= VP_LANES (none when n <= 0); the rest are 0 */
static inline vp vp_load_f32(const float *p, int n) { return n > 0 ? v16_load_f32(p, n) : v16_zero(); }
static inline vp vp_load_bf16(const bf16 *p, int n) { return n > 0 ? v16_load_bf16(p, n) : v16_zero(); }
/* VP_LANES pairs of bf16, as loaded (vpairs); lane l of vp_pairs_first (or _second) is the
 * first (or second) element of pair l, widened by a shift (or a mask): no cross-lane
 * widening instruction, and one load serves both. */
typedef __m512i vpairs;
static inline vpairs vp_load_pairs(const bf16 *p) { return _mm512_loadu_si512(p); }
static inline vp vp_pairs_first(vpairs v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline vp vp_pairs_second(vpairs v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline v16 v16_from_parts(const vp parts[SIMD_PARTS]) { return parts[0]; }
static inline v16 v16_fma(v16 a, v16 b, v16 acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v16_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
static inline v16 v16_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
/* to the nearest integer, ties to even */
static inline v16 v16_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* 2^n for integral n in [-126, 127] */
static inline v16 v16_pow2i(v16 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline void v16_store(float *p, v16 v, int n) {
    if (n >= 16)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, v16_mask(n), v);
}
/* lanes l < n of v; the others +0 */
static inline v16 v16_first(v16 v, int n) { return n >= 16 ? v : _mm512_maskz_mov_ps(v16_mask(n), v); }
static inline float v16_reduce(v16 v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* The levels of v16_reduce's tree on two vectors side by side, by shuffles:
 * fold8(a, b) = [a l+(l+8) ; b l+(l+8)], l < 8;
 * fold4(a, b), a and b two fold8 results: 128-bit block k holds the 4 sums l+(l+4) of
 *   the k-th of their 4 halves (a's two, then b's two);
 * fold2(a, b), two fold4 results: block k = [a's block k l+(l+2) ; b's block k l+(l+2)]. */
/* Lanes 0-7 of a, then of b; lanes 8-15 of a, then of b. */
static inline v16 v16_low_halves(v16 a, v16 b) { return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)); }
static inline v16 v16_high_halves(v16 a, v16 b) { return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)); }
static inline __m512 avx512_fold8(__m512 a, __m512 b) {
    return _mm512_add_ps(v16_low_halves(a, b), v16_high_halves(a, b));
}
static inline __m512 avx512_fold4(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __m512 avx512_fold2(__m512 a, __m512 b) {
    __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

/* p[0..n) (n <= 8, the rest 0) in lanes 0-7 and again in lanes 8-15 */
static inline v16 v16_load_f32_twice8(const float *p, int n) {
    const __m256 h = n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskz_loadu_ps((__mmask8)(n > 0 ? (1u << n) - 1 : 0), p);
    return _mm512_broadcast_f32x8(h);
}

/* v16_reduce16 after its first level: s8[i] = [a(2i) l+(l+8) ; a(2i+1) l+(l+8)], l < 8. */
static inline v16 v16_reduce16_folded(const v16 s8[8]) {
    __m512 s4[4], s2[2];
    for (int i = 0; i < 4; i++) s4[i] = avx512_fold4(s8[2 * i], s8[2 * i + 1]); /* block b: a(4i+b) */
    for (int i = 0; i < 2; i++) s2[i] = avx512_fold2(s4[2 * i], s4[2 * i + 1]); /* block b: a(8i+b), a(8i+b+4) */
    /* block b, element i: a(b + 4i) lane 0 + lane 1 */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r); /* lane j: a(j) */
}

/* out[j] = v16_reduce(a[j]) for j < 8: v16_reduce16's tree on 8 vectors side by side */
static inline void v16_reduce8_store(float *out, const v16 a[8]) {
    __m512 s4[2];
    for (int i = 0; i < 2; i++)
        s4[i] = avx512_fold4(avx512_fold8(a[4 * i], a[4 * i + 1]), avx512_fold8(a[4 * i + 2], a[4 * i + 3]));
    __m512 s2 = avx512_fold2(s4[0], s4[1]); /* block b: [a(b) l+(l+2) ; a(b+4) l+(l+2)], l < 2 */
    /* block b: [a(b), a(b+4), a(b), a(b+4)], each lane 0 + lane 1 */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r))); /* lane j: a(j) */
}

#elif ISA_AVX2
#include <immintrin.h>
#define SIMD_NAME "avx2"
typedef struct {
    __m256 lo, hi;
} v16;
static inline v16 v16_zero(void) {
    v16 v = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return v;
}
static inline __m256i avx2_mask8(int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
static inline v16 v16_load_f32(const float *p, int n) {
    v16 v;
    if (n >= 16) {
        v.lo = _mm256_loadu_ps(p);
        v.hi = _mm256_loadu_ps(p + 8);
        return v;
    }
    v.lo = _mm256_maskload_ps(p, avx2_mask8(n));
    v.hi = n > 8 ? _mm256_maskload_ps(p + 8, avx2_mask8(n - 8)) : _mm256_setzero_ps();
    return v;
}
static inline __m256 avx2_widen8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline v16 v16_load_bf16(const bf16 *p, int n) {
    v16 v;
    if (n >= 16) {
        v.lo = avx2_widen8(_mm_loadu_si128((const __m128i *)p));
        v.hi = avx2_widen8(_mm_loadu_si128((const __m128i *)(p + 8)));
        return v;
    }
    bf16 tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(bf16));
    return v16_load_bf16(tmp, 16);
}
static inline v16 v16_set1(float x) {
    v16 v = {_mm256_set1_ps(x), _mm256_set1_ps(x)};
    return v;
}
static inline v16 v16_load_i8(const int8_t *p, int n) {
    int8_t tmp[16] = {0};
    if (n < 16) memcpy(tmp, p, (size_t)(n > 0 ? n : 0)), p = tmp;
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    v16 v = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    return v;
}
/* lanes 0-7: the low nibbles of x's bytes, lanes 8-15 the high ones; built in registers, as
 * a 16-byte load of bytes just stored would wait for the stores to retire */
static inline v16 v16_from_4bit(uint64_t x) {
    const long long lo = (long long)(x & 0x0F0F0F0F0F0F0F0Full), hi = (long long)((x >> 4) & 0x0F0F0F0F0F0F0F0Full);
    v16 v = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(lo))),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(hi)))};
    return v;
}
static inline v16 v16_from_2bit(uint32_t x) {
    const __m256i all = _mm256_set1_epi32((int)x), three = _mm256_set1_epi32(3);
    const __m256i s0 = _mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26),
                  s1 = _mm256_setr_epi32(4, 12, 20, 28, 6, 14, 22, 30);
    v16 v = {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(all, s0), three)),
             _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(all, s1), three))};
    return v;
}
static inline __m256 f8x8_to_ps(__m128i b) {
    const __m256i x = _mm256_cvtepu8_epi32(b);
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24),
                                         _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}
static inline v16 v16_load_f8(const uint8_t *p, int n) {
    uint8_t tmp[16] = {0};
    if (n < 16) memcpy(tmp, p, (size_t)(n > 0 ? n : 0)), p = tmp;
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    v16 v = {f8x8_to_ps(b), f8x8_to_ps(_mm_srli_si128(b, 8))};
    return v;
}
static inline v16 v16_fma(v16 a, v16 b, v16 acc) {
    acc.lo = _mm256_fmadd_ps(a.lo, b.lo, acc.lo);
    acc.hi = _mm256_fmadd_ps(a.hi, b.hi, acc.hi);
    return acc;
}
static inline v16 v16_add(v16 a, v16 b) {
    v16 v = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
    return v;
}
static inline v16 v16_sub(v16 a, v16 b) {
    v16 v = {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
    return v;
}
static inline v16 v16_mul(v16 a, v16 b) {
    v16 v = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
    return v;
}
static inline v16 v16_max(v16 a, v16 b) {
    v16 v = {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
    return v;
}
static inline v16 v16_min(v16 a, v16 b) {
    v16 v = {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
    return v;
}
static inline v16 v16_div(v16 a, v16 b) {
    v16 v = {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
    return v;
}
static inline __m256 avx2_round(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline v16 v16_round(v16 a) {
    v16 v = {avx2_round(a.lo), avx2_round(a.hi)};
    return v;
}
static inline __m256 avx2_pow2i(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline v16 v16_pow2i(v16 n) {
    v16 v = {avx2_pow2i(n.lo), avx2_pow2i(n.hi)};
    return v;
}
static inline void v16_store(float *p, v16 v, int n) {
    if (n >= 16) {
        _mm256_storeu_ps(p, v.lo);
        _mm256_storeu_ps(p + 8, v.hi);
        return;
    }
    _mm256_maskstore_ps(p, avx2_mask8(n), v.lo);
    if (n > 8) _mm256_maskstore_ps(p + 8, avx2_mask8(n - 8), v.hi);
}
static inline v16 v16_first(v16 v, int n) {
    if (n >= 16) return v;
    v.lo = _mm256_and_ps(v.lo, _mm256_castsi256_ps(avx2_mask8(n)));
    v.hi = n > 8 ? _mm256_and_ps(v.hi, _mm256_castsi256_ps(avx2_mask8(n - 8))) : _mm256_setzero_ps();
    return v;
}

#define SIMD_PARTS 2
enum { VP_LANES = 8 };
typedef __m256 vp;
static inline vp vp_zero(void) { return _mm256_setzero_ps(); }
static inline vp vp_fma(vp a, vp b, vp acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline vp vp_load_f32(const float *p, int n) {
    if (n >= 8) return _mm256_loadu_ps(p);
    return n > 0 ? _mm256_maskload_ps(p, avx2_mask8(n)) : _mm256_setzero_ps();
}
static inline vp vp_load_bf16(const bf16 *p, int n) {
    if (n >= 8) return avx2_widen8(_mm_loadu_si128((const __m128i *)p));
    bf16 tmp[8] = {0};
    if (n > 0) memcpy(tmp, p, (size_t)n * sizeof(bf16));
    return avx2_widen8(_mm_loadu_si128((const __m128i *)tmp));
}
typedef __m256i vpairs;
static inline vpairs vp_load_pairs(const bf16 *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vp vp_pairs_first(vpairs v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline vp vp_pairs_second(vpairs v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline v16 v16_from_parts(const vp parts[SIMD_PARTS]) {
    v16 v = {parts[0], parts[1]};
    return v;
}

static inline float v16_reduce(v16 v) {
    __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* avx2_reduce8 after its first level: s8[i] = a(i)'s l + (l+8), l < 8. */
static inline __m256 avx2_reduce8_folded(const __m256 s8[8]) {
    __m256 s4[4], s2[2];
    for (int i = 0; i < 4; i++) /* [a(2i) l+(l+4) ; a(2i+1) l+(l+4)], l < 4 */
        s4[i] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * i], s8[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(s8[2 * i], s8[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) { /* 128-bit half b: [a(4i+b) l+(l+2) ; a(4i+b+2) l+(l+2)], l < 2 */
        __m256d x = _mm256_castps_pd(s4[2 * i]), y = _mm256_castps_pd(s4[2 * i + 1]);
        s2[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    /* half b, element e: a(b + 2e) lane 0 + lane 1 */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* lane j: a(j) */
}

/* v16_reduce of a[0..7] side by side, by shuffles: the same tree (l + l+8, + l+4, + l+2,
 * + l+1) for each, so each lane equals v16_reduce bit for bit. */
static inline __m256 avx2_reduce8(const v16 a[8]) {
    __m256 s8[8];
    for (int i = 0; i < 8; i++) s8[i] = _mm256_add_ps(a[i].lo, a[i].hi); /* a(i): l + (l+8), l < 8 */
    return avx2_reduce8_folded(s8);
}

/* Lanes 0-7 of a, then of b; lanes 8-15 of a, then of b. */
static inline v16 v16_low_halves(v16 a, v16 b) {
    v16 v = {a.lo, b.lo};
    return v;
}
static inline v16 v16_high_halves(v16 a, v16 b) {
    v16 v = {a.hi, b.hi};
    return v;
}
/* p[0..n) (n <= 8, the rest 0) in lanes 0-7 and again in lanes 8-15 */
static inline v16 v16_load_f32_twice8(const float *p, int n) {
    const __m256 h = n >= 8 ? _mm256_loadu_ps(p) : n > 0 ? _mm256_maskload_ps(p, avx2_mask8(n)) : _mm256_setzero_ps();
    v16 v = {h, h};
    return v;
}
/* v16_reduce16 after its first level: s8[i] = [a(2i) l+(l+8) ; a(2i+1) l+(l+8)], l < 8. */
static inline v16 v16_reduce16_folded(const v16 s8[8]) {
    __m256 t[16];
    for (int i = 0; i < 8; i++) t[2 * i] = s8[i].lo, t[2 * i + 1] = s8[i].hi;
    v16 r = {avx2_reduce8_folded(t), avx2_reduce8_folded(t + 8)};
    return r;
}
/* out[j] = v16_reduce(a[j]) for j < 8 */
static inline void v16_reduce8_store(float *out, const v16 a[8]) { _mm256_storeu_ps(out, avx2_reduce8(a)); }

#else
#define SIMD_NAME "portable"
typedef struct {
    float x[16];
} v16;
static inline v16 v16_zero(void) {
    v16 v = {{0}};
    return v;
}
static inline v16 v16_load_f32(const float *p, int n) {
    v16 v = {{0}};
    for (int l = 0; l < 16 && l < n; l++) v.x[l] = p[l];
    return v;
}
static inline v16 v16_load_bf16(const bf16 *p, int n) {
    v16 v = {{0}};
    for (int l = 0; l < 16 && l < n; l++) v.x[l] = bf16_to_f32(p[l]);
    return v;
}
static inline v16 v16_load_i8(const int8_t *p, int n) {
    v16 v = {{0}};
    for (int l = 0; l < 16 && l < n; l++) v.x[l] = (float)p[l];
    return v;
}
static inline v16 v16_from_4bit(uint64_t x) {
    v16 v;
    for (int l = 0; l < 16; l++) v.x[l] = (float)((x >> (8 * (l % 8) + 4 * (l / 8))) & 15u);
    return v;
}
static inline v16 v16_from_2bit(uint32_t x) {
    v16 v;
    for (int l = 0; l < 16; l++) v.x[l] = (float)((x >> (8 * (l % 4) + 2 * (l / 4))) & 3u);
    return v;
}
static inline v16 v16_load_f8(const uint8_t *p, int n) {
    v16 v = {{0}};
    for (int l = 0; l < 16 && l < n; l++) v.x[l] = f8_to_f32(p[l]);
    return v;
}
#define SIMD_PARTS 1
enum { VP_LANES = 16 };
typedef v16 vp;
static inline vp vp_zero(void) { return v16_zero(); }
static inline vp vp_load_f32(const float *p, int n) { return v16_load_f32(p, n); }
static inline vp vp_load_bf16(const bf16 *p, int n) { return v16_load_bf16(p, n); }
typedef struct {
    bf16 x[32];
} vpairs;
static inline vpairs vp_load_pairs(const bf16 *p) {
    vpairs v;
    memcpy(v.x, p, sizeof v.x);
    return v;
}
static inline vp vp_pairs_first(vpairs v) {
    vp r;
    for (int l = 0; l < 16; l++) r.x[l] = bf16_to_f32(v.x[2 * l]);
    return r;
}
static inline vp vp_pairs_second(vpairs v) {
    vp r;
    for (int l = 0; l < 16; l++) r.x[l] = bf16_to_f32(v.x[2 * l + 1]);
    return r;
}
static inline v16 v16_from_parts(const vp parts[SIMD_PARTS]) { return parts[0]; }
static inline v16 v16_set1(float x) {
    v16 v;
    for (int l = 0; l < 16; l++) v.x[l] = x;
    return v;
}
static inline v16 v16_fma(v16 a, v16 b, v16 acc) {
    for (int l = 0; l < 16; l++) acc.x[l] = fmaf(a.x[l], b.x[l], acc.x[l]);
    return acc;
}
static inline vp vp_fma(vp a, vp b, vp acc) { return v16_fma(a, b, acc); }
static inline float pow2i_f32(float n) {
    uint32_t u = (uint32_t)((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline v16 v16_add(v16 a, v16 b) {
    for (int l = 0; l < 16; l++) a.x[l] = a.x[l] + b.x[l];
    return a;
}
static inline v16 v16_sub(v16 a, v16 b) {
    for (int l = 0; l < 16; l++) a.x[l] = a.x[l] - b.x[l];
    return a;
}
static inline v16 v16_mul(v16 a, v16 b) {
    for (int l = 0; l < 16; l++) a.x[l] = a.x[l] * b.x[l];
    return a;
}
static inline v16 v16_max(v16 a, v16 b) {
    for (int l = 0; l < 16; l++) a.x[l] = a.x[l] > b.x[l] ? a.x[l] : b.x[l];
    return a;
}
static inline v16 v16_min(v16 a, v16 b) {
    for (int l = 0; l < 16; l++) a.x[l] = a.x[l] < b.x[l] ? a.x[l] : b.x[l];
    return a;
}
static inline v16 v16_div(v16 a, v16 b) {
    for (int l = 0; l < 16; l++) a.x[l] = a.x[l] / b.x[l];
    return a;
}
static inline v16 v16_round(v16 a) {
    for (int l = 0; l < 16; l++) a.x[l] = nearbyintf(a.x[l]);
    return a;
}
static inline v16 v16_pow2i(v16 n) {
    for (int l = 0; l < 16; l++) n.x[l] = pow2i_f32(n.x[l]);
    return n;
}
static inline void v16_store(float *p, v16 v, int n) {
    for (int l = 0; l < 16 && l < n; l++) p[l] = v.x[l];
}
static inline v16 v16_first(v16 v, int n) {
    for (int l = n < 0 ? 0 : n; l < 16; l++) v.x[l] = 0.0f;
    return v;
}
/* x[0] after the tree's levels from `half` down: x[l] + x[l + h] for h = half, half/2 .. 1 */
static inline float portable_tree(float *x, int half) {
    for (int h = half; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) x[l] = x[l] + x[l + h];
    return x[0];
}
static inline float v16_reduce(v16 v) { return portable_tree(v.x, 8); }
/* out[j] = v16_reduce(a[j]) for j < 8 */
static inline void v16_reduce8_store(float *out, const v16 a[8]) {
    for (int j = 0; j < 8; j++) out[j] = v16_reduce(a[j]);
}
/* Lanes 0-7 of a, then of b; lanes 8-15 of a, then of b. */
static inline v16 v16_low_halves(v16 a, v16 b) {
    v16 v;
    for (int l = 0; l < 8; l++) v.x[l] = a.x[l], v.x[8 + l] = b.x[l];
    return v;
}
static inline v16 v16_high_halves(v16 a, v16 b) {
    v16 v;
    for (int l = 0; l < 8; l++) v.x[l] = a.x[8 + l], v.x[8 + l] = b.x[8 + l];
    return v;
}
/* p[0..n) (n <= 8, the rest 0) in lanes 0-7 and again in lanes 8-15 */
static inline v16 v16_load_f32_twice8(const float *p, int n) {
    v16 v;
    for (int l = 0; l < 8; l++) v.x[l] = v.x[8 + l] = l < n ? p[l] : 0.0f;
    return v;
}
/* v16_reduce16 after its first level: s8[i] = [a(2i) l+(l+8) ; a(2i+1) l+(l+8)], l < 8. */
static inline v16 v16_reduce16_folded(const v16 s8[8]) {
    v16 r;
    for (int j = 0; j < 16; j++) {
        float x[8];
        for (int l = 0; l < 8; l++) x[l] = s8[j / 2].x[8 * (j % 2) + l];
        r.x[j] = portable_tree(x, 4);
    }
    return r;
}
#endif

/* r[j] = v16_reduce(a[j]) for 16 vectors at once: the same tree of adds (l + l+8, + l+4,
 * + l+2, + l+1) for every vector, its first level on two vectors' halves side by side,
 * so the result equals v16_reduce bit for bit. */
static inline v16 v16_reduce16(const v16 a[16]) {
    v16 s8[8];
    for (int i = 0; i < 8; i++)
        s8[i] = v16_add(v16_low_halves(a[2 * i], a[2 * i + 1]), v16_high_halves(a[2 * i], a[2 * i + 1]));
    return v16_reduce16_folded(s8);
}

/* e^x for x <= 0 (softmax's shifted scores), within ~2 ulp: x = n ln2 + r, |r| <= ln2/2,
 * e^r by Cephes' expf polynomial, times 2^n. x below -87.3 is taken as -87.3 (e^x ~ 1e-38
 * instead of a denormal or 0). Only correctly rounded IEEE operations (add, mul, fma,
 * round to nearest), so every path gives the same bits. */
static inline v16 v16_exp_nonpositive(v16 x) {
    x = v16_max(x, v16_set1(-87.3f));
    v16 n = v16_round(v16_mul(x, v16_set1(1.44269504088896341f))); /* x / ln2 */
    v16 r = v16_fma(n, v16_set1(-0.693359375f), x);                /* x - n ln2, ln2 in two parts */
    r = v16_fma(n, v16_set1(2.12194440e-4f), r);
    v16 p = v16_set1(1.9875691500e-4f);
    p = v16_fma(p, r, v16_set1(1.3981999507e-3f));
    p = v16_fma(p, r, v16_set1(8.3334519073e-3f));
    p = v16_fma(p, r, v16_set1(4.1665795894e-2f));
    p = v16_fma(p, r, v16_set1(1.6666665459e-1f));
    p = v16_fma(p, r, v16_set1(5.0000001201e-1f));
    v16 er = v16_add(v16_fma(p, v16_mul(r, r), r), v16_set1(1.0f)); /* 1 + r + r^2 p(r) */
    return v16_mul(er, v16_pow2i(n));
}

#endif /* SIMD_H */
