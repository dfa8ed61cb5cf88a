/* The e4m3x16 KV codec's CPU kernels (engine_adapter/e4m3x16_native.py loads them).
 *
 * One fused pass each way, over rows of contiguous values given by offset arrays (a row is a
 * run of whole 16-value groups; the Python side cuts strided views of the paged cache into
 * rows, so whole blocks and layer ranges go in one call):
 *
 *   quantise:   per group of 16: amax -> bf16 scale (amax / 448 rounded up) -> 16 e4m3 bytes
 *               (x * (1 / scale), round to nearest even, saturating at 448)
 *   dequantise: per byte: e4m3 bits -> fp32 (exact) * scale (exact) -> bf16 / fp16 / fp32
 *
 * The results are bit for bit those of the torch path in kv_format.py (the reference of the
 * semantics; tests/engine_adapter/test_e4m3x16_native.py compares them for every kernel
 * below): every step is an exact operation or one IEEE rounding to nearest even that both
 * sides make.
 *
 * Kernels, by level (the `simd` argument: the highest level a call may use; e4m3x16_simd()
 * says which this CPU runs; every level gives the same bits):
 * 0 portable: plain C99 loops over one group, which a compiler vectorises within the group
 *   (gcc 12 -O3 -march=native: one group per iteration, never across groups); no intrinsics,
 *   no _Float16, so it builds and runs anywhere.
 * 1 AVX-512 (F, BW, DQ, VBMI; x86-64, found at run time by __builtin_cpu_supports, so a
 *   build without -march=native has it too): a group of 16 fp32 is one zmm register, and a
 *   step takes 16 groups. What is not lane-parallel is done for 16 groups at once: a tree of
 *   shuffles and maxes (16-bit lanes for bf16 and fp16 sources, two groups a register)
 *   leaves group g's amax in lane g, and the scales' two IEEE divisions run on that vector,
 *   one step ahead of the encoding (software-pipelined: the encoding never waits on them).
 *   The e4m3 rounding is a float add of a per-value magic number (see magnitude_codes), two
 *   groups' codes are gathered by one byte permute and their signs added under a mask.
 *   Dequantising is lane-parallel as it stands: 16 groups' multipliers at once, then per
 *   group widen, shift, mask, multiply, round.
 * 2 the same, with AVX512_BF16's vcvtne2ps2bf16 rounding bf16 output, two groups in one
 *   instruction (it flushes subnormal results to zero, so blocks whose scales could give
 *   them take level 1's exact integer rounding).
 * Intrinsics rather than a plain-C formulation because the gains come from across groups
 * (the max tree, the pipelined scales, the byte permute), which no compiler found here.
 */
#include <stdint.h>
#include <string.h>

#define GROUP 16
#define SCALE_NAN 0x7FC0u        /* bf16's NaN, as torch writes it */
#define MIN_SCALE_BITS 0x00800000u /* 2^-126 (fp32 bits): kv_format.MIN_SCALE */
#define MAX_SCALE_BITS 0x43000000u /* 2^7: kv_format.MAX_SCALE */

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FLOAT16 = 2 };

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp16 bits -> fp32, exact, subnormals included (c10's fp16_ieee_to_fp32_value). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | f32_bits(two_w < (1u << 27) ? denormalized : normalized));
}

/* fp32 -> fp16 bits, round to nearest even (c10's fp16_ieee_from_fp32_value; finite input). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    float base = (bits_f32(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    uint32_t bits = f32_bits(bits_f32((bias >> 1) + 0x07800000u) + base);
    return (uint16_t)((sign >> 16) | (((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu)));
}

/* fp32 -> bf16 bits, round to nearest even (c10's round_to_nearest_even; finite input). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits = f32_bits(f);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* fp32 -> e4m3fn bits, round to nearest even, |f| <= 448 (c10's algorithm, so torch agrees). */
static inline uint32_t f32_to_e4m3(float f) {
    uint32_t bits = f32_bits(f), sign = bits & 0x80000000u, mag = bits ^ sign;
    /* below 2^-6 (e4m3 subnormals): adding 2^14 rounds to a multiple of 2^-9 */
    uint32_t sub = f32_bits(bits_f32(mag) + bits_f32(141u << 23)) - (141u << 23);
    uint32_t odd = (mag >> 20) & 1u; /* else rebias the exponent, round the mantissa to 3 bits */
    uint32_t normal = (mag + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd) >> 20;
    return ((mag < (121u << 23) ? sub : normal) | (sign >> 24)) & 0xFFu;
}

