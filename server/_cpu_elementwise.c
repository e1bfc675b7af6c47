/* server._cpu_kernels' elementwise kernels: rms_norm (with an optional residual add), gelu_mul and
rope, one fixed sequence of float operations per row (contraction off), the same in the scalar, AVX2
and AVX-512 code. A row takes a few microseconds, so they run on the calling thread. The module's
contract is the comment at the top of _cpu_kernels.c. */
#include "_cpu_kernels.h"

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
PyObject *rms_norm(PyObject *self, PyObject *args, PyObject *kwargs) {
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
       z = c * (x + ((0.044715 * x) * x) * x);  e = exp_sf(-2 |z|)  (<= 1; exp_sf, see _cpu_kernels.h);
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
PyObject *gelu_mul(PyObject *self, PyObject *args) {
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

PyObject *rope(PyObject *self, PyObject *args) {
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
