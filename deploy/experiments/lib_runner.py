"""The experiments' Runner (see lib.py): starts a point's cluster, runs
`karatctl bench`, scrapes the metrics, stops the cluster, and writes
results.csv / results.md / plot.png; plus the cell formatting of the
results and the row cells taken from bench.json."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from lib_base import (DEFAULT_MODEL_DIR, DEFAULT_TRACE, REPO, ExperimentError,
                      _rel, log)
from lib_config import to_textproto
from lib_metrics import Metrics, MissingMetrics


# ---------------------------------------------------------------------------
# Running points.


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
