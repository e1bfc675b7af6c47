/* server._cpu_kernels: the CPU path's per-step kernels for the bundled Gemma 3 270M (Q8_0-style int8
matmuls and single-KV-head attention), in C with AVX2 / AVX-VNNI / AVX-512 VNNI where the CPU has them.

Contract (batch invariance): every output row is bit for bit the same whatever the number of rows M in
the call, the number of threads, and which code runs (AVX-512 VNNI, AVX-VNNI, AVX2 or portable scalar). The server
verifies a 16-token draft in one call and must get exactly the logits 16 one-token calls give. So:
  - threads split the work by output columns n (matmul_q8) or by (m, h) pairs (attention), never a
    reduction; each output's arithmetic is one fixed sequence of float operations that depends on
    neither M, nor the tile or thread it lands in;
  - the scalar code performs that same sequence: every fused multiply-add is explicit (_mm256_fmadd_ps
    there, fmaf here), the code has no a * b + c expression a compiler could contract differently, and
    integer dot products are exact, so their order is free;
  - the softmax's exponential is exp_sf, a fixed sequence of IEEE operations in both paths.
The scalar path also serves CPUs without AVX2/FMA (picked at run time, __builtin_cpu_supports) and
any D not a multiple of 16 in attention; _force_scalar(True) selects it for tests, _force_path(name)
any of matmul_q8's paths.

Functions (arrays through the buffer protocol, C-contiguous, native byte order; checked, TypeError for a
wrong dtype or a non-array, ValueError for a wrong shape, non-contiguous or read-only output):
  quantize_rows(x) -> (xq, xs): x float32 [M, K], K % 32 == 0; xq int8 [M, K], xs float32 [M, K/32].
      Per 32-value block: d = max|x| / 127 (fp32 division), q = rint(x / d) (round half to even)
      clamped to [-127, 127], all zeros when d == 0 (llama.cpp's Q8_0 rule, d kept in fp32).
      x must be finite.
  matmul_q8(xq, xs, wq, ws, out, threads=None, packed=None) -> out: xq int8 [M, K], xs float32
      [M, K/32], wq int8 [N, K], ws float32 [N, K/32], out float32 [M, N]; packed None or uint8
      [packed_size(N, K)] holding pack_q8(wq, ws) (of these very arrays: the SIMD paths read W from
      it, the scalar path from wq / ws; without it a SIMD call packs W itself, every call). Per output:
          d(b) = sum over i = 0..31 of xq[m, 32b + i] * wq[n, 32b + i]      (exact int32, one per block)
          s(b) = xs[m, b] * ws[n, b]                                         (rounded to fp32)
          acc[b % 4] = fmaf(s(b), (float)d(b), acc[b % 4])                   (one rounding)
      for b = 0, 1, ..., K/32 - 1 in order, the 4 fp32 accumulators starting at +0, and then
          out[m, n] = (acc[0] + acc[1]) + (acc[2] + acc[3]).
      K/32 need not be a multiple of 4: the SIMD paths pad the last group of 4 blocks with zero codes
      and zero scales, and a padded block's fmaf(+0, 0, acc) returns acc exactly (acc is never -0:
      it starts at +0 and a round-to-nearest sum is -0 only if both terms are), so a row's operations
      are the definition's whatever K, M, the tile or the thread. wq codes must lie in [-127, 127]
      (AVX2 applies x's sign to w: a -128 there wraps); xq may be any int8.
  pack_q8(wq, ws, out, threads=None) -> out: W in the SIMD paths' layout, out uint8 [packed_size(N, K)].
      W rows in tiles of 4 (the last padded with zero rows), blocks in groups of 4 (the last padded
      with zero blocks); tile T's groups are consecutive records of 576 bytes, group g's record:
      8 steps t of 64 bytes, byte 16 r + 4 q + i = wq[4T + r, 32 (4g + q) + 4t + i] + 128 (as unsigned,
      i.e. the code's bits ^ 0x80), then 16 fp32 scales, lane 4 r + q = ws[4T + r, 4g + q] (0 when padded).
      So a 16-lane int32 vector of a step holds, lane 4 r + q, 4 consecutive codes of W row r's block q.
  packed_size(N, K) -> ceil(N / 4) * ceil(K / 128) * 576.
  rms_norm(x, weight, eps, out, residual=None) -> out: x float32 [R, N], weight float32 [N] or None,
      residual None or float32 [R, N], out float32 [R, N] (it may be residual itself). Per row:
          l[i % 16] = fmaf(x_i, x_i, l[i % 16]) for i in order from +0;  ss = tree8(l_i + l_{i+8});
          inv = 1 / sqrtf(ss / N + eps);  y_i = x_i * inv (* w_i);  out_i = y_i, or residual_i + y_i.
      One thread, one fixed sequence a row (a norm is a few microseconds; numpy's four calls were
      most of a one-token step's glue).
  attention(q, k_cache, v_cache, positions, window, scale, out, threads=None) -> out:
      q float32 [M, H, D], k_cache / v_cache float16 [T, D] (one KV head shared by the H query heads;
      each value read as its exact float),
      positions int64 [M] (each in 0..T-1), window int, scale float, out float32 [M, H, D]. Row m
      attends to cache positions p with start <= p <= positions[m], start = max(0, positions[m] -
      window + 1) when window > 0, else 0. Per (m, h):
          s_p = dot16(q[m, h], k[p]) * scale,  dot16: lane i = fma chain over d = i, i + 16, ... in
                order from +0, then u_i = l_i + l_{i+8} (i < 8) and tree8(u);
          mx = max_p s_p; e_p = exp_sf(s_p - mx) (see exp_sf); sum = e_start + ... in position order;
          out[m, h, d] = acc_d / sum,  acc_d = fma chain of (e_p, v[p, d]) in position order from +0.
      A token tree (ancestors int64 [M], tree_start >= 0): the step's rows sit in slots tree_start..;
      row m is at position positions[m] = tree_start + depth and bit j of ancestors[m] marks step
      slot tree_start + j as one of its ancestors (or itself), so its k-th set bit is its ancestor at
      depth k. Row m attends to slots start..tree_start-1 and then to those ancestors in depth order
      (those at positions >= start): the keys a chain row at that position sees, in the same order,
      so a tree row's output equals the chain row's bit for bit.
  attention_many(calls, threads=None) -> None: several attention calls at once, each a tuple of
      attention's arguments but threads (q, k_cache, v_cache, positions, window, scale, out[,
      tree_start, ancestors]), each out written with the bits attention writes for that call alone;
      the calls run side by side on the threads (a batched forward's sequences; see its comment).
  set_threads(n) -> previous count (1..64; the default is the CPUs this process may run on);
  get_threads(); paths() -> matmul_q8's paths this CPU runs ("scalar", "avx2", "avxvnni", "avx512",
  best last); _force_path(name or None) -> the previous forced name or None (ValueError for a path
  this CPU lacks); _force_scalar(flag) -> previous flag (False: unforced); simd() -> the path matmul_q8
  runs now for M >= 2 (unforced, an M = 1 call runs at most M1_PATH's code: see matmul_q8).
  A call's threads= overrides the module count for that call. out must not overlap an input.
The GIL is released around all compute. Threads are a small pool of pthreads started on first use
(they spin about 0.2 ms after a call for the next one, then sleep); a fork()ed child starts its own.

Why these loops: at M = 1 a matmul is a stream of the weights (the LM head: 262144 x 640 int8, 189 MB
packed a call), so W is read once per call whatever M: a stride of W tiles stays in L1 and meets every
x row (of an m_block whose records stay in L2) before the next is read. Each block's dot product is
completed in one int32 lane before any float operation: a step's vpdpbusd adds 4 codes of each lane's
block (W as w + 128 unsigned against x signed, the lane starting from -128 * the block's x codes' sum;
exact), 8 steps finish the 16 (W row, block) lanes of a tile's group, and then one convert, one scale
multiply and one fma per lane cover 4 blocks of 4 outputs (the previous definition spent those three
float operations per 8 lanes of partial sums, per block pair). x rows are re-laid out per call to match
(a step's 4 blocks' 4 codes broadcast to the 4 W rows' lanes). AVX-512: micro-tiles of 4 x rows by
2 tiles (8 int32 + 8 fp32 accumulators); AVX-VNNI and AVX2 (16 ymm registers): 2 x rows by one tile
as two 8-lane halves (AVX2 forms the exact dot from maddubs + madd on |x| and w with x's sign, adding
int32 lanes). Outputs are reduced from the accumulator lanes once, at the end.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
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
#define SPIN_NS 200000    /* how long an idle worker (or a waiting caller) spins before sleeping */

