/* server._cpu_kernels' int8 matmul: quantize_rows (float32 rows to Q8_0 codes and scales), pack_q8 and
packed_size (W in the SIMD paths' layout) and matmul_q8, with their portable scalar, AVX2, AVX-VNNI
and AVX-512 VNNI kernels: every path gives each output the contract's bits whatever M, the tile or
the thread. The contract, the layouts and why these loops are at the top of _cpu_kernels.c. */
#include "_cpu_kernels.h"

#define QBLOCK 32         /* values per quantization block */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 4   /* how many W tile strides ahead matmul_q8 prefetches */
#endif
/* Prefetched W goes to L2, not L1: with 8-16 x rows a tile's records (about 1.4 KB a row on the bundled
   model) and the tiles prefetched ahead overflowed L1, each evicting the other, and a multi-row call's
   stream stalled on memory between its products. The bundled model's LM head (262144 x 640), 2 threads:
   8 rows 12.1 -> 7.4-8.1 ms, 16 rows 17.9 -> 11.7-11.9 (1 and 4 rows within the noise); a whole forward at
   4k context, 8 rows 27.9-28.5 -> 21.6-22.7 ms, 16 rows 41.7-41.9 -> 34.3-36.6 (`python -m bench.cpu_step
   --context 4096 --rows 1 4 8 16`, alternating builds). The distance (4 to 12 strides) made no difference
   there. Where data goes changes no result. */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
#define M1_PATH PATH_AVX512 /* the path an unforced M = 1 matmul_q8 call takes at most (see matmul_q8) */
/* The SIMD tile loops (matmul_tiles_*) start on a 64-byte boundary, so that where the linker puts them
   never moves their inner loops against the CPU's instruction fetch blocks: when this file was split
   from _cpu_kernels.c, matmul_tiles_avx512 landed 32 bytes past a boundary and the LM head's one-row
   matmul (262144 x 640, 2 threads, same instructions) went from about 7.6 to 9.2 ms, 16 rows 21.3 to
   22.4; aligned, as fast as before. Placement changes no result. */
#define TILE_LOOP_ALIGN __attribute__((aligned(64)))

/* ---------------------------------------------------------------------------------------------
   quantize_rows */

static void quantize_scalar(const float *x, int8_t *q, float *s, Py_ssize_t nblocks) {
    for (Py_ssize_t b = 0; b < nblocks; b++, x += QBLOCK, q += QBLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            float a = fabsf(x[i]);
            if (a > amax) amax = a;
        }
        float d = amax / 127.0f;
        s[b] = d;
        for (int i = 0; i < QBLOCK; i++) {
            float v = d == 0.0f ? 0.0f : rintf(x[i] / d);
            v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
            q[i] = (int8_t)v;
        }
    }
}

