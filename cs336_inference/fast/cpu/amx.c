/* int4 and int8 products on Intel AMX tiles (opt-in: CS336_KERNELS_AMX=1): many rows for the price of one.

   Why: with fp32 FMAs every extra row of x costs one multiply-add per weight, so a 17-row verify
   pass of quantized SmolLM2 costs several one-token steps (docs/kernels.md). AMX's tile unit
   (TDPBF16PS) multiplies a 16 x 32 bf16 tile by a 32 x 16 one in about the time an AVX-512 core
   spends on 32 fp32 FMAs, whatever the number of rows up to 16.

   The numbers stay the reference's, to fp32 rounding, although the tile unit only takes bf16:
     - the weights are exact in bf16: int8's q (|q| <= 127) and int4's q - zero (in [-15, 15]); the
       scales are applied in fp32 afterwards, int8's per row to the row's sum and int4's per group
       to the group's sum;
     - x is split into three bf16 parts, x = hi + mid + lo with hi = bf16(x), mid = bf16(x - hi),
       lo = bf16(x - hi - mid), which hold all 24 bits of an fp32 significand; every product
       weight * part is exact in the tile unit's fp32 accumulator (two parts would leave ~1.5e-6 of
       sum |x||w|, twenty times fp32's rounding: the tests tell the two apart).
   The three parts of a row are three columns of the x tile (column 3 m + p: part p of row m), so
   one product serves five rows; the row's result is (hi + mid) + lo of its scaled sums. Each output
   is computed from its own weight row and its own three columns only, so a row's result does not
   depend on the other rows: the same bits at every M (tested).

   Layout: an A tile is 16 weight rows x 32 weights, decoded to bf16 and stored to L1 (int8 by
   conversion; int4 by a 16-entry table of bf16(k - zero), vpermw). For int4, inside each 64-weight
   superblock the even weights (low nibbles) form one 32-block and the odd ones (high nibbles) the
   next, and x is laid out in that order, so decoding needs no shuffle. A B tile holds, for 32 of
   those inputs, the pairs (x[2k], x[2k + 1]) of 16 columns.

   When to use it: at one row the tile unit gains nothing, and decoding to bf16 tiles (plus int4's
   per-group scaling) costs more than the AVX-512 kernels' fp32 FMAs: the native SmolLM2 step takes
   1.2x (int4) and 1.5x (int8) as long, while a 17-token one takes 0.43x and 0.58x (docs/kernels.md,
   Intel Xeon with AMX). So it is off by default; with it on, every product of
   those formats at every M takes this path, so that a verify pass keeps the bits of the one-token
   steps. Shapes it does not cover (outputs not a multiple of 32; int8 inputs or int4 groups not a
   multiple of 64) and CPUs without AMX keep decode.c's kernels.

   Compiled into the same library as decode.c; without AMX (or -march without it) only the stubs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS_PER_CALL 21 /* 3 x 21 = 63 columns: at most 4 column tiles */

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static int amx_on = 0;
static __m512i LUT[16]; /* LUT[z]: words k = 0..15 hold bf16(k - z) */

/* 1 if AMX products are on after the call: on = 1 asks Linux for the tile state (once per process) */
int cs336_amx_enable(int on) {
    static int permitted = -1;
    if (!on) return amx_on = 0;
    if (permitted < 0) {
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int z = 0; z < 16; z++)
            LUT[z] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(k, _mm512_set1_ps((float)z))));
    }
    return amx_on = permitted;
}

