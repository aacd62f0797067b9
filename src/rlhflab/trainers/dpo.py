"""DPO: the policy against the frozen reference on preference pairs (``rlhflab dpo``).

No reward model and no sampling: the loss of :func:`rlhflab.core.losses.dpo_loss` on the
summed log-probs of each answer. The reference's log-probs never change, so they are
computed once, before training, and cached. Logged per step: the loss, the implicit rewards
β·(log π − log π_ref) of chosen and rejected answers, their margin and the reward accuracy
(share of pairs whose chosen answer has the larger implicit reward). Checkpoints and resume
use the PPO trainer's machinery.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from rlhflab import models as M
from rlhflab.backends.cpu_blas import apply_cpu_matmul
from rlhflab.backends.lean import make_activations_lean
from rlhflab.config import Config
from rlhflab.config.base import to_dict
from rlhflab.core import algorithms as A
from rlhflab.core import losses as L
from rlhflab.experience.data import load_preferences
from rlhflab.infra import checkpoint as C
from rlhflab.infra.distributed import resolve_device
from rlhflab.infra.runlog import RunLog
from rlhflab.trainers.common import (
    Halt,
    build_optimizer_simple,
    build_scheduler,
    progress,
    supervised_step,
)
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
            path, self.tokenizer, cfg.model.trust_remote_code, torch.float32, cfg.model.runtime
        )
        if cfg.model.lean_activations:
            make_activations_lean(lm)
        if cfg.model.lora_r:
            lm = M.apply_lora(lm, cfg.model.lora_r, cfg.model.lora_alpha, cfg.model.lora_targets)
        self.policy = M.require_fp32_trainable(lm.to(self.device).train(), "the DPO policy")
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
        self.run_dir = Path(cfg.log.output_dir)
        self.halt = Halt("DPO", "dpo.lr", self._last_checkpoint)
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
        value = supervised_step(
            self.policy, self.opt, self.sched, loss, self.iteration + 1, self.halt
        )
        return {
            "loss": value,
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

    def _last_checkpoint(self) -> str:
        ckpts = C.list_checkpoints(self.run_dir)
        if not ckpts:
            return "No checkpoint was written yet (log.checkpoint_every)."
        return f"The last complete checkpoint is {ckpts[-1]}."

    def save(self, step: int) -> Path:
        return C.save_checkpoint(
            self.run_dir, step, self._cast, self.state_dict(), self.cfg.log.keep_last
        )

    def fit(self, resume: bool = False) -> dict:
        cfg, resume_step = self.cfg, None
        if resume and (last := C.latest_checkpoint(self.run_dir, set_aside=True)):
            self.load_state_dict(C.load_checkpoint(last, self._cast))
            resume_step = self.iteration
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        runlog = RunLog(self.run_dir, cfg.log.tensorboard, cfg.log.wandb, to_dict(cfg), resume_step)
        bar = progress(
            range(self.iteration, cfg.dpo.steps),
            cfg.log.progress,
            "DPO",
            initial=self.iteration,
            total=cfg.dpo.steps,
        )
        metrics, start = {}, time.perf_counter()
        try:
            for _ in bar:
                metrics = self.step()
                self.iteration += 1
                runlog.metrics(self.iteration, metrics)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(
                        acc=f"{metrics['rewards/accuracy']:.2f}",
                        margin=f"{metrics['rewards/margin']:.3f}",
                    )
                if (
                    self.iteration % cfg.log.checkpoint_every == 0
                    or self.iteration == cfg.dpo.steps
                ):
                    self.save(self.iteration)
        finally:
            runlog.close()
        return {
            "steps": self.iteration,
            "last": metrics,
            "pairs": len(self.prompts),
            "seconds": time.perf_counter() - start,
        }


def _with_pairs(cfg: Config, n: int) -> Config:
    import copy

    out = copy.deepcopy(cfg)
    out.rm.pairs = n
    return out


def train(cfg: Config, resume: bool = False) -> dict:
    return DPOTrainer(cfg).fit(resume)