#if HAVE_X86
AVX2 static void quantize_avx2(const float *x, int8_t *q, float *s, Py_ssize_t nblocks) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (Py_ssize_t b = 0; b < nblocks; b++, x += QBLOCK, q += QBLOCK) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        /* max is exact, so any order gives the scalar loop's amax (for finite x) */
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(v2, abs_mask), _mm256_and_ps(v3, abs_mask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.0f;
        s[b] = d;
        if (d == 0.0f) {
            memset(q, 0, QBLOCK);
            continue;
        }
        const __m256 vd = _mm256_set1_ps(d);
#define QUANT(v) _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps( \
        _mm256_round_ps(_mm256_div_ps(v, vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi))
        __m256i i0 = QUANT(v0), i1 = QUANT(v1), i2 = QUANT(v2), i3 = QUANT(v3);
#undef QUANT
        /* packs work within 128-bit lanes: 0-3 8-11 4-7 12-15 ... ; the permute restores order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, perm));
    }
}
#endif

static PyObject *new_array(PyObject *shape_dims[2], const char *dtype_name) {
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return NULL;
    PyObject *r = PyObject_CallMethod(np, "empty", "((OO)s)", shape_dims[0], shape_dims[1], dtype_name);
    Py_DECREF(np);
    return r;
}

/* quantize_rows(x) -> (xq int8 [M, K], xs float32 [M, K/32]) */
PyObject *quantize_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"x", NULL};
    static const char *fn = "quantize_rows";
    PyObject *x_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", kwlist, &x_obj)) return NULL;
    Py_buffer x, q, s;
    if (get_array(x_obj, fn, "x", F32, 2, 0, &x) < 0) return NULL;
    Py_ssize_t M = x.shape[0], K = x.shape[1];
    if (K % QBLOCK) {
        PyErr_Format(PyExc_ValueError, "%s: x.shape[1] (K = %zd) must be a multiple of %d", fn, K, QBLOCK);
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *dq[2] = {PyLong_FromSsize_t(M), PyLong_FromSsize_t(K)};
    PyObject *ds[2] = {PyLong_FromSsize_t(M), PyLong_FromSsize_t(K / QBLOCK)};
    PyObject *xq = NULL, *xs = NULL, *result = NULL;
    if (dq[0] && dq[1] && ds[0] && ds[1]) {
        xq = new_array(dq, "int8");
        xs = xq ? new_array(ds, "float32") : NULL;
    }
    Py_XDECREF(dq[0]);
    Py_XDECREF(dq[1]);
    Py_XDECREF(ds[0]);
    Py_XDECREF(ds[1]);
    if (!xs) goto done;
    if (PyObject_GetBuffer(xq, &q, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (PyObject_GetBuffer(xs, &s, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&q);
        goto done;
    }
    Py_ssize_t nblocks = M * (K / QBLOCK);
    int simd = use_simd();
    Py_BEGIN_ALLOW_THREADS
#if HAVE_X86
    if (simd) quantize_avx2(x.buf, q.buf, s.buf, nblocks);
    else
#endif
        quantize_scalar(x.buf, q.buf, s.buf, nblocks);
    Py_END_ALLOW_THREADS
    (void)simd;
    PyBuffer_Release(&q);
    PyBuffer_Release(&s);
    result = PyTuple_Pack(2, xq, xs);
done:
    Py_XDECREF(xq);
    Py_XDECREF(xs);
    PyBuffer_Release(&x);
    return result;
}

/* ---------------------------------------------------------------------------------------------
   matmul_q8 */

#define GROUP 4                      /* blocks per group: the 4 accumulators of an output */
#define TILE 4                       /* W rows per packed tile */
#define WREC (8 * 64 + 16 * 4)       /* bytes of one packed (tile, group) record: codes, then 16 scales */
#define XREC (8 * 16 * 2 + 16 * 2)   /* bytes of one (x row, group) record: codes, |codes|, xc, xs */
#define XREC512 (8 * 16 + 16 * 2)    /* the AVX-512 path's record: codes, xc, xs (no |codes|) */

static inline Py_ssize_t groups_of(Py_ssize_t K) { return (K / QBLOCK + GROUP - 1) / GROUP; }
static inline Py_ssize_t packed_bytes(Py_ssize_t N, Py_ssize_t K) {
    return (N + TILE - 1) / TILE * groups_of(K) * WREC;
}

/* pack_q8's layout (see the top of _cpu_kernels.c): tiles t_lo..t_hi-1 of W into `out`. */
static void pack_tiles(const int8_t *wq, const float *ws, Py_ssize_t N, Py_ssize_t K, uint8_t *out, Py_ssize_t t_lo,
                       Py_ssize_t t_hi) {
    const Py_ssize_t nb = K / QBLOCK, ng = groups_of(K);
    for (Py_ssize_t T = t_lo; T < t_hi; T++)
        for (Py_ssize_t g = 0; g < ng; g++) {
            uint8_t *rec = out + (T * ng + g) * WREC;
            float *sc = (float *)(rec + 8 * 64);
            for (int r = 0; r < TILE; r++)
                for (int q = 0; q < GROUP; q++) {
                    const Py_ssize_t n = T * TILE + r, b = g * GROUP + q;
                    const int real = n < N && b < nb;
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++)
                            rec[64 * t + 16 * r + 4 * q + i] =
                                (uint8_t)((real ? wq[n * K + b * QBLOCK + 4 * t + i] : 0) ^ 0x80);
                    sc[4 * r + q] = real ? ws[n * nb + b] : 0.0f;
                }
        }
}

typedef struct {
    const int8_t *xq, *wq;
    const float *xs, *ws;
    const uint8_t *xr;    /* the x records, [M][groups][XREC] (SIMD paths) */
    const uint8_t *wp;    /* W packed (SIMD paths) */
    float *out;
    Py_ssize_t M, N, K, ng, m_block;
    int path;
    Py_ssize_t next_tile, chunk;  /* the threads' shared queue of W tiles (matmul_part) */
} MatmulCtx;

typedef struct {
    const int8_t *wq;
    const float *ws;
    uint8_t *out;
    Py_ssize_t N, K;
} PackCtx;

static void pack_part(void *ctx, int part, int nparts) {
    const PackCtx *c = ctx;
    Py_ssize_t lo, hi;
    part_range((c->N + TILE - 1) / TILE, 1, part, nparts, &lo, &hi);
    pack_tiles(c->wq, c->ws, c->N, c->K, c->out, lo, hi);
}

/* x rows' records: per (m, group g), codes[8][16] (step t, lane q: x[m, 32 (4g + q) + 4t .. + 3]),
   their absolute values as unsigned bytes [8][16], xc[4] = -128 * (block 4g + q's 32 codes' sum), xs[4];
   a block past K/32 is all zeros. Groups g0.. of each row. `rec_bytes` a record: XREC, or XREC512
   (the AVX-512 path's, which reads no |codes|: xc and xs follow the codes). */
static void x_records(const int8_t *xq, const float *xs, Py_ssize_t M, Py_ssize_t K, uint8_t *xr, Py_ssize_t g0,
                      Py_ssize_t rec_bytes) {
    const Py_ssize_t nb = K / QBLOCK, ng = groups_of(K);
    const int with_abs = rec_bytes == XREC;
    for (Py_ssize_t m = 0; m < M; m++)
        for (Py_ssize_t g = g0; g < ng; g++) {
            uint8_t *rec = xr + (m * ng + g) * rec_bytes;
            int8_t *codes = (int8_t *)rec;
            uint8_t *absx = rec + 128;
            int32_t *xc = (int32_t *)(rec + (with_abs ? 256 : 128));
            float *sc = (float *)(rec + (with_abs ? 272 : 144));
            for (int q = 0; q < GROUP; q++) {
                const Py_ssize_t b = g * GROUP + q;
                const int8_t *x = xq + m * K + b * QBLOCK;
                int32_t sum = 0;
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++) {
                        int8_t v = b < nb ? x[4 * t + i] : 0;
                        codes[16 * t + 4 * q + i] = v;
                        if (with_abs) absx[16 * t + 4 * q + i] = (uint8_t)abs((int)v);
                        sum += v;
                    }
                xc[q] = -128 * sum;
                sc[q] = b < nb ? xs[m * nb + b] : 0.0f;
            }
        }
}

