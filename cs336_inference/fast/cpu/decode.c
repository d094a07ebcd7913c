/* Decode-shape products y[M, O] = x[M, I] W^T (+ b) for M = 1..32 rows, straight from the stored weight.

   Every kernel reads each weight byte from memory once per call and runs all M rows against it,
   with OpenMP over the output rows (or column tiles). Row m of y is computed by exactly the same
   floating-point operations whatever M is (rows never share a reduction), so a row's result is
   bitwise independent of how many rows are in the call: what speculative verification needs.

   Row-major kernels (W stored [O, I]: fp32, int8, int4, Q8_0, Q4_0, Q4_1) take 4 weight rows at a
   time and decode them in registers, VL inputs (fp32, int8) or one 32-block at a time, then
   multiply-add them into one VL-lane accumulator per (x row, weight row) pair, 4 x rows at a time.
   With more x rows the tiles change shape (`rowmajor_mm`): 2 weight rows x 8 x rows, or with
   AVX-512's 32 registers 4 x 6 (5 or 6 rows) and 3 x 8 (more). Every pair's sum is made the same way:

       accumulate in input order, sum the lanes (vsum4, a fixed tree), then the inputs past the last
       whole vector one by one.

   The decoded numbers are the reference's (ggml_blocks.py, int4.py): d * q for Q8_0,
   (q - 8) * d for Q4_0, d * q + m for Q4_1 (two roundings: compiled with -ffp-contract=off),
   (q - zero) * scale for int4; int8 multiplies the row's dot product of q by its scale instead.
   With AVX-512 the 4-bit formats look their values up in a 16-entry table per block or group
   (vpermps), which costs two instructions per 16 weights instead of five; int4 takes the (low, high)
   nibbles of a 32-block as (even, odd) weights and multiplies them with a copy of x de-interleaved
   once per call, and builds its table once per group. With AVX2 (16 registers) the block formats are
   decoded a quarter block (8 weights) at a time for the tile's weight rows (`quarter`), int4 with the
   same de-interleaved x. Every row tile prefetches the weight rows two
   tiles ahead (the hardware prefetcher alone left a core at about half of its read bandwidth), short
   rows as one stream (`prefetch_tile`).

   llm_int8 / w8a8 layers (int8 weights times int8 activations, quantized per row) have their own
   kernel near the end of the file: exact int32 products with AVX512-VNNI; so do the _a8 methods
   (int4, Q8_0, Q4_0 weights times x in Q8_0 blocks, `cs336_a8`: exact block sums with AVX2), and
   llama.cpp's Q5_0, Q4_K and Q6_K (`cs336_kq`: x in Q8_0 / Q8_K blocks, integer sums per block on
   the packed bytes, equal bit for bit to quantization/k8.py). With CS336_KERNELS_AMX=1,
   int4 and int8 products go to amx.c's tile kernels instead (same numbers to fp32 rounding).

   The column-major fp32 kernel (W^T stored [I, O], how layers.Linear keeps its weight) adds
   x[m, i] * W^T[i, o0:o0+32] into 32-wide tiles of y in input order (one fma chain per output).

   Near the end: e^x on vectors (`vexp`, within 2 ulp) for step.c's softmax and SwiGLU (`cs336_exp`,
   `cs336_silu_mul`), which had called the C library's expf once per number.

   Compiled on first use by fast/cpu/build.py (gcc -O3 -march=native -fopenmp). The vectors are GCC
   vector types (16 lanes with AVX-512, 8 with AVX2, 4 otherwise), so one source serves every
   x86-64 CPU; the few intrinsics (conversions, fma, the lookup) have plain C versions.
*/
#include <math.h>
#include <omp.h>
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

/* ------------------------------------------------------------------ vectors

   GCC vector types: VL float lanes (16 with AVX-512, 8 with AVX2, 4 otherwise); the compiler lowers
   them to whatever the target has, so one source serves every CPU. Products use an explicit fused
   multiply-add (the file is compiled with -ffp-contract=off: nothing else is fused). */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VL 16
#elif defined(CS336_AVX2)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint8_t vu8 __attribute__((vector_size(VL)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* v, held in a register: an x vector is loaded once and used for every weight row of a tile (GCC
   otherwise folds the load into each multiply-add, one load per multiply-add) */
static inline vf xreg(vf v) {
#ifdef CS336_AVX2
    __asm__("" : "+v"(v));
#endif
    return v;
}
static inline vf vsplat(float a) {
#if VL == 16
    return (vf)_mm512_set1_ps(a);
#elif VL == 8
    return (vf)_mm256_set1_ps(a);
#else
    return (vf){a, a, a, a};
#endif
}

static inline vf vfma(vf a, vf b, vf c) {
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VL == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int k = 0; k < VL; k++) r[k] = fmaf(a[k], b[k], c[k]);
    return r;
#endif
}

/* out[j] = the lanes of a_j summed, for four vectors at once (a transpose of partial sums): every
   output is the same tree of its own vector's lanes, whatever the other three hold */
#ifdef CS336_AVX2
/* out[j] = the sum of the 8 lanes of aj: the AVX2 reduction, also for 8-wide sums on an AVX-512 build */
static inline void vsum4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float out[4]) {
    __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    __m256d d01 = _mm256_castps_pd(t01), d23 = _mm256_castps_pd(t23);
    __m256 u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(d01, d23)), _mm256_castpd_ps(_mm256_unpackhi_pd(d01, d23)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}
#endif

static inline void vsum4(vf a0, vf a1, vf a2, vf a3, float out[4]) {
#if VL == 16
    __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a0, (__m512)a1), _mm512_unpackhi_ps((__m512)a0, (__m512)a1));
    __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a2, (__m512)a3), _mm512_unpackhi_ps((__m512)a2, (__m512)a3));
    __m512d d01 = _mm512_castps_pd(t01), d23 = _mm512_castps_pd(t23);
    __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)), _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
    __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
#elif VL == 8
    vsum4_256((__m256)a0, (__m256)a1, (__m256)a2, (__m256)a3, out);
#else
    vf a[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4; j++) out[j] = (a[j][0] + a[j][2]) + (a[j][1] + a[j][3]);
#endif
}

/* ------------------------------------------------------------------ decode stored weights

   With the reference's numbers (ggml_blocks.py, int4.py): d * q for Q8_0, (q - 8) * d for Q4_0,
   d * q + m for Q4_1 (two roundings), (q - zero) * scale for int4; int8 gives q, and the row's dot
   product is multiplied by its scale afterwards (a per-row scale comes out of the sum). */

enum { FMT_F32 = 0, FMT_INT8 = 1, FMT_INT4 = 2, FMT_Q8_0 = 3, FMT_Q4_0 = 4, FMT_Q4_1 = 5 };

typedef struct {
    int fmt;
    const void *w;           /* the stored weight, row-major [O, row_bytes] */
    i64 row_bytes;           /* bytes per stored row */
    const float *scale_f32;  /* int8: [O] */
    const uint16_t *scale16; /* int4: fp16 [O, G] */
    const uint8_t *zero;     /* int4: [O, G] */
    i64 groups;              /* int4: G */
    int gshift;              /* int4: log2 of the group size when it is a power of two, else -1 */
} Weight;

/* VL bytes -> VL floats (unsigned or signed): intrinsics, as GCC 12 turns __builtin_convertvector of
   bytes into scalar code */
static inline vf bytes_to_vf(vu8 b) {
#if VL == 16
    __m128i v;
    memcpy(&v, &b, 16);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
#elif VL == 8
    __m128i v = _mm_loadl_epi64((const __m128i *)&b);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
#else
    vf r;
    for (int k = 0; k < VL; k++) r[k] = (float)b[k];
    return r;
#endif
}

static inline vf int8_to_vf(const int8_t *p) {
#if VL == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VL == 8
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf r;
    for (int k = 0; k < VL; k++) r[k] = (float)p[k];
    return r;
#endif
}

/* VL bytes of nibbles at p -> the low nibbles' and the high nibbles' values as floats */
static inline void nibbles(const uint8_t *p, vf *lo, vf *hi) {
#if VL == 8 /* GCC 12 shifts an 8-byte vector's bytes one by one in general registers (about 30 instructions) */
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(0x0f);
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, m)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
#else
    vu8 b;
    memcpy(&b, p, VL);
    *lo = bytes_to_vf(b & 0x0f);
    *hi = bytes_to_vf(b >> 4);
#endif
}

#if VL == 16
#define LO_MASK {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}
#define HI_MASK {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}
#elif VL == 8
#define LO_MASK {0, 8, 1, 9, 2, 10, 3, 11}
#define HI_MASK {4, 12, 5, 13, 6, 14, 7, 15}
#else
#define LO_MASK {0, 4, 1, 5}
#define HI_MASK {2, 6, 3, 7}
#endif

/* An int4 row whose groups are not a power-of-two multiple of 32 weights (`fused_ok` fails), into a
   float buffer: byte j of a group holds weights 2j (low nibble) and 2j + 1 (high). Every other
   format and group size is decoded in registers by `chunk` / `block` below. */
static void dequantize_int4_row(const Weight *W, i64 o, i64 I, float *out) {
    const uint8_t *row = (const uint8_t *)W->w + o * W->row_bytes;
    i64 gs = I / W->groups;
    for (i64 g = 0; g < W->groups; g++) {
        float s = half_to_float(W->scale16[o * W->groups + g]), z = (float)W->zero[o * W->groups + g];
        const uint8_t *p = row + g * gs / 2;
        float *dst = out + g * gs;
        vf vs = vsplat(s), vz = vsplat(z), lo, hi;
        i64 j = 0;
        for (; j + 2 * VL <= gs; j += 2 * VL) {
            nibbles(p + j / 2, &lo, &hi);
            lo = (lo - vz) * vs, hi = (hi - vz) * vs;
            vstore(dst + j, __builtin_shuffle(lo, hi, (vi)LO_MASK));
            vstore(dst + j + VL, __builtin_shuffle(lo, hi, (vi)HI_MASK));
        }
        for (; j < gs; j += 2) {
            uint8_t b = p[j / 2];
            dst[j] = ((float)(b & 0x0f) - z) * s;
            dst[j + 1] = ((float)(b >> 4) - z) * s;
        }
    }
}

/* Weights [i, i + VL) of an fp32 or int8 row, and weights [i, i + 32) of a block-format row as
   32 / VL vectors, decoded in registers: the reference's numbers (above). int4 here needs groups
   of 2^gshift weights, a multiple of 32 (`fused_ok`); other int4 rows go through the buffer. */
static inline __attribute__((always_inline)) vf chunk(int fmt, const uint8_t *row, i64 i) {
    return fmt == FMT_F32 ? vload((const float *)row + i) : int8_to_vf((const int8_t *)row + i);
}

