/* moe_emu.c - the CPU emulation of the GPU MoE arithmetic (see moe_emu.h).
 *
 * Each dot product walks the same (lane, group) assignment as the kernels in
 * moe_kern.cuh: one f32 accumulator per emulated lane, updated in the lane's order,
 * then the xor butterfly. Integer sums per group are computed bytewise here and with
 * dp4a there; they are exact either way. Any change to a kernel's lane mapping must
 * be mirrored here, or the GPU tests' bit-exact checks fail.
 */
#include <stdlib.h>
#include <string.h>

#include "moe_emu.h"

/* The xor butterfly of the kernels over `lanes` (8 or 32) accumulators:
 * for off = lanes/2 .. 1, v[l] = v[l] + v[l ^ off]; every lane ends with lane 0's sum. */
static float butterfly(float *v, int lanes)
{
    float t[32];
    for (int off = lanes / 2; off >= 1; off /= 2) {
        for (int l = 0; l < lanes; l++) t[l] = sl_emu_add(v[l], v[l ^ off]);
        for (int l = 0; l < lanes; l++) v[l] = t[l];
    }
    return v[0];
}

static float f16_at(const uint8_t *p)
{
    return sl_f16_to_f32((sl_f16)(p[0] | p[1] << 8));
}

void sl_emu_act_quant(const float *x, uint32_t n, sl_emu_act *act)
{
    act->n = n;
    for (uint32_t b = 0; b < n / 32; b++) {
        sl_block_q8_1 blk;
        (void)sl_quant_q8_1(x + 32 * b, &blk, 32);
        act->d[b] = blk.d;
        memcpy(act->qs + 32 * b, blk.qs, 32);
        int s0 = 0, s1 = 0;
        for (int t = 0; t < 16; t++) {
            s0 += blk.qs[t];
            s1 += blk.qs[16 + t];
        }
        act->sum16[2 * b] = s0;
        act->sum16[2 * b + 1] = s1;
    }
}

/* Q2_K, 32 lanes per row: lane l owns group g = l % 8 (values 32g..32g+31) of blocks
 * b = l/8, l/8 + 4, ... in increasing b. */
float sl_emu_dot_q2_k(const void *row, const sl_emu_act *act)
{
    const uint8_t *p = row;
    const uint32_t nb = act->n / 256;
    float acc[32];
    for (int l = 0; l < 32; l++) {
        const int g = l & 7, sh = 2 * (g & 3);
        acc[l] = 0.0f;
        for (uint32_t b = (uint32_t)l >> 3; b < nb; b += 4) {
            const uint8_t *blk = p + 84 * b;
            const uint8_t *qs = blk + 16 + 32 * (g >> 2);
            const int8_t *a = act->qs + 256 * b + 32 * g;
            int c[2] = {0, 0};
            for (int t = 0; t < 32; t++) c[t >> 4] += ((qs[t] >> sh) & 3) * a[t];
            const int sc0 = blk[2 * g], sc1 = blk[2 * g + 1];
            const int isum = (sc0 & 15) * c[0] + (sc1 & 15) * c[1];
            const int imin = (sc0 >> 4) * act->sum16[16 * b + 2 * g] +
                             (sc1 >> 4) * act->sum16[16 * b + 2 * g + 1];
            acc[l] = sl_emu_q2_k_step(acc[l], f16_at(blk + 80), f16_at(blk + 82), isum, imin,
                                      act->d[8 * b + g]);
        }
    }
    return butterfly(acc, 32);
}

/* The 6-bit scale k of a Q3_K block, minus 32. */
static int q3_k_scale(const uint8_t *sc, int k)
{
    return (int)sl_emu_q3_k_scale6(sc, (uint32_t)k) - 32;
}

/* Q3_K, 8 lanes per row: lane g owns group g of every block, in increasing b. */
float sl_emu_dot_q3_k(const void *row, const sl_emu_act *act)
{
    const uint8_t *p = row;
    const uint32_t nb = act->n / 256;
    float acc[8];
    for (int g = 0; g < 8; g++) {
        const int sh = 2 * (g & 3);
        acc[g] = 0.0f;
        for (uint32_t b = 0; b < nb; b++) {
            const uint8_t *blk = p + 110 * b;
            const uint8_t *qs = blk + 32 + 32 * (g >> 2);
            const int8_t *a = act->qs + 256 * b + 32 * g;
            int c[2] = {0, 0};
            for (int t = 0; t < 32; t++) {
                const int low = (qs[t] >> sh) & 3;
                const int code = (blk[t] >> g) & 1 ? low : low - 4;
                c[t >> 4] += code * a[t];
            }
            const int isum =
                q3_k_scale(blk + 96, 2 * g) * c[0] + q3_k_scale(blk + 96, 2 * g + 1) * c[1];
            acc[g] = sl_emu_q3_k_step(acc[g], f16_at(blk + 108), isum, act->d[8 * b + g]);
        }
    }
    return butterfly(acc, 8);
}

