/* sluice_gguf.c - `sluice-gguf`: look inside a GGUF checkpoint.
 *
 *   info FILE [--summary]   metadata, tensors (type, shape, offset, shard), totals per
 *                           type, split info
 *   verify FILE [--data]    every header check on every shard, the expert slice map;
 *                           --data also reads every tensor byte and checks block scales
 *   dump FILE TENSOR        the tensor decoded to little-endian f32 on stdout
 *   experts FILE            the routed-expert slice map and slot layout, summarised
 *
 * Exit codes: 0 ok, 1 the checkpoint is bad or an I/O error happened, 2 usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "expert_map.h"
#include "gguf.h"
#include "quant.h"
#include "synth.h"

#define CHUNK_BYTES (8u << 20)

static void usage(FILE *f)
{
    fprintf(f, "usage: sluice-gguf COMMAND FILE [ARGS]\n"
               "  info FILE [--summary]   metadata, tensors, totals per type, split info\n"
               "  verify FILE [--data]    check every shard's header (and with --data every\n"
               "                          tensor byte and block scale) and the expert map\n"
               "  dump FILE TENSOR        TENSOR decoded to little-endian f32 on stdout\n"
               "  experts FILE            routed-expert slice map and slot layout\n"
               "FILE is a single GGUF or any shard of a split checkpoint.\n");
}

static void print_bytes(FILE *f, uint64_t b)
{
    if (b >= (1ull << 30))
        fprintf(f, "%.2f GiB", (double)b / (1ull << 30));
    else if (b >= (1ull << 20))
        fprintf(f, "%.2f MiB", (double)b / (1ull << 20));
    else if (b >= (1ull << 10))
        fprintf(f, "%.2f KiB", (double)b / (1ull << 10));
    else
        fprintf(f, "%" PRIu64 " B", b);
}

static void print_shape(FILE *f, const sl_gguf_tensor *t)
{
    fputc('[', f);
    for (uint32_t d = 0; d < t->n_dims; d++) fprintf(f, "%s%" PRIu64, d ? ", " : "", t->ne[d]);
    fputc(']', f);
}

static void print_totals(const sl_gguf *g)
{
    uint64_t count[SL_QTYPE_COUNT] = {0}, bytes[SL_QTYPE_COUNT] = {0}, total = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        count[g->tensors[i].type]++;
        bytes[g->tensors[i].type] += g->tensors[i].n_bytes;
        total += g->tensors[i].n_bytes;
    }
    printf("totals per type:\n");
    for (uint32_t t = 0; t < SL_QTYPE_COUNT; t++) {
        if (!count[t]) continue;
        printf("  %-6s %6" PRIu64 " tensors  ", sl_qtype_get(t)->name, count[t]);
        print_bytes(stdout, bytes[t]);
        printf("  (%.1f%%)\n", total ? 100.0 * (double)bytes[t] / (double)total : 0.0);
    }
    printf("  all    %6" PRIu64 " tensors  ", g->n_tensors);
    print_bytes(stdout, total);
    printf("\n");
}

static void print_split(const sl_gguf *g)
{
    printf("shards: %u\n", g->n_shards);
    for (uint32_t s = 0; s < g->n_shards; s++) {
        const sl_gguf_shard *sh = &g->shards[s];
        printf("  [%u] %s: %" PRIu64 " tensors, %" PRIu64 " keys, header ", s, sh->path,
               sh->n_tensor, sh->n_kv);
        print_bytes(stdout, sh->header_bytes);
        printf(", file ");
        print_bytes(stdout, sh->file_bytes);
        printf(", alignment %" PRIu64 "\n", sh->alignment);
    }
    printf("fingerprint: %016" PRIx64 "\n", g->fingerprint);
}

static int cmd_info(const sl_gguf *g, int summary)
{
    const sl_gguf_shard *s0 = &g->shards[0];
    printf("GGUF v%u, %" PRIu64 " metadata keys in shard 0\n", s0->version, s0->n_kv);
    for (uint64_t i = 0; i < s0->n_kv; i++) {
        const sl_gguf_kv *kv = &s0->kv[i];
        /* The tokenizer's big arrays are noise in a summary. */
        if (summary && kv->type == SL_GGUF_TYPE_ARRAY && kv->arr_n > 64) continue;
        printf("  ");
        sl_gguf_print_kv(stdout, kv);
        printf("\n");
    }
    print_split(g);
    if (!summary) {
        printf("tensors:\n");
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            const sl_gguf_tensor *t = &g->tensors[i];
            printf("  %-44s %-5s ", t->name.s, sl_qtype_get(t->type)->name);
            print_shape(stdout, t);
            printf("  shard %u off %" PRIu64 " bytes %" PRIu64 "\n", t->shard, t->offset,
                   t->n_bytes);
        }
    }
    print_totals(g);
    return 0;
}