static int n_threads = 1;     /* set at import: the CPUs this process may run on */
/* matmul_q8's code paths, best last; quantize_rows and attention have AVX2 code only, which runs
   whenever the path in use is not the scalar one. */
enum { PATH_SCALAR, PATH_AVX2, PATH_AVXVNNI, PATH_AVX512, N_PATHS };
static const char *path_names[N_PATHS] = {"scalar", "avx2", "avxvnni", "avx512"};
static int cpu_paths[N_PATHS] = {1, 0, 0, 0};  /* which paths this CPU runs, checked once at import */
static int best_path = PATH_SCALAR;
static int forced_path = -1;                   /* _force_path / _force_scalar: tests compare the paths */

static int matmul_path(void) { return forced_path >= 0 ? forced_path : best_path; }
static int use_simd(void) { return matmul_path() != PATH_SCALAR; }
static int have_f16c = 0;  /* set at import: the attention's AVX2 code reads the float16 cache through F16C */

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

typedef enum { F32, I8, I64, U8, F16 } dtype;
static const char *dtype_names[] = {"float32", "int8", "int64", "uint8", "float16"};

static int format_is(const Py_buffer *v, dtype dt) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;  /* native order (the CPUs here are little-endian) */
    if (f[0] == '\0' || f[1] != '\0') return 0;
    switch (dt) {
    case F32: return *f == 'f' && v->itemsize == 4;
    case I8: return *f == 'b' && v->itemsize == 1;
    case I64: return (*f == 'l' || *f == 'q') && v->itemsize == 8;
    case U8: return *f == 'B' && v->itemsize == 1;
    case F16: return *f == 'e' && v->itemsize == 2;
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

/* The arrays of one call, acquired in order with get_array (spec i for objs[i] into views[i]). Returns
   how many were acquired: n on success; fewer, with the error set, when one failed (those acquired
   are the caller's to release, as on success). */
typedef struct { const char *name; dtype dt; int ndim; int writable; } ArraySpec;

static int get_arrays(const char *fn, int n, const ArraySpec *spec, PyObject *const *objs, Py_buffer *views) {
    for (int i = 0; i < n; i++)
        if (get_array(objs[i], fn, spec[i].name, spec[i].dt, spec[i].ndim, spec[i].writable, &views[i]) < 0)
            return i;
    return n;
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

#define GROUP 4                      /* blocks per group: the 4 accumulators of an output */
#define TILE 4                       /* W rows per packed tile */
#define WREC (8 * 64 + 16 * 4)       /* bytes of one packed (tile, group) record: codes, then 16 scales */
#define XREC (8 * 16 * 2 + 16 * 2)   /* bytes of one (x row, group) record: codes, |codes|, xc, xs */
#define XREC512 (8 * 16 + 16 * 2)    /* the AVX-512 path's record: codes, xc, xs (no |codes|) */

static inline Py_ssize_t groups_of(Py_ssize_t K) { return (K / QBLOCK + GROUP - 1) / GROUP; }
static inline Py_ssize_t packed_bytes(Py_ssize_t N, Py_ssize_t K) {
    return (N + TILE - 1) / TILE * groups_of(K) * WREC;
}

/* pack_q8's layout (see the header): tiles t_lo..t_hi-1 of W into `out`. */
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


static inline float tree8(const float *l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

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

AVX2 static void matmul_tiles_avx2(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) { TILE_LOOP(kernel_avx2, 2, 1) }

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

VNNI256 static void matmul_tiles_avxvnni(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) {
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

AVX512 static void matmul_tiles_avx512(const MatmulCtx *c, Py_ssize_t t_lo, Py_ssize_t t_hi) {
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
   Which thread computes a tile changes none of its bits (see the top of the file). */
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
static PyObject *pack_q8(PyObject *self, PyObject *args, PyObject *kwargs) {
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
static PyObject *packed_size(PyObject *self, PyObject *args) {
    Py_ssize_t N, K;
    if (!PyArg_ParseTuple(args, "nn", &N, &K)) return NULL;
    if (N < 0 || K < 0 || K % QBLOCK) {
        PyErr_Format(PyExc_ValueError, "packed_size: N >= 0 and K >= 0 a multiple of %d, not (%zd, %zd)", QBLOCK, N, K);
        return NULL;
    }
    return PyLong_FromSsize_t(packed_bytes(N, K));
}

/* matmul_q8(xq, xs, wq, ws, out, threads=None, packed=None) -> out */
static PyObject *matmul_q8(PyObject *self, PyObject *args, PyObject *kwargs) {
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

/* exp_sf(x), the softmax's exponential (contract: exp_sf): Cephes' expf as a fixed sequence of IEEE
   operations, x clamped to [EXP_LO, 0] (softmax inputs are s - max <= 0):
       n = rint(x * LOG2E);  r = fmaf(n, -LN2_HI, x);  r = fmaf(n, -LN2_LO, r);
       p = P0;  p = fmaf(p, r, P_i) for P1..P5;  y = fmaf(p, r * r, r) + 1;  exp_sf = y * 2^n
   exp_sf_avx2 performs the same operations lane by lane, so both paths give the same bits (within
   about 2 ulp of expf). libm's expf, one call per score, was most of a verify's attention time. */
#define EXP_LO -87.33654f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_sf(float x) {
    x = x < EXP_LO ? EXP_LO : (x > 0.0f ? 0.0f : x);
    const float n = rintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    const float z = r * r;
    const float y = fmaf(p, z, r) + 1.0f;
    union { uint32_t u; float f; } two_n = {(uint32_t)((int32_t)n + 127) << 23};
    return y * two_n.f;
}

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

/* dot16's two 8-lane halves for query row q against key row k (D % 16 == 0): returns l[0..7] + l[8..15]. */
AVX2H static inline __m256 dot16_halves(const float *q, const uint16_t *k, Py_ssize_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (Py_ssize_t d = 0; d < D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8h(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8h(k + d + 8), a1);
    }
    return _mm256_add_ps(a0, a1);
}

/* exp_sf on 8 lanes: the scalar function's operations, lane by lane. */
AVX2 static inline __m256 exp_sf_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_setzero_ps());
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    const __m256 z = _mm256_mul_ps(r, r);
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

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
   its two 8-lane halves added, then tree8 through the hadds, as in tile4_avx2). */
AVX2H static inline void score4(const float *const q[4], const uint16_t *kp, Py_ssize_t D, __m128 scale, float *out) {
    __m256 u0 = dot16_halves(q[0], kp, D), u1 = dot16_halves(q[1], kp, D);
    __m256 u2 = dot16_halves(q[2], kp, D), u3 = dot16_halves(q[3], kp, D);
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

#if HAVE_X86
#define LONG_ROW_KEYS 1024  /* a single row over at least this many keys is split by keys and values */
#define ATTN_BLOCK 32  /* keys per block: 32 KB of K or of V at D = 256, still in L1/L2 for the next row */
#define ROWS_512 16  /* rows per attend_rows_512 call (a 16-token verify's rows in one or two calls) */

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


/* Rows m..m+R-1 (R <= 4) of a chain (no tree), all H <= 4 heads of each: for every (row, head) the
   very arithmetic of attend4_avx2 (the same dot16 and score code, softmax4_weights_avx2, and per
   output element the same fma chain over the row's keys in position order from +0; a chain is only
   paused at block ends, its accumulator stored and reloaded exactly). Keys are taken in blocks of
   ATTN_BLOCK, and every row works through a block before the next block is read: a verify's rows
   share nearly all their keys, so the cache is read from memory once for R rows instead of R
   times. scratch: 16 * S floats of scores and 16 * D of accumulators. */
AVX2H static void attend_rows_avx2(const AttnCtx *c, Py_ssize_t m, int R, float *scratch) {
    const Py_ssize_t D = c->D, H = c->H;
    ChainRows cr;
    chain_rows(c, m, R, scratch, &cr);
    const Py_ssize_t *first = cr.first, *last = cr.last, lo = cr.lo, hi = cr.hi;
    const float *(*q)[4] = cr.q;
    float **s = cr.s, *acc = scratch + 16 * c->S;  /* acc[(r * 4 + j) * D + d] */
    const __m128 scale = _mm_set1_ps(c->scale);
    for (Py_ssize_t b = lo; b <= hi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < hi ? b + ATTN_BLOCK - 1 : hi;
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > first[r] ? b : first[r], pb = bend < last[r] ? bend : last[r];
            for (Py_ssize_t p = pa; p <= pb; p++) score4(q[r], c->k + p * D, D, scale, s[r] + 4 * (p - first[r]));
        }
    }
    float sum[4][4];
    for (int r = 0; r < R; r++) softmax4_weights_avx2(s[r], last[r] - first[r] + 1, sum[r]);
    for (Py_ssize_t i = 0; i < 16 * D; i++) acc[i] = 0.0f;
    for (Py_ssize_t b = lo; b <= hi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < hi ? b + ATTN_BLOCK - 1 : hi;
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > first[r] ? b : first[r], pb = bend < last[r] ? bend : last[r];
            if (pa > pb) continue;
            float *ar = acc + r * 4 * D;
            for (Py_ssize_t d = 0; d < D; d += 16) {
                __m256 a[8];
                for (int j = 0; j < 4; j++) {
                    a[2 * j] = _mm256_loadu_ps(ar + j * D + d);
                    a[2 * j + 1] = _mm256_loadu_ps(ar + j * D + d + 8);
                }
                for (Py_ssize_t p = pa; p <= pb; p++) accumulate4(a, s[r] + 4 * (p - first[r]), c->v + p * D + d);
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
            for (Py_ssize_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_div_ps(_mm256_loadu_ps(ar + d), vs));
        }
}
#endif

#if HAVE_X86
/* The attention's AVX-512 code: the same arithmetic on 16-lane registers. A 16-lane fma chain over
   d = i, i + 16, ... holds dot16's lanes l_0..l_15 at once (AVX2 keeps them in two 8-lane halves),
   and each output element's fma chain over keys is the same whatever the vector holding it, so every
   value equals the AVX2 and scalar code's bit for bit (tests/test_cpu_kernels.py compares the paths).
   Zen 5 and recent Intel cores issue two 16-lane FMAs a cycle, twice AVX2's lanes. */
#define AVX512H __attribute__((target("avx2,fma,f16c,avx512f")))

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
   the rows; and the values d = dlo..dhi-1 of every row's heads over all its keys, each output
   element's fma chain in position order, paused at block ends with its accumulator (acc: 4 * R * D
   floats, acc[(r * 4 + j) * D + d]) stored and reloaded exactly, then divided by the head's sum. So
   a score or an output element is the same whichever part computes it. */
AVX512H static void rows_scores_512(const AttnCtx *c, const ChainRows *cr, int R, Py_ssize_t klo, Py_ssize_t khi,
                                    float *kb) {
    const Py_ssize_t D = c->D;
    const __m128 scale = _mm_set1_ps(c->scale);
    for (Py_ssize_t b = klo; b <= khi; b += ATTN_BLOCK) {
        const Py_ssize_t bend = b + ATTN_BLOCK - 1 < khi ? b + ATTN_BLOCK - 1 : khi;
        for (Py_ssize_t i = 0; i < (bend - b + 1) * D; i += 16) _mm512_storeu_ps(kb + i, load16h(c->k + b * D + i));
        for (int r = 0; r < R; r++) {
            const Py_ssize_t pa = b > cr->first[r] ? b : cr->first[r], pb = bend < cr->last[r] ? bend : cr->last[r];
            if (pa <= pb) score_block_512(cr->q[r], kb, b, pa, pb, cr->first[r], D, scale, cr->s[r]);
        }
    }
}

AVX512H static void rows_values_512(const AttnCtx *c, const ChainRows *cr, Py_ssize_t m, int R,
                                    const float (*sum)[4], Py_ssize_t dlo, Py_ssize_t dhi, float *acc) {
    const Py_ssize_t D = c->D, H = c->H;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            for (Py_ssize_t d = dlo; d < dhi; d++) acc[(r * 4 + j) * D + d] = 0.0f;
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
                for (Py_ssize_t p = pa; p <= pb; p++) accumulate4x32(a, sr + 4 * (p - pa), c->v + p * D + d);
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

/* Up to ROWS_512 rows of a chain over a long run of keys (a verify deep into a conversation), split
   between threads as attend_long_row splits one row: the scores by keys (each thread converting its
   own blocks), the softmax by rows, the values by output elements. Every thread reads its share of
   the cache once for all the rows, where attn_part's split by rows has each part read all of it
   (two threads, four rows: the cache read twice, each thread at its own memory's pace). */
typedef struct {
    const AttnCtx *c;
    ChainRows cr;
    Py_ssize_t m;
    int R;
    float *acc, *kb, sum[ROWS_512][4];
} SplitRows;

AVX512H static void split_rows_scores(void *ctx, int part, int nparts) {
    SplitRows *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->cr.hi - L->cr.lo + 1, ATTN_BLOCK, part, nparts, &lo, &hi);
    if (lo < hi) rows_scores_512(L->c, &L->cr, L->R, L->cr.lo + lo, L->cr.lo + hi - 1, L->kb + part * ATTN_BLOCK * L->c->D);
}

static void split_rows_softmax(void *ctx, int part, int nparts) {
    SplitRows *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->R, 1, part, nparts, &lo, &hi);
    for (Py_ssize_t r = lo; r < hi; r++) softmax4_weights_avx2(L->cr.s[r], L->cr.last[r] - L->cr.first[r] + 1, L->sum[r]);
}

AVX512H static void split_rows_values(void *ctx, int part, int nparts) {
    SplitRows *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->c->D, 32, part, nparts, &lo, &hi);
    if (lo < hi) rows_values_512(L->c, &L->cr, L->m, L->R, (const float (*)[4])L->sum, lo, hi, L->acc);
}

/* Rows m..m+R-1 (R <= ROWS_512) of c (a chain, H <= 4, AVX-512) split over `threads`; scratch as
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

/* One row over a long run of keys (a decode step deep into a conversation): split between threads
   by keys for the scores and by output elements for the values, never inside a reduction, so each
   value is attend4's. Splitting by heads (attn_part) would give each of 2 threads 2 of 4 heads, and
   attend4 computes 4 heads whatever G: half its work wasted. */
typedef struct {
    const AttnCtx *c;
    KeyList keys;
    const float *q[4];
    float *s, sum[4];
    int G;
} LongRow;

AVX512H static void long_row_scores_512(void *ctx, int part, int nparts) {
    LongRow *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->keys.n, 16, part, nparts, &lo, &hi);
    if (lo < hi) score_run_512(L->c, &L->keys, L->q, lo, hi - 1, 0, L->s);
}

AVX2H static void long_row_scores_avx2(void *ctx, int part, int nparts) {
    LongRow *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->keys.n, 16, part, nparts, &lo, &hi);
    const __m128 scale = _mm_set1_ps(L->c->scale);
    for (Py_ssize_t p = lo; p < hi; p++) score4(L->q, L->c->k + key_slot(&L->keys, p) * L->c->D, L->c->D, scale, L->s + 4 * p);
}

