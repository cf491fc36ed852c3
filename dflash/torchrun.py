"""`python -m dflash.torchrun ARGS`: torchrun (same arguments, same behaviour), except that on a multi-node c10d run
the head node's rendezvous store stays up until every other node has left.

Why: torchrun hosts the c10d store inside the head node's agent. After the agents' exit barrier every agent closes the
rendezvous through that store, so when the head's agent exits first, another node's close fails and a *successful*
run's log ends with "has failed to shutdown the rendezvous ... RendezvousConnectionError" and a C++ stack
(pytorch/pytorch#69197; this project's CI hit it on a two-node group). Here the head process starts the store server
before torchrun does (TCPStore's documented `multi_tenant`: the agent's own store then attaches to this server in the
same process), and after its agent returns it keeps serving until every other node said it left (their agents have
closed the rendezvous by then), at most LINGER_S. Every other node says so after its own agent returned. A signal
(kill) skips the wait. With `--rdzv-conf is_host=...` left out, a single node, or another backend: plain torchrun.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint

LINGER_S = 30.0  # the head's longest wait for the others after its agent returned (a node that died never says so)
SAY_LEFT_TIMEOUT_S = 3.0  # per connect try (TCPStore retries once): how long a node tries to tell the head it left
_TRUE = ("1", "true", "t", "yes", "y")  # RendezvousParameters.get_as_bool's spellings
_FALSE = ("0", "false", "f", "no", "n")


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    run_id: str
    others: int  # the nodes besides this one that say they left (max nodes - 1)
    is_host: bool

    @property
    def left_key(self) -> str:
        return f"dflash.torchrun/{self.run_id}/left"


def rendezvous(argv: list[str]) -> Rendezvous | None:
    """The multi-node c10d rendezvous these torchrun arguments join, when they name who hosts its store."""
    args = torchrun.parse_args(argv)
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    is_host = _parse_rendezvous_config(args.rdzv_conf or "").get("is_host", "").strip().lower()
    if max_nodes < 2 or is_host not in _TRUE + _FALSE:
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_PORT)
    return Rendezvous(host, port, args.rdzv_id, max_nodes - 1, is_host in _TRUE)


def host_store(rdzv: Rendezvous) -> TCPStore | None:
    """The store server, made before torchrun's agent makes it with the same (host, port, multi_tenant) so that the
    agent's store shares it. None when it cannot start here: torchrun then fails or succeeds exactly as it would."""
    try:
        return TCPStore(rdzv.host, rdzv.port, is_master=True, multi_tenant=True, wait_for_workers=False,
                        timeout=timedelta(seconds=60))
    except (RuntimeError, ValueError, TimeoutError):
        return None


def wait_for_others(store: TCPStore, rdzv: Rendezvous, linger_s: float = LINGER_S) -> int:
    """Serve until every other node said it left or `linger_s` passed; returns how many said so."""
    deadline = time.monotonic() + linger_s
    left = 0
    try:
        while (left := store.add(rdzv.left_key, 0)) < rdzv.others and time.monotonic() < deadline:
            time.sleep(0.05)
    except (SignalException, KeyboardInterrupt):  # a kill while waiting: the run has ended, stop serving now
        return left
    if left < rdzv.others:
        print(f"dflash.torchrun: {rdzv.others - left} of {rdzv.others} other nodes did not say they left within "
              f"{linger_s:g} s; closing the rendezvous store", file=sys.stderr, flush=True)
    return left


def say_left(rdzv: Rendezvous) -> bool:
    try:
        client = TCPStore(rdzv.host, rdzv.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=SAY_LEFT_TIMEOUT_S))
        client.add(rdzv.left_key, 1)
        return True
    except (RuntimeError, ValueError, TimeoutError):  # the head is gone (it crashed or was killed): nothing to keep up
        return False


def failed_rank_exit(exc: ChildFailedError) -> int:
    """The exit code of the rank that failed first, said in one line with its error: torchrun itself always exits 1,
    which would hide a rank's own code (2: a refused config or resume) behind a generic failure. A rank ended by a
    signal exits 128 + N, as a shell reports it."""
    rank, failure = exc.get_first_failure()
    code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode if failure.exitcode < 0 else 1
    msg = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message")
    print(f"dflash.torchrun: rank {rank} failed first, exit code {code}" + (f": {msg}" if msg else ""),
          file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rdzv = rendezvous(argv)
    store = host_store(rdzv) if rdzv is not None and rdzv.is_host else None
    try:
        torchrun.main(argv)
    except SignalException:
        rdzv = None  # killed: no waiting and nobody to wait for
        raise
    except ChildFailedError as exc:
        traceback.print_exc()  # torchrun's own report stays in the log as it was (opsctl reads its root cause)
        raise SystemExit(failed_rank_exit(exc)) from None
    finally:
        if rdzv is not None and store is not None:
            wait_for_others(store, rdzv)
        elif rdzv is not None and not rdzv.is_host:
            say_left(rdzv)


if __name__ == "__main__":
    main()
