/* synth_model.c - the deepseek41 config: presets, layer roles, tensor layout,
 * validation, and its GGUF metadata in both directions.
 *
 * MODEL.md §1 (roles), §9.1 (tensors) and §9.2 (keys) generalised to any config.
 * Reading and writing of the metadata sit together so that every key is spelled
 * once; docs/gguf-layout.md is their reference. No global state, no I/O beyond
 * reading an already opened sl_gguf.
 */
#include "synth.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

/* ---- tensor kinds ---- */

typedef struct kind_info {
    const char *suffix; /* name after "blk.N." or the full global name */
    int global;
} kind_info;

static const kind_info KINDS[SL_MODEL_TENSOR_COUNT] = {
    [SL_MODEL_TENSOR_TOKEN_EMBD] = {"token_embd.weight", 1},
    [SL_MODEL_TENSOR_ENGRAM_EMBD] = {"engram_embd.weight", 0},
    [SL_MODEL_TENSOR_ENGRAM_WKV] = {"engram_wkv.weight", 0},
    [SL_MODEL_TENSOR_ENGRAM_Q] = {"engram_q.weight", 0},
    [SL_MODEL_TENSOR_ENGRAM_K] = {"engram_k.weight", 0},
    [SL_MODEL_TENSOR_HC_ATTN_FN] = {"hc_attn_fn.weight", 0},
    [SL_MODEL_TENSOR_HC_ATTN_BASE] = {"hc_attn_base.weight", 0},
    [SL_MODEL_TENSOR_HC_ATTN_SCALE] = {"hc_attn_scale.weight", 0},
    [SL_MODEL_TENSOR_ATTN_NORM] = {"attn_norm.weight", 0},
    [SL_MODEL_TENSOR_ATTN_Q_A] = {"attn_q_a.weight", 0},
    [SL_MODEL_TENSOR_ATTN_Q_A_NORM] = {"attn_q_a_norm.weight", 0},
    [SL_MODEL_TENSOR_ATTN_Q_B] = {"attn_q_b.weight", 0},
    [SL_MODEL_TENSOR_ATTN_KV] = {"attn_kv.weight", 0},
    [SL_MODEL_TENSOR_ATTN_KV_A_NORM] = {"attn_kv_a_norm.weight", 0},
    [SL_MODEL_TENSOR_COMPRESSOR_KV] = {"attn_compressor_kv.weight", 0},
    [SL_MODEL_TENSOR_COMPRESSOR_GATE] = {"attn_compressor_gate.weight", 0},
    [SL_MODEL_TENSOR_COMPRESSOR_NORM] = {"attn_compressor_norm.weight", 0},
    [SL_MODEL_TENSOR_INDEXER_K] = {"indexer.attn_k.weight", 0},
    [SL_MODEL_TENSOR_INDEXER_K_NORM] = {"indexer.k_norm.weight", 0},
    [SL_MODEL_TENSOR_INDEXER_Q_B] = {"indexer.attn_q_b.weight", 0},
    [SL_MODEL_TENSOR_INDEXER_PROJ] = {"indexer.proj.weight", 0},
    [SL_MODEL_TENSOR_ATTN_SINKS] = {"attn_sinks.weight", 0},
    [SL_MODEL_TENSOR_ATTN_OUTPUT_A] = {"attn_output_a.weight", 0},
    [SL_MODEL_TENSOR_ATTN_OUTPUT_B] = {"attn_output_b.weight", 0},
    [SL_MODEL_TENSOR_HC_FFN_FN] = {"hc_ffn_fn.weight", 0},
    [SL_MODEL_TENSOR_HC_FFN_BASE] = {"hc_ffn_base.weight", 0},
    [SL_MODEL_TENSOR_HC_FFN_SCALE] = {"hc_ffn_scale.weight", 0},
    [SL_MODEL_TENSOR_FFN_NORM] = {"ffn_norm.weight", 0},
    [SL_MODEL_TENSOR_FFN_GATE_INP] = {"ffn_gate_inp.weight", 0},
    [SL_MODEL_TENSOR_EXP_PROBS_B] = {"exp_probs_b.bias", 0},
    [SL_MODEL_TENSOR_EXP_PROBS_B_VL] = {"exp_probs_b_vl.bias", 0},
    [SL_MODEL_TENSOR_FFN_GATE_EXPS] = {"ffn_gate_exps.weight", 0},
    [SL_MODEL_TENSOR_FFN_UP_EXPS] = {"ffn_up_exps.weight", 0},
    [SL_MODEL_TENSOR_FFN_DOWN_EXPS] = {"ffn_down_exps.weight", 0},
    [SL_MODEL_TENSOR_FFN_GATE_SHEXP] = {"ffn_gate_shexp.weight", 0},
    [SL_MODEL_TENSOR_FFN_UP_SHEXP] = {"ffn_up_shexp.weight", 0},
    [SL_MODEL_TENSOR_FFN_DOWN_SHEXP] = {"ffn_down_shexp.weight", 0},
    [SL_MODEL_TENSOR_OUTPUT_NORM] = {"output_norm.weight", 1},
    [SL_MODEL_TENSOR_OUTPUT] = {"output.weight", 1},
};

void sl_model_tensor_name(char *buf, uint64_t cap, uint32_t kind, uint32_t layer)
{
    SL_ASSERT(kind < SL_MODEL_TENSOR_COUNT && cap > 0);
    if (KINDS[kind].global)
        snprintf(buf, (size_t)cap, "%s", KINDS[kind].suffix);
    else
        snprintf(buf, (size_t)cap, "blk.%" PRIu32 ".%s", layer, KINDS[kind].suffix);
}

/* ---- roles ---- */

static int in_list(const uint32_t *list, uint32_t n, uint32_t l)
{
    for (uint32_t i = 0; i < n; i++)
        if (list[i] == l) return 1;
    return 0;
}

/* max{s in list : s <= l}, or -1. */
static int32_t src_of(const uint32_t *list, uint32_t n, uint32_t l)
{
    int32_t best = -1;
    for (uint32_t i = 0; i < n; i++)
        if (list[i] <= l && (int32_t)list[i] > best) best = (int32_t)list[i];
    return best;
}

sl_model_layer_role sl_model_layer_role_of(const sl_model_config *cfg, uint32_t l)
{
    SL_ASSERT(l < cfg->n_layer && l < SL_MODEL_MAX_LAYER);
    sl_model_layer_role r;
    memset(&r, 0, sizeof r);
    r.ratio = cfg->compress_ratio[l];
    r.kv_source = r.ratio ? src_of(cfg->kv_source, cfg->n_kv_source, l) : -1;
    r.index_source = r.ratio ? src_of(cfg->index_source, cfg->n_index_source, l) : -1;
    r.owns_compressor = in_list(cfg->kv_source, cfg->n_kv_source, l);
    r.owns_gate = r.owns_compressor && r.ratio == 2;
    r.owns_indexer = in_list(cfg->index_source, cfg->n_index_source, l);
    r.owns_index_keys = r.owns_compressor && r.owns_indexer;
    r.candidate = SL_MODEL_CANDIDATE_NONE;
    if (cfg->candidate_source >= 0) {
        if ((int32_t)l == cfg->candidate_source)
            r.candidate = SL_MODEL_CANDIDATE_SOURCE;
        else if (r.owns_indexer && !r.owns_index_keys && r.kv_source == cfg->candidate_source)
            r.candidate = SL_MODEL_CANDIDATE_CONSUMER;
    }
    r.engram = -1;
    for (uint32_t e = 0; e < cfg->n_engram && e < SL_MODEL_MAX_ENGRAM; e++)
        if (cfg->engram_layer[e] == l) r.engram = (int32_t)e;
    r.rope_yarn = r.ratio != 0;
    return r;
}

/* ---- layout ---- */

static uint32_t engram_cols(const sl_model_config *cfg)
{
    return cfg->engram_max_ngram >= 2 ? (cfg->engram_max_ngram - 1) * cfg->engram_n_head : 0;
}

static uint64_t engram_rows(const sl_model_config *cfg, uint32_t e)
{
    uint64_t s = 0;
    for (uint32_t c = 0; c < engram_cols(cfg) && c < SL_MODEL_MAX_ENGRAM_COL; c++)
        s += cfg->engram_prime[e][c];
    return s;
}

