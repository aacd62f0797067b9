"""Built-in Llama-style models and a tokenizer the project trains itself: no download.

Presets are written as ordinary Hugging Face folders (``config.json``, safetensors,
``tokenizer.json``), so everything downstream goes through the same loading code as a real
model. ``preset:NAME`` in a config resolves to a cached folder built on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from rlhflab.builtin import tasks
from rlhflab.infra.files import share_like_umask
from rlhflab.models.prepare import quiet_transformers

# name → LlamaConfig fields. Parameter counts (tied embeddings, the ~440-token vocabulary
# the BPE trainer reaches on the task corpus) are pinned by tests/test_models.py.
PRESETS: dict[str, dict] = {
    "nano": dict(
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    ),  # ~0.04M: the fastest tests
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),  # ~0.9M
    "small": dict(
        hidden_size=320,
        intermediate_size=864,
        num_hidden_layers=8,
        num_attention_heads=5,
        num_key_value_heads=5,
    ),  # ~10M
    "medium": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=9,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),  # ~30M
}
VOCAB_SIZE = 512
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_FORMAT_VERSION = "1"


def default_corpus() -> list[str]:
    """Text the preset tokenizer is trained on: the built-in task's vocabulary and phrases."""
    return tasks.tokenizer_corpus()


def build_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on ``corpus`` (any text still encodes: byte fallback).

    Pad, BOS and EOS are distinct special tokens; a simple chat template is attached.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(name: str, tokenizer, **extra):
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
        **PRESETS[name],
        **extra,
    )


def build_preset(
    name: str,
    out_dir: str | Path,
    seed: int = 0,
    heads: list[str] | None = None,
    corpus: list[str] | None = None,
) -> Path:
    """Write a freshly initialised preset to ``out_dir`` as a Hugging Face folder.

    ``heads=None`` builds a causal LM; a list of head names builds a sequence-classification
    (reward) model with one output per head, named in ``id2label``.
    """
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    out = Path(out_dir)
    tokenizer = build_tokenizer(corpus if corpus is not None else default_corpus())
    torch.manual_seed(seed)
    if heads is None:
        model = LlamaForCausalLM(llama_config(name, tokenizer))
    else:
        labels = {i: h for i, h in enumerate(heads)}
        cfg = llama_config(
            name,
            tokenizer,
            num_labels=len(heads),
            id2label=labels,
            label2id={h: i for i, h in labels.items()},
        )
        model = LlamaForSequenceClassification(cfg)
    out.mkdir(parents=True, exist_ok=True)
    quiet_transformers()
    _write_model(model, out)
    tokenizer.save_pretrained(out)
    return out


def _write_model(model, out: Path) -> None:
    """``config.json``, ``generation_config.json`` and ``model.safetensors`` of a freshly
    made transformers model, as ``save_pretrained`` lays them out, on every process.

    Not ``model.save_pretrained``: transformers 5 writes a model's files on rank 0 only once
    torch.distributed is initialised, so under torchrun another rank built a preset with a
    tokenizer and no model, and when its folder reached the cache first every rank (and
    every later run) read a model folder without a config.json."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]
    model.config.dtype = next(model.parameters()).dtype
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding's own tensor, saved once
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def cache_dir() -> Path:
    return Path(os.environ.get("RLHFLAB_CACHE", Path.home() / ".cache" / "rlhflab"))


def preset_path(name: str, seed: int = 0) -> Path:
    """The cached folder for ``preset:NAME``, built on first use (atomically, by rename)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    key = hashlib.sha1(
        json.dumps([_FORMAT_VERSION, PRESETS[name], default_corpus()[:50]], sort_keys=True).encode()
    ).hexdigest()[:10]
    final = cache_dir() / "presets" / f"{name}-s{seed}-{key}"
    if _complete(final):
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    build_preset(name, tmp, seed=seed)
    share_like_umask(tmp)
    if final.exists() and not _complete(final):
        # an incomplete folder left by an older rlhflab under torchrun (see _write_model):
        # moved aside, so that a complete one takes its place
        aside = final.with_name(final.name + f".incomplete{os.getpid()}")
        try:
            final.rename(aside)
        except OSError:  # another process moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race; its folder is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def count_parameters(name: str) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(name, build_tokenizer(default_corpus())))
    return sum(p.numel() for p in model.parameters())
