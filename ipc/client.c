/* client.c - sl_fetch_client: handshake, hits through the shared slot table,
 * misses through FETCH/READY, heartbeats, and recovery from a fetcher restart.
 *
 * The DEALER has ZMQ_IMMEDIATE set, so nothing is queued for a peer that is not
 * connected: a request sent while the fetcher is down fails to send (or is
 * answered by nobody) and is sent again after the new handshake.
 */
#include "client.h"

#include <errno.h>
#include <sched.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "trace.h"

/* How long a wait for a message polls without sleeping before it blocks. */
#define SL_CLIENT_SPIN_NS 100000ull

struct sl_fetch_client {
    sl_fetch_client_options opt;
    char endpoint[512];
    void *zctx, *sock;
    sl_proto_welcome welcome;
    sl_arena *arena;
    uint64_t next_req;
    uint64_t ping_seq;
    uint64_t last_rx_ns, last_tx_ns;
    uint32_t reconnects;
    uint8_t frame[SL_PROTO_FRAME_MAX];
};

int sl_fetch_default_endpoint(char *out, size_t cap, uint64_t fingerprint, int create, sl_err *err)
{
    char dir[256];
    const char *run = getenv("XDG_RUNTIME_DIR");
    if (run && run[0] == '/')
        snprintf(dir, sizeof dir, "%s/sluice", run);
    else
        snprintf(dir, sizeof dir, "/tmp/sluice-%u", (unsigned)getuid());
    if (create && mkdir(dir, 0700) != 0 && errno != EEXIST)
        return sl_err_errno(err, SL_EIO, errno, "mkdir(%s)", dir);
    struct stat st;
    if (create) {
        if (stat(dir, &st) != 0) return sl_err_errno(err, SL_EIO, errno, "stat(%s)", dir);
        if (st.st_uid != getuid() || (st.st_mode & 077))
            return sl_err_set(err, SL_EINVAL,
                              "%s must belong to this user and be closed to others (mode 0700)",
                              dir);
    }
    int n = snprintf(out, cap, "ipc://%s/%016" PRIx64 ".sock", dir, fingerprint);
    /* A unix socket path holds at most 107 bytes. */
    if (n < 0 || (size_t)n >= cap || n - 6 > 107)
        return sl_err_set(err, SL_EINVAL, "endpoint path under %s is too long for a socket", dir);
    return 0;
}

void sl_fetch_client_options_default(sl_fetch_client_options *o, const char *endpoint)
{
    memset(o, 0, sizeof *o);
    o->endpoint = endpoint;
    o->kind = SL_PROTO_CLIENT_COMPUTE;
    o->connect_ms = 10000;
    o->heartbeat_ms = SL_PROTO_HEARTBEAT_MS;
    o->liveness = SL_PROTO_LIVENESS;
    o->io_cpu = SL_CPU_ANY;
}

static int send_msg(sl_fetch_client *c, const sl_proto_msg *m, sl_err *err)
{
    size_t len = 0;
    int rc = sl_proto_encode(m, c->frame, sizeof c->frame, &len, err);
    if (rc) return rc;
    if (zmq_send(c->sock, c->frame, len, ZMQ_DONTWAIT) < 0) {
        int e = zmq_errno();
        if (e == EAGAIN)
            return sl_err_set(err, SL_EPEER, "no fetcher connected at %s", c->endpoint);
        return sl_err_set(err, SL_EIO, "zmq_send(%s): %s", c->endpoint, zmq_strerror(e));
    }
    c->last_tx_ns = sl_now_ns();
    return 0;
}

static int send_ping(sl_fetch_client *c)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_PING;
    m.ping.seq = ++c->ping_seq;
    m.ping.sent_ns = sl_now_ns();
    return send_msg(c, &m, NULL);
}

/* One frame into c->frame: its length, or -1 when none came. spin: one non-blocking
 * receive (a zmq_poll that does not block costs a system call more; bench-socket),
 * then sched_yield, so that a thread sharing this CPU (ZeroMQ's I/O thread when pinned
 * with --cpu) runs at once instead of at the end of our time slice; otherwise a
 * zmq_poll of up to wait_ms first. *fail: set on a socket error (the message in err). */
