/* test_fetcher.c - integration tests: the real sluice-fetcher process on a `tiny`
 * synthetic checkpoint, driven by the real client library over ZeroMQ.
 *
 * Every expert the client is given is compared with an independent pread of the
 * shard at the offsets the test's own slice map gives. Each test writes its
 * checkpoint with its own seed (mixed with the pid), so fingerprints, arena names and
 * endpoints never collide between tests running in parallel.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dirent.h>
#include <sched.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "arena.h"
#include "client.h"
#include "expert_map.h"
#include "gguf.h"
#include "proto.h"
#include "synth.h"
#include "trace.h"
#include "run_cmd.h"

typedef struct rig {
    char dir[64];
    char model[128];
    char endpoint[160];
    char log[128];
    sl_gguf *g;
    sl_expert_map *map;
    pid_t pid;
} rig;

static void rig_model(rig *r, uint64_t seed, uint32_t shards)
{
    strcpy(r->dir, "/tmp/sl-fetcher-XXXXXX");
    cr_assert_not_null(mkdtemp(r->dir));
    sl_model_config cfg;
    sl_err err = {0};
    cr_assert_eq(sl_model_config_preset(&cfg, "tiny", &err), 0, "%s", err.msg);
    /* The pid keeps fingerprints apart when two test runs share the machine. */
    seed = seed * 1000003u + (uint64_t)getpid();
    cr_assert_eq(sl_synth_write(&cfg, r->dir, shards, seed, NULL, NULL, NULL, &err), 0, "%s",
                 err.msg);
    snprintf(r->model, sizeof r->model, "%s/%s-00001-of-%05u.gguf", r->dir, cfg.name, shards);
    snprintf(r->endpoint, sizeof r->endpoint, "ipc://%s/fetcher.sock", r->dir);
    snprintf(r->log, sizeof r->log, "%s/fetcher.log", r->dir);
    cr_assert_eq(sl_gguf_open(&r->g, r->model, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_expert_map_build(&r->map, r->g, SL_SLOT_ALIGN, &err), 0, "%s", err.msg);
}

/* Forks and execs argv with stdout and stderr appended to the rig's log. */
static pid_t spawn(rig *r, const char *const *argv)
{
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        /* A failed assertion ends the test process: take the fetcher with it. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(r->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 2);
            dup2(fd, 1);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* Starts sluice-fetcher with extra arguments (NULL-terminated); returns its pid. */
static pid_t start_fetcher(rig *r, const char *slots, ...)
{
    const char *argv[32];
    int n = 0;
    argv[n++] = SL_BIN_DIR "/sluice-fetcher";
    argv[n++] = "-m";
    argv[n++] = r->model;
    argv[n++] = "--endpoint";
    argv[n++] = r->endpoint;
    argv[n++] = "--no-mlock";
    argv[n++] = "--readers";
    argv[n++] = "4";
    argv[n++] = "--arena-slots";
    argv[n++] = slots;
    va_list ap;
    va_start(ap, slots);
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 31) argv[n++] = a;
    va_end(ap);
    argv[n] = NULL;
    r->pid = spawn(r, argv);
    return r->pid;
}

static int wait_exit(pid_t pid)
{
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void stop_fetcher(rig *r)
{
    if (r->pid > 0) {
        kill(r->pid, SIGTERM);
        wait_exit(r->pid);
        r->pid = 0;
    }
}

static void rig_free(rig *r)
{
    stop_fetcher(r);
    sl_expert_map_free(&r->map);
    sl_gguf_close(&r->g);
    sl_test_rm_rf(r->dir);
}

static sl_fetch_client *connect_client(rig *r)
{
    sl_fetch_client_options o;
    sl_fetch_client_options_default(&o, r->endpoint);
    o.fingerprint = r->g->fingerprint;
    sl_fetch_client *c = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_open(&c, &o, &err), 0, "%s", err.msg);
    return c;
}

/* The expert's bytes in its slot equal a pread of the shard at the map's offsets. */
static void check_pin(rig *r, sl_fetch_client *c, const sl_fetch_pin *p)
{
    sl_arena *a = sl_fetch_client_arena(c);
    const uint8_t *slot = sl_arena_slot_data(a, p->slot);
    for (int part = 0; part < SL_EXPERT_N_PART; part++) {
        const sl_expert_slice *s = sl_expert_map_slice(r->map, p->layer, p->expert, part);
        uint8_t *want = malloc(s->bytes);
        cr_assert_eq(pread(r->g->shards[s->shard].fd, want, s->bytes, (off_t)s->offset),
                     (ssize_t)s->bytes);
        const uint8_t *got = slot + a->hdr->part_offset[part] + s->offset % (uint64_t)a->hdr->align;
        cr_assert(memcmp(got, want, s->bytes) == 0,
                  "layer %u expert %u part %d: slot %u holds other bytes", p->layer, p->expert,
                  part, p->slot);
        free(want);
    }
}

