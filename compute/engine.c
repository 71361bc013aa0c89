/* engine.c - sluice-compute's state and decode loop (MoE-only layer body).
 *
 * Ownership: the engine owns the opened checkpoint (for resident weights and token
 * embeddings only; routed experts come from the fetcher's arena), the resident
 * weights of every layer, the fetch client and the output file. Buffers are sized
 * at open; a step allocates nothing beyond what the CPU reference does for itself.
 */
#include "compute.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "affinity.h"
#include "arena.h"
#include "client.h"
#include "expert_map.h"
#include "gguf.h"
#include "moe_emu.h"
#include "moe_ref.h"
#include "moe_types.h"
#include "opts.h"
#include "policy.h"
#include "proto.h"
#include "quant.h"
#include "router.h"
#include "synth.h"
#include "synth_route.h"
#include "t0cache.h"
#include "trace.h"

#ifdef SL_HAVE_CUDA
#include "gpu.h"
#endif

#define TRACE_CAPACITY (1u << 18)
#define NO_SLOT        UINT32_MAX

typedef struct layer_w {
    float *ffn_norm;     /* [dim] f32 */
    uint16_t *router;    /* [n_expert][dim] bf16 */
    float *bias;         /* [n_expert] f32 */
    void *shared[3];     /* shared expert gate/up/down raw blocks */
    sl_moe_layer_w moe;  /* views of the above */
    void *router_dev;    /* GPU: [n_expert][dim] bf16 */
    float *bias_dev;     /* GPU: [n_expert] f32 */
    float *ffn_norm_dev; /* GPU: [dim] f32 */
    void *shared_dev[3]; /* GPU: the shared expert's blocks */
    sl_moe_expert_w shared_w_dev;
    int norm_in_router; /* GPU: the router computes x (sl_gpu_route_start_norm) */
} layer_w;

/* The device tier: whole experts copied from T1 into device slots, with their own
 * eviction policy and admission (t0cache.h; keys layer * n_expert + expert). */
typedef struct t0_tier {
    uint32_t n_slot;
    uint8_t *base; /* device memory, n_slot * slot_bytes */
    uint64_t slot_bytes;
    uint64_t down_off; /* a slot: T1's gate and up regions as they are, then at down_off the
                        * down tiled (gpu.h: sl_gpu_upload_down) */
    sl_t0cache cache;
#ifdef SL_HAVE_CUDA
    /* The same table on the device, for routing there (gpu.h): an entry per (layer,
     * expert), changed in stream order by sl_gpu_t0_set; changes wait in `set` until
     * the layer's launches are queued. */
    sl_gpu_t0e *table_dev;
    uint32_t set_index[16];
    sl_gpu_t0e set_value[16];
    uint32_t n_set;
#endif
} t0_tier;

/* A span of the GPU's own timeline, between two marks (gpu.h), while tracing. */
typedef struct gpu_span {
    const char *name;
    int32_t layer, expert;
    uint64_t bytes;
    uint32_t from, to; /* mark ids; 0 = not taken */
} gpu_span;
#define GPU_SPANS 1024

/* What the start-up memory plan prints (bytes). */
typedef struct plan {
    uint64_t gpu_total, gpu_free; /* device memory, and free after the resident weights */
    uint64_t resident;            /* routers and shared experts of every layer */
    const char *t0_why;           /* how the device tier was sized */
} plan;

/* The parts of a layer, timed separately so that the summary shows where the fixed
 * per-layer cost goes. */
enum {
    SUB_START,
    SUB_NORM,
    SUB_SHARED,
    SUB_ROUTER,
    SUB_SELECT,
    SUB_GATHER,
    SUB_FINISH,
    SUB_RESIDUAL,
    N_SUB
};
static const char *const sub_names[N_SUB] = {"step start (embedding, upload)",
                                             "residual + ffn_norm",
                                             "queue routing + T0 gate/up",
                                             "wait for the GPU's picks",
                                             "-",
                                             "gather + launches",
                                             "queue down + sum",
                                             "step end (residual, h download)"};
/* The same parts when the CPU computes the layer (no queueing: the work itself). */
static const char *const sub_names_cpu[N_SUB] = {"step start (embedding)",
                                                 "residual + ffn_norm",
                                                 "-",
                                                 "router GEMV",
                                                 "top-k",
                                                 "gather (waits for reads)",
                                                 "experts",
                                                 "step end (residual)"};

typedef struct stage_times {
    uint64_t route_ns, wait_ns, compute_ns;
    uint64_t sub_ns[N_SUB];
} stage_times;

struct sl_compute {
    sl_compute_options opt;
    char endpoint[512];
    sl_gguf *gguf;
    sl_model_config cfg;
    sl_expert_map *map;
    sl_moe_shape shape;
    layer_w *layers; /* [n_layer] */
    const sl_gguf_tensor *embd;
    uint8_t *embd_row;        /* one row of token_embd, raw */
    float *f32;               /* [dim] scratch */
    float *logits;            /* [n_expert] router logits */
    uint16_t *h, *x, *y;      /* [dim] bf16: residual stream, normed input, MoE output */
    sl_moe_expert_w *experts; /* [n_expert] views into pinned slots */
    sl_fetch_client *client;
    int backend;                 /* the backend in use (never AUTO) */
    sl_moe_expert_w by_rank[64]; /* the picked experts' weights, by rank */
#ifdef SL_HAVE_CUDA
    sl_gpu_ctx *gpu;
    uint16_t *h_dev, *x_dev, *y_dev; /* [dim] bf16: residual stream, normed input, MoE out */
    uint16_t *h2_dev; /* the residual stream's other buffer: a router that adds the residual
                         writes it there (its CTAs all read h_dev), then the two swap */
    void *embd_dev;   /* token_embd in device memory when the GPU decodes it (Q2_K), else NULL */
    sl_arena *registered; /* the arena mapping registered with CUDA */
    uint8_t *arena_dev;   /* its device address */
    t0_tier t0;
    plan plan;
    uint8_t launched[64]; /* ranks of this layer whose experts are queued (hits first) */
    uint32_t started;     /* ranks whose gate/up the device queued from T0 (its routing) */
    uint32_t mark_layer, mark_routed, mark_launch; /* this layer's marks (--trace) */
    uint64_t *mark_ns;                             /* [SL_GPU_MARKS] their times (--trace) */
#endif
    gpu_span gspan[GPU_SPANS]; /* this step's GPU spans, by timeline marks (--trace) */
    uint32_t n_gspan;
    sl_fetch_pin held[64]; /* the pins of the layer whose GPU work may still run */
    uint32_t n_held;
    uint64_t hit_t0;
    sl_synth_route synth; /* --routing uniform | zipf: the picks' tables */
    uint64_t step;        /* the step being run */
    uint32_t pass;        /* the pass over the layers in it (--layer-passes) */
    /* prefetch: predicted experts of the next layer, and how the guesses fared */
    uint32_t predicted[64];
    uint32_t n_predicted;
    uint64_t pf_sent, pf_useful, pf_misses_covered, misses_total;
    sl_trace *trace;
    FILE *out;
    /* counters */
    uint64_t steps_done;
    uint64_t hit_shm, hit_fetcher, from_disk;
    uint64_t t1_in_place; /* of those, read in place although there is a device tier */
    uint64_t read_us;
    stage_times t;
    uint64_t run_ns;
};

/* ---------------------------------------------------------------- options */

void sl_compute_options_default(sl_compute_options *o)
{
    memset(o, 0, sizeof *o);
    o->steps = 16;
    o->passes = 1;
    o->seed = 1;
    o->timeout_ms = 60000;
    o->backend = SL_BACKEND_AUTO;
    o->cpu = SL_CPU_ANY;
    o->t0_admit = SL_T0_ADMIT_FREQ; /* measured: bench/results/2026-12-01-s6-compute-e2e.md */
}

enum opt_id {
    OPT_MODEL,
    OPT_ENDPOINT,
    OPT_STEPS,
    OPT_SEED,
    OPT_OUT,
    OPT_TRACE,
    OPT_TIMEOUT,
    OPT_BACKEND,
    OPT_T0,
    OPT_T0_BYTES,
    OPT_T0_PRELOAD,
    OPT_T0_ADMIT,
    OPT_ZERO_COPY,
    OPT_NORM_KERNEL,
    OPT_WARMUP,
    OPT_PASSES,
    OPT_CEILINGS,
    OPT_PREFETCH,
    OPT_ROUTING,
    OPT_CPU,
    OPT_QUIET,
    OPT_HELP
};

static const sl_opt opt_table[] = {
    {OPT_MODEL, "-m", "--model", "FILE", "checkpoint: any shard of it (required)"},
    {OPT_ENDPOINT, NULL, "--endpoint", "URL", "the fetcher's endpoint (default: the model's)"},
    {OPT_STEPS, "-n", "--steps", "N", "decode steps (default 16)"},
    {OPT_SEED, NULL, "--seed", "N", "seed of the tokens fed to the steps (default 1)"},
    {OPT_OUT, "-o", "--out", "FILE", "write every step's output (bf16) to FILE"},
    {OPT_TRACE, NULL, "--trace", "FILE", "write this process's spans as Chrome trace JSON"},
    {OPT_TIMEOUT, NULL, "--timeout", "MS", "longest wait for one layer's experts (default 60000)"},
    {OPT_BACKEND, NULL, "--backend", "NAME",
     "gpu, cpu (the GPU's arithmetic on the CPU) or ref (f32 reference); default: gpu if present"},
    {OPT_T0_BYTES, NULL, "--t0", "SIZE",
     "device expert tier budget, e.g. 40G (default: free GPU memory less a reserve; none on a "
     "GPU sharing host memory)"},
    {OPT_T0, NULL, "--t0-slots", "N",
     "device expert tier in slots; 0 = read the host arena in place"},
    {OPT_T0_PRELOAD, NULL, "--t0-preload", NULL,
     "fill the device tier with every expert it can hold before the first step"},
    {OPT_T0_ADMIT, NULL, "--t0-admit", "HOW",
     "freq (default): a miss is copied into the device tier only when it was asked for more "
     "often lately than the expert it would evict, the others are read in place; always: "
     "every miss is copied in"},
    {OPT_ZERO_COPY, NULL, "--zero-copy", NULL, "no device tier: kernels read the host arena"},
    {OPT_NORM_KERNEL, NULL, "--norm-kernel", NULL,
     "GPU: the residual and the norm as a kernel of their own, not inside the router "
     "(comparisons)"},
    {OPT_WARMUP, NULL, "--warmup", "N", "steps run before counters and clocks start (default 0)"},
    {OPT_PASSES, NULL, "--layer-passes", "N",
     "run the checkpoint's layers N times a step, as a model N times as deep (benchmarks; "
     "default 1)"},
    {OPT_CEILINGS, NULL, "--ceilings", "LIST",
     "hbm=G,copy=G,zc=G,disk=G in GB/s (bench-ceilings prints them): the summary then gives "
     "each step's byte floor"},
    {OPT_ROUTING, NULL, "--routing", "MODE",
     "router (default), uniform, or zipf[:S]: synthetic picks for benchmarks"},
    {OPT_PREFETCH, NULL, "--prefetch", NULL,
     "predict the next layer's experts with its router on this layer's input and prefetch them"},
    {OPT_CPU, NULL, "--cpu", "N",
     "pin the decode thread and its ZeroMQ I/O thread to CPU N (lower message latency)"},
    {OPT_QUIET, "-q", "--quiet", NULL, "no banner and no summary"},
    {OPT_HELP, "-h", "--help", NULL, "this help"},
};

