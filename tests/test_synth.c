/* test_synth.c - sluice-synth: layout, metadata, tokenizer, shards, determinism.
 *
 * The expected tiny layout is written out literally here (names, types, dims per
 * layer role) rather than taken from sl_model_layout, so a mistake in the layout
 * code cannot confirm itself. Files go to mkdtemp folders that each test removes.
 * Tests that do not look at weight values write tiny with every quantized tensor
 * as random blocks (quantize_max_values 0), which keeps them fast under ASan.
 */
#include <criterion/criterion.h>

#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "quant.h"
#include "synth.h"
#include "test_file.h"

/* ---- helpers ---- */

static char *make_tmp(void)
{
    char *d = strdup("/tmp/sluice-test-synth-XXXXXX");
    cr_assert(d && mkdtemp(d), "mkdtemp");
    return d;
}

static void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            struct stat st;
            if (!lstat(p, &st) && S_ISDIR(st.st_mode))
                rm_tree(p);
            else
                unlink(p);
        }
        closedir(d);
    }
    rmdir(dir);
}

static sl_model_config tiny_cfg(int real_quant)
{
    sl_model_config c;
    sl_err err = {0, ""};
    cr_assert_eq(sl_model_config_preset(&c, "tiny", &err), 0, "%s", err.msg);
    if (!real_quant) c.quantize_max_values = 0;
    return c;
}

static void write_cfg(const sl_model_config *c, const char *dir, uint32_t shards, uint64_t seed)
{
    sl_err err = {0, ""};
    int rc = sl_synth_write(c, dir, shards, seed, NULL, NULL, NULL, &err);
    cr_assert_eq(rc, 0, "sl_synth_write: %s", err.msg);
}

static sl_gguf *open_first(const char *dir, const char *name, uint32_t shards)
{
    char file[512], path[4096];
    cr_assert_eq(sl_gguf_split_path(file, sizeof file, name, 0, shards), 0);
    snprintf(path, sizeof path, "%s/%s", dir, file);
    sl_gguf *g = NULL;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0, "sl_gguf_open(%s): %s", path, err.msg);
    return g;
}

static uint8_t *read_tensor(const sl_gguf *g, const sl_gguf_tensor *t)
{
    uint8_t *b = malloc(t->n_bytes ? t->n_bytes : 1);
    cr_assert(b);
    ssize_t n = pread(g->shards[t->shard].fd, b, t->n_bytes, (off_t)t->offset);
    cr_assert_eq((uint64_t)n, t->n_bytes, "pread %s", t->name.s);
    return b;
}

static uint64_t get_u64(const sl_gguf *g, const char *key)
{
    uint64_t v = 0;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_get_u64(g, key, &v, &err), 0, "%s", err.msg);
    return v;
}

static float get_f32(const sl_gguf *g, const char *key)
{
    float v = 0;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_get_f32(g, key, &v, &err), 0, "%s", err.msg);
    return v;
}

