"""How ``rlhflab memory`` prints its measurements (:mod:`~.memory`): the models' table, the
iteration's phases and the peak they imply, and what the estimate leaves out."""

from __future__ import annotations

from rlhflab.diagnostics.memory import ModelMemory, PhaseMemory


def format_table(rows: list[ModelMemory], peak: int | None = None) -> str:
    mib = 1024 * 1024
    kept = any(r.kept_casts for r in rows)  # a column only where a model keeps copies
    names = ["weights", *(["16-bit"] if kept else []), "grads", "optimizer", "total"]
    lines = [f"{'model':<10} " + " ".join(f"{n:>10}" for n in names) + "  (MiB)"]

    def cells(name, parts) -> str:
        return f"{name:<10} " + " ".join(f"{b / mib:>10.2f}" for b in parts)

    def parts(r) -> list[int]:
        return [r.weights, *([r.kept_casts] if kept else []), r.gradients, r.optimizer, r.total]

    lines += [cells(r.name, parts(r)) for r in rows]
    lines.append(cells("total", [sum(col) for col in zip(*(parts(r) for r in rows))]))
    if kept:
        lines.append(
            "16-bit: the copies of trained models' weights (a LoRA base's too) kept between "
            "forwards (model.cast_cache)"
        )
    if peak is not None:
        lines.append(f"measured peak resident memory while building: {peak / mib:.1f} MiB")
    return "\n".join(lines)


def estimated_peak(models: list[ModelMemory], phases: list[PhaseMemory]) -> tuple[int, str]:
    """The iteration's peak of tensors and the phase it falls in: weights and AdamW moments
    always (and kept 16-bit weight copies), the gradients of the models that have them in a
    phase, plus the phase's own bytes."""
    always = sum(m.weights + m.kept_casts + m.optimizer for m in models)
    grads = {m.name: m.gradients for m in models}
    peaks: dict[str, int] = {}
    with_grads: dict[str, set[str]] = {}
    for row in phases:
        peaks[row.phase] = peaks.get(row.phase, always) + row.bytes
        with_grads.setdefault(row.phase, set()).update(row.gradients_of)
    for phase, names in with_grads.items():
        peaks[phase] += sum(grads.get(name, 0) for name in names)
    largest = max(peaks, key=peaks.get)
    return peaks[largest], largest


def format_iteration(phases: list[PhaseMemory], models: list[ModelMemory]) -> str:
    """The phases' table and the peak they imply (:func:`estimated_peak`)."""
    mib = 1024 * 1024
    lines = ["", "what one iteration adds, worst case (MiB; * measured on the built models):"]
    for r in phases:
        mark = "*" if r.measured else " "
        lines.append(f"{r.phase:<10} {r.bytes / mib:>10.2f}{mark} {r.what}")
    peak, largest = estimated_peak(models, phases)
    grads = sorted({name for r in phases if r.phase == largest for name in r.gradients_of})
    with_grads = f", {' and '.join(grads)} gradients" if grads else ""
    lines.append(
        f"estimated peak of tensors: {peak / mib:.2f} MiB, in {largest} (weights and AdamW "
        f"moments{with_grads} + {largest}); the process adds its libraries and allocator slack"
    )
    if largest == "monitor":
        lines.append(
            "the monitor's opener probe keeps the prompts' KV cache of policy and reference "
            "until it runs, then extends one rollout.score_micro_batch of them by the "
            "phrases' tokens: a smaller rollout.score_micro_batch, fewer monitor.phrases or "
            "monitor.flattery_opener_ratio=null lowers it"
        )
    return "\n".join(lines)


def not_counted(cast, cfg) -> list[str]:
    """What the estimate leaves out for this config, one line each (said, not guessed)."""
    out = []
    if cfg.reward.refresh_every:
        params = sum(
            p.numel()
            for name, model in cast.models().items()
            if name.startswith("reward")
            for p in model.parameters()
        )
        out.append(
            f"not counted: reward.refresh_every={cfg.reward.refresh_every} fine-tunes the reward "
            f"model(s) every N iterations — at least {params * 12 / 1024**2:.2f} MiB of "
            "gradients and AdamW moments (fp32, 12 bytes a parameter), plus the forward and "
            f"backward of reward.refresh_batch_size={cfg.reward.refresh_batch_size} pairs; "
            "measure it with a short run (memory/peak_mib)"
        )
    estimator = cfg.ppo.advantage_estimator
    if estimator in ("grpo", "rloo"):  # config.CRITIC_FREE_ESTIMATORS
        out.append(
            f"not checked against a run: ppo.advantage_estimator={estimator} — the phases "
            f"above are PPO's on the same answers; rlhflab {estimator}'s own group batches "
            "are not yet measured here (docs/memory.md): confirm with a short run "
            "(memory/peak_mib)"
        )
    return out


def fit_line(device, peak: int) -> str | None:
    """A line where the estimated ``peak`` of tensors is more than the device has for it
    (its free memory and what this process already holds: the models built to measure),
    None where it fits or cannot be told."""
    import torch

    from rlhflab.diagnostics.memory import free_bytes, rss_bytes

    free = free_bytes(device)
    if free is None:
        return None
    device = torch.device(device)
    # what this process holds now (the models; the measured phases are freed, and counted
    # as free again): the allocator's reserve on a GPU, the resident set on a CPU
    held = torch.cuda.memory_reserved(device) if device.type == "cuda" else rss_bytes()
    if peak <= free + held:
        return None
    gib = 2**30
    return (
        f"does not fit here: the estimated peak, {peak / gib:.1f} GiB, is more than the "
        f"{(free + held) / gib:.1f} GiB this machine has for it (free now, and what this "
        "process holds); lower the batch settings above, or see docs/memory.md's levers"
    )
