/* test_gpu_info.c - the GPU suite's first check: a device is found and described.
 * Skips, saying so, on machines without a GPU. */
#include <criterion/criterion.h>
#include <stdio.h>

#include "gpu.h"

Test(gpu_info, device_is_described)
{
    sl_err err = {0};
    int n = -1;
    cr_assert_eq(sl_gpu_device_count(&n, &err), 0, "%s", err.msg);
    if (n == 0) cr_skip_test("no GPU present: GPU tests skipped");
    char line[256] = "";
    cr_assert_eq(sl_gpu_describe(0, line, sizeof line, &err), 0, "%s", err.msg);
    cr_assert(line[0] != '\0');
    printf("gpu 0: %s\n", line);
}
