"""Data parallel PPO and GRPO on two CPU ranks (gloo), the ranks started as torchrun starts
them (the command under torchrun itself: test_torchrun.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "dist_worker.py")


def _worker_env() -> dict:
    # faulthandler: a rank that aborts in C++ (SIGABRT) still prints every Python thread's
    # stack, so a failure says where the rank was (mid-run or at interpreter exit)
    # this checkout's src/ first: the venv's editable install may point at another worktree
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def ranks(n, *args, fails=False, timeout=600):
    """Run tests/dist_worker.py on ``n`` ranks as torchrun starts them — one process per
    rank with the variables torchrun sets and rlhflab and torch.distributed read (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the first failure
    ending the others as torchrun's agent does — without torchrun's agent process, which
    costs ~2 s a launch on 2 cores (a 2-rank no-op: 4.1 s under torchrun, 1.8 s so); the
    tests of the documented command run torchrun itself. It must succeed (or, with
    ``fails``, must fail; a run that hangs past ``timeout`` fails the test either way).
    Returns the finished run: its exit status (the first failing rank's), and each stream
    of every rank, headed by the rank."""
    with socket.socket() as s:  # a free port for the group's store, as --standalone finds
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _worker_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n))
    env.update(LOCAL_WORLD_SIZE=str(n))
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(n)]
    procs, code, hung = [], 0, False
    deadline = time.monotonic() + timeout
    try:
        for r, (out, err) in enumerate(logs):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            cmd = [sys.executable, WORKER, *args]
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=err, text=True))
        while True:
            states = [p.poll() for p in procs]  # every rank, every time
            failed = [c for c in states if c not in (None, 0)]
            if failed or None not in states:
                code = failed[0] if failed else 0
                break
            if time.monotonic() > deadline:
                hung = True
                for p in procs:  # faulthandler prints each thread's stack on SIGABRT
                    if p.poll() is None:
                        p.send_signal(signal.SIGABRT)
                time.sleep(5)
                break
            time.sleep(0.05)
    finally:  # a rank left waiting at a collective would never return (nor on Ctrl-C)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    # each rank's own tail, so that one rank's long output cannot hide another's error
    texts = []
    for stream, keep in ((0, 4000), (1, 12000)):
        parts = []
        for r, files in enumerate(logs):
            files[stream].seek(0)
            parts.append(f"[rank {r}]\n{files[stream].read()[-keep:]}")
            files[stream].close()
        texts.append("\n".join(parts))
    what = f"{n} ranks of {' '.join(args)}"
    if hung or (code != 0) != fails:
        status = f"still running after {timeout} s" if hung else f"exited {code}"
        pytest.fail(
            f"{what} {status}\n--- stdout ---\n{texts[0]}\n--- stderr ---\n{texts[1]}",
            pytrace=False,  # not through an assertion's repr, which pytest shortens
        )
    return subprocess.CompletedProcess(procs[0].args, code, texts[0], texts[1])


@pytest.mark.parametrize(
    "answers, world, minibatches, micro, group, per_rank_minibatch",
    [
        (16, 1, 4, None, 1, 4),
        (16, 2, 4, None, 1, 2),
        (16, 4, 4, None, 1, 1),
        (16, 4, 2, 1, 4, 2),  # whole GRPO groups of 4 per rank, minibatches may cut them
        (24, 2, 3, 2, 1, 4),
        (8, 4, 1, 4, 1, 2),  # a micro-batch larger than a rank's minibatch: one per step
    ],
)
def test_each_rank_gets_the_same_number_of_equal_minibatches(
    answers, world, minibatches, micro, group, per_rank_minibatch
):
    from rlhflab.infra.distributed import rank_split

    # every rank takes ppo.minibatches optimiser steps per epoch, as a single process does
    assert rank_split(answers, world, minibatches, micro, group) == per_rank_minibatch


@pytest.mark.parametrize(
    "answers, world, minibatches, micro, group, field",
    [
        (12, 2, 4, None, 1, "ppo.minibatches"),  # 6 per rank: was 6 steps of 1 per epoch
        (8, 2, 8, None, 1, "ppo.minibatches"),  # 4 per rank: was a division by zero
        (16, 4, 8, None, 1, "ppo.minibatches"),
        (10, 4, 1, None, 1, "rollout.prompts_per_iteration"),
        (12, 2, 1, None, 4, "grpo.group_size"),  # 6 per rank: a group split over two ranks
        (12, 2, 1, 4, 1, "ppo.micro_batch_size"),  # divides 12, not the 6 each rank holds
    ],
)
def test_a_batch_that_does_not_split_evenly_over_ranks_is_refused(
    answers, world, minibatches, micro, group, field
):
    from rlhflab.config import ConfigError
    from rlhflab.infra.distributed import rank_split

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        rank_split(answers, world, minibatches, micro, group)
    assert f"{world} rank" in str(err.value)


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_two_ranks_and_one_rank_make_the_same_first_update(tmp_path, runtime):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    ranks(1, "equiv", str(one), f"model.runtime={runtime}")
    ranks(2, "equiv", str(two), f"model.runtime={runtime}")
    a, b = torch.load(one), torch.load(two)
    from rlhflab import models as M
    from rlhflab.models.presets import preset_path

    start = M.load_causal_lm(preset_path("nano"), M.load_tokenizer(preset_path("nano")))
    moved = max((a["policy"][k] - v).abs().max().item() for k, v in start.state_dict().items())
    diff = max((a["policy"][k] - b["policy"][k]).abs().max().item() for k in a["policy"])
    critic_diff = max((a["critic"][k] - b["critic"][k]).abs().max().item() for k in a["critic"])
    assert moved > 1e-3  # the update is real ...
    assert diff < 1e-5 and critic_diff < 1e-5  # ... and the same whatever the rank layout


def test_a_centred_reward_ensemble_makes_the_same_update_on_two_ranks(tmp_path):
    # each rank's reference answers differ; the members' means are averaged over ranks,
    # so both ranks centre, and combine, as one rank does on the whole batch
    from rlhflab.config import load_config
    from rlhflab.trainers.rm_ensemble import train_rm

    rm = ["model.policy=preset:nano", "threads=1", "rm.steps=3", "rm.pairs=24"]
    rm += ["rm.batch_size=4", "rm.ensemble_size=2", f"rm.output_dir={tmp_path / 'rm'}"]
    members = train_rm(load_config(overrides=[*rm, "log.progress=false"], stage="rm"))["ensemble"]
    reward = ["reward.functions={}", f"reward.ensemble={json.dumps(members)}"]
    reward.append("reward.ensemble_combine=wco")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    ranks(1, "equiv", str(one), *reward)
    ranks(2, "equiv", str(two), *reward)
    a, b = torch.load(one), torch.load(two)
    diff = max((a["policy"][k] - b["policy"][k]).abs().max().item() for k in a["policy"])
    assert diff < 1e-5


def test_a_lora_critic_under_ddp_makes_the_same_update_as_on_one_rank(tmp_path, monkeypatch):
    """model.critic_lora_r (issue #26) under DDP: frozen backbone, adapters and head."""
    import rlhflab.trainers.ppo as ppo_module
    from tests.dist_worker import config, fixed_rollout

    # two updates: the zero-initialised head passes no gradient to the adapters in the first
    over = ("model.critic_lora_r=4", "ppo.epochs=2")
    ranks(2, "equiv", str(tmp_path / "two.pt"), *over, "dist.strategy=ddp")
    monkeypatch.setattr(ppo_module, "generate_rollout", fixed_rollout)  # as the worker does
    one = ppo_module.PPOTrainer(config(str(tmp_path / "one"), *over))
    one.fit()
    a, b = one.cast.critic.state_dict(), torch.load(tmp_path / "two.pt")["critic"]
    trained = [k for k in a if "lora_B" in k or "modules_to_save" in k]
    assert len(trained) > 2 and all(a[k].abs().max() > 1e-4 for k in trained)  # each learnt
    worst = max(a, key=lambda k: (a[k] - b[k]).abs().max().item())
    assert (a[worst] - b[worst]).abs().max().item() < 1e-5, worst


def test_a_rank_whose_gloo_threads_outlive_the_group_still_exits_cleanly(tmp_path):
    # CI saw a finished 2-rank FSDP run abort at interpreter exit ("terminate called
    # without an active exception"): gloo's threads released tensors during teardown.
    # Collectives still queued make it likely on a busy machine (the old ending, barrier +
    # destroy_process_group, aborted 2 runs of 6 under load; on an idle machine it rarely
    # does, so this catches a regression only under load). exit_without_teardown leaves no
    # teardown for the threads to race
    for _ in range(3):
        ranks(2, "late", str(tmp_path / "late"))


def test_all_gather_cat_joins_rank_tensors_in_rank_order(tmp_path):
    # the opener probe's ratio of means is taken over these gathered per-prompt values
    ranks(2, "gather", str(tmp_path / "g.pt"))
    assert torch.load(tmp_path / "g.pt").tolist() == [0.0, 10.0, 1.0, 11.0]


@pytest.mark.parametrize("runtime", ["transformers", "native"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_run_trains_checkpoints_and_resumes(tmp_path, strategy, runtime):
    run, straight = tmp_path / strategy, tmp_path / "straight"
    over = (f"dist.strategy={strategy}", f"model.runtime={runtime}")
    ranks(2, "run", str(run), *over, "ppo.iterations=2")
    assert (run / "checkpoints" / "step-2" / "policy" / "config.json").exists()
    ranks(2, "run-reads", str(run), *over, "ppo.iterations=3")
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # only rank 0 writes, once each
    assert f"runtime: {runtime}" in (run / "config.yaml").read_text()
    step3 = run / "checkpoints" / "step-3"
    state = torch.load(step3 / "state.pt", weights_only=True)
    assert state["world"] == 2 and len(state["rng"]) == 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(step3 / "policy")
    # the resumed run is the run that was never stopped, bit for bit
    ranks(2, "run", str(straight), *over, "ppo.iterations=3")
    _assert_same_checkpoint(step3, straight / "checkpoints" / "step-3")
    again = [json.loads(ln) for ln in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [_untimed(r) for r in again] == [_untimed(r) for r in rows]
    reads = [json.loads((run / f"reads-{r}.json").read_text()) for r in (0, 1)]
    if strategy == "fsdp":  # rank 0 reads the weights and moments and sends rank 1 its shards
        assert sorted(reads[0]) == sorted(
            f"checkpoints/step-2/{f}" for f in ("policy", "critic", "state.pt", "optimizer.pt")
        )
        assert reads[1] == ["checkpoints/step-2/state.pt"]
    else:  # replicated: each rank needs all of it
        assert (
            reads[0]
            == reads[1]
            == ["checkpoints/step-2/state.pt", "checkpoints/step-2/optimizer.pt"]
        )


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/"))}


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(f.relative_to(a) for f in a.rglob("*.safetensors"))
    assert files and files == sorted(f.relative_to(b) for f in b.rglob("*.safetensors"))
    for f in files:
        wa, wb = load_file(a / f), load_file(b / f)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f
    oa = torch.load(a / "optimizer.pt", weights_only=True)
    ob = torch.load(b / "optimizer.pt", weights_only=True)
    flat = lambda x: torch.utils._pytree.tree_leaves(x)  # noqa: E731
    assert len(flat(oa)) == len(flat(ob)) > 0
    for x, y in zip(flat(oa), flat(ob)):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_a_shared_backbone_under_fsdp_trains_as_on_one_rank_and_resumes(tmp_path, runtime):
    # sampling calls the language model and scoring the backbone without the root's
    # forward: both must find their parameters gathered (they met them sharded until
    # 2026-12-05, "aten.embedding got mixed torch.Tensor and DTensor")
    over = ("model.value_model=shared", "dist.strategy=fsdp", f"model.runtime={runtime}")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    ranks(1, "equiv", str(one), *over)
    ranks(2, "equiv", str(two), *over)
    a, b = torch.load(one)["policy"], torch.load(two)["policy"]
    assert any(k.startswith("value_head.") for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    run, straight = tmp_path / "run", tmp_path / "straight"
    ranks(2, "run", str(run), *over, "ppo.iterations=2")
    ranks(2, "run", str(run), *over, "ppo.iterations=3")
    ranks(2, "run", str(straight), *over, "ppo.iterations=3")
    step3 = run / "checkpoints" / "step-3"
    assert (step3 / "value_head.safetensors").exists()
    _assert_same_checkpoint(step3, straight / "checkpoints" / "step-3")


def test_a_sharded_reference_scores_and_samples(tmp_path):
    # dist.shard_reference: the frozen reference sharded too, called for its log-probs and,
    # with monitor.reference_every, to sample the monitor's reference answers
    run = tmp_path / "ref"
    over = ("dist.strategy=fsdp", "dist.shard_reference=true", "monitor.reference_every=1")
    ranks(2, "run", str(run), *over, "ppo.iterations=2")
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("monitor/length_ratio" in r for r in rows)


def test_numpy_matmul_under_fsdp(tmp_path):
    # FSDP2 resizes the gathered weights' storages, which numpy's products must leave alone
    run = tmp_path / "numpy"
    ranks(2, "run", str(run), "dist.strategy=fsdp", "model.cpu_matmul=numpy")
    assert (run / "checkpoints" / "step-1" / "state.pt").exists()


@pytest.mark.parametrize(
    "over, message",
    [
        (
            (
                "dist.strategy=fsdp",
                "model.value_model=shared",
                "rollout.logprobs_from_sampling=true",
            ),
            "rollout.logprobs_from_sampling: with a shared backbone under fsdp",
        ),
        (("ppo.max_grad_norm=null", "ppo.step_in_backward=true"), "ppo.step_in_backward: with"),
        (("dist.strategy=fsdp", "model.critic_lora_r=4"), "dist.strategy: LoRA with fsdp"),
        # 6 answers per rank in 4 minibatches: 6 optimiser steps per epoch instead of 4
        (("rollout.prompts_per_iteration=12", "ppo.minibatches=4"), "ppo.minibatches: 4"),
    ],
)
def test_settings_that_do_not_fit_two_ranks_are_refused(tmp_path, over, message):
    done = ranks(2, "run", str(tmp_path / "run"), *over, fails=True)
    assert message in done.stderr


def test_a_ddp_checkpoint_resumed_under_fsdp_is_refused_before_training(tmp_path):
    # FSDP reads its full optimiser state by name, DDP's is by position: it trained on and
    # failed at the next checkpoint
    run = tmp_path / "run"
    ranks(2, "run", str(run), "dist.strategy=ddp")
    refused = "dist.strategy is 'fsdp', but the checkpoint was written under 'ddp'"
    for old in (False, True):
        if old:  # a checkpoint from before state.pt recorded it: the run's config.yaml says
            state = run / "checkpoints" / "step-1" / "state.pt"
            saved = torch.load(state, weights_only=True)
            torch.save({k: v for k, v in saved.items() if k != "strategy"}, state)
        done = ranks(2, "run", str(run), "dist.strategy=fsdp", "ppo.iterations=2", fails=True)
        assert refused in done.stderr
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # nothing trained


def test_every_rank_builds_a_whole_preset(tmp_path):
    # transformers 5's save_pretrained writes nothing on ranks other than 0 once
    # torch.distributed is up; a preset built there must still have its model
    ranks(2, "preset", str(tmp_path))
    for rank in (0, 1):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in (tmp_path / f"rank-{rank}").iterdir()
        }


@pytest.mark.parametrize(
    "runtime, strategy, checkpointing",
    [("transformers", "ddp", "false"), ("native", "fsdp", "true")],
)
def test_grpo_runs_on_two_ranks(tmp_path, runtime, strategy, checkpointing):
    run = tmp_path / "grpo"
    over = (
        f"model.runtime={runtime}",
        f"dist.strategy={strategy}",
        f"model.gradient_checkpointing={checkpointing}",
    )
    ranks(2, "grpo", str(run), "ppo.iterations=2", *over)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_keep_best_saves_on_every_rank_together(tmp_path, strategy):
    """log.keep_best decides on the gold reward averaged over ranks, so every rank joins
    the collective save of checkpoints/best at the same iteration (else the run hangs)."""
    run = tmp_path / strategy
    gold = "monitor.gold=rlhflab.builtin.toy_rewards:vowel_reward"
    ranks(2, "run", str(run), f"dist.strategy={strategy}", gold, "ppo.iterations=3")
    story = json.loads((run / "run.json").read_text())["gold"]
    state = torch.load(run / "checkpoints" / "best" / "state.pt", weights_only=True)
    assert state["world"] == 2 and state["iteration"] == story["best_iteration"] - 1
    assert story["best_checkpoint"] == str(run / "checkpoints" / "best")


def test_fsdp_resumes_a_model_whose_weights_transformers_renames_on_save(tmp_path):
    """GPT-NeoX saves its head as embed_out, holds it as lm_head: rank 0 reads a sharded
    run's checkpoint back under the model's own names (checkpoint.read_weights_for)."""
    from tests.test_real_architectures import build

    folder = build("neox", tmp_path / "neox")
    run, straight = tmp_path / "run", tmp_path / "straight"
    over = ("dist.strategy=fsdp", "model.runtime=transformers", f"model.policy={folder}")
    ranks(2, "run", str(run), *over, "ppo.iterations=2")
    ranks(2, "run", str(run), *over, "ppo.iterations=3")
    ranks(2, "run", str(straight), *over, "ppo.iterations=3")
    _assert_same_checkpoint(run / "checkpoints" / "step-3", straight / "checkpoints" / "step-3")