float sl_emu_dot_bf16(const uint16_t *row, const float *x, uint32_t n)
{
    float acc[32];
    for (uint32_t l = 0; l < 32; l++) {
        acc[l] = 0.0f;
        for (uint32_t c = l; c < n / 8; c += 32)
            for (uint32_t i = 8 * c; i < 8 * c + 8; i++)
                acc[l] = sl_emu_fma(x[i], sl_emu_bf16_to_f32(row[i]), acc[l]);
    }
    return butterfly(acc, 32);
}

void sl_emu_router_logits(const uint16_t *w, const uint16_t *x, uint32_t n_expert, uint32_t dim,
                          float gate_temp, float *logits)
{
    float *xf = malloc(sizeof(float) * dim);
    SL_ASSERT(xf);
    for (uint32_t i = 0; i < dim; i++) xf[i] = sl_emu_bf16_to_f32(x[i]);
    for (uint32_t e = 0; e < n_expert; e++) {
        float v = sl_emu_dot_bf16(w + (size_t)e * dim, xf, dim);
        if (gate_temp != 1.0f) v = sl_emu_div(v, gate_temp);
        logits[e] = v;
    }
    free(xf);
}

void sl_emu_moe_order(const sl_moe_route *route, uint32_t n_used, uint32_t *order)
{
    for (uint32_t i = 0; i < n_used; i++) order[i] = i;
    for (uint32_t i = 1; i < n_used; i++) /* insertion sort: stable, n_used <= 64 */
        for (uint32_t j = i; j > 0 && route->expert[order[j - 1]] > route->expert[order[j]]; j--) {
            const uint32_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
}

static int act_alloc(sl_emu_act *a, uint32_t n)
{
    a->n = n;
    a->qs = malloc(n);
    a->d = malloc(sizeof(float) * (n / 32));
    a->sum16 = malloc(sizeof(int32_t) * (n / 16));
    return a->qs && a->d && a->sum16 ? 0 : SL_ENOMEM;
}

static void act_free(sl_emu_act *a)
{
    free(a->qs);
    free(a->d);
    free(a->sum16);
}

int sl_emu_moe(const sl_moe_shape *s, const uint16_t *x, const sl_moe_route *route,
               const sl_moe_expert_w *w, const sl_moe_expert_w *shared, uint16_t *out,
               float *out_f32, sl_emu_trace *tr, sl_err *err)
{
    if (!s || !x || !route || !w || !out || s->dim == 0 || s->inter == 0 || s->dim % 256 ||
        s->inter % 256 || s->n_used == 0 || s->n_used > 64)
        return sl_err_set(err, SL_EINVAL, "sl_emu_moe: bad arguments (dim %u, inter %u, n_used %u)",
                          s ? s->dim : 0, s ? s->inter : 0, s ? s->n_used : 0);
    if (s->gate_type != SL_QTYPE_Q2_K || s->up_type != SL_QTYPE_Q2_K ||
        s->down_type != SL_QTYPE_Q3_K)
        return sl_err_set(err, SL_EUNSUPPORTED,
                          "sl_emu_moe: routed types %u/%u/%u (want Q2_K/Q2_K/Q3_K)", s->gate_type,
                          s->up_type, s->down_type);
    const int sh_q = s->sh_gate_type == SL_QTYPE_Q2_K && s->sh_up_type == SL_QTYPE_Q2_K &&
                     s->sh_down_type == SL_QTYPE_Q3_K;
    const int sh_bf = s->sh_gate_type == SL_QTYPE_BF16 && s->sh_up_type == SL_QTYPE_BF16 &&
                      s->sh_down_type == SL_QTYPE_BF16;
    if (shared && !sh_q && !sh_bf)
        return sl_err_set(err, SL_EUNSUPPORTED, "sl_emu_moe: shared types %u/%u/%u",
                          s->sh_gate_type, s->sh_up_type, s->sh_down_type);

    const uint32_t dim = s->dim, inter = s->inter, n = s->n_used;
    const uint64_t rb_gu = sl_qtype_row_bytes(SL_QTYPE_Q2_K, dim);
    const uint64_t rb_dn = sl_qtype_row_bytes(SL_QTYPE_Q3_K, inter);
    int rc = SL_ENOMEM;
    sl_emu_act ax = {0}, ah = {0};
    float *xf = malloc(sizeof(float) * dim);
    float *h = malloc(sizeof(float) * inter);
    float *ysh = calloc(dim, sizeof(float));
    float *y = calloc(dim, sizeof(float));
    if (!xf || !h || !ysh || !y || act_alloc(&ax, dim) || act_alloc(&ah, inter)) goto fail;

    for (uint32_t i = 0; i < dim; i++) xf[i] = sl_emu_bf16_to_f32(x[i]);
    sl_emu_act_quant(xf, dim, &ax);

    /* The shared expert first (the GPU runs it on a side stream; its output is added last). */
    if (shared) {
        if (sh_q) {
            for (uint32_t r = 0; r < inter; r++) {
                const float g = sl_emu_dot_q2_k((const uint8_t *)shared->gate + r * rb_gu, &ax);
                const float u = sl_emu_dot_q2_k((const uint8_t *)shared->up + r * rb_gu, &ax);
                h[r] = sl_emu_swiglu(g, u, 1.0f, s->swiglu_limit);
            }
            sl_emu_act_quant(h, inter, &ah);
            for (uint32_t r = 0; r < dim; r++)
                ysh[r] = sl_emu_bf16_round(
                    sl_emu_dot_q3_k((const uint8_t *)shared->down + r * rb_dn, &ah));
        } else {
            const uint16_t *wg = shared->gate, *wu = shared->up, *wd = shared->down;
            for (uint32_t r = 0; r < inter; r++) {
                const float g = sl_emu_dot_bf16(wg + (size_t)r * dim, xf, dim);
                const float u = sl_emu_dot_bf16(wu + (size_t)r * dim, xf, dim);
                h[r] = sl_emu_swiglu(g, u, 1.0f, s->swiglu_limit);
            }
            for (uint32_t r = 0; r < dim; r++)
                ysh[r] = sl_emu_bf16_round(sl_emu_dot_bf16(wd + (size_t)r * inter, h, inter));
        }
        if (tr && tr->h_sh) memcpy(tr->h_sh, h, sizeof(float) * inter);
        if (tr && tr->y_sh) memcpy(tr->y_sh, ysh, sizeof(float) * dim);
    }

    /* Routed experts in increasing expert id; each expert's bf16-rounded output is added
     * into y in that order. */
    uint32_t order[64];
    sl_emu_moe_order(route, n, order);
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t rank = order[k];
        const sl_moe_expert_w *e = &w[rank];
        for (uint32_t r = 0; r < inter; r++) {
            const float g = sl_emu_dot_q2_k((const uint8_t *)e->gate + r * rb_gu, &ax);
            const float u = sl_emu_dot_q2_k((const uint8_t *)e->up + r * rb_gu, &ax);
            h[r] = sl_emu_swiglu(g, u, route->weight[rank], s->swiglu_limit);
        }
        sl_emu_act_quant(h, inter, &ah);
        if (tr && tr->h) memcpy(tr->h + (size_t)k * inter, h, sizeof(float) * inter);
        if (tr && tr->hq) memcpy(tr->hq + (size_t)k * inter, ah.qs, inter);
        if (tr && tr->hd)
            memcpy(tr->hd + (size_t)k * (inter / 32), ah.d, sizeof(float) * (inter / 32));
        for (uint32_t r = 0; r < dim; r++) {
            const float v = sl_emu_dot_q3_k((const uint8_t *)e->down + r * rb_dn, &ah);
            y[r] = sl_emu_add(y[r], sl_emu_bf16_round(v));
        }
    }
    for (uint32_t r = 0; r < dim; r++) {
        if (shared) y[r] = sl_emu_add(y[r], ysh[r]);
        if (out_f32) out_f32[r] = y[r];
        out[r] = sl_emu_bf16_bits(y[r]);
    }
    rc = 0;
fail:
    if (rc) sl_err_set(err, rc, "sl_emu_moe: out of memory (dim %u, inter %u)", dim, inter);
    act_free(&ax);
    act_free(&ah);
    free(xf);
    free(h);
    free(ysh);
    free(y);
    return rc;
}

