/* fetcher.c - the fetcher's state and its serving loop.
 *
 * Ownership: this thread owns the slot bookkeeping (which read is in flight for
 * which expert, who waits for it, which client holds which READY pins), the
 * eviction policy and the counters. The arena's slot table is written only here;
 * the compute side only pins and unpins. Reader threads fill claimed slots and post
 * completions to the `done` PULL socket, polled together with the ROUTER.
 *
 * Slot life: FREE -> (claim) FILLING -> (publish) READY -> (claim) FILLING ...;
 * a failed or dropped read goes FILLING -> FREE. A slot is claimed only when no
 * reader count is held on it and no read is in flight.
 */
#include "fetcher.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "affinity.h"
#include "arena.h"
#include "client.h"
#include "expert_map.h"
#include "gguf.h"
#include "opts.h"
#include "proto.h"
#include "reader.h"
#include "trace.h"

#define NIL               UINT32_MAX
#define DONE_ENDPOINT_FMT "inproc://sluice-reads-%p"
#define TRACE_CAPACITY    (1u << 20)
#define IDENTITY_MAX      256
#define ENDED_MAX         64 /* requests of a client ended by an ERROR, remembered */

typedef struct client {
    int used;
    uint32_t incarnation; /* bumped when the record is reused */
    uint8_t id[IDENTITY_MAX];
    size_t id_len;
    uint8_t kind;
    uint32_t pid;
    uint64_t last_ns;
    uint32_t *pins; /* [n_slot] READY pins granted and not released */
    uint64_t n_pins;
    uint64_t ended[ENDED_MAX]; /* requests ended by an ERROR: no READY may follow */
    uint32_t n_ended;          /* ring position */
} client;

typedef struct waiter {
    uint32_t client, incarnation;
    uint64_t req;
    uint32_t next;
} waiter;

typedef struct slot_info {
    uint32_t layer, expert;
    uint8_t filling;  /* a read is queued or running */
    uint8_t prefetch; /* that read is a prefetch */
    uint32_t waiters; /* head of the waiter list, NIL when none */
} slot_info;

typedef struct counters {
    uint64_t hits, misses, bytes_read, prefetch_dropped, read_errors, prefetch_reads;
    uint64_t read_us_total;
    uint64_t hist[SL_PROTO_HIST_BUCKETS];
    uint64_t bad_frames;
} counters;

struct sl_fetcher {
    sl_fetcher_options opt;
    char endpoint[512];
    sl_gguf *gguf;
    sl_expert_map *map;
    uint32_t n_expert_used;
    sl_arena *arena;
    sl_policy *policy;
    sl_trace *trace;
    void *zctx, *router, *done;
    char done_endpoint[64];
    sl_readers *readers;
    uint32_t n_slot;
    uint32_t n_filling; /* slots whose read is queued, running or not yet published */
    slot_info *slots;   /* [n_slot] */
    uint32_t *inflight; /* [n_layer * n_expert]: slot + 1 while its read is in flight */
    waiter *waiters;    /* pool */
    uint32_t n_waiter, free_waiter;
    sl_read_job *dropped; /* [n_slot] scratch for dropped prefetches */
    client clients[SL_FETCHER_MAX_CLIENTS];
    uint64_t next_seq;
    uint64_t start_ns;
    uint64_t last_reclaim_ns; /* last look for pin rows of dead processes */
    counters c;
    uint8_t frame[SL_PROTO_FRAME_MAX];
};

/* ---------------------------------------------------------------- options */

void sl_fetcher_options_default(sl_fetcher_options *o)
{
    memset(o, 0, sizeof *o);
    o->readers = 16;
    o->policy = SL_POLICY_OLDEST_RANDOM;
    o->lock_memory = 1;
    o->direct = 1;
    o->seed = 1;
    o->cpu = SL_CPU_ANY;
}

enum opt_id {
    OPT_MODEL,
    OPT_ARENA,
    OPT_SLOTS,
    OPT_READERS,
    OPT_ENDPOINT,
    OPT_TRACE,
    OPT_POLICY,
    OPT_NO_MLOCK,
    OPT_NO_DIRECT,
    OPT_SEED,
    OPT_CPU,
    OPT_QUIET,
    OPT_HELP
};

static const sl_opt opt_table[] = {
    {OPT_MODEL, "-m", "--model", "FILE",
     "checkpoint: a GGUF or any shard of a split one (required)"},
    {OPT_ARENA, NULL, "--arena", "SIZE",
     "host arena budget, e.g. 80G (default: 50% of free memory)"},
    {OPT_SLOTS, NULL, "--arena-slots", "N", "host arena size in expert slots (instead of --arena)"},
    {OPT_READERS, NULL, "--readers", "N", "reader threads (default 16)"},
    {OPT_ENDPOINT, NULL, "--endpoint", "URL",
     "ipc:// endpoint (default ipc://$XDG_RUNTIME_DIR/sluice/<model>.sock)"},
    {OPT_TRACE, NULL, "--trace", "FILE", "write read spans as Chrome trace JSON at exit"},
    {OPT_POLICY, NULL, "--policy", "NAME", "eviction: oldest-random (default) or lru"},
    {OPT_NO_MLOCK, NULL, "--no-mlock", NULL, "do not lock the arena in memory"},
    {OPT_NO_DIRECT, NULL, "--no-direct", NULL, "buffered reads instead of O_DIRECT"},
    {OPT_SEED, NULL, "--seed", "N", "seed of the eviction policy's random picks (default 1)"},
    {OPT_CPU, NULL, "--cpu", "N",
     "pin the serving thread and its ZeroMQ I/O thread to CPU N (lower hit latency)"},
    {OPT_QUIET, "-q", "--quiet", NULL, "no start-up banner"},
    {OPT_HELP, "-h", "--help", NULL, "this help"},
};

