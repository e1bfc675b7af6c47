/* ngram._speedups: the drafter's per-step kernels in C, each an exact port of its pure-Python twin.

Contract: every function here returns exactly what the Python function of the same name returns for
the same valid arguments (same strings, same floats bit for bit, same list order); tests/test_speedups.py
checks that on random inputs. Invalid arguments (a negative depth, rows not longer than the depth
walked, ids out of range, non-integer arrays) raise; nothing reads outside a string. Python twins:
ngram.match.walk, .follow_rows, .context_match, .context_rows, .overlay_rows; ngram.codec.encode,
.encode_ints, .decode (encode_buffer is encode for buffer-protocol arrays).
ngram.match and ngram.codec use these when the extension is built and fall back to their own code
otherwise (a machine without a compiler, a Python the extension was not built for), so the drafter's
output never depends on which one runs; only its latency does.

Why C: on a slow CPU each proposal is a few dozen small Python operations (slices, list
comprehensions, dict tallies) of about a microsecond each; here they are loops over characters.
Strings are the encoded token text of ngram.codec (one code point per token), read through
PyUnicode_READ so any string kind works.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Code point <-> token id (ngram.codec): id + 1, plus the surrogate span from 0xD7FF on. */
#define SURROGATE_START 0xD800
#define SURROGATE_SPAN 0x800
#define MAX_TOKEN_ID (0x10FFFF - SURROGATE_SPAN - 1)
#define SHIFT_FROM (SURROGATE_START - 1)
#define UNSHIFT_FROM (SURROGATE_START + SURROGATE_SPAN)

typedef struct {
    PyObject *text;  /* borrowed */
    int kind;
    const void *data;
    Py_ssize_t len;
    long long weight;
} Row;

/* Borrow a (str, int) row; 0 on success, -1 with an exception set. */
static int read_row(PyObject *item, Row *row) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 2 || !PyUnicode_Check(PyTuple_GET_ITEM(item, 0))) {
        PyErr_SetString(PyExc_TypeError, "rows must be (str, int) tuples");
        return -1;
    }
    PyObject *text = PyTuple_GET_ITEM(item, 0);
    row->text = text;
    row->kind = PyUnicode_KIND(text);
    row->data = PyUnicode_DATA(text);
    row->len = PyUnicode_GET_LENGTH(text);
    row->weight = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    if (row->weight == -1 && PyErr_Occurred()) return -1;
    return 0;
}

#define CH(r, i) PyUnicode_READ((r)->kind, (r)->data, (i))

/* ValueError unless depth >= 0 (walk's and follow_rows' depth); 1 if it was raised, else 0. */
static int negative_depth(Py_ssize_t depth) {
    if (depth >= 0) return 0;
    PyErr_SetString(PyExc_ValueError, "depth must be >= 0");
    return 1;
}

/* PyMem_Malloc for count items of size bytes (room for one when count <= 0); NULL with MemoryError set. */
static void *alloc_items(Py_ssize_t count, size_t size) {
    void *p = PyMem_Malloc(size * (count > 0 ? count : 1));
    if (!p) PyErr_NoMemory();
    return p;
}

