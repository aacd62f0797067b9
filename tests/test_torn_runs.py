"""A run directory a crash left behind can be reported on and resumed (issue #24).

A kill or power loss mid-write cuts the last line of metrics.jsonl (or samples, alerts), a
JSON file, or a checkpoint's files short. Readers skip the torn tail with a warning and keep
every complete line; ``--resume`` trims the tail and continues from the newest intact
checkpoint.
"""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.config import ConfigError, load_config
from rlhflab.config.base import to_dict
from rlhflab.infra import checkpoint as C
from rlhflab.infra.runlog import read_jsonl
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_ppo import make_cfg


def cut_last_line(path, keep: int = 12) -> None:
    """Leave only the first ``keep`` bytes of the file's last line (no newline after)."""
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:keep])


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def test_report_reads_every_complete_line_of_a_torn_run(tmp_path, capsys, caplog):
    run = tmp_path / "ppo"
    run.mkdir()
    rows = [{"iteration": i, "objective/scores": 0.1 * i, "objective/kl": 0.01} for i in (1, 2, 3)]
    write_jsonl(run / "metrics.jsonl", [*rows, {"iteration": 4, "objective/scores": 9.0}])
    cut_last_line(run / "metrics.jsonl")
    sample = {"iteration": 1, "prompt": "p", "response": "é" * 20, "score": 1.0, "kl": 0.1}
    write_jsonl(run / "samples.jsonl", [sample, sample])
    last = (run / "samples.jsonl").read_bytes().splitlines()[-1]
    cut_last_line(run / "samples.jsonl", keep=last.index("é".encode()) + 1)  # mid-character
    alert = {"iteration": 2, "signal": "kl_limit", "value": 9.0, "message": "kl high"}
    write_jsonl(run / "alerts.jsonl", [alert, alert])
    cut_last_line(run / "alerts.jsonl")
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "rm_checks.json").write_text('{"reward": {"accuracy": 0.7')
    (run / "config.yaml").write_text(f"reward: {{model: '{rm}'}}\n")
    (tmp_path / "summary.json").write_text('{"ppo": {"gold": 0.')
    with caplog.at_level(logging.WARNING):
        assert main(["report", str(run)]) == 0
    assert (run / "report.html").exists()
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert len(read_jsonl(run / "samples.jsonl")) == 1
    warned = caplog.text
    assert "metrics.jsonl:4" in warned and "samples.jsonl:2" in warned
    assert "summary.json" in warned and "rm_checks.json" in warned


def test_a_damaged_line_before_the_end_is_an_error_naming_it(tmp_path, capsys):
    run = tmp_path / "ppo"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n{"iterat\n{"iteration": 3}\n')
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"error: {run / 'metrics.jsonl'}:2: not a complete JSON object, and not the last line "
        "(a crash cuts only the last); the file is damaged"
    ]


def ppo_config(tmp_path, iterations: int):
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(
        "device: cpu\n"
        "model: {policy: 'preset:nano', value_model: separate}\n"
        "reward: {functions: {'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}}\n"
        "rollout: {prompts_per_iteration: 8, max_new_tokens: 8}\n"
        f"ppo: {{iterations: {iterations}, epochs: 1, minibatches: 1, lr: 1.0e-3}}\n"
        f"log: {{output_dir: '{tmp_path / 'run'}', progress: false, checkpoint_every: 2,"
        " sample_every: 1}\n"
    )
    return str(cfg)