static inline __attribute__((always_inline)) void block(const Weight *W, int fmt, const uint8_t *row, i64 o, i64 i,
                                                         vf w[32 / VL]) {
    if (fmt == FMT_Q8_0) {
        const uint8_t *p = row + i / 32 * 34;
        vf d = vsplat(half_to_float(read_u16(p)));
        for (int c = 0; c < 32 / VL; c++) w[c] = d * int8_to_vf((const int8_t *)p + 2 + c * VL);
    } else if (fmt == FMT_INT4) { /* 16 bytes: weights i, i + 1, ... as (low, high) nibble pairs */
        i64 g = o * W->groups + (i >> W->gshift);
        vf z = vsplat((float)W->zero[g]), sc = vsplat(half_to_float(W->scale16[g])), lo, hi;
        for (int c = 0; c < 32 / VL; c += 2) {
            nibbles(row + i / 2 + c * VL / 2, &lo, &hi);
            lo = (lo - z) * sc, hi = (hi - z) * sc;
            w[c] = __builtin_shuffle(lo, hi, (vi)LO_MASK);
            w[c + 1] = __builtin_shuffle(lo, hi, (vi)HI_MASK);
        }
    } else { /* Q4_0 / Q4_1: byte k of the block holds weights k (low nibble) and k + 16 (high) */
        int q41 = fmt == FMT_Q4_1;
        const uint8_t *p = row + i / 32 * (q41 ? 20 : 18);
        vf d = vsplat(half_to_float(read_u16(p))), m = vsplat(q41 ? half_to_float(read_u16(p + 2)) : 0.f);
        vf v8 = vsplat(8.f), lo, hi;
#if VL == 16
        /* a 16-entry table of the block's 16 values, looked up by nibble (vpermps reads the low 4 bits) */
        vf k = (vf)_mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
        vf lut = q41 ? d * k + m : (k - v8) * d;
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (q41 ? 4 : 2))));
        w[0] = (vf)_mm512_permutexvar_ps(idx, (__m512)lut);
        w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), (__m512)lut);
        return;
#endif
        for (int c = 0; c < 16 / VL; c++) {
            nibbles(p + (q41 ? 4 : 2) + c * VL, &lo, &hi);
            w[c] = q41 ? d * lo + m : (lo - v8) * d;
            w[16 / VL + c] = q41 ? d * hi + m : (hi - v8) * d;
        }
    }
}

#if VL == 8
/* AVX2: weights [i + 8c, i + 8c + 8) of a 32-block, c = 0..3, decoded a quarter at a time (whole blocks
   for 4 weight rows need 16 of the 16 registers). `block_head` reads a block's scale (d, and m for
   Q4_1) and the number to take from each nibble (8 for Q4_0, the zero point for int4), which
   `quarter` subtracts in bytes, so each value is the reference's: (q - 8) * d, (q - zero) * scale,
   q * d for Q8_0, and d * q + m for Q4_1 (d * q is exact, so one fma rounds as the reference's two
   steps do). For int4 the block's even weights are c = 0, 1 and its odd ones c = 2, 3, as its low
   and high nibbles lie (x comes in that order, `int4_x_order`). */
static inline vf half_splat(uint16_t h) { return (vf)_mm256_cvtph_ps(_mm_set1_epi16((short)h)); }

static inline __attribute__((always_inline)) const uint8_t *block_head(const Weight *W, int fmt, const uint8_t *row,
                                                                       i64 o, i64 i, vf *d, vf *m, __m128i *sub) {
    if (fmt == FMT_INT4) {
        i64 g = o * W->groups + (i >> W->gshift);
        *d = half_splat(W->scale16[g]), *sub = _mm_set1_epi8((char)W->zero[g]);
        return row + i / 2;
    }
    const uint8_t *p = row + i / 32 * (fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20);
    *d = half_splat(read_u16(p));
    if (fmt == FMT_Q4_1) *m = half_splat(read_u16(p + 2));
    *sub = _mm_set1_epi8(fmt == FMT_Q4_0 ? 8 : 0);
    return p + (fmt == FMT_Q4_1 ? 4 : 2);
}

/* the same four quarters for one row of x: the block's 16 bytes of nibbles read, masked and shifted once */
static inline __attribute__((always_inline)) void whole_block(int fmt, const uint8_t *p, vf d, vf m, __m128i sub,
                                                               vf w[4]) {
    if (fmt == FMT_Q8_0) {
        for (int c = 0; c < 4; c++) w[c] = d * int8_to_vf((const int8_t *)p + c * 8);
        return;
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f);
    __m128i h[2] = {_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask)};
    for (int k = 0; k < 2; k++) {
        if (fmt == FMT_Q4_1) {
            w[2 * k] = vfma(d, (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h[k])), m);
            w[2 * k + 1] = vfma(d, (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(h[k], h[k]))), m);
        } else {
            __m128i q = _mm_sub_epi8(h[k], sub);
            w[2 * k] = d * (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            w[2 * k + 1] = d * (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
        }
    }
}

static inline __attribute__((always_inline)) vf quarter(int fmt, const uint8_t *p, vf d, vf m, __m128i sub, int c) {
    if (fmt == FMT_Q8_0) return d * int8_to_vf((const int8_t *)p + c * 8);
    __m128i b = _mm_loadl_epi64((const __m128i *)(p + (c & 1) * 8));
    if (c >= 2) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    if (fmt == FMT_Q4_1) return vfma(d, (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), m);
    return d * (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(b, sub)));
}
#endif

/* the byte offset of weight i in a stored row of a block format (int4: two per byte) */
static inline i64 block_bytes(const Weight *W, int fmt, i64 i) {
    return fmt == FMT_INT4 ? i / 2 : i / 32 * (fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20);
}

/* Software prefetch of the weight rows PREFETCH_ROWS ahead (two tiles): the hardware prefetcher
   alone left a core at about half of its streaming bandwidth on these short rows (measured). */
#define PREFETCH_ROWS 8
/* Rows of at most ONE_STREAM bytes are prefetched as one stream: a tile's J rows lie back to back, so
   the tile two ahead is one range, fetched front to back, J * `bytes` of it per step of `bytes` per
   row. Measured on AMD EPYC against one stream per row (2 threads): int8 0.73-0.92x the time at 1 to
   9 rows, Q8_0 and Q4_0 0.89-0.95x at one row, fp32 0.83-0.90x at 3 and 5 rows and 0.71-0.74x at 17
   (d = 576); but fp32 rows of 3 KB or more took 1.09-1.19x at 17 rows, and int4 1.03-1.11x. */
#define ONE_STREAM 2304

static inline __attribute__((always_inline)) void prefetch_tile(const uint8_t *const row[4], int J, int one_stream,
                                                                 i64 ahead, i64 at, int bytes) {
    if (one_stream)
        for (int c = 0; c < J * bytes; c += 64) __builtin_prefetch(row[0] + ahead + at * J + c);
    else
        for (int j = 0; j < J; j++) __builtin_prefetch(row[j] + ahead + at);
}

static int fused_ok(const Weight *W, i64 I) {
    return W->fmt != FMT_INT4 || (W->gshift >= 5 && (I / W->groups) == ((i64)1 << W->gshift));
}

#if VL == 16
/* int4 with AVX-512: a 16-entry table of the group's 16 values (q - zero) * scale, made once per group
   and row, looked up by nibble (vpermps reads the low 4 bits of each index). The 16 low nibbles of
   a 32-block are weights i, i + 2, ..., i + 30 and the high ones i + 1, ..., i + 31; x comes
   de-interleaved to match (`int4_x_order`). */
static inline vf int4_lut(const Weight *W, i64 o, i64 i) {
    i64 g = o * W->groups + (i >> W->gshift);
    vf k = (vf)_mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    return (k - vsplat((float)W->zero[g])) * vsplat(half_to_float(W->scale16[g]));
}

static inline void int4_lookup(const uint8_t *row, i64 i, vf lut, vf w[2]) {
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i / 2)));
    w[0] = (vf)_mm512_permutexvar_ps(idx, (__m512)lut);
    w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), (__m512)lut);
}
#endif

/* ------------------------------------------------------------------ a tile: J weight rows x R rows

   s[r][j] = w_j . x[r] for R rows of x and the J weight rows oj[0..J-1] (J = 4 and R <= 4, or J = 2
   and R <= 8: 16 accumulators; with AVX-512 also J = 4 and R <= 6, J = 3 and R <= 8: 24; each weight
   vector decoded once per R rows): one vector
   accumulator per (row, weight row) pair, VL inputs at a time in input order, its lanes summed by vsum4, then
   the inputs past the last whole vector one by one (only fp32 and int8 rows have those). The
   operations of a pair are the same whatever R is and whichever tile it is in, so a row's result
   does not depend on the rows beside it. */

