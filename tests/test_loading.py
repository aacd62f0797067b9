"""Loading correctness: fp32 master weights whatever the checkpoint's dtype, no dropout left
anywhere, and broken or wrong model folders refused with one line (issue #24)."""

import json
import shutil

import pytest
import torch

from rlhflab import models as M
from rlhflab.app.cli import main
from rlhflab.backends.native_models import read_safetensors
from rlhflab.config import load_config
from rlhflab.experience import cast as C
from rlhflab.experience.rewards import ModelReward
from rlhflab.models.presets import preset_path
from rlhflab.trainers.dpo import DPO_BASE, DPOTrainer
from rlhflab.trainers.ppo import PPOTrainer
from rlhflab.trainers.rm_ensemble import train_rm
from rlhflab.trainers.sft import train_sft

RUNTIMES = ["transformers", "native"]


def _save_bf16(src, out, classifier=False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    auto.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(out)
    M.load_tokenizer(src).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, nano_rm):
    """A causal LM and a reward model, both saved in bf16."""
    root = tmp_path_factory.mktemp("bf16")
    lm = _save_bf16(preset_path("nano"), root / "lm")
    rm = _save_bf16(nano_rm, root / "rm", classifier=True)
    assert {t.dtype for t in read_safetensors(lm / "model.safetensors").values()} == {
        torch.bfloat16
    }
    return {"lm": lm, "rm": rm}


def dtypes(model, trainable=True):
    return {p.dtype for p in model.parameters() if p.requires_grad == trainable}


def cfg_with(stage="ppo", **over):
    base = {"device": "cpu", "log": {"progress": False}}
    return load_config(base=base, overrides=[f"{k}={v}" for k, v in over.items()], stage=stage)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize(
    "layout,reward_precision",
    [("separate", "fp32"), ("from_reward", "fp32"), ("from_reward", "bf16"), ("shared", "fp32")],
)
def test_cast_trains_fp32_master_weights_from_bf16_checkpoints(
    bf16, runtime, layout, reward_precision
):
    cast = C.build_cast(
        cfg_with(
            **{
                "model.policy": bf16["lm"],
                "reward.model": bf16["rm"],
                "model.value_model": layout,
                "model.reward_precision": reward_precision,
                "model.runtime": runtime,
            }
        )
    )
    assert dtypes(cast.policy) == {torch.float32}
    if cast.critic is not None:
        assert dtypes(cast.critic) == {torch.float32}
    assert dtypes(cast.reference, trainable=False) == {torch.float32}
    rm = next(s for s, _ in cast.reward.sources if isinstance(s, ModelReward)).model
    assert dtypes(rm, trainable=False) == {M.PRECISION_DTYPES[reward_precision]}


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_frozen_reward_model_follows_the_configured_precision(bf16, runtime, precision):
    # rm --check and the compare helper load reward.model through this one function
    rm, _ = C.load_frozen_reward_model(
        cfg_with(
            "rm",
            **{
                "reward.model": bf16["rm"],
                "model.reward_precision": precision,
                "model.runtime": runtime,
            },
        ),
        "cpu",
    )
    assert dtypes(rm, trainable=False) == {M.PRECISION_DTYPES[precision]}
    assert not rm.training


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_rm_sft_and_dpo_train_in_fp32_from_a_bf16_checkpoint(bf16, tmp_path, runtime):
    common = {"model.policy": bf16["lm"], "model.runtime": runtime}
    cfg = cfg_with(
        "rm",
        **common,
        **{"rm.steps": 1, "rm.pairs": 16, "rm.batch_size": 4, "rm.output_dir": tmp_path / "rm"},
    )
    train_rm(cfg)
    cfg.sft.steps, cfg.sft.examples, cfg.sft.output_dir = 1, 8, str(tmp_path / "sft")
    train_sft(cfg)
    for stage in ("rm", "sft"):  # a model trained in bf16 would be saved in bf16
        saved = read_safetensors(tmp_path / stage / "model.safetensors")
        assert {t.dtype for t in saved.values()} == {torch.float32}, stage
    dpo = load_config(
        base={**DPO_BASE, "device": "cpu"},
        overrides=[f"model.policy={bf16['lm']}", f"model.runtime={runtime}", "dpo.pairs=8"],
        stage="dpo",
    )
    trainer = DPOTrainer(dpo)
    assert dtypes(trainer.policy) == {torch.float32}
    assert dtypes(trainer.reference, trainable=False) == {torch.float32}