/* Reads a tensor's bytes [off, off+len) into buf, handling short reads and EINTR. */
static int read_tensor(const sl_gguf *g, const sl_gguf_tensor *t, uint64_t off, void *buf,
                       uint64_t len, sl_err *err)
{
    const sl_gguf_shard *sh = &g->shards[t->shard];
    uint8_t *p = buf;
    uint64_t at = t->offset + off;
    while (len) {
        ssize_t n = pread(sh->fd, p, len, (off_t)at);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0)
            return sl_err_errno(err, SL_EIO, errno, "pread(%s, off %" PRIu64 ", len %" PRIu64 ")",
                                sh->path, at, len);
        if (n == 0)
            return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' ends early: EOF at offset %" PRIu64,
                              sh->path, t->name.s, at);
        p += n;
        at += (uint64_t)n;
        len -= (uint64_t)n;
    }
    return 0;
}

/* Rows of tensor t that fit in one chunk (at least one). */
static uint64_t rows_per_chunk(uint64_t row_bytes)
{
    uint64_t r = CHUNK_BYTES / row_bytes;
    return r ? r : 1;
}

/* Decodes the whole tensor chunk by chunk; each chunk's f32 values go to sink. */
typedef int (*row_sink)(void *ctx, const sl_gguf_tensor *t, uint64_t row0, const float *v,
                        uint64_t n, sl_err *err);

static int decode_tensor(const sl_gguf *g, const sl_gguf_tensor *t, row_sink sink, void *ctx,
                         sl_err *err)
{
    const sl_qtype_info *qi = sl_qtype_get(t->type);
    if (!qi->decodable)
        return sl_err_set(err, SL_EUNSUPPORTED, "tensor '%s': type %s cannot be decoded", t->name.s,
                          qi->name);
    uint64_t row_bytes = sl_qtype_row_bytes(t->type, t->ne[0]);
    uint64_t n_rows = t->n_bytes / row_bytes;
    uint64_t per = rows_per_chunk(row_bytes);
    uint8_t *raw = malloc(per * row_bytes);
    float *vals = malloc(per * t->ne[0] * sizeof(float));
    int rc = 0;
    if (!raw || !vals) {
        rc = sl_err_set(err, SL_ENOMEM, "tensor '%s': out of memory for a %" PRIu64 "-row chunk",
                        t->name.s, per);
        goto done;
    }
    for (uint64_t r = 0; r < n_rows && !rc; r += per) {
        uint64_t nr = n_rows - r < per ? n_rows - r : per;
        rc = read_tensor(g, t, r * row_bytes, raw, nr * row_bytes, err);
        if (!rc) rc = sl_quant_decode(t->type, raw, vals, nr * t->ne[0]);
        if (rc == SL_EINVAL)
            rc = sl_err_set(err, SL_EFORMAT, "tensor '%s': decode failed", t->name.s);
        if (!rc) rc = sink(ctx, t, r, vals, nr * t->ne[0], err);
    }
done:
    free(raw);
    free(vals);
    return rc;
}

static int sink_stdout(void *ctx, const sl_gguf_tensor *t, uint64_t row0, const float *v,
                       uint64_t n, sl_err *err)
{
    (void)ctx, (void)row0;
    /* The values are already little-endian f32 on every host sluice builds for. */
    if (fwrite(v, sizeof(float), n, stdout) != n)
        return sl_err_errno(err, SL_EIO, errno, "writing tensor '%s' to stdout", t->name.s);
    return 0;
}

struct finite_check {
    uint64_t bad;
    uint64_t first_bad;
};

static int sink_finite(void *ctx, const sl_gguf_tensor *t, uint64_t row0, const float *v,
                       uint64_t n, sl_err *err)
{
    struct finite_check *c = ctx;
    (void)err;
    for (uint64_t i = 0; i < n; i++) {
        if (!isfinite(v[i])) {
            if (!c->bad) c->first_bad = row0 * t->ne[0] + i;
            c->bad++;
        }
    }
    return 0;
}