/* The memory paths a step's bytes take, in --ceilings order. */
enum { CEIL_HBM, CEIL_COPY, CEIL_ZC, CEIL_DISK };
static const char *const ceiling_names[4] = {"hbm", "copy", "zc", "disk"};

/* "hbm=4500,copy=55,zc=51,disk=2.1" (GB/s; any subset, any order). */
static int parse_ceilings(const char *v, double *gbs, sl_err *err)
{
    const char *p = v;
    while (*p) {
        int k = 0;
        while (k < 4 && strncmp(p, ceiling_names[k], strlen(ceiling_names[k]))) k++;
        const char *q = k < 4 ? p + strlen(ceiling_names[k]) : p;
        char *end = NULL;
        double g = k < 4 && *q == '=' ? strtod(q + 1, &end) : -1.0;
        if (k == 4 || !end || end == q + 1 || !(g > 0.0) || g > 1e6 || (*end && *end != ','))
            return sl_err_set(err, SL_EINVAL,
                              "--ceilings %s: expected NAME=GB/s[,...] with NAME hbm, copy, zc "
                              "or disk",
                              v);
        gbs[k] = g;
        p = *end ? end + 1 : end;
    }
    return 0;
}

int sl_compute_parse_args(sl_compute_options *o, int argc, char **argv, FILE *out, sl_err *err)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        const sl_opt *d =
            sl_opt_next(opt_table, sizeof opt_table / sizeof opt_table[0], argc, argv, &i, &v, err);
        if (!d) return SL_EINVAL;
        uint64_t n = 0;
        int rc = 0;
        switch (d->id) {
        case OPT_MODEL:
            o->model = v;
            break;
        case OPT_ENDPOINT:
            o->endpoint = v;
            break;
        case OPT_STEPS:
            rc = sl_opt_u64(a, v, 1, 1u << 30, &n, err);
            o->steps = (uint32_t)n;
            break;
        case OPT_SEED:
            rc = sl_opt_u64(a, v, 0, UINT64_MAX, &o->seed, err);
            break;
        case OPT_OUT:
            o->out_path = v;
            break;
        case OPT_TRACE:
            o->trace_path = v;
            break;
        case OPT_TIMEOUT:
            rc = sl_opt_u64(a, v, 1, 86400000, &n, err);
            o->timeout_ms = (uint32_t)n;
            break;
        case OPT_BACKEND:
            if (!strcmp(v, "gpu"))
                o->backend = SL_BACKEND_GPU;
            else if (!strcmp(v, "cpu"))
                o->backend = SL_BACKEND_CPU;
            else if (!strcmp(v, "ref"))
                o->backend = SL_BACKEND_REF;
            else
                return sl_err_set(err, SL_EINVAL, "--backend %s: expected gpu, cpu or ref", v);
            break;
        case OPT_T0:
            rc = sl_opt_u64(a, v, 0, 1u << 24, &n, err);
            o->t0_slots = (uint32_t)n;
            o->t0_bytes = 0;
            o->t0_given = 1;
            break;
        case OPT_T0_BYTES:
            rc = sl_parse_size(v, &o->t0_bytes, err);
            o->t0_slots = 0;
            o->t0_given = 1;
            break;
        case OPT_T0_PRELOAD:
            o->t0_preload = 1;
            break;
        case OPT_T0_ADMIT:
            rc = sl_t0cache_admit_parse(v, &o->t0_admit, err);
            break;
        case OPT_WARMUP:
            rc = sl_opt_u64(a, v, 0, 1u << 30, &n, err);
            o->warmup = (uint32_t)n;
            break;
        case OPT_PASSES:
            rc = sl_opt_u64(a, v, 1, 1000, &n, err);
            o->passes = (uint32_t)n;
            break;
        case OPT_CEILINGS:
            rc = parse_ceilings(v, o->ceiling_gbs, err);
            break;
        case OPT_ZERO_COPY:
            o->zero_copy = 1;
            o->t0_given = 1;
            break;
        case OPT_NORM_KERNEL:
            o->norm_kernel = 1;
            break;
        case OPT_ROUTING:
            if (!strcmp(v, "router")) {
                o->routing = SL_ROUTING_ROUTER;
            } else if (!strcmp(v, "uniform")) {
                o->routing = SL_ROUTING_UNIFORM;
            } else if (!strncmp(v, "zipf", 4) && (v[4] == '\0' || v[4] == ':')) {
                o->routing = SL_ROUTING_ZIPF;
                o->zipf_s = 1.0f;
                if (v[4] == ':') {
                    char *end = NULL;
                    o->zipf_s = strtof(v + 5, &end);
                    if (end == v + 5 || *end || !(o->zipf_s > 0.0f) || o->zipf_s > 8.0f)
                        return sl_err_set(err, SL_EINVAL, "--routing %s: S must be in (0, 8]", v);
                }
            } else {
                return sl_err_set(err, SL_EINVAL,
                                  "--routing %s: expected router, uniform or zipf[:S]", v);
            }
            break;
        case OPT_PREFETCH:
            o->prefetch = 1;
            break;
        case OPT_CPU:
            rc = sl_opt_u64(a, v, 0, 65535, &n, err);
            if (!rc) rc = sl_affinity_check((int)n, err);
            o->cpu = (int)n;
            break;
        case OPT_QUIET:
            o->quiet = 1;
            break;
        case OPT_HELP:
            sl_opt_help(out,
                        "usage: sluice-compute -m FIRST_SHARD [options]\n"
                        "Runs decode steps of the MoE layers, experts served by sluice-fetcher.\n",
                        opt_table, sizeof opt_table / sizeof opt_table[0]);
            return 1;
        }
        if (rc) return rc;
    }
    if (!o->model)
        return sl_err_set(err, SL_EINVAL, "no model given: use -m FIRST_SHARD (see --help)");
    return 0;
}

/* ---------------------------------------------------------------- memory plan */

uint32_t sl_compute_t0_slots(const sl_compute_options *o, uint64_t free_bytes, uint64_t total_bytes,
                             int shares_host_memory, uint64_t slot_bytes, uint64_t n_experts,
                             const char **why)
{
    uint64_t want;
    if (o->zero_copy) {
        want = 0;
        *why = "--zero-copy";
    } else if (o->t0_given) {
        want = o->t0_bytes ? o->t0_bytes / slot_bytes : o->t0_slots;
        *why = o->t0_bytes ? "--t0" : "--t0-slots";
    } else if (shares_host_memory) {
        want = 0;
        *why = "the GPU shares host memory: kernels read the arena in place";
    } else {
        uint64_t reserve =
            SL_COMPUTE_T0_RESERVE > total_bytes / 20 ? SL_COMPUTE_T0_RESERVE : total_bytes / 20;
        want = free_bytes > reserve ? (free_bytes - reserve) / slot_bytes : 0;
        *why = "auto: free device memory less a reserve";
    }
    if (want > n_experts) want = n_experts;
    return want > UINT32_MAX ? UINT32_MAX : (uint32_t)want;
}

/* ---------------------------------------------------------------- loading */

