/* gdswriter._gather: the host snapshot's gather, and a load's checksums, in one compiled call each.
 *
 * gather_copies(dst_address, dst_size, copies, crcs, base) copies a pool piece's (offset, length,
 * (address, length)) copies to dst_address + offset and writes each one's crc32c (Castagnoli, the
 * crc32c package's values) to crcs[base + i], copy and checksum fused per cache-sized part, so the
 * checksum reads the copy from cache. crc32c_spans(data, offsets, lengths, crcs_out) checksums many
 * spans of one buffer (a load's read run: its chunks). The GIL is released for each loop. Inputs are
 * checked first (equal lengths, no negative length or offset, every span inside its buffer); a
 * copy's source addresses are the caller's to vouch for.
 *
 * The crc32c: SSE4.2's crc32 instruction on x86-64, the ARMv8 CRC extension on aarch64 (both
 * chosen at run time; three streams interleaved), else a slicing-by-8 table. Python's pure paths
 * (gdswriter/crc.py, save/pool.py) compute the same bytes and checksums; tests/test_native_gather.py
 * compares them. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define GATHER_X86 1
#elif defined(__aarch64__) && defined(__GNUC__) && defined(__linux__)
#include <sys/auxv.h>
#include <arm_acle.h>
#define GATHER_ARM 1
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif

#define POLY 0x82F63B78u   /* Castagnoli, reflected */
#define FUSED ((size_t)256 << 10)  /* copy this much, then checksum it while it is in cache */

static uint32_t table[8][256];

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++) table[k][n] = (table[k - 1][n] >> 8) ^ table[0][table[k - 1][n] & 0xff];
}

/* crc is the register (already inverted) in every *_update function */
static uint32_t table_update(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff]; n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t lo = (uint32_t)w ^ crc, hi = (uint32_t)(w >> 32);
        crc = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^ table[4][lo >> 24]
            ^ table[3][hi & 0xff] ^ table[2][(hi >> 8) & 0xff] ^ table[1][(hi >> 16) & 0xff] ^ table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

/* The hardware crc32c runs three streams at once (the instruction's latency is three times its
 * throughput), LONG or SHORT bytes apart, and joins them by shifting a register over LONG or SHORT
 * zero bytes with a table (Mark Adler's method, as the crc32c package does). */
#define LONG 8192
#define SHORT 256
static uint32_t zeros_long[4][256], zeros_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* the table that feeds ``len`` (a power of two) zero bytes through a register */
static void make_zeros(uint32_t zeros[4][256], size_t len) {
    uint32_t a[32], b[32], *op = a, *other = b, *t;
    a[0] = POLY;  /* one zero bit */
    for (int n = 1; n < 32; n++) a[n] = 1u << (n - 1);
    for (int k = 0; k < 3; k++) { gf2_square(other, op); t = op; op = other; other = t; }  /* 8 bits: a byte */
    for (; len > 1; len >>= 1) { gf2_square(other, op); t = op; op = other; other = t; }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++) zeros[k][n] = gf2_times(op, n << (8 * k));
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

#define HW_BODY(CRC8, CRC64)                                                                      \
    while (n && ((uintptr_t)p & 7)) { crc = CRC8(crc, *p++); n--; }                               \
    for (size_t blk = LONG; blk >= SHORT; blk = blk == LONG ? SHORT : 0) {                          \
        while (n >= 3 * blk) {                                                                     \
            uint32_t c1 = 0, c2 = 0;                                                               \
            for (const unsigned char *end = p + blk; p < end; p += 8) {                            \
                uint64_t w0, w1, w2;                                                               \
                memcpy(&w0, p, 8); memcpy(&w1, p + blk, 8); memcpy(&w2, p + 2 * blk, 8);           \
                crc = (uint32_t)CRC64(crc, w0); c1 = (uint32_t)CRC64(c1, w1);                      \
                c2 = (uint32_t)CRC64(c2, w2);                                                      \
            }                                                                                      \
            uint32_t (*z)[256] = blk == LONG ? zeros_long : zeros_short;                           \
            crc = shift(z, shift(z, crc) ^ c1) ^ c2;                                               \
            p += 2 * blk;                                                                          \
            n -= 3 * blk;                                                                          \
        }                                                                                          \
    }                                                                                              \
    for (; n >= 8; p += 8, n -= 8) { uint64_t w; memcpy(&w, p, 8); crc = (uint32_t)CRC64(crc, w); } \
    while (n--) crc = CRC8(crc, *p++);                                                             \
    return crc;

