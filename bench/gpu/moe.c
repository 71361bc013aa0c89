/* moe.c - bench-moe: the MoE kernels on the GPU at the real dimensions of
 * DeepSeek-V4.1-Flash (dim 5120, inter 2304, 6 of 384 experts, shared expert).
 *
 * Prints, measured in the same run: the HBM read ceiling (plain int4 read kernel) and
 * each kernel variant's bytes/s for one token's routed experts (gate/up, down, both),
 * checked bit-exact against the CPU emulation; the zero-copy ceiling of a registered
 * POSIX shm mapping and the kernels reading experts in place from it; and the wall
 * time of a whole all-hit MoE layer through compute/gpu.h (shared expert, router GEMV,
 * then either a host top-6 and the routed experts, or routing on the device), with the
 * device-routed layer's GPU timeline from event marks.
 *
 * usage: bench-moe [-o FILE.md] [--pool N] [--iters N] [--zc-all] [--quick [--also V]...
 *        [--passes N]] [--carveout PCT] [--stamps FILE]
 * --quick: the shipped kernels and the two before them (and each --also V; all of them
 * --passes N times, so that each is also timed after the others), the experts-a-launch
 * fit and the kernels' milestones only; --carveout: the shared-memory carveout the
 * shipped kernels prefer (all the same, so that no SM changes its L1 split between them);
 * --stamps: every milestone table's raw records (a CTA's group each, with its SM) appended
 * to FILE, for looking at one launch by hand.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "gpu.h"
#include "moe_emu.h"
#include "quant.h"
#include "moe_bench.h"

#define DIM   5120
#define INTER 2304
#define NUSED 6

typedef struct opts {
    const char *out; /* markdown table file, or NULL */
    int pool;        /* experts resident in device memory (sets rotate through them) */
    int iters;
    int zc_all; /* zero-copy: every variant (else the shipped ones for mapped memory) */
    int quick;  /* the shipped variant and its staggered start only, then the milestones */
    int carve;  /* the shipped kernels' shared-memory carveout preference, % (0: driver's) */
    int passes; /* --quick: its rows this many times over (--passes N) */
    int n_also; /* --quick: these variants' rows too (--also V) */
    int also[8];
    const char *stamps; /* --stamps FILE: the milestone tables' raw records appended here */
} opts;

/* Whether --quick runs variant v's row. */
static int quick_row(const opts *o, int v)
{
    if (v == MB_V_SHIPPED || v == MB_V_NBONLY || v == MB_V_SPLONLY || v == MB_V_S24 ||
        v == MB_V_S20 || v == MB_V_S11 || v == MB_V_BEFORE || v == MB_V_S9)
        return 1;
    for (int i = 0; i < o->n_also; i++)
        if (o->also[i] == v) return 1;
    return 0;
}

static uint64_t rng = 0x1234567887654321ULL;

static uint64_t rnd(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1DULL;
}

static float urand(void)
{
    return (float)(rnd() >> 40) / 16777216.0f;
}

static void put_f16(uint8_t *p, float v)
{
    const sl_f16 h = sl_f32_to_f16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void fill_blocks(uint8_t *p, uint32_t type, uint64_t n, float scale)
{
    const uint32_t bb = type == SL_QTYPE_Q2_K ? 84 : 110;
    for (uint64_t b = 0; b < n / 256; b++) {
        uint8_t *blk = p + b * bb;
        for (uint32_t i = 0; i < bb; i += 8) {
            const uint64_t r = rnd();
            memcpy(blk + i, &r, bb - i < 8 ? bb - i : 8);
        }
        if (type == SL_QTYPE_Q2_K) {
            put_f16(blk + 80, scale * (0.5f + urand()));
            put_f16(blk + 82, scale * (0.5f + urand()));
        } else {
            put_f16(blk + 108, scale * (0.5f + urand()));
        }
    }
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, "bench-moe: " __VA_ARGS__);                                                \
        fputc('\n', stderr);                                                                       \
        exit(1);                                                                                   \
    } while (0)

static FILE *md;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    if (md) {
        va_start(ap, fmt);
        vfprintf(md, fmt, ap);
        va_end(ap);
    }
    fflush(stdout);
}

/* The forced routing of token `it` of the device-routed rows: experts it*6 .. it*6+5
 * (mod 384), each a different pool expert through the device tier's table, with
 * the host rows' weights. */
static void forced_route(int it, sl_moe_route *r)
{
    float sum = 0;
    memset(r, 0, sizeof *r);
    for (int k = 0; k < NUSED; k++) {
        r->expert[k] = (uint32_t)((it * NUSED + k) % 384);
        r->weight[k] = 1.0f + 0.01f * k;
        sum += r->weight[k];
    }
    for (int k = 0; k < NUSED; k++) r->weight[k] *= 1.5f / sum;
}

/* The buffers of sluice-compute's own layer forms in the device-routed rows: the
 * residual stream (two, since the router's form writes h + y into the other one), the
 * norm's weights and x. */
typedef struct norm_io {
    void *h[2], *w, *x;
} norm_io;

enum { NORM_NONE, NORM_IN_ROUTER, NORM_KERNEL };

/* Queues the shared expert of layer `it` and its device routing (forced picks r, the
 * device tier t0d): on x as given (NORM_NONE), or, as sluice-compute's layer, with the
 * residual (+ y, the last layer's output) and the norm computed inside the router's
 * CTAs (NORM_IN_ROUTER) or by their own kernel before it (NORM_KERNEL, --norm-kernel). */
static int route_layer(sl_gpu_ctx *c, int form, int it, const uint16_t *x, const norm_io *n,
                       const uint16_t *y, const sl_moe_expert_w *sh, const uint16_t *rw,
                       const sl_gpu_t0e *t0d, const sl_moe_route *r, sl_err *err)
{
    const float eps = 1e-6f;
    uint16_t *nx = n->x; /* the x the norm forms compute */
    const uint16_t *xr = form == NORM_NONE ? x : nx;
    int rc = form == NORM_KERNEL ? sl_gpu_residual_norm(c, n->h[0], y, n->w, eps, nx, err) : 0;
    if (!rc) rc = sl_gpu_moe_shared(c, xr, sh, err);
    if (rc) return rc;
    if (form != NORM_IN_ROUTER) return sl_gpu_route_start(c, xr, rw, NULL, t0d, r, err);
    const sl_gpu_norm nm = {n->h[it & 1], y, n->h[(it + 1) & 1], n->w, eps};
    return sl_gpu_route_start_norm(c, &nm, nx, rw, NULL, t0d, r, err);
}

/* The longest phase row: a variant's name and its five figures (160 bytes cut the
 * interleaved variants' rows, newline included, in session 36's first run). */
enum { PHASE_ROW = 400 };

/* One table row of a fused launch's phases from its stamps (sl_kfuse.stamps). */
static void fused_phases(const unsigned long long *st, const char *name, char *row, size_t cap)
{
    double a[1024], b[1024], d[1024];
    int n = 0, ctas = 0;
    unsigned long long first = ~0ull, last = 0;
    for (int c = 0; c < 1024; c++) {
        const unsigned long long *s = st + 4 * c;
        if (!s[0]) continue;
        ctas++;
        if (s[0] < first) first = s[0];
        if (s[3] > last) last = s[3];
        if (!s[1] || !s[2]) continue;
        a[n] = (double)(s[1] - s[0]) / 1e3;
        b[n] = (double)(s[2] - s[1]) / 1e3;
        d[n] = (double)(s[3] - s[2]) / 1e3;
        n++;
    }
    if (!n) {
        snprintf(row, cap, "| %s | - | - | - | - | %d |\n", name, ctas);
        return;
    }
    qsort(a, n, sizeof *a, cmp_d);
    qsort(b, n, sizeof *b, cmp_d);
    qsort(d, n, sizeof *d, cmp_d);
    snprintf(row, cap, "| %s | %.1f | %.1f | %.1f | %.1f | %d |\n", name, a[n / 2], b[n / 2],
             d[n / 2], (double)(last - first) / 1e3, ctas);
}

/* Microseconds from %globaltimer stamp b to stamp a (either order). The difference is
 * taken in integers: the stamps count ns since 1970, past a double's 53 bits, so each
 * would be rounded to 256 ns first (the grain of every layer timeline until session 18). */
static double us_after(unsigned long long a, unsigned long long b)
{
    return (double)(long long)(a - b) / 1e3;
}