static int recv_frame(sl_fetch_client *c, int spin, long wait_ms, int *fail, sl_err *err)
{
    if (!spin) {
        zmq_pollitem_t it = {c->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&it, 1, wait_ms);
        if (n < 0 && zmq_errno() != EINTR) {
            *fail = 1;
            sl_err_set(err, SL_EIO, "zmq_poll: %s", zmq_strerror(zmq_errno()));
        }
        if (n <= 0) return -1;
    }
    int len = zmq_recv(c->sock, c->frame, sizeof c->frame, ZMQ_DONTWAIT);
    if (len < 0 && spin) sched_yield();
    return len;
}

/* Receives one message within timeout_ms, sending heartbeats meanwhile. Returns 0,
 * SL_ENOTFOUND on timeout, SL_EPEER when the fetcher is silent past its liveness. */
static int recv_any(sl_fetch_client *c, sl_proto_msg *out, uint32_t timeout_ms, sl_err *err)
{
    uint64_t entered = sl_now_ns();
    uint64_t deadline = entered + (uint64_t)timeout_ms * 1000000ull;
    uint64_t hb = (uint64_t)c->opt.heartbeat_ms * 1000000ull;
    /* Silence counts only while we wait and ping: a client busy elsewhere for seconds
     * (a long GPU call) must not take the fetcher for dead on its next request. */
    if (c->last_rx_ns < entered) c->last_rx_ns = entered;
    for (;;) {
        uint64_t now = sl_now_ns();
        if (now - c->last_rx_ns > hb * c->opt.liveness)
            return sl_err_set(err, SL_EPEER, "fetcher at %s is silent for %" PRIu64 " ms",
                              c->endpoint, (now - c->last_rx_ns) / 1000000);
        if (now - c->last_tx_ns >= hb) send_ping(c);
        if (now >= deadline)
            return sl_err_set(err, SL_ENOTFOUND, "no answer within %u ms", timeout_ms);
        uint64_t wait = deadline - now < hb ? deadline - now : hb;
        /* Spin briefly first: an answer of the fetcher usually comes within tens of
         * microseconds, less than a sleep and wake-up cost. */
        int fail = 0;
        int len = recv_frame(c, now - entered < SL_CLIENT_SPIN_NS, (long)(wait / 1000000ull) + 1,
                             &fail, err);
        if (fail) return SL_EIO;
        if (len < 0) continue;
        c->last_rx_ns = sl_now_ns();
        sl_err de = {0};
        if ((size_t)len > sizeof c->frame || sl_proto_decode(c->frame, (size_t)len, out, &de)) {
            fprintf(stderr, "sluice: fetch client: dropped a bad frame from the fetcher: %s\n",
                    de.msg);
            continue;
        }
        if (out->type == SL_PROTO_PONG) continue;
        if (out->type == SL_PROTO_ERROR && out->error.code == SL_PROTO_ERR_NOT_READY)
            return sl_err_set(err, SL_EPEER,
                              "the fetcher at %s does not know this client (it "
                              "restarted?): %s",
                              c->endpoint, out->error.text);
        if (out->type == SL_PROTO_PING) {
            sl_proto_msg p;
            memset(&p, 0, sizeof p);
            p.type = SL_PROTO_PONG;
            p.pong.seq = out->ping.seq;
            p.pong.echo_ns = out->ping.sent_ns;
            send_msg(c, &p, NULL);
            continue;
        }
        return 0;
    }
}

static int open_socket(sl_fetch_client *c, sl_err *err)
{
    if (c->sock) zmq_close(c->sock);
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) return sl_err_set(err, SL_EIO, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    int one = 1, linger = 0, ivl = 50;
    zmq_setsockopt(c->sock, ZMQ_IMMEDIATE, &one, sizeof one);
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    if (zmq_connect(c->sock, c->endpoint) != 0)
        return sl_err_set(err, SL_EINVAL, "zmq_connect(%s): %s", c->endpoint,
                          zmq_strerror(zmq_errno()));
    return 0;
}

