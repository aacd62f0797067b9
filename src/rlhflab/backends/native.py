"""rlhflab's own runtime for Llama-architecture checkpoints (``model.runtime: native``).

Why: loading a model through transformers imports its model-loading stack
(``transformers.utils.type_validators`` → ``core_model_loading`` →
``torch.distributed.tensor`` → ``torch._dynamo`` and sympy, plus accelerate): ~115 MiB of
resident memory on top of torch's own, more than a 4M-parameter run's weights, gradients
and AdamW state together (docs/benchmarks.md, "Import cost"). The forward passes rlhflab
needs from a Llama model are few — logits with an optional KV cache, the backbone's last
hidden state, a linear head — so this module implements them directly on the same
safetensors, with the same parameter names: a checkpoint saved here loads in transformers
and back, and FSDP's ``base_model.layers`` and the lean activations find what they expect.
With rlhflab's own AdamW (:mod:`rlhflab.backends.optim`; constructing a ``torch.optim`` optimiser
imports ``torch._dynamo`` as well) a run stays at torch's import floor. The whole models,
loading and saving are in :mod:`rlhflab.backends.native_models`.

What it supports, checked when the config is read (anything else is refused with the
field named, never guessed at): ``model_type: llama``, SiLU MLP, the default RoPE (no
scaling), ``pretraining_tp: 1``; grouped-query attention, attention/MLP biases and tied
embeddings are handled. The arithmetic follows transformers' Llama (RMSNorm in float32,
RoPE angles in float32, SDPA attention), so logits agree with it to float rounding
(tests/test_native.py). Two documented differences: a pad *query* position attends to
itself only (transformers lets it attend everywhere; both outputs are masked out later),
and new embedding rows (a pad token added to the vocabulary) start at the mean of the
existing rows instead of a random draw around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlhflab.backends.input_cast import projection_inputs
from rlhflab.backends.kv_cache import KVCache
from rlhflab.backends.lean import rms_norm_plain
from rlhflab.backends.native_config import NativeConfig


class NativeRMSNorm(nn.Module):
    """Llama RMSNorm: w · x / sqrt(mean(x²) + eps), computed in float32 for 16-bit x."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps  # the name lean.make_activations_lean looks for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_plain(x, self.weight, self.variance_epsilon)


