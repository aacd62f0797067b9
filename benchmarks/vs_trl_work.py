"""The work both sides of ``vs_trl.py`` do, and the models they do it on.

The sizes (hidden, intermediate, layers, heads, answer tokens), rollouts per iteration,
PPO epochs, KL coefficient and learning rate; the locally built Llama-style policy and
reward model of a size with their prompts (``build_models``), a bare policy of a size for
the one-model benchmarks (``bare_llama``), the prompts' mean length in tokens, and
rlhflab's config of the equal work (``rlhflab_config``). ``vs_trl_group.py``,
``vs_trl_real.py``, ``bf16_speedup.py``, ``time_floor.py`` and others import them from here.
Nothing at module level imports torch or rlhflab: TRL's workers import this too.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROLLOUTS, EPOCHS, KL_COEF, LR = 16, 4, 0.05, 3e-6
# name → (hidden, intermediate, layers, heads, answer tokens); ~440-token vocabulary, tied
SIZES = {
    "0.2M": (64, 192, 3, 2, 32),
    "4M": (256, 704, 5, 4, 64),
    "25M": (512, 1408, 8, 8, 64),
}


def build_models(size: str, folder: Path) -> Path:
    """policy/, reward/ (one-label classifier, also the value model's start), prompts.jsonl."""
    if (folder / "prompts.jsonl").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlhflab.builtin import tasks
    from rlhflab.models.presets import build_tokenizer, default_corpus

    hidden, inter, layers, heads, _ = SIZES[size]
    tok = build_tokenizer(default_corpus())
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    for name, model in (
        ("policy", LlamaForCausalLM(LlamaConfig(**cfg))),
        ("reward", LlamaForSequenceClassification(LlamaConfig(**cfg, num_labels=1))),
    ):
        model.save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    rows = [{"prompt": ex.prompt} for ex in tasks.make_examples(512, seed=7)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def bare_llama(size: str):
    """A freshly initialised (seed 0) Llama causal LM of one size, 440-token vocabulary, tied
    embeddings: the policy shape of that size, for the one-model benchmarks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden, inter, layers, heads, _ = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=440,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def prompt_length(folder: Path) -> int:
    """Mean prompt tokens (the batch pads to its longest; close enough for a FLOP count)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder / "policy")
    rows = [
        json.loads(x)["prompt"] for x in (folder / "prompts.jsonl").read_text().split("\n") if x
    ]
    return round(statistics.mean(len(tok(p, add_special_tokens=False)["input_ids"]) for p in rows))


def rlhflab_config(
    folder: Path,
    answer: int,
    iterations: int,
    runtime: str = "native",
    cpu_matmul: str = "numpy",
    rollouts: int = ROLLOUTS,
    epochs: int = EPOCHS,
) -> dict:
    """rlhflab's side of the equal work, as a config dict: ``folder``'s policy/ and reward/
    (the critic initialised from the reward model), ``rollouts`` answers of exactly ``answer``
    tokens, ``epochs`` PPO epochs of one minibatch, TRL 1.12's PPO choices written out."""
    return {
        "device": "cpu",
        "seed": 0,
        "model": {
            "policy": str(folder / "policy"),
            "value_model": "from_reward",
            "runtime": runtime,
            # the Linear layers' products through torch's MKL or numpy's OpenBLAS, whichever
            # main() measured faster here (benchmarks/cpu_matmul.py); same FLOPs, same fp32
            "cpu_matmul": cpu_matmul,
        },
        "reward": {"model": str(folder / "reward"), "normalize": "none", "clip": None},
        "rollout": {
            "prompts_per_iteration": rollouts,
            "max_new_tokens": answer,
            "ignore_eos": True,
            "temperature": 1.0,
            # TRL 1.12 takes the policy's old log-probs from the generation logits
            # (ppo_trainer.py: logprob = selective_log_softmax(logitss[...], response)), with
            # no policy forward after sampling; the same here
            "logprobs_from_sampling": True,
            # TRL draws with torch.multinomial; the same softmax drawn by the Gumbel-max
            # trick (an exact draw from the same distribution, another random stream), whose
            # CPU draw is ~5x faster at a large vocabulary (docs/benchmarks.md, "What each
            # optimisation bought"). The work the floor counts is unchanged: it has no draw
            "sampler": "gumbel",
        },
        "ppo": {
            "iterations": iterations,
            "epochs": epochs,
            "minibatches": 1,
            "lr": LR,
            "critic_lr": LR,
            "kl_coef": KL_COEF,
            "kl_estimator": "k1",
            "gamma": 1.0,
            "lam": 0.95,
            "whiten_rewards": False,
            # TRL 1.12's PPOTrainer steps without clipping the gradient norm
            # (trl/experimental/ppo/ppo_trainer.py: backward, then optimizer.step()), so no
            # clip here either; which in turn lets AdamW run inside the backward (same
            # updates, no full set of gradients held: docs/benchmarks.md)
            "max_grad_norm": None,
            "step_in_backward": True,
            # the default, written out: the critic's first training forward gives the old
            # values (one minibatch), where TRL runs a separate no-grad value forward first
            "values_from_training_forward": True,
        },
        "data": {"prompts": str(folder / "prompts.jsonl")},
        "log": {
            "output_dir": str(folder / "run-rlhflab"),
            "progress": False,
            "sample_every": 10_000,
            "checkpoint_every": 10_000,
        },
        "monitor": {"enabled": False},
    }