/* Reads a whole tensor (checked against the wanted type and element count). */
static int load_tensor(sl_compute *c, uint32_t kind, uint32_t layer, int want_type,
                       uint64_t want_elems, void **out, sl_err *err)
{
    char name[SL_MODEL_TENSOR_NAME_MAX];
    sl_model_tensor_name(name, sizeof name, kind, layer);
    const sl_gguf_tensor *t = sl_gguf_find_tensor(c->gguf, name);
    if (!t) return sl_err_set(err, SL_ENOTFOUND, "%s: tensor '%s' is missing", c->opt.model, name);
    uint64_t elems = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    if ((want_type >= 0 && t->type != (uint32_t)want_type) || elems != want_elems)
        return sl_err_set(
            err, SL_EFORMAT,
            "%s: tensor '%s' is %s with %" PRIu64 " values, expected %s with %" PRIu64,
            c->gguf->shards[t->shard].path, name, sl_qtype_get(t->type)->name, elems,
            want_type >= 0 ? sl_qtype_get((uint32_t)want_type)->name : "any type", want_elems);
    uint8_t *buf = malloc(t->n_bytes);
    if (!buf) return sl_err_set(err, SL_ENOMEM, "out of memory for tensor '%s'", name);
    const sl_gguf_shard *sh = &c->gguf->shards[t->shard];
    for (uint64_t got = 0; got < t->n_bytes;) {
        ssize_t n = pread(sh->fd, buf + got, t->n_bytes - got, (off_t)(t->offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            int e = n < 0 ? errno : 0;
            free(buf);
            if (!e)
                return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' ends early", sh->path, name);
            return sl_err_errno(err, SL_EIO, e, "pread(%s, off %" PRIu64 ", len %" PRIu64 ")",
                                sh->path, t->offset + got, t->n_bytes - got);
        }
        got += (uint64_t)n;
    }
    *out = buf;
    return 0;
}

static int load_layers(sl_compute *c, sl_err *err)
{
    const sl_model_config *m = &c->cfg;
    c->layers = calloc(m->n_layer, sizeof *c->layers);
    if (!c->layers) return sl_err_set(err, SL_ENOMEM, "out of memory");
    static const uint32_t sh_kind[3] = {SL_MODEL_TENSOR_FFN_GATE_SHEXP,
                                        SL_MODEL_TENSOR_FFN_UP_SHEXP,
                                        SL_MODEL_TENSOR_FFN_DOWN_SHEXP};
    for (uint32_t l = 0; l < m->n_layer; l++) {
        layer_w *w = &c->layers[l];
        int rc = load_tensor(c, SL_MODEL_TENSOR_FFN_NORM, l, SL_QTYPE_F32, m->dim,
                             (void **)&w->ffn_norm, err);
        if (!rc)
            rc = load_tensor(c, SL_MODEL_TENSOR_FFN_GATE_INP, l, SL_QTYPE_BF16,
                             (uint64_t)m->dim * m->n_expert, (void **)&w->router, err);
        if (!rc)
            rc = load_tensor(c, SL_MODEL_TENSOR_EXP_PROBS_B, l, SL_QTYPE_F32, m->n_expert,
                             (void **)&w->bias, err);
        for (int p = 0; p < 3 && !rc; p++)
            rc = load_tensor(c, sh_kind[p], l, -1, (uint64_t)m->dim * m->moe_inter, &w->shared[p],
                             err);
        if (rc) return rc;
        w->moe.router = w->router;
        w->moe.bias = w->bias;
        w->moe.shared.gate = w->shared[0];
        w->moe.shared.up = w->shared[1];
        w->moe.shared.down = w->shared[2];
    }
    /* The shared expert's types, as stored (Q2_K/Q3_K, or BF16). */
    char name[SL_MODEL_TENSOR_NAME_MAX];
    uint32_t *sh_type[3] = {&c->shape.sh_gate_type, &c->shape.sh_up_type, &c->shape.sh_down_type};
    for (int p = 0; p < 3; p++) {
        sl_model_tensor_name(name, sizeof name, sh_kind[p], 0);
        *sh_type[p] = sl_gguf_find_tensor(c->gguf, name)->type;
    }
    return 0;
}

/* ---------------------------------------------------------------- GPU */

#ifdef SL_HAVE_CUDA
/* The fetch client is about to unmap an arena (a fetcher restart): drop its CUDA
 * registration first. */
static void unregister_arena(void *ctx, sl_arena *old)
{
    sl_compute *c = ctx;
    if (c->registered != old) return;
    /* Hits-first work queued from the old mapping may still be reading it. */
    if (c->gpu) sl_gpu_sync(c->gpu, NULL);
    sl_gpu_host_unregister(old->base, NULL);
    c->registered = NULL;
    c->arena_dev = NULL;
}

/* The current arena mapping, registered (mapped + portable) so kernels can read it. */
static int ensure_registered(sl_compute *c, sl_err *err)
{
    sl_arena *a = sl_fetch_client_arena(c->client);
    if (c->registered == a) return 0;
    void *dev = NULL;
    int rc = sl_gpu_host_register(a->base, a->total_bytes, &dev, err);
    if (rc) return rc;
    c->registered = a;
    c->arena_dev = dev;
    return 0;
}

static uint64_t blocks_bytes(uint32_t type, uint32_t cols, uint32_t rows)
{
    return sl_qtype_row_bytes(type, cols) * rows;
}

static int upload_new(sl_compute *c, const void *host, uint64_t bytes, void **dev, sl_err *err)
{
    int rc = sl_gpu_malloc(c->gpu, dev, bytes, err);
    if (!rc) rc = sl_gpu_upload(c->gpu, *dev, host, bytes, err);
    return rc;
}

/* Opens the GPU context, uploads the resident weights and sizes the device tier. */
static int gpu_open(sl_compute *c, uint64_t *resident, sl_err *err)
{
    const sl_model_config *m = &c->cfg;
    int rc = sl_gpu_open(&c->gpu, 0, &c->shape, err);
    if (!rc) rc = sl_gpu_malloc(c->gpu, (void **)&c->x_dev, m->dim * sizeof(uint16_t), err);
    if (!rc) rc = sl_gpu_malloc(c->gpu, (void **)&c->y_dev, m->dim * sizeof(uint16_t), err);
    if (!rc) rc = sl_gpu_malloc(c->gpu, (void **)&c->h_dev, m->dim * sizeof(uint16_t), err);
    if (!rc) rc = sl_gpu_malloc(c->gpu, (void **)&c->h2_dev, m->dim * sizeof(uint16_t), err);
    const uint64_t sh_bytes[3] = {blocks_bytes(c->shape.sh_gate_type, m->dim, m->moe_inter),
                                  blocks_bytes(c->shape.sh_up_type, m->dim, m->moe_inter),
                                  blocks_bytes(c->shape.sh_down_type, m->moe_inter, m->dim)};
    *resident = 0;
    /* a Q3_K down goes to the device tiled (gpu.h) */
    const int sh_pk = c->shape.sh_down_type == SL_QTYPE_Q3_K;
    const uint64_t sh_dev[3] = {sh_bytes[0], sh_bytes[1],
                                sh_pk ? sl_gpu_packed_bytes(sh_bytes[2]) : sh_bytes[2]};
    for (uint32_t l = 0; l < m->n_layer && !rc; l++) {
        layer_w *w = &c->layers[l];
        uint64_t rb = (uint64_t)m->n_expert * m->dim * sizeof(uint16_t);
        rc = upload_new(c, w->router, rb, &w->router_dev, err);
        if (!rc)
            rc = upload_new(c, w->ffn_norm, m->dim * sizeof(float), (void **)&w->ffn_norm_dev, err);
        if (!rc)
            rc = upload_new(c, w->bias, m->n_expert * sizeof(float), (void **)&w->bias_dev, err);
        for (int p = 0; p < 2 && !rc; p++)
            rc = upload_new(c, w->shared[p], sh_bytes[p], &w->shared_dev[p], err);
        if (!rc && sh_pk) {
            rc = sl_gpu_malloc(c->gpu, &w->shared_dev[2], sh_dev[2], err);
            if (!rc)
                rc = sl_gpu_upload_down(c->gpu, w->shared_dev[2], w->shared[2], sh_bytes[2], err);
        } else if (!rc) {
            rc = upload_new(c, w->shared[2], sh_bytes[2], &w->shared_dev[2], err);
        }
        *resident += rb + m->dim * sizeof(float) + m->n_expert * sizeof(float) + sh_dev[0] +
                     sh_dev[1] + sh_dev[2]; /* router, ffn_norm, bias, shared expert */
        w->shared_w_dev = (sl_moe_expert_w){w->shared_dev[0], w->shared_dev[1], w->shared_dev[2]};
        /* the router can compute x only when nothing reads x before it (a shared expert
         * on the side stream would) */
        w->norm_in_router =
            !rc && !c->opt.norm_kernel && sl_gpu_moe_shared_merges(c->gpu, &w->shared_w_dev);
    }
    /* The embedding table too, when the GPU can decode its rows: a step then starts
     * with one small kernel instead of a pread, a host decode and a waited upload. */
    if (!rc && c->embd->type == SL_QTYPE_Q2_K && m->dim % 256 == 0 && c->embd->ne[1] >= m->vocab) {
        void *tab = NULL;
        sl_err why = {0};
        int lr = load_tensor(c, SL_MODEL_TENSOR_TOKEN_EMBD, 0, SL_QTYPE_Q2_K,
                             c->embd->ne[0] * c->embd->ne[1], &tab, &why);
        if (!lr) lr = upload_new(c, tab, c->embd->n_bytes, &c->embd_dev, &why);
        free(tab);
        if (!lr) {
            *resident += c->embd->n_bytes;
        } else { /* not fatal: the host path reads the rows instead */
            sl_gpu_free(c->gpu, c->embd_dev);
            c->embd_dev = NULL;
            fprintf(stderr, "sluice-compute: token_embd stays on the host: %s\n", why.msg);
        }
    }
    if (rc) return rc;
    /* The device tier: by flag, or what free memory allows (after the resident
     * weights, less a reserve for the runtime and other jobs), never more than every
     * expert; none where the GPU reads host memory as fast as its own. */
    plan *pl = &c->plan;
    sl_gpu_mem mem;
    rc = sl_gpu_mem_info(0, &mem, err);
    if (rc) return rc;
    pl->gpu_total = mem.total_bytes;
    pl->gpu_free = mem.free_bytes;
    pl->resident = *resident;
    t0_tier *t = &c->t0;
    uint64_t n_ent = (uint64_t)m->n_layer * m->n_expert;
    /* a T0 slot: T1's slot with its down region tiled (a little longer) */
    const sl_slot_layout *lay = &c->map->layout;
    t->down_off = lay->part_offset[SL_EXPERT_DOWN];
    t->slot_bytes = t->down_off + sl_gpu_packed_bytes(c->map->part_bytes[SL_EXPERT_DOWN]);
    t->slot_bytes = (t->slot_bytes + lay->align - 1) / lay->align * lay->align;
    if (t->slot_bytes < lay->slot_bytes) t->slot_bytes = lay->slot_bytes;
    t->n_slot = sl_compute_t0_slots(&c->opt, mem.free_bytes, mem.total_bytes,
                                    mem.shares_host_memory, t->slot_bytes, n_ent, &pl->t0_why);
    if (!t->n_slot) return 0;
    rc = sl_gpu_malloc(c->gpu, (void **)&t->base, t->n_slot * t->slot_bytes, err);
    if (rc) {
        sl_err_prefix(err, "device tier of %u slots (%.1f GiB; see --t0)", t->n_slot,
                      (double)t->n_slot * (double)t->slot_bytes / (1ull << 30));
        return rc;
    }
    rc = sl_t0cache_init(&t->cache, t->n_slot, (uint32_t)n_ent, c->opt.t0_admit, 1, err);
    if (rc) return rc;
    sl_gpu_t0e *zero = calloc(n_ent, sizeof *zero);
    if (!zero) return sl_err_set(err, SL_ENOMEM, "out of memory");
    rc = upload_new(c, zero, n_ent * sizeof *zero, (void **)&t->table_dev, err);
    free(zero);
    return rc;
}

static void gpu_close(sl_compute *c)
{
    if (!c->gpu) return;
    sl_gpu_sync(c->gpu, NULL);
    if (c->registered) {
        sl_gpu_host_unregister(c->registered->base, NULL);
        c->registered = NULL;
    }
    for (uint32_t l = 0; c->layers && l < c->cfg.n_layer; l++) {
        sl_gpu_free(c->gpu, c->layers[l].router_dev);
        sl_gpu_free(c->gpu, c->layers[l].bias_dev);
        sl_gpu_free(c->gpu, c->layers[l].ffn_norm_dev);
        for (int p = 0; p < 3; p++) sl_gpu_free(c->gpu, c->layers[l].shared_dev[p]);
    }
    sl_gpu_free(c->gpu, c->x_dev);
    sl_gpu_free(c->gpu, c->y_dev);
    sl_gpu_free(c->gpu, c->h_dev);
    sl_gpu_free(c->gpu, c->h2_dev);
    sl_gpu_free(c->gpu, c->embd_dev);
    sl_gpu_free(c->gpu, c->t0.base);
    sl_gpu_free(c->gpu, c->t0.table_dev);
    if (c->t0.n_slot) sl_t0cache_free(&c->t0.cache);
    sl_gpu_close(&c->gpu);
}

/* The T0 slot holding expert e of layer l, NO_SLOT when none (or no device tier). */
static uint32_t t0_slot(const sl_compute *c, uint32_t l, uint32_t e)
{
    return c->t0.n_slot ? sl_t0cache_slot(&c->t0.cache, l * c->cfg.n_expert + e) : NO_SLOT;
}

#endif

/* Pointers to the parts of an expert whose bytes sit in a slot laid out like the
 * current arena's (T1 through a host or device address, or a T0 copy of such a slot):
 * each part's bytes start `skip` bytes into its region, skip being the slice's file
 * offset modulo the alignment. */
static sl_moe_expert_w slot_parts(sl_compute *c, const uint8_t *slot, uint32_t layer,
                                  uint32_t expert)
{
    const sl_arena_header *h = sl_fetch_client_arena(c->client)->hdr;
    const void *part[3];
    for (int p = 0; p < 3; p++) {
        const sl_expert_slice *s = sl_expert_map_slice(c->map, layer, expert, p);
        part[p] = slot + h->part_offset[p] + s->offset % h->align;
    }
    return (sl_moe_expert_w){part[0], part[1], part[2]};
}

#ifdef SL_HAVE_CUDA
/* The parts of an expert in T0 slot `slot` (see t0_tier). */
static sl_moe_expert_w t0_parts(sl_compute *c, uint32_t slot, uint32_t layer, uint32_t expert)
{
    uint8_t *base = c->t0.base + slot * c->t0.slot_bytes;
    sl_moe_expert_w p = slot_parts(c, base, layer, expert);
    p.down = base + c->t0.down_off;
    return p;
}
#endif

static double gib(uint64_t b)
{
    return (double)b / (double)(1ull << 30);
}

/* The start-up memory plan: what goes where, how many slots of each tier, what is left. */
static void print_plan(sl_compute *c, FILE *f)
{
    static const char *const names[] = {"auto", "CPU emulation of the GPU arithmetic",
                                        "CPU f32 reference", "GPU"};
    const sl_model_config *m = &c->cfg;
    const sl_proto_welcome *w = sl_fetch_client_welcome(c->client);
    uint64_t slot = c->map->layout.slot_bytes, n_ent = (uint64_t)m->n_layer * m->n_expert;
    fprintf(f,
            "sluice-compute: %s: %u layers, dim %u, %u experts (top %u) of %u; backend: %s\n"
            "sluice-compute: memory plan:\n"
            "  experts       %" PRIu64 " of %.1f MiB = %.2f GiB on disk (T2)\n"
            "  T1 host arena %s: %u slots = %.2f GiB (%.0f%% of the experts), fetcher at %s\n",
            c->opt.model, m->n_layer, m->dim, m->n_expert, m->n_expert_used, m->moe_inter,
            names[c->backend], n_ent, (double)slot / (1 << 20), gib(n_ent * slot), w->arena_name,
            w->slot_count, gib((uint64_t)w->slot_count * w->slot_bytes),
            100.0 * (double)w->slot_count / (double)n_ent, c->endpoint);
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU) {
        const plan *p = &c->plan;
        uint64_t t0 = (uint64_t)c->t0.n_slot * c->t0.slot_bytes;
        fprintf(f,
                "  GPU           %.1f GiB: resident weights %.2f GiB (routers, shared experts%s); "
                "%.1f GiB were free after them\n"
                "  T0 device     %u slots = %.2f GiB (%.0f%% of the experts; %s)%s\n"
                "  GPU left      %.1f GiB\n",
                gib(p->gpu_total), gib(p->resident), c->embd_dev ? ", token_embd" : "",
                gib(p->gpu_free), c->t0.n_slot, gib(t0),
                100.0 * (double)c->t0.n_slot / (double)n_ent, p->t0_why,
                c->t0.n_slot ? (c->opt.t0_admit == SL_T0_ADMIT_FREQ
                                    ? "; admission freq: a miss may be read in place"
                                    : "")
                             : "; kernels read T1 in place (zero-copy)",
                gib(p->gpu_free > t0 ? p->gpu_free - t0 : 0));
    }
#endif
}

