/* reader.c - reader threads: aligned window reads of expert slices into slots.
 *
 * Queues are two rings (demand, prefetch) of capacity n_slot under one mutex; a job
 * holds a claimed slot, so there are never more jobs than slots. Each thread owns a
 * PUSH socket to the main thread's completion PULL socket (ZeroMQ sockets are not
 * shared between threads).
 */
#include "reader.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

typedef struct job_ring {
    sl_read_job *jobs; /* [cap] */
    uint32_t cap, head, n;
} job_ring;

struct sl_readers {
    sl_readers_config cfg;
    uint32_t n_shard;
    int *fd_direct;          /* [n_shard]: O_DIRECT fd or -1 */
    _Atomic int *use_direct; /* [n_shard]: cleared when a direct read is refused */
    pthread_t *threads;
    uint32_t n_started;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    job_ring demand, prefetch;
    int stopping;
};

typedef struct reader_thread_arg {
    sl_readers *r;
    uint32_t index;
} reader_thread_arg;

static int ring_init(job_ring *q, uint32_t cap)
{
    q->jobs = calloc(cap, sizeof *q->jobs);
    q->cap = cap;
    q->head = q->n = 0;
    return q->jobs ? 0 : -1;
}

static void ring_push(job_ring *q, const sl_read_job *j)
{
    SL_ASSERT(q->n < q->cap);
    q->jobs[(q->head + q->n) % q->cap] = *j;
    q->n++;
}

static sl_read_job ring_pop(job_ring *q)
{
    SL_ASSERT(q->n > 0);
    sl_read_job j = q->jobs[q->head];
    q->head = (q->head + 1) % q->cap;
    q->n--;
    return j;
}

/* Reads len bytes at off into dst; EOF is fine once `need` bytes arrived (an
 * aligned window may run past the end of the file). Returns bytes read or -errno;
 * -ENODATA when the file ends before `need`. */
static int64_t pread_window(int fd, uint8_t *dst, uint64_t len, uint64_t off, uint64_t need)
{
    uint64_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, dst + got, len - got, (off_t)(off + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        if (n == 0) break;
        got += (uint64_t)n;
    }
    return got < need ? -ENODATA : (int64_t)got;
}

/* Reads one part of the job's expert into its slot region. */
static int read_part(sl_readers *r, const sl_read_job *j, int part, sl_read_done *d, sl_err *err)
{
    const sl_expert_map *m = r->cfg.map;
    const sl_expert_slice *s = sl_expert_map_slice(m, j->layer, j->expert, part);
    sl_expert_window w = sl_expert_window_of(s, m->layout.align);
    uint8_t *region = sl_arena_slot_data(r->cfg.arena, j->slot) + m->layout.part_offset[part];
    const sl_gguf_shard *sh = &r->cfg.gguf->shards[s->shard];
    SL_ASSERT(w.bytes <= m->layout.part_capacity[part]);

    if (atomic_load(&r->use_direct[s->shard])) {
        int64_t n =
            pread_window(r->fd_direct[s->shard], region, w.bytes, w.offset, w.skip + s->bytes);
        if (n >= 0) {
            d->bytes += (uint64_t)n;
            d->direct = 1;
            return 0;
        }
        if (n != -EINVAL) {
            int e = (int)-n;
            if (e == ENODATA)
                return sl_err_set(err, SL_EIO,
                                  "pread(shard %u, off %" PRIu64 ", len %" PRIu64
                                  "): file ends early (truncated shard %s?)",
                                  s->shard, w.offset, w.bytes, sh->path);
            return sl_err_errno(err, SL_EIO, e, "pread(shard %u, off %" PRIu64 ", len %" PRIu64 ")",
                                s->shard, w.offset, w.bytes);
        }
        /* The file system refuses O_DIRECT for this read: buffered from now on. */
        atomic_store(&r->use_direct[s->shard], 0);
    }
    int64_t n = pread_window(sh->fd, region + w.skip, s->bytes, s->offset, s->bytes);
    if (n < 0) {
        int e = (int)-n;
        if (e == ENODATA)
            return sl_err_set(err, SL_EIO,
                              "pread(shard %u, off %" PRIu64 ", len %" PRIu64
                              "): file ends early (truncated shard %s?)",
                              s->shard, s->offset, s->bytes, sh->path);
        return sl_err_errno(err, SL_EIO, e, "pread(shard %u, off %" PRIu64 ", len %" PRIu64 ")",
                            s->shard, s->offset, s->bytes);
    }
    d->bytes += (uint64_t)n;
    /* Keep the page cache from holding a second copy of what the arena holds. */
    posix_fadvise(sh->fd, (off_t)s->offset, (off_t)s->bytes, POSIX_FADV_DONTNEED);
    return 0;
}

