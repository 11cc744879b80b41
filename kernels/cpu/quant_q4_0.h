/* Q4_0's tiles by columns (`cpu/quant.c`'s products, included by quant_tiles.h once per ISA, with
 * its macros): a tile holds 8 weight rows in the lanes of one vector (16 in 512-bit vectors where
 * QWIDE), their nibble words transposed as they are read, and keeps one float sum per output
 * (quant.c's header says which). */

/* block b of 8 Q4_0 weight rows decoded (`q4_cols`): the rows' 32 nibbles each as 8 vectors of 4
 * bytes per lane (the low nibbles of bytes 4k … 4k + 3 for k < 4, the high ones of bytes 4(k − 4) …
 * for k >= 4: the values 4k … 4k + 3, met by the same activations), and their scales */
QTARGET static inline __attribute__((always_inline)) void QS(decode_q4)(const quant_job *j, const uint8_t *const row[8],
                                                                       int64_t b, q4_cols *out, int64_t ahead_rows) {
    const uint8_t *nibbles[8];
    uint16_t half[8];
    for (int c = 0; c < 8; ++c) {
        nibbles[c] = row[c] + b * 18 + 2;
        half[c] = half_at(nibbles[c] - 2);
    }
    /* the tiles read 8 (or 16) whole weight rows each, streams the hardware's prefetch does not
     * follow: the next tile's rows (ahead_rows on, into L1) and the one after (into L2), the same
     * share of their bytes, 144 a block (from one to sixteen tiles on, the nearest were the fastest
     * streamed from memory) */
    const uint8_t *ahead = row[0] + ahead_rows * j->row_bytes + b * 144;
    const uint8_t *further = row[0] + 2 * ahead_rows * j->row_bytes + b * 144;
    prefetch_l1(ahead), prefetch_l1(ahead + 64), prefetch_l1(ahead + 128);
    prefetch_l2(further), prefetch_l2(further + 64), prefetch_l2(further + 128);
    v8i words[4];
    u32x8_transposed16(nibbles, words);
    for (int k = 0; k < 4; ++k) out->q[k] = u8x32_low_nibbles(words[k]), out->q[k + 4] = u8x32_high_nibbles(words[k]);
    out->dw = f16x8(half);
}

/* rows m0 … m0 + R − 1 by a decoded block b: per lane the exact integer sum −8 · Σx + Σ q·x, scaled
 * by dw · dx into the chain of b's parity */
QTARGET static inline __attribute__((always_inline)) void QS(rows_q4)(const quant_job *j, const q4_cols *w, int64_t m0,
                                                                     int R, int64_t b, v8 acc[Q4_ROWS][2],
                                                                     int parity) {
    const int64_t nb = j->K / 32;
    for (int r = 0; r < R; ++r) {
        const int8_t *x = j->xq + (m0 + r) * j->K + b * 32;
        v8i even = v8i_set1(-8 * j->xs[(m0 + r) * nb + b]), odd = v8i_zero(); /* two chains: half the latency */
        for (int k = 0; k < 8; k += 2) {
            even = QDOT4(even, w->q[k], i8x4_broadcast(x + 4 * k));
            odd = QDOT4(odd, w->q[k + 1], i8x4_broadcast(x + 4 * k + 4));
        }
        const v8i lanes = v8i_add(even, odd);
        acc[r][parity] = v8_fmadd(v8_mul(w->dw, v8_set1(j->xd[(m0 + r) * nb + b])), v8i_to_float(lanes), acc[r][parity]);
    }
}

/* block b of a Q4_0 tile: from `decoded` (the tile's blocks decoded before) or decoded here */
QTARGET static inline __attribute__((always_inline)) void QS(block_q4)(const quant_job *j, const uint8_t *const row[8],
                                                                      const q4_cols *decoded, int64_t m0, int R,
                                                                      int64_t b, v8 acc[Q4_ROWS][2], int parity) {
    if (decoded) {
        QS(rows_q4)(j, decoded + b, m0, R, b, acc, parity);
    } else {
        q4_cols w;
        QS(decode_q4)(j, row, b, &w, 8);
        QS(rows_q4)(j, &w, m0, R, b, acc, parity);
    }
}

/* a Q4_0 tile of R rows by 8 columns, lane c column n0 + c (columns past the first C are not
 * stored): per output two float chains, the even blocks' and the odd blocks', added at the end */