/* HELLO until WELCOME (or a refusal), then map the arena if its epoch is new. */
static int handshake(sl_fetch_client *c, sl_err *err)
{
    uint64_t deadline = sl_now_ns() + (uint64_t)c->opt.connect_ms * 1000000ull;
    int rc = open_socket(c, err);
    if (rc) return rc;
    uint32_t attempts = 0;
    for (;;) {
        if (sl_now_ns() >= deadline)
            return sl_err_set(err, SL_EPEER, "no fetcher answered at %s within %u ms", c->endpoint,
                              c->opt.connect_ms);
        sl_proto_msg m;
        memset(&m, 0, sizeof m);
        m.type = SL_PROTO_HELLO;
        m.hello.version = SL_PROTO_VERSION;
        m.hello.client_kind = c->opt.kind;
        m.hello.pid = (uint32_t)getpid();
        m.hello.fingerprint = c->opt.fingerprint;
        if (send_msg(c, &m, NULL) != 0) {
            usleep(20000); /* not connected yet */
            continue;
        }
        c->last_rx_ns = sl_now_ns();
        sl_proto_msg r;
        rc = recv_any(c, &r, 500, NULL);
        if (rc) {
            /* Nothing came back yet (a fetcher still starting, or a loaded machine): say
             * HELLO again on the same socket. A new socket per attempt would leave the
             * fetcher one forgotten client per attempt. */
            if (++attempts % 8 == 0) {
                /* Long silence: maybe a connection to a peer that died. Start afresh. */
                rc = open_socket(c, err);
                if (rc) return rc;
            }
            continue;
        }
        if (r.type == SL_PROTO_ERROR)
            return sl_err_set(err, r.error.code == SL_PROTO_ERR_MODEL ? SL_EMISMATCH : SL_EPEER,
                              "fetcher at %s refused HELLO: %s: %s", c->endpoint,
                              sl_proto_err_name(r.error.code), r.error.text);
        if (r.type != SL_PROTO_WELCOME) continue; /* a late answer of an earlier life */
        if (c->arena && c->welcome.arena_epoch == r.welcome.arena_epoch &&
            !strcmp(c->welcome.arena_name, r.welcome.arena_name))
            return 0;
        if (c->arena && c->opt.on_unmap) c->opt.on_unmap(c->opt.on_unmap_ctx, c->arena);
        sl_arena_close(&c->arena);
        rc = sl_arena_map(&c->arena, r.welcome.arena_name, r.welcome.fingerprint, err);
        if (rc) return rc;
        if (c->arena->hdr->epoch != r.welcome.arena_epoch ||
            c->arena->hdr->n_slot != r.welcome.slot_count ||
            c->arena->hdr->slot_bytes != r.welcome.slot_bytes)
            return sl_err_set(err, SL_EMISMATCH, "arena %s does not match the fetcher's WELCOME",
                              r.welcome.arena_name);
        c->welcome = r.welcome;
        return 0;
    }
}

int sl_fetch_client_open(sl_fetch_client **out, const sl_fetch_client_options *o, sl_err *err)
{
    *out = NULL;
    if (!o->endpoint) return sl_err_set(err, SL_EINVAL, "fetch client: no endpoint");
    sl_fetch_client *c = calloc(1, sizeof *c);
    if (!c) return sl_err_set(err, SL_ENOMEM, "fetch client: out of memory");
    c->opt = *o;
    if (!c->opt.heartbeat_ms) c->opt.heartbeat_ms = SL_PROTO_HEARTBEAT_MS;
    if (!c->opt.liveness) c->opt.liveness = SL_PROTO_LIVENESS;
    sl_strlcpy(c->endpoint, o->endpoint, sizeof c->endpoint);
    c->opt.endpoint = c->endpoint;
    c->zctx = zmq_ctx_new();
    int rc = c->zctx ? 0 : sl_err_set(err, SL_EIO, "zmq_ctx_new failed");
    /* Before the first socket, which starts the I/O thread. */
    if (!rc && o->io_cpu != SL_CPU_ANY) {
        rc = sl_affinity_check(o->io_cpu, err);
        if (!rc && zmq_ctx_set(c->zctx, ZMQ_THREAD_AFFINITY_CPU_ADD, o->io_cpu) != 0)
            rc = sl_err_set(err, SL_EIO, "zmq_ctx_set(ZMQ_THREAD_AFFINITY_CPU_ADD, %d): %s",
                            o->io_cpu, zmq_strerror(zmq_errno()));
    }
    if (!rc) rc = handshake(c, err);
    if (rc) {
        sl_fetch_client_close(&c);
        return rc;
    }
    *out = c;
    return 0;
}

