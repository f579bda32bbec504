"""Typed, strict configuration: the schema (one dataclass per section), loading from YAML and
`--set key=value`, range checks, and the sizes derived from a config and a world size. The names
below are the package's interface; each lives in the module named beside it."""

from megatronish.config.checks import (
    check_dataset_vocab,
    check_output_paths,
    check_values,
    profile_ranks,
    profile_steps,
)
from megatronish.config.derive import (
    Derived,
    attention_window,
    chunk_layers,
    derive,
    layout_notes,
    padded_vocab,
    virtual_stages,
    world_size_of,
)
from megatronish.config.layout_checks import moe_layers
from megatronish.config.load import config_from_dict, load_config
from megatronish.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DPOConfig,
    KernelsConfig,
    ModelConfig,
    MoEConfig,
    MuonConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "Derived",
    "KernelsConfig",
    "ModelConfig",
    "MoEConfig",
    "DPOConfig",
    "MuonConfig",
    "ObserveConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "attention_window",
    "check_dataset_vocab",
    "check_output_paths",
    "check_values",
    "chunk_layers",
    "config_from_dict",
    "derive",
    "layout_notes",
    "load_config",
    "moe_layers",
    "padded_vocab",
    "profile_ranks",
    "profile_steps",
    "virtual_stages",
    "world_size_of",
]
