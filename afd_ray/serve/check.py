"""`afd-ray check FILE.yaml`: every error of a Serve config file (or an autoscaling
policy file), each with its key path, before anything is deployed.

It checks the file, not this machine: each afd_ray application's `args` against the
config tree (`AFDConfig`, `attention.engine_args` against the installed vLLM's
`EngineArgs`), and what `build_app` checks from the file (gate placement against the
model, the autoscaling policy it names). Only when given a running Ray cluster's
resources does it check the pools against them (`cluster_errors`); so a CUDA config
passes on a laptop without a GPU. Not checked: the API-key variables
(`ingress.api_key_env`), which the Serve build reads on the cluster.

Every error in one run where it can be told apart (`_validated`: cross-field checks
too); unknown keys of the Serve file itself (`aplications`) name the nearest valid one.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from afd_ray.config.base import nearest_field_hint
from afd_ray.config.tree import AFDConfig
from afd_ray.config.model import FP8_CAPABILITY

__all__ = [
    "APP_IMPORT_PATH",
    "FP8_CAPABILITY",
    "NO_FP8_ACCELERATORS",
    "ClusterResources",
    "ConfigError",
    "args_errors",
    "cluster_errors",
    "eplb_model_errors",
    "file_errors",
    "fp8_device_errors",
    "policy_errors",
    "validation_errors",
]

APP_IMPORT_PATH = "afd_ray.serve.app:build_app"
"""The `import_path` of an afd_ray application in a Serve config file."""
NO_FP8_ACCELERATORS = frozenset({"V100", "P100", "T4", "P4", "K80", "A10G", "A100", "A100-40G", "A100-80G"})
"""Ray's NVIDIA accelerator types (`ray.util.accelerators`, the node resource
`accelerator_type:<type>`) below `FP8_CAPABILITY`. A type not listed is left to vLLM."""
_ACCELERATOR = "accelerator_type:"


@dataclasses.dataclass(frozen=True)
class ConfigError:
    """One error of a config file: the dotted key path and what is wrong there."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclasses.dataclass(frozen=True)
class ClusterResources:
    """What a running Ray cluster has, summed over its alive nodes."""

    total: Mapping[str, float]
    """Resource name -> amount (`ray.cluster_resources()`)."""
    largest_node: Mapping[str, float]
    """Resource name -> the most one node has (a bundle must fit on one node)."""

    @staticmethod
    def of_running_cluster() -> ClusterResources:
        """The resources of the cluster this process is connected to (`ray.init` done).

        Raises:
            RuntimeError: Ray is not initialized.
        """
        import ray

        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        largest = {name: max(node.get(name, 0.0) for node in nodes) for node in nodes for name in node}
        return ClusterResources(total=dict(ray.cluster_resources()), largest_node=largest)


def _path(prefix: str, loc: Iterable[int | str]) -> str:
    parts = [prefix] if prefix else []
    parts += [f"[{part}]" if isinstance(part, int) else part for part in loc if part != "[key]"]
    return ".".join(parts).replace(".[", "[")


_LEADING_KEY = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*): (.*)$", re.S)
"""A message that starts with a (dotted) key path (`ffn.ubatches: ...`)."""


def _split_key(prefix: str, message: str) -> ConfigError:
    """A cross-section error whose message starts with its key (`ffn.ubatches: ...`)
    under that key's path; any other message under `prefix`."""
    match = _LEADING_KEY.match(message)
    if match:
        return ConfigError(_path(prefix, match[1].split(".")), match[2])
    return ConfigError(prefix or "<root>", message)


def validation_errors(error: ValidationError, prefix: str, model: type[BaseModel] | None = None) -> list[ConfigError]:
    """One `ConfigError` per pydantic error, under `prefix`; unknown keys of `model` get the nearest name."""
    found = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden" and model is not None:
            message += nearest_field_hint(model, item["loc"])
        named = _LEADING_KEY.match(message)
        if item["loc"] and not (named and named[1].startswith(".".join(map(str, item["loc"])))):
            found.append(ConfigError(_path(prefix, item["loc"]), message))
        else:  # a cross-section error (no loc) or one naming a key below its loc
            found.append(_split_key(prefix, message))
    return found


