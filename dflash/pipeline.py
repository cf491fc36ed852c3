"""How hidden-state buffers get from the target to the drafter: roles, the buffer feed, and the bounded reservoir.

Processes, not threads: under torchrun each rank is `colocated` (target + drafter), `drafter` or `target`; target ranks
send fixed-shape buffers with torch.distributed point-to-point ops. Both modes go through the same reservoir, so the
same seed gives the same losses whichever way the job is laid out.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash.config import DistConfig
from dflash.data import Piece, Schedule, TokenizedCorpus, buffer_arrays, buffer_rows
from dflash.model import DraftBatch
from dflash.target import to_device

Key = tuple[int, int]  # (epoch, buffer index in that epoch's schedule)


# ---------------------------------------------------------------------------------------------- roles
@dataclass
class Roles:
    """Who does what in this job. Drafter ranks come first, so rank 0 (the run-level event writer) sees the loss."""

    rank: int = 0
    world_size: int = 1
    role: str = "colocated"  # colocated | drafter | target
    drafters: list[int] = field(default_factory=lambda: [0])  # ranks that train (colocated ranks included)
    targets: list[int] = field(default_factory=lambda: [0])  # ranks that run the target
    local_rank: int = 0
    # Split mode: (drafter ranks, target ranks) of each lane; a lane's targets serve only its drafters. One lane of
    # every rank on one node; one lane per node across nodes (hidden states then never leave a node).
    lanes: list[tuple[list[int], list[int]]] | None = None

    @property
    def is_drafter(self) -> bool:
        return self.role in ("colocated", "drafter")

    @property
    def is_target(self) -> bool:
        return self.role in ("colocated", "target")

    @property
    def drafter_index(self) -> int:
        return self.drafters.index(self.rank)

    @property
    def target_index(self) -> int:
        return self.targets.index(self.rank)

    @property
    def split(self) -> bool:
        return self.role != "colocated"

    def lane(self, rank: int) -> tuple[list[int], list[int]]:
        """(drafter ranks, target ranks) of the lane `rank` belongs to."""
        for ds, ts in self.lanes or [(self.drafters, self.targets)]:
            if rank in ds or rank in ts:
                return ds, ts
        raise ValueError(f"rank {rank} is in no lane of {self.lanes}")

    def target_for(self, j: int, drafter_rank: int) -> int:
        """The target rank that computes item j of this drafter: its lane's targets in turn, in the lane's global
        order (item j of the lane's drafter i has sequence number j * lane drafters + i)."""
        ds, ts = self.lane(drafter_rank)
        return ts[(j * len(ds) + ds.index(drafter_rank)) % len(ts)]

    def as_event(self) -> dict[str, list[int]]:
        if not self.split:
            return {"colocated": list(self.drafters)}
        return {"drafter": list(self.drafters), "target": list(self.targets)}


def resolve_roles(cfg: DistConfig, env: dict[str, str] | None = None) -> Roles:
    """Roles from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); without torchrun: one colocated rank."""
    env = dict(os.environ) if env is None else env
    rank = int(env.get("RANK", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_RANK", str(rank)))
    if cfg.roles == "colocated":
        ranks = list(range(world))
        return Roles(rank=rank, world_size=world, role="colocated", drafters=ranks, targets=ranks, local_rank=local)
    if world < 2:
        raise ValueError(f"dist.roles=split needs at least 2 processes (a target rank and a drafter rank), got {world}")
    node = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    per_node = cfg.target_ranks_per_node
    if cfg.target_ranks is not None and per_node is not None:
        raise ValueError("set dist.target_ranks (counted over the whole job) or dist.target_ranks_per_node, not both")
    if world > node >= 2 and world % node == 0 and cfg.target_ranks is None:
        # Several nodes: every node runs its own split (the last t local ranks run the target for that node's
        # drafters), so the hidden states (token_budget x taps x hidden x 2 bytes per buffer) stay on the node.
        t = per_node if per_node is not None else balanced_target_ranks(node)
        if t >= node:
            raise ValueError(f"dist.target_ranks_per_node={t} leaves no drafter rank on a node of {node} processes")
        lanes = [(list(range(b, b + node - t)), list(range(b + node - t, b + node))) for b in range(0, world, node)]
        drafters = [r for ds, _ in lanes for r in ds]
        targets = [r for _, ts in lanes for r in ts]
        role = "drafter" if rank in drafters else "target"
        return Roles(rank=rank, world_size=world, role=role, drafters=drafters, targets=targets, local_rank=local,
                     lanes=lanes)
    n_t = cfg.target_ranks if cfg.target_ranks is not None else per_node if per_node is not None else \
        balanced_target_ranks(world)
    if world < n_t + 1:
        raise ValueError(f"dist.roles=split needs at least dist.target_ranks+1 = {n_t + 1} processes, got {world}")
    drafters = list(range(world - n_t))
    targets = list(range(world - n_t, world))
    role = "drafter" if rank in drafters else "target"
    return Roles(rank=rank, world_size=world, role=role, drafters=drafters, targets=targets, local_rank=local)


# Per-buffer GPU time of the target forward and of the drafter step (forward + backward + optimizer) at the
# Qwen3.6-27B-like shape, measured on one H200 at commit 0969e1c (docs/perf.md): the packed target forward with
# varlen attention alone, 1649.7 ms (bench/target_forward.py), which is all a target rank of a split job runs; the
# drafter's forward + backward 1125.2 ms + optimizer 43.8 ms at the real 248,320-row vocabulary (bench/step_phases.py).
# (Issue 11's first figures, 2.05 s : 0.85 s, were a sdpa-era forward and a 32k vocabulary.)
TARGET_FORWARD_S = 1.65
DRAFTER_STEP_S = 1.17


def balanced_target_ranks(world: int, target_s: float = TARGET_FORWARD_S, drafter_s: float = DRAFTER_STEP_S) -> int:
    """How many of `world` ranks should run the target so the pipeline moves the most buffers per second.

    t target ranks make t / target_s buffers per second, the other world - t drafter ranks consume
    (world - t) / drafter_s; the pipeline runs at the smaller of the two. At 1.65 : 1.17 that is 5 of 8 ranks
    (drafter-bound at 2.56 buffers/s; 4 of 8 would be target-bound at 2.42). Ties go to fewer target ranks (more
    drafters share the optimizer work).
    """
    if world < 2:
        raise ValueError(f"a split layout needs at least 2 ranks, got {world}")
    if target_s <= 0 or drafter_s <= 0:
        raise ValueError(f"per-step times must be positive, got target {target_s} and drafter {drafter_s}")
    return max(range(1, world), key=lambda t: (min(t / target_s, (world - t) / drafter_s), -t))


def init_distributed(roles: Roles, device: torch.device, backend: str = "auto", timeout_s: float = 1800.0) -> None:
    """Join the torchrun process group (nothing to do for a single process); every operation of the group fails after
    `timeout_s` rather than waiting forever for a peer that is gone or stuck."""
    if roles.world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


# ---------------------------------------------------------------------------------------------- the plan
def total_steps_for(buffers_per_epoch: int, epochs: int, max_steps: int | None, n_drafters: int) -> int:
    """Optimizer steps of the run: one buffer per drafter rank per step."""
    full = (buffers_per_epoch * epochs) // n_drafters
    if max_steps is not None:
        return max_steps
    if full < 1:
        raise ValueError(f"one epoch has {buffers_per_epoch} buffers, fewer than the {n_drafters} drafter ranks")
    return full


def epochs_needed(buffers_per_epoch: int, total_steps: int, n_drafters: int) -> int:
    return max(1, -(-(total_steps * n_drafters) // buffers_per_epoch))


def drafter_feed(buffers_per_epoch: Sequence[int], total_steps: int, n_drafters: int, d: int) -> list[Key]:
    """The keys drafter d receives, in order: the global buffer stream (epoch by epoch), dealt round-robin."""
    keys: list[Key] = []
    need = total_steps * n_drafters
    g = 0
    for e, n in enumerate(buffers_per_epoch):
        for i in range(n):
            if g >= need:
                return keys
            if g % n_drafters == d:
                keys.append((e, i))
            g += 1
    if len(keys) < total_steps:
        raise ValueError(f"schedule has {g} buffers, fewer than the {need} the plan needs")
    return keys


# ---------------------------------------------------------------------------------------------- reservoir
class Reservoir:
    """A bounded bag of buffers; `take` returns a uniformly random one (seeded), so each step mixes lengths.

    Nothing is ever dropped or duplicated: `put` refuses when full, `take` removes what it returns. The order of the
    internal list is part of the state (restored exactly on resume) because `take` indexes into it.
    """

    def __init__(self, capacity: int, seed: int) -> None:
        if capacity < 1:
            raise ValueError(f"reservoir capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rng = random.Random(f"dflash-reservoir:{seed}")
        self._items: list[tuple[Key, Any]] = []

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self.capacity

    def put(self, key: Key, payload: Any) -> None:
        if self.full():
            raise RuntimeError(f"reservoir is full ({self.capacity}); take before putting")
        self._items.append((key, payload))

    def take(self) -> tuple[Key, Any]:
        if not self._items:
            raise RuntimeError("reservoir is empty")
        j = self._rng.randrange(len(self._items))
        self._items[j], self._items[-1] = self._items[-1], self._items[j]
        return self._items.pop()

    def keys(self) -> list[Key]:
        return [k for k, _ in self._items]

    def rng_state(self) -> Any:
        return self._rng.getstate()

    def set_rng_state(self, state: Any) -> None:
        self._rng.setstate(state)


# ---------------------------------------------------------------------------------------------- buffers -> DraftBatch
@dataclass
class HostBuffer:
    """One buffer laid out on the host (CPU work only): what the target forward and the DraftBatch need."""

    arrays: dict[str, torch.Tensor]  # buffer_arrays: [token_budget] ids, loss mask, positions, doc ids
    real: int  # real tokens (the rest of the token budget is padding)
    rows: tuple[torch.Tensor, torch.Tensor] | None  # packing pad: [R, T] right-padded ids and attention mask
    packed_ids: torch.Tensor | None  # packing varlen: [1, N] ids of the packed row
    cu_seqlens: torch.Tensor | None  # packing varlen: [D+1] boundaries (a dummy tail document when fixed_shape)


def prepare_buffer(corpus: TokenizedCorpus, pieces: Sequence[Piece], token_budget: int, packing: str,
                   fixed_shape: bool = False) -> HostBuffer:
    """The host half of a buffer: ids, masks and boundaries, without touching the GPU (bench/ times it apart).

    fixed_shape: the packed row is always token_budget long, its padding tail one more (dummy) document, so the
    target forward sees one shape per run (what compiling it or capturing a CUDA graph needs); its states are
    dropped. Costs the forward over the tail.
    """
    arrays = buffer_arrays(corpus, pieces, token_budget)
    lengths = [n for _, _, n in pieces]
    real = sum(lengths)
    if packing != "varlen":
        return HostBuffer(arrays, real, buffer_rows(corpus, pieces, pad_id=0), None, None)
    bounds = [0, *itertools.accumulate(lengths)]
    n = real
    if fixed_shape and real < token_budget:
        bounds.append(token_budget)
        n = token_budget
    cu = torch.tensor(bounds, dtype=torch.int32)
    return HostBuffer(arrays, real, None, arrays["input_ids"][:n].unsqueeze(0), cu)


def run_target(target: Any, host: HostBuffer, token_budget: int) -> DraftBatch:
    """The device half: the target forward over a prepared buffer -> a fixed-shape DraftBatch of token_budget."""
    kh = target.hidden_size * len(target.tap_layers)
    real = host.real
    if host.packed_ids is not None:
        assert host.cu_seqlens is not None
        hs = target.hidden_states_packed(host.packed_ids, host.cu_seqlens)[0]
        # A copy out of the inference-mode result (the drafter saves it for backward); a fixed shape's dummy tail
        # stays zero like any padding.
        hidden = torch.zeros(token_budget, kh, dtype=target.dtype, device=target.device)
        hidden[:real] = hs[:real]
    else:
        assert host.rows is not None
        ids, att = host.rows
        hs = target.hidden_states(ids, att)  # [R, T, KH]
        hidden = torch.zeros(token_budget, kh, dtype=target.dtype, device=target.device)
        hidden[:real] = hs[att.to(hs.device).bool()]  # row-major order == the packed order of buffer_arrays
    # The small per-token arrays follow on the same stream without a sync: a plain (pageable) host-to-device copy
    # later, in the drafter step, would make the host wait for this whole forward before launching the drafter.
    a = {k: to_device(v, target.device) for k, v in host.arrays.items()}
    return DraftBatch(hidden=hidden, input_ids=a["input_ids"], loss_mask=a["loss_mask"],
                      position_ids=a["position_ids"], doc_ids=a["doc_ids"])


def compute_batch(target: Any, corpus: TokenizedCorpus, pieces: Sequence[Piece], token_budget: int,
                  fixed_shape: bool = False) -> DraftBatch:
    """Run the target on one buffer and lay the result out as a fixed-shape DraftBatch of token_budget positions."""
    return run_target(target, prepare_buffer(corpus, pieces, token_budget, target.packing, fixed_shape), token_budget)


def batch_real_tokens(batch: DraftBatch) -> int:
    return int((batch.doc_ids >= 0).sum())


# ---------------------------------------------------------------------------------------------- wire format
# One buffer on the wire: an int64 header+fields tensor [2 + 4N] (epoch, index, ids, loss_mask, positions, doc ids)
# and the hidden tensor [N, KH]. Both shapes are fixed by the config, so nothing but the payload varies.
def _pack_ints(key: Key, b: DraftBatch) -> torch.Tensor:
    return torch.cat([torch.tensor(key, dtype=torch.long), b.input_ids.long().cpu(), b.loss_mask.long().cpu(),
                      b.position_ids.long().cpu(), b.doc_ids.long().cpu()])


def _unpack_ints(t: torch.Tensor, n: int) -> tuple[Key, dict[str, torch.Tensor]]:
    key = (int(t[0]), int(t[1]))
    f = t[2:].view(4, n)
    return key, {"input_ids": f[0].clone(), "loss_mask": f[1].bool(), "position_ids": f[2].clone(),
                 "doc_ids": f[3].clone()}


def comm_device(device: torch.device) -> torch.device:
    """NCCL moves CUDA tensors only; gloo moves CPU tensors."""
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def send_object(obj: Any, dst: int, device: torch.device) -> None:
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    dev = comm_device(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.long, device=dev), dst)
    dist.send(data.to(dev), dst)


def recv_object(src: int, device: torch.device) -> Any:
    dev = comm_device(device)
    n = torch.zeros(1, dtype=torch.long, device=dev)
    dist.recv(n, src)
    data = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    dist.recv(data, src)
    return json.loads(bytes(data.cpu().tolist()).decode())


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass
class TargetInfo:
    """What a drafter rank needs from the target without loading it: shapes, taps and the frozen embedding/LM head."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    tap_layers: list[int]
    dtype: torch.dtype
    kernels: dict[str, str]
    packing: str
    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    @classmethod
    def from_target(cls, t: Any) -> TargetInfo:
        return cls(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_layers=t.num_layers,
                   tap_layers=list(t.tap_layers), dtype=t.dtype, kernels=dict(t.kernels), packing=t.packing,
                   embed_tokens=t.embed_tokens, lm_head=t.lm_head)


def send_target_info(info: TargetInfo, dst: int, device: torch.device) -> None:
    meta = {"hidden_size": info.hidden_size, "vocab_size": info.vocab_size, "num_layers": info.num_layers,
            "tap_layers": info.tap_layers, "dtype": _DTYPE_NAMES[info.dtype], "kernels": info.kernels,
            "packing": info.packing, "embed_shape": list(info.embed_tokens.weight.shape),
            "head_shape": list(info.lm_head.weight.shape), "head_bias": info.lm_head.bias is not None}
    send_object(meta, dst, device)
    dev = comm_device(device)
    dist.send(info.embed_tokens.weight.detach().to(dev).contiguous(), dst)
    dist.send(info.lm_head.weight.detach().to(dev).contiguous(), dst)
    if info.lm_head.bias is not None:
        dist.send(info.lm_head.bias.detach().to(dev).contiguous(), dst)


def recv_target_info(src: int, device: torch.device) -> TargetInfo:
    meta = recv_object(src, device)
    dtype = _NAME_DTYPES[meta["dtype"]]
    dev = comm_device(device)
    emb = torch.zeros(meta["embed_shape"], dtype=dtype, device=dev)
    dist.recv(emb, src)
    head = torch.zeros(meta["head_shape"], dtype=dtype, device=dev)
    dist.recv(head, src)
    embed_tokens = nn.Embedding(*meta["embed_shape"], device=device, dtype=dtype)
    embed_tokens.weight.data.copy_(emb)
    lm_head = nn.Linear(meta["head_shape"][1], meta["head_shape"][0], bias=meta["head_bias"], device=device,
                        dtype=dtype)
    lm_head.weight.data.copy_(head)
    if meta["head_bias"]:
        bias = torch.zeros(meta["head_shape"][0], dtype=dtype, device=dev)
        dist.recv(bias, src)
        lm_head.bias.data.copy_(bias)
    embed_tokens.requires_grad_(False)
    lm_head.requires_grad_(False)
    return TargetInfo(hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"], num_layers=meta["num_layers"],
                      tap_layers=list(meta["tap_layers"]), dtype=dtype, kernels=dict(meta["kernels"]),
                      packing=meta["packing"], embed_tokens=embed_tokens, lm_head=lm_head)


# ---------------------------------------------------------------------------------------------- feeds
@dataclass
class FeedState:
    """Where one drafter's feed stands: how many keys went into its reservoir, and which are still in there."""

    received: int = 0
    reservoir: list[Key] = field(default_factory=list)
    rng: Any = None

    def to_json(self) -> dict[str, Any]:
        rng = None if self.rng is None else [self.rng[0], list(self.rng[1]), self.rng[2]]
        return {"received": self.received, "reservoir": [list(k) for k in self.reservoir], "rng": rng}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FeedState:
        rng = obj.get("rng")
        return cls(received=int(obj["received"]), reservoir=[(int(a), int(b)) for a, b in obj["reservoir"]],
                   rng=None if rng is None else (rng[0], tuple(rng[1]), rng[2]))


def refeed(feed: Sequence[Key], state: FeedState) -> list[Key]:
    """What a drafter must (re)receive after a resume: its reservoir content first, then the rest of its feed."""
    return [*state.reservoir, *feed[state.received:]]


def target_worklist(refeeds: Sequence[Sequence[Key]], n_targets: int, t: int) -> list[tuple[int, int, Key]]:
    """Items (seq, drafter index, key) that target t serves, in the one global order every rank agrees on.

    Item j of drafter d has sequence number j * n_drafters + d and goes to target seq % n_targets. Every target sends
    and every drafter receives in increasing seq, so the blocking point-to-point exchange can never deadlock.
    """
    n_d = len(refeeds)
    out = []
    for j in range(max((len(r) for r in refeeds), default=0)):
        for d in range(n_d):
            if j < len(refeeds[d]):
                s = j * n_d + d
                if s % n_targets == t:
                    out.append((s, d, refeeds[d][j]))
    return out


class Feeder:
    """The drafter side of the pipeline: fills its reservoir from a source and hands out one buffer per step.

    `source(key)` produces the DraftBatch for a key: the local target in colocated mode, a receive from the right
    target rank in split mode. Source calls happen in feed order, which is what makes both modes identical.
    """

    def __init__(self, keys: Sequence[Key], capacity: int, seed: int, source: Callable[[int, Key], DraftBatch],
                 state: FeedState | None = None) -> None:
        self.feed = list(keys)
        self.reservoir = Reservoir(capacity, seed)
        self.source = source
        state = state or FeedState()
        self._refeed = refeed(self.feed, state)  # keys to put, in order
        self._seq = 0  # next index into the refeed (also the item number the target worklist uses)
        self.received = state.received
        self._restoring = len(state.reservoir)  # the first puts re-create the checkpointed reservoir
        if state.rng is not None:
            self.reservoir.set_rng_state(state.rng)
        self.last_wait_s = 0.0

    def _pending(self) -> int:
        return len(self._refeed) - self._seq

    def _put_one(self) -> None:
        key = self._refeed[self._seq]
        batch = self.source(self._seq, key)
        self._seq += 1
        self.reservoir.put(key, batch)
        if self._restoring:
            self._restoring -= 1
        else:
            self.received += 1

    def remaining(self) -> int:
        return self._pending() + len(self.reservoir)

    def next(self) -> tuple[Key, DraftBatch]:
        t0 = time.perf_counter()
        while self._pending() and (not self.reservoir.full() or self._restoring):
            self._put_one()
        self.last_wait_s = time.perf_counter() - t0
        return self.reservoir.take()

    def state(self) -> FeedState:
        return FeedState(received=self.received, reservoir=self.reservoir.keys(), rng=self.reservoir.rng_state())

    def pending_targets(self, roles: Roles) -> list[int]:
        """Target ranks that still expect to serve this drafter (they must be told to stop when it stops early)."""
        n_targets = len(roles.lane(roles.rank)[1])
        out = {roles.target_for(j, roles.rank) for j in range(self._seq, min(len(self._refeed), self._seq + n_targets))}
        return sorted(out)


# ---------------------------------------------------------------------------------------------- split mode transport
_GO, _STOP = 1, 0


class RemoteSource:
    """Drafter side of split mode: ask the owning target rank for the next buffer, then receive it."""

    def __init__(self, roles: Roles, token_budget: int, kh: int, dtype: torch.dtype, device: torch.device) -> None:
        self.roles = roles
        self.n = token_budget
        self.kh = kh
        self.dtype = dtype
        self.device = device
        self.dev = comm_device(device)

    def __call__(self, j: int, key: Key) -> DraftBatch:
        src = self.roles.target_for(j, self.roles.rank)
        dist.send(torch.tensor([_GO], dtype=torch.long, device=self.dev), src)
        ints = torch.zeros(2 + 4 * self.n, dtype=torch.long, device=self.dev)
        hidden = torch.zeros(self.n, self.kh, dtype=self.dtype, device=self.dev)
        dist.recv(ints, src)
        dist.recv(hidden, src)
        got, f = _unpack_ints(ints.cpu(), self.n)
        if got != key:
            raise RuntimeError(f"split pipeline out of step: expected buffer {key}, target rank {src} sent {got}")
        return DraftBatch(hidden=hidden.to(self.device), input_ids=f["input_ids"], loss_mask=f["loss_mask"],
                          position_ids=f["position_ids"], doc_ids=f["doc_ids"])

    def stop(self, targets: Sequence[int]) -> None:
        """Tell the target ranks that still hold work for us that we are done (non-blocking sends, then wait)."""
        msgs = [torch.tensor([_STOP], dtype=torch.long, device=self.dev) for _ in targets]
        reqs = [dist.isend(m, t) for m, t in zip(msgs, targets, strict=True)]
        for r in reqs:
            r.wait()


def serve_target(roles: Roles, target: Any, corpus: TokenizedCorpus, schedule: Schedule,
                 refeeds: Sequence[Sequence[Key]], token_budget: int, device: torch.device,
                 on_item: Callable[[int], None] | None = None) -> int:
    """Target rank loop: compute each buffer of its worklist ahead, send it when its drafter asks; return items sent.

    The target runs one buffer ahead of the drafter (it computes the next while the drafter trains), in this process's
    main thread: no thread touches the GPU.
    """
    lane_drafters, lane_targets = roles.lane(roles.rank)
    lane_refeeds = [refeeds[roles.drafters.index(r)] for r in lane_drafters]
    work = target_worklist(lane_refeeds, len(lane_targets), lane_targets.index(roles.rank))
    dev = comm_device(device)
    stopped: set[int] = set()
    sent = 0
    for _seq, d, key in work:
        if d in stopped:
            continue
        peer = lane_drafters[d]
        batch = compute_batch(target, corpus, schedule.buffer(key), token_budget)
        ints = _pack_ints(key, batch).to(dev)
        hidden = batch.hidden.to(dev).contiguous()
        flag = torch.zeros(1, dtype=torch.long, device=dev)
        dist.recv(flag, peer)
        if int(flag.item()) == _STOP:
            stopped.add(d)
            if len(stopped) == len(lane_drafters):
                break
            continue
        dist.send(ints, peer)
        dist.send(hidden, peer)
        sent += 1
        if on_item is not None:
            on_item(sent)
    return sent