AVX512H static void long_row_values_512(void *ctx, int part, int nparts) {
    LongRow *L = ctx;
    Py_ssize_t lo, hi;
    part_range(L->c->D, 32, part, nparts, &lo, &hi);
    for (Py_ssize_t d = lo; d < hi; d += 32) values_512(L->c, &L->keys, 0, 0, L->G, L->s, L->sum, d);
}

AVX2H static void long_row_values_avx2(void *ctx, int part, int nparts) {
    LongRow *L = ctx;
    const AttnCtx *c = L->c;
    Py_ssize_t lo, hi;
    part_range(c->D, 16, part, nparts, &lo, &hi);
    for (Py_ssize_t d = lo; d < hi; d += 16) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (Py_ssize_t p = 0; p < L->keys.n; p++) accumulate4(a, L->s + 4 * p, c->v + key_slot(&L->keys, p) * c->D + d);
        for (int j = 0; j < L->G; j++) {
            float *out = c->out + j * c->D + d;
            const __m256 vs = _mm256_set1_ps(L->sum[j]);
            _mm256_storeu_ps(out, _mm256_div_ps(a[2 * j], vs));
            _mm256_storeu_ps(out + 8, _mm256_div_ps(a[2 * j + 1], vs));
        }
    }
}

/* Row 0 of c (M == 1, H <= 4, simd) split over `threads`; scratch holds 4 * S floats. */
static void attend_long_row(const AttnCtx *c, int threads, float *scratch) {
    LongRow L = {.c = c, .s = scratch, .G = (int)c->H};
    attn_keys(c, 0, &L.keys);
    for (int j = 0; j < 4; j++) L.q[j] = c->q + (j < c->H ? j : c->H - 1) * c->D;
    const int wide = c->simd == 2;
    pool_run(wide ? long_row_scores_512 : long_row_scores_avx2, &L, parts_for(L.keys.n / 256, threads));
    softmax4_weights_avx2(L.s, L.keys.n, L.sum);
    pool_run(wide ? long_row_values_512 : long_row_values_avx2, &L, parts_for(c->D / (wide ? 32 : 16), threads));
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
        if (c->simd && h == 0 && c->H <= 4 && c->ancestors == NULL && m + 1 < c->M && i + 2 * c->H <= hi) {
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
    int long_keys, split_rows, nparts, threads;
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
    /* a chain over long runs of keys, several threads: split by keys and values, not by rows (one
       row: attend_long_row, on both SIMD paths; several: attend_split_rows, on AVX-512) */
    job->long_keys = simd && H <= 4 && c->ancestors == NULL && threads > 1 && S >= LONG_ROW_KEYS;
    job->split_rows = job->long_keys && M > 1 && simd == 2;
    /* attend_rows_avx2: 4 rows' scores and sums; attend_rows_512: ROWS_512 rows' */
    c->scratch_per_part = simd == 2 ? 4 * ROWS_512 * (S + D) + ATTN_BLOCK * D : simd ? 16 * S + 16 * D : S + D;
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
    if (job->long_keys && c->M == 1)
        attend_long_row(c, job->threads, c->scratch);
    else if (job->split_rows)
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
static PyObject *attention(PyObject *self, PyObject *args, PyObject *kwargs) {
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
static PyObject *attention_many(PyObject *self, PyObject *args, PyObject *kwargs) {
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

/* ---------------------------------------------------------------------------------------------
   rms_norm */

/* One row by the contract's definition (see the module docstring). No multiply may feed an add
   (y * w, then r + y): contraction is off here and in the SIMD twins, whose lanes do the same
   operations, so every path gives the same bits. */
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

/* The sum of squares' lanes l[i % 16] continued over x[from..N) (fmaf in order), folded by
   tree8(l_i + l_{i+8}): the row's 1 / sqrtf(ss / N + eps). */
NO_CONTRACT static float rms_inv(float l[16], const float *x, Py_ssize_t from, Py_ssize_t N, float eps) {
    for (Py_ssize_t i = from; i < N; i++) l[i % 16] = fmaf(x[i], x[i], l[i % 16]);
    float u[8];
    for (int i = 0; i < 8; i++) u[i] = l[i] + l[i + 8];
    const float var = tree8(u) / (float)N;
    return 1.0f / sqrtf(var + eps);
}

/* The elementwise steps over [from, N): y = x * inv (* w), out = y or r + y. */
NO_CONTRACT static void rms_scale(const float *x, const float *w, const float *r, float *out, Py_ssize_t from,
                                  Py_ssize_t N, float inv) {
    for (Py_ssize_t i = from; i < N; i++) {
        float y = x[i] * inv;
        if (w) y = y * w[i];
        out[i] = r ? r[i] + y : y;
    }
}

NO_CONTRACT static void rms_norm_row(const float *x, const float *w, const float *r, float *out, Py_ssize_t N, float eps) {
    float l[16] = {0};
    rms_scale(x, w, r, out, 0, N, rms_inv(l, x, 0, N, eps));
}

#if HAVE_X86
/* rms_norm_row on AVX2: the 16 lanes as two 8-lane halves over whole 16s, the rest by the scalar code. */
NO_CONTRACT AVX2 static void rms_norm_row_avx2(const float *x, const float *w, const float *r, float *out,
                                               Py_ssize_t N, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    const Py_ssize_t N16 = N - N % 16;
    for (Py_ssize_t i = 0; i < N16; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    float l[16];
    _mm256_storeu_ps(l, a0);
    _mm256_storeu_ps(l + 8, a1);
    const float inv = rms_inv(l, x, N16, N, eps);
    const __m256 iv = _mm256_set1_ps(inv);
    const Py_ssize_t N8 = N - N % 8;
    for (Py_ssize_t i = 0; i < N8; i += 8) {
        __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
        if (w) y = _mm256_mul_ps(y, _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(out + i, r ? _mm256_add_ps(_mm256_loadu_ps(r + i), y) : y);
    }
    rms_scale(x, w, r, out, N8, N, inv);
}

/* rms_norm_row with 16 lanes (lane i % 16 of the sum of squares is register lane i % 16) over whole
   16s, the rest by the scalar code. */
NO_CONTRACT AVX512H static void rms_norm_row_512(const float *x, const float *w, const float *r, float *out,
                                                 Py_ssize_t N, float eps) {
    __m512 a = _mm512_setzero_ps();
    const Py_ssize_t N16 = N - N % 16;
    for (Py_ssize_t i = 0; i < N16; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        a = _mm512_fmadd_ps(v, v, a);
    }
    float l[16];
    _mm512_storeu_ps(l, a);
    const float inv = rms_inv(l, x, N16, N, eps);
    const __m512 iv = _mm512_set1_ps(inv);
    for (Py_ssize_t i = 0; i < N16; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + i), iv);
        if (w) y = _mm512_mul_ps(y, _mm512_loadu_ps(w + i));
        _mm512_storeu_ps(out + i, r ? _mm512_add_ps(_mm512_loadu_ps(r + i), y) : y);
    }
    rms_scale(x, w, r, out, N16, N, inv);
}
#endif

/* rms_norm(x, weight, eps, out, residual=None) -> out */
static PyObject *rms_norm(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"x", "weight", "eps", "out", "residual", NULL};
    static const char *fn = "rms_norm";
    PyObject *x_o, *w_o, *out_o, *r_o = Py_None;
    float eps;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOfO|O", kwlist, &x_o, &w_o, &eps, &out_o, &r_o)) return NULL;
    /* x and out, then weight and residual where given, in that order */
    static const ArraySpec x_spec = {"x", F32, 2, 0}, out_spec = {"out", F32, 2, 1}, w_spec = {"weight", F32, 1, 0},
                           r_spec = {"residual", F32, 2, 0};
    ArraySpec specs[4] = {x_spec, out_spec};
    PyObject *objs[4] = {x_o, out_o};
    int n = 2, wi = -1, ri = -1;
    if (w_o != Py_None) {
        wi = n;
        specs[n] = w_spec;
        objs[n++] = w_o;
    }
    if (r_o != Py_None) {
        ri = n;
        specs[n] = r_spec;
        objs[n++] = r_o;
    }
    Py_buffer v[4];
    PyObject *result = NULL;
    char msg[200];
    int got = get_arrays(fn, n, specs, objs, v);
    if (got < n) goto done;
    const Py_ssize_t R = v[0].shape[0], N = v[0].shape[1];
    const Py_buffer *wv = wi >= 0 ? &v[wi] : NULL, *rv = ri >= 0 ? &v[ri] : NULL;
    if (v[1].shape[0] != R || v[1].shape[1] != N || (wv && wv->shape[0] != N) ||
        (rv && (rv->shape[0] != R || rv->shape[1] != N)) || N < 1) {
        snprintf(msg, sizeof msg, "shapes must be x [R, N] (N >= 1), weight [N], out and residual [R, N]; got x [%zd, %zd], "
                 "out [%zd, %zd]", R, N, v[1].shape[0], v[1].shape[1]);
        shape_error(fn, msg);
        goto done;
    }
    {
        const float *x = v[0].buf, *w = wv ? wv->buf : NULL, *r = rv ? rv->buf : NULL;
        float *out = v[1].buf;
        void (*row)(const float *, const float *, const float *, float *, Py_ssize_t, float) = rms_norm_row;
#if HAVE_X86
        if (matmul_path() == PATH_AVX512) row = rms_norm_row_512;
        else if (use_simd()) row = rms_norm_row_avx2;
#endif
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < R; i++) row(x + i * N, w, r ? r + i * N : NULL, out + i * N, N, eps);
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(out_o);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* ---------------------------------------------------------------------------------------------
   gelu_mul, rope */

/* gelu_sf(x): transformers' gelu_pytorch_tanh, 0.5 x (1 + tanh(z)) with z = c (x + 0.044715 x^3),
   c = sqrt(2 / pi), computed as x * sigmoid(2z) (the same function) so that no step cancels:
       z = c * (x + ((0.044715 * x) * x) * x);  e = exp_sf(-2 |z|)  (<= 1; exp_sf, see above);
       s = (z >= 0 ? 1 : e) / (1 + e);  gelu_sf = x * s.
   Within a few ulp of the true value (1 + tanh(z) in float32 loses all digits once tanh(z) nears
   -1, at x below about -4). */
#define GELU_C 0.7978845608028654f
#define GELU_A 0.044715f

NO_CONTRACT static inline float gelu_sf(float x) {
    const float z = GELU_C * (x + ((GELU_A * x) * x) * x);
    const float e = exp_sf(-2.0f * fabsf(z));
    return x * ((z >= 0.0f ? 1.0f : e) / (1.0f + e));
}

#if HAVE_X86
NO_CONTRACT AVX2 static inline __m256 gelu_sf_avx2(__m256 x) {
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(GELU_C),
                                   _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_A), x), x), x)));
    const __m256 e = exp_sf_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e)));
}