/* One group's 16 source values as fp32 (exact for every source dtype). */
static inline __attribute__((always_inline)) void load_group(const void *src, int dtype,
                                                             int64_t index, float *x) {
    if (dtype == DTYPE_FLOAT32) {
        memcpy(x, (const float *)src + index, GROUP * sizeof(float));
    } else if (dtype == DTYPE_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src + index;
        for (int i = 0; i < GROUP; i++) x[i] = bits_f32((uint32_t)s[i] << 16);
    } else {
        const uint16_t *s = (const uint16_t *)src + index;
        for (int i = 0; i < GROUP; i++) x[i] = f16_to_f32(s[i]);
    }
}

static inline __attribute__((always_inline)) void store_group(const float *y, void *dst,
                                                              int dtype, int64_t index) {
    if (dtype == DTYPE_FLOAT32) {
        memcpy((float *)dst + index, y, GROUP * sizeof(float));
    } else if (dtype == DTYPE_BFLOAT16) {
        uint16_t *d = (uint16_t *)dst + index;
        for (int i = 0; i < GROUP; i++) d[i] = f32_to_bf16(y[i]);
    } else {
        uint16_t *d = (uint16_t *)dst + index;
        for (int i = 0; i < GROUP; i++) d[i] = f32_to_f16(y[i]);
    }
}

/* The bf16 scale of a group whose largest |value| has fp32 bits amax_bits: amax / 448 (one
 * IEEE division) rounded up to a bf16 (adding 0xFFFF carries unless the low half is zero),
 * clamped to [2^-126, 2^7]; NaN for inf or NaN (their bits are the largest). */
static inline uint32_t scale_bits(uint32_t amax_bits) {
    uint32_t bits = (f32_bits(bits_f32(amax_bits) / 448.0f) + 0xFFFFu) & 0xFFFF0000u;
    bits = bits < MIN_SCALE_BITS ? MIN_SCALE_BITS : (bits > MAX_SCALE_BITS ? MAX_SCALE_BITS : bits);
    return amax_bits >= 0x7F800000u ? SCALE_NAN << 16 : bits;
}

static inline void quantize_group(const float *x, uint8_t *values, uint16_t *scale) {
    uint32_t amax_bits = 0;
    for (int i = 0; i < GROUP; i++) {
        uint32_t mag = f32_bits(x[i]) & 0x7FFFFFFFu; /* |x| orders as its bits; NaN above inf */
        amax_bits = mag > amax_bits ? mag : amax_bits;
    }
    uint32_t bits = scale_bits(amax_bits);
    *scale = (uint16_t)(bits >> 16);
    /* a NaN group's values do not matter (its block is a miss); its inverse is NaN too */
    float inverse = 1.0f / bits_f32(bits), limit = 448.0f;
    uint32_t codes[GROUP]; /* 32-bit lanes first, narrowed after: both loops vectorise whole */
    for (int i = 0; i < GROUP; i++) {
        float scaled = x[i] * inverse;
        scaled = scaled > limit ? limit : (scaled < -limit ? -limit : scaled); /* saturate */
        codes[i] = f32_to_e4m3(scaled);
    }
    for (int i = 0; i < GROUP; i++) values[i] = (uint8_t)codes[i];
}


/* ---- the portable kernel ---- */

static inline __attribute__((always_inline)) void quantize_rows(
    const void *src, int dtype, const int64_t *src_offsets, uint8_t *values,
    const int64_t *value_offsets, uint16_t *scales, const int64_t *scale_offsets, int64_t num_rows,
    int64_t row_values) {
    float x[GROUP];
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t g = 0; g < row_values / GROUP; g++) {
            load_group(src, dtype, src_offsets[r] + g * GROUP, x);
            quantize_group(x, values + value_offsets[r] + g * GROUP, scales + scale_offsets[r] + g);
        }
    }
}

