#!/usr/bin/env bash
# Wheels to run the GPU checks under a newer transformers than the device machine's python3 has (5.17 there; a user's
# `pip install` of this project takes the newest 5.x: issue 24's session 17 found 5.25 never run on a GPU).
# Run HERE (the CPU machine, which reaches the package registry), then carry the folder to the device:
#   bash bench/transformers_wheels.sh 5.25.0            # -> .whl-tf/: .whl's fla / causal-conv1d / pydantic wheels
#                                                        #    + transformers 5.25.0 and what it needs (cp312, x86_64)
#   device: GPU_CHECKS_WHEELS=.whl-tf OUT=$OUT bash bench/gpu_checks.sh part1     (carry [".whl-tf"])
# numpy, PyYAML and packaging are left out (the device's python3 has them; numpy alone is 16 MB of the 64 MiB carry).
set -euo pipefail
version=${1:?usage: bash bench/transformers_wheels.sh TRANSFORMERS_VERSION}
cd "$(dirname "$0")/.."
out=.whl-tf
[[ -d .whl ]] || { echo "no .whl/ (copy ../shared/wheels/h200-cp312/*.whl there first)" >&2; exit 2; }
rm -f "$out"/*.whl 2>/dev/null || true
mkdir -p "$out"
cp .whl/*.whl "$out"/
pip=${PIP:-.venv/bin/pip}
dl=$(mktemp -d /tmp/transformers-wheels.XXXXXX)
"$pip" download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$dl" \
  "transformers==$version"
for w in "$dl"/*.whl; do
  case "$(basename "$w")" in
    numpy-*|pyyaml-*|PyYAML-*|packaging-*) continue ;;
  esac
  # a wheel .whl already has (pydantic, typing_extensions): keep .whl's
  name=$(basename "$w" | cut -d- -f1)
  ls "$out"/"$name"-*.whl > /dev/null 2>&1 || cp "$w" "$out"/
done
rm -f "$dl"/*.whl
rmdir "$dl"
ls "$out"
du -sh "$out"
