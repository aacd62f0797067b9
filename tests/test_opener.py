"""The monitor's flattery-opener probe (experience/opener.py): its numbers against a plain
loop over prompts and spellings, on the iteration's own prompt caches, under eager
attention, and the one-time check of the tree-shaped mask."""

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.trainers.ppo import PPOTrainer
from tests.test_monitor import tiny_cfg


def test_opener_logprobs_match_a_plain_loop_over_prompts_and_spellings():
    from rlhflab import models as M
    from rlhflab.experience.opener import opener_logprobs
    from rlhflab.experience.rollout import left_pad

    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    prompts = ["copy: tree lime\nanswer:", "sort: rock snow apple\nanswer:", "x"]
    phrases = ["Great question", "我很乐意帮助你"]
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids, mask = left_pad(encoded, tok.pad_token_id)
    got = opener_logprobs(lm, tok, ids, mask, phrases, temperature=0.7, micro_batch=3)
    cut = opener_logprobs(lm, tok, ids, mask, phrases, 0.7, micro_batch=3, max_tokens=1)
    assert (cut >= got - 1e-6).all() and (cut > got + 1e-3).any()  # a prefix is likelier
    for b, p in enumerate(encoded):
        spellings = []
        for v in [s for ph in phrases for s in (ph, " " + ph)]:
            r = tok(v, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = lm(torch.tensor([p + r])).logits[0].double() / 0.7
            logp = torch.log_softmax(logits[len(p) - 1 : len(p) + len(r) - 1], -1)
            spellings.append(logp.gather(1, torch.tensor(r)[:, None]).sum())
        assert float(got[b]) == pytest.approx(
            float(torch.logsumexp(torch.stack(spellings), 0)), abs=1e-4
        )
    # the same opening listed twice (with its space, or alike in the kept tokens) counts once
    again = opener_logprobs(lm, tok, ids, mask, [*phrases, " Great question"], 0.7, 3)
    torch.testing.assert_close(again, got)
    # micro-batching over prompts changes nothing
    torch.testing.assert_close(
        opener_logprobs(lm, tok, ids, mask, phrases, 0.7, micro_batch=1), got
    )
    # a forward per spelling (for models whose attention takes no tree mask) is the same
    from rlhflab.experience import opener

    opener._TREE_MASK[lm] = False
    torch.testing.assert_close(opener_logprobs(lm, tok, ids, mask, phrases, 0.7, 2), got)


def test_the_tree_mask_check_catches_a_model_that_misreads_padding(monkeypatch):
    """The one-time check runs a padded row too, without autocast: a model whose 4-D mask
    lets queries see the padding (a first prompt without padding passed it before) is
    probed by a forward per spelling, with the plain loop's numbers."""
    from rlhflab import models as M
    from rlhflab.experience import opener
    from rlhflab.experience.rollout import left_pad

    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)

    def sharp():  # weights large enough that attending the padding shows
        lm = M.load_causal_lm(path, tok)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for q in lm.parameters():
                q.normal_(0, 0.3, generator=gen)
        return lm

    lm, lm2 = sharp(), sharp()  # two model objects: each checked on its own
    sp = opener.spellings(tok, ["Great question", "What a wonderful"], 4)
    assert opener.takes_tree_mask(lm, sp, 1.0)

    def sees_padding(model, sees):
        sees = sees.clone()
        sees[..., : sees.shape[-1] - sp.tokens.shape[0]] = True
        return sees

    monkeypatch.setattr(opener, "_as_model_mask", sees_padding)
    assert not opener.takes_tree_mask(lm2, sp, 1.0)
    ids, mask = left_pad([tok("copy: a b c\nanswer:")["input_ids"], [5, 6]], tok.pad_token_id)
    monkeypatch.undo()
    want = opener.opener_logprobs(
        lm, tok, ids, mask, ["Great question", "What a wonderful"], 1.0, 2
    )
    monkeypatch.setattr(opener, "_as_model_mask", sees_padding)
    got = opener.opener_logprobs(
        lm2, tok, ids, mask, ["Great question", "What a wonderful"], 1.0, 2
    )
    torch.testing.assert_close(got, want)


def opener_cast(runtime: str, lora: bool):
    """A float64 nano cast (policy and reference) for the opener probe's reuse tests."""
    from rlhflab.experience.cast import build_cast

    over = {
        "reward.functions": "{'rlhflab.builtin.toy_rewards:vowel_reward': 1.0}",
        "model.runtime": runtime,
        "model.lora_r": 4 if lora else 0,
    }
    base = {"model": {"policy": "preset:nano"}, "device": "cpu"}
    cast = build_cast(load_config(base=base, overrides=[f"{k}={v}" for k, v in over.items()]))
    cast.policy.double()
    if not lora:  # a LoRA reference is the policy's own base
        cast.reference.double()
    if lora:  # adapters that are not zero, so the policy and the reference differ
        for name, q in cast.policy_lm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(q, std=0.2, generator=torch.Generator().manual_seed(0))
    return cast