QTARGET static inline __attribute__((always_inline)) void QS(tile_q4)(const quant_job *j, int64_t m0, int R,
                                                                     int64_t n0, int C, const q4_cols *decoded) {
    const int64_t nb = j->K / 32;
    const uint8_t *row[8];
    tile_rows(j, n0, C, 8, row);
    v8 acc[Q4_ROWS][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8_zero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        QS(block_q4)(j, row, decoded, m0, R, b, acc, 0);
        QS(block_q4)(j, row, decoded, m0, R, b + 1, acc, 1);
    }
    if (b < nb) QS(block_q4)(j, row, decoded, m0, R, b, acc, 0);
    for (int r = 0; r < R; ++r) {
        float out[8];
        v8_store(out, v8_add(acc[r][0], acc[r][1]));
        memcpy(j->y + (m0 + r) * j->N + n0, out, (size_t)C * sizeof *out);
    }
}

/* a Q4_0 tile with R made a constant, and whether its blocks come decoded */
QTARGET static void QS(tile_q4_sized)(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                      const q4_cols *decoded) {
#define Q4CASE(r)                                                              \
    case r:                                                                    \
        if (decoded) QS(tile_q4)(j, m0, r, n0, C, decoded);                    \
        else QS(tile_q4)(j, m0, r, n0, C, NULL);                               \
        break;
    switch (R) {
        Q4CASE(1) Q4CASE(2)
#if Q4_ROWS > 2
        Q4CASE(3) Q4CASE(4)
#endif
#if Q4_ROWS > 4
        Q4CASE(5) Q4CASE(6)
#endif
        default: break;
    }
#undef Q4CASE
}

#ifdef QWIDE
/* 16 columns in the 16 lanes of 512-bit vectors (AVX512-VNNI): two 8-column tiles side by side, each
 * lane the chain it has in tile_q4, so the same bits; a row's block work is then one instruction for
 * 16 outputs where tile_q4's is one for 8 (the activations' broadcasts and the scale products shared) */
typedef struct {
    v16i q[8];
    v16 dw;
} q4_cols16;
_Static_assert(sizeof(q4_cols16) <= Q4_DECODED && sizeof(q4_cols) <= Q4_DECODED, "Q4_DECODED: a decoded block's bytes");

/* block b of the 16 rows row[0] … row[15] decoded, rows 8 … 15 in the high lanes */
QTARGET static inline __attribute__((always_inline)) void QS(decode_q4_wide)(const quant_job *j,
                                                                            const uint8_t *const row[16], int64_t b,
                                                                            q4_cols16 *out) {
    q4_cols lo, hi;
    QS(decode_q4)(j, row, b, &lo, 16);
    QS(decode_q4)(j, row + 8, b, &hi, 16);
    for (int k = 0; k < 8; ++k) out->q[k] = v16i_from_halves(lo.q[k], hi.q[k]);
    out->dw = v16_from_halves(lo.dw, hi.dw);
}

/* rows_q4 over 16 columns */
QTARGET static inline __attribute__((always_inline)) void QS(rows_q4_wide)(const quant_job *j, const q4_cols16 *w,
                                                                          int64_t m0, int R, int64_t b,
                                                                          v16 acc[Q4_ROWS][2], int parity) {
    const int64_t nb = j->K / 32;
    for (int r = 0; r < R; ++r) {
        const int8_t *x = j->xq + (m0 + r) * j->K + b * 32;
        v16i even = v16i_set1(-8 * j->xs[(m0 + r) * nb + b]), odd = v16i_zero();
        for (int k = 0; k < 8; k += 2) {
            even = dot_u8_lanes_vnni16(even, w->q[k], i8x4_broadcast16(x + 4 * k));
            odd = dot_u8_lanes_vnni16(odd, w->q[k + 1], i8x4_broadcast16(x + 4 * k + 4));
        }
        acc[r][parity] = v16_fmadd(v16_mul(w->dw, v16_set1(j->xd[(m0 + r) * nb + b])),
                                   v16i_to_float(v16i_add(even, odd)), acc[r][parity]);
    }
}

