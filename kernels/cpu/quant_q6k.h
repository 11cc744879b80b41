/* The Q6_K product's tiles (`cpu/quant.c` includes this file after its job type and sends Q6_K
 * weights here): y[M, N] = x[M, K] @ Wᵀ, W in GGUF's Q6_K super-blocks of 256 values, 210 bytes
 * (`kernels/quant/formats.py`), x rounded per row to ggml's Q8_K (int8 blocks of 256, a float32
 * scale dx each: `formats.quantize_rows_q8` with block 256).
 *
 * Per output (row m, column n) the float work is one fixed chain: per super-block b in order, the
 * exact integer S_b = Σ_j sc_j · Σ (q − 32) · x over its 16 sub-blocks j of 16 values (q the 6-bit
 * value, 0 … 63, sc_j the sub-block's int8 scale; |S_b| < 2^27), converted to float (exact below
 * 2^24, else rounded to nearest: the same integer, the same float), fused-multiply-added times
 * d_b · dx_b rounded to float32 into one float32 sum starting at zero. One sum per output is what
 * lets the 16-column tiles hold 16 outputs in the lanes of one vector. The −32 goes through the
 * activations: per call, each row's offsets are computed once (`q6_offsets`) in the form the path
 * takes. The integer sums, each path its own way to the same integers:
 *   AVX2: per 32 values, maddubs(q, x) (pair sums within ±16002), times the two sub-blocks' scales
 *         by madd; the −32 once per super-block, one madd of the 16 scales times −32 by the row's 16
 *         sub-block sums of x; 8 lanes summed per super-block; up to Q6_ROWS rows in tiles of two
 *         distant columns, more one column at a time by groups of up to Q6_ROWS rows.
 *   AVX512-VNNI, up to Q6_COLUMN_ROWS rows: per 32 values, dpbusd(q, x) from the offsets −32 · x's
 *         lane sums (each lane Σ (q − 32) · x, within ±16256: an int16), times its sub-block's scale
 *         by dpwssd (the scale in the lane's low half, 0 in its high half), two chunks of 32 per
 *         512-bit instruction, the lanes summed per super-block; tiles of two distant columns.
 *   AVX512-VNNI, more rows, or any count on interleaved weights (HS_X16, below): tiles of 16 columns
 *         in the lanes (q6_16): the 16 weight rows' words transposed as they are read (interleaved:
 *         loaded as they lie), per sub-block 4 dpbusd from the row's −32 · Σ x of the sub-block,
 *         times the sub-block's scales (one multiply for 16 outputs).
 * The coarse pass of `hs_quant_top` (a greedy draft's LM head, cpu/quant.c) runs the same tiles on
 * the values 2h − 3 of the two high bits h alone (q6_decode_*'s `coarse`; on interleaved weights
 * q6_16_coarse_rows over the high plane), the same integers and float chain on every path.
 * Nothing in the chain depends on the other rows of the call, the thread count, the tile or the
 * path, so a row's bits are the same in any batch, at any thread count, on either path:
 * tests/kernels/quant/test_products.py. */

/* Few rows take tiles of two columns n and n + half of the part's (each super-block decoded once for
 * all rows): the weight read as two sequential streams (neighbouring columns would interleave them, and
 * the prefetchers lose the stream), the activations loaded once for both */
#define Q6_ROWS 4       /* AVX2: rows one decoded super-block meets before the next */
#define Q6_ROW_CHUNK 64 /* rows whose activations stay in cache while the columns pass */
#define Q6_COLUMN_ROWS 6 /* AVX512-VNNI: up to this many rows in tiles of two distant columns, more in the
                          * 16-column tiles (q6_16) */
#define Q6_TILE_ROWS 6   /* rows of one 16-column tile */
#define Q6_BYTES 210
#define Q6_LOW 128      /* a super-block's bytes in the low plane (ql: the values' low nibbles) */
#define Q6_HIGH 82      /* and in the high plane (qh 64, the 16 scales, d) */
#define Q6_PLANE_ROWS 256 /* rows per group of the interleaved layout (HS_X16; a multiple of X16_ROWS) */

/* Interleaved Q6_K (HS_X16, `QuantWeight.interleave_`; the rows a multiple of 16): the rows in groups
 * of Q6_PLANE_ROWS (the last one what is left), each group in its own bytes as two planes, the low
 * one (every super-block's ql) then the high one (qh, scales, d), each by 16-row tiles t and
 * super-blocks b in order: in the low plane 2048 bytes per (t, b), ql's 32 words of the 16 rows
 * transposed (word i of the 16 rows side by side, 64 bytes, then word i + 1); in the high plane
 * 1312 bytes, qh's 16 words transposed (1024), the scales' 4 (256), then the 16 rows' d (32). The
 * 16-column tiles load what they would transpose (as Q4_K's, quant_q4k.h), and the coarse pass
 * (`hs_quant_top`) streams the high plane alone: 82 of each 210 bytes, 16 columns in the lanes. */
