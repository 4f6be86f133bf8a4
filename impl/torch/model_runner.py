"""A tiny worker: writes real K/V through slot mappings and runs paged attention for a step.

K, V and Q of a token are a fixed function of (token id, position, group, layer) — seeded random
embeddings plus a per-position term — so a prefix computed by one request is exactly what a
later request with the same prefix would compute, and a prefix-cache hit may reuse it. For each
step (``run_step``) every scheduled chunk's new tokens are written through the manager's block
tables (one batched slot mapping per group) and attended through them; ``dense_step`` computes
the same outputs over the contiguous token sequence, never touching the cache. The two agree iff
the bookkeeping is right (within :data:`~.paged_attention.TOLERANCE`).

``attention_backend`` picks who runs the hot operations (the K/V write and paged attention):
``"torch"`` (default; gather + matmul, the oracle-like path) or ``"triton"`` (the kernels in
:mod:`.triton_kernels`, compiled on CUDA, interpreted on CPU with ``TRITON_INTERPRET=1``). The
dense recomputation is torch either way, so a bookkeeping fault shows up as wrong numbers
through either back-end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import AttentionSpec, MambaSpec

from .block_table import slot_mapping
from .kv_cache_tensors import KVCacheTensors
from .mamba_state import MambaStateRunner, scan
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

    VOCAB = 64

    def __init__(self, num_groups: int, num_layers: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                 max_len: int, dtype: torch.dtype, device: torch.device, seed: int = 0, vocab: int = VOCAB) -> None:
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
        attention_backend: ``"torch"`` or ``"triton"`` (raises ``TritonUnavailableError``, a
            ``ValueError``, when triton cannot run here).
    """

    def __init__(self, manager: TorchKVCacheManager, num_layers: int = 1, num_q_heads: int | None = None,
                 dtype: torch.dtype = torch.float64, seed: int = 0, attention_backend: str = "torch") -> None:
        if not isinstance(manager, TorchKVCacheManager):
            raise InvalidFieldError("manager", manager, "a TorchKVCacheManager")
        from .kv_cache_tensors import MAX_LAYERS

        check_int("num_layers", num_layers, minimum=1)
        if num_layers > MAX_LAYERS:
            raise InvalidFieldError("num_layers", num_layers, f"an int in [1, {MAX_LAYERS}]")
        check_int("seed", seed, minimum=0)
        if seed >= 1 << 63:
            raise InvalidFieldError("seed", seed, f"an int in [0, {(1 << 63) - 1}]")
        self.attention_backend = _check_backend(attention_backend, manager.device)
        self.manager = manager
        cfg = manager.config
        specs = [g.kv_cache_spec for g in cfg.groups]
        attn = [s for s in specs if isinstance(s, AttentionSpec)]
        for i, s in enumerate(specs):
            if isinstance(s, MambaSpec) and s.block_size < cfg.max_model_len:
                # Without prefix caching vLLM gives a Mamba group one block per request
                # (block_size >= max_model_len); the state then never moves.
                raise InvalidFieldError(f"groups[{i}].kv_cache_spec.block_size", s.block_size,
                                        f">= max_model_len={cfg.max_model_len} (one state block per request)")
            if not isinstance(s, (AttentionSpec, MambaSpec)):
                raise InvalidFieldError(f"groups[{i}].kv_cache_spec", type(s).__name__, "attention or Mamba")
        if not attn:
            raise InvalidFieldError("groups", cfg.groups, "at least one attention group")
        heads = {s.num_kv_heads for s in attn}
        sizes = {s.head_size for s in attn}
        if len(heads) != 1 or len(sizes) != 1:
            raise InvalidFieldError("groups", cfg.groups, "equal num_kv_heads and head_size in every group")
        self.num_kv_heads = heads.pop()
        self.head_size = sizes.pop()
        check_int("num_q_heads", num_q_heads, minimum=1, allow_none=True)
        if num_q_heads is not None and num_q_heads > 4096:
            raise InvalidFieldError("num_q_heads", num_q_heads, "an int in [1, 4096] or None")
        self.num_q_heads = num_q_heads or self.num_kv_heads
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidFieldError("num_q_heads", self.num_q_heads, f"a multiple of {self.num_kv_heads}")
        self.device = manager.device
        self.cache = KVCacheTensors(cfg.groups, cfg.num_blocks, num_layers, dtype, self.device)
        self.masks = [AttentionMask.for_spec(s) if isinstance(s, AttentionSpec) else None for s in specs]
        #: Mamba groups: a recurrent state per (group, layer), input = a token/position embedding
        self.mamba = {(g, layer): MambaStateRunner(self.cache, g, layer, seed=seed + 7 * g + layer)
                      for g, s in enumerate(specs) if isinstance(s, MambaSpec) for layer in range(num_layers)}
        gen = torch.Generator().manual_seed(seed + 1)
        self.mamba_in = {key: torch.randn((TokenModel.VOCAB, *r.states.shape[1:]), generator=gen,
                                          dtype=torch.float64).to(dtype).to(self.device)
                         for key, r in self.mamba.items()}
        self.model = TokenModel(len(specs), num_layers, self.num_q_heads, self.num_kv_heads, self.head_size,
                                cfg.max_model_len + 1, dtype, self.device, seed)
        self.num_layers = num_layers

    def _write(self, g: int, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.attention_backend == "triton":
            from .triton_kernels.write_kv import write_kv_triton

            return write_kv_triton(self.cache.kv(g, layer), slots, k, v)
        self.cache.write_kv(g, layer, slots, k, v)

    def _attend(self, g: int, layer: int, q, table, ctx, rows, pos) -> torch.Tensor:
        attend = paged_attention
        if self.attention_backend == "triton":
            from .triton_kernels.attention import paged_attention_triton as attend
        return attend(q, self.cache.kv(g, layer), table, ctx, rows, pos, self.masks[g])

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
            if self.masks[g] is None:
                for layer in range(self.num_layers):
                    out[(g, layer)] = self._mamba_step(g, layer, chunks, table, toks)
                continue
            bs = self.manager.groups[g].block_size
            slots = slot_mapping(table, pos, bs, rows)
            for layer in range(self.num_layers):
                q, k, v = self.model.qkv(g, layer, toks, pos)
                self._write(g, layer, slots, k, v)
                out[(g, layer)] = self._attend(g, layer, q, table, ctx, rows, pos)
        return out

    def _mamba_step(self, g: int, layer: int, chunks: list[Chunk], table: torch.Tensor,
                    toks: torch.Tensor) -> torch.Tensor:
        """Advance each request's state, kept in its state block (table entry 0)."""
        runner = self.mamba[(g, layer)]
        x_all = self.mamba_in[(g, layer)][toks % TokenModel.VOCAB]
        outs, at = [], 0
        for i, c in enumerate(chunks):
            block = int(table[i, 0])
            if c.start == 0:
                runner.reset(block)  # a new (or recomputed) request starts from the zero state
            outs.append(runner.run_chunk(block, x_all[at:at + c.num_tokens]))
            at += c.num_tokens
        return torch.cat(outs)

    def write_only(self, chunks: list[Chunk]) -> None:
        """Store the chunks' K/V without attending: a KV connector's load of external tokens.

        Positions whose block is the null block (skipped by a window) land in block 0, which no
        masked read ever uses."""
        if not chunks:
            return
        toks, pos, rows = self._flat(chunks)
        rids = [c.request.request_id for c in chunks]
        for g in range(self.manager.num_groups):
            if self.masks[g] is None:
                raise InvalidFieldError("chunks", chunks, "no connector loads into a pool with Mamba groups")
            table, _ = self.manager.batch_block_tables(g, rids)
            slots = slot_mapping(table, pos, self.manager.groups[g].block_size, rows)
            for layer in range(self.num_layers):
                _, k, v = self.model.qkv(g, layer, toks, pos)
                self._write(g, layer, slots, k, v)

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
                    if self.masks[g] is None:
                        runner = self.mamba[(g, layer)]
                        x = self.mamba_in[(g, layer)][all_t % TokenModel.VOCAB]
                        h0 = torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)
                        out.setdefault((g, layer), []).append(scan(runner.decay, x, h0)[c.start:end])
                        continue
                    q, k, v = self.model.qkv(g, layer, all_t, all_p)
                    o = dense_attention(q[c.start:end], k, v, all_p[c.start:end], self.masks[g])
                    out.setdefault((g, layer), []).append(o)
        return {key: torch.cat(v) for key, v in out.items()}


def _check_backend(name, device) -> str:
    """Validate ``attention_backend`` and, for ``"triton"``, that the kernels can run on ``device``."""
    from .triton_kernels import check_backend, require_triton

    check_backend("attention_backend", name)
    if name == "triton":
        require_triton(device)
    return name
