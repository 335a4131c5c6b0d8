/* alpha-entmax attention rows with exact thresholds: a decoding step in one pass over the cache, and the rows of a
   prefill's blocks from their scores (hf_sparsemax.attention.fused).

   For each batch row b and kv head h (in parallel), its R query rows (the G query heads of the group, q rows
   each) are scored against every cached key, each key row read once:

       s_ij = scaling * <q_i, k_j> + mask_ij        (a key whose mask is at or below `masked` is not seen)

   then, per row, with m = max_j s_j and z_j = (alpha - 1)(s_j - m) in double:

       p_j = relu(z_j - tau) ** (1 / (alpha - 1)),   out_i = sum_j p_j v_j,

   where tau in [-1, 0) is the exact threshold (sum_j p_j = 1). Since tau >= -1, a key with z_j <= -1 has
   weight exactly 0: only the candidates z_j > -1 are collected; of those, only the ones above a floor of tau
   taken from the candidates' counts near the top (tau_floor: in a flat row, far above -1) are solved, and only
   the support's value rows are read.
   Sparsemax and 1.5-entmax rows with few candidates (at most `sort_below`) take the closed forms on the sorted
   candidates; other rows Newton's method on the candidates in a bisection bracket until a step moves tau by at
   most `tolerance` (the eager solver's rule; Michelot's algorithm for sparsemax). A row that sees no key gets 0; a
   row with a NaN or +inf score gets NaN. Keys and values are float32 or bfloat16 (widened exactly). A call
   returns 1 only where memory could not be had (the caller then takes its general path).

   Both entry points take one argument, hf_sparsemax_params: its declaration is generated from the Python side's
   FIELDS (hf_sparsemax.attention.fused) into the header included below, and so are the solver's constants
   (tolerance, max_iter, candidate_margin, sort_below): nothing here restates them. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The generated header, by the absolute path the build passes (kernel_build.py): never a stray file beside this
   source, which a quoted name would find first. */
#include HF_SPARSEMAX_PARAMS

/* The size the library was built for: the loader compares it with its own struct before any call. */
int64_t hf_sparsemax_params_size(void) { return (int64_t)sizeof(hf_sparsemax_params); }

typedef struct {
    double z;
    int64_t j;
} candidate;

enum { CHUNK = 16 }; /* scores a candidate test, candidates a weights pass (a few vectors: no solver constant) */

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

/* The coefficients, highest power first: ln m / (2 s) = sum_i s^(2i) / (2i + 1), i <= 9; exp r = sum_i r^i / i!,
   i <= 13 (each rounded once, by the compiler). */
static const double LOG_SERIES[] = {1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13, 1.0 / 11, 1.0 / 9, 1.0 / 7, 1.0 / 5,
                                    1.0 / 3, 1.0};
static const double EXP_SERIES[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                    1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                                    1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};

static inline double horner(const double *coefficient, int terms, double x) {
    double sum = coefficient[0];
    for (int i = 1; i < terms; i++) sum = sum * x + coefficient[i];
    return sum;
}

/* u ** e for finite u >= DBL_MIN and e >= -1 with u ** e <= 2^1000 (the solver's u = z - tau lie in (0, 2)), as
   2^(e log2 u) in double arithmetic alone, so that a loop of them vectorises (libm's pow is a call per element):

       u = 2^k m, m in [sqrt(1/2), sqrt(2)),   ln m = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...),  s = (m - 1)/(m + 1),

   |s| <= 0.1716, s^2 <= 0.02944: the terms to s^19 leave a relative remainder below 0.02944^10 / 21 < 3e-17; then
   y = e (k + ln m / ln 2), y = n + f (n the nearest integer, f = y - n exact, |f| <= 1/2) and 2^f = exp(r),
   r = f ln 2, |r| <= 0.3466, by its Taylor series to r^13 (remainder below 0.3466^14 / 14! < 5e-18), times 2^n
   built in the exponent bits. Rounding: ln m carries a relative error of a few u (u = 2^-53: m - 1 is exact, m + 1,
   the quotient and the Horner steps round once each, the terms decreasing by s^2), k + ln m / ln 2 at most 10 u of
   itself (|k + log2 m| >= |log2 m| and >= |k| / 2), so y carries an absolute error below 11 u |y|, and the result a
   relative error below (8 |y| + 4) u (11 ln 2 |y| u < 8 |y| u from y, 4 u from r and the series): below 1e-14 for every
   result above 2^-9, and an absolute error below 2e-15 for u <= 1, e >= 0 (8 |y| 2^-|y| <= 4.3). A result below
   2^-1022 is flushed to 0 (absolute error below 2^-1022). NaN, inf and u <= 0 are not in the domain: the caller
   never passes them (rows with NaN or +inf scores are not solved, u > 0 is tested). */
static inline double power(double u, double e) {
    uint64_t bits, mantissa, at;
    memcpy(&bits, &u, sizeof bits);
    mantissa = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL; /* m in [1, 2) */
    at = 0x4330000000000000ULL | (bits >> 52);                          /* 2^52 + the biased exponent, exactly */
    double m, k;
    memcpy(&m, &mantissa, sizeof m);
    memcpy(&k, &at, sizeof k);
    k -= 0x1p52 + 1023.0;
    int high = m > 0x1.6a09e667f3bcdp+0; /* sqrt(2) */
    m = high ? 0.5 * m : m;
    k = high ? k + 1.0 : k;
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double series = horner(LOG_SERIES, sizeof LOG_SERIES / sizeof *LOG_SERIES, s2);
    double y = e * (k + (2.0 * s * series) * 0x1.71547652b82fep+0); /* 1 / ln 2 */
    y = y < -1080.0 ? -1080.0 : y > 1000.0 ? 1000.0 : y;
    double shifted = y + 0x1.8p52, n = shifted - 0x1.8p52; /* n: y rounded to the nearest integer */
    double r = (y - n) * 0x1.62e42fefa39efp-1;               /* ln 2 */
    double t = horner(EXP_SERIES, sizeof EXP_SERIES / sizeof *EXP_SERIES, r);
    uint64_t scale_bits;
    memcpy(&scale_bits, &shifted, sizeof scale_bits);
    scale_bits = (scale_bits - 0x4338000000000000ULL + 1023) << 52; /* 2^n, where n >= -1022 */
    double scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return n < -1022.0 ? 0.0 : t * scale;
}

