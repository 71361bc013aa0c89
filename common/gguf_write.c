/* gguf_write.c - the GGUF v3 writer.
 *
 * Keys are kept as their serialized bytes (type + value) in call order; tensor
 * infos with their sizes and data offsets, assigned in add order, each tensor
 * padded to the alignment. sl_gguf_writer_write streams header, padding and tensor
 * bytes through one 4 MiB buffer: the fill callback writes straight into the free
 * part of it, so each byte of a tensor is touched once by us (no per-byte loop)
 * and every write(2) but the last is 4 MiB. Behind the writes, windows of 64 MiB
 * are pushed to disk (sync_file_range) and dropped from the page cache, so a file
 * of tens of GB neither fills memory nor leaves minutes of dirty pages to fsync.
 */
#include "gguf.h"
#include "quant.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF writer assumes a little-endian host"
#endif

#define OUT_BUF_BYTES      (4u << 20)
#define WRITE_BEHIND_BYTES (64ull << 20)
#define MAX_ALIGNMENT      (1u << 30)

typedef struct wkv {
    char *key; /* NUL terminated, key_len bytes */
    uint64_t key_len;
    unsigned char *val; /* type u32 then the value, as on disk */
    uint64_t val_len;
} wkv;

typedef struct wtensor {
    char *name;
    uint64_t name_len;
    uint32_t type, n_dims;
    uint64_t ne[SL_GGUF_MAX_DIMS];
    uint64_t n_bytes, rel_offset;
} wtensor;

struct sl_gguf_writer {
    uint32_t alignment;
    wkv *kv; /* [n_kv], call order */
    uint64_t n_kv, cap_kv;
    wtensor *t; /* [n_t], add order */
    uint64_t n_t, cap_t;
    uint64_t data_bytes; /* sum of the tensors' padded sizes */
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) & ~(a - 1);
}

int sl_gguf_writer_init(sl_gguf_writer **out, uint32_t alignment, sl_err *err)
{
    *out = NULL;
    if (alignment < 8 || alignment > MAX_ALIGNMENT || (alignment & (alignment - 1)))
        return sl_err_set(err, SL_EINVAL,
                          "gguf writer: alignment %" PRIu32 " is not a power of two in [8, 2^30]",
                          alignment);
    sl_gguf_writer *w = calloc(1, sizeof *w);
    if (!w) return sl_err_set(err, SL_ENOMEM, "gguf writer: out of memory");
    w->alignment = alignment;
    if (alignment != SL_GGUF_DEFAULT_ALIGNMENT &&
        sl_gguf_writer_set_u32(w, SL_GGUF_KEY_ALIGNMENT, alignment) != 0) {
        sl_gguf_writer_free(&w);
        return sl_err_set(err, SL_ENOMEM, "gguf writer: out of memory");
    }
    *out = w;
    return 0;
}

void sl_gguf_writer_free(sl_gguf_writer **wp)
{
    if (!wp || !*wp) return;
    sl_gguf_writer *w = *wp;
    for (uint64_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    for (uint64_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w);
    *wp = NULL;
}

/* Appends key with a value of val_len bytes (type first); returns a pointer to the
 * value bytes after the type for the caller to fill, or NULL with *rc set. */
static unsigned char *kv_add(sl_gguf_writer *w, const char *key, uint32_t type, uint64_t val_len,
                             int *rc)
{
    *rc = SL_EINVAL;
    if (!key || !key[0]) return NULL;
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kv[i].key, key) == 0) return NULL;
    *rc = SL_ENOMEM;
    if (val_len > SIZE_MAX - 8) return NULL;
    if (w->n_kv == w->cap_kv) {
        uint64_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        wkv *kv = realloc(w->kv, cap * sizeof *kv);
        if (!kv) return NULL;
        w->kv = kv;
        w->cap_kv = cap;
    }
    wkv *kv = &w->kv[w->n_kv];
    kv->key = strdup(key);
    kv->val = malloc(4 + val_len);
    if (!kv->key || !kv->val) {
        free(kv->key);
        free(kv->val);
        return NULL;
    }
    kv->key_len = strlen(key);
    kv->val_len = 4 + val_len;
    memcpy(kv->val, &type, 4);
    w->n_kv++;
    *rc = 0;
    return kv->val + 4;
}

