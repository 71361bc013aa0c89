/* proto.h - the control protocol between sluice-compute and sluice-fetcher: messages and codec.
 *
 * Every control message is one msgpack array [type, field, ...] in one ZeroMQ frame (compute
 * DEALER, fetcher ROUTER); docs/protocol.md is the wire specification and this header mirrors
 * it. This module is the pure codec: no sockets, no global state, callable from any thread.
 *
 * Invariants:
 *  - sl_proto_decode() treats its input as hostile: it bounds the frame size, checks that the
 *    frame holds exactly one complete msgpack object before msgpack-c allocates anything, then
 *    checks type, arity, msgpack type, integer width, array length, string length and charset
 *    and enum values of every field. It never reads outside the frame and never crashes.
 *  - Everything that can be checked without knowing the model and the arena is checked by the
 *    codec, on both sides: sl_proto_encode() refuses to emit what sl_proto_decode() would
 *    reject. Ranges that need context (layer < n_layer, expert < n_expert, slot < slot count)
 *    are checked by sl_proto_check().
 *  - sl_proto_decode() zeroes *out before filling it, so two decodes of the same message
 *    compare equal with memcmp().
 */
#ifndef SL_PROTO_H
#define SL_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

/* Protocol version sent in HELLO and WELCOME; both sides must speak exactly this one. */
#define SL_PROTO_VERSION 1

/* Largest frame sl_proto_decode() parses; larger ones are rejected unread. The largest v1
 * message in its most wasteful legal encoding (RELEASE, every integer as uint64, array32
 * headers) is 2972 bytes; a buffer of this size holds any encoded message. */
#define SL_PROTO_FRAME_MAX 8192
/* Deepest container nesting in a frame (RELEASE: [5, epoch, [[slot, gen], ...]] is 3). */
#define SL_PROTO_DEPTH_MAX 3

#define SL_PROTO_FETCH_MAX      64   /* experts in one FETCH */
#define SL_PROTO_RELEASE_MAX    128  /* slots in one RELEASE */
#define SL_PROTO_ARENA_NAME_MAX 64   /* bytes of the arena's shm name, leading '/' included */
#define SL_PROTO_TEXT_MAX       255  /* bytes of UTF-8 text in ERROR */
#define SL_PROTO_N_PART         3    /* parts of an expert in a slot: gate, up, down */
#define SL_PROTO_SLOT_ALIGN     4096 /* slot size and part offsets are multiples of this */

/* Read-latency histogram of STATS_REPLY: bucket 0 counts reads under SL_PROTO_HIST_BASE_US,
 * bucket i in 1..14 reads in [BASE << (i-1), BASE << i) us, bucket 15 reads of
 * BASE << 14 us (1.05 s) or more. sl_proto_hist_bucket() maps a latency to its bucket. */
#define SL_PROTO_HIST_BUCKETS 16
#define SL_PROTO_HIST_BASE_US 64

/* Heartbeats: a client sends PING every SL_PROTO_HEARTBEAT_MS; a peer from which nothing
 * (any message counts) arrived for SL_PROTO_LIVENESS intervals is dead. Values may be tuned. */
#define SL_PROTO_HEARTBEAT_MS 250
#define SL_PROTO_LIVENESS     4

/* Message types: the first element of every frame. */
typedef enum sl_proto_type {
    SL_PROTO_HELLO = 1,       /* compute -> fetcher: first message of a connection */
    SL_PROTO_WELCOME = 2,     /* fetcher -> compute: answer to HELLO, describes the arena */
    SL_PROTO_FETCH = 3,       /* compute -> fetcher: load experts of one layer */
    SL_PROTO_READY = 4,       /* fetcher -> compute: one expert of a FETCH is in its slot */
    SL_PROTO_RELEASE = 5,     /* compute -> fetcher: drop the pins READY gave */
    SL_PROTO_STATS = 6,       /* compute -> fetcher: ask for counters */
    SL_PROTO_STATS_REPLY = 7, /* fetcher -> compute: the counters */
    SL_PROTO_PING = 8,        /* either way: heartbeat */
    SL_PROTO_PONG = 9,        /* either way: answer to PING */
    SL_PROTO_ERROR = 10,      /* either way: a request or a frame was refused */
    SL_PROTO_BYE = 11,        /* either way: the sender is leaving */
} sl_proto_type;
#define SL_PROTO_TYPE_MAX 11

