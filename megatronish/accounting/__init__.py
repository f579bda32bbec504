"""Counting, from a config alone: parameters (parameters), model FLOPs (flops), the
collectives and bytes a rank sends per step (collectives), memory and step time per rank
(memory), and the GPUs' data sheets (hardware). `check`, `plan` and `bench` read them; the
tests hold the wire to them. Pure functions: nothing here starts a process group or touches a
device. Import the submodule you need; this package imports none of them."""
