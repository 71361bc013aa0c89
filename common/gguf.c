/* gguf.c - the GGUF v3 reader: one file (sl_gguf_open_fd) or a split checkpoint
 * (sl_gguf_open), plus the typed getters and the value printer.
 *
 * parse_shard reads one header front to back through a buffered pread reader that
 * never reads past the end of the file nor past SL_GGUF_MAX_HEADER_BYTES. Every
 * length and count is checked against the bytes left before anything is
 * allocated, so what a header can make us allocate is bounded by its size. All
 * strings, arrays and tensor names of a shard live in one arena (shard.mem) freed
 * in one go; g->tensors is one array for all shards. g->index holds a hash table
 * of tensor names and shard 0's keys sorted for bsearch. Nothing here is touched
 * after open, so an opened sl_gguf may be read by any number of threads.
 */
#include "gguf.h"
#include "quant.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

#define FNV_BASIS      0xcbf29ce484222325ull
#define FNV_PRIME      0x100000001b3ull
#define RD_BUF_BYTES   (128u << 10)
#define MAX_NAME_SHOWN 96 /* bytes of a key or tensor name quoted in messages */

/* A key or tensor name made fit for a one-line message: control bytes become '?',
 * and it is cut after MAX_NAME_SHOWN bytes. SHOW's buffer lives until the end of
 * the enclosing block. */
#define SHOW(x) show((char[MAX_NAME_SHOWN + 4]){0}, (x))
static const char *show(char *buf, const char *s)
{
    size_t i = 0;
    for (; s[i] && i < MAX_NAME_SHOWN; i++)
        buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    if (s[i])
        memcpy(buf + i, "...", 4);
    else
        buf[i] = '\0';
    return buf;
}

/* ---- arena: bump allocation in growing chunks, freed all at once ---- */

typedef struct chunk {
    struct chunk *next;
    size_t cap, used;
    size_t pad_; /* keeps the data after the header 16-byte aligned */
} chunk;

typedef struct arena {
    chunk *head;
    size_t next_cap;
} arena;

static void *arena_alloc(arena *a, uint64_t n)
{
    if (n > SIZE_MAX / 2) return NULL;
    size_t sz = ((size_t)n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < sz) {
        size_t cap = a->next_cap ? a->next_cap : 4096;
        if (a->next_cap < (1u << 20)) a->next_cap = cap * 2;
        if (cap < sz) cap = sz;
        chunk *c = malloc(sizeof(chunk) + cap);
        if (!c) return NULL;
        c->cap = cap;
        c->used = 0;
        c->next = a->head;
        a->head = c;
    }
    void *p = (unsigned char *)(a->head + 1) + a->head->used;
    a->head->used += sz;
    return p;
}

static void arena_free(arena *a)
{
    if (!a) return;
    for (chunk *c = a->head, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    free(a);
}

/* ---- the index: tensor names hashed, shard 0's keys sorted ---- */

typedef struct gguf_index {
    uint64_t mask;          /* capacity - 1, capacity a power of two >= 2 n_tensors */
    uint64_t *slot;         /* [capacity] tensor index + 1, 0 when empty */
    const sl_gguf_kv **kv0; /* [n_kv0] shard 0's kv sorted by key (in its arena) */
    uint64_t n_kv0;
} gguf_index;

static uint64_t fnv(uint64_t h, const void *p, uint64_t n)
{
    const unsigned char *b = p;
    for (uint64_t i = 0; i < n; i++) h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

/* ---- buffered reader over pread ---- */

typedef struct reader {
    int fd;
    const char *name;
    uint64_t file_bytes;
    uint64_t limit; /* min(file_bytes, SL_GGUF_MAX_HEADER_BYTES) */
    uint64_t pos;   /* next byte to consume */
    uint64_t buf_off, buf_len;
    unsigned char *buf; /* [buf_cap] */
    uint64_t buf_cap;   /* RD_BUF_BYTES, or less for a smaller file */
    uint64_t hash;      /* FNV-1a of every byte consumed */
    sl_err *err;
} reader;

/* pread until len bytes or end of file; returns bytes read or -errno. */
static int64_t pread_full(int fd, void *buf, uint64_t len, uint64_t off)
{
    uint64_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, (char *)buf + got, len - got, (off_t)(off + got));
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) break;
        got += (uint64_t)n;
    }
    return (int64_t)got;
}

/* Checks that count items of at least width bytes each fit in what is left of the
 * header; the one place that turns a short file into "truncated" (a fixed field,
 * is_len 0) or "runs past the end" (a length or count read from the file). */
static int rd_check(reader *r, uint64_t count, uint64_t width, int is_len, const char *what)
{
    uint64_t left_file = r->file_bytes - r->pos;
    uint64_t left = r->limit - r->pos;
    if (count <= left / width) return 0;
    if (count <= left_file / width)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: %s (%" PRIu64 " x %" PRIu64 " bytes at offset %" PRIu64
                          ") makes the header larger than %llu MiB",
                          r->name, what, count, width, r->pos, SL_GGUF_MAX_HEADER_BYTES >> 20);
    if (!is_len)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: truncated: %s needs %" PRIu64 " bytes at offset %" PRIu64
                          ", the file has %" PRIu64,
                          r->name, what, count, r->pos, r->file_bytes);
    if (width == 1)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: %s of %" PRIu64 " bytes at offset %" PRIu64
                          " runs past the end of the file (%" PRIu64 " bytes)",
                          r->name, what, count, r->pos, r->file_bytes);
    return sl_err_set(r->err, SL_EFORMAT,
                      "%s: %s of %" PRIu64 " x %" PRIu64 " bytes at offset %" PRIu64
                      " runs past the end of the file (%" PRIu64 " bytes)",
                      r->name, what, count, width, r->pos, r->file_bytes);
}

static int rd_fits(reader *r, uint64_t count, uint64_t width, const char *what)
{
    return rd_check(r, count, width, 1, what);
}

