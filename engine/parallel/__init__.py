"""Tensor and expert parallelism: a worker as a group of processes (docs/parallelism.md).

Rank 0 is the worker to the outside world (scheduler, block manager, sampling); it sends each
step's inputs (step.py) to ranks 1..N-1 (rank_worker.py), which the group (group.py) started
and supervises; every rank runs the forward over its shard of the weights (shard.py, sliced
by engine/models/tp_slices.py) and its heads' KV, combining partial results through the
communicator (communicator.py; fake.py for single-process tests)."""
