"""A trained policy read back: from a model folder, a LoRA adapter folder or a run directory.

``rlhflab export``, ``generate`` and ``eval`` take any of them. A run directory (the
``log.output_dir`` of ppo, grpo, rloo and dpo; ``OUT/run`` of sft) gives its policy rebuilt
as the run built it: the run's ``config.yaml`` says how (``model.*``: the base, the runtime,
LoRA), one of its checkpoints (``checkpoints/step-N``, ``infra/checkpoint.py``) gives the
trained weights. A shared value head stays behind: only the LM is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from torch import nn

from rlhflab import models as M
from rlhflab.config.base import ConfigError, build
from rlhflab.config.models import ModelConfig
from rlhflab.infra import checkpoint as C
from rlhflab.models.build import load_model

RUN_CONFIG = "config.yaml"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class PolicySource:
    """Where a policy comes from, found and checked, with its tokenizer read (cheap: the
    data can be checked against it before any weight is loaded); :meth:`load` loads it."""

    source: str  # what was asked for: a folder, preset:NAME or a run directory
    kind: str  # 'folder' (or preset), 'adapter' (a PEFT folder) or 'run'
    tokenizer: object
    options: ModelConfig  # how to load it: the run's model section, or the caller's
    checkpoint: Path | None = None  # the run's checkpoint the weights come from
    run_config: dict | None = None  # the run's config.yaml as written (None: not a run)
    base: str | None = None  # the base model of a LoRA adapter (a folder or preset:NAME)
    lm: nn.Module | None = None  # set by load()
    newest: bool = False  # the checkpoint is the run's newest ('last'), picked afresh if gone

    @property
    def is_lora(self) -> bool:
        return self.base is not None

    def load(self, device="cpu") -> nn.Module:
        """The causal LM (peft-wrapped for a LoRA adapter), fp32, in eval mode on
        ``device``; also kept as ``self.lm``."""
        for attempt in range(_TRIES):
            try:
                self.lm = self.lm or _LOADERS[self.kind](self)
                break
            except Exception:
                if not _pruned(self) or attempt == _TRIES - 1:
                    raise
                # a run still training deleted it (log.keep_last): its newest one now
                self.checkpoint = pick_checkpoint(Path(self.source), "last")
        self.lm.to(device).eval()
        return self.lm


_TRIES = 5  # checkpoints a reader lets a training run delete under it before it gives up


def _pruned(src: PolicySource) -> bool:
    """Whether ``src``'s checkpoint, the newest of its run when picked, is gone since."""
    return src.newest and src.checkpoint is not None and not src.checkpoint.exists()


def is_run_dir(path: Path) -> bool:
    """A run directory holds the run's ``config.yaml``, a model folder a ``config.json``."""
    return (path / RUN_CONFIG).is_file() and not (path / "config.json").is_file()


def read_run_config(run_dir: Path) -> dict:
    """The run's resolved config, as the run wrote it (sections of plain values)."""
    path = Path(run_dir) / RUN_CONFIG
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot be read ({M.first_line(exc)})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: not a run's config (a mapping of sections)")
    return loaded


def checkpoint_names(run_dir: Path) -> list[str]:
    """The checkpoint folders of a run: ``step-N`` oldest first, then any other (``best``,
    ``halted-N``); unfinished ``.tmp`` and set-aside ``.corrupt`` ones left out."""
    root = Path(run_dir) / "checkpoints"
    steps = [p.name for p in C.list_checkpoints(run_dir)]
    others = sorted(
        p.name
        for p in (root.iterdir() if root.is_dir() else ())
        if p.is_dir() and p.name not in steps and not p.name.endswith((".tmp", ".corrupt"))
    )
    return steps + others


def pick_checkpoint(run_dir: Path, which: str = "last") -> Path:
    """The checkpoint folder ``which`` names: 'last' (the newest whole one, as ``--resume``
    picks it), 'best' (``checkpoints/best``, which ``log.keep_best`` writes) or a folder
    name such as ``step-20``. An absent or damaged one is an error naming what exists."""
    run_dir = Path(run_dir)
    if which == "last":
        path = C.latest_checkpoint(run_dir)
        if path is None:
            best = (run_dir / "checkpoints" / "best").is_dir()
            raise C.CheckpointError(
                f"{run_dir}: no step checkpoint in {run_dir / 'checkpoints'} (a run writes one "
                "every log.checkpoint_every iterations and at its end)"
                + ("; it holds checkpoints/best: --checkpoint best reads it" if best else "")
            )
        return path
    path = run_dir / "checkpoints" / which
    if "/" in which or which in ("", ".", "..") or not path.is_dir():
        why = " (log.keep_best writes it)" if which == "best" else ""
        there = ", ".join(checkpoint_names(run_dir)) or "none"
        raise C.CheckpointError(
            f"--checkpoint {which}: {run_dir} has no checkpoints/{which}{why}; it has: {there}"
        )
    fault = C.checkpoint_fault(path)
    if fault is not None:
        raise C.CheckpointError(f"{path}: {fault}")
    return path