/* Type and dims of one kind for one layer. */
static void kind_shape(const sl_model_config *cfg, uint32_t kind, int32_t engram,
                       sl_model_tensor *t)
{
    uint64_t d = cfg->dim, hc = cfg->hc_mult, hc_rows = (2 + hc) * hc;
    uint64_t shared = (uint64_t)cfg->moe_inter * cfg->n_shared;
    uint64_t ne0 = 0, ne1 = 1, ne2 = 1;
    uint32_t nd = 2, type = cfg->type_weight;
    switch ((enum sl_model_tensor_kind)kind) {
    case SL_MODEL_TENSOR_TOKEN_EMBD:
        ne0 = d, ne1 = cfg->vocab;
        break;
    case SL_MODEL_TENSOR_ENGRAM_EMBD:
        ne0 = cfg->engram_head_dim, ne1 = engram >= 0 ? engram_rows(cfg, (uint32_t)engram) : 0;
        type = cfg->type_engram_embd;
        break;
    case SL_MODEL_TENSOR_ENGRAM_WKV:
        ne0 = (uint64_t)engram_cols(cfg) * cfg->engram_head_dim, ne1 = (hc + 1) * d;
        break;
    case SL_MODEL_TENSOR_ENGRAM_Q:
    case SL_MODEL_TENSOR_ENGRAM_K:
        ne0 = d, ne1 = hc;
        break;
    case SL_MODEL_TENSOR_HC_ATTN_FN:
    case SL_MODEL_TENSOR_HC_FFN_FN:
        ne0 = hc * d, ne1 = hc_rows;
        break;
    case SL_MODEL_TENSOR_HC_ATTN_BASE:
    case SL_MODEL_TENSOR_HC_FFN_BASE:
        nd = 1, ne0 = hc_rows, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_HC_ATTN_SCALE:
    case SL_MODEL_TENSOR_HC_FFN_SCALE:
        nd = 1, ne0 = 3, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_ATTN_NORM:
    case SL_MODEL_TENSOR_FFN_NORM:
    case SL_MODEL_TENSOR_OUTPUT_NORM:
        nd = 1, ne0 = d, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_ATTN_Q_A:
        ne0 = d, ne1 = cfg->q_lora;
        break;
    case SL_MODEL_TENSOR_ATTN_Q_A_NORM:
        nd = 1, ne0 = cfg->q_lora, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_ATTN_Q_B:
        ne0 = cfg->q_lora, ne1 = (uint64_t)cfg->n_head * cfg->head_dim;
        break;
    case SL_MODEL_TENSOR_ATTN_KV:
    case SL_MODEL_TENSOR_COMPRESSOR_KV:
    case SL_MODEL_TENSOR_COMPRESSOR_GATE:
        ne0 = d, ne1 = cfg->head_dim;
        break;
    case SL_MODEL_TENSOR_ATTN_KV_A_NORM:
    case SL_MODEL_TENSOR_COMPRESSOR_NORM:
        nd = 1, ne0 = cfg->head_dim, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_INDEXER_K:
        ne0 = cfg->head_dim, ne1 = cfg->index_head_dim;
        break;
    case SL_MODEL_TENSOR_INDEXER_K_NORM:
        nd = 1, ne0 = cfg->index_head_dim, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_INDEXER_Q_B:
        ne0 = cfg->q_lora, ne1 = (uint64_t)cfg->index_n_head * cfg->index_head_dim;
        break;
    case SL_MODEL_TENSOR_INDEXER_PROJ:
        ne0 = d, ne1 = cfg->index_n_head;
        break;
    case SL_MODEL_TENSOR_ATTN_SINKS:
        nd = 1, ne0 = cfg->n_head, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_ATTN_OUTPUT_A:
        ne0 = cfg->o_groups ? (uint64_t)(cfg->n_head / cfg->o_groups) * cfg->head_dim : 0;
        ne1 = (uint64_t)cfg->o_groups * cfg->o_lora;
        break;
    case SL_MODEL_TENSOR_ATTN_OUTPUT_B:
        ne0 = (uint64_t)cfg->o_groups * cfg->o_lora, ne1 = d;
        break;
    case SL_MODEL_TENSOR_FFN_GATE_INP:
        ne0 = d, ne1 = cfg->n_expert, type = cfg->type_router;
        break;
    case SL_MODEL_TENSOR_EXP_PROBS_B:
    case SL_MODEL_TENSOR_EXP_PROBS_B_VL:
        nd = 1, ne0 = cfg->n_expert, type = SL_QTYPE_F32;
        break;
    case SL_MODEL_TENSOR_FFN_GATE_EXPS:
    case SL_MODEL_TENSOR_FFN_UP_EXPS:
        nd = 3, ne0 = d, ne1 = cfg->moe_inter, ne2 = cfg->n_expert;
        break;
    case SL_MODEL_TENSOR_FFN_DOWN_EXPS:
        nd = 3, ne0 = cfg->moe_inter, ne1 = d, ne2 = cfg->n_expert, type = cfg->type_down;
        break;
    case SL_MODEL_TENSOR_FFN_GATE_SHEXP:
    case SL_MODEL_TENSOR_FFN_UP_SHEXP:
        ne0 = d, ne1 = shared;
        break;
    case SL_MODEL_TENSOR_FFN_DOWN_SHEXP:
        ne0 = shared, ne1 = d, type = cfg->type_down;
        break;
    case SL_MODEL_TENSOR_OUTPUT:
        ne0 = d, ne1 = cfg->vocab, type = cfg->type_output;
        break;
    case SL_MODEL_TENSOR_COUNT:
        SL_ASSERT(0 && "bad tensor kind");
    }
    t->kind = kind;
    t->type = type;
    t->n_dims = nd;
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = ne2, t->ne[3] = 1;
    t->n_bytes = sl_qtype_row_bytes(type, ne0) * ne1 * ne2;
}

static int kind_present(uint32_t kind, const sl_model_layer_role *r)
{
    switch (kind) {
    case SL_MODEL_TENSOR_ENGRAM_EMBD:
    case SL_MODEL_TENSOR_ENGRAM_WKV:
    case SL_MODEL_TENSOR_ENGRAM_Q:
    case SL_MODEL_TENSOR_ENGRAM_K:
        return r->engram >= 0;
    case SL_MODEL_TENSOR_COMPRESSOR_KV:
    case SL_MODEL_TENSOR_COMPRESSOR_NORM:
        return r->owns_compressor;
    case SL_MODEL_TENSOR_COMPRESSOR_GATE:
        return r->owns_gate;
    case SL_MODEL_TENSOR_INDEXER_K:
    case SL_MODEL_TENSOR_INDEXER_K_NORM:
        return r->owns_index_keys;
    case SL_MODEL_TENSOR_INDEXER_Q_B:
    case SL_MODEL_TENSOR_INDEXER_PROJ:
        return r->owns_indexer;
    default:
        return 1;
    }
}

static void push(const sl_model_config *cfg, sl_model_tensor *out, uint64_t *n, uint32_t kind,
                 int32_t layer, int32_t engram)
{
    if (out) {
        sl_model_tensor *t = &out[*n];
        memset(t, 0, sizeof *t);
        kind_shape(cfg, kind, engram, t);
        t->layer = layer;
        sl_model_tensor_name(t->name, sizeof t->name, kind, layer < 0 ? 0 : (uint32_t)layer);
    }
    (*n)++;
}

/* The layout without validation; out may be NULL to count. cfg's lists must be in
 * range (checked by validate before any caller relies on the result). */
static uint64_t build_layout(const sl_model_config *cfg, sl_model_tensor *out)
{
    uint64_t n = 0;
    push(cfg, out, &n, SL_MODEL_TENSOR_TOKEN_EMBD, -1, -1);
    for (uint32_t l = 0; l < cfg->n_layer && l < SL_MODEL_MAX_LAYER; l++) {
        sl_model_layer_role r = sl_model_layer_role_of(cfg, l);
        for (uint32_t k = SL_MODEL_TENSOR_ENGRAM_EMBD; k <= SL_MODEL_TENSOR_FFN_DOWN_SHEXP; k++)
            if (kind_present(k, &r)) push(cfg, out, &n, k, (int32_t)l, r.engram);
    }
    push(cfg, out, &n, SL_MODEL_TENSOR_OUTPUT_NORM, -1, -1);
    push(cfg, out, &n, SL_MODEL_TENSOR_OUTPUT, -1, -1);
    return n;
}

/* ---- validation ---- */

static int is_prime_u64(uint64_t v)
{
    if (v < 2) return 0;
    if (v % 2 == 0) return v == 2;
    for (uint64_t d = 3; d <= v / d; d += 2)
        if (v % d == 0) return 0;
    return 1;
}

static int check_list(const uint32_t *list, uint32_t n, uint32_t n_layer, const char *what,
                      sl_err *err)
{
    for (uint32_t i = 0; i < n; i++) {
        if (list[i] >= n_layer)
            return sl_err_set(err, SL_EINVAL,
                              "config: %s[%" PRIu32 "] = %" PRIu32
                              " is not a layer (n_layer %" PRIu32 ")",
                              what, i, list[i], n_layer);
        if (i && list[i] <= list[i - 1])
            return sl_err_set(err, SL_EINVAL,
                              "config: %s is not strictly ascending at [%" PRIu32 "]", what, i);
    }
    return 0;
}

static int check_pos(const char *what, uint64_t v, sl_err *err)
{
    return v ? 0 : sl_err_set(err, SL_EINVAL, "config: %s must be > 0", what);
}

static int check_posf(const char *what, float v, sl_err *err)
{
    return isfinite(v) && v > 0 ? 0
                                : sl_err_set(err, SL_EINVAL,
                                             "config: %s must be finite and > 0 "
                                             "(is %g)",
                                             what, (double)v);
}

