/* Rows of a quantized weight (GGUF blocks, `kernels/quant/formats.py`) as float32, the values of
 * `formats.dequantize` bit for bit: the whole forward's lookup of a quantized token embedding
 * (`cpu/forward.c`). Each value is the float32 operations ggml's and gguf's dequantizers do, in
 * their order, one rounding each (the build turns off contraction into FMA). */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

static inline float half_value(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_value(h);
}

/* Q8_0: d · q */
static void row_q8_0(const uint8_t *row, int64_t K, float *out) {
    for (int64_t b = 0; b < K / 32; ++b, row += 34) {
        const float d = half_value(row);
        for (int i = 0; i < 32; ++i) out[32 * b + i] = (float)(int8_t)row[2 + i] * d;
    }
}

/* Q4_0: d · (q − 8), byte j holding value j (low nibble) and j + 16 (high) */
static void row_q4_0(const uint8_t *row, int64_t K, float *out) {
    for (int64_t b = 0; b < K / 32; ++b, row += 18) {
        const float d = half_value(row);
        for (int j = 0; j < 16; ++j) {
            out[32 * b + j] = d * (float)((row[2 + j] & 0x0F) - 8);
            out[32 * b + j + 16] = d * (float)((row[2 + j] >> 4) - 8);
        }
    }
}

/* Q4_K: (d · sc_j) · q − dmin · m_j over sub-block j (32 values); chunk c of 32 bytes holds values
 * 64c + l (low nibble) and 64c + 32 + l (high) */
static void row_q4_k(const uint8_t *row, int64_t K, float *out) {
    for (int64_t b = 0; b < K / 256; ++b, row += 144) {
        const float d = half_value(row), dmin = half_value(row + 2);
        const uint8_t *s = row + 4;
        for (int j = 0; j < 8; ++j) {  /* ggml's get_scale_min_k4 */
            const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
            const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            const float step = d * (float)sc, offset = dmin * (float)m;
            const uint8_t *q = row + 16 + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) {
                const int v = j % 2 ? q[l] >> 4 : q[l] & 0x0F;
                out[256 * b + 32 * j + l] = step * (float)v - offset;
            }
        }
    }
}

/* Q6_K: (d · sc_j) · (q − 32) over sub-block j (16 values); half h (128 values) takes ql[64h …] and
 * qh[32h …], value 128h + 32k + l the low (k < 2) or high nibble of ql[64h + 32(k % 2) + l] with bits
 * 2k, 2k + 1 of qh[32h + l] above it */
static void row_q6_k(const uint8_t *row, int64_t K, float *out) {
    for (int64_t b = 0; b < K / 256; ++b, row += 210) {
        const float d = half_value(row + 208);
        for (int v = 0; v < 256; ++v) {
            const int h = v / 128, k = v % 128 / 32, l = v % 32;
            const uint8_t low = row[64 * h + 32 * (k % 2) + l];
            const int q = (k < 2 ? low & 0x0F : low >> 4) | ((row[128 + 32 * h + l] >> (2 * k)) & 3) << 4;
            out[256 * b + v] = d * (float)(int8_t)row[192 + v / 16] * (float)(q - 32);
        }
    }
}

/* row `row` of the weight [N, K] whose blocks start at `w`, format `fmt` (HS_Q8_0 …), into out [K];
 * returns 0, or -1 for a format it does not read or K not whole blocks (nothing written) */
int hs_quant_row(const uint8_t *w, int fmt, int64_t K, int64_t row, float *out) {
    const int64_t block = fmt >= HS_Q4_K ? 256 : 32;
    const int64_t bytes = fmt == HS_Q6_K ? 210 : fmt == HS_Q4_K ? 144 : fmt == HS_Q4_0 ? 18 : 34;
    if (fmt < HS_Q8_0 || fmt > HS_Q6_K || K < 0 || K % block || row < 0) return -1;
    const uint8_t *at = w + row * (K / block * bytes);
    if (fmt == HS_Q8_0) row_q8_0(at, K, out);
    else if (fmt == HS_Q4_0) row_q4_0(at, K, out);
    else if (fmt == HS_Q4_K) row_q4_k(at, K, out);
    else row_q6_k(at, K, out);
    return 0;
}
