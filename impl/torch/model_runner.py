"""A tiny worker: writes real K/V through slot mappings and runs paged attention for a step.

K, V and Q of a token are a fixed function of (token id, position, group, layer) — seeded random
embeddings plus a per-position term — so a prefix computed by one request is exactly what a
later request with the same prefix would compute, and a prefix-cache hit may reuse it. For each
step (``run_step``) every scheduled chunk's new tokens are written through the manager's block
tables (one batched slot mapping per group) and attended through them; ``dense_step`` computes
the same outputs over the contiguous token sequence, never touching the cache. The two agree iff
the bookkeeping is right (within :data:`~.paged_attention.TOLERANCE`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import AttentionSpec

from .block_table import slot_mapping
from .kv_cache_tensors import KVCacheTensors
from .manager import TorchKVCacheManager
from .paged_attention import AttentionMask, dense_attention, paged_attention


@dataclass(frozen=True)
class Chunk:
    """``num_tokens`` new tokens of ``request`` starting at position ``start`` (its computed tokens)."""

    request: Request
    start: int
    num_tokens: int


class TokenModel:
    """Deterministic Q/K/V per (token, position, group, layer)."""

    def __init__(self, num_groups: int, num_layers: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                 max_len: int, dtype: torch.dtype, device: torch.device, seed: int = 0, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (num_groups, num_layers)

        def table(*dims):
            return torch.randn(*shape, *dims, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)

        self.vocab = vocab
        self.q_tok, self.q_pos = table(vocab, num_q_heads, head_size), table(max_len, num_q_heads, head_size)
        self.k_tok, self.k_pos = table(vocab, num_kv_heads, head_size), table(max_len, num_kv_heads, head_size)
        self.v_tok, self.v_pos = table(vocab, num_kv_heads, head_size), table(max_len, num_kv_heads, head_size)

    def qkv(self, group: int, layer: int, tokens: torch.Tensor, positions: torch.Tensor):
        t = tokens.long() % self.vocab
        p = positions.long()
        return (self.q_tok[group, layer][t] + self.q_pos[group, layer][p],
                self.k_tok[group, layer][t] + self.k_pos[group, layer][p],
                self.v_tok[group, layer][t] + self.v_pos[group, layer][p])


class DataPathRunner:
    """Runs steps for a :class:`TorchKVCacheManager` against real memory.

    Args:
        manager: the bookkeeping; its block tables decide where tokens live.
        num_layers: attention layers per group.
        num_q_heads: query heads (a multiple of each group's ``num_kv_heads``; GQA).
        dtype: data-path dtype (float64 on CPU for near-exact checks).
        seed: the token model's seed.
    """

    def __init__(self, manager: TorchKVCacheManager, num_layers: int = 1, num_q_heads: int | None = None,
                 dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        if not isinstance(manager, TorchKVCacheManager):
            raise InvalidFieldError("manager", manager, "a TorchKVCacheManager")
        check_int("num_layers", num_layers, minimum=1)
        self.manager = manager
        cfg = manager.config
        specs = [g.kv_cache_spec for g in cfg.groups]
        if not all(isinstance(s, AttentionSpec) for s in specs):
            raise InvalidFieldError("groups", cfg.groups, "attention groups only (Mamba state: see mamba_state.py)")
        heads = {s.num_kv_heads for s in specs}
        sizes = {s.head_size for s in specs}
        if len(heads) != 1 or len(sizes) != 1:
            raise InvalidFieldError("groups", cfg.groups, "equal num_kv_heads and head_size in every group")
        self.num_kv_heads = heads.pop()
        self.head_size = sizes.pop()
        self.num_q_heads = num_q_heads or self.num_kv_heads
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidFieldError("num_q_heads", self.num_q_heads, f"a multiple of {self.num_kv_heads}")
        self.device = manager.device
        self.cache = KVCacheTensors(cfg.groups, cfg.num_blocks, num_layers, dtype, self.device)
        self.masks = [AttentionMask.for_spec(s) for s in specs]
        self.model = TokenModel(len(specs), num_layers, self.num_q_heads, self.num_kv_heads, self.head_size,
                                cfg.max_model_len + 1, dtype, self.device, seed)
        self.num_layers = num_layers

    def _flat(self, chunks: list[Chunk]):
        toks, pos, rows = [], [], []
        for i, c in enumerate(chunks):
            ids = c.request.all_token_ids[c.start:c.start + c.num_tokens]
            if len(ids) != c.num_tokens:
                raise InvalidFieldError("chunks", c, "a chunk within the request's tokens")
            toks += ids
            pos += range(c.start, c.start + c.num_tokens)
            rows += [i] * c.num_tokens
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_t(toks), as_t(pos), as_t(rows)

    def run_step(self, chunks: list[Chunk]) -> dict[tuple[int, int], torch.Tensor]:
        """Write the chunks' K/V and attend through the block tables: ``{(group, layer): [T, Hq, D]}``."""
        if not chunks:
            return {}
        toks, pos, rows = self._flat(chunks)
        rids = [c.request.request_id for c in chunks]
        ctx = torch.tensor([c.start + c.num_tokens for c in chunks], dtype=torch.long, device=self.device)
        out = {}
        for g in range(self.manager.num_groups):
            table, _ = self.manager.batch_block_tables(g, rids)
            bs = self.manager.groups[g].block_size
            slots = slot_mapping(table, pos, bs, rows)
            for layer in range(self.num_layers):
                q, k, v = self.model.qkv(g, layer, toks, pos)
                self.cache.write_kv(g, layer, slots, k, v)
                out[(g, layer)] = paged_attention(q, self.cache.kv(g, layer), table, ctx, rows, pos, self.masks[g])
        return out

    def write_only(self, chunks: list[Chunk]) -> None:
        """Store the chunks' K/V without attending: a KV connector's load of external tokens.

        Positions whose block is the null block (skipped by a window) land in block 0, which no
        masked read ever uses."""
        if not chunks:
            return
        toks, pos, rows = self._flat(chunks)
        rids = [c.request.request_id for c in chunks]
        for g in range(self.manager.num_groups):
            table, _ = self.manager.batch_block_tables(g, rids)
            slots = slot_mapping(table, pos, self.manager.groups[g].block_size, rows)
            for layer in range(self.num_layers):
                _, k, v = self.model.qkv(g, layer, toks, pos)
                self.cache.write_kv(g, layer, slots, k, v)

    def max_error(self, chunks: list[Chunk]) -> float:
        """Run the step through the cache and densely; the largest absolute difference."""
        if not chunks:
            return 0.0
        paged, dense = self.run_step(chunks), self.dense_step(chunks)
        return max(float((paged[k] - dense[k]).abs().max()) for k in paged)

    def dense_step(self, chunks: list[Chunk]) -> dict[tuple[int, int], torch.Tensor]:
        """The same outputs from the contiguous sequences (no cache involved)."""
        out: dict[tuple[int, int], list[torch.Tensor]] = {}
        for c in chunks:
            end = c.start + c.num_tokens
            all_t = torch.tensor(c.request.all_token_ids[:end], dtype=torch.long, device=self.device)
            all_p = torch.arange(end, device=self.device)
            for g in range(self.manager.num_groups):
                for layer in range(self.num_layers):
                    q, k, v = self.model.qkv(g, layer, all_t, all_p)
                    o = dense_attention(q[c.start:end], k, v, all_p[c.start:end], self.masks[g])
                    out.setdefault((g, layer), []).append(o)
        return {key: torch.cat(v) for key, v in out.items()}
