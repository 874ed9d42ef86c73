r"""
train_gpt.py: a nanoGPT-style GPT trained with zero.py (ZeRO stages 0-3), on CPU or GPUs.

The model, the data pipeline and the training loop in one file, to run as is or to copy
your own loop from. With no arguments it trains a small byte-level GPT on the source of the
Python standard library (every Python install carries it, so nothing is downloaded), then
prints a sample. Settings are the commented globals below; override any with --key=value.

  python train_gpt.py                                            # one process, CPU or one GPU
  torchrun --standalone --nproc_per_node=2 train_gpt.py          # 2 processes on a laptop CPU (gloo)
  torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3 --checkpoint=True --accum_steps=2
  torchrun --standalone --nproc_per_node=8 train_gpt.py --model=gpt2 --data=data/openwebtext \
      --stage=3 --dtype=fp16 --offload=True --batch_size=12 --accum_steps=5 --lr=6e-4 --min_lr=6e-5 \
      --warmup_iters=2000 --max_iters=600000 --eval_interval=1000 --eval_iters=200
                                      # GPT-2 124M on OpenWebText (nanoGPT's data/openwebtext/prepare.py)
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train_gpt.py \
      --model=gpt2-xl --stage=3 --shard_group=8     # two nodes: shard inside each node, replicate across
  python train_gpt.py --resume=True --max_iters=1000             # continue from out_dir's checkpoint
  python zero.py consolidate out/ckpt model.pt && python train_gpt.py --init_from=model.pt --out_dir=ft
                                                                 # fine-tune from a plain state_dict file

The model is built on the meta device (shapes only) and zero.Zero makes it real one block at a
time, so a rank never holds more than its shards and a few blocks: --model=gpt2-xl --stage=3
starts on ranks that could never hold gpt2-xl whole.
"""
import ast, contextlib, dataclasses, difflib, math, os, pickle, resource, sys, sysconfig, time
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero

# ----------------------------------------------------------------------------- config
# model: a preset, whose shape any of n_layer/n_head/n_embd/block_size (0 = the preset's) overrides
model = "tiny"          # tiny (0.8M: a CPU in 2 minutes) | gpt2 (124M) | gpt2-medium (350M) | gpt2-large (774M)
                        # | gpt2-xl (1558M)
n_layer = 0             # transformer blocks; each one is a zero unit
n_head = 0              # attention heads
n_embd = 0              # embedding width
block_size = 0          # context length in tokens
# data
data = ""               # "" = bytes of the Python stdlib's source | DIR with nanoGPT's train.bin, val.bin
                        # (and meta.pkl) | any FILE, its bytes as tokens
out_dir = "out"         # the checkpoint (with the loop's own state) and the stdlib token cache go here
batch_size = 16         # sequences per micro-batch per rank: global batch = batch_size * world * accum_steps
# training loop
max_iters = 800         # optimizer steps in total (a resumed run counts the steps already taken)
eval_interval = 100     # validation loss every this many steps (and at the first and last)
eval_iters = 10         # validation batches per evaluation
ckpt_interval = 1000    # checkpoint every this many steps (and always at the end)
resume = False          # continue from out_dir's checkpoint: weights, optimizer, step and data stream
init_from = ""          # start from the weights of a plain state_dict file (python zero.py consolidate's output)
seed = 1337             # model init and the data stream
compile = False         # torch.compile the model (nanoGPT's default on GPUs; graphs break at zero's unit hooks)
# learning rate: linear warm-up, then cosine decay to min_lr
warmup_iters = 50       # steps of linear warm-up from 0
lr_decay_iters = 0      # step where the cosine reaches min_lr (0 = max_iters)
min_lr = 1e-4           # the floor of the schedule, ~lr/10 as in Chinchilla
# zero.Config: each field is taken from the global of the same name; the fields not listed here
# (fp16 loss-scale settings, prefetch, timeout_s) are options too, with zero.Config's defaults
stage = 2               # 0 plain data parallel | 1 shard optimizer | 2 + shard grads | 3 + shard params
dtype = "auto"          # fp32 | bf16 | fp16 | auto (bf16 where the GPU or CPU computes it natively, else
                        # fp16 on GPUs, fp32 on CPUs)
