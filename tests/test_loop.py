"""RunLoop, the run around any trainer, on a job with no model: cadence, stop, resume."""

import shutil

import yaml

from rlhflab.config import LogConfig
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.loop import RunLoop


class CountingJob:
    """A supervised-style job: step() returns a loss; its state is the step count."""

    def __init__(self, run_dir, stop_after=None):
        self.run_dir, self.stop_after = run_dir, stop_after
        self.iteration = 0
        self.stop_reason = None
        self.saved, self.loaded = [], []

    def step(self):
        if self.stop_after is not None and self.iteration + 1 >= self.stop_after:
            self.stop_reason = "enough"
        return {"loss": 1.0 / (self.iteration + 1)}

    def save(self, step):
        path = self.run_dir / "checkpoints" / f"step-{step}"
        path.mkdir(parents=True)
        (path / "state.yaml").write_text(yaml.safe_dump({"iteration": self.iteration}))
        self.saved.append(step)
        return path

    def load_checkpoint(self, path):
        self.iteration = yaml.safe_load((path / "state.yaml").read_text())["iteration"]
        self.loaded.append(path.name)


def newest(run_dir, set_aside):
    """The job's own checkpoints (state.yaml, not rlhflab's format): the newest by step."""
    found = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    return found[-1] if found else None


def loop(run_dir, total=5, **kw):
    log = LogConfig(output_dir=str(run_dir), progress=False, checkpoint_every=2, sample_every=2)
    return RunLoop(run_dir, total, log, {"seed": 7}, "Test", latest=newest, **kw)


