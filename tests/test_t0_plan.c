/* test_t0_plan.c - how sluice-compute sizes its device tier (sl_compute_t0_slots):
 * flags first, none on a GPU sharing host memory, else free memory less the reserve,
 * never more than every expert. */
#include <criterion/criterion.h>
#include <string.h>

#include "compute.h"
#include "t0cache.h"

#define GIB  (1ull << 30)
#define SLOT (12ull << 20) /* 12 MiB slots */

static sl_compute_options opts(const char *const *argv, int argc)
{
    sl_compute_options o;
    sl_compute_options_default(&o);
    sl_err err = {0};
    cr_assert_eq(sl_compute_parse_args(&o, argc, (char **)argv, NULL, &err), 0, "%s", err.msg);
    return o;
}

Test(t0_plan, auto_takes_free_memory_less_the_reserve)
{
    const char *argv[] = {"c", "-m", "x"};
    sl_compute_options o = opts(argv, 3);
    const char *why = NULL;
    /* 140 GiB GPU, 100 GiB free: reserve is 5% (7 GiB) > 2 GiB. */
    uint32_t n = sl_compute_t0_slots(&o, 100 * GIB, 140 * GIB, 0, SLOT, 15360, &why);
    cr_assert_eq(n, (uint32_t)((100 * GIB - 140 * GIB / 20) / SLOT));
    cr_assert(strstr(why, "auto"), "%s", why);
    /* A small GPU: the 2 GiB floor of the reserve. */
    n = sl_compute_t0_slots(&o, 10 * GIB, 16 * GIB, 0, SLOT, 15360, &why);
    cr_assert_eq(n, (uint32_t)((10 * GIB - 2 * GIB) / SLOT));
    /* Less free than the reserve: no tier. */
    cr_assert_eq(sl_compute_t0_slots(&o, GIB, 16 * GIB, 0, SLOT, 15360, &why), 0);
    /* Never more than every expert. */
    cr_assert_eq(sl_compute_t0_slots(&o, 100 * GIB, 140 * GIB, 0, SLOT, 96, &why), 96);
    /* A GPU that shares host memory reads the arena in place. */
    cr_assert_eq(sl_compute_t0_slots(&o, 100 * GIB, 140 * GIB, 1, SLOT, 15360, &why), 0);
    cr_assert(strstr(why, "shares host memory"), "%s", why);
}

Test(t0_plan, flags_win)
{
    const char *why = NULL;
    const char *a1[] = {"c", "-m", "x", "--t0", "1G"};
    sl_compute_options o = opts(a1, 5);
    cr_assert_eq(sl_compute_t0_slots(&o, 100 * GIB, 140 * GIB, 1, SLOT, 15360, &why),
                 (uint32_t)(GIB / SLOT), "--t0 holds even on a GPU sharing host memory");
    cr_assert_str_eq(why, "--t0");
    const char *a2[] = {"c", "-m", "x", "--t0-slots", "7"};
    o = opts(a2, 5);
    cr_assert_eq(sl_compute_t0_slots(&o, 0, 140 * GIB, 0, SLOT, 15360, &why), 7);
    cr_assert_str_eq(why, "--t0-slots");
    const char *a3[] = {"c", "-m", "x", "--t0-slots", "0"};
    o = opts(a3, 5);
    cr_assert_eq(sl_compute_t0_slots(&o, 100 * GIB, 140 * GIB, 0, SLOT, 15360, &why), 0);
    const char *a4[] = {"c", "-m", "x", "--t0-slots", "9", "--zero-copy"};
    o = opts(a4, 6);
    cr_assert_eq(sl_compute_t0_slots(&o, 100 * GIB, 140 * GIB, 0, SLOT, 15360, &why), 0);
    cr_assert_str_eq(why, "--zero-copy");
}

Test(t0_plan, admission_is_a_flag)
{
    const char *dflt[] = {"c", "-m", "x"};
    cr_assert_eq(opts(dflt, 3).t0_admit, SL_T0_ADMIT_FREQ);
    const char *always[] = {"c", "-m", "x", "--t0-admit", "always"};
    cr_assert_eq(opts(always, 5).t0_admit, SL_T0_ADMIT_ALWAYS);
    sl_compute_options o;
    sl_compute_options_default(&o);
    const char *bad[] = {"c", "-m", "x", "--t0-admit", "lfu"};
    sl_err err = {0};
    cr_assert_eq(sl_compute_parse_args(&o, 5, (char **)bad, NULL, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "--t0-admit lfu"), "%s", err.msg);
}
