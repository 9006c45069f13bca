"""Cluster configurations for the experiments (see lib.py): text-format
protobuf (karat.cluster.ClusterConfig) from plain dicts, the cluster config
dict and link rules."""

import math
from pathlib import Path


# ---------------------------------------------------------------------------
# Text-format protobuf (karat.cluster.ClusterConfig) from plain dicts.


def _scalar(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"not a finite number: {value}")
        return repr(value)
    if isinstance(value, (str, Path)):
        s = str(value).replace("\\", "\\\\").replace('"', '\\"')
        return f'"{s}"'
    raise TypeError(f"cannot write {value!r} in a text proto")


def to_textproto(message, indent=0):
    """A dict as text-format protobuf; lists are repeated fields, dicts are
    sub-messages, None values are left out."""
    pad = "  " * indent
    lines = []
    for key, value in message.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, dict):
                lines.append(f"{pad}{key} {{")
                body = to_textproto(v, indent + 1)
                if body:
                    lines.append(body)
                lines.append(f"{pad}}}")
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Cluster configurations.


def gpu_names(ranks):
    return [f"gpu{i}" for i in range(ranks)]


def karat_names(count):
    return [f"karat{i}" for i in range(count)]


def cluster_config(model_dir, ranks=1, karat_nodes=1, devices=2,
                   device_capacity=1 << 30, cores=1, tokens_per_page=64,
                   max_batch=64, max_step_tokens=256, threads=1, mode=None,
                   scheduling=None, links=None, hbm_bytes=None,
                   hbm_bandwidth_gbps=None, tflops=None,
                   device_bandwidth_gbps=None, device_tflops=None,
                   plaintext=False):
    """A ClusterConfig dict in the shape of deploy/local.textproto.
    `hbm_bandwidth_gbps` / `tflops`: the GPU ranks' timing model,
    `device_bandwidth_gbps` / `device_tflops` the KARAT devices' (off when
    None or 0). `plaintext`: no TLS and no credentials (security.plaintext;
    otherwise deploy/karat up makes the cluster's certificates)."""
    gpus = []
    for name in gpu_names(ranks):
        gpus.append({"name": name, "listen": "127.0.0.1:0",
                     "max_step_tokens": max_step_tokens,
                     "max_batch": max_batch, "threads": threads,
                     "hbm_bytes": hbm_bytes,
                     "hbm_bandwidth_gbps": hbm_bandwidth_gbps or None,
                     "tflops": tflops or None})
    karats = []
    for name in karat_names(karat_nodes):
        karats.append({"name": name, "listen": "127.0.0.1:0",
                       "tokens_per_page": tokens_per_page,
                       "devices": [{"capacity_bytes": int(device_capacity),
                                    "cores": cores,
                                    "bandwidth_gbps":
                                        device_bandwidth_gbps or None,
                                    "tflops": device_tflops or None}]
                       * devices})
    return {
        "model_dir": str(model_dir),
        "provider": "shm",
        "coordinator": {"listen": "127.0.0.1:0", "max_new_tokens_limit": 4096,
                        "heartbeat_interval_ms": 1000,
                        "node_timeout_ms": 5000},
        "gpu_nodes": gpus,
        "karat_nodes": karats,
        "links": links or None,
        "mode": mode,
        "scheduling": scheduling,
        "security": {"plaintext": True} if plaintext else None,
    }


def link_rules(sources, destinations, both_ways=True, **settings):
    """LinkConfig dicts from every node of `sources` to every node of
    `destinations` (not to itself), and back when `both_ways`. Settings with
    value 0 / None are left out (0 means "none" in the schema)."""
    settings = {k: v for k, v in settings.items() if v}
    if not settings:
        return []
    pairs = [(s, d) for s in sources for d in destinations if s != d]
    if both_ways:
        pairs += [(d, s) for s, d in pairs if (d, s) not in pairs]
    return [dict({"source": s, "destination": d}, **settings)
            for s, d in pairs]
