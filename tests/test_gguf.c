/* test_gguf.c - GGUF reader and writer: round trips of every value and tensor type,
 * split checkpoints, and one test per malformed input the reader must refuse
 * (each made by patching a valid file), checking the SL_E code and that the
 * message names the file and says what is wrong.
 *
 * Every test works in its own mkdtemp folder under /tmp, removed at the end.
 */
#include "gguf.h"
#include "quant.h"
#include "test_file.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- scaffolding ---- */

static char dir[64];

static void dir_make(void)
{
    snprintf(dir, sizeof dir, "/tmp/sl_test_gguf_XXXXXX");
    cr_assert(mkdtemp(dir) != NULL);
}

static void dir_remove(void)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[PATH_MAX];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

TestSuite(gguf, .init = dir_make, .fini = dir_remove, .timeout = 30);

static const char *path_of(const char *name)
{
    static char p[4][PATH_MAX];
    static int k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
    return p[k];
}

/* The byte a tensor holds at position pos: cheap, and different per tensor. */
static uint8_t pattern(uint64_t tensor, uint64_t pos)
{
    uint64_t x = (tensor + 1) * 0x9e3779b97f4a7c15ull ^ (pos * 0xbf58476d1ce4e5b9ull);
    return (uint8_t)(x >> 29 ^ x >> 7 ^ pos);
}

static int fill_pattern(void *ctx, uint64_t tensor, uint64_t off, void *buf, uint64_t len,
                        sl_err *err)
{
    (void)err;
    uint64_t *calls = ctx;
    if (calls) (*calls)++;
    uint8_t *b = buf;
    for (uint64_t i = 0; i < len; i++) b[i] = pattern(tensor, off + i);
    return 0;
}

static void write_or_die(sl_gguf_writer *w, const char *path)
{
    sl_err err = {0};
    int rc = sl_gguf_writer_write(w, path, fill_pattern, NULL, NULL, NULL, &err);
    cr_assert_eq(rc, 0, "write %s: %s", path, err.msg);
}

static uint64_t find(const unsigned char *b, uint64_t n, const char *s)
{
    size_t k = strlen(s);
    const unsigned char *p = memmem(b, n, s, k);
    cr_assert(p, "'%s' not in the file", s);
    return (uint64_t)(p - b);
}

static void put_u32(unsigned char *b, uint64_t at, uint32_t v)
{
    memcpy(b + at, &v, 4);
}

static void put_u64(unsigned char *b, uint64_t at, uint64_t v)
{
    memcpy(b + at, &v, 8);
}

/* Opens path, expects code, and that the message has the file name and phrase. */
static void expect_fail(const char *path, int code, const char *phrase)
{
    sl_gguf *g = NULL;
    sl_err err = {0};
    int rc = sl_gguf_open(&g, path, &err);
    cr_assert_eq(rc, code, "%s: want %s, got %s: %s", path, sl_status_name(code),
                 sl_status_name(rc), err.msg);
    cr_assert_null(g);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    cr_assert(strstr(err.msg, base), "message lacks the file name: %s", err.msg);
    cr_assert(strstr(err.msg, phrase), "message lacks '%s': %s", phrase, err.msg);
}

static sl_gguf *open_ok(const char *path)
{
    sl_gguf *g = NULL;
    sl_err err = {0};
    int rc = sl_gguf_open(&g, path, &err);
    cr_assert_eq(rc, 0, "open %s: %s", path, err.msg);
    return g;
}

/* ---- the base file every malformed case patches ---- */

/* Keys of equal length and tensor names of equal length, so that one can be
 * renamed into another in place. */
#define BASE_T0 "tns.0.weight"
#define BASE_T1 "tns.1.weight"
#define BASE_T2 "tns.2.weight"

static unsigned char *base_file(uint64_t *n)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.architecture", "test"), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "key.aaaa", 7), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "key.bbbb", 8), 0);
    int32_t arr[3] = {1, -2, 3};
    cr_assert_eq(sl_gguf_writer_set_arr(w, "key.iarr", SL_GGUF_TYPE_INT32, arr, 3), 0);
    const char *strs[2] = {"ab", "cde"};
    cr_assert_eq(sl_gguf_writer_set_arr_str(w, "key.sarr", strs, 2), 0);
    uint64_t ne0[2] = {8, 2}, ne1[2] = {256, 2}, ne2[1] = {4};
    cr_assert_eq(sl_gguf_writer_add_tensor(w, BASE_T0, SL_QTYPE_F32, 2, ne0, &err), 0);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, BASE_T1, SL_QTYPE_Q2_K, 2, ne1, &err), 1);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, BASE_T2, SL_QTYPE_F16, 1, ne2, &err), 2);
    const char *p = path_of("base.gguf");
    write_or_die(w, p);
    sl_gguf_writer_free(&w);
    unsigned char *b = sl_test_slurp(p, n);
    unlink(p);
    return b;
}

/* Offset of tensor name's n_dims field in the base file. */
static uint64_t tinfo(const unsigned char *b, uint64_t n, const char *name)
{
    return find(b, n, name) + strlen(name);
}

/* Writes the base file with one patch applied and expects code + phrase. */
#define PATCHED(fname, code, phrase, ...)                                                          \
    do {                                                                                           \
        uint64_t n_;                                                                               \
        unsigned char *b = base_file(&n_);                                                         \
        uint64_t n = n_;                                                                           \
        (void)n;                                                                                   \
        __VA_ARGS__;                                                                               \
        const char *p_ = path_of(fname);                                                           \
        sl_test_write(p_, b, n);                                                                   \
        expect_fail(p_, code, phrase);                                                             \
        free(b);                                                                                   \
    } while (0)

Test(gguf, base_file_is_valid)
{
    uint64_t n;
    unsigned char *b = base_file(&n);
    const char *p = path_of("base-ok.gguf");
    sl_test_write(p, b, n);
    sl_gguf *g = open_ok(p);
    cr_assert_eq(g->n_tensors, 3);
    cr_assert_eq(g->shards[0].n_kv, 5);
    const sl_gguf_tensor *t = sl_gguf_find_tensor(g, BASE_T1);
    cr_assert(t);
    cr_assert_eq(t->n_bytes, 168);
    cr_assert_eq(t->offset % 32, 0);
    sl_gguf_close(&g);
    cr_assert_null(g);
    free(b);
}

/* ---- malformed inputs ---- */

Test(gguf, bad_magic)
{
    PATCHED("magic.gguf", SL_EFORMAT, "bad magic", b[0] = 'X');
}

Test(gguf, unsupported_versions)
{
    PATCHED("v1.gguf", SL_EUNSUPPORTED, "unsupported version 1", put_u32(b, 4, 1));
    PATCHED("v2.gguf", SL_EUNSUPPORTED, "unsupported version 2", put_u32(b, 4, 2));
    PATCHED("v4.gguf", SL_EUNSUPPORTED, "unsupported version 4", put_u32(b, 4, 4));
    PATCHED("vbe.gguf", SL_EUNSUPPORTED, "big-endian", put_u32(b, 4, 0x03000000));
}

Test(gguf, empty_and_tiny_files)
{
    const char *p = path_of("empty.gguf");
    sl_test_write(p, "", 0);
    expect_fail(p, SL_EFORMAT, "truncated");
    p = path_of("three.gguf");
    sl_test_write(p, "GGU", 3);
    expect_fail(p, SL_EFORMAT, "truncated");
}

