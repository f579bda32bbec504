"""Seeing into a run: per-rank phase times and stragglers, peak memory, a flight recorder of
collectives for hang reports, profiler traces and TensorBoard."""
