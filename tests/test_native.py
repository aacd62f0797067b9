"""The native Llama runtime against transformers' LlamaForCausalLM on the same files."""

import json
import subprocess
import sys

import pytest
import torch

from rlhflab import models as M
from rlhflab.backends.lean import make_activations_lean
from rlhflab.backends.native import KVCache, apply_rotary, attention_mask_4d
from rlhflab.backends.native_config import NativeConfigError, read_config
from rlhflab.backends.native_models import load_native
from rlhflab.infra.checkpoint import CheckpointError
from rlhflab.models.presets import build_preset, preset_path
from tests.test_lean import tiny_llama


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory):
    """A 2-layer Llama with grouped-query attention, untied head and biases, saved by
    transformers (so the native loader reads transformers' own files)."""
    model = tiny_llama(
        vocab_size=438,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    out = tmp_path_factory.mktemp("gqa")
    model.save_pretrained(out)
    # a tokenizer for _fit_vocab and the samplers: the nano preset's
    M.load_tokenizer(preset_path("nano")).save_pretrained(out)
    return out


def _batch():
    """Two left-padded prompts and one unpadded, as rlhflab's rollouts look."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 400, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3], mask[1, :1] = 0, 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("which", ["nano", "gqa"])
def test_logits_and_hidden_states_match_transformers(which, gqa_folder):
    folder = preset_path("nano") if which == "nano" else gqa_folder
    tok = M.load_tokenizer(folder)
    hf = M.load_causal_lm(folder, tok, dtype=torch.float32).eval()
    nat = M.load_causal_lm(folder, tok, dtype=torch.float32, runtime="native").eval()
    assert type(nat).__name__ == "NativeLlamaForCausalLM"
    assert set(nat.state_dict()) == set(hf.state_dict())
    ids, mask = _batch()
    real = mask.bool()
    a = M.causal_forward(hf, ids, mask).logits
    b = M.causal_forward(nat, ids, mask).logits
    torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)
    kept = M.causal_forward(nat, ids, mask, keep_last=4).logits  # float64 test below
    torch.testing.assert_close(kept, b[:, -4:], rtol=1e-5, atol=1e-6)
    ha, hb = M.backbone_hidden(hf, ids, mask), M.backbone_hidden(nat, ids, mask)
    torch.testing.assert_close(hb[real], ha[real], rtol=1e-5, atol=1e-5)
    # the lean activations recognise the native blocks (2 norms + MLP per layer, final norm)
    layers = nat.config.num_hidden_layers
    assert make_activations_lean(nat) == 3 * layers + 1
    torch.testing.assert_close(M.causal_forward(nat, ids, mask).logits, b, rtol=0, atol=0)


@pytest.mark.parametrize("padded", [True, False])
def test_last_layer_runs_on_the_kept_rows_only_and_changes_nothing(padded, gqa_folder):
    """keep_last: the native last layer computes queries, attention and MLP for the kept
    rows only (a hook sees their count), and logits, values, a reward model's last-token
    state and every parameter's gradient equal the full forward's, in float64. Unpadded
    batches take the bottom-right causal mask, padded ones the sliced padding mask."""
    tok = M.load_tokenizer(gqa_folder)
    nat = M.load_causal_lm(gqa_folder, tok, dtype=torch.float64, runtime="native").eval()
    ids, mask = _batch()
    if not padded:
        mask = torch.ones_like(mask)
    rows_seen = []
    last_mlp = nat.model.layers[-1].mlp
    last_mlp.register_forward_hook(lambda mod, args, out: rows_seen.append(args[0].shape[1]))

    def grads(loss):
        nat.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in nat.named_parameters()}

    weights = torch.randn(3, 4, nat.config.vocab_size, dtype=torch.float64)
    full = M.causal_forward(nat, ids, mask).logits
    want = grads((full[:, -4:] * weights).sum())
    kept = M.causal_forward(nat, ids, mask, keep_last=4).logits
    got = grads((kept * weights).sum())
    assert rows_seen == [9, 4]
    torch.testing.assert_close(kept, full[:, -4:], rtol=1e-12, atol=1e-12)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
    # as many rows as the sequence, or more: the full forward
    for n in (9, 20):
        torch.testing.assert_close(M.causal_forward(nat, ids, mask, keep_last=n).logits, full)
    assert rows_seen[-2:] == [9, 9]
    with torch.no_grad():
        hidden = M.backbone_hidden(nat, ids, mask)
        torch.testing.assert_close(M.backbone_hidden(nat, ids, mask, keep_last=3), hidden[:, -3:])
        # a reward model's pooling: right-padded rows end at 5, 8 and 6
        right = torch.ones_like(mask)
        right[0, 6:], right[2, 7:] = 0, 0
        last = torch.tensor([5, 8, 6])
        want_last = M.backbone_hidden(nat, ids, right)[torch.arange(3), last]
        del rows_seen[:]
        torch.testing.assert_close(M.last_token_hidden(nat, ids, right), want_last)
        assert rows_seen == [4]  # the last layer from the earliest last token (5) on


def test_checkpointed_layers_give_the_same_gradients_and_keep_fewer_tensors(gqa_folder):
    """model.gradient_checkpointing on the native runtime: the same float64 gradients,
    and the decoder layers' activations are not kept by the forward."""
    tok = M.load_tokenizer(gqa_folder)
    nat = M.load_causal_lm(gqa_folder, tok, dtype=torch.float64, runtime="native").train()
    ids, mask = _batch()
    weights = torch.randn(3, 9, nat.config.vocab_size, dtype=torch.float64)

    def storage_ref(t):  # whether a tensor's memory is still held, whoever holds it
        ref = t.untyped_storage()._weak_ref()
        return lambda: not torch.UntypedStorage._expired(ref)

    normed = []  # the first layer's normalised input, which q/k/v keep for backward
    second = []  # the second layer's
    freed_in_time = []  # layer 1's recomputed input gone when layer 0 is recomputed

    def first_layer(mod, args, out):
        normed.append(storage_ref(out))
        if len(normed) == 3:  # backward runs the last layer first
            freed_in_time.append(not second[-1]())

    nat.model.layers[0].input_layernorm.register_forward_hook(first_layer)
    nat.model.layers[1].input_layernorm.register_forward_hook(
        lambda mod, args, out: second.append(storage_ref(out))
    )

    def run():
        nat.zero_grad()
        loss = (M.causal_forward(nat, ids, mask).logits * weights).sum()
        alive = normed[-1]()  # after the forward, before the backward
        loss.backward()
        return alive, {n: p.grad.clone() for n, p in nat.named_parameters()}

    kept_plain, want = run()
    nat.gradient_checkpointing_enable()
    kept_ckpt, got = run()
    assert kept_plain and not kept_ckpt
    assert len(normed) == 3  # forward, forward, and the recomputation in backward
    assert freed_in_time == [True]  # each layer's recomputed tensors go once used
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


def test_transformers_backbone_keeps_the_same_rows(gqa_folder):
    """The keep_last contract holds for transformers' models too (rows dropped after)."""
    tok = M.load_tokenizer(gqa_folder)
    hf = M.load_causal_lm(gqa_folder, tok, dtype=torch.float64).eval()
    ids, mask = _batch()
    with torch.no_grad():
        hidden = M.backbone_hidden(hf, ids, mask)
        torch.testing.assert_close(M.backbone_hidden(hf, ids, mask, keep_last=3), hidden[:, -3:])
        torch.testing.assert_close(M.last_token_hidden(hf, ids, mask), hidden[:, -1])


@pytest.mark.parametrize("compiling", [False, True])
def test_rotary_is_transformers_expression_and_its_gradient_the_inverse_rotation(
    compiling, monkeypatch
):
    """apply_rotary on a transposed (B, heads, L, d) view, against q·cos + rotate_half(q)·sin
    written out with the repeated angles, in float64; gradcheck for the backward. Also the
    expression torch.compile traces instead of the out= kernel inductor cannot take."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    B, H, L, D = 2, 3, 5, 8
    q = torch.randn(B, L, H, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    angles = torch.randn(B, 1, L, D // 2, dtype=torch.float64)
    c, s = angles.cos(), angles.sin()
    cos, sin = torch.cat((c, c), -1), torch.cat((s, s), -1)
    rotate_half = torch.cat((-q[..., D // 2 :], q[..., : D // 2]), -1)
    torch.testing.assert_close(apply_rotary(q, c, s), q * cos + rotate_half * sin)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, c, s), (q,))
    with torch.no_grad():  # the no-grad path is the same function
        torch.testing.assert_close(apply_rotary(q, c, s), q * cos + rotate_half * sin)


def test_kv_cache_growing_in_place_holds_what_concatenation_would():
    """Appends of 1 and 2 positions across several doublings of the buffers, two layers;
    then one prompt's cache repeated for its continuations."""
    cache, keys, values = KVCache(), [], []
    for chunk in (3, 1, 1, 2, 1, 1, 1, 1, 2, 1):
        for layer in range(2):
            k, v = torch.randn(2, 3, chunk, 4), torch.randn(2, 3, chunk, 4)
            if layer == len(keys):
                keys.append(k)
                values.append(v)
            else:
                keys[layer] = torch.cat([keys[layer], k], 2)
                values[layer] = torch.cat([values[layer], v], 2)
            got_k, got_v = cache.update(layer, k, v)
            assert torch.equal(got_k, keys[layer]) and torch.equal(got_v, values[layer])
    assert cache.get_seq_length() == 14
    cache.batch_repeat_interleave(2)
    k, v = torch.randn(4, 3, 1, 4), torch.randn(4, 3, 1, 4)
    got_k, _ = cache.update(0, k, v)
    want = torch.cat([keys[0].repeat_interleave(2, 0), k], 2)
    assert torch.equal(got_k, want)


def test_cached_decoding_equals_one_full_forward(gqa_folder):
    """Prefill + one token at a time through the KV cache = the whole sequence at once."""
    tok = M.load_tokenizer(gqa_folder)
    nat = M.load_causal_lm(gqa_folder, tok, dtype=torch.float32, runtime="native").eval()
    ids, mask = _batch()
    full = M.causal_forward(nat, ids, mask).logits
    pos = M.position_ids_from_mask(mask)
    out = nat(ids[:, :6], mask[:, :6], pos[:, :6], use_cache=True)
    steps = [out.logits]
    for t in range(6, 9):
        out = nat(ids[:, t : t + 1], mask[:, : t + 1], pos[:, t : t + 1], out.past_key_values)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], full[mask.bool()])


