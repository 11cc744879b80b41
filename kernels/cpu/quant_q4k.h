/* Q4_K's tiles (`cpu/quant.c`'s products, included by quant_tiles.h once per ISA, with its macros),
 * one chain per output (quant.c's header): a column at a time, AVX2's in 256-bit vectors,
 * AVX512-VNNI's (QWIDE_K) in 512-bit ones, and the columns of a call whose rows are one tile's; on
 * AVX2, interleaved weights (HS_X16) by 8 columns in the lanes (k8); on AVX512-VNNI, for more than
 * K_COLUMN_ROWS rows or interleaved weights, by 16 (k16). */

/* super-block b's head for columns col[0], col[1] (C = 1: the same column twice), what both ISAs'
 * tiles decode alike: the scales and mins of both (sm; the mins as int16, mn), d per column (lane c),
 * dmin */
typedef struct {
    v8i sm, mn;
    v8 d01, dmin; /* d01: lane c column c's d */
} QS(k_head);

QTARGET static inline __attribute__((always_inline)) QS(k_head) QS(k_head_of)(const quant_job *j, const uint8_t *const blk[2],
                                                                              int C) {
    /* the same super-block two tiles on (into L1) and eight on (into L2), as Q8_0's tiles: the tiles
     * read the weight in order, C rows at a time, and without these the hardware's prefetch kept up
     * only with rows of at most 4 super-blocks (docs/results/quant.md) */
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
    h.d01 = v8_pick2(pairs, 0, 2);
    return h;
}

/* row m's mins' part of super-block b, dmin · dx · Σ m_j · xsum_j, into its chain (lane 4c: column
 * c's); dx as a vector */
QTARGET static inline __attribute__((always_inline)) v8 QS(k_mins)(const quant_job *j, const QS(k_head) *h, int64_t m,
                                                                  int64_t b, v8 dx, v8 mins) {
    const v8i msum = i16x16_half_dots(h->mn, u8x32_load_twice(j->xs16 + m * (j->K / 32) + b * 8));
    return v8_fmadd(v8_mul(h->dmin, dx), v8i_to_float(msum), mins);
}

/* row r's sums of super-block b, tot[c] column c's integer lanes (the exact Σ_s scale_s · Σ q·x in
 * all): each column's one integer, times d · dx into its chain (lane c of acc) */
QTARGET static inline __attribute__((always_inline)) v8 QS(k_sums)(const QS(k_head) *h, v8i tot0, v8i tot1, v8 dx, v8 acc) {
    return v8_fmadd(v8_mul(h->d01, dx), v8i_to_float(v8i_pair_totals(tot0, tot1)), acc);
}

/* the tile's outputs: each column's chain less its mins' chain */
QTARGET static inline __attribute__((always_inline)) void QS(k_store)(const quant_job *j, int64_t m0, int R, int64_t n0,
                                                                     int C, const v8 acc[ACC_ROWS],
                                                                     const v8 mins[ACC_ROWS]) {
    for (int r = 0; r < R; ++r) {
        float a[8], m[8];
        v8_store(a, acc[r]);
        v8_store(m, mins[r]);
        for (int c = 0; c < C; ++c) j->y[(m0 + r) * j->N + n0 + c] = a[c] - m[4 * c];
    }
}

#ifndef QWIDE_K
/* super-block b of a Q4_K tile (AVX2): each column's 8 sub-blocks' integer sums times their 6-bit
 * scales (exact, maddubs then madd by the scale), in 8 integer lanes summed to one (k_sums), times
 * d · dx into the column's chain; the mins' part into each row's chain */
QTARGET static inline __attribute__((always_inline)) void QS(k_block)(const quant_job *j, const uint8_t *const blk[2],
                                                                     const QS(k_head) *h, int64_t m0, int R, int C,
                                                                     int64_t b, v8 acc[ACC_ROWS], v8 mins[ACC_ROWS]) {
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
        v8i tot[2];
        for (int c = 0; c < C; ++c) {
            v8i isum[2] = {v8i_zero(), v8i_zero()}; /* two chains of dot products in flight */
            for (int s = 0; s < 8; ++s)
                isum[s & 1] = v8i_add(isum[s & 1], dot_u4_vscaled_lanes(wq[c][s], v8i_load(xb + 32 * s), sv[c][s]));
            tot[c] = v8i_add(isum[0], isum[1]);
        }
        acc[r] = QS(k_sums)(h, tot[0], C > 1 ? tot[1] : tot[0], dx, acc[r]);
    }
}
#else
/* super-block b of a Q4_K tile (AVX512-VNNI), 512-bit vectors: the same integer sums
 * (`dot_u4x2_scaled_lanes_vnni16`: two chunks of weights, four sub-blocks, per instruction, the
 * activations paired as k_pair_activations lays them; the low 8 lanes sum sub-blocks 0, 1, 4, 5, the
 * high 8 sub-blocks 2, 3, 6, 7, added at the end) into the same chains as AVX2's */
