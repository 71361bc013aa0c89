/* run_cmd.h - for the tests that run the programs as a user does: a shell command's
 * output and exit status, and the removal of a test's scratch directory. */
#ifndef SL_TEST_RUN_CMD_H
#define SL_TEST_RUN_CMD_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

/* Runs cmd through the shell; stdout+stderr go to out (at most cap-1 bytes, the rest
 * read and dropped so the program never blocks on a full pipe). Returns its exit
 * status, or 128 + the signal that ended it. */
static inline int sl_test_run(const char *cmd, char *out, size_t cap)
{
    char full[1024];
    snprintf(full, sizeof full, "{ %s ; } 2>&1", cmd);
    FILE *p = popen(full, "r");
    cr_assert_not_null(p);
    size_t n = 0, got;
    while (n + 1 < cap && (got = fread(out + n, 1, cap - 1 - n, p)) > 0) n += got;
    out[n] = '\0';
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* rm -rf dir (a test's mkdtemp directory); the test fails if it cannot. */
static inline void sl_test_rm_rf(const char *dir)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

#endif
