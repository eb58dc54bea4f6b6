"""The config tree (`afd_ray.config`) without a cluster: every shipped deployment
validates, and bad values are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from afd_ray.config import BATCH_WINDOW_MAX_US, EP_IDLE_CHECK_MAX_US, AFDConfig

DEPLOYMENTS = Path(__file__).parents[1] / "deployments"


def _field(error: ValidationError) -> str:
    (only,) = error.errors()
    return ".".join(str(part) for part in only["loc"])


@pytest.mark.parametrize("path", sorted(DEPLOYMENTS.glob("afd*.yaml")), ids=lambda p: p.name)
def test_every_deployment_validates(path: Path) -> None:
    for app in yaml.safe_load(path.read_text())["applications"]:
        AFDConfig.model_validate(app["args"])


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"ffn": {"ubatches": True}}, "ffn.ubatches"),
        ({"ffn": {"ubatches": "2"}}, "ffn.ubatches"),
        ({"ffn": {"ubatches": 2.0}}, "ffn.ubatches"),
        ({"attention": {"num_ranks": "1"}}, "attention.num_ranks"),
        ({"attention": {"enforce_eager": "false"}}, "attention.enforce_eager"),
        ({"observability": {"metrics": 0}}, "observability.metrics"),
        ({"connector": {"timeout_s": "120"}}, "connector.timeout_s"),
        ({"ingress": {"max_kv_cache_usage": True}}, "ingress.max_kv_cache_usage"),
    ],
    ids=["bool-int", "str-int", "float-int", "str-ranks", "str-flag", "int-flag", "str-float", "bool-float"],
)
def test_values_of_another_type_are_refused_not_converted(args: dict[str, object], field: str) -> None:
    """`ffn.ubatches: true` used to become 1 and `"2"` 2 (a fresh user's report)."""
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate(args)
    assert _field(error.value) == field
    assert field in str(error.value)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"connector": {"timeout_s": float("inf")}}, "connector.timeout_s"),
        ({"attention": {"kv_cache_gib": float("inf")}}, "attention.kv_cache_gib"),
        ({"ffn": {"placement": {"resources": {"fast": float("inf")}}}}, "ffn.placement.resources.fast"),
        ({"autoscale": {"enabled": True, "policy": ""}}, "autoscale.policy"),
        ({"attention": {"cudagraph_mode": "full"}}, "attention.cudagraph_mode"),
    ],
    ids=["inf-timeout", "inf-kv", "inf-resource", "empty-policy", "unknown-graph-mode"],
)
def test_values_that_would_fail_only_in_a_replica_are_refused(args: dict[str, object], field: str) -> None:
    """A fresh user's report: `.inf` durations and sizes passed validation and failed
    later in a replica (`timedelta(seconds=inf)`, `int(inf * GIB)`), and `policy: ''`
    with the autoscaler enabled ran without one, silently."""
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate(args)
    assert _field(error.value) == field


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"ffn": {"ep_idle_check_us": 2 * 10**9}}, "ffn.ep_idle_check_us"),
        ({"ffn": {"ep_idle_max_check_us": EP_IDLE_CHECK_MAX_US + 1}}, "ffn.ep_idle_max_check_us"),
    ],
    ids=["check", "max-check"],
)
def test_ep_idle_check_in_is_bounded(args: dict[str, object], field: str) -> None:
    """Any interval was accepted (2e9 us: a busy EP rank waited half an hour per step
    for an idle one)."""
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate(args)
    assert _field(error.value).startswith(field)
    assert "less than or equal to 1000000" in str(error.value)
    assert AFDConfig.model_validate({"ffn": {"ep_idle_max_check_us": EP_IDLE_CHECK_MAX_US}}).ffn.ep_idle_max_check_us


def test_ep_idle_check_in_is_shorter_than_the_collective_timeout() -> None:
    with pytest.raises(
        ValidationError,
        match=r"ffn\.ep_idle_max_check_us: 20000 us must be shorter than "
        r"connector\.timeout_s 0\.02 s, the EP group's collective timeout",
    ):
        AFDConfig.model_validate({"connector": {"timeout_s": 0.02}})
    assert AFDConfig.model_validate({"connector": {"timeout_s": 0.5}}).connector.timeout_s == 0.5


def test_an_integer_stays_valid_where_a_float_is_expected() -> None:
    cfg = AFDConfig.model_validate({"ffn": {"bundle_resources": 1, "placement": {"resources": {"ffn_node": 1}}}})
    assert cfg.ffn.bundle_resources == 1.0 and cfg.ffn.placement.resources == {"ffn_node": 1.0}


def test_more_ubatches_than_attention_peers_of_one_ffn_rank_are_refused() -> None:
    """A step's peers are split into at most as many ubatches as there are peers; 1A:1F
    with `ffn.ubatches: 2` ran exactly as with 1."""
    with pytest.raises(ValidationError, match=r"ffn\.ubatches: 2 > 1, the most attention peers one FFN rank can have"):
        AFDConfig.model_validate({"ffn": {"ubatches": 2}})
    with pytest.raises(ValidationError, match=r"ffn\.ubatches: 3 > 2"):
        AFDConfig.model_validate(
            {"attention": {"max_ranks": 3}, "ffn": {"num_ranks": 2, "min_ranks": 2, "ubatches": 3}}
        )
    grows = AFDConfig.model_validate({"attention": {"max_ranks": 2}, "ffn": {"ubatches": 2}})  # 2A:1F after a resize
    assert grows.ffn.ubatches == 2