class NativeMLP(nn.Module):
    """SwiGLU: down(SiLU(gate(x)) · up(x))."""

    def __init__(self, cfg: NativeConfig):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1·c − x2·s, x2·c + x1·s] for x (..., 2h) = [x1, x2] and c, s (..., h): the rotary
    embedding, written into one output (transformers' q·cos + rotate_half(q)·sin with
    cos = [c, c], sin = [s, s] makes ~4.5 passes over q and a cat; this makes 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():
        # torch.compile fuses these passes anyway, and inductor (torch 2.13) fails on the
        # out= products below ("mul expected 2 arguments, got 3"): the plain expression
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


class _RotaryFn(torch.autograd.Function):
    """The rotary embedding as one autograd node that keeps only c and s: the gradient of
    a rotation by θ is the rotation by −θ of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, heads, L, 2h) with cos, sin (B, 1, L, h)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RotaryFn.apply(x, cos, sin)
    return _rotate(x, cos, sin)


_HALF = (torch.bfloat16, torch.float16)


class NativeAttention(nn.Module):
    """Llama attention: q/k/v projections, rotary embedding, SDPA (grouped-query where
    kv_heads < heads), o projection.

    ``fp32_on_cpu`` (``model.cpu_attention_fp32``, set per model by
    ``models.build.load_model``): when the projections come out in 16 bits on a CPU
    (``model.compute_dtype`` bf16/fp16, or a frozen model held in bf16/fp16), the rotary
    embedding (on fp32 angles), the KV cache and SDPA run in fp32 between them. torch
    2.13's CPU flash attention is several times slower in bf16 than in fp32 — its backward
    5.9 against 1.5 ms a call at SmolLM2-135M's (8, 9, 68, 64) on an AMX Xeon, 0.72 s of a
    6.2 s PPO iteration (docs/real-models.md, "Precision") — while the attention's own
    products are a small part of the work. It is also how transformers' Llama computes the
    rotary embedding under autocast (16-bit q times fp32 cos: fp32), rounded once instead
    of after each multiply. The output is cast back for o_proj (autocast would cast it)."""

    fp32_on_cpu = True
    cast_once = True  # model.cast_once: backends/input_cast.py

    def __init__(self, cfg: NativeConfig, layer: int):
        super().__init__()
        self.layer, hd = layer, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, cfg.hidden_size, bias=bias)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, keep: int = 0):
        """x (B, L, H); cos/sin (B, L, head_dim / 2); mask (B, 1, L, T) bool or None =
        causal. ``keep`` > 0: queries (and the output, (B, keep, H)) for the last ``keep``
        positions only; keys and values still cover all L."""
        B, L, _ = x.shape
        Lq = keep if 0 < keep < L else L
        xq, xk, xv = projection_inputs(x, (self.q_proj, self.k_proj, self.v_proj), self.cast_once)
        xq = xq[:, L - Lq :] if Lq < L else xq
        q = self.q_proj(xq).view(B, Lq, self.heads, -1).transpose(1, 2)
        k = self.k_proj(xk).view(B, L, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(xv).view(B, L, self.kv_heads, -1).transpose(1, 2)
        narrow = q.dtype
        wide = self.fp32_on_cpu and q.device.type == "cpu" and narrow in _HALF
        if wide:  # see the class docstring: rotary, cache and attention in fp32
            q, k, v = q.float(), k.float(), v.float()
        else:  # the angles in the hidden states' dtype, as transformers' Llama takes them
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = apply_rotary(q, cos[:, :, L - Lq :], sin[:, :, L - Lq :])
        k = apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if Lq < L:
            mask = _last_rows(mask, Lq, k.shape[2], x.device)
        causal, gqa = mask is None and Lq > 1, self.kv_heads != self.heads
        if wide:  # CPU autocast would lower SDPA's inputs to 16 bits again
            with torch.autocast("cpu", enabled=False):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
                ).to(narrow)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, Lq, -1))


def set_cpu_attention_fp32(on: bool, models) -> int:
    """``model.cpu_attention_fp32`` on every :class:`NativeAttention` of ``models``; None
    entries, other runtimes' models and non-modules (a LoRA reference: the policy's own
    modules, set as the policy's) are skipped. Returns how many were set."""
    n = 0
    for model in models:
        for module in model.modules() if isinstance(model, nn.Module) else ():
            if isinstance(module, NativeAttention):
                module.fp32_on_cpu = bool(on)
                n += 1
    return n


def _last_rows(mask: torch.Tensor | None, rows: int, T: int, device) -> torch.Tensor:
    """The last ``rows`` query rows of a (B, 1, L, T) mask; for None (causal, nothing
    padded) a (rows, T) causal mask aligned to the bottom right, which SDPA's ``is_causal``
    is not when there are fewer queries than keys (it aligns to the top left)."""
    if mask is not None:
        return mask[:, :, -rows:]
    return torch.ones(rows, T, dtype=torch.bool, device=device).tril(T - rows)


class NativeDecoderLayer(nn.Module):
    def __init__(self, cfg: NativeConfig, layer: int):
        super().__init__()
        self.self_attn = NativeAttention(cfg, layer)
        self.mlp = NativeMLP(cfg)
        self.input_layernorm = NativeRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = NativeRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, mask, cache, keep: int = 0):
        """h (B, L, H) → (B, L, H), or (B, keep, H) for the last ``keep`` positions when
        0 < keep < L (every position still gives its key and value)."""
        attn = self.self_attn(self.input_layernorm(h), cos, sin, mask, cache, keep)
        h = (h[:, -attn.shape[1] :] if attn.shape[1] < h.shape[1] else h) + attn
        return h + self.mlp(self.post_attention_layernorm(h))


