"""`pdserve up`, `pdserve scale`, `pdserve status`: a whole local cluster (etcd, router,
prefill and decode workers) as child processes of one supervisor (supervisor.py); launcher.py
starts and stops one child `pdserve` process (also used by benchmarks and multi-process tests)."""
