"""Per-group block tables as int32 tensors on the device, plus batched slot mappings.

One :class:`BlockTables` per KV cache group: a ``[rows, width]`` int32 tensor, one row per live
request, and the row's length. Entry ``j`` of a row is the block holding the request's tokens
``[j*block_size, (j+1)*block_size)``; 0 (the null block) marks a position whose block was freed
(outside a sliding window / local chunk) or skipped by a prefix hit. This is the same
position-indexed table vLLM hands the workers (``req_to_blocks`` on the scheduler side).
"""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, width: int, device: torch.device, rows: int = 8) -> None:
        self.width = max(width, 1)
        self.device = device
        self.table = torch.zeros((rows, self.width), dtype=torch.int32, device=device)
        self.length = torch.zeros(rows, dtype=torch.int32, device=device)
        self._row: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        self._len: dict[str, int] = {}  # host mirror of ``length`` for the rows in use
        # Null entries always form a prefix of a row (skipped hits, then out-of-window frees from
        # the front), so one count per row says where the live blocks start.
        self._null_head: dict[str, int] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

    def _ensure_row(self, request_id: str) -> int:
        row = self._row.get(request_id)
        if row is not None:
            return row
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.length = torch.cat([self.length, torch.zeros_like(self.length)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row[request_id] = row
        self._len[request_id] = 0
        self._null_head[request_id] = 0
        self.length[row] = 0
        return row

    def num_blocks(self, request_id: str) -> int:
        return self._len.get(request_id, 0)

    def get(self, request_id: str) -> list[int]:
        row = self._row.get(request_id)
        if row is None:
            return []
        return self.table[row, : self._len[request_id]].tolist()

    def extend(self, request_id: str, block_ids: list[int]) -> None:
        row = self._ensure_row(request_id)
        n = self._len[request_id]
        if n + len(block_ids) > self.width:
            grow = max(self.width, n + len(block_ids) - self.width)
            self.table = torch.cat([self.table, torch.zeros((self.table.shape[0], grow),
                                                            dtype=torch.int32, device=self.device)], 1)
            self.width += grow
        if block_ids:
            self.table[row, n:n + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32,
                                                                 device=self.device)
            if self._null_head[request_id] == n:
                lead = 0
                while lead < len(block_ids) and block_ids[lead] == 0:
                    lead += 1
                self._null_head[request_id] = n + lead
        self._len[request_id] = n + len(block_ids)
        self.length[row] = n + len(block_ids)

    def slice(self, request_id: str, start: int, end: int) -> list[int]:
        row = self._row.get(request_id)
        if row is None:
            return []
        return self.table[row, start:min(end, self._len[request_id])].tolist()

    def null_head(self, request_id: str) -> int:
        """Length of the row's leading run of null blocks."""
        return self._null_head.get(request_id, 0)

    def clear_front(self, request_id: str, end: int) -> list[int]:
        """Null the live entries before ``end``; return the block ids they held (in order)."""
        row = self._row[request_id]
        head = self._null_head[request_id]
        end = min(end, self._len[request_id])
        if end <= head:
            return []
        ids = self.table[row, head:end].tolist()
        self.table[row, head:end] = 0
        self._null_head[request_id] = end
        return ids

    def touch_row(self, request_id: str) -> None:
        """Create an empty row (vLLM's ``defaultdict`` entry) without blocks."""
        self._ensure_row(request_id)

    def pop(self, request_id: str) -> list[int]:
        row = self._row.pop(request_id, None)
        if row is None:
            return []
        ids = self.table[row, : self._len.pop(request_id)].tolist()
        self._null_head.pop(request_id, None)
        self.table[row].zero_()
        self.length[row] = 0
        self._free_rows.append(row)
        return ids

    def request_ids(self) -> list[str]:
        return list(self._row)

    # ----------------------------------------------------------------- batched views
    def batch(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table [B, W] int32, lengths [B] int32)`` for the requests of one step."""
        rows = torch.tensor([self._row[r] for r in request_ids], dtype=torch.int64, device=self.device)
        return self.table.index_select(0, rows), self.length.index_select(0, rows)

    def check_invariants(self) -> None:
        """M6 (the leading nulls are the skipped prefix) and D1 (the tensors mirror the bookkeeping),
        docs/invariants.md."""
        for rid, row in self._row.items():
            assert int(self.length[row]) == self._len[rid], f"D1: length mirror drifted for {rid}"
            ids = self.table[row, : self._len[rid]]
            head = self._null_head[rid]
            assert bool((ids[:head] == 0).all()) and bool((ids[head:] != 0).all()), \
                f"M6: nulls of {rid} are not exactly its first {head} entries"
        assert len(set(self._row.values())) == len(self._row), "D1: two requests share a row"


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int,
                 row_of_token: torch.Tensor) -> torch.Tensor:
    """Slot of each token: ``table[row, pos // bs] * bs + pos % bs`` (int64, batched, on device).

    ``row_of_token[i]`` is the batch row of token ``i`` and ``positions[i]`` its position in its
    request. The slot is the flat index of the token in a ``[num_blocks * block_size]`` view of a
    layer's K (or V) cache; a token whose block is the null block maps into block 0.
    """
    blocks = block_table[row_of_token.long(), torch.div(positions, block_size, rounding_mode="floor").long()]
    return blocks.long() * block_size + positions.long() % block_size