static uint64_t rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

/* n distinct random experts. */
static void pick(uint64_t *s, uint32_t n_expert, uint32_t *out, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        for (;;) {
            uint32_t e = (uint32_t)(rnd(s) % n_expert), dup = 0;
            for (uint32_t k = 0; k < i; k++) dup |= out[k] == e;
            if (!dup) {
                out[i] = e;
                break;
            }
        }
    }
}

/* The last lines of the fetcher's log, for failure messages. */
static const char *log_tail(rig *r)
{
    static char buf[2048];
    buf[0] = '\0';
    FILE *f = fopen(r->log, "r");
    if (!f) return buf;
    fseek(f, 0, SEEK_END);
    long n = ftell(f), from = n > (long)sizeof buf - 1 ? n - (long)sizeof buf + 1 : 0;
    fseek(f, from, SEEK_SET);
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    buf[got] = '\0';
    fclose(f);
    return buf;
}

static void get_check_put(rig *r, sl_fetch_client *c, uint32_t layer, const uint32_t *ex,
                          uint32_t n)
{
    sl_fetch_pin pins[SL_PROTO_FETCH_MAX];
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_get(c, layer, ex, n, pins, 20000, &err), 0, "%s\nfetcher log:\n%s",
                 err.msg, log_tail(r));
    for (uint32_t i = 0; i < n; i++) {
        cr_assert_eq(pins[i].layer, layer);
        cr_assert_eq(pins[i].expert, ex[i]);
        check_pin(r, c, &pins[i]);
    }
    cr_assert_eq(sl_fetch_client_put(c, pins, n, &err), 0, "%s", err.msg);
}

Test(fetcher, random_stream_under_eviction_pressure, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 101, 2);
    /* tiny: 6 layers x 16 experts, top-6: 36 slots is the least a token needs. */
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *c = connect_client(&r);
    cr_assert_eq(sl_fetch_client_welcome(c)->slot_count, 40);
    uint64_t s = 7;
    uint32_t ex[6];
    for (int step = 0; step < 300; step++) {
        uint32_t layer = (uint32_t)(rnd(&s) % r.map->n_layer);
        pick(&s, r.map->n_expert, ex, 6);
        get_check_put(&r, c, layer, ex, 6);
    }
    sl_proto_stats_reply st;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_stats(c, &st, 2000, &err), 0, "%s", err.msg);
    /* Hits the client pinned from the shared table never reach the fetcher. */
    cr_assert_leq(st.hits + st.misses, 300 * 6, "hits %lu misses %lu", (unsigned long)st.hits,
                  (unsigned long)st.misses);
    cr_assert_gt(st.misses, 96, "96 experts in 40 slots must be evicted and read again");
    cr_assert_eq(st.read_errors, 0);
    cr_assert_eq(st.pinned, 0, "every pin was given back");
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, concurrent_requests_for_one_expert, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 102, 1);
    start_fetcher(&r, "48", NULL);
    sl_fetch_client *a = connect_client(&r), *b = connect_client(&r);
    /* Both ask before either reads an answer: the second finds the read in flight
     * (or done) and both get the same slot. */
    for (uint32_t e = 0; e < r.map->n_expert; e++) {
        uint32_t ex[1] = {e};
        sl_err err = {0};
        cr_assert_eq(sl_fetch_client_prefetch(a, 3, ex, 1, &err), 0, "%s", err.msg);
        sl_fetch_pin pa, pb;
        cr_assert_eq(sl_fetch_client_get(a, 3, ex, 1, &pa, 10000, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_fetch_client_get(b, 3, ex, 1, &pb, 10000, &err), 0, "%s", err.msg);
        cr_assert_eq(pa.slot, pb.slot);
        check_pin(&r, a, &pa);
        check_pin(&r, b, &pb);
        sl_arena *ar = sl_fetch_client_arena(a);
        cr_assert_geq(atomic_load(&ar->slots[pa.slot].readers), 2);
        sl_fetch_client_put(a, &pa, 1, &err);
        sl_fetch_client_put(b, &pb, 1, &err);
    }
    sl_fetch_client_close(&a);
    sl_fetch_client_close(&b);
    rig_free(&r);
}

