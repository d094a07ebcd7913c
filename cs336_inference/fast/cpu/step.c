/* The decoder layers of a Llama-style model for B rows of T new tokens, in one C call.

   A compiled decode step (fast/step/fixed.py) still runs about 500 small calls per SmolLM2 token
   through the generated Python wrapper: the products, the fused norm / rotary / softmax / SiLU
   loops, the cache writes, each a few microseconds. The products are memory-bound and cannot get
   faster than the bytes they read; the calls between them are pure overhead, about a fifth of the
   step. `cs336_layers` runs every layer's

       x += o_proj(attend(rope(q), rope(k) -> cache, v -> cache))   with q, k, v = qkv(rmsnorm(x))
       x += down(silu(gate) * up)                                  with gate, up = gateup(rmsnorm(x))

   (with QK-norm, Qwen3's, q and k are RMS-normalized head by head before the rotary; Gemma 3's
   block normalizes each branch's output too before adding it, x += post_norm(o_proj(...)), gates
   with tanh-GELU instead of SiLU, and rotates its sliding layers with a second table)

   in C, calling decode.c's product kernels (exported there) on the stacked q/k/v and gate/up
   weights of fast/step/fuse.py. fast/step/native.py builds its arguments; it is staff code, tested
   equal (to float32 rounding) to the model's own forward, which stays the readable reference.

   Every row (b, t) is computed by the same operations whatever T is: the products' rows are
   independent (decode.c), and so are the norms, the rotary and each query's attention, whose keys
   are visited in step order with the same reduction. A verify pass of k + 1 tokens therefore gives
   bitwise the logits of k + 1 one-token steps, as speculative decoding's greedy identity needs.

   Arguments are flat int64 arrays (pointers as integers), so the Python side builds them with
   one torch.tensor call. Compiled with decode.c by fast/cpu/build.py (-ffp-contract=off: every
   multiply and add rounds as in the reference). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

void cs336_f32_rows(const float *x, i64 M, i64 I, i64 ldx, const float *w, i64 O, const float *bias, float *y,
                    int threads);
void cs336_f32_panels(const float *x, i64 M, i64 I, i64 ldx, const float *wp, i64 O, const float *bias, float *y,
                      int threads);
void cs336_f32_cols(const float *x, i64 M, i64 I, i64 ldx, const float *wt, i64 O, const float *bias, float *y,
                    int threads);
void cs336_int8(const float *x, i64 M, i64 I, i64 ldx, const int8_t *q, const float *scale, i64 O,
                const float *bias, float *y, int threads);
void cs336_int4(const float *x, i64 M, i64 I, i64 ldx, const uint8_t *packed, const uint16_t *scale,
                const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads);
void cs336_ggml(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *raw, i64 O, const float *bias,
                float *y, int threads);
void cs336_a8(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *w, const uint16_t *scale,
              const uint8_t *zero, i64 G, i64 O, const float *bias, float *y, int threads);
void cs336_kq(int fmt, const float *x, i64 M, i64 I, i64 ldx, const uint8_t *w, i64 O, const float *bias, float *y,
              int threads);
void cs336_exp(float *x, i64 n);
void cs336_silu_mul(const float *gu, i64 M, i64 F, float *a, int threads);

/* A product: {format, O, groups, weight, scale, zero, bias}. Formats as decode.c (1 int8, 2 int4,
   3 q8_0, 4 q4_0, 5 q4_1; 8 q5_0, 9 q4_k, 10 q6_k, always times x quantized to 8 bits inside,
   decode.c's `cs336_kq`, as llama.cpp and the fast layers do), with 0 = fp32 row-major, 6 = fp32
   column-major (W^T contiguous), 7 = fp32 in panels of 16 rows (decode.c's cs336_f32_panels), and
   A8 + format for int4, q8_0 and q4_0 times Q8_0 activations (decode.c's `cs336_a8`). */
enum { LIN_FIELDS = 7, F32_ROWS = 0, F32_COLS = 6, F32_PANELS = 7, Q5_0 = 8, Q6_K = 10, A8 = 16 };
/* A layer: {attn_norm, mlp_norm, k cache, v cache, window (0: none), q_norm, k_norm (QK-norm's [H] gains,
   0: none), post_attn_norm, post_mlp_norm (Gemma 3's sandwich norms' [D] gains, 0: none), flags}, then
   seven products: q, k, v, o, gate, up, down. q/k/v and gate/up stacked by fast/step/fuse.py (one
   format) are one product, the q and gate slots, with the k, v and up slots empty (O = 0); groups of
   mixed formats (a Q4_K_M file's q4_k q/k and q6_k v) run as separate products. */
