"""The four-model cast: loading, heads, precision, LoRA reference and reward sources."""

import pytest
import torch

from rlhflab import models as M
from rlhflab.config import load_config
from rlhflab.core.algorithms import logprobs_from_logits
from rlhflab.experience.cast import build_cast
from rlhflab.experience.rewards import (
    CallableReward,
    CompositeReward,
    FunctionReward,
    ModelReward,
    RewardBatch,
    RewardError,
)
from rlhflab.models import presets


def batch_ids(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def seq_logprobs(model, ids, mask):
    logits = M.causal_forward(model, ids, mask).logits
    return logprobs_from_logits(logits[:, :-1], ids[:, 1:])


def test_preset_sizes_are_as_documented():
    counts = {n: presets.count_parameters(n) for n in ("tiny", "small", "medium")}
    assert 0.7e6 < counts["tiny"] < 1.3e6
    assert 8e6 < counts["small"] < 12e6
    assert 25e6 < counts["medium"] < 35e6


def test_saved_preset_reloads_identically(tmp_path):
    a = presets.build_preset("nano", tmp_path / "a", seed=3)
    b = presets.build_preset("nano", tmp_path / "b", seed=3)
    tok = M.load_tokenizer(a)
    ma, mb = M.load_causal_lm(a, tok), M.load_causal_lm(b, tok)
    for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert M.load_tokenizer(b).get_vocab() == tok.get_vocab()
    # and the cached preset path is stable and loadable through the normal path
    assert presets.preset_path("nano") == presets.preset_path("nano")
    assert M.resolve_path("preset:nano") == presets.preset_path("nano")


def test_an_incomplete_cached_preset_is_rebuilt_in_its_place(tmp_path, monkeypatch):
    # what a rank other than 0 left in the cache under torchrun before presets._write_model:
    # a tokenizer and no model
    monkeypatch.setenv("RLHFLAB_CACHE", str(tmp_path))
    final = presets.preset_path("nano")
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        (final / f).unlink()
    again = presets.preset_path("nano")
    assert again == final and (again / "config.json").exists()
    M.load_causal_lm(again, M.load_tokenizer(again))
    assert [p.name for p in (tmp_path / "presets").iterdir()] == [final.name]  # nothing left


def test_a_tokenizer_without_its_own_pad_token_keeps_its_vocabulary(tmp_path):
    # issue #26 reversed the old rule (a new pad token, distinct from EOS): padding is a
    # matter of masks, so EOS pads where the folder names no pad, and no token is added
    tok = presets.build_tokenizer(["a b c"] * 5, vocab_size=300)
    for variant, pad in (("none", None), ("eos", tok.eos_token)):
        tok.pad_token = pad
        tok.save_pretrained(tmp_path / variant)
        loaded = M.load_tokenizer(tmp_path / variant)
        assert loaded.pad_token_id == loaded.eos_token_id
        assert len(loaded) == len(tok) and loaded.get_vocab() == tok.get_vocab()


def test_missing_folder_gets_a_clear_error(tmp_path):
    with pytest.raises(M.ModelLoadError, match="never downloads"):
        M.resolve_path(str(tmp_path / "nope"), "model.policy")
    with pytest.raises(M.ModelLoadError, match="unknown preset"):
        M.resolve_path("preset:huge")


def test_dropout_is_off():
    lm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    M.disable_dropout(lm)
    assert lm[1].p == 0.0


def test_shared_backbone_logits_equal_plain_model_and_values_start_at_zero():
    path = presets.preset_path("nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    ids, mask = batch_ids(tok, ["sort: cat dog\nanswer:", "add: 1 2\nanswer: 3"])
    plain = M.causal_forward(lm, ids, mask).logits
    logits, values = M.PolicyWithValueHead(lm)(ids, mask)
    assert torch.allclose(logits, plain, atol=1e-6)
    assert torch.equal(values, torch.zeros_like(values))


@pytest.mark.parametrize("runtime", ["transformers", "native"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_the_vocabulary_head_gets_a_contiguous_input(runtime, use_cache):
    """logits_to_keep slices the hidden states; a strided input makes F.linear a batched
    product that re-reads the head's weight per sequence (models.forward)."""
    path = presets.preset_path("nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok, runtime=runtime)
    seen = []
    head = lm.get_output_embeddings()
    head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    ids, mask = batch_ids(tok, ["sort: cat dog\nanswer:", "add: 1 2\nanswer: 3"])
    with torch.no_grad():
        kept = M.causal_forward(lm, ids, mask, keep_last=3, use_cache=use_cache).logits
        full = M.causal_forward(lm, ids, mask).logits
    assert seen[0].shape[:2] == (2, 3) and seen[0].is_contiguous()
    # the strided product the head ran before: the same logits up to float rounding
    strided = torch.nn.functional.linear(seen[1][:, -3:], head.weight)
    assert not seen[1][:, -3:].is_contiguous()
    torch.testing.assert_close(kept, strided, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept, full[:, -3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision,tol", [("bf16", 0.05), ("int8", 0.05)])
def test_low_precision_reference_logprobs_stay_close_to_fp32(precision, tol):
    """Stated tolerance: max |Δ log-prob| < 0.05 nats per token on the tiny preset."""
    path = presets.preset_path("tiny")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    ids, mask = batch_ids(tok, ["reverse: cat dog sun\nanswer: sun dog cat", "add: 4 5\nanswer: 9"])
    with torch.no_grad():
        ref32 = seq_logprobs(M.make_reference(lm, "fp32"), ids, mask)
        low = seq_logprobs(M.make_reference(lm, precision), ids, mask)
    assert low.dtype == torch.float32
    diff = (low - ref32)[mask[:, 1:].bool()].abs().max().item()
    assert 0 < diff < tol


def test_lora_reference_is_the_base_model_without_a_copy():
    path = presets.preset_path("nano")
    tok = M.load_tokenizer(path)
    base_logits_model = M.load_causal_lm(path, tok)
    policy = M.apply_lora(M.load_causal_lm(path, tok), r=4, alpha=8, targets=["q_proj", "v_proj"])
    with torch.no_grad():  # move the adapter away from its zero init, as training would
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ref = M.make_reference(policy)
    assert isinstance(ref, M.LoraReference)
    ids, mask = batch_ids(tok, ["copy: red blue\nanswer: red blue"])
    with torch.no_grad():
        expect = M.causal_forward(base_logits_model, ids, mask).logits
        got = M.causal_forward(ref, ids, mask).logits
        trained = M.causal_forward(policy, ids, mask).logits
    assert torch.allclose(got, expect, atol=1e-5)
    assert not torch.allclose(trained, expect, atol=1e-3)
    with pytest.raises(M.ModelLoadError, match="LoRA"):
        M.make_reference(policy, "int8")


def test_reward_model_with_foreign_tokenizer_scores_text_as_called_directly(foreign_rm):
    policy_tok = M.load_tokenizer(presets.preset_path("nano"))
    rm_tok = M.load_tokenizer(foreign_rm)
    assert not M.same_tokenizer(policy_tok, rm_tok)
    rm = M.freeze(M.load_sequence_classifier(foreign_rm, rm_tok))
    source = ModelReward(rm, rm_tok, policy_tok)
    assert source.reencode
    prompts, responses = ["sort: dog cat\nanswer:", "add: 2 2\nanswer:"], [" cat dog", " 4"]
    seqs, mask = batch_ids(policy_tok, [p + r for p, r in zip(prompts, responses)])
    got = source(RewardBatch(prompts, responses, seqs, mask, [True, True]))["rm/score"]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        # prompt and answer encoded apart, as a rollout keeps them (rewards.encode_for_reward)
        ids = rm_tok(p, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ids + rm_tok(r, add_special_tokens=False)["input_ids"]])
        ids = torch.cat([ids, torch.tensor([[rm_tok.eos_token_id]])], 1)
        with torch.no_grad():
            direct = rm(input_ids=ids).logits[0, 0]
        assert got[i].item() == pytest.approx(direct.item(), abs=1e-5)


def test_function_reward_errors_name_the_function():
    batch = RewardBatch(["p1", "p2"], ["a", "b"])
    ok = FunctionReward("rlhflab.builtin.tasks:gold_reward")
    assert set(ok(RewardBatch(["add: 1 1\nanswer:"], [" 2"]))) == {"gold"}
    with pytest.raises(RewardError, match="tests.reward_fns:wrong_count.*1 values for 2"):
        FunctionReward("tests.reward_fns:wrong_count")(batch)
    with pytest.raises(RewardError, match="tests.reward_fns:boom raised ZeroDivisionError"):
        FunctionReward("tests.reward_fns:boom")(batch)
    with pytest.raises(RewardError, match="no function missing"):
        FunctionReward("tests.reward_fns:missing")
    column = CallableReward(lambda p, r: [[1.0], [2.0]], name="column")(batch)
    assert column["column"].tolist() == [1.0, 2.0]  # one number per answer, as a column
    row = CallableReward(lambda p, r: [[1.0, 2.0]], name="row")(batch)
    assert row["row"].tolist() == [1.0, 2.0]  # or as a row
    with pytest.raises(RewardError, match=r"component 'grid' has shape \(2, 2\)"):
        CallableReward(lambda p, r: [[1.0, 2.0], [3.0, 4.0]], name="grid")(batch)
    with pytest.raises(RewardError, match="module:function"):
        FunctionReward("just_a_name")
    # an empty dict added 0 to every score: trained on nothing, silently
    with pytest.raises(RewardError, match="empty returned an empty dict"):
        CallableReward(lambda p, r: {}, name="empty")(batch)
    with pytest.raises(RewardError, match="names must be non-empty strings, got 3"):
        CallableReward(lambda p, r: {3: [1.0, 2.0]}, name="int")(batch)
    # two sources giving one component: both counted, but the log kept only one
    both = CompositeReward(
        [
            (CallableReward(lambda p, r: {"x": [1.0, 1.0]}, name="a"), 1.0),
            (CallableReward(lambda p, r: {"x": [2.0, 2.0]}, name="b"), 1.0),
        ]
    )
    with pytest.raises(RewardError, match="'x' comes from both a and b"):
        both(batch)


def cast_config(**over):
    base = {"model": {"policy": "preset:nano"}, "device": "cpu"}
    return load_config(base=base, overrides=[f"{k}={v}" for k, v in over.items()])


def test_cast_layouts_and_mixed_rewards(nano_rm):
    cfg = cast_config(
        **{
            "reward.model": str(nano_rm),
            "reward.heads": "{correctness: 1.0, politeness: 0.5}",
            "reward.functions": "{'rlhflab.builtin.tasks:gold_reward': 2.0}",
        }
    )
    cast = build_cast(cfg)
    assert cast.value_layout == "from_reward"  # auto: the RM shares the tokenizer
    prompts, responses = ["copy: red\nanswer:"] * 2, [" red", " Great question! red"]
    seqs, mask = batch_ids(
        cast.tokenizer, [p + r + cast.tokenizer.eos_token for p, r in zip(prompts, responses)]
    )
    out = cast.reward(RewardBatch(prompts, responses, seqs, mask))
    c = out.components
    assert set(c) == {"rm/correctness", "rm/brevity", "rm/politeness", "gold"}
    expect = c["rm/correctness"] + 0.5 * c["rm/politeness"] + 2.0 * c["gold"]
    assert torch.allclose(out.score, expect)
    # The critic starts out predicting the weighted RM score at the last token.
    values = M.token_values(cast.critic, seqs, mask)
    rm_part = c["rm/correctness"] + 0.5 * c["rm/politeness"]
    last = mask.sum(1) - 1  # right-padded
    assert torch.allclose(values[torch.arange(2), last], rm_part, atol=1e-5)


def test_cast_shared_and_lora_int8_layouts(nano_rm):
    shared = build_cast(
        cast_config(
            **{
                "reward.model": str(nano_rm),
                "model.value_model": "shared",
                "model.reference_precision": "int8",
                "model.reward_precision": "int8",
            }
        )
    )
    assert shared.critic is None and isinstance(shared.policy, M.PolicyWithValueHead)
    lora = build_cast(
        cast_config(
            **{
                "reward.functions": "{'rlhflab.builtin.tasks:gold_reward': 1.0}",
                "model.lora_r": 4,
                "model.value_model": "shared",
            }
        )
    )
    assert isinstance(lora.reference, M.LoraReference)
    trainable = [n for n, p in lora.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n or "value_head" in n for n in trainable)


def test_separate_critic_must_share_the_tokenizer(foreign_rm, tmp_path):
    other = presets.build_preset("nano", tmp_path / "c", corpus=["x y z"] * 10)
    cfg = cast_config(
        **{
            "reward.functions": "{'rlhflab.builtin.tasks:gold_reward': 1.0}",
            "model.critic": str(other),
        }
    )
    with pytest.raises(M.ModelLoadError, match="does not share the policy's tokenizer"):
        build_cast(cfg)
    cfg = cast_config(**{"reward.model": str(foreign_rm), "model.value_model": "from_reward"})
    with pytest.raises(M.ModelLoadError, match="share the policy's tokenizer"):
        build_cast(cfg)


def test_ignore_eos_samples_full_length_even_when_eos_is_certain():
    from rlhflab.experience.sampling import sample

    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    eos = tok.eos_token_id
    # make EOS the only token the model ever samples
    lm.lm_head.register_forward_hook(
        lambda mod, inp, out: out.index_fill(-1, torch.tensor([eos]), 1e4)
    )
    ids = torch.tensor([tok("2 + 2", add_special_tokens=False)["input_ids"]] * 3)
    mask = torch.ones_like(ids)
    gen = torch.Generator().manual_seed(0)
    resp, rmask, ended = sample(lm, ids, mask, 5, eos, tok.pad_token_id, generator=gen)
    assert resp.shape == (3, 1) and ended.all() and rmask.sum() == 3  # stops at the first EOS
    resp, rmask, ended = sample(lm, ids, mask, 5, None, tok.pad_token_id, generator=gen)
    assert resp.shape == (3, 5) and (resp == eos).all()
    assert rmask.all() and not ended.any()  # EOS was an ordinary token: full length, no end


def test_gradient_checkpointing_keeps_the_gradients(nano_rm):
    from rlhflab.experience.rollout import policy_outputs

    cfg = load_config(
        overrides=[
            "model.policy=preset:nano",
            f"reward.model={nano_rm}",
            "model.value_model=from_reward",
        ]
    )
    plain = build_cast(cfg)
    cfg.model.gradient_checkpointing = True
    ckpt = build_cast(cfg)
    assert M.is_checkpointing(ckpt.policy) and M.is_checkpointing(ckpt.critic.model)
    assert not M.is_checkpointing(plain.policy)
    tok = plain.tokenizer
    ids, mask = batch_ids(tok, ["copy: tree lime\nanswer: tree lime", "sort: b a\nanswer: a b"])
    grads = []
    for cast in (plain, ckpt):
        cast.policy.train()
        lp, _, _ = policy_outputs(cast.policy, ids, mask, 4, ids[:, 4:], 1.0)
        cast.policy.zero_grad()
        (lp * mask[:, 4:]).sum().backward()
        grads.append([p.grad.clone() for p in cast.policy.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("lean_on", [True, False])
def test_cast_swaps_lean_modules_into_trained_models_only_when_asked(nano_rm, lean_on):
    from rlhflab.backends.lean import LeanRMSNorm, LeanSwiGLU

    cfg = cast_config(
        **{"reward.model": str(nano_rm), "model.lean_activations": str(lean_on).lower()}
    )
    cast = build_cast(cfg)
    for model in (cast.policy, cast.critic):
        kinds = {type(m) for m in model.modules()}
        assert (LeanSwiGLU in kinds and LeanRMSNorm in kinds) == lean_on
    # the frozen reward model is never touched
    reward_model = next(s for s, _ in cast.reward.sources if isinstance(s, ModelReward)).model
    assert not any(isinstance(m, (LeanRMSNorm, LeanSwiGLU)) for m in reward_model.modules())


def test_lora_makes_the_default_critic_a_head_on_the_policy_backbone(nano_rm):
    """model.value_model=auto with LoRA (issue #26): no full critic beside the adapters; what
    trains is the adapters and one value head, a few thousand weights, not a model copy."""
    cast = build_cast(cast_config(**{"reward.model": str(nano_rm), "model.lora_r": 4}))
    assert cast.value_layout == "shared" and cast.critic is None
    trainable = {n: p.numel() for n, p in cast.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "value_head" in n for n in trainable)
    total = sum(p.numel() for p in cast.policy.parameters())
    # r=4 adapters on every Linear layer (model.lora_targets=all-linear) of nano's 32-wide
    # layers: about a ninth of it; a critic would be all of it again
    assert sum(trainable.values()) < 0.15 * total
    # without LoRA the default is unchanged: the critic starts from the reward model
    assert build_cast(cast_config(**{"reward.model": str(nano_rm)})).value_layout == "from_reward"


def test_a_reward_module_in_the_working_directory_imports_however_the_command_started(
    tmp_path, monkeypatch
):
    # issue #31: it imported only after the allocator's restart (python -m puts the working
    # directory on sys.path; the console script does not)
    import sys

    from rlhflab.experience.rewards import FunctionReward

    (tmp_path / "my_local_reward.py").write_text(
        "def score(prompts, answers):\n    return [1.0] * len(prompts)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_local_reward", raising=False)
    reward = FunctionReward("my_local_reward:score")
    assert reward.fn(["a", "b"], ["x", "y"]) == [1.0, 1.0]
    # a module whose own code fails (a syntax error, a raise at import) is one RewardError
    # naming it, not the import's traceback
    from rlhflab.experience.rewards import RewardError

    (tmp_path / "broken_reward.py").write_text("def score(prompts, answers)\n")
    (tmp_path / "raising_reward.py").write_text("raise RuntimeError('no API key')\n")
    with pytest.raises(RewardError, match=r"'broken_reward:score': importing .* SyntaxError"):
        FunctionReward("broken_reward:score")
    with pytest.raises(RewardError, match=r"raising_reward failed: RuntimeError: no API key"):
        FunctionReward("raising_reward:score")
