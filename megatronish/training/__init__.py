"""A training run: setup, the step loop, its checkpoint hooks, metrics and what it does when
something goes wrong."""
