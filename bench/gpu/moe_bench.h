/* moe_bench.h - what bench/gpu/moe.c and its variants (moe_variants.cu) share. */
#ifndef SL_MOE_BENCH_H
#define SL_MOE_BENCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One token's expert set: device-visible weights, routing weights (table order). */
typedef struct mb_set {
    const void *gate[8], *up[8], *down[8];
    const void *down_pk[8];   /* the downs as compute/ keeps them in device memory (gpu.h:
                               * sl_gpu_upload_down, the tiled layout SL_Q3K_TB) */
    const void *down_p112[8]; /* the downs in 112-byte packed blocks (SL_Q3K_PACKED, the
                               * device layout of sessions 11-20) */
    float w[8];
} mb_set;

/* Shapes, activation and scratch of the variant runs (all device pointers). */
typedef struct mb_io {
    uint32_t dim, inter, n;
    const uint16_t *x;          /* [dim] bf16 */
    uint8_t *ximg;              /* x quantized for the bulk-copy gate/up (k_quant_x_img), 16 KB */
    float *h;                   /* [8][inter] */
    int8_t *hq;                 /* [8][inter] */
    float *hd;                  /* [8][inter/32] */
    unsigned *cnt;              /* [8][inter/32], zeroed */
    unsigned *sync;             /* the fused kernel's counters (sl_kfuse), zeroed, 4096 of them */
    float *part;                /* [8][dim] */
    unsigned long long *stamps; /* [1024][4]: the fused kernel's phase stamps (sl_kfuse) */
    unsigned long long *gu_st;  /* NULL (timed runs), or the gate/up's milestones */
    unsigned long long *dn_st;  /* NULL (timed runs), or the down's milestones */
    float *out_f32;             /* [dim] */
    uint16_t *out;              /* [dim] */
} mb_io;

/* A device-only all-hit layer (router, selection, fused experts), all device pointers. */
typedef struct mb_layer {
    uint32_t n_expert, n_used;
    float gate_temp, route_scale, limit;
    int norm_topk;
    const uint16_t *router; /* [n_expert][dim] bf16 */
    const void *t0;         /* [n_expert] sl_gpu_t0e: every expert in the device tier */
    const void *forced;     /* [n_forced] sl_moe_route: layer i takes forced[i % n_forced] */
    int n_forced;
    const void *sh_gate, *sh_up, *sh_down; /* the shared expert */
    mb_io io;                              /* x, the scratch and the outputs */
} mb_layer;

/* GB/s of a plain 16-byte read kernel over buf (device or mapped host memory). */
int mb_read_ceiling(const void *buf, size_t bytes, int iters, double *gbps, char *msg);

/* GB/s of a read over one token's experts (sets[i]: n experts, gate and up of
 * gate_bytes, down of down_bytes), one launch per token, rotating the sets. form 0: the
 * int4 grid-stride loop over the token's bytes as one range (two 64-bit divisions a
 * load); 1: the same loads expert by expert, six a thread in flight, no division; 2: bulk
 * copies into shared memory (2 CTAs an SM, 6 copies of 16 KB each in flight); 3: form 2
 * launched with PDL (a launch's copies start when the one before ends); 4: form 3 with the
 * weights' L2 evict-first hint. */
int mb_read_sets(const mb_set *sets, int nsets, int n, size_t gate_bytes, size_t down_bytes,
                 int iters, int form, double *gbps, char *msg);

/* cudaPointerGetAttributes(p) done n times (for timing); returns its memory type. */
int mb_ptr_kind(const void *p, int n);

/* Variants: compute/'s kernels for mapped host weights and for device weights (the
 * down on tiled Q3_K blocks, mb_set.down_pk); what compute/ ran until session 20 (the
 * down on packed 112-byte blocks, mb_set.down_p112), then the tiled down with two and
 * three blocks' chains interleaved; session 13's downs (MB_V_RING and the
 * four after it: in one round, and compute/'s at 72 registers); what compute/ ran for
 * device weights until session 9, until session 11 (h's q8_1 by k_quant_h), and until
 * session 10 (raw blocks); compute/'s gate/up for dim 5120 with a stage's rows together, then
 * for any dim with the stages split, then compute/'s until session 25 (for any dim, rows
 * together; the last variant). */
#define MB_V_MAPPED  0
#define MB_V_SHIPPED 1
#define MB_V_S20     2
#define MB_V_RING    5
#define MB_V_S9      16
#define MB_V_S11     53
#define MB_V_BEFORE  54
#define MB_V_NBONLY  55
#define MB_V_SPLONLY 56
#define MB_V_S24     57

int mb_variant_count(void);
const char *mb_variant_name(int v);

/* Microseconds per token of variant v over iters launches rotating through sets;
 * which: 0 gate/up + down, 1 gate/up only, 2 down only (0 us: the variant has no such
 * part, e.g. the fused layer kernel). Leaves set 0's full result in
 * io->out / io->out_f32. msg[256] gets the failure. */
int mb_variant_time(int v, const mb_io *io, const mb_set *sets, int nsets, int iters, int which,
                    double *us, char *msg);

/* Records (SL_KSTAMP_SLOTS stamps each: a CTA's group) of the milestone buffers. */
#define MB_ST_RECS  4096
#define MB_ST_SLOTS 32
#define MB_ST_UNITS 11 /* units a record stamps (SL_KSTAMP_UNITS) */

/* iters launches of variant v back to back (rotating the sets), its gate/up and down
 * stamping into gu_st and dn_st (MB_ST_RECS records each, zeroed first): the stamps
 * left are the last launch's. */
int mb_variant_stamped(int v, const mb_io *io, const mb_set *sets, int nsets, int iters,
                       unsigned long long *gu_st, unsigned long long *dn_st, char *msg);

/* Sets the shared-memory carveout preference of the kernels variant 1 launches
 * (quant_x_img, gate/up, quant_h, down) to pct (100: the most shared memory), so that
 * consecutive kernels need the same L1 split. */
int mb_carveout(int pct, char *msg);

/* Whether variant v reads its downs as compute/ keeps them in device memory (1:
 * mb_set.down_pk) or in 112-byte packed blocks (2: mb_set.down_p112); 0: raw blocks. */
int mb_variant_packed(int v);

/* Whether variant v is a fused layer kernel (mb_fused_layer times it). */
int mb_variant_fused(int v);

/* Microseconds per layer of iters device-only layers back to back (router, selection,
 * fused variant v with the shared expert, PDL between them); then layer 0 alone, its
 * sum left in L->io.out / out_f32 and its picks (experts, weights) in *picks. */
int mb_fused_layer(int v, const mb_layer *L, int iters, double *us, uint32_t *pick_expert,
                   float *pick_weight, char *msg);

#ifdef __cplusplus
}
#endif

#endif
