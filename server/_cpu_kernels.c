/* server._cpu_kernels: the CPU path's per-step kernels for the bundled Gemma 3 270M (Q8_0-style int8
matmuls and single-KV-head attention), in C with AVX2 where the CPU has it.

Contract (batch invariance): every output row is bit for bit the same whatever the number of rows M in
the call, the number of threads, and whether the AVX2 or the portable scalar code runs. The server
verifies a 16-token draft in one call and must get exactly the logits 16 one-token calls give. So:
  - threads split the work by output columns n (matmul_q8) or by (m, h) pairs (attention), never a
    reduction; each output's arithmetic is one fixed sequence of float operations that depends on
    neither M, nor the tile or thread it lands in;
  - the scalar code performs that same sequence: every fused multiply-add is explicit (_mm256_fmadd_ps
    there, fmaf here), the code has no a * b + c expression a compiler could contract differently, and
    integer dot products are exact, so their order is free;
  - expf is libm's in both paths (called one value at a time).
The scalar path also serves CPUs without AVX2/FMA (picked at run time, __builtin_cpu_supports) and
any D not a multiple of 16 in attention; _force_scalar(True) selects it for tests.

Functions (arrays through the buffer protocol, C-contiguous, native byte order; checked, TypeError for a
wrong dtype or a non-array, ValueError for a wrong shape, non-contiguous or read-only output):
  quantize_rows(x) -> (xq, xs): x float32 [M, K], K % 32 == 0; xq int8 [M, K], xs float32 [M, K/32].
      Per 32-value block: d = max|x| / 127 (fp32 division), q = rint(x / d) (round half to even)
      clamped to [-127, 127], all zeros when d == 0 (llama.cpp's Q8_0 rule, d kept in fp32).
      x must be finite.
  matmul_q8(xq, xs, wq, ws, out, threads=None) -> out: xq int8 [M, K], xs float32 [M, K/32],
      wq int8 [N, K], ws float32 [N, K/32], out float32 [M, N]:
          out[m, n] = tree8(lane[0..7]),  lane[j] = fma(xs[m,b] * ws[n,b], (float)idot(m, n, b), lane[j])
      over b = j, j + 8, j + 16, ... in order (lanes start at +0; a group's missing blocks past the
      end add fma(0, 0, lane)), idot the exact int32 dot product of block b of row m and row n, and
      tree8(l) = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). wq codes must lie in [-127, 127]
      (AVX2 applies x's sign to w: a -128 there wraps); xq may be any int8.
  attention(q, k_cache, v_cache, positions, window, scale, out, threads=None) -> out:
      q float32 [M, H, D], k_cache / v_cache float32 [T, D] (one KV head shared by the H query heads),
      positions int64 [M] (each in 0..T-1), window int, scale float, out float32 [M, H, D]. Row m
      attends to cache positions p with start <= p <= positions[m], start = max(0, positions[m] -
      window + 1) when window > 0, else 0. Per (m, h):
          s_p = dot16(q[m, h], k[p]) * scale,  dot16: lane i = fma chain over d = i, i + 16, ... in
                order from +0, then u_i = l_i + l_{i+8} (i < 8) and tree8(u);
          mx = max_p s_p; e_p = expf(s_p - mx); sum = e_start + ... in position order;
          out[m, h, d] = acc_d / sum,  acc_d = fma chain of (e_p, v[p, d]) in position order from +0.
  set_threads(n) -> previous count (1..64; the default is the CPUs this process may run on);
  get_threads(); _force_scalar(flag) -> previous flag; simd() -> "avx2" or "scalar" (what runs now).
  A call's threads= overrides the module count for that call. out must not overlap an input.
The GIL is released around all compute. Threads are a small pool of pthreads started on first use
(they spin about 0.2 ms after a call for the next one, then sleep); a fork()ed child starts its own.

Why these loops: at M = 1 a matmul is a stream of the weights (the LM head: 262144 x 640 int8, 168 MB
a call), so W is read once per call whatever M: a tile of 4 W rows stays in L1 and meets every x row
(x is M x K bytes, in L2) before the next tile is read.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#else
#define HAVE_X86 0
#endif

#define QBLOCK 32         /* values per quantization block */
#define MAX_THREADS 64
#define M_BLOCK 64        /* x rows that meet one W tile before the next tile (keeps x in L2) */
#define PREFETCH_TILES 4   /* how many W tiles ahead matmul_q8 prefetches */
#define SPIN_NS 200000    /* how long an idle worker (or a waiting caller) spins before sleeping */