#ifdef SL_HAVE_CUDA
/* Queues the device table's pending changes (before the next routing on the device). */
static int t0_table_flush(sl_compute *c, sl_err *err)
{
    t0_tier *t = &c->t0;
    int rc = sl_gpu_t0_set(c->gpu, t->table_dev, t->set_index, t->set_value, t->n_set, err);
    t->n_set = 0;
    return rc;
}

/* Notes table entry `index` = value for the device's copy of the table. */
static int t0_table_note(sl_compute *c, uint32_t index, sl_gpu_t0e value, sl_err *err)
{
    t0_tier *t = &c->t0;
    if (t->n_set == 16) {
        int rc = t0_table_flush(c, err);
        if (rc) return rc;
    }
    t->set_index[t->n_set] = index;
    t->set_value[t->n_set++] = value;
    return 0;
}

/* Puts expert e of layer l (bytes at host_slot, a pinned arena slot) into a free or
 * evicted T0 slot: its gate and up regions copied as they are, its down copied raw into
 * a stage and tiled at down_off (t0_tier), both on the copy stream, the tiling on the
 * main stream before the next work that reads it (gpu.h); returns the slot, or NO_SLOT
 * when every slot is in use this layer or the admission (--t0-admit freq) leaves the
 * expert in T1, to be read in place. */
static uint32_t t0_fill(sl_compute *c, uint32_t l, uint32_t e, const uint8_t *host_slot, int *rc,
                        sl_err *err)
{
    t0_tier *t = &c->t0;
    const uint32_t key = l * c->cfg.n_expert + e;
    uint32_t evicted;
    const uint32_t slot = sl_t0cache_claim(&t->cache, key, &evicted);
    if (slot == SL_T0_NONE) return NO_SLOT;
    if (evicted != SL_T0_NONE) {
        *rc = t0_table_note(c, evicted, (sl_gpu_t0e){NULL, NULL, NULL}, err);
        if (*rc) return NO_SLOT;
    }
    uint8_t *dst = t->base + slot * t->slot_bytes;
    *rc = sl_gpu_upload_async(c->gpu, dst, host_slot, t->down_off, err); /* gate, up */
    if (!*rc)
        *rc =
            sl_gpu_upload_down_async(c->gpu, dst + t->down_off, slot_parts(c, host_slot, l, e).down,
                                     c->map->part_bytes[SL_EXPERT_DOWN], err);
    if (*rc) return NO_SLOT;
    sl_t0cache_fill(&t->cache, slot, key);
    const sl_moe_expert_w p = t0_parts(c, slot, l, e);
    *rc = t0_table_note(c, key, (sl_gpu_t0e){p.gate, p.up, p.down}, err);
    return *rc ? NO_SLOT : slot;
}

/* --t0-preload: every expert the device tier can hold, layer by layer, through the
 * fetcher (so the host arena warms too), before the first step. */
static int t0_preload(sl_compute *c, sl_err *err)
{
    t0_tier *t = &c->t0;
    if (c->backend != SL_BACKEND_GPU || !t->n_slot) return 0;
    int rc = ensure_registered(c, err);
    uint32_t left = t->n_slot, batch = c->shape.n_used;
    for (uint32_t l = 0; l < c->cfg.n_layer && left && !rc; l++)
        for (uint32_t e0 = 0; e0 < c->cfg.n_expert && left && !rc; e0 += batch) {
            uint32_t ex[64], n = 0;
            for (uint32_t e = e0; e < e0 + batch && e < c->cfg.n_expert && n < left; e++)
                ex[n++] = e;
            sl_fetch_pin pins[64];
            rc = sl_fetch_client_get(c->client, l, ex, n, pins, c->opt.timeout_ms, err);
            if (rc) break;
            sl_arena *a = sl_fetch_client_arena(c->client);
            for (uint32_t k = 0; k < n && !rc; k++) {
                if (t0_fill(c, l, ex[k], sl_arena_slot_data(a, pins[k].slot), &rc, err) == NO_SLOT)
                    left = 0;
                else
                    left--;
            }
            /* The copies read the pinned slots: wait before giving them back. */
            if (!rc) rc = t0_table_flush(c, err);
            if (!rc) rc = sl_gpu_sync(c->gpu, err);
            sl_fetch_client_put(c->client, pins, n, NULL);
        }
    sl_t0cache_layer_done(&t->cache); /* filled, not in use by any layer yet */
    return rc;
}
#else
static int t0_preload(sl_compute *c, sl_err *err)
{
    (void)c;
    (void)err;
    return 0;
}
#endif

/* ---------------------------------------------------------------- open/close */

int sl_compute_open(sl_compute **out, const sl_compute_options *o, sl_err *err)
{
    *out = NULL;
    sl_compute *c = calloc(1, sizeof *c);
    if (!c) return sl_err_set(err, SL_ENOMEM, "out of memory");
    c->opt = *o;
    int rc = sl_gguf_open(&c->gguf, o->model, err);
    if (!rc) rc = sl_model_config_read(c->gguf, &c->cfg, err);
    if (!rc) rc = sl_expert_map_build(&c->map, c->gguf, SL_SLOT_ALIGN, err);
    if (rc) goto fail;
    const sl_model_config *m = &c->cfg;
    c->shape = (sl_moe_shape){.dim = m->dim,
                              .inter = m->moe_inter,
                              .n_expert = m->n_expert,
                              .n_used = m->n_expert_used,
                              .gate_type = c->map->type[SL_EXPERT_GATE],
                              .up_type = c->map->type[SL_EXPERT_UP],
                              .down_type = c->map->type[SL_EXPERT_DOWN],
                              .route_scale = m->route_scale,
                              .norm_topk = m->norm_topk_prob,
                              .swiglu_limit = m->swiglu_limit,
                              .gate_temp = m->gate_temp};
    if (m->n_expert_used > 64 || m->n_expert_used > SL_PROTO_FETCH_MAX) {
        rc = sl_err_set(err, SL_EUNSUPPORTED, "%u experts per token: at most 64 are supported",
                        m->n_expert_used);
        goto fail;
    }
    rc = load_layers(c, err);
    if (!rc && o->routing != SL_ROUTING_ROUTER)
        rc = sl_synth_route_init(&c->synth, c->cfg.n_layer, c->cfg.n_expert, c->shape.n_used,
                                 o->routing == SL_ROUTING_ZIPF ? o->zipf_s : 0.0, o->seed,
                                 c->shape.route_scale / (float)c->shape.n_used, err);
    if (rc) goto fail;
    char name[SL_MODEL_TENSOR_NAME_MAX];
    sl_model_tensor_name(name, sizeof name, SL_MODEL_TENSOR_TOKEN_EMBD, 0);
    c->embd = sl_gguf_find_tensor(c->gguf, name);
    if (!c->embd || c->embd->ne[0] != m->dim || !sl_qtype_get(c->embd->type)->decodable) {
        rc = sl_err_set(err, SL_EFORMAT, "%s: no usable '%s'", o->model, name);
        goto fail;
    }
    c->embd_row = malloc(sl_qtype_row_bytes(c->embd->type, m->dim));
    c->f32 = malloc(sizeof(float) * m->dim);
    c->logits = malloc(sizeof(float) * m->n_expert);
    c->h = malloc(sizeof(uint16_t) * m->dim);
    c->x = malloc(sizeof(uint16_t) * m->dim);
    c->y = malloc(sizeof(uint16_t) * m->dim);
    c->experts = calloc(m->n_expert, sizeof *c->experts);
    if (!c->embd_row || !c->f32 || !c->logits || !c->h || !c->x || !c->y || !c->experts) {
        rc = sl_err_set(err, SL_ENOMEM, "out of memory");
        goto fail;
    }
    if (o->trace_path) {
        rc = sl_trace_open(&c->trace, "sluice-compute", TRACE_CAPACITY, err);
        if (!rc) rc = sl_trace_name_track(c->trace, SL_TRACE_TRACK_GPU, "GPU (CUDA events)", err);
        if (!rc)
            rc = sl_trace_name_track(c->trace, SL_TRACE_TRACK_GPU_COPY,
                                     "GPU copies T1->T0 (CUDA events)", err);
#ifdef SL_HAVE_CUDA
        if (!rc && !(c->mark_ns = malloc(SL_GPU_MARKS * sizeof *c->mark_ns)))
            rc = sl_err_set(err, SL_ENOMEM, "out of memory");
#endif
        if (rc) goto fail;
    }
    if (o->out_path) {
        c->out = fopen(o->out_path, "wb");
        if (!c->out) {
            rc = sl_err_errno(err, SL_EIO, errno, "fopen(%s)", o->out_path);
            goto fail;
        }
    }
    uint64_t resident = 0; /* bytes of resident weights on the GPU */
    (void)resident;
    c->backend = o->backend;
    if (c->backend == SL_BACKEND_AUTO || c->backend == SL_BACKEND_GPU) {
        int n_gpu = 0;
#ifdef SL_HAVE_CUDA
        rc = sl_gpu_device_count(&n_gpu, err);
        if (rc) goto fail;
#endif
        if (n_gpu > 0) {
            c->backend = SL_BACKEND_GPU;
        } else if (c->backend == SL_BACKEND_GPU) {
            rc = sl_err_set(err, SL_EUNSUPPORTED, "--backend gpu: %s",
#ifdef SL_HAVE_CUDA
                            "no CUDA device is present"
#else
                            "this build has no CUDA (nvcc was not found when it was built)"
#endif
            );
            goto fail;
        } else {
            c->backend = SL_BACKEND_CPU;
        }
    }
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU) {
        rc = gpu_open(c, &resident, err);
        if (rc) goto fail;
    }
