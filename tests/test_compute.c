/* test_compute.c - sluice-compute end to end against the real sluice-fetcher, on a
 * `tiny` checkpoint, through the CPU path of the pipeline (CUDA is not needed).
 *
 * The outputs of a 64-step decode must be byte-identical whatever happens around
 * them: another arena size, the fetcher killed with -9 at a random moment and started
 * again (20 trials), or a compute process killed mid-run and replaced.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "synth.h"
#include "run_cmd.h"

#define STEPS "64"

typedef struct rig {
    char dir[64], model[160], endpoint[160], log[160];
    pid_t fetcher;
} rig;

static pid_t spawn(const char *log, const char *const *argv)
{
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static int wait_exit(pid_t pid, int seconds)
{
    int st = 0;
    for (int i = 0; i < seconds * 100; i++) {
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return 255;
}

/* A tiny checkpoint in a new directory; n_layer > 6: that many layers whose tensors
 * repeat the first 6 layers' where kind, type and shape agree (synth's layer_period;
 * the added layers do not compress their attention, which the MoE layer body does not
 * run, so their MoE tensors all repeat). */
static void rig_open_layers(rig *r, uint64_t seed, uint32_t n_layer)
{
    strcpy(r->dir, "/tmp/sl-compute-XXXXXX");
    cr_assert_not_null(mkdtemp(r->dir));
    sl_model_config cfg;
    sl_err err = {0};
    cr_assert_eq(sl_model_config_preset(&cfg, "tiny", &err), 0, "%s", err.msg);
    if (n_layer > cfg.n_layer) {
        for (uint32_t l = cfg.n_layer; l < n_layer; l++) cfg.compress_ratio[l] = 0;
        cfg.layer_period = cfg.n_layer;
        cfg.n_layer = n_layer;
    }
    seed = seed * 1000003u + (uint64_t)getpid(); /* distinct arenas across parallel runs */
    cr_assert_eq(sl_synth_write(&cfg, r->dir, 2, seed, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    snprintf(r->model, sizeof r->model, "%s/%s-00001-of-00002.gguf", r->dir, cfg.name);
    snprintf(r->endpoint, sizeof r->endpoint, "ipc://%s/f.sock", r->dir);
    snprintf(r->log, sizeof r->log, "%s/log", r->dir);
}

static void start_fetcher(rig *r, const char *slots)
{
    const char *argv[] = {SL_BIN_DIR "/sluice-fetcher",
                          "-m",
                          r->model,
                          "--endpoint",
                          r->endpoint,
                          "--arena-slots",
                          slots,
                          "--no-mlock",
                          "--readers",
                          "4",
                          "-q",
                          NULL};
    r->fetcher = spawn(r->log, argv);
}

static void kill_fetcher(rig *r, int sig)
{
    kill(r->fetcher, sig);
    wait_exit(r->fetcher, 30);
    r->fetcher = 0;
}

static void rig_open(rig *r, uint64_t seed)
{
    rig_open_layers(r, seed, 0);
}

/* Starts sluice-compute on the rig's model and fetcher with the flags extra[]
 * (NULL-terminated). */
static pid_t spawn_compute(rig *r, const char *const *extra)
{
    const char *argv[32] = {SL_BIN_DIR "/sluice-compute", "-m", r->model, "--endpoint",
                            r->endpoint};
    int n = 5;
    for (; *extra; extra++) {
        cr_assert_lt(n, 31, "too many flags");
        argv[n++] = *extra;
    }
    argv[n] = NULL;
    return spawn(r->log, argv);
}

static pid_t start_compute(rig *r, const char *out)
{
    const char *flags[] = {"-n", STEPS, "--seed", "5", "-o", out, "-q", NULL};
    return spawn_compute(r, flags);
}

static void rig_close(rig *r)
{
    if (r->fetcher) kill_fetcher(r, SIGTERM);
    sl_test_rm_rf(r->dir);
}

/* The last lines of the processes' log, for failure messages. */
static const char *log_tail(const char *log)
{
    static char tail[2048];
    tail[0] = '\0';
    FILE *f = fopen(log, "r");
    if (f) {
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, n > 2000 ? n - 2000 : 0, SEEK_SET);
        size_t got = fread(tail, 1, sizeof tail - 1, f);
        tail[got] = '\0';
        fclose(f);
    }
    return tail;
}

static void same_bytes(const char *a, const char *b, const char *what, const char *log)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    int rc = system(cmd);
    cr_assert_eq(rc, 0, "%s: outputs differ from the uninterrupted run\n%s", what, log_tail(log));
    struct stat st;
    cr_assert_eq(stat(a, &st), 0);
    cr_assert_eq(st.st_size, 64 * 256 * 2, "64 steps of 256 bf16 values");
}