static int rd_bytes(reader *r, void *dst, uint64_t n, const char *what)
{
    int rc = rd_check(r, n, 1, 0, what);
    if (rc) return rc;
    unsigned char *d = dst;
    while (n) {
        if (r->pos >= r->buf_off && r->pos < r->buf_off + r->buf_len) {
            uint64_t at = r->pos - r->buf_off;
            uint64_t k = r->buf_len - at < n ? r->buf_len - at : n;
            memcpy(d, r->buf + at, k);
            r->hash = fnv(r->hash, d, k);
            d += k;
            r->pos += k;
            n -= k;
            continue;
        }
        /* Large reads go straight to dst; small ones refill the buffer. */
        int direct = n >= r->buf_cap;
        uint64_t want = direct ? n : r->file_bytes - r->pos;
        if (!direct && want > r->buf_cap) want = r->buf_cap;
        int64_t got = pread_full(r->fd, direct ? d : r->buf, want, r->pos);
        if (got < 0)
            return sl_err_errno(r->err, SL_EIO, (int)-got,
                                "pread(%s, off %" PRIu64 ", len %" PRIu64 ")", r->name, r->pos,
                                want);
        if ((uint64_t)got < (direct ? n : 1) || got == 0)
            return sl_err_set(r->err, SL_EIO,
                              "%s: the file shrank while being read (%s at offset %" PRIu64 ")",
                              r->name, what, r->pos);
        if (direct) {
            r->hash = fnv(r->hash, d, n);
            r->pos += n;
            return 0;
        }
        r->buf_off = r->pos;
        r->buf_len = (uint64_t)got;
    }
    return 0;
}

static int rd_u32(reader *r, uint32_t *v, const char *what)
{
    return rd_bytes(r, v, 4, what);
}

static int rd_u64(reader *r, uint64_t *v, const char *what)
{
    return rd_bytes(r, v, 8, what);
}

/* A string: u64 length, then the bytes; stored NUL terminated in the arena. */
static int rd_str(reader *r, arena *a, sl_gguf_str *s, const char *what)
{
    uint64_t len;
    int rc = rd_u64(r, &len, what);
    if (rc) return rc;
    if ((rc = rd_fits(r, len, 1, what))) return rc;
    s->s = arena_alloc(a, len + 1);
    if (!s->s)
        return sl_err_set(r->err, SL_ENOMEM, "%s: out of memory for %s of %" PRIu64 " bytes",
                          r->name, what, len);
    if ((rc = rd_bytes(r, s->s, len, what))) return rc;
    s->s[len] = '\0';
    s->len = len;
    return 0;
}

/* ---- metadata values ---- */

uint64_t sl_gguf_scalar_width(uint32_t t)
{
    switch (t) {
    case SL_GGUF_TYPE_UINT8:
    case SL_GGUF_TYPE_INT8:
    case SL_GGUF_TYPE_BOOL:
        return 1;
    case SL_GGUF_TYPE_UINT16:
    case SL_GGUF_TYPE_INT16:
        return 2;
    case SL_GGUF_TYPE_UINT32:
    case SL_GGUF_TYPE_INT32:
    case SL_GGUF_TYPE_FLOAT32:
        return 4;
    case SL_GGUF_TYPE_UINT64:
    case SL_GGUF_TYPE_INT64:
    case SL_GGUF_TYPE_FLOAT64:
        return 8;
    }
    return 0;
}

/* Bytes on disk of one value of type (for strings and arrays: the least). */
static uint64_t type_width(uint32_t t)
{
    if (t == SL_GGUF_TYPE_STRING) return 8; /* the length field */
    if (t == SL_GGUF_TYPE_ARRAY) return 12; /* element type and count */
    return sl_gguf_scalar_width(t);
}

static int type_is_int(uint32_t t)
{
    return t == SL_GGUF_TYPE_UINT8 || t == SL_GGUF_TYPE_INT8 || t == SL_GGUF_TYPE_UINT16 ||
           t == SL_GGUF_TYPE_INT16 || t == SL_GGUF_TYPE_UINT32 || t == SL_GGUF_TYPE_INT32 ||
           t == SL_GGUF_TYPE_UINT64 || t == SL_GGUF_TYPE_INT64;
}

static int type_is_signed(uint32_t t)
{
    return t == SL_GGUF_TYPE_INT8 || t == SL_GGUF_TYPE_INT16 || t == SL_GGUF_TYPE_INT32 ||
           t == SL_GGUF_TYPE_INT64;
}

const char *sl_gguf_type_name(uint32_t type)
{
    static const char *const names[SL_GGUF_TYPE_COUNT] = {
        "u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
        "bool", "string", "array", "u64", "i64", "f64",
    };
    return type < SL_GGUF_TYPE_COUNT ? names[type] : "?";
}

/* Decodes one scalar of type t from its little-endian bytes into kv's union. */
static void scalar_set(sl_gguf_kv *kv, uint32_t t, const unsigned char *b)
{
    uint8_t u8;
    int8_t i8;
    uint16_t u16;
    int16_t i16;
    uint32_t u32;
    int32_t i32;
    float f32;
    switch (t) {
    case SL_GGUF_TYPE_UINT8:
        memcpy(&u8, b, 1), kv->v.u64 = u8;
        break;
    case SL_GGUF_TYPE_BOOL:
        memcpy(&u8, b, 1), kv->v.u64 = u8 != 0;
        break;
    case SL_GGUF_TYPE_INT8:
        memcpy(&i8, b, 1), kv->v.i64 = i8;
        break;
    case SL_GGUF_TYPE_UINT16:
        memcpy(&u16, b, 2), kv->v.u64 = u16;
        break;
    case SL_GGUF_TYPE_INT16:
        memcpy(&i16, b, 2), kv->v.i64 = i16;
        break;
    case SL_GGUF_TYPE_UINT32:
        memcpy(&u32, b, 4), kv->v.u64 = u32;
        break;
    case SL_GGUF_TYPE_INT32:
        memcpy(&i32, b, 4), kv->v.i64 = i32;
        break;
    case SL_GGUF_TYPE_FLOAT32:
        memcpy(&f32, b, 4), kv->v.f64 = f32;
        break;
    case SL_GGUF_TYPE_UINT64:
        memcpy(&kv->v.u64, b, 8);
        break;
    case SL_GGUF_TYPE_INT64:
        memcpy(&kv->v.i64, b, 8);
        break;
    case SL_GGUF_TYPE_FLOAT64:
        memcpy(&kv->v.f64, b, 8);
        break;
    }
}

