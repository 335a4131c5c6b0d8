/* alpha-entmax attention rows with exact thresholds: a decoding step in one pass over the cache, and the rows of a
   prefill's blocks from their scores (hf_sparsemax.attention.fused).

   For each batch row b and kv head h (in parallel), its R query rows (the G query heads of the group, q rows
   each) are scored against every cached key, each key row read once:

       s_ij = scaling * <q_i, k_j> + mask_ij        (a key whose mask is at or below `masked` is not seen)

   then, per row, with m = max_j s_j and z_j = (alpha - 1)(s_j - m) in double:

       p_j = relu(z_j - tau) ** (1 / (alpha - 1)),   out_i = sum_j p_j v_j,

   where tau in [-1, 0) is the exact threshold (sum_j p_j = 1). Since tau >= -1, a key with z_j <= -1 has
   weight exactly 0: only the candidates z_j > -1 are collected and solved, and only their value rows are read.
   Sparsemax and 1.5-entmax rows with few candidates (at most `sort_below`) take the closed forms on the sorted
   candidates; other rows Newton's method on the candidates in a bisection bracket until a step moves tau by at
   most `tolerance` (the eager solver's rule; Michelot's algorithm for sparsemax). A row that sees no key gets 0; a
   row with a NaN or +inf score gets NaN. Keys and values are float32 or bfloat16 (widened exactly). A call
   returns 1 only where memory could not be had (the caller then takes its general path).

   Both entry points take one argument, hf_sparsemax_params: its declaration is generated from the Python side's
   FIELDS (hf_sparsemax.attention.fused) into the header included below, and so are the solver's constants
   (tolerance, max_iter, candidate_margin, sort_below): nothing here restates them. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hf_sparsemax_params.h"

/* The size the library was built for: the loader compares it with its own struct before any call. */
int64_t hf_sparsemax_params_size(void) { return (int64_t)sizeof(hf_sparsemax_params); }

typedef struct {
    double z;
    int64_t j;
} candidate;

static int by_z_descending(const void *a, const void *b) {
    double x = ((const candidate *)a)->z, y = ((const candidate *)b)->z;
    return (x < y) - (x > y);
}