def test_runs_to_the_total_logging_each_step_and_checkpointing_on_cadence_and_at_the_end(
    tmp_path,
):
    job = CountingJob(tmp_path)
    samples = []
    done = loop(tmp_path, samples=lambda n: samples.append(n) or [{"text": "hi"}]).run(job)
    assert (done.steps, done.stop_reason, done.last) == (5, None, {"loss": 1 / 5})
    assert job.saved == [2, 4, 5]
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    # steps 2 and 4, and the last (a run shorter than log.sample_every had none)
    assert [r["iteration"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [2, 4, 5]
    assert samples == [4, 4, 4]  # log.samples_per_log each
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"seed": 7}


def test_a_stop_reason_ends_the_run_with_a_checkpoint(tmp_path):
    job = CountingJob(tmp_path, stop_after=3)
    done = loop(tmp_path, samples=lambda n: [{"text": "hi"}]).run(job)
    assert (done.steps, done.stop_reason) == (3, "enough")
    assert job.saved == [2, 3]
    # the answers it stopped on are logged too
    assert [r["iteration"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [2, 3]


def test_step_hooks_see_every_step_the_stopping_one_too_and_can_stop_a_run(tmp_path):
    seen = []
    job = CountingJob(tmp_path, stop_after=3)
    job.step_hooks = [lambda step, metrics: seen.append(step)]
    assert loop(tmp_path).run(job).steps == 3 and seen == [1, 2, 3]

    def stop_at_two(step, metrics):
        return step == 2

    job = CountingJob(tmp_path / "b")
    job.step_hooks = [stop_at_two]
    done = loop(tmp_path / "b").run(job)
    assert done.steps == 2 and "stop_at_two" in done.stop_reason and job.saved[-1] == 2


def test_resume_starts_after_the_newest_checkpoint_and_appends_to_the_log(tmp_path):
    loop(tmp_path, total=3).run(CountingJob(tmp_path))
    again = CountingJob(tmp_path)
    done = loop(tmp_path, total=5).run(again, resume=True)
    assert again.loaded == ["step-3"] and again.saved == [4, 5] and done.steps == 5
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    fresh = CountingJob(tmp_path / "empty")
    assert loop(tmp_path / "empty", total=1).run(fresh, resume=True).steps == 1
    assert fresh.loaded == []


def test_a_resume_of_a_finished_run_returns_its_last_logged_metrics(tmp_path):
    # it returned {}: `rlhflab dpo --resume` of a finished run died on a KeyError in its
    # closing line, and train() from Python gave an empty "last"
    loop(tmp_path, total=3).run(CountingJob(tmp_path))
    again = CountingJob(tmp_path)
    done = loop(tmp_path, total=3).run(again, resume=True)
    assert again.loaded == ["step-3"] and again.saved == [] and done.steps == 3
    assert done.last == {"loss": 1 / 3}
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_only_the_main_rank_writes_files(tmp_path):
    job = CountingJob(tmp_path)
    loop(tmp_path / "out", total=1, is_main=False).run(job)
    assert not (tmp_path / "out").exists() and job.saved == [1]


def test_resume_names_each_setting_that_changed(tmp_path, caplog):
    import logging

    loop(tmp_path).run(CountingJob(tmp_path))
    changed = RunLoop(
        tmp_path,
        6,  # a step left to run (a finished run's record stays: test_guards_stop48)
        LogConfig(output_dir=str(tmp_path), progress=False, checkpoint_every=2),
        {"seed": 8, "ppo": {"lr": 1e-5}},
        "Test",
        latest=newest,
    )
    with caplog.at_level(logging.WARNING):
        changed.run(CountingJob(tmp_path), resume=True)
    assert "the config differs from the run's: seed: 7 → 8" in caplog.text
    assert "ppo: '<unset>' → {'lr': 1e-05}" in caplog.text
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["seed"] == 8  # the new one
    # and the settings the first steps ran with stay on record
    (kept,) = tmp_path.glob("config.until-step-*.yaml")
    assert yaml.safe_load(kept.read_text())["seed"] == 7


def test_the_settings_history_keeps_its_first_copy_and_a_fresh_start_clears_it(tmp_path):
    def run(seed: int, total: int, resume: bool):
        log = LogConfig(output_dir=str(tmp_path), progress=False, checkpoint_every=2)
        loop = RunLoop(tmp_path, total, log, {"seed": seed}, "Test", latest=newest)
        return loop.run(CountingJob(tmp_path), resume=resume)

    run(7, 2, False)  # steps 1-2 under seed 7
    run(8, 3, True)  # resumed at 2 under seed 8: steps 1-2's settings kept
    shutil.rmtree(tmp_path / "checkpoints" / "step-3")  # killed before step 3's checkpoint
    run(9, 3, True)  # resumed at 2 again: steps 1-2 still ran under seed 7, not 8
    kept = tmp_path / "config.until-step-2.yaml"
    assert yaml.safe_load(kept.read_text())["seed"] == 7
    (tmp_path / "tensorboard").mkdir()
    run(7, 1, False)  # a fresh start: no history of the run it replaced
    assert not kept.exists() and not (tmp_path / "tensorboard").exists()


def test_a_second_run_in_a_folder_being_trained_in_is_refused_naming_the_first(tmp_path):
    # two runs in one folder appended to one metrics.jsonl and interleaved checkpoints
    import os

    import pytest

    from rlhflab.config import ConfigError

    class Peek(CountingJob):  # a second run tries to start while the first one trains
        def step(self):
            with pytest.raises(
                ConfigError,
                match=rf"log.output_dir: another rlhflab run "
                rf"\(process {os.getpid()}\) is training in {tmp_path}",
            ):
                loop(tmp_path).run(CountingJob(tmp_path))
            return super().step()

    assert loop(tmp_path, total=2).run(Peek(tmp_path)).steps == 2
    assert [r["iteration"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    # released at the end, and by the kernel when a holder is killed: a resume goes on
    held = _hold(tmp_path)
    with pytest.raises(ConfigError, match="another rlhflab run"):
        loop(tmp_path, total=3).run(CountingJob(tmp_path), resume=True)
    held.kill()
    held.wait()
    assert loop(tmp_path, total=3).run(CountingJob(tmp_path), resume=True).steps == 3
    # a run refused before it wrote anything leaves no folder behind
    ran = CountingJob(tmp_path / "new")
    ran.iteration = 1  # a trainer that ran before, started afresh: refused first thing
    with pytest.raises(ConfigError, match="has already run"):
        loop(tmp_path / "new").run(ran)
    assert not (tmp_path / "new").exists()


def test_wall_time_survives_a_run_killed_after_a_checkpoint(tmp_path):
    # run.json's wall_s was written only at a run's end: a kill -9 lost it, and the resume
    # after it counted from 0, dropping the time of every run before
    import json

    from rlhflab.infra import runinfo

    loop(tmp_path, total=2).run(CountingJob(tmp_path))
    first = json.loads((tmp_path / "run.json").read_text())["wall_s"]

    class Killed(CountingJob):
        def step(self):
            if self.iteration == 4:  # resumed at 2, checkpointed at 4, killed in step 5
                raise SystemExit("killed")
            return super().step()

    real_end = RunLoop._end_info
    RunLoop._end_info = lambda *a, **k: None  # kill -9 writes no end
    try:
        import pytest

        with pytest.raises(SystemExit):
            loop(tmp_path, total=6).run(Killed(tmp_path), resume=True)
    finally:
        RunLoop._end_info = real_end
    noted = runinfo.read_run_info(tmp_path)
    assert noted["checkpoint_step"] == 4 and noted["finished"] is None
    assert "steps" not in noted  # a report reads steps as the run's end
    assert noted["wall_s_before"] == first and noted["wall_s_at_checkpoint"] > first
    # killed again before its first checkpoint: its start's record keeps the time before
    RunLoop._end_info = lambda *a, **k: None
    try:
        with pytest.raises(SystemExit):
            loop(tmp_path, total=6).run(Killed(tmp_path), resume=True)  # at 4: dies in step 5
    finally:
        RunLoop._end_info = real_end
    again = runinfo.read_run_info(tmp_path)
    assert again["wall_s_before"] == noted["wall_s_at_checkpoint"]
    assert "wall_s_at_checkpoint" not in again
    loop(tmp_path, total=6).run(CountingJob(tmp_path), resume=True)
    end = json.loads((tmp_path / "run.json").read_text())
    assert end["wall_s_before"] == again["wall_s_before"] and end["wall_s"] > end["wall_s_before"]


def test_the_lock_gives_way_where_a_file_system_has_no_locks_and_is_shared_by_umask(
    tmp_path, monkeypatch, caplog
):
    # NFS without its lock daemon raised ENOLCK out of every run; the lock file was 0644
    # under a group-sharing umask, so a teammate's resume could not open it
    import errno
    import os
    import stat

    from rlhflab.infra import run_lock

    old = os.umask(0o002)
    try:
        loop(tmp_path / "shared", total=1).run(CountingJob(tmp_path / "shared"))
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "shared" / ".rlhflab.lock").stat().st_mode)
    assert mode == 0o664

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"):
        assert loop(tmp_path / "nfs", total=1).run(CountingJob(tmp_path / "nfs")).steps == 1
    assert "not locked (" in caplog.text and "No locks available" in caplog.text


def _hold(folder):
    """Another process holding ``folder``'s run lock (until killed)."""
    import subprocess
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    held = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(folder / ".rlhflab.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert held.stdout.readline().strip() == "held"
    return held


def test_a_refused_start_writes_nothing_in_the_held_folder(tmp_path):
    # the Python API wrote inputs/python_rewards.json into a folder a CLI run held (whose
    # --resume was then refused for Python rewards), and a second demo retrained the SFT
    # and reward models under the first one's PPO stage
    import pytest

    import rlhflab
    from rlhflab.app.compare import run_compare
    from rlhflab.app.demo import run_demo
    from rlhflab.config import ConfigError

    run = tmp_path / "ppo"
    held = _hold(run)
    try:
        with pytest.raises(ConfigError, match="another rlhflab run"):  # before models load
            rlhflab.PPOTrainer(
                model="preset:nano",
                reward=lambda prompts, responses: [0.0] * len(responses),
                overrides={"ppo.iterations": 1, "log.progress": False},
                output_dir=str(run),
            )
        assert not (run / "inputs" / "python_rewards.json").exists()
    finally:
        held.kill()
        held.wait()
    built = rlhflab.PPOTrainer(  # built while the folder was free, trained once it is not
        model="preset:nano",
        reward=lambda prompts, responses: [0.0] * len(responses),
        overrides={"ppo.iterations": 1, "log.progress": False},
        output_dir=str(tmp_path / "later"),
    )
    held = _hold(tmp_path / "later")
    try:
        with pytest.raises(ConfigError, match="another rlhflab run"):
            built.train()
        assert not (tmp_path / "later" / "inputs" / "python_rewards.json").exists()
    finally:
        held.kill()
        held.wait()
    for root, start in (
        (tmp_path / "quick-s0", run_demo),
        (tmp_path / "compare-quick-s0", run_compare),
    ):
        held = _hold(root)
        try:
            with pytest.raises(ConfigError, match=r"--out: another rlhflab run"):
                start("quick", 0, tmp_path, progress=False)
            assert not (root / "sft").exists()
        finally:
            held.kill()
            held.wait()


def test_under_a_process_group_every_rank_raises_rank_zeros_refusal(tmp_path):
    # torchrun: rank 0 said the refusal and the other ranks died in their next collective
    # with a transport traceback; the refusal is now broadcast and raised on every rank
    import pytest
    import torch.distributed as dist

    from rlhflab.config import ConfigError
    from rlhflab.infra.run_lock import rank_zero_lock

    held = _hold(tmp_path / "run")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="another rlhflab run"):
            with rank_zero_lock(tmp_path / "run", "log.output_dir", is_main=True):
                pass
        with rank_zero_lock(tmp_path / "free", "log.output_dir", is_main=False):
            pass  # a rank that writes nothing takes no lock, and passes when rank 0 has it
    finally:
        dist.destroy_process_group()
        held.kill()
        held.wait()


def test_sft_and_dpo_refuse_a_held_folder_before_their_model_loads(tmp_path, monkeypatch, capsys):
    from rlhflab.app.cli import main
    from rlhflab.trainers import dpo, sft

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded first")

    monkeypatch.setattr(sft, "load_model", no_model)
    monkeypatch.setattr(dpo, "load_model", no_model)
    for stage, folder, field in (("sft", tmp_path / "s" / "run", "sft.output_dir"),
                                 ("dpo", tmp_path / "d", "log.output_dir")):  # fmt: skip
        held = _hold(folder)
        try:
            out = f"{field}={folder.parent if stage == 'sft' else folder}"
            assert main([stage, "model.policy=preset:nano", out, "log.progress=false"]) == 2
            assert f"error: {field}: another rlhflab run" in capsys.readouterr().err
        finally:
            held.kill()
            held.wait()
