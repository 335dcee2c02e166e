"""A sweep process's resident memory and time, run by run: `run_sweep` with every line it prints prefixed by the
seconds since the start and the process's RSS, and its peak RSS at the end (Linux: /proc/self/status).

    SPECDEC_DATA=/path/to/shared/data python -m benchmarks.sweep_memory configs/sweeps/memory_probe.yaml \
        output.dir=/tmp/memory_probe [--only PATTERN ...]

Rerun on a fresh output.dir (finished runs are skipped). Run it at an older commit to see what a change did.
"""

from __future__ import annotations

import argparse
import resource
import time

from experiments.sweep import run_sweep


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as for `specdec sweep`")
    ap.add_argument("--only", action="append", default=[], help="shell-style pattern of run names (repeatable)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()

    def echo(text: str) -> None:
        first = text.splitlines()[0] if text else ""
        print(f"[{time.monotonic() - t0:6.0f} s, RSS {rss_gb():5.2f} GB] {first[:120]}", flush=True)

    try:
        run_sweep(args.sweep, args.overrides, progress=False, echo=echo, only=args.only)
    finally:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
        print(f"peak RSS {peak:.2f} GB, RSS now {rss_gb():.2f} GB, {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