/* A record's slot 31 as k_stamp_end packs it: its units (low word) and its SM. */
static unsigned rec_units(const unsigned long long *s)
{
    return (unsigned)(s[31] & 0xffffffffu);
}

static unsigned rec_sm(const unsigned long long *s)
{
    return (unsigned)(s[31] >> 32);
}

/* One milestone row of stamp_table: over the records that reached `slot` (a unit's
 * slots: those with more than `unit` units), p10 / median / p90 / max of its time
 * from t0, and the median of its time after slot `prev` of the same record. */
static void stamp_row(const unsigned long long *st, unsigned long long t0, const char *name,
                      int slot, int prev, int unit)
{
    static double v[MB_ST_RECS], d[MB_ST_RECS];
    int n = 0;
    for (int r = 0; r < MB_ST_RECS; r++) {
        const unsigned long long *s = st + (size_t)r * MB_ST_SLOTS;
        if (!s[30] || (unit >= 0 && rec_units(s) <= (unsigned)unit) || !s[slot]) continue;
        v[n] = (double)(s[slot] - t0) / 1e3;
        d[n] = prev >= 0 && s[prev] ? us_after(s[slot], s[prev]) : 0.0;
        n++;
    }
    if (!n) return;
    qsort(v, n, sizeof *v, cmp_d);
    qsort(d, n, sizeof *d, cmp_d);
    say("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %d |\n", name, v[n / 10], v[n / 2],
        v[n * 9 / 10], v[n - 1], d[n / 2], n);
}

/* The bulk-copy gate/up's refills (slots 24, 25: the ns its group leader spent queueing
 * refills after its units, and their count), per record: the median, p90 and max of
 * the time and the median count; nothing when no record queued a refill. */
static void refill_line(const unsigned long long *st)
{
    static double t[MB_ST_RECS], c[MB_ST_RECS];
    int n = 0;
    for (int r = 0; r < MB_ST_RECS; r++) {
        const unsigned long long *s = st + (size_t)r * MB_ST_SLOTS;
        if (!s[30] || !s[25]) continue;
        t[n] = (double)s[24] / 1e3;
        c[n++] = (double)s[25];
    }
    if (!n) return;
    qsort(t, n, sizeof *t, cmp_d);
    qsort(c, n, sizeof *c, cmp_d);
    say("Refills queued by each group's leader after its units (its time in `cp.async.bulk`, "
        "the group waiting at its next barrier): %d records, median %.2f us in %.0f refills, "
        "p90 %.2f us, max %.2f us.\n\n",
        n, t[n / 2], c[n / 2], t[n * 9 / 10], t[n - 1]);
}

/* A table's raw records appended to file `dump` (bench-moe --stamps FILE): a line
 * "# what (t0 ...)" (t0: the first entry, ns on the GPU's clock), then one line a record: its index
 * (CTA * groups + group), each slot in us after t0 (-1: not stamped; slots 24 and 25: the
 * refills' queueing, us and count), its units and its SM. */
static void stamp_dump(const unsigned long long *st, unsigned long long t0, const char *what,
                       const char *dump)
{
    FILE *f = fopen(dump, "a");
    if (!f) DIE("--stamps %s: %s", dump, strerror(errno));
    fprintf(f, "# %s (t0 %llu ns on the GPU's clock)\n", what, t0);
    for (int r = 0; r < MB_ST_RECS; r++) {
        const unsigned long long *s = st + (size_t)r * MB_ST_SLOTS;
        if (!s[30]) continue;
        fprintf(f, "%d", r);
        for (int k = 0; k < 31; k++) /* 24, 25: the refills' queueing, us and count */
            fprintf(f, " %.3f",
                    k == 24   ? (double)s[k] / 1e3
                    : k == 25 ? (double)s[k]
                    : s[k]    ? us_after(s[k], t0)
                              : -1.0);
        fprintf(f, " %u %u\n", rec_units(s), rec_sm(s));
    }
    if (fclose(f)) DIE("--stamps %s: %s", dump, strerror(errno));
}

/* One SM's records of a launch, summed: its last end, its groups' first start, and over
 * its units the time each waited for its bytes (landed after the unit before was done,
 * or after the start) and the time each took once landed. */
typedef struct sm_sum {
    double end, start, wait, comp;
    int units; /* units with both stamps (at most MB_ST_UNITS a record) */
    int work;  /* units its records ran (rec_units), every one counted */
} sm_sum;

static int cmp_sm_end(const void *a, const void *b)
{
    const double x = ((const sm_sum *)a)->end, y = ((const sm_sum *)b)->end;
    return (x > y) - (x < y);
}

/* The mean of the per-unit wait, compute, and start of SMs [a, b) of sm (sorted). */
static void sm_fifth(const sm_sum *sm, int a, int b, double out[3])
{
    double w = 0, c = 0, s = 0;
    int u = 0;
    for (int i = a; i < b; i++)
        w += sm[i].wait, c += sm[i].comp, s += sm[i].start, u += sm[i].units;
    out[0] = u ? w / u : 0, out[1] = u ? c / u : 0, out[2] = b > a ? s / (b - a) : 0;
}

/* Fewer units first, then earlier ends first. */
static int cmp_sm_work(const void *a, const void *b)
{
    const sm_sum *x = a, *y = b;
    if (x->work != y->work) return (x->work > y->work) - (x->work < y->work);
    return cmp_sm_end(a, b);
}

/* The SMs grouped by the units they ran, as one line: how many SMs ran each count and
 * when they ended. Which CTAs share an SM is the hardware's choice, made anew at each
 * launch, so the units an SM runs differ when the CTAs' counts do. */
static void stamp_by_work(const sm_sum *sm, int n)
{
    static sm_sum by[1024];
    memcpy(by, sm, sizeof *sm * (size_t)n);
    qsort(by, n, sizeof *by, cmp_sm_work);
    say("By the units an SM ran (its records' units, the shared expert's too):");
    for (int a = 0, b; a < n; a = b) { /* [a, b): one count, by end */
        for (b = a + 1; b < n && by[b].work == by[a].work; b++) {
        }
        say(" %s%d units on %d SMs, last ends first %.2f, median %.2f, last %.2f us", a ? "; " : "",
            by[a].work, b - a, by[a].end, by[a + (b - a) / 2].end, by[b - 1].end);
    }
    say(".\n\n");
}

/* Where a launch's spread of ends comes from: its records grouped by SM (k_stamp_end's
 * %smid), the fifth of the SMs that ended last against the fifth that ended first. */
static void stamp_by_sm(const unsigned long long *st, unsigned long long t0)
{
    static sm_sum sm[1024];
    static int seen[1024];
    memset(seen, 0, sizeof seen);
    int n = 0;
    for (int r = 0; r < MB_ST_RECS; r++) {
        const unsigned long long *s = st + (size_t)r * MB_ST_SLOTS;
        const unsigned id = rec_sm(s), units = rec_units(s);
        if (!s[30] || !s[1] || id >= 1024) continue;
        if (!seen[id]) seen[id] = ++n, sm[n - 1] = (sm_sum){0, 1e30, 0, 0, 0, 0};
        sm_sum *m = &sm[seen[id] - 1];
        m->work += (int)units;
        const double end = us_after(s[30], t0), start = us_after(s[1], t0);
        if (end > m->end) m->end = end;
        if (start < m->start) m->start = start;
        double prev = start;
        for (unsigned i = 0; i < units && i < MB_ST_UNITS; i++) {
            if (!s[2 + 2 * i] || !s[3 + 2 * i]) break;
            const double l = us_after(s[2 + 2 * i], t0), d = us_after(s[3 + 2 * i], t0);
            m->wait += l > prev ? l - prev : 0.0;
            m->comp += d - l;
            m->units++;
            prev = d;
        }
    }
    if (n < 5) return;
    qsort(sm, n, sizeof *sm, cmp_sm_end);
    double lo[3], hi[3];
    sm_fifth(sm, 0, n / 5, lo);
    sm_fifth(sm, n - n / 5, n, hi);
    say("By SM (%d SMs): the last end of each, first %.2f, median %.2f, last %.2f us. The "
        "fifth that ended last against the fifth that ended first: each unit waited %.2f "
        "against %.2f us for its bytes and took %.2f against %.2f us once landed; the SM's "
        "first group started at %.2f against %.2f us.\n\n",
        n, sm[0].end, sm[n / 2].end, sm[n - 1].end, hi[0], lo[0], hi[1], lo[1], hi[2], lo[2]);
    stamp_by_work(sm, n);
}

