"""Data parallelism on PyTorch's own engine: ``torchrun`` + DDP or FSDP2 (``fully_shard``).

    torchrun --nproc-per-node 2 -m rlhflab ppo --config FILE dist.strategy=fsdp

Each rank generates and scores its share of the rollout batch. Statistics that define the
update are global: whitening moments, the token count that normalises the loss, and the KL
the controller sees are all-reduced. Data order is shared; sampling seeds differ per rank.
Only rank 0 writes logs, samples and reports. The backend follows the device: gloo on CPU,
nccl on GPU. Nothing here runs when the process is not started by torchrun (world size 1).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from rlhflab.config.base import ConfigError
from rlhflab.models import CriticValues, PolicyWithValueHead


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, ...) tensor, concatenated in rank order (B equal on all ranks):
        for statistics that are not means of per-rank means, e.g. a ratio of means."""
        if not self.enabled:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def all_true(self, flag: bool) -> bool:
        """True only when the flag is true on every rank (a collective decision)."""
        if not self.enabled:
            return flag
        t = torch.tensor([0.0 if flag else 1.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.item() == 0.0

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average every numeric metric over ranks (keys are the same on every rank)."""
        if not self.enabled:
            return metrics
        keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
        vals = torch.tensor(
            [float(metrics[k]) for k in keys], dtype=torch.float64, device=self.device
        )
        vals = self.all_sum(vals) / self.world
        return {**metrics, **dict(zip(keys, vals.tolist()))}

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def resolve_device(name: str) -> torch.device:
    """The project's one device rule, for every trainer: ``device`` 'auto' is CUDA when
    there is one, else the CPU; 'cuda' with no CUDA device is an error, never a quiet CPU
    run that would take hours where the user expected minutes."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device: 'cuda' was asked for but torch sees no CUDA device "
            f"(torch {torch.__version__}); set device=cpu or device=auto"
        )
    return torch.device(name)


def init_distributed(device_name: str = "auto") -> DistContext:
    """Join the process group torchrun set up (gloo on CPU, nccl on GPU); else world size 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = resolve_device(device_name).type == "cuda"
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistContext(rank, world, local, device)


def shutdown_distributed(wait: bool = True) -> bool:
    """Leave the process group at the end of a run: every rank waits for the others, then
    destroys it. True when there was a group to leave (see :func:`exit_without_teardown`).

    ``wait=False``, for a rank that failed: no barrier and no teardown of the group. An
    error one rank alone meets (its reward function raised on its answers) leaves the
    others inside the iteration's next collective; a barrier here would wait for them as
    they wait for it, until gloo's 30-minute timeout. The caller exits at once instead,
    and torchrun's agent ends the other ranks."""
    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
            dist.destroy_process_group()
        return True
    return False


def exit_without_teardown(code: int) -> NoReturn:
    """End a process that ran a gloo group with ``code``: its exit handlers run and its
    output is flushed, then it exits at once, without the interpreter's teardown.

    Why: ``destroy_process_group`` does not stop gloo's worker threads while anything still
    holds the group, and FSDP2's device mesh does (torch 2.13: ``DeviceMesh._pg_registry``,
    reached from cached DTensor specs). A worker thread that drops its last tensor after
    teardown has begun needs the GIL, which a finalising interpreter no longer grants: the
    thread is unwound through C++ code that cannot unwind and the rank dies with
    "terminate called without an active exception" (SIGABRT) after a run that finished —
    1 in ~120 two-rank FSDP runs on a busy 2-core machine (pytorch/pytorch PR 179291
    describes the same mechanism). Exiting before teardown leaves no window for it."""
    atexit._run_exitfuncs()  # logging.shutdown, weakref finalizers, …: what exit would run
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def rank_split(
    answers: int,
    world: int,
    minibatches: int,
    micro_batch_size: int | None = None,
    group_size: int = 1,
) -> int:
    """Answers per minibatch on each rank, for a rollout of ``answers`` over ``world`` ranks.

    Every rank must hold the same number of answers (whole groups of ``group_size`` for
    GRPO/RLOO, whose baseline is computed within a rank's share) and cut them into exactly
    ``minibatches`` equal minibatches: then a run takes ``ppo.minibatches`` optimiser steps
    per epoch whatever its world size, and each step's gradient averages the same number of
    answers on every rank. A check of the global batch alone lets 12 answers on 2 ranks
    make 6 steps of 1 answer per epoch with 4 minibatches, or divide by zero with 8."""
    where = f"over {world} rank{'s' if world > 1 else ''}"
    if answers % world:
        raise ConfigError(f"rollout.prompts_per_iteration: {answers} answers do not split {where}")
    local = answers // world
    if local % group_size:
        raise ConfigError(
            f"grpo.group_size: rollout.prompts_per_iteration={answers} {where} gives each "
            f"rank {local} answers, not whole groups of {group_size}"
        )
    if local % minibatches:
        raise ConfigError(
            f"ppo.minibatches: {minibatches} minibatches do not split the {local} answers "
            f"each rank holds (rollout.prompts_per_iteration={answers} {where}); make "
            f"prompts_per_iteration a multiple of {minibatches * world}"
        )
    per_minibatch = local // minibatches
    micro = micro_batch_size
    if micro is not None and micro < per_minibatch and per_minibatch % micro:
        raise ConfigError(
            f"ppo.micro_batch_size: {micro} does not divide the minibatch of {per_minibatch} "
            f"answers each rank holds (rollout.prompts_per_iteration={answers} {where}, "
            f"ppo.minibatches={minibatches})"
        )
    return per_minibatch


def global_moments(x: torch.Tensor, mask: torch.Tensor, ctx: DistContext):
    """Masked mean and unbiased variance of ``x`` over every rank's selected elements."""
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    xs = torch.where(m, x.double(), zero)
    n = ctx.all_sum(m.sum().double().reshape(1))[0]
    mean = ctx.all_sum(xs.sum().reshape(1))[0] / n.clamp(min=1)
    sq = ctx.all_sum(torch.where(m, (x.double() - mean) ** 2, zero).sum().reshape(1))[0]
    var = torch.where(n > 1, sq / (n - 1).clamp(min=1), zero)
    return mean.to(x.dtype), var.to(x.dtype)


def global_batch_moments(x: torch.Tensor, ctx) -> tuple[int, float, float]:
    """Count, mean and sum of squared deviations (float64) of every rank's ``x`` together,
    for :meth:`rlhflab.core.stats.RunningMoments.merge`; this rank's alone at world size 1.
    Two reductions (the mean first, then the deviations from it), not a sum of squares,
    which cancels catastrophically when the mean is large against the spread."""
    x = x.double().reshape(-1)
    n = ctx.all_sum(torch.tensor([float(x.numel())], dtype=torch.float64, device=x.device))[0]
    if n.item() == 0:
        return 0, 0.0, 0.0
    mean = ctx.all_sum(x.sum().reshape(1))[0] / n
    m2 = ctx.all_sum(((x - mean) ** 2).sum().reshape(1))[0]
    return int(n.item()), mean.item(), m2.item()


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (``base_model.layers``), seen through rlhflab's
    PolicyWithValueHead / CriticValues wrappers."""
    core = module
    if isinstance(module, PolicyWithValueHead):
        core = module.lm
    elif isinstance(module, CriticValues):
        core = module.model
    layers = getattr(getattr(core, "base_model", None), "layers", None)
    if layers is None:
        raise ValueError(
            "dist.strategy=fsdp: cannot find the model's decoder layers "
            "(expected base_model.layers)"
        )
    return list(layers)


def shard(module: nn.Module, mixed_precision: str = "none") -> nn.Module:
    """FSDP2: shard every decoder layer, then the root (which keeps embeddings and heads).

    A shared-backbone policy (PolicyWithValueHead) also gets its backbone and vocabulary
    head sharded as one unit of their own, between the layers and the root: sampling and
    scoring call them directly, not through the root's forward, and only a unit's own
    forward gathers its parameters (with the embeddings in the root's unit, sampling met
    them still sharded — "aten.embedding got mixed torch.Tensor and DTensor" — until
    2026-12-05)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    mp = MixedPrecisionPolicy(
        param_dtype=dtypes[mixed_precision],
        reduce_dtype=torch.float32 if dtypes[mixed_precision] else None,
    )
    for layer in decoder_layers(module):
        fully_shard(layer, mp_policy=mp)
    shared = isinstance(module, PolicyWithValueHead)
    if shared:
        # the backbone (embeddings, layers, final norm) and the vocabulary head as one
        # unit (a tied head shares the embeddings' parameter): sampling runs the language
        # model and scoring the backbone, neither through the root's forward
        fully_shard([module.lm.base_model, module.lm.get_output_embeddings()], mp_policy=mp)
    fully_shard(module, mp_policy=mp)
    if shared:
        # FSDP2 takes the first unit to run a forward as the root; sampling's direct call
        # of the language model would make it the root and the policy's own forward would
        # then fail (tests/test_distributed.py fails without this), so the policy is made
        # the root now; torch 2.13 has no public call for it
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            raise RuntimeError(
                "dist.strategy=fsdp with model.value_model=shared: this torch's FSDP2 has no "
                "_get_fsdp_state(); use dist.strategy=ddp or a separate critic"
            )
        state()._lazy_init()
    return module


def wrap_trained(
    module: nn.Module, ctx: DistContext, strategy: str, mixed_precision: str = "none"
) -> nn.Module:
    """The module that training calls: DDP-wrapped, FSDP-sharded in place, or itself."""
    if not ctx.enabled:
        return module
    if strategy == "fsdp":
        return shard(module, mixed_precision)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)


