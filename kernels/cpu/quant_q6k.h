/* The Q6_K product's columns (`cpu/quant.c` includes this file after its job type and sends Q6_K
 * weights here): y[M, N] = x[M, K] @ Wᵀ, W in GGUF's Q6_K super-blocks of 256 values, 210 bytes
 * (`kernels/quant/formats.py`), x rounded per row to ggml's Q8_K (int8 blocks of 256, a float32
 * scale dx each: `formats.quantize_rows_q8` with block 256).
 *
 * Per output (row m, column n) the float work is one fixed chain: per super-block b in order, 8 int32
 * lanes (lane i: values 4i … 4i + 3 of each 32 of the block), each the exact integer sum over its 32
 * values of sc_j · (q − 32) · x, q the 6-bit value (0 … 63) and sc_j the int8 scale of the value's
 * sub-block of 16 (the −32 as 32 times x's pair sums, subtracted in 16 bits: both terms and their
 * difference fit), at most 32 · 32 · 127 · 128 < 2^24 in magnitude and so converted to float exactly,
 * fused-multiply-added times d_b · dx_b rounded to float32 into 8 float32 lanes starting at zero; then
 * the lanes summed as `hsum8` sums them. The integer sums are AVX2's whichever dot product quant.c
 * has chosen, and nothing in the chain depends on the other rows of the call, the thread count or the
 * rows a decoded block meets, so a row's bits are the same in any batch, at any thread count, on
 * either path: tests/kernels/quant/test_products.py. */

#define Q6_ROWS 4       /* rows one decoded super-block meets before the next */
#define Q6_ROW_CHUNK 64 /* rows whose activations stay in cache while the columns pass */
#define Q6_BYTES 210

/* a super-block decoded: its 256 values q (0 … 63) in value order, 32 per vector; per 32 values the
 * scales of their two sub-blocks as madd takes them, [sc_2c × 8 | sc_2c+1 × 8] int16; d */
typedef struct {
    v8i q[8], sc[8];
    float d;
} q6_block;

/* ggml's layout: half h (128 values) takes ql[64h …] and qh[32h …]; its 32 values 32k + l are the
 * low (k < 2) or high nibble of ql[64h + 32(k % 2) + l] with bits 2k, 2k + 1 of qh[32h + l] above */
static inline void q6_decode(const uint8_t *blk, q6_block *out) {
    for (int h = 0; h < 2; ++h) {
        const v8i ql0 = v8i_load(blk + 64 * h), ql1 = v8i_load(blk + 64 * h + 32), qh = v8i_load(blk + 128 + 32 * h);
        out->q[4 * h] = u8x32_six_bits(u8x32_low_nibbles(ql0), qh, 0);
        out->q[4 * h + 1] = u8x32_six_bits(u8x32_low_nibbles(ql1), qh, 2);
        out->q[4 * h + 2] = u8x32_six_bits(u8x32_high_nibbles(ql0), qh, 4);
        out->q[4 * h + 3] = u8x32_six_bits(u8x32_high_nibbles(ql1), qh, 6);
    }
    const int8_t *sc = (const int8_t *)(blk + 192);
    for (int c = 0; c < 8; ++c) out->sc[c] = i16x16_halves(sc[2 * c], sc[2 * c + 1]);
    out->d = f16_value(half_at(blk + 208));
}

/* the 8 exact lane sums of a decoded super-block by 256 int8 activations (see the file's comment) */
static inline v8i q6_lanes(const q6_block *w, const int8_t *x) {
    v8i sum = v8i_zero();
    for (int c = 0; c < 8; ++c) sum = v8i_add(sum, dot_u6_centered_scaled_lanes(w->q[c], v8i_load(x + 32 * c), w->sc[c]));
    return sum;
}

/* rows m0 … m0 + R − 1 (R <= Q6_ROWS) of column n, over all K */
static void q6_tile(const quant_job *j, int64_t m0, int R, int64_t n) {
    const int64_t nb = j->K / 256;
    v8 acc[Q6_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = v8_zero();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = j->w + n * j->row_bytes + b * Q6_BYTES;
        prefetch_l1(blk + 2 * Q6_BYTES);
        prefetch_l1(blk + 2 * Q6_BYTES + 128);
        q6_block w;
        q6_decode(blk, &w);
        for (int r = 0; r < R; ++r) {
            const v8i lanes = q6_lanes(&w, j->xq + (m0 + r) * j->K + b * 256);
            acc[r] = v8_fmadd(v8_set1(w.d * j->xd[(m0 + r) * nb + b]), v8i_to_float(lanes), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) j->y[(m0 + r) * j->N + n] = hsum8(acc[r]);
}

/* columns c0 … c1 − 1 of the product, over chunks of Q6_ROW_CHUNK rows, Q6_ROWS rows at a time */
static void q6_columns(const quant_job *j, int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < j->M; r0 += Q6_ROW_CHUNK) {
        const int64_t r1 = r0 + Q6_ROW_CHUNK < j->M ? r0 + Q6_ROW_CHUNK : j->M;
        for (int64_t n = c0; n < c1; ++n)
            for (int64_t m0 = r0; m0 < r1; m0 += Q6_ROWS)
                q6_tile(j, m0, (int)(r1 - m0 < Q6_ROWS ? r1 - m0 : Q6_ROWS), n);
    }
}
