"""Any Hugging Face causal LM through the transformers runtime (issue #26): GPT-2 and Qwen2,
tied and untied embeddings, a pad id equal to EOS or none at all, left- and right-padding
tokenizers, each with dropout in its config. Built locally, a few thousand weights each."""

import json

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.models.presets import build_tokenizer, default_corpus
from rlhflab.trainers.ppo import PPOTrainer
from tests.model_helpers import probe_by_plain_loop
from tests.test_ppo import make_cfg


def build(kind: str, out, tied: bool, pad: str, side: str):
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = build_tokenizer(default_corpus())
    # the token GPT-2's and Qwen2's tokenizer classes expect (real checkpoints carry it)
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    if pad == "eos":
        tok.pad_token = tok.eos_token
    elif pad == "none":
        tok.pad_token = None
    tok.padding_side = side
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=2, n_head=2,
            tie_word_embeddings=tied, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, **ids,
        )  # fmt: skip
        model = GPT2LMHeadModel(cfg)
    elif kind == "bloom":  # ALiBi positions, no rotary: its attention takes a 2-D mask only
        cfg = BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=2, n_head=4, **ids)
        model = BloomForCausalLM(cfg)
    else:
        cfg = Qwen2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=tied, attention_dropout=0.1, **ids,
        )  # fmt: skip
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, len(tok)


