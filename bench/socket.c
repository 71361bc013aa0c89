/* socket.c - `bench-socket`: the floor under the fetcher's hit round trip.
 *
 * A hit costs the compute process one FETCH -> READY exchange with the fetcher over
 * ZeroMQ (ipc://). This program times round trips of a 32-byte frame between two
 * processes with nothing else in them, so that the fetcher's own cost can be told
 * from the transport's:
 *
 *   - AF_UNIX stream socket, plain (the kernel's share: one write and one wake-up
 *     each way);
 *   - ZeroMQ DEALER -> ROUTER over ipc:// (the fetcher's sockets: each message also
 *     crosses an I/O thread in each process);
 *
 * each with the receivers blocking in recv, and spinning (non-blocking receives with
 * sched_yield, as the fetcher's loop and the client do), and, with --pin A,B, each
 * process and its ZeroMQ I/O thread pinned to CPU A (the echoing side) and B; with
 * --io C,D too, once more with the I/O threads on CPUs C and D of their own.
 * Prints a markdown table (and -o FILE) with the command line.
 */
#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "affinity.h"

#define FRAME  32  /* bytes: about a FETCH of one expert */
#define WARMUP 500 /* round trips before the timed ones */

static void die(const char *what)
{
    fprintf(stderr, "bench-socket: %s: %s\n", what, strerror(errno));
    exit(1);
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* One way of moving frames: the echoing side (child) and the timing side. */
typedef struct transport {
    const char *name;
    int zmq;
} transport;

static cpu_set_t
    all_cpus; /* the process's CPUs at start: a fork of a pinned timer gets them back */

/* This thread on cpu, and zctx's I/O thread on io (io < 0: on cpu too); cpu < 0: none. */
static void pin(int cpu, int io, void *zctx)
{
    sl_err err = {0};
    if (cpu < 0) return;
    if (sched_setaffinity(0, sizeof all_cpus, &all_cpus)) die("sched_setaffinity");
    if (zctx && zmq_ctx_set(zctx, ZMQ_THREAD_AFFINITY_CPU_ADD, io < 0 ? cpu : io) != 0)
        die("zmq_ctx_set");
    if (sl_affinity_pin_self(cpu, &err)) {
        fprintf(stderr, "bench-socket: %s\n", err.msg);
        exit(1);
    }
}

/* A frame of exactly len bytes from fd (stream socket); spin: non-blocking reads. */
static void unix_recv(int fd, uint8_t *buf, size_t len, int spin)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = recv(fd, buf + got, len - got, spin ? MSG_DONTWAIT : 0);
        if (n > 0) {
            got += (size_t)n;
        } else if (n == 0) {
            fprintf(stderr, "bench-socket: the peer closed the socket\n");
            exit(1);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            sched_yield();
        } else if (errno != EINTR) {
            die("recv");
        }
    }
}

static void unix_send(int fd, const uint8_t *buf, size_t len)
{
    size_t put = 0;
    while (put < len) {
        ssize_t n = send(fd, buf + put, len - put, MSG_NOSIGNAL);
        if (n > 0)
            put += (size_t)n;
        else if (n < 0 && errno != EINTR)
            die("send");
    }
}

/* Receives one message on a ZeroMQ socket into buf (its first part when multipart);
 * spin: non-blocking receives. Returns its length. */
static int zmq_get(void *s, uint8_t *buf, size_t cap, int spin)
{
    for (;;) {
        int n = zmq_recv(s, buf, cap, spin ? ZMQ_DONTWAIT : 0);
        if (n >= 0) return n;
        if (zmq_errno() == EAGAIN)
            sched_yield();
        else if (zmq_errno() != EINTR)
            die("zmq_recv");
    }
}

