/* server._cpu_kernels' attention: attention and attention_many over a float16 K/V cache of one KV head
(a chain of rows or a token tree), with portable scalar, AVX2 and AVX-512 code that give each output
the same bits whatever the rows, the threads or the way a call's work is split. The contract (dot16,
exp_sf, the key order) is at the top of _cpu_kernels.c. */
#include "_cpu_kernels.h"

/* ---------------------------------------------------------------------------------------------
   attention */

typedef struct {
    const float *q;
    const uint16_t *k, *v;  /* float16 */
    const int64_t *pos;
    const uint64_t *ancestors;  /* NULL: a chain; else each row's ancestor bits over the step's slots */
    float *out, *scratch;
    Py_ssize_t M, H, D, T, scratch_per_part, tree_start;
    Py_ssize_t S;  /* the most keys a row attends to: the scratch's stride per row */
    long long window;
    float scale;
    int simd;
} AttnCtx;

/* The keys row m attends to, in position order: `n_run` cache slots from `start` on (contiguous),
   then the step slots extra[0..n_extra-1] (a tree row's visible ancestors and itself). */
typedef struct {
    Py_ssize_t start, n_run, n_extra, n;
    Py_ssize_t extra[64];
} KeyList;

static void attn_keys(const AttnCtx *c, Py_ssize_t m, KeyList *keys) {
    const Py_ssize_t pos = (Py_ssize_t)c->pos[m];
    Py_ssize_t start = 0;
    if (c->window > 0 && pos - c->window + 1 > 0) start = (Py_ssize_t)(pos - c->window + 1);
    keys->start = start;
    keys->n_extra = 0;
    if (c->ancestors == NULL) {
        keys->n_run = pos - start + 1;
    } else {  /* the k-th set bit is the ancestor at depth k, i.e. at position tree_start + k */
        const Py_ssize_t s = c->tree_start;
        keys->n_run = start < s ? s - start : 0;
        uint64_t bits = c->ancestors[m];
        for (Py_ssize_t depth = 0; bits; depth++, bits &= bits - 1)
            if (s + depth >= start) keys->extra[keys->n_extra++] = s + __builtin_ctzll(bits);
    }
    keys->n = keys->n_run + keys->n_extra;
}

static inline Py_ssize_t key_slot(const KeyList *keys, Py_ssize_t p) {
    return p < keys->n_run ? keys->start + p : keys->extra[p - keys->n_run];
}

/* exp_sf, the softmax's exponential, and exp_sf_avx2 are in _cpu_kernels.h (gelu_mul uses them too). */

/* In place: s[p * stride] -> exp_sf(s - max) for p < n; returns their sum in position order. */
static float softmax_weights(float *s, Py_ssize_t n, Py_ssize_t stride) {
    float mx = s[0];
    for (Py_ssize_t p = 1; p < n; p++)
        if (s[p * stride] > mx) mx = s[p * stride];
    float sum = 0.0f;
    for (Py_ssize_t p = 0; p < n; p++) {
        float e = exp_sf(s[p * stride] - mx);
        s[p * stride] = e;
        sum += e;
    }
    return sum;
}

/* A float16's exact value as a float (the K/V cache is float16; F16C's vcvtph2ps gives the same). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) v.u = sign | 0x7f800000u | (man << 13);      /* inf, nan */
    else if (exp) v.u = sign | ((exp + 112) << 23) | (man << 13);  /* normal */
    else {                                                          /* zero, subnormal: man * 2^-24, exact */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

/* dot16 of the contract: 16 lanes (lane d % 16) of fma chains, then u_i = l_i + l_{i+8}, tree8(u). */
static float dot16_scalar(const float *a, const uint16_t *b, Py_ssize_t D) {
    float l[16] = {0};
    for (Py_ssize_t d = 0; d < D; d++) l[d % 16] = fmaf(a[d], half_to_float(b[d]), l[d % 16]);
    float u[8];
    for (int i = 0; i < 8; i++) u[i] = l[i] + l[i + 8];
    return tree8(u);
}

/* One (m, h) pair by the contract's definition; scratch holds n + D floats. */
static void attend_scalar(const AttnCtx *c, Py_ssize_t m, Py_ssize_t h, float *scratch) {
    KeyList keys;
    attn_keys(c, m, &keys);
    const Py_ssize_t D = c->D, n = keys.n;
    const float *q = c->q + (m * c->H + h) * D;
    float *s = scratch, *acc = scratch + n, *out = c->out + (m * c->H + h) * D;
    for (Py_ssize_t p = 0; p < n; p++) s[p] = dot16_scalar(q, c->k + key_slot(&keys, p) * D, D) * c->scale;
    float sum = softmax_weights(s, n, 1);
    for (Py_ssize_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (Py_ssize_t p = 0; p < n; p++) {
        const uint16_t *vp = c->v + key_slot(&keys, p) * D;
        for (Py_ssize_t d = 0; d < D; d++) acc[d] = fmaf(s[p], half_to_float(vp[d]), acc[d]);
    }
    for (Py_ssize_t d = 0; d < D; d++) out[d] = acc[d] / sum;
}

#if HAVE_X86
/* The attention's AVX2 code also converts the float16 cache (F16C, which every AVX2 CPU has). */
#define AVX2H __attribute__((target("avx2,fma,f16c")))

/* 8 float16 values as floats. */
AVX2H static inline __m256 load8h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* softmax_weights for 4 heads at once, scores laid out [p][head] (4 * n floats): each head's max,
   then exp_sf(s - max) in place, and each head's sum in position order (lane j of the sums adds
   head j's weights p = 0, 1, ... in turn), as softmax_weights(s + j, n, 4) gives for head j. */
AVX2 static void softmax4_weights_avx2(float *s, Py_ssize_t n, float sum[4]) {
    __m128 mx = _mm_loadu_ps(s);
    for (Py_ssize_t p = 1; p < n; p++) mx = _mm_max_ps(mx, _mm_loadu_ps(s + 4 * p));
    /* max is exact whatever the order; _mm_max_ps(a, b) returns b on a tie of +0/-0 only, and
       s - max is then 0 either way */
    const __m256 mx8 = _mm256_set_m128(mx, mx);
    __m128 acc = _mm_setzero_ps();
    Py_ssize_t p = 0;
    for (; p + 2 <= n; p += 2) {
        const __m256 e = exp_sf_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + 4 * p), mx8));
        _mm256_storeu_ps(s + 4 * p, e);
        acc = _mm_add_ps(acc, _mm256_castps256_ps128(e));
        acc = _mm_add_ps(acc, _mm256_extractf128_ps(e, 1));
    }
    if (p < n) {
        const __m256 e = exp_sf_avx2(_mm256_sub_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + 4 * p)), mx8));
        _mm_storeu_ps(s + 4 * p, _mm256_castps256_ps128(e));
        acc = _mm_add_ps(acc, _mm256_castps256_ps128(e));
    }
    _mm_storeu_ps(sum, acc);
}

