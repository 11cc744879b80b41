/* Q4_K's tiles (`cpu/quant.c`'s products, included by quant_tiles.h once per ISA, with its macros):
 * AVX2's in 256-bit vectors, AVX512-VNNI's (QWIDE_K) in 512-bit ones, the same chains; and the
 * columns of a call whose rows are one tile's. */

/* super-block b's head for columns col[0], col[1] (C = 1: the same column twice), what both ISAs'
 * tiles decode alike: the scales and mins of both (sm; the mins as int16, mn), d per column, dmin */
typedef struct {
    v8i sm, mn;
    v8 d[2], dmin;
} QS(k_head);

QTARGET static inline __attribute__((always_inline)) QS(k_head) QS(k_head_of)(const quant_job *j, const uint8_t *const blk[2],
                                                                              int C) {
    /* the same super-block two tiles on (into L1) and eight on (into L2), as Q8_0's tiles: the tiles
     * read the weight in order, C rows at a time, and without these the hardware's prefetch kept up
     * only with rows of at most 4 super-blocks (K = 1024: 17 GB/s streamed; K = 2048: 6) */
    for (int c = 0; c < C; ++c) {
        const uint8_t *ahead = blk[c] + 2 * C * j->row_bytes, *further = blk[c] + 8 * C * j->row_bytes;
        prefetch_l1(ahead), prefetch_l1(ahead + 64), prefetch_l1(ahead + 128);
        prefetch_l2(further), prefetch_l2(further + 64), prefetch_l2(further + 128);
    }
    QS(k_head) h;
    h.sm = u8x32_k_scales_mins(u8x32_load_halves(blk[0] + 4, blk[1] + 4));
    h.mn = u8x32_k_mins16(h.sm);
    const v8 pairs = f16x4_pairs(blk[0], blk[1]); /* [d0, dmin0, d1, dmin1, 0 …] */
    h.dmin = v8_halves_of(pairs, 1, 3);
    h.d[0] = v8_halves_of(pairs, 0, 0), h.d[1] = v8_halves_of(pairs, 2, 2);
    return h;
}

/* row m's mins' part of super-block b, dmin · dx · Σ m_j · xsum_j, into its chain (lane 4c: column
 * c's); dx as a vector */
QTARGET static inline __attribute__((always_inline)) v8 QS(k_mins)(const quant_job *j, const QS(k_head) *h, int64_t m,
                                                                  int64_t b, v8 dx, v8 mins) {
    const v8i msum = i16x16_half_dots(h->mn, u8x32_load_twice(j->xs16 + m * (j->K / 32) + b * 8));
    return v8_fmadd(v8_mul(h->dmin, dx), v8i_to_float(msum), mins);
}

/* the tile's outputs: each column's lanes summed, less its mins' chain */
QTARGET static inline __attribute__((always_inline)) void QS(k_store)(const quant_job *j, int64_t m0, int R, int64_t n0,
                                                                     int C, v8 acc[ACC_ROWS][ACC_COLS],
                                                                     const v8 mins[ACC_ROWS]) {
    for (int r = 0; r < R; ++r) {
        float m[8];
        v8_store(m, mins[r]);
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c] = hsum8(acc[r][c]) - m[4 * c];
    }
}

#ifndef QWIDE_K
/* super-block b of a Q4_K tile (AVX2): each column's 8 sub-blocks' integer sums times their 6-bit
 * scales (exact, maddubs then madd by the scale), times d · dx into the column's 8 float lanes; the
 * mins' part into each row's chain */
QTARGET static inline __attribute__((always_inline)) void QS(k_block)(const quant_job *j, const uint8_t *const blk[2],
                                                                     const QS(k_head) *h, int64_t m0, int R, int C,
                                                                     int64_t b, v8 acc[ACC_ROWS][ACC_COLS],
                                                                     v8 mins[ACC_ROWS]) {
    v8i wq[TILE_COLS][8], sv[TILE_COLS][8];
    for (int c = 0; c < C; ++c) {
        const v8i own = u8x32_half_twice(h->sm, c);
        for (int s = 0; s < 8; ++s) sv[c][s] = u8x32_k_scale16(own, s);
    }
    for (int c = 0; c < C; ++c)
        for (int chunk = 0; chunk < 4; ++chunk) { /* low nibbles: sub-block 2·chunk, high: the next */
            const v8i raw = v8i_load(blk[c] + 16 + 32 * chunk);
            wq[c][2 * chunk] = u8x32_low_nibbles(raw);
            wq[c][2 * chunk + 1] = u8x32_high_nibbles(raw);
        }
    for (int r = 0; r < R; ++r) {
        const int8_t *xb = j->xq + (m0 + r) * j->K + b * 256;
        const v8 dx = v8_set1(j->xd[(m0 + r) * (j->K / 256) + b]);
        mins[r] = QS(k_mins)(j, h, m0 + r, b, dx, mins[r]);
        for (int c = 0; c < C; ++c) {
            v8i isum[2] = {v8i_zero(), v8i_zero()}; /* two chains of dot products in flight */
            for (int s = 0; s < 8; ++s)
                isum[s & 1] = v8i_add(isum[s & 1], dot_u4_vscaled_lanes(wq[c][s], v8i_load(xb + 32 * s), sv[c][s]));
            acc[r][c] = v8_fmadd(v8_mul(h->d[c], dx), v8i_to_float(v8i_add(isum[0], isum[1])), acc[r][c]);
        }
    }
}
#else
/* super-block b of a Q4_K tile (AVX512-VNNI), 512-bit vectors: the same integer sums
 * (`dot_u4x2_scaled_lanes_vnni16`: two chunks of weights, four sub-blocks, per instruction, the
 * activations paired as k_pair_activations lays them; the low 8 lanes sum sub-blocks 0, 1, 4, 5, the
 * high 8 sub-blocks 2, 3, 6, 7, added at the end) into the same chains as AVX2's */
