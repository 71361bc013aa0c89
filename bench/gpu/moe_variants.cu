/* moe_variants.cu - the sandbox of bench/gpu/moe: read-ceiling kernels and the MoE
 * kernel variants (instantiations of compute/moe_kern.cuh: bulk-copy gate/up and down
 * with their stage shapes, programmatic dependent launch on or off, and the
 * register-staged kernels of runs 4 and 5), each timed with CUDA events on rotating
 * expert sets so that L2 never holds the weights. Variant 0 is what compute/moe.cu
 * ships for weights in mapped host memory, variant 1 what it ships for device memory.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "bench_ck.h"
#include "moe_sandbox.cuh"
#include "moe_bench.h"

/* The current device's SM count. */
static cudaError_t sm_count(int *n_sm)
{
    int dev = 0;
    cudaError_t rc = cudaGetDevice(&dev);
    return rc != cudaSuccess ? rc
                             : cudaDeviceGetAttribute(n_sm, cudaDevAttrMultiProcessorCount, dev);
}

/* Milliseconds between two events around queue(0), ..., queue(n - 1), each queueing work
 * on the default stream and returning its error; the first failure is returned. */
template <typename F> static cudaError_t time_launches(int n, float *ms, F &&queue)
{
    cudaEvent_t a, b;
    cudaError_t rc = cudaEventCreate(&a);
    if (rc != cudaSuccess) return rc;
    rc = cudaEventCreate(&b);
    if (rc != cudaSuccess) {
        cudaEventDestroy(a);
        return rc;
    }
    rc = cudaEventRecord(a);
    for (int i = 0; i < n && rc == cudaSuccess; i++) rc = queue(i);
    if (rc == cudaSuccess) rc = cudaEventRecord(b);
    if (rc == cudaSuccess) rc = cudaEventSynchronize(b);
    if (rc == cudaSuccess) rc = cudaEventElapsedTime(ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return rc;
}

__global__ void k_read_ceiling(const int4 *__restrict__ p, size_t n, int *sink)
{
    int acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const int4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                   d = __ldcs(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
               d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const int4 a = __ldcs(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x7fedcba9) *sink = acc;
}

extern "C" int mb_read_ceiling(const void *buf, size_t bytes, int iters, double *gbps, char *msg)
{
    int n_sm = 0;
    CKB(sm_count(&n_sm));
    int *sink;
    CKB(cudaMalloc(&sink, 4));
    double best = 1e30;
    for (int it = 0; it < iters; it++) {
        float ms;
        CKB(time_launches(1, &ms, [&](int) {
            k_read_ceiling<<<n_sm * 8, 256>>>((const int4 *)buf, bytes / 16, sink);
            return cudaGetLastError();
        }));
        if (it > 0 && ms < best) best = ms; /* the first run warms up */
    }
    *gbps = (double)bytes / (best * 1e-3) / 1e9;
    cudaFree(sink);
    return 0;
}

/* Read ceiling at the problem's own size: one launch reads one token's experts (gate
 * and up of cg 16-byte chunks, down of cd) with the int4 loop, rotating the sets. */
__global__ void k_read_set(const __grid_constant__ mb_set set, int n, size_t cg, size_t cd,
                           int *sink)
{
    int acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x, per = 2 * cg + cd, total = per * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int e = (int)(i / per);
        const size_t off = i % per;
        const int4 *p = off < cg       ? (const int4 *)set.gate[e] + off
                        : off < 2 * cg ? (const int4 *)set.up[e] + (off - cg)
                                       : (const int4 *)set.down[e] + (off - 2 * cg);
        const int4 a = __ldcs(p);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x7fedcba9) *sink = acc;
}

/* The same bytes with no division in the loop (k_read_set's two 64-bit divisions a
 * 16-byte load cost it instructions, not bandwidth): expert by expert, each thread's
 * loads of gate, up and down (two of each a round) issued together. */
__global__ void k_read_set_flat(const __grid_constant__ mb_set set, int n, size_t cg, size_t cd,
                                int *sink)
{
    int acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x, cm = cg > cd ? cg : cd;
    const int4 z = make_int4(0, 0, 0, 0);
    for (int e = 0; e < n; e++) {
        const int4 *g = (const int4 *)set.gate[e], *u = (const int4 *)set.up[e],
                   *d = (const int4 *)set.down[e];
        for (size_t i = t0; i < cm; i += 2 * stride) {
            const size_t j = i + stride;
            const int4 a0 = i < cg ? __ldcs(g + i) : z, a1 = j < cg ? __ldcs(g + j) : z;
            const int4 b0 = i < cg ? __ldcs(u + i) : z, b1 = j < cg ? __ldcs(u + j) : z;
            const int4 c0 = i < cd ? __ldcs(d + i) : z, c1 = j < cd ? __ldcs(d + j) : z;
            acc ^= a0.x ^ a0.w ^ a1.x ^ a1.w ^ b0.x ^ b0.w ^ b1.x ^ b1.w ^ c0.x ^ c0.w ^ c1.x ^
                   c1.w ^ a0.y ^ a0.z ^ a1.y ^ a1.z ^ b0.y ^ b0.z ^ b1.y ^ b1.z ^ c0.y ^ c0.z ^
                   c1.y ^ c1.z;
        }
    }
    if (acc == 0x7fedcba9) *sink = acc;
}

/* The same bytes as bulk copies into shared memory, as the kernels move them: 2 CTAs an
 * SM, each thread 0 keeping RD_ST copies of RD_B bytes in flight (the tensors cut into
 * RD_B pieces, dealt to the CTAs in turn), nothing reading them. */
#define RD_ST 6
#define RD_B  16384u
/* PDL (forms 3, 4): launched with programmatic stream serialization, each CTA enters
 * while the launch before drains and starts its copies the moment that one's grid has
 * ended, as the GEMVs' launches do (their rows are timed back to back with PDL too);
 * EF (form 4): the copies carry the weights' L2 evict-first hint (k_bulk_w). */
template <bool PDL, bool EF>
__global__ void __launch_bounds__(32)
    k_read_set_bulk(const __grid_constant__ mb_set set, int n, size_t gbytes, size_t dbytes)
{
    extern __shared__ int4 k_smem[];
    uint64_t *bar = (uint64_t *)((uint8_t *)k_smem + RD_ST * RD_B);
    if (PDL) k_pdl_go();
    if (threadIdx.x != 0) return;
    for (int k = 0; k < RD_ST; k++) k_mbar_init(bar + k, 1);
    k_mbar_fence_init();
    if (PDL) k_pdl_wait();
    uint32_t q = 0;    /* copies queued */
    uint32_t seen = 0; /* pieces dealt before this tensor */
    for (int t = 0; t < 3 * n; t++) {
        const int e = t / 3, part = t % 3;
        const uint8_t *p = (const uint8_t *)(part == 0   ? set.gate[e]
                                             : part == 1 ? set.up[e]
                                                         : set.down[e]);
        const size_t bytes = part == 2 ? dbytes : gbytes;
        const uint32_t pieces = (uint32_t)((bytes + RD_B - 1) / RD_B);
        for (uint32_t k = (blockIdx.x + gridDim.x - seen % gridDim.x) % gridDim.x; k < pieces;
             k += gridDim.x) {
            const uint32_t len =
                (uint32_t)(bytes - (size_t)k * RD_B < RD_B ? bytes - (size_t)k * RD_B : RD_B);
            const uint32_t st = q % RD_ST;
            if (q >= RD_ST) k_mbar_wait(bar + st, (q / RD_ST - 1) & 1);
            k_mbar_expect(bar + st, len);
            k_bulk_w<EF>((uint8_t *)k_smem + (size_t)st * RD_B, p + (size_t)k * RD_B, len,
                         bar + st);
            q++;
        }
        seen += pieces;
    }
    for (uint32_t k = q > RD_ST ? q - RD_ST : 0; k < q; k++)
        k_mbar_wait(bar + k % RD_ST, (k / RD_ST) & 1);
}

extern "C" int mb_read_sets(const mb_set *sets, int nsets, int n, size_t gate_bytes,
                            size_t down_bytes, int iters, int form, double *gbps, char *msg)
{
    int n_sm = 0;
    CKB(sm_count(&n_sm));
    int *sink;
    CKB(cudaMalloc(&sink, 4));
    const size_t cg = gate_bytes / 16, cd = down_bytes / 16, bsm = RD_ST * RD_B + 8 * RD_ST;
    auto bulk = form == 2   ? k_read_set_bulk<false, false>
                : form == 3 ? k_read_set_bulk<true, false>
                            : k_read_set_bulk<true, true>;
    if (form >= 2)
        CKB(cudaFuncSetAttribute(bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bsm));
    auto launch = [&](const mb_set &set) {
        if (form == 0)
            k_read_set<<<n_sm * 8, 256>>>(set, n, cg, cd, sink);
        else if (form == 1)
            k_read_set_flat<<<n_sm * 8, 256>>>(set, n, cg, cd, sink);
        else
            return k_launch(bulk, n_sm * 2, 32, bsm, 0, form >= 3, set, n, gate_bytes, down_bytes);
        return cudaGetLastError();
    };
    CKB(launch(sets[0]));
    float ms;
    CKB(time_launches(iters, &ms, [&](int it) { return launch(sets[(it + 1) % nsets]); }));
    *gbps = (double)((2 * cg + cd) * 16 * n) * iters / (ms * 1e-3) / 1e9;
    cudaFree(sink);
    return 0;
}

extern "C" int mb_ptr_kind(const void *p, int n)
{
    cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    for (int i = 0; i < n; i++)
        if (cudaPointerGetAttributes(&a, p) != cudaSuccess) (void)cudaGetLastError();
    return (int)a.type;
}

enum {
    G_RUN4,
    G_4P,
    G_T8_16_3,
    G_T8_16_4,
    G_T8x2_16_4,
    G_T4x4_8_8,
    G_T8x3_16_3,
    G_T4x2_8_6, /* smaller gate/up stages: a down CTA fits beside it (PDL starts it early) */
    G_T4x2_8_4,
    G_T4x2_8_4_PF,   /* ... prefetching the downs into L2 as its CTAs run out of units */
    G_T4x2_8_4_STG,  /* ... one stage a group queued at first, the others once it landed */
    G_T4x2_8_4_QH,   /* ... and h's q8_1 by the unit that completes a group (no k_quant_h) */
    G_T4x2_8_4_QH2,  /* ... counted at each CTA's end */
    G_T4x2_8_4_QH3,  /* ... a group of 32 rows by the warp group that computed them */
    G_T4x2_8_4_QH3X, /* ... for dim 5120 exactly (a lane's blocks a constant count), the split
                      * stage layout (compute/'s) */
    G_T4x2_8_4_QH3N, /* ... for dim 5120 exactly, a stage's rows together */
    G_T4x2_8_4_QH3S, /* ... for any dim, the split stage layout */
    G_T4x2_8_4_QH4,  /* ... by the CTA's two groups that computed them (16 rows each) */
    G_T4x4_8_4,
    G_T8x2_16_2,
    G_T4x2_8_2,
    G_M8x2_16_4,
    G_M8_16_4,
    G_FUSED_8,  /* the fused layer kernel, 2 groups of 8 warps, down units round-robin */
    G_FUSED_8A, /* ... one expert's downs a CTA */
    G_FUSED_4,  /* 4 groups of 4 warps (TR 8, 8 stages, 16 down rows), round-robin */
    G_FUSED_4A,
    G_FUSED_8AH, /* one expert's downs a CTA, a helper warp a group publishes */
    G_FUSED_4AH,
    G_FUSED_8I1, /* round-robin interleaved by expert: downs an expert behind the gate/ups */
    G_FUSED_8I2  /* ... two experts behind */
};
enum dn_form {
    D_RUN4,
    D_T2_8,
    D_T8_8,
    D_T8_16,
    D_P8_4_2_1,
    D_P8_4_3_1,
    D_P8_4_4_2,
    D_P8_4_2_2,
    D_P8_8_2_1,
    D_P4_8_2_1,
    D_P4_8_3_1,
    D_P4_8_4_2,
    D_P8_4_1_1,
    D_P4_8_2_2,
    D_P4_8_2_2L, /* the stage refilled after the group's barrier (before session 8) */
    D_P4_8_1_1,
    D_M2_16_1_1,
    D_P4_8_2_2_PK,   /* D_P4_8_2_2 on packed Q3_K blocks (mb_set.down_p112) */
    D_P4_8_2_2_PK2,  /* ... two blocks' chains interleaved (compute/'s until session 20) */
    D_P4_8_2_2_PK2S, /* ... a CTA's odd last tile shared by its two groups (blocks split) */
    D_RING3_2,       /* packed blocks in one round: a CTA a tile, rings of 2 chunks of 3 blocks */
    D_RING2_3,       /* ... rings of 3 chunks of 2 blocks */
    D_RING1_4,       /* ... rings of 4 chunks of 1 block */
    D_PK_R72U2,      /* D_P4_8_2_2_PK2 at 72 registers (2 CTAs of 7 experts an SM still) */
    D_PK_R72U3,      /* ... three blocks' chains interleaved */
    D_TB1,           /* D_P4_8_2_2_PK2's CTAs on the tiled layout (mb_set.down_pk): a lane one
                      * group of two rows, the activation loaded once for both; a block at a
                      * time (compute/'s) */
    D_TB2,           /* ... two blocks' chains interleaved */
    D_TB3,           /* ... three */
    D_FUSED          /* none: the gate/up launch is the fused layer kernel */
};

struct variant {
    const char *name;
    int gu, dn;
    bool pdl; /* programmatic dependent launch between the bulk-copy kernels */
};

static constexpr variant variants[] = {
    {"run 4: gu8pf + quant_h + down2 T1 (compute, mapped weights)", G_RUN4, D_RUN4, false},
    {"gt 2x NW4 TR8 ST4, staggered start, q8_1 of h by the warp group of its 32 rows (no quant_h), "
     "built for dim 5120, stages split (gate tiles, 64 bytes, up tiles) + dp TD8 ST2 2x on 8-row "
     "tiled Q3_K blocks (a lane: one group of two rows), a block at a time, PDL (compute, device "
     "weights)",
     G_T4x2_8_4_QH3X, D_TB1, true},
    {"gt QH3 (as compute) + dp LPR4 TD8 ST2 2x on packed 112-byte Q3_K blocks, 2 blocks "
     "interleaved, PDL (compute until session 20)",
     G_T4x2_8_4_QH3, D_P4_8_2_2_PK2, true},
    {"gt QH3 (as compute) + dp TD8 ST2 2x on tiled blocks, 2 blocks interleaved, PDL",
     G_T4x2_8_4_QH3, D_TB2, true},
    {"gt QH3 (as compute) + dp TD8 ST2 2x on tiled blocks, 3 blocks interleaved, PDL",
     G_T4x2_8_4_QH3, D_TB3, true},
    {"gt QH3 (as compute) + down in one round, a CTA a tile, rings of 2 chunks of 3 blocks, PDL",
     G_T4x2_8_4_QH3, D_RING3_2, true},
    {"gt QH3 (as compute) + down in one round, rings of 3 chunks of 2 blocks, PDL", G_T4x2_8_4_QH3,
     D_RING2_3, true},
    {"gt QH3 (as compute) + down in one round, rings of 4 chunks of 1 block, PDL", G_T4x2_8_4_QH3,
     D_RING1_4, true},
    {"gt QH3 (as compute) + compute's packed down at 72 registers, 2 blocks interleaved, PDL",
     G_T4x2_8_4_QH3, D_PK_R72U2, true},
    {"gt QH3 (as compute) + compute's packed down at 72 registers, 3 blocks interleaved, PDL",
     G_T4x2_8_4_QH3, D_PK_R72U3, true},
    {"gt 2x NW4 TR8 ST4, staggered start, q8_1 of h by the CTA of its 32 rows (its two groups, no "
     "quant_h) + dp LPR4 TD8 ST2 2x on packed blocks, 2 blocks interleaved, PDL",
     G_T4x2_8_4_QH4, D_P4_8_2_2_PK2, true},
    {"gt 2x NW4 TR8 ST4, staggered start + dp LPR4 TD8 ST2 2x on packed blocks, a block at a "
     "time, PDL",
     G_T4x2_8_4_STG, D_P4_8_2_2_PK, true},
    {"gt 2x NW4 TR8 ST4, staggered start + dp LPR4 TD8 ST2 2x on packed blocks, 2 blocks "
     "interleaved, a CTA's odd last tile shared by its groups (blocks split), PDL",
     G_T4x2_8_4_STG, D_P4_8_2_2_PK2S, true},
    {"gt 2x NW4 TR8 ST4, staggered start, q8_1 of h by the unit completing a group (no "
     "quant_h) + dp LPR4 TD8 ST2 2x on packed blocks, 2 blocks interleaved, PDL",
     G_T4x2_8_4_QH, D_P4_8_2_2_PK2, true},
    {"gt 2x NW4 TR8 ST4, staggered start, q8_1 of h counted at each CTA's end (no quant_h) + dp "
     "LPR4 TD8 ST2 2x on packed blocks, 2 blocks interleaved, PDL",
     G_T4x2_8_4_QH2, D_P4_8_2_2_PK2, true},
    {"gt 2x NW4 TR8 ST4, L2 prefetch of the downs + dp LPR4 TD8 ST2 2x, PDL", G_T4x2_8_4_PF,
     D_P4_8_2_2, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR4 TD8 ST2 2x, PDL (compute until session 9)", G_T4x2_8_4,
     D_P4_8_2_2, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR4 TD8 ST2 2x, stage refilled after the barrier (compute until "
     "session 7), PDL",
     G_T4x2_8_4, D_P4_8_2_2L, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR4 TD8 ST1, one tile a CTA, PDL", G_T4x2_8_4, D_P4_8_1_1, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR4 TD8 ST2 1x, PDL", G_T4x2_8_4, D_P4_8_2_1, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR4 TD8 ST3 1x, PDL", G_T4x2_8_4, D_P4_8_3_1, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR8 TD4 ST2 2x, PDL", G_T4x2_8_4, D_P8_4_2_2, true},
    {"gt 2x NW4 TR8 ST4 + dp LPR8 TD8 ST2 1x, PDL", G_T4x2_8_4, D_P8_8_2_1, true},
    {"gt 2x NW8 TR16 ST4 + dp LPR4 TD8 ST1, one tile a CTA, PDL (compute until session 6)",
     G_T8x2_16_4, D_P4_8_1_1, true},
    {"fused gate/up + down, 2x NW8 TR16 ST4, down TD32 LPR8 round-robin, PDL", G_FUSED_8, D_FUSED,
     true},
    {"fused gate/up + down, 2x NW8 TR16 ST4, down TD32 LPR8 an expert a CTA, PDL", G_FUSED_8A,
     D_FUSED, true},
    {"fused gate/up + down, 4x NW4 TR8 ST8, down TD16 LPR8 round-robin, PDL", G_FUSED_4, D_FUSED,
     true},
    {"fused gate/up + down, 4x NW4 TR8 ST8, down TD16 LPR8 an expert a CTA, PDL", G_FUSED_4A,
     D_FUSED, true},
    {"fused gate/up + down, 2x (NW8 + helper) TR16 ST4, down TD32 an expert a CTA, PDL",
     G_FUSED_8AH, D_FUSED, true},
    {"fused gate/up + down, 4x (NW4 + helper) TR8 ST8, down TD16 an expert a CTA, PDL", G_FUSED_4AH,
     D_FUSED, true},
    {"fused gate/up + down, 2x NW8 TR16 ST4, down TD32 LPR8 round-robin interleaved by expert "
     "(an expert's downs after the next one's gate/ups), PDL",
     G_FUSED_8I1, D_FUSED, true},
    {"fused gate/up + down, 2x NW8 TR16 ST4, down TD32 LPR8 round-robin interleaved by expert "
     "(an expert's downs two experts behind), PDL",
     G_FUSED_8I2, D_FUSED, true},
    {"gt 2x NW4 TR8 ST6 (176 KB: one down CTA beside it) + dp LPR4 TD8 ST1, PDL", G_T4x2_8_6,
     D_P4_8_1_1, true},
    {"gt 4x NW4 TR8 ST4 (123 KB) + dp LPR4 TD8 ST1, PDL", G_T4x4_8_4, D_P4_8_1_1, true},
    {"gt 2x NW8 TR16 ST2 (123 KB) + dp LPR4 TD8 ST1, PDL", G_T8x2_16_2, D_P4_8_1_1, true},
    {"gt 2x NW4 TR8 ST2 (3 CTAs/SM) + dp LPR4 TD8 ST2 2x, PDL", G_T4x2_8_2, D_P4_8_2_2, true},
    {"gt 2x NW4 TR8 ST4 + dt LPR8 TD8, PDL", G_T4x2_8_4, D_T8_8, true},
    {"gt 2x NW4 TR8 ST2 (3 CTAs/SM) + dp LPR4 TD8 ST1, PDL", G_T4x2_8_2, D_P4_8_1_1, true},
    {"mma gt 2x NW8 TR16 ST4 + mma dp TD16 ST1, PDL", G_M8x2_16_4, D_M2_16_1_1, true},
    {"gt 2x NW8 TR16 ST4 + mma dp TD16 ST1, PDL", G_T8x2_16_4, D_M2_16_1_1, true},
    {"mma gt 2x NW8 TR16 ST4 + dp LPR4 TD8 ST1, PDL", G_M8x2_16_4, D_P4_8_1_1, true},
    {"mma gt 1x NW8 TR16 ST4 + dp LPR4 TD8 ST1, PDL", G_M8_16_4, D_P4_8_1_1, true},
    {"gt 2x NW8 TR16 ST4 + dt LPR8 TD8, PDL (run 6)", G_T8x2_16_4, D_T8_8, true},
    {"gt 2x NW8 TR16 ST4 + dp LPR4 TD8 ST2 1x, PDL", G_T8x2_16_4, D_P4_8_2_1, true},
    {"gt 2x NW8 TR16 ST4 + dp LPR4 TD8 ST2 2x, PDL", G_T8x2_16_4, D_P4_8_2_2, true},
    {"gt 2x NW8 TR16 ST4 + dp LPR4 TD8 ST4 2x, PDL", G_T8x2_16_4, D_P4_8_4_2, true},
    {"gt 2x NW8 TR16 ST4 + dp LPR8 TD4 ST4 2x, PDL", G_T8x2_16_4, D_P8_4_4_2, true},
    {"gt 2x NW8 TR16 ST4 + dp LPR8 TD4 ST1, one tile a CTA, PDL", G_T8x2_16_4, D_P8_4_1_1, true},
    {"gt 2x NW8 TR16 ST4 + dt LPR8 TD8, no PDL", G_T8x2_16_4, D_T8_8, false},
    {"gt 4x NW4 TR8 ST8 + dt LPR8 TD8, PDL", G_T4x4_8_8, D_T8_8, true},
    {"gt 3x NW8 TR16 ST3 + dt LPR8 TD8, PDL", G_T8x3_16_3, D_T8_8, true},
    {"gt 1x NW8 TR16 ST3 + dt LPR8 TD16, PDL", G_T8_16_3, D_T8_16, true},
    {"gt 1x NW8 TR16 ST4 + dt LPR2 TD8, PDL", G_T8_16_4, D_T2_8, true},
    {"gt 2x NW4 TR8 ST4, staggered start + dp LPR4 TD8 ST2 2x on packed blocks, 2 blocks "
     "interleaved, PDL (compute until session 11)",
     G_T4x2_8_4_STG, D_P4_8_2_2_PK2, true},
    {"gt 2x NW4 TR8 ST4, staggered start + dp LPR4 TD8 ST2 2x, PDL (compute until session 10)",
     G_T4x2_8_4_STG, D_P4_8_2_2, true},
    {"gt QH3 for dim 5120, a stage's rows together + compute's tiled down, PDL", G_T4x2_8_4_QH3N,
     D_TB1, true},
    {"gt QH3 for any dim, stages split + compute's tiled down, PDL", G_T4x2_8_4_QH3S, D_TB1, true},
    {"gt QH3 for any dim (compute until session 25) + dp TD8 ST2 2x on tiled blocks, a block at a "
     "time, PDL",
     G_T4x2_8_4_QH3, D_TB1, true},
};

static_assert(sizeof variants / sizeof *variants == MB_V_S24 + 1, "MB_V_S24 is the last");
static_assert(variants[MB_V_NBONLY].gu == G_T4x2_8_4_QH3N &&
                  variants[MB_V_SPLONLY].gu == G_T4x2_8_4_QH3S,
              "MB_V_NBONLY, MB_V_SPLONLY: compute/'s gate/up with one of its two changes");
static_assert(variants[MB_V_S24].gu == G_T4x2_8_4_QH3 && variants[MB_V_S24].dn == D_TB1,
              "MB_V_S24: compute/'s device-weight kernels until session 25");
static_assert(variants[MB_V_SHIPPED].gu == G_T4x2_8_4_QH3X && variants[MB_V_SHIPPED].dn == D_TB1,
              "MB_V_SHIPPED is compute/'s device-weight kernels");
static_assert(variants[MB_V_RING].dn == D_RING3_2, "MB_V_RING: the down in one round");
static_assert(variants[MB_V_S20].dn == D_P4_8_2_2_PK2, "MB_V_S20: the down until session 20");
static_assert(variants[MB_V_S11].gu == G_T4x2_8_4_STG && variants[MB_V_S11].dn == D_P4_8_2_2_PK2,
              "MB_V_S11 is what compute/ ran until session 11");
static_assert(variants[MB_V_S9].gu == G_T4x2_8_4 && variants[MB_V_S9].dn == D_P4_8_2_2,
              "MB_V_S9 is what compute/ ran until session 9");
static_assert(variants[MB_V_BEFORE].gu == G_T4x2_8_4_STG && variants[MB_V_BEFORE].dn == D_P4_8_2_2,
              "MB_V_BEFORE is what compute/ ran until session 10");

extern "C" int mb_variant_count(void)
{
    return (int)(sizeof variants / sizeof *variants);
}

extern "C" const char *mb_variant_name(int v)
{
    return variants[v].name;
}

template <int NW, int TR, int ST, int NG = 1, bool MMA = false, bool PFD = false, bool STG = false,
          int QH = 0, int NB = 0, bool SPL = false>
static cudaError_t gt_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, int n_sm,
                             bool pdl)
{
    const size_t smem = k_gateup_tma_smem(io->dim, TR, ST, MMA ? NG : 0, NW, SPL);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        cudaError_t rc = cudaFuncSetAttribute(
            k_gateup_tma_q2_k<NW, TR, ST, NG, MMA, PFD, STG, false, QH, NB, SPL>,
            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (rc == cudaSuccess) /* the form that records milestones (io->gu_st) */
            rc = cudaFuncSetAttribute(
                k_gateup_tma_q2_k<NW, TR, ST, NG, MMA, PFD, STG, true, QH, NB, SPL>,
                cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &occ, k_gateup_tma_q2_k<NW, TR, ST, NG, MMA, PFD, STG, false, QH, NB, SPL>,
                NG * NW * 32, smem);
        if (rc != cudaSuccess) return rc;
        if (!occ) return cudaErrorInvalidConfiguration;
        printf("  [gate/up tma%s%s%s %dx NW %d TR %d ST %d: %d CTAs/SM, smem %zu]\n",
               MMA ? " mma" : "", STG ? " staggered" : "", QH ? " q8_1 of h" : "", NG, NW, TR, ST,
               occ, smem);
    }
    if (k_gu4_xbytes(io->dim) > 16384) return cudaErrorInvalidValue; /* io->ximg's size */
    if (NB && io->dim != 256u * NB) return cudaErrorInvalidValue;    /* its one width */
    cudaError_t rc =
        k_launch(k_quant_x_img, (io->dim / 32 + 7) / 8, 256, 0, 0, pdl, io->x, io->dim, io->ximg);
    if (rc != cudaSuccess) return rc;
    const uint32_t units = (uint32_t)tab.n * io->inter / TR;
    const uint32_t need = QH >= 3 ? units / (32 / TR) : units; /* chunks */
    uint32_t grid = (uint32_t)(occ * n_sm);
    if (grid > need) grid = need;
    rc = k_launch(s.stamps ? k_gateup_tma_q2_k<NW, TR, ST, NG, MMA, PFD, STG, true, QH, NB, SPL>
                           : k_gateup_tma_q2_k<NW, TR, ST, NG, MMA, PFD, STG, false, QH, NB, SPL>,
                  grid, NG * NW * 32, smem, 0, pdl, tab, (const uint8_t *)io->ximg, io->dim,
                  io->inter, 10.0f, s);
    if (rc != cudaSuccess || QH) return rc;
    const uint32_t groups = (uint32_t)tab.n * io->inter / 32;
    return k_launch(k_quant_h_pdl, (groups + 7) / 8, 256, 0, 0, pdl, s, groups, groups, ~0u);
}

/* The fused layer kernel (gate/up, q8_1 of h and down in one launch), after x's image. */
template <int NW, int TR, int ST, int NG, int TD, int AFF, bool HELP = false>
static cudaError_t fu_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, int n_sm,
                             bool pdl)
{
    if (!k_moe_fused_fits(io->dim, io->inter, TR, TD, AFF)) return cudaErrorInvalidValue;
    const size_t smem = k_moe_fused_smem(io->dim, io->inter, TR, ST, AFF);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        cudaError_t rc =
            cudaFuncSetAttribute(k_moe_fused_q2q3<NW, TR, ST, NG, TD, AFF, HELP>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &occ, k_moe_fused_q2q3<NW, TR, ST, NG, TD, AFF, HELP>, NG * (NW + HELP) * 32, smem);
        if (rc != cudaSuccess) return rc;
        if (!occ) return cudaErrorInvalidConfiguration;
        printf("  [fused %dx NW %d%s TR %d ST %d TD %d%s: %d CTAs/SM, smem %zu]\n", NG, NW,
               HELP ? " + helper" : "", TR, ST, TD,
               AFF == 1   ? " an expert a CTA"
               : AFF == 2 ? " interleaved, downs an expert behind"
               : AFF == 3 ? " interleaved, downs two experts behind"
                          : "",
               occ, smem);
    }
    if (k_gu4_xbytes(io->dim) > 16384) return cudaErrorInvalidValue; /* io->ximg's size */
    cudaError_t rc =
        k_launch(k_quant_x_img, (io->dim / 32 + 7) / 8, 256, 0, 0, pdl, io->x, io->dim, io->ximg);
    if (rc != cudaSuccess) return rc;
    /* at most what fits at once (the waits need every CTA resident); AFF 1: one at least
     * for every expert */
    const uint32_t units = (uint32_t)tab.n * (io->inter / TR + io->dim / TD);
    uint32_t grid = (uint32_t)(occ * n_sm);
    if (grid > units) grid = units;
    if (AFF == 1 && grid < (uint32_t)tab.n) return cudaErrorInvalidConfiguration;
    const sl_kfuse f = {io->sync, io->part, NULL, io->out_f32, io->out, tab.n, io->stamps};
    return k_launch(k_moe_fused_q2q3<NW, TR, ST, NG, TD, AFF, HELP>, grid, NG * (NW + HELP) * 32,
                    smem, 0, pdl, tab, (const uint8_t *)io->ximg, io->dim, io->inter, 10.0f, s, f);
}