/* Which side may send a type (bit mask, sl_proto_direction()). */
enum {
    SL_PROTO_FROM_CLIENT = 1,
    SL_PROTO_FROM_FETCHER = 2,
};

/* Codes carried by ERROR. */
typedef enum sl_proto_errcode {
    SL_PROTO_ERR_BAD_MESSAGE = 1,  /* the frame is not a valid message */
    SL_PROTO_ERR_UNKNOWN_TYPE = 2, /* a well-formed frame of a type this side does not know */
    SL_PROTO_ERR_OUT_OF_RANGE = 3, /* layer, expert or slot outside the model or the arena */
    SL_PROTO_ERR_VERSION = 4,      /* HELLO with another protocol version */
    SL_PROTO_ERR_MODEL = 5,        /* HELLO expects another model fingerprint */
    SL_PROTO_ERR_NOT_READY = 6,    /* a request before the handshake completed */
    SL_PROTO_ERR_UNEXPECTED = 7,   /* valid, but not accepted from this peer or in this state */
    SL_PROTO_ERR_BUSY = 8,         /* the request queue is full; retry later */
    SL_PROTO_ERR_IO = 9,           /* reading an expert from its shard failed */
    SL_PROTO_ERR_STALE = 10,       /* RELEASE of another arena epoch or slot generation */
    SL_PROTO_ERR_INTERNAL = 11,    /* the sender failed in a way not covered above */
} sl_proto_errcode;
#define SL_PROTO_ERR_MAX 11

typedef enum sl_proto_client {
    SL_PROTO_CLIENT_COMPUTE = 1, /* a compute process: fetches, pins and releases */
    SL_PROTO_CLIENT_MONITOR = 2, /* a tool that only asks for STATS and PINGs */
} sl_proto_client;

typedef enum sl_proto_priority {
    SL_PROTO_DEMAND = 0,   /* needed now: one READY per expert, or an ERROR */
    SL_PROTO_PREFETCH = 1, /* a hint: no READY, may be dropped */
} sl_proto_priority;

typedef enum sl_proto_source {
    SL_PROTO_SRC_HIT = 0,  /* the expert was already in the host arena */
    SL_PROTO_SRC_DISK = 1, /* the expert was read from its shard */
} sl_proto_source;

/* [1, version, client_kind, pid, fingerprint] */
typedef struct sl_proto_hello {
    uint32_t version;     /* SL_PROTO_VERSION */
    uint8_t client_kind;  /* sl_proto_client */
    uint32_t pid;         /* the client's process id, for logs */
    uint64_t fingerprint; /* model fingerprint the client expects, 0 = any */
} sl_proto_hello;

/* [2, version, fingerprint, arena_name, arena_epoch, slot_bytes, slot_count, n_layer,
 *  n_expert, [part_off x 3]] */
typedef struct sl_proto_welcome {
    uint32_t version;     /* SL_PROTO_VERSION */
    uint64_t fingerprint; /* model fingerprint of the fetcher's shards, != 0 */
    char arena_name[SL_PROTO_ARENA_NAME_MAX + 1]; /* "/[A-Za-z0-9][A-Za-z0-9._-]*", NUL-ended */
    uint64_t arena_epoch;               /* >= 1; changes whenever the arena is created anew */
    uint64_t slot_bytes;                /* bytes per slot, a multiple of SL_PROTO_SLOT_ALIGN */
    uint32_t slot_count;                /* slots in the arena, >= 1 */
    uint32_t n_layer;                   /* MoE layers of the model, >= 1 */
    uint32_t n_expert;                  /* routed experts per layer, >= 1 */
    uint64_t part_off[SL_PROTO_N_PART]; /* bytes from slot start to the gate/up/down windows;
                                           aligned, strictly increasing, < slot_bytes */
} sl_proto_welcome;