def find_policy(
    spec: str | os.PathLike, options: ModelConfig | None = None, checkpoint: str = "last"
) -> PolicySource:
    """The policy at ``spec``: a model folder, ``preset:NAME``, a LoRA adapter folder or a
    run directory, found and its tokenizer read. ``options`` (runtime, remote code) read a
    folder; a run directory brings its own. ``checkpoint``: which of a run's checkpoints
    (:func:`pick_checkpoint`)."""
    options = options or ModelConfig()
    spec = os.fspath(spec)  # a pathlib.Path names a folder as a string does
    path = Path(spec).expanduser()
    if not spec.startswith("preset:") and not path.is_dir():
        what = "no such folder" if not path.exists() else "not a folder"
        raise M.ModelLoadError(f"--model {spec}: {what}")
    if not spec.startswith("preset:") and is_run_dir(path):
        return _run(path, checkpoint)
    if checkpoint != "last":  # it would be ignored: only a run has checkpoints to pick
        raise M.ModelLoadError(
            f"--checkpoint {checkpoint}: {spec} is a model, not a run directory; only a "
            "run's checkpoints can be picked"
        )
    if spec.startswith("preset:"):
        return _folder(spec, options)
    if (path / ADAPTER_CONFIG).is_file():
        return _adapter(path, options)
    if (path / "config.json").is_file():
        return _folder(spec, options)
    raise M.ModelLoadError(
        f"--model {spec}: neither a model folder (config.json), a LoRA adapter "
        f"({ADAPTER_CONFIG}) nor a run directory ({RUN_CONFIG} and checkpoints/)"
    )


def load_policy(
    spec: str | os.PathLike,
    options: ModelConfig | None = None,
    checkpoint: str = "last",
    device="cpu",
) -> PolicySource:
    """:func:`find_policy`, then its model loaded (``.lm``)."""
    found = find_policy(spec, options, checkpoint)
    found.load(device)
    return found


def _tokenizer(folder, options: ModelConfig):
    return M.load_tokenizer(folder, options.trust_remote_code, runtime=options.runtime)


def _folder(spec: str, options: ModelConfig) -> PolicySource:
    tokenizer = _tokenizer(M.resolve_path(spec, "--model"), options)
    return PolicySource(spec, "folder", tokenizer, options)


def _adapter(folder: Path, options: ModelConfig) -> PolicySource:
    where = f"{folder / ADAPTER_CONFIG}"
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise M.ModelLoadError(f"{where}: no readable base_model_name_or_path ({exc})") from None
    field = f"{where}: base_model_name_or_path"
    base_dir = M.resolve_path(base, field)  # checked now, not after the data
    tokenizer = _tokenizer(
        folder if (folder / "tokenizer_config.json").is_file() else base_dir, options
    )
    return PolicySource(str(folder), "adapter", tokenizer, options, base=base)


def _run(run_dir: Path, which: str) -> PolicySource:
    """A run's policy; its newest checkpoint ('last') picked again where a run that is
    still training deletes it while it is read (log.keep_last)."""
    for attempt in range(_TRIES):
        path = pick_checkpoint(run_dir, which)
        try:
            return _run_at(run_dir, which, path)
        except Exception:
            if which != "last" or path.exists() or attempt == _TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _run_at(run_dir: Path, which: str, path: Path) -> PolicySource:
    run_config = read_run_config(run_dir)
    where = f"{run_dir / RUN_CONFIG}: "
    options = build(ModelConfig, run_config.get("model") or {}, where + "model.")
    saved = path / "policy"
    lora = (saved / ADAPTER_CONFIG).is_file()
    if lora and not options.lora_r:
        raise C.CheckpointError(f"{saved}: an adapter, but the run's model.lora_r is 0")
    if not lora:
        _refuse_reward_model(run_dir, saved)
    return PolicySource(
        str(run_dir),
        "run",
        _tokenizer(saved, options),
        options,
        path,
        run_config,
        options.policy if lora else None,
        newest=which == "last",
    )


def _load_folder(src: PolicySource) -> nn.Module:
    return load_model(src.source, src.tokenizer, src.options, field="--model", trained=False)


def _load_adapter(src: PolicySource) -> nn.Module:
    field = f"{Path(src.source) / ADAPTER_CONFIG}: base_model_name_or_path"
    lm = load_model(src.base, src.tokenizer, src.options, field=field, trained=False)
    return M.load_lora_adapter(lm, src.source)


def _load_run(src: PolicySource) -> nn.Module:
    saved, options = src.checkpoint / "policy", src.options
    if not src.is_lora:  # full weights: the checkpoint's own folder
        return load_model(str(saved), src.tokenizer, options, field=str(saved), trained=False)
    # a LoRA run: its base, the adapter laid on it as the run did, then the trained weights
    field = f"{Path(src.source) / RUN_CONFIG}: model.policy"
    lm = load_model(options.policy, src.tokenizer, options, field=field, trained=False)
    lm = M.apply_lora(lm, options.lora_r, options.lora_alpha, options.lora_targets)
    try:
        C.load_weights_into(lm, saved)
    except (FileNotFoundError, RuntimeError) as exc:
        raise C.CheckpointError(f"{saved}: {M.first_line(exc)}") from None
    return lm


_LOADERS = {"folder": _load_folder, "adapter": _load_adapter, "run": _load_run}


def _refuse_reward_model(run_dir: Path, saved: Path) -> None:
    """``rlhflab rm``'s run (``OUT/run``) checkpoints a classifier, not a policy."""
    try:
        architectures = json.loads((saved / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return  # the loader names a broken config.json
    if any(str(a).endswith("ForSequenceClassification") for a in architectures or ()):
        raise M.ModelLoadError(
            f"{run_dir}: a reward-model run (its checkpoints hold a {architectures[0]}); "
            "export, generate and eval take a policy"
        )