enum { LAYER_HEAD = 10, LAYER_FIELDS = LAYER_HEAD + 7 * LIN_FIELDS };
enum { S_Q = 0, S_O = 3, S_GATE = 4, S_DOWN = 6 }; /* product slots */
/* flags: LOCAL_ROPE rotates with the second table (Gemma 3's sliding layers, their own base);
   GELU_TANH gates with tanh-GELU (Gemma's GeGLU) instead of SiLU (SwiGLU) */
enum { LOCAL_ROPE = 1, GELU_TANH = 2 };
/* dims: {B, T, D, N, K, H, F, S (cache slots), threads, cos_local, sin_local (the second rotary table's
   [B, T, H] rows as pointers, 0: none)} */

static void linear(const i64 *L, const float *x, i64 M, i64 I, float *y, int threads) {
    i64 fmt = L[0], O = L[1], G = L[2];
    const void *w = (const void *)L[3], *scale = (const void *)L[4];
    const uint8_t *zero = (const uint8_t *)L[5];
    const float *bias = (const float *)L[6];
    if (fmt == F32_ROWS)
        cs336_f32_rows(x, M, I, I, (const float *)w, O, bias, y, threads);
    else if (fmt == F32_COLS)
        cs336_f32_cols(x, M, I, I, (const float *)w, O, bias, y, threads);
    else if (fmt == F32_PANELS)
        cs336_f32_panels(x, M, I, I, (const float *)w, O, bias, y, threads);
    else if (fmt == 1)
        cs336_int8(x, M, I, I, (const int8_t *)w, (const float *)scale, O, bias, y, threads);
    else if (fmt > A8)
        cs336_a8((int)(fmt - A8), x, M, I, I, (const uint8_t *)w, (const uint16_t *)scale, zero, G, O, bias, y, threads);
    else if (fmt == 2)
        cs336_int4(x, M, I, I, (const uint8_t *)w, (const uint16_t *)scale, zero, G, O, bias, y, threads);
    else if (fmt >= Q5_0 && fmt <= Q6_K)
        cs336_kq((int)fmt, x, M, I, I, (const uint8_t *)w, O, bias, y, threads);
    else
        cs336_ggml((int)fmt, x, M, I, I, (const uint8_t *)w, O, bias, y, threads);
}

/* y [M, Y] = the products P[0..parts) of x side by side along the output (q, k, v or gate, up): one call
   when they are stacked (P[1]'s O is 0, or a single part), else each into tmp [M, its O], then its columns */
static void linear_parts(const i64 *P, int parts, const float *x, i64 M, i64 I, float *y, i64 Y, float *tmp,
                         int threads) {
    if (parts == 1 || P[LIN_FIELDS + 1] == 0) {
        linear(P, x, M, I, y, threads);
        return;
    }
    for (i64 p = 0, at = 0; p < parts; p++) {
        const i64 *L = P + p * LIN_FIELDS;
        i64 O = L[1];
        linear(L, x, M, I, tmp, threads);
        for (i64 m = 0; m < M; m++) memcpy(y + m * Y + at, tmp + m * O, sizeof(float) * (size_t)O);
        at += O;
    }
}

/* a[m, f] = gelu_tanh(gu[m, f]) * gu[m, F + f], as layers.GeGLU (F.gelu(approximate="tanh")):
   gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3))) */
static void gelu_mul(const float *gu, i64 M, i64 F, float *a) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    for (i64 m = 0; m < M; m++) {
        const float *z = gu + m * 2 * F, *u = z + F;
        for (i64 f = 0; f < F; f++) {
            float zf = z[f], inner = beta * (zf + kappa * (zf * zf * zf));
            a[m * F + f] = 0.5f * zf * (1.f + tanhf(inner)) * u[f];
        }
    }
}