/* Append item, a new reference (NULL: making it failed), to list and release it; 0, or -1 with an exception set. */
static int append_new(PyObject *list, PyObject *item) {
    if (!item) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* Append the row (text[a:b], weight) to rows; 0 on success, -1 with an exception set. */
static int append_row(PyObject *rows, PyObject *text, Py_ssize_t a, Py_ssize_t b, long long weight) {
    return append_new(rows, Py_BuildValue("(NL)", PyUnicode_Substring(text, a, b), weight));
}

/* (0, []): context_match's and overlay_rows' answer when nothing matches. */
static PyObject *no_match(void) { return Py_BuildValue("(n[])", (Py_ssize_t)0); }

/* walk(rows, depth, max_tokens, cutoff) -> (drafted text, cumulative confidences) */
static PyObject *walk(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"rows", "depth", "max_tokens", "cutoff", NULL};
    PyObject *rows_arg;
    Py_ssize_t depth, max_tokens;
    double cutoff;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onnd", kwlist, &rows_arg, &depth, &max_tokens, &cutoff) ||
        negative_depth(depth))
        return NULL;
    PyObject *rows_obj = PySequence_Fast(rows_arg, "rows must be a sequence of (str, int) tuples");
    if (!rows_obj) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(rows_obj);
    Py_ssize_t stop = depth + (max_tokens > 0 ? max_tokens : 0);
    Row *rows = alloc_items(n, sizeof(Row));
    Py_UCS4 *out = alloc_items(stop - depth, sizeof(Py_UCS4));
    double *confs = alloc_items(stop - depth, sizeof(double));
    PyObject *result = NULL;
    if (!rows || !out || !confs) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (read_row(PySequence_Fast_GET_ITEM(rows_obj, i), &rows[i]) < 0) goto done;
    Py_ssize_t n_out = 0;
    double conf = 1.0;
    while (n > 0 && depth < stop) {
        /* Draft what every row agrees on (rows are sorted: what the first and last agree on), at no
           cost in confidence; one row left agrees with itself up to its end, and is the draft. */
        Row *first = &rows[0], *last = &rows[n - 1];
        Py_ssize_t end = first->len < last->len ? first->len : last->len;
        if (stop < end) end = stop;
        Py_ssize_t same = depth;
        while (same < end && CH(first, same) == CH(last, same)) same++;
        for (Py_ssize_t i = depth; i < same; i++) {
            out[n_out] = CH(first, i);
            confs[n_out++] = conf;
        }
        if (n == 1) break;
        if (same > depth) {
            depth = same;
            if (depth >= stop) break;
            Py_ssize_t kept = 0;
            for (Py_ssize_t i = 0; i < n; i++)
                if (rows[i].len > depth) rows[kept++] = rows[i];
            n = kept;
            continue;
        }
        /* Tally the next token's weight; the heaviest wins, ties to the token seen first in row
           order (Python's dict order; rows are sorted, so that is the lowest token). */
        long long total = 0, best_weight = -1;
        Py_UCS4 best = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (rows[i].len <= depth) {  /* callers keep rows longer than depth; Python raises here too */
                PyErr_SetString(PyExc_IndexError, "string index out of range");
                goto done;
            }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_UCS4 ch = CH(&rows[i], depth);
            total += rows[i].weight;
            int seen = 0;
            for (Py_ssize_t j = 0; j < i && !seen; j++) seen = CH(&rows[j], depth) == ch;
            if (seen) continue;
            long long weight = 0;
            for (Py_ssize_t j = i; j < n; j++)
                if (CH(&rows[j], depth) == ch) weight += rows[j].weight;
            if (weight > best_weight) {
                best_weight = weight;
                best = ch;
            }
        }
        conf *= (double)best_weight / (double)total;
        if (conf < cutoff) break;
        out[n_out] = best;
        confs[n_out++] = conf;
        depth++;
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (CH(&rows[i], depth - 1) == best && rows[i].len > depth) rows[kept++] = rows[i];
        n = kept;
    }
    PyObject *text = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, out, n_out);
    PyObject *conf_list = PyList_New(n_out);
    if (text && conf_list) {
        for (Py_ssize_t i = 0; i < n_out; i++) {
            PyObject *f = PyFloat_FromDouble(confs[i]);
            if (!f) goto fail;
            PyList_SET_ITEM(conf_list, i, f);
        }
        result = PyTuple_Pack(2, text, conf_list);
    }
fail:
    Py_XDECREF(text);
    Py_XDECREF(conf_list);
done:
    PyMem_Free(rows);
    PyMem_Free(out);
    PyMem_Free(confs);
    Py_DECREF(rows_obj);  /* after the rows' borrowed texts are done with */
    return result;
}

/* follow_rows(rows, depth, appended) -> the rows longer than depth + len(appended) whose text
   continues with `appended` at `depth` (the same tuple objects, in order). */
