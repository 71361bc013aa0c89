/* err.h - the one error convention of sluice.
 *
 * Functions that can fail return int: 0 on success, a negative SL_E* code on
 * failure, and write a one-line message into a caller-owned sl_err. Messages name
 * the call, its arguments and errno ("pread(shard 3, off 81920, len 3870720): ...").
 * Broken invariants (bugs) abort through SL_ASSERT, which is always on.
 */
#ifndef SL_ERR_H
#define SL_ERR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum sl_status {
    SL_OK = 0,
    SL_EINVAL = -1,       /* bad argument or option */
    SL_EIO = -2,          /* an OS call failed (read, write, open, mmap ...) */
    SL_ENOMEM = -3,       /* allocation failed */
    SL_EFORMAT = -4,      /* a file or message is malformed */
    SL_ENOTFOUND = -5,    /* a key, tensor, file or peer is missing */
    SL_EUNSUPPORTED = -6, /* well formed, but not something sluice handles */
    SL_EMISMATCH = -7,    /* parts that must agree do not (shards of two models ...) */
    SL_ENOSPACE = -8,     /* a disk or a budget is full */
    SL_EPEER = -9,        /* the other process is dead or answered wrongly */
};

#define SL_ERR_MSG_MAX 512

/* A caller-owned error slot: code and a message for the user. */
typedef struct sl_err {
    int code;
    char msg[SL_ERR_MSG_MAX];
} sl_err;

/* Formats msg into err (err may be NULL) and returns code, so that a failing
 * function can end with `return sl_err_set(err, SL_EIO, "...", ...)`. */
int sl_err_set(sl_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Like sl_err_set, with ": strerror(errnum)" appended. */
int sl_err_errno(sl_err *err, int code, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Prefixes the message already in err with more context ("shard 2: ..."). */
int sl_err_prefix(sl_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Copies src into dst[cap] (cap > 0), cut to fit and always NUL-terminated;
 * returns strlen(src). For messages moved between fixed-size buffers. */
size_t sl_strlcpy(char *dst, const char *src, size_t cap);

/* Short name of a status code ("SL_EFORMAT"). */
const char *sl_status_name(int code);

/* Aborts with file and line when an invariant is broken. Never compiled out. */
#define SL_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) sl_assert_fail(#cond, __FILE__, __LINE__);                                    \
    } while (0)

__attribute__((noreturn)) void sl_assert_fail(const char *expr, const char *file, int line);

#ifdef __cplusplus
}
#endif

#endif
