"""fla's tuned kernel configs in the host store (dflash/fla_configs.py): what is recorded, in fla's format, and when
fla is pointed at it. fla's autotuners need Triton, which never exists on these CPU machines, so the autotuners
here are stand-ins with the attributes fla's CachedAutotuner has (fla/ops/utils/cache.py: `kernel_name`, `keys`,
`cache` mapping an autotune key tuple to the chosen triton.Config, reached through a heuristics wrapper's `fn`),
and the configs carry triton.Config's attributes. tests/gpu/test_fla_configs_gpu.py runs the real round trip through
fla's own loader on a GPU."""

from __future__ import annotations

import enum
import hashlib
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dflash import fla_configs


@dataclass
class Config:  # triton.Config's attributes
    kwargs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    num_ctas: int = 1
    maxnreg: int | None = None
    ir_override: str | None = None


@dataclass
class Tuner:  # fla's CachedAutotuner: what autotune chose per key
    kernel_name: str
    keys: list[str]
    cache: dict[tuple[Any, ...], Config] = field(default_factory=dict)
    fn: Any = None
    configs: list[Config] = field(default_factory=lambda: [Config({"BK": 32}), Config({"BK": 64})])


@dataclass
class Heuristics:  # triton.heuristics wraps the autotuner: fla's module attribute is this
    fn: Any


@pytest.fixture
def fla_modules(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A loaded `fla.ops.gated_delta_rule.chunk_fwd`-like module with two kernels, as fla has them after a forward."""
    mod = types.ModuleType("fla.ops.standin_kernels")
    mod.kkt = Heuristics(Tuner("chunk_fwd_kkt_kernel", ["H", "K", "BC"],
                               {(16, 128, 64, "torch.bfloat16"): Config({"BK": 64}, num_warps=2)}))
    mod.wy = Tuner("recompute_w_u_fwd_kernel", ["H", "K", "V"],
                   {(16, 128, 128, "torch.bfloat16", "torch.float32"): Config({"BK": 32, "BV": 64}, 4, 3)})
    mod.not_a_kernel = 3
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delenv(fla_configs.MODE_ENV, raising=False)
    monkeypatch.delenv(fla_configs.DIR_ENV, raising=False)
    return mod


def fla_hash(key: list[Any]) -> str:
    """fla's AutotuneKey.key_hash, as its source states it: md5 of json.dumps(key, separators=(',', ':'),
    sort_keys=True) with tuples as lists."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def test_record_writes_fla_s_config_files_and_a_later_record_only_adds(tmp_path: Path,
                                                                       fla_modules: types.ModuleType) -> None:
    store = tmp_path / "store"
    line = fla_configs.record(store, env={})
    assert "recorded 2 tuned keys of 2 kernels" in line and str(store) in line
    kkt = json.loads((store / "chunk_fwd_kkt_kernel.json").read_text())
    key = [16, 128, 64, "torch.bfloat16"]
    assert kkt["kernel_name"] == "chunk_fwd_kkt_kernel" and kkt["default_config"] is None
    assert kkt["autotune_entries"] == {fla_hash(key): {"autotune_key": key, "config": {
        "kwargs": {"BK": 64}, "num_warps": 2, "num_stages": 2, "num_ctas": 1, "maxnreg": None, "ir_override": None}}}
    wy = json.loads((store / "recompute_w_u_fwd_kernel.json").read_text())
    (entry,) = wy["autotune_entries"].values()
    assert entry["config"]["kwargs"] == {"BK": 32, "BV": 64} and entry["config"]["num_stages"] == 3

    # nothing new: nothing written, no line
    before = {f.name: f.stat().st_mtime_ns for f in store.glob("*.json")}
    assert fla_configs.record(store, env={}) == ""
    assert {f.name: f.stat().st_mtime_ns for f in store.glob("*.json")} == before
    # a new shape of one kernel: added beside the old entry; an entry already there is never replaced
    fla_modules.kkt.fn.cache[(32, 128, 64, "torch.bfloat16")] = Config({"BK": 32}, num_warps=1)
    fla_modules.kkt.fn.cache[(16, 128, 64, "torch.bfloat16")] = Config({"BK": 32}, num_warps=8)
    assert "recorded 1 tuned keys of 1 kernels" in fla_configs.record(store, env={})
    entries = json.loads((store / "chunk_fwd_kkt_kernel.json").read_text())["autotune_entries"]
    assert entries[fla_hash(key)]["config"]["num_warps"] == 2
    assert entries[fla_hash([32, 128, 64, "torch.bfloat16"])]["config"]["kwargs"] == {"BK": 32}
    assert not list(store.glob(".*.tmp"))


