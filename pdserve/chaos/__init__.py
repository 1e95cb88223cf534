"""Chaos runs: faults under load against a `pdserve up` cluster (see run.py)."""
