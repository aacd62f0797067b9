"""A trained policy's answers to prompts, and their scores: ``rlhflab generate`` and ``eval``.

Answers come from rlhflab's own sampler (``experience.rollout.generate_rollout``, as PPO's
step 1) with the rollout settings: ``rollout.temperature``, ``top_k``, ``top_p``,
``max_new_tokens`` and ``ignore_eos``, taken from the run's ``config.yaml`` when the model is
a run directory, under ``--config`` and the dotted overrides. One generator seeded with
``seed`` draws every batch in turn, so the same seed, prompts and batch size give the same
answers. Each prompt is asked ``n`` times in a row, as GRPO groups them.

``eval`` scores every answer with each reward model (every head), each reward function and
the gold function, and reports mean ± standard error per scorer, with the answers' length
and how many ended with EOS. Without ``--prompts`` it runs on the built-in task's held-out
prompts with its gold reward (``diagnostics.evaluate``: the demo's held-out set and verdict).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from rlhflab.config import Config
from rlhflab.config import base as configbase
from rlhflab.config.base import ConfigError
from rlhflab.diagnostics.evaluate import heldout_prompts, judge_answers
from rlhflab.experience.cast import freeze_reward_model
from rlhflab.experience.data import load_prompts
from rlhflab.experience.rewards import FunctionReward, ModelReward, RewardBatch
from rlhflab.experience.rollout import Rollout, generate_rollout
from rlhflab.infra.distributed import resolve_device
from rlhflab.infra.files import write_lines_atomic, write_text_atomic
from rlhflab.infra.runs import PolicySource, find_policy, is_run_dir, read_run_config
from rlhflab.models import positions_of
from rlhflab.models.build import load_model, load_tokenizer_for
from rlhflab.models.text import encode_prompt
from rlhflab.trainers.common import progress

log = logging.getLogger(__name__)

BUILTIN_GOLD = "rlhflab.builtin.tasks:gold_reward"
BUILTIN_HELDOUT = 256  # held-out prompts of the built-in task, as the demo's quick preset
# answers sampled together: fixed, not a run's setting, so that a run directory and the
# folder exported from it give the same answers for the same seed
DEFAULT_BATCH = 32


def answer_config(model: str, config: str | None, overrides: list[str]) -> Config:
    """The settings of a generate/eval call: the run's ``config.yaml`` when ``model`` is a
    run directory (else the defaults), then the ``--config`` file, then the overrides."""
    path = Path(model).expanduser()
    run = not model.startswith("preset:") and path.is_dir() and is_run_dir(path)
    recorded = read_run_config(path) if run else None
    # a value the run recorded that this rlhflab refuses (an older one took it) names the file
    cfg = configbase.load(Config, config, overrides, recorded, path / "config.yaml")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return cfg


def read_prompts(path: str, src: PolicySource, cfg: Config) -> list[str]:
    d = cfg.data
    prompts, _ = load_prompts(
        path,
        src.tokenizer,
        cfg.rollout.max_prompt_tokens,
        d.prompt_field,
        d.messages_field,
        d.on_bad_row,
        d.split,
    )
    return prompts


def rollouts(
    src: PolicySource, cfg: Config, prompts: list[str], n: int, batch_size: int, desc: str
) -> Iterator[Rollout]:
    """Answers to each prompt, ``n`` in a row, ``batch_size`` answers per sampling call."""
    r, device = cfg.rollout, next(src.lm.parameters()).device
    _check_room(src, prompts, r.max_new_tokens)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    asked = [p for p in prompts for _ in range(n)]
    starts = range(0, len(asked), batch_size)
    for s in progress(starts, cfg.log.progress, desc, unit="batch"):
        yield generate_rollout(
            src.lm,
            src.tokenizer,
            asked[s : s + batch_size],
            r.max_new_tokens,
            r.temperature,
            r.top_k,
            r.top_p,
            gen,
            device,
            ignore_eos=r.ignore_eos,
            sampler=r.sampler,
        )


# files a run directory or a model folder is read by: an answers file or summary written
# under one of these names in such a folder would replace a run's log, or turn the run into
# a "model folder" or a "PEFT folder"
OWNED_NAMES = frozenset(
    {
        "metrics.jsonl",
        "samples.jsonl",
        "alerts.jsonl",
        "run.json",
        "config.yaml",
        "config.json",
        "generation_config.json",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "summary.json",
        "compare.json",
        "sweep.json",
    }
)


def _owned_folder(folder: Path) -> bool:
    """A run directory (its config.yaml beside its log, run.json or checkpoints) or a model
    folder (config.json, or a PEFT adapter's adapter_config.json); a folder that merely
    holds a user's config.yaml is neither."""
    if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
        return True
    marks = ("metrics.jsonl", "run.json", "checkpoints")
    return (folder / "config.yaml").is_file() and any((folder / m).exists() for m in marks)


def _check_out(out: Path, prompts: str | None) -> None:
    """An output file that would fail only once the work is done (a folder), would
    overwrite the prompts being read, or would take the name of a file a run or model
    folder is read by (``RUN/metrics.jsonl``, ``MODEL/config.json``), is refused first."""
    if out.is_dir():
        raise ConfigError(f"--out {out}: a folder; name the file to write")
    if prompts and out.exists() and out.resolve() == Path(prompts).expanduser().resolve():
        raise ConfigError(f"--out {out}: the prompt file itself; name another file")
    folder = out.parent
    if _owned_folder(folder) and (out.name in OWNED_NAMES or out.suffix == ".safetensors"):
        raise ConfigError(
            f"--out {out}: {folder} is a run or model folder, which reads {out.name}; name "
            "another file"
        )


def _check_room(src: PolicySource, prompts: list[str], max_new_tokens: int) -> None:
    """The longest prompt and a whole answer must fit the model's positions (a learned
    position table has no row beyond them: an IndexError deep in the forward otherwise)."""
    limit = positions_of(src.lm.config)
    if limit is None or not prompts:
        return
    tok = src.tokenizer
    longest = max(len(encode_prompt(tok, p)) for p in prompts)
    if longest + max_new_tokens > limit:
        raise ConfigError(
            f"rollout.max_new_tokens: the longest prompt ({longest} tokens) + "
            f"max_new_tokens ({max_new_tokens}) = {longest + max_new_tokens} exceeds the "
            f"model's {limit} positions (the position limit of its config.json); lower "
            "rollout.max_new_tokens or shorten the prompts"
        )


def answer_rows(ro: Rollout) -> list[dict]:
    """One row per answer; ``tokens`` counts the answer's tokens, its EOS included (the
    rollout's response mask)."""
    lengths, ended = ro.response_mask.sum(1).tolist(), ro.ended.tolist()
    return [
        {"prompt": p, "answer": a, "tokens": int(t), "ended_with_eos": bool(e)}
        for p, a, t, e in zip(ro.prompts, ro.responses, lengths, ended)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines, written beside ``path`` and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(path, (json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _batch_size(batch_size: int | None) -> int:
    size = DEFAULT_BATCH if batch_size is None else batch_size
    if size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {size}")
    return size


def sampling(cfg: Config, batch_size: int) -> dict:
    r = cfg.rollout
    return {
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_k": r.top_k,
        "top_p": r.top_p,
        "ignore_eos": r.ignore_eos,
        "sampler": r.sampler,
        "seed": cfg.seed,
        "batch_size": batch_size,
    }


def run_generate(args) -> dict:
    """``rlhflab generate``: answers to a prompt file as JSON lines; returns a summary."""
    if args.n < 1:
        raise ConfigError(f"--n: must be >= 1, got {args.n}")
    _check_out(Path(args.out), args.prompts)
    cfg = answer_config(args.model, args.config, args.overrides)
    src = find_policy(args.model, cfg.model, args.checkpoint)
    prompts = read_prompts(args.prompts, src, cfg)  # before the weights: bad rows come fast
    src.load(resolve_device(cfg.device))
    size = _batch_size(args.batch_size)
    rows = [
        row
        for ro in rollouts(src, cfg, prompts, args.n, size, "generate")
        for row in answer_rows(ro)
    ]
    out = Path(args.out)
    write_jsonl(out, rows)
    return {"answers": len(rows), "prompts": len(prompts), "out": str(out), **sampling(cfg, size)}


# ----------------------------------------------------------------------------- eval


def _unique(name: str, taken: set[str]) -> str:
    label, k = name, 2
    while label in taken:
        label, k = f"{name}-{k}", k + 1
    taken.add(label)
    return label


def reward_model_source(folder: str, label: str, cfg: Config, src: PolicySource, device):
    """``folder``'s reward model, frozen as PPO's cast holds it, scoring every head."""
    tokenizer = load_tokenizer_for(folder, cfg.model, "--reward-model")
    rm = load_model(
        folder,
        tokenizer,
        cfg.model,
        "classifier",
        field="--reward-model",
        trained=False,
        precision=cfg.model.reward_precision,
        trained_head_for="--reward-model",
    )
    rm = freeze_reward_model(rm, cfg, device, offload=False)
    micro = cfg.rollout.score_micro_batch
    return ModelReward(rm, tokenizer, src.tokenizer, device=device, micro_batch=micro, name=label)


def scorers(args, cfg: Config, src: PolicySource, gold: str | None, device) -> list[tuple]:
    """(kind, spec, source) of every scorer: the gold function, each reward model, each
    reward function. The functions are imported here: a wrong name stops before sampling."""
    out, taken = [], set()
    if gold:
        out.append(("gold", gold, FunctionReward(gold)))
    for folder in args.reward_model or []:
        label = _unique(Path(folder).name or folder, taken)
        out.append(("model", folder, reward_model_source(folder, label, cfg, src, device)))
    for spec in args.reward or []:
        out.append(("function", spec, FunctionReward(spec)))
    return out


def score(batch: RewardBatch, sources: list[tuple], builtin: bool) -> dict[str, list[float]]:
    """Each scorer's value per answer, by label: the gold function's component is 'gold'
    (several: 'gold/NAME'), a reward model's 'FOLDER/HEAD', a function's its own names."""
    scores: dict[str, list[float]] = {}
    for kind, _, source in sources:
        parts = source(batch)
        for name, values in parts.items():
            label = name
            if kind == "gold":
                label = "gold" if len(parts) == 1 else f"gold/{name}"
            scores[_unique(label, set(scores))] = [float(v) for v in values]
    if builtin:  # the demo's verdict beside the gold: right, flattering, repeating
        for name, values in judge_answers(batch.prompts, batch.responses).items():
            if name != "gold":
                scores[name] = values
    return scores


def mean_stderr(values: list[float]) -> dict:
    """Mean and standard error of the finite values (a non-finite score is counted apart)."""
    finite = [v for v in values if math.isfinite(v)]
    n = len(finite)
    mean = sum(finite) / n if n else None
    stderr = None
    if n > 1:
        var = sum((v - mean) ** 2 for v in finite) / (n - 1)
        stderr = math.sqrt(var / n)
    return {"mean": mean, "stderr": stderr, "n": n, "non_finite": len(values) - n}


def _eval_prompts(args, cfg: Config, src: PolicySource) -> tuple[list[str], str, str | None]:
    """(prompts, where they come from, the gold function)."""
    if args.prompts:
        prompts = read_prompts(args.prompts, src, cfg)
        return prompts[: args.limit] if args.limit else prompts, args.prompts, args.gold
    trained_on = (src.run_config or {}).get("data", {}).get("prompts")
    if trained_on:
        raise ConfigError(
            f"--prompts: {src.source} trained on {trained_on} (data.prompts); give held-out "
            "prompts of that task"
        )
    if src.kind != "run" and not src.source.startswith("preset:"):
        log.warning(
            "--prompts is not given: %s is evaluated on the built-in task's held-out prompts "
            "with its gold reward; give --prompts FILE (and --gold) for your own task",
            src.source,
        )
    n = args.limit or BUILTIN_HELDOUT
    where = f"built-in task, {n} held-out prompts (seed {10_000 + cfg.seed})"
    return heldout_prompts(n, cfg.seed, cfg.data.task), where, args.gold or BUILTIN_GOLD


def run_eval(args) -> dict:
    """``rlhflab eval``: sample, score, summarise; writes the summary (JSON) and the
    answers with their scores (JSON lines beside it). Returns the summary."""
    out = Path(args.out)
    answers_path = out.with_suffix(".jsonl")
    if answers_path == out:
        raise ConfigError(f"--out {out}: the summary is JSON; name a .json file")
    for path in (out, answers_path):  # before the evaluation, not after it
        _check_out(path, args.prompts)
    if args.n < 1:
        raise ConfigError(f"--n: must be >= 1, got {args.n}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {args.limit}")
    cfg = answer_config(args.model, args.config, args.overrides)
    device = resolve_device(cfg.device)
    src = find_policy(args.model, cfg.model, args.checkpoint)
    prompts, where, gold = _eval_prompts(args, cfg, src)
    sources = scorers(args, cfg, src, gold, device)
    src.load(device)
    size = _batch_size(args.batch_size)
    rows: list[dict] = []
    for ro in rollouts(src, cfg, prompts, args.n, size, "eval"):
        batch = RewardBatch(ro.prompts, ro.responses, ro.sequences, ro.attention_mask, ro.ended)
        batch_scores = score(batch, sources, builtin=args.prompts is None)
        for i, row in enumerate(answer_rows(ro)):
            rows.append({**row, "scores": {k: v[i] for k, v in batch_scores.items()}})
    names = list(rows[0]["scores"]) if rows else []
    summary = {
        "model": src.source,
        "checkpoint": str(src.checkpoint) if src.checkpoint else None,
        "prompts": where,
        "prompt_count": len(prompts),
        "answers_per_prompt": args.n,
        "answers": len(rows),
        "sampling": sampling(cfg, size),
        "scorers": [{"kind": kind, "spec": spec} for kind, spec, _ in sources],
        "scores": {k: mean_stderr([r["scores"][k] for r in rows]) for k in names},
        "length": mean_stderr([float(r["tokens"]) for r in rows]),
        "eos_rate": mean_stderr([float(r["ended_with_eos"]) for r in rows]),
        "answers_file": str(answers_path),
    }
    write_jsonl(answers_path, rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def _cell(stat: dict) -> str:
    mean = "n/a" if stat["mean"] is None else f"{stat['mean']:.4f}"
    se = "" if stat["stderr"] is None else f"{stat['stderr']:.4f}"
    bad = f"  ({stat['non_finite']} not finite)" if stat["non_finite"] else ""
    return f"{mean:>10}  {se:>8}{bad}"


def format_eval(summary: dict) -> str:
    """The table ``rlhflab eval`` prints: mean ± standard error per scorer, then the
    answers' length and EOS rate."""
    s = summary["sampling"]
    checkpoint = f" ({Path(summary['checkpoint']).name})" if summary["checkpoint"] else ""
    rows = list(summary["scores"].items())
    rows += [("answer length (tokens)", summary["length"]), ("EOS rate", summary["eos_rate"])]
    width = max(len(name) for name, _ in rows) + 2
    lines = [
        f"eval of {summary['model']}{checkpoint}",
        f"{summary['answers']} answers ({summary['prompt_count']} prompts × "
        f"{summary['answers_per_prompt']}) on {summary['prompts']}; seed {s['seed']}, "
        f"temperature {s['temperature']}, top_k {s['top_k']}, top_p {s['top_p']}, "
        f"max_new_tokens {s['max_new_tokens']}",
        "",
        f"{'scorer':<{width}}{'mean':>10}  {'± s.e.':>8}",
    ]
    lines += [f"{name:<{width}}{_cell(stat)}" for name, stat in rows]
    return "\n".join(lines)
