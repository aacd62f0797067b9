"""Loading models and tokenizers from local folders, through transformers or rlhflab's
native runtime; activation checkpointing and byte counts (LoRA: :mod:`rlhflab.models.lora`).

Each loader applies what every model needs before it is used (:mod:`rlhflab.models.prepare`):
the folder's files checked, dropout off, fp32 weights for the models that train.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from rlhflab.models.forward import contiguous_head_input
from rlhflab.models.prepare import (
    ModelLoadError,
    check_weight_files,
    config_errors,
    disable_dropout,
    hf_load,
    load_error_reason,
    mismatch_message,
)
from rlhflab.models.presets import preset_path
from rlhflab.models.text import leading_special_ids, record_stop_ids

log = logging.getLogger(__name__)


def _owned_memory_kwargs() -> dict:
    """Ask transformers (>= 5) to read weights into memory instead of memory-mapping them.

    Memory-mapped weights stay tied to the file: after an int8 or bf16 conversion the fp32
    pages that were read remain resident as long as any tensor of the file lives, so the
    frozen models would cost their fp32 size anyway (measured in benchmarks/memory_cast.py).
    """
    import inspect

    from transformers import PreTrainedModel

    params = inspect.signature(PreTrainedModel.from_pretrained).parameters
    return {"disable_mmap": True} if "disable_mmap" in params else {}


def release_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), so a transient copy made
    while loading or converting a model does not stay resident for the rest of the run."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        pass


def resolve_path(spec: str, field: str = "model") -> Path:
    """``preset:NAME`` → the cached preset folder; otherwise an existing local folder."""
    if spec.startswith("preset:"):
        try:
            return preset_path(spec.split(":", 1)[1])
        except ValueError as exc:
            raise ModelLoadError(f"{field}: {exc}") from None
    # absolute: the name transformers and PEFT record (a LoRA adapter's base) must find the
    # folder from any directory
    path = Path(spec).expanduser().absolute()
    if path.is_file():  # e.g. its config.json: "(no config.json)" would mislead
        where = f"{path.parent}, the folder that holds it" if path.name == "config.json" else None
        raise ModelLoadError(
            f"{field}: {spec!r} is a file, not a model folder"
            + (f"; give {where}" if where else " (a folder holding config.json and the weights)")
        )
    if not path.exists():
        relative = "" if Path(spec).expanduser().is_absolute() else f", looked for at {path}"
        raise ModelLoadError(
            f"{field}: {spec!r} does not exist (no such folder{relative}); rlhflab never "
            "downloads at run time — use preset:NAME or a saved folder"
        )
    adapter = path / "adapter_config.json"
    if adapter.is_file() and not (path / "config.json").exists():
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            base = None
        raise ModelLoadError(
            f"{field}: {spec!r} is a LoRA adapter (adapter_config.json), not a whole model"
            + (f"; its base model is {base!r}" if base else "")
            + ": give a whole model folder (an rlhflab run's policy: `rlhflab export RUN "
            "OUT` merges its adapter; another adapter: peft's merge_and_unload, then "
            "save_pretrained)"
        )
    if not (path / "config.json").exists():
        raise ModelLoadError(
            f"{field}: {spec!r} is not a local Hugging Face model folder (no config.json); "
            "rlhflab never downloads at run time — use preset:NAME or a saved folder"
        )
    try:  # read here, so that every loader after this reads a config known to be JSON
        settings = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{field}: {path / 'config.json'} is not valid JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise ModelLoadError(
            f"{field}: {path / 'config.json'} is not a model config (a JSON object of settings)"
        )
    return path


# config.json's names for the longest sequence a model's positions cover (GPT-2: n_positions)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def position_limit(spec: str, field: str = "model") -> int | None:
    """The number of positions a model folder (or ``preset:NAME``) declares in its
    config.json, or None where it names none. Read before any weight is loaded, so a data
    row too long for the model is named before the model loads; a learned position table
    (GPT-2, OPT) has no row beyond it, and a rotary model was not trained beyond it."""
    return positions_of(json.loads((resolve_path(spec, field) / "config.json").read_text()))


def positions_of(config) -> int | None:
    """The positions a model config declares (:data:`POSITION_KEYS`, or its text_config's):
    a config.json's dict or a loaded model's config object; None where it names none."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    for key in POSITION_KEYS:
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text = get("text_config")
    return positions_of(text) if text is not None and text is not config else None


RUNTIMES = ("transformers", "native")


# the files a Hugging Face tokenizer is read from (fast, SentencePiece, BPE and WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    path: str | Path, trust_remote_code: bool = False, runtime: str = "transformers"
):
    """The folder's tokenizer, vocabulary as it is; without a pad token, EOS pads.

    With ``runtime='native'`` a folder with a ``tokenizer.json`` is read by the generic
    fast tokenizer class directly: ``AutoTokenizer`` would first resolve the model's config
    class, which imports transformers' model-loading stack (docs/benchmarks.md, "Import cost").
    """
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        # transformers would otherwise fail deep inside with a page about sentencepiece
        raise ModelLoadError(
            f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the "
            "tokenizer into the model folder (tokenizer.save_pretrained)"
        )
    if runtime == "native" and (Path(path) / "tokenizer.json").exists() and not trust_remote_code:
        from transformers import PreTrainedTokenizerFast as TokenizerClass
    else:
        from transformers import AutoTokenizer as TokenizerClass

    try:
        tok = TokenizerClass.from_pretrained(path, trust_remote_code=trust_remote_code)
    except config_errors() as exc:  # AutoTokenizer reads config.json too
        raise ModelLoadError(
            f"{path}: the tokenizer cannot be loaded ({load_error_reason(exc)})"
        ) from None
    if tok.eos_token_id is None:
        raise ModelLoadError(
            f"{path}: the tokenizer has no EOS token; answers could never end. Give it the "
            "token that ends an answer and save it again (tokenizer.eos_token = '...'; "
            "tokenizer.save_pretrained(folder))"
        )
    if tok.pad_token_id is None:
        # Padding is a matter of masks: every forward and every loss in rlhflab takes a mask
        # built from lengths, never from ``ids != pad`` (docs/ppo-details.md §1.2), so an
        # existing token can fill the padded positions, as EOS does in many checkpoints
        # (SmolLM2, Llama 3). A new token would resize the embeddings, could be sampled,
        # and would make a LoRA checkpoint carry the whole embedding matrix.
        tok.pad_token = tok.eos_token
    record_stop_ids(tok, Path(path))
    return tok


