/* Decode-shape products y[M, O] = x[M, I] W^T (+ b) for M = 1..16 rows, straight from the stored weight.

   Every kernel reads each weight byte from memory once per call and runs all M rows against it,
   with OpenMP over the output rows (or column tiles). Row m of y is computed by exactly the same
   floating-point operations whatever M is (rows never share a reduction), so a row's result is
   bitwise independent of how many rows are in the call: what speculative verification needs.

   Row-major kernels (W stored [O, I]: fp32, int8, int4, Q8_0, Q4_0, Q4_1) dequantize one weight
   row into a float buffer (in L1) and take its dot product with every x row:

       four 8-lane accumulators over blocks of 32 inputs, summed (a0 + a1) + (a2 + a3), then the
       lanes in a fixed order, then the inputs past the last whole block one by one.

   The dequantized numbers are the reference's (ggml_blocks.py, int4.py): d * q for Q8_0,
   d * (q - 8) for Q4_0, d * q + m for Q4_1 (two roundings: compiled with -ffp-contract=off),
   (q - zero) * scale for int4; int8 multiplies the row's dot product of q by its scale instead.

   The column-major fp32 kernel (W^T stored [I, O], how layers.Linear keeps its weight) adds
   x[m, i] * W^T[i, o0:o0+32] into 32-wide tiles of y in input order (one fma chain per output).

   Compiled on first use by kernels/build.py (gcc -O3 -march=native -fopenmp); without AVX2 / FMA /
   F16C the plain C loops below run instead (same structure, no intrinsics).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CS336_AVX2 1
#endif

typedef int64_t i64;

int cs336_has_avx2(void) {
#ifdef CS336_AVX2
    return 1;
#else
    return 0;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float half_to_float(uint16_t h) {
#ifdef CS336_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24); /* zero or subnormal */
        return (h & 0x8000u) ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ------------------------------------------------------------------ dot products of one weight row */

#ifdef CS336_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s[r][j] = w[j] . x[r] for R rows and J weight rows (R * J <= 2). Each (row, weight row) pair gets
   its own four accumulators and the same operations whatever R and J are. */
static inline void dot_RJ(const float *w0, const float *w1, i64 I, const float *x, i64 ldx, int R, int J,
                          float s[2][2]) {
    const float *w[2] = {w0, w1};
    __m256 a[2][2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++)
            for (int k = 0; k < 4; k++) a[r][j][k] = _mm256_setzero_ps();
    i64 I32 = I & ~(i64)31;
    for (i64 i = 0; i < I32; i += 32)
        for (int j = 0; j < J; j++) {
            __m256 v0 = _mm256_loadu_ps(w[j] + i), v1 = _mm256_loadu_ps(w[j] + i + 8);
            __m256 v2 = _mm256_loadu_ps(w[j] + i + 16), v3 = _mm256_loadu_ps(w[j] + i + 24);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * ldx + i;
                a[r][j][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xr), a[r][j][0]);
                a[r][j][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xr + 8), a[r][j][1]);
                a[r][j][2] = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xr + 16), a[r][j][2]);
                a[r][j][3] = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xr + 24), a[r][j][3]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) {
            float t = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][j][0], a[r][j][1]), _mm256_add_ps(a[r][j][2], a[r][j][3])));
            const float *xr = x + r * ldx;
            for (i64 i = I32; i < I; i++) t = fmaf(w[j][i], xr[i], t);
            s[r][j] = t;
        }
}
#endif

