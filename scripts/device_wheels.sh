#!/usr/bin/env bash
# Wheels a GPU machine without internet needs beyond its image (CPython 3.12, x86-64):
# the CUTLASS headers, CUPTI's Python bindings (for the image's CUPTI 13.0) and the openai
# client with the dependencies its image lacks.
# Downloads into .whl/; install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl nvidia-cutlass==4.2.0.0 cupti-python==13.0.1
# openai with everything it depends on (httpx2, anyio, pydantic, ...), resolved for that Python.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl openai==3.57.0
ls .whl
