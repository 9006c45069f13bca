"""Sizing inputs for the experiments (see lib.py): the model's weight and
KV bytes (for the emulated HBM) and the context lengths of the workload as
`karatctl bench` plans it."""

import csv
import json
import math
import re
import struct
from pathlib import Path


# ---------------------------------------------------------------------------
# The model: the GPU rank's weight bytes and the KV bytes per token, for
# sizing the emulated HBM (GpuNodeConfig.hbm_bytes).


def read_safetensors_header(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def rank_weight_bytes(model_dir, rank, ranks):
    """What a GPU rank holds, as the runtime counts it (RankWeightBytes in
    common/weights.h): every tensor as fp32, routed experts only those of
    the rank's contiguous block."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    experts = int(cfg.get("n_routed_experts", 0))
    first, last = experts * rank // ranks, experts * (rank + 1) // ranks
    header = read_safetensors_header(Path(model_dir) / "model.safetensors")
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        m = re.search(r"\.mlp\.experts\.(\d+)\.", name)
        if m and not first <= int(m.group(1)) < last:
            continue
        total += 4 * math.prod(t["shape"])
    return total


def kv_bytes_per_token(model_dir):
    """Bytes of one token's KV entry and index key over all layers (bf16 KV,
    fp8 index key plus an fp32 scale; MODEL.md, Storage)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    layers = int(c["num_hidden_layers"])
    kind = c.get("attention", {}).get("type", "mla_dsa")
    if kind == "mla_dsa":
        kv = 2 * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        index = c["index_head_dim"] + 4
        reuse = max(1, int(c.get("index_reuse_freq", 1)))
        return layers * kv + math.ceil(layers / reuse) * index
    kv_heads = int(c.get("num_key_value_heads", c["num_attention_heads"]))
    return layers * 2 * 2 * kv_heads * c["head_dim"]


# ---------------------------------------------------------------------------
# The workload as `karatctl bench` plans it (tools/karatctl/workload.h),
# for sizing only (context lengths).


def planned_context_lengths(trace, turns, scale, cap, output_scale=None):
    """Final context length of each main conversation with >= `turns`
    calls, scaled as PlanWorkload scales it (BOS + prompts + outputs)."""
    output_scale = output_scale or scale
    convs = {}
    with open(trace, newline="") as f:
        for row in csv.DictReader(f):
            if row["agent"] != "main":
                continue
            convs.setdefault(row["trace"], []).append(row)
    lengths = []
    for calls in convs.values():
        if len(calls) < turns:
            continue
        calls.sort(key=lambda r: int(r["idx"]))
        n = 1
        for r in calls[:turns]:
            n += max(1, round(int(r["new_prefill_tokens"]) / scale))
            n += max(1, min(cap, round(int(r["out"]) / output_scale)))
        lengths.append(n)
    return lengths
