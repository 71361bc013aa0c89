/* synth.h - the deepseek41 model description and the synthetic checkpoint writer.
 *
 * Two layers live here. The model layer (sl_model_*) is pure knowledge of
 * MODEL.md: a config struct holding every dimension and per-layer role, the
 * layout of tensors it implies (names, GGUF dims, types, §9.1), its validation,
 * and reading it back from an opened checkpoint's metadata (§9.2, with §1's
 * values as defaults only for keys real files may lack). The engine's loader and
 * `sluice-gguf verify` use these; nothing here does I/O except
 * sl_model_config_read, which only reads an already opened sl_gguf.
 *
 * The synth layer (sl_synth_*) writes a checkpoint of a config: presets, a
 * byte-level BPE tokenizer (trained on an embedded text, topped up mechanically
 * to any vocabulary size), the engram constants, seeded weights, and the split
 * files. docs/gguf-layout.md lists every key and tensor it writes.
 *
 * Everything is deterministic: the same config and seed give byte-identical
 * files, whatever the shard count (each tensor's bytes depend only on the seed,
 * its layout index and its shape). No function keeps global state; all are
 * thread-safe on distinct arguments.
 */
#ifndef SL_SYNTH_H
#define SL_SYNTH_H

#include <stdint.h>

#include "err.h"
#include "gguf.h"

#define SL_MODEL_ARCH            "deepseek41"
#define SL_MODEL_MAX_LAYER       64 /* block_count limit (V4.1: 40, + 3 MTP not stored) */
#define SL_MODEL_MAX_ENGRAM      8  /* engram layers (V4.1: 2) */
#define SL_MODEL_MAX_NGRAM       8  /* engram max_ngram_size (V4.1: 4) */
#define SL_MODEL_MAX_ENGRAM_COL  64 /* (max_ngram - 1) * engram heads (V4.1: 24) */
#define SL_MODEL_NAME_MAX        64
#define SL_MODEL_TENSOR_NAME_MAX 64

/* Roles of a layer's candidate pre-filter (MODEL.md §5.5 step 6). */
enum sl_model_candidate {
    SL_MODEL_CANDIDATE_NONE = 0,
    SL_MODEL_CANDIDATE_SOURCE = 1,   /* builds the block mask from its own scores */
    SL_MODEL_CANDIDATE_CONSUMER = 2, /* applies the source's mask before its top-k */
};

/* Every dimension, constant and layer role of a deepseek41 checkpoint. Layer lists
 * are sorted ascending, unique, and < n_layer. Fields marked (derived) are filled
 * by sl_synth_derive or read from a file, not by presets. */
