"""`rlhflab memory`: what one iteration adds to the cast, against what the sampler and a
real PPO iteration hold."""

import itertools
import json

import pytest
import torch

from rlhflab import models as M
from rlhflab.config import load_config
from rlhflab.diagnostics.memory import (
    ModelMemory,
    PhaseMemory,
    cache_positions,
    cast_memory,
    iteration_memory,
    kv_cache_bytes,
)
from rlhflab.diagnostics.memory_format import estimated_peak, format_iteration
from rlhflab.diagnostics.tensor_bytes import (
    NewStorages,
    forward_backward_bytes,
    held_by,
    optimizer_held_bytes,
)
from rlhflab.experience.sampling import cache_kwarg, sample
from rlhflab.models.presets import preset_path

KIB = 1024


def test_held_by_counts_what_the_graph_keeps_not_views_or_in_place_results():
    w = torch.nn.Linear(64, 64)  # 16 KiB of weight, not counted: made before
    x = torch.randn(16, 64, requires_grad=True)  # 4 KiB rows

    def chain():
        h = x
        for _ in range(3):
            h = torch.relu(w(h))  # keeps relu's output (4 KiB); the Linear output is freed
        view = h.t()  # a view: no new memory
        view.mul_(1.0)  # in place: no new memory (no backward runs here)
        return h.sum()

    out, held, peak = held_by(chain)
    assert held == 3 * 4 * KIB + 4  # three relu outputs and the float32 sum
    assert peak == 4 * 4 * KIB  # the last Linear's output lived beside the three relu outputs
    del out
    with torch.no_grad():
        _, held, _ = held_by(chain)
    assert held == 4  # without a graph only the result stays