#endif
    if (o->endpoint) {
        sl_strlcpy(c->endpoint, o->endpoint, sizeof c->endpoint);
    } else {
        rc = sl_fetch_default_endpoint(c->endpoint, sizeof c->endpoint, c->gguf->fingerprint, 0,
                                       err);
        if (rc) goto fail;
    }
    sl_fetch_client_options co;
    sl_fetch_client_options_default(&co, c->endpoint);
    co.fingerprint = c->gguf->fingerprint;
    co.connect_ms = o->timeout_ms;
    co.io_cpu = o->cpu;
#ifdef SL_HAVE_CUDA
    co.on_unmap = unregister_arena;
    co.on_unmap_ctx = c;
#endif
    rc = sl_fetch_client_open(&c->client, &co, err);
    if (rc) goto fail;
#ifdef SL_HAVE_CUDA
    /* Pinning a large arena for the GPU takes seconds: do it before the first step. */
    if (c->backend == SL_BACKEND_GPU) {
        rc = ensure_registered(c, err);
        if (rc) goto fail;
    }
#endif
    const sl_proto_welcome *w = sl_fetch_client_welcome(c->client);
    int same_parts = 1;
    for (int p = 0; p < SL_EXPERT_N_PART; p++)
        same_parts &= w->part_off[p] == c->map->layout.part_offset[p];
    if (w->slot_bytes != c->map->layout.slot_bytes || !same_parts) {
        /* T0 slots are laid out from this build's layout (t0_tier: the parts before the
         * down copied as they are, the down tiled at its region's start). */
        rc = sl_err_set(err, SL_EMISMATCH,
                        "the fetcher's slots (%" PRIu64 " bytes, down region at %" PRIu64
                        ") differ from this build's (%" PRIu64 " bytes, down at %" PRIu64
                        "): a fetcher of another version?",
                        (uint64_t)w->slot_bytes, (uint64_t)w->part_off[SL_EXPERT_DOWN],
                        c->map->layout.slot_bytes, c->map->layout.part_offset[SL_EXPERT_DOWN]);
        goto fail;
    }
    if (w->n_layer != m->n_layer || w->n_expert != m->n_expert) {
        rc = sl_err_set(err, SL_EMISMATCH,
                        "the fetcher serves %u x %u experts, the model has %u x %u", w->n_layer,
                        w->n_expert, m->n_layer, m->n_expert);
        goto fail;
    }
    if (o->t0_preload) rc = t0_preload(c, err);
    if (rc) goto fail;
    if (!o->quiet) print_plan(c, stderr);
    /* Last, so that the threads CUDA and the readers of the trace start are not pinned. */
    rc = sl_affinity_pin_self(o->cpu, err);
    if (rc) goto fail;
    *out = c;
    return 0;
fail:
    sl_compute_close(&c);
    return rc;
}

void sl_compute_close(sl_compute **pc)
{
    if (!pc || !*pc) return;
    sl_compute *c = *pc;
    if (c->trace && c->opt.trace_path) {
        sl_err e = {0};
        if (sl_trace_write_json(c->trace, c->opt.trace_path, &e))
            fprintf(stderr, "sluice-compute: %s\n", e.msg);
    }
#ifdef SL_HAVE_CUDA
    gpu_close(c);
#endif
    sl_fetch_client_close(&c->client);
    if (c->out) fclose(c->out);
    if (c->layers) {
        for (uint32_t l = 0; l < c->cfg.n_layer; l++) {
            layer_w *w = &c->layers[l];
            free(w->ffn_norm);
            free(w->router);
            free(w->bias);
            for (int p = 0; p < 3; p++) free(w->shared[p]);
        }
        free(c->layers);
    }
    sl_trace_close(&c->trace);
#ifdef SL_HAVE_CUDA
    free(c->mark_ns);
#endif
    free(c->embd_row);
    free(c->f32);
    free(c->logits);
    free(c->h);
    free(c->x);
    free(c->y);
    free(c->experts);
    sl_synth_route_free(&c->synth);
    sl_expert_map_free(&c->map);
    sl_gguf_close(&c->gguf);
    free(c);
    *pc = NULL;
}

/* ---------------------------------------------------------------- one step */

/* h = the embedding row of the step's token: on the device when it holds the table,
 * else read, decoded here and (on the GPU) uploaded. */
static int embed(sl_compute *c, uint64_t step, sl_err *err)
{
    uint32_t token = (uint32_t)(sl_splitmix64(c->opt.seed * 1000003u + step) % c->cfg.vocab);
#ifdef SL_HAVE_CUDA
    if (c->embd_dev) return sl_gpu_embed_q2_k(c->gpu, c->embd_dev, token, c->h_dev, err);
#endif
    uint64_t row = sl_qtype_row_bytes(c->embd->type, c->cfg.dim);
    const sl_gguf_shard *sh = &c->gguf->shards[c->embd->shard];
    uint64_t off = c->embd->offset + (uint64_t)token * row;
    if (pread(sh->fd, c->embd_row, row, (off_t)off) != (ssize_t)row)
        return sl_err_errno(err, SL_EIO, errno, "pread(%s, off %" PRIu64 ", len %" PRIu64 ")",
                            sh->path, off, row);
    sl_quant_decode(c->embd->type, c->embd_row, c->f32, c->cfg.dim);
    for (uint32_t i = 0; i < c->cfg.dim; i++) c->h[i] = sl_f32_to_bf16(c->f32[i]);
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU)
        return sl_gpu_upload(c->gpu, c->h_dev, c->h, c->cfg.dim * sizeof(uint16_t), err);
#endif
    return 0;
}

/* The previous layer's residual (h = bf16(h + y), when there is one) and this layer's
 * ffn_norm x = bf16(w * h * rsqrt(mean(h^2) + eps)) (MODEL.md §2.1), in
 * sl_emu_residual_norm's arithmetic: on the GPU the residual stream stays in device
 * memory and this is one kernel; the CPU backends run its twin. w NULL: the residual
 * only (the end of a step). */
static int residual_norm(sl_compute *c, int with_y, const layer_w *w, sl_err *err)
{
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU)
        return sl_gpu_residual_norm(c->gpu, c->h_dev, with_y ? c->y_dev : NULL,
                                    w ? w->ffn_norm_dev : NULL, c->cfg.norm_eps, c->x_dev, err);
#endif
    (void)err;
    sl_emu_residual_norm(c->cfg.dim, c->h, with_y ? c->y : NULL, w ? w->ffn_norm : NULL,
                         c->cfg.norm_eps, c->x);
    return 0;
}

/* Points the table by expert id (what the CPU backends read) at the pinned slots. */
static void bind_experts(sl_compute *c, uint32_t layer, const sl_fetch_pin *pins, uint32_t n)
{
    sl_arena *a = sl_fetch_client_arena(c->client);
    for (uint32_t i = 0; i < n; i++)
        c->experts[pins[i].expert] =
            slot_parts(c, sl_arena_slot_data(a, pins[i].slot), layer, pins[i].expert);
}

/* Adds the time since *t to part `sub` of the layer and restarts the clock. */
static void lap(sl_compute *c, int sub, uint64_t *t)
{
    uint64_t now = sl_now_ns();
    c->t.sub_ns[sub] += now - *t;
    *t = now;
}

#ifdef SL_HAVE_CUDA
/* A timeline mark when tracing, on the compute stream or (copy) the copy stream of the
 * T1 -> T0 copies (0 otherwise, or when the batch is full: the span is then left out). */
static uint32_t gmark(sl_compute *c, int copy)
{
    uint32_t id = 0;
    if (c->mark_ns && c->backend == SL_BACKEND_GPU &&
        (copy ? sl_gpu_mark_copy : sl_gpu_mark)(c->gpu, &id, NULL))
        id = 0;
    return id;
}

static void gspan(sl_compute *c, const char *name, int32_t layer, int32_t expert, uint64_t bytes,
                  uint32_t from, uint32_t to)
{
    if (from && to && c->n_gspan < GPU_SPANS)
        c->gspan[c->n_gspan++] = (gpu_span){name, layer, expert, bytes, from, to};
}

/* The step's GPU spans into the trace, on the GPU's own track (waits for the GPU). */
static void gspans_flush(sl_compute *c)
{
    uint64_t *ns = c->mark_ns;
    uint32_t n = 0;
    if (!ns || sl_gpu_marks_read(c->gpu, ns, &n, NULL)) return;
    for (uint32_t i = 0; i < c->n_gspan; i++) {
        const gpu_span *g = &c->gspan[i];
        if (g->to < n)
            sl_trace_add_on(c->trace, g->bytes ? SL_TRACE_TRACK_GPU_COPY : SL_TRACE_TRACK_GPU,
                            g->name, g->layer, g->expert, g->bytes, ns[g->from], ns[g->to]);
    }
    c->n_gspan = 0;
}
#endif

