#!/usr/bin/env bash
# The pure-Python (and cp312 manylinux) wheels speculators 0.9.0 and specforge 0.2.0 need on the GPU machine, which has torch,
# transformers 5.17, numpy, pyarrow, safetensors, tokenizers, huggingface_hub, pyyaml, tqdm and no package index: downloaded here
# into DIR (default .whl-peer, git-ignored), carried with `run`'s carry, installed there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-peer DIR/*.whl
# and put on PYTHONPATH for bench/peer.py's --peer-python (see its docstring). torchvision/torchaudio are left out on
# purpose: speculators never imports them, and transformers would import a torchvision that does not match torch.
set -euo pipefail
dir=${1:-.whl-peer}
mkdir -p "$dir"
# pyarrow is left out too: the GPU machine has pyarrow 25.0.1 (seen 2026-12-07), and its 55 MB wheel would not fit
# run's 64 MiB carry beside .whl/. Total here ~24 MB (with .whl's 34 MB: ~58 MB of the 64 MiB).
# specforge --no-deps (it pins sglang==0.5.14 and torch==2.11.0; its offline DFlash path needs neither): of its
# imports only accelerate (0.4 MB) is not already here or on that machine (measured: the modules a CPU
# `specforge train` of the offline path loads). specforge itself is 0.4 MB.
pkgs=(speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill multiprocess xxhash "fsspec<=2026.7.0"
      pandas python-dateutil tzdata six loguru==0.7.3 pydantic-settings python-dotenv typer click shellingham annotated-doc
      openai httpx httpcore httpx2 httpcore2 truststore h11 anyio sniffio distro jiter aiohttp aiohappyeyeballs aiosignal attrs frozenlist
      multidict propcache yarl psutil rich markdown-it-py mdurl pygments idna certifi typing-inspection
      specforge==0.2.0 accelerate==1.16.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dir" \
  "${pkgs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
ls "$dir"/*.whl | wc -l
