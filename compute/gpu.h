/* gpu.h - the plain C face of sluice's CUDA code.
 *
 * Everything CUDA lives in the .cu files of compute/, behind this header; host code never sees a
 * CUDA type. Each entry checks its arguments and every CUDA call, and reports
 * failures through sl_err. No entry keeps global mutable state: what the kernels
 * need lives in an sl_gpu_ctx. docs/kernels.md describes the arithmetic.
 */
#ifndef SL_GPU_H
#define SL_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "quant.h"
#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices usable by this process; 0 (and success) when there is no
 * GPU or no driver, so that callers and tests can skip cleanly. */
int sl_gpu_device_count(int *n, sl_err *err);

/* One line describing device `dev` (name, compute capability, memory) into buf. */
int sl_gpu_describe(int dev, char *buf, unsigned long len, sl_err *err);

/* Device memory now, and whether the GPU shares the host's memory (integrated, or
 * coherent with host page tables as on GH200/GB10): there the kernels read the host
 * arena in place and a device tier would only copy memory into itself. */
typedef struct sl_gpu_mem {
    uint64_t free_bytes, total_bytes;
    int shares_host_memory;
} sl_gpu_mem;
int sl_gpu_mem_info(int dev, sl_gpu_mem *out, sl_err *err);

/* Ceilings of the memory paths on device dev, in bytes per second, measured with
 * plain kernels and copies (best of several runs; each costs tens of ms):
 * hbm: a kernel reading `bytes` of device memory with 16-byte loads;
 * copy: cudaMemcpy of `bytes` from pinned/registered host memory `host` to the device;
 * zero_copy: a kernel reading `host` in place through its mapped device address;
 * checksum (nullable): the XOR of every 32-bit word it read, sl_gpu_read_xor_cpu's
 * result when every byte arrived. */
int sl_gpu_ceiling_hbm(int dev, size_t bytes, double *hbm, sl_err *err);
int sl_gpu_ceiling_host(int dev, const void *host, size_t bytes, double *copy, double *zero_copy,
                        unsigned *checksum, sl_err *err);

/* The CPU twin of the ceiling kernels' checksum: XOR of the n 32-bit words at p. */
static inline unsigned sl_gpu_read_xor_cpu(const void *p, size_t bytes)
{
    const unsigned *w = (const unsigned *)p;
    unsigned x = 0;
    for (size_t i = 0; i < bytes / 4; i++) x ^= w[i];
    return x;
}

/* ---- context ---- */

/* Most experts per token one launch handles (V4.1 picks 6). */
#define SL_GPU_MAX_USED 8

/* Everything the MoE kernels of one layer shape need on one device: two streams
 * (main, and a side stream for the shared expert), events, and scratch sized at
 * open. One thread drives a context; contexts are independent. */
typedef struct sl_gpu_ctx sl_gpu_ctx;

/* Opens a context on device dev for layers of `shape` (dim and inter multiples of
 * 256, dim <= 12288, inter <= 4608, n_used <= SL_GPU_MAX_USED, routed Q2_K/Q2_K/Q3_K,
 * shared Q2_K/Q2_K/Q3_K or BF16). Costs a few ms (streams, scratch, occupancy). */
int sl_gpu_open(sl_gpu_ctx **ctx, int dev, const sl_moe_shape *shape, sl_err *err);

/* Waits for the context's work, frees everything, sets *ctx to NULL. NULL is fine. */
void sl_gpu_close(sl_gpu_ctx **ctx);

/* Device memory and transfers (for the engine's resident weights, tests, benches).
 * upload/download are synchronous with respect to the context's main stream. */
int sl_gpu_malloc(sl_gpu_ctx *ctx, void **dev, size_t bytes, sl_err *err);
void sl_gpu_free(sl_gpu_ctx *ctx, void *dev);
int sl_gpu_upload(sl_gpu_ctx *ctx, void *dev, const void *host, size_t bytes, sl_err *err);
int sl_gpu_download(sl_gpu_ctx *ctx, void *host, const void *dev, size_t bytes, sl_err *err);