/* Every cut inside the header, and cuts inside the data section. */
Test(gguf, truncation_anywhere)
{
    uint64_t n;
    unsigned char *b = base_file(&n);
    const char *p = path_of("cut.gguf");
    /* the header ends where the data of the first tensor starts */
    sl_test_write(p, b, n);
    sl_gguf *g = open_ok(p);
    uint64_t data = g->shards[0].data_offset, hb = g->shards[0].header_bytes, end = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].offset + g->tensors[i].n_bytes > end)
            end = g->tensors[i].offset + g->tensors[i].n_bytes;
    sl_gguf_close(&g);
    cr_assert_lt(end, n, "the base file ends with padding");
    /* the padding after the last tensor is not needed */
    sl_test_write(p, b, end);
    g = open_ok(p);
    sl_gguf_close(&g);
    /* A memfd: rewriting one file 300 times on ext4 flushes it each time. */
    int fd = memfd_create("cut", MFD_CLOEXEC);
    cr_assert_geq(fd, 0);
    for (uint64_t cut = 0; cut < end; cut++) {
        if (cut >= hb && cut < data) continue; /* only padding and no tensor bytes yet: see below */
        cr_assert_eq(ftruncate(fd, 0), 0);
        cr_assert_eq(pwrite(fd, b, cut, 0), (ssize_t)cut);
        sl_err err = {0};
        int rc = sl_gguf_open_fd(&g, fd, "cut.gguf", &err);
        cr_assert_eq(rc, SL_EFORMAT, "cut at %" PRIu64 ": %s (%s)", cut, sl_status_name(rc),
                     err.msg);
        cr_assert(strstr(err.msg, "cut.gguf"), "%s", err.msg);
        cr_assert(strstr(err.msg, "truncated") || strstr(err.msg, "past the end"),
                  "cut at %" PRIu64 ": %s", cut, err.msg);
        if (cut < 24) cr_assert(strstr(err.msg, "truncated:"), "%s", err.msg);
    }
    close(fd);
    /* A cut in the padding after the header leaves the tensors past the end. */
    sl_test_write(p, b, hb);
    expect_fail(p, SL_EFORMAT, "past the end of the file");
    free(b);
}

Test(gguf, string_length_past_eof)
{
    PATCHED("keylen.gguf", SL_EFORMAT, "runs past the end of the file",
            put_u64(b, find(b, n, "key.bbbb") - 8, 1ull << 40));
    PATCHED("keylen2.gguf", SL_EFORMAT, "past the end",
            put_u64(b, find(b, n, "key.bbbb") - 8, UINT64_MAX));
    /* the value string of general.architecture */
    PATCHED("vallen.gguf", SL_EFORMAT, "past the end", put_u64(b, find(b, n, "test") - 8, n));
    PATCHED("tname.gguf", SL_EFORMAT, "past the end",
            put_u64(b, find(b, n, BASE_T2) - 8, 1ull << 62));
    PATCHED("sarrstr.gguf", SL_EFORMAT, "past the end",
            put_u64(b, find(b, n, "cde") - 8, UINT64_MAX - 1));
}

Test(gguf, array_length_past_eof)
{
    /* key.iarr: key, type u32, elem type u32, n u64 */
    PATCHED("arrn.gguf", SL_EFORMAT, "past the end",
            put_u64(b, find(b, n, "key.iarr") + 8 + 4 + 4, 1ull << 40));
    PATCHED("arrn2.gguf", SL_EFORMAT, "past the end",
            put_u64(b, find(b, n, "key.iarr") + 8 + 4 + 4, UINT64_MAX));
    PATCHED("sarrn.gguf", SL_EFORMAT, "past the end",
            put_u64(b, find(b, n, "key.sarr") + 8 + 4 + 4, 1ull << 61));
}

Test(gguf, impossible_counts)
{
    PATCHED("nkv.gguf", SL_EFORMAT, "n_kv", put_u64(b, 16, 1ull << 40));
    PATCHED("nkv2.gguf", SL_EFORMAT, "impossible", put_u64(b, 16, UINT64_MAX));
    PATCHED("nt.gguf", SL_EFORMAT, "n_tensors", put_u64(b, 8, 1ull << 40));
    PATCHED("nt2.gguf", SL_EFORMAT, "impossible", put_u64(b, 8, UINT64_MAX));
}

Test(gguf, bad_n_dims)
{
    PATCHED("dims0.gguf", SL_EFORMAT, "n_dims 0", put_u32(b, tinfo(b, n, BASE_T1), 0));
    PATCHED("dims5.gguf", SL_EFORMAT, "n_dims 5", put_u32(b, tinfo(b, n, BASE_T1), 5));
    PATCHED("dimsx.gguf", SL_EFORMAT, "must be 1..4",
            put_u32(b, tinfo(b, n, BASE_T1), 0xffffffffu));
}

Test(gguf, unknown_tensor_type)
{
    /* BASE_T2: n_dims 1, ne[1], then type */
    PATCHED("ttype.gguf", SL_EUNSUPPORTED, "unknown tensor type 99",
            put_u32(b, tinfo(b, n, BASE_T2) + 4 + 8, 99));
    PATCHED("ttype4.gguf", SL_EUNSUPPORTED, "unknown tensor type 4",
            put_u32(b, tinfo(b, n, BASE_T2) + 4 + 8, 4));
}

Test(gguf, ne0_not_multiple_of_block)
{
    PATCHED("block.gguf", SL_EFORMAT, "not a multiple of the block size 256",
            put_u64(b, tinfo(b, n, BASE_T1) + 4, 128));
}

Test(gguf, element_count_overflow)
{
    PATCHED("nel.gguf", SL_EFORMAT, "element count overflows",
            put_u64(b, tinfo(b, n, BASE_T0) + 4 + 8, 1ull << 62));
    PATCHED("nel2.gguf", SL_EFORMAT, "element count overflows",
            put_u64(b, tinfo(b, n, BASE_T0) + 4, 1ull << 63));
    /* fits int64 as a count, overflows as bytes of f32 */
    PATCHED("bytes.gguf", SL_EFORMAT, "overflows", put_u64(b, tinfo(b, n, BASE_T0) + 4, 1ull << 62),
            put_u64(b, tinfo(b, n, BASE_T0) + 4 + 8, 1));
}

Test(gguf, misaligned_offset)
{
    /* BASE_T2: n_dims, ne[1], type, offset */
    uint64_t n0;
    unsigned char *b0 = base_file(&n0);
    uint64_t at = tinfo(b0, n0, BASE_T2) + 4 + 8 + 4, off;
    memcpy(&off, b0 + at, 8);
    free(b0);
    char want[96];
    snprintf(want, sizeof want, "offset %" PRIu64 " not a multiple of alignment 32", off + 4);
    PATCHED("misal.gguf", SL_EFORMAT, want, put_u64(b, at, off + 4));
}

Test(gguf, overlapping_tensors)
{
    /* BASE_T2 (8 bytes) moved onto BASE_T0 (offset 0) */
    PATCHED("overlap.gguf", SL_EFORMAT, "overlap", put_u64(b, tinfo(b, n, BASE_T2) + 4 + 8 + 4, 0));
    /* BASE_T1 (168 bytes) moved from 64 to 32, into BASE_T0 (64 bytes at 0) */
    PATCHED("overlap2.gguf", SL_EFORMAT, "overlap",
            put_u64(b, tinfo(b, n, BASE_T1) + 4 + 16 + 4, 32));
}

