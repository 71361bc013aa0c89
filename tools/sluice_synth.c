/* sluice_synth.c - `sluice-synth`: writes a synthetic DeepSeek-V4.1-Flash
 * checkpoint (deepseek41 GGUF layout) from a preset and a seed.
 *
 *   sluice-synth --preset NAME --out DIR [--shards N] [--seed S] [--quiet]
 *
 * Writes DIR/<name>-0000i-of-0000N.gguf. Progress goes to stderr (a bar on a
 * terminal, a line every 10% otherwise), the summary to stdout. Exit codes: 0 ok,
 * 1 the write failed, 2 bad usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "synth.h"

/* ---- options: one struct, defaults in one place, --help from the table ---- */

typedef struct options {
    const char *preset;
    const char *out;
    uint32_t shards;
    uint64_t seed;
    int quiet;
    int help;
} options;

static const options DEFAULTS = {NULL, NULL, 1, 1, 0, 0};

enum opt_id { OPT_PRESET, OPT_OUT, OPT_SHARDS, OPT_SEED, OPT_QUIET, OPT_HELP };

typedef struct opt_spec {
    enum opt_id id;
    const char *name;
    const char *arg; /* NULL: a flag */
    const char *help;
} opt_spec;

static const opt_spec OPTS[] = {
    {OPT_PRESET, "--preset", "NAME", "checkpoint to write: " SL_SYNTH_PRESETS " (required)"},
    {OPT_OUT, "--out", "DIR", "output directory, created if missing (required)"},
    {OPT_SHARDS, "--shards", "N", "number of shard files (default 1)"},
    {OPT_SEED, "--seed", "S", "seed of every weight and engram multiplier (default 1)"},
    {OPT_QUIET, "--quiet", NULL, "no size line, progress or summary"},
    {OPT_HELP, "--help", NULL, "show this help"},
};
#define N_OPTS (sizeof OPTS / sizeof OPTS[0])

static void usage(FILE *f)
{
    fprintf(f, "usage: sluice-synth --preset NAME --out DIR [--shards N] [--seed S] [--quiet]\n"
               "Writes a synthetic DeepSeek-V4.1-Flash checkpoint (GGUF, deepseek41 layout)\n"
               "as DIR/<name>-0000i-of-0000N.gguf.\n\noptions:\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        char left[40];
        snprintf(left, sizeof left, "%s%s%s", OPTS[i].name, OPTS[i].arg ? " " : "",
                 OPTS[i].arg ? OPTS[i].arg : "");
        fprintf(f, "  %-18s %s\n", left, OPTS[i].help);
    }
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+') return -1;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max) return -1;
    *out = v;
    return 0;
}

/* Fills o from argv; returns 0, or 2 after printing one line for a usage error. */
static int parse_args(int argc, char **argv, options *o)
{
    *o = DEFAULTS;
    for (int i = 1; i < argc; i++) {
        const opt_spec *spec = NULL;
        for (size_t k = 0; k < N_OPTS; k++)
            if (!strcmp(argv[i], OPTS[k].name)) spec = &OPTS[k];
        if (!spec && !strcmp(argv[i], "-h")) spec = &OPTS[N_OPTS - 1];
        if (!spec) {
            fprintf(stderr, "sluice-synth: unknown option '%s' (see --help)\n", argv[i]);
            return 2;
        }
        const char *val = NULL;
        if (spec->arg) {
            if (i + 1 >= argc) {
                fprintf(stderr, "sluice-synth: %s needs a value (%s)\n", spec->name, spec->arg);
                return 2;
            }
            val = argv[++i];
        }
        uint64_t v = 0;
        switch (spec->id) {
        case OPT_PRESET:
            o->preset = val;
            break;
        case OPT_OUT:
            o->out = val;
            break;
        case OPT_SHARDS:
            if (parse_u64(val, SL_GGUF_MAX_SHARDS, &v) || v == 0) {
                fprintf(stderr, "sluice-synth: --shards '%s' is not a number in 1..%d\n", val,
                        SL_GGUF_MAX_SHARDS);
                return 2;
            }
            o->shards = (uint32_t)v;
            break;
        case OPT_SEED:
            if (parse_u64(val, UINT64_MAX, &v)) {
                fprintf(stderr, "sluice-synth: --seed '%s' is not an unsigned 64-bit number\n",
                        val);
                return 2;
            }
            o->seed = v;
            break;
        case OPT_QUIET:
            o->quiet = 1;
            break;
        case OPT_HELP:
            o->help = 1;
            break;
        }
    }
    if (o->help) return 0;
    if (!o->preset || !o->out) {
        fprintf(stderr, "sluice-synth: %s is required (see --help)\n",
                !o->preset ? "--preset NAME" : "--out DIR");
        return 2;
    }
    return 0;
}

