"""Sparse attention over a paged KV cache without an engine: fake vLLM steps against transformers' attention.

The oracle is the attention function hf_sparsemax registers with transformers (the model as trained), run on
each request's whole sequence; the paged path sees the same keys split over cache blocks in shuffled order,
written step by step as an engine writes them (prefill, a chunked prompt, a cached prefix, decode steps, all
in mixed batches).
"""

import math

import pytest
import torch
from torch import nn

import hf_sparsemax as hs
from hf_sparsemax.attention.interface import ALPHA_ATTR, OPTIONS_ATTR, LearnedAlpha, sparse_attention_forward
from hf_sparsemax.integrations.vllm import paged_attention as paged
from hf_sparsemax.integrations.vllm.paged_attention import (PagedBatch, SparseAttention, paged_attention, step_plan,
                                                            write_cache)
from hf_sparsemax.settings import SparseSettings

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
SCALE = DIM ** -0.5
ATTENTIONS = [("sparsemax", {}), ("entmax15", {}), ("entmax_bisect", {"alpha": 1.3}),
              ("entmax_bisect", {"alpha": 1.05}), ("sparse_softmax", {"top_k": 3}),
              ("entmax_bisect", {"alpha": 1.4, "learn_alpha": True})]


def learned_alpha():
    return 1 + torch.sigmoid(torch.tensor([-1.5, 0.0, 0.7, 2.0]))  # four heads, alphas 1.18 ... 1.88


def layer_of(attn, options):
    """A transformers-side attention module carrying the saved options (and a learned alpha)."""
    module = nn.Module()
    settings = SparseSettings(attn=attn, attn_options=options)
    setattr(module, OPTIONS_ATTR, settings.attention_options)
    alpha = None
    if options.get("learn_alpha"):
        learned = LearnedAlpha(HEADS)
        alpha = learned_alpha()
        learned.pre_alpha.data = torch.logit(alpha - 1)
        setattr(module, ALPHA_ATTR, learned)
        alpha = (1 + torch.sigmoid(learned.pre_alpha)).detach()
    return module, SparseAttention.from_settings(settings, alpha)


def reference(module, attn, q, k, v):
    """transformers' sparse attention of one whole sequence: ``q [n, H, D]``, ``k, v [n, Hkv, D]``, causal."""
    out, _ = sparse_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], None, scaling=SCALE, mapping=attn)
    return out[0]