static inline float widen(const void *base, int64_t offset, int bf16) {
    if (!bf16) return ((const float *)base)[offset];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[offset] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* tau of the candidates sorted descending (z[0] = 0 >= z[1] >= ..., n of them, all > -candidate_margin): the
   closed forms of sparsemax and 1.5-entmax (a candidate at or below -1 never enters the support). */
static double closed_form(const candidate *c, int64_t n, double alpha) {
    double s1 = 0.0, s2 = 0.0, tau = -1.0;
    for (int64_t k = 0; k < n; k++) {
        double z = c[k].z, kk = (double)(k + 1);
        s1 += z;
        s2 += z * z;
        if (alpha == 2.0) { /* sparsemax: the largest k with 1 + k z_k > sum_{i<=k} z_i; tau = (sum - 1) / k */
            if (1.0 + kk * z > s1) tau = (s1 - 1.0) / kk;
            else break;
        } else { /* 1.5-entmax on z = (x - max) / 2: tau = mean - sqrt(1/k - var) on the support */
            if (s2 - 2.0 * z * s1 + kk * z * z < 1.0) {
                double mean = s1 / kk, spread = 1.0 / kk - (s2 / kk - mean * mean);
                tau = mean - sqrt(spread > 0.0 ? spread : 0.0);
            } else break;
        }
    }
    return tau;
}

/* tau of candidates in any order, any alpha in (1, 2]: Newton's method on the convex, decreasing
   h(tau) = (sum relu(z - tau) ** beta) ** (alpha - 1) - 1 from tau = -1 (h >= 0 there), inside the bracket
   [lo, hi] (a bisection step where Newton's leaves it), until a step moves tau by at most p->tolerance, at most
   p->max_iter steps (the eager solver's rule and cap). For sparsemax (beta = 1) this is Michelot's algorithm; beta = 1 and 2 need no pow.
   Every later tau lies in [lo, hi], so a candidate at or below lo adds 0 to every later sum: once a pass finds
   h > 0 (lo = tau), the candidates it found at or below tau are dropped (moved past the *n kept ones, which
   keep their order). From tau = -1, Newton's iterates rise to the root, so most passes drop keys: a row with
   many candidates (alpha near 1, flat rows) costs about two passes over them, not one per step. */
static double newton(candidate *c, int64_t *count, double alpha, const hf_sparsemax_params *p) {
    double am1 = alpha - 1.0, beta = 1.0 / am1, lo = -1.0, hi = 0.0, tau = -1.0;
    int64_t n = *count;
    for (int64_t it = 0; it < p->max_iter; it++) {
        double total = 0.0, slope = 0.0;
        int64_t kept = 0;
        for (int64_t k = 0; k < n; k++) {
            double u = c[k].z - tau;
            if (u <= 0.0) continue;
            if (kept != k) { /* the kept ones to the front, in order; the others behind them */
                candidate swap = c[kept];
                c[kept] = c[k];
                c[k] = swap;
            }
            kept++;
            double power = beta == 1.0 ? 1.0 : beta == 2.0 ? u : pow(u, beta - 1.0); /* u ** (beta - 1) */
            total += power * u;
            slope += power;
        }
        double norm = alpha == 2.0 ? total : alpha == 1.5 ? sqrt(total) : pow(total, am1), h = norm - 1.0;
        if (h > 0) {
            lo = tau;
            n = kept; /* the others are at or below lo: weight 0 at every tau from here on */
        } else {
            hi = tau;
        }
        double step = (lo + hi) / 2.0;
        if (slope > 0) {
            double proposal = tau + h * (total / norm) / slope;
            if (proposal >= lo && proposal <= hi) step = proposal;
        }
        int converged = fabs(step - tau) <= p->tolerance;
        tau = step;
        if (converged) break;
    }
    *count = n;
    return tau;
}

/* One row of scores s[0..keys) (masked keys at or below p->masked) to out_i = sum_j p_j v_j, the value rows at
   value + j * v_n; `chosen` holds up to `keys` candidates, z_j > -p->candidate_margin (tau >= -1; a margin for
   rounding). Sparsemax and 1.5-entmax rows with at most p->sort_below candidates take the closed form on the
   sorted candidates, the others Newton's method. Where tau_out is not NULL, the row's tau goes there (NaN where
   the row has none: it sees no key, or holds NaN / +inf). */
static void attend_row(const float *s, int64_t keys, double alpha, candidate *chosen, const void *value,
                       const int64_t *slot_row, const hf_sparsemax_params *p, float *oi, double *tau_out) {
    int64_t v_n = p->v_n, value_dim = p->value_dim;
    int bf16 = p->bf16;
    float masked = p->masked;
    float top = -INFINITY;
    int broken = 0;
    for (int64_t j = 0; j < keys; j++) {
        if (isnan(s[j]) || s[j] == INFINITY) broken = 1;
        if (s[j] > top) top = s[j];
    }
    if (tau_out) *tau_out = NAN; /* until solved: rows with NaN or +inf, and rows that see no key */
    if (broken) {
        for (int64_t d = 0; d < value_dim; d++) oi[d] = NAN;
        return;
    }
    memset(oi, 0, sizeof(float) * value_dim);
    if (top <= masked) return; /* sees no key */
    double am1 = alpha - 1.0;
    int64_t n = 0;
    for (int64_t j = 0; j < keys; j++) {
        double z = ((double)s[j] - (double)top) * am1; /* exact difference, as the eager solver's */
        if (z > -p->candidate_margin) {
            chosen[n].z = z;
            chosen[n++].j = j;
        }
    }
    double tau;
    if ((alpha == 2.0 || alpha == 1.5) && n <= p->sort_below) {
        qsort(chosen, n, sizeof(candidate), by_z_descending);
        tau = closed_form(chosen, n, alpha);
    } else {
        tau = newton(chosen, &n, alpha, p); /* n: the candidates above the bracket's low end */
    }
    if (tau_out) *tau_out = tau;
    double beta = 1.0 / am1;
    for (int64_t k = 0; k < n; k++) {
        double u = chosen[k].z - tau;
        if (u <= 0.0) continue;
        float weight = (float)(alpha == 2.0 ? u : alpha == 1.5 ? u * u : pow(u, beta));
        int64_t at = (slot_row ? slot_row[chosen[k].j] : chosen[k].j) * v_n;
        for (int64_t d = 0; d < value_dim; d++) oi[d] += weight * widen(value, at + d, bf16);
    }
}

/* A decoding step: query [batch, kv_heads, rows, dim] (rows: the G query heads' q_rows rows each), keys and
   values through their strides, an additive mask through its strides (or NULL), alphas one per query head (or
   NULL: fixed_alpha); out [batch, kv_heads, rows, value_dim]. */
int hf_sparsemax_decode(const hf_sparsemax_params *p) {
    int64_t kv_heads = p->kv_heads, rows = p->rows, keys = p->keys, dim = p->dim, q_rows = p->q_rows;
    const float *mask = p->mask;
    int stopped = 0;
#pragma omp parallel for num_threads(p->threads) schedule(static) reduction(| : stopped)
    for (int64_t task = 0; task < p->batch * kv_heads; task++) {
        int64_t b = task / kv_heads, h = task % kv_heads;
        const float *q = p->query + task * rows * dim;
        const int64_t *slot_row = p->slots ? p->slots + b * p->s_b : NULL; /* key j's row: slot_row[j] (paged) */
        float *scores = malloc(sizeof(float) * rows * keys);
        float *row = malloc(sizeof(float) * dim);
        candidate *chosen = malloc(sizeof(candidate) * (keys + 1));
        const float **mask_rows = malloc(sizeof(float *) * rows);
        if (!scores || !row || !chosen || !mask_rows) {
            stopped = 1;
            free(scores), free(row), free(chosen), free(mask_rows);
            continue;
        }
        for (int64_t i = 0; mask && i < rows; i++) /* row i: query head i / q_rows of the group, its row i % q_rows */
            mask_rows[i] = mask + b * p->m_b + h * p->m_h + (i / q_rows) * p->m_g + (i % q_rows) * p->m_r;
        for (int64_t j = 0; j < keys; j++) { /* each key row read once, scored by every query row */
            int64_t at = b * p->k_b + h * p->k_h + (slot_row ? slot_row[j] : j) * p->k_n;
            const float *kj = (const float *)p->key + at;
            if (p->bf16) {
                for (int64_t d = 0; d < dim; d++) row[d] = widen(p->key, at + d, 1);
                kj = row;
            }
            for (int64_t i = 0; i < rows; i++) {
                const float *qi = q + i * dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < dim; d++) acc += qi[d] * kj[d];
                float s = acc * p->scaling;
                if (mask) {
                    float m = mask_rows[i][j * p->m_n];
                    s = m <= p->masked ? -INFINITY : s + m;
                }
                scores[i * keys + j] = s;
            }
        }
        const void *v = p->bf16 ? (const void *)((const uint16_t *)p->value + b * p->v_b + h * p->v_h)
                                : (const void *)((const float *)p->value + b * p->v_b + h * p->v_h);
        for (int64_t i = 0; i < rows; i++) {
            double alpha = p->alphas ? (double)p->alphas[h * (rows / q_rows) + i / q_rows] : p->fixed_alpha;
            int64_t at = task * rows + i;
            attend_row(scores + i * keys, keys, alpha, chosen, v, slot_row, p, p->out + at * p->value_dim,
                       p->taus ? p->taus + at : NULL);
        }
        free(scores), free(row), free(chosen), free(mask_rows);
    }
    return stopped;
}

