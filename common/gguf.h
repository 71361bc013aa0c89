/* gguf.h - reader and writer of GGUF v3 files and split checkpoints.
 *
 * Reader: sl_gguf_open takes one file or any shard name of a split checkpoint
 * (<prefix>-00002-of-0000N.gguf) and opens every shard once (O_RDONLY | O_CLOEXEC;
 * the fds stay in the shards). Headers are read with pread through a small buffer;
 * tensor data is never mapped or read here (the fetcher reads it with its own
 * pool). Every header is untrusted: each malformed input gets one SL_EFORMAT (or
 * SL_EMISMATCH / SL_ENOTFOUND / SL_EUNSUPPORTED / SL_EIO) message that names the
 * file and what is wrong; lengths and counts are checked against the bytes left
 * before anything is allocated, so a corrupt header never causes a huge
 * allocation. The opened sl_gguf is immutable and may be shared by threads.
 *
 * Writer: metadata and tensor infos are collected in memory, then the file is
 * written in one pass; tensor bytes come from a caller callback in chunks, so a
 * file of tens of GB is written at disk speed with a few MB of memory.
 *
 * Both sides assume a little-endian host (x86-64, aarch64), as GGUF v3 files are.
 */
#ifndef SL_GGUF_H
#define SL_GGUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "err.h"

#define SL_GGUF_MAGIC             0x46554747u /* "GGUF" little-endian */
#define SL_GGUF_VERSION           3
#define SL_GGUF_DEFAULT_ALIGNMENT 32
#define SL_GGUF_MAX_DIMS          4
#define SL_GGUF_MAX_SHARDS        9999
/* Everything before the data section of one file must fit in this many bytes (the
 * largest real header, a tokenizer-bearing shard 0, is ~6 MB). It bounds what a
 * corrupt length field can make the reader allocate: at most ~6x this. */
#define SL_GGUF_MAX_HEADER_BYTES (64ull << 20)

/* Keys of llama.cpp split checkpoints (gguf-split): split.no is 0-based (u16 in
 * llama.cpp files; any integer type is accepted), split.count the number of shards
 * (u16), split.tensors.count the tensors of all shards together (i32). */
#define SL_GGUF_KEY_ALIGNMENT     "general.alignment"
#define SL_GGUF_KEY_SPLIT_NO      "split.no"
#define SL_GGUF_KEY_SPLIT_COUNT   "split.count"
#define SL_GGUF_KEY_SPLIT_TENSORS "split.tensors.count"

/* Metadata value types, as stored in the file. */
enum sl_gguf_type {
    SL_GGUF_TYPE_UINT8 = 0,
    SL_GGUF_TYPE_INT8 = 1,
    SL_GGUF_TYPE_UINT16 = 2,
    SL_GGUF_TYPE_INT16 = 3,
    SL_GGUF_TYPE_UINT32 = 4,
    SL_GGUF_TYPE_INT32 = 5,
    SL_GGUF_TYPE_FLOAT32 = 6,
    SL_GGUF_TYPE_BOOL = 7,
    SL_GGUF_TYPE_STRING = 8,
    SL_GGUF_TYPE_ARRAY = 9,
    SL_GGUF_TYPE_UINT64 = 10,
    SL_GGUF_TYPE_INT64 = 11,
    SL_GGUF_TYPE_FLOAT64 = 12,
    SL_GGUF_TYPE_COUNT = 13,
};

/* A string as stored: length and bytes; the bytes are also NUL terminated. */
typedef struct sl_gguf_str {
    uint64_t len;
    char *s;
} sl_gguf_str;

/* One metadata key/value. Scalars live in the union; arrays of numbers (and bools)
 * are packed in `arr` at their natural width, arrays of strings are sl_gguf_str[].
 * Nested arrays are refused by the reader (SL_EUNSUPPORTED) and the writer. */
typedef struct sl_gguf_kv {
    sl_gguf_str key;
    uint32_t type;     /* enum sl_gguf_type */
    uint32_t arr_type; /* element type when type == ARRAY */
    uint64_t arr_n;    /* element count when type == ARRAY */
    union {
        uint64_t u64; /* every unsigned integer type and bool (0/1) */
        int64_t i64;  /* every signed integer type */
        double f64;   /* FLOAT32 and FLOAT64 */
        sl_gguf_str str;
        void *arr; /* ARRAY: arr_n elements */
    } v;
} sl_gguf_kv;

/* One tensor of the checkpoint (all shards). */
typedef struct sl_gguf_tensor {
    sl_gguf_str name;
    uint32_t type;                 /* enum sl_qtype */
    uint32_t n_dims;               /* 1..4 */
    uint64_t ne[SL_GGUF_MAX_DIMS]; /* ne[0] contiguous; unused dims are 1 */
    uint32_t shard;                /* index into sl_gguf.shards */
    uint64_t rel_offset;           /* offset as stored, relative to the data section */
    uint64_t offset;               /* absolute offset of the first byte in the shard file */
    uint64_t n_bytes;              /* bytes of the data */
} sl_gguf_tensor;

