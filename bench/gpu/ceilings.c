/* ceilings.c - `bench-ceilings`: the ceilings of every path an expert's bytes take,
 * measured on this machine now, for `sluice-compute --ceilings` (byte floors) and
 * for reading any benchmark figure against:
 *
 *   hbm   a kernel reading 2 GiB of device memory with 16-byte loads;
 *   copy  cudaMemcpy from a registered POSIX shm mapping (what the arena is) to the GPU;
 *   zc    a kernel reading that mapping in place (zero-copy);
 *   disk  O_DIRECT preads of expert windows straight from the shards, the best of 2, 4,
 *         ... 64 threads (disk_ceiling.h).
 *
 * The last line of its output is the --ceilings argument, in GB/s.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../disk_ceiling.h"
#include "expert_map.h"
#include "gguf.h"
#include "gpu.h"
#include "opts.h"

/* One clear error and exit: e's message, or errno's after a failed system call. */
static void die(const char *what, const sl_err *e)
{
    fprintf(stderr, "bench-ceilings: %s: %s\n", what, e ? e->msg : strerror(errno));
    exit(1);
}

/* The same for a failure that is neither (no errno to print). */
static void fail(const char *what)
{
    fprintf(stderr, "bench-ceilings: %s\n", what);
    exit(1);
}

int main(int argc, char **argv)
{
    const char *model = NULL, *out_path = NULL;
    uint32_t disk_experts = 384, disk_first = 0, disk_stride = 1, threads = 0;
    sl_err err = {0};
    for (int i = 1; i < argc; i++) {
        /* the disk's flags: whole numbers (the stride and count from 1), or one clear error */
        uint32_t *num = !strcmp(argv[i], "--disk-experts")  ? &disk_experts
                        : !strcmp(argv[i], "--disk-first")  ? &disk_first
                        : !strcmp(argv[i], "--disk-stride") ? &disk_stride
                                                            : NULL;
        if (num && i + 1 < argc) {
            uint64_t v = 0;
            if (sl_opt_u64(argv[i], argv[i + 1], num == &disk_first ? 0 : 1, UINT32_MAX, &v, &err))
                die("bad flag", &err);
            *num = (uint32_t)v;
            i++;
        } else if (!strcmp(argv[i], "-m") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "-o") && i + 1 < argc)
            out_path = argv[++i];
        else {
            fprintf(stderr,
                    "usage: bench-ceilings -m FIRST_SHARD [--disk-experts N] [--disk-first I] "
                    "[--disk-stride S] [-o FILE]\n"
                    "Measures the HBM, host->device copy, zero-copy and disk read "
                    "ceilings (the disk's\nover N experts: layer-major indices I, I + S, ..., "
                    "default 384 from 0, stride 1);\nthe last line is sluice-compute's "
                    "--ceilings argument.\n");
            return 2;
        }
    }
    if (!model) fail("-m FIRST_SHARD is required");
    int n_gpu = 0;
    if (sl_gpu_device_count(&n_gpu, &err)) die("CUDA", &err);
    if (!n_gpu) fail("no GPU");
    char desc[256];
    if (sl_gpu_describe(0, desc, sizeof desc, &err)) die("describe", &err);

    double hbm = 0, copy = 0, zc = 0;
    if (sl_gpu_ceiling_hbm(0, 2ull << 30, &hbm, &err)) die("HBM ceiling", &err);

    /* A registered shm mapping of 1 GiB, made like the fetcher's arena. */
    size_t host_bytes = 1ull << 30;
    char name[64];
    snprintf(name, sizeof name, "/sluice-ceilings-%d", (int)getpid());
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) die("shm_open", NULL);
    shm_unlink(name);
    if (ftruncate(fd, (off_t)host_bytes) != 0) die("ftruncate", NULL);
    void *host = mmap(NULL, host_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (host == MAP_FAILED) die("mmap", NULL);
    memset(host, 1, host_bytes);
    void *dev = NULL;
    if (sl_gpu_host_register(host, host_bytes, &dev, &err)) die("register", &err);
    unsigned sum = 0;
    if (sl_gpu_ceiling_host(0, host, host_bytes, &copy, &zc, &sum, &err))
        die("host ceilings", &err);
    if (sum != sl_gpu_read_xor_cpu(host, host_bytes)) fail("zero-copy read checksum mismatch");
    sl_gpu_host_unregister(host, NULL);
    munmap(host, host_bytes);

    sl_gguf *g = NULL;
    sl_expert_map *m = NULL;
    if (sl_gguf_open(&g, model, &err)) die("open model", &err);
    if (sl_expert_map_build(&m, g, SL_SLOT_ALIGN, &err)) die("expert map", &err);
    uint32_t n_all = m->n_layer * m->n_expert;
    if (disk_first >= n_all) disk_first = 0;
    const uint32_t fit = (n_all - disk_first + disk_stride - 1) / disk_stride; /* in range */
    if (disk_experts > fit) disk_experts = fit;
    uint64_t disk_bytes = 0;
    double by_depth[SL_BENCH_DISK_DEPTHS];
    double disk = sl_bench_disk_best(g, m, disk_first, disk_stride, disk_experts, &disk_bytes,
                                     &threads, by_depth);
    char depths[256];
    int at = 0;
    for (int k = 0; k < SL_BENCH_DISK_DEPTHS && at < (int)sizeof depths; k++)
        at += snprintf(depths + at, sizeof depths - (size_t)at, "%s%u: %.2f", k ? ", " : "",
                       sl_bench_disk_depth[k], by_depth[k] / 1e9);

    FILE *out = out_path ? fopen(out_path, "w") : NULL;
    FILE *fs[2] = {stdout, out};
    for (int k = 0; k < 2; k++) {
        FILE *f = fs[k];
        if (!f) continue;
        fprintf(
            f,
            "\n%s\n\n| path | GB/s | how |\n|---|---|---|\n"
            "| hbm | %.0f | kernel reading 2 GiB of device memory, 16-byte loads, best of 5 |\n"
            "| copy | %.1f | cudaMemcpy from a registered 1 GiB POSIX shm mapping, best of 3 |\n"
            "| zc | %.1f | kernel reading that mapping in place, best of 3 |\n"
            "| disk | %.2f | O_DIRECT expert windows, best of 2-64 threads (%u), %u experts "
            "from %u, stride %u (%.2f GB) |\n\nThe disk by threads (GB/s, a run of experts "
            "each): %s\n\n",
            desc, hbm / 1e9, copy / 1e9, zc / 1e9, disk / 1e9, threads, disk_experts, disk_first,
            disk_stride, (double)disk_bytes / 1e9, depths);
    }
    if (out) fclose(out);
    printf("--ceilings hbm=%.0f,copy=%.1f,zc=%.1f,disk=%.2f\n", hbm / 1e9, copy / 1e9, zc / 1e9,
           disk / 1e9);
    sl_expert_map_free(&m);
    sl_gguf_close(&g);
    return 0;
}