static int validate_dims(const sl_model_config *c, sl_err *err)
{
    int rc;
    if (!memchr(c->name, 0, sizeof c->name) || !c->name[0])
        return sl_err_set(err, SL_EINVAL, "config: name is empty or not terminated");
    if (c->n_layer == 0 || c->n_layer > SL_MODEL_MAX_LAYER)
        return sl_err_set(err, SL_EINVAL, "config: n_layer %" PRIu32 " not in 1..%d", c->n_layer,
                          SL_MODEL_MAX_LAYER);
    if ((rc = check_pos("dim", c->dim, err)) || (rc = check_pos("n_head", c->n_head, err)) ||
        (rc = check_pos("q_lora", c->q_lora, err)) ||
        (rc = check_pos("o_groups", c->o_groups, err)) ||
        (rc = check_pos("o_lora", c->o_lora, err)) || (rc = check_pos("window", c->window, err)) ||
        (rc = check_pos("index_n_head", c->index_n_head, err)) ||
        (rc = check_pos("index_topk", c->index_topk, err)) ||
        (rc = check_pos("n_expert", c->n_expert, err)) ||
        (rc = check_pos("n_expert_used", c->n_expert_used, err)) ||
        (rc = check_pos("moe_inter", c->moe_inter, err)) ||
        (rc = check_pos("n_shared", c->n_shared, err)) ||
        (rc = check_pos("hc_mult", c->hc_mult, err)) ||
        (rc = check_pos("hc_sinkhorn_iters", c->hc_sinkhorn_iters, err)) ||
        (rc = check_pos("context_length", c->context_length, err)) ||
        (rc = check_pos("yarn_orig_ctx", c->yarn_orig_ctx, err)))
        return rc;
    if ((rc = check_posf("route_scale", c->route_scale, err)) ||
        (rc = check_posf("gate_temp", c->gate_temp, err)) ||
        (rc = check_posf("swiglu_limit", c->swiglu_limit, err)) ||
        (rc = check_posf("hc_eps", c->hc_eps, err)) ||
        (rc = check_posf("norm_eps", c->norm_eps, err)) ||
        (rc = check_posf("rope_theta", c->rope_theta, err)) ||
        (rc = check_posf("compress_rope_theta", c->compress_rope_theta, err)) ||
        (rc = check_posf("yarn_factor", c->yarn_factor, err)) ||
        (rc = check_posf("yarn_beta_fast", c->yarn_beta_fast, err)) ||
        (rc = check_posf("yarn_beta_slow", c->yarn_beta_slow, err)))
        return rc;
    if (c->vocab < SL_SYNTH_FIRST_MERGE_TOKEN)
        return sl_err_set(err, SL_EINVAL, "config: vocab %" PRIu32 " < %d (3 specials + 256 bytes)",
                          c->vocab, SL_SYNTH_FIRST_MERGE_TOKEN);
    if (c->rope_dim == 0 || c->rope_dim % 2 || c->rope_dim >= c->head_dim ||
        c->rope_dim >= c->index_head_dim)
        return sl_err_set(err, SL_EINVAL,
                          "config: rope_dim %" PRIu32 " must be even, > 0 and "
                          "below head_dim %" PRIu32 " and index_head_dim %" PRIu32,
                          c->rope_dim, c->head_dim, c->index_head_dim);
    if (c->n_head % c->o_groups)
        return sl_err_set(err, SL_EINVAL,
                          "config: n_head %" PRIu32 " is not a multiple of "
                          "o_groups %" PRIu32,
                          c->n_head, c->o_groups);
    if (c->n_expert_used > c->n_expert)
        return sl_err_set(err, SL_EINVAL, "config: n_expert_used %" PRIu32 " > n_expert %" PRIu32,
                          c->n_expert_used, c->n_expert);
    return 0;
}

static int validate_roles(const sl_model_config *c, sl_err *err)
{
    int rc;
    for (uint32_t l = 0; l < c->n_layer; l++)
        if (c->compress_ratio[l] > 2)
            return sl_err_set(err, SL_EUNSUPPORTED,
                              "config: compress_ratio[%" PRIu32 "] = %" PRIu32
                              " (V4.1 has only 0, 1 and 2)",
                              l, c->compress_ratio[l]);
    if (c->n_kv_source > SL_MODEL_MAX_LAYER || c->n_index_source > SL_MODEL_MAX_LAYER)
        return sl_err_set(err, SL_EINVAL, "config: too many source layers");
    if ((rc = check_list(c->kv_source, c->n_kv_source, c->n_layer, "kv_source", err)) ||
        (rc = check_list(c->index_source, c->n_index_source, c->n_layer, "index_source", err)))
        return rc;
    for (uint32_t i = 0; i < c->n_kv_source; i++) {
        uint32_t s = c->kv_source[i];
        if (!c->compress_ratio[s])
            return sl_err_set(err, SL_EINVAL, "config: kv source %" PRIu32 " has ratio 0", s);
        if (!in_list(c->index_source, c->n_index_source, s))
            return sl_err_set(err, SL_EINVAL,
                              "config: kv source %" PRIu32 " is not an index "
                              "source (it owns the index keys)",
                              s);
    }
    for (uint32_t i = 0; i < c->n_index_source; i++)
        if (!c->compress_ratio[c->index_source[i]])
            return sl_err_set(err, SL_EINVAL, "config: index source %" PRIu32 " has ratio 0",
                              c->index_source[i]);
    for (uint32_t l = 0; l < c->n_layer; l++) {
        if (!c->compress_ratio[l]) continue;
        sl_model_layer_role r = sl_model_layer_role_of(c, l);
        if (r.kv_source < 0 || c->compress_ratio[r.kv_source] != c->compress_ratio[l])
            return sl_err_set(err, SL_EINVAL,
                              "config: layer %" PRIu32 " (ratio %" PRIu32
                              ") has no kv source of its ratio at or before it",
                              l, c->compress_ratio[l]);
        if (r.index_source < 0 || c->compress_ratio[r.index_source] != c->compress_ratio[l])
            return sl_err_set(err, SL_EINVAL,
                              "config: layer %" PRIu32 " (ratio %" PRIu32
                              ") has no index source of its ratio at or before it",
                              l, c->compress_ratio[l]);
    }
    if (c->candidate_source >= 0) {
        uint32_t s = (uint32_t)c->candidate_source;
        if (s >= c->n_layer || !in_list(c->kv_source, c->n_kv_source, s))
            return sl_err_set(err, SL_EINVAL,
                              "config: candidate source %" PRId32 " is not a kv source",
                              c->candidate_source);
        if (!c->candidate_block_size || !c->candidate_topk_blocks)
            return sl_err_set(err, SL_EINVAL,
                              "config: candidate block size and top-k blocks "
                              "must be > 0");
    } else if (c->candidate_source != -1) {
        return sl_err_set(err, SL_EINVAL, "config: candidate source %" PRId32 " (use -1 for none)",
                          c->candidate_source);
    }
    return 0;
}

static int validate_engram(const sl_model_config *c, sl_err *err)
{
    int rc;
    if (c->n_engram > SL_MODEL_MAX_ENGRAM)
        return sl_err_set(err, SL_EINVAL, "config: n_engram %" PRIu32 " > %d", c->n_engram,
                          SL_MODEL_MAX_ENGRAM);
    if ((rc = check_list(c->engram_layer, c->n_engram, c->n_layer, "engram_layer", err))) return rc;
    if (c->engram_pad_id >= c->vocab)
        return sl_err_set(err, SL_EINVAL, "config: engram pad id %" PRIu32 " >= vocab",
                          c->engram_pad_id);
    if (!c->n_engram) return 0;
    if (c->engram_max_ngram < 2 || c->engram_max_ngram > SL_MODEL_MAX_NGRAM)
        return sl_err_set(err, SL_EINVAL, "config: engram max n-gram %" PRIu32 " not in 2..%d",
                          c->engram_max_ngram, SL_MODEL_MAX_NGRAM);
    if ((rc = check_pos("engram_n_head", c->engram_n_head, err)) ||
        (rc = check_pos("engram_head_dim", c->engram_head_dim, err)))
        return rc;
    uint32_t cols = engram_cols(c);
    if (cols > SL_MODEL_MAX_ENGRAM_COL)
        return sl_err_set(err, SL_EINVAL, "config: engram columns %" PRIu32 " > %d", cols,
                          SL_MODEL_MAX_ENGRAM_COL);
    for (uint32_t e = 0; e < c->n_engram; e++) {
        uint64_t off = 0;
        for (uint32_t k = 0; k < cols; k++) {
            uint64_t p = c->engram_prime[e][k];
            if (!is_prime_u64(p))
                return sl_err_set(err, SL_EINVAL,
                                  "config: engram prime [%" PRIu32 "][%" PRIu32 "] = %" PRIu64
                                  " is not a prime",
                                  e, k, p);
            for (uint32_t f = 0; f <= e; f++)
                for (uint32_t j = 0; j < (f == e ? k : cols); j++)
                    if (c->engram_prime[f][j] == p)
                        return sl_err_set(err, SL_EINVAL,
                                          "config: engram prime %" PRIu64 " appears twice", p);
            if (c->engram_offset[e][k] != off)
                return sl_err_set(err, SL_EINVAL,
                                  "config: engram offset [%" PRIu32 "][%" PRIu32 "] = %" PRIu64
                                  ", expected %" PRIu64 " (prefix sum)",
                                  e, k, c->engram_offset[e][k], off);
            off += p;
        }
        for (uint32_t i = 0; i < c->engram_max_ngram; i++) {
            uint64_t m = c->engram_multiplier[e][i];
            if (m && (!(m & 1) || m >= (1ull << 47)))
                return sl_err_set(err, SL_EINVAL,
                                  "config: engram multiplier [%" PRIu32 "][%" PRIu32 "] = %" PRIu64
                                  " is not odd and < 2^47",
                                  e, i, m);
        }
    }
    return 0;
}

