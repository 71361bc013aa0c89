/* ktrace.c - `bench-ktrace`: the layer's chain from a kernel trace (the CSV that the
 * CUPTI injection library bench/cupti/ktrace.c writes), as the layer-timeline results
 * under bench/results give it: for each kernel, the median time from the end of the kernel
 * before it (in start order) to its own end, and its median duration, over the later
 * part of the run; optionally the median period of one kernel (a layer's chain, e.g.
 * the down to the down).
 *
 *   bench-ktrace k.csv [--from F] [--period NAME] [--keep-all]
 *
 * --from F: the records from this fraction of the run on (default 0.5: the steady
 * state). Kernels are named by the first length-prefixed identifier of their mangled
 * name that starts with "k_" (k_router_pf, k_down_pt_q3_k), else by the name as
 * written. The device tier's fills (k_pack_q3_k_tb, k_t0_set) are left out unless
 * --keep-all; copies (memcpy records) always are.
 */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LEN 64
#define MAX_NAMES    64

typedef struct rec {
    unsigned long long start, end;
    int name; /* index into the name table */
} rec;

typedef struct names {
    char s[MAX_NAMES][NAME_MAX_LEN];
    int n;
} names;

/* One clear line on stderr, exit 1. */
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "bench-ktrace: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *alloc(size_t bytes)
{
    void *p = malloc(bytes);
    if (!p) die("out of memory");
    return p;
}

/* The kernel's short name: the first identifier "k_..." whose decimal length prefix
 * covers it exactly (Itanium mangling), else the mangled name cut to fit. */
static void short_name(const char *m, char *out)
{
    for (const char *p = strstr(m, "k_"); p; p = strstr(p + 1, "k_")) {
        const char *d = p;
        while (d > m && isdigit((unsigned char)d[-1])) d--;
        if (d == p) continue;
        const long len = strtol(d, NULL, 10);
        long ok = 0;
        while (ok < len && (isalnum((unsigned char)p[ok]) || p[ok] == '_')) ok++;
        if (len > 0 && ok == len && len < NAME_MAX_LEN) {
            memcpy(out, p, (size_t)len);
            out[len] = '\0';
            return;
        }
    }
    snprintf(out, NAME_MAX_LEN, "%s", m);
}

static int name_index(names *t, const char *s)
{
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->s[i], s)) return i;
    if (t->n == MAX_NAMES) die("more than %d kernel names", MAX_NAMES);
    snprintf(t->s[t->n], NAME_MAX_LEN, "%s", s);
    return t->n++;
}

