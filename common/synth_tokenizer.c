/* synth_tokenizer.c - a small real byte-level BPE tokenizer for synthetic
 * checkpoints, and its engram token map (MODEL.md §6.1).
 *
 * Tokens are spelled as llama.cpp's "gpt2" model expects: every byte is shown
 * through GPT-2's byte-to-unicode table (space is "Ġ"). Ids 0..2 are DeepSeek's
 * specials, 3..258 the 256 bytes in byte order, then one token per merge. Merges
 * are first learned by a plain BPE trainer (most frequent adjacent pair, ties to
 * the smaller id pair, never across pre-tokenizer pieces) on the English text
 * below until every piece is one token (763 merges), then topped up mechanically (an alphabetic
 * token + one lowercase letter, breadth first) to reach any vocabulary size. Every
 * merged token is the concatenation of its two parts and unique in the vocabulary.
 *
 * The token map normalises each token's text (ASCII lowercase, whitespace runs to
 * one space, trimmed; raw spelling when the bytes are not valid UTF-8) and numbers
 * the distinct keys in raw-id order, so ids 0, 1, 2 map to 0, 1, 2. Real files use
 * NFKC + accent stripping as well; the engine only reads the stored map.
 */
#include "synth.h"

#include <stdlib.h>
#include <string.h>

/* Training text, written for sluice. ASCII only. */
static const char CORPUS[] =
    "A sluice is a gate that holds back water and lets it through when the miller "
    "wants it. The water waits in the pond above the mill, still and dark, and when "
    "the gate is lifted it runs down the race, turns the wheel, and leaves the mill "
    "by the tail race to find the river again. The miller does not make the water; "
    "he only decides when it moves and how much of it moves at once. A good miller "
    "knows the pond the way a sailor knows the weather. He watches the level in the "
    "morning and again in the evening, he listens to the wheel, and he can tell from "
    "the sound of the stones whether the grain is too wet or the flow too weak.\n\n"
    "There were thousands of such mills along the rivers of the old country. Most of "
    "them were small: one wheel, one pair of stones, a family that lived upstairs and "
    "worked downstairs. Some were large, with three or four wheels in a row and a "
    "long channel that fed them all from a single weir. In a dry summer the larger "
    "mills had to share the water with the farmers upstream, and the quarrels over "
    "who could open a gate and for how many hours filled the records of the local "
    "courts for centuries. The rules they wrote were simple. Nobody may hold back "
    "the whole river. Every gate must be closed at night. The mill that stands lower "
    "on the stream may ask the mill above it for water, and the mill above must "
    "answer within the day.\n\n"
    "A modern computer has the same problem in a different form. The memory close "
    "to the processor is fast but small, the memory further away is large but slow, "
    "and the disk is larger and slower still. A program that reads its data in the "
    "order it needs it, and asks for the next piece before it has finished with the "
    "current one, keeps the processor busy the way a good miller keeps the wheel "
    "turning. A program that waits for every read to finish before it starts the "
    "next one leaves the wheel standing still while the water trickles in. The art "
    "is in the timing: open the gate early enough that the water arrives when the "
    "wheel is ready for it, but not so early that the pond runs dry.\n\n"
    "Language models are large programs of this kind. Each word they write is "
    "computed from millions or billions of numbers, and only a few of those numbers "
    "are needed for any one word. A mixture of experts divides the numbers into many "
    "groups and chooses, for every word, the handful of groups that matter. The rest "
    "can stay on the disk until they are called. If the choice can be guessed a "
    "little before it is made, the needed groups can be brought closer in time, and "
    "the model runs almost as fast as if everything had been in memory from the "
    "start. If the guess is wrong, nothing is lost except a little work, because the "
    "right group is simply read when it is asked for.\n\n"
    "The numbers themselves are stored in a compact way. Instead of writing each "
    "one in full, the program keeps small blocks of them together with a shared "
    "scale, and every number in the block is written with only two or three bits. "
    "The blocks are read as they are, without unpacking them first, and the arithmetic "
    "happens directly on the packed form. This saves space on the disk, time on the "
    "wire, and room in the memory of the graphics card, which is always the scarcest "
    "of the three. It also means that a single mistake in the layout of a block shows "
    "up as nonsense in the output, so every part of the system is tested against a "
    "slow and simple version of itself that is easy to read and hard to get wrong.\n\n"
    "When the work is done the miller closes the gate, sweeps the floor and writes "
    "the day in his book: how many sacks came in, how many went out, how high the "
    "water stood at noon. Years later somebody reads the book and learns how the "
    "river behaved in a wet spring or a hot August, which is more than the miller "
    "ever meant to tell them. Good records are like that. They answer questions that "
    "nobody thought to ask when they were written, provided they are honest, kept "
    "every day, and written in plain words that anybody can understand.\n";