/* The echoing process: answers every frame until `total` were answered. */
static void echo(const transport *t, const char *where, int spin, int cpu, int io, uint32_t total)
{
    uint8_t buf[256], id[256];
    if (t->zmq) {
        void *ctx = zmq_ctx_new();
        pin(cpu, io, ctx);
        void *s = zmq_socket(ctx, ZMQ_ROUTER);
        if (!s || zmq_bind(s, where) != 0) die("zmq_bind");
        for (uint32_t k = 0; k < total; k++) {
            int il = zmq_get(s, id, sizeof id, spin);
            int n = zmq_get(s, buf, sizeof buf, spin);
            if (zmq_send(s, id, (size_t)il, ZMQ_SNDMORE) < 0 || zmq_send(s, buf, (size_t)n, 0) < 0)
                die("zmq_send");
        }
        zmq_close(s);
        zmq_ctx_term(ctx);
        return;
    }
    pin(cpu, -1, NULL);
    int ls = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(where) >= sizeof a.sun_path) die("socket path too long");
    memcpy(a.sun_path, where, strlen(where) + 1);
    unlink(where);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1)) die("bind");
    int fd = accept(ls, NULL, NULL);
    if (fd < 0) die("accept");
    for (uint32_t k = 0; k < total; k++) {
        unix_recv(fd, buf, FRAME, spin);
        unix_send(fd, buf, FRAME);
    }
    close(fd);
    close(ls);
    unlink(where);
}

/* Times `samples` round trips (after WARMUP) against a fresh echoing process: p50 and
 * p99 in us. io_echo, io_me: the I/O threads' CPUs (-1: the process's own). */
static void measure(const transport *t, int spin, int cpu_echo, int cpu_me, int io_echo, int io_me,
                    uint32_t samples, double *p50, double *p99)
{
    char where[128];
    snprintf(where, sizeof where, "%s/tmp/sluice-bench-socket-%d.sock", t->zmq ? "ipc://" : "",
             (int)getpid());
    const uint32_t total = WARMUP + samples;
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        echo(t, where, spin, cpu_echo, io_echo, total);
        _exit(0);
    }
    uint8_t buf[256] = {0};
    uint64_t *rtt = malloc(sizeof *rtt * samples);
    if (!rtt) die("malloc");
    void *ctx = NULL, *s = NULL;
    int fd = -1;
    if (t->zmq) {
        ctx = zmq_ctx_new();
        pin(cpu_me, io_me, ctx);
        s = zmq_socket(ctx, ZMQ_DEALER);
        if (!s || zmq_connect(s, where) != 0) die("zmq_connect"); /* retried until bound */
    } else {
        pin(cpu_me, -1, NULL);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        if (strlen(where) >= sizeof a.sun_path) die("socket path too long");
        memcpy(a.sun_path, where, strlen(where) + 1);
        for (int tries = 0;; tries++) { /* until the child listens */
            fd = socket(AF_UNIX, SOCK_STREAM, 0);
            if (fd < 0) die("socket");
            if (!connect(fd, (struct sockaddr *)&a, sizeof a)) break;
            close(fd);
            if (tries > 5000) die("connect");
            usleep(1000);
        }
    }
    for (uint32_t k = 0; k < total; k++) {
        memcpy(buf, &k, sizeof k);
        const uint64_t a = now_ns();
        if (t->zmq) {
            if (zmq_send(s, buf, FRAME, 0) < 0) die("zmq_send");
            zmq_get(s, buf, sizeof buf, spin);
        } else {
            unix_send(fd, buf, FRAME);
            unix_recv(fd, buf, FRAME, spin);
        }
        const uint64_t b = now_ns();
        uint32_t back;
        memcpy(&back, buf, sizeof back);
        if (back != k) {
            fprintf(stderr, "bench-socket: frame %u came back as %u\n", k, back);
            exit(1);
        }
        if (k >= WARMUP) rtt[k - WARMUP] = b - a;
    }
    if (t->zmq) {
        zmq_close(s);
        zmq_ctx_term(ctx);
    } else {
        close(fd);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "bench-socket: the echoing process failed\n");
        exit(1);
    }
    qsort(rtt, samples, sizeof *rtt, cmp_u64);
    *p50 = (double)rtt[samples / 2] / 1e3;
    *p99 = (double)rtt[(uint64_t)samples * 99 / 100] / 1e3;
    free(rtt);
}

/* Two CPU numbers "X,Y" of option opt (--pin, --io) into *x, *y; 0, or 2 after the
 * message (names: how the usage spells them, "A,B"). */