static void expect_list(const sl_gguf *g, const char *key, const int64_t *want, uint64_t n_want)
{
    int64_t v[64];
    uint64_t n = 0;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_get_arr_i64(g, key, v, 64, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(n, n_want, "%s: %" PRIu64 " entries", key, n);
    for (uint64_t i = 0; i < n; i++) cr_expect_eq(v[i], want[i], "%s[%" PRIu64 "]", key, i);
}

static int is_prime(uint64_t v)
{
    if (v < 2) return 0;
    for (uint64_t d = 2; d * d <= v; d++)
        if (v % d == 0) return 0;
    return 1;
}

/* ---- the tiny layout, written out ---- */

typedef struct want_tensor {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne0, ne1, ne2;
} want_tensor;

/* Every tensor of tiny's layers 0 (ratio 0), 2 (ratio-2 kv + index source), 4
 * (ratio-1 kv source, candidate source) and 5 (index-only consumer), and the
 * globals. Dims: dim 256, 4 heads x 256, q_lora 256, 2 groups x o_lora 128, 16
 * experts x 256, indexer 4 x 128, hc 4 (24 mixes), vocab 512. */
static const want_tensor TINY[] = {
    {"token_embd.weight", SL_QTYPE_Q2_K, 2, 256, 512, 1},
    {"output_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"output.weight", SL_QTYPE_Q6_K, 2, 256, 512, 1},
    {"blk.0.attn_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"blk.0.ffn_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"blk.0.hc_attn_fn.weight", SL_QTYPE_Q2_K, 2, 1024, 24, 1},
    {"blk.0.hc_ffn_fn.weight", SL_QTYPE_Q2_K, 2, 1024, 24, 1},
    {"blk.0.hc_attn_base.weight", SL_QTYPE_F32, 1, 24, 1, 1},
    {"blk.0.hc_ffn_base.weight", SL_QTYPE_F32, 1, 24, 1, 1},
    {"blk.0.hc_attn_scale.weight", SL_QTYPE_F32, 1, 3, 1, 1},
    {"blk.0.hc_ffn_scale.weight", SL_QTYPE_F32, 1, 3, 1, 1},
    {"blk.0.attn_q_a.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.0.attn_q_a_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"blk.0.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 256, 1024, 1},
    {"blk.0.attn_kv.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.0.attn_kv_a_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"blk.0.attn_sinks.weight", SL_QTYPE_F32, 1, 4, 1, 1},
    {"blk.0.attn_output_a.weight", SL_QTYPE_Q2_K, 2, 512, 256, 1},
    {"blk.0.attn_output_b.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.0.ffn_gate_inp.weight", SL_QTYPE_BF16, 2, 256, 16, 1},
    {"blk.0.exp_probs_b.bias", SL_QTYPE_F32, 1, 16, 1, 1},
    {"blk.0.exp_probs_b_vl.bias", SL_QTYPE_F32, 1, 16, 1, 1},
    {"blk.0.ffn_gate_exps.weight", SL_QTYPE_Q2_K, 3, 256, 256, 16},
    {"blk.0.ffn_up_exps.weight", SL_QTYPE_Q2_K, 3, 256, 256, 16},
    {"blk.0.ffn_down_exps.weight", SL_QTYPE_Q3_K, 3, 256, 256, 16},
    {"blk.0.ffn_gate_shexp.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.0.ffn_up_shexp.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.0.ffn_down_shexp.weight", SL_QTYPE_Q3_K, 2, 256, 256, 1},
    {"blk.2.attn_compressor_kv.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.2.attn_compressor_gate.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.2.attn_compressor_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"blk.2.indexer.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 256, 512, 1},
    {"blk.2.indexer.proj.weight", SL_QTYPE_Q2_K, 2, 256, 4, 1},
    {"blk.2.indexer.attn_k.weight", SL_QTYPE_Q2_K, 2, 256, 128, 1},
    {"blk.2.indexer.k_norm.weight", SL_QTYPE_F32, 1, 128, 1, 1},
    {"blk.4.attn_compressor_kv.weight", SL_QTYPE_Q2_K, 2, 256, 256, 1},
    {"blk.4.attn_compressor_norm.weight", SL_QTYPE_F32, 1, 256, 1, 1},
    {"blk.4.indexer.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 256, 512, 1},
    {"blk.4.indexer.proj.weight", SL_QTYPE_Q2_K, 2, 256, 4, 1},
    {"blk.4.indexer.attn_k.weight", SL_QTYPE_Q2_K, 2, 256, 128, 1},
    {"blk.4.indexer.k_norm.weight", SL_QTYPE_F32, 1, 128, 1, 1},
    {"blk.5.indexer.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 256, 512, 1},
    {"blk.5.indexer.proj.weight", SL_QTYPE_Q2_K, 2, 256, 4, 1},
    {"blk.1.engram_wkv.weight", SL_QTYPE_Q2_K, 2, 6144, 1280, 1},
    {"blk.1.engram_q.weight", SL_QTYPE_Q2_K, 2, 256, 4, 1},
    {"blk.1.engram_k.weight", SL_QTYPE_Q2_K, 2, 256, 4, 1},
    {"blk.3.engram_wkv.weight", SL_QTYPE_Q2_K, 2, 6144, 1280, 1},
};

/* Tensors a layer's role must NOT have in tiny. */
static const char *const TINY_ABSENT[] = {
    "blk.0.engram_embd.weight",        "blk.0.attn_compressor_kv.weight",
    "blk.0.indexer.attn_q_b.weight",   "blk.1.attn_compressor_kv.weight",
    "blk.2.engram_embd.weight",        "blk.3.attn_compressor_kv.weight",
    "blk.3.indexer.attn_q_b.weight",   "blk.4.attn_compressor_gate.weight",
    "blk.5.attn_compressor_kv.weight", "blk.5.indexer.attn_k.weight",
    "blk.5.indexer.k_norm.weight",     "blk.5.engram_embd.weight",
    "blk.6.attn_norm.weight",          "blk.3.attn_compressor_gate.weight",
};

/* The engram table rows of tiny: 24 consecutive primes from 300 for layer 1, the
 * next 24 for layer 3 (the §6.4 search restarts but skips primes handed out). */
static void tiny_primes(uint64_t p[48])
{
    uint64_t v = 299;
    for (int i = 0; i < 48; i++) {
        do v++;
        while (!is_prime(v));
        p[i] = v;
    }
}

static void check_tiny_layout(const sl_gguf *g)
{
    cr_assert_eq(g->n_tensors, 176,
                 "tiny has 6 x 25 + 2 x 4 engram + 5 compressor + 10 "
                 "indexer + 3 global tensors, got %" PRIu64,
                 g->n_tensors);
    for (size_t i = 0; i < sizeof TINY / sizeof TINY[0]; i++) {
        const want_tensor *w = &TINY[i];
        const sl_gguf_tensor *t = sl_gguf_find_tensor(g, w->name);
        cr_assert(t, "tensor %s missing", w->name);
        cr_expect_eq(t->type, w->type, "%s type %u", w->name, t->type);
        cr_expect_eq(t->n_dims, w->n_dims, "%s n_dims %u", w->name, t->n_dims);
        cr_expect(t->ne[0] == w->ne0 && t->ne[1] == w->ne1 && t->ne[2] == w->ne2,
                  "%s dims [%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]", w->name, t->ne[0], t->ne[1],
                  t->ne[2]);
    }
    for (size_t i = 0; i < sizeof TINY_ABSENT / sizeof TINY_ABSENT[0]; i++)
        cr_expect_null(sl_gguf_find_tensor(g, TINY_ABSENT[i]), "%s must not exist", TINY_ABSENT[i]);
    /* every layer has the 25 common tensors */
    const char *common[] = {"attn_norm.weight",    "attn_q_b.weight",     "ffn_down_exps.weight",
                            "hc_ffn_scale.weight", "exp_probs_b_vl.bias", "attn_sinks.weight"};
    for (int l = 0; l < 6; l++)
        for (size_t k = 0; k < sizeof common / sizeof common[0]; k++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.%s", l, common[k]);
            cr_expect(sl_gguf_find_tensor(g, name), "%s missing", name);
        }
    uint64_t p[48], rows1 = 0, rows3 = 0;
    tiny_primes(p);
    for (int i = 0; i < 24; i++) rows1 += p[i], rows3 += p[24 + i];
    const sl_gguf_tensor *e1 = sl_gguf_find_tensor(g, "blk.1.engram_embd.weight");
    const sl_gguf_tensor *e3 = sl_gguf_find_tensor(g, "blk.3.engram_embd.weight");
    cr_assert(e1 && e3);
    cr_expect(e1->type == SL_QTYPE_Q2_K && e1->ne[0] == 256 && e1->ne[1] == rows1,
              "blk.1.engram_embd [%" PRIu64 ", %" PRIu64 "], want [256, %" PRIu64 "]", e1->ne[0],
              e1->ne[1], rows1);
    cr_expect(e3->ne[1] == rows3);
    cr_expect_eq(e1->n_bytes, 84 * rows1, "one 84-byte Q2_K block per row");
}

/* ---- tests ---- */

Test(synth, tiny_layout_and_metadata)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0);
    write_cfg(&c, dir, 1, 7);
    sl_gguf *g = open_first(dir, "sluice-tiny", 1);
    check_tiny_layout(g);

    const char *s = NULL;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_get_str(g, "general.architecture", &s, &err), 0);
    cr_expect_str_eq(s, "deepseek41");
    cr_assert_eq(sl_gguf_get_str(g, "general.name", &s, &err), 0);
    cr_expect_str_eq(s, "sluice-tiny");
    cr_expect_eq(get_u64(g, "general.alignment"), 32);
    cr_expect_eq(get_u64(g, "deepseek41.block_count"), 6);
    cr_expect_eq(get_u64(g, "deepseek41.embedding_length"), 256);
    cr_expect_eq(get_u64(g, "deepseek41.vocab_size"), 512);
    cr_expect_eq(get_u64(g, "deepseek41.attention.head_count"), 4);
    cr_expect_eq(get_u64(g, "deepseek41.attention.head_count_kv"), 1);
    cr_expect_eq(get_u64(g, "deepseek41.attention.key_length"), 256);
    cr_expect_eq(get_u64(g, "deepseek41.attention.value_length"), 256);
    cr_expect_eq(get_u64(g, "deepseek41.rope.dimension_count"), 64);
    cr_expect_eq(get_u64(g, "deepseek41.attention.q_lora_rank"), 256);
    cr_expect_eq(get_u64(g, "deepseek41.attention.output_group_count"), 2);
    cr_expect_eq(get_u64(g, "deepseek41.attention.output_lora_rank"), 128);
    cr_expect_eq(get_u64(g, "deepseek41.attention.sliding_window"), 128);
    cr_expect_eq(get_u64(g, "deepseek41.attention.indexer.head_count"), 4);
    cr_expect_eq(get_u64(g, "deepseek41.attention.indexer.key_length"), 128);
    cr_expect_eq(get_u64(g, "deepseek41.attention.indexer.top_k"), 32);
    cr_expect_eq(get_u64(g, "deepseek41.expert_count"), 16);
    cr_expect_eq(get_u64(g, "deepseek41.expert_used_count"), 6);
    cr_expect_eq(get_u64(g, "deepseek41.expert_feed_forward_length"), 256);
    cr_expect_eq(get_u64(g, "deepseek41.expert_shared_count"), 1);
    cr_expect_eq(get_u64(g, "deepseek41.hyper_connection.count"), 4);
    cr_expect_eq(get_u64(g, "deepseek41.hyper_connection.sinkhorn_iterations"), 20);
    cr_expect_eq(get_u64(g, "deepseek41.hash_layer_count"), 0);
    cr_expect_eq(get_u64(g, "deepseek41.rope.scaling.original_context_length"), 65536);
    cr_expect_eq(get_f32(g, "deepseek41.rope.freq_base"), 10000.0f);
    cr_expect_eq(get_f32(g, "deepseek41.attention.compress_rope_freq_base"), 160000.0f);
    cr_expect_eq(get_f32(g, "deepseek41.rope.scaling.factor"), 16.0f);
    cr_expect_eq(get_f32(g, "deepseek41.expert_weights_scale"), 1.5f);
    cr_expect_eq(get_f32(g, "deepseek41.attention.layer_norm_rms_epsilon"), 1e-20f);
    cr_expect_eq(get_f32(g, "deepseek41.hyper_connection.epsilon"), 1e-6f);
    cr_expect_eq(get_f32(g, "deepseek41.expert_gate_temp"), 1.0f);
    cr_assert_eq(sl_gguf_get_str(g, "deepseek41.expert_score_func", &s, &err), 0);
    cr_expect_str_eq(s, "sqrtsoftplus");
    const sl_gguf_kv *clamp = sl_gguf_find_kv(g, "deepseek41.swiglu_clamp_exp");
    cr_assert(clamp && clamp->type == SL_GGUF_TYPE_ARRAY && clamp->arr_n == 6 &&
              clamp->arr_type == SL_GGUF_TYPE_FLOAT32);
    cr_expect_eq(((const float *)clamp->v.arr)[5], 10.0f);

    const int64_t ratios[] = {0, 0, 2, 2, 1, 1}, kv[] = {2, 4}, idx[] = {2, 4, 5}, eng[] = {1, 3};
    expect_list(g, "deepseek41.attention.compress_ratios", ratios, 6);
    expect_list(g, "deepseek41.attention.kv_source_layers", kv, 2);
    expect_list(g, "deepseek41.attention.index_source_layers", idx, 3);
    expect_list(g, "deepseek41.engram.layer_ids", eng, 2);
    int64_t cand = 0;
    cr_assert_eq(sl_gguf_get_i64(g, "deepseek41.attention.candidate.source_layer", &cand, &err), 0);
    cr_expect_eq(cand, 4);
    cr_expect_eq(get_u64(g, "deepseek41.attention.candidate.block_size") *
                     get_u64(g, "deepseek41.attention.candidate.top_k_blocks"),
                 64, "the candidate mask keeps fewer than 300 entries");

    /* engram constants */
    cr_expect_eq(get_u64(g, "deepseek41.engram.head_count"), 8);
    cr_expect_eq(get_u64(g, "deepseek41.engram.key_length"), 256);
    cr_expect_eq(get_u64(g, "deepseek41.engram.max_ngram_size"), 4);
    cr_expect_eq(get_u64(g, "deepseek41.engram.pad_id"), 2);
    int64_t primes[64], offs[64], mult[64];
    uint64_t np = 0, no = 0, nm = 0;
    cr_assert_eq(sl_gguf_get_arr_i64(g, "deepseek41.engram.primes", primes, 64, &np, &err), 0);
    cr_assert_eq(sl_gguf_get_arr_i64(g, "deepseek41.engram.offsets", offs, 64, &no, &err), 0);
    cr_assert_eq(sl_gguf_get_arr_i64(g, "deepseek41.engram.multipliers", mult, 64, &nm, &err), 0);
    cr_assert(np == 48 && no == 48 && nm == 8);
    uint64_t want_p[48];
    tiny_primes(want_p);
    for (int e = 0; e < 2; e++) {
        int64_t off = 0;
        for (int k = 0; k < 24; k++) {
            cr_expect_eq((uint64_t)primes[e * 24 + k], want_p[e * 24 + k], "prime [%d][%d]", e, k);
            cr_expect_eq(offs[e * 24 + k], off, "offset [%d][%d]", e, k);
            off += primes[e * 24 + k];
        }
    }
    for (int i = 0; i < 8; i++)
        cr_expect(mult[i] > 0 && (mult[i] & 1) && mult[i] < (1ll << 47), "multiplier %d", i);
    uint64_t cv = get_u64(g, "deepseek41.engram.compressed_vocab_size");
    cr_expect(cv > 3 && cv <= 512);
    for (int i = 0; i < 8; i++) /* tau * mu must not overflow for any compressed id */
        cr_expect((uint64_t)mult[i] <= (uint64_t)INT64_MAX / cv, "multiplier %d too large", i);

    /* tokenizer keys */
    cr_assert_eq(sl_gguf_get_str(g, "tokenizer.ggml.model", &s, &err), 0);
    cr_expect_str_eq(s, "gpt2");
    cr_expect_eq(get_u64(g, "tokenizer.ggml.bos_token_id"), 0);
    cr_expect_eq(get_u64(g, "tokenizer.ggml.eos_token_id"), 1);
    cr_expect_eq(get_u64(g, "tokenizer.ggml.padding_token_id"), 2);
    int add_bos = 0;
    cr_assert_eq(sl_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos, &err), 0);
    cr_expect(add_bos);
    cr_expect_eq(get_u64(g, "split.count"), 1);
    cr_expect_eq(get_u64(g, "split.tensors.count"), 176);
    sl_gguf_close(&g);
    rm_tree(dir);
    free(dir);
}

Test(synth, layout_function_matches_file)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0);
    write_cfg(&c, dir, 1, 1);
    sl_gguf *g = open_first(dir, "sluice-tiny", 1);
    sl_model_tensor *t = NULL;
    uint64_t n = 0;
    sl_err err = {0, ""};
    cr_assert_eq(sl_model_layout(&c, &t, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(n, g->n_tensors);
    uint64_t bytes = 0;
    for (uint64_t i = 0; i < n; i++) {
        const sl_gguf_tensor *f = &g->tensors[i];
        cr_expect_str_eq(f->name.s, t[i].name, "tensor %" PRIu64 " in file order", i);
        cr_expect_eq(f->type, t[i].type);
        cr_expect_eq(f->n_dims, t[i].n_dims);
        cr_expect(!memcmp(f->ne, t[i].ne, sizeof f->ne), "%s dims", t[i].name);
        cr_expect_eq(f->n_bytes, t[i].n_bytes);
        bytes += t[i].n_bytes;
    }
    cr_expect_eq(bytes, sl_model_tensor_bytes(&c));
    cr_expect_str_eq(t[0].name, "token_embd.weight", "globals: embedding first");
    cr_expect_str_eq(t[n - 1].name, "output.weight", "... and the head last");
    free(t);
    sl_gguf_close(&g);
    rm_tree(dir);
    free(dir);
}

Test(synth, three_shards)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0);
    write_cfg(&c, dir, 3, 7);
    char path[4096];
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/sluice-tiny-%05u-of-00003.gguf", dir, i + 1);
        cr_expect_eq(access(path, R_OK), 0, "%s exists", path);
    }
    /* open through the last shard's name: every shard comes with it */
    sl_gguf *g = NULL;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0, "%s", err.msg);
    cr_assert_eq(g->n_shards, 3);
    check_tiny_layout(g);
    uint64_t shard_bytes[3] = {0, 0, 0};
    for (uint32_t i = 0; i < 3; i++) {
        const sl_gguf_shard *sh = &g->shards[i];
        cr_expect(sh->n_tensor > 0, "shard %u has tensors", i);
        int have_no = 0, have_count = 0, have_total = 0, have_arch = 0, have_tok = 0;
        for (uint64_t k = 0; k < sh->n_kv; k++) {
            const sl_gguf_kv *kv = &sh->kv[k];
            if (!strcmp(kv->key.s, "split.no"))
                have_no = kv->type == SL_GGUF_TYPE_UINT16 && kv->v.u64 == i;
            if (!strcmp(kv->key.s, "split.count"))
                have_count = kv->type == SL_GGUF_TYPE_UINT16 && kv->v.u64 == 3;
            if (!strcmp(kv->key.s, "split.tensors.count"))
                have_total = kv->type == SL_GGUF_TYPE_INT32 && kv->v.i64 == 176;
            have_arch |= !strcmp(kv->key.s, "general.architecture");
            have_tok |= !strcmp(kv->key.s, "tokenizer.ggml.tokens");
        }
        cr_expect(have_no && have_count && have_total, "shard %u split keys", i);
        cr_expect_eq(have_arch, i == 0, "model keys only in shard 0");
        cr_expect_eq(have_tok, i == 0, "tokenizer only in shard 0");
        for (uint64_t k = sh->first_tensor; k < sh->first_tensor + sh->n_tensor; k++)
            shard_bytes[i] += g->tensors[k].n_bytes;
    }
    /* balanced by bytes: no shard is more than twice another (tiny has 2.6 MB tensors) */
    for (int i = 0; i < 3; i++)
        cr_expect(shard_bytes[i] * 2 > shard_bytes[(i + 1) % 3], "shard %d: %" PRIu64 " bytes", i,
                  shard_bytes[i]);
    sl_gguf_close(&g);

    /* the same tensors' bytes as a single-file write */
    char *dir1 = make_tmp();
    write_cfg(&c, dir1, 1, 7);
    sl_gguf *g1 = open_first(dir1, "sluice-tiny", 1);
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0);
    for (uint64_t i = 0; i < g1->n_tensors; i++) {
        const sl_gguf_tensor *a = &g1->tensors[i], *b = sl_gguf_find_tensor(g, a->name.s);
        cr_assert(b && a->n_bytes == b->n_bytes);
        uint8_t *x = read_tensor(g1, a), *y = read_tensor(g, b);
        cr_expect(!memcmp(x, y, a->n_bytes), "%s differs between 1 and 3 shards", a->name.s);
        free(x), free(y);
    }
    sl_gguf_close(&g);
    sl_gguf_close(&g1);
    rm_tree(dir);
    rm_tree(dir1);
    free(dir);
    free(dir1);
}