#define SPACE_G  "\xc4\xa0"     /* "Ġ": byte 0x20 in GPT-2's table */
#define FW_BAR   "\xef\xbd\x9c" /* U+FF5C fullwidth vertical line, in DeepSeek's specials */
#define LOW_LINE "\xe2\x96\x81" /* U+2581 lower one eighth block */

/* ---- growable string pool (offsets stay valid across growth) ---- */

typedef struct pool {
    char *buf;
    size_t len, cap;
} pool;

/* Appends s[0..n) and a NUL; returns the offset or -1 when out of memory. */
static long long pool_add(pool *p, const char *s, size_t n, const char *s2, size_t n2)
{
    size_t need = p->len + n + n2 + 1;
    if (need > p->cap) {
        size_t cap = p->cap ? p->cap : 4096;
        while (cap < need) cap *= 2;
        char *b = realloc(p->buf, cap);
        if (!b) return -1;
        p->buf = b;
        p->cap = cap;
    }
    size_t off = p->len;
    memcpy(p->buf + off, s, n);
    if (n2) memcpy(p->buf + off + n, s2, n2);
    p->buf[off + n + n2] = 0;
    p->len = need;
    return (long long)off;
}

/* ---- hash set of strings (stored elsewhere), by index ---- */

typedef struct strset {
    uint32_t *slot; /* index + 1, 0 = empty */
    uint32_t mask;
} strset;

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static int strset_init(strset *s, uint32_t n_max)
{
    uint32_t cap = 64;
    while (cap < 2 * n_max) cap *= 2;
    s->slot = calloc(cap, sizeof *s->slot);
    s->mask = cap - 1;
    return s->slot ? 0 : SL_ENOMEM;
}

/* Finds s[0..n) among strings get(i); returns its slot (empty or holding it). */
typedef const char *(*str_get_fn)(const void *ctx, uint32_t i, size_t *n);

static uint32_t strset_find(const strset *set, const char *s, size_t n, str_get_fn get,
                            const void *ctx)
{
    uint32_t at = (uint32_t)hash_bytes(s, n) & set->mask;
    for (;;) {
        uint32_t v = set->slot[at];
        if (!v) return at;
        size_t m;
        const char *t = get(ctx, v - 1, &m);
        if (m == n && !memcmp(s, t, n)) return at;
        at = (at + 1) & set->mask;
    }
}

/* ---- GPT-2 byte-to-unicode ---- */

static void byte_table(uint32_t cp[256])
{
    uint32_t extra = 0;
    for (uint32_t b = 0; b < 256; b++) {
        int direct = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        cp[b] = direct ? b : 256 + extra++;
    }
}

