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


@pytest.mark.parametrize("args,option", [
    (["--params", "1e9", "--world-size", "0"], "--world-size"),
    (["--params", "1e9", "--world-size", "-2"], "--world-size"),
    (["--params", "1e9", "--world-size", "2.5"], "--world-size"),
    (["--model", "gpt2", "--world-size", "-1", "--simulate"], "--world-size"),
    (["--params", "0", "--world-size", "8"], "--params"),
    (["--params=-1e9", "--world-size", "8"], "--params"),
    (["--params", "nan", "--world-size", "8"], "--params"),
    (["--params", "inf", "--world-size", "8"], "--params"),
])
def test_impossible_values_are_usage_errors_naming_the_option(args, option, capsys):
    from shardwrap import estimate as est

    with pytest.raises(SystemExit) as exit_:
        est.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}:" in err and "Traceback" not in err, err


def test_world_size_zero_from_the_command_line_exits_2_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "shardwrap.estimate", "--params", "1e9", "--world-size", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "argument --world-size: 0 ranks is impossible" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stdout == ""  # no table of negative or infinite sizes


def test_a_simulation_that_cannot_fit_in_memory_is_refused_before_it_starts(monkeypatch, capsys):
    from shardwrap import estimate as est

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulate() ran")

    monkeypatch.setattr(est, "_memory_bytes", lambda: 2**30)  # a machine with 1 GiB
    monkeypatch.setattr(est, "simulate", no_simulation)
    # gpt2 at W = 1: 0.46 GiB of fp32 shards, but a padded unit grows with W past the rows of a
    # parameter (W = 10^6: every parameter padded to 10^6 rows).
    with pytest.raises(SystemExit) as exit_:
        est.main(["--model", "gpt2", "--world-size", "1000000", "--simulate"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--world-size 1000000 with --simulate" in err and "padded unsharded unit" in err, err
    with pytest.raises(SystemExit):  # llama-7b at W = 8: 3.1 GiB of shards
        est.main(["--model", "llama-7b", "--world-size", "8", "--simulate"])
    assert "GiB of fp32 shards on rank 0" in capsys.readouterr().err
    shards, largest = est.simulated_memory(est.SHAPES["gpt2"], 1, "none")
    assert shards == 4 * est.unit_sizes(est.SHAPES["gpt2"])[0] and largest < 2**30
