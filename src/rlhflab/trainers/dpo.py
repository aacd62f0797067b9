"""DPO: the policy against the frozen reference on preference pairs (``rlhflab dpo``).

No reward model and no sampling: the loss of :func:`rlhflab.losses.dpo_loss` on the
summed log-probs of each answer. The reference's log-probs never change, so they are
computed once, before training, and cached. Logged per step: the loss, the implicit rewards
β·(log π − log π_ref) of chosen and rejected answers, their margin and the reward accuracy
(share of pairs whose chosen answer has the larger implicit reward). Checkpoints, resume and
the run log are :class:`rlhflab.trainers.loop.RunLoop`'s, as for PPO.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from rlhflab import algorithms as A
from rlhflab import checkpoint as C
from rlhflab import losses as L
from rlhflab import models as M
from rlhflab.config import Config
from rlhflab.configbase import to_dict
from rlhflab.cpu_blas import apply_cpu_matmul
from rlhflab.data import load_preferences
from rlhflab.distributed import resolve_device
from rlhflab.lean import make_activations_lean
from rlhflab.trainers.common import (
    TrainingHalted,
    build_optimizer_simple,
    build_scheduler,
)
from rlhflab.trainers.loop import RunLoop
from rlhflab.trainers.rm import builtin_pairs
from rlhflab.trainers.sft import encode_pairs

log = logging.getLogger(__name__)

DPO_BASE = {"model": {"value_model": "none"}, "log": {"output_dir": "runs/dpo"}}


def answer_logprobs(model, tokenizer, prompts, answers, device, micro_batch=64):
    """Σ log π(answer + EOS | prompt) per pair: (N,)."""
    out = []
    for s in range(0, len(prompts), micro_batch):
        pairs = list(zip(prompts[s : s + micro_batch], answers[s : s + micro_batch]))
        ids, attn, loss_mask = (t.to(device) for t in encode_pairs(tokenizer, pairs))
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
        # a data file is read before the model is loaded: a bad row is reported in seconds
        pairs = load_preferences(d.data) if d.data else None
        path = M.resolve_path(cfg.model.policy, "model.policy")
        self.tokenizer = M.load_tokenizer(
            path, cfg.model.trust_remote_code, runtime=cfg.model.runtime
        )
        lm = M.load_causal_lm(
            path, self.tokenizer, cfg.model.trust_remote_code, runtime=cfg.model.runtime
        )
        if cfg.model.lean_activations:
            make_activations_lean(lm)
        if cfg.model.lora_r:
            lm = M.apply_lora(lm, cfg.model.lora_r, cfg.model.lora_alpha, cfg.model.lora_targets)
        self.policy = lm.to(self.device).train()
        self.reference = M.make_reference(
            lm, cfg.model.reference_precision, cfg.model.offload_frozen, self.device
        )
        apply_cpu_matmul(cfg.model.cpu_matmul, self.device, (lm, self.reference))
        if pairs is None:
            pairs = builtin_pairs(_with_pairs(cfg, d.pairs))
        self.prompts = [p.prompt for p in pairs]
        self.chosen = [p.chosen for p in pairs]
        self.rejected = [p.rejected for p in pairs]
        with torch.no_grad():  # the reference never changes: its log-probs are computed once
            self.ref_chosen = answer_logprobs(
                self.reference, self.tokenizer, self.prompts, self.chosen, self.device
            )
            self.ref_rejected = answer_logprobs(
                self.reference, self.tokenizer, self.prompts, self.rejected, self.device
            )
        params = [q for q in self.policy.parameters() if q.requires_grad]
        self.opt = build_optimizer_simple(params, d.lr)
        self.sched = build_scheduler(self.opt, d.warmup_steps, d.steps, "constant")
        self.gens = {"batch": torch.Generator().manual_seed(cfg.seed)}
        self.iteration = 0
        self.stop_reason: str | None = None  # DPO runs its steps to the end
        self.run_dir = Path(cfg.log.output_dir)
        # the checkpoint code saves a "cast": the policy and no critic
        self._cast = SimpleNamespace(
            policy=self.policy, policy_lm=self.policy, critic=None, tokenizer=self.tokenizer
        )

    def step(self) -> dict[str, float]:
        d = self.cfg.dpo
        idx = torch.randint(len(self.prompts), (d.batch_size,), generator=self.gens["batch"])
        pick = idx.tolist()
        prompts = [self.prompts[i] for i in pick]
        pc = answer_logprobs(
            self.policy, self.tokenizer, prompts, [self.chosen[i] for i in pick], self.device
        )
        pr = answer_logprobs(
            self.policy, self.tokenizer, prompts, [self.rejected[i] for i in pick], self.device
        )
        losses, rc, rr = L.dpo_loss(
            pc,
            pr,
            self.ref_chosen[idx],
            self.ref_rejected[idx],
            d.beta,
            d.loss_type,
            d.label_smoothing,
        )
        loss = losses.mean()
        if not torch.isfinite(loss):
            raise TrainingHalted(f"DPO step {self.iteration + 1}: non-finite loss; lower dpo.lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return {
            "loss": loss.item(),
            "rewards/chosen": rc.mean().item(),
            "rewards/rejected": rr.mean().item(),
            "rewards/margin": (rc - rr).mean().item(),
            "rewards/accuracy": (rc > rr).float().mean().item(),
            "lr/policy": self.opt.param_groups[0]["lr"],
        }

    def state_dict(self) -> dict:
        return {
            "iteration": self.iteration,
            "optim": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "rng": C.rng_state(self.gens),
        }

    def load_state_dict(self, s: dict) -> None:
        self.iteration = int(s["iteration"])
        self.opt.load_state_dict(s["optim"])
        self.sched.load_state_dict(s["sched"])
        C.restore_rng(s["rng"], self.gens)

    def save(self, step: int) -> Path:
        return C.save_checkpoint(
            self.run_dir, step, self._cast, self.state_dict(), self.cfg.log.keep_last
        )

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