/* s[m][j] = w_j . x[m] for all M rows and J = 1 or 2 weight rows (w1 unused when J = 1) */
static void dot_rows(const float *w0, const float *w1, int J, i64 I, const float *x, i64 ldx, i64 M, float s[16][2]) {
#ifdef CS336_AVX2
    float t[2][2];
    i64 m = 0;
    for (; m + 2 <= M; m += 2)
        for (int j = 0; j < J; j++) {
            dot_RJ(j ? w1 : w0, NULL, I, x + m * ldx, ldx, 2, 1, t);
            s[m][j] = t[0][0], s[m + 1][j] = t[1][0];
        }
    if (m < M) {
        dot_RJ(w0, w1, I, x + m * ldx, ldx, 1, J, t);
        for (int j = 0; j < J; j++) s[m][j] = t[0][j];
    }
#else
    for (int j = 0; j < J; j++) {
        const float *w = j ? w1 : w0;
        for (i64 m = 0; m < M; m++) {
            float lanes[32] = {0};
            const float *xm = x + m * ldx;
            i64 I32 = I & ~(i64)31, i = 0;
            for (; i < I32; i += 32)
                for (int k = 0; k < 32; k++) lanes[k] = fmaf(w[i + k], xm[i + k], lanes[k]);
            float t = 0;
            for (int k = 0; k < 32; k++) t += lanes[k];
            for (; i < I; i++) t = fmaf(w[i], xm[i], t);
            s[m][j] = t;
        }
    }
#endif
}

/* ------------------------------------------------------------------ dequantize one weight row */

enum { FMT_F32 = 0, FMT_INT8 = 1, FMT_INT4 = 2, FMT_Q8_0 = 3, FMT_Q4_0 = 4, FMT_Q4_1 = 5 };

typedef struct {
    int fmt;
    const void *w;          /* the stored weight, row-major [O, row_bytes] */
    i64 row_bytes;          /* bytes per stored row */
    const float *scale_f32; /* int8: [O] */
    const uint16_t *scale16; /* int4: fp16 [O, G] */
    const uint8_t *zero;    /* int4: [O, G] */
    i64 groups;             /* int4: G */
    int gshift;             /* int4: group size = 32 << gshift (the fused path), or -1 */
} Weight;

#ifdef CS336_AVX2
static inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
#endif

/* 16 bytes of nibbles -> 32 floats: byte j -> (low nibble, high nibble) at (j, j + 16) when
   `pairs` is 0 (llama.cpp), at (2j, 2j + 1) when `pairs` is 1 (int4.py); then (q - sub) * mul, or
   mul * q + add when q41 */
#ifdef CS336_AVX2
static inline void nibbles32v(const uint8_t *p, int pairs, float sub, float mul, float add, int q41, __m256 v[4]) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    __m128i first = lo, second = hi;
    if (pairs) {
        first = _mm_unpacklo_epi8(lo, hi);
        second = _mm_unpackhi_epi8(lo, hi);
    }
    __m256 vs = _mm256_set1_ps(sub), vm = _mm256_set1_ps(mul), va = _mm256_set1_ps(add);
    __m256 q[4] = {u8x8_to_ps(first), u8x8_to_ps(_mm_srli_si128(first, 8)), u8x8_to_ps(second),
                   u8x8_to_ps(_mm_srli_si128(second, 8))};
    for (int k = 0; k < 4; k++)
        v[k] = q41 ? _mm256_add_ps(_mm256_mul_ps(vm, q[k]), va) : _mm256_mul_ps(_mm256_sub_ps(q[k], vs), vm);
}
#endif

static inline void nibbles32(const uint8_t *p, int pairs, float sub, float mul, float add, int q41, float *out) {
#ifdef CS336_AVX2
    __m256 v[4];
    nibbles32v(p, pairs, sub, mul, add, q41, v);
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + 8 * k, v[k]);
#else
    for (int j = 0; j < 16; j++) {
        float a = (float)(p[j] & 0x0f), b = (float)(p[j] >> 4);
        int ia = pairs ? 2 * j : j, ib = pairs ? 2 * j + 1 : j + 16;
        out[ia] = q41 ? mul * a + add : (a - sub) * mul;
        out[ib] = q41 ? mul * b + add : (b - sub) * mul;
    }
#endif
}

static void dequantize_row(const Weight *W, i64 o, i64 I, float *out) {
    const uint8_t *row = (const uint8_t *)W->w + o * W->row_bytes;
    if (W->fmt == FMT_INT8) {
        const int8_t *q = (const int8_t *)row;
        i64 i = 0;
#ifdef CS336_AVX2
        for (; i + 8 <= I; i += 8) _mm256_storeu_ps(out + i, i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(q + i))));
