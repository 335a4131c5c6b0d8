"""Every causal-LM model type of the installed transformers: WORKS or REFUSED at patch time, as the docs say."""

import pytest

import hf_sparsemax as hs
from hf_sparsemax.attention.families import family_verdict

from family_sweep import NOT_BUILT, TABLE_END, TABLE_START, causal_lm_types, docs_section, sweep, table

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_type", [t for t in causal_lm_types() if t not in NOT_BUILT])
def test_family_works_or_is_refused_at_patch_time(model_type):
    attention, loss = sweep(model_type)
    assert attention == ("REFUSED" if family_verdict(model_type) else "WORKS"), family_verdict(model_type)
    assert loss in ("WORKS", "REFUSED", "not run")


def test_docs_table_and_supported_families_agree_with_the_sweep():
    with open("docs/families.md", encoding="utf-8") as handle:
        text = handle.read()
    assert TABLE_START in text and TABLE_END in text
    assert docs_section(text) == table(), "docs/families.md's family table is stale: run python tests/family_sweep.py"
    supported = set(hs.supported_families())
    for model_type in causal_lm_types():
        assert (model_type in supported) == (family_verdict(model_type) is None), model_type


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"])
def test_models_without_attention_are_refused_as_such(model_type):
    from family_sweep import build

    with pytest.raises(ValueError, match="has no attention"):
        hs.patch_model(build(model_type), attn="entmax15")