#define Q6_X16_LOW (16 * Q6_LOW)   /* a tile's super-block in the low plane */
#define Q6_X16_HIGH (16 * Q6_HIGH) /* and in the high plane: qh's words, then the scales', then d */
#define Q6_X16_SCALES (16 * 64)    /* where in it the scales' words start */
#define Q6_X16_D (Q6_X16_SCALES + 16 * 16) /* and the 16 rows' d */

/* the low and high plane bytes of super-block b of the 16-row tile holding row n (interleaved) */
static inline __attribute__((always_inline)) void q6_x16_at(const quant_job *j, int64_t n, int64_t b,
                                                            const uint8_t **low, const uint8_t **high) {
    const int64_t nb = j->K / 256, g0 = n - n % Q6_PLANE_ROWS, t = (n - g0) / 16;
    const int64_t rows = j->N - g0 < Q6_PLANE_ROWS ? j->N - g0 : Q6_PLANE_ROWS;
    const uint8_t *group = j->w + g0 * j->row_bytes;
    *low = group + (t * nb + b) * Q6_X16_LOW;
    *high = group + rows * nb * Q6_LOW + (t * nb + b) * Q6_X16_HIGH;
}

/* Where super-block b of weight row n lies in GGUF's order: lo its ql (128 bytes), hi its qh (64), the
 * scales (hi + 64, 16) and d (hi + 80). Interleaved, it is put together in `scratch` (210 bytes): the
 * tiles of one or two columns (AVX2's, a row's best columns in `hs_quant_top`) read such weights a
 * word at a time */
static inline __attribute__((always_inline)) void q6_at(const quant_job *j, int64_t n, int64_t b, uint8_t *scratch,
                                                        const uint8_t **lo, const uint8_t **hi) {
    if (!j->x16) {
        *lo = j->w + n * j->row_bytes + b * Q6_BYTES;
        *hi = *lo + Q6_LOW;
        return;
    }
    const uint8_t *low, *high;
    q6_x16_at(j, n, b, &low, &high);
    const int c = (int)(n % 16);
    for (int w = 0; w < Q6_LOW / 4; ++w) memcpy(scratch + 4 * w, low + 64 * w + 4 * c, 4);
    for (int w = 0; w < (Q6_HIGH - 2) / 4; ++w) memcpy(scratch + Q6_LOW + 4 * w, high + 64 * w + 4 * c, 4); /* qh, scales */
    memcpy(scratch + Q6_BYTES - 2, high + Q6_X16_D + 2 * c, 2);
    *lo = scratch, *hi = scratch + Q6_LOW;
}

/* the cache lines of super-block b of row n into L1 (GGUF's order; interleaved weights stream) */
static inline __attribute__((always_inline)) void q6_prefetch(const quant_job *j, int64_t n, int64_t b) {
    if (n >= j->N || j->x16) return;
    const uint8_t *blk = j->w + n * j->row_bytes + b * Q6_BYTES;
    for (int line = 0; line < Q6_BYTES; line += 64) prefetch_l1(blk + line);
}

/* AVX2's super-block decoded: its 256 values q (0 … 63) in value order, 32 per vector; per 32 values
 * the scales of their two sub-blocks as madd takes them, [sc_2c × 8 | sc_2c+1 × 8] int16; the 16
 * scales times −32 as int16 (nsc); d */
typedef struct {
    v8i q[8], sc[8], nsc;
    float d;
} q6_block;

/* each row's offsets (xo: room for [M, K / 4] int32), `mul` times x where the value is q − 32 (the
 * product: mul −32) or, in the coarse pass, 2h − 3 (mul −3): AVX2 the sum of each 16 of xq, [M, K / 16]
 * int16 (within ±2032; the decoded scales carry mul); VNNI up to Q6_COLUMN_ROWS rows, or any count in
 * the coarse pass (`lanes`), one vector of the 32-bit lane sums mul · (x_4i + … + x_4i+3); more rows
 * (the 16-column tiles) mul · the sum of each 16, [M, K / 16] */
static void q6_offsets(const int8_t *xq, int64_t M, int64_t K, int vnni, int lanes, int16_t mul, int32_t *xo) {
    if (!vnni || !lanes) { /* per 16 of xq: its sum (AVX2, int16) or mul times it (VNNI, int32) */
        for (int64_t i = 0; i < M * K; i += 16) {
            int32_t sum = 0;
            for (int k = 0; k < 16; ++k) sum += xq[i + k];
            if (vnni) xo[i / 16] = mul * sum;
            else ((int16_t *)xo)[i / 16] = (int16_t)sum;
        }
        return;
    }
    for (int64_t i = 0; i < M * K; i += 32) {
        v8i_store(xo + i / 4, i8x32_lane_sums(v8i_load(xq + i), mul));
    }
}