def _cache_tensors(cache) -> list[torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers' DynamicCache
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [*cache.keys, *cache.values]  # the native runtime's KVCache


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_kv_cache_bytes_are_what_the_sampler_holds(runtime):
    path = preset_path("nano")
    tok = M.load_tokenizer(path, runtime=runtime)
    lm = M.load_causal_lm(path, tok, runtime=runtime).eval()
    outs = []
    hook = lm.register_forward_hook(lambda m, a, o: outs.append(o))
    ids = torch.randint(5, 50, (3, 7))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        sample(lm, ids, torch.ones_like(ids), 6, None, tok.pad_token_id, 1.0, 0, 1.0, gen)
    hook.remove()
    cache = getattr(outs[-1], cache_kwarg(lm))
    held = sum(t.untyped_storage().nbytes() for t in _cache_tensors(cache))
    c = lm.config
    positions = cache_positions(7, 6, doubling=runtime == "native")
    assert positions == (14 if runtime == "native" else 12)
    assert held == kv_cache_bytes(
        c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 3, positions, 4
    )


LORA_SMALL = [
    "model.lora_r=4",
    "model.value_model=shared",
    "ppo.micro_batch_size=1",
    "ppo.minibatches=1",
]


def _fixed_length_cfg(tmp_path, *overrides):
    """Every prompt as long as rollout.max_prompt_tokens, all of a batch's prompts distinct
    (the opener probe runs a repeated one once) and no early EOS: the worst case `rlhflab
    memory` plans for is then what the run does."""
    words = ["apple", "banana", "cherry", "kiwi"]
    prompts = [f"copy: {' '.join(w)}\nanswer:" for w in itertools.permutations(words)]
    tok = M.load_tokenizer(preset_path("tiny"))
    lengths = {len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts}
    assert len(lengths) == 1
    n_tokens = lengths.pop()
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    base = {
        "device": "cpu",
        "model": {"policy": "preset:tiny", "value_model": "separate"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "data": {"prompts": str(f)},
        "rollout": {
            "prompts_per_iteration": 8,
            "max_new_tokens": 16,
            "max_prompt_tokens": n_tokens,
            "ignore_eos": True,
        },
        "ppo": {"iterations": 2, "epochs": 2, "minibatches": 2},
        "log": {"output_dir": str(tmp_path / "run"), "progress": False},
    }
    return load_config(base=base, overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["ppo.minibatches=1"],  # the critic's kept graph overlaps the policy's forward
        ["model.value_model=shared"],
        ["model.gradient_checkpointing=true", "model.runtime=native"],
        ["ppo.micro_batch_size=2"],  # gradients accumulate: they exist before each backward
        ["monitor.enabled=false"],
        # a LoRA critic: a bf16 frozen backbone, fp32 adapters and head (issue #26)
        ["model.critic_lora_r=4", "model.reference_precision=bf16"],
        # LoRA, shared head, micro-batches of 1: the opener probe's kept prompt caches set
        # the peak in scoring (two score micro-batches) and, with short answers and long
        # spellings, in the monitor's probe itself (issue #27)
        [*LORA_SMALL, "rollout.score_micro_batch=4"],
        [*LORA_SMALL, "rollout.max_new_tokens=4", "monitor.opener_tokens=8"],
    ],
)
def test_the_estimate_is_what_a_real_iteration_holds_at_its_peak(tmp_path, overrides):
    from rlhflab.trainers.ppo import PPOTrainer

    cfg = _fixed_length_cfg(tmp_path, *overrides)
    trainer = PPOTrainer(cfg)
    models = cast_memory(trainer.cast)
    phases = iteration_memory(trainer.cast, cfg)
    estimate, _ = estimated_peak(models, phases)

    trainer.step()  # the first iteration creates the optimiser moments
    before = sum(m.weights for m in models) + optimizer_held_bytes(trainer.opt, trainer.critic_opt)
    tracker = NewStorages()
    with tracker:
        trainer.step()
    actual = before + tracker.peak
    # the same shapes as the run: off by at most small tensors (the rollout, statistics)
    assert abs(estimate / actual - 1) < 0.02, (estimate, actual, phases)


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_checkpointing_shrinks_what_the_forward_keeps_and_backward_restores_no_gradients(
    runtime,
):
    from rlhflab.experience.rollout import policy_outputs

    path = preset_path("tiny")
    tok = M.load_tokenizer(path, runtime=runtime)
    seqs = torch.randint(5, 400, (4, 48))

    def measured(checkpointing: bool) -> tuple[int, int]:
        lm = M.load_causal_lm(path, tok, runtime=runtime).train()
        if checkpointing:
            M.enable_gradient_checkpointing(lm)
        out = forward_backward_bytes(
            lambda: policy_outputs(lm, seqs, torch.ones_like(seqs), 16, seqs[:, 16:], 1.0),
            lm,
            gradients_exist=False,
        )
        assert all(q.grad is None for q in lm.parameters())
        return out

    (kept, peak), (kept_ckpt, peak_ckpt) = measured(False), measured(True)
    assert kept_ckpt < 0.3 * kept and peak_ckpt < peak


def test_the_table_names_the_knobs_only_when_the_opener_probe_sets_the_peak():
    models = [ModelMemory("policy", weights=100, trainable=100, gradients=100, optimizer=200)]
    probe = PhaseMemory("monitor", "opener probe", 1000, measured=True)
    training = PhaseMemory("training", "fwd+bwd", 500, measured=True, gradients_of=("policy",))
    assert "monitor.flattery_opener_ratio=null" in format_iteration([probe, training], models)
    small = PhaseMemory("monitor", "opener probe", 10, measured=True)
    text = format_iteration([small, training], models)
    assert "in training" in text and "flattery_opener_ratio" not in text


def test_the_estimate_says_what_it_leaves_out(nano_rm, capsys):
    """A reward-model refresh added ~600 MiB to a measured run while `rlhflab memory`
    printed the same as without it: what it does not count is now said."""
    from rlhflab.app.cli import main

    args = ["memory", "model.policy=preset:nano", f"reward.model={nano_rm}"]
    assert main(args) == 0
    assert "not counted" not in capsys.readouterr().out
    assert main([*args, "reward.refresh_every=2"]) == 0
    out = capsys.readouterr().out
    assert "not counted: reward.refresh_every=2 fine-tunes the reward model(s)" in out
    assert "reward.refresh_batch_size=" in out


def test_the_models_table_needs_no_reward_setting(nano_rm, capsys):
    """`rlhflab memory` printed only 'set reward.model, …' for a config without a reward: the
    policy's, reference's and critic's bytes do not depend on it."""
    from rlhflab.app.cli import main

    assert main(["memory", "model.policy=preset:nano", "model.reward_precision=int8"]) == 0
    out = capsys.readouterr().out
    assert "reward: none set, so no reward model is counted" in out
    assert "model.reward_precision=int8: no reward model to hold" in out  # not silently
    rows = [line.split()[0] for line in out.splitlines() if line[:1].isalpha()]
    assert {"policy", "reference", "critic"} <= set(rows) and "reward" not in rows
    assert main(["memory", "model.policy=preset:nano", f"reward.model={nano_rm}"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line[:1].isalpha()]
    assert "none set" not in out and "reward" in rows


def test_a_forward_that_cannot_fit_is_refused_not_measured(monkeypatch, capsys):
    # measuring it would allocate it: a config asked about because it may not fit took the
    # machine down (100,000 prompts in one minibatch)
    from rlhflab.app.cli import main
    from rlhflab.diagnostics import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**20)  # 1 MiB free
    sizes = ["model.policy=preset:nano", "rollout.max_new_tokens=8", "rollout.score_micro_batch=2"]
    assert main(["memory", *sizes, "rollout.prompts_per_iteration=256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # the scoring micro-batch of 2 fits; one minibatch of 256 answers does not
    assert err.startswith("error: ppo.minibatches: one forward over 256 answers would hold"), err
    assert "raise it, or set ppo.micro_batch_size" in err
    over = [*sizes, "ppo.micro_batch_size=128", "rollout.prompts_per_iteration=256"]
    assert main(["memory", *over]) == 2
    assert "error: ppo.micro_batch_size: one forward over 128" in capsys.readouterr().err
    over = [*sizes, "rollout.score_micro_batch=128", "rollout.prompts_per_iteration=256"]
    assert main(["memory", *over]) == 2  # scoring is checked first
    assert "error: rollout.score_micro_batch: one forward over 128" in capsys.readouterr().err
    # and an estimate larger than the machine has is said, not only printed as a number
    from rlhflab.diagnostics.memory_format import fit_line

    monkeypatch.setattr(memory, "rss_bytes", lambda: 2**20)
    assert fit_line("cpu", 2**21) is None  # 1 MiB free + 1 MiB held
    assert fit_line("cpu", 3 * 2**20).startswith("does not fit here: the estimated peak")


def test_the_fit_check_extrapolates_without_multiplying_what_a_forward_holds_once():
    # a tied embedding's dense gradient exists once per backward: one row's peak times the
    # rows would refuse a normal config of a real model (~1 GB a row for a 0.5B model)
    from rlhflab.diagnostics.memory import extrapolate

    torch.manual_seed(0)
    emb = torch.nn.Embedding(2000, 256)
    head = torch.nn.Linear(256, 2000, bias=False)
    head.weight = emb.weight  # tied

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = emb, head

    model = Tied()

    def peak(rows):
        ids = torch.randint(0, 2000, (rows, 24))
        return forward_backward_bytes(lambda: (head(emb(ids)).log_softmax(-1),), model, False)[1]

    guess, real = extrapolate(peak(1), peak(2), 16), peak(16)
    assert abs(guess - real) < 0.1 * real, (guess, real)
    assert 16 * peak(1) > 1.5 * real  # what one row's peak times the rows would have said
