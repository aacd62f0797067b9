"""Saving a policy as a plain Hugging Face folder that ``AutoModelForCausalLM.from_pretrained``
loads: weights, config and tokenizer (``rlhflab export``, and the Python API on a live model).

A LoRA policy is merged into its base by default, without touching the model passed in: each
adapted layer's weight is written as ``W + ΔW`` with peft's own ``get_delta_weight`` (the
arithmetic of peft's ``merge_and_unload``, on a copy of the sums, so a model still training
is left exactly as it was). ``merge_lora=False`` keeps the adapter as a PEFT folder
(``adapter_config.json`` names the base it needs). A policy with a shared value head saves its
LM alone. Folders are written beside ``out_dir`` and renamed into place when complete.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from rlhflab.infra.files import WRITER_WORDS, share_like_umask
from rlhflab.models.heads import PolicyWithValueHead
from rlhflab.models.prepare import ModelLoadError, first_line, restore_dropout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ExportError(ModelLoadError):
    """A policy that cannot be saved as asked, or an output folder that cannot be written."""


def check_out_dir(
    out: Path, force: bool, error: type[Exception] = ExportError, protect: tuple = ()
) -> None:
    """Refuse an ``out`` that is a file, or a folder with something in it (unless ``force``);
    and, ``force`` or not, one that is or holds a folder of ``protect`` (the run or model
    the export is made from: replacing ``out`` would delete it), or a non-empty folder
    inside one (``RUN/checkpoints``)."""
    here = Path(out).expanduser().resolve()
    for kept in protect:
        if kept is None or str(kept).startswith("preset:"):
            continue
        kept_path = Path(kept).expanduser().resolve()
        # out is the source, holds it, or is a part of it that --force would replace
        inside = kept_path in here.parents and out.is_dir() and any(out.iterdir())
        if kept_path == here or here in kept_path.parents or (inside and force):
            raise error(
                f"{out}: replacing it would delete {kept} (or part of it), which this export "
                "is made from; "
                "choose another folder"
            )
    cwd = Path.cwd().resolve()
    if here == cwd or here in cwd.parents:
        # the export replaces the folder whole: the shell would be left in a deleted one
        raise error(
            f"{out}: is the current folder{'' if here == cwd else ' or holds it'}; name a "
            "folder to create, e.g. ./model"
        )
    if out.exists() and not out.is_dir():
        raise error(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise error(
            f"{out}: exists and is not empty; choose another folder or pass --force "
            "(force=True from Python)"
        )


def replace_folder(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` at ``out``; an old ``out`` (``--force``) is moved aside first
    and deleted only once the new folder is in place."""
    aside = None
    if out.exists():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(aside)
    tmp.rename(out)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def building_folder(out: Path, error: type[Exception] = ExportError) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into; renamed to ``out`` when the block ends
    without an error, deleted in every case. A failure to write (no space, no permission) is
    one line naming ``out``, and leaves ``out`` as it was."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        share_like_umask(tmp)  # safetensors writes owner-only files
        replace_folder(tmp, out)
    except Exception as exc:
        # torch's and safetensors' writers say a full disk without an errno (SafetensorError
        # is a plain Exception): the same one line
        if not isinstance(exc, OSError) and not any(w in str(exc) for w in WRITER_WORDS):
            raise
        raise error(f"{out}: cannot be written ({first_line(exc)})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ExportError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _lora_layers(base: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def merged_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active LoRA adapter added in, under the base
    model's own key names; ``peft_model`` is not modified. Adapters peft would merge in
    another way (DoRA, other tuner types) are merged by peft itself, on a copy."""
    base = peft_model.get_base_model()
    layers = _lora_layers(base)
    if any(
        any(getattr(m, "use_dora", {}).get(a, False) for a in m.active_adapters)
        for m in layers.values()
    ):
        return _merged_by_peft(peft_model)
    state = {}
    for key, tensor in base.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if ".lora_" in key:
            continue  # the adapter's own matrices: folded into the weight below
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            owner = owner[: -len(".base_layer")]
            layer = layers[owner]
            if leaf == "weight" and not layer.merged and not layer.disable_adapters:
                with torch.no_grad():
                    for adapter in layer.active_adapters:
                        if adapter in layer.lora_A or adapter in getattr(
                            layer, "lora_embedding_A", {}
                        ):
                            tensor = tensor + layer.get_delta_weight(adapter)
            key = f"{owner}.{leaf}"
        elif "modules_to_save" in key or "original_module" in key:
            return _merged_by_peft(peft_model)
        state[key] = tensor
    return state


def _merged_by_peft(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    return copy.deepcopy(peft_model).merge_and_unload().state_dict()


def _set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights were saved in (transformers >= 5 loads in it)."""
    path = folder / "config.json"
    fields = json.loads(path.read_text())
    fields["dtype"] = str(dtype).replace("torch.", "")
    fields.pop("torch_dtype", None)
    path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def _cast_adapter(folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / ADAPTER_WEIGHTS
    weights = {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}
    save_file(weights, str(path), metadata={"format": "pt"})


def _saved_state(state: dict, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` as :func:`_saved_tensor` saves it, tensors that share one
    storage (a tied embedding and output head) still sharing one: cast one by one they came
    apart, and ``save_pretrained``, which finds ties by storage, wrote the head as a second
    copy of the embedding (the whole 49152 x 576 matrix again in a bf16 SmolLM2)."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for key, t in state.items():
        same = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if same not in done:
            done[same] = _saved_tensor(t, dtype)
        out[key] = done[same]
    return out


def _saved_tensor(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """On the CPU, floating-point tensors in ``dtype`` (integer buffers as they are)."""
    t = t.detach().to("cpu")
    return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()


def unwrap_policy(model: nn.Module) -> nn.Module:
    """The causal LM inside a policy: without a shared value head or a DDP wrapper."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    return model.lm if isinstance(model, PolicyWithValueHead) else model


def save_policy(
    lm: nn.Module,
    tokenizer,
    out_dir: str | Path,
    *,
    merge_lora: bool = True,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    protect: tuple = (),
) -> Path:
    """Write ``lm`` (a causal LM, maybe LoRA-wrapped, or a policy with a shared value head)
    and ``tokenizer`` to ``out_dir``; returns the folder. ``protect``: folders ``out_dir``
    must neither be nor hold (the run and base model it comes from), ``force`` or not.

    ``merge_lora``: a LoRA policy is saved merged into its base (a plain model folder); with
    False, as its adapter alone (a PEFT folder for the base its ``adapter_config.json``
    names). ``dtype``: 'fp32', 'bf16' (or a torch dtype) for the saved weights; None keeps
    them as they are (fp32 for weights rlhflab trained). ``out_dir`` must be absent or empty
    unless ``force``; it is replaced only once the new folder is whole. The model is not
    changed (nor moved off its device)."""
    out, dtype = Path(out_dir).expanduser().absolute(), _dtype(dtype)
    check_out_dir(out, force, protect=protect)
    lm = unwrap_policy(lm)
    with building_folder(out) as tmp:
        if is_peft(lm) and not merge_lora:
            lm.save_pretrained(tmp, safe_serialization=True)
            if dtype is not None:
                _cast_adapter(tmp, dtype)
        else:
            model = lm.get_base_model() if is_peft(lm) else lm
            state = merged_state_dict(lm) if is_peft(lm) else lm.state_dict()
            state = _saved_state(state, dtype)
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
            restore_dropout(tmp, model)
            _set_config_dtype(tmp, dtype or model.get_input_embeddings().weight.dtype)
        tokenizer.save_pretrained(tmp)
    return out
