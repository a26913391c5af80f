/* The hot loop of the parameter fingerprint (poslin64x2-v1, reshard_job/core/fingerprint.py):
 * per row of bytes, both lanes' column sums in one pass over the words.
 *
 *   y1[i] = sum_t  word(i, t)        * A1[(c0+t) mod S] * G1[(c0+t) div S - (c0 div S)]   mod 2^64
 *   y2[i] = sum_t  bswap(word(i, t)) * A2[(c0+t) mod S] * G2[(c0+t) div S - (c0 div S)]   mod 2^64
 *
 * word(i, t) is the little-endian value of bytes [8t - phase, 8t + 8 - phase) of row i, bytes
 * outside the row being zero: a row that begins mid-word (a run cut anywhere) or whose width is
 * not a multiple of 8 is padded here, without a copy. The keys stay in Python (one definition):
 * the column tables A (S keys a lane) and the keys G of the segments the rows cross come in as
 * buffers. Integer arithmetic mod 2^64 is exact, so any summation order gives the numpy path's
 * bits. Plain CPython C API and the buffer protocol; the GIL is released while the loop runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER)
#include <stdlib.h>
#define BSWAP64(x) _byteswap_uint64(x)
#else
#define BSWAP64(x) __builtin_bswap64(x)
#endif

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define X86_DISPATCH 1
#define ALWAYS_INLINE __attribute__((always_inline))
#else
#define X86_DISPATCH 0
#define ALWAYS_INLINE
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define FROM_LE64(x) BSWAP64(x)
#else
#define FROM_LE64(x) (x)
#endif

typedef struct {
    const uint64_t *col1, *col2;  /* column tables, S keys each */
    const uint64_t *seg1, *seg2;  /* keys of the segments crossed, from segment c0 div S on */
    Py_ssize_t size;              /* S */
} Keys;

static inline uint64_t load_le64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return FROM_LE64(w);
}

/* One segment's run of m full words (p: the first), both lanes, before the segment keys. The loop
 * is plain so that compilers vectorise it; on x86 it is compiled three times (AVX-512 has a 64-bit
 * multiply, AVX2 and the baseline do not) and the best one the CPU runs is picked at import. */
static inline ALWAYS_INLINE void dot_body(const unsigned char *p, Py_ssize_t m, const uint64_t *a1,
                                          const uint64_t *a2, uint64_t *s1, uint64_t *s2) {
    uint64_t x1 = 0, x2 = 0;
    for (Py_ssize_t t = 0; t < m; t++) {
        uint64_t w = load_le64(p + 8 * t);
        x1 += w * a1[t];
        x2 += BSWAP64(w) * a2[t];
    }
    *s1 = x1;
    *s2 = x2;
}

typedef void (*DotFn)(const unsigned char *, Py_ssize_t, const uint64_t *, const uint64_t *, uint64_t *,
                      uint64_t *);

static void dot_baseline(const unsigned char *p, Py_ssize_t m, const uint64_t *a1, const uint64_t *a2,
                         uint64_t *s1, uint64_t *s2) {
    dot_body(p, m, a1, a2, s1, s2);
}

#if X86_DISPATCH
__attribute__((target("avx2")))
static void dot_avx2(const unsigned char *p, Py_ssize_t m, const uint64_t *a1, const uint64_t *a2,
                     uint64_t *s1, uint64_t *s2) {
    dot_body(p, m, a1, a2, s1, s2);
}

__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
static void dot_avx512(const unsigned char *p, Py_ssize_t m, const uint64_t *a1, const uint64_t *a2,
                       uint64_t *s1, uint64_t *s2) {
    dot_body(p, m, a1, a2, s1, s2);
}
#endif

/* splitmix64's finaliser of index * gamma + seed, low bit set: fingerprint._odd_keys's keys. */
static inline ALWAYS_INLINE void keys_body(uint64_t lo, uint64_t seed, uint64_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t z = (lo + (uint64_t)i) * 0x9E3779B97F4A7C15ULL + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        out[i] = (z ^ (z >> 31)) | 1;
    }
}

