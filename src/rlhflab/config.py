"""The one typed config tree of rlhflab, with every field's default and the reason for it.

Load it with :func:`load_config` (YAML file + dotted ``key=value`` overrides); print it with
``rlhflab config``. References in the docs: ``shared/docs/ppo-details.md`` section numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhflab import configbase
from rlhflab.configbase import ConfigError, section, setting

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
# KL estimators whose gradient pulls toward the reference when differentiated in the loss
LOSS_KL_ESTIMATORS = ("k2", "k3", "k3+")
# ppo.advantage_estimator's choices (the registry in rlhflab/advantages.py; a test keeps the
# two equal) and those that train no critic, their baseline being the prompt's group
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")
CRITIC_FREE_ESTIMATORS = ("grpo", "rloo")


@dataclass
class ModelConfig:
    policy: str = setting(
        "preset:tiny",
        "Policy to train: a local Hugging Face causal-LM folder, or 'preset:NAME' for a built-in "
        "Llama-style model (nano, tiny, small, medium) made without any download.",
    )
    trust_remote_code: bool = setting(
        False, "Allow model folders to run their own Python code. Off: it executes arbitrary code."
    )
    runtime: str = setting(
        "transformers",
        "Which code runs the models. 'transformers': Hugging Face's classes (any architecture "
        "they support). 'native': rlhflab's own Llama forward (rlhflab/native.py) over the "
        "same safetensors files, for model_type llama with default RoPE; with rlhflab's own "
        "AdamW a run never imports transformers' modelling code or torch's compiler stack "
        "(~93 MiB less resident memory, docs/benchmarks.md). Not with LoRA or "
        "trust_remote_code.",
        choices=("transformers", "native"),
    )
    value_model: str = setting(
        "auto",
        "Critic layout. 'shared': a value head on the policy's backbone (OAI19; least memory). "
        "'separate': its own backbone from `critic` (or a copy of the policy). 'from_reward': "
        "initialised from the reward model, head included (N+, InstructGPT). 'auto' = "
        "from_reward when a reward model is configured, else separate (ppo-details §6.4). "
        "'none': no critic (GRPO, RLOO and DPO set it).",
        choices=("auto", "shared", "separate", "from_reward", "none"),
    )
    critic: str | None = setting(
        None,
        "Causal-LM folder for a 'separate' critic; may be smaller than the policy but must "
        "share its tokenizer. Default: a copy of the policy.",
    )
    vf_coef: float = setting(
        0.1,
        "Weight of the value loss in the combined loss of a shared backbone (OAI19, N+: 0.1).",
        low=0.0,
    )
    reference_precision: str = setting(
        "fp32",
        "Precision of the frozen reference: fp32, bf16, fp16, or int8 (dynamic "
        "quantisation of Linear layers on CPU). Lower saves memory; the KL gets noisier.",
        choices=PRECISIONS,
    )
    reward_precision: str = setting(
        "fp32",
        "Precision of the frozen reward model (same choices as reference_precision).",
        choices=PRECISIONS,
    )
    offload_frozen: bool = setting(
        False,
        "Keep reference and reward model on the CPU; move each to the accelerator only for "
        "its forward pass. No effect on a CPU-only run.",
    )
    gradient_checkpointing: bool = setting(
        False,
        "Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them (policy and a separate critic): less memory for about one more forward of "
        "compute. TRL's GRPO/RLOO turn it on by default.",
    )
    lean_activations: bool = setting(
        True,
        "Llama-family RMSNorm and SwiGLU MLP blocks (Llama, Mistral, Qwen2/3, SmolLM3) of "
        "every trained model keep fewer activations for backward: the normalised input and "
        "SiLU(gate)*up are recomputed from what is kept (elementwise work, no matmul). Same "
        "outputs, same gradients up to rounding, about a third fewer saved bytes "
        "(rlhflab/lean.py). Other architectures are left as they are.",
    )
    cpu_matmul: str = setting(
        "torch",
        "Which library multiplies the Linear layers' float32/64 matrices on the CPU. 'torch': "
        "PyTorch's own (Intel MKL in its CPU wheels). 'numpy': the BLAS numpy carries "
        "(OpenBLAS in its wheels) for products of 64 rows or more, in forward and backward "
        "(rlhflab/cpu_blas.py): on the AMD EPYC machines we test on, OpenBLAS multiplies "
        "float32 6-12 % faster than MKL (benchmarks/cpu_matmul.py), and matmuls are most of "
        "a CPU run; on the Intel Xeon (AVX-512) machines it is 4-15 % slower. Same results "
        "to float rounding. Off by default: run the benchmark on your CPU before switching. "
        "CPU device only.",
        choices=("torch", "numpy"),
    )
    lora_r: int = setting(
        0,
        "LoRA rank for the policy (0 = full fine-tuning). With LoRA the reference is the base "
        "model with the adapter disabled: no second copy in memory.",
        low=0,
    )
    lora_alpha: float = setting(
        16.0, "LoRA scaling alpha (the update is scaled by alpha/r).", low=0.0, low_open=True
    )
    lora_targets: list[str] = setting(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "Module names LoRA adapts."
    )


@dataclass
class RewardConfig:
    model: str | None = setting(
        None,
        "Reward model: a Hugging Face sequence-classification folder (one output per head). "
        "Its score is read at the last real token.",
    )
    heads: dict[str, float] = setting(
        {},
        "Weight of each reward-model head by name (from the model's id2label), combined into "
        "the scalar the policy optimises. Empty: every head with weight 1.",
    )
    functions: dict[str, float] = setting(
        {},
        "Programmatic rewards 'module:function' → weight. The function takes (prompts, "
        "responses) and returns one float per answer, or a dict of named lists of floats.",
    )
    missing_eos_penalty: float | None = setting(
        None,
        "Subtracted from the score of an answer that hit max_new_tokens without EOS (TRL "
        "PPO's choice; OAI19 replaced the score with −1). None: off.",
        low=0.0,
    )
    normalize: str = setting(
        "none",
        "Score normalisation before shaping: 'batch' whitens scores over the rollout "
        "batch, 'running' divides by the std of every score so far, over all ranks (MOSS; "
        "left as they are until scores differ), 'none' (N+, TRL; ppo-details §4.6).",
        choices=("none", "batch", "running"),
    )
    clip: float | None = setting(
        None,
        "Clip normalised scores to ±clip (MOSS uses 5). None: no clipping.",
        low=0.0,
        low_open=True,
    )


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = setting(
        16,
        "Answers sampled per PPO iteration. Larger batches tame the noise of one score per "
        "answer (pain point three).",
        low=1,
    )
    max_prompt_tokens: int = setting(
        64, "Longest prompt in tokens; longer ones are a data error.", low=1
    )
    max_new_tokens: int = setting(32, "Answer length limit; answers cut here have no EOS.", low=1)
    ignore_eos: bool = setting(
        False,
        "Treat EOS as an ordinary token: every answer is max_new_tokens long and none 'ends' "
        "(so reward.missing_eos_penalty hits all). For benchmarks that need equal work.",
    )
    temperature: float = setting(
        1.0,
        "Sampling temperature; every log-prob in training uses the same one (N+ detail).",
        low=0.0,
        low_open=True,
    )
    top_k: int = setting(
        0,
        "Top-k sampling (0 = off). Off by default: a truncated sampler makes the training "
        "log-probs differ from the sampling distribution (OAI19, N+ use neither).",
        low=0,
    )
    top_p: float = setting(
        1.0, "Nucleus sampling (1.0 = off); same caveat as top_k.", low=0.0, high=1.0, low_open=True
    )
    score_micro_batch: int = setting(
        32, "Sequences per no-grad forward pass when scoring rollouts (memory vs speed).", low=1
    )
    logprobs_from_sampling: bool = setting(
        False,
        "Take the old log-probs and entropy (with a shared backbone, the values too) from "
        "the sampling pass, whose every step already has the logits of the token it draws, "
        "instead of a separate no-grad policy forward over prompt + answer: one policy "
        "forward fewer per iteration, as TRL's PPOTrainer does. Off by default because the "
        "KV-cached pass equals a full forward only to float rounding (~1e-6 in fp32; more in "
        "bf16 or with another sampling engine), so the first update's ratio is not exactly 1.",
    )


@dataclass
class PPOConfig:
    iterations: int = setting(20, "Rollout-then-train iterations.", low=1)
    epochs: int = setting(4, "Passes over each rollout batch (OAI19, N+, TRL: 4).", low=1)
    minibatches: int = setting(
        1,
        "Optimiser steps per epoch; must divide prompts_per_iteration. With 1 epoch and 1 "
        "minibatch the ratio is always 1 and clipping never binds.",
        low=1,
    )
    reuse_training_forward: bool = setting(
        True,
        "With 1 epoch of 1 minibatch, no value model and the KL in the loss (GRPO as "
        "usually run), the training forward is the first forward on the sampling weights: "
        "take the old log-probs and entropy from it (ratio exactly 1) instead of a separate "
        "no-grad policy forward while scoring, as TRL does. Ignored in every other case.",
    )
    values_from_training_forward: bool = setting(
        True,
        "With a separate critic and one minibatch of one micro-batch (the defaults), the "
        "critic's first training forward sees the weights and answers the old values are "
        "taken on: run it while scoring, take the old values from it and keep its graph "
        "for the first value loss, instead of a separate no-grad critic forward (one "
        "critic forward fewer per iteration, ~3.6 % of the work at 25M). Same values; the "
        "critic runs in training mode either way. Ignored in every other case.",
    )
    step_in_backward: bool = setting(
        False,
        "Update each weight with AdamW as soon as its gradient is complete in the backward "
        "pass and free that gradient, so a trained model's gradients are never all held "
        "at once (at 25M parameters: −200 MiB peak with a separate critic, "
        "docs/benchmarks.md). Same updates bit for bit. Needs max_grad_norm null (a clip "
        "needs all of a model's gradients first), one micro-batch per minibatch and a single "
        "process. The guard then holds back only tensors whose gradient is not finite (the "
        "rest are already updated, and their AdamW step counts advance while the "
        "learning-rate schedule does not, as for any skipped update), and a non-finite value "
        "loss skips only the critic's update (the policy's was applied in its backward).",
    )
    micro_batch_size: int | None = setting(
        None,
        "Gradient-accumulation chunk (sequences); None = the whole minibatch. Results do "
        "not depend on it: the loss is normalised by the minibatch's global token count.",
        low=1,
    )
    clip_low: float = setting(0.2, "PPO clip ε below 1 (all sources: 0.2).", low=0.0)
    clip_high: float | None = setting(
        None, "PPO clip above 1; None = clip_low. DAPO's clip-higher uses 0.28.", low=0.0
    )
    dual_clip: float | None = setting(
        None,
        "Dual-clip bound c for negative advantages (Ye et al. 2019; c = 3). Off: vanilla PPO.",
        low=1.0,
        low_open=True,
    )
    value_clip: float | None = setting(
        0.2,
        "Value-loss clip in reward units (OAI19, N+, TRL 0.2; verl 0.5). None: unclipped.",
        low=0.0,
    )
    advantage_estimator: str = setting(
        "gae",
        "Steps 5–7 of the loop (rlhflab/advantages.py). 'gae': per-token KL shaping, GAE "
        "from the critic's values, whitening (PPO). 'grpo': each answer's score against its "
        "prompt's group of grpo.group_size answers, (s − mean)/std (DeepSeekMath; centred only "
        "with grpo.normalize_std=false, Dr. GRPO). 'rloo': the leave-one-out mean of the group "
        "as baseline. grpo and rloo train no critic (model.value_model=none) and sample each "
        "prompt group_size times in a row; rlhflab grpo and rlhflab rloo set it to their name.",
        choices=ADVANTAGE_ESTIMATORS,
    )
    gamma: float = setting(
        1.0, "Discount; 1 because the episode is one answer (OAI19).", low=0.0, high=1.0
    )
    lam: float = setting(0.95, "GAE λ (OAI19, N+, TRL 0.95; verl 1.0).", low=0.0, high=1.0)
    whiten_advantages: bool = setting(True, "Whiten advantages over the rollout batch (OAI19).")
    whiten_rewards: bool = setting(
        False, "Scale-only whitening of shaped per-token rewards (OAI19 on; N+, TRL off)."
    )
    kl_coef: float = setting(
        0.05,
        "β of the KL penalty (N+, TRL: 0.05). The initial value when kl_target is set.",
        low=0.0,
    )
    kl_target: float | None = setting(
        None,
        "Adaptive KL control target in nats per answer (summed over its tokens; OAI19 "
        "used 6). None: β stays fixed.",
        low=0.0,
        low_open=True,
    )
    kl_horizon: float = setting(
        10000.0, "Adaptive controller horizon in answers (OAI19).", low=0.0, low_open=True
    )
    kl_estimator: str = setting(
        "k1",
        "KL estimator: k1 in the reward is the correct gradient; in the loss use k2 or k3+ "
        "(k3 is DSM's biased choice; k1 and abs are refused there: no KL gradient; "
        "ppo-details §3.4).",
        choices=("k1", "k2", "k3", "k3+", "abs"),
    )
    kl_placement: str = setting(
        "reward",
        "'reward': −β·KL per token flows through GAE (PPO-RLHF standard). 'loss': "
        "β·KL added to the policy loss, differentiated (GRPO style).",
        choices=("reward", "loss"),
    )
    entropy_coef: float = setting(
        0.0, "Entropy bonus; 0 in RLHF (OAI19, N+, verl). Logged anyway.", low=0.0
    )
    loss_agg: str = setting(
        "token-mean",
        "Loss aggregation (ppo-details §5.6).",
        choices=(
            "token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ),
    )
    loss_agg_norm: int | None = setting(
        None,
        "The constant that loss_agg=seq-mean-token-sum-norm divides each answer's token sum "
        "by (Dr. GRPO: the generation budget). None: rollout.max_new_tokens. The same on every "
        "rank and minibatch, never the batch's longest answer, so an answer's weight does not "
        "depend on which other answers share its batch.",
        low=1,
    )
    lr: float = setting(
        1e-5,
        "Policy learning rate (typical 1e-6..1e-5; tiny models need more).",
        low=0.0,
        low_open=True,
    )
    critic_lr: float = setting(
        3e-5, "Critic learning rate; 3–10× the policy's is common.", low=0.0, low_open=True
    )
    lr_schedule: str = setting(
        "constant",
        "After warm-up: constant, linear decay, or cosine.",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps: int = setting(0, "Linear learning-rate warm-up, in optimiser steps.", low=0)
    max_grad_norm: float | None = setting(
        1.0,
        "Gradient-norm clip, applied to each trained model on its own: the policy (with a "
        "shared backbone, its value head too) and a separate critic, as verl and OpenRLHF "
        "(1.0) do, so a large critic gradient never shrinks the policy's step. Both norms "
        "are logged (policy/grad_norm, val/grad_norm). None: no clip.",
        low=0.0,
        low_open=True,
    )
    adam_eps: float = setting(1e-5, "Adam ε (OAI19, N+, CleanRL use 1e-5).", low=0.0, low_open=True)
    weight_decay: float = setting(0.0, "AdamW weight decay.", low=0.0)
    max_bad_updates: int = setting(
        3,
        "Consecutive skipped updates (NaN/inf reward, loss or gradient) before the run stops "
        "with a checkpoint of the last good state.",
        low=1,
    )


@dataclass
class DataConfig:
    prompts: str | None = setting(
        None,
        "Prompt file: .jsonl, .parquet or .csv with a `prompt` string or chat `messages` "
        "per row. None: the built-in task's prompts.",
    )
    prompt_field: str = setting("prompt", "Column holding the prompt text.")
    messages_field: str = setting(
        "messages", "Column holding chat messages (rendered with the tokenizer's chat template)."
    )
    on_bad_row: str = setting(
        "error",
        "A malformed, empty or too-long row: 'error' stops with file, line and field; "
        "'skip' drops it and counts it in the log.",
        choices=("error", "skip"),
    )
    task: str = setting("mixed", "Built-in task family used when `prompts` is None.")


@dataclass
class LogConfig:
    output_dir: str = setting(
        "runs/ppo", "Run directory: config, metrics.jsonl, samples.jsonl, checkpoints/."
    )
    tensorboard: bool = setting(False, "Also write TensorBoard events (needs tensorboard).")
    wandb: bool = setting(False, "Also log to Weights & Biases (needs wandb installed).")
    sample_every: int = setting(5, "Write sample generations every N iterations.", low=1)
    samples_per_log: int = setting(4, "How many samples each time.", low=0)
    checkpoint_every: int = setting(10, "Checkpoint every N iterations (and at the end).", low=1)
    keep_last: int = setting(2, "Checkpoints kept; older ones are deleted.", low=1)
    progress: bool = setting(True, "Show a progress bar.")


@dataclass
class MonitorConfig:
    enabled: bool = setting(True, "Compute the reward-hacking signals every iteration.")
    response: str = setting(
        "warn",
        "What an alert does: 'warn' logs it; 'raise_kl' multiplies β by kl_factor; 'stop' "
        "checkpoints and stops with a message naming the signal and what to try.",
        choices=("warn", "raise_kl", "stop"),
    )
    kl_factor: float = setting(1.5, "β multiplier for response 'raise_kl'.", low=1.0)
    gold: str | None = setting(
        None,
        "A gold reward 'module:function' (same contract as reward.functions) to measure "
        "the proxy against. The built-in task's is rlhflab.tasks:gold_reward.",
    )
    reference_every: int = setting(
        1,
        "Sample the reference's answers to the batch's prompts every N iterations for the "
        "length-drift signal (one extra generation); 0 = off.",
        low=0,
    )
    phrases: list[str] = setting(
        [
            "Great question",
            "I'm happy to help",
            "What a wonderful",
            "这是一个很好的问题",
            "我很乐意帮助你",
        ],
        "Flattery phrases counted by the flattery_rate signal.",
    )
    ngram: int = setting(3, "n of the repeated-n-gram and distinct-n signals (tokens).", low=1)
    warmup_iterations: int = setting(
        1, "No alert in the first N iterations (the first rollout is the reference's own).", low=0
    )
    smoothing: float = setting(
        0.8,
        "EMA factor for the gold/proxy trend (batch means of 64 answers move ±0.1).",
        low=0.0,
        high=0.99,
    )
    length_ratio: float | None = setting(1.5, "Alert above this length ratio to the reference.")
    flattery_rate: float | None = setting(0.5, "Alert above this share of flattering answers.")
    flattery_excess: float | None = setting(
        0.15,
        "Alert when the share of flattering answers exceeds the reference's on the same "
        "prompts by this much (needs reference_every; fires earlier than flattery_rate).",
    )
    flattery_opener_ratio: float | None = setting(
        1.3,
        "Alert when the policy is this many times likelier than the reference to open an "
        "answer with a listed phrase (forced decoding on the batch's prompts: one no-grad "
        "pass of policy and reference, the prompts' KV cache shared by the phrases; None = "
        "not computed).",
        low=0.0,
        low_open=True,
    )
    opener_tokens: int = setting(
        4,
        "flattery_opener_ratio scores each phrase on its first N tokens (the opening decision "
        "is made there; the probe's cost grows with N).",
        low=1,
    )
    repeated_ngram_rate: float | None = setting(0.3, "Alert above this repeated n-gram share.")
    reward_length_corr: float | None = setting(0.8, "Alert above this score–length correlation.")
    gold_drop: float | None = setting(
        0.2,
        "Alert when the smoothed gold reward is this far below its best while the proxy "
        "rises (gold-reward units).",
    )
    kl_limit: float | None = setting(
        None, "Alert above this KL (nats per answer). None: 2 × ppo.kl_target when set, else off."
    )
    entropy_ratio: float | None = setting(0.2, "Alert below this share of the initial entropy.")


@dataclass
class DistConfig:
    strategy: str = setting(
        "ddp",
        "Under torchrun: 'ddp' replicates the trained models and all-reduces gradients; "
        "'fsdp' shards them with FSDP2 (fully_shard), per decoder layer.",
        choices=("ddp", "fsdp"),
    )
    shard_reference: bool = setting(
        False,
        "With fsdp: shard the frozen reference too (else replicated on every rank). The "
        "reward model is always replicated.",
    )
    mixed_precision: str = setting(
        "none",
        "With fsdp: parameter dtype in forward/backward ('bf16', 'fp16'); gradients are "
        "reduced in fp32. 'none': the stored dtype.",
        choices=("none", "bf16", "fp16"),
    )


@dataclass
class GRPOConfig:
    group_size: int = setting(
        4,
        "Answers sampled per prompt (G); rollout.prompts_per_iteration counts answers and "
        "must be a multiple of G.",
        low=2,
    )
    normalize_std: bool = setting(
        True,
        "Divide by the group's std (DSM). False centres only: Dr. GRPO's fix for the "
        "difficulty bias (pair it with ppo.loss_agg=seq-mean-token-sum-norm).",
    )
    eps: float = setting(1e-6, "Added to the group std (verl 1e-6).", low=0.0)


@dataclass
class DPOConfig:
    data: str | None = setting(
        None,
        "Preference pairs (prompt, chosen, rejected). None: the built-in annotator's, "
        "labelled with the rm.* annotator settings.",
    )
    pairs: int = setting(3000, "Built-in preference pairs to label.", low=1)
    beta: float = setting(
        0.1, "DPO β: strength of the implicit KL to the reference.", low=0.0, low_open=True
    )
    loss_type: str = setting("sigmoid", "'sigmoid' (DPO) or 'ipo'.", choices=("sigmoid", "ipo"))
    label_smoothing: float = setting(0.0, "Conservative-DPO ε (sigmoid only).", low=0.0, high=0.49)
    steps: int = setting(200, "Optimiser steps.", low=1)
    batch_size: int = setting(32, "Pairs per step.", low=1)
    lr: float = setting(1e-4, "Learning rate.", low=0.0, low_open=True)
    warmup_steps: int = setting(10, "Linear warm-up steps, then constant.", low=0)


@dataclass
class SFTConfig:
    data: str | None = setting(
        None,
        "SFT data: .jsonl/.csv/.parquet rows with `prompt` and `response` strings. None: the "
        "built-in task's noisy-teacher answers.",
    )
    examples: int = setting(4000, "Built-in teacher examples to generate.", low=1)
    output_dir: str = setting("runs/sft/model", "Where the fine-tuned policy is saved (HF folder).")
    steps: int = setting(600, "Optimiser steps.", low=1)
    batch_size: int = setting(32, "Sequences per step.", low=1)
    lr: float = setting(
        1e-3,
        "Learning rate; high because the presets start from random weights.",
        low=0.0,
        low_open=True,
    )
    warmup_steps: int = setting(30, "Linear warm-up steps, then cosine decay.", low=0)


@dataclass
class RMConfig:
    data: str | None = setting(
        None,
        "Preference pairs: rows with `prompt`, `chosen`, `rejected` and optional `labels` "
        "(attribute → 1/0/0.5). None: the built-in simulated annotator.",
    )
    init: str | None = setting(
        None,
        "Model folder the reward model starts from. None: model.policy (the SFT model, as "
        "InstructGPT does).",
    )
    heads: dict[str, float] = setting(
        {"preference": 1.0, "correctness": 1.0, "brevity": 1.0, "politeness": 1.0},
        "Heads and their training-loss weights. 'preference' learns the annotator's overall "
        "choice; any other head learns the pair's per-attribute label of that name.",
    )
    margin: float | None = setting(
        None,
        "Bradley-Terry margin subtracted from chosen − rejected (Llama-2). None: off.",
        low=0.0,
    )
    pairs: int = setting(3000, "Built-in preference pairs to label.", low=2)
    heldout_fraction: float = setting(
        0.1, "Share of pairs held out for accuracy.", low=0.0, high=0.9, low_open=True
    )
    noise: float = setting(
        0.3,
        "Built-in annotator temperature on gold-reward differences (0 = noiseless).",
        low=0.0,
    )
    length_bias: float = setting(
        0.0, "Built-in annotator's extra utility per answer word (a known flaw).", low=0.0
    )
    flattery_bias: float = setting(
        0.0,
        "Built-in annotator's extra utility for a flattering opener (a known flaw).",
        low=0.0,
    )
    output_dir: str = setting("runs/rm/model", "Where the reward model is saved (HF folder).")
    steps: int = setting(400, "Optimiser steps.", low=1)
    batch_size: int = setting(32, "Pairs per step.", low=1)
    lr: float = setting(5e-4, "Learning rate.", low=0.0, low_open=True)
    warmup_steps: int = setting(20, "Linear warm-up steps, then cosine decay.", low=0)


@dataclass
class Config:
    seed: int = setting(0, "Seed for sampling, shuffling and initialisation.")
    device: str = setting(
        "auto",
        "'auto' (cuda when available, else cpu), 'cpu' or 'cuda'; 'cuda' on a machine "
        "without one is an error in every command, not a quiet CPU run.",
        choices=("auto", "cpu", "cuda"),
    )
    threads: int = setting(0, "torch CPU threads (0 = torch's default).", low=0)
    model: ModelConfig = section(ModelConfig, "The four-model cast.")
    reward: RewardConfig = section(RewardConfig, "Where scores come from.")
    rollout: RolloutConfig = section(RolloutConfig, "Sampling.")
    ppo: PPOConfig = section(PPOConfig, "The PPO update.")
    data: DataConfig = section(DataConfig, "Prompts.")
    log: LogConfig = section(LogConfig, "Run directory, logging and checkpoints.")
    monitor: MonitorConfig = section(MonitorConfig, "Reward-hacking monitors and alerts.")
    dist: DistConfig = section(DistConfig, "Data parallelism under torchrun.")
    grpo: GRPOConfig = section(GRPOConfig, "Group baselines (rlhflab grpo / rloo).")
    dpo: DPOConfig = section(DPOConfig, "Direct preference optimisation (rlhflab dpo).")
    sft: SFTConfig = section(SFTConfig, "Supervised fine-tuning (rlhflab sft).")
    rm: RMConfig = section(RMConfig, "Reward-model training (rlhflab rm).")


def validate(cfg: Config, stage: str = "ppo") -> Config:
    """Cross-field checks that single-field bounds cannot express (for the given stage)."""
    if cfg.model.runtime == "native" and (cfg.model.lora_r or cfg.model.trust_remote_code):
        raise ConfigError(
            "model.runtime: 'native' runs rlhflab's own Llama code, which supports neither "
            "LoRA (model.lora_r) nor model.trust_remote_code; use 'transformers'"
        )
    if stage in ("sft", "rm", "dpo"):
        return cfg
    estimator = cfg.ppo.advantage_estimator
    if stage in CRITIC_FREE_ESTIMATORS and estimator != stage:
        raise ConfigError(
            f"ppo.advantage_estimator: rlhflab {stage} runs the {stage!r} estimator, not "
            f"{estimator!r}; run rlhflab {estimator if estimator != 'gae' else 'ppo'} instead"
        )
    if estimator not in CRITIC_FREE_ESTIMATORS and cfg.model.value_model == "none":
        raise ConfigError(
            "model.value_model: PPO needs a critic (ppo.advantage_estimator=gae); 'none' is "
            "for the critic-free estimators grpo and rloo (rlhflab grpo/rloo)"
        )
    if estimator in CRITIC_FREE_ESTIMATORS:
        if cfg.model.value_model != "none":
            raise ConfigError(
                f"model.value_model: ppo.advantage_estimator={estimator} trains no critic; "
                "set it to 'none'"
            )
        if cfg.rollout.prompts_per_iteration % cfg.grpo.group_size:
            raise ConfigError(
                f"grpo.group_size: {cfg.grpo.group_size} does not divide "
                f"rollout.prompts_per_iteration={cfg.rollout.prompts_per_iteration}"
            )
    if cfg.rollout.prompts_per_iteration % cfg.ppo.minibatches:
        raise ConfigError(
            f"ppo.minibatches: {cfg.ppo.minibatches} does not divide "
            f"rollout.prompts_per_iteration={cfg.rollout.prompts_per_iteration}"
        )
    mb = cfg.rollout.prompts_per_iteration // cfg.ppo.minibatches
    if cfg.ppo.micro_batch_size is not None and mb % cfg.ppo.micro_batch_size:
        raise ConfigError(
            f"ppo.micro_batch_size: {cfg.ppo.micro_batch_size} does not divide the minibatch "
            f"of {mb} answers"
        )
    if cfg.ppo.step_in_backward:
        if cfg.ppo.max_grad_norm is not None:
            raise ConfigError(
                "ppo.step_in_backward: a gradient-norm clip needs all of a model's gradients "
                "before any of its weights is updated; set ppo.max_grad_norm to null (it is "
                f"{cfg.ppo.max_grad_norm})"
            )
        if cfg.ppo.micro_batch_size is not None and cfg.ppo.micro_batch_size != mb:
            raise ConfigError(
                "ppo.step_in_backward: gradients accumulated over micro-batches "
                f"(ppo.micro_batch_size={cfg.ppo.micro_batch_size} < minibatch of {mb}) "
                "cannot be applied during the backward; set micro_batch_size to null"
            )
    if cfg.ppo.loss_agg_norm is not None and cfg.ppo.loss_agg != "seq-mean-token-sum-norm":
        raise ConfigError(
            "ppo.loss_agg_norm: only used with ppo.loss_agg=seq-mean-token-sum-norm "
            f"(it is {cfg.ppo.loss_agg!r})"
        )
    if cfg.model.value_model == "from_reward" and not cfg.reward.model:
        raise ConfigError("model.value_model: 'from_reward' needs reward.model to be set")
    if cfg.model.critic and cfg.model.value_model not in ("separate", "auto"):
        raise ConfigError("model.critic: only used with value_model 'separate'")
    if not cfg.reward.model and not cfg.reward.functions:
        raise ConfigError("reward: set reward.model or reward.functions (or both)")
    if cfg.reward.heads and not cfg.reward.model:
        raise ConfigError("reward.heads: head weights need reward.model")
    if cfg.ppo.kl_placement == "reward" and cfg.ppo.kl_estimator not in ("k1", "k3", "abs"):
        raise ConfigError(
            f"ppo.kl_estimator: {cfg.ppo.kl_estimator!r} is a loss-side estimator; in the reward "
            "use k1 (ppo-details §3.4)"
        )
    if cfg.ppo.kl_placement == "loss" and cfg.ppo.kl_estimator not in LOSS_KL_ESTIMATORS:
        # E_π[∇ log π] = 0, so k1 differentiated in the loss has no expected gradient: the
        # KL penalty would silently vanish (abs is no KL gradient either)
        raise ConfigError(
            f"ppo.kl_estimator: {cfg.ppo.kl_estimator!r} in the loss (ppo.kl_placement=loss) "
            "gives no KL gradient; use one of "
            f"{', '.join(repr(e) for e in LOSS_KL_ESTIMATORS)} (ppo-details §3.4)"
        )
    return cfg


def load_config(path=None, overrides=None, base: dict | None = None, stage="ppo") -> Config:
    """The config of ``stage`` (a command): ``base``, then the file, then the overrides.
    rlhflab grpo and rlhflab rloo run the estimator of their name, under ``base``."""
    if stage in CRITIC_FREE_ESTIMATORS:
        base = dict(base or {})
        base["ppo"] = {"advantage_estimator": stage, **base.get("ppo", {})}
    return validate(configbase.load(Config, path, overrides, base), stage)


__all__ = ["Config", "ConfigError", "load_config", "validate"]
