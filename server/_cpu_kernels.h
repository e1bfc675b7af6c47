/* server._cpu_kernels' shared declarations: the includes and target attributes of the module's C
files, the settings they read (defined in _cpu_kernels.c), the thread pool's (_cpu_pool.c) and the
argument checks' (_cpu_args.c) interfaces, the small inline helpers several files use (tree8, exp_sf),
and the Python-facing functions that _cpu_kernels.c's method table lists. The module's contract is the
comment at the top of _cpu_kernels.c. */
#ifndef SAILFISH_CPU_KERNELS_H
#define SAILFISH_CPU_KERNELS_H

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
/* The AVX-512 code of attention and rms_norm (F16C too: the attention converts the float16 cache). */
#define AVX512H __attribute__((target("avx2,fma,f16c,avx512f")))
#else
#define HAVE_X86 0
#endif

/* What one file defines and another uses: hidden, so the module exports PyInit__cpu_kernels alone. */
#define SF_HIDDEN __attribute__((visibility("hidden")))

#define MAX_THREADS 64

/* matmul_q8's code paths, best last; quantize_rows and attention have AVX2 code only, which runs
   whenever the path in use is not the scalar one. */
enum { PATH_SCALAR, PATH_AVX2, PATH_AVXVNNI, PATH_AVX512, N_PATHS };

/* The module's settings (_cpu_kernels.c). */
extern SF_HIDDEN int n_threads;    /* set at import: the CPUs this process may run on */
extern SF_HIDDEN int best_path;    /* the best of matmul_q8's paths this CPU runs, found at import */
extern SF_HIDDEN int forced_path;  /* _force_path / _force_scalar: tests compare the paths */
extern SF_HIDDEN int have_f16c;    /* set at import: the attention's AVX2 code reads the float16 cache through F16C */

static inline int matmul_path(void) { return forced_path >= 0 ? forced_path : best_path; }
static inline int use_simd(void) { return matmul_path() != PATH_SCALAR; }

/* ---------------------------------------------------------------------------------------------
   Thread pool (_cpu_pool.c). */

typedef void (*part_fn)(void *ctx, int part, int nparts);

/* Run fn(ctx, part, nparts) for every part in 0..nparts-1, on up to nparts threads; returns when
   all are done. Called without the GIL. */
SF_HIDDEN void pool_run(part_fn fn, void *ctx, int nparts);
/* A fork()ed child has none of the parent's workers: forget them (PyInit__cpu_kernels registers it). */
SF_HIDDEN void pool_after_fork_child(void);

/* [lo, hi) of `total` items for part `part` of `nparts`, in whole units of `unit` items. */
static inline void part_range(Py_ssize_t total, Py_ssize_t unit, int part, int nparts, Py_ssize_t *lo, Py_ssize_t *hi) {
    Py_ssize_t units = (total + unit - 1) / unit;
    Py_ssize_t per = (units + nparts - 1) / nparts;
    Py_ssize_t a = per * part * unit, b = per * (part + 1) * unit;
    *lo = a < total ? a : total;
    *hi = b < total ? b : total;
}

/* The number of parts for `units` independent pieces of work at `threads` threads. */
static inline int parts_for(Py_ssize_t units, int threads) {
    if (units < 1) return 1;
    return units < threads ? (int)units : threads;
}

/* ---------------------------------------------------------------------------------------------
   Argument checks (_cpu_args.c). */

typedef enum { F32, I8, I64, U8, F16 } dtype;
/* One array argument's name and expectations: get_array's dt, ndim and writable. */
typedef struct { const char *name; dtype dt; int ndim; int writable; } ArraySpec;

/* Borrow obj's buffer as a C-contiguous `ndim`-dimensional array of `dt` (writable if asked);
   0 on success (release it with PyBuffer_Release), -1 with TypeError/ValueError set. */
SF_HIDDEN int get_array(PyObject *obj, const char *fn, const char *name, dtype dt, int ndim, int writable,
                        Py_buffer *view);
/* The arrays of one call with get_array: how many were acquired (n on success; fewer, with the
   error set, when one failed; those acquired are the caller's to release either way). */
SF_HIDDEN int get_arrays(const char *fn, int n, const ArraySpec *spec, PyObject *const *objs, Py_buffer *views);
/* ValueError "fn: what"; always -1. */
SF_HIDDEN int shape_error(const char *fn, const char *what);
/* The threads= argument: None (the module count) or 1..MAX_THREADS; -1 with ValueError/TypeError set. */
SF_HIDDEN int threads_arg(PyObject *obj, const char *fn);

/* ---------------------------------------------------------------------------------------------
   Arithmetic shared by several kernels (each file gets its own inlined copy: the same operations). */

/* The contract's tree8: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline float tree8(const float *l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

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

#if HAVE_X86
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
#endif

/* ---------------------------------------------------------------------------------------------
   The Python-facing functions (see the top of _cpu_kernels.c), by file. */

/* _cpu_matmul.c */
SF_HIDDEN PyObject *quantize_rows(PyObject *self, PyObject *args, PyObject *kwargs);
SF_HIDDEN PyObject *pack_q8(PyObject *self, PyObject *args, PyObject *kwargs);
SF_HIDDEN PyObject *packed_size(PyObject *self, PyObject *args);
SF_HIDDEN PyObject *matmul_q8(PyObject *self, PyObject *args, PyObject *kwargs);
/* _cpu_attention.c */
SF_HIDDEN PyObject *attention(PyObject *self, PyObject *args, PyObject *kwargs);
SF_HIDDEN PyObject *attention_many(PyObject *self, PyObject *args, PyObject *kwargs);
/* _cpu_elementwise.c */
SF_HIDDEN PyObject *rms_norm(PyObject *self, PyObject *args, PyObject *kwargs);
SF_HIDDEN PyObject *gelu_mul(PyObject *self, PyObject *args);
SF_HIDDEN PyObject *rope(PyObject *self, PyObject *args);

#endif /* SAILFISH_CPU_KERNELS_H */