QTARGET static inline __attribute__((always_inline)) void QS(k_block)(const quant_job *j, const uint8_t *const blk[2],
                                                                     const QS(k_head) *h, int64_t m0, int R, int C,
                                                                     int64_t b, v8 acc[ACC_ROWS], v8 mins[ACC_ROWS]) {
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
        v8i tot[2];
        for (int c = 0; c < C; ++c) {
            v16i isum = dot_u4x2_scaled_lanes_vnni16(start[c], lo[c][0], hi[c][0],
                                                     v16i_load(xb), v16i_load(xb + 64), duo[c][0]);
            isum = dot_u4x2_scaled_lanes_vnni16(isum, lo[c][1], hi[c][1], v16i_load(xb + 128), v16i_load(xb + 192),
                                                duo[c][1]);
            tot[c] = v8i_add(v16i_lo(isum), v16i_hi(isum));
        }
        acc[r] = QS(k_sums)(h, tot[0], C > 1 ? tot[1] : tot[0], dx, acc[r]);
    }
}
#endif

#ifndef QWIDE_K
/* -- Q4_K by columns (AVX2), interleaved weights (HS_X16): the 8 rows of half of a group in the 8 lanes
 * of 256-bit vectors (a 64-byte word vector of the group holds both halves), each lane the chain of
 * one output, so a sub-block's integer work is one maddubs per 4 values of 8 outputs, their 16-bit
 * pair sums added over the sub-block (8 · 3810 < 2^15), and its scale one madd for 8: no sums across
 * lanes, which the column-at-a-time tiles pay per super-block and row ---------------------------- */

/* a super-block's head for the 8 rows of a half: d and dmin per lane; sc[s], lane c: row c's scale of
 * sub-block s in both 16-bit halves (what madd takes); mn[p]: its mins of sub-blocks 2p, 2p + 1 as the
 * two 16-bit halves (ggml's get_scale_min_k4 in every lane, as k16_head_of) */
typedef struct {
    v8i sc[8], mn[4];
    v8 d, dmin;
} k8_head;

/* the head from the interleaved super-block's first 4 words at `at` (the half's 32 bytes of each) */
static inline __attribute__((always_inline)) void k8_head_of(const uint8_t *at, k8_head *out) {
    const v8i h0 = v8i_load(at), q0 = v8i_load(at + 64), q4 = v8i_load(at + 128), q8 = v8i_load(at + 192);
    out->d = v8_f16_half(h0, 0), out->dmin = v8_f16_half(h0, 1);
    const v8i sc_lo = v8i_and_bits(q0, 0x3F3F3F3F), mn_lo = v8i_and_bits(q4, 0x3F3F3F3F);
    const v8i sc_hi = v8i_or(v8i_and_bits(q8, 0x0F0F0F0F), v8i_and_bits(v8i_shr(q0, 2), 0x30303030));
    const v8i mn_hi = v8i_or(v8i_and_bits(v8i_shr(q8, 4), 0x0F0F0F0F), v8i_and_bits(v8i_shr(q4, 2), 0x30303030));
    for (int s = 0; s < 4; ++s) {
        const v8i lo = v8i_and_bits(v8i_shr(sc_lo, 8 * s), 0xFF), hi = v8i_and_bits(v8i_shr(sc_hi, 8 * s), 0xFF);
        out->sc[s] = v8i_or(lo, v8i_shl(lo, 16)), out->sc[s + 4] = v8i_or(hi, v8i_shl(hi, 16));
    }
    for (int p = 0; p < 2; ++p) { /* bytes 2p and 2p + 1 of each half as the two 16-bit halves */
        const v8i a = v8i_shr(mn_lo, 16 * p), c = v8i_shr(mn_hi, 16 * p);
        out->mn[p] = v8i_or(v8i_and_bits(a, 0xFF), v8i_and_bits(v8i_shl(a, 8), 0xFF0000));
        out->mn[p + 2] = v8i_or(v8i_and_bits(c, 0xFF), v8i_and_bits(v8i_shl(c, 8), 0xFF0000));
    }
}