Test(synth, tokenizer_consistency)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0);
    write_cfg(&c, dir, 1, 1);
    sl_gguf *g = open_first(dir, "sluice-tiny", 1);
    const sl_gguf_kv *tk = sl_gguf_find_kv(g, "tokenizer.ggml.tokens");
    const sl_gguf_kv *tt = sl_gguf_find_kv(g, "tokenizer.ggml.token_type");
    const sl_gguf_kv *mg = sl_gguf_find_kv(g, "tokenizer.ggml.merges");
    const sl_gguf_kv *tm = sl_gguf_find_kv(g, "deepseek41.engram.token_map");
    cr_assert(tk && tt && mg && tm);
    cr_assert_eq(tk->arr_type, SL_GGUF_TYPE_STRING);
    cr_assert_eq(tk->arr_n, 512);
    cr_assert(tt->arr_type == SL_GGUF_TYPE_INT32 && tt->arr_n == 512);
    cr_assert(tm->arr_type == SL_GGUF_TYPE_INT32 && tm->arr_n == 512, "token_map length = vocab");
    const sl_gguf_str *tok = tk->v.arr, *merge = mg->v.arr;
    const int32_t *type = tt->v.arr, *map = tm->v.arr;
    cr_expect_str_eq(tok[0].s, "<\xef\xbd\x9c"
                               "begin\xe2\x96\x81"
                               "of\xe2\x96\x81"
                               "sentence\xef\xbd\x9c>");
    cr_expect_str_eq(tok[3 + ' '].s, "\xc4\xa0", "space byte is spelled G-dot");
    cr_expect_str_eq(tok[3 + 'a'].s, "a");
    for (int i = 0; i < 3; i++) cr_expect_eq(type[i], 3, "special %d is a control token", i);
    for (uint64_t i = 3; i < 512; i++) cr_expect_eq(type[i], 1);
    for (uint64_t i = 0; i < 512; i++)
        for (uint64_t j = i + 1; j < 512; j++)
            cr_assert(strcmp(tok[i].s, tok[j].s), "tokens %" PRIu64 " and %" PRIu64 " are equal", i,
                      j);
    cr_assert_eq(mg->arr_n, 512 - 259);
    for (uint64_t i = 0; i < mg->arr_n; i++) {
        const char *sp = strchr(merge[i].s, ' ');
        cr_assert(sp && !strchr(sp + 1, ' '), "merge %" PRIu64 " has one space", i);
        char joined[512];
        size_t la = (size_t)(sp - merge[i].s);
        snprintf(joined, sizeof joined, "%.*s%s", (int)la, merge[i].s, sp + 1);
        int left = 0, right = 0;
        for (uint64_t k = 0; k < 259 + i; k++) { /* both parts exist before the merge */
            left |= strlen(tok[k].s) == la && !strncmp(tok[k].s, merge[i].s, la);
            right |= !strcmp(tok[k].s, sp + 1);
        }
        cr_expect(left && right, "merge '%s' parts are earlier tokens", merge[i].s);
        cr_expect_str_eq(tok[259 + i].s, joined, "merge %" PRIu64 " makes token %" PRIu64, i,
                         259 + i);
    }
    uint64_t cv = get_u64(g, "deepseek41.engram.compressed_vocab_size");
    int32_t next = 0;
    for (uint64_t i = 0; i < 512; i++) {
        cr_assert(map[i] >= 0 && (uint64_t)map[i] < cv, "token_map[%" PRIu64 "] in range", i);
        cr_assert(map[i] <= next, "first-sight numbering at %" PRIu64, i);
        if (map[i] == next) next++;
    }
    cr_expect_eq((uint64_t)next, cv);
    cr_expect(map[0] == 0 && map[1] == 1 && map[2] == 2);
    /* "the" and " the" (a learned merge) share their compressed id */
    int the = -1, sthe = -1;
    for (int i = 0; i < 512; i++) {
        if (!strcmp(tok[i].s, "the")) the = i;
        if (!strcmp(tok[i].s, "\xc4\xa0the")) sthe = i;
    }
    cr_assert(sthe >= 0, "'Gthe' learned from the text");
    if (the >= 0) cr_expect_eq(map[the], map[sthe]);
    cr_expect_eq(map[3 + 'A'], map[3 + 'a'], "case folded");
    sl_gguf_close(&g);
    rm_tree(dir);
    free(dir);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