/* ggml's layout: half h (128 values) takes ql[64h …] and qh[32h …]; its 32 values 32k + l are the
 * low (k < 2) or high nibble of ql[64h + 32(k % 2) + l] with bits 2k, 2k + 1 of qh[32h + l] above
 * (moved to bits 4, 5 by a 16-bit shift of 4 − 2k; the nibble and the bits masked). `coarse`: the
 * coarse pass's values 2 · (bits 2k, 2k + 1), 0 … 6, from qh alone (moved to bits 1, 2 by a shift of
 * 1 − 2k), and its scales' offsets −3 · sc */
static inline __attribute__((always_inline)) void q6_decode_avx2(const uint8_t *lo, const uint8_t *hi, int coarse,
                                                                 q6_block *out) {
    for (int h = 0; h < 2; ++h) {
        const v8i qh = v8i_load(hi + 32 * h);
        if (coarse) {
            for (int k = 0; k < 4; ++k) out->q[4 * h + k] = v8i_and_bits(u8x32_shifted16(qh, 1 - 2 * k), 0x06060606);
            continue;
        }
        const v8i ql0 = v8i_load(lo + 64 * h), ql1 = v8i_load(lo + 64 * h + 32);
        out->q[4 * h] = u8x32_six_bits_or(u8x32_low_nibbles(ql0), u8x32_shifted16(qh, 4));
        out->q[4 * h + 1] = u8x32_six_bits_or(u8x32_low_nibbles(ql1), u8x32_shifted16(qh, 2));
        out->q[4 * h + 2] = u8x32_six_bits_or(u8x32_high_nibbles(ql0), qh);
        out->q[4 * h + 3] = u8x32_six_bits_or(u8x32_high_nibbles(ql1), u8x32_shifted16(qh, -2));
    }
    const int8_t *scales = (const int8_t *)(hi + 64);
    const v8i low = i16_pairs_of_i8x8(scales), high = i16_pairs_of_i8x8(scales + 8);
    for (int c = 0; c < 8; ++c) out->sc[c] = v8i_pair_spread(c < 4 ? low : high, 2 * c % 8);
    out->nsc = i16x16_times_of_i8x16(scales, coarse ? -3 : -32);
    out->d = f16_value(half_at(hi + 80));
}

/* VNNI's super-block decoded: its values two chunks of 32 per vector (chunks 2p, 2p + 1 in q[p]), the
 * scales as dpwssd takes them (sc[p]: sc_4p … sc_4p+3, 4 lanes each, low halves); d */
typedef struct {
    v16i q[4], sc[4];
    float d;
} q6_block_vnni;

/* half h's two vectors from ql[64h …] (its 4 chunks' nibbles, in order) and qh[32h …] twice, the low
 * half as it is and the high half 2 bits lower (chunks 4h + 1, 4h + 3 take bits 2-3, 6-7); `coarse`:
 * 2 · those bits from qh alone (q6_decode_avx2) */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_decode_vnni(const uint8_t *lo, const uint8_t *hi,
                                                                             int coarse, q6_block_vnni *out) {
    for (int h = 0; h < 2; ++h) {
        const v16i qh = u8x64_qh_twice(hi + 32 * h);
        if (coarse) {
            out->q[2 * h] = v16i_and_bits(v16i_shifted_left32(qh, 1), 0x06060606);
            out->q[2 * h + 1] = v16i_and_bits(v16i_shr(qh, 3), 0x06060606);
            continue;
        }
        const v16i ql = v16i_load(lo + 64 * h);
        out->q[2 * h] = u8x64_six_bits_or(u8x64_low_nibbles(ql), v16i_shifted_left32(qh, 4));
        out->q[2 * h + 1] = u8x64_six_bits_or(u8x64_high_nibbles(ql), qh);
    }
    const v16i sc = i16_lanes_of_i8x16((const int8_t *)(hi + 64));
    for (int p = 0; p < 4; ++p) out->sc[p] = v16i_quad_spread(sc, 4 * p);
    out->d = f16_value(half_at(hi + 80));
}

/* 8 exact lane sums of a decoded super-block by 256 int8 activations x and their offsets, whose
 * total is the super-block's S_b (AVX2: xs the 16 sub-block sums of x, the −32 · Σ_s sc_s · xs_s in
 * one madd; VNNI: xo, two dpwssd chains, the low and the high lanes folded) */
static inline __attribute__((always_inline)) v8i q6_lanes_avx2(const q6_block *w, const int8_t *x, const int16_t *xs) {
    v8i sum = i16_pair_dots(w->nsc, v8i_load(xs));
    for (int c = 0; c < 8; ++c) sum = v8i_add(sum, dot_u4_vscaled_lanes(w->q[c], v8i_load(x + 32 * c), w->sc[c]));
    return sum;
}
TARGET_VNNI static inline __attribute__((always_inline)) v8i q6_lanes_vnni(const q6_block_vnni *w, const int8_t *x,
                                                                           const int32_t *xo) {
    v16i even = v16i_zero(), odd = v16i_zero(); /* two dpwssd chains in flight */
    for (int p = 0; p < 4; p += 2) {
        even = dot_i16_lanes_vnni16(even, dot_u8_lanes_vnni16(v16i_load(xo + 16 * p), w->q[p], v16i_load(x + 64 * p)),
                                    w->sc[p]);
        odd = dot_i16_lanes_vnni16(odd, dot_u8_lanes_vnni16(v16i_load(xo + 16 * p + 16), w->q[p + 1],
                                                            v16i_load(x + 64 * p + 64)), w->sc[p + 1]);
    }
    return v16i_fold(v16i_add(even, odd));
}

