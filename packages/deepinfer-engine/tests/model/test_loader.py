"""load_model on tiny checkpoints written by make_checkpoint (real file format: FP8/FP4 + E8M0 scales)."""

from __future__ import annotations

import json

import pytest
import torch
from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model._equality import max_rel_err, run_chunked, run_full
from deepinfer_engine.model.checkpoint import CheckpointReader
from deepinfer_engine.model.loader import load_model
from deepinfer_engine.model.writer import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def ckpt_v4(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v4") / "ck", "v4", "tiny", 0)


def test_v4_checkpoint_loads_exactly_the_stored_or_decoded_tensors(ckpt_v4):
    """Quantized (default): every FP8 / FP4 tensor and scale is held exactly as stored (experts in their stacked
    slot), the rest decoded; dense: everything decoded. Parity with HF is test_hf_parity.py."""
    from deepinfer_engine.model.linear import QUANTIZED_DTYPES
    from deepinfer_engine.model.loader import expected_checkpoint_tensors

    quant = load_model(ckpt_v4, torch.float32)
    dense = load_model(ckpt_v4, torch.float32, quantized=False)
    assert quant.mtp is not None and len(quant.mtp) == 1
    qs, ds = quant.state_dict(), dense.state_dict()
    assert "layers.0.ffn.experts.w1.weight" in qs and "layers.0.ffn.experts.0.w1.weight" not in qs
    held = 0
    with CheckpointReader(ckpt_v4) as reader:
        for ck, (pname, slot) in expected_checkpoint_tensors(quant).items():
            t = qs[pname] if slot is None else qs[pname][slot]
            if t.dtype in QUANTIZED_DTYPES or ck.endswith(".scale"):
                raw = reader.load_raw(ck)
                assert t.dtype == raw.dtype and torch.equal(t.view(torch.uint8), raw.view(torch.uint8)), ck
                held += 1
            else:
                assert torch.equal(t, reader.load(ck)), ck
        for ck, (pname, slot) in expected_checkpoint_tensors(dense).items():
            t = ds[pname] if slot is None else ds[pname][slot]
            assert torch.equal(t, reader.load(ck)), ck
    assert held > 100  # every attention / shared-expert FP8 weight + scale, every expert slot


def test_v41_checkpoint_loads_with_engram_and_dspark(tmp_path):
    d = make_checkpoint(tmp_path / "ck", "v41", "tiny", 1)
    model = load_model(d, torch.float32)
    assert model.engram_hasher is not None and model.mtp is not None and len(model.mtp) == 3
    ids = torch.randint(0, model.args.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    full = run_full(model, ids)
    assert torch.isfinite(full).all()
    assert max_rel_err(run_chunked(model, ids, [5, 1, 1, 14]), full) <= 1e-5


def test_checkpoint_shapes_not_matching_config(ckpt_v4, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt_v4.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((ckpt_v4 / "config.json").read_text())
    cfg["q_lora_rank"] = 48  # the shards still hold 32-wide q latents
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"wq_a\.weight"):
        load_model(bad, torch.float32)
