"""The group's one-word state from its nodes' states (opsctl.group.verdict): which node a failure is about, and why."""

from __future__ import annotations

from typing import Any

from opsctl.group import verdict


def row(node: int, state: str, **kw: Any) -> dict[str, Any]:
    return {"node": node, "host": f"h{node}", "state": state, **kw}


def test_a_node_that_refused_to_start_makes_the_group_refused_with_its_reason() -> None:
    state, why, node = verdict([row(0, "training"), row(1, "refused", reason="refusing to resume: drafter.num_layers")])
    assert (state, node) == ("refused", 1)
    assert why == "node1 h1: refusing to resume: drafter.num_layers; still running: node0 h0"


def test_a_crash_outranks_a_refusal_and_a_refused_group_is_not_degraded_or_finished() -> None:
    assert verdict([row(0, "refused", reason="r"), row(1, "crashed", reason="boom")])[0] == "crashed"
    assert verdict([row(0, "finished"), row(1, "refused")]) == ("refused", "node1 h1: refused", 1)


def test_all_nodes_training_is_training_and_one_gone_is_degraded() -> None:
    assert verdict([row(0, "training"), row(1, "training")]) == ("training", None, None)
    state, why, node = verdict([row(0, "training"), row(1, "absent")])
    assert (state, why, node) == ("degraded", "node1 h1 absent", 1)
