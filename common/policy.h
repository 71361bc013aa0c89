/* policy.h - the eviction policy of a slot cache: the fetcher's host arena (T1) and
 * the compute process's device tier (T0) both use it.
 *
 * The policy only orders slots by recency and picks victims; it knows nothing of
 * experts or bytes. Slots that must not be evicted (readers pinned, a read in
 * flight) are reported by the caller's `busy` callback at victim time, so pins never
 * have to be mirrored here. Not thread-safe: the owner serialises calls.
 *
 * Two policies:
 *  - SL_POLICY_OLDEST_RANDOM (default): a victim drawn at random among the oldest 8%
 *    of the evictable slots. Measured elsewhere on this model as the best policy:
 *    when the working set is just above the capacity, strict LRU evicts exactly the
 *    slot needed next and thrashes, while a random pick among the old keeps some of
 *    the cycle resident.
 *  - SL_POLICY_LRU: the least recently used evictable slot.
 */
#ifndef SL_POLICY_H
#define SL_POLICY_H

#include <stdint.h>

#include "err.h"

enum sl_policy_kind {
    SL_POLICY_OLDEST_RANDOM = 0,
    SL_POLICY_LRU = 1,
};

/* Share of the oldest slots the default policy draws its victim from, in percent. */
#define SL_POLICY_OLDEST_PERCENT 8

typedef struct sl_policy sl_policy;

/* Returns nonzero when slot must not be evicted now. */
typedef int (*sl_policy_busy_fn)(void *ctx, uint32_t slot);

/* All n_slot slots start unused, ordered as oldest (slot 0 first). seed drives the
 * random pick (same seed, same calls: same victims). */
int sl_policy_init(sl_policy **out, enum sl_policy_kind kind, uint32_t n_slot, uint64_t seed,
                   sl_err *err);
void sl_policy_free(sl_policy **p);

/* Marks slot as just used (a hit, or its fill completed). O(1). */
void sl_policy_touch(sl_policy *p, uint32_t slot);

/* Marks slot as empty: it becomes the oldest, the first to be reused. O(1). */
void sl_policy_forget(sl_policy *p, uint32_t slot);

/* Picks a victim among the slots busy() does not refuse, or returns -1 when every
 * slot is busy. Empty slots (never touched, or forgotten) always come first. Does not change the
 * order: the caller touches the slot once it is refilled. O(oldest share of n_slot) calls to busy
 * in the common case. */
int64_t sl_policy_victim(sl_policy *p, sl_policy_busy_fn busy, void *ctx);

/* Name of a policy ("oldest-random", "lru"); parse the same names back. */
const char *sl_policy_name(enum sl_policy_kind kind);
int sl_policy_parse(const char *name, enum sl_policy_kind *out, sl_err *err);

#endif