/* a row's super-block into its chains (lane c: column c's): each column's S_b, the total of its 8
 * lanes, times d_c · dx (each lane rounded as the scalar fmaf) */
static inline __attribute__((always_inline)) v8 q6_sums(float d0, float d1, v8i lanes0, v8i lanes1, float dx, v8 acc) {
    return v8_fmadd(v8_mul(v8_set2(d0, d1), v8_set1(dx)), v8i_to_float(v8i_pair_totals(lanes0, lanes1)), acc);
}

/* a tile's outputs, lane c of row r's chains at column n0 + c · step */
static inline __attribute__((always_inline)) void q6_store(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                                           int64_t step, const v8 *acc) {
    for (int r = 0; r < R; ++r) {
        float out[8];
        v8_store(out, acc[r]);
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c * step] = out[c];
    }
}

/* AVX2: rows m0 … m0 + R − 1 (R <= Q6_ROWS) by the C <= 2 columns n0, n0 + step, over all K (`coarse`:
 * the coarse pass's sums, j->xo its offsets) */
static inline __attribute__((always_inline)) void q6_tile_avx2(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                                               int64_t step, int coarse) {
    const int64_t nb = j->K / 256;
    v8 acc[Q6_ROWS]; /* lane c: column c's chain */
    for (int r = 0; r < R; ++r) acc[r] = v8_zero();
    for (int64_t b = 0; b < nb; ++b) {
        q6_block w[2];
        for (int c = 0; c < C; ++c) {
            uint8_t scratch[Q6_BYTES];
            const uint8_t *lo, *hi;
            q6_at(j, n0 + c * step, b, scratch, &lo, &hi);
            q6_prefetch(j, n0 + c * step + 2, b);
            q6_decode_avx2(lo, hi, coarse, &w[c]);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t *x = j->xq + (m0 + r) * j->K + b * 256;
            const int16_t *xs = (const int16_t *)j->xo + (m0 + r) * (j->K / 16) + b * 16;
            const float dx = j->xd[(m0 + r) * nb + b];
            const v8i lanes = q6_lanes_avx2(&w[0], x, xs);
            acc[r] = q6_sums(w[0].d, w[C - 1].d, lanes, C > 1 ? q6_lanes_avx2(&w[1], x, xs) : lanes, dx, acc[r]);
        }
    }
    q6_store(j, m0, R, n0, C, step, acc);
}

/* an AVX2 tile with R, C and `coarse` made constants */
static void q6_tile_avx2_sized(const quant_job *j, int64_t m0, int R, int64_t n0, int C, int64_t step, int coarse) {
#if Q6_ROWS != 4
#error "quant_q6k.h: a tile shape that q6_tile_avx2_sized does not instantiate"
#endif
#define Q6CASE(r, c)                                                                                       \
    case (r) * 4 + (c):                                                                                    \
        if (coarse) q6_tile_avx2(j, m0, r, n0, c, step, 1);                                                \
        else q6_tile_avx2(j, m0, r, n0, c, step, 0);                                                       \
        break;
    switch (R * 4 + C) {
        Q6CASE(1, 1) Q6CASE(2, 1) Q6CASE(3, 1) Q6CASE(4, 1) Q6CASE(1, 2) Q6CASE(2, 2) Q6CASE(3, 2) Q6CASE(4, 2)
        default: break;
    }
#undef Q6CASE
}

/* VNNI: rows m0 … m0 + R − 1 (R <= Q6_COLUMN_ROWS) by the C <= 2 columns n0, n0 + step, … over all
 * K; each column's super-blocks prefetched two columns ahead in its stream (the tiles read each stream
 * in order: neighbouring columns C at a time, step 1, or one column of each of C streams); `coarse`
 * as q6_tile_avx2 */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_tile_vnni(const quant_job *j, int64_t m0, int R,
                                                                           int64_t n0, int C, int64_t step,
                                                                           int coarse) {
    const int64_t nb = j->K / 256;
    v8 acc[Q6_COLUMN_ROWS]; /* lane c: column c's chain */
    for (int r = 0; r < R; ++r) acc[r] = v8_zero();
    for (int64_t b = 0; b < nb; ++b) {
        q6_block_vnni w[2];
        for (int c = 0; c < C; ++c) {
            uint8_t scratch[Q6_BYTES];
            const uint8_t *lo, *hi;
            q6_at(j, n0 + c * step, b, scratch, &lo, &hi);
            q6_prefetch(j, n0 + c * step + 2 * (step == 1 ? C : 1), b);
            q6_decode_vnni(lo, hi, coarse, &w[c]);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t *x = j->xq + (m0 + r) * j->K + b * 256;
            const int32_t *xo = j->xo + (m0 + r) * (j->K / 4) + b * 64;
            const float dx = j->xd[(m0 + r) * nb + b];
            const v8i lanes = q6_lanes_vnni(&w[0], x, xo);
            acc[r] = q6_sums(w[0].d, w[C - 1].d, lanes, C > 1 ? q6_lanes_vnni(&w[1], x, xo) : lanes, dx, acc[r]);
        }
    }
    q6_store(j, m0, R, n0, C, step, acc);
}

