"""LoRA on any Hugging Face model: where the adapters go (``model.lora_targets``), checked
against the model before peft sees the names, and the LoRA critic.

``'all-linear'`` (the default) is peft's own shorthand: every ``nn.Linear`` and every
transformers ``Conv1D`` (GPT-2's fused projections) except the output head — the vocabulary
projection of a causal LM, the ``score`` head of a classifier — whatever the architecture
calls its layers. A list names modules by the last part of their path (``q_proj``,
``c_attn``, ``query_key_value``) or a longer suffix (``attn.c_proj``), as peft matches them;
a name that matches no adaptable layer is refused here, naming the field and listing the
model's Linear layers, instead of peft's error deep inside, or silence when another name of
the list matched.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from rlhflab.models.frozen import PRECISION_DTYPES
from rlhflab.models.loading import release_freed_memory
from rlhflab.models.prepare import ModelLoadError, first_line

ALL_LINEAR = "all-linear"
# peft's task types: a causal LM, or a sequence classifier whose `score` head trains whole
TASKS = {"causal": "CAUSAL_LM", "critic": "SEQ_CLS"}


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every layer LoRA can adapt as a matrix, by its full module path: ``nn.Linear`` and
    transformers' ``Conv1D`` (a Linear with its weight stored transposed)."""
    kinds = (nn.Linear, _conv1d_class())
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def _matches(path: str, target: str) -> bool:
    """peft's rule for a listed name: the whole path, or its last dotted parts."""
    return path == target or path.endswith("." + target)


def check_targets(
    model: nn.Module, targets: str | list[str], field: str = "model.lora_targets"
) -> dict[str, nn.Module]:
    """The layers ``targets`` selects (for 'all-linear': every Linear layer, peft leaves out
    the output head itself); raises ModelLoadError naming ``field`` when a listed name
    matches none of them, or the model has no Linear layer at all."""
    layers = linear_layers(model)
    short = sorted({name.rsplit(".", 1)[-1] for name in layers})
    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    if not layers:
        raise ModelLoadError(f"{field}: this {kind} model has no Linear layer for LoRA to adapt")
    if targets == ALL_LINEAR:
        return layers
    missing = [t for t in targets if not any(_matches(name, t) for name in layers)]
    if missing:
        raise ModelLoadError(
            f"{field}: {missing} match no Linear layer of this {kind} model; its Linear "
            f"layers are named {short} (or use '{ALL_LINEAR}': every Linear layer but the "
            "output head)"
        )
    return {name: m for name, m in layers.items() if any(_matches(name, t) for t in targets)}


def apply_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    targets: str | list[str],
    kind: str = "causal",
    field: str = "model.lora_targets",
    seed: int = 0,
):
    """``model`` wrapped by peft with rank-``r`` adapters on the ``targets`` layers (checked
    first: :func:`check_targets`); only the adapters train, and for ``kind='critic'`` (a
    sequence classifier) also its whole ``score`` head. No dropout: the first PPO ratio
    must be 1.

    The adapters' random start (peft's Kaiming-uniform ``lora_A``; ``lora_B`` is zero) is
    drawn from ``seed`` alone, on a forked generator: what ran before (a preset built on
    first use, a head initialised and then zeroed) would otherwise change it, and a run
    would start elsewhere depending on whether a cache was warm or how many ranks it has.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelLoadError("model.lora_r > 0 needs peft: pip install 'rlhflab[lora]'") from None
    chosen = check_targets(model, targets, field)
    conv1d = _conv1d_class()
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets if targets == ALL_LINEAR else list(targets),
        task_type=TASKS[kind],
        modules_to_save=["score"] if kind == "critic" else None,
        # Conv1D keeps its weight as (in, out): peft must know, or it warns and guesses
        fan_in_fan_out=any(isinstance(m, conv1d) for m in chosen.values()),
    )
    with warnings.catch_warnings():
        # peft asks the model `is_gradient_checkpointing`, which transformers 5 deprecates
        # in favour of `is_activation_checkpointing`: a notice for peft, not for our users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")
        with torch.random.fork_rng(devices=[]):  # peft draws on the CPU, then moves
            torch.manual_seed(seed)
            return get_peft_model(model, cfg)


def lora_critic(
    critic: nn.Module,
    r: int,
    alpha: float,
    targets: str | list[str],
    precision: str = "fp32",
    field: str = "model.lora_targets",
    seed: int = 0,
):
    """A separate critic (a sequence classifier with a one-output ``score`` head) that trains
    through rank-``r`` adapters and its whole head, its backbone frozen.

    The frozen backbone is held in ``precision`` where that is a float dtype (bf16/fp16:
    half the bytes); int8 stays fp32, as peft cannot put adapters on torch's dynamically
    quantised Linear layers. The head and the adapters are fp32 master weights whatever
    the backbone's dtype (peft makes 16-bit adapters fp32); the head reads the backbone's
    hidden states cast to its own dtype (:func:`rlhflab.models.heads.token_values`).
    """
    dtype = PRECISION_DTYPES.get(precision, torch.float32)
    if dtype != torch.float32:
        critic.base_model.to(dtype)  # the backbone: `score` sits beside it and stays fp32
        release_freed_memory()
    return apply_lora(critic, r, alpha, targets, kind="critic", field=field, seed=seed)


def load_lora_adapter(lm: nn.Module, folder: str | Path) -> nn.Module:
    """``lm`` with the PEFT adapter saved in ``folder`` (``adapter_config.json``) on it."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelLoadError(
            f"{folder}: a LoRA adapter needs peft: pip install 'rlhflab[lora]'"
        ) from None
    try:
        with warnings.catch_warnings():  # as in apply_lora: peft's use of a deprecated name
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")
            return PeftModel.from_pretrained(lm, str(folder))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{folder}: the adapter cannot be loaded ({first_line(exc)})"
        ) from None
