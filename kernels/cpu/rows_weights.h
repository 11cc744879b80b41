/* The products' loops for one type of weight storage, included by `cpu/rows.c` once per type
 * (float32, and bfloat16 and float16 widened to float32 as they are loaded: see there). The includer defines
 * WT (the stored element), WS(name) (the type's name for a function or table), WLOAD8 / WLOAD16
 * (8 / 16 weights widened into an AVX2 / AVX-512 vector), WSCALAR (one weight as a float),
 * W_PER_LINE (weights per 64-byte cache line) and, for a type the tiles widen, W_WIDENED_TILES
 * (the float32 tile sets' type; see `tiled_matmul`). */

#define STEP8(G, Q) EXPAND(DEFINE_STEP, WS(step), WT, WLOAD8, W_PER_LINE, , AVX2_OPS, G, Q)
#define STEP16(G, Q) EXPAND(DEFINE_STEP, WS(step16), WT, WLOAD16, W_PER_LINE, TARGET512, AVX512_OPS, G, Q)
/* G·Q broadcasts, Q weight vectors and one sum in registers: 16 ymm, 32 zmm */
STEP8(1, 4) STEP8(1, 1) STEP8(2, 4) STEP8(2, 1) STEP8(3, 3) STEP8(3, 1) STEP8(4, 2) STEP8(4, 1) STEP8(5, 2) STEP8(5, 1)
STEP16(1, 12) STEP16(1, 1) STEP16(2, 6) STEP16(2, 1) STEP16(3, 6) STEP16(3, 1) STEP16(4, 6) STEP16(4, 1)
STEP16(5, 4) STEP16(5, 1)
#undef STEP8
#undef STEP16

typedef void (*WS(step_fn))(const float *, int64_t, const WT *, int64_t, int64_t, int64_t, float *, int64_t);
typedef struct {
    int width;                        /* columns per vector */
    WS(step_fn) q[GROUP_ROWS + 1];    /* Q weight rows per step, for G rows */
    WS(step_fn) one[GROUP_ROWS + 1];  /* one weight row per step */
    int q_of[GROUP_ROWS + 1];         /* that Q (each divides KBLOCK) */
} WS(step_set);
static const WS(step_set) WS(AVX2_STEPS) = {
    8, {0, FN(step, 1, 4), FN(step, 2, 4), FN(step, 3, 3), FN(step, 4, 2), FN(step, 5, 2)},
    {0, FN(step, 1, 1), FN(step, 2, 1), FN(step, 3, 1), FN(step, 4, 1), FN(step, 5, 1)}, {0, 4, 4, 3, 2, 2}};
static const WS(step_set) WS(AVX512_STEPS) = {
    16, {0, FN(step16, 1, 12), FN(step16, 2, 6), FN(step16, 3, 6), FN(step16, 4, 6), FN(step16, 5, 4)},
    {0, FN(step16, 1, 1), FN(step16, 2, 1), FN(step16, 3, 1), FN(step16, 4, 1), FN(step16, 5, 1)}, {0, 12, 6, 6, 6, 4}};

/* columns n0 <= n < n1 (those past the last multiple of 8), k0 <= k < k1: the same chain, one float at a time */
static void WS(tail_columns)(int G, const float *x, int64_t ldx, const WT *w, int64_t N, int64_t k0, int64_t k1,
                                 int64_t n0, int64_t n1, float *y, int64_t ldy) {
    for (int g = 0; g < G; ++g)
        for (int64_t n = n0; n < n1; ++n) {
            float s = y[g * ldy + n];
            for (int64_t k = k0; k < k1; ++k) s = fmaf(x[g * ldx + k], WSCALAR(w[k * N + n]), s);
            y[g * ldy + n] = s;
        }
}

#define TILE16(G, V) EXPAND(DEFINE_TILE, WS(tile16), WT, WLOAD16, W_PER_LINE, TARGET512, AVX512_OPS, G, V)
#define TILE8(G, V) EXPAND(DEFINE_TILE, WS(tile8), WT, WLOAD8, W_PER_LINE, , AVX2_OPS, G, V)
/* AVX-512: 6 rows × 4 vectors (24 sums + 4 weight vectors in 32 registers), and
 * the narrower tiles for the last columns; AVX2: 4 rows × 3 vectors (12 + 3 of 16) */
TILE16(6, 4) TILE16(5, 4) TILE16(4, 4) TILE16(3, 4) TILE16(2, 4) TILE16(1, 4)
TILE16(6, 1) TILE16(5, 1) TILE16(4, 1) TILE16(3, 1) TILE16(2, 1) TILE16(1, 1)
TILE8(4, 3) TILE8(3, 3) TILE8(2, 3) TILE8(1, 3)
TILE8(4, 1) TILE8(3, 1) TILE8(2, 1) TILE8(1, 1)
#undef TILE16
#undef TILE8

