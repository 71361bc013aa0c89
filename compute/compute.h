/* compute.h - sluice-compute: the decode loop of the compute process.
 *
 * Connects to sluice-fetcher (ipc/client.h), maps its arena, loads the resident
 * weights of every layer it runs, and runs decode steps. Until attention lands the
 * layer body is the MoE part alone (DESIGN.md "One decode step"):
 *
 *   h (bf16 [dim], the residual stream) starts as the token's embedding row;
 *   per layer: x = ffn_norm(h); route x; get the picked experts (shared-table hits
 *   without a message, misses by FETCH); y = routed experts + shared expert;
 *   h = bf16(h + y); give the pins back.
 *
 * One step's output is the final h. Outputs never depend on which tier served an
 * expert, on the order misses arrived, on cache sizes or on a fetcher restart.
 * One thread drives everything; not thread-safe.
 */
#ifndef SL_COMPUTE_H
#define SL_COMPUTE_H

#include <stdint.h>
#include <stdio.h>

#include "err.h"

enum sl_compute_backend {
    SL_BACKEND_AUTO = 0, /* the GPU when one is present, else the CPU emulation */
    SL_BACKEND_CPU = 1,  /* the CPU emulation of the GPU arithmetic (compute/moe_emu.h):
                            the same bytes out as the GPU */
    SL_BACKEND_REF = 2,  /* the plain f32 CPU reference (compute/moe_ref.h): the oracle */
    SL_BACKEND_GPU = 3,  /* the CUDA kernels (compute/gpu.h) */
};

/* Who picks the experts. The router always runs (its cost is part of a step); the
 * synthetic modes replace its picks so that benchmarks control the popularity of
 * experts, which random synthetic weights do not. Weights are then route_scale /
 * n_used each. */
enum sl_compute_routing {
    SL_ROUTING_ROUTER = 0,  /* the model's router (default) */
    SL_ROUTING_UNIFORM = 1, /* n_used distinct experts drawn uniformly */
    SL_ROUTING_ZIPF = 2,    /* expert of popularity rank r drawn with weight 1/(r+1)^s, the
                               ranking a fixed random permutation per layer */
};

typedef struct sl_compute_options {
    const char *model;      /* -m: any shard of the checkpoint */
    const char *endpoint;   /* --endpoint; NULL = the model's default ipc endpoint */
    uint32_t steps;         /* -n: decode steps */
    uint64_t seed;          /* --seed: picks the tokens of the steps */
    const char *out_path;   /* --out: every step's h, bf16 little-endian, appended */
    const char *trace_path; /* --trace: Chrome trace JSON of this process */
    uint32_t timeout_ms;    /* --timeout: longest wait for one layer's experts */
    int backend;            /* enum sl_compute_backend (--backend) */
    uint32_t t0_slots;      /* --t0-slots: device expert slots (GPU); 0 = read T1 in place */
    uint64_t t0_bytes;      /* --t0 SIZE: the device tier's budget in bytes instead */
    int t0_given;           /* 1 when --t0 or --t0-slots was given; otherwise the tier is
                               sized automatically: none on a GPU that shares the host's
                               memory, else free device memory less a reserve */
    int t0_preload;         /* --t0-preload: fill the device tier before the first step */
    int t0_admit;           /* --t0-admit: enum sl_t0_admit (t0cache.h), which misses T0
                               takes in (default: freq) */
    int zero_copy;          /* --zero-copy: no T0 even on a discrete GPU */
    int norm_kernel;        /* --norm-kernel: the residual and the norm in a kernel of their
                               own, not inside the router (comparisons) */
    uint32_t warmup;        /* --warmup N: steps run before the counters and clocks start */
    uint32_t passes;        /* --layer-passes N: each step runs the checkpoint's layers N
                               times (a benchmark of a deeper model on a small checkpoint:
                               4 layers x 10 = the real model's 40, measured instead of
                               extrapolated; the synthetic routings pick anew each pass) */
    double ceiling_gbs[4];  /* --ceilings: GB/s of HBM reads, host->device copies, zero-copy
                               reads and the disk (0 = not known), for the byte floors */
    int routing;            /* --routing: enum sl_compute_routing */
    float zipf_s;           /* --routing zipf:S exponent (default 1.0) */
    int prefetch;           /* --prefetch: the next layer's router on this layer's input
                               predicts its experts, PREFETCHed at low priority (off by
                               default until it is measured to win) */
    int cpu;                /* --cpu N: pin the driving thread and the fetch client's ZeroMQ
                               I/O thread to CPU N (SL_CPU_ANY = no pinning) */
    int quiet;              /* -q: no banner, no per-run summary */
} sl_compute_options;

void sl_compute_options_default(sl_compute_options *o);

/* Fills o from argv. Returns 0, 1 when --help was printed to out, or SL_EINVAL with a
 * one-line message. */
int sl_compute_parse_args(sl_compute_options *o, int argc, char **argv, FILE *out, sl_err *err);

/* Device memory the automatic device tier leaves free: the larger of this and 5%. */
#define SL_COMPUTE_T0_RESERVE (2ull << 30)

/* Slots of the device tier for these options on a GPU with free_bytes of total_bytes
 * free: none with --zero-copy, the flags' budget when given, none on a GPU sharing host
 * memory, else free memory less the reserve; never more than n_experts. *why says which
 * (for the memory plan). Pure: the engine's sizing, exposed for its tests. */
uint32_t sl_compute_t0_slots(const sl_compute_options *o, uint64_t free_bytes, uint64_t total_bytes,
                             int shares_host_memory, uint64_t slot_bytes, uint64_t n_experts,
                             const char **why);

typedef struct sl_compute sl_compute;

/* Opens the checkpoint, loads the resident weights and connects to the fetcher
 * (waiting for one to answer). The caller owns *out. */
int sl_compute_open(sl_compute **out, const sl_compute_options *o, sl_err *err);

/* Runs o->steps decode steps; writes outputs as it goes. */
int sl_compute_run(sl_compute *c, sl_err *err);

/* Tokens/s, hits per tier, bytes read, ms per stage. */
void sl_compute_print_summary(sl_compute *c, FILE *out);

void sl_compute_close(sl_compute **c);

#endif