static PyObject *follow_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"rows", "depth", "appended", NULL};
    PyObject *rows_obj, *appended;
    Py_ssize_t depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!nU", kwlist, &PyList_Type, &rows_obj, &depth, &appended) ||
        negative_depth(depth))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows_obj), m = PyUnicode_GET_LENGTH(appended);
    int akind = PyUnicode_KIND(appended);
    const void *adata = PyUnicode_DATA(appended);
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(rows_obj, i);
        Row row;
        if (read_row(item, &row) < 0) goto fail;
        if (row.len <= depth + m) continue;
        Py_ssize_t j = 0;
        while (j < m && CH(&row, depth + j) == PyUnicode_READ(akind, adata, j)) j++;
        if (j == m && PyList_Append(out, item) < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* The most recent start p >= start of text[n-k:] with p + k <= end; -1 if none, -2 on error. */
static Py_ssize_t rfind_suffix(PyObject *text, Py_ssize_t n, Py_ssize_t k, Py_ssize_t start, Py_ssize_t end) {
    PyObject *pattern = PyUnicode_Substring(text, n - k, n);
    if (!pattern) return -2;
    Py_ssize_t at = PyUnicode_Find(text, pattern, start, end, -1);
    Py_DECREF(pattern);
    return at;
}

/* context_match(text, min_len, max_len, max_occurrences, start=0, upper_hint=None) -> (k, starts) */
static PyObject *context_match(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"text", "min_len", "max_len", "max_occurrences", "start", "upper_hint", NULL};
    PyObject *text, *hint = Py_None;
    Py_ssize_t min_len, max_len, max_occ, start = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Unnn|nO", kwlist, &text, &min_len, &max_len, &max_occ, &start,
                                     &hint))
        return NULL;
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    Py_ssize_t hi = max_len;
    if (n - start - 1 < hi) hi = n - start - 1;
    if (hint != Py_None) {
        Py_ssize_t h = PyLong_AsSsize_t(hint);
        if (h == -1 && PyErr_Occurred()) return NULL;
        if (h < hi) hi = h;
    }
    Py_ssize_t lo = min_len;
    if (hi < lo) return no_match();
    /* str.rfind(sub, start, end) with a negative or short window finds nothing; mirror its clamping */
    Py_ssize_t found = rfind_suffix(text, n, lo, start, n - 1);
    if (found == -2) return NULL;
    if (found < 0) return no_match();
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        Py_ssize_t at = rfind_suffix(text, n, mid, start, n - 1);
        if (at == -2) return NULL;
        if (at >= 0) {
            lo = mid;
            found = at;
        } else {
            hi = mid - 1;
        }
    }
    PyObject *pattern = PyUnicode_Substring(text, n - lo, n);
    PyObject *starts = PyList_New(0);
    if (!pattern || !starts) goto fail;
    Py_ssize_t end = found + lo - 1;
    if (append_new(starts, PyLong_FromSsize_t(found + lo)) < 0) goto fail;
    while (PyList_GET_SIZE(starts) < max_occ) {
        Py_ssize_t at = PyUnicode_Find(text, pattern, start, end, -1);
        if (at == -2) goto fail;
        if (at < 0) break;
        if (append_new(starts, PyLong_FromSsize_t(at + lo)) < 0) goto fail;
        end = at + lo - 1;
    }
    Py_DECREF(pattern);
    return Py_BuildValue("(nN)", lo, starts);
fail:
    Py_XDECREF(pattern);
    Py_XDECREF(starts);
    return NULL;
}

/* context_rows(text, starts, k, ahead) -> sorted [(text[s-k : s+ahead], RECENCY_SCALE + n - i)] */
static PyObject *context_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"text", "starts", "k", "ahead", "scale", NULL};
    PyObject *text, *starts;
    Py_ssize_t k, ahead;
    long long scale = 1000;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UO!nn|L", kwlist, &text, &PyList_Type, &starts, &k, &ahead,
                                     &scale))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(starts), len = PyUnicode_GET_LENGTH(text);
    PyObject *rows = PyList_New(0);
    if (!rows) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(starts, i));
        if (s == -1 && PyErr_Occurred()) goto fail;
        /* Python slice semantics for text[s - k : s + ahead] with 0 <= s - k (callers' offsets) */
        Py_ssize_t a = s - k, b = s + ahead;
        if (a < 0) a = a + len < 0 ? 0 : a + len;
        if (b > len) b = len;
        if (b - a <= k) continue;
        if (append_row(rows, text, a, b, scale + n - i) < 0) goto fail;
    }
    if (PyList_Sort(rows) < 0) goto fail;
    return rows;
fail:
    Py_DECREF(rows);
    return NULL;
}

/* overlay_rows(text, offsets, tail, key_tokens, min_match, max_match, max_occurrences, candidates, ahead,
   separator) -> (k, rows): see ngram.match.overlay_rows */