NO_CONTRACT AVX2 static void gelu_mul_row_avx2(const float *g, const float *u, float *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu_sf_avx2(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    for (; i < n; i++) out[i] = gelu_sf(g[i]) * u[i];
}
#endif

NO_CONTRACT static void gelu_mul_row(const float *g, const float *u, float *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = gelu_sf(g[i]) * u[i];
}

/* gelu_mul(gate, up, out) -> out: out = gelu_sf(gate) * up elementwise; gate, up [R, N] or, with
   up None, gate [R, 2N] holding gate | up (a fused gate_up projection's output). */
static PyObject *gelu_mul(PyObject *self, PyObject *args) {
    static const char *fn = "gelu_mul";
    PyObject *g_o, *u_o, *out_o;
    if (!PyArg_ParseTuple(args, "OOO", &g_o, &u_o, &out_o)) return NULL;
    const int fused = u_o == Py_None;
    static const ArraySpec spec[3] = {{"gate", F32, 2, 0}, {"out", F32, 2, 1}, {"up", F32, 2, 0}};
    PyObject *const objs[3] = {g_o, out_o, u_o};
    const int n = fused ? 2 : 3;
    Py_buffer v[3];
    PyObject *result = NULL;
    char msg[160];
    int got = get_arrays(fn, n, spec, objs, v);
    if (got < n) goto done;
    const Py_ssize_t R = v[1].shape[0], N = v[1].shape[1];
    if (v[0].shape[0] != R || v[0].shape[1] != (fused ? 2 * N : N) || (!fused && (v[2].shape[0] != R || v[2].shape[1] != N))) {
        snprintf(msg, sizeof msg, "shapes must be gate and up [R, N] (or gate [R, 2N] with up None) and out [R, N]; "
                 "got gate [%zd, %zd], out [%zd, %zd]", v[0].shape[0], v[0].shape[1], R, N);
        shape_error(fn, msg);
        goto done;
    }
    {
        const float *g = v[0].buf, *u = fused ? g + N : v[2].buf;
        const Py_ssize_t gs = fused ? 2 * N : N;
        float *out = v[1].buf;
        int simd = use_simd();
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < R; r++) {
#if HAVE_X86
            if (simd) {
                gelu_mul_row_avx2(g + r * gs, u + r * gs, out + r * N, N);
                continue;
            }
#endif
            gelu_mul_row(g + r * gs, u + r * gs, out + r * N, N);
        }
        Py_END_ALLOW_THREADS
        (void)simd;
    }
    result = Py_NewRef(out_o);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* rope(x, cos, sin, out) -> out: x [M, H, D] (D even), cos / sin [M, D]; per row (m, h):
   out = x * cos[m] + rotated * sin[m], rotated = (-x[D/2:], x[:D/2]): two products, then their sum
   (numpy's order, contraction off, so the same bits as numpy's expression). */
NO_CONTRACT static void rope_row(const float *x, const float *c, const float *s, float *out, Py_ssize_t D) {
    const Py_ssize_t half = D / 2;
    for (Py_ssize_t d = 0; d < half; d++) {
        const float a = x[d] * c[d], b = -x[d + half] * s[d];
        out[d] = a + b;
    }
    for (Py_ssize_t d = half; d < D; d++) {
        const float a = x[d] * c[d], b = x[d - half] * s[d];
        out[d] = a + b;
    }
}

static PyObject *rope(PyObject *self, PyObject *args) {
    static const char *fn = "rope";
    PyObject *x_o, *c_o, *s_o, *out_o;
    if (!PyArg_ParseTuple(args, "OOOO", &x_o, &c_o, &s_o, &out_o)) return NULL;
    static const ArraySpec spec[4] = {{"x", F32, 3, 0}, {"cos", F32, 2, 0}, {"sin", F32, 2, 0}, {"out", F32, 3, 1}};
    PyObject *const objs[4] = {x_o, c_o, s_o, out_o};
    Py_buffer v[4];
    PyObject *result = NULL;
    char msg[160];
    int got = get_arrays(fn, 4, spec, objs, v);
    if (got < 4) goto done;
    const Py_ssize_t M = v[0].shape[0], H = v[0].shape[1], D = v[0].shape[2];
    if (D % 2 || v[1].shape[0] != M || v[1].shape[1] != D || v[2].shape[0] != M || v[2].shape[1] != D ||
        v[3].shape[0] != M || v[3].shape[1] != H || v[3].shape[2] != D) {
        snprintf(msg, sizeof msg, "shapes must be x and out [M, H, D] (D even), cos and sin [M, D]; got x [%zd, %zd, %zd]",
                 M, H, D);
        shape_error(fn, msg);
        goto done;
    }
    {
        const float *x = v[0].buf, *c = v[1].buf, *s = v[2].buf;
        float *out = v[3].buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t m = 0; m < M; m++)
            for (Py_ssize_t h = 0; h < H; h++) rope_row(x + (m * H + h) * D, c + m * D, s + m * D, out + (m * H + h) * D, D);
        Py_END_ALLOW_THREADS
    }
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
    int prev = forced_path == PATH_SCALAR;
    forced_path = flag ? PATH_SCALAR : -1;
    return PyBool_FromLong(prev);
}