Test(synth, bench_tokenizer_full_vocab)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    sl_synth_tokenizer *t = NULL;
    sl_err err = {0, ""};
    cr_assert_eq(sl_synth_tokenizer_build(&t, 129280, &err), 0, "%s", err.msg);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    cr_expect(s < 2.0, "129280 tokens took %.2f s", s); /* ~0.1 s; loose for ASan */
    cr_assert_eq(t->n_vocab, 129280);
    cr_assert_eq(t->n_merges, 129280 - 259);
    cr_expect(t->n_trained > 100, "merges learned from the text: %u", t->n_trained);
    char **sorted = malloc(t->n_vocab * sizeof *sorted);
    memcpy(sorted, t->tokens, t->n_vocab * sizeof *sorted);
    qsort(sorted, t->n_vocab, sizeof *sorted, cmp_str);
    for (uint32_t i = 1; i < t->n_vocab; i++)
        cr_assert(strcmp(sorted[i - 1], sorted[i]), "duplicate token '%s'", sorted[i]);
    free(sorted);
    for (uint32_t i = 0; i < t->n_merges; i++) {
        const char *m = t->merges[i], *sp = strchr(m, ' ');
        cr_assert(sp);
        const char *tok = t->tokens[SL_SYNTH_FIRST_MERGE_TOKEN + i];
        size_t la = (size_t)(sp - m);
        cr_assert(strlen(tok) == la + strlen(sp + 1) && !strncmp(tok, m, la) &&
                      !strcmp(tok + la, sp + 1),
                  "merge '%s' -> '%s'", m, tok);
    }
    int32_t mx = -1;
    for (uint32_t i = 0; i < t->n_vocab; i++) mx = t->token_map[i] > mx ? t->token_map[i] : mx;
    cr_expect_eq((uint32_t)mx + 1, t->n_compressed);
    cr_expect(t->n_compressed < t->n_vocab && t->n_compressed > 1000);
    sl_synth_tokenizer_free(&t);
    cr_expect_null(t);
}

