"""On one GPU (NCCL, W=1): this session's changes on the CUDA path.
1. optimizer in backward (per-parameter AdamW in post-accumulate-grad hooks) at stages 1-3, also with
   Offload("cpu") at stage 3, against the unwrapped model on the same device (fp32, TF32 off);
2. torch.save of model.state_dict() / opt.state_dict() and load into a fresh wrapped model;
3. GPT-2 small bf16 stage-3 step time (this commit), as in probes_gpu_session34.md."""
import io, os, sys, time, statistics, torch, torch.nn as nn, torch.distributed as dist
sys.path.insert(0, os.getcwd())
torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29581")
GPU = torch.cuda.is_available()
dist.init_process_group("nccl" if GPU else "gloo", rank=0, world_size=1); dev = torch.device("cuda", 0) if GPU else torch.device("cpu")
if GPU: torch.cuda.set_device(0)
sync = torch.cuda.synchronize if GPU else (lambda: None)
from shardwrap import ShardedModule, Offload, MixedPrecision
class Block(nn.Module):
    def __init__(s, d=256): super().__init__(); s.n = nn.LayerNorm(d); s.a = nn.Linear(d, 4*d); s.b = nn.Linear(4*d, d); s.dead = nn.Linear(d, d)
    def forward(s, x): return x + s.b(torch.tanh(s.a(s.n(x))))
def net():
    torch.manual_seed(0); return nn.Sequential(nn.Linear(256, 256), Block(), Block(), Block(), nn.Linear(256, 7)).to(dev)
def attach(m):
    calls = [0]
    for p in m.parameters():
        o = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1 if p.dim() >= 2 else 0.0)
        def h(q, o=o): calls[0] += 1; o.step(); o.zero_grad()
        p.register_post_accumulate_grad_hook(h)
    return calls
def run(m):
    calls = attach(m)
    for s in range(4):
        g = torch.Generator().manual_seed(s); x = torch.randn(32, 256, generator=g).to(dev); y = torch.randn(32, 7, generator=g).to(dev)
        ((m(x) - y) ** 2).mean().backward()
    sync(); return calls[0]
ref = net(); rc = run(ref); rs = {k: v.float().cpu() for k, v in ref.state_dict().items()}
ok = True
for stage, off in [(1, None), (2, None), (3, None), (3, "cpu")]:
    m = ShardedModule(net(), auto_wrap_policy={Block}, stage=stage, offload=Offload(off) if off else None)
    c = run(m); sd = m.full_state_dict()
    d = max((sd[k].float().cpu() - v).abs().max().item() for k, v in rs.items())
    good = c == rc and d < 1e-5; ok &= good
    print(f"optimizer in backward s{stage} offload={off}: hook calls {c} (unwrapped {rc}), max |param - ref| {d:.2e}, ok {good}", flush=True)
    b = io.BytesIO(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    torch.save({"m": m.state_dict(), "o": opt.state_dict()}, b); b.seek(0); st = torch.load(b, weights_only=True)
    m2 = ShardedModule(net(), auto_wrap_policy={Block}, stage=stage, offload=Offload(off) if off else None); m2.load_state_dict(st["m"])
    sd2 = m2.full_state_dict(); d2 = max((sd2[k].float().cpu() - sd[k].float().cpu()).abs().max().item() for k in sd)
    ok &= d2 == 0; print(f"  torch.save/load of state_dict: max diff {d2}", flush=True)
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
for rep in range(2 if GPU else 0):
    torch.manual_seed(0)
    model = ShardedModule(GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)).to(dev), auto_wrap_policy={GPT2Block}, stage=3,
                          mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1); times = []
    for s in range(13):
        x = torch.randint(0, 50257, (8, 1024), generator=torch.Generator().manual_seed(s)).to(dev)
        sync(); t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        sync()
        if s >= 3: times.append((time.perf_counter() - t0) * 1e3)
    print(f"GPT-2 small bf16 s3 step {statistics.median(times):.1f} ms", flush=True)
    del model, opt; torch.cuda.empty_cache() if GPU else None
print("ALL OK" if ok else "FAILED"); dist.destroy_process_group()
