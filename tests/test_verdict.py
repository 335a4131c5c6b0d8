"""The verdict that opens report.md: computed from the table's numbers, on synthetic results."""

import math

from hf_sparsemax.app.verdict import NOT_MEASURED, compared, shown, verdict


def row(variant, attn, loss, **numbers):
    return {"variant": variant, "attn": attn, "loss": loss, **numbers}


def seeded(entry, **stds):
    entry["seeds"] = [0, 1, 2]
    entry["spread"] = {key: {"std": std} for key, std in stds.items()}
    return entry


ONE_SEED = [
    row("softmax_ce", "softmax", "cross_entropy", epsilon_perplexity=51.16, cross_entropy=3.909, zero_prob_share=0.0,
        support_size=49152.0, heldout_attention_zero_share=0.0, train_cpu_seconds=100.0),
    row("entmax15_loss", "softmax", "entmax15", epsilon_perplexity=1604.33, cross_entropy=math.inf,
        zero_prob_share=0.445, support_size=14.8, heldout_attention_zero_share=0.0, train_cpu_seconds=110.0),
    row("top10", "softmax", "sparse_softmax(top_k=10)", epsilon_perplexity=1074.02, cross_entropy=math.inf,
        zero_prob_share=0.434, support_size=10.0, train_cpu_seconds=105.0),
    row("entmax15_attn", "entmax15", "cross_entropy", epsilon_perplexity=65.71, cross_entropy=4.163,
        zero_prob_share=0.0, support_size=49152.0, heldout_attention_zero_share=0.74, train_cpu_seconds=150.0),
]


def test_one_sentence_per_question_from_the_numbers():
    rows = [dict(r, train_load=[0.5 + i, 1.5]) for i, r in enumerate(ONE_SEED)]
    lines = verdict(rows, "causal_lm", peak_rss=3.5 * 2**30)
    assert lines[0] == "## Verdict" and lines[-1] == ""
    loss, attention, time, memory = [line for line in lines if line.startswith("- ")]
    assert loss.startswith("- **Which loss keeps quality, at which sparsity** (against `softmax_ce`: "
                           "epsilon-perplexity 51.16, mean support 49152.0)")
    assert ("`entmax15_loss` epsilon-perplexity 1604.33 (worse (one run: no error bars)), held-out tokens at p = 0 "
            "0.445, mean support 14.8") in loss
    assert loss.endswith("Best sparse loss by epsilon-perplexity: `top10`.")  # 1074 < 1604
    assert "entmax15_attn" not in loss and "entmax15_loss" not in attention
    assert ("`entmax15_attn` attends with 74% exact zeros at +0.254 nats of held-out cross-entropy, "
            "epsilon-perplexity 65.71 (worse (one run: no error bars))") in attention
    assert time == ("- **Time**: training CPU time (process CPU seconds) against `softmax_ce` (100 s): "
                    "`entmax15_loss` 1.10x, `top10` 1.05x, `entmax15_attn` 1.50x; 1-minute load average 0.5-3.5 "
                    "while training (the load changed while training: threads waiting for a core burn CPU time too, "
                    "so these ratios measure the machine as much as the variants; compare them from a run on a quiet "
                    "machine).")
    steady = verdict([dict(r, train_load=[1.2, 1.5]) for r in ONE_SEED], "causal_lm", peak_rss=None)
    assert [line for line in steady if line.startswith("- **Time**")][0].endswith("load average 1.2-1.5 while training.")
    assert "3.50 GiB" in memory


def test_missing_numbers_read_not_measured():
    rows = [dict(r) for r in ONE_SEED]
    del rows[0]["train_cpu_seconds"]  # e.g. results written before the column existed
    rows[3]["cross_entropy"] = None
    del rows[3]["heldout_attention_zero_share"]
    rows[1]["epsilon_perplexity"] = math.nan
    lines = verdict(rows, "causal_lm")
    loss, attention, time, memory = [line for line in lines if line.startswith("- ")]
    assert f"`entmax15_loss` epsilon-perplexity {NOT_MEASURED} ({NOT_MEASURED})" in loss
    assert loss.endswith("`top10`.")
    assert f"attends with {NOT_MEASURED} exact zeros at held-out cross-entropy {NOT_MEASURED}" in attention
    assert f"against `softmax_ce` ({NOT_MEASURED} s): `entmax15_loss` {NOT_MEASURED}," in time
    assert f"whole comparison (one process, every variant) {NOT_MEASURED}" in memory


def test_with_seeds_the_error_bars_decide():
    ref = seeded(row("softmax_ce", "softmax", "cross_entropy", epsilon_perplexity=51.21, cross_entropy=3.910),
                 epsilon_perplexity=0.30, cross_entropy=0.006)
    near = seeded(row("alpha", "entmax_bisect", "cross_entropy", epsilon_perplexity=51.67, cross_entropy=3.919),
                  epsilon_perplexity=0.31, cross_entropy=0.006)
    far = seeded(row("entmax15_attn", "entmax15", "cross_entropy", epsilon_perplexity=66.13, cross_entropy=4.169),
                 epsilon_perplexity=0.45, cross_entropy=0.007)
    assert shown(near, "epsilon_perplexity", "{:.2f}") == "51.67 ± 0.31"
    # |51.67 - 51.21| = 0.46 <= 2 sqrt(0.30^2 + 0.31^2) = 0.86; 66.13 is 14.9 away
    assert compared(near, ref, "epsilon_perplexity", False) == "within the error bars (2 standard deviations)"
    assert compared(far, ref, "epsilon_perplexity", False) == "worse"
    attention = [line for line in verdict([ref, near, far], "causal_lm") if "Which attention" in line][0]
    assert "epsilon-perplexity 51.21 ± 0.30" in attention and "`entmax15_attn`" in attention
    assert "Which loss" not in " ".join(verdict([ref, near, far], "causal_lm"))  # no variant changes the loss


def test_classification_asks_about_macro_f1_and_a_missing_reference():
    rows = [row("sparsemax", "softmax", "sparsemax", macro_f1=0.891, zero_prob_share=0.01, support_size=1.66),
            row("top2", "softmax", "sparse_softmax(top_k=2)", macro_f1=0.880, support_size=2.0)]
    lines = verdict(rows, "sequence_classification")
    loss = [line for line in lines if "Which loss" in line][0]  # no softmax + cross-entropy: the first row leads
    assert "(against `sparsemax`: macro-F1 0.891" in loss and "`top2` macro-F1 0.880 (worse (one run" in loss
    assert f"held-out tokens at p = 0 {NOT_MEASURED}" in loss
    assert verdict([], "causal_lm") == []