typedef void (*WS(tile_fn))(const float *, int64_t, const WT *, int64_t, int64_t, int64_t, float *, int64_t,
                            const WT *, int64_t, int);
typedef struct {
    int rows, width, vectors;          /* the widest tile: rows × vectors of `width` columns */
    WS(tile_fn) wide[7], one[7];       /* by rows: the wide tile and the one-vector tile */
} WS(tile_set);
static const WS(tile_set) WS(AVX512_TILES) = {
    6, 16, 4,
    {0, FN(tile16, 1, 4), FN(tile16, 2, 4), FN(tile16, 3, 4), FN(tile16, 4, 4), FN(tile16, 5, 4), FN(tile16, 6, 4)},
    {0, FN(tile16, 1, 1), FN(tile16, 2, 1), FN(tile16, 3, 1), FN(tile16, 4, 1), FN(tile16, 5, 1), FN(tile16, 6, 1)}};
static const WS(tile_set) WS(AVX2_TILES) = {
    4, 8, 3, {0, FN(tile8, 1, 3), FN(tile8, 2, 3), FN(tile8, 3, 3), FN(tile8, 4, 3)},
    {0, FN(tile8, 1, 1), FN(tile8, 2, 1), FN(tile8, 3, 1), FN(tile8, 4, 1)}};

/* whether the tiles widen each panel's block once (16-bit weights, from WIDEN_MIN_GROUPS row groups) */
static inline int WS(widens)(const WS(tile_set) *t, int64_t M) {
#ifdef W_WIDENED_TILES
    return (M + t->rows - 1) / t->rows >= WIDEN_MIN_GROUPS;
#else
    (void)t, (void)M;
    return 0;
#endif
}

static void WS(tiled_matmul)(const WS(tile_set) *t, int64_t tile_k, int ahead, const product_job *j,
                             const column_share *s) {
    const float *x = j->x;
    const WT *w = j->w;
    const int64_t ldx = j->ldx, M = j->M, K = j->K, N = j->N, ldy = s->ldy, c0 = s->c0, c1 = s->c1;
    const int part = s->part, parts = s->parts;
    float *y = s->y;
    const int64_t groups = (M + t->rows - 1) / t->rows, panel = (int64_t)t->width * t->vectors;
    const int64_t wide = c0 + (c1 - c0) / panel * panel, vec_end = c0 + (c1 - c0) / t->width * t->width;
    const int64_t vec8 = c0 + (c1 - c0) / 8 * 8;
    const int64_t calls = ((wide - c0) / panel + (vec_end - wide) / t->width) * groups;  /* tile calls per block */
#ifdef W_WIDENED_TILES
    /* with `widen`, each panel's block widened once into float32, the float32 tiles on it */
    float widened[TILE_K * 64] __attribute__((aligned(64)));
    const W_WIDENED_TILES *ft = isa512 ? &W_WIDENED_TILES_512 : &W_WIDENED_TILES_2;
#endif
    const int widen = WS(widens)(t, M);
    for (int64_t k0 = 0; k0 < K; k0 += tile_k) {
        const int64_t k1 = k0 + tile_k < K ? k0 + tile_k : K, k2 = k1 + tile_k < K ? k1 + tile_k : K;
        /* the next block, (k2 - k1) rows of N in memory order: this part's share of its lines */
        const int64_t block_lines = ahead ? 0 : (k2 - k1) * N / W_PER_LINE, first = block_lines * part / parts;
        const WT *next = w + k1 * N + W_PER_LINE * first;
        const int64_t lines = block_lines * (part + 1) / parts - first;
        int64_t call = 0;
        for (int64_t n0 = c0; n0 < vec8;) {
            /* this panel: `wide` columns in wide tiles, then single vectors, then one AVX2 vector */
            const int64_t step = n0 < wide ? panel : n0 < vec_end ? t->width : 8;
#ifdef W_WIDENED_TILES
            if (step == panel && widen)
                for (int64_t k = k0; k < k1; ++k) {
                    if (ahead) /* the next panel's part of the row, as the tiles would */
                        for (int64_t l = 0; l < panel; l += W_PER_LINE)
                            prefetch_l1(w + k * N + n0 + panel + l);
                    for (int64_t l = 0; l < panel; l += 8)
                        v8_store_aligned(widened + (k - k0) * panel + l, WLOAD8(w + k * N + n0 + l));
                }
#endif
            for (int64_t group = 0; group < groups; ++group) {
                const int64_t m0 = M * group / groups, m1 = M * (group + 1) / groups;
                const int G = (int)(m1 - m0);
                const float *xg = x + m0 * ldx;
                float *yg = y + m0 * ldy + (n0 - c0);
                if (step == 8) {  /* one AVX2 vector left: AVX2 tiles of up to 4 rows, no prefetch */
                    for (int64_t g = 0; g < G; g += 4) {
                        const int rows = G - g < 4 ? (int)(G - g) : 4;
                        WS(AVX2_TILES).one[rows](xg + g * ldx, ldx, w + n0, N, k0, k1, yg + g * ldy, ldy, 0, 0, 0);
                    }
                    continue;
                }
                const int64_t l0 = lines * call / calls, l1 = lines * (call + 1) / calls;
                ++call;
#ifdef W_WIDENED_TILES
                if (step == panel && widen)
                    ft->wide[G](xg + k0, ldx, widened, panel, 0, k1 - k0, yg, ldy,
                                (const float *)(next + W_PER_LINE * l0), l1 - l0, 0);
                else
#endif
                if (step == panel)
                    t->wide[G](xg, ldx, w + n0, N, k0, k1, yg, ldy, next + W_PER_LINE * l0, l1 - l0, ahead);
                else t->one[G](xg, ldx, w + n0, N, k0, k1, yg, ldy, next + W_PER_LINE * l0, l1 - l0, ahead);
            }
            n0 += step;
        }
    }
    if (vec8 < c1) WS(tail_columns)((int)M, x, ldx, w + c0, N, 0, K, vec8 - c0, c1 - c0, y, ldy);
}

