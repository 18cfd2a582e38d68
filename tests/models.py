"""Models the tests build. Everything here is top-level so ranks can rebuild it by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn


class Block(nn.Module):
    """A residual MLP block: the usual unit in these tests."""

    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden or 2 * dim)
        self.down = nn.Linear(hidden or 2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3, out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp(dim: int = 16, depth: int = 3, out: int = 5) -> nn.Module:
    return MLP(dim, depth, out)


def blocks(dim: int = 16, depth: int = 2) -> nn.Module:
    """Blocks and nothing else: with Block units the root unit holds no parameter."""
    return nn.Sequential(*(Block(dim) for _ in range(depth)))


def gpt2(
    n_layer: int = 2, n_embd: int = 32, n_head: int = 2, vocab_size: int = 96, n_positions: int = 16, use_cache: bool = True
) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=use_cache,  # False for training under compile + checkpointing (no KV cache in the region)
    )
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def t5(vocab_size: int = 128) -> nn.Module:
    """A two-layer T5 (encoder-decoder): its ``generate`` runs the encoder outside ``forward``."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=vocab_size, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    config._attn_implementation = "eager"
    return T5ForConditionalGeneration(config)


def t5_block_class() -> type:
    from transformers.models.t5.modeling_t5 import T5Block

    return T5Block


def gpt2_block_class() -> type:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


def marked_unit(module: nn.Module) -> bool:
    """Wrap policy for generated trees: the builder marks the modules that start a unit."""
    return bool(getattr(module, "unit_mark", False))


# ---- generated module trees (hypothesis) ---------------------------------------------------------
#
# A spec is nested tuples. Leaves map (B, T, D) -> (B, T, D):
#   ("linear", bias, frozen, unit)   x + tanh(Linear(D, D)(x))
#   ("norm", frozen, unit)           LayerNorm(D)
#   ("conv", kernel, frozen, unit)   x + Conv1d(D, D, kernel, padding="same") over T
#   ("embed", rows, frozen, unit)    x + Embedding(rows, D)(arange(T) % rows)   (rows may be < W)
#   ("zero", unit)                   a zero-size parameter that joins the graph
#   ("tie", j, unit)                 a Linear sharing the weight Parameter of the j-th linear so far
#   ("reuse", j)                     the j-th leaf module so far, registered and called again
# Containers: ("seq" | "list" | "dict", [children], unit).


class Residual(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.layer(x))


class ConvT(nn.Module):
    def __init__(self, dim: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, T, D) <-> (B, D, T)


