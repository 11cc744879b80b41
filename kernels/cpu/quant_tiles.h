/* The quantized products' tiles (`cpu/quant.c`), included once per ISA: the includer defines
 * QS(name) (the ISA's name for a function), QTARGET (its target attribute), FEW_ROWS, TILE_ROWS and
 * TILE_COLS (the shapes it computes in), QWIDE where Q8_0 tiles of up to that many rows run in
 * 512-bit vectors, Q4_ROWS (the most rows of a Q4_0 tile) and the block dot product's parts
 * (QWEIGHT_OFFSET, QACT, QDOT, QDOT_K, QDOT4: cpu/quant.c says what each is), whose lane sums
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

/* block b of 8 Q4_0 weight rows decoded (`q4_cols`): the rows' 32 nibbles each as 8 vectors of 4
 * bytes per lane (the low nibbles of bytes 4k … 4k + 3 for k < 4, the high ones of bytes 4(k − 4) …
 * for k >= 4: the values 4k … 4k + 3, met by the same activations), and their scales */
QTARGET static inline __attribute__((always_inline)) void QS(decode_q4)(const quant_job *j, const uint8_t *const row[8],
                                                                       int64_t b, q4_cols *out) {
    const uint8_t *nibbles[8];
    uint16_t half[8];
    for (int c = 0; c < 8; ++c) {
        nibbles[c] = row[c] + b * 18 + 2;
        half[c] = half_at(nibbles[c] - 2);
    }
    /* the tiles read 8 whole weight rows each, 8 streams the hardware's prefetch does not follow: the
     * next tile (into L1) and the one after (into L2), the same share of its bytes, 144 a block (from
     * one to sixteen tiles on, the nearest were the fastest streamed from memory) */
    const uint8_t *ahead = row[0] + 8 * j->row_bytes + b * 144, *further = row[0] + 16 * j->row_bytes + b * 144;
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
        QS(decode_q4)(j, row, b, &w);
        QS(rows_q4)(j, &w, m0, R, b, acc, parity);
    }
}

/* a Q4_0 tile of R rows by 8 columns, lane c column n0 + c (columns past the first C are not
 * stored): per output two float chains, the even blocks' and the odd blocks', added at the end */
QTARGET static inline __attribute__((always_inline)) void QS(tile_q4)(const quant_job *j, int64_t m0, int R,
                                                                     int64_t n0, int C, const q4_cols *decoded) {
    const int64_t nb = j->K / 32;
    const uint8_t *row[8];
    q4_rows(j, n0, C, row);
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

/* columns c0 … c1 − 1 of a Q4_0 product: 8 columns at a time by balanced groups of at most Q4_ROWS
 * rows, over chunks of ROW_CHUNK rows; where a chunk has more than one group, its 8 columns'
 * blocks are decoded once into `decoded` ([K / 32] q4_cols; NULL: each group decodes them) */
QTARGET static void QS(columns_q4)(const quant_job *j, int64_t c0, int64_t c1, q4_cols *decoded) {
    for (int64_t r0 = 0; r0 < j->M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < j->M ? r0 + ROW_CHUNK : j->M, groups = (r1 - r0 + Q4_ROWS - 1) / Q4_ROWS;
        for (int64_t n = c0; n < c1; n += 8) {
            const int C = (int)(c1 - n < 8 ? c1 - n : 8);
            const q4_cols *from = NULL;
            if (groups > 1 && decoded) {
                const uint8_t *row[8];
                q4_rows(j, n, C, row);
                for (int64_t b = 0; b < j->K / 32; ++b) QS(decode_q4)(j, row, b, decoded + b);
                from = decoded;
            }
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                QS(tile_q4_sized)(j, m0, (int)(m1 - m0), n, C, from);
            }
        }
    }
}