/* sub-block 2 · chunk + high of the interleaved super-block at `at` (its chunk's 8 words' low or high
 * nibbles): each row's 16-bit pair sums over it, times its scale (sc) into the row's integer sum */
static inline __attribute__((always_inline)) void QS(k8_sub_block)(const quant_job *j, const uint8_t *at, int64_t m0,
                                                                  int R, int64_t b, int chunk, int high, v8i sc,
                                                                  v8i total[ACC_ROWS]) {
    const int8_t *x = j->xq + m0 * j->K + b * 256 + 64 * chunk + 32 * high;
    v8i sum[ACC_ROWS];
    for (int r = 0; r < R; ++r) sum[r] = v8i_zero();
    for (int k = 0; k < 8; ++k) {
        const v8i w = v8i_load(at + 64 * (4 + 8 * chunk + k));
        const v8i q = high ? u8x32_high_nibbles(w) : u8x32_low_nibbles(w);
        for (int r = 0; r < R; ++r) sum[r] = v8i_add16(sum[r], u4_i8_pair_sums(q, i8x4_broadcast(x + r * j->K + 4 * k)));
    }
    for (int r = 0; r < R; ++r) total[r] = v8i_add(total[r], i16_pair_dots(sum[r], sc));
}

/* a tile of R rows by the 16 columns of the interleaved group at n0 (half h's lane c: column
 * n0 + 8h + c): per super-block and half, its head, then per sub-block (a chunk's 8 words' low
 * nibbles, then their high ones: the words read twice, from L1) the rows' 16-bit pair sums, times the
 * sub-block's scale into each row's integer sums; then times d · dx into the rows' chains, the mins'
 * Σ_s m_s · xsum_s times dmin · dx into theirs (the chains of k_block and of the k16 tiles) */
static inline __attribute__((always_inline)) void QS(k8_tile)(const quant_job *j, int64_t m0, int R, int64_t n0) {
    const uint8_t *group = j->w + n0 * j->row_bytes;
    const int64_t nb = j->K / 256;
    v8 acc[2][ACC_ROWS], mins[2][ACC_ROWS];
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) acc[h][r] = mins[h][r] = v8_zero();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = group + b * 16 * 144;
        for (int h = 0; h < 2; ++h) {
            const uint8_t *at = block + 32 * h;
            k8_head head;
            k8_head_of(at, &head);
            v8i total[ACC_ROWS];
            for (int r = 0; r < R; ++r) total[r] = v8i_zero();
#pragma GCC unroll 1
            for (int chunk = 0; chunk < 4; ++chunk) {
                QS(k8_sub_block)(j, at, m0, R, b, chunk, 0, head.sc[2 * chunk], total);
                QS(k8_sub_block)(j, at, m0, R, b, chunk, 1, head.sc[2 * chunk + 1], total);
            }
            for (int r = 0; r < R; ++r) {
                const int16_t *xs = j->xs16 + (m0 + r) * (j->K / 32) + b * 8;
                v8i msum = v8i_zero();
                for (int p = 0; p < 4; ++p)
                    msum = v8i_add(msum, i16_pair_dots(head.mn[p], i8x4_broadcast((const int8_t *)(xs + 2 * p))));
                const v8 dx = v8_set1(j->xd[(m0 + r) * nb + b]);
                acc[h][r] = v8_fmadd(v8_mul(head.d, dx), v8i_to_float(total[r]), acc[h][r]);
                mins[h][r] = v8_fmadd(v8_mul(head.dmin, dx), v8i_to_float(msum), mins[h][r]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) v8_store(j->y + (m0 + r) * j->N + n0 + 8 * h, v8_sub(acc[h][r], mins[h][r]));
}

/* a k8 tile with R made a constant */
static void QS(k8_tile_sized)(const quant_job *j, int64_t m0, int R, int64_t n0) {
#if TILE_ROWS != 4
#error "quant_q4k.h: a tile shape that k8_tile_sized does not instantiate"
#endif
    switch (R) {
        case 1: QS(k8_tile)(j, m0, 1, n0); break;
        case 2: QS(k8_tile)(j, m0, 2, n0); break;
        case 3: QS(k8_tile)(j, m0, 3, n0); break;
        case 4: QS(k8_tile)(j, m0, 4, n0); break;
        default: break;
    }
}

/* interleaved Q4_K's columns c0 … c1 − 1 (groups of 16), by balanced groups of at most TILE_ROWS
 * rows over chunks of ROW_CHUNK rows (a group's super-blocks stay in cache while its row groups pass) */
static void QS(k8_columns)(const quant_job *j, int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < j->M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < j->M ? r0 + ROW_CHUNK : j->M;
        const int64_t groups = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
        for (int64_t n = c0; n < c1; n += 16)
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                QS(k8_tile_sized)(j, m0, (int)(m1 - m0), n);
            }
    }
}
#endif