static int by_start(const void *a, const void *b)
{
    const rec *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of v[0..n) (sorted in place; the mean of the middle two when n is even). */
static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Reads every kernel record of path into *out (start order), naming them in t. */
static size_t read_trace(const char *path, int keep_all, names *t, rec **out)
{
    FILE *f = fopen(path, "r");
    if (!f) die("%s: %s", path, strerror(errno));
    size_t n = 0, cap = 1024;
    rec *r = alloc(cap * sizeof *r);
    char line[4096];
    long ln = 0;
    while (fgets(line, sizeof line, f)) {
        ln++;
        if (!strncmp(line, "memcpy,", 7) || line[0] == '\n') continue;
        if (strncmp(line, "kernel,", 7)) die("%s: line %ld is not a ktrace record", path, ln);
        char *p = line + 7, *e = NULL;
        errno = 0;
        const unsigned long long s = strtoull(p, &e, 10);
        if (errno || e == p || *e != ',') die("%s: line %ld: bad start", path, ln);
        p = e + 1;
        const unsigned long long en = strtoull(p, &e, 10);
        if (errno || e == p || *e != ',' || en < s) die("%s: line %ld: bad end", path, ln);
        for (int k = 0; k < 3 && e; k++) e = strchr(e + 1, ','); /* stream, grid, block */
        if (!e) die("%s: line %ld: no kernel name", path, ln);
        char *nm = e + 1;
        nm[strcspn(nm, "\r\n")] = '\0';
        char sn[NAME_MAX_LEN];
        short_name(nm, sn);
        if (!keep_all && (!strcmp(sn, "k_pack_q3_k_tb") || !strcmp(sn, "k_t0_set"))) continue;
        if (n == cap) {
            cap *= 2;
            rec *g = realloc(r, cap * sizeof *r);
            if (!g) die("out of memory");
            r = g;
        }
        r[n++] = (rec){s, en, name_index(t, sn)};
    }
    if (ferror(f)) die("%s: read error", path);
    fclose(f);
    if (n < 2) die("%s: %zu kernel records, 2 at least are needed", path, n);
    qsort(r, n, sizeof *r, by_start);
    *out = r;
    return n;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *period = NULL;
    double from = 0.5;
    int keep_all = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--from") && i + 1 < argc) {
            char *e = NULL;
            from = strtod(argv[++i], &e);
            if (!e || *e || !(from >= 0.0 && from < 1.0))
                die("--from %s: a fraction in [0, 1)", argv[i]);
        } else if (!strcmp(argv[i], "--period") && i + 1 < argc) {
            period = argv[++i];
        } else if (!strcmp(argv[i], "--keep-all")) {
            keep_all = 1;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: bench-ktrace FILE.csv [--from F] [--period NAME] [--keep-all]\n"
                   "  the median time from each kernel's predecessor's end to its end, and its\n"
                   "  median duration, over the run from fraction F on (default 0.5); --period:\n"
                   "  the median time between that kernel's ends too\n");
            return 0;
        } else if (argv[i][0] == '-' || path) {
            die("unexpected argument '%s' (--help)", argv[i]);
        } else {
            path = argv[i];
        }
    }
    if (!path) die("no trace file given (--help)");
    static names t;
    rec *r = NULL;
    const size_t n = read_trace(path, keep_all, &t, &r);
    const size_t first = (size_t)(from * (double)n);
    double *delta[MAX_NAMES], *dur[MAX_NAMES];
    size_t cnt[MAX_NAMES] = {0};
    for (int k = 0; k < t.n; k++) {
        delta[k] = alloc(n * sizeof(double));
        dur[k] = alloc(n * sizeof(double));
    }
    int order[MAX_NAMES], n_order = 0, seen[MAX_NAMES] = {0};
    for (size_t i = first + 1; i < n; i++) {
        const int k = r[i].name;
        /* signed: a kernel of another stream may end before the one started before it;
         * in integers first: the stamps (ns since 1970) are past a double's 53 bits, each
         * would be rounded to 256 ns (every chain measured until session 18 was) */
        delta[k][cnt[k]] = (double)(long long)(r[i].end - r[i - 1].end) / 1e3;
        dur[k][cnt[k]++] = (double)(r[i].end - r[i].start) / 1e3;
        if (!seen[k]) {
            seen[k] = 1;
            order[n_order++] = k;
        }
    }
    /* the period first: a name without two records is an error, before any output */
    double per = 0.0;
    size_t m = 0;
    if (period) {
        double *p = alloc(n * sizeof(double));
        unsigned long long last = 0;
        int have = 0;
        for (size_t i = first; i < n; i++) {
            if (strcmp(t.s[r[i].name], period)) continue;
            if (have) p[m++] = (double)(long long)(r[i].end - last) / 1e3;
            last = r[i].end;
            have = 1;
        }
        if (!m) die("--period %s: fewer than two of its records measured", period);
        per = median(p, m);
        free(p);
    }
    printf("%s: %zu kernel records, the last %zu measured\n\n", path, n, n - first);
    printf("| kernel | records | from the end of the kernel before to its end, us | its "
           "duration, us |\n|---|---|---|---|\n");
    for (int j = 0; j < n_order; j++) {
        const int k = order[j];
        printf("| %s | %zu | %.2f | %.2f |\n", t.s[k], cnt[k], median(delta[k], cnt[k]),
               median(dur[k], cnt[k]));
    }
    if (period)
        printf("\n%s to %s (end to end), median over %zu: %.2f us\n", period, period, m, per);
    for (int k = 0; k < t.n; k++) {
        free(delta[k]);
        free(dur[k]);
    }
    free(r);
    return 0;
}