#endif
        for (; i < I; i++) out[i] = (float)q[i];
    } else if (W->fmt == FMT_INT4) {
        i64 gs = I / W->groups;
        for (i64 g = 0; g < W->groups; g++) {
            float s = half_to_float(W->scale16[o * W->groups + g]), z = (float)W->zero[o * W->groups + g];
            const uint8_t *p = row + g * gs / 2;
            float *dst = out + g * gs;
            i64 j = 0;
            for (; j + 32 <= gs; j += 32) nibbles32(p + j / 2, 1, z, s, 0.f, 0, dst + j);
            for (; j < gs; j += 2) {
                uint8_t b = p[j / 2];
                dst[j] = ((float)(b & 0x0f) - z) * s;
                dst[j + 1] = ((float)(b >> 4) - z) * s;
            }
        }
    } else if (W->fmt == FMT_Q8_0) {
        for (i64 blk = 0; blk < I / 32; blk++) {
            const uint8_t *p = row + blk * 34;
            float d = half_to_float(read_u16(p));
            const int8_t *q = (const int8_t *)(p + 2);
#ifdef CS336_AVX2
            __m256 vd = _mm256_set1_ps(d);
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(out + blk * 32 + 8 * k,
                                 _mm256_mul_ps(vd, i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(q + 8 * k)))));
#else
            for (int k = 0; k < 32; k++) out[blk * 32 + k] = d * (float)q[k];
#endif
        }
    } else if (W->fmt == FMT_Q4_0) {
        for (i64 blk = 0; blk < I / 32; blk++) {
            const uint8_t *p = row + blk * 18;
            nibbles32(p + 2, 0, 8.f, half_to_float(read_u16(p)), 0.f, 0, out + blk * 32);
        }
    } else { /* FMT_Q4_1 */
        for (i64 blk = 0; blk < I / 32; blk++) {
            const uint8_t *p = row + blk * 20;
            nibbles32(p + 4, 0, 0.f, half_to_float(read_u16(p)), half_to_float(read_u16(p + 2)), 1, out + blk * 32);
        }
    }
}

#ifdef CS336_AVX2
/* Block blk (32 weights) of weight row o in four registers: the numbers dequantize_row writes. */
static inline void block32(const Weight *W, int fmt, i64 o, i64 blk, i64 I, __m256 v[4]) {
    const uint8_t *row = (const uint8_t *)W->w + o * W->row_bytes;
    if (fmt == FMT_F32) {
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps((const float *)row + blk * 32 + 8 * k);
    } else if (fmt == FMT_INT8) {
        for (int k = 0; k < 4; k++) v[k] = i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(row + blk * 32 + 8 * k)));
    } else if (fmt == FMT_INT4) {
        i64 g = blk >> W->gshift;
        float sc = half_to_float(W->scale16[o * W->groups + g]), z = (float)W->zero[o * W->groups + g];
        nibbles32v(row + blk * 16, 1, z, sc, 0.f, 0, v);
    } else if (fmt == FMT_Q8_0) {
        const uint8_t *p = row + blk * 34;
        __m256 vd = _mm256_set1_ps(half_to_float(read_u16(p)));
        for (int k = 0; k < 4; k++) v[k] = _mm256_mul_ps(vd, i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * k))));
    } else if (fmt == FMT_Q4_0) {
        const uint8_t *p = row + blk * 18;
        nibbles32v(p + 2, 0, 8.f, half_to_float(read_u16(p)), 0.f, 0, v);
    } else {
        const uint8_t *p = row + blk * 20;
        nibbles32v(p + 4, 0, 0.f, half_to_float(read_u16(p)), half_to_float(read_u16(p + 2)), 1, v);
    }
}

/* dot_RJ without the float buffer: the weights are dequantized in registers (M <= 2). The same
   operations per (row, weight row) as dot_RJ on dequantize_row's output, so the same result. */
