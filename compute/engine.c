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
    void *shared_dev[3]; /* GPU: the shared expert's blocks */
    sl_moe_expert_w shared_w_dev;
} layer_w;

/* The device tier: whole experts copied from T1 into device slots, with their own
 * eviction policy (common/policy.h). */
typedef struct t0_tier {
    uint32_t n_slot;
    uint8_t *base; /* device memory, n_slot * slot_bytes */
    uint64_t slot_bytes;
    sl_policy *policy;
    uint32_t *slot_of; /* [n_layer * n_expert] T0 slot, NO_SLOT when absent */
    uint32_t *owner;   /* [n_slot] layer * n_expert + expert, NO_SLOT when empty */
    uint8_t *in_use;   /* [n_slot] 1 while the current layer uses it */
} t0_tier;

typedef struct stage_times {
    uint64_t route_ns, wait_ns, compute_ns;
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
    uint16_t *x_dev, *y_dev; /* [dim] bf16 */
    sl_arena *registered;    /* the arena mapping registered with CUDA */
    uint8_t *arena_dev;      /* its device address */
    t0_tier t0;
#endif
    uint64_t hit_t0;
    double *zipf_cdf;    /* [n_expert] cumulative popularity of rank r (synthetic routing) */
    uint32_t *zipf_perm; /* [n_layer][n_expert] expert of rank r in layer l */
    uint64_t step;       /* the step being run */
    /* prefetch: predicted experts of the next layer, and how the guesses fared */
    uint32_t predicted[64];
    uint32_t n_predicted;
    uint64_t pf_sent, pf_useful, pf_misses_covered, misses_total;
    sl_trace *trace;
    FILE *out;
    /* counters */
    uint64_t steps_done;
    uint64_t hit_shm, hit_fetcher, from_disk;
    uint64_t read_us;
    stage_times t;
    uint64_t run_ns;
};

static int synthetic_routing_init(sl_compute *c, sl_err *err);

/* ---------------------------------------------------------------- options */

void sl_compute_options_default(sl_compute_options *o)
{
    memset(o, 0, sizeof *o);
    o->steps = 16;
    o->seed = 1;
    o->timeout_ms = 60000;
    o->backend = SL_BACKEND_AUTO;
    o->cpu = SL_CPU_ANY;
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
    OPT_ZERO_COPY,
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
    {OPT_T0, NULL, "--t0-slots", "N",
     "device expert slots (GPU); 0 = read the host arena in place"},
    {OPT_ZERO_COPY, NULL, "--zero-copy", NULL, "no device tier: kernels read the host arena"},
    {OPT_ROUTING, NULL, "--routing", "MODE",
     "router (default), uniform, or zipf[:S]: synthetic picks for benchmarks"},
    {OPT_PREFETCH, NULL, "--prefetch", NULL,
     "predict the next layer's experts with its router on this layer's input and prefetch them"},
    {OPT_CPU, NULL, "--cpu", "N",
     "pin the decode thread and its ZeroMQ I/O thread to CPU N (lower message latency)"},
    {OPT_QUIET, "-q", "--quiet", NULL, "no banner and no summary"},
    {OPT_HELP, "-h", "--help", NULL, "this help"},
};

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
            break;
        case OPT_ZERO_COPY:
            o->zero_copy = 1;
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
    const uint64_t sh_bytes[3] = {blocks_bytes(c->shape.sh_gate_type, m->dim, m->moe_inter),
                                  blocks_bytes(c->shape.sh_up_type, m->dim, m->moe_inter),
                                  blocks_bytes(c->shape.sh_down_type, m->moe_inter, m->dim)};
    *resident = 0;
    for (uint32_t l = 0; l < m->n_layer && !rc; l++) {
        layer_w *w = &c->layers[l];
        uint64_t rb = (uint64_t)m->n_expert * m->dim * sizeof(uint16_t);
        rc = upload_new(c, w->router, rb, &w->router_dev, err);
        for (int p = 0; p < 3 && !rc; p++)
            rc = upload_new(c, w->shared[p], sh_bytes[p], &w->shared_dev[p], err);
        *resident += rb + sh_bytes[0] + sh_bytes[1] + sh_bytes[2];
        w->shared_w_dev = (sl_moe_expert_w){w->shared_dev[0], w->shared_dev[1], w->shared_dev[2]};
    }
    if (rc || !c->opt.t0_slots || c->opt.zero_copy) return rc;
    t0_tier *t = &c->t0;
    uint64_t n_ent = (uint64_t)m->n_layer * m->n_expert;
    t->n_slot = c->opt.t0_slots < n_ent ? c->opt.t0_slots : (uint32_t)n_ent;
    t->slot_bytes = c->map->layout.slot_bytes;
    rc = sl_gpu_malloc(c->gpu, (void **)&t->base, t->n_slot * t->slot_bytes, err);
    if (!rc) rc = sl_policy_init(&t->policy, SL_POLICY_OLDEST_RANDOM, t->n_slot, 1, err);
    if (rc) return rc;
    t->slot_of = malloc(n_ent * sizeof *t->slot_of);
    t->owner = malloc(t->n_slot * sizeof *t->owner);
    t->in_use = calloc(t->n_slot, 1);
    if (!t->slot_of || !t->owner || !t->in_use) return sl_err_set(err, SL_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < n_ent; i++) t->slot_of[i] = NO_SLOT;
    for (uint32_t i = 0; i < t->n_slot; i++) t->owner[i] = NO_SLOT;
    return 0;
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
        for (int p = 0; p < 3; p++) sl_gpu_free(c->gpu, c->layers[l].shared_dev[p]);
    }
    sl_gpu_free(c->gpu, c->x_dev);
    sl_gpu_free(c->gpu, c->y_dev);
    sl_gpu_free(c->gpu, c->t0.base);
    sl_policy_free(&c->t0.policy);
    free(c->t0.slot_of);
    free(c->t0.owner);
    free(c->t0.in_use);
    sl_gpu_close(&c->gpu);
}

