/* opts.h - command-line options from one table per program: lookup, values, the
 * generated --help. Each program keeps its own switch over the option ids. */
#ifndef SL_OPTS_H
#define SL_OPTS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "err.h"

typedef struct sl_opt {
    int id;           /* the program's own enum */
    const char *shrt; /* "-m", or NULL */
    const char *lng;  /* "--model" */
    const char *arg;  /* "FILE" when the option takes a value, else NULL */
    const char *help; /* one line */
} sl_opt;

/* The option at argv[*i] and, when it takes one, its value (argv[*i + 1], and *i is
 * advanced past it). NULL with err set for an unknown option or a missing value. */
const sl_opt *sl_opt_next(const sl_opt *table, size_t n, int argc, char **argv, int *i,
                          const char **value, sl_err *err);

/* Writes usage, then one line per option of the table. */
void sl_opt_help(FILE *out, const char *usage, const sl_opt *table, size_t n);

/* A whole number in [lo, hi] for flag; SL_EINVAL naming the flag otherwise. */
int sl_opt_u64(const char *flag, const char *s, uint64_t lo, uint64_t hi, uint64_t *out,
               sl_err *err);

/* Parses "80G", "512M", "4096", "1.5T" (binary units) into bytes. */
int sl_parse_size(const char *s, uint64_t *out, sl_err *err);

#endif