def test_sampler_draws_the_same_answers_as_with_transformers():
    """Same seed, same prompts: the samplers agree token for token (fp64 removes ties)."""
    from rlhflab.experience.sampling import sample

    folder = preset_path("nano")
    tok = M.load_tokenizer(folder)
    ids, mask = _batch()
    answers = []
    for runtime in ("transformers", "native"):
        lm = M.load_causal_lm(folder, tok, dtype=torch.float32, runtime=runtime).eval()
        gen = torch.Generator().manual_seed(3)
        answers.append(sample(lm, ids, mask, 12, tok.eos_token_id, tok.pad_token_id, generator=gen))
    for x, y in zip(*answers):
        assert torch.equal(x, y)


def test_classifier_scores_and_gradients_match_transformers(nano_rm):
    tok = M.load_tokenizer(nano_rm)
    hf = M.load_sequence_classifier(nano_rm, tok)
    nat = M.load_sequence_classifier(nano_rm, tok, runtime="native")
    assert nat.config.id2label == hf.config.id2label and nat.config.num_labels == 3
    ids, mask = _batch()
    losses = []
    for model in (hf, nat):
        values = model.score(M.backbone_hidden(model, ids, mask))
        losses.append((values * mask[..., None]).pow(2).sum())
        losses[-1].backward()
        with torch.no_grad():  # transformers' pooling: the last non-pad token
            torch.testing.assert_close(
                model(input_ids=ids, attention_mask=mask).logits, values[:, -1]
            )
    torch.testing.assert_close(losses[1], losses[0])
    grads = dict(hf.named_parameters())
    for name, p in nat.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5)


