"""Mamba-style recurrent state kept in its block: the data path only.

A Mamba group's page holds one request's recurrent state (``MambaSpec.shapes[0]``), not per-token
K/V. Each chunk of a request reads the state from the request's block, runs the recurrence
``h_t = a * h_{t-1} + x_t`` (a diagonal linear SSM, enough to make the state carry the whole
history) over the chunk, and writes the last state back. Processing a sequence in any chunking
must give the same outputs as one scan over the whole sequence; a request reading another
request's block (or a stale block) does not.

The torch bookkeeping models Mamba groups without prefix caching (vLLM gives them one block per
request, block size >= ``max_model_len``); ``DataPathRunner`` keeps the state in block table
entry 0. Mamba "align" mode (prefix-cached states, checkpoints, copy-on-write) is not modelled.
"""

from __future__ import annotations

import torch

from kvref.spec.errors import InvalidFieldError, check_int

from .kv_cache_tensors import KVCacheTensors


def scan(decay: torch.Tensor, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """All states ``h_1..h_T`` of ``h_t = decay * h_{t-1} + x_t`` from ``h0`` (``x``: ``[T, *shape]``)."""
    out = torch.empty_like(x)
    h = h0
    for t in range(x.shape[0]):
        h = decay * h + x[t]
        out[t] = h
    return out


class MambaStateRunner:
    """Runs chunks of a Mamba group layer against its state blocks in ``cache``."""

    def __init__(self, cache: KVCacheTensors, group_id: int, layer: int = 0, seed: int = 0) -> None:
        if not isinstance(cache, KVCacheTensors):
            raise InvalidFieldError("cache", cache, "a KVCacheTensors")
        self.cache = cache
        self.group_id = group_id
        self.layer = layer
        self.states = cache.state(group_id, layer)  # validates the group is a MambaSpec
        g = torch.Generator().manual_seed(seed)
        shape = self.states.shape[1:]
        self.decay = (0.5 + 0.5 * torch.rand(shape, generator=g, dtype=torch.float64)).to(cache.dtype).to(cache.device)

    def reset(self, block_id: int) -> None:
        """A new request starts from the zero state (vLLM zeroes new Mamba blocks)."""
        check_int("block_id", block_id, minimum=1)
        self.states[block_id].zero_()

    def run_chunk(self, block_id: int, x: torch.Tensor) -> torch.Tensor:
        """Advance the state in ``block_id`` over ``x`` (``[T, *shape]``); return the chunk's states."""
        check_int("block_id", block_id, minimum=1)
        if block_id >= self.cache.num_blocks:
            raise InvalidFieldError("block_id", block_id, f"< {self.cache.num_blocks}")
        x = x.to(self.cache.dtype).to(self.cache.device)
        out = scan(self.decay, x, self.states[block_id].clone())
        if x.shape[0]:
            self.states[block_id] = out[-1]
        return out