/* Rows of scores already computed (a prefill's block: scores [batch * kv_heads, rows, keys], masked entries at or
   below p->masked), task = b * kv_heads + h reading the value rows value + b * v_b + h * v_h + j * v_n; alphas one
   per query head as in a decoding step (row i of a task: the group's query head i / q_rows), or NULL: fixed_alpha
   for all; out [batch * kv_heads, rows, value_dim]. */
int hf_sparsemax_rows(const hf_sparsemax_params *p) {
    int64_t kv_heads = p->kv_heads, rows = p->rows, keys = p->keys, tasks = p->batch * p->kv_heads;
    int stopped = 0;
#pragma omp parallel num_threads(p->threads) reduction(| : stopped)
    {
        candidate *chosen = malloc(sizeof(candidate) * (keys + 1));
        if (!chosen) stopped = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < tasks * rows; r++) {
            if (stopped) continue;
            int64_t task = r / rows, b = task / kv_heads, h = task % kv_heads;
            const void *v = p->bf16 ? (const void *)((const uint16_t *)p->value + b * p->v_b + h * p->v_h)
                                    : (const void *)((const float *)p->value + b * p->v_b + h * p->v_h);
            double alpha = p->alphas ? (double)p->alphas[h * (rows / p->q_rows) + (r % rows) / p->q_rows]
                                     : p->fixed_alpha;
            attend_row(p->scores + r * keys, keys, alpha, chosen, v, p->slots ? p->slots + b * p->s_b : NULL, p,
                       p->out + r * p->value_dim,
                       p->taus ? p->taus + r : NULL);
        }
        free(chosen);
    }
    return stopped;
}
