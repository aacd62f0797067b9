"""Atomic checkpoints that resume bit-identically.

``checkpoints/step-N/`` holds ``policy/`` (an HF folder in safetensors with the tokenizer;
a LoRA policy saves its adapter there), ``value_head.safetensors`` (shared backbone) or
``critic/`` (an HF sequence-classification folder; a LoRA critic, ``model.critic_lora_r``,
saves its adapters and value head there, not its frozen backbone), ``optimizer.pt`` (the
optimisers' states, the largest part: two moments per trained weight) and ``state.pt`` (schedulers, KL
controller, RNG states, data position, step): plain tensors and numbers only, loaded with
``weights_only=True`` so nothing arbitrary is ever unpickled. The optimisers sit in their
own file so that a sharded (FSDP) resume reads them on rank 0 alone and the other ranks
read only the small ``state.pt`` (``trainers/runstate.py``); checkpoints written before
2026-12-05 hold them inside ``state.pt``, and load as before. A checkpoint is written under
``step-N.tmp`` and renamed when complete, so a run killed at any moment leaves only complete
checkpoints behind; one damaged all the same is skipped on resume for the one before it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlhflab.backends.native_models import iter_safetensors
from rlhflab.errors import RlhflabError
from rlhflab.infra.files import share_like_umask, writing
from rlhflab.models import PolicyWithValueHead
from rlhflab.models.prepare import restore_dropout

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")
# the keys of a trainer's state that go to optimizer.pt (whichever of them it has)
OPTIMIZER_KEYS = ("optim", "critic_optim")


def _save_lm(lm, folder: Path, tokenizer, state_dict: dict | None = None) -> None:
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    lm.save_pretrained(folder, safe_serialization=True, **kwargs)
    restore_dropout(folder, lm)  # the source's dropout, not the zeros training runs with
    tokenizer.save_pretrained(folder)


MANIFEST = "manifest.json"


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def save_checkpoint(
    run_dir: Path,
    step: int,
    cast,
    state: dict,
    keep_last: int,
    policy_state: dict | None = None,
    critic_state: dict | None = None,
    name: str | None = None,
    extra_models: dict | None = None,
) -> Path:
    """Write ``checkpoints/step-N`` atomically. ``policy_state``/``critic_state`` are full
    (gathered) weights of a sharded policy / CriticValues module; None: read the modules.
    ``name``: another folder name (a halted run's state, ``halted-N``), which ``--resume``
    and ``log.keep_last`` leave alone. ``extra_models``: folder name → (model, tokenizer)
    saved as whole HF folders beside the policy (a refreshed reward model)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / (name or f"step-{step}")
    tmp = root / f"{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(final, "checkpoint"):
            _write_checkpoint(tmp, cast, state, policy_state, critic_state, extra_models)
    except BaseException:
        # a half-written folder of a full disk would keep it full: the run's last whole
        # checkpoint is what a resume needs
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_checkpoint(tmp, cast, state, policy_state, critic_state, extra_models) -> None:
    """The files of :func:`save_checkpoint`, into the folder ``tmp``."""
    tmp.mkdir()
    shared = isinstance(cast.policy, PolicyWithValueHead)
    lm_state = (
        _strip(policy_state, "lm.") if (policy_state is not None and shared) else policy_state
    )
    _save_lm(cast.policy_lm, tmp / "policy", cast.tokenizer, lm_state)
    if shared:
        head = (
            _strip(policy_state, "value_head.")
            if policy_state is not None
            else cast.policy.value_head.state_dict()
        )
        save_file(
            {k: v.detach().contiguous() for k, v in head.items()},
            str(tmp / "value_head.safetensors"),
        )
    if cast.critic is not None:
        critic = _strip(critic_state, "model.") if critic_state is not None else None
        _save_lm(cast.critic, tmp / "critic", cast.tokenizer, critic)
    for folder, (model, tokenizer) in (extra_models or {}).items():
        _save_lm(model, tmp / folder, tokenizer)
    optimizers = {k: state[k] for k in OPTIMIZER_KEYS if k in state}
    torch.save({k: v for k, v in state.items() if k not in optimizers}, tmp / "state.pt")
    torch.save(optimizers, tmp / "optimizer.pt")
    # what a whole copy of this checkpoint holds: a copy that lost a file is told apart from
    # a run that never wrote one (a shared backbone has no critic/, for instance)
    files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    (tmp / MANIFEST).write_text(json.dumps(files))
    share_like_umask(tmp)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``.tmp`` folders are incomplete and ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found)]


class CheckpointError(RlhflabError, ValueError):
    """No checkpoint of a run can be resumed from; the message names each and why."""


