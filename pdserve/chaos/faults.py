"""Faults for a chaos run, aimed by PID at the children of one `pdserve up` (its control
port lists them). Every fault is one that the cluster must absorb without a failed request:
- kill-prefill / kill-decode: SIGKILL one ready worker (the supervisor restarts it; the
  router migrates what it was serving);
- stall-prefill / stall-decode: SIGSTOP one ready worker for a few seconds, then SIGCONT
  (the router's stall timeout migrates around it);
- restart-etcd: SIGKILL etcd (restarted on the same ports and data; workers re-register);
- restart-router: SIGTERM the router (it drains its streams, the supervisor starts it again
  on the same port; clients retry their connection meanwhile).
Client disconnects at random points are part of the load (load.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass

from cluster.roles import ROLES
from local_cluster.run_file import control_request

KINDS = (
    "kill-prefill",
    "kill-decode",
    "stall-prefill",
    "stall-decode",
    "restart-etcd",
    "restart-router",
)
"""Every fault kind, `<action>-<target>` (the target: a slot role of `pdserve up`)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str  # the slot name
    pid: int
    at: float  # time.monotonic() when applied


class Injector:
    def __init__(self, run: dict, kinds: tuple[str, ...], stall_s: float, seed: int) -> None:
        self.run = run  # the `up`'s run file: its control port and token
        self.kinds = kinds
        self.stall_s = stall_s
        self.rng = random.Random(seed)

    def slots(self) -> list[dict]:
        return json.loads(control_request(self.run))["slots"]

    def inject(self) -> Fault | None:
        """Apply one random fault to a ready target; None if no target is ready now."""
        kind = self.rng.choice(self.kinds)
        action, _, role = kind.partition("-")
        ready = [
            s for s in self.slots() if s["role"] == role and s["state"] == "ready" and s["pid"]
        ]
        if role in ROLES and len(ready) < 2 and action == "kill":
            return None  # keep one of each role serving: a kill is absorbed by its peers
        if not ready:
            return None
        slot = self.rng.choice(ready)
        pid, now = slot["pid"], time.monotonic()
        if action == "kill" or kind == "restart-etcd":
            os.kill(pid, signal.SIGKILL)
        elif action == "stall":
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(self.stall_s)
            finally:
                os.kill(pid, signal.SIGCONT)
        else:  # restart-router
            os.kill(pid, signal.SIGTERM)
        return Fault(kind, slot["name"], pid, now)
