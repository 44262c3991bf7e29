/* Whether block files are there, for a batch of keys at once, without the
 * GIL: the one-call branch of BlockPresence.at (engine/block/presence.py) in
 * a C loop, so that lookups of a long prompt do not share the scheduler's
 * interpreter lock for every key (vLLM's built-in answers the same way, one
 * C loop of access()).
 *
 * Per key, exactly what the Python branch does: openat2(O_PATH|O_CLOEXEC,
 * RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_XDEV) below the root's
 * descriptor, fstat, close. Never follows a link, never crosses a mount
 * point, never resolves outside the root: the kernel refuses all three.
 * Answers, one byte per key:
 *   1  a block: a regular file of one of the accepted sizes;
 *   0  settled, not a block: anything else that opened, or ENOENT, ELOOP,
 *      ENOTDIR (ENOENT only when misses are not revalidated);
 *   2  unsettled (EXDEV, ENOSYS, EACCES, ESTALE, ...): the Python path
 *      decides that path exactly as it does without this module.
 *
 * The keys' paths are built in the loop too, without the GIL:
 * <prefix>/<hhh>/<hh>_g<group>/<hash>.bin, byte for byte layout/names.py's
 * block_rel_path (a test holds the two together), so the lookup thread
 * does not hold the interpreter lock per key, the lock the scheduler's
 * re-scan of the same prompt needs every step.
 *
 * A call may be given a time budget: it then stops once the budget is spent
 * (after at least one key) and answers only the keys it checked, so that a
 * long chunk on a volume that turns slow mid-way holds nobody's verdicts
 * for longer than that (engine/lookup_checks.py).
 *
 * Optional: built by the package's ordinary install where a C compiler and
 * Python's headers are (pyproject.toml, ext-modules, optional); the tier
 * runs the Python path without it. Linux only (openat2, 5.6+).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef __linux__
#error "openat2 is Linux only"
#endif

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "beneath.h"

#define MAX_SIZES 8


static char check_one(int root_fd, const char *path, const long long *sizes, int n_sizes,
                      int revalidate) {
    long fd = open_beneath(root_fd, path, O_PATH);
    if (fd < 0) {
        int code = errno;
        if (code == ELOOP || code == ENOTDIR || (code == ENOENT && !revalidate)) {
            return 0;
        }
        return 2;
    }
    struct stat st;
    int got = fstat((int)fd, &st);
    close((int)fd);
    if (got != 0) {
        return 2;
    }
    if (!S_ISREG(st.st_mode)) {
        return 0;
    }
    for (int i = 0; i < n_sizes; i++) {
        if ((long long)st.st_size == sizes[i]) {
            return 1;
        }
    }
    return 0;
}

static int read_sizes(PyObject *given, long long *sizes) {
    PyObject *seq = PySequence_Fast(given, "sizes must be a sequence of ints");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_SIZES) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "at most 8 accepted sizes");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        sizes[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (sizes[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return (int)n;
}

/* "<prefix>/<hhh>/<hh>_g<group>/<hex>.bin" into out: layout/names.py's
 * block_rel_parts joined. */
static void block_path(char *out, const char *prefix, size_t prefix_len,
                       const unsigned char *key, size_t hash_len) {
    char name[NAME_BYTES];
    size_t dir_len = block_place(out, name, prefix, prefix_len, key, hash_len);
    out[dir_len] = '/';
    memcpy(out + dir_len + 1, name, 2 * hash_len + 5);
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static PyObject *check_keys(PyObject *self, PyObject *args) {
    int root_fd, revalidate;
    const char *prefix;
    Py_ssize_t prefix_len;
    PyObject *given_keys, *given_sizes;
    long long budget_ns = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#OOp|L:check_keys", &root_fd, &prefix, &prefix_len,
                          &given_keys, &given_sizes, &revalidate, &budget_ns)) {
        return NULL;
    }
    if (prefix_len > MAX_PREFIX || strlen(prefix) != (size_t)prefix_len) {
        PyErr_SetString(PyExc_ValueError, "the prefix is too long or holds a NUL");
        return NULL;
    }
    long long sizes[MAX_SIZES];
    int n_sizes = read_sizes(given_sizes, sizes);
    if (n_sizes < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(given_keys, "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *answers = PyBytes_FromStringAndSize(NULL, n);
    PyObject **held = PyMem_Calloc(n ? (size_t)n : 1, sizeof(PyObject *));
    if (answers == NULL || held == NULL) {
        Py_XDECREF(answers);
        PyMem_Free(held);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* keys stay alive while the GIL is away */
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (PyBytes_Check(key)) {
            Py_INCREF(key);
            held[i] = key;
        }
    }
    char *out = PyBytes_AS_STRING(answers);
    Py_ssize_t checked = n;
    Py_BEGIN_ALLOW_THREADS
    char path[PATH_BYTES];
    long long started = budget_ns > 0 ? now_ns() : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t key_len = held[i] == NULL ? 0 : PyBytes_GET_SIZE(held[i]);
        size_t hash_len = key_len > 4 ? (size_t)key_len - 4 : 0;
        if (hash_len < MIN_HASH_BYTES || hash_len > MAX_HASH_BYTES) {
            out[i] = 2;  /* not a key this layout names: the Python path decides */
        } else {
            block_path(path, prefix, (size_t)prefix_len,
                       (const unsigned char *)PyBytes_AS_STRING(held[i]), hash_len);
            out[i] = check_one(root_fd, path, sizes, n_sizes, revalidate);
        }
        if (budget_ns > 0 && i + 1 < n && now_ns() - started >= budget_ns) {
            checked = i + 1;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(held[i]);
    }
    PyMem_Free(held);
    Py_DECREF(seq);
    if (checked < n) {  /* the budget was spent: the keys checked */
        PyObject *some = PyBytes_FromStringAndSize(PyBytes_AS_STRING(answers), checked);
        Py_DECREF(answers);
        return some;
    }
    return answers;
}

static PyMethodDef methods[] = {
    {"check_keys", check_keys, METH_VARARGS,
     "check_keys(root_fd, prefix, keys, sizes, revalidate_misses, budget_ns=0) -> bytes\n\n"
     "One byte per key: is its block file below prefix (bytes: the rank\n"
     "directory), at the path layout/names.py's block_rel_path names, one of\n"
     "sizes: 1 yes, 0 settled no, 2 unsettled (the caller's own path decides;\n"
     "also a key too short or too long to name a block). Releases the GIL.\n"
     "With budget_ns > 0, stops once that much time is spent (after one key at\n"
     "least): then fewer bytes than keys, for the first keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_presence", "Batch presence checks of block files (presence.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__presence(void) { return PyModule_Create(&module); }