/* tile register numbers must be constants: these switches fold away once inlined */
#define AI static inline __attribute__((always_inline))
AI void t_load(int t, const void *p) {
    switch (t) {
    case 4: _tile_loadd(4, p, 64); break;
    case 5: _tile_loadd(5, p, 64); break;
    case 6: _tile_loadd(6, p, 64); break;
    default: _tile_loadd(7, p, 64); break;
    }
}
AI void t_store(int t, void *p) {
    switch (t) {
    case 0: _tile_stored(0, p, 64); break;
    case 1: _tile_stored(1, p, 64); break;
    case 2: _tile_stored(2, p, 64); break;
    case 3: _tile_stored(3, p, 64); break;
    case 4: _tile_stored(4, p, 64); break;
    default: _tile_stored(5, p, 64); break;
    }
}
AI void t_zero(int t) {
    switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    case 3: _tile_zero(3); break;
    case 4: _tile_zero(4); break;
    default: _tile_zero(5); break;
    }
}
#define DP(C, A, B)                                                                                          \
    case C * 4 + (A - 4) * 2 + (B - 6): _tile_dpbf16ps(C, A, B); break;
AI void t_dp(int c, int a, int b) { /* C tile c += A tile a . B tile b */
    switch (c * 4 + (a - 4) * 2 + (b - 6)) {
        DP(0, 4, 6) DP(0, 4, 7) DP(0, 5, 6) DP(0, 5, 7) DP(1, 4, 6) DP(1, 4, 7) DP(1, 5, 6) DP(1, 5, 7)
        DP(2, 4, 6) DP(2, 4, 7) DP(2, 5, 6) DP(2, 5, 7) DP(3, 4, 6) DP(3, 4, 7) DP(3, 5, 6) DP(3, 5, 7)
    }
}

/* x[M, I] as B tiles: xb[(c * KB + kb) * 256 + k2 * 16 + j] = the pair of inputs (2 k2, 2 k2 + 1) of
   32-block kb in column j = 3 m + p - 16 c (int4: in superblock order, evens then odds). This fills
   the three columns of row m for the 64 inputs of superblock s. */
static void x_columns(const float *x, i64 m, i64 s, i64 I, i64 ldx, uint32_t *xb, int evens_odds) {
    const i64 KB = I / 32;
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    const float *xs = x + m * ldx + s * 64;
    __m512 v0 = _mm512_loadu_ps(xs), v1 = _mm512_loadu_ps(xs + 16);
    __m512 v2 = _mm512_loadu_ps(xs + 32), v3 = _mm512_loadu_ps(xs + 48);
    __m512 half[2][2] = {{v0, v1}, {v2, v3}}; /* int8: the inputs in order */
    if (evens_odds) {                          /* int4: the order of its nibbles */
        half[0][0] = _mm512_permutex2var_ps(v0, ev, v1), half[0][1] = _mm512_permutex2var_ps(v2, ev, v3);
        half[1][0] = _mm512_permutex2var_ps(v0, od, v1), half[1][1] = _mm512_permutex2var_ps(v2, od, v3);
    }
    for (int h = 0; h < 2; h++) {
        __m512 a = half[h][0], b = half[h][1]; /* what is left of the 32 inputs */
        for (int p = 0; p < 3; p++) {
            __m512i part = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* words 0-15 from a, 16-31 from b */
            __m512 pa = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(part)), 16));
            __m512 pb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(part, 1)), 16));
            a = _mm512_sub_ps(a, pa), b = _mm512_sub_ps(b, pb); /* exact */
            uint32_t pairs[16];
            _mm512_storeu_si512(pairs, part);
            i64 col = 3 * m + p;
            uint32_t *t = xb + ((col / 16) * KB + 2 * s + h) * 256 + col % 16;
            for (int k2 = 0; k2 < 16; k2++) t[k2 * 16] = pairs[k2];
        }
    }
}

/* int4 rows o0 .. o0 + R - 1, superblock s (in group g), as bf16 A blocks of (q - zero): abuf[0] the
   low nibbles (even weights), abuf[1] the high ones (odd); weight row r at abuf[h][r / 16][r % 16] */
