"""The runtime both worker roles share (`prefill_node`, `decode_node` build on it): the engine
on its own thread, NIXL agent, etcd registration, KV events, the `Worker` gRPC service,
/metrics and draining (runtime.py); the flags both roles take (args.py); the one mapping from
exceptions to gRPC status codes (grpc_errors.py). Importing the package loads nothing heavy."""
