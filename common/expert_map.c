/* expert_map.c - the routed-expert slice map and the slot layout.
 *
 * Built once per opened checkpoint; immutable afterwards, so any thread may read
 * it. For each layer the three stacked tensors are looked up, their types, dims and
 * extents checked, and expert e's part is the e-th [out][in] matrix of the stack.
 */
#include "expert_map.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

static const char *const part_tensor[SL_EXPERT_N_PART] = {"ffn_gate_exps", "ffn_up_exps",
                                                          "ffn_down_exps"};

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) & ~(a - 1);
}

sl_slot_layout sl_slot_layout_make(const uint64_t part_bytes[SL_EXPERT_N_PART], uint32_t align)
{
    SL_ASSERT(align >= 32 && (align & (align - 1)) == 0);
    sl_slot_layout l = {.align = align};
    uint64_t at = 0;
    for (int p = 0; p < SL_EXPERT_N_PART; p++) {
        /* A slice starts at a multiple of 32, so at most align-32 bytes of the file
         * precede it inside its window. */
        l.part_offset[p] = at;
        l.part_capacity[p] = align_up(part_bytes[p] + align - 32, align);
        at += l.part_capacity[p];
    }
    l.slot_bytes = at;
    return l;
}

sl_expert_window sl_expert_window_of(const sl_expert_slice *s, uint32_t align)
{
    sl_expert_window w;
    w.offset = s->offset & ~((uint64_t)align - 1);
    w.skip = s->offset - w.offset;
    w.bytes = align_up(s->offset + s->bytes, align) - w.offset;
    return w;
}

const sl_expert_slice *sl_expert_map_slice(const sl_expert_map *m, uint32_t layer, uint32_t expert,
                                           enum sl_expert_part_kind p)
{
    SL_ASSERT(layer < m->n_layer && expert < m->n_expert && (unsigned)p < SL_EXPERT_N_PART);
    return &m->slices[((uint64_t)layer * m->n_expert + expert) * SL_EXPERT_N_PART + p];
}

/* Checks one stacked tensor and returns its per-expert byte size. out_dim/in_dim
 * are the expected [out][in] (0 = take from the tensor and return it). */
static int check_stack(const sl_gguf *g, const sl_gguf_tensor *t, uint32_t n_expert,
                       uint64_t *in_dim, uint64_t *out_dim, uint64_t *bytes, sl_err *err)
{
    const char *shard = g->shards[t->shard].path;
    if (t->n_dims != 3)
        return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' has %u dims, expected 3", shard,
                          t->name.s, t->n_dims);
    if (t->ne[2] != n_expert)
        return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' stacks %llu experts, expected %u",
                          shard, t->name.s, (unsigned long long)t->ne[2], n_expert);
    if ((*in_dim && t->ne[0] != *in_dim) || (*out_dim && t->ne[1] != *out_dim))
        return sl_err_set(
            err, SL_EFORMAT, "%s: tensor '%s' is [%llu, %llu, %u], expected [%llu, %llu, %u]",
            shard, t->name.s, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], n_expert,
            (unsigned long long)*in_dim, (unsigned long long)*out_dim, n_expert);
    if (t->ne[0] > UINT32_MAX || t->ne[1] > UINT32_MAX)
        return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' has dims too large for an expert",
                          shard, t->name.s);
    const sl_qtype_info *qi = sl_qtype_get(t->type);
    uint64_t row = qi ? sl_qtype_row_bytes(t->type, t->ne[0]) : 0;
    if (!row)
        return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' has type %u with no row size", shard,
                          t->name.s, t->type);
    uint64_t per = row * t->ne[1];
    if (per * n_expert != t->n_bytes)
        return sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' holds %llu bytes, expected %llu", shard,
                          t->name.s, (unsigned long long)t->n_bytes,
                          (unsigned long long)(per * n_expert));
    *in_dim = t->ne[0];
    *out_dim = t->ne[1];
    *bytes = per;
    return 0;
}

int sl_expert_map_build(sl_expert_map **out, const sl_gguf *g, uint32_t align, sl_err *err)
{
    *out = NULL;
    if (align < 32 || (align & (align - 1)))
        return sl_err_set(err, SL_EINVAL, "expert map: alignment %u is not a power of two >= 32",
                          align);
    uint32_t n_layer = 0, n_expert = 0;
    int rc = sl_gguf_get_u32(g, "deepseek41.block_count", &n_layer, err);
    if (rc) return rc;
    rc = sl_gguf_get_u32(g, "deepseek41.expert_count", &n_expert, err);
    if (rc) return rc;
    if (n_layer == 0 || n_expert == 0)
        return sl_err_set(err, SL_EFORMAT, "%s: block_count %u / expert_count %u must be > 0",
                          g->shards[0].path, n_layer, n_expert);

    sl_expert_map *m = calloc(1, sizeof *m);
    if (!m) return sl_err_set(err, SL_ENOMEM, "expert map: out of memory");
    m->n_layer = n_layer;
    m->n_expert = n_expert;
    m->slices = calloc((uint64_t)n_layer * n_expert * SL_EXPERT_N_PART, sizeof *m->slices);
    if (!m->slices) {
        rc = sl_err_set(err, SL_ENOMEM, "expert map: out of memory for %u x %u experts", n_layer,
                        n_expert);
        goto fail;
    }

    uint64_t dim = 0, inter = 0;
    for (uint32_t l = 0; l < n_layer; l++) {
        for (int p = 0; p < SL_EXPERT_N_PART; p++) {
            char name[96];
            snprintf(name, sizeof name, "blk.%u.%s.weight", l, part_tensor[p]);
            const sl_gguf_tensor *t = sl_gguf_find_tensor(g, name);
            if (!t) {
                rc = sl_err_set(err, SL_ENOTFOUND, "%s: tensor '%s' is missing", g->shards[0].path,
                                name);
                goto fail;
            }
            /* gate/up are [inter][dim] (ne0 = dim), down is [dim][inter]. */
            uint64_t in = p == SL_EXPERT_DOWN ? inter : dim;
            uint64_t outd = p == SL_EXPERT_DOWN ? dim : inter;
            uint64_t bytes = 0;
            rc = check_stack(g, t, n_expert, &in, &outd, &bytes, err);
            if (rc) goto fail;
            if (p != SL_EXPERT_DOWN) {
                dim = in;
                inter = outd;
            }
            if (l == 0) {
                m->type[p] = t->type;
                m->part_bytes[p] = bytes;
            } else if (t->type != m->type[p]) {
                rc = sl_err_set(err, SL_EFORMAT, "%s: tensor '%s' has type %s, layer 0 has %s",
                                g->shards[t->shard].path, name, sl_qtype_get(t->type)->name,
                                sl_qtype_get(m->type[p])->name);
                goto fail;
            }
            for (uint32_t e = 0; e < n_expert; e++) {
                sl_expert_slice *s =
                    &m->slices[((uint64_t)l * n_expert + e) * SL_EXPERT_N_PART + p];
                s->shard = t->shard;
                s->offset = t->offset + (uint64_t)e * bytes;
                s->bytes = bytes;
            }
        }
    }
    m->dim = (uint32_t)dim;
    m->inter = (uint32_t)inter;
    m->layout = sl_slot_layout_make(m->part_bytes, align);
    *out = m;
    return 0;
fail:
    sl_expert_map_free(&m);
    return rc;
}

void sl_expert_map_free(sl_expert_map **m)
{
    if (!m || !*m) return;
    free((*m)->slices);
    free(*m);
    *m = NULL;
}