@contextlib.contextmanager
def accumulate(modules: list[nn.Module], sync: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a minibatch."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            if hasattr(m, "no_sync") and not sync:
                stack.enter_context(m.no_sync())
            elif hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(sync)
        yield


def full_state_dict(module: nn.Module, ctx: DistContext, strategy: str) -> dict | None:
    """Plain (unsharded, CPU) weights; every rank must call it under FSDP."""
    if ctx.enabled and strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return None


def load_full_state_dict(module: nn.Module, state: dict, ctx: DistContext) -> None:
    """Load full (unsharded) weights into a sharded ``module``: ``state`` on rank 0, ``{}``
    on the others; rank 0 sends each tensor in turn and every rank keeps its shard, so no
    other rank ever holds the whole model. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not ctx.is_main and state:
        raise ValueError("load_full_state_dict: only rank 0 passes weights; the others {}")
    # strict=False only because tied embeddings are saved once (lm_head.weight is absent);
    # the keys are checked here instead
    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=True)
    result = set_model_state_dict(module, state, options=options)
    missing = [k for k in getattr(result, "missing_keys", []) if not k.endswith("lm_head.weight")]
    if missing or getattr(result, "unexpected_keys", []):
        raise RuntimeError(
            f"checkpoint does not match the model: missing {missing[:3]}, "
            f"unexpected {list(getattr(result, 'unexpected_keys', []))[:3]}"
        )


def optimizer_state(module, opt, ctx: DistContext, strategy: str) -> dict:
    if ctx.enabled and strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return opt.state_dict()


def load_optimizer_state(module, opt, state: dict, ctx: DistContext, strategy: str) -> None:
    if ctx.enabled and strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        # rank 0 holds the full state and sends it tensor by tensor; the others pass {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(module, opt, state, options=options)
    else:
        opt.load_state_dict(state)
