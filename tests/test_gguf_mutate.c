/* test_gguf_mutate.c - the GGUF reader against a deterministic stream of broken
 * headers: bit flips, byte sets, cuts, length and count fields set to huge values,
 * swapped fields. Each mutant goes through a memfd into sl_gguf_open_fd; it must
 * either open (then every tensor lies inside the file and lookups and printing
 * work) or fail with a known SL_E code and a message naming the file. CI runs this
 * under ASan + UBSan, which turn any out-of-bounds access into a failure.
 */
#include "gguf.h"
#include "quant.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define N_MUTANTS 12000
#define SEED      0x5eed5eedull

static uint64_t rng_state;

static uint64_t rng(void)
{
    /* splitmix64: fixed seed, so every run feeds the same mutants */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t below(uint64_t n)
{
    return n ? rng() % n : 0;
}

static int fill_bytes(void *ctx, uint64_t tensor, uint64_t off, void *buf, uint64_t len,
                      sl_err *err)
{
    (void)ctx, (void)err;
    for (uint64_t i = 0; i < len; i++) ((uint8_t *)buf)[i] = (uint8_t)(tensor * 31 + off + i);
    return 0;
}

/* A small file with every kind of key and a few tensors. */
static unsigned char *base_file(uint64_t *n)
{
    sl_gguf_writer *w;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    sl_gguf_writer_set_str(w, "general.architecture", "mut");
    sl_gguf_writer_set_str(w, "general.name", "");
    sl_gguf_writer_set_u8(w, "m.u8", 1);
    sl_gguf_writer_set_i8(w, "m.i8", -1);
    sl_gguf_writer_set_u16(w, "m.u16", 2);
    sl_gguf_writer_set_i16(w, "m.i16", -2);
    sl_gguf_writer_set_u32(w, "m.u32", 3);
    sl_gguf_writer_set_i32(w, "m.i32", -3);
    sl_gguf_writer_set_u64(w, "m.u64", 4);
    sl_gguf_writer_set_i64(w, "m.i64", -4);
    sl_gguf_writer_set_f32(w, "m.f32", 0.5f);
    sl_gguf_writer_set_f64(w, "m.f64", 0.25);
    sl_gguf_writer_set_bool(w, "m.bool", 1);
    int32_t ia[4] = {1, 14, -3, 9};
    sl_gguf_writer_set_arr(w, "m.arr_i32", SL_GGUF_TYPE_INT32, ia, 4);
    uint64_t ua[2] = {7, 8};
    sl_gguf_writer_set_arr(w, "m.arr_u64", SL_GGUF_TYPE_UINT64, ua, 2);
    float fa[2] = {1.5f, 2.5f};
    sl_gguf_writer_set_arr(w, "m.arr_f32", SL_GGUF_TYPE_FLOAT32, fa, 2);
    sl_gguf_writer_set_arr(w, "m.arr_empty", SL_GGUF_TYPE_UINT8, NULL, 0);
    const char *toks[4] = {"<s>", "</s>", "", "hello"};
    sl_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 4);
    uint64_t ne_a[2] = {32, 2}, ne_b[2] = {256, 1}, ne_c[3] = {4, 2, 2}, ne_d[1] = {32};
    cr_assert_geq(sl_gguf_writer_add_tensor(w, "a.weight", SL_QTYPE_Q8_0, 2, ne_a, &err), 0);
    cr_assert_geq(sl_gguf_writer_add_tensor(w, "b.weight", SL_QTYPE_Q2_K, 2, ne_b, &err), 0);
    cr_assert_geq(sl_gguf_writer_add_tensor(w, "c.weight", SL_QTYPE_F32, 3, ne_c, &err), 0);
    cr_assert_geq(sl_gguf_writer_add_tensor(w, "d.bias", SL_QTYPE_F16, 1, ne_d, &err), 0);
    char path[] = "/tmp/sl_test_gguf_mutate_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(sl_gguf_writer_write(w, path, fill_bytes, NULL, NULL, NULL, &err), 0, "%s",
                 err.msg);
    sl_gguf_writer_free(&w);
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    *n = (uint64_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*n);
    cr_assert_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    unlink(path);
    return b;
}

/* Positions of the header's length/count fields (u64) and type fields (u32),
 * found by walking the (trusted) base file. */
typedef struct fields {
    uint64_t u64[256], n_u64;
    uint64_t u32[256], n_u32;
    uint64_t header_bytes;
} fields;

static uint64_t get64(const unsigned char *b, uint64_t at)
{
    uint64_t v;
    memcpy(&v, b + at, 8);
    return v;
}

static uint32_t get32(const unsigned char *b, uint64_t at)
{
    uint32_t v;
    memcpy(&v, b + at, 4);
    return v;
}