#define N_OPT (sizeof opt_table / sizeof opt_table[0])

int sl_fetcher_parse_args(sl_fetcher_options *o, int argc, char **argv, FILE *out, sl_err *err)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        const sl_opt *d = sl_opt_next(opt_table, N_OPT, argc, argv, &i, &v, err);
        if (!d) return SL_EINVAL;
        uint64_t n = 0;
        int rc = 0;
        switch (d->id) {
        case OPT_MODEL:
            o->model = v;
            break;
        case OPT_ARENA:
            rc = sl_parse_size(v, &o->arena_bytes, err);
            break;
        case OPT_SLOTS:
            rc = sl_opt_u64(a, v, 1, UINT32_MAX - 1, &n, err);
            o->arena_slots = (uint32_t)n;
            break;
        case OPT_READERS:
            rc = sl_opt_u64(a, v, 1, 1024, &n, err);
            o->readers = (uint32_t)n;
            break;
        case OPT_ENDPOINT:
            o->endpoint = v;
            break;
        case OPT_TRACE:
            o->trace_path = v;
            break;
        case OPT_POLICY:
            rc = sl_policy_parse(v, &o->policy, err);
            break;
        case OPT_NO_MLOCK:
            o->lock_memory = 0;
            break;
        case OPT_NO_DIRECT:
            o->direct = 0;
            break;
        case OPT_SEED:
            rc = sl_opt_u64(a, v, 0, UINT64_MAX, &o->seed, err);
            break;
        case OPT_CPU:
            rc = sl_opt_u64(a, v, 0, 65535, &n, err);
            if (!rc) rc = sl_affinity_check((int)n, err);
            o->cpu = (int)n;
            break;
        case OPT_QUIET:
            o->quiet = 1;
            break;
        case OPT_HELP:
            sl_opt_help(out,
                        "usage: sluice-fetcher -m FIRST_SHARD [options]\n"
                        "Serves routed experts of a GGUF checkpoint to sluice-compute through a "
                        "shared-memory arena.\n",
                        opt_table, N_OPT);
            return 1;
        }
        if (rc) return rc;
    }
    if (!o->model)
        return sl_err_set(err, SL_EINVAL, "no model given: use -m FIRST_SHARD (see --help)");
    if (o->arena_bytes && o->arena_slots)
        return sl_err_set(err, SL_EINVAL, "give --arena or --arena-slots, not both");
    return 0;
}

/* ---------------------------------------------------------------- sizing */

static int read_meminfo(uint64_t *total, uint64_t *avail)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    *total = *avail = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) *total = kb * 1024;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) *avail = kb * 1024;
    }
    fclose(f);
    return *total && *avail ? 0 : -1;
}