@pytest.mark.parametrize(
    "kind, tied, pad, side",
    [
        ("gpt2", True, "eos", "left"),
        ("qwen2", False, "own", "right"),
        ("qwen2", True, "none", "left"),
    ],
)
def test_ppo_runs_on_other_causal_lms_with_the_first_ratio_one(tmp_path, kind, tied, pad, side):
    folder, vocab = build(kind, tmp_path / kind, tied, pad, side)
    t = PPOTrainer(
        make_cfg(
            tmp_path, f"model.policy={folder}", "ppo.iterations=2", "model.runtime=transformers"
        )
    )
    t.fit()
    # dropout off in every model although each config asks for 0.1: old and new log-probs agree
    assert t.first_minibatch["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert t.first_minibatch["policy/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    # the vocabulary is the checkpoint's: nothing added, nothing resized
    assert t.cast.policy_lm.get_input_embeddings().weight.shape[0] == vocab
    assert t.cast.tokenizer.pad_token_id is not None
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_native_runtime_refuses_what_it_cannot_run(tmp_path, capsys):
    folder, _ = build("gpt2", tmp_path / "gpt2", True, "eos", "left")
    args = ["ppo", "--config", "examples/tiny_ppo.yaml", f"model.policy={folder}"]
    assert main([*args, "model.runtime=native", f"log.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "model_type='gpt2' is not supported by model.runtime=native" in err, err
    assert "model.runtime=transformers" in err and "Traceback" not in err


STAGE_ARGS = {
    "sft": ["sft.steps=3", "sft.examples=16", "sft.batch_size=4"],
    "rm": ["rm.steps=3", "rm.pairs=24", "rm.batch_size=4", "rm.heldout_fraction=0.25"],
    "dpo": ["dpo.steps=3", "dpo.pairs=16", "dpo.batch_size=4", "log.checkpoint_every=3"],
}


def losses(run_dir) -> list[float]:
    from rlhflab.infra.runlog import read_jsonl

    return [row["loss"] for row in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """GPT-2 (Conv1D layers, tied head) and Qwen2 (untied), built once for the module."""
    root = tmp_path_factory.mktemp("any-lm")
    return {
        kind: build(kind, root / kind, tied=kind == "gpt2", pad="eos", side="left")[0]
        for kind in ("gpt2", "qwen2")
    }


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
@pytest.mark.parametrize(
    "stage, lora", [("sft", False), ("rm", False), ("dpo", False), ("dpo", True)]
)
def test_sft_rm_and_dpo_train_other_causal_lms_into_folders_that_reload(
    tmp_path, built, kind, stage, lora
):
    """issue #26: each stage a few steps on GPT-2 and Qwen2, LoRA where the stage has it
    (DPO) with model.lora_targets at its default."""
    from rlhflab import models as M

    folder = built[kind]
    out = tmp_path / "out"
    where = f"log.output_dir={out}" if stage == "dpo" else f"{stage}.output_dir={out}"
    extra = ["model.lora_r=4"] if lora else []
    args = [stage, f"model.policy={folder}", "device=cpu", "log.progress=false", where]
    assert main([*args, *STAGE_ARGS[stage], *extra]) == 0
    run = out if stage == "dpo" else out / "run"
    assert len(losses(run)) == 3 and all(torch.isfinite(torch.tensor(losses(run))))
    # trained without dropout (ratio 1), saved with the source's: a next fine-tune keeps it
    dropout = "resid_pdrop" if kind == "gpt2" else "attention_dropout"
    folders = (
        [out] if stage != "dpo" else [] if lora else [out / "checkpoints" / "step-3" / "policy"]
    )
    for f in folders:
        assert json.loads((f / "config.json").read_text())[dropout] == 0.1, f
    tok = M.load_tokenizer(folder)
    start = M.load_causal_lm(folder, tok)
    ids = torch.tensor([tok("copy: red\nanswer: red", add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    if stage == "rm":  # a finished reward model: its four trained heads score a text
        rm = M.load_sequence_classifier(out, tok, trained_head_for="reward.model")
        assert rm.config.num_labels == 4
        assert torch.isfinite(rm(input_ids=ids, attention_mask=mask).logits).all()
        return
    saved = out if stage == "sft" else out / "checkpoints" / "step-3" / "policy"
    if lora:  # the adapters alone, on the base model they were trained from
        from peft import PeftModel

        model = PeftModel.from_pretrained(M.load_causal_lm(folder, tok), saved)
        trained = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert trained and any(p.abs().max() > 0 for p in trained)
    else:
        model = M.load_causal_lm(saved, tok)
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, start(input_ids=ids, attention_mask=mask).logits)


def test_ppo_with_lora_on_gpt2_adapts_its_own_layers_and_saves_the_adapters(tmp_path, built):
    from safetensors.torch import load_file

    folder = built["gpt2"]
    t = PPOTrainer(
        make_cfg(
            tmp_path,
            f"model.policy={folder}",
            "ppo.iterations=1",
            "model.lora_r=4",
            "model.value_model=auto",
        )
    )
    t.fit()
    assert t.cast.value_layout == "shared"  # auto with LoRA: a head on the policy's backbone
    assert t.first_minibatch["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    trained = {n for n, p in t.cast.policy.named_parameters() if p.requires_grad}
    layers = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained if "lora_" in n}
    assert layers == {"c_attn", "c_proj", "c_fc"}  # model.lora_targets: all-linear
    assert all("lora_" in n or n.startswith("value_head") for n in trained)
    policy = tmp_path / "run" / "checkpoints" / "step-1" / "policy"
    saved = [k for f in policy.glob("*.safetensors") for k in load_file(str(f))]
    assert saved and all("lora_" in k for k in saved)


def test_an_int8_gpt2_quantises_its_conv1d_layers_too(built):
    """GPT-2's layers are transformers' Conv1D, not nn.Linear: int8 quantised only its tied
    head before (a larger "int8" reference than the fp32 one). Now every layer product is
    int8, and the logits stay those of the fp32 model to int8's rounding."""
    from transformers import AutoModelForCausalLM

    from rlhflab.models.frozen import set_precision

    fp32 = AutoModelForCausalLM.from_pretrained(built["gpt2"]).eval()
    int8 = set_precision(AutoModelForCausalLM.from_pretrained(built["gpt2"]).eval(), "int8")
    kinds = [type(m).__name__ for m in int8.modules()]
    quantised = [
        m
        for m in int8.modules()
        if type(m).__module__.endswith("quantized.dynamic.modules.linear")
        and type(m).__name__ == "Linear"
    ]
    assert "Conv1D" not in kinds and len(quantised) == 2 * 4 + 1, kinds  # 4 a layer + head
    ids = torch.randint(
        0, fp32.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        a, b = fp32(ids).logits, int8(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_the_opener_probe_on_a_model_whose_attention_takes_no_tree_mask(tmp_path, caplog):
    # Bloom's ALiBi builds its biases from a 2-D mask and raised on the probe's tree-shaped
    # 4-D one: PPO with the default monitor ended in a traceback. The probe now checks a
    # model once and scores such a model with a forward per spelling, saying so once
    from rlhflab.experience.opener import opener_logprobs
    from rlhflab.experience.rollout import left_pad

    folder, _ = build("bloom", tmp_path / "bloom", True, "own", "left")
    cfg = make_cfg(tmp_path, f"model.policy={folder}", "ppo.iterations=1")
    cfg.model.runtime, cfg.monitor.flattery_opener_ratio = "transformers", 5.0
    t = PPOTrainer(cfg)
    with caplog.at_level("WARNING", logger="rlhflab.experience.opener"):
        t.fit()
    said = [r.message for r in caplog.records if "tree-shaped attention mask" in r.message]
    assert len(said) == 1 and "BloomForCausalLM" in said[0], said
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["monitor/flattery_opener_ratio"] == pytest.approx(1.0, abs=1e-4)
    # the numbers are the plain loop's: prompt + spelling, one forward each
    lm, tok = t.cast.policy_lm, t.cast.tokenizer
    prompts = [tok("copy: tree lime", add_special_tokens=False)["input_ids"], [5, 6]]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    got = opener_logprobs(lm, tok, ids, mask, ["Great question"], 1.0, micro_batch=2)
    want = probe_by_plain_loop(lm, tok, prompts, "Great question")
    assert got.tolist() == pytest.approx(want, abs=1e-4)
