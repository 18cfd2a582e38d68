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


# ---- --offload cpu|disk -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("precision,p", [("bf16", 2), ("none", 4)])
@pytest.mark.parametrize("max_unsharded", [1, 2])
def test_offload_formula_columns_at_a_hand_checkable_size(kind, precision, p, max_unsharded):
    """Psi = 1200 parameters in four units of 500, 400, 200 and 100, W = 4 ranks, p bytes per
    compute element (bf16: 2, none: 4), M = max_unsharded; H = the M + 1 largest units'
    parameters, G = the M largest units'. Per rank, in bytes:

    - device parameters: p Psi at stages 1 and 2, p H at stage 3;
    - device gradients: p Psi at stage 1, p H at stages 2 and 3;
    - device staging: p G / W; device: the sum of the three;
    - host RAM: cpu 4 Psi/W (master) + 4 Psi/W (gradient shards) + 8 Psi/W (AdamW), disk 4 Psi/W;
    - disk: disk 4 Psi/W + 8 Psi/W, cpu 0;
    - CPU-only run RAM: device + host RAM.
    """
    from shardwrap import estimate as est

    units, psi, W = [100, 500, 200, 400], 1200, 4
    H = sum(sorted(units, reverse=True)[: max_unsharded + 1])
    G = sum(sorted(units, reverse=True)[:max_unsharded])
    assert (H, G) == {1: (900, 500), 2: (1100, 900)}[max_unsharded]  # the definitions, read by hand
    rows = est.offload_formula(psi, units, W, precision, kind, max_unsharded)
    for stage in (1, 2, 3):
        params = p * psi if stage <= 2 else p * H
        grads = p * psi if stage == 1 else p * H
        staging = p * G / W
        host = (4 + 4 + 8) * psi / W if kind == "cpu" else 4 * psi / W
        disk = (4 + 8) * psi / W if kind == "disk" else 0
        row = rows[stage]
        assert row["device_params"] == pytest.approx(params)
        assert row["device_grads"] == pytest.approx(grads)
        assert row["device_staging"] == pytest.approx(staging)
        assert row["device"] == pytest.approx(params + grads + staging)
        assert row["host"] == pytest.approx(host)
        assert row["host_master"] + row["host_grads"] + row["host_optim"] == pytest.approx(host)
        assert row["disk"] == pytest.approx(disk)
        assert row["cpu_only_ram"] == pytest.approx(params + grads + staging + host)


def test_offload_json_fields_and_columns(capsys, monkeypatch):
    from shardwrap import estimate as est

    monkeypatch.setattr(est, "_memory_bytes", lambda: 2**50)  # a machine where anything fits
    fields = {"device_params", "device_grads", "device_staging", "device", "host_master", "host_grads", "host_optim",
              "host", "disk", "cpu_only_ram"}
    for kind in ("cpu", "disk"):
        est.main(["--model", "gpt2", "--world-size", "4", "--offload", kind, "--max-unsharded", "3", "--json"])
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert r["offload"] == kind and r["max_unsharded"] == 3
        assert set(r["offload_formula"]) == {"1", "2", "3"}
        assert all(set(row) == fields for row in r["offload_formula"].values())
        # the keys a JSON reader gets are the formula's, unit sizes from the model
        counts = est.unit_param_counts(est.SHAPES["gpt2"])
        want = est.offload_formula(r["psi"], counts, 4, "none", kind, 3)
        assert r["offload_formula"] == {str(s): row for s, row in want.items()}
        if kind == "disk":
            assert r["machine_memory_bytes"] == 2**50 and r["fits_without_offload"] is True
            assert r["without_offload_bytes"] == pytest.approx(4 * r["formula"]["3"]["total"])
        else:
            assert "fits_without_offload" not in r
    est.main(["--model", "gpt2", "--world-size", "4", "--offload", "disk"])
    out = capsys.readouterr().out
    for column in ("device total", "host RAM", "| disk |", "CPU-only run: RAM (device + host)", "3 (chosen)"):
        assert column in out, out
    assert "the run without offload fits in this machine's memory" in out, out
    est.main(["--model", "gpt2", "--world-size", "4", "--offload", "cpu"])
    out = capsys.readouterr().out
    assert "host RAM" in out and "| disk |" not in out and "fits" not in out, out
    est.main(["--model", "gpt2", "--world-size", "4", "--json"])  # no offload: no new columns
    r = json.loads(capsys.readouterr().out)
    assert r["offload"] == "none" and "offload_formula" not in r and "fits_without_offload" not in r
    est.main(["--model", "gpt2", "--world-size", "4"])
    assert "host RAM" not in capsys.readouterr().out
    monkeypatch.setattr(est, "_memory_bytes", lambda: None)
    est.main(["--params", "1e6", "--world-size", "2", "--offload", "disk", "--json"])
    assert json.loads(capsys.readouterr().out)["fits_without_offload"] is None


def test_simulated_cpu_offload_agrees_with_the_formula_within_padding():
    # gpt2 at W = 3: the vocabulary (50257) and positions (1024) rows are padded to a multiple of 3
    r = estimate("--model", "gpt2", "--world-size", "3", "--mixed-precision", "bf16", "--simulate", "--offload", "cpu")
    sim, formula, W, p, M = r["simulated"], r["offload_formula"], 3, 2, r["max_unsharded"]
    pad, n_units = sim["padding_elements_per_rank"], sim["units"]
    assert pad > 0 and n_units == 13
    for stage in ("1", "2", "3"):
        s, f = sim["offload"][stage], formula[stage]
        # unsharded params and grads: at most every unit's padding rows over the W ranks each;
        # staging: at most a rank's padding and each shard's tag
        for key, bound in (("device_params", p * W * pad), ("device_grads", p * W * pad),
                           ("device_staging", p * (pad + M))):
            assert 0 <= s[key] - f[key] <= bound + 1e-6, (stage, key, s[key], f[key])
        # host: the padded master shards with their tags, gradient shards and AdamW's two states
        assert s["host"] - f["host"] == pytest.approx(4 * (pad + n_units) + 4 * pad + 8 * pad)
        assert s["disk"] == f["disk"] == 0
        assert s["cpu_only_ram"] == pytest.approx(s["device"] + s["host"])


def test_disk_offload_says_a_huge_run_without_offload_does_not_fit():
    out = subprocess.run(
        [sys.executable, "-m", "shardwrap.estimate", "--params", "1e13", "--world-size", "2", "--offload", "disk"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "the run without offload does not fit in this machine's memory" in out, out
    assert "| disk |" in out and "CPU-only run" in out, out


def test_max_unsharded_below_one_is_a_usage_error(capsys):
    from shardwrap import estimate as est

    with pytest.raises(SystemExit) as exit_:
        est.main(["--params", "1e9", "--world-size", "2", "--offload", "cpu", "--max-unsharded", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --max-unsharded:" in err and "Traceback" not in err, err
