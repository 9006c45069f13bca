"""A cluster kept up while `karatctl bench` runs in the background and the
experiment does something meanwhile: inject faults (chaos), sample the
daemons (soak).

    with live.LiveCluster(runner, "label", config) as c:
        bench = c.start_bench({"sessions": 8, ...}, ["--retry"])
        while bench.poll() is None:
            ...  # c.karat("kill", "gpu0"), c.pids(), c.client(...)
        c.finish_bench(bench, timeout)

The cluster is stopped (`deploy/karat down`) when the block ends, also on
an exception, Ctrl-C or SIGTERM (lib.main turns those into
KeyboardInterrupt); benches still running are killed first and a daemon left
stopped (SIGSTOP) is continued so that it can exit.
"""

import json
import math
import shutil
import subprocess
import time

import lib


class LiveCluster:
    def __init__(self, runner, label, config):
        self.runner = runner
        self.label = label
        self.config = config
        self.dir = runner.points_dir / label
        self.bench = None  # the bench started last
        self.benches = []  # every bench started
        self.stopped = set()  # daemons sent SIGSTOP and not yet SIGCONT

    # -- lifetime ----------------------------------------------------------

    def __enter__(self):
        r = self.runner
        if self.dir.exists():
            r.down(self.dir)  # a cluster left over by a killed earlier run
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        config_path = self.dir / "cluster.textproto"
        config_path.write_text(
            f"# {r.name} / {self.label} (written by deploy/experiments)\n"
            + lib.to_textproto(self.config) + "\n")
        lib.log(f"{self.label}: starting the cluster ({config_path})")
        try:
            up = r._karat("up", "--config", config_path, "--run-dir",
                          self.dir, log_file=self.dir / "karat-up-down.log")
            if up.returncode != 0:
                text = (self.dir / "karat-up-down.log").read_text()
                lib.log(f"{self.label}: last lines of "
                        f"{self.dir}/karat-up-down.log:\n" + text[-1500:])
                raise lib.ExperimentError(
                    f"{self.label}: deploy/karat up failed (exit "
                    f"{up.returncode}): {lib._reason(text)}")
        except BaseException:
            r.down(self.dir)
            raise
        return self

    def __exit__(self, *exc):
        for bench in self.benches:
            if bench.poll() is None:
                bench.kill()
                bench.wait()
        for name in list(self.stopped):
            self.signal(name, "CONT")
        self.runner.down(self.dir)
        return False

    # -- the daemons -------------------------------------------------------

    def names(self):
        """The daemons `up` started (from their recorded command lines)."""
        return sorted(p.stem for p in self.dir.glob("*.cmd"))

    def pid(self, name):
        try:
            return int((self.dir / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def karat(self, *argv):
        """deploy/karat SUBCOMMAND ... --run-dir DIR, its output appended to
        DIR/karat-faults.log; returns the exit status."""
        log_file = self.dir / "karat-faults.log"
        with open(log_file, "a") as f:
            f.write(f"$ deploy/karat {' '.join(map(str, argv))}\n")
        return self.runner._karat(*argv, "--run-dir", self.dir,
                                  log_file=log_file).returncode

    def signal(self, name, sig):
        rc = self.karat("kill", name, "--signal", sig)
        if sig == "STOP" and rc == 0:
            self.stopped.add(name)
        elif sig == "CONT":
            self.stopped.discard(name)
        return rc

    def addr_file(self):
        return self.dir / "coordinator.addr"

    # -- the bench ---------------------------------------------------------

    def start_bench(self, flags, switches=(), json_name="bench.json",
                    log_name="bench.log"):
        """Starts `karatctl bench --trace T --json DIR/json_name` with
        `flags` (a dict: --key value) and `switches` (extra argv) in the
        background, its output in DIR/log_name."""
        argv = ["bench", "--trace", self.runner.trace, "--json",
                self.dir / json_name]
        for k, v in flags.items():
            if v is not None:
                argv += [f"--{k}", v]
        argv += list(switches)
        lib.log(f"{self.label}: karatctl "
                f"{' '.join(map(str, argv[:1] + argv[5:]))}")
        cmd = [str(self.runner.karatctl), "--addr-file",
               str(self.addr_file()), *map(str, argv)]
        out = open(self.dir / log_name, "w")
        self.bench = subprocess.Popen(cmd, stdout=out,
                                      stderr=subprocess.STDOUT)
        self.benches.append(self.bench)
        out.close()
        self.bench_started = time.monotonic()
        self.bench_json = self.dir / json_name
        self.bench_log = self.dir / log_name
        return self.bench

    def finish_bench(self, timeout):
        """Waits for the bench (at most `timeout` s from its start); returns
        its report (dict). ExperimentError when it crashed, ran too long or
        wrote no report."""
        left = timeout - (time.monotonic() - self.bench_started)
        try:
            rc = self.bench.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            self.bench.kill()
            self.bench.wait()
            raise lib.ExperimentError(
                f"{self.label}: bench ran past {timeout:g} s "
                f"(--bench-timeout); see {self.bench_log}")
        if rc not in (0, 1) or not self.bench_json.exists():
            text = self.bench_log.read_text()
            lib.log(f"{self.label}: last lines of {self.bench_log}:\n"
                    + text[-1500:])
            raise lib.ExperimentError(
                f"{self.label}: bench failed (exit {rc}): {lib._reason(text)}")
        return json.loads(self.bench_json.read_text())


def vm_rss_kib(pid):
    """VmRSS of a process in KiB (None when it is gone or not readable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def role_of(name):
    """coordinator, gpu or karat (by the names lib.cluster_config gives)."""
    if name == "coordinator":
        return "coordinator"
    return "gpu" if name.startswith("gpu") else "karat"


def percentile(values, p):
    """Nearest rank, as karatctl's Percentile; None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    rank = min(max(1, math.ceil(p / 100 * len(xs))), len(xs))
    return xs[rank - 1]