int sl_model_config_validate(const sl_model_config *cfg, sl_err *err)
{
    int rc;
    if ((rc = validate_dims(cfg, err)) || (rc = validate_roles(cfg, err)) ||
        (rc = validate_engram(cfg, err)))
        return rc;
    const uint32_t types[] = {cfg->type_weight, cfg->type_down, cfg->type_output, cfg->type_router,
                              cfg->type_engram_embd};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!sl_qtype_get(types[i]))
            return sl_err_set(err, SL_EINVAL, "config: tensor type id %" PRIu32 " is unknown",
                              types[i]);
    uint64_t n = build_layout(cfg, NULL);
    sl_model_tensor *t = malloc(n * sizeof *t);
    if (!t) return sl_err_set(err, SL_ENOMEM, "config: layout of %" PRIu64 " tensors", n);
    build_layout(cfg, t);
    rc = 0;
    for (uint64_t i = 0; i < n && !rc; i++) {
        const sl_qtype_info *q = sl_qtype_get(t[i].type);
        if (t[i].ne[0] == 0 || t[i].ne[1] == 0 || t[i].ne[2] == 0)
            rc = sl_err_set(err, SL_EINVAL, "config: tensor %s has an empty dim", t[i].name);
        else if (t[i].ne[0] % q->block_elems)
            rc = sl_err_set(err, SL_EINVAL,
                            "config: tensor %s: ne0 %" PRIu64 " is not a multiple "
                            "of %" PRIu32 " (block of %s)",
                            t[i].name, t[i].ne[0], q->block_elems, q->name);
    }
    free(t);
    return rc;
}

int sl_model_layout(const sl_model_config *cfg, sl_model_tensor **out, uint64_t *n, sl_err *err)
{
    int rc = sl_model_config_validate(cfg, err);
    if (rc) return rc;
    uint64_t count = build_layout(cfg, NULL);
    sl_model_tensor *t = calloc(count, sizeof *t);
    if (!t) return sl_err_set(err, SL_ENOMEM, "layout of %" PRIu64 " tensors", count);
    build_layout(cfg, t);
    *out = t;
    *n = count;
    return 0;
}

uint64_t sl_model_tensor_bytes(const sl_model_config *cfg)
{
    uint64_t n = build_layout(cfg, NULL), sum = 0;
    sl_model_tensor *t = malloc(n * sizeof *t);
    SL_ASSERT(t);
    build_layout(cfg, t);
    for (uint64_t i = 0; i < n; i++) sum += t[i].n_bytes;
    free(t);
    return sum;
}

/* ---- presets ---- */

/* §6.4's search: for each engram layer, for each n-gram size, restart above
 * engram_vocab_size - 1 and take the next n_head primes never handed out before. */
void sl_model_config_engram_primes(sl_model_config *c)
{
    uint32_t cols = engram_cols(c);
    for (uint32_t e = 0; e < c->n_engram; e++) {
        uint64_t off = 0;
        for (uint32_t g = 0; g + 1 < c->engram_max_ngram; g++) {
            uint64_t cur = c->engram_vocab_size - 1;
            for (uint32_t h = 0; h < c->engram_n_head; h++) {
                for (;;) {
                    cur++;
                    if (!is_prime_u64(cur)) continue;
                    int seen = 0;
                    for (uint32_t f = 0; f <= e && !seen; f++)
                        for (uint32_t k = 0; k < (f == e ? g * c->engram_n_head + h : cols); k++)
                            if (c->engram_prime[f][k] == cur) seen = 1;
                    if (!seen) break;
                }
                uint32_t k = g * c->engram_n_head + h;
                c->engram_prime[e][k] = cur;
                c->engram_offset[e][k] = off;
                off += cur;
            }
        }
    }
}

/* The constants every preset shares with V4.1 (§1), at V4.1's real dims. */
static void preset_v41(sl_model_config *c)
{
    memset(c, 0, sizeof *c);
    c->dim = 5120;
    c->vocab = 129280;
    c->context_length = 1048576;
    c->n_head = 64;
    c->head_dim = 512;
    c->rope_dim = 64;
    c->q_lora = 1280;
    c->o_groups = 8;
    c->o_lora = 1024;
    c->window = 128;
    c->index_n_head = 32;
    c->index_head_dim = 128;
    c->index_topk = 512;
    c->n_expert = 384;
    c->n_expert_used = 6;
    c->moe_inter = 2304;
    c->n_shared = 1;
    c->route_scale = 1.5f;
    c->norm_topk_prob = 1;
    c->gate_temp = 1.0f;
    c->swiglu_limit = 10.0f;
    c->hc_mult = 4;
    c->hc_sinkhorn_iters = 20;
    c->hc_eps = 1e-6f;
    c->norm_eps = 1e-20f;
    c->rope_theta = 10000.0f;
    c->compress_rope_theta = 160000.0f;
    c->yarn_orig_ctx = 65536;
    c->yarn_factor = 16.0f;
    c->yarn_beta_fast = 32.0f;
    c->yarn_beta_slow = 1.0f;
    c->candidate_source = -1;
    c->candidate_block_size = 8;
    c->candidate_topk_blocks = 2048;
    c->engram_n_head = 8;
    c->engram_head_dim = 256;
    c->engram_max_ngram = 4;
    c->engram_pad_id = 2;
    c->engram_vocab_size = 16000000;
    c->type_weight = SL_QTYPE_Q2_K;
    c->type_down = SL_QTYPE_Q3_K;
    c->type_output = SL_QTYPE_Q6_K;
    c->type_router = SL_QTYPE_BF16;
    c->type_engram_embd = SL_QTYPE_Q2_K;
    c->quantize_max_values = 1u << 18;
}

static void set_list(uint32_t *dst, uint32_t *n, const uint32_t *src, uint32_t n_src,
                     uint32_t n_layer)
{
    *n = 0;
    for (uint32_t i = 0; i < n_src; i++)
        if (src[i] < n_layer) dst[(*n)++] = src[i];
}

/* §1's roles of layers 0..n-1 of V4.1-Flash. */
static void roles_v41(sl_model_config *c, uint32_t n)
{
    static const uint32_t kv[] = {2, 8, 14, 20};
    static const uint32_t idx[] = {2, 8, 14, 20, 24, 28, 32, 36};
    static const uint32_t engram[] = {1, 14};
    c->n_layer = n;
    for (uint32_t l = 0; l < n; l++) c->compress_ratio[l] = l < 2 ? 0 : l < 20 ? 2 : 1;
    set_list(c->kv_source, &c->n_kv_source, kv, 4, n);
    set_list(c->index_source, &c->n_index_source, idx, 8, n);
    set_list(c->engram_layer, &c->n_engram, engram, 2, n);
    c->candidate_source = n > 20 ? 20 : -1;
}

static void preset_tiny(sl_model_config *c)
{
    static const uint32_t ratios[] = {0, 0, 2, 2, 1, 1};
    preset_v41(c);
    snprintf(c->name, sizeof c->name, "sluice-tiny");
    c->n_layer = 6;
    memcpy(c->compress_ratio, ratios, sizeof ratios);
    c->n_kv_source = 2, c->kv_source[0] = 2, c->kv_source[1] = 4;
    c->n_index_source = 3, c->index_source[0] = 2, c->index_source[1] = 4, c->index_source[2] = 5;
    c->candidate_source = 4;
    c->candidate_block_size = 4; /* keeps 4 * 16 = 64 entries: masks in a 300-token test */
    c->candidate_topk_blocks = 16;
    c->n_engram = 2, c->engram_layer[0] = 1, c->engram_layer[1] = 3;
    c->engram_vocab_size = 300; /* 24 primes of ~300-470, then ~470-650 */
    c->dim = 256;
    c->vocab = 512;
    c->n_head = 4;
    c->head_dim = 256; /* 192 + 64 rope */
    c->q_lora = 256;
    c->o_groups = 2;
    c->o_lora = 128;
    c->index_n_head = 4;
    c->index_head_dim = 128;
    c->index_topk = 32;
    c->n_expert = 16;
    c->moe_inter = 256;
}

