/* The quantized products' tiles (`cpu/quant.c`), included once per ISA: Q8_0's here, Q4_0's
 * (quant_q4_0.h) and Q4_K's (quant_q4k.h) included below, and the columns of a call. The includer
 * defines QS(name) (the ISA's name for a function), QTARGET (its target attribute), FEW_ROWS,
 * TILE_ROWS and TILE_COLS (the shapes it computes in), QWIDE where Q8_0 tiles of up to that many
 * rows run in 512-bit vectors, QWIDE_K where Q4_K's do, Q4_ROWS (the most rows of a Q4_0 tile) and
 * the block dot product's parts (QWEIGHT_OFFSET, QACT, QDOT, QDOT4: cpu/quant.c says what each
 * is), whose lane sums
 * are the exact integers on every ISA (cpu/simd.h). A tile computes rows m0 … m0 + R − 1 by
 * columns n0 … n0 + C − 1 over all K, each output its own chain (cpu/quant.c says which), so R and
 * C change no bits. */

/* the scale products dw · dx of blocks b … b + n − 1 (n <= 8) of a Q8_0 tile, each rounded to
 * float32 as one product alone: lane k of sv[r][c] for row m0 + r, column n0 + c, block b + k */
QTARGET static inline __attribute__((always_inline)) void QS(scales_32)(const quant_job *j, int64_t m0, int R,
                                                                       int64_t n0, int C, int64_t b, int n,
                                                                       v8 sv[ACC_ROWS][ACC_COLS]) {
    const int64_t nb = j->K / 32;
    v8 dw[TILE_COLS];
    for (int c = 0; c < C; ++c) {
        uint16_t half[8] = {0};
        for (int k = 0; k < n; ++k) half[k] = half_at(j->w + (n0 + c) * j->row_bytes + (b + k) * 34);
        dw[c] = f16x8(half);
    }
    for (int r = 0; r < R; ++r) {
        float some[8] = {0};
        const float *xd = j->xd + (m0 + r) * nb + b;
        if (n < 8) memcpy(some, xd, (size_t)n * sizeof *xd), xd = some;
        const v8 dx = v8_load(xd);
        for (int c = 0; c < C; ++c) sv[r][c] = v8_mul(dw[c], dx);
    }
}

/* the same scale products as floats, scale[r][c][k]: the 256-bit tiles broadcast them from memory */
QTARGET static inline __attribute__((always_inline)) void QS(scales_32_stored)(const quant_job *j, int64_t m0, int R,
                                                                              int64_t n0, int C, int64_t b,
                                                                              int n, float scale[ACC_ROWS][ACC_COLS][8]) {
    v8 sv[ACC_ROWS][ACC_COLS];
    QS(scales_32)(j, m0, R, n0, C, b, n, sv);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) v8_store(scale[r][c], sv[r][c]);
}

/* block b of a Q8_0 tile: its 8 lanes' exact integer sums, scaled by
 * dw · dx (scale[·][·][k]), into the accumulators of b's parity */
QTARGET static inline __attribute__((always_inline)) void QS(block_32)(const quant_job *j, int64_t m0, int R,
                                                                      int64_t n0, int C, int64_t b,
                                                                      v8 acc[ACC_ROWS][ACC_COLS][2], int parity,
                                                                      float scale[ACC_ROWS][ACC_COLS][8], int k) {
    v8i wq[TILE_COLS], wo[TILE_COLS];
    for (int c = 0; c < C; ++c) {
        const uint8_t *blk = j->w + (n0 + c) * j->row_bytes + b * 34;
        prefetch_l1(blk + 2 * C * j->row_bytes);  /* the same block two tiles on: the tiles read the weight in order */
        prefetch_l2(blk + 8 * C * j->row_bytes);
        wq[c] = v8i_load(blk + 2);
        wo[c] = QWEIGHT_OFFSET(wq[c]);
    }
    for (int r = 0; r < R; ++r) {
        const v8i xa = QACT(v8i_load(j->xq + (m0 + r) * j->K + b * 32));
        for (int c = 0; c < C; ++c) {
            const v8i lanes = QDOT(wq[c], wo[c], xa);
            acc[r][c][parity] = v8_fmadd(v8_set1(scale[r][c][k]), v8i_to_float(lanes), acc[r][c][parity]);
        }
    }
}

/* a Q8_0 tile: two float chains of 8 lanes per output, the even blocks' and the odd
 * blocks' (two multiply-adds in flight: one row's chain is otherwise bound by their latency),
 * added lane by lane at the end and summed as hsum8 sums; the scale products 8 blocks at a time */
