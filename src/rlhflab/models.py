"""Loading models, the value heads, and the memory levers for frozen models.

Every forward pass in rlhflab goes through :func:`causal_forward` or :func:`token_values`,
which take explicit ``position_ids`` computed from the attention mask, so left-padded
generation and right-padded training see the same positions.
"""

from __future__ import annotations

import copy
import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

# the loaders' checks live in rlhflab.loading; callers reach these through this module
from rlhflab.loading import ModelLoadError as ModelLoadError
from rlhflab.loading import check_weight_files, disable_dropout, first_line, hf_load
from rlhflab.loading import quiet_transformers as quiet_transformers
from rlhflab.loading import require_fp32_trainable as require_fp32_trainable
from rlhflab.native import NativeLlamaModel
from rlhflab.presets import PAD, preset_path


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


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_path(spec: str, field: str = "model") -> Path:
    """``preset:NAME`` → the cached preset folder; otherwise an existing local folder."""
    if spec.startswith("preset:"):
        try:
            return preset_path(spec.split(":", 1)[1])
        except ValueError as exc:
            raise ModelLoadError(f"{field}: {exc}") from None
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise ModelLoadError(
            f"{field}: {spec!r} is not a local Hugging Face model folder (no config.json); "
            "rlhflab never downloads at run time — use preset:NAME or a saved folder"
        )
    try:  # read here, so that every loader after this reads a config known to be JSON
        json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{field}: {path / 'config.json'} is not valid JSON ({exc})") from None
    return path


RUNTIMES = ("transformers", "native")


# the files a Hugging Face tokenizer is read from (fast, SentencePiece, BPE and WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    path: str | Path, trust_remote_code: bool = False, runtime: str = "transformers"
):
    """Tokenizer with a pad token distinct from EOS (one is added when missing or shared).

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
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{path}: the tokenizer cannot be loaded ({first_line(exc)})"
        ) from None
    if tok.eos_token_id is None:
        raise ModelLoadError(f"{path}: the tokenizer has no EOS token; answers could never end")
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        # Sharing pad and EOS makes the EOS look like padding and drop out of the mask.
        tok.add_special_tokens({"pad_token": PAD})
    return tok


def _fit_vocab(model, tokenizer) -> None:
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
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
    from rlhflab.native import NativeConfigError
    from rlhflab.native_models import load_native

    try:
        model = load_native(path, kind, **kwargs)
    except NativeConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    _fit_vocab(model, tokenizer)
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

    model, _ = hf_load(AutoModelForCausalLM, path, trust_remote_code, {}, dtype=dtype)
    _fit_vocab(model, tokenizer)
    return disable_dropout(model)


def load_sequence_classifier(
    path: str | Path,
    tokenizer,
    trust_remote_code: bool = False,
    num_labels: int | None = None,
    owned: bool = False,
    runtime: str = "transformers",
    dtype: torch.dtype = torch.float32,
    trained_head_for: str | None = None,
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
    """
    _check_runtime(runtime, trust_remote_code)
    saved = check_weight_files(path).get("score.weight")
    if num_labels is not None and saved and saved[0] != num_labels:
        # transformers would refuse it with a traceback pointing at a report it printed
        raise ModelLoadError(
            f"{path}: its saved score head has {saved[0]} outputs where {num_labels} are "
            "needed (rm.heads: one per head); start from a causal LM or match the heads"
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

    from rlhflab.native_models import untrained_head_message

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
    _fit_vocab(model, tokenizer)
    return disable_dropout(model)


def same_tokenizer(a, b) -> bool:
    """Same vocabulary and special tokens: token ids can be passed between the two models."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.eos_token_id == b.eos_token_id
        and a.pad_token_id == b.pad_token_id
    )


# ----------------------------------------------------------------------------- forward passes


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def backbone_hidden(model, input_ids, attention_mask, keep_last: int = 0) -> torch.Tensor:
    """Last hidden states (B, L, H) of a CausalLM or SequenceClassification model's backbone;
    ``keep_last=N`` > 0: of the last N positions only, (B, min(N, L), H). The native runtime
    then runs its last layer on those rows only (``NativeLlamaModel.forward``); transformers'
    models compute every row and the rest are dropped."""
    if hasattr(model, "get_base_model"):  # a peft model: LoRA layers are injected in place
        model = model.get_base_model()
    kwargs = {}
    native = isinstance(model.base_model, NativeLlamaModel)
    if native and keep_last:
        kwargs["keep_last"] = keep_last
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
    hidden = out.last_hidden_state
    return hidden[:, -keep_last:] if keep_last and not native else hidden


def last_token_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """Hidden states (B, H) at each row's last real token (a reward model's pooling), with
    the backbone's last layer run from the leftmost of those positions on (one host sync
    to find it): answers forced to full length need that layer for one row each."""
    last = last_real_index(attention_mask)
    keep = input_ids.shape[1] - int(last.min())
    hidden = backbone_hidden(model, input_ids, attention_mask, keep_last=keep)
    rows = torch.arange(input_ids.shape[0], device=hidden.device)
    return hidden[rows, last - (input_ids.shape[1] - hidden.shape[1])]


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) mask → (B,) index of the last 1 (works for left and right padding)."""
    pos = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.where(attention_mask.bool(), pos, -1).max(dim=1).values


def causal_forward(model, input_ids, attention_mask, keep_last: int = 0, **kwargs):
    """One forward of a causal LM. ``keep_last=N`` computes logits for the last N positions
    only (``logits_to_keep``): PPO needs them for the answer, not the prompt, and the
    vocabulary projection of the prompt positions is pure waste (with a 150k vocabulary it
    is the biggest matmul of the model)."""
    if keep_last:
        kwargs["logits_to_keep"] = keep_last
    kwargs.setdefault("use_cache", False)  # a scoring/training pass has no use for a KV cache
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        **kwargs,
    )