static int n_threads = 1;     /* set at import: the CPUs this process may run on */
static int force_scalar = 0;  /* _force_scalar(True): tests compare the two paths */
static int cpu_avx2 = 0;      /* AVX2 and FMA, checked once at import */

static int use_simd(void) { return cpu_avx2 && !force_scalar; }

/* ---------------------------------------------------------------------------------------------
   Thread pool. Workers 1..size run parts of one call at a time (the caller runs part 0 and any
   part beyond the workers it has); the call mutex serialises callers. Every worker checks in for
   every call (pending counts all of them), so no worker can see one call's generation with the
   next call's fields. */

typedef void (*part_fn)(void *ctx, int part, int nparts);

static struct {
    pthread_mutex_t call, mu;
    pthread_cond_t wake, done;
    int size;
    unsigned long gen;  /* bumped under mu to start a call; read atomically by spinning workers */
    part_fn fn;
    void *ctx;
    int nparts;
    int pending;        /* workers yet to check in for the current call */
    unsigned long start_gen[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, {0}};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if HAVE_X86
    _mm_pause();
#endif
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned long seen = pool.start_gen[id];  /* written before this thread was created */
    for (;;) {
        unsigned long g;
        uint64_t t0 = now_ns();
        unsigned spins = 0;
        while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen) {
            cpu_relax();
            if ((++spins & 63) == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&pool.mu);
                while ((g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen)
                    pthread_cond_wait(&pool.wake, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        seen = g;
        if (id < pool.nparts) pool.fn(pool.ctx, id, pool.nparts);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* Start workers until there are `want` (fewer if the system refuses); called holding pool.call. */
static void ensure_workers(int want) {
    while (pool.size < want) {
        int id = pool.size + 1;
        pthread_t tid;
        pthread_attr_t attr;
        pool.start_gen[id] = pool.gen;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&tid, &attr, worker_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (rc != 0) return;  /* the caller runs the parts no worker takes */
        pool.size = id;
    }
}

/* Run fn(ctx, part, nparts) for every part in 0..nparts-1, on up to nparts threads; returns when
   all are done. Called without the GIL. */
static void pool_run(part_fn fn, void *ctx, int nparts) {
    if (nparts <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.call);
    ensure_workers(nparts - 1 < MAX_THREADS - 1 ? nparts - 1 : MAX_THREADS - 1);
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nparts = nparts;
    pool.pending = pool.size;
    __atomic_add_fetch(&pool.gen, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, nparts);
    for (int p = pool.size + 1; p < nparts; p++) fn(ctx, p, nparts);
    uint64_t t0 = now_ns();
    unsigned spins = 0;
    while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0) {
        cpu_relax();
        if ((++spins & 63) == 0 && now_ns() - t0 > SPIN_NS) {
            pthread_mutex_lock(&pool.mu);
            while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0) pthread_cond_wait(&pool.done, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
    }
    pthread_mutex_unlock(&pool.call);
}

/* A fork()ed child has none of the parent's workers: forget them (and any lock a parent thread held). */
static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.size = 0;
    pool.pending = 0;
}

/* [lo, hi) of `total` items for part `part` of `nparts`, in whole units of `unit` items. */
static void part_range(Py_ssize_t total, Py_ssize_t unit, int part, int nparts, Py_ssize_t *lo, Py_ssize_t *hi) {
    Py_ssize_t units = (total + unit - 1) / unit;
    Py_ssize_t per = (units + nparts - 1) / nparts;
    Py_ssize_t a = per * part * unit, b = per * (part + 1) * unit;
    *lo = a < total ? a : total;
    *hi = b < total ? b : total;
}

/* The number of parts for `units` independent pieces of work at `threads` threads. */
static int parts_for(Py_ssize_t units, int threads) {
    if (units < 1) return 1;
    return units < threads ? (int)units : threads;
}

/* ---------------------------------------------------------------------------------------------
   Argument checks. */

typedef enum { F32, I8, I64 } dtype;
static const char *dtype_names[] = {"float32", "int8", "int64"};

static int format_is(const Py_buffer *v, dtype dt) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;  /* native order (the CPUs here are little-endian) */
    if (f[0] == '\0' || f[1] != '\0') return 0;
    switch (dt) {
    case F32: return *f == 'f' && v->itemsize == 4;
    case I8: return *f == 'b' && v->itemsize == 1;
    case I64: return (*f == 'l' || *f == 'q') && v->itemsize == 8;
    }
    return 0;
}

/* What obj holds, for messages: numpy's dtype name where it has one, else its type name. */
static PyObject *describe(PyObject *obj) {
    PyObject *dt = PyObject_GetAttrString(obj, "dtype");
    if (dt) {
        PyObject *s = PyObject_Str(dt);
        Py_DECREF(dt);
        if (s) return s;
    }
    PyErr_Clear();
    return PyUnicode_FromString(Py_TYPE(obj)->tp_name);
}

/* Borrow obj's buffer as a C-contiguous `ndim`-dimensional array of `dt` (writable if asked);
   0 on success (release it with PyBuffer_Release), -1 with TypeError/ValueError set. */
static int get_array(PyObject *obj, const char *fn, const char *name, dtype dt, int ndim, int writable,
                     Py_buffer *view) {
    if (!PyObject_CheckBuffer(obj)) {
        PyObject *what = describe(obj);
        PyErr_Format(PyExc_TypeError, "%s: %s must be a %s numpy array, not %U", fn, name, dtype_names[dt], what);
        Py_XDECREF(what);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s must be a %sarray with the buffer protocol", fn, name,
                     writable ? "writable " : "");
        return -1;
    }
    if (!format_is(view, dt)) {
        PyObject *what = describe(obj);
        PyErr_Format(PyExc_TypeError, "%s: %s must be %s, not %U", fn, name, dtype_names[dt], what);
        Py_XDECREF(what);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be %d-dimensional, not %d-dimensional", fn, name, ndim,
                     view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be C-contiguous (np.ascontiguousarray)", fn, name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ValueError "fn: what" with the shapes in the message; always -1. */
static int shape_error(const char *fn, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s: %s", fn, what);
    return -1;
}

/* The threads= argument: None (the module count) or 1..MAX_THREADS; -1 with ValueError/TypeError set. */
static int threads_arg(PyObject *obj, const char *fn) {
    if (obj == NULL || obj == Py_None) return n_threads;
    long t = PyLong_AsLong(obj);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (t < 1 || t > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be 1..%d, not %ld", fn, MAX_THREADS, t);
        return -1;
    }
    return (int)t;
}

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
static PyObject *quantize_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
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

typedef struct {
    const int8_t *xq, *xa;  /* xa: |xq| as unsigned bytes, for maddubs (AVX2 path only) */
    const float *xs;
    const int8_t *wq;
    const float *ws;
    float *out;
    Py_ssize_t M, N, K;
    int simd;
} MatmulCtx;

/* The exact int32 dot product of two 32-value int8 blocks (|result| <= 32 * 128 * 128). */
static inline int32_t idot32(const int8_t *x, const int8_t *w) {
    int32_t s = 0;
    for (int i = 0; i < QBLOCK; i++) s += (int32_t)x[i] * (int32_t)w[i];
    return s;
}

static inline float tree8(const float *l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

/* out[m, n] by the contract's definition; the AVX2 code performs these same float operations. */
static float dot_q8_scalar(const int8_t *x, const float *xs, const int8_t *w, const float *ws, Py_ssize_t nb) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (Py_ssize_t g = 0; g < nb; g += 8)
        for (int j = 0; j < 8; j++) {
            Py_ssize_t b = g + j;
            float s = 0.0f;
            int32_t d = 0;
            if (b < nb) {
                s = xs[b] * ws[b];
                d = idot32(x + b * QBLOCK, w + b * QBLOCK);
            }
            lane[j] = fmaf(s, (float)d, lane[j]);
        }
    return tree8(lane);
}

static void matmul_rows_scalar(const MatmulCtx *c, Py_ssize_t n_lo, Py_ssize_t n_hi) {
    const Py_ssize_t K = c->K, nb = K / QBLOCK;
    for (Py_ssize_t n = n_lo; n < n_hi; n++)
        for (Py_ssize_t m = 0; m < c->M; m++)
            c->out[m * c->N + n] = dot_q8_scalar(c->xq + m * K, c->xs + m * nb, c->wq + n * K, c->ws + n * nb, nb);
}

#if HAVE_X86
/* Block b of row x against block b of row w: 8 int32 lanes summing to the exact dot product
   (x's sign moved onto w so maddubs gets |x| unsigned; pairs stay within int16: 2 * 128 * 127). */
AVX2 static inline __m256i block_dot(const int8_t *xa, const int8_t *x, const int8_t *w) {
    __m256i sw = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)w), _mm256_loadu_si256((const __m256i *)x));
    __m256i p16 = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)xa), sw);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* [sum(v0), ..., sum(v7)]: eight blocks' exact dot products, one per lane (integer adds: any order). */