/* the share s of j's product (cpu/rows.c: column_share): the tiles, or the row groups streaming
 * the weight */
static void WS(product_columns)(const product_job *j, const column_share *s) {
    const float *x = j->x;
    const WT *w = j->w;
    const int64_t ldx = j->ldx, M = j->M, K = j->K, N = j->N, ldy = s->ldy, c0 = s->c0, c1 = s->c1;
    float *y = s->y;
    for (int64_t m = 0; m < M; ++m) memset(y + m * ldy, 0, (size_t)(c1 - c0) * sizeof(float));
    const int cached = K * N * (int64_t)sizeof(WT) <= CACHED_WEIGHT_BYTES;
    if (M >= (cached ? TILE_MIN_ROWS_CACHED : TILE_MIN_ROWS)) {
        const WS(tile_set) *t = isa512 ? &WS(AVX512_TILES) : &WS(AVX2_TILES);
        const int widen = WS(widens)(t, M);
        /* streamed from memory below TILE_K_LONG_ROWS rows: shorter blocks, each tile fetching its rows'
         * next panel; widened, TILE_K_WIDENED rows and the next block (cpu/rows.c) */
        const int64_t tile_k = cached || M >= TILE_K_LONG_ROWS ? TILE_K : widen ? TILE_K_WIDENED : TILE_K_STREAMED;
        WS(tiled_matmul)(t, tile_k, !cached && M < AHEAD_MAX_ROWS && !widen, j, s);
        return;
    }
    const WS(step_set) *set = isa512 ? &WS(AVX512_STEPS) : &WS(AVX2_STEPS);
    /* columns [c0, wide) in the chosen vectors, [wide, vec_end) in AVX2 ones, the rest one at a time */
    const int64_t groups = (M + GROUP_ROWS - 1) / GROUP_ROWS, wide = (c1 - c0) / set->width * set->width;
    const int64_t vec_end = (c1 - c0) / 8 * 8;
    const WT *wc = w + c0;
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        int64_t k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int64_t group = 0; group < groups; ++group) {
            int64_t m0 = M * group / groups, m1 = M * (group + 1) / groups;
            int G = (int)(m1 - m0), Q = set->q_of[G], Q8 = WS(AVX2_STEPS).q_of[G];
            const float *xg = x + m0 * ldx;
            float *yg = y + m0 * ldy;
            int64_t k = k0;
            if (wide > 0) {
                for (; k + Q <= k1; k += Q) set->q[G](xg, ldx, wc, N, k, wide, yg, ldy);
                for (; k < k1; ++k) set->one[G](xg, ldx, wc, N, k, wide, yg, ldy);
            }
            if (wide < vec_end) {  /* 8 columns left over from 16-column vectors */
                for (k = k0; k + Q8 <= k1; k += Q8) WS(AVX2_STEPS).q[G](xg, ldx, wc + wide, N, k, 8, yg + wide, ldy);
                for (; k < k1; ++k) WS(AVX2_STEPS).one[G](xg, ldx, wc + wide, N, k, 8, yg + wide, ldy);
            }
            if (vec_end < c1 - c0) WS(tail_columns)(G, xg, ldx, wc, N, k0, k1, vec_end, c1 - c0, yg, ldy);
        }
    }
}
