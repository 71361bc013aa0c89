/* test_expert_map.c - the routed-expert slice map and the slot layout.
 *
 * The map is checked against the file itself: every expert part is written with a
 * pattern that names (layer, expert, part) in each 32-bit word, so a pread at the
 * offset the map gives must find its own name, and the word before it another. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expert_map.h"
#include "gguf.h"
#include "quant.h"
#include "run_cmd.h"

#define N_LAYER  3
#define N_EXPERT 5
#define DIM      512
#define INTER    256

static char dir[64];

static void setup_dir(void)
{
    strcpy(dir, "/tmp/sl-expert-map-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void teardown_dir(void)
{
    sl_test_rm_rf(dir);
}

/* Writer tensor index -> (layer, part) of the stacks; -1 for filler tensors. */
struct fill_ctx {
    int layer_of[64];
    int part_of[64];
    uint64_t part_bytes[SL_EXPERT_N_PART];
};

static uint32_t tag(uint32_t layer, uint32_t expert, uint32_t part)
{
    return 0x5A000000u | (layer << 16) | (expert << 4) | part;
}

static int fill(void *vctx, uint64_t tensor, uint64_t off, void *buf, uint64_t len, sl_err *err)
{
    (void)err;
    struct fill_ctx *c = vctx;
    uint8_t *b = buf;
    for (uint64_t i = 0; i < len; i++) {
        uint64_t at = off + i;
        uint32_t word;
        if (c->layer_of[tensor] < 0) {
            word = 0xF111F111u;
        } else {
            int p = c->part_of[tensor];
            word =
                tag((uint32_t)c->layer_of[tensor], (uint32_t)(at / c->part_bytes[p]), (uint32_t)p);
        }
        b[i] = (uint8_t)(word >> (8 * (at % 4)));
    }
    return 0;
}

/* Writes a model with N_LAYER layers of stacked experts, odd-sized filler tensors
 * between them so that slices land at unaligned offsets, split over 2 shards. */
static void write_model(struct fill_ctx *c)
{
    sl_err err = {0};
    const uint32_t part_type[3] = {SL_QTYPE_Q2_K, SL_QTYPE_Q2_K, SL_QTYPE_Q3_K};
    c->part_bytes[0] = sl_qtype_row_bytes(SL_QTYPE_Q2_K, DIM) * INTER;
    c->part_bytes[1] = c->part_bytes[0];
    c->part_bytes[2] = sl_qtype_row_bytes(SL_QTYPE_Q3_K, INTER) * DIM;
    for (int shard = 0; shard < 2; shard++) {
        sl_gguf_writer *w = NULL;
        cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0, "%s", err.msg);
        if (shard == 0) {
            sl_gguf_writer_set_str(w, "general.architecture", "deepseek41");
            sl_gguf_writer_set_u32(w, "deepseek41.block_count", N_LAYER);
            sl_gguf_writer_set_u32(w, "deepseek41.expert_count", N_EXPERT);
        }
        sl_gguf_writer_set_u16(w, "split.no", (uint16_t)shard);
        sl_gguf_writer_set_u16(w, "split.count", 2);
        sl_gguf_writer_set_i32(w, "split.tensors.count", N_LAYER * 4);
        int n = 0;
        for (int l = 0; l < N_LAYER; l++) {
            if ((l < 2) != (shard == 0)) continue; /* layers 0,1 in shard 0, 2 in shard 1 */
            char name[64];
            uint64_t ne_f[1] = {32 * (uint64_t)(l + 1) + 32}; /* F32 filler: not 4096-sized */
            snprintf(name, sizeof name, "blk.%d.filler.weight", l);
            cr_assert_geq(sl_gguf_writer_add_tensor(w, name, SL_QTYPE_F32, 1, ne_f, &err), 0, "%s",
                          err.msg);
            c->layer_of[n] = -1;
            n++;
            static const char *const pn[3] = {"gate", "up", "down"};
            for (int p = 0; p < 3; p++) {
                uint64_t ne[3] = {p == 2 ? INTER : DIM, p == 2 ? DIM : INTER, N_EXPERT};
                snprintf(name, sizeof name, "blk.%d.ffn_%s_exps.weight", l, pn[p]);
                cr_assert_geq(sl_gguf_writer_add_tensor(w, name, part_type[p], 3, ne, &err), 0,
                              "%s", err.msg);
                c->layer_of[n] = l;
                c->part_of[n] = p;
                n++;
            }
        }
        char path[128];
        snprintf(path, sizeof path, "%s/m-%05d-of-00002.gguf", dir, shard + 1);
        cr_assert_eq(sl_gguf_writer_write(w, path, fill, c, NULL, NULL, &err), 0, "%s", err.msg);
        sl_gguf_writer_free(&w);
    }
}

