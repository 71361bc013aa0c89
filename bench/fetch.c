/* fetch.c - `bench-fetch`: how close the fetcher comes to the disk and to the
 * socket.
 *
 *   1. ceiling: raw O_DIRECT preads of expert-sized aligned windows at the experts'
 *      own offsets, straight from the shards (no fetcher), the best of 2, 4, ... 64
 *      threads (disk_ceiling.h);
 *   2. cold reads through the fetcher: FETCH every expert of the checkpoint once
 *      (none resident), N readers, as many requests in flight as the readers can
 *      take, and time the bytes until the last READY;
 *   3. hit round trip: FETCH of one resident expert -> READY (source hit), timed
 *      one at a time on ipc://, p50 / p99 / max.
 *
 * It starts the real sluice-fetcher (from the folder this program lives in), drives
 * it with the real client, and prints a markdown table with the command line.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "affinity.h"
#include "disk_ceiling.h"
#include "client.h"
#include "expert_map.h"
#include "gguf.h"
#include "proto.h"
#include "trace.h"

typedef struct bench_opts {
    const char *model;
    uint32_t readers;
    uint32_t ceiling_reads; /* expert windows read for the ceiling */
    uint32_t rtt_samples;
    const char *fetcher_bin;
    const char *out;             /* markdown file, or NULL */
    int pin_fetcher, pin_client; /* --pin A,B: CPUs of the pinned hit round trips */
} bench_opts;

static void die(const char *what, const sl_err *e)
{
    fprintf(stderr, "bench-fetch: %s: %s\n", what, e ? e->msg : strerror(errno));
    exit(1);
}

/* ---- 1. the disk's own ceiling: disk_ceiling.h ---- */

/* ---- the fetcher process ---- */

