"""Converting a GGUF file (llama.cpp's format, usually quantised) into a plain Hugging Face
folder: ``config.json`` without any ``quantization_config``, dense ``model.safetensors`` and
the tokenizer with its chat template, which transformers and rlhflab's native runtime both load.

transformers' GGUF loader does the de-quantising (with the ``gguf`` package); this module
checks the file first, so that a wrong or damaged file is one line naming it, and writes the
folder atomically. ``gguf`` and transformers' GGUF code are imported only inside functions:
importing rlhflab never imports them.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import torch

from rlhflab.models.export import DTYPES, building_folder, check_out_dir
from rlhflab.models.prepare import ModelLoadError, first_line, quiet_transformers

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rlhflab[gguf]'"
MAGIC = b"GGUF"
# keys the GGUF route leaves in a config or tokenizer config that describe how this one load
# happened (the source file, hub flags), not the model: a plain folder must not carry them
_CONFIG_DROP = ("quantization_config", "_model_name_or_path", "_name_or_path")
_TOKENIZER_DROP = ("is_local", "local_files_only", "gguf_file", "name_or_path")


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be converted, or an output folder that cannot be written."""


def _require_gguf(path: Path):
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            f"{path}: reading a GGUF file needs the gguf package: {INSTALL_HINT}"
        ) from None
    return gguf


def _string_field(reader, key: str) -> str | None:
    """A string metadata value (``ReaderField.contents`` is missing from older gguf)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def inspect_gguf(path: str | Path) -> dict:
    """What the file holds (architecture, name, tensor count and storage types, bytes),
    after checking that it is a whole GGUF file: every tensor's data inside the file.

    Checked here rather than left to transformers, which fails on a damaged file deep inside
    numpy with a message that does not name it."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
    gguf = _require_gguf(path)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
        architecture = _string_field(reader, "general.architecture")
        name = _string_field(reader, "general.name")
        ends = [t.data_offset + t.n_bytes for t in reader.tensors]
        types = Counter(t.tensor_type.name for t in reader.tensors)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as exc:
        raise GGUFError(
            f"{path}: not a readable GGUF file, truncated or damaged ({first_line(exc)})"
        ) from None
    if ends and max(ends) > size:
        raise GGUFError(
            f"{path}: truncated: its tensors need {max(ends)} bytes, the file has {size}"
        )
    if not architecture:
        raise GGUFError(f"{path}: the GGUF file names no architecture (general.architecture)")
    return {
        "architecture": architecture,
        "name": name,
        "tensors": len(ends),
        "types": dict(types),
        "bytes": size,
    }


def _dequantising_options() -> dict:
    """transformers >= 5.2x may keep GGUF weights packed in their blocks (with a kernel);
    a plain folder needs them unpacked, which older releases always do."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _load_with_transformers(path: Path, info: dict):
    """(model, tokenizer) de-quantised by transformers from the local file, in fp32. The model
    first: its config is where an architecture transformers does not know is refused."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    where = {"gguf_file": path.name, "local_files_only": True}
    types = ", ".join(sorted(info["types"]))
    cannot = f"{path}: transformers {transformers.__version__} cannot"
    errors = (ValueError, NotImplementedError, KeyError, OSError, ImportError, TypeError)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, **where, **_dequantising_options()
        )
    except errors as exc:
        if "accelerate" in first_line(exc):  # transformers 5 reads GGUF only with accelerate
            raise GGUFError(f"{cannot} read it without accelerate: {INSTALL_HINT}") from None
        raise GGUFError(
            f"{cannot} de-quantise this file (architecture {info['architecture']!r}, tensor "
            f"types {types}): {first_line(exc)}"
        ) from None
    packed = [n for n, t in model.state_dict().items() if not t.dtype.is_floating_point]
    if packed:
        raise GGUFError(f"{cannot} unpack its weights ({packed[0]} stayed packed)")
    for name, t in model.state_dict().items():  # a damaged block de-quantises to NaN or inf
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise GGUFError(
                f"{path}: damaged: {name} de-quantises to {bad} NaN or infinite values of "
                f"{t.numel()}; nothing written"
            )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **where)
    except errors as exc:
        raise GGUFError(f"{cannot} build a tokenizer from this file: {first_line(exc)}") from None
    return model, tokenizer