static void keys_baseline(uint64_t lo, uint64_t seed, uint64_t *out, Py_ssize_t n) {
    keys_body(lo, seed, out, n);
}

#if X86_DISPATCH
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
static void keys_avx512(uint64_t lo, uint64_t seed, uint64_t *out, Py_ssize_t n) {
    keys_body(lo, seed, out, n);
}
#endif

/* The instruction sets a loop is compiled for, best first; the first one this CPU runs is used. */
typedef void (*KeysFn)(uint64_t, uint64_t, uint64_t *, Py_ssize_t);
typedef struct {
    const char *name;
    DotFn dot;
    KeysFn keys;
} Variant;

static const Variant variants[] = {
#if X86_DISPATCH
    {"avx512", dot_avx512, keys_avx512},
    {"avx2", dot_avx2, keys_baseline},
#endif
    {"baseline", dot_baseline, keys_baseline},
};
#define VARIANTS ((Py_ssize_t)(sizeof(variants) / sizeof(variants[0])))

static const Variant *variant = &variants[VARIANTS - 1];

static int runs_here(const Variant *v) {
#if X86_DISPATCH
    if (v->dot == dot_avx512)
        return __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    if (v->dot == dot_avx2)
        return __builtin_cpu_supports("avx2");
#endif
    return 1;
}

static void choose_variant(void) {
#if X86_DISPATCH
    __builtin_cpu_init();
#endif
    for (Py_ssize_t i = VARIANTS - 1; i >= 0; i--)
        if (runs_here(&variants[i]))
            variant = &variants[i];
}

/* Word t of a row whose first byte lies at place `phase` of word 0: the row's bytes
 * [8t - phase, 8t + 8 - phase), those outside [0, width) zero. */
static inline uint64_t word_at(const unsigned char *row, Py_ssize_t t, Py_ssize_t phase, Py_ssize_t width) {
    Py_ssize_t first = 8 * t - phase;
    if (first >= 0 && first + 8 <= width)
        return load_le64(row + first);
    uint64_t w = 0;
    Py_ssize_t lo = first < 0 ? 0 : first, hi = first + 8 > width ? width : first + 8;
    for (Py_ssize_t b = lo; b < hi; b++)
        w |= (uint64_t)row[b] << (8 * (b - first));
    return w;
}

static inline Py_ssize_t clamp(Py_ssize_t x, Py_ssize_t lo, Py_ssize_t hi) {
    return x < lo ? lo : x > hi ? hi : x;
}

/* Both lanes' sums of words t..end-1 of a row, all in one segment (a1, a2: the keys of word t on),
 * before the segment's keys. Whole words in a long stretch go to the vectorised loop; the at most
 * two partial words at the row's ends, and short stretches (narrow rows), are summed here. */
static inline void piece_sums(const unsigned char *row, Py_ssize_t t, Py_ssize_t end, Py_ssize_t phase,
                              Py_ssize_t width, const uint64_t *a1, const uint64_t *a2, uint64_t *s1,
                              uint64_t *s2) {
    Py_ssize_t lo = clamp(phase ? 1 : 0, t, end), hi = clamp((phase + width) / 8, lo, end);
    uint64_t x1 = 0, x2 = 0;
    if (hi - lo >= 8) {
        variant->dot(row + 8 * lo - phase, hi - lo, a1 + (lo - t), a2 + (lo - t), &x1, &x2);
    } else {
        for (Py_ssize_t u = lo; u < hi; u++) {
            uint64_t w = load_le64(row + 8 * u - phase);
            x1 += w * a1[u - t];
            x2 += BSWAP64(w) * a2[u - t];
        }
    }
    for (Py_ssize_t u = t; u < end; u++) {  /* the words outside [lo, hi): a row's partial ends */
        if (u == lo)
            u = hi;
        if (u < end) {
            uint64_t w = word_at(row, u, phase, width);
            x1 += w * a1[u - t];
            x2 += BSWAP64(w) * a2[u - t];
        }
    }
    *s1 = x1;
    *s2 = x2;
}