Test(fetcher, survives_random_and_mutated_frames, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 103, 1);
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *c = connect_client(&r);
    uint8_t buf[SL_PROTO_FRAME_MAX];
    uint64_t seed = 2024;
    sl_err err = {0};
    for (int i = 0; i < 10000; i++) {
        size_t len = sl_proto_random_frame(&seed, buf, sizeof buf);
        cr_assert_eq(sl_fetch_client_send_raw(c, buf, len, &err), 0, "%s", err.msg);
    }
    /* A valid FETCH is still served, with the right bytes. */
    uint32_t ex[6] = {0, 3, 5, 7, 11, 15};
    get_check_put(&r, c, 2, ex, 6);
    cr_assert_eq(kill(r.pid, 0), 0, "the fetcher must still be alive");
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, restart_mid_stream_gives_right_bytes, .timeout = 90)
{
    rig r = {0};
    rig_model(&r, 104, 2);
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *c = connect_client(&r);
    uint64_t epoch0 = sl_fetch_client_welcome(c)->arena_epoch;
    uint64_t s = 99;
    uint32_t ex[6];
    for (int step = 0; step < 120; step++) {
        if (step == 40 || step == 80) {
            kill(r.pid, SIGKILL); /* no clean-up: the arena stays behind, stale */
            wait_exit(r.pid);
            start_fetcher(&r, "40", NULL);
        }
        uint32_t layer = (uint32_t)(rnd(&s) % r.map->n_layer);
        pick(&s, r.map->n_expert, ex, 6);
        get_check_put(&r, c, layer, ex, 6);
    }
    cr_assert_geq(sl_fetch_client_reconnects(c), 2);
    cr_assert_neq(sl_fetch_client_welcome(c)->arena_epoch, epoch0);
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, io_error_answers_error_and_keeps_serving, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 105, 2);
    start_fetcher(&r, "40", "--no-direct", NULL);
    sl_fetch_client *c = connect_client(&r);
    /* Cut the second shard in half under the running fetcher. */
    const sl_expert_slice *last =
        sl_expert_map_slice(r.map, r.map->n_layer - 1, r.map->n_expert - 1, SL_EXPERT_DOWN);
    cr_assert_eq(last->shard, 1);
    cr_assert_eq(truncate(r.g->shards[1].path, (off_t)(last->offset - 100000)), 0);
    uint32_t bad[1] = {r.map->n_expert - 1};
    sl_fetch_pin pin;
    sl_err err = {0};
    int rc = sl_fetch_client_get(c, r.map->n_layer - 1, bad, 1, &pin, 10000, &err);
    cr_assert_eq(rc, SL_EIO, "got %d: %s", rc, err.msg);
    cr_assert(strstr(err.msg, "ERR_IO") || strstr(err.msg, "IO"), "%s", err.msg);
    cr_assert(strstr(err.msg, "file ends early"), "%s", err.msg);
    /* A good expert of shard 0 is still served. */
    uint32_t good[2] = {0, 1};
    get_check_put(&r, c, 0, good, 2);
    sl_proto_stats_reply st;
    cr_assert_eq(sl_fetch_client_stats(c, &st, 2000, &err), 0, "%s", err.msg);
    cr_assert_eq(st.read_errors, 1);
    sl_fetch_client_close(&c);
    rig_free(&r);
}

/* Runs argv to its end on an emptied log; returns the exit code, the log in out. */
static int run_to_exit(rig *r, const char *const *argv, char *out, size_t cap)
{
    truncate(r->log, 0);
    int code = wait_exit(spawn(r, argv));
    FILE *f = fopen(r->log, "r");
    size_t n = f ? fread(out, 1, cap - 1, f) : 0;
    out[n] = '\0';
    if (f) fclose(f);
    return code;
}

