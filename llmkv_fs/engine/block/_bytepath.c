/* The compiled byte path: a whole slice of one job's blocks stored or loaded
 * in one call that releases the GIL, so that I/O threads do not pay the
 * interpreter's per-block cost (engine/block/bytes_c.py drives it).
 *
 * It is the Python path's common case, step for step, and nothing else:
 *   load_slice   per block: the file opened beneath the root's descriptor in
 *                one openat2 (RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|
 *                RESOLVE_NO_XDEV, the caller's read flags: O_RDONLY|
 *                O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC[|O_DIRECT]), read into its
 *                row and a two-page tail as volume/vectored.py's read_all
 *                (or in pieces, each hashed right after it lands, as
 *                bytepath.py's VectoredBytes), then judged as
 *                layout/judgement.py's judge_plain: exactly payload + trailer
 *                bytes, magic, version 1, the trailer's own xxh3, the payload
 *                length, the key, and with the checksum on its flag and the
 *                payload's xxh3-64.
 *   store_slice  per block: its directory opened beneath the root in one
 *                openat2 (volume/beneath.py's DIR_FLAGS; its two levels
 *                below the rank directory made first where missing, with
 *                exactly the directory mode), nothing at the
 *                block's name (faccessat, no link followed), the temp file
 *                created exclusively under layout/names.py's temp_name, the
 *                row and its trailer (layout/blockfile.py's pack_trailer)
 *                written, fsync'ed if asked, its length checked, the
 *                deadline asked, renamed to the block's name (EEXIST: the
 *                block is there, PRESENT), the directory fsync'ed if asked.
 *
 * Anything else stops the call at that block -- a missing file, a bad or
 * sealed trailer, a short read, any errno, something already at a store's
 * name, a deadline passed -- and answers its index and why: the caller runs
 * that block through the Python path, which does what it always does (the
 * walk, quarantine, miss reasons, REPLACED, the space guard, metrics). The
 * blocks before it are done: every load among them verified as above (a
 * block whose bytes were not all checked is never among them), every store
 * published. A store that stops removes its temp file; nothing else it made
 * stays. Descriptors are closed on every path.
 *
 * The xxh3-64 (seed 0, the payload's bytes; the trailer's own over its
 * bytes before it) is xxHash's, vendored under third_party/xxhash (BSD-2),
 * with its run-time choice of SSE2, AVX2 or AVX-512 on x86-64, as
 * python-xxhash picks.
 *
 * Optional: built by the package's ordinary install where a C compiler and
 * Python's headers are (pyproject.toml, ext-modules, optional); the tier
 * runs the Python path without it. Linux only (openat2, 5.6+).
 *
 * Threading: stateless; any number of threads may call it at once, each on
 * its own rows.
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
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include "third_party/xxhash/xxh_x86dispatch.c"
#define XXH3_ONE XXH3_64bits_dispatch
#define XXH3_UPDATE XXH3_64bits_update_dispatch
#define XXH3_WHICH "dispatched at run time (SSE2, AVX2 or AVX-512)"
#else
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"
#define XXH3_ONE XXH3_64bits
#define XXH3_UPDATE XXH3_64bits_update
#define XXH3_WHICH "as compiled"
#endif

#include "beneath.h"

/* layout/blockfile.py */
#define TRAILER_SIZE 4096
#define MAX_KEY_LEN 1024
#define HEAD_SIZE 42
#define FORMAT_VERSION 1
#define FLAG_CHECKSUM 1
static const unsigned char MAGIC[8] = {'L', 'L', 'M', 'K', 'V', 'F', 'S', 0};

