"""Real test infrastructure for opsctl: an OpenSSH sshd on loopback and a Proxmox `pct` stand-in with namespaces.

Nothing here fakes a protocol: sshd, tmux, unshare and nsenter are the real programs; only Proxmox is stood in for.
"""