/* [3, req, layer, [expert x n_expert], priority] */
typedef struct sl_proto_fetch {
    uint64_t req;                        /* request id chosen by the client, >= 1 */
    uint32_t layer;                      /* < n_layer (sl_proto_check) */
    uint32_t n_expert;                   /* entries used in expert[], 1..SL_PROTO_FETCH_MAX */
    uint32_t expert[SL_PROTO_FETCH_MAX]; /* distinct, each < n_expert; read in this order */
    uint8_t priority;                    /* sl_proto_priority */
} sl_proto_fetch;

/* [4, req, layer, expert, slot, generation, source, read_us] */
typedef struct sl_proto_ready {
    uint64_t req;        /* the FETCH it answers, >= 1 */
    uint32_t layer;      /* < n_layer */
    uint32_t expert;     /* < n_expert */
    uint32_t slot;       /* < slot_count; pinned for the client until RELEASE */
    uint64_t generation; /* the slot's generation when it was filled */
    uint8_t source;      /* sl_proto_source */
    uint32_t read_us;    /* microseconds spent reading the expert, 0 for a hit */
} sl_proto_ready;

typedef struct sl_proto_slot_ref {
    uint32_t slot;       /* < slot_count */
    uint64_t generation; /* as READY gave it */
} sl_proto_slot_ref;

/* [5, arena_epoch, [[slot, generation] x n_slot]] */
typedef struct sl_proto_release {
    uint64_t arena_epoch; /* the epoch of WELCOME, >= 1 */
    uint32_t n_slot;      /* entries used in slot[], 1..SL_PROTO_RELEASE_MAX */
    sl_proto_slot_ref slot[SL_PROTO_RELEASE_MAX]; /* one pin each; a slot may repeat */
} sl_proto_release;

/* [6, req] */
typedef struct sl_proto_stats {
    uint64_t req; /* >= 1, echoed in STATS_REPLY */
} sl_proto_stats;

/* [7, req, uptime_ms, hits, misses, bytes_read, prefetch_dropped, read_errors, queue_depth,
 *  in_flight, pinned, [hist x 16]]; counters are cumulative since the fetcher started. */
typedef struct sl_proto_stats_reply {
    uint64_t req;              /* the STATS it answers */
    uint64_t uptime_ms;        /* since the fetcher started */
    uint64_t hits;             /* demanded experts found in the arena */
    uint64_t misses;           /* experts read from disk (demand and prefetch) */
    uint64_t bytes_read;       /* bytes read from shards */
    uint64_t prefetch_dropped; /* prefetched experts dropped before their read */
    uint64_t read_errors;      /* failed expert reads */
    uint32_t queue_depth;      /* experts waiting for a reader now */
    uint32_t in_flight;        /* experts taken by a reader, not yet published */
    uint32_t pinned;           /* slots pinned by clients now (all clients, counted once) */
    uint64_t hist[SL_PROTO_HIST_BUCKETS]; /* reads by latency, see SL_PROTO_HIST_BASE_US */
} sl_proto_stats_reply;

/* [8, seq, sent_ns] */
typedef struct sl_proto_ping {
    uint64_t seq;     /* increases by one per PING of the sender */
    uint64_t sent_ns; /* sender's CLOCK_MONOTONIC at sending */
} sl_proto_ping;

/* [9, seq, echo_ns] */
typedef struct sl_proto_pong {
    uint64_t seq;     /* the PING's seq */
    uint64_t echo_ns; /* the PING's sent_ns, unchanged */
} sl_proto_pong;

/* [10, req, code, text] */
typedef struct sl_proto_error {
    uint64_t req;                     /* the refused request, 0 when none (an undecodable frame) */
    uint16_t code;                    /* sl_proto_errcode */
    char text[SL_PROTO_TEXT_MAX + 1]; /* UTF-8 without control characters, NUL-ended */
} sl_proto_error;

