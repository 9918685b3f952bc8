"""Bad input gives typed errors at the model entry / in the loader, never a crash deep inside a matmul."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.errors import CheckpointError, InputError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.loader import load_state_into
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config
from equality import init_random_


@pytest.fixture(scope="module")
def model() -> Transformer:
    return init_random_(Transformer(ModelArgs.from_config_dict(tiny_v4_config()), torch.float32), seed=0)


def _run(model, ids, start=0):
    cache, bt = ModelCache.allocate_dense(model.args, [8], dtype=torch.float32)
    return model(ForwardBatch.single(torch.tensor(ids), start_pos=start, block_table=bt[0]), cache)


def test_token_id_out_of_range(model):
    with pytest.raises(InputError, match="token id 129280"):
        _run(model, [1, 129280])
    with pytest.raises(InputError, match="token id -1"):
        _run(model, [-1, 3])


def test_position_beyond_max_position_embeddings(model):
    with pytest.raises(InputError, match="max_position_embeddings=4096"):
        _run(model, [1, 2], start=4095)


def test_malformed_batches(model):
    cache, bt = ModelCache.allocate_dense(model.args, [8], dtype=torch.float32)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(InputError, match="consecutive"):
        model(
            ForwardBatch(input_ids=ids, positions=torch.tensor([0, 2, 3]), query_lens=(3,), slots=(0,),
                         block_tables=bt, logits_indices=torch.arange(3)),
            cache,
        )  # fmt: skip
    with pytest.raises(InputError, match="slots"):
        model(ForwardBatch.single(ids, slot=4, block_table=bt[0]), cache)
    with pytest.raises(InputError, match="query_lens"):
        ForwardBatch(input_ids=ids, positions=torch.arange(3), query_lens=(2,), slots=(0,), block_tables=bt,
                     logits_indices=torch.arange(3))  # fmt: skip
    with pytest.raises(InputError, match="int64"):
        ForwardBatch(input_ids=ids.int(), positions=torch.arange(3), query_lens=(3,), slots=(0,), block_tables=bt,
                     logits_indices=torch.arange(3))  # fmt: skip


class _FakeReader:
    """Stands in for CheckpointReader: name -> tensor."""

    def __init__(self, tensors):
        self.t = dict(tensors)

    def tensor_names(self):
        return list(self.t)

    def load(self, name, dtype=torch.float32, device="cpu"):
        v = self.t[name]
        return v if not v.is_floating_point() else v.to(dtype)


def _checkpoint_state(model):
    """The model's tensors under their checkpoint names (stacked experts split into per-expert tensors)."""
    from deepinfer_engine.model.loader import expected_checkpoint_tensors

    sd = model.state_dict()
    return {ck: (sd[p] if e is None else sd[p][e]) for ck, (p, e) in expected_checkpoint_tensors(model).items()}


def test_loader_copies_every_tensor_by_name(model):
    fresh = Transformer(model.args, torch.float32)
    sd = model.state_dict()
    load_state_into(fresh, _FakeReader(_checkpoint_state(model)))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_loader_rejects_shape_mismatch_missing_and_unexpected(model):
    sd = _checkpoint_state(model)
    bad = dict(sd)
    bad["layers.1.attn.wq_a.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_a\.weight.*\[3, 3\].*\[32, 64\]"):
        load_state_into(Transformer(model.args, torch.float32), _FakeReader(bad))
    missing = {k: v for k, v in sd.items() if k != "layers.2.attn.compressor.ape"}
    with pytest.raises(CheckpointError, match="1 missing.*layers.2.attn.compressor.ape"):
        load_state_into(Transformer(model.args, torch.float32), _FakeReader(missing))
    extra = dict(sd, **{"layers.0.attn.indexer.wq_b.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="1 unexpected"):
        load_state_into(Transformer(model.args, torch.float32), _FakeReader(extra))
    # scale companions of quantized weights are not "unexpected"
    with_scale = dict(sd, **{"layers.0.attn.wq_a.scale": torch.ones(1, 1)})
    load_state_into(Transformer(model.args, torch.float32), _FakeReader(with_scale))


def test_kernel_backend_is_resolved_once_at_build(monkeypatch) -> None:
    """The model reads DEEPINFER_KERNEL_BACKEND when it is built and hands the result to every module; a later
    change of the variable does not reach it (no op reads the environment on a model's behalf)."""
    import torch
    from deepinfer_engine.model import presets
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.model import Transformer

    args = ModelArgs.from_config_dict(presets.tiny_v4_config())
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    with torch.device("meta"):
        model = Transformer(args, torch.float32)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    backends = {getattr(m, "kernel_backend", None) for m in model.modules()}
    assert backends == {"torch"}
    monkeypatch.delenv("DEEPINFER_KERNEL_BACKEND")
    model.set_kernel_backend("device")
    assert {m.kernel_backend for m in model.modules()} == {"device"}
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "bogus")
    from deepinfer_kernels import KernelBackendError

    with pytest.raises(KernelBackendError, match="DEEPINFER_KERNEL_BACKEND"), torch.device("meta"):
        Transformer(args, torch.float32)
