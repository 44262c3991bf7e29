/* issue 20 store microbench: N workers (threads or processes) store 2 MiB
 * blocks from a shared memfd region into a tmpfs dir, one variant at a time.
 *   storebench DIR BLOCK TOTAL_BLOCKS MODE(t|p) N VARIANT PIECE ODIRECT
 * variants: one (pwritev row+trailer), pieces, pieces_hash, hash_one,
 *   overwrite (into existing files), memcpy, hash, one_noren (no rename),
 *   one_trunc (ftruncate to final size first), one_fallocate
 * prints one JSON line.  */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TRAILER 4096
#define NDIRS 256
static const uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL,
                      P3 = 1609587929392839161ULL, P4 = 9650029242287828579ULL;
static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static uint64_t round1(uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; }
static uint64_t hsum;
static void xxh_piece(uint64_t *v, const uint8_t *p, size_t len) {
    uint64_t w[4];
    for (size_t i = 0; i < len; i += 32) {
        memcpy(w, p + i, 32);
        v[0] = round1(v[0], w[0]); v[1] = round1(v[1], w[1]);
        v[2] = round1(v[2], w[2]); v[3] = round1(v[3], w[3]);
    }
}
static const char *dir, *variant;
static size_t block, total, piece, rows = 256;
static int nworkers, odirect;
static uint8_t *region;
static volatile int *go;

struct res { double wall, user, sys; long blocks; long minflt; long nvcsw, nivcsw; };
static struct res *results; /* shared mapping */

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static double tv(struct timeval t) { return t.tv_sec + t.tv_usec / 1e6; }

static void path_of(char *buf, size_t k, const char *suffix) {
    snprintf(buf, 512, "%s/d%03zu/b%06zu%s", dir, k % NDIRS, k, suffix);
}

static void die(const char *what) { perror(what); exit(2); }

static void store_one(size_t k, uint8_t *trailer, uint8_t *priv) {
    uint8_t *row = region + (k % rows) * block;
    char tmp[512], fin[512];
    path_of(fin, k, "");
    int flags = O_WRONLY | O_CLOEXEC | (odirect ? O_DIRECT : 0);
    if (!strcmp(variant, "memcpy")) { memcpy(priv, row, block); return; }
    if (!strcmp(variant, "hash")) { uint64_t v[4] = {1, 2, 3, 4}; xxh_piece(v, row, block); hsum += v[0]; return; }
    if (!strcmp(variant, "overwrite")) {
        int fd = open(fin, flags);
        if (fd < 0) die("open existing");
        struct iovec io[2] = {{row, block}, {trailer, TRAILER}};
        if (pwritev(fd, io, 2, 0) != (ssize_t)(block + TRAILER)) die("pwritev");
        close(fd);
        return;
    }
    path_of(tmp, k, ".tmp");
    int fd = open(tmp, flags | O_CREAT | O_EXCL, 0644);
    if (fd < 0) die("open tmp");
    if (!strcmp(variant, "one_trunc") && ftruncate(fd, block + TRAILER)) die("ftruncate");
    if (!strcmp(variant, "one_fallocate") && fallocate(fd, 0, 0, block + TRAILER)) die("fallocate");
    if (!strcmp(variant, "pieces") || !strcmp(variant, "pieces_hash")) {
        uint64_t v[4] = {1, 2, 3, 4};
        size_t done = 0;
        while (done + piece < block) {
            if (variant[6]) xxh_piece(v, row + done, piece);
            if (pwrite(fd, row + done, piece, done) != (ssize_t)piece) die("pwrite");
            done += piece;
        }
        if (variant[6]) xxh_piece(v, row + done, block - done);
        hsum += v[0];
        struct iovec io[2] = {{row + done, block - done}, {trailer, TRAILER}};
        if (pwritev(fd, io, 2, done) != (ssize_t)(block - done + TRAILER)) die("pwritev last");
    } else {
        if (!strcmp(variant, "hash_one")) { uint64_t v[4] = {1, 2, 3, 4}; xxh_piece(v, row, block); hsum += v[0]; }
        struct iovec io[2] = {{row, block}, {trailer, TRAILER}};
        if (pwritev(fd, io, 2, 0) != (ssize_t)(block + TRAILER)) die("pwritev");
    }
    close(fd);
    if (strcmp(variant, "one_noren") && rename(tmp, fin)) die("rename");
}