template <int LPR, int TD>
static cudaError_t dt_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, bool pdl)
{
    const size_t smem = k_down_tma_smem(tab.n, io->inter, TD);
    static int set = 0;
    if (!set) {
        cudaError_t rc = cudaFuncSetAttribute(k_down_tma_q3_k<LPR, TD>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)k_down_tma_smem(8, io->inter, TD));
        if (rc != cudaSuccess) return rc;
        int occ = 0;
        rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &occ, k_down_tma_q3_k<LPR, TD>, k_down_tma_threads(tab.n, LPR, TD), smem);
        if (rc != cudaSuccess) return rc;
        printf("  [down tma LPR %d TD %d: %d CTAs/SM, smem %zu]\n", LPR, TD, occ, smem);
        set = 1;
    }
    return k_launch(k_down_tma_q3_k<LPR, TD>, io->dim / TD, k_down_tma_threads(tab.n, LPR, TD),
                    smem, 0, pdl, tab, (const int8_t *)s.hq, (const float *)s.hd, io->dim,
                    io->inter, (const float *)NULL, io->out_f32, io->out);
}

/* The persistent down: as many CTAs as fit (ST 1: one CTA per tile). */
template <int LPR, int TD, int ST, int NG, bool MMA = false, bool EI = TD *LPR == 32, int BB = 110,
          int UNR = 1, bool SPLIT = false, bool TB = false>