static void fmt_bytes(char *buf, size_t cap, uint64_t b)
{
    if (b >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", (double)b / (1ull << 30));
    else if (b >= (1ull << 20))
        snprintf(buf, cap, "%.1f MiB", (double)b / (1ull << 20));
    else
        snprintf(buf, cap, "%.1f KiB", (double)b / 1024.0);
}

/* Decides the slot count from the options and the machine's free memory. */
static int size_arena(sl_fetcher *f, sl_err *err)
{
    const sl_expert_map *m = f->map;
    uint64_t slot = m->layout.slot_bytes;
    uint32_t most = m->n_layer * m->n_expert; /* more slots than experts are useless */
    uint32_t least = m->n_layer * f->n_expert_used;
    if (least > most) least = most;
    uint64_t total = 0, avail = 0;
    int have_mem = read_meminfo(&total, &avail) == 0;
    uint64_t reserve =
        SL_FETCHER_RESERVE_BYTES > total / 10 ? SL_FETCHER_RESERVE_BYTES : total / 10;
    uint64_t usable = have_mem && avail > reserve ? avail - reserve : 0;
    uint64_t n;
    if (f->opt.arena_slots)
        n = f->opt.arena_slots;
    else if (f->opt.arena_bytes)
        n = f->opt.arena_bytes / slot;
    else
        n = (usable / 2) / slot;
    char a[32], b[32], c[32];
    /* The request itself must fit, even when more than the model would be clamped. */
    uint64_t asked = f->opt.arena_bytes ? f->opt.arena_bytes : n * slot;
    if (have_mem && asked > usable) {
        fmt_bytes(a, sizeof a, asked);
        fmt_bytes(b, sizeof b, avail);
        fmt_bytes(c, sizeof c, reserve);
        return sl_err_set(err, SL_ENOSPACE,
                          "arena of %s does not fit: %s of memory is available and %s stays "
                          "reserved for the rest of the machine (ask for less with --arena)",
                          a, b, c);
    }
    if (n > most) n = most;
    if (n < least) {
        fmt_bytes(a, sizeof a, (uint64_t)least * slot);
        return sl_err_set(err, SL_EINVAL,
                          "arena of %" PRIu64 " slots is too small: one token touches %u experts "
                          "(%u layers x %u), so at least %u slots (%s) are needed",
                          n, least, m->n_layer, f->n_expert_used, least, a);
    }
    f->n_slot = (uint32_t)n;
    return 0;
}

/* ---------------------------------------------------------------- open/close */

static int setup_endpoint(sl_fetcher *f, sl_err *err)
{
    if (f->opt.endpoint) {
        if (!strncmp(f->opt.endpoint, "tcp://", 6))
            return sl_err_set(err, SL_EUNSUPPORTED,
                              "%s: tcp:// endpoints need ZeroMQ CURVE keys, which this build "
                              "does not configure yet; use an ipc:// endpoint",
                              f->opt.endpoint);
        if (strncmp(f->opt.endpoint, "ipc://", 6))
            return sl_err_set(err, SL_EINVAL, "%s: the endpoint must be an ipc:// URL",
                              f->opt.endpoint);
        sl_strlcpy(f->endpoint, f->opt.endpoint, sizeof f->endpoint);
        return 0;
    }
    return sl_fetch_default_endpoint(f->endpoint, sizeof f->endpoint, f->gguf->fingerprint, 1, err);
}

int sl_fetcher_open(sl_fetcher **out, const sl_fetcher_options *o, sl_err *err)
{
    *out = NULL;
    sl_fetcher *f = calloc(1, sizeof *f);
    if (!f) return sl_err_set(err, SL_ENOMEM, "fetcher: out of memory");
    f->opt = *o;
    f->start_ns = sl_now_ns();
    int rc = sl_gguf_open(&f->gguf, o->model, err);
    if (rc) goto fail;
    rc = sl_expert_map_build(&f->map, f->gguf, SL_SLOT_ALIGN, err);
    if (rc) goto fail;
    f->n_expert_used = 6;
    uint32_t used;
    if (sl_gguf_get_u32(f->gguf, "deepseek41.expert_used_count", &used, NULL) == 0 && used)
        f->n_expert_used = used;
    rc = size_arena(f, err);
    if (rc) goto fail;
    rc = setup_endpoint(f, err);
    if (rc) goto fail;

    sl_arena_config ac = {.fingerprint = f->gguf->fingerprint,
                          .n_layer = f->map->n_layer,
                          .n_expert = f->map->n_expert,
                          .n_slot = f->n_slot,
                          .slot_bytes = f->map->layout.slot_bytes,
                          .align = f->map->layout.align,
                          .lock_memory = o->lock_memory};
    memcpy(ac.part_offset, f->map->layout.part_offset, sizeof ac.part_offset);
    memcpy(ac.part_capacity, f->map->layout.part_capacity, sizeof ac.part_capacity);
    rc = sl_arena_create(&f->arena, &ac, err);
    if (rc) goto fail;
    rc = sl_policy_init(&f->policy, o->policy, f->n_slot, o->seed, err);
    if (rc) goto fail;
    if (o->trace_path) {
        rc = sl_trace_open(&f->trace, "sluice-fetcher", TRACE_CAPACITY, err);
        if (rc) goto fail;
    }

    uint64_t n_ent = (uint64_t)f->map->n_layer * f->map->n_expert;
    f->slots = calloc(f->n_slot, sizeof *f->slots);
    f->inflight = calloc(n_ent, sizeof *f->inflight);
    f->dropped = calloc(f->n_slot, sizeof *f->dropped);
    f->n_waiter = f->n_slot * 4 + 1024;
    f->waiters = calloc(f->n_waiter, sizeof *f->waiters);
    if (!f->slots || !f->inflight || !f->dropped || !f->waiters) {
        rc = sl_err_set(err, SL_ENOMEM, "fetcher: out of memory for %u slots", f->n_slot);
        goto fail;
    }
    for (uint32_t s = 0; s < f->n_slot; s++) f->slots[s].waiters = NIL;
    for (uint32_t w = 0; w < f->n_waiter; w++)
        f->waiters[w].next = w + 1 < f->n_waiter ? w + 1 : NIL;
    f->free_waiter = 0;

    f->zctx = zmq_ctx_new();
    if (!f->zctx) {
        rc = sl_err_errno(err, SL_EIO, zmq_errno(), "zmq_ctx_new");
        goto fail;
    }
    /* ZeroMQ starts its I/O thread with the first socket: the affinity goes first. */
    if (o->cpu != SL_CPU_ANY && zmq_ctx_set(f->zctx, ZMQ_THREAD_AFFINITY_CPU_ADD, o->cpu) != 0) {
        rc = sl_err_set(err, SL_EIO, "zmq_ctx_set(ZMQ_THREAD_AFFINITY_CPU_ADD, %d): %s", o->cpu,
                        zmq_strerror(zmq_errno()));
        goto fail;
    }
    f->done = zmq_socket(f->zctx, ZMQ_PULL);
    snprintf(f->done_endpoint, sizeof f->done_endpoint, DONE_ENDPOINT_FMT, (void *)f);
    if (!f->done || zmq_bind(f->done, f->done_endpoint) != 0) {
        rc = sl_err_set(err, SL_EIO, "zmq_bind(%s): %s", f->done_endpoint,
                        zmq_strerror(zmq_errno()));
        goto fail;
    }
    f->router = zmq_socket(f->zctx, ZMQ_ROUTER);
    int linger = 0, mandatory = 0;
    if (f->router) {
        zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(f->router, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    }
    if (!f->router || zmq_bind(f->router, f->endpoint) != 0) {
        int e = zmq_errno();
        rc = sl_err_set(err, SL_EIO, "zmq_bind(%s): %s%s", f->endpoint, zmq_strerror(e),
                        e == EADDRINUSE ? " (another fetcher serves this model?)" : "");
        goto fail;
    }
    sl_readers_config rcfg = {.n_thread = o->readers,
                              .gguf = f->gguf,
                              .map = f->map,
                              .arena = f->arena,
                              .zmq_ctx = f->zctx,
                              .done_endpoint = f->done_endpoint,
                              .try_direct = o->direct,
                              .trace = f->trace};
    rc = sl_readers_open(&f->readers, &rcfg, err);
    if (rc) goto fail;
    /* After the readers exist, which would otherwise inherit the pin. */
    rc = sl_affinity_pin_self(o->cpu, err);
    if (rc) goto fail;

    if (!o->quiet) {
        char a[32], e[32];
        fmt_bytes(a, sizeof a, f->arena->total_bytes);
        fmt_bytes(e, sizeof e, f->map->layout.slot_bytes);
        fprintf(stderr,
                "sluice-fetcher: %s: %u layers x %u experts (%u shard%s, fingerprint %016" PRIx64
                ")\n"
                "sluice-fetcher: arena %s: %u slots x %s = %s%s, policy %s, %u readers, %s\n"
                "sluice-fetcher: serving on %s\n",
                o->model, f->map->n_layer, f->map->n_expert, f->gguf->n_shards,
                f->gguf->n_shards == 1 ? "" : "s", f->gguf->fingerprint, f->arena->name, f->n_slot,
                e, a, o->lock_memory ? " (locked)" : "", sl_policy_name(o->policy), o->readers,
                o->direct ? "O_DIRECT" : "buffered reads", f->endpoint);
    }
    *out = f;
    return 0;
fail:
    sl_fetcher_close(&f);
    return rc;
}

void sl_fetcher_close(sl_fetcher **pf)
{
    if (!pf || !*pf) return;
    sl_fetcher *f = *pf;
    sl_readers_close(&f->readers);
    if (f->trace && f->opt.trace_path) {
        sl_err e = {0};
        if (sl_trace_write_json(f->trace, f->opt.trace_path, &e))
            fprintf(stderr, "sluice-fetcher: %s\n", e.msg);
    }
    if (f->router) zmq_close(f->router);
    if (f->done) zmq_close(f->done);
    if (f->zctx) zmq_ctx_term(f->zctx);
    if (f->endpoint[0] && !strncmp(f->endpoint, "ipc://", 6)) unlink(f->endpoint + 6);
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++) free(f->clients[i].pins);
    sl_trace_close(&f->trace);
    sl_policy_free(&f->policy);
    sl_arena_close(&f->arena);
    sl_expert_map_free(&f->map);
    sl_gguf_close(&f->gguf);
    free(f->slots);
    free(f->inflight);
    free(f->dropped);
    free(f->waiters);
    free(f);
    *pf = NULL;
}

/* ---------------------------------------------------------------- sending */

static void send_to(sl_fetcher *f, const uint8_t *id, size_t id_len, const sl_proto_msg *m)
{
    size_t len = 0;
    sl_err e = {0};
    if (sl_proto_encode(m, f->frame, sizeof f->frame, &len, &e)) {
        /* Our own message broke the protocol: a bug. */
        fprintf(stderr, "sluice-fetcher: internal error encoding %s: %s\n",
                sl_proto_type_name(m->type), e.msg);
        SL_ASSERT(0);
    }
    /* A peer that vanished makes these fail; that is not our error. */
    if (zmq_send(f->router, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return;
    zmq_send(f->router, f->frame, len, ZMQ_DONTWAIT);
}

static void send_error(sl_fetcher *f, const uint8_t *id, size_t id_len, uint64_t req, int code,
                       const char *text)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_ERROR;
    m.error.req = req;
    m.error.code = (uint16_t)code;
    sl_proto_set_text(m.error.text, text);
    send_to(f, id, id_len, &m);
}

/* ---------------------------------------------------------------- clients */

static int find_client(sl_fetcher *f, const uint8_t *id, size_t len)
{
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++)
        if (f->clients[i].used && f->clients[i].id_len == len && !memcmp(f->clients[i].id, id, len))
            return i;
    return -1;
}

static void grant_pin(sl_fetcher *f, int ci, uint32_t slot)
{
    atomic_fetch_add(&f->arena->slots[slot].readers, 1);
    f->clients[ci].pins[slot]++;
    f->clients[ci].n_pins++;
}

static int request_ended(const client *c, uint64_t req)
{
    for (uint32_t i = 0; i < ENDED_MAX; i++)
        if (c->ended[i] == req) return 1;
    return 0;
}

/* Ends a demand request with one ERROR: later completions of its other experts
 * send neither READY nor a second ERROR (docs/protocol.md, FETCH). */
static void end_request(sl_fetcher *f, int ci, uint64_t req, int code, const char *text)
{
    client *c = &f->clients[ci];
    if (request_ended(c, req)) return;
    c->ended[c->n_ended++ % ENDED_MAX] = req;
    send_error(f, c->id, c->id_len, req, code, text);
}

static int any_compute_client(const sl_fetcher *f)
{
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++)
        if (f->clients[i].used && f->clients[i].kind == SL_PROTO_CLIENT_COMPUTE) return 1;
    return 0;
}

