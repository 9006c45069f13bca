"""Metrics of the experiments (see lib.py): the Prometheus text of
`karatctl metrics` parsed into samples and stats, and the collector of
"metric X not reported" notes."""

import re

from lib_base import log


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
# Notes of metrics the cluster does not report.


class MissingMetrics:
    """Collects "metric X not reported" once per name."""

    def __init__(self):
        self.names = []

    def note(self, name, why="not reported"):
        line = f"metric {name} {why}"
        if line not in self.names:
            self.names.append(line)
            log(line)
