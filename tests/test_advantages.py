"""Advantage estimators (rlhflab.core.advantages) against float64 loops, their registry, and the
config field that picks one (ppo.advantage_estimator)."""

import math

import pytest
import torch

from rlhflab.config import ADVANTAGE_ESTIMATORS, ConfigError, load_config
from rlhflab.core import advantages as ADV
from tests.maths_helpers import ragged_mask, rand


def loop_whiten(x, m, shift_mean=True):
    _, vals = _selected(x, m)
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            if m[i][j]:
                w = (x[i][j].item() - mu) / math.sqrt(var + 1e-8)
                out[i][j] = w + (mu if not shift_mean else 0.0)
    return out


def _selected(x, m):
    vals = [x[i][j].item() for i in range(x.shape[0]) for j in range(x.shape[1]) if m[i][j]]
    return len(vals), vals


def loop_gae(scores, kl, m, values, beta, gamma, lam, whiten_rewards):
    """Shaping, GAE and returns, token by token: r_t = −β·kl_t (+ score at the last token)."""
    B, T = m.shape
    rewards = torch.zeros_like(kl)
    for i in range(B):
        n = int(m[i].sum().item())
        for t in range(n):
            rewards[i][t] = -beta * kl[i][t].item() + (scores[i].item() if t == n - 1 else 0.0)
    if whiten_rewards:
        rewards = loop_whiten(rewards, m, shift_mean=False)
    adv, ret = torch.zeros_like(kl), torch.zeros_like(kl)
    for i in range(B):
        n = int(m[i].sum().item())
        last = 0.0
        for t in reversed(range(n)):
            v_next = values[i][t + 1].item() if t + 1 < n else 0.0
            delta = rewards[i][t].item() + gamma * v_next - values[i][t].item()
            last = delta + gamma * lam * last
            adv[i][t] = last
            ret[i][t] = last + values[i][t].item()
    return adv, ret


@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("whiten_advantages", [False, True])
def test_gae_estimator_matches_loop(whiten_rewards, whiten_advantages):
    m = ragged_mask(seed=3)
    B, T = m.shape
    scores, kl, values = rand(B, seed=1), rand(B, T, seed=2) * m, rand(B, T, seed=4)
    s = ADV.AdvantageSettings(
        kl_in_reward=True,
        gamma=0.9,
        lam=0.8,
        whiten_rewards=whiten_rewards,
        whiten_advantages=whiten_advantages,
    )
    out = ADV.get("gae").fn(scores, kl, m, values, 0.3, s)
    adv, ret = loop_gae(scores, kl, m, values, 0.3, 0.9, 0.8, whiten_rewards)
    if whiten_advantages:
        adv = loop_whiten(adv, m)
    torch.testing.assert_close(out.returns, ret, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.advantages, adv, rtol=1e-10, atol=1e-12)
    assert out.metrics == {}
    # with the KL in the loss β takes no part in the reward
    in_loss = ADV.gae(scores, kl, m, values, 0.3, ADV.AdvantageSettings(kl_in_reward=False))
    plain = ADV.gae(scores, kl, m, values, 0.0, ADV.AdvantageSettings(kl_in_reward=True))
    assert torch.equal(in_loss.advantages, plain.advantages)
    with pytest.raises(ValueError, match="critic"):
        ADV.gae(scores, kl, m, None, 0.3, s)


