"""Shared machinery of the experiments under deploy/experiments/.

Each experiment is a list of *points*. A point is one cluster configuration
(a ClusterConfig text proto written into the point's run directory) and one
`karatctl bench` workload. For every point the runner

  1. writes the configuration to run/experiments/<name>/points/<label>/,
  2. starts the cluster with `deploy/karat up --config ... --run-dir ...`,
  3. scrapes `karatctl metrics` (before), runs `karatctl bench --json`,
     scrapes `karatctl metrics` again (after),
  4. stops the cluster with `deploy/karat down` -- always, also when a step
     fails or on Ctrl-C / SIGTERM,

and returns one row (a dict). The experiment then writes results.csv,
results.md and plot.png into run/experiments/<name>/.

Metric names come from the metrics output: a name the cluster does not
report yet leaves the cell empty and is listed as "metric X not reported"
on stderr and in results.md.

Runs under /usr/bin/python3 (numpy and matplotlib are needed only for the
plot).
"""

import argparse
import csv
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "deploy" / "traces" / "kvcache-tester-main-sample.csv"
DEFAULT_MODEL_DIR = REPO / "run" / "models" / "dsa-tiny"


def log(message):
    print(f"experiment: {message}", file=sys.stderr, flush=True)


class ExperimentError(Exception):
    """A point could not be run (cluster did not start, bench crashed...)."""


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


# ---------------------------------------------------------------------------
# Prometheus text (`karatctl metrics`).

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _normal(name):
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _series_key(labels):
    """Which series a sample belongs to: its node, else its other labels
    ("rank=0"), else "" (a cluster-wide value, e.g. the coordinator's)."""
    if "node" in labels:
        return labels["node"]
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())
                    if k not in ("name", "le", "quantile"))


class Metrics:
    """Samples of one scrape: (metric name, labels, value)."""

    def __init__(self, text=""):
        self.text = text
        self.samples = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            labels = dict(_LABEL.findall(m.group(2) or ""))
            self.samples.append((m.group(1), labels, value))

    def stat(self, key):
        """{series: value} of the stat `key`: a gauge labelled name="key"
        (how `karatctl metrics` exports a node's stats map), else a metric
        named `key` with a karat_ prefix ('.' read as '_', e.g.
        karat_coordinator_<key>). A series is a node, else the other labels
        ("rank=0"), else "" (cluster-wide); samples of one node with other
        labels (device, peer) are summed. Empty when nothing reports it."""
        want = _normal(key)
        out = {}
        for name, labels, value in self.samples:
            if "le" in labels or "quantile" in labels:
                continue
            if "name" in labels:
                hit = labels["name"] == key
            else:
                n = _normal(name)
                hit = n == want or (n.startswith("karat") and n.endswith(want))
                if name.endswith(("_bucket", "_count", "_sum")):
                    hit = hit and n == want
            if hit:
                out[_series_key(labels)] = out.get(_series_key(labels), 0.0) \
                    + value
        return out

    def scalar(self, key):
        """The value of `key` for the whole cluster: its sample without
        labels (the coordinator's), else the mean over the series that
        report it; None when none does."""
        series = self.stat(key)
        if not series:
            return None
        if "" in series:
            return series[""]
        return sum(series.values()) / len(series)

    def stat_matching(self, pattern):
        """{stat name: {node: value}} of every stat whose name matches the
        regular expression (on the `name` label, else the metric name)."""
        rx = re.compile(pattern)
        out = {}
        for name, labels, value in self.samples:
            key = labels.get("name", name)
            if "le" in labels or not rx.search(key):
                continue
            out.setdefault(key, {})[_series_key(labels)] = value
        return out

    def nodes(self):
        return sorted({l.get("node", "") for _, l, _ in self.samples} - {""})


# ---------------------------------------------------------------------------
# Running points.


class MissingMetrics:
    """Collects "metric X not reported" once per name."""

    def __init__(self):
        self.names = []

    def note(self, name, why="not reported"):
        line = f"metric {name} {why}"
        if line not in self.names:
            self.names.append(line)
            log(line)


