/* launch.c - bench-launch: what a kernel launch costs on the GPU's side, back to back
 * on one stream, with and without programmatic dependent launch, and whether kernels
 * that need different L1 / shared-memory splits cost more in turn than alike ones
 * (the MoE chain alternates small kernels and ~115 KB bulk-copy kernels).
 *
 * usage: bench-launch [-o FILE.md] [--n N (2000)]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"
#include "launch_bench.h"

int main(int argc, char **argv)
{
    const char *out = NULL;
    int n = 2000;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc)
            out = argv[++i];
        else if (!strcmp(argv[i], "--n") && i + 1 < argc)
            n = atoi(argv[++i]);
        else {
            printf("usage: bench-launch [-o FILE.md] [--n N (2000)]\n");
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    sl_err err = {0};
    int ndev = 0;
    if (sl_gpu_device_count(&ndev, &err)) {
        fprintf(stderr, "bench-launch: %s\n", err.msg);
        return 1;
    }
    if (ndev == 0) {
        printf("bench-launch: no GPU present, nothing measured\n");
        return 0;
    }
    FILE *md = out ? fopen(out, "w") : NULL;
    if (out && !md) {
        fprintf(stderr, "bench-launch: cannot write %s\n", out);
        return 1;
    }
    char desc[256];
    if (sl_gpu_describe(0, desc, sizeof desc, &err)) {
        fprintf(stderr, "bench-launch: %s\n", err.msg);
        return 1;
    }
    const size_t smem = 115 * 1024;
    char line[512];
    snprintf(line, sizeof line,
             "# bench-launch, %s\n\n%d launches back to back (best of 3), one CTA of 256 threads "
             "an SM; the large kernel holds %zu KB of dynamic shared memory.\n\n| kernels | PDL | "
             "carveout | us a launch |\n|---|---|---|---|\n",
             desc, n, smem / 1024);
    fputs(line, stdout);
    if (md) fputs(line, md);
    static const char *kinds[] = {"empty", "115 KB shared", "empty and 115 KB in turn"};
    static const int carves[2] = {-1, 100}; /* the driver's choice, the most shared memory */
    for (int pdl = 0; pdl <= 1; pdl++)
        for (int ci = 0; ci < 2; ci++)
            for (int k = LB_NOP; k <= LB_ALTERNATE; k++) {
                const int carve = carves[ci];
                double us = 0;
                char msg[256] = "";
                if (lb_chain(k, n, pdl, carve, smem, &us, msg)) {
                    fprintf(stderr, "bench-launch: %s\n", msg);
                    return 1;
                }
                snprintf(line, sizeof line, "| %s | %s | %s | %.2f |\n", kinds[k],
                         pdl ? "yes" : "no", carve < 0 ? "driver's" : "100% shared", us);
                fputs(line, stdout);
                if (md) fputs(line, md);
            }
    if (md) fclose(md);
    return 0;
}
