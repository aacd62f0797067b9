"""What the Python API's trainers are given, turned into what a config can name.

A model object, a list of prompts, a ``datasets.Dataset`` or a lambda cannot sit in a YAML
file. Rather than a second way into the trainers, each object is written once into the run's
``inputs/`` folder (a model with ``save_pretrained``, rows as JSONL) and the config names that
file, so an object gets exactly the preparation the command gives a folder (dropout off, fp32
master weights, padding, LoRA, lean activations: :mod:`rlhflab.models.build`), the run's
``config.yaml`` describes it completely, and ``rlhflab ppo --config RUN/config.yaml --resume``
continues it from the command line. A reward callable that can be imported is named in the
config as ``module:function``; one that cannot (a lambda, a closure, a function defined in a
script's ``__main__``) is handed to the trainer directly and said so in the log.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rlhflab.app.run_inputs import inputs_folder
from rlhflab.config import Config, ConfigError
from rlhflab.experience.rewards import CallableReward, importable_spec
from rlhflab.infra.files import share_like_umask, write_lines_atomic

log = logging.getLogger(__name__)

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # module:function


def is_module(obj) -> bool:
    try:
        from torch import nn
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, nn.Module)


def _atomic_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Write a folder through ``write(tmp)`` beside ``final``, then put it in place."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        share_like_umask(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_folder(model, tokenizer, folder: Path, what: str, reuse: bool) -> str:
    """``model`` as something the config's model fields take: a folder or ``preset:NAME``
    as it is; a model object written to ``folder`` with ``tokenizer``.

    ``reuse``: a resumed run keeps the folder its first start wrote (the run began from
    those weights), whatever the object holds now."""
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise ConfigError(
            f"{what}: the tokenizer passed must be a tokenizer object (with save_pretrained), "
            f"got {type(tokenizer).__name__}; for a folder's, pass "
            "AutoTokenizer.from_pretrained(folder)"
        )
    if isinstance(model, (str, os.PathLike)):
        if tokenizer is not None:  # warned, not logged at INFO: Python shows no INFO
            log.warning(
                "%s: the tokenizer passed is not used with a model folder (%s): the folder's "
                "own tokenizer files are read; save yours into the folder, or pass the model "
                "as an object",
                what,
                model,
            )
        return str(model)
    if not is_module(model) or not hasattr(model, "save_pretrained"):
        raise ConfigError(
            f"{what}: expected a model folder, 'preset:NAME' or a Hugging Face model object "
            f"(with save_pretrained), got {type(model).__name__}"
        )
    if hasattr(model, "peft_config"):
        raise ConfigError(
            f"{what}: a PEFT model object: pass its base model (model.get_base_model(), or "
            "merge_and_unload() to keep trained adapters) and set model.lora_r for new ones"
        )
    if tokenizer is None:
        raise ConfigError(
            f"{what}: a model object needs its tokenizer (tokenizer=; for a reward model "
            "with its own, reward_tokenizer=); rlhflab never downloads one"
        )
    from rlhflab.models.loading import vocab_overflow

    wrong = vocab_overflow(model, tokenizer, ("the tokenizer passed", "the model object"))
    if wrong:  # as loading a folder refuses it, but naming the objects passed
        raise ConfigError(f"{what}: {wrong}")
    if what == "reward":
        _refuse_fresh_head(model)
    if reuse and (folder / "config.json").is_file():
        log.info("%s: resuming; keeping %s, written when the run started", what, folder)
        return str(folder)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    _atomic_dir(folder, write)
    log.info("%s: model object written to %s (loaded from there as a folder)", what, folder)
    return str(folder)


def _refuse_fresh_head(model) -> None:
    """A reward-model object whose ``score`` head was initialised at load: a sequence
    classifier loaded from a checkpoint of another class (``config.architectures`` names the
    checkpoint's, e.g. ``LlamaForCausalLM``). Written to a folder its random head would look
    trained, and it would score at random — as a causal LM folder given as the reward model
    is refused (``untrained_head_message``). A model built from a config (architectures
    unset) is left alone: everything in it is as fresh as its head, by the caller's choice."""
    loaded_as = getattr(getattr(model, "config", None), "architectures", None) or []
    mine = type(model).__name__
    if loaded_as and mine not in loaded_as and mine.endswith("ForSequenceClassification"):
        if not any(a.endswith("ForSequenceClassification") for a in loaded_as):
            raise ConfigError(
                f"reward: the model object is a {mine} loaded from a {loaded_as[0]} "
                "checkpoint: its score head was freshly initialised, so it would score at "
                "random; train the head first (rlhflab.RewardTrainer with this model, or "
                "rlhflab rm) and pass the trained reward model (a head you trained yourself: "
                f"set model.config.architectures = [{mine!r}] to say so)"
            )


def _plain(value):
    """numpy and torch scalars and arrays as the Python values JSON holds."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _lines(rows: list[dict], what: str):
    for n, row in enumerate(rows, start=1):
        try:
            yield json.dumps(row, ensure_ascii=False, default=_plain) + "\n"
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{what}: item {n}: {exc}") from None


def _write_jsonl(rows: list[dict], path: Path, what: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(path, _lines(rows, what))
    return str(path)


def _dataset(data, split: str, what: str):
    """A ``datasets.Dataset`` (one split of a ``DatasetDict``), or None for anything else;
    checked by type name, without importing ``datasets``."""
    kind = type(data).__name__
    if kind == "DatasetDict":
        if split not in data:
            raise ConfigError(
                f"{what}: the DatasetDict has no split {split!r} (data.split); it has "
                f"{', '.join(repr(k) for k in data)}"
            )
        data, kind = data[split], type(data[split]).__name__
    if kind == "IterableDataset":
        raise ConfigError(f"{what}: an IterableDataset cannot be read twice; pass a Dataset")
    return data if kind == "Dataset" else None


def rows_file(data, path: Path, what: str, split: str, as_row: Callable[[object], dict]):
    """A data argument as a path the loaders read: a path as it is; a list (items through
    ``as_row``) written to ``path`` as JSONL; a ``datasets.Dataset`` or a split of a
    ``DatasetDict`` saved with ``save_to_disk`` beside it (its column types kept). None
    stays None (the built-in data)."""
    if data is None or isinstance(data, (str, os.PathLike)):
        return None if data is None else str(data)
    dataset = _dataset(data, split, what)
    if dataset is not None:
        if len(dataset) == 0:
            raise ConfigError(f"{what}: no rows")
        folder = path.with_suffix("")
        if folder.exists():  # an earlier start's (a resume given data): never written over
            folder = inputs_folder(path.parent.parent, resume=False) / folder.name
        _atomic_dir(folder, dataset.save_to_disk)
        return str(folder)
    if not isinstance(data, (list, tuple)):
        raise ConfigError(
            f"{what}: expected a path, a list or a datasets.Dataset, got {type(data).__name__}"
        )
    rows = [as_row(item) for item in data]
    if not rows:
        raise ConfigError(f"{what}: no rows")
    if path.exists():  # an earlier start's (a resume given data): kept if the same rows,
        # else never written over — the steps so far trained on it, and a refused resume
        # would leave the run reading another's
        if path.read_text(encoding="utf-8") == "".join(_lines(rows, what)):
            return str(path)
        path = inputs_folder(path.parent.parent, resume=False) / path.name
    return _write_jsonl(rows, path, what)


def prompt_row(item) -> dict:
    """A prompt: a string, a list of chat messages, or a row with its fields."""
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, list):
        return {"messages": item}
    if isinstance(item, Mapping):
        return dict(item)
    raise ConfigError(f"prompts: each must be a string, a message list or a dict, got {item!r}")


def sft_row(item) -> dict:
    """An SFT example: (prompt, response) or a row with its fields."""
    if isinstance(item, tuple) and len(item) == 2:
        return {"prompt": item[0], "response": item[1]}
    if isinstance(item, Mapping):
        return dict(item)
    raise ConfigError(f"data: each example must be (prompt, response) or a dict, got {item!r}")


def pair_row(item) -> dict:
    """A preference pair: (prompt, chosen, rejected) or a row with its fields."""
    if isinstance(item, tuple) and len(item) == 3:
        return dict(zip(("prompt", "chosen", "rejected"), item))
    if isinstance(item, Mapping):
        return dict(item)
    raise ConfigError(f"pairs: each must be (prompt, chosen, rejected) or a dict, got {item!r}")


@dataclass
class Rewards:
    """What ``reward=`` resolved to: config fields set, plus the sources no config can name."""

    extra: list[tuple[object, float]] = field(default_factory=list)


def _as_weighted(reward) -> list[tuple[object, float]]:
    if isinstance(reward, Mapping):
        out = []
        for item, w in reward.items():
            name = getattr(item, "__name__", repr(item))
            try:
                weight = float(w) if not isinstance(w, (str, bytes, bool)) else math.nan
            except (TypeError, ValueError):
                weight = math.nan
            if not math.isfinite(weight):
                raise ConfigError(f"reward: the weight of {name} must be a number, got {w!r}")
            out.append((item, weight))
        return out
    if isinstance(reward, (list, tuple)):
        return [(item, 1.0) for item in reward]
    return [(reward, 1.0)]


def _head_names(folder: str) -> list[str]:
    try:
        settings = json.loads((Path(folder) / "config.json").read_text())
        labels = settings["id2label"]
        return [labels[k] for k in sorted(labels, key=int)]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"reward: {folder} has no readable id2label in config.json to weight its heads; "
            "set reward.heads instead of a weight"
        ) from None


def apply_rewards(cfg: Config, reward, tokenizer, inputs: Path, reuse: bool) -> Rewards:
    """Resolve ``reward=``: a reward-model folder or object (at most one: the config holds
    one), a ``module:function`` string, a callable ``(prompts, responses) -> list[float]``,
    or a list of them, or a dict of them to weights. Sets ``reward.model``/``reward.heads``/
    ``reward.functions``; returns the callables that cannot be named."""
    out = Rewards()
    if reward is None:
        return out
    models = 0
    for item, weight in _as_weighted(reward):
        if isinstance(item, str) and SPEC.match(item) and not item.startswith("preset:"):
            cfg.reward.functions[item] = weight
        elif isinstance(item, (str, os.PathLike)) or is_module(item):
            models += 1
            if models > 1:
                raise ConfigError("reward: one reward model at most (its heads can be weighted)")
            rtok = item if isinstance(item, (str, os.PathLike)) else tokenizer
            folder = model_folder(
                item, None if rtok is item else rtok, inputs / "reward", "reward", reuse
            )
            cfg.reward.model = folder
            if weight != 1.0:
                cfg.reward.heads = {h: weight for h in _head_names(folder)}
        elif callable(item):
            spec = importable_spec(item)
            if spec:
                cfg.reward.functions[spec] = weight
            else:
                name = getattr(item, "__name__", None) or type(item).__name__
                taken = {source.name for source, _ in out.extra}
                if name in taken:  # two lambdas: each component keeps its own log column
                    name = f"{name}#{len(out.extra) + 1}"
                source = CallableReward(item, name)
                log.warning(
                    "reward %s cannot be imported by name (a lambda, a closure or a function "
                    "of __main__): it is not in config.yaml; resume this run from Python with "
                    "the same callable",
                    source.name,
                )
                out.extra.append((source, weight))
        else:
            raise ConfigError(
                "reward: expected a reward-model folder or object, 'module:function', a "
                f"callable (prompts, responses) -> list[float], or a list/dict of them; got {item!r}"
            )
    return out


def gold_source(cfg: Config, gold) -> CallableReward | None:
    """``gold=``: 'module:function' or a callable, for the monitor and the report. An
    importable one is named in ``monitor.gold``; otherwise the source is returned."""
    if gold is None:
        return None
    if isinstance(gold, str):
        cfg.monitor.gold = gold
        return None
    if not callable(gold):
        raise ConfigError(f"gold: expected 'module:function' or a callable, got {gold!r}")
    spec = importable_spec(gold)
    if spec:
        cfg.monitor.gold = spec
        return None
    return CallableReward(gold)
