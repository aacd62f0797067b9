"""The four-model cast (`model`) and where scores come from (`reward`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhflab.config.base import setting

PRECISIONS = ("fp32", "bf16", "fp16", "int8")


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
        "they support). 'native': rlhflab's own Llama forward (rlhflab/backends/native.py) over the "
        "same safetensors files, for model_type llama with default RoPE; with rlhflab's own "
        "AdamW a run never imports transformers' modelling code or torch's compiler stack "
        "(less resident memory per process: docs/benchmarks.md, 'Import cost'). Not with LoRA or "
        "trust_remote_code.",
        choices=("transformers", "native"),
    )
    value_model: str = setting(
        "auto",
        "Critic layout. 'shared': a value head on the policy's backbone (OAI19; least memory). "
        "'separate': its own backbone from `critic` (or a copy of the policy). 'from_reward': "
        "initialised from the reward model, head included (N+, InstructGPT); both train "
        "every weight, or adapters and the head with critic_lora_r. 'auto' = shared with "
        "LoRA (model.lora_r > 0: the adapters and the head train, no full critic) unless "
        "critic_lora_r asks for a LoRA critic, else from_reward when a reward model shares "
        "the policy's tokenizer, else separate (ppo-details §6.4). "
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
    compute_dtype: str = setting(
        "fp32",
        "Arithmetic of the trained models' forward and backward passes (policy, critic, value "
        "head; the SFT, RM and DPO model), in sampling, scoring and training: 'bf16' runs "
        "them under torch.autocast (matrix products in bf16; norms, logits' log-softmax, "
        "value and reward heads, ratios, KL, advantages and losses in fp32), as does the "
        "reference when reference_precision is fp32 (so π and π_ref are computed alike "
        "and the KL starts at 0); weights, gradients and AdamW moments stay fp32. bf16 is "
        "faster where the hardware multiplies it natively (GPUs from Ampere on, CPUs with "
        "AMX: 1.97x per PPO iteration at 25M parameters and 1.64x on SmolLM2-135M on an "
        "AMX Xeon, benchmarks/bf16_speedup.py); on a CPU without it, slower (2-3x per PPO "
        "iteration on a Xeon without AMX: docs/real-models.md, 'Precision'). fp32 stays "
        "the default: it keeps runs bit-exact across machines. 'fp16' autocasts to fp16 "
        "(GPUs before Ampere, or to match a checkpoint's training) with dynamic loss "
        "scaling (loss_scale): small gradients that would underflow to 0 in fp16 are "
        "lifted into its range, and an update whose scaled gradients overflow is skipped "
        "and the scale halved (backends/loss_scale.py). On a CPU fp16 products are "
        "emulated: ~10x slower than fp32 on this project's Xeon VM; use bf16 there. Not "
        "with ppo.step_in_backward (an overflow is only known after some weights are "
        "updated), cpu_matmul=numpy (numpy multiplies fp32 only) nor "
        "dist.mixed_precision (fsdp's own parameter casting).",
        choices=("fp32", "bf16", "fp16"),
    )
    loss_scale: float = setting(
        2.0**16,
        "Initial loss scale with compute_dtype=fp16 (torch.amp.GradScaler's default, 2^16): "
        "the loss is multiplied by it before backward and the gradients divided by it "
        "before the clip and AdamW. Halved on every update whose gradients overflow (that "
        "update is skipped, counted in faults/overflow_skips, not in ppo.max_bad_updates), "
        "doubled after loss_scale_growth_interval clean updates; at 1 an overflow counts "
        "as a non-finite gradient. Ignored for fp32 and bf16 (bf16 has fp32's range).",
        low=1.0,
    )
    loss_scale_growth_interval: int = setting(
        2000,
        "Clean updates in a row after which the fp16 loss scale doubles (GradScaler's "
        "default). Ignored for fp32 and bf16.",
        low=1,
    )
    reference_precision: str = setting(
        "fp32",
        "Precision of the frozen reference: fp32, bf16, fp16, or int8 (dynamic "
        "quantisation of Linear layers on CPU). Lower saves memory; the KL gets noisier: "
        "an unchanged SmolLM2-135M policy's log-probs differ from a bf16 reference's by "
        "~0.03 nats a token, from an int8 one's by ~1.2 (KL ~9 nats on a 24-token answer: "
        "torch's dynamic int8 also rounds activations per tensor, which real language "
        "models' outlier features do not survive). The first iteration warns when the gap "
        "exceeds 0.1 nats a token (trainers/ppo_guards.py).",
        choices=PRECISIONS,
    )
    reference_low_weights: bool = setting(
        True,
        "With a 16-bit compute_dtype and reference_precision fp32, the reference's Linear "
        "weights are stored in that 16-bit dtype: under autocast it multiplies only 16-bit "
        "copies of them, cast again in every forward, so the fp32 originals held half their "
        "bytes for nothing. Same arithmetic bit for bit (the copy is the rounding autocast "
        "applies; norms, embeddings and a tied output embedding stay fp32, and the KL of "
        "an unchanged policy stays 0); the reference's Linear weights take half the memory "
        "and its forward skips the casts (SmolLM2-135M: peak -220 MiB, time within noise; "
        "docs/real-models.md, 'Precision'). Not with a LoRA policy (its reference is the policy's own base) "
        "nor a reference sharded by fsdp (one dtype per shard). Ignored for fp32.",
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
        "them, in every trained model (SFT, RM and DPO policies, the PPO policy and a separate "
        "critic): less memory for about one more forward of compute. TRL's GRPO/RLOO turn it "
        "on by default.",
    )
    lean_activations: bool = setting(
        True,
        "Llama-family RMSNorm and SwiGLU MLP blocks (Llama, Mistral, Qwen2/3, SmolLM3) of "
        "every trained model keep fewer activations for backward: the normalised input and "
        "SiLU(gate)*up are recomputed from what is kept (elementwise work, no matmul). Same "
        "outputs, same gradients up to rounding, about a third fewer saved bytes "
        "(rlhflab/backends/lean.py). Other architectures are left as they are.",
    )
    cpu_matmul: str = setting(
        "torch",
        "Which library multiplies the Linear layers' float32/64 matrices on the CPU. 'torch': "
        "PyTorch's own (Intel MKL in its CPU wheels). 'numpy': the BLAS numpy carries "
        "(OpenBLAS in its wheels) for products of 64 rows or more, in forward and backward "
        "(rlhflab/backends/cpu_blas.py). Which is faster depends on the CPU (on some AMD EPYC "
        "machines OpenBLAS wins, on Intel Xeon with AVX-512 MKL does: docs/benchmarks.md); "
        "same results to float rounding. Off by default: run benchmarks/cpu_matmul.py on "
        "your CPU before switching. "
        "CPU device only.",
        choices=("torch", "numpy"),
    )
    cast_cache: bool = setting(
        True,
        "With a 16-bit compute_dtype, each trained model keeps the 16-bit copies of its fp32 "
        "Linear weights between forwards and remakes one only when the weight changed (an "
        "optimiser step), where autocast casts every weight again in every forward "
        "(sampling, values, each epoch, the monitor's probe) and a frozen one (a LoRA "
        "policy's base, shared with its reference) at every call, each decoding step's "
        "included. Same arithmetic bit for bit; costs half those weights' fp32 bytes, held "
        "between forwards, which a training forward's graph holds anyway while it lives "
        "(with gradient_checkpointing it does not: frozen weights then keep none; "
        "rlhflab/backends/weight_cast.py). Not under torch.distributed (FSDP re-gathers "
        "weights into storage it cannot track). Ignored for fp32.",
    )
    cast_once: bool = setting(
        True,
        "With a 16-bit compute_dtype, a decoder layer casts its normalised input to 16 bits "
        "once for its q/k/v projections and once for gate/up, where autocast casts it in "
        "each projection (five casts of a (tokens, hidden) tensor a layer in every "
        "forward). Each projection still sends its gradient back in fp32 through its own "
        "node, so forward and backward are the same arithmetic bit for bit "
        "(rlhflab/backends/input_cast.py). Plain Linear projections of the native "
        "runtime's attention and of the lean SwiGLU MLP (lean_activations); LoRA, int8 and "
        "numpy-BLAS layers take their input as before. Ignored for fp32.",
    )
    cpu_attention_fp32: bool = setting(
        True,
        "On a CPU, when a model's q/k/v projections come out in 16 bits (compute_dtype "
        "bf16/fp16, or a frozen model held in bf16/fp16), its attention runs in fp32 "
        "between the projections: on the native runtime the rotary embedding, KV cache and "
        "SDPA; on the transformers runtime SDPA (a model loaded with transformers' 'sdpa' "
        "attention gets rlhflab's fp32 version of it, registered with transformers' "
        "AttentionInterface; nothing of it is saved in an exported config). torch 2.13's "
        "CPU attention is several times slower in bf16 than in fp32 (the backward ~4x at "
        "SmolLM2-135M's shapes on an AMX Xeon: a tenth of a bf16 PPO iteration), while "
        "attention's products are a small share of the work; fp32 rotary is also what "
        "transformers' Llama computes under autocast. Off: attention in the projections' "
        "dtype, as on a GPU, where this never applies (docs/real-models.md, 'Precision').",
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
    lora_targets: str | list[str] = setting(
        "all-linear",
        "Layers the LoRA adapters go on (the policy's, and a LoRA critic's). 'all-linear': "
        "every Linear layer but the output head, whatever the architecture calls them "
        "(GPT-2's c_attn/c_proj/c_fc, GPT-NeoX's query_key_value/dense, Llama's and Qwen2's "
        "q_proj … down_proj), so any causal LM works unnamed; QLoRA found adapters on every "
        "linear layer needed to match full fine-tuning, attention alone falling short, and "
        "the MLP's adapters cost about r·(hidden + intermediate) weights per matrix. Or a "
        "list of names as peft matches them, the last parts of a layer's path ([q_proj, "
        "v_proj], [attn.c_proj]); [q_proj, k_proj, v_proj, o_proj] was the default until "
        "issue #26 (attention only, Llama names). A name that matches no Linear layer of the "
        "model is refused, with the model's Linear layer names. A mixture-of-experts model "
        "(Mixtral, Qwen3-MoE) keeps its experts as fused tensors in transformers 5, not "
        "Linear layers: all-linear adapts its attention and router, never the experts.",
    )
    critic_lora_r: int = setting(
        0,
        "LoRA rank for a 'separate' or 'from_reward' critic (0 = the critic trains every "
        "weight). The critic then trains its adapters (model.lora_targets, model.lora_alpha) "
        "and its whole value head, and keeps its frozen backbone in model.reference_precision "
        "where that is bf16/fp16 (int8 stays fp32: peft cannot adapt quantised layers): no "
        "gradients or AdamW moments for the backbone, half its bytes in 16 bits, and "
        "checkpoints hold the adapters and head alone. A separate critic that learns "
        "apart from the policy, at a fraction of a full critic's memory; the shared head "
        "is still less. Not with dist.strategy=fsdp (ddp works).",
        low=0,
    )


@dataclass
class RewardConfig:
    model: str | None = setting(
        None,
        "Reward model: a Hugging Face sequence-classification folder (one output per head) "
        "with trained `score` weights — a causal-LM folder is refused, not scored through a "
        "fresh random head. Its score is read at the last real token: the EOS of an answer "
        "that ended, the last answer token of one cut off at max_new_tokens (encoded as in "
        "`rlhflab rm`: prompt and answer apart, rewards.encode_for_reward).",
    )
    heads: dict[str, float] = setting(
        {},
        "Weight of each reward-model head by name (from the model's id2label), combined into "
        "the scalar the policy optimises. Empty: every head with weight 1, except a head "
        "named 'length' (rm.length_head, ODIN), which gets 0: it holds the length preference "
        "the quality heads were trained free of. A head left out of a non-empty mapping gets 0.",
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
        "left as they are until scores differ), 'none' (N+, TRL; ppo-details §2.3).",
        choices=("none", "batch", "running"),
    )
    clip: float | None = setting(
        None,
        "Clip normalised scores to ±clip (MOSS uses 5). None: no clipping.",
        low=0.0,
        low_open=True,
    )
    ensemble: list[str] = setting(
        [],
        "Reward-model ensemble: k sequence-classification folders with the same heads (e.g. "
        "`rlhflab rm` with rm.ensemble_size=k: OUT/member-0 … member-k-1). Each member is "
        "frozen in model.reward_precision and scored as reward.model would be (one "
        "ModelReward each: k forward passes per batch, k models in memory); each member's "
        "heads are summed with reward.heads, then combined per answer by ensemble_combine "
        "(Coste et al., ICLR 2024, 'Reward Model Ensembles Help Mitigate "
        "Overoptimization'). Logged: objective/ensemble_std, the members' disagreement. "
        "Not with reward.model. Empty: off.",
    )
    ensemble_combine: str = setting(
        "mean",
        "How the members' scores become one per answer: 'mean'; 'wco' (worst-case: the "
        "minimum over members); 'uwo' (uncertainty-weighted: mean − uwo_lambda · variance "
        "over members). Coste et al. found WCO and UWO curb overoptimisation in best-of-n "
        "and PPO, mean less so.",
        choices=("mean", "wco", "uwo"),
    )
    uwo_lambda: float = setting(
        0.5,
        "λ of ensemble_combine='uwo': the variance penalty's weight, in reward units⁻¹ (the "
        "variance is in squared score units). Coste et al. tuned it per setting; 0.5 is "
        "a middle value, not tuned here.",
        low=0.0,
    )
    ensemble_center: str = setting(
        "reference",
        "Before reward.ensemble's members are combined, shift each by its mean score on the "
        "reference policy's answers to the batch's prompts, less the members' average "
        "(recomputed every iteration, so a refreshed member is centred anew). A "
        "Bradley-Terry model's offset is arbitrary: uncentred, 'wco' follows whichever "
        "member sits lowest and 'uwo' counts the offsets as disagreement, which cost the "
        "default demo gold (docs/hacking.md). Cost: the reference's answers (the monitor's "
        "reference sampling, shared when monitor.reference_every samples that iteration) "
        "scored by every member. With ensemble_combine='mean' the combined score is the "
        "same either way (the offsets average to zero): centring then changes only the "
        "members' logged scores, their spread and monitor.ensemble_spread. 'none': the "
        "members as they are (and no extra sampling).",
        choices=("none", "reference"),
    )
    shaping: str = setting(
        "none",
        "RL reward shaping. 'par' (Preference As Reward, Fu et al. 2025, 'Reward Shaping "
        "to Mitigate Reward Hacking in RLHF'): the reward becomes σ(r − r_ref), r_ref the "
        "score of the reference policy's answer to the same prompt (bounded: no gain from "
        "pushing the proxy far past the reference). Cost: one extra generation per "
        "iteration by the reference (the monitor's reference sampling, shared when "
        "monitor.reference_every samples that iteration) and one extra reward scoring of "
        "those answers. Applied after reward.missing_eos_penalty (given to both answers), "
        "before reward.normalize. 'none': the score as it is.",
        choices=("none", "par"),
    )
    refresh_every: int | None = setting(
        None,
        "Reward-model refresh (online / iterated RLHF: Bai et al. 2022 refreshed theirs "
        "weekly on the newest policy's answers): after every N-th PPO iteration the current "
        "policy answers that iteration's prompts twice, a labeller judges each pair "
        "(reward.refresh_labeller, or the built-in annotator with the rm.* settings), the "
        "reward model (each member of reward.ensemble) is fine-tuned on them and PPO goes on "
        "scoring with it. Its weights go into every checkpoint (checkpoints/step-N/reward, a "
        "reward.model folder), so --resume stays exact. Needs reward.model or "
        "reward.ensemble in model.reward_precision=fp32, and one process. Cost per refresh: "
        "two samplings of the batch's prompts, the labeller, refresh_steps forward and "
        "backward passes of each reward model with its AdamW moments held meanwhile, and "
        "two scorings of the pairs (accuracy before and after). None or 0: off, a fixed "
        "reward model as InstructGPT used: a refresh needs a labeller, which only the "
        "built-in task has for free (docs/hacking.md).",
        low=0,
    )
    refresh_labeller: str | None = setting(
        None,
        "Who labels a refresh's pairs: 'module:function' called as fn(prompts, answers_a, "
        "answers_b) with three equal-length lists of strings, returning one number per pair "
        "in [0, 1] (1: answer a is better, 0: answer b is, 0.5: a tie; values between are "
        "soft Bradley-Terry targets) for the head 'preference' (or a one-head model's only "
        "head), or a dict of head name → such a list. None: the built-in annotator with "
        "rm.noise, rm.length_bias and rm.flattery_bias (set them as the reward model was "
        "trained), on the built-in task only (data.prompts unset).",
    )
    refresh_steps: int = setting(
        20,
        "AdamW steps per refresh, for each reward model. Each refresh starts a new AdamW "
        "(moments from the previous policy's answers would be stale), so no optimiser "
        "state lives between refreshes. Not tuned here.",
        low=1,
    )
    refresh_batch_size: int = setting(16, "Pairs per refresh step.", low=1)
    refresh_lr: float = setting(
        1e-4,
        "Constant learning rate of a refresh: a fine-tune of a trained model, a fifth of "
        "rm.lr's default. Not tuned here.",
        low=0.0,
        low_open=True,
    )
    refresh_replay: float = setting(
        0.5,
        "Share of each refresh batch drawn from the reward model's own training pairs "
        "(rm.data, else the built-in pairs of the rm.* settings; the part `rlhflab rm` "
        "trained on), the rest from the fresh pairs of every refresh so far. Keeping old "
        "comparisons beside new ones is what Llama 2 did (Touvron et al. 2023) and one of "
        "the data schemes Wolf et al. 2025 ('Reward Model Overoptimisation in Iterated "
        "RLHF') compare; the replay keeps the model from forgetting the answers it was "
        "trained on. 0: fresh pairs only.",
        low=0.0,
        high=1.0,
    )
