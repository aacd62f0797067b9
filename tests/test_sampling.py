"""The sampling pass's own scores (rollout.logprobs_from_sampling) against a full forward."""

import pytest
import torch

from rlhflab import models as M
from rlhflab.experience.rollout import left_pad, policy_outputs
from rlhflab.experience.sampling import SamplingScores, draw_tokens, sample


@pytest.mark.parametrize("runtime", ["transformers", "native"])
@pytest.mark.parametrize("shared", [False, True])
def test_sampling_scores_equal_a_full_forward(runtime, shared):
    torch.manual_seed(0)
    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok, runtime=runtime)
    policy = M.PolicyWithValueHead(lm) if shared else lm
    if shared:  # a zero head would make every value 0 and hide a wrong hidden state
        torch.nn.init.normal_(policy.value_head.weight)
        torch.nn.init.normal_(policy.value_head.bias)
    prompts = ["2 + 2", "the cat sat on", "a", "red green blue sun"]
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids, mask = left_pad(encoded, tok.pad_token_id)  # rows of unequal length: left padding
    scores = SamplingScores(lm, policy.value_head) if shared else SamplingScores()
    gen = torch.Generator().manual_seed(1)
    temperature = 0.7
    resp, rmask, _ = sample(
        lm, ids, mask, 10, None, tok.pad_token_id, temperature, generator=gen, scores=scores
    )
    T = resp.shape[1]
    sampled_lp = torch.stack(scores.logprobs, 1)
    assert sampled_lp.shape == resp.shape == (4, 10)

    seqs = torch.cat([ids, resp], 1)
    full_mask = torch.cat([mask, rmask], 1)
    with torch.no_grad():
        lp, values, ent = policy_outputs(
            policy, seqs, full_mask, ids.shape[1], resp, temperature, with_entropy=True
        )
    assert lp.abs().min() > 1e-3  # real log-probs, not zeros that agree trivially
    torch.testing.assert_close(sampled_lp, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(scores.entropy, 1), ent, atol=1e-5, rtol=1e-5)
    if shared:
        assert values.shape == (4, T) and values.abs().max() > 1e-2
        torch.testing.assert_close(torch.stack(scores.values, 1), values, atol=1e-5, rtol=1e-5)
        # the hook is gone after sampling: a later forward records nothing
        M.causal_forward(lm, seqs, full_mask)
        assert len(scores.values) == T
    else:
        assert values is None and scores.values == []


def test_sampling_scores_need_both_lm_and_head():
    with pytest.raises(ValueError, match="both the LM and the value head"):
        SamplingScores(lm=torch.nn.Linear(2, 2))


def test_an_eos_that_is_also_the_pad_token_stays_in_the_mask():
    """Checkpoints whose pad id is the EOS id (issue #26): the answer mask comes from the
    first EOS, not from ``ids != pad``, so an ended answer keeps its EOS and what follows
    is padding."""
    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in ["2 + 2", "the cat sat"]]
    ids, mask = left_pad(encoded, tok.pad_token_id)
    greedy = 1e-4  # a temperature this low samples the most likely token

    def run(eos):
        gen = torch.Generator().manual_seed(0)
        return sample(lm, ids, mask, 6, eos, eos if eos is not None else 0, greedy, generator=gen)

    first, _, _ = run(None)
    eos = int(first[0, 0])  # row 0's first token plays EOS and pad at once
    resp, rmask, ended = run(eos)
    assert bool(ended[0]) and int(rmask[0].sum()) == 1 and int(resp[0, 0]) == eos
    for i in range(len(resp)):
        n = int(rmask[i].sum())
        assert rmask[i, :n].all() and not rmask[i, n:].any()  # a prefix, then padding
        assert bool(ended[i]) == (int(resp[i, n - 1]) == eos and n <= 6)
        hits = (first[i, :n] == eos).nonzero()
        assert (int(hits[0]) + 1 if len(hits) else 6) == n  # up to and including the 1st EOS


@pytest.mark.parametrize("sampler", ["multinomial", "gumbel"])
def test_each_sampler_draws_from_the_softmax(sampler):
    """rollout.sampler: both draws follow softmax(logits); a filtered (-inf) token never
    comes up. 60,000 draws per token probability: each count within 5 standard errors."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    n = 60_000
    gen = torch.Generator().manual_seed(0)
    drawn = draw_tokens(logits.expand(n, -1).contiguous(), gen, sampler)
    assert drawn.shape == (n,) and drawn.dtype == torch.int64
    counts = torch.bincount(drawn, minlength=6).double()
    p = torch.softmax(logits.double(), -1)
    assert counts[4] == 0
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * sigma + 1e-9).all(), (counts / n, p)


def test_the_gumbel_sampler_is_its_own_random_stream():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    a = draw_tokens(logits, torch.Generator().manual_seed(1), "gumbel")
    b = draw_tokens(logits, torch.Generator().manual_seed(1), "multinomial")
    assert torch.equal(a, draw_tokens(logits, torch.Generator().manual_seed(1), "gumbel"))
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="sampler must be one of"):
        draw_tokens(logits, None, "greedy")
    for bad in (float("nan"), float("inf")):  # refused by both, saying which row
        broken = logits.clone()
        broken[5, 7] = bad
        for name in ("multinomial", "gumbel"):
            with pytest.raises(ValueError, match="row 5 hold NaN or \\+inf"):
                draw_tokens(broken, torch.Generator().manual_seed(1), name)
    empty = logits.clone()
    empty[3] = float("-inf")  # top-k/top-p left nothing: not a NaN message
    for name in ("multinomial", "gumbel"):
        with pytest.raises(ValueError, match="every token of row 3 is filtered out"):
            draw_tokens(empty, torch.Generator().manual_seed(1), name)


def test_sample_draws_with_the_sampler_it_is_given(monkeypatch):
    import rlhflab.experience.sampling as sampling

    seen = []
    real = sampling.draw_tokens
    monkeypatch.setattr(sampling, "draw_tokens", lambda lg, g, s: seen.append(s) or real(lg, g, s))
    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    ids, mask = left_pad([tok("2 + 2", add_special_tokens=False)["input_ids"]], tok.pad_token_id)
    out = {}
    for name in ("multinomial", "gumbel"):
        gen = torch.Generator().manual_seed(1)
        out[name] = sample(lm, ids, mask, 6, None, tok.pad_token_id, generator=gen, sampler=name)[0]
    assert seen == ["multinomial"] * 6 + ["gumbel"] * 6
    assert out["gumbel"].shape == (1, 6) and int(out["gumbel"].max()) < lm.config.vocab_size


def test_a_top_k_past_the_vocabulary_is_not_warned_as_truncating(monkeypatch):
    # it truncates nothing: the warning that PPO becomes off-policy was false
    import warnings

    from rlhflab.experience import sampling

    path = M.resolve_path("preset:nano")
    tok = M.load_tokenizer(path)
    lm = M.load_causal_lm(path, tok)
    ids, mask = left_pad([tok("a b", add_special_tokens=False)["input_ids"]], tok.pad_token_id)
    for top_k, warned in ((10**20, False), (lm.config.vocab_size - 1, True)):
        monkeypatch.setattr(sampling, "_warned_truncated", False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sample(lm, ids, mask, 2, None, tok.pad_token_id, top_k=top_k)
        assert any("top_k/top_p" in str(w.message) for w in seen) == warned, top_k
