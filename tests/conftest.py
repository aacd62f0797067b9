"""Shared fixtures: tiny models built locally into a per-session cache (no download)."""

import os

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["RLHFLAB_CACHE"] = str(tmp_path_factory.mktemp("rlhflab-cache"))
    yield


@pytest.fixture(scope="session")
def nano_rm(tmp_path_factory):
    """A 3-head reward model on the nano preset, sharing the policy tokenizer."""
    from rlhflab.models.presets import build_preset

    return build_preset(
        "nano",
        tmp_path_factory.mktemp("rm"),
        seed=1,
        heads=["correctness", "brevity", "politeness"],
    )


@pytest.fixture(scope="session")
def foreign_rm(tmp_path_factory):
    """A reward model whose tokenizer was trained on other text (different vocabulary)."""
    from rlhflab.models.presets import build_preset

    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["cat dog sun moon"] * 5
    return build_preset(
        "nano", tmp_path_factory.mktemp("rm-foreign"), seed=2, heads=["score"], corpus=corpus
    )


@pytest.fixture
def sdpa_dtypes(monkeypatch):
    """The dtypes SDPA computes in at every call of this test: those of q, k and v, or the
    autocast dtype where CPU autocast is on (it lowers SDPA's inputs to it)."""
    seen, real = [], F.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        if torch.is_autocast_enabled("cpu"):
            seen.append((torch.get_autocast_dtype("cpu"),) * 3)
        else:
            seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen
