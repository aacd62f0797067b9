"""Reward-hacking monitors and the HTML report."""

import json

import pytest
import torch

from rlhflab.app.charts import Chart, Series
from rlhflab.app.report import build_report
from rlhflab.config import load_config
from rlhflab.diagnostics.monitor import HackingMonitor, distinct_n, pearson, repeated_ngram_rate
from rlhflab.experience.rollout import Rollout
from rlhflab.trainers.ppo import PPOTrainer
from rlhflab.trainers.ppo_watch import raised_kl_coef


def test_repetition_and_correlation_signals():
    assert repeated_ngram_rate([1, 2, 3, 4], 2) == 0.0
    assert repeated_ngram_rate([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)
    assert distinct_n([[1, 2, 3], [1, 2, 3]], 2) == pytest.approx(2 / 4)
    assert pearson(torch.tensor([1.0, 2, 3]), torch.tensor([2.0, 4, 6])) == pytest.approx(1.0)
    assert pearson(torch.tensor([1.0, 1, 1]), torch.tensor([2.0, 4, 6])) == 0.0


def fake_rollout(responses, scores, lengths):
    B, T = len(responses), max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.arange(B * T).reshape(B, T) % 7
    return Rollout(
        torch.zeros(B, 1, dtype=torch.long),
        torch.ones(B, 1, dtype=torch.long),
        ids,
        mask,
        torch.ones(B, dtype=torch.bool),
        ["p"] * B,
        responses,
        scores=torch.tensor(scores),
    )


def test_monitor_thresholds_fire_and_warmup_is_respected():
    cfg = load_config(
        overrides=[
            "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            "monitor.warmup_iterations=1",
        ]
    )
    mon = HackingMonitor(cfg.monitor)
    ro = fake_rollout(["Great question! a", "Great question! b"], [1.0, 2.0], [3, 6])
    metrics = {"objective/scores": 1.5, "objective/kl": 0.1, "policy/entropy": 2.0}
    ref = fake_rollout(["Great question! a", "plain b"], [0.0, 0.0], [2, 2])
    sig = mon.signals(ro, metrics, reference=ref)
    assert sig["flattery_rate"] == 1.0 and sig["length_ratio"] == pytest.approx(4.5 / 2)
    assert sig["flattery_excess"] == pytest.approx(0.5)
    assert sig["reward_length_corr"] == pytest.approx(1.0)
    assert mon.check(1, sig) == []  # warm-up
    fired = {a.signal for a in mon.check(2, sig)}
    assert fired == {"flattery_rate", "flattery_excess", "length_ratio", "reward_length_corr"}
    sig = mon.signals(ro, {**metrics, "policy/entropy": 0.1}, None)
    assert "entropy_ratio" in {a.signal for a in mon.check(3, sig)}


def test_gold_drop_signal_tracks_proxy_versus_gold(monkeypatch):
    cfg = load_config(
        overrides=[
            "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}",
            "monitor.gold=rlhflab.builtin.toy_rewards:vowel_reward",
            "monitor.smoothing=0",
        ]
    )
    from rlhflab.experience.rewards import FunctionReward

    mon = HackingMonitor(cfg.monitor, FunctionReward(cfg.monitor.gold))
    drops = []
    for proxy, text in ((1.0, "aaaa"), (2.0, "aab"), (3.0, "bbbb")):
        ro = fake_rollout([text], [proxy], [2])
        sig = mon.signals(
            ro, {"objective/scores": proxy, "objective/kl": 0.0, "policy/entropy": 1.0}, None
        )
        drops.append(sig["gold_drop"])
    assert drops[0] == 0.0 and drops[1] == pytest.approx(1 - 2 / 3) and drops[2] == 1.0


def tiny_cfg(tmp_path, *over):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "shared"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 4, "epochs": 1, "lr": 1e-3},
        "log": {"output_dir": str(tmp_path / "run"), "progress": False, "sample_every": 1},
        "monitor": {"gold": "rlhflab.builtin.toy_rewards:vowel_reward", "warmup_iterations": 0},
    }
    return load_config(base=base, overrides=list(over))