static inline __attribute__((always_inline)) void tile(const Weight *W, int fmt, const i64 oj[4], const float *x,
                                                        i64 ldx, int J, int R, i64 I, float s[][4]) {
    const uint8_t *row[4];
    for (int j = 0; j < J; j++) row[j] = (const uint8_t *)W->w + oj[j] * W->row_bytes;
    vf a[8][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) a[r][j] = (vf){0};
    const i64 ahead = PREFETCH_ROWS * W->row_bytes; /* the tile after next: rows are read in order */
    const int one_stream = fmt != FMT_INT4 && W->row_bytes <= ONE_STREAM;
    i64 i = 0;
    if (fmt == FMT_F32 && R <= 2) {
        /* one or two x rows: the J weight rows one after another, each read front to back (the same
           operations per pair as below). Four rows read side by side left each core at about two
           thirds of its read bandwidth: 0.64-0.89x the time at one row, 0.72-0.94x at two (AMD EPYC;
           slower from three rows, where the multiply-adds and not the reads set the pace) */
        for (int j = 0; j < J; j++) {
            vf acc[2] = {{0}, {0}};
            for (i = 0; i + VL <= I; i += VL) {
                __builtin_prefetch(row[j] + i * 4 + ahead);
                vf w = vload((const float *)row[j] + i);
                for (int r = 0; r < R; r++) acc[r] = vfma(w, vload(x + r * ldx + i), acc[r]);
            }
            for (int r = 0; r < R; r++) a[r][j] = acc[r];
        }
    } else if (fmt == FMT_F32 || fmt == FMT_INT8) {
        for (; i + VL <= I; i += VL) {
            vf w[4];
            const int es = fmt == FMT_F32 ? 4 : 1; /* bytes per weight */
            prefetch_tile(row, J, one_stream, ahead, i * es, VL * es);
            for (int j = 0; j < J; j++) w[j] = chunk(fmt, row[j], i);
            for (int r = 0; r < R; r++) {
                vf xv = xreg(vload(x + r * ldx + i));
                for (int j = 0; j < J; j++) a[r][j] = vfma(w[j], xv, a[r][j]);
            }
        }
#if VL == 16
    } else if (fmt == FMT_INT4) { /* a group at a time: its 4 tables, then its 32-blocks */
        for (i64 g0 = 0; g0 < I; g0 += (i64)1 << W->gshift) {
            vf lut[4];
            for (int j = 0; j < J; j++) lut[j] = int4_lut(W, oj[j], g0);
            for (; i < g0 + ((i64)1 << W->gshift); i += 32) {
                vf w[4][2];
                prefetch_tile(row, J, 0, ahead, i / 2, 16);
                for (int j = 0; j < J; j++) int4_lookup(row[j], i, lut[j], w[j]);
                for (int c = 0; c < 2; c++)
                    for (int r = 0; r < R; r++) {
                        vf xv = xreg(vload(x + r * ldx + i + c * VL));
                        for (int j = 0; j < J; j++) a[r][j] = vfma(w[j][c], xv, a[r][j]);
                    }
            }
        }
#endif
#if VL == 8
    } else { /* AVX2 (16 registers): each quarter of a 32-block decoded for the J weight rows, then
                multiplied into the R rows; decoding whole blocks first spilled them to the stack */
        for (; i + 32 <= I; i += 32) {
            prefetch_tile(row, J, one_stream, ahead, block_bytes(W, fmt, i), (int)block_bytes(W, fmt, 32));
            const uint8_t *p[4];
            vf d[4], m[4];
            __m128i sub[4];
            if (R == 1) { /* one row: the weight rows' whole blocks one after another against x's 4 quarters */
                vf xv[4], w[4];
                for (int c = 0; c < 4; c++) xv[c] = xreg(vload(x + i + c * VL));
                for (int j = 0; j < J; j++) {
                    p[j] = block_head(W, fmt, row[j], oj[j], i, &d[j], &m[j], &sub[j]);
                    whole_block(fmt, p[j], d[j], m[j], sub[j], w);
                    for (int c = 0; c < 4; c++) a[0][j] = vfma(w[c], xv[c], a[0][j]);
                }
                continue;
            }
            for (int j = 0; j < J; j++) p[j] = block_head(W, fmt, row[j], oj[j], i, &d[j], &m[j], &sub[j]);
            for (int c = 0; c < 4; c++) {
                vf w[4];
                for (int j = 0; j < J; j++) w[j] = quarter(fmt, p[j], d[j], m[j], sub[j], c);
                for (int r = 0; r < R; r++) {
                    vf xv = xreg(vload(x + r * ldx + i + c * VL));
                    for (int j = 0; j < J; j++) a[r][j] = vfma(w[j], xv, a[r][j]);
                }
            }
        }
    }
#else
    } else { /* block formats: 32 weights at a time (I is a multiple of 32), the same order */
        for (; i + 32 <= I; i += 32) {
            vf w[4][32 / VL];
            prefetch_tile(row, J, one_stream, ahead, block_bytes(W, fmt, i), (int)block_bytes(W, fmt, 32));
            for (int j = 0; j < J; j++) block(W, fmt, row[j], oj[j], i, w[j]);
            for (int c = 0; c < 32 / VL; c++)
                for (int r = 0; r < R; r++) {
                    vf xv = xreg(vload(x + r * ldx + i + c * VL));
                    for (int j = 0; j < J; j++) a[r][j] = vfma(w[j][c], xv, a[r][j]);
                }
        }
    }
#endif
    for (int r = 0; r < R; r++) {
        float t[4];
        vsum4(a[r][0], a[r][1], a[r][2], a[r][3], t); /* J = 2: lanes 2, 3 hold zeros, unused */
        for (int j = 0; j < J; j++) {
            for (i64 k = i; k < I; k++) {
                float wk = fmt == FMT_F32 ? ((const float *)row[j])[k] : (float)((const int8_t *)row[j])[k];
                t[j] = fmaf(wk, x[r * ldx + k], t[j]);
            }
            s[r][j] = t[j];
        }
    }
}

#define MAX_M 32
/* one specialized copy of `tile` per format, tile width JJ and number of rows (J = 4 runs at most 6 rows) */
#define TILE_J(F, JJ)                                                                                        \
    switch (R) {                                                                                             \
    case 1: tile(W, F, oj, xm, ldx, JJ, 1, I, s); break;                                                     \
    case 2: tile(W, F, oj, xm, ldx, JJ, 2, I, s); break;                                                     \
    case 3: tile(W, F, oj, xm, ldx, JJ, 3, I, s); break;                                                     \
    case 4: tile(W, F, oj, xm, ldx, JJ, 4, I, s); break;                                                     \
    case 5: tile(W, F, oj, xm, ldx, JJ, 5, I, s); break;                                                     \
    case 6: tile(W, F, oj, xm, ldx, JJ, 6, I, s); break;                                                     \
    case 7: tile(W, F, oj, xm, ldx, JJ, 7, I, s); break;                                                     \
    default: tile(W, F, oj, xm, ldx, JJ, 8, I, s); break;                                                    \
    }
#define TILE_R(F)                                                                                            \
    if (J == 4) {                                                                                            \
        TILE_J(F, 4)                                                                                         \
    } else if (J == 3) {                                                                                     \
        TILE_J(F, 3)                                                                                         \
    } else {                                                                                                 \
        TILE_J(F, 2)                                                                                         \
    }

static void tile_any(const Weight *W, const i64 oj[4], const float *xm, i64 ldx, int J, int R, i64 I,
                     float s[][4]) {
    switch (W->fmt) {
    case FMT_F32: TILE_R(FMT_F32); break;
    case FMT_INT8: TILE_R(FMT_INT8); break;
    case FMT_INT4: TILE_R(FMT_INT4); break;
    case FMT_Q8_0: TILE_R(FMT_Q8_0); break;
    case FMT_Q4_0: TILE_R(FMT_Q4_0); break;
    default: TILE_R(FMT_Q4_1); break;
    }
}

/* With AVX-512 and AVX2, int4 rows are decoded as (even weights, odd weights) of each 32-block
   (`int4_lookup`, `quarter`), so x is copied in that order once per call:
   x'[32b + k] = x[32b + 2k], x'[32b + 16 + k] = x[32b + 2k + 1] */
static int int4_x_order(const Weight *W, i64 I) { return VL >= 8 && W->fmt == FMT_INT4 && fused_ok(W, I); }

static float *deinterleave_x(const float *x, i64 M, i64 I, i64 ldx) {
    float *xp = (float *)malloc(sizeof(float) * (size_t)(M * I));
    for (i64 m = 0; m < M; m++)
        for (i64 b = 0; b < I; b += 32)
            for (int k = 0; k < 16; k++) {
                xp[m * I + b + k] = x[m * ldx + b + 2 * k];
                xp[m * I + b + 16 + k] = x[m * ldx + b + 2 * k + 1];
            }
    return xp;
}

/* y[m, o] = (x[m] . W[o]) (* scale[o] for int8) (+ bias[o]) for the row-major formats: OpenMP over
   tiles of TW output rows, every group of up to RG x rows against a tile's weights decoded in
   registers: TW = RG = 4 for up to 4 rows, TW = 2 and RG = 8 for more, so a weight vector is decoded
   once per 8 rows rather than per 4 (5 rows: once instead of twice; measured faster than decoding a
   tile once into an L1 buffer and reloading it per group). With AVX-512 (32 registers), 5 or 6 rows
   keep TW = 4 with RG = 6 and more rows take TW = 3, RG = 8 (24 accumulators either way): all SmolLM2
   products took 0.90-0.94x the time of TW = 2 at 5 to 7 rows in fp32 and int4, 0.91x (fp32) at 8
   and 0.95x at 9 and 16 (Intel Xeon, interleaved A/B runs). The rows are spread evenly over the
   groups (17 rows as 6 + 6 + 5: a group of one row runs at a fraction of the fma rate; 0.91-0.96x the
   time at 17 rows and 0.82-0.90x at 12, fp32, AMD EPYC). int4 with groups that are not whole
   vectors is dequantized once into an L1 buffer instead, which then serves as an fp32 tile.
   With several groups whose x rows together outgrow L1 while one group's fit (OUTER_X_BYTES), each
   thread takes its share of the tiles (as schedule(static) would) in chunks of OUTER_CHUNK_BYTES of
   weights, and runs the groups one after another over a chunk: the first group reads the chunk from
   memory, the others from L2, and each group's x stays in L1. Against one pass per group over the
   whole weight (weights up to 16 MB, read again from L3) and all groups per tile otherwise
   (`benchmark.py kernels --base REV --formats fp32,q4_1,int8 --rows 1,8,16,32 --rounds 7`), all 121
   products of a SmolLM2 step took 0.92x the time at 16 rows and 0.85x at 32 in fp32, 0.91x and 0.88x
   in q4_1, 0.96x and 0.80x in int8, with the same bits (AMD EPYC Zen 5, 2 threads, 2026-11-26);
   128 and 512 KB chunks did no better than 256 in a 16-request engine step. Not for down (1536
   inputs: one group's x does not fit L1; smaller groups that fit were slower). A pair's operations
   are the same either way. */
/* y[m0 + r, o + j] = s[r][j] (* scale[o + j] for int8) (+ bias[o + j]) for a tile's J outputs and R rows */
static inline void store_tile(const Weight *W, const float *bias, float s[][4], i64 o, int J, i64 m0, i64 R, i64 O,
                              float *y) {
    for (int j = 0; j < J; j++) {
        float scale = W->fmt == FMT_INT8 ? W->scale_f32[o + j] : 1.f, b = bias ? bias[o + j] : 0.f;
        for (i64 r = 0; r < R; r++) {
            float v = W->fmt == FMT_INT8 ? s[r][j] * scale : s[r][j];
            y[(m0 + r) * O + o + j] = bias ? v + b : v;
        }
    }
}