AVX2 static inline __m256i block_sums(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4, __m256i v5,
                                      __m256i v6, __m256i v7) {
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* out[m, n..n+3] for x row m and W rows n..n+3: the scalar definition, lane j of acc[r] being lane[j]. */
AVX2 static void tile4_avx2(const MatmulCtx *c, Py_ssize_t m, Py_ssize_t n) {
    const Py_ssize_t K = c->K, nb = K / QBLOCK;
    const int8_t *x = c->xq + m * K, *xa = c->xa + m * K;
    const float *xs = c->xs + m * nb;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    Py_ssize_t g = 0;
    for (; g + 8 <= nb; g += 8) {
        const __m256 sx = _mm256_loadu_ps(xs + g);
        const int8_t *xg = x + g * QBLOCK, *ag = xa + g * QBLOCK;
        for (int r = 0; r < 4; r++) {
            const int8_t *w = c->wq + (n + r) * K + g * QBLOCK;
            __m256i d = block_sums(block_dot(ag, xg, w), block_dot(ag + 32, xg + 32, w + 32),
                                   block_dot(ag + 64, xg + 64, w + 64), block_dot(ag + 96, xg + 96, w + 96),
                                   block_dot(ag + 128, xg + 128, w + 128), block_dot(ag + 160, xg + 160, w + 160),
                                   block_dot(ag + 192, xg + 192, w + 192), block_dot(ag + 224, xg + 224, w + 224));
            __m256 s = _mm256_mul_ps(sx, _mm256_loadu_ps(c->ws + (n + r) * nb + g));
            acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), acc[r]);
        }
    }
    if (g < nb) {  /* a last, partial group: missing blocks are zero scales and zero dots */
        int left = (int)(nb - g);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 sx = _mm256_maskload_ps(xs + g, mask);
        for (int r = 0; r < 4; r++) {
            const int8_t *w = c->wq + (n + r) * K + g * QBLOCK;
            __m256i v[8];
            for (int j = 0; j < 8; j++)
                v[j] = j < left ? block_dot(xa + (g + j) * QBLOCK, x + (g + j) * QBLOCK, w + j * QBLOCK)
                                : _mm256_setzero_si256();
            __m256i d = block_sums(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
            __m256 s = _mm256_mul_ps(sx, _mm256_maskload_ps(c->ws + (n + r) * nb + g, mask));
            acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), acc[r]);
        }
    }
    /* tree8 of each acc, all four at once: hadd pairs (0+1, 2+3 | 4+5, 6+7), then halves, then lo + hi */
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(c->out + m * c->N + n, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

AVX2 static void matmul_rows_avx2(const MatmulCtx *c, Py_ssize_t n_lo, Py_ssize_t n_hi) {
    Py_ssize_t n4 = n_lo + (n_hi - n_lo) / 4 * 4;
    for (Py_ssize_t m0 = 0; m0 < c->M; m0 += M_BLOCK) {
        Py_ssize_t m1 = m0 + M_BLOCK < c->M ? m0 + M_BLOCK : c->M;
        for (Py_ssize_t n = n_lo; n < n4; n += 4) {
            /* The tile PREFETCH_TILES ahead (its codes and scales) on its way to L1 while this one
               is used: the hardware prefetcher alone falls behind once each tile takes a while. */
            if (n + 4 * PREFETCH_TILES + 4 <= n4) {
                const char *w = (const char *)(c->wq + (n + 4 * PREFETCH_TILES) * c->K);
                for (Py_ssize_t i = 0; i < 4 * c->K; i += 64) _mm_prefetch(w + i, _MM_HINT_T0);
                const char *s = (const char *)(c->ws + (n + 4 * PREFETCH_TILES) * (c->K / QBLOCK));
                for (Py_ssize_t i = 0; i < 4 * c->K / 8; i += 64) _mm_prefetch(s + i, _MM_HINT_T0);
            }
            for (Py_ssize_t m = m0; m < m1; m++) tile4_avx2(c, m, n);
        }
    }
    if (n4 < n_hi) {  /* fewer than 4 rows left (N % 4 != 0): the scalar code, same arithmetic */
        matmul_rows_scalar(c, n4, n_hi);
    }
}
#endif

static void matmul_part(void *ctx, int part, int nparts) {
    const MatmulCtx *c = ctx;
    Py_ssize_t lo, hi;
    part_range(c->N, 4, part, nparts, &lo, &hi);  /* parts start on a multiple of 4: whole tiles */
#if HAVE_X86
    if (c->simd) {
        matmul_rows_avx2(c, lo, hi);
        return;
    }
#endif
    matmul_rows_scalar(c, lo, hi);
}

/* matmul_q8(xq, xs, wq, ws, out, threads=None) -> out */
static PyObject *matmul_q8(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"xq", "xs", "wq", "ws", "out", "threads", NULL};
    static const char *fn = "matmul_q8";
    PyObject *xq_o, *xs_o, *wq_o, *ws_o, *out_o, *threads_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|O", kwlist, &xq_o, &xs_o, &wq_o, &ws_o, &out_o, &threads_o))
        return NULL;
    int threads = threads_arg(threads_o, fn);
    if (threads < 0) return NULL;
    Py_buffer v[5];
    int got = 0;
    PyObject *result = NULL;
    char msg[200];
    if (get_array(xq_o, fn, "xq", I8, 2, 0, &v[0]) < 0) goto done;
    got++;
    if (get_array(xs_o, fn, "xs", F32, 2, 0, &v[1]) < 0) goto done;
    got++;
    if (get_array(wq_o, fn, "wq", I8, 2, 0, &v[2]) < 0) goto done;
    got++;
    if (get_array(ws_o, fn, "ws", F32, 2, 0, &v[3]) < 0) goto done;
    got++;
    if (get_array(out_o, fn, "out", F32, 2, 1, &v[4]) < 0) goto done;
    got++;
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
    MatmulCtx c = {v[0].buf, NULL, v[1].buf, v[2].buf, v[3].buf, v[4].buf, M, N, K, use_simd()};
    uint8_t *xa = NULL;
    if (c.simd && M * K > 0) {
        xa = PyMem_Malloc((size_t)(M * K));
        if (!xa) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; xa && i < M * K; i++) {
        int8_t q = c.xq[i];
        xa[i] = (uint8_t)(q < 0 ? -(int)q : q);
    }
    c.xa = (const int8_t *)xa;
    pool_run(matmul_part, &c, parts_for((N + 3) / 4, threads));
    Py_END_ALLOW_THREADS
    PyMem_Free(xa);
    result = Py_NewRef(out_o);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* ---------------------------------------------------------------------------------------------
   attention */

typedef struct {
    const float *q, *k, *v;
    const int64_t *pos;
    float *out, *scratch;
    Py_ssize_t M, H, D, T, scratch_per_part;
    long long window;
    float scale;
    int simd;
} AttnCtx;

/* The first cache position row m attends to (its last is pos). */
static Py_ssize_t attn_start(const AttnCtx *c, Py_ssize_t pos) {
    if (c->window > 0 && pos - c->window + 1 > 0) return (Py_ssize_t)(pos - c->window + 1);
    return 0;
}

/* In place: s[p * stride] -> expf(s - max) for p < n; returns their sum in position order. One
   function (not inlined) for both paths, so both make the same libm calls. */
__attribute__((noinline)) static float softmax_weights(float *s, Py_ssize_t n, Py_ssize_t stride) {
    float mx = s[0];
    for (Py_ssize_t p = 1; p < n; p++)
        if (s[p * stride] > mx) mx = s[p * stride];
    float sum = 0.0f;
    for (Py_ssize_t p = 0; p < n; p++) {
        float e = expf(s[p * stride] - mx);
        s[p * stride] = e;
        sum += e;
    }
    return sum;
}

/* dot16 of the contract: 16 lanes (lane d % 16) of fma chains, then u_i = l_i + l_{i+8}, tree8(u). */
static float dot16_scalar(const float *a, const float *b, Py_ssize_t D) {
    float l[16] = {0};
    for (Py_ssize_t d = 0; d < D; d++) l[d % 16] = fmaf(a[d], b[d], l[d % 16]);
    float u[8];
    for (int i = 0; i < 8; i++) u[i] = l[i] + l[i + 8];
    return tree8(u);
}

/* One (m, h) pair by the contract's definition; scratch holds n + D floats. */
static void attend_scalar(const AttnCtx *c, Py_ssize_t m, Py_ssize_t h, float *scratch) {
    const Py_ssize_t D = c->D, pos = (Py_ssize_t)c->pos[m], start = attn_start(c, pos), n = pos - start + 1;
    const float *q = c->q + (m * c->H + h) * D;
    float *s = scratch, *acc = scratch + n, *out = c->out + (m * c->H + h) * D;
    for (Py_ssize_t p = 0; p < n; p++) s[p] = dot16_scalar(q, c->k + (start + p) * D, D) * c->scale;
    float sum = softmax_weights(s, n, 1);
    for (Py_ssize_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (Py_ssize_t p = 0; p < n; p++) {
        const float *vp = c->v + (start + p) * D;
        for (Py_ssize_t d = 0; d < D; d++) acc[d] = fmaf(s[p], vp[d], acc[d]);
    }
    for (Py_ssize_t d = 0; d < D; d++) out[d] = acc[d] / sum;
}

#if HAVE_X86
/* dot16's two 8-lane halves for query row q against key row k (D % 16 == 0): returns l[0..7] + l[8..15]. */
AVX2 static inline __m256 dot16_halves(const float *q, const float *k, Py_ssize_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (Py_ssize_t d = 0; d < D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
    }
    return _mm256_add_ps(a0, a1);
}

/* Heads h..h+G-1 (G <= 4) of row m, which share each K and V row read: four heads are always
   computed (a short group repeats its last head) and only the G real ones stored. Each head's
   arithmetic is attend_scalar's. scratch holds 4 * n floats, scores laid out [p][head]. */
AVX2 static void attend4_avx2(const AttnCtx *c, Py_ssize_t m, Py_ssize_t h, int G, float *scratch) {
    const Py_ssize_t D = c->D, pos = (Py_ssize_t)c->pos[m], start = attn_start(c, pos), n = pos - start + 1;
    const float *q[4];
    for (int j = 0; j < 4; j++) q[j] = c->q + (m * c->H + h + (j < G ? j : G - 1)) * D;
    float *s = scratch;
    const __m128 scale = _mm_set1_ps(c->scale);
    for (Py_ssize_t p = 0; p < n; p++) {
        const float *kp = c->k + (start + p) * D;
        __m256 u0 = dot16_halves(q[0], kp, D), u1 = dot16_halves(q[1], kp, D);
        __m256 u2 = dot16_halves(q[2], kp, D), u3 = dot16_halves(q[3], kp, D);
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(u0, u1), _mm256_hadd_ps(u2, u3));  /* tree8, as in tile4_avx2 */
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        _mm_storeu_ps(s + 4 * p, _mm_mul_ps(r, scale));
    }
    float sum[4];
    for (int j = 0; j < 4; j++) sum[j] = j < G ? softmax_weights(s + j, n, 4) : 1.0f;
    for (Py_ssize_t d = 0; d < D; d += 16) {
        __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
               a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
               a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
        for (Py_ssize_t p = 0; p < n; p++) {
            const float *vp = c->v + (start + p) * D + d;
            const __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8);
            const float *e = s + 4 * p;
            __m256 e0 = _mm256_broadcast_ss(e), e1 = _mm256_broadcast_ss(e + 1);
            __m256 e2 = _mm256_broadcast_ss(e + 2), e3 = _mm256_broadcast_ss(e + 3);
            a00 = _mm256_fmadd_ps(e0, v0, a00);
            a01 = _mm256_fmadd_ps(e0, v1, a01);
            a10 = _mm256_fmadd_ps(e1, v0, a10);
            a11 = _mm256_fmadd_ps(e1, v1, a11);
            a20 = _mm256_fmadd_ps(e2, v0, a20);
            a21 = _mm256_fmadd_ps(e2, v1, a21);
            a30 = _mm256_fmadd_ps(e3, v0, a30);
            a31 = _mm256_fmadd_ps(e3, v1, a31);
        }
        __m256 acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
        for (int j = 0; j < G; j++) {
            float *out = c->out + (m * c->H + h + j) * D + d;
            const __m256 vs = _mm256_set1_ps(sum[j]);
            _mm256_storeu_ps(out, _mm256_div_ps(acc[j][0], vs));
            _mm256_storeu_ps(out + 8, _mm256_div_ps(acc[j][1], vs));
        }
    }
}
#endif