static size_t utf8_put(char *dst, uint32_t cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    dst[0] = (char)(0xc0 | (cp >> 6)); /* every code point here is < 0x800 */
    dst[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* ---- builder ---- */

typedef struct builder {
    pool p;
    uint64_t *tok_off; /* [n_vocab] offsets into p */
    uint32_t *tok_len; /* [n_vocab] */
    uint32_t n_tok;
    uint64_t *merge_off; /* [n_vocab] */
    uint32_t n_merge;
    strset set; /* tokens by spelling */
} builder;

static const char *tok_get(const void *ctx, uint32_t i, size_t *n)
{
    const builder *b = ctx;
    *n = b->tok_len[i];
    return b->p.buf + b->tok_off[i];
}

/* Adds a token spelled a + c (c may be empty); 1 if added, 0 if it exists, < 0 on error. */
static int tok_add(builder *b, const char *a, size_t na, const char *c, size_t nc)
{
    char tmp[256];
    if (na + nc > sizeof tmp) return 0; /* never needed: keep tokens short */
    memcpy(tmp, a, na);
    memcpy(tmp + na, c, nc);
    uint32_t at = strset_find(&b->set, tmp, na + nc, tok_get, b);
    if (b->set.slot[at]) return 0;
    long long off = pool_add(&b->p, tmp, na + nc, NULL, 0);
    if (off < 0) return SL_ENOMEM;
    b->tok_off[b->n_tok] = (uint64_t)off;
    b->tok_len[b->n_tok] = (uint32_t)(na + nc);
    b->set.slot[at] = ++b->n_tok;
    return 1;
}

/* Adds the merge of tokens x and y and its token; 1 added, 0 exists, < 0 error. */
static int merge_add(builder *b, uint32_t x, uint32_t y)
{
    char m[256]; /* "x y" */
    size_t na = b->tok_len[x], nc = b->tok_len[y];
    if (na + nc + 1 >= sizeof m) return 0;
    memcpy(m, b->p.buf + b->tok_off[x], na); /* a copy: pool_add may move the buffer */
    m[na] = ' ';
    memcpy(m + na + 1, b->p.buf + b->tok_off[y], nc);
    int rc = tok_add(b, m, na, m + na + 1, nc);
    if (rc <= 0) return rc;
    long long off = pool_add(&b->p, m, na + 1 + nc, NULL, 0);
    if (off < 0) return SL_ENOMEM;
    b->merge_off[b->n_merge++] = (uint64_t)off;
    return 1;
}

/* ---- trainer ---- */

enum { CH_LETTER, CH_DIGIT, CH_SPACE, CH_WS, CH_PUNCT };

static int char_class(unsigned char c)
{
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return CH_LETTER;
    if (c >= 0x80) return CH_LETTER;
    if (c >= '0' && c <= '9') return CH_DIGIT;
    if (c == ' ') return CH_SPACE;
    if (c == '\n' || c == '\r' || c == '\t') return CH_WS;
    return CH_PUNCT;
}

/* Length of the pre-tokenizer piece at s (a simplified deepseek-v3 split: an
 * optional space then letters, 1-3 digits, an optional space then punctuation,
 * whitespace runs that leave a last space to the word after them). */
static size_t piece_len(const char *s, size_t n)
{
    int k = char_class((unsigned char)s[0]);
    size_t i = 1;
    if (k == CH_SPACE && n > 1) {
        int k1 = char_class((unsigned char)s[1]);
        if (k1 == CH_LETTER || k1 == CH_PUNCT) k = k1, i = 2;
    }
    if (k == CH_DIGIT) {
        while (i < n && i < 3 && char_class((unsigned char)s[i]) == CH_DIGIT) i++;
        return i;
    }
    if (k == CH_SPACE || k == CH_WS) {
        while (i < n) {
            int c = char_class((unsigned char)s[i]);
            if (c != CH_SPACE && c != CH_WS) break;
            i++;
        }
        if (i < n && i > 1 && s[i - 1] == ' ') i--;
        return i;
    }
    while (i < n && char_class((unsigned char)s[i]) == k) i++;
    return i;
}

typedef struct words {
    uint32_t n;
    uint32_t *start; /* [n] into ids */
    uint32_t *len;   /* [n] current token count */
    uint32_t *count; /* [n] occurrences */
    uint32_t *ids;   /* token ids of every unique piece */
} words;

typedef struct piece_ctx {
    const char *text;
    const uint32_t *off, *len;
} piece_ctx;

static const char *piece_get(const void *ctx, uint32_t i, size_t *n)
{
    const piece_ctx *p = ctx;
    *n = p->len[i];
    return p->text + p->off[i];
}

static void words_free(words *w)
{
    free(w->start), free(w->len), free(w->count), free(w->ids);
}

/* Splits the corpus into unique pieces with counts, as byte token ids. */
static int words_build(words *w, const char *text, size_t n)
{
    memset(w, 0, sizeof *w);
    uint32_t *off = malloc(n * sizeof *off), *len = malloc(n * sizeof *len);
    w->start = malloc(n * sizeof *w->start);
    w->len = malloc(n * sizeof *w->len);
    w->count = malloc(n * sizeof *w->count);
    w->ids = malloc(n * sizeof *w->ids);
    strset set = {0};
    int rc = SL_ENOMEM;
    if (!off || !len || !w->start || !w->len || !w->count || !w->ids || strset_init(&set, n))
        goto out;
    piece_ctx pc = {text, off, len};
    uint32_t n_ids = 0;
    for (size_t i = 0; i < n;) {
        size_t m = piece_len(text + i, n - i);
        uint32_t at = strset_find(&set, text + i, m, piece_get, &pc);
        if (set.slot[at]) {
            w->count[set.slot[at] - 1]++;
        } else {
            uint32_t k = w->n++;
            off[k] = (uint32_t)i, len[k] = (uint32_t)m;
            w->start[k] = n_ids, w->len[k] = (uint32_t)m, w->count[k] = 1;
            for (size_t j = 0; j < m; j++)
                w->ids[n_ids++] = SL_SYNTH_FIRST_BYTE_TOKEN + (unsigned char)text[i + j];
            set.slot[at] = k + 1;
        }
        i += m;
    }
    rc = 0;
out:
    free(off), free(len), free(set.slot);
    if (rc) words_free(w);
    return rc;
}

/* Pair counts of one round: open addressing on (a, b), cleared through `used`. */
typedef struct pairs {
    uint64_t *key; /* (a << 32 | b) + 1, 0 = empty */
    uint32_t *cnt;
    uint32_t *used; /* slots in use */
    uint32_t n_used, mask;
} pairs;

static void pairs_add(pairs *p, uint64_t k, uint32_t c)
{
    uint32_t at = (uint32_t)((k * 0x9e3779b97f4a7c15ull) >> 40) & p->mask;
    while (p->key[at] && p->key[at] != k + 1) at = (at + 1) & p->mask;
    if (!p->key[at]) {
        p->key[at] = k + 1;
        p->cnt[at] = 0;
        p->used[p->n_used++] = at;
    }
    p->cnt[at] += c;
}

/* Learns merges until the vocabulary is full or every piece is a single token. */
static int train(builder *b, uint32_t n_vocab)
{
    words w;
    int rc = words_build(&w, CORPUS, sizeof CORPUS - 1);
    if (rc) return rc;
    uint32_t total = 0;
    for (uint32_t i = 0; i < w.n; i++) total += w.len[i];
    pairs p = {0};
    uint32_t cap = 64;
    while (cap < 2 * total + 64) cap *= 2;
    p.key = calloc(cap, sizeof *p.key);
    p.cnt = calloc(cap, sizeof *p.cnt);
    p.used = malloc(cap * sizeof *p.used);
    p.mask = cap - 1;
    uint64_t *banned = malloc(n_vocab * sizeof *banned);
    uint32_t n_banned = 0;
    rc = SL_ENOMEM;
    if (!p.key || !p.cnt || !p.used || !banned) goto out;
    rc = 0;
    while (b->n_tok < n_vocab) {
        for (uint32_t i = 0; i < p.n_used; i++) p.key[p.used[i]] = 0;
        p.n_used = 0;
        for (uint32_t i = 0; i < w.n; i++) {
            const uint32_t *t = w.ids + w.start[i];
            for (uint32_t j = 0; j + 1 < w.len[i]; j++)
                pairs_add(&p, (uint64_t)t[j] << 32 | t[j + 1], w.count[i]);
        }
        uint64_t best = 0;
        uint32_t best_cnt = 0;
        for (uint32_t i = 0; i < p.n_used; i++) {
            uint32_t s = p.used[i];
            uint64_t k = p.key[s] - 1;
            if (p.cnt[s] < best_cnt || (p.cnt[s] == best_cnt && k >= best)) continue;
            int skip = 0;
            for (uint32_t j = 0; j < n_banned && !skip; j++) skip = banned[j] == k;
            if (!skip) best = k, best_cnt = p.cnt[s];
        }
        if (best_cnt == 0) break; /* every piece is one token */
        uint32_t x = (uint32_t)(best >> 32), y = (uint32_t)best;
        int added = merge_add(b, x, y);
        if (added < 0) {
            rc = added;
            goto out;
        }
        if (!added) { /* spelled like an existing token: never merge this pair */
            banned[n_banned++] = best;
            continue;
        }
        uint32_t z = b->n_tok - 1;
        for (uint32_t i = 0; i < w.n; i++) {
            uint32_t *t = w.ids + w.start[i], o = 0;
            for (uint32_t j = 0; j < w.len[i]; j++) {
                if (j + 1 < w.len[i] && t[j] == x && t[j + 1] == y) {
                    t[o++] = z;
                    j++;
                } else {
                    t[o++] = t[j];
                }
            }
            w.len[i] = o;
        }
    }
out:
    free(p.key), free(p.cnt), free(p.used), free(banned);
    words_free(&w);
    return rc;
}

/* "Ġ" + [a-z]* or [a-z]+: tokens the mechanical top-up extends. */
static int alphabetic(const char *s, size_t n)
{
    size_t i = 0;
    if (n >= 2 && !memcmp(s, SPACE_G, 2)) i = 2;
    if (i == n) return i > 0;
    for (; i < n; i++)
        if (s[i] < 'a' || s[i] > 'z') return 0;
    return 1;
}

static int top_up(builder *b, uint32_t n_vocab)
{
    for (uint32_t i = SL_SYNTH_FIRST_BYTE_TOKEN; i < b->n_tok && b->n_tok < n_vocab; i++) {
        if (!alphabetic(b->p.buf + b->tok_off[i], b->tok_len[i])) continue;
        for (char c = 'a'; c <= 'z' && b->n_tok < n_vocab; c++) {
            uint32_t y = SL_SYNTH_FIRST_BYTE_TOKEN + (unsigned char)c;
            int rc = merge_add(b, i, y);
            if (rc < 0) return rc;
        }
    }
    return b->n_tok == n_vocab ? 0 : SL_EINVAL;
}

/* ---- token map ---- */

static int utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t k = c < 0x80             ? 1
                   : (c & 0xe0) == 0xc0 ? 2
                   : (c & 0xf0) == 0xe0 ? 3
                   : (c & 0xf8) == 0xf0 ? 4
                                        : 0;
        if (!k || i + k > n) return 0;
        if (k == 2 && c < 0xc2) return 0;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80) return 0;
        i += k;
    }
    return 1;
}

