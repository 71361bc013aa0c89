/* trace.h - spans of work (name, layer, expert, bytes, start, end) recorded into a
 * bounded ring and written as Chrome trace JSON (opens in Perfetto).
 *
 * Times are CLOCK_MONOTONIC nanoseconds, which every process on the host shares,
 * so the traces of the fetcher and the compute process line up when merged. Any
 * thread may record; recording takes a short mutex and never allocates. When the
 * ring is full the oldest spans are overwritten (and counted as dropped).
 */
#ifndef SL_TRACE_H
#define SL_TRACE_H

#include <stdint.h>

#include "err.h"

#define SL_TRACE_NAME_MAX 24

typedef struct sl_span {
    char name[SL_TRACE_NAME_MAX]; /* "read", "route", ... */
    uint32_t tid;                 /* thread id (gettid) */
    int32_t layer;                /* -1 when none */
    int32_t expert;               /* -1 when none */
    uint64_t bytes;               /* 0 when none */
    uint64_t start_ns, end_ns;    /* CLOCK_MONOTONIC */
} sl_span;

typedef struct sl_trace sl_trace;

/* A ring of capacity spans for process `process` (the track name in the JSON). */
int sl_trace_open(sl_trace **out, const char *process, uint32_t capacity, sl_err *err);
void sl_trace_close(sl_trace **t);

/* Records one span; t may be NULL (tracing off). Thread-safe. */
void sl_trace_add(sl_trace *t, const char *name, int32_t layer, int32_t expert, uint64_t bytes,
                  uint64_t start_ns, uint64_t end_ns);

/* Tracks that are not threads of the process (e.g. the GPU's own timeline): a track id
 * no thread id takes (above the kernel's pid_max, 2^22), and a name for the viewer. */
#define SL_TRACE_TRACKS         8
#define SL_TRACE_TRACK_GPU      0x40000001u
#define SL_TRACE_TRACK_GPU_COPY 0x40000002u
int sl_trace_name_track(sl_trace *t, uint32_t track, const char *name, sl_err *err);

/* Records one span on a given track (t may be NULL). Thread-safe. */
void sl_trace_add_on(sl_trace *t, uint32_t track, const char *name, int32_t layer, int32_t expert,
                     uint64_t bytes, uint64_t start_ns, uint64_t end_ns);

/* Spans recorded so far (at most capacity) and spans overwritten. */
uint64_t sl_trace_count(const sl_trace *t);
uint64_t sl_trace_dropped(const sl_trace *t);

/* Writes the spans as a Chrome trace JSON file ({"traceEvents": [...]}): one "X"
 * event per span (ts/dur in microseconds), a process-name and per-thread-name
 * metadata event. The file is written to path.tmp and renamed. */
int sl_trace_write_json(const sl_trace *t, const char *path, sl_err *err);

/* Merges Chrome trace JSON files written by sl_trace_write_json (one per process)
 * into one file at out: their events side by side, each keeping its process track.
 * Missing inputs are skipped (a process that died wrote none); the count of merged
 * files is returned in *merged. */
int sl_trace_merge_json(const char *const *paths, int n, const char *out, int *merged, sl_err *err);

/* CLOCK_MONOTONIC now, in nanoseconds. */
uint64_t sl_now_ns(void);

#endif