static void field_walk(const unsigned char *b, fields *f)
{
    static const uint64_t width[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    uint64_t p = 8;
    f->u32[f->n_u32++] = 4; /* version */
    uint64_t n_t = get64(b, 8), n_kv = get64(b, 16);
    f->u64[f->n_u64++] = 8;
    f->u64[f->n_u64++] = 16;
    p = 24;
    for (uint64_t i = 0; i < n_kv; i++) {
        f->u64[f->n_u64++] = p;
        p += 8 + get64(b, p);
        uint32_t t = get32(b, p);
        f->u32[f->n_u32++] = p;
        p += 4;
        if (t == SL_GGUF_TYPE_STRING) {
            f->u64[f->n_u64++] = p;
            p += 8 + get64(b, p);
        } else if (t == SL_GGUF_TYPE_ARRAY) {
            uint32_t et = get32(b, p);
            f->u32[f->n_u32++] = p;
            f->u64[f->n_u64++] = p + 4;
            uint64_t n = get64(b, p + 4);
            p += 12;
            for (uint64_t k = 0; k < n; k++) {
                if (et == SL_GGUF_TYPE_STRING) {
                    f->u64[f->n_u64++] = p;
                    p += 8 + get64(b, p);
                } else {
                    p += width[et];
                }
            }
        } else {
            p += width[t];
        }
    }
    for (uint64_t i = 0; i < n_t; i++) {
        f->u64[f->n_u64++] = p;
        p += 8 + get64(b, p);
        uint32_t nd = get32(b, p);
        f->u32[f->n_u32++] = p;
        p += 4;
        for (uint32_t d = 0; d < nd; d++, p += 8) f->u64[f->n_u64++] = p;
        f->u32[f->n_u32++] = p; /* type */
        p += 4;
        f->u64[f->n_u64++] = p; /* offset */
        p += 8;
    }
    f->header_bytes = p;
    cr_assert_lt(f->n_u64, 256);
    cr_assert_lt(f->n_u32, 256);
}

static uint64_t special64(uint64_t file_bytes)
{
    static const uint64_t v[] = {0,
                                 1,
                                 2,
                                 0xFFFFFFFFFFFFFFFFull,
                                 0xFFFFFFFFFFFFFFFEull,
                                 1ull << 40,
                                 1ull << 32,
                                 1ull << 63,
                                 (1ull << 63) - 1,
                                 0xFFFFFFFFull,
                                 256,
                                 SL_GGUF_MAX_HEADER_BYTES};
    uint64_t k = below(sizeof v / sizeof v[0] + 3);
    if (k < sizeof v / sizeof v[0]) return v[k];
    if (k == sizeof v / sizeof v[0]) return file_bytes - below(64);
    if (k == sizeof v / sizeof v[0] + 1) return below(64);
    return rng();
}

static uint32_t special32(void)
{
    static const uint32_t v[] = {0,  1,  2,  3,  4,  5,           8,          9,
                                 10, 12, 13, 30, 31, 0xFFFFFFFFu, 0x80000000u};
    uint64_t k = below(sizeof v / sizeof v[0] + 1);
    return k < sizeof v / sizeof v[0] ? v[k] : (uint32_t)rng();
}

/* One mutant of base into m (room for base_n + 64 bytes); returns its length. */
static uint64_t mutate(unsigned char *m, const unsigned char *base, uint64_t base_n,
                       const fields *f)
{
    memcpy(m, base, base_n);
    uint64_t n = base_n;
    int n_mut = 1 + (int)below(3);
    for (int k = 0; k < n_mut; k++) {
        /* most mutations hit the header, which is what the reader parses */
        uint64_t span = below(10) < 8 ? f->header_bytes : n;
        uint64_t v64;
        uint32_t v32;
        switch (below(9)) {
        case 0: /* bit flip */
        case 1: {
            uint64_t at = below(span);
            m[at] ^= (unsigned char)(1u << below(8));
            break;
        }
        case 2: /* byte set */
            m[below(span)] = (unsigned char)rng();
            break;
        case 3: /* cut */
            n = below(n + 1);
            break;
        case 4: /* a length or count field */
        case 5: {
            uint64_t at = f->u64[below(f->n_u64)];
            v64 = special64(base_n);
            if (at + 8 <= n) memcpy(m + at, &v64, 8);
            break;
        }
        case 6: { /* a type field */
            uint64_t at = f->u32[below(f->n_u32)];
            v32 = special32();
            if (at + 4 <= n) memcpy(m + at, &v32, 4);
            break;
        }
        case 7: { /* two length fields swapped */
            uint64_t a = f->u64[below(f->n_u64)], b = f->u64[below(f->n_u64)];
            if (a + 8 <= n && b + 8 <= n) {
                uint64_t x = get64(m, a), y = get64(m, b);
                memcpy(m + a, &y, 8);
                memcpy(m + b, &x, 8);
            }
            break;
        }
        case 8: { /* a field nudged by a little */
            uint64_t at = f->u64[below(f->n_u64)];
            if (at + 8 <= n) {
                v64 = get64(m, at) + below(9) - 4;
                memcpy(m + at, &v64, 8);
            }
            break;
        }
        }
    }
    return n;
}

/* What an opened mutant must satisfy. */
static void check_opened(const sl_gguf *g, FILE *sink)
{
    const sl_gguf_shard *sh = &g->shards[0];
    cr_assert_eq(g->n_shards, 1);
    cr_assert_eq(sh->n_tensor, g->n_tensors);
    cr_assert_eq(sh->data_offset % sh->alignment, 0);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const sl_gguf_tensor *t = &g->tensors[i];
        cr_assert_leq(t->offset, sh->file_bytes);
        cr_assert_leq(t->n_bytes, sh->file_bytes - t->offset);
        cr_assert_eq(t->offset % sh->alignment, 0);
        cr_assert(t->n_dims >= 1 && t->n_dims <= SL_GGUF_MAX_DIMS);
        cr_assert_not_null(sl_qtype_get(t->type));
        if (strlen(t->name.s) == t->name.len) cr_assert_eq(sl_gguf_find_tensor(g, t->name.s), t);
    }
    for (uint64_t i = 0; i < sh->n_kv; i++) {
        const sl_gguf_kv *kv = &sh->kv[i];
        cr_assert_gt(kv->key.len, 0);
        if (strlen(kv->key.s) == kv->key.len) cr_assert_eq(sl_gguf_find_kv(g, kv->key.s), kv);
        sl_gguf_print_kv(sink, kv);
    }
    uint32_t u32;
    float f;
    const char *s;
    sl_err err;
    sl_gguf_get_u32(g, "m.u32", &u32, &err);
    sl_gguf_get_f32(g, "m.f32", &f, &err);
    sl_gguf_get_str(g, "general.architecture", &s, &err);
}

