"""Block-hash agreement: every process of a cluster must hash the same tokens the same way.

Prefix affinity works only if the router's block hashes (engine/kv/block_hash.py, computed for
each worker's block size, KV cache dtype and weights version) equal the hashes in the
worker's prefix cache, and a peer can only reuse KV it finds under the same hash. A worker
running other hashing code (another pdserve version, another salt handling) would otherwise
get 0% hits, silently. So each worker publishes `WorkerInfo.block_hash_probe`
(`engine.kv.block_hash.block_hash_probe` of its own settings), and:

- a starting worker refuses to start (`check_peers` raises `BlockHashMismatch`; exit code 2)
  when a registered worker with the same KV layout (compat hash) and weights version
  publishes another probe;
- the router (router/placement/registry.py) and `pdserve status` recompute the probe for each
  registration's settings (`probe_refusal`) and refuse a worker whose published one differs.

An empty probe (a worker older than the probe) is never refused.
"""

from __future__ import annotations

from cluster.registration import RegistrationRefused, WorkerInfo
from engine.kv.block_hash import block_hash_probe

REASON = "block_hash_mismatch"
"""The refusal's reason (the router metric's label, `pdserve status`)."""


class BlockHashMismatch(RegistrationRefused):
    """A starting worker hashes blocks differently from a registered worker of its layout."""


def expected_probe(info: WorkerInfo) -> str:
    """The probe this process computes for `info`'s block size, KV cache dtype and weights
    version."""
    return block_hash_probe(info.block_size, info.kv_cache_dtype, info.weights_version)


def probe_refusal(info: WorkerInfo) -> str | None:
    """Why `info` is refused for its published probe (None: it agrees or publishes none)."""
    if not info.block_hash_probe or info.block_size <= 0:
        return None
    expected = expected_probe(info)
    if info.block_hash_probe == expected:
        return None
    return (
        f"its block-hash probe {info.block_hash_probe} differs from {expected}, the probe "
        f"computed here for block size {info.block_size}, KV cache dtype "
        f"{info.kv_cache_dtype}, weights version {info.weights_version}: it hashes the same "
        "tokens differently (another pdserve version?), so no prefix-cache or KV-index "
        "match with it could ever hit"
    )


def check_peers(own: WorkerInfo, others: list[WorkerInfo]) -> None:
    """Raise BlockHashMismatch, naming the other worker and both probes, when a registered
    worker with `own`'s compat hash and weights version publishes a non-empty probe other
    than `own`'s (the Registrar's startup check)."""
    for other in others:
        if other.worker_id == own.worker_id or not other.block_hash_probe:
            continue
        if (other.compat_hash, other.weights_version) != (own.compat_hash, own.weights_version):
            continue
        if other.block_hash_probe != own.block_hash_probe:
            raise BlockHashMismatch(
                f"refusing to start: registered worker {other.worker_id} ({other.role} at "
                f"{other.grpc_address}) has this worker's KV layout (compat hash "
                f"{own.compat_hash}) and weights version {own.weights_version} but block-hash "
                f"probe {other.block_hash_probe}, while this worker ({own.worker_id}) computes "
                f"{own.block_hash_probe}: the two hash the same tokens differently (different "
                "pdserve versions?), so prefix caching across them would silently never hit. "
                "Run the same pdserve version on every worker of the cluster"
            )