enum { OUTER_X_BYTES = 32 << 10 };
#define OUTER_CHUNK_BYTES ((i64)256 << 10)
static void rowmajor_mm(const Weight *W, const float *x, i64 M, i64 I, i64 ldx, i64 O, const float *bias,
                        float *y, int threads) {
#if VL == 16 /* 32 vector registers: 4 weight rows against up to 6 x rows (24 accumulators) */
    const int TW = M > 6 ? 3 : 4;
    int RG = M > 6 ? 8 : M > 4 ? 6 : 4;
#else
    const int TW = M > 4 ? 2 : 4;
    int RG = M > 4 ? 8 : 4;
#endif
    const i64 groups = (M + RG - 1) / RG;
    RG = (int)((M + groups - 1) / groups); /* the rows spread evenly: 17 = 6 + 6 + 5, not 8 + 8 + 1 */
    i64 tiles = (O + TW - 1) / TW;
    int fused = fused_ok(W, I);
    float *xp = int4_x_order(W, I) ? deinterleave_x(x, M, I, ldx) : NULL;
    if (xp) x = xp, ldx = I;
    if (groups > 1 && fused && RG * I * 4 <= OUTER_X_BYTES) {
        /* the row groups one after another over a chunk of tiles, chunk after chunk (comment above) */
        const i64 chunk = OUTER_CHUNK_BYTES / (TW * W->row_bytes) > 0 ? OUTER_CHUNK_BYTES / (TW * W->row_bytes) : 1;
#pragma omp parallel num_threads(threads)
        {
            float s[MAX_M][4];
            int t = omp_get_thread_num(), n = omp_get_num_threads();
            i64 lo = tiles * t / n, hi = tiles * (t + 1) / n; /* each thread's tiles, as schedule(static) */
            for (i64 c0 = lo; c0 < hi; c0 += chunk) {
                i64 c1 = c0 + chunk < hi ? c0 + chunk : hi;
                for (i64 m = 0; m < M; m += RG) {
                    int R = M - m < RG ? (int)(M - m) : RG;
                    for (i64 tt = c0; tt < c1; tt++) {
                        i64 o = TW * tt, oj[4];
                        int J = O - o < TW ? (int)(O - o) : TW;
                        for (int j = 0; j < 4; j++) oj[j] = o + (j < J ? j : 0); /* as below */
                        tile_any(W, oj, x + m * ldx, ldx, TW, R, I, s);
                        store_tile(W, bias, s, o, J, m, R, O, y);
                    }
                }
            }
        }
        free(xp);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = fused ? NULL : (float *)malloc(sizeof(float) * (size_t)(4 * I + VL));
        float s[MAX_M][4];
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++) {
            i64 o = TW * t, oj[4];
            int J = O - o < TW ? (int)(O - o) : TW;
            for (int j = 0; j < 4; j++) oj[j] = o + (j < J ? j : 0); /* a short last tile repeats a row */
            Weight B = {FMT_F32, buf, I * 4, NULL, NULL, NULL, 0, -1};
            const Weight *T = W;
            if (!fused) {
                for (int j = 0; j < J; j++) dequantize_int4_row(W, o + j, I, buf + j * I);
                for (int j = 0; j < 4; j++) oj[j] = j < J ? j : 0;
                T = &B;
            }
            for (i64 m = 0; m < M; m += RG) tile_any(T, oj, x + m * ldx, ldx, TW, M - m < RG ? (int)(M - m) : RG, I, s + m);
            store_tile(W, bias, s, o, J, 0, M, O, y);
        }
        free(buf);
    }
    free(xp);
}

/* ------------------------------------------------------------------ entry points (ctypes) */

void cs336_f32_rows(const float *x, i64 M, i64 I, i64 ldx, const float *w, i64 O, const float *bias, float *y,
                    int threads) {
    Weight W = {FMT_F32, w, I * 4, NULL, NULL, NULL, 0, -1};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

int cs336_amx_int8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                   const float *bias, float *y, int threads); /* amx.c */

