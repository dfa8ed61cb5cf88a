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
 * semantics; tests/engine_adapter/test_e4m3x16_native.py compares them): every step is an
 * exact operation or one IEEE rounding to nearest even that both sides make. Plain loops over
 * one group that the compiler vectorises (-O3 -march=native): no intrinsics, no _Float16, so
 * it builds with any C99 compiler.
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

/* Quantise num_rows rows of row_values values each (a multiple of 16). Row r starts at
 * element src_offsets[r] of src (dtype: DTYPE_*); its e4m3 bytes go to values +
 * value_offsets[r], its bf16 scales to scales + scale_offsets[r] (in scales). */
void e4m3x16_quantize(const void *src, int dtype, const int64_t *src_offsets, uint8_t *values,
                      const int64_t *value_offsets, uint16_t *scales,
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

static inline __attribute__((always_inline)) void dequantize_rows(
    const uint8_t *values, const int64_t *value_offsets, const uint16_t *scales,
    const int64_t *scale_offsets, void *dst, int dtype, const int64_t *dst_offsets,
    int64_t num_rows, int64_t row_values) {
    float y[GROUP];
    for (int64_t r = 0; r < num_rows; r++) {
        for (int64_t g = 0; g < row_values / GROUP; g++) {
            const int8_t *v = (const int8_t *)(values + value_offsets[r] + g * GROUP);
            /* scale * 2^120, exact (the scale is at most 2^7) */
            float multiplier = bits_f32((uint32_t)scales[scale_offsets[r] + g] << 16) * 0x1.0p120f;
            for (int i = 0; i < GROUP; i++) {
                uint32_t bits = ((uint32_t)(int32_t)v[i] << 20) & 0x87F00000u; /* sign|exp|man */
                y[i] = bits_f32(bits) * multiplier;
            }
            store_group(y, dst, dtype, dst_offsets[r] + g * GROUP);
        }
    }
}

/* Dequantise: the inverse of e4m3x16_quantize's layout, into dst (dtype: DTYPE_*) at element
 * dst_offsets[r] per row. An e4m3 byte's exponent and mantissa, moved to fp32's places, are
 * the value times 2^-120 (subnormals too); one multiply by scale * 2^120 finishes it, exactly
 * (4 significant bits times 8, at least 2^-142: an fp32), then one rounding to dtype. */
void e4m3x16_dequantize(const uint8_t *values, const int64_t *value_offsets,
                        const uint16_t *scales, const int64_t *scale_offsets, void *dst, int dtype,
                        const int64_t *dst_offsets, int64_t num_rows, int64_t row_values) {
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