/* The scores of 4 query heads q[0..3] against key row kp, times scale, into out[0..3] (dot16 each:
   its two 8-lane halves added, then tree8 through the hadds, as in tile4_avx2).
   Per head, two 8-lane fma chains over d = 0, 16, 32, ... (lanes d..d+7) and d + 8 (lanes d+8..d+15),
   added: dot16's halves. The key's 16 values of each step are converted once for the 4 heads (a chain
   pair per head converting its own copy took 4 conversions where 1 does: on AVX2 cores without AVX-512
   the conversions set the pace); the chains are the same FMAs in the same order, so the same bits. */
AVX2H static inline void score4(const float *const q[4], const uint16_t *kp, Py_ssize_t D, __m128 scale, float *out) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (Py_ssize_t d = 0; d < D; d += 16) {
        const __m256 k0 = load8h(kp + d), k1 = load8h(kp + d + 8);
        for (int j = 0; j < 4; j++) {
            a[2 * j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + d), k0, a[2 * j]);
            a[2 * j + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + d + 8), k1, a[2 * j + 1]);
        }
    }
    __m256 u0 = _mm256_add_ps(a[0], a[1]), u1 = _mm256_add_ps(a[2], a[3]);
    __m256 u2 = _mm256_add_ps(a[4], a[5]), u3 = _mm256_add_ps(a[6], a[7]);
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(u0, u1), _mm256_hadd_ps(u2, u3));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(out, _mm_mul_ps(r, scale));
}

/* One key's step of 4 heads' output chains over 16 values: a[2j], a[2j + 1] = fma(e[j], v[0..15], .). */
AVX2H static inline void accumulate4(__m256 a[8], const float *e, const uint16_t *vp) {
    const __m256 v0 = load8h(vp), v1 = load8h(vp + 8);
    for (int j = 0; j < 4; j++) {
        const __m256 ej = _mm256_broadcast_ss(e + j);
        a[2 * j] = _mm256_fmadd_ps(ej, v0, a[2 * j]);
        a[2 * j + 1] = _mm256_fmadd_ps(ej, v1, a[2 * j + 1]);
    }
}

/* Heads h..h+G-1 (G <= 4) of row m, which share each K and V row read: four heads are always
   computed (a short group repeats its last head) and only the G real ones stored. Each head's
   arithmetic is attend_scalar's. scratch holds 4 * n floats, scores laid out [p][head]. */
AVX2H static void attend4_avx2(const AttnCtx *c, Py_ssize_t m, Py_ssize_t h, int G, float *scratch) {
    KeyList keys;
    attn_keys(c, m, &keys);
    const Py_ssize_t D = c->D, n = keys.n;
    const float *q[4];
    for (int j = 0; j < 4; j++) q[j] = c->q + (m * c->H + h + (j < G ? j : G - 1)) * D;
    float *s = scratch;
    const __m128 scale = _mm_set1_ps(c->scale);
    for (Py_ssize_t p = 0; p < n; p++) score4(q, c->k + key_slot(&keys, p) * D, D, scale, s + 4 * p);
    float sum[4];
    softmax4_weights_avx2(s, n, sum);  /* a short group's repeated head is computed too, and not stored */
    for (Py_ssize_t d = 0; d < D; d += 16) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (Py_ssize_t p = 0; p < n; p++) accumulate4(a, s + 4 * p, c->v + key_slot(&keys, p) * D + d);
        for (int j = 0; j < G; j++) {
            float *out = c->out + (m * c->H + h + j) * D + d;
            const __m256 vs = _mm256_set1_ps(sum[j]);
            _mm256_storeu_ps(out, _mm256_div_ps(a[2 * j], vs));
            _mm256_storeu_ps(out + 8, _mm256_div_ps(a[2 * j + 1], vs));
        }
    }
}
#endif

/* The plan (attn_plan) names these on every CPU; only the x86 code below runs with them. */
#define LONG_RUN_KEYS 1024  /* a chain's rows over at least this many keys are split by keys and values */
#define ATTN_BLOCK 32  /* keys per block: 32 KB of K or of V at D = 256, still in L1/L2 for the next row */
#define ROWS_512 16  /* rows per attend_rows_512 call (a 16-token verify's rows in one or two calls) */
/* The rows code reads the cache this many keys ahead of the key it works on (software prefetch,
   never past the last key of the rows' span). A key's float16 K or V row is D * 2 bytes, so the
   cache streams from memory at the pace of the arithmetic instead of a cache miss at a time: the
   hardware prefetcher alone fell behind. The rows code on one row over 32k keys, one thread: about
   5.4 ms without, 3.5-4.3 with; 64-512 keys ahead about alike, 128 best of them; a whole block
   prefetched at each block's start did not help. Where data goes changes no result. */
#define PREFETCH_KEYS 128
/* On AVX2, attend_split_rows for up to this many rows over a long run of keys; more rows take whole
   rows a thread (attn_part), faster there (2 threads of an AVX2-only Zen 2, 32k keys: 8 rows 10.8
   against 17.5 ms split, 16 rows 19.5 against 30.7; 2 and 3 rows 4.2 and 5.0 split against 9.1 and
   18 split by (row, head)) */
#define AVX2_SPLIT_ROWS 3

#if HAVE_X86

/* Rows m..m+R-1 of a chain (R <= ROWS_512), as both attend_rows codes walk them: row r attends to
   keys first[r]..last[r], and lo..hi spans them all; q[r] are its 4 query heads (a short group
   repeats its last head); s[r] its scores in scratch, 4 * S floats a row, laid out [p][head]. */
typedef struct {
    Py_ssize_t first[ROWS_512], last[ROWS_512], lo, hi;
    const float *q[ROWS_512][4];
    float *s[ROWS_512];
} ChainRows;

