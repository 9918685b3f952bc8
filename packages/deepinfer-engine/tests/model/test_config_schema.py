"""The config field table: it covers ModelArgs exactly, and every per-field rule it declares is enforced."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model import presets
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.config_schema import FIELDS, GROUP_TRIGGER, REQUIRED

# fields with their own parsing (nested objects, identity, two possible homes)
_SPECIAL = {"arch", "model_type", "rope_scaling", "vision_config", "expert_dtype"}


def test_table_covers_model_args_exactly_once() -> None:
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names))
    init_fields = {f.name for f in dataclasses.fields(ModelArgs) if f.init}
    assert set(names) == init_fields - _SPECIAL
    assert set(GROUP_TRIGGER.values()) <= set(names)


def _base(arch: str) -> dict:
    return presets.v4_flash_0731_config() if arch == "v4" else presets.v41_flash_config()


def _home(d: dict, arch: str, section: str) -> dict:
    if section == "quant":
        return d.setdefault("quantization_config", {})
    if section == "top" or arch == "v4":
        return d
    return d["text_config"]


BOUNDED = [(arch, f) for arch in ("v4", "v41") for f in FIELDS
           if arch in f.archs and f.minimum is not None and f.kind == "int"]


@pytest.mark.parametrize(("arch", "field"), BOUNDED, ids=[f"{a}:{f.name}" for a, f in BOUNDED])
def test_every_declared_minimum_is_enforced(arch: str, field) -> None:
    d = copy.deepcopy(_base(arch))
    home = _home(d, arch, field.section)
    if field.group is not None and GROUP_TRIGGER[field.group] not in home:
        pytest.skip(f"group {field.group} absent in the {arch} release config")
    home[field.name] = field.minimum - 1
    with pytest.raises(ModelConfigError, match=rf"{field.name}.*found {field.minimum - 1}.*>= {field.minimum}"):
        ModelArgs.from_config_dict(d)


REQUIRED_FIELDS = [(arch, f) for arch in ("v4", "v41") for f in FIELDS
                   if arch in f.archs and f.default is REQUIRED and f.group is None]


@pytest.mark.parametrize(("arch", "field"), REQUIRED_FIELDS, ids=[f"{a}:{f.name}" for a, f in REQUIRED_FIELDS])
def test_every_required_field_is_required(arch: str, field) -> None:
    d = copy.deepcopy(_base(arch))
    _home(d, arch, field.section).pop(field.name)
    with pytest.raises(ModelConfigError, match=rf"{field.name}' is missing"):
        ModelArgs.from_config_dict(d)


@pytest.mark.parametrize("kind_value", [("int", "7"), ("float", "x"), ("bool", 1), ("str", 3), ("ints", [1, "2"])])
def test_types_are_checked_per_kind(kind_value) -> None:
    kind, bad = kind_value
    field = next(f for f in FIELDS if f.kind == kind and "v4" in f.archs and f.group is None)
    d = copy.deepcopy(_base("v4"))
    _home(d, "v4", field.section)[field.name] = bad
    with pytest.raises(ModelConfigError, match=field.name):
        ModelArgs.from_config_dict(d)


@pytest.mark.parametrize(("arch", "preset"), [("v4", "full"), ("v41", "full"), ("v4", "tiny-dspark"), ("v41", "tiny")])
def test_serialization_is_generated_from_the_table(arch: str, preset: str) -> None:
    a = ModelArgs.from_config_dict(presets.preset_config(arch, preset))
    out = a.to_config_dict()
    for f in FIELDS:
        if arch not in f.archs or getattr(a, f.name) is None:
            continue
        if f.group is not None and not getattr(a, GROUP_TRIGGER[f.group]):
            continue
        v = _home(out, arch, f.section)[f.name]
        assert (tuple(v) if isinstance(v, list) else v) == getattr(a, f.name), f.name
    assert ModelArgs.from_config_dict(out) == a