def test_gae_whitens_with_the_moments_it_is_given():
    """Under DDP the statistics are every rank's: the estimator uses the ones passed in."""
    m = ragged_mask(seed=5)
    B, T = m.shape
    scores, kl, values = rand(B, seed=6), torch.zeros(B, T, dtype=torch.float64), rand(B, T)
    seen = []

    def moments(x, mask):
        seen.append(x.shape)
        return torch.tensor(0.0, dtype=x.dtype), torch.tensor(4.0, dtype=x.dtype)

    s = ADV.AdvantageSettings(moments=moments)
    out = ADV.gae(scores, kl, m, values, 0.1, s)
    raw = ADV.gae(scores, kl, m, values, 0.1, ADV.AdvantageSettings(whiten_advantages=False))
    assert seen == [(B, T)]
    torch.testing.assert_close(
        out.advantages, raw.advantages * m / math.sqrt(4.0 + 1e-8), rtol=1e-12, atol=0
    )


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_group_estimators_match_loop(name, kl_in_reward):
    G, B, T = 4, 12, 5
    m = ragged_mask(seed=7, b=B, t=T)
    scores, kl = rand(B, seed=8), rand(B, T, seed=9) * m
    scores[4:8] = 0.5  # one group whose answers all scored the same
    beta = 0.2
    s = ADV.AdvantageSettings(kl_in_reward=kl_in_reward, group_size=G, normalize_std=True)
    out = ADV.get(name).fn(scores, kl, m, None, beta, s)
    assert out.returns is None
    seq = [
        scores[i].item() - (beta * kl[i].sum().item() if kl_in_reward else 0.0) for i in range(B)
    ]
    for k in range(B // G):
        grp = seq[k * G : (k + 1) * G]
        mu = sum(grp) / G
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (G - 1))
        for j in range(G):
            i = k * G + j
            if name == "grpo":
                want = (grp[j] - mu) / (sd + 1e-6)
            else:
                want = grp[j] - (sum(grp) - grp[j]) / (G - 1)
            for t in range(T):
                expected = want if m[i][t] else 0.0
                assert out.advantages[i][t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    zero_std = 1 / 3 if not kl_in_reward else 0.0  # the KL term breaks the tie
    assert out.metrics == {f"{name}/zero_std_fraction": pytest.approx(zero_std)}


def test_dr_grpo_switch_only_centres():
    G, B, T = 4, 8, 3
    m = torch.ones(B, T, dtype=torch.float64)
    scores, kl = rand(B, seed=11), torch.zeros(B, T, dtype=torch.float64)
    s = ADV.AdvantageSettings(kl_in_reward=False, group_size=G, normalize_std=False)
    out = ADV.grpo(scores, kl, m, None, 0.0, s)
    centred = scores.reshape(-1, G) - scores.reshape(-1, G).mean(1, keepdim=True)
    torch.testing.assert_close(out.advantages[:, 0], centred.reshape(-1), rtol=1e-12, atol=0)


def test_registry_knows_the_config_choices_and_names_them_on_a_miss():
    assert ADV.names() == ADVANTAGE_ESTIMATORS
    assert ADV.get("gae").needs_critic and not ADV.get("gae").grouped
    for name in ("grpo", "rloo"):
        assert ADV.get(name).grouped and not ADV.get(name).needs_critic
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'; known: gae, grpo"):
        ADV.get("vtrace")
    with pytest.raises(ValueError, match="already registered"):
        ADV.register("gae", ADV.gae, needs_critic=True, grouped=False)


REWARD = "reward.functions={'rlhflab.builtin.toy_rewards:vowel_reward': 1}"


def test_the_estimator_is_a_config_choice_checked_against_the_critic():
    assert load_config(overrides=[REWARD]).ppo.advantage_estimator == "gae"
    # rlhflab grpo / rloo run their own estimator
    for stage in ("grpo", "rloo"):
        cfg = load_config(overrides=[REWARD, "model.value_model=none"], stage=stage)
        assert cfg.ppo.advantage_estimator == stage
    # on rlhflab ppo, a critic-free estimator without a critic
    cfg = load_config(overrides=[REWARD, "model.value_model=none", "ppo.advantage_estimator=rloo"])
    assert cfg.ppo.advantage_estimator == "rloo"
    bad = [
        (["ppo.advantage_estimator=grpo"], r"model\.value_model: ppo\.advantage_estimator=grpo"),
        (["model.value_model=none"], r"model\.value_model: PPO needs a critic"),
        (["ppo.advantage_estimator=vtrace"], r"ppo\.advantage_estimator"),
        (
            ["ppo.advantage_estimator=rloo", "model.value_model=none", "grpo.group_size=3"],
            r"grpo\.group_size",
        ),
    ]
    for over, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_config(overrides=[REWARD, *over])
    with pytest.raises(ConfigError, match=r"ppo\.advantage_estimator: rlhflab grpo runs"):
        load_config(
            overrides=[REWARD, "model.value_model=none", "ppo.advantage_estimator=rloo"],
            stage="grpo",
        )