static int t0_busy(void *ctx, uint32_t slot)
{
    return ((const t0_tier *)ctx)->in_use[slot];
}

/* Device pointers of an expert whose bytes sit in a slot laid out like the arena's
 * (T1 read in place, or a T0 copy of such a slot). */
static sl_moe_expert_w slot_parts(sl_compute *c, const uint8_t *slot_dev, uint32_t layer,
                                  uint32_t expert)
{
    const void *part[3];
    for (int p = 0; p < 3; p++) {
        const sl_expert_slice *s = sl_expert_map_slice(c->map, layer, expert, p);
        part[p] = slot_dev + c->map->layout.part_offset[p] + s->offset % c->map->layout.align;
    }
    return (sl_moe_expert_w){part[0], part[1], part[2]};
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
    if (!rc && o->routing != SL_ROUTING_ROUTER) rc = synthetic_routing_init(c, err);
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
    if (w->n_layer != m->n_layer || w->n_expert != m->n_expert) {
        rc = sl_err_set(err, SL_EMISMATCH,
                        "the fetcher serves %u x %u experts, the model has %u x %u", w->n_layer,
                        w->n_expert, m->n_layer, m->n_expert);
        goto fail;
    }
    if (!o->quiet) {
        static const char *const names[] = {"auto", "CPU emulation of the GPU arithmetic",
                                            "CPU f32 reference", "GPU"};
        fprintf(stderr,
                "sluice-compute: %s: %u layers, dim %u, %u experts (top %u) of %u; backend: %s\n"
                "sluice-compute: memory plan: T1 host arena %s, %u slots of %.1f MiB (fetcher at "
                "%s)",
                o->model, m->n_layer, m->dim, m->n_expert, m->n_expert_used, m->moe_inter,
                names[c->backend], w->arena_name, w->slot_count, (double)w->slot_bytes / (1 << 20),
                c->endpoint);
#ifdef SL_HAVE_CUDA
        if (c->backend == SL_BACKEND_GPU)
            fprintf(stderr, "; GPU resident weights %.1f MiB; T0 device tier %u slots (%.1f MiB)%s",
                    (double)resident / (1 << 20), c->t0.n_slot,
                    (double)c->t0.n_slot * (double)c->map->layout.slot_bytes / (1 << 20),
                    c->t0.n_slot ? "" : ", kernels read T1 in place (zero-copy)");
#endif
        fprintf(stderr, "\n");
    }
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
    free(c->embd_row);
    free(c->f32);
    free(c->logits);
    free(c->h);
    free(c->x);
    free(c->y);
    free(c->experts);
    free(c->zipf_cdf);
    free(c->zipf_perm);
    sl_expert_map_free(&c->map);
    sl_gguf_close(&c->gguf);
    free(c);
    *pc = NULL;
}

