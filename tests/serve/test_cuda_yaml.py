"""`deployments/afd-cuda.yaml`, the CUDA layout: it validates as an `AFDConfig`, both
pools fit one GPU through fractional bundles, and the GPU memory split reaches vLLM's
engine arguments. (Serving it needs a GPU: tests/gpu.)"""

from __future__ import annotations

from pathlib import Path

import yaml

from afd_ray.attention.engine import engine_args
from afd_ray.config import AFDConfig, ModelConfig
from afd_ray.models.tiny import tiny_config
from afd_ray.platform import actor_resources

YAML = Path(__file__).parents[2] / "deployments" / "afd-cuda.yaml"


def test_one_gpu_layout_and_memory_split(tmp_path: Path) -> None:
    (app,) = yaml.safe_load(YAML.read_text())["applications"]
    cfg = AFDConfig.model_validate(app["args"])
    assert cfg.platform == "cuda"
    assert cfg.attention.bundle_resources + cfg.ffn.bundle_resources <= 1.0  # one GPU
    assert actor_resources("cuda", cfg.ffn.bundle_resources) == {"num_cpus": 0, "num_gpus": 0.5}
    tiny_config("llama").save_pretrained(tmp_path)  # a config.json is all engine_args reads
    model = ModelConfig(source=str(tmp_path), dtype="bfloat16", load_format="dummy")
    args = engine_args(model, cfg.attention, tmp_path, cfg.gate_placement)
    assert args.gpu_memory_utilization == cfg.attention.gpu_memory_utilization < 1 - cfg.ffn.bundle_resources + 1e-9
    assert args.kv_cache_memory_bytes == int(cfg.attention.kv_cache_gib * (1 << 30))
    assert args.load_format == "dummy"
