"""Cluster plumbing shared by workers and router: the etcd server launcher, worker
registration (what a worker publishes, under which key, kept alive by a lease) and the
registry watch the router places requests from."""