/* The synthetic routings' step number: each pass over the layers picks anew. */
static uint64_t synth_step(const sl_compute *c)
{
    return c->step * c->opt.passes + c->pass;
}

/* Whether this layer adds the last layer's y to the residual stream (also across
 * passes, --layer-passes). */
static int adds_y(const sl_compute *c, uint32_t l)
{
    return l > 0 || c->pass > 0;
}

/* Route x: on the GPU routing on the device (below); on the CPU backends the router
 * GEMV and the selection of router.c. On the GPU with w->norm_in_router the router
 * first computes x itself, with the residual (layer_step has not run it). */
static int route_x(sl_compute *c, uint32_t l, layer_w *w, sl_moe_route *route, sl_err *err)
{
    uint64_t t = sl_now_ns();
    int rc;
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU) {
        /* Routing on the device: the router, the selection (router.c's, bit for bit)
         * and the gate/up of the picks the device tier holds are queued at once, with
         * the shared expert (inside those launches, or on the side stream); the host
         * sees the picks while that work runs. A synthetic routing is handed over to
         * replace the picks (the router and the selection still run). */
        sl_moe_route forced;
        const int synth = c->opt.routing != SL_ROUTING_ROUTER;
        if (synth) sl_synth_route_pick(&c->synth, synth_step(c), l, &forced);
        const sl_gpu_t0e *t0 =
            c->t0.n_slot ? c->t0.table_dev + (uint64_t)l * c->cfg.n_expert : NULL;
        rc = sl_gpu_moe_shared(c->gpu, c->x_dev, &w->shared_w_dev, err);
        if (!rc && w->norm_in_router) {
            const int add_y = adds_y(c, l);
            const sl_gpu_norm n = {c->h_dev, add_y ? c->y_dev : NULL, c->h2_dev, w->ffn_norm_dev,
                                   c->cfg.norm_eps};
            rc = sl_gpu_route_start_norm(c->gpu, &n, c->x_dev, w->router_dev, w->bias_dev, t0,
                                         synth ? &forced : NULL, err);
            if (!rc && add_y) { /* the router wrote the residual into the other buffer */
                uint16_t *h = c->h_dev;
                c->h_dev = c->h2_dev;
                c->h2_dev = h;
            }
        } else if (!rc) {
            rc = sl_gpu_route_start(c->gpu, c->x_dev, w->router_dev, w->bias_dev, t0,
                                    synth ? &forced : NULL, err);
        }
        c->mark_routed = gmark(c, 0);
        lap(c, SUB_SHARED, &t);
        if (!rc) rc = sl_gpu_route_wait(c->gpu, route, &c->started, err);
        lap(c, SUB_ROUTER, &t);
        return rc;
    }
#endif
    (void)l;
    rc = sl_router_logits(c->x, w->router, c->cfg.n_expert, c->cfg.dim, c->shape.gate_temp,
                          c->logits, err);
    lap(c, SUB_ROUTER, &t);
    if (!rc) rc = sl_router_select(c->logits, w->bias, &c->shape, route, err);
    lap(c, SUB_SELECT, &t);
    return rc;
}

/* Hits first: what sl_fetch_client_get_each's reports need to place and launch the
 * experts of one layer as they get pinned. */
typedef struct arrivals {
    sl_compute *c;
    uint32_t layer;
    const uint32_t *rank_of; /* [index in the request] -> rank */
    const uint32_t *want;    /* [index in the request] -> expert */
    const uint32_t *pending; /* T0 hits held back to share the first launch */
    uint32_t n_pending;
    int rc; /* the first failure; later reports are ignored */
    sl_err *err;
} arrivals;

/* Points by_rank[rank] at expert e of layer l, pinned in host slot `slot` of the
 * current arena: a device-tier copy on a GPU with T0 (queued on the copy stream),
 * else the slot read in place (GPU zero-copy, or the CPU backends' host view). */
static int place(sl_compute *c, uint32_t l, uint32_t rank, uint32_t e, uint32_t slot, sl_err *err)
{
    sl_arena *a = sl_fetch_client_arena(c->client);
    const uint8_t *host_slot = sl_arena_slot_data(a, slot);
    int rc = 0;
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU) {
        rc = ensure_registered(c, err);
        if (rc) return rc;
        if (c->t0.n_slot) {
            /* Already copied (this layer, before a fetcher restart), or a new copy. */
            uint32_t t = t0_slot(c, l, e);
            if (t == NO_SLOT) {
                uint32_t m0 = gmark(c, 1);
                t = t0_fill(c, l, e, host_slot, &rc, err);
                gspan(c, "copy T1->T0", (int32_t)l, (int32_t)e,
                      c->t0.down_off + c->map->part_bytes[SL_EXPERT_DOWN], m0, gmark(c, 1));
            }
            if (rc) return rc;
            if (t != NO_SLOT) {
                c->t0.cache.in_use[t] = 1;
                c->by_rank[rank] = t0_parts(c, t, l, e);
                return 0;
            }
        }
        if (c->t0.n_slot) c->t1_in_place++;
        c->by_rank[rank] = slot_parts(c, c->arena_dev + (host_slot - a->base), l, e);
        return 0;
    }
#endif
    (void)err;
    c->by_rank[rank] = slot_parts(c, host_slot, l, e);
    return rc;
}

/* Queues the routed work of ranks[0..n) whose weights are in by_rank (GPU only: the
 * CPU backends compute every expert at the end of the layer). */
static int launch(sl_compute *c, const uint32_t *ranks, uint32_t n, const char *what, sl_err *err)
{
    if (!n) return 0;
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU) {
        uint64_t t = sl_now_ns();
        if (!c->mark_launch) c->mark_launch = gmark(c, 0);
        for (uint32_t k = 0; k < n; k++) c->launched[ranks[k]] = 1;
        int rc = sl_gpu_moe_part(c->gpu, ranks, n, c->by_rank, err);
        sl_trace_add(c->trace, what, -1, (int32_t)n, 0, t, sl_now_ns());
        return rc;
    }
#endif
    (void)c;
    (void)ranks;
    (void)what;
    (void)err;
    return 0;
}

/* sl_fetch_client_get_each's report: place and launch what just got pinned. A rank
 * reported again after a fetcher restart is already queued from the old mapping (the
 * same bytes, kept mapped until that work is done): only its new pin is kept. */
static void on_arrival(void *ctx, const uint32_t *index, const sl_fetch_pin *pins, uint32_t n)
{
    arrivals *g = ctx;
    sl_compute *c = g->c;
    uint32_t ranks[128], k = 0, later[128], n_later = 0;
    for (; k < g->n_pending; k++) ranks[k] = g->pending[k];
    g->n_pending = 0;
    for (uint32_t i = 0; i < n && !g->rc; i++) {
        uint32_t rank = g->rank_of[index[i]];
#ifdef SL_HAVE_CUDA
        if (c->launched[rank]) continue;
        /* one that must first be copied into T0 comes last (below) */
        if (c->backend == SL_BACKEND_GPU && c->t0.n_slot &&
            t0_slot(c, g->layer, g->want[index[i]]) == NO_SLOT &&
            sl_t0cache_would_take(&c->t0.cache, g->layer * c->cfg.n_expert + g->want[index[i]])) {
            later[n_later++] = i;
            continue;
        }
#endif
        g->rc = place(c, g->layer, rank, g->want[index[i]], pins[i].slot, g->err);
        ranks[k++] = rank;
    }
    if (!g->rc) g->rc = launch(c, ranks, k, n > 1 ? "launch hits" : "launch arrival", g->err);
#ifdef SL_HAVE_CUDA
    /* The experts to copy into T0: the down projections of everything queued so far go
     * first (they run while the copies land), then each copy with its own launch, which
     * starts as soon as that copy has landed while the next one is copied (a launch
     * waits for the copies queued before it). */
    if (!g->rc && n_later) g->rc = sl_gpu_moe_down_early(c->gpu, g->err);
    for (uint32_t j = 0; j < n_later && !g->rc; j++) {
        const uint32_t i = later[j], rank = g->rank_of[index[i]];
        g->rc = place(c, g->layer, rank, g->want[index[i]], pins[i].slot, g->err);
        if (!g->rc) g->rc = launch(c, &rank, 1, "launch after its copy", g->err);
    }
#else
    (void)later;
    (void)n_later;
#endif
}

/* Whether the shared slot table holds every expert of want[0..n) of layer l now (a
 * hint: the fetcher may evict one before it is pinned). */
static int all_in_arena(sl_compute *c, uint32_t l, const uint32_t *want, uint32_t n)
{
    sl_arena *a = sl_fetch_client_arena(c->client);
    for (uint32_t i = 0; i < n; i++)
        if (!atomic_load_explicit(&a->table[(uint64_t)l * c->cfg.n_expert + want[i]],
                                  memory_order_acquire))
            return 0;
    return 1;
}

/* Gets the layer's picked experts (DESIGN.md steps 2-3): the device tier's hits are
 * queued first, then the host arena's hits (pinned from the shared table, no
 * message) while the fetcher reads the misses, then each miss as its READY arrives.
 * Pins taken from the fetcher go to pins[0..*n_pins). */
