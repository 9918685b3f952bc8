"""V4 logits == HF transformers DeepseekV4ForCausalLM (fp32, rel err = max|Δ|/max|ref| <= 1e-5).

Tiny V4 (architecture.md §9.1: SWA, CSA ratio 4 with overlap + indexer top-4, HCA ratio 8, 2 hash-MoE layers,
mHC with hc_head) with random official-name weights loaded into both models; several seeds, lengths past the
window (8) and past many CSA (4) / HCA (8) blocks; our side also through chunked prefill and decode.

Tie rule: exact ties in the indexer scores occur on this config (4 heads, ReLU zeros). The spec does not say how
ties are broken; we take the lower entry index (chunk-independent). HF uses `torch.topk`, whose order among equal
values is arbitrary, so while HF runs we replace `Tensor.topk` by a stable version (equal values -> lower index)
— the same rule — which changes nothing for tie-free rows (the MoE router has no exact ties).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")  # 5.17 ships deepseek_v4 but its incremental decode differs from its prefill (seen: rel err 1.1); the oracle needs >= 5.23
pytest.importorskip("transformers.models.deepseek_v4")

from deepinfer_engine.model._equality import max_rel_err, run_chunked, run_full, stable_topk  # noqa: E402
from deepinfer_engine.model.args import ModelArgs  # noqa: E402
from deepinfer_engine.model.model import Transformer  # noqa: E402
from deepinfer_engine.model.presets import tiny_v4_config  # noqa: E402
from deepinfer_engine.testing_hf import build_hf_model, hf_logits, random_official_v4_state  # noqa: E402

TOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: intra-op threads only add overhead on the 2 shared cores
    yield
    torch.set_num_threads(n)


def _models(args: ModelArgs, seed: int):
    state = random_official_v4_state(args, seed=seed)
    ours = Transformer(args, torch.float32)
    ours.load_state_dict(state, strict=True)
    return ours.eval(), build_hf_model(state, args), state


def _ids(args: ModelArgs, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (n,), generator=torch.Generator().manual_seed(500 + seed))


def _hf(hf, ids):
    with stable_topk():
        return hf_logits(hf, ids)


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    a = ModelArgs.from_config_dict(tiny_v4_config())
    assert a.num_hash_layers == 2 and set(a.compress_ratios) == {0, 4, 8}
    return a


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_forward_matches_hf(args, seed):
    ours, hf, _ = _models(args, seed)
    ids = _ids(args, 40, seed)
    ref = _hf(hf, ids)
    got = run_full(ours, ids)
    assert max_rel_err(got, ref) <= TOL
    # a short prompt (partial window, partial first blocks) ends differently than a prefix of a long one
    assert max_rel_err(run_full(ours, ids[:11]), ref[:11]) <= TOL
    if seed == 0:
        # cache paths against the oracle as well: chunked prefill with a chunk > window, then decode steps
        assert max_rel_err(run_chunked(ours, ids, [13, 1, 1, 1, 6, 1, 7, 10]), ref) <= TOL
        assert max_rel_err(run_chunked(ours, ids, [1] * 40), ref) <= TOL


def test_comparison_detects_a_wrong_compressor(args):
    """The oracle comparison is sensitive to the compressed paths (a perturbed CSA ape must fail)."""
    ours, hf, state = _models(args, 0)
    ids = _ids(args, 40, 0)
    ref = _hf(hf, ids)
    bent = dict(state)
    ape = state["layers.1.attn.compressor.ape"]
    # a per-position change (a constant shift would cancel in the per-channel softmax)
    bent["layers.1.attn.compressor.ape"] = ape + torch.randn(ape.shape, generator=torch.Generator().manual_seed(7))
    other = Transformer(args, torch.float32)
    other.load_state_dict(bent, strict=True)
    assert max_rel_err(run_full(other, ids), ref) > 1e3 * TOL


@pytest.mark.slow
def test_hca_ratio_128_matches_hf():
    cfg = tiny_v4_config()
    cfg["compress_ratios"] = [0, 4, 128, 4, 128, 4, 0]
    a = ModelArgs.from_config_dict(cfg)
    ours, hf, _ = _models(a, 3)
    ids = _ids(a, 300, 3)
    ref = _hf(hf, ids)
    assert max_rel_err(run_full(ours, ids), ref) <= TOL
    assert max_rel_err(run_chunked(ours, ids, [100, 1, 27, 1, 171]), ref) <= TOL


def test_v4_0731_backbone_matches_hf():
    """V4-Flash-0731 (tiny-dspark): three DSpark stages instead of MTP; the backbone logits are still HF's."""
    from deepinfer_engine.model._equality import init_random_
    from deepinfer_engine.model.presets import tiny_v4_dspark_config

    a = ModelArgs.from_config_dict(tiny_v4_dspark_config())
    ours = init_random_(Transformer(a, torch.float32), seed=5).eval()
    assert ours.mtp is not None and len(ours.mtp) == 3
    backbone = {k: v for k, v in ours.state_dict().items() if not k.startswith("mtp.")}
    hf = build_hf_model(backbone, a)
    ids = _ids(a, 33, 5)
    assert max_rel_err(run_full(ours, ids), _hf(hf, ids)) <= TOL