def vocab_overflow(model, tokenizer, names=("the tokenizer", "the model")) -> str | None:
    """What is wrong when ``tokenizer`` has more tokens than ``model``'s embedding has rows
    (ids past the last row have no embedding: the wrong tokenizer, or tokens added without
    resizing the model), with the fix, the two called ``names``; None when every id has a
    row."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(getattr(embedding, "weight", None), "shape", (None,))[0]
    if rows is None or len(tokenizer) <= rows:
        return None
    return (
        f"{names[0]} has {len(tokenizer)} tokens but {names[1]}'s embedding only {rows} "
        f"rows, so ids from {rows} on have no embedding (is it the model's own tokenizer?); "
        "if tokens were added to it on purpose, give the model rows for them first: "
        "model.resize_token_embeddings(len(tokenizer))"
    )


def _fit_vocab(model, tokenizer, path=None) -> None:
    """Such a tokenizer (:func:`vocab_overflow`) was met with fresh random rows, silently:
    a LoRA run's adapter then carried the whole grown embedding and the base it names could
    not load it. Refused instead, with the fix."""
    wrong = vocab_overflow(model, tokenizer)
    if wrong:
        raise ModelLoadError(
            f"{path or 'the model'}: {wrong}, then save_pretrained both into one folder"
        )
    model.config.pad_token_id = tokenizer.pad_token_id


def _check_runtime(runtime: str, trust_remote_code: bool) -> None:
    if runtime not in RUNTIMES:
        raise ModelLoadError(f"model.runtime: {runtime!r} is not one of {list(RUNTIMES)}")
    if runtime == "native" and trust_remote_code:
        raise ModelLoadError(
            "model.runtime=native runs rlhflab's own Llama code; it cannot run a "
            "checkpoint's remote code (model.trust_remote_code) — use runtime=transformers"
        )


def _load_native(path, kind: str, tokenizer, **kwargs):
    """A native model, fitted to the tokenizer and without dropout, as the loaders return."""
    from rlhflab.backends.native_config import NativeConfigError
    from rlhflab.backends.native_models import load_native

    try:
        model = load_native(path, kind, **kwargs)
    except NativeConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    except RuntimeError as exc:  # load_state_dict: config.json disagrees with the weights
        if "size mismatch" not in str(exc):
            raise  # not that (out of memory, say): as it is
        raise ModelLoadError(mismatch_message(path, str(exc))) from None
    # where it came from, as transformers' configs keep it (never saved: "_" fields are not)
    model.config._name_or_path = str(path)
    _fit_vocab(model, tokenizer, path)
    return disable_dropout(model)


def load_causal_lm(
    path: str | Path,
    tokenizer,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    runtime: str = "transformers",
):
    """A causal LM from a local folder, through transformers or rlhflab's native runtime,
    in ``dtype`` whatever dtype the checkpoint was saved in (transformers >= 5 would keep
    the saved one)."""
    _check_runtime(runtime, trust_remote_code)
    check_weight_files(path)
    if runtime == "native":
        return _load_native(path, "causal", tokenizer, dtype=dtype)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report: said below in one line, or refused
    try:
        model, info = hf_load(AutoModelForCausalLM, path, trust_remote_code, {}, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    _refuse_fresh_weights(model, info, path)
    _fit_vocab(model, tokenizer, path)
    contiguous_head_input(model)
    return disable_dropout(model)


def _refuse_fresh_weights(model, info: dict, path) -> None:
    """A causal LM whose saved weights lack some of its parameters would start them at
    random and say so only in transformers' load report: a reward model's folder (a
    ``score`` head, no ``lm_head``) or an encoder would train and sample as garbage. Refused
    naming what is missing, as the native runtime's loader does; so is a sequence
    classifier's folder whose head is tied to its embeddings (it would load, its ``score``
    weights ignored). Other unused tensors are only named in a warning."""
    params = dict(model.named_parameters())
    fresh = [k for k in info.get("missing_keys", ()) if k in params]
    unexpected = sorted(info.get("unexpected_keys", ()))
    classifier = any(k.split(".")[0] in ("score", "classifier") for k in unexpected)
    if not fresh and not classifier:
        if unexpected:  # e.g. a multimodal checkpoint's other towers: not ours to refuse
            log.warning(
                "%s: %d saved tensors are not used by a %s (e.g. %s)",
                path,
                len(unexpected),
                type(model).__name__,
                unexpected[:3],
            )
        return
    hint = " — a sequence classifier's folder (a reward model?); a policy is a causal LM's"
    raise ModelLoadError(
        f"{path}: weights do not match a {type(model).__name__} (missing {fresh[:5]}, "
        f"unexpected {unexpected[:5]}){hint if classifier else ''}"
    )


def load_sequence_classifier(
    path: str | Path,
    tokenizer,
    trust_remote_code: bool = False,
    num_labels: int | None = None,
    owned: bool = False,
    runtime: str = "transformers",
    dtype: torch.dtype = torch.float32,
    trained_head_for: str | None = None,
    heads_reason: str = "rm.heads: one per head",
):
    """An HF sequence-classification model (reward model or critic); ``score`` is its head.

    ``dtype``: the weights' dtype whatever the checkpoint's (fp32: trained models hold fp32
    master weights; a frozen reward model may ask for its configured precision).
    ``owned=True`` reads the weights into memory instead of memory-mapping the file: use it
    for a model that will be converted to int8/bf16, whose fp32 pages would otherwise stay
    resident with the mapping (the native runtime always reads into memory).
    ``trained_head_for``: the config field that asks for a finished reward model
    (``reward.model``): a folder without ``score`` weights (a causal LM) is refused instead
    of being given a freshly initialised head, which would score at random.
    ``heads_reason``: why ``num_labels`` heads are needed, named when the saved head differs.
    """
    _check_runtime(runtime, trust_remote_code)
    saved = check_weight_files(path).get("score.weight")
    if num_labels is not None and saved and saved[0] != num_labels:
        # transformers would refuse it with a traceback pointing at a report it printed
        raise ModelLoadError(
            f"{path}: its saved score head has {saved[0]} outputs where {num_labels} are "
            f"needed ({heads_reason}); start from a causal LM or match the heads"
        )
    if runtime == "native":
        return _load_native(
            path,
            "classifier",
            tokenizer,
            num_labels=num_labels,
            dtype=dtype,
            trained_head_for=trained_head_for,
        )
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlhflab.backends.native_models import untrained_head_message

    fields = {} if num_labels is None else {"num_labels": num_labels}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialised score weights" report: we set them
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = hf_load(
                AutoModelForSequenceClassification,
                path,
                trust_remote_code,
                fields,
                dtype=dtype,
                **(_owned_memory_kwargs() if owned else {}),
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ModelLoadError(
            f"{path}: expected a sequence-classification model with a linear "
            "`score` head (Llama, Qwen, Mistral, Gemma, GPT-2 families)"
        )
    fresh_head = any(k.split(".")[0] == "score" for k in info["missing_keys"])
    if trained_head_for and fresh_head:
        raise ModelLoadError(untrained_head_message(path, trained_head_for))
    _fit_vocab(model, tokenizer, path)
    return disable_dropout(model)


def same_tokenizer(a, b) -> bool:
    """Same vocabulary and special tokens (the leading BOS too): token ids can be passed
    between the two models."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.eos_token_id == b.eos_token_id
        and a.pad_token_id == b.pad_token_id
        and leading_special_ids(a) == leading_special_ids(b)
    )