#ifdef QWIDE_K
/* -- Q4_K by columns (AVX512-VNNI): 16 weight rows in the 16 lanes of 512-bit vectors, their bytes
 * transposed as they are read, each lane the chain of one output (quant.c's header), so a
 * sub-block's integer work is one instruction per 4 values of 16 outputs and its scale one
 * multiply for 16 -------------------------------------------------------------------------------- */

/* super-block b of 16 weight rows decoded: q[s][k], lane c: values 4k … 4k + 3 of sub-block s of
 * row c (0..15, a byte each); sc[s], lane c: its scale; mn[p], lane c: the mins of sub-blocks 2p
 * and 2p + 1 as 16-bit values; d and dmin per lane */
typedef struct {
    v16i q[8][8];
    v16i sc[8], mn[4];
    v16 d, dmin;
} k16_block;

/* the head of super-block b of 16 rows, head[0] lane c row c's d | dmin << 16, head[1 … 3] its 12
 * bytes of packed scales and mins (q0-3, q4-7, q8-11): d, dmin, the scales and the min pairs (ggml's
 * get_scale_min_k4, in every lane) */
QTARGET static inline __attribute__((always_inline)) void QS(k16_head_of)(const v16i head[4], k16_block *out) {
    out->d = v16_f16_half(head[0], 0), out->dmin = v16_f16_half(head[0], 1);
    const v16i q0 = head[1], q4 = head[2], q8 = head[3];
    const v16i sc_lo = v16i_and_bits(q0, 0x3F3F3F3F), mn_lo = v16i_and_bits(q4, 0x3F3F3F3F);
    const v16i sc_hi = v16i_or(v16i_and_bits(q8, 0x0F0F0F0F), v16i_and_bits(v16i_shr(q0, 2), 0x30303030));
    const v16i mn_hi = v16i_or(v16i_and_bits(v16i_shr(q8, 4), 0x0F0F0F0F), v16i_and_bits(v16i_shr(q4, 2), 0x30303030));
    for (int s = 0; s < 4; ++s) {
        out->sc[s] = v16i_and_bits(v16i_shr(sc_lo, 8 * s), 0xFF);
        out->sc[s + 4] = v16i_and_bits(v16i_shr(sc_hi, 8 * s), 0xFF);
    }
    for (int p = 0; p < 2; ++p) { /* bytes 2p and 2p + 1 of each half as the two 16-bit halves */
        const v16i a = v16i_shr(mn_lo, 16 * p), c = v16i_shr(mn_hi, 16 * p);
        out->mn[p] = v16i_or(v16i_and_bits(a, 0xFF), v16i_and_bits(v16i_shl(a, 8), 0xFF0000));
        out->mn[p + 2] = v16i_or(v16i_and_bits(c, 0xFF), v16i_and_bits(v16i_shl(c, 8), 0xFF0000));
    }
}

/* the head of super-block b of the 16 rows at blk[0] … blk[15] (each row's block), transposed as read */
QTARGET static inline __attribute__((always_inline)) void QS(k16_head)(const uint8_t *const blk[16], k16_block *out) {
    v16i head[4];
    u32x16_transposed16(blk, head);
    QS(k16_head_of)(head, out);
}

/* the nibbles of chunk `chunk` of the 16 rows' blocks at blk[…] (32 bytes each): lo[k] sub-block
 * 2·chunk's values 4k … 4k + 3, hi[k] the next sub-block's */