def _write_config(model, folder: Path, dtype: torch.dtype) -> None:
    """config.json (and generation_config.json) of a plain dense checkpoint."""
    fields = model.config.to_dict()
    for key in _CONFIG_DROP:
        fields.pop(key, None)
    fields["architectures"] = [type(model).__name__]
    fields["dtype"] = str(dtype).replace("torch.", "")
    type(model.config).from_dict(fields).save_pretrained(folder)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)


def _write_tokenizer(tokenizer, folder: Path, vocab_size: int) -> None:
    """The tokenizer's files, its config cleared of how it was read (the GGUF, hub flags) and
    naming the generic fast class, which every transformers release knows (not
    transformers 5's ``TokenizersBackend``)."""
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    fields = json.loads(config_path.read_text())
    for key in _TOKENIZER_DROP:
        fields.pop(key, None)
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    dropped = _drop_tokens_past_vocab(folder / "tokenizer.json", vocab_size)
    for key, value in list(fields.items()):
        if key.endswith("_token") and value in dropped:
            fields[key] = None
    config_path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def _drop_tokens_past_vocab(path: Path, vocab_size: int) -> set[str]:
    """Remove added tokens with ids the model has no embedding row for: tokens the GGUF does
    not list, which transformers' GPT-2 tokenizer class adds by default (``<|endoftext|>``
    for a vocabulary without one). Kept, every load would refuse the tokenizer as larger than
    the embedding (models/loading.py)."""
    spec = json.loads(path.read_text())
    extra = [t for t in spec.get("added_tokens", []) if t["id"] >= vocab_size]
    if extra:
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < vocab_size]
        path.write_text(json.dumps(spec, ensure_ascii=False, indent=2) + "\n")
        log.info("dropped tokens the file does not list: %s", [t["content"] for t in extra])
    return {t["content"] for t in extra}


def _write_weights(model, folder: Path, dtype: torch.dtype) -> int:
    """model.safetensors in ``dtype``, a tied output matrix saved once; the parameter count."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    weights = folder / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})  # made readable by
    # building_folder's share_like_umask, as every other file of the folder
    return sum(t.numel() for t in state.values())


def convert_gguf(src: str | Path, out: str | Path, dtype: str = "fp32", force: bool = False):
    """Write the GGUF file ``src`` as a Hugging Face folder ``out``; returns a summary dict.

    The folder is built in a temporary sibling and renamed into place
    (:func:`rlhflab.models.export.building_folder`), so a failure at any point leaves
    ``out`` as it was. ``dtype``: 'fp32' or 'bf16' for the saved weights."""
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if dtype not in DTYPES:
        raise GGUFError(f"--dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    info = inspect_gguf(src)
    check_out_dir(out, force, GGUFError, protect=(src,))  # never a folder holding the GGUF
    types = ", ".join(f"{n} {t}" for t, n in sorted(info["types"].items()))
    log.info(
        "reading %s: %s, %d tensors (%s), %.1f MB",
        src,
        info["architecture"],
        info["tensors"],
        types,
        info["bytes"] / 1e6,
    )
    model, tokenizer = _load_with_transformers(src, info)
    with building_folder(out, GGUFError) as tmp:
        log.info("writing %s (%s)", out, dtype)
        _write_config(model, tmp, DTYPES[dtype])
        params = _write_weights(model, tmp, DTYPES[dtype])
        _write_tokenizer(tokenizer, tmp, model.get_input_embeddings().weight.shape[0])
    return {
        "source": str(src),
        "output": str(out),
        "architecture": info["architecture"],
        "model_class": type(model).__name__,
        "parameters": params,
        "dtype": dtype,
        "source_types": info["types"],
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }


def format_summary(summary: dict) -> str:
    """One line: what was written where."""
    template = "with" if summary["chat_template"] else "without"
    return (
        f"converted {summary['source']} → {summary['output']}: {summary['model_class']}, "
        f"{summary['parameters'] / 1e6:.1f}M parameters, {summary['dtype']}, tokenizer "
        f"{template} chat template"
    )