/* out[m, n] by the contract's definition, from the plain layout; every SIMD path performs these
   same float operations on the same exact integers. */
static float dot_q8_scalar(const int8_t *x, const float *xs, const int8_t *w, const float *ws, Py_ssize_t nb) {
    float acc[GROUP] = {0};
    for (Py_ssize_t b = 0; b < nb; b++) {
        const int8_t *xb = x + b * QBLOCK, *wb = w + b * QBLOCK;
        int32_t p = 0;
        for (int i = 0; i < QBLOCK; i++) p += (int32_t)xb[i] * (int32_t)wb[i];
        const float s = xs[b] * ws[b];
        acc[b % GROUP] = fmaf(s, (float)p, acc[b % GROUP]);
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

static void matmul_tiles_scalar(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) {
    const Py_ssize_t K = c->K, nb = K / QBLOCK;
    const Py_ssize_t n_hi = t_hi * TILE < c->N ? t_hi * TILE : c->N;
    for (Py_ssize_t n = t_lo * TILE; n < n_hi; n++)
        for (Py_ssize_t m = 0; m < c->M; m++)
            c->out[m * c->N + n] = dot_q8_scalar(c->xq + m * K, c->xs + m * nb, c->wq + n * K, c->ws + n * nb, nb);
}

#if HAVE_X86
/* The SIMD paths share one loop: per m_block of x rows (their records stay in L2), W tiles in
   strides of NT_MAX tiles (the stride PREFETCH_TILES ahead prefetched: the hardware prefetcher alone
   falls behind once each tile takes a while), each meeting the block's x rows in micro-tiles of up
   to MR_MAX rows. KERNEL(c, m, T, MR, NT) computes x rows m..m+MR-1 against tiles T..T+NT-1. A
   range's first PREFETCH_TILES strides are prefetched before it starts: a call is cut into about
   16 ranges (matmul_part), and on a small linear (the bundled model's q|k|v: 12 strides a
   range) those strides were a third of each range's weights, read on demand. The bundled model's
   18 layers of body matmuls on cold weights (a throwaway timing, 2 threads, alternating builds on a
   noisy machine): 16 rows, medians of sittings, 11.4 -> 10.9 and 12.5-16.0 -> 9.9-12.3 ms; 4 rows
   5.4-7.7 -> 5.2-6.8; 1 row within the noise. */
#define TILE_LOOP(KERNEL, MR_MAX, NT_MAX)                                                                 \
    const Py_ssize_t tile_bytes = c->ng * WREC;                                                           \
    {   /* the range's first strides, which the loop's own prefetch (strides ahead of it) never covers */ \
        const Py_ssize_t pf_hi = t_lo + NT_MAX * PREFETCH_TILES < t_hi ? t_lo + NT_MAX * PREFETCH_TILES : t_hi; \
        const char *pw = (const char *)(c->wp + t_lo * tile_bytes);                                       \
        for (Py_ssize_t i = 0; i < (pf_hi - t_lo) * tile_bytes; i += 64) _mm_prefetch(pw + i, PREFETCH_HINT); \
    }                                                                                                     \
    for (Py_ssize_t m0 = 0; m0 < c->M; m0 += c->m_block) {                                                \
        Py_ssize_t m1 = m0 + c->m_block < c->M ? m0 + c->m_block : c->M;                                   \
        for (Py_ssize_t T = t_lo; T < t_hi; T += NT_MAX) {                                                \
            const int nt = t_hi - T < NT_MAX ? (int)(t_hi - T) : NT_MAX;                                  \
            if (T + NT_MAX * (PREFETCH_TILES + 1) <= t_hi) {                                              \
                const char *pw = (const char *)(c->wp + (T + NT_MAX * PREFETCH_TILES) * tile_bytes);       \
                for (Py_ssize_t i = 0; i < NT_MAX * tile_bytes; i += 64) _mm_prefetch(pw + i, PREFETCH_HINT); \
            }                                                                                             \
            Py_ssize_t m = m0;                                                                            \
            if (nt == NT_MAX) {                                                                           \
                for (; m + MR_MAX <= m1; m += MR_MAX) KERNEL(c, m, T, MR_MAX, NT_MAX);                    \
                switch (m1 - m) {                                                                         \
                case 3: KERNEL(c, m, T, 3, NT_MAX); break;                                                \
                case 2: KERNEL(c, m, T, 2, NT_MAX); break;                                                \
                case 1: KERNEL(c, m, T, 1, NT_MAX); break;                                                \
                default: break;                                                                           \
                }                                                                                         \
            } else {                                                                                      \
                for (int j = 0; j < nt; j++) {                                                            \
                    for (m = m0; m + MR_MAX <= m1; m += MR_MAX) KERNEL(c, m, T + j, MR_MAX, 1);           \
                    switch (m1 - m) {                                                                     \
                    case 3: KERNEL(c, m, T + j, 3, 1); break;                                             \
                    case 2: KERNEL(c, m, T + j, 2, 1); break;                                             \
                    case 1: KERNEL(c, m, T + j, 1, 1); break;                                             \
                    default: break;                                                                       \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

/* The 4 outputs of a row's tile from its accumulators (4 lanes a W row, lane q = acc[q]), by the
   contract's (acc0 + acc1) + (acc2 + acc3): swap neighbours and add (lane q: acc[q] + acc[q ^ 1],
   the same value either way round), swap pairs and add; lane 4r is then W row r's output. */
AVX2 static inline __m128 sum4_ymm(__m256 a) {  /* a: 2 W rows; returns (row 0, row 1) in lanes 0, 1 */
    a = _mm256_add_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
    a = _mm256_add_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

/* Store the first (N - n) of 4 values (all 4 when n + 4 <= N). */
static inline void store_tile(float *dst, const float *v, Py_ssize_t n, Py_ssize_t N) {
    Py_ssize_t k = N - n < 4 ? N - n : 4;
    for (Py_ssize_t i = 0; i < k; i++) dst[i] = v[i];
}

/* The ymm paths (AVX2, AVX-VNNI): a tile is two ymm, W rows 0-1 and 2-3 (8 lanes: 2 rows x 4
   blocks); micro-tiles of MR <= 2 x rows by one tile. STEP(i, h) adds step t's exact products of x
   row m + i and half h to p[i][h] (the x record `xr[i]` and W `wv[h]` in scope). */
#define YMM_KERNEL_BODY(STEP, PREP_W)                                                                     \
    const Py_ssize_t ng = c->ng;                                                                          \
    __m256 acc[4][2]; /* [4]: the tile loop names MR = 3 too, never reached with MR_MAX 2 */            \
    for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                              \
    for (Py_ssize_t g = 0; g < ng; g++) {                                                                 \
        const uint8_t *w = c->wp + (T * ng + g) * WREC;                                                   \
        const uint8_t *xr[4];                                                                             \
        __m256i p[4][2];                                                                                  \
        for (int i = 0; i < MR; i++) {                                                                    \
            xr[i] = c->xr + ((m + i) * ng + g) * XREC;                                                    \
            p[i][0] = p[i][1] = YMM_INIT(xr[i]);                                                          \
        }                                                                                                 \
        for (int t = 0; t < 8; t++) {                                                                     \
            __m256i wv[2] = {PREP_W(_mm256_loadu_si256((const __m256i *)(w + 64 * t))),                   \
                             PREP_W(_mm256_loadu_si256((const __m256i *)(w + 64 * t + 32)))};             \
            for (int i = 0; i < MR; i++) { STEP(i, 0); STEP(i, 1); }                                       \
        }                                                                                                 \
        const __m256 ws0 = _mm256_loadu_ps((const float *)(w + 512)), ws1 = _mm256_loadu_ps((const float *)(w + 544)); \
        for (int i = 0; i < MR; i++) {                                                                    \
            const __m256 xsv = _mm256_broadcast_ps((const __m128 *)(xr[i] + 272));                        \
            acc[i][0] = _mm256_fmadd_ps(_mm256_mul_ps(xsv, ws0), _mm256_cvtepi32_ps(p[i][0]), acc[i][0]);  \
            acc[i][1] = _mm256_fmadd_ps(_mm256_mul_ps(xsv, ws1), _mm256_cvtepi32_ps(p[i][1]), acc[i][1]);  \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < MR; i++) {                                                                        \
        float v[4];                                                                                       \
        _mm_storel_pi((__m64 *)v, sum4_ymm(acc[i][0]));                                                   \
        _mm_storel_pi((__m64 *)(v + 2), sum4_ymm(acc[i][1]));                                             \
        store_tile(c->out + (m + i) * c->N + T * TILE, v, T * TILE, c->N);                                \
    }

#define BCAST128(ptr) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ptr)))

/* AVX2: W back to signed (w = stored ^ 0x80), x's sign moved onto it so maddubs gets |x| unsigned
   (pairs stay within int16: 2 * 128 * 127), madd by 1 sums each 4 exactly, and the int32 lane sums
   a block's 32 products over the 8 steps (no -128 correction: p starts at 0). */
#define YMM_INIT(xr) _mm256_setzero_si256()
#define FLIP256(v) _mm256_xor_si256((v), _mm256_set1_epi8((char)0x80))
#define AVX2_STEP(i, h)                                                                                   \
    p[i][h] = _mm256_add_epi32(p[i][h], _mm256_madd_epi16(_mm256_maddubs_epi16(BCAST128(xr[i] + 128 + 16 * t), \
                                   _mm256_sign_epi8(wv[h], BCAST128(xr[i] + 16 * t))), _mm256_set1_epi16(1)))

AVX2 static inline __attribute__((always_inline)) void kernel_avx2(const MatmulCtx *c, Py_ssize_t m, Py_ssize_t T,
                                                                 const int MR, const int NT) {
    (void)NT;
    YMM_KERNEL_BODY(AVX2_STEP, FLIP256)
}
#undef YMM_INIT

AVX2 TILE_LOOP_ALIGN static void matmul_tiles_avx2(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) {
    TILE_LOOP(kernel_avx2, 2, 1)
}

/* The VNNI paths: vpdpbusd multiplies W unsigned (stored: w + 128) by x signed, the lane starting
   from xc = -128 * (the block's x codes' sum): after 8 steps exactly the block's dot product
   (|intermediate| <= 32 * 255 * 128, no wrap). */
#define VNNI256 __attribute__((target("avx2,fma,avxvnni")))
#define YMM_INIT(xr) BCAST128((xr) + 256)
#define VNNI256_STEP(i, h) p[i][h] = _mm256_dpbusd_avx_epi32(p[i][h], wv[h], BCAST128(xr[i] + 16 * t))
#define NO_PREP(v) (v)

VNNI256 static inline __attribute__((always_inline)) void kernel_avxvnni(const MatmulCtx *c, Py_ssize_t m,
                                                                       Py_ssize_t T, const int MR, const int NT) {
    (void)NT;
    YMM_KERNEL_BODY(VNNI256_STEP, NO_PREP)
}
#undef YMM_INIT

VNNI256 TILE_LOOP_ALIGN static void matmul_tiles_avxvnni(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) {
    TILE_LOOP(kernel_avxvnni, 2, 1)
}

/* AVX-512 VNNI: a tile is one zmm (16 lanes: 4 W rows x 4 blocks); micro-tiles of MR <= 4 x rows by
   NT <= 2 tiles: 8 int32 and 8 fp32 accumulators. */
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
#define AVX512_NT 2

/* The outputs of 4 accumulators (lane 4 r + q: W row r's partial sum q) by the contract's
   (acc0 + acc1) + (acc2 + acc3), all four in 3 adds: shuffles pair lanes q = 0, 1 and 2, 3 of two
   accumulators into one vector (each add then takes the same two values the one-accumulator form
   adds, so the same bits), then the pair sums, and a permute puts each accumulator's 4 outputs
   side by side. A, B: x row i's two tiles, 8 outputs at dst0; C, D: row i + 1's at dst1 (NULL:
   none). Per-accumulator reductions (2 permutes, 2 adds, a permute and a store each) were about a
   twentieth of a 20-row K = 640 matmul's instructions. */
AVX512 static inline void reduce_store4_512(__m512 A, __m512 B, __m512 C, __m512 D, float *dst0, float *dst1) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(A, B, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(A, B, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(C, D, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(C, D, _MM_SHUFFLE(3, 1, 3, 1)));
    /* ab, 128-bit lane r: A01 A23 B01 B23; cd: C01 C23 D01 D23 */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    /* r, lane r: A_r B_r C_r D_r -> A_0..3 B_0..3 C_0..3 D_0..3 */
    const __m512 o = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
    _mm256_storeu_ps(dst0, _mm512_castps512_ps256(o));
    if (dst1) _mm256_storeu_ps(dst1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o), 1)));
}

AVX512 static inline __attribute__((always_inline)) void kernel_avx512(const MatmulCtx *c, Py_ssize_t m, Py_ssize_t T,
                                                                     const int MR, const int NT) {
    const Py_ssize_t ng = c->ng;
    __m512 acc[4][AVX512_NT];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < AVX512_NT; j++) acc[i][j] = _mm512_setzero_ps();
    for (Py_ssize_t g = 0; g < ng; g++) {
        const uint8_t *w[AVX512_NT];
        for (int j = 0; j < NT; j++) w[j] = c->wp + ((T + j) * ng + g) * WREC;
        const uint8_t *xr[4];
        __m512i p[4][AVX512_NT];
        for (int i = 0; i < MR; i++) {
            xr[i] = c->xr + ((m + i) * ng + g) * XREC512;
            const __m512i xc = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xr[i] + 128)));
            for (int j = 0; j < NT; j++) p[i][j] = xc;
        }
        for (int t = 0; t < 8; t++) {
            __m512i wv[AVX512_NT];
            for (int j = 0; j < NT; j++) wv[j] = _mm512_loadu_si512(w[j] + 64 * t);
            for (int i = 0; i < MR; i++) {
                const __m512i xv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xr[i] + 16 * t)));
                for (int j = 0; j < NT; j++) p[i][j] = _mm512_dpbusd_epi32(p[i][j], wv[j], xv);
            }
        }
        __m512 wsv[AVX512_NT];
        for (int j = 0; j < NT; j++) wsv[j] = _mm512_loadu_ps((const float *)(w[j] + 512));
        for (int i = 0; i < MR; i++) {
            const __m512 xsv = _mm512_broadcast_f32x4(_mm_loadu_ps((const float *)(xr[i] + 144)));
            for (int j = 0; j < NT; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(xsv, wsv[j]), _mm512_cvtepi32_ps(p[i][j]), acc[i][j]);
        }
    }
    if (NT == 2 && (T + 2) * TILE <= c->N) {  /* two whole tiles: rows in pairs, 4 accumulators at once */
        for (int i = 0; i < MR; i += 2) {
            const __m512 z = _mm512_setzero_ps();
            float *dst = c->out + (m + i) * c->N + T * TILE;
            reduce_store4_512(acc[i][0], acc[i][1], i + 1 < MR ? acc[i + 1][0] : z, i + 1 < MR ? acc[i + 1][1] : z,
                              dst, i + 1 < MR ? dst + c->N : NULL);
        }
        return;
    }
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NT; j++) {
            __m512 a = acc[i][j];
            a = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
            a = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
            const Py_ssize_t n = (T + j) * TILE;
            float *dst = c->out + (m + i) * c->N + n;
            const __m128 v = _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, a));
            if (n + 4 <= c->N) _mm_storeu_ps(dst, v);
            else {
                float tmp[4];
                _mm_storeu_ps(tmp, v);
                store_tile(dst, tmp, n, c->N);
            }
        }
}

