"""The vLLM floor of hf_sparsemax's vLLM plugins (0.31), checked before vLLM is imported (no vLLM needed here)."""

import pytest

from hf_sparsemax.integrations.vllm.versions import MIN_VLLM, vllm_refusal


@pytest.mark.parametrize("version", ["0.31.0", "0.31.0rc1", "0.32.0", "0.32.0+cpu", "v0.40.1", "1.0.0", "0.31"])
def test_releases_from_the_floor_are_accepted(version):
    assert vllm_refusal(version) is None


@pytest.mark.parametrize("version", ["0.30.2", "0.11.0", "0.9.2+cpu", "0.30.99rc1"])
def test_older_releases_are_refused_in_one_line(version):
    reason = vllm_refusal(version)
    assert reason is not None and "\n" not in reason
    assert "need vLLM >= 0.31 (the first release whose Model Runner V2 takes custom logits processors)" in reason
    assert f"this environment has vLLM {version}" in reason


def test_an_unreadable_version_is_refused():
    assert "could not read vLLM's version 'unknown'" in vllm_refusal("unknown")
    assert MIN_VLLM == (0, 31)