Test(gguf, offset_past_eof)
{
    PATCHED("far.gguf", SL_EFORMAT, "past the end of the file",
            put_u64(b, tinfo(b, n, BASE_T2) + 4 + 8 + 4, 1ull << 40));
    PATCHED("far2.gguf", SL_EFORMAT, "past the end of the file",
            put_u64(b, tinfo(b, n, BASE_T2) + 4 + 8 + 4, UINT64_MAX - 31));
}

Test(gguf, duplicate_key)
{
    PATCHED("dupkey.gguf", SL_EFORMAT, "duplicate key 'key.aaaa'",
            memcpy(b + find(b, n, "key.bbbb"), "key.aaaa", 8));
}

Test(gguf, duplicate_tensor_name)
{
    PATCHED("duptensor.gguf", SL_EFORMAT, "duplicate tensor name '" BASE_T0 "'",
            memcpy(b + find(b, n, BASE_T2), BASE_T0, strlen(BASE_T0)));
}

Test(gguf, empty_key_and_name)
{
    /* Length 0 and a key of 8 bytes is left where the type should be: the empty key
     * is reported first. */
    PATCHED("emptykey.gguf", SL_EFORMAT, "empty key", put_u64(b, find(b, n, "key.aaaa") - 8, 0));
    PATCHED("emptyname.gguf", SL_EFORMAT, "empty name", put_u64(b, find(b, n, BASE_T0) - 8, 0));
}

Test(gguf, value_types)
{
    PATCHED("vtype.gguf", SL_EFORMAT, "unknown value type 13",
            put_u32(b, find(b, n, "key.aaaa") + 8, 13));
    PATCHED("nested.gguf", SL_EUNSUPPORTED, "nested array",
            put_u32(b, find(b, n, "key.iarr") + 8 + 4, SL_GGUF_TYPE_ARRAY));
    PATCHED("arrtype.gguf", SL_EFORMAT, "array of unknown value type 77",
            put_u32(b, find(b, n, "key.iarr") + 8 + 4, 77));
}

Test(gguf, bad_alignment_key)
{
    /* rename key.aaaa (u32 7) to a 17-byte key would move bytes; instead write a
     * file with the key and patch its value / type. */
    for (int c = 0; c < 3; c++) {
        sl_gguf_writer *w;
        sl_err err = {0};
        cr_assert_eq(sl_gguf_writer_init(&w, 64, &err), 0);
        uint64_t ne[1] = {16};
        cr_assert_eq(sl_gguf_writer_add_tensor(w, "x", SL_QTYPE_F32, 1, ne, &err), 0);
        const char *p = path_of("align.gguf");
        write_or_die(w, p);
        sl_gguf_writer_free(&w);
        uint64_t n;
        unsigned char *b = sl_test_slurp(p, &n);
        uint64_t at = find(b, n, "general.alignment") + 17;
        if (c == 0) put_u32(b, at, SL_GGUF_TYPE_INT32);
        if (c == 1) put_u32(b, at + 4, 48);
        if (c == 2) put_u32(b, at + 4, 0);
        sl_test_write(p, b, n);
        expect_fail(p, SL_EFORMAT,
                    c == 0 ? "general.alignment is i32, must be u32"
                           : "not a nonzero power of two");
        free(b);
    }
}

/* The header limit: a string longer than SL_GGUF_MAX_HEADER_BYTES inside a large
 * (sparse) file is refused before anything is read or allocated. */
Test(gguf, header_size_limit)
{
    uint64_t n;
    unsigned char *b = base_file(&n);
    put_u64(b, find(b, n, "test") - 8, SL_GGUF_MAX_HEADER_BYTES + 100);
    const char *p = path_of("huge.gguf");
    sl_test_write(p, b, n);
    cr_assert_eq(truncate(p, (off_t)(2 * SL_GGUF_MAX_HEADER_BYTES)), 0);
    expect_fail(p, SL_EFORMAT, "larger than 64 MiB");
    free(b);
}

/* ---- round trips ---- */

Test(gguf, every_value_type_round_trips)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    cr_assert_eq(sl_gguf_writer_set_u8(w, "v.u8", 250), 0);
    cr_assert_eq(sl_gguf_writer_set_i8(w, "v.i8", -120), 0);
    cr_assert_eq(sl_gguf_writer_set_u16(w, "v.u16", 65000), 0);
    cr_assert_eq(sl_gguf_writer_set_i16(w, "v.i16", -32000), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "v.u32", 4000000000u), 0);
    cr_assert_eq(sl_gguf_writer_set_i32(w, "v.i32", INT32_MIN), 0);
    cr_assert_eq(sl_gguf_writer_set_u64(w, "v.u64", UINT64_MAX), 0);
    cr_assert_eq(sl_gguf_writer_set_i64(w, "v.i64", INT64_MIN), 0);
    cr_assert_eq(sl_gguf_writer_set_f32(w, "v.f32", 1.5e-6f), 0);
    cr_assert_eq(sl_gguf_writer_set_f64(w, "v.f64", 3.141592653589793), 0);
    cr_assert_eq(sl_gguf_writer_set_bool(w, "v.true", 1), 0);
    cr_assert_eq(sl_gguf_writer_set_bool(w, "v.false", 0), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "v.str", "hello, gguf"), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "v.empty", ""), 0);

    uint8_t a_u8[3] = {0, 7, 255};
    int8_t a_i8[3] = {-128, 0, 127};
    uint16_t a_u16[2] = {1, 65535};
    int16_t a_i16[2] = {-32768, 32767};
    uint32_t a_u32[4] = {0, 1, 2, UINT32_MAX};
    int32_t a_i32[2] = {INT32_MIN, INT32_MAX};
    float a_f32[3] = {0.5f, -1e30f, INFINITY};
    uint8_t a_bool[3] = {1, 0, 1};
    uint64_t a_u64[2] = {0, UINT64_MAX};
    int64_t a_i64[2] = {INT64_MIN, 42};
    double a_f64[2] = {1e300, -0.0};
    struct {
        const char *key;
        uint32_t type;
        const void *data;
        uint64_t n, width;
    } arrs[] = {
        {"a.u8", SL_GGUF_TYPE_UINT8, a_u8, 3, 1},     {"a.i8", SL_GGUF_TYPE_INT8, a_i8, 3, 1},
        {"a.u16", SL_GGUF_TYPE_UINT16, a_u16, 2, 2},  {"a.i16", SL_GGUF_TYPE_INT16, a_i16, 2, 2},
        {"a.u32", SL_GGUF_TYPE_UINT32, a_u32, 4, 4},  {"a.i32", SL_GGUF_TYPE_INT32, a_i32, 2, 4},
        {"a.f32", SL_GGUF_TYPE_FLOAT32, a_f32, 3, 4}, {"a.bool", SL_GGUF_TYPE_BOOL, a_bool, 3, 1},
        {"a.u64", SL_GGUF_TYPE_UINT64, a_u64, 2, 8},  {"a.i64", SL_GGUF_TYPE_INT64, a_i64, 2, 8},
        {"a.f64", SL_GGUF_TYPE_FLOAT64, a_f64, 2, 8}, {"a.empty", SL_GGUF_TYPE_UINT32, NULL, 0, 4},
    };
    size_t n_arrs = sizeof arrs / sizeof arrs[0];
    for (size_t i = 0; i < n_arrs; i++)
        cr_assert_eq(sl_gguf_writer_set_arr(w, arrs[i].key, arrs[i].type, arrs[i].data, arrs[i].n),
                     0);
    const char *strs[4] = {"one", "", "three \"quoted\"", "\xe2\x9c\x93"};
    cr_assert_eq(sl_gguf_writer_set_arr_str(w, "a.str", strs, 4), 0);
    cr_assert_eq(sl_gguf_writer_set_arr_str(w, "a.str_empty", NULL, 0), 0);
    const char *p = path_of("values.gguf");
    write_or_die(w, p);
    struct stat st;
    cr_assert_eq(stat(p, &st), 0);
    cr_assert_eq(sl_gguf_writer_file_bytes(w), (uint64_t)st.st_size);
    sl_gguf_writer_free(&w);

    sl_gguf *g = open_ok(p);
    const sl_gguf_kv *kv;