static int set_scalar(sl_gguf_writer *w, const char *key, uint32_t type, const void *v)
{
    int rc;
    unsigned char *p = kv_add(w, key, type, sl_gguf_scalar_width(type), &rc);
    if (p) memcpy(p, v, sl_gguf_scalar_width(type));
    return rc;
}

int sl_gguf_writer_set_u8(sl_gguf_writer *w, const char *key, uint8_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_UINT8, &v);
}

int sl_gguf_writer_set_i8(sl_gguf_writer *w, const char *key, int8_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_INT8, &v);
}

int sl_gguf_writer_set_u16(sl_gguf_writer *w, const char *key, uint16_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_UINT16, &v);
}

int sl_gguf_writer_set_i16(sl_gguf_writer *w, const char *key, int16_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_INT16, &v);
}

int sl_gguf_writer_set_u32(sl_gguf_writer *w, const char *key, uint32_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_UINT32, &v);
}

int sl_gguf_writer_set_i32(sl_gguf_writer *w, const char *key, int32_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_INT32, &v);
}

int sl_gguf_writer_set_u64(sl_gguf_writer *w, const char *key, uint64_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_UINT64, &v);
}

int sl_gguf_writer_set_i64(sl_gguf_writer *w, const char *key, int64_t v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_INT64, &v);
}

int sl_gguf_writer_set_f32(sl_gguf_writer *w, const char *key, float v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_FLOAT32, &v);
}

int sl_gguf_writer_set_f64(sl_gguf_writer *w, const char *key, double v)
{
    return set_scalar(w, key, SL_GGUF_TYPE_FLOAT64, &v);
}

int sl_gguf_writer_set_bool(sl_gguf_writer *w, const char *key, int v)
{
    uint8_t b = v != 0;
    return set_scalar(w, key, SL_GGUF_TYPE_BOOL, &b);
}

int sl_gguf_writer_set_str(sl_gguf_writer *w, const char *key, const char *v)
{
    if (!v) return SL_EINVAL;
    uint64_t n = strlen(v);
    int rc;
    unsigned char *p = kv_add(w, key, SL_GGUF_TYPE_STRING, 8 + n, &rc);
    if (p) {
        memcpy(p, &n, 8);
        memcpy(p + 8, v, n);
    }
    return rc;
}

int sl_gguf_writer_set_arr(sl_gguf_writer *w, const char *key, uint32_t elem_type, const void *data,
                           uint64_t n)
{
    uint64_t width = sl_gguf_scalar_width(elem_type);
    if (width == 0 || (n && !data) || n > (SIZE_MAX - 16) / width) return SL_EINVAL;
    int rc;
    unsigned char *p = kv_add(w, key, SL_GGUF_TYPE_ARRAY, 12 + n * width, &rc);
    if (p) {
        memcpy(p, &elem_type, 4);
        memcpy(p + 4, &n, 8);
        if (n) memcpy(p + 12, data, n * width);
    }
    return rc;
}

int sl_gguf_writer_set_arr_str(sl_gguf_writer *w, const char *key, const char *const *strs,
                               uint64_t n)
{
    if (n && !strs) return SL_EINVAL;
    uint64_t bytes = 12;
    for (uint64_t i = 0; i < n; i++) {
        if (!strs[i]) return SL_EINVAL;
        bytes += 8 + strlen(strs[i]);
    }
    int rc;
    unsigned char *p = kv_add(w, key, SL_GGUF_TYPE_ARRAY, bytes, &rc);
    if (!p) return rc;
    uint32_t et = SL_GGUF_TYPE_STRING;
    memcpy(p, &et, 4);
    memcpy(p + 4, &n, 8);
    p += 12;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t len = strlen(strs[i]);
        memcpy(p, &len, 8);
        memcpy(p + 8, strs[i], len);
        p += 8 + len;
    }
    return 0;
}

