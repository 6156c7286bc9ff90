"""The benchmark harness: compare methods against the tuned random baseline, tune it, time steps, report."""