static cudaError_t dp_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, int n_sm,
                             bool pdl)
{
    /* fs: the form that records milestones (io->dn_st; the mma form has none) */
    constexpr auto fn = MMA ? k_down_kern<LPR, TD, ST, NG, MMA>::fn
                            : &k_down_pt_q3_k<LPR, TD, ST, NG, EI, false, BB, UNR, SPLIT, TB>;
    constexpr auto fs = MMA ? k_down_kern<LPR, TD, ST, NG, MMA>::fn
                            : &k_down_pt_q3_k<LPR, TD, ST, NG, EI, true, BB, UNR, SPLIT, TB>;
    const size_t smem = k_dpt_smem(tab.n, io->inter, TD, ST, BB);
    const uint32_t threads = k_dpt_threads(tab.n, LPR, TD, NG);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        const int most = (int)k_dpt_smem(SL_GPU_MAX_USED, io->inter, TD, ST, BB); /* any table */
        cudaError_t rc =
            cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        if (rc == cudaSuccess)
            rc = cudaFuncSetAttribute(fs, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, threads, smem);
        if (rc != cudaSuccess) return rc;
        if (!occ) return cudaErrorInvalidConfiguration;
        printf("  [down pt%s%s%s%s LPR %d TD %d ST %d NG %d: %d CTAs/SM, %u threads, smem %zu]\n",
               MMA ? " mma" : "", EI ? " early refill" : "",
               TB          ? " tiled"
               : BB == 110 ? ""
                           : " packed",
               SPLIT ? " split last tile" : "", LPR, TD, ST, NG, occ, threads, smem);
    }
    const uint32_t tiles = io->dim / TD;
    uint32_t grid = ST == 1 ? tiles : (uint32_t)(occ * n_sm);
    if (grid > tiles) grid = tiles;
    return k_launch(io->dn_st ? fs : fn, grid, threads, smem, 0, pdl, tab, (const int8_t *)s.hq,
                    (const float *)s.hd, io->dim, io->inter, (const float *)NULL, io->out_f32,
                    io->out, (float *)NULL, io->dn_st);
}

