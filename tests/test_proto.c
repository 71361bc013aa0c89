/* test_proto.c - the control protocol codec (ipc/proto.h) against docs/protocol.md.
 *
 * Round trips of every message type at its boundaries, one rejection per rule with the
 * message it must produce, 10,000 random valid messages, 10,000 hostile frames, and the
 * byte-level examples of docs/protocol.md, read from the page itself so that the page and
 * the codec cannot drift apart. Everything is deterministic (fixed seeds) and runs in well
 * under a second.
 */
#include <criterion/criterion.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"

/* ---- helpers ---- */

static sl_proto_msg mk(sl_proto_type type)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = type;
    return m;
}

static sl_proto_msg valid_fetch(void)
{
    sl_proto_msg m = mk(SL_PROTO_FETCH);
    m.fetch.req = 1;
    m.fetch.layer = 5;
    m.fetch.n_expert = 3;
    m.fetch.expert[0] = 7;
    m.fetch.expert[1] = 42;
    m.fetch.expert[2] = 300;
    m.fetch.priority = SL_PROTO_DEMAND;
    return m;
}

static sl_proto_msg valid_welcome(void)
{
    sl_proto_msg m = mk(SL_PROTO_WELCOME);
    m.welcome.version = SL_PROTO_VERSION;
    m.welcome.fingerprint = 0x1234;
    strcpy(m.welcome.arena_name, "/sluice-1000-tiny");
    m.welcome.arena_epoch = 1;
    m.welcome.slot_bytes = 12 * 4096;
    m.welcome.slot_count = 100;
    m.welcome.n_layer = 40;
    m.welcome.n_expert = 384;
    m.welcome.part_off[0] = 0;
    m.welcome.part_off[1] = 4 * 4096;
    m.welcome.part_off[2] = 8 * 4096;
    return m;
}

static size_t enc(const sl_proto_msg *m, uint8_t *buf)
{
    size_t n = 0;
    sl_err e = {0};
    int rc = sl_proto_encode(m, buf, SL_PROTO_FRAME_MAX, &n, &e);
    cr_assert_eq(rc, 0, "encode %s: %s", sl_proto_type_name(m->type), e.msg);
    cr_assert(n > 0 && n <= SL_PROTO_FRAME_MAX);
    return n;
}

/* Encodes m, decodes it, and checks that the result is m and encodes to the same bytes. */
static void roundtrip(const sl_proto_msg *m)
{
    uint8_t a[SL_PROTO_FRAME_MAX], b[SL_PROTO_FRAME_MAX];
    size_t na = enc(m, a);
    sl_proto_msg d;
    sl_err e = {0};
    int rc = sl_proto_decode(a, na, &d, &e);
    cr_assert_eq(rc, 0, "decode %s: %s", sl_proto_type_name(m->type), e.msg);
    cr_assert_eq(memcmp(m, &d, sizeof d), 0, "%s changed in a round trip",
                 sl_proto_type_name(m->type));
    size_t nb = enc(&d, b);
    cr_assert(na == nb && memcmp(a, b, na) == 0, "%s re-encodes differently",
              sl_proto_type_name(m->type));
}

static void reject(const void *buf, size_t n, int want_rc, const char *want_msg)
{
    sl_proto_msg d;
    sl_err e = {0};
    int rc = sl_proto_decode(buf, n, &d, &e);
    cr_assert_eq(rc, want_rc, "decode returned %d (%s), expected %d; message: %s", rc,
                 sl_status_name(rc), want_rc, e.msg);
    cr_assert(strstr(e.msg, want_msg), "message \"%s\" lacks \"%s\"", e.msg, want_msg);
}

#define REJECT(want_rc, want_msg, ...)                                                             \
    do {                                                                                           \
        static const uint8_t b_[] = {__VA_ARGS__};                                                 \
        reject(b_, sizeof b_, want_rc, want_msg);                                                  \
    } while (0)

static void reject_encode(const sl_proto_msg *m, const char *want_msg)
{
    uint8_t buf[SL_PROTO_FRAME_MAX];
    size_t n = 0;
    sl_err e = {0};
    int rc = sl_proto_encode(m, buf, sizeof buf, &n, &e);
    cr_assert_eq(rc, SL_EINVAL, "encode returned %d, expected SL_EINVAL (%s)", rc, want_msg);
    cr_assert(strstr(e.msg, want_msg), "message \"%s\" lacks \"%s\"", e.msg, want_msg);
}

/* A frame built field by field with msgpack-c, for shapes the encoder refuses to make. */
typedef struct raw {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} raw;

static void raw_init(raw *r, size_t arity)
{
    msgpack_sbuffer_init(&r->sb);
    msgpack_packer_init(&r->pk, &r->sb, msgpack_sbuffer_write);
    msgpack_pack_array(&r->pk, arity);
}

static void raw_u(raw *r, uint64_t v)
{
    msgpack_pack_uint64(&r->pk, v);
}

static void raw_s(raw *r, const char *s, size_t n)
{
    msgpack_pack_str_with_body(&r->pk, s, n);
}

static void raw_reject(raw *r, int want_rc, const char *want_msg)
{
    reject(r->sb.data, r->sb.size, want_rc, want_msg);
    msgpack_sbuffer_destroy(&r->sb);
}

/* WELCOME with the given name and numbers, in wire order. */
static void raw_welcome(raw *r, uint64_t fp, const char *name, size_t name_len, uint64_t epoch,
                        uint64_t slot_bytes, uint64_t slot_count, const uint64_t off[3])
{
    raw_init(r, 10);
    raw_u(r, SL_PROTO_WELCOME);
    raw_u(r, SL_PROTO_VERSION);
    raw_u(r, fp);
    raw_s(r, name, name_len);
    raw_u(r, epoch);
    raw_u(r, slot_bytes);
    raw_u(r, slot_count);
    raw_u(r, 40);
    raw_u(r, 384);
    msgpack_pack_array(&r->pk, 3);
    for (int i = 0; i < 3; i++) raw_u(r, off[i]);
}

static void raw_error_text(const char *text, size_t n, const char *want_msg)
{
    raw r;
    raw_init(&r, 4);
    raw_u(&r, SL_PROTO_ERROR);
    raw_u(&r, 9);
    raw_u(&r, SL_PROTO_ERR_IO);
    raw_s(&r, text, n);
    raw_reject(&r, SL_EFORMAT, want_msg);
}