def test_saved_native_model_loads_in_transformers_and_back(tmp_path, gqa_folder):
    tok = M.load_tokenizer(gqa_folder)
    nat = M.load_causal_lm(gqa_folder, tok, runtime="native")
    with torch.no_grad():
        nat.lm_head.weight.add_(0.01)  # a trained change must survive the round trip
    nat.save_pretrained(tmp_path)
    hf = M.load_causal_lm(tmp_path, tok)
    back = M.load_causal_lm(tmp_path, tok, runtime="native")
    ids, mask = _batch()
    ref = M.causal_forward(nat, ids, mask).logits[mask.bool()]
    for model in (hf, back):
        torch.testing.assert_close(M.causal_forward(model, ids, mask).logits[mask.bool()], ref)
    # a classifier made from the causal LM keeps its backbone and gets a fresh head
    clf = M.load_sequence_classifier(tmp_path, tok, num_labels=2, runtime="native")
    torch.testing.assert_close(
        M.backbone_hidden(clf, ids, mask)[mask.bool()],
        M.backbone_hidden(nat, ids, mask)[mask.bool()],
    )
    assert clf.score.weight.shape == (2, 32)


def test_unsupported_checkpoints_are_refused_with_the_field_named(tmp_path):
    folder = build_preset("nano", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    for field, value, named in [
        ("model_type", "qwen3", "model_type"),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}, "rope_type"),
        ("hidden_act", "gelu", "hidden_act"),
    ]:
        (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(NativeConfigError, match=named):
            read_config(folder)
        with pytest.raises(M.ModelLoadError, match=named):
            M.load_causal_lm(folder, None, runtime="native")
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").unlink()
    with pytest.raises(NativeConfigError, match="safetensors"):
        load_native(folder, "causal")


def test_pad_queries_see_themselves_so_no_row_is_empty():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    m = attention_mask_4d(mask, 4)
    assert m.shape == (2, 1, 4, 4) and bool(m.any(-1).all())
    assert m[0, 0, 3].tolist() == [False, False, True, True]  # real query: real keys only
    assert attention_mask_4d(torch.ones(2, 4, dtype=torch.long), 4) is None  # causal kernel


@pytest.mark.parametrize("checkpointing", [False, True])
def test_native_ppo_run_never_imports_transformers_modelling(tmp_path, checkpointing):
    """The point of the runtime: a whole PPO iteration without transformers' model code or
    torch's compiler stack (sympy), activation checkpointing included."""
    # the preset built here first: building it (once per cache) runs transformers' own model
    # code, which the run itself must not need
    from rlhflab.models.presets import preset_path

    preset_path("nano")
    script = f"""
import sys
from rlhflab.config import load_config
from rlhflab.trainers.ppo import PPOTrainer
cfg = load_config(base={{"model": {{"policy": "preset:nano", "runtime": "native",
    "gradient_checkpointing": {checkpointing}}},
    "reward": {{"functions": {{"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}}}},
    "rollout": {{"prompts_per_iteration": 4, "max_new_tokens": 4}},
    "ppo": {{"iterations": 1}}, "log": {{"output_dir": {str(tmp_path)!r}, "progress": False}}}})
PPOTrainer(cfg).fit()
heavy = [m for m in ("transformers.modeling_utils", "torch.distributed.tensor", "sympy")
         if m in sys.modules]
print("HEAVY", heavy)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HEAVY []" in done.stdout


def test_resume_copies_each_saved_tensor_into_the_model_and_names_a_mismatch(tmp_path, gqa_folder):
    from safetensors.torch import load_file, save_file

    from rlhflab.infra.checkpoint import load_weights_into

    model = load_native(gqa_folder, "causal")
    saved = load_file(str(gqa_folder / "model.safetensors"))
    where = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_weights_into(model, gqa_folder)
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    assert {k: v.data_ptr() for k, v in state.items()} == where  # in place, no new tensors
    bad = tmp_path / "bad"
    bad.mkdir()
    name = "model.norm.weight"
    save_file({**saved, name: torch.ones(3)}, str(bad / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors: tensor '{name}' has shape \[3\]"
    ):
        load_weights_into(model, bad)
    rest = {k: v for k, v in saved.items() if k != name}
    save_file({**rest, "extra": torch.ones(1)}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"missing \['{name}'\], unexpected \['extra'\]"):
        load_weights_into(model, bad)