/* Q3_K down projections in device memory are kept in the tiled layout (SL_Q3K_TB,
 * moe_emu.h: each block of 8 consecutive rows in 896 bytes, laid out for the down
 * kernel's lanes, as long as 8 blocks of 112 bytes); in registered host memory (T1,
 * zero-copy) they stay raw. The MoE calls below take a Q3_K down in device memory as
 * tiled and one in host memory as raw: put every device copy there with these (a raw
 * device copy computes garbage). sl_gpu_packed_bytes: the device bytes of raw_bytes of
 * Q3_K blocks. upload_down: tiles raw_bytes (whole 8-row tiles of the context's down
 * rows, inter / 256 blocks a row) from host into dev (16-byte aligned), waiting;
 * upload_down_async: the same, at most one down of the context's shape, under
 * sl_gpu_upload_async's rules (host pinned or registered): the copy stream brings the
 * raw blocks into one of a few stages allocated at open, and the main stream tiles them
 * (sl_emu_pack_q3_k_tb's bytes) when sl_gpu_moe_part, sl_gpu_moe_finish,
 * sl_gpu_route_start, sl_gpu_upload_down or sl_gpu_sync next waits for the copies, so
 * that the tiling waits for no SM a kernel holds; a stage is reused once its tiling
 * has run. */
uint64_t sl_gpu_packed_bytes(uint64_t raw_bytes);
int sl_gpu_upload_down(sl_gpu_ctx *ctx, void *dev, const void *host, uint64_t raw_bytes,
                       sl_err *err);
int sl_gpu_upload_down_async(sl_gpu_ctx *ctx, void *dev, const void *host, uint64_t raw_bytes,
                             sl_err *err);

/* Registers host memory (e.g. the POSIX shm arena) as mapped and portable, so that
 * kernels read it in place; *dev is the device address of host. */
int sl_gpu_host_register(void *host, size_t bytes, void **dev, sl_err *err);
int sl_gpu_host_unregister(void *host, sl_err *err);

/* Waits for everything queued on the context's streams. */
int sl_gpu_sync(sl_gpu_ctx *ctx, sl_err *err);

/* ---- MoE layer (DESIGN.md "One decode step") ----
 * All pointers named *_dev, and the weights, are device-visible (device memory or
 * registered host memory), 16-byte aligned. Calls queue work and return without
 * waiting, except sl_gpu_router_logits, which waits for its logits. */

/* q8_1 of n (multiple of 32) bf16 values into n/32 blocks (the sl_block_q8_1 rules,
 * bit-exact with sl_quant_q8_1 of the widened values). Main stream. */
int sl_gpu_quant_q8_1(sl_gpu_ctx *ctx, const uint16_t *x_dev, uint32_t n, sl_block_q8_1 *dst_dev,
                      sl_err *err);

/* The residual and the next layer's ffn_norm on the main stream (sl_emu_residual_norm's
 * arithmetic, bit for bit): h_dev = bf16(h_dev + y_dev) unless y_dev is NULL, then,
 * unless w_dev ([dim] f32) is NULL, x_dev = bf16(w * h * rsqrt(mean(h^2) + eps)). The
 * residual stream stays on the device between layers. */
int sl_gpu_residual_norm(sl_gpu_ctx *ctx, uint16_t *h_dev, const uint16_t *y_dev,
                         const float *w_dev, float eps, uint16_t *x_dev, sl_err *err);

/* h_dev [dim] bf16 = row `row` of a Q2_K embedding table in device memory (dim / 256
 * blocks a row), decoded as sl_emu_embed_q2_k (bit for bit); queued, nothing waits. */
int sl_gpu_embed_q2_k(sl_gpu_ctx *ctx, const void *table_dev, uint32_t row, uint16_t *h_dev,
                      sl_err *err);

/* Router logits of x_dev [dim] bf16 against router_dev [n_expert][dim] bf16, in
 * sl_router_logits' order, divided by gate_temp; waits and copies them into
 * logits[n_expert] (host). */
int sl_gpu_router_logits(sl_gpu_ctx *ctx, const uint16_t *x_dev, const uint16_t *router_dev,
                         float *logits, sl_err *err);

/* The same in two halves, so that the host can queue other work (the shared expert)
 * while the GEMV runs and its logits come back: start queues the GEMV and the download
 * on the main stream; wait blocks until the logits are on the host (everything queued
 * on the main stream before start has then completed) and copies them out. */
int sl_gpu_router_start(sl_gpu_ctx *ctx, const uint16_t *x_dev, const uint16_t *router_dev,
                        sl_err *err);
int sl_gpu_router_wait(sl_gpu_ctx *ctx, float *logits, sl_err *err);

