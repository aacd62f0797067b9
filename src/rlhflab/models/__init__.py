"""The models of a run: loading and preparing them, value heads, frozen-model options and
the local presets (:mod:`rlhflab.models.presets`). The four-model cast built from them and
the config is one layer up, in :mod:`rlhflab.experience.cast`.

The names below are the package's public surface; each lives in the module named beside it.
"""

from rlhflab.models.forward import (
    backbone_hidden,
    causal_forward,
    last_real_index,
    last_token_hidden,
    position_ids_from_mask,
)
from rlhflab.models.frozen import (
    PRECISION_DTYPES,
    LoraReference,
    Offloaded,
    freeze,
    make_reference,
    module_bytes,
    set_precision,
)
from rlhflab.models.heads import (
    CriticValues,
    PolicyWithValueHead,
    critic_from_causal_lm,
    critic_from_reward_model,
    token_values,
)
from rlhflab.models.loading import (
    RUNTIMES,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    position_limit,
    positions_of,
    release_freed_memory,
    resolve_path,
    same_tokenizer,
)
from rlhflab.models.lora import (
    ALL_LINEAR,
    apply_lora,
    check_targets,
    linear_layers,
    load_lora_adapter,
    lora_critic,
)
from rlhflab.models.precision import (
    COMPUTE_DTYPES,
    autocast_dtype,
    compute_autocast,
    fp32_head,
    frozen_compute_dtype,
)
from rlhflab.models.prepare import (
    ModelLoadError,
    check_weight_files,
    disable_dropout,
    enable_gradient_checkpointing,
    first_line,
    hf_config,
    hf_load,
    is_checkpointing,
    quiet_transformers,
    require_fp32_trainable,
    zero_dropout_fields,
)
from rlhflab.models.text import encode_prompt, leading_special_ids, stop_ids

__all__ = [
    "ALL_LINEAR",
    "RUNTIMES",
    "COMPUTE_DTYPES",
    "PRECISION_DTYPES",
    "CriticValues",
    "LoraReference",
    "ModelLoadError",
    "Offloaded",
    "PolicyWithValueHead",
    "apply_lora",
    "autocast_dtype",
    "backbone_hidden",
    "causal_forward",
    "check_targets",
    "check_weight_files",
    "compute_autocast",
    "critic_from_causal_lm",
    "critic_from_reward_model",
    "disable_dropout",
    "encode_prompt",
    "enable_gradient_checkpointing",
    "first_line",
    "fp32_head",
    "frozen_compute_dtype",
    "freeze",
    "hf_config",
    "hf_load",
    "is_checkpointing",
    "last_real_index",
    "last_token_hidden",
    "leading_special_ids",
    "linear_layers",
    "load_causal_lm",
    "load_lora_adapter",
    "load_sequence_classifier",
    "load_tokenizer",
    "lora_critic",
    "make_reference",
    "module_bytes",
    "position_ids_from_mask",
    "quiet_transformers",
    "release_freed_memory",
    "require_fp32_trainable",
    "position_limit",
    "positions_of",
    "resolve_path",
    "same_tokenizer",
    "set_precision",
    "stop_ids",
    "token_values",
    "zero_dropout_fields",
]
