/* opts.c - table-driven command-line options. */
#include "opts.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

const sl_opt *sl_opt_next(const sl_opt *table, size_t n, int argc, char **argv, int *i,
                          const char **value, sl_err *err)
{
    const char *a = argv[*i];
    const sl_opt *d = NULL;
    for (size_t k = 0; k < n && !d; k++)
        if ((table[k].shrt && !strcmp(a, table[k].shrt)) || !strcmp(a, table[k].lng)) d = &table[k];
    if (!d) {
        sl_err_set(err, SL_EINVAL, "unknown option '%s' (see --help)", a);
        return NULL;
    }
    *value = NULL;
    if (d->arg) {
        if (*i + 1 >= argc) {
            sl_err_set(err, SL_EINVAL, "%s needs %s", a, d->arg);
            return NULL;
        }
        *value = argv[++*i];
    }
    return d;
}

void sl_opt_help(FILE *out, const char *usage, const sl_opt *table, size_t n)
{
    fprintf(out, "%s\noptions:\n", usage);
    for (size_t k = 0; k < n; k++) {
        const sl_opt *t = &table[k];
        char left[64];
        snprintf(left, sizeof left, "%s%s%s%s%s", t->shrt ? t->shrt : "", t->shrt ? ", " : "    ",
                 t->lng, t->arg ? " " : "", t->arg ? t->arg : "");
        fprintf(out, "  %-26s %s\n", left, t->help);
    }
}

int sl_opt_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out,
               sl_err *err)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || *end || errno || s[0] == '-' || v < lo || v > hi)
        return sl_err_set(err, SL_EINVAL,
                          "%s %s: expected a whole number from %" PRIu64 " to %" PRIu64, flag, s,
                          lo, hi);
    *out = v;
    return 0;
}

int sl_parse_size(const char *s, uint64_t *out, sl_err *err)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !(v >= 0) || v > 1e18)
        return sl_err_set(err, SL_EINVAL, "'%s' is not a size (e.g. 80G, 512M, 4096)", s);
    double mul = 1;
    switch (*end) {
    case 'k':
    case 'K':
        mul = 1024.0;
        end++;
        break;
    case 'm':
    case 'M':
        mul = 1024.0 * 1024;
        end++;
        break;
    case 'g':
    case 'G':
        mul = 1024.0 * 1024 * 1024;
        end++;
        break;
    case 't':
    case 'T':
        mul = 1024.0 * 1024 * 1024 * 1024;
        end++;
        break;
    default:
        break;
    }
    if (*end == 'i' || *end == 'B') end += (*end == 'i') + (end[*end == 'i'] == 'B');
    if (*end) return sl_err_set(err, SL_EINVAL, "'%s' is not a size (e.g. 80G, 512M, 4096)", s);
    *out = (uint64_t)floor(v * mul);
    return 0;
}
