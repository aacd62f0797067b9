"""How close `rlhflab memory`'s estimate comes to what a real PPO iteration holds.

For each preset and layout: the estimate (``memory.estimated_peak``: weights and AdamW
moments, the gradients during the PPO epochs, plus the phases of
``memory.iteration_memory``) against the most bytes of tensors a
real iteration held at once — its second, once the moments exist — followed through
torch's dispatcher (``tensor_bytes.NewStorages``). Prompts are all ``rollout.max_prompt_tokens``
long and EOS is ignored, so the run is the worst case the estimate plans for. Tensors only:
a process's resident memory adds its libraries and its allocator's slack on top.

    .venv/bin/python benchmarks/memory_estimate.py [--presets tiny small medium]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch

from rlhflab import models as M
from rlhflab.config import load_config
from rlhflab.diagnostics.memory import cast_memory, iteration_memory
from rlhflab.diagnostics.memory_format import estimated_peak
from rlhflab.diagnostics.tensor_bytes import NewStorages, optimizer_held_bytes
from rlhflab.models.presets import preset_path
from rlhflab.trainers.ppo import PPOTrainer

LAYOUTS = {
    "separate critic, 2 minibatches": [],
    "separate critic, 1 minibatch": ["ppo.minibatches=1"],
    "shared backbone": ["model.value_model=shared"],
    "checkpointing, native": ["model.gradient_checkpointing=true", "model.runtime=native"],
    # the attention-only targets these rows were measured with (the default before issue
    # #26; model.lora_targets is now all-linear)
    "LoRA r=8": ["model.lora_r=8", "model.lora_targets=[q_proj,k_proj,v_proj,o_proj]"],
    "LoRA critic r=8": ["model.critic_lora_r=8"],
    "LoRA critic r=8, bf16": ["model.critic_lora_r=8", "model.reference_precision=bf16"],
}
MIB = 1024 * 1024


def config(preset: str, folder: Path, overrides: list[str]):
    # distinct prompts of one length: the opener probe runs a repeated prompt once
    words = ["apple", "banana", "cherry", "kiwi", "mango"]
    prompts = [f"copy: {' '.join(w)}\nanswer:" for w in itertools.permutations(words)]
    tok = M.load_tokenizer(preset_path(preset))
    lengths = {len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts}
    assert len(lengths) == 1, lengths
    n_tokens = lengths.pop()
    rows = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    (folder / "prompts.jsonl").write_text(rows)
    base = {
        "device": "cpu",
        "model": {"policy": f"preset:{preset}", "value_model": "separate"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "data": {"prompts": str(folder / "prompts.jsonl")},
        "rollout": {
            "prompts_per_iteration": 16,
            "max_new_tokens": 32,
            "max_prompt_tokens": n_tokens,
            "ignore_eos": True,
        },
        "ppo": {"iterations": 2, "epochs": 2, "minibatches": 2},
        "log": {"output_dir": str(folder / "run"), "progress": False},
    }
    return load_config(base=base, overrides=overrides)


def measure(preset: str, overrides: list[str]) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as d:
        cfg = config(preset, Path(d), overrides)
        trainer = PPOTrainer(cfg)
        models = cast_memory(trainer.cast)
        estimate, largest = estimated_peak(models, iteration_memory(trainer.cast, cfg))
        trainer.step()
        before = sum(m.weights for m in models) + optimizer_held_bytes(
            trainer.opt, trainer.critic_opt
        )
        tracker = NewStorages()
        with tracker:
            trainer.step()
        return estimate / MIB, (before + tracker.peak) / MIB, largest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small", "medium"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'preset':<8} {'layout':<32} {'estimate':>9} {'actual':>9} {'ratio':>6}  largest phase")
    for preset in args.presets:
        for name in args.layouts:
            overrides = LAYOUTS[name]
            est, actual, largest = measure(preset, overrides)
            print(
                f"{preset:<8} {name:<32} {est:>9.1f} {actual:>9.1f} {est / actual:>6.2f}  {largest}"
            )


if __name__ == "__main__":
    main()