Test(expert_map, slices_point_at_their_own_bytes, .init = setup_dir, .fini = teardown_dir)
{
    struct fill_ctx c;
    memset(&c, 0, sizeof c);
    write_model(&c);
    char path[128];
    snprintf(path, sizeof path, "%s/m-00001-of-00002.gguf", dir);
    sl_err err = {0};
    sl_gguf *g = NULL;
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0, "%s", err.msg);
    sl_expert_map *m = NULL;
    cr_assert_eq(sl_expert_map_build(&m, g, SL_SLOT_ALIGN, &err), 0, "%s", err.msg);
    cr_assert_eq(m->n_layer, N_LAYER);
    cr_assert_eq(m->n_expert, N_EXPERT);
    cr_assert_eq(m->dim, DIM);
    cr_assert_eq(m->inter, INTER);
    cr_assert_eq(m->type[SL_EXPERT_GATE], SL_QTYPE_Q2_K);
    cr_assert_eq(m->type[SL_EXPERT_DOWN], SL_QTYPE_Q3_K);
    /* Q2_K: 84 bytes per 256 values; Q3_K: 110. */
    cr_assert_eq(m->part_bytes[SL_EXPERT_GATE], (uint64_t)DIM / 256 * 84 * INTER);
    cr_assert_eq(m->part_bytes[SL_EXPERT_DOWN], (uint64_t)INTER / 256 * 110 * DIM);
    int unaligned = 0;
    for (uint32_t l = 0; l < N_LAYER; l++)
        for (uint32_t e = 0; e < N_EXPERT; e++)
            for (uint32_t p = 0; p < SL_EXPERT_N_PART; p++) {
                const sl_expert_slice *s = sl_expert_map_slice(m, l, e, p);
                cr_assert_eq(s->shard, l < 2 ? 0u : 1u);
                cr_assert_eq(s->bytes, m->part_bytes[p]);
                int fd = g->shards[s->shard].fd;
                uint32_t first, last, before;
                cr_assert_eq(pread(fd, &first, 4, (off_t)s->offset), 4);
                cr_assert_eq(pread(fd, &last, 4, (off_t)(s->offset + s->bytes - 4)), 4);
                cr_assert_eq(pread(fd, &before, 4, (off_t)(s->offset - 4)), 4);
                cr_assert_eq(first, tag(l, e, p), "layer %u expert %u part %u starts wrong", l, e,
                             p);
                cr_assert_eq(last, tag(l, e, p));
                cr_assert_neq(before, tag(l, e, p));
                unaligned += s->offset % SL_SLOT_ALIGN != 0;
                /* The window covers the slice, is aligned, and skip points at it. */
                sl_expert_window w = sl_expert_window_of(s, SL_SLOT_ALIGN);
                cr_assert_eq(w.offset % SL_SLOT_ALIGN, 0);
                cr_assert_eq(w.bytes % SL_SLOT_ALIGN, 0);
                cr_assert_eq(w.offset + w.skip, s->offset);
                cr_assert_geq(w.offset + w.bytes, s->offset + s->bytes);
                cr_assert_leq(w.bytes, m->layout.part_capacity[p]);
            }
    cr_assert_gt(unaligned, 0, "the fillers should leave some slices unaligned");
    sl_expert_map_free(&m);
    cr_assert_null(m);
    sl_gguf_close(&g);
}