/* Forgets a client: its READY pins are dropped. Pins it took straight from the shared
 * table are its process's pin row's, given back when the process is gone
 * (check_clients); only pins no row accounts for (more compute processes than rows)
 * are cleared here, when no compute client and no live pin row is left. */
static void drop_client(sl_fetcher *f, int ci, const char *why)
{
    client *c = &f->clients[ci];
    for (uint32_t s = 0; s < f->n_slot && c->n_pins; s++) {
        if (!c->pins[s]) continue;
        atomic_fetch_sub(&f->arena->slots[s].readers, c->pins[s]);
        c->n_pins -= c->pins[s];
        c->pins[s] = 0;
    }
    c->used = 0;
    c->incarnation++;
    if (!f->opt.quiet) fprintf(stderr, "sluice-fetcher: client pid %u %s\n", c->pid, why);
    if (!any_compute_client(f) && !sl_arena_live_rows(f->arena)) {
        uint64_t stale = 0;
        for (uint32_t s = 0; s < f->n_slot; s++)
            stale += atomic_exchange(&f->arena->slots[s].readers, 0);
        if (stale)
            fprintf(stderr, "sluice-fetcher: cleared %" PRIu64 " pins left by gone clients\n",
                    stale);
    }
}

static int add_client(sl_fetcher *f, const uint8_t *id, size_t len, const sl_proto_hello *h)
{
    /* A full table gives up its stalest client if that one has been silent past the
     * heartbeat liveness (a connection its owner replaced). */
    int stalest = -1;
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++)
        if (f->clients[i].used &&
            (stalest < 0 || f->clients[i].last_ns < f->clients[stalest].last_ns))
            stalest = i;
    int full = 1;
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++) full &= f->clients[i].used;
    uint64_t liveness_ns = (uint64_t)SL_PROTO_HEARTBEAT_MS * SL_PROTO_LIVENESS * 1000000ull;
    if (full && stalest >= 0 && sl_now_ns() - f->clients[stalest].last_ns > liveness_ns)
        drop_client(f, stalest, "was replaced (table full, silent)");
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++) {
        client *c = &f->clients[i];
        if (c->used) continue;
        if (!c->pins) {
            c->pins = calloc(f->n_slot, sizeof *c->pins);
            if (!c->pins) return -1;
        }
        c->used = 1;
        memcpy(c->id, id, len);
        c->id_len = len;
        c->kind = h->client_kind;
        c->pid = h->pid;
        c->last_ns = sl_now_ns();
        c->n_pins = 0;
        memset(c->ended, 0, sizeof c->ended);
        c->n_ended = 0;
        return i;
    }
    return -1;
}

