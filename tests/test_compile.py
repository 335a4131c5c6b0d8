"""Sparse attention and sparse losses under ``torch.compile``.

The compiled path (``hf_sparsemax/mappings/_sync_free.py``) has no host sync
and no data-dependent shape: dynamo sees one graph with no break, the
sequence length can stay symbolic, and the result equals the eager path.
Tiny 1-layer models and the ``aot_eager`` backend keep this file fast.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.mappings import _sync_free

# label -> (attention, its options, loss, its options): every sparse attention and every sparse loss appears
SETUPS = {
    "sparsemax": ("sparsemax", {}, "sparsemax", {}),
    "entmax15": ("entmax15", {}, "entmax15", {}),
    "bisect13": ("entmax_bisect", {"alpha": 1.3}, "entmax_bisect", {"alpha": 1.3}),
    "learned_alpha+top_p": ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True}, "sparse_softmax", {"top_p": 0.9}),
    "top_k": ("sparse_softmax", {"top_k": 4}, "sparse_softmax", {"top_k": 5}),
}
VOCAB = 96


def tiny_llama(setup: str, layers: int = 1):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, head_dim=8)
    attn, attn_options, loss, loss_options = SETUPS[setup]
    return hs.patch_model(LlamaForCausalLM(config), attn=attn, loss=loss, attn_options=attn_options,
                          loss_options=loss_options)


def forward_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def batch(length: int, dynamic: bool = True):
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
    labels = ids.clone()
    labels[0, -3:] = -100  # ignored items: a mask, not an index
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
    return ids, labels


def loss_and_grads(fn, model, ids, labels):
    model.zero_grad()
    loss = fn(model, ids, labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_no_graph_break(setup):
    """``torch._dynamo.explain`` of forward + loss: one graph, no break. The KV cache is on (the default);
    two layers for one setup (a second layer's cache update follows the first layer's solver)."""
    model = tiny_llama(setup, layers=2 if setup == "sparsemax" else 1)
    ids, labels = batch(7, dynamic=False)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward_loss)(model, ids, labels)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1


def every_mapping(scores):
    """The mappings attention uses, on ``[B, H, q, kv]`` scores (one compile for all keeps this file fast)."""
    return (hs.sparsemax(scores), hs.entmax15(scores), hs.entmax_bisect(scores, 1.3),
            hs.sparse_softmax(scores, top_k=5))


def test_mappings_fullgraph_equal_eager_with_one_graph_for_three_lengths():
    """sparsemax, entmax15, entmax_bisect(1.3), sparse_softmax(top_k) on causal attention scores, forward and
    backward: compiled == eager to 1e-5, one graph for three lengths (marked dynamic)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(every_mapping, fullgraph=True, backend="aot_eager")

    def run(f, scores, grads):
        scores = scores.detach().requires_grad_()
        torch._dynamo.mark_dynamic(scores, 2)
        torch._dynamo.mark_dynamic(scores, 3)
        outs = f(scores)
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        return [o.detach() for o in outs] + [scores.grad]

    for length in (9, 13, 17):
        g = torch.Generator().manual_seed(length)
        scores = torch.randn(2, 3, length, length, generator=g) * 3
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
        grads = [torch.randn(scores.shape, generator=g) for _ in range(4)]
        for e, o in zip(run(every_mapping, scores, grads), run(compiled, scores, grads)):
            torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_model_fullgraph_equals_eager_with_one_graph_for_three_lengths():
    """A whole patched model, forward + loss + backward (learned per-head alpha, top_p loss): fullgraph
    aot_eager == eager to 1e-5 (the alphas' gradients included); the symbolic sequence length compiles once."""
    model = tiny_llama("learned_alpha+top_p")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(forward_loss, fullgraph=True, backend="aot_eager")
    for length in (9, 13, 17):
        ids, labels = batch(length)
        expected, expected_grads = loss_and_grads(forward_loss, model, ids, labels)
        got, grads = loss_and_grads(compiled, model, ids, labels)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_dynamic_true_with_a_float_loss_option():
    """``dynamic=True`` (floats may turn symbolic) with a float option (top_p): compiles and equals eager."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([1, 2, -100, 3, 4, 5])
    torch._dynamo.reset()
    fn = hs.sparse_softmax_loss
    got = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)(logits, target, top_p=0.9)
    torch.testing.assert_close(got, fn(logits, target, top_p=0.9), rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("setup", list(SETUPS))
def test_dynamic_true_whole_model_equals_eager(setup):
    """``dynamic=True`` on a whole model whose attention and loss share a mapping: dynamo reads a float default or
    global as a symbolic input and could not lift it into the second autograd Function (sparsemax, bisect failed)."""
    model = tiny_llama(setup)
    ids, labels = batch(7, dynamic=False)
    torch._dynamo.reset()
    compiled = torch.compile(forward_loss, fullgraph=True, backend="aot_eager", dynamic=True)
    expected, expected_grads = loss_and_grads(forward_loss, model, ids, labels)
    got, grads = loss_and_grads(compiled, model, ids, labels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_exact_fallback_runs_inside_the_compiled_graph():
    """Rows the fixed passes cannot certify (a flat plateau, a large nucleus) still get the exact answer."""
    torch._dynamo.reset()
    flat = torch.linspace(0, 1e-3, 300).repeat(3, 1)
    flat[1] = torch.randn(300)
    cases = [(hs.sparsemax, {}), (hs.entmax15, {}), (hs.sparse_softmax, {"top_p": 0.9})]
    for fn, options in cases:
        compiled = torch.compile(lambda x: fn(x, **options), fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(flat), fn(flat, **options), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("alpha", [1.05, 1.1, 1.2, 1.3, 1.5, 1.8])
def test_newton_certifies_typical_rows(alpha):
    """The compiled path's fixed Newton passes certify attention-like rows at every usual alpha, so no row
    goes to the (sorting) exact fallback; float32 for alpha >= 1.125, float64 below (as the mapping upcasts)."""
    torch.manual_seed(0)
    dtype = torch.float32 if alpha >= 1.125 else torch.float64
    rows = (torch.randn(4096, 512) * 2).to(dtype)
    for a in (alpha, torch.full((4096, 1), alpha, dtype=dtype)):
        for steps in (None, _sync_free.newton_steps(alpha, dtype)):  # the default, and the eager caller's by alpha
            found = _sync_free.newton_certified(rows, a, torch.finfo(torch.float32).min, steps)
            assert bool(found.done.all()), (steps, float(found.done.double().mean()))