void cs336_int8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                const float *bias, float *y, int threads) {
    if (cs336_amx_int8(x, M, I, ldx, q, scale, O, bias, y, threads)) return; /* CS336_KERNELS_AMX=1 */
    Weight W = {FMT_INT8, q, I, scale, NULL, NULL, 0, -1};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

int cs336_amx_int4(const float *x, i64 M, i64 I, i64 ldx, const uint8_t *packed, const uint16_t *scale,
                   const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads); /* amx.c */

void cs336_int4(const float *x, i64 M, i64 I, i64 ldx, const uint8_t *packed, const uint16_t *scale,
                const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads) {
    if (cs336_amx_int4(x, M, I, ldx, packed, scale, zero, G, O, bias, y, threads)) return; /* CS336_KERNELS_AMX=1 */
    int gshift = -1;
    for (int k = 0; k < 31; k++)
        if (I / G == (i64)1 << k) gshift = k;
    Weight W = {FMT_INT4, packed, I / 2, NULL, scale, zero, G, gshift};
    rowmajor_mm(&W, x, M, I, ldx, O, bias, y, threads);
}

void cs336_ggml(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *raw, i64 O, const float *bias,
                float *y, int threads) {
    i64 bytes = fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20;
    Weight W = {fmt, raw, I / 32 * bytes, NULL, NULL, NULL, 0, -1};
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
        float acc[MAX_M][TILE];
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

/* ------------------------------------------------------------------ fp32 panels

   W stored as panels of PW = 16 output rows, each input-major: wp[p][i][k] = W[16 p + k, i]
   (ops.pack_panels; the last panel padded with zero rows). One step of i loads a panel's 16 weights
   as vectors and multiplies them by x[m, i] broadcast: the lanes are outputs, so nothing is summed
   across lanes at the end, each output is one fma chain in input order,

       y[m, o] = fma(W[o, I-1], x[m, I-1], ... fma(W[o, 0], x[m, 0], 0)) (+ b[o]),

   whatever the number of rows, the tile's shape, the vector width or the threads; and a tile of TP
   panels is TP sequential streams of the weight. Tiles of TP panels x R rows of x, with AVX-512
   (32 registers): 4 x 1 for one row, 4 x 4, 4 x 6, 3 x 8 (24 accumulators), 2 x 16 for 9 to 24 rows
   (up to 32 accumulators; faster than 3 x 8 groups there, slower past 24), then 3 x 8 again; AVX2
   (16): 1 x 6 (2 vectors a panel). A verify pass of 9 to 16 rows so runs each tile once. Several
   row groups run one after another over a tile, whose weights are then read from L2; so that
   memory does not sit idle meanwhile, each group also prefetches its share of the next tile's
   weights (nx, step bytes per input), spread evenly over the groups. The native steps (step.c,
   format 7) and OutputHead run their fp32 products this way; the layout is a second copy of the
   weight (fast/cpu/ops.panels). */

#define PW 16
#define NV (PW / VL) /* vectors per panel */
#define PANEL_AHEAD 512 /* floats ahead in each panel's stream (2 KB) */
#define DEF_PANEL_TILE(TP, R)                                                                                \
    static void panel_tile_##TP##_##R(const float *wp, i64 I, const float *x, i64 ldx, float *s, const char *nx,  \
                                      i64 step) {                                                            \
        vf a[R][TP * NV];                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int v = 0; v < TP * NV; v++) a[r][v] = (vf){0};                                             \
        for (i64 i = 0; i < I; i++) {                                                                        \
            vf w[TP * NV];                                                                                   \
            if (step) { /* the next tile, into L2 (gcc takes the test out of the loop) */                    \
                __builtin_prefetch(nx + i * step, 0, 1);                                                     \
                __builtin_prefetch(nx + i * step + 64, 0, 1);                                                \
            }                                                                                                \
            for (int t = 0; t < TP; t++) {                                                                   \
                const float *pt = wp + t * I * PW + i * PW;                                                  \
                __builtin_prefetch(pt + PANEL_AHEAD);                                                        \
                for (int v = 0; v < NV; v++) w[t * NV + v] = vload(pt + v * VL);                             \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                vf xb = vsplat(x[r * ldx + i]);                                                              \
                for (int v = 0; v < TP * NV; v++) a[r][v] = vfma(w[v], xb, a[r][v]);                         \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int v = 0; v < TP * NV; v++) vstore(s + (r * TP * NV + v) * VL, a[r][v]);                   \
    }
typedef void (*panel_fn)(const float *, i64, const float *, i64, float *, const char *, i64);
#if VL == 16
enum { PANEL_TP_MAX = 4, PANEL_R_MAX = 16 };
DEF_PANEL_TILE(4, 1) DEF_PANEL_TILE(4, 2) DEF_PANEL_TILE(4, 3) DEF_PANEL_TILE(4, 4) DEF_PANEL_TILE(4, 5)
DEF_PANEL_TILE(4, 6) DEF_PANEL_TILE(3, 1) DEF_PANEL_TILE(3, 2) DEF_PANEL_TILE(3, 3) DEF_PANEL_TILE(3, 4)
DEF_PANEL_TILE(3, 5) DEF_PANEL_TILE(3, 6) DEF_PANEL_TILE(3, 7) DEF_PANEL_TILE(3, 8) DEF_PANEL_TILE(2, 1)
DEF_PANEL_TILE(2, 2) DEF_PANEL_TILE(2, 3) DEF_PANEL_TILE(2, 4) DEF_PANEL_TILE(2, 5) DEF_PANEL_TILE(2, 6)
DEF_PANEL_TILE(2, 7) DEF_PANEL_TILE(2, 8) DEF_PANEL_TILE(2, 9) DEF_PANEL_TILE(2, 10) DEF_PANEL_TILE(2, 11)
DEF_PANEL_TILE(2, 12) DEF_PANEL_TILE(2, 13) DEF_PANEL_TILE(2, 14) DEF_PANEL_TILE(2, 15)
DEF_PANEL_TILE(2, 16) DEF_PANEL_TILE(1, 1) DEF_PANEL_TILE(1, 2) DEF_PANEL_TILE(1, 3) DEF_PANEL_TILE(1, 4)
DEF_PANEL_TILE(1, 5) DEF_PANEL_TILE(1, 6) DEF_PANEL_TILE(1, 7) DEF_PANEL_TILE(1, 8) DEF_PANEL_TILE(1, 9)
DEF_PANEL_TILE(1, 10) DEF_PANEL_TILE(1, 11) DEF_PANEL_TILE(1, 12) DEF_PANEL_TILE(1, 13)
DEF_PANEL_TILE(1, 14) DEF_PANEL_TILE(1, 15) DEF_PANEL_TILE(1, 16)
#define P1(R) panel_tile_1_##R
#define P2(R) panel_tile_2_##R
/* [TP][R]: a short last tile (fewer panels) keeps the group's R */
static const panel_fn PANEL_TILES[5][17] = {
    {0},
    {0, P1(1), P1(2), P1(3), P1(4), P1(5), P1(6), P1(7), P1(8), P1(9), P1(10), P1(11), P1(12), P1(13), P1(14),
     P1(15), P1(16)},
    {0, P2(1), P2(2), P2(3), P2(4), P2(5), P2(6), P2(7), P2(8), P2(9), P2(10), P2(11), P2(12), P2(13), P2(14),
     P2(15), P2(16)},
    {0, panel_tile_3_1, panel_tile_3_2, panel_tile_3_3, panel_tile_3_4, panel_tile_3_5, panel_tile_3_6, panel_tile_3_7, panel_tile_3_8},
    {0, panel_tile_4_1, panel_tile_4_2, panel_tile_4_3, panel_tile_4_4, panel_tile_4_5, panel_tile_4_6}};
static void panel_shape(i64 M, int *TP, int *RG) {
    if (M <= 6) *TP = 4, *RG = M > 4 ? 6 : 4;
    else if (M <= 8 || M > 24) *TP = 3, *RG = 8;
    else *TP = 2, *RG = 16; /* 9 to 24 rows: one group, or two even ones */
}
#else /* AVX2 (16 registers) and narrower: one panel against up to 6 rows */
enum { PANEL_TP_MAX = 1, PANEL_R_MAX = 6 };
DEF_PANEL_TILE(1, 1) DEF_PANEL_TILE(1, 2) DEF_PANEL_TILE(1, 3) DEF_PANEL_TILE(1, 4) DEF_PANEL_TILE(1, 5)
DEF_PANEL_TILE(1, 6)
static const panel_fn PANEL_TILES[2][17] = {
    {0}, {0, panel_tile_1_1, panel_tile_1_2, panel_tile_1_3, panel_tile_1_4, panel_tile_1_5, panel_tile_1_6}};
static void panel_shape(i64 M, int *TP, int *RG) {
    *TP = 1;
    *RG = VL == 8 ? 6 : 3;
}
#endif

/* y [M, O] = x W^T (+ b), W as panels (above); any M >= 1 */
void cs336_f32_panels(const float *x, i64 M, i64 I, i64 ldx, const float *wp, i64 O, const float *bias, float *y,
                      int threads) {
    int TP, RG;
    panel_shape(M, &TP, &RG);
    const i64 groups = (M + RG - 1) / RG;
    RG = (int)((M + groups - 1) / groups); /* the rows spread evenly over the groups, as rowmajor_mm */
    const i64 panels = (O + PW - 1) / PW, tiles = (panels + TP - 1) / TP;
#pragma omp parallel num_threads(threads)
    {
        float s[PANEL_R_MAX * PANEL_TP_MAX * PW];
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++) {
            i64 p0 = t * TP;
            int tp = panels - p0 < TP ? (int)(panels - p0) : TP;
            i64 o0 = p0 * PW, n = O - o0 < tp * PW ? O - o0 : tp * PW; /* the tile's real outputs */
            /* with several groups, each prefetches 1 / groups of the next tile (its panels of I lines) */
            const i64 np = panels - p0 - tp < TP ? panels - p0 - tp : TP;
            const char *nx = (const char *)(wp + (p0 + tp) * I * PW);
            const i64 step = groups > 1 && np > 0 ? np * PW * 4 / groups : 0;
            for (i64 m = 0, g = 0; m < M; m += RG, g++) {
                int R = M - m < RG ? (int)(M - m) : RG;
                PANEL_TILES[tp][R](wp + p0 * I * PW, I, x + m * ldx, ldx, s, step ? nx + g * I * step : 0, step);
                for (int r = 0; r < R; r++) {
                    float *yr = y + (m + r) * O + o0;
                    const float *sr = s + r * tp * PW;
                    for (i64 k = 0; k < n; k++) yr[k] = bias ? sr[k] + bias[o0 + k] : sr[k];
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ int8 x int8 (w8a8, LLM.int8())

   y[m, o] = ((float)acc[m, o] * s_x[m]) * s_w[o] (+ b[o]), acc = sum_i qx[m, i] * q[o, i] in int32:
   int8_matmul of quantization/llm_int8.py, the same operations, so the same bits. Each x row is
   quantized first with its own absmax scale (s_x = amax / 127, qx = round-half-even(x / s_x)).

   With AVX512-VNNI one vpdpbusd multiplies 64 byte pairs and adds them into 16 int32 lanes, four
   products per lane: 2 instructions per 64 weights (an xor and the product) where the float kernels
   above spend 12 (widen, convert, fma per 16). vpdpbusd wants one operand unsigned: the weight
   bytes are flipped to q + 128 (xor 0x80) and 128 * sum_i qx[m, i] is subtracted at the end. The
   integer sum is exact, so the order of the lanes does not matter. */

static void quantize_rows_q8(const float *x, i64 M, i64 I, i64 ldx, i64 ld, int8_t *qx, float *sx, int32_t *sumq) {
    for (i64 m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        int8_t *qm = qx + m * ld;
        float amax = 0.f;
        i64 i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 vmax = _mm512_setzero_ps();
        for (; i + 16 <= I; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xm + i)));
        amax = _mm512_reduce_max_ps(vmax);
#endif
        for (; i < I; i++) amax = fmaxf(amax, fabsf(xm[i]));
        float s = amax / 127.f, safe = s == 0.f ? 1.f : s;
        int32_t total = 0;
        i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* the same operations as below, 16 at a time: divide, round half to even, clamp */
        __m512i vsum = _mm512_setzero_si512();
        const __m512 vs = _mm512_set1_ps(safe), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        for (; i + 16 <= I; i += 16) {
            __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xm + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            vsum = _mm512_add_epi32(vsum, v);
            _mm_storeu_si128((__m128i *)(qm + i), _mm512_cvtepi32_epi8(v));
        }
        total = _mm512_reduce_add_epi32(vsum);
#endif
        for (; i < I; i++) {
            float r = nearbyintf(xm[i] / safe);
            int v = (int)fminf(fmaxf(r, -127.f), 127.f);
            qm[i] = (int8_t)v;
            total += v;
        }
        for (i = I; i < ld; i++) qm[i] = 0;
        sx[m] = s, sumq[m] = total;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* out[j] = the int32 lanes of a_j summed, four vectors at once (vsum4's transpose, in integers) */
static inline void isum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3, int32_t out[4]) {
    __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    _mm_storeu_si128((__m128i *)out, _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#endif

void cs336_w8a8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                const float *bias, float *y, int threads) {
    i64 ld = (I + 63) / 64 * 64;
    int8_t *qx = (int8_t *)aligned_alloc(64, (size_t)(M * ld));
    float sx[MAX_M];
    int32_t sumq[MAX_M];
    quantize_rows_q8(x, M, I, ldx, ld, qx, sx, sumq);
    i64 tiles = (O + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (i64 t = 0; t < tiles; t++) {
        i64 o = 4 * t;
        int J = O - o < 4 ? (int)(O - o) : 4;
        int32_t acc[MAX_M][4];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        const int8_t *row[4];
        for (int j = 0; j < 4; j++) row[j] = q + (o + (j < J ? j : 0)) * I;
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (i64 m0 = 0; m0 < M; m0 += 4) {
            int R = M - m0 < 4 ? (int)(M - m0) : 4;
            __m512i a[4][4];
            for (int r = 0; r < 4; r++)
                for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_si512();
            for (i64 i = 0; i < I; i += 64) {
                __mmask64 k = I - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (I - i)) - 1);
                __m512i w[4];
                for (int j = 0; j < 4; j++) {
                    __builtin_prefetch(row[j] + i + PREFETCH_ROWS * I);
                    w[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(k, row[j] + i), flip);
                }
                for (int r = 0; r < R; r++) { /* padding: qx is 0 there, so the flipped 128s add nothing */
                    __m512i xv = _mm512_load_si512((const void *)(qx + (m0 + r) * ld + i));
                    for (int j = 0; j < 4; j++) a[r][j] = _mm512_dpbusd_epi32(a[r][j], w[j], xv);
                }
            }
            for (int r = 0; r < R; r++) {
                isum4(a[r][0], a[r][1], a[r][2], a[r][3], acc[m0 + r]);
                for (int j = 0; j < 4; j++) acc[m0 + r][j] -= 128 * sumq[m0 + r];
            }
        }
#else
        for (i64 m = 0; m < M; m++)
            for (int j = 0; j < J; j++) {
                const int8_t *w = q + (o + j) * I, *xq = qx + m * ld;
                int32_t s = 0;
                for (i64 i = 0; i < I; i++) s += (int32_t)w[i] * (int32_t)xq[i];
                acc[m][j] = s;
            }
#endif
        for (int j = 0; j < J; j++)
            for (i64 m = 0; m < M; m++) {
                float v = (float)acc[m][j] * sx[m] * scale[o + j];
                y[m * O + o + j] = bias ? v + bias[o + j] : v;
            }
    }
    free(qx);
}

/* ------------------------------------------------------------------ 4- and 8-bit blocks x Q8_0 activations

   The "_a8" methods (quantization/a8.py, llama.cpp's arithmetic for Q4_0 and Q8_0): each x row is
   quantized in blocks of 32 like a Q8_0 weight (d_x = amax / 127, qx = round(x / d_x) half away from 0,
   computed as x * (1 / d_x)), and a block's product is exact in integers:

       y[m, o] = sum over blocks b of (d_w[o, b] d_x[m, b]) * (sum_k qw[o, b, k] qx[m, b, k])

   qw: q - 8 (Q4_0), q (Q8_0), q - zero with the group's scale as d_w (int4, whose x is quantized in
   the de-interleaved order of `int4_x_order`, a permutation inside each 32-block). With AVX2 a
   block of one weight row against one x row is: the weight bytes' signs moved onto x (vpsignb:
   vpmaddubsw wants one operand unsigned; weights lie in [-127, 127], as ggml's Q8_0 makes them),
   the 32 byte products added in pairs into 16-bit numbers (at most 2 * 127 * 127, exact), those in
   pairs into 8 32-bit lanes, converted, and one multiply-add by d_w d_x: 7 instructions per 32
   weights and x row, where the float kernels above spend 12 to 16. A pair's operations do not
   depend on the rows beside it. */

/* block b of weight row o: its scale (d_w), the number its nibbles hold in excess (8, the zero point,
   0 for Q8_0) and where its 16 or 32 bytes of integers start */
static inline __attribute__((always_inline)) const uint8_t *a8_head(const Weight *W, int fmt, i64 o, i64 b,
                                                                    float *d, int *sub) {
    const uint8_t *row = (const uint8_t *)W->w + o * W->row_bytes;
    if (fmt == FMT_INT4) {
        i64 g = o * W->groups + b / (W->row_bytes / 16 / W->groups); /* 16 bytes a block */
        *d = half_to_float(W->scale16[g]), *sub = W->zero[g];
        return row + b * 16;
    }
    const uint8_t *p = row + block_bytes(W, fmt, 32 * b);
    *d = half_to_float(read_u16(p)), *sub = fmt == FMT_Q4_0 ? 8 : 0;
    return p + 2;
}

/* x's M rows as Q8_0 blocks: qx [M, I] (int4: each block de-interleaved), dx [M, I / 32] */
static void a8_quantize_x(const float *x, i64 M, i64 I, i64 ldx, int deinterleave, int8_t *qx, float *dx) {
    for (i64 m = 0; m < M; m++)
        for (i64 b = 0; b < I / 32; b++) {
            const float *xb = x + m * ldx + 32 * b;
            float amax = 0.f, v[32];
            for (int k = 0; k < 32; k++) amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
            float d = amax / 127.f, inv = d == 0.f ? 0.f : 1.f / d;
            for (int k = 0; k < 32; k++) { /* roundf (half away from zero, as ggml) in steps GCC vectorizes */
                float t = xb[k] * inv, a = fabsf(t), whole = floorf(a);
                v[k] = copysignf(whole + floorf(2.f * (a - whole)), t);
            }
            int8_t *q = qx + m * I + 32 * b;
            for (int k = 0; k < 32; k++) q[k] = (int8_t)(deinterleave ? v[k < 16 ? 2 * k : 2 * (k - 16) + 1] : v[k]);
            dx[m * (I / 32) + b] = d;
        }
}

#ifdef CS336_AVX2
/* the block's 32 integers as signed bytes, in its weights' order (Q4_0: low nibbles then high) */
static inline __m256i a8_weights(int fmt, const uint8_t *p, int sub) {
    if (fmt == FMT_Q8_0) return _mm256_loadu_si256((const __m256i *)p);
    const __m128i n = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f), s = _mm_set1_epi8((char)sub);
    return _mm256_set_m128i(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(n, 4), mask), s),
                            _mm_sub_epi8(_mm_and_si128(n, mask), s));
}
#endif

/* s[r][j] = y[r, oj[j]] without bias, for R <= 2 rows of x (qx, dx point at the first) */
static inline __attribute__((always_inline)) void a8_tile(const Weight *W, int fmt, const i64 oj[4],
                                                           const int8_t *qx, const float *dx, i64 I, int R,
                                                           float s[][4]) {
    const i64 nb = I / 32, ahead = PREFETCH_ROWS * W->row_bytes;
#ifdef CS336_AVX2
    const int one_stream = fmt != FMT_INT4 && W->row_bytes <= ONE_STREAM;
    const i64 bb = block_bytes(W, fmt, 32), per_scale = fmt == FMT_INT4 ? nb / W->groups : 1; /* blocks per scale */
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *row[4];
    for (int j = 0; j < 4; j++) row[j] = (const uint8_t *)W->w + oj[j] * W->row_bytes;
    __m256 a[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (i64 b0 = 0; b0 < nb; b0 += per_scale) {
        __m256 dw[4];
        int sub[4];
        for (int j = 0; j < 4; j++) {
            float d;
            a8_head(W, fmt, oj[j], b0, &d, &sub[j]);
            dw[j] = _mm256_set1_ps(d);
        }
        for (i64 b = b0; b < b0 + per_scale; b++) {
            prefetch_tile(row, 4, one_stream, ahead, b * bb, (int)bb);
            __m256i w[4];
            for (int j = 0; j < 4; j++) /* the block's integers: past the fp16 scale, int4 has none */
                w[j] = a8_weights(fmt, row[j] + b * bb + (fmt == FMT_INT4 ? 0 : 2), sub[j]);
            for (int r = 0; r < R; r++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + r * I + 32 * b)), ax = _mm256_abs_epi8(xq);
                const __m256 dxv = _mm256_set1_ps(dx[r * nb + b]);
                for (int j = 0; j < 4; j++) {
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[j], xq)), ones);
                    a[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[j], dxv), a[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) vsum4_256(a[r][0], a[r][1], a[r][2], a[r][3], s[r]);
#else
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) {
            float acc = 0.f;
            for (i64 b = 0; b < nb; b++) {
                float d;
                int sub;
                const uint8_t *p = a8_head(W, fmt, oj[j], b, &d, &sub);
                const int8_t *xq = qx + r * I + 32 * b;
                int32_t t = 0;
                for (int k = 0; k < 32; k++) {
                    int q = fmt == FMT_Q8_0 ? (int)(int8_t)p[k] : (k < 16 ? p[k] & 0x0f : p[k - 16] >> 4) - sub;
                    t += q * xq[k];
                }
                acc = fmaf((float)t, d * dx[r * nb + b], acc);
            }
            s[r][j] = acc;
        }
    (void)ahead;
#endif
}

/* fmt: FMT_INT4 (scale fp16 [O, G], zero [O, G], I / G a multiple of 32), FMT_Q8_0 or FMT_Q4_0 (raw blocks) */
void cs336_a8(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *w, const uint16_t *scale,
              const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads) {
    Weight W = {fmt, w, block_bytes(NULL, fmt, I), NULL, scale, zero, G, -1};
    int8_t *qx = (int8_t *)malloc((size_t)(M * I));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(M * (I / 32)));
    a8_quantize_x(x, M, I, ldx, fmt == FMT_INT4, qx, dx);
    i64 tiles = (O + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (i64 t = 0; t < tiles; t++) {
        i64 o = 4 * t, oj[4];
        int J = O - o < 4 ? (int)(O - o) : 4;
        for (int j = 0; j < 4; j++) oj[j] = o + (j < J ? j : 0); /* a short last tile repeats a row */
        float s[2][4];
        for (i64 m = 0; m < M; m += 2) {
            const int8_t *q = qx + m * I;
            const float *d = dx + m * (I / 32);
#define A8_TILE(F) (M - m >= 2 ? a8_tile(&W, F, oj, q, d, I, 2, s) : a8_tile(&W, F, oj, q, d, I, 1, s))
            if (fmt == FMT_INT4)
                A8_TILE(FMT_INT4);
            else if (fmt == FMT_Q8_0)
                A8_TILE(FMT_Q8_0);
            else
                A8_TILE(FMT_Q4_0);
#undef A8_TILE
            for (int r = 0; r < 2 && m + r < M; r++)
                for (int j = 0; j < J; j++) y[(m + r) * O + o + j] = bias ? s[r][j] + bias[o + j] : s[r][j];
        }
    }
    free(qx);
    free(dx);
}

/* ------------------------------------------------------------------ Q5_0, Q4_K, Q6_K x 8-bit activations

   llama.cpp's products for the formats of its Q4_K_M files, with quantization/k8.py as the readable
   reference (bit for bit). x is quantized once per call, row by row, and every block's dot product
   is a sum of integers:

     Q4_K, Q6_K  x in Q8_K blocks of 256: iscale = -127 / (the x of largest |x|), q_x = min(127,
                 round-half-even(iscale x)), d_x = 1 / iscale; and the sums of q_x per 16 and per 32
     Q5_0        x in Q8_0 blocks of 32 (a8_quantize_x), and the sum of each block's q_x

   Per x row and weight row, over the weight's blocks b in order, in float32 (one rounding per
   operation; the file is compiled with -ffp-contract=off and no fma is written here):

     Q5_0  S = sum_k q q_x - 16 sum_k q_x                           acc = acc + (float)S * (d d_x)
     Q4_K  S = sum_j s_j sum_k q q_x,  T = sum_j m_j sum_k q_x      acc = acc + ((float)S * (d d_x)
                                                                                 - (float)T * (dmin d_x))
     Q6_K  S = sum_j s_j (sum_k q q_x - 32 sum_k q_x)               acc = acc + (float)S * (d d_x)

   q is the stored unsigned integer (5, 4 or 6 bits): the offsets 16 and 32 (and Q4_K's mins) come
   out through x's sums, so every product is an unsigned weight byte times a signed x byte, which
   is what vpmaddubsw multiplies: 32 byte products added in pairs into 16-bit numbers (at most
   2 * 63 * 127, exact), then vpmaddwd times the sub-block's scale (Q4_K, Q6_K) or times 1 (Q5_0; with
   AVX512-VNNI one vpdpbusd does both) into 8 int32 lanes. The scales are unpacked once per block
   and weight row (Q4_K's twelve bytes of 6-bit numbers a 32-bit word at a time) and spread over the
   lanes by a byte shuffle. A tile is 4 weight rows x up to KQ_ROWS x rows (4 with AVX-512's 32
   registers, else 2), each weight block decoded once for all of them: every (x row, weight row)
   pair keeps one 8-lane integer sum over a block; per two x rows the 8 sums are added across their
   lanes into one vector (`kq_sum8`: lane 4 r + j is pair (r, j)) and the float steps above run on
   the 8 pairs at once. The integer sums are exact, so no pair's numbers depend on the lanes beside
   it: a row's result is bitwise independent of M, and the plain C loops give the same bits.

   Measured on this file's AMD EPYC (Zen 5, one thread, one x row, a 4096 x 2048 weight): Q4_K 41,
   Q6_K 41, Q5_0 30 G multiply-adds/s, where the float kernels above run Q4_0 37 and Q8_0 35; at 8 x
   rows 82, 72 and 58 against 88 and 90. */

enum { FMT_Q5_0 = 8, FMT_Q4_K = 9, FMT_Q6_K = 10 }; /* step.c's fp32 codes are 0, 6 and 7 */

static inline int kq_block_weights(int fmt) { return fmt == FMT_Q5_0 ? 32 : 256; }
static inline int kq_block_bytes(int fmt) { return fmt == FMT_Q5_0 ? 22 : fmt == FMT_Q4_K ? 144 : 210; }

static inline uint32_t read_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* x quantized for one call: q [M, I], d [M, I / block], sum16 [M, I / 16] and sum32 [M, I / 32] */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *sum16, *sum32;
} KqX;

