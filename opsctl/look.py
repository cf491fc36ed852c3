"""How `opsctl watch` draws states and numbers, shared by the Textual dashboard and `--plain`: rich only, no Textual.

Kept apart from opsctl/widgets.py so `watch --plain` and `watch --once --json` do not pay for importing Textual and
plotext (about a quarter of a second on a loaded 2-core box: bench/ops_latency.py --only watch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.text import Text

from opsctl.runstate import RunView, phase_progress
from opsctl.watch import state_label

BLOCKS = "▁▂▃▄▅▆▇█"

# One background per state, as exact colours (a theme maps named ANSI colours, which made `blue` and `purple` look
# alike): no two states share one, and the ones that need someone (crashed, refused, unreachable, stalled) are the
# loud ones. tests/test_tui.py checks every pair is far apart. The text colours are exact too (a terminal's `white` is
# often light grey): `opsctl status` draws its state cells with these same styles, and tests/test_state_colours.py
# checks each text/background pair reads at 3:1 or better, whatever the terminal's own background.
STATE_STYLES: dict[str, str] = {
    "absent": "bold #ffffff on #808080",
    "connecting": "bold #ffffff on #3a3a3a",
    "starting": "bold #000000 on #d0d0d0",
    "loading": "bold #000000 on #00afd7",
    "compiling": "bold #000000 on #d7af87",
    "training": "bold #000000 on #00af5f",
    "stalled": "bold #000000 on #ffd700",
    "restarting": "bold #000000 on #ff8700",
    "finished": "bold #ffffff on #005fd7",
    "crashed": "bold #ffffff on #d70000",
    "killed": "bold #ffffff on #875f00",
    "refused": "bold #ffffff on #af005f",
    "unreachable": "bold #000000 on #ff87ff",
    "degraded": "bold #ffffff on #af5f5f",  # a group run some of whose nodes are gone
}


def spark(values: Sequence[float], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """A one-line chart of the last `width` finite values; a flat series draws at its bottom."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)][-max(width, 0):]
    if not vals or width <= 0:
        return ""
    low = min(vals) if lo is None else lo
    high = max(vals) if hi is None else hi
    span = high - low
    out = []
    for v in vals:
        frac = 0.0 if span <= 0 else min(1.0, max(0.0, (v - low) / span))
        out.append(BLOCKS[min(len(BLOCKS) - 1, int(frac * (len(BLOCKS) - 1) + 0.5))])
    return "".join(out)


def state_badge(view: RunView) -> Text:
    """The one word that says what a run is doing, with loading progress (i/N) when the run reports it."""
    label = state_label(view).upper()
    if view.state == "loading":
        label = phase_progress(label, view.phase_i, view.phase_n)
    return Text(f" {label} ", style=STATE_STYLES.get(view.state, "bold reverse"))


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round values (1, 2, 2.5 or 5 times a power of ten) from one at or below `lo` to one at or above
    `hi`, as people read axes (`4.0k 4.2k 4.4k`, never `3947.5 4712.0`); the chart's range is set to their ends."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9) * step
    last = math.ceil(hi / step - 1e-9) * step
    return [round(first + k * step, 12) for k in range(int(round((last - first) / step)) + 1)]


def tick_labels(ticks: Sequence[float], unit: str = "") -> list[str]:
    """Axis labels for `ticks`, one scale for the whole axis: `4.0k`, `440k`, `1.2M` for big numbers; seconds as
    `850ms` below one second, else `1.5s`, when `unit` is `s`; as many decimals as the spacing needs."""
    if not ticks:
        return []
    top = max(abs(t) for t in ticks)
    step = min((b - a for a, b in zip(ticks, ticks[1:], strict=False)), default=0.0) or top or 1.0
    scale, suffix = 1.0, ""
    if unit == "s":
        scale, suffix = (1e-3, "ms") if top < 1 else (1.0, "s")
    else:
        for limit, letter in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if top >= limit:
                scale, suffix = limit, letter + unit
                break
        else:
            suffix = unit
    return ["0" if t == 0 else f"{_plain(t / scale, step / scale)}{suffix}" for t in ticks]


def _plain(value: float, step: float) -> str:
    """`value` with the decimals the tick spacing `step` needs (at most 3): `2.5`, `0.25`, `4`."""
    decimals = next((d for d in range(4) if abs(step * 10**d - round(step * 10**d)) < 1e-6 * max(1.0, step * 10**d)), 3)
    text = f"{value:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text