/* a VNNI tile with R, C and `coarse` made constants */
TARGET_VNNI static void q6_tile_vnni_sized(const quant_job *j, int64_t m0, int R, int64_t n0, int C, int64_t step,
                                           int coarse) {
#if Q6_COLUMN_ROWS != 6
#error "quant_q6k.h: a tile shape that q6_tile_vnni_sized does not instantiate"
#endif
#define Q6CASE(r, c)                                                                                       \
    case (r) * 4 + (c):                                                                                    \
        if (coarse) q6_tile_vnni(j, m0, r, n0, c, step, 1);                                                \
        else q6_tile_vnni(j, m0, r, n0, c, step, 0);                                                       \
        break;
    switch (R * 4 + C) {
        Q6CASE(1, 1) Q6CASE(2, 1) Q6CASE(3, 1) Q6CASE(4, 1) Q6CASE(5, 1) Q6CASE(6, 1)
        Q6CASE(1, 2) Q6CASE(2, 2) Q6CASE(3, 2) Q6CASE(4, 2) Q6CASE(5, 2) Q6CASE(6, 2)
        default: break;
    }
#undef Q6CASE
}

/* rows r0 … r1 − 1 in balanced groups of at most `most` rows, by the C columns n, n + step, … */
static void q6_group_tiles(const quant_job *j, int64_t r0, int64_t r1, int most, int64_t n, int C, int64_t step,
                           int vnni, int coarse) {
    const int64_t groups = (r1 - r0 + most - 1) / most;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
        if (vnni) q6_tile_vnni_sized(j, m0, (int)(m1 - m0), n, C, step, coarse);
        else q6_tile_avx2_sized(j, m0, (int)(m1 - m0), n, C, step, coarse);
    }
}

/* -- Q6_K by columns (AVX512-VNNI, more than Q6_COLUMN_ROWS rows): 16 weight rows in the 16 lanes
 * of 512-bit vectors, their bytes transposed as they are read, each lane the chain of one output,
 * so a sub-block's integer work is one dpbusd per 4 values of 16 outputs and its scale one multiply
 * for 16 ------------------------------------------------------------------------------------------ */

/* super-block b of 16 weight rows decoded: q[s][i], lane c: values 4i … 4i + 3 of sub-block s of row
 * c (0 … 63, a byte each); sc[s], lane c: its scale; d per lane */
typedef struct {
    v16i q[16][4];
    v16i sc[16];
    v16 d;
} q6_16_block;

/* super-block b of 16 weight rows as 4-byte words, 16 lanes (lane c: row c's word): ql's 32, qh's 16,
 * the scales' 4; d per lane */
typedef struct {
    v16i low[32], high[16], scales[4];
    v16 d;
} q6_16_words;

/* the high plane's words of a tile's super-block (interleaved, at `high`): qh's, the scales', d */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_load_high(const uint8_t *high, q6_16_words *w) {
    for (int i = 0; i < 16; ++i) w->high[i] = v16i_load(high + 64 * i);
    for (int i = 0; i < 4; ++i) w->scales[i] = v16i_load(high + Q6_X16_SCALES + 64 * i);
    w->d = v16_of_f16x16(high + Q6_X16_D);
}

/* the words of super-block b of the columns n0 … n0 + 15: interleaved, loaded as they lie
 * (q6_x16_at); in GGUF's order, transposed from the 16 columns' super-blocks blk */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_load(const quant_job *j, int64_t n0, int64_t b,
                                                                         const uint8_t *const blk[16],
                                                                         q6_16_words *w) {
    if (j->x16) {
        const uint8_t *low, *high;
        q6_x16_at(j, n0, b, &low, &high);
        for (int i = 0; i < 32; ++i) w->low[i] = v16i_load(low + 64 * i);
        q6_16_load_high(high, w);
        return;
    }
    const uint8_t *p[16];
    for (int i = 0; i < 32; i += 4) {
        for (int c = 0; c < 16; ++c) p[c] = blk[c] + 4 * i;
        u32x16_transposed16(p, w->low + i);
        if (i < 16) {
            for (int c = 0; c < 16; ++c) p[c] += Q6_LOW;
            u32x16_transposed16(p, w->high + i);
        }
    }
    for (int c = 0; c < 16; ++c) p[c] = blk[c] + 192;
    u32x16_transposed16(p, w->scales);
    int32_t d[16];
    for (int c = 0; c < 16; ++c) d[c] = half_at(blk[c] + 208);
    w->d = v16_f16_half(v16i_load(d), 0);
}

