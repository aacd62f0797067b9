"""Guards that outside testing (stop 46) found missing: an adaptive β that could turn
negative, a run folder that cannot be written failing as a traceback, and child processes
(compare's methods, a sweep's workers) that outlived a parent killed by a signal."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest

from rlhflab.config import ConfigError, load_config
from rlhflab.core.algorithms import AdaptiveKLController
from rlhflab.infra import run_lock

REWARD = {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}


def ppo(*overrides):
    return load_config(base={"reward": REWARD}, overrides=list(overrides))


def test_an_adaptive_horizon_that_could_make_beta_negative_is_refused():
    # β ← β·(1 + e·n/horizon), e ≥ −0.2: with 64 answers and a horizon of 10, β went
    # 0.02 → −0.0056, the KL penalty a bonus
    with pytest.raises(ConfigError, match=r"ppo.kl_horizon: 10 answers .* above 12\.8"):
        ppo("rollout.prompts_per_iteration=64", "ppo.kl_target=6", "ppo.kl_horizon=10")
    ppo("rollout.prompts_per_iteration=64", "ppo.kl_target=6", "ppo.kl_horizon=13")
    with pytest.raises(ConfigError, match="ppo.kl_coef: the adaptive controller"):
        ppo("ppo.kl_target=0.001", "ppo.kl_coef=0")
    ppo("ppo.kl_coef=0")  # a fixed β of 0 is allowed: no KL penalty, asked for
    ctl = AdaptiveKLController(0.02, 100.0, 1.0)
    with pytest.raises(ValueError, match="β × -0.6; kl_horizon must exceed 0.2 × 8"):
        ctl.update(0.0, 8)  # the trainer's own guard, should a config slip past
    assert ctl.value == 0.02


def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    # an existing folder the user cannot write (chattr +i, a read-only mount): the lock
    # file's open failed as a bare FileNotFoundError/PermissionError traceback
    real_open = os.open

    def refuse(path, flags, *args):
        if str(path).endswith(run_lock.LOCK_NAME):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    monkeypatch.setattr(run_lock.os, "open", refuse)
    with pytest.raises(ConfigError, match=r"log.output_dir: .*run cannot be written \(Read-only"):
        with run_lock.run_lock(tmp_path / "run"):
            pass


def test_a_lock_file_that_can_be_neither_made_nor_read_is_one_line(tmp_path, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *args):
        if str(path).endswith(run_lock.LOCK_NAME):
            if flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, "Permission denied")
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        return real_open(path, flags, *args)

    monkeypatch.setattr(run_lock.os, "open", refuse)
    with pytest.raises(ConfigError, match=r"run cannot be written \(No such file"):
        with run_lock.run_lock(tmp_path / "a" / "run"):
            pass
    assert not (tmp_path / "a").exists()  # the folders this call made are gone again


def test_a_run_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    def refuse(self, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match=r"log.output_dir: .*new cannot be written \(Perm"):
        with run_lock.run_lock(tmp_path / "new"):
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_child_ends_when_its_parent_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from rlhflab.infra.child_process import ends_with_parent\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " preexec_fn=ends_with_parent())\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(60)\n",
        ]
    )
    deadline = time.time() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()  # SIGKILL: nothing in the parent runs
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """A process that is neither gone nor a zombie (an orphan is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_logger_asked_for_without_its_package_is_refused_before_models_load(
    tmp_path, monkeypatch
):
    # it only warned, and a run of hours then had no curves where the user would look
    import importlib.util

    from rlhflab.trainers.ppo import PPOTrainer

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    cfg = ppo("log.wandb=true", f"log.output_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match="log.wandb: the wandb package is not installed"):
        PPOTrainer(cfg)


def test_every_error_class_rlhflab_defines_is_an_rlhflab_error():
    # "except rlhflab.RlhflabError catches them all": a new ValueError subclass (as
    # UndrawableLogits was) escaped it, and a sweep's trial catch with it
    import ast
    from pathlib import Path

    import rlhflab

    builtin = {"ValueError", "RuntimeError", "OSError", "Exception", "TypeError", "KeyError"}
    missing = []
    for path in Path(rlhflab.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                not isinstance(node, ast.ClassDef)
                or node.name in ("RlhflabError",)
                or node.name.startswith("_")
            ):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if bases & builtin and "RlhflabError" not in bases:
                missing.append(f"{path.name}:{node.name}")
    assert not missing, missing


def test_rm_is_refused_in_a_held_folder_before_its_model_loads(tmp_path, monkeypatch):
    # `rlhflab rm` met the lock (and a missing logger) only once its run started, after
    # the model had loaded; the other trainers before
    from rlhflab.trainers import rm

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(rm, "load_model", no_model)
    cfg = load_config(
        stage="rm",
        overrides=["model.policy=preset:nano", "rm.pairs=40", f"rm.output_dir={tmp_path / 'rm'}"],
    )
    with run_lock.run_lock(tmp_path / "rm" / "run", "rm.output_dir"):
        with pytest.raises(ConfigError, match="rm.output_dir: another rlhflab run"):
            rm.rm_trainer(cfg)
