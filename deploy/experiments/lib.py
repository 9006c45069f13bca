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

The machinery lives in modules by responsibility; this module re-exports
their names so that the scripts `import lib` only:

  lib_base.py     repository paths and defaults, log(), ExperimentError
  lib_config.py   text-format protobuf and cluster configurations
  lib_sizing.py   model bytes (weights, KV per token), planned context lengths
  lib_metrics.py  Prometheus text parsing (Metrics), MissingMetrics
  lib_runner.py   Runner (points, results output), bench_columns
  lib_stats.py    mean / median helpers
  lib_cli.py      argument parsing, timing-model flags, workload(), main()
"""

# flake8: noqa: F401
from lib_base import (DEFAULT_MODEL_DIR, DEFAULT_TRACE, REPO, ExperimentError,
                      _rel, log)
from lib_cli import (add_timing_model_args, main, parser, timing_model,
                     timing_model_text, workload)
from lib_config import (_scalar, cluster_config, gpu_names, karat_names,
                        link_rules, to_textproto)
from lib_metrics import (_LABEL, _SAMPLE, Metrics, MissingMetrics, _normal,
                         _series_key)
from lib_runner import Runner, _csv_cell, _md_cell, _reason, bench_columns
from lib_sizing import (kv_bytes_per_token, planned_context_lengths,
                        rank_weight_bytes, read_safetensors_header)
from lib_stats import mean, median, nan_mean, nan_median
