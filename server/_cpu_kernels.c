/* server._cpu_kernels: the CPU path's per-step kernels for the bundled Gemma 3 270M (Q8_0-style int8
matmuls and single-KV-head attention), in C with AVX2 / AVX-VNNI / AVX-512 VNNI where the CPU has them.

Contract (batch invariance): every output row is bit for bit the same whatever the number of rows M in
the call, the number of threads, and which code runs (AVX-512 VNNI, AVX-VNNI, AVX2 or portable scalar). The server
verifies a 16-token draft in one call and must get exactly the logits 16 one-token calls give. So:
  - threads split the work by output columns n (matmul_q8) or, in attention, by rows or (m, h) pairs,
    and over long runs of keys by keys for the scores and by output elements for the values, never
    inside a reduction; each output's arithmetic is one fixed sequence of float operations that depends on
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
#include "_cpu_kernels.h"

/* The module's files, each with one job: _cpu_kernels.h (what they share), _cpu_pool.c (the thread
   pool), _cpu_args.c (argument checks), _cpu_matmul.c (quantize_rows, pack_q8, packed_size, matmul_q8),
   _cpu_attention.c (attention, attention_many), _cpu_elementwise.c (rms_norm, gelu_mul, rope) and
   this one: the settings, the method table and the module's init. */

int n_threads = 1;     /* set at import: the CPUs this process may run on */
/* matmul_q8's code paths (the enum in _cpu_kernels.h), best last */
static const char *path_names[N_PATHS] = {"scalar", "avx2", "avxvnni", "avx512"};
static int cpu_paths[N_PATHS] = {1, 0, 0, 0};  /* which paths this CPU runs, checked once at import */
int best_path = PATH_SCALAR;
int forced_path = -1;                   /* _force_path / _force_scalar: tests compare the paths */
int have_f16c = 0;  /* set at import: the attention's AVX2 code reads the float16 cache through F16C */

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
#ifdef __linux__  /* the CPUs this process may run on (a container's or taskset's share) */
    cpu_set_t set;
    long cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
#else  /* macOS and the BSDs have no affinity masks of this kind: the CPUs online */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    n_threads = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
    static int fork_handler = 0;
    if (!fork_handler && pthread_atfork(NULL, NULL, pool_after_fork_child) == 0) fork_handler = 1;
    return PyModule_Create(&module);
}