/* out[i] = power(u[i], e) for i < n (u[i] in power's domain): the tests pin power to libm's pow through it. */
void hf_sparsemax_power(const double *u, int64_t n, double e, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = power(u[i], e);
}

/* Over c[0..n), u_k = relu(z_k - tau): the sums F = sum u ** beta, S1 = sum u ** (beta - 1) and
   S2 = sum_{u > 0} u ** (beta - 2), beta = 1 / (alpha - 1) >= 1 (no pow for beta 1 and 2), in a loop that
   vectorises. */
static void power_sums(const candidate *c, int64_t n, double tau, double beta, double *sums) {
    double f = 0.0, s1 = 0.0, s2 = 0.0, e = beta - 2.0;
    if (beta == 1.0 || beta == 2.0) {
#pragma omp simd reduction(+ : f, s1, s2)
        for (int64_t k = 0; k < n; k++) {
            double u = c[k].z - tau, w = u > 0.0 ? (beta == 1.0 ? 1.0 : u) : 0.0; /* S2: beta 2 only */
            f += w * u;
            s1 += w;
            s2 += u > 0.0 && beta == 2.0;
        }
    } else {
#pragma omp simd reduction(+ : f, s1, s2)
        for (int64_t k = 0; k < n; k++) {
            double u = c[k].z - tau, v = u > 0.0 ? power(u > 0.0 ? u : 1.0, e) : 0.0, w = v * u;
            f += w * u;
            s1 += w;
            s2 += v;
        }
    }
    sums[0] = f;
    sums[1] = s1;
    sums[2] = s2;
}

/* The weights relu(z_k - tau) ** (e + 1) of c[0..count), e = 1 / (alpha - 1) - 1 (no pow for alpha 2 and 1.5),
   in w (-1 where z_k <= tau), in a loop that vectorises. */
static void support_weights(const candidate *c, int64_t count, double tau, double alpha, double e, double *w) {
    if (alpha == 2.0 || alpha == 1.5) {
#pragma omp simd
        for (int64_t k = 0; k < count; k++) {
            double u = c[k].z - tau;
            w[k] = u > 0.0 ? (alpha == 2.0 ? u : u * u) : -1.0;
        }
    } else {
#pragma omp simd
        for (int64_t k = 0; k < count; k++) {
            double u = c[k].z - tau;
            w[k] = u > 0.0 ? u * power(u > 0.0 ? u : 1.0, e) : -1.0;
        }
    }
}

/* The floor of a row's threshold from its candidates (z <= 0, the row's largest 0): tau is at least
       -c - n_c ** (1 - alpha)
   for every c > 0 and n_c the number of candidates with z > -c (were tau below it, each of those n_c keys would
   weigh (z - tau) ** (1 / (alpha - 1)) > 1 / n_c, together more than 1). At c = k / FLOOR_LEVELS, k = 1 ..
   FLOOR_LEVELS - 1, from the counts per level (level[b]: the candidates whose smallest such k is b, b =
   floor(-z FLOOR_LEVELS) + 1, exact: a power of two), the largest of these and -1 (the bound at c -> 0 for the
   row's largest key). A row of many near-equal scores has tau near 0 (n keys tied at the top: -n ** (1 - alpha)),
   where -1 keeps every key within 1 / (alpha - 1) of the top a candidate. The floor depends only on the
   candidates above -c* (c* the level that gives it) and on no candidate's position: any key below the floor
   dropped beforehand, the same keys give the same floor, bit for bit (the certificate below drops such keys). */
static const double NO_FLOOR = -1.0; /* tau >= -1 at any rate: the row's largest weight is at most 1 */

static inline int64_t floor_level(double z) {
    double b = floor(-z * (double)FLOOR_LEVELS) + 1.0;
    return b < (double)FLOOR_LEVELS ? (int64_t)b : FLOOR_LEVELS; /* FLOOR_LEVELS: in no level (z <= -1 + 1/L) */
}

static double tau_floor(const int64_t *level, double alpha) {
    double best = NO_FLOOR;
    int64_t n = 0;
    for (int64_t k = 1; k < FLOOR_LEVELS; k++) {
        if (level[k] == 0) continue; /* the same count as the level before, at a lower level: a lower bound */
        n += level[k];
        double count = (double)n, share = alpha == 2.0 ? 1.0 / count
                                          : alpha == 1.5 ? 1.0 / sqrt(count) : pow(count, 1.0 - alpha);
        double bound = -(double)k / (double)FLOOR_LEVELS - share;
        best = bound > best ? bound : best;
    }
    return best;
}

/* tau of candidates in any order, any alpha in (1, 2]: Halley's method (Newton's where its correction is large) on
   the convex, decreasing h(tau) = F ** (alpha - 1) - 1, F = sum relu(z - tau) ** beta, from tau = start (at or
   below the root: -1 or the candidates' floor less its margin; h >= 0 there), inside the bracket [lo, hi] (a
   bisection step where a step does not land strictly inside it, unless it moves tau by at most the tolerance),
   until a step moves tau by at most p->tolerance, at most p->max_iter steps (the eager solver's rule and cap).
   With S1, S2 of power_sums, h' = -F ** (alpha - 2) S1 and h'' = (beta - 1) F ** (alpha - 3) (F S2 - S1^2) >= 0
   (Cauchy-Schwarz), so Halley's step is Newton's, h F ** (2 - alpha) / S1 = h (F / norm) / S1, divided by 1 - b with
   b = h h'' / (2 h'^2) = h (beta - 1) (F S2 / S1^2 - 1) / (2 norm): used where |b| < 1/2. For sparsemax (beta = 1,
   b = 0) this is Michelot's algorithm. Every later tau lies in [lo, hi], so a candidate at or below lo adds 0 to
   every later sum: once a pass finds h > 0 (lo = tau), the candidates at or below tau are dropped (the *n kept
   ones keep their order). The iterates rise to the root from tau = -1, so most passes drop keys: a row with many
   candidates (alpha near 1, flat rows) costs about two passes over them, not one per step. */
