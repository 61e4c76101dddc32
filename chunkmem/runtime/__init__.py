"""The per-step runtime: hooks, the iteration scheduler and tracer, placement policies, Belady's plan, the chunk executor."""