static void preset_small(sl_model_config *c)
{
    static const uint32_t ratios[] = {0, 0, 2, 2, 2, 1, 1, 1};
    preset_v41(c);
    snprintf(c->name, sizeof c->name, "sluice-small");
    c->n_layer = 8;
    memcpy(c->compress_ratio, ratios, sizeof ratios);
    c->n_kv_source = 2, c->kv_source[0] = 2, c->kv_source[1] = 5;
    c->n_index_source = 3, c->index_source[0] = 2, c->index_source[1] = 5, c->index_source[2] = 7;
    c->candidate_source = 5;
    c->candidate_block_size = 8; /* keeps 8 * 32 = 256 entries */
    c->candidate_topk_blocks = 32;
    c->n_engram = 2, c->engram_layer[0] = 1, c->engram_layer[1] = 3;
    c->engram_vocab_size = 2000;
    c->dim = 1024;
    c->vocab = 1024;
    c->n_head = 8;
    c->head_dim = 512; /* 448 + 64 rope, as V4.1 */
    c->q_lora = 512;
    c->o_groups = 2;
    c->o_lora = 256;
    c->index_n_head = 8;
    c->index_head_dim = 128;
    c->index_topk = 64;
    c->n_expert = 32;
    c->moe_inter = 512;
}

int sl_model_config_preset(sl_model_config *cfg, const char *preset, sl_err *err)
{
    if (!preset) preset = "";
    if (!strcmp(preset, "tiny")) {
        preset_tiny(cfg);
    } else if (!strcmp(preset, "small")) {
        preset_small(cfg);
    } else if (!strncmp(preset, "bench-L", 7)) {
        const char *s = preset + 7;
        char *end = NULL;
        unsigned long n = strtoul(s, &end, 10);
        if (*s < '1' || *s > '9' || *end || n < 1 || n > 40)
            return sl_err_set(err, SL_EINVAL,
                              "preset '%s': bench-L<n> needs 1 <= n <= 40 "
                              "(presets: %s)",
                              preset, SL_SYNTH_PRESETS);
        preset_v41(cfg);
        snprintf(cfg->name, sizeof cfg->name, "sluice-bench-L%lu", n);
        roles_v41(cfg, (uint32_t)n);
        /* Tables shrunk to ~3 M rows (the per-token cost does not depend on it). */
        cfg->engram_vocab_size = 125000;
        cfg->fast_random_blocks = 1;
    } else {
        return sl_err_set(err, SL_EINVAL, "unknown preset '%s' (presets: %s)", preset,
                          SL_SYNTH_PRESETS);
    }
    sl_model_config_engram_primes(cfg);
    return sl_model_config_validate(cfg, err);
}

/* ---- metadata ---- */

#define K(s) SL_MODEL_ARCH "." s

/* Keys sluice writes and reads (docs/gguf-layout.md). */
#define KEY_BLOCK_COUNT      K("block_count")
#define KEY_CONTEXT          K("context_length")
#define KEY_DIM              K("embedding_length")
#define KEY_VOCAB            K("vocab_size")
#define KEY_HEADS            K("attention.head_count")
#define KEY_HEADS_KV         K("attention.head_count_kv")
#define KEY_KEY_LEN          K("attention.key_length")
#define KEY_VALUE_LEN        K("attention.value_length")
#define KEY_RMS_EPS          K("attention.layer_norm_rms_epsilon")
#define KEY_Q_LORA           K("attention.q_lora_rank")
#define KEY_O_GROUPS         K("attention.output_group_count")
#define KEY_O_LORA           K("attention.output_lora_rank")
#define KEY_WINDOW           K("attention.sliding_window")
#define KEY_RATIOS           K("attention.compress_ratios")
#define KEY_COMPRESS_THETA   K("attention.compress_rope_freq_base")
#define KEY_KV_SOURCES       K("attention.kv_source_layers")
#define KEY_INDEX_SOURCES    K("attention.index_source_layers")
#define KEY_CAND_SOURCE      K("attention.candidate.source_layer")
#define KEY_CAND_BLOCK       K("attention.candidate.block_size")
#define KEY_CAND_TOPK        K("attention.candidate.top_k_blocks")
#define KEY_IDX_HEADS        K("attention.indexer.head_count")
#define KEY_IDX_KEY_LEN      K("attention.indexer.key_length")
#define KEY_IDX_TOPK         K("attention.indexer.top_k")
#define KEY_ROPE_DIM         K("rope.dimension_count")
#define KEY_ROPE_THETA       K("rope.freq_base")
#define KEY_YARN_TYPE        K("rope.scaling.type")
#define KEY_YARN_FACTOR      K("rope.scaling.factor")
#define KEY_YARN_ORIG        K("rope.scaling.original_context_length")
#define KEY_YARN_BETA_FAST   K("rope.scaling.yarn_beta_fast")
#define KEY_YARN_BETA_SLOW   K("rope.scaling.yarn_beta_slow")
#define KEY_N_EXPERT         K("expert_count")
#define KEY_N_EXPERT_USED    K("expert_used_count")
#define KEY_MOE_INTER        K("expert_feed_forward_length")
#define KEY_N_SHARED         K("expert_shared_count")
#define KEY_LEADING_DENSE    K("leading_dense_block_count")
#define KEY_ROUTE_SCALE      K("expert_weights_scale")
#define KEY_ROUTE_NORM       K("expert_weights_norm")
#define KEY_GATING_FUNC      K("expert_gating_func")
#define KEY_SCORE_FUNC       K("expert_score_func")
#define KEY_GATE_TEMP        K("expert_gate_temp")
#define KEY_CLAMP_EXP        K("swiglu_clamp_exp")
#define KEY_CLAMP_SHEXP      K("swiglu_clamp_shexp")
#define KEY_HC_COUNT         K("hyper_connection.count")
#define KEY_HC_ITERS         K("hyper_connection.sinkhorn_iterations")
#define KEY_HC_EPS           K("hyper_connection.epsilon")
#define KEY_HASH_LAYERS      K("hash_layer_count")
#define KEY_ENGRAM_LAYERS    "engram.layer_ids"
#define KEY_ENGRAM_HEADS     "engram.head_count"
#define KEY_ENGRAM_KEY_LEN   "engram.key_length"
#define KEY_ENGRAM_NGRAM     "engram.max_ngram_size"
#define KEY_ENGRAM_MULT      "engram.multipliers"
#define KEY_ENGRAM_PRIMES    "engram.primes"
#define KEY_ENGRAM_OFFSETS   "engram.offsets"
#define KEY_ENGRAM_TOKEN_MAP "engram.token_map"
#define KEY_ENGRAM_PAD       "engram.pad_id"
#define KEY_ENGRAM_CVOCAB    "engram.compressed_vocab_size"
#define KEY_ENGRAM_VOCAB     "engram.vocab_size"

/* The expert_gating_func value sluice writes for sqrtsoftplus (llama.cpp's enum has
 * 1 softmax, 2 sigmoid, 3 softmax_weight; 4 is sluice's choice). */
#define GATING_SQRTSOFTPLUS 4

typedef struct meta_writer {
    sl_gguf_writer *w;
    int rc;
    const char *key; /* first key that failed */
} meta_writer;

static void mw_check(meta_writer *m, const char *key, int rc)
{
    if (!m->rc && rc) m->rc = rc, m->key = key;
}

static void mw_u32(meta_writer *m, const char *key, uint32_t v)
{
    if (!m->rc) mw_check(m, key, sl_gguf_writer_set_u32(m->w, key, v));
}

static void mw_f32(meta_writer *m, const char *key, float v)
{
    if (!m->rc) mw_check(m, key, sl_gguf_writer_set_f32(m->w, key, v));
}

static void mw_arr(meta_writer *m, const char *key, uint32_t type, const void *data, uint64_t n)
{
    if (!m->rc) mw_check(m, key, sl_gguf_writer_set_arr(m->w, key, type, data, n));
}

static void mw_i32_list(meta_writer *m, const char *key, const uint32_t *list, uint32_t n)
{
    int32_t v[SL_MODEL_MAX_LAYER];
    for (uint32_t i = 0; i < n; i++) v[i] = (int32_t)list[i];
    mw_arr(m, key, SL_GGUF_TYPE_INT32, v, n);
}