void sl_emu_residual_norm(uint32_t dim, uint16_t *h, const uint16_t *y, const float *w, float eps,
                          uint16_t *x)
{
    if (y)
        for (uint32_t i = 0; i < dim; i++)
            h[i] = sl_emu_bf16_bits(sl_emu_add(sl_emu_bf16_to_f32(h[i]), sl_emu_bf16_to_f32(y[i])));
    if (!w) return;
    float s[SL_EMU_NORM_LANES];
    for (uint32_t j = 0; j < SL_EMU_NORM_LANES; j++) {
        float acc = 0.0f;
        for (uint32_t i = j; i < dim; i += SL_EMU_NORM_LANES) {
            float v = sl_emu_bf16_to_f32(h[i]);
            acc = sl_emu_add(acc, sl_emu_mul(v, v));
        }
        s[j] = acc;
    }
    for (uint32_t off = SL_EMU_NORM_LANES / 2; off; off >>= 1)
        for (uint32_t j = 0; j < off; j++) s[j] = sl_emu_add(s[j], s[j + off]);
    float r = sl_emu_div(1.0f, sl_emu_sqrt(sl_emu_add(sl_emu_div(s[0], (float)dim), eps)));
    for (uint32_t i = 0; i < dim; i++)
        x[i] = sl_emu_bf16_bits(sl_emu_mul(w[i], sl_emu_mul(sl_emu_bf16_to_f32(h[i]), r)));
}