static void quantize_portable(const void *src, int dtype, const int64_t *src_offsets,
                              uint8_t *values, const int64_t *value_offsets, uint16_t *scales,
                              const int64_t *scale_offsets, int64_t num_rows, int64_t row_values) {
    if (dtype == DTYPE_FLOAT32) /* one copy of the loop per dtype: nothing branches inside */
        quantize_rows(src, DTYPE_FLOAT32, src_offsets, values, value_offsets, scales,
                      scale_offsets, num_rows, row_values);
    else if (dtype == DTYPE_BFLOAT16)
        quantize_rows(src, DTYPE_BFLOAT16, src_offsets, values, value_offsets, scales,
                      scale_offsets, num_rows, row_values);
    else
        quantize_rows(src, DTYPE_FLOAT16, src_offsets, values, value_offsets, scales,
                      scale_offsets, num_rows, row_values);
}

/* An e4m3 byte's exponent and mantissa, moved to fp32's places, are the value times 2^-120
 * (subnormals too); one multiply by scale * 2^120 finishes it, exactly (4 significant bits
 * times 8, at least 2^-142: an fp32), then one rounding to the destination dtype. */
static inline float dequantize_multiplier(uint16_t scale) {
    return bits_f32((uint32_t)scale << 16) * 0x1.0p120f; /* exact: the scale is at most 2^7 */
}

static inline __attribute__((always_inline)) void dequantize_rows(
    const uint8_t *values, const int64_t *value_offsets, const uint16_t *scales,
    const int64_t *scale_offsets, void *dst, int dtype, const int64_t *dst_offsets,
    int64_t num_rows, int64_t row_values) {
    float y[GROUP];
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t g = 0; g < row_values / GROUP; g++) {
            const int8_t *v = (const int8_t *)(values + value_offsets[r] + g * GROUP);
            float multiplier = dequantize_multiplier(scales[scale_offsets[r] + g]);
            for (int i = 0; i < GROUP; i++) {
                uint32_t bits = ((uint32_t)(int32_t)v[i] << 20) & 0x87F00000u; /* sign|exp|man */
                y[i] = bits_f32(bits) * multiplier;
            }
            store_group(y, dst, dtype, dst_offsets[r] + g * GROUP);
        }
    }
}

static void dequantize_portable(const uint8_t *values, const int64_t *value_offsets,
                                const uint16_t *scales, const int64_t *scale_offsets, void *dst,
                                int dtype, const int64_t *dst_offsets, int64_t num_rows,
                                int64_t row_values) {
    if (dtype == DTYPE_FLOAT32)
        dequantize_rows(values, value_offsets, scales, scale_offsets, dst, DTYPE_FLOAT32,
                        dst_offsets, num_rows, row_values);
    else if (dtype == DTYPE_BFLOAT16)
        dequantize_rows(values, value_offsets, scales, scale_offsets, dst, DTYPE_BFLOAT16,
                        dst_offsets, num_rows, row_values);
    else
        dequantize_rows(values, value_offsets, scales, scale_offsets, dst, DTYPE_FLOAT16,
                        dst_offsets, num_rows, row_values);
}

/* ---- the AVX-512 kernels ---- */

enum { PORTABLE = 0, AVX512 = 1, AVX512_BF16 = 2 }; /* the kernels, by level */

/* gcc 10 and clang 9 have every intrinsic used here (AVX512_BF16 came last) */
#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10))
#define HAVE_AVX512_KERNELS 1
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx512bf16")))
#define INLINE __attribute__((always_inline)) static inline
#define I32(c) _mm512_set1_epi32((int)(c))
#define PS(v) _mm512_castsi512_ps(v)
#define SI(v) _mm512_castps_si512(v)

