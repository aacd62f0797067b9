"""AdamW and the learning-rate schedule, without the import cost of ``torch.optim``'s classes.

Constructing any ``torch.optim.Optimizer`` imports torch's compiler stack (its methods are
wrapped by ``torch._disable_dynamo``, which imports ``torch._dynamo`` on first call, and
with it sympy and ``torch.distributed.tensor``): ~70 MiB of resident memory in a process
that never compiles anything (measured in docs/benchmarks.md). That is more than a 4M
model's weights, gradients and AdamW state together.

:class:`FusedAdamW` runs the very kernel ``torch.optim.AdamW(fused=True)`` runs
(``torch._fused_adamw_``, one pass per device and dtype over every weight and both
moments), so its updates are bit-identical to torch's (tests/test_optim.py); its state
dicts have torch's layout, so checkpoints load in either. It covers what rlhflab's trainers
use — plain (not sharded) floating tensors on CPU or CUDA, no AMSGrad, no gradient scaler;
anything else (FSDP2's DTensors) gets ``torch.optim.AdamW``. :class:`LambdaSchedule` is
``torch.optim.lr_scheduler.LambdaLR``'s rule (lr = base lr × factor(step)) for either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from rlhflab.backends import weight_cast


class FusedAdamW:
    """AdamW with decoupled weight decay over parameter groups (dicts with ``params`` and
    optional ``lr``, ``betas``, ``eps``, ``weight_decay``), like ``torch.optim.AdamW``."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        # the option names torch's AdamW keeps in each group, so state dicts match
        self.defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=True,
            decoupled_weight_decay=True,
        )
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict] = {}
        self._groups_by_param: dict[int, dict] | None = None
        seen = set()
        for g in self.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("FusedAdamW: amsgrad and maximize are not supported")
            for p in g["params"]:
                if not (p.is_floating_point() and p.device.type in ("cpu", "cuda")):
                    raise ValueError(
                        f"FusedAdamW: a {p.dtype} parameter on {p.device} is not a floating "
                        "CPU/CUDA tensor; use torch.optim.AdamW"
                    )
                if id(p) in seen:
                    raise ValueError("FusedAdamW: a parameter appears in two groups")
                seen.add(id(p))

    def _state_of(self, p: torch.Tensor) -> dict:
        st = self.state.get(p)
        if st is None:  # torch's initial state for the fused path: float32 step on p's device
            st = self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return st

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for g in self.param_groups:
            buckets: dict[tuple, tuple[list, ...]] = {}
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedAdamW: sparse gradients are not supported")
                st = self._state_of(p)
                lists = buckets.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for lst, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                    lst.append(t)
            for params, grads, avgs, sqs, steps in buckets.values():
                torch._foreach_add_(steps, 1)
                _fused_update(g, params, grads, avgs, sqs, steps)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
        """Update the single parameter ``p`` from its gradient, with its group's settings —
        the same kernel and arithmetic as :meth:`step` (which treats each tensor on its
        own), so stepping every parameter this way gives bit-identical weights. With
        ``found_inf`` (a 0-dim float tensor, 1.0 = skip) the kernel leaves the weight, its
        moments and its step count as they were, without a host sync."""
        group = self._group_of().get(id(p))
        if group is None:
            raise ValueError("FusedAdamW.step_param: the tensor is not one of its parameters")
        st = self._state_of(p)
        st["step"].add_(1)
        _fused_update(
            group, [p], [p.grad], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]], found_inf
        )
        if found_inf is not None:
            st["step"].sub_(found_inf)

    @torch.no_grad()
    def step_params(self, params: list[torch.Tensor]) -> None:
        """:meth:`step_param` for several parameters of this optimiser at once, every
        gradient finite: one kernel call per group instead of one per tensor, the same
        arithmetic (the fused kernel treats each tensor on its own)."""
        groups = self._group_of()
        buckets: dict[tuple, tuple[dict, list]] = {}  # as step(): per group, device, dtype
        for p in params:
            group = groups.get(id(p))
            if group is None:
                raise ValueError("FusedAdamW.step_params: a tensor is not one of its parameters")
            buckets.setdefault((id(group), p.device, p.dtype), (group, []))[1].append(p)
        for group, ps in buckets.values():
            states = [self._state_of(p) for p in ps]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1)
            avgs, sqs = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
            _fused_update(group, ps, [p.grad for p in ps], avgs, sqs, steps)

    def _group_of(self) -> dict[int, dict]:
        if self._groups_by_param is None:
            self._groups_by_param = {id(q): g for g in self.param_groups for q in g["params"]}
        return self._groups_by_param

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def state_dict(self) -> dict:
        """torch's layout: parameters numbered in group order; per-parameter state by number."""
        index, groups, n = {}, [], 0
        for g in self.param_groups:
            ids = list(range(n, n + len(g["params"])))
            index.update({id(p): i for p, i in zip(g["params"], ids)})
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
            n += len(ids)
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        """A state dict from this class or from ``torch.optim.AdamW``.

        Moments already on their parameter's device and dtype are taken as they are, not
        copied (as ``torch.optim`` does): resuming then holds them once, where a copy held
        them twice until the loaded dict was dropped (+2 × the weights of every trained
        model at the peak). Pass a copy of a dict that stays in use elsewhere."""
        saved = sd["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)
        ):
            raise ValueError("optimizer state: parameter groups do not match this model's")
        self.state = {}
        for s, g in zip(saved, self.param_groups):
            g.update({k: v for k, v in s.items() if k != "params"})
            g["betas"] = tuple(g["betas"])
            for i, p in zip(s["params"], g["params"]):
                st = sd["state"].get(i, sd["state"].get(str(i)))
                if st is None:
                    continue
                self.state[p] = {
                    "step": torch.as_tensor(st["step"], dtype=torch.float32).to(p.device).clone(),
                    "exp_avg": st["exp_avg"].to(p.device, p.dtype),
                    "exp_avg_sq": st["exp_avg_sq"].to(p.device, p.dtype),
                }