/* _force_path(name or None) -> the previous forced name or None */
static PyObject *force_path_fn(PyObject *self, PyObject *arg) {
    int want = -1;
    if (arg != Py_None) {
        const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
        if (!name) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_force_path: path must be a str or None");
            return NULL;
        }
        for (int i = 0; i < N_PATHS; i++)
            if (strcmp(name, path_names[i]) == 0) want = i;
        if (want < 0) {
            PyErr_Format(PyExc_ValueError, "_force_path: unknown path '%s' (scalar, avx2, avxvnni, avx512)", name);
            return NULL;
        }
        if (!cpu_paths[want]) {
            PyErr_Format(PyExc_ValueError, "_force_path: this CPU cannot run the %s path", name);
            return NULL;
        }
    }
    PyObject *prev = forced_path >= 0 ? PyUnicode_FromString(path_names[forced_path]) : Py_NewRef(Py_None);
    if (prev) forced_path = want;
    return prev;
}

/* paths() -> the paths this CPU can run, best last */
static PyObject *paths_fn(PyObject *self, PyObject *unused) {
    PyObject *r = PyList_New(0);
    for (int i = 0; r && i < N_PATHS; i++) {
        if (!cpu_paths[i]) continue;
        PyObject *s = PyUnicode_FromString(path_names[i]);
        if (!s || PyList_Append(r, s) < 0) Py_CLEAR(r);
        Py_XDECREF(s);
    }
    return r;
}