/* Every tensor the deepseek41 layout of the file's own metadata calls for is there,
 * with its type and dims. Tensors beyond the layout are listed, not refused. */
static int check_layout(const sl_gguf *g, sl_err *err)
{
    sl_model_config cfg;
    int rc = sl_model_config_read(g, &cfg, err);
    if (rc) return rc;
    sl_model_tensor *want = NULL;
    uint64_t n = 0;
    rc = sl_model_layout(&cfg, &want, &n, err);
    if (rc) return rc;
    for (uint64_t i = 0; i < n && !rc; i++) {
        const sl_model_tensor *w = &want[i];
        const sl_gguf_tensor *t = sl_gguf_find_tensor(g, w->name);
        if (!t) {
            rc =
                sl_err_set(err, SL_ENOTFOUND, "%s: tensor '%s' of the deepseek41 layout is missing",
                           g->shards[0].path, w->name);
            break;
        }
        int same = t->type == w->type && t->n_dims == w->n_dims;
        for (uint32_t d = 0; d < SL_GGUF_MAX_DIMS && same; d++) same = t->ne[d] == w->ne[d];
        if (!same)
            rc = sl_err_set(err, SL_EFORMAT,
                            "%s: tensor '%s' is %s [%" PRIu64 ", %" PRIu64 ", %" PRIu64
                            "], the layout wants %s [%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]",
                            g->shards[t->shard].path, w->name, sl_qtype_get(t->type)->name,
                            t->ne[0], t->ne[1], t->ne[2], sl_qtype_get(w->type)->name, w->ne[0],
                            w->ne[1], w->ne[2]);
    }
    if (!rc) {
        printf("layout: all %" PRIu64 " tensors of the deepseek41 layout (%u layers): ok\n", n,
               cfg.n_layer);
        if (g->n_tensors > n)
            printf("layout: %" PRIu64 " further tensors are not used by sluice\n",
                   g->n_tensors - n);
    }
    free(want);
    return rc;
}

static int cmd_verify(const sl_gguf *g, int data, sl_err *err)
{
    printf("headers: %u shard(s), %" PRIu64 " tensors: ok\n", g->n_shards, g->n_tensors);
    int rc = check_layout(g, err);
    if (rc) return rc;
    sl_expert_map *m = NULL;
    rc = sl_expert_map_build(&m, g, SL_SLOT_ALIGN, err);
    if (rc) return rc;
    printf("expert map: %u layers x %u experts: ok\n", m->n_layer, m->n_expert);
    sl_expert_map_free(&m);
    if (!data) return 0;
    uint64_t bad_tensors = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const sl_gguf_tensor *t = &g->tensors[i];
        struct finite_check c = {0};
        rc = decode_tensor(g, t, sink_finite, &c, err);
        if (rc) return rc;
        if (c.bad) {
            fprintf(stderr,
                    "%s: tensor '%s': %" PRIu64 " non-finite values (first at %" PRIu64 ")\n",
                    g->shards[t->shard].path, t->name.s, c.bad, c.first_bad);
            bad_tensors++;
        }
    }
    if (bad_tensors)
        return sl_err_set(err, SL_EFORMAT, "%" PRIu64 " tensor(s) decode to non-finite values",
                          bad_tensors);
    printf("data: every tensor read and decoded to finite values: ok\n");
    return 0;
}

static int cmd_dump(const sl_gguf *g, const char *name, sl_err *err)
{
    const sl_gguf_tensor *t = sl_gguf_find_tensor(g, name);
    if (!t)
        return sl_err_set(err, SL_ENOTFOUND, "%s: no tensor named '%s'", g->shards[0].path, name);
    if (isatty(STDOUT_FILENO))
        return sl_err_set(err, SL_EINVAL, "dump writes binary f32: redirect stdout to a file");
    int rc = decode_tensor(g, t, sink_stdout, NULL, err);
    if (!rc && fflush(stdout) != 0)
        rc = sl_err_errno(err, SL_EIO, errno, "writing tensor '%s' to stdout", name);
    return rc;
}

