"""The documented command under torchrun itself (its agent, two CPU ranks on gloo): each rank
on the allocator, a user error said once, and an error one rank meets alone ending the run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_runs_under_torchrun_each_rank_on_the_allocator(tmp_path):
    # the documented way past one process: torchrun -m rlhflab ...; each rank re-executes
    # itself once onto mimalloc (same PID, so torchrun keeps watching it)
    from rlhflab.backends.allocator import mimalloc_library

    config = tmp_path / "ppo.yaml"
    config.write_text(
        "device: cpu\n"
        "model: {policy: 'preset:nano', value_model: separate}\n"
        "reward: {functions: {'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}}\n"
        "rollout: {prompts_per_iteration: 8, max_new_tokens: 6}\n"
        "ppo: {iterations: 2, epochs: 1, minibatches: 1}\n"
        f"log: {{output_dir: '{tmp_path / 'run'}', progress: false}}\n"
    )
    # an empty preset cache: both ranks build preset:nano at once, after torch.distributed
    # is up (transformers' save_pretrained writes nothing on rank 1 then: presets.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHFLAB_CACHE": str(tmp_path / "cache")}
    env.pop("RLHFLAB_ALLOCATOR_STARTED", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", "rlhflab", "ppo", "--config", str(config)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-12000:]
    expected = "mimalloc" if mimalloc_library() else "system"
    assert done.stderr.count(f"allocator: {expected}") == 2, done.stderr[-4000:]
    assert f"[rank 1] allocator: {expected}" in done.stderr
    # what the run does is said once, by rank 0 (each rank said it before)
    assert done.stderr.count("cast built") == 1, done.stderr[-4000:]
    assert done.stdout.count("done: 2 iterations") == 1, done.stdout[-2000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_user_error_on_two_ranks_is_said_once_without_a_traceback(tmp_path):
    # every rank meets the same config refusal (here the per-rank split, before any model
    # loads): rank 0 prints the one line, the others none; each leaves without the barrier
    vowel = "rlhflab.builtin.toy_rewards:vowel_reward"
    done = _ppo_on_two_ranks(tmp_path, vowel, prompts=6, tokens=6, iterations=2, minibatches=2)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "ppo.minibatches" in ours[0], done.stderr[-4000:]
    # no traceback through rlhflab's code (torchrun's own report of a failed child may follow)
    assert not any('File "' in ln and "rlhflab/" in ln for ln in done.stderr.splitlines())
    assert "terminate called" not in done.stderr


def test_an_error_on_one_rank_alone_ends_the_run_with_its_line(tmp_path):
    """A reward function that raises on rank 1's answers only: rank 1 used to wait in the
    exit barrier for rank 0, which waited for it in the iteration's collective — a silent
    hang until gloo's 30-minute timeout. Now the failed rank says its error and exits, and
    torchrun ends the other."""
    (tmp_path / "flaky.py").write_text(
        "import os\n"
        "calls = []\n"
        "def reward(prompts, responses):\n"
        "    calls.append(1)\n"
        "    if os.environ['RANK'] == '1' and len(calls) == 2:\n"
        "        raise ValueError('reward service down')\n"
        "    return [0.0] * len(responses)\n"
    )
    done = _ppo_on_two_ranks(tmp_path, "flaky:reward", prompts=8, tokens=4, iterations=4)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(ours) == 1 and ours[0].startswith(
        "error (rank 1): reward function flaky:reward raised ValueError: reward service down (at "
    ), done.stderr[-4000:]
    assert ours[0].endswith("flaky.py:6, in reward)"), ours


def _ppo_on_two_ranks(
    tmp_path, reward: str, prompts: int, tokens: int, iterations: int, minibatches: int = 1
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m rlhflab ppo` on preset:nano with the reward function
    ``reward`` (importable from ``tmp_path``, the working folder), run to its end."""
    config = tmp_path / "ppo.yaml"
    config.write_text(
        "device: cpu\n"
        "model: {policy: 'preset:nano', value_model: separate}\n"
        f"reward: {{functions: {{'{reward}': 1.0}}}}\n"
        f"rollout: {{prompts_per_iteration: {prompts}, max_new_tokens: {tokens}}}\n"
        f"ppo: {{iterations: {iterations}, epochs: 1, minibatches: {minibatches}}}\n"
        f"log: {{output_dir: '{tmp_path / 'run'}', progress: false}}\n"
    )
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RLHFLAB_ALLOCATOR": "system"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", "rlhflab", "ppo", "--config", str(config)]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
