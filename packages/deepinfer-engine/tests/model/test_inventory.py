"""Inventory counts of the real configs against the published / design-doc numbers (docs/checkpoint.md §6, §8)."""

from __future__ import annotations

from deepinfer_engine.model import presets
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.inventory import summarize, tensor_inventory


def test_v4_flash_counts_match_published_numbers() -> None:
    inv = tensor_inventory(ModelArgs.from_config_dict(presets.v4_flash_config()))
    s = summarize(inv)
    assert s.params("backbone") == 284_334_567_511  # "284.3B", §8.1 total without MTP
    assert s.params("backbone") + s.params("draft") == 290_944_616_402  # with MTP
    assert s.total_bytes == 159_609_485_896  # published index total_size
    assert s.num_tensors == 69_187  # published weight_map entries
    comp = {c: v for sec, c, v in s.params_by_component if sec == "backbone"}
    assert comp["routed_experts"] == 43 * 256 * 3 * 2048 * 4096
    assert comp["compressor"] == 261_464_576 and comp["indexer"] == 225_730_176
    assert comp["gate"] == 47_426_048 and comp["mhc"] == 33_818_898 and comp["norms"] == 421_056


def test_v41_flash_counts_match_design_doc() -> None:
    s = summarize(tensor_inventory(ModelArgs.from_config_dict(presets.v41_flash_config())))
    assert s.params("backbone") == 551_566_180_464
    assert s.params("engram") == 196_928_504_320
    # design-doc draft count + the 3 stages' optional gate.bias_vl [128] (present in a release, never applied)
    assert s.params("draft") == 14_225_362_146 + 3 * 128
    comp = {c: v for sec, c, v in s.params_by_component if sec == "backbone"}
    assert comp["compressor"] == 18_352_128 and comp["indexer"] == 262_656 + 43_253_760
    assert comp["gate"] == 78_673_920 and comp["mhc"] + comp["norms"] == 39_807_600


def test_v4_flash_0731_draft_params_near_design_estimate() -> None:
    s = summarize(tensor_inventory(ModelArgs.from_config_dict(presets.v4_flash_0731_config())))
    assert s.params("backbone") == 284_334_567_511
    assert abs(s.params("draft") - 19.85e9) < 0.01e9  # "≈ 19.85B" (dtypes of heads [I])


def test_tiny_inventories_have_every_structural_kind() -> None:
    v4 = {t.name: t for t in tensor_inventory(ModelArgs.from_config_dict(presets.tiny_v4_config()))}
    assert "layers.0.ffn.gate.tid2eid" in v4 and "layers.0.ffn.gate.bias" not in v4
    assert v4["layers.1.attn.compressor.wkv.weight"].shape == (64, 64)  # CSA: 2 x head_dim (overlap)
    assert v4["layers.2.attn.compressor.ape"].shape == (8, 32)  # HCA ratio 8
    assert "layers.1.attn.indexer.compressor.ape" in v4 and "layers.2.attn.indexer.wq_b.weight" not in v4
    assert v4["mtp.0.e_proj.weight"].scale is not None and "mtp.0.hc_head_fn" in v4
    w = v4["layers.3.ffn.experts.7.w2.weight"]
    assert w.dtype == "fp4_e2m1x2" and w.stored_shape == (64, 16) and w.scale.shape == (64, 1)
    assert v4["layers.0.attn.wq_b.weight"].scale.shape == (1, 1)  # 128x128 blocks over [128, 32]
    v41 = {t.name: t for t in tensor_inventory(ModelArgs.from_config_dict(presets.tiny_v41_config()))}
    assert v41["layers.1.engram.embed.weight"].shape == (462, 16)
    assert v41["layers.3.engram.embed.weight"].scale.shape == (630, 1)
    assert v41["layers.3.engram.wkv.weight"].shape == (5 * 64, 6 * 16)
    assert (
        "layers.5.attn.compressor.wgate.weight" not in v41 and "layers.2.attn.compressor.wgate.weight" in v41
    )
    assert "layers.7.attn.indexer.wq_b.weight" in v41 and "layers.7.attn.indexer.wk.weight" not in v41
    assert "layers.6.attn.indexer.wq_b.weight" not in v41 and "layers.6.attn.compressor.wkv.weight" not in v41
    assert "layers.0.ffn.gate.bias_vl" in v41 and not v41["layers.0.ffn.gate.bias_vl"].optional
    assert v41["mtp.0.ffn.gate.bias_vl"].optional and v41["mtp.0.ffn.gate.bias_vl"].shape == (4,)
    assert "mtp.0.ffn.experts.3.w1.weight" in v41 and "mtp.0.ffn.experts.4.w1.weight" not in v41
    assert v41["mtp.0.main_proj.weight"].shape == (64, 192) and "mtp.2.markov_head.embed.weight" in v41
    assert v41["mtp.2.confidence_head.proj.weight"].shape == (1, 72) and "hc_head_fn" not in v41
    assert v41["layers.0.attn.wq_a.weight"].scale.shape == (1, 2)  # 32x32 blocks over [32, 64]