Test(synth, determinism_and_seed)
{
    char *a = make_tmp(), *b = make_tmp(), *c = make_tmp();
    sl_model_config cfg = tiny_cfg(1);
    write_cfg(&cfg, a, 1, 42);
    write_cfg(&cfg, b, 1, 42);
    write_cfg(&cfg, c, 1, 43);
    char pa[4096], pb[4096], pc[4096];
    snprintf(pa, sizeof pa, "%s/sluice-tiny-00001-of-00001.gguf", a);
    snprintf(pb, sizeof pb, "%s/sluice-tiny-00001-of-00001.gguf", b);
    snprintf(pc, sizeof pc, "%s/sluice-tiny-00001-of-00001.gguf", c);
    size_t na, nb, nc;
    uint8_t *x = sl_test_slurp(pa, &na), *y = sl_test_slurp(pb, &nb), *z = sl_test_slurp(pc, &nc);
    cr_expect(na == nb && !memcmp(x, y, na), "same seed, same bytes");
    cr_expect(na != nc || memcmp(x, z, na), "another seed, other bytes");
    free(x), free(y), free(z);

    sl_gguf *ga = open_first(a, "sluice-tiny", 1), *gc = open_first(c, "sluice-tiny", 1);
    cr_assert_eq(ga->n_tensors, gc->n_tensors);
    uint64_t n_diff = 0;
    for (uint64_t i = 0; i < ga->n_tensors; i++) {
        const sl_gguf_tensor *p = &ga->tensors[i], *q = &gc->tensors[i];
        cr_expect_str_eq(p->name.s, q->name.s);
        cr_expect(p->type == q->type && p->offset == q->offset && p->n_bytes == q->n_bytes,
                  "%s: same header shape", p->name.s);
        uint8_t *u = read_tensor(ga, p), *v = read_tensor(gc, q);
        n_diff += memcmp(u, v, p->n_bytes) != 0;
        free(u), free(v);
    }
    cr_expect_eq(n_diff, ga->n_tensors, "every tensor's data depends on the seed");
    int64_t m1[8], m2[8];
    uint64_t n1, n2;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_get_arr_i64(ga, "deepseek41.engram.multipliers", m1, 8, &n1, &err), 0);
    cr_assert_eq(sl_gguf_get_arr_i64(gc, "deepseek41.engram.multipliers", m2, 8, &n2, &err), 0);
    cr_expect(memcmp(m1, m2, sizeof m1), "multipliers follow the seed");
    sl_gguf_close(&ga);
    sl_gguf_close(&gc);
    rm_tree(a), rm_tree(b), rm_tree(c);
    free(a), free(b), free(c);
}

/* A layer period P: layer l's tensors carry the bytes of the same kind in layer l mod P
 * (the MoE tensors of layer 8 checked against layer 2's), the layers below P and the
 * global tensors keep their own, and without a period layer 8 has its own. */
Test(synth, layer_period_repeats_the_layers)
{
    char *a = make_tmp(), *b = make_tmp();
    sl_model_config cfg = tiny_cfg(1);
    cfg.n_layer = 12;
    for (uint32_t l = 6; l < 12; l++) cfg.compress_ratio[l] = 0; /* no kv sources needed */
    write_cfg(&cfg, a, 1, 7);
    cfg.layer_period = 6;
    write_cfg(&cfg, b, 1, 7);
    sl_gguf *ga = open_first(a, "sluice-tiny", 1), *gb = open_first(b, "sluice-tiny", 1);
    static const char *const kinds[] = {"ffn_norm.weight",       "ffn_gate_inp.weight",
                                        "exp_probs_b.bias",      "ffn_gate_exps.weight",
                                        "ffn_up_exps.weight",    "ffn_down_exps.weight",
                                        "ffn_gate_shexp.weight", "ffn_down_shexp.weight"};
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        char lo[64], hi[64];
        snprintf(lo, sizeof lo, "blk.2.%s", kinds[k]);
        snprintf(hi, sizeof hi, "blk.8.%s", kinds[k]);
        const sl_gguf_tensor *tl = sl_gguf_find_tensor(gb, lo), *th = sl_gguf_find_tensor(gb, hi);
        const sl_gguf_tensor *ta = sl_gguf_find_tensor(ga, lo), *tah = sl_gguf_find_tensor(ga, hi);
        cr_assert(tl && th && ta && tah, "%s", kinds[k]);
        cr_assert_eq(tl->n_bytes, th->n_bytes, "%s", kinds[k]);
        uint8_t *u = read_tensor(gb, tl), *v = read_tensor(gb, th);
        uint8_t *w = read_tensor(ga, ta), *x = read_tensor(ga, tah);
        cr_expect(!memcmp(u, v, tl->n_bytes), "period 6: layer 8's %s is layer 2's", kinds[k]);
        cr_expect(!memcmp(u, w, tl->n_bytes), "period 6: layer 2's %s is its own", kinds[k]);
        cr_expect(memcmp(w, x, tl->n_bytes), "no period: layer 8's %s is its own", kinds[k]);
        free(u), free(v), free(w), free(x);
    }
    const sl_gguf_tensor *ea = sl_gguf_find_tensor(ga, "token_embd.weight");
    const sl_gguf_tensor *eb = sl_gguf_find_tensor(gb, "token_embd.weight");
    cr_assert(ea && eb);
    uint8_t *u = read_tensor(ga, ea), *v = read_tensor(gb, eb);
    cr_expect(!memcmp(u, v, ea->n_bytes), "the global tensors keep their bytes");
    free(u), free(v);
    sl_gguf_close(&ga);
    sl_gguf_close(&gb);
    rm_tree(a), rm_tree(b);
    free(a), free(b);
}

/* Mean and spread of decoded values of one tensor's first rows. */
static void decoded_stats(const sl_gguf *g, const char *name, uint64_t n_values, double *mean,
                          double *std, double *amax)
{
    const sl_gguf_tensor *t = sl_gguf_find_tensor(g, name);
    cr_assert(t, "%s", name);
    uint64_t bytes = sl_qtype_row_bytes(t->type, n_values);
    cr_assert(bytes && bytes <= t->n_bytes);
    uint8_t *raw = read_tensor(g, t);
    float *v = malloc(n_values * sizeof *v);
    cr_assert_eq(sl_quant_decode(t->type, raw, v, n_values), 0, "decode %s", name);
    double s = 0, s2 = 0, m = 0;
    for (uint64_t i = 0; i < n_values; i++) {
        cr_assert(isfinite(v[i]), "%s value %" PRIu64 " is %g", name, i, (double)v[i]);
        s += v[i], s2 += (double)v[i] * v[i];
        if (fabs(v[i]) > m) m = fabs(v[i]);
    }
    *mean = s / (double)n_values;
    *std = sqrt(s2 / (double)n_values - *mean * *mean);
    *amax = m;
    free(raw), free(v);
}

Test(synth, decoded_values_plausible)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(1);
    write_cfg(&c, dir, 1, 3);
    sl_gguf *g = open_first(dir, "sluice-tiny", 1);
    /* matrices aim at N(0, 1/sqrt(ne0)) = 0.0625 for ne0 256: random blocks (experts)
     * and reference-quantized ones (q_b) alike; +-50% covers Q2_K's coarse grid. */
    const char *mats[] = {"blk.0.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight",
                          "blk.0.attn_q_b.weight", "output.weight"};
    for (size_t i = 0; i < 4; i++) {
        double mean, std, amax;
        decoded_stats(g, mats[i], 256 * 64, &mean, &std, &amax);
        cr_expect(std > 0.03 && std < 0.1, "%s std %g", mats[i], std);
        cr_expect(fabs(mean) < 0.02, "%s mean %g", mats[i], mean);
        cr_expect(amax < 1.0, "%s max %g", mats[i], amax);
    }
    double mean, std, amax;
    decoded_stats(g, "blk.0.attn_norm.weight", 256, &mean, &std, &amax);
    cr_expect(mean > 0.9 && mean < 1.1 && std > 0.01, "norm weights around 1: %g", mean);
    decoded_stats(g, "blk.0.ffn_gate_inp.weight", 256 * 16, &mean, &std, &amax);
    cr_expect(std > 0.03 && std < 0.1, "router std %g", std);
    /* one expert's first block (expert 5 of layer 2), decoded alone */
    const sl_gguf_tensor *t = sl_gguf_find_tensor(g, "blk.2.ffn_gate_exps.weight");
    cr_assert(t);
    uint64_t expert_bytes = t->n_bytes / 16;
    uint8_t blk[sizeof(sl_block_q2_k)];
    cr_assert_eq(
        pread(g->shards[t->shard].fd, blk, sizeof blk, (off_t)(t->offset + 5 * expert_bytes)),
        (ssize_t)sizeof blk);
    float v[256];
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q2_K, blk, v, 256), 0);
    int nonzero = 0;
    for (int i = 0; i < 256; i++) {
        cr_assert(isfinite(v[i]) && fabsf(v[i]) < 1.0f, "value %d = %g", i, (double)v[i]);
        nonzero += v[i] != 0.0f;
    }
    cr_expect(nonzero > 64);
    /* every expert and every row has its own data (routing tests need distinct experts) */
    uint8_t *all = read_tensor(g, t);
    for (int e = 1; e < 16; e++)
        cr_expect(memcmp(all, all + e * expert_bytes, expert_bytes), "expert %d = expert 0", e);
    cr_expect(memcmp(all, all + sizeof(sl_block_q2_k), sizeof(sl_block_q2_k)), "rows repeat");
    free(all);
    sl_gguf_close(&g);
    rm_tree(dir);
    free(dir);
}