static double newton(candidate *c, int64_t *count, double alpha, double start, const hf_sparsemax_params *p) {
    double am1 = alpha - 1.0, beta = 1.0 / am1, lo = start, hi = 0.0, tau = start;
    int64_t n = *count;
    for (int64_t it = 0; it < p->max_iter; it++) {
        double sums[3];
        power_sums(c, n, tau, beta, sums);
        double total = sums[0], slope = sums[1];
        double norm = alpha == 2.0 ? total : alpha == 1.5 ? sqrt(total) : pow(total, am1), h = norm - 1.0;
        if (h > 0) {
            lo = tau;
            int64_t kept = 0;
            for (int64_t k = 0; k < n; k++) { /* the kept ones to the front, in order */
                c[kept] = c[k];
                kept += c[k].z > tau;
            }
            n = kept; /* the others are at or below lo: weight 0 at every tau from here on */
        } else {
            hi = tau;
        }
        double step = (lo + hi) / 2.0;
        if (slope > 0) {
            double newton_step = h * (total / norm) / slope;
            double bend = h * (beta - 1.0) * (total * sums[2] / (slope * slope) - 1.0) / (2.0 * norm);
            double proposal = tau + (bend < 0.5 && bend > -0.5 ? newton_step / (1.0 - bend) : newton_step);
            /* strictly inside the bracket, or a converging step: a proposal back at the end the iterate left
               (Halley's step from -1 overshooting to just under the top, Newton's from there landing on -1 exactly
               where only the top key is left) would cycle between the two to max_iter */
            if ((proposal > lo && proposal < hi) || fabs(proposal - tau) <= p->tolerance) step = proposal;
        }
        int converged = fabs(step - tau) <= p->tolerance;
        tau = step;
        if (converged) break;
    }
    *count = n;
    return tau;
}

/* One row of scores s[0..keys) (masked keys at or below p->masked) to out_i = sum_j p_j v_j, the value rows at
   value + key * v_n, key = index[j] (index NULL: j), or slot_row[key] in a paged cache (slot_row not NULL; an
   index ascending keeps the candidates' order);
   `chosen` holds up to `keys` candidates, z_j > -p->candidate_margin (tau >= -1; a margin for
   rounding). Sparsemax and 1.5-entmax rows with at most p->sort_below candidates take the closed form on the
   sorted candidates, the others Newton's method. Where tau_out is not NULL, the row's tau goes there (NaN where
   the row has none: it sees no key, or holds NaN / +inf). */
static void attend_keys(const float *s, int64_t keys, const int64_t *index, double alpha, candidate *chosen,
                        const void *value, const int64_t *slot_row, const hf_sparsemax_params *p, float *oi,
                        double *tau_out) {
    int64_t v_n = p->v_n, value_dim = p->value_dim;
    int bf16 = p->bf16;
    float masked = p->masked;
    float top = -INFINITY;
    int broken = 0;
#pragma omp simd reduction(max : top) reduction(| : broken)
    for (int64_t j = 0; j < keys; j++) { /* (top is not used where a score is NaN) */
        broken |= !(s[j] < INFINITY);
        top = s[j] > top ? s[j] : top;
    }
    if (tau_out) *tau_out = NAN; /* until solved: rows with NaN or +inf, and rows that see no key */
    if (broken) {
        for (int64_t d = 0; d < value_dim; d++) oi[d] = NAN;
        return;
    }
    memset(oi, 0, sizeof(float) * value_dim);
    if (top <= masked) return; /* sees no key */
    double am1 = alpha - 1.0, margin = -p->candidate_margin;
    /* A score at or below `cut` is no candidate: cut is, for the test below, not one, and the test is monotone in
       the score (each rounding is), so a chunk of scores all at or below it is passed over. */
    float cut = (float)((double)top + margin / am1);
    while (((double)cut - (double)top) * am1 > margin) cut = nextafterf(cut, -INFINITY);
    int64_t n = 0;
    for (int64_t start = 0; start < keys; start += CHUNK) {
        int64_t stop = keys - start < CHUNK ? keys : start + CHUNK;
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int64_t j = start; j < stop; j++) any |= s[j] > cut;
        for (int64_t j = start; any && j < stop; j++) { /* chosen has room for keys + 1: n <= j stays in it */
            double z = ((double)s[j] - (double)top) * am1; /* exact difference, as the eager solver's */
            chosen[n].z = z;
            chosen[n].j = index ? index[j] : j;
            n += z > margin;
        }
    }
    /* The candidates above the floor of tau less the same margin (tau_floor; -1: all of them, as collected) */
    int64_t level[FLOOR_LEVELS + 1] = {0};
    for (int64_t k = 0; k < n; k++) level[floor_level(chosen[k].z)]++;
    double start = NO_FLOOR, floor_tau = tau_floor(level, alpha);
    if (floor_tau > NO_FLOOR) {
        start = floor_tau + (margin + 1.0); /* margin + 1 = 1 - candidate_margin <= 0 */
        int64_t kept = 0;
        for (int64_t k = 0; k < n; k++) { /* in order */
            chosen[kept] = chosen[k];
            kept += chosen[k].z > start;
        }
        n = kept;
    }
    double tau;
    if ((alpha == 2.0 || alpha == 1.5) && n <= p->sort_below) {
        qsort(chosen, n, sizeof(candidate), by_z_descending);
        tau = closed_form(chosen, n, alpha);
    } else {
        tau = newton(chosen, &n, alpha, start, p); /* n: the candidates above the bracket's low end */
    }
    if (tau_out) *tau_out = tau;
    double e = 1.0 / am1 - 1.0, weights[CHUNK];
    for (int64_t start = 0; start < n; start += CHUNK) { /* the weights of a chunk of candidates (-1: not in the */
        int64_t count = n - start < CHUNK ? n - start : CHUNK; /* support), then their value rows */
        support_weights(chosen + start, count, tau, alpha, e, weights);
        for (int64_t k = 0; k < count; k++) {
            if (weights[k] < 0.0) continue;
            float weight = (float)weights[k];
            int64_t j = chosen[start + k].j, at = (slot_row ? slot_row[j] : j) * v_n;
            for (int64_t d = 0; d < value_dim; d++) oi[d] += weight * widen(value, at + d, bf16);
        }
    }
}

/* attend_keys over all the keys of a row of scores (index NULL: score j is key j). */
static void attend_row(const float *s, int64_t keys, double alpha, candidate *chosen, const void *value,
                       const int64_t *slot_row, const hf_sparsemax_params *p, float *oi, double *tau_out) {
    attend_keys(s, keys, NULL, alpha, chosen, value, slot_row, p, oi, tau_out);
}

