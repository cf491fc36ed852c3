"""The remote side (the wing): everything that runs on a host, stdlib only, and the rules the client shares with it.

base (stream, limits, the bundle loader) and rules (event contract, crash line, ETA, tau, memory) are read by the
client too; attempts, thin, procs, follow, cache, agent (the verbs) and wrapper (the run's supervisor in tmux) are
shipped only: the client reads them as text for the agent's blob (opsctl/channel.py, base.shipped_script) and never
imports them. A host needs only python3.
"""
