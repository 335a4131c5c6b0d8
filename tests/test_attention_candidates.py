"""Candidate keys: each block's threshold of a no-grad forward solved over the keys within ``1 / (alpha - 1)`` of some row's maximum.

Keys below that bound have weight exactly 0 (THEORY.md, "Exact KV skipping"), so the block's solve and ``P V``
over the candidates alone are exact: checked in float64 against the materialised formula on the registry's
mappings (outputs and gradients), across mask families (padding, a query that sees nothing), grouped heads and
a learned alpha, with every block compacted; and that compaction happens on inputs with far keys.
"""

import pytest
import torch

from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.attention.interface import sparse_attention_forward
from test_attention_blocks import B, H, L, SETUPS, inputs, masks, materialised, module_for, small_blocks


@pytest.fixture
def compacted(monkeypatch):
    """Every block solved over its candidates (by default only where they are few), the calls recorded."""
    monkeypatch.setattr(attention_blocks, "CANDIDATES_BELOW", 1.0)
    seen = []
    original = attention_blocks.candidate_keys
    monkeypatch.setattr(attention_blocks, "candidate_keys",
                        lambda *a: (lambda found: seen.append(found is not None) or found)(original(*a)))
    return seen


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("budget", [None, 100])
def test_solving_over_the_candidates_equals_the_materialised_formula_in_float64(setup, budget, grad, compacted,
                                                                                 monkeypatch):
    if budget is not None:
        small_blocks(monkeypatch, budget)
    for name, mask in masks().items():
        module, attn = module_for(setup, torch.float64)
        module.is_causal = name == "is_causal"
        q, k, v = inputs(torch.float64)
        mask = None if mask is None else mask.double().masked_fill(mask == mask.min(), torch.finfo(torch.float64).min)
        leaves = [q, k, v] + ([module.hf_sparsemax_alpha.pre_alpha] if SETUPS[setup][1].get("learn_alpha") else [])
        with torch.set_grad_enabled(grad):
            out, _ = sparse_attention_forward(module, q, k, v, mask, scaling=0.4, mapping=attn)
        causal = masks()["causal"].double().masked_fill(masks()["causal"] < 0, torch.finfo(torch.float64).min)
        reference = materialised(module, setup, q, k, v, causal if module.is_causal else mask, 0.4)
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12, msg=name)
        if grad:
            g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
            got = torch.autograd.grad((out * g).sum(), leaves)
            expected = torch.autograd.grad((reference * g).sum(), leaves)
            for a, b, leaf in zip(got, expected, ["q", "k", "v", "alpha"]):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{name}: d{leaf}")
        if name == "causal+padding":
            assert (out[1, :3] == 0).all()
    assert all(compacted) and bool(compacted) != grad  # the no-grad forward compacts; training does not


@pytest.mark.parametrize("setup", list(SETUPS))
def test_keys_far_below_every_row_s_maximum_are_no_candidates(setup):
    """With keys far below (scores 20 under the rest), the block is compacted by default: the solve sees the
    near keys alone, and the output equals the materialised formula."""
    q, k, v = (t.detach() for t in inputs(torch.float64, length=64))
    k[..., 10:50, :] = 0.0
    q[..., 0], k[..., 0] = 4.0, 0.0
    k[..., 10:50, 0] = -12.5  # q . k * 0.4 = -20 on the far keys
    k[..., :10, 0], k[..., 50:, 0] = 2.0, 2.0
    module, attn = module_for(setup, torch.float64)
    scores = torch.matmul(q[:, :2], k.transpose(-1, -2)) * 0.4
    index = attention_blocks.candidate_keys(scores, 1.3 if setup != "sparsemax" else 2.0, torch.finfo(q.dtype).min)
    assert index is not None and not any(10 <= i < 50 for i in index.tolist())
    with torch.no_grad():
        out, _ = sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    torch.testing.assert_close(out, materialised(module, setup, q, k, v, None, 0.4), rtol=1e-12, atol=1e-12)


def test_a_nan_score_makes_every_key_a_candidate():
    scores = torch.zeros(1, 1, 2, 6)
    scores[..., 1, 3] = float("nan")
    scores[..., 0, 0] = 10.0
    index = attention_blocks.candidate_keys(scores, 2.0, torch.finfo(torch.float32).min)
    assert index is None or index.numel() == 6