#define SCALAR(key, t, field, val)                                                                 \
    kv = sl_gguf_find_kv(g, key);                                                                  \
    cr_assert(kv, key);                                                                            \
    cr_assert_eq(kv->type, t, key);                                                                \
    cr_assert(kv->v.field == (val), key)
    SCALAR("v.u8", SL_GGUF_TYPE_UINT8, u64, 250);
    SCALAR("v.i8", SL_GGUF_TYPE_INT8, i64, -120);
    SCALAR("v.u16", SL_GGUF_TYPE_UINT16, u64, 65000);
    SCALAR("v.i16", SL_GGUF_TYPE_INT16, i64, -32000);
    SCALAR("v.u32", SL_GGUF_TYPE_UINT32, u64, 4000000000u);
    SCALAR("v.i32", SL_GGUF_TYPE_INT32, i64, INT32_MIN);
    SCALAR("v.u64", SL_GGUF_TYPE_UINT64, u64, UINT64_MAX);
    SCALAR("v.i64", SL_GGUF_TYPE_INT64, i64, INT64_MIN);
    SCALAR("v.f32", SL_GGUF_TYPE_FLOAT32, f64, (double)1.5e-6f);
    SCALAR("v.f64", SL_GGUF_TYPE_FLOAT64, f64, 3.141592653589793);
    SCALAR("v.true", SL_GGUF_TYPE_BOOL, u64, 1);
    SCALAR("v.false", SL_GGUF_TYPE_BOOL, u64, 0);
    kv = sl_gguf_find_kv(g, "v.str");
    cr_assert(kv && kv->type == SL_GGUF_TYPE_STRING);
    cr_assert_eq(kv->v.str.len, 11);
    cr_assert_str_eq(kv->v.str.s, "hello, gguf");
    kv = sl_gguf_find_kv(g, "v.empty");
    cr_assert(kv && kv->type == SL_GGUF_TYPE_STRING && kv->v.str.len == 0);
    cr_assert_str_eq(kv->v.str.s, "");
    for (size_t i = 0; i < n_arrs; i++) {
        kv = sl_gguf_find_kv(g, arrs[i].key);
        cr_assert(kv, "%s", arrs[i].key);
        cr_assert_eq(kv->type, SL_GGUF_TYPE_ARRAY);
        cr_assert_eq(kv->arr_type, arrs[i].type, "%s", arrs[i].key);
        cr_assert_eq(kv->arr_n, arrs[i].n, "%s", arrs[i].key);
        if (arrs[i].n)
            cr_assert(!memcmp(kv->v.arr, arrs[i].data, arrs[i].n * arrs[i].width), "%s",
                      arrs[i].key);
    }
    kv = sl_gguf_find_kv(g, "a.str");
    cr_assert(kv && kv->arr_type == SL_GGUF_TYPE_STRING && kv->arr_n == 4);
    const sl_gguf_str *s = kv->v.arr;
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(s[i].len, strlen(strs[i]));
        cr_assert_str_eq(s[i].s, strs[i]);
    }
    kv = sl_gguf_find_kv(g, "a.str_empty");
    cr_assert(kv && kv->arr_type == SL_GGUF_TYPE_STRING && kv->arr_n == 0);
    cr_assert_null(sl_gguf_find_kv(g, "v.absent"));
    cr_assert_eq(g->n_tensors, 0);
    cr_assert_eq(g->shards[0].n_kv, 14 + n_arrs + 2);
    /* file order is kept */
    cr_assert_str_eq(g->shards[0].kv[0].key.s, "v.u8");
    cr_assert_str_eq(g->shards[0].kv[g->shards[0].n_kv - 1].key.s, "a.str_empty");
    sl_gguf_close(&g);
}

/* Tensors of every type the quant table knows, read back with pread. */
static void tensor_round_trip(uint32_t alignment)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, alignment, &err), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.architecture", "test"), 0);
    int n_types = 0;
    uint64_t want_bytes[SL_QTYPE_COUNT];
    char names[SL_QTYPE_COUNT][32];
    for (uint32_t ty = 0; ty < SL_QTYPE_COUNT + 8; ty++) {
        const sl_qtype_info *qi = sl_qtype_get(ty);
        uint64_t ne[3] = {3, 2, 2};
        if (!qi) {
            cr_assert_lt(sl_gguf_writer_add_tensor(w, "unknown", ty, 1, ne, &err), 0);
            cr_assert(strstr(err.msg, "unknown tensor type"), "%s", err.msg);
            continue;
        }
        cr_assert_lt(ty, SL_QTYPE_COUNT);
        ne[0] = (uint64_t)qi->block_elems * (1 + ty % 3);
        uint32_t nd = 1 + ty % 3;
        snprintf(names[ty], sizeof names[ty], "blk.%u.%s", ty, qi->name);
        int64_t id = sl_gguf_writer_add_tensor(w, names[ty], ty, nd, ne, &err);
        cr_assert_geq(id, 0, "%s: %s", names[ty], err.msg);
        want_bytes[ty] =
            ne[0] / qi->block_elems * qi->block_bytes * (nd > 1 ? 2 : 1) * (nd > 2 ? 2 : 1);
        n_types++;
    }
    cr_assert_geq(n_types, 6, "the quant table knows only %d types", n_types);
    const char *p = path_of("tensors.gguf");
    uint64_t calls = 0;
    cr_assert_eq(sl_gguf_writer_write(w, p, fill_pattern, &calls, NULL, NULL, &err), 0, "%s",
                 err.msg);
    cr_assert_geq(calls, (uint64_t)n_types);
    uint64_t file_bytes = sl_gguf_writer_file_bytes(w);
    sl_gguf_writer_free(&w);

    sl_gguf *g = open_ok(p);
    cr_assert_eq(g->shards[0].file_bytes, file_bytes);
    cr_assert_eq(g->shards[0].alignment, alignment);
    cr_assert_eq(g->shards[0].data_offset % alignment, 0);
    cr_assert_eq(g->n_tensors, (uint64_t)n_types);
    if (alignment != 32) {
        uint32_t a = 0;
        cr_assert_eq(sl_gguf_get_u32(g, "general.alignment", &a, &err), 0);
        cr_assert_eq(a, alignment);
    } else {
        cr_assert_null(sl_gguf_find_kv(g, "general.alignment"));
    }
    uint64_t idx = 0;
    for (uint32_t ty = 0; ty < SL_QTYPE_COUNT; ty++) {
        if (!sl_qtype_get(ty)) continue;
        const sl_gguf_tensor *t = sl_gguf_find_tensor(g, names[ty]);
        cr_assert(t, "%s", names[ty]);
        cr_assert_eq(t - g->tensors, (ptrdiff_t)idx, "file order");
        cr_assert_eq(t->type, ty);
        cr_assert_eq(t->n_dims, 1 + ty % 3);
        cr_assert_eq(t->n_bytes, want_bytes[ty], "%s", names[ty]);
        cr_assert_eq(t->offset % alignment, 0);
        cr_assert_eq(t->offset, g->shards[0].data_offset + t->rel_offset);
        for (uint32_t d = t->n_dims; d < 4; d++) cr_assert_eq(t->ne[d], 1);
        unsigned char *buf = malloc(t->n_bytes);
        cr_assert_eq(pread(g->shards[0].fd, buf, t->n_bytes, (off_t)t->offset),
                     (ssize_t)t->n_bytes);
        for (uint64_t i = 0; i < t->n_bytes; i++)
            if (buf[i] != pattern(idx, i))
                cr_assert_fail("%s: byte %" PRIu64 " differs", names[ty], i);
        free(buf);
        idx++;
    }
    cr_assert_null(sl_gguf_find_tensor(g, "blk.0"));
    cr_assert_null(sl_gguf_find_tensor(g, ""));
    sl_gguf_close(&g);
}

