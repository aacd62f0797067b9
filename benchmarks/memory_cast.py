"""Peak resident memory of the four-model cast in four layouts (issue: the four-model cast).

Each layout runs in its own process: build the cast for a ~29M-parameter policy (the
`medium` preset) with a reward model of the same size, then one PPO-shaped
forward/backward/AdamW step of policy and critic on 8 sequences of 96 tokens, in
micro-batches of 2 (gradient accumulation) in every layout.

Reported per layout: the process's peak RSS, and the peak *above* the RSS right after
importing torch and transformers (~350 MiB of libraries that every layout pays equally).
The ratio line uses the latter, the memory the cast itself costs.

    python benchmarks/memory_cast.py            # prints a table, last line the ratio
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

LAYOUTS = {
    "naive: four fp32 copies": {"model.value_model": "separate"},
    "shared policy/value backbone": {"model.value_model": "shared"},
    "shared + int8 reference and reward": {
        "model.value_model": "shared",
        "model.reference_precision": "int8",
        "model.reward_precision": "int8",
    },
    "LoRA policy (ref = base) + int8 reward": {
        "model.value_model": "shared",
        "model.lora_r": 8,
        # the attention-only targets of the table in docs/benchmarks.md (the default before
        # issue #26; model.lora_targets is now all-linear)
        "model.lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "model.reward_precision": "int8",
    },
}


MICRO = 2  # sequences per micro-batch


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(layout: str, rm_path: str) -> None:
    import torch
    import transformers  # noqa: F401  (import cost counted in the baseline)

    from rlhflab import models as M
    from rlhflab.config import load_config
    from rlhflab.core.algorithms import logprobs_from_logits
    from rlhflab.diagnostics.memory import peak_rss_bytes
    from rlhflab.experience.cast import build_cast

    torch.manual_seed(0)
    baseline = current_rss()
    over = {
        "model.policy": "preset:medium",
        "reward.model": rm_path,
        "device": "cpu",
        **LAYOUTS[layout],
    }
    cfg = load_config(overrides=[f"{k}={v}" for k, v in over.items()])
    cast = build_cast(cfg)
    params = [p for p in cast.policy.parameters() if p.requires_grad]
    if cast.critic is not None:
        params += list(cast.critic.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(3, len(cast.tokenizer), (8, 96))
    mask = torch.ones_like(ids)
    from rlhflab.experience.rewards import RewardBatch

    with torch.no_grad():
        cast.reward(RewardBatch([""] * 8, [""] * 8, ids, mask))
    for s in range(0, 8, MICRO):  # gradient accumulation, identical in every layout
        i, m = ids[s : s + MICRO], mask[s : s + MICRO]
        with torch.no_grad():
            ref = M.causal_forward(cast.reference, i, m).logits
        if cast.shared:
            logits, values = cast.policy(i, m)
        else:
            logits = M.causal_forward(cast.policy, i, m).logits
            values = M.token_values(cast.critic, i, m)
        lp = logprobs_from_logits(logits[:, :-1], i[:, 1:])
        ref_lp = logprobs_from_logits(ref[:, :-1], i[:, 1:])
        loss = (lp - ref_lp).pow(2).mean() + values.pow(2).mean()
        loss.backward()
    opt.step()
    peak = peak_rss_bytes()
    print(json.dumps({"peak": peak, "cast_peak": peak - baseline}))


def main() -> None:
    from rlhflab.models.presets import build_preset

    with tempfile.TemporaryDirectory() as tmp:
        rm_path = str(build_preset("medium", os.path.join(tmp, "rm"), seed=1, heads=["score"]))
        # build the cached policy preset once, outside the measured processes
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from rlhflab.models.presets import preset_path; preset_path('medium')",
            ],
            check=True,
        )
        results = {}
        for layout in LAYOUTS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", layout, rm_path],
                check=True,
                capture_output=True,
                text=True,
            )
            results[layout] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1024 * 1024
    naive = results["naive: four fp32 copies"]["cast_peak"]
    print(f"{'layout':<42} {'peak RSS':>10} {'cast peak':>10} {'vs naive':>9}  (MiB)")
    for layout, r in results.items():
        print(
            f"{layout:<42} {r['peak'] / mib:>10.0f} {r['cast_peak'] / mib:>10.0f} "
            f"{r['cast_peak'] / naive:>9.2f}"
        )
    leanest = min(r["cast_peak"] for r in results.values())
    print(f"leanest/naive peak memory: {leanest / naive:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