_PASSES = 8  # most validations of one application's `args` (`_validated`)


def args_errors(args: object, prefix: str = "args") -> tuple[AFDConfig | None, list[ConfigError]]:
    """Validate an application's `args` as `build_app` does, without a cluster: the
    config tree (`_validated`), then, on the config less its bad keys, the gate
    placement against the model, EPLB against the model (`eplb_model_errors`) and the
    autoscaling policy file, each error kept unless it names a key that failed.

    Returns the config (None when `args` has an error the tree finds) and every error found.
    """
    from afd_ray.models.embedded import check_gate_placement

    cfg, found, dropped = _validated(args, prefix)
    if cfg is None:
        return None, found
    more = []
    try:
        check_gate_placement(cfg.model, cfg.gate_placement)
    except ValueError as e:
        more.append(_split_key(prefix, str(e)))
    more += eplb_model_errors(cfg, prefix)
    if cfg.autoscale.policy is not None:
        where = _path(prefix, ["autoscale", "policy"])
        try:
            more += [ConfigError(where, f"{cfg.autoscale.policy}: {e}") for e in policy_errors(cfg.autoscale.policy)]
        except OSError as e:
            more.append(ConfigError(where, str(e)))
    found += [error for error in more if not _names_any(error, dropped)]
    return (None if dropped else cfg), found


def _validated(args: object, prefix: str) -> tuple[AFDConfig | None, list[ConfigError], list[str]]:
    """`AFDConfig` of `args` less the keys that failed, every error, and those keys.

    Pydantic runs a section's `model_validator` only once the section's fields
    validate, and the tree's cross-section checks (`AFDConfig._bounds`, which stop at
    the first) only once every section does. So each failing key (the deepest key of
    its path that `args` sets) is dropped, leaving its default, and the rest validated
    again; errors of a later pass that name a dropped key (in their path or message)
    are not reported, as they may come from the default. When the passes end without
    a config, a last error says that cross-field checks were skipped.
    """
    data = copy.deepcopy(args)
    found: list[ConfigError] = []
    dropped: list[str] = []
    for _ in range(_PASSES):
        try:
            return AFDConfig.model_validate(data), found, dropped
        except ValidationError as e:
            errors = validation_errors(e, "", AFDConfig)
        for error in errors:
            if not _names_any(error, dropped):
                parts = [] if error.path == "<root>" else error.path.split(".")
                found.append(ConfigError(_path(prefix, parts) or "<root>", error.message))
        cut = [key for key in (_drop(data, error.path) for error in errors) if key is not None]
        if not cut:
            break
        dropped += cut
    if not isinstance(data, dict):  # no field to check across
        return None, found, dropped
    skipped = "cross-field checks were skipped because of the errors above; fix them and check again"
    return None, [*found, ConfigError(prefix or "<root>", skipped)], dropped


def _drop(data: object, path: str) -> str | None:
    """Delete the deepest key of dotted `path` that `data` sets; its path, or None (none set)."""
    node, parent, depth = data, None, 0
    parts = path.split(".")
    for part in parts:
        if not (isinstance(node, dict) and part in node):
            break
        parent, node, depth = node, node[part], depth + 1
    if parent is None:
        return None
    del parent[parts[depth - 1]]
    return ".".join(parts[:depth])


def _names_any(error: ConfigError, keys: Iterable[str]) -> bool:
    """`error`'s path or message names one of the dotted `keys` (or a key under one)."""
    text = f"{error.path} {error.message}"
    return any(re.search(rf"(?<!\w){re.escape(key)}(?![\w])", text) for key in keys)


