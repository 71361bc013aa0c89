/* test_ceiling_gpu.c - the ceiling measurements: they run, give plausible figures, and
 * the zero-copy read kernel reads every word (its checksum against the CPU twin). */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "gpu.h"

static int have_gpu(void)
{
    int n = 0;
    sl_err err = {0};
    cr_assert_eq(sl_gpu_device_count(&n, &err), 0, "%s", err.msg);
    return n > 0;
}

Test(ceiling_gpu, figures_and_checksum)
{
    if (!have_gpu()) cr_skip_test("no GPU present: GPU tests skipped");
    sl_err err = {0};
    sl_gpu_mem mem;
    cr_assert_eq(sl_gpu_mem_info(0, &mem, &err), 0, "%s", err.msg);
    cr_assert_gt(mem.total_bytes, 0);
    cr_assert_leq(mem.free_bytes, mem.total_bytes);
    double hbm = 0, copy = 0, zc = 0;
    cr_assert_eq(sl_gpu_ceiling_hbm(0, 256u << 20, &hbm, &err), 0, "%s", err.msg);
    size_t bytes = 64u << 20;
    uint32_t *host = NULL;
    cr_assert_eq(posix_memalign((void **)&host, 4096, bytes), 0);
    uint64_t s = 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)host;
    for (size_t i = 0; i < bytes / 4; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        host[i] = (uint32_t)s;
    }
    void *dev = NULL;
    cr_assert_eq(sl_gpu_host_register(host, bytes, &dev, &err), 0, "%s", err.msg);
    unsigned sum = 0;
    cr_assert_eq(sl_gpu_ceiling_host(0, host, bytes, &copy, &zc, &sum, &err), 0, "%s", err.msg);
    cr_assert_eq(sum, sl_gpu_read_xor_cpu(host, bytes), "every word read in place");
    cr_assert_eq(sl_gpu_ceiling_host(0, (char *)host + 4, 4096, &copy, &zc, NULL, &err), SL_EINVAL);
    printf("ceiling_gpu: %s, hbm %.0f GB/s, copy %.1f GB/s, zero-copy %.1f GB/s, free %.1f of %.1f "
           "GiB, shares host memory %d\n",
           "device 0", hbm / 1e9, copy / 1e9, zc / 1e9, (double)mem.free_bytes / (1 << 30),
           (double)mem.total_bytes / (1 << 30), mem.shares_host_memory);
    /* Plausible for any CUDA GPU of the last decade, and not absurd. */
    cr_assert(hbm > 50e9 && hbm < 50e12, "hbm %.3g", hbm);
    cr_assert(copy > 1e9 && copy < 2e12, "copy %.3g", copy);
    cr_assert(zc > 1e9 && zc < 2e12, "zero-copy %.3g", zc);
    sl_gpu_host_unregister(host, NULL);
    free(host);
}