/* Rows of at most NARROW words in one segment (an (N, 3) tensor's): each word's two keys, column
 * times segment, are multiplied once for all rows, and a row is a few multiply-adds. */
#define NARROW 8

static void narrow_row_sums(const unsigned char *base, Py_ssize_t rows, Py_ssize_t stride, Py_ssize_t width,
                            Py_ssize_t phase, Py_ssize_t words, Py_ssize_t j0, const Keys *k,
                            uint64_t *out1, uint64_t *out2) {
    uint64_t k1[NARROW], k2[NARROW];
    for (Py_ssize_t t = 0; t < words; t++) {
        k1[t] = k->col1[j0 + t] * k->seg1[0];
        k2[t] = k->col2[j0 + t] * k->seg2[0];
    }
    Py_ssize_t lo = phase ? 1 : 0, hi = (phase + width) / 8;  /* the whole words: [lo, hi) */
    if (hi < lo)
        hi = lo;
    for (Py_ssize_t i = 0; i < rows; i++) {
        const unsigned char *row = base + i * stride;
        uint64_t y1 = 0, y2 = 0;
        for (Py_ssize_t t = lo; t < hi; t++) {
            uint64_t w = load_le64(row + 8 * t - phase);
            y1 += w * k1[t];
            y2 += BSWAP64(w) * k2[t];
        }
        for (Py_ssize_t t = 0; t < words; t++) {  /* the partial ends: word 0 if lo is 1, words hi.. */
            if (t == lo)
                t = hi;
            if (t < words) {
                uint64_t w = word_at(row, t, phase, width);
                y1 += w * k1[t];
                y2 += BSWAP64(w) * k2[t];
            }
        }
        out1[i] = y1;
        out2[i] = y2;
    }
}

static void row_sums(const unsigned char *base, Py_ssize_t rows, Py_ssize_t stride, Py_ssize_t width,
                     Py_ssize_t phase, Py_ssize_t c0, const Keys *k, uint64_t *out1, uint64_t *out2) {
    Py_ssize_t words = width ? (phase + width + 7) / 8 : 0, j0 = c0 % k->size;
    if (words <= NARROW && j0 + words <= k->size) {
        narrow_row_sums(base, rows, stride, width, phase, words, j0, k, out1, out2);
        return;
    }
    for (Py_ssize_t i = 0; i < rows; i++) {
        const unsigned char *row = base + i * stride;
        uint64_t y1 = 0, y2 = 0, s1, s2;
        /* the rows share their columns: segment by segment, from column c0 (place j0 of its segment) */
        for (Py_ssize_t t = 0, j = j0, g = 0; t < words; j = 0, g++) {
            Py_ssize_t end = t + (k->size - j < words - t ? k->size - j : words - t);
            piece_sums(row, t, end, phase, width, k->col1 + j, k->col2 + j, &s1, &s2);
            y1 += s1 * k->seg1[g];
            y2 += s2 * k->seg2[g];
            t = end;
        }
        out1[i] = y1;
        out2[i] = y2;
    }
}

