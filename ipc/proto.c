/* proto.c - msgpack codec of the control protocol (docs/protocol.md is the specification).
 *
 * Encoding packs straight into the caller's buffer through a msgpack-c packer whose write
 * callback refuses to overflow, so it allocates nothing. Decoding runs in three steps:
 *  1. scan_frame() walks the raw bytes once and proves that they hold exactly one complete
 *     msgpack object, nested at most SL_PROTO_DEPTH_MAX deep, whose containers declare no
 *     more elements than there are bytes left. msgpack-c allocates every array up front from
 *     its declared count, so without this step a 5-byte frame could ask for 64 GiB.
 *  2. msgpack-c unpacks the frame into a zone owned by a msgpack_unpacked (strings point into
 *     the frame, so the zone holds at most 24 bytes per byte of input).
 *  3. The per-type decoders read each field with an explicit msgpack type and integer width,
 *     then validate() applies the rules that encoding applies too.
 * Every function here is reentrant; nothing is global but constant tables.
 */
#include "proto.h"

#include <inttypes.h>
#include <msgpack.h>
#include <stdio.h>
#include <string.h>

/* ---- names ---- */

static const char *const type_names[SL_PROTO_TYPE_MAX + 1] = {
    [SL_PROTO_HELLO] = "HELLO",
    [SL_PROTO_WELCOME] = "WELCOME",
    [SL_PROTO_FETCH] = "FETCH",
    [SL_PROTO_READY] = "READY",
    [SL_PROTO_RELEASE] = "RELEASE",
    [SL_PROTO_STATS] = "STATS",
    [SL_PROTO_STATS_REPLY] = "STATS_REPLY",
    [SL_PROTO_PING] = "PING",
    [SL_PROTO_PONG] = "PONG",
    [SL_PROTO_ERROR] = "ERROR",
    [SL_PROTO_BYE] = "BYE",
};

static const char *const err_names[SL_PROTO_ERR_MAX + 1] = {
    [SL_PROTO_ERR_BAD_MESSAGE] = "ERR_BAD_MESSAGE",
    [SL_PROTO_ERR_UNKNOWN_TYPE] = "ERR_UNKNOWN_TYPE",
    [SL_PROTO_ERR_OUT_OF_RANGE] = "ERR_OUT_OF_RANGE",
    [SL_PROTO_ERR_VERSION] = "ERR_VERSION",
    [SL_PROTO_ERR_MODEL] = "ERR_MODEL",
    [SL_PROTO_ERR_NOT_READY] = "ERR_NOT_READY",
    [SL_PROTO_ERR_UNEXPECTED] = "ERR_UNEXPECTED",
    [SL_PROTO_ERR_BUSY] = "ERR_BUSY",
    [SL_PROTO_ERR_IO] = "ERR_IO",
    [SL_PROTO_ERR_STALE] = "ERR_STALE",
    [SL_PROTO_ERR_INTERNAL] = "ERR_INTERNAL",
};

const char *sl_proto_type_name(int type)
{
    return type >= 1 && type <= SL_PROTO_TYPE_MAX ? type_names[type] : "?";
}

const char *sl_proto_err_name(int code)
{
    return code >= 1 && code <= SL_PROTO_ERR_MAX ? err_names[code] : "?";
}

int sl_proto_direction(int type)
{
    switch (type) {
    case SL_PROTO_HELLO:
    case SL_PROTO_FETCH:
    case SL_PROTO_RELEASE:
    case SL_PROTO_STATS:
        return SL_PROTO_FROM_CLIENT;
    case SL_PROTO_WELCOME:
    case SL_PROTO_READY:
    case SL_PROTO_STATS_REPLY:
        return SL_PROTO_FROM_FETCHER;
    case SL_PROTO_PING:
    case SL_PROTO_PONG:
    case SL_PROTO_ERROR:
    case SL_PROTO_BYE:
        return SL_PROTO_FROM_CLIENT | SL_PROTO_FROM_FETCHER;
    }
    return 0;
}

uint16_t sl_proto_err_from_status(int status)
{
    switch (status) {
    case SL_EFORMAT:
        return SL_PROTO_ERR_BAD_MESSAGE;
    case SL_EUNSUPPORTED:
        return SL_PROTO_ERR_UNKNOWN_TYPE;
    case SL_EMISMATCH:
        return SL_PROTO_ERR_VERSION;
    case SL_EINVAL:
        return SL_PROTO_ERR_OUT_OF_RANGE;
    case SL_EIO:
        return SL_PROTO_ERR_IO;
    }
    return SL_PROTO_ERR_INTERNAL;
}

int sl_proto_hist_bucket(uint64_t read_us)
{
    int b = 0;
    for (uint64_t lim = SL_PROTO_HIST_BASE_US; b < SL_PROTO_HIST_BUCKETS - 1 && read_us >= lim;
         lim <<= 1)
        b++;
    return b;
}

/* ---- text rules shared by encoder, decoder and sl_proto_set_text() ---- */

/* Length (1..4) of the UTF-8 character at s[0..n) if it is well formed (shortest form, no
 * surrogate, <= U+10FFFF) and not a C0 or C1 control character or DEL; 0 otherwise. */
static size_t utf8_char(const uint8_t *s, size_t n)
{
    uint8_t c = s[0];
    if (c < 0x80) return c >= 0x20 && c != 0x7f ? 1 : 0;
    size_t len;
    uint32_t cp, min;
    if ((c & 0xe0) == 0xc0) {
        len = 2, cp = c & 0x1f, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
        len = 3, cp = c & 0x0f, min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
        len = 4, cp = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (len > n) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3fu);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    if (cp <= 0x9f) return 0; /* C1 controls U+0080..U+009F */
    return len;
}

/* Offset of the first byte of s[0..n) that is not valid ERROR text, or n. */
static size_t text_bad_at(const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        size_t k = utf8_char(u + i, n - i);
        if (!k) return i;
        i += k;
    }
    return n;
}

void sl_proto_set_text(char text[SL_PROTO_TEXT_MAX + 1], const char *src)
{
    const uint8_t *s = (const uint8_t *)(src ? src : "");
    size_t n = strlen((const char *)s), i = 0, o = 0;
    while (i < n) {
        size_t k = utf8_char(s + i, n - i);
        if (!k) {
            if (o + 1 > SL_PROTO_TEXT_MAX) break;
            text[o++] = '?';
            i++;
            continue;
        }
        if (o + k > SL_PROTO_TEXT_MAX) break;
        memcpy(text + o, s + i, k);
        o += k;
        i += k;
    }
    text[o] = '\0';
}

