"""TRL's side of ``vs_trl.py``'s PPO comparison: its environment and its run.

``setup_trl_env`` makes a virtual environment with TRL ``TRL_VERSION`` and our torch and
transformers versions (``vs_trl_group.py`` sets ``TRL_VERSION`` to its own before calling
it); ``run_trl`` trains TRL's ``PPOTrainer`` on a ``vs_trl_work`` folder inside a worker
process of that environment, timing each step and each generation; ``TRL_COMMON`` holds
the TrainingArguments every TRL run shares. ``run_trl`` runs under TRL's interpreter,
where rlhflab is not importable: module level imports only the standard library and this
folder's modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vs_trl_work import EPOCHS, KL_COEF, LR, ROLLOUTS
from worker_process import worker_result

TRL_VERSION = "1.12.0"
# every TRL run: fp32 on the CPU, seed 0, no logging, saving or progress bars
TRL_COMMON = dict(
    report_to="none",
    save_strategy="no",
    logging_steps=10_000,
    disable_tqdm=True,
    seed=0,
    bf16=False,
    fp16=False,
    use_cpu=True,
)


def setup_trl_env(env: Path) -> Path:
    """A venv with TRL 1.12.0 and our torch/transformers versions; returns its python."""
    import torch
    import transformers

    py = env / "bin" / "python"
    stamp = env / f".trl-{TRL_VERSION}"
    if stamp.exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pins = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
        f"trl=={TRL_VERSION}",
    ]
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", *pins], check=True)
    stamp.touch()
    return py


def run_trl(
    folder: Path,
    answer: int,
    iterations: int,
    rollouts: int = ROLLOUTS,
    epochs: int = EPOCHS,
    threads: int = 1,
    pad_token: str | None = None,
    **overrides,
) -> dict:
    """TRL's side of the equal work (see :func:`rlhflab_config`), ``threads`` torch threads.
    ``pad_token``: a pad token added to the tokenizer first, as TRL's PPO example script
    does (examples/scripts/ppo/ppo.py: ``add_special_tokens({"pad_token": "[PAD]"})``; TRL
    builds every mask as ``ids != pad_token_id`` and zeroes those ids before a forward, so
    the new id never reaches the embedding); ``overrides``: PPOConfig fields that replace
    the ones set here (e.g. ``bf16=True``)."""
    import torch

    torch.set_num_threads(threads)
    if overrides.get("bf16") or overrides.get("fp16"):
        # TRL 1.12's PPOTrainer makes its own Accelerator without the config's precision
        # (ppo_trainer.py: Accelerator(gradient_accumulation_steps=...)) and transformers 5's
        # TrainingArguments no longer exports it, so bf16=True alone leaves the run in fp32;
        # through the environment, as `accelerate launch --mixed_precision bf16` passes it
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if overrides.get("bf16") else "fp16"
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    tok = AutoTokenizer.from_pretrained(folder / "policy", padding_side="left")
    if pad_token is not None:
        tok.add_special_tokens({"pad_token": pad_token})
    prompts = [
        json.loads(x)["prompt"] for x in (folder / "prompts.jsonl").read_text().split("\n") if x
    ]
    ds = Dataset.from_dict(
        {"input_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]}
    )
    config = dict(
        output_dir=str(folder / "run-trl"),
        per_device_train_batch_size=rollouts,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=epochs,
        total_episodes=rollouts * iterations,
        response_length=answer,
        stop_token=None,  # full length, as rlhflab's rollout.ignore_eos
        temperature=1.0,
        kl_coef=KL_COEF,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        learning_rate=LR,
        local_rollout_forward_batch_size=rollouts,
        num_sample_generations=0,
        **TRL_COMMON,
    )
    args = PPOConfig(**{**config, **overrides})
    policy = AutoModelForCausalLM.from_pretrained(folder / "policy")
    ref = AutoModelForCausalLM.from_pretrained(folder / "policy")
    reward = AutoModelForSequenceClassification.from_pretrained(folder / "reward", num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(folder / "reward", num_labels=1)

    gen, original = [], trl_ppo.batch_generation

    def timed_generation(model, queries, *a, **kw):
        t0 = time.perf_counter()
        out = original(model, queries, *a, **kw)
        new_tokens = out[0].shape[1] - queries.shape[1]
        gen.append(queries.shape[0] * new_tokens / (time.perf_counter() - t0))
        return out

    trl_ppo.batch_generation = timed_generation
    ticks = []

    class Tick(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ticks.append(time.perf_counter())

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=ds,
        value_model=value,
        callbacks=[Tick()],
    )
    start = time.perf_counter()
    trainer.train()
    # the precision TRL's accelerator ran in ("no" = fp32)
    return {
        **worker_result(start, ticks, gen),
        "mixed_precision": trainer.accelerator.mixed_precision,
    }