static int rd_value(reader *r, arena *a, sl_gguf_kv *kv)
{
    const char *k = kv->key.s;
    char what[MAX_NAME_SHOWN + 64];
    int rc;
    if (kv->type >= SL_GGUF_TYPE_COUNT)
        return sl_err_set(r->err, SL_EFORMAT, "%s: key '%s': unknown value type %" PRIu32, r->name,
                          SHOW(k), kv->type);
#define WHAT(s) (snprintf(what, sizeof what, "key '%s': %s", SHOW(k), s), what)
    if (kv->type == SL_GGUF_TYPE_STRING) return rd_str(r, a, &kv->v.str, WHAT("string value"));
    if (kv->type != SL_GGUF_TYPE_ARRAY) {
        unsigned char b[8];
        if ((rc = rd_bytes(r, b, type_width(kv->type), WHAT("value")))) return rc;
        scalar_set(kv, kv->type, b);
        return 0;
    }
    if ((rc = rd_u32(r, &kv->arr_type, WHAT("array type")))) return rc;
    if ((rc = rd_u64(r, &kv->arr_n, WHAT("array length")))) return rc;
    if (kv->arr_type == SL_GGUF_TYPE_ARRAY)
        return sl_err_set(r->err, SL_EUNSUPPORTED,
                          "%s: key '%s': nested array (array of arrays) is not supported", r->name,
                          SHOW(k));
    if (kv->arr_type >= SL_GGUF_TYPE_COUNT)
        return sl_err_set(r->err, SL_EFORMAT, "%s: key '%s': array of unknown value type %" PRIu32,
                          r->name, SHOW(k), kv->arr_type);
    uint64_t w = type_width(kv->arr_type);
    if ((rc = rd_fits(r, kv->arr_n, w, WHAT("array")))) return rc;
    if (kv->arr_type != SL_GGUF_TYPE_STRING) {
        kv->v.arr = arena_alloc(a, kv->arr_n * w + 1);
        if (!kv->v.arr) goto nomem;
        return rd_bytes(r, kv->v.arr, kv->arr_n * w, WHAT("array"));
    }
    sl_gguf_str *s = arena_alloc(a, kv->arr_n * sizeof *s + 1);
    if (!s) goto nomem;
    kv->v.arr = s;
    WHAT("string in the array");
    for (uint64_t i = 0; i < kv->arr_n; i++)
        if ((rc = rd_str(r, a, &s[i], what))) return rc;
#undef WHAT
    return 0;
nomem:
    return sl_err_set(r->err, SL_ENOMEM, "%s: key '%s': out of memory for %" PRIu64 " values",
                      r->name, SHOW(k), kv->arr_n);
}

static int str_cmp(const sl_gguf_str *a, const sl_gguf_str *b)
{
    uint64_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->s, b->s, n);
    if (c) return c;
    return a->len < b->len ? -1 : a->len > b->len;
}

static int kv_ptr_cmp(const void *a, const void *b)
{
    const sl_gguf_kv *x = *(const sl_gguf_kv *const *)a, *y = *(const sl_gguf_kv *const *)b;
    return str_cmp(&x->key, &y->key);
}

