"""Architectures whose real checkpoints broke rlhflab where Llama, GPT-2 and Qwen2 did not
(an outside test, 2026-12-07): weights transformers renames between memory and disk
(GPT-NeoX, mixture-of-experts), a sliding attention window (Gemma 2), an output layer
narrower than the hidden states (OPT-350m), tied embeddings exported in bf16, and a
tokenizer with more tokens than the embedding has rows. Built locally, tiny."""

import pytest
import torch
from safetensors import safe_open

from rlhflab.app.cli import main
from rlhflab.infra.runlog import read_jsonl
from rlhflab.models.presets import build_tokenizer, default_corpus
from rlhflab.trainers.ppo import PPOTrainer
from tests.model_helpers import probe_by_plain_loop
from tests.test_ppo import VOLATILE, make_cfg


def build(kind: str, out, tokens: int = 0):
    """A 2-layer ``kind`` checkpoint and its tokenizer in ``out``; ``tokens`` > 0: that
    many tokens added to the tokenizer after the model was sized."""
    import transformers as T

    tok = build_tokenizer(default_corpus())
    # the token Qwen2's tokenizer class adds when it loads (real checkpoints carry it)
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    ids = {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    small = {"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}
    torch.manual_seed(0)
    if kind == "neox":  # lm_head in memory, embed_out on disk
        model = T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(hidden_size=32, intermediate_size=64, **small, **ids)
        )
    elif kind == "mixtral":  # experts fused in memory, one by one on disk
        cfg = T.MixtralConfig(
            hidden_size=32, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, **small, **ids,
        )  # fmt: skip
        model = T.MixtralForCausalLM(cfg)
    elif kind == "gemma2":  # every other layer attends to the last 8 positions only
        cfg = T.Gemma2Config(
            hidden_size=32, intermediate_size=64, num_key_value_heads=2, head_dim=8,
            sliding_window=8, **small, **ids,
        )  # fmt: skip
        model = T.Gemma2ForCausalLM(cfg)
    elif kind == "opt350":  # hidden 64, projected to 32 before the vocabulary head
        cfg = T.OPTConfig(
            hidden_size=64, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False,
            pad_token_id=tok.pad_token_id, **small, **ids,
        )  # fmt: skip
        model = T.OPTForCausalLM(cfg)
    else:  # qwen2, tied
        cfg = T.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=True,
            **small, **ids,
        )  # fmt: skip
        model = T.Qwen2ForCausalLM(cfg)
    if tokens:
        tok.add_tokens([f"newword{i}" for i in range(tokens)])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["neox", "mixtral"])
def test_a_run_on_weights_renamed_on_save_resumes_bit_identically(tmp_path, kind):
    folder = build(kind, tmp_path / kind)
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        on_disk = set(fh.keys())
    from transformers import AutoModelForCausalLM

    in_memory = set(AutoModelForCausalLM.from_pretrained(folder).state_dict())
    assert on_disk != in_memory  # what the test is about: transformers renames them
    args = [f"model.policy={folder}", "model.runtime=transformers", "ppo.iterations=2"]
    straight = PPOTrainer(make_cfg(tmp_path, *args, f"log.output_dir={tmp_path / 'a'}"))
    straight.fit()
    half = PPOTrainer(make_cfg(tmp_path, *args, f"log.output_dir={tmp_path / 'b'}"))
    half.cfg.ppo.iterations = 1  # stop after 1 (a checkpoint at step 1), as if killed
    half.cfg.log.checkpoint_every = 1
    half.fit()
    resumed = PPOTrainer(make_cfg(tmp_path, *args, f"log.output_dir={tmp_path / 'b'}"))
    resumed.fit(resume=True)
    for a, b in [
        (straight.cast.policy, resumed.cast.policy),
        (straight.cast.critic, resumed.cast.critic),
    ]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "a" / "metrics.jsonl")) == strip(
        read_jsonl(tmp_path / "b" / "metrics.jsonl")
    )


def test_the_opener_probe_on_a_sliding_window_model_scores_prompts_longer_than_it(tmp_path, caplog):
    """Prompts of ~10 tokens plus the spellings' positions pass Gemma 2's window of 8: the
    probe's tree-shaped forward after the prompt's cache raised a shape mismatch there."""
    folder = build("gemma2", tmp_path / "gemma2")
    cfg = make_cfg(
        tmp_path, f"model.policy={folder}", "model.runtime=transformers", "ppo.iterations=1"
    )
    cfg.monitor.flattery_opener_ratio = 5.0
    t = PPOTrainer(cfg)
    with caplog.at_level("WARNING", logger="rlhflab.experience.opener"):
        t.fit()
    said = [r.message for r in caplog.records if "sliding attention window" in r.message]
    assert said and "Gemma2ForCausalLM" in said[0], said
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["monitor/flattery_opener_ratio"] == pytest.approx(1.0, abs=1e-4)
    # and its numbers are the plain loop's: prompt + spelling, one whole forward each
    from rlhflab.experience.opener import opener_logprobs
    from rlhflab.experience.rollout import left_pad

    lm, tok = t.cast.policy_lm, t.cast.tokenizer
    prompts = [
        tok("copy: tree lime sun moon red blue green sea sky", add_special_tokens=False)[
            "input_ids"
        ],
        [5, 6],
    ]
    assert len(prompts[0]) > lm.config.sliding_window  # past the window on its own
    ids, mask = left_pad(prompts, tok.pad_token_id)
    got = opener_logprobs(lm, tok, ids, mask, ["Great question"], 1.0, micro_batch=2)
    want = probe_by_plain_loop(lm, tok, prompts, "Great question")
    assert got.tolist() == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("extra", [[], ["rollout.logprobs_from_sampling=true"]])
