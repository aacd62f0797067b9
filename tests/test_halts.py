"""A loss or gradient that is not finite halts every trainer the same way (issue #24).

The command prints one line naming the trainer's step and the setting to lower, exits 2,
and leaves the last good state intact: SFT and RM write no model into their output folder
and save the weights from before the bad step in OUT/last-good; DPO checkpoints the last
good state; PPO keeps its last complete checkpoint; all loadable and finite. A learning rate of 1e30 on the nano preset
makes the loss or a gradient non-finite within three steps.
"""

import math

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.infra import checkpoint as C


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def finite_weights(folder) -> bool:
    return all(torch.isfinite(t).all() for t in C.read_weights(folder).values())


@pytest.mark.parametrize(
    "command,args,trainer",
    [
        ("sft", ["sft.steps=6", "sft.examples=40", "sft.batch_size=4"], "SFT"),
        ("rm", ["rm.steps=6", "rm.pairs=40", "rm.batch_size=4"], "RM"),
    ],
)
def test_supervised_stages_halt_in_one_line_and_keep_the_last_good_weights(
    tmp_path, capsys, command, args, trainer
):
    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)  # an earlier output of the stage (its run/ beside it)
    (out / "previous.txt").write_text("an earlier model lives here")
    rc = main(
        [
            command,
            "model.policy=preset:nano",
            f"{command}.lr=1e30",
            f"{command}.output_dir={out}",
            "log.progress=false",
            *args,
        ]
    )
    assert rc == 2
    line = one_error_line(capsys)
    assert f"{trainer} step " in line and f"lower {command}.lr" in line, line
    assert "non-finite" in line
    # the output folder as it was (no model written into it), the weights from before the
    # bad step beside it, and the run's log of the steps that were taken
    assert sorted(p.name for p in out.iterdir()) == ["last-good", "previous.txt", "run"]
    assert (out / "run" / "metrics.jsonl").is_file()
    assert (out / "previous.txt").read_text() == "an earlier model lives here"
    assert f"are in {out / 'last-good'}" in line
    assert finite_weights(out / "last-good")


def test_dpo_halts_in_one_line_and_keeps_its_last_checkpoint(tmp_path, capsys):
    run = tmp_path / "dpo"
    rc = main(
        [
            "dpo",
            "model.policy=preset:nano",
            "dpo.lr=1e30",
            "dpo.steps=6",
            "dpo.pairs=40",
            "dpo.batch_size=4",
            "log.checkpoint_every=1",
            f"log.output_dir={run}",
            "log.progress=false",
        ]
    )
    assert rc == 2
    line = one_error_line(capsys)
    assert "DPO step " in line and "lower dpo.lr" in line, line
    last = C.list_checkpoints(run)[-1]
    assert str(last) in line
    assert finite_weights(last / "policy")
    assert C.read_state(last)["iteration"] == int(last.name.split("-")[1])


def test_ppo_halts_in_one_line_and_keeps_its_last_checkpoint(tmp_path, capsys):
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(
        "device: cpu\n"
        "model: {policy: 'preset:nano', value_model: separate}\n"
        "reward: {functions: {'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}}\n"
        "rollout: {prompts_per_iteration: 8, max_new_tokens: 8}\n"
        "ppo: {iterations: 6, epochs: 1, minibatches: 1, lr: 1.0e+30, max_bad_updates: 1}\n"
        f"log: {{output_dir: '{tmp_path / 'run'}', progress: false, checkpoint_every: 1}}\n"
    )
    assert main(["ppo", "--config", str(cfg)]) == 2
    line = one_error_line(capsys)
    assert "PPO iteration " in line and "lower ppo.lr" in line and "non-finite" in line, line
    last = C.list_checkpoints(tmp_path / "run")[-1]
    assert f"--resume continues from {last}" in line
    assert finite_weights(last / "policy") and finite_weights(last / "critic")
    # the state at the halt is kept under a name that --resume does not take: it may hold
    # finite updates of the halted iteration, and a resume must start from a whole one
    (halted,) = (tmp_path / "run" / "checkpoints").glob("halted-*")
    assert str(halted) in line and finite_weights(halted / "policy")
    assert C.latest_checkpoint(tmp_path / "run") == last
    assert not math.isnan(C.read_state(last)["iteration"])
