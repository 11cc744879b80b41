/* The Q6_K product's tiles (`cpu/quant.c` includes this file after its job type and sends Q6_K
 * weights here): y[M, N] = x[M, K] @ Wᵀ, W in GGUF's Q6_K super-blocks of 256 values, 210 bytes
 * (`kernels/quant/formats.py`), x rounded per row to ggml's Q8_K (int8 blocks of 256, a float32
 * scale dx each: `formats.quantize_rows_q8` with block 256).
 *
 * Per output (row m, column n) the float work is one fixed chain: per super-block b in order, 8 int32
 * lanes (lane i: values 4i … 4i + 3 of each 32 of the block), each the exact integer sum over its 32
 * values of sc_j · (q − 32) · x, q the 6-bit value (0 … 63) and sc_j the int8 scale of the value's
 * sub-block of 16, at most 32 · 32 · 127 · 128 < 2^24 in magnitude and so converted to float exactly,
 * fused-multiply-added times d_b · dx_b rounded to float32 into 8 float32 lanes starting at zero; then
 * the lanes summed as `hsum8` sums them. The −32 goes through the activations: per call, each row's
 * offsets are computed once (`q6_offsets`) in the form the path takes. The integer sums, each path
 * its own way to the same integers:
 *   AVX2: per 32 values, maddubs(q, x) less the offsets 32 · x's pair sums in 16 bits (both terms and
 *         their difference fit), times the two sub-blocks' scales by madd; up to Q6_ROWS rows in tiles
 *         of two distant columns, more one column at a time by groups of up to Q6_ROWS rows.
 *   AVX512-VNNI: per 32 values, dpbusd(q, x) from the offsets −32 · x's lane sums (each lane
 *         Σ (q − 32) · x, within ±16256: an int16), times its sub-block's scale by dpwssd (the scale in
 *         the lane's low half, 0 in its high half), two chunks of 32 per 512-bit instruction (the low
 *         8 lanes one chunk's, the high 8 the next's, added lane by lane per super-block); up to
 *         Q6_FEW_ROWS rows in tiles of two distant columns, more in tiles of Q6_VROWS rows by Q6_VCOLS
 *         neighbouring columns.
 * Nothing in the chain depends on the other rows of the call, the thread count, the tile or the
 * path, so a row's bits are the same in any batch, at any thread count, on either path:
 * tests/kernels/quant/test_products.py. */

/* Few rows take tiles of two columns n and n + half of the part's (each super-block decoded once for
 * all rows): the weight read as two sequential streams (neighbouring columns would interleave them, and
 * the prefetchers lose the stream), the activations loaded once for both */
#define Q6_ROWS 4       /* AVX2: rows one decoded super-block meets before the next */
#define Q6_FEW_ROWS 8   /* AVX512-VNNI: up to this many rows in one tile of two distant columns */
#define Q6_VROWS 6      /* more rows: tiles of up to Q6_VROWS rows by Q6_VCOLS neighbouring columns */
#define Q6_VCOLS 2
#define Q6_ROW_CHUNK 64 /* rows whose activations stay in cache while the columns pass */
#define Q6_BYTES 210

/* AVX2's super-block decoded: its 256 values q (0 … 63) in value order, 32 per vector; per 32 values
 * the scales of their two sub-blocks as madd takes them, [sc_2c × 8 | sc_2c+1 × 8] int16; d */
typedef struct {
    v8i q[8], sc[8];
    float d;
} q6_block;

/* each row's −32 offsets, per 32 of xq one vector (xo [M, K / 4] int32): AVX2 the 16-bit pair sums
 * 32 · (x_2i + x_2i+1), VNNI the 32-bit lane sums −32 · (x_4i + … + x_4i+3) */
static void q6_offsets(const int8_t *xq, int64_t M, int64_t K, int vnni, int32_t *xo) {
    for (int64_t i = 0; i < M * K; i += 32) {
        const v8i x = v8i_load(xq + i);
        v8i_store(xo + i / 4, vnni ? i8x32_lane_sums(x, -32) : i8x32_pair_sums(x, 32));
    }
}

/* ggml's layout: half h (128 values) takes ql[64h …] and qh[32h …]; its 32 values 32k + l are the
 * low (k < 2) or high nibble of ql[64h + 32(k % 2) + l] with bits 2k, 2k + 1 of qh[32h + l] above
 * (moved to bits 4, 5 by a 16-bit shift of 4 − 2k; the nibble and the bits masked) */