#ifdef GATHER_X86
__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t crc, const unsigned char *p, size_t n) {
    HW_BODY(_mm_crc32_u8, _mm_crc32_u64)
}
static int hw_present(void) { __builtin_cpu_init(); return __builtin_cpu_supports("sse4.2"); }
static const char *HW_NAME = "sse4.2";
#elif defined(GATHER_ARM)
#ifdef __clang__
#define ARM_CRC_TARGET __attribute__((target("crc")))
#else
#define ARM_CRC_TARGET __attribute__((target("+crc")))
#endif
ARM_CRC_TARGET static uint32_t hw_update(uint32_t crc, const unsigned char *p, size_t n) {
    HW_BODY(__crc32cb, __crc32cd)
}
static int hw_present(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
static const char *HW_NAME = "armv8-crc";
#endif

typedef uint32_t (*update_fn)(uint32_t, const unsigned char *, size_t);
static update_fn update = table_update;
static const char *impl_name = "table";

/* A C-contiguous one-dimensional buffer of ``itemsize``-byte integers (``sign``: 'i' or 'u'). */
static int get_column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, char sign, int writable,
                      const char *name) {  /* (crc32c_spans' columns) */
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "crc32c_spans: %s must be a C-contiguous%s buffer of %s%d integers "
                     "(a numpy array or memoryview)", name, writable ? " writable" : "",
                     sign == 'u' ? "uint" : "int", (int)(itemsize * 8));
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    int is_unsigned = *f == 'B' || *f == 'H' || *f == 'I' || *f == 'L' || *f == 'Q';
    int is_int = is_unsigned || *f == 'b' || *f == 'h' || *f == 'i' || *f == 'l' || *f == 'q';
    if (view->ndim != 1 || view->itemsize != itemsize || !is_int || f[1] != '\0' || (sign == 'u') != is_unsigned) {
        PyErr_Format(PyExc_TypeError, "crc32c_spans: %s must be one-dimensional %s%d (got format '%s', %d "
                     "dimension(s), %zd-byte items): pass numpy arrays of that dtype",
                     name, sign == 'u' ? "uint" : "int", (int)(itemsize * 8), view->format ? view->format : "B",
                     view->ndim, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Every span non-negative and inside [0, dst_size); 0, else -1 with a ValueError set. */
static int check_spans(const int64_t *off, const int64_t *len, Py_ssize_t count, int64_t dst_size,
                       const char *fn, const char *what) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (len[i] < 0 || off[i] < 0 || off[i] > dst_size || len[i] > dst_size - off[i]) {
            PyErr_Format(PyExc_ValueError, "%s: span %zd (offset %lld, length %lld) is not inside the %s's %lld "
                         "bytes: offsets and lengths must be non-negative and end within it", fn, i,
                         (long long)off[i], (long long)len[i], what, (long long)dst_size);
            return -1;
        }
    }
    return 0;
}

static void gather(unsigned char *dst, const int64_t *off, const int64_t *src, const int64_t *len,
                   uint32_t *crcs, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned char *d = dst + off[i];
        const unsigned char *s = (const unsigned char *)(uintptr_t)src[i];
        size_t n = (size_t)len[i];
        uint32_t crc = 0xFFFFFFFFu;
        while (n) {
            size_t m = n < FUSED ? n : FUSED;
            memmove(d, s, m);
            crc = update(crc, d, m);
            d += m;
            s += m;
            n -= m;
        }
        crcs[i] = crc ^ 0xFFFFFFFFu;
    }
}