int sl_model_config_write(const sl_model_config *c, const int32_t *token_map, sl_gguf_writer *w,
                          sl_err *err)
{
    int rc = sl_model_config_validate(c, err);
    if (rc) return rc;
    meta_writer m = {w, 0, NULL};
    mw_check(&m, "general.architecture",
             sl_gguf_writer_set_str(w, "general.architecture", SL_MODEL_ARCH));
    if (!m.rc) mw_check(&m, "general.name", sl_gguf_writer_set_str(w, "general.name", c->name));
    mw_u32(&m, SL_GGUF_KEY_ALIGNMENT, SL_GGUF_DEFAULT_ALIGNMENT);
    mw_u32(&m, "general.file_type", 10); /* llama.cpp LLAMA_FTYPE_MOSTLY_Q2_K */
    mw_u32(&m, "general.quantization_version", 2);

    mw_u32(&m, KEY_BLOCK_COUNT, c->n_layer);
    mw_u32(&m, KEY_CONTEXT, c->context_length);
    mw_u32(&m, KEY_DIM, c->dim);
    mw_u32(&m, KEY_VOCAB, c->vocab);
    mw_u32(&m, KEY_HEADS, c->n_head);
    mw_u32(&m, KEY_HEADS_KV, 1);
    mw_u32(&m, KEY_KEY_LEN, c->head_dim);
    mw_u32(&m, KEY_VALUE_LEN, c->head_dim);
    mw_f32(&m, KEY_RMS_EPS, c->norm_eps);
    mw_u32(&m, KEY_Q_LORA, c->q_lora);
    mw_u32(&m, KEY_O_GROUPS, c->o_groups);
    mw_u32(&m, KEY_O_LORA, c->o_lora);
    mw_u32(&m, KEY_WINDOW, c->window);
    mw_i32_list(&m, KEY_RATIOS, c->compress_ratio, c->n_layer);
    mw_f32(&m, KEY_COMPRESS_THETA, c->compress_rope_theta);
    mw_i32_list(&m, KEY_KV_SOURCES, c->kv_source, c->n_kv_source);
    mw_i32_list(&m, KEY_INDEX_SOURCES, c->index_source, c->n_index_source);
    if (!m.rc)
        mw_check(&m, KEY_CAND_SOURCE,
                 sl_gguf_writer_set_i32(w, KEY_CAND_SOURCE, c->candidate_source));
    mw_u32(&m, KEY_CAND_BLOCK, c->candidate_block_size);
    mw_u32(&m, KEY_CAND_TOPK, c->candidate_topk_blocks);
    mw_u32(&m, KEY_IDX_HEADS, c->index_n_head);
    mw_u32(&m, KEY_IDX_KEY_LEN, c->index_head_dim);
    mw_u32(&m, KEY_IDX_TOPK, c->index_topk);
    mw_u32(&m, KEY_ROPE_DIM, c->rope_dim);
    mw_f32(&m, KEY_ROPE_THETA, c->rope_theta);
    if (!m.rc) mw_check(&m, KEY_YARN_TYPE, sl_gguf_writer_set_str(w, KEY_YARN_TYPE, "yarn"));
    mw_f32(&m, KEY_YARN_FACTOR, c->yarn_factor);
    mw_u32(&m, KEY_YARN_ORIG, c->yarn_orig_ctx);
    mw_f32(&m, KEY_YARN_BETA_FAST, c->yarn_beta_fast);
    mw_f32(&m, KEY_YARN_BETA_SLOW, c->yarn_beta_slow);
    mw_u32(&m, KEY_N_EXPERT, c->n_expert);
    mw_u32(&m, KEY_N_EXPERT_USED, c->n_expert_used);
    mw_u32(&m, KEY_MOE_INTER, c->moe_inter);
    mw_u32(&m, KEY_N_SHARED, c->n_shared);
    mw_u32(&m, KEY_LEADING_DENSE, 0);
    mw_f32(&m, KEY_ROUTE_SCALE, c->route_scale);
    if (!m.rc)
        mw_check(&m, KEY_ROUTE_NORM,
                 sl_gguf_writer_set_bool(w, KEY_ROUTE_NORM, c->norm_topk_prob != 0));
    mw_u32(&m, KEY_GATING_FUNC, GATING_SQRTSOFTPLUS);
    if (!m.rc)
        mw_check(&m, KEY_SCORE_FUNC, sl_gguf_writer_set_str(w, KEY_SCORE_FUNC, "sqrtsoftplus"));
    mw_f32(&m, KEY_GATE_TEMP, c->gate_temp);
    float clamp[SL_MODEL_MAX_LAYER];
    for (uint32_t l = 0; l < c->n_layer; l++) clamp[l] = c->swiglu_limit;
    mw_arr(&m, KEY_CLAMP_EXP, SL_GGUF_TYPE_FLOAT32, clamp, c->n_layer);
    mw_arr(&m, KEY_CLAMP_SHEXP, SL_GGUF_TYPE_FLOAT32, clamp, c->n_layer);
    mw_u32(&m, KEY_HC_COUNT, c->hc_mult);
    mw_u32(&m, KEY_HC_ITERS, c->hc_sinkhorn_iters);
    mw_f32(&m, KEY_HC_EPS, c->hc_eps);
    mw_u32(&m, KEY_HASH_LAYERS, 0);

    /* engram: flattened [layer][...] arrays */
    uint32_t cols = engram_cols(c);
    uint64_t mult[SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_NGRAM];
    uint64_t primes[SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_ENGRAM_COL];
    uint64_t offs[SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_ENGRAM_COL];
    for (uint32_t e = 0; e < c->n_engram; e++) {
        for (uint32_t i = 0; i < c->engram_max_ngram; i++)
            mult[e * c->engram_max_ngram + i] = c->engram_multiplier[e][i];
        for (uint32_t k = 0; k < cols; k++) {
            primes[e * cols + k] = c->engram_prime[e][k];
            offs[e * cols + k] = c->engram_offset[e][k];
        }
    }
    mw_i32_list(&m, K(KEY_ENGRAM_LAYERS), c->engram_layer, c->n_engram);
    mw_u32(&m, K(KEY_ENGRAM_HEADS), c->engram_n_head);
    mw_u32(&m, K(KEY_ENGRAM_KEY_LEN), c->engram_head_dim);
    mw_u32(&m, K(KEY_ENGRAM_NGRAM), c->engram_max_ngram);
    mw_arr(&m, K(KEY_ENGRAM_MULT), SL_GGUF_TYPE_UINT64, mult,
           (uint64_t)c->n_engram * c->engram_max_ngram);
    mw_arr(&m, K(KEY_ENGRAM_PRIMES), SL_GGUF_TYPE_UINT64, primes, (uint64_t)c->n_engram * cols);
    mw_arr(&m, K(KEY_ENGRAM_OFFSETS), SL_GGUF_TYPE_UINT64, offs, (uint64_t)c->n_engram * cols);
    if (token_map) mw_arr(&m, K(KEY_ENGRAM_TOKEN_MAP), SL_GGUF_TYPE_INT32, token_map, c->vocab);
    mw_u32(&m, K(KEY_ENGRAM_PAD), c->engram_pad_id);
    mw_u32(&m, K(KEY_ENGRAM_CVOCAB), c->engram_compressed_vocab);
    if (!m.rc)
        mw_check(&m, K(KEY_ENGRAM_VOCAB),
                 sl_gguf_writer_set_u64(w, K(KEY_ENGRAM_VOCAB), c->engram_vocab_size));
    if (m.rc) return sl_err_set(err, m.rc, "gguf writer: key %s: %s", m.key, sl_status_name(m.rc));
    return 0;
}

/* ---- reading ---- */

/* u32 key: required when def is NULL, else *def when absent. */
static int rd_u32(const sl_gguf *g, const char *key, uint32_t *out, const uint32_t *def,
                  sl_err *err)
{
    int rc = sl_gguf_get_u32(g, key, out, err);
    if (rc == SL_ENOTFOUND && def) {
        *out = *def;
        return 0;
    }
    return rc;
}

static int rd_u32d(const sl_gguf *g, const char *key, uint32_t *out, uint32_t def, sl_err *err)
{
    return rd_u32(g, key, out, &def, err);
}

static int rd_f32d(const sl_gguf *g, const char *key, float *out, float def, sl_err *err)
{
    int rc = sl_gguf_get_f32(g, key, out, err);
    if (rc == SL_ENOTFOUND) {
        *out = def;
        return 0;
    }
    return rc;
}

/* An integer list of at most max entries, each in [0, lim); defaults (filtered to
 * < lim) when absent and def is not NULL. */
static int rd_list(const sl_gguf *g, const char *key, uint32_t *out, uint32_t *n, uint32_t max,
                   uint32_t lim, const uint32_t *def, uint32_t n_def, sl_err *err)
{
    int64_t v[SL_MODEL_MAX_LAYER];
    uint64_t cnt = 0;
    int rc = sl_gguf_get_arr_i64(g, key, v, max < SL_MODEL_MAX_LAYER ? max : SL_MODEL_MAX_LAYER,
                                 &cnt, err);
    if (rc == SL_ENOTFOUND && def) {
        set_list(out, n, def, n_def, lim);
        return 0;
    }
    if (rc) return rc;
    for (uint64_t i = 0; i < cnt; i++) {
        if (v[i] < 0 || v[i] >= (int64_t)lim)
            return sl_err_set(err, SL_EFORMAT,
                              "key %s: entry %" PRIu64 " = %" PRId64 " is not in [0, %" PRIu32 ")",
                              key, i, v[i], lim);
        out[i] = (uint32_t)v[i];
    }
    *n = (uint32_t)cnt;
    return 0;
}