static PyObject *overlay_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"text", "offsets", "tail", "key_tokens", "min_match", "max_match", "max_occurrences",
                             "candidates", "ahead", "separator", NULL};
    PyObject *text, *offsets, *tail, *separator;
    Py_ssize_t key_tokens, min_match, max_match, max_occ, candidates, ahead;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UO!UnnnnnnU", kwlist, &text, &PyList_Type, &offsets, &tail,
                                     &key_tokens, &min_match, &max_match, &max_occ, &candidates, &ahead, &separator))
        return NULL;
    if (PyUnicode_GET_LENGTH(separator) != 1) {
        PyErr_SetString(PyExc_ValueError, "separator must be one character");
        return NULL;
    }
    Py_UCS4 sep = PyUnicode_READ_CHAR(separator, 0);
    int tkind = PyUnicode_KIND(text), lkind = PyUnicode_KIND(tail);
    const void *tdata = PyUnicode_DATA(text), *ldata = PyUnicode_DATA(tail);
    Py_ssize_t tlen = PyUnicode_GET_LENGTH(text), llen = PyUnicode_GET_LENGTH(tail);
    Py_ssize_t n_off = PyList_GET_SIZE(offsets);
    Py_ssize_t first = candidates > 0 ? (n_off > candidates ? n_off - candidates : 0) : n_off;
    /* offsets[first:] reversed: most recent first; keep (k, off) pairs */
    Py_ssize_t n_found = n_off - first;
    Py_ssize_t *ks = alloc_items(2 * n_found, sizeof(Py_ssize_t));
    if (!ks) return NULL;
    Py_ssize_t *offs = ks + n_found;
    Py_ssize_t best = 0;
    PyObject *rows = NULL, *result = NULL;
    for (Py_ssize_t j = 0; j < n_found; j++) {
        Py_ssize_t off = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, n_off - 1 - j));
        if (off == -1 && PyErr_Occurred()) goto done;
        Py_ssize_t k = key_tokens, limit = max_match;
        if (off < limit) limit = off;
        if (llen < limit) limit = llen;
        if (off > tlen) limit = key_tokens;  /* out of range: Python would raise on a read; never extend */
        while (k < limit && PyUnicode_READ(tkind, tdata, off - k - 1) == PyUnicode_READ(lkind, ldata, llen - k - 1)) k++;
        ks[j] = k;
        offs[j] = off;
        if (j == 0 || k > best) best = k;
    }
    if (n_found == 0 || best < min_match) {
        result = no_match();
        goto done;
    }
    Py_ssize_t n_hits = 0;
    for (Py_ssize_t j = 0; j < n_found && n_hits < max_occ; j++)
        if (ks[j] == best) n_hits++;
    rows = PyList_New(0);
    if (!rows) goto done;
    Py_ssize_t i = 0;
    for (Py_ssize_t j = 0; j < n_found && i < n_hits; j++) {
        if (ks[j] != best) continue;
        Py_ssize_t off = offs[j];
        Py_ssize_t a = off - best, b = off + ahead;
        if (a < 0) a = 0;  /* never: off >= best by construction */
        if (b > tlen) b = tlen;
        Py_ssize_t end = b;
        for (Py_ssize_t c = a + best; c < b; c++)
            if (PyUnicode_READ(tkind, tdata, c) == sep) {
                end = c;
                break;
            }
        if (end - a > best && append_row(rows, text, a, end, (long long)(1000 + n_hits - i)) < 0)
            goto done;
        i++;
    }
    if (PyList_Sort(rows) < 0) goto done;
    result = PyList_GET_SIZE(rows) ? Py_BuildValue("(nO)", best, rows) : no_match();
done:
    Py_XDECREF(rows);
    PyMem_Free(ks);
    return result;
}

/* The code point of token id `id` (ngram.codec); 0, never a token's, with ValueError set when id is out of range. */
static Py_UCS4 code_point(long long id) {
    if (id < 0 || id > MAX_TOKEN_ID) {
        PyErr_Format(PyExc_ValueError, "token id out of range 0..%d", MAX_TOKEN_ID);
        return 0;
    }
    return (Py_UCS4)(id >= SHIFT_FROM ? id + SURROGATE_SPAN + 1 : id + 1);
}

/* encode_ints(list of ints) -> key string, one code point per token (ngram.codec) */
static PyObject *encode_ints(PyObject *self, PyObject *ids) {
    PyObject *seq = PySequence_Fast(ids, "encode_ints expects a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_UCS4 *buf = alloc_items(n, sizeof(Py_UCS4));
    PyObject *result = NULL;
    if (!buf) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long id = PyLong_AsLongLong(items[i]);
        if (id == -1 && PyErr_Occurred()) goto done;
        buf[i] = code_point(id);
        if (!buf[i]) goto done;
    }
    result = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, buf, n);