static const sl_gguf_kv *kv_bsearch(const sl_gguf_kv **sorted, uint64_t n, const char *key)
{
    sl_gguf_str want = {strlen(key), (char *)key};
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = str_cmp(&sorted[mid]->key, &want);
        if (c == 0) return sorted[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* ---- tensors ---- */

static int tensor_check(reader *r, sl_gguf_tensor *t, uint64_t alignment)
{
    const char *nm = t->name.s;
    const sl_qtype_info *qi = sl_qtype_get(t->type);
    if (!qi || qi->block_elems == 0 || qi->block_bytes == 0)
        return sl_err_set(r->err, SL_EUNSUPPORTED, "%s: tensor '%s': unknown tensor type %" PRIu32,
                          r->name, SHOW(nm), t->type);
    uint64_t nel = 1;
    int over = 0;
    for (uint32_t d = 0; d < SL_GGUF_MAX_DIMS; d++) {
        if (t->ne[d] > (uint64_t)INT64_MAX) over = 1;
        if (__builtin_mul_overflow(nel, t->ne[d], &nel)) over = 1;
    }
    if (over || nel > (uint64_t)INT64_MAX)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: tensor '%s': element count overflows (ne %" PRIu64 " x %" PRIu64
                          " x %" PRIu64 " x %" PRIu64 ")",
                          r->name, SHOW(nm), t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
    if (nel == 0)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: tensor '%s': a zero dimension (ne %" PRIu64 " x %" PRIu64
                          " x %" PRIu64 " x %" PRIu64 ")",
                          r->name, SHOW(nm), t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
    if (t->ne[0] % qi->block_elems)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: tensor '%s': ne[0] = %" PRIu64
                          " is not a multiple of the block size %" PRIu32 " of %s",
                          r->name, SHOW(nm), t->ne[0], qi->block_elems, qi->name);
    uint64_t bytes = t->ne[0] / qi->block_elems;
    int ovf = __builtin_mul_overflow(bytes, qi->block_bytes, &bytes);
    for (uint32_t d = 1; d < SL_GGUF_MAX_DIMS; d++)
        ovf |= __builtin_mul_overflow(bytes, t->ne[d], &bytes);
    if (ovf)
        return sl_err_set(r->err, SL_EFORMAT, "%s: tensor '%s': byte size overflows", r->name,
                          SHOW(nm));
    t->n_bytes = bytes;
    if (t->rel_offset % alignment)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: tensor '%s': offset %" PRIu64
                          " not a multiple of alignment %" PRIu64,
                          r->name, SHOW(nm), t->rel_offset, alignment);
    return 0;
}

static int tensor_ptr_cmp(const void *a, const void *b)
{
    const sl_gguf_tensor *x = *(const sl_gguf_tensor *const *)a;
    const sl_gguf_tensor *y = *(const sl_gguf_tensor *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->n_bytes != y->n_bytes) return x->n_bytes < y->n_bytes ? -1 : 1;
    return 0;
}

/* Data ranges inside the file and disjoint (checked in offset order). */
static int tensors_place(reader *r, sl_gguf_shard *sh, sl_gguf_tensor *t)
{
    if (sh->n_tensor && r->file_bytes < sh->data_offset)
        return sl_err_set(r->err, SL_EFORMAT,
                          "%s: the data section starts at %" PRIu64
                          ", past the end of the file (%" PRIu64 " bytes)",
                          r->name, sh->data_offset, r->file_bytes);
    for (uint64_t i = 0; i < sh->n_tensor; i++) {
        uint64_t room = r->file_bytes > sh->data_offset ? r->file_bytes - sh->data_offset : 0;
        if (t[i].rel_offset > room || t[i].n_bytes > room - t[i].rel_offset)
            return sl_err_set(r->err, SL_EFORMAT,
                              "%s: tensor '%s': data at offset %" PRIu64 " + %" PRIu64
                              " bytes runs past the end of the file (data section %" PRIu64
                              " bytes)",
                              r->name, SHOW(t[i].name.s), t[i].rel_offset, t[i].n_bytes, room);
        t[i].offset = sh->data_offset + t[i].rel_offset;
    }
    if (sh->n_tensor < 2) return 0;
    const sl_gguf_tensor **by_off = malloc(sh->n_tensor * sizeof *by_off);
    if (!by_off) return sl_err_set(r->err, SL_ENOMEM, "%s: out of memory sorting tensors", r->name);
    for (uint64_t i = 0; i < sh->n_tensor; i++) by_off[i] = &t[i];
    qsort(by_off, sh->n_tensor, sizeof *by_off, tensor_ptr_cmp);
    int rc = 0;
    for (uint64_t i = 1; i < sh->n_tensor; i++) {
        const sl_gguf_tensor *p = by_off[i - 1], *c = by_off[i];
        if (p->rel_offset + p->n_bytes > c->rel_offset) {
            rc = sl_err_set(r->err, SL_EFORMAT,
                            "%s: tensors '%s' [%" PRIu64 ", +%" PRIu64 ") and '%s' [%" PRIu64
                            ", +%" PRIu64 ") overlap",
                            r->name, SHOW(p->name.s), p->rel_offset, p->n_bytes, SHOW(c->name.s),
                            c->rel_offset, c->n_bytes);
            break;
        }
    }
    free(by_off);
    return rc;
}

/* ---- one shard ---- */

/* Parses the header of g->shards[si] from fd (owned from here on) and appends its
 * tensors to g->tensors. *sorted gets the shard's kv sorted by key. g->fingerprint
 * carries the running hash in and out. */
static int parse_shard(sl_gguf *g, uint32_t si, int fd, const char *name,
                       const sl_gguf_kv ***sorted, sl_err *err)
{
    sl_gguf_shard *sh = &g->shards[si];
    sh->fd = fd;
    sh->path = strdup(name);
    arena *a = calloc(1, sizeof *a);
    sh->mem = a;
    if (!sh->path || !a) return sl_err_set(err, SL_ENOMEM, "%s: out of memory", name);
    name = sh->path;

    struct stat st;
    if (fstat(fd, &st) != 0) return sl_err_errno(err, SL_EIO, errno, "fstat(%s)", name);
    reader r = {.fd = fd, .name = name, .err = err, .hash = g->fingerprint};
    r.file_bytes = st.st_size > 0 ? (uint64_t)st.st_size : 0;
    r.limit = r.file_bytes < SL_GGUF_MAX_HEADER_BYTES ? r.file_bytes : SL_GGUF_MAX_HEADER_BYTES;
    sh->file_bytes = r.file_bytes;
    /* A small file needs a small buffer (the fuzzer opens many). */
    r.buf_cap = r.limit < RD_BUF_BYTES ? r.limit + 1 : RD_BUF_BYTES;
    r.buf = malloc(r.buf_cap);
    if (!r.buf) return sl_err_set(err, SL_ENOMEM, "%s: out of memory", name);

    int rc;
    uint32_t magic;
    uint64_t n_tensor, n_kv;
    sl_gguf_tensor *t = NULL;
    if ((rc = rd_u32(&r, &magic, "magic"))) goto out;
    if (magic != SL_GGUF_MAGIC) {
        rc = sl_err_set(err, SL_EFORMAT, "%s: bad magic 0x%08" PRIx32 " (not a GGUF file)", name,
                        magic);
        goto out;
    }
    if ((rc = rd_u32(&r, &sh->version, "version"))) goto out;
    if (sh->version != SL_GGUF_VERSION) {
        rc = sl_err_set(err, SL_EUNSUPPORTED, "%s: unsupported version %" PRIu32 "%s", name,
                        sh->version,
                        sh->version == __builtin_bswap32(SL_GGUF_VERSION)
                            ? " (a big-endian GGUF; only little-endian v3 is read)"
                            : " (only GGUF v3 is read)");
        goto out;
    }
    if ((rc = rd_u64(&r, &n_tensor, "n_tensors")) || (rc = rd_u64(&r, &n_kv, "n_kv"))) goto out;
    /* Least bytes of one kv: key len 8 + key 1 + type 4 + value 1; of one tensor
     * info: name len 8 + name 1 + n_dims 4 + ne 8 + type 4 + offset 8. */
    uint64_t left = r.limit - r.pos;
    if (n_kv > left / 14) {
        rc = sl_err_set(err, SL_EFORMAT,
                        "%s: n_kv %" PRIu64 " is impossible: at most %" PRIu64
                        " header bytes follow (truncated or corrupt)",
                        name, n_kv, left);
        goto out;
    }
    if (n_tensor > (left - n_kv * 14) / 33) {
        rc = sl_err_set(err, SL_EFORMAT,
                        "%s: n_tensors %" PRIu64 " is impossible: at most %" PRIu64
                        " header bytes follow (truncated or corrupt)",
                        name, n_tensor, left);
        goto out;
    }

    sh->n_kv = n_kv;
    sh->kv = arena_alloc(a, n_kv * sizeof *sh->kv + 1);
    const sl_gguf_kv **srt = arena_alloc(a, n_kv * sizeof *srt + 1);
    if (!sh->kv || !srt) {
        rc = sl_err_set(err, SL_ENOMEM, "%s: out of memory for %" PRIu64 " keys", name, n_kv);
        goto out;
    }
    memset(sh->kv, 0, n_kv * sizeof *sh->kv);
    for (uint64_t i = 0; i < n_kv; i++) {
        sl_gguf_kv *kv = &sh->kv[i];
        if ((rc = rd_str(&r, a, &kv->key, "key"))) goto out;
        if (kv->key.len == 0) {
            rc = sl_err_set(err, SL_EFORMAT, "%s: key %" PRIu64 " is an empty key", name, i);
            goto out;
        }
        if ((rc = rd_u32(&r, &kv->type, "value type")) || (rc = rd_value(&r, a, kv))) goto out;
        srt[i] = kv;
    }
    qsort(srt, n_kv, sizeof *srt, kv_ptr_cmp);
    for (uint64_t i = 1; i < n_kv; i++)
        if (str_cmp(&srt[i - 1]->key, &srt[i]->key) == 0) {
            rc = sl_err_set(err, SL_EFORMAT, "%s: duplicate key '%s'", name, SHOW(srt[i]->key.s));
            goto out;
        }
    *sorted = srt;

    sh->alignment = SL_GGUF_DEFAULT_ALIGNMENT;
    const sl_gguf_kv *al = kv_bsearch(srt, n_kv, SL_GGUF_KEY_ALIGNMENT);
    if (al) {
        if (al->type != SL_GGUF_TYPE_UINT32) {
            rc = sl_err_set(err, SL_EFORMAT, "%s: general.alignment is %s, must be u32", name,
                            sl_gguf_type_name(al->type));
            goto out;
        }
        if (al->v.u64 == 0 || (al->v.u64 & (al->v.u64 - 1))) {
            rc = sl_err_set(err, SL_EFORMAT,
                            "%s: general.alignment %" PRIu64 " is not a nonzero power of two", name,
                            al->v.u64);
            goto out;
        }
        sh->alignment = al->v.u64;
    }

    sh->first_tensor = g->n_tensors;
    sh->n_tensor = n_tensor;
    t = realloc(g->tensors, (g->n_tensors + n_tensor + 1) * sizeof *t);
    if (!t) {
        rc =
            sl_err_set(err, SL_ENOMEM, "%s: out of memory for %" PRIu64 " tensors", name, n_tensor);
        goto out;
    }
    g->tensors = t;
    t += g->n_tensors;
    for (uint64_t i = 0; i < n_tensor; i++) {
        sl_gguf_tensor *ti = &t[i];
        memset(ti, 0, sizeof *ti);
        if ((rc = rd_str(&r, a, &ti->name, "tensor name"))) goto out;
        if (ti->name.len == 0) {
            rc = sl_err_set(err, SL_EFORMAT, "%s: tensor %" PRIu64 " has an empty name", name, i);
            goto out;
        }
        if ((rc = rd_u32(&r, &ti->n_dims, "tensor n_dims"))) goto out;
        if (ti->n_dims == 0 || ti->n_dims > SL_GGUF_MAX_DIMS) {
            rc = sl_err_set(err, SL_EFORMAT, "%s: tensor '%s': n_dims %" PRIu32 " (must be 1..%d)",
                            name, SHOW(ti->name.s), ti->n_dims, SL_GGUF_MAX_DIMS);
            goto out;
        }
        for (uint32_t d = 0; d < SL_GGUF_MAX_DIMS; d++) ti->ne[d] = 1;
        if ((rc = rd_bytes(&r, ti->ne, 8ull * ti->n_dims, "tensor ne")) ||
            (rc = rd_u32(&r, &ti->type, "tensor type")) ||
            (rc = rd_u64(&r, &ti->rel_offset, "tensor offset")))
            goto out;
        ti->shard = si;
        if ((rc = tensor_check(&r, ti, sh->alignment))) goto out;
        g->n_tensors++; /* counted once fully valid, so close never sees half a tensor */
    }
    sh->header_bytes = r.pos;
    sh->data_offset = (r.pos + sh->alignment - 1) & ~(sh->alignment - 1);
    if ((rc = tensors_place(&r, sh, t))) goto out;
    uint64_t hb = sh->header_bytes;
    g->fingerprint = fnv(r.hash, &hb, sizeof hb);
out:
    free(r.buf);
    return rc;
}

/* ---- index ---- */

static int index_build(sl_gguf *g, sl_err *err)
{
    gguf_index *ix = g->index;
    uint64_t cap = 16;
    while (cap < 2 * g->n_tensors) cap *= 2;
    ix->slot = calloc(cap, sizeof *ix->slot);
    if (!ix->slot) return sl_err_set(err, SL_ENOMEM, "out of memory for the tensor index");
    ix->mask = cap - 1;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const sl_gguf_tensor *t = &g->tensors[i];
        uint64_t h = fnv(FNV_BASIS, t->name.s, t->name.len) & ix->mask;
        for (;; h = (h + 1) & ix->mask) {
            if (!ix->slot[h]) {
                ix->slot[h] = i + 1;
                break;
            }
            const sl_gguf_tensor *o = &g->tensors[ix->slot[h] - 1];
            if (str_cmp(&o->name, &t->name) == 0) {
                const char *f = g->shards[t->shard].path;
                if (o->shard == t->shard)
                    return sl_err_set(err, SL_EFORMAT, "%s: duplicate tensor name '%s'", f,
                                      SHOW(t->name.s));
                return sl_err_set(err, SL_EFORMAT, "%s: duplicate tensor name '%s' (also in %s)", f,
                                  SHOW(t->name.s), g->shards[o->shard].path);
            }
        }
    }
    return 0;
}

const sl_gguf_tensor *sl_gguf_find_tensor(const sl_gguf *g, const char *name)
{
    const gguf_index *ix = g->index;
    if (!ix || !ix->slot) return NULL;
    sl_gguf_str want = {strlen(name), (char *)name};
    for (uint64_t h = fnv(FNV_BASIS, name, want.len) & ix->mask;; h = (h + 1) & ix->mask) {
        if (!ix->slot[h]) return NULL;
        const sl_gguf_tensor *t = &g->tensors[ix->slot[h] - 1];
        if (str_cmp(&t->name, &want) == 0) return t;
    }
}

const sl_gguf_kv *sl_gguf_find_kv(const sl_gguf *g, const char *key)
{
    const gguf_index *ix = g->index;
    return ix && ix->kv0 ? kv_bsearch(ix->kv0, ix->n_kv0, key) : NULL;
}

/* ---- open / close ---- */

static sl_gguf *gguf_new(uint32_t n_shards)
{
    sl_gguf *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->shards = calloc(n_shards, sizeof *g->shards);
    g->index = calloc(1, sizeof(gguf_index));
    if (!g->shards || !g->index) {
        free(g->shards);
        free(g->index);
        free(g);
        return NULL;
    }
    for (uint32_t i = 0; i < n_shards; i++) g->shards[i].fd = -1;
    g->fingerprint = FNV_BASIS;
    return g;
}

void sl_gguf_close(sl_gguf **gp)
{
    if (!gp || !*gp) return;
    sl_gguf *g = *gp;
    for (uint32_t i = 0; i < g->n_shards; i++) {
        if (g->shards[i].fd >= 0) close(g->shards[i].fd);
        free(g->shards[i].path);
        arena_free(g->shards[i].mem);
    }
    gguf_index *ix = g->index;
    if (ix) free(ix->slot);
    free(ix);
    free(g->shards);
    free(g->tensors);
    free(g);
    *gp = NULL;
}

int sl_gguf_open_fd(sl_gguf **out, int fd, const char *name, sl_err *err)
{
    *out = NULL;
    sl_gguf *g = gguf_new(1);
    if (!g) return sl_err_set(err, SL_ENOMEM, "%s: out of memory", name);
    int rc;
    int dfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dfd < 0) {
        rc = sl_err_errno(err, SL_EIO, errno, "dup(%s, fd %d)", name, fd);
        goto fail;
    }
    g->n_shards = 1;
    gguf_index *ix = g->index;
    if ((rc = parse_shard(g, 0, dfd, name, &ix->kv0, err))) goto fail;
    ix->n_kv0 = g->shards[0].n_kv;
    if ((rc = index_build(g, err))) goto fail;
    *out = g;
    return 0;
fail:
    sl_gguf_close(&g);
    return rc;
}