typedef struct sl_model_config {
    char name[SL_MODEL_NAME_MAX]; /* general.name; also the shard file prefix */

    uint32_t n_layer;        /* blocks stored (V4.1: 40; MTP stages are not stored) */
    uint32_t dim;            /* model dim D (5120) */
    uint32_t vocab;          /* tokens (129280) */
    uint32_t context_length; /* max_position_embeddings (1048576) */

    /* attention (§5) */
    uint32_t n_head;   /* query heads (64), all sharing one KV latent */
    uint32_t head_dim; /* per head, = non-rope + rope dims (512) */
    uint32_t rope_dim; /* rotated dims, the LAST rope_dim of a head / index head (64) */
    uint32_t q_lora;   /* q_lora_rank (1280) */
    uint32_t o_groups; /* output groups (8); n_head % o_groups == 0 */
    uint32_t o_lora;   /* output low rank per group (1024) */
    uint32_t window;   /* sliding window (128) */

    /* indexer (§5.5) */
    uint32_t index_n_head;   /* 32 */
    uint32_t index_head_dim; /* 128 */
    uint32_t index_topk;     /* 512 */

    /* MoE (§7) */
    uint32_t n_expert;      /* routed experts per layer (384) */
    uint32_t n_expert_used; /* top-k (6) */
    uint32_t moe_inter;     /* expert hidden size (2304) */
    uint32_t n_shared;      /* shared experts (1), each of moe_inter */
    float route_scale;      /* routed_scaling_factor (1.5) */
    int norm_topk_prob;     /* renormalise the top-k scores (1) */
    float gate_temp;        /* router logit divisor (1.0) */
    float swiglu_limit;     /* clamp of routed and shared experts (10.0) */

    /* hyper-connections (§4) */
    uint32_t hc_mult;           /* stream copies (4) */
    uint32_t hc_sinkhorn_iters; /* 20 */
    float hc_eps;               /* 1e-6, inside the Sinkhorn only */
    float norm_eps;             /* every RMSNorm (1e-20) */

    /* rope (§2.5): ratio-0 layers use rope_theta plain; others compress_rope_theta + YaRN */
    float rope_theta;          /* 10000 */
    float compress_rope_theta; /* 160000 */
    uint32_t yarn_orig_ctx;    /* original_seq_len (65536) */
    float yarn_factor;         /* 16 */
    float yarn_beta_fast;      /* 32 */
    float yarn_beta_slow;      /* 1 */

    /* layer roles (§1) */
    uint32_t compress_ratio[SL_MODEL_MAX_LAYER]; /* [n_layer], each 0, 1 or 2 */
    uint32_t n_kv_source;
    uint32_t kv_source[SL_MODEL_MAX_LAYER]; /* [n_kv_source] layers owning a compressor */
    uint32_t n_index_source;
    uint32_t index_source[SL_MODEL_MAX_LAYER]; /* [n_index_source] layers owning an indexer */
    int32_t candidate_source;                  /* layer building the candidate mask, -1 none */
    uint32_t candidate_block_size;             /* entries per candidate block (8) */
    uint32_t candidate_topk_blocks;            /* blocks kept (2048) */

    /* engram (§6) */
    uint32_t n_engram;
    uint32_t engram_layer[SL_MODEL_MAX_ENGRAM]; /* [n_engram] (V4.1: 1, 14) */
    uint32_t engram_n_head;                     /* hash heads per n-gram size (8) */
    uint32_t engram_head_dim;                   /* table row width (256) */
    uint32_t engram_max_ngram;                  /* n-grams 2..max are hashed (4) */
    uint32_t engram_pad_id;                     /* compressed pad id (2) */
    uint64_t engram_vocab_size; /* prime search starts above engram_vocab_size - 1 (16e6) */
    /* [n_engram][(max_ngram-1)*n_head] table sizes, column order [ngram-2][head] */
    uint64_t engram_prime[SL_MODEL_MAX_ENGRAM][SL_MODEL_MAX_ENGRAM_COL];
    /* [n_engram][cols] exclusive prefix sums of engram_prime (row offset of a column) */
    uint64_t engram_offset[SL_MODEL_MAX_ENGRAM][SL_MODEL_MAX_ENGRAM_COL];
    /* [n_engram][max_ngram] hash multipliers, odd, < 2^47 (derived) */
    uint64_t engram_multiplier[SL_MODEL_MAX_ENGRAM][SL_MODEL_MAX_NGRAM];
    uint32_t engram_compressed_vocab; /* distinct token_map ids (99092) (derived) */

    /* tensor types (enum sl_qtype); MODEL.md §9.1's Q2_K file by default */
    uint32_t type_weight;      /* every other 2-D/3-D weight (Q2_K) */
    uint32_t type_down;        /* ffn_down_exps and ffn_down_shexp (Q3_K) */
    uint32_t type_output;      /* output.weight (Q6_K) */
    uint32_t type_router;      /* ffn_gate_inp (BF16) */
    uint32_t type_engram_embd; /* engram tables, one block per row (Q2_K) */

    /* synth only (not model metadata): how quantized tensors get their blocks.
     * Tensors of at most quantize_max_values values are drawn in f32 and quantized
     * by the reference quantizers (sl_quant_encode: blocks exactly like real ones,
     * ~100 ns per Q2_K value); larger ones, and all of them when fast_random_blocks
     * is set, get random valid blocks at memory speed (random codes and scales, f16
     * scales overwritten by small finite values calibrated to the same mean and
     * spread). Float tensors (F32/F16/BF16) are always drawn and converted. */
    int fast_random_blocks;       /* 1: every quantized tensor random (bench presets) */
    uint64_t quantize_max_values; /* tiny/small: 2^18 (attention etc., not the experts) */
    /* 0, or P: a tensor of layer l >= P gets the bytes of the tensor of the same kind,
     * type and shape in layer l mod P, where that layer has one (a model whose layers
     * repeat: tests) */
    uint32_t layer_period;
} sl_model_config;

