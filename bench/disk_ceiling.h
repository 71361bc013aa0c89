/* disk_ceiling.h - the disk's own read ceiling for expert-sized reads, shared by
 * bench-fetch and bench-ceilings: raw O_DIRECT preads of the aligned windows that
 * cover experts first, first + stride, ... (count of them, layer-major order, the same
 * reads the fetcher does on a miss) by `threads` threads, straight from the shards.
 *
 * Header-only (static functions) because each bench is one program of its own. */
#ifndef SL_BENCH_DISK_CEILING_H
#define SL_BENCH_DISK_CEILING_H

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expert_map.h"
#include "gguf.h"
#include "trace.h"

typedef struct sl_bench_disk_job {
    const sl_expert_map *m;
    int *fds;
    uint32_t next; /* shared counter, atomically taken */
    uint32_t total;
    uint32_t first, stride; /* the k-th read is expert first + k * stride */
    uint64_t bytes;
    pthread_mutex_t lock;
    size_t buf_bytes;
} sl_bench_disk_job;

static void *sl_bench_disk_thread(void *v)
{
    sl_bench_disk_job *j = v;
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, j->buf_bytes)) return NULL;
    uint64_t mine = 0;
    for (;;) {
        uint32_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->total) break;
        uint32_t i = j->first + k * j->stride;
        uint32_t layer = i / j->m->n_expert, expert = i % j->m->n_expert;
        for (int p = 0; p < SL_EXPERT_N_PART; p++) {
            const sl_expert_slice *s = sl_expert_map_slice(j->m, layer, expert, p);
            sl_expert_window w = sl_expert_window_of(s, SL_SLOT_ALIGN);
            uint64_t got = 0;
            while (got < w.bytes) {
                ssize_t n = pread(j->fds[s->shard], (uint8_t *)buf + got, w.bytes - got,
                                  (off_t)(w.offset + got));
                if (n < 0 && errno == EINTR) continue;
                if (n <= 0) break;
                got += (uint64_t)n;
            }
            mine += got;
        }
    }
    free(buf);
    pthread_mutex_lock(&j->lock);
    j->bytes += mine;
    pthread_mutex_unlock(&j->lock);
    return NULL;
}

/* Bytes per second; *bytes_out gets the bytes read. Exits with a message when a shard
 * cannot be opened with O_DIRECT (the ceiling is meaningless without it). */
static double sl_bench_disk_ceiling(const sl_gguf *g, const sl_expert_map *m, uint32_t threads,
                                    uint32_t first, uint32_t stride, uint32_t count,
                                    uint64_t *bytes_out)
{
    sl_bench_disk_job j = {.m = m, .next = 0, .total = count, .first = first, .stride = stride};
    pthread_mutex_init(&j.lock, NULL);
    j.fds = calloc(g->n_shards, sizeof(int));
    pthread_t *t = calloc(threads, sizeof *t);
    if (!j.fds || !t) {
        fprintf(stderr, "disk ceiling: out of memory\n");
        exit(1);
    }
    for (uint32_t s = 0; s < g->n_shards; s++) {
        j.fds[s] = open(g->shards[s].path, O_RDONLY | O_DIRECT);
        if (j.fds[s] < 0) {
            fprintf(stderr, "open(%s, O_DIRECT): %s (the ceiling needs O_DIRECT)\n",
                    g->shards[s].path, strerror(errno));
            exit(1);
        }
    }
    j.buf_bytes = m->layout.part_capacity[SL_EXPERT_DOWN];
    uint64_t t0 = sl_now_ns();
    for (uint32_t i = 0; i < threads; i++) pthread_create(&t[i], NULL, sl_bench_disk_thread, &j);
    for (uint32_t i = 0; i < threads; i++) pthread_join(t[i], NULL);
    uint64_t dt = sl_now_ns() - t0;
    for (uint32_t s = 0; s < g->n_shards; s++) close(j.fds[s]);
    free(j.fds);
    free(t);
    *bytes_out = j.bytes;
    return (double)j.bytes / ((double)dt / 1e9);
}

/* The thread counts of sl_bench_disk_best's runs, in order. */
#define SL_BENCH_DISK_DEPTHS 6
static const uint32_t sl_bench_disk_depth[SL_BENCH_DISK_DEPTHS] = {2, 4, 8, 16, 32, 64};

/* The disk's ceiling is its best rate at any queue depth: the count experts first,
 * first + stride, ... split into SL_BENCH_DISK_DEPTHS runs of consecutive ones, read
 * with 2, 4, ... 64 threads (each expert once, so no read finds the bytes of another in
 * a cache); the best rate, its thread count in *threads_out, the bytes of all runs
 * in *bytes_out and, when rates is not NULL, each run's rate (B/s) in rates. A read is a whole
 * expert window (megabytes), so 2 threads already keep a disk busy; with 16 threads alone the
 * fetcher beat this "ceiling" by 30-40% on the GPU box's virtual disk, and with 16, 32 and 64 by
 * 3-17% (session 35), when its cold starts keep about a layer's misses (6) in flight: the shallow
 * depths are measured since session 36. */
static double sl_bench_disk_best(const sl_gguf *g, const sl_expert_map *m, uint32_t first,
                                 uint32_t stride, uint32_t count, uint64_t *bytes_out,
                                 uint32_t *threads_out, double *rates)
{
    const uint32_t *depth = sl_bench_disk_depth;
    double best = 0.0;
    *bytes_out = 0;
    *threads_out = depth[0];
    for (uint32_t k = 0; k < SL_BENCH_DISK_DEPTHS; k++) {
        const uint32_t a = count * k / SL_BENCH_DISK_DEPTHS,
                       b = count * (k + 1) / SL_BENCH_DISK_DEPTHS;
        uint64_t bytes = 0;
        const double r =
            sl_bench_disk_ceiling(g, m, depth[k], first + a * stride, stride, b - a, &bytes);
        *bytes_out += bytes;
        if (rates) rates[k] = r;
        if (r > best) {
            best = r;
            *threads_out = depth[k];
        }
    }
    return best;
}

#endif