static inline void fused_RJ(const Weight *W, int fmt, i64 o, int J, const float *x, i64 ldx, int R, i64 I,
                            float s[2][2]) {
    __m256 a[2][2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++)
            for (int k = 0; k < 4; k++) a[r][j][k] = _mm256_setzero_ps();
    i64 I32 = I & ~(i64)31;
    for (i64 blk = 0; blk < I32 / 32; blk++)
        for (int j = 0; j < J; j++) {
            __m256 v[4];
            block32(W, fmt, o + j, blk, I, v);
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * ldx + blk * 32;
                for (int k = 0; k < 4; k++) a[r][j][k] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(xr + 8 * k), a[r][j][k]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) {
            float t = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][j][0], a[r][j][1]), _mm256_add_ps(a[r][j][2], a[r][j][3])));
            const float *xr = x + r * ldx;
            const uint8_t *row = (const uint8_t *)W->w + (o + j) * W->row_bytes;
            for (i64 i = I32; i < I; i++) /* only fp32 and int8 rows have a partial block */
                t = fmaf(fmt == FMT_F32 ? ((const float *)row)[i] : (float)((const int8_t *)row)[i], xr[i], t);
            s[r][j] = t;
        }
}

static inline void fused_pair(const Weight *W, int fmt, i64 o, int J, const float *x, i64 ldx, i64 M, i64 I,
                              float s[16][2]) {
    float t[2][2];
    if (M == 2) {
        for (int j = 0; j < J; j++) {
            fused_RJ(W, fmt, o + j, 1, x, ldx, 2, I, t);
            s[0][j] = t[0][0], s[1][j] = t[1][0];
        }
    } else {
        fused_RJ(W, fmt, o, J, x, ldx, 1, I, t);
        for (int j = 0; j < J; j++) s[0][j] = t[0][j];
    }
}
#endif

/* y[m, o] = (x[m] . W[o]) (* scale[o] for int8) (+ bias[o]) for the row-major formats; output rows
   go in pairs (two weight rows against the last odd x row keep 8 fma chains busy at M = 1) */
static void rowmajor_mm(const Weight *W, const float *x, i64 M, i64 I, i64 ldx, i64 O, const float *bias,
                        float *y, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = W->fmt == FMT_F32 ? NULL : (float *)malloc(sizeof(float) * (size_t)(2 * I + 64));
        float s[16][2];
#pragma omp for schedule(static)
        for (i64 p = 0; p < (O + 1) / 2; p++) {
            i64 o = 2 * p;
            int J = o + 1 < O ? 2 : 1;
#ifdef CS336_AVX2
            if (M <= 2 && (W->fmt != FMT_INT4 || W->gshift >= 0)) {
                switch (W->fmt) { /* one specialized copy per format */
                case FMT_F32: fused_pair(W, FMT_F32, o, J, x, ldx, M, I, s); break;
                case FMT_INT8: fused_pair(W, FMT_INT8, o, J, x, ldx, M, I, s); break;
                case FMT_INT4: fused_pair(W, FMT_INT4, o, J, x, ldx, M, I, s); break;
                case FMT_Q8_0: fused_pair(W, FMT_Q8_0, o, J, x, ldx, M, I, s); break;
                case FMT_Q4_0: fused_pair(W, FMT_Q4_0, o, J, x, ldx, M, I, s); break;
                default: fused_pair(W, FMT_Q4_1, o, J, x, ldx, M, I, s); break;
                }
                goto store;
            }
#endif
            const float *w[2];
            for (int j = 0; j < J; j++) {
                w[j] = (const float *)((const uint8_t *)W->w + (o + j) * W->row_bytes);
                if (buf) {
                    dequantize_row(W, o + j, I, buf + j * (I + 32));
                    w[j] = buf + j * (I + 32);
                }
            }
            dot_rows(w[0], J == 2 ? w[1] : NULL, J, I, x, ldx, M, s);
#ifdef CS336_AVX2
        store:
#endif
            for (int j = 0; j < J; j++) {
                float scale = W->fmt == FMT_INT8 ? W->scale_f32[o + j] : 1.f, b = bias ? bias[o + j] : 0.f;
                for (i64 m = 0; m < M; m++) {
                    float v = W->fmt == FMT_INT8 ? s[m][j] * scale : s[m][j];
                    y[m * O + o + j] = bias ? v + b : v;
                }
            }
        }
        free(buf);
    }
}

