"""Time building the random-init target of a config on its device (the loading_target phase of a benchmark run).

Run on the device machine: `python3 bench/target_init.py configs/h200-4b-like.yaml`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dflash.config import load_config  # noqa: E402
from dflash.target import Target  # noqa: E402


def main(path: str) -> int:
    cfg = load_config(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arch = {**cfg.target.arch, "vocab_size": cfg.data.vocab_size}
    tcfg = type(cfg.target)(**{**cfg.target.__dict__, "arch": arch})
    t0 = time.perf_counter()
    target = Target(tcfg, cfg.drafter.num_layers, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(p.numel() for p in target.model.parameters())
    print(f"{path}: {n / 1e9:.2f}B params built on {device} in {dt:.1f} s ({target.dtype}, packing {target.packing})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