def test_resume_and_report_after_a_torn_metrics_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["ppo", "--config", ppo_config(tmp_path, 2)]) == 0
    cut_last_line(run / "metrics.jsonl", keep=30)  # iteration 2's line, cut mid-JSON
    cut_last_line(run / "samples.jsonl", keep=30)
    assert main(["ppo", "--resume", "--config", ppo_config(tmp_path, 3)]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    # iteration 2's line was torn and is gone; every line left is whole JSON
    assert [json.loads(ln)["iteration"] for ln in lines] == [1, 3]
    samples = [json.loads(ln) for ln in (run / "samples.jsonl").read_text().splitlines()]
    # 4 samples an iteration; the torn 4th of iteration 2 is gone, the 3 before it stay
    assert [s["iteration"] for s in samples] == [1] * 4 + [2] * 3 + [3] * 4
    assert main(["report", str(run)]) == 0


def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path, caplog):
    first = PPOTrainer(make_cfg(tmp_path, "ppo.epochs=1", "ppo.minibatches=1"))
    first.fit()
    ckpts = C.list_checkpoints(tmp_path / "run")
    assert [p.name for p in ckpts] == ["step-2", "step-4"]
    # a copy that lost a whole file is told apart from a layout that never has it (a shared
    # backbone has no critic/): each checkpoint lists its files
    lost = tmp_path / "lost"
    shutil.copytree(ckpts[0], lost)
    (lost / "optimizer.pt").unlink()
    assert C.checkpoint_fault(ckpts[0]) is None
    assert C.checkpoint_fault(lost) == "optimizer.pt is missing"
    (lost / "manifest.json").unlink()  # the list gone too: it passed, and resumed to a KeyError
    assert C.checkpoint_fault(lost) == "no optimizer.pt (and no manifest.json to say what it held)"
    torch.save({**C.read_state(ckpts[0]), "optim": {}}, lost / "state.pt")  # before 2026-12-05
    assert C.checkpoint_fault(lost) is None
    newest = ckpts[-1] / "optimizer.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # cut mid-write
    resumed = PPOTrainer(make_cfg(tmp_path, "ppo.epochs=1", "ppo.minibatches=1"))
    with caplog.at_level(logging.WARNING):
        resumed.fit(resume=True)
    assert "step-4" in caplog.text and "the newest whole checkpoint is" in caplog.text
    # it went on from step 2 and, resume being exact, ended where the first run did
    for a, b in zip(
        first.cast.policy.state_dict().values(), resumed.cast.policy.state_dict().values()
    ):
        assert torch.equal(a, b)
    iterations = [r["iteration"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert iterations == [1, 2, 3, 4]
    assert (tmp_path / "run" / "checkpoints" / "step-4.corrupt").is_dir()  # set aside, kept
    assert C.read_state(C.list_checkpoints(tmp_path / "run")[-1])["iteration"] == 4


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path, capsys):
    bad = tmp_path / "run" / "checkpoints" / "step-2"
    (bad / "policy").mkdir(parents=True)
    (bad / "state.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(C.CheckpointError, match=r"step-2"):
        C.latest_checkpoint(tmp_path / "run")


def test_a_result_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """Summaries, tables, reports and a run's config.yaml go through write_text_atomic: a
    write that fails (here an unencodable character, then a kill between the write and the
    rename) leaves the old file as it was and no temporary file behind."""
    from rlhflab.app.report import build_report
    from rlhflab.infra import files

    path = tmp_path / "summary.json"
    files.write_text_atomic(path, '{"gold": 1}')
    with pytest.raises(UnicodeEncodeError):
        files.write_text_atomic(path, '{"gold": "\ud800"}')  # a lone surrogate
    assert path.read_text() == '{"gold": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]

    run = tmp_path / "ppo"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"iteration": 1, "objective/scores": 0.5}])
    before = build_report(run).read_text(encoding="utf-8")
    write_jsonl(run / "metrics.jsonl", [{"iteration": i, "objective/scores": 0.5} for i in (1, 2)])

    def killed(src, dst):
        raise KeyboardInterrupt  # as a Ctrl-C between the write and the rename

    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        build_report(run)
    assert (run / "report.html").read_text(encoding="utf-8") == before
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.html"]