AI void int4_decode(const uint8_t *base, i64 rb, int R, i64 s, const uint8_t *zero, i64 G, i64 o0, i64 g,
                    uint16_t (*abuf)[2][16][32]) {
    for (int r = 0; r < R; r++) {
        const uint8_t *p = base + r * rb + s * 32;
        __builtin_prefetch(p + R * rb); /* the next tile's rows */
        __m512i lut = LUT[zero[(o0 + r) * G + g]];
        __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
        __m512i lo = _mm512_and_si512(q, _mm512_set1_epi16(0x0f)), hi = _mm512_srli_epi16(q, 4);
        _mm512_store_si512(abuf[0][r / 16][r % 16], _mm512_permutexvar_epi16(lo, lut));
        _mm512_store_si512(abuf[1][r / 16][r % 16], _mm512_permutexvar_epi16(hi, lut));
    }
}

/* y[m, o0 + r] = (hi + mid) + lo of row r's three columns 3 m + p (+ bias), for R weight rows whose
   sums sit at sums + r * stride */
AI void write_rows(const float *sums, i64 stride, int R, i64 M, i64 o0, i64 O, const float *bias, float *y) {
    for (i64 m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            const float *c = sums + r * stride + 3 * m;
            float v = (c[0] + c[1]) + c[2];
            y[m * O + o0 + r] = bias ? v + bias[o0 + r] : v;
        }
}

/* acc[r][16 c ..] += group g's sums (C tiles first + c, stored in cbuf) times row r's scale, in fp32 */
AI void scale_group(float (*acc)[64], float (*cbuf)[16][16], int first, int NCH, const uint16_t *scale16, i64 o0,
                    i64 G, i64 g) {
    for (int r = 0; r < 16; r++) {
        __m512 sc = _mm512_set1_ps(_cvtsh_ss(scale16[(o0 + r) * G + g]));
        for (int c = 0; c < NCH; c++) {
            __m512 v = _mm512_load_ps(acc[r] + 16 * c);
            _mm512_store_ps(acc[r] + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(cbuf[first + c][r]), sc, v));
        }
    }
}

/* int4, 3 or 4 column tiles (11 to 21 rows), 16 weight rows from o0: y[m, o0 + r] for the call's M
   rows; each group's sums are scaled into acc as soon as its products are done (there are not tiles
   enough to alternate, as int4_tile_1 and int4_tile_n do) */
AI void int4_tile(int NCH, const uint32_t *xb, i64 I, const uint8_t *packed, const uint16_t *scale16,
                  const uint8_t *zero, i64 G, i64 o0, i64 M, i64 O, const float *bias, float *y,
                  uint16_t (*abuf)[2][16][32], float (*cbuf)[16][16], float (*acc)[64]) {
    const i64 KB = I / 32, rb = I / 2, per_group = I / G / 64; /* superblocks per group */
    const uint8_t *base = packed + o0 * rb;
    for (int r = 0; r < 16; r++) memset(acc[r], 0, sizeof(float) * 16 * NCH);
    for (i64 g = 0; g < G; g++) {
        for (int c = 0; c < NCH; c++) t_zero(c);
        for (i64 s = g * per_group; s < (g + 1) * per_group; s++) {
            int4_decode(base, rb, 16, s, zero, G, o0, g, abuf);
            for (int h = 0; h < 2; h++) {
                t_load(4, abuf[h][0]);
                for (int c = 0; c < NCH; c++) {
                    t_load(6 + (c & 1), xb + (c * KB + 2 * s + h) * 256);
                    t_dp(c, 4, 6 + (c & 1));
                }
            }
        }
        for (int c = 0; c < NCH; c++) t_store(c, cbuf[c]);
        scale_group(acc, cbuf, 0, NCH, scale16, o0, G, g);
    }
    write_rows(acc[0], 64, 16, M, o0, O, bias, y);
}

/* int4, one column tile (up to 5 rows), 16 weight rows. The 16 row sums stay in registers, and the
   groups' sums alternate between C tiles 0 and 1, so group g - 1 is scaled while group g's products
   run: storing a tile and reading it back at once had cost a fifth of the time (SmolLM2's products,
   all M = 1 calls of a step: 6.4 ms -> 5.6 ms). */