class FakeEngine:
    """A paged cache with shuffled blocks, and the steps of several requests (each a sequence of q, k, v rows)."""

    def __init__(self, sequences, blocks=64, seed=0, block=BLOCK):
        self.cache = torch.full((blocks, KV_HEADS, block, 2 * DIM), float("nan"))  # unwritten slots poison the output
        self.block = block
        generator = torch.Generator().manual_seed(seed)
        free = torch.randperm(blocks, generator=generator).tolist()
        self.tables = [[free.pop() for _ in range(math.ceil(len(s[0]) / block))] for s in sequences]
        self.sequences = sequences
        self.done = [0] * len(sequences)

    def step(self, requests, attention, layers=1, scales=None, own=True):
        """Run ``{request: new tokens}`` (``layers`` times over the same cache, with one plan, as an engine's layers
        read it); returns each request's output rows (of the last). ``scales``: the layer's query scales, applied
        to the step's queries as vLLM's backend applies them; ``own``: the step's keys and values handed to the
        attention as vLLM's backend hands them (whole prompts read them; False: everything from the cache)."""
        qs, ks, vs, starts, lengths, slots = [], [], [], [0], [], []
        for request, count in requests.items():
            q, k, v = self.sequences[request]
            first = self.done[request]
            qs.append(q[first:first + count])
            ks.append(k[first:first + count])
            vs.append(v[first:first + count])
            positions = torch.arange(first, first + count)
            table = torch.tensor(self.tables[request])
            slots.append(table[positions // self.block] * self.block + positions % self.block)
            starts.append(starts[-1] + count)
            lengths.append(first + count)
            self.done[request] += count
        width = max(len(t) for t in self.tables)
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in requests])
        padding = 3  # tokens past the last request's (an engine's padded batch): never written, never read
        dtype = qs[0].dtype
        query = torch.cat([*qs, torch.randn(padding, HEADS, DIM, dtype=dtype)])
        key = torch.cat([*ks, torch.randn(padding, KV_HEADS, DIM, dtype=dtype)])
        value = torch.cat([*vs, torch.randn(padding, KV_HEADS, DIM, dtype=dtype)])
        batch = PagedBatch(torch.tensor(starts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                           table.to(torch.int32), torch.cat([*slots, torch.full((padding,), -1)]))
        if scales is not None:
            query = torch.cat([scales.apply(query[:starts[-1]], batch), query[starts[-1]:]])
        mine = dict(key=key, value=value) if own else {}
        if layers == 1:  # no plan given: paged_attention builds the step's own
            write_cache(self.cache, key, value, batch.slot_mapping)
            out = paged_attention(query, self.cache, batch, SCALE, attention, **mine)
        else:  # one plan for the step, read by every layer (each writes the same keys again)
            plan = step_plan(batch, self.cache, query)
            for _ in range(layers):
                assert plan.serves(batch, self.cache, query)
                write_cache(self.cache, key, value, batch.slot_mapping, plan)
                out = paged_attention(query, self.cache, batch, SCALE, attention, plan=plan, **mine)
        return {request: out[starts[i]:starts[i + 1]] for i, request in enumerate(requests)}


def sequences(lengths, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(n, HEADS, DIM) * 2, torch.randn(n, KV_HEADS, DIM) * 2, torch.randn(n, KV_HEADS, DIM))
            for n in lengths]


@pytest.mark.parametrize("attn,options", ATTENTIONS, ids=[f"{a}{o}" for a, o in ATTENTIONS])
def test_prefill_chunks_prefix_hits_and_decode_in_mixed_batches_equal_transformers(attn, options):
    module, attention = layer_of(attn, options)
    seqs = sequences([10, 15, 6, 11])
    engine = FakeEngine(seqs)
    got = {r: [] for r in range(len(seqs))}
    # step 1: request 0 whole prompt, request 1 the first chunk of its prompt, request 2 a prefix "already cached"
    engine.step({2: 4}, attention)  # (the prefix: written by an earlier request with the same blocks)
    for steps in ({0: 7, 1: 5, 2: 1}, {1: 5, 0: 1, 2: 1, 3: 11}, {1: 4, 0: 1}, {0: 1, 1: 1}):
        for request, rows in engine.step(steps, attention).items():
            got[request].append(rows)
    for request, (q, k, v) in enumerate(seqs):
        expected = reference(module, attn, q, k, v)
        rows = torch.cat(got[request])
        first = engine.done[request] - len(rows)
        torch.testing.assert_close(rows, expected[first:engine.done[request]], rtol=0, atol=2e-6)
    assert engine.done == [10, 15, 6, 11] and torch.isfinite(torch.cat(got[3])).all()


def test_weights_are_exactly_sparse_and_future_keys_never_read():
    _, attention = layer_of("sparsemax", {})
    q, k, v = sequences([8])[0]
    engine = FakeEngine([(q, k, v)])
    out = engine.step({0: 8}, attention)[0]
    # the future keys' slots hold NaN until written: a read of any of them would make the row NaN
    engine2 = FakeEngine([(q, k, v)])
    first = engine2.step({0: 5}, attention)[0]
    assert torch.isfinite(first).all() and torch.equal(first, out[:5])