/* ---------------------------------------------------------------- one step */

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* h = the embedding row of the step's token. */
static int embed(sl_compute *c, uint64_t step, sl_err *err)
{
    uint32_t token = (uint32_t)(splitmix64(c->opt.seed * 1000003u + step) % c->cfg.vocab);
    uint64_t row = sl_qtype_row_bytes(c->embd->type, c->cfg.dim);
    const sl_gguf_shard *sh = &c->gguf->shards[c->embd->shard];
    uint64_t off = c->embd->offset + (uint64_t)token * row;
    if (pread(sh->fd, c->embd_row, row, (off_t)off) != (ssize_t)row)
        return sl_err_errno(err, SL_EIO, errno, "pread(%s, off %" PRIu64 ", len %" PRIu64 ")",
                            sh->path, off, row);
    sl_quant_decode(c->embd->type, c->embd_row, c->f32, c->cfg.dim);
    for (uint32_t i = 0; i < c->cfg.dim; i++) c->h[i] = sl_f32_to_bf16(c->f32[i]);
    return 0;
}

/* x = bf16(w * (h * rsqrt(mean(h^2) + eps))), all f32 (MODEL.md §2.1). */
static void ffn_norm(sl_compute *c, const float *w)
{
    uint32_t n = c->cfg.dim;
    float ss = 0.0f;
    for (uint32_t i = 0; i < n; i++) {
        float v = sl_bf16_to_f32(c->h[i]);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)n + c->cfg.norm_eps);
    for (uint32_t i = 0; i < n; i++) c->x[i] = sl_f32_to_bf16(w[i] * (sl_bf16_to_f32(c->h[i]) * r));
}

/* Points the expert table at the pinned slots: each part's bytes start `skip` bytes
 * into its region, skip being the slice's file offset modulo the alignment. */
static void bind_experts(sl_compute *c, uint32_t layer, const sl_fetch_pin *pins, uint32_t n)
{
    sl_arena *a = sl_fetch_client_arena(c->client);
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *slot = sl_arena_slot_data(a, pins[i].slot);
        const void *part[3];
        for (int p = 0; p < 3; p++) {
            const sl_expert_slice *s = sl_expert_map_slice(c->map, layer, pins[i].expert, p);
            part[p] = slot + a->hdr->part_offset[p] + s->offset % a->hdr->align;
        }
        c->experts[pins[i].expert] = (sl_moe_expert_w){part[0], part[1], part[2]};
    }
}

/* Tables of the synthetic routings: popularity by rank (uniform is Zipf with s = 0)
 * and a fixed random ranking of the experts of each layer. */
static int synthetic_routing_init(sl_compute *c, sl_err *err)
{
    uint32_t n = c->cfg.n_expert;
    c->zipf_cdf = malloc(sizeof(double) * n);
    c->zipf_perm = malloc(sizeof(uint32_t) * n * c->cfg.n_layer);
    if (!c->zipf_cdf || !c->zipf_perm) return sl_err_set(err, SL_ENOMEM, "out of memory");
    double s = c->opt.routing == SL_ROUTING_ZIPF ? c->opt.zipf_s : 0.0, sum = 0.0;
    for (uint32_t r = 0; r < n; r++) c->zipf_cdf[r] = sum += pow((double)r + 1.0, -s);
    for (uint32_t r = 0; r < n; r++) c->zipf_cdf[r] /= sum;
    for (uint32_t l = 0; l < c->cfg.n_layer; l++) {
        uint32_t *p = c->zipf_perm + (uint64_t)l * n;
        uint64_t state = c->opt.seed * 0x9e3779b97f4a7c15ull + l;
        for (uint32_t r = 0; r < n; r++) p[r] = r;
        for (uint32_t r = n - 1; r > 0; r--) {
            state = splitmix64(state);
            uint32_t k = (uint32_t)(state % (r + 1));
            uint32_t t = p[r];
            p[r] = p[k];
            p[k] = t;
        }
    }
    return 0;
}

/* Replaces the router's picks with n_used distinct experts drawn from the synthetic
 * popularity, deterministically from (seed, step, layer). */
