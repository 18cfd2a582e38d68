"""Train a GPT-2-style causal language model with shardwrap: the main job.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt2.py

It runs on CPU ranks over gloo by default and unchanged on GPUs over nccl. The model is a
transformers GPT2LMHeadModel built from a small GPT2Config with random weights; the tokenizer is
byte-level (vocab 256) and needs no download; the text is the shipped public-domain corpus
examples/data/corpus.txt (three Shakespeare plays, see examples/data/README.md), or, with
--data generated, sentences from a small grammar, so nothing is fetched at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import random
import time

# ---- defaults ---------------------------------------------------------------------------------
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
p.add_argument("--steps", type=int, default=150)
p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--n-layer", type=int, default=4)
p.add_argument("--n-embd", type=int, default=128)
p.add_argument("--n-head", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--log-every", type=int, default=25)
p.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "data", "corpus.txt"),
               help="a UTF-8 text file, or 'generated'")
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none")
p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step; all but the last run under no_sync()")
p.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0 turns clipping off")
p.add_argument("--save-every", type=int, default=0, help="save a sharded checkpoint every N steps (0: never)")
p.add_argument("--ckpt-dir", default="checkpoints/gpt2")
p.add_argument("--resume", default="", help="a checkpoint directory, or 'auto' for the latest in --ckpt-dir")
p.add_argument("--replicate", default="1",
               help="hybrid sharding: N replicas, each sharded over WORLD_SIZE / N ranks (mesh (N, WORLD_SIZE / N), "
                    "axes 'replicate' and 'shard'); 'auto': one replica per node (WORLD_SIZE / LOCAL_WORLD_SIZE); "
                    "1: shard over every rank")
p.add_argument("--timeout", type=float, default=0,
               help="seconds a collective waits for the other ranks before it raises (init_process_group's "
                    "timeout); 0: torch's default (30 minutes on gloo, 10 on nccl)")
p.add_argument("--final-state", default="", help="at the end, rank 0 saves model.full_state_dict() here with torch.save")
args = p.parse_args()
if "RANK" not in os.environ:  # init_process_group reads the rank and the rendezvous from torchrun
    p.error("start it with torchrun: OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/train_gpt2.py")
# torchrun sets WORLD_SIZE (every rank of every node) and LOCAL_WORLD_SIZE (the ranks of this node).
world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
if args.replicate == "auto":
    if world_size % local_world_size:
        p.error(f"--replicate auto: WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size} "
                f"(nodes with different --nproc_per_node); pass --replicate N")
    args.replicate = world_size // local_world_size  # the number of nodes
elif not args.replicate.isdigit() or int(args.replicate) < 1:
    p.error(f"--replicate must be a whole number >= 1 or 'auto', not {args.replicate!r}")
else:
    args.replicate = int(args.replicate)
if world_size % args.replicate:
    p.error(f"--replicate {args.replicate} does not divide the {world_size} ranks: each replica shards over "
            f"WORLD_SIZE / N ranks; pass a divisor of {world_size}, or 'auto' for one replica per node")
if args.timeout < 0:
    p.error(f"--timeout must be >= 0 seconds, not {args.timeout}")

# torch and transformers take seconds to import: the command line is read first, so --help and
# a start without torchrun answer at once.
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from shardwrap import MixedPrecision, ShardedModule, collectives, load_checkpoint, save_checkpoint
from shardwrap.unit import local_of

# ---- processes and devices --------------------------------------------------------------------
use_cuda = torch.cuda.is_available()
timeout = {"timeout": datetime.timedelta(seconds=args.timeout)} if args.timeout else {}
dist.init_process_group("nccl" if use_cuda else "gloo", **timeout)
rank, world = dist.get_rank(), dist.get_world_size()
if use_cuda:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(args.seed)


# ---- data: bytes of text, cut into (seq_len + 1)-byte windows ---------------------------------
def generated_corpus(n_sentences: int = 6000) -> str:
    """English-like sentences from a tiny grammar: learnable structure, nothing to download."""
    rng = random.Random(0)
    subjects = ["the old sailor", "a quiet child", "the king", "my neighbour", "the young doctor", "a grey wolf"]
    verbs = ["watched", "followed", "remembered", "painted", "carried", "found"]
    objects = ["the northern sea", "a broken lantern", "the long road", "an empty house", "the winter moon"]
    endings = ["at dawn", "without a word", "for many years", "in the rain", "before the storm"]
    return " ".join(
        f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(endings)}."
        for _ in range(n_sentences)
    )


class ByteWindows(Dataset):
    def __init__(self, text: str, seq_len: int) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]  # (T + 1,)


text = generated_corpus() if args.data == "generated" else open(args.data, encoding="utf-8").read()
dataset = ByteWindows(text, args.seq_len)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

# ---- model: GPT-2 with tied embeddings, one unit per block --------------------------------------
config = GPT2Config(
    vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)
model = GPT2LMHeadModel(config).to(device)
n_params = sum(p.numel() for p in model.parameters())
dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]
# Hybrid sharding: shard within a replica (a node, with --replicate auto), replicate across them, so
# the gathers stay on the node's fast links and only the gradient all-reduce crosses nodes.
mesh = None
if args.replicate > 1:
    mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate), mesh_dim_names=("replicate", "shard"))
model = ShardedModule(model, auto_wrap_policy={GPT2Block}, stage=args.stage, mixed_precision=MixedPrecision(param_dtype=dtype),
                      mesh=mesh)

# nanoGPT's grouping: decay 2-D weights, not biases and norms.
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr, betas=(0.9, 0.95),
)


# fp16 needs loss scaling (bf16 does not): torch's ShardedGradScaler agrees across ranks on whether
# any rank's shard overflowed, so every rank skips the same steps.
scaler = None
if args.mixed_precision == "fp16":
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device=device.type)


def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def model_state_mib() -> float:
    """This rank's parameter, gradient and optimizer-state storage, in MiB."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    locals_ = [local_of(t) for t in tensors]  # parameters, gradients and states are DTensors
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in locals_}
    return sum(storages.values()) / 2**20