/* The milestones of a weight-streaming kernel's last launch (k_stamp's records, a CTA's
 * group each), in us from the earliest entry on the GPU's clock. */
static void stamp_table(const unsigned long long *st, const char *what, const char *dump)
{
    unsigned long long t0 = ~0ull, t1 = 0;
    int nrec = 0;
    for (int r = 0; r < MB_ST_RECS; r++) {
        const unsigned long long *s = st + (size_t)r * MB_ST_SLOTS;
        if (!s[30]) continue;
        nrec++;
        if (s[0] < t0) t0 = s[0];
        if (s[30] > t1) t1 = s[30];
    }
    if (!nrec) {
        say("%s: no records\n\n", what);
        return;
    }
    say("%s: %d records (a CTA's group each), %.1f us from the first entry to the last end\n\n",
        what, nrec, (double)(t1 - t0) / 1e3);
    if (dump) stamp_dump(st, t0, what, dump);
    say("| milestone | p10 us | median us | p90 us | max us | median after the row before, us "
        "| records |\n|---|---|---|---|---|---|---|\n");
    stamp_row(st, t0, "entry", 0, -1, -1);
    stamp_row(st, t0, "past the kernel before (gate/up: x landed)", 1, 0, -1);
    for (int i = 0; i < MB_ST_UNITS; i++) {
        char name[64];
        snprintf(name, sizeof name, "unit %d landed", i);
        stamp_row(st, t0, name, 2 + 2 * i, i ? 1 + 2 * i : 1, i);
        snprintf(name, sizeof name, "unit %d done", i);
        stamp_row(st, t0, name, 3 + 2 * i, 2 + 2 * i, i);
    }
    stamp_row(st, t0, "end", 30, 0, -1);
    say("\n");
    stamp_by_sm(st, t0);
    refill_line(st);
}

/* The first, median and last of slot `slot` over a kernel's records (stride slots a
 * record; a record counts when its slot `valid` is set), in us after t0; 0 when none. */
static int rec_stats(const unsigned long long *st, int nrec, int stride, int valid, int slot,
                     unsigned long long t0, double out[3])
{
    static double v[MB_ST_RECS];
    int n = 0;
    for (int r = 0; r < nrec; r++) {
        const unsigned long long *s = st + (size_t)r * stride;
        if (s[valid] && s[slot]) v[n++] = us_after(s[slot], t0);
    }
    if (!n) return 0;
    qsort(v, n, sizeof *v, cmp_d);
    out[0] = v[0], out[1] = v[n / 2], out[2] = v[n - 1];
    return n;
}

/* One device-routed layer on the GPU's clock: the router's CTAs and the selection
 * (rt: sl_gpu_probe.rt_stamps), the gate/up's and the down's groups (gu, dn), in us
 * after the router's first entry. */
static void layer_timeline(const unsigned long long *rt, const unsigned long long *gu,
                           const unsigned long long *dn)
{
    const unsigned long long *ro = rt + SL_GPU_RT_ROUTER;
    unsigned long long t0 = ~0ull;
    for (int c = 0; c < 256; c++) {
        const unsigned long long en = ro[SL_GPU_RT_ROUTER_SLOTS * c];
        if (en && en < t0) t0 = en;
    }
    if (t0 == ~0ull) {
        say("Layer timeline: no records\n\n");
        return;
    }
    say("One device-routed layer on the GPU's clock (the last of 8 back to back), us after the "
        "router's first CTA entered:\n\n| kernel | event | first | median | last | records "
        "|\n|---|---|---|---|---|---|\n");
    static const char *const rname[SL_GPU_RT_ROUTER_SLOTS] = {
        "entry",
        "past its wait (the kernel before)",
        "end",
        "x in shared memory",
        "the norm: h and y loaded, squares summed (thread 0)",
        "the norm: r known"};
    static const int rorder[SL_GPU_RT_ROUTER_SLOTS] = {0, 1, 4, 5, 3, 2};
    for (int kk = 0; kk < SL_GPU_RT_ROUTER_SLOTS; kk++) {
        const int k = rorder[kk];
        double v[3];
        const int n = rec_stats(ro, 256, SL_GPU_RT_ROUTER_SLOTS, 2, k, t0, v);
        if (n) say("| router | %s | %.2f | %.2f | %.2f | %d |\n", rname[k], v[0], v[1], v[2], n);
    }
    static const char *const sname[SL_GPU_RT_SEL_END + 1] = {"entry",
                                                             "past its wait (the router)",
                                                             "scores, warp maxima",
                                                             "picks ranked",
                                                             "weights, slots, device-tier entries",
                                                             "table published",
                                                             "end (host's picks written)"};
    for (int k = 0; k <= SL_GPU_RT_SEL_END; k++)
        if (rt[k]) say("| selection | %s | | %.2f | | 1 |\n", sname[k], us_after(rt[k], t0));
    char beside[512] = "";
    size_t nb = 0;
    for (int r = 0; r < MB_ST_RECS && rt[SL_GPU_RT_SEL_SM]; r++) { /* the selection's SM */
        const unsigned long long *s = gu + (size_t)r * MB_ST_SLOTS;
        if (!s[30] || rec_sm(s) + 1ull != rt[SL_GPU_RT_SEL_SM] || !s[2]) continue;
        const int w = snprintf(beside + nb, sizeof beside - nb,
                               "%s CTA %d group %d (its first "
                               "unit landed at %.2f us)",
                               nb ? "," : "", r / 2, r % 2, us_after(s[2], t0));
        if (w < 0 || (size_t)w >= sizeof beside - nb) break;
        nb += (size_t)w;
    }
    static const int slot[7] = {0, 26, 28, 27, 1, 30, 29};
    static const char *const gname[7] = {"entry",
                                         "x landed (group 0's second warp)",
                                         "the table read (group 0's warp 0)",
                                         "the routed stages queued (thread 0)",
                                         "x and the table landed",
                                         "end",
                                         "past its final wait (the selection's grid)"};
    static const char *const dname[7] = {"entry", "", "", "", "past its wait (the kernel before)",
                                         "end",   ""};
    for (int w = 0; w < 2; w++)
        for (int k = 0; k < 7; k++) {
            if (w && !*dname[k]) continue;
            double v[3];
            const int n = rec_stats(w ? dn : gu, MB_ST_RECS, MB_ST_SLOTS, 30, slot[k], t0, v);
            if (n)
                say("| %s | %s | %.2f | %.2f | %.2f | %d |\n", w ? "down" : "gate/up",
                    w ? dname[k] : gname[k], v[0], v[1], v[2], n);
        }
    say("\n");
    if (rt[SL_GPU_RT_SEL_SM])
        say("The selection ran on SM %llu, beside the gate/up's%s.\n\n", rt[SL_GPU_RT_SEL_SM] - 1,
            nb ? beside : " (no group of it)");
    if (rt[SL_GPU_RT_SEL_WAITED] && rt[SL_GPU_RT_SEL_CLK + SL_GPU_RT_SEL_WAITED]) {
        say("The selection's steps after its wait, in us and in its SM's cycles (clock64; the "
            "ratio is the SM's clock over the step, GHz):");
        for (int k = SL_GPU_RT_SEL_SCORED; k <= SL_GPU_RT_SEL_END; k++) {
            const double us = us_after(rt[k], rt[k - 1]);
            const double cyc =
                (double)(long long)(rt[SL_GPU_RT_SEL_CLK + k] - rt[SL_GPU_RT_SEL_CLK + k - 1]);
            say(" %s %.2f us, %.0f cycles, %.2f GHz%s", sname[k], us, cyc,
                us > 0 ? cyc / us / 1e3 : 0.0, k < SL_GPU_RT_SEL_END ? ";" : ".\n\n");
        }
    }
}

/* What a row of the routed-experts table needs. */
typedef struct routed_ctx {
    sl_gpu_ctx *c;
    const mb_io *io;
    const mb_set *sets;
    int nsets, iters;
    double hbm, own, token_bytes;
    size_t bg, bd;
    const float *want; /* the emulation's output of set 0 */
} routed_ctx;

/* Times variant v on one token's experts and prints its row; with phases (a fused
 * variant), its phase row too. A variant that fails is reported and skipped. */
