"""Per-token bytes of the real configs' paged families equal the design figures (docs/runtime.md §6.2,
docs/caches.md §7.1/§7.2): V4.1 3,200 B bf16, 890 B NVFP4+MXFP4, 1,490 B MXFP8+MXFP4; V4 6,880 B bf16,
3,514 B production (FP8 main + MXFP4 index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepinfer_engine.core.kv_cache_spec import (
    CacheFamily,
    compressed_owners,
    paged_bytes_per_token,
    record_bytes,
)
from deepinfer_engine.model.presets import v4_flash_config, v41_flash_config  # config data, no torch

V41_DESIGN_CONFIG = Path(__file__).resolve().parents[1] / "data" / "v41_flash_config.json"


def _v41_text_config() -> dict:
    cfg = v41_flash_config()
    text = cfg.get("text_config", cfg)
    if V41_DESIGN_CONFIG.exists():  # where the design docs are mounted: the preset must agree with them
        design = json.loads(V41_DESIGN_CONFIG.read_text())
        design = design.get("text_config", design)
        for k in ("compress_ratios", "num_hidden_layers", "kv_source_layer_ids", "head_dim", "index_head_dim"):
            assert text[k] == design[k], k
    return text


def test_record_sizes_of_the_production_formats() -> None:
    assert record_bytes("bf16", 512) == 1024
    assert record_bytes("nvfp4", 512) == 288
    assert record_bytes("mxfp8", 512) == 528
    assert record_bytes("mxfp4", 128) == 68
    assert record_bytes("fp8_f32scale", 128) == 132
    assert record_bytes("fp8_ds", 512, rope_dim=64) == 584
    with pytest.raises(ValueError, match="record format"):
        record_bytes("int3", 8)  # type: ignore[arg-type]


def test_v41_flash_paged_bytes_per_token() -> None:
    t = _v41_text_config()
    owners = compressed_owners(t["compress_ratios"], t["num_hidden_layers"], t["kv_source_layer_ids"])
    assert [(o.layer_id, o.ratio) for o in owners] == [(2, 2), (8, 2), (14, 2), (20, 1)]
    kw = dict(head_dim=t["head_dim"], index_head_dim=t["index_head_dim"], rope_dim=t["qk_rope_head_dim"])
    assert paged_bytes_per_token(owners, **kw) == 3200
    assert paged_bytes_per_token(owners, main_format="nvfp4", index_format="mxfp4", **kw) == 890
    assert paged_bytes_per_token(owners, main_format="mxfp8", index_format="mxfp4", **kw) == 1490


def test_v4_flash_paged_bytes_per_token() -> None:
    cfg = v4_flash_config()
    assert cfg["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4, 0]  # docs/model.md §1.1
    owners = compressed_owners(cfg["compress_ratios"], cfg["num_hidden_layers"])
    assert sum(o.has_index_keys for o in owners) == 21 and len(owners) == 41
    kw = dict(head_dim=cfg["head_dim"], index_head_dim=cfg["index_head_dim"], rope_dim=cfg["qk_rope_head_dim"])
    assert paged_bytes_per_token(owners, **kw) == 6880
    assert int(paged_bytes_per_token(owners, main_format="fp8_ds", index_format="mxfp4", **kw)) == 3514


def test_cache_family_validates() -> None:
    with pytest.raises(ValueError, match="kind"):
        CacheFamily(name="x", kind="ring", num_layers=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        CacheFamily(name="x", kind="paged", num_layers=1, bytes_per_token=-1)