int64_t sl_gguf_writer_add_tensor(sl_gguf_writer *w, const char *name, uint32_t type,
                                  uint32_t n_dims, const uint64_t *ne, sl_err *err)
{
    if (!name || !name[0]) return sl_err_set(err, SL_EINVAL, "gguf writer: empty tensor name");
    if (n_dims == 0 || n_dims > SL_GGUF_MAX_DIMS || !ne)
        return sl_err_set(err, SL_EINVAL,
                          "gguf writer: tensor '%s': n_dims %" PRIu32 " (must be 1..%d)", name,
                          n_dims, SL_GGUF_MAX_DIMS);
    const sl_qtype_info *qi = sl_qtype_get(type);
    if (!qi || qi->block_elems == 0 || qi->block_bytes == 0)
        return sl_err_set(err, SL_EINVAL, "gguf writer: tensor '%s': unknown tensor type %" PRIu32,
                          name, type);
    for (uint64_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return sl_err_set(err, SL_EINVAL, "gguf writer: duplicate tensor name '%s'", name);
    wtensor t = {.type = type, .n_dims = n_dims, .ne = {1, 1, 1, 1}};
    uint64_t nel = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        t.ne[d] = ne[d];
        if (ne[d] > (uint64_t)INT64_MAX || __builtin_mul_overflow(nel, ne[d], &nel) ||
            nel > (uint64_t)INT64_MAX)
            return sl_err_set(err, SL_EINVAL, "gguf writer: tensor '%s': element count overflows",
                              name);
    }
    if (t.ne[0] % qi->block_elems)
        return sl_err_set(err, SL_EINVAL,
                          "gguf writer: tensor '%s': ne[0] = %" PRIu64
                          " is not a multiple of the block size %" PRIu32 " of %s",
                          name, t.ne[0], qi->block_elems, qi->name);
    t.n_bytes = t.ne[0] / qi->block_elems * qi->block_bytes;
    uint64_t padded, total;
    for (uint32_t d = 1; d < SL_GGUF_MAX_DIMS; d++)
        if (__builtin_mul_overflow(t.n_bytes, t.ne[d], &t.n_bytes)) goto too_big;
    if (t.n_bytes > UINT64_MAX - w->alignment) goto too_big;
    padded = align_up(t.n_bytes, w->alignment);
    if (__builtin_add_overflow(w->data_bytes, padded, &total)) goto too_big;
    t.rel_offset = w->data_bytes;
    t.name = strdup(name);
    t.name_len = strlen(name);
    if (!t.name) goto nomem;
    if (w->n_t == w->cap_t) {
        uint64_t cap = w->cap_t ? w->cap_t * 2 : 64;
        wtensor *nt = realloc(w->t, cap * sizeof *nt);
        if (!nt) {
            free(t.name);
            goto nomem;
        }
        w->t = nt;
        w->cap_t = cap;
    }
    w->t[w->n_t] = t;
    w->data_bytes = total;
    return (int64_t)w->n_t++;
too_big:
    return sl_err_set(err, SL_EINVAL, "gguf writer: tensor '%s': byte size overflows", name);
nomem:
    return sl_err_set(err, SL_ENOMEM, "gguf writer: tensor '%s': out of memory", name);
}

/* Bytes from the magic to the end of the last tensor info. */
static uint64_t header_bytes(const sl_gguf_writer *w)
{
    uint64_t n = 4 + 4 + 8 + 8;
    for (uint64_t i = 0; i < w->n_kv; i++) n += 8 + w->kv[i].key_len + w->kv[i].val_len;
    for (uint64_t i = 0; i < w->n_t; i++)
        n += 8 + w->t[i].name_len + 4 + 8ull * w->t[i].n_dims + 4 + 8;
    return n;
}

