"""What workers and the router share about the cluster: etcd (the server launcher and worker
registration: what a worker publishes, under which key, kept alive by a lease; the listing the
router and `pdserve status` read), the one reconnect loop, loopback helpers, and the
protobuf <-> engine type conversions used on both ends of the gRPC calls."""
