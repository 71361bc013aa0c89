/* reader.h - the fetcher's pool of reader threads (internal to fetcher/).
 *
 * The main thread owns all cache state; readers only move bytes: a job names an
 * expert and the slot claimed for it, a reader reads the expert's three aligned
 * windows into the slot's part regions (O_DIRECT, or buffered pread plus
 * posix_fadvise(DONTNEED) where the file system refuses O_DIRECT) and posts a
 * completion over a ZeroMQ inproc PUSH socket, so the main thread wakes in the same
 * zmq_poll that serves clients. Demand jobs are always taken before prefetch jobs.
 */
#ifndef SL_READER_H
#define SL_READER_H

#include <stdint.h>

#include "arena.h"
#include "err.h"
#include "expert_map.h"
#include "gguf.h"
#include "trace.h"

typedef struct sl_read_job {
    uint64_t seq; /* the fetcher's id for this read */
    uint32_t layer, expert, slot;
    uint8_t prefetch; /* 1: may be dropped before it starts */
} sl_read_job;

/* Posted by a reader when a job ends; one ZeroMQ frame of exactly this struct. */
typedef struct sl_read_done {
    sl_read_job job;
    int32_t status;            /* 0 or a negative SL_E code */
    uint32_t direct;           /* 1 when O_DIRECT served the read */
    uint64_t bytes;            /* bytes read from the shard files */
    uint64_t start_ns, end_ns; /* CLOCK_MONOTONIC */
    char msg[240];             /* the error, when status != 0 */
} sl_read_done;

typedef struct sl_readers_config {
    uint32_t n_thread;         /* >= 1 */
    const sl_gguf *gguf;       /* shard paths and buffered fds (borrowed) */
    const sl_expert_map *map;  /* borrowed */
    sl_arena *arena;           /* borrowed: slot memory */
    void *zmq_ctx;             /* borrowed ZeroMQ context */
    const char *done_endpoint; /* inproc:// endpoint the main thread's PULL is bound to */
    int try_direct;            /* 1: O_DIRECT where the file system allows it */
    sl_trace *trace;           /* may be NULL */
} sl_readers_config;

typedef struct sl_readers sl_readers;

/* Opens the shards for direct I/O and starts the threads. */
int sl_readers_open(sl_readers **out, const sl_readers_config *cfg, sl_err *err);

/* Stops the threads (jobs not started are discarded) and closes the fds. */
void sl_readers_close(sl_readers **r);

/* Queues a job (main thread). Never blocks on I/O; the queues are sized at open
 * for one job per slot, which is the most that can be outstanding. */
void sl_readers_submit(sl_readers *r, const sl_read_job *job);

/* Removes every queued prefetch job that has not started and copies it to
 * dropped[] (at most max); returns how many were removed. */
uint32_t sl_readers_drop_prefetch(sl_readers *r, sl_read_job *dropped, uint32_t max);

/* Jobs waiting for a reader. */
uint32_t sl_readers_queued(sl_readers *r);

/* Shards that fell back to buffered reads (O_DIRECT refused). */
uint32_t sl_readers_buffered_shards(sl_readers *r);

#endif