/* ---- progress ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct bar {
    int tty;
    double t0, last;
    int last_decile;
    int drawn;
} bar;

static void on_progress(void *ctx, const sl_synth_progress *p)
{
    bar *b = ctx;
    double t = now_s(), el = t - b->t0;
    int finished = p->done_bytes >= p->total_bytes;
    double frac = p->total_bytes ? (double)p->done_bytes / (double)p->total_bytes : 1.0;
    double mbs = el > 0 ? (double)p->done_bytes / el / 1e6 : 0.0;
    if (b->tty) {
        if (!finished && t - b->last < 0.25) return;
        b->last = t;
        double eta = frac > 0 && !finished ? el / frac - el : 0.0;
        char cells[31];
        int fill = (int)(frac * 30);
        for (int i = 0; i < 30; i++) cells[i] = i < fill ? '#' : '.';
        cells[30] = 0;
        fprintf(stderr, "\r[%s] %5.1f%%  %.2f/%.2f GB  %6.0f MB/s  ETA %d:%02d  shard %u/%u ",
                cells, frac * 100, (double)p->done_bytes / 1e9, (double)p->total_bytes / 1e9, mbs,
                (int)eta / 60, (int)eta % 60, p->shard + 1, p->n_shards);
        b->drawn = 1;
        if (finished) fputc('\n', stderr), b->drawn = 0;
        fflush(stderr);
        return;
    }
    int decile = (int)(frac * 10);
    if (decile <= b->last_decile || p->done_bytes == 0) return;
    b->last_decile = decile;
    fprintf(stderr, "sluice-synth: %3d%%  %.2f/%.2f GB  %.0f MB/s\n", decile * 10,
            (double)p->done_bytes / 1e9, (double)p->total_bytes / 1e9, mbs);
}

int main(int argc, char **argv)
{
    options o;
    int rc = parse_args(argc, argv, &o);
    if (rc) return rc;
    if (o.help) {
        usage(stdout);
        return 0;
    }
    sl_err err = {0, ""};
    sl_model_config cfg;
    if (sl_model_config_preset(&cfg, o.preset, &err)) {
        fprintf(stderr, "sluice-synth: %s\n", err.msg);
        return 2;
    }
    sl_model_tensor *layout = NULL;
    uint64_t n_tensors = 0;
    if (sl_model_layout(&cfg, &layout, &n_tensors, &err)) {
        fprintf(stderr, "sluice-synth: %s\n", err.msg);
        return 1;
    }
    free(layout);
    if (o.shards > n_tensors) {
        fprintf(stderr,
                "sluice-synth: --shards %u is more than the %" PRIu64 " tensors of preset %s\n",
                o.shards, n_tensors, o.preset);
        return 2;
    }
    if (!o.quiet)
        fprintf(stderr,
                "sluice-synth: %s: %" PRIu64 " tensors, %.3f GB of tensor data, %u shard%s, "
                "seed %" PRIu64 " -> %s\n",
                cfg.name, n_tensors, (double)sl_model_tensor_bytes(&cfg) / 1e9, o.shards,
                o.shards == 1 ? "" : "s", o.seed, o.out);
    bar b = {isatty(STDERR_FILENO), now_s(), 0.0, 0, 0};
    sl_synth_stats st;
    double t0 = now_s();
    rc = sl_synth_write(&cfg, o.out, o.shards, o.seed, o.quiet ? NULL : on_progress, &b, &st, &err);
    double el = now_s() - t0;
    if (b.drawn) fputc('\n', stderr);
    if (rc) {
        fprintf(stderr, "sluice-synth: %s\n", err.msg);
        return 1;
    }
    if (!o.quiet)
        printf("sluice-synth: wrote %u file%s, %" PRIu64 " tensors, %.3f GB in %.2f s (%.0f MB/s) "
               "to %s/%s-*-of-%05u.gguf\n",
               st.n_files, st.n_files == 1 ? "" : "s", st.n_tensors, (double)st.total_bytes / 1e9,
               el, el > 0 ? (double)st.total_bytes / el / 1e6 : 0.0, o.out, cfg.name, st.n_files);
    return 0;
}