QTARGET static inline __attribute__((always_inline)) void QS(tile_32)(const quant_job *j, int64_t m0, int R,
                                                                     int64_t n0, int C) {
    const int64_t nb = j->K / 32;
    v8 acc[ACC_ROWS][ACC_COLS][2];
    float scale[ACC_ROWS][ACC_COLS][8];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = v8_zero();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        QS(scales_32_stored)(j, m0, R, n0, C, b, 8, scale);
        for (int k = 0; k < 8; k += 2) { /* parity a constant: the accumulators stay in registers */
            QS(block_32)(j, m0, R, n0, C, b + k, acc, 0, scale, k);
            QS(block_32)(j, m0, R, n0, C, b + k + 1, acc, 1, scale, k + 1);
        }
    }
    if (b < nb) {
        QS(scales_32_stored)(j, m0, R, n0, C, b, (int)(nb - b), scale);
        for (int k = 0; b + k < nb; k += 2) {
            QS(block_32)(j, m0, R, n0, C, b + k, acc, 0, scale, k);
            if (b + k + 1 < nb) QS(block_32)(j, m0, R, n0, C, b + k + 1, acc, 1, scale, k + 1);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c] = hsum8(v8_add(acc[r][c][0], acc[r][c][1]));
}

#ifdef QWIDE
/* Q8_0 blocks b and b + 1 (b + 1 where `both`) of a tile in 512-bit vectors: the lanes of block b in
 * the low 8, of b + 1 in the high 8 (b even: the even and the odd blocks' chains), each the exact
 * integer sum (the activations 128 higher by the weights, from −128 · the weights' lane sums),
 * scaled by dw · dx (lanes k and k + 1 of sv[·][·]). A missing b + 1 is zeros with a zero scale:
 * its chain gains +0, which leaves it as it is (a chain that starts at +0 is never −0) */
QTARGET static inline __attribute__((always_inline)) void QS(pair_q8)(const quant_job *j, int64_t m0, int R,
                                                                     int64_t n0, int C, int64_t b, int both,
                                                                     v16 acc[ACC_ROWS][ACC_COLS],
                                                                     v8 sv[ACC_ROWS][ACC_COLS], int k) {
    v16i wq[TILE_COLS], wo[TILE_COLS];
    for (int c = 0; c < C; ++c) {
        const uint8_t *blk = j->w + (n0 + c) * j->row_bytes + b * 34;
        prefetch_l1(blk + 2 * C * j->row_bytes);  /* two tiles on, as block_32 */
        prefetch_l1(blk + 2 * C * j->row_bytes + 34);
        prefetch_l2(blk + 8 * C * j->row_bytes);
        prefetch_l2(blk + 8 * C * j->row_bytes + 34);
        wq[c] = v16i_from_halves(v8i_load(blk + 2), both ? v8i_load(blk + 36) : v8i_zero());
        wo[c] = neg_dot_lanes_vnni16(128, wq[c]);
    }
    for (int r = 0; r < R; ++r) {
        const int8_t *x = j->xq + (m0 + r) * j->K + b * 32;
        const v16i xa = i8x64_offset(both ? v16i_load(x) : v16i_from_halves(v8i_load(x), v8i_zero()));
        for (int c = 0; c < C; ++c)
            acc[r][c] = v16_fmadd(v16_pair_broadcast(sv[r][c], k),
                                  v16i_to_float(dot_u8_lanes_vnni16(wo[c], xa, wq[c])), acc[r][c]);
    }
}

/* a Q8_0 tile of at most QWIDE rows in 512-bit vectors: the chains of tile_32 (the even blocks' in
 * the low lanes, the odd blocks' in the high), two blocks per instruction */