/* The exact scores of the keys [from, to) of task (b, h) for its `rows` query rows q, written to
   scores[i * keys + j]: s_ij = fl(fl(sum_d q_id k_jd) * scaling) (+ m_ij, or -inf where masked). Not inlined, so
   that the full step and the certified step compute every score with the same instructions (the same value). */
__attribute__((noinline)) static void score_keys(const hf_sparsemax_params *p, int64_t b, int64_t h,
                                                 const float *q, const float *const *mask_rows, int64_t from,
                                                 int64_t to, float *row, float *scores) {
    int64_t rows = p->rows, keys = p->keys, dim = p->dim;
    const int64_t *slot_row = p->slots ? p->slots + b * p->s_b : NULL; /* key j's row: slot_row[j] (paged) */
    for (int64_t j = from; j < to; j++) { /* each key row read once, scored by every query row */
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
            if (p->mask) {
                float m = mask_rows[i][j * p->m_n];
                s = m <= p->masked ? -INFINITY : s + m;
            }
            scores[i * keys + j] = s;
        }
    }
}

/* ---- The int8 key certificate ------------------------------------------------------------------------------

   Each cached key k (dim channels) has an int8 copy c = round(k / s_k), |c_d| <= 127, with the scale
   s_k = max_d |k_d| / 127 (float32), kept beside the cache (codes, code_scales) and written by quantise_keys as
   keys are appended. Per task (batch row, kv head) code_bounds holds rho = max_k ||k - s_k c||_2 / s_k (the
   largest rounding residual in units of the key's scale, <= sqrt(dim) / 2) and kappa = max_k ||c||_2, both rounded
   up; a crop keeps them (still upper bounds), a rebuild (coded = 0) starts them again.

   A query row q is quantised with int16 codes e = round(q / s_q), s_q = max_d |q_d| / 32767 (int16 rather than
   int8: the integer product costs the same sign extension and vpmaddwd either way, and the query's rounding term
   below becomes 256 times smaller). The integer product a = sum_d e_d c_d is exact in int32 (|a| <= dim 32767 127
   < 2^31 for dim <= 512), and t = scaling s_q s_k a (+ m) approximates the kernel's float score s (score_keys).

   The bound. Write q' = s_q e, r_q = q - q', k' = s_k c, r_k = k - k' (real numbers). Then
       q.k = q.k' + q.r_k = q'.k' + r_q.k' + q.r_k,   so   |q.k - s_q s_k a| <= ||q|| ||r_k|| + ||r_q|| ||k'||
                                                                        <= s_k (||q|| rho + ||r_q|| kappa).
   The kernel's s is not q.k: its float32 sum of dim products (any order, fused or not) is within
   gamma ||q|| ||k|| of q.k (gamma = dim u / (1 - dim u), u = 2^-24; sum_d |q_d k_d| <= ||q|| ||k|| by
   Cauchy-Schwarz, ||k|| <= s_k (rho + kappa)), then scaled and added to m with one rounding each (u |result|).
   t is computed in float32 (s_q scaling rounded once, then three operations: within 5u (|t| + |m|); the int32
   product converted exactly up to 2^24, within u beyond). Hence, with
       E = (1 + 1e-6) [ s_k A_q + 1e-5 (|t| + |m|) ],
       A_q = scaling (||q|| rho + ||r_q|| kappa + 2 (dim + 4) u ||q|| (rho + kappa)),
   (the norms computed in double and rounded up, A_q then rounded to float32), every score the full step computes
   lies in [t - E, t + E]: the 1e-5 term is over 20 times the roundings of t, of the scaling and of the mask's
   addition, and the factor (1 + 1e-6) covers the roundings of E, t - E and t + E in float32 (a few u each).

   The certificate. Per query row, M = max_j (t_j - E_j) <= max_j s_j (the row's max, `top` in attend_row). The
   full step solves over the keys with z_j = (alpha - 1)(s_j - top) > f - (candidate_margin - 1), f the floor of
   tau (tau_floor, -1 at least) of its candidates. Let U_max = max_j (t_j + E_j) >= top and count the keys with
   (alpha - 1)(t_j - E_j - U_max) > -k / FLOOR_LEVELS: each is a key the full step counts at level k (its z is at
   least that; the differences exact in double, the product's rounding monotone), so the floor f' of these counts
   is at most f (tau_floor grows with the counts). A key with (alpha - 1)(t_j + E_j - M) <= f' - (candidate_margin
   - 1) - 1e-9 (the cut M - (candidate_margin - 1 - f' + 1e-9) / (alpha - 1) rounded down to float32) then has
   z_j <= f - (candidate_margin - 1) (the 1e-9: z's rounding in double): the full step does not solve over it
   (f' = -1: the cut at -candidate_margin, no candidate at all). A key certified so for every query row of its
   kv head is never read, and left out of the rows handed to the solver (attend_keys over the kept keys, their
   indices ascending). Every other key is scored exactly by score_keys (the row's maximum among them: its
   t + E >= s_max >= M). The certified step's floor is the full step's, bit for bit: the level k* that gives f
   counts the keys above -k* / FLOOR_LEVELS > f, none certified, so the same number; every other level counts
   at most as many as in the full step (it gives at most f). So the certified step hands the solver the same
   keys with the same scores, in the same order, as the full step: the same threshold and the same output, bit
   for bit. A NaN or infinite key or
   query gives a NaN bound, which certifies nothing (the comparisons are written so), and the full step's NaN
   output follows.

   Overflow. The bound above is float32's error analysis, which assumes no sum overflows; a huge key can overflow
   the full step's float32 sum while its true score is small (q.k = 0 from +-3e38 entries: the full step's score
   inf or NaN, its row NaN; its t + E finite, so certified). Every partial sum of the full step's score, its
   scaling and the mask's addition stay below
       R = 2 max(1, |scaling|) ||q|| s_k (rho + kappa) + |m|
   (each partial sum is at most sum_d |q_d k_d| (1 + gamma) <= ||q|| ||k|| (1 + gamma), ||k|| <= s_k (rho + kappa);
   the factor 2 covers gamma and the roundings of R in float32). A key whose R is not below FLT_MAX (NaN where
   it has no code) is read and scored exactly, and kept out of M (its t - E bounds no score that overflowed):
   the row then sees that key's score as the full step does, inf or NaN included. */

#define UNIT_ROUNDOFF 5.9604644775390625e-08 /* 2^-24, float32's */