def test_a_fresh_start_in_a_run_folder_sets_the_earlier_run_aside_or_replaces_it(tmp_path, caplog):
    """Without --resume, the earlier run's logs were replaced but its checkpoints stayed: a
    shorter new run left the old run's later step-N as the newest, which --resume, export
    and generate then picked. Then they were deleted before the new run's first step, lost
    if it failed there. Now the earlier run is moved into earlier-<time>/ (log.earlier_run
    =keep, the default), or deleted whole with log.earlier_run=replace."""
    fast = ["ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1"]
    PPOTrainer(make_cfg(tmp_path, "ppo.iterations=2", *fast)).fit()
    run = tmp_path / "run"
    (run / "report.html").write_text("the old run's")
    assert [p.name for p in C.list_checkpoints(run)] == ["step-1", "step-2"]
    with caplog.at_level(logging.WARNING):
        PPOTrainer(make_cfg(tmp_path, "ppo.iterations=1", *fast)).fit()
    assert "holds an earlier run" in caplog.text and "kept in" in caplog.text
    assert [p.name for p in C.list_checkpoints(run)] == ["step-1"]
    assert not (run / "report.html").exists()
    assert len(read_jsonl(run / "metrics.jsonl")) == 1
    (aside,) = run.glob("earlier-*")
    assert [p.name for p in C.list_checkpoints(aside)] == ["step-1", "step-2"]
    assert (aside / "report.html").read_text() == "the old run's"
    assert len(read_jsonl(aside / "metrics.jsonl")) == 2
    # replace: the earlier run goes whole
    PPOTrainer(make_cfg(tmp_path, "ppo.iterations=2", *fast, "log.earlier_run=replace")).fit()
    assert [p.name for p in C.list_checkpoints(run)] == ["step-1", "step-2"]
    assert len(read_jsonl(run / "metrics.jsonl")) == 2
    assert len(list(run.glob("earlier-*"))) == 1  # the one kept before, untouched
    # but never the checkpoint the new run itself starts from
    policy = run / "checkpoints" / "step-1" / "policy"
    for how, verb in (("keep", "move"), ("replace", "delete")):
        over = (f"model.policy={policy}", f"log.earlier_run={how}")
        again = PPOTrainer(make_cfg(tmp_path, "ppo.iterations=1", *fast, *over))
        with pytest.raises(ConfigError, match=f"model.policy: .* is inside .* would {verb}"):
            again.fit()
        assert policy.is_dir()


