/* main.c - sluice-compute's entry: options, run, summary. */
#include <signal.h>
#include <stdio.h>

#include "compute.h"

int main(int argc, char **argv)
{
    sl_compute_options o;
    sl_compute_options_default(&o);
    sl_err err = {0};
    int rc = sl_compute_parse_args(&o, argc, argv, stdout, &err);
    if (rc == 1) return 0;
    if (rc) {
        fprintf(stderr, "sluice-compute: %s\n", err.msg);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    sl_compute *c = NULL;
    if (sl_compute_open(&c, &o, &err)) {
        fprintf(stderr, "sluice-compute: %s\n", err.msg);
        return 1;
    }
    rc = sl_compute_run(c, &err);
    if (rc) fprintf(stderr, "sluice-compute: %s\n", err.msg);
    if (!o.quiet) sl_compute_print_summary(c, stderr);
    sl_compute_close(&c);
    return rc ? 1 : 0;
}