class Runner:
    def __init__(self, name, args):
        self.name = name
        self.args = args
        self.out_dir = Path(args.out_dir
                            or REPO / "run" / "experiments" / name)
        self.points_dir = self.out_dir / "points"
        self.build_dir = Path(args.build_dir or os.environ.get(
            "KARAT_BUILD_DIR", REPO / "build")).resolve()
        self.karatctl = Path(args.karatctl
                             or self.build_dir / "bin" / "karatctl")
        self.trace = Path(args.trace or DEFAULT_TRACE)
        self.model_dir = Path(args.model_dir or DEFAULT_MODEL_DIR).resolve()
        self.missing = MissingMetrics()
        self.failures = []
        self.notes = []  # lines for results.md
        self._active_run_dir = None
        # Extra environment for `deploy/karat up`, e.g. KARAT_CPUS_GPU.
        self.daemon_env = {}

    # -- helpers -----------------------------------------------------------

    def check_tools(self):
        for b in ("karat-coordinator", "karat-gpu-node", "karat-node",
                  "karatctl", "karat-weights"):
            if not (self.build_dir / "bin" / b).exists():
                raise SystemExit(
                    f"experiment: {self.build_dir}/bin/{b} is missing; run "
                    f"deploy/karat build (or pass --build-dir)")
        if not self.karatctl.exists():
            raise SystemExit(f"experiment: no karatctl at {self.karatctl}")
        if not self.trace.exists():
            raise SystemExit(f"experiment: no trace at {self.trace}")
        probe = subprocess.run([str(self.karatctl), "--help"],
                               capture_output=True, text=True)
        if "--concurrency" not in probe.stdout:
            raise SystemExit(
                f"experiment: {self.karatctl} has no `bench --concurrency`; "
                f"rebuild karatctl")

    def ensure_model(self):
        """Generates the weights once, before the first point (so that no
        point's start-up time includes it)."""
        if (self.model_dir / "config.json").exists() and \
                (self.model_dir / "model.safetensors").exists():
            return
        preset = self.args.preset
        log(f"generating {preset} weights into {self.model_dir}")
        self.model_dir.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(self.build_dir / "bin" / "karat-weights"),
                        "--preset", preset, "--seed", "1",
                        "--out", str(self.model_dir)], check=True)

    def _karat(self, *argv, log_file=None):
        env = dict(os.environ, KARAT_BUILD_DIR=str(self.build_dir),
                   **self.daemon_env)
        cmd = [str(REPO / "deploy" / "karat"), *map(str, argv)]
        if log_file is None:
            return subprocess.run(cmd, env=env)
        with open(log_file, "a") as f:
            return subprocess.run(cmd, env=env, stdout=f, stderr=f)

    def _ctl(self, run_dir, *argv, timeout=None, **kw):
        # TLS from the run directory's tls/ (deploy/karat up made it), or a
        # cluster whose config says security.plaintext.
        tls = Path(run_dir) / "tls"
        security = (["--tls-dir", str(tls)] if (tls / "ca.crt").exists()
                    else ["--plaintext"])
        cmd = [str(self.karatctl), "--addr-file",
               str(Path(run_dir) / "coordinator.addr"), *security,
               *map(str, argv)]
        return subprocess.run(cmd, timeout=timeout, **kw)

    def scrape(self, run_dir, path):
        r = self._ctl(run_dir, "metrics", capture_output=True, text=True,
                      timeout=30)
        Path(path).write_text(r.stdout + (
            f"# karatctl metrics failed: {r.stderr}" if r.returncode else ""))
        if r.returncode != 0:
            self.missing.note("(all)", f"unavailable: karatctl metrics exited "
                              f"{r.returncode}: {r.stderr.strip()}")
            return Metrics("")
        return Metrics(r.stdout)

    def down(self, run_dir):
        # A second Ctrl-C must not leave the cluster running: `down` is
        # bounded (SIGKILL 10 s after SIGTERM), so let it finish.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self._karat("down", "--run-dir", run_dir,
                        log_file=Path(run_dir) / "karat-up-down.log")
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

    # -- one point ---------------------------------------------------------

    def run_point(self, label, config, bench):
        """Starts the cluster of `config`, runs the bench (flags as a dict:
        sessions, turns, scale, max-new-tokens-cap, concurrency, seed,
        tbt-slo-ms...), stops the cluster. Returns (bench report dict,
        metrics before, metrics after, point dir). Raises ExperimentError
        when the point could not run."""
        point = self.points_dir / label
        if point.exists():
            self.down(point)  # a cluster left over by a killed earlier run
            shutil.rmtree(point)
        point.mkdir(parents=True)
        config_path = point / "cluster.textproto"
        config_path.write_text(
            f"# {self.name} / {label} (written by deploy/experiments)\n"
            + to_textproto(config) + "\n")
        log(f"{label}: starting the cluster ({config_path})")
        self._active_run_dir = point
        try:
            up = self._karat("up", "--config", config_path, "--run-dir", point,
                             log_file=point / "karat-up-down.log")
            if up.returncode != 0:
                text = (point / "karat-up-down.log").read_text()
                log(f"{label}: last lines of {point}/karat-up-down.log:\n"
                    + text[-1500:])
                raise ExperimentError(
                    f"{label}: deploy/karat up failed (exit {up.returncode}): "
                    f"{_reason(text)}")
            before = self.scrape(point, point / "metrics-before.prom")
            json_path = point / "bench.json"
            argv = ["bench", "--trace", self.trace, "--json", json_path]
            for k, v in bench.items():
                if v is not None:
                    argv += [f"--{k}", v]
            log(f"{label}: karatctl {' '.join(map(str, argv[:1] + argv[5:]))}")
            start = time.monotonic()
            with open(point / "bench.log", "w") as out:
                try:
                    r = self._ctl(point, *argv, stdout=out,
                                  stderr=subprocess.STDOUT,
                                  timeout=self.args.bench_timeout)
                except subprocess.TimeoutExpired:
                    raise ExperimentError(
                        f"{label}: bench ran past {self.args.bench_timeout} s "
                        f"(--bench-timeout); see {point}/bench.log")
            elapsed = time.monotonic() - start
            if r.returncode not in (0, 1) or not json_path.exists():
                text = (point / "bench.log").read_text()
                log(f"{label}: last lines of {point}/bench.log:\n"
                    + text[-1500:])
                raise ExperimentError(
                    f"{label}: bench failed (exit {r.returncode}): "
                    f"{_reason(text)}")
            report = json.loads(json_path.read_text())
            # The nodes' stats reach the coordinator with their heartbeats
            # (every heartbeat_interval_ms, 1 s here): wait for the ones
            # that cover the end of the bench.
            time.sleep(2.5)
            after = self.scrape(point, point / "metrics-after.prom")
            log(f"{label}: {report['generated_tokens']} tokens in "
                f"{elapsed:.1f} s, {report['throughput_tokens_per_s']:.1f} "
                f"tokens/s, TBT p99 {report['tbt_ms_p99']:.1f} ms, "
                f"{report['errors']} failed turns")
            return report, before, after, point
        finally:
            self.down(point)
            self._active_run_dir = None

    def try_point(self, label, config, bench, row):
        """run_point, but a failure becomes row["status"] and the
        experiment goes on (the failure is reported at the end)."""
        try:
            result = self.run_point(label, config, bench)
            report = result[0]
            codes = ", ".join(f"{c} {n}" for c, n in sorted(
                report.get("errors_by_code", {}).items()))
            row["status"] = "ok" if report["errors"] == 0 else \
                f"{report['errors']} turns failed ({codes})"
            for sample in report.get("error_samples", [])[:1]:
                self.notes.append(f"{label}: e.g. {sample}")
            return result
        except ExperimentError as e:
            log(str(e))
            row["status"] = "failed"
            self.failures.append(str(e).splitlines()[0])
            return None

    # -- metrics -----------------------------------------------------------

    def stat_sum(self, before, after, key, nodes=None, counter=True):
        """Sum over `nodes` (all when None) of stat `key`: the change
        between the scrapes for a counter, the last value otherwise. None
        (and a "not reported" note) when no node reports it."""
        a = after.stat(key)
        if nodes is not None:
            a = {n: v for n, v in a.items() if n in nodes}
        if not a:
            self.missing.note(key)
            return None
        b = before.stat(key) if counter else {}
        return sum(v - b.get(n, 0.0) for n, v in a.items())

    def find_stat(self, after, candidates, pattern, nodes=None):
        """The first of `candidates` that is reported, else the first stat
        whose name matches `pattern`: (name, {node: value}) or (None, {})."""
        for key in candidates:
            v = after.stat(key)
            if nodes is not None:
                v = {n: x for n, x in v.items() if n in nodes}
            if v:
                return key, v
        for key, v in sorted(after.stat_matching(pattern).items()):
            if nodes is not None:
                v = {n: x for n, x in v.items() if n in nodes}
            if v:
                return key, v
        self.missing.note(" / ".join(candidates))
        return None, {}

    def link_traffic(self, before, after, senders, is_peer, what):
        """Over the data-plane links from a node in `senders` to a peer for
        which is_peer(peer) holds: (megabytes sent during the bench, the
        largest per-link send latency p50 in us). None for what no node
        reports (noted as `what`)."""
        p50, sent, found = [], 0.0, False
        for name, labels, value in after.samples:
            node, peer = labels.get("node"), labels.get("peer")
            if node not in senders or peer is None or not is_peer(peer):
                continue
            if name == "karat_link_latency_us_p50":
                p50.append(value)
            elif name == "karat_link_bytes_total":
                found = True
                b = [v for n, l, v in before.samples if n == name
                     and l.get("node") == node and l.get("peer") == peer]
                sent += value - (b[0] if b else 0.0)
        if not found:
            self.missing.note(f"link bytes {what}",
                              "not reported (no traffic on these links)")
        return (sent / 1e6 if found else None), (max(p50) if p50 else None)

    # -- output ------------------------------------------------------------

    def write_results(self, rows, columns, title, intro, summary_lines,
                      plot, notes=()):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        csv_path = self.out_dir / "results.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[c for c, _ in columns],
                               extrasaction="ignore")
            w.writeheader()
            for row in rows:
                w.writerow({c: _csv_cell(row.get(c)) for c, _ in columns})
        md = [f"# {title}", "", intro, ""]
        md.append("| " + " | ".join(h for _, h in columns) + " |")
        md.append("|" + "|".join(" --- " for _ in columns) + "|")
        for row in rows:
            md.append("| " + " | ".join(_md_cell(row.get(c))
                                        for c, _ in columns) + " |")
        md.append("")
        if summary_lines:
            md += summary_lines + [""]
        extra = list(notes) + self.notes + self.missing.names + [
            f"point failed: {f}" for f in self.failures]
        if extra:
            md += ["Notes:", ""] + [f"* {n}" for n in extra] + [""]
        md.append(f"Per-point configs, logs, bench.json and metric scrapes: "
                  f"`{_rel(self.points_dir)}/`. "
                  f"Command: `{' '.join(sys.argv)}`.")
        md_path = self.out_dir / "results.md"
        md_path.write_text("\n".join(md) + "\n")
        png = self.out_dir / "plot.png"
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig = plot(plt, rows)
            fig.tight_layout()
            fig.savefig(png, dpi=120)
            plt.close(fig)
        except ImportError as e:
            log(f"no plot ({e}): install python3-matplotlib "
                f"(apt-get) and run with /usr/bin/python3")
            png = None
        log(f"wrote {_rel(csv_path)}, {_rel(md_path)}"
            + (f", {_rel(png)}" if png else ""))
        print((md_path).read_text())