/* 16 values from element index i of src as fp32 (exact for every source dtype). */
TARGET INLINE __m512 load16(const void *src, int dtype, int64_t i) {
    if (dtype == DTYPE_FLOAT32) return _mm512_loadu_ps((const float *)src + i);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
    if (dtype == DTYPE_BFLOAT16) return PS(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    return _mm512_cvtph_ps(half); /* exact, subnormals included */
}

/* The e4m3 codes of min(|y|, 448), one in the low byte of each lane (f32_to_e4m3 without its
 * sign, branches or blends). With E the exponent of that magnitude, at least -6, adding
 * magic = 2^(E+20) + 152 u (u = 2^(E-3): the e4m3 spacing in |y|'s binade, or that of the
 * subnormals below 2^-6) rounds it to a multiple of u, to nearest even (152 is even), and
 * leaves 152 + k in the low byte, k = round(|y| / u) (8 + the mantissa, or the subnormal
 * code). The code is 8 (E + 6) + k, and magic >> 20 = 8 E + 1176 adds it (mod 256). */
TARGET INLINE __m512i magnitude_codes(__m512 y) {
    __m512 mag = _mm512_range_ps(y, _mm512_set1_ps(448.0f), 0x0A); /* min(|y|, 448), sign 0 */
    __m512i exponent = _mm512_max_epu32(_mm512_and_si512(SI(mag), I32(0x7F800000)), I32(121u << 23));
    __m512i magic = _mm512_add_epi32(exponent, I32((20u << 23) + 152));
    __m512i sum = SI(_mm512_add_ps(mag, PS(magic)));
    return _mm512_add_epi32(sum, _mm512_srli_epi32(magic, 20));
}

/* One group: x * inverse -> its 16 e4m3 bytes. */
TARGET INLINE __m128i encode16(__m512 x, __m512 inverse) {
    __m512 y = _mm512_mul_ps(x, inverse);
    __m512i codes = magnitude_codes(y); /* | the sign, from bit 31 to bit 7 */
    return _mm512_cvtepi32_epi8(
        _mm512_ternarylogic_epi32(codes, _mm512_srli_epi32(SI(y), 24), I32(0x80), 0xF8));
}

/* Two adjacent groups at element index i of src as fp32, and their signs (bit k: value k). */
TARGET INLINE __mmask32 load_pair(const void *src, int dtype, int64_t i, __m512 *x0, __m512 *x1) {
    if (dtype == DTYPE_FLOAT32) {
        *x0 = _mm512_loadu_ps((const float *)src + i);
        *x1 = _mm512_loadu_ps((const float *)src + i + GROUP);
        return _mm512_kunpackw(_mm512_movepi32_mask(SI(*x1)), _mm512_movepi32_mask(SI(*x0)));
    }
    const uint16_t *half = (const uint16_t *)src + i;
    __m512i raw = _mm512_loadu_si512(half);
    if (dtype == DTYPE_BFLOAT16) { /* bf16 -> fp32: the 16 bits on top, zeros below */
        const __m512i low = _mm512_setr_epi32(0, 1 << 16, 2 << 16, 3 << 16, 4 << 16, 5 << 16,
                                              6 << 16, 7 << 16, 8 << 16, 9 << 16, 10 << 16,
                                              11 << 16, 12 << 16, 13 << 16, 14 << 16, 15 << 16);
        *x0 = PS(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, low, raw));
        *x1 = PS(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, _mm512_add_epi32(low, I32(16 << 16)), raw));
    } else {
        *x0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)half));
        *x1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + GROUP)));
    }
    return _mm512_movepi16_mask(raw);
}

/* Two groups -> their 32 e4m3 bytes: the codes of both (the low byte of each lane) gathered
 * by one byte permute, then the sign added where a value is negative. */