AVX512 TILE_LOOP_ALIGN static void matmul_tiles_avx512(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) {
    TILE_LOOP(kernel_avx512, 4, AVX512_NT)
}

/* x_records' XREC512 records for the AVX-512 path, built with AVX-512. A whole group's 4 blocks
   (128 codes, contiguous in a row) as two zmm of 32-bit words, word 8 q + t = block q's codes
   4t..4t+3, transposed into the record's order (word 4 t + q) by two permutes; the blocks' sums
   from a dpbusd by ones (4 codes a word, exact) and the record's 4 lane groups added. A last group
   with fewer than 4 blocks takes the portable loop. With the scalar loop a 20-row call on K = 2048
   spent 25 us here, alone on one core before the threads start (a quarter of the down
   projection's call). */
AVX512 static void x_records_vnni_512(const int8_t *xq, const float *xs, Py_ssize_t M, Py_ssize_t K, uint8_t *xr) {
    const Py_ssize_t nb = K / QBLOCK, ng = groups_of(K), full = nb / GROUP;
    const __m512i lo_idx = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i hi_idx = _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
    const __m512i ones = _mm512_set1_epi8(1);
    for (Py_ssize_t m = 0; m < M; m++) {
        for (Py_ssize_t g = 0; g < full; g++) {
            const int8_t *x = xq + m * K + g * GROUP * QBLOCK;
            uint8_t *rec = xr + (m * ng + g) * XREC512;
            const __m512i a = _mm512_loadu_si512(x), b = _mm512_loadu_si512(x + 64);
            const __m512i c0 = _mm512_permutex2var_epi32(a, lo_idx, b), c1 = _mm512_permutex2var_epi32(a, hi_idx, b);
            _mm512_storeu_si512(rec, c0);
            _mm512_storeu_si512(rec + 64, c1);
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, c0), ones, c1);
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
            const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            _mm_storeu_si128((__m128i *)(rec + 128), _mm_mullo_epi32(s4, _mm_set1_epi32(-128)));
            _mm_storeu_ps((float *)(rec + 144), _mm_loadu_ps(xs + m * nb + g * GROUP));
        }
        if (full < ng) x_records(xq + m * K, xs + m * nb, 1, K, xr + m * ng * XREC512, full, XREC512);
    }
}
#endif

