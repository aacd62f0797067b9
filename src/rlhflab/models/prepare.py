"""What every model loader does besides reading the weights (:mod:`rlhflab.models`):
the checks of a model folder that turn a broken file into one line naming it, dropout off
before and after the model is built, and the fp32 rule for trained weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from rlhflab.errors import RlhflabError


def quiet_transformers() -> None:
    """Silence transformers' per-load progress bars; rlhflab shows its own per stage."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class ModelLoadError(RlhflabError, ValueError):
    """A model or tokenizer folder that cannot be used as configured."""


# names of dropout probabilities in configs and modules: attention_dropout, hidden_dropout,
# resid_pdrop (GPT-2, Phi), drop_path_rate, layerdrop
DROPOUT_NAME = re.compile(r"dropout|pdrop|drop_?path|layerdrop", re.IGNORECASE)
DROPOUT_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def zero_dropout_fields(obj) -> None:
    """Set every float attribute of ``obj`` named like a dropout probability to 0.0, and so
    in its sub-configs (``text_config`` and the like)."""
    for key, value in list(vars(obj).items()):
        if isinstance(value, float) and DROPOUT_NAME.search(key):
            setattr(obj, key, 0.0)
        elif key.endswith("_config") and hasattr(value, "__dict__"):
            zero_dropout_fields(value)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Dropout off everywhere (N+ detail): otherwise the first PPO ratio is not 1.

    Three places hold a dropout probability: dropout modules (``p``), float attributes that
    modules copied from the config when they were built (Llama/Qwen2/Mistral attention keep
    ``self.attention_dropout`` and pass it to the attention kernel in train mode), and the
    config itself. Zeroing the config alone reaches none of the built modules; the loaders
    also zero it before the model is built (:func:`hf_config`)."""
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = 0.0
        zero_dropout_fields(module)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        zero_dropout_fields(cfg)
    return model


def require_fp32_trainable(model: nn.Module, what: str) -> nn.Module:
    """Every trained weight is an fp32 master weight: a 16-bit one loses most small AdamW
    updates (bf16 keeps 8 bits of mantissa). Raised, never cast here: a trainable 16-bit
    parameter means a loader forgot its dtype."""
    wrong = [
        f"{name} ({p.dtype})"
        for name, p in model.named_parameters()
        if p.requires_grad and p.dtype != torch.float32
    ]
    if wrong:
        raise RuntimeError(f"{what}: trainable parameters not in float32: {wrong[:3]}")
    return model


def refuse_nonfinite_weights(model: nn.Module, path) -> None:
    """Refuse a model whose weights hold NaN or inf (a damaged file, a run that diverged),
    naming the first such tensor: otherwise the first anyone hears of it is NaN logits in
    sampling, far from the cause."""
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_meta:
            continue
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ModelLoadError(
                f"{path}: damaged weights: {name} holds {bad} NaN or infinite values of {t.numel()}"
            )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_weight_files(path) -> dict[str, list[int]]:
    """Each safetensors file of the folder readable and whole (header parsed, every tensor's
    data inside the file): a file cut short by a failed copy is named here, before either
    runtime reads it (transformers would fail with a bare SafetensorError). Returns the
    saved tensors' shapes ({} for a checkpoint in another format)."""
    from rlhflab.backends.native_config import NativeConfigError
    from rlhflab.backends.native_models import check_safetensors, weight_files

    shapes = {}
    try:
        for f in weight_files(Path(path)):
            shapes.update(check_safetensors(f))
    except NativeConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    return shapes


