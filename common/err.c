/* err.c - formatting of sl_err messages and the assertion handler. */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int sl_err_set(sl_err *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

int sl_err_errno(sl_err *err, int code, int errnum, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < sizeof err->msg)
            snprintf(err->msg + n, sizeof err->msg - (size_t)n, ": %s", strerror(errnum));
        err->code = code;
    }
    return code;
}

int sl_err_prefix(sl_err *err, const char *fmt, ...)
{
    if (!err) return 0;
    char head[SL_ERR_MSG_MAX], old[SL_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    old[sizeof old - 1] = '\0';
    /* head, ": ", then as much of the old message as fits. */
    size_t room = sizeof err->msg - 1, n = strlen(head), m = strlen(old);
    if (n > room) n = room;
    memcpy(err->msg, head, n);
    if (n + 2 <= room) {
        memcpy(err->msg + n, ": ", 2);
        n += 2;
    }
    if (m > room - n) m = room - n;
    memcpy(err->msg + n, old, m);
    err->msg[n + m] = '\0';
    return err->code;
}

size_t sl_strlcpy(char *dst, const char *src, size_t cap)
{
    size_t n = strlen(src);
    size_t m = n < cap - 1 ? n : cap - 1;
    memcpy(dst, src, m);
    dst[m] = '\0';
    return n;
}

const char *sl_status_name(int code)
{
    switch (code) {
    case SL_OK:
        return "SL_OK";
    case SL_EINVAL:
        return "SL_EINVAL";
    case SL_EIO:
        return "SL_EIO";
    case SL_ENOMEM:
        return "SL_ENOMEM";
    case SL_EFORMAT:
        return "SL_EFORMAT";
    case SL_ENOTFOUND:
        return "SL_ENOTFOUND";
    case SL_EUNSUPPORTED:
        return "SL_EUNSUPPORTED";
    case SL_EMISMATCH:
        return "SL_EMISMATCH";
    case SL_ENOSPACE:
        return "SL_ENOSPACE";
    case SL_EPEER:
        return "SL_EPEER";
    }
    return "SL_E?";
}

void sl_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "sluice: internal error: assertion `%s` failed at %s:%d\n", expr, file, line);
    abort();
}