int sl_gguf_split_path(char *buf, size_t cap, const char *prefix, uint32_t i, uint32_t n)
{
    if (n == 0 || n > SL_GGUF_MAX_SHARDS || i >= n) return SL_EINVAL;
    int k = snprintf(buf, cap, "%s-%05" PRIu32 "-of-%05" PRIu32 ".gguf", prefix, i + 1, n);
    return k < 0 || (size_t)k >= cap ? SL_EINVAL : 0;
}

/* "<prefix>-NNNNN-of-MMMMM.gguf" at the end of base (no directory): 1 and the
 * numbers when it matches, else 0. */
#define SPLIT_SUFFIX_LEN 20 /* strlen("-00001-of-00003.gguf") */
static int split_name_parse(const char *base, size_t len, uint32_t *idx, uint32_t *count)
{
    if (len <= SPLIT_SUFFIX_LEN) return 0;
    const char *s = base + len - SPLIT_SUFFIX_LEN;
    if (s[0] != '-' || memcmp(s + 6, "-of-", 4) != 0 || memcmp(s + 15, ".gguf", 5) != 0) return 0;
    uint32_t a = 0, b = 0;
    for (int i = 0; i < 5; i++) {
        if (s[1 + i] < '0' || s[1 + i] > '9' || s[10 + i] < '0' || s[10 + i] > '9') return 0;
        a = a * 10 + (uint32_t)(s[1 + i] - '0');
        b = b * 10 + (uint32_t)(s[10 + i] - '0');
    }
    *idx = a;
    *count = b;
    return 1;
}