/* Each thread takes chunks of W tiles from the shared queue until it is empty, rather than a fixed
   share: a core that something else (the server's Python threads) takes for a while then costs the
   call about its share of that time, where a fixed split made the call wait for the slowed share.
   Which thread computes a tile changes none of its bits (see the top of _cpu_kernels.c). */
static void matmul_part(void *ctx, int part, int nparts) {
    MatmulCtx *c = ctx;
    (void)part;
    (void)nparts;
    const Py_ssize_t tiles = (c->N + TILE - 1) / TILE;
    for (;;) {
        const Py_ssize_t lo = __atomic_fetch_add(&c->next_tile, c->chunk, __ATOMIC_RELAXED);
        if (lo >= tiles) return;
        const Py_ssize_t hi = lo + c->chunk < tiles ? lo + c->chunk : tiles;
        switch (c->path) {
#if HAVE_X86
        case PATH_AVX512: matmul_tiles_avx512(c, lo, hi); break;
        case PATH_AVXVNNI: matmul_tiles_avxvnni(c, lo, hi); break;
        case PATH_AVX2: matmul_tiles_avx2(c, lo, hi); break;
#endif
        default: matmul_tiles_scalar(c, lo, hi); break;
        }
    }
}

/* Tiles a matmul_part chunk takes: about CHUNKS_PER_PART chunks a thread, whole micro-tile pairs. */
#define CHUNKS_PER_PART 8
static Py_ssize_t tile_chunk(Py_ssize_t tiles, int nparts) {
    Py_ssize_t chunk = (tiles + (Py_ssize_t)nparts * CHUNKS_PER_PART - 1) / ((Py_ssize_t)nparts * CHUNKS_PER_PART);
    chunk = (chunk + 1) / 2 * 2;
    return chunk < 2 ? 2 : chunk;
}

