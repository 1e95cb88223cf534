"""What checking a registration costs (cluster/registration_check.py, docs/security.md).

Parses the same registration documents two ways, in turns, in one process:
- "before": what `WorkerInfo.from_json` did before the check (json.loads, Capacity, the
  dataclass), reproduced here;
- "after": `WorkerInfo.from_json` now (json.loads, the whole check, the dataclass).
Two documents: a typical worker's (a few hundred bytes of kv metadata, 2 LoRAs) and a large
one (64 KiB of kv metadata, 256 LoRAs). Prints the median time per parse over `--rounds`
rounds of `--parses` parses each, and after / before.

    .venv/bin/python benchmarks/registration_check_bench.py [--parses 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from typing import Callable

from cluster.registration import Capacity, WorkerInfo


def old_from_json(data: bytes) -> WorkerInfo:
    """The parse before issue 51 (no check but the role's)."""
    doc = json.loads(data)
    doc["capacity"] = Capacity.from_dict(doc.get("capacity", {}))
    doc["resident_loras"] = tuple(doc.get("resident_loras", ()))
    return WorkerInfo(**doc)


def document(metadata_bytes: int, loras: int) -> bytes:
    info = WorkerInfo(
        "decode-10.0.3.17-50051",
        "decode",
        "10.0.3.17:50051",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "9f2c4e1a" * 8,
        16,
        kv_metadata=base64.b64encode(bytes(range(256)) * (metadata_bytes // 256)).decode(),
        metrics_address="10.0.3.17:9100",
        capacity=Capacity(
            total_blocks=4096,
            free_blocks=3000,
            running=12,
            waiting=3,
            queued_prefill_tokens=2048,
            prefill_tokens_per_s=5321.5,
            decode_step_s=0.021,
            decode_step_tokens=12.0,
            max_num_batched_tokens=8192,
        ),
        updated_at=time.time(),
        max_model_len=8192,
        loras={f"adapter-{i}": f"/adapters/adapter-{i}" for i in range(loras)},
        resident_loras=tuple(f"adapter-{i}" for i in range(min(loras, 4))),
        block_hash_probe="ab" * 16,
    )
    return info.to_json()


def per_parse(parse: Callable[[bytes], WorkerInfo], data: bytes, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        parse(data)
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parses", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from cpu_info import cpu_isa  # benchmarks/ sibling

    print(f"CPU: {cpu_isa()}")
    docs = {"typical (512 B metadata, 2 LoRAs)": document(512, 2)}
    docs["large (64 KiB metadata, 256 LoRAs)"] = document(64 << 10, 256)
    for name, data in docs.items():
        assert old_from_json(data) == WorkerInfo.from_json(data)
        n = args.parses if len(data) < 4096 else max(1, args.parses // 20)
        before, after = [], []
        for _ in range(args.rounds):
            before.append(per_parse(old_from_json, data, n))
            after.append(per_parse(WorkerInfo.from_json, data, n))
        b, a = statistics.median(before), statistics.median(after)
        print(
            f"{name}: {len(data)} bytes; before {b * 1e6:.1f} us, after {a * 1e6:.1f} us "
            f"per parse; after / before {a / b:.2f}"
        )


if __name__ == "__main__":
    main()
