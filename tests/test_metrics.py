"""Metrics for sparse models: closed forms against direct computation; the evaluate module; Trainer hooks."""

import math

import evaluate
import numpy as np
import pytest
import torch

import hf_sparsemax as hs
from hf_sparsemax.metrics import sparse_text as metrics
from hf_sparsemax.losses.names import loss_mapping


def direct(p, t, eps):
    """Reference: the definitions of Martins et al. (2020), term by term, in float64."""
    p = p.double()
    onehot = torch.nn.functional.one_hot(t, p.shape[-1]).double()
    m = (p + onehot) / 2

    def kl(a, b):
        return torch.where(a > 0, a * (a / b).log(), 0).sum(-1)

    p_t = p.gather(-1, t[:, None]).squeeze(-1)
    return {
        "epsilon_perplexity": math.exp((-((p_t + eps) / (1 + eps * p.shape[-1])).log()).mean()),
        "sparsemax_score": (p_t - 0.5 * (p * p).sum(-1) + 0.5).mean().item(),
        "jensen_shannon": (0.5 * kl(p, m) + 0.5 * kl(onehot, m)).mean().item(),
        "accuracy": (p.argmax(-1) == t).double().mean().item(),
    }


@pytest.mark.parametrize("mapping", [hs.sparsemax, hs.entmax15, lambda x: torch.softmax(x, -1)])
def test_summary_matches_definitions(mapping):
    torch.manual_seed(0)
    p = mapping(torch.randn(200, 50) * 3)
    t = torch.randint(0, 50, (200,))
    stats = metrics.token_stats(p, t).numpy()
    got = metrics.summarize(*stats.T, vocab_size=50, epsilon=1e-4)
    for key, value in direct(p, t, 1e-4).items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    zero = (p.gather(-1, t[:, None]) == 0).any()
    assert got["zero_prob_share"] == pytest.approx((p.gather(-1, t[:, None]) == 0).double().mean().item())
    assert (got["cross_entropy"] == float("inf")) == bool(zero)


def test_perfect_and_uniform_predictions():
    t = torch.tensor([1, 3])
    perfect = metrics.summarize(*metrics.token_stats(torch.eye(5)[t], t).numpy().T, vocab_size=5)
    assert perfect["sparsemax_score"] == 1 and perfect["jensen_shannon"] == 0 and perfect["accuracy"] == 1
    assert perfect["cross_entropy"] == 0
    wrong = metrics.summarize(*metrics.token_stats(torch.eye(5)[t + 1], t).numpy().T, vocab_size=5)
    assert wrong["jensen_shannon"] == pytest.approx(math.log(2)) and wrong["zero_prob_share"] == 1
    with pytest.raises(ValueError):
        metrics.summarize([], [], [], [], vocab_size=5)


def test_evaluate_module_loads_offline_by_path():
    torch.manual_seed(1)
    p, t = hs.sparsemax(torch.randn(30, 20) * 2), torch.randint(0, 20, (30,))
    stats = metrics.token_stats(p, t)
    module = evaluate.load(metrics.METRIC_PATH)
    for row in range(0, 30, 10):
        chunk = stats[row : row + 10]
        module.add_batch(target_prob=chunk[:, 0], sq_norm=chunk[:, 1], hit=chunk[:, 2], support=chunk[:, 3])
    got = module.compute(vocab_size=20)
    assert got == pytest.approx(metrics.summarize(*stats.numpy().T, vocab_size=20))
    with pytest.raises(ValueError):
        evaluate.load(metrics.METRIC_PATH).compute(target_prob=[0.5], sq_norm=[0.5], hit=[1], support=[2])


def test_trainer_hooks_shift_and_ignore_labels():
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 11)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, 3] = -100
    preprocess, compute = metrics.trainer_metrics(loss_mapping("sparsemax"), vocab_size=11)
    stats = preprocess(logits, labels)
    assert stats.shape == (2, 6, 4)

    class Prediction:
        predictions, label_ids = stats.numpy(), labels.numpy()

    got = compute(Prediction)
    keep = labels[:, 1:] != -100
    p = hs.sparsemax(logits[:, :-1])[keep]
    assert got == pytest.approx(metrics.summarize(*metrics.token_stats(p, labels[:, 1:][keep]).numpy().T, vocab_size=11))
    assert got["tokens"] == int(keep.sum())


def test_loss_mapping_is_the_trained_distribution():
    x = torch.randn(3, 30)
    assert torch.equal(loss_mapping("sparse_softmax", top_k=4)(x), hs.sparse_softmax(x, top_k=4))
    assert torch.equal(loss_mapping("entmax_bisect", alpha=1.2)(x), hs.entmax_bisect(x, 1.2))
    assert torch.allclose(loss_mapping("cross_entropy")(x), torch.softmax(x, -1))
    with pytest.raises(ValueError):
        loss_mapping("sparse_softmax", top_k=0)
    assert np.isfinite(metrics.summarize([0.5], [0.5], [1], [2], vocab_size=3)["cross_entropy"])