static inline __attribute__((always_inline)) void q6_decode_avx2(const uint8_t *blk, q6_block *out) {
    for (int h = 0; h < 2; ++h) {
        const v8i ql0 = v8i_load(blk + 64 * h), ql1 = v8i_load(blk + 64 * h + 32), qh = v8i_load(blk + 128 + 32 * h);
        out->q[4 * h] = u8x32_six_bits_or(u8x32_low_nibbles(ql0), u8x32_shifted16(qh, 4));
        out->q[4 * h + 1] = u8x32_six_bits_or(u8x32_low_nibbles(ql1), u8x32_shifted16(qh, 2));
        out->q[4 * h + 2] = u8x32_six_bits_or(u8x32_high_nibbles(ql0), qh);
        out->q[4 * h + 3] = u8x32_six_bits_or(u8x32_high_nibbles(ql1), u8x32_shifted16(qh, -2));
    }
    const v8i lo = i16_pairs_of_i8x8((const int8_t *)(blk + 192)), hi = i16_pairs_of_i8x8((const int8_t *)(blk + 200));
    for (int c = 0; c < 8; ++c) out->sc[c] = v8i_pair_spread(c < 4 ? lo : hi, 2 * c % 8);
    out->d = f16_value(half_at(blk + 208));
}

/* VNNI's super-block decoded: its values two chunks of 32 per vector (chunks 2p, 2p + 1 in q[p]), the
 * scales as dpwssd takes them (sc[p]: sc_4p … sc_4p+3, 4 lanes each, low halves); d */
typedef struct {
    v16i q[4], sc[4];
    float d;
} q6_block_vnni;

/* half h's two vectors from ql[64h …] (its 4 chunks' nibbles, in order) and qh[32h …] twice, the low
 * half as it is and the high half 2 bits lower (chunks 4h + 1, 4h + 3 take bits 2-3, 6-7) */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_decode_vnni(const uint8_t *blk, q6_block_vnni *out) {
    for (int h = 0; h < 2; ++h) {
        const v16i ql = v16i_load(blk + 64 * h), qh = u8x64_qh_twice(blk + 128 + 32 * h);
        out->q[2 * h] = u8x64_six_bits_or(u8x64_low_nibbles(ql), v16i_shifted_left32(qh, 4));
        out->q[2 * h + 1] = u8x64_six_bits_or(u8x64_high_nibbles(ql), qh);
    }
    const v16i sc = i16_lanes_of_i8x16((const int8_t *)(blk + 192));
    for (int p = 0; p < 4; ++p) out->sc[p] = v16i_quad_spread(sc, 4 * p);
    out->d = f16_value(half_at(blk + 208));
}

/* the 8 exact lane sums of a decoded super-block by 256 int8 activations x and their offsets xo
 * (VNNI: two dpwssd chains, the low and the high lanes folded at the end) */