QTARGET static inline __attribute__((always_inline)) void QS(tile_q8_wide)(const quant_job *j, int64_t m0, int R,
                                                                          int64_t n0, int C) {
    const int64_t nb = j->K / 32;
    v16 acc[ACC_ROWS][ACC_COLS];
    v8 sv[ACC_ROWS][ACC_COLS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = v16_zero();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        QS(scales_32)(j, m0, R, n0, C, b, 8, sv);
        for (int k = 0; k < 8; k += 2) QS(pair_q8)(j, m0, R, n0, C, b + k, 1, acc, sv, k);
    }
    if (b < nb) {
        const int n = (int)(nb - b);
        QS(scales_32)(j, m0, R, n0, C, b, n, sv);
        for (int k = 0; k < n; k += 2) QS(pair_q8)(j, m0, R, n0, C, b + k, k + 1 < n, acc, sv, k);
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            j->y[(m0 + r) * j->N + n0 + c] = hsum8(v8_add(v16_lo(acc[r][c]), v16_hi(acc[r][c])));
}
#endif

#include "quant_q4_0.h" /* Q4_0's tiles by columns */
#include "quant_q4k.h"  /* Q4_K's tiles */

/* one tile of the format, R and C constants where it is inlined */
QTARGET static inline __attribute__((always_inline)) void QS(tile)(const quant_job *j, int64_t m0, int R,
                                                                  int64_t n0, int C) {
    if (j->fmt == HS_Q4_K) QS(tile_k)(j, m0, R, n0, C);
#ifdef QWIDE
    else if (R <= QWIDE) QS(tile_q8_wide)(j, m0, R, n0, C);
#endif
    else QS(tile_32)(j, m0, R, n0, C);
}

/* one tile of R rows by C columns, R and C made constants: the few-row path's (R <= FEW_ROWS, C = 1)
 * and the tiles' (R <= TILE_ROWS, C <= TILE_COLS) */
#if FEW_ROWS > 4 || TILE_ROWS > ACC_ROWS || TILE_COLS > ACC_COLS || TILE_ROWS > 6
#error "quant_tiles.h: a tile shape that tile_sized does not instantiate"
#endif
QTARGET static void QS(tile_sized)(const quant_job *j, int64_t m0, int R, int64_t n0, int C) {
#define QCASE(r, c) case (r) * 8 + (c): QS(tile)(j, m0, r, n0, c); break;
    switch (R * 8 + C) {
        QCASE(1, 1) QCASE(2, 1) QCASE(3, 1) QCASE(4, 1)
#if TILE_COLS > 1
        QCASE(1, 2) QCASE(2, 2) QCASE(3, 2) QCASE(4, 2)
#endif
#if TILE_ROWS > 4
        QCASE(5, 1) QCASE(6, 1)
#endif
#if TILE_ROWS > 4 && TILE_COLS > 1
        QCASE(5, 2) QCASE(6, 2)
#endif
        default: break;
    }
#undef QCASE
}

/* columns c0 … c1 − 1 of the product: up to FEW_ROWS rows one column at a time (the weight streamed
 * once, each block decoded once for all rows; FEW_ROWS 0: none); more rows in tiles of TILE_COLS columns by balanced
 * groups of at most TILE_ROWS rows, over chunks of ROW_CHUNK rows (the chunk's activations stay in
 * cache while the columns pass) */
QTARGET static void QS(columns)(const quant_job *j, int64_t c0, int64_t c1) {
    if (j->fmt == HS_Q4_0) { /* more rows than a tile: the blocks decoded once per chunk and 8 columns */
        void *decoded = j->M > Q4_ROWS ? aligned_alloc(64, (size_t)(j->K / 32) * Q4_DECODED) : NULL;
        QS(columns_q4)(j, c0, c1, decoded);
        free(decoded);
        return;
    }
#ifdef QWIDE_K
    if (j->fmt == HS_Q4_K && (j->M > K_COLUMN_ROWS || j->x16)) { /* 16 columns in the lanes; more rows than a tile:
                                                      * decoded once per chunk */
        k16_block *decoded = j->M > TILE_ROWS ? aligned_alloc(64, (size_t)(j->K / 256) * sizeof *decoded) : NULL;
        QS(k16_columns)(j, c0, c1, decoded);
        free(decoded);
        return;
    }
#endif
#ifndef QWIDE_K
    if (j->fmt == HS_Q4_K && j->x16) { /* interleaved: 8 columns in the lanes (quant_q4k.h's k8 tiles) */
        QS(k8_columns)(j, c0, c1);
        return;
    }
#endif
    const int64_t M = j->M;
    const int cols = M <= FEW_ROWS ? 1 : TILE_COLS, most = M <= FEW_ROWS ? FEW_ROWS : TILE_ROWS;
    if (j->fmt == HS_Q4_K && M <= most) {
        QS(k_columns)(j, c0, c1, cols);
        return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < M ? r0 + ROW_CHUNK : M, groups = (r1 - r0 + most - 1) / most;
        for (int64_t n = c0; n < c1;) {
            const int C = n + cols <= c1 ? cols : 1;
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                QS(tile_sized)(j, m0, (int)(m1 - m0), n, C);
            }
            n += C;
        }
    }
}