/* The codes' layout: per task, blocks of CODE_BLOCK keys (the slots' strides are multiples of it), in a block
   channel pair by channel pair, key by key: channel d of slot j at code_at(j, d). A block's 16 keys then take
   one 32-byte load per channel pair, widened to int16 and multiplied-and-added against the query's pair
   (vpmaddwd: two int16 products summed into each int32 lane, one lane a key), so no horizontal sum is needed. */
#if CODE_BLOCK != 16 /* from the generated header; the vector products below hold 16 keys' int32 sums a register */
#error "CODE_BLOCK must be 16"
#endif
static inline int64_t code_at(int64_t slot, int64_t d, int64_t dim) {
    return (slot - slot % CODE_BLOCK) * dim + (d / 2) * (2 * CODE_BLOCK) + (slot % CODE_BLOCK) * 2 + d % 2;
}

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__)
#define MULTIPLY_ADD(acc, k, q) _mm512_dpwssd_epi32(acc, k, q)
#elif defined(__AVX512BW__)
#define MULTIPLY_ADD(acc, k, q) _mm512_add_epi32(acc, _mm512_madd_epi16(k, q))
#endif

/* out[i * CODE_BLOCK + l] = sum_d e_id c_{l, d}, exact in int32, for the `rows` query rows e (rows x dim int16)
   against the CODE_BLOCK keys of a block (dim even): AVX-512 (with VNNI's vpdpwssd where the build machine has
   it), AVX2, or plain C, chosen at build time (-march=native). The rows go four at a time, so that each channel
   pair of the block is loaded and widened once for up to four rows. AVX-512: each row's sum is two independent
   sums (even and odd channel pairs, added at the end: the same integer), so that eight chains hide the
   multiply-add's latency, and a group of fewer than four rows computes only its own (products_avx512's `count`, a
   constant in each of the four copies the switch makes). */
#define PRODUCT_ROWS 4
#if defined(__AVX512BW__)
static inline __attribute__((always_inline)) void products_avx512(const int16_t *const *r, int64_t count,
                                                                  const int8_t *block, int64_t dim, int32_t *out) {
    __m512i even[PRODUCT_ROWS], odd[PRODUCT_ROWS];
    for (int64_t i = 0; i < count; i++) even[i] = odd[i] = _mm512_setzero_si512();
    int64_t pairs = dim / 2, d2 = 0;
    for (; d2 + 1 < pairs; d2 += 2) {
        __m512i k0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + 2 * CODE_BLOCK * d2)));
        __m512i k1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + 2 * CODE_BLOCK * (d2 + 1))));
        for (int64_t i = 0; i < count; i++) { /* channels 2 d2 .. 2 d2 + 3 of row i, broadcast from memory */
            even[i] = MULTIPLY_ADD(even[i], k0, _mm512_broadcastd_epi32(_mm_loadu_si32(r[i] + 2 * d2)));
            odd[i] = MULTIPLY_ADD(odd[i], k1, _mm512_broadcastd_epi32(_mm_loadu_si32(r[i] + 2 * d2 + 2)));
        }
    }
    if (d2 < pairs) { /* an odd number of channel pairs: the last one */
        __m512i k0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + 2 * CODE_BLOCK * d2)));
        for (int64_t i = 0; i < count; i++)
            even[i] = MULTIPLY_ADD(even[i], k0, _mm512_broadcastd_epi32(_mm_loadu_si32(r[i] + 2 * d2)));
    }
    for (int64_t i = 0; i < count; i++)
        _mm512_storeu_si512((void *)(out + i * CODE_BLOCK), _mm512_add_epi32(even[i], odd[i]));
}
#endif

static void block_products(const int16_t *e, int64_t rows, const int8_t *block, int64_t dim, int32_t *out) {
    for (int64_t first = 0; first < rows; first += PRODUCT_ROWS) {
        const int16_t *r[PRODUCT_ROWS];
        for (int64_t i = 0; i < PRODUCT_ROWS; i++) r[i] = e + (first + i < rows ? first + i : rows - 1) * dim;
        int64_t stored = rows - first < PRODUCT_ROWS ? rows - first : PRODUCT_ROWS;
#if defined(__AVX512BW__)
        int32_t *at = out + first * CODE_BLOCK;
        switch (stored) { /* the group's rows, a constant in each case */
        case 1: products_avx512(r, 1, block, dim, at); break;
        case 2: products_avx512(r, 2, block, dim, at); break;
        case 3: products_avx512(r, 3, block, dim, at); break;
        default: products_avx512(r, 4, block, dim, at); break;
        }
#elif defined(__AVX2__)
        __m256i low[PRODUCT_ROWS], high[PRODUCT_ROWS];
        for (int64_t i = 0; i < PRODUCT_ROWS; i++) low[i] = high[i] = _mm256_setzero_si256();
        for (int64_t d2 = 0; d2 < dim / 2; d2++) {
            const int8_t *at = block + 2 * CODE_BLOCK * d2;
            __m256i k0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)at));
            __m256i k1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + 16)));
            for (int64_t i = 0; i < PRODUCT_ROWS; i++) {
                int32_t pair;
                memcpy(&pair, r[i] + 2 * d2, sizeof pair);
                __m256i q = _mm256_set1_epi32(pair);
                low[i] = _mm256_add_epi32(low[i], _mm256_madd_epi16(k0, q));
                high[i] = _mm256_add_epi32(high[i], _mm256_madd_epi16(k1, q));
            }
        }
        for (int64_t i = 0; i < stored; i++) {
            _mm256_storeu_si256((__m256i *)(out + (first + i) * CODE_BLOCK), low[i]);
            _mm256_storeu_si256((__m256i *)(out + (first + i) * CODE_BLOCK + 8), high[i]);
        }
#else
        for (int64_t i = 0; i < stored; i++) {
            int32_t *o = out + (first + i) * CODE_BLOCK;
            for (int64_t l = 0; l < CODE_BLOCK; l++) o[l] = 0;
            for (int64_t d2 = 0; d2 < dim / 2; d2++) {
                const int8_t *at = block + 2 * CODE_BLOCK * d2;
                for (int64_t l = 0; l < CODE_BLOCK; l++)
                    o[l] += (int32_t)r[i][2 * d2] * at[2 * l] + (int32_t)r[i][2 * d2 + 1] * at[2 * l + 1];
            }
        }
#endif
    }
}

