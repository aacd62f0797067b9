"""Built-in Llama-style models and a tokenizer the project trains itself: no download.

Presets are written as ordinary Hugging Face folders (``config.json``, safetensors,
``tokenizer.json``), so everything downstream goes through the same loading code as a real
model. ``preset:NAME`` in a config resolves to a cached folder built on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

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
    from rlhflab import tasks

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
    from rlhflab.models import quiet_transformers

    quiet_transformers()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


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
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    build_preset(name, tmp, seed=seed)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race; its folder is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final


def count_parameters(name: str) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(name, build_tokenizer(default_corpus())))
    return sum(p.numel() for p in model.parameters())