/* sum_i a[i] b[i]: 8 partial sums (vectorizable without reassociating), a fixed tree, the tail */
static float dot(const float *a, const float *b, i64 n) {
    float acc[8] = {0};
    i64 i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y = g * (x / sqrt(mean(x^2) + eps)), as layers.RMSNorm: the scaled row first, then the gain */
static void rmsnorm(const float *x, const float *g, float *y, i64 M, i64 D, float eps) {
    for (i64 m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float r = 1.f / sqrtf(dot(xm, xm, D) / (float)D + eps);
        for (i64 i = 0; i < D; i++) y[m * D + i] = g[i] * (xm[i] * r);
    }
}

/* dot's arithmetic on 8 lanes, for four dot products at once: LOAD(v8f, p) reads 8 floats (v16f: 16);
   a[c] holds dot's 8 partial sums of product c (each lane's products and sums rounded as dot's
   scalars are: GCC's vector types never reassociate), and TREE4(a) adds each as dot's fixed tree
   does, the four results as one vector: the same additions, lane by lane (halves, then pairs, then
   pairs of pairs), with shuffles instead of one horizontal sum each. Macros, not functions: a vector
   returned by value changes the ABI of a build without AVX-512 (which GCC warns about). */
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
#define LOAD(type, p) ({ type v_; memcpy(&v_, (p), sizeof v_); v_; })
#define HALVES(x) (__builtin_shufflevector((x), (x), 0, 1, 2, 3) + __builtin_shufflevector((x), (x), 4, 5, 6, 7))
#define PAIRS(x, y) (__builtin_shufflevector((x), (y), 0, 2, 4, 6) + __builtin_shufflevector((x), (y), 1, 3, 5, 7))
#define TREE4(a) PAIRS(PAIRS(HALVES((a)[0]), HALVES((a)[1])), PAIRS(HALVES((a)[2]), HALVES((a)[3])))

/* x cos + rotate_half(x) sin in place, rotate_half(x) = (-x2, x1) (layers.apply_rope) */
static void rope(float *x, const float *cos, const float *sin, i64 H) {
    i64 h2 = H / 2;
    float tmp[512];
    memcpy(tmp, x, sizeof(float) * (size_t)H);
    for (i64 i = 0; i < h2; i++) x[i] = tmp[i] * cos[i] + (-tmp[i + h2]) * sin[i];
    for (i64 i = h2; i < H; i++) x[i] = tmp[i] * cos[i] + tmp[i - h2] * sin[i];
}

/* Seconds spent per phase of cs336_layers while profiling is on (cs336_step_profile), summed over
   calls and layers: what the per-step overhead outside the products is made of. */
enum { P_NORMS, P_QKV, P_ROPE, P_ATTEND, P_O, P_RESIDUAL, P_GATEUP, P_SILU, P_DOWN, PHASES };
static int profiling;
static double phase_seconds[PHASES];

/* on: 1 starts (and zeroes), 0 stops; out (if not NULL): the PHASES sums so far, in enum order */
void cs336_step_profile(int on, double *out) {
    if (out) memcpy(out, phase_seconds, sizeof phase_seconds);
    if (on) memset(phase_seconds, 0, sizeof phase_seconds);
    profiling = on;
}

static inline void phase(int k, double *t) {
    if (!profiling) return;
    double now = omp_get_wtime();
    phase_seconds[k] += now - *t;
    *t = now;
}

/* Paged attention of M rows (the new tokens of several sequences, flattened): row m is step
   pos[m] of its sequence, whose step j lives at slot keys[first[m] + j] of the K/V stores
   [slots, K, H] (serving/paged_attention.py's PagedKVCache; every row's keys already written).
   Each row sees its own sequence's steps lo..pos[m], with the operations of attend_queries in the same
   order (so the numbers of a static cache holding those steps). The query heads that share a K/V
   head are done together, up to GROUP at once: each key and value row is read once for all of them
   (decode attention reads the cache, memory-bound like the products). A group's size and head width
   are compile-time constants for the common cases (attend_paged's switch), so its output rows stay
   in registers across the keys instead of being loaded and stored at every key, and the heads'
   softmax sums run side by side (each in key order, as attend_queries): a 16-request SmolLM2 engine
   step spent 2.5 -> 2.1 ms in attention at 64-124 tokens of context and 10.5-11.2 -> 9.1-9.5 ms at
   400-460 (`cs336_step_profile`, alternated A/B runs, AMD EPYC Zen 5, 2 threads, 2026-11-26). */
enum { GROUP = 8, AHEAD = 8 };
static inline void prefetch_row(const float *r, i64 H) {
    for (i64 c = 0; c < H; c += 16) __builtin_prefetch(r + c); /* a cache line at a time */
}

/* one task of attend_paged: the `heads` query heads at q (of K/V head g's group) against row m's
   keys lo..qs; inlined with H a constant for the common head sizes. The next keys' and values' rows
   are prefetched AHEAD slots on (a sequence's slots jump at each block boundary). */
static inline __attribute__((always_inline)) void attend_group(const float *q, const float *k, const float *v,
                                                               const i64 *slot, i64 lo, i64 qs, i64 heads,
                                                               i64 stride, i64 S, float scale, float *p,
                                                               float *out, i64 H) {
    float mx[GROUP], sum[GROUP];
    for (i64 e = 0; e < heads; e++) mx[e] = -INFINITY;
    for (i64 j = lo; j <= qs; j++) {
        if (j + AHEAD <= qs) prefetch_row(k + slot[j + AHEAD] * stride, H);
        const float *kj = k + slot[j] * stride;
        for (i64 e = 0; e < heads; e++) {
            float x = dot(q + e * H, kj, H) * scale;
            p[e * S + j] = x;
            if (x > mx[e]) mx[e] = x;
        }
    }
    for (i64 e = 0; e < heads; e++) {
        float *pe = p + e * S;
        for (i64 j = lo; j <= qs; j++) pe[j] -= mx[e];
        cs336_exp(pe + lo, qs - lo + 1);
        sum[e] = 0.f;
    }
    for (i64 j = lo; j <= qs; j++) /* each head's sum in key order; the heads' chains side by side */
        for (i64 e = 0; e < heads; e++) sum[e] += p[e * S + j];
    float acc[GROUP * 512]; /* heads * H <= GROUP * 512; with both constant it stays in registers */
    for (i64 i = 0; i < heads * H; i++) acc[i] = 0.f;
    for (i64 j = lo; j <= qs; j++) {
        if (j + AHEAD <= qs) prefetch_row(v + slot[j + AHEAD] * stride, H);
        const float *vj = v + slot[j] * stride;
        for (i64 e = 0; e < heads; e++) {
            float w = p[e * S + j] / sum[e], *ae = acc + e * H;
            for (i64 h = 0; h < H; h++) ae[h] += w * vj[h];
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(heads * H));
}

static void attend_paged(i64 M, i64 N, i64 K, i64 H, const float *qkv, const float *kc, const float *vc,
                         i64 window, const i64 *pos, const i64 *keys, const i64 *first, float scale, int threads,
                         float *out) {
    i64 QKV = (N + 2 * K) * H, G = N / K, chunks = (G + GROUP - 1) / GROUP, tasks = M * K * chunks, S = 0;
    for (i64 m = 0; m < M; m++) S = pos[m] + 1 > S ? pos[m] + 1 : S;
#pragma omp parallel num_threads(threads)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(S * GROUP));
#pragma omp for schedule(static)
        for (i64 task = 0; task < tasks; task++) {
            i64 m = task / (K * chunks), g = task / chunks % K, n0 = g * G + task % chunks * GROUP;
            i64 heads = G - (n0 - g * G) < GROUP ? G - (n0 - g * G) : GROUP, qs = pos[m];
            i64 lo = window > 0 && qs - window + 1 > 0 ? qs - window + 1 : 0, stride = K * H;
            const i64 *slot = keys + first[m];
            const float *q = qkv + m * QKV + n0 * H, *k = kc + g * H, *v = vc + g * H;
            float *o = out + m * N * H + n0 * H; /* the group's heads are adjacent in out's row */
            if (H == 64 && heads == 3) /* SmolLM2's groups */
                attend_group(q, k, v, slot, lo, qs, 3, stride, S, scale, p, o, 64);
            else if (H == 64 && heads == 4)
                attend_group(q, k, v, slot, lo, qs, 4, stride, S, scale, p, o, 64);
            else if (H == 64)
                attend_group(q, k, v, slot, lo, qs, heads, stride, S, scale, p, o, 64);
            else if (H == 128 && heads == 4)
                attend_group(q, k, v, slot, lo, qs, 4, stride, S, scale, p, o, 128);
            else if (H == 128)
                attend_group(q, k, v, slot, lo, qs, heads, stride, S, scale, p, o, 128);
            else
                attend_group(q, k, v, slot, lo, qs, heads, stride, S, scale, p, o, H);
        }
        free(p);
    }
}

/* The static cache's attention: out[m, n*H:(n+1)*H] = softmax(q k^T * scale over the visible keys) v
   for every row m = (b, t) and query head n (K/V head g = n / G, G = N / K). Visible: step j <= the
   query's step qs, inside the window, and not left padding (pad[b] > j) unless j is the query's own
   step (attention.attention_mask); with tree (a tree pass: T <= 64 new steps from steps[0] on), also
   an ancestor of the query (bits of tree[t]).

   Per query, in key order: the scores p_j = q . k_j * scale (dot), their max, p_j - max through
   cs336_exp, the sum of the visible ones, then o = sum_j (p_j / sum) v_j. The queries that share a
   K/V head (the T rows' G heads, up to QGROUP at a time) go side by side, so each key and value row
   is read once for all of them: a verify pass reads the cache once per group of up to six queries
   instead of once per query. A query adds exact zeros for the keys of the others that it does not
   see (its score -inf, its weight 0), which leave its sums as they were, so every query's bits are
   those of attending alone, whatever T or the group. */
enum { QGROUP = 6 };
typedef struct {
    const float *q;
    float *o;
    i64 lo, qs;              /* its steps lo..qs */
    unsigned long long anc;  /* its tree ancestors' bits (~0: no tree) */
} Query;

/* key j seen by query e: in its steps lo..qs, not padding (unless its own step), and in a tree pass
   (anc != ~0) not a node of the tree (j >= base) other than one of its ancestors (bit j - base of
   anc; speculative_tree.tree_mask) */
#define SEES(e, j) ((j) >= qu[e].lo && (j) <= qu[e].qs && VIS(j, qu[e].qs, qu[e].anc))
#define VIS(j, qs, anc) (((j) >= pad || (j) == (qs)) && ((j) < base || (((anc) >> ((j) - base)) & 1ULL)))

/* E queries of one K/V head (k, v: its [S, H] rows; pad: the batch row's padding; base: the tree's first
   step); p: E * S floats of scratch. Inlined with E and H constants for the common cases, so the E
   output rows stay in registers across the keys. */
static inline __attribute__((always_inline)) void attend_queries(const Query *qu, i64 E, const float *k,
                                                                 const float *v, i64 pad, i64 base, float scale,
                                                                 float *p, i64 S, i64 H) {
    i64 lo = qu[0].lo, hi = qu[0].qs;
    for (i64 e = 1; e < E; e++) {
        lo = qu[e].lo < lo ? qu[e].lo : lo;
        hi = qu[e].qs > hi ? qu[e].qs : hi;
    }
    /* keys every query sees (no test needed): from the last lo (and past the padding) to the first qs,
       before the tree's nodes */
    i64 all_lo = pad > lo ? pad : lo, all_hi = base - 1 < hi ? base - 1 : hi;
    for (i64 e = 0; e < E; e++) {
        all_lo = qu[e].lo > all_lo ? qu[e].lo : all_lo;
        all_hi = qu[e].qs < all_hi ? qu[e].qs : all_hi;
    }
#define SEEN(e, j) (((j) >= all_lo && (j) <= all_hi) || SEES(e, j))
    float mx[QGROUP], sum[QGROUP];
    for (i64 e = 0; e < E; e++) mx[e] = -INFINITY;
    i64 j = lo;
    if (H % 8 == 0) /* four keys at a time: each query's 8 partial sums of each, their trees as one vector */
        for (; j + 3 <= hi; j += 4) {
            if (j + AHEAD + 3 <= hi)
                for (int c = 0; c < 4; c++) prefetch_row(k + (j + AHEAD + c) * H, H);
            v8f a[QGROUP][4];
            for (i64 e = 0; e < E; e++)
                for (int c = 0; c < 4; c++) a[e][c] = (v8f){0};
            for (i64 i = 0; i < H; i += 8) {
                v8f kv[4];
                for (int c = 0; c < 4; c++) kv[c] = LOAD(v8f, k + (j + c) * H + i);
                for (i64 e = 0; e < E; e++) {
                    v8f qv = LOAD(v8f, qu[e].q + i);
                    for (int c = 0; c < 4; c++) a[e][c] = a[e][c] + qv * kv[c];
                }
            }
            for (i64 e = 0; e < E; e++) {
                v4f d = TREE4(a[e]) * scale;
                for (int c = 0; c < 4; c++) {
                    float x = SEEN(e, j + c) ? d[c] : -INFINITY;
                    p[e * S + j + c] = x;
                    if (x > mx[e]) mx[e] = x;
                }
            }
        }
    for (; j <= hi; j++) { /* the keys left */
        if (j + AHEAD <= hi) prefetch_row(k + (j + AHEAD) * H, H);
        const float *kj = k + j * H;
        for (i64 e = 0; e < E; e++) {
            float x = SEEN(e, j) ? dot(qu[e].q, kj, H) * scale : -INFINITY;
            p[e * S + j] = x;
            if (x > mx[e]) mx[e] = x;
        }
    }
    for (i64 e = 0; e < E; e++) {
        float *pe = p + e * S;
        for (i64 j = lo; j <= hi; j++) pe[j] -= mx[e];
        cs336_exp(pe + lo, hi - lo + 1);
        for (i64 j = lo; j <= hi; j++)
            if (!SEEN(e, j)) pe[j] = 0.f;
        sum[e] = 0.f;
    }
    for (i64 j = lo; j <= hi; j++) /* each query's sum in key order; the queries' chains side by side */
        for (i64 e = 0; e < E; e++) sum[e] += p[e * S + j];
    if (H == 64) { /* the E output rows in 4 vectors of 16 each, in registers across the keys */
        v16f acc[QGROUP][4];
        for (i64 e = 0; e < E; e++)
            for (int c = 0; c < 4; c++) acc[e][c] = (v16f){0};
        for (i64 j = lo; j <= hi; j++) {
            if (j + AHEAD <= hi) prefetch_row(v + (j + AHEAD) * H, H);
            const float *vj = v + j * H;
            v16f vr[4] = {LOAD(v16f, vj), LOAD(v16f, vj + 16), LOAD(v16f, vj + 32), LOAD(v16f, vj + 48)};
            for (i64 e = 0; e < E; e++) {
                float w = p[e * S + j] / sum[e];
                v16f wv = (v16f){0} + w;
                for (int c = 0; c < 4; c++) acc[e][c] = acc[e][c] + wv * vr[c];
            }
        }
        for (i64 e = 0; e < E; e++) memcpy(qu[e].o, acc[e], sizeof(float) * 64);
        return;
    }
    float acc[QGROUP * 512]; /* E * H <= QGROUP * 512 */
    for (i64 i = 0; i < E * H; i++) acc[i] = 0.f;
    for (i64 j = lo; j <= hi; j++) {
        if (j + AHEAD <= hi) prefetch_row(v + (j + AHEAD) * H, H);
        const float *vj = v + j * H;
        for (i64 e = 0; e < E; e++) {
            float w = p[e * S + j] / sum[e], *ae = acc + e * H;
            for (i64 h = 0; h < H; h++) ae[h] += w * vj[h];
        }
    }
    for (i64 e = 0; e < E; e++) memcpy(qu[e].o, acc + e * H, sizeof(float) * (size_t)H);
}
#undef SEEN
#undef SEES
#undef VIS

static void attend(const i64 *dims, const float *qkv, const float *kc, const float *vc, i64 window,
                   const i64 *steps, const i64 *pad, const i64 *tree, float scale, float *out) {
    i64 B = dims[0], T = dims[1], N = dims[3], K = dims[4], H = dims[5], S = dims[7];
    i64 QKV = (N + 2 * K) * H, G = N / K, Q = T * G; /* a K/V head's queries: T rows x G heads */
    int threads = (int)dims[8];
    /* groups of at most QGROUP queries, and at least two tasks a thread where there are queries enough
       (3 K/V heads and 2 threads: a one-token step's 3 queries a head go as 2 + 1) */
    i64 chunks = (Q + QGROUP - 1) / QGROUP, want = (2 * threads + B * K - 1) / (B * K);
    if (chunks < want) chunks = want < Q ? want : Q;
    i64 C = (Q + chunks - 1) / chunks;
    chunks = (Q + C - 1) / C;
    i64 tasks = B * K * chunks;
#pragma omp parallel num_threads(threads)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(S * C));
        Query qu[QGROUP];
#pragma omp for schedule(static)
        for (i64 task = 0; task < tasks; task++) {
            i64 b = task / (K * chunks), g = task / chunks % K, c0 = task % chunks * C;
            i64 E = Q - c0 < C ? Q - c0 : C;
            for (i64 e = 0; e < E; e++) {
                i64 t = (c0 + e) / G, n = g * G + (c0 + e) % G, m = b * T + t, qs = steps[t];
                qu[e] = (Query){qkv + m * QKV + n * H, out + m * N * H + n * H,
                                window > 0 && qs - window + 1 > 0 ? qs - window + 1 : 0, qs,
                                tree ? (unsigned long long)tree[t] : ~0ULL};
            }
            const float *k = kc + (b * K + g) * S * H, *v = vc + (b * K + g) * S * H;
            i64 base = tree ? steps[0] : INT64_MAX;
#define ATTEND(E_, H_) attend_queries(qu, E_, k, v, pad[b], base, scale, p, S, H_)
            if (H == 64) {
                switch (E) {
                case 1: ATTEND(1, 64); break;
                case 2: ATTEND(2, 64); break;
                case 3: ATTEND(3, 64); break;
                case 4: ATTEND(4, 64); break;
                case 5: ATTEND(5, 64); break;
                default: ATTEND(6, 64);
                }
            } else if (H == 128) {
                switch (E) {
                case 1: ATTEND(1, 128); break;
                case 2: ATTEND(2, 128); break;
                default: ATTEND(E, 128);
                }
            } else {
                ATTEND(E, H);
            }
#undef ATTEND
        }
        free(p);
    }
}

