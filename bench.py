"""bench.py — memory, communication and speed of zero.py next to PyTorch's own.

Users choose a sharding library by three numbers: memory per GPU, speed and
communication. This script measures the three for zero.py's stages 0-3 and for
PyTorch's peers on the GPT of train_gpt.py and the same training step (AdamW,
grad clip 1.0): DDP + AdamW, DDP + ZeroRedundancyOptimizer and FSDP2
(`fully_shard` per block). It prints markdown tables for the README:

  1. model-state memory per rank: engine.memory() vs zero.estimate_memory vs the
     peers' tensors, and the ZeRO paper's formula at 7.5B and 1T parameters;
  2. communication per step and rank (engine.comm()) vs 2Ψ(N-1)/N and 3Ψ(N-1)/N; hybrid sharding
     (shard groups of 2 at 4 ranks) against plain stage 3, and the formula at 7.5B on 64 GPUs; the engine's
     own collectives and host syncs per step at 2, 4 and 8 ranks, and their latency at 512 and 4096;
  3. throughput at 2 gloo ranks, as ratios against the peers, with our targets;
  4. CPU AdamW params/s, activation memory with and without recompute, how
     much of the host update offload hides behind the next forward, and rules written in torch ops
     (AdamW, AdEMAMix) on offload's host thread against the C AdamW kernel;
  5. on a GPU only: tokens/s, MFU and peak memory per stage next to plain torch and FSDP2, and the largest
     GPT that plain torch, stage 3 and stage 3 with offload train (a CPU test runs it on a tiny GPT);
  6. matrix rules: Muon's bytes and time per step beside AdamW's, the bytes nanochat's layout would move, and the
     Newton-Schulz balance of the matrices' assignment at 8-64 ranks on GPT, Llama and Mixtral shapes.

A shared machine drifts by more than the differences we look for, so every
variant is warmed up, then all of them run in interleaved rounds (in a rotating
order) and each ratio is the median of per-round ratios. Only ratios from one
run are claims; absolute numbers come with the hardware line printed first.

    python bench.py            # the full run (about 10 minutes on 2 CPU cores)
    python bench.py --quick    # a reduced smoke run, under a minute
    python bench.py --baseline OLD.py    # also another zero.py's stages, interleaved (git show HEAD~:zero.py)
"""
import argparse, collections, datetime, importlib.util, os, platform, queue, socket, statistics, tempfile, time
import traceback
import functools, types
from contextlib import ExitStack, nullcontext
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt
try:
    import zero
except Exception as e:  # the peers are still measured without it
    zero, ZERO_ERR = None, f"{type(e).__name__}: {e}"
zero_base = None  # --baseline: another zero.py, its variants named base0 .. base3 (loaded in every rank)
if os.environ.get("ZERO_BASELINE"):
    _spec = importlib.util.spec_from_file_location("zero_base", os.environ["ZERO_BASELINE"])
    zero_base = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(zero_base)

MB, GB = 1e6, 1e9
VOCAB = 256  # train_gpt's default data is bytes
OPT = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # the same AdamW everywhere
KINDS = ("params", "grads", "master", "optim")
# (ours, baseline, ratio to reach): tokens/s of ours over the baseline's, same dtype, same run
TARGETS = [("zero0", "ddp", 1.0), ("zero1", "zero-opt", 1.0), ("zero2", "ddp", 0.95), ("zero3", "fsdp2", 1.1)]
BASE_TARGETS = [(f"zero{s}", f"base{s}", 0.95) for s in range(4)]  # with --baseline: this engine vs the other


# --------------------------------------------------------------------------- model, data, bytes
def make_gpt(preset, **shape):
    """train_gpt's GPT from a preset; n_layer/n_head/n_embd/block_size override its shape."""
    torch.manual_seed(0)  # every variant starts from the same weights
    dims = dict(zip(("n_layer", "n_head", "n_embd", "block_size"), train_gpt.PRESETS[preset]))
    return train_gpt.GPT(VOCAB, **{**dims, **shape})


def batch(model, B, rank):
    g = torch.Generator().manual_seed(rank)  # each rank its own batch, the same every step
    xy = torch.randint(0, VOCAB, (B, model.block_size + 1), generator=g)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def numel(model):
    return sum(p.numel() for p in model.parameters())  # the tied head counts once


def storage_bytes(tensors, seen):
    """Bytes of the storages behind `tensors` not yet in `seen` (views share one storage)."""
    n = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            n += s.nbytes()
    return n


def peer_held(model, opt):
    """What a PyTorch peer holds, in the engine's kinds: its fp32 params are its master."""
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps this rank's AdamW in .optim
    seen, ps = set(), [p for p in model.parameters() if p.requires_grad]
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return dict(params=storage_bytes(ps, seen), grads=storage_bytes([p.grad for p in ps if p.grad is not None], seen),
                master=0, optim=storage_bytes(states, seen),
                frozen=storage_bytes([p for p in model.parameters() if not p.requires_grad], seen))


# --------------------------------------------------------------------------- the variants
def stage_of(name):
    """zero.py's variants are zero0 .. zero3 (base0 .. base3: the --baseline's), with "+off" for offload; the
    peers are ddp, zero-opt, fsdp2."""
    return int(name[4]) if name[:4] in ("zero", "base") and name[4:5].isdigit() else None


def build(name, dtype, model, world, **extra):
    """One way to train `model`: (step(x, y), held() -> (device, host) bytes by kind, comm or None)."""
    if stage_of(name) is not None:
        z = zero_base if name.startswith("base") else zero
        if z is None:
            raise RuntimeError(f"import zero failed: {ZERO_ERR}")
        eng = z.Zero(model, z.Config(stage=stage_of(name), dtype=dtype, offload=name.endswith("+off"), **OPT, **extra))

        def step(x, y):
            eng.backward(eng(x, y))
            eng.step()
        return step, lambda: (eng.memory()["device"], eng.memory()["host"]), eng.comm
    amp = torch.autocast("cpu", torch.bfloat16) if dtype == "bf16" else nullcontext()
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:     # torch 2.4 has FSDP2 under its first, private name
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
        for b in model.blocks:  # the same units as zero.py's
            fully_shard(b, mesh=mesh, mp_policy=mpp)
        fully_shard(model, mesh=mesh, mp_policy=mpp)
        opt, amp = torch.optim.AdamW(model.parameters(), fused=True, **OPT), nullcontext()
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, gradient_as_bucket_view=True)  # grads live in DDP's buckets: no second copy
        if name == "ddp":
            opt = torch.optim.AdamW(model.parameters(), fused=True, **OPT)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **OPT)

    def step(x, y):
        opt.zero_grad(set_to_none=True)  # first, so that held() after a step sees the grads
        with amp:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step, lambda: (peer_held(model, opt), {}), None


# --------------------------------------------------------------------------- 2-rank jobs
def _rank_main(fn, rank, world, port, q, args):
    # CPU ranks even on a GPU machine: zero.init_distributed then picks gloo, and the tables compare like with like
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)  # one core per rank
    try:
        if zero is not None:
            zero.init_distributed(timeout_s=120)
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        out = fn(rank, world, *args)
        if rank == 0:
            q.put(("ok", out))
        dist.barrier()
    except BaseException:
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    q.close()
    q.join_thread()
    os._exit(0)  # skip gloo's teardown, which now and then aborts at exit