def test_raise_kl_response_multiplies_beta(tmp_path):
    t = PPOTrainer(
        tiny_cfg(
            tmp_path, "monitor.response=raise_kl", "monitor.entropy_ratio=10", "ppo.iterations=2"
        )
    )
    t.fit()
    rows = [r for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert t.kl_ctl.value == pytest.approx(0.05 * 2.0**2)  # an alert each iteration


def test_raise_kl_once_per_iteration_up_to_the_ceiling(tmp_path):
    # three signals alert every iteration (entropy, length, repetition thresholds that
    # always fire), yet β moves once an iteration, and stops at monitor.kl_coef_max
    over = ["monitor.response=raise_kl", "monitor.entropy_ratio=10", "monitor.kl_factor=3"]
    over += ["monitor.length_ratio=0", "monitor.repeated_ngram_rate=-1", "ppo.iterations=3"]
    t = PPOTrainer(tiny_cfg(tmp_path, *over, "monitor.kl_coef_max=1.0"))
    t.fit()
    alerts = [json.loads(r) for r in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert {a["iteration"] for a in alerts} == {1, 2, 3}
    assert len(alerts) >= 6  # several alerts an iteration
    beta = [
        json.loads(r)["objective/kl_coef"]
        for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert beta == pytest.approx([0.05, 0.15, 0.45])  # the β each iteration trained with
    assert t.kl_ctl.value == pytest.approx(1.0)  # 1.35 capped


def test_raised_kl_coef_never_lowers_a_beta_above_the_ceiling():
    assert raised_kl_coef(0.1, 2.0, 10.0) == pytest.approx(0.2)
    assert raised_kl_coef(8.0, 2.0, 10.0) == 10.0
    assert raised_kl_coef(20.0, 2.0, 10.0) == 20.0


def test_stop_response_checkpoints_and_names_the_signal(tmp_path):
    t = PPOTrainer(tiny_cfg(tmp_path, "monitor.response=stop", "monitor.entropy_ratio=10"))
    out = t.fit()
    assert out["iterations"] == 1
    assert "entropy_ratio" in out["stop_reason"] and "lower ppo.lr" in out["stop_reason"]
    assert (tmp_path / "run" / "checkpoints" / "step-1").exists()


def test_report_is_self_contained_html_with_curves_alerts_and_samples(tmp_path):
    PPOTrainer(tiny_cfg(tmp_path, "monitor.entropy_ratio=10")).fit()
    path = build_report(tmp_path / "run")
    text = path.read_text()
    assert text.count('<svg class="pl"') >= 10
    assert "Monitor: entropy_ratio" in text and "threshold 10 (alert below)" in text
    assert "<h2 id='alerts'>Alerts</h2><div class=\"tw\"><table>" in text
    assert "<h2 id='samples'>Samples</h2>" in text and "reference, same prompt" in text
    assert "http://" not in text and "https://" not in text and "<script" not in text


def test_chart_skips_non_finite_points():
    points = [(1, 1.0), (2, float("nan")), (3, 2.0)]
    fig = Chart("x", [Series("a", points)], "u", alerts=[2], threshold=(1.5, "above")).html()
    assert fig.startswith("<figure") and "nan" not in fig
    assert Chart("empty", [Series("a", [(1, None)])], "u").html() == ""


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


def test_flattery_opener_ratio_is_a_ratio_of_means_and_alerts_above_threshold():
    from rlhflab.diagnostics.monitor import opener_ratio

    pol, ref = torch.tensor([0.5, 0.1]).log(), torch.tensor([0.25, 0.05]).log()
    assert opener_ratio(pol, ref) == pytest.approx(2.0)
    assert opener_ratio(torch.tensor([0.0, 0.9]).log(), torch.tensor([1e-9, 0.3]).log()) == (
        pytest.approx(0.45 / (0.15 + 5e-10))
    )
    cfg = load_config(
        overrides=["reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}"]
    )
    mon = HackingMonitor(cfg.monitor)
    ro = fake_rollout(["plain a", "plain b"], [1.0, 2.0], [3, 3])
    metrics = {"objective/scores": 1.5, "objective/kl": 0.1, "policy/entropy": 2.0}
    sig = mon.signals(ro, metrics, openers=(pol, ref))
    assert sig["flattery_opener_ratio"] == pytest.approx(2.0)
    assert "flattery_opener_ratio" in {a.signal for a in mon.check(2, sig)}
    sig = mon.signals(ro, metrics, openers=(ref, ref))
    assert "flattery_opener_ratio" not in {a.signal for a in mon.check(3, sig)}


def test_report_shows_the_reward_models_checks_and_their_warning(tmp_path):
    run, rm = tmp_path / "run", tmp_path / "rm"
    run.mkdir()
    rm.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "objective/kl": 0.1}) + "\n")
    (run / "config.yaml").write_text(f"reward:\n  model: {rm}\n")
    row = {
        "accuracy": 0.84,
        "calibration_error": 0.05,
        "longer_preferred": 0.75,
        "longer_preferred_by_labels": 0.73,
        "score_length_corr": 0.64,
    }
    (rm / "rm_checks.json").write_text(
        json.dumps(
            {
                "preference": {**row, "score_length_corr": None},
                "reward": row,
                "reward_vs_gold": {**row, "accuracy": 0.5},
            }
        )
    )
    text = build_report(run).read_text()
    assert "<h2 id='rm'>Reward model checks</h2>" in text and "<td>0.750</td>" in text
    assert "prefers the longer answer in 75%" in text and "<td>-</td>" in text
    assert "agrees with the gold reward on 50%" in text
    (rm / "rm_checks.json").unlink()  # a reward model from before the checks: where looked
    text = build_report(run).read_text()
    assert "No rm_checks.json" in text and str(rm / "rm_checks.json") in text