update = "adamw"        # adamw | muon: Muon on the blocks' matrices at muon_lr, AdamW at lr on the rest
lr = 2e-3               # peak learning rate (small models take a large one; gpt2 wants ~6e-4)
muon_lr = 0.02          # update=muon: Muon's peak learning rate (the schedule scales both alike)
beta1 = 0.9             # AdamW betas
beta2 = 0.95
eps = 1e-8              # AdamW epsilon
weight_decay = 0.1      # AdamW decoupled weight decay
grad_clip = 1.0         # clip the global grad norm to this (0 = off)
accum_steps = 1         # micro-batches per optimizer step
checkpoint = False      # activation recompute: False | True (every block) | k (every k-th block)
offload = False         # ZeRO-Offload (stages 1-3): fp32 master and Adam moments on the host
# sampling at the end
prompt = "def "         # text the sample starts from
sample_tokens = 300     # tokens to generate
temperature = 0.8       # < 1 sharpens the distribution
top_k = 40              # sample only among the k likeliest tokens (0 = all)

PRESETS = {  # (n_layer, n_head, n_embd, block_size)
    "tiny": (4, 4, 128, 128), "gpt2": (12, 12, 768, 1024), "gpt2-medium": (24, 16, 1024, 1024),
    "gpt2-large": (36, 20, 1280, 1024), "gpt2-xl": (48, 25, 1600, 1024),
}
# dense 16-bit peak FLOP/s per GPU, looked up by name, for MFU (unknown GPUs and CPUs show none)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "V100": 125e12}


def fail(msg):
    # a user's mistake gets one line on stderr and exit code 2, not a traceback; every rank
    # meets it, so only the first on each node says it (torchrun then adds its own report)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"train_gpt.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv, cfg):
    """Apply --key=value overrides to cfg, a dict of the globals above; the default's type is the rule."""
    for arg in argv:
        key, sep, text = arg[2:].partition("=")
        if not arg.startswith("--") or not sep:
            fail(f"expected --key=value, got {arg!r}")
        if key not in cfg:
            near = difflib.get_close_matches(key, cfg, n=1)
            hint = f"did you mean --{near[0]}?" if near else f"known: {', '.join(cfg)}"
            fail(f"unknown option --{key} ({hint})")
        old = cfg[key]
        if isinstance(old, str):
            cfg[key] = text
            continue
        text = {"true": "True", "false": "False"}.get(text.lower(), text)
        try:
            val = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            val = text
        # ints pass as floats; checkpoint also takes an int k (every k-th block)
        ok = type(val) is type(old) or (type(old) is float and type(val) is int) \
            or (key == "checkpoint" and type(val) is int)
        if not ok:
            fail(f"--{key}={text}: expected {type(old).__name__}, like --{key}={old}")
        cfg[key] = float(val) if type(old) is float else val


# ----------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_head, n_embd):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # q, k, v for all heads in one matmul
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash / mem-efficient kernel where there is one
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # heads side by side again: (B, T, C)


