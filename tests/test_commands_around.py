"""rlhflab export, generate and eval on tiny PPO runs of the nano preset (a full-weight run
with a separate critic, a LoRA run with a shared value head), made once per module."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhflab.app.cli import main
from rlhflab.diagnostics.evaluate import heldout_prompts
from rlhflab.experience.rollout import generate_rollout
from rlhflab.infra.runs import load_policy
from rlhflab.models.presets import preset_path

BOOM_LINE = 9  # tests/reward_fns.py: boom's `return 1 / 0`

PROMPTS = ("add: 1 2\nanswer:", "copy: cat dog\nanswer:", "sort: red fish\nanswer:")
IDS = torch.tensor([[5, 17, 42, 9, 88, 3, 61]])
TINY_RUN = [
    "model.policy=preset:nano",
    "ppo.iterations=2",
    "ppo.lr=1e-2",  # large: the trained policy must differ visibly from its base
    "rollout.prompts_per_iteration=4",
    "rollout.max_new_tokens=6",
    "ppo.epochs=1",
    "monitor.enabled=false",
    "reward.functions={rlhflab.builtin.toy_rewards:vowel_reward: 1.0}",
    "log.checkpoint_every=1",
    "log.progress=false",
    "device=cpu",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    made = {"full": root / "full", "lora": root / "lora"}
    assert main(["ppo", *TINY_RUN, f"log.output_dir={made['full']}"]) == 0
    assert main(["ppo", *TINY_RUN, "model.lora_r=4", f"log.output_dir={made['lora']}"]) == 0
    return made


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": p} for p in PROMPTS]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_saved_weights_are_as_readable_as_every_other_file(runs, tmp_path):
    """safetensors creates its files owner-only (0600): exports, checkpoints and the
    folders sft/rm write get the mode the umask gives every other file."""
    import os
    import stat

    from rlhflab.infra.files import current_umask

    before = os.umask(0o022)  # whatever the CI's umask: 0600 is then visibly wrong
    try:
        assert current_umask() == 0o022
        assert main(["export", str(runs["full"]), str(tmp_path / "out")]) == 0
        args = ["sft", "model.policy=preset:nano", "sft.steps=1", "device=cpu"]
        assert main([*args, f"sft.output_dir={tmp_path / 'sft'}", "log.progress=false"]) == 0
    finally:
        os.umask(before)
    weights = [tmp_path / "out" / "model.safetensors", tmp_path / "sft" / "model.safetensors"]
    weights += list((tmp_path / "sft" / "run" / "checkpoints").rglob("*.safetensors"))
    assert len(weights) > 2
    for f in weights:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_export_full_run_is_the_checkpoints_policy(runs, tmp_path, capsys):
    out = tmp_path / "full"
    assert main(["export", str(runs["full"]), str(out)]) == 0
    assert "step-2" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("*value_head*")) and not (out / "critic").exists()
    exported = hf(out)
    # read independently of rlhflab: the run's last checkpoint, through transformers
    policy = hf(runs["full"] / "checkpoints" / "step-2" / "policy")
    assert torch.equal(logits(exported), logits(policy))
    base = hf(preset_path("nano"))
    assert not torch.allclose(logits(exported), logits(base), atol=1e-3)  # trained: moved

    older = tmp_path / "step1-bf16"
    assert main(["export", str(runs["full"]), str(older), "--checkpoint", "step-1"]) == 0
    assert not torch.equal(logits(hf(older)), logits(exported))
    assert main(["export", str(runs["full"]), str(older), "--dtype", "bf16", "--force"]) == 0
    assert json.loads((older / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(older / "model.safetensors")).values()} == {
        torch.bfloat16
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_export_lora_merged_gives_the_adapter_policys_logits(runs, tmp_path):
    from peft import PeftModel

    out = tmp_path / "merged"
    assert main(["export", str(runs["lora"]), str(out)]) == 0
    weights = load_file(str(out / "model.safetensors"))
    assert not [k for k in weights if "lora" in k or "value_head" in k or "base_layer" in k]
    # the run's policy as peft itself reads it: base + the checkpoint's adapter
    saved = runs["lora"] / "checkpoints" / "step-2" / "policy"
    base_dir = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
    policy = PeftModel.from_pretrained(hf(base_dir), str(saved)).eval()
    exported = hf(out)
    torch.testing.assert_close(logits(exported), logits(policy), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(exported), logits(hf(base_dir)), atol=1e-3)
    # the same sums as peft's own merge, and the run's model left unmerged
    by_peft = PeftModel.from_pretrained(hf(base_dir), str(saved)).merge_and_unload().state_dict()
    assert set(weights) == set(by_peft) - {"lm_head.weight"}  # tied to the embedding: once
    for key, tensor in weights.items():
        assert torch.equal(tensor, by_peft[key]), key


def test_export_adapter_loads_with_peft_on_the_named_base(runs, tmp_path, capsys):
    from peft import PeftModel

    out = tmp_path / "adapter"
    assert main(["export", str(runs["lora"]), str(out), "--adapter"]) == 0
    said = capsys.readouterr().out
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    base_dir = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert "preset:nano" in said and base_dir in said  # which base it needs
    adapter = PeftModel.from_pretrained(hf(base_dir), str(out)).eval()
    run_policy = load_policy(Path(runs["lora"])).lm  # a pathlib.Path is taken as its string
    assert torch.equal(logits(adapter), logits(run_policy))


def test_export_refuses_a_folder_that_is_not_empty(runs, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(runs["full"]), str(out)]) == 2
    assert error_line(capsys) == (
        f"error: {out}: exists and is not empty; choose another folder or pass --force "
        "(force=True from Python)"
    )
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(runs["full"]), str(tmp_path / "new"), "--adapter"]) == 2
    assert "trained full weights (model.lora_r is 0); there is no adapter" in error_line(capsys)
    assert main(["export", str(runs["full"]), str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    # --force never replaces the run it exports (or a folder holding it)
    for kept in (runs["full"], runs["full"].parent, runs["full"] / "checkpoints"):
        assert main(["export", str(runs["full"]), str(kept), "--force"]) == 2
        assert "would delete" in error_line(capsys)
    assert (runs["full"] / "config.yaml").is_file()


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_is_seeded_and_samples_as_the_rollout_does(runs, prompts_file, tmp_path):
    def generate(name, *extra, model=runs["lora"]):
        out = tmp_path / f"{name}.jsonl"
        args = ["generate", "--model", str(model), "--prompts", str(prompts_file)]
        assert main([*args, "--out", str(out), "--n", "2", "log.progress=false", *extra]) == 0
        return read_rows(out)

    first, again, other = generate("a"), generate("b"), generate("c", "seed=7")
    assert first == again and first != other
    assert [r["prompt"] for r in first] == [p for p in PROMPTS for _ in range(2)]
    assert all(set(r) == {"prompt", "answer", "tokens", "ended_with_eos"} for r in first)
    # the run's rollout settings (max_new_tokens=6), and the sampler PPO uses, seeded alike
    assert all(1 <= r["tokens"] <= 6 for r in first)
    assert all(r["ended_with_eos"] or r["tokens"] == 6 for r in first)
    src = load_policy(str(runs["lora"]))
    gen = torch.Generator().manual_seed(0)
    ro = generate_rollout(
        src.lm, src.tokenizer, [r["prompt"] for r in first], 6, 1.0, 0, 1.0, gen, "cpu"
    )
    assert [r["answer"] for r in first] == ro.responses
    assert [r["tokens"] for r in first] == ro.response_mask.sum(1).tolist()
    # an override wins over the run's config; the exported folder answers as the run does
    assert all(r["tokens"] <= 2 for r in generate("d", "rollout.max_new_tokens=2"))
    merged = tmp_path / "merged"
    assert main(["export", str(runs["lora"]), str(merged)]) == 0
    from_folder = generate("e", "rollout.max_new_tokens=6", model=merged)
    assert [r["answer"] for r in from_folder] == [r["answer"] for r in first]


def test_eval_scores_with_every_scorer(runs, prompts_file, nano_rm, tmp_path, capsys):
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(runs["full"]), "--prompts", str(prompts_file)]
    args += ["--reward-model", str(nano_rm), "--reward", "rlhflab.builtin.toy_rewards:vowel_reward"]
    args += ["--gold", "rlhflab.builtin.tasks:gold_reward", "--out", str(out), "--n", "3"]
    assert main([*args, "log.progress=false"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(out.read_text())
    rows = read_rows(tmp_path / "eval.jsonl")
    head = nano_rm.name
    names = ["gold", *(f"{head}/{h}" for h in ("correctness", "brevity", "politeness"))]
    names.append("rlhflab.builtin.toy_rewards:vowel_reward")
    assert list(summary["scores"]) == names and len(rows) == 9 == summary["answers"]
    for name in names:
        values = [r["scores"][name] for r in rows]
        stat = summary["scores"][name]
        assert stat["mean"] == pytest.approx(sum(values) / 9)
        assert stat["stderr"] == pytest.approx(torch.tensor(values).std().item() / 3, rel=1e-4)
        assert name in printed and f"{stat['mean']:.4f}" in printed
    assert summary["length"]["mean"] == pytest.approx(sum(r["tokens"] for r in rows) / 9)
    eos = sum(r["ended_with_eos"] for r in rows) / 9
    assert summary["eos_rate"]["mean"] == pytest.approx(eos)
    assert "EOS rate" in printed and "answer length (tokens)" in printed


def test_eval_defaults_to_the_builtin_tasks_heldout_prompts_and_gold(runs, tmp_path):
    out = tmp_path / "builtin.json"
    args = ["eval", "--model", str(runs["full"]), "--limit", "6", "--out", str(out)]
    assert main([*args, "log.progress=false"]) == 0
    summary, rows = json.loads(out.read_text()), read_rows(tmp_path / "builtin.jsonl")
    assert [r["prompt"] for r in rows] == heldout_prompts(6, seed=0)
    assert summary["scorers"] == [{"kind": "gold", "spec": "rlhflab.builtin.tasks:gold_reward"}]
    assert list(summary["scores"]) == ["gold", "accuracy", "flattery_rate", "repetition_rate"]


def test_errors_are_one_line_naming_the_culprit(runs, prompts_file, tmp_path, capsys):
    gen = ["generate", "--prompts", str(prompts_file), "--out", str(tmp_path / "a.jsonl")]
    missing = tmp_path / "nowhere"
    assert main([*gen, "--model", str(missing)]) == 2
    assert error_line(capsys) == f"error: --model {missing}: no such folder"

    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text((runs["full"] / "config.yaml").read_text())
    assert main([*gen, "--model", str(empty_run)]) == 2
    assert error_line(capsys).startswith(f"error: {empty_run}: no step checkpoint in")
    assert main(["export", str(empty_run), str(tmp_path / "x")]) == 2
    assert "no step checkpoint" in error_line(capsys)
    (empty_run / "checkpoints" / "best").mkdir(parents=True)  # keep_best's alone: said
    assert main(["export", str(empty_run), str(tmp_path / "x")]) == 2
    assert error_line(capsys).endswith("it holds checkpoints/best: --checkpoint best reads it")

    assert main(["export", str(runs["full"]), str(tmp_path / "x"), "--checkpoint", "best"]) == 2
    assert error_line(capsys).endswith(
        "has no checkpoints/best (log.keep_best writes it); it has: step-1, step-2"
    )
    assert main([*gen, "--model", "preset:nano", "--checkpoint", "step-1"]) == 2  # not ignored
    assert "--checkpoint step-1: preset:nano is a model, not a run directory" in error_line(capsys)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    assert main(["generate", "--model", str(runs["full"]), "--prompts", str(bad)]) == 2
    assert error_line(capsys) == f"error: {bad}:2: not valid JSON (Expecting value at column 12)"

    ev = ["eval", "--model", str(runs["full"]), "--prompts", str(prompts_file)]
    ev += ["--out", str(tmp_path / "e.json"), "--reward", "tests.reward_fns:boom"]
    assert main([*ev, "log.progress=false"]) == 2
    # the line of the user's function that raised is named: the one-line error lost it
    said = error_line(capsys)
    assert said.startswith(
        "error: reward function tests.reward_fns:boom raised ZeroDivisionError: division by zero"
        " (at "
    ) and said.endswith(f"{os.sep}tests{os.sep}reward_fns.py:{BOOM_LINE}, in boom)"), said


def test_bad_prompts_are_reported_before_any_weight_is_loaded(runs, tmp_path, monkeypatch, capsys):
    import rlhflab.infra.runs as R

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the prompts were read")

    monkeypatch.setattr(R, "load_model", no_model)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["generate", "--model", str(runs["lora"]), "--prompts", str(empty)]) == 2
    assert error_line(capsys) == f"error: {empty}: no usable prompt rows"


def test_save_policy_leaves_a_live_lora_policy_as_it_was(tmp_path):
    from rlhflab import models as M
    from rlhflab.models.export import save_policy

    folder = preset_path("nano")
    tok = M.load_tokenizer(folder)
    lm = M.apply_lora(M.load_causal_lm(folder, tok), 4, 16.0, ["q_proj", "v_proj"])
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    policy = M.PolicyWithValueHead(lm)  # the shared value head stays behind
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    out = save_policy(policy, tok, tmp_path / "live", dtype="fp32")
    after = policy.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged", False) for m in lm.modules())
    saved = load_file(str(out / "model.safetensors"))
    assert not [k for k in saved if "value_head" in k or "lora" in k]
    torch.testing.assert_close(logits(hf(out)), logits(lm), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(hf(out)), logits(hf(folder)), atol=1e-3)


def test_a_run_started_with_relative_paths_is_found_from_anywhere(
    tmp_path, monkeypatch, prompts_file
):
    """A LoRA run keeps its base as the run's config.yaml names it: started in one folder
    with relative paths, its export (merged and as an adapter) and generate work from
    another, because the run records absolute paths (and PEFT the base's absolute one)."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(preset_path("nano"), work / "models" / "base")
    monkeypatch.chdir(work)
    run_args = [a for a in TINY_RUN if not a.startswith("model.policy=")]
    run_args += ["ppo.iterations=1", "model.policy=models/base", "model.lora_r=4"]
    assert main(["ppo", *run_args, "log.output_dir=runs/lora"]) == 0
    recorded = (work / "runs" / "lora" / "config.yaml").read_text()
    assert f"policy: {work / 'models' / 'base'}" in recorded
    assert f"output_dir: {work / 'runs' / 'lora'}" in recorded

    monkeypatch.chdir(tmp_path)  # elsewhere
    run = str(work / "runs" / "lora")
    assert main(["export", run, str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(work / "models" / "base")
    assert main(["export", run, str(tmp_path / "merged")]) == 0
    assert main(["generate", "--model", run, "--prompts", str(prompts_file)]) == 0
    first = (tmp_path / "answers.jsonl").read_text()
    assert len(first.splitlines()) == len(PROMPTS)
    # a default output never replaces an earlier result (a named --out does)
    assert main(["generate", "--model", run, "--prompts", str(prompts_file), "seed=5"]) == 0
    assert (tmp_path / "answers.jsonl").read_text() == first
    assert len((tmp_path / "answers-2.jsonl").read_text().splitlines()) == len(PROMPTS)


def test_export_of_a_native_run_names_the_class_its_config_json_names(tmp_path, capsys):
    run = tmp_path / "native"
    assert (
        main(
            ["ppo", *TINY_RUN, "ppo.iterations=1", "model.runtime=native", f"log.output_dir={run}"]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert ": LlamaForCausalLM," in said and "Native" not in said, said
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_a_file_the_command_cannot_write_is_one_line(monkeypatch, capsys):
    """A read-only or full disk was an OSError traceback (torch's checkpoint writer: a
    RuntimeError); now one line naming the file, status 2. Any other error still raises."""
    import errno

    from rlhflab.app import cli

    def fails_with(exc):
        def command(args):
            raise exc

        return command

    cases = [
        (
            OSError(errno.EROFS, "Read-only file system", "/ro/run/config.yaml"),
            "/ro/run/config.yaml: Read-only",
        ),
        (OSError(errno.ENOSPC, "No space left on device"), "writing a file failed: No space"),
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64"),
            "is the disk full?",
        ),
    ]
    for exc, said in cases:
        monkeypatch.setitem(cli.COMMANDS, "report", fails_with(exc))
        assert main(["report", "somewhere"]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    monkeypatch.setitem(cli.COMMANDS, "report", fails_with(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["report", "somewhere"])