Test(fetcher, bad_budgets_and_a_second_fetcher_are_refused, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 106, 1);
    char out[4096];
    const char *small[] = {SL_BIN_DIR "/sluice-fetcher",
                           "-m",
                           r.model,
                           "--endpoint",
                           r.endpoint,
                           "--no-mlock",
                           "--arena-slots",
                           "10",
                           NULL};
    cr_assert_eq(run_to_exit(&r, small, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "too small") && strstr(out, "36"), "%s", out);
    const char *usage[] = {SL_BIN_DIR "/sluice-fetcher", "-m", r.model, "--arena", NULL};
    cr_assert_eq(run_to_exit(&r, usage, out, sizeof out), 2, "%s", out);
    cr_assert(strstr(out, "--arena needs SIZE"), "%s", out);
    /* A budget larger than the machine is refused before anything is allocated. */
    const char *huge[] = {SL_BIN_DIR "/sluice-fetcher",
                          "-m",
                          r.model,
                          "--endpoint",
                          r.endpoint,
                          "--arena",
                          "900T",
                          NULL};
    cr_assert_eq(run_to_exit(&r, huge, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "does not fit"), "%s", out);
    /* One fetcher per model: the second one finds the arena held. */
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *c = connect_client(&r); /* the first is up */
    pid_t first = r.pid;
    char ep2[200];
    snprintf(ep2, sizeof ep2, "ipc://%s/other.sock", r.dir);
    const char *second[] = {SL_BIN_DIR "/sluice-fetcher",
                            "-m",
                            r.model,
                            "--endpoint",
                            ep2,
                            "--arena-slots",
                            "40",
                            "--no-mlock",
                            NULL};
    cr_assert_eq(run_to_exit(&r, second, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "another fetcher"), "%s", out);
    r.pid = first;
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, sigterm_unlinks_the_arena_and_stale_arena_is_replaced, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 107, 1);
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *c = connect_client(&r);
    char name[SL_PROTO_ARENA_NAME_MAX + 1];
    strcpy(name, sl_fetch_client_welcome(c)->arena_name);
    sl_fetch_client_close(&c);
    /* kill -9 leaves the arena behind; the next fetcher replaces it. */
    kill(r.pid, SIGKILL);
    wait_exit(r.pid);
    int fd = shm_open(name, O_RDONLY, 0);
    cr_assert_geq(fd, 0, "a killed fetcher cannot unlink its arena");
    close(fd);
    start_fetcher(&r, "40", NULL);
    c = connect_client(&r);
    uint32_t ex[2] = {4, 9};
    get_check_put(&r, c, 1, ex, 2);
    sl_fetch_client_close(&c);
    kill(r.pid, SIGTERM);
    cr_assert_eq(wait_exit(r.pid), 0);
    r.pid = 0;
    cr_assert_lt(shm_open(name, O_RDONLY, 0), 0, "SIGTERM must unlink the arena");
    cr_assert_eq(errno, ENOENT);
    FILE *f = fopen(r.log, "r");
    char out[8192];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    fclose(f);
    cr_assert(strstr(out, "replacing stale arena"), "%s", out);
    cr_assert(strstr(out, "stats"), "exit prints the counters: %s", out);
    rig_free(&r);
}

