/* affinity.c - see affinity.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "affinity.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>

int sl_affinity_check(int cpu, sl_err *err)
{
    if (cpu == SL_CPU_ANY) return 0;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        return sl_err_errno(err, SL_EIO, errno, "sched_getaffinity");
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed))
        return sl_err_set(err, SL_EINVAL,
                          "CPU %d is not one this process may use (%d CPUs allowed; see "
                          "`taskset -p $$`)",
                          cpu, CPU_COUNT(&allowed));
    return 0;
}

int sl_affinity_pin_self(int cpu, sl_err *err)
{
    if (cpu == SL_CPU_ANY) return 0;
    int rc = sl_affinity_check(cpu, err);
    if (rc) return rc;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    int e = pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    if (e) return sl_err_errno(err, SL_EIO, e, "pthread_setaffinity_np(CPU %d)", cpu);
    return 0;
}