/* x's M rows as Q8_K blocks of 256 (quantize_row_q8_K_ref's numbers) */
static void q8_k_quantize_x(const float *x, i64 M, i64 I, i64 ldx, int8_t *qx, float *dx) {
    for (i64 m = 0; m < M; m++)
        for (i64 b = 0; b < I / 256; b++) {
            const float *xb = x + m * ldx + 256 * b;
            int8_t *q = qx + m * I + 256 * b;
            float amax = 0.f, top = 0.f;
            for (int k = 0; k < 256; k++) /* the first x of largest |x|, with its sign */
                if (fabsf(xb[k]) > amax) amax = fabsf(xb[k]), top = xb[k];
            if (amax == 0.f) {
                memset(q, 0, 256);
                dx[m * (I / 256) + b] = 0.f;
                continue;
            }
            const float iscale = -127.f / top;
            for (int k = 0; k < 256; k++) { /* |iscale x| <= 127 up to rounding: only the top can pass it */
                float v = nearbyintf(iscale * xb[k]);
                q[k] = (int8_t)(v > 127.f ? 127.f : v);
            }
            dx[m * (I / 256) + b] = 1.f / iscale;
        }
}

static KqX kq_quantize_x(int fmt, const float *x, i64 M, i64 I, i64 ldx) {
    KqX X;
    X.q = (int8_t *)malloc((size_t)(M * I));
    X.d = (float *)malloc(sizeof(float) * (size_t)(M * (I / kq_block_weights(fmt))));
    X.sum16 = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * (I / 16)));
    X.sum32 = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * (I / 32)));
    if (fmt == FMT_Q5_0)
        a8_quantize_x(x, M, I, ldx, 0, X.q, X.d);
    else
        q8_k_quantize_x(x, M, I, ldx, X.q, X.d);
    for (i64 i = 0; i < M * (I / 16); i++) { /* at most 16 * 127 and 32 * 127: int16 */
        int s = 0;
        for (int k = 0; k < 16; k++) s += X.q[16 * i + k];
        X.sum16[i] = (int16_t)s;
    }
    for (i64 i = 0; i < M * (I / 32); i++) X.sum32[i] = (int16_t)(X.sum16[2 * i] + X.sum16[2 * i + 1]);
    return X;
}

static void kq_free_x(KqX *X) {
    free(X->q);
    free(X->d);
    free(X->sum16);
    free(X->sum32);
}

