/* affinity.h - pinning the calling thread to one CPU.
 *
 * The fetcher's serving thread and the compute process's driving thread can be
 * pinned (`--cpu N`) together with their ZeroMQ I/O thread, so that a message hop
 * between the two wakes a thread on a CPU that is already running instead of a
 * halted one (a virtual machine pays tens of microseconds for that wake-up).
 */
#ifndef SL_AFFINITY_H
#define SL_AFFINITY_H

#include "err.h"

/* No pinning asked (the default of every --cpu option). */
#define SL_CPU_ANY (-1)

/* Checks that cpu is one this process may run on: SL_EINVAL naming the allowed set
 * otherwise. SL_CPU_ANY is always fine. */
int sl_affinity_check(int cpu, sl_err *err);

/* Pins the calling thread to cpu (no-op for SL_CPU_ANY). Threads it creates later
 * inherit the pin, so create workers first. */
int sl_affinity_pin_self(int cpu, sl_err *err);

#endif