QTARGET static inline __attribute__((always_inline)) void QS(k_block)(const quant_job *j, const uint8_t *const blk[2],
                                                                     const QS(k_head) *h, int64_t m0, int R, int C,
                                                                     int64_t b, v8 acc[ACC_ROWS][ACC_COLS],
                                                                     v8 mins[ACC_ROWS]) {
    v16i lo[TILE_COLS][2], hi[TILE_COLS][2], duo[TILE_COLS][2];
    v16i start[TILE_COLS];
    const v8i duos = u8x32_k_scale_duos(h->sm);
    for (int c = 0; c < C; ++c) {
        for (int i = 0; i < 2; ++i) { /* chunks 2i, 2i + 1: sub-blocks 4i, 4i + 2 (low), 4i + 1, 4i + 3 (high) */
            const v16i raw = v16i_load(blk[c] + 16 + 64 * i);
            lo[c][i] = u8x64_low_nibbles(raw);
            hi[c][i] = u8x64_high_nibbles16(raw);
            duo[c][i] = v16i_lanes_of(duos, 4 * c + 2 * i, 4 * c + 2 * i + 1);
        }
        /* where the sums start: −8192 · the even sub-blocks' scales (the low halves of the pairs), what
         * the dot products add beyond the exact sums */
        start[c] = k_bias_start_vnni16(duo[c][0], duo[c][1]);
    }
    for (int r = 0; r < R; ++r) {
        const int8_t *xb = j->xq + (m0 + r) * j->K + b * 256;
        const v8 dx = v8_set1(j->xd[(m0 + r) * (j->K / 256) + b]);
        mins[r] = QS(k_mins)(j, h, m0 + r, b, dx, mins[r]);
        for (int c = 0; c < C; ++c) {
            v16i isum = dot_u4x2_scaled_lanes_vnni16(start[c], lo[c][0], hi[c][0],
                                                     v16i_load(xb), v16i_load(xb + 64), duo[c][0]);
            isum = dot_u4x2_scaled_lanes_vnni16(isum, lo[c][1], hi[c][1], v16i_load(xb + 128), v16i_load(xb + 192),
                                                duo[c][1]);
            acc[r][c] = v8_fmadd(v8_mul(h->d[c], dx), v8i_to_float(v8i_add(v16i_lo(isum), v16i_hi(isum))), acc[r][c]);
        }
    }
}
#endif

/* a Q4_K tile: per super-block of 256, the 8 sub-blocks' integer sums times their 6-bit scales
 * (exact), scaled by d · dx into the float lanes; the mins' part, dmin · dx · Σ m_j · xsum_j, in a
 * float chain of its own, subtracted at the end. Two columns' scales and mins decoded at once (one
 * per 128-bit half; C = 1: the column twice), the mins' chains of a row in one vector (lane 4c:
 * column c's, each lane rounded as the scalar fmaf); k_block the ISA's products */
QTARGET static inline __attribute__((always_inline)) void QS(tile_k)(const quant_job *j, int64_t m0, int R,
                                                                    int64_t n0, int C) {
    const uint8_t *col[2] = {j->w + n0 * j->row_bytes, j->w + (n0 + C - 1) * j->row_bytes};
    v8 acc[ACC_ROWS][ACC_COLS], mins[ACC_ROWS];
    for (int r = 0; r < R; ++r) {
        mins[r] = v8_zero();
        for (int c = 0; c < C; ++c) acc[r][c] = v8_zero();
    }
    for (int64_t b = 0; b < j->K / 256; ++b) {
        const uint8_t *blk[2] = {col[0] + b * 144, col[1] + b * 144};
        const QS(k_head) h = QS(k_head_of)(j, blk, C);
        QS(k_block)(j, blk, &h, m0, R, C, b, acc, mins);
    }
    QS(k_store)(j, m0, R, n0, C, acc, mins);
}

/* Q4_K's columns c0 … c1 − 1 when its M rows are one group (M <= most): the tiles columns would
 * compute, in its order, one after another inside one call with R a constant (a tile of few rows
 * is short: a call per tile costs) */
QTARGET static void QS(k_columns)(const quant_job *j, int64_t c0, int64_t c1, int cols) {
#define KCASE(r)                                                                                   \
    case r:                                                                                        \
        for (int64_t n = c0; n < c1; n += cols == 2 && n + 2 <= c1 ? 2 : 1)                        \
            if (cols == 2 && n + 2 <= c1) QS(tile_k)(j, 0, r, n, 2);                               \
            else QS(tile_k)(j, 0, r, n, 1);                                                        \
        break;
    switch (j->M) {
        KCASE(1) KCASE(2) KCASE(3) KCASE(4)
#if TILE_ROWS > 4
        KCASE(5) KCASE(6)
#endif
        default: break;
    }
#undef KCASE
}
