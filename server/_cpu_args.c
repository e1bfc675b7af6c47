/* server._cpu_kernels' argument checks: the buffer-protocol arrays every function takes (dtype, number
of dimensions, C-contiguous, writable where it is an output), checked with the module's TypeError /
ValueError messages, and the threads= argument. The kernels check shapes themselves. The module's
contract is the comment at the top of _cpu_kernels.c. */
#include "_cpu_kernels.h"

/* ---------------------------------------------------------------------------------------------
   Argument checks. */

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
int get_array(PyObject *obj, const char *fn, const char *name, dtype dt, int ndim, int writable,
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

int get_arrays(const char *fn, int n, const ArraySpec *spec, PyObject *const *objs, Py_buffer *views) {
    for (int i = 0; i < n; i++)
        if (get_array(objs[i], fn, spec[i].name, spec[i].dt, spec[i].ndim, spec[i].writable, &views[i]) < 0)
            return i;
    return n;
}

/* ValueError "fn: what" with the shapes in the message; always -1. */
int shape_error(const char *fn, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s: %s", fn, what);
    return -1;
}

/* The threads= argument: None (the module count) or 1..MAX_THREADS; -1 with ValueError/TypeError set. */
int threads_arg(PyObject *obj, const char *fn) {
    if (obj == NULL || obj == Py_None) return n_threads;
    long t = PyLong_AsLong(obj);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (t < 1 || t > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be 1..%d, not %ld", fn, MAX_THREADS, t);
        return -1;
    }
    return (int)t;
}