QTARGET static inline __attribute__((always_inline)) void QS(k16_chunk)(const uint8_t *const blk[16], int chunk,
                                                                       v16i lo[8], v16i hi[8]) {
    const uint8_t *p[16];
    v16i w[8];
    for (int c = 0; c < 16; ++c) p[c] = blk[c] + 16 + 32 * chunk;
    u32x16_transposed16(p, w);
    for (int c = 0; c < 16; ++c) p[c] += 16;
    u32x16_transposed16(p, w + 4);
    for (int k = 0; k < 8; ++k) lo[k] = u8x64_low_nibbles(w[k]), hi[k] = u8x64_high_nibbles(w[k]);
}

/* interleaved weights (X16_ROWS, quant.c): super-block b of the 16 rows lies at `at` as the k16 tiles
 * read it, its 36 words a vector each (lane c row c's word), head first (k16_head_of's), then each
 * chunk's 8 (k16_chunk's w) */
QTARGET static inline __attribute__((always_inline)) void QS(k16_x16_head)(const uint8_t *at, k16_block *out) {
    v16i head[4];
    for (int i = 0; i < 4; ++i) head[i] = v16i_load(at + 64 * i);
    QS(k16_head_of)(head, out);
}
QTARGET static inline __attribute__((always_inline)) void QS(k16_x16_chunk)(const uint8_t *at, int chunk, v16i lo[8],
                                                                           v16i hi[8]) {
    for (int k = 0; k < 8; ++k) {
        const v16i w = v16i_load(at + 64 * (4 + 8 * chunk + k));
        lo[k] = u8x64_low_nibbles(w), hi[k] = u8x64_high_nibbles(w);
    }
}

/* where super-block b of the interleaved 16 rows at `group` lies, and what is read next prefetched:
 * a tile (`decoding` 0) reads the weight as one stream, which the hardware's prefetch follows (a
 * prefetch of the super-block two on made the tiles slower: docs/results/quant.md); the
 * decoding into the tiles' cache (`decoding` 1) reads a group in a burst before the tiles' work, and
 * the same super-block of the next group goes into L1, of the one after into L2, as tile16_blocks
 * does for plain rows */
static inline __attribute__((always_inline)) const uint8_t *k16_x16_at(const quant_job *j, const uint8_t *group,
                                                                      int64_t b, int decoding) {
    const uint8_t *at = group + b * 16 * 144;
    if (decoding)
        for (int line = 0; line < 16 * 144; line += 64)
            prefetch_l1(at + 16 * j->row_bytes + line), prefetch_l2(at + 32 * j->row_bytes + line);
    return at;
}

/* super-block b of the rows row[0] … row[15] decoded whole into out (the tiles' cache) */
QTARGET static inline __attribute__((always_inline)) void QS(k16_decode)(const quant_job *j, const uint8_t *const row[16],
                                                                        int64_t b, k16_block *out) {
    if (j->x16) {
        const uint8_t *at = k16_x16_at(j, row[0], b, 1);
        QS(k16_x16_head)(at, out);
        for (int chunk = 0; chunk < 4; ++chunk) QS(k16_x16_chunk)(at, chunk, out->q[2 * chunk], out->q[2 * chunk + 1]);
        return;
    }
    const uint8_t *blk[16];
    tile16_blocks(j, row, b, 144, blk);
    QS(k16_head)(blk, out);
    for (int chunk = 0; chunk < 4; ++chunk) QS(k16_chunk)(blk, chunk, out->q[2 * chunk], out->q[2 * chunk + 1]);
}

/* rows m0 … m0 + R − 1 by chunk `chunk` of super-block b (its sub-blocks' nibbles lo, hi and scales
 * sc_lo, sc_hi): total[r] += per lane the exact sc_lo · Σ lo·x + sc_hi · Σ hi·x; each weight vector
 * met by every row while it is in a register */
QTARGET static inline __attribute__((always_inline)) void QS(k16_chunk_rows)(const quant_job *j, const v16i lo[8],
                                                                            const v16i hi[8], v16i sc_lo, v16i sc_hi,
                                                                            int64_t m0, int R, int64_t b, int chunk,
                                                                            v16i total[ACC_ROWS]) {
    v16i s0[ACC_ROWS], s1[ACC_ROWS];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = v16i_zero();
    for (int k = 0; k < 8; ++k)
        for (int r = 0; r < R; ++r) {
            const int8_t *x = j->xq + (m0 + r) * j->K + b * 256 + 64 * chunk + 4 * k;
            s0[r] = dot_u8_lanes_vnni16(s0[r], lo[k], i8x4_broadcast16(x));
            s1[r] = dot_u8_lanes_vnni16(s1[r], hi[k], i8x4_broadcast16(x + 32));
        }
    for (int r = 0; r < R; ++r) total[r] = v16i_add(total[r], v16i_add(v16i_mul(s0[r], sc_lo), v16i_mul(s1[r], sc_hi)));
}

