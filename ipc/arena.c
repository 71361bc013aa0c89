/* arena.c - creating, mapping and pinning the shared-memory expert arena.
 *
 * The creator holds an exclusive flock on the shm fd for its whole life: a later
 * fetcher that finds the name taken tries the same lock, and if it gets it the
 * owner is dead and the object is stale (unlinked and replaced). Pid checks would
 * be fooled by pid reuse; the lock dies with its process.
 */
#include "arena.h"

#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

void sl_arena_name(char out[SL_ARENA_NAME_MAX], uint64_t fingerprint)
{
    snprintf(out, SL_ARENA_NAME_MAX, "/sluice-%u-%016" PRIx64, (unsigned)getuid(), fingerprint);
}

/* Offsets of the table, slot records, pin rows and data for a geometry. */
static void layout(uint32_t n_layer, uint32_t n_expert, uint32_t n_slot, uint64_t slot_bytes,
                   uint64_t *table, uint64_t *meta, uint64_t *pins, uint64_t *data, uint64_t *total)
{
    *table = SL_ARENA_HEADER_BYTES;
    *meta = align_up(*table + (uint64_t)n_layer * n_expert * sizeof(uint64_t), 64);
    *pins = align_up(*meta + (uint64_t)n_slot * sizeof(sl_arena_slot), 64);
    *data = align_up(*pins + (uint64_t)SL_ARENA_PIN_ROWS * n_slot * sizeof(uint32_t), 4096);
    *total = *data + (uint64_t)n_slot * slot_bytes;
}

uint64_t sl_arena_bytes(uint32_t n_layer, uint32_t n_expert, uint32_t n_slot, uint64_t slot_bytes)
{
    uint64_t t, m, p, d, total;
    layout(n_layer, n_expert, n_slot, slot_bytes, &t, &m, &p, &d, &total);
    return total;
}

static void attach_views(sl_arena *a)
{
    a->hdr = (sl_arena_header *)a->base;
    a->table = (_Atomic uint64_t *)(a->base + a->hdr->table_offset);
    a->slots = (sl_arena_slot *)(a->base + a->hdr->meta_offset);
    a->pins = (_Atomic uint32_t *)(a->base + a->hdr->pins_offset);
    a->data = a->base + a->hdr->data_offset;
    a->pin_row = -2;
}

static uint64_t new_epoch(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t e = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    return e ^ ((uint64_t)getpid() << 40);
}

/* Opens name O_CREAT|O_EXCL; when taken, replaces it if its owner is dead. */
static int open_exclusive(const char *name, int *fd_out, sl_err *err)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
            if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
                int e = errno;
                close(fd);
                shm_unlink(name);
                return sl_err_errno(err, SL_EIO, e, "flock(arena %s)", name);
            }
            *fd_out = fd;
            return 0;
        }
        if (errno != EEXIST) return sl_err_errno(err, SL_EIO, errno, "shm_open(%s, O_EXCL)", name);
        int old = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
        if (old < 0) {
            if (errno == ENOENT) continue; /* vanished meanwhile: try again */
            return sl_err_errno(err, SL_EIO, errno, "shm_open(%s) of an existing arena", name);
        }
        int live = flock(old, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        uint32_t pid = 0;
        sl_arena_header h;
        if (pread(old, &h, sizeof h, 0) == (ssize_t)sizeof h && h.magic == SL_ARENA_MAGIC)
            pid = atomic_load(&h.fetcher_pid);
        close(old);
        if (live)
            return sl_err_set(err, SL_EMISMATCH,
                              "arena %s is held by a live fetcher (pid %u): another fetcher "
                              "already serves this model",
                              name, pid);
        fprintf(stderr, "sluice: replacing stale arena %s of a dead fetcher (pid %u)\n", name, pid);
        shm_unlink(name);
    }
    return sl_err_set(err, SL_EIO, "shm_open(%s): the name stays taken", name);
}

