/* test_ktrace.c - bench-ktrace, the layer's chain from a kernel trace: the medians
 * of a small hand-made trace, the kernels' short names, the records it leaves out,
 * and one clear line for bad input. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "run_cmd.h"
#include "test_file.h"

static char dir[64], csv[128];

/* Two kernels a "layer", three layers, in shuffled order; a device-tier fill and a
 * copy between them. Ends after the end before (start order): beta 2.0, alpha 2.0,
 * beta 3.0, alpha 1.0, beta 3.0 us; durations beta 2.5, 4.0, 3.5 and alpha 2.0, 1.0. */
static const char trace[] = "kernel,8000,9000,7,264,256,_ZN12_GLOBAL__N_1e7k_alphaILi4EEEvPKt\n"
                            "kernel,500,3000,7,96,128,_Z6k_betav\n"
                            "memcpy,3050,3090,13,20480,0,copy kind 1\n"
                            "kernel,0,1000,7,264,256,_ZN12_GLOBAL__N_1e7k_alphaILi4EEEvPKt\n"
                            "kernel,3100,3200,7,1,32,_Z8k_t0_setv\n"
                            "kernel,4000,8000,7,96,128,_Z6k_betav\n"
                            "kernel,3000,5000,7,264,256,_ZN12_GLOBAL__N_1e7k_alphaILi4EEEvPKt\n"
                            "kernel,8500,12000,7,96,128,_Z6k_betav\n";

static void setup(void)
{
    strcpy(dir, "/tmp/sl-ktrace-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(csv, sizeof csv, "%s/k.csv", dir);
    sl_test_write_text(csv, trace);
}

static void teardown(void)
{
    sl_test_rm_rf(dir);
}

TestSuite(ktrace, .init = setup, .fini = teardown, .timeout = 30);

Test(ktrace, medians_names_and_the_period)
{
    char cmd[512], out[8192];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s --from 0 --period k_alpha", csv);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "6 kernel records, the last 6 measured"), "%s", out);
    cr_assert(strstr(out, "| k_beta | 3 | 3.00 | 3.50 |"), "%s", out);
    cr_assert(strstr(out, "| k_alpha | 2 | 1.50 | 1.50 |"), "%s", out);
    cr_assert(strstr(out, "k_beta |") < strstr(out, "k_alpha |"), "first seen first: %s", out);
    cr_assert(strstr(out, "k_alpha to k_alpha (end to end), median over 2: 4.00 us"), "%s", out);
    cr_assert_null(strstr(out, "k_t0_set"), "the device tier's fills are left out: %s", out);
}

Test(ktrace, from_and_keep_all)
{
    char cmd[512], out[8192];
    /* from the middle: the last 3 records (beta 4000, alpha 8000, beta 8500) */
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s", csv);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "the last 3 measured"), "%s", out);
    cr_assert(strstr(out, "| k_alpha | 1 | 1.00 | 1.00 |"), "%s", out);
    cr_assert(strstr(out, "| k_beta | 1 | 3.00 | 3.50 |"), "%s", out);
    /* --keep-all: the fill ends 1.8 us before the kernel started before it did */
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s --from 0 --keep-all", csv);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "| k_t0_set | 1 | -1.80 | 0.10 |"), "%s", out);
}

/* The GPU's stamps count ns since 1970 (1.8e18, past a double's 53 bits): the times
 * between two ends must come from the integers, not from two rounded doubles (each
 * rounded to 256 ns, 45.06 or 45.31 where the chain is 45.123 us). */
Test(ktrace, epoch_scale_stamps_keep_their_nanoseconds)
{
    char cmd[512], out[8192], big[160];
    snprintf(big, sizeof big, "%s/big.csv", dir);
    sl_test_write_text(big, "kernel,1796173326169900000,1796173326169911984,7,96,128,_Z6k_betav\n"
                            "kernel,1796173326169950000,1796173326169957107,7,96,128,_Z6k_betav\n"
                            "kernel,1796173326169990000,1796173326170002230,7,96,128,_Z6k_betav\n");
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s --from 0 --period k_beta", big);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    /* ends 45.123 and 45.123 us apart; durations 11.984, 7.107, 12.230 us */
    cr_assert(strstr(out, "k_beta to k_beta (end to end), median over 2: 45.12 us"), "%s", out);
    cr_assert(strstr(out, "| k_beta | 2 | 45.12 |"), "%s", out);
}

Test(ktrace, bad_input_gets_one_clear_line)
{
    char cmd[512], out[8192], bad[160];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s/none.csv", dir);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "No such file"), "%s", out);
    snprintf(bad, sizeof bad, "%s/bad.csv", dir);
    sl_test_write_text(bad, "kernel,0,1000,7,1,32,_Z6k_betav\nkernel,x,2000,7,1,32,_Z6k_betav\n");
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s", bad);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "line 2: bad start"), "%s", out);
    sl_test_write_text(bad, "kernel,0,1000,7,1,32,_Z6k_betav\nhello\n");
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "line 2 is not a ktrace record"), "%s", out);
    sl_test_write_text(bad, "kernel,0,1000,7,1,32,_Z6k_betav\n");
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "1 kernel records, 2 at least"), "%s", out);
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s --from 1.5", csv);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "--from 1.5"), "%s", out);
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/bench-ktrace %s --from 0 --period k_gamma", csv);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "--period k_gamma"), "%s", out);
    /* nothing is printed to a line but the one */
    cr_assert_eq(strchr(out, '\n'), strrchr(out, '\n'), "%s", out);
}
