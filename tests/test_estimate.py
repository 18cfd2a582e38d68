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
    - CPU-only run RAM: device + host RAM at stages 1 and 2. At stage 3 the backward walked unit
      by unit (the list is root first, then forward order; a gradient shard is 4 n / W = n bytes
      here): host RAM without the gradient shards, plus the most of (shards of the units done +
      the previous unit's flat gradient p t + this unit's p (n + t) + the M - 1 units gathered
      ahead with their staged shards p 1.25 n + the root's p (100 + 100)). By hand, backward order
      400, 200, 500, then the root:
      M = 1: 1000p | 400 + 1000p | 600 + 1400p | root 1100 + 700p | all shards 1200;
      M = 2: 1250p | 400 + 1625p | 600 + 1400p | root 1100 + 700p | all shards 1200.
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
        walk = {1: {4: 6200, 2: 3400}, 2: {4: 6900, 2: 3650}}[max_unsharded][p]
        cpu_only = params + grads + staging + host if stage <= 2 else host - 4 * psi / W + walk
        assert row["cpu_only_ram"] == pytest.approx(cpu_only), (stage, row["cpu_only_ram"], cpu_only)


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
    for column in ("device total", "host RAM", "| disk |", "CPU-only run: RAM |", "3 (chosen)"):
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
        if stage != "3":
            assert s["cpu_only_ram"] == pytest.approx(s["device"] + s["host"])
        else:  # the backward walk: padding rows of the units alive at once, each shard's tag
            assert 0 <= s["cpu_only_ram"] - f["cpu_only_ram"] <= s["device"] + s["host"] - f["device"] - f["host"] + 1e-6
            assert s["cpu_only_ram"] < s["device"] + s["host"]


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


def _padded_shards(shape_name: str, shards: int) -> list[tuple[int, int, int]]:
    """Per unit (root first, then the blocks), its padded shard elements per rank at ``shards``,
    written out from the parameter shapes: every parameter's dim 0 rounded up to a multiple of
    S, divided by S, times the elements of a row (all parameters train), twice (the trainable
    prefix is all of it), and its number of parameters (one used-flag each)."""
    from shardwrap import estimate as est

    model = est.build_on_meta(est.SHAPES[shape_name])
    blocks = list(model.blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}

    def padded(params) -> int:
        return sum(-(-(p.shape[0] if p.dim() else 1) // shards) * (p[0].numel() if p.dim() else 1) for p in params)

    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [(padded(root), padded(root), len(root))] + [(padded(b.parameters()),) * 2 + (len(list(b.parameters())),) for b in blocks]


def test_collectives_formula_at_a_hand_checkable_size():
    """Three units with padded shards of 10, 6 and 6 elements (the last with 4 trainable), of 3, 1
    and 2 trainable parameters, R = 4 replicas of S = 8 shards, fp32 (4 bytes), stage 3, per rank:

    - all-gathers: forward all three (11 + 7 + 7 = 25 elements with the tags); backward only the
      middle unit (the root and the unit that ended the forward stay gathered): 7; 32 in 4 calls,
      wire 7 * 32 * 4 bytes received;
    - reduce-scatters, the gradient shards and a used-flag per trainable parameter:
      8 * (13 + 7 + 6) = 208 elements in 3 calls, wire 7 * 26 * 4 bytes sent;
    - all-reduce over replicate: the reduced shards and flags, 13 + 7 + 6 = 26 elements, wire
      2 * 3/4 * 26 * 4 = 156 bytes;
    - headers 2 elements per gather, counts 2 per unit in backward.
    """
    from shardwrap import estimate as est

    units, mesh = [(10, 10, 3), (6, 6, 1), (6, 4, 2)], est.Mesh(4, 8)
    f = est.collectives_formula(units, 22, mesh, "none", 3)
    ag, rs, ar = f["shard"]["all_gather"], f["shard"]["reduce_scatter"], f["replicate"]["replicate_all_reduce"]
    assert (ag["calls"], ag["forward_calls"], ag["backward_calls"], ag["elements"]) == (4, 3, 1, 32)
    assert ag["bytes"] == 4 * 32 and ag["wire_bytes"] == 7 * 32 * 4
    assert (rs["calls"], rs["elements"], rs["wire_bytes"]) == (3, 208, 7 * 26 * 4)
    assert (ar["calls"], ar["elements"], ar["wire_bytes"]) == (3, 26, 156)
    assert f["counter"] == {"all_gather": 32, "all_gather_calls": 4, "reduce_scatter": 208, "reduce_scatter_calls": 3,
                            "headers": 8, "headers_calls": 4, "counts": 6, "counts_calls": 3,
                            "replicate_all_reduce": 26, "replicate_all_reduce_calls": 3,
                            "bytes": 4 * (32 + 208 + 26) + 8 * (8 + 6)}
    first = est.collectives_formula(units, 22, mesh, "none", 3, first_step=True)["shard"]["all_gather"]
    assert (first["calls"], first["elements"]) == (5, 39)  # the last unit is gathered again
    for stage in (1, 2):  # no gathers in backward
        assert est.collectives_formula(units, 22, mesh, "none", stage)["shard"]["all_gather"]["elements"] == 25
    # stage 2 gathers every unit after the root at once, under one header (not in its first step)
    assert [est.collectives_formula(units, 22, mesh, "none", 2, first_step=f)["shard"]["headers"]["calls"] for f in (False, True)] == [2, len(units)]
    bf16 = est.collectives_formula(units, 22, mesh, "bf16", 3)
    assert bf16["shard"]["all_gather"]["bytes"] == 2 * 32 and bf16["replicate"]["replicate_all_reduce"]["wire_bytes"] == 78
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
    assert pad == sum(n for n, _, _ in _padded_shards(model, S)) - psi / S
    flags = sum(k for _, _, k in _padded_shards(model, S))  # one used-flag per parameter
    f = r["collectives_formula"][3]
    ag, ar = f["shard"]["all_gather"], f["replicate"]["replicate_all_reduce"]
    assert (ag["forward_calls"], ag["backward_calls"]) == (U, U - 2)
    forward_pass = psi / S + pad + U
    root = _padded_shards(model, S)[0][0]
    last = _padded_shards(model, S)[-1][0]
    assert ag["elements"] == pytest.approx(forward_pass + forward_pass - (root + 1) - (last + 1))
    assert ag["wire_bytes"] == pytest.approx(2 * (S - 1) * ag["elements"])
    assert ar["elements"] == pytest.approx(psi / S + pad + flags)  # the used-flags
    assert ar["wire_bytes"] == pytest.approx(2 * 2 * (R - 1) / (R * S) * (psi + S * (pad + flags)))


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
    assert sim["shard_bytes"] == 4 * sum(n for n, _, _ in padded)
    assert sim["padding_elements_per_rank"] == pytest.approx(r["padding_elements_per_rank"])
    assert sim["padding_elements_per_rank"] == pytest.approx(sum(n for n, _, _ in padded) - psi / S)
    assert sim["padding_elements_per_rank"] > 0  # the vocabulary's 50257 rows
    step = sim["step"]
    want = r["collectives_formula"]["3"]["counter"]
    first, second = step["counters"]
    assert second == want, (second, want)
    assert first == r["collectives_formula_first_step"]["counter"], first
    assert want["replicate_all_reduce"] == sum(g + k for _, g, k in padded)
    assert want["all_gather"] == 2 * sum(n + 1 for n, _, _ in padded) - (padded[0][0] + 1) - (padded[-1][0] + 1)
    assert want["reduce_scatter"] == S * sum(g + k for _, g, k in padded)
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


# ---- the step-time model: --intra-gbps, --inter-gbps, --ranks-per-node ----------------------------


def test_step_time_is_wire_bytes_over_the_link_by_hand():
    """The hand-checkable case above (R = 4, S = 8, fp32, stage 3) with 8 ranks per node: the shard
    groups are nodes (intra, 2 GB/s), the replicate groups cross them (inter, 0.5 GB/s). Seconds:
    all-gather 7 * 32 * 4 / 2e9, reduce-scatter 7 * 26 * 4 / 2e9, all-reduce 156 / 0.5e9."""
    from shardwrap import estimate as est

    units, mesh = [(10, 10, 3), (6, 6, 1), (6, 4, 2)], est.Mesh(4, 8)
    f = est.collectives_formula(units, 22, mesh, "none", 3)
    t = est.step_time_model(f, mesh, intra_gbps=2.0, inter_gbps=0.5, ranks_per_node=8)
    assert t["links"] == {"shard": "intra", "replicate": "inter"}
    assert t["seconds"]["all_gather"] == pytest.approx(7 * 32 * 4 / 2e9)
    assert t["seconds"]["reduce_scatter"] == pytest.approx(7 * 26 * 4 / 2e9)
    assert t["seconds"]["replicate_all_reduce"] == pytest.approx(156 / 0.5e9)
    assert t["comm_seconds"] == pytest.approx((7 * 32 * 4 + 7 * 26 * 4) / 2e9 + 156 / 0.5e9)
    assert t["wire_bytes"] == {"intra": 7 * 58 * 4, "inter": 156}
    # 4 ranks a node: a shard group spans two nodes, so every collective runs at the inter-node link
    t4 = est.step_time_model(f, mesh, intra_gbps=2.0, inter_gbps=0.5, ranks_per_node=4)
    assert t4["links"] == {"shard": "inter", "replicate": "inter"}
    assert t4["comm_seconds"] == pytest.approx((7 * 58 * 4 + 156) / 0.5e9)


@pytest.mark.parametrize("mesh,nodes,links", [
    ((4, 8), 8, ("intra", "inter")),
    ((4, 8), 16, ("intra", "inter")),  # two replicas a node, but each replicate group spans two nodes
    ((4, 8), 32, ("intra", "intra")),  # one node holds the world
    ((4, 8), 4, ("inter", "inter")),
    ((4, 8), 12, ("inter", "inter")),  # 12 is no multiple of 8: shard group 1 (ranks 8-15) straddles
    ((2, 3), 3, ("intra", "inter")),
    ((1, 16), 8, ("inter", None)),
    ((1, 8), 8, ("intra", None)),
    ((8, 1), 8, (None, "intra")),  # S = 1: nothing to shard; the replicas all-reduce within the node
])
def test_axis_links_follow_the_rank_layout(mesh, nodes, links):
    from shardwrap import estimate as est

    got = est.axis_links(est.Mesh(*mesh), nodes)
    assert (got["shard"], got["replicate"]) == links


def test_hybrid_beats_one_d_when_the_inter_node_link_is_slow():
    """1e9 params (ideal units), bf16, W = 64: 8x8 against 1x64 at 8 ranks a node. Per rank, 1x64
    moves 3 * 63/64 Psi p bytes over the slow link; 8x8 moves 3 * 7/8 Psi p within the node and
    2 * 7/8 Psi p / 8 across. Hybrid wins above intra / inter = (21/8) / (189/64 - 14/64)."""
    from shardwrap import estimate as est

    psi, hybrid, flat = 10**9, est.Mesh(8, 8), est.Mesh(1, 64)

    def comm(mesh: est.Mesh, intra: float, inter: float) -> dict:
        return est.step_time_model(est.collectives_formula(None, psi, mesh, "bf16", 3), mesh, intra, inter, 8)

    fast_node = comm(hybrid, 200, 25), comm(flat, 200, 25)
    assert fast_node[0]["comm_seconds"] < fast_node[1]["comm_seconds"] / 4
    assert fast_node[1]["comm_seconds"] == pytest.approx(3 * 63 / 64 * 2 * psi / 25e9)
    verdict, ratio = est.hybrid_breakeven(*fast_node)
    assert verdict == "above" and ratio == pytest.approx((21 / 8) / (189 / 64 - 14 / 64))
    below, above = ratio * 0.99, ratio * 1.01
    assert comm(hybrid, below * 10, 10)["comm_seconds"] > comm(flat, below * 10, 10)["comm_seconds"]
    assert comm(hybrid, above * 10, 10)["comm_seconds"] < comm(flat, above * 10, 10)["comm_seconds"]
    # one node of 64 ranks: 1x64 never leaves it, 8x8 only adds its all-reduce
    one_node = tuple(est.step_time_model(est.collectives_formula(None, psi, m, "bf16", 3), m, 200, 25, 64)
                     for m in (hybrid, flat))
    assert one_node[1]["links"]["shard"] == "intra" and est.hybrid_breakeven(*one_node) == ("always", None)


def test_one_d_is_hybrid_with_one_replica(capsys):
    """--mesh 1xW is the 1-D world: no all-reduce, one table row, and the same row the hybrid
    mesh of that W prints beside itself (same ranks per node)."""
    from shardwrap import estimate as est

    one = est.main(["--model", "gpt2", "--mesh", "1x16", "--ranks-per-node", "4", "--json"])["step_time"]
    pair = est.main(["--model", "gpt2", "--mesh", "4x4", "--json"])["step_time"]
    capsys.readouterr()
    assert len(one["meshes"]) == 1 and "hybrid_wins" not in one
    row = one["meshes"][0]
    assert row["seconds"]["replicate_all_reduce"] == 0 and row["links"] == {"shard": "inter", "replicate": None}
    assert pair["ranks_per_node"] == 4 and [r["mesh"] for r in pair["meshes"]] == ["4x4", "1x16"]
    assert pair["meshes"][1] == row
    flat = est.main(["--model", "gpt2", "--mesh", "1x8", "--json"])["step_time"]  # default: min(W, 8) a node
    capsys.readouterr()
    assert flat["ranks_per_node"] == 8 and flat["meshes"][0]["links"]["shard"] == "intra"


def test_step_time_table_and_json_fields(capsys):
    from shardwrap import estimate as est

    args = ["--params", "1e9", "--mesh", "8x8", "--mixed-precision", "bf16", "--intra-gbps", "100",
            "--inter-gbps", "10"]
    est.main(args)
    out = capsys.readouterr().out
    assert "| mesh | shard axis | replicate axis | all-gather s | reduce-scatter s | all-reduce s | comm s/step |" in out
    assert "| 8x8 | intra (100 GB/s) | inter (10 GB/s) |" in out and "| 1x64 | inter (10 GB/s) | - |" in out, out
    assert "intra-node 100 GB/s (--intra-gbps)" in out and "8 ranks per node (default: S" in out, out
    assert "8x8 communicates for less time than 1x64 when intra/inter > " in out and "so 8x8 is faster" in out, out
    st = est.main([*args, "--json"])["step_time"]
    printed = json.loads(capsys.readouterr().out)["step_time"]
    assert printed == json.loads(json.dumps(st))
    assert {"stage", "intra_gbps", "intra_source", "inter_gbps", "inter_source", "ranks_per_node",
            "ranks_per_node_source", "meshes", "hybrid_wins"} <= set(st)
    assert (st["intra_gbps"], st["inter_gbps"], st["ranks_per_node"]) == (100, 10, 8)
    for row in st["meshes"]:
        assert set(row) == {"mesh", "links", "seconds", "comm_seconds", "wire_bytes", "peak_bytes"}
        assert row["comm_seconds"] == pytest.approx(sum(row["seconds"].values()))
    assert st["hybrid_wins"]["here"] is True
    hybrid, flat = st["meshes"]  # the hybrid mesh holds the model state at S = 8, the 1-D one at W = 64
    assert hybrid["peak_bytes"] == pytest.approx(est.formula(10**9, 0, 8, "bf16")[3]["total"])
    assert flat["peak_bytes"] == pytest.approx(est.formula(10**9, 0, 64, "bf16")[3]["total"])
    assert "8x8 pays in memory: " in out and "| comm s/step | peak GiB per rank |" in out, out
    est.main(["--params", "1e9", "--mesh", "8x8", "--ranks-per-node", "64"])  # one node: no ratio to print
    out = capsys.readouterr().out
    assert "| 1x64 | intra (200 GB/s) | - |" in out and "than 1x64 at every bandwidth ratio" in out, out
    default = est.main(["--params", "1e9", "--mesh", "8x8", "--json"])["step_time"]
    capsys.readouterr()
    assert (default["intra_gbps"], default["inter_gbps"]) == (est.DEFAULT_INTRA_GBPS, est.DEFAULT_INTER_GBPS)


def test_calibrated_intra_bandwidth_comes_from_the_file(tmp_path, monkeypatch, capsys):
    from shardwrap import estimate as est

    committed = json.loads(est.CALIBRATION.read_text())  # benchmarks/calibrate_bandwidth.py's result
    assert committed["allgather_busbw_gbps"] > 0 and committed["world_size"] >= 2
    assert committed["sizes"] and committed["date"]
    calibration = tmp_path / "gloo_bandwidth.json"
    calibration.write_text(json.dumps({"allgather_busbw_gbps": 0.5, "world_size": 2, "date": "2025-01-01",
                                       "function": "torch.distributed.all_gather_single"}))
    monkeypatch.setattr(est, "CALIBRATION", calibration)
    est.main(["--params", "1e9", "--mesh", "2x2", "--intra-gbps", "calibrated"])
    out = capsys.readouterr().out
    assert f"intra-node 0.5 GB/s (calibrated: gloo torch.distributed.all_gather_single bus bandwidth, 2 ranks, " \
           f"2025-01-01 ({calibration}))" in out, out
    monkeypatch.setattr(est, "CALIBRATION", tmp_path / "missing.json")
    with pytest.raises(SystemExit) as exit_:
        est.main(["--params", "1e9", "--mesh", "2x2", "--intra-gbps", "calibrated"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --intra-gbps: calibrated, but" in err and "calibrate_bandwidth.py" in err


@pytest.mark.parametrize("args,option,says", [
    (["--intra-gbps", "0"], "--intra-gbps", "0 GB/s is impossible"),
    (["--intra-gbps=-5"], "--intra-gbps", "-5 GB/s is impossible"),
    (["--intra-gbps", "nan"], "--intra-gbps", "nan GB/s is impossible"),
    (["--intra-gbps", "fast"], "--intra-gbps", "is not a number of GB/s"),
    (["--inter-gbps", "0"], "--inter-gbps", "0 GB/s is impossible"),
    (["--inter-gbps=-25"], "--inter-gbps", "-25 GB/s is impossible"),
    (["--inter-gbps", "inf"], "--inter-gbps", "inf GB/s is impossible"),
    (["--ranks-per-node", "0"], "--ranks-per-node", "0 ranks per node is impossible"),
    (["--ranks-per-node", "2.5"], "--ranks-per-node", "not a whole number"),
])
def test_bad_bandwidth_values_are_usage_errors_naming_the_option(args, option, says, capsys):
    from shardwrap import estimate as est

    with pytest.raises(SystemExit) as exit_:
        est.main(["--params", "1e9", "--mesh", "2x4", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}: " in err and says in err and "Traceback" not in err, err


def test_step_time_options_need_a_mesh(capsys):
    from shardwrap import estimate as est

    with pytest.raises(SystemExit) as exit_:
        est.main(["--params", "1e9", "--world-size", "8", "--inter-gbps", "10"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --inter-gbps: the step-time model needs --mesh RxS (--mesh 1x8" in err


_SIMULATIONS_IN_ONE_PROCESS = """
import json, socket, sys
import torch.distributed as dist
from shardwrap import estimate
worlds = [int(w) for w in sys.argv[1:]]
out = {"shard_bytes": [estimate.simulate(estimate.SHAPES["gpt2"], w, "bf16")["shard_bytes"] for w in worlds]}
dist.destroy_process_group()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
try:
    estimate.simulate(estimate.SHAPES["gpt2"], 8, "bf16")
    out["under_a_real_group"] = "ran"
except RuntimeError as exc:
    out["under_a_real_group"] = str(exc)
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_simulations_at_several_world_sizes_in_one_process_each_use_their_own():
    """``simulate`` from Python (a notebook comparing world sizes) sets up a fake group of each
    size in turn, as a fresh process would; under a real process group it refuses, naming why."""
    def run(*worlds: int) -> dict:
        out = subprocess.run([sys.executable, "-c", _SIMULATIONS_IN_ONE_PROCESS, *map(str, worlds)],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    together = run(8, 16, 8)
    assert together["shard_bytes"] == [run(8)["shard_bytes"][0], run(16)["shard_bytes"][0], run(8)["shard_bytes"][0]]
    assert together["shard_bytes"][0] > together["shard_bytes"][1]
    assert "already has a real one (gloo, 1 ranks)" in together["under_a_real_group"], together
    assert "in a process of its own" in together["under_a_real_group"]
