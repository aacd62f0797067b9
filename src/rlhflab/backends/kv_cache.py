"""The native runtime's KV cache (``model.runtime: native``, backends/native.py)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values (B, kv_heads, T, head_dim) per layer, written into buffers that
    double in length when full; attention reads the filled part as a view.

    Growing by ``torch.cat`` every step copies the whole cache each step (O(T²) bytes per
    answer: 0.22 s of a 1.75 s sampling pass at 25M, 16 × 64 tokens, on the Intel Xeon VM);
    doubling copies it O(log T) times. (Buffers sized once for prompt + answer were tried
    on the AMD EPYC VM earlier and were no faster there, 360-400 vs 415 tokens/s.)
    """

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []

    def get_seq_length(self) -> int:
        return self.lengths[0] if self.lengths else 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append this step's k, v (B, kv_heads, t, head_dim); return all so far."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
            self.lengths.append(k.shape[2])
            return k, v
        start = self.lengths[layer]
        end = start + k.shape[2]
        if end > self.keys[layer].shape[2]:
            capacity = max(end, 2 * self.keys[layer].shape[2])
            self.keys[layer] = _grown(self.keys[layer], start, capacity)
            self.values[layer] = _grown(self.values[layer], start, capacity)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def batch_repeat_interleave(self, n: int) -> None:
        """Row i becomes rows i·n … i·n+n−1 (one prompt, n continuations)."""
        self.keys = [k.repeat_interleave(n, 0) for k in self.keys]
        self.values = [v.repeat_interleave(n, 0) for v in self.values]

    def rows(self, rows: torch.Tensor, length: int) -> KVCache:
        """A new cache holding rows ``rows`` (int64) and the first ``length`` positions of
        this one, copied (the opener probe keeps a rollout's prompts this way)."""
        out = KVCache()
        out.keys = [k[rows, :, :length] for k in self.keys]
        out.values = [v[rows, :, :length] for v in self.values]
        out.lengths = [length] * len(self.keys)
        return out


def _grown(buffer: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
    """A (B, heads, capacity, d) buffer holding ``buffer``'s first ``filled`` positions."""
    B, H, _, D = buffer.shape
    out = buffer.new_empty(B, H, capacity, D)
    out[:, :, :filled] = buffer[:, :, :filled]
    return out
