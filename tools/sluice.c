/* sluice.c - the front end: starts and supervises the processes so that a user never
 * has to.
 *
 *   sluice bench moe -m FIRST_SHARD [-n STEPS] [--arena SIZE | --arena-slots N]
 *                    [--readers N] [--seed S] [-o OUT] [--trace FILE]
 *
 * starts sluice-fetcher on a private endpoint, runs the decode steps of the MoE layers
 * in this process (the sluice-compute engine), stops the fetcher, prints the summary
 * of both, and with --trace writes one Chrome trace JSON holding the spans of both
 * processes (their CLOCK_MONOTONIC is the same clock).
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "compute.h"
#include "trace.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: sluice bench moe -m FIRST_SHARD [options]\n"
               "  -m FILE             checkpoint (any shard)\n"
               "  -n N                decode steps (default 16)\n"
               "  --arena SIZE        fetcher arena budget (e.g. 80G)\n"
               "  --arena-slots N     fetcher arena size in expert slots\n"
               "  --readers N         fetcher reader threads\n"
               "  --policy NAME       fetcher eviction policy (oldest-random, lru)\n"
               "  --no-mlock, --no-direct   passed to the fetcher\n"
               "  --seed N            seed of the tokens of the steps\n"
               "  -o FILE             every step's output (bf16) to FILE\n"
               "  --trace FILE        one Chrome trace JSON of both processes\n"
               "  any other sluice-compute option (--backend, --t0, --t0-slots, --zero-copy,\n"
               "  --t0-preload, --routing, --warmup, --ceilings, --prefetch, --cpu; see\n"
               "  sluice-compute --help) goes to the compute side\n");
}

int main(int argc, char **argv)
{
    if (argc < 3 || strcmp(argv[1], "bench") || strcmp(argv[2], "moe")) {
        usage(argc >= 2 && !strcmp(argv[1], "--help") ? stdout : stderr);
        return argc >= 2 && !strcmp(argv[1], "--help") ? 0 : 2;
    }
    const char *model = NULL, *arena = NULL, *slots = NULL, *readers = NULL, *trace = NULL;
    const char *policy = NULL;
    int no_mlock = 0, no_direct = 0;
    sl_compute_options co;
    sl_compute_options_default(&co);
    /* Options for the compute engine are parsed by its own table. */
    const char *cargv[32] = {"sluice"};
    int cargc = 1;
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i];
        int has_value = i + 1 < argc;
        if (!strcmp(a, "--arena") && has_value)
            arena = argv[++i];
        else if (!strcmp(a, "--arena-slots") && has_value)
            slots = argv[++i];
        else if (!strcmp(a, "--readers") && has_value)
            readers = argv[++i];
        else if (!strcmp(a, "--trace") && has_value)
            trace = argv[++i];
        else if (!strcmp(a, "--policy") && has_value)
            policy = argv[++i];
        else if (!strcmp(a, "--no-mlock"))
            no_mlock = 1;
        else if (!strcmp(a, "--no-direct"))
            no_direct = 1;
        else if ((!strcmp(a, "-h") || !strcmp(a, "--help"))) {
            usage(stdout);
            return 0;
        } else if (cargc < 30) {
            if (!strcmp(a, "-m") && has_value) model = argv[i + 1];
            cargv[cargc++] = a;
        }
    }
    sl_err err = {0};
    if (sl_compute_parse_args(&co, cargc, (char **)cargv, stdout, &err)) {
        fprintf(stderr, "sluice: %s\n", err.msg);
        return 2;
    }
    (void)model;

    char dir[] = "/tmp/sluice-run-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "sluice: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    char endpoint[128], ftrace[128], ctrace[128], self[PATH_MAX], fetcher[PATH_MAX + 32];
    snprintf(endpoint, sizeof endpoint, "ipc://%s/fetcher.sock", dir);
    snprintf(ftrace, sizeof ftrace, "%s/fetcher.json", dir);
    snprintf(ctrace, sizeof ctrace, "%s/compute.json", dir);
    ssize_t sn = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sn < 0) {
        fprintf(stderr, "sluice: readlink(/proc/self/exe): %s\n", strerror(errno));
        return 1;
    }
    self[sn] = '\0';
    *strrchr(self, '/') = '\0';
    snprintf(fetcher, sizeof fetcher, "%s/sluice-fetcher", self);

    const char *fargv[24];
    int fn = 0;
    fargv[fn++] = fetcher;
    fargv[fn++] = "-m";
    fargv[fn++] = co.model;
    fargv[fn++] = "--endpoint";
    fargv[fn++] = endpoint;
    if (arena) fargv[fn++] = "--arena", fargv[fn++] = arena;
    if (slots) fargv[fn++] = "--arena-slots", fargv[fn++] = slots;
    if (readers) fargv[fn++] = "--readers", fargv[fn++] = readers;
    if (trace) fargv[fn++] = "--trace", fargv[fn++] = ftrace;
    if (policy) fargv[fn++] = "--policy", fargv[fn++] = policy;
    if (no_mlock) fargv[fn++] = "--no-mlock";
    if (no_direct) fargv[fn++] = "--no-direct";
    fargv[fn] = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        execv(fetcher, (char *const *)fargv);
        fprintf(stderr, "sluice: cannot run %s: %s\n", fetcher, strerror(errno));
        _exit(127);
    }

    co.endpoint = endpoint;
    if (trace) co.trace_path = ctrace;
    sl_compute *c = NULL;
    int rc = sl_compute_open(&c, &co, &err);
    if (!rc) rc = sl_compute_run(c, &err);
    if (rc) fprintf(stderr, "sluice: %s\n", err.msg);
    if (c) sl_compute_print_summary(c, stderr);
    sl_compute_close(&c); /* writes the compute trace */
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0); /* the fetcher prints its counters and writes its trace */
    if (trace) {
        const char *parts[2] = {ftrace, ctrace};
        int merged = 0;
        if (sl_trace_merge_json(parts, 2, trace, &merged, &err)) {
            fprintf(stderr, "sluice: %s\n", err.msg);
            rc = rc ? rc : 1;
        } else {
            fprintf(stderr, "sluice: trace of %d processes written to %s (open it in Perfetto)\n",
                    merged, trace);
        }
    }
    unlink(ftrace);
    unlink(ctrace);
    rmdir(dir);
    return rc ? 1 : 0;
}