def hf_config(path, trust_remote_code: bool, **fields):
    """The folder's transformers config with every dropout probability zeroed *before* the
    model is built from it: modules copy some of them into plain attributes at build time."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **fields)
    zero_dropout_fields(config)
    return config


def hf_load(auto_class, path, trust_remote_code: bool, fields: dict, **kwargs):
    """``auto_class.from_pretrained`` with the dropout-free config, as (model, loading info);
    a folder transformers cannot read becomes a :class:`ModelLoadError` naming it."""
    from safetensors import SafetensorError

    quiet_transformers()
    errors = (*config_errors(), RuntimeError, SafetensorError)
    try:
        config = hf_config(path, trust_remote_code, **fields)
        # mismatched shapes are refused below, each named (transformers' own error points
        # at a load report that its quietened logging never shows)
        model, info = auto_class.from_pretrained(
            path,
            config=config,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            **kwargs,
        )
    except errors as exc:
        raise ModelLoadError(
            f"{path}: the model cannot be loaded ({load_error_reason(exc)})"
        ) from None
    mismatched = list(info.get("mismatched_keys") or ())
    if mismatched:
        raise ModelLoadError(mismatch_message(path, mismatched))
    return model, info


SIZE_MISMATCH = re.compile(
    r"size mismatch for ([^:]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) "
    r"from checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)"
)


def mismatch_message(path, mismatched) -> str:
    """One line for weights whose shapes the config disagrees with: ``mismatched`` is
    [(name, saved shape, shape by the config)], or torch's load_state_dict error text."""
    if isinstance(mismatched, str):
        text = mismatched
        mismatched = [
            (
                name,
                tuple(int(x) for x in a.split(",") if x.strip()),
                tuple(int(x) for x in b.split(",") if x.strip()),
            )
            for name, a, b in SIZE_MISMATCH.findall(mismatched)
        ]
        if not mismatched:  # torch worded it otherwise: its line as it is
            return f"{path}: config.json does not match the saved weights ({text.strip()[:300]})"
    name, saved, wanted = mismatched[0]
    n = len(mismatched)
    return (
        f"{path}: config.json does not match the saved weights: {name} is {tuple(saved)} in "
        f"the file but {tuple(wanted)} by the config ({n} tensor{'s' if n > 1 else ''} "
        f"differ{'' if n > 1 else 's'})"
    )


def config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises on a folder whose config.json it refuses: its configs'
    field checks (huggingface_hub's strict dataclasses, e.g. a hidden size that is not a
    multiple of the heads) are not ValueErrors."""
    from huggingface_hub.errors import StrictDataclassError

    return (OSError, ValueError, StrictDataclassError)


def load_error_reason(exc: BaseException) -> str:
    """The line of a load error that says what is wrong: a size mismatch if one is named
    (torch lists hundreds), a config check's own message, else the first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("size mismatch", "ValueError:")):
            return ln.removeprefix("ValueError: ")
    return first_line(exc)


def restore_dropout(folder: str | Path, model) -> None:
    """Put back, in the ``config.json`` just saved to ``folder``, the dropout probabilities
    of the folder ``model`` was loaded from (its config's ``name_or_path``): the loaders zero
    them so that the first PPO ratio is 1 (:func:`hf_config`), and the saved folder would
    otherwise tell whoever fine-tunes it next that the model never had dropout. A model
    with no source folder on disk is left as saved."""
    config = getattr(model, "config", None)
    source = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if not source:
        return
    src, out = Path(source) / "config.json", Path(folder) / "config.json"
    if not (src.is_file() and out.is_file()) or src.resolve() == out.resolve():
        return
    try:
        original, saved = json.loads(src.read_text()), json.loads(out.read_text())
    except (OSError, ValueError):
        return  # a loader has read the source already; nothing to mend here
    if _copy_dropout(original, saved):
        out.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _copy_dropout(original: dict, saved: dict) -> bool:
    """Copy into ``saved`` (a config.json's dict, sub-configs too) every dropout value of
    ``original`` that ``saved`` has under the same name; whether anything changed."""
    changed = False
    for key, value in original.items():
        if isinstance(value, dict) and isinstance(saved.get(key), dict):
            changed |= _copy_dropout(value, saved[key])
        elif isinstance(value, float) and DROPOUT_NAME.search(key) and saved.get(key) != value:
            if key in saved:
                saved[key] = value
                changed = True
    return changed


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute decoder-layer activations in backward (transformers' own mechanism, the
    non-reentrant torch.utils.checkpoint, which needs no input that requires grad, so LoRA
    works too). It acts only in train mode: sampling (eval mode, KV cache) is unaffected."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(
            f"model.gradient_checkpointing: {type(model).__name__} does not support it"
        )
    # transformers >= 5.x renamed it (the old name warns); older releases only have the old
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, under either transformers name."""
    flag = getattr(type(model), "is_activation_checkpointing", None)
    return bool(model.is_activation_checkpointing if flag else model.is_gradient_checkpointing)