static int gather(sl_compute *c, uint32_t l, const sl_moe_route *route, sl_fetch_pin *pins,
                  uint32_t *n_pins, sl_err *err)
{
    uint32_t n = c->shape.n_used, want[64], rank_of[64], t0_ranks[64], n_t0 = 0;
    *n_pins = 0;
#ifdef SL_HAVE_CUDA
    uint32_t dev_ranks[64], n_dev = 0; /* T0 hits the device queued (its routing) */
    memset(c->launched, 0, sizeof c->launched);
    /* route_x's sl_gpu_route_wait started the token on the GPU */
#endif
    for (uint32_t i = 0; i < n; i++) {
#ifdef SL_HAVE_CUDA
        t0_tier *t = &c->t0;
        const int started = c->backend == SL_BACKEND_GPU && (c->started >> i & 1);
        uint32_t slot = t0_slot(c, l, route->expert[i]);
        if (started && slot == NO_SLOT)
            return sl_err_set(err, SL_EIO,
                              "layer %u: the device tier's table holds expert %u, the host's "
                              "does not (out of step)",
                              l, route->expert[i]);
        if (c->backend == SL_BACKEND_GPU && t->n_slot)
            sl_t0cache_ask(&t->cache, l * c->cfg.n_expert + route->expert[i]);
        if (slot != NO_SLOT) {
            sl_t0cache_hit(&t->cache, slot);
            c->by_rank[i] = t0_parts(c, slot, l, route->expert[i]);
            c->hit_t0++;
            if (started) {
                c->launched[i] = 1;
                dev_ranks[n_dev++] = i;
            } else
                t0_ranks[n_t0++] = i;
            continue;
        }
#endif
        rank_of[*n_pins] = i;
        want[(*n_pins)++] = route->expert[i];
    }
    /* Each launch costs a few microseconds: when the rest of the picks sit in the host
     * arena (their report comes at once), the T0 hits wait to share their launch. */
    int defer = n_t0 && *n_pins && all_in_arena(c, l, want, *n_pins);
    int rc = defer ? 0 : launch(c, t0_ranks, n_t0, "launch T0 hits", err);
    if (rc || !*n_pins) return rc;
    arrivals g = {.c = c,
                  .layer = l,
                  .rank_of = rank_of,
                  .want = want,
                  .pending = t0_ranks,
                  .n_pending = defer ? n_t0 : 0,
                  .err = err};
    uint32_t asked = *n_pins;
#ifdef SL_HAVE_CUDA
    uint32_t restarts = sl_fetch_client_reconnects(c->client);
#endif
    rc = sl_fetch_client_get_each(c->client, l, want, asked, pins, c->opt.timeout_ms, on_arrival,
                                  &g, err);
#ifdef SL_HAVE_CUDA
    if (!rc && !g.rc && c->backend == SL_BACKEND_GPU &&
        sl_fetch_client_reconnects(c->client) != restarts) {
        /* The fetcher restarted meanwhile and the old arena is unmapped: work queued
         * from it that has not run yet (the down projections) would read nothing.
         * Start the layer's experts again from the new pins (and the T0 copies). */
        g.rc = sl_gpu_moe_begin(c->gpu, c->x_dev, route, err);
        memset(c->launched, 0, sizeof c->launched);
        uint32_t ranks[64], nr = 0;
        for (uint32_t k = 0; k < n_dev; k++) ranks[nr++] = dev_ranks[k];
        for (uint32_t k = 0; k < n_t0; k++) ranks[nr++] = t0_ranks[k];
        for (uint32_t k = 0; k < asked && !g.rc; k++) {
            g.rc = place(c, l, rank_of[k], want[k], pins[k].slot, err);
            ranks[nr++] = rank_of[k];
        }
        if (!g.rc) g.rc = launch(c, ranks, nr, "relaunch after a restart", err);
    }
#endif
    if (!rc && g.rc) {
        sl_fetch_client_put(c->client, pins, asked, NULL);
        rc = g.rc;
    }
    if (rc) {
        *n_pins = 0;
        return rc;
    }
    for (uint32_t k = 0; k < *n_pins; k++) {
        if (!pins[k].from_fetcher)
            c->hit_shm++;
        else if (pins[k].source == SL_PROTO_SRC_HIT)
            c->hit_fetcher++;
        else {
            c->from_disk++;
            c->read_us += pins[k].read_us;
        }
    }
    /* The CPU backends and the reference read host views by expert id too. */
    bind_experts(c, l, pins, *n_pins);
    return 0;
}

/* y = the layer's experts on x, with the backend in use. On the GPU every rank is
 * queued by now; this adds the down projections, the sum and the shared expert. */
static int experts(sl_compute *c, layer_w *w, const sl_moe_route *route, sl_err *err)
{
    switch (c->backend) {
    case SL_BACKEND_REF:
        return sl_moe_ref_apply(&c->shape, c->experts, &w->moe.shared, route, c->x, c->y, NULL,
                                err);
    case SL_BACKEND_CPU:
        return sl_emu_moe(&c->shape, c->x, route, c->by_rank, &w->moe.shared, c->y, NULL, NULL,
                          err);
#ifdef SL_HAVE_CUDA
    case SL_BACKEND_GPU: {
        /* Nothing waits here: the next layer's router (or the step's end) does, and
         * only then do this layer's pins go back. */
        return sl_gpu_moe_finish(c->gpu, c->y_dev, NULL, err);
    }
#endif
    }
    return sl_err_set(err, SL_EINVAL, "backend %d is not available", c->backend);
}

/* Prefetch (DESIGN.md step 5): the next layer's router applied to this layer's input
 * x predicts the next layer's picks; those not resident in the host arena are hinted
 * to the fetcher at low priority. The guesses are kept to score them next layer. */
static int predict_next(sl_compute *c, uint32_t l, sl_err *err)
{
    c->n_predicted = 0;
    if (!c->opt.prefetch || l + 1 >= c->cfg.n_layer) return 0;
    layer_w *next = &c->layers[l + 1];
    int rc;
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU)
        rc = sl_gpu_router_logits(c->gpu, c->x_dev, next->router_dev, c->logits, err);
    else
#endif
        rc = sl_router_logits(c->x, next->router, c->cfg.n_expert, c->cfg.dim, c->shape.gate_temp,
                              c->logits, err);
    sl_moe_route guess;
    if (!rc) rc = sl_router_select(c->logits, next->bias, &c->shape, &guess, err);
    if (rc) return rc;
    sl_arena *a = sl_fetch_client_arena(c->client);
    uint32_t hint[64], n = 0;
    for (uint32_t i = 0; i < c->shape.n_used; i++) {
        uint64_t e = atomic_load_explicit(
            &a->table[(uint64_t)(l + 1) * c->cfg.n_expert + guess.expert[i]], memory_order_acquire);
        if (!e) hint[n++] = c->predicted[c->n_predicted++] = guess.expert[i];
    }
    c->pf_sent += n;
    /* A hint the fetcher cannot take is no error: the demand will come anyway. */
    if (n) sl_fetch_client_prefetch(c->client, l + 1, hint, n, NULL);
    return 0;
}

/* Scores the previous layer's hints against this layer's picks. A would-be miss is a
 * pick that was not resident when the hints went out: either it was hinted (caught,
 * whether its read had finished or not) or it was read from disk unhinted. */
static void score_prediction(sl_compute *c, const sl_moe_route *route, const sl_fetch_pin *pins,
                             uint32_t n_pins)
{
    uint32_t caught = 0;
    for (uint32_t i = 0; i < c->n_predicted; i++)
        for (uint32_t k = 0; k < c->shape.n_used; k++)
            caught += route->expert[k] == c->predicted[i];
    uint32_t unhinted_reads = 0;
    for (uint32_t k = 0; k < n_pins; k++) {
        int hinted = 0;
        for (uint32_t i = 0; i < c->n_predicted; i++) hinted |= c->predicted[i] == pins[k].expert;
        unhinted_reads += !hinted && pins[k].source == SL_PROTO_SRC_DISK;
    }
    c->pf_useful += caught;
    c->pf_misses_covered += caught;
    c->misses_total += caught + unhinted_reads;
}

/* Gives back the pins of the previous layer: the GPU work that read them has
 * completed once the main stream was waited for (the router's logits, or the end of
 * the step). */
static void put_held(sl_compute *c)
{
    if (c->n_held) sl_fetch_client_put(c->client, c->held, c->n_held, NULL);
    c->n_held = 0;
}

/* One layer (DESIGN.md "One decode step"). On the GPU nothing waits for this layer's
 * kernels: the next layer's router download does, and puts this layer's pins back. */
static int layer_step(sl_compute *c, uint32_t l, sl_err *err)
{
    layer_w *w = &c->layers[l];
    uint64_t t0 = sl_now_ns(), t = t0;
#ifdef SL_HAVE_CUDA
    c->mark_layer = gmark(c, 0);
    c->mark_launch = 0;
#endif
    /* the last layer's y; inside the router when it can compute x itself */
    int rc = w->norm_in_router ? 0 : residual_norm(c, adds_y(c, l), w, err);
    lap(c, SUB_NORM, &t);
    sl_moe_route route;
    if (!rc) rc = route_x(c, l, w, &route, err);
    put_held(c);
    if (rc) return sl_err_prefix(err, "layer %u", l);
    if (c->opt.routing != SL_ROUTING_ROUTER && c->backend != SL_BACKEND_GPU)
        sl_synth_route_pick(&c->synth, synth_step(c), l, &route); /* the GPU's routing took it */
    uint64_t t1 = sl_now_ns();
    rc = gather(c, l, &route, c->held, &c->n_held, err);
    if (!rc && c->opt.prefetch) {
        score_prediction(c, &route, c->held, c->n_held);
        rc = predict_next(c, l, err);
    }
#ifdef SL_HAVE_CUDA
    /* the device tier's table changes of this layer, before the next routing */
    if (!rc && c->t0.n_set) rc = t0_table_flush(c, err);
#endif
    uint64_t t2 = sl_now_ns();
    c->t.sub_ns[SUB_GATHER] += t2 - t1;
    t = t2;
    if (!rc) rc = experts(c, w, &route, err);
#ifdef SL_HAVE_CUDA
    /* Later fills of these slots are queued behind this layer's kernels. */
    if (c->t0.n_slot) sl_t0cache_layer_done(&c->t0.cache);
#endif
    if (rc) return sl_err_prefix(err, "layer %u", l);
#ifdef SL_HAVE_CUDA
    uint32_t done = gmark(c, 0);
    gspan(c, "norm + routing + T0 gate/up", (int32_t)l, -1, 0, c->mark_layer, c->mark_routed);
    /* After the device's own work the main stream waits for what the host queues once
     * it has the picks (the other experts, or only the down projections). */
    gspan(c, "waits for the host", (int32_t)l, -1, 0, c->mark_routed, c->mark_launch);
    gspan(c, "experts", (int32_t)l, -1, 0, c->mark_launch ? c->mark_launch : c->mark_routed, done);
#endif
    lap(c, SUB_FINISH, &t);
    c->t.route_ns += t1 - t0;
    c->t.wait_ns += t2 - t1;
    c->t.compute_ns += t - t2;
    sl_trace_add(c->trace, "route", (int32_t)l, -1, 0, t0, t1);
    sl_trace_add(c->trace, "wait", (int32_t)l, -1, 0, t1, t2);
    sl_trace_add(c->trace, "compute", (int32_t)l, -1, 0, t2, t);
    return 0;
}

/* A step: the token's embedding into the residual stream, every layer, the last
 * residual; the step's output h comes back to the host. */
