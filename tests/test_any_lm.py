"""Any Hugging Face causal LM through the transformers runtime (issue #26): GPT-2 and Qwen2,
tied and untied embeddings, a pad id equal to EOS or none at all, left- and right-padding
tokenizers, each with dropout in its config. Built locally, a few thousand weights each."""

import pytest
import torch

from rlhflab.app.cli import main
from rlhflab.models.presets import build_tokenizer, default_corpus
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_ppo import make_cfg


def build(kind: str, out, tied: bool, pad: str, side: str):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

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