typedef struct keys {
    pool p;
    uint64_t *off;
    uint32_t *len;
} keys;

static const char *key_get(const void *ctx, uint32_t i, size_t *n)
{
    const keys *k = ctx;
    *n = k->len[i];
    return k->p.buf + k->off[i];
}

/* The §6.1 key of one token into out (cap >= 2 * n + 1); returns its length. */
static size_t token_key(const char *tok, size_t n, int special, const int16_t inv[512], char *out)
{
    unsigned char raw[512];
    size_t m = 0;
    if (special) goto verbatim;
    for (size_t i = 0; i < n;) { /* byte-level decode */
        unsigned char c = (unsigned char)tok[i];
        uint32_t cp;
        if (c < 0x80)
            cp = c, i += 1;
        else if ((c & 0xe0) == 0xc0 && i + 1 < n)
            cp = (uint32_t)(c & 0x1f) << 6 | ((unsigned char)tok[i + 1] & 0x3f), i += 2;
        else
            goto verbatim;
        if (cp >= 512 || inv[cp] < 0 || m >= sizeof raw) goto verbatim;
        raw[m++] = (unsigned char)inv[cp];
    }
    if (!utf8_valid(raw, m)) goto verbatim;
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        unsigned char c = raw[i];
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
            if (!k || out[k - 1] != ' ') out[k++] = ' ';
            continue;
        }
        out[k++] = (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
    }
    if (!(k == 1 && out[0] == ' ')) {
        size_t a = 0;
        while (a < k && out[a] == ' ') a++;
        while (k > a && out[k - 1] == ' ') k--;
        memmove(out, out + a, k - a);
        k -= a;
    }
    if (k == 0) { /* empty after normalisation: the un-normalised text */
        memcpy(out, raw, m);
        k = m;
    }
    return k;
