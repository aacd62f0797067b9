"""sft.micro_batch_size and dpo.micro_batch_size: a step's gradient accumulated over parts of
its batch is the whole batch's (each part's loss its share of the batch's), so the weights
after a few steps match the one-pass run's to float rounding; one part's activations are
held at a time. Checked against the one-pass run, in float64 where the sum order differs."""

import pytest
import torch

from rlhflab.config import ConfigError, load_config
from rlhflab.infra.runlog import read_jsonl
from rlhflab.models.build import load_tokenizer_for
from rlhflab.models.presets import build_preset
from rlhflab.trainers.dpo import DPOTrainer
from rlhflab.trainers.sft import response_nll, response_nll_parts
from tests.test_grpo_dpo import dpo_cfg


def test_sft_parts_add_up_to_the_batch_loss_and_its_gradient(tmp_path):
    cfg = load_config(overrides=["model.policy=preset:nano"], stage="sft")
    tokenizer = load_tokenizer_for(cfg.model.policy, cfg.model)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_preset("nano", tmp_path / "m")).double()
    # answers of different lengths: the parts are padded to their own width
    pairs = [("copy: cat dog\\nanswer:", " cat dog" * k) for k in (1, 3, 2, 5, 1, 4)]
    whole = response_nll(model, tokenizer, pairs, "cpu")
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    parts = list(response_nll_parts(model, tokenizer, pairs, "cpu", 4))
    assert len(parts) == 2
    for part in parts:
        part.backward()
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)
    for want, p in zip(expected, model.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12)


def test_dpo_in_parts_trains_as_the_whole_batch(tmp_path):
    whole = DPOTrainer(dpo_cfg(tmp_path, "dpo.steps=2", out="whole"))
    whole.fit()
    parts = DPOTrainer(dpo_cfg(tmp_path, "dpo.steps=2", "dpo.micro_batch_size=4", out="parts"))
    parts.fit()
    # fp32 sums in another order; AdamW divides by √v, which makes a weight whose gradient
    # is ~0 move by up to a step (lr 1e-3) on rounding alone: 2 % of a step allowed
    for a, b in zip(whole.policy.state_dict().values(), parts.policy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    first_whole = read_jsonl(tmp_path / "whole" / "metrics.jsonl")[0]
    first_parts = read_jsonl(tmp_path / "parts" / "metrics.jsonl")[0]
    for key in ("loss", "rewards/accuracy", "rewards/margin"):
        assert first_parts[key] == pytest.approx(first_whole[key], abs=1e-6)


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused():
    for stage in ("sft", "dpo"):
        with pytest.raises(ConfigError, match=rf"{stage}.micro_batch_size: 5 does not divide"):
            load_config(
                overrides=[f"{stage}.batch_size=32", f"{stage}.micro_batch_size=5"], stage=stage
            )


def test_the_sft_command_trains_in_parts(tmp_path):
    from rlhflab.app.cli import main

    losses = {}
    for name, extra in (("whole", []), ("parts", ["sft.micro_batch_size=2"])):
        args = ["sft", "model.policy=preset:nano", "sft.examples=20", "sft.batch_size=4"]
        args += ["sft.steps=2", "device=cpu", "log.progress=false", *extra]
        assert main([*args, f"sft.output_dir={tmp_path / name}"]) == 0
        rows = read_jsonl(tmp_path / name / "run" / "metrics.jsonl")
        losses[name] = [r["loss"] for r in rows]
    assert losses["parts"] == pytest.approx(losses["whole"], rel=1e-4)


def test_each_part_runs_under_the_compute_dtype(tmp_path, sdpa_dtypes):
    # the parts' forwards run when supervised_step asks for them, outside the trainer's
    # autocast block: each is computed inside one of its own
    from rlhflab.app.cli import main

    args = ["sft", "model.policy=preset:nano", "sft.examples=20", "sft.batch_size=4"]
    args += ["sft.steps=1", "device=cpu", "log.progress=false", "sft.micro_batch_size=2"]
    args += [
        "model.compute_dtype=bf16",
        "model.runtime=transformers",
        "model.cpu_attention_fp32=false",
    ]
    assert main([*args, f"sft.output_dir={tmp_path / 'bf16'}"]) == 0
    assert sdpa_dtypes and {d for d, _, _ in sdpa_dtypes} == {torch.bfloat16}
