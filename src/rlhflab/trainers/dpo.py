"""DPO: the policy against the frozen reference on preference pairs (``rlhflab dpo``).

No reward model and no sampling: the loss of :func:`rlhflab.core.losses.dpo_loss` on the
summed log-probs of each answer. The reference's log-probs never change, so they are
computed once, before training, and cached. Logged per step: the loss, the implicit rewards
β·(log π − log π_ref) of chosen and rejected answers, their margin and the reward accuracy
(share of pairs whose chosen answer has the larger implicit reward, a tie counting half).
Checkpoints, resume and
the run log are :class:`rlhflab.trainers.loop.RunLoop`'s, as for PPO.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from rlhflab import models as M
from rlhflab.backends.loss_scale import LossScaler
from rlhflab.config import Config
from rlhflab.config.base import to_dict
from rlhflab.config.stages import STAGE_DEFAULTS
from rlhflab.core import algorithms as A
from rlhflab.core import losses as L
from rlhflab.experience.cast import reference_low_dtype
from rlhflab.experience.data import check_pairs_fit, load_preferences
from rlhflab.infra import checkpoint as C
from rlhflab.infra.distributed import resolve_device
from rlhflab.models.build import finish_models, load_model, load_tokenizer_for, to_trained
from rlhflab.trainers.common import (
    Halt,
    build_optimizer_simple,
    build_scheduler,
    load_single_model_state,
    refuse_before_models,
    single_model_state,
    supervised_step,
)
from rlhflab.trainers.loop import RunLoop
from rlhflab.trainers.rm import builtin_pairs
from rlhflab.trainers.sft import encode_pairs

log = logging.getLogger(__name__)

# DPO's defaults live in the config tree (config.stages.STAGE_DEFAULTS, applied by
# load_config for stage dpo); this name stays for callers that build a config by hand.
DPO_BASE = STAGE_DEFAULTS["dpo"]


def answer_logprobs(
    model, tokenizer, prompts, answers, device, micro_batch=64, autocast=contextlib.nullcontext
):
    """Σ log π(answer + EOS | prompt) per pair: (N,), in fp32; the forwards run in the
    context ``autocast()`` returns (model.compute_dtype's)."""
    out = []
    for s in range(0, len(prompts), micro_batch):
        pairs = list(zip(prompts[s : s + micro_batch], answers[s : s + micro_batch]))
        ids, attn, loss_mask = (t.to(device) for t in encode_pairs(tokenizer, pairs))
        with autocast():
            logits = M.causal_forward(model, ids, attn).logits[:, :-1]
        logp = A.logprobs_from_logits(logits, ids[:, 1:])
        out.append(torch.where(loss_mask[:, 1:].bool(), logp, 0.0).sum(1))
    return torch.cat(out)


class DPOTrainer:
    def __init__(self, cfg: Config):
        self.cfg, d = cfg, cfg.dpo
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        mc = cfg.model
        self.tokenizer = load_tokenizer_for(mc.policy, mc)  # renders chat rows
        # the data is read before the model is loaded: a bad row is reported in seconds
        limit = M.position_limit(mc.policy, "model.policy")
        if d.data:
            pairs = load_preferences(
                d.data, self.tokenizer, cfg.data.split, limit, cfg.data.on_bad_row
            )
        else:
            pairs = builtin_pairs(_with_pairs(cfg, d.pairs))
            check_pairs_fit(self.tokenizer, limit, pairs, "the built-in task's pair")
        refuse_before_models(cfg, Path(cfg.log.output_dir), "log.output_dir")
        lm = load_model(mc.policy, self.tokenizer, mc)
        if mc.lora_r:
            lm = M.apply_lora(lm, mc.lora_r, mc.lora_alpha, mc.lora_targets, seed=cfg.seed)
        self.reference = M.make_reference(
            lm, mc.reference_precision, mc.offload_frozen, self.device, reference_low_dtype(cfg)
        )
        finish_models(mc, self.device, trained=(lm,), frozen=(self.reference,))
        self.policy = to_trained(lm, self.device, "the DPO policy")
        self.prompts = [p.prompt for p in pairs]
        self.chosen = [p.chosen for p in pairs]
        self.rejected = [p.rejected for p in pairs]
        # the policy computes in model.compute_dtype; an fp32 reference computes alike, so
        # that the implicit rewards of the unchanged policy are 0
        self.autocast = functools.partial(M.compute_autocast, self.device, mc.compute_dtype)
        ref_dtype = M.frozen_compute_dtype(mc.compute_dtype, mc.reference_precision)
        self.ref_autocast = functools.partial(M.compute_autocast, self.device, ref_dtype)
        with torch.no_grad():  # the reference never changes: its log-probs are computed once
            self.ref_chosen = self._answer_logprobs(self.reference, self.prompts, self.chosen)
            self.ref_rejected = self._answer_logprobs(self.reference, self.prompts, self.rejected)
        params = [q for q in self.policy.parameters() if q.requires_grad]
        self.opt = build_optimizer_simple(params, d.lr)
        self.sched = build_scheduler(self.opt, d.warmup_steps, d.steps, "constant", "dpo")
        self.scaler = LossScaler.for_model(mc)  # model.compute_dtype=fp16's loss scale
        self.gens = {"batch": torch.Generator().manual_seed(cfg.seed)}
        self.iteration = 0
        self.stop_reason: str | None = None  # DPO runs its steps to the end
        self.step_hooks: list = []  # hook(step, metrics) after it is logged (RunLoop)
        self.halt = Halt("DPO", "dpo.lr", self._keep_last_good)
        self.run_dir = Path(cfg.log.output_dir)
        # the checkpoint code saves a "cast": the policy and no critic
        self._cast = SimpleNamespace(
            policy=self.policy, policy_lm=self.policy, critic=None, tokenizer=self.tokenizer
        )

    def step(self) -> dict[str, float]:
        d = self.cfg.dpo
        idx = torch.randint(len(self.prompts), (d.batch_size,), generator=self.gens["batch"])
        size = d.micro_batch_size if d.micro_batch_size else d.batch_size
        rewards: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rc, rr) of each part
        used = self.opt.param_groups[0]["lr"]  # this step's (the schedule moves in the step)
        value = supervised_step(
            self.policy,
            self.opt,
            self.sched,
            self._loss_parts(idx, size, rewards),
            self.iteration + 1,
            self.halt,
            scaler=self.scaler,
        )
        rc, rr = (torch.cat(x) for x in zip(*rewards))
        return {
            "loss": value,
            "rewards/chosen": rc.mean().item(),
            "rewards/rejected": rr.mean().item(),
            "rewards/margin": (rc - rr).mean().item(),
            # a tie counts half: at the first step, the policy still the reference, every
            # margin is 0 and the accuracy 0.5, not 0 (TRL counts ties as wrong)
            "rewards/accuracy": ((rc > rr).float() + 0.5 * (rc == rr).float()).mean().item(),
            "lr/policy": used,
        }

    def _loss_parts(self, idx: torch.Tensor, size: int, rewards: list):
        """The batch's DPO loss in parts of ``size`` pairs (dpo.micro_batch_size; the whole
        batch by default, as its mean): each part's share of the batch mean, its forwards
        run when asked for, after the part before was backpropagated. Each part's implicit
        rewards are appended to ``rewards`` for the step's metrics."""
        d = self.cfg.dpo
        for start in range(0, len(idx), size):
            part = idx[start : start + size]
            pick = part.tolist()
            prompts = [self.prompts[i] for i in pick]
            pc = self._answer_logprobs(self.policy, prompts, [self.chosen[i] for i in pick])
            pr = self._answer_logprobs(self.policy, prompts, [self.rejected[i] for i in pick])
            losses, rc, rr = L.dpo_loss(
                pc,
                pr,
                self.ref_chosen[part],
                self.ref_rejected[part],
                d.beta,
                d.loss_type,
                d.label_smoothing,
            )
            rewards.append((rc.detach(), rr.detach()))
            yield losses.mean() if size == len(idx) else losses.sum() / len(idx)

    def _answer_logprobs(self, model, prompts, answers) -> torch.Tensor:
        """answer_logprobs of the policy or the reference, each in its compute dtype."""
        autocast = self.ref_autocast if model is self.reference else self.autocast
        return answer_logprobs(
            model, self.tokenizer, prompts, answers, self.device, autocast=autocast
        )

    def state_dict(self) -> dict:
        return single_model_state(self)

    def load_state_dict(self, s: dict) -> None:
        load_single_model_state(self, s)

    def save(self, step: int) -> Path:
        return C.save_checkpoint(
            self.run_dir, step, self._cast, self.state_dict(), self.cfg.log.keep_last
        )

    def _keep_last_good(self) -> str:
        """At a halt the weights and optimiser are still the last good ones (the bad update
        was refused before any weight changed): checkpoint them."""
        return f"The last good state is checkpoint {self.save(self.iteration)}."

    def load_checkpoint(self, path: Path) -> None:
        self.load_state_dict(C.load_checkpoint(path, self._cast))

    def fit(self, resume: bool = False) -> dict:
        loop = RunLoop(
            self.run_dir,
            self.cfg.dpo.steps,
            self.cfg.log,
            to_dict(self.cfg),
            "DPO",
            postfix=lambda m: {
                "acc": f"{m['rewards/accuracy']:.2f}",
                "margin": f"{m['rewards/margin']:.3f}",
            },
        )
        done = loop.run(self, resume)
        return {
            "steps": done.steps,
            "last": done.last,
            "pairs": len(self.prompts),
            "seconds": done.seconds,
        }


def _with_pairs(cfg: Config, n: int) -> Config:
    import copy

    out = copy.deepcopy(cfg)
    out.rm.pairs = n
    return out


def train(cfg: Config, resume: bool = False) -> dict:
    return DPOTrainer(cfg).fit(resume)