/* The reference: an uninterrupted run with every expert fitting in the arena. */
static void reference(rig *r, char *ref, size_t cap)
{
    snprintf(ref, cap, "%s/ref.bin", r->dir);
    start_fetcher(r, "96");
    int code = wait_exit(start_compute(r, ref), 120);
    cr_assert_eq(code, 0, "reference run failed (%d):\n%s", code, log_tail(r->log));
    kill_fetcher(r, SIGTERM);
}

/* trials of: a 64-step run with a 40-slot arena, the fetcher killed with -9 at a random
 * moment (0-1.5 s in) and started again at once. */
static void restart_trials(uint64_t seed, int trials)
{
    rig r = {0};
    rig_open(&r, seed);
    char ref[200], out[200];
    reference(&r, ref, sizeof ref);
    srand((unsigned)(time(NULL) ^ (seed << 8)));
    for (int t = 0; t < trials; t++) {
        snprintf(out, sizeof out, "%s/out%d.bin", r.dir, t);
        start_fetcher(&r, "40");
        pid_t c = start_compute(&r, out);
        usleep((useconds_t)(rand() % 1500) * 1000u);
        kill_fetcher(&r, SIGKILL);
        start_fetcher(&r, "40");
        int code = wait_exit(c, 120);
        cr_assert_eq(code, 0, "trial %d: sluice-compute exited with %d:\n%s", t, code,
                     log_tail(r.log));
        char what[64];
        snprintf(what, sizeof what, "restart trial %d", t);
        same_bytes(out, ref, what, r.log);
        kill_fetcher(&r, SIGTERM);
    }
    rig_close(&r);
}

/* 4 x 5 = 20 trials, split so that the runner's jobs can take them in parallel. */
Test(compute, fetcher_restarts_a, .timeout = 300)
{
    restart_trials(1, 5);
}
Test(compute, fetcher_restarts_b, .timeout = 300)
{
    restart_trials(2, 5);
}
Test(compute, fetcher_restarts_c, .timeout = 300)
{
    restart_trials(3, 5);
}
Test(compute, fetcher_restarts_d, .timeout = 300)
{
    restart_trials(4, 5);
}

Test(compute, a_dead_compute_leaves_the_fetcher_serving_the_next, .timeout = 300)
{
    rig r = {0};
    rig_open(&r, 5);
    char ref[200], out[200];
    reference(&r, ref, sizeof ref);
    start_fetcher(&r, "40");
    snprintf(out, sizeof out, "%s/dead.bin", r.dir);
    pid_t c = start_compute(&r, out);
    usleep(400000);
    kill(c, SIGKILL);
    wait_exit(c, 30);
    /* The next compute process finds the same fetcher and gets the same outputs. */
    snprintf(out, sizeof out, "%s/next.bin", r.dir);
    cr_assert_eq(wait_exit(start_compute(&r, out), 120), 0);
    same_bytes(out, ref, "after a dead compute process", r.log);
    cr_assert_eq(kill(r.fetcher, 0), 0, "the fetcher kept running");
    rig_close(&r);
}

Test(compute, no_fetcher_is_one_clear_error, .timeout = 60)
{
    rig r = {0};
    rig_open(&r, 6);
    char out[200];
    snprintf(out, sizeof out, "%s/none.bin", r.dir);
    const char *flags[] = {"-n", "1", "--timeout", "500", "-o", out, NULL};
    cr_assert_eq(wait_exit(spawn_compute(&r, flags), 30), 1);
    const char *log = log_tail(r.log);
    cr_assert(strstr(log, "no fetcher answered"), "%s", log);
    rig_close(&r);
}