# ----------------------------------------------------------------------------- dropout


@pytest.fixture(scope="module")
def with_dropout(tmp_path_factory):
    """Checkpoints whose configs switch dropout on: Llama (attention_dropout, kept by the
    attention module as a float) and GPT-2 (embedding, attention and residual dropouts)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("dropout")
    llama = root / "llama"
    shutil.copytree(preset_path("nano"), llama)
    fields = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**fields, "attention_dropout": 0.1}))
    tok = M.load_tokenizer(llama)
    ids = {k: getattr(tok, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    gpt2_cfg = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128, **ids
    )
    gpt2_cfg.resid_pdrop = gpt2_cfg.embd_pdrop = gpt2_cfg.attn_pdrop = 0.1
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_cfg).save_pretrained(root / "gpt2")
    tok.save_pretrained(root / "gpt2")
    return {"llama": llama, "gpt2": root / "gpt2"}


@pytest.mark.parametrize(
    "arch,runtime", [("llama", "transformers"), ("llama", "native"), ("gpt2", "transformers")]
)
def test_train_mode_equals_eval_mode_for_every_loaded_model(with_dropout, arch, runtime):
    folder = with_dropout[arch]
    tok = M.load_tokenizer(folder)
    enc = tok(["copy: red\nanswer: red", "add: 2 2\nanswer: 4"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    lm = M.load_causal_lm(folder, tok, runtime=runtime)
    critic = M.critic_from_causal_lm(folder, tok, runtime=runtime)
    for model, run in (
        (lm, lambda m: M.causal_forward(m, ids, mask).logits),
        (critic, lambda m: M.backbone_hidden(m, ids, mask)),  # its head starts at zero
    ):
        torch.manual_seed(0)
        trained = run(model.train())
        assert torch.equal(trained, run(model.eval())), type(model).__name__


def test_first_ppo_ratio_is_one_with_attention_dropout_in_the_checkpoint(with_dropout, tmp_path):
    cfg = cfg_with(
        **{
            "model.policy": with_dropout["llama"],
            "model.value_model": "separate",
            "reward.functions": "{'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}",
            "rollout.prompts_per_iteration": 8,
            "rollout.max_new_tokens": 6,
            "ppo.iterations": 1,
            "ppo.epochs": 1,
            "log.output_dir": tmp_path / "run",
        }
    )
    trainer = PPOTrainer(cfg)
    trainer.fit()
    first = trainer.first_minibatch
    assert first["policy/ratio_mean"] == 1.0 and first["policy/ratio_max"] == 1.0
    assert first["policy/approx_kl"] == pytest.approx(0.0, abs=1e-9)


# ----------------------------------------------------------------------------- broken folders


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Copies of the nano preset, each broken one way."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for fault in ("cut_short", "lfs_pointer", "no_tokenizer", "bad_config", "config_list"):
        folder = out[fault] = root / fault
        shutil.copytree(preset_path("nano"), folder)
    weights = out["cut_short"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    # what a clone without git-lfs leaves: its first 8 bytes read as a length of exabytes
    (out["lfs_pointer"] / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 1234\n"
    )
    for f in out["no_tokenizer"].iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",):
            f.unlink()
    (out["bad_config"] / "config.json").write_text('{"model_type": "llama",')
    (out["config_list"] / "config.json").write_text("[]")  # JSON, but no settings
    return out


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize(
    "fault,names",
    [
        ("cut_short", "model.safetensors"),
        ("lfs_pointer", "model.safetensors"),
        ("no_tokenizer", "tokenizer"),
        ("bad_config", "config.json"),
        ("config_list", "config.json"),
    ],  # fmt: skip
)
def test_a_broken_model_folder_is_one_line_and_status_2(
    broken, tmp_path, capsys, runtime, fault, names
):
    folder = broken[fault]
    out = tmp_path / "out"
    common = [f"model.runtime={runtime}", "device=cpu", f"log.output_dir={out}"]
    for args in (
        ["sft", f"model.policy={folder}", f"sft.output_dir={out}"],
        ["ppo", "model.policy=preset:nano", f"reward.model={folder}"],
        ["rm", "--check", f"reward.model={folder}"],
    ):
        assert main([*args, *common]) == 2, args
        line = error_line(capsys)
        assert str(folder) in line and names in line, line
        assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_causal_lm_given_as_the_reward_model_is_refused(tmp_path, capsys, runtime):
    out = tmp_path / "out"
    common = [f"model.runtime={runtime}", "device=cpu", f"log.output_dir={out}"]
    for args in (
        ["ppo", "model.policy=preset:nano", "reward.model=preset:nano"],
        ["grpo", "model.policy=preset:nano", "reward.model=preset:nano"],
        ["rm", "--check", "reward.model=preset:nano"],
    ):
        assert main([*args, *common]) == 2, args
        line = error_line(capsys)
        assert "reward.model" in line and "score head" in line, line
        assert str(preset_path("nano")) in line, line
        assert not out.exists()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_reward_model_given_as_the_policy_is_refused(tmp_path, capsys, nano_rm, runtime):
    """A sequence classifier's folder is no policy: untied, it has no LM head, which
    transformers would start at random, saying so only in its load report; tied, its
    score head would be ignored. Every command that loads a policy refuses either in one
    line naming the folder (the native loader did already); a critic is refused one too."""
    untied = tmp_path / "rm-untied"
    shutil.copytree(nano_rm, untied)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out"
    common = [f"model.runtime={runtime}", "device=cpu", f"log.output_dir={out}"]
    ppo = ["ppo", "reward.functions={tests.reward_fns:zero_reward: 1}", *common]
    for folder, missing in ((untied, "['lm_head.weight']"), (nano_rm, "[]")):
        for args in (
            [*ppo, f"model.policy={folder}"],
            ["sft", f"model.policy={folder}", f"sft.output_dir={out}", *common],
            ["generate", "--model", str(folder), "--prompts", str(tmp_path / "p.jsonl")],
        ):
            assert main(args) == 2, args
            line = error_line(capsys)
            assert f"{folder}: weights do not match" in line and f"missing {missing}" in line
            assert "unexpected ['score.weight']" in line, line
            assert not out.exists()
    assert main([*ppo, "model.policy=preset:nano", f"model.critic={nano_rm}"]) == 2
    line = error_line(capsys)
    assert str(nano_rm) in line and "3 outputs where 1" in line and "model.critic:" in line
    assert "model.value_model=from_reward" in line


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_rm_init_with_a_head_of_another_size_is_one_line(tmp_path, capsys, nano_rm, runtime):
    # the fixture has 3 heads; rm.heads asks for its own default set
    out = tmp_path / "rm"
    args = ["rm", f"rm.init={nano_rm}", f"rm.output_dir={out}", f"model.runtime={runtime}"]
    assert main([*args, "rm.heads={preference: 1.0}", "device=cpu"]) == 2
    line = error_line(capsys)
    assert str(nano_rm) in line and "3 outputs where 1" in line, line
    assert not out.exists()


# ----------------------------------------------------------------------------- pad == EOS


def eos_pads(folder, how: str):
    """The nano preset as many real checkpoints ship: the pad token is the EOS ("shared"),
    or there is none ("missing")."""
    shutil.copytree(preset_path("nano"), folder)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    model_cfg = json.loads((folder / "config.json").read_text())
    if how == "shared":
        tok_cfg["pad_token"] = tok_cfg["eos_token"]
        model_cfg["pad_token_id"] = model_cfg["eos_token_id"]
    else:
        tok_cfg.pop("pad_token")
        model_cfg.pop("pad_token_id", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "config.json").write_text(json.dumps(model_cfg))
    return folder


@pytest.mark.parametrize("how", ["shared", "missing"])
def test_a_pad_equal_to_eos_keeps_the_vocabulary_and_the_eos_in_the_mask(tmp_path, how):
    """Padding is a matter of masks (issue #26): no token is added, no embedding grows, a
    LoRA checkpoint holds no embedding, and an answer that ended keeps its EOS in the mask."""
    from rlhflab.trainers.ppo import PPOTrainer
    from tests.test_ppo import make_cfg

    folder = eos_pads(tmp_path / "eos-pads", how)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok = M.load_tokenizer(folder)
    assert tok.pad_token_id == tok.eos_token_id and len(tok) == vocab
    t = PPOTrainer(
        make_cfg(
            tmp_path,
            f"model.policy={folder}",
            "model.lora_r=4",
            "ppo.iterations=2",
            "rollout.temperature=2.0",  # some answers end early, some are cut at the limit
        )
    )
    t.fit()
    assert t.cast.policy_lm.get_input_embeddings().weight.shape[0] == vocab
    ro = t.last_rollout
    lengths = ro.response_mask.sum(1)
    for i in range(len(ro)):
        last = ro.response_ids[i, lengths[i] - 1].item()
        assert (last == tok.eos_token_id) == bool(ro.ended[i]), i
    # the LoRA policy's checkpoint is the adapter alone: no embedding or output matrix
    from safetensors.torch import load_file

    policy = tmp_path / "run" / "checkpoints" / "step-2" / "policy"
    saved = [k for f in policy.glob("*.safetensors") for k in load_file(str(f))]
    assert saved and all("lora_" in k for k in saved), saved


def test_the_native_config_writes_back_the_labels_it_read_and_no_others():
    """A causal LM's config.json that names no labels came back from a native save with
    a LABEL_0 map; a classifier's labels, read or set, are written."""
    from rlhflab.backends.native_config import NativeConfig

    fields = json.loads((preset_path("nano") / "config.json").read_text())
    fields.pop("id2label", None), fields.pop("label2id", None)
    assert "id2label" not in NativeConfig(fields).to_dict()
    heads = NativeConfig(fields)
    heads.num_labels = 3
    assert heads.to_dict()["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    named = NativeConfig({**fields, "id2label": {"0": "reward"}})
    assert named.to_dict()["label2id"] == {"reward": 0}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_trained_folder_keeps_its_sources_dropout(tmp_path, runtime):
    """Training zeroes dropout (the first PPO ratio must be 1); the folder sft writes says
    what the source said, whichever runtime trained it."""
    src = tmp_path / "src"
    shutil.copytree(preset_path("nano"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    out = tmp_path / "sft"
    args = ["sft", f"model.policy={src}", f"sft.output_dir={out}", "sft.steps=1"]
    assert main([*args, f"model.runtime={runtime}", "device=cpu", "log.progress=false"]) == 0
    assert json.loads((out / "config.json").read_text())["attention_dropout"] == 0.1


def test_a_tokenizer_without_eos_is_refused_saying_how_to_give_it_one(tmp_path):
    from rlhflab.models import ModelLoadError
    from rlhflab.models.loading import load_tokenizer
    from rlhflab.models.presets import build_tokenizer, default_corpus

    tok = build_tokenizer(default_corpus())
    tok.eos_token = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no EOS token.*tokenizer.eos_token = "):
        load_tokenizer(str(tmp_path))