verbatim:
    memcpy(out, tok, n);
    return n;
}

static int token_map_build(sl_synth_tokenizer *t)
{
    uint32_t cp[256];
    int16_t inv[512];
    byte_table(cp);
    for (int i = 0; i < 512; i++) inv[i] = -1;
    for (int b = 0; b < 256; b++) inv[cp[b]] = (int16_t)b;
    keys k = {0};
    strset set = {0};
    int rc = SL_ENOMEM;
    k.off = malloc(t->n_vocab * sizeof *k.off);
    k.len = malloc(t->n_vocab * sizeof *k.len);
    if (!k.off || !k.len || strset_init(&set, t->n_vocab)) goto out;
    uint32_t n_keys = 0;
    for (uint32_t i = 0; i < t->n_vocab; i++) {
        char buf[1024];
        size_t n = strlen(t->tokens[i]);
        if (n > 500) goto out; /* never: tokens are short */
        size_t m = token_key(t->tokens[i], n, t->token_type[i] == 3, inv, buf);
        uint32_t at = strset_find(&set, buf, m, key_get, &k);
        if (!set.slot[at]) {
            long long off = pool_add(&k.p, buf, m, NULL, 0);
            if (off < 0) goto out;
            k.off[n_keys] = (uint64_t)off;
            k.len[n_keys] = (uint32_t)m;
            set.slot[at] = ++n_keys;
        }
        t->token_map[i] = (int32_t)(set.slot[at] - 1);
    }
    t->n_compressed = n_keys;
    rc = 0;
out:
    free(k.p.buf), free(k.off), free(k.len), free(set.slot);
    return rc;
}

