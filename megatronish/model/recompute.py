"""Activation recompute (train.activation_checkpointing): torch's checkpoint with the RNG
tracker's streams replayed, so a recomputed region draws the same dropout masks."""

from __future__ import annotations

import torch.utils.checkpoint

from megatronish.distributed.layout import RNGTracker
from megatronish.moe.layer import recomputing


def checkpoint(fn, tracker: RNGTracker, *args):
    """torch.utils.checkpoint that also replays the tracker's streams on recompute, so
    dropout inside the recomputed region draws the same masks as the first forward (and MoE
    layers do not count their routing twice)."""
    snapshot = tracker.get_states()
    calls = [0]

    def run(*inner):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inner)
        after = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            with recomputing():
                return fn(*inner)
        finally:
            tracker.set_states(after)

    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True
    )
