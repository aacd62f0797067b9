"""The frozen models' memory levers: precision (bf16/fp16/int8), CPU offload, and the
reference of a LoRA policy (the same weights, adapter disabled)."""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager

import torch
from torch import nn

from rlhflab.models.loading import release_freed_memory
from rlhflab.models.prepare import ModelLoadError

# set on a model whose Linear weights store_linear_weights made 16-bit: its dtype
LOW_LINEAR = "_rlhflab_low_linear"
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def freeze(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def set_precision(model: nn.Module, precision: str, device: torch.device | str = "cpu"):
    """Cast a frozen model to fp32/bf16/fp16, or int8.

    int8 on CPU: torch's dynamic quantisation of every nn.Linear (weights int8, activations
    quantised per batch), GPT-2's Conv1D layers included (rewritten as Linear first). Its
    `torch.ao` API is deprecated in favour of torchao but still the one that needs no
    extra package. On GPU, int8 needs bitsandbytes: load the model with
    ``BitsAndBytesConfig(load_in_8bit=True)`` (see docs/memory.md); refused here.
    """
    if precision in PRECISION_DTYPES:
        model = model.to(PRECISION_DTYPES[precision])
        release_freed_memory()
        return model
    if precision != "int8":
        raise ValueError(f"unknown precision {precision!r}")
    if torch.device(device).type != "cpu":
        raise ModelLoadError(
            "int8 on an accelerator needs bitsandbytes (docs/memory.md); "
            "torch's dynamic int8 quantisation runs on the CPU only"
        )
    from torch.ao.quantization import quantize_dynamic

    _conv1d_as_linear(model)  # GPT-2's layers: else only its tied head would be int8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notices of torch.ao
        # in place: the caller already owns a copy, and a second one would double the peak
        quantized = quantize_dynamic(model.float(), {nn.Linear}, dtype=torch.qint8, inplace=True)
    release_freed_memory()
    return quantized


def _conv1d_as_linear(model: nn.Module) -> None:
    """Replace transformers' ``Conv1D`` (GPT-2 and its family: ``x @ W + b`` with W stored
    (in, out)) by the same product as an ``nn.Linear`` (W transposed), in place, so that
    int8 quantisation, which takes Linear layers, reaches them."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ != "Conv1D" or not hasattr(child, "nf"):
                continue
            n_in, n_out = child.weight.shape
            linear = nn.Linear(n_in, n_out, bias=child.bias is not None, device="meta")
            linear.weight = nn.Parameter(child.weight.detach().t().contiguous(), False)
            if child.bias is not None:
                linear.bias = nn.Parameter(child.bias.detach(), False)
            setattr(parent, name, linear)


class Offloaded(nn.Module):
    """Keeps a frozen model on the CPU and moves it to ``device`` only for its forward pass."""

    def __init__(self, model: nn.Module, device: torch.device):
        super().__init__()
        self.model = model.to("cpu")
        self.device = torch.device(device)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, *args, **kwargs):
        if self.device.type == "cpu":
            return self.model(*args, **kwargs)
        self.model.to(self.device)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.to("cpu")

    @contextmanager
    def on_device(self):
        """Keep the model on the accelerator for a block of several forward passes."""
        self.model.to(self.device)
        try:
            yield self.model
        finally:
            self.model.to("cpu")


class LoraReference:
    """The reference policy of a LoRA-trained policy: the same model, adapter disabled.

    No second copy of the weights exists; calling it runs the base model (peft's
    ``disable_adapter`` context).
    """

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    @property
    def base_model(self):
        return self.peft_model.base_model

    def context(self):
        return self.peft_model.disable_adapter()


def make_reference(
    policy_lm: nn.Module,
    precision: str = "fp32",
    offload: bool = False,
    device: str | torch.device = "cpu",
    low_weights: torch.dtype | None = None,
):
    """Frozen copy of the initial policy, or the adapter-disabled base of a LoRA policy
    (which shares the policy's weights: nothing of it to offload — ``offload`` then moves
    only the other frozen models — and no precision of its own). ``low_weights``: the
    16-bit dtype an fp32 reference's products run in under autocast, to store its Linear
    weights in (:func:`store_linear_weights`; model.reference_low_weights)."""
    if hasattr(policy_lm, "disable_adapter"):
        if precision != "fp32":
            raise ModelLoadError(
                "model.reference_precision: with LoRA the reference shares the policy's "
                "weights and cannot be cast"
            )
        return LoraReference(policy_lm)
    ref = freeze(set_precision(copy.deepcopy(policy_lm), precision, "cpu" if offload else device))
    if low_weights is not None and precision == "fp32":
        store_linear_weights(ref, low_weights)
        release_freed_memory()
    if offload:
        return Offloaded(ref, torch.device(device))
    return ref.to(device) if precision != "int8" else ref


def store_linear_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the fp32 weight of every plain ``nn.Linear`` of frozen ``model`` in ``dtype``,
    in place; returns the bytes freed. For a model that only ever runs under
    ``torch.autocast(dtype)``: autocast casts each Linear's fp32 weight to ``dtype`` in
    every forward (its cache keeps only the casts of weights that train), and a weight
    already in ``dtype`` is the same rounding, made once — the products are bit for bit
    those of the fp32 model under autocast. Outside autocast the model would refuse fp32
    inputs (mixed dtypes), never compute otherwise. Left fp32: biases (autocast casts
    them as before), every other module's weights (norms and embeddings run in fp32 under
    autocast) and a Linear weight tied to one of them (a tied output embedding is also
    the input embedding's table, looked up in fp32)."""
    others = {
        id(p)
        for module in model.modules()
        if type(module) is not nn.Linear
        for p in module._parameters.values()
        if p is not None
    }
    low: dict[int, nn.Parameter] = {}  # one 16-bit tensor for a weight two Linears share
    freed = 0
    for module in model.modules():
        w = module.weight if type(module) is nn.Linear else None
        if w is None or w.dtype != torch.float32 or id(w) in others:
            continue
        if id(w) not in low:
            low[id(w)] = nn.Parameter(w.detach().to(dtype), requires_grad=False)
            freed += w.numel() * (w.element_size() - low[id(w)].element_size())
        module.weight = low[id(w)]
    if low:
        setattr(model, LOW_LINEAR, dtype)
    return freed


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's quantised layers (an int8 model's Linear: its
    weight and bias are packed, not parameters)."""
    return type(module).__module__.startswith("torch.ao.nn.quantized")


def low_linear_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`store_linear_weights` stored ``model``'s Linear weights in (the
    autocast it must run under), or None."""
    return getattr(model, LOW_LINEAR, None)


def module_bytes(model: nn.Module) -> int:
    """Bytes of all weights, tied tensors once; int8-packed Linear weights (their state_dict
    holds a (qweight, bias) tuple) count 1 byte per weight."""
    seen, total = set(), 0
    for value in model.state_dict().values():
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total
