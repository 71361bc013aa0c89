/* client.h - sl_fetch_client: the compute side of the fetcher protocol.
 *
 * Connects a DEALER socket to the fetcher, does HELLO/WELCOME, maps the arena the
 * fetcher names, and gets experts: hits are pinned straight from the shared slot
 * table (no message), misses are FETCHed and arrive as READY. It sends a PING every
 * SL_PROTO_HEARTBEAT_MS while it waits and declares the fetcher dead after
 * SL_PROTO_LIVENESS silent intervals; sl_fetch_client_get then re-does HELLO,
 * re-maps the new arena (new epoch) and asks again, so a fetcher restart costs
 * time, never a wrong byte.
 *
 * One client per thread; not thread-safe. The caller owns every pin it gets and
 * gives it back with sl_fetch_client_put.
 */
#ifndef SL_CLIENT_H
#define SL_CLIENT_H

#include <stdint.h>

#include "affinity.h"
#include "arena.h"
#include "err.h"
#include "proto.h"

typedef struct sl_fetch_client sl_fetch_client;

/* The default endpoint for a model: ipc://$XDG_RUNTIME_DIR/sluice/<fingerprint>.sock
 * (or /tmp/sluice-<uid>/... without XDG_RUNTIME_DIR). With create, the folder is
 * made (mode 0700); an existing folder not owned by this user or open to others is
 * refused. */
int sl_fetch_default_endpoint(char *out, size_t cap, uint64_t fingerprint, int create, sl_err *err);

typedef struct sl_fetch_client_options {
    const char *endpoint;  /* ipc:// or tcp:// URL */
    uint64_t fingerprint;  /* the model the client expects; 0 = any */
    uint8_t kind;          /* SL_PROTO_CLIENT_COMPUTE or _MONITOR */
    uint32_t connect_ms;   /* how long open/reconnect wait for WELCOME */
    uint32_t heartbeat_ms; /* SL_PROTO_HEARTBEAT_MS by default */
    uint32_t liveness;     /* SL_PROTO_LIVENESS by default */
    int io_cpu;            /* CPU for ZeroMQ's I/O thread (SL_CPU_ANY = no pinning): the
                              CPU the caller pinned its own thread to, see affinity.h */
    /* Called before an arena the client mapped is unmapped (a fetcher restart gave a
     * new one): the place to drop GPU registrations of the old mapping. May be NULL. */
    void (*on_unmap)(void *ctx, sl_arena *old);
    void *on_unmap_ctx;
} sl_fetch_client_options;

void sl_fetch_client_options_default(sl_fetch_client_options *o, const char *endpoint);

/* Connects and completes the handshake (waiting up to connect_ms for a fetcher to
 * answer). The caller owns *out. */
int sl_fetch_client_open(sl_fetch_client **out, const sl_fetch_client_options *o, sl_err *err);

/* Says BYE (best effort), unmaps and closes. */
void sl_fetch_client_close(sl_fetch_client **c);

/* What the fetcher said in its last WELCOME, and the mapped arena. */
const sl_proto_welcome *sl_fetch_client_welcome(const sl_fetch_client *c);
sl_arena *sl_fetch_client_arena(sl_fetch_client *c);

/* A pinned expert: its bytes are at sl_arena_slot_data(arena, slot) until put. */
typedef struct sl_fetch_pin {
    uint32_t layer, expert;
    uint32_t slot;
    uint32_t generation;
    uint8_t from_fetcher; /* 1: pin granted by READY (released by message); 0: shm hit */
    uint8_t source;       /* SL_PROTO_SRC_HIT or _DISK */
    uint32_t read_us;     /* fetcher's read time for a disk read */
    uint64_t epoch;       /* arena epoch the pin belongs to */
} sl_fetch_pin;

/* Gets n experts of one layer: pins the resident ones from the shared table, FETCHes
 * the rest at demand priority and waits for their READY (up to timeout_ms overall).
 * If the fetcher dies meanwhile, reconnects, re-maps and asks again. pins[i] answers
 * experts[i]. On failure no pin is left held. */
int sl_fetch_client_get(sl_fetch_client *c, uint32_t layer, const uint32_t *experts, uint32_t n,
                        sl_fetch_pin *pins, uint32_t timeout_ms, sl_err *err);

/* Called by sl_fetch_client_get_each as experts get pinned, so the caller can start
 * work on them while the rest are read: first once with every shared-table hit (after
 * the FETCH for the rest went out), then once per READY. index[k] is the position in
 * experts[] of pins[k]. After a fetcher restart the experts are asked for again and
 * may be reported again with pins of the new arena (the same bytes). */
typedef void (*sl_fetch_on_pins)(void *ctx, const uint32_t *index, const sl_fetch_pin *pins,
                                 uint32_t n);

/* sl_fetch_client_get, calling on_pins(ctx, ...) as pins arrive (on_pins may be NULL). */
int sl_fetch_client_get_each(sl_fetch_client *c, uint32_t layer, const uint32_t *experts,
                             uint32_t n, sl_fetch_pin *pins, uint32_t timeout_ms,
                             sl_fetch_on_pins on_pins, void *ctx, sl_err *err);

/* Hints the fetcher to read these experts at low priority (no answer). */
int sl_fetch_client_prefetch(sl_fetch_client *c, uint32_t layer, const uint32_t *experts,
                             uint32_t n, sl_err *err);

/* Gives pins back: shm pins are dropped in place, READY pins with one RELEASE. Pins
 * of an arena that is gone (a restart) are simply forgotten. */
int sl_fetch_client_put(sl_fetch_client *c, const sl_fetch_pin *pins, uint32_t n, sl_err *err);

/* Asks for the fetcher's counters. */
int sl_fetch_client_stats(sl_fetch_client *c, sl_proto_stats_reply *out, uint32_t timeout_ms,
                          sl_err *err);

/* Sends a PING and waits for its PONG; *rtt_ns gets the round trip. */
int sl_fetch_client_ping(sl_fetch_client *c, uint64_t *rtt_ns, uint32_t timeout_ms, sl_err *err);

/* Sends one raw frame as is (tests of the fetcher's input validation). */
int sl_fetch_client_send_raw(sl_fetch_client *c, const void *buf, size_t len, sl_err *err);

/* Receives the next message that is not a heartbeat, waiting up to timeout_ms;
 * SL_ENOTFOUND on timeout, SL_EPEER when the fetcher is declared dead. */
int sl_fetch_client_recv(sl_fetch_client *c, sl_proto_msg *out, uint32_t timeout_ms, sl_err *err);

/* Times the client re-did the handshake after losing the fetcher. */
uint32_t sl_fetch_client_reconnects(const sl_fetch_client *c);

#endif