/* The rows' layout: static (B rows of T tokens, a [B, K, S, H] cache per layer) or paged. */
typedef struct {
    const i64 *dims;                /* static: {B, T, D, N, K, H, F, S, threads} */
    const i64 *steps, *pad;         /* static: the T new steps (cache slots), the rows' left padding */
    const i64 *tree;                /* static, a tree pass: each new step's ancestors as bits, or NULL */
    const i64 *pos, *slot, *seq;    /* paged: per row its step, its slot, its sequence */
    const i64 *tables;              /* paged: [sequences, n_blocks] block tables */
    i64 n_blocks, bs;
    i64 *keys, *first;              /* paged, made by layers_body: row m's step j at slot keys[first[m] + j] */
} Rows;

/* x [M, D] (updated in place) through every layer; cos, sin [M, H] (the rows' rotary angles). */
static int layers_body(Rows *r, i64 M, i64 D, i64 N, i64 K, i64 H, i64 F, int threads, const i64 *layers,
                       i64 n_layers, float eps, float scale, float *x, const float *cos, const float *sin,
                       const float *cos_local, const float *sin_local) {
    i64 QKV = (N + 2 * K) * H, widest = QKV > 2 * F ? QKV : 2 * F;
    if (H > 512) return -1;
    float *h = malloc(sizeof(float) * (size_t)(M * D)), *qkv = malloc(sizeof(float) * (size_t)(M * QKV));
    float *att = malloc(sizeof(float) * (size_t)(M * N * H)), *gu = malloc(sizeof(float) * (size_t)(M * 2 * F));
    float *a = malloc(sizeof(float) * (size_t)(M * F)), *y = malloc(sizeof(float) * (size_t)(M * D));
    float *tmp = malloc(sizeof(float) * (size_t)(M * widest)); /* a separate q, k, v, gate or up's output */
    int ok = h && qkv && att && gu && a && y && tmp;
    if (ok && !r->dims) { /* every row's key slots, once for all the layers (tables do not change) */
        i64 total = 0;
        for (i64 m = 0; m < M; m++) total += r->pos[m] + 1;
        r->keys = malloc(sizeof(i64) * (size_t)total), r->first = malloc(sizeof(i64) * (size_t)M);
        ok = r->keys && r->first;
        for (i64 m = 0, at = 0; ok && m < M; m++) {
            const i64 *table = r->tables + r->seq[m] * r->n_blocks;
            r->first[m] = at;
            for (i64 j = 0; j <= r->pos[m]; j++) r->keys[at++] = table[j / r->bs] * r->bs + j % r->bs;
        }
    }
    double t = profiling ? omp_get_wtime() : 0;
    for (i64 l = 0; ok && l < n_layers; l++) {
        const i64 *L = layers + l * LAYER_FIELDS, *P = L + LAYER_HEAD, flags = L[9];
        const float *post_attn = (const float *)L[7], *post_mlp = (const float *)L[8];
        float *kc = (float *)L[2], *vc = (float *)L[3];
        if ((flags & LOCAL_ROPE) && !(cos_local && sin_local)) {
            ok = 0; /* the caller passed no second table */
            break;
        }
        const float *cos_l = flags & LOCAL_ROPE ? cos_local : cos, *sin_l = flags & LOCAL_ROPE ? sin_local : sin;
        rmsnorm(x, (const float *)L[0], h, M, D, eps);
        phase(P_NORMS, &t);
        linear_parts(P + S_Q * LIN_FIELDS, 3, h, M, D, qkv, QKV, tmp, threads);
        phase(P_QKV, &t);
        const float *qn = (const float *)L[5], *kn = (const float *)L[6];
        if (qn && kn) { /* QK-norm: each query head, then each key head, normalized over its H dims */
            for (i64 m = 0; m < M; m++) {
                float *row = qkv + m * QKV;
                rmsnorm(row, qn, row, N, H, eps);
                rmsnorm(row + N * H, kn, row + N * H, K, H, eps);
            }
            phase(P_NORMS, &t);
        }
        for (i64 m = 0; m < M; m++) {
            float *row = qkv + m * QKV;
            const float *c = cos_l + m * H, *s = sin_l + m * H;
            for (i64 n = 0; n < N + K; n++) rope(row + n * H, c, s, H); /* the queries, then the keys */
            for (i64 g = 0; g < K; g++) {
                i64 at;
                if (r->dims) {
                    i64 S = r->dims[7], T = r->dims[1], b = m / T;
                    at = ((b * K + g) * S + r->steps[m % T]) * H;
                } else {
                    at = (r->slot[m] * K + g) * H;
                }
                memcpy(kc + at, row + (N + g) * H, sizeof(float) * (size_t)H);
                memcpy(vc + at, row + (N + K + g) * H, sizeof(float) * (size_t)H);
            }
        }
        phase(P_ROPE, &t); /* with the cache writes */
        if (r->dims)
            attend(r->dims, qkv, kc, vc, L[4], r->steps, r->pad, r->tree, scale, att);
        else
            attend_paged(M, N, K, H, qkv, kc, vc, L[4], r->pos, r->keys, r->first, scale, threads, att);
        phase(P_ATTEND, &t);
        linear(P + S_O * LIN_FIELDS, att, M, N * H, y, threads);
        phase(P_O, &t);
        if (post_attn) { /* Gemma 3's sandwich: the branch's output normalized before the residual */
            rmsnorm(y, post_attn, y, M, D, eps);
            phase(P_NORMS, &t);
        }
        for (i64 i = 0; i < M * D; i++) x[i] = x[i] + y[i];
        phase(P_RESIDUAL, &t);
        rmsnorm(x, (const float *)L[1], h, M, D, eps);
        phase(P_NORMS, &t);
        linear_parts(P + S_GATE * LIN_FIELDS, 2, h, M, D, gu, 2 * F, tmp, threads);
        phase(P_GATEUP, &t);
        if (flags & GELU_TANH)
            gelu_mul(gu, M, F, a);
        else
            cs336_silu_mul(gu, M, F, a, threads);
        phase(P_SILU, &t);
        linear(P + S_DOWN * LIN_FIELDS, a, M, F, y, threads);
        phase(P_DOWN, &t);
        if (post_mlp) {
            rmsnorm(y, post_mlp, y, M, D, eps);
            phase(P_NORMS, &t);
        }
        for (i64 i = 0; i < M * D; i++) x[i] = x[i] + y[i];
        phase(P_RESIDUAL, &t);
    }
    free(h), free(qkv), free(att), free(gu), free(a), free(y), free(tmp);
    if (!r->dims) free(r->keys), free(r->first);
    return ok ? 0 : -1;
}