/* Integer value of a split key as u64, or an error naming the file. */
static int split_key(const sl_gguf_shard *sh, const sl_gguf_kv **srt, const char *key, int64_t *v,
                     int *present, sl_err *err)
{
    const sl_gguf_kv *kv = kv_bsearch(srt, sh->n_kv, key);
    *present = kv != NULL;
    if (!kv) return 0;
    if (!type_is_int(kv->type))
        return sl_err_set(err, SL_EFORMAT, "%s: %s is %s, must be an integer", sh->path, key,
                          sl_gguf_type_name(kv->type));
    if (type_is_signed(kv->type))
        *v = kv->v.i64;
    else
        *v = kv->v.u64 > (uint64_t)INT64_MAX ? -1 : (int64_t)kv->v.u64;
    return 0;
}

static int kv_equal(const sl_gguf_kv *a, const sl_gguf_kv *b)
{
    if (a->type != b->type) return 0;
    switch (a->type) {
    case SL_GGUF_TYPE_STRING:
        return str_cmp(&a->v.str, &b->v.str) == 0;
    case SL_GGUF_TYPE_FLOAT32:
    case SL_GGUF_TYPE_FLOAT64:
        return memcmp(&a->v.f64, &b->v.f64, sizeof a->v.f64) == 0;
    case SL_GGUF_TYPE_ARRAY:
        if (a->arr_type != b->arr_type || a->arr_n != b->arr_n) return 0;
        if (a->arr_type == SL_GGUF_TYPE_STRING) {
            const sl_gguf_str *x = a->v.arr, *y = b->v.arr;
            for (uint64_t i = 0; i < a->arr_n; i++)
                if (str_cmp(&x[i], &y[i])) return 0;
            return 1;
        }
        return memcmp(a->v.arr, b->v.arr, a->arr_n * type_width(a->arr_type)) == 0;
    }
    return a->v.u64 == b->v.u64;
}

/* Split keys of shard i (of n, named as such when named != 0) and the keys it
 * shares with shard 0. *total_out gets split.tensors.count (or -1 if absent). */
static int split_check(sl_gguf *g, uint32_t i, uint32_t n, int named, const sl_gguf_kv **srt,
                       int64_t *total_out, sl_err *err)
{
    const sl_gguf_shard *sh = &g->shards[i];
    int64_t no = 0, count = 0, total = -1;
    int has_no, has_count, has_total, rc;
    if ((rc = split_key(sh, srt, SL_GGUF_KEY_SPLIT_NO, &no, &has_no, err)) ||
        (rc = split_key(sh, srt, SL_GGUF_KEY_SPLIT_COUNT, &count, &has_count, err)) ||
        (rc = split_key(sh, srt, SL_GGUF_KEY_SPLIT_TENSORS, &total, &has_total, err)))
        return rc;
    if (!named && has_count && count != 1)
        return sl_err_set(err, SL_EMISMATCH,
                          "%s: split.count is %" PRId64
                          " but the name is not <prefix>-NNNNN-of-NNNNN.gguf; open it by its "
                          "split name",
                          sh->path, count);
    if (n > 1 && (!has_no || !has_count || !has_total))
        return sl_err_set(err, SL_EFORMAT,
                          "%s: named as shard %" PRIu32 " of %" PRIu32 " but has no %s key",
                          sh->path, i + 1, n,
                          !has_no      ? SL_GGUF_KEY_SPLIT_NO
                          : !has_count ? SL_GGUF_KEY_SPLIT_COUNT
                                       : SL_GGUF_KEY_SPLIT_TENSORS);
    if (has_no && no != (int64_t)i)
        return sl_err_set(err, SL_EMISMATCH,
                          "%s: split.no is %" PRId64 ", expected %" PRIu32 " (shard %" PRIu32
                          " of %" PRIu32 " by its name)",
                          sh->path, no, i, i + 1, n);
    if (has_count && count != (int64_t)n)
        return sl_err_set(err, SL_EMISMATCH,
                          "%s: split.count is %" PRId64 " but the checkpoint has %" PRIu32
                          " shards by name",
                          sh->path, count, n);
    if (has_total && total < 0)
        return sl_err_set(err, SL_EFORMAT, "%s: split.tensors.count %" PRId64 " is negative",
                          sh->path, total);
    *total_out = has_total ? total : -1;
    if (i == 0) return 0;
    const gguf_index *ix = g->index;
    if (has_total) {
        int64_t t0 = -1;
        int h0;
        if ((rc = split_key(&g->shards[0], ix->kv0, SL_GGUF_KEY_SPLIT_TENSORS, &t0, &h0, err)))
            return rc;
        if (h0 && t0 != total)
            return sl_err_set(err, SL_EMISMATCH,
                              "%s: split.tensors.count %" PRId64 " differs from %" PRId64
                              " in %s (shards of different models?)",
                              sh->path, total, t0, g->shards[0].path);
    }
    for (uint64_t k = 0; k < sh->n_kv; k++) {
        const sl_gguf_kv *kv = &sh->kv[k];
        if (strcmp(kv->key.s, SL_GGUF_KEY_SPLIT_NO) == 0) continue;
        const sl_gguf_kv *k0 = kv_bsearch(ix->kv0, ix->n_kv0, kv->key.s);
        if (k0 && kv->key.len == strlen(kv->key.s) && !kv_equal(k0, kv))
            return sl_err_set(err, SL_EMISMATCH,
                              "%s: key '%s' differs from its value in %s (shards of "
                              "different models?)",
                              sh->path, SHOW(kv->key.s), g->shards[0].path);
    }
    return 0;
}

/* A file of another split with the same prefix beside the shards (index past n or
 * another count) makes the checkpoint ambiguous. */