def eplb_model_errors(cfg: AFDConfig, prefix: str = "args") -> list[ConfigError]:
    """`ffn.eplb.enabled` or `num_redundant_experts` with a model without MoE layers,
    where its `config.json` is readable here (embedded: `EMBEDDED_MOE`; a local folder:
    `ffn_layout`); other sources, or unknown architectures, are left to the FFN rank."""
    from transformers import AutoConfig

    from afd_ray.layers.family import ffn_layout
    from afd_ray.models.embedded import EMBEDDED_MOE

    eplb, source = cfg.ffn.eplb, cfg.model.source
    if not (eplb.enabled or eplb.num_redundant_experts):
        return []
    if source in EMBEDDED_MOE:
        moe = EMBEDDED_MOE[source]
    elif (Path(source) / "config.json").is_file():
        try:
            moe = bool(ffn_layout(AutoConfig.from_pretrained(source)).moe_layers)
        except ValueError:
            return []
    else:
        return []
    if moe:
        return []
    key, value = ("enabled", "true") if eplb.enabled else ("num_redundant_experts", eplb.num_redundant_experts)
    dense = f"model.source {source!r} is dense (no MoE layer): leave ffn.eplb off"
    return [ConfigError(_path(prefix, ["ffn", "eplb", key]), f"{value} balances the experts of MoE layers; {dense}")]


def policy_errors(path: str | Path) -> list[ConfigError]:
    """Every error of the autoscaling policy file at `path` (`load_policy`'s checks),
    one per bad field, each under its key path in the policy (`ffn.step`); a file
    that is not a YAML mapping gives one error under `<policy>`.

    Raises:
        OSError: the file cannot be read.
    """
    from afd_ray.autoscale.loader import PolicyError, load_policy
    from afd_ray.autoscale.schema import AutoscalePolicy

    try:
        load_policy(path)
    except PolicyError as e:
        if not e.fields:  # not UTF-8 YAML, or not a mapping
            return [ConfigError("<policy>", str(e).removeprefix(f"{path}: "))]
        try:
            AutoscalePolicy.model_validate(yaml.safe_load(Path(path).read_text()))
        except ValidationError as invalid:
            return validation_errors(invalid, "")
    return []


def cluster_errors(cfg: AFDConfig, cluster: ClusterResources, prefix: str = "args") -> list[ConfigError]:
    """The pools at their starting size (`num_ranks`, plus `ffn.standby_ranks` FFN
    replicas) against a running cluster: each pool's bundles, then both pools together,
    must fit in what the cluster has, and each bundle on one node; FP8 needs GPUs with
    FP8 kernels (`fp8_device_errors`)."""
    from afd_ray.platform import resource_key

    key = resource_key(cfg.platform)
    found = []
    needs: dict[str, float] = {}
    short: set[str] = set()
    for name, pool, bundles, counted in (
        ("attention", cfg.attention, cfg.attention.num_ranks, f"num_ranks {cfg.attention.num_ranks}"),
        ("ffn", cfg.ffn, *_ffn_bundles(cfg)),
    ):
        for resource, amount in {key: pool.bundle_resources, **pool.placement.resources}.items():
            need = bundles * amount
            needs[resource] = needs.get(resource, 0.0) + need
            has, largest = cluster.total.get(resource, 0.0), cluster.largest_node.get(resource, 0.0)
            if need > has:
                short.add(resource)
                found.append(
                    ConfigError(
                        _path(prefix, [name]),
                        f"{counted} x {amount:g} {resource} = {need:g} {resource}, the running Ray cluster has {has:g}",
                    )
                )
            elif amount > largest:
                found.append(
                    ConfigError(
                        _path(prefix, [name]),
                        f"a bundle of {amount:g} {resource} fits on no node (the largest has {largest:g})",
                    )
                )
    for resource, need in needs.items():
        has = cluster.total.get(resource, 0.0)
        if need > has and resource not in short:
            found.append(
                ConfigError(
                    prefix or "<root>",
                    f"attention + ffn at start need {need:g} {resource}, the running Ray cluster has {has:g}",
                )
            )
    return found + fp8_device_errors(cfg, cluster, prefix)