TARGET INLINE __m256i encode_pair(__m512 x0, __m512 x1, __mmask32 negative, float inverse0,
                                  float inverse1) {
    __m512i codes0 = magnitude_codes(_mm512_mul_ps(x0, _mm512_set1_ps(inverse0)));
    __m512i codes1 = magnitude_codes(_mm512_mul_ps(x1, _mm512_set1_ps(inverse1)));
    const __m512i low_bytes = _mm512_set_epi8(
        124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64,
        60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0,
        124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64,
        60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
    __m512i bytes = _mm512_permutex2var_epi8(codes0, low_bytes, codes1);
    bytes = _mm512_mask_add_epi8(bytes, negative, bytes, _mm512_set1_epi8((char)0x80));
    return _mm512_castsi512_si256(bytes);
}

/* The bf16 scales (as fp32 bits) of 16 groups whose |value| maxima are the lanes of amax. */
TARGET INLINE __m512i scale16(__m512i amax) {
    __m512 quotient = _mm512_div_ps(PS(amax), _mm512_set1_ps(448.0f));
    __m512i bits = _mm512_and_si512(_mm512_add_epi32(SI(quotient), I32(0xFFFF)), I32(0xFFFF0000u));
    bits = _mm512_min_epu32(_mm512_max_epu32(bits, I32(MIN_SCALE_BITS)), I32(MAX_SCALE_BITS));
    return _mm512_mask_mov_epi32(bits, _mm512_cmpge_epu32_mask(amax, I32(0x7F800000u)),
                                 I32(SCALE_NAN << 16));
}

/* The amax of 16 groups, one per lane, by a tree of maxes over pairs of registers: each step
 * shuffles two registers' halves (then quarters, pairs, single lanes) so that every lane pair
 * it maxes belongs to one group, halving the registers. Its output order is the 4x4 transpose
 * of its input order: feeding group transposed(p) at position p (fp32), or permuting once at
 * the end (16-bit sources, whose registers hold two groups each), puts group g in lane g. */
static inline int transposed(int g) { return (g & 3) * 4 + (g >> 2); }
#define TRANSPOSE _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
#define HALVES(max, a, b) max(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE))
#define QUARTERS(max, a, b) max(_mm512_shuffle_i64x2(a, b, 0x88), _mm512_shuffle_i64x2(a, b, 0xDD))
#define PAIRS(max, a, b) max(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
#define LANES(max, a, b) max(SI(_mm512_shuffle_ps(PS(a), PS(b), 0x88)), SI(_mm512_shuffle_ps(PS(a), PS(b), 0xDD)))

/* fp32 source: |x| bits per lane (one group a register), 16 -> 8 -> 4 -> 2 -> 1 registers. */
TARGET INLINE __m512i amax16_f32(const float *src) {
    __m512i m[16];
    for (int p = 0; p < 16; p++)
        m[p] = _mm512_and_si512(_mm512_loadu_si512(src + GROUP * transposed(p)), I32(0x7FFFFFFF));
    for (int k = 0; k < 8; k++) m[k] = HALVES(_mm512_max_epu32, m[2 * k], m[2 * k + 1]);
    for (int k = 0; k < 4; k++) m[k] = QUARTERS(_mm512_max_epu32, m[2 * k], m[2 * k + 1]);
    for (int k = 0; k < 2; k++) m[k] = PAIRS(_mm512_max_epu32, m[2 * k], m[2 * k + 1]);
    return LANES(_mm512_max_epu32, m[0], m[1]);
}

/* bf16 or fp16 source: |x| bits as 16-bit lanes, two groups a register (positive bf16 and
 * fp16 values order as their bits too, NaN above inf), 8 -> 4 -> 2 -> 1 registers, then the
 * two halves of each 32-bit lane; converted to fp32 once, 16 maxima at a time (exactly). */
TARGET INLINE __m512i amax16_half(const uint16_t *src, int dtype) {
    __m512i m[8];
    for (int p = 0; p < 8; p++)
        m[p] = _mm512_and_si512(_mm512_loadu_si512(src + 2 * GROUP * p), I32(0x7FFF7FFF));
    for (int k = 0; k < 4; k++) m[k] = QUARTERS(_mm512_max_epu16, m[2 * k], m[2 * k + 1]);
    for (int k = 0; k < 2; k++) m[k] = PAIRS(_mm512_max_epu16, m[2 * k], m[2 * k + 1]);
    __m512i pairs = LANES(_mm512_max_epu16, m[0], m[1]);
    __m512i amax = _mm512_max_epu16(pairs, _mm512_srli_epi32(pairs, 16)); /* in the low half */
    amax = _mm512_permutexvar_epi32(TRANSPOSE, amax);
    if (dtype == DTYPE_BFLOAT16) return _mm512_slli_epi32(amax, 16);
    return SI(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(amax)));
}

