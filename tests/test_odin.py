"""ODIN's length head (issue #29; Chen et al. 2024, "ODIN: Disentangled Reward Mitigates
Hacking in RLHF"): its losses against float64 loops, what descending them does, and reward
models trained with it."""

import math

import pytest
import torch

from rlhflab.config import ConfigError, load_config
from rlhflab.core import guards as G
from rlhflab.trainers.rm_ensemble import train_rm
from tests.maths_helpers import rand


def _loop_pearson(x, y):
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy)


def test_odin_losses_match_loops():
    q, ln, lengths = rand(12, 3, seed=6), rand(12, seed=7), rand(12, seed=8).abs() * 10
    x, L = [q[:, k].tolist() for k in range(3)], lengths.tolist()
    want = -_loop_pearson(ln.tolist(), L) + sum(abs(_loop_pearson(xk, L)) for xk in x)
    assert G.odin_length_loss(q, ln, lengths).item() == pytest.approx(want, rel=1e-9)
    w = rand(4, 5, seed=9)
    dots = [sum(w[k][h].item() * w[2][h].item() for h in range(5)) for k in (0, 1, 3)]
    assert G.head_orthogonality_loss(w, 2).item() == pytest.approx(sum(abs(d) for d in dots))


def test_descending_the_odin_loss_decorrelates_the_quality_score_from_length():
    # a linear "reward model" over [quality feature, length]: the loss moves length out of
    # the quality head and into the length head
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 30, (64,), generator=g).double()
    feats = torch.stack([torch.randn(64, generator=g, dtype=torch.float64), lengths / 10], 1)
    wq = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
    wl = torch.tensor([0.3, -0.1], dtype=torch.float64, requires_grad=True)
    before = G.pearson_corr(feats @ wq, lengths).item()
    opt = torch.optim.SGD([wq, wl], lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        G.odin_length_loss((feats @ wq)[:, None], feats @ wl, lengths).backward()
        opt.step()
    assert before > 0.5
    assert abs(G.pearson_corr(feats @ wq, lengths).item()) < 0.05
    assert G.pearson_corr(feats @ wl, lengths).item() > 0.99


def test_odin_length_head_takes_the_length_preference_out_of_the_quality_head(tmp_path):
    def corr(length_head: bool) -> tuple[float, float | None]:
        cfg = load_config(
            overrides=[
                "model.policy=preset:nano",
                "threads=1",
                "rm.steps=60",
                "rm.pairs=600",
                "rm.batch_size=16",
                "rm.lr=1e-3",
                "rm.length_bias=1.0",
                "rm.heads={'preference': 1.0}",
                "rm.heldout_fraction=0.25",
                f"rm.length_head={str(length_head).lower()}",
                f"rm.output_dir={tmp_path / str(length_head)}",
                "log.progress=false",
            ],
            stage="rm",
        )
        checks = train_rm(cfg)["heldout_checks"]
        return checks["preference"]["score_length_corr"], checks.get("length", {}).get(
            "score_length_corr"
        )

    plain, _ = corr(False)
    odin, length = corr(True)
    assert plain > 0.4  # the length-loving annotator's preference follows length
    assert abs(odin) < plain - 0.3
    assert length > 0.8


def test_odin_ranks_exempt_heads_on_their_own_scores_and_leaves_them_out():
    scores = rand(6, 4, seed=3).requires_grad_(True)  # heads a, b(exempt), c, length
    ranked = G.odin_ranked_scores(scores, 3, [1])
    loop = torch.stack(
        [scores[:, k] + (0.0 if k == 1 else 1.0) * scores[:, 3] for k in range(4)], 1
    )
    torch.testing.assert_close(ranked, loop)
    assert G.odin_quality_heads(4, 3, [1]) == [0, 2]
    weight = rand(4, 5, seed=4)
    expected = sum((weight[k] @ weight[3]).abs() for k in (0, 2))
    torch.testing.assert_close(G.head_orthogonality_loss(weight, 3, [0, 2]), expected)
    ranked.sum().backward()  # differentiable through both terms
    # the length head feeds a and c, not b, and its own column twice (weight 0 in the loss)
    assert scores.grad[:, 3].eq(4.0).all() and scores.grad[:, 1].eq(1.0).all()


def test_odin_keeps_the_brevity_head_which_is_about_length(tmp_path):
    def brevity_accuracy(exempt: str) -> float:
        cfg = load_config(
            overrides=[
                "model.policy=preset:nano",
                "threads=1",
                "rm.steps=30",
                "rm.pairs=300",
                "rm.batch_size=16",
                "rm.lr=1e-3",
                "rm.heads={'preference': 1.0, 'brevity': 1.0}",
                "rm.heldout_fraction=0.25",
                "rm.length_head=true",
                f"rm.length_exempt={exempt}",
                f"rm.output_dir={tmp_path / exempt}",
                "log.progress=false",
            ],
            stage="rm",
        )
        return train_rm(cfg)["heldout_accuracy"]["brevity"]

    decorrelated, exempt = brevity_accuracy("[]"), brevity_accuracy("null")  # null: brevity
    assert exempt > 0.85  # 0.92 when written; decorrelated: 0.19, below chance
    assert exempt > decorrelated + 0.3


def test_odin_refuses_an_exempt_head_it_does_not_have(tmp_path):
    cfg = load_config(
        overrides=[
            "model.policy=preset:nano",
            "rm.length_head=true",
            "rm.length_exempt=['brevity', 'tone']",
            f"rm.output_dir={tmp_path}",
        ],
        stage="rm",
    )
    with pytest.raises(ConfigError, match=r"rm.length_exempt: 'tone' is not one of the heads"):
        train_rm(cfg)


def test_a_refresh_fine_tunes_odin_models_as_they_were_trained():
    from types import SimpleNamespace

    from rlhflab.trainers.rm import trained_odin

    r = SimpleNamespace(length_loss_weight=0.5, orthogonal_weight=2.0, length_exempt=["x"])
    heads = ["preference", "brevity", "length"]
    # the model's own record decides, not this run's rm.length_exempt
    recorded = SimpleNamespace(odin_exempt=["brevity"])
    assert trained_odin(recorded, heads, r) == (2, 0.5, 2.0, [1])
    assert trained_odin(SimpleNamespace(), heads, r) == (2, 0.5, 2.0, [])  # from before it
    assert trained_odin(recorded, ["preference", "brevity"], r) is None  # no length head