static int split_scan_extra(const char *path, size_t dir_len, size_t prefix_len, uint32_t n,
                            sl_err *err)
{
    char dir[4096];
    if (dir_len == 0)
        snprintf(dir, sizeof dir, ".");
    else if (dir_len < sizeof dir)
        snprintf(dir, sizeof dir, "%.*s", (int)dir_len, path);
    else
        return 0;
    const char *base = path + dir_len;
    size_t base_prefix = prefix_len - dir_len;
    DIR *d = opendir(dir);
    if (!d) return 0; /* unlistable folder: the shards themselves were fine */
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        uint32_t idx, count;
        if (len != base_prefix + SPLIT_SUFFIX_LEN || memcmp(e->d_name, base, base_prefix) != 0 ||
            !split_name_parse(e->d_name, len, &idx, &count))
            continue;
        if (count != n || idx == 0 || idx > n) {
            rc = sl_err_set(err, SL_EMISMATCH,
                            "%s: extra shard %.*s%s lies beside this %" PRIu32
                            "-shard checkpoint (two splits with one prefix?)",
                            path, (int)dir_len, path, e->d_name, n);
            break;
        }
    }
    closedir(d);
    return rc;
}

int sl_gguf_open(sl_gguf **out, const char *path, sl_err *err)
{
    *out = NULL;
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    size_t len = strlen(path);
    uint32_t idx = 0, n = 1;
    int named = split_name_parse(path + dir_len, len - dir_len, &idx, &n);
    if (named && (n == 0 || idx == 0 || idx > n))
        return sl_err_set(err, SL_EINVAL,
                          "%s: shard number %" PRIu32 " of %" PRIu32
                          " in the name is not a valid shard",
                          path, idx, n);
    if (named && n > SL_GGUF_MAX_SHARDS)
        return sl_err_set(err, SL_EUNSUPPORTED, "%s: %" PRIu32 " shards, more than %d", path, n,
                          SL_GGUF_MAX_SHARDS);
    if (!named) n = 1;
    size_t prefix_len = named ? len - SPLIT_SUFFIX_LEN : len;

    sl_gguf *g = gguf_new(n);
    char *name = malloc(len + 1);
    char *prefix = strndup(path, prefix_len);
    int rc = 0;
    if (!g || !name || !prefix) {
        rc = sl_err_set(err, SL_ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    gguf_index *ix = g->index;
    int64_t total0 = -1;
    for (uint32_t i = 0; i < n; i++) {
        if (named) {
            /* Same length as path: only the two 5-digit numbers change. */
            rc = sl_gguf_split_path(name, len + 1, prefix, i, n);
            SL_ASSERT(rc == 0);
        } else {
            memcpy(name, path, len + 1);
        }
        int fd = open(name, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            if (e == ENOENT)
                rc = named
                         ? sl_err_set(err, SL_ENOTFOUND,
                                      "%s: missing shard %" PRIu32 " of %" PRIu32 " (no such file)",
                                      name, i + 1, n)
                         : sl_err_errno(err, SL_ENOTFOUND, e, "open(%s)", name);
            else
                rc = sl_err_errno(err, SL_EIO, e, "open(%s)", name);
            goto fail;
        }
        g->n_shards = i + 1;
        const sl_gguf_kv **srt = NULL;
        if ((rc = parse_shard(g, i, fd, name, &srt, err))) goto fail;
        if (i == 0) {
            ix->kv0 = srt;
            ix->n_kv0 = g->shards[0].n_kv;
        }
        int64_t total = -1;
        if ((rc = split_check(g, i, n, named, srt, &total, err))) goto fail;
        if (i == 0) total0 = total;
    }
    if (total0 >= 0 && (uint64_t)total0 != g->n_tensors) {
        rc = sl_err_set(err, SL_EMISMATCH,
                        "%s: split.tensors.count is %" PRId64 " but the %" PRIu32
                        " shard(s) hold %" PRIu64 " tensors",
                        g->shards[0].path, total0, n, g->n_tensors);
        goto fail;
    }
    if (named && (rc = split_scan_extra(path, dir_len, prefix_len, n, err))) goto fail;
    if ((rc = index_build(g, err))) goto fail;
    free(name);
    free(prefix);
    *out = g;
    return 0;
fail:
    free(name);
    free(prefix);
    sl_gguf_close(&g);
    return rc;
}

/* ---- typed getters ---- */

static int get_kv(const sl_gguf *g, const char *key, const sl_gguf_kv **kv, sl_err *err)
{
    *kv = sl_gguf_find_kv(g, key);
    if (!*kv)
        return sl_err_set(err, SL_ENOTFOUND, "%s: key '%s' not found", g->shards[0].path, key);
    return 0;
}

static int not_a(const sl_gguf *g, const sl_gguf_kv *kv, const char *want, sl_err *err)
{
    return sl_err_set(err, SL_EFORMAT, "%s: key '%s' is %s, not %s", g->shards[0].path, kv->key.s,
                      sl_gguf_type_name(kv->type), want);
}

static int out_of_range(const sl_gguf *g, const sl_gguf_kv *kv, const char *want, sl_err *err)
{
    char v[48];
    if (type_is_signed(kv->type))
        snprintf(v, sizeof v, "%" PRId64, kv->v.i64);
    else if (type_is_int(kv->type) || kv->type == SL_GGUF_TYPE_BOOL)
        snprintf(v, sizeof v, "%" PRIu64, kv->v.u64);
    else
        snprintf(v, sizeof v, "%.17g", kv->v.f64);
    return sl_err_set(err, SL_EFORMAT, "%s: key '%s': value %s out of range of %s",
                      g->shards[0].path, kv->key.s, v, want);
}

int sl_gguf_get_u64(const sl_gguf *g, const char *key, uint64_t *out, sl_err *err)
{
    const sl_gguf_kv *kv;
    int rc = get_kv(g, key, &kv, err);
    if (rc) return rc;
    if (!type_is_int(kv->type)) return not_a(g, kv, "an integer", err);
    if (type_is_signed(kv->type) && kv->v.i64 < 0) return out_of_range(g, kv, "u64", err);
    *out = kv->v.u64;
    return 0;
}

int sl_gguf_get_u32(const sl_gguf *g, const char *key, uint32_t *out, sl_err *err)
{
    uint64_t v;
    int rc = sl_gguf_get_u64(g, key, &v, err);
    if (rc) return rc;
    if (v > UINT32_MAX) return out_of_range(g, sl_gguf_find_kv(g, key), "u32", err);
    *out = (uint32_t)v;
    return 0;
}

int sl_gguf_get_i64(const sl_gguf *g, const char *key, int64_t *out, sl_err *err)
{
    const sl_gguf_kv *kv;
    int rc = get_kv(g, key, &kv, err);
    if (rc) return rc;
    if (!type_is_int(kv->type)) return not_a(g, kv, "an integer", err);
    if (!type_is_signed(kv->type) && kv->v.u64 > (uint64_t)INT64_MAX)
        return out_of_range(g, kv, "i64", err);
    *out = kv->v.i64;
    return 0;
}

int sl_gguf_get_f32(const sl_gguf *g, const char *key, float *out, sl_err *err)
{
    const sl_gguf_kv *kv;
    int rc = get_kv(g, key, &kv, err);
    if (rc) return rc;
    if (kv->type == SL_GGUF_TYPE_FLOAT32 || kv->type == SL_GGUF_TYPE_FLOAT64) {
        if (isfinite(kv->v.f64) && fabs(kv->v.f64) > FLT_MAX)
            return out_of_range(g, kv, "f32", err);
        *out = (float)kv->v.f64;
    } else if (type_is_signed(kv->type)) {
        *out = (float)kv->v.i64;
    } else if (type_is_int(kv->type)) {
        *out = (float)kv->v.u64;
    } else {
        return not_a(g, kv, "a number", err);
    }
    return 0;
}

int sl_gguf_get_bool(const sl_gguf *g, const char *key, int *out, sl_err *err)
{
    const sl_gguf_kv *kv;
    int rc = get_kv(g, key, &kv, err);
    if (rc) return rc;
    if (kv->type != SL_GGUF_TYPE_BOOL && !type_is_int(kv->type)) return not_a(g, kv, "bool", err);
    if (kv->v.u64 > 1) return out_of_range(g, kv, "bool", err);
    *out = (int)kv->v.u64;
    return 0;
}

int sl_gguf_get_str(const sl_gguf *g, const char *key, const char **out, sl_err *err)
{
    const sl_gguf_kv *kv;
    int rc = get_kv(g, key, &kv, err);
    if (rc) return rc;
    if (kv->type != SL_GGUF_TYPE_STRING) return not_a(g, kv, "string", err);
    *out = kv->v.str.s;
    return 0;
}

/* Element i of an integer array as int64; 0 when it does not fit. */
static int arr_elem_i64(const sl_gguf_kv *kv, uint64_t i, int64_t *v)
{
    const unsigned char *p = (const unsigned char *)kv->v.arr + i * type_width(kv->arr_type);
    sl_gguf_kv tmp;
    memset(&tmp, 0, sizeof tmp);
    scalar_set(&tmp, kv->arr_type, p);
    if (!type_is_signed(kv->arr_type) && tmp.v.u64 > (uint64_t)INT64_MAX) return 0;
    *v = tmp.v.i64;
    return 1;
}

int sl_gguf_get_arr_i64(const sl_gguf *g, const char *key, int64_t *out, uint64_t max, uint64_t *n,
                        sl_err *err)
{
    const sl_gguf_kv *kv;
    int rc = get_kv(g, key, &kv, err);
    if (rc) return rc;
    if (kv->type != SL_GGUF_TYPE_ARRAY || !type_is_int(kv->arr_type))
        return sl_err_set(err, SL_EFORMAT, "%s: key '%s' is %s%s%s, not an integer array",
                          g->shards[0].path, key, sl_gguf_type_name(kv->type),
                          kv->type == SL_GGUF_TYPE_ARRAY ? " of " : "",
                          kv->type == SL_GGUF_TYPE_ARRAY ? sl_gguf_type_name(kv->arr_type) : "");
    *n = kv->arr_n;
    if (kv->arr_n > max)
        return sl_err_set(err, SL_EFORMAT,
                          "%s: key '%s' has %" PRIu64 " entries, more than the %" PRIu64
                          " expected",
                          g->shards[0].path, key, kv->arr_n, max);
    for (uint64_t i = 0; i < kv->arr_n; i++)
        if (!arr_elem_i64(kv, i, &out[i]))
            return sl_err_set(err, SL_EFORMAT,
                              "%s: key '%s': entry %" PRIu64 " out of range of i64",
                              g->shards[0].path, key, i);
    return 0;
}

/* ---- printing ---- */

/* s escaped (and quoted when quote), cut after max bytes with "... (N bytes)". */
static void print_str(FILE *f, const sl_gguf_str *s, uint64_t max, int quote)
{
    uint64_t n = s->len < max ? s->len : max;
    if (quote) fputc('"', f);
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s->s[i];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c == '\n')
            fputs("\\n", f);
        else if (c < 0x20 || c == 0x7f)
            fprintf(f, "\\x%02x", c);
        else
            fputc(c, f);
    }
    if (quote) fputc('"', f);
    if (s->len > max) fprintf(f, "... (%" PRIu64 " bytes)", s->len);
}

