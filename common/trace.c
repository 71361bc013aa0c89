/* trace.c - the span ring and its Chrome trace JSON writer. */
#include "trace.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct sl_trace {
    char process[64];
    uint32_t pid;
    pthread_mutex_t lock;
    sl_span *ring; /* [capacity] */
    uint32_t capacity;
    uint64_t written; /* spans ever recorded */
    /* tracks that are not threads (sl_trace_add_on), and their names */
    uint32_t track_id[SL_TRACE_TRACKS];
    char track_name[SL_TRACE_TRACKS][32];
    uint32_t n_tracks;
};

uint64_t sl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int sl_trace_open(sl_trace **out, const char *process, uint32_t capacity, sl_err *err)
{
    *out = NULL;
    if (capacity == 0) return sl_err_set(err, SL_EINVAL, "trace: capacity must be > 0");
    sl_trace *t = calloc(1, sizeof *t);
    if (!t) return sl_err_set(err, SL_ENOMEM, "trace: out of memory");
    t->ring = calloc(capacity, sizeof *t->ring);
    if (!t->ring) {
        free(t);
        return sl_err_set(err, SL_ENOMEM, "trace: out of memory for %u spans", capacity);
    }
    snprintf(t->process, sizeof t->process, "%s", process);
    t->pid = (uint32_t)getpid();
    t->capacity = capacity;
    pthread_mutex_init(&t->lock, NULL);
    *out = t;
    return 0;
}

void sl_trace_close(sl_trace **pt)
{
    if (!pt || !*pt) return;
    pthread_mutex_destroy(&(*pt)->lock);
    free((*pt)->ring);
    free(*pt);
    *pt = NULL;
}

void sl_trace_add(sl_trace *t, const char *name, int32_t layer, int32_t expert, uint64_t bytes,
                  uint64_t start_ns, uint64_t end_ns)
{
    if (!t) return;
    sl_trace_add_on(t, (uint32_t)syscall(SYS_gettid), name, layer, expert, bytes, start_ns, end_ns);
}

int sl_trace_name_track(sl_trace *t, uint32_t track, const char *name, sl_err *err)
{
    if (!t) return 0;
    pthread_mutex_lock(&t->lock);
    int rc = 0;
    if (t->n_tracks == SL_TRACE_TRACKS) {
        rc = sl_err_set(err, SL_ENOMEM, "trace: more than %d named tracks", SL_TRACE_TRACKS);
    } else {
        t->track_id[t->n_tracks] = track;
        snprintf(t->track_name[t->n_tracks], sizeof t->track_name[0], "%s", name);
        t->n_tracks++;
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

void sl_trace_add_on(sl_trace *t, uint32_t track, const char *name, int32_t layer, int32_t expert,
                     uint64_t bytes, uint64_t start_ns, uint64_t end_ns)
{
    if (!t) return;
    sl_span s = {.tid = track,
                 .layer = layer,
                 .expert = expert,
                 .bytes = bytes,
                 .start_ns = start_ns,
                 .end_ns = end_ns};
    snprintf(s.name, sizeof s.name, "%s", name);
    pthread_mutex_lock(&t->lock);
    t->ring[t->written % t->capacity] = s;
    t->written++;
    pthread_mutex_unlock(&t->lock);
}

uint64_t sl_trace_count(const sl_trace *t)
{
    return t->written < t->capacity ? t->written : t->capacity;
}

uint64_t sl_trace_dropped(const sl_trace *t)
{
    return t->written > t->capacity ? t->written - t->capacity : 0;
}

/* Writes s as a JSON string body (names are ours, but escape anyway). */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

int sl_trace_write_json(const sl_trace *t, const char *path, sl_err *err)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return sl_err_errno(err, SL_EIO, errno, "fopen(%s)", tmp);
    sl_trace *mt = (sl_trace *)t; /* the lock is the only thing touched */
    pthread_mutex_lock(&mt->lock);
    uint64_t n = sl_trace_count(t), first = t->written - n;
    fprintf(f, "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n");
    fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%u,\"tid\":0,\"args\":{\"name\":",
            t->pid);
    json_str(f, t->process);
    fprintf(f, "}}");
    for (uint32_t k = 0; k < t->n_tracks; k++) {
        fprintf(
            f,
            ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%u,\"tid\":%u,\"args\":{\"name\":",
            t->pid, t->track_id[k]);
        json_str(f, t->track_name[k]);
        fprintf(f, "}}");
    }
    for (uint64_t i = 0; i < n; i++) {
        const sl_span *s = &t->ring[(first + i) % t->capacity];
        fprintf(f, ",\n{\"ph\":\"X\",\"name\":");
        json_str(f, s->name);
        fprintf(f, ",\"pid\":%u,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f,\"args\":{", t->pid, s->tid,
                (double)s->start_ns / 1e3,
                (double)(s->end_ns > s->start_ns ? s->end_ns - s->start_ns : 0) / 1e3);
        int comma = 0;
        if (s->layer >= 0) comma = fprintf(f, "\"layer\":%d", s->layer) > 0;
        if (s->expert >= 0) comma = fprintf(f, "%s\"expert\":%d", comma ? "," : "", s->expert) > 0;
        if (s->bytes) fprintf(f, "%s\"bytes\":%" PRIu64, comma ? "," : "", s->bytes);
        fprintf(f, "}}");
    }
    fprintf(f, "\n]}\n");
    pthread_mutex_unlock(&mt->lock);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        int e = errno;
        unlink(tmp);
        return sl_err_errno(err, SL_EIO, e, "writing trace %s", tmp);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return sl_err_errno(err, SL_EIO, e, "rename(%s, %s)", tmp, path);
    }
    return 0;
}