def test_a_shared_value_head_fits_an_output_layer_narrower_than_the_hidden_states(tmp_path, extra):
    folder = build("opt350", tmp_path / "opt")
    t = PPOTrainer(
        make_cfg(
            tmp_path,
            f"model.policy={folder}",
            "model.value_model=shared",
            "ppo.iterations=1",
            *extra,
        )
    )
    assert t.cast.policy.value_head.in_features == 32  # word_embed_proj_dim, not hidden_size
    t.fit()
    assert t.first_minibatch["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_a_bf16_export_of_a_tied_model_writes_the_embedding_once(tmp_path):
    folder = build("qwen2", tmp_path / "qwen2")
    run = tmp_path / "run"
    assert main(["ppo", "--config", "examples/tiny_ppo.yaml", f"model.policy={folder}",
                 "model.runtime=transformers", "ppo.iterations=1", f"log.output_dir={run}",
                 "log.progress=false"]) == 0  # fmt: skip
    sizes = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / f"export-{dtype}"
        assert main(["export", str(run), str(out), "--dtype", dtype]) == 0
        with safe_open(str(out / "model.safetensors"), "pt") as fh:
            assert "lm_head.weight" not in set(fh.keys()), dtype
        sizes[dtype] = (out / "model.safetensors").stat().st_size
    assert sizes["bf16"] < 0.55 * sizes["fp32"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export-bf16")
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_tokenizer_with_more_tokens_than_the_embedding_is_refused_naming_both(tmp_path, capsys):
    folder = build("qwen2", tmp_path / "big", tokens=20)
    args = ["ppo", "--config", "examples/tiny_ppo.yaml", f"model.policy={folder}",
            "model.runtime=transformers", f"log.output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "tokens but the model's embedding only" in err and "resize_token_embeddings" in err
    assert "Traceback" not in err


def test_a_renamed_checkpoint_missing_a_weight_is_refused_not_filled_at_random(tmp_path):
    """transformers' loader fills what a folder lacks with fresh weights: read back through
    it, a checkpoint short of a tensor loaded "fine" before the loading report was read."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from rlhflab.infra import checkpoint as C

    folder = build("neox", tmp_path / "neox")
    model = AutoModelForCausalLM.from_pretrained(folder)
    renamed = C.read_weights_for(model, folder)  # the model's own names, the saved values
    assert set(renamed) == set(model.state_dict())
    assert torch.equal(renamed["lm_head.weight"], model.lm_head.weight)
    weights = load_file(str(folder / "model.safetensors"))
    gone = next(k for k in weights if k.endswith("mlp.dense_4h_to_h.weight"))
    del weights[gone]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(C.CheckpointError, match="missing"):
        C.load_weights_into(model, folder)


def test_the_window_of_a_composite_model_is_read_from_its_text_config():
    """Gemma 3's 4B-27B load as Gemma3ForConditionalGeneration: the window is in text_config."""
    from transformers import Gemma3Config, LlamaConfig

    from rlhflab.experience.opener import within_window

    class Model:
        def __init__(self, config):
            self.config = config

    gemma3 = Model(Gemma3Config())
    assert within_window(gemma3, 100) and not within_window(gemma3, 100_000)
    assert within_window(Model(LlamaConfig()), 100_000)
    from transformers import Llama4Config

    llama4 = Model(Llama4Config())  # chunked attention: 8192-position chunks
    assert within_window(llama4, 8000) and not within_window(llama4, 9000)


def test_a_shared_value_head_on_a_model_without_an_output_layer_is_refused_naming_the_setting():
    from torch import nn

    from rlhflab.models import PolicyWithValueHead
    from rlhflab.models.prepare import ModelLoadError

    class Headless(nn.Module):
        def get_output_embeddings(self):
            return None

        def get_input_embeddings(self):
            return nn.Embedding(3, 4)

    with pytest.raises(ModelLoadError, match="model.value_model=shared: Headless"):
        PolicyWithValueHead(Headless())