/* ---------------------------------------------------------------- requests */

static uint32_t waiter_add(sl_fetcher *f, uint32_t slot, int ci, uint64_t req)
{
    uint32_t w = f->free_waiter;
    if (w == NIL) return NIL;
    f->free_waiter = f->waiters[w].next;
    f->waiters[w] = (waiter){.client = (uint32_t)ci,
                             .incarnation = f->clients[ci].incarnation,
                             .req = req,
                             .next = f->slots[slot].waiters};
    f->slots[slot].waiters = w;
    return w;
}

struct busy_ctx {
    sl_fetcher *f;
};

static int slot_busy(void *ctx, uint32_t slot)
{
    sl_fetcher *f = ((struct busy_ctx *)ctx)->f;
    return f->slots[slot].filling || atomic_load(&f->arena->slots[slot].readers) != 0;
}

/* Finds and claims a slot for a new read; NIL when every slot is pinned or busy. */
static uint32_t claim_victim(sl_fetcher *f)
{
    struct busy_ctx bc = {f};
    for (int attempt = 0; attempt < 8; attempt++) {
        int64_t v = sl_policy_victim(f->policy, slot_busy, &bc);
        if (v < 0) return NIL;
        if (sl_arena_claim(f->arena, (uint32_t)v)) return (uint32_t)v;
        /* A pin raced in between: the slot is busy now, try another. */
    }
    return NIL;
}

static void start_read(sl_fetcher *f, uint32_t slot, uint32_t layer, uint32_t expert, int prefetch)
{
    slot_info *si = &f->slots[slot];
    si->layer = layer;
    si->expert = expert;
    si->filling = 1;
    f->n_filling++;
    si->prefetch = (uint8_t)prefetch;
    f->inflight[(uint64_t)layer * f->map->n_expert + expert] = slot + 1;
    sl_read_job j = {.seq = ++f->next_seq,
                     .layer = layer,
                     .expert = expert,
                     .slot = slot,
                     .prefetch = (uint8_t)prefetch};
    sl_readers_submit(f->readers, &j);
    if (prefetch)
        f->c.prefetch_reads++;
    else
        f->c.misses++;
}

static void end_read(sl_fetcher *f, uint32_t slot)
{
    slot_info *si = &f->slots[slot];
    f->inflight[(uint64_t)si->layer * f->map->n_expert + si->expert] = 0;
    si->filling = 0;
    f->n_filling--;
    si->prefetch = 0;
}

/* Demand arrived: prefetch reads not started yet are dropped, except those this very
 * request wants, which become demand reads in the slot they already hold. */
static void drop_prefetches(sl_fetcher *f, const sl_proto_fetch *want)
{
    uint32_t n = sl_readers_drop_prefetch(f->readers, f->dropped, f->n_slot);
    for (uint32_t i = 0; i < n; i++) {
        sl_read_job j = f->dropped[i];
        int wanted = 0;
        for (uint32_t k = 0; k < want->n_expert && !wanted; k++)
            wanted = j.layer == want->layer && j.expert == want->expert[k];
        /* Counted as a prefetch read when queued: it is now a demand read, or none. */
        f->c.prefetch_reads--;
        if (wanted) {
            j.prefetch = 0;
            f->slots[j.slot].prefetch = 0;
            sl_readers_submit(f->readers, &j);
            f->c.misses++;
            continue;
        }
        end_read(f, j.slot);
        sl_arena_abandon(f->arena, j.slot);
        sl_policy_forget(f->policy, j.slot);
        f->c.prefetch_dropped++;
    }
}

static void send_ready(sl_fetcher *f, int ci, uint64_t req, uint32_t slot, int source,
                       uint32_t read_us)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_READY;
    m.ready.req = req;
    m.ready.layer = atomic_load(&f->arena->slots[slot].layer);
    m.ready.expert = atomic_load(&f->arena->slots[slot].expert);
    m.ready.slot = slot;
    m.ready.generation = atomic_load(&f->arena->slots[slot].generation);
    m.ready.source = (uint8_t)source;
    m.ready.read_us = read_us;
    send_to(f, f->clients[ci].id, f->clients[ci].id_len, &m);
}