Test(expert_map, slot_layout_of_the_real_model)
{
    /* V4.1-Flash: gate/up Q2_K [2304][5120] = 3,870,720 B; down Q3_K [5120][2304] =
     * 5,068,800 B. Each region holds the slice plus up to 4064 bytes in front of it,
     * rounded up to 4096: 946 and 1239 pages. */
    const uint64_t parts[3] = {3870720, 3870720, 5068800};
    sl_slot_layout l = sl_slot_layout_make(parts, 4096);
    cr_assert_eq(l.part_offset[0], 0);
    cr_assert_eq(l.part_capacity[0], 946ull * 4096);
    cr_assert_eq(l.part_offset[1], 946ull * 4096);
    cr_assert_eq(l.part_offset[2], 2 * 946ull * 4096);
    cr_assert_eq(l.part_capacity[2], 1239ull * 4096);
    cr_assert_eq(l.slot_bytes, (2 * 946ull + 1239) * 4096);
}

Test(expert_map, window_of_unaligned_slice)
{
    sl_expert_slice s = {.shard = 0, .offset = 40960 + 32, .bytes = 100};
    sl_expert_window w = sl_expert_window_of(&s, 4096);
    cr_assert_eq(w.offset, 40960);
    cr_assert_eq(w.skip, 32);
    cr_assert_eq(w.bytes, 4096);
    s.offset = 40960 + 4064;
    s.bytes = 64; /* crosses a page */
    w = sl_expert_window_of(&s, 4096);
    cr_assert_eq(w.bytes, 8192);
    cr_assert_eq(w.skip, 4064);
    s.offset = 81920;
    s.bytes = 8192; /* already aligned: no extra bytes */
    w = sl_expert_window_of(&s, 512);
    cr_assert_eq(w.offset, 81920);
    cr_assert_eq(w.skip, 0);
    cr_assert_eq(w.bytes, 8192);
}

Test(expert_map, missing_or_wrong_tensors_are_refused, .init = setup_dir, .fini = teardown_dir)
{
    sl_err err = {0};
    sl_gguf_writer *w = NULL;
    cr_assert_eq(sl_gguf_writer_init(&w, 32, &err), 0);
    sl_gguf_writer_set_u32(w, "deepseek41.block_count", 1);
    sl_gguf_writer_set_u32(w, "deepseek41.expert_count", 4);
    uint64_t ne_gate[3] = {256, 256, 4}, ne_up[3] = {256, 256, 3}; /* up stacks 3, not 4 */
    sl_gguf_writer_add_tensor(w, "blk.0.ffn_gate_exps.weight", SL_QTYPE_Q2_K, 3, ne_gate, &err);
    sl_gguf_writer_add_tensor(w, "blk.0.ffn_up_exps.weight", SL_QTYPE_Q2_K, 3, ne_up, &err);
    char path[128];
    snprintf(path, sizeof path, "%s/bad.gguf", dir);
    struct fill_ctx c;
    memset(&c, 0, sizeof c);
    for (int i = 0; i < 64; i++) c.layer_of[i] = -1;
    cr_assert_eq(sl_gguf_writer_write(w, path, fill, &c, NULL, NULL, &err), 0, "%s", err.msg);
    sl_gguf_writer_free(&w);
    sl_gguf *g = NULL;
    cr_assert_eq(sl_gguf_open(&g, path, &err), 0, "%s", err.msg);
    sl_expert_map *m = NULL;
    cr_assert_eq(sl_expert_map_build(&m, g, 4096, &err), SL_EFORMAT);
    cr_assert(strstr(err.msg, "blk.0.ffn_up_exps.weight") && strstr(err.msg, "stacks 3"), "%s",
              err.msg);
    cr_assert_null(m);
    cr_assert_eq(sl_expert_map_build(&m, g, 1000, &err), SL_EINVAL);
    sl_gguf_close(&g);
}
