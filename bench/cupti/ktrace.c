/* ktrace.c - every kernel's and copy's start and end on the GPU, for a process that knows
 * nothing of it: a CUPTI injection library (the CUDA driver loads it when
 * CUDA_INJECTION64_PATH names it). At exit it writes one line a record into the file
 * SL_KTRACE names (default ktrace.csv):
 *
 *   kind,start_ns,end_ns,stream,grid,block,name
 *
 * The GPU box has no Nsight Systems; this gives the gaps between the kernels of a layer,
 * which CUDA events between them would change (an event in the stream stops one kernel
 * from overlapping the next, docs/kernels.md).
 *
 *   CUDA_INJECTION64_PATH=build/lib/libsl_ktrace.so SL_KTRACE=t.csv sluice-compute ...
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

static void CUPTIAPI give_buffer(uint8_t **buf, size_t *size, size_t *max_records)
{
    *size = 16u << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI take_buffer(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                 size_t valid)
{
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *r = NULL;
    while (out && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            fprintf(out, "kernel,%llu,%llu,%u,%d,%d,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->streamId, k->gridX, k->blockX, k->name);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            fprintf(out, "memcpy,%llu,%llu,%u,%llu,%u,copy kind %u\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes, 0u,
                    (unsigned)m->copyKind);
        }
    }
    free(buf);
}

static void at_exit(void)
{
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (out) fclose(out);
    out = NULL;
}

int InitializeInjection(void);
int InitializeInjection(void)
{
    const char *path = getenv("SL_KTRACE");
    out = fopen(path && *path ? path : "ktrace.csv", "w");
    if (!out) return 0;
    if (cuptiActivityRegisterCallbacks(give_buffer, take_buffer) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) {
        fprintf(stderr, "ktrace: CUPTI refused the activity records\n");
        return 0;
    }
    atexit(at_exit);
    return 1;
}