static int is_alnum(int c)
{
    return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

/* NULL if name[0..n) is a valid arena name, else what is wrong with it (into why). */
static const char *arena_name_problem(const char *name, size_t n, char *why, size_t cap)
{
    if (n < 2 || n > SL_PROTO_ARENA_NAME_MAX) {
        snprintf(why, cap, "length %zu, must be 2..%d", n, SL_PROTO_ARENA_NAME_MAX);
        return why;
    }
    if (name[0] != '/') return "must start with '/'";
    if (!is_alnum((unsigned char)name[1])) return "must start with '/' and a letter or digit";
    for (size_t i = 2; i < n; i++) {
        int c = (unsigned char)name[i];
        if (!is_alnum(c) && c != '.' && c != '_' && c != '-') {
            snprintf(why, cap, "byte 0x%02x at %zu is not one of A-Z a-z 0-9 . _ -", c, i);
            return why;
        }
    }
    return NULL;
}

/* ---- context-free rules, applied by encode (code SL_EINVAL) and decode (SL_EFORMAT) ---- */

static int validate(const sl_proto_msg *m, int code, sl_err *err)
{
    switch (m->type) {
    case SL_PROTO_HELLO: {
        const sl_proto_hello *h = &m->hello;
        if (h->version != SL_PROTO_VERSION)
            return sl_err_set(err, code, "HELLO: version %" PRIu32 ", this build speaks %d",
                              h->version, SL_PROTO_VERSION);
        if (h->client_kind != SL_PROTO_CLIENT_COMPUTE && h->client_kind != SL_PROTO_CLIENT_MONITOR)
            return sl_err_set(err, code, "HELLO: client_kind %u, must be 1 or 2", h->client_kind);
        return 0;
    }
    case SL_PROTO_WELCOME: {
        const sl_proto_welcome *w = &m->welcome;
        char why[96];
        if (w->version != SL_PROTO_VERSION)
            return sl_err_set(err, code, "WELCOME: version %" PRIu32 ", this build speaks %d",
                              w->version, SL_PROTO_VERSION);
        if (w->fingerprint == 0) return sl_err_set(err, code, "WELCOME: fingerprint is 0");
        size_t n = strnlen(w->arena_name, sizeof w->arena_name);
        const char *p = arena_name_problem(w->arena_name, n, why, sizeof why);
        if (p) return sl_err_set(err, code, "WELCOME: arena_name: %s", p);
        if (w->arena_epoch == 0) return sl_err_set(err, code, "WELCOME: arena_epoch is 0");
        if (w->slot_bytes == 0 || w->slot_bytes % SL_PROTO_SLOT_ALIGN)
            return sl_err_set(err, code,
                              "WELCOME: slot_bytes %" PRIu64 " is not a positive multiple of %d",
                              w->slot_bytes, SL_PROTO_SLOT_ALIGN);
        if (w->slot_count == 0) return sl_err_set(err, code, "WELCOME: slot_count is 0");
        if (w->slot_count > UINT64_MAX / w->slot_bytes)
            return sl_err_set(err, code,
                              "WELCOME: slot_count %" PRIu32 " x slot_bytes %" PRIu64
                              " overflows 64 bits",
                              w->slot_count, w->slot_bytes);
        if (w->n_layer == 0) return sl_err_set(err, code, "WELCOME: n_layer is 0");
        if (w->n_expert == 0) return sl_err_set(err, code, "WELCOME: n_expert is 0");
        for (int i = 0; i < SL_PROTO_N_PART; i++) {
            uint64_t o = w->part_off[i];
            if (o % SL_PROTO_SLOT_ALIGN || o >= w->slot_bytes)
                return sl_err_set(err, code,
                                  "WELCOME: part_off[%d] %" PRIu64
                                  " is not a multiple of %d below slot_bytes %" PRIu64,
                                  i, o, SL_PROTO_SLOT_ALIGN, w->slot_bytes);
            if (i > 0 && o <= w->part_off[i - 1])
                return sl_err_set(err, code,
                                  "WELCOME: part_off[%d] %" PRIu64
                                  " is not above part_off[%d] %" PRIu64,
                                  i, o, i - 1, w->part_off[i - 1]);
        }
        return 0;
    }
    case SL_PROTO_FETCH: {
        const sl_proto_fetch *f = &m->fetch;
        if (f->req == 0) return sl_err_set(err, code, "FETCH: req is 0");
        if (f->n_expert == 0 || f->n_expert > SL_PROTO_FETCH_MAX)
            return sl_err_set(err, code,
                              "FETCH req %" PRIu64 ": %" PRIu32 " experts, must be 1..%d", f->req,
                              f->n_expert, SL_PROTO_FETCH_MAX);
        if (f->priority != SL_PROTO_DEMAND && f->priority != SL_PROTO_PREFETCH)
            return sl_err_set(err, code, "FETCH req %" PRIu64 ": priority %u, must be 0 or 1",
                              f->req, f->priority);
        for (uint32_t i = 1; i < f->n_expert; i++)
            for (uint32_t j = 0; j < i; j++)
                if (f->expert[i] == f->expert[j])
                    return sl_err_set(err, code,
                                      "FETCH req %" PRIu64 ": duplicate expert %" PRIu32
                                      " at %" PRIu32 " and %" PRIu32,
                                      f->req, f->expert[i], j, i);
        return 0;
    }
    case SL_PROTO_READY:
        if (m->ready.req == 0) return sl_err_set(err, code, "READY: req is 0");
        if (m->ready.source != SL_PROTO_SRC_HIT && m->ready.source != SL_PROTO_SRC_DISK)
            return sl_err_set(err, code, "READY req %" PRIu64 ": source %u, must be 0 or 1",
                              m->ready.req, m->ready.source);
        return 0;
    case SL_PROTO_RELEASE:
        if (m->release.arena_epoch == 0) return sl_err_set(err, code, "RELEASE: arena_epoch is 0");
        if (m->release.n_slot == 0 || m->release.n_slot > SL_PROTO_RELEASE_MAX)
            return sl_err_set(err, code, "RELEASE: %" PRIu32 " slots, must be 1..%d",
                              m->release.n_slot, SL_PROTO_RELEASE_MAX);
        return 0;
    case SL_PROTO_STATS:
        if (m->stats.req == 0) return sl_err_set(err, code, "STATS: req is 0");
        return 0;
    case SL_PROTO_STATS_REPLY:
        if (m->stats_reply.req == 0) return sl_err_set(err, code, "STATS_REPLY: req is 0");
        return 0;
    case SL_PROTO_ERROR: {
        const sl_proto_error *e = &m->error;
        if (e->code < 1 || e->code > SL_PROTO_ERR_MAX)
            return sl_err_set(err, code, "ERROR: code %u, must be 1..%d", e->code,
                              SL_PROTO_ERR_MAX);
        size_t n = strnlen(e->text, sizeof e->text);
        if (n > SL_PROTO_TEXT_MAX)
            return sl_err_set(err, code, "ERROR: text longer than %d bytes", SL_PROTO_TEXT_MAX);
        size_t bad = text_bad_at(e->text, n);
        if (bad < n)
            return sl_err_set(err, code,
                              "ERROR: text: byte 0x%02x at %zu is not valid UTF-8 or is a "
                              "control character",
                              (unsigned char)e->text[bad], bad);
        return 0;
    }
    case SL_PROTO_PING:
    case SL_PROTO_PONG:
    case SL_PROTO_BYE:
        return 0;
    }
    return sl_err_set(err, code, "message type %d is unknown", (int)m->type);
}

/* ---- encoder ---- */

typedef struct wbuf {
    uint8_t *p;
    size_t cap, len;
    int overflow;
} wbuf;

static int wbuf_write(void *data, const char *buf, size_t n)
{
    wbuf *w = data;
    if (n == 0) return 0;
    if (w->overflow || n > w->cap - w->len) {
        w->overflow = 1;
        return -1;
    }
    memcpy(w->p + w->len, buf, n);
    w->len += n;
    return 0;
}

/* Opens the message array: arity counts the type tag. Overflow is checked once at the end. */
static void put_head(msgpack_packer *pk, int type, size_t arity)
{
    msgpack_pack_array(pk, arity);
    msgpack_pack_uint64(pk, (uint64_t)type);
}

static void put_u(msgpack_packer *pk, uint64_t v)
{
    msgpack_pack_uint64(pk, v);
}

static void put_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

int sl_proto_encode(const sl_proto_msg *m, void *buf, size_t cap, size_t *len, sl_err *err)
{
    SL_ASSERT(m && len && (buf || cap == 0));
    int rc = validate(m, SL_EINVAL, err);
    if (rc) return rc;

    wbuf w = {buf, cap, 0, 0};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &w, wbuf_write);

    switch (m->type) {
    case SL_PROTO_HELLO:
        put_head(&pk, m->type, 5);
        put_u(&pk, m->hello.version);
        put_u(&pk, m->hello.client_kind);
        put_u(&pk, m->hello.pid);
        put_u(&pk, m->hello.fingerprint);
        break;
    case SL_PROTO_WELCOME: {
        const sl_proto_welcome *x = &m->welcome;
        put_head(&pk, m->type, 10);
        put_u(&pk, x->version);
        put_u(&pk, x->fingerprint);
        put_str(&pk, x->arena_name);
        put_u(&pk, x->arena_epoch);
        put_u(&pk, x->slot_bytes);
        put_u(&pk, x->slot_count);
        put_u(&pk, x->n_layer);
        put_u(&pk, x->n_expert);
        msgpack_pack_array(&pk, SL_PROTO_N_PART);
        for (int i = 0; i < SL_PROTO_N_PART; i++) put_u(&pk, x->part_off[i]);
        break;
    }
    case SL_PROTO_FETCH:
        put_head(&pk, m->type, 5);
        put_u(&pk, m->fetch.req);
        put_u(&pk, m->fetch.layer);
        msgpack_pack_array(&pk, m->fetch.n_expert);
        for (uint32_t i = 0; i < m->fetch.n_expert; i++) put_u(&pk, m->fetch.expert[i]);
        put_u(&pk, m->fetch.priority);
        break;
    case SL_PROTO_READY: {
        const sl_proto_ready *x = &m->ready;
        put_head(&pk, m->type, 8);
        put_u(&pk, x->req);
        put_u(&pk, x->layer);
        put_u(&pk, x->expert);
        put_u(&pk, x->slot);
        put_u(&pk, x->generation);
        put_u(&pk, x->source);
        put_u(&pk, x->read_us);
        break;
    }
    case SL_PROTO_RELEASE:
        put_head(&pk, m->type, 3);
        put_u(&pk, m->release.arena_epoch);
        msgpack_pack_array(&pk, m->release.n_slot);
        for (uint32_t i = 0; i < m->release.n_slot; i++) {
            msgpack_pack_array(&pk, 2);
            put_u(&pk, m->release.slot[i].slot);
            put_u(&pk, m->release.slot[i].generation);
        }
        break;
    case SL_PROTO_STATS:
        put_head(&pk, m->type, 2);
        put_u(&pk, m->stats.req);
        break;
    case SL_PROTO_STATS_REPLY: {
        const sl_proto_stats_reply *x = &m->stats_reply;
        put_head(&pk, m->type, 12);
        put_u(&pk, x->req);
        put_u(&pk, x->uptime_ms);
        put_u(&pk, x->hits);
        put_u(&pk, x->misses);
        put_u(&pk, x->bytes_read);
        put_u(&pk, x->prefetch_dropped);
        put_u(&pk, x->read_errors);
        put_u(&pk, x->queue_depth);
        put_u(&pk, x->in_flight);
        put_u(&pk, x->pinned);
        msgpack_pack_array(&pk, SL_PROTO_HIST_BUCKETS);
        for (int i = 0; i < SL_PROTO_HIST_BUCKETS; i++) put_u(&pk, x->hist[i]);
        break;
    }
    case SL_PROTO_PING:
        put_head(&pk, m->type, 3);
        put_u(&pk, m->ping.seq);
        put_u(&pk, m->ping.sent_ns);
        break;
    case SL_PROTO_PONG:
        put_head(&pk, m->type, 3);
        put_u(&pk, m->pong.seq);
        put_u(&pk, m->pong.echo_ns);
        break;
    case SL_PROTO_ERROR:
        put_head(&pk, m->type, 4);
        put_u(&pk, m->error.req);
        put_u(&pk, m->error.code);
        put_str(&pk, m->error.text);
        break;
    case SL_PROTO_BYE:
        put_head(&pk, m->type, 1);
        break;
    }
    if (w.overflow)
        return sl_err_set(err, SL_ENOSPACE, "encode %s: does not fit in %zu bytes",
                          sl_proto_type_name(m->type), cap);
    *len = w.len;
    return 0;
}