static void chain_rows(const AttnCtx *c, Py_ssize_t m, int R, float *scratch, ChainRows *cr) {
    cr->lo = c->T;
    cr->hi = -1;
    for (int r = 0; r < R; r++) {
        KeyList keys;
        attn_keys(c, m + r, &keys);
        cr->first[r] = keys.start;
        cr->last[r] = keys.start + keys.n - 1;
        if (cr->first[r] < cr->lo) cr->lo = cr->first[r];
        if (cr->last[r] > cr->hi) cr->hi = cr->last[r];
        for (int j = 0; j < 4; j++) cr->q[r][j] = c->q + ((m + r) * c->H + (j < c->H ? j : c->H - 1)) * c->D;
        cr->s[r] = scratch + r * 4 * c->S;
    }
}


/* Prefetch values dlo..dhi-1 of keys lo..hi of a float16 cache. */
static inline void prefetch_keys(const uint16_t *cache, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t D, Py_ssize_t dlo,
                                 Py_ssize_t dhi) {
    for (Py_ssize_t p = lo; p <= hi; p++) {
        const char *row = (const char *)(cache + p * D);
        for (Py_ssize_t off = dlo * 2; off < dhi * 2; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
    }
}

/* Prefetch values dlo..dhi-1 of the cache's key p + PREFETCH_KEYS, if that key is at most hi (the
   last key the loop reads). Where every row walks the keys (AVX2's scores, both values phases) only
   the last row, whose keys reach furthest, prefetches ahead: once a line, not once a row (20 rows
   over 1k keys were slower prefetching in every row's walk). */
static inline void prefetch_ahead(const uint16_t *cache, Py_ssize_t p, Py_ssize_t hi, Py_ssize_t D, Py_ssize_t dlo,
                                  Py_ssize_t dhi) {
    if (p + PREFETCH_KEYS <= hi) prefetch_keys(cache, p + PREFETCH_KEYS, p + PREFETCH_KEYS, D, dlo, dhi);
}

/* Prefetch values dlo..dhi-1 of keys lo..hi, at most the first PREFETCH_KEYS of them: what
   prefetch_ahead never covers, read first (a sliding layer's 512 keys are only four times as many). */
static inline void prefetch_first(const uint16_t *cache, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t D, Py_ssize_t dlo,
                                  Py_ssize_t dhi) {
    prefetch_keys(cache, lo, lo + PREFETCH_KEYS - 1 < hi ? lo + PREFETCH_KEYS - 1 : hi, D, dlo, dhi);
}

/* The values phases' accumulators (acc[(r * 4 + j) * D + d], rows r < R, heads j < 4) zeroed over
   d = dlo..dhi-1: each element's fma chain starts from +0. */
static inline void zero_rows_acc(float *acc, int R, Py_ssize_t D, Py_ssize_t dlo, Py_ssize_t dhi) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            for (Py_ssize_t d = dlo; d < dhi; d++) acc[(r * 4 + j) * D + d] = 0.0f;
}

/* The two phases of attend_rows_avx2 (below), each over part of the work, as rows_scores_512 /
   rows_values_512 cut AVX-512's: the scores of keys klo..khi (of the rows' span lo..hi), a block of
   ATTN_BLOCK keys at a time for all the rows (each row converting the float16 keys itself: a
   converted block, as AVX-512 keeps, was slower here); the values d = dlo..dhi-1 (multiples of 16) of every row's heads over all its keys, each output
   element's fma chain in position order from +0, paused at block ends with its accumulator (acc:
   4 * R * D floats, acc[(r * 4 + j) * D + d]) stored and reloaded exactly, then divided by the
   head's sum. So a score or an output element is attend4_avx2's bit for bit, whichever part or
   thread computes it (attend_split_rows splits both phases between threads). */
AVX2H static void rows_scores_avx2(const AttnCtx *c, const ChainRows *cr, int R, Py_ssize_t klo, Py_ssize_t khi) {
    const Py_ssize_t D = c->D;
    const __m128 scale = _mm_set1_ps(c->scale);
    prefetch_first(c->k, klo, khi, D, 0, D);
    for (Py_ssize_t b = klo; b <= khi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < khi ? b + ATTN_BLOCK - 1 : khi;
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > cr->first[r] ? b : cr->first[r], pb = bend < cr->last[r] ? bend : cr->last[r];
            for (Py_ssize_t p = pa; p <= pb; p++) {
                if (r == R - 1) prefetch_ahead(c->k, p, khi, D, 0, D);
                score4(cr->q[r], c->k + p * D, D, scale, cr->s[r] + 4 * (p - cr->first[r]));
            }
        }
    }
}

