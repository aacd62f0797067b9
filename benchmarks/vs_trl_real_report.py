"""The report of ``vs_trl_real.py``: each row's summary, the table and the closing lines.

``summarise`` is ``worker_process.summarise`` plus TRL's mixed precision and the KL figures
a levers run carries; ``format_table`` prints every row against TRL fp32 (and the floor);
``ratio_lines`` prints the last lines docs/benchmarks.md quotes, saying which ratios a
failed or skipped row leaves out.
"""

from __future__ import annotations

import statistics

import worker_process
from vs_trl_real_work import FULL, LORA_R, NAME, ROWS


def summarise(runs: list[dict], warmup: int) -> dict:
    """``worker_process.summarise`` plus the KL figures a levers run carries."""
    out = worker_process.summarise(runs, warmup)
    if any("mixed_precision" in r for r in runs):  # TRL's accelerator, as it ran
        out["mixed_precision"] = sorted({r["mixed_precision"] for r in runs})
    for key in ("kl_to_full", "kl_to_full_max", "kl_from_base", "kl_from_base_max"):
        values = [r[key] for r in runs if key in r]
        if values:
            out[key] = statistics.median(values)
            out[key + "_runs"] = values
    return out


def row_label(side: str, record: dict) -> str:
    if side in ("levers", FULL):
        lv = record["levers"]
        reward, compute = (lv["reward"], lv["compute"]) if side == "levers" else ("fp32", "fp32")
        return (
            f"rlhflab levers: LoRA r={LORA_R} all-linear, shared value head, reward {reward}, "
            f"compute {compute}" + (" (full precision; one run)" if side == FULL else "")
        )
    ran = record["rows"].get(side, {}).get("mixed_precision")
    return ROWS[side] + (f" (accelerator mixed precision: {'/'.join(ran)})" if ran else "")


def format_table(record: dict) -> str:
    res, floor, trl = record["rows"], record["floor_s"], record["rows"].get("trl")
    lines = [
        f"## {NAME}-Instruct, {record['rollouts']} rollouts × {record['answer']} tokens, "
        f"{record['epochs']} epochs, {record['threads']} threads; {record['rounds']} round(s) "
        f"of {record['warmup']} + {record['iterations']} iterations",
        "| row | s/iteration (median) | min–max | gen tokens/s | peak MiB | time / TRL fp32 "
        "| memory / TRL fp32 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for side in [*ROWS, FULL]:
        if side in res:
            r = res[side]
            t = f"{r['s_per_it'] / trl['s_per_it']:.3f}" if trl else "–"
            m = f"{r['peak_mib'] / trl['peak_mib']:.3f}" if trl else "–"
            lines.append(
                f"| {row_label(side, record)} | {r['s_per_it']:.2f} | {r['spread'][0]:.2f}–"
                f"{r['spread'][1]:.2f} | {r['gen_tps']:.0f} | {r['peak_mib']:.0f} | {t} | {m} |"
            )
        elif side in record["errors"]:
            first = record["errors"][side].strip().splitlines()[-1][:160]
            lines.append(f"| {row_label(side, record)} | failed: {first} | | | | | |")
    if floor:
        from time_floor import describe  # this folder's benchmark

        lines.append(describe(floor, 2))
    return "\n".join(lines)


def ratio_lines(record: dict) -> list[str]:
    """The closing lines: floor, equal settings, levers against TRL fp32 and bf16, KL."""
    res, errors = record["rows"], record["errors"]

    def missing(side: str) -> str:
        return f"n/a ({side} failed)" if side in errors else f"n/a ({side} not run)"

    def ratio(a: str, b: str, key: str) -> str:
        for side in (a, b):
            if side not in res:
                return missing(side)
        return f"{res[a][key] / res[b][key]:.3f}"

    out = []
    if record["floor_s"]:
        trl = res.get("trl")
        value = f"{record['floor_s']['total'] / trl['s_per_it']:.3f}" if trl else missing("trl")
        out.append(f"floor / TRL {NAME}: {value}")
        floor = record["floor_s"]
        for side in ("rlhflab", "trl"):
            if side in res:
                r = res[side]["s_per_it"]
                out.append(
                    f"{side} / floor {NAME}: {r / floor['total']:.2f} (against the products "
                    f"and attention alone, decode in cache: {r / floor['products_and_attention']:.2f})"
                )
    pairs = [
        ("equal", "rlhflab", "trl"),
        ("equal transformers runtime", "rlhflab-tf", "trl"),
        ("TRL bf16 vs TRL fp32", "trl-bf16", "trl"),
        ("levers", "levers", "trl"),
        ("levers vs TRL bf16", "levers", "trl-bf16"),
    ]
    for name, a, b in pairs:
        if a in record["asked"]:
            out.append(f"time ratio {NAME} {name}: {ratio(a, b, 's_per_it')}")
            out.append(f"memory ratio {NAME} {name}: {ratio(a, b, 'peak_mib')}")
    lv = res.get("levers", {})
    if "kl_to_full" in lv:
        full = res.get(FULL, {})
        out.append(
            f"KL {NAME} levers to full precision: {lv['kl_to_full']:.2e} nats per answer token "
            f"(max {lv['kl_to_full_max']:.2e}); the full-precision run moved "
            f"{full.get('kl_from_base', float('nan')):.2e} from the base"
        )
    elif "levers" in res:
        reason = errors.get(FULL, "the levers' precision is full: nothing to compare")
        out.append(f"KL {NAME} levers to full precision: n/a ({reason.strip().splitlines()[-1]})")
    return out
