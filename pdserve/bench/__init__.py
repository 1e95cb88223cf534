"""`pdserve bench`: a serving load generator for any OpenAI-compatible server.

  workload.py  request specs (random lengths, shared-prefix multi-tenant), seeded
  client.py    one streamed request -> RequestResult (timestamps, tokens, error)
  runner.py    Poisson arrivals or fixed concurrency, progress bar, overall deadline
  report.py    TTFT / ITL / TPOT / e2e statistics, goodput, JSON, CDF plot
  cli.py       the `bench` subcommand (cheap to import; heavy modules load when it runs)

Run `pdserve bench --help`, or `python -m pdserve.bench --help`; see docs/bench.md."""
