"""Pipeline parallelism: the order of operations of each schedule (schedule) and the runner
that executes it on one stage, exchanging activations with its neighbours (runner)."""
