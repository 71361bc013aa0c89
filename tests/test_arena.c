/* test_arena.c - the shared-memory arena: creation, mapping, the slot table and
 * the pin/claim protocol between the two sides, stale and live owners. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "arena.h"

static sl_arena_config config(uint64_t fingerprint)
{
    sl_arena_config c = {.fingerprint = fingerprint,
                         .n_layer = 3,
                         .n_expert = 8,
                         .n_slot = 5,
                         .slot_bytes = 3 * 4096,
                         .align = 4096,
                         .part_offset = {0, 4096, 8192},
                         .part_capacity = {4096, 4096, 4096},
                         .lock_memory = 0};
    return c;
}

/* A fingerprint no other test process uses. */
static uint64_t unique_fp(uint64_t k)
{
    return ((uint64_t)getpid() << 20) ^ k ^ 0xabc0000000000000ull;
}

Test(arena, create_map_pin_claim_publish)
{
    sl_err err = {0};
    sl_arena_config cfg = config(unique_fp(1));
    sl_arena *f = NULL, *c = NULL;
    cr_assert_eq(sl_arena_create(&f, &cfg, &err), 0, "%s", err.msg);
    struct stat st;
    cr_assert_eq(fstat(f->fd, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600, "the arena is private to its user");
    cr_assert_eq(sl_arena_map(&c, f->name, cfg.fingerprint, &err), 0, "%s", err.msg);
    cr_assert_eq(c->hdr->epoch, f->hdr->epoch);
    cr_assert_eq(c->hdr->n_slot, 5);
    cr_assert_eq((uintptr_t)c->data % 4096, 0);

    uint32_t slot, gen;
    cr_assert_eq(sl_arena_pin(c, 1, 2, &slot, &gen), 0, "nothing is resident yet");
    /* Fetcher fills slot 3 with (1, 2). */
    cr_assert_eq(sl_arena_claim(f, 3), 1);
    memset(sl_arena_slot_data(f, 3), 0x5a, 3 * 4096);
    uint32_t g = sl_arena_publish(f, 3, 1, 2);
    cr_assert_eq(sl_arena_pin(c, 1, 2, &slot, &gen), 1);
    cr_assert_eq(slot, 3);
    cr_assert_eq(gen, g);
    cr_assert_eq(sl_arena_slot_data(c, 3)[100], 0x5a, "both sides see the same bytes");
    /* A pinned slot cannot be claimed. */
    cr_assert_eq(sl_arena_claim(f, 3), 0);
    cr_assert_eq(sl_arena_pin(c, 1, 2, &slot, &gen), 1, "pins stack");
    sl_arena_unpin(c, 3);
    cr_assert_eq(sl_arena_claim(f, 3), 0);
    sl_arena_unpin(c, 3);
    /* Unpinned: claimable; the table entry is withdrawn and the generation moves. */
    cr_assert_eq(sl_arena_claim(f, 3), 1);
    cr_assert_eq(sl_arena_pin(c, 1, 2, &slot, &gen), 0);
    cr_assert_eq(sl_arena_pin_slot(c, 3, g, 1, 2), 0, "the old generation is gone");
    uint32_t g2 = sl_arena_publish(f, 3, 2, 7);
    cr_assert_neq(g2, g);
    cr_assert_eq(sl_arena_pin_slot(c, 3, g2, 2, 7), 1);
    cr_assert_eq(sl_arena_pin_slot(c, 3, g2, 2, 6), 0, "owner mismatch");
    sl_arena_unpin(c, 3);
    /* A failed read leaves the slot free and unpublished. */
    cr_assert_eq(sl_arena_claim(f, 0), 1);
    sl_arena_abandon(f, 0);
    cr_assert_eq(atomic_load(&f->slots[0].state), SL_SLOT_FREE);
    sl_arena_close(&c);
    char name[SL_ARENA_NAME_MAX];
    strcpy(name, f->name);
    sl_arena_close(&f);
    cr_assert_null(f);
    cr_assert_lt(shm_open(name, O_RDONLY, 0), 0, "the owner unlinks on close");
}

Test(arena, map_checks_fingerprint_and_header)
{
    sl_err err = {0};
    sl_arena_config cfg = config(unique_fp(2));
    sl_arena *f = NULL, *c = NULL;
    cr_assert_eq(sl_arena_create(&f, &cfg, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_arena_map(&c, f->name, cfg.fingerprint + 1, &err), SL_EMISMATCH);
    cr_assert(strstr(err.msg, "serves model"), "%s", err.msg);
    cr_assert_eq(sl_arena_map(&c, "/sluice-no-such-arena", 0, &err), SL_ENOTFOUND);
    cr_assert(strstr(err.msg, "/sluice-no-such-arena"), "%s", err.msg);
    /* Corrupt the magic: refused. */
    f->hdr->magic ^= 1;
    cr_assert_eq(sl_arena_map(&c, f->name, 0, &err), SL_EFORMAT);
    f->hdr->magic ^= 1;
    cr_assert_eq(sl_arena_map(&c, f->name, 0, &err), 0, "%s", err.msg);
    sl_arena_close(&c);
    sl_arena_close(&f);
}

Test(arena, live_owner_refuses_and_dead_owner_is_replaced)
{
    sl_err err = {0};
    sl_arena_config cfg = config(unique_fp(3));
    sl_arena *f = NULL, *g = NULL;
    cr_assert_eq(sl_arena_create(&f, &cfg, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_arena_create(&g, &cfg, &err), SL_EMISMATCH);
    cr_assert(strstr(err.msg, "live fetcher"), "%s", err.msg);
    sl_arena_close(&f);

    /* A child creates the arena and dies without cleaning up. */
    int pipefd[2];
    cr_assert_eq(pipe(pipefd), 0);
    pid_t pid = fork();
    if (pid == 0) {
        sl_arena *a = NULL;
        if (sl_arena_create(&a, &cfg, NULL)) _exit(1);
        char ok = 1;
        if (write(pipefd[1], &ok, 1) != 1) _exit(1);
        pause();
        _exit(0);
    }
    char ok = 0;
    cr_assert_eq(read(pipefd[0], &ok, 1), 1);
    cr_assert_eq(sl_arena_create(&g, &cfg, &err), SL_EMISMATCH, "the child still lives");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cr_assert_eq(sl_arena_create(&g, &cfg, &err), 0, "%s", err.msg);
    cr_assert_eq(g->hdr->fetcher_pid, (uint32_t)getpid());
    sl_arena_close(&g);
    close(pipefd[0]);
    close(pipefd[1]);
}

Test(arena, bad_geometry_is_refused)
{
    sl_err err = {0};
    sl_arena_config cfg = config(unique_fp(4));
    cfg.slot_bytes = 1000;
    sl_arena *f = NULL;
    cr_assert_eq(sl_arena_create(&f, &cfg, &err), SL_EINVAL);
    cr_assert_null(f);
    cr_assert(strstr(err.msg, "bad geometry"), "%s", err.msg);
}

/* Publishes (layer, expert) = (0, s) in slot s, for s < n. */
static void publish_first(sl_arena *f, uint32_t n)
{
    for (uint32_t s = 0; s < n; s++) {
        cr_assert_eq(sl_arena_claim(f, s), 1);
        sl_arena_publish(f, s, 0, s);
    }
}

Test(arena, pins_of_a_dead_process_are_given_back_and_a_live_ones_kept)
{
    sl_err err = {0};
    sl_arena_config cfg = config(unique_fp(7));
    sl_arena *f = NULL, *c = NULL;
    cr_assert_eq(sl_arena_create(&f, &cfg, &err), 0, "%s", err.msg);
    publish_first(f, 4);
    /* This process pins slot 0 twice: its row, counted per slot. */
    cr_assert_eq(sl_arena_map(&c, f->name, cfg.fingerprint, &err), 0, "%s", err.msg);
    uint32_t slot, gen;
    cr_assert_eq(sl_arena_pin(c, 0, 0, &slot, &gen), 1);
    cr_assert_eq(sl_arena_pin(c, 0, 0, &slot, &gen), 1);
    cr_assert_geq(c->pin_row, 0);
    cr_assert_eq(atomic_load(&f->hdr->pin_owner[c->pin_row]), (uint32_t)getpid());
    cr_assert_eq(atomic_load(&c->pins[(uint64_t)c->pin_row * 5 + 0]), 2);
    /* A child pins slots 1-3 and dies without a word. */
    pid_t pid = fork();
    if (pid == 0) {
        sl_arena *m = NULL;
        uint32_t s, g;
        if (sl_arena_map(&m, f->name, cfg.fingerprint, NULL)) _exit(2);
        for (uint32_t e = 1; e < 4; e++)
            if (!sl_arena_pin(m, 0, e, &s, &g)) _exit(3);
        _exit(0);
    }
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
    for (uint32_t s = 1; s < 4; s++) {
        cr_assert_eq(atomic_load(&f->slots[s].readers), 1, "slot %u pinned by the dead child", s);
        cr_assert_eq(sl_arena_claim(f, s), 0);
    }
    cr_assert(sl_arena_live_rows(f), "this process still holds its row");
    cr_assert_eq(sl_arena_reclaim_dead(f), 3, "exactly the dead child's three pins");
    for (uint32_t s = 1; s < 4; s++) cr_assert_eq(atomic_load(&f->slots[s].readers), 0);
    cr_assert_eq(atomic_load(&f->slots[0].readers), 2, "the live process keeps its pins");
    cr_assert_eq(sl_arena_reclaim_dead(f), 0);
    cr_assert_eq(sl_arena_claim(f, 1), 1, "a given-back slot can be reused");
    /* Closing a mapping gives back what it still holds, and its row. */
    int row = c->pin_row;
    sl_arena_unpin(c, 0);
    sl_arena_close(&c);
    cr_assert_eq(atomic_load(&f->slots[0].readers), 0);
    cr_assert_eq(atomic_load(&f->hdr->pin_owner[row]), 0);
    cr_assert_not(sl_arena_live_rows(f));
    sl_arena_close(&f);
}
