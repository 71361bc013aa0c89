/* test_affinity.c - CPU pinning: the checks of --cpu values and the pin itself,
 * and a fetch client refusing an I/O CPU it may not use before it connects. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <unistd.h>

#include "affinity.h"
#include "client.h"

/* The highest CPU this process may run on. */
static int last_allowed_cpu(void)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    cr_assert_eq(sched_getaffinity(0, sizeof s, &s), 0);
    int last = -1;
    for (int i = 0; i < CPU_SETSIZE; i++)
        if (CPU_ISSET(i, &s)) last = i;
    cr_assert_geq(last, 0);
    return last;
}

Test(affinity, checks_the_cpu_number)
{
    sl_err err = {0};
    cr_assert_eq(sl_affinity_check(SL_CPU_ANY, &err), 0);
    cr_assert_eq(sl_affinity_check(last_allowed_cpu(), &err), 0, "%s", err.msg);
    cr_assert_eq(sl_affinity_check(-7, &err), SL_EINVAL);
    cr_assert_eq(sl_affinity_check(CPU_SETSIZE + 3, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "CPU") != NULL, "%s", err.msg);
    cr_assert_eq(sl_affinity_pin_self(CPU_SETSIZE + 3, &err), SL_EINVAL);
}

static void *pinned_thread(void *arg)
{
    int cpu = *(int *)arg;
    sl_err err = {0};
    if (sl_affinity_pin_self(cpu, &err)) return (void *)1;
    cpu_set_t s;
    CPU_ZERO(&s);
    pthread_getaffinity_np(pthread_self(), sizeof s, &s);
    /* Exactly one CPU allowed, the asked one, and the thread runs there. */
    if (CPU_COUNT(&s) != 1 || !CPU_ISSET(cpu, &s)) return (void *)2;
    if (sched_getcpu() != cpu) return (void *)3;
    return NULL;
}

Test(affinity, pins_the_calling_thread_only)
{
    int cpu = last_allowed_cpu();
    pthread_t t;
    void *ret = (void *)9;
    cr_assert_eq(pthread_create(&t, NULL, pinned_thread, &cpu), 0);
    pthread_join(t, &ret);
    cr_assert_null(ret, "pinned thread check %ld failed", (long)ret);
    /* This thread kept its own set. */
    cpu_set_t s;
    CPU_ZERO(&s);
    cr_assert_eq(sched_getaffinity(0, sizeof s, &s), 0);
    if (sysconf(_SC_NPROCESSORS_ONLN) > 1) cr_assert_gt(CPU_COUNT(&s), 1);
}

Test(affinity, client_refuses_a_bad_io_cpu_before_connecting)
{
    sl_fetch_client_options o;
    sl_fetch_client_options_default(&o, "ipc:///nonexistent/sluice-test.sock");
    o.io_cpu = CPU_SETSIZE + 1;
    o.connect_ms = 60000; /* must not be waited for */
    sl_fetch_client *c = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_open(&c, &o, &err), SL_EINVAL);
    cr_assert_null(c);
    cr_assert(strstr(err.msg, "CPU") != NULL, "%s", err.msg);
}
