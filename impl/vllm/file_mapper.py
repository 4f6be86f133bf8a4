"""vLLM 0.33.0's ``FileMapper`` (``v1/kv_offload/file_mapper.py``: where a file-backed offload tier
keeps each offloaded chunk) driven with generated settings and keys, its answers as plain data for
:mod:`kvref.models.machines.file_mapper`'s properties."""

from __future__ import annotations

from typing import Any


def vllm_file_mapper(root_dir: str, fields: dict[str, Any], keys: list[tuple[bytes, int]]) -> dict[str, Any]:
    """``FileMapper(root_dir, **fields)``: its base path, config path, run config, and the file
    name of every ``(block hash, group)`` key."""
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.file_mapper import FileMapper

    m = FileMapper(root_dir, **fields)
    return {"base_path": m.base_path, "config_path": m.get_config_file_path(), "run_config": m.get_run_config(),
            "rank": m.rank, "names": [m.get_file_name(make_offload_key(h, g)) for h, g in keys]}


def vllm_file_mapper_from_spec(root_dir: str, spec: Any, blocks_per_file: int, parallel_agnostic: bool) -> dict:
    """``FileMapper.from_offloading_spec`` for a live ``OffloadingSpec`` (its run config and base path)."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    m = FileMapper.from_offloading_spec(root_dir, spec, blocks_per_file=blocks_per_file,
                                        parallel_agnostic=parallel_agnostic)
    return {"base_path": m.base_path, "run_config": m.get_run_config(), "rank": m.rank}
