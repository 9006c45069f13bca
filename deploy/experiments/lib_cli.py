"""Command line and lifetime of the experiments (see lib.py): the shared
argument parser, the timing-model flags, the bench sizes, and main() with
its signal handling."""

import argparse
import math
import signal
import sys

from lib_base import DEFAULT_MODEL_DIR, DEFAULT_TRACE, _rel, log


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