Test(gguf_mutate, ten_thousand_mutants, .timeout = 120)
{
    uint64_t base_n;
    unsigned char *base = base_file(&base_n);
    fields f = {0};
    field_walk(base, &f);
    unsigned char *m = malloc(base_n + 64);
    int fd = memfd_create("gguf_mutant", MFD_CLOEXEC);
    cr_assert_geq(fd, 0);
    FILE *sink = fopen("/dev/null", "w");
    cr_assert_not_null(sink);

    /* the base itself opens */
    cr_assert_eq(pwrite(fd, base, base_n, 0), (ssize_t)base_n);
    sl_gguf *g = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_gguf_open_fd(&g, fd, "mutant", &err), 0, "%s", err.msg);
    cr_assert_eq(g->n_tensors, 4);
    cr_assert_eq(g->shards[0].header_bytes, f.header_bytes);
    sl_gguf_close(&g);

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rng_state = SEED;
    uint64_t ok = 0, rejected = 0, by_code[16] = {0};
    for (int i = 0; i < N_MUTANTS; i++) {
        uint64_t n = mutate(m, base, base_n, &f);
        cr_assert_eq(ftruncate(fd, 0), 0);
        if (n) cr_assert_eq(pwrite(fd, m, n, 0), (ssize_t)n);
        memset(&err, 0, sizeof err);
        int rc = sl_gguf_open_fd(&g, fd, "mutant", &err);
        if (rc == 0) {
            cr_assert_not_null(g);
            check_opened(g, sink);
            sl_gguf_close(&g);
            ok++;
            continue;
        }
        cr_assert_null(g, "mutant %d", i);
        cr_assert_lt(rc, 0);
        cr_assert_str_neq(sl_status_name(rc), "SL_E?", "mutant %d: code %d", i, rc);
        cr_assert_eq(err.code, rc, "mutant %d", i);
        cr_assert_gt(strlen(err.msg), 0, "mutant %d: empty message", i);
        cr_assert(strstr(err.msg, "mutant"), "mutant %d: message lacks the name: %s", i, err.msg);
        cr_assert(rc == SL_EFORMAT || rc == SL_EUNSUPPORTED, "mutant %d: %s: %s", i,
                  sl_status_name(rc), err.msg);
        by_code[-rc]++;
        rejected++;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    printf("gguf mutate: %d mutants of a %" PRIu64 "-byte file: %" PRIu64 " opened, %" PRIu64
           " rejected (%" PRIu64 " SL_EFORMAT, %" PRIu64 " SL_EUNSUPPORTED) in %.0f ms\n",
           N_MUTANTS, base_n, ok, rejected, by_code[-SL_EFORMAT], by_code[-SL_EUNSUPPORTED], ms);
    cr_assert_gt(ok, N_MUTANTS / 50, "too few mutants open: the mutator breaks everything");
    cr_assert_gt(rejected, N_MUTANTS / 2, "too few mutants rejected: the mutator is broken");
    cr_assert_eq(ok + rejected, N_MUTANTS);
    fclose(sink);
    close(fd);
    free(m);
    free(base);
}