void sl_fetch_client_close(sl_fetch_client **pc)
{
    if (!pc || !*pc) return;
    sl_fetch_client *c = *pc;
    if (c->sock) {
        sl_proto_msg m;
        memset(&m, 0, sizeof m);
        m.type = SL_PROTO_BYE;
        send_msg(c, &m, NULL);
        zmq_close(c->sock);
    }
    if (c->zctx) zmq_ctx_term(c->zctx);
    if (c->arena && c->opt.on_unmap) c->opt.on_unmap(c->opt.on_unmap_ctx, c->arena);
    sl_arena_close(&c->arena);
    free(c);
    *pc = NULL;
}

const sl_proto_welcome *sl_fetch_client_welcome(const sl_fetch_client *c)
{
    return &c->welcome;
}

sl_arena *sl_fetch_client_arena(sl_fetch_client *c)
{
    return c->arena;
}

uint32_t sl_fetch_client_reconnects(const sl_fetch_client *c)
{
    return c->reconnects;
}

int sl_fetch_client_recv(sl_fetch_client *c, sl_proto_msg *out, uint32_t timeout_ms, sl_err *err)
{
    return recv_any(c, out, timeout_ms, err);
}

int sl_fetch_client_send_raw(sl_fetch_client *c, const void *buf, size_t len, sl_err *err)
{
    if (zmq_send(c->sock, buf, len, 0) < 0)
        return sl_err_set(err, SL_EIO, "zmq_send: %s", zmq_strerror(zmq_errno()));
    c->last_tx_ns = sl_now_ns();
    return 0;
}

static void release_fetcher_pins(sl_fetch_client *c, const sl_fetch_pin *pins, uint32_t n)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_RELEASE;
    m.release.arena_epoch = c->welcome.arena_epoch;
    for (uint32_t i = 0; i < n; i++) {
        if (!pins[i].from_fetcher || pins[i].epoch != c->welcome.arena_epoch) continue;
        m.release.slot[m.release.n_slot].slot = pins[i].slot;
        m.release.slot[m.release.n_slot].generation = pins[i].generation;
        if (++m.release.n_slot == SL_PROTO_RELEASE_MAX) {
            send_msg(c, &m, NULL);
            m.release.n_slot = 0;
        }
    }
    if (m.release.n_slot) send_msg(c, &m, NULL);
}

int sl_fetch_client_put(sl_fetch_client *c, const sl_fetch_pin *pins, uint32_t n, sl_err *err)
{
    (void)err;
    for (uint32_t i = 0; i < n; i++)
        if (!pins[i].from_fetcher && pins[i].epoch == c->welcome.arena_epoch)
            sl_arena_unpin(c->arena, pins[i].slot);
    release_fetcher_pins(c, pins, n);
    return 0;
}

/* A FETCH of layer with a fresh request id and no experts yet. */
static void fetch_begin(sl_fetch_client *c, sl_proto_msg *m, uint32_t layer, uint8_t priority)
{
    memset(m, 0, sizeof *m);
    m->type = SL_PROTO_FETCH;
    m->fetch.req = ++c->next_req;
    m->fetch.layer = layer;
    m->fetch.priority = priority;
}