def test_resuming_with_other_models_names_the_setting(tmp_path, capsys):
    """--resume with a shared value head for a run trained with a separate critic, or with
    LoRA for a full-weight run: one line naming the setting, not a missing file."""
    fast = ["ppo.iterations=1", "ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1"]
    PPOTrainer(make_cfg(tmp_path, *fast)).fit()  # model.value_model=separate
    config = str(tmp_path / "run" / "config.yaml")
    for change, said in (
        ("model.value_model=shared", "model.value_model is 'shared', but"),
        ("model.lora_r=4", "model.lora_r is 4, but"),
    ):
        assert main(["ppo", "--config", config, "ppo.iterations=2", change, "--resume"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert said in line and "resume with the run's setting" in line, line
    # another policy folder: the tensors' shapes differ; said as the setting, the file named
    assert main(["ppo", "--config", config, "model.policy=preset:tiny", "--resume"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.policy is 'preset:tiny', but the run was trained from 'preset:nano'" in line
    assert "model.safetensors" in line and "resume with the run's setting" in line, line
    # 'auto' is resolved per run, so not compared: the checkpoint's loader names the file
    auto = tmp_path / "auto"
    PPOTrainer(make_cfg(auto, *fast, "model.value_model=auto")).fit()
    config = str(auto / "run" / "config.yaml")
    assert (
        main(
            ["ppo", "--config", config, "ppo.iterations=2", "model.value_model=shared", "--resume"]
        )
        == 2
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "value_head.safetensors" in line and "written for others" in line, line


def test_resuming_a_lora_run_with_another_alpha_is_refused(tmp_path, capsys):
    # the adapters were trained at scale alpha/r: another alpha is another policy
    fast = ["ppo.iterations=1", "ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1"]
    PPOTrainer(make_cfg(tmp_path, *fast, "model.lora_r=4", "model.lora_alpha=8")).fit()
    config = str(tmp_path / "run" / "config.yaml")
    args = ["ppo", "--config", config, "ppo.iterations=2", "--resume"]
    assert main([*args, "model.lora_alpha=32"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.lora_alpha is 32" in line and "trained with 8" in line, line
    assert main(args) == 0  # the run's own alpha resumes


def test_a_report_name_taken_by_a_folder_is_one_line(tmp_path, capsys):
    run = tmp_path / "ppo"
    (run / "report.html").mkdir(parents=True)
    write_jsonl(run / "metrics.jsonl", [{"iteration": 1, "objective/scores": 0.5}])
    assert main(["report", str(run)]) == 2
    assert "report.html: a folder" in capsys.readouterr().err.strip().splitlines()[-1]


def test_answers_written_as_json_lines_whole_or_not_at_all(tmp_path):
    """generate/eval's answers and the API's converted inputs stream through
    write_lines_atomic: a row that cannot be written part-way through the file leaves the
    old file as it was and no temporary file behind."""
    from rlhflab.app.answers import write_jsonl as write_answers
    from rlhflab.app.inputs import _write_jsonl as write_inputs
    from rlhflab.config import ConfigError

    path = tmp_path / "answers.jsonl"
    write_answers(path, [{"answer": "a"}])
    with pytest.raises(TypeError):
        write_answers(path, [{"answer": "b"}, {"answer": object()}])
    assert path.read_text() == '{"answer": "a"}\n'
    with pytest.raises(ConfigError, match=r"prompts: item 2"):
        write_inputs([{"prompt": "b"}, {"prompt": object()}], path, "prompts")
    assert path.read_text() == '{"answer": "a"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["answers.jsonl"]
    write_inputs([{"prompt": "ü"}, {"prompt": "c"}], path, "prompts")
    assert path.read_text(encoding="utf-8") == '{"prompt": "ü"}\n{"prompt": "c"}\n'


def test_a_trainer_that_ran_is_never_started_afresh_under_its_own_files(tmp_path):
    """Training the same trainer object again (a notebook's second train(), or a retry
    after an exception) used to start afresh: it deleted the run's logs and checkpoints
    and went on from the object's iteration. Now it is refused naming resume, which
    continues from the newest checkpoint exactly as an uninterrupted run does."""
    fast = ["ppo.iterations=3", "ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1"]
    straight = PPOTrainer(make_cfg(tmp_path / "a", *fast))
    straight.fit()
    with pytest.raises(ConfigError, match=r"already run .*to iteration 3 of 3.*resume"):
        straight.fit()
    assert len(read_jsonl(tmp_path / "a" / "run" / "metrics.jsonl")) == 3
    assert [p.name for p in C.list_checkpoints(tmp_path / "a" / "run")][-1] == "step-3"

    failing = PPOTrainer(make_cfg(tmp_path / "b", *fast))

    def reward_service_down(step, metrics):
        if step == 2:
            raise RuntimeError("reward service down")

    failing.step_hooks = [reward_service_down]
    with pytest.raises(RuntimeError, match="reward service down"):
        failing.fit()
    with pytest.raises(ConfigError, match=r"already run .*to iteration 2 of 3"):
        failing.fit()
    failing.step_hooks = []
    failing.fit(resume=True)  # from step-1: the hook raised before step-2 was written
    rows = read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for a, b in zip(
        straight.cast.policy.state_dict().values(), failing.cast.policy.state_dict().values()
    ):
        assert torch.equal(a, b)


def test_resume_with_nothing_to_continue_sets_the_earlier_run_aside(tmp_path, caplog):
    """A run killed before its first step-N checkpoint (only checkpoints/best, from
    log.keep_best) and then given --resume starts afresh, as a job script that always
    passes --resume expects, but its logs, best policy and report are moved aside, not
    deleted."""
    run = tmp_path / "run"
    (run / "checkpoints" / "best").mkdir(parents=True)
    (run / "checkpoints" / "best" / "policy.txt").write_text("the best policy")
    write_jsonl(run / "metrics.jsonl", [{"iteration": i, "objective/scores": 0.5} for i in (1, 2)])
    (run / "report.html").write_text("the old run's")
    (run / "config.yaml").write_text("seed: 7\n")
    fast = ["ppo.iterations=1", "ppo.epochs=1", "ppo.minibatches=1"]
    with caplog.at_level(logging.WARNING):
        PPOTrainer(make_cfg(tmp_path, *fast)).fit(resume=True)
    assert "holds no checkpoint to continue from" in caplog.text
    (aside,) = run.glob("earlier-*")
    assert (aside / "checkpoints" / "best" / "policy.txt").read_text() == "the best policy"
    assert len(read_jsonl(aside / "metrics.jsonl")) == 2
    assert (aside / "report.html").read_text() == "the old run's"
    assert (aside / "config.yaml").read_text() == "seed: 7\n"
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    assert [p.name for p in C.list_checkpoints(run)] == ["step-1"]
    # a folder with nothing of a run in it: nothing set aside, and one line that says so
    # (it said it twice in other words); nor for a start that logged nothing but its
    # run.json (killed while loading its models)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhflab.trainers.loop"):
        PPOTrainer(make_cfg(tmp_path / "empty", *fast)).fit(resume=True)
    assert caplog.text.count("starting fresh") + caplog.text.count("starting afresh") == 1
    assert not list((tmp_path / "empty" / "run").glob("earlier-*"))
    killed = tmp_path / "killed" / "run"
    killed.mkdir(parents=True)
    (killed / "run.json").write_text('{"trainer": "PPO", "finished": null}')
    PPOTrainer(make_cfg(tmp_path / "killed", *fast)).fit()
    assert not list(killed.glob("earlier-*")) and (killed / "metrics.jsonl").is_file()
    # a second set-aside within the same second gets a folder of its own
    shutil.rmtree(run / "checkpoints" / "step-1")
    PPOTrainer(make_cfg(tmp_path, *fast)).fit(resume=True)
    assert len(list(run.glob("earlier-*"))) == 2
    # never the checkpoints this run reads from
    best = run / "checkpoints" / "best"
    best.mkdir(parents=True)
    (best / "p.jsonl").write_text('{"prompt": "add: 1 2\\nanswer:"}\n')
    shutil.rmtree(run / "checkpoints" / "step-1")
    reads = PPOTrainer(make_cfg(tmp_path, *fast, f"data.prompts={best / 'p.jsonl'}"))
    with pytest.raises(ConfigError, match=r"data.prompts: .* would move"):
        reads.fit(resume=True)


def test_resume_refuses_a_run_another_command_wrote(tmp_path):
    """--resume read any checkpoint in the folder: grpo --resume on a PPO run continued it
    with PPO's steps counted as its own (and PPO's β); now refused, naming both."""
    fast = ["ppo.iterations=1", "ppo.epochs=1", "ppo.minibatches=1", "log.checkpoint_every=1"]
    PPOTrainer(make_cfg(tmp_path, *fast)).fit()
    cfg = load_config(
        base=to_dict(make_cfg(tmp_path, *fast, "ppo.iterations=2")),
        overrides=["model.value_model=none", "ppo.advantage_estimator=grpo"],
        stage="grpo",
    )
    with pytest.raises(ConfigError, match=r"holds a PPO run, not a GRPO run.*rlhflab ppo --resume"):
        PPOTrainer(cfg).fit(resume=True)
    assert [p.name for p in C.list_checkpoints(tmp_path / "run")] == ["step-1"]


def test_a_checkpoint_write_that_fails_names_the_folder_and_leaves_no_half_folder(
    tmp_path, monkeypatch
):
    # a full disk: torch's writer named no file, safetensors' error was a bare traceback,
    # and the half-written step-N.tmp stayed, keeping the disk full
    from rlhflab.app.user_errors import storage_error
    from rlhflab.infra.files import WriteFailed

    trainer = PPOTrainer(make_cfg(tmp_path, "ppo.iterations=1", "ppo.epochs=1"))
    trainer.fit()
    stale = tmp_path / "run" / "checkpoints" / "step-9.tmp"  # a kill -9 mid-write left it
    stale.mkdir()

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 2")

    monkeypatch.setattr(C.torch, "save", full)
    with pytest.raises(WriteFailed) as err:
        trainer.save(5)
    said = storage_error(err.value)
    assert said.startswith(f"{tmp_path / 'run' / 'checkpoints' / 'step-5'}: the checkpoint could")
    assert "(is the disk full?)" in said
    assert not (tmp_path / "run" / "checkpoints" / "step-5.tmp").exists()
    monkeypatch.undo()
    assert C.latest_checkpoint(tmp_path / "run", set_aside=True).name == "step-1"
    assert not stale.exists()  # the writer of the run's files clears what a kill left

    class SafetensorError(Exception):  # safetensors' own, raised from Rust
        pass

    err = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert storage_error(SafetensorError(err)).startswith("writing a file failed (is the disk")
    assert storage_error(RuntimeError("a bug")) is None
    # a read that fails inside a write is no write's failure: it passes as it is
    from rlhflab.infra.files import writing

    with pytest.raises(FileNotFoundError):
        with writing(tmp_path / "out", "model"):
            open(tmp_path / "missing.txt")
    with pytest.raises(
        WriteFailed, match=r"out: the model could not be written: Permission denied \("
    ):
        with writing(tmp_path / "out", "model"):
            raise PermissionError(13, "Permission denied", str(tmp_path / "out" / "x"))


def test_a_model_that_cannot_be_written_leaves_no_half_file_and_is_one_line(
    tmp_path, monkeypatch, capsys
):
    # rlhflab sft wrote its model straight into OUT: a full disk left half a
    # model.safetensors there, and safetensors' error was a traceback
    from transformers import PreTrainedModel

    class SafetensorError(Exception):  # safetensors' own: a plain Exception
        pass

    save = PreTrainedModel.save_pretrained

    def full_disk(self, folder, **kwargs):
        if Path(folder).name != ".model.tmp":  # checkpoints are written; the model is not
            return save(self, folder, **kwargs)
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "sft"
    args = ["sft", "model.policy=preset:nano", "sft.steps=1", f"sft.output_dir={out}"]
    assert main([*args, "log.progress=false"]) == 2
    said = capsys.readouterr().err
    assert f"error: {out}: the model could not be written (is the disk full?)" in said
    assert "Traceback" not in said
    assert not (out / "model.safetensors").exists() and not (out / ".model.tmp").exists()


def test_reading_a_run_that_deletes_its_newest_checkpoint_meanwhile_takes_the_next(
    tmp_path, monkeypatch
):
    # export/generate on a run still training: log.keep_last deleted the checkpoint being
    # read, and the error blamed the tokenizer ("Repo id must be in the form ...")
    from rlhflab.infra import runs

    PPOTrainer(make_cfg(tmp_path, "ppo.iterations=3", "log.checkpoint_every=1")).fit()
    run = tmp_path / "run"
    assert [p.name for p in C.list_checkpoints(run)] == ["step-2", "step-3"]
    found = runs.find_policy(run)
    assert found.checkpoint.name == "step-3"
    shutil.move(run / "checkpoints" / "step-3", tmp_path / "gone")  # pruned before the load
    found.load()
    assert found.checkpoint.name == "step-2" and found.lm is not None
    shutil.move(tmp_path / "gone", run / "checkpoints" / "step-3")
    real = runs._run_at

    def pruned_while_read(run_dir, which, path):
        if path.name == "step-3":
            shutil.rmtree(path)
            raise OSError("config.json: no such file")
        return real(run_dir, which, path)

    monkeypatch.setattr(runs, "_run_at", pruned_while_read)
    assert runs.find_policy(run).checkpoint.name == "step-2"
    with pytest.raises(C.CheckpointError):  # a checkpoint asked for by name: no other
        runs.find_policy(run, checkpoint="step-9")