/* A per-layer f32 array whose entries must all be equal; *out gets the value. */
static int rd_uniform_f32(const sl_gguf *g, const char *key, float *out, float def, sl_err *err)
{
    const sl_gguf_kv *kv = sl_gguf_find_kv(g, key);
    if (!kv) {
        *out = def;
        return 0;
    }
    if (kv->type != SL_GGUF_TYPE_ARRAY) return sl_gguf_get_f32(g, key, out, err);
    if (kv->arr_type != SL_GGUF_TYPE_FLOAT32 || kv->arr_n == 0)
        return sl_err_set(err, SL_EFORMAT, "key %s: expected a non-empty f32 array", key);
    const float *a = kv->v.arr;
    for (uint64_t i = 1; i < kv->arr_n; i++)
        if (a[i] != a[0])
            return sl_err_set(err, SL_EUNSUPPORTED,
                              "key %s: per-layer values differ (%g at 0, "
                              "%g at %" PRIu64 "); sluice takes one value",
                              key, (double)a[0], (double)a[i], i);
    *out = a[0];
    return 0;
}

/* Engram keys appear as deepseek41.engram.* (also deepseek4.engram.* in early files). */
static const char *engram_key(const sl_gguf *g, char *buf, size_t cap, const char *suffix)
{
    snprintf(buf, cap, "%s.%s", SL_MODEL_ARCH, suffix);
    if (sl_gguf_find_kv(g, buf)) return buf;
    char alt[128];
    snprintf(alt, sizeof alt, "deepseek4.%s", suffix);
    if (sl_gguf_find_kv(g, alt)) snprintf(buf, cap, "%s", alt);
    return buf;
}

/* §6.4's multipliers of V4.1's engram layers 1 and 14 (compressed vocab 99092). */
static const uint64_t V41_MULT[2][4] = {
    {76632096046245ull, 4839876093313ull, 35959672319349ull, 73987337458391ull},
    {67716810739261ull, 51510806800915ull, 30921347202721ull, 82619226485591ull},
};

static int read_engram(const sl_gguf *g, sl_model_config *c, sl_err *err)
{
    static const uint32_t def_layers[] = {1, 14};
    char key[128];
    int rc;
    if ((rc = rd_list(g, engram_key(g, key, sizeof key, KEY_ENGRAM_LAYERS), c->engram_layer,
                      &c->n_engram, SL_MODEL_MAX_ENGRAM, c->n_layer, def_layers, 2, err)) ||
        (rc = rd_u32d(g, engram_key(g, key, sizeof key, KEY_ENGRAM_HEADS), &c->engram_n_head, 8,
                      err)) ||
        (rc = rd_u32d(g, engram_key(g, key, sizeof key, KEY_ENGRAM_KEY_LEN), &c->engram_head_dim,
                      256, err)) ||
        (rc = rd_u32d(g, engram_key(g, key, sizeof key, KEY_ENGRAM_NGRAM), &c->engram_max_ngram, 4,
                      err)) ||
        (rc =
             rd_u32d(g, engram_key(g, key, sizeof key, KEY_ENGRAM_PAD), &c->engram_pad_id, 2, err)))
        return rc;
    uint64_t u = 16000000;
    rc = sl_gguf_get_u64(g, engram_key(g, key, sizeof key, KEY_ENGRAM_VOCAB), &u, err);
    if (rc && rc != SL_ENOTFOUND) return rc;
    c->engram_vocab_size = u;
    if (c->n_engram == 0) return 0;
    if (c->engram_max_ngram < 2 || c->engram_max_ngram > SL_MODEL_MAX_NGRAM ||
        engram_cols(c) > SL_MODEL_MAX_ENGRAM_COL)
        return sl_err_set(err, SL_EUNSUPPORTED,
                          "engram: max n-gram %" PRIu32 " with %" PRIu32
                          " heads is beyond sluice's limits",
                          c->engram_max_ngram, c->engram_n_head);
    uint32_t cols = engram_cols(c);
    int64_t v[SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_ENGRAM_COL];
    uint64_t n = 0;

    rc = sl_gguf_get_arr_i64(g, engram_key(g, key, sizeof key, KEY_ENGRAM_PRIMES), v,
                             SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_ENGRAM_COL, &n, err);
    if (rc == SL_ENOTFOUND) {
        sl_model_config_engram_primes(c);
    } else if (rc) {
        return rc;
    } else {
        if (n != (uint64_t)c->n_engram * cols)
            return sl_err_set(err, SL_EFORMAT,
                              "key %s: %" PRIu64 " entries, expected %" PRIu32 " layers x %" PRIu32,
                              key, n, c->n_engram, cols);
        for (uint32_t e = 0; e < c->n_engram; e++) {
            uint64_t off = 0;
            for (uint32_t k = 0; k < cols; k++) {
                c->engram_prime[e][k] = (uint64_t)v[e * cols + k];
                c->engram_offset[e][k] = off;
                off += c->engram_prime[e][k];
            }
        }
    }
    /* offsets are implied by the primes; when stored they must agree (validate) */
    rc = sl_gguf_get_arr_i64(g, engram_key(g, key, sizeof key, KEY_ENGRAM_OFFSETS), v,
                             SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_ENGRAM_COL, &n, err);
    if (rc && rc != SL_ENOTFOUND) return rc;
    if (!rc) {
        if (n != (uint64_t)c->n_engram * cols)
            return sl_err_set(err, SL_EFORMAT,
                              "key %s: %" PRIu64 " entries, expected %" PRIu32 " layers x %" PRIu32,
                              key, n, c->n_engram, cols);
        for (uint32_t e = 0; e < c->n_engram; e++)
            for (uint32_t k = 0; k < cols; k++) c->engram_offset[e][k] = (uint64_t)v[e * cols + k];
    }

    rc = sl_gguf_get_arr_i64(g, engram_key(g, key, sizeof key, KEY_ENGRAM_MULT), v,
                             SL_MODEL_MAX_ENGRAM * SL_MODEL_MAX_NGRAM, &n, err);
    if (rc == SL_ENOTFOUND) {
        if (c->n_engram != 2 || c->engram_layer[0] != 1 || c->engram_layer[1] != 14 ||
            c->engram_max_ngram != 4)
            return sl_err_set(err, SL_ENOTFOUND,
                              "key %s is missing and the engram layers are not "
                              "V4.1's (1, 14): no default",
                              key);
        memcpy(c->engram_multiplier[0], V41_MULT[0], sizeof V41_MULT[0]);
        memcpy(c->engram_multiplier[1], V41_MULT[1], sizeof V41_MULT[1]);
    } else if (rc) {
        return rc;
    } else {
        if (n != (uint64_t)c->n_engram * c->engram_max_ngram)
            return sl_err_set(err, SL_EFORMAT,
                              "key %s: %" PRIu64 " entries, expected %" PRIu32 " layers x %" PRIu32,
                              key, n, c->n_engram, c->engram_max_ngram);
        for (uint32_t e = 0; e < c->n_engram; e++)
            for (uint32_t i = 0; i < c->engram_max_ngram; i++)
                c->engram_multiplier[e][i] = (uint64_t)v[e * c->engram_max_ngram + i];
    }
    for (uint32_t e = 0; e < c->n_engram; e++)
        for (uint32_t i = 0; i < c->engram_max_ngram; i++)
            if (!c->engram_multiplier[e][i])
                return sl_err_set(err, SL_EFORMAT,
                                  "key %s: multiplier [%" PRIu32 "][%" PRIu32 "] is 0", key, e, i);
    return 0;
}

/* The compressed vocab size: the key, else max(token_map) + 1, else §1's 99092. */
static int read_cvocab(const sl_gguf *g, sl_model_config *c, sl_err *err)
{
    char key[128];
    int rc = sl_gguf_get_u32(g, engram_key(g, key, sizeof key, KEY_ENGRAM_CVOCAB),
                             &c->engram_compressed_vocab, err);
    if (rc != SL_ENOTFOUND) return rc;
    const sl_gguf_kv *kv = sl_gguf_find_kv(g, engram_key(g, key, sizeof key, KEY_ENGRAM_TOKEN_MAP));
    c->engram_compressed_vocab = 99092;
    if (kv && kv->type == SL_GGUF_TYPE_ARRAY && kv->arr_type == SL_GGUF_TYPE_INT32) {
        const int32_t *a = kv->v.arr;
        int32_t mx = -1;
        for (uint64_t i = 0; i < kv->arr_n; i++)
            if (a[i] > mx) mx = a[i];
        if (mx >= 0) c->engram_compressed_vocab = (uint32_t)mx + 1;
    }
    return 0;
}