/* ---- decoder, step 1: structure of the raw bytes ---- */

static int scan_truncated(sl_err *err, size_t len, size_t at)
{
    return sl_err_set(err, SL_EFORMAT, "frame of %zu bytes is truncated (object at offset %zu)",
                      len, at);
}

/* How the object continues after a tag byte in 0xc0..0xdf (the msgpack specification). */
typedef struct tag_rule {
    uint8_t valid;    /* 0 only for 0xc1, which msgpack never uses */
    uint8_t skip;     /* fixed payload bytes after the tag */
    uint8_t lenbytes; /* bytes of a big-endian length (str, bin, ext) or count (array, map) */
    uint8_t extra;    /* payload bytes the length does not count (the type byte of ext) */
    uint8_t kind;     /* 0 scalar, 1 array, 2 map */
} tag_rule;

static const tag_rule tag_rules[32] = {
    [0x00] = {1, 0, 0, 0, 0},  /* c0 nil */
    [0x02] = {1, 0, 0, 0, 0},  /* c2 false */
    [0x03] = {1, 0, 0, 0, 0},  /* c3 true */
    [0x04] = {1, 0, 1, 0, 0},  /* c4 bin 8 */
    [0x05] = {1, 0, 2, 0, 0},  /* c5 bin 16 */
    [0x06] = {1, 0, 4, 0, 0},  /* c6 bin 32 */
    [0x07] = {1, 0, 1, 1, 0},  /* c7 ext 8 */
    [0x08] = {1, 0, 2, 1, 0},  /* c8 ext 16 */
    [0x09] = {1, 0, 4, 1, 0},  /* c9 ext 32 */
    [0x0a] = {1, 4, 0, 0, 0},  /* ca float 32 */
    [0x0b] = {1, 8, 0, 0, 0},  /* cb float 64 */
    [0x0c] = {1, 1, 0, 0, 0},  /* cc uint 8 */
    [0x0d] = {1, 2, 0, 0, 0},  /* cd uint 16 */
    [0x0e] = {1, 4, 0, 0, 0},  /* ce uint 32 */
    [0x0f] = {1, 8, 0, 0, 0},  /* cf uint 64 */
    [0x10] = {1, 1, 0, 0, 0},  /* d0 int 8 */
    [0x11] = {1, 2, 0, 0, 0},  /* d1 int 16 */
    [0x12] = {1, 4, 0, 0, 0},  /* d2 int 32 */
    [0x13] = {1, 8, 0, 0, 0},  /* d3 int 64 */
    [0x14] = {1, 2, 0, 0, 0},  /* d4 fixext 1: type and 1 byte */
    [0x15] = {1, 3, 0, 0, 0},  /* d5 fixext 2 */
    [0x16] = {1, 5, 0, 0, 0},  /* d6 fixext 4 */
    [0x17] = {1, 9, 0, 0, 0},  /* d7 fixext 8 */
    [0x18] = {1, 17, 0, 0, 0}, /* d8 fixext 16 */
    [0x19] = {1, 0, 1, 0, 0},  /* d9 str 8 */
    [0x1a] = {1, 0, 2, 0, 0},  /* da str 16 */
    [0x1b] = {1, 0, 4, 0, 0},  /* db str 32 */
    [0x1c] = {1, 0, 2, 0, 1},  /* dc array 16 */
    [0x1d] = {1, 0, 4, 0, 1},  /* dd array 32 */
    [0x1e] = {1, 0, 2, 0, 2},  /* de map 16 */
    [0x1f] = {1, 0, 4, 0, 2},  /* df map 32 */
};