Test(compute, front_end_runs_both_processes_and_merges_their_traces, .timeout = 120)
{
    rig r = {0};
    rig_open(&r, 7);
    char trace[200], out[200];
    snprintf(trace, sizeof trace, "%s/merged.json", r.dir);
    snprintf(out, sizeof out, "%s/front.bin", r.dir);
    const char *argv[] = {
        SL_BIN_DIR "/sluice", "bench", "moe", "-m",      r.model, "-n", "4", "--arena-slots", "40",
        "--no-mlock",         "-o",    out,   "--trace", trace,   NULL};
    cr_assert_eq(wait_exit(spawn(r.log, argv), 60), 0);
    FILE *f = fopen(trace, "r");
    cr_assert_not_null(f);
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    /* Spans of both processes: reads on the fetcher's side, the stages on compute's. */
    cr_assert(strstr(buf, "\"sluice-fetcher\"") && strstr(buf, "\"sluice-compute\""), "%.500s",
              buf);
    const char *names[] = {"\"read\"", "\"route\"", "\"wait\"", "\"compute\""};
    for (int i = 0; i < 4; i++) cr_assert(strstr(buf, names[i]), "no %s span", names[i]);
    struct stat st;
    cr_assert_eq(stat(out, &st), 0);
    cr_assert_eq(st.st_size, 4 * 256 * 2);
    const char *log = log_tail(r.log);
    cr_assert(strstr(log, "tokens/s") && strstr(log, "hits") && strstr(log, "per step: route"),
              "every run ends with a summary: %s", log);
    rig_close(&r);
}

Test(compute, prefetch_changes_no_byte, .timeout = 120)
{
    rig r = {0};
    rig_open(&r, 8);
    char ref[200], out[200];
    reference(&r, ref, sizeof ref);
    start_fetcher(&r, "40");
    snprintf(out, sizeof out, "%s/prefetch.bin", r.dir);
    const char *flags[] = {"-n", STEPS, "--seed", "5", "-o", out, "--prefetch", NULL};
    cr_assert_eq(wait_exit(spawn_compute(&r, flags), 120), 0);
    same_bytes(out, ref, "with prefetch", r.log);
    const char *log = log_tail(r.log);
    cr_assert(strstr(log, "prefetch:") && strstr(log, "wasted reads per useful one"),
              "the summary reports coverage and waste: %s", log);
    rig_close(&r);
}

Test(compute, synthetic_routing_is_deterministic_across_arena_sizes, .timeout = 120)
{
    rig r = {0};
    rig_open(&r, 9);
    char a[200], b[200];
    snprintf(a, sizeof a, "%s/zipf40.bin", r.dir);
    snprintf(b, sizeof b, "%s/zipf96.bin", r.dir);
    const char *slots[2] = {"40", "96"};
    const char *outs[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        start_fetcher(&r, slots[i]);
        const char *flags[] = {"-n", "16", "--routing", "zipf:1.2", "-o", outs[i], NULL};
        cr_assert_eq(wait_exit(spawn_compute(&r, flags), 120), 0, "%s", log_tail(r.log));
        kill_fetcher(&r, SIGTERM);
    }
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    cr_assert_eq(system(cmd), 0, "zipf routing must not depend on the arena size");
    const char *bad[] = {SL_BIN_DIR "/sluice-compute", "-m", r.model, "--routing", "zipf:-1", NULL};
    cr_assert_eq(wait_exit(spawn(r.log, bad), 30), 2);
    cr_assert(strstr(log_tail(r.log), "--routing zipf:-1"), "%s", log_tail(r.log));
    rig_close(&r);
}

Test(compute, warmup_steps_leave_the_counters_and_floors_are_printed, .timeout = 120)
{
    rig r = {0};
    rig_open(&r, 10);
    char ref[200], out[200], n_after[16];
    reference(&r, ref, sizeof ref);
    start_fetcher(&r, "40");
    snprintf(out, sizeof out, "%s/warm.bin", r.dir);
    snprintf(n_after, sizeof n_after, "%d", atoi(STEPS) - 3);
    /* 3 warm-up steps then the rest: the same steps, so the same bytes out. */
    const char *flags[] = {
        "-n", n_after, "--warmup", "3",          "--seed",
        "5",  "-o",    out,        "--ceilings", "disk=2.5,hbm=4000,copy=50,zc=45",
        NULL};
    cr_assert_eq(wait_exit(spawn_compute(&r, flags), 120), 0, "%s", log_tail(r.log));
    same_bytes(out, ref, "after a warm-up", r.log);
    const char *log = log_tail(r.log);
    char want[64];
    snprintf(want, sizeof want, "sluice-compute: %s steps in", n_after);
    cr_assert(strstr(log, want), "only the measured steps are counted: %s", log);
    cr_assert(strstr(log, "byte floor per step") && strstr(log, "x its floor of"), "%s", log);
    cr_assert(strstr(log, "at 2.50 GB/s"), "the disk ceiling given is used: %s", log);
    cr_assert(strstr(log, "memory plan:") && strstr(log, "T1 host arena"), "%s", log);
    kill_fetcher(&r, SIGTERM);
    const char *bad[][2] = {{"--ceilings", "hbm=fast"},
                            {"--ceilings", "pcie=50"},
                            {"--t0", "lots"},
                            {"--cpu", "100000"}};
    for (int i = 0; i < 4; i++) {
        const char *a[] = {SL_BIN_DIR "/sluice-compute", "-m", r.model, bad[i][0], bad[i][1], NULL};
        cr_assert_eq(wait_exit(spawn(r.log, a), 30), 2, "%s %s", bad[i][0], bad[i][1]);
        cr_assert(strstr(log_tail(r.log), bad[i][1]) || strstr(log_tail(r.log), "CPU"), "%s",
                  log_tail(r.log));
    }
    rig_close(&r);
}

