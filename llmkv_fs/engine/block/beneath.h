/* What both compiled modules (_presence.c, _bytepath.c) need of the volume
 * and the layout, once: a name opened beneath a directory descriptor in one
 * openat2 that follows no link and crosses no mount (volume/beneath.py's
 * open_beneath), and a block's place below the rank directory
 * (layout/names.py's block_place, byte for byte). Static functions: each
 * module gets its own copy; no state. */
#ifndef LLMKV_FS_BENEATH_H
#define LLMKV_FS_BENEATH_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture (5.6, generic table) */
#endif

#define RESOLVE_NO_XDEV_ 0x01
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08

struct open_how_ {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

/* ``path`` below ``root_fd`` opened with ``flags``, never through a link,
 * never across a mount, never outside: a descriptor, or -1 with errno. */
static long open_beneath(int root_fd, const char *path, int flags) {
    struct open_how_ how = {
        (uint64_t)(flags | O_CLOEXEC),
        0,
        RESOLVE_BENEATH_ | RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_XDEV_,
    };
    return syscall(SYS_openat2, root_fd, path, &how, sizeof how);
}

#define MIN_HASH_BYTES 3 /* <hhh>/<hh> need five hex digits */
#define MAX_HASH_BYTES 256
#define MAX_PREFIX 3072
#define PATH_BYTES (MAX_PREFIX + 2 * MAX_HASH_BYTES + 64)
#define NAME_BYTES (2 * MAX_HASH_BYTES + 5)

/* "<prefix>/<hhh>/<hh>_g<group>" into dir (its length returned), and
 * "<hex>.bin" into name: a key is its hash's ``hash_len`` bytes, then the
 * group as 4 big-endian bytes. */
static size_t block_place(char *dir, char *name, const char *prefix, size_t prefix_len,
                          const unsigned char *key, size_t hash_len) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < hash_len; i++) {
        name[2 * i] = digits[key[i] >> 4];
        name[2 * i + 1] = digits[key[i] & 15];
    }
    memcpy(name + 2 * hash_len, ".bin", 5);
    uint32_t group = ((uint32_t)key[hash_len] << 24) | ((uint32_t)key[hash_len + 1] << 16) |
                     ((uint32_t)key[hash_len + 2] << 8) | (uint32_t)key[hash_len + 3];
    char *at = dir;
    memcpy(at, prefix, prefix_len);
    at += prefix_len;
    *at++ = '/';
    memcpy(at, name, 3);
    at += 3;
    *at++ = '/';
    memcpy(at, name + 3, 2);
    at += 2;
    at += sprintf(at, "_g%u", (unsigned)group);
    return (size_t)(at - dir);
}

#endif
