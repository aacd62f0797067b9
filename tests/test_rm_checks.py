"""The reward-model checks (rlhflab/diagnostics/rm_checks.py) against plain loops in float64."""

import math

import pytest
import torch

from rlhflab.diagnostics import rm_checks as R


def _ece_loop(diff, outcome, bins):
    rows = []
    for d, o in zip(diff.tolist(), outcome.tolist()):
        p = 1 / (1 + math.exp(-d))
        conf = max(p, 1 - p)
        b = min(int((conf - 0.5) * 2 * bins), bins - 1)
        rows.append((b, conf, float((p > 0.5) == (o > 0.5))))
    err = 0.0
    for b in range(bins):
        inside = [r for r in rows if r[0] == b]
        if inside:
            acc = sum(r[2] for r in inside) / len(inside)
            conf = sum(r[1] for r in inside) / len(inside)
            err += len(inside) / len(rows) * abs(acc - conf)
    return err


@pytest.mark.parametrize("bins", [1, 5, 10])
def test_calibration_error_matches_loop(bins):
    g = torch.Generator().manual_seed(0)
    diff = torch.randn(200, generator=g, dtype=torch.float64) * 3
    outcome = (torch.rand(200, generator=g, dtype=torch.float64) < 0.7).double()
    assert R.calibration_error(diff, outcome, bins) == pytest.approx(
        _ece_loop(diff, outcome, bins), abs=1e-12
    )


def test_calibration_error_is_zero_when_confidence_matches_accuracy():
    # σ(±log 3) = 0.75: four pairs at 75 % confidence, three right — calibrated exactly
    diff = torch.full((4,), math.log(3.0), dtype=torch.float64)
    assert R.calibration_error(diff, torch.tensor([1.0, 1.0, 1.0, 0.0])) == pytest.approx(0)
    # the same gaps, all wrong: |0 − 0.75|
    assert R.calibration_error(diff, torch.zeros(4)) == pytest.approx(0.75)
    assert math.isnan(R.calibration_error(torch.zeros(0), torch.zeros(0)))


def test_longer_preferred_matches_loop_and_counts_ties_as_half():
    g = torch.Generator().manual_seed(1)
    diff = torch.randn(100, generator=g)
    diff[:5] = 0.0
    lc = torch.randint(1, 6, (100,), generator=g)
    lr = torch.randint(1, 6, (100,), generator=g)
    shares = []
    for d, c, r in zip(diff.tolist(), lc.tolist(), lr.tolist()):
        if c == r:
            continue
        favoured = 0.5 if d == 0 else float((d > 0) == (c > r))
        shares.append(favoured)
    share, n = R.longer_preferred(diff, lc, lr)
    assert n == len(shares) and share == pytest.approx(sum(shares) / len(shares), abs=1e-12)
    same = torch.ones(3)
    assert math.isnan(R.longer_preferred(torch.ones(3), same, same)[0])


def test_reward_checks_tell_a_length_loving_reward_from_its_labels():
    # labels: the chosen answer is better in every pair, and it is the longer one in half;
    # reward A scores by length alone, reward B agrees with the labels
    lc = torch.tensor([5, 5, 2, 2, 3, 3, 4, 1])
    lr = torch.tensor([2, 2, 5, 5, 1, 1, 2, 4])
    label = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, float("nan")])
    by_length = R.reward_checks(lc.double(), lr.double(), label, lc, lr)
    assert by_length["pairs"] == 6  # the tie and the unlabelled pair are left out
    assert by_length["longer_preferred"] == 1.0
    assert by_length["longer_preferred_by_labels"] == pytest.approx(4 / 6)
    assert by_length["length_bias"] == pytest.approx(2 / 6)
    assert by_length["accuracy"] == pytest.approx(4 / 6)
    assert by_length["score_length_corr"] == pytest.approx(1.0)
    faithful = R.reward_checks(torch.ones(8), torch.zeros(8), label, lc, lr)
    assert faithful["accuracy"] == 1.0 and faithful["length_bias"] == pytest.approx(0.0)
    unlabelled = R.reward_checks(lc.double(), lr.double(), None, lc, lr)
    assert set(unlabelled) == {"longer_preferred", "score_length_corr"}
    assert unlabelled["longer_preferred"] == 1.0  # every pair of unequal length


def test_the_built_in_length_loving_annotator_shows_in_the_label_shares():
    # the `hacking` demo's annotator (rm.length_bias) prefers longer answers; the default
    # one, whose gold reward values brevity, shorter ones — as the checks' label side reads
    from rlhflab.config import load_config
    from rlhflab.trainers.rm import builtin_pairs

    def labels_share(*over):
        pairs = builtin_pairs(load_config(overrides=["rm.pairs=400", *over], stage="rm"))
        words = [
            torch.tensor([len(getattr(p, s).split()) for p in pairs])
            for s in ("chosen", "rejected")
        ]
        return R.reward_checks(
            torch.zeros(len(pairs)), torch.zeros(len(pairs)), torch.ones(len(pairs)), *words
        )["longer_preferred_by_labels"]

    honest, loving = labels_share(), labels_share("rm.length_bias=0.3", "rm.flattery_bias=1.5")
    assert honest < 0.4 and loving > 0.6


