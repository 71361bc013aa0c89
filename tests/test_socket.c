/* test_socket.c - bench-socket, the transport floor under the fetcher's hit round trip:
 * its table (every row measured, p99 >= p50 > 0, the file the same as the screen), the
 * pinned rows, and one clear line for bad arguments. */
#include <criterion/criterion.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "run_cmd.h"
#include "test_file.h"

/* The rows of a bench-socket table in out: checks each and returns how many. */
static int check_rows(const char *out)
{
    int rows = 0;
    for (const char *p = strstr(out, "\n| "); p; p = strstr(p + 1, "\n| ")) {
        char transport[64], receivers[16], pinned[32];
        double p50 = -1, p99 = -1;
        if (sscanf(p + 1, "| %63[^|]| %15[^ |] | %31[^|]| %lf | %lf |", transport, receivers,
                   pinned, &p50, &p99) != 5)
            continue; /* the header */
        cr_expect(strstr(transport, "AF_UNIX") || strstr(transport, "ZeroMQ"), "%s", transport);
        cr_expect(!strcmp(receivers, "blocking") || !strcmp(receivers, "spinning"), "%s",
                  receivers);
        cr_expect(p50 > 0 && p99 >= p50, "p50 %f p99 %f", p50, p99);
        rows++;
    }
    return rows;
}

Test(socket, measures_every_transport_and_writes_the_same_table)
{
    char dir[] = "/tmp/sluice-test-socket-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char cmd[512], out[8192];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-socket --samples 200 -o %s/t.md", dir);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_expect_eq(check_rows(out), 4, "%s", out);
    cr_expect(strstr(out, "command: `bench-socket --samples 200`"), "%s", out);
    char path[300];
    snprintf(path, sizeof path, "%s/t.md", dir);
    char *file = sl_test_slurp(path, NULL);
    cr_expect(strstr(out, file) == out, "the file is the table printed:\n%s", file);
    free(file);
    sl_test_rm_rf(dir);
}

Test(socket, pinned_rows_on_an_allowed_cpu)
{
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0);
    int cpu = 0;
    while (!CPU_ISSET(cpu, &set)) cpu++;
    char cmd[256], out[8192];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-socket --samples 100 --pin %d,%d", cpu, cpu);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_expect_eq(check_rows(out), 8, "%s", out);
    char want[64];
    snprintf(want, sizeof want, "| CPUs %d, %d |", cpu, cpu);
    cr_expect(strstr(out, want), "%s", out);
}

Test(socket, bad_arguments_get_one_clear_line)
{
    static const char *const args[] = {"--pin x",       "--pin 3",        "--samples 3",
                                       "--samples 12x", "--pin 100000,0", "--bogus"};
    for (size_t i = 0; i < sizeof args / sizeof args[0]; i++) {
        char cmd[256], out[4096];
        snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-socket %s", args[i]);
        cr_expect_eq(sl_test_run(cmd, out, sizeof out), 2, "%s: %s", args[i], out);
        cr_expect(strstr(out, "bench-socket") != NULL, "%s: %s", args[i], out);
        cr_expect(strchr(out, '\n') == out + strlen(out) - 1 || strstr(out, "usage:"), "%s: %s",
                  args[i], out);
    }
}