/* Proves that p[0..len) is exactly one complete msgpack object with containers nested at most
 * SL_PROTO_DEPTH_MAX deep and never declaring more elements than bytes remain. */
static int scan_frame(const uint8_t *p, size_t len, sl_err *err)
{
    uint64_t left[SL_PROTO_DEPTH_MAX + 1]; /* objects still to read per open level; 0 = frame */
    uint64_t pending = 1;                  /* sum of left[] */
    int top = 0;
    size_t pos = 0;
    left[0] = 1;
    while (top >= 0) {
        if (left[top] == 0) {
            top--;
            continue;
        }
        if (pos >= len) return scan_truncated(err, len, pos);
        left[top]--;
        pending--;
        size_t at = pos;
        uint8_t b = p[pos++];
        tag_rule r = {1, 0, 0, 0, 0}; /* positive and negative fixint: the tag is all */
        uint64_t skip, count = 0;
        if (b >= 0x80 && b <= 0x8f) {
            r.kind = 2, count = b & 0x0fu; /* fixmap */
        } else if (b >= 0x90 && b <= 0x9f) {
            r.kind = 1, count = b & 0x0fu; /* fixarray */
        } else if (b >= 0xa0 && b <= 0xbf) {
            r.skip = b & 0x1fu; /* fixstr */
        } else if (b >= 0xc0 && b <= 0xdf) {
            r = tag_rules[b - 0xc0];
            if (!r.valid)
                return sl_err_set(err, SL_EFORMAT,
                                  "byte 0x%02x at offset %zu is not a msgpack type", b, at);
        }
        skip = r.skip;
        if (r.lenbytes) {
            if (r.lenbytes > len - pos) return scan_truncated(err, len, at);
            uint64_t n = 0;
            for (int i = 0; i < r.lenbytes; i++) n = n << 8 | p[pos + (size_t)i];
            pos += r.lenbytes;
            if (r.kind)
                count = n;
            else
                skip = n + r.extra;
        }
        if (skip > len - pos) return scan_truncated(err, len, at);
        pos += (size_t)skip;
        if (r.kind) {
            if (top == SL_PROTO_DEPTH_MAX)
                return sl_err_set(err, SL_EFORMAT, "containers nested deeper than %d (offset %zu)",
                                  SL_PROTO_DEPTH_MAX, at);
            if (r.kind == 2) count *= 2;
            pending += count;
            if (pending > len - pos)
                return sl_err_set(err, SL_EFORMAT,
                                  "%s at offset %zu declares %" PRIu64
                                  " elements, the frame has %zu bytes left",
                                  r.kind == 1 ? "array" : "map", at, count, len - pos);
            left[++top] = count;
        }
    }
    if (pos != len)
        return sl_err_set(err, SL_EFORMAT,
                          "%zu trailing bytes after the message (frame of %zu bytes)", len - pos,
                          len);
    return 0;
}

/* ---- decoder, step 3: fields ---- */

static const char *obj_type_name(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        return "nil";
    case MSGPACK_OBJECT_BOOLEAN:
        return "boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        return "unsigned integer";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return "negative integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return "float";
    case MSGPACK_OBJECT_STR:
        return "str";
    case MSGPACK_OBJECT_ARRAY:
        return "array";
    case MSGPACK_OBJECT_MAP:
        return "map";
    case MSGPACK_OBJECT_BIN:
        return "bin";
    case MSGPACK_OBJECT_EXT:
        return "ext";
    }
    return "?";
}

/* The array being decoded: f[0] is the type tag, f[1..n) the fields. */
typedef struct dec {
    const msgpack_object *f;
    uint32_t n;
    const char *t; /* message type name */
    sl_err *err;
} dec;

/* Reads an unsigned integer that fits `bits` bits; on failure describes why in why[]. */
static int obj_uint(const msgpack_object *o, int bits, uint64_t *v, char *why, size_t cap)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        uint64_t max = bits == 64 ? UINT64_MAX : (UINT64_C(1) << bits) - 1;
        if (o->via.u64 > max) {
            snprintf(why, cap, "%" PRIu64 " does not fit u%d", o->via.u64, bits);
            return -1;
        }
        *v = o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        snprintf(why, cap, "negative value %" PRId64 " where u%d expected", o->via.i64, bits);
    else
        snprintf(why, cap, "expected u%d, got %s", bits, obj_type_name(o));
    return -1;
}

