"""Shared basics of the experiments' library (see lib.py): the repository
paths and defaults, the log line, the experiment error, and paths shown
relative to the repository."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "deploy" / "traces" / "kvcache-tester-main-sample.csv"
DEFAULT_MODEL_DIR = REPO / "run" / "models" / "dsa-tiny"


def log(message):
    print(f"experiment: {message}", file=sys.stderr, flush=True)


class ExperimentError(Exception):
    """A point could not be run (cluster did not start, bench crashed...)."""


def _rel(p):
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)
