/* Whether block files are there, for a batch of paths at once, without the
 * GIL: the one-call branch of BlockPresence.at (engine/block/presence.py) in
 * a C loop, so that lookups of a long prompt no longer share the scheduler's
 * interpreter lock for every key (issue 33; vLLM's built-in answers the same
 * way, one C loop of access()).
 *
 * Per path, exactly what the Python branch does: openat2(O_PATH|O_CLOEXEC,
 * RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_XDEV) below the root's
 * descriptor, fstat, close. Never follows a link, never crosses a mount
 * point, never resolves outside the root: the kernel refuses all three.
 * Answers, one byte per path:
 *   1  a block: a regular file of one of the accepted sizes;
 *   0  settled, not a block: anything else that opened, or ENOENT, ELOOP,
 *      ENOTDIR (ENOENT only when misses are not revalidated);
 *   2  unsettled (EXDEV, ENOSYS, EACCES, ESTALE, ...): the Python path
 *      decides that path exactly as it does without this module.
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
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture (5.6, generic table) */
#endif

#define RESOLVE_NO_XDEV_ 0x01
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08
#define MAX_SIZES 8

struct open_how_ {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

static char check_one(int root_fd, const char *path, const long long *sizes, int n_sizes,
                      int revalidate) {
    struct open_how_ how = {
        (uint64_t)(O_PATH | O_CLOEXEC),
        0,
        RESOLVE_BENEATH_ | RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_XDEV_,
    };
    long fd = syscall(SYS_openat2, root_fd, path, &how, sizeof how);
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

/* The paths as NUL-terminated bytes objects (new references in held). A
 * path with a NUL inside is answered 2 (its pointer is NULL). */
static int hold_paths(PyObject *seq, PyObject **held, const char **paths, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *raw;
        if (PyUnicode_Check(item)) {
            raw = PyUnicode_AsEncodedString(item, "utf-8", "surrogateescape");
        } else if (PyBytes_Check(item)) {
            Py_INCREF(item);
            raw = item;
        } else {
            PyErr_Format(PyExc_TypeError, "a path is str or bytes, not %.100s",
                         Py_TYPE(item)->tp_name);
            raw = NULL;
        }
        if (raw == NULL) {
            return -1;
        }
        held[i] = raw;
        const char *text = PyBytes_AS_STRING(raw);
        paths[i] = strlen(text) == (size_t)PyBytes_GET_SIZE(raw) ? text : NULL;
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

static PyObject *check_many(PyObject *self, PyObject *args) {
    int root_fd, revalidate;
    PyObject *given_paths, *given_sizes;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOp:check_many", &root_fd, &given_paths, &given_sizes,
                          &revalidate)) {
        return NULL;
    }
    long long sizes[MAX_SIZES];
    int n_sizes = read_sizes(given_sizes, sizes);
    if (n_sizes < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(given_paths, "paths must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *answers = PyBytes_FromStringAndSize(NULL, n);
    PyObject **held = PyMem_Calloc(n ? (size_t)n : 1, sizeof(PyObject *));
    const char **paths = PyMem_Calloc(n ? (size_t)n : 1, sizeof(char *));
    if (answers == NULL || held == NULL || paths == NULL) {
        if (answers != NULL) {
            PyErr_NoMemory();
        }
        Py_CLEAR(answers);
    } else if (hold_paths(seq, held, paths, n) < 0) {
        Py_CLEAR(answers);
    } else {
        char *out = PyBytes_AS_STRING(answers);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i] = paths[i] == NULL ? 2 : check_one(root_fd, paths[i], sizes, n_sizes, revalidate);
        }
        Py_END_ALLOW_THREADS
    }
    if (held != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(held[i]);
        }
    }
    PyMem_Free(held);
    PyMem_Free(paths);
    Py_DECREF(seq);
    return answers;
}

static PyMethodDef methods[] = {
    {"check_many", check_many, METH_VARARGS,
     "check_many(root_fd, paths, sizes, revalidate_misses) -> bytes\n\n"
     "One byte per path below root_fd: 1 a block file of one of sizes, 0 settled\n"
     "not a block, 2 unsettled (the caller's own path decides). Releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_presence", "Batch presence checks of block files (presence.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__presence(void) { return PyModule_Create(&module); }
