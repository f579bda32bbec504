"""The optimizer step: AdamW, ZeRO-1 ownership, the gradient buffer and its bucketed,
overlapped reductions, gradient clipping."""