/* The int8 code of one key (the dim entries at p->key + at, float32 or bfloat16) into slot `slot` of the codes
   (code_at) and its scale into code_scales[slot]; returns 1 with *rho = ||k - s_k c|| / s_k and *kappa = ||c||
   (rounded up), or 0 for a key with a NaN or infinite entry, or too small to scale: scale NaN, never certified. */
static int quantise_key(const hf_sparsemax_params *p, int64_t at, int64_t slot, double *rho, double *kappa) {
    int64_t dim = p->dim;
    float top = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        float x = fabsf(widen(p->key, at + d, p->bf16));
        top = x > top || isnan(x) ? x : top;
    }
    float scale = top / 127.0f;
    if (!(top <= FLT_MAX) || (top > 0.0f && !(scale > 0.0f))) { /* NaN or infinite, or underflows */
        for (int64_t d = 0; d < dim; d++) p->codes[code_at(slot, d, dim)] = 0;
        p->code_scales[slot] = NAN;
        return 0;
    }
    double residual = 0.0, norm = 0.0;
    for (int64_t d = 0; d < dim; d++) {
        float x = widen(p->key, at + d, p->bf16);
        float v = scale > 0.0f ? rintf(x / scale) : 0.0f;
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        p->codes[code_at(slot, d, dim)] = (int8_t)v;
        double r = (double)x - (double)scale * (double)v; /* the product exact in double */
        residual += r * r;
        norm += (double)v * (double)v;
    }
    p->code_scales[slot] = scale;
    *rho = scale > 0.0f ? sqrt(residual) / scale * (1.0 + NORM_SLACK) : 0.0;
    *kappa = sqrt(norm) * (1.0 + CODE_NORM_SLACK);
    return 1;
}

/* Write the int8 codes and scales of the keys [p->coded, p->length) of task (b, h) and bring its rho, kappa
   (code_bounds[2 task], [2 task + 1]) up to date (reset first where coded is 0). */
static void quantise_keys(const hf_sparsemax_params *p, int64_t b, int64_t h) {
    double *bounds = p->code_bounds + 2 * (b * p->kv_heads + h), rho, kappa;
    if (p->coded == 0) bounds[0] = bounds[1] = 0.0;
    for (int64_t j = p->coded; j < p->length; j++) {
        if (!quantise_key(p, b * p->k_b + h * p->k_h + j * p->k_n, b * p->c_b + h * p->c_h + j, &rho, &kappa))
            continue;
        if (rho > bounds[0]) bounds[0] = rho;
        if (kappa > bounds[1]) bounds[1] = kappa;
    }
}

/* ---- The certificate per slot of a paged cache (vLLM) ------------------------------------------------------

   A paged cache's slots are shared by the requests over time, so no bound per (batch row, kv head) can be kept
   as keys are appended. Each slot s of kv head h keeps its code at slot h c_h + s of the codes (c_h a multiple
   of CODE_BLOCK), its scale, and its own rho_s rounded up to float32 (code_residuals), all written by
   hf_sparsemax_code_slots whenever a key is written to the slot (so they are always those of the key stored
   there). A decoding call takes rho = max_j rho_{slot j} over the request's keys (slot_bounds: one float read a
   key, beside its D bytes of codes), and kappa = 127 sqrt(dim), which holds for every int8 code (|c_d| <= 127)
   and costs little: its term s_k kappa ||r_q|| <= (dim / 65534) max|k| max|q| (r_q: the query's int16 rounding)
   is a few percent of the rho term's ||q|| s_k rho. Key j's codes are read in a block of CODE_BLOCK with its
   neighbours, which needs their slots consecutive from a multiple of CODE_BLOCK (cache blocks of a multiple of
   CODE_BLOCK slots); a key whose slot breaks that is not coded for the call (code_block): scored exactly. */

/* Code the keys at p->slots[0 .. p->keys) (key rows [slots, kv_heads, dim] through k_n, k_h) for every kv head:
   codes, scales and residuals rho_s (rounded up to float32; 0 for a key never certified). */
int hf_sparsemax_code_slots(const hf_sparsemax_params *p) {
    int64_t kv_heads = p->kv_heads, total = p->keys * kv_heads;
#pragma omp parallel for num_threads(p->threads) schedule(static) if (total > 256)
    for (int64_t k = 0; k < total; k++) {
        int64_t s = p->slots[k / kv_heads], h = k % kv_heads, slot = h * p->c_h + s;
        double rho = 0.0, kappa;
        quantise_key(p, s * p->k_n + h * p->k_h, slot, &rho, &kappa);
        float up = (float)rho;
        p->code_residuals[slot] = (double)up < rho ? nextafterf(up, INFINITY) : up;
    }
    return 0;
}

/* rho and kappa of task (b, h): kept per task (transformers' caches), or from its slots (a paged cache, above). */
static void code_norms(const hf_sparsemax_params *p, int64_t b, int64_t h, double *rho, double *kappa) {
    if (!p->slots) {
        *rho = p->code_bounds[2 * (b * p->kv_heads + h)], *kappa = p->code_bounds[2 * (b * p->kv_heads + h) + 1];
        return;
    }
    const int64_t *slot_row = p->slots + b * p->s_b;
    float top = 0.0f;
    for (int64_t j = 0; j < p->keys; j++) {
        float r = p->code_residuals[h * p->c_h + slot_row[j]];
        top = r > top ? r : top;
    }
    *rho = top;
    *kappa = 127.0 * sqrt((double)p->dim) * (1.0 + CODE_NORM_SLACK);
}

/* The codes of the keys [start, start + count) of task (b, h) (start a multiple of CODE_BLOCK, count at most
   it): the block that holds them, or NULL, and scale_k[l] the scale of key start + l, NaN where its code is not
   there (never certified: scored exactly). Transformers' caches: keys [0, length) coded in place. A paged
   cache: key start + l where its slot is the block's first slot + l (the first a multiple of CODE_BLOCK). */
static const int8_t *code_block(const hf_sparsemax_params *p, int64_t b, int64_t h, int64_t start, int64_t count,
                                float *scale_k) {
    for (int64_t l = 0; l < CODE_BLOCK; l++) scale_k[l] = NAN;
    if (!p->slots) {
        int64_t base = b * p->c_b + h * p->c_h + start;
        for (int64_t l = 0; l < count && start + l < p->length; l++) scale_k[l] = p->code_scales[base + l];
        return start < p->length ? p->codes + base * p->dim : NULL;
    }
    const int64_t *slot_row = p->slots + b * p->s_b + start;
    if (slot_row[0] % CODE_BLOCK) return NULL;
    int64_t base = h * p->c_h + slot_row[0];
    for (int64_t l = 0; l < count; l++)
        if (slot_row[l] == slot_row[0] + l) scale_k[l] = p->code_scales[base + l];
    return p->codes + base * p->dim;
}

