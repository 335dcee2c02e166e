"""The benchmark scripts, run from the repo root as `python -m benchmarks.<script>` (see common.py)."""