def recomputed_in_backward(fn, *args):
    """``fn(*args)`` keeping none of its intermediate tensors for backward: when backward
    first needs one, ``fn`` runs again on the same inputs, and each tensor it saves is
    handed to backward once and then dropped (activation checkpointing, non-reentrant: the
    forward builds the graph as usual, only the tensors it would save are not kept).

    Not ``torch.utils.checkpoint``: its non-reentrant path reads ``torch._dynamo.config``,
    which imports torch's compiler stack (+76 MiB resident, ~800 modules, torch 2.13) —
    what ``model.runtime=native`` exists to avoid. ``fn`` must save the same tensors in the
    same order when run again: the decoder layer draws no random numbers (no dropout). The
    recomputation's own graph keeps nothing (its pack hook returns None; one that returned
    the tensor ties an output to its own grad_fn in a cycle Python cannot collect: a 25M
    GRPO worker's peak went 1067 → 2028 MiB that way), and each recomputed tensor is kept
    detached and dropped once backward has used it. The recomputation runs under the
    forward's ``torch.autocast`` state (``model.compute_dtype``), which backward does not
    keep by itself: else it would save fp32 tensors where the forward saved bf16 ones."""
    count = [0]
    recomputed: dict[int, torch.Tensor] = {}
    device_type = args[0].device.type
    autocast = torch.autocast(
        device_type,
        dtype=torch.get_autocast_dtype(device_type),
        enabled=torch.is_autocast_enabled(device_type),
    )

    def pack(_tensor) -> int:  # the forward keeps each saved tensor's position only
        count[0] += 1
        return count[0] - 1

    def keep(tensor) -> None:  # the recomputation keeps a detached copy, by position
        recomputed[len(recomputed)] = tensor.detach()

    def unpack(index: int) -> torch.Tensor:
        if index not in recomputed:  # first use in this backward: run the segment again
            recomputed.clear()
            inputs = [
                a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in args
            ]
            hooks = torch.autograd.graph.saved_tensors_hooks(keep, _unused)
            with torch.enable_grad(), autocast, hooks:
                fn(*inputs)
            if len(recomputed) != count[0]:
                raise RuntimeError(
                    f"activation checkpointing: the recomputed forward saved "
                    f"{len(recomputed)} tensors where the first saved {count[0]} (a segment "
                    "that is not deterministic?)"
                )
        return recomputed.pop(index)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args)


def _unused(_packed) -> None:
    raise RuntimeError("the graph of a recomputed segment is never run backward")


def attention_mask_4d(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor | None:
    """(B, T) 0/1 key mask → (B, 1, q_len, T) bool, causal over the last q_len positions;
    None when nothing is padded and there is no cache (SDPA's own causal kernel then).
    A (B, 1, q_len, T) mask is taken as it is (True: may attend; the opener probe's
    tree-shaped mask), as transformers takes a 4-D mask.

    A query may see key j when j is a real token at or before it; every query also sees
    itself, so a pad query's row is never empty (an empty row would be NaN in SDPA).
    """
    if attention_mask.dim() == 4:
        return attention_mask.bool()
    B, T = attention_mask.shape
    if T == q_len and bool(attention_mask.all()):
        return None
    device = attention_mask.device
    rows = torch.arange(T - q_len, T, device=device)[:, None]
    cols = torch.arange(T, device=device)[None, :]
    allowed = (cols <= rows) & attention_mask.bool()[:, None, None, :]
    return allowed | (cols == rows)


@dataclass
class NativeOutput:
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    past_key_values: KVCache | None = None


class NativeLlamaModel(nn.Module):
    """The backbone: embeddings, decoder layers, final norm (transformers' ``model.*``)."""

    # forward(keep_last=N) runs the last layer on the last N rows only (models.forward asks)
    computes_last_rows_only = True

    def __init__(self, cfg: NativeConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            NativeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = NativeRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.checkpointing = False

    def _inv_freq(self) -> torch.Tensor:
        d = self.config.head_dim
        return 1.0 / (self.config.rope_theta() ** (torch.arange(0, d, 2, dtype=torch.float) / d))

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        keep_last: int = 0,
    ) -> NativeOutput:
        """Last hidden states (B, L, H), or (B, keep_last, H) of the last ``keep_last``
        positions when 0 < keep_last < L: then the last layer computes queries, attention
        output and MLP for those rows only. The rows nobody reads (a prompt's positions
        under PPO, all but the final token under a reward model) cost a whole layer's
        work otherwise, forward and backward; earlier layers still run on every position,
        whose keys and values the kept rows attend to."""
        B, L = input_ids.shape
        cache = past_key_values if past_key_values is not None else KVCache() if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + L, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(past, past + L, device=input_ids.device).expand(B, L)
        h = self.embed_tokens(input_ids)
        # RoPE angles in float32 whatever the weights' dtype, as transformers does
        # (transformers repeats the angles to head_dim: cat((freqs, freqs)); apply_rotary
        # takes the half it repeats)
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()  # each attention takes them in its dtype
        mask = attention_mask_4d(attention_mask, L)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            keep = keep_last if i == last else 0
            if self.checkpointing and self.training and torch.is_grad_enabled():
                h = recomputed_in_backward(layer, h, cos, sin, mask, cache, keep)
            else:
                h = layer(h, cos, sin, mask, cache, keep)
        return NativeOutput(last_hidden_state=self.norm(h), past_key_values=cache)