static void *alloc64(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, n ? n : 64) == 0 ? p : NULL;
}

/* Checks wq [N, K] and ws [N, K/32] (K % 32 == 0); 0, or -1 with ValueError set. */
static int check_w(const char *fn, const Py_buffer *wq, const Py_buffer *ws) {
    char msg[200];
    Py_ssize_t N = wq->shape[0], K = wq->shape[1];
    if (K % QBLOCK) {
        snprintf(msg, sizeof msg, "K (wq.shape[1] = %zd) must be a multiple of %d", K, QBLOCK);
        return shape_error(fn, msg);
    }
    if (ws->shape[0] != N || ws->shape[1] != K / QBLOCK) {
        snprintf(msg, sizeof msg, "ws must be [N, K/32] = [%zd, %zd], not [%zd, %zd]", N, K / QBLOCK, ws->shape[0],
                 ws->shape[1]);
        return shape_error(fn, msg);
    }
    return 0;
}

/* pack_q8(wq, ws, out, threads=None) -> out */
PyObject *pack_q8(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"wq", "ws", "out", "threads", NULL};
    static const char *fn = "pack_q8";
    PyObject *wq_o, *ws_o, *out_o, *threads_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O", kwlist, &wq_o, &ws_o, &out_o, &threads_o)) return NULL;
    int threads = threads_arg(threads_o, fn);
    if (threads < 0) return NULL;
    static const ArraySpec spec[3] = {{"wq", I8, 2, 0}, {"ws", F32, 2, 0}, {"out", U8, 1, 1}};
    PyObject *const objs[3] = {wq_o, ws_o, out_o};
    Py_buffer v[3];
    PyObject *result = NULL;
    char msg[200];
    int got = get_arrays(fn, 3, spec, objs, v);
    if (got < 3 || check_w(fn, &v[0], &v[1]) < 0) goto done;
    Py_ssize_t N = v[0].shape[0], K = v[0].shape[1];
    if (v[2].shape[0] != packed_bytes(N, K)) {
        snprintf(msg, sizeof msg, "out must hold packed_size(%zd, %zd) = %zd bytes, not %zd", N, K, packed_bytes(N, K),
                 v[2].shape[0]);
        shape_error(fn, msg);
        goto done;
    }
    PackCtx pc = {v[0].buf, v[1].buf, v[2].buf, N, K};
    Py_BEGIN_ALLOW_THREADS
    pool_run(pack_part, &pc, parts_for((N + TILE - 1) / TILE, threads));
    Py_END_ALLOW_THREADS
    result = Py_NewRef(out_o);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* packed_size(N, K) -> bytes of pack_q8's layout */
