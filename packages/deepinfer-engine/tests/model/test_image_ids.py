"""Image positions are ids past the vocabulary, never the config's image_token_id (docs/fidelity.md §2).

Proof of "text is text": prompts containing ids 129264..129268 (the real vocabulary's image_token_id and its
four successors) give bit-identical logits whether or not the gates carry a bias_vl, while ids 129280..129284
(image positions) do route with it.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.errors import InputError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.image_ids import IMAGE_ID_SPAN, accepts_image_ids, image_positions, max_input_id
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config
from equality import run_full

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(make_tiny_v41_model) -> tuple[Transformer, Transformer]:
    a = make_tiny_v41_model(seed=21)
    b = make_tiny_v41_model(seed=21)
    with torch.no_grad():
        for layer in b.layers:
            assert layer.ffn.gate.bias_vl is not None and layer.ffn.gate.bias_vl.abs().max() > 0.1
            layer.ffn.gate.bias_vl.zero_()
    return a, b


def test_real_vocab_and_image_token_id() -> None:
    args = ModelArgs.from_config_dict(tiny_v41_config())
    assert args.vocab_size == 129280 and args.image_token_id == 129264
    assert accepts_image_ids(args) and max_input_id(args) == 129280 + IMAGE_ID_SPAN
    v4 = ModelArgs.from_config_dict(tiny_v4_config())
    assert not accepts_image_ids(v4) and max_input_id(v4) == v4.vocab_size
    ids = torch.tensor([129263, 129264, 129268, 129279, 129280, 129284])
    assert image_positions(ids, args.vocab_size).tolist() == [False] * 4 + [True] * 2


def test_text_ids_129264_to_129268_ignore_bias_vl(models) -> None:
    a, b = models
    g = torch.Generator().manual_seed(4)
    for n in (7, 19):
        ids = torch.randint(3, 129280, (n,), generator=g)
        ids[1:6] = torch.arange(129264, 129269)
        ids[-1] = 129266
        la, lb = run_full(a, ids), run_full(b, ids)
        assert torch.equal(la, lb)


def test_image_ids_do_use_bias_vl(models) -> None:
    a, b = models
    ids = torch.randint(3, 129280, (19,), generator=torch.Generator().manual_seed(5))
    ids[2:7] = 129280 + torch.arange(5)
    diff = (run_full(a, ids) - run_full(b, ids)).abs().max()
    assert float(diff) > 1e-4


def test_ids_past_the_image_range_are_rejected(models) -> None:
    a, _ = models
    with pytest.raises(InputError, match="129285"):
        run_full(a, torch.tensor([5, 129285]))
    v4 = Transformer(ModelArgs.from_config_dict(tiny_v4_config()), torch.float32)
    with pytest.raises(InputError, match="vocab_size"):
        run_full(v4, torch.tensor([5, v4.args.vocab_size]))