/* crc32c_spans(data, offsets, lengths, crcs_out): crcs_out[i] = crc32c of data[offsets[i]:offsets[i] +
 * lengths[i]] for every i, the GIL released: a load's chunks of one read run checksummed in one
 * call. data: any C-contiguous buffer (read-only is fine); every span is checked to lie inside it
 * before any is read. */
static PyObject *crc32c_spans(PyObject *self, PyObject *args) {
    PyObject *o_data, *o_off, *o_len, *o_crc;
    if (!PyArg_ParseTuple(args, "OOOO:crc32c_spans", &o_data, &o_off, &o_len, &o_crc)) return NULL;
    Py_buffer v_data, v_off, v_len, v_crc;
    if (PyObject_GetBuffer(o_data, &v_data, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_SetString(PyExc_TypeError, "crc32c_spans: data must be a C-contiguous buffer (a numpy array, bytes "
                        "or memoryview)");
        return NULL;
    }
    if (get_column(o_off, &v_off, 8, 'i', 0, "offsets") < 0) goto f0;
    if (get_column(o_len, &v_len, 8, 'i', 0, "lengths") < 0) goto f1;
    if (get_column(o_crc, &v_crc, 4, 'u', 1, "crcs_out") < 0) goto f2;
    Py_ssize_t count = v_off.shape[0];
    if (v_len.shape[0] != count || v_crc.shape[0] != count) {
        PyErr_Format(PyExc_ValueError, "crc32c_spans: the arrays differ in length (offsets %zd, lengths %zd, "
                     "crcs_out %zd): pass one entry per span in each", count, v_len.shape[0], v_crc.shape[0]);
        goto f3;
    }
    const int64_t *off = v_off.buf, *len = v_len.buf;
    if (check_spans(off, len, count, (int64_t)v_data.len, "crc32c_spans", "data") < 0) goto f3;
    const unsigned char *base = v_data.buf;
    uint32_t *out = v_crc.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        out[i] = update(0xFFFFFFFFu, base + off[i], (size_t)len[i]) ^ 0xFFFFFFFFu;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v_crc);
    PyBuffer_Release(&v_len);
    PyBuffer_Release(&v_off);
    PyBuffer_Release(&v_data);
    Py_RETURN_NONE;
f3:
    PyBuffer_Release(&v_crc);
f2:
    PyBuffer_Release(&v_len);
f1:
    PyBuffer_Release(&v_off);
f0:
    PyBuffer_Release(&v_data);
    return NULL;
}

/* One copy (offset, length, (address, length)) of a pool piece's list into the columns; 1 done,
 * 0 where its source is not an (address, length) tuple (a tensor: the caller copies it), -1 on error. */
static int parse_copy(PyObject *item, Py_ssize_t i, int64_t *off, int64_t *src, int64_t *len) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_Format(PyExc_TypeError, "gather_copies: copy %zd is not an (offset, length, source) tuple: pass "
                     "a pool piece's copies list", i);
        return -1;
    }
    PyObject *s = PyTuple_GET_ITEM(item, 2);
    if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) != 2) return 0;
    *off = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0));
    *len = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    *src = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 0));
    return PyErr_Occurred() ? -1 : 1;  /* a TypeError or OverflowError: not a 64-bit int */
}

/* gather_copies(dst_address, dst_size, copies, crcs, base): the copies of a list of (offset,
 * length, (address, length)) tuples, gathered, each crc32c to crcs[base + i]; False (nothing copied) where
 * a copy's source is not such a tuple. Parsing the tuples here costs a few ns a copy, less than
 * making numpy columns of them in Python. */