static int cpu_pair(const char *opt, const char *names, const char *arg, int *x, int *y)
{
    if (sscanf(arg, "%d,%d", x, y) != 2 || *x < 0 || *y < 0) {
        fprintf(stderr, "bench-socket: %s wants %s (two CPU numbers)\n", opt, names);
        return 2;
    }
    sl_err err = {0};
    if (sl_affinity_check(*x, &err) || sl_affinity_check(*y, &err)) {
        fprintf(stderr, "bench-socket: %s: %s\n", opt, err.msg);
        return 2;
    }
    return 0;
}

int main(int argc, char **argv)
{
    uint32_t samples = 20000;
    int cpu_a = -1, cpu_b = -1, io_c = -1, io_d = -1;
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--samples") && i + 1 < argc) {
            char *end;
            unsigned long v = strtoul(argv[++i], &end, 10);
            if (*end || v < 10 || v > 10000000) {
                fprintf(stderr, "bench-socket: --samples wants 10 to 10000000\n");
                return 2;
            }
            samples = (uint32_t)v;
        } else if (!strcmp(argv[i], "--pin") && i + 1 < argc) {
            if (cpu_pair("--pin", "A,B", argv[++i], &cpu_a, &cpu_b)) return 2;
        } else if (!strcmp(argv[i], "--io") && i + 1 < argc) {
            if (cpu_pair("--io", "C,D", argv[++i], &io_c, &io_d)) return 2;
        } else if (!strcmp(argv[i], "-o") && i + 1 < argc) {
            out = argv[++i];
        } else {
            fprintf(stderr,
                    "usage: bench-socket [--samples N] [--pin A,B [--io C,D]] [-o FILE]\n"
                    "Round trips of a %d-byte frame between two processes: AF_UNIX "
                    "and ZeroMQ ipc://,\nblocking and spinning receivers, and with "
                    "--pin the echoing process on CPU A, this one on B\n(their ZeroMQ "
                    "I/O threads with them, and with --io once more on CPUs C and D).\n",
                    FRAME);
            return !strcmp(argv[i], "--help") ? 0 : 2;
        }
    }
    signal(SIGPIPE, SIG_IGN);
    if (io_c >= 0 && cpu_a < 0) {
        fprintf(stderr, "bench-socket: --io needs --pin\n");
        return 2;
    }
    if (sched_getaffinity(0, sizeof all_cpus, &all_cpus)) die("sched_getaffinity");
    static const transport tr[2] = {{"AF_UNIX stream socket", 0},
                                    {"ZeroMQ DEALER -> ROUTER, ipc://", 1}};
    FILE *f = out ? fopen(out, "w") : NULL;
    if (out && !f) die(out);
    char line[4096];
    int at = snprintf(line, sizeof line,
                      "| transport | receivers | pinned | p50 us | p99 us |\n"
                      "|---|---|---|---|---|\n");
    /* pass 0: nothing pinned; 1: --pin, I/O threads beside; 2: --io (ZeroMQ only) */
    for (int p = 0; p < (io_c >= 0 ? 3 : cpu_a >= 0 ? 2 : 1); p++)
        for (int t = p == 2; t < 2; t++)
            for (int spin = 0; spin < 2; spin++) {
                double p50 = 0, p99 = 0;
                measure(&tr[t], spin, p ? cpu_a : -1, p ? cpu_b : -1, p == 2 ? io_c : -1,
                        p == 2 ? io_d : -1, samples, &p50, &p99);
                char pinned[64] = "no";
                if (p == 1) snprintf(pinned, sizeof pinned, "CPUs %d, %d", cpu_a, cpu_b);
                if (p == 2)
                    snprintf(pinned, sizeof pinned, "CPUs %d, %d; I/O threads %d, %d", cpu_a, cpu_b,
                             io_c, io_d);
                at += snprintf(line + at, sizeof line - (size_t)at,
                               "| %s | %s | %s | %.1f | %.1f |\n", tr[t].name,
                               spin ? "spinning" : "blocking", pinned, p50, p99);
            }
    char cmd[256] = "bench-socket";
    snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " --samples %u", samples);
    if (cpu_a >= 0)
        snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " --pin %d,%d", cpu_a, cpu_b);
    if (io_c >= 0) snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " --io %d,%d", io_c, io_d);
    printf("%s\ncommand: `%s`\n", line, cmd);
    if (f) {
        fprintf(f, "%s\ncommand: `%s`\n", line, cmd);
        fclose(f);
    }
    return 0;
}
