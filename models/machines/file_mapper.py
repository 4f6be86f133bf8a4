"""Where a file-backed offload tier keeps each chunk: vLLM's ``FileMapper`` against the facts its
layout promises (#22), on generated settings and keys.

* a chunk's file is ``<base>_r<rank>/<hash[:3]>/<hash[3:5]>_g<group>/<hash>.bin`` (hash in hex):
  one file per (hash, group), different keys never share a file;
* ``<base>`` is ``<root>/<model name with "/" as "_">_<12 hex digits>``, the same for every rank of
  one configuration (the rank is outside it, so workers share ``<base>/config.json``) and different
  when any stored setting differs (model, dtype, tokens per hash, blocks per file, parallel sizes,
  groups, engine);
* ``parallel_agnostic`` forces the parallel sizes to 1 and the rank to 0: every layout of the same
  model shares one folder;
* the run config is the settings as given (after that forcing).
"""

from __future__ import annotations

import re

FIELDS = ("model_name", "tokens_per_hash", "blocks_per_file", "tp_size", "pp_size", "pcp_size", "dcp_size", "dtype")


def random_fields(rng) -> dict:
    return {"model_name": rng.choice(["meta-llama/Llama-3-8B", "tiny", "org/sub/model"]),
            "tokens_per_hash": rng.choice([16, 32]), "blocks_per_file": rng.choice([1, 4]),
            "tp_size": rng.choice([1, 2, 4]), "pp_size": rng.choice([1, 2]), "pcp_size": 1,
            "dcp_size": rng.choice([1, 2]), "rank": 0, "dtype": rng.choice(["float16", "bfloat16"]),
            "kv_cache_groups": rng.choice([None, [{"tokens_per_block": 16, "layer_names": ["l0"]}]]),
            "parallel_agnostic": rng.random() < 0.3}


def check_file_mapper(rng, root: str = "/kvref-files") -> str | None:
    """None when vLLM's FileMapper keeps the layout's promises on one generated configuration."""
    from kvref.impl.vllm.file_mapper import vllm_file_mapper

    fields = random_fields(rng)
    keys = list({(rng.randbytes(32), rng.randint(0, 2)) for _ in range(6)})
    ranks = range(fields["tp_size"])
    runs = [vllm_file_mapper(root, dict(fields, rank=r), keys) for r in ranks]
    agnostic = fields["parallel_agnostic"]
    safe = fields["model_name"].replace("/", "_")
    for r, got in zip(ranks, runs):
        rank = 0 if agnostic else r
        if got["rank"] != rank:
            return f"{fields}: rank {r} maps as rank {got['rank']}"
        if not re.fullmatch(re.escape(f"{root}/{safe}_") + "[0-9a-f]{12}", got["base_path"]):
            return f"{fields}: base path {got['base_path']!r}"
        if got["base_path"] != runs[0]["base_path"]:
            return f"{fields}: ranks 0 and {r} have different base paths"
        if got["config_path"] != got["base_path"] + "/config.json":
            return f"{fields}: config path {got['config_path']!r}"
        for (h, g), name in zip(keys, got["names"]):
            x = h.hex()
            if name != f"{got['base_path']}_r{rank}/{x[:3]}/{x[3:5]}_g{g}/{x}.bin":
                return f"{fields}: key ({x[:8]}…, group {g}) -> {name!r}"
        cfg = got["run_config"]
        want = {f: (1 if agnostic and f.endswith("_size") else fields[f]) for f in FIELDS}
        if any(cfg.get(f) != v for f, v in want.items()):
            return f"{fields}: run config {cfg}"
    if len(set(runs[0]["names"])) != len(keys):
        return f"{fields}: two keys share a file"
    # one setting changed: another folder, unless it is a parallel size under parallel_agnostic
    for f, other in (("dtype", "float32"), ("tokens_per_hash", 64), ("tp_size", 8), ("model_name", "tiny2")):
        moved = vllm_file_mapper(root, dict(fields, **{f: other}), keys)["base_path"]
        if (moved == runs[0]["base_path"]) != (agnostic and f == "tp_size"):
            same = moved == runs[0]["base_path"]
            return f"{fields}: changing {f} to {other} {'keeps' if same else 'moves'} the folder"
    return None


#: the canonical byte format's id for vLLM's LBHNC (head-major) layout: format version 1, "hnd" family
CANONICAL_FORMAT_HND = "v1-hnd"


def check_spec_file_mappers(views: list[dict], cfg, groups: list[tuple[int, tuple[str, ...]]],
                            blocks_per_file: int, parallel_agnostic: bool, canonical: bool = False) -> str | None:
    """``FileMapper.from_offloading_spec`` on each rank's live spec of an OffloadingConnector world
    (``cfg``: its :class:`OffloadingConfig`; ``groups``: (tokens per block, layer names) per offloaded
    group; ``canonical``: the canonical layout, whose byte format the folder records): the run
    config carries the engine's settings, the ranks share one folder."""
    for r, v in enumerate(views):
        c = v["run_config"]
        want = {"tokens_per_hash": cfg.block_size, "blocks_per_file": blocks_per_file,
                "tp_size": 1 if parallel_agnostic else cfg.num_workers,
                "kv_cache_groups": [{"tokens_per_block": t, "layer_names": list(n)} for t, n in groups],
                "canonical_format": CANONICAL_FORMAT_HND if canonical else None}
        if any(c.get(k) != x for k, x in want.items()) or v["rank"] != (0 if parallel_agnostic else r):
            return f"rank {r} of {cfg}: file mapper run config {c} (rank {v['rank']}), expected {want}"
        if v["base_path"] != views[0]["base_path"]:
            return f"{cfg}: ranks 0 and {r} keep their chunks in different folders"
    return None
