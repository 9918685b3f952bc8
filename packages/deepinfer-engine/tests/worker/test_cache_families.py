"""The families the engine sizes its caches with (the model's own cache layout) give the
design per-token figures for the real configs in bf16: V4.1 3,200 B/token, V4 6,880 B/token."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.engine import default_page_size
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache_layout import cache_families
from deepinfer_engine.model.presets import v4_flash_config, v41_flash_config


@pytest.mark.parametrize("make_config,per_token", [(v41_flash_config, 3200), (v4_flash_config, 6880)])
def test_real_config_paged_bytes_per_token(make_config, per_token: int) -> None:
    args = ModelArgs.from_config_dict(make_config())
    page = default_page_size([p.ratio for p in args.layer_plans], args.hidden_size)
    assert page == 128
    fams = cache_families(args, page, torch.bfloat16)
    paged = sum(f.bytes_per_token for f in fams if f.kind == "paged")
    assert paged == per_token
    swa = next(f for f in fams if f.name == "swa_ring")
    # one bf16 512-wide row per window position (+ slack rows) for every layer incl. MTP / DSpark
    assert swa.num_layers == len(args.layer_plans)
    assert swa.bytes_per_slot % (len(args.layer_plans) * 512 * 2) == 0
    assert swa.bytes_per_slot >= len(args.layer_plans) * args.sliding_window * 1024


def test_resolve_device_errors_name_the_option() -> None:
    from deepinfer_engine.engine import resolve_device
    from deepinfer_engine.errors import ConfigError

    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ConfigError, match="device: found 'bogus'"):
        resolve_device("bogus")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"has {n} CUDA device"):
        resolve_device(f"cuda:{n}")