def _reason(log_text):
    """The line of a log that says why it failed: the last one naming an
    error, else the last line."""
    lines = [l.strip() for l in log_text.splitlines() if l.strip()]
    for line in reversed(lines):
        if re.search(r"error|refused|failed|exited|did not", line, re.I):
            return line[-400:]
    return lines[-1][-400:] if lines else "(empty log)"


def _rel(p):
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def _csv_cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def _md_cell(v):
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e9:
            return str(int(v))
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def bench_columns(report):
    """The row cells every experiment takes from bench.json (latencies
    empty when no turn produced them)."""
    def latency(key, have):
        return report[key] if have else None
    ttft = report["turns_ok"] > 0
    tbt = report["generated_tokens"] > report["turns_ok"]
    return {"throughput": report["throughput_tokens_per_s"],
            "ttft_p50_ms": latency("ttft_ms_p50", ttft),
            "ttft_p99_ms": latency("ttft_ms_p99", ttft),
            "tbt_p50_ms": latency("tbt_ms_p50", tbt),
            "tbt_p90_ms": latency("tbt_ms_p90", tbt),
            "tbt_p99_ms": latency("tbt_ms_p99", tbt),
            "generated_tokens": report["generated_tokens"],
            "wall_s": report["wall_s"],
            "failed_turns": report["errors"]}


