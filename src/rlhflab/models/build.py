"""One way to load a model for any command: :func:`load_model` applies the ``model`` section's
options (runtime, remote code, fp32 master weights or a frozen precision, dropout off, lean
activations) and :func:`finish_models` the ones that must come last (the CPU matmul library,
activation checkpointing). SFT, RM, DPO and the PPO cast all go through these two, so a
setting of the ``model`` section means the same in every command.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhflab.backends.cpu_blas import apply_cpu_matmul
from rlhflab.backends.input_cast import set_cast_once
from rlhflab.backends.lean import make_activations_lean
from rlhflab.backends.native import set_cpu_attention_fp32
from rlhflab.backends.weight_cast import keep_weight_casts
from rlhflab.config.models import ModelConfig
from rlhflab.models.frozen import PRECISION_DTYPES
from rlhflab.models.heads import critic_from_causal_lm
from rlhflab.models.hf_attention import set_transformers_cpu_attention_fp32
from rlhflab.models.loading import (
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    resolve_path,
)
from rlhflab.models.precision import autocast_dtype
from rlhflab.models.prepare import (
    enable_gradient_checkpointing,
    refuse_nonfinite_weights,
    require_fp32_trainable,
)

KINDS = ("causal", "classifier", "critic")


def load_tokenizer_for(spec: str, options: ModelConfig, field: str = "model.policy"):
    """The tokenizer of ``spec`` (a folder or ``preset:NAME``), read as ``options`` say."""
    path = resolve_path(spec, field)
    return load_tokenizer(path, options.trust_remote_code, runtime=options.runtime)


def load_model(
    spec: str,
    tokenizer,
    options: ModelConfig,
    kind: str = "causal",
    *,
    field: str = "model.policy",
    trained: bool = True,
    precision: str = "fp32",
    num_labels: int | None = None,
    trained_head_for: str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """A model from ``spec``, prepared as every command prepares it.

    ``kind``: 'causal' (a causal LM), 'classifier' (a sequence-classification model: a
    reward model, or one to be trained as such with ``num_labels`` heads) or 'critic' (a
    causal LM's backbone with a zero-initialised value head). A ``trained`` model holds fp32
    master weights whatever the folder's dtype and gets the lean activations; a frozen one is
    read in the float dtype of ``precision`` (int8 quantises an fp32 model later, in
    :func:`rlhflab.models.frozen.set_precision`). Dropout is off in both (the loaders); the
    attention takes ``model.cpu_attention_fp32`` (native runtime, or a transformers model
    loaded with SDPA).
    ``trained_head_for`` names the setting of a finished reward model, whose ``score`` head
    must be in the weights. ``dtype`` overrides the frozen dtype (a reward model that a
    trained critic is copied from is read in fp32 and cast to ``precision`` afterwards).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = resolve_path(spec, field)
    if trained:
        dtype = torch.float32
    elif dtype is None:
        dtype = PRECISION_DTYPES.get(precision, torch.float32)
    common = {"trust_remote_code": options.trust_remote_code, "runtime": options.runtime}
    if kind == "causal":
        model = load_causal_lm(path, tokenizer, dtype=dtype, **common)
    elif kind == "critic":
        model = critic_from_causal_lm(path, tokenizer, field=field, **common)
    else:
        model = load_sequence_classifier(
            path,
            tokenizer,
            num_labels=num_labels,
            owned=precision != "fp32",
            dtype=dtype,
            trained_head_for=trained_head_for,
            **common,
        )
    refuse_nonfinite_weights(model, path)
    # every model a command loads, trained or frozen (eval, compare, demo included)
    set_attention_fp32_on_cpu(options.cpu_attention_fp32, [model])
    if trained:
        return prepare_trained(model, options)
    set_cast_once(options.cast_once, [model])
    return model


def set_attention_fp32_on_cpu(on: bool, models) -> None:
    """``model.cpu_attention_fp32`` on ``models`` whichever runtime loaded them: the native
    runtime's attention modules and transformers models loaded with SDPA (each switch
    passes over the other runtime's models)."""
    set_cpu_attention_fp32(on, models)
    set_transformers_cpu_attention_fp32(on, models)


def prepare_trained(model: nn.Module, options: ModelConfig) -> nn.Module:
    """What a model about to be trained gets, whether it was loaded or copied from another
    (the critic made from the reward model): lean activations, before LoRA and any reference
    copy so that every copy has the same modules; ``model.cast_once`` on its modules."""
    if options.lean_activations:
        make_activations_lean(model)
    set_cast_once(options.cast_once, [model])
    return model


def finish_models(options: ModelConfig, device, trained=(), frozen=()) -> None:
    """The options that apply once every model exists: the CPU matmul library (after
    quantisation and offloading, so only plain float Linear layers change), and activation
    checkpointing and the kept 16-bit weight copies (``model.cast_cache``) of trained
    models. Trained models are checked to hold fp32 weights; a
    model.compute_dtype this device cannot run is refused here, before any training."""
    autocast_dtype(device, options.compute_dtype)
    trained = [m for m in trained if m is not None]
    apply_cpu_matmul(options.cpu_matmul, device, [*trained, *frozen])
    for model in trained:
        if options.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if options.cast_cache and options.compute_dtype != "fp32":
            keep_weight_casts(model, frozen_too=not options.gradient_checkpointing)


def to_trained(model: nn.Module, device, what: str) -> nn.Module:
    """``model`` on ``device`` in train mode, refused unless its trainable weights are fp32."""
    return require_fp32_trainable(model.to(device).train(), what)