Test(gguf, every_tensor_type_round_trips_align_32)
{
    tensor_round_trip(32);
}

Test(gguf, every_tensor_type_round_trips_align_64)
{
    tensor_round_trip(64);
}

Test(gguf, every_tensor_type_round_trips_align_4096)
{
    tensor_round_trip(4096);
}

/* A large tensor crosses the 4 MiB buffer: chunks, padding, progress. */
static void progress_cb(void *ctx, uint64_t done, uint64_t total)
{
    uint64_t *st = ctx; /* [calls, last done, total] */
    cr_assert_geq(done, st[1]);
    st[0]++;
    st[1] = done;
    st[2] = total;
}

Test(gguf, large_tensor_chunks_and_progress)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    uint64_t ne_a[2] = {1000, 1}, ne_b[2] = {4096, 700}; /* 4000 B, then 11.2 MB of f32 */
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "a", SL_QTYPE_F32, 2, ne_a, &err), 0);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "b", SL_QTYPE_F32, 2, ne_b, &err), 1);
    const char *p = path_of("large.gguf");
    uint64_t st[3] = {0, 0, 0}, calls = 0;
    cr_assert_eq(sl_gguf_writer_write(w, p, fill_pattern, &calls, progress_cb, st, &err), 0, "%s",
                 err.msg);
    cr_assert_geq(calls, 4);
    cr_assert_geq(st[0], 3);
    cr_assert_eq(st[1], sl_gguf_writer_file_bytes(w));
    cr_assert_eq(st[2], st[1]);
    sl_gguf_writer_free(&w);
    sl_gguf *g = open_ok(p);
    const sl_gguf_tensor *t = sl_gguf_find_tensor(g, "b");
    cr_assert(t);
    cr_assert_eq(t->rel_offset, 4000 + 0); /* 4000 is a multiple of 32 */
    unsigned char *buf = malloc(t->n_bytes);
    cr_assert_eq(pread(g->shards[0].fd, buf, t->n_bytes, (off_t)t->offset), (ssize_t)t->n_bytes);
    for (uint64_t i = 0; i < t->n_bytes; i++)
        if (buf[i] != pattern(1, i)) cr_assert_fail("byte %" PRIu64 " differs", i);
    free(buf);
    sl_gguf_close(&g);
}

/* ---- split checkpoints ---- */

/* Writes shard i of n of prefix with tensors [3i, 3i+3). Variants change one
 * thing to make shards disagree. */
enum { SPLIT_OK, SPLIT_NAME, SPLIT_COUNT, SPLIT_TOTAL, SPLIT_NO, SPLIT_NOKEYS, SPLIT_DUPT };

static void write_shard(const char *prefix, uint32_t i, uint32_t n, int variant)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    if (variant != SPLIT_NOKEYS) {
        cr_assert_eq(sl_gguf_writer_set_u16(w, "split.no", (uint16_t)(variant == SPLIT_NO ? 0 : i)),
                     0);
        cr_assert_eq(sl_gguf_writer_set_u16(w, "split.count",
                                            (uint16_t)(variant == SPLIT_COUNT ? n + 1 : n)),
                     0);
        cr_assert_eq(sl_gguf_writer_set_i32(w, "split.tensors.count",
                                            (int32_t)(3 * n + (variant == SPLIT_TOTAL))),
                     0);
    }
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.architecture", "test"), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.name", variant == SPLIT_NAME ? "other" : "m"),
                 0);
    if (i == 0) {
        cr_assert_eq(sl_gguf_writer_set_u32(w, "test.block_count", 3), 0);
        const char *toks[3] = {"<s>", "a", "b"};
        cr_assert_eq(sl_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3), 0);
    }
    for (uint32_t k = 0; k < 3; k++) {
        char name[32];
        snprintf(name, sizeof name, "blk.%u.w", variant == SPLIT_DUPT ? k : 3 * i + k);
        uint64_t ne[2] = {32, 1 + k};
        cr_assert_geq(sl_gguf_writer_add_tensor(w, name, SL_QTYPE_Q8_0, 2, ne, &err), 0);
    }
    char path[PATH_MAX];
    cr_assert_eq(sl_gguf_split_path(path, sizeof path, prefix, i, n), 0);
    write_or_die(w, path);
    sl_gguf_writer_free(&w);
}

static const char *split_set(uint32_t n, int bad_shard, int variant)
{
    const char *prefix = path_of("m");
    static char pre[PATH_MAX];
    snprintf(pre, sizeof pre, "%s", prefix);
    for (uint32_t i = 0; i < n; i++)
        write_shard(pre, i, n, (int)i == bad_shard ? variant : SPLIT_OK);
    return pre;
}