/* sub-block s's int8 scales, one a lane */
TARGET_VNNI static inline __attribute__((always_inline)) v16i q6_16_scale(const q6_16_words *w, int s) {
    return v16i_sra(v16i_shl(w->scales[s / 4], 24 - 8 * (s % 4)), 24);
}

/* ggml's layout (q6_decode_avx2's comment) by 4-value groups: values l … l + 3 of half h's 32-value
 * part k take the nibbles of ql[64h + 32(k % 2) + l …] (ql's word 16h + 8(k % 2) + l / 4; low for
 * k < 2) and bits 2k, 2k + 1 of qh[32h + l …] (qh's word 8h + l / 4), and are sub-block
 * 8h + 2k + l / 16's values l % 16 … */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_decode(const q6_16_words *w, q6_16_block *out) {
    for (int h = 0; h < 2; ++h)
        for (int part = 0; part < 2; ++part) { /* l = 16 · part … 16 · part + 15 */
            const int s = 8 * h + part; /* k = 0's sub-block; k adds 2k */
            for (int i = 0; i < 4; ++i) {
                const v16i lo = w->low[16 * h + 4 * part + i], hi = w->low[16 * h + 8 + 4 * part + i];
                const v16i qh = w->high[8 * h + 4 * part + i];
                out->q[s][i] = v16i_or(v16i_and_bits(lo, 0x0F0F0F0F), v16i_and_bits(v16i_shl(qh, 4), 0x30303030));
                out->q[s + 2][i] = v16i_or(v16i_and_bits(hi, 0x0F0F0F0F), v16i_and_bits(v16i_shl(qh, 2), 0x30303030));
                out->q[s + 4][i] = v16i_or(v16i_and_bits(v16i_shr(lo, 4), 0x0F0F0F0F), v16i_and_bits(qh, 0x30303030));
                out->q[s + 6][i] = v16i_or(v16i_and_bits(v16i_shr(hi, 4), 0x0F0F0F0F),
                                           v16i_and_bits(v16i_shr(qh, 2), 0x30303030));
            }
        }
    for (int s = 0; s < 16; ++s) out->sc[s] = q6_16_scale(w, s);
    out->d = w->d;
}

/* super-block b of the columns n0 … n0 + 15 (past the first C: the last again) decoded into out; in
 * GGUF's order the next tile's share of it prefetched into L1 and the one after's into L2
 * (tile16_blocks); interleaved, the next tile's super-block b into L2 where more rows than a tile
 * take it (at few rows none, as Q4_K's k16 tiles, which went faster without) */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_fetch(const quant_job *j, int64_t n0, int C,
                                                                          int64_t b, q6_16_block *out) {
    const uint8_t *blk[16];
    if (!j->x16) {
        const uint8_t *row[16];
        tile_rows(j, n0, C, 16, row);
        tile16_blocks(j, row, b, Q6_BYTES, blk);
    } else if (j->M > Q6_TILE_ROWS && n0 + 16 < j->N) { /* interleaved, many rows: the next tile into L2 */
        const uint8_t *low, *high;
        q6_x16_at(j, n0 + 16, b, &low, &high);
        for (int line = 0; line < Q6_X16_LOW; line += 64) prefetch_l2(low + line);
        for (int line = 0; line < Q6_X16_HIGH; line += 64) prefetch_l2(high + line);
    }
    q6_16_words w;
    q6_16_load(j, n0, b, blk, &w);
    q6_16_decode(&w, out);
}

/* each row's S_b (total[r], lane c: column c's) times d · dx into its chain: the float work of a
 * super-block in the 16-column tiles, the product's and the coarse pass's */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_chain(const quant_job *j, v16 d,
                                                                          const v16i total[Q6_TILE_ROWS], int64_t m0,
                                                                          int R, int64_t b, v16 acc[Q6_TILE_ROWS]) {
    for (int r = 0; r < R; ++r) {
        const v16 dx = v16_set1(j->xd[(m0 + r) * (j->K / 256) + b]);
        acc[r] = v16_fmadd(v16_mul(d, dx), v16i_to_float(total[r]), acc[r]);
    }
}