/* Why a call stopped (bytes_c.py names them; STOP_NONE: it did not). */
enum stop {
    STOP_NONE = 0,
    STOP_DEADLINE,     /* the deadline passed before the block started */
    STOP_CHUNK,        /* the chunk lies outside the rows */
    STOP_KEY,          /* a key this layout cannot name, or longer than a trailer holds */
    STOP_OPEN,         /* the block's openat2 failed (errno) */
    STOP_READ,         /* a read failed (errno) */
    STOP_LENGTH,       /* the file is not payload + trailer bytes long */
    STOP_TRAILER,      /* magic, version, key length or the trailer's own xxh3 */
    STOP_SEALED,       /* a sealed trailer (version 2) */
    STOP_PAYLOAD_LEN,  /* the trailer records another payload length */
    STOP_WRONG_KEY,    /* the trailer holds another key */
    STOP_NO_CHECKSUM,  /* written without a checksum, and this reader wants one */
    STOP_CHECKSUM,     /* the payload's xxh3 differs */
    STOP_DIR,          /* the store's directory did not open in one call (errno) */
    STOP_THERE,        /* something is at the block's name (or faccessat failed) */
    STOP_CREATE,       /* the temp file's exclusive create failed (errno) */
    STOP_WRITE,        /* a write failed (errno) */
    STOP_FSYNC,        /* the temp file's fsync failed (errno) */
    STOP_SIZE,         /* the temp file's length is not a block file's (or fstat failed) */
    STOP_CLOSE,        /* closing the temp file failed (errno) */
    STOP_ABANDONED,    /* the deadline passed before the rename: not published */
    STOP_RENAME,       /* the rename failed (errno) */
    STOP_FSYNC_DIR,    /* the directory's fsync failed after the rename (errno) */
    STOP_CHMOD,        /* the temp file's fchmod failed (errno) */
};

/* What a store published (bytes_c.py maps them to Outcome). */
#define DONE_WRITTEN 'W'
#define DONE_PRESENT 'P'

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t realtime_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}


/* -- names: layout/names.py's block_place and temp_name, byte for byte ---- */

#define MAX_HOST 512
#define TEMP_BYTES (2 * MAX_HASH_BYTES + MAX_HOST + 96)

/* -- the trailer: layout/blockfile.py ------------------------------------- */

static void put_le(unsigned char *at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; i++) {
        at[i] = (unsigned char)(value >> (8 * i));
    }
}

static uint64_t get_le(const unsigned char *at, int bytes) {
    uint64_t value = 0;
    for (int i = bytes - 1; i >= 0; i--) {
        value = (value << 8) | at[i];
    }
    return value;
}

/* pack_trailer: the page filled in place, zeros after the trailer. */
static void pack_trailer(unsigned char *page, const unsigned char *key, size_t key_len,
                         uint64_t payload_len, int checksum, uint64_t digest) {
    memcpy(page, MAGIC, 8);
    put_le(page + 8, FORMAT_VERSION, 2);
    put_le(page + 10, checksum ? FLAG_CHECKSUM : 0, 2);
    put_le(page + 12, 0, 4);
    put_le(page + 16, payload_len, 8);
    put_le(page + 24, checksum ? digest : 0, 8);
    put_le(page + 32, realtime_ns(), 8);
    put_le(page + 40, key_len, 2);
    memcpy(page + HEAD_SIZE, key, key_len);
    size_t key_end = HEAD_SIZE + key_len;
    put_le(page + key_end, XXH3_ONE(page, key_end), 8);
    memset(page + key_end + 8, 0, TRAILER_SIZE - key_end - 8);
}

/* judge_plain for a file of payload + trailer bytes: STOP_NONE when it is
 * this block's, with its checksum matching where the reader wants one. */
static int judge(const unsigned char *page, const unsigned char *key, size_t key_len,
                 uint64_t payload_len, int checksum, uint64_t digest) {
    if (memcmp(page, MAGIC, 8) != 0) {
        return STOP_TRAILER;
    }
    uint64_t version = get_le(page + 8, 2);
    if (version != FORMAT_VERSION) {
        return version == 2 ? STOP_SEALED : STOP_TRAILER;
    }
    size_t stored_key_len = (size_t)get_le(page + 40, 2);
    size_t key_end = HEAD_SIZE + stored_key_len;
    if (stored_key_len > MAX_KEY_LEN || key_end + 8 > TRAILER_SIZE) {
        return STOP_TRAILER;
    }
    if (get_le(page + key_end, 8) != XXH3_ONE(page, key_end)) {
        return STOP_TRAILER;
    }
    if (get_le(page + 16, 8) != payload_len) {
        return STOP_PAYLOAD_LEN;
    }
    if (stored_key_len != key_len || memcmp(page + HEAD_SIZE, key, key_len) != 0) {
        return STOP_WRONG_KEY;
    }
    if (!checksum) {
        return STOP_NONE; /* UNVERIFIED: length and key checked, the payload not */
    }
    if (!(get_le(page + 10, 2) & FLAG_CHECKSUM)) {
        return STOP_NO_CHECKSUM;
    }
    return get_le(page + 24, 8) == digest ? STOP_NONE : STOP_CHECKSUM;
}