Test(gguf, split_round_trip_3_shards)
{
    const char *pre = split_set(3, -1, SPLIT_OK);
    uint64_t fp = 0;
    for (uint32_t open_by = 0; open_by < 3; open_by++) {
        char path[PATH_MAX];
        sl_gguf_split_path(path, sizeof path, pre, open_by, 3);
        sl_gguf *g = open_ok(path);
        cr_assert_eq(g->n_shards, 3);
        cr_assert_eq(g->n_tensors, 9);
        if (open_by == 0) fp = g->fingerprint;
        cr_assert_eq(g->fingerprint, fp, "fingerprint depends on the name opened");
        for (uint32_t s = 0; s < 3; s++) {
            char want[PATH_MAX];
            sl_gguf_split_path(want, sizeof want, pre, s, 3);
            cr_assert_str_eq(g->shards[s].path, want);
            cr_assert_eq(g->shards[s].first_tensor, 3 * s);
            cr_assert_eq(g->shards[s].n_tensor, 3);
        }
        for (uint32_t k = 0; k < 9; k++) {
            char name[32];
            snprintf(name, sizeof name, "blk.%u.w", k);
            const sl_gguf_tensor *t = sl_gguf_find_tensor(g, name);
            cr_assert(t, "%s", name);
            cr_assert_eq(t->shard, k / 3);
            cr_assert_eq(t - g->tensors, (ptrdiff_t)k);
            cr_assert_eq(t->n_bytes, 34 * (1 + k % 3));
            unsigned char buf[128];
            cr_assert_eq(pread(g->shards[t->shard].fd, buf, t->n_bytes, (off_t)t->offset),
                         (ssize_t)t->n_bytes);
            for (uint64_t b = 0; b < t->n_bytes; b++) cr_assert_eq(buf[b], pattern(k % 3, b));
        }
        uint32_t bc;
        sl_err err = {0};
        cr_assert_eq(sl_gguf_get_u32(g, "test.block_count", &bc, &err), 0);
        cr_assert_eq(bc, 3);
        sl_gguf_close(&g);
    }
    /* One changed header byte in the last shard changes the fingerprint. */
    char p2[PATH_MAX];
    sl_gguf_split_path(p2, sizeof p2, pre, 2, 3);
    uint64_t n;
    unsigned char *b = sl_test_slurp(p2, &n);
    b[find(b, n, "blk.8.w")] = 'B';
    sl_test_write(p2, b, n);
    free(b);
    sl_gguf *g = open_ok(p2);
    cr_assert_neq(g->fingerprint, fp);
    sl_gguf_close(&g);
}

Test(gguf, single_shard_split_name_without_keys)
{
    char p[PATH_MAX];
    sl_gguf_split_path(p, sizeof p, path_of("one"), 0, 1);
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.name", "one"), 0);
    write_or_die(w, p);
    sl_gguf_writer_free(&w);
    sl_gguf *g = open_ok(p);
    cr_assert_eq(g->n_shards, 1);
    sl_gguf_close(&g);
}

Test(gguf, missing_shard)
{
    const char *pre = split_set(3, -1, SPLIT_OK);
    char p1[PATH_MAX], p0[PATH_MAX];
    sl_gguf_split_path(p1, sizeof p1, pre, 1, 3);
    sl_gguf_split_path(p0, sizeof p0, pre, 0, 3);
    unlink(p1);
    sl_gguf *g = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_open(&g, p0, &err), SL_ENOTFOUND, "%s", err.msg);
    cr_assert(strstr(err.msg, "m-00002-of-00003.gguf"), "%s", err.msg);
    cr_assert(strstr(err.msg, "missing shard 2 of 3"), "%s", err.msg);
    cr_assert_null(g);
    /* a plain missing file */
    cr_assert_eq(sl_gguf_open(&g, path_of("nothing.gguf"), &err), SL_ENOTFOUND);
    cr_assert(strstr(err.msg, "nothing.gguf"), "%s", err.msg);
}

Test(gguf, extra_shard)
{
    const char *pre = split_set(3, -1, SPLIT_OK);
    /* a shard 4 of some 4-shard set with the same prefix */
    write_shard(pre, 3, 4, SPLIT_OK);
    char p0[PATH_MAX];
    sl_gguf_split_path(p0, sizeof p0, pre, 0, 3);
    sl_gguf *g = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_open(&g, p0, &err), SL_EMISMATCH, "%s", err.msg);
    cr_assert(strstr(err.msg, "m-00004-of-00004.gguf"), "%s", err.msg);
    cr_assert(strstr(err.msg, "extra shard"), "%s", err.msg);
}

Test(gguf, mismatched_shards)
{
    struct {
        int variant;
        int code;
        const char *phrase;
    } cases[] = {
        {SPLIT_NAME, SL_EMISMATCH, "key 'general.name' differs"},
        {SPLIT_COUNT, SL_EMISMATCH, "split.count is 4"},
        {SPLIT_TOTAL, SL_EMISMATCH, "split.tensors.count 10 differs"},
        {SPLIT_NO, SL_EMISMATCH, "split.no is 0, expected 2"},
        {SPLIT_NOKEYS, SL_EFORMAT, "has no split.no key"},
        {SPLIT_DUPT, SL_EFORMAT, "duplicate tensor name 'blk.0.w' (also in"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *pre = split_set(3, 2, cases[c].variant);
        char p0[PATH_MAX], p2[PATH_MAX];
        sl_gguf_split_path(p0, sizeof p0, pre, 0, 3);
        sl_gguf_split_path(p2, sizeof p2, pre, 2, 3);
        sl_gguf *g = NULL;
        sl_err err = {0};
        int rc = sl_gguf_open(&g, p0, &err);
        cr_assert_eq(rc, cases[c].code, "case %zu: %s", c, err.msg);
        cr_assert(strstr(err.msg, "m-00003-of-00003.gguf"), "case %zu: %s", c, err.msg);
        cr_assert(strstr(err.msg, cases[c].phrase), "case %zu: %s", c, err.msg);
        cr_assert_null(g);
    }
    /* split.tensors.count agreeing everywhere but wrong for the set */
    const char *pre = path_of("t");
    char pre_c[PATH_MAX];
    snprintf(pre_c, sizeof pre_c, "%s", pre);
    for (uint32_t i = 0; i < 2; i++) write_shard(pre_c, i, 2, SPLIT_TOTAL);
    char p0[PATH_MAX];
    sl_gguf_split_path(p0, sizeof p0, pre_c, 0, 2);
    expect_fail(p0, SL_EMISMATCH, "hold 6 tensors");
}

Test(gguf, split_keys_in_a_plain_name)
{
    const char *pre = split_set(2, -1, SPLIT_OK);
    char p0[PATH_MAX];
    sl_gguf_split_path(p0, sizeof p0, pre, 0, 2);
    const char *plain = path_of("renamed.gguf");
    cr_assert_eq(rename(p0, plain), 0);
    expect_fail(plain, SL_EMISMATCH, "split.count is 2");
    /* opened as one fd, split keys are not looked at */
    int fd = open(plain, O_RDONLY);
    sl_gguf *g = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_open_fd(&g, fd, "renamed", &err), 0, "%s", err.msg);
    close(fd);
    cr_assert_eq(g->n_tensors, 3);
    cr_assert_geq(g->shards[0].fd, 0);
    sl_gguf_close(&g);
}

Test(gguf, bad_split_names)
{
    const char *p = path_of("x-00004-of-00003.gguf");
    sl_test_write(p, "GGUF", 4);
    expect_fail(p, SL_EINVAL, "not a valid shard");
    p = path_of("x-00000-of-00003.gguf");
    sl_test_write(p, "GGUF", 4);
    expect_fail(p, SL_EINVAL, "not a valid shard");
    p = path_of("x-00001-of-10000.gguf");
    sl_test_write(p, "GGUF", 4);
    expect_fail(p, SL_EUNSUPPORTED, "more than 9999");
    char buf[24];
    cr_assert_eq(sl_gguf_split_path(buf, sizeof buf, "long-prefix", 0, 2), SL_EINVAL);
    cr_assert_eq(sl_gguf_split_path(buf, sizeof buf, "a", 2, 2), SL_EINVAL);
    cr_assert_eq(sl_gguf_split_path(buf, sizeof buf, "a", 0, 0), SL_EINVAL);
    cr_assert_eq(sl_gguf_split_path(buf, sizeof buf, "ab", 0, 2), 0);
    cr_assert_str_eq(buf, "ab-00001-of-00002.gguf");
}