/* ---- routing on the device (no host between the router and the first experts) ----
 *
 * One layer's picks computed by the GPU with router.c's rules bit for bit (scores by
 * router/score.h; the CPU backends and the tests get the same experts and weights
 * from sl_router_select), and the gate/up of the picks that the device tier already
 * holds queued behind them, before the host has seen the picks.
 *
 * The device tier's table: one entry per (layer, expert), the expert's three parts in
 * device memory, or gate NULL when the tier does not hold it. It lives in device
 * memory owned by the caller (zeroed: sl_gpu_malloc + sl_gpu_t0_set, or an upload of
 * zeroes) and changes only through sl_gpu_t0_set, queued on the main stream, so that
 * each sl_gpu_route_start sees the table as the host had it when it queued the call. */
typedef struct sl_gpu_t0e {
    const void *gate, *up, *down;
} sl_gpu_t0e;

/* Queues table[index[i]] = value[i] for i < n (n <= 16 per call) on the main stream. */
int sl_gpu_t0_set(sl_gpu_ctx *ctx, sl_gpu_t0e *table_dev, const uint32_t *index,
                  const sl_gpu_t0e *value, uint32_t n, sl_err *err);

/* Queues the router GEMV of x_dev against router_dev (as sl_gpu_router_start), the
 * selection with bias_dev ([n_expert] f32, nullable) and, when t0_dev (the layer's
 * [n_expert] entries, nullable) is given, the gate/up of the picks it holds. forced
 * (nullable): picks and weights to use instead of the router's (synthetic routings;
 * the router and the selection still run). Then sl_gpu_route_wait. */
int sl_gpu_route_start(sl_gpu_ctx *ctx, const uint16_t *x_dev, const uint16_t *router_dev,
                       const float *bias_dev, const sl_gpu_t0e *t0_dev, const sl_moe_route *forced,
                       sl_err *err);

/* The previous layer's residual and this layer's ffn_norm, as sl_gpu_residual_norm
 * computes them, handed to sl_gpu_route_start_norm. */
typedef struct sl_gpu_norm {
    const uint16_t *h; /* the residual stream [dim] bf16 */
    const uint16_t *y; /* the last layer's output, added to it; NULL: no residual */
    uint16_t *h_out;   /* gets bf16(h + y) when y is given; not h (the router's CTAs all read h) */
    const float *w;    /* ffn_norm [dim] f32 */
    float eps;
} sl_gpu_norm;

/* sl_gpu_route_start whose router computes x_dev itself from norm: each of its CTAs
 * adds the residual and takes the norm (the same bits as sl_gpu_residual_norm, then
 * sl_gpu_route_start), so a layer has one kernel and one kernel boundary fewer. The
 * shared expert must not have been queued on the side stream (it would read x_dev
 * before it is computed): see sl_gpu_moe_shared_merges. */
int sl_gpu_route_start_norm(sl_gpu_ctx *ctx, const sl_gpu_norm *norm, uint16_t *x_dev,
                            const uint16_t *router_dev, const float *bias_dev,
                            const sl_gpu_t0e *t0_dev, const sl_moe_route *forced, sl_err *err);

/* Waits for the picks: route (experts and weights by rank, zero past n_used) and
 * *started (bit r: rank r's gate/up is queued from the device tier). Starts the token
 * as sl_gpu_moe_begin would, with those ranks queued: sl_gpu_moe_part the others, then
 * sl_gpu_moe_finish. */
int sl_gpu_route_wait(sl_gpu_ctx *ctx, sl_moe_route *route, uint32_t *started, sl_err *err);

/* The device's selection alone, for tests: logits (host, [n_expert]) in, route out. */
int sl_gpu_select(sl_gpu_ctx *ctx, const float *logits, const float *bias_dev, sl_moe_route *route,
                  sl_err *err);

/* The shared expert of x_dev for the next routed call, whose sum adds its output last.
 * A K-quant one in device memory runs with the routed experts (one more entry in
 * their gate/up and down launches; nothing is queued now); a BF16 one, or one in host
 * memory, is queued now on the side stream (after the work on the main stream, which
 * produced x). */
int sl_gpu_moe_shared(sl_gpu_ctx *ctx, const uint16_t *x_dev, const sl_moe_expert_w *shared,
                      sl_err *err);

/* 1 when sl_gpu_moe_shared would merge this shared expert into the routed launches
 * (queueing nothing), 0 when it would queue it on the side stream. */
int sl_gpu_moe_shared_merges(const sl_gpu_ctx *ctx, const sl_moe_expert_w *shared);