uint64_t sl_gguf_writer_file_bytes(const sl_gguf_writer *w)
{
    return align_up(header_bytes(w), w->alignment) + w->data_bytes;
}

/* ---- output: one buffer, large writes, write-behind ---- */

typedef struct out {
    int fd;
    const char *path;
    unsigned char *buf; /* [OUT_BUF_BYTES] */
    uint64_t len;       /* bytes waiting in buf */
    uint64_t done;      /* bytes written to the file */
    uint64_t total;
    uint64_t synced; /* bytes before this are on their way to disk */
    sl_gguf_progress_fn progress;
    void *progress_ctx;
    sl_err *err;
} out;

static int io_error(out *o, int e, const char *call, uint64_t off, uint64_t len)
{
    int code = (e == ENOSPC || e == EDQUOT) ? SL_ENOSPACE : SL_EIO;
    return sl_err_errno(o->err, code, e, "%s(%s, off %" PRIu64 ", len %" PRIu64 ")", call, o->path,
                        off, len);
}

/* Starts writeback of the newest full window and waits for the one before it,
 * then drops that one from the page cache. Advisory, except that an I/O error or
 * a full disk it reports is real. */
static int write_behind(out *o)
{
    while (o->done - o->synced >= WRITE_BEHIND_BYTES) {
        uint64_t w0 = o->synced;
        if (sync_file_range(o->fd, (off_t)w0, WRITE_BEHIND_BYTES, SYNC_FILE_RANGE_WRITE) != 0 &&
            (errno == EIO || errno == ENOSPC))
            return io_error(o, errno, "sync_file_range", w0, WRITE_BEHIND_BYTES);
        if (w0 >= WRITE_BEHIND_BYTES) {
            uint64_t p0 = w0 - WRITE_BEHIND_BYTES;
            if (sync_file_range(o->fd, (off_t)p0, WRITE_BEHIND_BYTES,
                                SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                    SYNC_FILE_RANGE_WAIT_AFTER) != 0 &&
                (errno == EIO || errno == ENOSPC))
                return io_error(o, errno, "sync_file_range", p0, WRITE_BEHIND_BYTES);
            posix_fadvise(o->fd, (off_t)p0, WRITE_BEHIND_BYTES, POSIX_FADV_DONTNEED);
        }
        o->synced += WRITE_BEHIND_BYTES;
    }
    return 0;
}

static int out_flush(out *o)
{
    uint64_t at = 0;
    while (at < o->len) {
        ssize_t n = write(o->fd, o->buf + at, o->len - at);
        if (n < 0) {
            if (errno == EINTR) continue;
            return io_error(o, errno, "write", o->done, o->len - at);
        }
        if (n == 0)
            return sl_err_set(o->err, SL_EIO,
                              "write(%s, off %" PRIu64 ", len %" PRIu64 "): short write", o->path,
                              o->done, o->len - at);
        at += (uint64_t)n;
        o->done += (uint64_t)n;
    }
    o->len = 0;
    if (o->progress) o->progress(o->progress_ctx, o->done, o->total);
    return write_behind(o);
}

static int out_put(out *o, const void *p, uint64_t n)
{
    const unsigned char *b = p;
    while (n) {
        uint64_t k = OUT_BUF_BYTES - o->len < n ? OUT_BUF_BYTES - o->len : n;
        memcpy(o->buf + o->len, b, k);
        o->len += k;
        b += k;
        n -= k;
        if (o->len == OUT_BUF_BYTES) {
            int rc = out_flush(o);
            if (rc) return rc;
        }
    }
    return 0;
}

static int out_zero(out *o, uint64_t n)
{
    while (n) {
        uint64_t k = OUT_BUF_BYTES - o->len < n ? OUT_BUF_BYTES - o->len : n;
        memset(o->buf + o->len, 0, k);
        o->len += k;
        n -= k;
        if (o->len == OUT_BUF_BYTES) {
            int rc = out_flush(o);
            if (rc) return rc;
        }
    }
    return 0;
}