def _ffn_bundles(cfg: AFDConfig) -> tuple[int, str]:
    """The FFN bundles at start, one per replica: the layout's `num_ranks` plus the
    `standby_ranks` Serve runs beside them; and how the error message counts them."""
    ffn = cfg.ffn
    if not ffn.standby_ranks:
        return ffn.num_ranks, f"num_ranks {ffn.num_ranks}"
    bundles = ffn.num_ranks + ffn.standby_ranks
    return bundles, f"num_ranks {ffn.num_ranks} + standby_ranks {ffn.standby_ranks} = {bundles}"


def fp8_device_errors(cfg: AFDConfig, cluster: ClusterResources, prefix: str = "args") -> list[ConfigError]:
    """`model.quantization: fp8`, or an FP8 checkpoint (`model.source`), on a cluster
    whose GPU nodes include a type without FP8 kernels (`NO_FP8_ACCELERATORS`, from
    each node's `accelerator_type:` resource).

    Types Ray does not name, and clusters without GPUs (the pool check reports those),
    are left to vLLM's own check at engine start.
    """
    if not cfg.model.fp8:
        return []
    types = {name.removeprefix(_ACCELERATOR) for name in cluster.total if name.startswith(_ACCELERATOR)}
    slow = sorted(types & NO_FP8_ACCELERATORS)
    if not slow:
        return []
    capability = ".".join(map(str, FP8_CAPABILITY))
    key, what = ("quantization", "fp8") if cfg.model.quantization else ("source", "an FP8 checkpoint")
    return [
        ConfigError(
            _path(prefix, ["model", key]),
            f"{what} needs GPUs of compute capability >= {capability}; the running Ray cluster has {', '.join(slow)}",
        )
    ]


def _unknown_keys(data: Mapping[object, object], known: list[str], where: str) -> list[ConfigError]:
    """An error for each key of `data` not in `known` (Ray Serve's schema fields, which
    Ray does not refuse), with the nearest known name when there is a close one."""
    found = []
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"expected one of {', '.join(known)}"
            found.append(ConfigError(_path(where, [str(key)]), f"unknown key; {hint}"))
    return found


def file_errors(path: Path, cluster: ClusterResources | None) -> tuple[int, list[ConfigError]]:
    """Every error of the Serve config file (or autoscaling policy file) at `path`.

    A mapping with `applications` is a Serve config: each application whose
    `import_path` is `APP_IMPORT_PATH` is checked (`args_errors`, and `cluster_errors`
    when `cluster` is given). Any other mapping is read as an autoscaling policy
    (`afd_ray.autoscale.schema.AutoscalePolicy`, e.g. deployments/autoscale.yaml).

    Returns the number of afd_ray applications (or policies) checked and the errors.

    Raises:
        OSError: the file cannot be read.
    """
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from afd_ray.autoscale.schema import AutoscalePolicy

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        return 0, [ConfigError("<file>", f"not valid YAML: {e}")]
    if not isinstance(data, dict):
        return 0, [ConfigError("<file>", "expected a Serve config (a mapping with `applications`) or a policy")]
    serve_keys = list(ServeDeploySchema.model_fields)
    unknown = _unknown_keys(data, serve_keys, "")
    if "applications" not in data:
        near_serve = any(difflib.get_close_matches(str(key), serve_keys, n=1) for key in data)
        if set(data) & set(AutoscalePolicy.model_fields) or not near_serve:
            return 1, policy_errors(path)
        return 0, [*unknown, ConfigError("applications", "missing: a Serve config lists its applications here")]
    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as e:
        return 0, unknown + validation_errors(e, "")
    app_keys = list(ServeApplicationSchema.model_fields)
    found, checked = unknown, 0
    for index, app in enumerate(data["applications"]):
        found += _unknown_keys(app, app_keys, f"applications[{index}]")
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        checked += 1
        prefix = f"applications[{index}].args"
        cfg, errors = args_errors(app.get("args") or {}, prefix)
        found += errors
        if cfg is not None and cluster is not None:
            found += cluster_errors(cfg, cluster, prefix)
    if not checked:
        found.append(ConfigError("applications", f"no application with import_path {APP_IMPORT_PATH}"))
    return checked, found