int sl_model_config_read(const sl_gguf *g, sl_model_config *cfg, sl_err *err)
{
    static const uint32_t def_kv[] = {2, 8, 14, 20};
    static const uint32_t def_idx[] = {2, 8, 14, 20, 24, 28, 32, 36};
    sl_model_config c;
    const char *s = NULL;
    int rc;
    preset_v41(&c);
    if ((rc = sl_gguf_get_str(g, "general.architecture", &s, err))) return rc;
    if (strcmp(s, SL_MODEL_ARCH))
        return sl_err_set(err, SL_EUNSUPPORTED, "general.architecture is '%s', sluice runs '%s'", s,
                          SL_MODEL_ARCH);
    if (sl_gguf_get_str(g, "general.name", &s, NULL)) s = SL_MODEL_ARCH;
    snprintf(c.name, sizeof c.name, "%s", s[0] ? s : SL_MODEL_ARCH);

    if ((rc = rd_u32(g, KEY_BLOCK_COUNT, &c.n_layer, NULL, err))) return rc;
    if (c.n_layer == 0 || c.n_layer > SL_MODEL_MAX_LAYER)
        return sl_err_set(err, SL_EUNSUPPORTED, "key %s = %" PRIu32 " not in 1..%d",
                          KEY_BLOCK_COUNT, c.n_layer, SL_MODEL_MAX_LAYER);
    const sl_gguf_kv *toks = sl_gguf_find_kv(g, "tokenizer.ggml.tokens");
    uint32_t vocab_def = toks && toks->type == SL_GGUF_TYPE_ARRAY && toks->arr_n <= UINT32_MAX
                             ? (uint32_t)toks->arr_n
                             : 0;
    uint32_t heads_kv = 1, hash_layers = 0, value_len = 0;
    if ((rc = rd_u32(g, KEY_DIM, &c.dim, NULL, err)) ||
        (rc = rd_u32(g, KEY_VOCAB, &c.vocab, vocab_def ? &vocab_def : NULL, err)) ||
        (rc = rd_u32d(g, KEY_CONTEXT, &c.context_length, c.context_length, err)) ||
        (rc = rd_u32(g, KEY_HEADS, &c.n_head, NULL, err)) ||
        (rc = rd_u32d(g, KEY_HEADS_KV, &heads_kv, 1, err)) ||
        (rc = rd_u32(g, KEY_KEY_LEN, &c.head_dim, NULL, err)) ||
        (rc = rd_u32d(g, KEY_VALUE_LEN, &value_len, c.head_dim, err)) ||
        (rc = rd_u32d(g, KEY_ROPE_DIM, &c.rope_dim, c.rope_dim, err)) ||
        (rc = rd_u32(g, KEY_Q_LORA, &c.q_lora, NULL, err)) ||
        (rc = rd_u32d(g, KEY_O_GROUPS, &c.o_groups, c.o_groups, err)) ||
        (rc = rd_u32d(g, KEY_O_LORA, &c.o_lora, c.o_lora, err)) ||
        (rc = rd_u32d(g, KEY_WINDOW, &c.window, c.window, err)) ||
        (rc = rd_u32d(g, KEY_IDX_HEADS, &c.index_n_head, c.index_n_head, err)) ||
        (rc = rd_u32d(g, KEY_IDX_KEY_LEN, &c.index_head_dim, c.index_head_dim, err)) ||
        (rc = rd_u32d(g, KEY_IDX_TOPK, &c.index_topk, c.index_topk, err)) ||
        (rc = rd_u32(g, KEY_N_EXPERT, &c.n_expert, NULL, err)) ||
        (rc = rd_u32(g, KEY_N_EXPERT_USED, &c.n_expert_used, NULL, err)) ||
        (rc = rd_u32(g, KEY_MOE_INTER, &c.moe_inter, NULL, err)) ||
        (rc = rd_u32d(g, KEY_N_SHARED, &c.n_shared, c.n_shared, err)) ||
        (rc = rd_u32d(g, KEY_HC_COUNT, &c.hc_mult, c.hc_mult, err)) ||
        (rc = rd_u32d(g, KEY_HC_ITERS, &c.hc_sinkhorn_iters, c.hc_sinkhorn_iters, err)) ||
        (rc = rd_u32d(g, KEY_YARN_ORIG, &c.yarn_orig_ctx, c.yarn_orig_ctx, err)) ||
        (rc = rd_u32d(g, KEY_HASH_LAYERS, &hash_layers, 0, err)) ||
        (rc = rd_u32d(g, KEY_CAND_BLOCK, &c.candidate_block_size, c.candidate_block_size, err)) ||
        (rc = rd_u32d(g, KEY_CAND_TOPK, &c.candidate_topk_blocks, c.candidate_topk_blocks, err)))
        return rc;
    if (heads_kv != 1 || value_len != c.head_dim || hash_layers != 0)
        return sl_err_set(err, SL_EUNSUPPORTED,
                          "head_count_kv %" PRIu32 ", value_length %" PRIu32
                          ", hash_layer_count %" PRIu32 ": sluice needs 1, key_length and 0",
                          heads_kv, value_len, hash_layers);
    if ((rc = rd_f32d(g, KEY_RMS_EPS, &c.norm_eps, c.norm_eps, err)) ||
        (rc = rd_f32d(g, KEY_COMPRESS_THETA, &c.compress_rope_theta, c.compress_rope_theta, err)) ||
        (rc = rd_f32d(g, KEY_ROPE_THETA, &c.rope_theta, c.rope_theta, err)) ||
        (rc = rd_f32d(g, KEY_YARN_FACTOR, &c.yarn_factor, c.yarn_factor, err)) ||
        (rc = rd_f32d(g, KEY_YARN_BETA_FAST, &c.yarn_beta_fast, c.yarn_beta_fast, err)) ||
        (rc = rd_f32d(g, KEY_YARN_BETA_SLOW, &c.yarn_beta_slow, c.yarn_beta_slow, err)) ||
        (rc = rd_f32d(g, KEY_ROUTE_SCALE, &c.route_scale, c.route_scale, err)) ||
        (rc = rd_f32d(g, KEY_GATE_TEMP, &c.gate_temp, c.gate_temp, err)) ||
        (rc = rd_f32d(g, KEY_HC_EPS, &c.hc_eps, c.hc_eps, err)) ||
        (rc = rd_uniform_f32(g, KEY_CLAMP_EXP, &c.swiglu_limit, c.swiglu_limit, err)))
        return rc;
    float shexp = c.swiglu_limit;
    if ((rc = rd_uniform_f32(g, KEY_CLAMP_SHEXP, &shexp, c.swiglu_limit, err))) return rc;
    if (shexp != c.swiglu_limit)
        return sl_err_set(err, SL_EUNSUPPORTED, "%s (%g) differs from %s (%g)", KEY_CLAMP_SHEXP,
                          (double)shexp, KEY_CLAMP_EXP, (double)c.swiglu_limit);
    rc = sl_gguf_get_bool(g, KEY_ROUTE_NORM, &c.norm_topk_prob, err);
    if (rc == SL_ENOTFOUND)
        c.norm_topk_prob = 1;
    else if (rc)
        return rc;
    if (sl_gguf_get_str(g, KEY_SCORE_FUNC, &s, NULL) == 0 && strcmp(s, "sqrtsoftplus"))
        return sl_err_set(err, SL_EUNSUPPORTED, "%s is '%s', sluice implements sqrtsoftplus",
                          KEY_SCORE_FUNC, s);

    /* per-layer ratios: real files carry n_layer + MTP entries; the first n_layer count */
    int64_t r[SL_MODEL_MAX_LAYER + 8];
    uint64_t nr = 0;
    if ((rc = sl_gguf_get_arr_i64(g, KEY_RATIOS, r, SL_MODEL_MAX_LAYER + 8, &nr, err))) return rc;
    if (nr < c.n_layer)
        return sl_err_set(err, SL_EFORMAT, "key %s: %" PRIu64 " entries for %" PRIu32 " layers",
                          KEY_RATIOS, nr, c.n_layer);
    for (uint32_t l = 0; l < c.n_layer; l++) {
        if (r[l] < 0 || r[l] > 2)
            return sl_err_set(err, SL_EUNSUPPORTED, "key %s: layer %" PRIu32 " has ratio %" PRId64,
                              KEY_RATIOS, l, r[l]);
        c.compress_ratio[l] = (uint32_t)r[l];
    }
    if ((rc = rd_list(g, KEY_KV_SOURCES, c.kv_source, &c.n_kv_source, SL_MODEL_MAX_LAYER, c.n_layer,
                      def_kv, 4, err)) ||
        (rc = rd_list(g, KEY_INDEX_SOURCES, c.index_source, &c.n_index_source, SL_MODEL_MAX_LAYER,
                      c.n_layer, def_idx, 8, err)))
        return rc;
    int64_t cand = c.n_layer > 20 ? 20 : -1;
    rc = sl_gguf_get_i64(g, KEY_CAND_SOURCE, &cand, err);
    if (rc && rc != SL_ENOTFOUND) return rc;
    if (cand < -1 || cand >= (int64_t)c.n_layer)
        return sl_err_set(err, SL_EFORMAT, "key %s = %" PRId64 " is not a layer or -1",
                          KEY_CAND_SOURCE, cand);
    c.candidate_source = (int32_t)cand;
    if ((rc = read_engram(g, &c, err)) || (rc = read_cvocab(g, &c, err))) return rc;
    if ((rc = sl_model_config_validate(&c, err))) {
        sl_err_prefix(err, "checkpoint metadata");
        return rc;
    }
    *cfg = c;
    return 0;
}