/* Everything one layer does, from the lists above. */
typedef struct sl_model_layer_role {
    uint32_t ratio;       /* compress ratio: 0 window only, 1 or 2 */
    int32_t kv_source;    /* layer whose compressed cache it reads, -1 (ratio 0) */
    int32_t index_source; /* layer whose top-k list it uses, -1 (ratio 0) */
    int owns_compressor;  /* kv source: compressor kv + norm */
    int owns_gate;        /* ratio-2 kv source: compressor gate */
    int owns_indexer;     /* index source: indexer q_b + proj */
    int owns_index_keys;  /* kv source that is an index source: indexer attn_k + k_norm */
    int candidate;        /* enum sl_model_candidate */
    int32_t engram;       /* index into engram_layer[], -1 when no engram module */
    int rope_yarn;        /* 1: compress_rope_theta + YaRN, 0: rope_theta plain */
} sl_model_layer_role;

/* Every tensor kind of the layout, in the order a layer's tensors are written. */
enum sl_model_tensor_kind {
    SL_MODEL_TENSOR_TOKEN_EMBD = 0,
    SL_MODEL_TENSOR_ENGRAM_EMBD,
    SL_MODEL_TENSOR_ENGRAM_WKV,
    SL_MODEL_TENSOR_ENGRAM_Q,
    SL_MODEL_TENSOR_ENGRAM_K,
    SL_MODEL_TENSOR_HC_ATTN_FN,
    SL_MODEL_TENSOR_HC_ATTN_BASE,
    SL_MODEL_TENSOR_HC_ATTN_SCALE,
    SL_MODEL_TENSOR_ATTN_NORM,
    SL_MODEL_TENSOR_ATTN_Q_A,
    SL_MODEL_TENSOR_ATTN_Q_A_NORM,
    SL_MODEL_TENSOR_ATTN_Q_B,
    SL_MODEL_TENSOR_ATTN_KV,
    SL_MODEL_TENSOR_ATTN_KV_A_NORM,
    SL_MODEL_TENSOR_COMPRESSOR_KV,
    SL_MODEL_TENSOR_COMPRESSOR_GATE,
    SL_MODEL_TENSOR_COMPRESSOR_NORM,
    SL_MODEL_TENSOR_INDEXER_K,
    SL_MODEL_TENSOR_INDEXER_K_NORM,
    SL_MODEL_TENSOR_INDEXER_Q_B,
    SL_MODEL_TENSOR_INDEXER_PROJ,
    SL_MODEL_TENSOR_ATTN_SINKS,
    SL_MODEL_TENSOR_ATTN_OUTPUT_A,
    SL_MODEL_TENSOR_ATTN_OUTPUT_B,
    SL_MODEL_TENSOR_HC_FFN_FN,
    SL_MODEL_TENSOR_HC_FFN_BASE,
    SL_MODEL_TENSOR_HC_FFN_SCALE,
    SL_MODEL_TENSOR_FFN_NORM,
    SL_MODEL_TENSOR_FFN_GATE_INP,
    SL_MODEL_TENSOR_EXP_PROBS_B,
    SL_MODEL_TENSOR_EXP_PROBS_B_VL,
    SL_MODEL_TENSOR_FFN_GATE_EXPS,
    SL_MODEL_TENSOR_FFN_UP_EXPS,
    SL_MODEL_TENSOR_FFN_DOWN_EXPS,
    SL_MODEL_TENSOR_FFN_GATE_SHEXP,
    SL_MODEL_TENSOR_FFN_UP_SHEXP,
    SL_MODEL_TENSOR_FFN_DOWN_SHEXP,
    SL_MODEL_TENSOR_OUTPUT_NORM,
    SL_MODEL_TENSOR_OUTPUT,
    SL_MODEL_TENSOR_COUNT,
};