static int step(sl_compute *c, uint64_t s, sl_err *err)
{
    uint64_t t = sl_now_ns();
    int rc = embed(c, s, err);
#ifdef SL_HAVE_CUDA
    if (!rc && c->mark_ns && c->backend == SL_BACKEND_GPU) rc = sl_gpu_mark_anchor(c->gpu, err);
#endif
    lap(c, SUB_START, &t);
    for (c->pass = 0; c->pass < c->opt.passes && !rc; c->pass++)
        for (uint32_t l = 0; l < c->cfg.n_layer && !rc; l++) rc = layer_step(c, l, err);
    t = sl_now_ns();
    if (!rc) rc = residual_norm(c, 1, NULL, err);
#ifdef SL_HAVE_CUDA
    /* Waits for the last layer's kernels: then its pins may go back. */
    if (!rc && c->backend == SL_BACKEND_GPU)
        rc = sl_gpu_download(c->gpu, c->h, c->h_dev, c->cfg.dim * sizeof(uint16_t), err);
    /* A failed step may leave kernels queued that read the pinned slots, and a token
     * open on the GPU: wait for them and drop it before the pins go back. */
    if (rc && c->backend == SL_BACKEND_GPU && c->gpu) sl_gpu_moe_abort(c->gpu, NULL);
#endif
    put_held(c);
    c->t.sub_ns[SUB_RESIDUAL] += sl_now_ns() - t;
#ifdef SL_HAVE_CUDA
    if (!rc) gspans_flush(c);
#endif
    return rc;
}

/* After the warm-up steps: counters and clocks start from zero. */
static void reset_counters(sl_compute *c)
{
    c->steps_done = 0;
    c->hit_t0 = c->hit_shm = c->hit_fetcher = c->from_disk = c->read_us = c->t1_in_place = 0;
#ifdef SL_HAVE_CUDA
    c->t0.cache.fills = c->t0.cache.refused = 0;
#endif
    memset(&c->t, 0, sizeof c->t);
    c->pf_sent = c->pf_useful = c->pf_misses_covered = c->misses_total = 0;
}

int sl_compute_run(sl_compute *c, sl_err *err)
{
    uint64_t start = sl_now_ns();
    for (uint64_t s = 0; s < (uint64_t)c->opt.warmup + c->opt.steps; s++) {
        if (s == c->opt.warmup && s) {
            reset_counters(c);
            start = sl_now_ns();
        }
        c->step = s;
        int rc = step(c, s, err);
        if (rc) return sl_err_prefix(err, "step %" PRIu64, s);
        if (c->out && fwrite(c->h, sizeof(uint16_t), c->cfg.dim, c->out) != c->cfg.dim)
            return sl_err_errno(err, SL_EIO, errno, "writing %s", c->opt.out_path);
        c->steps_done++;
    }
    if (c->out && fflush(c->out) != 0)
        return sl_err_errno(err, SL_EIO, errno, "writing %s", c->opt.out_path);
    c->run_ns = sl_now_ns() - start;
    return 0;
}

/* Layers a step runs: the checkpoint's, times --layer-passes. */
static uint32_t depth(const sl_compute *c)
{
    return c->cfg.n_layer * c->opt.passes;
}

/* A step of the real model's 40 layers: the step's start (embedding) once, the rest
 * of the measured step scaled by 40 / depth. The rest stays whole because the host
 * runs ahead of the GPU: the wait at the step's end (h's download) holds GPU work of
 * the last layers, so it is counted as layers' time, not as a cost of the step. */
static double step40_s(const sl_compute *c)
{
    const double per = 1.0 / (double)c->steps_done;
    const double step = (double)c->run_ns / 1e9 * per;
    const double start = (double)c->t.sub_ns[SUB_START] / 1e9 * per;
    return start + (step - start) * 40.0 / (double)depth(c);
}

/* The byte floor of a step: the bytes each memory path moved per step, at the
 * ceiling of that path measured in the same run (--ceilings), the paths working in
 * parallel; the step can be no faster than its slowest path. HBM carries every
 * expert computed from device memory plus the resident router and shared expert;
 * the host link every expert that came from T1 or the disk (copied into T0, or read
 * in place); the disk every miss. */
static void print_floor(sl_compute *c, FILE *out)
{
    const double *g = c->opt.ceiling_gbs;
    if (!c->steps_done ||
        !(g[CEIL_HBM] > 0 || g[CEIL_COPY] > 0 || g[CEIL_ZC] > 0 || g[CEIL_DISK] > 0))
        return;
    const sl_model_config *m = &c->cfg;
    double per = 1.0 / (double)c->steps_done;
    double ex = (double)(c->map->part_bytes[0] + c->map->part_bytes[1] + c->map->part_bytes[2]);
    double host = (double)(c->hit_shm + c->hit_fetcher + c->from_disk) * ex * per;
    double disk = (double)c->from_disk * ex * per;
    double placed = host; /* read in place over the link; the rest is copied into T0 */
    double hbm = (double)c->hit_t0 * ex * per;
#ifdef SL_HAVE_CUDA
    if (c->t0.n_slot) placed = (double)c->t1_in_place * ex * per;
#endif
    hbm += host - placed; /* filled into T0, then read there */
    double shared = (double)(sl_qtype_row_bytes(c->shape.sh_gate_type, m->dim) * m->moe_inter +
                             sl_qtype_row_bytes(c->shape.sh_up_type, m->dim) * m->moe_inter +
                             sl_qtype_row_bytes(c->shape.sh_down_type, m->moe_inter) * m->dim);
    double resident = (double)depth(c) * ((double)m->n_expert * m->dim * 2.0 + shared);
    hbm += resident;
    double t_hbm = g[CEIL_HBM] > 0 ? hbm / (g[CEIL_HBM] * 1e9) : 0;
    double t_link = (g[CEIL_COPY] > 0 ? (host - placed) / (g[CEIL_COPY] * 1e9) : 0) +
                    (g[CEIL_ZC] > 0 ? placed / (g[CEIL_ZC] * 1e9) : 0);
    double t_disk = g[CEIL_DISK] > 0 ? disk / (g[CEIL_DISK] * 1e9) : 0;
    double floor_s = t_hbm > t_link ? t_hbm : t_link;
    if (t_disk > floor_s) floor_s = t_disk;
    double step_s = (double)c->run_ns / 1e9 * per;
    const char *bound = floor_s == t_disk ? "disk" : floor_s == t_link ? "host link" : "HBM";
    fprintf(out,
            "  byte floor per step: HBM %.1f MB at %.0f GB/s = %.3f ms, host link %.1f MB "
            "(%.1f copied into T0 at %.1f GB/s, %.1f read in place at %.1f GB/s) = %.3f ms, disk "
            "%.1f MB at %.2f GB/s = %.3f ms\n"
            "  step (%u layers) %.3f ms = %.2fx its floor of %.3f ms (%s-bound)\n",
            hbm / 1e6, g[CEIL_HBM], t_hbm * 1e3, host / 1e6, (host - placed) / 1e6, g[CEIL_COPY],
            placed / 1e6, g[CEIL_ZC], t_link * 1e3, disk / 1e6, g[CEIL_DISK], t_disk * 1e3,
            depth(c), step_s * 1e3, floor_s > 0 ? step_s / floor_s : 0.0, floor_s * 1e3, bound);
    /* Every layer moves the same bytes: the floor of 40 layers is the measured one scaled. */
    if (depth(c) < 40 && floor_s > 0 && step_s > 0) {
        const double f40 = floor_s * 40.0 / (double)depth(c), s40 = step40_s(c);
        fprintf(out, "  extrapolated to 40 layers: step %.3f ms = %.2fx its floor of %.3f ms\n",
                s40 * 1e3, s40 / f40, f40 * 1e3);
    }
}

void sl_compute_print_summary(sl_compute *c, FILE *out)
{
    double secs = (double)c->run_ns / 1e9;
    uint64_t total = c->hit_t0 + c->hit_shm + c->hit_fetcher + c->from_disk;
    uint64_t expert_bytes = c->map->part_bytes[0] + c->map->part_bytes[1] + c->map->part_bytes[2];
    double per_step = c->steps_done ? 1.0 / (double)c->steps_done : 0.0;
    fprintf(out,
            "sluice-compute: %" PRIu64 " steps in %.3f s: %.2f tokens/s\n"
            "  experts: %" PRIu64 " asked; T0 hits %.1f%%, T1 hits %.1f%% (%.1f%% from the "
            "shared table, %.1f%% by FETCH), misses %.1f%%; %.3f GB read from disk (mean read "
            "%.0f us)\n"
            "  per step: route %.2f ms, wait %.2f ms, compute %.2f ms; fetcher restarts seen: "
            "%u\n",
            c->steps_done, secs, secs > 0 ? (double)c->steps_done / secs : 0.0, total,
            total ? 100.0 * (double)c->hit_t0 / (double)total : 0.0,
            total ? 100.0 * (double)(c->hit_shm + c->hit_fetcher) / (double)total : 0.0,
            total ? 100.0 * (double)c->hit_shm / (double)total : 0.0,
            total ? 100.0 * (double)c->hit_fetcher / (double)total : 0.0,
            total ? 100.0 * (double)c->from_disk / (double)total : 0.0,
            (double)(c->from_disk * expert_bytes) / 1e9,
            c->from_disk ? (double)c->read_us / (double)c->from_disk : 0.0,
            (double)c->t.route_ns / 1e6 * per_step, (double)c->t.wait_ns / 1e6 * per_step,
            (double)c->t.compute_ns / 1e6 * per_step, sl_fetch_client_reconnects(c->client));
    /* The real model has 40 layers: what a step would cost there (step40_s). */
    if (c->steps_done && c->run_ns && depth(c) < 40) { /* run_ns: the run ended well */
        double ms = step40_s(c) * 1e3;
        fprintf(out, "  extrapolated to 40 layers: %.2f ms per token, %.2f tokens/s\n", ms,
                ms > 0 ? 1000.0 / ms : 0.0);
    }
    if (c->steps_done) {
        double layers = (double)c->steps_done * depth(c);
        const char *sep = "";
        fprintf(out, "  per layer (us):");
        for (int k = 0; k < N_SUB; k++)
            if (c->t.sub_ns[k]) {
                fprintf(out, "%s %s %.1f", sep,
                        c->backend == SL_BACKEND_GPU ? sub_names[k] : sub_names_cpu[k],
                        (double)c->t.sub_ns[k] / 1e3 / layers);
                sep = ",";
            }
        fprintf(out, "\n");
    }
#ifdef SL_HAVE_CUDA
    if (c->t0.n_slot)
        fprintf(out,
                "  T0: %u slots, admission %s: %" PRIu64 " misses copied in, %" PRIu64
                " read in place (%" PRIu64 " left out by the admission)\n",
                c->t0.n_slot, sl_t0cache_admit_name(c->t0.cache.admit), c->t0.cache.fills,
                c->t1_in_place, c->t0.cache.refused);
#endif
    print_floor(c, out);
    if (c->opt.prefetch)
        fprintf(out,
                "  prefetch: %" PRIu64 " hints, %" PRIu64 " useful; covered %.1f%% of the next "
                "layers' misses, %.2f wasted reads per useful one\n",
                c->pf_sent, c->pf_useful,
                c->misses_total ? 100.0 * (double)c->pf_misses_covered / (double)c->misses_total
                                : 0.0,
                c->pf_useful ? (double)(c->pf_sent - c->pf_useful) / (double)c->pf_useful : 0.0);
}