/* The cut of a query row whose largest t - E so far is `top` (am1 = alpha - 1) at the floor `floor_tau` of tau
   (NO_FLOOR in the pass): a key with t + E at or below it is not solved over (the certificate, above).
   top - (candidate_margin - 1 - floor_tau + CUT_SLACK) / am1 in double, then
   the largest float32 at or below it (-inf for am1 <= 0): monotone in top, so the cut of a running maximum never
   exceeds the cut of the final one. */
static float row_cut(const hf_sparsemax_params *p, double top, double am1, double floor_tau) {
    double cut = am1 > 0.0 ? top - (p->candidate_margin - 1.0 - floor_tau + CUT_SLACK) / am1 : -INFINITY;
    float rounded = (float)cut;
    return (double)rounded > cut ? nextafterf(rounded, -INFINITY) : rounded;
}

/* The certified scores of task (b, h): the keys not certified, ascending, in kept[0..*n), and their exact scores
   (as score_keys writes them) in compact[i * *n + k] for every query row i; the keys certified are never read.
   Returns the number of keys with codes (code_block) certified, or -1 where a query row is not finite or memory
   could not be had (then the caller scores every key). `scores` (rows * keys floats) is scratch.

   One pass over the codes: block by block, each row's bounds t - E and U = t + E, its running maximum M' of
   t - E and the cut of M' at tau >= -1 (row_cut, no floor); a key whose U is at or below its row's cut for every
   row is certified there and then (M' <= M and f' >= -1, so that cut is at most the final cut: the key is
   certified by the final cut too). The few others (survivors, with their U and t - E) give each row's floor f'
   (their largest U is U_max: every key certified in the pass is below the top's U; the keys certified in the
   pass have z below -1, at no level) and are tested again against the final cuts once the pass is over: the keys
   kept are exactly those some row's final cut does not place above U, as a second pass over every key would
   find. The bounds are computed in float32 (a few roundings of u each, far inside the slack of E above), the
   lanes of a block of codes branch-free (lanes past the keys masked off) so that the compiler vectorises them. */