static void worker(int w, int is_proc) {
    uint8_t *trailer = aligned_alloc(4096, TRAILER), *priv = aligned_alloc(4096, block);
    memset(trailer, 7, TRAILER); memset(priv, 1, block);
    if (is_proc) madvise(region, rows * block, 23 /* MADV_POPULATE_WRITE */);
    __atomic_add_fetch(&go[1], 1, __ATOMIC_SEQ_CST);
    while (!go[0]) ;
    struct rusage r0, r1;
    int who = is_proc ? RUSAGE_SELF : RUSAGE_THREAD;
    getrusage(who, &r0);
    double t0 = now();
    long n = 0;
    for (size_t k = w; k < total; k += nworkers, n++) store_one(k, trailer, priv);
    double t1 = now();
    getrusage(who, &r1);
    results[w] = (struct res){t1 - t0, tv(r1.ru_utime) - tv(r0.ru_utime), tv(r1.ru_stime) - tv(r0.ru_stime), n,
                              r1.ru_minflt - r0.ru_minflt, r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw};
}
static void *thread_main(void *a) { worker((int)(intptr_t)a, 0); return NULL; }

int main(int argc, char **argv) {
    if (argc != 9) { fprintf(stderr, "usage\n"); return 2; }
    dir = argv[1]; block = strtoul(argv[2], 0, 0); total = strtoul(argv[3], 0, 0);
    char mode = argv[4][0]; nworkers = atoi(argv[5]); variant = argv[6];
    piece = strtoul(argv[7], 0, 0); odirect = atoi(argv[8]);
    int fd = memfd_create("region", 0);
    if (ftruncate(fd, rows * block)) die("ftruncate region");
    region = mmap(NULL, rows * block, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    for (size_t i = 0; i < rows * block; i += 8) *(uint64_t *)(region + i) = i * P4 + P3;
    results = mmap(NULL, 4096 * 4, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    go = (volatile int *)(results + 256);
    char p[512];
    mkdir(dir, 0755);
    for (int d = 0; d < NDIRS; d++) { snprintf(p, sizeof p, "%s/d%03d", dir, d); mkdir(p, 0755); }
    if (!strcmp(variant, "overwrite")) { /* pre-create files */
        uint8_t *z = aligned_alloc(4096, block + TRAILER); memset(z, 3, block + TRAILER);
        for (size_t k = 0; k < total; k++) {
            path_of(p, k, ""); int f = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (f < 0 || write(f, z, block + TRAILER) < 0) die("precreate"); close(f);
        }
    }
    double t0 = now();
    if (mode == 'p') {
        pid_t pids[256];
        for (int w = 0; w < nworkers; w++) {
            pids[w] = fork();
            if (!pids[w]) { worker(w, 1); _exit(0); }
        }
        while (go[1] < nworkers) usleep(1000);
        t0 = now(); go[0] = 1;
        for (int w = 0; w < nworkers; w++) waitpid(pids[w], NULL, 0);
    } else {
        pthread_t th[256];
        for (int w = 0; w < nworkers; w++) pthread_create(&th[w], NULL, thread_main, (void *)(intptr_t)w);
        while (go[1] < nworkers) usleep(1000);
        t0 = now(); go[0] = 1;
        for (int w = 0; w < nworkers; w++) pthread_join(th[w], NULL);
    }
    double wall = now() - t0;
    double u = 0, s = 0, ww = 0; long n = 0, flt = 0, vcs = 0, ivcs = 0;
    for (int w = 0; w < nworkers; w++) {
        u += results[w].user; s += results[w].sys; ww += results[w].wall; n += results[w].blocks;
        flt += results[w].minflt; vcs += results[w].nvcsw; ivcs += results[w].nivcsw;
    }
    printf("{\"variant\":\"%s\",\"mode\":\"%c\",\"n\":%d,\"piece\":%zu,\"odirect\":%d,\"gbps\":%.2f,"
           "\"wall_us_per_block\":%.0f,\"user_us\":%.0f,\"sys_us\":%.0f,\"cpu_us\":%.0f,\"minflt\":%.1f,\"vcsw\":%.2f,\"ivcsw\":%.2f}\n",
           variant, mode, nworkers, piece, odirect, n * (double)block / wall / 1e9, ww / n * 1e6,
           u / n * 1e6, s / n * 1e6, (u + s) / n * 1e6, (double)flt / n, (double)vcs / n, (double)ivcs / n);
    /* cleanup, untimed */
    char cmd[600]; snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) {}
    return hsum == 42;
}