TARGET INLINE __m512i amax16(const void *src, int dtype, int64_t i) {
    if (dtype == DTYPE_FLOAT32) return amax16_f32((const float *)src + i);
    return amax16_half((const uint16_t *)src + i, dtype);
}

/* The scales of the 16 groups at element index i of src into scales[0..15], their inverses
 * (1 / scale: NaN for a NaN scale, whose group's values do not matter) into inverse[]. */
TARGET INLINE void scale_block(const void *src, int dtype, int64_t i, uint16_t *scales,
                               float *inverse) {
    __m512i bits = scale16(amax16(src, dtype, i));
    _mm256_storeu_si256((__m256i *)scales, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), PS(bits)));
}

/* One row, 16 groups a step, software-pipelined: the scales of step b + 1 (a chain of about
 * 60 cycles: the max tree, two divisions) are worked out before step b's values are encoded,
 * so that the encoding never waits on them. */
TARGET INLINE void quantize_row_avx512(const void *src, int dtype, int64_t s, uint8_t *values,
                                       uint16_t *scales, int64_t num_groups) {
    float inverses[2][16];
    int64_t num_steps = num_groups / 16;
    if (num_steps) scale_block(src, dtype, s, scales, inverses[0]);
    for (int64_t step = 0; step < num_steps; step++) {
        int64_t g = step * 16;
        if (step + 1 < num_steps)
            scale_block(src, dtype, s + (g + 16) * GROUP, scales + g + 16, inverses[(step + 1) & 1]);
        const float *inverse = inverses[step & 1];
        for (int k = 0; k < 16; k += 2) {
            __m512 x0, x1;
            __mmask32 negative = load_pair(src, dtype, s + (g + k) * GROUP, &x0, &x1);
            _mm256_storeu_si256((__m256i *)(values + (g + k) * GROUP),
                                encode_pair(x0, x1, negative, inverse[k], inverse[k + 1]));
        }
    }
    for (int64_t g = num_steps * 16; g < num_groups; g++) { /* the last groups, one by one */
        __m512 x = load16(src, dtype, s + g * GROUP);
        uint32_t bits = scale_bits(
            (uint32_t)_mm512_reduce_max_epu32(_mm512_and_si512(SI(x), I32(0x7FFFFFFF))));
        scales[g] = (uint16_t)(bits >> 16);
        _mm_storeu_si128((__m128i *)(values + g * GROUP), encode16(x, _mm512_set1_ps(1.0f / bits_f32(bits))));
    }
}

/* One group's e4m3 bytes as fp32 times 2^-120, exactly (see dequantize_multiplier). */
TARGET INLINE __m512 decode16(const uint8_t *values) {
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)values));
    return PS(_mm512_and_si512(_mm512_slli_epi32(v, 20), I32(0x87F00000u))); /* sign|exp|man */
}

/* 16 fp32 -> dtype at element index i of dst, one rounding to nearest even. */
TARGET INLINE void store16(void *dst, int dtype, int64_t i, __m512 y) {
    if (dtype == DTYPE_FLOAT32) {
        _mm512_storeu_ps((float *)dst + i, y);
        return;
    }
    __m256i half;
    if (dtype == DTYPE_BFLOAT16) { /* f32_to_bf16, lane-wise (the results are finite) */
        __m512i bits = SI(y), odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), I32(1));
        half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, I32(0x7FFF)), odd), 16));
    } else { /* IEEE's rounding: c10's fp16_ieee_from_fp32_value for finite values */
        half = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), half);
}

/* The groups [g, g + n) of a row, n <= 16, the multipliers already in multiplier[]. */
TARGET INLINE void dequantize_groups(const uint8_t *values, const float *multiplier, void *dst,
                                     int dtype, int64_t d, int64_t g, int n) {
    for (int k = 0; k < n; k++)
        store16(dst, dtype, d + (g + k) * GROUP,
                _mm512_mul_ps(decode16(values + (g + k) * GROUP), _mm512_set1_ps(multiplier[k])));
}

