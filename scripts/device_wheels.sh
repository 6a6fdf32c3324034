#!/usr/bin/env bash
# Wheels a GPU machine without internet needs beyond its image (CPython 3.12, x86-64):
# the CUTLASS headers and the openai client with the dependencies its image lacks.
# Downloads into .whl/; install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl nvidia-cutlass==4.2.0.0 openai==3.57.0 pydantic==2.14.4 pydantic-core==2.50.5 jiter==0.19.0 \
  annotated-types==0.8.0 typing-inspection==0.4.5 sniffio==1.3.1 distro
ls .whl