class PolicyWithValueHead(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (shared backbone).

    One forward returns both logits and per-token values. The head is a Linear(H, 1)
    initialised to zero weight and bias (OAI19), so every value starts at 0 and the
    policy's outputs are exactly the plain model's.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=lm.get_input_embeddings().weight.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask, keep_last: int = 0):
        """(logits (B, N, V), values (B, N)) for the last N = ``keep_last`` positions when
        > 0, else for all L."""
        hidden = backbone_hidden(self.lm, input_ids, attention_mask, keep_last)
        logits = self.lm.get_output_embeddings()(hidden)
        values = self.value_head(hidden).squeeze(-1).clone()  # not a view (FSDP2 hooks)
        return logits, values


class CriticValues(nn.Module):
    """A sequence-classification critic as a module whose forward gives per-token values,
    so DDP/FSDP see the training call go through ``forward``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, keep_last: int = 0):
        # a fresh tensor, not a view: FSDP2 hooks its backward onto the output
        return token_values(self.model, input_ids, attention_mask, keep_last).clone()


def token_values(critic, input_ids, attention_mask, keep_last: int = 0) -> torch.Tensor:
    """Per-token values (B, L) from a sequence-classification critic's ``score`` head; of the
    last ``keep_last`` positions only, (B, keep_last), when > 0 (see :func:`backbone_hidden`)."""
    hidden = backbone_hidden(critic, input_ids, attention_mask, keep_last)
    return critic.score(hidden).squeeze(-1).float()


def critic_from_causal_lm(path, tokenizer, trust_remote_code=False, runtime="transformers"):
    """A separate critic: the causal LM's backbone with a zero-initialised scalar head."""
    critic = load_sequence_classifier(
        path, tokenizer, trust_remote_code, num_labels=1, runtime=runtime
    )
    nn.init.zeros_(critic.score.weight)
    if critic.score.bias is not None:
        nn.init.zeros_(critic.score.bias)
    return critic


def critic_from_reward_model(reward_model, head_weights: torch.Tensor):
    """A critic initialised from the reward model, head included (N+, InstructGPT).

    A K-head reward model's heads are combined with the same weights as the reward itself:
    a weighted sum of linear heads is one linear head, so the critic starts out predicting
    exactly the combined score at every token.
    """
    # a trained model: fp32 master weights even where the reward model was loaded in 16 bits
    critic = copy.deepcopy(reward_model).to(torch.float32)
    old = critic.score
    head = nn.Linear(old.in_features, 1, bias=old.bias is not None, dtype=old.weight.dtype)
    with torch.no_grad():
        w = head_weights.to(old.weight.dtype)
        head.weight.copy_(w @ old.weight)
        if old.bias is not None:
            head.bias.copy_((w @ old.bias).reshape(1))
    critic.score = head
    critic.config.num_labels = 1
    critic.config.id2label, critic.config.label2id = {0: "value"}, {"value": 0}
    for p in critic.parameters():
        p.requires_grad_(True)
    return critic.train()


# ----------------------------------------------------------------------------- frozen models


def freeze(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def set_precision(model: nn.Module, precision: str, device: torch.device | str = "cpu"):
    """Cast a frozen model to fp32/bf16/fp16, or int8.

    int8 on CPU: torch's dynamic quantisation of every nn.Linear (weights int8, activations
    quantised per batch). Its `torch.ao` API is deprecated in favour of torchao but still the
    one that needs no extra package. On GPU, int8 needs bitsandbytes: load the model with
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

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notices of torch.ao
        # in place: the caller already owns a copy, and a second one would double the peak
        quantized = quantize_dynamic(model.float(), {nn.Linear}, dtype=torch.qint8, inplace=True)
    release_freed_memory()
    return quantized


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
):
    """Frozen copy of the initial policy, or the adapter-disabled base of a LoRA policy."""
    if hasattr(policy_lm, "disable_adapter"):
        if precision != "fp32" or offload:
            raise ModelLoadError(
                "model.reference_precision/offload_frozen: with LoRA the "
                "reference shares the policy's weights and cannot be cast"
            )
        return LoraReference(policy_lm)
    ref = freeze(set_precision(copy.deepcopy(policy_lm), precision, "cpu" if offload else device))
    if offload:
        return Offloaded(ref, torch.device(device))
    return ref.to(device) if precision != "int8" else ref


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute decoder-layer activations in backward (transformers' own mechanism, the
    non-reentrant torch.utils.checkpoint, which needs no input that requires grad, so LoRA
    works too). It acts only in train mode: sampling (eval mode, KV cache) is unaffected."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(
            f"model.gradient_checkpointing: {type(model).__name__} does not support it"
        )
    # transformers >= 5.x renamed it (the old name warns); older releases only have the old
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, under either transformers name."""
    flag = getattr(type(model), "is_activation_checkpointing", None)
    return bool(model.is_activation_checkpointing if flag else model.is_gradient_checkpointing)


def apply_lora(lm: nn.Module, r: int, alpha: float, targets: list[str]):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelLoadError("model.lora_r > 0 needs peft: pip install 'rlhflab[lora]'") from None
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():
        # peft asks the model `is_gradient_checkpointing`, which transformers 5 deprecates
        # in favour of `is_activation_checkpointing`: a notice for peft, not for our users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")
        return get_peft_model(lm, cfg)


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
