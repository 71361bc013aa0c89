/* arena.h - the host expert arena: a POSIX shared-memory object shared by the
 * fetcher (creator, writer of slot bytes and of the slot table) and the compute
 * process (reader, pins slots it reads).
 *
 * Layout (all offsets from the start of the mapping, little-endian, fixed widths):
 *
 *   [0, 4096)                 sl_arena_header
 *   [table_offset, ...)       slot table: n_layer * n_expert entries, one _Atomic
 *                             uint64 each: 0 = not resident, else
 *                             (generation << 32) | (slot + 1)
 *   [meta_offset, ...)        n_slot sl_arena_slot records (64 bytes each)
 *   [pins_offset, ...)        pin rows: SL_ARENA_PIN_ROWS rows of n_slot _Atomic uint32,
 *                             the pins each compute process holds per slot
 *   [data_offset, ...)        n_slot slots of slot_bytes each, 4096-aligned
 *
 * Ownership: the fetcher writes headers, table entries and slot meta; the compute
 * side only changes `readers`. Hits need no message: compute reads the table entry
 * (acquire), pins the slot (readers += 1, sequentially consistent), then re-checks
 * that the slot's generation and owner still match; the fetcher never evicts a slot
 * whose reader count is nonzero, and bumps the generation (then re-checks readers)
 * before it reuses one. Between processes only handles travel (epoch, slot,
 * generation), never pointers.
 *
 * Pins taken from the table are attributed: a compute process claims a pin row (its
 * pid in pin_owner, by compare-and-swap) at its first pin and counts its pins per slot
 * there too, so that the fetcher can give back exactly the pins of a process that died
 * (sl_arena_reclaim_dead) while other compute processes keep theirs.
 */
#ifndef SL_ARENA_H
#define SL_ARENA_H

#include <stdatomic.h>
#include <stdint.h>

#include "err.h"

#define SL_ARENA_MAGIC          0x414e455245434c53ull /* "SLCERENA" */
#define SL_ARENA_LAYOUT_VERSION 2
#define SL_ARENA_PIN_ROWS       16 /* compute processes whose pins are attributed */
#define SL_ARENA_HEADER_BYTES   4096
#define SL_ARENA_NAME_MAX       96

enum sl_arena_slot_state {
    SL_SLOT_FREE = 0,    /* holds nothing */
    SL_SLOT_FILLING = 1, /* a read is in flight; bytes are not valid */
    SL_SLOT_READY = 2,   /* bytes valid for (layer, expert, generation) */
};

typedef struct sl_arena_header {
    uint64_t magic;          /* SL_ARENA_MAGIC */
    uint32_t layout_version; /* SL_ARENA_LAYOUT_VERSION */
    uint32_t header_bytes;   /* SL_ARENA_HEADER_BYTES */
    uint64_t epoch;          /* changes with every fetcher start */
    uint64_t fingerprint;    /* model fingerprint (sl_gguf.fingerprint) */
    uint64_t total_bytes;    /* size of the whole mapping */
    uint64_t slot_bytes;     /* bytes per slot, multiple of 4096 */
    uint32_t n_slot;
    uint32_t n_layer;
    uint32_t n_expert;
    uint32_t align;                                /* part region alignment (4096) */
    uint64_t part_offset[3];                       /* gate, up, down region start inside a slot */
    uint64_t part_capacity[3];                     /* region bytes */
    uint64_t table_offset;                         /* slot table */
    uint64_t meta_offset;                          /* slot records */
    uint64_t data_offset;                          /* slot bytes */
    _Atomic uint32_t fetcher_pid;                  /* pid of the owning fetcher */
    _Atomic uint32_t ready;                        /* 1 once the fetcher finished initialising */
    _Atomic uint64_t heartbeat_ns;                 /* CLOCK_MONOTONIC of the owner's last beat */
    uint64_t pins_offset;                          /* pin rows */
    _Atomic uint32_t pin_owner[SL_ARENA_PIN_ROWS]; /* pid holding each pin row, 0 = free */
} sl_arena_header;

typedef struct sl_arena_slot {
    _Atomic uint32_t readers;    /* pins held by the compute side */
    _Atomic uint32_t state;      /* enum sl_arena_slot_state */
    _Atomic uint32_t generation; /* bumped each time the slot is given to an expert */
    _Atomic uint32_t layer;      /* owner while READY */
    _Atomic uint32_t expert;
    uint32_t pad[11];
} sl_arena_slot;

