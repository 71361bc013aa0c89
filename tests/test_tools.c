/* test_tools.c - the command-line programs as a user runs them: sluice-synth writes
 * a tiny checkpoint, sluice-gguf reads it back (info, verify, dump, experts), and
 * bad input gets one clear line and a nonzero exit, never a crash. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "run_cmd.h"
#include "quant.h"

static char dir[64], first[160];

static void setup(void)
{
    strcpy(dir, "/tmp/sl-tools-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    char cmd[512], out[8192];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-synth --preset tiny --out %s --shards 2 --seed 3",
             dir);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    snprintf(first, sizeof first, "%s/sluice-tiny-00001-of-00002.gguf", dir);
    cr_assert_eq(access(first, R_OK), 0, "%s", out);
}

static void teardown(void)
{
    sl_test_rm_rf(dir);
}

TestSuite(tools, .init = setup, .fini = teardown, .timeout = 60);

Test(tools, info_lists_metadata_tensors_and_totals)
{
    char cmd[512];
    static char out[1 << 20];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf info %s", first);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "general.architecture = \"deepseek41\""), "%.2000s", out);
    cr_assert(strstr(out, "blk.5.ffn_down_exps.weight"), "tensors are listed");
    cr_assert(strstr(out, "shards: 2"), "split info");
    cr_assert(strstr(out, "totals per type:") && strstr(out, "Q3_K"), "totals per type");
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf info %s --summary", first);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert_null(strstr(out, "blk.5.ffn_down_exps.weight"), "the summary leaves tensors out");
}

Test(tools, verify_passes_on_a_good_checkpoint_and_names_a_truncated_shard)
{
    char cmd[512], out[8192];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf verify %s --data", first);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "layout: all") && strstr(out, "expert map") &&
                  strstr(out, "finite values: ok"),
              "%s", out);
    char second[200];
    snprintf(second, sizeof second, "%s/sluice-tiny-00002-of-00002.gguf", dir);
    cr_assert_eq(truncate(second, 1000000), 0);
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf verify %s", first);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "sluice-tiny-00002-of-00002.gguf"), "the bad shard is named: %s", out);
    cr_assert_eq(strchr(out, '\n'), out + strlen(out) - 1, "one line: %s", out);
}

/* dump's output equals the tensor decoded here from a pread of its bytes. */
static void check_dump(const char *tensor)
{
    char cmd[512], out[256];
    char path[200];
    snprintf(path, sizeof path, "%s/dump.f32", dir);
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf dump %s %s > %s", first, tensor, path);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    sl_err err = {0};
    sl_gguf *g = NULL;
    cr_assert_eq(sl_gguf_open(&g, first, &err), 0, "%s", err.msg);
    const sl_gguf_tensor *t = sl_gguf_find_tensor(g, tensor);
    cr_assert_not_null(t);
    uint64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    uint8_t *raw = malloc(t->n_bytes);
    float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float) + 1);
    cr_assert_eq(pread(g->shards[t->shard].fd, raw, t->n_bytes, (off_t)t->offset),
                 (ssize_t)t->n_bytes);
    cr_assert_eq(sl_quant_decode(t->type, raw, want, n), 0);
    FILE *f = fopen(path, "rb");
    cr_assert_eq(fread(got, 1, n * sizeof(float) + 1, f), n * sizeof(float), "size of %s", tensor);
    fclose(f);
    cr_assert(memcmp(got, want, n * sizeof(float)) == 0, "%s decoded differently", tensor);
    free(raw);
    free(want);
    free(got);
    sl_gguf_close(&g);
}

Test(tools, dump_writes_the_decoded_tensor)
{
    check_dump("blk.0.attn_norm.weight");     /* F32 */
    check_dump("blk.2.attn_q_a.weight");      /* Q2_K */
    check_dump("blk.1.ffn_down_exps.weight"); /* Q3_K, 3-D */
    check_dump("blk.0.ffn_gate_inp.weight");  /* BF16 */
    check_dump("output.weight");              /* Q6_K */
}

Test(tools, experts_summarises_the_slice_map)
{
    char cmd[512], out[8192];
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf experts %s", first);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "6 layers x 16 experts"), "%s", out);
    cr_assert(strstr(out, "slot layout (align 4096)"), "%s", out);
}

Test(tools, bad_input_gets_one_clear_line)
{
    char cmd[512], out[8192];
    cr_assert_eq(sl_test_run(SL_BIN_DIR "/sluice-gguf verify /nonexistent/m.gguf", out, sizeof out),
                 1);
    cr_assert(strstr(out, "/nonexistent/m.gguf"), "%s", out);
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-gguf dump %s no.such.tensor > /dev/null", first);
    cr_assert_eq(sl_test_run(cmd, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "no tensor named 'no.such.tensor'"), "%s", out);
    cr_assert_eq(sl_test_run(SL_BIN_DIR "/sluice-gguf frobnicate x", out, sizeof out), 2);
    cr_assert_eq(
        sl_test_run(SL_BIN_DIR "/sluice-synth --preset huge --out /tmp/x", out, sizeof out), 2);
    cr_assert(strstr(out, "tiny"), "the presets are listed: %s", out);
    snprintf(cmd, sizeof cmd, SL_BIN_DIR "/sluice-synth --preset tiny --out %s --shards 0", dir);
    cr_assert_neq(sl_test_run(cmd, out, sizeof out), 0, "%s", out);
}