Test(fetcher, prefetch_then_demand_hits, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 108, 1);
    start_fetcher(&r, "96", NULL);
    sl_fetch_client *c = connect_client(&r);
    uint32_t ex[6] = {1, 2, 3, 4, 5, 6};
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_prefetch(c, 4, ex, 6, &err), 0, "%s", err.msg);
    /* Wait until the reads landed (STATS: nothing queued or in flight). */
    sl_proto_stats_reply st;
    int landed = 0;
    for (int i = 0; i < 2000 && !landed; i++) {
        cr_assert_eq(sl_fetch_client_stats(c, &st, 2000, &err), 0, "%s", err.msg);
        landed = st.misses == 6 && st.queue_depth == 0 && st.in_flight == 0;
        if (!landed) usleep(10000);
    }
    cr_assert(landed,
              "the prefetch reads did not land in 20 s (misses %llu, queued %u, in flight %u)",
              (unsigned long long)st.misses, st.queue_depth, st.in_flight);
    sl_fetch_pin pins[6];
    cr_assert_eq(sl_fetch_client_get(c, 4, ex, 6, pins, 5000, &err), 0, "%s", err.msg);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(pins[i].from_fetcher, 0, "a prefetched expert is a shared-table hit");
        check_pin(&r, c, &pins[i]);
    }
    sl_fetch_client_put(c, pins, 6, &err);
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, demand_drops_queued_prefetches_and_takes_over_its_own, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 109, 1);
    /* One reader: prefetches queue up behind it. */
    start_fetcher(&r, "96", "--readers", "1", NULL);
    sl_fetch_client *c = connect_client(&r);
    uint32_t hint[16];
    for (uint32_t e = 0; e < 16; e++) hint[e] = e;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_prefetch(c, 5, hint, 16, &err), 0, "%s", err.msg);
    /* Demand arrives at once for the last hinted expert: its queued read becomes a
     * demand read, every other queued hint is dropped. */
    uint32_t want_hinted[1] = {15}, want_other[1] = {3};
    get_check_put(&r, c, 5, want_hinted, 1);
    sl_proto_stats_reply st;
    cr_assert_eq(sl_fetch_client_stats(c, &st, 2000, &err), 0, "%s", err.msg);
    cr_assert_gt(st.prefetch_dropped, 0, "queued prefetches must give way to demand");
    cr_assert_leq(st.prefetch_dropped, 15, "the demanded one is read, not dropped");
    cr_assert_eq(st.misses, 16 - st.prefetch_dropped, "nothing is read twice: %lu reads",
                 (unsigned long)st.misses);
    get_check_put(&r, c, 1, want_other, 1);
    cr_assert_eq(sl_fetch_client_stats(c, &st, 2000, &err), 0, "%s", err.msg);
    cr_assert_eq(st.read_errors, 0);
    cr_assert_eq(st.pinned, 0);
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, trace_and_counters_on_request, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 110, 1);
    char trace[160];
    snprintf(trace, sizeof trace, "%s/trace.json", r.dir);
    start_fetcher(&r, "40", "--trace", trace, NULL);
    sl_fetch_client *c = connect_client(&r);
    uint32_t ex[3] = {2, 7, 9};
    get_check_put(&r, c, 3, ex, 3);
    kill(r.pid, SIGUSR1);
    /* The counters appear in the log while the fetcher keeps serving. */
    int seen = 0;
    for (int i = 0; i < 500 && !seen; i++) {
        usleep(20000);
        seen = strstr(log_tail(&r), "stats after") != NULL;
    }
    cr_assert(seen, "SIGUSR1 prints the counters: %s", log_tail(&r));
    get_check_put(&r, c, 3, ex, 3);
    sl_fetch_client_close(&c);
    kill(r.pid, SIGTERM);
    cr_assert_eq(wait_exit(r.pid), 0);
    r.pid = 0;
    FILE *f = fopen(trace, "r");
    cr_assert_not_null(f, "--trace writes its file at exit");
    char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    cr_assert(strstr(buf, "\"traceEvents\""), "%s", buf);
    cr_assert(strstr(buf, "\"name\":\"read\"") && strstr(buf, "\"layer\":3,\"expert\":7"), "%s",
              buf);
    rig_free(&r);
}

/* "Cpus_allowed_list:" of thread tid of process pid, e.g. "0-1" or "1". */
static void allowed_list(pid_t pid, pid_t tid, char *out, size_t cap)
{
    char path[96], line[256];
    snprintf(path, sizeof path, "/proc/%d/task/%d/status", (int)pid, (int)tid);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    out[0] = '\0';
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "Cpus_allowed_list:", 18)) {
            sscanf(line + 18, "%63s", out);
            break;
        }
    fclose(f);
    (void)cap;
}

Test(fetcher, cpu_pins_the_serving_thread_not_the_readers, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 107, 1);
    cpu_set_t s;
    CPU_ZERO(&s);
    cr_assert_eq(sched_getaffinity(0, sizeof s, &s), 0);
    int cpu = 0;
    while (!CPU_ISSET(cpu, &s)) cpu++;
    char cpu_s[16], want[16];
    snprintf(cpu_s, sizeof cpu_s, "%d", cpu);
    start_fetcher(&r, "40", "--cpu", cpu_s, NULL);
    sl_fetch_client *c = connect_client(&r);
    uint32_t ex[6] = {0, 3, 5, 7, 9, 11};
    get_check_put(&r, c, 1, ex, 6);
    char got[64], task[64];
    allowed_list(r.pid, r.pid, got, sizeof got);
    snprintf(want, sizeof want, "%d", cpu);
    cr_assert_str_eq(got, want, "the serving thread runs on CPU %d only", cpu);
    /* The readers were started before the pin: at least one thread is free. */
    int free_threads = 0;
    snprintf(task, sizeof task, "/proc/%d/task", (int)r.pid);
    DIR *d = opendir(task);
    cr_assert_not_null(d);
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') {
            allowed_list(r.pid, (pid_t)atoi(e->d_name), got, sizeof got);
            free_threads += strcmp(got, want) != 0;
        }
    closedir(d);
    if (CPU_COUNT(&s) > 1) cr_assert_geq(free_threads, 4, "the 4 readers are not pinned");
    sl_fetch_client_close(&c);
    stop_fetcher(&r);
    char out[4096];
    const char *bad[] = {SL_BIN_DIR "/sluice-fetcher", "-m", r.model, "--cpu", "65000", NULL};
    cr_assert_eq(run_to_exit(&r, bad, out, sizeof out), 2, "%s", out);
    cr_assert(strstr(out, "CPU 65000"), "%s", out);
    rig_free(&r);
}

