"""How long the config reader (dflash/yamlfile.py) takes on a file at its size cap, with libyaml's parser (the default
where PyYAML has it) and with the pure-Python one. Both CLIs read every config and hosts.yaml through it.

Usage: python bench/yaml_parse.py [--repeats 3] [--bytes 1048576]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash import yamlfile


def dense(size: int) -> str:
    """A hosts-like mapping of small flow mappings, just under `size` bytes: the most nodes per byte a config has."""
    lines, n, i = ["hosts:"], 7, 0
    while True:
        line = f"  h{i}: {{a: 1, b: [1, 2, 3], c: 'x{i}'}}"
        if n + len(line) + 1 > size:
            return "\n".join(lines) + "\n"
        lines.append(line)
        n += len(line) + 1
        i += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bytes", type=int, default=yamlfile.MAX_CONFIG_BYTES)
    args = p.parse_args()
    text = dense(args.bytes)
    c_loader, times = yamlfile._CLoader, {}
    for name, loader in (("libyaml", c_loader), ("python", None)):
        if name == "libyaml" and loader is None:
            print("libyaml: not in this PyYAML")
            continue
        yamlfile._CLoader = loader
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            yamlfile.parse(text, "dense.yaml")
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs)
        print(f"{name:8} {times[name]:6.2f} s median of {args.repeats} ({len(text)} bytes, {text.count(chr(10))} lines)")
    yamlfile._CLoader = c_loader
    if len(times) == 2:
        print(f"libyaml is {times['python'] / times['libyaml']:.2f}x the pure-Python parser")


if __name__ == "__main__":
    main()
