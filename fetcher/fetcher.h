/* fetcher.h - sluice-fetcher: owns the shards, the host expert arena, the slot
 * table and its eviction policy, and a pool of reader threads; serves FETCH
 * requests of compute processes over ZeroMQ (ROUTER) with msgpack messages.
 *
 * One thread (the caller of sl_fetcher_run) owns all cache state; reader threads
 * only move bytes. Signal handlers only set the flags passed to sl_fetcher_run.
 */
#ifndef SL_FETCHER_H
#define SL_FETCHER_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "err.h"
#include "policy.h"

/* Memory kept free for everything else when sizing the arena: the larger of this
 * and a tenth of the machine's memory. */
#define SL_FETCHER_RESERVE_BYTES (2ull << 30)
/* A client that sent nothing for this long is dead: its pins are dropped. Longer
 * than the client's own heartbeat liveness, since a busy compute step may delay
 * its pings. */
#define SL_FETCHER_CLIENT_TIMEOUT_MS 5000
#define SL_FETCHER_MAX_CLIENTS       16
/* After a message, the serving loop polls without sleeping for this long, so that
 * the next request of a burst is picked up without a wake-up (costs at most this
 * much CPU per burst). */
#define SL_FETCHER_SPIN_NS 200000ull

typedef struct sl_fetcher_options {
    const char *model;          /* -m: first shard (or any shard) of the checkpoint */
    uint64_t arena_bytes;       /* --arena SIZE; 0 = not given */
    uint32_t arena_slots;       /* --arena-slots N; 0 = not given */
    uint32_t readers;           /* --readers N */
    const char *endpoint;       /* --endpoint URL; NULL = ipc default */
    const char *trace_path;     /* --trace FILE; NULL = off */
    enum sl_policy_kind policy; /* --policy NAME */
    int lock_memory;            /* mlock the arena (--no-mlock clears) */
    int direct;                 /* O_DIRECT reads (--no-direct clears) */
    uint64_t seed;              /* --seed: the eviction policy's random picks */
    int quiet;                  /* --quiet: no start-up banner */
    int cpu;                    /* --cpu N: pin the serving thread and ZeroMQ's I/O thread
                                   to CPU N (SL_CPU_ANY = no pinning); readers stay free */
} sl_fetcher_options;

void sl_fetcher_options_default(sl_fetcher_options *o);

/* Fills o from argv (after defaults). Returns 0, 1 when --help was printed to out,
 * or SL_EINVAL with a one-line message. */
int sl_fetcher_parse_args(sl_fetcher_options *o, int argc, char **argv, FILE *out, sl_err *err);

typedef struct sl_fetcher sl_fetcher;

/* Opens the checkpoint, sizes and creates the arena, starts the readers and binds
 * the endpoint. The caller owns *out. */
int sl_fetcher_open(sl_fetcher **out, const sl_fetcher_options *o, sl_err *err);

/* Serves until *stop becomes nonzero; prints the counters whenever *report is
 * nonzero (and clears it). Returns 0 or a negative SL_E code on a fatal error. */
int sl_fetcher_run(sl_fetcher *f, volatile sig_atomic_t *stop, volatile sig_atomic_t *report,
                   sl_err *err);

/* Counters in human form (hits, misses, bytes, read latency, queue). */
void sl_fetcher_print_stats(sl_fetcher *f, FILE *out);

/* Writes the trace (if asked for), unbinds, stops the readers, unlinks the arena. */
void sl_fetcher_close(sl_fetcher **f);

#endif