AVX2H static void rows_values_avx2(const AttnCtx *c, const ChainRows *cr, Py_ssize_t m, int R,
                                   const float (*sum)[4], Py_ssize_t dlo, Py_ssize_t dhi, float *acc) {
    const Py_ssize_t D = c->D, H = c->H;
    prefetch_first(c->v, cr->lo, cr->hi, D, dlo, dhi);
    zero_rows_acc(acc, R, D, dlo, dhi);
    for (Py_ssize_t b = cr->lo; b <= cr->hi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < cr->hi ? b + ATTN_BLOCK - 1 : cr->hi;
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > cr->first[r] ? b : cr->first[r], pb = bend < cr->last[r] ? bend : cr->last[r];
            if (pa > pb) continue;
            float *ar = acc + r * 4 * D;
            const float *sr = cr->s[r] + 4 * (pa - cr->first[r]);
            for (Py_ssize_t d = dlo; d < dhi; d += 16) {
                __m256 a[8];
                for (int j = 0; j < 4; j++) {
                    a[2 * j] = _mm256_loadu_ps(ar + j * D + d);
                    a[2 * j + 1] = _mm256_loadu_ps(ar + j * D + d + 8);
                }
                for (Py_ssize_t p = pa; p <= pb; p++) {
                    if (r == R - 1) prefetch_ahead(c->v, p, cr->hi, D, d, d + 16);
                    accumulate4(a, sr + 4 * (p - pa), c->v + p * D + d);
                }
                for (int j = 0; j < 4; j++) {
                    _mm256_storeu_ps(ar + j * D + d, a[2 * j]);
                    _mm256_storeu_ps(ar + j * D + d + 8, a[2 * j + 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < H; j++) {
            const float *ar = acc + (r * 4 + j) * D;
            float *out = c->out + ((m + r) * H + j) * D;
            const __m256 vs = _mm256_set1_ps(sum[r][j]);
            for (Py_ssize_t d = dlo; d < dhi; d += 8) _mm256_storeu_ps(out + d, _mm256_div_ps(_mm256_loadu_ps(ar + d), vs));
        }
}

/* Rows m..m+R-1 (R <= 4) of a chain (no tree), all H <= 4 heads of each, on one thread: for every
   (row, head) the very arithmetic of attend4_avx2 (the phases above). Every row works through a
   block of keys before the next block is read: a verify's rows share nearly all their keys, so the
   cache is read from memory once for R rows instead of R times. scratch: 16 * S floats of scores
   and 16 * D of accumulators. */
AVX2H static void attend_rows_avx2(const AttnCtx *c, Py_ssize_t m, int R, float *scratch) {
    ChainRows cr;
    chain_rows(c, m, R, scratch, &cr);
    rows_scores_avx2(c, &cr, R, cr.lo, cr.hi);
    float sum[4][4];
    for (int r = 0; r < R; r++) softmax4_weights_avx2(cr.s[r], cr.last[r] - cr.first[r] + 1, sum[r]);
    rows_values_avx2(c, &cr, m, R, (const float (*)[4])sum, 0, c->D, scratch + 16 * c->S);
}
#endif

#if HAVE_X86
/* The attention's AVX-512 code: the same arithmetic on 16-lane registers. A 16-lane fma chain over
   d = i, i + 16, ... holds dot16's lanes l_0..l_15 at once (AVX2 keeps them in two 8-lane halves),
   and each output element's fma chain over keys is the same whatever the vector holding it, so every
   value equals the AVX2 and scalar code's bit for bit (tests/test_cpu_kernels.py compares the paths).
   Zen 5 and recent Intel cores issue two 16-lane FMAs a cycle, twice AVX2's lanes. */
/* AVX512H, these functions' target attribute, is in _cpu_kernels.h (rms_norm's AVX-512 code uses it too). */

/* 16 float16 values as floats. */
AVX512H static inline __m512 load16h(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* score4's ending: per head, u = l[0..7] + l[8..15], then tree8 through the hadds, times scale. */
AVX512H static inline void finish_score4(const __m512 a[4], __m128 scale, float *out) {
    __m256 u[4];
    for (int j = 0; j < 4; j++)
        u[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(u[0], u[1]), _mm256_hadd_ps(u[2], u[3]));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(out, _mm_mul_ps(r, scale));
}

/* score4 for keys k0 and k1 at once (8 independent chains keep both FMA pipes busy). */
AVX512H static inline void score4x2_512(const float *const q[4], const uint16_t *k0, const uint16_t *k1, Py_ssize_t D,
                                        __m128 scale, float *out0, float *out1) {
    __m512 a0[4], a1[4];
    for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm512_setzero_ps();
    for (Py_ssize_t d = 0; d < D; d += 16) {
        const __m512 x0 = load16h(k0 + d), x1 = load16h(k1 + d);
        for (int j = 0; j < 4; j++) {
            const __m512 qv = _mm512_loadu_ps(q[j] + d);
            a0[j] = _mm512_fmadd_ps(qv, x0, a0[j]);
            a1[j] = _mm512_fmadd_ps(qv, x1, a1[j]);
        }
    }
    finish_score4(a0, scale, out0);
    finish_score4(a1, scale, out1);
}

/* One key's scores of 4 heads (q, D, scale, out in scope), the key's values d..d+15 as LOAD_KEY(d). */
#define SCORE4_512(LOAD_KEY)                                                                              \
    __m512 a[4];                                                                                          \
    for (int j = 0; j < 4; j++) a[j] = _mm512_setzero_ps();                                               \
    for (Py_ssize_t d = 0; d < D; d += 16) {                                                              \
        const __m512 x = LOAD_KEY(d);                                                                     \
        for (int j = 0; j < 4; j++) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q[j] + d), x, a[j]);           \
    }                                                                                                     \
    finish_score4(a, scale, out);

AVX512H static inline void score4_512(const float *const q[4], const uint16_t *kp, Py_ssize_t D, __m128 scale, float *out) {
#define HALF_KEY(d) load16h(kp + (d))
    SCORE4_512(HALF_KEY)
#undef HALF_KEY
}

/* Scores of keys pa..pb (cache slots through the key list) into s[4 * (p - p0)]. */
AVX512H static void score_run_512(const AttnCtx *c, const KeyList *keys, const float *const q[4], Py_ssize_t pa,
                                  Py_ssize_t pb, Py_ssize_t p0, float *s) {
    const Py_ssize_t D = c->D;
    const __m128 scale = _mm_set1_ps(c->scale);
    Py_ssize_t p = pa;
    for (; p + 1 <= pb; p += 2)
        score4x2_512(q, c->k + key_slot(keys, p) * D, c->k + key_slot(keys, p + 1) * D, D, scale,
                     s + 4 * (p - p0), s + 4 * (p + 1 - p0));
    if (p <= pb) score4_512(q, c->k + key_slot(keys, p) * D, D, scale, s + 4 * (p - p0));
}

/* score4_512 against a key already converted to floats (the same values: the conversion is exact). */
AVX512H static inline void score4_f32_512(const float *const q[4], const float *kp, Py_ssize_t D, __m128 scale, float *out) {
#define FLOAT_KEY(d) _mm512_loadu_ps(kp + (d))
    SCORE4_512(FLOAT_KEY)
#undef FLOAT_KEY
}

/* The scores of 4 converted keys k[0..3] (4 heads each) into out + 4 * i: 16 independent chains a
   step, each query and key vector loaded once for 4 of them (score4x2_512 loads 6 and converts 2
   for 8). Each chain is dot16's, so every score is score4_512's bit for bit. */
AVX512H static inline void score4x4_f32_512(const float *const q[4], const float *k, Py_ssize_t D, __m128 scale,
                                            float *out) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
    for (Py_ssize_t d = 0; d < D; d += 16) {
        const __m512 x0 = _mm512_loadu_ps(k + d), x1 = _mm512_loadu_ps(k + D + d);
        const __m512 x2 = _mm512_loadu_ps(k + 2 * D + d), x3 = _mm512_loadu_ps(k + 3 * D + d);
        for (int j = 0; j < 4; j++) {
            const __m512 qv = _mm512_loadu_ps(q[j] + d);
            a[0][j] = _mm512_fmadd_ps(qv, x0, a[0][j]);
            a[1][j] = _mm512_fmadd_ps(qv, x1, a[1][j]);
            a[2][j] = _mm512_fmadd_ps(qv, x2, a[2][j]);
            a[3][j] = _mm512_fmadd_ps(qv, x3, a[3][j]);
        }
    }
    for (int i = 0; i < 4; i++) finish_score4(a[i], scale, out + 4 * i);
}

/* Scores of keys pa..pb of a block whose key p sits at kb + (p - b) * D (floats), into s[4 * (p - p0)]. */
AVX512H static void score_block_512(const float *const q[4], const float *kb, Py_ssize_t b, Py_ssize_t pa,
                                    Py_ssize_t pb, Py_ssize_t p0, Py_ssize_t D, __m128 scale, float *s) {
    Py_ssize_t p = pa;
    for (; p + 3 <= pb; p += 4) score4x4_f32_512(q, kb + (p - b) * D, D, scale, s + 4 * (p - p0));
    for (; p <= pb; p++) score4_f32_512(q, kb + (p - b) * D, D, scale, s + 4 * (p - p0));
}

/* One key's step of 4 heads' output chains over 32 values: a[2j], a[2j + 1] = fma(e[j], v[0..31], .). */
AVX512H static inline void accumulate4x32(__m512 a[8], const float *e, const uint16_t *vp) {
    const __m512 v0 = load16h(vp), v1 = load16h(vp + 16);
    for (int j = 0; j < 4; j++) {
        const __m512 ej = _mm512_set1_ps(e[j]);
        a[2 * j] = _mm512_fmadd_ps(ej, v0, a[2 * j]);
        a[2 * j + 1] = _mm512_fmadd_ps(ej, v1, a[2 * j + 1]);
    }
}

/* Values d..d+31 of the G real heads of row m (weights s, sums sum) over keys 0..n-1 of the list. */
AVX512H static void values_512(const AttnCtx *c, const KeyList *keys, Py_ssize_t m, Py_ssize_t h, int G,
                               const float *s, const float sum[4], Py_ssize_t d) {
    const Py_ssize_t D = c->D;
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (Py_ssize_t p = 0; p < keys->n; p++) accumulate4x32(a, s + 4 * p, c->v + key_slot(keys, p) * D + d);
    for (int j = 0; j < G; j++) {
        float *out = c->out + (m * c->H + h + j) * D + d;
        const __m512 vs = _mm512_set1_ps(sum[j]);
        _mm512_storeu_ps(out, _mm512_div_ps(a[2 * j], vs));
        _mm512_storeu_ps(out + 16, _mm512_div_ps(a[2 * j + 1], vs));
    }
}

/* attend4_avx2 on 16-lane registers (D % 32 == 0). */
AVX512H static void attend4_512(const AttnCtx *c, Py_ssize_t m, Py_ssize_t h, int G, float *scratch) {
    KeyList keys;
    attn_keys(c, m, &keys);
    const float *q[4];
    for (int j = 0; j < 4; j++) q[j] = c->q + (m * c->H + h + (j < G ? j : G - 1)) * c->D;
    score_run_512(c, &keys, q, 0, keys.n - 1, 0, scratch);
    float sum[4];
    softmax4_weights_avx2(scratch, keys.n, sum);
    for (Py_ssize_t d = 0; d < c->D; d += 32) values_512(c, &keys, m, h, G, scratch, sum, d);
}

/* The phases of attend_rows_512 over part of the work: the scores of keys klo..khi (of the rows'
   span lo..hi) with each block of keys converted to floats once (kb: ATTN_BLOCK * D floats) for all
   the rows (one row: each key converted as it is read, no kb); and the values d = dlo..dhi-1 of every row's heads over all its keys, each output
   element's fma chain in position order, paused at block ends with its accumulator (acc: 4 * R * D
   floats, acc[(r * 4 + j) * D + d]) stored and reloaded exactly, then divided by the head's sum. So
   a score or an output element is the same whichever part computes it. */
AVX512H static void rows_scores_512(const AttnCtx *c, const ChainRows *cr, int R, Py_ssize_t klo, Py_ssize_t khi,
                                    float *kb) {
    const Py_ssize_t D = c->D;
    const __m128 scale = _mm_set1_ps(c->scale);
    prefetch_first(c->k, klo, khi, D, 0, D);
    if (R == 1) {  /* one row: each key converted as it is read (a converted block pays where rows share it) */
        const Py_ssize_t pa = klo > cr->first[0] ? klo : cr->first[0], pb = khi < cr->last[0] ? khi : cr->last[0];
        float *s = cr->s[0];
        const Py_ssize_t f = cr->first[0];
        Py_ssize_t p = pa;
        for (; p + 1 <= pb; p += 2) {
            prefetch_ahead(c->k, p, khi, D, 0, D);
            prefetch_ahead(c->k, p + 1, khi, D, 0, D);
            score4x2_512(cr->q[0], c->k + p * D, c->k + (p + 1) * D, D, scale, s + 4 * (p - f), s + 4 * (p + 1 - f));
        }
        if (p <= pb) score4_512(cr->q[0], c->k + p * D, D, scale, s + 4 * (p - f));
        return;
    }
    for (Py_ssize_t b = klo; b <= khi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < khi ? b + ATTN_BLOCK - 1 : khi;
        for (Py_ssize_t p = b; p <= bend; p++) {
            prefetch_ahead(c->k, p, khi, D, 0, D);
            for (Py_ssize_t d = 0; d < D; d += 16) _mm512_storeu_ps(kb + (p - b) * D + d, load16h(c->k + p * D + d));
        }
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > cr->first[r] ? b : cr->first[r], pb = bend < cr->last[r] ? bend : cr->last[r];
            if (pa <= pb) score_block_512(cr->q[r], kb, b, pa, pb, cr->first[r], D, scale, cr->s[r]);
        }
    }
}

AVX512H static void rows_values_512(const AttnCtx *c, const ChainRows *cr, Py_ssize_t m, int R,
                                    const float (*sum)[4], Py_ssize_t dlo, Py_ssize_t dhi, float *acc) {
    const Py_ssize_t D = c->D, H = c->H;
    prefetch_first(c->v, cr->lo, cr->hi, D, dlo, dhi);
    zero_rows_acc(acc, R, D, dlo, dhi);
    for (Py_ssize_t b = cr->lo; b <= cr->hi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < cr->hi ? b + ATTN_BLOCK - 1 : cr->hi;
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > cr->first[r] ? b : cr->first[r], pb = bend < cr->last[r] ? bend : cr->last[r];
            if (pa > pb) continue;
            float *ar = acc + r * 4 * D;
            const float *sr = cr->s[r] + 4 * (pa - cr->first[r]);
            for (Py_ssize_t d = dlo; d < dhi; d += 32) {
                __m512 a[8];
                for (int j = 0; j < 4; j++) {
                    a[2 * j] = _mm512_loadu_ps(ar + j * D + d);
                    a[2 * j + 1] = _mm512_loadu_ps(ar + j * D + d + 16);
                }
                for (Py_ssize_t p = pa; p <= pb; p++) {
                    if (r == R - 1) prefetch_ahead(c->v, p, cr->hi, D, d, d + 32);
                    accumulate4x32(a, sr + 4 * (p - pa), c->v + p * D + d);
                }
                for (int j = 0; j < 4; j++) {
                    _mm512_storeu_ps(ar + j * D + d, a[2 * j]);
                    _mm512_storeu_ps(ar + j * D + d + 16, a[2 * j + 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < H; j++) {
            const float *ar = acc + (r * 4 + j) * D;
            float *out = c->out + ((m + r) * H + j) * D;
            const __m512 vs = _mm512_set1_ps(sum[r][j]);
            for (Py_ssize_t d = dlo; d < dhi; d += 16) _mm512_storeu_ps(out + d, _mm512_div_ps(_mm512_loadu_ps(ar + d), vs));
        }
}

/* attend_rows_avx2's rows on 16-lane registers (D % 32 == 0; the same bits), up to ROWS_512 rows
   m..m+R-1 of a chain: all of a part's rows meet each block of keys while it is in L1, so a long
   cache is read from memory once per part, not once per 4 rows, and converted to floats once for
   all of them.
   scratch: 4 * ROWS_512 * (S + D) + ATTN_BLOCK * D floats. */
AVX512H static void attend_rows_512(const AttnCtx *c, Py_ssize_t m, int R, float *scratch) {
    ChainRows cr;
    chain_rows(c, m, R, scratch, &cr);
    float *acc = scratch + 4 * ROWS_512 * c->S, *kb = acc + 4 * ROWS_512 * c->D;
    rows_scores_512(c, &cr, R, cr.lo, cr.hi, kb);
    float sum[ROWS_512][4];
    for (int r = 0; r < R; r++) softmax4_weights_avx2(cr.s[r], cr.last[r] - cr.first[r] + 1, sum[r]);
    rows_values_512(c, &cr, m, R, (const float (*)[4])sum, 0, c->D, acc);
}

/* Up to ROWS_512 rows of a chain over a long run of keys (a step or a verify deep into a
   conversation), split between threads: the scores by keys (each thread converting its own keys),
   the softmax by rows, the values by output elements, never inside a reduction, so each value is
   the rows code's. Every thread reads its share of the cache once for all the rows, where
   attn_part's split by rows has each part read all of it (two threads, four rows: the cache read
   twice, each thread at its own memory's pace), and its split by heads gives each of 2 threads 2 of
   a row's 4 heads (the rows code computes 4 whatever H: half its work wasted). One row took its own
   split before (the values of each 32 outputs over every key, the cache's rows read at a stride):
   at 32k keys, 2 threads, cold cache, 3.52 -> 2.42 ms with the prefetch. */
typedef struct {
    const AttnCtx *c;
    ChainRows cr;
    Py_ssize_t m;
    int R;
    float *acc, *kb, sum[ROWS_512][4];
} SplitRows;

static void split_rows_scores(void *ctx, int part, int nparts) {
    SplitRows *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->cr.hi - L->cr.lo + 1, ATTN_BLOCK, part, nparts, &lo, &hi);
    if (lo >= hi) return;
    if (L->c->simd == 2)  /* each thread converts its blocks of keys into its own kb */
        rows_scores_512(L->c, &L->cr, L->R, L->cr.lo + lo, L->cr.lo + hi - 1, L->kb + part * ATTN_BLOCK * L->c->D);
    else
        rows_scores_avx2(L->c, &L->cr, L->R, L->cr.lo + lo, L->cr.lo + hi - 1);
}

static void split_rows_softmax(void *ctx, int part, int nparts) {
    SplitRows *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->R, 1, part, nparts, &lo, &hi);
    for (Py_ssize_t r = lo; r < hi; r++) softmax4_weights_avx2(L->cr.s[r], L->cr.last[r] - L->cr.first[r] + 1, L->sum[r]);
}

static void split_rows_values(void *ctx, int part, int nparts) {
    SplitRows *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->c->D, 32, part, nparts, &lo, &hi);   /* AVX2 takes 16 at a time: D % 16 == 0 on both */
    if (lo >= hi) return;
    if (L->c->simd == 2) rows_values_512(L->c, &L->cr, L->m, L->R, (const float (*)[4])L->sum, lo, hi, L->acc);
    else rows_values_avx2(L->c, &L->cr, L->m, L->R, (const float (*)[4])L->sum, lo, hi, L->acc);
}

/* Rows m..m+R-1 (R <= ROWS_512) of c (a chain, H <= 4, AVX-512 or AVX2) split over `threads`; scratch as
   attend_rows_512's plus ATTN_BLOCK * D floats a thread. */
static void attend_split_rows(const AttnCtx *c, Py_ssize_t m, int R, int threads, float *scratch) {
    SplitRows L = {.c = c, .m = m, .R = R};
    chain_rows(c, m, R, scratch, &L.cr);
    L.acc = scratch + 4 * ROWS_512 * c->S;
    L.kb = L.acc + 4 * ROWS_512 * c->D;
    pool_run(split_rows_scores, &L, parts_for((L.cr.hi - L.cr.lo + 1) / 256, threads));
    pool_run(split_rows_softmax, &L, parts_for(R, threads));
    pool_run(split_rows_values, &L, parts_for(c->D / 32, threads));
}

#endif

static void attn_part(void *ctx, int part, int nparts) {
    const AttnCtx *c = ctx;
    float *scratch = c->scratch + part * c->scratch_per_part;
    Py_ssize_t lo, hi;
    /* whole rows a part where the rows code below runs and each part gets two rows or more: a part
       that began or ended inside a row would read the whole cache again for that row's other heads
       (5 rows over 2 threads: 2.5 rows a part, the middle row's heads split, the cache read 4 times) */
    const int whole_rows = c->simd && c->H <= 4 && c->ancestors == NULL && c->M >= 2 * nparts;
    part_range(c->M * c->H, whole_rows ? c->H : 1, part, nparts, &lo, &hi);
    for (Py_ssize_t i = lo; i < hi;) {
        Py_ssize_t m = i / c->H, h = i % c->H;
#if HAVE_X86
        /* whole rows, one or more: the rows code (a lone row too: its blocked values read each key's
           row of the cache at once, with the prefetch; one thread, cold cache, 2k keys 0.49 -> 0.30
           ms, 32k 5.96 -> 3.96, 512 keys 0.115 -> 0.111, against attend4's; with the cache warm in
           L3, as a forward never has it, up to 25% slower at 1.5k-8k keys) */
        if (c->simd && h == 0 && c->H <= 4 && c->ancestors == NULL && i + c->H <= hi) {
            Py_ssize_t rows = (hi - i) / c->H;  /* whole rows of this part, from m on */
            if (rows > (c->simd == 2 ? ROWS_512 : 4)) rows = c->simd == 2 ? ROWS_512 : 4;
            if (c->simd == 2) attend_rows_512(c, m, (int)rows, scratch);
            else attend_rows_avx2(c, m, (int)rows, scratch);
            i += rows * c->H;
            continue;
        }
        if (c->simd) {
            Py_ssize_t g = c->H - h;  /* this row's heads left in the part, at most 4 */
            if (g > hi - i) g = hi - i;
            if (g > 4) g = 4;
            if (c->simd == 2) attend4_512(c, m, h, (int)g, scratch);
            else attend4_avx2(c, m, h, (int)g, scratch);
            i += g;
            continue;
        }
#endif
        attend_scalar(c, m, h, scratch);
        i++;
    }
}

/* One attention call's checked arguments, its plan and its scratch: `attention` runs one,
   `attention_many` several. */
typedef struct {
    Py_buffer v[6];
    int got;
    AttnCtx c;
    int split_rows, nparts, threads;
    double cost;  /* keys read times rows: what attention_many balances */
} AttnJob;

/* Checks one call's arguments into job (its buffers held until attn_release); 0, or -1 with an
   exception set. */
static int attn_check(AttnJob *job, const char *fn, PyObject *q_o, PyObject *k_o, PyObject *v_o, PyObject *p_o,
                      long long window, float scale, PyObject *out_o, long long tree_start, PyObject *anc_o) {
    Py_buffer *v = job->v;
    char msg[200];
    const int tree = anc_o != Py_None, n_arrays = tree ? 6 : 5;
    static const ArraySpec spec[6] = {{"q", F32, 3, 0}, {"k_cache", F16, 2, 0}, {"v_cache", F16, 2, 0},
                                      {"positions", I64, 1, 0}, {"out", F32, 3, 1}, {"ancestors", I64, 1, 0}};
    PyObject *const objs[6] = {q_o, k_o, v_o, p_o, out_o, anc_o};
    job->got = get_arrays(fn, n_arrays, spec, objs, v);
    if (job->got < n_arrays) return -1;
    Py_ssize_t M = v[0].shape[0], H = v[0].shape[1], D = v[0].shape[2], T = v[1].shape[0];
    if (v[1].shape[1] != D || v[2].shape[0] != T || v[2].shape[1] != D || v[3].shape[0] != M ||
        v[4].shape[0] != M || v[4].shape[1] != H || v[4].shape[2] != D || H < 1 || D < 1) {
        snprintf(msg, sizeof msg,
                 "shapes must be q [M, H, D], k_cache and v_cache [T, D], positions [M], out [M, H, D] (H, D >= 1); "
                 "got q [%zd, %zd, %zd], k_cache [%zd, %zd], v_cache [%zd, %zd], positions [%zd], out [%zd, %zd, %zd]",
                 M, H, D, T, v[1].shape[1], v[2].shape[0], v[2].shape[1], v[3].shape[0], v[4].shape[0], v[4].shape[1],
                 v[4].shape[2]);
        return shape_error(fn, msg);
    }
    const int64_t *pos = v[3].buf;
    for (Py_ssize_t m = 0; m < M; m++)
        if (pos[m] < 0 || pos[m] >= T) {
            snprintf(msg, sizeof msg, "positions[%zd] = %lld is outside the cache (0..%zd)", m, (long long)pos[m], T - 1);
            return shape_error(fn, msg);
        }
    const uint64_t *anc = NULL;
    if (tree) {  /* row m: position tree_start + depth, ancestors' bits (itself included) over the step's slots */
        anc = v[5].buf;
        if (v[5].shape[0] != M || tree_start < 0) {
            snprintf(msg, sizeof msg, "a tree needs ancestors [M] and tree_start >= 0; got ancestors [%zd], tree_start %lld",
                     v[5].shape[0], tree_start);
            return shape_error(fn, msg);
        }
        for (Py_ssize_t m = 0; m < M; m++) {
            uint64_t bits = anc[m];
            int top = bits ? 63 - __builtin_clzll(bits) : -1;
            if (top < 0 || tree_start + top >= T || pos[m] != tree_start + __builtin_popcountll(bits) - 1) {
                snprintf(msg, sizeof msg, "ancestors[%zd] must hold the row's path (positions[m] = tree_start + "
                         "depth) inside the cache", m);
                return shape_error(fn, msg);
            }
        }
    }
    /* 2: AVX-512 (where matmul_q8 runs it too, and D % 32 == 0); 1: AVX2; 0: scalar */
    int simd = use_simd() && have_f16c && D % 16 == 0 ? (matmul_path() == PATH_AVX512 && D % 32 == 0 ? 2 : 1) : 0;
    Py_ssize_t S = 1;  /* a row sees at most positions start..pos (a tree row: fewer) */
    for (Py_ssize_t m = 0; m < M; m++) {
        const Py_ssize_t n = window > 0 && pos[m] + 1 > window ? window : pos[m] + 1;
        if (n > S) S = n;
    }
    job->cost = (double)M * (double)S;
    job->c = (AttnCtx){v[0].buf, v[1].buf, v[2].buf, pos, anc, v[4].buf, NULL, M, H, D, T, 0,
                       (Py_ssize_t)tree_start, S, window, scale, simd};
    return 0;
}

/* job's plan for `threads` threads and its scratch; 0, or -1 with MemoryError set. */
static int attn_plan(AttnJob *job, int threads) {
    AttnCtx *c = &job->c;
    const Py_ssize_t M = c->M, H = c->H, D = c->D, S = c->S;
    const int simd = c->simd;
    job->threads = threads;
    job->nparts = parts_for(M * H, threads);
    /* a chain over long runs of keys, several threads: split by keys and values, not by rows
       (attend_split_rows, on both SIMD paths) */
    job->split_rows = simd && H <= 4 && c->ancestors == NULL && threads > 1 && S >= LONG_RUN_KEYS &&
                      (simd == 2 || M <= AVX2_SPLIT_ROWS);
    /* attend_rows_avx2: 4 rows' scores and sums; attend_rows_512: ROWS_512 rows' */
    c->scratch_per_part = simd == 2 ? 4 * ROWS_512 * (S + D) + ATTN_BLOCK * D : simd ? 16 * (S + D) : S + D;
    /* attend_split_rows: one part's scores and accumulators, and a block of keys a thread */
    const Py_ssize_t total = job->split_rows ? 4 * ROWS_512 * (S + D) + (Py_ssize_t)threads * ATTN_BLOCK * D
                                             : c->scratch_per_part * job->nparts;
    c->scratch = PyMem_Malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (!c->scratch) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Runs a planned job (without the GIL). */
static void attn_run(AttnJob *job) {
    AttnCtx *c = &job->c;
    if (c->M == 0) return;
#if HAVE_X86
    if (job->split_rows)
        for (Py_ssize_t m = 0; m < c->M; m += ROWS_512)
            attend_split_rows(c, m, (int)(c->M - m < ROWS_512 ? c->M - m : ROWS_512), job->threads, c->scratch);
    else
#endif
        pool_run(attn_part, c, job->nparts);
}

static void attn_release(AttnJob *job) {
    PyMem_Free(job->c.scratch);
    job->c.scratch = NULL;
    for (int i = 0; i < job->got; i++) PyBuffer_Release(&job->v[i]);
    job->got = 0;
}

/* attention(q, k_cache, v_cache, positions, window, scale, out, threads=None, tree_start=-1, ancestors=None) -> out */
PyObject *attention(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"q", "k_cache", "v_cache", "positions", "window", "scale", "out", "threads",
                             "tree_start", "ancestors", NULL};
    static const char *fn = "attention";
    PyObject *q_o, *k_o, *v_o, *p_o, *out_o, *threads_o = Py_None, *anc_o = Py_None;
    long long window, tree_start = -1;
    float scale;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOLfO|OLO", kwlist, &q_o, &k_o, &v_o, &p_o, &window, &scale,
                                     &out_o, &threads_o, &tree_start, &anc_o))
        return NULL;
    int threads = threads_arg(threads_o, fn);
    if (threads < 0) return NULL;
    AttnJob job = {.got = 0};
    PyObject *result = NULL;
    if (attn_check(&job, fn, q_o, k_o, v_o, p_o, window, scale, out_o, tree_start, anc_o) < 0 || attn_plan(&job, threads) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    attn_run(&job);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(out_o);
done:
    attn_release(&job);
    return result;
}

/* attention_many's shared queue: the threads take whole calls, largest first. */
typedef struct {
    AttnJob *jobs;
    const int *order;
    int n, next;
} AttnQueue;

static void attn_queue_part(void *ctx, int part, int nparts) {
    AttnQueue *q = ctx;
    (void)part;
    (void)nparts;
    for (;;) {
        const int j = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
        if (j >= q->n) return;
        attn_run(&q->jobs[q->order[j]]);
    }
}

/* attention_many(calls, threads=None) -> None: each call a tuple (q, k_cache, v_cache, positions,
   window, scale, out[, tree_start, ancestors]) of `attention`'s arguments, each out written as
   `attention` writes it (the same bits: how a call's work is split never changes a value). The
   sequences of a batched forward, one call each: while the largest call reads more keys x rows
   than all the smaller ones together it runs alone on every thread (as `attention` would); the
   rest run side by side, one thread each, the largest first. Several rows of one sequence split
   over two threads pay a split's synchronisations and share each block of keys between the
   threads (a 5-row verify over a 512-key window: 93 us on two threads against 139-149 on one);
   two sequences on a thread each pay neither. */
PyObject *attention_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"calls", "threads", NULL};
    static const char *fn = "attention_many";
    PyObject *calls_o, *threads_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O", kwlist, &calls_o, &threads_o)) return NULL;
    int threads = threads_arg(threads_o, fn);
    if (threads < 0) return NULL;
    PyObject *calls = PySequence_Fast(calls_o, "attention_many: calls must be a sequence of tuples");
    if (!calls) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(calls);
    AttnJob *jobs = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(AttnJob));
    int *order = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(int));
    PyObject *result = NULL;
    Py_ssize_t checked = 0;
    if (!jobs || !order) {
        PyErr_NoMemory();
        goto done;
    }
    for (; checked < n; checked++) {
        PyObject *call = PySequence_Fast_GET_ITEM(calls, checked), *q_o, *k_o, *v_o, *p_o, *out_o, *anc_o = Py_None;
        long long window, tree_start = -1;
        float scale;
        if (!PyTuple_Check(call)) {
            PyErr_Format(PyExc_TypeError, "attention_many: calls[%zd] must be a tuple, not %s", checked, Py_TYPE(call)->tp_name);
            goto done;
        }
        if (!PyArg_ParseTuple(call, "OOOOLfO|LO:attention_many", &q_o, &k_o, &v_o, &p_o, &window, &scale, &out_o,
                              &tree_start, &anc_o) ||
            attn_check(&jobs[checked], fn, q_o, k_o, v_o, p_o, window, scale, out_o, tree_start, anc_o) < 0)
            goto done;
    }
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++)  /* largest first (insertion sort: a forward's few sequences) */
        for (int j = i; j > 0 && jobs[order[j]].cost > jobs[order[j - 1]].cost; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    /* the leading calls that outweigh all the rest run alone on every thread */
    double rest = 0.0;
    for (int i = 0; i < n; i++) rest += jobs[i].cost;
    int alone = 0;
    while (alone < n) {
        rest -= jobs[order[alone]].cost;
        if (threads > 1 && n - alone > 1 && jobs[order[alone]].cost <= rest) break;
        alone++;
    }
    for (int i = 0; i < n; i++)
        if (attn_plan(&jobs[order[i]], i < alone ? threads : 1) < 0) goto done;
    AttnQueue q = {jobs, order + alone, (int)(n - alone), 0};
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < alone; i++) attn_run(&jobs[order[i]]);
    if (q.n > 0) pool_run(attn_queue_part, &q, parts_for(q.n, threads));
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (jobs)
        for (Py_ssize_t i = 0; i < n; i++) attn_release(&jobs[i]);
    PyMem_Free(jobs);
    PyMem_Free(order);
    Py_DECREF(calls);
    return result;
}