static void attn_part(void *ctx, int part, int nparts) {
    const AttnCtx *c = ctx;
    float *scratch = c->scratch + part * c->scratch_per_part;
    Py_ssize_t lo, hi;
    part_range(c->M * c->H, 1, part, nparts, &lo, &hi);
    for (Py_ssize_t i = lo; i < hi;) {
        Py_ssize_t m = i / c->H, h = i % c->H;
#if HAVE_X86
        if (c->simd) {
            Py_ssize_t g = c->H - h;  /* this row's heads left in the part, at most 4 */
            if (g > hi - i) g = hi - i;
            if (g > 4) g = 4;
            attend4_avx2(c, m, h, (int)g, scratch);
            i += g;
            continue;
        }
#endif
        attend_scalar(c, m, h, scratch);
        i++;
    }
}

/* attention(q, k_cache, v_cache, positions, window, scale, out, threads=None) -> out */
static PyObject *attention(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"q", "k_cache", "v_cache", "positions", "window", "scale", "out", "threads", NULL};
    static const char *fn = "attention";
    PyObject *q_o, *k_o, *v_o, *p_o, *out_o, *threads_o = Py_None;
    long long window;
    float scale;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOLfO|O", kwlist, &q_o, &k_o, &v_o, &p_o, &window, &scale,
                                     &out_o, &threads_o))
        return NULL;
    int threads = threads_arg(threads_o, fn);
    if (threads < 0) return NULL;
    Py_buffer v[5];
    int got = 0;
    PyObject *result = NULL;
    char msg[200];
    if (get_array(q_o, fn, "q", F32, 3, 0, &v[0]) < 0) goto done;
    got++;
    if (get_array(k_o, fn, "k_cache", F32, 2, 0, &v[1]) < 0) goto done;
    got++;
    if (get_array(v_o, fn, "v_cache", F32, 2, 0, &v[2]) < 0) goto done;
    got++;
    if (get_array(p_o, fn, "positions", I64, 1, 0, &v[3]) < 0) goto done;
    got++;
    if (get_array(out_o, fn, "out", F32, 3, 1, &v[4]) < 0) goto done;
    got++;
    Py_ssize_t M = v[0].shape[0], H = v[0].shape[1], D = v[0].shape[2], T = v[1].shape[0];
    if (v[1].shape[1] != D || v[2].shape[0] != T || v[2].shape[1] != D || v[3].shape[0] != M ||
        v[4].shape[0] != M || v[4].shape[1] != H || v[4].shape[2] != D || H < 1 || D < 1) {
        snprintf(msg, sizeof msg,
                 "shapes must be q [M, H, D], k_cache and v_cache [T, D], positions [M], out [M, H, D] (H, D >= 1); "
                 "got q [%zd, %zd, %zd], k_cache [%zd, %zd], v_cache [%zd, %zd], positions [%zd], out [%zd, %zd, %zd]",
                 M, H, D, T, v[1].shape[1], v[2].shape[0], v[2].shape[1], v[3].shape[0], v[4].shape[0], v[4].shape[1],
                 v[4].shape[2]);
        shape_error(fn, msg);
        goto done;
    }
    const int64_t *pos = v[3].buf;
    for (Py_ssize_t m = 0; m < M; m++)
        if (pos[m] < 0 || pos[m] >= T) {
            snprintf(msg, sizeof msg, "positions[%zd] = %lld is outside the cache (0..%zd)", m, (long long)pos[m], T - 1);
            shape_error(fn, msg);
            goto done;
        }
    if (M == 0) {
        result = Py_NewRef(out_o);
        goto done;
    }
    int simd = use_simd() && D % 16 == 0;
    int nparts = parts_for(M * H, threads);
    Py_ssize_t per_part = simd ? 4 * T : T + D;
    float *scratch = PyMem_Malloc(sizeof(float) * (size_t)(per_part * nparts));
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    AttnCtx c = {v[0].buf, v[1].buf, v[2].buf, pos, v[4].buf, scratch, M, H, D, T, per_part, window, scale, simd};
    Py_BEGIN_ALLOW_THREADS
    pool_run(attn_part, &c, nparts);
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    result = Py_NewRef(out_o);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* ---------------------------------------------------------------------------------------------
   Settings */