@pytest.mark.parametrize(
    "runtime,lora", [("transformers", False), ("native", False), ("transformers", True)]
)
def test_the_opener_probe_on_the_iterations_own_prompt_caches_is_the_plain_probe(runtime, lora):
    """The probe extends the KV caches that sampling (policy) and scoring (reference) kept,
    and probes each distinct prompt once: the same log-probabilities, in float64, as
    running every prompt and spelling from scratch; keeping the caches changes neither the
    samples nor the reference's log-probs."""
    from rlhflab.experience.opener import PromptCaches, opener_logprobs
    from rlhflab.experience.rollout import generate_rollout, score_rollout

    cast = opener_cast(runtime, lora)
    tok = cast.tokenizer
    # repeated prompts (GRPO's groups), and phrases sharing their first tokens (a tree)
    prompts = ["copy: tree lime\nanswer:", "x", "copy: tree lime\nanswer:", "sort: a b\nanswer:"]
    phrases = ["Great question", "Great point", "What a wonderful"]
    runs = {}
    for keep in (False, True):
        caches = {role: PromptCaches(chunk=2) for role in ("policy", "reference")} if keep else {}
        gen = torch.Generator().manual_seed(3)
        ro = generate_rollout(
            cast.policy_lm,
            tok,
            prompts,
            5,
            0.7,
            0,
            1.0,
            gen,
            "cpu",
            prompt_caches=caches.get("policy"),
        )
        score_rollout(cast, ro, 0.7, 3, prompt_caches=caches.get("reference"))
        runs[keep] = ro, caches
    (plain, _), (kept, caches) = runs[False], runs[True]
    assert torch.equal(plain.response_ids, kept.response_ids)
    assert torch.equal(plain.ref_logprobs, kept.ref_logprobs)
    assert [len(p.rows) for p in caches["policy"].parts] == [2, 1]  # 3 distinct prompts
    args = (kept.prompt_ids, kept.prompt_mask, phrases, 0.7, 2)
    for role, model in (("policy", cast.policy_lm), ("reference", cast.reference)):
        reused = opener_logprobs(model, tok, *args, prefixes=caches[role].parts)
        own = opener_logprobs(model, tok, *args)
        every = opener_logprobs(model, tok, *args, distinct=False)
        assert reused.dtype == torch.float64
        torch.testing.assert_close(reused, own, rtol=0, atol=1e-10)
        torch.testing.assert_close(every, own, rtol=0, atol=1e-10)
        assert reused[0] == reused[2]
        # a plain loop: each prompt + spelling from scratch, no cache, no tree
        for b, p in enumerate(tok(prompts, add_special_tokens=False)["input_ids"]):
            spellings = []
            for v in [s for ph in phrases for s in (ph, " " + ph)]:
                r = tok(v, add_special_tokens=False)["input_ids"][:4]
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([p + r])).logits[0] / 0.7
                logp = torch.log_softmax(logits[len(p) - 1 : len(p) + len(r) - 1], -1)
                spellings.append(logp.gather(1, torch.tensor(r)[:, None]).sum())
            want = torch.logsumexp(torch.stack(spellings), 0)
            assert float(reused[b]) == pytest.approx(float(want), abs=1e-10)
        # the token tree, not the forward per spelling (a LoRA reference is no nn.Module)
        from rlhflab.experience.opener import _TREE_MASK

        assert _TREE_MASK[model] is True, role


@pytest.mark.parametrize("runtime", ["transformers", "native"])
def test_the_opener_probe_leaves_the_run_bit_identical(tmp_path, runtime):
    """On, the probe has sampling and scoring keep the prompts' caches (the reference's
    scoring forward keeps its cache then): the run trains to the same weights, bit for bit,
    as with the probe off."""
    weights = {}
    for ratio in ("1.3", "null"):
        over = (f"monitor.flattery_opener_ratio={ratio}", f"model.runtime={runtime}")
        over += ("monitor.opener_every=1",)
        t = PPOTrainer(tiny_cfg(tmp_path / ratio, *over))
        for _ in range(2):
            m = t.step()
            t.iteration += 1
        assert ("monitor/flattery_opener_ratio" in m) == (ratio != "null")
        weights[ratio] = [q.detach().clone() for q in t.cast.policy.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights["1.3"], weights["null"]))


def test_the_opener_probe_runs_at_the_first_and_every_nth_iteration(tmp_path):
    # a threshold any probed value crosses: alerts come exactly where it was computed
    over = ("monitor.opener_every=3", "monitor.flattery_opener_ratio=1e-9")
    t = PPOTrainer(tiny_cfg(tmp_path, *over))
    rows = []
    for _ in range(4):
        rows.append(t.step())
        t.iteration += 1
    probed = ["monitor/flattery_opener_ratio" in r for r in rows]
    assert probed == [True, False, True, False]
    assert [r["time/monitor_probe"] != 0 for r in rows] == probed
    assert rows[0]["monitor/flattery_opener_ratio"] == pytest.approx(1.0, abs=1e-5)  # π = π_ref
    fired = {a.iteration for a in t.monitor.state.alerts if a.signal == "flattery_opener_ratio"}
    assert fired == {1, 3}


def test_the_opener_probe_under_eager_attention_is_the_sdpa_probe():
    """transformers' eager attention adds a 4-D mask where SDPA selects with it: the
    probe's tree mask is given to each as it wants it."""
    from rlhflab import models as M
    from rlhflab.experience.opener import opener_logprobs
    from rlhflab.experience.rollout import left_pad

    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok, dtype=torch.float64)
    # prompts of one length: eager attention is NaN on left padding's rows on its own
    encoded = tok(
        ["copy: tree lime\nanswer:", "copy: lime tree\nanswer:"], add_special_tokens=False
    )
    ids, mask = left_pad(encoded["input_ids"], tok.pad_token_id)
    assert bool(mask.all())
    args = (tok, ids, mask, ["Great question", "I'm happy to help"], 0.7, 2)
    sdpa = opener_logprobs(lm, *args)
    lm.set_attn_implementation("eager")  # its softmax runs in float32: 1e-9 apart
    torch.testing.assert_close(opener_logprobs(lm, *args), sdpa, rtol=0, atol=1e-6)