AI void int4_tile_1(const uint32_t *xb, i64 I, const uint8_t *packed, const uint16_t *scale16, const uint8_t *zero,
                    i64 G, i64 o0, i64 M, i64 O, const float *bias, float *y, uint16_t (*abuf)[2][16][32],
                    float (*cbuf)[16][16]) {
    const i64 rb = I / 2, per_group = I / G / 64;
    const uint8_t *base = packed + o0 * rb;
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (i64 g = 0; g < G; g++) { /* group g in C tile g & 1; group g - 1 scaled once g's products are issued */
        if (g & 1) _tile_zero(1); else _tile_zero(0);
        for (i64 s = g * per_group; s < (g + 1) * per_group; s++) {
            int4_decode(base, rb, 16, s, zero, G, o0, g, abuf);
            _tile_loadd(4, abuf[0][0], 64);
            _tile_loadd(6, xb + (2 * s) * 256, 64);
            _tile_loadd(5, abuf[1][0], 64);
            _tile_loadd(7, xb + (2 * s + 1) * 256, 64);
            if (g & 1) { _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(1, 5, 7); }
            else { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 7); }
        }
        if (g > 0)
            for (int r = 0; r < 16; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf[(g - 1) & 1][r]), _mm512_set1_ps(_cvtsh_ss(scale16[(o0 + r) * G + g - 1])), acc[r]);
        if (g & 1) _tile_stored(1, cbuf[1], 64); else _tile_stored(0, cbuf[0], 64);
    }
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf[(G - 1) & 1][r]), _mm512_set1_ps(_cvtsh_ss(scale16[(o0 + r) * G + G - 1])), acc[r]);
    float out[16][16] __attribute__((aligned(64)));
    for (int r = 0; r < 16; r++) _mm512_store_ps(out[r], acc[r]);
    write_rows(out[0], 16, 16, M, o0, O, bias, y);
}

/* int4, two column tiles (6 to 10 rows), 16 weight rows: as int4_tile_1 with its sums in L1 */
AI void t_dp67(int t) { /* C tile t += A tile 6 . B tile 7 */
    switch (t) {
    case 0: _tile_dpbf16ps(0, 6, 7); break;
    case 1: _tile_dpbf16ps(1, 6, 7); break;
    case 2: _tile_dpbf16ps(2, 6, 7); break;
    case 3: _tile_dpbf16ps(3, 6, 7); break;
    case 4: _tile_dpbf16ps(4, 6, 7); break;
    default: _tile_dpbf16ps(5, 6, 7); break;
    }
}

AI void int4_tile_n(int NCH, const uint32_t *xb, i64 I, const uint8_t *packed, const uint16_t *scale16,
                    const uint8_t *zero, i64 G, i64 o0, i64 M, i64 O, const float *bias, float *y,
                    uint16_t (*abuf)[2][16][32], float (*cbuf)[16][16], float (*acc)[64]) {
    const i64 KB = I / 32, rb = I / 2, per_group = I / G / 64;
    const uint8_t *base = packed + o0 * rb;
    for (int r = 0; r < 16; r++) memset(acc[r], 0, sizeof(float) * 16 * NCH);
    for (i64 g = 0; g < G; g++) { /* group g in C tiles (g & 1) NCH + c; group g - 1 scaled after g's products */
        const int par = (int)(g & 1);
        for (int c = 0; c < NCH; c++) t_zero(par * NCH + c);
        for (i64 s = g * per_group; s < (g + 1) * per_group; s++) {
            int4_decode(base, rb, 16, s, zero, G, o0, g, abuf);
            for (int h = 0; h < 2; h++) {
                _tile_loadd(6, abuf[h][0], 64);
                for (int c = 0; c < NCH; c++) {
                    _tile_loadd(7, xb + (c * KB + 2 * s + h) * 256, 64);
                    t_dp67(par * NCH + c);
                }
            }
        }
        if (g > 0) scale_group(acc, cbuf, (1 - par) * NCH, NCH, scale16, o0, G, g - 1);
        for (int c = 0; c < NCH; c++) t_store(par * NCH + c, cbuf[par * NCH + c]);
    }
    scale_group(acc, cbuf, (int)((G - 1) & 1) * NCH, NCH, scale16, o0, G, G - 1);
    write_rows(acc[0], 64, 16, M, o0, O, bias, y);
}