/* The text between the brackets of "traceEvents": [...] of a file we wrote. */
static char *read_events(const char *path, size_t *len, sl_err *err, int *missing)
{
    *missing = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) {
            *missing = 1;
            return NULL;
        }
        sl_err_errno(err, SL_EIO, errno, "fopen(%s)", path);
        return NULL;
    }
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 65536 > cap) {
            cap = cap ? cap * 2 : 1 << 20;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                sl_err_set(err, SL_ENOMEM, "reading %s: out of memory", path);
                return NULL;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    fclose(f);
    buf[n] = '\0';
    char *open = strstr(buf, "\"traceEvents\":[");
    char *close = strrchr(buf, ']');
    if (!open || !close || close < open) {
        free(buf);
        sl_err_set(err, SL_EFORMAT, "%s: not a sluice trace (no traceEvents array)", path);
        return NULL;
    }
    open += strlen("\"traceEvents\":[");
    *len = (size_t)(close - open);
    memmove(buf, open, *len);
    buf[*len] = '\0';
    return buf;
}

int sl_trace_merge_json(const char *const *paths, int n, const char *out, int *merged, sl_err *err)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", out);
    FILE *f = fopen(tmp, "w");
    if (!f) return sl_err_errno(err, SL_EIO, errno, "fopen(%s)", tmp);
    fprintf(f, "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[");
    int done = 0, rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        size_t len = 0;
        int missing = 0;
        char *ev = read_events(paths[i], &len, err, &missing);
        if (missing) continue;
        if (!ev) {
            rc = err ? err->code : SL_EIO;
            break;
        }
        /* Trim, and join with a comma. */
        size_t a = 0;
        while (a < len && (ev[a] == '\n' || ev[a] == ' ')) a++;
        while (len > a && (ev[len - 1] == '\n' || ev[len - 1] == ' ')) len--;
        if (len > a) {
            fprintf(f, "%s\n", done ? "," : "");
            fwrite(ev + a, 1, len - a, f);
            done++;
        }
        free(ev);
    }
    fprintf(f, "\n]}\n");
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) rc = rc ? rc : sl_err_errno(err, SL_EIO, errno, "writing %s", tmp);
    if (!rc && rename(tmp, out) != 0) rc = sl_err_errno(err, SL_EIO, errno, "rename(%s)", tmp);
    if (rc) unlink(tmp);
    if (merged) *merged = done;
    return rc;
}
