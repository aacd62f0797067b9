"""Shared by the maths tests: ragged masks, float64 draws and reference loops."""

import torch

B, T = 6, 9


def ragged_mask(seed=0, b=B, t=T, empty_row=False):
    """Right-padded mask with ragged lengths, always including a length-1 row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = 1
    lengths[1] = t
    if empty_row:
        lengths[-1] = 0
    return (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def with_garbage_padding(x, mask, value=float("nan")):
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def loop_mean(x, m):
    vals = [x[i][j].item() for i in range(x.shape[0]) for j in range(x.shape[1]) if m[i][j]]
    return sum(vals) / len(vals), vals