class Block(nn.Module):
    def __init__(self, n_head, n_embd, n_layer):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_head, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        # GPT-2's MLP: 4x wider, tanh-approximated GELU
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd))
        self.attn.proj.residual_of = self.mlp[2].residual_of = n_layer  # init_weights scales these down

    def forward(self, x):
        x = x + self.attn(self.ln1(x))  # pre-norm: the residual stream itself is never normalized
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, n_layer, n_head, n_embd, block_size):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_head, n_embd, n_layer) for _ in range(n_layer))  # each: one zero unit
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: zero puts a parameter shared like this in the root unit
        self.apply(init_weights)  # a no-op on the meta device, where zero.Zero calls it unit by unit

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:  # generation needs the last position only
            return self.head(x[:, -1]).float()
        logits = self.head(x).float()  # the softmax in fp32 whatever the compute dtype
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def init_weights(module):
    """GPT-2's init, one module at a time (as nn.Module.apply and zero.Zero's init_fn call it): weights
    N(0, 0.02), residual projections scaled down by depth so the stream stays ~unit; zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02 / math.sqrt(2 * getattr(module, "residual_of", 0.5)))
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


@torch.no_grad()
def generate(engine, idx, n, temperature, top_k, gen):
    # every rank runs the same forwards (stage 3 gathers each block) with the same generator
    for _ in range(n):
        logits = engine(idx[:, -engine.module.block_size:]) / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits[logits < kth] = -float("inf")
        nxt = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=gen)
        idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
    return idx


# ----------------------------------------------------------------------------- data
def build_stdlib_tokens(cache):
    """Bytes of the stdlib's .py files (not site-packages or tests), every 10th file held out for validation."""
    root, parts = sysconfig.get_paths()["stdlib"], ([], [])
    files = []
    for d, dirs, names in os.walk(root):
        # installed packages differ between machines, and the test suites are full of deliberately odd bytes
        skip = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
        dirs[:] = sorted(x for x in dirs if x not in skip)
        files += [os.path.join(d, f) for f in sorted(names) if f.endswith(".py")]
    for i, path in enumerate(sorted(files)):  # sorted: the same split on every rank and every run
        with open(path, "rb") as f:
            parts[i % 10 == 9].append(f.read())
    os.makedirs(cache, exist_ok=True)
    for split, chunks in zip(("train", "val"), parts):
        # write under a private name, then rename: a reader sees the old file or the whole new one
        tmp = os.path.join(cache, f"{split}.bin.{os.uname().nodename}.{os.getpid()}")
        np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16).tofile(tmp)
        os.replace(tmp, os.path.join(cache, f"{split}.bin"))


def load_data(path, block_size, out_dir, local_rank):
    """-> ({"train": tokens, "val": tokens}, vocab_size, encode, decode) for the --data argument."""
    byte_codec = (256, lambda s: list(s.encode()), lambda ids: bytes(ids).decode(errors="replace"))
    if path and not os.path.exists(path):
        fail(f"--data={path}: no such file or directory")
    if path and os.path.isfile(path):  # any file: its bytes are the tokens, the last 10% for validation
        raw = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
        splits, codec = {"train": raw[: len(raw) * 9 // 10], "val": raw[len(raw) * 9 // 10:]}, byte_codec
    else:
        stdlib = not path
        if stdlib:  # the stdlib's source, tokenized once per node by its local rank 0
            path = os.path.join(out_dir, f"stdlib_py{sys.version_info[0]}{sys.version_info[1]}")
            # val.bin is renamed into place last: once it is there, both files are whole
            if local_rank == 0 and not os.path.exists(os.path.join(path, "val.bin")):
                build_stdlib_tokens(path)
            if dist.is_initialized():
                dist.barrier()  # the other ranks read only once the files are whole
        for split in ("train", "val"):
            if not os.path.exists(os.path.join(path, f"{split}.bin")):
                fail(f"--data={path}: a data directory needs train.bin and val.bin "
                     "(uint16 tokens, as nanoGPT's prepare.py writes them)")
        splits = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=np.uint16, mode="r") for s in ("train", "val")}
        codec = byte_codec if stdlib else gpt2_codec(os.path.join(path, "meta.pkl"))
    for split, toks in splits.items():
        if len(toks) < block_size + 1:
            fail(f"--data={path or 'stdlib'}: {split} split has {len(toks)} tokens, fewer than one block "
                 f"({block_size} + 1); use more data or a smaller --block_size")
    return splits, *codec


