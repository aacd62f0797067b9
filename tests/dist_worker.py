"""Run under torchrun by tests/test_distributed.py (and directly for the 1-rank reference)."""

import json
import sys
from pathlib import Path

import torch

import rlhflab.trainers.ppo as ppo_module
import rlhflab.trainers.ppo_watch as ppo_watch
from rlhflab.config import load_config
from rlhflab.experience.rollout import Rollout, left_pad
from rlhflab.trainers.ppo import PPOTrainer

ANSWERS = [" cat dog sun", " red", " blue green apple pear"]


def fixed_rollout(model, tokenizer, prompts, max_new_tokens, *args, **kwargs):
    """The same answers for the same prompts, whatever the rank layout: sampling controlled."""
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    prompt_ids, prompt_mask = left_pad(encoded, tokenizer.pad_token_id)
    rows = [
        tokenizer(ANSWERS[sum(map(ord, p)) % 3], add_special_tokens=False)["input_ids"][
            : max_new_tokens - 1
        ]
        + [tokenizer.eos_token_id]
        for p in prompts
    ]
    width = max(len(r) for r in rows)
    resp = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    texts = tokenizer.batch_decode(resp, skip_special_tokens=True)
    return Rollout(
        prompt_ids,
        prompt_mask,
        resp,
        mask,
        torch.ones(len(rows), dtype=torch.bool),
        list(prompts),
        texts,
    )


def note_checkpoint_reads(out: str) -> list[str]:
    """From now on, append to the returned list each file or folder under ``out`` that
    this process reads weights or a torch.save'd state from (relative to ``out``)."""
    import rlhflab.infra.checkpoint as C

    reads, read_weights, load = [], C.read_weights, torch.load

    def noting_read_weights(folder, name=None):
        reads.append(str(Path(folder, name or "").relative_to(out)))
        return read_weights(folder, name)

    def noting_load(f, *args, **kwargs):
        if str(f).startswith(out):
            reads.append(str(Path(f).relative_to(out)))
        return load(f, *args, **kwargs)

    C.read_weights, torch.load = noting_read_weights, noting_load
    return reads


def config(out_dir, *over, stage="ppo"):
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "separate"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 6},
        "ppo": {"iterations": 1, "epochs": 1, "minibatches": 1, "lr": 1e-2, "critic_lr": 1e-2},
        "monitor": {"enabled": True},
        "log": {"output_dir": out_dir, "progress": False, "checkpoint_every": 1},
    }
    return load_config(base=base, overrides=list(over), stage=stage)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "equiv":  # one update on fixed rollouts; rank 0 saves the weights
        ppo_module.generate_rollout = fixed_rollout
        ppo_watch.generate_rollout = fixed_rollout  # the reference's answers too
        t = PPOTrainer(config(out + "-run", *sys.argv[3:]))
        t.fit()
        from rlhflab.infra.distributed import full_state_dict

        # sharded (fsdp): gathered into plain tensors, a collective of every rank
        policy = full_state_dict(t.cast.policy, t.ctx, t.cfg.dist.strategy)
        if t.ctx.is_main:
            critic = t.cast.critic.state_dict() if t.cast.critic is not None else {}
            policy = policy if policy is not None else t.cast.policy.state_dict()
            torch.save({"policy": policy, "critic": critic}, out)
    elif mode == "grpo":
        from rlhflab.trainers.grpo import GRPOTrainer

        cfg = config(
            out,
            "model.value_model=none",
            "ppo.kl_placement=loss",
            "ppo.kl_estimator=k3",
            "grpo.group_size=2",
            *sys.argv[3:],
            stage="grpo",
        )
        GRPOTrainer(cfg).fit()
    elif mode == "preset":  # each rank builds a preset into its own folder
        from rlhflab.infra.distributed import init_distributed
        from rlhflab.models.presets import build_preset

        ctx = init_distributed("cpu")
        build_preset("nano", f"{out}/rank-{ctx.rank}")
    elif mode == "late":  # the group outlives destroy_process_group, as under FSDP2
        import torch.distributed as dist

        from rlhflab.infra.distributed import init_distributed

        init_distributed("cpu")
        held = dist.group.WORLD  # FSDP2's device mesh holds it the same way
        queued = [torch.ones(1000) for _ in range(3000)]
        for t in queued:  # gloo's worker threads release these as the process ends
            dist.all_reduce(t, async_op=True)
        del queued, t
    elif mode == "gather":  # rank r holds [r, r + 10]; rank 0 saves the gathered tensor
        from rlhflab.infra.distributed import init_distributed

        ctx = init_distributed("cpu")
        gathered = ctx.all_gather_cat(torch.tensor([ctx.rank, ctx.rank + 10.0]))
        if ctx.is_main:
            torch.save(gathered, out)
    else:  # mode "run": real sampling, checkpoints; resumes when a checkpoint exists
        reads = note_checkpoint_reads(out) if mode == "run-reads" else None
        t = PPOTrainer(config(out, *sys.argv[3:]))
        t.fit(resume=True)
        if reads is not None:
            Path(out, f"reads-{t.ctx.rank}.json").write_text(json.dumps(reads))
    from rlhflab.infra.distributed import exit_without_teardown, shutdown_distributed

    # as the command line does: leave the group, then exit before the interpreter's teardown
    if shutdown_distributed():
        exit_without_teardown(0)