/* One attempt at getting the experts; SL_EPEER means: reconnect and try again. */
static int get_once(sl_fetch_client *c, uint32_t layer, const uint32_t *experts, uint32_t n,
                    sl_fetch_pin *pins, uint8_t *have, uint64_t deadline, sl_fetch_on_pins on_pins,
                    void *ctx, sl_err *err)
{
    sl_proto_msg m;
    fetch_begin(c, &m, layer, SL_PROTO_DEMAND);
    uint64_t epoch = c->welcome.arena_epoch;
    for (uint32_t i = 0; i < n; i++) {
        have[i] = 0;
        uint32_t slot, gen;
        if (sl_arena_pin(c->arena, layer, experts[i], &slot, &gen)) {
            pins[i] = (sl_fetch_pin){.layer = layer,
                                     .expert = experts[i],
                                     .slot = slot,
                                     .generation = gen,
                                     .from_fetcher = 0,
                                     .source = SL_PROTO_SRC_HIT,
                                     .epoch = epoch};
            have[i] = 1;
        } else {
            m.fetch.expert[m.fetch.n_expert++] = experts[i];
        }
    }
    int rc = m.fetch.n_expert ? send_msg(c, &m, err) : 0;
    if (rc) return rc;
    /* The hits, reported while the fetcher starts on the misses. */
    if (on_pins && m.fetch.n_expert < n) {
        uint32_t index[SL_PROTO_FETCH_MAX], k = 0;
        sl_fetch_pin hit[SL_PROTO_FETCH_MAX];
        for (uint32_t i = 0; i < n; i++)
            if (have[i]) {
                index[k] = i;
                hit[k++] = pins[i];
            }
        on_pins(ctx, index, hit, k);
    }
    uint32_t missing = m.fetch.n_expert;
    while (missing) {
        uint64_t now = sl_now_ns();
        if (now >= deadline)
            return sl_err_set(err, SL_ENOTFOUND, "FETCH of layer %u timed out", layer);
        sl_proto_msg r;
        rc = recv_any(c, &r, (uint32_t)((deadline - now) / 1000000ull) + 1, err);
        if (rc) return rc;
        if (r.type == SL_PROTO_ERROR && r.error.req == m.fetch.req)
            return sl_err_set(err, r.error.code == SL_PROTO_ERR_IO ? SL_EIO : SL_EPEER,
                              "fetcher refused layer %u: %s: %s", layer,
                              sl_proto_err_name(r.error.code), r.error.text);
        if (r.type == SL_PROTO_READY && r.ready.req != m.fetch.req) {
            /* The answer to a request given up earlier: its pin is not wanted. */
            sl_fetch_pin stray = {.slot = r.ready.slot,
                                  .generation = (uint32_t)r.ready.generation,
                                  .from_fetcher = 1,
                                  .epoch = epoch};
            release_fetcher_pins(c, &stray, 1);
            continue;
        }
        if (r.type != SL_PROTO_READY) continue;
        for (uint32_t i = 0; i < n; i++) {
            if (have[i] || experts[i] != r.ready.expert || r.ready.layer != layer) continue;
            pins[i] = (sl_fetch_pin){.layer = layer,
                                     .expert = experts[i],
                                     .slot = r.ready.slot,
                                     .generation = (uint32_t)r.ready.generation,
                                     .from_fetcher = 1,
                                     .source = r.ready.source,
                                     .read_us = r.ready.read_us,
                                     .epoch = epoch};
            have[i] = 1;
            missing--;
            if (on_pins) on_pins(ctx, &i, &pins[i], 1);
            break;
        }
    }
    return 0;
}

int sl_fetch_client_get(sl_fetch_client *c, uint32_t layer, const uint32_t *experts, uint32_t n,
                        sl_fetch_pin *pins, uint32_t timeout_ms, sl_err *err)
{
    return sl_fetch_client_get_each(c, layer, experts, n, pins, timeout_ms, NULL, NULL, err);
}