/* ---- public ---- */

void sl_synth_tokenizer_free(sl_synth_tokenizer **tok)
{
    if (!tok || !*tok) return;
    sl_synth_tokenizer *t = *tok;
    free(t->tokens), free(t->token_type), free(t->merges), free(t->token_map), free(t->pool);
    free(t);
    *tok = NULL;
}

int sl_synth_tokenizer_build(sl_synth_tokenizer **out, uint32_t n_vocab, sl_err *err)
{
    static const char *const specials[SL_SYNTH_N_SPECIAL] = {
        ("<" FW_BAR "begin" LOW_LINE "of" LOW_LINE "sentence" FW_BAR ">"),
        ("<" FW_BAR "end" LOW_LINE "of" LOW_LINE "sentence" FW_BAR ">"),
        ("<" FW_BAR LOW_LINE "pad" LOW_LINE FW_BAR ">"),
    };
    if (n_vocab < SL_SYNTH_FIRST_MERGE_TOKEN || n_vocab > (1u << 24))
        return sl_err_set(err, SL_EINVAL, "tokenizer: vocab %u not in %d..%u", n_vocab,
                          SL_SYNTH_FIRST_MERGE_TOKEN, 1u << 24);
    builder b;
    memset(&b, 0, sizeof b);
    sl_synth_tokenizer *t = calloc(1, sizeof *t);
    b.tok_off = malloc(n_vocab * sizeof *b.tok_off);
    b.tok_len = malloc(n_vocab * sizeof *b.tok_len);
    b.merge_off = malloc(n_vocab * sizeof *b.merge_off);
    int rc = SL_ENOMEM;
    if (!t || !b.tok_off || !b.tok_len || !b.merge_off || strset_init(&b.set, n_vocab)) goto fail;
    for (int i = 0; i < SL_SYNTH_N_SPECIAL; i++)
        if (tok_add(&b, specials[i], strlen(specials[i]), "", 0) != 1) goto fail;
    uint32_t cp[256];
    byte_table(cp);
    for (uint32_t c = 0; c < 256; c++) {
        char u[4];
        if (tok_add(&b, u, utf8_put(u, cp[c]), "", 0) != 1) goto fail;
    }
    if ((rc = train(&b, n_vocab))) goto fail;
    t->n_trained = b.n_merge;
    if ((rc = top_up(&b, n_vocab))) goto fail;

    t->n_vocab = n_vocab;
    t->n_merges = b.n_merge;
    t->tokens = malloc(n_vocab * sizeof *t->tokens);
    t->token_type = malloc(n_vocab * sizeof *t->token_type);
    t->merges = malloc((b.n_merge ? b.n_merge : 1) * sizeof *t->merges);
    t->token_map = malloc(n_vocab * sizeof *t->token_map);
    rc = SL_ENOMEM;
    if (!t->tokens || !t->token_type || !t->merges || !t->token_map) goto fail;
    t->pool = b.p.buf;
    b.p.buf = NULL;
    for (uint32_t i = 0; i < n_vocab; i++) {
        t->tokens[i] = t->pool + b.tok_off[i];
        t->token_type[i] = i < SL_SYNTH_N_SPECIAL ? 3 : 1;
    }
    for (uint32_t i = 0; i < b.n_merge; i++) t->merges[i] = t->pool + b.merge_off[i];
    if ((rc = token_map_build(t))) goto fail;
    free(b.tok_off), free(b.tok_len), free(b.merge_off), free(b.set.slot);
    *out = t;
    return 0;
fail:
    free(b.p.buf), free(b.tok_off), free(b.tok_len), free(b.merge_off), free(b.set.slot);
    sl_synth_tokenizer_free(&t);
    if (rc == SL_EINVAL)
        return sl_err_set(err, rc, "tokenizer: could not reach %u tokens", n_vocab);
    return sl_err_set(err, SL_ENOMEM, "tokenizer: out of memory building %u tokens", n_vocab);
}
