"""`pdserve up`, `pdserve scale`, `pdserve status`: a whole local cluster (etcd, router,
prefill and decode workers) as child processes of one supervisor (supervisor.py), scaled over
its loopback control port (control.py); cli.py adds the subcommands; launcher.py starts and
stops one child `pdserve` process (also used by benchmarks and multi-process tests)."""
