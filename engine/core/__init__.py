"""Core scheduling: the scheduler, its step input and output, the request and its
life cycle, step costs and the swap-or-recompute policy."""