def test_a_length_loving_reward_gets_a_warning_naming_both_shares():
    msg = R.length_warning({"longer_preferred": 0.75, "longer_preferred_by_labels": 0.73})
    assert "75%" in msg and "labels: 73%" in msg and "lengthen" in msg
    assert R.length_warning({"longer_preferred": 0.27, "longer_preferred_by_labels": 0.25}) is None
    assert R.length_warning({"longer_preferred": float("nan")}) is None
    assert "labels" not in R.length_warning({"longer_preferred": 0.9})  # no preference head


def test_a_reward_that_disagrees_with_gold_gets_a_warning():
    msg = R.gold_warning({"accuracy": 0.51})
    assert "51%" in msg and "gold" in msg
    assert R.gold_warning({"accuracy": 0.84}) is None
    assert R.gold_warning({}) is None  # no gold reward configured


def test_a_model_made_elsewhere_gets_the_labels_it_can_have():
    from rlhflab.config.base import ConfigError
    from rlhflab.experience.data import PreferencePair
    from rlhflab.trainers.rm import head_targets

    pairs = [PreferencePair("p", "a", "b", {"brevity": 0.0}), PreferencePair("p", "c", "d", {})]
    # a single-head model (an HF reward model's LABEL_0): the pair order is its label
    assert head_targets(pairs, ["LABEL_0"], "x", strict=False).tolist() == [[1.0], [1.0]]
    two = head_targets(pairs, ["brevity", "helpful"], "x", strict=False)
    assert two[0, 0] == 0.0 and two[:, 1].isnan().all() and two[1, 0].isnan()
    with pytest.raises(ConfigError, match="no pair in x has a label for head 'helpful'"):
        head_targets(pairs, ["brevity", "helpful"], "x")  # training needs every head's labels


def test_the_reward_row_of_a_model_without_a_preference_head_is_checked_on_pair_order():
    # a one-head HF reward model (LABEL_0): its head had an accuracy, the reward row PPO
    # optimises — the same score — read "-"

    from rlhflab.experience.data import PreferencePair
    from rlhflab.trainers.rm import head_targets, heldout_checks

    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    pairs = [PreferencePair("p", "a b c", "d", {}) for _ in range(3)]
    pairs.append(PreferencePair("p", "e", "f g", {}))
    chosen = torch.tensor([[2.0], [1.0], [0.5], [-1.0]])
    rejected = torch.tensor([[0.0], [0.0], [0.0], [0.0]])
    targets = head_targets(pairs, ["LABEL_0"], "x", strict=False)
    out = heldout_checks(chosen, rejected, targets, ["LABEL_0"], Words(), pairs, {})
    assert out["LABEL_0"]["accuracy"] == out["reward"]["accuracy"] == 0.75
    assert (
        out["reward"]["longer_preferred_by_labels"] == out["LABEL_0"]["longer_preferred_by_labels"]
    )


def test_labels_that_match_no_head_are_said(caplog):
    # a misspelled label ('brevty') trained nothing, without a word
    from rlhflab.experience.data import PreferencePair
    from rlhflab.trainers.rm import head_targets

    pairs = [
        PreferencePair("p", "a", "b", {"brevity": 1.0}),
        PreferencePair("p", "c", "d", {"brevty": 1}),
    ]
    with caplog.at_level("WARNING", logger="rlhflab.trainers.rm"):
        head_targets(pairs, ["preference", "brevity"], "x.jsonl")
    assert "x.jsonl: labels ['brevty'] match no rm.heads entry" in caplog.text


def test_a_sparsely_labelled_head_trains_whatever_the_held_out_pairs_hold(tmp_path):
    """Half the pairs carry a 'brevity' label: the held-out split may hold none of them;
    training needs labels among its own pairs, the held-out checks do not."""
    import json

    from rlhflab.app.cli import main

    rows = [
        {"prompt": f"copy: w{i}\nanswer:", "chosen": f" w{i}", "rejected": " x"}
        | ({"labels": {"brevity": i % 2}} if i < 5 else {})  # seed 0 holds out row 8
        for i in range(10)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"rm.data={data}", "rm.steps=1", "rm.batch_size=2", "device=cpu"]
    common += ["model.policy=preset:nano", f"rm.output_dir={tmp_path / 'rm'}"]
    assert main(["rm", *common, "rm.heads={preference: 1.0, brevity: 1.0}"]) == 0
    # the built-in task's heads by default: plain pairs are told what to set
    assert main(["rm", *common]) == 2