void sl_emu_pack_q3_k(const uint8_t *src, uint64_t n, uint8_t *dst)
{
    for (uint64_t b = 0; b < n; b++) {
        memcpy(dst + b * SL_Q3K_PACKED, src + b * 110, 110);
        memset(dst + b * SL_Q3K_PACKED + 110, 0, SL_Q3K_PACKED - 110);
    }
}

void sl_emu_pack_q3_k_tb(const uint8_t *src, uint32_t rows, uint32_t nb, uint8_t *dst)
{
    const uint64_t stride = (uint64_t)nb * 110; /* a raw row */
    for (uint32_t i = 0; i < rows / 8; i++)
        for (uint32_t b = 0; b < nb; b++) {
            const uint8_t *blk0 = src + (size_t)8 * i * stride + (size_t)b * 110;
            uint8_t *tb = dst + ((size_t)i * nb + b) * SL_Q3K_TB;
            for (uint32_t q = 0; q < SL_Q3K_TB; q++) tb[q] = sl_emu_q3_k_tb_byte(blk0, stride, q);
        }
}

/* dp4a with an unsigned first operand (the kernels' k_dp4a_us) */
static int dp4a_us(uint32_t a, uint32_t b, int c)
{
    for (int k = 0; k < 4; k++) c += (int)((a >> (8 * k)) & 255) * (int)(int8_t)(b >> (8 * k));
    return c;
}

static uint32_t rd32(const void *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

float sl_emu_dot_q3_k_tb(const uint8_t *tile, uint32_t r, uint32_t nb, const sl_emu_act *act)
{
    const uint32_t p = r >> 1, rr = r & 1;
    const int lsh = (int)(4 * (p & 1) + 2 * rr), hsh = (int)r; /* the row's fields */
    const uint32_t ml = 0x03030303u << lsh, mh = 0x01010101u << hsh;
    float acc[8];
    for (int g = 0; g < 8; g++) { /* lane 8p + g */
        acc[g] = 0.0f;
        for (uint32_t b = 0; b < nb; b++) {
            const uint8_t *tb = tile + (size_t)b * SL_Q3K_TB;
            const int8_t *a = act->qs + 256 * b + 32 * g;
            int c[2];
            for (int v = 0; v < 2; v++) {
                int lo = 0, hi = 0;
                for (int u = 0; u < 4; u++) {
                    const uint32_t aw = rd32(a + 16 * v + 4 * u);
                    const int at = 128 * v + 16 * g + 4 * u;
                    lo = dp4a_us(rd32(tb + 256 * (p >> 1) + at) & ml, aw, lo);
                    hi = dp4a_us(~rd32(tb + 512 + at) & mh, aw, hi);
                }
                c[v] = lo / (1 << lsh) - 4 * (hi / (1 << hsh)); /* exact multiples */
            }
            const uint32_t l = 8 * p + g;
            const uint32_t z =
                (tb[768 + 2 * l] | tb[769 + 2 * l] << 8 | tb[832 + l] << 16) >> (12 * rr);
            const int isum = ((int)(z & 63) - 32) * c[0] + ((int)((z >> 6) & 63) - 32) * c[1];
            acc[g] = sl_emu_q3_k_step(acc[g], f16_at(tb + 864 + 2 * r), isum, act->d[8 * b + g]);
        }
    }
    return butterfly(acc, 8);
}

void sl_emu_embed_q2_k(const uint8_t *row, uint32_t dim, uint16_t *out)
{
    for (uint32_t i = 0; i < dim; i++)
        out[i] = sl_emu_bf16_bits(sl_emu_q2_k_value(row + (size_t)(i / 256) * 84, i % 256));
}
