"""`retrace eval`: JSON shape, paired statistics, lossless greedy across modes."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from retrace.cli import main
from retrace.train.evaluate import paired_stats

pytestmark = pytest.mark.usefixtures("one_thread")


def test_paired_stats():
    a = [1.0, 2.0, None, 3.0]
    b = [1.5, 2.0, 4.0, 4.0]
    s = paired_stats(a, b)
    assert s["n"] == 3
    assert s["mean_diff"] == pytest.approx(0.5)
    sd = math.sqrt(((0.5 - 0.5) ** 2 + (0 - 0.5) ** 2 + (1 - 0.5) ** 2) / 2)
    assert s["se"] == pytest.approx(sd / math.sqrt(3), abs=1e-5)
    assert paired_stats([None], [1.0]) == {"mean_diff": None, "se": None, "n": 0}


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_eval_json_shape(tiny_pair, tmp_path, temperature):
    pair = tiny_pair(block_size=8, conditioner="random")
    p = tmp_path / "p.jsonl"
    rows = [{"prompt_ids": [5 + i, 7, 9 + i, 11], "domain": "code" if i % 2 else "docs"} for i in range(6)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(main, ["eval", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                                    "--prompts", str(p), "--max-new-tokens", "12", "--temperature", temperature,
                                    "--block-size", "6", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert set(rep["modes"]) == {"dflash", "retrace"}
    for m in ("dflash", "retrace"):
        r = rep["modes"][m]
        assert isinstance(r["tau"], float) and 1.0 <= r["tau"] <= 6.0
        assert len(r["per_prompt"]) == 6
        assert r["tau"] == pytest.approx(sum(r["per_prompt"]) / 6, abs=1e-4)
        assert 1.0 <= r["tau_pooled"] <= 6.0
    assert set(rep["paired"]) >= {"mean_diff", "se", "n"} and rep["paired"]["n"] == 6
    assert set(rep["by_domain"]) == {"code", "docs"}
    assert rep["settings"]["block_size"] == 6
    if temperature == "0":
        assert rep["outputs_equal"] is True  # lossless: both modes emit the target's greedy tokens
    text = CliRunner().invoke(main, ["eval", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                                     "--prompts", str(p), "--max-new-tokens", "8", "--limit", "2"])
    assert text.exit_code == 0 and "retrace - dflash" in text.output


def test_eval_errors(tiny_pair, tmp_path):
    pair = tiny_pair(block_size=8)  # no conditioner
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    res = CliRunner().invoke(main, ["eval", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                                    "--prompts", str(p)])
    assert res.exit_code == 2 and "conditioner" in res.output
    res = CliRunner().invoke(main, ["eval", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                                    "--prompts", str(p), "--modes", "dflash", "--block-size", "9"])
    assert res.exit_code == 2 and "block size" in res.output
    res = CliRunner().invoke(main, ["eval", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                                    "--prompts", str(tmp_path / "missing.jsonl")])
    assert res.exit_code != 0