def kernel_fn(name: str, module: str) -> types.FunctionType:
    """A kernel's Python function as Triton's Autotuner keeps it (`base_fn`): its name and defining module."""
    fn = types.FunctionType(compile("def f(): pass", "k", "exec").co_consts[0], {"__name__": module}, name)
    assert fn.__module__ == module
    return fn


def test_a_kernel_name_several_autotuners_share_is_filed_under_its_module_and_unjsonable_keys_never(
        tmp_path: Path, fla_modules: types.ModuleType) -> None:
    """fla 0.6 files configs by function name, and most of its kernels share one with another op's (8 of 12 names on
    the H200 in session 15): each is recorded under the name qualified by its module, and looked up under it."""
    fla_modules.wy.base_fn = kernel_fn("recompute_w_u_fwd_kernel", "fla.ops.gated_delta_rule.wy_fast")
    fla_modules.other = Tuner("recompute_w_u_fwd_kernel", ["H"], {(8, "torch.float16"): Config({"BK": 16})})
    fla_modules.other.fn = types.SimpleNamespace(fn=kernel_fn("recompute_w_u_fwd_kernel", "fla.ops.gla.wy"))
    fla_modules.twin = Tuner("twin_kernel", ["H"], {(1, "torch.float16"): Config({"BK": 16})})
    fla_modules.twin2 = Tuner("twin_kernel", ["H"], {(2, "torch.float16"): Config({"BK": 16})})
    for t in (fla_modules.twin, fla_modules.twin2):  # one module defining a name twice: no name of its own
        t.base_fn = kernel_fn("twin_kernel", "fla.ops.twice")
    fla_modules.odd = Tuner("odd_kernel", ["X"], {((1, 2), "torch.bfloat16"): Config({"BK": 16}),
                                                   (object(),): Config({"BK": 16})})
    line = fla_configs.record(tmp_path, env={})
    assert "recorded 3 tuned keys of 3 kernels" in line
    assert "2 autotuners without a name of their own not recorded" in line
    qualified = ["recompute_w_u_fwd_kernel__fla_ops_gated_delta_rule_wy_fast", "recompute_w_u_fwd_kernel__fla_ops_gla_wy"]
    assert sorted(f.stem for f in tmp_path.glob("*.json")) == ["chunk_fwd_kkt_kernel", *qualified]
    gla = json.loads((tmp_path / f"{qualified[1]}.json").read_text())
    assert gla["kernel_name"] == qualified[1]
    assert [e["autotune_key"] for e in gla["autotune_entries"].values()] == [[8, "torch.float16"]]

    # the run that uses the store looks each one up under that name (CachedAutotuner reads self.kernel_name)
    cache_mod = types.ModuleType(fla_configs.FLA_MODULE)
    cache_mod.CachedAutotuner = Tuner
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, fla_configs.FLA_MODULE, cache_mod)
        mp.setitem(sys.modules, "triton.runtime.autotuner", types.SimpleNamespace(Autotuner=object))
        fla_configs.adopt()
    assert (fla_modules.wy.kernel_name, fla_modules.other.kernel_name) == tuple(qualified)
    assert fla_modules.kkt.fn.kernel_name == "chunk_fwd_kkt_kernel"
    assert fla_modules.twin.kernel_name == fla_modules.twin2.kernel_name == "twin_kernel"


def test_a_damaged_file_is_replaced_and_an_unwritable_store_is_a_line_not_an_error(
        tmp_path: Path, fla_modules: types.ModuleType) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "chunk_fwd_kkt_kernel.json").write_text('{"autotune_entries": [1, 2')  # cut short by a crash
    assert "recorded 2 tuned keys" in fla_configs.record(store, env={})
    assert json.loads((store / "chunk_fwd_kkt_kernel.json").read_text())["kernel_name"] == "chunk_fwd_kkt_kernel"
    blocked = tmp_path / "file"
    blocked.write_text("x")
    line = fla_configs.record(blocked / "store", env={})
    assert line.startswith(f"fla kernel configs: not recorded in {blocked / 'store'}:")