/* The one-round down: a CTA a tile. */
template <int CB, int NB>
static cudaError_t dr_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, bool pdl)
{
    constexpr auto fn = &k_down_ring_q3_k<CB, NB, false>, fs = &k_down_ring_q3_k<CB, NB, true>;
    const size_t smem = (size_t)tab.n * k_dr_warp_bytes(CB, NB);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        const int most = (int)(SL_GPU_MAX_USED * k_dr_warp_bytes(CB, NB));
        cudaError_t rc =
            cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        if (rc == cudaSuccess)
            rc = cudaFuncSetAttribute(fs, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, 32 * tab.n, smem);
        if (rc != cudaSuccess) return rc;
        if (!occ) return cudaErrorInvalidConfiguration;
        printf("  [down in one round CB %d NB %d: %d CTAs/SM, %d threads, smem %zu]\n", CB, NB, occ,
               32 * tab.n, smem);
    }
    return k_launch(io->dn_st ? fs : fn, io->dim / SL_DR_TD, 32 * tab.n, smem, 0, pdl, tab,
                    (const int8_t *)s.hq, (const float *)s.hd, io->dim, io->inter,
                    (const float *)NULL, io->out_f32, io->out, (float *)NULL, io->dn_st);
}

/* session 20's packed down at 72 registers (k_down_pk_regs_q3_k), persistent. */
template <int UNR>
static cudaError_t dr72_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, int n_sm,
                               bool pdl)
{
    constexpr auto fn = &k_down_pk_regs_q3_k<72, UNR>;
    const size_t smem = k_dpt_smem(tab.n, io->inter, 8, 2, SL_Q3K_PACKED);
    const uint32_t threads = k_dpt_threads(tab.n, 4, 8, 2);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        cudaError_t rc =
            cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)k_dpt_smem(SL_GPU_MAX_USED, io->inter, 8, 2, SL_Q3K_PACKED));
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, threads, smem);
        if (rc != cudaSuccess) return rc;
        if (!occ) return cudaErrorInvalidConfiguration;
        printf("  [down pt packed at 72 registers, UNR %d: %d CTAs/SM, %u threads, smem %zu]\n",
               UNR, occ, threads, smem);
    }
    uint32_t grid = (uint32_t)(occ * n_sm);
    if (grid > io->dim / 8) grid = io->dim / 8;
    return k_launch(fn, grid, threads, smem, 0, pdl, tab, (const int8_t *)s.hq, (const float *)s.hd,
                    io->dim, io->inter, (const float *)NULL, io->out_f32, io->out, (float *)NULL,
                    (unsigned long long *)NULL);
}

