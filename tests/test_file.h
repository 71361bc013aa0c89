/* test_file.h - for the tests: a file read whole, and bytes or text written to one. */
#ifndef SL_TEST_FILE_H
#define SL_TEST_FILE_H

#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The bytes of path (malloc'd, with a '\0' after them; free it), their count in *n
 * when n is given. The test fails if the file cannot be read. */
static inline void *sl_test_slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "open %s: %s", path, strerror(errno));
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    const long len = ftell(f);
    cr_assert(len >= 0, "ftell %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0);
    char *b = malloc((size_t)len + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)len, f), (size_t)len, "read %s", path);
    b[len] = '\0';
    fclose(f);
    if (n) *n = (size_t)len;
    return b;
}

/* Writes n bytes to path (created or truncated); the test fails if it cannot. */
static inline void sl_test_write(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert(f, "open %s: %s", path, strerror(errno));
    cr_assert_eq(fwrite(b, 1, n, f), n, "write %s", path);
    cr_assert_eq(fclose(f), 0, "close %s", path);
}

/* Writes the string text (without its '\0') to path. */
static inline void sl_test_write_text(const char *path, const char *text)
{
    sl_test_write(path, text, strlen(text));
}

#endif
