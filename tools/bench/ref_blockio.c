/* Compiled reference for tools/bench/engine.py: our block file format at
 * the same concurrency, without Python. Per block, as llmkv_fs does it:
 *   store: access(final) -> mkdir parent/leaf (EEXIST fine) -> open temp
 *          O_CREAT|O_EXCL -> pwritev(payload, trailer page) -> close -> rename
 *   load:  open -> preadv(payload, 2 trailer pages) -> close -> verify
 *          length, key and checksum.
 * The checksum is XXH64 (written out below; the xxhash C library is not on
 * the device machine), which is slower than the xxh3-64 llmkv_fs uses, so
 * this reference errs on the slow side when checksums are on.
 *
 *   cc -O2 -pthread -o ref_blockio tools/bench/ref_blockio.c
 *   ./ref_blockio DIR BLOCK_BYTES NBLOCKS THREADS CHECKSUM(0|1)
 * prints one JSON object: {"store_gbps": .., "load_gbps": ..}.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define TRAILER 4096
static const uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL,
                      P3 = 1609587929392839161ULL, P4 = 9650029242287828579ULL,
                      P5 = 2870177450012600261ULL;
static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static uint64_t round1(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
static uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round1(0, v)) * P1 + P4; }

static uint64_t xxh64(const uint8_t *p, size_t len) { /* len: a multiple of 32 */
    uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = -P1, h, w[4];
    for (size_t i = 0; i < len; i += 32) {
        memcpy(w, p + i, 32);
        v1 = round1(v1, w[0]); v2 = round1(v2, w[1]); v3 = round1(v3, w[2]); v4 = round1(v4, w[3]);
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(merge(merge(merge(h, v1), v2), v3), v4) + len;
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    return h;
}

static const char *dir;
static size_t block, nblocks;
static int checksum;
static uint8_t *primary;
static volatile size_t next_block;
static int failures;

static void paths(size_t i, char *leaf, char *final, char *tmp) {
    char hex[65];
    uint64_t h = i * 0x9E3779B97F4A7C15ULL;
    snprintf(hex, sizeof hex, "%016llx%016llx%016llx%016llx", (unsigned long long)h,
             (unsigned long long)~h, (unsigned long long)(h ^ 0x5555), (unsigned long long)i);
    snprintf(leaf, 512, "%s/%.3s", dir, hex);
    mkdir(leaf, 0770); /* parent, EEXIST fine */
    snprintf(leaf, 512, "%s/%.3s/%.2s_g0", dir, hex, hex + 3);
    snprintf(final, 512, "%s/%s.bin", leaf, hex);
    snprintf(tmp, 600, "%s/.%s.bin.ref~%d~%ld.tmp", leaf, hex, getpid(), (long)gettid());
}

static void *store_worker(void *arg) {
    uint8_t *trailer = aligned_alloc(4096, TRAILER);
    char leaf[512], final[512], tmp[600];
    (void)arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&next_block, 1, __ATOMIC_RELAXED);
        if (i >= nblocks) break;
        paths(i, leaf, final, tmp);
        if (access(final, F_OK) == 0) continue;
        mkdir(leaf, 0770);
        uint8_t *row = primary + i * block;
        memset(trailer, 0, TRAILER);
        memcpy(trailer, "LLMKVFS", 8);
        uint64_t len = block, sum = checksum ? xxh64(row, block) : 0, key = i;
        memcpy(trailer + 16, &len, 8); memcpy(trailer + 24, &sum, 8); memcpy(trailer + 42, &key, 8);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0640);
        struct iovec iov[2] = {{row, block}, {trailer, TRAILER}};
        if (fd < 0 || pwritev(fd, iov, 2, 0) != (ssize_t)(block + TRAILER) || close(fd) ||
            rename(tmp, final))
            __atomic_fetch_add(&failures, 1, __ATOMIC_RELAXED);
    }
    free(trailer);
    return NULL;
}

static void *load_worker(void *arg) {
    uint8_t *pages = aligned_alloc(4096, 2 * TRAILER);
    char leaf[512], final[512], tmp[600];
    (void)arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&next_block, 1, __ATOMIC_RELAXED);
        if (i >= nblocks) break;
        paths(i, leaf, final, tmp);
        uint8_t *row = primary + i * block;
        int fd = open(final, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
        struct iovec iov[2] = {{row, block}, {pages, 2 * TRAILER}};
        ssize_t n = fd < 0 ? -1 : preadv(fd, iov, 2, 0);
        if (fd >= 0) close(fd);
        uint64_t len, sum, key;
        memcpy(&len, pages + 16, 8); memcpy(&sum, pages + 24, 8); memcpy(&key, pages + 42, 8);
        if (n != (ssize_t)(block + TRAILER) || len != block || key != i ||
            (checksum && xxh64(row, block) != sum))
            __atomic_fetch_add(&failures, 1, __ATOMIC_RELAXED);
    }
    free(pages);
    return NULL;
}

static double run(void *(*fn)(void *), int threads) {
    pthread_t t[512];
    struct timespec a, b;
    next_block = 0;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, fn, NULL);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)block * nblocks / ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9) / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s DIR BLOCK_BYTES NBLOCKS THREADS CHECKSUM\n", argv[0]);
        return 2;
    }
    dir = argv[1];
    block = strtoull(argv[2], NULL, 10);
    nblocks = strtoull(argv[3], NULL, 10);
    int threads = atoi(argv[4]);
    checksum = atoi(argv[5]);
    if (threads < 1 || threads > 512 || block % 32) return 2;
    primary = mmap(NULL, block * nblocks, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    for (size_t i = 0; i < block * nblocks; i += 8) *(uint64_t *)(primary + i) = i * P5;
    mkdir(dir, 0770);
    double store = run(store_worker, threads);
    memset(primary, 0, block * nblocks);
    double load = run(load_worker, threads);
    printf("{\"store_gbps\": %.3f, \"load_gbps\": %.3f, \"failures\": %d}\n", store, load, failures);
    return failures != 0;
}
