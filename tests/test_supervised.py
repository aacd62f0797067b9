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