/* -- moving bytes: volume/vectored.py and bytepath.py ---------------------- */

/* write_all: pwritev from off until every buffer is written; 0 or errno. */
static int write_all(int fd, struct iovec *iov, int count, off_t off) {
    while (count > 0) {
        ssize_t n = pwritev(fd, iov, count, off);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        if (n == 0) {
            return EIO;
        }
        off += n;
        while (count > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

/* One preadv, retried on EINTR only; bytes or -errno. */
static ssize_t pread_once(int fd, struct iovec *iov, int count, off_t off) {
    for (;;) {
        ssize_t n = preadv(fd, iov, count, off);
        if (n >= 0) {
            return n;
        }
        if (errno != EINTR) {
            return -errno;
        }
    }
}

/* read_all of [row, tail] from offset 0: again after a short count until
 * EOF, the buffers full, or the count is `enough`. Bytes or -errno. */
static ssize_t read_all(int fd, struct iovec *iov, int count, size_t enough) {
    ssize_t done = 0;
    for (;;) {
        ssize_t n = pread_once(fd, iov, count, done);
        if (n < 0) {
            return n;
        }
        if (n == 0) {
            return done;
        }
        done += n;
        if ((size_t)done == enough) {
            return done;
        }
        while (count > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count == 0) {
            return done;
        }
        iov->iov_base = (char *)iov->iov_base + n;
        iov->iov_len -= (size_t)n;
    }
}

/* VectoredBytes.read in pieces: each piece hashed right after it lands,
 * the tail riding with the last. Bytes (the digest in *digest) or -errno. */
static ssize_t read_pieces(int fd, unsigned char *row, size_t size, unsigned char *tail,
                           size_t tail_len, size_t piece, XXH3_state_t *state,
                           uint64_t *digest) {
    XXH3_64bits_reset(state);
    size_t done = 0;
    while (done < size) {
        size_t end = done + piece;
        if (end >= size) {
            struct iovec iov[2] = {{row + done, size - done}, {tail, tail_len}};
            ssize_t n = pread_once(fd, iov, 2, (off_t)done);
            if (n < 0) {
                return n;
            }
            size_t payload = (size_t)n < size - done ? (size_t)n : size - done;
            XXH3_UPDATE(state, row + done, payload);
            *digest = XXH3_64bits_digest(state);
            return (ssize_t)(done + (size_t)n);
        }
        struct iovec iov[1] = {{row + done, end - done}};
        ssize_t n = pread_once(fd, iov, 1, (off_t)done);
        if (n < 0) {
            return n;
        }
        if (n == 0) {
            break;
        }
        XXH3_UPDATE(state, row + done, (size_t)n);
        done += (size_t)n;
    }
    *digest = XXH3_64bits_digest(state);
    return (ssize_t)done;
}

/* -- arguments shared by both entry points -------------------------------- */

struct slice_args {
    int root_fd;
    const char *prefix;
    Py_ssize_t prefix_len;
    PyObject *keys_seq;   /* PySequence_Fast of the keys */
    PyObject **keys;      /* the keys from start to stop, held (NULL: not bytes) */
    long long *chunks;    /* their chunks (-1: not an int in range) */
    Py_ssize_t count;
    Py_buffer rows;
    long long block_size;
    double deadline;      /* monotonic seconds; inf: none */
    Py_buffer cancel;     /* the job's cancel byte (nonzero: not wanted any more) */
};

/* Past the deadline, or the job cancelled (the owner sets the byte under its
 * lock; a stale read here costs one block, which the rename check catches). */
static int unwanted(const struct slice_args *a) {
    if (((volatile const unsigned char *)a->cancel.buf)[0] != 0) {
        return 1;
    }
    return monotonic_s() >= a->deadline;
}

static void release_args(struct slice_args *a) {
    if (a->keys != NULL) {
        for (Py_ssize_t i = 0; i < a->count; i++) {
            Py_XDECREF(a->keys[i]);
        }
    }
    PyMem_Free(a->keys);
    PyMem_Free(a->chunks);
    Py_XDECREF(a->keys_seq);
    if (a->rows.obj != NULL) {
        PyBuffer_Release(&a->rows);
    }
    if (a->cancel.obj != NULL) {
        PyBuffer_Release(&a->cancel);
    }
}

/* Keys and chunks from start to stop taken while the GIL is held. */
static int take_args(struct slice_args *a, PyObject *keys, PyObject *chunks, Py_ssize_t start,
                     Py_ssize_t stop, PyObject *rows, int writable) {
    if (a->cancel.len < 1) {
        PyErr_SetString(PyExc_ValueError, "the cancel byte is empty");
        return -1;
    }
    if (a->prefix_len > MAX_PREFIX || strlen(a->prefix) != (size_t)a->prefix_len) {
        PyErr_SetString(PyExc_ValueError, "the prefix is too long or holds a NUL");
        return -1;
    }
    if (a->block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    if (PyObject_GetBuffer(rows, &a->rows, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        a->rows.obj = NULL;
        return -1;
    }
    a->keys_seq = PySequence_Fast(keys, "keys must be a sequence");
    if (a->keys_seq == NULL) {
        return -1;
    }
    PyObject *chunk_seq = PySequence_Fast(chunks, "chunks must be a sequence");
    if (chunk_seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a->keys_seq);
    if (PySequence_Fast_GET_SIZE(chunk_seq) != n || start < 0 || stop > n || start > stop) {
        Py_DECREF(chunk_seq);
        PyErr_SetString(PyExc_ValueError, "keys and chunks differ in length, or a bad range");
        return -1;
    }
    a->count = stop - start;
    a->keys = PyMem_Calloc(a->count ? (size_t)a->count : 1, sizeof(PyObject *));
    a->chunks = PyMem_Calloc(a->count ? (size_t)a->count : 1, sizeof(long long));
    if (a->keys == NULL || a->chunks == NULL) {
        Py_DECREF(chunk_seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < a->count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(a->keys_seq, start + i);
        if (PyBytes_Check(key)) {
            Py_INCREF(key);
            a->keys[i] = key;
        }
        long long chunk = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(chunk_seq, start + i));
        if (chunk == -1 && PyErr_Occurred()) {
            PyErr_Clear();
        }
        a->chunks[i] = chunk;
    }
    Py_DECREF(chunk_seq);
    return 0;
}

/* The row of chunk (NULL: outside the rows, as BlockStep.run refuses it). */
static unsigned char *row_of(const struct slice_args *a, long long chunk) {
    long long rows = (long long)a->rows.len / a->block_size;
    if (chunk < 0 || chunk >= rows) {
        return NULL;
    }
    return (unsigned char *)a->rows.buf + chunk * a->block_size;
}

/* The key's hash length, or 0 when the layout cannot name it. */
static size_t hash_len_of(PyObject *key) {
    Py_ssize_t key_len = key == NULL ? 0 : PyBytes_GET_SIZE(key);
    size_t hash_len = key_len > 4 ? (size_t)key_len - 4 : 0;
    if (hash_len < MIN_HASH_BYTES || hash_len > MAX_HASH_BYTES || key_len > MAX_KEY_LEN) {
        return 0;
    }
    return hash_len;
}

static PyObject *answer(Py_ssize_t done, int stop, int code, PyObject *outcomes) {
    if (outcomes == NULL) {
        return Py_BuildValue("(nii)", done, stop, code);
    }
    return Py_BuildValue("(niiN)", done, stop, code, outcomes);
}

/* -- load ---------------------------------------------------------------- */

static int load_one(const struct slice_args *a, PyObject *key, unsigned char *row, int flags,
                    int checksum, size_t piece, unsigned char *tail, XXH3_state_t *state,
                    int *code) {
    size_t hash_len = hash_len_of(key);
    if (hash_len == 0) {
        return STOP_KEY;
    }
    const unsigned char *key_bytes = (const unsigned char *)PyBytes_AS_STRING(key);
    size_t key_len = (size_t)PyBytes_GET_SIZE(key);
    char path[PATH_BYTES];
    char name[2 * MAX_HASH_BYTES + 8];
    size_t dir_len = block_place(path, name, a->prefix, (size_t)a->prefix_len, key_bytes,
                                 hash_len);
    path[dir_len] = '/';
    memcpy(path + dir_len + 1, name, 2 * hash_len + 5);
    long fd = open_beneath(a->root_fd, path, flags);
    if (fd < 0) {
        *code = errno;
        return STOP_OPEN;
    }
    size_t size = (size_t)a->block_size;
    size_t whole = size + TRAILER_SIZE;
    uint64_t digest = 0;
    ssize_t n;
    if (checksum && piece) {
        n = read_pieces((int)fd, row, size, tail, 2 * TRAILER_SIZE, piece, state, &digest);
    } else {
        struct iovec iov[2] = {{row, size}, {tail, 2 * TRAILER_SIZE}};
        n = read_all((int)fd, iov, 2, whole);
    }
    close((int)fd); /* read-only: a close can lose nothing */
    if (n < 0) {
        *code = (int)-n;
        return STOP_READ;
    }
    if ((size_t)n != whole) {
        return STOP_LENGTH;
    }
    if (checksum && !piece) {
        digest = XXH3_ONE(row, size);
    }
    return judge(tail, key_bytes, key_len, (uint64_t)size, checksum, digest);
}

static PyObject *load_slice(PyObject *self, PyObject *args) {
    struct slice_args a;
    memset(&a, 0, sizeof a);
    PyObject *keys, *chunks, *rows;
    Py_ssize_t start, stop;
    int flags, checksum;
    long long piece;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#OOnnOLipLdy*:load_slice", &a.root_fd, &a.prefix,
                          &a.prefix_len, &keys, &chunks, &start, &stop, &rows, &a.block_size,
                          &flags, &checksum, &piece, &a.deadline, &a.cancel)) {
        return NULL;
    }
    if (take_args(&a, keys, chunks, start, stop, rows, 1) < 0) {
        release_args(&a);
        return NULL;
    }
    /* As VectoredBytes: pieces only where they divide the block into more
     * than one. */
    size_t pieces = (checksum && piece > 0 && a.block_size % piece == 0 && a.block_size > piece)
                        ? (size_t)piece : 0;
    unsigned char *tail = NULL;
    XXH3_state_t *state = NULL;
    if (posix_memalign((void **)&tail, TRAILER_SIZE, 2 * TRAILER_SIZE) != 0 ||
        (state = XXH3_createState()) == NULL) {
        free(tail);
        release_args(&a);
        return PyErr_NoMemory();
    }
    Py_ssize_t done = 0;
    int stopped = STOP_NONE, code = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; done < a.count; done++) {
        if (unwanted(&a)) {
            stopped = STOP_DEADLINE;
            break;
        }
        unsigned char *row = row_of(&a, a.chunks[done]);
        if (row == NULL) {
            stopped = STOP_CHUNK;
            break;
        }
        stopped = load_one(&a, a.keys[done], row, flags, checksum, pieces, tail, state, &code);
        if (stopped != STOP_NONE) {
            break;
        }
    }
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    free(tail);
    release_args(&a);
    return answer(done, stopped, code, NULL);
}

/* -- store --------------------------------------------------------------- */

struct store_args {
    int dir_flags, dir_mode, dir_chmod, temp_flags, file_mode, chmod, checksum, fsync_file,
        fsync_dir;
    size_t piece;
    const char *host;
    Py_ssize_t host_len;
    long long pid;
    char nonce[32];
};

static int write_block(int fd, const unsigned char *row, size_t size, unsigned char *page,
                       const unsigned char *key, size_t key_len, const struct store_args *s,
                       XXH3_state_t *state) {
    if (!s->piece) {
        uint64_t digest = s->checksum ? XXH3_ONE(row, size) : 0;
        pack_trailer(page, key, key_len, size, s->checksum, digest);
        struct iovec iov[2] = {{(void *)row, size}, {page, TRAILER_SIZE}};
        return write_all(fd, iov, 2, 0);
    }
    /* Each piece hashed right after the kernel's copy pulled it into cache. */
    XXH3_64bits_reset(state);
    for (size_t done = 0; done < size; done += s->piece) {
        size_t len = size - done < s->piece ? size - done : s->piece;
        struct iovec iov[1] = {{(void *)(row + done), len}};
        int failed = write_all(fd, iov, 1, (off_t)done);
        if (failed) {
            return failed;
        }
        XXH3_UPDATE(state, row + done, len);
    }
    pack_trailer(page, key, key_len, size, s->checksum, XXH3_64bits_digest(state));
    struct iovec iov[1] = {{page, TRAILER_SIZE}};
    return write_all(fd, iov, 1, (off_t)size);
}

/* mkdir name in parent_fd with exactly dir_mode, as beneath.py's
 * make_dir_at (a chmod through a descriptor of it, never by name): 0, or
 * errno. EEXIST is no error. */
static int make_dir_at(int parent_fd, const char *name, const struct store_args *s) {
    if (mkdirat(parent_fd, name, (mode_t)s->dir_mode) != 0) {
        return errno == EEXIST ? 0 : errno;
    }
    if (!s->dir_chmod) {
        return 0;
    }
    int fd = openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        return errno;
    }
    int failed = fchmod(fd, (mode_t)s->dir_mode) != 0 ? errno : 0;
    close(fd);
    return failed;
}

/* The store's directory <prefix>/<hhh>/<hh>_g<g> opened beneath the root in
 * one call; the two levels below the prefix made first where missing (the
 * prefix itself, the rank directory, never: the Python path makes it). The
 * parents are opened beneath the root too, and the directory is opened in
 * one call after the mkdirs, so a link or a mount point swapped in is
 * refused. A descriptor, or -1 with *code. */
static long open_store_dir(const struct slice_args *a, const struct store_args *s, char *dir,
                           size_t dir_len, int *code) {
    long fd = open_beneath(a->root_fd, dir, s->dir_flags);
    if (fd >= 0 || errno != ENOENT) {
        *code = errno;
        return fd;
    }
    size_t levels[2] = {(size_t)a->prefix_len, (size_t)a->prefix_len + 4}; /* "/<hhh>" */
    for (int i = 0; i < 2; i++) {
        dir[levels[i]] = '\0';
        long parent = open_beneath(a->root_fd, dir, s->dir_flags);
        dir[levels[i]] = '/';
        if (parent < 0) {
            *code = errno;
            return -1;
        }
        size_t end = i == 0 ? levels[1] : dir_len;
        char name[64];
        size_t len = end - levels[i] - 1;
        memcpy(name, dir + levels[i] + 1, len);
        name[len] = '\0';
        int failed = make_dir_at((int)parent, name, s);
        close((int)parent);
        if (failed) {
            *code = failed;
            return -1;
        }
    }
    fd = open_beneath(a->root_fd, dir, s->dir_flags);
    *code = fd < 0 ? errno : 0;
    return fd;
}

static int store_one(const struct slice_args *a, const struct store_args *s, PyObject *key,
                     const unsigned char *row, unsigned char *page, XXH3_state_t *state,
                     int *code, char *outcome) {
    size_t hash_len = hash_len_of(key);
    if (hash_len == 0) {
        return STOP_KEY;
    }
    const unsigned char *key_bytes = (const unsigned char *)PyBytes_AS_STRING(key);
    size_t key_len = (size_t)PyBytes_GET_SIZE(key);
    char dir[PATH_BYTES];
    char name[2 * MAX_HASH_BYTES + 8];
    size_t dir_len = block_place(dir, name, a->prefix, (size_t)a->prefix_len, key_bytes,
                                 hash_len);
    long dir_fd = open_store_dir(a, s, dir, dir_len, code);
    if (dir_fd < 0) {
        return STOP_DIR;
    }
    int stopped = STOP_NONE;
    if (faccessat((int)dir_fd, name, F_OK, AT_SYMLINK_NOFOLLOW) == 0) {
        close((int)dir_fd);
        return STOP_THERE; /* BlockIO._found judges it: PRESENT or REPLACED */
    }
    if (errno != ENOENT) {
        *code = errno;
        close((int)dir_fd);
        return STOP_THERE;
    }
    char tmp[TEMP_BYTES];
    snprintf(tmp, sizeof tmp, ".%s.%.*s~%lld~%s.tmp", name, (int)s->host_len, s->host, s->pid,
             s->nonce);
    int fd = openat((int)dir_fd, tmp, s->temp_flags, (mode_t)s->file_mode);
    if (fd < 0) {
        *code = errno;
        close((int)dir_fd);
        return STOP_CREATE;
    }
    size_t size = (size_t)a->block_size;
    struct stat st;
    int failed;
    if (s->chmod && fchmod(fd, (mode_t)s->file_mode) != 0) {
        *code = errno;
        stopped = STOP_CHMOD;
    } else if ((failed = write_block(fd, row, size, page, key_bytes, key_len, s, state)) != 0) {
        *code = failed;
        stopped = STOP_WRITE;
    } else if (s->fsync_file && fsync(fd) != 0) {
        *code = errno;
        stopped = STOP_FSYNC;
    } else if (fstat(fd, &st) != 0) {
        *code = errno;
        stopped = STOP_SIZE;
    } else if ((size_t)st.st_size != size + TRAILER_SIZE) {
        stopped = STOP_SIZE;
    }
    if (close(fd) != 0 && stopped == STOP_NONE) {
        *code = errno;
        stopped = STOP_CLOSE;
    }
    if (stopped == STOP_NONE && unwanted(a)) {
        stopped = STOP_ABANDONED;
    }
    if (stopped == STOP_NONE) {
        if (renameat((int)dir_fd, tmp, (int)dir_fd, name) == 0) {
            *outcome = DONE_WRITTEN;
        } else if (errno == EEXIST) {
            /* A filesystem that refuses to rename over a name: names are
             * content keys, so the file there is this block. */
            *outcome = DONE_PRESENT;
        } else {
            *code = errno;
            stopped = STOP_RENAME;
        }
    }
    if (stopped != STOP_NONE || *outcome == DONE_PRESENT) {
        unlinkat((int)dir_fd, tmp, 0);
    }
    if (stopped == STOP_NONE && *outcome == DONE_WRITTEN && s->fsync_dir) {
        int dfd = openat((int)dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0 || fsync(dfd) != 0) {
            *code = errno;
            stopped = STOP_FSYNC_DIR;
        }
        if (dfd >= 0) {
            close(dfd);
        }
    }
    close((int)dir_fd);
    return stopped;
}

static PyObject *store_slice(PyObject *self, PyObject *args) {
    struct slice_args a;
    struct store_args s;
    memset(&a, 0, sizeof a);
    memset(&s, 0, sizeof s);
    PyObject *keys, *chunks, *rows;
    Py_ssize_t start, stop;
    long long piece;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy#OOnnOLiipiipLpppy#Ldy*:store_slice", &a.root_fd, &a.prefix,
                          &a.prefix_len, &keys, &chunks, &start, &stop, &rows, &a.block_size,
                          &s.dir_flags, &s.dir_mode, &s.dir_chmod, &s.temp_flags, &s.file_mode, &s.chmod, &piece,
                          &s.checksum, &s.fsync_file, &s.fsync_dir, &s.host, &s.host_len,
                          &s.pid, &a.deadline, &a.cancel)) {
        return NULL;
    }
    if (s.host_len > MAX_HOST || strlen(s.host) != (size_t)s.host_len) {
        PyErr_SetString(PyExc_ValueError, "the host name is too long or holds a NUL");
        release_args(&a);
        return NULL;
    }
    if (take_args(&a, keys, chunks, start, stop, rows, 0) < 0) {
        release_args(&a);
        return NULL;
    }
    s.piece = (s.checksum && piece > 0 && a.block_size % piece == 0 && a.block_size > piece)
                  ? (size_t)piece : 0;
    /* The temp name's nonce: the calling thread's id in hex, as BlockIO's. */
    snprintf(s.nonce, sizeof s.nonce, "%lx", (long)syscall(SYS_gettid));
    PyObject *outcomes = PyBytes_FromStringAndSize(NULL, a.count);
    unsigned char *page = NULL;
    XXH3_state_t *state = NULL;
    if (outcomes == NULL || posix_memalign((void **)&page, TRAILER_SIZE, TRAILER_SIZE) != 0 ||
        (state = XXH3_createState()) == NULL) {
        Py_XDECREF(outcomes);
        free(page);
        release_args(&a);
        return PyErr_NoMemory();
    }
    char *out = PyBytes_AS_STRING(outcomes);
    Py_ssize_t done = 0;
    int stopped = STOP_NONE, code = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; done < a.count; done++) {
        if (unwanted(&a)) {
            stopped = STOP_DEADLINE;
            break;
        }
        unsigned char *row = row_of(&a, a.chunks[done]);
        if (row == NULL) {
            stopped = STOP_CHUNK;
            break;
        }
        stopped = store_one(&a, &s, a.keys[done], row, page, state, &code, out + done);
        if (stopped != STOP_NONE) {
            break;
        }
    }
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    free(page);
    release_args(&a);
    if (done < a.count && _PyBytes_Resize(&outcomes, done) < 0) {
        return NULL;
    }
    return answer(done, stopped, code, outcomes);
}