/* int8: A = bf16(q), exact for |q| <= 127; one sum per row over all of I, times the row's scale */
AI void int8_tile(int RA, int NCH, const uint32_t *xb, i64 I, const int8_t *q, const float *scale, i64 o0, i64 M,
                  i64 O, const float *bias, float *y, uint16_t (*abuf)[2][16][32], float (*cbuf)[16][16]) {
    const i64 KB = I / 32;
    const int R = 16 * RA;
    const int8_t *base = q + o0 * I;
    for (int t = 0; t < RA * NCH; t++) t_zero(t);
#define INT8_DECODE(kb)                                                                                     \
    for (int r = 0; r < R; r++) {                                                                           \
        const int8_t *p = base + r * I + (kb) * 32;                                                         \
        __builtin_prefetch(p + R * I);                                                                      \
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));           \
        __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));    \
        _mm512_store_si512(abuf[(kb) & 1][r / 16][r % 16], (__m512i)_mm512_cvtne2ps_pbh(b, a));             \
    }
    INT8_DECODE(0)
    for (i64 kb = 0; kb < KB; kb++) {
        if (kb + 1 < KB) { INT8_DECODE(kb + 1) } /* one block ahead: a tile never loads what was just stored */
        for (int a = 0; a < RA; a++) t_load(4 + a, abuf[kb & 1][a]);
        for (int c = 0; c < NCH; c++) {
            t_load(6 + (c & 1), xb + (c * KB + kb) * 256);
            for (int a = 0; a < RA; a++) t_dp(a * NCH + c, 4 + a, 6 + (c & 1));
        }
    }
#undef INT8_DECODE
    for (int t = 0; t < RA * NCH; t++) t_store(t, cbuf[t]);
    for (i64 m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            const int t = (r / 16) * NCH; /* row r's C tiles: t + column / 16 */
            const i64 j = 3 * m;
            float v = (cbuf[t + j / 16][r % 16][j % 16] + cbuf[t + (j + 1) / 16][r % 16][(j + 1) % 16]) +
                      cbuf[t + (j + 2) / 16][r % 16][(j + 2) % 16];
            v *= scale[o0 + r];
            y[m * O + o0 + r] = bias ? v + bias[o0 + r] : v;
        }
}

typedef struct {
    int int8;               /* 1: int8 per row; 0: int4 in groups */
    const void *w;          /* int8 q [O, I] or int4 packed [O, I / 2] */
    const void *scale;      /* int8: float [O]; int4: fp16 [O, G] */
    const uint8_t *zero;    /* int4: [O, G] */
    i64 G;                  /* int4: groups per row */
} AmxWeight;