def test_settings_without_sparse_attention_or_without_their_alphas_are_refused():
    with pytest.raises(ValueError, match="no sparse attention"):
        SparseAttention.from_settings(SparseSettings(loss="sparsemax"))
    with pytest.raises(ValueError, match="learned one alpha per head"):
        SparseAttention.from_settings(SparseSettings(attn="entmax_bisect", attn_options={"learn_alpha": True}))
    with pytest.raises(ValueError, match="did not learn them"):
        SparseAttention.from_settings(SparseSettings(attn="entmax15"), torch.ones(HEADS) * 1.5)


def test_a_learned_alpha_is_per_head():
    """Heads with different alphas weigh the same scores differently (the alpha reaches each head's rows)."""
    _, attention = layer_of("entmax_bisect", {"alpha": 1.4, "learn_alpha": True})
    scores = torch.randn(1, 1, 3, 10).expand(1, HEADS, 3, 10).contiguous()
    p = attention.weights(scores)
    for head, alpha in enumerate(learned_alpha()):
        torch.testing.assert_close(p[0, head], hs.entmax_bisect(scores[0, head], float(alpha)), rtol=0, atol=1e-6)


THRESHOLDS = [a for a in ATTENTIONS if a[0] != "sparse_softmax"]


@pytest.mark.parametrize("attn,options", THRESHOLDS, ids=[f"{a}{o}" for a, o in THRESHOLDS])
def test_the_compiled_kernel_a_shared_plan_and_decode_rows_apart_equal_transformers(attn, options, monkeypatch):
    """The threshold mappings through the compiled row kernel (as served: every call here, not only from
    MIN_SCORES scores), the step's plan shared by three layers, and decode requests whose rows are not
    consecutive (a prefill chunk between them) and of different lengths (a padded batch)."""
    monkeypatch.setattr(paged, "MIN_SCORES", 0)
    module, attention = layer_of(attn, options)
    seqs = sequences([9, 14, 7])
    engine = FakeEngine(seqs, seed=2)
    got = {r: [] for r in range(len(seqs))}
    for steps in ({0: 6, 2: 4}, {0: 1, 1: 8, 2: 1}, {2: 1, 1: 6, 0: 1}, {0: 1, 2: 1}):
        for request, rows in engine.step(steps, attention, layers=3).items():
            got[request].append(rows)
    for request, (q, k, v) in enumerate(seqs):
        expected = reference(module, attn, q, k, v)
        # both float32 roundings of one result: against the same attention in float64 the compiled kernel is within
        # 1.6e-6 and transformers' path within 8.5e-7 (outputs up to 2.7, float32's spacing 2.4e-7 there), on
        # opposite sides at sparsemax's worst element, 2.1e-6 apart
        torch.testing.assert_close(torch.cat(got[request]), expected, rtol=0, atol=3e-6)
    assert engine.done == [9, 14, 7]


FLOAT32_IN_TRANSFORMERS = [a for a in THRESHOLDS if a[1].get("alpha") != 1.05]  # its threshold path (float32)


