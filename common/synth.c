/* synth.c - writes a synthetic deepseek41 checkpoint: metadata, tokenizer, seeded
 * weights, split into shards.
 *
 * Each tensor row's values come from a xoshiro256** stream seeded by (seed,
 * layout index, row) (with cfg->layer_period, the layout index of the same kind's
 * tensor in the layer it repeats), so the bytes depend on nothing else: not on the shard
 * count, the chunking of the GGUF writer or the number of threads. Float tensors
 * and quantized tensors up to cfg->quantize_max_values values are drawn in f32 at
 * a plausible scale and quantized by the reference quantizers (sl_quant_encode,
 * rows spread over threads); larger quantized tensors, and all of them with
 * fast_random_blocks (bench presets), get random bytes with each block's f16
 * scales overwritten by small finite values calibrated to the same spread, which
 * is valid and runs at memory speed. Rows are generated into one staging buffer
 * (4 MiB) that the writer's fill callback copies from.
 */
#include "synth.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quant.h"

/* ---- random numbers ---- */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct rng {
    uint64_t s[4];
} rng;

/* Independent streams for every (seed, a, b): splitmix64 of a hash of the three. */
static void rng_seed(rng *r, uint64_t seed, uint64_t a, uint64_t b)
{
    uint64_t x =
        mix64(mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ a) ^ (b + 0x632be59bd9b4e019ull));
    for (int i = 0; i < 4; i++) {
        x += 0x9e3779b97f4a7c15ull;
        r->s[i] = mix64(x);
    }
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static inline uint64_t rng_next(rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

/* Approximately N(0, 1): the sum of four 16-bit uniforms, centred and scaled
 * (Irwin-Hall; bounded at +-3.46, which is what weights look like anyway). */
static inline float rng_normal(rng *r)
{
    uint64_t v = rng_next(r);
    uint32_t s = (uint32_t)(v & 0xffff) + (uint32_t)((v >> 16) & 0xffff) +
                 (uint32_t)((v >> 32) & 0xffff) + (uint32_t)(v >> 48);
    return ((float)s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}

/* Stream domains, so that different uses of one seed never share a stream. */
#define STREAM_TENSOR 0x74656e736f72ull /* "tensor" */
#define STREAM_ENGRAM 0x656e6772616dull /* "engram" */

/* ---- derived constants ---- */

static void derive_with(sl_model_config *cfg, uint32_t n_compressed, uint64_t seed)
{
    cfg->engram_compressed_vocab = n_compressed;
    /* §6.4's bound keeps tau * mu < 2^63 for every compressed id tau */
    uint64_t beta = ((uint64_t)INT64_MAX / (n_compressed ? n_compressed : 1)) / 2;
    uint64_t bound = beta < (1ull << 46) ? beta : (1ull << 46);
    for (uint32_t e = 0; e < cfg->n_engram; e++) {
        rng r;
        rng_seed(&r, seed, STREAM_ENGRAM, cfg->engram_layer[e]);
        for (uint32_t i = 0; i < cfg->engram_max_ngram; i++)
            cfg->engram_multiplier[e][i] = 2 * ((rng_next(&r) >> 1) % bound) + 1;
    }
}

int sl_synth_derive(sl_model_config *cfg, uint64_t seed, sl_err *err)
{
    sl_synth_tokenizer *tok = NULL;
    int rc = sl_synth_tokenizer_build(&tok, cfg->vocab, err);
    if (rc) return rc;
    derive_with(cfg, tok->n_compressed, seed);
    sl_synth_tokenizer_free(&tok);
    return 0;
}

/* ---- tensor values ---- */

/* Mean and spread of a kind's f32 values before quantization. */
static void value_scale(const sl_model_tensor *t, float *mean, float *std)
{
    *mean = 0.0f;
    *std = 1.0f / sqrtf((float)t->ne[0]); /* matrices: unit-variance outputs */
    switch (t->kind) {
    case SL_MODEL_TENSOR_ATTN_NORM:
    case SL_MODEL_TENSOR_FFN_NORM:
    case SL_MODEL_TENSOR_OUTPUT_NORM:
    case SL_MODEL_TENSOR_ATTN_Q_A_NORM:
    case SL_MODEL_TENSOR_ATTN_KV_A_NORM:
    case SL_MODEL_TENSOR_COMPRESSOR_NORM:
    case SL_MODEL_TENSOR_INDEXER_K_NORM:
    case SL_MODEL_TENSOR_ENGRAM_Q:
    case SL_MODEL_TENSOR_ENGRAM_K:
        *mean = 1.0f, *std = 0.1f;
        break;
    case SL_MODEL_TENSOR_HC_ATTN_BASE:
    case SL_MODEL_TENSOR_HC_FFN_BASE:
        *std = 0.5f;
        break;
    case SL_MODEL_TENSOR_HC_ATTN_SCALE:
    case SL_MODEL_TENSOR_HC_FFN_SCALE:
        *mean = 0.5f, *std = 0.05f;
        break;
    case SL_MODEL_TENSOR_ATTN_SINKS:
        *std = 1.0f;
        break;
    case SL_MODEL_TENSOR_EXP_PROBS_B:
    case SL_MODEL_TENSOR_EXP_PROBS_B_VL:
        *std = 0.01f;
        break;
    case SL_MODEL_TENSOR_TOKEN_EMBD:
    case SL_MODEL_TENSOR_ENGRAM_EMBD:
        *std = 0.5f;
        break;
    default:
        break;
    }
}

/* Where a block type keeps its f16 scales, and how random codes relate to them:
 * with uniform random codes and sub-scales, a block's values have spread
 * sigma_per_d * d, and mean ~0 when dmin = dmin_ratio * d (E[d*s*q] = E[dmin*m]).
 * n_f16 0: not a block type (float tensors are always drawn and converted). */
typedef struct block_fix {
    uint32_t bytes;
    uint32_t n_f16;  /* 1: d, 2: d and dmin */
    uint32_t off[2]; /* byte offsets of d and dmin in the block */
    float sigma_per_d;
    float dmin_ratio;
} block_fix;

static block_fix block_fix_of(uint32_t type)
{
    block_fix f = {0, 0, {0, 0}, 1.0f, 0.0f};
    switch (type) {
    case SL_QTYPE_Q2_K: /* d*s*q - dmin*m, s, m 4-bit, q 2-bit */
        f = (block_fix){sizeof(sl_block_q2_k),
                        2,
                        {offsetof(sl_block_q2_k, d), offsetof(sl_block_q2_k, dmin)},
                        13.9f,
                        1.5f};
        break;
    case SL_QTYPE_Q3_K: /* d*(s-32)*(q-4), s 6-bit, q 3-bit */
        f = (block_fix){sizeof(sl_block_q3_k), 1, {offsetof(sl_block_q3_k, d), 0}, 43.3f, 0.0f};
        break;
    case SL_QTYPE_Q4_K: /* d*s*q - dmin*m, s, m 6-bit, q 4-bit */
        f = (block_fix){sizeof(sl_block_q4_k),
                        2,
                        {offsetof(sl_block_q4_k, d), offsetof(sl_block_q4_k, dmin)},
                        258.0f,
                        7.5f};
        break;
    case SL_QTYPE_Q5_K: /* as Q4_K with 5-bit q */
        f = (block_fix){sizeof(sl_block_q5_k),
                        2,
                        {offsetof(sl_block_q5_k, d), offsetof(sl_block_q5_k, dmin)},
                        527.0f,
                        15.5f};
        break;
    case SL_QTYPE_Q6_K: /* d*s*(q-32), s int8, q 6-bit */
        f = (block_fix){sizeof(sl_block_q6_k), 1, {offsetof(sl_block_q6_k, d), 0}, 1366.0f, 0.0f};
        break;
    case SL_QTYPE_Q8_0: /* d*q, q int8 */
        f = (block_fix){sizeof(sl_block_q8_0), 1, {offsetof(sl_block_q8_0, d), 0}, 73.9f, 0.0f};
        break;
    }
    return f;
}

#define STAGE_BYTES (4u << 20)
#define MAX_THREADS 16

/* State of one shard's fill callback. */
typedef struct gen {
    const sl_model_config *cfg;
    const sl_model_tensor *layout;
    uint64_t n_layout;
    uint64_t seed;
    uint64_t first; /* layout index of this shard's writer tensor 0 */
    uint8_t *stage; /* generated rows [st_row0, st_row0 + st_rows) of st_tensor */
    size_t stage_cap;
    uint64_t st_tensor, st_row0, st_rows;
    uint32_t n_threads;
    float *fbuf[MAX_THREADS]; /* [max ne0] each, one per quantizing thread */
} gen;

/* Rows [row0, row0 + n) of one tensor, by one thread. */
typedef struct row_job {
    const gen *g;
    uint64_t ti, key, row0, n, rb; /* key: the layout index whose streams the rows use */
    uint8_t *dst;
    float *fbuf;
    int rc;
} row_job;

static void rows_random(const row_job *j, const block_fix *f)
{
    const sl_model_tensor *t = &j->g->layout[j->ti];
    float mean, std;
    value_scale(t, &mean, &std);
    /* 16 values around the calibrated d (x0.75 .. x1.22); dmin from its own table */
    sl_f16 fix[2][16];
    for (int i = 0; i < 16; i++) {
        float d = std / f->sigma_per_d * (0.75f + (float)i / 32.0f);
        fix[0][i] = sl_f32_to_f16(d);
        fix[1][i] = sl_f32_to_f16(d * f->dmin_ratio);
    }
    for (uint64_t i = 0; i < j->n; i++) {
        rng r;
        rng_seed(&r, j->g->seed, STREAM_TENSOR ^ (j->key << 8), j->row0 + i);
        uint8_t *dst = j->dst + i * j->rb;
        uint64_t k = 0;
        for (; k + 8 <= j->rb; k += 8) {
            uint64_t v = rng_next(&r);
            memcpy(dst + k, &v, 8);
        }
        if (k < j->rb) {
            uint64_t v = rng_next(&r);
            memcpy(dst + k, &v, j->rb - k);
        }
        uint64_t bits = rng_next(&r);
        for (uint64_t b = 0; b < j->rb; b += f->bytes) {
            for (uint32_t h = 0; h < f->n_f16; h++) {
                memcpy(dst + b + f->off[h], &fix[h][bits & 15], sizeof(sl_f16));
                bits = (bits >> 4) | (bits << 60);
            }
        }
    }
}

static void *rows_quantize(void *arg)
{
    row_job *j = arg;
    const sl_model_tensor *t = &j->g->layout[j->ti];
    float mean, std;
    value_scale(t, &mean, &std);
    for (uint64_t i = 0; i < j->n && !j->rc; i++) {
        rng r;
        rng_seed(&r, j->g->seed, STREAM_TENSOR ^ (j->key << 8), j->row0 + i);
        for (uint64_t k = 0; k < t->ne[0]; k++) j->fbuf[k] = mean + std * rng_normal(&r);
        j->rc = sl_quant_encode(t->type, j->fbuf, j->dst + i * j->rb, t->ne[0]);
    }
    return NULL;
}

/* The layout index whose streams tensor ti's rows use: its own, or with a layer
 * period P the same kind's in layer (layer mod P), when that layer has one of the same
 * type and shape. */
static uint64_t stream_key(const gen *g, uint64_t ti)
{
    const sl_model_tensor *t = &g->layout[ti];
    const uint32_t p = g->cfg->layer_period;
    if (!p || t->layer < (int32_t)p) return ti;
    for (uint64_t i = 0; i < g->n_layout; i++) {
        const sl_model_tensor *u = &g->layout[i];
        if (u->kind == t->kind && u->layer == t->layer % (int32_t)p && u->type == t->type &&
            !memcmp(u->ne, t->ne, sizeof t->ne))
            return i;
    }
    return ti; /* no such tensor there, or another shape: its own bytes */
}

/* Generates rows [row0, row0 + n) of layout tensor ti into dst (rb bytes per row).
 * Quantization is spread over the threads; every row has its own stream, so the
 * bytes do not depend on the split. */
static int gen_rows(gen *g, uint64_t ti, uint64_t row0, uint64_t n, uint8_t *dst, uint64_t rb,
                    sl_err *err)
{
    const sl_model_tensor *t = &g->layout[ti];
    block_fix f = block_fix_of(t->type);
    uint64_t values = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    const uint64_t key = stream_key(g, ti);
    row_job job = {g, ti, key, row0, n, rb, dst, g->fbuf[0], 0};
    if (f.n_f16 && (g->cfg->fast_random_blocks || values > g->cfg->quantize_max_values)) {
        rows_random(&job, &f);
        return 0;
    }
    uint32_t nt = g->n_threads;
    if (values * 100 < STAGE_BYTES || n < 4 * (uint64_t)nt) nt = 1; /* not worth a thread */
    row_job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    uint32_t started = 1;
    for (uint32_t k = 0; k < nt; k++) {
        uint64_t a = n * k / nt, b = n * (k + 1) / nt;
        jobs[k] = (row_job){g, ti, key, row0 + a, b - a, rb, dst + a * rb, g->fbuf[k], 0};
    }
    for (uint32_t k = 1; k < nt; k++, started++)
        if (pthread_create(&tid[k], NULL, rows_quantize, &jobs[k])) break;
    for (uint32_t k = started; k < nt; k++) rows_quantize(&jobs[k]); /* no thread: do it here */
    rows_quantize(&jobs[0]);
    for (uint32_t k = 1; k < started; k++) pthread_join(tid[k], NULL);
    for (uint32_t k = 0; k < nt; k++)
        if (jobs[k].rc)
            return sl_err_set(err, jobs[k].rc,
                              "sl_quant_encode(%s, type %s, %" PRIu64 " values per row) failed",
                              t->name, sl_qtype_get(t->type)->name, t->ne[0]);
    return 0;
}

static int gen_fill(void *ctx, uint64_t tensor, uint64_t off, void *buf, uint64_t len, sl_err *err)
{
    gen *g = ctx;
    uint64_t ti = g->first + tensor;
    const sl_model_tensor *t = &g->layout[ti];
    uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3], rb = t->n_bytes / rows;
    if (off + len > t->n_bytes)
        return sl_err_set(err, SL_EINVAL,
                          "fill(%s, off %" PRIu64 ", len %" PRIu64 ") past the tensor's %" PRIu64
                          " bytes",
                          t->name, off, len, t->n_bytes);
    uint8_t *out = buf;
    while (len) {
        uint64_t r = off / rb;
        if (g->st_tensor != ti || r < g->st_row0 || r >= g->st_row0 + g->st_rows) {
            if (rb > g->stage_cap) {
                uint8_t *s = realloc(g->stage, rb);
                if (!s)
                    return sl_err_set(err, SL_ENOMEM, "synth: row buffer of %" PRIu64 " bytes", rb);
                g->stage = s;
                g->stage_cap = rb;
            }
            uint64_t n = g->stage_cap / rb;
            if (n > rows - r) n = rows - r;
            g->st_tensor = UINT64_MAX;
            int rc = gen_rows(g, ti, r, n, g->stage, rb, err);
            if (rc) return rc;
            g->st_tensor = ti, g->st_row0 = r, g->st_rows = n;
        }
        uint64_t at = off - g->st_row0 * rb, have = g->st_rows * rb - at;
        uint64_t k = have < len ? have : len;
        memcpy(out, g->stage + at, k);
        out += k, off += k, len -= k;
    }
    return 0;
}

/* ---- files ---- */

/* mkdir -p: creates dir and its missing parents (0755). */
static int make_dirs(const char *dir, sl_err *err)
{
    size_t n = strlen(dir);
    if (n == 0) return sl_err_set(err, SL_EINVAL, "output dir is empty");
    char *p = malloc(n + 1);
    if (!p) return sl_err_set(err, SL_ENOMEM, "mkdir(%s)", dir);
    memcpy(p, dir, n + 1);
    int rc = 0;
    for (size_t i = 1; i <= n && !rc; i++) {
        if (p[i] != '/' && p[i] != 0) continue;
        char c = p[i];
        p[i] = 0;
        struct stat st;
        if (mkdir(p, 0755) && errno != EEXIST)
            rc = sl_err_errno(err, SL_EIO, errno, "mkdir(%s)", p);
        else if (stat(p, &st) || !S_ISDIR(st.st_mode))
            rc = sl_err_set(err, SL_EIO, "output dir %s: %s exists and is not a directory", dir, p);
        p[i] = c;
    }
    free(p);
    if (!rc && access(dir, W_OK | X_OK))
        rc = sl_err_errno(err, SL_EIO, errno, "output dir %s is not writable: access", dir);
    return rc;
}

/* Removes dir/<name>-NNNNN-of-MMMMM.gguf files of other shard counts than n, left by
 * an earlier write of the same checkpoint name (a reader refuses mixed splits). */
static void remove_stale(const char *dir, const char *name, uint32_t n)
{
    DIR *d = opendir(dir);
    if (!d) return;
    size_t nl = strlen(name);
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *s = e->d_name;
        unsigned a, b;
        char tail[8];
        if (strncmp(s, name, nl) || s[nl] != '-') continue;
        if (strlen(s + nl) != strlen("-00001-of-00001.gguf")) continue;
        if (sscanf(s + nl, "-%5u-of-%5u%7s", &a, &b, tail) != 3 || strcmp(tail, ".gguf")) continue;
        if (b == n) continue;
        char path[4096];
        if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, s) < sizeof path) unlink(path);
    }
    closedir(d);
}

