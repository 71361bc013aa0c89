/* test_compute_gpu.c - sluice-compute's GPU path end to end on a `tiny` checkpoint:
 * the bytes out are the same whether the kernels read the host arena in place
 * (zero-copy), read a device tier (T0) of any size, or the CPU emulation of the same
 * arithmetic computes the layer; and a fetcher restart changes nothing. Skips, saying
 * so, without a GPU. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu.h"
#include "synth.h"

static char dir[64], model[160], endpoint[160], log_path[160];

static pid_t spawn(const char *const *argv)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) dup2(fd, 2), dup2(fd, 1);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static int wait_exit(pid_t pid)
{
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static pid_t fetcher(void)
{
    const char *argv[] = {SL_BIN_DIR "/sluice-fetcher",
                          "-m",
                          model,
                          "--endpoint",
                          endpoint,
                          "--arena-slots",
                          "40",
                          "--no-mlock",
                          "-q",
                          NULL};
    return spawn(argv);
}

/* Starts sluice-compute on the rig's model and fetcher, 32 steps of seed 3 into out,
 * with the flags extra[] (NULL-terminated; a NULL inside ends them early). */
static pid_t start_compute(const char *out, const char *const *extra)
{
    const char *argv[24] = {SL_BIN_DIR "/sluice-compute",
                            "-m",
                            model,
                            "--endpoint",
                            endpoint,
                            "-n",
                            "32",
                            "--seed",
                            "3",
                            "-o",
                            out};
    int n = 11;
    while (*extra && n < 23) argv[n++] = *extra++;
    argv[n] = NULL;
    return spawn(argv);
}

/* extra: one more flag (or NULL). */
static void run_compute(const char *backend, const char *t0, const char *out, const char *extra)
{
    const char *flags[] = {"--backend", backend, "--t0-slots", t0, extra, NULL};
    cr_assert_eq(wait_exit(start_compute(out, flags)), 0,
                 "sluice-compute --backend %s --t0-slots %s %s failed", backend, t0,
                 extra ? extra : "");
}

static void same(const char *a, const char *b)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    cr_assert_eq(system(cmd), 0, "%s and %s differ (log: %s)", a, b, log_path);
}

Test(compute_gpu, same_bytes_from_every_tier_and_from_the_cpu_twin, .timeout = 300)
{
    int n = 0;
    sl_err err = {0};
    cr_assert_eq(sl_gpu_device_count(&n, &err), 0, "%s", err.msg);
    if (n == 0) cr_skip_test("no GPU present: GPU tests skipped");
    strcpy(dir, "/tmp/sl-compute-gpu-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    sl_model_config cfg;
    cr_assert_eq(sl_model_config_preset(&cfg, "tiny", &err), 0, "%s", err.msg);
    cr_assert_eq(sl_synth_write(&cfg, dir, 2, 77 + (uint64_t)getpid(), NULL, NULL, NULL, &err), 0,
                 "%s", err.msg);
    snprintf(model, sizeof model, "%s/%s-00001-of-00002.gguf", dir, cfg.name);
    snprintf(endpoint, sizeof endpoint, "ipc://%s/f.sock", dir);
    snprintf(log_path, sizeof log_path, "%s/log", dir);
    char zc[200], t0s[200], t0l[200], cpu[200], rs[200], nk[200];
    snprintf(zc, sizeof zc, "%s/zero-copy.bin", dir);
    snprintf(t0s, sizeof t0s, "%s/t0-small.bin", dir);
    snprintf(t0l, sizeof t0l, "%s/t0-large.bin", dir);
    snprintf(cpu, sizeof cpu, "%s/cpu.bin", dir);
    snprintf(rs, sizeof rs, "%s/restart.bin", dir);
    snprintf(nk, sizeof nk, "%s/norm-kernel.bin", dir);
    pid_t f = fetcher();
    run_compute("gpu", "0", zc, NULL);
    run_compute("gpu", "8", t0s, NULL);
    run_compute("gpu", "96", t0l, NULL);
    run_compute("cpu", "0", cpu, NULL);
    same(zc, t0s);
    same(zc, t0l);
    same(zc, cpu);
    /* The residual and the norm in a kernel of their own instead of inside the router. */
    run_compute("gpu", "8", nk, "--norm-kernel");
    same(zc, nk);
    /* Tracing changes no byte, and the trace holds the GPU's own spans. */
    char tr[200];
    snprintf(tr, sizeof tr, "%s/trace.json", dir);
    const char *traced[] = {"--backend", "gpu", "--t0-slots", "8", "--trace", tr, NULL};
    cr_assert_eq(wait_exit(start_compute(t0s, traced)), 0, "traced run failed (log: %s)", log_path);
    same(zc, t0s);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "grep -q 'GPU (CUDA events)' '%s' && grep -q '\"copy T1->T0\"' '%s' && "
             "grep -q '\"experts\"' '%s'",
             tr, tr, tr);
    cr_assert_eq(system(cmd), 0, "the trace %s lacks the GPU track's spans", tr);
    /* A device tier filled before the first step. */
    run_compute("gpu", "50", t0l, "--t0-preload");
    same(zc, t0l);
    /* Restarts in the middle of a GPU run: T0 sized automatically, then zero-copy (the
     * old mapping is read by queued work when the fetcher dies). */
    for (int zero_copy = 0; zero_copy < 2; zero_copy++) {
        const char *flags[] = {"--backend", "gpu", zero_copy ? "--zero-copy" : NULL, NULL};
        pid_t c = start_compute(rs, flags);
        usleep(300000);
        kill(f, SIGKILL);
        wait_exit(f);
        f = fetcher();
        cr_assert_eq(wait_exit(c), 0, "GPU run across a fetcher restart failed (log: %s)",
                     log_path);
        same(zc, rs);
    }
    kill(f, SIGTERM);
    wait_exit(f);
    printf("compute_gpu: zero-copy, T0 8, 96 and 50 preloaded slots, CPU twin, the norm as its "
           "own kernel and restarts (T0 auto, zero-copy), traced: same bytes\n");
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}