static int get_uint(const dec *d, uint32_t i, const char *field, int bits, uint64_t *v)
{
    char why[80];
    if (obj_uint(&d->f[i], bits, v, why, sizeof why))
        return sl_err_set(d->err, SL_EFORMAT, "%s field %" PRIu32 " (%s): %s", d->t, i, field, why);
    return 0;
}

/* The same for element j of an array field (sub names a part of the element, or is ""). */
static int get_elem(const dec *d, const msgpack_object *o, const char *field, uint32_t j,
                    const char *sub, int bits, uint64_t *v)
{
    char why[80];
    if (obj_uint(o, bits, v, why, sizeof why))
        return sl_err_set(d->err, SL_EFORMAT, "%s %s[%" PRIu32 "]%s: %s", d->t, field, j, sub, why);
    return 0;
}

#define GET_UINT(d, i, field, bits, dst)                                                           \
    do {                                                                                           \
        uint64_t v_ = 0;                                                                           \
        if (get_uint(d, i, #field, bits, &v_)) return SL_EFORMAT;                                  \
        dst = v_;                                                                                  \
    } while (0)

/* Field i must be an array of min..max elements. */
static int get_array(const dec *d, uint32_t i, const char *field, uint32_t min, uint32_t max,
                     const msgpack_object_array **a)
{
    const msgpack_object *o = &d->f[i];
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return sl_err_set(d->err, SL_EFORMAT, "%s field %" PRIu32 " (%s): expected array, got %s",
                          d->t, i, field, obj_type_name(o));
    if (o->via.array.size < min || o->via.array.size > max) {
        if (min == max)
            return sl_err_set(d->err, SL_EFORMAT,
                              "%s field %" PRIu32 " (%s): %" PRIu32 " elements, must be %" PRIu32,
                              d->t, i, field, o->via.array.size, min);
        return sl_err_set(d->err, SL_EFORMAT,
                          "%s field %" PRIu32 " (%s): %" PRIu32 " elements, must be %" PRIu32
                          "..%" PRIu32,
                          d->t, i, field, o->via.array.size, min, max);
    }
    *a = &o->via.array;
    return 0;
}

/* Field i must be a str of at most max bytes without NUL; copies it NUL-ended into dst. */
static int get_str(const dec *d, uint32_t i, const char *field, size_t max, char *dst)
{
    const msgpack_object *o = &d->f[i];
    if (o->type != MSGPACK_OBJECT_STR)
        return sl_err_set(d->err, SL_EFORMAT, "%s field %" PRIu32 " (%s): expected str, got %s",
                          d->t, i, field, obj_type_name(o));
    size_t n = o->via.str.size;
    if (n > max)
        return sl_err_set(d->err, SL_EFORMAT, "%s field %" PRIu32 " (%s): %zu bytes, at most %zu",
                          d->t, i, field, n, max);
    if (n && memchr(o->via.str.ptr, 0, n))
        return sl_err_set(d->err, SL_EFORMAT, "%s field %" PRIu32 " (%s): contains a NUL byte",
                          d->t, i, field);
    if (n) memcpy(dst, o->via.str.ptr, n);
    dst[n] = '\0';
    return 0;
}

static int arity(const dec *d, uint32_t want)
{
    if (d->n != want)
        return sl_err_set(d->err, SL_EFORMAT,
                          "%s: array of %" PRIu32 " elements, must be %" PRIu32
                          " (type and %" PRIu32 " fields)",
                          d->t, d->n, want, want - 1);
    return 0;
}

static int dec_hello(const dec *d, sl_proto_hello *h)
{
    if (arity(d, 5)) return SL_EFORMAT;
    GET_UINT(d, 1, version, 32, h->version);
    GET_UINT(d, 2, client_kind, 8, h->client_kind);
    GET_UINT(d, 3, pid, 32, h->pid);
    GET_UINT(d, 4, fingerprint, 64, h->fingerprint);
    return 0;
}

static int dec_welcome(const dec *d, sl_proto_welcome *w)
{
    const msgpack_object_array *a;
    if (arity(d, 10)) return SL_EFORMAT;
    GET_UINT(d, 1, version, 32, w->version);
    GET_UINT(d, 2, fingerprint, 64, w->fingerprint);
    if (get_str(d, 3, "arena_name", SL_PROTO_ARENA_NAME_MAX, w->arena_name)) return SL_EFORMAT;
    GET_UINT(d, 4, arena_epoch, 64, w->arena_epoch);
    GET_UINT(d, 5, slot_bytes, 64, w->slot_bytes);
    GET_UINT(d, 6, slot_count, 32, w->slot_count);
    GET_UINT(d, 7, n_layer, 32, w->n_layer);
    GET_UINT(d, 8, n_expert, 32, w->n_expert);
    if (get_array(d, 9, "part_off", SL_PROTO_N_PART, SL_PROTO_N_PART, &a)) return SL_EFORMAT;
    for (uint32_t j = 0; j < SL_PROTO_N_PART; j++)
        if (get_elem(d, &a->ptr[j], "part_off", j, "", 64, &w->part_off[j])) return SL_EFORMAT;
    return 0;
}

static int dec_fetch(const dec *d, sl_proto_fetch *f)
{
    const msgpack_object_array *a;
    if (arity(d, 5)) return SL_EFORMAT;
    GET_UINT(d, 1, req, 64, f->req);
    GET_UINT(d, 2, layer, 32, f->layer);
    if (get_array(d, 3, "experts", 1, SL_PROTO_FETCH_MAX, &a)) return SL_EFORMAT;
    for (uint32_t j = 0; j < a->size; j++) {
        uint64_t v = 0;
        if (get_elem(d, &a->ptr[j], "experts", j, "", 32, &v)) return SL_EFORMAT;
        f->expert[j] = (uint32_t)v;
    }
    f->n_expert = a->size;
    GET_UINT(d, 4, priority, 8, f->priority);
    return 0;
}

static int dec_ready(const dec *d, sl_proto_ready *r)
{
    if (arity(d, 8)) return SL_EFORMAT;
    GET_UINT(d, 1, req, 64, r->req);
    GET_UINT(d, 2, layer, 32, r->layer);
    GET_UINT(d, 3, expert, 32, r->expert);
    GET_UINT(d, 4, slot, 32, r->slot);
    GET_UINT(d, 5, generation, 64, r->generation);
    GET_UINT(d, 6, source, 8, r->source);
    GET_UINT(d, 7, read_us, 32, r->read_us);
    return 0;
}

static int dec_release(const dec *d, sl_proto_release *r)
{
    const msgpack_object_array *a;
    if (arity(d, 3)) return SL_EFORMAT;
    GET_UINT(d, 1, arena_epoch, 64, r->arena_epoch);
    if (get_array(d, 2, "slots", 1, SL_PROTO_RELEASE_MAX, &a)) return SL_EFORMAT;
    for (uint32_t j = 0; j < a->size; j++) {
        const msgpack_object *e = &a->ptr[j];
        uint64_t slot = 0;
        if (e->type != MSGPACK_OBJECT_ARRAY)
            return sl_err_set(d->err, SL_EFORMAT,
                              "RELEASE slots[%" PRIu32 "]: expected [slot, generation], got %s", j,
                              obj_type_name(e));
        if (e->via.array.size != 2)
            return sl_err_set(d->err, SL_EFORMAT,
                              "RELEASE slots[%" PRIu32 "]: expected [slot, generation], got an "
                              "array of %" PRIu32,
                              j, e->via.array.size);
        if (get_elem(d, &e->via.array.ptr[0], "slots", j, ".slot", 32, &slot)) return SL_EFORMAT;
        if (get_elem(d, &e->via.array.ptr[1], "slots", j, ".generation", 64,
                     &r->slot[j].generation))
            return SL_EFORMAT;
        r->slot[j].slot = (uint32_t)slot;
    }
    r->n_slot = a->size;
    return 0;
}

static int dec_stats_reply(const dec *d, sl_proto_stats_reply *s)
{
    const msgpack_object_array *a;
    if (arity(d, 12)) return SL_EFORMAT;
    GET_UINT(d, 1, req, 64, s->req);
    GET_UINT(d, 2, uptime_ms, 64, s->uptime_ms);
    GET_UINT(d, 3, hits, 64, s->hits);
    GET_UINT(d, 4, misses, 64, s->misses);
    GET_UINT(d, 5, bytes_read, 64, s->bytes_read);
    GET_UINT(d, 6, prefetch_dropped, 64, s->prefetch_dropped);
    GET_UINT(d, 7, read_errors, 64, s->read_errors);
    GET_UINT(d, 8, queue_depth, 32, s->queue_depth);
    GET_UINT(d, 9, in_flight, 32, s->in_flight);
    GET_UINT(d, 10, pinned, 32, s->pinned);
    if (get_array(d, 11, "hist", SL_PROTO_HIST_BUCKETS, SL_PROTO_HIST_BUCKETS, &a))
        return SL_EFORMAT;
    for (uint32_t j = 0; j < SL_PROTO_HIST_BUCKETS; j++)
        if (get_elem(d, &a->ptr[j], "hist", j, "", 64, &s->hist[j])) return SL_EFORMAT;
    return 0;
}

static int dec_error(const dec *d, sl_proto_error *e)
{
    if (arity(d, 4)) return SL_EFORMAT;
    GET_UINT(d, 1, req, 64, e->req);
    GET_UINT(d, 2, code, 16, e->code);
    if (get_str(d, 3, "text", SL_PROTO_TEXT_MAX, e->text)) return SL_EFORMAT;
    return 0;
}

/* Decodes the unpacked root object into out (already zeroed). */
static int decode_root(const msgpack_object *root, sl_proto_msg *out, sl_err *err)
{
    if (root->type != MSGPACK_OBJECT_ARRAY)
        return sl_err_set(err, SL_EFORMAT, "frame is not a message array (got %s)",
                          obj_type_name(root));
    const msgpack_object *f = root->via.array.ptr;
    uint32_t n = root->via.array.size;
    if (n == 0) return sl_err_set(err, SL_EFORMAT, "empty message array (no type)");
    uint64_t type = 0;
    char why[80];
    if (obj_uint(&f[0], 64, &type, why, sizeof why))
        return sl_err_set(err, SL_EFORMAT, "message type: %s", why);
    if (type < 1 || type > SL_PROTO_TYPE_MAX)
        return sl_err_set(err, SL_EUNSUPPORTED, "message type %" PRIu64 " is unknown (1..%d)", type,
                          SL_PROTO_TYPE_MAX);

    dec d = {f, n, sl_proto_type_name((int)type), err};
    out->type = (sl_proto_type)type;

    /* [type, version, ...] of HELLO and WELCOME is frozen across versions, so a peer of
     * another version is told so rather than that its message has the wrong shape. */
    if ((type == SL_PROTO_HELLO || type == SL_PROTO_WELCOME) && n >= 2 &&
        f[1].type == MSGPACK_OBJECT_POSITIVE_INTEGER && f[1].via.u64 <= UINT32_MAX &&
        f[1].via.u64 != SL_PROTO_VERSION) {
        out->hello.version = (uint32_t)f[1].via.u64; /* welcome.version aliases it */
        return sl_err_set(err, SL_EMISMATCH,
                          "%s: protocol version %" PRIu64 ", this build speaks %d", d.t,
                          f[1].via.u64, SL_PROTO_VERSION);
    }

    int rc = 0;
    switch (out->type) {
    case SL_PROTO_HELLO:
        rc = dec_hello(&d, &out->hello);
        break;
    case SL_PROTO_WELCOME:
        rc = dec_welcome(&d, &out->welcome);
        break;
    case SL_PROTO_FETCH:
        rc = dec_fetch(&d, &out->fetch);
        break;
    case SL_PROTO_READY:
        rc = dec_ready(&d, &out->ready);
        break;
    case SL_PROTO_RELEASE:
        rc = dec_release(&d, &out->release);
        break;
    case SL_PROTO_STATS:
        if (arity(&d, 2)) return SL_EFORMAT;
        GET_UINT(&d, 1, req, 64, out->stats.req);
        break;
    case SL_PROTO_STATS_REPLY:
        rc = dec_stats_reply(&d, &out->stats_reply);
        break;
    case SL_PROTO_PING:
        if (arity(&d, 3)) return SL_EFORMAT;
        GET_UINT(&d, 1, seq, 64, out->ping.seq);
        GET_UINT(&d, 2, sent_ns, 64, out->ping.sent_ns);
        break;
    case SL_PROTO_PONG:
        if (arity(&d, 3)) return SL_EFORMAT;
        GET_UINT(&d, 1, seq, 64, out->pong.seq);
        GET_UINT(&d, 2, echo_ns, 64, out->pong.echo_ns);
        break;
    case SL_PROTO_ERROR:
        rc = dec_error(&d, &out->error);
        break;
    case SL_PROTO_BYE:
        rc = arity(&d, 1);
        break;
    }
    if (rc) return rc;
    return validate(out, SL_EFORMAT, err);
}

int sl_proto_decode(const void *buf, size_t len, sl_proto_msg *out, sl_err *err)
{
    SL_ASSERT(out && (buf || len == 0));
    memset(out, 0, sizeof *out);
    if (len == 0) return sl_err_set(err, SL_EFORMAT, "empty frame");
    if (len > SL_PROTO_FRAME_MAX)
        return sl_err_set(err, SL_EFORMAT, "frame of %zu bytes exceeds %d", len,
                          SL_PROTO_FRAME_MAX);
    int rc = scan_frame(buf, len, err);
    if (rc) return rc;

    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    msgpack_unpack_return ur = msgpack_unpack_next(&u, buf, len, &off);
    if (ur == MSGPACK_UNPACK_NOMEM_ERROR)
        rc = sl_err_set(err, SL_ENOMEM, "msgpack_unpack_next(frame of %zu bytes): out of memory",
                        len);
    else if (ur != MSGPACK_UNPACK_SUCCESS || off != len)
        rc = sl_err_set(err, SL_EFORMAT,
                        "msgpack_unpack_next(frame of %zu bytes): result %d at offset %zu", len,
                        (int)ur, off);
    else
        rc = decode_root(&u.data, out, err);
    msgpack_unpacked_destroy(&u);

    if (rc && rc != SL_EMISMATCH) memset(out, 0, sizeof *out);
    return rc;
}

/* ---- context checks ---- */

int sl_proto_check(const sl_proto_msg *m, const sl_proto_limits *lim, sl_err *err)
{
    SL_ASSERT(m && lim && lim->n_layer && lim->n_expert && lim->slot_count);
    switch (m->type) {
    case SL_PROTO_FETCH: {
        const sl_proto_fetch *f = &m->fetch;
        if (f->layer >= lim->n_layer)
            return sl_err_set(err, SL_EINVAL,
                              "FETCH req %" PRIu64 ": layer %" PRIu32
                              " out of range (n_layer %" PRIu32 ")",
                              f->req, f->layer, lim->n_layer);
        for (uint32_t i = 0; i < f->n_expert && i < SL_PROTO_FETCH_MAX; i++)
            if (f->expert[i] >= lim->n_expert)
                return sl_err_set(err, SL_EINVAL,
                                  "FETCH req %" PRIu64 ": expert %" PRIu32
                                  " out of range (n_expert %" PRIu32 ")",
                                  f->req, f->expert[i], lim->n_expert);
        return 0;
    }
    case SL_PROTO_READY: {
        const sl_proto_ready *r = &m->ready;
        if (r->layer >= lim->n_layer || r->expert >= lim->n_expert || r->slot >= lim->slot_count)
            return sl_err_set(
                err, SL_EINVAL,
                "READY req %" PRIu64 ": layer %" PRIu32 " expert %" PRIu32 " slot %" PRIu32
                " out of range (n_layer %" PRIu32 ", n_expert %" PRIu32 ", slot_count %" PRIu32 ")",
                r->req, r->layer, r->expert, r->slot, lim->n_layer, lim->n_expert, lim->slot_count);
        return 0;
    }
    case SL_PROTO_RELEASE:
        for (uint32_t i = 0; i < m->release.n_slot && i < SL_PROTO_RELEASE_MAX; i++)
            if (m->release.slot[i].slot >= lim->slot_count)
                return sl_err_set(err, SL_EINVAL,
                                  "RELEASE: slot %" PRIu32 " out of range (slot_count %" PRIu32 ")",
                                  m->release.slot[i].slot, lim->slot_count);
        return 0;
    default:
        return 0;
    }
}

/* ---- test support: random messages and hostile frames ---- */

static uint64_t rnd(uint64_t *s)
{
    uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static uint64_t rnd_below(uint64_t *s, uint64_t n)
{
    return n ? rnd(s) % n : 0;
}

/* A value of `bits` bits, often a boundary so that every msgpack integer width appears. */
static uint64_t rnd_uint(uint64_t *s, int bits)
{
    uint64_t max = bits == 64 ? UINT64_MAX : (UINT64_C(1) << bits) - 1;
    switch (rnd_below(s, 8)) {
    case 0:
        return 0;
    case 1:
        return max;
    case 2:
        return max - rnd_below(s, 2);
    case 3:
        return rnd_below(s, 128);
    case 4: {
        static const uint64_t edge[] = {127, 128, 255, 256, 65535, 65536, 4294967295u, 4294967296u};
        uint64_t v = edge[rnd_below(s, 8)];
        return v > max ? max : v;
    }
    default:
        return rnd(s) & max;
    }
}

static void rnd_text(uint64_t *s, char text[SL_PROTO_TEXT_MAX + 1])
{
    static const char *const piece[] = {"a",
                                        "Z",
                                        "7",
                                        " ",
                                        ":",
                                        "/",
                                        "\xc3\xa9",
                                        "\xe2\x82\xac",
                                        "\xf0\x9f\x98\x80",
                                        "pread(shard 3): ",
                                        "\x7e"};
    size_t want = rnd_below(s, 2) ? rnd_below(s, 40) : SL_PROTO_TEXT_MAX, n = 0;
    while (n < want) {
        const char *p = piece[rnd_below(s, sizeof piece / sizeof piece[0])];
        size_t k = strlen(p);
        if (n + k > SL_PROTO_TEXT_MAX) break;
        memcpy(text + n, p, k);
        n += k;
    }
    text[n] = '\0';
}

static void rnd_name(uint64_t *s, char name[SL_PROTO_ARENA_NAME_MAX + 1])
{
    static const char set[] = "ABCXYZabcxyz0189._-";
    size_t n = rnd_below(s, 2) ? 2 + rnd_below(s, 20) : SL_PROTO_ARENA_NAME_MAX;
    name[0] = '/';
    name[1] = (char)('a' + rnd_below(s, 26));
    for (size_t i = 2; i < n; i++) name[i] = set[rnd_below(s, sizeof set - 1)];
    name[n] = '\0';
}

void sl_proto_random_msg(uint64_t *seed, sl_proto_msg *m)
{
    memset(m, 0, sizeof *m);
    m->type = (sl_proto_type)(1 + rnd_below(seed, SL_PROTO_TYPE_MAX));
    switch (m->type) {
    case SL_PROTO_HELLO:
        m->hello.version = SL_PROTO_VERSION;
        m->hello.client_kind = (uint8_t)(1 + rnd_below(seed, 2));
        m->hello.pid = (uint32_t)rnd_uint(seed, 32);
        m->hello.fingerprint = rnd_uint(seed, 64);
        break;
    case SL_PROTO_WELCOME: {
        sl_proto_welcome *w = &m->welcome;
        w->version = SL_PROTO_VERSION;
        w->fingerprint = rnd_uint(seed, 64) | 1;
        rnd_name(seed, w->arena_name);
        w->arena_epoch = rnd_uint(seed, 64) | 1;
        w->slot_bytes = (uint64_t)SL_PROTO_SLOT_ALIGN * (3 + rnd_below(seed, 4000));
        w->slot_count = (uint32_t)(1 + rnd_below(seed, 100000));
        w->n_layer = (uint32_t)(1 + rnd_below(seed, 64));
        w->n_expert = (uint32_t)(1 + rnd_below(seed, 512));
        uint64_t units = w->slot_bytes / SL_PROTO_SLOT_ALIGN, a = rnd_below(seed, units - 2);
        uint64_t b = a + 1 + rnd_below(seed, units - a - 2);
        uint64_t c = b + 1 + rnd_below(seed, units - b - 1);
        w->part_off[0] = a * SL_PROTO_SLOT_ALIGN;
        w->part_off[1] = b * SL_PROTO_SLOT_ALIGN;
        w->part_off[2] = c * SL_PROTO_SLOT_ALIGN;
        break;
    }
    case SL_PROTO_FETCH: {
        sl_proto_fetch *f = &m->fetch;
        f->req = rnd_uint(seed, 64) | 1;
        f->layer = (uint32_t)rnd_uint(seed, 32);
        f->n_expert = (uint32_t)(rnd_below(seed, 4) ? 1 + rnd_below(seed, 8) : SL_PROTO_FETCH_MAX);
        uint32_t base = (uint32_t)rnd_uint(seed, 32) & ~UINT32_C(0xff);
        for (uint32_t i = 0; i < f->n_expert; i++) f->expert[i] = base + i * 3; /* distinct */
        f->priority = (uint8_t)rnd_below(seed, 2);
        break;
    }
    case SL_PROTO_READY:
        m->ready.req = rnd_uint(seed, 64) | 1;
        m->ready.layer = (uint32_t)rnd_uint(seed, 32);
        m->ready.expert = (uint32_t)rnd_uint(seed, 32);
        m->ready.slot = (uint32_t)rnd_uint(seed, 32);
        m->ready.generation = rnd_uint(seed, 64);
        m->ready.source = (uint8_t)rnd_below(seed, 2);
        m->ready.read_us = (uint32_t)rnd_uint(seed, 32);
        break;
    case SL_PROTO_RELEASE:
        m->release.arena_epoch = rnd_uint(seed, 64) | 1;
        m->release.n_slot =
            (uint32_t)(rnd_below(seed, 4) ? 1 + rnd_below(seed, 12) : SL_PROTO_RELEASE_MAX);
        for (uint32_t i = 0; i < m->release.n_slot; i++) {
            m->release.slot[i].slot = (uint32_t)rnd_uint(seed, 32);
            m->release.slot[i].generation = rnd_uint(seed, 64);
        }
        break;
    case SL_PROTO_STATS:
        m->stats.req = rnd_uint(seed, 64) | 1;
        break;
    case SL_PROTO_STATS_REPLY: {
        sl_proto_stats_reply *r = &m->stats_reply;
        r->req = rnd_uint(seed, 64) | 1;
        r->uptime_ms = rnd_uint(seed, 64);
        r->hits = rnd_uint(seed, 64);
        r->misses = rnd_uint(seed, 64);
        r->bytes_read = rnd_uint(seed, 64);
        r->prefetch_dropped = rnd_uint(seed, 64);
        r->read_errors = rnd_uint(seed, 64);
        r->queue_depth = (uint32_t)rnd_uint(seed, 32);
        r->in_flight = (uint32_t)rnd_uint(seed, 32);
        r->pinned = (uint32_t)rnd_uint(seed, 32);
        for (int i = 0; i < SL_PROTO_HIST_BUCKETS; i++) r->hist[i] = rnd_uint(seed, 64);
        break;
    }
    case SL_PROTO_PING:
        m->ping.seq = rnd_uint(seed, 64);
        m->ping.sent_ns = rnd_uint(seed, 64);
        break;
    case SL_PROTO_PONG:
        m->pong.seq = rnd_uint(seed, 64);
        m->pong.echo_ns = rnd_uint(seed, 64);
        break;
    case SL_PROTO_ERROR:
        m->error.req = rnd_uint(seed, 64);
        m->error.code = (uint16_t)(1 + rnd_below(seed, SL_PROTO_ERR_MAX));
        rnd_text(seed, m->error.text);
        break;
    case SL_PROTO_BYE:
        break;
    }
}

/* Bytes that change the meaning of what follows: type tags of every width and kind. */
static const uint8_t tricky[] = {0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1,
                                 0xc2, 0xc3, 0xc4, 0xc7, 0xca, 0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0,
                                 0xd3, 0xd4, 0xd9, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff};

size_t sl_proto_random_frame(uint64_t *seed, void *buf, size_t cap)
{
    uint8_t *p = buf;
    size_t n = 0;
    if (cap == 0) return 0;
    if (rnd_below(seed, 16) == 0) { /* plain noise */
        n = rnd_below(seed, (cap < 96 ? cap : 96) + 1);
        for (size_t i = 0; i < n; i++) p[i] = (uint8_t)rnd(seed);
        return n;
    }
    sl_proto_msg m;
    sl_proto_random_msg(seed, &m);
    if (sl_proto_encode(&m, p, cap, &n, NULL)) n = 0;
    if (rnd_below(seed, 16) == 0) return n; /* left valid */

    for (uint64_t k = 1 + rnd_below(seed, 4); k > 0; k--) {
        size_t at = n ? rnd_below(seed, n) : 0, w = 1 + rnd_below(seed, 8);
        switch (rnd_below(seed, 8)) {
        case 0: /* bit flip */
            if (n) p[at] ^= (uint8_t)(1u << rnd_below(seed, 8));
            break;
        case 1: /* a tricky tag */
            if (n) p[at] = tricky[rnd_below(seed, sizeof tricky)];
            break;
        case 2: /* truncate */
            n = at;
            break;
        case 3: /* insert random or tricky bytes */
            if (w > cap - n) break;
            memmove(p + at + w, p + at, n - at);
            for (size_t i = 0; i < w; i++)
                p[at + i] = rnd_below(seed, 2) ? (uint8_t)rnd(seed)
                                               : tricky[rnd_below(seed, sizeof tricky)];
            n += w;
            break;
        case 4: /* delete */
            if (w > n - at) w = n - at;
            memmove(p + at, p + at + w, n - at - w);
            n -= w;
            break;
        case 5: /* append a copy of a piece: trailing bytes, or a second message */
            if (w > n - at) w = n - at;
            if (w > cap - n) break;
            memmove(p + n, p + at, w);
            n += w;
            break;
        case 6: /* overwrite a run with noise */
            for (size_t i = at; i < n && i < at + w; i++) p[i] = (uint8_t)rnd(seed);
            break;
        case 7: { /* insert a container header that claims a huge count */
            static const uint8_t huge[][5] = {{0xdd, 0xff, 0xff, 0xff, 0xff},
                                              {0xdf, 0x7f, 0xff, 0xff, 0xff},
                                              {0xdc, 0xff, 0xff, 0, 0},
                                              {0xdb, 0xff, 0xff, 0xff, 0xf0}};
            const uint8_t *h = huge[rnd_below(seed, 4)];
            size_t hl = h[0] == 0xdc ? 3 : 5;
            if (hl > cap - n) break;
            memmove(p + at + hl, p + at, n - at);
            memcpy(p + at, h, hl);
            n += hl;
            break;
        }
        }
    }
    return n;
}
