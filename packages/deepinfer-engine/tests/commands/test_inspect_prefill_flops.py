"""`deepinfer inspect --config FILE --prefill-flops`: the FLOPs table of prefill_flops for 1K .. 128K prompts."""

from __future__ import annotations

from pathlib import Path

from deepinfer_engine.cli import main
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.prefill_flops import prefill_flops

REAL = Path(__file__).parents[1] / "data" / "v41_flash_config.json"


def test_prefill_flops_table(capsys) -> None:
    assert main(["inspect", "--config", str(REAL), "--prefill-flops", "--keep", "256"]) == 0
    out = capsys.readouterr().out
    assert "compact keep = 256" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1024 << i for i in range(8)]
    a = ModelArgs.from_file(REAL)
    full, cut = prefill_flops(a, 131072), prefill_flops(a, 131072, 256)
    assert rows[-1][1:4] == [f"{full.total / 1e12:.2f}", f"{cut.total / 1e12:.2f}",
                             f"{(full.total - cut.total) / full.total:.1%}"]