Test(synth, config_round_trip)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0), want = c, got;
    sl_err err = {0, ""};
    write_cfg(&c, dir, 2, 99);
    cr_assert_eq(sl_synth_derive(&want, 99, &err), 0, "%s", err.msg);
    sl_gguf *g = open_first(dir, "sluice-tiny", 2);
    memset(&got, 0x5a, sizeof got);
    cr_assert_eq(sl_model_config_read(g, &got, &err), 0, "%s", err.msg);
    got.fast_random_blocks = want.fast_random_blocks; /* synth-only fields */
    got.quantize_max_values = want.quantize_max_values;
    cr_expect_str_eq(got.name, want.name);
    cr_expect_eq(got.n_layer, want.n_layer);
    cr_expect_eq(got.engram_compressed_vocab, want.engram_compressed_vocab);
    cr_expect(!memcmp(got.engram_multiplier, want.engram_multiplier, sizeof got.engram_multiplier));
    cr_expect(!memcmp(got.engram_prime, want.engram_prime, sizeof got.engram_prime));
    cr_expect(!memcmp(got.compress_ratio, want.compress_ratio, sizeof got.compress_ratio));
    cr_expect(!memcmp(&got, &want, sizeof got), "every field reads back");
    sl_gguf_close(&g);
    rm_tree(dir);
    free(dir);
}

/* A header like an early community file: only the keys MODEL.md says every file
 * has; the lists, candidate settings and engram constants come from §1 / §6.4. */