static int set_tokenizer(sl_gguf_writer *w, const sl_synth_tokenizer *tok, sl_err *err)
{
    const char *key = NULL;
    int rc = 0;
#define TRY(k, call)                                                                               \
    do {                                                                                           \
        if (!rc && (rc = (call))) key = (k);                                                       \
    } while (0)
    TRY("tokenizer.ggml.model", sl_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"));
    TRY("tokenizer.ggml.pre", sl_gguf_writer_set_str(w, "tokenizer.ggml.pre", "deepseek-v3"));
    TRY("tokenizer.ggml.tokens",
        sl_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tok->tokens,
                                   tok->n_vocab));
    TRY("tokenizer.ggml.token_type",
        sl_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", SL_GGUF_TYPE_INT32, tok->token_type,
                               tok->n_vocab));
    TRY("tokenizer.ggml.merges",
        sl_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", (const char *const *)tok->merges,
                                   tok->n_merges));
    TRY("tokenizer.ggml.bos_token_id",
        sl_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", SL_SYNTH_TOKEN_BOS));
    TRY("tokenizer.ggml.eos_token_id",
        sl_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", SL_SYNTH_TOKEN_EOS));
    TRY("tokenizer.ggml.padding_token_id",
        sl_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", SL_SYNTH_TOKEN_PAD));
    TRY("tokenizer.ggml.add_bos_token",
        sl_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", 1));
    TRY("tokenizer.ggml.add_eos_token",
        sl_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", 0));
#undef TRY
    if (rc) return sl_err_set(err, rc, "gguf writer: key %s: %s", key, sl_status_name(rc));
    return 0;
}

/* Layout index where each shard starts: in order, balanced by bytes, none empty
 * (n_shards <= n). A tensor goes to the shard its middle byte falls in. */
static void plan_shards(const sl_model_tensor *t, uint64_t n, uint32_t n_shards, uint64_t *start)
{
    uint64_t total = 0, cum = 0, i = 0; /* cum: bytes of tensors [0, i) */
    for (uint64_t k = 0; k < n; k++) total += t[k].n_bytes;
    start[0] = 0;
    for (uint32_t s = 1; s < n_shards; s++) {
        uint64_t target = (uint64_t)((double)total * s / n_shards);
        cum += t[i++].n_bytes; /* shard s - 1 gets at least one tensor */
        while (i < n - (n_shards - s) && cum + t[i].n_bytes / 2 < target) cum += t[i++].n_bytes;
        start[s] = i;
    }
    start[n_shards] = n;
}

typedef struct progress_ctx {
    sl_synth_progress_fn fn;
    void *ctx;
    sl_synth_progress p;
    uint64_t base; /* bytes of the shards before this one */
} progress_ctx;

static void on_progress(void *ctx, uint64_t done, uint64_t total)
{
    (void)total;
    progress_ctx *pc = ctx;
    pc->p.done_bytes = pc->base + done;
    if (pc->fn) pc->fn(pc->ctx, &pc->p);
}

int sl_synth_write(const sl_model_config *cfg_in, const char *dir, uint32_t n_shards, uint64_t seed,
                   sl_synth_progress_fn progress, void *progress_ctx_, sl_synth_stats *stats,
                   sl_err *err)
{
    sl_model_config cfg = *cfg_in;
    sl_synth_tokenizer *tok = NULL;
    sl_model_tensor *layout = NULL;
    sl_gguf_writer **w = NULL;
    uint64_t *start = NULL, n = 0;
    gen g;
    memset(&g, 0, sizeof g);
    int rc;
    if ((rc = sl_model_layout(&cfg, &layout, &n, err))) goto fail;
    if (n_shards == 0 || n_shards > n || n_shards > SL_GGUF_MAX_SHARDS) {
        rc = sl_err_set(err, SL_EINVAL,
                        "shard count %" PRIu32 " not in 1..%" PRIu64 " (the checkpoint has %" PRIu64
                        " tensors)",
                        n_shards, n < SL_GGUF_MAX_SHARDS ? n : (uint64_t)SL_GGUF_MAX_SHARDS, n);
        goto fail;
    }
    if ((rc = sl_synth_tokenizer_build(&tok, cfg.vocab, err))) goto fail;
    derive_with(&cfg, tok->n_compressed, seed);
    if ((rc = make_dirs(dir, err))) goto fail;

    w = calloc(n_shards, sizeof *w);
    start = malloc((n_shards + 1) * sizeof *start);
    if (!w || !start) {
        rc = sl_err_set(err, SL_ENOMEM, "synth: %" PRIu32 " shard writers", n_shards);
        goto fail;
    }
    plan_shards(layout, n, n_shards, start);
    uint64_t total = 0, max_ne0 = 1;
    for (uint64_t i = 0; i < n; i++)
        if (layout[i].ne[0] > max_ne0) max_ne0 = layout[i].ne[0];
    for (uint32_t s = 0; s < n_shards; s++) {
        if ((rc = sl_gguf_writer_init(&w[s], SL_GGUF_DEFAULT_ALIGNMENT, err))) goto fail;
        if (s == 0) {
            if ((rc = sl_model_config_write(&cfg, tok->token_map, w[s], err)) ||
                (rc = set_tokenizer(w[s], tok, err)))
                goto fail;
            if ((rc = sl_gguf_writer_set_u64(w[s], "sluice.synth.seed", seed))) {
                rc = sl_err_set(err, rc, "gguf writer: key sluice.synth.seed");
                goto fail;
            }
        }
        if ((rc = sl_gguf_writer_set_u16(w[s], SL_GGUF_KEY_SPLIT_NO, (uint16_t)s)) ||
            (rc = sl_gguf_writer_set_u16(w[s], SL_GGUF_KEY_SPLIT_COUNT, (uint16_t)n_shards)) ||
            (rc = sl_gguf_writer_set_i32(w[s], SL_GGUF_KEY_SPLIT_TENSORS, (int32_t)n))) {
            rc = sl_err_set(err, rc, "gguf writer: split keys of shard %" PRIu32, s);
            goto fail;
        }
        for (uint64_t i = start[s]; i < start[s + 1]; i++) {
            int64_t id = sl_gguf_writer_add_tensor(w[s], layout[i].name, layout[i].type,
                                                   layout[i].n_dims, layout[i].ne, err);
            if (id < 0) {
                rc = (int)id;
                goto fail;
            }
        }
        total += sl_gguf_writer_file_bytes(w[s]);
    }

    g.cfg = &cfg;
    g.layout = layout;
    g.n_layout = n;
    g.seed = seed;
    g.st_tensor = UINT64_MAX;
    g.stage_cap = STAGE_BYTES;
    g.stage = malloc(g.stage_cap);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    g.n_threads = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (uint32_t)cpus;
    int no_mem = !g.stage;
    for (uint32_t k = 0; k < g.n_threads; k++)
        no_mem |= !(g.fbuf[k] = malloc(max_ne0 * sizeof *g.fbuf[k]));
    if (no_mem) {
        rc = sl_err_set(err, SL_ENOMEM, "synth: staging buffers");
        goto fail;
    }
    progress_ctx pc = {progress, progress_ctx_, {0, n_shards, 0, total}, 0};
    if (progress) progress(progress_ctx_, &pc.p);
    for (uint32_t s = 0; s < n_shards; s++) {
        char path[4096], file[512];
        if (sl_gguf_split_path(file, sizeof file, cfg.name, s, n_shards) ||
            (size_t)snprintf(path, sizeof path, "%s/%s", dir, file) >= sizeof path) {
            rc = sl_err_set(err, SL_EINVAL, "output path %s/%s... is too long", dir, cfg.name);
            goto fail;
        }
        g.first = start[s];
        g.st_tensor = UINT64_MAX;
        pc.p.shard = s;
        if ((rc = sl_gguf_writer_write(w[s], path, gen_fill, &g, on_progress, &pc, err))) goto fail;
        pc.base += sl_gguf_writer_file_bytes(w[s]);
    }
    remove_stale(dir, cfg.name, n_shards);
    if (stats) {
        stats->n_files = n_shards;
        stats->n_tensors = n;
        stats->total_bytes = total;
    }
    rc = 0;
fail:
    if (w)
        for (uint32_t s = 0; s < n_shards; s++) sl_gguf_writer_free(&w[s]);
    free(w);
    free(start);
    free(layout);
    free(g.stage);
    for (uint32_t k = 0; k < MAX_THREADS; k++) free(g.fbuf[k]);
    sl_synth_tokenizer_free(&tok);
    return rc;
}