static int get_table(PyObject *obj, Py_buffer *view, int flags, const char *what) {
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->len % 8 || ((uintptr_t)view->buf) % 8) {
        PyErr_Format(PyExc_ValueError, "%s: an aligned buffer of 64-bit words is expected", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(row_sums_doc,
"row_sums(rows, phase, c0, col1, col2, seg1, seg2, out1, out2)\n--\n\n"
"Both lanes' column sums of each row of `rows` (a 2-D byte buffer, rows at any stride, bytes\n"
"contiguous within a row) whose first byte lies at place `phase` of word `c0` of its grid row.\n"
"col1/col2: the column tables (S uint64 keys each); seg1/seg2: the keys of segments c0 // S on;\n"
"out1/out2: writable uint64 buffers of one value a row.");

static PyObject *py_row_sums(PyObject *self, PyObject *args) {
    PyObject *objs[7];
    Py_ssize_t phase, c0;
    Py_buffer rows = {0}, bufs[6] = {{0}};
    int got = 0;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OnnOOOOOO:row_sums", &objs[0], &phase, &c0, &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6]))
        return NULL;
    if (PyObject_GetBuffer(objs[0], &rows, PyBUF_STRIDED_RO) < 0)
        return NULL;
    static const char *names[6] = {"col1", "col2", "seg1", "seg2", "out1", "out2"};
    for (; got < 6; got++)
        if (get_table(objs[got + 1], &bufs[got], got < 4 ? PyBUF_SIMPLE : PyBUF_WRITABLE, names[got]) < 0)
            goto done;
    Py_ssize_t n = rows.ndim == 2 ? rows.shape[0] : 0, width = rows.ndim == 2 ? rows.shape[1] : 0;
    Keys k = {bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, bufs[0].len / 8};
    if (rows.ndim != 2 || rows.itemsize != 1 || (width > 1 && rows.strides[1] != 1)) {
        PyErr_SetString(PyExc_ValueError, "rows: a 2-D byte buffer with contiguous rows is expected");
        goto done;
    }
    if (phase < 0 || phase > 7 || c0 < 0 || k.size == 0 || bufs[1].len != bufs[0].len) {
        PyErr_SetString(PyExc_ValueError, "phase in 0..7, c0 >= 0 and two equal non-empty column tables expected");
        goto done;
    }
    Py_ssize_t words = (phase + width + 7) / 8;
    Py_ssize_t segs = width ? (c0 + words - 1) / k.size - c0 / k.size + 1 : 0;
    if (bufs[2].len / 8 < segs || bufs[3].len / 8 < segs || bufs[4].len / 8 < n || bufs[5].len / 8 < n) {
        PyErr_Format(PyExc_ValueError, "%zd segment keys and %zd outputs a lane expected", segs, n);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    row_sums(rows.buf, n, n > 1 ? rows.strides[0] : 0, width, phase, c0, &k, bufs[4].buf, bufs[5].buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&bufs[i]);
    PyBuffer_Release(&rows);
    return result;
}

PyDoc_STRVAR(odd_keys_doc,
"odd_keys(lo, seed, out)\n--\n\n"
"Fill `out` (a writable uint64 buffer of n keys) with the odd keys of indices lo..lo+n-1.");

static PyObject *py_odd_keys(PyObject *self, PyObject *args) {
    unsigned long long lo, seed;
    PyObject *obj;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "KKO:odd_keys", &lo, &seed, &obj) || get_table(obj, &out, PyBUF_WRITABLE, "out") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    variant->keys(lo, seed, out.buf, out.len / 8);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *py_variant(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(variant->name);
}

static PyObject *py_variants(PyObject *self, PyObject *noargs) {
    PyObject *names = PyList_New(0);
    for (Py_ssize_t i = 0; names && i < VARIANTS; i++) {
        if (!runs_here(&variants[i]))
            continue;
        PyObject *name = PyUnicode_FromString(variants[i].name);
        if (!name || PyList_Append(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static PyObject *py_use_variant(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    for (Py_ssize_t i = 0; i < VARIANTS; i++) {
        if (strcmp(variants[i].name, name) == 0 && runs_here(&variants[i])) {
            variant = &variants[i];
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "variant %R: not compiled in or not run by this CPU", arg);
    return NULL;
}

static PyMethodDef methods[] = {
    {"row_sums", py_row_sums, METH_VARARGS, row_sums_doc},
    {"odd_keys", py_odd_keys, METH_VARARGS, odd_keys_doc},
    {"variant", py_variant, METH_NOARGS, "The instruction set the loops use now (avx512, avx2 or baseline)."},
    {"variants", py_variants, METH_NOARGS, "The instruction sets compiled in that this CPU runs, best first."},
    {"use_variant", py_use_variant, METH_O, "Use the loops of one of variants() (for tests: not thread-safe)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fingerprint_c",
    "Compiled row sums of the poslin64x2-v1 fingerprint (see reshard_job.core.fingerprint).", -1, methods,
};

PyMODINIT_FUNC PyInit__fingerprint_c(void) {
    choose_variant();
    return PyModule_Create(&module);
}