static void handle_fetch(sl_fetcher *f, int ci, const sl_proto_fetch *r)
{
    int demand = r->priority == SL_PROTO_DEMAND;
    if (demand) drop_prefetches(f, r);
    for (uint32_t k = 0; k < r->n_expert; k++) {
        uint32_t e = r->expert[k];
        uint64_t idx = (uint64_t)r->layer * f->map->n_expert + e;
        if (f->inflight[idx]) {
            uint32_t slot = f->inflight[idx] - 1;
            if (demand && waiter_add(f, slot, ci, r->req) == NIL) {
                end_request(f, ci, r->req, SL_PROTO_ERR_BUSY, "too many waiting requests");
                return;
            }
            continue;
        }
        uint32_t slot, gen;
        if (sl_arena_pin(f->arena, r->layer, e, &slot, &gen)) {
            sl_policy_touch(f->policy, slot);
            if (!demand) {
                sl_arena_unpin(f->arena, slot);
                continue;
            }
            /* The pin taken by sl_arena_pin becomes the client's READY pin. */
            f->clients[ci].pins[slot]++;
            f->clients[ci].n_pins++;
            f->c.hits++;
            send_ready(f, ci, r->req, slot, SL_PROTO_SRC_HIT, 0);
            continue;
        }
        slot = claim_victim(f);
        if (slot == NIL) {
            if (!demand) continue; /* a hint that does not fit is simply dropped */
            char t[128];
            snprintf(t, sizeof t, "no free slot for layer %u expert %u: every slot is pinned",
                     r->layer, e);
            end_request(f, ci, r->req, SL_PROTO_ERR_BUSY, t);
            return;
        }
        start_read(f, slot, r->layer, e, !demand);
        if (demand && waiter_add(f, slot, ci, r->req) == NIL) {
            end_request(f, ci, r->req, SL_PROTO_ERR_BUSY, "too many waiting requests");
            return;
        }
    }
}

static void handle_release(sl_fetcher *f, int ci, const sl_proto_release *r)
{
    client *c = &f->clients[ci];
    uint32_t stale = 0;
    if (r->arena_epoch != f->arena->hdr->epoch) {
        send_error(f, c->id, c->id_len, 0, SL_PROTO_ERR_STALE,
                   "RELEASE names another arena epoch: those pins died with their fetcher");
        return;
    }
    for (uint32_t i = 0; i < r->n_slot; i++) {
        uint32_t s = r->slot[i].slot;
        if (!c->pins[s] || atomic_load(&f->arena->slots[s].generation) != r->slot[i].generation) {
            stale++;
            continue;
        }
        c->pins[s]--;
        c->n_pins--;
        atomic_fetch_sub(&f->arena->slots[s].readers, 1);
    }
    if (stale) {
        char t[96];
        snprintf(t, sizeof t, "RELEASE: %u of %u slots were not pinned by this client", stale,
                 r->n_slot);
        send_error(f, c->id, c->id_len, 0, SL_PROTO_ERR_STALE, t);
    }
}

/* Reads taken by a reader and not yet published here. A reader's own count drops before
 * its completion reaches this loop, so it would let a STATS reply say "nothing in flight"
 * while the slot is still unpublished. */
static uint32_t reads_in_flight(sl_fetcher *f)
{
    uint32_t queued = sl_readers_queued(f->readers);
    return f->n_filling > queued ? f->n_filling - queued : 0;
}

static void fill_stats(sl_fetcher *f, sl_proto_stats_reply *s)
{
    s->uptime_ms = (sl_now_ns() - f->start_ns) / 1000000;
    s->hits = f->c.hits;
    s->misses = f->c.misses + f->c.prefetch_reads;
    s->bytes_read = f->c.bytes_read;
    s->prefetch_dropped = f->c.prefetch_dropped;
    s->read_errors = f->c.read_errors;
    s->queue_depth = sl_readers_queued(f->readers);
    s->in_flight = reads_in_flight(f);
    uint32_t pinned = 0;
    for (uint32_t i = 0; i < f->n_slot; i++)
        pinned += atomic_load(&f->arena->slots[i].readers) != 0;
    s->pinned = pinned;
    memcpy(s->hist, f->c.hist, sizeof s->hist);
}