static PyObject *set_threads(PyObject *self, PyObject *arg) {
    long t = PyLong_AsLong(arg);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (t < 1 || t > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "set_threads: n must be 1..%d, not %ld", MAX_THREADS, t);
        return NULL;
    }
    int prev = n_threads;
    n_threads = (int)t;
    return PyLong_FromLong(prev);
}

static PyObject *get_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(n_threads); }

static PyObject *force_scalar_fn(PyObject *self, PyObject *arg) {
    int flag = PyObject_IsTrue(arg);
    if (flag < 0) return NULL;
    int prev = force_scalar;
    force_scalar = flag;
    return PyBool_FromLong(prev);
}

static PyObject *simd_fn(PyObject *self, PyObject *unused) { return PyUnicode_FromString(use_simd() ? "avx2" : "scalar"); }

static PyMethodDef methods[] = {
    {"quantize_rows", (PyCFunction)(void (*)(void))quantize_rows, METH_VARARGS | METH_KEYWORDS,
     "quantize_rows(x) -> (xq, xs): float32 [M, K] rows to Q8_0 int8 codes [M, K] and float32 block scales [M, K/32]"},
    {"matmul_q8", (PyCFunction)(void (*)(void))matmul_q8, METH_VARARGS | METH_KEYWORDS,
     "matmul_q8(xq, xs, wq, ws, out, threads=None) -> out: out[m, n] = sum over blocks of xs*ws*idot (see the source)"},
    {"attention", (PyCFunction)(void (*)(void))attention, METH_VARARGS | METH_KEYWORDS,
     "attention(q, k_cache, v_cache, positions, window, scale, out, threads=None) -> out (see the source)"},
    {"set_threads", set_threads, METH_O, "set_threads(n) -> the previous thread count"},
    {"get_threads", get_threads, METH_NOARGS, "get_threads() -> the thread count calls use by default"},
    {"_force_scalar", force_scalar_fn, METH_O, "_force_scalar(flag) -> previous flag: run the portable scalar code"},
    {"simd", simd_fn, METH_NOARGS, "simd() -> 'avx2' or 'scalar': the code that runs now"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "server._cpu_kernels",
                                    "The CPU path's int8 matmul and attention kernels in C (see the source's header).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
#if HAVE_X86
    __builtin_cpu_init();
    cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    cpu_set_t set;
    long cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    n_threads = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
    static int fork_handler = 0;
    if (!fork_handler && pthread_atfork(NULL, NULL, pool_after_fork_child) == 0) fork_handler = 1;
    return PyModule_Create(&module);
}