static void amx_rows(const float *x, i64 M, i64 I, i64 ldx, const AmxWeight *W, i64 O, const float *bias, float *y,
                     int threads) {
    const int NCH = (int)((3 * M + 15) / 16), RA = W->int8 && NCH <= 2 ? 2 : 1; /* 16 RA weight rows a tile */
    const i64 KB = I / 32, S = I / 64, tiles = O / (16 * RA);
    uint32_t *xb = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(NCH * KB * 256));
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (i64 s = 0; s < S; s++) { /* a thread per superblock: its tiles' cache lines are its own */
            for (i64 m = 0; m < M; m++) x_columns(x, m, s, I, ldx, xb, !W->int8);
            for (i64 kb = 2 * s; kb < 2 * s + 2; kb++) /* the columns past the last row: zeros */
                for (int k2 = 0; k2 < 16; k2++)
                    for (i64 col = 3 * M; col < 16 * NCH; col++) xb[((col / 16) * KB + kb) * 256 + k2 * 16 + col % 16] = 0;
        }
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* 0-3: C, 4-5: A, 6-7: B */
        _tile_loadconfig(&cfg);
        uint16_t abuf[2][2][16][32] __attribute__((aligned(64)));
        float cbuf[6][16][16] __attribute__((aligned(64)));
        float acc[32][64] __attribute__((aligned(64)));
        const float *s8 = (const float *)W->scale;
        const int8_t *q8 = (const int8_t *)W->w;
        const uint8_t *q4 = (const uint8_t *)W->w;
        const uint16_t *s4 = (const uint16_t *)W->scale;
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++) {
            i64 o0 = t * 16 * RA;
            if (W->int8) switch (NCH) {
                case 1: int8_tile(2, 1, xb, I, q8, s8, o0, M, O, bias, y, abuf, cbuf); break;
                case 2: int8_tile(2, 2, xb, I, q8, s8, o0, M, O, bias, y, abuf, cbuf); break;
                case 3: int8_tile(1, 3, xb, I, q8, s8, o0, M, O, bias, y, abuf, cbuf); break;
                default: int8_tile(1, 4, xb, I, q8, s8, o0, M, O, bias, y, abuf, cbuf); break;
                }
            else switch (NCH) {
                case 1: int4_tile_1(xb, I, q4, s4, W->zero, W->G, o0, M, O, bias, y, abuf, cbuf); break;
                case 2: int4_tile_n(2, xb, I, q4, s4, W->zero, W->G, o0, M, O, bias, y, abuf, cbuf, acc); break;
                case 3: int4_tile(3, xb, I, q4, s4, W->zero, W->G, o0, M, O, bias, y, abuf, cbuf, acc); break;
                default: int4_tile(4, xb, I, q4, s4, W->zero, W->G, o0, M, O, bias, y, abuf, cbuf, acc); break;
                }
        }
        _tile_release();
    }
    free(xb);
}

static void amx_chunks(const float *x, i64 M, i64 I, i64 ldx, const AmxWeight *W, i64 O, const float *bias, float *y,
                       int threads) {
    for (i64 m = 0; m < M; m += ROWS_PER_CALL) { /* rows are independent: chunks change no bits */
        i64 n = M - m < ROWS_PER_CALL ? M - m : ROWS_PER_CALL;
        amx_rows(x + m * ldx, n, I, ldx, W, O, bias, y + m * O, threads);
    }
}

/* y = x W^T (+ b) through the tile unit when it is on and the shape fits: 1, else 0 (decode.c runs) */
int cs336_amx_int4(const float *x, i64 M, i64 I, i64 ldx, const uint8_t *packed, const uint16_t *scale16,
                   const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads) {
    if (!amx_on || M < 1 || G < 1 || I % G || (I / G) % 64 || O % 32) return 0;
    AmxWeight W = {0, packed, scale16, zero, G};
    amx_chunks(x, M, I, ldx, &W, O, bias, y, threads);
    return 1;
}

int cs336_amx_int8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                   const float *bias, float *y, int threads) {
    if (!amx_on || M < 1 || I < 64 || I % 64 || O % 32) return 0;
    AmxWeight W = {1, q, scale, NULL, 0};
    amx_chunks(x, M, I, ldx, &W, O, bias, y, threads);
    return 1;
}

#else /* no AMX in this build: decode.c's kernels run */
int cs336_amx_enable(int on) {
    (void)on;
    return 0;
}
int cs336_amx_int4(const float *x, i64 M, i64 I, i64 ldx, const uint8_t *packed, const uint16_t *scale16,
                   const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads) {
    (void)x, (void)M, (void)I, (void)ldx, (void)packed, (void)scale16, (void)zero, (void)G, (void)O, (void)bias,
        (void)y, (void)threads;
    return 0;
}
int cs336_amx_int8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                   const float *bias, float *y, int threads) {
    (void)x, (void)M, (void)I, (void)ldx, (void)q, (void)scale, (void)O, (void)bias, (void)y, (void)threads;
    return 0;
}
#endif
