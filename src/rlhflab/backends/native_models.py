"""The native runtime's whole models: causal LM and sequence classifier, loading and saving.

The blocks and the backbone are in :mod:`rlhflab.backends.native`; this module adds what rlhflab asks
of a transformers model (``base_model``, embeddings, resizing, checkpointing switches,
``save_pretrained``) and reads checkpoints: safetensors only, single file or sharded.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from rlhflab.backends.native import KVCache, NativeLlamaModel, NativeOutput
from rlhflab.backends.native_config import NativeConfig, NativeConfigError, read_config


def _grown_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """``weight`` (V, H) with rows appended up to n, each the mean of the old rows."""
    with torch.no_grad():
        extra = weight.mean(0, keepdim=True).expand(n - weight.shape[0], -1)
        return torch.cat([weight.detach(), extra])


class _NativePreTrained(nn.Module):
    """What rlhflab asks of a transformers model: ``base_model``, the embeddings, resizing,
    checkpointing switches and ``save_pretrained`` (transformers-compatible files)."""

    supports_gradient_checkpointing = True
    architecture = ""  # the transformers class name written into config.json
    # the source folder's generation_config.json (its stop ids, sampling defaults), written
    # again by save_pretrained, as transformers' models carry theirs
    generation_fields: dict | None = None

    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.config = cfg
        self.model = NativeLlamaModel(cfg)

    @property
    def base_model(self) -> NativeLlamaModel:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        return None

    def resize_token_embeddings(self, n: int) -> nn.Embedding:
        """Grow the vocabulary to ``n`` rows; new rows start at the mean of the old ones
        (an added pad token's embedding is masked out anyway)."""
        old = self.model.embed_tokens
        if n <= old.num_embeddings:
            raise ValueError(
                f"resize_token_embeddings: {n} is not larger than {old.num_embeddings}"
            )
        new = nn.Embedding.from_pretrained(_grown_rows(old.weight, n), freeze=False)
        self.model.embed_tokens = new
        self.config.vocab_size = n
        return new

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """Recompute each decoder layer in backward (non-reentrant checkpointing,
        ``native.recomputed_in_backward``)."""
        kwargs = gradient_checkpointing_kwargs or {}
        if kwargs.get("use_reentrant", False):
            raise ValueError("the native runtime checkpoints with use_reentrant=False only")
        self.model.checkpointing = True

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.checkpointing

    def save_pretrained(self, folder, safe_serialization=True, state_dict=None) -> None:
        """config.json and model.safetensors, readable by transformers' Auto classes."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        fields = self.config.to_dict()
        fields["architectures"] = [self.architecture]
        fields["vocab_size"] = self.get_input_embeddings().num_embeddings
        fields["dtype"] = str(self.get_input_embeddings().weight.dtype).replace("torch.", "")
        (folder / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        if self.generation_fields:
            text = json.dumps(self.generation_fields, indent=2, sort_keys=True) + "\n"
            (folder / "generation_config.json").write_text(text)
        state = self.state_dict() if state_dict is None else state_dict
        if getattr(self.config, "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


class NativeLlamaForCausalLM(_NativePreTrained):
    architecture = "LlamaForCausalLM"

    def __init__(self, cfg: NativeConfig):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def resize_token_embeddings(self, n: int) -> nn.Embedding:
        new = super().resize_token_embeddings(n)
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head = nn.Linear(new.embedding_dim, n, bias=False, device=new.weight.device)
            self.tie_weights()
        else:
            weight = _grown_rows(self.lm_head.weight, n)
            with _uninitialised():  # the weight is replaced at once
                self.lm_head = nn.Linear(weight.shape[1], n, bias=False, device=weight.device)
            self.lm_head.weight = nn.Parameter(weight)
        return new

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> NativeOutput:
        """Logits (B, L, V) — of the last ``logits_to_keep`` positions only when > 0 (the
        backbone's last layer then runs on those rows only: ``NativeLlamaModel.forward``)."""
        out = self.model(
            input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep
        )
        h = out.last_hidden_state
        out.logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return out


class NativeLlamaForSequenceClassification(_NativePreTrained):
    architecture = "LlamaForSequenceClassification"

    def __init__(self, cfg: NativeConfig):
        super().__init__(cfg)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_) -> NativeOutput:
        """Scores (B, num_labels) at each row's last real token: the last 1 of the attention
        mask (where the pad id may equal EOS, ids cannot tell padding apart); without a
        mask, the last token that is not the pad id (transformers' pooling)."""
        h = self.model(input_ids, attention_mask, position_ids).last_hidden_state
        scores = self.score(h)
        pad = getattr(self.config, "pad_token_id", None)
        if attention_mask is not None:
            real = attention_mask.bool()
        elif pad is not None:
            real = input_ids != pad
        else:
            real = torch.ones_like(input_ids, dtype=torch.bool)
        last = (torch.arange(input_ids.shape[1], device=h.device) * real).argmax(-1)
        return NativeOutput(logits=scores[torch.arange(len(last), device=h.device), last])


# ----------------------------------------------------------------------------- loading


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors``, or the shards its
    index names; [] when it has neither (transformers may still read other formats)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if not index.exists():
        return []
    try:
        shards = json.loads(index.read_text())["weight_map"].values()
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise NativeConfigError(f"{index}: not a safetensors index ({err!r})") from None
    return [folder / name for name in dict.fromkeys(shards)]


def read_weights(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint, single file or sharded, floating-point ones
    cast to ``dtype`` when given (read into memory: nothing stays tied to the file)."""
    files = weight_files(folder)
    if not files:
        raise NativeConfigError(
            f"{folder}: model.runtime=native reads safetensors checkpoints only "
            "(no model.safetensors or model.safetensors.index.json)"
        )
    state = {}
    for f in files:
        state.update(read_safetensors(f, dtype))
    return state


def _read_header(f, path: Path) -> tuple[dict, int]:
    """(header without its metadata, offset of the data) of an open safetensors file."""
    size = os.fstat(f.fileno()).st_size
    try:
        (header_len,) = struct.unpack("<Q", f.read(8))
        # checked before reading: the first 8 bytes of something else (a Git LFS pointer's
        # "version ", say) read as a length of exabytes
        if header_len > size - 8:
            raise ValueError(f"its header claims {header_len} bytes, the file has {size}")
        header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise NativeConfigError(f"{path}: not a safetensors file ({err})") from err
    if not isinstance(header, dict):
        raise NativeConfigError(f"{path}: not a safetensors file (its header is not a table)")
    header.pop("__metadata__", None)
    return header, 8 + header_len


def check_safetensors(path: Path) -> dict[str, list[int]]:
    """The shape of each tensor of a safetensors file whose header parses and whose tensors
    all lie inside the file: what a copy cut short or a file of something else fails.
    Reads the header only."""
    if not path.exists():
        raise NativeConfigError(f"{path}: missing (named by the checkpoint's index)")
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
    try:
        end = max((info["data_offsets"][1] for info in header.values()), default=0)
    except (TypeError, KeyError, IndexError) as err:
        raise NativeConfigError(f"{path}: not a safetensors file ({err!r})") from None
    size = path.stat().st_size
    if data_start + end > size:
        raise NativeConfigError(
            f"{path}: cut short ({size} bytes; its header describes {data_start + end})"
        )
    return {name: list(info.get("shape", [])) for name, info in header.items()}


def untrained_head_message(folder, field: str) -> str:
    """Why a folder without ``score`` weights is refused as a finished reward model."""
    return (
        f"{field}: {folder} has no trained score head in its weights (a causal LM, not a "
        "reward model); it would score through a freshly initialised head, at random — "
        f"train one with rlhflab rm (rm.init={folder})"
    )


# safetensors' dtype names (https://github.com/huggingface/safetensors, format: a u64 header
# length, a JSON header of name → dtype, shape, data_offsets, then the little-endian data)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, each read from the file straight into its own
    tensor and cast to ``dtype`` (floating-point ones) before the next is read.

    Why not ``safetensors.torch.load(path.read_bytes())``: that holds the whole file as
    bytes while it makes the tensors, so loading peaked at twice the weights (25M policy:
    +204 MiB of peak RSS for 99 MiB of weights, 2026-12-05), and a cast to another dtype
    kept both copies of everything until the end."""
    return dict(iter_safetensors(path, dtype))


def iter_safetensors(path: Path, dtype: torch.dtype | None = None):
    """Yield (name, tensor) for each tensor of one safetensors file in file order, each
    read from the file into its own memory (and cast, as :func:`read_safetensors`) only
    when asked for: a caller that copies each into a model and drops it holds one tensor
    at a time (``checkpoint.load_checkpoint``)."""
    if sys.byteorder != "little":  # the format is little-endian; let the library swap
        from safetensors.torch import load as load_bytes

        for k, v in load_bytes(Path(path).read_bytes()).items():
            yield k, _cast(v, dtype)
        return
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            kind = SAFETENSORS_DTYPES.get(info["dtype"])
            if kind is None:
                raise NativeConfigError(
                    f"{path}: tensor {name!r} is stored as {info['dtype']}, which "
                    f"model.runtime=native does not read (it reads {list(SAFETENSORS_DTYPES)})"
                )
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=kind)
            nbytes = tensor.numel() * tensor.element_size()
            if end - begin != nbytes:
                raise NativeConfigError(
                    f"{path}: tensor {name!r} has {end - begin} bytes of data for shape "
                    f"{info['shape']} in {info['dtype']} ({nbytes} expected)"
                )
            if nbytes:  # an empty tensor has no address to read into
                f.seek(data_start + begin)
                into = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
                if f.readinto(into) != nbytes:
                    raise NativeConfigError(f"{path}: tensor {name!r} is cut short (truncated?)")
            yield name, _cast(tensor, dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in ``dtype`` when it is floating-point and a dtype is given."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


@contextmanager
def _uninitialised():
    """Build Linear and Embedding layers without running their random initialisation: the
    checkpoint's tensors replace the parameters anyway. (Not the meta device: creating
    meta tensors imports torch's compiler stack, ``torch._refs`` → sympy, ~40 MiB.)"""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def load_native(
    folder: str | Path,
    kind: str,
    dtype: torch.dtype = torch.float32,
    num_labels: int | None = None,
    trained_head_for: str | None = None,
):
    """A native causal LM (``kind='causal'``) or sequence classifier (``'classifier'``).

    A classifier loaded from a causal LM's folder keeps the backbone and gets a fresh
    ``score`` head (normal, std ``initializer_range``) — as transformers does — unless
    ``trained_head_for`` names the config field that asks for a finished reward model:
    then such a folder is refused (:func:`untrained_head_message`). The model is
    built without initialising its weights and the read tensors are assigned to it, so the
    weights are in memory once.
    """
    folder = Path(folder)
    cfg = read_config(folder)
    if num_labels is not None:
        cfg.num_labels = num_labels
    cls = NativeLlamaForCausalLM if kind == "causal" else NativeLlamaForSequenceClassification
    with _uninitialised():  # uninitialised memory is not resident until written
        model = cls(cfg)
    generation = folder / "generation_config.json"
    if kind == "causal" and generation.is_file():
        try:
            model.generation_fields = json.loads(generation.read_text())
        except (OSError, ValueError):
            pass  # sampling settings are rlhflab's own; a broken file is not carried on
    state = read_weights(folder, dtype)
    if kind != "causal":
        state.pop("lm_head.weight", None)
    expected = dict(model.named_parameters())
    if kind == "causal" and getattr(cfg, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    fresh = [k for k in expected if k not in state]
    if kind != "causal" and fresh == ["score.weight"]:
        if trained_head_for:
            raise NativeConfigError(untrained_head_message(folder, trained_head_for))
        std = float(getattr(cfg, "initializer_range", 0.02))
        state["score.weight"] = torch.randn(cfg.num_labels, cfg.hidden_size, dtype=dtype) * std
        fresh = []
    unexpected = [k for k in state if k not in expected]
    if fresh or unexpected:
        raise NativeConfigError(
            f"{folder}: weights do not match a {cls.architecture} "
            f"(missing {fresh[:5]}, unexpected {unexpected[:5]})"
        )
    score = state.get("score.weight")
    if score is not None and score.shape[0] != cfg.num_labels:
        raise NativeConfigError(
            f"{folder}: the saved score head has {score.shape[0]} outputs, "
            f"{cfg.num_labels} were asked for"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if kind == "causal":
        model.tie_weights()
    return model.to(dtype)