def gpt2_codec(meta_path):
    # nanoGPT's char-level sets carry their vocabulary in meta.pkl; otherwise GPT-2 tokens (tiktoken if installed)
    if os.path.exists(meta_path):
        with open(meta_path, "rb") as f:
            meta = pickle.load(f)
        stoi, itos = meta["stoi"], meta["itos"]  # characters the vocabulary lacks are dropped from the prompt
        return meta["vocab_size"], lambda s: [stoi[c] for c in s if c in stoi], lambda ids: "".join(map(itos.get, ids))
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
        return 50304, enc.encode_ordinary, enc.decode  # 50257 padded up to a multiple of 64 for speed
    except Exception:
        return 50304, lambda s: [50256], lambda ids: " ".join(map(str, ids))  # <|endoftext|>, ids printed raw


def get_batch(splits, split, key, batch_size, block_size, rank, world, device):
    # the global batch is a function of (seed, key): every rank draws it and keeps its own slice,
    # so a resumed run sees exactly the batches the uninterrupted one would have
    toks = splits[split]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 2 * key + (split == "val"))
    ix = torch.randint(len(toks) - block_size, (batch_size * world,), generator=gen)
    ix = ix[rank * batch_size:(rank + 1) * batch_size]
    xy = torch.from_numpy(np.stack([toks[i:i + block_size + 1] for i in ix.tolist()]).astype(np.int64))
    if device.type == "cuda":  # pinned: the copy overlaps the work already queued on the GPU
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


# ----------------------------------------------------------------------------- training
def get_lr(step):
    # linear warm-up to lr, cosine down to min_lr at lr_decay_iters, then flat
    decay_iters = lr_decay_iters or max_iters
    if step < warmup_iters:
        return lr * (step + 1) / (warmup_iters + 1)
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def mean_over_ranks(x, device):
    t = torch.tensor([float(x)], device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def mib(d):
    return " ".join(f"{k} {v / 2**20:.1f}" for k, v in d.items()) + f" = {sum(d.values()) / 2**20:.1f} MiB"


def cpu_bf16():
    # bf16 matmuls are fast only where the CPU has bf16 instructions (AVX-512 BF16, AMX, Arm's bf16): elsewhere
    # (AVX2) they run ~7x slower than fp32 (measured on a Zen 2: 3.1 s a step against 0.43 s)
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags.split()))