# ---- resuming: the model, the optimizer, and where the run was in its data -----------------------
# Each rank's epoch is a fixed shuffle (seed + epoch) dealt round-robin to the ranks, so a step
# consumes the next batch_size * world windows of the global order, whatever the world size. A
# checkpoint records the epoch and how many windows of it were consumed; a resume skips that many
# and goes on with the very batches the uninterrupted run would have seen.
global_batch = args.batch_size * world  # windows per step, over every rank
step, epoch, skip = 0, 0, 0  # skip: batches of this epoch already trained on
if args.resume:  # checkpoints are directories named step_NNNNNN
    path = args.resume
    if path == "auto":
        found = sorted(d for d in os.listdir(args.ckpt_dir) if d.startswith("step_")) if os.path.isdir(args.ckpt_dir) else []
        path = os.path.join(args.ckpt_dir, found[-1]) if found else ""
    if path:
        saved = load_checkpoint(path, model, opt)
        if saved is None:  # saved before the data position was: assume the same data and batch size
            step = int(os.path.basename(path.rstrip("/")).split("_")[-1])
            epoch, skip = divmod(step, len(loader))
        else:
            step, epoch, consumed = saved["step"], saved["epoch"], saved["windows_in_epoch"]
            if (saved["seed"], saved["windows"]) != (args.seed, len(dataset)):
                p.error(f"{path} was trained on {saved['windows']} windows shuffled with --seed {saved['seed']}, this run "
                        f"has {len(dataset)} windows and --seed {args.seed}: pass the same --data, --seq-len and --seed")
            if consumed % global_batch:
                p.error(f"{path} stopped {consumed} windows into epoch {epoch}, not a whole number of steps of "
                        f"{global_batch} windows (--batch-size {args.batch_size} x {world} ranks): use a global batch "
                        f"that divides {consumed}, e.g. the saved {saved['global_batch']}")
            skip = consumed // global_batch
            if scaler is not None and saved.get("scaler"):
                scaler.load_state_dict(saved["scaler"])
if rank == 0:
    layout = f"{args.replicate} replicas x {world // args.replicate} shards" if args.replicate > 1 else f"{world} ranks"
    print(f"GPT-2 {n_params / 1e6:.2f}M params, {layout}, stage {args.stage}, {args.mixed_precision}, "
          f"{device}, {len(dataset)} windows, starting at step {step} (epoch {epoch}, batch {skip})")

# ---- training loop ------------------------------------------------------------------------------
try:
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, disable=rank != 0, ncols=100)
except ImportError:  # tqdm is optional
    bar = None
t0, tokens = time.perf_counter(), 0
first_loss = last_loss = float("nan")