/* rows m0 … m0 + R − 1 by super-block b (decoded w): per lane S_b, the exact Σ_s sc_s · Σ (q − 32) · x
 * (each sub-block's dpbusd chain from the row's −32 · Σ x of the sub-block), times d · dx into acc */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_rows(const quant_job *j, const q6_16_block *w,
                                                                         int64_t m0, int R, int64_t b,
                                                                         v16 acc[Q6_TILE_ROWS]) {
    v16i total[Q6_TILE_ROWS];
    for (int r = 0; r < R; ++r) total[r] = v16i_zero();
    for (int s = 0; s < 16; s += 2) { /* two sub-blocks' chains in flight */
        v16i s0[Q6_TILE_ROWS], s1[Q6_TILE_ROWS];
        for (int r = 0; r < R; ++r) {
            const int32_t *xo = j->xo + (m0 + r) * (j->K / 16) + b * 16 + s;
            s0[r] = v16i_set1(xo[0]), s1[r] = v16i_set1(xo[1]);
        }
        for (int i = 0; i < 4; ++i)
            for (int r = 0; r < R; ++r) {
                const int8_t *x = j->xq + (m0 + r) * j->K + b * 256 + 16 * s + 4 * i;
                s0[r] = dot_u8_lanes_vnni16(s0[r], w->q[s][i], i8x4_broadcast16(x));
                s1[r] = dot_u8_lanes_vnni16(s1[r], w->q[s + 1][i], i8x4_broadcast16(x + 16));
            }
        for (int r = 0; r < R; ++r)
            total[r] = v16i_add(total[r], v16i_add(v16i_mul(s0[r], w->sc[s]), v16i_mul(s1[r], w->sc[s + 1])));
    }
    q6_16_chain(j, w->d, total, m0, R, b, acc);
}