/* Queues the routed experts of one token on the main stream: route (experts and
 * weights by rank) and w[n_used] (their device-visible weights by rank). Experts are
 * run and summed in increasing expert id, then the shared expert if one was queued
 * since the last call; out_dev [dim] bf16, out_f32_dev [dim] (nullable) the f32 sum. */
int sl_gpu_moe_routed(sl_gpu_ctx *ctx, const uint16_t *x_dev, const sl_moe_route *route,
                      const sl_moe_expert_w *w, uint16_t *out_dev, float *out_f32_dev, sl_err *err);

/* The same work split so that the engine can start the experts it holds while the
 * others are read ("hits first"); sl_gpu_moe_routed = begin + part(every rank) +
 * finish, and the output bytes do not depend on how the ranks were split or ordered.
 * Weights in device memory go through bulk-copy kernels, weights in registered host
 * memory through register-staged ones (chosen per expert by a driver pointer lookup).
 *
 * Starts one token's routed experts: route (experts and weights by rank), x_dev [dim]
 * bf16. Queues nothing. */
int sl_gpu_moe_begin(sl_gpu_ctx *ctx, const uint16_t *x_dev, const sl_moe_route *route,
                     sl_err *err);

/* Queues gate/up + SwiGLU of ranks[0..n) whose weights are w_by_rank[rank] (entries of
 * other ranks are ignored); may be called several times, each rank exactly once. The
 * weights must stay valid until the work finishes (sl_gpu_sync or a later download). */
int sl_gpu_moe_part(sl_gpu_ctx *ctx, const uint32_t *ranks, uint32_t n,
                    const sl_moe_expert_w *w_by_rank, sl_err *err);

/* Queues q8_1 of h and the down projections of the experts queued so far (each
 * expert's rows kept apart), so that a token whose last experts arrive late (a copy, a
 * read) ends with only their down and the sum: call it before queueing those. Does
 * nothing when a down queued so far sits in host memory (that kernel sums in one go);
 * after it, every down of the token goes through the bulk-copy kernel, host memory
 * included (slower there, the same bits). The output bytes are the same with or
 * without it. */
int sl_gpu_moe_down_early(sl_gpu_ctx *ctx, sl_err *err);

/* After every rank was queued: q8_1 of h, down, the sum in increasing expert id, plus
 * the shared expert if one was queued since the last token; out_dev [dim] bf16,
 * out_f32_dev [dim] (nullable) the f32 sum. */
int sl_gpu_moe_finish(sl_gpu_ctx *ctx, uint16_t *out_dev, float *out_f32_dev, sl_err *err);

/* Drops the token in flight, after a failure between sl_gpu_route_start or
 * sl_gpu_moe_begin and sl_gpu_moe_finish (or a token the caller gives up): waits for
 * everything queued on the context's streams, so that no queued work still reads the
 * token's weights or scratch, then forgets the token, its routing and a shared expert
 * not yet run, so that the next sl_gpu_route_start or sl_gpu_moe_begin starts clean.
 * Nothing queued is undone: the dropped token's outputs are undefined. Returns the
 * wait's error (the state is reset either way). */
int sl_gpu_moe_abort(sl_gpu_ctx *ctx, sl_err *err);

/* cudaMemcpyAsync host -> device (host pinned or registered, e.g. an arena slot) on the
 * context's copy stream, so that it runs beside the kernels; returns without waiting.
 * Work queued later through this context (sl_gpu_moe_part, _finish, sl_gpu_route_start)
 * sees the bytes. The copy starts once the work queued up to the last
 * sl_gpu_moe_finish has completed: the caller must not copy into memory that work of
 * the token in flight reads (the engine never evicts a slot its layer uses). */
int sl_gpu_upload_async(sl_gpu_ctx *ctx, void *dev, const void *host, size_t bytes, sl_err *err);

/* ---- timeline marks (tracing) ----
 * Events recorded on the main stream and read back as CLOCK_MONOTONIC times, so that
 * the GPU's own spans (copies, kernels) sit in the trace beside the host's. A batch
 * starts with an anchor (waits for the stream), takes up to SL_GPU_MARKS - 1 marks,
 * and ends with sl_gpu_marks_read (waits for the last mark). */
#define SL_GPU_MARKS 4096
int sl_gpu_mark_anchor(sl_gpu_ctx *ctx, sl_err *err);
/* *id: the mark's index in the batch (1, 2, ...). SL_ENOMEM when the batch is full.
 * sl_gpu_mark_copy marks the copy stream instead (sl_gpu_upload_async's copies). */
