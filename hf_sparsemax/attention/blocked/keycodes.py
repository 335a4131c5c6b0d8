"""The int8 key certificate: an int8 copy of every cached key, and decoding steps that never read the keys it
proves weigh nothing.

Page bounds (:mod:`.pages`) certify no page of a rotary model's keys; a bound per key does. Beside the cache's
page summary (:class:`.pages.PageSummary`: it follows the cache's appends, crops, reorders and static slots, and a
new summary starts new codes), :class:`KeyCodes` keeps per batch row, kv head and cached key ``k`` the codes
``c = round(k / s_k)`` (int8, ``s_k = max |k| / 127``) and the scale ``s_k`` (float32), and per batch row and kv
head the largest rounding residual and code norm. The fused kernel (:func:`.fused.decode`, ``fused.c``) writes the
codes of the keys appended since its last call (one call per layer and step, the step itself: no torch operation
per key), scores every key's codes against the query rows' int16 codes with integer products, bounds each float
score within ``E`` of its approximation (the proof is in ``fused.c``: the key's and the query's rounding and the
float32 sums), and reads the float keys only of the keys some row's bound cannot place below the keys the full
step solves over (a floor of the threshold from the bounds of the keys near the row's maximum: ``fused.c``
``tau_floor``; at least ``CANDIDATE_MARGIN / (alpha - 1)`` below the maximum), then the value rows of the
support only. Those are the full step's candidates with the full step's scores: the output is the full step's bit
for bit.

Memory: ``D + 4`` bytes a key (``D`` int8 codes and a float32 scale) against ``4 D`` for a float32 key (26.6% for
SmolLM2's ``D = 64``), in slots grown by :data:`.growing_cache.GENERATE_GROWTH` (4%: the codes held within 4% of
the keys coded, as the default cache's buffers, :func:`.growing_cache.grown_size`). A layer whose step certifies
less than ``MIN_CERTIFIED`` of its keys scores them all for the next ``RETRY`` steps (the codes are still
written). On from :data:`.pages.MIN_KEYS` cached keys, with the page summaries' switch ``HF_SPARSEMAX_KV_SKIP=0``.

A paged cache (vLLM's, :mod:`hf_sparsemax.integrations.vllm.paged_attention`) hands its slots from request to
request, so its codes are kept per slot (:class:`SlotCodes`, written with the slot's key) and the per-head bounds
are taken over each request's slots by the kernel (``fused.c``: the certificate per slot).
"""

from __future__ import annotations

import torch

from ..cpu.fused import CERTIFICATE, KEY_DTYPES, MAX_CODED_DIM, code_slots
from ..cpu.fused import decode as fused_decode
from .growing_cache import GENERATE_GROWTH, grown_size

BLOCK = CERTIFICATE["CODE_BLOCK"]  # keys a block of codes (fused.c: slots come in multiples of it)
MIN_CERTIFIED = 0.5  # share of a step's keys certified below which the layer backs off
RETRY = 32  # steps a layer scores every key after a step that certified less than MIN_CERTIFIED
COUNTS = {"calls": 0, "keys": 0, "certified": 0}  # certified steps, the keys they had, the keys never read


def certified_share() -> float:
    """The share of keys never read by the certified steps counted in :data:`COUNTS` (0 when there were none)."""
    return COUNTS["certified"] / COUNTS["keys"] if COUNTS["keys"] else 0.0


def reset_counts() -> None:
    COUNTS.update(calls=0, keys=0, certified=0)


