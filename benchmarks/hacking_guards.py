"""Do the reward guards of issue #29 keep the `hacking` demo from hacking its reward?

For each seed: SFT once, then the reward models (an ensemble of ``--ensemble-size``
members trained by ``rlhflab rm`` with rm.ensemble_size, member 0 being the plain reward
model, and one with rm.length_head), then one PPO run of the ``hacking`` preset per guard:

* ``plain``: reward.model = member 0 (the demo's reward model);
* ``wco`` / ``uwo``: reward.ensemble = every member, reward.ensemble_combine = wco / uwo
  (members centred on the reference's answers, reward.ensemble_center's default);
* ``par``: member 0 with reward.shaping = par;
* ``odin``: the length-head reward model (its ``length`` head weight 0);
* ``refresh``: member 0 refreshed every 2 iterations, 40 steps each (reward.refresh_every,
  reward.refresh_steps) on the policy's answers, labelled by the preset's own annotator
  (the rm.* settings);
* ``raise_kl`` / ``stop``: member 0 with ``monitor.response`` raise_kl (β × monitor.kl_factor
  once per iteration with an alert, up to monitor.kl_coef_max) or stop (the run ends, with a checkpoint, at the first alert), reacting
  only to the gold-free signals (monitor.gold_drop off; the gold reward still measures).

Every guard but ``par`` runs with reward.shaping=none: the default preset shapes with PAR
itself since issue #29, and ``plain`` there means the reward as it was.

Per run: ``final gold``, the gold reward of the final policy on ``--eval-prompts`` held-out
prompts (one sampled answer each, diagnostics.evaluate), and ``gold drop``, the best minus
the final of the held-out gold measured the same way at iteration 0 (the SFT policy) and
every ``--eval-every`` iterations. Every evaluation samples from the same seed on the same
prompts (common random numbers), so a policy that has not changed scores exactly the same
and the drop measures the policy, not the sampling. ``batch gold drop`` is the earlier
measure, best minus final of the training batches' gold (monitor/gold, 64 answers an
iteration) as a trailing 3-iteration moving mean: one batch moves ±0.08, so its best is
the luckiest of 50 noisy windows and even an unchanged policy "drops" by about 0.1
(docs/hacking.md). The last lines, one pair per guard, are ``final gold <guard>: X ± s``
and ``gold drop <guard>: Y ± s`` (mean ± sample std over seeds; ± 0 with one seed). Also printed per guard, first: ``final accuracy``
(exact answers); and the SFT policy's held-out gold and accuracy as row ``sft``, the
baseline PPO starts from. Run folders are reused: a finished stage or guard run (its ``guard.json``,
which also records the run's PPO seconds and peak memory) is not rerun, so an interrupted
benchmark continues where it stopped. ``--preset default`` runs the same guards on the
default demo preset: the check that a guard costs no gold where nothing is hacked.

Usage (2 cores: untimed; estimated 20–30 minutes a seed for the first five guards, more
with the refresh guard's PPO run; run nothing else alongside)::

    python benchmarks/hacking_guards.py --seeds 3 --out runs/guards

Smallest check that it works (a few minutes)::

    python benchmarks/hacking_guards.py --seeds 1 --iterations 2 --eval-prompts 32 \
        --ensemble-size 2 --set sft.steps=20 rm.steps=10 rm.pairs=200 \
        rollout.prompts_per_iteration=16 --out runs/guards-smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import time
from pathlib import Path

GUARDS = ("plain", "wco", "uwo", "par", "odin", "refresh", "raise_kl", "stop")


def guard_overrides(guard: str, run: Path, k: int) -> list[str]:
    members = [str(run / "rm" / f"member-{i}") for i in range(k)]
    ensemble = ["reward.model=null", f"reward.ensemble={json.dumps(members)}"]
    no_gold_alert = "monitor.gold_drop=null"
    return {
        "plain": [f"reward.model={members[0]}"],
        "wco": ensemble + ["reward.ensemble_combine=wco"],
        "uwo": ensemble + ["reward.ensemble_combine=uwo"],
        "par": [f"reward.model={members[0]}", "reward.shaping=par"],
        "odin": [f"reward.model={run / 'rm-odin'}"],
        "refresh": [
            f"reward.model={members[0]}",
            "reward.refresh_every=2",
            "reward.refresh_steps=40",
        ],
        # the monitor's reactions to its gold-free signals (gold_drop off: the gold reward
        # only measures, as where a user has none)
        "raise_kl": [f"reward.model={members[0]}", "monitor.response=raise_kl", no_gold_alert],
        "stop": [f"reward.model={members[0]}", "monitor.response=stop", no_gold_alert],
    }[guard] + ([] if guard == "par" else ["reward.shaping=none"])  # the default preset's PAR off


def smoothed_drop(gold: list[float], window: int = 3) -> float:
    """Best minus final of the trailing ``window``-iteration moving mean of ``gold``."""
    smooth = [statistics.mean(gold[max(0, i - window + 1) : i + 1]) for i in range(len(gold))]
    return max(smooth) - smooth[-1]


def prepare(seed: int, args) -> tuple[Path, object]:
    """SFT and the reward models of one seed (reused when their folders exist)."""
    from rlhflab.app.demo import _COMMON, demo_config
    from rlhflab.config import load_config
    from rlhflab.trainers.rm_ensemble import train_rm
    from rlhflab.trainers.sft import train_sft

    run, cfg = demo_config(args.preset, seed, args.out, args.set + ["log.progress=false"])
    run.mkdir(parents=True, exist_ok=True)
    if not (run / "sft" / "config.json").exists():
        sft_cfg = load_config(base=_COMMON, overrides=[f"seed={seed}"], stage="sft")
        sft_cfg.sft, sft_cfg.log = cfg.sft, cfg.log
        train_sft(sft_cfg)
    if not (run / "rm" / f"member-{args.ensemble_size - 1}" / "config.json").exists():
        ens = copy.deepcopy(cfg)
        ens.rm.ensemble_size = args.ensemble_size
        train_rm(ens)
    odin_config = run / "rm-odin" / "config.json"
    # a length-head model from before rm.length_exempt (no record of it) is trained again
    if not odin_config.exists() or "odin_exempt" not in json.loads(odin_config.read_text()):
        odin = copy.deepcopy(cfg)
        odin.rm.length_head, odin.rm.output_dir = True, str(run / "rm-odin")
        train_rm(odin)
    return run, cfg


def run_guard(guard: str, seed: int, run: Path, args) -> dict:
    from rlhflab.app.demo import demo_config
    from rlhflab.diagnostics.evaluate import evaluate_policy, heldout_prompts
    from rlhflab.infra.runlog import read_jsonl
    from rlhflab.trainers.ppo import PPOTrainer

    out = run / f"ppo-{guard}"
    if (out / "guard.json").exists():  # finished before: the benchmark is resumable per run
        return json.loads((out / "guard.json").read_text())
    if out.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(out)
    extra = args.set + ["log.progress=false", f"log.output_dir={out}"]
    extra += guard_overrides(guard, run, args.ensemble_size)
    if args.iterations:
        extra.append(f"ppo.iterations={args.iterations}")
    _, cfg = demo_config(args.preset, seed, args.out, extra)
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    prompts = heldout_prompts(args.eval_prompts, seed)

    def evaluate() -> dict:
        """The policy now on the held-out prompts, sampled from the same seed every time
        (common random numbers: an unchanged policy gives the same answers and gold)."""
        policy = trainer.cast.policy_lm
        was_training = policy.training
        result = evaluate_policy(
            policy,
            trainer.cast.reference,
            trainer.cast.tokenizer,
            prompts,
            reward=trainer.cast.reward,
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=seed,
            device=trainer.device,
        )
        policy.train(was_training)
        return result

    curve, eval_seconds = {}, 0.0

    def evaluate_at(iteration: int, _metrics=None) -> None:
        nonlocal eval_seconds
        last = iteration == cfg.ppo.iterations  # evaluated below in any case
        if args.eval_every and iteration % args.eval_every == 0 and not last:
            t = time.perf_counter()
            curve[iteration] = evaluate()["gold"]
            eval_seconds += time.perf_counter() - t

    evaluate_at(0)
    trainer.step_hooks.append(evaluate_at)
    trainer.fit()
    t = time.perf_counter()
    final = evaluate()
    eval_seconds += time.perf_counter() - t
    seconds = time.perf_counter() - t0 - eval_seconds
    curve[trainer.iteration] = final["gold"]
    metrics = read_jsonl(out / "metrics.jsonl")
    gold = [row["monitor/gold"] for row in metrics]
    row = {
        "guard": guard,
        "seed": seed,
        "final_gold": final["gold"],
        "final_accuracy": final["accuracy"],
        # the training batches' drop ("batch gold drop"; the key predates the held-out one)
        "gold_drop": smoothed_drop(gold),
        # best minus final of the held-out gold, every --eval-every iterations from 0
        "heldout_gold": {str(k): v for k, v in sorted(curve.items())},
        **({"heldout_drop": max(curve.values()) - final["gold"]} if len(curve) > 1 else {}),
        # cost: wall seconds of PPO (building the cast included, the held-out evaluations
        # not; untimed if the cores were
        # shared) and the largest memory/peak_mib any iteration logged (the process's peak
        # resident memory so far, so a later run in the same process reads at least the
        # earlier runs' peak: compare the first guard of a seed with care)
        "ppo_seconds": seconds,
        "peak_mib": max(row.get("memory/peak_mib", 0.0) for row in metrics),
    }
    (out / "guard.json").write_text(json.dumps(row, indent=2))
    return row


def sft_row(seed: int, run: Path, args) -> dict:
    """The SFT policy PPO starts from, evaluated as the guards' final policies are: the
    baseline of ``final accuracy`` and ``final gold`` (cached in ``sft-eval.json``)."""
    cached = run / "sft-eval.json"
    if cached.exists():
        return json.loads(cached.read_text())
    from rlhflab import models as M
    from rlhflab.diagnostics.evaluate import evaluate_policy, heldout_prompts

    tok = M.load_tokenizer(str(run / "sft"))
    sft = M.load_causal_lm(str(run / "sft"), tok).eval()
    prompts = heldout_prompts(args.eval_prompts, seed)
    result = evaluate_policy(sft, sft, tok, prompts, max_new_tokens=24, seed=seed)
    row = {"guard": "sft", "seed": seed, "final_gold": result["gold"]}
    row |= {"final_accuracy": result["accuracy"], "gold_drop": 0.0}
    cached.write_text(json.dumps(row, indent=2))
    return row


def unchanged_policy_drop(seed: int, run: Path, iterations: int, args) -> float:
    """The batch gold drop of a policy that never changes: the SFT policy answers
    ``iterations`` fresh batches of 64 prompts, as PPO's training batches would be, and
    :func:`smoothed_drop` reads their gold as it reads a run's: the measure's noise floor."""
    from rlhflab import models as M
    from rlhflab.builtin import tasks
    from rlhflab.diagnostics.evaluate import evaluate_policy

    tok = M.load_tokenizer(str(run / "sft"))
    sft = M.load_causal_lm(str(run / "sft"), tok).eval()
    examples = tasks.make_examples(64 * iterations, seed=20_000 + seed)
    gold = []
    for i in range(iterations):
        prompts = [ex.prompt for ex in examples[64 * i : 64 * (i + 1)]]
        gold.append(evaluate_policy(sft, sft, tok, prompts, seed=1000 * seed + i)["gold"])
    return smoothed_drop(gold)


def values(rows: list[dict], guard: str, key: str) -> list[float]:
    """``key`` of every row of ``guard`` that has it, in seed order."""
    return [r[key] for r in rows if r["guard"] == guard and key in r]


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 … N−1 (default 3)")
    p.add_argument(
        "--preset",
        default="hacking",
        choices=("hacking", "default"),
        help="demo preset: hacking (does a guard stop it?) or default (does a guard cost gold?)",
    )
    p.add_argument("--guards", nargs="+", default=list(GUARDS), choices=GUARDS)
    p.add_argument("--iterations", type=int, default=None, help="ppo.iterations (preset: 50)")
    p.add_argument("--ensemble-size", type=int, default=3, help="reward models in the ensemble")
    p.add_argument("--eval-prompts", type=int, default=512, help="held-out prompts per policy")
    p.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="also evaluate the policy on the held-out prompts at iteration 0 and every N "
        "iterations, for the held-out gold drop (0: only the final policy)",
    )
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides KEY=VALUE")
    p.add_argument("--out", default="runs/guards", help="run folders go here")
    args = p.parse_args()
    rows = []
    for seed in range(args.seeds):
        run, cfg = prepare(seed, args)
        rows.append(sft_row(seed, run, args))
        iterations = args.iterations or cfg.ppo.iterations
        if rows[-1].get("unchanged_iterations") != iterations:  # absent, or another length
            rows[-1]["unchanged_drop"] = unchanged_policy_drop(seed, run, iterations, args)
            rows[-1]["unchanged_iterations"] = iterations
            (run / "sft-eval.json").write_text(json.dumps(rows[-1], indent=2))
        print(json.dumps(rows[-1]), flush=True)
        for guard in args.guards:
            row = run_guard(guard, seed, run, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hacking_guards.json").write_text(json.dumps(rows, indent=2))
    for guard in ["sft", *args.guards]:  # accuracy first: the last lines are the targets'
        accuracy = [r["final_accuracy"] for r in rows if r["guard"] == guard]
        print(f"final accuracy {guard}: {mean_std(accuracy)}")
    # the training batches' drop, for comparison, and its noise floor: the same measure
    # on an unchanged policy (the SFT policy's own batches)
    print(f"batch gold drop unchanged sft: {mean_std(values(rows, 'sft', 'unchanged_drop'))}")
    for guard in args.guards:
        print(f"batch gold drop {guard}: {mean_std(values(rows, guard, 'gold_drop'))}")
    for guard in ["sft", *args.guards]:
        print(f"final gold {guard}: {mean_std(values(rows, guard, 'final_gold'))}")
    for guard in args.guards:
        drops = values(rows, guard, "heldout_drop")
        if len(drops) < len(values(rows, guard, "gold_drop")):  # a run from before the curve
            print(f"gold drop {guard}: n/a (rerun it: its folder has no held-out curve)")
        else:
            print(f"gold drop {guard}: {mean_std(drops)}")


if __name__ == "__main__":
    main()