int sl_arena_create(sl_arena **out, const sl_arena_config *cfg, sl_err *err)
{
    *out = NULL;
    if (!cfg->n_slot || !cfg->n_layer || !cfg->n_expert || !cfg->slot_bytes ||
        cfg->slot_bytes % 4096)
        return sl_err_set(err, SL_EINVAL,
                          "arena: bad geometry (%u slots of %" PRIu64 " bytes, %u x %u experts)",
                          cfg->n_slot, cfg->slot_bytes, cfg->n_layer, cfg->n_expert);
    sl_arena *a = calloc(1, sizeof *a);
    if (!a) return sl_err_set(err, SL_ENOMEM, "arena: out of memory");
    a->fd = -1;
    a->owner = 1;
    sl_arena_name(a->name, cfg->fingerprint);
    uint64_t table, meta, pins, data, total;
    layout(cfg->n_layer, cfg->n_expert, cfg->n_slot, cfg->slot_bytes, &table, &meta, &pins, &data,
           &total);
    int rc = open_exclusive(a->name, &a->fd, err);
    if (rc) {
        a->owner = 0; /* the name is not ours to unlink */
        goto fail;
    }
    if (ftruncate(a->fd, (off_t)total) != 0) {
        rc = sl_err_errno(err, SL_ENOSPACE, errno, "ftruncate(arena %s, %" PRIu64 " bytes)",
                          a->name, total);
        goto fail;
    }
    /* Reserve the pages now (tmpfs would otherwise fail with SIGBUS on first touch). */
    int pe = posix_fallocate(a->fd, 0, (off_t)total);
    if (pe != 0 && pe != EOPNOTSUPP && pe != EINVAL) {
        rc = sl_err_errno(err, SL_ENOSPACE, pe, "posix_fallocate(arena %s, %" PRIu64 " bytes)",
                          a->name, total);
        goto fail;
    }
    a->base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
    if (a->base == MAP_FAILED) {
        a->base = NULL;
        rc = sl_err_errno(err, SL_EIO, errno, "mmap(arena %s, %" PRIu64 " bytes)", a->name, total);
        goto fail;
    }
    a->total_bytes = total;
    if (cfg->lock_memory && mlock(a->base, total) != 0) {
        rc = sl_err_errno(err, SL_ENOSPACE, errno,
                          "mlock(arena %s, %" PRIu64 " bytes) (raise `ulimit -l`, or run "
                          "without locking)",
                          a->name, total);
        goto fail;
    }
    sl_arena_header *h = (sl_arena_header *)a->base;
    memset(h, 0, SL_ARENA_HEADER_BYTES);
    h->magic = SL_ARENA_MAGIC;
    h->layout_version = SL_ARENA_LAYOUT_VERSION;
    h->header_bytes = SL_ARENA_HEADER_BYTES;
    h->epoch = new_epoch();
    h->fingerprint = cfg->fingerprint;
    h->total_bytes = total;
    h->slot_bytes = cfg->slot_bytes;
    h->n_slot = cfg->n_slot;
    h->n_layer = cfg->n_layer;
    h->n_expert = cfg->n_expert;
    h->align = cfg->align;
    memcpy(h->part_offset, cfg->part_offset, sizeof h->part_offset);
    memcpy(h->part_capacity, cfg->part_capacity, sizeof h->part_capacity);
    h->table_offset = table;
    h->meta_offset = meta;
    h->pins_offset = pins;
    h->data_offset = data;
    atomic_store(&h->fetcher_pid, (uint32_t)getpid());
    attach_views(a);
    for (uint64_t i = 0; i < (uint64_t)cfg->n_layer * cfg->n_expert; i++)
        atomic_store_explicit(&a->table[i], 0, memory_order_relaxed);
    memset(a->slots, 0, (uint64_t)cfg->n_slot * sizeof(sl_arena_slot));
    memset((void *)a->pins, 0, (uint64_t)SL_ARENA_PIN_ROWS * cfg->n_slot * sizeof(uint32_t));
    atomic_store_explicit(&h->ready, 1, memory_order_release);
    *out = a;
    return 0;
fail:
    sl_arena_close(&a);
    return rc;
}

