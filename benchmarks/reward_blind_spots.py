"""Where can the demo's reward model not tell a right answer from a wrong one? (issue #29)

On the default demo PPO raises the gold reward while exact accuracy stays flat. This script
takes a finished demo run folder (``runs/default-s<seed>``) and measures, per skill of the
built-in task:

1. the reward model (``RUN/rm``, the demo's head weights: preference 1, correctness 2) on
   *clean* pairs — the correct answer against one plausible mistake of the teacher
   (``tasks.wrong_answer``: an off-by-one sum; a shuffled, dropped, substituted or extra
   word), no flattery, no repetition — as the share of pairs it orders right, split by the
   mistake's length difference (0: same length, e.g. a shuffled order or another word);
2. the policies' exact accuracy and gold reward on the demo's 512 held-out prompts (one
   sampled answer each at T = 1, seed as the demo evaluates): SFT, PPO's final checkpoint
   and, where the run kept one, ``checkpoints/best``.

    python benchmarks/reward_blind_spots.py runs/default-s0
    python benchmarks/reward_blind_spots.py runs/default-s0 --ppo other/ppo --rm other/rm

One torch thread; about a minute on 2 cores. Results: docs/hacking.md.
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from pathlib import Path

import torch

HEAD_WEIGHTS = {"preference": 1.0, "correctness": 2.0}  # the demo's reward.heads


def reward_on_clean_pairs(rm_dir: Path, pairs_per_skill: int = 120) -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhflab.builtin import tasks
    from rlhflab.experience.rewards import encode_for_reward, reward_scores

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    heads = [model.config.id2label[i] for i in range(model.config.num_labels)]
    weights = torch.tensor([HEAD_WEIGHTS.get(h, 0.0) for h in heads])

    def score(prompts, answers):
        ids, mask = encode_for_reward(tok, prompts, answers, [True] * len(prompts))
        with torch.no_grad():
            return reward_scores(model, ids, mask) @ weights

    rng = random.Random(5)
    examples = tasks.make_examples(8 * pairs_per_skill, seed=987)  # not a training seed
    out = {}
    for skill in tasks.SKILLS:
        chosen = [e for e in examples if e.skill == skill][:pairs_per_skill]
        prompts = [e.prompt for e in chosen]
        # answers as the reward model was trained on them: a leading space (trainers/rm.py)
        right = [" " + e.answer for e in chosen]
        wrong = [" " + " ".join(tasks.wrong_answer(e, rng)) for e in chosen]
        ok = (score(prompts, right) > score(prompts, wrong)).float()
        dlen = torch.tensor([len(w.split()) - len(r.split()) for r, w in zip(right, wrong)])
        row = {"all": (ok.mean().item(), len(ok))}
        for d in (-1, 0, 1):
            sel = dlen == d
            if sel.any():
                row[f"len {d:+d}"] = (ok[sel].mean().item(), int(sel.sum()))
        out[skill] = row
    return out


def policy_by_skill(run: Path, ppo: Path) -> dict:
    from rlhflab.builtin import tasks
    from rlhflab.config import load_config
    from rlhflab.diagnostics.evaluate import heldout_prompts
    from rlhflab.experience.cast import load_frozen_policy
    from rlhflab.experience.rollout import generate_rollout
    from rlhflab.infra.runs import load_policy

    seed = load_config(ppo / "config.yaml").seed
    prompts = heldout_prompts(512, seed)
    last = load_policy(ppo, checkpoint="last")
    policies = {"sft": load_frozen_policy(load_config(ppo / "config.yaml"), last.tokenizer, "cpu")}
    policies["ppo final"] = last.lm
    if (ppo / "checkpoints" / "best").is_dir():
        policies["ppo best"] = load_policy(ppo, checkpoint="best").lm
    out = {}
    for name, lm in policies.items():
        lm.eval()
        gen = torch.Generator().manual_seed(seed)
        answers = []
        with torch.no_grad():
            for s in range(0, len(prompts), 64):
                ro = generate_rollout(
                    lm, last.tokenizer, prompts[s : s + 64], 24, 1.0, 0, 1.0, gen, "cpu"
                )
                answers += ro.responses
        by = defaultdict(list)
        for p, a in zip(prompts, answers):
            j = tasks.judge(p, a)
            by[p.split(":")[0]].append((float(j.correct == 1.0), j.gold))
        out[name] = {
            k: (sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v))
            for k, v in sorted(by.items())
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="a demo run folder (sft/, rm/, ppo/ inside)")
    p.add_argument("--ppo", type=Path, default=None, help="PPO run folder (default RUN/ppo)")
    p.add_argument("--rm", type=Path, default=None, help="reward model folder (default RUN/rm)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print("reward model on clean pairs (share ordered right, pairs):")
    for skill, row in reward_on_clean_pairs(args.rm or args.run / "rm").items():
        print(f"  {skill:<8}" + "  ".join(f"{k} {v:.3f} ({n})" for k, (v, n) in row.items()))
    print("policies on held-out prompts (accuracy / gold):")
    for name, row in policy_by_skill(args.run, args.ppo or args.run / "ppo").items():
        print(f"  {name:<10}" + "  ".join(f"{k} {a:.3f}/{g:.3f}" for k, (a, g) in row.items()))


if __name__ == "__main__":
    main()