Test(synth, config_read_defaults)
{
    char *dir = make_tmp(), path[4096];
    snprintf(path, sizeof path, "%s/early.gguf", dir);
    sl_gguf_writer *w = NULL;
    sl_err err = {0, ""};
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0, "%s", err.msg);
    int32_t ratios[43];
    for (int l = 0; l < 43; l++) ratios[l] = l < 2 || l >= 40 ? 0 : l < 20 ? 2 : 1;
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.architecture", "deepseek41"), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.block_count", 40), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.embedding_length", 5120), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.vocab_size", 129280), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.attention.head_count", 64), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.attention.key_length", 512), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.attention.q_lora_rank", 1280), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.expert_count", 384), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.expert_used_count", 6), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek41.expert_feed_forward_length", 2304), 0);
    cr_assert_eq(sl_gguf_writer_set_u32(w, "deepseek4.engram.head_count", 8), 0, "old prefix");
    cr_assert_eq(sl_gguf_writer_set_arr(w, "deepseek41.attention.compress_ratios",
                                        SL_GGUF_TYPE_INT32, ratios, 43),
                 0);
    cr_assert_eq(sl_gguf_writer_write(w, path, NULL, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    sl_gguf_writer_free(&w);
    sl_gguf *g = NULL;
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0, "%s", err.msg);
    sl_model_config c, v41;
    cr_assert_eq(sl_model_config_read(g, &c, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_model_config_preset(&v41, "bench-L40", &err), 0);
    cr_expect(c.n_kv_source == 4 && !memcmp(c.kv_source, v41.kv_source, 4 * sizeof(uint32_t)));
    cr_expect(c.n_index_source == 8 && c.index_source[4] == 24 && c.index_source[7] == 36);
    cr_expect(c.candidate_source == 20 && c.candidate_block_size == 8 &&
              c.candidate_topk_blocks == 2048);
    cr_expect(c.n_engram == 2 && c.engram_layer[0] == 1 && c.engram_layer[1] == 14);
    cr_expect_eq(c.engram_multiplier[0][0], 76632096046245ull);
    cr_expect_eq(c.engram_multiplier[1][3], 82619226485591ull);
    cr_expect_eq(c.engram_prime[0][0], 16000057);
    cr_expect_eq(c.engram_prime[1][23], 16000889);
    cr_expect_eq(c.engram_compressed_vocab, 99092);
    cr_expect(c.gate_temp == 1.0f && c.route_scale == 1.5f && c.swiglu_limit == 10.0f);
    cr_expect(c.compress_ratio[39] == 1 && c.compress_ratio[19] == 2 && c.rope_dim == 64);
    sl_gguf_close(&g);

    /* another architecture is refused by name */
    snprintf(path, sizeof path, "%s/llama.gguf", dir);
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    cr_assert_eq(sl_gguf_writer_set_str(w, "general.architecture", "llama"), 0);
    cr_assert_eq(sl_gguf_writer_write(w, path, NULL, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    sl_gguf_writer_free(&w);
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0, "%s", err.msg);
    cr_expect_eq(sl_model_config_read(g, &c, &err), SL_EUNSUPPORTED);
    cr_expect(strstr(err.msg, "llama"), "%s", err.msg);
    sl_gguf_close(&g);
    rm_tree(dir);
    free(dir);
}

Test(synth, bench_presets_without_writing)
{
    sl_model_config c;
    sl_err err = {0, ""};
    cr_assert_eq(sl_model_config_preset(&c, "bench-L4", &err), 0, "%s", err.msg);
    cr_expect_str_eq(c.name, "sluice-bench-L4");
    cr_expect(c.dim == 5120 && c.n_expert == 384 && c.moe_inter == 2304 && c.n_layer == 4);
    cr_expect(c.n_head == 64 && c.head_dim == 512 && c.q_lora == 1280 && c.vocab == 129280);
    cr_expect(c.fast_random_blocks);
    cr_expect(c.compress_ratio[0] == 0 && c.compress_ratio[1] == 0 && c.compress_ratio[2] == 2 &&
              c.compress_ratio[3] == 2);
    cr_expect(c.n_kv_source == 1 && c.kv_source[0] == 2 && c.n_index_source == 1);
    cr_expect(c.n_engram == 1 && c.engram_layer[0] == 1 && c.candidate_source == -1);
    sl_model_tensor *t = NULL;
    uint64_t n = 0;
    cr_assert_eq(sl_model_layout(&c, &t, &n, &err), 0, "%s", err.msg);
    uint64_t expert = 0, table_rows = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (!strcmp(t[i].name, "blk.3.ffn_gate_exps.weight") ||
            !strcmp(t[i].name, "blk.3.ffn_up_exps.weight")) {
            cr_expect_eq(t[i].type, SL_QTYPE_Q2_K);
            cr_expect(t[i].ne[0] == 5120 && t[i].ne[1] == 2304 && t[i].ne[2] == 384);
            expert += t[i].n_bytes / 384;
        }
        if (!strcmp(t[i].name, "blk.3.ffn_down_exps.weight")) {
            cr_expect_eq(t[i].type, SL_QTYPE_Q3_K);
            cr_expect(t[i].ne[0] == 2304 && t[i].ne[1] == 5120 && t[i].ne[2] == 384);
            expert += t[i].n_bytes / 384;
        }
        if (!strcmp(t[i].name, "blk.1.engram_embd.weight")) table_rows = t[i].ne[1];
        if (!strcmp(t[i].name, "output.weight")) cr_expect_eq(t[i].type, SL_QTYPE_Q6_K);
    }
    free(t);
    cr_expect_eq(expert, 12810240, "one expert is 12.22 MiB (DESIGN.md)");
    cr_expect(table_rows > 2000000 && table_rows < 5000000, "engram table shrunk: %" PRIu64,
              table_rows);
    uint64_t bytes = sl_model_tensor_bytes(&c);
    cr_expect(bytes > 19e9 && bytes < 22e9, "bench-L4 ~20 GB, got %" PRIu64, bytes);

    /* bench-L40 with full-size engram tables is the published Q2_K file's layout:
     * 1046 tensors and 264,509,443,176 bytes of tensor data (MODEL.md §9.1) */
    cr_assert_eq(sl_model_config_preset(&c, "bench-L40", &err), 0, "%s", err.msg);
    c.engram_vocab_size = 16000000;
    sl_model_config_engram_primes(&c);
    cr_expect_eq(c.engram_prime[0][0], 16000057);
    cr_expect_eq(c.engram_prime[0][23], 16000463);
    cr_expect_eq(c.engram_prime[1][0], 16000477);
    cr_expect_eq(c.engram_prime[1][23], 16000889);
    cr_expect_eq(c.engram_offset[0][23], 368005705);
    cr_expect_eq(c.engram_offset[1][23], 368015793);
    cr_assert_eq(sl_model_layout(&c, &t, &n, &err), 0, "%s", err.msg);
    free(t);
    cr_expect_eq(n, 1046);
    cr_expect_eq(sl_model_tensor_bytes(&c), 264509443176ull);
}

/* MODEL.md §9.1's table at V4.1's dims (all distinct, unlike tiny's 256s), for the
 * layers that show each role: 1 engram, 2 ratio-2 kv source, 20 ratio-1 kv + candidate
 * source, 24 index-only consumer, 39 plain. */
static const want_tensor V41[] = {
    {"token_embd.weight", SL_QTYPE_Q2_K, 2, 5120, 129280, 1},
    {"output_norm.weight", SL_QTYPE_F32, 1, 5120, 1, 1},
    {"output.weight", SL_QTYPE_Q6_K, 2, 5120, 129280, 1},
    {"blk.39.attn_norm.weight", SL_QTYPE_F32, 1, 5120, 1, 1},
    {"blk.39.hc_attn_fn.weight", SL_QTYPE_Q2_K, 2, 20480, 24, 1},
    {"blk.39.hc_ffn_base.weight", SL_QTYPE_F32, 1, 24, 1, 1},
    {"blk.39.hc_ffn_scale.weight", SL_QTYPE_F32, 1, 3, 1, 1},
    {"blk.39.attn_q_a.weight", SL_QTYPE_Q2_K, 2, 5120, 1280, 1},
    {"blk.39.attn_q_a_norm.weight", SL_QTYPE_F32, 1, 1280, 1, 1},
    {"blk.39.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 1280, 32768, 1},
    {"blk.39.attn_kv.weight", SL_QTYPE_Q2_K, 2, 5120, 512, 1},
    {"blk.39.attn_kv_a_norm.weight", SL_QTYPE_F32, 1, 512, 1, 1},
    {"blk.39.attn_sinks.weight", SL_QTYPE_F32, 1, 64, 1, 1},
    {"blk.39.attn_output_a.weight", SL_QTYPE_Q2_K, 2, 4096, 8192, 1},
    {"blk.39.attn_output_b.weight", SL_QTYPE_Q2_K, 2, 8192, 5120, 1},
    {"blk.39.ffn_gate_inp.weight", SL_QTYPE_BF16, 2, 5120, 384, 1},
    {"blk.39.exp_probs_b.bias", SL_QTYPE_F32, 1, 384, 1, 1},
    {"blk.39.exp_probs_b_vl.bias", SL_QTYPE_F32, 1, 384, 1, 1},
    {"blk.39.ffn_gate_exps.weight", SL_QTYPE_Q2_K, 3, 5120, 2304, 384},
    {"blk.39.ffn_up_exps.weight", SL_QTYPE_Q2_K, 3, 5120, 2304, 384},
    {"blk.39.ffn_down_exps.weight", SL_QTYPE_Q3_K, 3, 2304, 5120, 384},
    {"blk.39.ffn_gate_shexp.weight", SL_QTYPE_Q2_K, 2, 5120, 2304, 1},
    {"blk.39.ffn_down_shexp.weight", SL_QTYPE_Q3_K, 2, 2304, 5120, 1},
    {"blk.2.attn_compressor_kv.weight", SL_QTYPE_Q2_K, 2, 5120, 512, 1},
    {"blk.2.attn_compressor_gate.weight", SL_QTYPE_Q2_K, 2, 5120, 512, 1},
    {"blk.2.attn_compressor_norm.weight", SL_QTYPE_F32, 1, 512, 1, 1},
    {"blk.2.indexer.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 1280, 4096, 1},
    {"blk.2.indexer.proj.weight", SL_QTYPE_Q2_K, 2, 5120, 32, 1},
    {"blk.2.indexer.attn_k.weight", SL_QTYPE_Q2_K, 2, 512, 128, 1},
    {"blk.2.indexer.k_norm.weight", SL_QTYPE_F32, 1, 128, 1, 1},
    {"blk.20.attn_compressor_kv.weight", SL_QTYPE_Q2_K, 2, 5120, 512, 1},
    {"blk.20.indexer.attn_k.weight", SL_QTYPE_Q2_K, 2, 512, 128, 1},
    {"blk.24.indexer.attn_q_b.weight", SL_QTYPE_Q2_K, 2, 1280, 4096, 1},
    {"blk.24.indexer.proj.weight", SL_QTYPE_Q2_K, 2, 5120, 32, 1},
    {"blk.1.engram_wkv.weight", SL_QTYPE_Q2_K, 2, 6144, 25600, 1},
    {"blk.14.engram_q.weight", SL_QTYPE_Q2_K, 2, 5120, 4, 1},
    {"blk.14.engram_k.weight", SL_QTYPE_Q2_K, 2, 5120, 4, 1},
    {"blk.14.engram_embd.weight", SL_QTYPE_Q2_K, 2, 256, 384016682, 1},
    {"blk.1.engram_embd.weight", SL_QTYPE_Q2_K, 2, 256, 384006168, 1},
};

Test(synth, v41_layout_literal)
{
    sl_model_config c;
    sl_err err = {0, ""};
    cr_assert_eq(sl_model_config_preset(&c, "bench-L40", &err), 0, "%s", err.msg);
    c.engram_vocab_size = 16000000; /* full-size tables */
    sl_model_config_engram_primes(&c);
    sl_model_tensor *t = NULL;
    uint64_t n = 0;
    cr_assert_eq(sl_model_layout(&c, &t, &n, &err), 0, "%s", err.msg);
    for (size_t i = 0; i < sizeof V41 / sizeof V41[0]; i++) {
        const want_tensor *w = &V41[i];
        const sl_model_tensor *f = NULL;
        for (uint64_t k = 0; k < n && !f; k++)
            if (!strcmp(t[k].name, w->name)) f = &t[k];
        cr_assert(f, "%s missing", w->name);
        cr_expect(f->type == w->type && f->n_dims == w->n_dims && f->ne[0] == w->ne0 &&
                      f->ne[1] == w->ne1 && f->ne[2] == w->ne2,
                  "%s: type %u dims [%" PRIu64 ", %" PRIu64 ", %" PRIu64 "]", w->name, f->type,
                  f->ne[0], f->ne[1], f->ne[2]);
    }
    const char *absent[] = {"blk.20.attn_compressor_gate.weight", "blk.24.indexer.attn_k.weight",
                            "blk.24.attn_compressor_kv.weight",   "blk.25.indexer.proj.weight",
                            "blk.3.attn_compressor_kv.weight",    "blk.2.engram_embd.weight",
                            "blk.36.indexer.k_norm.weight"};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++)
        for (uint64_t k = 0; k < n; k++)
            cr_expect(strcmp(t[k].name, absent[i]), "%s must not exist", absent[i]);
    free(t);
}

Test(synth, roles_of_v41)
{
    sl_model_config c;
    sl_err err = {0, ""};
    cr_assert_eq(sl_model_config_preset(&c, "bench-L40", &err), 0, "%s", err.msg);
    for (uint32_t l = 0; l < 40; l++) {
        sl_model_layer_role r = sl_model_layer_role_of(&c, l);
        uint32_t ratio = l < 2 ? 0 : l < 20 ? 2 : 1;
        int kv = l == 2 || l == 8 || l == 14 || l == 20;
        int idx = kv || l == 24 || l == 28 || l == 32 || l == 36;
        cr_expect_eq(r.ratio, ratio, "layer %u ratio", l);
        cr_expect_eq(r.owns_compressor, kv, "layer %u compressor", l);
        cr_expect_eq(r.owns_gate, kv && l < 20, "layer %u gate", l);
        cr_expect_eq(r.owns_indexer, idx, "layer %u indexer", l);
        cr_expect_eq(r.owns_index_keys, kv, "layer %u index keys", l);
        cr_expect_eq(r.engram, l == 1 ? 0 : l == 14 ? 1 : -1, "layer %u engram", l);
        cr_expect_eq(r.rope_yarn, l >= 2);
        int cand = l == 20                                      ? SL_MODEL_CANDIDATE_SOURCE
                   : (l == 24 || l == 28 || l == 32 || l == 36) ? SL_MODEL_CANDIDATE_CONSUMER
                                                                : SL_MODEL_CANDIDATE_NONE;
        cr_expect_eq(r.candidate, cand, "layer %u candidate role", l);
        int32_t want_kv = l < 2 ? -1 : l < 8 ? 2 : l < 14 ? 8 : l < 20 ? 14 : 20;
        int32_t want_idx = l < 24 ? want_kv : (int32_t)(l / 4 * 4);
        cr_expect_eq(r.kv_source, want_kv, "layer %u kv source", l);
        cr_expect_eq(r.index_source, want_idx, "layer %u index source", l);
    }
}

Test(synth, bad_presets_and_configs)
{
    const char *bad[] = {"nope",      "bench-L0",  "bench-L41", "bench-L", "bench-Lx",
                         "bench-L4x", "bench-L04", "TINY",      ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sl_model_config c;
        sl_err err = {0, ""};
        cr_expect_eq(sl_model_config_preset(&c, bad[i], &err), SL_EINVAL, "preset '%s'", bad[i]);
        cr_expect(strstr(err.msg, "tiny") && strstr(err.msg, "bench-L"),
                  "message lists the presets: %s", err.msg);
    }
    sl_model_config base = tiny_cfg(0), c;
    sl_err err = {0, ""};
    c = base, c.dim = 300;
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "multiple of 256"), "%s", err.msg);
    c = base, c.o_groups = 3;
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL, "heads not divisible by groups");
    c = base, c.n_index_source = 2, c.index_source[1] = 5; /* kv source 4 without index keys */
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "kv source 4"), "%s", err.msg);
    c = base, c.compress_ratio[3] = 1; /* layer 3 has no ratio-1 kv source before it */
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL, "%s", err.msg);
    c = base, c.compress_ratio[5] = 4;
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EUNSUPPORTED);
    c = base, c.kv_source[1] = 2;
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL, "list not ascending");
    c = base, c.engram_prime[1][3] = c.engram_prime[0][3];
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL, "duplicate prime");
    c = base, c.engram_multiplier[0][0] = 4;
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL, "even multiplier");
    c = base, c.candidate_source = 3;
    cr_expect_eq(sl_model_config_validate(&c, &err), SL_EINVAL, "candidate not a kv source");
}