/* Q4_K's 12 bytes of 6-bit numbers (kquants.pack_scales_mins): the 8 scales s_j and 8 mins m_j */
static inline void q4_k_scales(const uint8_t *k, uint8_t s[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        s[j] = k[j] & 63, mn[j] = k[4 + j] & 63;
        s[4 + j] = (uint8_t)((k[8 + j] & 0x0f) | ((k[j] >> 6) << 4));
        mn[4 + j] = (uint8_t)((k[8 + j] >> 4) | ((k[4 + j] >> 6) << 4));
    }
}

/* weight k (0..31) of a Q5_0 block: its nibble (low nibbles are weights 0-15) and bit k of qh above */
static inline int q5_0_q(const uint8_t *p, int k) {
    int nib = k < 16 ? p[6 + k] & 0x0f : p[6 + k - 16] >> 4;
    return nib | (int)(((read_u32(p + 2) >> k) & 1) << 4);
}

/* weight i (0..255) of a Q6_K super-block: in each half of 128, ql byte l holds weights l (low
   nibble) and 64 + l (high), ql byte 32 + l weights 32 + l and 96 + l; qh byte l the top two bits of
   weights l, 32 + l, 64 + l, 96 + l */
static inline int q6_k_q(const uint8_t *p, int i) {
    int n = i / 128, t = (i % 128) / 32, l = i % 32;
    int ql = p[64 * n + 32 * (t & 1) + l], qh = p[128 + 32 * n + l];
    return ((t < 2 ? ql & 0x0f : ql >> 4) | (((qh >> (2 * t)) & 3) << 4));
}

#ifdef CS336_AVX2
/* lane 4 r + j: the 8 int32 lanes of v[r][j] added (r < 2, j < 4), exact; rows = 1: v[0]'s sums in
   both halves (v[1] unused) */
static inline __m256i kq_sum8(const __m256i v[2][4], int rows) {
    __m256i u[2];
    for (int r = 0; r < rows; r++) { /* u[r]: per 128-bit half, the four vectors' half sums */
        __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[r][0], v[r][1]), _mm256_unpackhi_epi32(v[r][0], v[r][1]));
        __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[r][2], v[r][3]), _mm256_unpackhi_epi32(v[r][2], v[r][3]));
        u[r] = _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
    }
    if (rows == 1) return _mm256_add_epi32(u[0], _mm256_permute2x128_si256(u[0], u[0], 0x01));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

/* lane 4 r + j: the 4 int32 lanes of half r of a[j] added (a[j] holds one x row's partial sums in its
   low half, the other's in its high half) */
static inline __m256i kq_sum4x2(const __m256i a[4]) {
    __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpackhi_epi32(a[0], a[1]));
    __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2], a[3]), _mm256_unpackhi_epi32(a[2], a[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

/* lane 4 r + j: d_w[j] * d_x[r], x rows r = 0, 1 (dx0, dx1) */
static inline __m256 kq_scales(__m128 dw, float dx0, float dx1) {
    return _mm256_mul_ps(_mm256_set_m128(dw, dw), _mm256_set_m128(_mm_set1_ps(dx1), _mm_set1_ps(dx0)));
}

/* the four fp16 numbers at p[j] + off as floats */
static inline __m128 kq_halves(const uint8_t *const p[4], int off) {
    return _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, (short)read_u16(p[3] + off), (short)read_u16(p[2] + off),
                                      (short)read_u16(p[1] + off), (short)read_u16(p[0] + off)));
}

/* 16-bit lane k (k < 8) of each 128-bit half of v in all lanes of that half */
static inline __m256i kq_splat16(__m256i v, int k) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * k)));
}

/* sum_k w_k x_k over 32 unsigned weight bytes and 32 signed x bytes, as 8 int32 lanes */
static inline __m256i kq_dot(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* a Q5_0 block's 32 weights q (0..31) as bytes: nibbles, and 16 where bit k of qh is set */
static inline __m256i q5_0_weights(const uint8_t *p) {
    /* the 16 bytes in both halves, the high half shifted down by a nibble: weights 0-15, then 16-31 */
    const __m256i n = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 6)));
    __m256i q = _mm256_and_si256(_mm256_blend_epi32(n, _mm256_srli_epi16(n, 4), 0xf0), _mm256_set1_epi8(0x0f));
    uint32_t qh = read_u32(p + 2);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16)); /* + 16 where bit k is set */
#else
    /* byte k <- byte k / 8 of qh, keep bit k % 8, widen to 16 */
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(16));
    return _mm256_or_si256(q, h);
#endif
}

/* Q4_K's 12 bytes of 6-bit numbers as 16 bytes: the scales s_0..s_7, then the mins m_0..m_7 (a word
   at a time: the top 2 bits of bytes 0-3 and 4-7 go above the low nibbles of bytes 8-11) */
static inline __m128i q4_k_scales_mins(const uint8_t *k) {
    const uint32_t a = read_u32(k), b = read_u32(k + 4), c = read_u32(k + 8);
    const uint32_t s_lo = a & 0x3f3f3f3f, s_hi = (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030);
    const uint32_t m_lo = b & 0x3f3f3f3f, m_hi = ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030);
    return _mm_set_epi32((int)m_hi, (int)m_lo, (int)s_hi, (int)s_lo);
}
#endif

/* Rows of x per tile: 4 with AVX-512's 32 vector registers (16 integer sums live), else 2 */
#if defined(CS336_AVX2) && VL == 16
#define KQ_ROWS 4
#else
#define KQ_ROWS 2
#endif

/* s[r][j] = y[m0 + r, row j] without bias, for R <= KQ_ROWS rows of x and the 4 weight rows at row[j] */
static inline __attribute__((always_inline)) void kq_tile(int fmt, const uint8_t *const row[4], const KqX *X, i64 m0,
                                                           i64 I, int R, i64 ahead, int one_stream, float s[][4]) {
    const int bw = kq_block_weights(fmt), bb = kq_block_bytes(fmt);
    const i64 nb = I / bw, n16 = I / 16, n32 = I / 32;
    const int8_t *qx = X->q + m0 * I;
    const float *dx = X->d + m0 * nb;
    const int16_t *sum16 = X->sum16 + m0 * n16, *sum32 = X->sum32 + m0 * n32;
#ifdef CS336_AVX2
    /* x rows in pairs (lanes 0-3 and 4-7 of a float vector); an odd last row is paired with itself */
    const int G = (R + 1) / 2;
    int rr[KQ_ROWS]; /* the x row whose numbers lane group r takes */
    for (int r = 0; r < KQ_ROWS; r++) rr[r] = r < R ? r : R - 1;
    __m256 acc[KQ_ROWS / 2];
    for (int g = 0; g < KQ_ROWS / 2; g++) acc[g] = _mm256_setzero_ps();
    for (i64 b = 0; b < nb; b++) {
        prefetch_tile(row, 4, one_stream, ahead, b * bb, bb);
        const uint8_t *p[4];
        for (int j = 0; j < 4; j++) p[j] = row[j] + b * bb;
        __m256i v[KQ_ROWS][4]; /* pair (r, j): 8 int32 partial sums over the block */
        for (int r = 0; r < KQ_ROWS; r++)
            for (int j = 0; j < 4; j++) v[r][j] = _mm256_setzero_si256();
        __m256i S[KQ_ROWS / 2], T[KQ_ROWS / 2];
        __m128 dw, dm = _mm_setzero_ps();
        if (fmt == FMT_Q5_0) {
            dw = kq_halves(p, 0);
            for (int j = 0; j < 4; j++) {
                const __m256i w = q5_0_weights(p[j]);
                for (int r = 0; r < R; r++)
                    v[r][j] = kq_dot(w, _mm256_loadu_si256((const __m256i *)(qx + r * I + 32 * b)));
            }
            for (int g = 0; g < G; g++) { /* minus 16 sum_k q_x: lane 4 r + j holds x row r's block sum */
                const __m256i xs = _mm256_set_m128i(_mm_set1_epi32(sum32[rr[2 * g + 1] * n32 + b]),
                                                    _mm_set1_epi32(sum32[rr[2 * g] * n32 + b]));
                S[g] = _mm256_sub_epi32(kq_sum8((const __m256i(*)[4])(v + 2 * g), R - 2 * g >= 2 ? 2 : 1), _mm256_slli_epi32(xs, 4));
            }
        } else if (fmt == FMT_Q4_K) {
            dw = kq_halves(p, 0), dm = kq_halves(p, 2);
            __m256i sc[4];  /* row j's 8 scales as 16-bit numbers, in both 128-bit halves */
            __m128i mn[4];  /* row j's 8 mins as 16-bit numbers */
            for (int j = 0; j < 4; j++) {
                const __m256i sm = _mm256_cvtepu8_epi16(q4_k_scales_mins(p[j] + 4));
                sc[j] = _mm256_permute4x64_epi64(sm, 0x44), mn[j] = _mm256_extracti128_si256(sm, 1);
            }
            const __m256i mask = _mm256_set1_epi8(0x0f);
            for (int h = 0; h < 4; h++) /* 64 weights: sub-block 2h in the low nibbles, 2h + 1 in the high */
                for (int j = 0; j < 4; j++) {
                    const __m256i n = _mm256_loadu_si256((const __m256i *)(p[j] + 16 + 32 * h));
                    const __m256i lo = _mm256_and_si256(n, mask), hi = _mm256_and_si256(_mm256_srli_epi16(n, 4), mask);
                    const __m256i slo = kq_splat16(sc[j], 2 * h), shi = kq_splat16(sc[j], 2 * h + 1);
                    for (int r = 0; r < R; r++) {
                        const int8_t *xr = qx + r * I + 256 * b + 64 * h;
                        __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)), slo);
                        __m256i c = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32))), shi);
                        v[r][j] = _mm256_add_epi32(v[r][j], _mm256_add_epi32(a, c));
                    }
                }
            for (int g = 0; g < G; g++) {
                S[g] = kq_sum8((const __m256i(*)[4])(v + 2 * g), R - 2 * g >= 2 ? 2 : 1);
                /* T: the 8 mins times x row r's 8 sums of 32 (16-bit products added in pairs), the
                   group's two rows in the two halves */
                const __m256i xs = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(sum32 + rr[2 * g + 1] * n32 + 8 * b)),
                                                    _mm_loadu_si128((const __m128i *)(sum32 + rr[2 * g] * n32 + 8 * b)));
                __m256i t[4];
                for (int j = 0; j < 4; j++) t[j] = _mm256_madd_epi16(_mm256_set_m128i(mn[j], mn[j]), xs);
                T[g] = kq_sum4x2(t);
            }
        } else { /* FMT_Q6_K */
            dw = kq_halves(p, 208);
            const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
            for (int j = 0; j < 4; j++) {
                /* minus 32 sum_j s_j sum_k q_x: the 16 scales times x row r's 16 sums of 16 */
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p[j] + 192)));
                for (int r = 0; r < R; r++) {
                    const __m256i xs = _mm256_loadu_si256((const __m256i *)(sum16 + r * n16 + 16 * b));
                    v[r][j] = _mm256_sub_epi32(v[r][j], _mm256_slli_epi32(_mm256_madd_epi16(sc, xs), 5));
                }
            }
            for (int n = 0; n < 2; n++) /* a half of 128 weights */
                for (int j = 0; j < 4; j++) {
                    const uint8_t *ph = p[j] + 64 * n;
                    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)ph), ql1 = _mm256_loadu_si256((const __m256i *)(ph + 32));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p[j] + 128 + 32 * n));
                    /* the half's 8 scales as 16-bit numbers, in both 128-bit halves */
                    const __m256i s8 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p[j] + 192 + 8 * n))));
                    __m256i q[4]; /* weights 32 t .. 32 t + 31 of the half: a nibble and two top bits */
                    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top));
                    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top));
                    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, top));
                    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
                    for (int t = 0; t < 4; t++) { /* sub-block 2t in the low 16 bytes, 2t + 1 in the high */
                        const __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * t + 1))),
                                                              _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * t))));
                        const __m256i sc = _mm256_shuffle_epi8(s8, pick);
                        for (int r = 0; r < R; r++) {
                            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + r * I + 256 * b + 128 * n + 32 * t));
                            v[r][j] = _mm256_add_epi32(v[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], xq), sc));
                        }
                    }
                }
            for (int g = 0; g < G; g++) S[g] = kq_sum8((const __m256i(*)[4])(v + 2 * g), R - 2 * g >= 2 ? 2 : 1);
        }
        for (int g = 0; g < G; g++) { /* the float steps of the module comment, 8 pairs at once */
            const float dx0 = dx[rr[2 * g] * nb + b], dx1 = dx[rr[2 * g + 1] * nb + b];
            __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(S[g]), kq_scales(dw, dx0, dx1));
            if (fmt == FMT_Q4_K) term = _mm256_sub_ps(term, _mm256_mul_ps(_mm256_cvtepi32_ps(T[g]), kq_scales(dm, dx0, dx1)));
            acc[g] = _mm256_add_ps(acc[g], term);
        }
    }
    for (int g = 0; g < G; g++) {
        float out[8];
        _mm256_storeu_ps(out, acc[g]);
        for (int r = 2 * g; r < R && r < 2 * g + 2; r++)
            for (int j = 0; j < 4; j++) s[r][j] = out[4 * (r - 2 * g) + j];
    }