static PyObject *simd_fn(PyObject *self, PyObject *unused) { return PyUnicode_FromString(path_names[matmul_path()]); }

static PyMethodDef methods[] = {
    {"quantize_rows", (PyCFunction)(void (*)(void))quantize_rows, METH_VARARGS | METH_KEYWORDS,
     "quantize_rows(x) -> (xq, xs): float32 [M, K] rows to Q8_0 int8 codes [M, K] and float32 block scales [M, K/32]"},
    {"matmul_q8", (PyCFunction)(void (*)(void))matmul_q8, METH_VARARGS | METH_KEYWORDS,
     "matmul_q8(xq, xs, wq, ws, out, threads=None) -> out: out[m, n] = sum over blocks of xs*ws*idot (see the source)"},
    {"pack_q8", (PyCFunction)(void (*)(void))pack_q8, METH_VARARGS | METH_KEYWORDS,
     "pack_q8(wq, ws, out, threads=None) -> out: W's codes and scales in the SIMD paths' layout (uint8 "
     "[packed_size(N, K)]; see the source)"},
    {"packed_size", packed_size, METH_VARARGS, "packed_size(N, K) -> the bytes pack_q8 writes for W [N, K]"},
    {"attention", (PyCFunction)(void (*)(void))attention, METH_VARARGS | METH_KEYWORDS,
     "attention(q, k_cache, v_cache, positions, window, scale, out, threads=None, tree_start=-1, ancestors=None) -> out "
     "(see the source)"},
    {"attention_many", (PyCFunction)(void (*)(void))attention_many, METH_VARARGS | METH_KEYWORDS,
     "attention_many(calls, threads=None) -> None: several attention calls (tuples of its arguments "
     "but threads), the calls side by side on the threads (see the source)"},
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_VARARGS | METH_KEYWORDS,
     "rms_norm(x, weight, eps, out, residual=None) -> out: [residual +] RMSNorm of each row of x [R, N], times "
     "weight [N] (None: no scale) (see the source)"},
    {"gelu_mul", gelu_mul, METH_VARARGS,
     "gelu_mul(gate, up, out) -> out: gelu_sf(gate) * up (up None: gate holds gate | up) (see the source)"},
    {"rope", rope, METH_VARARGS, "rope(x, cos, sin, out) -> out: rotary embedding of x [M, H, D] (see the source)"},
    {"set_threads", set_threads, METH_O, "set_threads(n) -> the previous thread count"},
    {"get_threads", get_threads, METH_NOARGS, "get_threads() -> the thread count calls use by default"},
    {"_force_scalar", force_scalar_fn, METH_O, "_force_scalar(flag) -> previous flag: run the portable scalar code"},
    {"_force_path", force_path_fn, METH_O,
     "_force_path(name or None) -> previous forced path or None: run matmul_q8's 'scalar', 'avx2', 'avxvnni' or "
     "'avx512' code (None: the best this CPU has)"},
    {"paths", paths_fn, METH_NOARGS, "paths() -> matmul_q8's code paths this CPU can run, best last"},
    {"simd", simd_fn, METH_NOARGS, "simd() -> 'avx512', 'avxvnni', 'avx2' or 'scalar': matmul_q8's code that runs now"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "server._cpu_kernels",
                                    "The CPU path's int8 matmul and attention kernels in C (see the source's header).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
#if HAVE_X86
    __builtin_cpu_init();
    cpu_paths[PATH_AVX2] = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    have_f16c = __builtin_cpu_supports("f16c");
    cpu_paths[PATH_AVXVNNI] = cpu_paths[PATH_AVX2] && __builtin_cpu_supports("avxvnni");
    cpu_paths[PATH_AVX512] = cpu_paths[PATH_AVX2] && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    for (int i = 0; i < N_PATHS; i++)
        if (cpu_paths[i]) best_path = i;
#endif
    cpu_set_t set;
    long cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    n_threads = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
    static int fork_handler = 0;
    if (!fork_handler && pthread_atfork(NULL, NULL, pool_after_fork_child) == 0) fork_handler = 1;
    return PyModule_Create(&module);
}