def main():
    cfg = {k: v for k, v in globals().items() if not k.startswith("_") and type(v) in (int, float, bool, str)}
    cfg.update({f.name: f.default for f in dataclasses.fields(zero.Config)
                if f.name not in cfg and type(f.default) in (int, float, bool, str)})
    parse_args(sys.argv[1:], cfg)
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    if cfg["resume"]:
        try:  # the loop's own state, saved inside the checkpoint: its step and its config
            saved = zero.read_extra(ckpt_dir)
        except (OSError, ValueError) as e:
            fail(f"--resume=True: {e}")
        # the model and the data must be those of the checkpoint; everything else may change
        cfg.update({k: saved["config"][k] for k in ("model", "n_layer", "n_head", "n_embd", "block_size", "data",
                                                     "seed")})
    if cfg["model"] not in PRESETS:
        fail(f"--model={cfg['model']}: unknown preset (known: {', '.join(PRESETS)})")
    for k, v in zip(("n_layer", "n_head", "n_embd", "block_size"), PRESETS[cfg["model"]]):
        cfg[k] = cfg[k] or v
    for k in ("batch_size", "eval_interval", "eval_iters", "ckpt_interval", "sample_tokens"):
        if cfg[k] < 1:
            fail(f"--{k}={cfg[k]}: must be at least 1")
    if cfg["n_embd"] % cfg["n_head"]:
        fail(f"--n_embd={cfg['n_embd']} must be a multiple of --n_head={cfg['n_head']}")
    globals().update(cfg)  # from here on the globals hold the final config

    # one thread per core: 2 processes on 2 cores must not fight over them
    torch.set_num_threads(zero._host_threads())
    rank, world, device = zero.init_distributed()
    master = rank == 0
    cfg["dtype"] = dtype if dtype != "auto" else ("bf16" if cpu_bf16() else "fp32") if device.type == "cpu" else \
        ("bf16" if torch.cuda.is_bf16_supported() else "fp16")   # fp16 matmuls crawl on CPUs
    if master and device.type == "cpu" and cfg["dtype"] == "fp16":
        print("note: fp16 matmuls run ~100x slower than bf16 on most CPUs; --dtype=bf16 is the CPU choice")
    zcfg = zero.Config(**{f.name: cfg[f.name] for f in dataclasses.fields(zero.Config) if f.name in cfg},
                       betas=(beta1, beta2))
    if update == "muon":  # Config.lr is then Muon's, adamw_lr the AdamW group's
        zcfg = dataclasses.replace(zcfg, lr=muon_lr, adamw_lr=lr)
    os.makedirs(out_dir, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    splits, vocab_size, encode, decode = load_data(data, block_size, out_dir, local_rank)

    torch.manual_seed(seed)  # the same init on every run (zero.Zero also gives every rank rank 0's weights)
    with torch.device("meta"):  # shapes only: zero.Zero builds and initializes it one block at a time
        net = GPT(vocab_size, n_layer, n_head, n_embd, block_size)
    n_params = sum(p.numel() for p in net.parameters())  # the tied head is counted once
    # nanoGPT's optimizer groups: weight decay on the 2-D weights (matmuls, embeddings), none on biases and norms
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if update == "muon":  # zero's own split: Muon on the matrices, AdamW on embeddings, head and the rest
        groups = None
    try:
        engine = zero.Zero(net, zcfg, init_fn=init_weights, param_groups=groups)
    except ValueError as e:  # zero names a bad config (stage=7, offload at stage 0...) and its fix
        fail(str(e))
    peak_lrs = [g["lr"] for g in engine.optimizer.param_groups]  # each group's, before a resume sets them
    if init_from and not resume:
        if not os.path.isfile(init_from):
            fail(f"--init_from={init_from}: no such file")
        try:  # memory-mapped: each rank reads only the slices it keeps
            engine.load_state_dict(torch.load(init_from, map_location="cpu", mmap=True, weights_only=True))
        except (ValueError, RuntimeError) as e:  # another model or vocabulary: zero lists what does not fit
            why = str(e).removeprefix("zero: ")
            fail(f"--init_from={init_from} does not fit this model ({why[:300] + ' ...' * (len(why) > 300)}); "
                 "use the --model/--n_layer/--n_embd/--data it was trained with")
    if compile:
        engine.module.compile()  # after wrapping: each block's forward compiled, the engine's hooks between them
    step = 0
    if resume:
        try:
            step = zero.load(engine, ckpt_dir)["extra"]["step"]
        except (OSError, ValueError, RuntimeError) as e:  # missing shard files, another model's checkpoint...
            fail(str(e))
    tokens_per_step = batch_size * block_size * world * accum_steps
    # training FLOPs per token: 6 per weight (forward + backward) plus attention's, as in the PaLM paper
    flops_per_token = 6 * (n_params - net.wpe.weight.numel()) + 12 * n_layer * n_embd * block_size
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((v for k, v in PEAK_FLOPS.items() if k in gpu), 0.0) if cfg["dtype"] != "fp32" else 0.0
    if master:
        print("config: " + " ".join(f"{k}={v}" for k, v in cfg.items()))
        print(f"model: {n_params / 1e6:.2f}M parameters, vocab {vocab_size} | world {world} on {gpu or device.type} | "
              f"{tokens_per_step:,} tokens/step | tokens train {len(splits['train']):,} val {len(splits['val']):,}")
        n_muon = sum(p.numel() for g in engine.optimizer.param_groups if g.get("update") == "muon" for p in g["params"])
        est = zero.estimate_memory(n_params, world, stage, dtype=cfg["dtype"], offload=offload, shard_group=shard_group,
                                   device=device.type, muon_params=n_muon)
        mem = engine.memory()
        for where in ("device", "host"):
            print(f"memory/rank {where:6s} engine: {mib(mem[where])} | estimate: {mib(est[where])}")
        if resume:
            print(f"resumed from {ckpt_dir} at step {step}")

    def evaluate():  # on every rank: at stage 3 each forward gathers every block from all of them
        engine.eval()
        with torch.no_grad():  # the same val batches each time, so evaluations compare
            losses = [engine(*get_batch(splits, "val", k, batch_size, block_size, rank, world, device)).item()
                      for k in range(eval_iters)]
        engine.train()
        return mean_over_ranks(sum(losses) / len(losses), device)

    def save():  # every rank writes its shard; the loop's own state goes with them, in the same commit
        zero.save(engine, ckpt_dir, extra=dict(step=step, config=cfg))

    val_losses, t_start, timed = [], time.time(), []
    val_losses.append(evaluate())
    if master:
        print(f"step {step:5d} | val loss {val_losses[-1]:.4f}")
    while step < max_iters:
        t0 = time.time()
        loss_sum = 0.0
        for micro in range(accum_steps):
            x, y = get_batch(splits, "train", step * accum_steps + micro, batch_size, block_size, rank, world, device)
            loss = engine(x, y)
            engine.backward(loss)
            loss_sum += loss.detach()
        # the mean over ranks for the log; its .item() also waits for the device, so the timing is honest
        loss_avg = mean_over_ranks(loss_sum / accum_steps, device)
        for group, peak_lr in zip(engine.optimizer.param_groups, peak_lrs):  # step() reads each group's lr now
            group["lr"] = get_lr(step) * peak_lr / lr
        ok = engine.step()
        step += 1
        ms = (time.time() - t0) * 1000
        timed = timed[-50:] + [ms]  # the ETA from the recent steps: the first ones warm up
        if master:
            eta = sum(timed) / len(timed) * (max_iters - step) / 1000
            line = f"step {step:5d} | loss {loss_avg:.4f} | norm {engine.grad_norm:.3f} | lr {engine.lr:.2e} | " \
                   f"{ms:7.1f} ms | {tokens_per_step / ms * 1000:9,.0f} tok/s"
            if peak:
                line += f" | mfu {flops_per_token * tokens_per_step / world / (ms / 1000) / peak:5.1%}"
            if cfg["dtype"] == "fp16":
                line += f" | scale {engine.loss_scale:g}" + ("" if ok else " (overflow, skipped)")
            print(line + f" | eta {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)
        if step % eval_interval == 0 or step == max_iters:
            val_losses.append(evaluate())
            if master:
                print(f"step {step:5d} | val loss {val_losses[-1]:.4f}", flush=True)
        if step % ckpt_interval == 0 or step == max_iters:
            save()

    # a sample from the trained model: every rank runs the forwards, rank 0 prints
    engine.eval()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([encode(prompt) or [0]], dtype=torch.long, device=device)
    out = generate(engine, idx, sample_tokens, temperature, top_k, gen)[0].tolist()
    if master:
        print("-" * 30 + " sample " + "-" * 30 + "\n" + decode(out) + "\n" + "-" * 68)
        peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        mem, comm = engine.memory(), engine.comm()
        print(f"done: val loss {val_losses[0]:.4f} -> {val_losses[-1]:.4f} in {time.time() - t_start:.1f}s | "
              f"peak {'GPU memory allocated' if device.type == 'cuda' else 'RSS'} rank 0: {peak_mem / 2**20:.1f} MiB")
        for where in ("device", "host"):
            print(f"memory/rank {where:6s} engine: {mib(mem[where])}")
        # what one step moves: stage 3 adds an all-gather per block for the backward
        print("comm/rank last step: " + " ".join(f"{k} {v['calls']}x {v['bytes'] / 2**20:.2f} MiB"
                                                 for k, v in comm.items() if k != "between_steps"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