/* One opened file. */
typedef struct sl_gguf_shard {
    char *path;
    int fd;                /* opened O_RDONLY | O_CLOEXEC, owned */
    uint64_t file_bytes;   /* size when opened */
    uint32_t version;      /* 3 */
    uint64_t alignment;    /* general.alignment or 32 */
    uint64_t data_offset;  /* start of the tensor data section */
    uint64_t header_bytes; /* bytes of header up to the end of the tensor infos */
    sl_gguf_kv *kv;        /* [n_kv] in file order */
    uint64_t n_kv;
    uint64_t first_tensor; /* this shard's tensors are tensors[first..first+n) */
    uint64_t n_tensor;
    void *mem; /* internal: the arena holding kv, strings and names */
} sl_gguf_shard;

/* An opened checkpoint: one or more shards. */
typedef struct sl_gguf {
    sl_gguf_shard *shards; /* [n_shards], in split order */
    uint32_t n_shards;
    sl_gguf_tensor *tensors; /* [n_tensors], shard 0 first, file order within a shard */
    uint64_t n_tensors;
    /* FNV-1a 64 over, for each shard in order, its header_bytes as a u64 LE and
     * then its first header_bytes bytes (magic .. last tensor info). Two opens of
     * the same files give the same value; any header byte changed changes it. */
    uint64_t fingerprint;
    void *index; /* internal: name -> tensor hash table, sorted keys of shard 0 */
} sl_gguf;

/* Opens path (a single GGUF, or any shard name of a split set
 * <prefix>-%05d-of-%05d.gguf, 1-based: then all N shards are opened) and validates
 * every header, the split keys of every shard (split.no == i, split.count == N,
 * split.tensors.count == the total), that no file of another split with the same
 * prefix lies beside them, that keys present in shard 0 and shard i agree, and
 * that tensor names are unique across shards. A missing shard is SL_ENOTFOUND
 * naming it; shards that do not belong together are SL_EMISMATCH. The caller owns
 * *out (sl_gguf_close). Costs one pread per 128 KiB of header per shard. */
int sl_gguf_open(sl_gguf **out, const char *path, sl_err *err);

/* Parses and validates one GGUF header from an open fd (no split handling, split.*
 * keys are not checked): the fuzz entry; sl_gguf_open uses the same parser. name
 * is used in messages. The caller owns *out and closes it with sl_gguf_close; fd
 * is dup()ed (the caller keeps its own). */
int sl_gguf_open_fd(sl_gguf **out, int fd, const char *name, sl_err *err);

/* Closes every shard's fd and frees g; sets *g to NULL. NULL or *g NULL is fine. */
void sl_gguf_close(sl_gguf **g);

/* Writes "<prefix>-%05u-of-%05u.gguf" (i 0-based, written 1-based as llama.cpp
 * does) into buf. Returns 0, or SL_EINVAL when it does not fit cap or i >= n or
 * n is 0 or past SL_GGUF_MAX_SHARDS. */
int sl_gguf_split_path(char *buf, size_t cap, const char *prefix, uint32_t i, uint32_t n);

/* Metadata of shard 0 (the one that carries the model's keys). NULL if absent.
 * O(log n_kv). */
const sl_gguf_kv *sl_gguf_find_kv(const sl_gguf *g, const char *key);
/* A tensor of any shard by name, NULL if absent. O(1) (hash table). */
const sl_gguf_tensor *sl_gguf_find_tensor(const sl_gguf *g, const char *name);

/* Typed getters on shard 0's keys: any integer width converts when the value fits,
 * else SL_EFORMAT ("out of range"); a value of another kind (string for u32 ...)
 * is SL_EFORMAT; an absent key is SL_ENOTFOUND. Messages name the key. get_f32
 * takes FLOAT32, FLOAT64 (when finite values fit a float) and integers; get_bool
 * takes BOOL and integers 0/1; get_str points into g (valid until close). */
int sl_gguf_get_u64(const sl_gguf *g, const char *key, uint64_t *out, sl_err *err);
int sl_gguf_get_u32(const sl_gguf *g, const char *key, uint32_t *out, sl_err *err);
int sl_gguf_get_i64(const sl_gguf *g, const char *key, int64_t *out, sl_err *err);
int sl_gguf_get_f32(const sl_gguf *g, const char *key, float *out, sl_err *err);
int sl_gguf_get_bool(const sl_gguf *g, const char *key, int *out, sl_err *err);
int sl_gguf_get_str(const sl_gguf *g, const char *key, const char **out, sl_err *err);
/* An integer array converted to int64 (caller passes room for max entries; *n gets
 * the count, also when it is more than max). SL_EFORMAT when it is not an integer
 * array, an element does not fit int64, or it has more than max entries. */