Test(synth, bad_shards_and_dirs)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0);
    sl_err err = {0, ""};
    cr_expect_eq(sl_synth_write(&c, dir, 0, 1, NULL, NULL, NULL, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "shard count"), "%s", err.msg);
    cr_expect_eq(sl_synth_write(&c, dir, 177, 1, NULL, NULL, NULL, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "176 tensors"), "%s", err.msg);
    DIR *d = opendir(dir);
    int files = 0;
    struct dirent *e;
    while ((e = readdir(d))) files += e->d_name[0] != '.';
    closedir(d);
    cr_expect_eq(files, 0, "nothing written on a bad shard count");

    /* an output dir below a regular file cannot be created */
    char file[8192], sub[4096];
    snprintf(file, sizeof file, "%s/plain", dir);
    FILE *f = fopen(file, "w");
    cr_assert(f);
    fclose(f);
    snprintf(sub, sizeof sub, "%s/plain/out", dir);
    cr_expect_eq(sl_synth_write(&c, sub, 1, 1, NULL, NULL, NULL, &err), SL_EIO);
    cr_expect(strstr(err.msg, "plain"), "names the path: %s", err.msg);

    /* nested missing dirs are created (mkdir -p) */
    snprintf(sub, sizeof sub, "%s/a/b/c", dir);
    write_cfg(&c, sub, 1, 1);
    snprintf(file, sizeof file, "%s/sluice-tiny-00001-of-00001.gguf", sub);
    cr_expect_eq(access(file, R_OK), 0);
    /* a rewrite with another shard count replaces the old split */
    write_cfg(&c, sub, 2, 1);
    cr_expect_neq(access(file, F_OK), 0, "stale single-file shard removed");
    sl_gguf_close(&(sl_gguf *){open_first(sub, "sluice-tiny", 2)});
    rm_tree(dir);
    free(dir);
}

typedef struct prog {
    int calls;
    uint64_t last, total;
    int monotone;
} prog;

static void on_prog(void *ctx, const sl_synth_progress *p)
{
    prog *s = ctx;
    if (s->calls == 0) s->monotone = p->done_bytes == 0;
    if (p->done_bytes < s->last) s->monotone = 0;
    s->last = p->done_bytes;
    s->total = p->total_bytes;
    s->calls++;
}

Test(synth, progress_and_stats)
{
    char *dir = make_tmp();
    sl_model_config c = tiny_cfg(0);
    sl_err err = {0, ""};
    prog p = {0, 0, 0, 0};
    sl_synth_stats st;
    cr_assert_eq(sl_synth_write(&c, dir, 2, 5, on_prog, &p, &st, &err), 0, "%s", err.msg);
    cr_expect(p.calls >= 3 && p.monotone, "starts at 0 and grows (%d calls)", p.calls);
    cr_expect_eq(p.last, p.total, "ends at the total");
    cr_expect(st.n_files == 2 && st.n_tensors == 176 && st.total_bytes == p.total);
    char path[4096];
    uint64_t sum = 0;
    for (int i = 1; i <= 2; i++) {
        snprintf(path, sizeof path, "%s/sluice-tiny-%05d-of-00002.gguf", dir, i);
        struct stat sb;
        cr_assert_eq(stat(path, &sb), 0);
        sum += (uint64_t)sb.st_size;
    }
    cr_expect_eq(sum, st.total_bytes, "total is the exact size of the files");
    rm_tree(dir);
    free(dir);
}

/* The CLI: usage errors exit 2 with one line, --help exits 0. */
static int run_cli(const char *args)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s/sluice-synth %s >/dev/null 2>&1", SL_BIN_DIR, args);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(synth, cli)
{
    char bin[4096];
    snprintf(bin, sizeof bin, "%s/sluice-synth", SL_BIN_DIR);
    if (access(bin, X_OK)) cr_skip_test("%s is not built (target sluice-synth)", bin);
    char *dir = make_tmp(), args[4096];
    cr_expect_eq(run_cli("--help"), 0);
    cr_expect_eq(run_cli("--preset tiny"), 2, "missing --out");
    cr_expect_eq(run_cli("--bogus"), 2);
    snprintf(args, sizeof args, "--preset nope --out %s", dir);
    cr_expect_eq(run_cli(args), 2, "bad preset");
    snprintf(args, sizeof args, "--preset tiny --out %s --shards 0", dir);
    cr_expect_eq(run_cli(args), 2, "bad shard count");
    snprintf(args, sizeof args, "--preset tiny --out %s --seed 0x10", dir);
    cr_expect_eq(run_cli(args), 2, "decimal seeds only");
    snprintf(args, sizeof args, "--preset tiny --out %s --shards 999", dir);
    cr_expect_eq(run_cli(args), 2, "more shards than tensors");
    snprintf(args, sizeof args, "--preset tiny --out %s/x --shards 2 --seed 16 --quiet", dir);
    cr_expect_eq(run_cli(args), 0);
    snprintf(bin, sizeof bin, "%s/x/sluice-tiny-00002-of-00002.gguf", dir);
    cr_expect_eq(access(bin, R_OK), 0);
    rm_tree(dir);
    free(dir);
}