/* 16 groups' multipliers (scale * 2^120, exact) into multiplier[]; returns their scales'
 * fp32 bits. */
TARGET INLINE __m512i multipliers16(const uint16_t *scales, float *multiplier) {
    __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)scales)), 16);
    _mm512_storeu_ps(multiplier, _mm512_mul_ps(PS(bits), _mm512_set1_ps(0x1.0p120f)));
    return bits;
}

TARGET INLINE void dequantize_row_avx512(const uint8_t *values, const uint16_t *scales, void *dst,
                                         int dtype, int64_t d, int64_t num_groups) {
    float multiplier[16];
    int64_t g = 0;
    for (; g + 16 <= num_groups; g += 16) {
        multipliers16(scales + g, multiplier);
        dequantize_groups(values, multiplier, dst, dtype, d, g, 16);
    }
    int n = (int)(num_groups - g);
    for (int k = 0; k < n; k++) multiplier[k] = dequantize_multiplier(scales[g + k]);
    dequantize_groups(values, multiplier, dst, dtype, d, g, n);
}

/* bf16 out with AVX512_BF16: vcvtne2ps2bf16 rounds two groups to nearest even in one
 * instruction, but flushes subnormal results to zero. A result is subnormal only where the
 * scale is below 2^-117 (|e4m3| >= 2^-9 times a scale >= 2^-117 is a normal bf16), so blocks
 * of 16 groups holding such a scale (all-zero groups, whose scale is 2^-126, among them) take
 * the exact integer rounding. */