/* k16_chunk_rows from interleaved weights at `at`, one sub-block at a time (its nibbles split from
 * each word as loaded; the words read twice, from L1): the sums of R rows and one nibble vector in
 * registers, not 16 nibble vectors and two sums per row (which spilled) */
QTARGET static inline __attribute__((always_inline)) void QS(k16_x16_chunk_rows)(const quant_job *j, const uint8_t *at,
                                                                                v16i sc_lo, v16i sc_hi, int64_t m0,
                                                                                int R, int64_t b, int chunk,
                                                                                v16i total[ACC_ROWS]) {
    for (int half = 0; half < 2; ++half) { /* the low nibbles (sub-block 2·chunk), then the high */
        v16i sum[ACC_ROWS];
        for (int r = 0; r < R; ++r) sum[r] = v16i_zero();
        for (int k = 0; k < 8; ++k) {
            const v16i w = v16i_load(at + 64 * (4 + 8 * chunk + k));
            const v16i q = half ? u8x64_high_nibbles(w) : u8x64_low_nibbles(w);
            for (int r = 0; r < R; ++r)
                sum[r] = dot_u8_lanes_vnni16(sum[r], q, i8x4_broadcast16(j->xq + (m0 + r) * j->K + b * 256 + 64 * chunk
                                                                         + 32 * half + 4 * k));
        }
        for (int r = 0; r < R; ++r) total[r] = v16i_add(total[r], v16i_mul(sum[r], half ? sc_hi : sc_lo));
    }
}

/* rows m0 … m0 + R − 1 at super-block b, its sums total[r] made: times d · dx into the sums; the
 * mins' Σ_s m_s · xsum_s times dmin · dx into the mins' chains */
QTARGET static inline __attribute__((always_inline)) void QS(k16_finish)(const quant_job *j, const k16_block *h, int64_t m0,
                                                                        int R, int64_t b, const v16i total[ACC_ROWS],
                                                                        v16 acc[ACC_ROWS], v16 mins[ACC_ROWS]) {
    for (int r = 0; r < R; ++r) {
        const int16_t *xs = j->xs16 + (m0 + r) * (j->K / 32) + b * 8;
        v16i msum = v16i_zero();
        for (int p = 0; p < 4; ++p)
            msum = dot_i16_lanes_vnni16(msum, h->mn[p], i8x4_broadcast16((const int8_t *)(xs + 2 * p)));
        const v16 dx = v16_set1(j->xd[(m0 + r) * (j->K / 256) + b]);
        acc[r] = v16_fmadd(v16_mul(h->d, dx), v16i_to_float(total[r]), acc[r]);
        mins[r] = v16_fmadd(v16_mul(h->dmin, dx), v16i_to_float(msum), mins[r]);
    }
}

/* a tile of R rows by 16 columns, lane c column n0 + c (columns past the first C: the last again, not
 * stored); the super-blocks from `decoded`, or read here chunk by chunk: interleaved (`x16`, a
 * constant where inlined) or transposed as read */
