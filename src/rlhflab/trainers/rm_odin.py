"""ODIN's length head in a reward model (``rm.length_head``; Chen et al. 2024, "ODIN:
Disentangled Reward Mitigates Hacking in RLHF"): which heads it leaves alone, and the
settings :func:`rlhflab.trainers.rm.pair_loss` trains it with — as `rlhflab rm` trains it
and as a reward-model refresh fine-tunes a trained one."""

from __future__ import annotations

from rlhflab.config import ConfigError
from rlhflab.experience.rewards import LENGTH_HEAD

ODIN_EXEMPT = "odin_exempt"  # the model config's record of the heads ODIN left alone


def length_exempt_names(r, heads: list[str]) -> list[str]:
    """rm.length_exempt resolved for a model with heads ``heads``: None is the built-in
    task's 'brevity' head where there is one; a named head the model lacks is an error."""
    names = [h for h in ("brevity",) if h in heads] if r.length_exempt is None else r.length_exempt
    for h in names:
        if h not in heads or h == LENGTH_HEAD:
            quality = [x for x in heads if x != LENGTH_HEAD]
            raise ConfigError(f"rm.length_exempt: {h!r} is not one of the heads {quality}")
    return list(names)


def odin_settings(r, heads: list[str], exempt: list[str]) -> tuple:
    """:func:`pair_loss`'s ``odin`` for a reward model with heads ``heads`` (the length head
    among them) and ODIN-exempt heads ``exempt``, with the rm settings ``r``' loss weights."""
    idx = [heads.index(h) for h in exempt]
    return heads.index(LENGTH_HEAD), r.length_loss_weight, r.orthogonal_weight, idx


def trained_odin(model_config, heads: list[str], r) -> tuple | None:
    """The ``odin`` a refresh fine-tunes a trained reward model with: as `rlhflab rm` trained
    it, read from its config (``odin_exempt``, written since rm.length_exempt exists; a
    model with a length head but without that record was trained with none exempt). None
    without a length head."""
    if LENGTH_HEAD not in heads:
        return None
    exempt = [h for h in getattr(model_config, ODIN_EXEMPT, None) or [] if h in heads]
    return odin_settings(r, heads, exempt)