template <int NW, bool PF, bool FQ, int MINB>
static cudaError_t gu_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, int n_sm)
{
    const size_t smem = k_gateup_smem(io->dim, NW, 4);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        cudaError_t rc =
            cudaFuncSetAttribute(k_gateup_q2_k<NW, 4, PF, FQ, MINB>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &occ, k_gateup_q2_k<NW, 4, PF, FQ, MINB>, NW * 32, smem);
        if (rc != cudaSuccess) return rc;
        printf("  [gate/up NW %d PF %d FQ %d MINB %d: %d CTAs/SM, smem %zu]\n", NW, (int)PF,
               (int)FQ, MINB, occ, smem);
    }
    uint32_t grid = ((uint32_t)tab.n * io->inter + NW - 1) / NW;
    if (grid > (uint32_t)(occ * n_sm)) grid = (uint32_t)(occ * n_sm);
    k_gateup_q2_k<NW, 4, PF, FQ, MINB>
        <<<grid, NW * 32, smem>>>(tab, io->x, io->dim, io->inter, 10.0f, s);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess || FQ) return rc;
    const uint32_t groups = (uint32_t)tab.n * io->inter / 32;
    k_quant_h<<<(groups + 7) / 8, 256>>>(s, groups);
    return cudaGetLastError();
}

template <int NW, int ST>
static cudaError_t gu4_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s, int n_sm)
{
    const size_t smem = k_gateup4_smem(io->dim, NW, ST);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        cudaError_t rc = cudaFuncSetAttribute(
            k_gateup4_q2_k<NW, ST, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k_gateup4_q2_k<NW, ST, 1>,
                                                               NW * 32, smem);
        if (rc != cudaSuccess) return rc;
        printf("  [gate/up4 NW %d ST %d: %d CTAs/SM, smem %zu]\n", NW, ST, occ, smem);
    }
    const uint32_t units = (uint32_t)tab.n * io->inter / 2;
    uint32_t grid = (units + NW - 1) / NW;
    if (grid > (uint32_t)(occ * n_sm)) grid = (uint32_t)(occ * n_sm);
    k_gateup4_q2_k<NW, ST, 1><<<grid, NW * 32, smem>>>(tab, io->x, io->dim, io->inter, 10.0f, s);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    const uint32_t groups = (uint32_t)tab.n * io->inter / 32;
    k_quant_h<<<(groups + 7) / 8, 256>>>(s, groups);
    return cudaGetLastError();
}

template <int T>
static cudaError_t dn2_launch(const mb_io *io, const sl_ktab &tab, const sl_kscratch &s)
{
    static int set = 0;
    if (!set) {
        cudaError_t rc = cudaFuncSetAttribute(
            k_down2_q3_k<8, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
        if (rc != cudaSuccess) return rc;
        set = 1;
    }
    k_down2_q3_k<8, T><<<(io->dim / 4 + T - 1) / T, 32 * tab.n, k_down2_smem(tab.n, 8)>>>(
        tab, s.hq, s.hd, io->dim, io->inter, NULL, io->out_f32, io->out);
    return cudaGetLastError();
}

static cudaError_t run_one(int v, const mb_io *io, const mb_set *set, int which, int n_sm)
{
    sl_ktab tab;
    memset(&tab, 0, sizeof tab);
    tab.n = (int)io->n;
    for (uint32_t k = 0; k < io->n; k++) {
        tab.e[k].gate = (const uint8_t *)set->gate[k];
        tab.e[k].up = (const uint8_t *)set->up[k];
        const int pk = mb_variant_packed(v);
        tab.e[k].down = (const uint8_t *)(pk == 2 ? set->down_p112[k]
                                          : pk    ? set->down_pk[k]
                                                  : set->down[k]);
        tab.e[k].w = set->w[k];
        tab.e[k].slot = (int)k;
    }
    sl_kscratch s = {io->h, io->hq, io->hd, io->cnt, io->gu_st};
    const variant &V = variants[v];
    cudaError_t rc = cudaSuccess;
    switch (V.gu) {
    case G_FUSED_8:
        return fu_launch<8, 16, 4, 2, 32, 0>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_8A:
        return fu_launch<8, 16, 4, 2, 32, 1>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_4:
        return fu_launch<4, 8, 8, 4, 16, 0>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_4A:
        return fu_launch<4, 8, 8, 4, 16, 1>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_8AH:
        return fu_launch<8, 16, 4, 2, 32, 1, true>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_4AH:
        return fu_launch<4, 8, 8, 4, 16, 1, true>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_8I1:
        return fu_launch<8, 16, 4, 2, 32, 2>(io, tab, s, n_sm, V.pdl);
    case G_FUSED_8I2:
        return fu_launch<8, 16, 4, 2, 32, 3>(io, tab, s, n_sm, V.pdl);
    default:
        break;
    }
    if (which != 2) {
        switch (V.gu) {
        case G_4P:
            rc = gu4_launch<8, 2>(io, tab, s, n_sm);
            break;
        case G_T8_16_3:
            rc = gt_launch<8, 16, 3>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T8_16_4:
            rc = gt_launch<8, 16, 4>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T8x2_16_4:
            rc = gt_launch<8, 16, 4, 2>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x4_8_8:
            rc = gt_launch<4, 8, 8, 4>(io, tab, s, n_sm, V.pdl);
            break;
        case G_M8x2_16_4:
            rc = gt_launch<8, 16, 4, 2, true>(io, tab, s, n_sm, V.pdl);
            break;
        case G_M8_16_4:
            rc = gt_launch<8, 16, 4, 1, true>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T8x3_16_3:
            rc = gt_launch<8, 16, 3, 3>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_6:
            rc = gt_launch<4, 8, 6, 2>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4:
            rc = gt_launch<4, 8, 4, 2>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_PF:
            rc = gt_launch<4, 8, 4, 2, false, true>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_STG:
            rc = gt_launch<4, 8, 4, 2, false, false, true>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_QH:
            rc = gt_launch<4, 8, 4, 2, false, false, true, 1>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_QH2:
            rc = gt_launch<4, 8, 4, 2, false, false, true, 2>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_QH3:
            rc = gt_launch<4, 8, 4, 2, false, false, true, 3>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_QH3X:
            rc = io->dim == 5120
                     ? gt_launch<4, 8, 4, 2, false, false, true, 3, 20, true>(io, tab, s, n_sm,
                                                                              V.pdl)
                     : gt_launch<4, 8, 4, 2, false, false, true, 3, 0, true>(io, tab, s, n_sm,
                                                                             V.pdl);
            break;
        case G_T4x2_8_4_QH3N:
            rc = io->dim == 5120
                     ? gt_launch<4, 8, 4, 2, false, false, true, 3, 20>(io, tab, s, n_sm, V.pdl)
                     : cudaErrorInvalidValue;
            break;
        case G_T4x2_8_4_QH3S:
            rc = gt_launch<4, 8, 4, 2, false, false, true, 3, 0, true>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_4_QH4:
            rc = gt_launch<4, 8, 4, 2, false, false, true, 4>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x4_8_4:
            rc = gt_launch<4, 8, 4, 4>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T8x2_16_2:
            rc = gt_launch<8, 16, 2, 2>(io, tab, s, n_sm, V.pdl);
            break;
        case G_T4x2_8_2:
            rc = gt_launch<4, 8, 2, 2>(io, tab, s, n_sm, V.pdl);
            break;
        default:
            rc = gu_launch<8, true, false, 1>(io, tab, s, n_sm);
        }
    }
    if (rc != cudaSuccess || which == 1) return rc;
    switch (V.dn) {
    case D_T2_8:
        return dt_launch<2, 8>(io, tab, s, V.pdl);
    case D_T8_8:
        return dt_launch<8, 8>(io, tab, s, V.pdl);
    case D_T8_16:
        return dt_launch<8, 16>(io, tab, s, V.pdl);
    case D_P8_4_2_1:
        return dp_launch<8, 4, 2, 1>(io, tab, s, n_sm, V.pdl);
    case D_P8_4_3_1:
        return dp_launch<8, 4, 3, 1>(io, tab, s, n_sm, V.pdl);
    case D_P8_4_4_2:
        return dp_launch<8, 4, 4, 2>(io, tab, s, n_sm, V.pdl);
    case D_P8_4_2_2:
        return dp_launch<8, 4, 2, 2>(io, tab, s, n_sm, V.pdl);
    case D_P8_8_2_1:
        return dp_launch<8, 8, 2, 1>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_2_1:
        return dp_launch<4, 8, 2, 1>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_3_1:
        return dp_launch<4, 8, 3, 1>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_4_2:
        return dp_launch<4, 8, 4, 2>(io, tab, s, n_sm, V.pdl);
    case D_P8_4_1_1:
        return dp_launch<8, 4, 1, 1>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_2_2:
        return dp_launch<4, 8, 2, 2>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_2_2L:
        return dp_launch<4, 8, 2, 2, false, false>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_1_1:
        return dp_launch<4, 8, 1, 1>(io, tab, s, n_sm, V.pdl);
    case D_M2_16_1_1:
        return dp_launch<4, 16, 1, 1, true>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_2_2_PK:
        return dp_launch<4, 8, 2, 2, false, true, SL_Q3K_PACKED>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_2_2_PK2:
        return dp_launch<4, 8, 2, 2, false, true, SL_Q3K_PACKED, 2>(io, tab, s, n_sm, V.pdl);
    case D_P4_8_2_2_PK2S:
        return dp_launch<4, 8, 2, 2, false, true, SL_Q3K_PACKED, 2, true>(io, tab, s, n_sm, V.pdl);
    case D_RING3_2:
        return dr_launch<3, 2>(io, tab, s, V.pdl);
    case D_RING2_3:
        return dr_launch<2, 3>(io, tab, s, V.pdl);
    case D_RING1_4:
        return dr_launch<1, 4>(io, tab, s, V.pdl);
    case D_PK_R72U2:
        return dr72_launch<2>(io, tab, s, n_sm, V.pdl);
    case D_PK_R72U3:
        return dr72_launch<3>(io, tab, s, n_sm, V.pdl);
    case D_TB2:
        return dp_launch<4, 8, 2, 2, false, true, SL_Q3K_PACKED, 2, false, true>(io, tab, s, n_sm,
                                                                                 V.pdl);
    case D_TB1:
        return dp_launch<4, 8, 2, 2, false, true, SL_Q3K_PACKED, 1, false, true>(io, tab, s, n_sm,
                                                                                 V.pdl);
    case D_TB3:
        return dp_launch<4, 8, 2, 2, false, true, SL_Q3K_PACKED, 3, false, true>(io, tab, s, n_sm,
                                                                                 V.pdl);
    default:
        return dn2_launch<1>(io, tab, s);
    }
}

/* ---- a device-only all-hit layer: router, selection, fused experts ---- */

/* Device scratch of the layer runs (logits, the selection's picks and table). */
static float *fl_logits;
static sl_kroute *fl_route;
static sl_ktab *fl_tab;

template <int NW, int TR, int ST, int NG, int TD, int AFF, bool HELP>
static cudaError_t fl_queue(const mb_layer *L, int it, int n_sm)
{
    const mb_io *io = &L->io;
    const auto kern = k_moe_fused_dev_q2q3<NW, TR, ST, NG, TD, AFF, HELP>;
    const size_t smem = k_moe_fused_smem(io->dim, io->inter, TR, ST, AFF);
    static int occ = 0; /* bench only: set once per instantiation */
    if (!occ) {
        if (!k_moe_fused_fits(io->dim, io->inter, TR, TD, AFF)) return cudaErrorInvalidValue;
        cudaError_t rc =
            cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (rc == cudaSuccess)
            rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, NG * (NW + HELP) * 32,
                                                               smem);
        if (rc != cudaSuccess) return rc;
        if (!occ) return cudaErrorInvalidConfiguration;
    }
    if (io->dim > 256 * 24 || L->n_expert > 1024) return cudaErrorInvalidValue;
    cudaError_t rc =
        k_launch(k_router_pf<4, 24>, (L->n_expert + 3) / 4, 128, sizeof(float) * io->dim, 0, true,
                 L->router, io->x, L->n_expert, io->dim, L->gate_temp, fl_logits, io->ximg,
                 (unsigned long long *)NULL, k_rnorm{});
    if (rc != cudaSuccess) return rc;
    sl_kexp sh;
    sh.gate = (const uint8_t *)L->sh_gate;
    sh.up = (const uint8_t *)L->sh_up;
    sh.down = (const uint8_t *)L->sh_down;
    sh.w = 1.0f;
    sh.slot = (int)L->n_used;
    rc = k_launch(k_route_select, 1, (L->n_expert + 31) / 32 * 32, 0, 0, true,
                  (const float *)fl_logits, (const float *)NULL, L->n_expert, L->n_used,
                  L->norm_topk, L->route_scale, (const sl_gpu_t0e *)L->t0,
                  (const sl_moe_route *)L->forced + it % L->n_forced, fl_route, fl_tab, sh, 1,
                  (uint32_t)it + 1, (sl_kttab *)NULL, 0u, (unsigned long long *)NULL);
    if (rc != cudaSuccess) return rc;
    const sl_kscratch s = {io->h, io->hq, io->hd, io->cnt};
    const sl_kfuse f = {io->sync, io->part,           NULL,      io->out_f32,
                        io->out,  (int)L->n_used + 1, io->stamps};
    return k_launch(kern, (uint32_t)(occ * n_sm), NG * (NW + HELP) * 32, smem, 0, true,
                    (const sl_ktab *)fl_tab, (const uint8_t *)io->ximg, io->dim, io->inter,
                    L->limit, s, f, sh, 1);
}