/* a tile of R rows by 16 columns, lane c column n0 + c (columns past the first C: the last again, not
 * stored); the super-blocks from `decoded` or decoded here */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_tile(const quant_job *j, int64_t m0, int R,
                                                                         int64_t n0, int C,
                                                                         const q6_16_block *decoded) {
    v16 acc[Q6_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = v16_zero();
    for (int64_t b = 0; b < j->K / 256; ++b) {
        if (decoded) {
            q6_16_rows(j, decoded + b, m0, R, b, acc);
        } else {
            q6_16_block w;
            q6_16_fetch(j, n0, C, b, &w);
            q6_16_rows(j, &w, m0, R, b, acc);
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[16];
        v16_store(out, acc[r]);
        memcpy(j->y + (m0 + r) * j->N + n0, out, (size_t)C * sizeof *out);
    }
}

/* a 16-column tile with R made a constant, and whether its super-blocks come decoded */
TARGET_VNNI static void q6_16_tile_sized(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                         const q6_16_block *decoded) {
#if Q6_TILE_ROWS != 6
#error "quant_q6k.h: a tile shape that q6_16_tile_sized does not instantiate"
#endif
#define Q616CASE(r)                                                            \
    case r:                                                                    \
        if (decoded) q6_16_tile(j, m0, r, n0, C, decoded);                     \
        else q6_16_tile(j, m0, r, n0, C, NULL);                                \
        break;
    switch (R) {
        Q616CASE(1) Q616CASE(2) Q616CASE(3) Q616CASE(4) Q616CASE(5) Q616CASE(6)
        default: break;
    }
#undef Q616CASE
}

/* columns c0 … c1 − 1, 16 at a time, by balanced groups of at most Q6_TILE_ROWS rows over chunks of
 * Q6_ROW_CHUNK rows; where a chunk has more than one group, its columns' super-blocks decoded once
 * (when the memory for them is there; else each group decodes them) */
TARGET_VNNI static void q6_16_columns(const quant_job *j, int64_t c0, int64_t c1) {
    const int64_t nb = j->K / 256;
    q6_16_block *decoded = NULL;
    if (j->M > Q6_TILE_ROWS) decoded = aligned_alloc(64, (size_t)nb * sizeof *decoded);
    for (int64_t r0 = 0; r0 < j->M; r0 += Q6_ROW_CHUNK) {
        const int64_t r1 = r0 + Q6_ROW_CHUNK < j->M ? r0 + Q6_ROW_CHUNK : j->M;
        const int64_t groups = (r1 - r0 + Q6_TILE_ROWS - 1) / Q6_TILE_ROWS;
        for (int64_t n = c0; n < c1; n += 16) {
            const int C = (int)(c1 - n < 16 ? c1 - n : 16);
            const q6_16_block *from = NULL;
            if (groups > 1 && decoded) {
                for (int64_t b = 0; b < nb; ++b) q6_16_fetch(j, n, C, b, decoded + b);
                from = decoded;
            }
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                q6_16_tile_sized(j, m0, (int)(m1 - m0), n, C, from);
            }
        }
    }
    free(decoded);
}

/* -- The coarse pass on interleaved weights (AVX512-VNNI): 16 columns in the lanes, the high plane
 * alone ------------------------------------------------------------------------------------------- */

/* 2 · bits 2k, 2k + 1 of each byte of qh words (0 … 6 a byte): the coarse values of sub-block k's part */
TARGET_VNNI static inline __attribute__((always_inline)) v16i q6_16_coarse_values(v16i qh, int k) {
    return v16i_and_bits(k ? v16i_shr(qh, 2 * k - 1) : v16i_shl(qh, 1), 0x06060606);
}

/* rows m0 … m0 + R − 1 by super-block b of the 16-row tile whose high plane is at `high`: per lane the
 * exact Σ_s sc_s · Σ (2h − 3) · x (each sub-block's dpbusd chain from the row's −3 · Σ x of the
 * sub-block, j->xo), times d · dx into acc: the chain of the coarse tiles of two columns */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_coarse_rows(const quant_job *j, const uint8_t *high,
                                                                                int64_t m0, int R, int64_t b,
                                                                                v16 acc[Q6_TILE_ROWS]) {
    q6_16_words w; /* its high words only */
    q6_16_load_high(high, &w);
    v16i total[Q6_TILE_ROWS];
    for (int r = 0; r < R; ++r) total[r] = v16i_zero();
    for (int h = 0; h < 2; ++h)
        for (int part = 0; part < 2; ++part)
            for (int k = 0; k < 4; ++k) {
                const int s = 8 * h + 2 * k + part;
                v16i sub[Q6_TILE_ROWS];
                for (int r = 0; r < R; ++r) sub[r] = v16i_set1(j->xo[(m0 + r) * (j->K / 16) + b * 16 + s]);
                for (int i = 0; i < 4; ++i) {
                    const v16i v = q6_16_coarse_values(w.high[8 * h + 4 * part + i], k);
                    for (int r = 0; r < R; ++r)
                        sub[r] = dot_u8_lanes_vnni16(sub[r], v,
                                                     i8x4_broadcast16(j->xq + (m0 + r) * j->K + b * 256 + 16 * s + 4 * i));
                }
                const v16i sc = q6_16_scale(&w, s);
                for (int r = 0; r < R; ++r) total[r] = v16i_add(total[r], v16i_mul(sub[r], sc));
            }
    q6_16_chain(j, w.d, total, m0, R, b, acc);
}

/* the coarse pass's tile of R rows by the 16 columns n0 … n0 + 15 */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_16_coarse_tile(const quant_job *j, int64_t m0, int R,
                                                                                int64_t n0) {
    v16 acc[Q6_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = v16_zero();
    for (int64_t b = 0; b < j->K / 256; ++b) {
        const uint8_t *low, *high;
        q6_x16_at(j, n0, b, &low, &high);
        q6_16_coarse_rows(j, high, m0, R, b, acc);
    }
    for (int r = 0; r < R; ++r) v16_store(j->y + (m0 + r) * j->N + n0, acc[r]);
}

/* a coarse tile with R made a constant */
TARGET_VNNI static void q6_16_coarse_tile_sized(const quant_job *j, int64_t m0, int R, int64_t n0) {
#define Q616CASE(r) case r: q6_16_coarse_tile(j, m0, r, n0); break;
    switch (R) {
        Q616CASE(1) Q616CASE(2) Q616CASE(3) Q616CASE(4) Q616CASE(5) Q616CASE(6)
        default: break;
    }
#undef Q616CASE
}

/* the coarse pass's columns c0 … c1 − 1 (whole 16-row tiles), by balanced groups of at most
 * Q6_TILE_ROWS rows */
TARGET_VNNI static void q6_16_coarse_columns(const quant_job *j, int64_t c0, int64_t c1) {
    const int64_t groups = (j->M + Q6_TILE_ROWS - 1) / Q6_TILE_ROWS;
    for (int64_t n = c0; n < c1; n += 16)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t m0 = j->M * g / groups, m1 = j->M * (g + 1) / groups;
            q6_16_coarse_tile_sized(j, m0, (int)(m1 - m0), n);
        }
}

/* columns c0 … c1 − 1 of the product (`coarse`: of the coarse pass): on AVX512-VNNI interleaved
 * weights, or more than Q6_COLUMN_ROWS rows, by 16 columns (q6_16_columns, q6_16_coarse_columns);
 * else over chunks of Q6_ROW_CHUNK rows, up to Q6_ROWS (AVX2) or Q6_COLUMN_ROWS (VNNI) rows in
 * tiles of columns n and n + half, one odd column alone; more rows by balanced groups of at most
 * Q6_ROWS rows one column at a time (interleaved weights on AVX2: the columns put together a word at
 * a time, q6_at) */
static void q6_columns(const quant_job *j, int64_t c0, int64_t c1, int vnni, int coarse) {
    if (vnni && (j->x16 || (j->M > Q6_COLUMN_ROWS && !coarse))) {
        if (coarse) q6_16_coarse_columns(j, c0, c1);
        else q6_16_columns(j, c0, c1);
        return;
    }
    const int few = vnni ? Q6_COLUMN_ROWS : Q6_ROWS;
    const int64_t half = (c1 - c0) / 2;
    for (int64_t r0 = 0; r0 < j->M; r0 += Q6_ROW_CHUNK) {
        const int64_t r1 = r0 + Q6_ROW_CHUNK < j->M ? r0 + Q6_ROW_CHUNK : j->M;
        if (j->M <= few) {
            for (int64_t n = c0; n < c0 + half; ++n) q6_group_tiles(j, r0, r1, few, n, 2, half, vnni, coarse);
            if ((c1 - c0) % 2) q6_group_tiles(j, r0, r1, few, c1 - 1, 1, 1, vnni, coarse);
            continue;
        }
        for (int64_t n = c0; n < c1; ++n) q6_group_tiles(j, r0, r1, Q6_ROWS, n, 1, 1, vnni, coarse);
    }
}