def checkpoint_fault(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, or None when it is whole.

    The rename makes a checkpoint appear only once written, but a disk that filled up, a
    copy cut short or a power loss before the data reached the disk can still leave one
    with missing or truncated files. Checked cheaply, before any weight is loaded (a failed
    load would leave the models half-overwritten): each ``.pt`` opens (its zip directory is
    at the end of the file), each ``.json`` parses and each ``.safetensors`` file is as
    long as its header says.
    """
    if not (path / "state.pt").is_file():
        return "no state.pt"
    if not list((path / "policy").glob("*.safetensors")):
        return "no policy weights"
    if (path / MANIFEST).is_file():  # checkpoints from 2026-12-06 on list their files
        try:
            listed = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            return f"{MANIFEST} is unreadable ({type(exc).__name__})"
        missing = [f for f in listed if not (path / f).is_file()]
        if missing:
            return f"{missing[0]} is missing" + (
                f" (and {len(missing) - 1} more)" * (len(missing) > 1)
            )
    elif not (path / "optimizer.pt").is_file() and not _optimizers_in_state(path):
        # no list of its files: before 2026-12-05 state.pt held the optimisers, since then
        # optimizer.pt has; a checkpoint with neither lost one
        return f"no optimizer.pt (and no {MANIFEST} to say what it held)"
    for f in sorted(path.rglob("*")):
        try:
            if f.suffix == ".pt":
                # a torch.save file is a zip whose directory sits at its end: opening it finds
                # a file cut short without reading (or mapping) any tensor, on every rank
                with zipfile.ZipFile(f) as archive:
                    archive.namelist()
            elif f.suffix == ".json":
                json.loads(f.read_bytes().decode("utf-8"))
            elif f.suffix == ".safetensors" and not _safetensors_whole(f):
                return f"{f.relative_to(path)} is shorter than its header says"
        except Exception as exc:  # noqa: BLE001 - any failure to read means: not this one
            return f"{f.relative_to(path)} is unreadable ({type(exc).__name__})"
    return None


def _optimizers_in_state(path: Path) -> bool:
    """Whether state.pt holds optimiser states (a checkpoint of before 2026-12-05); mapped,
    not read: its tensors stay on disk."""
    try:
        state = torch.load(path / "state.pt", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable: the zip check below names it
        return True
    return isinstance(state, dict) and any(k in state for k in OPTIMIZER_KEYS)


def _safetensors_whole(f: Path) -> bool:
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    return f.stat().st_size >= 8 + n + end


def latest_checkpoint(run_dir: Path, set_aside: bool = False) -> Path | None:
    """The newest checkpoint that is whole (:func:`checkpoint_fault`), or None when the
    run has none. A damaged one is skipped with a warning; with ``set_aside`` (the process
    that writes the run's files) it is renamed ``step-N.corrupt``, kept for a look but out
    of the way: left in place, ``log.keep_last`` would count it and could delete the good
    checkpoints the resumed run writes before it. Raises CheckpointError when there are
    checkpoints but none is whole: starting afresh would discard the run."""
    ckpts = list_checkpoints(run_dir)
    if set_aside:  # a write cut short (kill -9, a full disk) left its folder: free the space
        for stale in (Path(run_dir) / "checkpoints").glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    faults = []
    for path in reversed(ckpts):
        fault = checkpoint_fault(path)
        if fault is None:
            if faults:
                log.warning("the newest whole checkpoint is %s", path)
            return path
        faults.append(f"{path.name}: {fault}")
        log.warning("checkpoint %s is damaged (%s); trying the one before", path, fault)
        if set_aside:
            aside = path.with_name(path.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
    if faults:
        raise CheckpointError(
            f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'} is whole "
            f"({'; '.join(faults)})"
        )
    return None


def read_weights(folder: Path, name: str | None = None) -> dict:
    """All safetensors tensors of a folder (or one named file in it)."""
    files = [folder / name] if name else sorted(folder.glob("*.safetensors"))
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"{folder}: no safetensors weights")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def load_weights_into(model, folder: Path) -> None:
    """Copy a saved folder's weights into ``model`` in place, one tensor at a time.

    Each tensor is read from the file, copied into the model and dropped before the next
    (``native_models.iter_safetensors``): resuming holds the weights once, not once more
    as a loaded state dict (``load_file`` + ``load_state_dict``: +100 MiB per 25M model).
    A LoRA adapter (small) goes through peft's own loader, which renames its keys. Weights
    that do not fit the model (a changed config) are a :class:`CheckpointError` naming them."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        # peft loads non-strictly (every base weight is "missing" from an adapter): the
        # adapter's own keys are checked here, so a checkpoint of other LoRA targets (say
        # attention-only against all-linear) is refused instead of leaving adapters fresh
        result = set_peft_model_state_dict(model, read_weights(folder))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing:
            raise CheckpointError(
                f"{folder}: the adapter does not match the model's LoRA layers (missing "
                f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}); resume with "
                "the run's model.lora_targets"
            )
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors weights")
    targets = model.state_dict()  # tensors sharing the model's storage
    found, unexpected = set(), []
    renamed = _renamed_on_save(model, folder, files, targets)
    sources = [renamed.items()] if renamed is not None else map(iter_safetensors, files)
    with torch.no_grad():
        for f, tensors in zip(files, sources):
            for name, tensor in tensors:
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                if target.shape != tensor.shape:
                    raise CheckpointError(
                        f"{f}: tensor {name!r} has shape {list(tensor.shape)}, the model's "
                        f"{list(target.shape)}"
                    )
                target.copy_(tensor)
                found.add(name)
    missing = sorted(set(targets) - found - _tied(model))
    if unexpected or missing:
        raise CheckpointError(
            f"{folder}: weights do not match the model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def _tied(model) -> set[str]:
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def _renamed_on_save(model, folder: Path, files: list[Path], targets: dict) -> dict | None:
    """The folder's weights under the model's own names, where they are saved under others:
    transformers 5 renames some architectures' weights between memory and disk (GPT-NeoX's
    ``lm_head`` is saved as ``embed_out``; Mixtral's and Qwen3-MoE's experts are fused in
    memory and saved one by one), so a checkpoint's names missed the model's and its own
    run could not resume. Such a folder is read back through transformers' loader, which
    undoes its renames: the weights are held twice while they are copied, this once. None
    where the names agree (the streaming path), or the model is not a transformers one."""
    from safetensors import safe_open

    saved: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as fh:
            saved.update(fh.keys())
    if saved <= set(targets):  # nothing renamed; a missing weight is refused by the caller
        return None
    cls = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers")), None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        return None
    from rlhflab.models.prepare import quiet_transformers

    quiet_transformers()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    try:
        fresh, info = cls.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("%s: transformers could not read it back either (%s)", folder, exc)
        return None
    # transformers fills what a folder lacks with fresh random weights: never a resume
    missing = sorted(set(info["missing_keys"]) - _tied(model))
    odd = missing + sorted(set(info["unexpected_keys"])) + [k[0] for k in info["mismatched_keys"]]
    if odd:
        raise CheckpointError(
            f"{folder}: weights do not match the model (read back through transformers: "
            f"missing {missing[:3]}, unexpected {sorted(info['unexpected_keys'])[:3]}, "
            f"other shapes {[k[0] for k in info['mismatched_keys']][:3]})"
        )
    return fresh.state_dict()


def read_weights_for(model, folder: Path) -> dict:
    """:func:`read_weights` under ``model``'s own names (see :func:`_renamed_on_save`)."""
    files = sorted(folder.glob("*.safetensors"))
    renamed = _renamed_on_save(model, folder, files, model.state_dict()) if files else None
    return renamed if renamed is not None else read_weights(folder)


def load_checkpoint(path: Path, cast) -> dict:
    """Load weights into the cast in place and return the training state. A file the cast
    needs and the checkpoint lacks (it was written by other model.* settings) is a
    CheckpointError naming it."""
    try:
        load_weights_into(cast.policy_lm, path / "policy")
        if isinstance(cast.policy, PolicyWithValueHead):
            head = load_file(str(path / "value_head.safetensors"))
            cast.policy.value_head.load_state_dict(head)
        if cast.critic is not None:
            load_weights_into(cast.critic, path / "critic")
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path}: does not fit this run's models ({exc}); it was written for others "
            "(another model.value_model, model.critic or LoRA setting?)"
        ) from None
    return read_state(path)


def read_state(path: Path, optimizers: bool = True) -> dict:
    """A checkpoint's training state: ``state.pt``, with the optimisers' states of
    ``optimizer.pt`` merged in where ``optimizers``. Without them, the returned state has
    no optimiser keys (also from a checkpoint of before 2026-12-05, whose state.pt held
    them: they are dropped after reading)."""
    state = torch.load(path / "state.pt", weights_only=True)
    if (path / "optimizer.pt").exists():
        if optimizers:
            state.update(torch.load(path / "optimizer.pt", weights_only=True))
    elif not optimizers:
        for k in OPTIMIZER_KEYS:
            state.pop(k, None)
    return state


def rng_state(generators: dict[str, torch.Generator]) -> dict:
    import random

    return {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        **{f"gen_{k}": g.get_state() for k, g in generators.items()},
    }


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    py = random.getstate()
    random.setstate((py[0], tuple(int(x) for x in state["python"]), py[2]))
    for k, g in generators.items():
        g.set_state(state[f"gen_{k}"])
