"""The config of a checkpoint that rlhflab's native runtime (:mod:`rlhflab.backends.native`)
runs: ``config.json`` read and checked against what the runtime implements, anything else
refused with the field named."""

from __future__ import annotations

import json
from pathlib import Path

from rlhflab.errors import RlhflabError

SUPPORTED_MODEL_TYPES = ("llama",)


class NativeConfigError(RlhflabError, ValueError):
    """A checkpoint the native runtime does not implement (the message names the field)."""


class NativeConfig:
    """The fields of a checkpoint's config.json, as attributes (``cfg.hidden_size``).

    Unknown fields are kept as they were read and written back unchanged on save, so a
    checkpoint round-trips through rlhflab without losing anything transformers needs.
    """

    def __init__(self, fields: dict):
        self.__dict__.update(fields)
        self._labels_read = "id2label" in fields  # else written back only once changed
        labels = fields.get("id2label") or {"0": "LABEL_0"}
        self.id2label = {int(k): v for k, v in labels.items()}
        self.label2id = {v: k for k, v in self.id2label.items()}
        self.head_dim = fields.get("head_dim") or self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = fields.get("num_key_value_heads") or self.num_attention_heads

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        if n != self.num_labels:
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.label2id = {v: k for k, v in self.id2label.items()}

    def rope_theta(self) -> float:
        params = getattr(self, "rope_parameters", None) or {}
        return float(params.get("rope_theta", getattr(self, "rope_theta", 10000.0)))

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        if self._labels_read or self.id2label != {0: "LABEL_0"}:
            out["id2label"] = {str(k): v for k, v in self.id2label.items()}
            out["label2id"] = dict(self.label2id)
        else:  # a causal LM's config that named no labels: saved as it was read
            out.pop("id2label", None)
            out.pop("label2id", None)
        return out


def read_config(folder: str | Path) -> NativeConfig:
    """config.json of ``folder``, checked against what this runtime implements."""
    path = Path(folder) / "config.json"
    try:
        fields = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise NativeConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(fields, dict):
        raise NativeConfigError(f"{path}: not a model config (a JSON object of settings)")
    checks = {
        "model_type": (fields.get("model_type"), SUPPORTED_MODEL_TYPES),
        "hidden_act": (fields.get("hidden_act", "silu"), ("silu",)),
        "pretraining_tp": (fields.get("pretraining_tp", 1), (1,)),
    }
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    checks["rope_parameters.rope_type"] = (rope.get("rope_type", "default"), ("default",))
    for field, (value, allowed) in checks.items():
        if value not in allowed:
            raise NativeConfigError(
                f"{path}: {field}={value!r} is not supported by model.runtime=native "
                f"(supported: {list(allowed)}); use model.runtime=transformers"
            )
    return NativeConfig(fields)
