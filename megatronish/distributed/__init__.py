"""The process groups of a layout and everything that crosses them: the ranks' layout
(tp innermost, then cp, dp with ep inside, pp), the one counted, recorded wrapper of every
collective, shared memory between ranks on one host, the RNG streams of tensor-parallel
regions and recompute, and what /proc says about processes."""