static void routed_row(const routed_ctx *r, int v, char *phases)
{
    static unsigned long long stamps[1024 * 4];
    static float got[DIM];
    char msg[256];
    sl_err err = {0};
    double us[3];
    int failed = 0;
    if (phases) {
        memset(stamps, 0, sizeof stamps);
        if (sl_gpu_upload(r->c, r->io->stamps, stamps, sizeof stamps, &err)) DIE("%s", err.msg);
    }
    for (int w = 0; w < 3 && !failed; w++) {
        const int which = (w + 1) % 3; /* 1, 2, 0: gate/up, down, both */
        failed = mb_variant_time(v, r->io, r->sets, r->nsets, r->iters, which, &us[w], msg);
    }
    if (failed) { /* e.g. a configuration that does not fit this GPU: say so, go on */
        say("| %s | failed: %s | | | | | | | | |\n", mb_variant_name(v), msg);
        if (phases) phases[0] = '\0';
        return;
    }
    if (sl_gpu_download(r->c, got, r->io->out_f32, sizeof got, &err)) DIE("%s", err.msg);
    const int exact = !memcmp(got, r->want, sizeof got);
    const double gu_b = (double)NUSED * 2 * r->bg, dn_b = (double)NUSED * r->bd;
    char part[2][48];
    for (int w = 0; w < 2; w++)
        if (us[w] > 0)
            snprintf(part[w], sizeof part[w], "%.1f | %.0f", us[w],
                     (w ? dn_b : gu_b) / us[w] / 1e3);
        else
            snprintf(part[w], sizeof part[w], "- | -");
    const double gbs = r->token_bytes / us[2] / 1e3;
    say("| %s | %s | %s | %.1f | %.0f | %.3f | %.3f | %s |\n", mb_variant_name(v), part[0], part[1],
        us[2], gbs, gbs / r->hbm, gbs / r->own, exact ? "bit-exact" : "DIFFERS");
    if (phases) {
        if (sl_gpu_download(r->c, stamps, r->io->stamps, sizeof stamps, &err)) DIE("%s", err.msg);
        fused_phases(stamps, mb_variant_name(v), phases, PHASE_ROW);
    }
}