/* --layer-passes N runs the layers N times a step: the summary counts N times the
 * layers (12 here, extrapolated to 40; 42 needs no extrapolation), the second
 * pass changes the output, and 0 passes is refused. */
Test(compute, layer_passes_run_the_layers_again, .timeout = 120)
{
    rig r = {0};
    rig_open(&r, 11);
    char ref[200], out[200];
    reference(&r, ref, sizeof ref);
    start_fetcher(&r, "96");
    snprintf(out, sizeof out, "%s/passes.bin", r.dir);
    const char *passes[2] = {"2", "7"};
    const char *layers[2] = {"step (12 layers)", "step (42 layers)"};
    for (int i = 0; i < 2; i++) {
        const char *flags[] = {
            "-n",      "4",  "--seed", "5",          "--layer-passes",
            passes[i], "-o", out,      "--ceilings", "disk=2.5,hbm=4000,copy=50,zc=45",
            NULL};
        cr_assert_eq(wait_exit(spawn_compute(&r, flags), 120), 0, "%s", log_tail(r.log));
        const char *log = log_tail(r.log), *run = log; /* this run's summary: the last */
        for (const char *p = log; (p = strstr(p, "steps in")); p++) run = p;
        cr_assert(strstr(run, layers[i]), "%s", log);
        cr_assert_eq(strstr(run, "extrapolated to 40 layers") != NULL, i == 0, "%s", log);
    }
    char cmd[512]; /* -o appends: its first 4 steps are the 2-pass run's, against 1 pass */
    snprintf(cmd, sizeof cmd, "cmp -s -n %d '%s' '%s'", 4 * 256 * 2, ref, out);
    cr_assert_neq(system(cmd), 0, "more passes, another h");
    kill_fetcher(&r, SIGTERM);
    const char *bad[] = {SL_BIN_DIR "/sluice-compute", "-m", r.model, "--layer-passes", "0", NULL};
    cr_assert_eq(wait_exit(spawn(r.log, bad), 30), 2);
    cr_assert(strstr(log_tail(r.log), "--layer-passes"), "%s", log_tail(r.log));
    rig_close(&r);
}

/* The same 6 layers run twice a step (--layer-passes 2) and a 12-layer checkpoint whose
 * layers 6-11 repeat 0-5 run once give the same bytes: a later pass starts from the
 * last layer's output and residual, as layer 6 would. */
Test(compute, layer_passes_equal_the_deeper_model, .timeout = 120)
{
    rig r = {0}, d = {0};
    rig_open(&r, 13);
    rig_open_layers(&d, 13, 12);
    char deep[200], twice[200];
    snprintf(deep, sizeof deep, "%s/deep.bin", d.dir);
    snprintf(twice, sizeof twice, "%s/twice.bin", r.dir);
    for (int k = 0; k < 2; k++) {
        rig *x = k ? &r : &d;
        start_fetcher(x, "96");
        const char *flags[] = {
            "-n",          STEPS, "--seed",         "5",  "--routing", "router", "--layer-passes",
            k ? "2" : "1", "-o",  k ? twice : deep, "-q", NULL};
        cr_assert_eq(wait_exit(spawn_compute(x, flags), 120), 0, "%s", log_tail(x->log));
        kill_fetcher(x, SIGTERM);
    }
    same_bytes(twice, deep, "2 passes of 6 layers against 12 layers", r.log);
    rig_close(&d);
    rig_close(&r);
}