/* ---- round trips ---- */

Test(proto, roundtrip_every_type_at_boundaries)
{
    sl_proto_msg m = mk(SL_PROTO_HELLO);
    m.hello.version = SL_PROTO_VERSION;
    m.hello.client_kind = SL_PROTO_CLIENT_COMPUTE;
    roundtrip(&m);
    m.hello.client_kind = SL_PROTO_CLIENT_MONITOR;
    m.hello.pid = UINT32_MAX;
    m.hello.fingerprint = UINT64_MAX;
    roundtrip(&m);

    m = valid_welcome();
    roundtrip(&m);
    memset(m.welcome.arena_name, 'x', SL_PROTO_ARENA_NAME_MAX); /* the longest name */
    m.welcome.arena_name[0] = '/';
    m.welcome.arena_name[SL_PROTO_ARENA_NAME_MAX - 1] = '-';
    m.welcome.fingerprint = UINT64_MAX;
    m.welcome.arena_epoch = UINT64_MAX;
    m.welcome.slot_bytes = UINT64_MAX & ~(uint64_t)4095;
    m.welcome.slot_count = 1;
    m.welcome.n_layer = UINT32_MAX;
    m.welcome.n_expert = UINT32_MAX;
    m.welcome.part_off[2] = m.welcome.slot_bytes - 4096;
    roundtrip(&m);
    memset(m.welcome.arena_name, 0, sizeof m.welcome.arena_name); /* the shortest */
    strcpy(m.welcome.arena_name, "/0");
    roundtrip(&m);

    m = valid_fetch();
    roundtrip(&m);
    m.fetch.req = UINT64_MAX;
    m.fetch.layer = UINT32_MAX;
    m.fetch.priority = SL_PROTO_PREFETCH;
    m.fetch.n_expert = SL_PROTO_FETCH_MAX;
    for (uint32_t i = 0; i < SL_PROTO_FETCH_MAX; i++) m.fetch.expert[i] = UINT32_MAX - i;
    m.fetch.expert[SL_PROTO_FETCH_MAX - 1] = 0;
    roundtrip(&m);

    m = mk(SL_PROTO_READY);
    m.ready.req = 1;
    roundtrip(&m);
    m.ready.req = UINT64_MAX;
    m.ready.layer = m.ready.expert = m.ready.slot = m.ready.read_us = UINT32_MAX;
    m.ready.generation = UINT64_MAX;
    m.ready.source = SL_PROTO_SRC_DISK;
    roundtrip(&m);

    m = mk(SL_PROTO_RELEASE);
    m.release.arena_epoch = 1;
    m.release.n_slot = 1;
    roundtrip(&m);
    m.release.arena_epoch = UINT64_MAX;
    m.release.n_slot = SL_PROTO_RELEASE_MAX;
    for (uint32_t i = 0; i < SL_PROTO_RELEASE_MAX; i++) {
        m.release.slot[i].slot = UINT32_MAX - (i % 2); /* repeats are allowed */
        m.release.slot[i].generation = UINT64_MAX - i;
    }
    roundtrip(&m);

    m = mk(SL_PROTO_STATS);
    m.stats.req = UINT64_MAX;
    roundtrip(&m);

    m = mk(SL_PROTO_STATS_REPLY);
    m.stats_reply.req = 1;
    roundtrip(&m);
    sl_proto_stats_reply *s = &m.stats_reply;
    s->req = s->uptime_ms = s->hits = s->misses = s->bytes_read = UINT64_MAX;
    s->prefetch_dropped = s->read_errors = UINT64_MAX;
    s->queue_depth = s->in_flight = s->pinned = UINT32_MAX;
    for (int i = 0; i < SL_PROTO_HIST_BUCKETS; i++) s->hist[i] = UINT64_MAX - (uint64_t)i;
    roundtrip(&m);

    m = mk(SL_PROTO_PING);
    roundtrip(&m);
    m.ping.seq = m.ping.sent_ns = UINT64_MAX;
    roundtrip(&m);
    m = mk(SL_PROTO_PONG);
    m.pong.seq = m.pong.echo_ns = UINT64_MAX;
    roundtrip(&m);

    m = mk(SL_PROTO_ERROR);
    m.error.code = SL_PROTO_ERR_BAD_MESSAGE;
    roundtrip(&m); /* req 0, empty text */
    m.error.req = UINT64_MAX;
    m.error.code = SL_PROTO_ERR_MAX;
    size_t n = 0; /* the longest text, of 1-, 2-, 3- and 4-byte characters */
    static const char *const piece[] = {"a", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80"};
    for (int i = 0; n + 4 <= SL_PROTO_TEXT_MAX; i++) {
        memcpy(m.error.text + n, piece[i % 4], strlen(piece[i % 4]));
        n += strlen(piece[i % 4]);
    }
    while (n < SL_PROTO_TEXT_MAX) m.error.text[n++] = 'z';
    roundtrip(&m);

    m = mk(SL_PROTO_BYE);
    roundtrip(&m);
}

Test(proto, roundtrip_random_messages_and_every_prefix_rejected)
{
    uint64_t seed = 1;
    int seen[SL_PROTO_TYPE_MAX + 1] = {0};
    srand(1);
    for (int i = 0; i < 10000; i++) {
        sl_proto_msg m;
        sl_proto_random_msg(&seed, &m);
        seen[m.type]++;
        roundtrip(&m);

        uint8_t buf[SL_PROTO_FRAME_MAX];
        size_t n = enc(&m, buf), got;
        sl_err e = {0};
        cr_assert_eq(sl_proto_encode(&m, buf, n - 1, &got, &e), SL_ENOSPACE,
                     "encode into %zu bytes of %zu", n - 1, n);
        /* every proper prefix of the first 2000, four random ones of the rest */
        for (size_t j = 0; j < (i < 2000 ? n : 4); j++) {
            size_t k = i < 2000 ? j : (size_t)rand() % n;
            sl_proto_msg d;
            cr_assert_eq(sl_proto_decode(buf, k, &d, &e), SL_EFORMAT, "%s prefix %zu of %zu",
                         sl_proto_type_name(m.type), k, n);
        }
    }
    for (int t = 1; t <= SL_PROTO_TYPE_MAX; t++)
        cr_assert(seen[t] > 500, "type %d drawn %d times", t, seen[t]);
}

Test(proto, non_canonical_integers_accepted)
{
    /* A client in another language may encode small values in wide or signed formats; the
     * decoder takes any msgpack integer format whose value fits. */
    static const uint8_t wide[] = {
        0xdc, 0x00, 0x05,                                  /* array 16 of 5 */
        0xcf, 0,    0,    0, 0,    0,    0,    0,    0x03, /* type as uint 64 */
        0xd3, 0,    0,    0, 0,    0,    0,    0,    0x01, /* req as int 64 */
        0xd0, 0x05,                                        /* layer as int 8 */
        0xdd, 0,    0,    0, 0x03, 0xcc, 0x07, 0xd1, 0x00,
        0x2a, 0xce, 0,    0, 0x01, 0x2c, /* experts */
        0xcc, 0x00,                      /* priority as uint 8 */
    };
    sl_proto_msg d, want = valid_fetch();
    sl_err e = {0};
    cr_assert_eq(sl_proto_decode(wide, sizeof wide, &d, &e), 0, "%s", e.msg);
    cr_assert_eq(memcmp(&d, &want, sizeof d), 0);

    /* The largest frame any v1 message can take: RELEASE of 128 slots with every integer as
     * uint 64 and every array as array 32 (the bound SL_PROTO_FRAME_MAX is chosen above). */
    static uint8_t big[2972];
    size_t n = 0;
    uint8_t *p = big;
#define PUT32HDR(cnt) (p[n++] = 0xdd, p[n++] = 0, p[n++] = 0, p[n++] = 0, p[n++] = (cnt))
#define PUT64(v)                                                                                   \
    do {                                                                                           \
        p[n++] = 0xcf;                                                                             \
        for (int s_ = 56; s_ >= 0; s_ -= 8) p[n++] = (uint8_t)((uint64_t)(v) >> s_);               \
    } while (0)
    PUT32HDR(3);
    PUT64(SL_PROTO_RELEASE);
    PUT64(7);
    PUT32HDR(SL_PROTO_RELEASE_MAX);
    for (int i = 0; i < SL_PROTO_RELEASE_MAX; i++) {
        PUT32HDR(2);
        PUT64(i);
        PUT64(UINT64_MAX);
    }
#undef PUT32HDR
#undef PUT64
    cr_assert_eq(n, sizeof big);
    cr_assert_eq(sl_proto_decode(big, n, &d, &e), 0, "%s", e.msg);
    cr_assert_eq(d.release.n_slot, SL_PROTO_RELEASE_MAX);
    cr_assert_eq(d.release.slot[127].slot, 127);
    cr_assert_eq(d.release.slot[127].generation, UINT64_MAX);
}

/* ---- rejections: frame level ---- */

Test(proto, reject_frame_shape)
{
    reject(NULL, 0, SL_EFORMAT, "empty frame");
    static uint8_t over[SL_PROTO_FRAME_MAX + 1];
    reject(over, sizeof over, SL_EFORMAT, "frame of 8193 bytes exceeds 8192");

    REJECT(SL_EFORMAT, "not a message array (got map)", 0x80);
    REJECT(SL_EFORMAT, "not a message array (got unsigned integer)", 0x03);
    REJECT(SL_EFORMAT, "not a message array (got str)", 0xa1, 'A');
    REJECT(SL_EFORMAT, "not a message array (got nil)", 0xc0);
    REJECT(SL_EFORMAT, "empty message array", 0x90);

    /* trailing bytes: a byte, then a whole second message */
    REJECT(SL_EFORMAT, "1 trailing bytes", 0x95, 0x03, 0x01, 0x05, 0x93, 0x07, 0x2a, 0xcd, 0x01,
           0x2c, 0x00, 0x00);
    REJECT(SL_EFORMAT, "1 trailing bytes", 0x91, 0x0b, 0x91);
    REJECT(SL_EFORMAT, "2 trailing bytes", 0x91, 0x0b, 0x91, 0x0b);

    /* truncated: in the middle of a uint 16, and before the last field */
    REJECT(SL_EFORMAT, "truncated", 0x95, 0x03, 0x01, 0x05, 0x93, 0x07, 0x2a, 0xcd, 0x01);
    REJECT(SL_EFORMAT, "truncated (object at offset 10)", 0x95, 0x03, 0x01, 0x05, 0x93, 0x07, 0x2a,
           0xcd, 0x01, 0x2c);
    REJECT(SL_EFORMAT, "truncated", 0x92, 0x03, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a');

    /* never a msgpack tag */
    REJECT(SL_EFORMAT, "byte 0xc1 at offset 1 is not a msgpack type", 0x91, 0xc1);

    /* counts that would make msgpack-c allocate gigabytes are refused before it runs */
    REJECT(SL_EFORMAT, "array at offset 0 declares 4294967295 elements", 0xdd, 0xff, 0xff, 0xff,
           0xff);
    REJECT(SL_EFORMAT, "map at offset 1 declares 8589934590 elements", 0x92, 0xdf, 0xff, 0xff, 0xff,
           0xff, 0x00);
    REJECT(SL_EFORMAT, "declares 65535 elements", 0x95, 0x03, 0x01, 0x05, 0xdc, 0xff, 0xff, 0x00);

    /* nesting */
    REJECT(SL_EFORMAT, "nested deeper than 3", 0x91, 0x91, 0x91, 0x91, 0x00);
    REJECT(SL_EFORMAT, "nested deeper than 3", 0x91, 0x91, 0x91, 0x90);
}

/* ---- rejections: type tag and arity ---- */

Test(proto, reject_type_tag)
{
    REJECT(SL_EUNSUPPORTED, "message type 0 is unknown", 0x91, 0x00);
    REJECT(SL_EUNSUPPORTED, "message type 12 is unknown", 0x91, 0x0c);
    REJECT(SL_EUNSUPPORTED, "message type 255 is unknown", 0x92, 0xcc, 0xff, 0x01);
    REJECT(SL_EUNSUPPORTED, "message type 18446744073709551615 is unknown", 0x91, 0xcf, 0xff, 0xff,
           0xff, 0xff, 0xff, 0xff, 0xff, 0xff);
    REJECT(SL_EFORMAT, "message type: expected u64, got str", 0x91, 0xa1, '3');
    REJECT(SL_EFORMAT, "message type: negative value -1 where u64 expected", 0x91, 0xff);
    REJECT(SL_EFORMAT, "message type: expected u64, got float", 0x91, 0xca, 0x40, 0x40, 0, 0);
    REJECT(SL_EFORMAT, "message type: expected u64, got array", 0x91, 0x90);
    REJECT(SL_EFORMAT, "message type: expected u64, got boolean", 0x91, 0xc3);
}

Test(proto, reject_arity)
{
    REJECT(SL_EFORMAT, "FETCH: array of 4 elements, must be 5", 0x94, 0x03, 0x01, 0x05, 0x91, 0x07);
    REJECT(SL_EFORMAT, "FETCH: array of 6 elements, must be 5", 0x96, 0x03, 0x01, 0x05, 0x91, 0x07,
           0x00, 0x00);
    REJECT(SL_EFORMAT, "HELLO: array of 1 elements, must be 5", 0x91, 0x01);
    REJECT(SL_EFORMAT, "HELLO: array of 4 elements, must be 5", 0x94, 0x01, 0x01, 0x01, 0x00);
    REJECT(SL_EFORMAT, "WELCOME: array of 2 elements, must be 10", 0x92, 0x02, 0x01);
    REJECT(SL_EFORMAT, "READY: array of 7 elements, must be 8", 0x97, 0x04, 1, 1, 1, 1, 1, 1);
    REJECT(SL_EFORMAT, "RELEASE: array of 2 elements, must be 3", 0x92, 0x05, 0x01);
    REJECT(SL_EFORMAT, "STATS: array of 1 elements, must be 2", 0x91, 0x06);
    REJECT(SL_EFORMAT, "STATS_REPLY: array of 2 elements, must be 12", 0x92, 0x07, 0x01);
    REJECT(SL_EFORMAT, "PING: array of 2 elements, must be 3", 0x92, 0x08, 0x01);
    REJECT(SL_EFORMAT, "PONG: array of 4 elements, must be 3", 0x94, 0x09, 1, 1, 1);
    REJECT(SL_EFORMAT, "ERROR: array of 3 elements, must be 4", 0x93, 0x0a, 0x00, 0x01);
    REJECT(SL_EFORMAT, "BYE: array of 2 elements, must be 1", 0x92, 0x0b, 0x00);
}

/* ---- rejections: fields ---- */

Test(proto, reject_field_types_and_widths)
{
    REJECT(SL_EFORMAT, "FETCH field 2 (layer): expected u32, got str", 0x95, 0x03, 0x01, 0xa1, '5',
           0x91, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 2 (layer): expected u32, got nil", 0x95, 0x03, 0x01, 0xc0, 0x91,
           0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 2 (layer): expected u32, got boolean", 0x95, 0x03, 0x01, 0xc3,
           0x91, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 1 (req): expected u64, got float", 0x95, 0x03, 0xcb, 0x3f, 0xf0,
           0, 0, 0, 0, 0, 0, 0x05, 0x91, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 3 (experts): expected array, got unsigned integer", 0x95, 0x03,
           0x01, 0x05, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 3 (experts): expected array, got map", 0x95, 0x03, 0x01, 0x05,
           0x81, 0x07, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH experts[0]: expected u32, got str", 0x95, 0x03, 0x01, 0x05, 0x91,
           0xa1, '7', 0x00);
    REJECT(SL_EFORMAT, "FETCH field 4 (priority): expected u8, got ext", 0x95, 0x03, 0x01, 0x05,
           0x91, 0x07, 0xd4, 0x01, 0x00);
    REJECT(SL_EFORMAT, "ERROR field 3 (text): expected str, got bin", 0x94, 0x0a, 0x00, 0x01, 0xc4,
           0x01, 'A');
    REJECT(SL_EFORMAT, "WELCOME field 3 (arena_name): expected str, got unsigned integer", 0x9a,
           0x02, 0x01, 0x01, 0x07, 0x01, 0xcd, 0x30, 0x00, 0x01, 0x01, 0x01, 0x93, 0x00, 0xcd, 0x10,
           0x00, 0xcd, 0x20, 0x00);

    /* negative where unsigned */
    REJECT(SL_EFORMAT, "FETCH field 2 (layer): negative value -1 where u32 expected", 0x95, 0x03,
           0x01, 0xff, 0x91, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 1 (req): negative value -128 where u64 expected", 0x95, 0x03,
           0xd0, 0x80, 0x05, 0x91, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH experts[1]: negative value -2 where u32 expected", 0x95, 0x03, 0x01,
           0x05, 0x92, 0x07, 0xd0, 0xfe, 0x00);
    REJECT(SL_EFORMAT, "PING field 2 (sent_ns): negative value -9223372036854775808", 0x93, 0x08,
           0x01, 0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0);

    /* too wide for the field */
    REJECT(SL_EFORMAT, "FETCH field 2 (layer): 4294967296 does not fit u32", 0x95, 0x03, 0x01, 0xcf,
           0, 0, 0, 0x01, 0, 0, 0, 0, 0x91, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH field 4 (priority): 256 does not fit u8", 0x95, 0x03, 0x01, 0x05,
           0x91, 0x07, 0xcd, 0x01, 0x00);
    REJECT(SL_EFORMAT, "ERROR field 2 (code): 65536 does not fit u16", 0x94, 0x0a, 0x00, 0xce, 0,
           0x01, 0, 0, 0xa0);
    REJECT(SL_EFORMAT, "HELLO field 2 (client_kind): 256 does not fit u8", 0x95, 0x01, 0x01, 0xcd,
           0x01, 0x00, 0x01, 0x00);
    REJECT(SL_EFORMAT, "RELEASE slots[0].slot: 4294967296 does not fit u32", 0x93, 0x05, 0x01, 0x91,
           0x92, 0xcf, 0, 0, 0, 0x01, 0, 0, 0, 0, 0x00);
    REJECT(SL_EFORMAT, "RELEASE slots[0].generation: expected u64, got str", 0x93, 0x05, 0x01, 0x91,
           0x92, 0x01, 0xa0);
}

Test(proto, reject_fetch_rules)
{
    REJECT(SL_EFORMAT, "FETCH field 3 (experts): 0 elements, must be 1..64", 0x95, 0x03, 0x01, 0x05,
           0x90, 0x00);
    REJECT(SL_EFORMAT, "FETCH req 1: duplicate expert 7 at 0 and 2", 0x95, 0x03, 0x01, 0x05, 0x93,
           0x07, 0x2a, 0x07, 0x00);
    REJECT(SL_EFORMAT, "FETCH req 1: priority 2, must be 0 or 1", 0x95, 0x03, 0x01, 0x05, 0x91,
           0x07, 0x02);
    REJECT(SL_EFORMAT, "FETCH: req is 0", 0x95, 0x03, 0x00, 0x05, 0x91, 0x07, 0x00);

    uint8_t buf[16 + SL_PROTO_FETCH_MAX + 1];
    size_t n = 0;
    buf[n++] = 0x95, buf[n++] = 0x03, buf[n++] = 0x01, buf[n++] = 0x05;
    buf[n++] = 0xdc, buf[n++] = 0x00, buf[n++] = SL_PROTO_FETCH_MAX + 1;
    for (int i = 0; i <= SL_PROTO_FETCH_MAX; i++) buf[n++] = (uint8_t)i;
    buf[n++] = 0x00;
    reject(buf, n, SL_EFORMAT, "FETCH field 3 (experts): 65 elements, must be 1..64");

    /* the encoder holds the same rules */
    sl_proto_msg m = valid_fetch();
    m.fetch.n_expert = 0;
    reject_encode(&m, "0 experts, must be 1..64");
    m.fetch.n_expert = SL_PROTO_FETCH_MAX + 1;
    reject_encode(&m, "65 experts, must be 1..64");
    m = valid_fetch();
    m.fetch.expert[2] = 42;
    reject_encode(&m, "duplicate expert 42 at 1 and 2");
    m = valid_fetch();
    m.fetch.priority = 2;
    reject_encode(&m, "priority 2");
    m = valid_fetch();
    m.fetch.req = 0;
    reject_encode(&m, "FETCH: req is 0");
}

Test(proto, reject_other_rules)
{
    /* version: [type, version] of HELLO and WELCOME is read whatever the rest looks like */
    static const uint8_t v2[] = {0x95, 0x01, 0x02, 0x01, 0x00, 0x00};
    sl_proto_msg d;
    sl_err e = {0};
    cr_assert_eq(sl_proto_decode(v2, sizeof v2, &d, &e), SL_EMISMATCH);
    cr_assert_eq(d.type, SL_PROTO_HELLO);
    cr_assert_eq(d.hello.version, 2);
    cr_assert(strstr(e.msg, "HELLO: protocol version 2, this build speaks 1"), "%s", e.msg);
    cr_assert_eq(sl_proto_err_from_status(SL_EMISMATCH), SL_PROTO_ERR_VERSION);
    REJECT(SL_EMISMATCH, "HELLO: protocol version 7", 0x92, 0x01, 0x07);
    REJECT(SL_EMISMATCH, "WELCOME: protocol version 0", 0x93, 0x02, 0x00, 0xa0);

    REJECT(SL_EFORMAT, "HELLO: client_kind 3, must be 1 or 2", 0x95, 0x01, 0x01, 0x03, 0x00, 0x00);
    REJECT(SL_EFORMAT, "HELLO: client_kind 0", 0x95, 0x01, 0x01, 0x00, 0x00, 0x00);
    REJECT(SL_EFORMAT, "READY: req is 0", 0x98, 0x04, 0x00, 1, 1, 1, 1, 0, 0);
    REJECT(SL_EFORMAT, "READY req 1: source 2, must be 0 or 1", 0x98, 0x04, 0x01, 1, 1, 1, 1, 2, 0);
    REJECT(SL_EFORMAT, "RELEASE: arena_epoch is 0", 0x93, 0x05, 0x00, 0x91, 0x92, 0x01, 0x01);
    REJECT(SL_EFORMAT, "RELEASE field 2 (slots): 0 elements, must be 1..128", 0x93, 0x05, 0x01,
           0x90);
    REJECT(SL_EFORMAT, "RELEASE slots[0]: expected [slot, generation], got unsigned integer", 0x93,
           0x05, 0x01, 0x91, 0x07);
    REJECT(SL_EFORMAT, "RELEASE slots[1]: expected [slot, generation], got an array of 3", 0x93,
           0x05, 0x01, 0x92, 0x92, 0x01, 0x01, 0x93, 0x01, 0x01, 0x01);
    REJECT(SL_EFORMAT, "STATS: req is 0", 0x92, 0x06, 0x00);
    REJECT(SL_EFORMAT, "ERROR: code 0, must be 1..11", 0x94, 0x0a, 0x00, 0x00, 0xa0);
    REJECT(SL_EFORMAT, "ERROR: code 12, must be 1..11", 0x94, 0x0a, 0x00, 0x0c, 0xa0);

    raw r;
    raw_init(&r, 3); /* RELEASE of 129 slots */
    raw_u(&r, SL_PROTO_RELEASE);
    raw_u(&r, 1);
    msgpack_pack_array(&r.pk, SL_PROTO_RELEASE_MAX + 1);
    for (int i = 0; i <= SL_PROTO_RELEASE_MAX; i++) {
        msgpack_pack_array(&r.pk, 2);
        raw_u(&r, (uint64_t)i);
        raw_u(&r, 1);
    }
    raw_reject(&r, SL_EFORMAT, "RELEASE field 2 (slots): 129 elements, must be 1..128");

    raw_init(&r, 12); /* STATS_REPLY with 15 buckets */
    raw_u(&r, SL_PROTO_STATS_REPLY);
    for (int i = 0; i < 10; i++) raw_u(&r, 1);
    msgpack_pack_array(&r.pk, SL_PROTO_HIST_BUCKETS - 1);
    for (int i = 0; i < SL_PROTO_HIST_BUCKETS - 1; i++) raw_u(&r, 0);
    raw_reject(&r, SL_EFORMAT, "STATS_REPLY field 11 (hist): 15 elements, must be 16");

    sl_proto_msg m = mk(SL_PROTO_RELEASE);
    m.release.arena_epoch = 1;
    m.release.n_slot = SL_PROTO_RELEASE_MAX + 1;
    reject_encode(&m, "RELEASE: 129 slots, must be 1..128");
    m = mk(SL_PROTO_ERROR);
    m.error.code = 0;
    reject_encode(&m, "ERROR: code 0");
    m = mk(SL_PROTO_HELLO);
    m.hello.version = 2;
    m.hello.client_kind = 1;
    reject_encode(&m, "HELLO: version 2, this build speaks 1");
    m = mk(0);
    reject_encode(&m, "message type 0 is unknown");
    m = mk(SL_PROTO_TYPE_MAX + 1);
    reject_encode(&m, "message type 12 is unknown");
}

Test(proto, reject_welcome_rules)
{
    static const uint64_t off[3] = {0, 4096, 8192}, unaligned[3] = {0, 4097, 8192},
                          same[3] = {0, 4096, 4096}, beyond[3] = {0, 4096, 12288};
    raw r;
    raw_welcome(&r, 1, "sluice", 6, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME: arena_name: must start with '/'");
    raw_welcome(&r, 1, "/", 1, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME: arena_name: length 1, must be 2..64");
    raw_welcome(&r, 1, "/.x", 3, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "must start with '/' and a letter or digit");
    raw_welcome(&r, 1, "/a/b", 4, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "byte 0x2f at 2 is not one of");
    raw_welcome(&r, 1, "/a b", 4, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "byte 0x20 at 2 is not one of");
    raw_welcome(&r, 1, "/a\0b", 4, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME field 3 (arena_name): contains a NUL byte");
    char longname[SL_PROTO_ARENA_NAME_MAX + 1];
    memset(longname, 'a', sizeof longname);
    longname[0] = '/';
    raw_welcome(&r, 1, longname, sizeof longname, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME field 3 (arena_name): 65 bytes, at most 64");
    raw_welcome(&r, 0, "/a", 2, 1, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME: fingerprint is 0");
    raw_welcome(&r, 1, "/a", 2, 0, 12288, 10, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME: arena_epoch is 0");
    raw_welcome(&r, 1, "/a", 2, 1, 12289, 10, off);
    raw_reject(&r, SL_EFORMAT, "slot_bytes 12289 is not a positive multiple of 4096");
    raw_welcome(&r, 1, "/a", 2, 1, 0, 10, off);
    raw_reject(&r, SL_EFORMAT, "slot_bytes 0 is not a positive multiple of 4096");
    raw_welcome(&r, 1, "/a", 2, 1, 12288, 0, off);
    raw_reject(&r, SL_EFORMAT, "WELCOME: slot_count is 0");
    raw_welcome(&r, 1, "/a", 2, 1, UINT64_C(1) << 63, 2, off);
    raw_reject(&r, SL_EFORMAT, "overflows 64 bits");
    raw_welcome(&r, 1, "/a", 2, 1, 12288, 10, unaligned);
    raw_reject(&r, SL_EFORMAT, "part_off[1] 4097 is not a multiple of 4096 below slot_bytes");
    raw_welcome(&r, 1, "/a", 2, 1, 12288, 10, same);
    raw_reject(&r, SL_EFORMAT, "part_off[2] 4096 is not above part_off[1] 4096");
    raw_welcome(&r, 1, "/a", 2, 1, 12288, 10, beyond);
    raw_reject(&r, SL_EFORMAT, "part_off[2] 12288 is not a multiple of 4096 below slot_bytes");

    raw_init(&r, 10); /* part_off with 2 entries */
    raw_u(&r, SL_PROTO_WELCOME);
    raw_u(&r, SL_PROTO_VERSION);
    raw_u(&r, 1);
    raw_s(&r, "/a", 2);
    for (int i = 0; i < 5; i++) raw_u(&r, 4096 * 4);
    msgpack_pack_array(&r.pk, 2);
    raw_u(&r, 0);
    raw_u(&r, 4096);
    raw_reject(&r, SL_EFORMAT, "WELCOME field 9 (part_off): 2 elements, must be 3");

    sl_proto_msg m = valid_welcome();
    strcpy(m.welcome.arena_name, "/a/b");
    reject_encode(&m, "byte 0x2f at 2");
    m = valid_welcome();
    memset(m.welcome.arena_name, 'a', sizeof m.welcome.arena_name); /* no NUL at all */
    m.welcome.arena_name[0] = '/';
    reject_encode(&m, "length 65, must be 2..64");
    m = valid_welcome();
    m.welcome.n_layer = 0;
    reject_encode(&m, "WELCOME: n_layer is 0");
    m = valid_welcome();
    m.welcome.n_expert = 0;
    reject_encode(&m, "WELCOME: n_expert is 0");
}

Test(proto, reject_error_text)
{
    raw_error_text("disk\nfull", 9, "ERROR: text: byte 0x0a at 4 is not valid UTF-8");
    raw_error_text("\x7f", 1, "byte 0x7f at 0");
    raw_error_text("ok \xc3\x28", 5, "byte 0xc3 at 3");      /* broken 2-byte sequence */
    raw_error_text("\xc0\xaf", 2, "byte 0xc0 at 0");         /* overlong '/' */
    raw_error_text("\xe0\x83\xa9", 3, "byte 0xe0 at 0");     /* overlong U+00E9 */
    raw_error_text("\xed\xa0\x80", 3, "byte 0xed at 0");     /* surrogate */
    raw_error_text("\xf4\x90\x80\x80", 4, "byte 0xf4 at 0"); /* above U+10FFFF */
    raw_error_text("\xc2\x85", 2, "byte 0xc2 at 0");         /* C1 control NEL */
    raw_error_text("a\xe2\x82", 3, "byte 0xe2 at 1");        /* cut short */
    raw_error_text("a\0b", 3, "ERROR field 3 (text): contains a NUL byte");
    char longtext[SL_PROTO_TEXT_MAX + 1];
    memset(longtext, 'x', sizeof longtext);
    raw_error_text(longtext, sizeof longtext, "ERROR field 3 (text): 256 bytes, at most 255");

    sl_proto_msg m = mk(SL_PROTO_ERROR);
    m.error.code = SL_PROTO_ERR_IO;
    strcpy(m.error.text, "tab\there");
    reject_encode(&m, "byte 0x09 at 3");
}

/* ---- hostile frames ---- */

Test(proto, hostile_frames_then_a_valid_fetch)
{
    uint64_t seed = 0x5eed, again = 0x5eed;
    int ok = 0, bad = 0, by_rc[4] = {0};
    for (int i = 0; i < 10000; i++) {
        uint8_t buf[SL_PROTO_FRAME_MAX], copy[SL_PROTO_FRAME_MAX];
        size_t n = sl_proto_random_frame(&seed, buf, sizeof buf);
        cr_assert(n <= sizeof buf);
        size_t n2 = sl_proto_random_frame(&again, copy, sizeof copy);
        cr_assert(n == n2 && memcmp(buf, copy, n) == 0, "frame %d is not deterministic", i);

        sl_proto_msg d;
        sl_err e = {0};
        int rc = sl_proto_decode(buf, n, &d, &e);
        if (rc == 0) {
            ok++;
            /* whatever decodes must re-encode and decode to itself */
            uint8_t re[SL_PROTO_FRAME_MAX];
            size_t rn;
            sl_proto_msg d2;
            cr_assert_eq(sl_proto_encode(&d, re, sizeof re, &rn, &e), 0, "%s", e.msg);
            cr_assert_eq(sl_proto_decode(re, rn, &d2, &e), 0, "%s", e.msg);
            cr_assert_eq(memcmp(&d, &d2, sizeof d), 0);
            sl_proto_limits lim = {40, 384, 1000};
            rc = sl_proto_check(&d, &lim, &e);
            cr_assert(rc == 0 || rc == SL_EINVAL);
            continue;
        }
        bad++;
        cr_assert(e.msg[0] != '\0', "frame %d rejected without a message", i);
        cr_assert_eq(e.code, rc);
        switch (rc) {
        case SL_EFORMAT:
            by_rc[0]++;
            break;
        case SL_EUNSUPPORTED:
            by_rc[1]++;
            break;
        case SL_EMISMATCH:
            by_rc[2]++;
            break;
        default:
            cr_assert_fail("frame %d: unexpected status %d (%s)", i, rc, e.msg);
        }
        if (rc != SL_EMISMATCH) {
            static const sl_proto_msg zero;
            cr_assert_eq(memcmp(&d, &zero, sizeof d), 0, "failed decode left data in *out");
        }
    }
    cr_log_info("hostile frames: %d decoded, %d rejected (format %d, type %d, version %d)", ok, bad,
                by_rc[0], by_rc[1], by_rc[2]);
    cr_assert(bad > 8000 && ok > 100, "%d decoded, %d rejected: the generator lost its teeth", ok,
              bad);
    cr_assert(by_rc[1] > 0);

    sl_proto_msg m = valid_fetch(), d;
    uint8_t buf[SL_PROTO_FRAME_MAX];
    size_t n = enc(&m, buf);
    sl_err e = {0};
    cr_assert_eq(sl_proto_decode(buf, n, &d, &e), 0, "%s", e.msg);
    cr_assert_eq(d.type, SL_PROTO_FETCH);
    cr_assert_eq(d.fetch.req, 1);
    cr_assert_eq(d.fetch.layer, 5);
    cr_assert_eq(d.fetch.n_expert, 3);
    cr_assert_eq(d.fetch.expert[2], 300);
}

/* ---- context checks and helpers ---- */

Test(proto, check_ranges)
{
    sl_proto_limits lim = {40, 384, 1000};
    sl_err e = {0};
    sl_proto_msg m = valid_fetch();
    cr_assert_eq(sl_proto_check(&m, &lim, &e), 0);
    m.fetch.layer = 40;
    cr_assert_eq(sl_proto_check(&m, &lim, &e), SL_EINVAL);
    cr_assert(strstr(e.msg, "FETCH req 1: layer 40 out of range (n_layer 40)"), "%s", e.msg);
    m = valid_fetch();
    m.fetch.expert[1] = 384;
    cr_assert_eq(sl_proto_check(&m, &lim, &e), SL_EINVAL);
    cr_assert(strstr(e.msg, "FETCH req 1: expert 384 out of range (n_expert 384)"), "%s", e.msg);
    m.fetch.expert[1] = 383;
    cr_assert_eq(sl_proto_check(&m, &lim, &e), 0);

    m = mk(SL_PROTO_READY);
    m.ready.req = 3;
    m.ready.layer = 39, m.ready.expert = 383, m.ready.slot = 999;
    cr_assert_eq(sl_proto_check(&m, &lim, &e), 0);
    m.ready.slot = 1000;
    cr_assert_eq(sl_proto_check(&m, &lim, &e), SL_EINVAL);
    cr_assert(strstr(e.msg, "READY req 3: layer 39 expert 383 slot 1000 out of range"), "%s",
              e.msg);

    m = mk(SL_PROTO_RELEASE);
    m.release.arena_epoch = 1;
    m.release.n_slot = 2;
    m.release.slot[0].slot = 999;
    m.release.slot[1].slot = 1000;
    cr_assert_eq(sl_proto_check(&m, &lim, &e), SL_EINVAL);
    cr_assert(strstr(e.msg, "RELEASE: slot 1000 out of range (slot_count 1000)"), "%s", e.msg);
    cr_assert_eq(sl_proto_err_from_status(SL_EINVAL), SL_PROTO_ERR_OUT_OF_RANGE);

    m = valid_welcome();
    cr_assert_eq(sl_proto_check(&m, &lim, &e), 0);
}

Test(proto, helpers)
{
    cr_assert_eq(sl_proto_err_from_status(SL_EFORMAT), SL_PROTO_ERR_BAD_MESSAGE);
    cr_assert_eq(sl_proto_err_from_status(SL_EUNSUPPORTED), SL_PROTO_ERR_UNKNOWN_TYPE);
    cr_assert_eq(sl_proto_err_from_status(SL_EIO), SL_PROTO_ERR_IO);
    cr_assert_eq(sl_proto_err_from_status(SL_ENOMEM), SL_PROTO_ERR_INTERNAL);

    cr_assert_str_eq(sl_proto_type_name(SL_PROTO_STATS_REPLY), "STATS_REPLY");
    cr_assert_str_eq(sl_proto_type_name(0), "?");
    cr_assert_str_eq(sl_proto_type_name(12), "?");
    cr_assert_str_eq(sl_proto_err_name(SL_PROTO_ERR_BUSY), "ERR_BUSY");
    cr_assert_str_eq(sl_proto_err_name(12), "?");
    for (int t = 1; t <= SL_PROTO_TYPE_MAX; t++) cr_assert(sl_proto_direction(t) != 0);
    cr_assert_eq(sl_proto_direction(SL_PROTO_FETCH), SL_PROTO_FROM_CLIENT);
    cr_assert_eq(sl_proto_direction(SL_PROTO_READY), SL_PROTO_FROM_FETCHER);
    cr_assert_eq(sl_proto_direction(SL_PROTO_PING), SL_PROTO_FROM_CLIENT | SL_PROTO_FROM_FETCHER);
    cr_assert_eq(sl_proto_direction(0), 0);

    /* histogram bounds as docs/protocol.md lists them */
    static const struct {
        uint64_t us;
        int bucket;
    } hb[] = {{0, 0},        {63, 0},       {64, 1},         {127, 1},     {128, 2},
              {1023, 4},     {1024, 5},     {1400, 5},       {524287, 13}, {524288, 14},
              {1048575, 14}, {1048576, 15}, {UINT64_MAX, 15}};
    for (size_t i = 0; i < sizeof hb / sizeof hb[0]; i++)
        cr_assert_eq(sl_proto_hist_bucket(hb[i].us), hb[i].bucket, "%llu us",
                     (unsigned long long)hb[i].us);

    /* ERROR text from arbitrary strings */
    sl_proto_msg m = mk(SL_PROTO_ERROR);
    m.error.code = SL_PROTO_ERR_IO;
    sl_proto_set_text(m.error.text, "pread(shard 3):\tInput/output\nerror \xff\xc3\xa9");
    cr_assert_str_eq(m.error.text, "pread(shard 3):?Input/output?error ?\xc3\xa9");
    roundtrip(&m);
    char src[400];
    memset(src, 'a', 254);
    strcpy(src + 254, "\xc3\xa9tail"); /* a 2-byte character across the limit is dropped whole */
    sl_proto_set_text(m.error.text, src);
    cr_assert_eq(strlen(m.error.text), 254);
    roundtrip(&m);
    memset(src, 'b', sizeof src - 1);
    src[sizeof src - 1] = '\0';
    sl_proto_set_text(m.error.text, src);
    cr_assert_eq(strlen(m.error.text), SL_PROTO_TEXT_MAX);
    roundtrip(&m);
    sl_proto_set_text(m.error.text, NULL);
    cr_assert_str_eq(m.error.text, "");
}

/* ---- the examples of docs/protocol.md ---- */

/* Reads the hex block that follows `marker` in docs/protocol.md into out; returns its length. */
static size_t doc_hex(const char *marker, uint8_t *out, size_t cap)
{
    const char *path = SL_SOURCE_DIR "/docs/protocol.md";
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    static char doc[1 << 17];
    size_t len = fread(doc, 1, sizeof doc - 1, f);
    fclose(f);
    doc[len] = '\0';
    const char *p = strstr(doc, marker);
    cr_assert(p, "%s has no %s", path, marker);
    p = strstr(p, "```");
    cr_assert(p, "no code block after %s", marker);
    p = strchr(p, '\n');
    cr_assert(p);
    const char *end = strstr(p, "```");
    cr_assert(end);
    size_t n = 0;
    for (; p < end; p++) {
        if (*p == ' ' || *p == '\n') continue;
        unsigned v;
        cr_assert(sscanf(p, "%2x", &v) == 1, "bad hex near \"%.10s\"", p);
        cr_assert(n < cap);
        out[n++] = (uint8_t)v;
        p++;
    }
    return n;
}

Test(proto, doc_fetch_example_byte_by_byte)
{
    /* [3, 1, 5, [7, 42, 300], 0]: FETCH req 1, layer 5, experts 7, 42, 300, demand */
    static const uint8_t want[] = {
        0x95,             /* fixarray of 5 */
        0x03,             /* type 3, FETCH */
        0x01,             /* req 1 */
        0x05,             /* layer 5 */
        0x93,             /* experts: fixarray of 3 */
        0x07,             /* expert 7 */
        0x2a,             /* expert 42 */
        0xcd, 0x01, 0x2c, /* expert 300: uint 16, big-endian */
        0x00,             /* priority 0, demand */
    };
    sl_proto_msg m = valid_fetch();
    uint8_t buf[SL_PROTO_FRAME_MAX], doc[64];
    size_t n = enc(&m, buf);
    cr_assert_eq(n, sizeof want);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(buf[i], want[i], "byte %zu: 0x%02x, expected 0x%02x", i, buf[i], want[i]);
    size_t dn = doc_hex("<!-- example: fetch -->", doc, sizeof doc);
    cr_assert(dn == n && memcmp(doc, want, n) == 0, "docs/protocol.md FETCH hex differs");
}

Test(proto, doc_other_examples)
{
    uint8_t buf[SL_PROTO_FRAME_MAX], doc[128];
    sl_proto_msg m = mk(SL_PROTO_READY);
    m.ready.req = 1;
    m.ready.layer = 5;
    m.ready.expert = 300;
    m.ready.slot = 17;
    m.ready.generation = 3;
    m.ready.source = SL_PROTO_SRC_DISK;
    m.ready.read_us = 1400;
    size_t n = enc(&m, buf), dn = doc_hex("<!-- example: ready -->", doc, sizeof doc);
    cr_assert(dn == n && memcmp(doc, buf, n) == 0, "docs/protocol.md READY hex differs");

    m = mk(SL_PROTO_HELLO);
    m.hello.version = SL_PROTO_VERSION;
    m.hello.client_kind = SL_PROTO_CLIENT_COMPUTE;
    m.hello.pid = 4242;
    m.hello.fingerprint = UINT64_C(0x8f3a5c7e9b1d2f40);
    n = enc(&m, buf), dn = doc_hex("<!-- example: hello -->", doc, sizeof doc);
    cr_assert(dn == n && memcmp(doc, buf, n) == 0, "docs/protocol.md HELLO hex differs");

    m = mk(SL_PROTO_ERROR);
    m.error.req = 1;
    m.error.code = SL_PROTO_ERR_OUT_OF_RANGE;
    strcpy(m.error.text, "layer 40 >= 40");
    n = enc(&m, buf), dn = doc_hex("<!-- example: error -->", doc, sizeof doc);
    cr_assert(dn == n && memcmp(doc, buf, n) == 0, "docs/protocol.md ERROR hex differs");
}
