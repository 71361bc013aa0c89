/* test_trace.c - the span ring and its Chrome trace JSON. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "trace.h"
#include "test_file.h"

static int count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p++) n++;
    return n;
}

Test(trace, writes_chrome_json_and_keeps_the_newest)
{
    sl_trace *t = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_trace_open(&t, "sluice-\"test\"", 4, &err), 0, "%s", err.msg);
    uint64_t t0 = sl_now_ns();
    for (int i = 0; i < 6; i++)
        sl_trace_add(t, i < 2 ? "old" : "read", i, 10 + i, 1000u * (uint64_t)i, t0 + 1000u * i,
                     t0 + 1000u * i + 500);
    cr_assert_eq(sl_trace_count(t), 4);
    cr_assert_eq(sl_trace_dropped(t), 2);
    char path[] = "/tmp/sl-trace-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(sl_trace_write_json(t, path, &err), 0, "%s", err.msg);
    char *s = sl_test_slurp(path, NULL);
    cr_assert(strncmp(s, "{\"displayTimeUnit\"", 18) == 0);
    cr_assert_eq(count(s, "\"ph\":\"X\""), 4);
    cr_assert_eq(count(s, "\"old\""), 0, "the two oldest spans were overwritten");
    cr_assert(strstr(s, "\"layer\":5,\"expert\":15,\"bytes\":5000"), "%s", s);
    cr_assert(strstr(s, "sluice-\\\"test\\\""), "names are escaped: %s", s);
    cr_assert(strstr(s, "\"dur\":0.500"), "%s", s);
    free(s);
    unlink(path);
    sl_trace_add(NULL, "ignored", 0, 0, 0, 0, 0); /* tracing off is a no-op */
    sl_trace_close(&t);
    cr_assert_null(t);
}

Test(trace, unwritable_path_is_an_error)
{
    sl_trace *t = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_trace_open(&t, "p", 8, &err), 0);
    cr_assert_eq(sl_trace_write_json(t, "/nonexistent-dir/x.json", &err), SL_EIO);
    cr_assert(strstr(err.msg, "/nonexistent-dir/x.json.tmp"), "%s", err.msg);
    sl_trace_close(&t);
}

Test(trace, named_tracks_carry_their_spans)
{
    sl_trace *t = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_trace_open(&t, "p", 16, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_trace_name_track(t, SL_TRACE_TRACK_GPU, "GPU", &err), 0, "%s", err.msg);
    sl_trace_add_on(t, SL_TRACE_TRACK_GPU, "copy", 3, 7, 4096, 2000, 5000);
    sl_trace_add(t, "route", 3, -1, 0, 1000, 1500);
    for (uint32_t k = 1; k < SL_TRACE_TRACKS; k++)
        cr_assert_eq(sl_trace_name_track(t, 100 + k, "x", &err), 0, "%s", err.msg);
    cr_assert_eq(sl_trace_name_track(t, 999, "one too many", &err), SL_ENOMEM);
    char path[] = "/tmp/sl-trace-track-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(sl_trace_write_json(t, path, &err), 0, "%s", err.msg);
    char *j = sl_test_slurp(path, NULL);
    char want[128];
    snprintf(want, sizeof want,
             "\"name\":\"thread_name\",\"pid\":%u,\"tid\":%u,\"args\":{\"name\":\"GPU\"}",
             (unsigned)getpid(), SL_TRACE_TRACK_GPU);
    cr_assert(strstr(j, want), "%s", j);
    snprintf(want, sizeof want,
             "\"name\":\"copy\",\"pid\":%u,\"tid\":%u,\"ts\":2.000,\"dur\":3.000",
             (unsigned)getpid(), SL_TRACE_TRACK_GPU);
    cr_assert(strstr(j, want), "%s", j);
    cr_assert_eq(count(j, "thread_name"), SL_TRACE_TRACKS);
    free(j);
    unlink(path);
    sl_trace_close(&t);
}