done:
    PyMem_Free(buf);
    Py_DECREF(seq);
    return result;
}

/* encode_buffer(int array) -> key string: encode_ints for anything with the buffer protocol holding
   signed or unsigned integers of 1, 2, 4 or 8 bytes (a numpy id array), read without a list. */
static PyObject *encode_buffer(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) return NULL;
    PyObject *result = NULL;
    Py_UCS4 *buf = NULL;
    const char *fmt = view.format ? view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    char code = fmt[0];
    Py_ssize_t n = view.ndim == 1 ? view.shape[0] : 0;
    Py_ssize_t step = view.ndim == 1 && view.strides ? view.strides[0] : view.itemsize;
    int is_signed = code == 'b' || code == 'h' || code == 'i' || code == 'l' || code == 'q' || code == 'n';
    int is_unsigned = code == 'B' || code == 'H' || code == 'I' || code == 'L' || code == 'Q' || code == 'N';
    if (view.ndim != 1 || fmt[1] != 0 || !(is_signed || is_unsigned) ||
        !(view.itemsize == 1 || view.itemsize == 2 || view.itemsize == 4 || view.itemsize == 8)) {
        PyErr_SetString(PyExc_TypeError, "encode_buffer expects a 1-d buffer of integers");
        goto done;
    }
    buf = alloc_items(n, sizeof(Py_UCS4));
    if (!buf) goto done;
    const char *p = view.buf;
    for (Py_ssize_t i = 0; i < n; i++, p += step) {
        long long id;
        switch (view.itemsize) {
            case 1: id = is_signed ? (long long)*(const int8_t *)p : (long long)*(const uint8_t *)p; break;
            case 2: id = is_signed ? (long long)*(const int16_t *)p : (long long)*(const uint16_t *)p; break;
            case 4: id = is_signed ? (long long)*(const int32_t *)p : (long long)*(const uint32_t *)p; break;
            default: {
                uint64_t u = *(const uint64_t *)p;
                id = (!is_signed && u > (uint64_t)MAX_TOKEN_ID) ? -1 : (long long)u;
            }
        }
        buf[i] = code_point(id);
        if (!buf[i]) goto done;
    }
    result = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, buf, n);
done:
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return result;
}

/* encode(ids) -> key string: a list or tuple goes through encode_ints, anything else with the buffer
   protocol (a numpy id array) through encode_buffer. */
static PyObject *encode(PyObject *self, PyObject *ids) {
    if (PyList_Check(ids) || PyTuple_Check(ids) || !PyObject_CheckBuffer(ids)) return encode_ints(self, ids);
    return encode_buffer(self, ids);
}

/* decode(key string) -> list of token ids */
static PyObject *decode(PyObject *self, PyObject *key) {
    if (!PyUnicode_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "decode expects a str");
        return NULL;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(key);
    int kind = PyUnicode_KIND(key);
    const void *data = PyUnicode_DATA(key);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long cp = (long)PyUnicode_READ(kind, data, i);
        PyObject *v = PyLong_FromLong(cp >= UNSHIFT_FROM ? cp - SURROGATE_SPAN - 1 : cp - 1);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_VARARGS | METH_KEYWORDS, "walk(rows, depth, max_tokens, cutoff): see ngram.match.walk"},
    {"follow_rows", (PyCFunction)(void (*)(void))follow_rows, METH_VARARGS | METH_KEYWORDS, "follow_rows(rows, depth, appended): see ngram.match.follow_rows"},
    {"context_match", (PyCFunction)(void (*)(void))context_match, METH_VARARGS | METH_KEYWORDS, "see ngram.match.context_match"},
    {"context_rows", (PyCFunction)(void (*)(void))context_rows, METH_VARARGS | METH_KEYWORDS, "see ngram.match.context_rows"},
    {"overlay_rows", (PyCFunction)(void (*)(void))overlay_rows, METH_VARARGS | METH_KEYWORDS,
     "see ngram.match.overlay_rows"},
    {"encode_ints", encode_ints, METH_O, "see ngram.codec.encode_ints"},
    {"decode", decode, METH_O, "see ngram.codec.decode"},
    {"encode", encode, METH_O, "encode(ids): see ngram.codec.encode"},
    {"encode_buffer", encode_buffer, METH_O, "encode_buffer(int array): see ngram.codec.encode"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ngram._speedups",
                                    "The drafter's per-step kernels in C (see the source's header).", -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