TARGET_BF16 INLINE void dequantize_row_bf16(const uint8_t *values, const uint16_t *scales,
                                            uint16_t *dst, int64_t num_groups) {
    float multiplier[16];
    int64_t g = 0;
    for (; g + 16 <= num_groups; g += 16) {
        __m512i bits = multipliers16(scales + g, multiplier);
        if (_mm512_cmplt_epu32_mask(bits, I32(10u << 23))) { /* 2^-117 */
            dequantize_groups(values, multiplier, dst, DTYPE_BFLOAT16, 0, g, 16);
            continue;
        }
        for (int k = 0; k < 16; k += 2) {
            __m512 y0 = _mm512_mul_ps(decode16(values + (g + k) * GROUP), _mm512_set1_ps(multiplier[k]));
            __m512 y1 = _mm512_mul_ps(decode16(values + (g + k + 1) * GROUP), _mm512_set1_ps(multiplier[k + 1]));
            _mm512_storeu_si512(dst + (g + k) * GROUP, (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
        }
    }
    int n = (int)(num_groups - g);
    for (int k = 0; k < n; k++) multiplier[k] = dequantize_multiplier(scales[g + k]);
    dequantize_groups(values, multiplier, dst, DTYPE_BFLOAT16, 0, g, n);
}

TARGET static void quantize_avx512(const void *src, int dtype, const int64_t *src_offsets,
                                   uint8_t *values, const int64_t *value_offsets, uint16_t *scales,
                                   const int64_t *scale_offsets, int64_t num_rows, int64_t row_values) {
    for (int64_t r = 0; r < num_rows; r++) { /* one copy of the row loop per dtype */
        if (dtype == DTYPE_FLOAT32)
            quantize_row_avx512(src, DTYPE_FLOAT32, src_offsets[r], values + value_offsets[r],
                                scales + scale_offsets[r], row_values / GROUP);
        else if (dtype == DTYPE_BFLOAT16)
            quantize_row_avx512(src, DTYPE_BFLOAT16, src_offsets[r], values + value_offsets[r],
                                scales + scale_offsets[r], row_values / GROUP);
        else
            quantize_row_avx512(src, DTYPE_FLOAT16, src_offsets[r], values + value_offsets[r],
                                scales + scale_offsets[r], row_values / GROUP);
    }
}

TARGET static void dequantize_avx512(const uint8_t *values, const int64_t *value_offsets,
                                     const uint16_t *scales, const int64_t *scale_offsets,
                                     void *dst, int dtype, const int64_t *dst_offsets,
                                     int64_t num_rows, int64_t row_values) {
    for (int64_t r = 0; r < num_rows; r++) {
        if (dtype == DTYPE_FLOAT32)
            dequantize_row_avx512(values + value_offsets[r], scales + scale_offsets[r], dst,
                                  DTYPE_FLOAT32, dst_offsets[r], row_values / GROUP);
        else if (dtype == DTYPE_BFLOAT16)
            dequantize_row_avx512(values + value_offsets[r], scales + scale_offsets[r], dst,
                                  DTYPE_BFLOAT16, dst_offsets[r], row_values / GROUP);
        else
            dequantize_row_avx512(values + value_offsets[r], scales + scale_offsets[r], dst,
                                  DTYPE_FLOAT16, dst_offsets[r], row_values / GROUP);
    }
}

TARGET_BF16 static void dequantize_bf16(const uint8_t *values, const int64_t *value_offsets,
                                        const uint16_t *scales, const int64_t *scale_offsets,
                                        uint16_t *dst, const int64_t *dst_offsets,
                                        int64_t num_rows, int64_t row_values) {
    for (int64_t r = 0; r < num_rows; r++)
        dequantize_row_bf16(values + value_offsets[r], scales + scale_offsets[r],
                            dst + dst_offsets[r], row_values / GROUP);
}

static int best_level(void) {
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi")))
        return PORTABLE;
    return __builtin_cpu_supports("avx512bf16") ? AVX512_BF16 : AVX512;
}
#else
static int best_level(void) { return PORTABLE; }
#endif

/* ---- entry points ---- */

/* The fastest kernel this CPU runs: 0 portable, 1 AVX-512 (F, BW, DQ), 2 AVX-512 with
 * AVX512_BF16 (only bf16 dequantisation differs). */
int e4m3x16_simd(void) { return best_level(); }

static int level(int simd) {
    int best = best_level();
    return simd < best ? simd : best;
}

/* Quantise num_rows rows of row_values values each (a multiple of 16). Row r starts at
 * element src_offsets[r] of src (dtype: DTYPE_*); its e4m3 bytes go to values +
 * value_offsets[r], its bf16 scales to scales + scale_offsets[r] (in scales). simd: the
 * highest kernel level to use (e4m3x16_simd's numbering); every level gives the same bits. */
void e4m3x16_quantize(const void *src, int dtype, const int64_t *src_offsets, uint8_t *values,
                      const int64_t *value_offsets, uint16_t *scales,
                      const int64_t *scale_offsets, int64_t num_rows, int64_t row_values,
                      int simd) {
#ifdef HAVE_AVX512_KERNELS
    if (level(simd) >= AVX512) {
        quantize_avx512(src, dtype, src_offsets, values, value_offsets, scales, scale_offsets,
                        num_rows, row_values);
        return;
    }
#endif
    quantize_portable(src, dtype, src_offsets, values, value_offsets, scales, scale_offsets,
                      num_rows, row_values);
}

/* Dequantise: the inverse of e4m3x16_quantize's layout, into dst (dtype: DTYPE_*) at element
 * dst_offsets[r] per row. */
void e4m3x16_dequantize(const uint8_t *values, const int64_t *value_offsets,
                        const uint16_t *scales, const int64_t *scale_offsets, void *dst, int dtype,
                        const int64_t *dst_offsets, int64_t num_rows, int64_t row_values,
                        int simd) {
#ifdef HAVE_AVX512_KERNELS
    if (level(simd) == AVX512_BF16 && dtype == DTYPE_BFLOAT16) {
        dequantize_bf16(values, value_offsets, scales, scale_offsets, dst, dst_offsets, num_rows,
                        row_values);
        return;
    }
    if (level(simd) >= AVX512) {
        dequantize_avx512(values, value_offsets, scales, scale_offsets, dst, dtype, dst_offsets,
                          num_rows, row_values);
        return;
    }
#endif
    dequantize_portable(values, value_offsets, scales, scale_offsets, dst, dtype, dst_offsets,
                        num_rows, row_values);
}