static PyObject *xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:xxh3_64", &data)) {
        return NULL;
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = XXH3_ONE(data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyMethodDef methods[] = {
    {"load_slice", load_slice, METH_VARARGS,
     "load_slice(root_fd, prefix, keys, chunks, start, stop, rows, block_size, read_flags,\n"
     "           checksum, hash_chunk, deadline, cancel) -> (done, stop, errno)\n\n"
     "Load the blocks of keys[start:stop] into their rows (chunk i: bytes\n"
     "i * block_size of rows), each verified; stops at the first block it does\n"
     "not settle. done: how many were loaded (VERIFIED with checksum, else\n"
     "UNVERIFIED); stop: why the next one was not (0: none left), errno its\n"
     "errno where one applies. deadline: time.monotonic() seconds (inf: none);\n"
     "cancel: the job's cancel byte (a buffer; nonzero: stop).\n"
     "Releases the GIL for the whole slice."},
    {"store_slice", store_slice, METH_VARARGS,
     "store_slice(root_fd, prefix, keys, chunks, start, stop, rows, block_size, dir_flags,\n"
     "            dir_mode, dir_chmod, temp_flags, file_mode, chmod, hash_chunk, checksum, fsync_file,\n"
     "            fsync_dir, host, pid, deadline, cancel) -> (done, stop, errno, outcomes)\n\n"
     "Publish the blocks of keys[start:stop] from their rows as new block\n"
     "files; stops at the first block it does not settle. outcomes: one byte\n"
     "per block published, W (written) or P (present). Releases the GIL."},
    {"xxh3_64", xxh3_64, METH_VARARGS,
     "xxh3_64(buffer) -> int: the xxh3-64 (seed 0) this module checks and writes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bytepath",
    "Store and load a slice of blocks in one call without the GIL (bytes_c.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__bytepath(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "XXH3", XXH3_WHICH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