#else
    (void)ahead, (void)one_stream;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) {
            float acc = 0.f;
            for (i64 b = 0; b < nb; b++) {
                const uint8_t *p = row[j] + b * bb;
                const int8_t *xq = qx + r * I + bw * b;
                const float d_x = dx[r * nb + b];
                int32_t S = 0, T = 0;
                float term;
                if (fmt == FMT_Q5_0) {
                    for (int k = 0; k < 32; k++) S += q5_0_q(p, k) * xq[k];
                    S -= 16 * sum32[r * n32 + b];
                    term = (float)S * (half_to_float(read_u16(p)) * d_x);
                } else if (fmt == FMT_Q4_K) {
                    uint8_t sc[8], mn[8];
                    q4_k_scales(p + 4, sc, mn);
                    for (int sub = 0; sub < 8; sub++) {
                        int32_t dot = 0;
                        for (int k = 0; k < 32; k++) { /* sub-block 2h: the low nibbles of bytes 32h..32h+31 */
                            const uint8_t byte = p[16 + 32 * (sub / 2) + k];
                            dot += (sub % 2 ? byte >> 4 : byte & 0x0f) * xq[32 * sub + k];
                        }
                        S += sc[sub] * dot;
                        T += mn[sub] * sum32[r * n32 + 8 * b + sub];
                    }
                    term = (float)S * (half_to_float(read_u16(p)) * d_x) - (float)T * (half_to_float(read_u16(p + 2)) * d_x);
                } else {
                    for (int sub = 0; sub < 16; sub++) {
                        int32_t dot = 0;
                        for (int k = 0; k < 16; k++) dot += q6_k_q(p, 16 * sub + k) * xq[16 * sub + k];
                        dot -= 32 * sum16[r * n16 + 16 * b + sub];
                        S += (int8_t)p[192 + sub] * dot;
                    }
                    term = (float)S * (half_to_float(read_u16(p + 208)) * d_x);
                }
                acc = acc + term;
            }
            s[r][j] = acc;
        }
#endif
}

/* kq_tile with R a constant (the loops over rows unrolled) */
static inline __attribute__((always_inline)) void kq_rows(int fmt, const uint8_t *const row[4], const KqX *X, i64 m0,
                                                           i64 I, int R, i64 ahead, int one_stream, float s[][4]) {
    if (R == 1)
        kq_tile(fmt, row, X, m0, I, 1, ahead, one_stream, s);
#if KQ_ROWS == 4
    else if (R == 3)
        kq_tile(fmt, row, X, m0, I, 3, ahead, one_stream, s);
    else if (R == 4)
        kq_tile(fmt, row, X, m0, I, 4, ahead, one_stream, s);
#endif
    else
        kq_tile(fmt, row, X, m0, I, 2, ahead, one_stream, s);
}

/* fmt: FMT_Q5_0, FMT_Q4_K or FMT_Q6_K; w: the raw blocks [O, I / block * bytes]; M <= MAX_M */
void cs336_kq(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *w, i64 O, const float *bias, float *y,
              int threads) {
    const i64 row_bytes = I / kq_block_weights(fmt) * kq_block_bytes(fmt);
    KqX X = kq_quantize_x(fmt, x, M, I, ldx);
    const i64 tiles = (O + 3) / 4, ahead = PREFETCH_ROWS * row_bytes;
    const int one_stream = row_bytes <= ONE_STREAM;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (i64 t = 0; t < tiles; t++) {
        i64 o = 4 * t;
        int J = O - o < 4 ? (int)(O - o) : 4;
        const uint8_t *row[4];
        for (int j = 0; j < 4; j++) row[j] = w + (o + (j < J ? j : 0)) * row_bytes; /* a short last tile repeats a row */
        float s[KQ_ROWS][4];
        for (i64 m = 0; m < M; m += KQ_ROWS) {
            const int R = M - m >= KQ_ROWS ? KQ_ROWS : (int)(M - m);
            if (fmt == FMT_Q5_0)
                kq_rows(FMT_Q5_0, row, &X, m, I, R, ahead, one_stream, s);
            else if (fmt == FMT_Q4_K)
                kq_rows(FMT_Q4_K, row, &X, m, I, R, ahead, one_stream, s);
            else
                kq_rows(FMT_Q6_K, row, &X, m, I, R, ahead, one_stream, s);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < J; j++) y[(m + r) * O + o + j] = bias ? s[r][j] + bias[o + j] : s[r][j];
        }
    }
    kq_free_x(&X);
}

/* ------------------------------------------------------------------ e^x, VL numbers at a time

   For the native step's SiLU and softmax (step.c), which had called the C library's expf once per
   number: about 3 ms of SmolLM2's 17-token pass went to the SiLU's alone (AMD EPYC Zen 3). e^x =
   2^n e^r with n = x log2(e) rounded to the nearest integer (adding and subtracting 1.5 * 2^23) and
   r = x - n ln 2, with ln 2 in two parts (0.693359375 has 9 bits, so n times it is exact); e^r from
   Cephes' degree-6 polynomial for expf (|r| <= ln(2) / 2); 2^n written into the exponent bits. x is
   clamped to [-87.3, 88.3], where 2^n is a normal float: below, the result is about 1.2e-38 rather
   than smaller (a softmax's masked keys are zeroed by their caller); NaN stays NaN. Within 2 ulp of
   e^x (tests/test_kernels.py). */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

static inline vf vexp(vf x) {
    x = vselect(x < vsplat(-87.3f), vsplat(-87.3f), x);
    x = vselect(x > vsplat(88.3f), vsplat(88.3f), x);
    const vf round = vsplat(12582912.f);
    vf n = (x * vsplat(1.44269504f) + round) - round;
    vf r = (x - n * vsplat(0.693359375f)) - n * vsplat(-2.12194440e-4f);
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + vsplat(1.3981999507e-3f);
    p = p * r + vsplat(8.3334519073e-3f);
    p = p * r + vsplat(4.1665795894e-2f);
    p = p * r + vsplat(1.6666665459e-1f);
    p = p * r + vsplat(5.0000001201e-1f);
    vf y = (p * (r * r) + r) + vsplat(1.f);
    vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)two_n;
}

/* x[i] = e^x[i] for i < n, in place (vexp; the last n % VL numbers through a padded vector) */
void cs336_exp(float *x, i64 n) {
    i64 i = 0;
    for (; i + VL <= n; i += VL) vstore(x + i, vexp(vload(x + i)));
    if (i < n) {
        float t[VL] = {0};
        memcpy(t, x + i, sizeof(float) * (size_t)(n - i));
        vstore(t, vexp(vload(t)));
        memcpy(x + i, t, sizeof(float) * (size_t)(n - i));
    }
}

/* a[m, f] = silu(gu[m, f]) * gu[m, F + f] for M rows of 2F (gate, then up; layers.SwiGLU):
   silu(z) = z / (1 + e^-z), on `threads` threads in chunks of 256 */
void cs336_silu_mul(const float *gu, i64 M, i64 F, float *a, int threads) {
    const i64 chunks = (F + 255) / 256;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (i64 m = 0; m < M; m++)
        for (i64 c = 0; c < chunks; c++) {
            i64 f0 = 256 * c, n = F - f0 < 256 ? F - f0 : 256;
            float *am = a + m * F + f0;
            const float *z = gu + m * 2 * F + f0, *u = z + F;
            for (i64 k = 0; k < n; k++) am[k] = -z[k];
            cs336_exp(am, n);
            for (i64 k = 0; k < n; k++) am[k] = z[k] / (1.f + am[k]) * u[k];
        }
}

/* ------------------------------------------------------------------ the arithmetic roof

   Multiply-adds per second of this file's own vector fma on `threads` threads, from registers only
   (16 independent accumulators per thread, `iters` rounds): what a product's extra rows cost at
   best, since each row is one multiply-add per weight. The benchmark's T-token floor uses it. */
double cs336_fma_rate(int threads, i64 iters) {
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = omp_get_wtime();
        float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            vf a[16], b = vsplat(0.999f), c = vsplat(1e-4f);
            for (int k = 0; k < 16; k++) a[k] = vsplat(1e-3f * (float)(k + omp_get_thread_num()));
            for (i64 n = 0; n < iters; n++)
                for (int k = 0; k < 16; k++) a[k] = vfma(a[k], b, c);
            for (int k = 1; k < 16; k++) a[0] += a[k];
            for (int l = 0; l < VL; l++) sink += a[0][l];
        }
        double rate = (double)threads * (double)iters * 16 * VL / (omp_get_wtime() - t0);
        if (rate > best && sink == sink) best = rate;
    }
    return best;
}