/* ------------------------------------------------------------------ entry points (ctypes) */

void cs336_f32_rows(const float *x, i64 M, i64 I, i64 ldx, const float *w, i64 O, const float *bias, float *y,
                    int threads) {
    Weight W = {FMT_F32, w, I * 4, NULL, NULL, NULL, 0, 0};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

void cs336_int8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                const float *bias, float *y, int threads) {
    Weight W = {FMT_INT8, q, I, scale, NULL, NULL, 0, 0};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

void cs336_int4(const float *x, i64 M, i64 I, i64 ldx, const uint8_t *packed, const uint16_t *scale,
                const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads) {
    int gshift = -1;
    for (int k = 0; k < 16; k++)
        if (I / G == (i64)32 << k) gshift = k;
    Weight W = {FMT_INT4, packed, I / 2, NULL, scale, zero, G, gshift};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

void cs336_ggml(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *raw, i64 O, const float *bias,
                float *y, int threads) {
    i64 block = fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20;
    Weight W = {fmt, raw, I / 32 * block, NULL, NULL, NULL, 0, 0};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

/* Column-major fp32: wt = W^T stored [I, O] (contiguous). Tiles of 32 outputs, inputs in blocks of
   IB so that a tile's block of W^T stays in L1 while every row chunk passes over it. */
#define TILE 32
#define IB 64
void cs336_f32_cols(const float *x, i64 M, i64 I, i64 ldx, const float *wt, i64 O, const float *bias, float *y,
                    int threads) {
    i64 tiles = O / TILE;
#pragma omp parallel num_threads(threads)
    {
        float acc[16][TILE];
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++) {
            i64 o0 = t * TILE;
            memset(acc, 0, sizeof(acc));
            for (i64 i0 = 0; i0 < I; i0 += IB) {
                i64 i1 = i0 + IB < I ? i0 + IB : I;
#ifdef CS336_AVX2
                for (i64 m = 0; m < M; m++) {
                    __m256 a0 = _mm256_loadu_ps(acc[m]), a1 = _mm256_loadu_ps(acc[m] + 8);
                    __m256 a2 = _mm256_loadu_ps(acc[m] + 16), a3 = _mm256_loadu_ps(acc[m] + 24);
                    const float *xm = x + m * ldx;
                    for (i64 i = i0; i < i1; i++) {
                        const float *w = wt + i * O + o0;
                        __m256 xv = _mm256_set1_ps(xm[i]);
                        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w), a0);
                        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8), a1);
                        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 16), a2);
                        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 24), a3);
                    }
                    _mm256_storeu_ps(acc[m], a0);
                    _mm256_storeu_ps(acc[m] + 8, a1);
                    _mm256_storeu_ps(acc[m] + 16, a2);
                    _mm256_storeu_ps(acc[m] + 24, a3);
                }
#else
                for (i64 m = 0; m < M; m++)
                    for (i64 i = i0; i < i1; i++)
                        for (int k = 0; k < TILE; k++) acc[m][k] = fmaf(x[m * ldx + i], wt[i * O + o0 + k], acc[m][k]);
#endif
            }
            for (i64 m = 0; m < M; m++)
                for (int k = 0; k < TILE; k++) y[m * O + o0 + k] = bias ? acc[m][k] + bias[o0 + k] : acc[m][k];
        }
    }
    /* the last O % TILE outputs: one fma chain each, in input order (as above) */
    for (i64 o = tiles * TILE; o < O; o++)
        for (i64 m = 0; m < M; m++) {
            float a = 0.f;
            for (i64 i = 0; i < I; i++) a = fmaf(x[m * ldx + i], wt[i * O + o], a);
            y[m * O + o] = bias ? a + bias[o] : a;
        }
}
