/* main.c - sluice-fetcher's entry: options, signals, serve, clean exit.
 *
 * Signal handlers only set flags: SIGINT/SIGTERM stop the loop (the arena is then
 * unlinked by the normal close path), SIGUSR1 prints the counters.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "fetcher.h"

static volatile sig_atomic_t stop_flag, report_flag;

static void on_stop(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static void on_report(int sig)
{
    (void)sig;
    report_flag = 1;
}

int main(int argc, char **argv)
{
    sl_fetcher_options o;
    sl_fetcher_options_default(&o);
    sl_err err = {0};
    int rc = sl_fetcher_parse_args(&o, argc, argv, stdout, &err);
    if (rc == 1) return 0;
    if (rc) {
        fprintf(stderr, "sluice-fetcher: %s\n", err.msg);
        return 2;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_report;
    sigaction(SIGUSR1, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    sl_fetcher *f = NULL;
    if (sl_fetcher_open(&f, &o, &err)) {
        fprintf(stderr, "sluice-fetcher: %s\n", err.msg);
        return 1;
    }
    rc = sl_fetcher_run(f, &stop_flag, &report_flag, &err);
    if (rc) fprintf(stderr, "sluice-fetcher: %s\n", err.msg);
    sl_fetcher_print_stats(f, stderr);
    sl_fetcher_close(&f);
    return rc ? 1 : 0;
}