def mean(xs):
    """Mean of the values that are present; None when there are none."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def nan_mean(xs):
    """mean() for plotting: NaN (a gap) when nothing is present."""
    m = mean(xs)
    return float("nan") if m is None else m


def median(xs):
    """Median of the values that are present (robust to a run slowed by
    the rest of the machine); None when there are none."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def nan_median(xs):
    """median() for plotting: NaN (a gap) when nothing is present."""
    m = median(xs)
    return float("nan") if m is None else m


# ---------------------------------------------------------------------------
# Command line and lifetime.


def parser(description, name):
    p = argparse.ArgumentParser(
        prog=f"deploy/experiments/{name}", description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: fewer points, fewer sessions and tokens")
    p.add_argument("--build-dir", help="binaries (default: $KARAT_BUILD_DIR "
                   "or ./build); its bin/ must hold the daemons and karatctl")
    p.add_argument("--karatctl", help="karatctl for bench and metrics "
                   "(default: BUILD_DIR/bin/karatctl)")
    p.add_argument("--out-dir", help=f"default: run/experiments/{name}")
    p.add_argument("--trace", help=f"default: {_rel(DEFAULT_TRACE)}")
    p.add_argument("--model-dir", help=f"default: {_rel(DEFAULT_MODEL_DIR)}")
    p.add_argument("--preset", default="dsa-tiny",
                   help="weights preset when the model dir is empty")
    p.add_argument("--sessions", type=int, help="sessions per point")
    p.add_argument("--turns", type=int, help="turns per session (<= 8 with "
                   "the sample trace)")
    p.add_argument("--scale", type=float, help="trace token counts are "
                   "divided by this")
    p.add_argument("--output-scale", type=float, help="trace output "
                   "token counts are divided by this")
    p.add_argument("--cap", type=int, help="max new tokens per turn")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--repeats", type=int, help="runs per configuration")
    p.add_argument("--bench-timeout", type=float, default=900,
                   help="seconds one bench may run (default 900)")
    return p


def add_timing_model_args(p, gpu_bandwidth_gbps=0.0,
                           device_bandwidth_gbps=0.0):
    """The timing models' flags, shared by every script: the GPU ranks'
    (GpuNodeConfig.hbm_bandwidth_gbps / tflops) and the KARAT devices'
    (DeviceConfig.bandwidth_gbps / tflops). 0 leaves a term out; both terms
    0 turns a model off (the processes then run at this box's speed)."""
    def default(v):
        return f"default {v:g}" + (": off" if not v else "")
    p.add_argument("--gpu-bandwidth-gbps", type=float,
                   default=gpu_bandwidth_gbps,
                   help="GPU ranks' timing model: HBM GB/s "
                   f"({default(gpu_bandwidth_gbps)})")
    p.add_argument("--gpu-tflops", type=float, default=0.0,
                   help="GPU ranks' timing model: TFLOP/s (default 0: off)")
    p.add_argument("--device-bandwidth-gbps", type=float,
                   default=device_bandwidth_gbps,
                   help="KARAT devices' timing model: GB/s per device "
                   f"({default(device_bandwidth_gbps)})")
    p.add_argument("--device-tflops", type=float, default=0.0,
                   help="KARAT devices' timing model: TFLOP/s per device "
                   "(default 0: off)")


def timing_model(p, args):
    """The timing-model flags as cluster_config() keyword arguments; a
    negative or non-finite rate is a usage error."""
    values = {"hbm_bandwidth_gbps": ("--gpu-bandwidth-gbps",
                                     args.gpu_bandwidth_gbps),
              "tflops": ("--gpu-tflops", args.gpu_tflops),
              "device_bandwidth_gbps": ("--device-bandwidth-gbps",
                                        args.device_bandwidth_gbps),
              "device_tflops": ("--device-tflops", args.device_tflops)}
    for flag, value in values.values():
        if not (value >= 0 and math.isfinite(value)):
            p.error(f"{flag} must be >= 0 and finite, got {value}")
    return {key: value for key, (_, value) in values.items()}


def timing_model_text(model):
    """One sentence for a results.md header: the timing models in use."""
    parts = []
    if model["hbm_bandwidth_gbps"] or model["tflops"]:
        parts.append(f"GPU ranks {model['hbm_bandwidth_gbps']:g} GB/s, "
                     f"{model['tflops']:g} TFLOP/s")
    if model["device_bandwidth_gbps"] or model["device_tflops"]:
        parts.append(f"KARAT devices {model['device_bandwidth_gbps']:g} GB/s,"
                     f" {model['device_tflops']:g} TFLOP/s each")
    if not parts:
        return "No timing models: the daemons compute at this box's speed. "
    return ("Timing models: " + "; ".join(parts)
            + " (0: that term off). ")


def workload(args, quick, full):
    """Bench sizes: the command line wins over the defaults of the mode."""
    d = quick if args.quick else full
    out = dict(d)
    for key, flag in (("sessions", "sessions"), ("turns", "turns"),
                      ("scale", "scale"), ("output_scale", "output-scale"),
                      ("cap", "max-new-tokens-cap"),
                      ("repeats", "repeats")):
        v = getattr(args, key)
        if v is not None:
            out[flag] = v
    out["seed"] = args.seed
    return out


def main(run):
    """Calls run(); Ctrl-C and SIGTERM stop it (the running point's cluster
    is stopped by run_point's finally). Exit 1 when a point failed."""
    def on_term(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)
    # Also when started in the background by a shell that ignores SIGINT
    # for its jobs: an explicit SIGINT stops the run too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        failures = run()
    except KeyboardInterrupt:
        log("interrupted; clusters stopped")
        sys.exit(130)
    sys.exit(1 if failures else 0)
