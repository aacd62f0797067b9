"""The work of ``vs_trl_real.py``: SmolLM2-135M-Instruct's sizes, models and rows.

The settings both sides share (rollouts, answer tokens, epochs, threads), the levers'
LoRA, the rows and their labels; the model folder (``build_real_models``: the converted
policy, a reward model on its backbone, the chat-rendered prompts and held-out problems)
and rlhflab's config of each row (``rlhflab_real_config``, ``vs_trl_work.rlhflab_config``
at these sizes). ``bf16_speedup.py`` runs the same work from here. Nothing at module level
imports torch or rlhflab: TRL's workers import this too.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from vs_trl_work import rlhflab_config

HERE = Path(__file__).resolve().parent
SMOLLM2 = HERE.parent / "examples" / "smollm2"
NAME = "SmolLM2-135M"
ROLLOUTS, ANSWER, EPOCHS, THREADS = 8, 24, 2, 2
LORA_R, LORA_ALPHA, LEVER_LR = 8, 16.0, 1e-4  # examples/smollm2/ppo.yaml's LoRA
PAD = "[PAD]"  # TRL's side only (see vs_trl_real.py's docstring)
ROWS = {
    "rlhflab": "rlhflab, native runtime, fp32",
    "trl": "TRL 1.12.0, fp32",
    "rlhflab-tf": "rlhflab, transformers runtime, fp32",
    "trl-bf16": "TRL 1.12.0, bf16=True",
    "levers": "rlhflab with levers",
}
FULL = "levers-fp32"  # the levers with the precision levers off: the KL's reference


def load_example(name: str):
    """A module of examples/smollm2 (task.py, prepare.py), imported from its file."""
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", SMOLLM2 / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_real_models(policy: Path, folder: Path) -> Path:
    """policy/ (a link to the converted checkpoint), reward/ (a one-label classifier with
    SmolLM2's backbone and a fresh score head, seed 0; also the critic's start),
    prompts.jsonl (the 70 training sums, chat-rendered) and eval.jsonl (8 held-out ones)."""
    if (folder / "prompts.jsonl").exists():
        return folder
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    if not (policy / "config.json").is_file():
        sys.exit(f"{policy}: no converted SmolLM2; run python examples/smollm2/prepare.py first")
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "policy"
    if not link.exists():
        link.symlink_to(policy.resolve(), target_is_directory=True)
    tok = AutoTokenizer.from_pretrained(policy)
    torch.manual_seed(0)
    reward = LlamaForSequenceClassification(LlamaConfig.from_pretrained(policy, num_labels=1))
    backbone = LlamaForCausalLM.from_pretrained(policy).model.state_dict()
    reward.model.load_state_dict(backbone)  # strict: every backbone weight, nothing else
    reward.save_pretrained(folder / "reward")
    tok.save_pretrained(folder / "reward")
    task = load_example("task")
    train, heldout = task.problems()
    for name, items in (("eval.jsonl", heldout[:ROLLOUTS]), ("prompts.jsonl", train)):
        rows = [
            {
                "prompt": tok.apply_chat_template(
                    [{"role": "user", "content": task.QUESTION.format(a=a, b=b)}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            }
            for a, b in items
        ]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def rlhflab_real_config(folder: Path, iterations: int, side: str, opts: dict) -> dict:
    """``vs_trl_work.rlhflab_config`` at this benchmark's sizes; the levers on top for
    ``levers`` and (precision off) ``levers-fp32``."""
    levers = side in ("levers", FULL)
    runtime = "transformers" if side == "rlhflab-tf" or levers else "native"
    compute = opts["compute"] if side == "levers" else "fp32"
    # numpy multiplies fp32 only (model.cpu_matmul): bf16 compute goes through torch
    cpu_matmul = "torch" if compute == "bf16" else opts["cpu_matmul"]
    cfg = rlhflab_config(folder, ANSWER, iterations, runtime, cpu_matmul, ROLLOUTS, EPOCHS)
    cfg["threads"] = THREADS
    cfg["log"]["output_dir"] = str(folder / f"run-{side}")
    if levers:
        cfg["model"].update(
            lora_r=LORA_R,
            lora_alpha=LORA_ALPHA,
            lora_targets="all-linear",
            value_model="shared",
            reward_precision=opts["reward"] if side == "levers" else "fp32",
            compute_dtype=compute,
        )
        cfg["ppo"]["lr"] = LEVER_LR
    return cfg