/* block b of a 16-column tile: from `decoded` or decoded here */
QTARGET static inline __attribute__((always_inline)) void QS(block_q4_wide)(const quant_job *j,
                                                                           const uint8_t *const row[16],
                                                                           const q4_cols16 *decoded, int64_t m0,
                                                                           int R, int64_t b, v16 acc[Q4_ROWS][2],
                                                                           int parity) {
    if (decoded) {
        QS(rows_q4_wide)(j, decoded + b, m0, R, b, acc, parity);
    } else {
        q4_cols16 w;
        QS(decode_q4_wide)(j, row, b, &w);
        QS(rows_q4_wide)(j, &w, m0, R, b, acc, parity);
    }
}

/* tile_q4 over 16 columns (lane c column n0 + c; columns past the first C, C > 8, not stored) */
QTARGET static inline __attribute__((always_inline)) void QS(tile_q4_wide)(const quant_job *j, int64_t m0, int R,
                                                                          int64_t n0, int C,
                                                                          const q4_cols16 *decoded) {
    const int64_t nb = j->K / 32;
    const uint8_t *row[16];
    tile_rows(j, n0, C, 16, row);
    v16 acc[Q4_ROWS][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v16_zero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        QS(block_q4_wide)(j, row, decoded, m0, R, b, acc, 0);
        QS(block_q4_wide)(j, row, decoded, m0, R, b + 1, acc, 1);
    }
    if (b < nb) QS(block_q4_wide)(j, row, decoded, m0, R, b, acc, 0);
    for (int r = 0; r < R; ++r) {
        float out[16];
        v16_store(out, v16_add(acc[r][0], acc[r][1]));
        memcpy(j->y + (m0 + r) * j->N + n0, out, (size_t)C * sizeof *out);
    }
}

/* a 16-column tile with R made a constant, and whether its blocks come decoded */
QTARGET static void QS(tile_q4_wide_sized)(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                           const q4_cols16 *decoded) {
#define Q4CASE(r)                                                              \
    case r:                                                                    \
        if (decoded) QS(tile_q4_wide)(j, m0, r, n0, C, decoded);               \
        else QS(tile_q4_wide)(j, m0, r, n0, C, NULL);                          \
        break;
    switch (R) {
        Q4CASE(1) Q4CASE(2) Q4CASE(3) Q4CASE(4) Q4CASE(5) Q4CASE(6)
        default: break;
    }
#undef Q4CASE
}
#endif

/* columns c0 … c1 − 1 of a Q4_0 product: 8 columns at a time (with QWIDE, 16 where more than 8 are
 * left) by balanced groups of at most Q4_ROWS rows, over chunks of ROW_CHUNK rows; where a chunk has
 * more than one group, its columns' blocks are decoded once into `decoded` (Q4_DECODED bytes a block;
 * NULL: each group decodes them) */
QTARGET static void QS(columns_q4)(const quant_job *j, int64_t c0, int64_t c1, void *decoded) {
    for (int64_t r0 = 0; r0 < j->M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < j->M ? r0 + ROW_CHUNK : j->M, groups = (r1 - r0 + Q4_ROWS - 1) / Q4_ROWS;
        for (int64_t n = c0; n < c1;) {
#ifdef QWIDE
            if (c1 - n > 8) {
                const int C = (int)(c1 - n < 16 ? c1 - n : 16);
                const q4_cols16 *from = NULL;
                if (groups > 1 && decoded) {
                    const uint8_t *row[16];
                    tile_rows(j, n, C, 16, row);
                    for (int64_t b = 0; b < j->K / 32; ++b) QS(decode_q4_wide)(j, row, b, (q4_cols16 *)decoded + b);
                    from = decoded;
                }
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                    QS(tile_q4_wide_sized)(j, m0, (int)(m1 - m0), n, C, from);
                }
                n += C;
                continue;
            }
#endif
            const int C = (int)(c1 - n < 8 ? c1 - n : 8);
            const q4_cols *from = NULL;
            if (groups > 1 && decoded) {
                const uint8_t *row[8];
                tile_rows(j, n, C, 8, row);
                for (int64_t b = 0; b < j->K / 32; ++b) QS(decode_q4)(j, row, b, (q4_cols *)decoded + b, 8);
                from = decoded;
            }
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                QS(tile_q4_sized)(j, m0, (int)(m1 - m0), n, C, from);
            }
            n += C;
        }
    }
}