/* One message. type selects the member of the union; [11] (BYE) has no fields. */
typedef struct sl_proto_msg {
    sl_proto_type type;
    union {
        sl_proto_hello hello;
        sl_proto_welcome welcome;
        sl_proto_fetch fetch;
        sl_proto_ready ready;
        sl_proto_release release;
        sl_proto_stats stats;
        sl_proto_stats_reply stats_reply;
        sl_proto_ping ping;
        sl_proto_pong pong;
        sl_proto_error error;
    };
} sl_proto_msg;

/* What a message's layer, expert and slot numbers must stay below: the fetcher's model and
 * arena, or for a client what WELCOME said. All three are >= 1. */
typedef struct sl_proto_limits {
    uint32_t n_layer;
    uint32_t n_expert;
    uint32_t slot_count;
} sl_proto_limits;

/* Encodes m into buf[0..cap) and sets *len. Fails with SL_EINVAL when m breaks a rule of
 * docs/protocol.md (the message says which) and SL_ENOSPACE when cap is too small; a buffer
 * of SL_PROTO_FRAME_MAX bytes always suffices. Allocates nothing. */
int sl_proto_encode(const sl_proto_msg *m, void *buf, size_t cap, size_t *len, sl_err *err);

/* Decodes the frame buf[0..len) into *out, which it zeroes first. Fails with
 *  SL_EFORMAT       the frame is not a valid message (size, msgpack structure, trailing bytes,
 *                   arity, field types, widths, lengths, enum values, duplicates),
 *  SL_EUNSUPPORTED  a well-formed [type, ...] array whose type is unknown,
 *  SL_EMISMATCH     a HELLO or WELCOME of another protocol version; out->type and
 *                   out->hello.version / out->welcome.version are then set,
 *  SL_ENOMEM        msgpack-c ran out of memory,
 * with a message naming the message type and the field. Any thread. Costs one pass over the
 * frame plus msgpack-c's zone (two mallocs, never more than 24 bytes per frame byte plus one
 * 8 KiB chunk), freed before it returns. */
int sl_proto_decode(const void *buf, size_t len, sl_proto_msg *out, sl_err *err);

/* Checks the context-dependent ranges of a decoded message against lim: FETCH layer and
 * experts, READY layer, expert and slot, RELEASE slots. Other types always pass. Returns 0 or
 * SL_EINVAL with a message naming the request and the value. */
int sl_proto_check(const sl_proto_msg *m, const sl_proto_limits *lim, sl_err *err);

/* The ERROR code that answers a failure of sl_proto_decode() or sl_proto_check(). */
uint16_t sl_proto_err_from_status(int status);

/* Bit mask of SL_PROTO_FROM_CLIENT / SL_PROTO_FROM_FETCHER: who may send this type (0 for
 * an unknown type). A receiver answers a type its peer may not send with ERROR UNEXPECTED. */
int sl_proto_direction(int type);

/* "FETCH", "ERR_BUSY"-style names for logs; "?" for unknown values. */
const char *sl_proto_type_name(int type);
const char *sl_proto_err_name(int code);

/* Copies src into text as valid ERROR text: at most SL_PROTO_TEXT_MAX bytes, cut on a UTF-8
 * character boundary, invalid bytes and control characters replaced by '?'. For building
 * ERROR messages out of sl_err messages or strerror(). */
void sl_proto_set_text(char text[SL_PROTO_TEXT_MAX + 1], const char *src);

/* The STATS_REPLY histogram bucket of a read that took read_us microseconds. */
int sl_proto_hist_bucket(uint64_t read_us);

/* Test support, deterministic for a given *seed (updated in place; any value is fine).
 * sl_proto_random_msg() fills *m with a valid message of a random type with random fields,
 * boundary values included. sl_proto_random_frame() writes at most cap bytes of hostile input
 * into buf and returns its length: random bytes, or the encoding of a random message mutated
 * by bit flips, byte overwrites, truncation, insertion, deletion and duplication (now and
 * then left valid). Used by the codec tests and the fetcher's socket test. */
void sl_proto_random_msg(uint64_t *seed, sl_proto_msg *m);
size_t sl_proto_random_frame(uint64_t *seed, void *buf, size_t cap);

#endif