@pytest.mark.parametrize("attn,options", ATTENTIONS, ids=[f"{a}{o}" for a, o in ATTENTIONS])
def test_a_bfloat16_model_is_scored_solved_and_accumulated_in_float32(attn, options):
    """A bfloat16 engine (bfloat16 queries, keys, values and cache): the scores, masks, weights and ``P V`` in float32,
    the output rounded to bfloat16 once. Against the float32 attention of the same bfloat16 rows, rounded to
    bfloat16, and, where transformers' sparse attention computes a bfloat16 model in float32 (its threshold path:
    sparsemax, entmax15, entmax_bisect with alphas in [1.125, 2]), against transformers' bfloat16 call itself: at
    most one bfloat16 rounding step apart (float32 accumulation orders differ). Scores rounded to bfloat16 (2**-9
    relative) move the weights by far more."""
    module, attention = layer_of(attn, options)
    seqs = [tuple(t.to(torch.bfloat16) for t in s) for s in sequences([10, 15, 6])]
    engine = FakeEngine(seqs)
    engine.cache = engine.cache.to(torch.bfloat16)
    got = {r: [] for r in range(len(seqs))}
    for steps in ({0: 7, 1: 5, 2: 4}, {1: 10, 0: 1, 2: 1}, {0: 1, 2: 1}, {0: 1}):
        for request, rows in engine.step(steps, attention).items():
            assert rows.dtype == torch.bfloat16
            got[request].append(rows)
    for request, (q, k, v) in enumerate(seqs):
        rows = torch.cat(got[request]).float()
        in_float32 = reference(module, attn, q.float(), k.float(), v.float()).to(torch.bfloat16)
        torch.testing.assert_close(rows, in_float32.float(), rtol=2 ** -7, atol=1e-5)
        if (attn, options) in FLOAT32_IN_TRANSFORMERS:
            expected = reference(module, attn, q, k, v)
            assert expected.dtype == torch.bfloat16
            torch.testing.assert_close(rows, expected.float(), rtol=2 ** -7, atol=1e-5)
    assert engine.done == [10, 15, 6]


def test_query_scales_scale_each_token_at_its_position_as_transformers_does():
    """Per-head temperatures and a length scale: the engine's tokens (prefill chunks, a cached prefix, decode
    steps) scaled at their positions in their requests equal transformers' attention of the whole sequences."""
    from hf_sparsemax.attention.query_scale import LENGTH_SCALE_ATTR, TEMPERATURE_ATTR, HeadTemperature, LengthScale

    module, attention = layer_of("entmax15", {"temperature": [[0.5, 2.0, 1.25, 3.0]], "length_scale": True})
    module.add_module(TEMPERATURE_ATTR, HeadTemperature([0.5, 2.0, 1.25, 3.0]))
    length = LengthScale(HEADS)
    with torch.no_grad():
        length.delta.copy_(torch.tensor([1.0, 0.6, 1.5, 0.9]))
        length.beta.copy_(torch.tensor([0.2, -0.1, 0.3, 0.05]))
        length.gamma.copy_(torch.tensor([1.0, 2.0, 0.5, 1.5]))
    module.add_module(LENGTH_SCALE_ATTR, length)
    scales = paged.QueryScales(torch.tensor([0.5, 2.0, 1.25, 3.0]),
                               tuple(p.detach() for p in (length.delta, length.beta, length.gamma)))
    seqs = sequences([10, 15, 6])
    engine = FakeEngine(seqs)
    got = {r: [] for r in range(len(seqs))}
    engine.step({2: 4}, attention, scales=scales)
    for steps in ({0: 7, 1: 5, 2: 1}, {1: 5, 0: 1, 2: 1}, {1: 5, 0: 2}):
        for request, rows in engine.step(steps, attention, scales=scales).items():
            got[request].append(rows)
    for request, (q, k, v) in enumerate(seqs):
        expected = reference(module, "entmax15", q, k, v)
        rows = torch.cat(got[request])
        first = engine.done[request] - len(rows)
        torch.testing.assert_close(rows, expected[first:engine.done[request]], rtol=0, atol=2e-6)
    assert engine.done == [10, 15, 6]