int sl_gguf_get_arr_i64(const sl_gguf *g, const char *key, int64_t *out, uint64_t max, uint64_t *n,
                        sl_err *err);

/* "u32", "string", "array" ...; "?" for ids past SL_GGUF_TYPE_COUNT. */
const char *sl_gguf_type_name(uint32_t type);

/* Bytes of one scalar value of a metadata type; 0 for STRING, ARRAY and unknown
 * types. */
uint64_t sl_gguf_scalar_width(uint32_t type);

/* Prints "key = value" (no newline) to f: scalars in full (floats with enough
 * digits to read back), strings quoted and escaped, cut after 256 bytes with
 * "... (N bytes)", arrays as "[n x type]" and their first 8 values, then "...". */
void sl_gguf_print_kv(FILE *f, const sl_gguf_kv *kv);

/* ---- writer ---- */

typedef struct sl_gguf_writer sl_gguf_writer;

/* Fills len bytes of tensor `tensor` (writer index) starting at byte `off` of its
 * data into buf. Returns 0 or a negative SL_E code with err set. */
typedef int (*sl_gguf_fill_fn)(void *ctx, uint64_t tensor, uint64_t off, void *buf, uint64_t len,
                               sl_err *err);

/* alignment: a power of two >= 8 (at most 1 GiB); written as general.alignment
 * (u32, the first key) when not 32, so setting that key yourself is a duplicate. */
int sl_gguf_writer_init(sl_gguf_writer **out, uint32_t alignment, sl_err *err);
void sl_gguf_writer_free(sl_gguf_writer **w);

/* Metadata setters; keys and values are copied, written in call order. A
 * duplicate or empty key is SL_EINVAL; SL_ENOMEM when out of memory. */
int sl_gguf_writer_set_u8(sl_gguf_writer *w, const char *key, uint8_t v);
int sl_gguf_writer_set_i8(sl_gguf_writer *w, const char *key, int8_t v);
int sl_gguf_writer_set_u16(sl_gguf_writer *w, const char *key, uint16_t v);
int sl_gguf_writer_set_i16(sl_gguf_writer *w, const char *key, int16_t v);
int sl_gguf_writer_set_u32(sl_gguf_writer *w, const char *key, uint32_t v);
int sl_gguf_writer_set_i32(sl_gguf_writer *w, const char *key, int32_t v);
int sl_gguf_writer_set_u64(sl_gguf_writer *w, const char *key, uint64_t v);
int sl_gguf_writer_set_i64(sl_gguf_writer *w, const char *key, int64_t v);
int sl_gguf_writer_set_f32(sl_gguf_writer *w, const char *key, float v);
int sl_gguf_writer_set_f64(sl_gguf_writer *w, const char *key, double v);
int sl_gguf_writer_set_bool(sl_gguf_writer *w, const char *key, int v);
int sl_gguf_writer_set_str(sl_gguf_writer *w, const char *key, const char *v);
/* An array of n numbers of elem_type (packed at the type's width, bools one byte
 * each), copied. elem_type STRING or ARRAY is SL_EINVAL (nested arrays). */
int sl_gguf_writer_set_arr(sl_gguf_writer *w, const char *key, uint32_t elem_type, const void *data,
                           uint64_t n);
/* An array of n NUL-terminated strings, copied. */
int sl_gguf_writer_set_arr_str(sl_gguf_writer *w, const char *key, const char *const *strs,
                               uint64_t n);

/* Adds a tensor info; data comes from the fill callback at write time, in add
 * order. ne[0] must be a multiple of the type's block. Returns the tensor's writer
 * index (>= 0) or a negative SL_E code with err set. */
int64_t sl_gguf_writer_add_tensor(sl_gguf_writer *w, const char *name, uint32_t type,
                                  uint32_t n_dims, const uint64_t *ne, sl_err *err);

/* Bytes the finished file will have. */
uint64_t sl_gguf_writer_file_bytes(const sl_gguf_writer *w);

/* Progress callback: bytes written so far of total; may be NULL. */
typedef void (*sl_gguf_progress_fn)(void *ctx, uint64_t done, uint64_t total);

/* Writes the file to path (created or truncated, mode 0644) and fsyncs it: header,
 * zero padding to the alignment, then each tensor's bytes (from fill, in chunks of
 * at most 4 MiB, each tensor padded to the alignment) through one 4 MiB buffer;
 * write-behind keeps the page cache from filling on files of tens of GB. A short
 * write or a full disk is SL_EIO / SL_ENOSPACE naming the path, an error of fill
 * is passed on; on any failure the partial file is removed. May be called again
 * (to write the same file elsewhere). */
int sl_gguf_writer_write(sl_gguf_writer *w, const char *path, sl_gguf_fill_fn fill, void *ctx,
                         sl_gguf_progress_fn progress, void *progress_ctx, sl_err *err);

#endif