class EmbedAdd(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(x.shape[1]) % self.emb.num_embeddings
        return x + self.emb(idx)


class ZeroSize(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.empty.sum()


class ListStack(nn.Module):
    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for item in self.items:
            x = item(x)
        return x


class DictStack(nn.Module):
    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleDict({f"k{i}": c for i, c in enumerate(children)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for item in self.items.values():
            x = item(x)
        return x


def tree(spec: Any, dim: int = 8) -> nn.Module:
    linears: list[nn.Linear] = []
    leaves: list[nn.Module] = []

    def freeze(module: nn.Module, frozen: bool) -> nn.Module:
        for p in module.parameters():
            p.requires_grad_(not frozen)
        return module

    def build(node: Any) -> nn.Module:
        kind = node[0]
        if kind in ("seq", "list", "dict"):
            children = [build(c) for c in node[1]]
            module: nn.Module = {"seq": nn.Sequential, "list": ListStack, "dict": DictStack}[kind](
                *([children] if kind != "seq" else children)
            )
            module.unit_mark = node[2]
            return module
        if kind == "reuse":
            return leaves[node[1] % len(leaves)] if leaves else build(("norm", False, False))
        if kind == "linear":
            lin = nn.Linear(dim, dim, bias=node[1])
            linears.append(lin)
            module = freeze(Residual(lin), node[2])
        elif kind == "norm":
            module = freeze(nn.LayerNorm(dim), node[1])
        elif kind == "conv":
            module = freeze(ConvT(dim, node[1]), node[2])
        elif kind == "embed":
            module = freeze(EmbedAdd(node[1], dim), node[2])
        elif kind == "zero":
            module = ZeroSize(dim)
        elif kind == "tie":
            lin = nn.Linear(dim, dim)
            if linears:
                lin.weight = linears[node[1] % len(linears)].weight
            linears.append(lin)
            module = Residual(lin)
        else:
            raise ValueError(f"unknown node {node!r}")
        module.unit_mark = node[-1]
        leaves.append(module)
        return module

    root = nn.Sequential(build(spec), nn.Linear(dim, dim))  # the head keeps one trainable parameter
    return root


# ---- forward patterns ------------------------------------------------------------------------


@dataclasses.dataclass
class Out:
    main: torch.Tensor
    extra: dict
    pair: tuple


class StructuredBlock(nn.Module):
    """A unit whose output is a dataclass holding a dict and a tuple."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> Out:
        h = torch.tanh(self.a(x))
        return Out(main=h, extra={"aux": self.b(h)}, pair=(h.sum(-1), {"deep": [self.b(x)]}))


class Structured(nn.Module):
    def __init__(self, dim: int = 16, out: int = 5) -> None:
        super().__init__()
        self.block = StructuredBlock(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> Out:
        o = self.block(x)
        return Out(main=self.head(o.main), extra=o.extra, pair=o.pair)


class Twice(nn.Module):
    """One unit called several times in one forward, plus a unit that is never called."""

    def __init__(self, dim: int = 16, out: int = 5) -> None:
        super().__init__()
        self.shared = Block(dim)
        self.unused = Block(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(self.shared(x))))


class LoRALinear(nn.Module):
    def __init__(self, dim: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.lora_a.t() @ self.lora_b.t())


class LoRANet(nn.Module):
    def __init__(self, dim: int = 16, out: int = 5) -> None:
        super().__init__()
        self.layers = nn.Sequential(LoRALinear(dim), LoRALinear(dim))
        self.head = nn.Linear(dim, out)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class WithBuffers(nn.Module):
    def __init__(self, dim: int = 16, out: int = 5) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(dim)
        self.block = Block(dim)
        self.head = nn.Linear(dim, out)
        self.register_buffer("scale", torch.rand(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.norm(x) * self.scale))


def structured(dim: int = 16) -> nn.Module:
    return Structured(dim)


def twice(dim: int = 16) -> nn.Module:
    return Twice(dim)


def lora(dim: int = 16) -> nn.Module:
    return LoRANet(dim)


def with_buffers(dim: int = 16) -> nn.Module:
    return WithBuffers(dim)


class TiedAcrossUnits(nn.Module):
    """An embedding and an output head that share one weight, each inside a different unit."""

    def __init__(self, vocab: int = 11, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Embedding(vocab, dim))
        self.body = Block(dim)
        self.out = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False))
        self.out[1].weight = self.embed[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 7).long().remainder(self.embed[0].num_embeddings)  # (B, D) ints
        return self.out(self.body(self.embed(ids).mean(1)))


def tied_across_units(vocab: int = 11, dim: int = 16) -> nn.Module:
    return TiedAcrossUnits(vocab, dim)


class FlipMLP(MLP):
    """Runs its blocks in reverse order on odd steps: the execution order changes between steps."""

    step = 0

    def set_step(self, step: int) -> None:
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        blocks = list(self.blocks)
        for block in reversed(blocks) if self.step % 2 else blocks:
            x = block(x)
        return self.head(x)


def flip_mlp(dim: int = 16, depth: int = 3) -> nn.Module:
    return FlipMLP(dim, depth)


class CausalMix(nn.Module):
    """Holds a non-persistent causal mask buffer, recomputed by reset_parameters (as a model built
    on the meta device needs)."""

    def __init__(self, dim: int = 16, seq: int = 6) -> None:
        super().__init__()
        self.seq = seq
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)) / torch.arange(1, seq + 1).unsqueeze(1), persistent=False)

    def reset_parameters(self) -> None:
        self.mask.copy_(torch.tril(torch.ones(self.seq, self.seq)) / torch.arange(1, self.seq + 1).unsqueeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D): causal average, then a projection
        return x + self.proj(self.mask @ x)


class MetaNet(nn.Module):
    def __init__(self, dim: int = 16, seq: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.mixes = nn.ModuleList(CausalMix(dim, seq) for _ in range(2))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for mix, block in zip(self.mixes, self.blocks):
            x = block(mix(x))
        return self.head(x)


def meta_net(dim: int = 16, seq: int = 6) -> nn.Module:
    return MetaNet(dim, seq)


class GainBlock(Block):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.gain = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


class Scaled(nn.Module):
    """0-dim parameters, in the root and inside a unit."""

    def __init__(self, dim: int = 16, out: int = 5) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.block = GainBlock(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)) / self.temperature


class ReachesIntoUnit(Scaled):
    """Reads a unit's parameter outside that unit's forward: refused with an error."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.block.gain


def scaled(dim: int = 16) -> nn.Module:
    return Scaled(dim)


# ---- activation checkpointing (tests/test_activation_checkpointing.py) ---------------------------


def selective_context():  # type: ignore[no-untyped-def]
    """Selective activation checkpointing's contexts (torchtitan's kind of policy): the outputs
    of matrix multiplications are saved, everything else is recomputed in backward."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class CheckpointedMLP(MLP):
    """``MLP`` whose forward runs each Block through ``torch.utils.checkpoint.checkpoint`` while
    training: ``checkpoint`` is None (plain), "reentrant", "non_reentrant" or "selective"
    (non-reentrant, with ``selective_context``). ``twice``: the first Block runs twice in a row,
    inside one checkpointed region (a unit called twice in one region). ``span``: the first two
    Blocks run inside one region (a region that recomputes two units)."""

    def __init__(self, dim: int = 16, depth: int = 3, out: int = 5, checkpoint: str | None = None, twice: bool = False,
                 span: bool = False) -> None:
        super().__init__(dim, depth, out)
        if checkpoint not in (None, "reentrant", "non_reentrant", "selective"):
            raise ValueError(f"checkpoint={checkpoint!r}")
        self.checkpoint = checkpoint
        self.twice = twice
        self.span = span

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        runs: list[Any] = [(lambda y, b=block: b(b(y))) if self.twice and i == 0 else block for i, block in enumerate(self.blocks)]
        if self.span:
            runs[:2] = [lambda y, first=runs[0], second=runs[1]: second(first(y))]
        for run in runs:
            if self.checkpoint is not None and self.training:
                if self.checkpoint == "selective":
                    x = checkpoint(run, x, use_reentrant=False, context_fn=selective_context())
                else:
                    x = checkpoint(run, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = run(x)
        return self.head(x)


def checkpointed_mlp(dim: int = 16, depth: int = 3, out: int = 5, checkpoint: str | None = None, twice: bool = False,
                     span: bool = False) -> nn.Module:
    return CheckpointedMLP(dim, depth, out, checkpoint, twice, span)


class InnerCheckpointBlock(Block):
    """A ``Block`` whose forward checkpoints only parts of itself while training, so the unit's
    parameters take gradients both from inside checkpointed regions and outside them: with
    ``use_reentrant=True`` the inside ones arrive from nested backwards. ``part``:

    - ``"early"``: ``tanh(up(norm(x)))`` is checkpointed, ``down`` outside;
    - ``"late"``: ``down(tanh(.))`` is checkpointed, so the nested backward runs before the outer
      backward reaches ``up`` and ``norm``;
    - ``"two"``: ``up`` and ``down`` in two regions of their own, ``norm`` outside (attention and
      MLP checkpointed apart);
    - ``"two_inside"``: two regions that read every parameter between them (``norm`` and ``up``,
      then ``down``), so the unit's first-pass views see no backward at all and both
      recomputations read whatever its slots hold."""

    def __init__(self, dim: int, reentrant: bool, part: str = "early") -> None:
        super().__init__(dim)
        self.reentrant = reentrant
        self.part = part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if not self.training:
            return super().forward(x)
        r = self.reentrant
        if self.part == "late":
            return x + checkpoint(lambda t: self.down(torch.tanh(t)), self.up(self.norm(x)), use_reentrant=r)
        if self.part == "two":
            h = torch.tanh(checkpoint(self.up, self.norm(x), use_reentrant=r))
            return x + checkpoint(self.down, h, use_reentrant=r)
        if self.part == "two_inside":
            h = checkpoint(lambda t: torch.tanh(self.up(self.norm(t))), x, use_reentrant=r)
            return x + checkpoint(self.down, h, use_reentrant=r)
        inner = checkpoint(lambda t: torch.tanh(self.up(self.norm(t))), x, use_reentrant=r)
        return x + self.down(inner)


class OuterCheckpointMLP(MLP):
    """``MLP`` whose forward also checkpoints each whole Block (reentrant): a Block that checkpoints
    part of itself then runs nested backwards two deep."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.training else block(x)
        return self.head(x)


def inner_checkpointed_mlp(dim: int = 16, depth: int = 3, out: int = 5, checkpoint: str = "reentrant", part: str = "early",
                           outer: bool = False) -> nn.Module:
    """``mlp`` whose Blocks checkpoint parts of their own forward (``InnerCheckpointBlock``);
    ``outer``: the model checkpoints each whole Block too (``OuterCheckpointMLP``)."""
    model = (OuterCheckpointMLP if outer else MLP)(dim, depth, out)
    model.blocks = nn.ModuleList(InnerCheckpointBlock(dim, checkpoint == "reentrant", part) for _ in range(depth))
    return model


def is_block(module: nn.Module) -> bool:
    return isinstance(module, Block)


def apply_block_checkpointing(model: nn.Module, selective: bool = False) -> nn.Module:
    """torch's ``apply_activation_checkpointing`` (default: non-reentrant ``CheckpointWrapper``) on
    every ``Block``: each Block moves under ``<name>._checkpoint_wrapped_module``. ``selective``:
    the wrappers take ``selective_context`` (torchtitan's way)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper

    if selective:
        wrapper = functools.partial(checkpoint_wrapper, context_fn=selective_context())
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=is_block)
    else:
        apply_activation_checkpointing(model, check_fn=is_block)
    return model


def mlp_checkpoint_wrapped(dim: int = 16, depth: int = 3, out: int = 5, selective: bool = False) -> nn.Module:
    """``mlp`` with ``apply_block_checkpointing`` applied."""
    return apply_block_checkpointing(MLP(dim, depth, out), selective)


def gpt2_checkpointed(checkpoint_kwargs: dict | None = None, **gpt2_kwargs: Any) -> nn.Module:
    """``gpt2`` with HF's ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``
    (None: HF's default)."""
    import warnings

    model = gpt2(**gpt2_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the alias of activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    return model


def many_linears(count: int = 70, dim: int = 4) -> nn.Module:
    """``count`` small Linear layers in a row: one unit with many parameters."""
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(count)))


def parametrized_mlp(dim: int = 16, depth: int = 3, kind: str = "weight_norm") -> nn.Module:
    """``mlp`` with torch's parametrizations inside the units: each block's ``up`` weight through
    ``kind`` (``weight_norm``: the weight is ``g * v / |v|``, two parameters; ``orthogonal``: the
    weight is a function of one unconstrained parameter; ``spectral_norm``: the weight divided by
    its largest singular value, estimated by power iteration in buffers updated at every training
    forward), and the head's weight through ``weight_norm``. The module's parameters are then
    ``parametrizations.weight.original*``."""
    from torch.nn.utils import parametrizations

    model = mlp(dim, depth)
    apply = getattr(parametrizations, kind)
    for block in model.blocks:
        apply(block.up)
    parametrizations.weight_norm(model.head)
    return model