int sl_fetch_client_get_each(sl_fetch_client *c, uint32_t layer, const uint32_t *experts,
                             uint32_t n, sl_fetch_pin *pins, uint32_t timeout_ms,
                             sl_fetch_on_pins on_pins, void *ctx, sl_err *err)
{
    if (n == 0 || n > SL_PROTO_FETCH_MAX)
        return sl_err_set(err, SL_EINVAL, "get: %u experts (1..%d)", n, SL_PROTO_FETCH_MAX);
    uint8_t have[SL_PROTO_FETCH_MAX];
    uint64_t deadline = sl_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        int rc = get_once(c, layer, experts, n, pins, have, deadline, on_pins, ctx, err);
        if (rc == 0) return 0;
        /* Give back what this attempt holds, whatever happens next. */
        for (uint32_t i = 0; i < n; i++)
            if (have[i]) sl_fetch_client_put(c, &pins[i], 1, NULL);
        if (rc != SL_EPEER || sl_now_ns() >= deadline) return rc;
        /* The fetcher is gone or refused us: a new handshake, a new arena. */
        c->reconnects++;
        uint32_t left = (uint32_t)((deadline - sl_now_ns()) / 1000000ull);
        uint32_t saved = c->opt.connect_ms;
        c->opt.connect_ms = left ? left : 1;
        rc = handshake(c, err);
        c->opt.connect_ms = saved;
        if (rc) return rc;
    }
}

int sl_fetch_client_prefetch(sl_fetch_client *c, uint32_t layer, const uint32_t *experts,
                             uint32_t n, sl_err *err)
{
    if (n == 0 || n > SL_PROTO_FETCH_MAX)
        return sl_err_set(err, SL_EINVAL, "prefetch: %u experts (1..%d)", n, SL_PROTO_FETCH_MAX);
    sl_proto_msg m;
    fetch_begin(c, &m, layer, SL_PROTO_PREFETCH);
    m.fetch.n_expert = n;
    memcpy(m.fetch.expert, experts, n * sizeof *experts);
    return send_msg(c, &m, err);
}

int sl_fetch_client_stats(sl_fetch_client *c, sl_proto_stats_reply *out, uint32_t timeout_ms,
                          sl_err *err)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_STATS;
    m.stats.req = ++c->next_req;
    int rc = send_msg(c, &m, err);
    if (rc) return rc;
    uint64_t deadline = sl_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = sl_now_ns();
        if (now >= deadline) return sl_err_set(err, SL_ENOTFOUND, "STATS timed out");
        sl_proto_msg r;
        rc = recv_any(c, &r, (uint32_t)((deadline - now) / 1000000ull) + 1, err);
        if (rc) return rc;
        if (r.type == SL_PROTO_STATS_REPLY && r.stats_reply.req == m.stats.req) {
            *out = r.stats_reply;
            return 0;
        }
    }
}

int sl_fetch_client_ping(sl_fetch_client *c, uint64_t *rtt_ns, uint32_t timeout_ms, sl_err *err)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_PING;
    m.ping.seq = ++c->ping_seq;
    m.ping.sent_ns = sl_now_ns();
    int rc = send_msg(c, &m, err);
    if (rc) return rc;
    uint64_t deadline = m.ping.sent_ns + (uint64_t)timeout_ms * 1000000ull;
    while (sl_now_ns() < deadline) {
        int fail = 0;
        int len = recv_frame(c, sl_now_ns() - m.ping.sent_ns < SL_CLIENT_SPIN_NS, 10, &fail, err);
        if (fail) return SL_EIO;
        if (len < 0) continue;
        c->last_rx_ns = sl_now_ns();
        sl_proto_msg r;
        if ((size_t)len <= sizeof c->frame && !sl_proto_decode(c->frame, (size_t)len, &r, NULL) &&
            r.type == SL_PROTO_PONG && r.pong.seq == m.ping.seq) {
            *rtt_ns = c->last_rx_ns - r.pong.echo_ns;
            return 0;
        }
    }
    return sl_err_set(err, SL_ENOTFOUND, "no PONG within %u ms", timeout_ms);
}
