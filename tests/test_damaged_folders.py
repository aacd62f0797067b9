"""Model folders whose files disagree with each other or hold damaged numbers: refused in
one line naming the folder and what is wrong, by either runtime, before anything runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.models.presets import preset_path

RUNTIMES = ["transformers", "native"]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    return path


def _copy(tmp_path, name="model", **config):
    folder = shutil.copytree(preset_path("nano"), tmp_path / name)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _generate(capsys, folder, prompts, runtime):
    out = prompts.parent / "answers.jsonl"
    code = main(
        ["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out)]
        + [f"model.runtime={runtime}"]
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists()
    return code, [ln for ln in err.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("field", ["intermediate_size", "hidden_size"])
def test_a_config_that_does_not_match_the_weights_is_one_line(
    tmp_path, capsys, prompts, runtime, field
):
    cfg = json.loads((preset_path("nano") / "config.json").read_text())
    folder = _copy(tmp_path, **{field: cfg[field] * 2})
    code, errors = _generate(capsys, folder, prompts, runtime)
    assert code == 2 and len(errors) == 1, errors
    assert str(folder) in errors[0] and "config.json does not match the saved weights" in errors[0]
    assert "in the file but" in errors[0] and "by the config" in errors[0], errors[0]


def test_a_config_transformers_refuses_is_one_line(tmp_path, capsys, prompts):
    heads = json.loads((preset_path("nano") / "config.json").read_text())["num_attention_heads"]
    folder = _copy(tmp_path, hidden_size=heads * 16 + 1)  # not a multiple of the heads
    code, errors = _generate(capsys, folder, prompts, "transformers")
    assert code == 2 and len(errors) == 1 and "not a multiple" in errors[0], errors


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_weights_holding_nan_are_refused_naming_the_tensor(tmp_path, capsys, prompts, runtime):
    from safetensors.torch import load_file, save_file

    folder = _copy(tmp_path)
    weights = folder / "model.safetensors"
    state = load_file(weights)
    name = "model.layers.1.self_attn.o_proj.weight"
    state[name][0, :3] = torch.tensor([float("nan"), float("inf"), 0.5])
    save_file(state, weights, metadata={"format": "pt"})
    code, errors = _generate(capsys, folder, prompts, runtime)
    assert code == 2 and len(errors) == 1, errors
    assert f"damaged weights: {name} holds 2 NaN or infinite values" in errors[0], errors[0]