def test_a_batch_window_over_its_bound_is_refused() -> None:
    """`batch_window_us: 3000000` (3 s, a typo for 3000) was accepted: with one peer idle,
    each step of the others would wait 3 s."""
    assert AFDConfig.model_validate({"connector": {"batch_window_us": BATCH_WINDOW_MAX_US}})
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate({"connector": {"batch_window_us": 3_000_000}})
    assert _field(error.value) == "connector.batch_window_us"
    assert "less than or equal to 100000" in str(error.value)


@pytest.mark.parametrize("placement", ["worker", "Head", None, 0])
def test_an_unknown_ingress_placement_is_refused_naming_the_field(placement: object) -> None:
    """`ingress.placement` is `head` (the default) or `any`, nothing else."""
    assert AFDConfig().ingress.placement == "head"
    with pytest.raises(ValidationError, match="'head' or 'any'") as error:
        AFDConfig.model_validate({"ingress": {"placement": placement}})
    assert _field(error.value) == "ingress.placement"


def test_engine_args_take_vllm_engine_arguments() -> None:
    engine = {"enable_prefix_caching": True, "max_num_batched_tokens": 512, "seed": 7, "kv_cache_dtype": "auto"}
    cfg = AFDConfig.model_validate({"attention": {"engine_args": engine}})
    assert cfg.attention.engine_args == engine
    assert AFDConfig().attention.engine_args == {}


def test_an_unknown_engine_arg_is_named_with_the_nearest_vllm_argument() -> None:
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate({"attention": {"engine_args": {"seed": 7, "enable_prefix_cachin": True}}})
    assert _field(error.value) == "attention.engine_args.enable_prefix_cachin.[key]"
    assert "'enable_prefix_cachin' is not an engine argument of vLLM" in str(error.value)
    assert "did you mean 'enable_prefix_caching'?" in str(error.value)


@pytest.mark.parametrize(
    ("name", "value", "instead"),
    [
        ("max_model_len", 512, "set model.max_model_len instead"),
        ("dtype", "bfloat16", "set model.dtype instead"),
        ("model", "/tmp/other", "set model.source instead"),
        ("quantization", "fp8", "set model.quantization instead"),
        ("tensor_parallel_size", 2, "set attention.num_ranks / ffn.num_ranks instead"),
        ("data_parallel_rank", 1, "set attention.num_ranks / ffn.num_ranks instead"),
        ("kv_cache_memory_bytes", 1 << 30, "set attention.kv_cache_gib instead"),
        ("gpu_memory_utilization", 0.5, "set attention.gpu_memory_utilization instead"),
        ("compilation_config", {"mode": 0}, "set attention.enforce_eager / attention.cudagraph_mode instead"),
        ("worker_extension_cls", "my.Extension", "afd_ray sets it"),
    ],
)
def test_an_engine_arg_afd_ray_owns_names_the_key_to_use(name: str, value: object, instead: str) -> None:
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate({"attention": {"engine_args": {name: value}}})
    assert _field(error.value) == f"attention.engine_args.{name}.[key]"
    assert f"'{name}' is owned by afd_ray" in str(error.value)
    assert instead in str(error.value)


@pytest.mark.parametrize(
    ("engine", "key"),
    [
        ({"seed": "7"}, "seed"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype"),
    ],
    ids=["str-int", "int-flag", "unknown-literal"],
)
def test_an_engine_arg_value_must_fit_vllms_type(engine: dict[str, object], key: str) -> None:
    """Checked here against vLLM's annotation of the field, not at engine start."""
    with pytest.raises(ValidationError, match=rf"attention\.engine_args\.{key}: .* does not fit vLLM's type"):
        AFDConfig.model_validate({"attention": {"engine_args": engine}})


def test_every_engine_arg_value_of_the_wrong_type_is_named() -> None:
    """Two wrong values give two messages, not the first one only (fresh-user trial,
    2026-12-07: `{seed: "7", block_size: "16"}` named only `block_size`)."""
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate({"attention": {"engine_args": {"seed": "7", "block_size": "16"}}})
    message = str(error.value)
    assert "attention.engine_args.seed: '7' does not fit vLLM's type" in message
    assert "attention.engine_args.block_size: '16' does not fit vLLM's type" in message


def test_fp8_is_refused_before_deploy_on_cpu_and_taken_on_cuda() -> None:
    with pytest.raises(
        ValidationError, match=r"model\.quantization: fp8 needs FP8 kernels, .* platform cuda .* not cpu"
    ):
        AFDConfig.model_validate({"model": {"quantization": "fp8"}})
    assert AFDConfig.model_validate({"platform": "cuda", "model": {"quantization": "fp8"}}).model.quantization == "fp8"
    with pytest.raises(ValidationError) as error:
        AFDConfig.model_validate({"platform": "cuda", "model": {"quantization": "int4"}})
    assert _field(error.value) == "model.quantization"