/* ---- getters, printing ---- */

static sl_gguf *getter_file(void)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    sl_gguf_writer_set_u8(w, "u8", 200);
    sl_gguf_writer_set_i8(w, "i8.neg", -5);
    sl_gguf_writer_set_i32(w, "i32.pos", 123456);
    sl_gguf_writer_set_u64(w, "u64.big", 1ull << 40);
    sl_gguf_writer_set_u64(w, "u64.max", UINT64_MAX);
    sl_gguf_writer_set_f32(w, "f32", 0.25f);
    sl_gguf_writer_set_f64(w, "f64.big", 1e300);
    sl_gguf_writer_set_f64(w, "f64", 1.5);
    sl_gguf_writer_set_bool(w, "bool", 1);
    sl_gguf_writer_set_u16(w, "u16.two", 2);
    sl_gguf_writer_set_str(w, "str", "hi");
    int32_t ia[3] = {1, -14, 7};
    sl_gguf_writer_set_arr(w, "arr.i32", SL_GGUF_TYPE_INT32, ia, 3);
    uint64_t ua[2] = {5, UINT64_MAX};
    sl_gguf_writer_set_arr(w, "arr.u64", SL_GGUF_TYPE_UINT64, ua, 2);
    float fa[1] = {1};
    sl_gguf_writer_set_arr(w, "arr.f32", SL_GGUF_TYPE_FLOAT32, fa, 1);
    const char *p = path_of("get.gguf");
    write_or_die(w, p);
    sl_gguf_writer_free(&w);
    return open_ok(p);
}

Test(gguf, typed_getters)
{
    sl_gguf *g = getter_file();
    sl_err err = {0};
    uint64_t u64;
    uint32_t u32;
    int64_t i64;
    float f;
    int b;
    const char *s;
    cr_assert_eq(sl_gguf_get_u64(g, "u8", &u64, &err), 0);
    cr_assert_eq(u64, 200);
    cr_assert_eq(sl_gguf_get_u32(g, "i32.pos", &u32, &err), 0);
    cr_assert_eq(u32, 123456);
    cr_assert_eq(sl_gguf_get_i64(g, "i8.neg", &i64, &err), 0);
    cr_assert_eq(i64, -5);
    cr_assert_eq(sl_gguf_get_i64(g, "u64.big", &i64, &err), 0);
    cr_assert_eq(i64, 1ll << 40);
    cr_assert_eq(sl_gguf_get_f32(g, "f32", &f, &err), 0);
    cr_assert_eq(f, 0.25f);
    cr_assert_eq(sl_gguf_get_f32(g, "f64", &f, &err), 0);
    cr_assert_eq(f, 1.5f);
    cr_assert_eq(sl_gguf_get_f32(g, "i8.neg", &f, &err), 0);
    cr_assert_eq(f, -5.0f);
    cr_assert_eq(sl_gguf_get_bool(g, "bool", &b, &err), 0);
    cr_assert_eq(b, 1);
    cr_assert_eq(sl_gguf_get_str(g, "str", &s, &err), 0);
    cr_assert_str_eq(s, "hi");
    int64_t arr[4];
    uint64_t n = 0;
    cr_assert_eq(sl_gguf_get_arr_i64(g, "arr.i32", arr, 4, &n, &err), 0);
    cr_assert_eq(n, 3);
    cr_assert(arr[0] == 1 && arr[1] == -14 && arr[2] == 7);

    /* range errors */
    struct {
        int rc;
        const char *phrase;
    } e[] = {
        {sl_gguf_get_u64(g, "i8.neg", &u64, &err), "out of range of u64"},
        {sl_gguf_get_u32(g, "u64.big", &u32, &err), "out of range of u32"},
        {sl_gguf_get_i64(g, "u64.max", &i64, &err), "out of range of i64"},
        {sl_gguf_get_f32(g, "f64.big", &f, &err), "out of range of f32"},
        {sl_gguf_get_bool(g, "u16.two", &b, &err), "out of range of bool"},
        {sl_gguf_get_u32(g, "str", &u32, &err), "is string, not an integer"},
        {sl_gguf_get_str(g, "u8", &s, &err), "is u8, not string"},
        {sl_gguf_get_f32(g, "str", &f, &err), "not a number"},
        {sl_gguf_get_bool(g, "f32", &b, &err), "not bool"},
        {sl_gguf_get_arr_i64(g, "arr.i32", arr, 2, &n, &err), "more than the 2 expected"},
        {sl_gguf_get_arr_i64(g, "arr.u64", arr, 4, &n, &err), "entry 1 out of range of i64"},
        {sl_gguf_get_arr_i64(g, "arr.f32", arr, 4, &n, &err), "array of f32, not an integer"},
        {sl_gguf_get_arr_i64(g, "u8", arr, 4, &n, &err), "is u8, not an integer array"},
    };
    /* each call above overwrote err; the messages are checked one by one below */
    for (size_t i = 0; i < sizeof e / sizeof e[0]; i++) cr_assert_eq(e[i].rc, SL_EFORMAT, "%zu", i);
#define MSG(call, phrase)                                                                          \
    do {                                                                                           \
        cr_assert_eq(call, SL_EFORMAT);                                                            \
        cr_assert(strstr(err.msg, phrase), "%s", err.msg);                                         \
        cr_assert(strstr(err.msg, "get.gguf"), "%s", err.msg);                                     \
    } while (0)
    MSG(sl_gguf_get_u64(g, "i8.neg", &u64, &err), "key 'i8.neg': value -5 out of range of u64");
    MSG(sl_gguf_get_u32(g, "u64.big", &u32, &err), "out of range of u32");
    MSG(sl_gguf_get_i64(g, "u64.max", &i64, &err), "out of range of i64");
    MSG(sl_gguf_get_f32(g, "f64.big", &f, &err), "out of range of f32");
    MSG(sl_gguf_get_bool(g, "u16.two", &b, &err), "out of range of bool");
    MSG(sl_gguf_get_u32(g, "str", &u32, &err), "key 'str' is string, not an integer");
    MSG(sl_gguf_get_str(g, "u8", &s, &err), "is u8, not string");
    MSG(sl_gguf_get_arr_i64(g, "arr.i32", arr, 2, &n, &err), "more than the 2 expected");
    cr_assert_eq(n, 3);
    MSG(sl_gguf_get_arr_i64(g, "arr.u64", arr, 4, &n, &err), "entry 1 out of range of i64");
    MSG(sl_gguf_get_arr_i64(g, "arr.f32", arr, 4, &n, &err), "array of f32, not an integer");
    cr_assert_eq(sl_gguf_get_u32(g, "absent", &u32, &err), SL_ENOTFOUND);
    cr_assert(strstr(err.msg, "key 'absent' not found"), "%s", err.msg);
    cr_assert_eq(sl_gguf_get_str(g, "absent", &s, &err), SL_ENOTFOUND);
    sl_gguf_close(&g);
    sl_gguf_close(&g); /* NULL is fine */
}

static char *print_to_string(const sl_gguf_kv *kv)
{
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    sl_gguf_print_kv(f, kv);
    fclose(f);
    return s;
}