/* One tensor of the layout as it appears in the GGUF. */
typedef struct sl_model_tensor {
    char name[SL_MODEL_TENSOR_NAME_MAX]; /* "blk.3.attn_q_a.weight" */
    uint32_t kind;                       /* enum sl_model_tensor_kind */
    int32_t layer;                       /* block index, -1 for the global tensors */
    uint32_t type;                       /* enum sl_qtype */
    uint32_t n_dims;                     /* 1..3 */
    uint64_t ne[SL_GGUF_MAX_DIMS];       /* ne[0] contiguous; unused dims are 1 */
    uint64_t n_bytes;                    /* bytes of the data */
} sl_model_tensor;

/* ---- model layer ---- */

/* Names of the presets sl_model_config_preset knows, for messages and --help. */
#define SL_SYNTH_PRESETS "tiny, small, bench-L<n> (1 <= n <= 40)"

/* Fills cfg from a preset name: "tiny", "small" or "bench-L<n>". Engram primes and
 * offsets are filled; multipliers and the compressed vocab size are not (see
 * sl_synth_derive). Unknown names are SL_EINVAL listing the presets. */
int sl_model_config_preset(sl_model_config *cfg, const char *preset, sl_err *err);

/* Fills engram_prime and engram_offset by §6.4's search: for each engram layer and
 * n-gram size, restart above engram_vocab_size - 1 and take the next engram_n_head
 * primes never handed out before (V4.1: 16000000 gives §6.4's table). Trial
 * division: ~50 ms at V4.1's size. */
void sl_model_config_engram_primes(sl_model_config *cfg);

/* Checks cfg: dims non-zero and consistent (head_dim > rope_dim, heads divisible
 * by groups ...), every quantized tensor's ne0 a multiple of its block, and the
 * roles consistent (sorted lists, every ratio > 0 layer has a kv and an index
 * source of the same ratio at or before it, kv sources are index sources, engram
 * constants sane). SL_EINVAL with the first problem named. */
int sl_model_config_validate(const sl_model_config *cfg, sl_err *err);

/* The roles of layer l (l < cfg->n_layer), from cfg's lists (MODEL.md §1's table). */
sl_model_layer_role sl_model_layer_role_of(const sl_model_config *cfg, uint32_t l);

/* Writes the GGUF name of a tensor kind for layer l ("blk.<l>.attn_q_a.weight";
 * layer is ignored for global kinds) into buf (SL_MODEL_TENSOR_NAME_MAX is enough). */
void sl_model_tensor_name(char *buf, uint64_t cap, uint32_t kind, uint32_t layer);

/* Builds the full tensor list of cfg in file order: token_embd, then for each
 * layer its tensors in enum order (only those its role has), then output_norm and
 * output. The caller frees *out with free(). SL_EINVAL when cfg does not validate. */
int sl_model_layout(const sl_model_config *cfg, sl_model_tensor **out, uint64_t *n, sl_err *err);

/* Sum of n_bytes over the layout (the tensor data of a checkpoint, no headers).
 * cfg must validate. */
uint64_t sl_model_tensor_bytes(const sl_model_config *cfg);

/* Reads cfg back from an opened checkpoint's metadata (shard 0): architecture must
 * be deepseek41; keys real files may lack (source lists, candidate settings,
 * gate_temp, engram constants) default to MODEL.md §1 / §6.4. Types are the
 * layout defaults (Q2_K file). Validates the result. The engine's loader entry. */
int sl_model_config_read(const sl_gguf *g, sl_model_config *cfg, sl_err *err);

/* Writes every model key of cfg (general.*, deepseek41.*, engram constants; not the
 * tokenizer or split keys) into w, in a fixed order. token_map ([cfg->vocab]) is
 * written as deepseek41.engram.token_map when not NULL. The inverse of
 * sl_model_config_read. SL_EINVAL when cfg does not validate. */
int sl_model_config_write(const sl_model_config *cfg, const int32_t *token_map, sl_gguf_writer *w,
                          sl_err *err);