int main(int argc, char **argv)
{
    opts o = {NULL, 36, 200, 0, 0, 0, 1, 0, {0}, NULL};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc)
            o.out = argv[++i];
        else if (!strcmp(argv[i], "--pool") && i + 1 < argc)
            o.pool = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            o.iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--zc-all"))
            o.zc_all = 1;
        else if (!strcmp(argv[i], "--quick"))
            o.quick = 1;
        else if (!strcmp(argv[i], "--stamps") && i + 1 < argc)
            o.stamps = argv[++i];
        else if (!strcmp(argv[i], "--carveout") && i + 1 < argc)
            o.carve = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--passes") && i + 1 < argc)
            o.passes = atoi(argv[++i]) < 1 ? 1 : atoi(argv[i]);
        else if (!strcmp(argv[i], "--also") && i + 1 < argc && o.n_also < 8) {
            o.also[o.n_also] = atoi(argv[++i]);
            if (o.also[o.n_also] < 0 || o.also[o.n_also] >= mb_variant_count())
                DIE("--also %d: variants are 0..%d", o.also[o.n_also], mb_variant_count() - 1);
            o.n_also++;
        } else {
            printf("usage: bench-moe [-o FILE.md] [--pool N (36)] [--iters N (200)] [--zc-all] "
                   "[--quick [--also V]... [--passes N]] [--carveout PCT] [--stamps FILE]\n");
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    if (o.pool < 12) o.pool = 12;
    sl_err err = {0};
    int ndev = 0;
    if (sl_gpu_device_count(&ndev, &err)) DIE("%s", err.msg);
    if (ndev == 0) {
        printf("bench-moe: no GPU present, nothing measured\n");
        return 0;
    }
    if (o.out && !(md = fopen(o.out, "w"))) DIE("fopen(%s) failed", o.out);
    char desc[256];
    if (sl_gpu_describe(0, desc, sizeof desc, &err)) DIE("%s", err.msg);

    const sl_moe_shape s = {.dim = DIM,
                            .inter = INTER,
                            .n_expert = 384,
                            .n_used = NUSED,
                            .gate_type = SL_QTYPE_Q2_K,
                            .up_type = SL_QTYPE_Q2_K,
                            .down_type = SL_QTYPE_Q3_K,
                            .sh_gate_type = SL_QTYPE_Q2_K,
                            .sh_up_type = SL_QTYPE_Q2_K,
                            .sh_down_type = SL_QTYPE_Q3_K,
                            .route_scale = 1.5f,
                            .norm_topk = 1,
                            .swiglu_limit = 10.0f,
                            .gate_temp = 1.0f};
    sl_gpu_ctx *c = NULL;
    if (sl_gpu_open(&c, 0, &s, &err)) DIE("%s", err.msg);

    const uint64_t nel = (uint64_t)DIM * INTER;
    const size_t bg = sl_qtype_row_bytes(SL_QTYPE_Q2_K, nel),
                 bd = sl_qtype_row_bytes(SL_QTYPE_Q3_K, nel);
    const size_t per_expert = 2 * bg + bd;
    const double token_bytes = (double)NUSED * per_expert;
    const int np = o.pool;

    /* the pool: host copies (for the emulation and the shm arena) and device copies */
    uint8_t *host = malloc(per_expert * np);
    if (!host) DIE("malloc(%zu)", per_expert * np);
    void **dev = calloc(np, sizeof *dev), **dev_pk = calloc(np, sizeof *dev_pk);
    void **dev_p112 = calloc(np, sizeof *dev_p112); /* the older variants' packed downs */
    const size_t bd_pk = sl_gpu_packed_bytes(bd);   /* a down in device memory (gpu.h) */
    const size_t bd_p112 = bd / 110 * SL_Q3K_PACKED;
    uint8_t *pbuf = malloc(bd_p112);
    if (!dev || !dev_pk || !dev_p112 || !pbuf) DIE("out of memory");
    for (int e = 0; e < np; e++) {
        uint8_t *p = host + per_expert * e;
        fill_blocks(p, SL_QTYPE_Q2_K, nel, 0.004f);
        fill_blocks(p + bg, SL_QTYPE_Q2_K, nel, 0.004f);
        fill_blocks(p + 2 * bg, SL_QTYPE_Q3_K, nel, 0.0005f);
        if (sl_gpu_malloc(c, &dev[e], per_expert, &err) ||
            sl_gpu_upload(c, dev[e], p, per_expert, &err) ||
            sl_gpu_malloc(c, &dev_pk[e], bd_pk, &err) ||
            sl_gpu_upload_down(c, dev_pk[e], p + 2 * bg, bd, &err))
            DIE("%s", err.msg);
        sl_emu_pack_q3_k(p + 2 * bg, bd / 110, pbuf);
        if (sl_gpu_malloc(c, &dev_p112[e], bd_p112, &err) ||
            sl_gpu_upload(c, dev_p112[e], pbuf, bd_p112, &err))
            DIE("%s", err.msg);
    }
    free(pbuf);
    uint16_t xh[DIM];
    for (int i = 0; i < DIM; i++) xh[i] = sl_f32_to_bf16((urand() - 0.5f) * 4.0f);

    say("# bench-moe, %s\n\n", desc);
    say("dim %d, inter %d, %d experts of %zu bytes (Q2_K gate/up %zu B each, Q3_K down %zu B): "
        "%.2f MB per token; pool of %d experts (%.0f MB) rotated so L2 never holds them; %d "
        "iterations.\n\n",
        DIM, INTER, NUSED, per_expert, bg, bd, token_bytes / 1e6, np, (double)per_expert * np / 1e6,
        o.iters);

    /* HBM ceiling */
    void *big = NULL;
    const size_t big_bytes = (size_t)2 << 30;
    char msg[256] = "";
    if (o.carve) {
        if (mb_carveout(o.carve, msg)) DIE("%s", msg);
        say("The bench's instances of the shipped kernels prefer a shared-memory carveout of "
            "%d%%.\n\n",
            o.carve);
    }
    double hbm = 0;
    if (sl_gpu_malloc(c, &big, big_bytes, &err)) DIE("%s", err.msg);
    if (mb_read_ceiling(big, big_bytes, 10, &hbm, msg)) DIE("%s", msg);
    sl_gpu_free(c, big);
    say("HBM read ceiling (int4 read kernel, 2 GiB, best of 9): **%.0f GB/s**\n\n", hbm);

    /* expert sets */
    const int nsets = np / NUSED;
    mb_set *sets = calloc(nsets, sizeof *sets);
    for (int k = 0; k < nsets; k++)
        for (int j = 0; j < NUSED; j++) {
            const uint8_t *p = dev[k * NUSED + j];
            sets[k].gate[j] = p;
            sets[k].up[j] = p + bg;
            sets[k].down[j] = p + 2 * bg;
            sets[k].down_pk[j] = dev_pk[k * NUSED + j];
            sets[k].down_p112[j] = dev_p112[k * NUSED + j];
            sets[k].w[j] = 0.25f + 0.05f * j;
        }
    /* the own-size ceiling: the best of five reads of one token's experts */
    double rd[5], own = 0;
    for (int f = 0; f < 5; f++) {
        if (mb_read_sets(sets, nsets, NUSED, bg, bd, o.iters, f, &rd[f], msg)) DIE("%s", msg);
        if (rd[f] > own) own = rd[f];
    }
    say("Read ceiling at the problem's size (one launch per token over its 6 experts, rotating "
        "the pool; the best of five reads): **%.0f GB/s** (%.1f us per token) = %.3fx the HBM "
        "ceiling. The int4 grid-stride read over the token as one range (two 64-bit divisions "
        "a load, the only form before session 24) %.0f GB/s (%.1f us); the same loads expert "
        "by expert, six in flight a thread, no division, %.0f GB/s (%.1f us); bulk copies into "
        "shared memory (2 CTAs an SM, six of 16 KB in flight each) %.0f GB/s (%.1f us); the "
        "same launched with PDL (each launch's copies start as the one before ends, as the "
        "GEMVs' rows are timed) %.0f GB/s (%.1f us); and with the weights' L2 evict-first "
        "hint too %.0f GB/s (%.1f us)\n\n",
        own, token_bytes / own / 1e3, own / hbm, rd[0], token_bytes / rd[0] / 1e3, rd[1],
        token_bytes / rd[1] / 1e3, rd[2], token_bytes / rd[2] / 1e3, rd[3],
        token_bytes / rd[3] / 1e3, rd[4], token_bytes / rd[4] / 1e3);
    mb_io io = {.dim = DIM, .inter = INTER, .n = NUSED};
    unsigned long long *gu_st = NULL, *dn_st = NULL, *rt_st = NULL; /* the kernels' milestones */
    void *t;
    if (sl_gpu_malloc(c, &t, DIM * 2, &err) || sl_gpu_upload(c, t, xh, DIM * 2, &err))
        DIE("%s", err.msg);
    io.x = t;
    if (sl_gpu_malloc(c, (void **)&io.ximg, 16384, &err) ||
        sl_gpu_malloc(c, (void **)&io.h, 8 * INTER * 4, &err) ||
        sl_gpu_malloc(c, (void **)&io.hq, 8 * INTER, &err) ||
        sl_gpu_malloc(c, (void **)&io.hd, 8 * INTER / 32 * 4, &err) ||
        sl_gpu_malloc(c, (void **)&io.cnt, 8 * INTER / 32 * 4, &err) ||
        sl_gpu_malloc(c, (void **)&io.sync, 4096 * 4, &err) ||
        sl_gpu_malloc(c, (void **)&io.part, 8 * DIM * 4, &err) ||
        sl_gpu_malloc(c, (void **)&io.stamps, 1024 * 4 * 8, &err) ||
        sl_gpu_malloc(c, (void **)&gu_st, MB_ST_RECS * MB_ST_SLOTS * 8, &err) ||
        sl_gpu_malloc(c, (void **)&dn_st, MB_ST_RECS * MB_ST_SLOTS * 8, &err) ||
        sl_gpu_malloc(c, (void **)&rt_st, SL_GPU_RT_STAMPS * 8, &err) ||
        sl_gpu_malloc(c, (void **)&io.out_f32, DIM * 4, &err) ||
        sl_gpu_malloc(c, (void **)&io.out, DIM * 2, &err))
        DIE("%s", err.msg);
    {
        static unsigned zero[4096];
        if (sl_gpu_upload(c, io.cnt, zero, 8 * INTER / 32 * 4, &err) ||
            sl_gpu_upload(c, io.sync, zero, sizeof zero, &err))
            DIE("%s", err.msg);
    }

    /* the emulation of set 0 (experts 0..5 of the pool, ids increasing = table order) */
    sl_moe_route route = {{0}, {0}};
    sl_moe_expert_w hw[NUSED];
    for (int j = 0; j < NUSED; j++) {
        route.expert[j] = (uint32_t)j;
        route.weight[j] = sets[0].w[j];
        const uint8_t *p = host + per_expert * j;
        hw[j] = (sl_moe_expert_w){p, p + bg, p + 2 * bg};
    }
    static float want[DIM], got[DIM];
    uint16_t want_bf[DIM];
    if (sl_emu_moe(&s, xh, &route, hw, NULL, want_bf, want, NULL, &err)) DIE("%s", err.msg);

    say("## Routed experts, one token (6 experts, %.2f MB), weights in device memory\n\n",
        token_bytes / 1e6);
    say("| variant | gate/up us | GB/s | down us | GB/s | both us | GB/s | x ceiling | x own-size "
        "| vs emulation |\n");
    say("|---|---|---|---|---|---|---|---|---|---|\n");
    /* the fused kernels come last (their own section at the end): a broken one traps,
     * and a trapped context ends the run */
    const routed_ctx rc_ = {c, &io, sets, nsets, o.iters, hbm, own, token_bytes, bg, bd, want};
    for (int pass = 0; pass < (o.quick ? o.passes : 1); pass++) /* --passes: other positions */
        for (int v = 0; v < mb_variant_count(); v++)
            if (!mb_variant_fused(v) && (!o.quick || quick_row(&o, v))) routed_row(&rc_, v, NULL);
    say("\n(ggml-cuda MUL_MAT_ID, same token: 127 us, 606 GB/s.)\n\n");
    {
        /* each kernel's milestones on the GPU's clock: the last of 8 launches back to back */
        static unsigned long long st[MB_ST_RECS * MB_ST_SLOTS];
        mb_io in = io;
        static const int vs[3] = {MB_V_SHIPPED, MB_V_S20, MB_V_S11};
        static const uint32_t ns[2] = {1, NUSED};
        for (int a = 0; a < 3; a++)
            for (int b = 0; b < 2; b++) {
                const int v = vs[a];
                const uint32_t n = ns[b];
                in.n = n;
                if (mb_variant_stamped(v, &in, sets, nsets, 8, gu_st, dn_st, msg)) DIE("%s", msg);
                char what[384];
                for (int k = 0; k < 2; k++) {
                    if (sl_gpu_download(c, st, k ? dn_st : gu_st, sizeof st, &err))
                        DIE("%s", err.msg);
                    snprintf(what, sizeof what, "Milestones of the %s (%s), %u expert%s",
                             k ? "down" : "gate/up", mb_variant_name(v), n, n > 1 ? "s" : "");
                    stamp_table(st, what, o.stamps);
                }
            }
    }

    /* the compute variant over 1..6 experts a launch: the slope is the steady cost of one
     * expert, the intercept what a launch costs besides (start, first bytes, tail) */
    {
        say("Experts a launch, compute's kernels (variant 1), us:\n\n| experts | gate/up | down "
            "|\n|---|---|---|\n");
        double sx = 0, sy[2] = {0, 0}, sxx = 0, sxy[2] = {0, 0};
        for (uint32_t n = 1; n <= NUSED; n++) {
            mb_io in = io;
            in.n = n;
            double tn[2];
            for (int w = 0; w < 2; w++)
                if (mb_variant_time(MB_V_SHIPPED, &in, sets, nsets, o.iters, w + 1, &tn[w], msg))
                    DIE("%s", msg);
            say("| %u | %.1f | %.1f |\n", n, tn[0], tn[1]);
            if (n >= 2) {
                sx += n;
                sxx += (double)n * n;
                for (int w = 0; w < 2; w++) {
                    sy[w] += tn[w];
                    sxy[w] += n * tn[w];
                }
            }
        }
        const double m = NUSED - 1, den = m * sxx - sx * sx;
        for (int w = 0; w < 2; w++) {
            const double slope = (m * sxy[w] - sx * sy[w]) / den, icpt = (sy[w] - slope * sx) / m;
            const double eb = w ? (double)bd : 2.0 * bg;
            say("%s%s: %.2f us an expert (%.0f GB/s), %.1f us a launch besides (fit over 2..%d)",
                w ? "; " : "\n", w ? "down" : "gate/up", slope, eb / slope / 1e3, icpt, NUSED);
        }
        say("\n\n");
    }

    /* zero-copy: 12 experts in a registered POSIX shm mapping */
    if (!o.quick) {
        const int nz = 12;
        char name[64];
        snprintf(name, sizeof name, "/sluice-bench-moe-%d", (int)getpid());
        const size_t zb = per_expert * nz;
        const int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0) DIE("shm_open(%s) failed", name);
        shm_unlink(name);
        if (ftruncate(fd, (off_t)zb)) DIE("ftruncate(%zu) failed", zb);
        uint8_t *z = mmap(NULL, zb, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (z == MAP_FAILED) DIE("mmap(%zu) failed", zb);
        close(fd);
        memcpy(z, host, zb);
        void *zd = NULL;
        if (sl_gpu_host_register(z, zb, &zd, &err)) DIE("%s", err.msg);
        double zc = 0;
        if (mb_read_ceiling(zd, zb, 4, &zc, msg)) DIE("%s", msg);
        mb_set zs[2];
        memset(zs, 0, sizeof zs);
        for (int k = 0; k < 2; k++)
            for (int j = 0; j < NUSED; j++) {
                const uint8_t *p = (const uint8_t *)zd + per_expert * (k * NUSED + j);
                zs[k].gate[j] = p;
                zs[k].up[j] = p + bg;
                zs[k].down[j] = p + 2 * bg;
                zs[k].w[j] = sets[0].w[j];
            }
        say("## Zero-copy: experts read in place from a registered POSIX shm mapping (%.0f MB)\n\n",
            zb / 1e6);
        say("| path | GB/s | x ceiling | vs emulation |\n|---|---|---|---|\n");
        say("| int4 read kernel over the mapping (ceiling) | %.1f | 1.000 | |\n", zc);
        const int nzv = o.zc_all ? mb_variant_count() : 1;
        for (int v = 0; v < nzv; v++) { /* variant 0: compute/'s kernels for mapped weights */
            if (mb_variant_packed(v)) continue; /* packed blocks live in device memory only */
            double us = 0;
            if (mb_variant_time(v, &io, zs, 2, 6, 0, &us, msg)) DIE("%s", msg);
            if (sl_gpu_download(c, got, io.out_f32, sizeof got, &err)) DIE("%s", err.msg);
            const int exact = !memcmp(got, want, sizeof got);
            say("| %s, one token (%.1f us) | %.1f | %.3f | %s |\n", mb_variant_name(v), us,
                token_bytes / us / 1e3, token_bytes / us / 1e3 / zc,
                exact ? "bit-exact" : "DIFFERS");
        }
        say("\n");
        if (sl_gpu_host_unregister(z, &err)) DIE("%s", err.msg);
        munmap(z, zb);
    }

    /* a whole all-hit layer through compute/gpu.h */
    {
        uint16_t *rw = malloc((size_t)384 * DIM * 2);
        for (size_t i = 0; i < (size_t)384 * DIM; i++)
            rw[i] = sl_f32_to_bf16((urand() - 0.5f) * 0.05f);
        void *rwd = NULL, *out = NULL, *shd = NULL;
        if (sl_gpu_malloc(c, &rwd, (size_t)384 * DIM * 2, &err) ||
            sl_gpu_upload(c, rwd, rw, (size_t)384 * DIM * 2, &err) ||
            sl_gpu_malloc(c, &out, DIM * 2, &err) || sl_gpu_malloc(c, &shd, per_expert, &err) ||
            sl_gpu_upload(c, shd, host + per_expert * (np - 1), per_expert, &err))
            DIE("%s", err.msg);
        const sl_moe_expert_w sh = {shd, (uint8_t *)shd + bg, dev_pk[np - 1]}; /* its copy */
        float logits[384];
        const int it_n = o.iters * 2;
        double *lat = malloc(sizeof(double) * it_n), *lr = malloc(sizeof(double) * it_n);
        double *lx = malloc(sizeof(double) * it_n);
        say("## Whole MoE layer, all hits, through compute/gpu.h (%d tokens, host wall clock)\n\n",
            it_n);
        say("shared expert (Q2_K/Q2_K/Q3_K in device memory: it runs inside the routed gate/up "
            "and down launches), router GEMV (384 x 5120 bf16); the host's rows wait for its "
            "logits and pick a top-6 (split: "
            "sl_gpu_moe_begin, part(ranks 0-2), part(ranks 3-5), finish); the device row runs "
            "the selection on the GPU (a forced routing over every expert id, each in a device "
            "tier table) and queues gate/up before the host sees the picks. Whole layer: with a "
            "sync after each; back to back: %d layers queued with no sync but the picks' wait, "
            "as the engine runs them.\n\n",
            it_n);
        say("| | router + picks us (p10, p90) | routed + sync us | whole layer us (p10, p90) | "
            "back to back, us per layer |\n|---|---|---|---|---|\n");
        /* the device tier's table for mode 2: expert id e -> pool expert e mod (np - 1) */
        sl_gpu_t0e *t0h = calloc(384, sizeof *t0h);
        for (int e = 0; e < 384; e++) {
            const uint8_t *p = dev[e % (np - 1)];
            t0h[e] = (sl_gpu_t0e){p, p + bg, dev_pk[e % (np - 1)]};
        }
        void *t0d = NULL;
        if (sl_gpu_malloc(c, &t0d, 384 * sizeof *t0h, &err) ||
            sl_gpu_upload(c, t0d, t0h, 384 * sizeof *t0h, &err))
            DIE("%s", err.msg);
        /* sluice-compute's layer: the residual (h + the last layer's output) and the norm
         * inside the router's CTAs, x computed there (hn ping-pongs: h_out is not h) */
        norm_io nio = {{NULL, NULL}, NULL, NULL};
        {
            uint16_t hb[DIM];
            float wf[DIM];
            for (int i = 0; i < DIM; i++) {
                hb[i] = sl_f32_to_bf16((urand() - 0.5f) * 2.0f);
                wf[i] = 0.5f + urand();
            }
            for (int k = 0; k < 2; k++)
                if (sl_gpu_malloc(c, &nio.h[k], DIM * 2, &err) ||
                    sl_gpu_upload(c, nio.h[k], hb, DIM * 2, &err))
                    DIE("%s", err.msg);
            if (sl_gpu_malloc(c, &nio.w, DIM * 4, &err) ||
                sl_gpu_upload(c, nio.w, wf, DIM * 4, &err) ||
                sl_gpu_malloc(c, &nio.x, DIM * 2, &err) || sl_gpu_upload(c, out, hb, DIM * 2, &err))
                DIE("%s", err.msg);
        }
        static const char *const mode_name[8] = {
            "host top-6, sl_gpu_moe_routed",
            "host top-6, begin + 2 parts + finish",
            "**device routing**: router + selection + gate/up queued at once, finish",
            "**device routing**, the gate/up waiting for the whole selection",
            "**device routing**, h's q8_1 by k_quant_h after the gate/up (until session 12)",
            "**device routing**, h's q8_1 by each warp group of the gate/up, its own 32 rows "
            "(sessions 12 to 17)",
            "**device routing**, the residual and the norm inside the router (sluice-compute's "
            "layer; its own x, so other bits)",
            "**device routing**, the residual and the norm as their own kernel, then the router "
            "(sluice-compute's `--norm-kernel`; its own x)"};
        for (int mode = 0; mode < 8; mode++) {
            if (o.quick && mode < 2) continue;
            const sl_gpu_probe pr = {.wait_select = mode == 3,
                                     .qh_form = mode == 4   ? 1
                                                : mode == 5 ? 3
                                                            : 0};
            if (sl_gpu_set_probe(c, &pr, &err)) DIE("%s", err.msg);
            double b2b = 0;
            for (int pass = 0; pass < 2; pass++) { /* 0: a sync per layer; 1: back to back */
                const double tb = now_us();
                for (int it = -10; it < it_n; it++) {
                    const double t0 = now_us();
                    /* modes 6, 7: sluice-compute's layer forms */
                    const int form = mode == 6   ? NORM_IN_ROUTER
                                     : mode == 7 ? NORM_KERNEL
                                                 : NORM_NONE;
                    if (mode < 2 && sl_gpu_moe_shared(c, io.x, &sh, &err)) DIE("%s", err.msg);
                    sl_moe_route r;
                    memset(&r, 0, sizeof r);
                    sl_moe_expert_w w[NUSED];
                    double t1;
                    if (mode >= 2) {
                        forced_route(it + 10, &r);
                        uint32_t started = 0;
                        if (route_layer(c, form, it, io.x, &nio, out, &sh, rwd, t0d, &r, &err) ||
                            sl_gpu_route_wait(c, &r, &started, &err))
                            DIE("%s", err.msg);
                        t1 = now_us();
                        if (started != (1u << NUSED) - 1) DIE("device tier started 0x%x", started);
                        if (sl_gpu_moe_finish(c, out, NULL, &err)) DIE("%s", err.msg);
                    } else {
                        if (sl_gpu_router_logits(c, io.x, rwd, logits, &err)) DIE("%s", err.msg);
                        t1 = now_us();
                        int used[384] = {0};
                        float sum = 0;
                        for (int k = 0; k < NUSED; k++) { /* plain top-6 of the logits */
                            int best = -1;
                            for (int e = 0; e < 384; e++)
                                if (!used[e] && (best < 0 || logits[e] > logits[best])) best = e;
                            used[best] = 1;
                            r.expert[k] = (uint32_t)best;
                            r.weight[k] = 1.0f + 0.01f * k;
                            sum += r.weight[k];
                        }
                        for (int k = 0; k < NUSED; k++) {
                            r.weight[k] *= 1.5f / sum;
                            /* a different pool expert each step (all hits, none in L2) */
                            const int pe = ((it + 10) * NUSED + k) % (np - 1);
                            const uint8_t *p = dev[pe];
                            w[k] = (sl_moe_expert_w){p, p + bg, dev_pk[pe]};
                        }
                        if (mode == 1) {
                            const uint32_t lo[3] = {0, 1, 2}, hi[3] = {5, 3, 4};
                            if (sl_gpu_moe_begin(c, io.x, &r, &err) ||
                                sl_gpu_moe_part(c, lo, 3, w, &err) ||
                                sl_gpu_moe_part(c, hi, 3, w, &err) ||
                                sl_gpu_moe_finish(c, out, NULL, &err))
                                DIE("%s", err.msg);
                        } else if (sl_gpu_moe_routed(c, io.x, &r, w, out, NULL, &err))
                            DIE("%s", err.msg);
                    }
                    if (pass == 0 && sl_gpu_sync(c, &err)) DIE("%s", err.msg);
                    const double t2 = now_us();
                    if (it == -1) {
                        if (sl_gpu_sync(c, &err)) DIE("%s", err.msg);
                        b2b = now_us();
                    }
                    if (pass == 0 && it >= 0) {
                        lat[it] = t2 - t0;
                        lr[it] = t1 - t0;
                        lx[it] = t2 - t1;
                    }
                }
                if (sl_gpu_sync(c, &err)) DIE("%s", err.msg);
                if (pass == 1) b2b = (now_us() - b2b) / it_n;
                (void)tb;
            }
            qsort(lat, it_n, sizeof *lat, cmp_d);
            qsort(lr, it_n, sizeof *lr, cmp_d);
            qsort(lx, it_n, sizeof *lx, cmp_d);
            /* modes 3 to 5's last output against mode 2's (the same routes) */
            static uint16_t last[4][DIM];
            if (mode >= 2 && mode < 6 &&
                sl_gpu_download(c, last[mode - 2], out, sizeof last[0], &err))
                DIE("%s", err.msg);
            say("| %s | %.1f (%.1f, %.1f) | %.1f | **%.1f** (%.1f, %.1f) | **%.1f**%s |\n",
                mode_name[mode], lr[it_n / 2], lr[it_n / 10], lr[it_n * 9 / 10], lx[it_n / 2],
                lat[it_n / 2], lat[it_n / 10], lat[it_n * 9 / 10], b2b,
                mode < 3 || mode >= 6                              ? ""
                : !memcmp(last[0], last[mode - 2], sizeof last[0]) ? " (output: the same bits)"
                                                                   : " (output DIFFERS)");
        }
        {
            const sl_gpu_probe pr = {0};
            if (sl_gpu_set_probe(c, &pr, &err)) DIE("%s", err.msg);
        }
        /* Where a device-routed layer's time goes, on the GPU's own clock (event marks on
         * the main stream, layers back to back): A = router + selection (+ gate/up of
         * the device tier when it holds the picks), B = the rest (q8_1 of h, down, the
         * sum), including any wait for the host to queue it. */
        say("\nDevice-routed layers back to back, GPU timeline (event marks, median of %d):\n\n"
            "| device tier | router + selection (+ gate/up) us | finish us | layer us |\n"
            "|---|---|---|---|\n",
            it_n / 4);
        for (int with_t0 = 1; with_t0 >= 0; with_t0--) {
            const int nl = it_n / 4;
            uint64_t ns[3 * 400 + 2];
            double ta[400], tf[400], tl[400];
            uint32_t id = 0, n = 0;
            if (sl_gpu_mark_anchor(c, &err)) DIE("%s", err.msg);
            for (int it = 0; it < nl; it++) {
                sl_moe_route r;
                forced_route(it, &r);
                uint32_t started = 0;
                if (sl_gpu_moe_shared(c, io.x, &sh, &err) || sl_gpu_mark(c, &id, &err) ||
                    sl_gpu_route_start(c, io.x, rwd, NULL, with_t0 ? t0d : NULL, &r, &err) ||
                    sl_gpu_mark(c, &id, &err) || sl_gpu_route_wait(c, &r, &started, &err))
                    DIE("%s", err.msg);
                if (!with_t0) {
                    sl_moe_expert_w w[NUSED];
                    uint32_t all[NUSED];
                    for (int k = 0; k < NUSED; k++) {
                        const sl_gpu_t0e *te = &t0h[r.expert[k]];
                        w[k] = (sl_moe_expert_w){te->gate, te->up, te->down};
                        all[k] = (uint32_t)k;
                    }
                    if (sl_gpu_moe_part(c, all, NUSED, w, &err)) DIE("%s", err.msg);
                }
                if (sl_gpu_moe_finish(c, out, NULL, &err) || sl_gpu_mark(c, &id, &err))
                    DIE("%s", err.msg);
            }
            if (sl_gpu_marks_read(c, ns, &n, &err)) DIE("%s", err.msg);
            for (int it = 0; it < nl; it++) {
                const uint64_t *m = ns + 1 + 3 * it;
                ta[it] = (double)(m[1] - m[0]) / 1e3;
                tf[it] = (double)(m[2] - m[1]) / 1e3;
                tl[it] = it ? (double)(m[2] - m[-1]) / 1e3 : 0;
            }
            qsort(ta, nl, sizeof *ta, cmp_d);
            qsort(tf, nl, sizeof *tf, cmp_d);
            qsort(tl, nl, sizeof *tl, cmp_d);
            say("| %s | %.1f | %.1f | %.1f |\n",
                with_t0 ? "holds every pick (gate/up before the host sees the picks)"
                        : "empty (the host queues gate/up after the picks)",
                ta[nl / 2], tf[nl / 2], tl[nl / 2 + 1]);
        }
        say("\n");
        /* the device-routed layer's gate/up and down on the GPU's clock: the last of 8
         * layers back to back, with the gate/up starting on the selection's table, after
         * the whole selection (ws 1), with h's q8_1 by k_quant_h (ws 2), by each warp
         * group, its own 32 rows (ws 3, sessions 12 to 17), with the residual and the norm inside
         * the router (ws 4), as their own kernel before it (ws 5) */
        for (int ws = 0; ws <= 5; ws++) {
            static unsigned long long st[MB_ST_RECS * MB_ST_SLOTS], st2[MB_ST_RECS * MB_ST_SLOTS],
                rts[SL_GPU_RT_STAMPS];
            memset(st, 0, sizeof st);
            memset(rts, 0, sizeof rts);
            const sl_gpu_probe pr = {.wait_select = ws == 1,
                                     .qh_form = ws == 2   ? 1
                                                : ws == 3 ? 3
                                                          : 0,
                                     .gu_stamps = gu_st,
                                     .dn_stamps = dn_st,
                                     .records = MB_ST_RECS,
                                     .rt_stamps = rt_st};
            if (sl_gpu_upload(c, gu_st, st, sizeof st, &err) ||
                sl_gpu_upload(c, dn_st, st, sizeof st, &err) ||
                sl_gpu_upload(c, rt_st, rts, sizeof rts, &err) || sl_gpu_set_probe(c, &pr, &err))
                DIE("%s", err.msg);
            for (int it = 0; it < 8; it++) {
                sl_moe_route r;
                forced_route(it, &r);
                uint32_t started = 0;
                const int form = ws == 4 ? NORM_IN_ROUTER : ws == 5 ? NORM_KERNEL : NORM_NONE;
                if (route_layer(c, form, it, io.x, &nio, out, &sh, rwd, t0d, &r, &err) ||
                    sl_gpu_route_wait(c, &r, &started, &err) ||
                    sl_gpu_moe_finish(c, out, NULL, &err))
                    DIE("%s", err.msg);
            }
            if (sl_gpu_sync(c, &err)) DIE("%s", err.msg);
            if (sl_gpu_download(c, st, gu_st, sizeof st, &err) ||
                sl_gpu_download(c, st2, dn_st, sizeof st2, &err) ||
                sl_gpu_download(c, rts, rt_st, sizeof rts, &err))
                DIE("%s", err.msg);
            if (ws != 1) {
                if (ws)
                    say(ws == 2   ? "With h's q8_1 by k_quant_h after the gate/up (until session "
                                    "12):\n\n"
                        : ws == 3 ? "With h's q8_1 by each warp group, its own 32 rows "
                                    "(sessions 12 to 17):\n\n"
                        : ws == 4 ? "With the residual and the norm inside the router "
                                    "(sluice-compute's layer):\n\n"
                                  : "With the residual and the norm as their own kernel before "
                                    "the router (`--norm-kernel`; the timeline starts at the "
                                    "router):\n\n");
                layer_timeline(rts, st, st2);
            }
            for (int k = 0; k < 2; k++) {
                char what[160];
                if (sl_gpu_download(c, st, k ? dn_st : gu_st, sizeof st, &err)) DIE("%s", err.msg);
                snprintf(what, sizeof what,
                         "Milestones of the device-routed layer's %s (6 experts and the shared "
                         "one%s)",
                         k ? "down" : "gate/up",
                         ws == 1   ? ", after the whole selection"
                         : ws == 2 ? ", h's q8_1 by k_quant_h"
                         : ws == 3 ? ", h's q8_1 by each warp group"
                         : ws == 4 ? ", the norm inside the router"
                         : ws == 5 ? ", the norm as its own kernel"
                                   : "");
                stamp_table(st, what, o.stamps);
            }
        }
        {
            const sl_gpu_probe pr = {0};
            if (sl_gpu_set_probe(c, &pr, &err)) DIE("%s", err.msg);
        }
        if (o.quick) {
            if (md) fclose(md);
            return 0;
        }
        /* The fused layer kernel (the sandbox's candidate), last: the routed experts of
         * one token as in the first table, each launch's phases, then whole device-only
         * layers. */
        say("## The fused layer kernel: gate/up, q8_1 of h and down in one launch\n\n"
            "Routed experts, one token, as in the first table:\n\n| variant | gate/up us | "
            "GB/s | down us | GB/s | both us | GB/s | x ceiling | x own-size | vs emulation "
            "|\n|---|---|---|---|---|---|---|---|---|---|\n");
        {
            char phases[16][PHASE_ROW];
            int n_phases = 0;
            for (int v = 0; v < mb_variant_count(); v++)
                if (mb_variant_fused(v) && n_phases < 16) routed_row(&rc_, v, phases[n_phases++]);
            say("\nEach variant's last launch on the GPU's clock (%%globaltimer of each CTA's "
                "thread 0; medians over the CTAs whose first group has a down unit): x landed "
                "-> that group's first down unit (its gate/up units), -> its h copied (the "
                "wait for the expert's h), -> the CTA's end (the downs); and the launch's "
                "span, first start to last end:\n\n| variant | gate/up us | wait for h us | "
                "downs us | span us | CTAs |\n|---|---|---|---|---|---|\n");
            for (int i = 0; i < n_phases; i++)
                if (phases[i][0]) say("%s", phases[i]);
            say("\n");
        }
        /* The fused layer kernel, device only: router + selection + one launch for the
         * experts (the shared one with them), layers back to back, nothing on the host
         * between them; checked against the emulation of layer 0's picks. */
        {
            sl_moe_route *fr = malloc(sizeof *fr * (size_t)it_n);
            if (!fr) DIE("out of memory");
            for (int it = 0; it < it_n; it++) forced_route(it, &fr[it]);
            void *frd = NULL;
            if (sl_gpu_malloc(c, &frd, sizeof *fr * (size_t)it_n, &err) ||
                sl_gpu_upload(c, frd, fr, sizeof *fr * (size_t)it_n, &err))
                DIE("%s", err.msg);
            /* the fused kernel reads raw Q3_K blocks: its own device-tier table and shared
             * down point at the pool's raw copies */
            for (int e = 0; e < 384; e++) {
                const uint8_t *p = dev[e % (np - 1)];
                t0h[e] = (sl_gpu_t0e){p, p + bg, p + 2 * bg};
            }
            void *t0raw = NULL;
            if (sl_gpu_malloc(c, &t0raw, 384 * sizeof *t0h, &err) ||
                sl_gpu_upload(c, t0raw, t0h, 384 * sizeof *t0h, &err))
                DIE("%s", err.msg);
            const mb_layer L = {.n_expert = 384,
                                .n_used = NUSED,
                                .gate_temp = s.gate_temp,
                                .route_scale = s.route_scale,
                                .limit = s.swiglu_limit,
                                .norm_topk = s.norm_topk,
                                .router = rwd,
                                .t0 = t0raw,
                                .forced = frd,
                                .n_forced = it_n,
                                .sh_gate = sh.gate,
                                .sh_up = sh.up,
                                .sh_down = (const uint8_t *)shd + 2 * bg,
                                .io = io};
            sl_moe_expert_w hw0[NUSED];
            for (int k = 0; k < NUSED; k++) {
                const uint8_t *p = host + per_expert * (fr[0].expert[k] % (uint32_t)(np - 1));
                hw0[k] = (sl_moe_expert_w){p, p + bg, p + 2 * bg};
            }
            const uint8_t *hs = host + per_expert * (np - 1);
            const sl_moe_expert_w shw = {hs, hs + bg, hs + 2 * bg};
            static float want0[DIM];
            uint16_t want0_bf[DIM];
            if (sl_emu_moe(&s, xh, &fr[0], hw0, &shw, want0_bf, want0, NULL, &err))
                DIE("%s", err.msg);
            say("Device-only all-hit layers with the fused kernel (router + selection + one "
                "launch for the 6 experts and the shared one; %d layers back to back, CUDA "
                "events, nothing on the host between them), layer 0 checked against the "
                "emulation:\n\n| variant | us per layer | vs emulation |\n|---|---|---|\n",
                it_n);
            for (int v = 0; v < mb_variant_count(); v++) {
                if (!mb_variant_fused(v)) continue;
                double us = 0;
                uint32_t pe[8];
                float pw[8];
                if (mb_fused_layer(v, &L, it_n, &us, pe, pw, msg)) {
                    say("| %s | failed: %s | |\n", mb_variant_name(v), msg);
                    continue;
                }
                int exact = 1;
                for (int k = 0; k < NUSED; k++)
                    exact &= pe[k] == fr[0].expert[k] && pw[k] == fr[0].weight[k];
                if (sl_gpu_download(c, got, io.out_f32, sizeof got, &err)) DIE("%s", err.msg);
                exact &= !memcmp(got, want0, sizeof got);
                say("| %s | **%.1f** | %s |\n", mb_variant_name(v), us,
                    exact ? "bit-exact" : "DIFFERS");
            }
            say("\n");
            sl_gpu_free(c, frd);
            sl_gpu_free(c, t0raw);
            free(fr);
        }
        free(t0h);
        sl_gpu_free(c, t0d);
        say("\n");
        /* what the per-expert placement check of sl_gpu_moe_part costs */
        const void *probe[2] = {dev[0], host};
        for (int i = 0; i < 2; i++) {
            const double p0 = now_us();
            const int kind = mb_ptr_kind(probe[i], 1000);
            say("Placement lookup (cudaPointerGetAttributes) of a %s pointer: %.3f us (type "
                "%d)\n\n",
                i ? "plain host" : "device", (now_us() - p0) / 1000, kind);
        }
        free(lx);
        free(rw);
        free(lat);
        free(lr);
        sl_gpu_free(c, rwd);
        sl_gpu_free(c, out);
        sl_gpu_free(c, shd);
    }
    for (int e = 0; e < np; e++) {
        sl_gpu_free(c, dev[e]);
        sl_gpu_free(c, dev_pk[e]);
        sl_gpu_free(c, dev_p112[e]);
    }
    sl_gpu_close(&c);
    free(host);
    free(dev);
    free(dev_pk);
    free(dev_p112);
    free(sets);
    if (md) fclose(md);
    return 0;
}
