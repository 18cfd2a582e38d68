"""The CPU memory tracker the examples and the benchmark rely on."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwrap.memory import CATEGORIES, LiveStorages, optimizer_states, state_classifier


def test_peak_is_split_into_parameters_gradients_optimizer_activations_and_other():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    opt.step()  # optimizer state exists from here on
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    tracker = LiveStorages(list(model.parameters()), every=1, classify=state_classifier(model, opt))
    tracker.track(optimizer_states(opt))  # made before the tracker
    x = torch.randn(32, 64)
    with tracker:
        hidden = torch.tanh(model[0](x))  # saved by tanh's backward: an activation
        model[2](hidden).sum().backward()
        tracker.sample()
    split = tracker.peak_split
    assert set(split) == set(CATEGORIES)
    assert sum(split.values()) == tracker.peak
    assert split["params"] == param_bytes
    assert split["optim"] == 2 * param_bytes  # AdamW: exp_avg and exp_avg_sq
    assert split["activations"] >= hidden.numel() * 4  # the saved tanh output at least
    assert split["grads"] <= param_bytes


def test_resized_root_counts_at_its_current_size():
    buffer = torch.empty(1024)
    tracker = LiveStorages([buffer], every=1)
    with tracker:
        assert tracker.sample() == 4096
        buffer.untyped_storage().resize_(0)  # how unsharded buffers are freed
        assert tracker.sample() == 0
        buffer.untyped_storage().resize_(4096)
        assert tracker.sample() == 4096
