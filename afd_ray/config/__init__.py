"""The one typed config tree of afd_ray.

Built once at the entry point (the `args` of `deployments/*.yaml`, or the CLI) and
passed down in sections: the attention pool gets `AttentionPoolConfig`, the FFN pool
`FFNPoolConfig`, the connector `ConnectorConfig`. Every model is frozen after
validation, forbids unknown keys and takes its values strictly (an integer field
takes an integer, never `"2"`, `2.0` or `true`; a float field also takes an integer;
a flag takes only `true`/`false`), so a typo in a YAML file is an error that names
the field.

One file per part of the tree, after vLLM's `vllm/config/`: `base` (the section base
and shared literals), `model`, `pools` (`attention`, `ffn`), `engine_args` (the check of
`attention.engine_args` against vLLM's `EngineArgs`), `serving` (`connector`,
`ingress`, `autoscale`, `observability`) and `tree` (the root `AFDConfig` and its
cross-section checks); this facade is the import path. `check` (imported on its own:
`afd-ray check`) finds every error of a config file.
"""

from afd_ray.config.base import CudaGraphMode, DType, GatePlacement, IngressPlacement
from afd_ray.config.model import EMBEDDED_MODELS, ModelConfig
from afd_ray.config.pools import EP_IDLE_CHECK_MAX_US, AttentionPoolConfig, FFNPoolConfig, PoolPlacement
from afd_ray.config.serving import (
    BATCH_WINDOW_MAX_US,
    AutoscaleConfig,
    ConnectorConfig,
    IngressConfig,
    ObservabilityConfig,
)
from afd_ray.config.tree import AFDConfig

__all__ = [
    "BATCH_WINDOW_MAX_US",
    "EMBEDDED_MODELS",
    "EP_IDLE_CHECK_MAX_US",
    "AFDConfig",
    "AttentionPoolConfig",
    "AutoscaleConfig",
    "ConnectorConfig",
    "CudaGraphMode",
    "DType",
    "FFNPoolConfig",
    "GatePlacement",
    "IngressConfig",
    "IngressPlacement",
    "ModelConfig",
    "ObservabilityConfig",
    "PoolPlacement",
]