/* ---- synthetic checkpoints ---- */

/* A byte-level BPE tokenizer in llama.cpp's gpt2 spelling, with the engram map. */
typedef struct sl_synth_tokenizer {
    uint32_t n_vocab;
    char **tokens;         /* [n_vocab] NUL-terminated, GPT-2 byte-to-unicode spelling */
    int32_t *token_type;   /* [n_vocab] llama.cpp token types: 1 normal, 3 control */
    uint32_t n_merges;     /* n_vocab - 259: every token after the bytes has one merge */
    char **merges;         /* [n_merges] "left right"; merge i makes token 259 + i */
    uint32_t n_trained;    /* merges learned from the embedded text; the rest are mechanical */
    int32_t *token_map;    /* [n_vocab] engram compressed id (§6.1), first sight order */
    uint32_t n_compressed; /* distinct compressed ids */
    char *pool;            /* owns every string above */
} sl_synth_tokenizer;

#define SL_SYNTH_TOKEN_BOS         0
#define SL_SYNTH_TOKEN_EOS         1
#define SL_SYNTH_TOKEN_PAD         2
#define SL_SYNTH_N_SPECIAL         3
#define SL_SYNTH_FIRST_BYTE_TOKEN  3 /* byte b is token 3 + b */
#define SL_SYNTH_FIRST_MERGE_TOKEN (SL_SYNTH_FIRST_BYTE_TOKEN + 256)

/* Builds the tokenizer of n_vocab tokens (>= 259): specials 0..2 spelled as
 * DeepSeek's, the 256 byte tokens, then merges learned by a small deterministic
 * BPE trainer on an embedded English text, topped up mechanically (token + letter)
 * when the text runs out. Every merge's result is the concatenation of its two
 * parts and unique. 129280 tokens take ~0.15 s. The caller owns *out. */
int sl_synth_tokenizer_build(sl_synth_tokenizer **out, uint32_t n_vocab, sl_err *err);
void sl_synth_tokenizer_free(sl_synth_tokenizer **tok);

/* Fills cfg's derived fields: engram_compressed_vocab from the tokenizer of
 * cfg->vocab and engram multipliers from seed (odd, < min(2^47, 2*beta) with
 * beta = floor(floor((2^63-1)/compressed)/2) as §6.4, so hashes cannot overflow). */
int sl_synth_derive(sl_model_config *cfg, uint64_t seed, sl_err *err);

/* Progress of a write, for a progress bar; called from the writing thread after
 * each chunk (every few MB) and once with done_bytes == 0 before the first byte. */
typedef struct sl_synth_progress {
    uint32_t shard; /* 0-based shard being written */
    uint32_t n_shards;
    uint64_t done_bytes;  /* bytes of all files written so far */
    uint64_t total_bytes; /* bytes of all files together, exact */
} sl_synth_progress;
typedef void (*sl_synth_progress_fn)(void *ctx, const sl_synth_progress *p);

/* What a write produced. */
typedef struct sl_synth_stats {
    uint32_t n_files;
    uint64_t n_tensors;
    uint64_t total_bytes;
} sl_synth_stats;

/* Writes cfg as n_shards files dir/<cfg->name>-%05u-of-%05u.gguf (1-based), creating
 * dir (and its parents) when missing. Derived fields of cfg are recomputed from seed
 * (a copy; cfg is not changed). Shard 0 carries every model and tokenizer key;
 * every shard carries split.no / split.count / split.tensors.count. Tensors go in
 * layout order, shards balanced by bytes; files of the same name with another
 * shard count are removed afterwards. n_shards of 0 or above the tensor count is
 * SL_EINVAL. progress may be NULL; stats may be NULL. Costs the disk time of the
 * files plus the reference quantization of tensors up to quantize_max_values
 * (~100 ns per Q2_K value, spread over the cores: tiny ~0.5 s of CPU). */
int sl_synth_write(const sl_model_config *cfg, const char *dir, uint32_t n_shards, uint64_t seed,
                   sl_synth_progress_fn progress, void *progress_ctx, sl_synth_stats *stats,
                   sl_err *err);

#endif