/* x [B*T, D] (updated in place) through every layer; cos, sin [B, T, H] (the rows' rotary angles; the
   sliding layers' own in dims[9], dims[10] where the model has a second table);
   steps [T] (the new tokens' steps = cache slots); pad [B]. Returns 0, or -1 if out of memory. */
int cs336_layers(const i64 *dims, const i64 *layers, i64 n_layers, float eps, float scale, float *x,
                 const float *cos, const float *sin, const i64 *steps, const i64 *pad) {
    Rows r = {dims, steps, pad, NULL, NULL, NULL, NULL, NULL, 0, 0, NULL, NULL};
    return layers_body(&r, dims[0] * dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], (int)dims[8], layers,
                       n_layers, eps, scale, x, cos, sin, (const float *)dims[9], (const float *)dims[10]);
}

/* cs336_layers for a tree of T <= 64 drafts (speculative_tree.py): new step steps[0] + i is node i,
   which attends to the steps before steps[0] and to the nodes whose bits tree[i] sets (its ancestors
   and itself); cos and sin carry the nodes' positions (their depths), not their steps. */
int cs336_layers_tree(const i64 *dims, const i64 *layers, i64 n_layers, float eps, float scale, float *x,
                      const float *cos, const float *sin, const i64 *steps, const i64 *pad, const i64 *tree) {
    if (dims[1] > 64) return -1;
    Rows r = {dims, steps, pad, tree, NULL, NULL, NULL, NULL, 0, 0, NULL, NULL};
    return layers_body(&r, dims[0] * dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], (int)dims[8], layers,
                       n_layers, eps, scale, x, cos, sin, (const float *)dims[9], (const float *)dims[10]);
}

/* The serving engine's step: M rows, each a new token of some sequence, over paged K/V stores.
   dims {M, D, N, K, H, F, n_blocks (columns of tables), block size, threads, cos_local, sin_local ([M, H]
   pointers, 0: none)}; rows [3, M]: each row's
   step, slot (block * bs + offset, where its K/V are written) and sequence (its row of tables).
   Layers as cs336_layers, their k and v caches being the paged stores. Returns 0, or -1. */
int cs336_layers_paged(const i64 *dims, const i64 *layers, i64 n_layers, float eps, float scale, float *x,
                       const float *cos, const float *sin, const i64 *rows, const i64 *tables) {
    i64 M = dims[0];
    Rows r = {NULL, NULL, NULL, NULL, rows, rows + M, rows + 2 * M, tables, dims[6], dims[7], NULL, NULL};
    return layers_body(&r, M, dims[1], dims[2], dims[3], dims[4], dims[5], (int)dims[8], layers, n_layers, eps,
                       scale, x, cos, sin, (const float *)dims[9], (const float *)dims[10]);
}
