"""scripts/dspark_policy_replay.py: recorded verify_all rounds replayed per policy. A policy that verifies m drafts
of a request emits min(m, a) + 1 tokens (a: the drafts accepted with all verified); the time is the curve's price
of the round's row bucket; the round's own global choice is replayed at T = 0 only."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest


def _rounds(path, temperature: float, batch: int = 8, width: int = 5, count: int = 24) -> list:
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(count):
        good = rng.integers(0, width + 1, size=batch)  # drafts before the survivals drop (bimodal)
        s = np.where(np.arange(width)[None, :] < good[:, None], 0.95, 0.02) ** np.arange(1, width + 1)[None, :]
        s = np.minimum.accumulate(s.astype(np.float32), axis=1)
        rounds.append((s, np.minimum(good, rng.integers(0, width + 1, size=batch)).astype(np.int64)))
    path.write_bytes(pickle.dumps({"temperature": temperature, "rounds": rounds}))
    return rounds


def _curve(path, batch: int = 8) -> None:
    sizes = sorted({-(-batch * k // 2) for k in range(2, 13)})
    row = {"policy": "cost", "prompts": batch, "temperature": 0.0, "latency_after": {"by_batch": {str(batch): {
        "sizes": sizes, "measured_ms": [1.0 + 0.02 * q for q in sizes], "noise_ms": 0.001, "overhead_ms": 1.0}}}}
    path.write_text(json.dumps({"rows": [row]}))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_counts_tokens_exactly_and_prices_row_buckets(script, tmp_path, temperature, capsys):
    replay = script("dspark_policy_replay")
    rounds = _rounds(tmp_path / "r.pkl", temperature)
    _curve(tmp_path / "c.json")
    out = tmp_path / "o.json"
    assert replay.main(["replay", str(tmp_path / "r.pkl"), "--curve-json", str(tmp_path / "c.json"), "--skip", "4",
                        "--json", str(out)]) == 0
    got = json.loads(out.read_text())["policies"]
    kept = rounds[4:]
    assert got["verify_all"]["verified"] == 40
    assert got["verify_all"]["tokens"] == pytest.approx(np.mean([8 + a.sum() for _, a in kept]))
    # threshold 0.5: the prefix of survivals >= 0.5, each request emitting min(that, a) + 1
    want = np.mean([8 + np.minimum((s >= 0.5).cumprod(1).sum(1), a).sum() for s, a in kept])
    assert got["threshold 0.5"]["tokens"] == pytest.approx(want)
    # every time is the curve at the round's row bucket (rows 8 + verified, rounded up to the next of 8, 12, ...)
    bucket = 8 + 40  # verify_all fills the largest
    assert got["verify_all"]["ms"] == pytest.approx(1.0 + 1.0 + 0.02 * bucket)
    assert all(r["tokens"] <= got["verify_all"]["tokens"] + 1e-9 for r in got.values())
    # choosing in the round reads the round's own survivals: unbiased only at T = 0; a carried cutoff at any T
    assert ("cost in the round" in got) == (temperature == 0)
    cut = got["cost cutoff, lag 1, every 1"]  # searched on each round before, applied as a threshold
    assert 0 < cut["verified"] < 40 and cut["tokens"] <= got["verify_all"]["tokens"]
    assert "rounds of 8 requests" in capsys.readouterr().out


def test_features_fit_the_drafts_own_probability_and_score_exactly(script, tmp_path, capsys):
    """`features`: on rounds where a draft's acceptance follows its own probability q besides the head's c, the fit
    weighs log q, and its exact survivals (a draft's own q read only for the drafts after it) cut more drafts at 97%
    of the tokens than the head's."""
    replay = script("dspark_policy_replay")
    rng = np.random.default_rng(1)

    def recording(path, count=40, batch=32, width=5):
        rounds, feats = [], []
        for _ in range(count):
            c = rng.uniform(0.3, 0.9, size=(batch, width))
            q = rng.uniform(0.01, 1.0, size=(batch, width))
            accept = rng.random((batch, width)) < np.clip(c * np.sqrt(q) * 1.3, 0, 1)
            a = np.logical_and.accumulate(accept, axis=1).sum(1).astype(np.int64)
            rounds.append((np.cumprod(c, 1).astype(np.float32), a))
            feats.append((c.astype(np.float32), q.astype(np.float32)))
        path.write_bytes(pickle.dumps({"temperature": 1.0, "rounds": rounds, "features": feats}))

    recording(tmp_path / "a.pkl")
    recording(tmp_path / "b.pkl")
    out = tmp_path / "o.json"
    assert replay.main(["features", str(tmp_path / "a.pkl"), str(tmp_path / "b.pkl"), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["weights"][2] > 0.2 and got["rounds"] == 40  # log q carries weight
    assert got["fitted, exact"]["cut_at_97"] > got["head"]["cut_at_97"]
    assert "test rounds" in capsys.readouterr().out
    # hand-checked frontier: one request, two drafts of scores 0.9 / 0.5, both accepted
    r = replay.frontier([np.asarray([[0.9, 0.5]])], [np.asarray([2])])
    assert r["cut_at_97"] == 0.0 and r["tokens_at_30"] == pytest.approx(2 / 3)
    with pytest.raises(SystemExit, match="no draft features"):
        (tmp_path / "c.pkl").write_bytes(pickle.dumps({"temperature": 0.0, "rounds": [], "features": []}))
        replay.main(["features", str(tmp_path / "c.pkl"), str(tmp_path / "b.pkl")])
