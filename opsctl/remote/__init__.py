"""The remote side's shared wing: what the agent, the run's wrapper and the client all read, stdlib only.

Shipped to hosts inside the agent's blob (opsctl/channel.py) and the wrapper file (base.splice), so a host needs
only python3; the client imports the same modules, never the agent's verbs.
"""
