/* expert_map.h - where every routed expert's bytes are, and how a slot holds them.
 *
 * Routed experts are stored stacked: blk.N.ffn_{gate,up,down}_exps.weight with the
 * expert index as ne[2], each expert's [out, in] matrix contiguous. The map gives,
 * for layer l and expert e, the (shard, file offset, bytes) of its gate, up and down
 * slices; it is built once from the opened checkpoint with types and dims checked.
 *
 * The slot layout is how one expert sits in a host (T1) or device (T0) slot: each
 * part owns a region starting at a multiple of `align` (4096) inside the slot. A
 * miss reads the aligned window of the file that covers the slice (O_DIRECT needs
 * aligned offsets and lengths; slices are only 32-byte aligned in a GGUF), so the
 * part's first byte sits `skip` bytes into its region; skip = offset mod align is
 * known to both processes from the map, so it is never sent.
 */
#ifndef SL_EXPERT_MAP_H
#define SL_EXPERT_MAP_H

#include <stdint.h>

#include "err.h"
#include "gguf.h"

enum sl_expert_part_kind {
    SL_EXPERT_GATE = 0, /* ffn_gate_exps, [inter][dim] */
    SL_EXPERT_UP = 1,   /* ffn_up_exps, [inter][dim] */
    SL_EXPERT_DOWN = 2, /* ffn_down_exps, [dim][inter] */
    SL_EXPERT_N_PART = 3,
};

#define SL_SLOT_ALIGN 4096

/* One part of one expert in the shard files. */
typedef struct sl_expert_slice {
    uint32_t shard;  /* index into sl_gguf.shards */
    uint64_t offset; /* absolute file offset of the first byte */
    uint64_t bytes;  /* exact bytes of the slice */
} sl_expert_slice;

/* The aligned read that brings one slice into its slot region. */
typedef struct sl_expert_window {
    uint64_t offset; /* file offset, multiple of align */
    uint64_t bytes;  /* multiple of align, covers the slice */
    uint64_t skip;   /* the slice starts this many bytes into the window */
} sl_expert_window;

/* Layout of one slot: identical for every slot of an arena. */
typedef struct sl_slot_layout {
    uint32_t align;                           /* region alignment, a power of two */
    uint64_t part_offset[SL_EXPERT_N_PART];   /* region start inside the slot */
    uint64_t part_capacity[SL_EXPERT_N_PART]; /* region bytes (fits any window) */
    uint64_t slot_bytes;                      /* multiple of align */
} sl_slot_layout;

typedef struct sl_expert_map {
    uint32_t n_layer;                      /* layers with routed experts (blk.0 .. n_layer-1) */
    uint32_t n_expert;                     /* experts per layer */
    uint32_t dim;                          /* model dim (gate/up ne[0], down ne[1]) */
    uint32_t inter;                        /* expert hidden size (gate/up ne[1], down ne[0]) */
    uint32_t type[SL_EXPERT_N_PART];       /* enum sl_qtype of each part */
    uint64_t part_bytes[SL_EXPERT_N_PART]; /* bytes of one expert's part */
    sl_expert_slice *slices;               /* [n_layer][n_expert][SL_EXPERT_N_PART] */
    sl_slot_layout layout;
} sl_expert_map;

/* Builds the map of every blk.N routed expert of g, checking that each stacked
 * tensor exists, is 3-D with ne[2] = n_expert, has consistent dims and a known
 * type, and lies inside its shard. align is the slot alignment (SL_SLOT_ALIGN or
 * the disk's logical block size; a power of two). The caller owns *out. */
int sl_expert_map_build(sl_expert_map **out, const sl_gguf *g, uint32_t align, sl_err *err);
void sl_expert_map_free(sl_expert_map **m);

/* The slice of part p of expert e of layer l (asserts the indices are in range). */
const sl_expert_slice *sl_expert_map_slice(const sl_expert_map *m, uint32_t layer, uint32_t expert,
                                           enum sl_expert_part_kind p);

/* The aligned window covering a slice, for a given alignment. */
sl_expert_window sl_expert_window_of(const sl_expert_slice *s, uint32_t align);

/* Pure layout computation: regions for parts of the given byte sizes, each able to
 * hold any aligned window of such a slice (slice offsets are multiples of 32). */
sl_slot_layout sl_slot_layout_make(const uint64_t part_bytes[SL_EXPERT_N_PART], uint32_t align);

#endif