#ifndef QWIDE_K
/* a Q4_K tile: per super-block of 256, the 8 sub-blocks' integer sums times their 6-bit scales
 * (exact), scaled by d · dx into the float lanes; the mins' part, dmin · dx · Σ m_j · xsum_j, in a
 * float chain of its own, subtracted at the end. Two columns' scales and mins decoded at once (one
 * per 128-bit half; C = 1: the column twice), the mins' chains of a row in one vector (lane 4c:
 * column c's, each lane rounded as the scalar fmaf) */
QTARGET static inline __attribute__((always_inline)) void QS(tile_k)(const quant_job *j, int64_t m0, int R,
                                                                    int64_t n0, int C) {
    const int64_t nb = j->K / 256;
    const uint8_t *col[2] = {j->w + n0 * j->row_bytes, j->w + (n0 + C - 1) * j->row_bytes};
    v8 acc[ACC_ROWS][ACC_COLS], mins[ACC_ROWS];
    for (int r = 0; r < R; ++r) {
        mins[r] = v8_zero();
        for (int c = 0; c < C; ++c) acc[r][c] = v8_zero();
    }
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk[2] = {col[0] + b * 144, col[1] + b * 144};
        v8i wq[TILE_COLS][8], sv[TILE_COLS][8];
        for (int c = 0; c < C; ++c) {
            prefetch_l1(blk[c] + 144);
            prefetch_l1(blk[c] + 208);
        }
        const v8i sm = u8x32_k_scales_mins(u8x32_load_halves(blk[0] + 4, blk[1] + 4)), mn = u8x32_k_mins16(sm);
        for (int c = 0; c < C; ++c) {
            const v8i own = u8x32_half_twice(sm, c);
            for (int s = 0; s < 8; ++s) sv[c][s] = u8x32_k_scale16(own, s);
        }
        const v8 h = f16x4_pairs(blk[0], blk[1]); /* [d0, dmin0, d1, dmin1, 0 …] */
        const v8 dmin = v8_halves_of(h, 1, 3), d[2] = {v8_halves_of(h, 0, 0), v8_halves_of(h, 2, 2)};
        for (int c = 0; c < C; ++c)
            for (int chunk = 0; chunk < 4; ++chunk) { /* low nibbles: sub-block 2·chunk, high: the next */
                const v8i raw = v8i_load(blk[c] + 16 + 32 * chunk);
                wq[c][2 * chunk] = u8x32_low_nibbles(raw);
                wq[c][2 * chunk + 1] = u8x32_high_nibbles(raw);
            }
        for (int r = 0; r < R; ++r) {
            const int8_t *xb = j->xq + (m0 + r) * j->K + b * 256;
            const v8 dx = v8_set1(j->xd[(m0 + r) * nb + b]);
            const v8i msum = i16x16_half_dots(mn, u8x32_load_twice(j->xs16 + (m0 + r) * (j->K / 32) + b * 8));
            mins[r] = v8_fmadd(v8_mul(dmin, dx), v8i_to_float(msum), mins[r]);
            for (int c = 0; c < C; ++c) {
                v8i isum[2] = {v8i_zero(), v8i_zero()}; /* two chains of dot products in flight */
                for (int s = 0; s < 8; ++s)
                    isum[s & 1] = v8i_add(isum[s & 1], dot_u4_vscaled_lanes(wq[c][s], v8i_load(xb + 32 * s), sv[c][s]));
                acc[r][c] = v8_fmadd(v8_mul(d[c], dx), v8i_to_float(v8i_add(isum[0], isum[1])), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float m[8];
        v8_store(m, mins[r]);
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c] = hsum8(acc[r][c]) - m[4 * c];
    }
}
#else
/* a Q4_K tile (AVX512-VNNI), 512-bit vectors: per super-block of 256, the 8 sub-blocks' integer sums
 * times their 6-bit scales (exact: `dot_u4x2_scaled_lanes_vnni16`, two chunks of weights, four
 * sub-blocks, per instruction, the activations paired as k_pair_activations lays them; the low 8
 * lanes sum sub-blocks 0, 1, 4, 5, the high 8 sub-blocks 2, 3, 6, 7, added at the end), scaled by
 * d · dx into the float lanes; the mins' part, dmin · dx · Σ m_j · xsum_j, in a float chain of its
 * own, subtracted at the end. Two columns' scales and mins decoded at once (one per 128-bit half;
 * C = 1: the column twice), the mins' chains of a row in one vector (lane 4c: column c's, each lane
 * rounded as the scalar fmaf). The same chains as AVX2's tile_k */
QTARGET static inline __attribute__((always_inline)) void QS(tile_k)(const quant_job *j, int64_t m0, int R,
                                                                    int64_t n0, int C) {
    const int64_t nb = j->K / 256;
    const uint8_t *col[2] = {j->w + n0 * j->row_bytes, j->w + (n0 + C - 1) * j->row_bytes};
    v8 acc[ACC_ROWS][ACC_COLS], mins[ACC_ROWS];
    for (int r = 0; r < R; ++r) {
        mins[r] = v8_zero();
        for (int c = 0; c < C; ++c) acc[r][c] = v8_zero();
    }
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk[2] = {col[0] + b * 144, col[1] + b * 144};
        v16i lo[TILE_COLS][2], hi[TILE_COLS][2], duo[TILE_COLS][2];
        v16i start[TILE_COLS];
        for (int c = 0; c < C; ++c) {
            prefetch_l1(blk[c] + 144);
            prefetch_l1(blk[c] + 208);
        }
        const v8i sm = u8x32_k_scales_mins(u8x32_load_halves(blk[0] + 4, blk[1] + 4)), mn = u8x32_k_mins16(sm);
        const v8i duos = u8x32_k_scale_duos(sm);
        const v8 h = f16x4_pairs(blk[0], blk[1]); /* [d0, dmin0, d1, dmin1, 0 …] */
        const v8 dmin = v8_halves_of(h, 1, 3), d[2] = {v8_halves_of(h, 0, 0), v8_halves_of(h, 2, 2)};
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
            const v8 dx = v8_set1(j->xd[(m0 + r) * nb + b]);
            const v8i msum = i16x16_half_dots(mn, u8x32_load_twice(j->xs16 + (m0 + r) * (j->K / 32) + b * 8));
            mins[r] = v8_fmadd(v8_mul(dmin, dx), v8i_to_float(msum), mins[r]);
            for (int c = 0; c < C; ++c) {
                v16i isum = dot_u4x2_scaled_lanes_vnni16(start[c], lo[c][0], hi[c][0],
                                                         v16i_load(xb), v16i_load(xb + 64), duo[c][0]);
                isum = dot_u4x2_scaled_lanes_vnni16(isum, lo[c][1], hi[c][1], v16i_load(xb + 128), v16i_load(xb + 192),
                                                    duo[c][1]);
                acc[r][c] = v8_fmadd(v8_mul(d[c], dx), v8i_to_float(v8i_add(v16i_lo(isum), v16i_hi(isum))), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float m[8];
        v8_store(m, mins[r]);
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c] = hsum8(acc[r][c]) - m[4 * c];
    }
}
#endif

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

/* columns c0 … c1 − 1 of the product: up to FEW_ROWS rows one column at a time (the weight streamed
 * once, each block decoded once for all rows; FEW_ROWS 0: none); more rows in tiles of TILE_COLS columns by balanced
 * groups of at most TILE_ROWS rows, over chunks of ROW_CHUNK rows (the chunk's activations stay in
 * cache while the columns pass) */
QTARGET static void QS(columns)(const quant_job *j, int64_t c0, int64_t c1) {
    if (j->fmt == HS_Q4_0) { /* more rows than a tile: the blocks decoded once per chunk and 8 columns */
        q4_cols *decoded = j->M > Q4_ROWS ? aligned_alloc(32, (size_t)(j->K / 32) * sizeof *decoded) : NULL;
        QS(columns_q4)(j, c0, c1, decoded);
        free(decoded);
        return;
    }
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
