"""The optimizer's arithmetic: the interface the ZeRO levels and the checkpoint call
(optim.interface) and its optimizers by name (optim.registry: AdamW), the learning-rate
schedule, gradient clipping.

IN_FLIGHT belongs to data parallelism's ZeRO-2 and 3 (megatronish.data_parallel.zero2): the
reduce-scatters of micro-batch gradients outstanding at once, each holding its bucket-sized
tensor until its shard is added to the kept one (and with optim.grad_reduce_dtype bf16, ZeRO-0
and 1's bf16 copies of buckets in flight); the memory estimate reads it here.
"""

IN_FLIGHT = 2