static void synthetic_route(sl_compute *c, uint32_t l, sl_moe_route *route)
{
    uint32_t n = c->cfg.n_expert, used = c->shape.n_used;
    uint64_t state = splitmix64(c->opt.seed ^ (c->step * 0x100000001b3ull) ^ ((uint64_t)l << 48));
    memset(route, 0, sizeof *route);
    for (uint32_t i = 0; i < used;) {
        state = splitmix64(state);
        double u = (double)(state >> 11) / 9007199254740992.0;
        uint32_t lo = 0, hi = n - 1;
        while (lo < hi) {
            uint32_t mid = (lo + hi) / 2;
            if (c->zipf_cdf[mid] > u)
                hi = mid;
            else
                lo = mid + 1;
        }
        uint32_t e = c->zipf_perm[(uint64_t)l * n + lo];
        int dup = 0;
        for (uint32_t k = 0; k < i; k++) dup |= route->expert[k] == e;
        if (dup) continue;
        route->expert[i] = e;
        route->weight[i] = c->shape.route_scale / (float)used;
        i++;
    }
}

/* Route x: the router GEMV on the device that computes the layer, the selection on
 * the CPU in the reference's order. */
static int route_x(sl_compute *c, layer_w *w, sl_moe_route *route, sl_err *err)
{
#ifdef SL_HAVE_CUDA
    if (c->backend == SL_BACKEND_GPU) {
        int rc = sl_gpu_upload(c->gpu, c->x_dev, c->x, c->cfg.dim * sizeof(uint16_t), err);
        /* The shared expert needs no routing: it runs on the side stream while the
         * router's logits come back and the picks are gathered. */
        if (!rc) rc = sl_gpu_moe_shared(c->gpu, c->x_dev, &w->shared_w_dev, err);
        if (!rc) rc = sl_gpu_router_logits(c->gpu, c->x_dev, w->router_dev, c->logits, err);
        if (!rc) rc = sl_router_select(c->logits, w->bias, &c->shape, route, err);
        return rc;
    }
#endif
    return sl_router_route(c->x, &w->moe, &c->shape, c->logits, route, err);
}

/* Gets the picked experts that the device tier does not hold from the fetcher (pins
 * in pins[0..*n_pins)), and fills c->by_rank with the pointers the backend reads. */
static int gather(sl_compute *c, uint32_t l, const sl_moe_route *route, sl_fetch_pin *pins,
                  uint32_t *n_pins, sl_err *err)
{
    uint32_t n = c->shape.n_used, want[64], rank_of[64];
    *n_pins = 0;
    for (uint32_t i = 0; i < n; i++) {
#ifdef SL_HAVE_CUDA
        t0_tier *t = &c->t0;
        if (t->n_slot) {
            uint32_t slot = t->slot_of[(uint64_t)l * c->cfg.n_expert + route->expert[i]];
            if (slot != NO_SLOT) {
                t->in_use[slot] = 1;
                sl_policy_touch(t->policy, slot);
                c->by_rank[i] = slot_parts(c, t->base + slot * t->slot_bytes, l, route->expert[i]);
                c->hit_t0++;
                continue;
            }
        }
#endif
        rank_of[*n_pins] = i;
        want[(*n_pins)++] = route->expert[i];
    }
    if (!*n_pins) return 0;
    int rc = sl_fetch_client_get(c->client, l, want, *n_pins, pins, c->opt.timeout_ms, err);
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
    sl_arena *a = sl_fetch_client_arena(c->client);
    bind_experts(c, l, pins, *n_pins); /* host views, c->experts[expert] */
    for (uint32_t k = 0; k < *n_pins; k++) {
        uint32_t i = rank_of[k];
        c->by_rank[i] = c->experts[want[k]];
#ifdef SL_HAVE_CUDA
        if (c->backend != SL_BACKEND_GPU) continue;
        const uint8_t *host_slot = sl_arena_slot_data(a, pins[k].slot);
        t0_tier *t = &c->t0;
        if (t->n_slot) {
            /* Into the device tier: a whole slot, so the layout stays the arena's. */
            int64_t v = sl_policy_victim(t->policy, t0_busy, t);
            if (v >= 0) {
                uint32_t slot = (uint32_t)v;
                if (t->owner[slot] != NO_SLOT) t->slot_of[t->owner[slot]] = NO_SLOT;
                rc = sl_gpu_upload(c->gpu, t->base + slot * t->slot_bytes, host_slot, t->slot_bytes,
                                   err);
                if (rc) return rc;
                t->owner[slot] = l * c->cfg.n_expert + want[k];
                t->slot_of[t->owner[slot]] = slot;
                t->in_use[slot] = 1;
                sl_policy_touch(t->policy, slot);
                c->by_rank[i] = slot_parts(c, t->base + slot * t->slot_bytes, l, want[k]);
                continue;
            }
        }
        /* Zero-copy: the kernels read the pinned host slot in place. */
        rc = ensure_registered(c, err);
        if (rc) return rc;
        c->by_rank[i] = slot_parts(c, c->arena_dev + (host_slot - a->base), l, want[k]);
#else
        (void)a;
#endif
    }
    return 0;
}