KERNEL_SERVED = [a for a in THRESHOLDS if a[1].get("alpha") != 1.05]  # 1.05: solved in float64 (general path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn,options", KERNEL_SERVED, ids=[f"{a}{o}" for a, o in KERNEL_SERVED])
def test_decoding_reads_the_paged_cache_in_place_by_the_fused_kernel(attn, options, dtype, monkeypatch):
    """Decode requests of different lengths (a padded batch), rows apart: the fused kernel serves them, reading
    each request's keys and values through its slots (no gather), equal to the gathered general path's output and
    to transformers'; the prefills (a whole prompt, and chunks after it) go through transformers' blocked
    attention (:func:`.paged_attention.blocked_prefill`), a whole prompt on the step's own keys (no gather), a
    later chunk on its keys gathered out of the cache."""
    gathered, served, prefilled, original = [], [], [], paged.kernel_decode
    monkeypatch.setattr(paged, "gather", lambda *a, gather=paged.gather: gathered.append(a[2]) or gather(*a))
    monkeypatch.setattr(paged, "kernel_decode", lambda *a: served.append(original(*a)) or served[-1])
    monkeypatch.setattr(paged, "blocked_prefill",
                        lambda *a, blocked=paged.blocked_prefill: prefilled.append(blocked(*a)) or prefilled[-1])
    module, attention = layer_of(attn, options)
    seqs = [tuple(t.to(dtype) for t in s) for s in sequences([9, 14, 9], seed=3)]
    engine = FakeEngine(seqs, seed=4)
    engine.cache = engine.cache.to(dtype)
    got = {r: [] for r in range(len(seqs))}
    for steps in ({0: 6, 1: 11, 2: 4}, {0: 1, 1: 1, 2: 1}, {2: 1, 1: 1, 0: 1}, {0: 1, 2: 3}):
        for request, rows in engine.step(steps, attention).items():
            got[request].append(rows)
    assert gathered == [1] and len(served) == 3 and all(found is not None for found in served)
    assert len(prefilled) == 4 and all(found is not None for found in prefilled)
    for request, (q, k, v) in enumerate(seqs):
        expected = reference(module, attn, q.float(), k.float(), v.float()).to(dtype)
        rows = torch.cat(got[request])
        tolerance = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(rows.float(), expected[: len(rows)].float(), **tolerance)
    monkeypatch.setattr(paged, "kernel_decode", lambda *a: None)  # the general path on the same cache: the same
    again = FakeEngine(seqs, seed=4)
    again.cache = again.cache.to(dtype)
    for steps in ({0: 6, 1: 11, 2: 4}, {0: 1, 1: 1, 2: 1}):
        general = again.step(steps, attention)
    torch.testing.assert_close(torch.cat([general[r] for r in range(3)]).float(),
                               torch.cat([got[r][1] for r in range(3)]).float(), rtol=1e-5, atol=1e-6)


def test_a_slot_outside_the_cache_is_refused():
    from hf_sparsemax.attention.cpu import fused

    if not fused.available():
        pytest.skip("no C compiler")
    rows = torch.randn(8, KV_HEADS, DIM)
    query = torch.randn(1, KV_HEADS, 2, 1, DIM)
    with pytest.raises(ValueError, match="slot outside"):
        fused.paged_decode(query, rows, rows, torch.tensor([[0, 8]]), None, 1.5, SCALE)
    assert fused.paged_decode(query, rows, rows, torch.tensor([[0, 7]]), None, 1.5, SCALE) is not None


def test_slots_checked_once_a_step_serve_its_layers_and_are_checked_again_for_another_cache():
    """An engine step checks its slots once (:class:`fused.CheckedSlots`) for every layer's call: the same output as
    the plain slots; handed to a call on a cache of fewer rows they are checked again (a ValueError, never read)."""
    from hf_sparsemax.attention.cpu import fused

    if not fused.available():
        pytest.skip("no C compiler")
    rows = torch.randn(8, KV_HEADS, DIM)
    query = torch.randn(1, KV_HEADS, 2, 1, DIM)
    slots = torch.tensor([[0, 7, 3]])
    checked = fused.checked_slots(slots, 8)
    assert fused.checked_slots(checked, 8) is checked  # checked once: not again for the step's next layer
    assert torch.equal(fused.paged_decode(query, rows, rows, checked, None, 1.5, SCALE),
                       fused.paged_decode(query, rows, rows, slots, None, 1.5, SCALE))
    with pytest.raises(ValueError, match="slot outside"):
        fused.paged_decode(query, rows[:7], rows[:7], checked, None, 1.5, SCALE)
    with pytest.raises(ValueError, match="slot outside"):
        fused.checked_slots(torch.tensor([[0, 8]]), 8)