int sl_gpu_mark(sl_gpu_ctx *ctx, uint32_t *id, sl_err *err);
int sl_gpu_mark_copy(sl_gpu_ctx *ctx, uint32_t *id, sl_err *err);
/* ns[0..*n): the batch's times (ns[0] the anchor's); the batch is then over. */
int sl_gpu_marks_read(sl_gpu_ctx *ctx, uint64_t *ns, uint32_t *n, sl_err *err);

/* Bench hook, all zero for the defaults: plain_start 1 has the host-table bulk-copy
 * gate/up queue every stage at once (default: one stage a warp group first, the group's
 * others once it landed); wait_select 1 has the device-table gate/up wait for the whole
 * selection kernel (default: for the table it publishes, k_route_select); qh_form 1
 * has h's q8_1 computed by k_quant_h after the gate/up, 3 and 4 by the bulk-copy
 * gate/ups themselves in the two ways of compute/moe_kern.cuh (default, 0: compute/'s
 * choice, GT_QH); gu_stamps
 * and dn_stamps (NULL: none) are device buffers of `records` records each that receive
 * the gate/up's and the down's milestones on the GPU's clock (32 u64 stamps a CTA's
 * warp group: compute/moe_kern.cuh, k_stamp). SL_EINVAL when a kernel's grid could need
 * more records. */
typedef struct sl_gpu_probe {
    int plain_start;               /* 1: the host-table gate/up not staggered */
    int wait_select;               /* 1: the device-table gate/up after the whole selection */
    int qh_form;                   /* 1: h's q8_1 by k_quant_h; 3, 4: by the gate/up */
    unsigned long long *gu_stamps; /* device buffer of the gate/up's milestones, or NULL */
    unsigned long long *dn_stamps; /* the same for the down (main stream) */
    uint32_t records;              /* records each buffer holds */
    unsigned long long *rt_stamps; /* device buffer of SL_GPU_RT_STAMPS: the routing's, or NULL */
} sl_gpu_probe;

/* rt_stamps (sl_gpu_route_start's kernels, %globaltimer ns): the selection's thread 0
 * at [SL_GPU_RT_SEL_*]: entry, past its wait for the router, scores and warp maxima
 * done, picks ranked, the picks' weights, slots and device-tier entries known, table
 * published, end (the host's picks written), at SL_GPU_RT_SEL_SM its SM's id + 1 and
 * at SL_GPU_RT_SEL_CLK + each of those slots the SM's cycle count at that moment;
 * the router's CTA c at SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS c: entry, past its wait
 * for the kernel before, end, x in shared memory and, with the norm inside the router,
 * h and y loaded and their squares summed, and the norm's factor r known (thread 0's
 * view of each: after its own rows, after the CTA's barrier). */
enum {
    SL_GPU_RT_SEL_ENTRY,
    SL_GPU_RT_SEL_WAITED,
    SL_GPU_RT_SEL_SCORED,
    SL_GPU_RT_SEL_RANKED,
    SL_GPU_RT_SEL_TIER,
    SL_GPU_RT_SEL_PUBLISHED,
    SL_GPU_RT_SEL_END,
    SL_GPU_RT_SEL_SM,
    SL_GPU_RT_SEL_CLK, /* + SL_GPU_RT_SEL_*: the same moments in the SM's clock64 */
    SL_GPU_RT_ROUTER = 16,
    SL_GPU_RT_ROUTER_SLOTS = 6,
    /* n_expert <= 1024, 4 experts a CTA */
    SL_GPU_RT_STAMPS = SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS * 256
};
int sl_gpu_set_probe(sl_gpu_ctx *ctx, const sl_gpu_probe *probe, sl_err *err);

/* Test hook: waits, then copies the last layer's intermediates to the host (each
 * nullable): h [n_used][inter] (experts by increasing id), hq [n_used][inter] and
 * hd [n_used][inter/32] (its q8_1), h_sh [inter], y_sh [dim] (the shared expert;
 * NaN when it ran with the routed experts: its output went straight into the sum). */
int sl_gpu_moe_peek(sl_gpu_ctx *ctx, float *h, int8_t *hq, float *hd, float *h_sh, float *y_sh,
                    sl_err *err);

#ifdef __cplusplus
}
#endif

#endif
