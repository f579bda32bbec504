"""A block's dense MLP (megatronish.model.block's MLP), ``BlockComponents.mlp``: gelu (up, GELU,
down) or swiglu (gate and up, SiLU(gate) * up, down); the first projection column-parallel, down
row-parallel, biased with ``BlockComponents.linear_bias``."""

from __future__ import annotations

from megatronish.config.schema import ModelConfig


def first_weights(model: ModelConfig) -> int:
    """Weights of the first projection: gate and up (swiglu) or up."""
    return 2 if model.components.gated_mlp else 1


def first_name(model: ModelConfig) -> str:
    """The first projection's name in the accounting's rows."""
    return "MLP up and gate" if model.components.gated_mlp else "MLP up"


def keeps_gathered(model: ModelConfig) -> bool:
    """Whether the first projection keeps the input it gathers under sequence parallelism for
    its weight gradients: gate and up share one gather (layers.linear.shared_input_linears,
    which keeps it); a lone up gathers again in backward."""
    return first_weights(model) > 1


def matmul_params(model: ModelConfig, f: int) -> int:
    """Weights of an MLP f wide (d_ff, or a tp rank's d_ff / t)."""
    return (first_weights(model) + 1) * model.d_model * f


def parameters(model: ModelConfig, f: int) -> int:
    """Parameters of an MLP f wide: its weights, and the first projection's biases (gate and
    up, or up) and the down one."""
    biases = first_weights(model) * f + model.d_model if model.components.linear_bias else 0
    return matmul_params(model, f) + biases


def sp_replicated(model: ModelConfig) -> int:
    """Of ``parameters``, those replicated on the tp ranks whose gradients are summed over tp
    under sequence parallelism: the down projection's bias."""
    return model.d_model if model.components.linear_bias else 0


def activations(model: ModelConfig) -> tuple[int, int]:
    """What it keeps per layer in 16-bit s b h (Korthikanti et al. 2022, at d_ff = 4 d_model;
    the same for swiglu and a MoE MLP, within a few percent): (whole on every tp rank without
    sequence parallelism: its input (2) and the dropout mask after it (1); split over tp: the
    first projection's output and the activation's (8 each))."""
    return 3, 16


def gemms(model: ModelConfig, T: int, f: int) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of the forward GEMMs of T tokens through an MLP f wide: the first
    projection and down."""
    h = model.d_model
    return [(T, first_weights(model) * f, h), (T, h, f)]


def activation_elements(model: ModelConfig, T: int, f: int) -> int:
    """Elements the activation reads and writes forward on T tokens f wide: read + write
    (gelu), read 2 and write 1 (swiglu)."""
    return T * f * (first_weights(model) + 1)
