"""SFT and reward-model training on the shared run loop: metrics, checkpoints in OUT/run,
and a resume that ends where the uninterrupted run did, bit for bit."""

import shutil

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.infra import checkpoint as C
from rlhflab.infra.runlog import read_jsonl

ARGS = {
    "sft": ["sft.steps=6", "sft.examples=40", "sft.batch_size=4", "sft.checkpoint_every=3"],
    "rm": ["rm.steps=6", "rm.pairs=40", "rm.batch_size=4", "rm.checkpoint_every=3"],
}


def run(command, out, *extra) -> int:
    return main(
        [
            command,
            "model.policy=preset:nano",
            f"{command}.output_dir={out}",
            "log.progress=false",
            *ARGS[command],
            *extra,
        ]
    )


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_a_resumed_supervised_run_ends_where_the_uninterrupted_one_did(tmp_path, command):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run(command, whole) == 0
    assert [p.name for p in C.list_checkpoints(whole / "run")] == ["step-3", "step-6"]
    rows = read_jsonl(whole / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 for r in rows)
    # a run killed after step 3's checkpoint: the later files never came to be
    assert run(command, cut) == 0
    shutil.rmtree(cut / "run" / "checkpoints" / "step-6")
    for f in cut.glob("*.safetensors"):
        f.unlink()
    assert run(command, cut, "--resume") == 0
    a, b = C.read_weights(whole), C.read_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = read_jsonl(cut / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]


def test_an_output_folder_that_holds_another_model_is_refused(tmp_path, capsys):
    """rm.output_dir = the SFT model's folder replaced the SFT policy with a reward model;
    a folder of the user's own files lost its config.json without a word; an empty
    sft.output_dir wrote into the current folder. Each is one line now; a rerun into the
    stage's own earlier output is still taken."""
    sft = tmp_path / "sft"
    args = ["sft", "model.policy=preset:nano", "sft.steps=1", "sft.examples=20", "device=cpu"]
    args += ["log.progress=false"]
    assert main([*args, f"sft.output_dir={sft}"]) == 0
    assert main([*args, f"sft.output_dir={sft}"]) == 0  # its own earlier output: taken
    before = (sft / "model.safetensors").read_bytes()
    rm = ["rm", f"model.policy={sft}", "rm.steps=1", "rm.pairs=16", "device=cpu"]
    assert main([*rm, f"rm.output_dir={sft}", "log.progress=false"]) == 2
    assert "is the folder of model.policy" in capsys.readouterr().err
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"my": "project config"}')
    assert main([*args, f"sft.output_dir={theirs}"]) == 2
    assert "holds files rlhflab did not write" in capsys.readouterr().err
    assert main([*rm, f"rm.output_dir={tmp_path / 'rm'}", f"rm.init={sft}"]) == 0
    assert main([*args, f"sft.output_dir={tmp_path / 'rm'}"]) == 2  # an RM's folder
    assert "holds the model `rlhflab rm` wrote" in capsys.readouterr().err
    assert main([*args, "sft.output_dir="]) == 2
    assert "sft.output_dir: empty" in capsys.readouterr().err
    assert (sft / "model.safetensors").read_bytes() == before
    assert (theirs / "config.json").read_text() == '{"my": "project config"}'


def test_resuming_after_the_data_file_changed_says_so(tmp_path, caplog):
    """run.json fingerprints the data files; a --resume after one was edited or replaced
    trained on other data without a word (config changes were said, data changes not)."""
    import json

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "response": " a"}) + "\n" for i in range(8))
    )
    args = ["sft", "model.policy=preset:nano", f"sft.data={data}", "sft.batch_size=4", "device=cpu"]
    args += [f"sft.output_dir={tmp_path / 'out'}", "sft.checkpoint_every=1", "log.progress=false"]
    assert main([*args, "sft.steps=1"]) == 0
    info = json.loads((tmp_path / "out" / "run" / "run.json").read_text())
    assert set(info["data"]) == {"sft.data"}
    with caplog.at_level("WARNING", logger="rlhflab.trainers.loop"):
        assert main([*args, "sft.steps=2", "--resume"]) == 0
    assert "changed since" not in caplog.text  # the same file: nothing said
    data.write_text(data.read_text().replace(" a", " b"))
    with caplog.at_level("WARNING", logger="rlhflab.trainers.loop"):
        assert main([*args, "sft.steps=3", "--resume"]) == 0
    assert f"sft.data ({data}) changed since the steps so far read it" in caplog.text


def test_a_fresh_sft_that_starts_from_its_own_checkpoint_names_sft_output_dir(tmp_path, capsys):
    # the refusal told SFT users to change log.output_dir, which SFT does not read
    out = tmp_path / "out"
    args = ["sft", "sft.steps=1", "sft.examples=20", "device=cpu", "log.progress=false"]
    args += [f"sft.output_dir={out}", "sft.checkpoint_every=1"]
    assert main([*args, "model.policy=preset:nano"]) == 0
    policy = out / "run" / "checkpoints" / "step-1" / "policy"
    assert main([*args, f"model.policy={policy}"]) == 2
    assert "give this run another sft.output_dir" in capsys.readouterr().err
    assert policy.is_dir()
