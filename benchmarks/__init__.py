"""The benchmarks a user runs, as `python -m benchmarks.<script>` from the repo root (see README.md here)."""
