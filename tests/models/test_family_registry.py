"""The family registry (`afd_ray.layers.family.MODEL_FAMILIES`): every entry resolves,
and every other list of families is read from it."""

from __future__ import annotations

import importlib

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from afd_ray.attention.plugin import AFD_ARCHITECTURES
from afd_ray.layers.family import MODEL_FAMILIES, ModelFamily, ffn_layout
from afd_ray.models import FAMILIES
from afd_ray.models.tiny import tiny_config


def _load(path: str) -> object:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("model_type", MODEL_FAMILIES)
def test_entry_resolves(model_type: str) -> None:
    family: ModelFamily = MODEL_FAMILIES[model_type]
    # transformers' causal-LM class of this model_type: what `afd_architecture` reads
    # from a config without `architectures`
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == family.architecture
    attention_class = _load(family.attention_class)
    assert isinstance(attention_class, type) and attention_class.__name__ == "AFD" + family.architecture
    if family.tiny_config is not None:
        assert callable(_load(family.tiny_config))
        config = tiny_config(model_type)
        assert config.model_type == model_type
        assert ffn_layout(config).num_layers == config.num_hidden_layers


def test_other_lists_read_the_registry() -> None:
    assert FAMILIES == tuple(name for name, family in MODEL_FAMILIES.items() if family.tiny_config)
    assert dict(AFD_ARCHITECTURES) == {f.architecture: f.attention_class for f in MODEL_FAMILIES.values()}


def test_unknown_model_type_names_the_field() -> None:
    config = tiny_config("llama")
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match=r"^model\.source: .*'gpt2'.*'deepseek_v3'"):
        ffn_layout(config)
    with pytest.raises(ValueError, match="unknown tiny family 'mixtral'"):
        tiny_config("mixtral")
