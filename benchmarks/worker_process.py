"""The worker processes of the TRL comparisons: starting one, what it reports, the summary.

Each run of a side is a fresh process running a script with ``--worker``; ``launch``
starts it (threads, malloc, torch's libraries evicted from the page cache first by
``evict_torch_libraries``) and reads the ``RESULT`` line it prints. Inside the worker,
``timed_fit`` trains an rlhflab trainer and ``worker_result`` packs what it measured
(iteration end times, generation tokens/s, peak RSS, the malloc in use). ``summarise``
turns a side's runs into median seconds per iteration, spread, tokens/s and peak memory.
Module level is stdlib only: TRL's workers, with no rlhflab, import it too.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _peak_rss_mib() -> float:
    # rlhflab.diagnostics.memory.peak_rss_bytes reads the same line, but the TRL worker runs in TRL's
    # venv, where rlhflab is not importable
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker_result(start: float, ticks: list, gen: list) -> dict:
    """What a worker reports: iteration end times, sampling speed, peak RSS, its malloc."""
    return {
        "start": start,
        "ticks": ticks,
        "gen_tps": gen,
        "peak_mib": _peak_rss_mib(),
        "allocator": _allocator_in_use(),
    }


def _allocator_in_use() -> str:
    with open("/proc/self/maps") as f:  # rlhflab.backends.allocator.in_use, for TRL's venv too
        return "mimalloc" if "libmimalloc" in f.read() else "system"


def timed_fit(trainer) -> dict:
    """Train an rlhflab trainer, noting when each iteration ends and its sampling speed."""
    ticks, gen = [], []
    trainer.callbacks.append(
        lambda t, ro, m: (
            ticks.append(time.perf_counter()),
            gen.append(m["response/tokens"] / m["time/generate"]),
        )
    )
    start = time.perf_counter()
    trainer.fit()
    return worker_result(start, ticks, gen)


def launch(
    python: str,
    worker_args: list[str],
    allocator: str = "system",
    threads: int = 1,
    ours: bool = True,
    script: Path = HERE / "vs_trl.py",
    what: str = "worker",
) -> dict:
    """Run ``script --worker *worker_args`` under ``python`` in a fresh process, on
    ``threads`` threads and the malloc ``allocator`` names, with torch's libraries evicted
    from the page cache first; the dict its ``RESULT`` line carries. ``ours``: rlhflab's
    src/ on its path (TRL's venv has no rlhflab)."""
    from rlhflab.backends.allocator import environment

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    # the malloc the worker starts on: rlhflab's command starts on mimalloc where installed
    # (rlhflab/backends/allocator.py); TRL on the system's unless --trl-allocator says otherwise
    env = environment(allocator, env)
    env["PYTHONPATH"] = str(HERE.parent / "src") if ours else ""
    cmd = [python, str(Path(script).resolve()), "--worker", *worker_args]
    evict_torch_libraries(python)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def evict_torch_libraries(python: str) -> None:
    """Drop torch's shared libraries of ``python``'s venv from the page cache, so that every
    worker maps them from a cold start.

    Peak RSS counts the file pages a process has mapped, and how many pages one fault maps
    depends on how the file sits in the page cache (its history: written by pip, read by
    other processes). On this VM the same libtorch_cpu.so, byte for byte, left
    ``import torch`` at 272 MiB in one venv and 224 MiB in the other until both were
    evicted; then 230 and 224. Files pip has just written sit in 1 MiB folios, which a fault
    maps whole: the 0.2M rlhflab worker peaked at 388 MiB on a fresh install against 317
    after eviction (rlhflab/infra/pagecache.py). Neither library's doing, so both sides
    start cold. Pages a process has mapped stay cached, so main() evicts rlhflab's before
    this process imports torch itself.
    """
    from rlhflab.infra.pagecache import drop

    venv = Path(python).parent.parent
    drop(venv.glob("lib/python3*/site-packages/torch/lib/*.so*"))


def per_iteration(result: dict, warmup: int) -> list[float]:
    ticks = [result["start"], *result["ticks"]]
    return [b - a for a, b in zip(ticks[warmup:], ticks[warmup + 1 :])]


def summarise(runs: list[dict], warmup: int) -> dict:
    secs = [s for r in runs for s in per_iteration(r, warmup)]
    gen = [g for r in runs for g in r["gen_tps"][warmup:]]
    return {
        "s_per_it": statistics.median(secs),
        "spread": (min(secs), max(secs)),
        "gen_tps": statistics.median(gen),
        "peak_mib": max(r["peak_mib"] for r in runs),
        "allocator": sorted({r.get("allocator", "?") for r in runs}),
    }
