"""Bad training input gets a message naming the actual problem (these used to name a different one), and
nothing is trained or generated for it."""

from __future__ import annotations

import json

import pytest
from helpers import write_target
from test_train_dflash import small_cfg

from retrace.errors import RetraceError
from retrace.runtime.prompts import read_prompts_jsonl
from retrace.train.dflash import train_dflash


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory.mktemp("bad") / "target", vocab=128, hidden=64, layers=2, heads=4,
                        kv_heads=2, intermediate=96)


def test_default_taps_that_do_not_fit_the_target_name_the_option(target, tmp_path):
    """--layers 2 on a 2-layer target: z-lab's default spacing gives taps [1, -1] (it said "tap layers [-1]
    do not exist", which the user never asked for)."""
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    with pytest.raises(RetraceError, match=r"--layers 2: z-lab's default taps .*\[1, -1\].* 2-layer target; pass "
                                           r"--target-layer-ids"):
        train_dflash(target, tmp_path / "d", p, small_cfg(num_layers=2), progress=False)
    assert not (tmp_path / "d").exists()
    train_dflash(target, tmp_path / "ok", p, small_cfg(num_layers=2, target_layer_ids=[0, 1], steps=1,
                                                      val_prompts=0, eval_tau_prompts=0), progress=False)


def test_all_empty_prompts_say_so(target, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt_ids": []}) + "\n" for _ in range(5)))
    with pytest.raises(RetraceError, match="all 5 prompts are empty"):  # was "cannot be split into 1 data shards"
        train_dflash(target, tmp_path / "d", p, small_cfg(), progress=False)


def test_an_empty_valid_parquet_file_has_no_rows(target, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p)
    with pytest.raises(RetraceError, match=f"{p}: no rows"):  # was "cannot read as parquet"
        train_dflash(target, tmp_path / "d", p, small_cfg(), progress=False)


@pytest.mark.parametrize("where", ["directory", "device"])
def test_a_prompts_path_that_is_no_file_says_what_it_is(tmp_path, where):
    p, what = (tmp_path, "is a directory") if where == "directory" else ("/dev/null", "is not a regular file")
    with pytest.raises(RetraceError, match=f"{p}: {what}; a prompts file is JSONL"):  # was "not found"
        read_prompts_jsonl(p)
    with pytest.raises(RetraceError, match="not found"):
        read_prompts_jsonl(tmp_path / "missing.jsonl")