class KeyCodes:
    """``codes [B, Hkv, slots, D]`` int8, ``scales [B, Hkv, slots]`` float32 of the first ``coded`` keys of a
    cache layer; ``bounds [B, Hkv, 2]`` float64 (the largest residual norm in units of the key's scale, the largest
    code norm); ``certified [B Hkv]`` the last certified step's count per kv head."""

    def __init__(self, key: torch.Tensor) -> None:
        batch, heads, _, dim = key.shape
        self.codes = torch.empty(batch, heads, 0, dim, dtype=torch.int8, device=key.device)
        self.scales = torch.empty(batch, heads, 0, dtype=torch.float32, device=key.device)
        self.bounds = torch.zeros(batch, heads, 2, dtype=torch.float64, device=key.device)
        self.certified = torch.zeros(batch * heads, dtype=torch.int64, device=key.device)
        self.coded = 0
        self.wait = 0  # steps before the next certified one (after one that did not pay: RETRY)
        self.checked_as = None  # the tensors and call layout the kernel last checked (its tensors are replaced, by
        # reserve and reorder, never resized in place: the same objects of the same sizes need no second check)

    def fits(self, key: torch.Tensor) -> bool:
        return self.codes.shape[:2] == key.shape[:2] and self.codes.shape[-1] == key.shape[-1]

    @staticmethod
    def serves(key: torch.Tensor) -> bool:
        """Whether keys of this head size can be coded: even (channel pairs), products exact in int32."""
        return key.shape[-1] % 2 == 0 and key.shape[-1] <= MAX_CODED_DIM

    def reserve(self, length: int, slots: int) -> None:
        """Room for ``length`` keys: a static cache's ``slots`` at once, a dynamic one's grown geometrically
        (:func:`.growing_cache.grown_size`, in blocks of ``BLOCK`` keys)."""
        if length <= self.codes.shape[2]:
            return
        size = -(-slots // BLOCK) * BLOCK if slots > length else grown_size(length, self.coded, GENERATE_GROWTH, BLOCK)
        batch, heads, _, dim = self.codes.shape
        codes = self.codes.new_empty(batch, heads, size, dim)
        scales = self.scales.new_empty(batch, heads, size)
        blocks = -(-self.coded // BLOCK) * BLOCK  # the codes' blocks are laid out together (fused.c, code_at)
        codes[:, :, :blocks] = self.codes[:, :, :blocks]
        scales[:, :, : self.coded] = self.scales[:, :, : self.coded]
        self.codes, self.scales = codes, scales

    def reorder(self, index: torch.Tensor) -> None:
        """Take batch rows ``index`` (a beam search's reorder): each row's codes, scales and bounds move with it."""
        heads = self.codes.shape[1]
        self.codes, self.scales = self.codes.index_select(0, index), self.scales.index_select(0, index)
        self.bounds = self.bounds.index_select(0, index)
        self.certified = self.certified.view(-1, heads).index_select(0, index).reshape(-1)

    def nbytes(self) -> int:
        """Bytes of the codes and scales (slots included; the per-head bounds are 16 bytes a kv head)."""
        return self.codes.nbytes + self.scales.nbytes + self.bounds.nbytes


class SlotCodes:
    """The int8 certificate of a paged cache, per slot: ``codes [Hkv, S, D]`` int8 (laid out in blocks of
    ``BLOCK`` slots, ``fused.c``'s ``code_at``), ``scales`` and ``residuals [Hkv, S]`` float32 (``S``: the cache's
    slots rounded up to ``BLOCK``; a slot's residual ``||k - s_k c|| / s_k`` rounded up), ``certified [B Hkv]``
    the last certified call's counts. Made from every slot of ``key_rows [slots, Hkv, D]`` (the cache's keys as
    they are), then written for each slot as its key is written (:meth:`write`): a slot's codes are always those
    of the key stored there, whichever request wrote it. ``D + 8`` bytes a slot and kv head."""

    def __init__(self, key_rows: torch.Tensor) -> None:
        slots, heads, dim = key_rows.shape
        size, device = -(-slots // BLOCK) * BLOCK, key_rows.device
        self.checked_as = None  # what the kernel last checked (fused.checked_slot_codes)
        self.codes = torch.zeros(heads, size, dim, dtype=torch.int8, device=device)
        self.scales = torch.full((heads, size), float("nan"), device=device)
        self.residuals = torch.zeros(heads, size, device=device)
        self.certified = torch.zeros(0, dtype=torch.int64, device=device)
        self.wait = 0
        self.written = self.write(key_rows, torch.arange(slots, device=device))  # False: no kernel (never used)

    def write(self, key_rows: torch.Tensor, slots: torch.Tensor) -> bool:
        """Code the keys ``key_rows[slots]`` (one kernel call); False where the kernel is not there."""
        return code_slots(key_rows, slots, self)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.residuals.nbytes


def take_turn(codes: KeyCodes | SlotCodes) -> bool:
    """Whether this step certifies (a layer that backed off scores every key for :data:`RETRY` steps)."""
    certify = codes.wait == 0
    codes.wait = max(codes.wait - 1, 0)
    return certify


def tally(codes: KeyCodes | SlotCodes, total: int) -> None:
    """Count a certified step of ``total`` keys in :data:`COUNTS`; one that certified fewer than
    :data:`MIN_CERTIFIED` of them makes the layer back off for :data:`RETRY` steps."""
    certified = sum(max(count, 0) for count in codes.certified.tolist())  # a few kv heads: no torch op
    COUNTS["calls"] += 1
    COUNTS["keys"] += total
    COUNTS["certified"] += certified
    if certified < MIN_CERTIFIED * total:
        codes.wait = RETRY


def coded_attention(problem, summary, length: int) -> torch.Tensor | None:
    """``out [B, Hkv, G q, D]`` of a decoding step (:class:`.blocks.Problem`, keys ``[0, length)`` written) by the
    fused kernel with the int8 certificate (the codes on ``summary``, a :class:`.pages.PageSummary`), or None where
    the kernel does not serve the call (the caller's other paths then)."""
    key = problem.key
    if problem.query.dtype != torch.float32 or key.dtype not in KEY_DTYPES or not KeyCodes.serves(key):
        return None  # the kernel does not serve it (no codes kept for a cache it never reads)
    codes = getattr(summary, "codes", None)
    if codes is None or not codes.fits(key):
        codes = summary.codes = KeyCodes(key)
    codes.reserve(length, key.shape[-2])
    certify = take_turn(codes)
    out = fused_decode(problem, problem.alpha, codes=codes, length=length, certify=certify)
    if out is not None and certify:
        tally(codes, key.shape[0] * key.shape[1] * length)
    return out