PyObject *packed_size(PyObject *self, PyObject *args) {
    Py_ssize_t N, K;
    if (!PyArg_ParseTuple(args, "nn", &N, &K)) return NULL;
    if (N < 0 || K < 0 || K % QBLOCK) {
        PyErr_Format(PyExc_ValueError, "packed_size: N >= 0 and K >= 0 a multiple of %d, not (%zd, %zd)", QBLOCK, N, K);
        return NULL;
    }
    return PyLong_FromSsize_t(packed_bytes(N, K));
}

/* matmul_q8(xq, xs, wq, ws, out, threads=None, packed=None) -> out */
PyObject *matmul_q8(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"xq", "xs", "wq", "ws", "out", "threads", "packed", NULL};
    static const char *fn = "matmul_q8";
    PyObject *xq_o, *xs_o, *wq_o, *ws_o, *out_o, *threads_o = Py_None, *packed_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|OO", kwlist, &xq_o, &xs_o, &wq_o, &ws_o, &out_o, &threads_o,
                                     &packed_o))
        return NULL;
    int threads = threads_arg(threads_o, fn);
    if (threads < 0) return NULL;
    const int n_arrays = packed_o != Py_None ? 6 : 5;
    static const ArraySpec spec[6] = {{"xq", I8, 2, 0}, {"xs", F32, 2, 0}, {"wq", I8, 2, 0}, {"ws", F32, 2, 0},
                                      {"out", F32, 2, 1}, {"packed", U8, 1, 0}};
    PyObject *const objs[6] = {xq_o, xs_o, wq_o, ws_o, out_o, packed_o};
    Py_buffer v[6];
    PyObject *result = NULL;
    char msg[200];
    int got = get_arrays(fn, n_arrays, spec, objs, v);
    if (got < n_arrays) goto done;
    Py_ssize_t M = v[0].shape[0], K = v[0].shape[1], N = v[2].shape[0];
    if (K % QBLOCK) {
        snprintf(msg, sizeof msg, "K (xq.shape[1] = %zd) must be a multiple of %d", K, QBLOCK);
        shape_error(fn, msg);
        goto done;
    }
    if (v[2].shape[1] != K || v[1].shape[0] != M || v[1].shape[1] != K / QBLOCK || v[3].shape[0] != N ||
        v[3].shape[1] != K / QBLOCK || v[4].shape[0] != M || v[4].shape[1] != N) {
        snprintf(msg, sizeof msg,
                 "shapes must be xq [M, K], xs [M, K/32], wq [N, K], ws [N, K/32], out [M, N]; got xq [%zd, %zd], "
                 "xs [%zd, %zd], wq [%zd, %zd], ws [%zd, %zd], out [%zd, %zd]",
                 M, K, v[1].shape[0], v[1].shape[1], N, v[2].shape[1], v[3].shape[0], v[3].shape[1], v[4].shape[0],
                 v[4].shape[1]);
        shape_error(fn, msg);
        goto done;
    }
    if (n_arrays == 6 && v[5].shape[0] != packed_bytes(N, K)) {
        snprintf(msg, sizeof msg, "packed must be pack_q8(wq, ws)'s %zd bytes, not %zd", packed_bytes(N, K),
                 v[5].shape[0]);
        shape_error(fn, msg);
        goto done;
    }
    /* M = 1 streams W from memory: there an unforced call runs at most M1_PATH (same results). With the
       previous arithmetic the AVX2 code kept up with memory better on Zen 5; with this one AVX-512
       VNNI does no worse, so M1_PATH is the best path. */
    int path = matmul_path();
    if (forced_path < 0 && M == 1 && path > M1_PATH) path = M1_PATH;
    if (M == 0 || N == 0 || K == 0) path = PATH_SCALAR;  /* nothing to pack for (same results) */
    const Py_ssize_t ng = groups_of(K);
    MatmulCtx c = {v[0].buf, v[2].buf, v[1].buf, v[3].buf, NULL, NULL, v[4].buf, M, N, K, ng, 4, path, 0, 0};
    /* x rows per m_block: their records (rec_bytes per 128 values) stay in L2 while W tiles pass */
    const Py_ssize_t rec_bytes = path == PATH_AVX512 ? XREC512 : XREC;
    c.m_block = (512 * 1024 / (ng * rec_bytes)) / 4 * 4;
    if (c.m_block < 4) c.m_block = 4;
    uint8_t *xr = NULL, *wp = NULL;
    if (path != PATH_SCALAR) {
        xr = alloc64((size_t)(M * ng * rec_bytes));
        wp = n_arrays == 6 ? NULL : alloc64((size_t)packed_bytes(N, K));
        if (!xr || (n_arrays == 5 && !wp)) {
            free(xr);
            free(wp);
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (path != PATH_SCALAR) {
#if HAVE_X86
        if (path == PATH_AVX512) x_records_vnni_512(c.xq, c.xs, M, K, xr);
        else
#endif
            x_records(c.xq, c.xs, M, K, xr, 0, XREC);
        c.xr = xr;
        if (wp) {
            PackCtx pc = {c.wq, c.ws, wp, N, K};
            pool_run(pack_part, &pc, parts_for((N + TILE - 1) / TILE, threads));
        }
        c.wp = wp ? wp : v[5].buf;
    }
    const Py_ssize_t tiles = (N + TILE - 1) / TILE;
    const int parts = parts_for(tiles, threads);
    c.chunk = tile_chunk(tiles, parts);
    pool_run(matmul_part, &c, parts);
    Py_END_ALLOW_THREADS
    free(xr);
    free(wp);
    result = Py_NewRef(out_o);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}
