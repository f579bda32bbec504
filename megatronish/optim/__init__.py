"""The optimizer step: AdamW, ZeRO ownership (ZeRO-3: the sharded parameters), the gradient
buffer and its bucketed, overlapped reductions, gradient clipping."""

# ZeRO-2 and 3: reduce-scatters of micro-batch gradients outstanding at once, each holding its
# bucket-sized tensor until its block is added to the kept one (the gradient buffer's limit,
# and the memory estimate's).
IN_FLIGHT = 2
