"""The estimator's formula against a simulated wrap on a fake process group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def estimate(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "shardwrap.estimate", *args, "--json"], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model,world", [("gpt2", 8), ("gpt2-xl", 64), ("llama-7b", 1024)])
def test_formula_matches_the_simulated_shards(model, world):
    r = estimate("--model", model, "--world-size", str(world), "--mixed-precision", "bf16", "--simulate")
    sim, psi = r["simulated"], r["psi"]
    assert sim["psi"] == psi
    formula_shard = r["formula"]["3"]["params"]  # 4 Psi / W bytes of fp32 master per rank
    padding_bytes = 4 * sim["padding_elements_per_rank"]
    assert 0 <= sim["shard_bytes"] - formula_shard <= padding_bytes + 1e-6
    assert sim["local_param_bytes"] <= sim["shard_bytes"]
    # The largest unit the simulation built is the formula's, up to padding rows.
    total_padding = sim["padding_elements_per_rank"] * world  # over every unit and rank
    assert r["largest_unit_params"] <= sim["largest_unit"] <= r["largest_unit_params"] + total_padding
    assert sim["units"] == {"gpt2": 13, "gpt2-xl": 49, "llama-7b": 33}[model]


def test_params_only_prints_every_stage():
    out = subprocess.run(
        [sys.executable, "-m", "shardwrap.estimate", "--params", "1.3e9", "--world-size", "8"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    for stage in ("| 1 |", "| 2 |", "| 3 (chosen) |"):
        assert stage in out, out
    r = estimate("--params", "1.3e9", "--world-size", "8")
    assert r["formula"]["3"]["params"] == pytest.approx(4 * 1.3e9 / 8)
    # fp32 stage 1: the master shard and the sharded gradient are rows of the full buffers
    assert r["formula"]["1"]["params"] == pytest.approx(4 * 1.3e9)
    assert r["formula"]["1"]["grads"] == pytest.approx(4 * 1.3e9)
    bf16 = estimate("--params", "1.3e9", "--world-size", "8", "--mixed-precision", "bf16")
    assert bf16["formula"]["1"]["grads"] == pytest.approx(4 * 1.3e9 / 8 + 2 * 1.3e9)
