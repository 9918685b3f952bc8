"""load_model on tiny checkpoints written by make_checkpoint (real file format: FP8/FP4 + E8M0 scales)."""

from __future__ import annotations

import json

import pytest
import torch
from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model.checkpoint import CheckpointReader
from deepinfer_engine.model.loader import load_model
from deepinfer_engine.model.writer import make_checkpoint
from equality import max_rel_err, run_chunked, run_full

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def ckpt_v4(tiny_ckpt):
    return tiny_ckpt("v4")


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


def test_v41_draft_gate_bias_vl_is_optional_and_never_applied(tmp_path):
    """A V4.1 release carries mtp.{k}.ffn.gate.bias_vl (DeepSeek's code declares it on every gate): it loads with
    them (dropped) and without them; the draft gates route with `bias` only."""
    from deepinfer_engine.model.inventory import optional_tensor_names
    from deepinfer_engine.model.loader import load_state_into
    from deepinfer_engine.model.model import Transformer

    d = make_checkpoint(tmp_path / "ck", "v41", "tiny", 2)
    with CheckpointReader(d) as reader:
        drafts = sorted(n for n in reader.tensor_names() if n.startswith("mtp.") and n.endswith("gate.bias_vl"))
        assert drafts == [f"mtp.{k}.ffn.gate.bias_vl" for k in range(3)]
        assert set(drafts) == optional_tensor_names(reader.args)
        with_vl = load_model(d, torch.float32)
        assert all(st.ffn.gate.bias_vl is None for st in with_vl.mtp)
        assert with_vl.layers[0].ffn.gate.bias_vl is not None  # backbone gates keep theirs

        class _Without:  # the same release without the optional tensors
            def tensor_names(self) -> list[str]:
                return [n for n in reader.tensor_names() if n not in drafts]

            def load(self, name: str, **kw: object) -> torch.Tensor:
                return reader.load(name, **kw)

            def load_raw(self, name: str) -> torch.Tensor:
                return reader.load_raw(name)

        without = Transformer(reader.args, torch.float32, quantized=True)
        load_state_into(without, _Without())
    for (n, a), (_, b) in zip(with_vl.state_dict().items(), without.state_dict().items()):
        assert a.dtype == b.dtype, n
        if a.element_size() == 1:  # FP8 / FP4 / E8M0 bytes: compare the stored bits
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), n
    ids = torch.randint(0, with_vl.args.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(run_full(with_vl, ids)).all()


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


def test_expert_layout_option(ckpt_v4):
    """expert_layout is validated; "chunked" repacks FP4 experts on CUDA only (on CPU the experts keep the
    checkpoint layout, which the torch reference decodes without an unpack; the CUDA repack: model/test_moe.py)."""
    from deepinfer_engine.errors import CheckpointError

    with pytest.raises(CheckpointError, match="expert_layout 'tiled'"):
        load_model(ckpt_v4, torch.float32, expert_layout="tiled")
    m = load_model(ckpt_v4, torch.float32, expert_layout="chunked")
    assert {layer.ffn.experts.w1.fmt for layer in m.layers} == {"fp4"}