/* A mapping of the arena, by either side. */
typedef struct sl_arena {
    char name[SL_ARENA_NAME_MAX]; /* shm name, "/sluice-<uid>-<fingerprint>" */
    int fd;                       /* shm fd (the creator holds an exclusive flock) */
    int owner;                    /* 1 in the fetcher that created it */
    uint8_t *base;                /* mapping of total_bytes */
    uint64_t total_bytes;
    sl_arena_header *hdr;
    _Atomic uint64_t *table; /* [n_layer * n_expert] */
    sl_arena_slot *slots;    /* [n_slot] */
    uint8_t *data;           /* [n_slot][slot_bytes] */
    _Atomic uint32_t *pins;  /* [SL_ARENA_PIN_ROWS][n_slot] */
    int pin_row;             /* this process's row: -2 not claimed yet, -1 none free */
} sl_arena;

/* What the creator decides. */
typedef struct sl_arena_config {
    uint64_t fingerprint;
    uint32_t n_layer, n_expert;
    uint32_t n_slot;
    uint64_t slot_bytes;
    uint32_t align;
    uint64_t part_offset[3], part_capacity[3];
    int lock_memory; /* mlock the mapping (refused with a clear message if it fails) */
} sl_arena_config;

/* The per-user, per-model name of the arena. */
void sl_arena_name(char out[SL_ARENA_NAME_MAX], uint64_t fingerprint);

/* Bytes a mapping of n_slot slots needs. */
uint64_t sl_arena_bytes(uint32_t n_layer, uint32_t n_expert, uint32_t n_slot, uint64_t slot_bytes);

/* Fetcher side: creates the shm object (mode 0600, O_EXCL). A stale object left by a
 * dead fetcher (no exclusive lock on it) is unlinked and replaced; one held by a
 * live fetcher is SL_EMISMATCH ("another fetcher serves this model"). The caller
 * owns *out and must sl_arena_close it (which unlinks). */
int sl_arena_create(sl_arena **out, const sl_arena_config *cfg, sl_err *err);

/* Compute side: maps an existing arena by name and checks its header (magic,
 * version, fingerprint when nonzero, sizes). */
int sl_arena_map(sl_arena **out, const char *name, uint64_t fingerprint, sl_err *err);

/* Unmaps; the owner also unlinks the name. Safe on NULL. */
void sl_arena_close(sl_arena **a);

/* Unlinks the name only (async-signal-safe: for the fetcher's signal path). */
int sl_arena_unlink_name(const char *name);

static inline uint8_t *sl_arena_slot_data(const sl_arena *a, uint32_t slot)
{
    return a->data + (uint64_t)slot * a->hdr->slot_bytes;
}

static inline uint64_t sl_arena_entry_pack(uint32_t slot, uint32_t generation)
{
    return ((uint64_t)generation << 32) | (uint64_t)(slot + 1);
}

/* Compute side: pins the slot holding (layer, expert) if it is resident. Returns 1
 * and fills slot/generation on a hit (the caller must sl_arena_unpin later), 0 on a
 * miss. No system call, no lock. */
int sl_arena_pin(sl_arena *a, uint32_t layer, uint32_t expert, uint32_t *slot,
                 uint32_t *generation);

/* Pins a slot the fetcher named in READY, checking it still holds (layer, expert)
 * at that generation. Returns 1 when pinned, 0 when it was evicted meanwhile. */
int sl_arena_pin_slot(sl_arena *a, uint32_t slot, uint32_t generation, uint32_t layer,
                      uint32_t expert);

void sl_arena_unpin(sl_arena *a, uint32_t slot);

/* Fetcher side: gives back the pins of every pin row whose process is gone (its pid no
 * longer exists) and frees those rows. Returns the pins given back. A few system calls
 * (one kill(pid, 0) per claimed row); call it now and then, not per request. */
uint64_t sl_arena_reclaim_dead(sl_arena *a);

/* Fetcher side: whether some pin row is held by a live process. */
int sl_arena_live_rows(sl_arena *a);

/* Fetcher side. Takes a slot for refilling: fails (returns 0) when it has readers;
 * otherwise its table entry is withdrawn, its generation bumped and its state set
 * to FILLING, and 1 is returned. The readers are re-checked after the bump, so a
 * pin that raced in is never overrun (the claim is then undone). */
int sl_arena_claim(sl_arena *a, uint32_t slot);

/* Fetcher side: the slot's bytes now hold (layer, expert): mark it READY and
 * publish it in the slot table (release). Returns the generation published. */
uint32_t sl_arena_publish(sl_arena *a, uint32_t slot, uint32_t layer, uint32_t expert);

/* Fetcher side: a claimed slot whose read failed goes back to FREE. */
void sl_arena_abandon(sl_arena *a, uint32_t slot);

#endif