/* Starts sluice-fetcher; cpu >= 0 pins its serving and I/O threads (--cpu). */
static pid_t start_fetcher(const bench_opts *o, const char *endpoint, uint32_t slots, int cpu)
{
    char slots_s[16], readers_s[16], cpu_s[16];
    snprintf(slots_s, sizeof slots_s, "%u", slots);
    snprintf(readers_s, sizeof readers_s, "%u", o->readers);
    snprintf(cpu_s, sizeof cpu_s, "%d", cpu);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (cpu >= 0)
            execl(o->fetcher_bin, o->fetcher_bin, "-m", o->model, "--endpoint", endpoint,
                  "--arena-slots", slots_s, "--readers", readers_s, "--cpu", cpu_s, (char *)NULL);
        else
            execl(o->fetcher_bin, o->fetcher_bin, "-m", o->model, "--endpoint", endpoint,
                  "--arena-slots", slots_s, "--readers", readers_s, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static void stop_fetcher(pid_t pid)
{
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

/* Sends a demand FETCH of one expert with request id req. */
static void send_fetch(sl_fetch_client *c, uint64_t req, uint32_t layer, uint32_t expert)
{
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_FETCH;
    m.fetch.req = req;
    m.fetch.layer = layer;
    m.fetch.n_expert = 1;
    m.fetch.expert[0] = expert;
    m.fetch.priority = SL_PROTO_DEMAND;
    uint8_t frame[SL_PROTO_FRAME_MAX];
    size_t len;
    sl_err err = {0};
    if (sl_proto_encode(&m, frame, sizeof frame, &len, &err)) die("encode FETCH", &err);
    if (sl_fetch_client_send_raw(c, frame, len, &err)) die("send FETCH", &err);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Hit round trips and the socket floor under them, in us. */
typedef struct hit_rtt {
    double p50, p99, max;
    double ping50; /* PING->PONG p50 through the same sockets and loop */
} hit_rtt;

static void send_release(sl_fetch_client *c, uint64_t epoch, uint32_t slot, uint32_t generation)
{
    sl_proto_msg rel;
    memset(&rel, 0, sizeof rel);
    rel.type = SL_PROTO_RELEASE;
    rel.release.arena_epoch = epoch;
    rel.release.n_slot = 1;
    rel.release.slot[0].slot = slot;
    rel.release.slot[0].generation = generation;
    uint8_t frame[SL_PROTO_FRAME_MAX];
    size_t len;
    sl_err err = {0};
    if (sl_proto_encode(&rel, frame, sizeof frame, &len, &err)) die("encode RELEASE", &err);
    sl_fetch_client_send_raw(c, frame, len, &err);
}

/* FETCH -> READY (hit) -> RELEASE of the resident experts first .. first + n - 1 in
 * turn, one at a time, then PING -> PONG: samples of each. */
static hit_rtt measure_hits(sl_fetch_client *c, const sl_expert_map *m, uint32_t first, uint32_t n,
                            uint32_t samples, uint64_t *req)
{
    sl_err err = {0};
    uint64_t epoch = sl_fetch_client_welcome(c)->arena_epoch;
    uint64_t *rtt = calloc(samples, sizeof *rtt), *ping = calloc(samples, sizeof *ping);
    if (!rtt || !ping) die("out of memory", NULL);
    for (uint32_t k = 0; k < samples; k++) {
        uint32_t i = first + k % n;
        uint64_t a = sl_now_ns();
        send_fetch(c, (*req)++, i / m->n_expert, i % m->n_expert);
        sl_proto_msg r;
        do {
            if (sl_fetch_client_recv(c, &r, 5000, &err)) die("waiting for hit", &err);
        } while (r.type != SL_PROTO_READY);
        rtt[k] = sl_now_ns() - a;
        if (r.ready.source != SL_PROTO_SRC_HIT) {
            fprintf(stderr, "bench-fetch: expected a hit, got a disk read\n");
            exit(1);
        }
        send_release(c, epoch, r.ready.slot, r.ready.generation);
    }
    for (uint32_t k = 0; k < samples; k++)
        if (sl_fetch_client_ping(c, &ping[k], 5000, &err)) die("PING", &err);
    qsort(rtt, samples, sizeof *rtt, cmp_u64);
    qsort(ping, samples, sizeof *ping, cmp_u64);
    hit_rtt h = {.p50 = (double)rtt[samples / 2] / 1e3,
                 .p99 = (double)rtt[(uint64_t)samples * 99 / 100] / 1e3,
                 .max = (double)rtt[samples - 1] / 1e3,
                 .ping50 = (double)ping[samples / 2] / 1e3};
    free(rtt);
    free(ping);
    return h;
}

/* The table rows of one hit round-trip measurement. */
static void print_rtt_rows(FILE *f, const char *label, const hit_rtt *h)
{
    fprintf(f, "| hit FETCH->READY p50, %s | %.1f us | target <= 30 us | %.2fx the target |\n",
            label, h->p50, h->p50 / 30.0);
    fprintf(f, "| hit FETCH->READY p99 / max, %s | %.1f / %.1f us | | |\n", label, h->p99, h->max);
    fprintf(f,
            "| floor: PING->PONG p50 (same sockets and loop), %s | %.1f us | | hit RTT is %.2fx "
            "the floor |\n",
            label, h->ping50, h->p50 / h->ping50);
}

/* Reads experts first .. first + n - 1 into a fresh fetcher's arena (misses). */
static void warm(sl_fetch_client *c, const sl_expert_map *m, uint32_t first, uint32_t n,
                 uint64_t *req)
{
    sl_err err = {0};
    uint64_t epoch = sl_fetch_client_welcome(c)->arena_epoch;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = first + k;
        send_fetch(c, (*req)++, i / m->n_expert, i % m->n_expert);
        sl_proto_msg r;
        do {
            if (sl_fetch_client_recv(c, &r, 60000, &err)) die("warming", &err);
            if (r.type == SL_PROTO_ERROR) die(r.error.text, NULL);
        } while (r.type != SL_PROTO_READY);
        send_release(c, epoch, r.ready.slot, r.ready.generation);
    }
}

int main(int argc, char **argv)
{
    bench_opts o = {.readers = 16, .rtt_samples = 20000, .pin_fetcher = -1, .pin_client = -1};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            o.model = argv[++i];
        else if (!strcmp(argv[i], "--readers") && i + 1 < argc)
            o.readers = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--samples") && i + 1 < argc)
            o.rtt_samples = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc)
            o.out = argv[++i];
        else if (!strcmp(argv[i], "--pin") && i + 1 < argc &&
                 sscanf(argv[++i], "%d,%d", &o.pin_fetcher, &o.pin_client) == 2)
            ;
        else {
            fprintf(stderr,
                    "usage: bench-fetch -m FIRST_SHARD [--readers N] [--samples N] [--pin A,B] "
                    "[--out FILE]\n"
                    "Measures cold expert reads through sluice-fetcher against the raw O_DIRECT\n"
                    "ceiling of the same disk, and the FETCH->READY round trip of hits; with\n"
                    "--pin, again with the fetcher on CPU A and this client on CPU B.\n");
            return 2;
        }
    }
    if (!o.model || !o.readers) {
        fprintf(stderr, "bench-fetch: -m FIRST_SHARD is required\n");
        return 2;
    }
    char self[PATH_MAX], bin[PATH_MAX + 32];
    ssize_t sn = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sn < 0) die("readlink(/proc/self/exe)", NULL);
    self[sn] = '\0';
    *strrchr(self, '/') = '\0';
    snprintf(bin, sizeof bin, "%s/sluice-fetcher", self);
    o.fetcher_bin = bin;

    sl_err err = {0};
    sl_gguf *g = NULL;
    sl_expert_map *m = NULL;
    if (sl_gguf_open(&g, o.model, &err)) die("open model", &err);
    if (sl_expert_map_build(&m, g, SL_SLOT_ALIGN, &err)) die("expert map", &err);
    uint32_t n_all = m->n_layer * m->n_expert;
    uint64_t expert_bytes = m->part_bytes[0] + m->part_bytes[1] + m->part_bytes[2];
    printf("model: %s: %u layers x %u experts, %.2f MiB per expert, %.2f GB of experts\n", o.model,
           m->n_layer, m->n_expert, (double)expert_bytes / (1 << 20),
           (double)expert_bytes * n_all / 1e9);

    /* The ceiling reads the first half of the experts, the fetcher the second half,
     * so neither finds the other's blocks in any cache. The same reads; the best rate
     * of six queue depths. */
    uint32_t half = n_all / 2, ceil_threads = 0;
    uint64_t ceil_bytes = 0;
    double ceiling = sl_bench_disk_best(g, m, 0, 1, half, &ceil_bytes, &ceil_threads, NULL);
    printf("ceiling: raw O_DIRECT pread, best at %u threads, %u experts: %.3f GB/s\n", ceil_threads,
           half, ceiling / 1e9);

    char dir[] = "/tmp/sl-bench-fetch-XXXXXX", endpoint[128];
    if (!mkdtemp(dir)) die("mkdtemp", NULL);
    snprintf(endpoint, sizeof endpoint, "ipc://%s/f.sock", dir);
    uint32_t slots = n_all - half + 8;
    pid_t pid = start_fetcher(&o, endpoint, slots, -1);
    sl_fetch_client_options co;
    sl_fetch_client_options_default(&co, endpoint);
    co.connect_ms = 120000; /* locking a large arena takes a while */
    sl_fetch_client *c = NULL;
    if (sl_fetch_client_open(&c, &co, &err)) die("connect to fetcher", &err);

    /* 2. cold reads: all experts of the second half, up to `window` in flight. */
    uint32_t window = o.readers * 2, sent = 0, done = 0;
    uint64_t t0 = sl_now_ns(), bytes = 0, req = 1;
    uint8_t frame[SL_PROTO_FRAME_MAX];
    size_t len;
    sl_proto_msg rel;
    memset(&rel, 0, sizeof rel);
    rel.type = SL_PROTO_RELEASE;
    rel.release.arena_epoch = sl_fetch_client_welcome(c)->arena_epoch;
    while (done < n_all - half) {
        while (sent < n_all - half && sent - done < window) {
            uint32_t i = half + sent;
            send_fetch(c, req++, i / m->n_expert, i % m->n_expert);
            sent++;
        }
        sl_proto_msg r;
        if (sl_fetch_client_recv(c, &r, 60000, &err)) die("waiting for READY", &err);
        if (r.type == SL_PROTO_ERROR) {
            fprintf(stderr, "bench-fetch: fetcher error: %s\n", r.error.text);
            return 1;
        }
        if (r.type != SL_PROTO_READY) continue;
        done++;
        bytes += expert_bytes;
        rel.release.slot[rel.release.n_slot].slot = r.ready.slot;
        rel.release.slot[rel.release.n_slot].generation = r.ready.generation;
        if (++rel.release.n_slot == SL_PROTO_RELEASE_MAX) {
            if (sl_proto_encode(&rel, frame, sizeof frame, &len, &err)) die("encode", &err);
            sl_fetch_client_send_raw(c, frame, len, &err);
            rel.release.n_slot = 0;
        }
    }
    double cold = (double)bytes / ((double)(sl_now_ns() - t0) / 1e9);
    if (rel.release.n_slot) {
        if (sl_proto_encode(&rel, frame, sizeof frame, &len, &err)) die("encode", &err);
        sl_fetch_client_send_raw(c, frame, len, &err);
    }
    sl_proto_stats_reply st;
    if (sl_fetch_client_stats(c, &st, 5000, &err)) die("STATS", &err);
    printf("fetcher: cold reads of %u experts: %.3f GB/s (%.2fx the ceiling)\n", n_all - half,
           cold / 1e9, cold / ceiling);

    /* 3. hit round trips, nothing pinned (the scheduler places every thread). */
    hit_rtt free_rtt = measure_hits(c, m, half, n_all - half, o.rtt_samples, &req);
    printf("hit round trip FETCH->READY on ipc://, %u samples, unpinned: p50 %.1f us, p99 %.1f "
           "us, max %.1f us; PING floor p50 %.1f us\n",
           o.rtt_samples, free_rtt.p50, free_rtt.p99, free_rtt.max, free_rtt.ping50);
    sl_fetch_client_close(&c);
    stop_fetcher(pid);

    /* 4. the same with each process's serving thread and ZeroMQ I/O thread on one CPU
     * (--cpu): a hop then wakes a thread on a CPU that is running, not a halted one. */
    hit_rtt pin_rtt = {0};
    int pinned = o.pin_fetcher >= 0 && o.pin_client >= 0;
    if (pinned) {
        enum { N_WARM = 64 };
        pid = start_fetcher(&o, endpoint, N_WARM + 8, o.pin_fetcher);
        if (sl_affinity_pin_self(o.pin_client, &err)) die("--pin", &err);
        co.io_cpu = o.pin_client;
        if (sl_fetch_client_open(&c, &co, &err)) die("connect to the pinned fetcher", &err);
        warm(c, m, half, N_WARM, &req);
        pin_rtt = measure_hits(c, m, half, N_WARM, o.rtt_samples, &req);
        printf("hit round trip FETCH->READY on ipc://, fetcher on CPU %d, client on CPU %d: p50 "
               "%.1f us, p99 %.1f us, max %.1f us; PING floor p50 %.1f us\n",
               o.pin_fetcher, o.pin_client, pin_rtt.p50, pin_rtt.p99, pin_rtt.max, pin_rtt.ping50);
        sl_fetch_client_close(&c);
        stop_fetcher(pid);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {
    }

    FILE *out = o.out ? fopen(o.out, "w") : NULL;
    FILE *fs[2] = {stdout, out};
    for (int k = 0; k < 2; k++) {
        FILE *f = fs[k];
        if (!f) continue;
        fprintf(f, "\n| measure | value | ceiling / target | ratio |\n|---|---|---|---|\n");
        fprintf(f,
                "| cold expert reads via fetcher (%u readers) | %.3f GB/s | %.3f GB/s raw "
                "O_DIRECT pread, best of 2-64 threads (%u) | %.2fx (target >= 0.9x) |\n",
                o.readers, cold / 1e9, ceiling / 1e9, ceil_threads, cold / ceiling);
        print_rtt_rows(f, "unpinned", &free_rtt);
        if (pinned) {
            char label[96];
            snprintf(label, sizeof label, "fetcher `--cpu %d`, client `--cpu %d`", o.pin_fetcher,
                     o.pin_client);
            print_rtt_rows(f, label, &pin_rtt);
        }
        fprintf(f,
                "| fetcher counters after the cold pass | %" PRIu64 " misses, %.2f GB read | | |\n",
                st.misses, (double)st.bytes_read / 1e9);
        fprintf(f, "\ncommand: `bench-fetch -m %s --readers %u --samples %u", o.model, o.readers,
                o.rtt_samples);
        if (pinned) fprintf(f, " --pin %d,%d", o.pin_fetcher, o.pin_client);
        fprintf(f, "`\n");
    }
    if (out) fclose(out);
    sl_expert_map_free(&m);
    sl_gguf_close(&g);
    return 0;
}