def spawn(fn, world, args, timeout):
    """fn(rank, world, *args) on `world` gloo processes on 127.0.0.1 -> rank 0's result, or raise."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a free port
        port = s.getsockname()[1]
    ctx = mp.get_context("forkserver")     # fresh ranks forked from a server that imported torch and this file once
    ctx.set_forkserver_preload(["__main__"])
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank_main, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
    for p in ps:
        p.start()
    try:
        status, out = q.get(timeout=timeout)
    except queue.Empty:
        status, out = "error", f"no result within {timeout} s: a hang"
    for p in ps:
        p.join(10)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(out)
    return out


def agreed(fn, *a):
    """(fn(*a), None) or (None, error); the ranks agree, so that one failing variant skips on all."""
    try:
        out, err = fn(*a), None
    except Exception as e:
        out, err = None, f"{type(e).__name__}: {e}".splitlines()[0][:160]
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    err = next((e for e in errs if e), None)
    return (None, err) if err else (out, None)


def dist_job(rank, world, o):
    """Memory and traffic of one step of each variant, then interleaved throughput rounds."""
    res = {"mem": {}, "comm": {}, "tput": {}, "errors": {}}
    for name, dtype in o["mem_variants"]:
        def one():
            model = make_gpt(o["mem_preset"])
            step, held, comm = build(name, dtype, model, world)
            xy = batch(model, 1, rank)
            for _ in range(2):  # the second step shows the steady state
                step(*xy)
            return held(), comm() if comm else None
        r, err = agreed(one)
        res["mem"][name, dtype] = err or r[0]
        if r and r[1]:
            res["comm"][name, dtype] = r[1]
    runs = {}
    for name, dtype in o["tput_variants"]:
        model = make_gpt(o["tput_preset"], n_embd=o["tput_embd"])
        xy = batch(model, o["B"], rank)
        r, err = agreed(build, name, dtype, model, world)
        if not err:
            _, err = agreed(lambda: [r[0](*xy) for _ in range(o["warmup"])])
        if err:
            res["errors"][name, dtype] = err
        else:
            runs[name, dtype], res["tput"][name, dtype] = (r[0], xy), []
    keys, tokens = list(runs), world * o["B"] * o["T"]
    for rnd in range(o["rounds"] if keys else 0):
        for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:  # rotate: nobody always goes first
            step, xy = runs[k]
            dist.barrier()
            t = time.perf_counter()
            step(*xy)
            dist.barrier()
            res["tput"][k].append(tokens / (time.perf_counter() - t))
    return res


# --------------------------------------------------------------------------- tables
def table(header, rows):
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print()


def ratio(xs, ys):
    return statistics.median(a / b for a, b in zip(xs, ys))  # per round, then the median


def paper_formula(stage, psi, n, K=12):
    # the ZeRO paper: 2Ψ fp16 params + 2Ψ fp16 grads + KΨ fp32 master and Adam, each sharded by its stage
    return {0: (4 + K) * psi, 1: 4 * psi + K * psi / n, 2: 2 * psi + (2 + K) * psi / n, 3: (4 + K) * psi / n}[stage]


def report_memory(res, psi, world):
    print(f"### 1. Model-state memory per rank: default GPT ({psi / 1e6:.2f}M params), {world} ranks (MB = 1e6 B)\n")
    print("Measured after the second step. zero.py: engine.memory(); peers: their parameters', gradients' and "
          "optimizer states' storages, each counted once. `+off`: offload; host bytes in their own column.\n")
    rows = []
    for (name, dtype), m in res["mem"].items():
        if isinstance(m, str):
            rows.append([name, dtype, f"failed: {m}"] + [""] * 7)
            continue
        dev, host = m
        est = "—"
        if stage_of(name) is not None:
            e = zero.estimate_memory(psi, world, stage_of(name), dtype=dtype, offload=name.endswith("+off"),
                                     device="cpu")   # the gloo ranks' engines are on the CPU
            est = f"{sum(e['device'].values()) / MB:.2f} + {sum(e['host'].values()) / MB:.2f}"
        rows.append([name, dtype] + [f"{(dev.get(k, 0) + host.get(k, 0)) / MB:.2f}" for k in KINDS]
                    + [f"{sum(dev.values()) / MB:.2f}", f"{sum(host.values()) / MB:.2f}", est])
    table(["variant", "dtype"] + list(KINDS) + ["device", "host", "estimate device + host"], rows)
    print("The ZeRO paper's formula (zero.estimate_memory, fp16 + fp32 Adam, GB = 1e9 B), "
          "next to the paper's Figure 1 and (2+2+K)Ψ/N_d with K = 12:\n")
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    rows = []
    for s in range(4):
        e1, e2 = (sum(zero.estimate_memory(p, n, s)["device"].values()) / GB for p, n in ((7.5e9, 64), (1e12, 1024)))
        rows.append([s, f"{e1:.1f}", paper[s], f"{paper_formula(s, 7.5e9, 64) / GB:.1f}", f"{e2:,.1f}",
                     f"{paper_formula(s, 1e12, 1024) / GB:,.1f}"])
    table(["stage", "7.5B, 64 GPUs", "paper", "formula", "1T, 1024 GPUs", "formula"], rows)


def report_comm(res, psi, world):
    print(f"### 2. Communication per step and rank ({psi / 1e6:.2f}M params, {world} ranks, MB = 1e6 B)\n")
    print("engine.comm(): bytes this rank sends as ring algorithms count them (all-reduce 2M(N-1)/N, "
          "reduce-scatter and all-gather M(N-1)/N); `scalar` is the grad-norm all-reduce.\n")
    rows = []
    for (name, dtype), c in res["comm"].items():
        stage, item = stage_of(name), torch.finfo(getattr(torch, {"bf16": "bfloat16"}.get(dtype, "float32"))).bits // 8
        k = 3 if stage == 3 else 2
        want = k * psi * (world - 1) / world * item
        got = sum(v["bytes"] for kind, v in c.items() if kind not in ("d2h", "h2d", "between_steps"))
        host = [c.get(kind, {}).get("bytes", 0) / MB for kind in ("d2h", "h2d")]
        rows.append([name, dtype] + [f"{c.get(kind, {}).get('bytes', 0) / MB:.3f} ({c.get(kind, {}).get('calls', 0)})"
                                     for kind in ("all_reduce", "reduce_scatter", "all_gather", "scalar")]
                    + [f"{got / MB:.3f}", f"{k}Ψ(N-1)/N = {want / MB:.3f}", f"{got / want:.3f}",
                       f"{host[0]:.3f} / {host[1]:.3f}" if any(host) else "—"])
    table(["variant", "dtype", "all-reduce (calls)", "reduce-scatter", "all-gather", "scalar", "total", "formula",
           "total / formula", "offload: device→host / host→device"], rows)
    print("Offload moves each gradient shard to the host and the updated 16-bit shard back, in the compute dtype: "
          "Ψ/N elements each way per step (the ZeRO-Offload paper's minimum).\n")


def hybrid_job(rank, world, o):
    """One bf16 step of stage 3 over all ranks and in shard groups of 2: bytes per kind, memory."""
    out = {}
    for k in (0, 2):
        model = make_gpt(o["mem_preset"])
        eng = zero.Zero(model, zero.Config(stage=3, dtype="bf16", shard_group=k, **OPT))
        for _ in range(2):
            eng.backward(eng(*batch(model, 1, rank)))
            eng.step()
        out[k] = (eng.comm(), sum(eng.memory()["device"].values()), eng.num_params(padded=True))
    return out


class LoRA(torch.nn.Module):
    """A frozen nn.Linear with a trainable rank-r update, B A (as peft's LoRA)."""

    def __init__(self, base, r):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = torch.nn.Parameter(torch.randn(r, base.in_features) / base.in_features ** 0.5)
        self.B = torch.nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


def lora_gpt(preset, r=8):
    """train_gpt's GPT with rank-r adapters on every Linear of its blocks, the rest frozen (a LoRA fine-tune)."""
    model = make_gpt(preset).requires_grad_(False)
    for b in model.blocks:
        for parent in list(b.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, LoRA(child, r))
    return model


def lora_job(rank, world, o):
    """Model states per rank of a LoRA fine-tune at stage 3, after two bf16 steps."""
    out = {}
    for name, extra in (("zero3", {}), ("zero3", dict(frozen_dtype="fp32")), ("fsdp2", {})):
        model = lora_gpt(o["mem_preset"])
        step, held, _ = build(name, "bf16", model, world, **extra)
        xy = batch(model, 1, rank)
        for _ in range(2):
            step(*xy)
        out[name + (" frozen_dtype=fp32" if extra else "")] = held()[0]
        out["psi"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return out


def report_lora(res, psi_f, world):
    psi = res.pop("psi")
    print(f"### 1b. A LoRA fine-tune at stage 3: the default GPT with rank-8 adapters on every Linear of its blocks "
          f"({psi / 1e3:.1f}K trainable, {psi_f / 1e6:.2f}M frozen parameters), {world} ranks, bf16 (MB = 1e6 B)\n")
    print("Counted the same way for both, from the storages after two steps: FSDP2 `fully_shard` per block keeps "
          "every sharded parameter in fp32 (MixedPrecisionPolicy(param_dtype=bf16) casts when gathering); zero.py "
          "holds the frozen base in bf16, or exactly in fp32 with frozen_dtype='fp32'.\n")
    rows = [[name] + [f"{m.get(k, 0) / MB:.3f}" for k in KINDS + ("frozen",)] + [f"{sum(m.values()) / MB:.3f}"]
            for name, m in res.items()]
    table(["variant"] + list(KINDS) + ["frozen", "total"], rows)
    est = zero.estimate_memory(psi, world, 3, "bf16", frozen_params=psi_f)["device"]
    print(f"Formula, zero.estimate_memory(frozen_params=...): {sum(est.values()) / MB:.3f} MB (frozen "
          f"{est['frozen'] / MB:.3f}). 30B frozen + 40M trainable on 8 GPUs: "
          f"{sum(zero.estimate_memory(4e7, 8, 3, 'bf16', frozen_params=3e10)['device'].values()) / GB:.1f} GB per "
          f"GPU at stage 3, {sum(zero.estimate_memory(4e7, 8, 2, 'bf16', frozen_params=3e10)['device'].values()) / GB:.1f}"
          " GB at stage 2 (the base whole on every GPU).\n")


def report_hybrid(res, psi, world):
    print(f"### 2b. Hybrid sharding: stage 3, bf16, {world} ranks as 2 groups of 2 vs one group of {world} "
          f"({psi / 1e6:.2f}M params, MB = 1e6 B)\n")
    print("Per step and rank, from engine.comm(). Inside: the all-gathers and reduce-scatters, which stay in the "
          "shard group (a node); across: the all-reduce of the reduced shard among the ranks holding it, once "
          "per step. Formula: inside (3Ψ - Ψ_root)(k-1)/k, across 2(Ψ/k)(R-1)/R elements, R = N/k replicas.\n")
    rows = []
    for k, (c, mem, padded) in res.items():
        n = k or world
        inside = sum(c.get(x, {}).get("bytes", 0) for x in ("all_gather", "reduce_scatter"))
        across = c.get("replica_all_reduce", {}).get("bytes", 0)
        reps = world // n
        f_across = 2 * padded / n * (reps - 1) / reps * 2
        rows.append([f"shard_group={k or world}" + (" (all ranks)" if not k else ""), f"{inside / MB:.3f}",
                     f"{across / MB:.3f}", f"{f_across / MB:.3f}", f"{mem / MB:.2f}",
                     f"{sum(zero.estimate_memory(padded, world, 3, 'bf16', shard_group=k)['device'].values()) / MB:.2f}"])
    table(["variant", "inside the group", "across groups", "across: formula", "memory/rank", "formula"], rows)
    print("7.5B parameters on 64 GPUs, 8 per node, fp16 (zero.estimate_memory; traffic per step and rank, GB = 1e9 "
          "B): plain stage 3 shards over all 64 ranks, so every collective crosses nodes; shard groups of 8 keep "
          "the all-gathers and reduce-scatters inside a node and send only the shard's all-reduce across.\n")
    p, n, k = 7.5e9, 64, 8
    rows = []
    for name, g in (("stage 3, shard_group=0 (all 64)", 0), ("stage 3, shard_group=8 (a node)", k)):
        m = sum(zero.estimate_memory(p, n, 3, "fp16", shard_group=g)["device"].values()) / GB
        size = g or n
        inside = 3 * p * (size - 1) / size * 2 / GB
        across = 2 * p / size * (n // size - 1) / (n // size) * 2 / GB if g else inside
        rows.append([name, f"{m:.1f}", f"{inside:.1f}" if g else "—", f"{across:.1f}"])
    table(["7.5B / 64 GPUs", "model states per rank (GB)", "inside a node (GB)", "across nodes (GB)"], rows)


# the engine's collectives and host syncs, counted at their outermost call (zero's aliases are bound at its import)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce_coalesced", "broadcast", "reduce",
               "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "new_group")
SYNCS = [(torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.cuda, "synchronize"),
         (torch.cuda.Event, "synchronize")]
OVERHEAD_CASES = [(s, 1) for s in range(4)] + [(3, 2)]    # (stage, accum_steps)


def overhead_job(rank, world, o):
    """Per optimizer step of each (stage, accum): the engine's collectives (data: a unit's all-gather or
    reduce-scatter, stage 0's all-reduce of a unit's gradient; the rest overhead), its host syncs, the time."""
    st, count = dict(on=False, measure=False, depth=0, padded=set()), collections.Counter()

    def counted(f, name):
        def call(*a, **k):
            if st["on"] and not st["depth"]:       # the outermost call, made while the engine runs
                data = any(w in name for w in ("all_gather", "reduce_scatter", "all_reduce")) and any(
                    torch.is_tensor(t) and t.is_floating_point() and t.numel() in st["padded"] for t in a[:2])
                count["sync" if name in ("tolist", "item", "synchronize") else "data" if data else "other"] += 1
            st["depth"] += 1
            try:
                return f(*a, **k)
            finally:
                st["depth"] -= 1
        return call

    def engine(fn, *a):                             # only the engine's calls count, not the script's own
        st["on"] = st["measure"]
        try:
            return fn(*a)
        finally:
            st["on"] = False

    def one(stage, accum):
        model = make_gpt(o["tput_preset"], n_embd=o["tput_embd"], block_size=o["oh_T"])
        eng = zero.Zero(model, zero.Config(stage=stage, dtype="fp32", accum_steps=accum, **OPT))
        xy, times = batch(model, o["oh_B"], rank), []
        st["padded"] = {f.padded for u in eng.units for f in u.flats}     # (frozen flats too)
        count.clear()
        for i in range(5):                          # 2 warm-up steps, 3 measured
            st["measure"] = i >= 2
            dist.barrier()
            t = time.perf_counter()
            for _ in range(accum):
                loss = engine(eng, *xy)
                engine(eng.backward, loss)
            engine(eng.step)
            loss.item()                             # the script's own sync: not counted
            times.append(time.perf_counter() - t)
        return {k: count[k] / 3 for k in ("other", "sync", "data")}, statistics.median(times[2:]) * 1e3

    out = {}
    targets = [(dist, n) for n in COLLECTIVES if hasattr(dist, n)] + SYNCS + \
        [(zero, n) for n in ("_all_gather", "_reduce_scatter", "_all_reduce", "_broadcast")]
    with ExitStack() as stack:
        for obj, n in targets:
            stack.enter_context(mock.patch.object(obj, n, counted(getattr(obj, n), n)))
        for case in OVERHEAD_CASES:
            r, err = agreed(one, *case)
            every = [None] * world
            dist.all_gather_object(every, r and r[0])
            out[case] = err or (r[0], r[1], all(e == r[0] for e in every))
    return out


def report_overhead(res, o):
    print(f"### 2c. The engine's own per-step overhead: tiny GPT n_embd={o['tput_embd']} with "
          f"block_size={o['oh_T']}, fp32, {o['oh_B']} x {o['oh_T']} tokens per rank, gloo ranks x 1 thread\n")
    print("Per optimizer step and rank, the mean of 3 steps after 2 warm-up steps, counted while the engine's "
          "forward, backward and step run (not the script's barriers and loss.item()): `data` are a unit's "
          "all-gathers and reduce-scatters and stage 0's all-reduces of a unit's gradient (a float tensor of a "
          "unit's padded size); "
          "`other collectives` every other outermost call of torch.distributed's functions or zero's aliases; "
          "`host syncs` the calls of Tensor.tolist, Tensor.item, torch.cuda.synchronize and Event.synchronize. "
          f"Step time: rank 0's median, the ranks sharing {os.cpu_count()} cores.\n")
    rows = []
    for n, cases in res.items():
        for (stage, accum), r in cases.items():
            if isinstance(r, str):
                rows.append([n, stage, accum, f"failed: {r}", "", "", "", ""])
                continue
            c, ms, same = r
            rows.append([n, stage, accum, f"{c['other']:g}", f"{c['sync']:g}", f"{c['data']:g}", f"{ms:.1f}",
                         "yes" if same else "NO"])
    table(["ranks", "stage", "accum_steps", "other collectives", "host syncs", "data collectives", "step ms",
           "counts equal on all ranks"], rows)
    ms = lambda x: f"{x:.2f}" if x < 1 else f"{x:,.0f}"      # noqa: E731
    lat = lambda hops: f"{ms(hops * 0.01)}-{ms(hops * 0.05)} ms"   # noqa: E731  hops of 10-50 µs
    big = (512, 4096)
    print("At scale, latency only, a hop 10-50 µs: the previous engine's rendezvous, an all-gather (a ring: N-1 "
          "hops) on a gloo control group at every forward, backward and step, 2·accum+1 per step at stage 3, cost "
          + "; ".join(f"N={n}: {lat(3 * (n - 1))} per step at accum 1, {lat(5 * (n - 1))} at accum 2" for n in big)
          + ". The one fp64 all-reduce now, assuming recursive doubling (log2 N hops): "
          + ", ".join(f"N={n}: {lat(n.bit_length() - 1)}" for n in big) + "; assuming a ring (2(N-1) hops): "
          + ", ".join(f"N={n}: {lat(2 * (n - 1))}" for n in big) + " per step, at any accum.\n")


def report_tput(res, o):
    print(f"### 3. Throughput: tiny GPT n_embd={o['tput_embd']} ({o['tput_psi'] / 1e6:.1f}M params), 2 gloo ranks "
          f"x 1 thread, {o['B']} seqs x {o['T']} tokens per rank\n")
    print(f"{o['rounds']} interleaved rounds of one step each, after {o['warmup']} warm-up steps. x DDP: the median of "
          "per-round ratios to DDP of the same dtype. bf16 peers: DDP and ZeRO-opt under autocast, FSDP2 with "
          "MixedPrecisionPolicy(param_dtype=bf16). Targets are judged on the median.\n")
    t = res["tput"]
    rows = [[n, d, f"{statistics.median(v):,.0f}", f"{ratio(v, t[('ddp', d)]):.2f}" if ("ddp", d) in t else "—"]
            for (n, d), v in t.items()] + [[n, d, f"failed: {e}", ""] for (n, d), e in res["errors"].items()]
    table(["variant", "dtype", "tokens/s (median)", "x DDP"], rows)
    rows = []
    targets = TARGETS + BASE_TARGETS * (("base0", "fp32") in t)      # with --baseline: this engine vs the other
    for (ours, base, want), d in ((tg, d) for tg in targets for d in ("fp32", "bf16")):
        if (ours, d) not in t or (base, d) not in t:
            rows.append([f"{ours} / {base}", d, "—", "", "", f">= {want}", "not measured"])
            continue
        r, each = ratio(t[ours, d], t[base, d]), [a / b for a, b in zip(t[ours, d], t[base, d])]  # noqa
        rows.append([f"{ours} / {base}", d, f"{r:.2f}", f"{min(each):.2f}-{max(each):.2f}",
                     f"{max(t[ours, d]) / max(t[base, d]):.2f}", f">= {want}", "met" if r >= want else "MISSED"])
    table(["tokens/s", "dtype", "median ratio", "range over rounds", "best / best", "target", ""], rows)


# --------------------------------------------------------------------------- one process: Adam, activations, offload
def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleave(fns, rounds):
    """{label: [seconds per call]} over rounds, each round in a rotated order, after one warm-up call."""
    for f in fns.values():
        f()
    times, keys = {k: [] for k in fns}, list(fns)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(timed(fns[k]))
    return times


def bandwidth():
    """The best of three streaming kernels over 512 MB tensors, in bytes read + written per second."""
    a, b, c = torch.ones(1 << 27), torch.ones(1 << 27), torch.empty(1 << 27)
    kernels = {"copy": (lambda: c.copy_(a), 2), "sum": (lambda: a.sum(), 1), "add": (lambda: torch.add(a, b, out=c), 3)}
    return max(k * a.nbytes / min(timed(f) for _ in range(5)) for f, k in kernels.values())


def deepspeed_adam(params):
    if importlib.util.find_spec("deepspeed") is None:  # measured when present, never needed
        return "not installed"
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, adamw_mode=True, **OPT).step
    except Exception as e:
        return f"failed: {type(e).__name__}: {e}".splitlines()[0][:120]


FUSED = "torch.optim.AdamW(fused=True)"


def report_adam(sizes, rounds):
    bw = bandwidth()
    print(f"### 4a. CPU AdamW params/s, one process, {torch.get_num_threads()} threads, fp32 master and moments\n")
    print(f"Best of {rounds} interleaved rounds (another process can only slow a round down); x fused, x DeepSpeed: "
          "best over best. GB/s: the bytes an update must read and write (28 per param with an fp32 grad, +2 "
          "writing a 16-bit copy, -2 reading a 16-bit grad; a separate copy pass reads the master again, +4) per "
          f"second; the best streaming kernel here (copy, sum, add over 512 MB) moves {bw / GB:.0f} GB/s. "
          "zero.adamw_step is one pass of zero's C kernel (what ZeRO-Offload's host update runs); `torch fused + "
          "copy` is zero's path without a C compiler (and before it had one); DeepSpeed's offload runs its CPU "
          "Adam and then copies the 16-bit weights in a separate pass.\n")
    rows = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = torch.randn(n) * 1e-3
        fns, traffic = {}, {}
        for kind in ("foreach", "fused"):
            label = FUSED.replace("fused", kind)
            fns[label], traffic[label] = torch.optim.AdamW([p], **{kind: True}, **OPT).step, 28
        if zero is not None:
            m, v, out, g16 = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16), p.grad.bfloat16()
            args = OPT["lr"], *OPT["betas"], OPT["eps"], OPT["weight_decay"]
            for label, g, o, nbytes in (("", p.grad, None, 28), (", out=bf16", p.grad, out, 30),
                                        (", bf16 grad, out=bf16", g16, out, 28)):
                fns[f"zero.adamw_step{label}"] = lambda g=g, o=o, w=p.data: zero.adamw_step(w, g, m, v, [(0, n, *args, 10)], out=o)
                traffic[f"zero.adamw_step{label}"] = nbytes
            for label, g, nbytes in ((", out=bf16", p.grad, 34), (", bf16 grad, out=bf16", g16, 32)):
                fns[f"torch fused + copy{label}"] = lambda g=g, w=p.data: zero._torch_adamw(
                    w, g, m, v, [(0, n, *args, 10)], 1.0, out)
                traffic[f"torch fused + copy{label}"] = nbytes
        ds = deepspeed_adam([p])
        if callable(ds):
            fns["DeepSpeedCPUAdam"], traffic["DeepSpeedCPUAdam"] = ds, 28
            copy = torch.empty(n, dtype=torch.bfloat16)
            fns["DeepSpeedCPUAdam + its bf16 copy"] = lambda: (ds(), copy.copy_(p.data))
            traffic["DeepSpeedCPUAdam + its bf16 copy"] = 34
        times = interleave(fns, rounds)
        for k, ts in times.items():
            rate = n / min(ts)
            rows.append([f"{n / 1e6:.0f}M", k, f"{rate / 1e9:.2f}", f"{min(times[FUSED]) / min(ts):.2f}",
                         f"{min(times['DeepSpeedCPUAdam']) / min(ts):.2f}" if callable(ds) else "—",
                         f"{rate * traffic[k] / GB:.0f}"])
        if not callable(ds):
            rows.append([f"{n / 1e6:.0f}M", "DeepSpeedCPUAdam", ds, "", "", ""])
        if zero is None:
            rows.append([f"{n / 1e6:.0f}M", "zero.adamw_step", f"import zero failed: {ZERO_ERR}", "", "", ""])
        del p, fns
    table(["params", "optimizer", "G params/s", "x fused", "x DeepSpeed", "GB/s"], rows)
    if zero is not None and zero._cpu_kernel() is not None:   # its first build, then a later run's load
        saved = os.environ.get("XDG_CACHE_HOME")
        with tempfile.TemporaryDirectory() as cache:
            os.environ["XDG_CACHE_HOME"] = cache
            build, load = timed(zero._build_kernel), timed(zero._build_kernel)
        os.environ.pop("XDG_CACHE_HOME") if saved is None else os.environ.update(XDG_CACHE_HOME=saved)
        print(f"zero's C kernel: built in {build:.2f} s on first use, loaded from the cache in {load * 1e3:.0f} ms "
              "by later runs.\n")


def saved_for_backward(eng, x, y):
    """Bytes autograd keeps from one forward for the backward: tensors saved by autograd plus the unit
    inputs that recompute holds on to, each storage once; the weights themselves are not counted."""
    seen, kept = {p.untyped_storage().data_ptr() for p in eng.module.parameters()}, []
    keep = lambda t: kept.append(storage_bytes([t], seen)) or t  # noqa: E731
    hooks = [b.register_forward_pre_hook(lambda m, args: kept.append(storage_bytes(args[:1], seen)))
             for b in eng.module.blocks]  # append returns None: the hook leaves the inputs alone
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = eng(x, y)
    for h in hooks:
        h.remove()
    eng.backward(loss)
    eng.step()
    return sum(kept)


def report_activations(o):
    print(f"### 4b. Activation memory, 8 blocks of n_embd={o['tput_embd']}, {o['B']} x {o['T']} tokens, bf16, "
          "one process\n")
    if zero is None:
        return print(f"not measured: import zero failed: {ZERO_ERR}\n")
    rows, steps, base = [], {}, None
    for ck in (False, 2, True):
        model = make_gpt(o["tput_preset"], n_embd=o["tput_embd"], n_layer=8)
        eng = zero.Zero(model, zero.Config(stage=0, dtype="bf16", checkpoint=ck, **OPT))
        xy = tuple(t.to(eng.device) for t in batch(model, o["B"], 0))   # (one process: CUDA where there is one)
        saved = saved_for_backward(eng, *xy)
        base = base or saved
        rows.append([f"checkpoint={ck}", f"{saved / MB:.1f}", f"{saved / base:.2f}"])
        steps[ck] = lambda eng=eng, xy=xy: (eng.backward(eng(*xy)), eng.step())
    times = interleave(steps, o["rounds"])
    for r, ck in zip(rows, steps):
        r.append(f"{ratio(times[ck], times[False]):.2f}")
    table(["Config", "saved for backward (MB)", "x no recompute", "step time x no recompute"], rows)


def report_offload(o):
    print(f"### 4c. Offload: the host update behind the next forward (stage 2, bf16, tiny GPT n_embd="
          f"{o['tput_embd']}, {o['off_B']} x {o['T']} tokens, one process, 1 thread + the update's thread)\n")
    if zero is None:
        return print(f"not measured: import zero failed: {ZERO_ERR}\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the caller's thread plays the GPU; the update's thread gets the other core
    engines, xy = {}, None
    for off in (False, True):
        model = make_gpt(o["tput_preset"], n_embd=o["tput_embd"])
        engines[off] = zero.Zero(model, zero.Config(stage=2, dtype="bf16", offload=off, **OPT))
        xy = tuple(t.to(engines[off].device) for t in batch(model, o["off_B"], 0))
    parts = ("forward", "backward", "step", "iteration")
    t = {(off, part): [] for off in engines for part in parts}
    for r in range(o["rounds"] + 1):  # round 0 warms up
        for off, eng in engines.items():
            for i in range(3):  # the first iteration starts with no update pending: not counted
                t0 = time.perf_counter()
                loss = eng(*xy)
                t1 = time.perf_counter()
                eng.backward(loss)
                t2 = time.perf_counter()
                eng.step()
                for part, dt in zip(parts, (t1 - t0, t2 - t1, time.perf_counter() - t2, time.perf_counter() - t0)):
                    t[off, part] += [dt] if r and i else []
    torch.set_num_threads(threads)
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    rows = [[f"offload={off}"] + [f"{med[off, part]:.1f}" for part in parts] for off in engines]
    table(["Config", "forward ms", "backward ms (waits for the update)", "step() ms as the caller sees it",
           "iteration ms"], rows)
    update = med[False, "step"]  # the same AdamW and gather, run in step() by the caller
    saved = med[False, "iteration"] - med[True, "iteration"]
    print(f"The update's own time (step() without offload): {update:.1f} ms. With offload step() returns in "
          f"{med[True, 'step']:.1f} ms and the iteration is {saved:+.1f} ms shorter: {saved / update:.0%} of the "
          "update is hidden behind the next forward and backward (below 0: the overlap cost more than it hid).\n")


# --------------------------------------------------------------------------- rules written in torch ops, on the host
def adamw_ops(master, grad, state, group, step):
    """AdamW as a rule's one function in torch ops (torch's formulas): what the C kernel computes."""
    beta1, beta2 = group["betas"]
    master.mul_(1 - group["lr"] * group["weight_decay"])
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
    master.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


def ademamix_ops(master, grad, state, group, step):
    """AdEMAMix (Pagliardini et al., 2024) as test_zero.py writes it: three states."""
    beta1, beta2, beta3 = group["betas"]
    state["m1"].lerp_(grad, 1 - beta1)
    state["m2"].lerp_(grad, 1 - beta3)
    state["nu"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["nu"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
    master.mul_(1 - group["lr"] * group["weight_decay"])
    master.addcdiv_(state["m1"] / (1 - beta1 ** step) + group["alpha"] * state["m2"], denom, value=-group["lr"])


def block_runs(n_embd):
    """The runs (a, b, group, step) of a GPT block's Flat at one rank: its parameters in order, each on 8 elements
    (bf16's 16 bytes), weights (decay, group 0) and biases/norms (group 1) alternating, adjacent ones merged."""
    runs, end = [], 0
    for p in train_gpt.Block(n_embd // 64, n_embd, 12).parameters():
        a, j = -(-end // 8) * 8, int(p.dim() < 2)
        end = a + p.numel()
        if runs and runs[-1][1] == a and runs[-1][2] == j:
            runs[-1] = (runs[-1][0], end, j, 10)
        else:
            runs.append((a, end, j, 10))
    return runs


def op_by_op(f, runs, groups, mult, out):
    """zero._elementwise's path without the compile: the rule's torch ops one by one, run by run."""
    for a, b, j, step in runs:
        state = {k: f.state[k][a:b] for k in f.rule.states}
        zero._run(f.rule.step, f.state["master"][a:b], f.grad_shard[a:b], state, groups[j], step, mult, out[a:b])


def report_rules(quick):
    """Offload's host update of an elementwise rule written in torch ops (zero._elementwise) next to the C AdamW
    kernel (zero._adamw), on offload's worker thread (its thread count), a bf16 gradient and a bf16 out."""
    if zero is None:
        return print(f"### 4d. Update rules written in torch ops: not measured: import zero failed: {ZERO_ERR}\n")
    worker = zero.HostWorker(torch.device("cpu"), 600)
    adamw = zero.Rule("adamw_ops", ("exp_avg", "exp_avg_sq"), zero.RULES["adamw"].keys, None, step=adamw_ops)
    ademamix = zero.Rule("ademamix", ("m1", "m2", "nu"), ("lr", "betas", "alpha", "eps", "weight_decay"), None,
                         step=ademamix_ops)
    # label: (rule, how it runs)
    variants = {"C AdamW kernel": (zero.RULES["adamw"], zero._adamw),
                "AdamW in torch ops, compiled": (adamw, zero._elementwise),
                "AdEMAMix, compiled": (ademamix, zero._elementwise), "AdEMAMix, op by op": (ademamix, op_by_op)}
    groups = [dict(OPT, betas=(0.9, 0.95, 0.999), alpha=5.0), dict(OPT, betas=(0.9, 0.95, 0.999), alpha=5.0,
                                                                   weight_decay=0.0)]
    adamw_groups = [dict(g, betas=g["betas"][:2]) for g in groups]
    cases = {"1M, one run": [(0, 1 << 20, 0, 10)], "16M, one run": [(0, 1 << 24, 0, 10)],
             "7.1M, GPT-2 block's 9 runs": block_runs(768)}
    rounds = 9
    if quick:
        cases, rounds = {"1M, one run": cases["1M, one run"]}, 2
    print(f"### 4d. Update rules written in torch ops on offload's host thread ({zero._host_threads()} threads)\n")
    print("zero._elementwise runs an elementwise rule's one function compiled (torch.compile; the rule's 0-dim "
          f"arithmetic apart) on runs of >= {zero.MIN_COMPILED} elements, op by op on shorter ones; AdamW's table "
          "entry keeps the C kernel. fp32 master and states, a bf16 gradient times a multiplier, a bf16 out (28 "
          "bytes a parameter for AdamW, 36 for AdEMAMix's three states). Best of "
          f"{rounds} interleaved rounds (another process can only slow a round down); x C: best over the C "
          "kernel's best. First call: the first update, its compile included (the first in this process at 1M; "
          "inductor's disk cache may hold an earlier run's kernels).\n")
    rows = []
    for case, runs in cases.items():
        n = max(b for _, b, _, _ in runs)
        fns, first = {}, {}
        for label, (rule, update) in variants.items():
            g0 = torch.Generator().manual_seed(0)
            state = {k: torch.randn(n, generator=g0).abs_() * 1e-3 for k in rule.states}
            state["master"] = torch.randn(n, generator=g0)
            f = types.SimpleNamespace(rule=rule, state=state, grad_shard=torch.randn(n, generator=g0).bfloat16())
            gs = groups
            if "AdamW" in label:
                gs = adamw_groups
            job = functools.partial(update, f, runs, gs, 0.5, torch.empty(n, dtype=torch.bfloat16))
            fns[label] = lambda job=job: worker.submit(job).result()
            first[label] = timed(fns[label])
        times = interleave(fns, rounds)
        for label in variants:
            best = min(times[label])
            rows.append([case, label, f"{best * 1e3:.2f}", f"{best / min(times['C AdamW kernel']):.2f}",
                         f"{first[label]:.2f} s"])
    worker.close()
    table(["params", "update", "ms", "x C", "first call"], rows)


# --------------------------------------------------------------------------- GPU (not run on CPU machines)
# The section's measurements are functions of a device and sizes, so that the suite runs them on the CPU with a
# tiny GPT (test_bench_gpu_section_on_cpu): report_gpu calls them with CUDA, a real meter and real sizes.
GPU_BASE = "torch"  # a plain torch loop, no engine: every ratio of the section is against it
SEARCHED = ("torch", "zero3", "zero3+off")  # the largest GPT each trains (ZeRO-Offload's headline)
HOST_SHARE = 0.7  # of the host's memory, offload's state may take: the rest for the process (CUDA, torch), the OS


def free_memory(device):
    """What the last variant left: its cycles collected, and the GPU's cache returned (for the next one)."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device):
    if device.type == "cuda":  # a step's kernels are queued: the clock waits for them
        torch.cuda.synchronize(device)


class CudaMeter:
    """Peak bytes allocated on the GPU between start() and peak(): what one variant built and ran, the
    variants built before it (alive, unchanged meanwhile) not counted."""

    def __init__(self, device):
        self.device = device  # the GPU measured
        self.base = 0  # bytes allocated at start()

    def start(self):
        free_memory(self.device)
        sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak(self, model):  # (the model: for a meter that counts it instead, as the CPU test's do)
        sync(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


class one_rank_group:
    """A process group of this process alone, for `with`: FSDP2 needs one, and the engines made inside use it
    too, so every variant runs on the same backend (NCCL on a GPU, gloo on the CPU). A group made before is
    used as it is."""

    def __init__(self, device):
        self.device = device  # where the variants run
        self.made = False  # whether this made the group (and destroys it at exit)

    def __enter__(self):
        if not dist.is_initialized():
            backend = "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # before NCCL starts
                backend = "nccl"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self.made = True
        return self

    def __exit__(self, *exc):
        if self.made:
            dist.destroy_process_group()


def flops_per_token(model):
    # train_gpt.py's count: 6 per parameter but the position embedding's (forward and backward), plus attention
    L, C, T = len(model.blocks), model.wte.weight.shape[1], model.block_size
    return 6 * (numel(model) - model.wpe.weight.numel()) + 12 * L * C * T


def one_gpu_step(name, model, device, dtype="bf16"):
    """`model` trained on `device` by one process: "torch" (torch's fused AdamW under bf16 autocast, no engine),
    "fsdp2" (fully_shard per block and on the root, in the process group), zero.py's zero0 .. zero3 ("+off":
    offload). A meta model is made real by the engine. -> step(x, y) returning the loss, not synced."""
    if stage_of(name) is not None:
        cfg = zero.Config(stage=stage_of(name), dtype=dtype, offload=name.endswith("+off"), **OPT)
        eng = zero.Zero(model, cfg, init_fn=train_gpt.init_weights)

        def step(x, y):
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            return loss.detach()
        return step
    if dtype != "bf16":
        raise ValueError(f"{name} runs in bf16 here (fp16 would need a GradScaler), not {dtype}")
    amp = torch.autocast(device.type, torch.bfloat16)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:     # torch 2.4 has FSDP2 under its first, private name
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (1,))
        # reductions in bf16, as zero's reduce_dtype="" (the compute dtype) does
        mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for b in model.blocks:  # the same units as zero.py's
            fully_shard(b, mesh=mesh, mp_policy=mpp)
        fully_shard(model, mesh=mesh, mp_policy=mpp)  # (moves the model to the mesh's device)
        amp = nullcontext()
    elif name == "torch":
        model.to(device)
    else:
        raise ValueError(f"unknown variant {name!r}")
    opt = torch.optim.AdamW(model.parameters(), fused=True, **OPT)

    def step(x, y):
        opt.zero_grad(set_to_none=True)  # first: the grads stay held between steps, as in a training loop
        with amp:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()
    return step


def gpu_speed(device, variants, make_model, B, warmup, rounds, steps, meter):
    """Each (name, dtype) of `variants` built from make_model() and warmed up alone (`meter` measures its peak
    memory over the two), then all of them timed in interleaved rounds of `steps` steps each (a rotating order),
    the built ones kept alive. -> {(name, dtype): dict(tok_s per round, peak bytes, flops per token, losses:
    warm-up and timed, in order)}, or an error string for a variant that failed."""
    out, runs = {}, {}
    for name, dtype in variants:
        model = step = xy = None  # a failed variant's, gone before the next one is measured
        try:
            meter.start()
            model = make_model()
            flops = flops_per_token(model)
            step = one_gpu_step(name, model, device, dtype)
            xy = tuple(t.to(device) for t in batch(model, B, 0))
            losses = [step(*xy) for _ in range(warmup)]
            out[name, dtype] = dict(tok_s=[], peak=meter.peak(model), flops=flops, losses=losses)
            runs[name, dtype] = step, xy, B * model.block_size * steps
        except Exception as e:  # reported in its row; the others still run
            out[name, dtype] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    keys = list(runs)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate: nobody always goes first
            step, xy, tokens = runs[k]
            sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                out[k]["losses"].append(step(*xy))
            sync(device)
            out[k]["tok_s"].append(tokens / (time.perf_counter() - t))
    for k in keys:
        out[k]["losses"] = [float(v) for v in out[k]["losses"]]  # read after the clock: no sync in the rounds
    return out


def gpu_speed_rows(res, peak_flops):
    """Table rows of gpu_speed's result: tokens/s (median), x torch (the median of per-round ratios), MFU, peak
    memory and x torch, the loss at the first and the last step."""
    base = res.get((GPU_BASE, "bf16"))
    rows = []
    for (name, dtype), r in res.items():
        if isinstance(r, str):
            rows.append([name, dtype, f"failed: {r}", "", "", "", "", ""])
            continue
        speed = mem = "—"
        if isinstance(base, dict):
            speed = f"{ratio(r['tok_s'], base['tok_s']):.2f}"
            mem = f"{r['peak'] / base['peak']:.2f}"
        mfu = "— (peak unknown)"
        if peak_flops:
            mfu = f"{r['flops'] * statistics.median(r['tok_s']) / peak_flops:.1%}"
        rows.append([name, dtype, f"{statistics.median(r['tok_s']):,.0f}", speed, mfu, f"{r['peak'] / GB:.2f}",
                     mem, f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}"])
    return rows


def search_gpt(shape, n_layer, device):
    """train_gpt's GPT of `shape` with n_layer blocks, made on `device` (meta: shapes only, for an engine)."""
    torch.manual_seed(0)
    with torch.device(device):
        return train_gpt.GPT(VOCAB, n_layer=n_layer, **shape)


def is_oom(e):
    # the allocator's error, or a library's (cuBLAS, NCCL) that failed to allocate
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    text = str(e)
    return isinstance(e, oom) or "out of memory" in text or "ALLOC_FAILED" in text


def try_train(name, n_layer, shape, device, steps, meter, host_budget, peaks):
    """None if `name` trains the GPT of n_layer blocks for `steps` steps (batch 1) on `device`, else why not:
    its host state (offload) over host_budget bytes, checked before anything is made, or out of memory.
    Records its peak (meter) in peaks[n_layer]. Everything it made is freed before it returns."""
    where = device
    if stage_of(name) is not None:  # the engine makes it real, unit by unit, on the GPU
        where = torch.device("meta")
    if name.endswith("+off"):
        psi = numel(search_gpt(shape, n_layer, "meta"))
        need = sum(zero.estimate_memory(psi, 1, 3, "bf16", offload=True, device=device.type)["host"].values())
        if need > host_budget:
            return f"host: {need / GB:.1f} GB > {host_budget / GB:.1f}"
    try:
        meter.start()
        model = search_gpt(shape, n_layer, where)
        step = one_gpu_step(name, model, device)
        xy = tuple(t.to(device) for t in batch(model, 1, 0))
        for _ in range(steps):
            loss = step(*xy)
        peaks[n_layer] = meter.peak(model)
        if not torch.isfinite(loss):
            return f"loss {float(loss)}"
        return None
    except Exception as e:
        if not is_oom(e):
            raise
        return "out of memory"
    finally:  # (the exception's frames, which held the tensors, are gone here)
        model = step = xy = loss = None
        free_memory(device)


def largest(fits, start, refine, limit=4096, deadline=float("inf")):
    """The largest n for which fits(n) is None (n layers trained), sizes being monotone: from `start` doubling
    while it fits (halving while it does not), then `refine` bisections between the largest n that fit and
    the smallest that did not. No new try after `deadline` (time.monotonic()) or above `limit`.
    -> (n, or 0 if none fit; {n: None or why not} of every try, in order)."""
    tried = {}

    def ok(n):
        tried[n] = fits(n)
        return tried[n] is None

    lo, hi = 0, None  # the largest n that fit, the smallest that did not
    if ok(start):
        lo = start
        while hi is None and 2 * lo <= limit and time.monotonic() < deadline:
            if ok(2 * lo):
                lo = 2 * lo
            else:
                hi = 2 * lo
    else:
        hi = start
        while lo == 0 and hi > 1 and time.monotonic() < deadline:
            if ok(hi // 2):
                lo = hi // 2
            else:
                hi = hi // 2
    for _ in range(refine):
        if not lo or hi is None or hi - lo < 2 or time.monotonic() >= deadline:
            break
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def gpu_largest(device, shape, start, refine, meter_of, host_budget, budget_s, steps=1):
    """largest() of each SEARCHED variant, each within budget_s seconds (a try begun is finished); offload's
    search starts from the largest the others trained. -> {name: (n, tried, peaks)}."""
    out = {}
    for name in SEARCHED:
        peaks = {}
        first = start
        if name.endswith("+off"):
            first = max([start] + [out[k][0] for k in out])
        fits = lambda n, name=name, peaks=peaks: try_train(  # noqa: E731
            name, n, shape, device, steps, meter_of(name), host_budget, peaks)
        n, tried = largest(fits, first, refine, deadline=time.monotonic() + budget_s)
        out[name] = (n, tried, peaks)
    return out


def gpu_largest_rows(res, shape):
    """Table rows of gpu_largest's result: the largest n_layer, its parameters and x torch's, its peak, the
    tries."""
    params = {name: numel(search_gpt(shape, n, "meta")) for name, (n, _, _) in res.items() if n}
    rows = []
    for name, (n, tried, peaks) in res.items():
        size = times = peak = "—"
        if n:
            size = f"{params[name] / 1e6:,.0f}M"
            peak = f"{peaks[n] / GB:.1f}"
        if n and GPU_BASE in params:
            times = f"{params[name] / params[GPU_BASE]:.2f}"
        tries = ", ".join(f"{k}: {why or 'ok'}" for k, why in tried.items())
        rows.append([name, n or "none", size, times, peak, tries])
    return rows


def report_gpu(quick):
    print("### 5. One GPU\n")
    if not torch.cuda.is_available() or zero is None:
        return print("skipped: " + ("no CUDA device" if zero else f"import zero failed: {ZERO_ERR}") + "\n")
    name, dev = torch.cuda.get_device_name(), torch.device("cuda", torch.cuda.current_device())
    peak = next((v for k, v in train_gpt.PEAK_FLOPS.items() if k in name), 0.0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"torch {torch.__version__} on {name}; the host update runs on {zero._host_threads()} threads "
          f"({cores} cores, LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE', 1)})\n")
    # the CUDA-only paths at world size 1: offload's pinned staging copy (a parameter without a gradient keeps its
    # value, also after load_state_dict) and the pinned host bytes against what memory() counts
    model = make_gpt("tiny")
    model.unused = torch.nn.Linear(8, 8)   # in the root unit, never gets a gradient
    eng = zero.Zero(model, zero.Config(stage=2, dtype="bf16", offload=True, **OPT))
    x, y = (t.to(dev) for t in batch(model, 2, 0))
    exact = []
    for s in range(4):
        if s == 2:
            sd = eng.full_state_dict()
            sd.update({k: torch.full_like(v, 0.25) for k, v in sd.items() if k.startswith("unused")})
            eng.load_state_dict(sd)
        eng.backward(eng(x, y))
        eng.step()
        eng.settle()
        exact.append(all(torch.equal(u.trains[0].owned.cpu(), u.trains[0].state["master"].to(torch.bfloat16))
                         for u in eng.units))
    unused = eng.full_state_dict()["unused.weight"]
    pinned = sum(eng.pinned_memory().values())
    host = sum(eng.memory()["host"].values())
    print(f"offload staging: 16-bit parameters equal the masters' rounding after each step {exact}; the never-"
          f"updated weight after load_state_dict: {'kept' if torch.all(unused == 0.25) else 'CHANGED'}; pinned "
          f"{pinned / MB:.3f} MB pinned, memory()['host'] {host / MB:.3f} MB\n")
    del eng, model, x, y
    free_memory(dev)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # the host's
    gpu_tables(dev, gpu_sizes(quick), CudaMeter(dev), lambda _: CudaMeter(dev), peak, memory)


def gpu_sizes(quick):
    """The GPU section's sizes: the gpt2 preset for speed; GPTs of n_embd 2048 for the largest-model search."""
    n_layer, n_head, n_embd, block_size = train_gpt.PRESETS["gpt2"]
    o = dict(speed_layers=n_layer, speed_shape=dict(n_head=n_head, n_embd=n_embd, block_size=block_size), B=8,
             warmup=2, rounds=10, steps=3, fp16=True, search_shape=dict(n_head=16, n_embd=2048, block_size=1024),
             start=8, refine=2, budget_s=90)
    if quick:  # gpu-check.sh gives bench.py --quick 150 s in all
        o.update(B=4, rounds=3, steps=2, fp16=False, start=32, refine=1, budget_s=30)
    return o


def gpu_tables(device, o, meter, meter_of, peak_flops, host_memory):
    """Tables 5a (speed and memory of plain torch, FSDP2 and zero's stages) and 5b (the largest GPT each of plain
    torch, zero3 and zero3 with offload trains) on `device`, of the sizes `o` (gpu_sizes), in a 1-rank group:
    peak memory by `meter` (5a) and meter_of(variant) (5b); offload's host state within HOST_SHARE of
    host_memory bytes. -> (gpu_speed's result, gpu_largest's)."""
    variants = [(GPU_BASE, "bf16"), ("fsdp2", "bf16")] + [(f"zero{s}", "bf16") for s in range(4)]
    if o["fp16"]:
        variants += [(f"zero{s}", "fp16") for s in range(4)]
    with one_rank_group(device):
        backend = dist.get_backend()
        t = time.time()
        make = lambda: search_gpt(o["speed_shape"], o["speed_layers"], "cpu")  # noqa: E731  (seed 0: the same)
        speed = gpu_speed(device, variants, make, o["B"], o["warmup"], o["rounds"], o["steps"], meter)
        psi = numel(search_gpt(o["speed_shape"], o["speed_layers"], "meta"))
        print(f"#### 5a. Speed and memory next to plain torch: GPT of {o['speed_layers']} x n_embd "
              f"{o['speed_shape']['n_embd']} ({psi / 1e6:.0f}M params), batch {o['B']} x "
              f"{o['speed_shape']['block_size']}, one process ({time.time() - t:.0f} s)\n")
        print(f"Each variant built and warmed up ({o['warmup']} steps) alone, then {o['rounds']} interleaved rounds "
              f"of {o['steps']} steps; x torch: the median of per-round ratios to plain torch (torch.optim.AdamW("
              "fused=True) under bf16 autocast, no engine). FSDP2: fully_shard per block and on the root, "
              f"MixedPrecisionPolicy(bf16, reduce bf16), in a 1-rank {backend} group, as zero's engines here. Peak: "
              "torch.cuda.max_memory_allocated over the build and warm-up, reset before each (GB = 1e9 B).\n")
        table(["variant", "dtype", "tokens/s", "x torch", "MFU", "peak GB", "x torch", "loss first → last"],
              gpu_speed_rows(speed, peak_flops))
        free_memory(device)
        # ZeRO-Offload's claim: the largest model one GPU trains; the host holds offload's 16 bytes a parameter
        shape = o["search_shape"]
        t = time.time()
        largest = gpu_largest(device, shape, o["start"], o["refine"], meter_of, HOST_SHARE * host_memory,
                              o["budget_s"])
        print(f"#### 5b. The largest GPT that trains on this device: n_embd {shape['n_embd']}, {shape['n_head']} "
              f"heads, {shape['block_size']} tokens, batch 1, bf16, one step, by n_layer ({time.time() - t:.0f} s)\n")
        print(f"From n_layer {o['start']} doubling until one does not train, then {o['refine']} bisection(s), "
              f"no new try after {o['budget_s']} s; offload's search starts where the others stopped. Offload's host "
              "state (zero.estimate_memory: grads, master, moments, the pinned staging copy) is checked first, "
              f"against {HOST_SHARE:.0%} of this host's {host_memory / GB:.0f} GB. x torch: by parameters. zero3: "
              "stage 3 at world size 1 (its gain is N ranks' sharding, so about torch's here); zero3+off: with "
              "offload=True.\n")
        table(["variant", "largest n_layer", "params", "x torch", "peak GB", "tries (n_layer: result)"],
              gpu_largest_rows(largest, shape))
    return speed, largest


# --------------------------------------------------------------------------- matrix rules: Muon's traffic and balance
def nanochat_bytes(muon_shapes, adamw_sizes, n, item):
    """Bytes per step and rank that nanochat's MuonAdamW layout moves for these parameters, counted as engine.comm()
    counts a ring: each Muon group of K same-shape matrices stacked, padded to a multiple of n, reduce-scattered so
    each rank owns whole matrices and all-gathered after (each matrix crosses twice); AdamW's reduce-scattered and
    all-gathered (under 1024 elements: all-reduced, the same bytes)."""
    b = 0.0
    for shape, k in collections.Counter(muon_shapes).items():
        b += 2 * -(-k // n) * n * shape.numel() * (n - 1) / n * item
    for size in adamw_sizes:
        b += 2 * size * (n - 1) / n * item
    return b


def muon_job(rank, world, o):
    """Per step and rank, Muon (update='muon') beside AdamW on the same GPT at stages 1-3, bf16: the bytes
    (engine.comm()) and the time of step() and of a whole step, interleaved rounds after warm-up."""
    res, runs = {"comm": {}, "step_ms": {}, "total_ms": {}}, {}
    for update in ("adamw", "muon"):
        for stage in (1, 2, 3):
            model = make_gpt(o["tput_preset"], n_embd=o["tput_embd"])
            eng = zero.Zero(model, zero.Config(stage=stage, dtype="bf16", update=update, adamw_lr=OPT["lr"], **OPT))
            runs[update, stage] = (eng, batch(model, o["B"], rank))
            if update == "muon":            # the split, for nanochat's layout
                muon = [p for g in eng.optimizer.param_groups if g.get("update") == "muon" for p in g["params"]]
                ids = {id(p) for p in muon}
                res["split"] = ([p.shape for p in muon], [p.numel() for p in model.parameters() if id(p) not in ids])
    for k, (eng, xy) in runs.items():       # warm-up, and the steady state's bytes
        for _ in range(o["warmup"]):
            eng.backward(eng(*xy))
            eng.step()
        res["comm"][k] = eng.comm()
        res["step_ms"][k], res["total_ms"][k] = [], []
    keys = list(runs)
    for rnd in range(o["rounds"]):
        for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            eng, xy = runs[k]
            dist.barrier()
            t0 = time.perf_counter()
            eng.backward(eng(*xy))
            t1 = time.perf_counter()
            eng.step()
            dist.barrier()
            t2 = time.perf_counter()
            res["step_ms"][k].append((t2 - t1) * 1e3)
            res["total_ms"][k].append((t2 - t0) * 1e3)
    return res


GPT2_XL = [[(4800, 1600), (1600, 1600), (6400, 1600), (1600, 6400)]] * 48
LLAMA_7B = [[(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)]] * 32
MIXTRAL = [[(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096)] + [(14336, 4096)] * 16 + [(4096, 14336)] * 8] * 32
GPT2 = [[(2304, 768), (768, 768), (3072, 768), (768, 3072)]] * 12


def unit_by_unit(units, n):
    """The previous engine's Newton-Schulz wall time: per unit, a gather, its matrices assigned greedily (loads
    carried over), and a wait for its busiest rank."""
    loads, wall = [0] * n, 0
    for costs in units:
        mine = [0] * n
        for c in sorted(costs, reverse=True):
            r = loads.index(min(loads))
            loads[r] += c
            mine[r] += c
        wall += max(mine)
    return wall


def report_muon(res, o):
    print(f"### 6. Matrix rules: Muon beside AdamW, tiny GPT n_embd={o['tput_embd']}, bf16, gloo ranks (B = bytes)\n")
    print("Per step and rank, engine.comm() (bytes this rank sends, as a ring counts them) after warm-up; the time "
          f"the median of {o['rounds']} interleaved rounds. Muon's exchange with each matrix's owner: one all-to-all "
          "to the owners (bf16) and one back (bf16: Muon's update is bf16, exact) a step for the whole model. "
          "nanochat's layout: its MuonAdamW's reduce-scatter to whole matrices and all-gather, for the same split, "
          "in the same dtype.\n")
    rows = []
    for world, r in sorted(res.items()):
        shapes, sizes = r["split"]
        psi_m = sum(s.numel() for s in shapes)
        nano = nanochat_bytes(shapes, sizes, world, 2)
        for stage in (1, 2, 3):
            a, m = (sum(v["bytes"] for v in r["comm"][u, stage].values()) for u in ("adamw", "muon"))
            ex = sum(v["bytes"] for k, v in r["comm"]["muon", stage].items() if k.startswith("matrix"))
            step = [statistics.median(r["step_ms"][u, stage]) for u in ("adamw", "muon")]
            total = [statistics.median(r["total_ms"][u, stage]) for u in ("adamw", "muon")]
            rows.append([world, stage, f"{a:,}", f"{m:,}", f"{m - a:,} ({ex:,})", f"{6 * psi_m / world:,.0f}",
                         f"{nano:,.0f}", f"{step[0]:.1f} / {step[1]:.1f}", f"{total[0]:.1f} / {total[1]:.1f}"])
    table(["ranks", "stage", "AdamW B", "Muon B", "Muon - AdamW (the exchange)", "(2+4) Ψ_muon / N",
           "nanochat's layout B", "step() ms AdamW / Muon", "whole step ms AdamW / Muon"], rows)
    print("Newton-Schulz work of the busiest rank over the mean (zero.assign_matrices over every matrix of the model, "
          "an expert one matrix at a time; cost ns_cost = m²(2n+m)); the bound: the largest matrix, or the mean; "
          "unit by unit: the previous engine's wall time, each unit waiting for its busiest rank.\n")
    rows = []
    for name, units in (("GPT-2 (12 layers)", GPT2), ("GPT-2 XL (48)", GPT2_XL), ("Llama-7B (32)", LLAMA_7B),
                        ("Mixtral 8x7B (32, experts)", MIXTRAL)):
        per_unit = [[zero.ns_cost(*s) for s in u] for u in units]
        costs = [c for u in per_unit for c in u]
        cells = []
        for n in (8, 16, 32, 64):
            loads = [0] * n
            for c, owner in zip(costs, zero.assign_matrices(costs, n)):
                loads[owner] += c
            mean = sum(costs) / n
            cells.append(f"{max(loads) / mean:.3f} (bound {max(max(costs), mean) / mean:.2f}; unit by unit "
                         f"{unit_by_unit(per_unit, n) / mean:.1f})")
        rows.append([name, len(costs)] + cells)
    table(["shapes", "matrices", "8 ranks", "16", "32", "64"], rows)


# --------------------------------------------------------------------------- main
def section(fn, *a):
    try:
        fn(*a)
    except Exception:  # a section that fails is reported, and the others still run
        print(f"**{fn.__name__} failed:**\n```\n{traceback.format_exc()}```\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a reduced smoke run (under a minute)")
    ap.add_argument("--baseline", help="another zero.py, whose stages run interleaved with these (base0 .. base3)")
    args = ap.parse_args()
    quick = args.quick
    if args.baseline:                       # the ranks load it at import (bench.py's own, in each process)
        os.environ["ZERO_BASELINE"] = os.path.abspath(args.baseline)
    t0 = time.time()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"## zero.py bench{' (--quick)' if quick else ''}: {datetime.date.today()}, {cpu} x {os.cpu_count()} "
          f"cores, {gpu}, torch {torch.__version__}, Python {platform.python_version()}\n")
    if zero is None:
        print(f"**import zero failed** ({ZERO_ERR}): only the peers are measured\n")
    zeros = [f"zero{s}" for s in range(4)]
    o = dict(mem_preset="tiny", tput_preset="tiny", tput_embd=64 if quick else 256, T=train_gpt.PRESETS["tiny"][3],
             B=2 if quick else 16, off_B=2, oh_B=1, oh_T=32, warmup=1 if quick else 2, rounds=1 if quick else 16,
             mem_variants=[("ddp", "fp32"), ("zero-opt", "fp32"), ("fsdp2", "fp32"), ("fsdp2", "bf16")]
             + [(z, d) for d in ("fp32", "bf16") for z in zeros] + [("zero2+off", "bf16"), ("zero3+off", "bf16")],
             tput_variants=[(v, d) for d in ("fp32", "bf16") for v in ["ddp", "zero-opt", "fsdp2"] + zeros
                            + [f"base{s}" for s in range(4)] * bool(args.baseline)])
    o["tput_psi"] = numel(make_gpt(o["tput_preset"], n_embd=o["tput_embd"]))
    psi, world = numel(make_gpt(o["mem_preset"])), 2
    try:
        res = spawn(dist_job, world, (o,), timeout=120 if quick else 1800)
        section(report_memory, res, psi, world)
        section(report_comm, res, psi, world)
        section(report_tput, res, o)
    except Exception as e:
        print(f"**the 2-rank job failed:**\n```\n{e}\n```\n")
    try:
        psi_f = sum(p.numel() for p in lora_gpt(o["mem_preset"]).parameters() if not p.requires_grad)
        section(report_lora, spawn(lora_job, world, (o,), timeout=300), psi_f, world)
    except Exception as e:
        print(f"**the LoRA job failed:**\n```\n{e}\n```\n")
    try:
        section(report_hybrid, spawn(hybrid_job, 4, (o,), timeout=300), psi, 4)
    except Exception as e:
        print(f"**the 4-rank hybrid job failed:**\n```\n{e}\n```\n")
    overhead = {}
    for n in (2,) if quick else (2, 4, 8):
        try:
            overhead[n] = spawn(overhead_job, n, (o,), timeout=300)
        except Exception as e:
            print(f"**the {n}-rank overhead job failed:**\n```\n{e}\n```\n")
    section(report_overhead, overhead, o)
    section(report_adam, [1_000_000] if quick else [10_000_000, 50_000_000, 200_000_000], 2 if quick else 7)
    section(report_activations, o)
    section(report_offload, o)
    section(report_rules, quick)
    section(report_gpu, quick)
    try:
        worlds = (2, 4)
        if quick:
            worlds = (2,)
        section(report_muon, {n: spawn(muon_job, n, (o,), timeout=600) for n in worlds}, o)
    except Exception as e:
        print(f"**the Muon jobs failed:**\n```\n{e}\n```\n")
    print(f"bench.py took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
