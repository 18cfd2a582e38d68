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


# ---- --mesh RxS: hybrid meshes and the collectives of one step --------------------------------


def _padded_shards(shape_name: str, shards: int) -> list[tuple[int, int]]:
    """Per unit (root first, then the blocks), its padded shard elements per rank at ``shards``,
    written out from the parameter shapes: every parameter's dim 0 rounded up to a multiple of
    S, divided by S, times the elements of a row (all parameters train)."""
    from shardwrap import estimate as est

    model = est.build_on_meta(est.SHAPES[shape_name])
    blocks = list(model.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}

    def padded(params) -> int:
        return sum(-(-(p.shape[0] if p.dim() else 1) // shards) * (p[0].numel() if p.dim() else 1) for p in params)

    root = padded(p for p in model.parameters() if id(p) not in in_blocks)
    return [(root, root)] + [(padded(b.parameters()),) * 2 for b in blocks]


def test_collectives_formula_at_a_hand_checkable_size():
    """Three units with padded shards of 10, 6 and 6 elements (the last with 4 trainable), R = 4
    replicas of S = 8 shards, fp32 (4 bytes), stage 3, per rank:

    - all-gathers: forward all three (11 + 7 + 7 = 25 elements with the tags); backward only the
      middle unit (the root and the unit that ended the forward stay gathered): 7; 32 in 4 calls,
      wire 7 * 32 * 4 bytes received;
    - reduce-scatters: 8 * (11 + 7 + 5) = 184 elements in 3 calls, wire 7 * 23 * 4 bytes sent;
    - all-reduce over replicate: the reduced shards and flags, 11 + 7 + 5 = 23 elements, wire
      2 * 3/4 * 23 * 4 = 138 bytes;
    - headers 2 elements per gather, counts 2 per unit in backward.
    """
    from shardwrap import estimate as est

    units, mesh = [(10, 10), (6, 6), (6, 4)], est.Mesh(4, 8)
    f = est.collectives_formula(units, 22, mesh, "none", 3)
    ag, rs, ar = f["shard"]["all_gather"], f["shard"]["reduce_scatter"], f["replicate"]["replicate_all_reduce"]
    assert (ag["calls"], ag["forward_calls"], ag["backward_calls"], ag["elements"]) == (4, 3, 1, 32)
    assert ag["bytes"] == 4 * 32 and ag["wire_bytes"] == 7 * 32 * 4
    assert (rs["calls"], rs["elements"], rs["wire_bytes"]) == (3, 184, 7 * 23 * 4)
    assert (ar["calls"], ar["elements"], ar["wire_bytes"]) == (3, 23, 138)
    assert f["counter"] == {"all_gather": 32, "all_gather_calls": 4, "reduce_scatter": 184, "reduce_scatter_calls": 3,
                            "headers": 8, "headers_calls": 4, "counts": 6, "counts_calls": 3,
                            "replicate_all_reduce": 23, "replicate_all_reduce_calls": 3,
                            "bytes": 4 * (32 + 184 + 23) + 8 * (8 + 6)}
    first = est.collectives_formula(units, 22, mesh, "none", 3, first_step=True)["shard"]["all_gather"]
    assert (first["calls"], first["elements"]) == (5, 39)  # the last unit is gathered again
    for stage in (1, 2):  # no gathers in backward
        assert est.collectives_formula(units, 22, mesh, "none", stage)["shard"]["all_gather"]["elements"] == 25
    bf16 = est.collectives_formula(units, 22, mesh, "bf16", 3)
    assert bf16["shard"]["all_gather"]["bytes"] == 2 * 32 and bf16["replicate"]["replicate_all_reduce"]["wire_bytes"] == 69
    one = est.collectives_formula(units, 22, est.Mesh(1, 8), "none", 3)
    assert one["replicate"] == {} and "replicate_all_reduce" not in one["counter"]  # R = 1: nothing to sum, none issued


@pytest.mark.parametrize("model,mesh", [("llama-7b", "8x512"), ("llama-70b", "16x256")])
def test_mesh_formula_is_the_ideal_one_plus_padding_and_tags(model, mesh, capsys):
    """Per rank at R x S: memory is the 1-D formula at S; one gather pass is Psi / S elements plus
    the padding and a tag per unit; the replicate all-reduce moves 2 Psi (R - 1) / (R S)
    elements plus padding (ring)."""
    from shardwrap import estimate as est

    R, S = (int(x) for x in mesh.split("x"))
    r = est.main(["--model", model, "--mesh", mesh, "--mixed-precision", "bf16", "--json"])
    capsys.readouterr()
    psi, pad, U = r["psi"], r["padding_elements_per_rank"], {"llama-7b": 33, "llama-70b": 81}[model]
    assert r["world_size"] == R * S and r["mesh"] == {"replicas": R, "shards": S}
    one_d = est.main(["--model", model, "--world-size", str(S), "--mixed-precision", "bf16", "--json"])
    capsys.readouterr()
    assert r["formula"] == one_d["formula"]
    assert pad == sum(n for n, _ in _padded_shards(model, S)) - psi / S
    f = r["collectives_formula"][3]
    ag, ar = f["shard"]["all_gather"], f["replicate"]["replicate_all_reduce"]
    assert (ag["forward_calls"], ag["backward_calls"]) == (U, U - 2)
    forward_pass = psi / S + pad + U
    root = _padded_shards(model, S)[0][0]
    last = _padded_shards(model, S)[-1][0]
    assert ag["elements"] == pytest.approx(forward_pass + forward_pass - (root + 1) - (last + 1))
    assert ag["wire_bytes"] == pytest.approx(2 * (S - 1) * ag["elements"])
    assert ar["elements"] == pytest.approx(psi / S + pad + U)  # the used-flags
    assert ar["wire_bytes"] == pytest.approx(2 * 2 * (R - 1) / (R * S) * (psi + S * (pad + U)))


@pytest.mark.parametrize("mesh", ["8x128", "16x256"])  # W = 1,024 and 4,096
def test_simulated_hybrid_step_matches_the_formula_exactly(mesh):
    """A real wrap on a fake R x S mesh and two real training steps: rank 0's shards are the
    padded sizes at S, and the collectives counted per axis equal the formula to the element."""
    R, S = (int(x) for x in mesh.split("x"))
    r = estimate("--model", "gpt2", "--mesh", mesh, "--mixed-precision", "bf16", "--simulate", "--steps", "2")
    sim, psi = r["simulated"], r["psi"]
    padded = _padded_shards("gpt2", S)
    assert sim["psi"] == psi and sim["units"] == 13
    assert [tuple(u) for u in sim["shards_per_unit"]] == padded
    assert sim["shard_bytes"] == 4 * sum(n for n, _ in padded)
    assert sim["padding_elements_per_rank"] == pytest.approx(r["padding_elements_per_rank"])
    assert sim["padding_elements_per_rank"] == pytest.approx(sum(n for n, _ in padded) - psi / S)
    assert sim["padding_elements_per_rank"] > 0  # the vocabulary's 50257 rows
    step = sim["step"]
    want = r["collectives_formula"]["3"]["counter"]
    first, second = step["counters"]
    assert second == want, (second, want)
    assert first == r["collectives_formula_first_step"]["counter"], first
    assert want["replicate_all_reduce"] == sum(g + 1 for _, g in padded)
    assert want["all_gather"] == 2 * sum(n + 1 for n, _ in padded) - (padded[0][0] + 1) - (padded[-1][0] + 1)
    assert want["reduce_scatter"] == S * sum(g + 1 for _, g in padded)
    # after the step: fp32 master shards, gradient shards and AdamW state of rank 0
    state, shard = step["model_state"], sim["shard_bytes"]
    assert shard <= state["params"] <= shard + 4 * sim["units"]  # and each unit's tag
    assert state["grads"] <= shard + 4 * sim["units"] and state["optim"] <= 2 * shard
    assert state["optim"] >= 2 * sim["local_param_bytes"]


def test_the_one_d_path_is_unchanged(capsys):
    from shardwrap import estimate as est

    r = est.main(["--model", "gpt2", "--world-size", "8", "--json"])
    out = capsys.readouterr().out
    assert "mesh" not in r and "collectives_formula" not in r and set(json.loads(out)) == set(r)
    est.main(["--model", "gpt2", "--world-size", "8"])
    assert "collectives" not in capsys.readouterr().out


@pytest.mark.parametrize("args,says", [
    (["--mesh", "8x"], "is not RxS"),
    (["--mesh", "x512"], "is not RxS"),
    (["--mesh", "8x512x2"], "is not RxS"),
    (["--mesh", "eight"], "is not RxS"),
    (["--mesh=-1x4"], "is not RxS"),
    (["--mesh", "0x4"], "0 replicas and 4 shards"),
    (["--mesh", "4x0"], "4 replicas and 0 shards"),
    (["--mesh", "8x512", "--world-size", "1024"], "8x512 is 4096 ranks but --world-size is 1024"),
])
def test_bad_mesh_values_are_usage_errors_naming_the_option(args, says, capsys):
    from shardwrap import estimate as est

    with pytest.raises(SystemExit) as exit_:
        est.main(["--params", "1e9", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --mesh:" in err and says in err and "Traceback" not in err, err


def test_mesh_and_world_size_agree_or_either_is_needed(capsys):
    from shardwrap import estimate as est

    with pytest.raises(SystemExit) as exit_:
        est.main(["--params", "1e9"])
    assert exit_.value.code == 2 and "--world-size N" in capsys.readouterr().err
    both = est.main(["--params", "1e9", "--mesh", "4x8", "--world-size", "32", "--json"])
    alone = est.main(["--params", "1e9", "--mesh", "4x8", "--json"])
    capsys.readouterr()
    assert both == alone and alone["world_size"] == 32
    ideal = alone["collectives_formula"][3]
    assert ideal["ideal"] and ideal["shard"]["all_gather"]["elements"] == pytest.approx(2 * 1e9 / 8)
    assert ideal["replicate"]["replicate_all_reduce"]["wire_bytes"] == pytest.approx(4 * 2 * 1e9 * 3 / 32)


def test_a_simulated_step_that_cannot_fit_is_refused_before_it_starts(monkeypatch, capsys):
    from shardwrap import estimate as est

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulate() ran")

    monkeypatch.setattr(est, "_memory_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr(est, "simulate", no_simulation)
    with pytest.raises(SystemExit) as exit_:  # 1.1 GiB of shards, a 1.6 GiB unit: the wrap alone fits
        est.main(["--model", "llama-70b", "--mesh", "16x256", "--mixed-precision", "bf16", "--simulate"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--mesh 16x256 with --simulate: the simulated training step needs" in err, err
    need = est.step_memory(est.SHAPES["llama-70b"], 256, "bf16")
    assert need > 16 * 2**30 and f"{need / 2**30:.1f} GiB" in err
    with pytest.raises(SystemExit) as exit_:
        est.main(["--model", "gpt2", "--world-size", "8", "--steps", "2"])
    assert exit_.value.code == 2 and "argument --steps: the simulated steps need --simulate and --mesh" in capsys.readouterr().err