static void print_scalar(FILE *f, const sl_gguf_kv *kv, uint32_t type)
{
    switch (type) {
    case SL_GGUF_TYPE_BOOL:
        fputs(kv->v.u64 ? "true" : "false", f);
        break;
    case SL_GGUF_TYPE_FLOAT32:
        fprintf(f, "%.9g", kv->v.f64);
        break;
    case SL_GGUF_TYPE_FLOAT64:
        fprintf(f, "%.17g", kv->v.f64);
        break;
    case SL_GGUF_TYPE_STRING:
        print_str(f, &kv->v.str, 256, 1);
        break;
    default:
        if (type_is_signed(type))
            fprintf(f, "%" PRId64, kv->v.i64);
        else
            fprintf(f, "%" PRIu64, kv->v.u64);
    }
}

void sl_gguf_print_kv(FILE *f, const sl_gguf_kv *kv)
{
    print_str(f, &kv->key, 256, 0);
    fputs(" = ", f);
    if (kv->type != SL_GGUF_TYPE_ARRAY) {
        print_scalar(f, kv, kv->type);
        return;
    }
    fprintf(f, "[%" PRIu64 " x %s]", kv->arr_n, sl_gguf_type_name(kv->arr_type));
    uint64_t shown = kv->arr_n < 8 ? kv->arr_n : 8;
    for (uint64_t i = 0; i < shown; i++) {
        fputs(i ? ", " : " ", f);
        if (kv->arr_type == SL_GGUF_TYPE_STRING) {
            print_str(f, &((const sl_gguf_str *)kv->v.arr)[i], 64, 1);
        } else {
            sl_gguf_kv tmp;
            memset(&tmp, 0, sizeof tmp);
            scalar_set(&tmp, kv->arr_type,
                       (const unsigned char *)kv->v.arr + i * type_width(kv->arr_type));
            print_scalar(f, &tmp, kv->arr_type);
        }
    }
    if (kv->arr_n > shown) fputs(", ...", f);
}