static void handle_frame(sl_fetcher *f, const uint8_t *id, size_t id_len, const uint8_t *buf,
                         size_t len)
{
    sl_proto_msg m;
    sl_err e = {0};
    int rc = sl_proto_decode(buf, len, &m, &e);
    int ci = find_client(f, id, id_len);
    if (ci >= 0) f->clients[ci].last_ns = sl_now_ns();
    if (rc == SL_EMISMATCH && m.type == SL_PROTO_HELLO) {
        char t[128];
        snprintf(t, sizeof t, "protocol version %u is not spoken here (version %d)",
                 m.hello.version, SL_PROTO_VERSION);
        send_error(f, id, id_len, 0, SL_PROTO_ERR_VERSION, t);
        return;
    }
    if (rc) {
        f->c.bad_frames++;
        send_error(f, id, id_len, 0, sl_proto_err_from_status(rc), e.msg);
        return;
    }
    if (!(sl_proto_direction(m.type) & SL_PROTO_FROM_CLIENT)) {
        char t[96];
        snprintf(t, sizeof t, "%s is not a message a client sends", sl_proto_type_name(m.type));
        send_error(f, id, id_len, 0, SL_PROTO_ERR_UNEXPECTED, t);
        return;
    }
    sl_proto_limits lim = {f->map->n_layer, f->map->n_expert, f->n_slot};
    if (sl_proto_check(&m, &lim, &e)) {
        send_error(f, id, id_len, m.type == SL_PROTO_FETCH ? m.fetch.req : 0,
                   SL_PROTO_ERR_OUT_OF_RANGE, e.msg);
        return;
    }
    if (m.type == SL_PROTO_HELLO) {
        if (m.hello.fingerprint && m.hello.fingerprint != f->gguf->fingerprint) {
            char t[128];
            snprintf(t, sizeof t, "this fetcher serves model %016" PRIx64 ", not %016" PRIx64,
                     f->gguf->fingerprint, m.hello.fingerprint);
            send_error(f, id, id_len, 0, SL_PROTO_ERR_MODEL, t);
            return;
        }
        if (ci >= 0) drop_client(f, ci, "said HELLO again");
        ci = add_client(f, id, id_len, &m.hello);
        if (ci < 0) {
            send_error(f, id, id_len, 0, SL_PROTO_ERR_BUSY, "too many clients");
            return;
        }
        sl_proto_msg w;
        memset(&w, 0, sizeof w);
        w.type = SL_PROTO_WELCOME;
        w.welcome.version = SL_PROTO_VERSION;
        w.welcome.fingerprint = f->gguf->fingerprint;
        sl_strlcpy(w.welcome.arena_name, f->arena->name, sizeof w.welcome.arena_name);
        w.welcome.arena_epoch = f->arena->hdr->epoch;
        w.welcome.slot_bytes = f->arena->hdr->slot_bytes;
        w.welcome.slot_count = f->n_slot;
        w.welcome.n_layer = f->map->n_layer;
        w.welcome.n_expert = f->map->n_expert;
        memcpy(w.welcome.part_off, f->map->layout.part_offset, sizeof w.welcome.part_off);
        send_to(f, id, id_len, &w);
        if (!f->opt.quiet)
            fprintf(stderr, "sluice-fetcher: client pid %u connected\n", m.hello.pid);
        return;
    }
    if (m.type == SL_PROTO_PING) {
        if (ci < 0) {
            /* A peer we do not know: most likely a client of a fetcher that died, whose
             * socket reconnected to us on its own. A PONG would hide that. */
            send_error(f, id, id_len, 0, SL_PROTO_ERR_NOT_READY, "say HELLO first");
            return;
        }
        sl_proto_msg p;
        memset(&p, 0, sizeof p);
        p.type = SL_PROTO_PONG;
        p.pong.seq = m.ping.seq;
        p.pong.echo_ns = m.ping.sent_ns;
        send_to(f, id, id_len, &p);
        return;
    }
    if (m.type == SL_PROTO_PONG || m.type == SL_PROTO_ERROR) return;
    if (ci < 0 && m.type == SL_PROTO_BYE) return; /* BYE is never answered */
    if (ci < 0) {
        send_error(f, id, id_len, m.type == SL_PROTO_FETCH ? m.fetch.req : 0,
                   SL_PROTO_ERR_NOT_READY, "say HELLO first");
        return;
    }
    switch (m.type) {
    case SL_PROTO_FETCH:
        handle_fetch(f, ci, &m.fetch);
        break;
    case SL_PROTO_RELEASE:
        handle_release(f, ci, &m.release);
        break;
    case SL_PROTO_STATS: {
        sl_proto_msg s;
        memset(&s, 0, sizeof s);
        s.type = SL_PROTO_STATS_REPLY;
        s.stats_reply.req = m.stats.req;
        fill_stats(f, &s.stats_reply);
        send_to(f, id, id_len, &s);
        break;
    }
    case SL_PROTO_BYE:
        drop_client(f, ci, "said BYE");
        break;
    default:
        break;
    }
}

/* A reader finished: publish the slot and answer everyone waiting for it. */
static void handle_done(sl_fetcher *f, const sl_read_done *d)
{
    uint32_t slot = d->job.slot;
    slot_info *si = &f->slots[slot];
    SL_ASSERT(slot < f->n_slot && si->filling);
    uint64_t us = (d->end_ns - d->start_ns) / 1000;
    uint32_t read_us = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    end_read(f, slot);
    f->c.bytes_read += d->bytes;
    if (d->status == 0) {
        sl_arena_publish(f->arena, slot, d->job.layer, d->job.expert);
        sl_policy_touch(f->policy, slot);
        f->c.hist[sl_proto_hist_bucket(us)]++;
        f->c.read_us_total += us;
    } else {
        sl_arena_abandon(f->arena, slot);
        sl_policy_forget(f->policy, slot);
        f->c.read_errors++;
        fprintf(stderr, "sluice-fetcher: layer %u expert %u: %s\n", d->job.layer, d->job.expert,
                d->msg);
    }
    uint32_t w = si->waiters;
    si->waiters = NIL;
    while (w != NIL) {
        waiter wt = f->waiters[w];
        f->waiters[w].next = f->free_waiter;
        f->free_waiter = w;
        w = wt.next;
        client *c = &f->clients[wt.client];
        if (!c->used || c->incarnation != wt.incarnation || request_ended(c, wt.req)) continue;
        if (d->status == 0) {
            grant_pin(f, (int)wt.client, slot);
            send_ready(f, (int)wt.client, wt.req, slot, SL_PROTO_SRC_DISK, read_us);
        } else {
            end_request(f, (int)wt.client, wt.req, SL_PROTO_ERR_IO, d->msg);
        }
    }
}

/* ---------------------------------------------------------------- loop */

static double hist_quantile(const uint64_t *hist, double q)
{
    uint64_t total = 0;
    for (int i = 0; i < SL_PROTO_HIST_BUCKETS; i++) total += hist[i];
    if (!total) return 0;
    uint64_t want = (uint64_t)ceil(q * (double)total), seen = 0;
    for (int i = 0; i < SL_PROTO_HIST_BUCKETS; i++) {
        seen += hist[i];
        if (seen >= want) return (double)((uint64_t)SL_PROTO_HIST_BASE_US << i); /* upper bound */
    }
    return (double)((uint64_t)SL_PROTO_HIST_BASE_US << (SL_PROTO_HIST_BUCKETS - 1));
}