def test_enable_points_fla_at_a_store_that_holds_configs_and_switches_an_imported_fla(
        tmp_path: Path, fla_modules: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    env: dict[str, str] = {}
    line = fla_configs.enable(store, env)
    assert "none recorded yet" in line and env == {}
    fla_configs.record(store, env)

    class FlaCacheMode(enum.Enum):  # fla.ops.utils.cache's enum, read once at import into FLA_CACHE_MODE
        DISABLED = "disabled"
        STRICT = "strict"

    cache_mod = types.ModuleType(fla_configs.FLA_MODULE)
    cache_mod.FlaCacheMode, cache_mod.FLA_CACHE_MODE = FlaCacheMode, FlaCacheMode.DISABLED
    monkeypatch.setitem(sys.modules, fla_configs.FLA_MODULE, cache_mod)
    line = fla_configs.enable(store, env)
    assert env == {"FLA_CACHE_MODE": "strict", "FLA_CONFIG_DIR": str(store)}
    assert "2 tuned keys of 2 kernels" in line and "without autotuning" in line
    assert cache_mod.FLA_CACHE_MODE is FlaCacheMode.STRICT
    # the store it reads from is the one it records into
    fla_modules.wy.cache[(8, 64, 64, "torch.bfloat16", "torch.float32")] = Config({"BK": 16, "BV": 16})
    assert "recorded 1 tuned keys" in fla_configs.record(store, env)


def test_a_user_s_own_fla_settings_are_left_alone(tmp_path: Path, fla_modules: types.ModuleType) -> None:
    store = tmp_path / "store"
    fla_configs.record(store, env={})
    theirs = tmp_path / "theirs"
    for env in ({"FLA_CONFIG_DIR": str(theirs)}, {"FLA_CACHE_MODE": "disabled"}):
        seen = dict(env)
        assert "set in the environment: left as set" in fla_configs.enable(store, seen)
        assert seen == env
        assert fla_configs.record(tmp_path / "other", seen) == ""
    assert not theirs.exists() and not (tmp_path / "other").exists()


def test_the_store_is_per_gpu_and_versions_and_absent_without_fla(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # this CPU machine has neither fla nor Triton (never installed here): no store, nothing recorded or loaded
    assert fla_configs.store_dir(tmp_path, "cpu") is None
    assert fla_configs.enable(None, {}) == "" and fla_configs.record(None, {}) == ""
    versions = {"fla-core": "0.6.0", "triton": "3.6.0"}

    def version(dist: str) -> str:
        if dist not in versions:
            raise fla_configs.importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(fla_configs.importlib.metadata, "version", version)
    assert fla_configs.store_dir(tmp_path, "NVIDIA H200") == tmp_path / "fla-configs" / "NVIDIA_H200" / \
        "fla-0.6.0_triton-3.6.0"
    # the shipped seed has the store's layout below its own root: GPU, then versions
    assert fla_configs.seed_dir("NVIDIA H200", tmp_path / "seed") == tmp_path / "seed" / "NVIDIA_H200" / \
        "fla-0.6.0_triton-3.6.0"
    assert fla_configs.seed_dir("NVIDIA H200").parent.parent == Path(fla_configs.__file__).parent / "fla_seed"


def _entries(*keys: tuple[Any, ...]) -> dict[str, Any]:
    return {fla_configs.key_hash(list(k)): {"autotune_key": list(k), "config": {"kwargs": {"BK": k[0]}, "num_warps": 4,
                                                                                "num_stages": 2}} for k in keys}


def test_the_shipped_seed_fills_what_a_fresh_host_store_lacks_and_never_replaces_a_host_entry(
        tmp_path: Path) -> None:
    src, store = tmp_path / "seed" / "NVIDIA_H200" / "fla-0.6.0_triton-3.6.0", tmp_path / "store"
    src.mkdir(parents=True)
    (src / "kkt.json").write_text(json.dumps({"kernel_name": "kkt", "triton_version": "3.6.0", "default_config": None,
                                              "autotune_entries": _entries((64, "bf16"), (32, "bf16"))}))
    (src / "damaged.json").write_text("{not json")
    (src / "empty.json").write_text(json.dumps({"kernel_name": "empty", "autotune_entries": {}}))
    assert fla_configs.seed(None, src) == "" and fla_configs.seed(store, None) == ""
    assert fla_configs.seed(store, tmp_path / "no-such-seed") == "" and not store.exists()

    # a fresh host: the whole seed copied in fla's format, nothing from the damaged or empty files
    line = fla_configs.seed(store, src)
    assert "2 tuned keys of 1 kernels shipped with dflash" in line and str(store) in line
    assert sorted(f.name for f in store.glob("*.json")) == ["kkt.json"]
    assert json.loads((store / "kkt.json").read_text())["autotune_entries"] == _entries((64, "bf16"), (32, "bf16"))
    assert fla_configs.seed(store, src) == ""  # nothing missing any more

    # a host that tuned one of the keys itself keeps its own choice; a key the seed adds later is merged in
    host = _entries((64, "bf16"))
    host[next(iter(host))]["config"]["num_warps"] = 8
    (store / "kkt.json").write_text(json.dumps({"kernel_name": "kkt", "triton_version": "3.6.0", "default_config": None,
                                                "autotune_entries": host}))
    line = fla_configs.seed(store, src)
    assert "1 tuned keys of 1 kernels" in line
    got = json.loads((store / "kkt.json").read_text())["autotune_entries"]
    assert got == {**_entries((32, "bf16")), **host}
    assert fla_configs._count(store) == (1, 2)

    # a store that cannot be made (a file where its directory should be) is a log line; fla then autotunes
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    line = fla_configs.seed(blocked / "store", src)
    assert line.startswith("fla kernel configs: shipped configs not merged into"), line



def test_a_store_held_by_a_stopped_process_costs_a_line_not_a_hung_step(
        tmp_path: Path, fla_modules: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another rank writing holds the store's flock for milliseconds; a holder that stopped (SIGSTOP, a hung
    filesystem) must not hold up the training step that records: it gives up after LOCK_WAIT_S and says so."""
    import subprocess
    import time

    store = tmp_path / "store"
    store.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
                               "time.sleep(60)", str(store / fla_configs.LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(fla_configs, "LOCK_WAIT_S", 0.3)
        t0 = time.monotonic()
        line = fla_configs.record(store, env={})
        assert time.monotonic() - t0 < 5
        assert line.startswith(f"fla kernel configs: not recorded in {store}:") and "still in use" in line, line
        assert not list(store.glob("*.json"))
    finally:
        holder.kill()
        holder.wait()
    assert "recorded 2 tuned keys" in fla_configs.record(store, env={})  # the lock is free again


def test_an_odd_object_in_fla_s_modules_is_passed_over(tmp_path: Path, fla_modules: types.ModuleType
                                                                 ) -> None:
    class Odd:  # a lazy proxy whose attribute access fails with something other than AttributeError
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("lazy import failed")

    fla_modules.odd = Odd()  # skipped: the kernels beside it are still recorded
    assert "recorded 2 tuned keys of 2 kernels" in fla_configs.record(tmp_path / "store", env={})


def test_enable_without_an_importable_fla_leaves_the_environment_as_it_was(tmp_path: Path,
                                                                           fla_modules: types.ModuleType,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    fla_configs.record(store, env={})
    monkeypatch.setitem(sys.modules, fla_configs.FLA_MODULE, None)  # `import` of it raises, as without fla
    env: dict[str, str] = {}
    assert fla_configs.enable(store, env).startswith("fla kernel configs: not used: ")
    assert env == {}


def test_fla_s_plain_triton_autotuners_get_its_store_lookup(tmp_path: Path, fla_modules: types.ModuleType,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Some fla kernels use Triton's plain autotune (cumsum, chunk_o): they are recorded under their function's name
    and, when the store is used, take fla's CachedAutotuner class (Triton's Autotuner and fla's subclass here are
    stand-ins with their documented attributes: `base_fn`, `cache`, `keys`, `configs`)."""

    class Autotuner:  # triton.runtime.autotuner.Autotuner
        def __init__(self, fn_name: str, cache: dict[tuple[Any, ...], Config]) -> None:
            self.base_fn = types.FunctionType(compile("def f(): pass", "k", "exec").co_consts[0], {}, fn_name)
            self.cache, self.keys, self.configs = cache, ["BT"], [Config({"BT": 16}), Config({"BT": 64})]

    class CachedAutotuner(Autotuner):  # fla.ops.utils.cache.CachedAutotuner: adds the store lookup, kernel_name
        pass

    class FlaCacheMode(enum.Enum):
        STRICT = "strict"

    triton_mod = types.ModuleType("triton.runtime.autotuner")
    triton_mod.Autotuner = Autotuner
    cache_mod = types.ModuleType(fla_configs.FLA_MODULE)
    cache_mod.CachedAutotuner, cache_mod.FlaCacheMode, cache_mod.FLA_CACHE_MODE = CachedAutotuner, FlaCacheMode, None
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", triton_mod)
    monkeypatch.setitem(sys.modules, fla_configs.FLA_MODULE, cache_mod)
    fla_modules.cumsum = Heuristics(Autotuner("chunk_local_cumsum_kernel", {(8, "torch.float32"): Config({"BT": 64})}))
    elsewhere = types.ModuleType("not_fla.kernels")  # not fla's: never touched
    elsewhere.k = Autotuner("other_kernel", {})
    monkeypatch.setitem(sys.modules, elsewhere.__name__, elsewhere)

    store = tmp_path / "store"
    assert "recorded 3 tuned keys of 3 kernels" in fla_configs.record(store, env={})
    assert json.loads((store / "chunk_local_cumsum_kernel.json").read_text())["kernel_name"] == \
        "chunk_local_cumsum_kernel"
    env: dict[str, str] = {}
    assert "1 plain Triton autotuners of fla given the same lookup" in fla_configs.enable(store, env)
    adopted = fla_modules.cumsum.fn
    assert type(adopted) is CachedAutotuner and adopted.kernel_name == "chunk_local_cumsum_kernel"
    assert adopted.cache == {(8, "torch.float32"): Config({"BT": 64})}  # the same object, its state kept
    assert type(elsewhere.k) is Autotuner and not hasattr(elsewhere.k, "kernel_name")
    assert type(fla_modules.wy) is Tuner  # fla's own cached autotuners (stand-ins here) stay as they are
    assert fla_configs.adopt() == 0  # nothing left to adopt


def test_every_shipped_seed_file_is_one_fla_would_match_and_load() -> None:
    """What dflash/fla_seed ships was recorded on a device run and copied by hand: an entry whose name is not fla's
    hash of its key, a file named for another kernel, or a directory for other versions would never be looked up
    (fla would silently autotune, and the cold start would lose what the seed is for). Each file here must be what
    fla's loader reads: kernel_name = the file's stem, Triton version = the directory's, entries keyed by
    key_hash(autotune_key), each config with its kwargs, warps and stages."""
    files = sorted(fla_configs.SEED_ROOT.glob("*/*/*.json"))
    assert files, "no seed shipped"
    for f in files:
        gpu, versions = f.parent.parent.name, f.parent.name
        assert gpu == fla_configs._safe(gpu) and versions.startswith("fla-") and "_triton-" in versions, f
        data = json.loads(f.read_text())
        assert data["kernel_name"] == f.stem, f
        assert versions.endswith("_triton-" + fla_configs._safe(data["triton_version"])), f
        assert data["autotune_entries"], f
        for name, entry in data["autotune_entries"].items():
            assert name == fla_configs.key_hash(entry["autotune_key"]), (f, name)
            cfg = entry["config"]
            assert isinstance(cfg["kwargs"], dict) and cfg["num_warps"] > 0 and cfg["num_stages"] > 0, (f, cfg)


def test_the_shipped_seed_merges_whole_into_a_fresh_store(tmp_path: Path) -> None:
    """Every shipped directory, merged into an empty host store (a fresh machine), adds every entry it holds."""
    for i, seed_dir in enumerate(sorted({f.parent for f in fla_configs.SEED_ROOT.glob("*/*/*.json")})):
        store = tmp_path / str(i)
        line = fla_configs.seed(store, seed_dir)
        shipped = sum(len(json.loads(f.read_text())["autotune_entries"]) for f in seed_dir.glob("*.json"))
        kernels = len(list(seed_dir.glob("*.json")))
        assert line.startswith(f"fla kernel configs: {shipped} tuned keys of {kernels} kernels shipped with dflash"), line
        assert fla_configs._count(store) == (kernels, shipped)