QTARGET static inline __attribute__((always_inline)) void QS(k16_tile)(const quant_job *j, int64_t m0, int R, int64_t n0,
                                                                      int C, const k16_block *decoded, int x16) {
    const uint8_t *row[16];
    tile_rows(j, n0, C, 16, row);
    v16 acc[ACC_ROWS], mins[ACC_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = mins[r] = v16_zero();
    for (int64_t b = 0; b < j->K / 256; ++b) {
        v16i total[ACC_ROWS];
        for (int r = 0; r < R; ++r) total[r] = v16i_zero();
        if (decoded) {
            const k16_block *w = decoded + b;
            for (int chunk = 0; chunk < 4; ++chunk)
                QS(k16_chunk_rows)(j, w->q[2 * chunk], w->q[2 * chunk + 1], w->sc[2 * chunk], w->sc[2 * chunk + 1], m0,
                                   R, b, chunk, total);
            QS(k16_finish)(j, w, m0, R, b, total, acc, mins);
        } else if (x16) {
            const uint8_t *at = k16_x16_at(j, row[0], b, 0);
            k16_block h; /* its head only */
            QS(k16_x16_head)(at, &h);
            for (int chunk = 0; chunk < 4; ++chunk)
                QS(k16_x16_chunk_rows)(j, at, h.sc[2 * chunk], h.sc[2 * chunk + 1], m0, R, b, chunk, total);
            QS(k16_finish)(j, &h, m0, R, b, total, acc, mins);
        } else {
            const uint8_t *blk[16];
            k16_block h; /* its head only */
            tile16_blocks(j, row, b, 144, blk);
            QS(k16_head)(blk, &h);
            for (int chunk = 0; chunk < 4; ++chunk) {
                v16i lo[8], hi[8];
                QS(k16_chunk)(blk, chunk, lo, hi);
                QS(k16_chunk_rows)(j, lo, hi, h.sc[2 * chunk], h.sc[2 * chunk + 1], m0, R, b, chunk, total);
            }
            QS(k16_finish)(j, &h, m0, R, b, total, acc, mins);
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[16];
        v16_store(out, v16_sub(acc[r], mins[r]));
        memcpy(j->y + (m0 + r) * j->N + n0, out, (size_t)C * sizeof *out);
    }
}

/* a 16-column tile with R made a constant, and where its super-blocks come from (each its own code:
 * the registers each path needs) */
QTARGET static void QS(k16_tile_sized)(const quant_job *j, int64_t m0, int R, int64_t n0, int C,
                                       const k16_block *decoded) {
#define K16CASE(r)                                                             \
    case r:                                                                    \
        if (decoded) QS(k16_tile)(j, m0, r, n0, C, decoded, 0);                \
        else if (j->x16) QS(k16_tile)(j, m0, r, n0, C, NULL, 1);               \
        else QS(k16_tile)(j, m0, r, n0, C, NULL, 0);                           \
        break;
    switch (R) {
        K16CASE(1) K16CASE(2) K16CASE(3) K16CASE(4) K16CASE(5) K16CASE(6)
        default: break;
    }
#undef K16CASE
}

/* Q4_K's columns c0 … c1 − 1, 16 at a time, by balanced groups of at most TILE_ROWS rows over chunks
 * of ROW_CHUNK rows; where a chunk has more than one group, its columns' super-blocks decoded once
 * into `decoded` ([K / 256]; NULL: each group decodes them) */
QTARGET static void QS(k16_columns)(const quant_job *j, int64_t c0, int64_t c1, k16_block *decoded) {
    for (int64_t r0 = 0; r0 < j->M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < j->M ? r0 + ROW_CHUNK : j->M;
        const int64_t groups = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
        for (int64_t n = c0; n < c1; n += 16) {
            const int C = (int)(c1 - n < 16 ? c1 - n : 16);
            const k16_block *from = NULL;
            if (groups > 1 && decoded) {
                const uint8_t *row[16];
                tile_rows(j, n, C, 16, row);
                for (int64_t b = 0; b < j->K / 256; ++b) QS(k16_decode)(j, row, b, decoded + b);
                from = decoded;
            }
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t m0 = r0 + (r1 - r0) * g / groups, m1 = r0 + (r1 - r0) * (g + 1) / groups;
                QS(k16_tile_sized)(j, m0, (int)(m1 - m0), n, C, from);
            }
        }
    }
}
#endif

/* a Q4_K tile a column at a time: per super-block of 256, the 8 sub-blocks' integer sums times their
 * 6-bit scales (exact), one integer, scaled by d · dx into the column's chain; the mins' part,
 * dmin · dx · Σ m_j · xsum_j, in a float chain of its own, subtracted at the end. Two columns'
 * scales and mins decoded at once (one per 128-bit half; C = 1: the column twice), a row's chains in
 * one vector (lane c: column c's sums, lane 4c its mins', each lane rounded as the scalar fmaf);
 * k_block the ISA's products */
QTARGET static inline __attribute__((always_inline)) void QS(tile_k)(const quant_job *j, int64_t m0, int R,
                                                                    int64_t n0, int C) {
    const uint8_t *col[2] = {j->w + n0 * j->row_bytes, j->w + (n0 + C - 1) * j->row_bytes};
    v8 acc[ACC_ROWS], mins[ACC_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = mins[r] = v8_zero();
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