static int out_header(out *o, const sl_gguf_writer *w)
{
    uint32_t magic = SL_GGUF_MAGIC, version = SL_GGUF_VERSION;
    int rc;
    if ((rc = out_put(o, &magic, 4)) || (rc = out_put(o, &version, 4)) ||
        (rc = out_put(o, &w->n_t, 8)) || (rc = out_put(o, &w->n_kv, 8)))
        return rc;
    for (uint64_t i = 0; i < w->n_kv; i++) {
        const wkv *kv = &w->kv[i];
        if ((rc = out_put(o, &kv->key_len, 8)) || (rc = out_put(o, kv->key, kv->key_len)) ||
            (rc = out_put(o, kv->val, kv->val_len)))
            return rc;
    }
    for (uint64_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        if ((rc = out_put(o, &t->name_len, 8)) || (rc = out_put(o, t->name, t->name_len)) ||
            (rc = out_put(o, &t->n_dims, 4)) || (rc = out_put(o, t->ne, 8ull * t->n_dims)) ||
            (rc = out_put(o, &t->type, 4)) || (rc = out_put(o, &t->rel_offset, 8)))
            return rc;
    }
    uint64_t hb = header_bytes(w);
    return out_zero(o, align_up(hb, w->alignment) - hb);
}

int sl_gguf_writer_write(sl_gguf_writer *w, const char *path, sl_gguf_fill_fn fill, void *ctx,
                         sl_gguf_progress_fn progress, void *progress_ctx, sl_err *err)
{
    if (w->n_t && !fill)
        return sl_err_set(err, SL_EINVAL, "%s: tensors to write but no fill callback", path);
    out o = {.fd = -1,
             .path = path,
             .total = sl_gguf_writer_file_bytes(w),
             .progress = progress,
             .progress_ctx = progress_ctx,
             .err = err};
    int rc;
    o.buf = malloc(OUT_BUF_BYTES);
    if (!o.buf) return sl_err_set(err, SL_ENOMEM, "%s: out of memory for the write buffer", path);
    o.fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (o.fd < 0) {
        rc = sl_err_errno(err, errno == ENOSPC ? SL_ENOSPACE : SL_EIO, errno, "open(%s)", path);
        free(o.buf);
        return rc;
    }
    if ((rc = out_header(&o, w))) goto fail;
    for (uint64_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        for (uint64_t off = 0; off < t->n_bytes;) {
            uint64_t k = OUT_BUF_BYTES - o.len;
            if (k > t->n_bytes - off) k = t->n_bytes - off;
            if ((rc = fill(ctx, i, off, o.buf + o.len, k, err))) {
                if (rc > 0) rc = SL_EINVAL;
                if (err && err->code != rc)
                    sl_err_set(err, rc, "the fill callback failed (%s)", sl_status_name(rc));
                sl_err_prefix(err, "%s: tensor '%s' at byte %" PRIu64, path, t->name, off);
                goto fail;
            }
            o.len += k;
            off += k;
            if (o.len == OUT_BUF_BYTES && (rc = out_flush(&o))) goto fail;
        }
        if ((rc = out_zero(&o, align_up(t->n_bytes, w->alignment) - t->n_bytes))) goto fail;
    }
    if ((rc = out_flush(&o))) goto fail;
    SL_ASSERT(o.done == o.total);
    if (fsync(o.fd) != 0) {
        rc = io_error(&o, errno, "fsync", 0, o.done);
        goto fail;
    }
    int fd = o.fd;
    o.fd = -1;
    if (close(fd) != 0) {
        rc = io_error(&o, errno, "close", 0, o.done);
        goto fail;
    }
    free(o.buf);
    return 0;
fail:
    if (o.fd >= 0) close(o.fd);
    unlink(path);
    free(o.buf);
    return rc;
}