def _fused_update(group: dict, params, grads, avgs, sqs, steps, found_inf=None) -> None:
    """torch's fused AdamW kernel over same-device, same-dtype lists, with ``group``'s
    settings; ``steps`` already counts this update."""
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        params,
        grads,
        avgs,
        sqs,
        [],
        steps,
        amsgrad=False,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
        grad_scale=None,
        found_inf=found_inf,
    )
    # the fused kernel writes the weights without bumping their version counters, by which
    # a kept 16-bit copy (model.cast_cache) knows it is stale: drop the copies here
    weight_cast.forget(params)


def clip_grad_norms(models: dict[str, list[torch.Tensor]], max_norm: float | None) -> dict:
    """Clip the gradients of each model on its own to ``max_norm`` (None: no clip) and
    return each one's norm before the clip, as a float, by the same names.

    One norm per model, as veRL and OpenRLHF clip actor and critic apart: a joint norm over
    a policy and a separate critic lets a large critic gradient shrink the policy's step.
    A model whose value head shares its backbone is one model with one norm. FSDP2's
    sharded gradients give a DTensor norm, gathered here into the global one."""
    limit = max_norm if max_norm is not None else math.inf
    norms = {}
    for name, params in models.items():
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norms[name] = float(norm)
    return norms


class UpdateInBackward:
    """While active, each parameter of the given :class:`FusedAdamW` optimisers is updated
    as soon as its gradient is complete in the backward pass, and the gradient is dropped
    at once: the trained models' gradients (of tensors of :attr:`DEFER_BELOW` elements or
    more) are never all alive together (the pattern of
    PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward
    pass"). Same updates bit for bit as backward-then-``step()``, provided each parameter
    gets its whole gradient from one backward (no accumulation over micro-batches) and
    nothing needs every gradient before the update (no global-norm clipping).

    A parameter whose gradient is not finite is left as it was (its moments and step
    count too); :attr:`found_inf` (0-dim bool tensor) says whether that happened since
    :meth:`reset`, read once per update rather than once per tensor.

    Parameters under :attr:`DEFER_BELOW` elements (norms, biases; every tensor of a very
    small model) are not updated in their hook but by :meth:`flush`, together, one kernel
    call per group: each hook's norm, finite check and kernel call cost ~50 µs of work
    that is pure overhead on a small tensor (0.2M model of benchmarks/vs_trl.py, whose
    tensors are all small: 0.256 → 0.226 s per iteration, median of an in-process A/B,
    2026-12-06; docs/benchmarks.md), and their
    gradients are too small to matter for the peak (a LoRA model's adapters are all
    small: SmolLM2-135M's r=8 adapters hold ~9 MB of gradients until the flush). Call
    :meth:`flush` after the backward passes of an update, before reading
    :attr:`found_inf` or the norms; a parameter deferred twice before it (two backward
    passes into one gradient, which the hooks would have stepped twice) is refused, and
    :meth:`reset` or leaving the context drops deferred gradients that were never flushed
    (an interrupted update), as the trainer drops an interrupted micro-batch's. :meth:`grad_norms`
    gives each optimiser's gradient norm over the same span (nothing is clipped: a clip
    needs all of a model's gradients before it updates any of them).
    """

    DEFER_BELOW = 1 << 16  # elements: 256 KiB of fp32 gradient

    def __init__(self, optimizers: Iterable[FusedAdamW]):
        self.optimizers = [o for o in optimizers if o is not None]
        self.handles: list = []
        self.found_inf: torch.Tensor | None = None
        self.norms: dict[int, torch.Tensor] = {}  # id(parameter) → its gradient's norm
        self.deferred: list[tuple[FusedAdamW, torch.Tensor]] = []  # small ones, for flush()
        self.deferred_ids: set[int] = set()

    def __enter__(self) -> UpdateInBackward:
        for opt in self.optimizers:
            if not isinstance(opt, FusedAdamW):
                raise TypeError(
                    f"UpdateInBackward needs rlhflab's FusedAdamW, not {type(opt).__name__}"
                )
            for g in opt.param_groups:
                for p in g["params"]:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._hook(opt)))
        self.reset()
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._drop_deferred()

    def reset(self) -> None:
        self.found_inf = None
        self.norms = {}
        self._drop_deferred()

    def _drop_deferred(self) -> None:
        for _, p in self.deferred:
            p.grad = None
        self.deferred, self.deferred_ids = [], set()

    def flush(self) -> None:
        """Update the deferred small parameters: one kernel call per optimiser group when
        every one of their gradients is finite (one host sync to know), else each on its
        own with its own finite check, as its hook would have."""
        if not self.deferred:
            return
        deferred, self.deferred, self.deferred_ids = self.deferred, [], set()
        norms = [torch.linalg.vector_norm(p.grad) for _, p in deferred]
        bad = ~torch.isfinite(torch.stack(norms))
        if bool(bad.any()):
            for (opt, p), norm in zip(deferred, norms):
                self._step_one(opt, p, norm)
            return
        by_opt: dict[int, tuple[FusedAdamW, list]] = {}
        for opt, p in deferred:
            by_opt.setdefault(id(opt), (opt, []))[1].append(p)
        for opt, params in by_opt.values():
            opt.step_params(params)
        for (_, p), norm in zip(deferred, norms):
            self.norms[id(p)] = norm
            p.grad = None
        found = bad.any()
        self.found_inf = found if self.found_inf is None else self.found_inf | found

    def _step_one(self, opt: FusedAdamW, p: torch.Tensor, norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(norm)
        opt.step_param(p, found_inf=bad.float())
        self.found_inf = bad if self.found_inf is None else self.found_inf | bad
        self.norms[id(p)] = norm
        p.grad = None

    def grad_norms(self) -> list[float]:
        """Per optimiser (in the order given), the 2-norm of all its gradients since
        :meth:`reset`, combined in parameter order as ``clip_grad_norm_`` combines them."""
        out = []
        for opt in self.optimizers:
            norms = [self.norms.get(id(p)) for g in opt.param_groups for p in g["params"]]
            norms = [n for n in norms if n is not None]
            out.append(float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0)
        return out

    def _hook(self, opt: FusedAdamW):
        def update(p: torch.Tensor) -> None:
            if p.numel() < self.DEFER_BELOW:
                if id(p) in self.deferred_ids:
                    raise RuntimeError(
                        "UpdateInBackward: a parameter's gradient was accumulated over two "
                        "backward passes before flush(); step_in_backward needs one"
                    )
                self.deferred.append((opt, p))
                self.deferred_ids.add(id(p))
                return
            # one read of the gradient: its norm is non-finite when any element is (or, for
            # finite elements, when it overflows, itself a gradient to hold back) and is
            # kept for the logged gradient norm; isfinite over the tensor took five passes
            # and three temporaries (~2 % of a 25M PPO step)
            self._step_one(opt, p, torch.linalg.vector_norm(p.grad))

        return update


class LambdaSchedule:
    """lr of group i = base_lr_i × factor(step), ``step()`` once per optimiser step — the
    rule of ``torch.optim.lr_scheduler.LambdaLR`` (whose state dicts it also reads)."""

    def __init__(self, optimizer, factor: Callable[[int], float]):
        self.optimizer, self.factor = optimizer, factor
        self.base_lrs = [g.setdefault("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        self._last_lr = [base * self.factor(self.last_epoch) for base in self.base_lrs]
        for g, lr in zip(self.optimizer.param_groups, self._last_lr):
            g["lr"] = lr

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch}

    def load_state_dict(self, sd: dict) -> None:
        # the step count only: the base lrs stay this run's config's, which a resume may
        # change (a lower lr after a spike); the saved ones trained on at the old lr
        self.last_epoch = int(sd["last_epoch"])
        self._apply()
