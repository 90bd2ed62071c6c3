#!/usr/bin/env bash
# GPU readiness (`make gpu-check`): the exactness tests and the layer benchmark on a GPU, in at
# most 8 minutes, with JSON results; benchmarks/gpu_check.py says what it runs and writes.
#
#   benchmarks/gpu_check.sh [--dry-run] [--backend auto|tensorflow|jax|torch|jax+torch] [OUT]
#                                                # OUT defaults to build/gpu_check/
#
# PYTHON picks the interpreter: default .venv/bin/python if it exists, else python3.
# Exit codes: 0 passed; 1 a check failed; 2 it cannot run here (no Python, no backend, no GPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: FAILED: no Python at PYTHON=$PYTHON" >&2
    exit 2
fi
exec "$PYTHON" "$root/benchmarks/gpu_check.py" "$@"
