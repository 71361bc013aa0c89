/* bench_main.h - the opening the small GPU benches (bench-launch, bench-router) share:
 * their flags [-o FILE.md] [--n N], the check for a GPU, its name, the output file, and
 * each line of their tables to stdout and that file. */
#ifndef SL_BENCH_MAIN_H
#define SL_BENCH_MAIN_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

/* Parses prog's flags into *n (default 2000) and opens -o's file into *md (NULL
 * without -o), checks for a GPU and writes its name into desc[cap]. Returns -1 to go
 * on, else the exit code: 2 on a bad flag, 0 for --help or when no GPU is present
 * (said on stdout), 1 on an error (said on stderr). */
static inline int bm_open(const char *prog, int argc, char **argv, int *n, FILE **md, char *desc,
                          size_t cap)
{
    const char *out = NULL;
    *n = 2000;
    *md = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc)
            out = argv[++i];
        else if (!strcmp(argv[i], "--n") && i + 1 < argc)
            *n = atoi(argv[++i]);
        else {
            printf("usage: %s [-o FILE.md] [--n N (2000)]\n", prog);
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    sl_err err = {0};
    int ndev = 0;
    if (sl_gpu_device_count(&ndev, &err)) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return 1;
    }
    if (ndev == 0) {
        printf("%s: no GPU present, nothing measured\n", prog);
        return 0;
    }
    if (sl_gpu_describe(0, desc, cap, &err)) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return 1;
    }
    *md = out ? fopen(out, "w") : NULL;
    if (out && !*md) {
        fprintf(stderr, "%s: cannot write %s\n", prog, out);
        return 1;
    }
    return -1;
}

/* A line of a table: to stdout and, when there is one, to md. */
static inline void bm_put(FILE *md, const char *line)
{
    fputs(line, stdout);
    if (md) fputs(line, md);
}

#endif