/* y = the layer's experts on x, with the backend in use. */
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
        int rc = sl_gpu_moe_routed(c->gpu, c->x_dev, route, c->by_rank, c->y_dev, NULL, err);
        /* The download waits for the kernels: only then may the pins go back. */
        if (!rc) rc = sl_gpu_download(c->gpu, c->y, c->y_dev, c->cfg.dim * sizeof(uint16_t), err);
        return rc;
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

static int layer_step(sl_compute *c, uint32_t l, sl_err *err)
{
    layer_w *w = &c->layers[l];
    uint64_t t0 = sl_now_ns();
    ffn_norm(c, w->ffn_norm);
    sl_moe_route route;
    int rc = route_x(c, w, &route, err);
    if (rc) return rc;
    if (c->opt.routing != SL_ROUTING_ROUTER) synthetic_route(c, l, &route);
    uint64_t t1 = sl_now_ns();
    sl_fetch_pin pins[64];
    uint32_t n_pins = 0;
    rc = gather(c, l, &route, pins, &n_pins, err);
    if (!rc && c->opt.prefetch) {
        score_prediction(c, &route, pins, n_pins);
        rc = predict_next(c, l, err);
    }
    uint64_t t2 = sl_now_ns();
    if (!rc) rc = experts(c, w, &route, err);
    if (n_pins) sl_fetch_client_put(c->client, pins, n_pins, NULL);
#ifdef SL_HAVE_CUDA
    if (c->t0.n_slot) memset(c->t0.in_use, 0, c->t0.n_slot);
#endif
    if (rc) return sl_err_prefix(err, "layer %u", l);
    for (uint32_t i = 0; i < c->cfg.dim; i++)
        c->h[i] = sl_f32_to_bf16(sl_bf16_to_f32(c->h[i]) + sl_bf16_to_f32(c->y[i]));
    uint64_t t3 = sl_now_ns();
    c->t.route_ns += t1 - t0;
    c->t.wait_ns += t2 - t1;
    c->t.compute_ns += t3 - t2;
    sl_trace_add(c->trace, "route", (int32_t)l, -1, 0, t0, t1);
    sl_trace_add(c->trace, "wait", (int32_t)l, -1, 0, t1, t2);
    sl_trace_add(c->trace, "compute", (int32_t)l, -1, 0, t2, t3);
    return 0;
}

int sl_compute_run(sl_compute *c, sl_err *err)
{
    uint64_t start = sl_now_ns();
    for (uint64_t s = 0; s < c->opt.steps; s++) {
        c->step = s;
        int rc = embed(c, s, err);
        for (uint32_t l = 0; l < c->cfg.n_layer && !rc; l++) rc = layer_step(c, l, err);
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
    /* The real model has 40 layers: what a step would cost there at this per-layer time. */
    if (c->steps_done && c->cfg.n_layer < 40) {
        double layer_ms = (double)(c->t.route_ns + c->t.wait_ns + c->t.compute_ns) / 1e6 *
                          per_step / (double)c->cfg.n_layer;
        fprintf(out, "  extrapolated to 40 layers: %.2f ms per token, %.2f tokens/s\n",
                layer_ms * 40.0, layer_ms > 0 ? 1000.0 / (layer_ms * 40.0) : 0.0);
    }
    if (c->opt.prefetch)
        fprintf(out,
                "  prefetch: %" PRIu64 " hints, %" PRIu64 " useful; covered %.1f%% of the next "
                "layers' misses, %.2f wasted reads per useful one\n",
                c->pf_sent, c->pf_useful,
                c->misses_total ? 100.0 * (double)c->pf_misses_covered / (double)c->misses_total
                                : 0.0,
                c->pf_useful ? (double)(c->pf_sent - c->pf_useful) / (double)c->pf_useful : 0.0);
}