@record  # under torchrun a failed rank's error goes into the failure summary, not "error_file: <N/A>"
def train() -> None:
    global step, epoch, skip, tokens, first_loss, last_loss
    try:
        while step < args.steps:
            sampler.set_epoch(epoch)
            # a resumed epoch starts after the batches it already trained on (islice reads and drops them)
            for batch_in_epoch, batch in enumerate(itertools.islice(loader, skip, None), start=skip):
                batch = batch.to(device)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                micro_batches = batch.chunk(args.grad_accum)
                for i, micro in enumerate(micro_batches):
                    x, y = micro[:, :-1], micro[:, 1:]  # (B, T) inputs and next-byte targets
                    sync = i == len(micro_batches) - 1  # only the last micro-batch communicates
                    with model.no_sync() if not sync else contextlib.nullcontext():
                        logits = model(input_ids=x).logits  # (B, T, 256)
                        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                        micro_loss = loss / len(micro_batches)
                        (scaler.scale(micro_loss) if scaler is not None else micro_loss).backward()
                if scaler is not None:
                    scaler.unscale_(opt)  # clip the true gradients
                if args.clip > 0:
                    model.clip_grad_norm_(args.clip)
                if scaler is not None:
                    scaler.step(opt)  # skipped on every rank if any rank's shard overflowed
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                tokens += batch[:, :-1].numel() * world
                step += 1
                if args.save_every and step % args.save_every == 0:
                    position = {  # where the next step starts; the same on every rank
                        "step": step, "epoch": epoch, "windows_in_epoch": (batch_in_epoch + 1) * global_batch,
                        "global_batch": global_batch, "seed": args.seed, "windows": len(dataset),
                        "scaler": scaler.state_dict() if scaler is not None else None,
                    }
                    save_checkpoint(os.path.join(args.ckpt_dir, f"step_{step:06d}"), model, opt, extra_state=position)
                if bar is not None:
                    bar.update(1)
                if step == 1 or step % args.log_every == 0 or step == args.steps:
                    avg = loss.detach().clone()
                    dist.all_reduce(avg)
                    avg = avg.item() / world
                    first_loss = avg if math.isnan(first_loss) else first_loss
                    last_loss = avg
                    # collectives run on the process group's device: nccl takes CUDA tensors only
                    peak = torch.cuda.max_memory_allocated(device) / 2**20 if use_cuda else float("nan")
                    mem = torch.tensor([model_state_mib(), peak], device=device)
                    mems = [torch.zeros(2, device=device) for _ in range(world)]
                    dist.all_gather(mems, mem)
                    if rank == 0:
                        rate = tokens / (time.perf_counter() - t0)
                        per_rank = " ".join(
                            f"r{r}={m[0].item():.1f}MiB" + (f" (peak allocated {m[1].item():.0f}MiB)" if use_cuda else "")
                            for r, m in enumerate(mems)
                        )
                        msg = f"step {step:4d} loss {avg:.4f} tok/s {rate:,.0f} model-state {per_rank}"
                        (bar.write if bar is not None else print)(msg)
                if step >= args.steps:
                    break
            else:  # the epoch ran out: the next one starts at its first batch
                epoch, skip = epoch + 1, 0

        if bar is not None:
            bar.close()
        if rank == 0:
            print(f"done: loss {first_loss:.3f} -> {last_loss:.3f} in {time.perf_counter() - t0:.1f}s")
        if args.final_state:
            final = model.full_state_dict()  # every rank takes part; rank 0 gets the full tensors
            if rank == 0:
                torch.save(final, args.final_state)
        dist.barrier()  # let every rank finish its last collective before tearing the groups down
    except Exception as exc:
        if not collectives.lost_a_peer(exc):  # shardwrap.PeerLost, or torch's own wording outside shardwrap's waits
            raise
        node, when = os.environ.get("GROUP_RANK", "?"), f"in step {step + 1}" if step < args.steps else "after the last step"
        raise RuntimeError(
            f"rank {rank} (node {node}) lost its connection to another rank {when}: that rank, or its "
            f"whole node, stopped (killed, out of memory, crashed, or the network went down). Its own log (or the "
            f"scheduler's) says why; the errors of the ranks that were still running, like this one, follow from it. "
            f"Restart the job with --resume auto to go on from the last checkpoint in {args.ckpt_dir} "
            f"(--save-every N writes them)"
        ) from exc


train()
dist.destroy_process_group()