void sl_fetcher_print_stats(sl_fetcher *f, FILE *out)
{
    const counters *c = &f->c;
    double up = (double)(sl_now_ns() - f->start_ns) / 1e9;
    uint64_t reads = c->misses + c->prefetch_reads;
    uint64_t asked = c->hits + c->misses;
    fprintf(out,
            "sluice-fetcher stats after %.1f s: %" PRIu64 " FETCH hits, %" PRIu64
            " demand misses (%.1f%% of FETCHed experts hit; hits taken from the shared table "
            "never reach the fetcher), %" PRIu64 " prefetch reads, %" PRIu64
            " prefetches dropped, %" PRIu64 " read errors, %" PRIu64 " bad frames\n",
            up, c->hits, c->misses, asked ? 100.0 * (double)c->hits / (double)asked : 0.0,
            c->prefetch_reads, c->prefetch_dropped, c->read_errors, c->bad_frames);
    fprintf(out,
            "  read %.3f GB in %" PRIu64 " expert reads (mean %.0f us, p50 <= %.0f us, p99 <= %.0f "
            "us); queue %u, in flight %u, buffered shards %u of %u\n",
            (double)c->bytes_read / 1e9, reads,
            reads ? (double)c->read_us_total / (double)reads : 0.0, hist_quantile(c->hist, 0.5),
            hist_quantile(c->hist, 0.99), sl_readers_queued(f->readers), reads_in_flight(f),
            sl_readers_buffered_shards(f->readers), f->gguf->n_shards);
}

static void check_clients(sl_fetcher *f, uint64_t now)
{
    for (int i = 0; i < SL_FETCHER_MAX_CLIENTS; i++) {
        client *c = &f->clients[i];
        if (c->used && now > c->last_ns &&
            now - c->last_ns > (uint64_t)SL_FETCHER_CLIENT_TIMEOUT_MS * 1000000ull)
            drop_client(f, i, "went silent: dropped");
    }
    /* Pins a dead compute process took from the shared table, whatever its messages
     * said: a few kill(pid, 0) per heartbeat. */
    if (now - f->last_reclaim_ns >= (uint64_t)SL_PROTO_HEARTBEAT_MS * 1000000ull) {
        f->last_reclaim_ns = now;
        uint64_t n = sl_arena_reclaim_dead(f->arena);
        if (n && !f->opt.quiet)
            fprintf(stderr,
                    "sluice-fetcher: gave back %" PRIu64 " pins of a dead compute process\n", n);
    }
}

/* Answers the completions the readers queued; returns how many. */
static int drain_done(sl_fetcher *f)
{
    sl_read_done d;
    int n = 0;
    for (;;) {
        int got = zmq_recv(f->done, &d, sizeof d, ZMQ_DONTWAIT);
        if (got < 0) return n;
        SL_ASSERT(got == (int)sizeof d);
        handle_done(f, &d);
        n++;
    }
}

/* Serves up to 256 of the messages queued on the ROUTER socket; returns how many. */
static int serve_router(sl_fetcher *f)
{
    uint8_t id[IDENTITY_MAX];
    int budget = 0;
    for (; budget < 256; budget++) {
        int idn = zmq_recv(f->router, id, sizeof id, ZMQ_DONTWAIT);
        if (idn < 0) break;
        int more = 0;
        size_t ml = sizeof more;
        zmq_getsockopt(f->router, ZMQ_RCVMORE, &more, &ml);
        if (!more) continue; /* an identity without a body: nothing to answer */
        int len = zmq_recv(f->router, f->frame, sizeof f->frame, 0);
        /* Drain any further parts: one message is one frame. */
        int extra = 0;
        for (;;) {
            zmq_getsockopt(f->router, ZMQ_RCVMORE, &more, &ml);
            if (!more) break;
            char sink[64];
            zmq_recv(f->router, sink, sizeof sink, 0);
            extra = 1;
        }
        if (len < 0) continue;
        if (extra || (size_t)len > sizeof f->frame) {
            f->c.bad_frames++;
            send_error(f, id, (size_t)idn, 0, SL_PROTO_ERR_BAD_MESSAGE,
                       extra ? "a message is one frame" : "frame too large");
            continue;
        }
        uint8_t copy[SL_PROTO_FRAME_MAX];
        memcpy(copy, f->frame, (size_t)len);
        handle_frame(f, id, (size_t)idn, copy, (size_t)len);
    }
    return budget;
}

int sl_fetcher_run(sl_fetcher *f, volatile sig_atomic_t *stop, volatile sig_atomic_t *report,
                   sl_err *err)
{
    uint64_t last_activity = 0;
    while (!*stop) {
        /* Right after traffic, spin on non-blocking receives for a moment: a request
         * usually follows another, and waking from a blocking poll costs more than the
         * round trip itself (so does a zmq_poll that does not block: a system call more
         * a turn than a receive; bench-socket). Otherwise block in zmq_poll up to a
         * heartbeat. */
        const int spin = sl_now_ns() - last_activity < SL_FETCHER_SPIN_NS;
        /* spinning, the readers' socket is tried only while reads are out (each try
         * of an empty socket is a system call) */
        int done_in = f->n_filling > 0, router_in = 1;
        if (!spin) {
            zmq_pollitem_t items[2] = {{f->router, 0, ZMQ_POLLIN, 0}, {f->done, 0, ZMQ_POLLIN, 0}};
            int n = zmq_poll(items, 2, SL_PROTO_HEARTBEAT_MS);
            if (n < 0) {
                if (zmq_errno() == EINTR) continue;
                return sl_err_set(err, SL_EIO, "zmq_poll: %s", zmq_strerror(zmq_errno()));
            }
            router_in = items[0].revents & ZMQ_POLLIN;
            done_in = items[1].revents & ZMQ_POLLIN;
        }
        /* Completions first: they free slots and answer waiting requests. */
        int handled = done_in ? drain_done(f) : 0;
        if (router_in) handled += serve_router(f);
        uint64_t now = sl_now_ns();
        if (handled)
            last_activity = now;
        else if (spin) /* a thread sharing this CPU (ZeroMQ's I/O thread under --cpu)
                        * runs now rather than when our time slice ends */
            sched_yield();
        atomic_store(&f->arena->hdr->heartbeat_ns, now);
        if (report && *report) {
            *report = 0;
            sl_fetcher_print_stats(f, stderr);
        }
        check_clients(f, now);
    }
    return 0;
}