int sl_arena_map(sl_arena **out, const char *name, uint64_t fingerprint, sl_err *err)
{
    *out = NULL;
    sl_arena *a = calloc(1, sizeof *a);
    if (!a) return sl_err_set(err, SL_ENOMEM, "arena: out of memory");
    int rc = 0;
    snprintf(a->name, sizeof a->name, "%s", name);
    a->fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (a->fd < 0) {
        rc =
            sl_err_errno(err, errno == ENOENT ? SL_ENOTFOUND : SL_EIO, errno, "shm_open(%s)", name);
        goto fail;
    }
    struct stat st;
    if (fstat(a->fd, &st) != 0) {
        rc = sl_err_errno(err, SL_EIO, errno, "fstat(arena %s)", name);
        goto fail;
    }
    if ((uint64_t)st.st_size < SL_ARENA_HEADER_BYTES) {
        rc = sl_err_set(err, SL_EFORMAT, "arena %s: %lld bytes, smaller than its header", name,
                        (long long)st.st_size);
        goto fail;
    }
    sl_arena_header h;
    if (pread(a->fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
        rc = sl_err_errno(err, SL_EIO, errno, "pread(arena %s header)", name);
        goto fail;
    }
    uint64_t table, meta, pins, data, total;
    if (h.magic != SL_ARENA_MAGIC || h.layout_version != SL_ARENA_LAYOUT_VERSION) {
        rc = sl_err_set(err, SL_EFORMAT, "arena %s: not a sluice arena of layout %d", name,
                        SL_ARENA_LAYOUT_VERSION);
        goto fail;
    }
    if (fingerprint && h.fingerprint != fingerprint) {
        rc = sl_err_set(err, SL_EMISMATCH,
                        "arena %s: serves model %016" PRIx64 ", expected %016" PRIx64, name,
                        h.fingerprint, fingerprint);
        goto fail;
    }
    layout(h.n_layer, h.n_expert, h.n_slot, h.slot_bytes, &table, &meta, &pins, &data, &total);
    if (h.table_offset != table || h.meta_offset != meta || h.pins_offset != pins ||
        h.data_offset != data || h.total_bytes != total || (uint64_t)st.st_size < total) {
        rc = sl_err_set(err, SL_EFORMAT, "arena %s: header geometry does not match its size", name);
        goto fail;
    }
    a->base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
    if (a->base == MAP_FAILED) {
        a->base = NULL;
        rc = sl_err_errno(err, SL_EIO, errno, "mmap(arena %s, %" PRIu64 " bytes)", name, total);
        goto fail;
    }
    a->total_bytes = total;
    attach_views(a);
    *out = a;
    return 0;
fail:
    sl_arena_close(&a);
    return rc;
}

void sl_arena_close(sl_arena **pa)
{
    if (!pa || !*pa) return;
    sl_arena *a = *pa;
    if (a->base && a->pin_row >= 0) {
        /* Pins still held die with this mapping: give them back, then the row. */
        _Atomic uint32_t *row = a->pins + (uint64_t)a->pin_row * a->hdr->n_slot;
        for (uint32_t s = 0; s < a->hdr->n_slot; s++) {
            uint32_t n = atomic_exchange(&row[s], 0);
            if (n) atomic_fetch_sub(&a->slots[s].readers, n);
        }
        atomic_store(&a->hdr->pin_owner[a->pin_row], 0);
    }
    if (a->base) munmap(a->base, a->total_bytes);
    if (a->owner && a->fd >= 0) shm_unlink(a->name);
    if (a->fd >= 0) close(a->fd);
    free(a);
    *pa = NULL;
}

int sl_arena_unlink_name(const char *name)
{
    return shm_unlink(name);
}

/* Takes a free pin row for this process (its pid, by compare-and-swap); none free
 * leaves the pins unattributed (pin_row -1). */
static void claim_row(sl_arena *a)
{
    uint32_t pid = (uint32_t)getpid();
    a->pin_row = -1;
    for (int i = 0; i < SL_ARENA_PIN_ROWS; i++) {
        uint32_t want = 0;
        if (atomic_compare_exchange_strong(&a->hdr->pin_owner[i], &want, pid)) {
            a->pin_row = i;
            return;
        }
    }
}

int sl_arena_pin_slot(sl_arena *a, uint32_t slot, uint32_t generation, uint32_t layer,
                      uint32_t expert)
{
    if (slot >= a->hdr->n_slot) return 0;
    sl_arena_slot *s = &a->slots[slot];
    atomic_fetch_add(&s->readers, 1); /* seq_cst: ordered before the checks below */
    if (atomic_load(&s->generation) == generation && atomic_load(&s->state) == SL_SLOT_READY &&
        atomic_load(&s->layer) == layer && atomic_load(&s->expert) == expert) {
        if (a->pin_row == -2) claim_row(a);
        if (a->pin_row >= 0)
            atomic_fetch_add_explicit(&a->pins[(uint64_t)a->pin_row * a->hdr->n_slot + slot], 1,
                                      memory_order_relaxed);
        return 1;
    }
    atomic_fetch_sub(&s->readers, 1);
    return 0;
}

int sl_arena_pin(sl_arena *a, uint32_t layer, uint32_t expert, uint32_t *slot, uint32_t *generation)
{
    if (layer >= a->hdr->n_layer || expert >= a->hdr->n_expert) return 0;
    uint64_t e = atomic_load_explicit(&a->table[(uint64_t)layer * a->hdr->n_expert + expert],
                                      memory_order_acquire);
    if (!e) return 0;
    uint32_t s = (uint32_t)(e & 0xffffffffu) - 1, g = (uint32_t)(e >> 32);
    if (!sl_arena_pin_slot(a, s, g, layer, expert)) return 0;
    *slot = s;
    *generation = g;
    return 1;
}

void sl_arena_unpin(sl_arena *a, uint32_t slot)
{
    SL_ASSERT(slot < a->hdr->n_slot);
    if (a->pin_row >= 0)
        atomic_fetch_sub_explicit(&a->pins[(uint64_t)a->pin_row * a->hdr->n_slot + slot], 1,
                                  memory_order_relaxed);
    uint32_t before = atomic_fetch_sub(&a->slots[slot].readers, 1);
    SL_ASSERT(before > 0);
}

uint64_t sl_arena_reclaim_dead(sl_arena *a)
{
    uint64_t given = 0;
    for (int i = 0; i < SL_ARENA_PIN_ROWS; i++) {
        uint32_t pid = atomic_load(&a->hdr->pin_owner[i]);
        if (!pid || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        _Atomic uint32_t *row = a->pins + (uint64_t)i * a->hdr->n_slot;
        for (uint32_t s = 0; s < a->hdr->n_slot; s++) {
            uint32_t n = atomic_exchange(&row[s], 0);
            if (n) atomic_fetch_sub(&a->slots[s].readers, n);
            given += n;
        }
        atomic_store(&a->hdr->pin_owner[i], 0);
    }
    return given;
}

int sl_arena_live_rows(sl_arena *a)
{
    for (int i = 0; i < SL_ARENA_PIN_ROWS; i++) {
        uint32_t pid = atomic_load(&a->hdr->pin_owner[i]);
        if (pid && (kill((pid_t)pid, 0) == 0 || errno != ESRCH)) return 1;
    }
    return 0;
}

int sl_arena_claim(sl_arena *a, uint32_t slot)
{
    SL_ASSERT(slot < a->hdr->n_slot);
    sl_arena_slot *s = &a->slots[slot];
    if (atomic_load(&s->readers) != 0) return 0;
    uint32_t old_state = atomic_load(&s->state);
    SL_ASSERT(old_state != SL_SLOT_FILLING);
    _Atomic uint64_t *entry = NULL;
    uint64_t old_entry = 0;
    if (old_state == SL_SLOT_READY) {
        entry = &a->table[(uint64_t)atomic_load(&s->layer) * a->hdr->n_expert +
                          atomic_load(&s->expert)];
        old_entry = atomic_exchange(entry, 0);
    }
    uint32_t gen = atomic_fetch_add(&s->generation, 1);
    atomic_store(&s->state, SL_SLOT_FILLING);
    if (atomic_load(&s->readers) == 0) return 1;
    /* A reader pinned between the first check and the bump and may have seen the
     * old generation: it keeps the slot. Undo. */
    atomic_store(&s->generation, gen);
    atomic_store(&s->state, old_state);
    if (entry) atomic_store(entry, old_entry);
    return 0;
}

uint32_t sl_arena_publish(sl_arena *a, uint32_t slot, uint32_t layer, uint32_t expert)
{
    SL_ASSERT(slot < a->hdr->n_slot && layer < a->hdr->n_layer && expert < a->hdr->n_expert);
    sl_arena_slot *s = &a->slots[slot];
    SL_ASSERT(atomic_load(&s->state) == SL_SLOT_FILLING);
    atomic_store(&s->layer, layer);
    atomic_store(&s->expert, expert);
    uint32_t gen = atomic_load(&s->generation);
    atomic_store_explicit(&s->state, SL_SLOT_READY, memory_order_release);
    atomic_store_explicit(&a->table[(uint64_t)layer * a->hdr->n_expert + expert],
                          sl_arena_entry_pack(slot, gen), memory_order_release);
    return gen;
}

void sl_arena_abandon(sl_arena *a, uint32_t slot)
{
    SL_ASSERT(slot < a->hdr->n_slot);
    SL_ASSERT(atomic_load(&a->slots[slot].state) == SL_SLOT_FILLING);
    atomic_store(&a->slots[slot].state, SL_SLOT_FREE);
}