static inline __attribute__((always_inline)) v8i q6_lanes_avx2(const q6_block *w, const int8_t *x, const int32_t *xo) {
    v8i sum = v8i_zero();
    for (int c = 0; c < 8; ++c)
        sum = v8i_add(sum, dot_u6_offset_scaled_lanes(w->q[c], v8i_load(x + 32 * c), v8i_load(xo + 8 * c), w->sc[c]));
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

/* AVX2: rows m0 … m0 + R − 1 (R <= Q6_ROWS) by the C <= 2 columns n0, n0 + step, over all K */
static inline __attribute__((always_inline)) void q6_tile_avx2(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                                               int64_t step) {
    const int64_t nb = j->K / 256;
    v8 acc[Q6_ROWS][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = v8_zero();
    for (int64_t b = 0; b < nb; ++b) {
        q6_block w[2];
        for (int c = 0; c < C; ++c) {
            const uint8_t *blk = j->w + (n0 + c * step) * j->row_bytes + b * Q6_BYTES;
            for (int line = 0; line < Q6_BYTES; line += 64) prefetch_l1(blk + 2 * j->row_bytes + line);
            q6_decode_avx2(blk, &w[c]);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t *x = j->xq + (m0 + r) * j->K + b * 256;
            const int32_t *xo = j->xo + (m0 + r) * (j->K / 4) + b * 64;
            const float dx = j->xd[(m0 + r) * nb + b];
            for (int c = 0; c < C; ++c)
                acc[r][c] = v8_fmadd(v8_set1(w[c].d * dx), v8i_to_float(q6_lanes_avx2(&w[c], x, xo)), acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c * step] = hsum8(acc[r][c]);
}

/* an AVX2 tile with R and C made constants */
static void q6_tile_avx2_sized(const quant_job *j, int64_t m0, int R, int64_t n0, int C, int64_t step) {
#if Q6_ROWS != 4
#error "quant_q6k.h: a tile shape that q6_tile_avx2_sized does not instantiate"
#endif
#define Q6CASE(r, c) case (r) * 4 + (c): q6_tile_avx2(j, m0, r, n0, c, step); break;
    switch (R * 4 + C) {
        Q6CASE(1, 1) Q6CASE(2, 1) Q6CASE(3, 1) Q6CASE(4, 1) Q6CASE(1, 2) Q6CASE(2, 2) Q6CASE(3, 2) Q6CASE(4, 2)
        default: break;
    }
#undef Q6CASE
}

/* VNNI: rows m0 … m0 + R − 1 (R <= Q6_FEW_ROWS) by the C <= Q6_VCOLS columns n0, n0 + step, … over all
 * K; each column's super-blocks prefetched two columns ahead in its stream (the tiles read each stream
 * in order: neighbouring columns C at a time, step 1, or one column of each of C streams) */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_tile_vnni(const quant_job *j, int64_t m0, int R,
                                                                           int64_t n0, int C, int64_t step) {
    const int64_t nb = j->K / 256;
    v8 acc[Q6_FEW_ROWS][Q6_VCOLS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = v8_zero();
    for (int64_t b = 0; b < nb; ++b) {
        q6_block_vnni w[Q6_VCOLS];
        for (int c = 0; c < C; ++c) {
            const uint8_t *blk = j->w + (n0 + c * step) * j->row_bytes + b * Q6_BYTES;
            const uint8_t *ahead = blk + 2 * (step == 1 ? C : 1) * j->row_bytes;
            for (int line = 0; line < Q6_BYTES; line += 64) prefetch_l1(ahead + line);
            q6_decode_vnni(blk, &w[c]);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t *x = j->xq + (m0 + r) * j->K + b * 256;
            const int32_t *xo = j->xo + (m0 + r) * (j->K / 4) + b * 64;
            const float dx = j->xd[(m0 + r) * nb + b];
            for (int c = 0; c < C; ++c)
                acc[r][c] = v8_fmadd(v8_set1(w[c].d * dx), v8i_to_float(q6_lanes_vnni(&w[c], x, xo)), acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c * step] = hsum8(acc[r][c]);
}

/* a VNNI tile with R and C made constants */
TARGET_VNNI static void q6_tile_vnni_sized(const quant_job *j, int64_t m0, int R, int64_t n0, int C, int64_t step) {
#if Q6_FEW_ROWS != 8 || Q6_VROWS > Q6_FEW_ROWS || Q6_VCOLS != 2
#error "quant_q6k.h: a tile shape that q6_tile_vnni_sized does not instantiate"
#endif
#define Q6CASE(r, c) case (r) * 4 + (c): q6_tile_vnni(j, m0, r, n0, c, step); break;
    switch (R * 4 + C) {
        Q6CASE(1, 1) Q6CASE(2, 1) Q6CASE(3, 1) Q6CASE(4, 1) Q6CASE(5, 1) Q6CASE(6, 1) Q6CASE(7, 1) Q6CASE(8, 1)
        Q6CASE(1, 2) Q6CASE(2, 2) Q6CASE(3, 2) Q6CASE(4, 2) Q6CASE(5, 2) Q6CASE(6, 2) Q6CASE(7, 2) Q6CASE(8, 2)
        default: break;
    }
#undef Q6CASE
}

/* rows r0 … r1 − 1 in balanced groups of at most `most` rows, by the C columns n, n + step, … */
static void q6_group_tiles(const quant_job *j, int64_t r0, int64_t r1, int most, int64_t n, int C, int64_t step,
                           int vnni) {
    const int64_t groups = (r1 - r0 + most - 1) / most;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
        if (vnni) q6_tile_vnni_sized(j, m0, (int)(m1 - m0), n, C, step);
        else q6_tile_avx2_sized(j, m0, (int)(m1 - m0), n, C, step);
    }
}

/* columns c0 … c1 − 1 of the product, over chunks of Q6_ROW_CHUNK rows: up to Q6_ROWS (AVX2) or
 * Q6_FEW_ROWS (VNNI) rows in tiles of columns n and n + half, one odd column alone; more rows by
 * balanced groups of at most Q6_ROWS rows one column at a time (AVX2) or Q6_VROWS rows by Q6_VCOLS
 * neighbouring columns (VNNI) */
static void q6_columns(const quant_job *j, int64_t c0, int64_t c1, int vnni) {
    const int few = vnni ? Q6_FEW_ROWS : Q6_ROWS, most = vnni ? Q6_VROWS : Q6_ROWS, cols = vnni ? Q6_VCOLS : 1;
    const int64_t half = (c1 - c0) / 2;
    for (int64_t r0 = 0; r0 < j->M; r0 += Q6_ROW_CHUNK) {
        const int64_t r1 = r0 + Q6_ROW_CHUNK < j->M ? r0 + Q6_ROW_CHUNK : j->M;
        if (j->M <= few) {
            for (int64_t n = c0; n < c0 + half; ++n) q6_group_tiles(j, r0, r1, few, n, 2, half, vnni);
            if ((c1 - c0) % 2) q6_group_tiles(j, r0, r1, few, c1 - 1, 1, 1, vnni);
            continue;
        }
        for (int64_t n = c0; n < c1;) {
            const int C = n + cols <= c1 ? cols : 1;
            q6_group_tiles(j, r0, r1, most, n, C, 1, vnni);
            n += C;
        }
    }
}