static cudaError_t fl_one(int v, const mb_layer *L, int it, int n_sm)
{
    switch (variants[v].gu) {
    case G_FUSED_8:
        return fl_queue<8, 16, 4, 2, 32, 0, false>(L, it, n_sm);
    case G_FUSED_8A:
        return fl_queue<8, 16, 4, 2, 32, 1, false>(L, it, n_sm);
    case G_FUSED_4:
        return fl_queue<4, 8, 8, 4, 16, 0, false>(L, it, n_sm);
    case G_FUSED_4A:
        return fl_queue<4, 8, 8, 4, 16, 1, false>(L, it, n_sm);
    case G_FUSED_8AH:
        return fl_queue<8, 16, 4, 2, 32, 1, true>(L, it, n_sm);
    case G_FUSED_4AH:
        return fl_queue<4, 8, 8, 4, 16, 1, true>(L, it, n_sm);
    case G_FUSED_8I1:
        return fl_queue<8, 16, 4, 2, 32, 2, false>(L, it, n_sm);
    case G_FUSED_8I2:
        return fl_queue<8, 16, 4, 2, 32, 3, false>(L, it, n_sm);
    default:
        return cudaErrorInvalidValue;
    }
}

/* Every down form named, no default: a new form that is not placed here is a compile
 * error (-Wswitch), not a run on bytes of another layout (session 28). */