static int64_t certified_scores(const hf_sparsemax_params *p, int64_t b, int64_t h, const float *q,
                                const float *const *mask_rows, float *row, float *scores, int64_t *kept,
                                float *compact, int64_t *n) {
    int64_t rows = p->rows, keys = p->keys, dim = p->dim;
    int16_t *e = malloc(sizeof(int16_t) * rows * dim);
    float *spec = malloc(sizeof(float) * rows * 5); /* per row: scaling s_q, A_q, its cut, R's factor, M' */
    float *ups = malloc(sizeof(float) * rows * CODE_BLOCK); /* a block's U, row by row */
    float *lows = malloc(sizeof(float) * rows * CODE_BLOCK); /* ... and its t - E */
    int32_t *products = malloc(sizeof(int32_t) * rows * CODE_BLOCK); /* a block's integer products, row by row */
    unsigned char *coded_key = malloc((size_t)keys); /* per survivor: whether it has a code */
    if (!e || !spec || !ups || !lows || !products || !coded_key) {
        free(e), free(spec), free(ups), free(lows), free(products), free(coded_key);
        return -1;
    }
    double rho, kappa, u = UNIT_ROUNDOFF;
    code_norms(p, b, h, &rho, &kappa);
    for (int64_t i = 0; i < rows; i++) {
        const float *qi = q + i * dim;
        float top = 0.0f;
        for (int64_t d = 0; d < dim; d++) top = fabsf(qi[d]) > top || isnan(qi[d]) ? fabsf(qi[d]) : top;
        float scale = top / 32767.0f;
        if (!(top <= FLT_MAX) || (top > 0.0f && !(scale > 0.0f))) {
            free(e), free(spec), free(ups), free(lows), free(products), free(coded_key);
            return -1;
        }
        double norm = 0.0, residual = 0.0;
        for (int64_t d = 0; d < dim; d++) {
            float v = scale > 0.0f ? rintf(qi[d] / scale) : 0.0f;
            v = v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
            e[i * dim + d] = (int16_t)v;
            double r = (double)qi[d] - (double)scale * (double)v;
            norm += (double)qi[d] * (double)qi[d];
            residual += r * r;
        }
        norm = sqrt(norm) * (1.0 + NORM_SLACK), residual = sqrt(residual) * (1.0 + NORM_SLACK);
        spec[5 * i] = (float)((double)p->scaling * scale);
        spec[5 * i + 1] = (float)(fabs((double)p->scaling) *
                                  (norm * rho + residual * kappa + 2.0 * (double)(dim + 4) * u * norm * (rho + kappa)));
        spec[5 * i + 2] = -INFINITY; /* the cut of M' = -inf: nothing certified yet */
        /* R's factor (overflow, above): R = s_k spec[5 i + 3] + |m| */
        spec[5 * i + 3] = (float)(2.0 * fmax(1.0, fabs((double)p->scaling)) * norm * (rho + kappa));
        spec[5 * i + 4] = -INFINITY;
    }
    float level = p->mask ? p->masked : -INFINITY; /* masked at or below (no mask: none) */
    float error = (float)p->code_error * (1.0f + (float)BOUND_SLACK); /* code_error is 1 (0 only in a test: no bound) */
    float scale_k[CODE_BLOCK], m[CODE_BLOCK] = {0};
    unsigned char keep[CODE_BLOCK];
    int64_t certified = 0, found = 0;
    for (int64_t start = 0; start < keys; start += CODE_BLOCK) {
        int64_t count = keys - start < CODE_BLOCK ? keys - start : CODE_BLOCK;
        const int8_t *block = code_block(p, b, h, start, count, scale_k); /* NULL: no codes (not read) */
        if (block) block_products(e, rows, block, dim, products);
        else memset(products, 0, sizeof(int32_t) * rows * CODE_BLOCK);
        for (int64_t i = 0; i < rows; i++) { /* U of every lane (NaN scale: wild, U = +inf), each row's M' */
            if (p->mask)
                for (int64_t l = 0; l < CODE_BLOCK; l++) m[l] = l < count ? mask_rows[i][(start + l) * p->m_n] : 0.0f;
            const int32_t *product = products + i * CODE_BLOCK;
            float sc = spec[5 * i], bound = spec[5 * i + 1], reach = spec[5 * i + 3], best = -INFINITY;
            float *up = ups + i * CODE_BLOCK, *low = lows + i * CODE_BLOCK;
#pragma omp simd reduction(max : best)
            for (int64_t l = 0; l < CODE_BLOCK; l++) {
                float t = sc * scale_k[l] * (float)product[l] + m[l];
                float err = (scale_k[l] * bound + (float)SUM_SLACK * (fabsf(t) + fabsf(m[l]))) * error;
                float lo = t - err, hi = t + err;
                int masked = m[l] <= level, wild = !(scale_k[l] * reach + fabsf(m[l]) < FLT_MAX); /* R (above) */
                hi = hi < -FLT_MAX ? -FLT_MAX : hi; /* -inf only where masked (NaN kept) */
                lo = masked || wild ? -INFINITY : lo;
                up[l] = masked ? -INFINITY : wild ? INFINITY : hi; /* wild: read and scored exactly */
                low[l] = lo;
                best = lo > best ? lo : best;
            }
            if (best > spec[5 * i + 4]) {
                double alpha = p->alphas ? (double)p->alphas[h * (rows / p->q_rows) + i / p->q_rows] : p->fixed_alpha;
                spec[5 * i + 4] = best;
                spec[5 * i + 2] = row_cut(p, best, alpha - 1.0, NO_FLOOR);
            }
        }
        memset(keep, 0, sizeof keep);
        for (int64_t i = 0; i < rows; i++) {
            const float *up = ups + i * CODE_BLOCK;
            float cut = spec[5 * i + 2];
            for (int64_t l = 0; l < CODE_BLOCK; l++) keep[l] |= !(up[l] <= cut);
        }
        int64_t coded = 0;
        for (int64_t l = 0; l < CODE_BLOCK; l++) {
            keep[l] &= l < count;
            coded += l < count && !isnan(scale_k[l]);
        }
        certified += coded;
        uint64_t any[2];
        memcpy(any, keep, sizeof any);
        for (int64_t l = 0; (any[0] | any[1]) && l < count; l++) { /* survivors: kept with their U */
            if (!keep[l]) continue;
            for (int64_t i = 0; i < rows; i++) { /* U in scores, t - E in compact (scratch until the end) */
                scores[i * keys + found] = ups[i * CODE_BLOCK + l];
                compact[i * keys + found] = lows[i * CODE_BLOCK + l];
            }
            coded_key[found] = !isnan(scale_k[l]);
            certified -= coded_key[found];
            kept[found++] = start + l;
        }
    }
    for (int64_t i = 0; i < rows; i++) { /* each row's final cut, at the floor of the survivors' bounds */
        double alpha = p->alphas ? (double)p->alphas[h * (rows / p->q_rows) + i / p->q_rows] : p->fixed_alpha;
        float reach = -INFINITY; /* the largest U: at or above the row's largest score */
        for (int64_t k = 0; k < found; k++) reach = scores[i * keys + k] > reach ? scores[i * keys + k] : reach;
        int64_t level[FLOOR_LEVELS + 1] = {0};
        for (int64_t k = 0; found && reach < INFINITY && k < found; k++) {
            double z = ((double)compact[i * keys + k] - (double)reach) * (alpha - 1.0); /* <= the key's z */
            if (z > NO_FLOOR) level[floor_level(z)]++;
        }
        spec[5 * i + 2] = row_cut(p, spec[5 * i + 4], alpha - 1.0, tau_floor(level, alpha));
    }
    int64_t held = 0; /* the survivors against the final cuts (ascending, compacted in place) */
    for (int64_t k = 0; k < found; k++) {
        int keep_key = 0;
        for (int64_t i = 0; i < rows; i++) keep_key |= !(scores[i * keys + k] <= spec[5 * i + 2]);
        if (keep_key) kept[held++] = kept[k];
        else certified += coded_key[k];
    }
    found = held;
    for (int64_t k = 0; k < found; k++) score_keys(p, b, h, q, mask_rows, kept[k], kept[k] + 1, row, scores);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < found; k++) compact[i * found + k] = scores[i * keys + kept[k]];
    *n = found;
    free(e), free(spec), free(ups), free(lows), free(products), free(coded_key);
    return certified;
}

/* A decoding step: query [batch, kv_heads, rows, dim] (rows: the G query heads' q_rows rows each), keys and
   values through their strides, an additive mask through its strides (or NULL), alphas one per query head (or
   NULL: fixed_alpha); out [batch, kv_heads, rows, value_dim]. Where codes is not NULL, the keys
   [coded, length) are quantised first (a paged cache: its slots' codes are read as they are), and where certify
   is set the keys certified (above) are not read;
   certified[task] (where not NULL) gets their number (-1: the task scored every key). */
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
        int64_t certified = -1, n = keys, *kept = NULL;
        float *compact = NULL;
        if (p->codes && !slot_row) quantise_keys(p, b, h); /* a paged cache's: written with its keys (code_slots) */
        if (p->codes && p->certify) {
            kept = malloc(sizeof(int64_t) * keys);
            compact = malloc(sizeof(float) * rows * keys);
            if (kept && compact) certified = certified_scores(p, b, h, q, mask_rows, row, scores, kept, compact, &n);
        }
        if (certified < 0) {
            free(kept), free(compact);
            kept = NULL, compact = scores, n = keys;
            score_keys(p, b, h, q, mask_rows, 0, keys, row, scores);
        }
        if (p->certified) p->certified[task] = certified;
        const void *v = p->bf16 ? (const void *)((const uint16_t *)p->value + b * p->v_b + h * p->v_h)
                                : (const void *)((const float *)p->value + b * p->v_b + h * p->v_h);
        for (int64_t i = 0; i < rows; i++) {
            double alpha = p->alphas ? (double)p->alphas[h * (rows / q_rows) + i / q_rows] : p->fixed_alpha;
            int64_t at = task * rows + i;
            attend_keys(compact + i * n, n, kept, alpha, chosen, v, slot_row, p, p->out + at * p->value_dim,
                        p->taus ? p->taus + at : NULL);
        }
        if (kept) free(kept), free(compact);
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
