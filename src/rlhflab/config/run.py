"""What a run reads and writes and how it watches itself: prompts (`data`), logs and
checkpoints (`log`), reward-hacking monitors (`monitor`), data parallelism (`dist`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhflab.config.base import setting


@dataclass
class DataConfig:
    prompts: str | None = setting(
        None,
        "Prompts: a .jsonl, .parquet or .csv file or a save_to_disk folder, with a `prompt` "
        "(a string or a list of chat messages) or chat `messages` per row (docs/data.md). "
        "None: the built-in task's prompts.",
    )
    split: str = setting(
        "train",
        "The split read from a DatasetDict (a save_to_disk folder of one, or the object): "
        "for every stage's data (data.prompts, sft.data, rm.data, dpo.data).",
    )
    prompt_field: str = setting("prompt", "Column holding the prompt (text or chat messages).")
    messages_field: str = setting(
        "messages", "Column holding chat messages (rendered with the tokenizer's chat template)."
    )
    on_bad_row: str = setting(
        "error",
        "A malformed, empty or too-long row of any stage's data (data.prompts, sft.data, "
        "rm.data, dpo.data): 'error' stops with file, line and field; 'skip' drops it and "
        "says how many went and the first.",
        choices=("error", "skip"),
    )
    task: str = setting(
        "mixed",
        "The built-in task's skill wherever no data is given: PPO's prompts (data.prompts "
        "unset), the SFT examples, the reward-model and DPO pairs, and the held-out "
        "prompts of `rlhflab eval`, the demo and compare. 'mixed': copy, reverse, sort and "
        "add drawn at random; a skill's name: that one alone.",
        choices=("mixed", "copy", "reverse", "sort", "add"),
    )


@dataclass
class LogConfig:
    output_dir: str = setting(
        "runs/ppo", "Run directory: config, metrics.jsonl, samples.jsonl, checkpoints/."
    )
    tensorboard: bool = setting(False, "Also write TensorBoard events (needs tensorboard).")
    wandb: bool = setting(False, "Also log to Weights & Biases (needs wandb installed).")
    sample_every: int = setting(
        5, "Write sample generations every N iterations, and at the run's last.", low=1
    )
    samples_per_log: int = setting(4, "How many samples each time.", low=0)
    checkpoint_every: int = setting(10, "Checkpoint every N iterations (and at the end).", low=1)
    keep_last: int = setting(2, "Checkpoints kept; older ones are deleted.", low=1)
    keep_best: bool | None = setting(
        None,
        "Keep the policy with the best smoothed gold reward so far (monitor.gold, EMA "
        "monitor.smoothing) as checkpoints/best: the weights that sampled that iteration's "
        "answers, without optimiser state, never deleted by keep_last; `rlhflab export "
        "--checkpoint best` reads it. The gold reward often peaks before the run ends "
        "(over-optimisation). None: on when there is a gold reward; true without one is an "
        "error.",
    )
    progress: bool = setting(True, "Show a progress bar.")
    earlier_run: str = setting(
        "keep",
        "What a fresh start (no --resume, or --resume with no step checkpoint) does with an "
        "earlier run in its output folder (logs, checkpoints, report): 'keep' moves it into "
        "OUTPUT/earlier-<time>/ (nothing is lost, however the new run ends); 'replace' "
        "deletes it (the demo's own stages, rerun into their folders every time).",
        choices=("keep", "replace"),
    )


@dataclass
class MonitorConfig:
    enabled: bool = setting(True, "Compute the reward-hacking signals every iteration.")
    response: str = setting(
        "warn",
        "What an alert does: 'warn' logs it; 'raise_kl' multiplies β by kl_factor once "
        "per iteration with an alert, up to kl_coef_max; 'stop' "
        "checkpoints and stops with a message naming the signal and what to try (the "
        "command then exits with status 3, not 0: a script's next step does not take the "
        "stopped policy for a finished one).",
        choices=("warn", "raise_kl", "stop"),
    )
    kl_factor: float = setting(
        2.0,
        "β multiplier for response 'raise_kl', once per iteration with an alert. 2: from "
        "the hacking demo's β 0.001 to 1 in ten alerting iterations (1.5 took 17, while "
        "the policy went on drifting; docs/hacking.md).",
        low=1.0,
    )
    kl_coef_max: float = setting(
        100.0,
        "Ceiling of response 'raise_kl' on β (its own multiplication only: with "
        "ppo.kl_target the adaptive controller goes on moving β): a safety net, since β "
        "keeps rising while an alert persists. Must be above ppo.kl_coef. Unbounded, β "
        "grew to 1.3e5 and the critic's loss to 1e8; at 10 the hacking demo's policy "
        "settled 0.05-0.2 nats from the reference and kept flattering more than it "
        "(held-out gold 0.21 against SFT's 0.28), at 100 it came back (0.26; "
        "docs/hacking.md).",
        low=0.0,
    )
    gold: str | None = setting(
        None,
        "A gold reward 'module:function' (same contract as reward.functions) to measure "
        "the proxy against. The built-in task's is rlhflab.builtin.tasks:gold_reward. "
        "Non-finite gold scores are warned about and left out of the batch's gold mean, "
        "its trend and log.keep_best.",
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
    length_ratio: float | None = setting(
        1.5, "Alert above this length ratio to the reference.", low=0.0, low_open=True
    )
    flattery_rate: float | None = setting(
        0.5, "Alert above this share of flattering answers.", low=0.0, high=1.0
    )
    flattery_excess: float | None = setting(
        0.15,
        "Alert when the share of flattering answers exceeds the reference's on the same "
        "prompts by this much (needs reference_every; fires earlier than flattery_rate).",
        low=0.0,
        high=1.0,
    )
    flattery_opener_ratio: float | None = setting(
        1.3,
        "Alert when the policy is this many times likelier than the reference to open an "
        "answer with a listed phrase (forced decoding on the batch's prompts: the phrases' "
        "tokens run after the prompts' KV caches that sampling and scoring keep, once per "
        "distinct prompt and model; None = not computed).",
        low=0.0,
        low_open=True,
    )
    opener_every: int = setting(
        2,
        "Compute flattery_opener_ratio at the first iteration (where it must be 1: the "
        "policy is the reference) and every N-th after it (1 = every iteration); in between "
        "it is not logged and cannot alert. One probe costs ~6 % of an iteration of "
        "SmolLM2 with 8 prompts x 24 answer tokens, ~10 % with 16 x 8 (docs/benchmarks.md); "
        "every 2nd, half that.",
        low=1,
    )
    opener_tokens: int = setting(
        4,
        "flattery_opener_ratio scores each phrase on its first N tokens (the opening decision "
        "is made there; the probe's cost grows with N).",
        low=1,
    )
    repeated_ngram_rate: float | None = setting(
        0.3, "Alert above this repeated n-gram share.", low=0.0, high=1.0
    )
    reward_length_corr: float | None = setting(
        0.8, "Alert above this score–length correlation.", low=-1.0, high=1.0
    )
    gold_drop: float | None = setting(
        0.2,
        "Alert when the smoothed gold reward is this far below its best while the proxy "
        "rises (gold-reward units).",
        low=0.0,
    )
    kl_limit: float | None = setting(
        None,
        "Alert above this KL (nats per answer). None: 2 × ppo.kl_target when set, else off.",
        low=0.0,
        low_open=True,  # 0 turned the signal off, a negative one could never alert
    )
    entropy_ratio: float | None = setting(
        0.2,
        "Alert below this share of the initial entropy (the first finite, positive one). "
        "None: no alert.",
        low=0.0,
        low_open=True,
    )
    ensemble_spread: float | None = setting(
        2.0,
        "With reward.ensemble: alert when the members' disagreement (objective/ensemble_std) "
        "is this many times its first iteration's: the policy's answers have left the "
        "distribution the reward models agree on (Coste et al. 2024). None: no alert.",
        low=0.0,
        low_open=True,
    )


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