extern "C" int mb_variant_packed(int v)
{
    switch ((dn_form)variants[v].dn) {
    case D_TB1:
    case D_TB2:
    case D_TB3:
        return 1;
    case D_P4_8_2_2_PK:
    case D_P4_8_2_2_PK2:
    case D_P4_8_2_2_PK2S:
    case D_RING3_2:
    case D_RING2_3:
    case D_RING1_4:
    case D_PK_R72U2:
    case D_PK_R72U3:
        return 2;
    case D_RUN4:
    case D_T2_8:
    case D_T8_8:
    case D_T8_16:
    case D_P8_4_2_1:
    case D_P8_4_3_1:
    case D_P8_4_4_2:
    case D_P8_4_2_2:
    case D_P8_8_2_1:
    case D_P4_8_2_1:
    case D_P4_8_3_1:
    case D_P4_8_4_2:
    case D_P8_4_1_1:
    case D_P4_8_2_2:
    case D_P4_8_2_2L:
    case D_P4_8_1_1:
    case D_M2_16_1_1:
    case D_FUSED:
        return 0;
    }
    return 0;
}

extern "C" int mb_variant_fused(int v)
{
    return variants[v].dn == D_FUSED;
}

extern "C" int mb_fused_layer(int v, const mb_layer *L, int iters, double *us,
                              uint32_t *pick_expert, float *pick_weight, char *msg)
{
    int n_sm = 0;
    CKB(sm_count(&n_sm));
    if (!fl_logits) {
        CKB(cudaMalloc(&fl_logits, sizeof(float) * 1024));
        CKB(cudaMalloc(&fl_route, sizeof *fl_route));
        CKB(cudaMalloc(&fl_tab, sizeof *fl_tab));
    }
    for (int it = 0; it < 4; it++) CKB(fl_one(v, L, it, n_sm)); /* warm-up */
    CKB(cudaDeviceSynchronize());
    float ms;
    CKB(time_launches(iters, &ms, [&](int it) { return fl_one(v, L, it + 1, n_sm); }));
    *us = ms * 1e3 / iters;
    CKB(fl_one(v, L, 0, n_sm)); /* layer 0 alone, for the caller's check */
    CKB(cudaDeviceSynchronize());
    sl_kroute r;
    CKB(cudaMemcpy(&r, fl_route, sizeof r, cudaMemcpyDeviceToHost));
    for (uint32_t k = 0; k < L->n_used; k++) {
        pick_expert[k] = r.expert[k];
        pick_weight[k] = r.weight[k];
    }
    return 0;
}

extern "C" int mb_variant_time(int v, const mb_io *io, const mb_set *sets, int nsets, int iters,
                               int which, double *us, char *msg)
{
    int n_sm = 0;
    CKB(sm_count(&n_sm));
    if (which && mb_variant_fused(v)) { /* one launch: no parts to time apart */
        *us = 0.0;
        return 0;
    }
    CKB(run_one(v, io, &sets[0], which, n_sm)); /* warm-up (and the correctness run) */
    CKB(cudaDeviceSynchronize());
    float ms;
    CKB(time_launches(
        iters, &ms, [&](int it) { return run_one(v, io, &sets[(it + 1) % nsets], which, n_sm); }));
    *us = ms * 1e3 / iters;
    /* leave set 0's result in io->out for the caller's check */
    CKB(run_one(v, io, &sets[0], 0, n_sm));
    CKB(cudaDeviceSynchronize());
    return 0;
}

extern "C" int mb_variant_stamped(int v, const mb_io *io, const mb_set *sets, int nsets, int iters,
                                  unsigned long long *gu_st, unsigned long long *dn_st, char *msg)
{
    int n_sm = 0;
    CKB(sm_count(&n_sm));
    const size_t bytes = (size_t)MB_ST_RECS * MB_ST_SLOTS * sizeof(unsigned long long);
    static_assert(MB_ST_SLOTS == SL_KSTAMP_SLOTS && MB_ST_UNITS == SL_KSTAMP_UNITS,
                  "one record layout");
    CKB(cudaMemset(gu_st, 0, bytes));
    CKB(cudaMemset(dn_st, 0, bytes));
    CKB(cudaDeviceSynchronize());
    mb_io in = *io;
    in.gu_st = gu_st;
    in.dn_st = dn_st;
    for (int it = 0; it < iters; it++) CKB(run_one(v, &in, &sets[(it + 1) % nsets], 0, n_sm));
    CKB(cudaDeviceSynchronize());
    return 0;
}

extern "C" int mb_carveout(int pct, char *msg)
{
    const cudaFuncAttribute a = cudaFuncAttributePreferredSharedMemoryCarveout;
    CKB(cudaFuncSetAttribute(k_quant_x_img, a, pct));
    CKB(cudaFuncSetAttribute(k_gateup_tma_q2_k<4, 8, 4, 2, false, false, true>, a, pct));
    CKB(cudaFuncSetAttribute(k_quant_h_pdl, a, pct));
    CKB(cudaFuncSetAttribute(k_down_pt_q3_k<4, 8, 2, 2>, a, pct));
    return 0;
}