Test(gguf, print_kv)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    char long_s[600];
    memset(long_s, 'x', sizeof long_s - 1);
    long_s[sizeof long_s - 1] = 0;
    sl_gguf_writer_set_str(w, "s", "a \"q\"\n");
    sl_gguf_writer_set_str(w, "long", long_s);
    sl_gguf_writer_set_u64(w, "u", UINT64_MAX);
    sl_gguf_writer_set_i16(w, "i", -3);
    sl_gguf_writer_set_f32(w, "f", 0.1f);
    sl_gguf_writer_set_bool(w, "b", 0);
    int32_t ia[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    sl_gguf_writer_set_arr(w, "a10", SL_GGUF_TYPE_INT32, ia, 10);
    sl_gguf_writer_set_arr(w, "a3", SL_GGUF_TYPE_INT32, ia, 3);
    sl_gguf_writer_set_arr(w, "a0", SL_GGUF_TYPE_FLOAT32, NULL, 0);
    const char *strs[2] = {"x", "y"};
    sl_gguf_writer_set_arr_str(w, "as", strs, 2);
    const char *p = path_of("print.gguf");
    write_or_die(w, p);
    sl_gguf_writer_free(&w);
    sl_gguf *g = open_ok(p);
    struct {
        const char *key, *want;
    } c[] = {
        {"s", "s = \"a \\\"q\\\"\\n\""},
        {"u", "u = 18446744073709551615"},
        {"i", "i = -3"},
        {"f", "f = 0.100000001"},
        {"b", "b = false"},
        {"a10", "a10 = [10 x i32] 0, 1, 2, 3, 4, 5, 6, 7, ..."},
        {"a3", "a3 = [3 x i32] 0, 1, 2"},
        {"a0", "a0 = [0 x f32]"},
        {"as", "as = [2 x string] \"x\", \"y\""},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        char *s = print_to_string(sl_gguf_find_kv(g, c[i].key));
        cr_assert_str_eq(s, c[i].want);
        free(s);
    }
    char *s = print_to_string(sl_gguf_find_kv(g, "long"));
    cr_assert(strstr(s, "... (599 bytes)"), "%s", s);
    cr_assert_lt(strlen(s), 300);
    free(s);
    cr_assert_str_eq(sl_gguf_type_name(SL_GGUF_TYPE_STRING), "string");
    cr_assert_str_eq(sl_gguf_type_name(99), "?");
    sl_gguf_close(&g);
}

/* ---- writer refusals and failures ---- */

Test(gguf, writer_refuses_bad_input)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 12, &err), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_init(&w, 4, &err), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_init(&w, 64, &err), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "general.alignment", 64), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "k", 1), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "k", "again"), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_set_u8(w, "", 1), SL_EINVAL);
    uint32_t x[1] = {1};
    cr_assert_eq(sl_gguf_writer_set_arr(w, "nested", SL_GGUF_TYPE_ARRAY, x, 1), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_set_arr(w, "strs", SL_GGUF_TYPE_STRING, x, 1), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_set_arr(w, "bad", 13, x, 1), SL_EINVAL);
    uint64_t ne[5] = {256, 1, 1, 1, 1};
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "t", SL_QTYPE_Q2_K, 1, ne, &err), 0);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "t", SL_QTYPE_Q2_K, 1, ne, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "duplicate tensor name 't'"), "%s", err.msg);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "t5", SL_QTYPE_Q2_K, 5, ne, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "n_dims 5"), "%s", err.msg);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "t0", SL_QTYPE_Q2_K, 0, ne, &err), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "tu", 99, 1, ne, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "unknown tensor type 99"), "%s", err.msg);
    uint64_t ne_bad[1] = {100};
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "tb", SL_QTYPE_Q2_K, 1, ne_bad, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "not a multiple of the block size"), "%s", err.msg);
    uint64_t ne_big[2] = {1ull << 62, 4};
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "tbig", SL_QTYPE_F32, 2, ne_big, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "overflows"), "%s", err.msg);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "", SL_QTYPE_F32, 1, ne, &err), SL_EINVAL);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "t2", SL_QTYPE_F32, 1, ne, &err), 1);
    /* what was refused left nothing behind: the file reads back */
    const char *p = path_of("refused.gguf");
    write_or_die(w, p);
    sl_gguf_writer_free(&w);
    cr_assert_null(w);
    sl_gguf *g = open_ok(p);
    cr_assert_eq(g->n_tensors, 2);
    cr_assert_eq(g->shards[0].n_kv, 2);
    cr_assert_eq(sl_gguf_find_tensor(g, "t2")->rel_offset, 128); /* 84 padded to 64 */
    sl_gguf_close(&g);
}

static int fill_fails(void *ctx, uint64_t tensor, uint64_t off, void *buf, uint64_t len,
                      sl_err *err)
{
    (void)ctx;
    if (tensor == 1) return sl_err_set(err, SL_EIO, "source read failed");
    memset(buf, 0, len);
    (void)off;
    return 0;
}

Test(gguf, writer_failures_remove_the_file)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    uint64_t ne[2] = {1024, 1024}; /* 4 MiB each */
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "a", SL_QTYPE_F32, 2, ne, &err), 0);
    cr_assert_eq(sl_gguf_writer_add_tensor(w, "b", SL_QTYPE_F32, 2, ne, &err), 1);
    const char *p = path_of("fail.gguf");
    cr_assert_eq(sl_gguf_writer_write(w, p, fill_fails, NULL, NULL, NULL, &err), SL_EIO);
    cr_assert(strstr(err.msg, "fail.gguf"), "%s", err.msg);
    cr_assert(strstr(err.msg, "tensor 'b'"), "%s", err.msg);
    cr_assert(strstr(err.msg, "source read failed"), "%s", err.msg);
    cr_assert_neq(access(p, F_OK), 0, "partial file left behind");

    /* a file size limit makes write() fail part way (EFBIG): SL_EIO, file gone */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {1u << 20, 1u << 20};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    cr_assert_eq(sl_gguf_writer_write(w, p, fill_pattern, NULL, NULL, NULL, &err), SL_EIO);
    cr_assert(strstr(err.msg, "write(") && strstr(err.msg, "fail.gguf"), "%s", err.msg);
    cr_assert_neq(access(p, F_OK), 0, "partial file left behind");

    /* an unwritable place */
    cr_assert_eq(
        sl_gguf_writer_write(w, "/nonexistent-dir/x.gguf", fill_pattern, NULL, NULL, NULL, &err),
        SL_EIO);
    cr_assert(strstr(err.msg, "/nonexistent-dir/x.gguf"), "%s", err.msg);
    sl_gguf_writer_free(&w);
}

/* Found by fuzz_gguf: tensors with a zero dimension whose (empty) data section began
 * past the end of the file were accepted. */
Test(gguf_regress, zero_dimension_tensor_is_refused)
{
    sl_gguf *g = NULL;
    sl_err err = {0};
    int rc = sl_gguf_open(&g, SL_SOURCE_DIR "/fuzz/corpus/gguf/regress-zero-dim", &err);
    cr_assert_eq(rc, SL_EFORMAT, "%d: %s", rc, err.msg);
    cr_assert_null(g);
    cr_assert(strstr(err.msg, "zero dimension") || strstr(err.msg, "past the end"), "%s", err.msg);
}