typedef struct pin_log {
    uint32_t calls, first_n, seen[SL_PROTO_FETCH_MAX];
    sl_fetch_pin last[SL_PROTO_FETCH_MAX];
} pin_log;

static void log_pins(void *ctx, const uint32_t *index, const sl_fetch_pin *pins, uint32_t n)
{
    pin_log *g = ctx;
    if (g->calls++ == 0) g->first_n = n;
    for (uint32_t k = 0; k < n; k++) {
        g->seen[index[k]]++;
        g->last[index[k]] = pins[k];
    }
}

Test(fetcher, get_each_reports_hits_first_then_each_ready, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 108, 1);
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *c = connect_client(&r);
    uint32_t warm[3] = {2, 6, 10};
    get_check_put(&r, c, 3, warm, 3);
    /* Three resident (in a different order) among three that must be read. */
    uint32_t ex[6] = {1, 10, 4, 2, 13, 6};
    sl_fetch_pin pins[6];
    pin_log g = {0};
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_get_each(c, 3, ex, 6, pins, 20000, log_pins, &g, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(g.first_n, 3, "the first report holds the three shared-table hits");
    cr_assert_eq(g.calls, 4, "then one report per READY");
    for (uint32_t i = 0; i < 6; i++) {
        cr_assert_eq(g.seen[i], 1, "expert %u reported once", ex[i]);
        cr_assert_eq(g.last[i].slot, pins[i].slot);
        cr_assert_eq(g.last[i].expert, ex[i]);
        cr_assert_eq(pins[i].from_fetcher, ex[i] % 4 != 2, "hits come from the table");
        check_pin(&r, c, &pins[i]);
    }
    cr_assert_eq(sl_fetch_client_put(c, pins, 6, &err), 0, "%s", err.msg);
    sl_fetch_client_close(&c);
    rig_free(&r);
}

Test(fetcher, pins_of_a_killed_compute_are_given_back_while_another_stays, .timeout = 60)
{
    rig r = {0};
    rig_model(&r, 109, 1);
    start_fetcher(&r, "40", NULL);
    sl_fetch_client *a = connect_client(&r);
    uint32_t ex[6] = {0, 1, 2, 3, 4, 5};
    get_check_put(&r, a, 2, ex, 6); /* now resident */
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
        /* A second compute process pins the six from the shared table and is killed
         * while it holds them. */
        sl_fetch_client *b = connect_client(&r);
        sl_fetch_pin pins[6];
        if (sl_fetch_client_get(b, 2, ex, 6, pins, 20000, NULL)) _exit(2);
        for (int i = 0; i < 6; i++)
            if (pins[i].from_fetcher) _exit(3);
        if (write(p[1], "x", 1) != 1) _exit(4);
        for (;;) pause();
    }
    char x;
    cr_assert_eq(read(p[0], &x, 1), 1, "the second process got its pins");
    sl_proto_stats_reply st;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_stats(a, &st, 2000, &err), 0, "%s", err.msg);
    cr_assert_eq(st.pinned, 6);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    /* Within a few heartbeats the fetcher notices the process is gone, although the
     * first client is still connected. */
    uint64_t deadline = sl_now_ns() + 10000000000ull;
    do {
        usleep(50000);
        cr_assert_eq(sl_fetch_client_stats(a, &st, 2000, &err), 0, "%s", err.msg);
    } while (st.pinned && sl_now_ns() < deadline);
    cr_assert_eq(st.pinned, 0, "the killed process's pins are given back\n%s", log_tail(&r));
    cr_assert(strstr(log_tail(&r), "gave back 6 pins"), "%s", log_tail(&r));
    get_check_put(&r, a, 2, ex, 6);
    close(p[0]);
    close(p[1]);
    sl_fetch_client_close(&a);
    rig_free(&r);
}
