"""Counting, from a config alone: parameters (parameters), model FLOPs (flops), the
collectives and bytes a rank sends per step (collectives), memory per rank (memory), the
GPUs' data sheets (hardware), and the time of a step: kernels on a roofline (roofline), a
layer's compute (layer_time), the collectives on their links (comm_time), the step with its
overlaps, bubble and optimizer (step_time). `check`, `plan` and `bench` read them; the
tests hold the wire to them. Pure functions: nothing here starts a process group or touches a
device. Import the submodule you need; this package imports none of them."""