static PyObject *gather_copies(PyObject *self, PyObject *args) {
    unsigned long long dst_address;
    long long dst_size;
    PyObject *copies, *crcs;
    Py_ssize_t base;
    if (!PyArg_ParseTuple(args, "KLO!O!n:gather_copies", &dst_address, &dst_size, &PyList_Type, &copies,
                          &PyList_Type, &crcs, &base))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(copies);
    if (base < 0 || base > PyList_GET_SIZE(crcs) - count) {
        PyErr_Format(PyExc_ValueError, "gather_copies: slots %zd to %zd are not in the crcs list of %zd: pass "
                     "the piece's first slot (Piece.base)", base, base + count, PyList_GET_SIZE(crcs));
        return NULL;
    }
    if (dst_size < 0 || (dst_address == 0 && dst_size > 0)) {
        PyErr_Format(PyExc_ValueError, "gather_copies: the destination (address %llu, %lld bytes) is not a "
                     "memory region: pass a buffer's address and its non-negative size", dst_address, dst_size);
        return NULL;
    }
    int64_t *cols = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)(count ? count : 1));
    uint32_t *out = PyMem_Malloc(sizeof(uint32_t) * (size_t)(count ? count : 1));
    PyObject *result = NULL;
    if (!cols || !out) { PyErr_NoMemory(); goto done; }
    int64_t *off = cols, *src = cols + count, *len = cols + 2 * count;
    for (Py_ssize_t i = 0; i < count; i++) {
        int r = parse_copy(PyList_GET_ITEM(copies, i), i, off + i, src + i, len + i);
        if (r < 0) goto done;
        if (r == 0) { result = Py_False; Py_INCREF(result); goto done; }
    }
    if (check_spans(off, len, count, dst_size, "gather_copies", "destination") < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    gather((unsigned char *)(uintptr_t)dst_address, off, src, len, out, count);
    Py_END_ALLOW_THREADS
    if (base > PyList_GET_SIZE(crcs) - count) {  /* the list shrank meanwhile */
        PyErr_SetString(PyExc_RuntimeError, "gather_copies: the crcs list changed size during the copy");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *v = PyLong_FromUnsignedLong(out[i]);
        if (!v) goto done;
        PyList_SetItem(crcs, base + i, v);
    }
    result = Py_True;
    Py_INCREF(result);
done:
    PyMem_Free(cols);
    PyMem_Free(out);
    return result;
}

static PyObject *crc32c_py(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long crc = 0;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*|kp:crc32c", &data, &crc, &portable)) return NULL;
    update_fn f = portable ? table_update : update;
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = f((uint32_t)crc ^ 0xFFFFFFFFu, data.buf, (size_t)data.len) ^ 0xFFFFFFFFu;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(r);
}

static PyMethodDef methods[] = {
    {"crc32c_spans", crc32c_spans, METH_VARARGS,
     "crc32c_spans(data, offsets, lengths, crcs_out): crcs_out[i] = crc32c(data[offsets[i]:offsets[i] + lengths[i]]) "
     "for every i (int64 columns, uint32 crcs_out), the GIL released."},
    {"gather_copies", gather_copies, METH_VARARGS,
     "gather_copies(dst_address, dst_size, copies, crcs, base): copy a pool piece's list of (offset, "
     "length, (address, length)) tuples, each crc32c to crcs[base + i]; False, nothing copied, where a source is "
     "not such a tuple."},
    {"crc32c", crc32c_py, METH_VARARGS, "crc32c(data, crc=0, portable=False): the crc32c of data, continuing crc (portable: by the table, "
     "not the CPU's instruction; for tests)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gdswriter._gather",
                                    "The host snapshot's compiled gather (memmove and crc32c per copy) and a load's crc32c of many spans.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__gather(void) {
    make_table();
#if defined(GATHER_X86) || defined(GATHER_ARM)
    if (hw_present()) {
        make_zeros(zeros_long, LONG);
        make_zeros(zeros_short, SHORT);
        update = hw_update;
        impl_name = HW_NAME;
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "CRC_IMPL", impl_name) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