static int cmd_experts(const sl_gguf *g, sl_err *err)
{
    sl_expert_map *m = NULL;
    int rc = sl_expert_map_build(&m, g, SL_SLOT_ALIGN, err);
    if (rc) return rc;
    static const char *const part_name[SL_EXPERT_N_PART] = {"gate", "up", "down"};
    uint64_t per_expert = m->part_bytes[0] + m->part_bytes[1] + m->part_bytes[2];
    printf("routed experts: %u layers x %u experts, dim %u, inter %u\n", m->n_layer, m->n_expert,
           m->dim, m->inter);
    for (int p = 0; p < SL_EXPERT_N_PART; p++) {
        printf("  %-4s %-5s %12" PRIu64 " bytes\n", part_name[p], sl_qtype_get(m->type[p])->name,
               m->part_bytes[p]);
    }
    printf("  one expert %" PRIu64 " bytes (", per_expert);
    print_bytes(stdout, per_expert);
    printf("), all experts ");
    print_bytes(stdout, per_expert * m->n_layer * m->n_expert);
    printf("\n");
    const sl_slot_layout *l = &m->layout;
    printf("slot layout (align %u): %" PRIu64 " bytes per slot\n", l->align, l->slot_bytes);
    for (int p = 0; p < SL_EXPERT_N_PART; p++)
        printf("  %-4s region at %10" PRIu64 ", capacity %10" PRIu64 "\n", part_name[p],
               l->part_offset[p], l->part_capacity[p]);

    uint64_t *per_shard = calloc(g->n_shards, sizeof *per_shard);
    uint64_t aligned = 0, window_bytes = 0,
             n = (uint64_t)m->n_layer * m->n_expert * SL_EXPERT_N_PART;
    if (!per_shard) {
        sl_expert_map_free(&m);
        return sl_err_set(err, SL_ENOMEM, "out of memory");
    }
    for (uint64_t i = 0; i < n; i++) {
        const sl_expert_slice *s = &m->slices[i];
        per_shard[s->shard]++;
        if (s->offset % l->align == 0) aligned++;
        window_bytes += sl_expert_window_of(s, l->align).bytes;
    }
    printf("slices: %" PRIu64 " (%" PRIu64 " start %u-aligned); aligned windows read %.3f%% more "
           "than the slices\n",
           n, aligned, l->align,
           100.0 * ((double)window_bytes / (double)(per_expert * n / SL_EXPERT_N_PART) - 1.0));
    for (uint32_t s = 0; s < g->n_shards; s++)
        printf("  shard %u: %" PRIu64 " slices\n", s, per_shard[s]);
    uint32_t show_layers = m->n_layer < 2 ? m->n_layer : 2;
    printf("first slices (layer expert part: shard offset bytes):\n");
    for (uint32_t ly = 0; ly < show_layers; ly++)
        for (uint32_t e = 0; e < 2 && e < m->n_expert; e++)
            for (int p = 0; p < SL_EXPERT_N_PART; p++) {
                const sl_expert_slice *s = sl_expert_map_slice(m, ly, e, p);
                printf("  %3u %3u %-4s: %u %14" PRIu64 " %10" PRIu64 "\n", ly, e, part_name[p],
                       s->shard, s->offset, s->bytes);
            }
    free(per_shard);
    sl_expert_map_free(&m);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        usage(stdout);
        return 0;
    }
    if (argc < 3) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1], *path = argv[2];
    int summary = 0, data = 0;
    const char *tensor = NULL;
    if (!strcmp(cmd, "info")) {
        if (argc > 4 || (argc == 4 && strcmp(argv[3], "--summary"))) goto bad_usage;
        summary = argc == 4;
    } else if (!strcmp(cmd, "verify")) {
        if (argc > 4 || (argc == 4 && strcmp(argv[3], "--data"))) goto bad_usage;
        data = argc == 4;
    } else if (!strcmp(cmd, "dump")) {
        if (argc != 4) goto bad_usage;
        tensor = argv[3];
    } else if (!strcmp(cmd, "experts")) {
        if (argc != 3) goto bad_usage;
    } else {
        fprintf(stderr, "sluice-gguf: unknown command '%s'\n", cmd);
        goto bad_usage;
    }

    sl_err err = {0};
    sl_gguf *g = NULL;
    int rc = sl_gguf_open(&g, path, &err);
    if (!rc) {
        if (!strcmp(cmd, "info"))
            rc = cmd_info(g, summary);
        else if (!strcmp(cmd, "verify"))
            rc = cmd_verify(g, data, &err);
        else if (!strcmp(cmd, "dump"))
            rc = cmd_dump(g, tensor, &err);
        else
            rc = cmd_experts(g, &err);
    }
    sl_gguf_close(&g);
    if (rc) {
        fprintf(stderr, "sluice-gguf: %s\n", err.msg);
        return 1;
    }
    return 0;
bad_usage:
    usage(stderr);
    return 2;
}