static void *reader_main(void *varg)
{
    reader_thread_arg *arg = varg;
    sl_readers *r = arg->r;
    free(arg);
    void *push = zmq_socket(r->cfg.zmq_ctx, ZMQ_PUSH);
    int linger = 0;
    if (push) zmq_setsockopt(push, ZMQ_LINGER, &linger, sizeof linger);
    if (!push || zmq_connect(push, r->cfg.done_endpoint) != 0) {
        fprintf(stderr, "sluice-fetcher: reader: zmq_connect(%s): %s\n", r->cfg.done_endpoint,
                zmq_strerror(zmq_errno()));
        if (push) zmq_close(push);
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&r->lock);
        while (!r->stopping && r->demand.n == 0 && r->prefetch.n == 0)
            pthread_cond_wait(&r->wake, &r->lock);
        if (r->stopping) {
            pthread_mutex_unlock(&r->lock);
            break;
        }
        sl_read_job j = r->demand.n ? ring_pop(&r->demand) : ring_pop(&r->prefetch);
        pthread_mutex_unlock(&r->lock);

        sl_read_done d;
        memset(&d, 0, sizeof d);
        d.job = j;
        d.start_ns = sl_now_ns();
        for (int p = 0; p < SL_EXPERT_N_PART && d.status == 0; p++) {
            sl_err e = {0};
            int rc = read_part(r, &j, p, &d, &e);
            if (rc) {
                d.status = rc;
                sl_strlcpy(d.msg, e.msg, sizeof d.msg);
            }
        }
        d.end_ns = sl_now_ns();
        sl_trace_add(r->cfg.trace, j.prefetch ? "read-prefetch" : "read", (int32_t)j.layer,
                     (int32_t)j.expert, d.bytes, d.start_ns, d.end_ns);
        while (zmq_send(push, &d, sizeof d, 0) < 0 && zmq_errno() == EINTR) {
        }
    }
    zmq_close(push);
    return NULL;
}

int sl_readers_open(sl_readers **out, const sl_readers_config *cfg, sl_err *err)
{
    *out = NULL;
    if (cfg->n_thread == 0 || cfg->n_thread > 1024)
        return sl_err_set(err, SL_EINVAL, "--readers %u: expected 1..1024", cfg->n_thread);
    sl_readers *r = calloc(1, sizeof *r);
    if (!r) return sl_err_set(err, SL_ENOMEM, "readers: out of memory");
    int rc = 0;
    r->cfg = *cfg;
    r->n_shard = cfg->gguf->n_shards;
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->wake, NULL);
    uint32_t cap = cfg->arena->hdr->n_slot;
    r->fd_direct = malloc(sizeof(int) * r->n_shard);
    r->use_direct = calloc(r->n_shard, sizeof *r->use_direct);
    r->threads = calloc(cfg->n_thread, sizeof *r->threads);
    if (!r->fd_direct || !r->use_direct || !r->threads || ring_init(&r->demand, cap) ||
        ring_init(&r->prefetch, cap)) {
        rc = sl_err_set(err, SL_ENOMEM, "readers: out of memory");
        goto fail;
    }
    for (uint32_t s = 0; s < r->n_shard; s++) {
        r->fd_direct[s] = -1;
        if (!cfg->try_direct) continue;
        const char *path = cfg->gguf->shards[s].path;
        int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (fd < 0 && errno != EINVAL) {
            rc = sl_err_errno(err, SL_EIO, errno, "open(%s, O_DIRECT)", path);
            goto fail;
        }
        r->fd_direct[s] = fd;
        atomic_store(&r->use_direct[s], fd >= 0);
    }
    for (uint32_t t = 0; t < cfg->n_thread; t++) {
        reader_thread_arg *arg = malloc(sizeof *arg);
        if (!arg) {
            rc = sl_err_set(err, SL_ENOMEM, "readers: out of memory");
            goto fail;
        }
        arg->r = r;
        arg->index = t;
        int e = pthread_create(&r->threads[t], NULL, reader_main, arg);
        if (e) {
            free(arg);
            rc = sl_err_errno(err, SL_EIO, e, "pthread_create(reader %u)", t);
            goto fail;
        }
        r->n_started++;
    }
    *out = r;
    return 0;
fail:
    sl_readers_close(&r);
    return rc;
}

void sl_readers_close(sl_readers **pr)
{
    if (!pr || !*pr) return;
    sl_readers *r = *pr;
    pthread_mutex_lock(&r->lock);
    r->stopping = 1;
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->lock);
    for (uint32_t t = 0; t < r->n_started; t++) pthread_join(r->threads[t], NULL);
    if (r->fd_direct)
        for (uint32_t s = 0; s < r->n_shard; s++)
            if (r->fd_direct[s] >= 0) close(r->fd_direct[s]);
    free(r->fd_direct);
    free(r->use_direct);
    free(r->threads);
    free(r->demand.jobs);
    free(r->prefetch.jobs);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->wake);
    free(r);
    *pr = NULL;
}

void sl_readers_submit(sl_readers *r, const sl_read_job *job)
{
    pthread_mutex_lock(&r->lock);
    ring_push(job->prefetch ? &r->prefetch : &r->demand, job);
    pthread_cond_signal(&r->wake);
    pthread_mutex_unlock(&r->lock);
}

uint32_t sl_readers_drop_prefetch(sl_readers *r, sl_read_job *dropped, uint32_t max)
{
    pthread_mutex_lock(&r->lock);
    uint32_t n = 0;
    while (r->prefetch.n && n < max) dropped[n++] = ring_pop(&r->prefetch);
    pthread_mutex_unlock(&r->lock);
    return n;
}

uint32_t sl_readers_queued(sl_readers *r)
{
    pthread_mutex_lock(&r->lock);
    uint32_t n = r->demand.n + r->prefetch.n;
    pthread_mutex_unlock(&r->lock);
    return n;
}

uint32_t sl_readers_buffered_shards(sl_readers *r)
{
    uint32_t n = 0;
    for (uint32_t s = 0; s < r->n_shard; s++) n += !atomic_load(&r->use_direct[s]);
    return n;
}