CERTIFIED = [a for a in KERNEL_SERVED if a[1].get("alpha") != 1.3] + [("entmax_bisect", {"alpha": 1.3})]
LONG = [1105, 1049, 1064]  # at least MIN_KEYS keys when decoding: the int8 certificate on
LONG_STEPS = ({0: 1100, 1: 600, 2: 512}, {1: 446, 2: 548, 0: 1}, {0: 1, 1: 1, 2: 1}, {2: 1, 0: 1, 1: 1},
              {0: 1, 1: 1, 2: 1}, {0: 1, 2: 1})  # whole prompts, chunks, then padded decode batches, rows apart


def long_run(attention, dtype, skip, monkeypatch):
    """Each request's output rows over LONG_STEPS (cache blocks of 16 slots), with the certificate on or off
    (``HF_SPARSEMAX_KV_SKIP``), and the keys the certified steps never read (:data:`.keycodes.COUNTS`)."""
    from hf_sparsemax.attention.blocked import keycodes

    monkeypatch.setenv("HF_SPARSEMAX_KV_SKIP", "1" if skip else "0")
    keycodes.reset_counts()
    seqs = [tuple(t.to(dtype) for t in s) for s in sequences(LONG, seed=5)]
    engine = FakeEngine(seqs, blocks=224, seed=6, block=16)
    engine.cache = engine.cache.to(dtype)
    got = {r: [] for r in range(len(seqs))}
    for steps in LONG_STEPS:
        for request, rows in engine.step(steps, attention).items():
            got[request].append(rows)
    assert engine.done == LONG
    assert (engine.cache in paged.SLOT_CODES) == skip
    if skip:  # D + 8 bytes a slot and kv head (codes, scale, residual), slots in whole code blocks
        assert paged.SLOT_CODES[engine.cache].nbytes() == 224 * 16 * KV_HEADS * (DIM + 8)
        assert paged.certificate_bytes() >= 224 * 16 * KV_HEADS * (DIM + 8)
    return seqs, {r: torch.cat(rows) for r, rows in got.items()}, dict(keycodes.COUNTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn,options", CERTIFIED, ids=[f"{a}{o}" for a, o in CERTIFIED])
def test_the_certificate_per_slot_skips_keys_and_changes_no_bit(attn, options, dtype, monkeypatch):
    """Decoding over a paged cache with the int8 certificate kept per slot (codes made at the first step with
    MIN_KEYS keys, then written with every key): some keys are never read, and every output row equals, bit for
    bit, the same steps' with the certificate off (``HF_SPARSEMAX_KV_SKIP=0``, no codes kept), which equal
    transformers' attention of the whole sequences; grouped heads, a learned alpha per head, requests of different
    lengths, bfloat16 caches."""
    from hf_sparsemax.attention.cpu import fused

    if not fused.available():
        pytest.skip("no C compiler")
    module, attention = layer_of(attn, options)
    seqs, certified, counts = long_run(attention, dtype, True, monkeypatch)
    _, full, off = long_run(attention, dtype, False, monkeypatch)
    assert counts["calls"] > 0 and 0 < counts["certified"] < counts["keys"] and off["calls"] == 0
    for request, (q, k, v) in enumerate(seqs):
        assert torch.equal(certified[request], full[request])
        if options.get("learn_alpha"):  # transformers' learned alphas at 1000 keys: seconds (the short tests check)
            continue
        expected = reference(module, attn, q.float(), k.float(), v.float()).to(dtype)
        tolerance = dict(rtol=1e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(certified[request].float(), expected.float(),  # float32 sums of ~1000 rows
                                   **tolerance)


def test_a_slot_reused_by_a_new_request_holds_the_new_keys_codes(monkeypatch):
    """A request that gets a finished request's cache blocks writes its keys (and their codes) over the old ones:
    its certified decoding equals, bit for bit, a fresh cache's without the certificate. Its keys are the old
    keys negated, so the old codes would exclude its largest scores: with the codes left stale (writes skipped)
    the output changes."""
    from hf_sparsemax.attention.cpu import fused
    from hf_sparsemax.attention.blocked.keycodes import COUNTS, SlotCodes, reset_counts

    if not fused.available():
        pytest.skip("no C compiler")
    _, attention = layer_of("sparsemax", {})
    q, k, v = sequences([1040], seed=7)[0]
    new = (q, -k, v)

    def reused(stale):
        engine = FakeEngine([(q, k, v), new], blocks=140, seed=8, block=16)
        engine.tables[1] = engine.tables[0]  # request 1 gets request 0's blocks once it finished
        engine.step({0: 1039}, attention)
        engine.step({0: 1}, attention)  # 1040 keys: the codes made (every slot) and used
        if stale:
            monkeypatch.setattr(SlotCodes, "write", lambda *a: True)
        engine.step({1: 1038}, attention)  # a whole prompt over the old slots
        return torch.cat([engine.step({1: 1}, attention)[1] for _ in range(2)])

    monkeypatch.setenv("HF_SPARSEMAX_KV_SKIP", "0")
    fresh = FakeEngine([new], blocks=70, seed=9, block=16)
    fresh.step({0: 1038}, attention)
    expected = torch.cat([fresh.step({0: 1}, attention)[0] for _ in range(2)])
    monkeypatch.setenv("HF_SPARSEMAX_KV_SKIP", "1")
    reset_counts()
    assert torch.equal(reused(stale=False), expected)
    assert COUNTS["calls"] == 3 and COUNTS["certified"] > 0
    assert not torch.equal(reused(stale=True), expected)


def test_keys_whose_slots_break_a_code_block_are_read(monkeypatch):
    """Cache blocks of 8 slots (half a code block) in shuffled order: a key is certified only where its code block's
    slots are consecutive from a multiple of 16 (the others are scored exactly), the output bit for bit the
    uncertified call's; codes made from every slot, then rewritten for some, as an engine writes them."""
    from hf_sparsemax.attention.cpu import fused
    from hf_sparsemax.attention.blocked.keycodes import SlotCodes

    if not fused.available():
        pytest.skip("no C compiler")
    torch.manual_seed(10)
    cache_blocks, block, keys = 300, 8, 1200
    rows = torch.randn(cache_blocks * block, 2, KV_HEADS, DIM)
    codes = SlotCodes(rows[:, 0])
    rows[:100, 0] = torch.randn(100, KV_HEADS, DIM) * 3
    assert codes.write(rows[:, 0], torch.arange(100))  # the new keys of 100 slots
    tables = torch.stack([torch.randperm(cache_blocks)[: keys // block] for _ in range(2)])
    positions = torch.arange(keys)
    slots = tables[:, positions // block] * block + positions % block
    mask = torch.zeros(2, 1, 1, 1, keys)
    mask[1, ..., 1000:] = torch.finfo(torch.float32).min  # the second request has 1000 keys
    query = torch.randn(2, KV_HEADS, HEADS // KV_HEADS, 1, DIM) * 2
    for alpha in (2.0, 1.5, learned_alpha().view(1, KV_HEADS, HEADS // KV_HEADS, 1, 1)):
        full = fused.paged_decode(query, rows[:, 0], rows[:, 1], slots, mask, alpha, SCALE)
        certified = fused.paged_decode(query, rows[:, 0], rows[:, 1], slots, mask, alpha, SCALE, codes=codes)
        assert torch.equal(certified, full)
        first = slots[:, ::16] % 16 == 0  # a code block's first 8 keys coded; its last 8 where they follow
        coded = 8 * first.sum(1) + 8 * (first & (slots[:, 8::16] == slots[:, ::16] + 8)).sum(1)
        assert (0 < codes.certified.view(2, KV_HEADS)).all()
        assert (codes.certified.view(2, KV_HEADS) <= coded[:, None]).all()


@pytest.mark.parametrize("attn,options", ATTENTIONS, ids=[f"{a}{o}" for a, o in ATTENTIONS])
def test_a_whole_prompt_on_its_own_keys_equals_its_keys_gathered(attn, options, monkeypatch):
    """A whole new prompt is attended over the step's own keys and values (no gather), a prompt with a cached
    prefix or a later chunk over its keys gathered out of the cache: the same rows, bit for bit."""
    _, attention = layer_of(attn, options)
    seqs = sequences([12, 9], seed=11)
    own, gathered = FakeEngine(seqs, seed=12), FakeEngine(seqs, seed=12)
    calls = []
    monkeypatch.setattr(paged, "gather", lambda *a, gather=paged.gather: calls.append(a[3]) or gather(*a))
    first = own.step({0: 12, 1: 5}, attention)
    assert calls == []  # two whole prompts: nothing gathered
    second = own.step({1: 4}, attention)
    assert calls == [9]  # a later chunk: its 9 keys gathered
    for out, steps in ((first, {0: 12, 1: 5}), (second, {1: 4})):  # the keys withheld: every prompt gathered
        again = gathered.step(steps, attention, own=False)
        for request in steps:
            assert torch.equal(again[request], out[request])
    assert calls == [9, 12, 5, 9]


def test_codes_written_with_chunks_and_a_cached_prefix_are_the_keys_codes(monkeypatch):
    """Once a cache keeps the certificate's codes (a decode step of MIN_KEYS keys made them), the prompts written
    after it (one in three chunks, one whose prefix was cached by an earlier step, each chunk's slots checked
    once for the step's layers) get their codes at the write, in the same call: every slot's codes equal codes made
    afresh from the cache's keys, and the steps that decode over them (certified, three layers sharing one plan)
    equal, bit for bit, the same steps without the certificate."""
    from hf_sparsemax.attention.blocked.keycodes import COUNTS, SlotCodes, reset_counts
    from hf_sparsemax.attention.cpu import fused

    if not fused.available():
        pytest.skip("no C compiler")
    _, attention = layer_of("entmax15", {})
    seqs = sequences([1045, 1072, 1092], seed=13)
    steps = ({0: 1039}, {0: 1}, {1: 400, 2: 500, 0: 1}, {1: 400, 2: 590, 0: 1}, {1: 270, 0: 1},
             {0: 1, 1: 1, 2: 1}, {2: 1, 1: 1, 0: 1})  # codes made at the second step, before requests 1 and 2

    def run(skip):
        monkeypatch.setenv("HF_SPARSEMAX_KV_SKIP", "1" if skip else "0")
        engine = FakeEngine(seqs, blocks=220, seed=14, block=16)
        outputs = [engine.step(step, attention, layers=3) for step in steps]
        assert engine.done == [1045, 1072, 1092]
        return engine, outputs

    reset_counts()
    certified, with_codes = run(skip=True)
    codes = paged.SLOT_CODES[certified.cache]
    keys = paged.cache_rows(certified.cache)[:, 0]
    fresh = SlotCodes(keys)
    slots = (~torch.isnan(keys).any(-1).any(-1)).nonzero().squeeze(1)  # the written slots (the rest: NaN)
    assert len(slots) == sum(certified.done)
    for name in ("codes", "scales", "residuals"):
        assert torch.equal(getattr(codes, name)[:, slots], getattr(fresh, name)[:, slots]), name
    assert COUNTS["calls"] > 0 and COUNTS["certified"] > 0
    _, without = run(skip=False)
    for got, expected in zip(with_codes, without):
        assert got.keys() == expected.keys()
        for request in got:
            assert torch.equal(got[request], expected[request])
