"""The head dims the Triton attention kernels take (kernels/attention_tiles.py tiles them) and
those of the Triton gated delta rule (ops.gated_delta), and the check of a config that asks for
those kernels."""

from __future__ import annotations

from megatronish.config.rules import require
from megatronish.config.schema import Config

TRITON_HEAD_DIMS = (16, 32, 64, 128)
"""The head dims the Triton attention kernels compile for (query-key and value dims equal)."""

TRITON_QK_HEAD_DIMS = tuple(
    sorted(d + rest for d in TRITON_HEAD_DIMS for rest in (0, *TRITON_HEAD_DIMS) if rest < d)
)
"""The query-key head dims the Triton attention kernels take beside a value head dim of
TRITON_HEAD_DIMS: one of those, or one plus a smaller one, which the kernels tile as two
parts (DeepSeek's latent attention: 192 = 128 + 64)."""


TRITON_GATED_DELTA_DIMS = (16, 32, 64, 128)
"""The key and value head dims the Triton gated-delta-rule kernels take (the linear attention's
model.linear_key_head_dim and linear_value_head_dim)."""


def triton_attention_dims_ok(qk_dim: int, v_dim: int) -> bool:
    """Whether the Triton attention kernels take query-key head dim qk_dim (queries and keys)
    with value head dim v_dim (values and the output)."""
    return qk_dim in TRITON_QK_HEAD_DIMS and v_dim in TRITON_HEAD_DIMS


def triton_attention_dims_hint() -> str:
    """The head dims triton_attention_dims_ok takes, in words for a one-line error."""
    return (
        f"valid query-key head dims: {', '.join(map(str, TRITON_QK_HEAD_DIMS))}; valid value "
        f"head dims: {', '.join(map(str, TRITON_HEAD_DIMS))}"
    )


def check_triton_head_dims(cfg: Config, head_dim: int) -> None:
    """The head dims the Triton attention and gated-delta-rule kernels take, when
    kernels.backend is triton."""
    if cfg.kernels.backend != "triton":
        return
    model = cfg.model
    if "linear_attention" in (model.layer_types or ()):
        _check_linear_head_dims(model.linear_key_head_dim, model.linear_value_head_dim)
    if model.attention == "mla":
        mla = model.mla
        require(
            triton_attention_dims_ok(head_dim, mla.v_head_dim),
            f"model.mla: query-key head dim {head_dim} (qk_nope_head_dim + qk_rope_head_dim) and "
            f"v_head_dim {mla.v_head_dim} are not supported by kernels.backend=triton; "
            f"{triton_attention_dims_hint()} (or kernels.backend=torch)",
        )
        return
    require(
        head_dim in TRITON_HEAD_DIMS,
        f"model.head_dim: {head_dim} is not supported by kernels.backend=triton; valid head dims: "
        f"{', '.join(map(str, TRITON_HEAD_DIMS))} (or kernels.backend=torch)",
    )


def _check_linear_head_dims(key_dim: int, value_dim: int) -> None:
    for name, dim in (("linear_key_head_dim", key_dim), ("linear_value_head_dim", value_dim)):
        require(
            dim in TRITON_GATED_DELTA_DIMS,
            f"model.{name}: {dim} is not supported by kernels.backend=triton (the gated delta "
            f"rule's kernels); valid model.linear_key_head_dim and linear_value_head_dim: "
            f"{', '.join(map(str, TRITON_GATED_DELTA_DIMS))} (or kernels.backend=torch or auto)",
        )
