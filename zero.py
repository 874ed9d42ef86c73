"""
zero.py: ZeRO data parallelism for PyTorch in one file.

Stages 0-3 of "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(Rajbhandari et al., 2020) by reduce-scatter / all-gather over torch.distributed, with
fp16/bf16 compute and fp32 master weights, dynamic loss scaling, activation recompute,
ZeRO-Offload's CPU Adam (Ren et al., 2021), sharded checkpoints, and a memory and
communication ledger. The same code runs on CUDA with NCCL and on CPU with gloo.

    import zero
    rank, world_size, device = zero.init_distributed()
    engine = zero.Zero(model, zero.Config(stage=3, dtype="bf16"))
    loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()

    torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3
    python zero.py estimate --params 7.5e9 --world-size 64
    python zero.py consolidate CKPT_DIR OUT.pt

Sections, in the order data flows:
  1. Config
  2. Distributed setup and collectives (with the ledger)
  3. Loss scaler
  4. AdamW (one kernel for device and host)
  5. Units and flat buffers
  6. Engine: hooks, backward, step (and the offload worker)
  7. Checkpoints
  8. Memory estimator and the command line
"""

import argparse
import atexit
import datetime
import functools
import hashlib
import json
import math
import os
import queue
import shutil
import threading
import warnings
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.adam import adam as functional_adam
from torch.utils.checkpoint import checkpoint as recompute

# -----------------------------------------------------------------------------
# 1. Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Config:
    stage: int = 2                  # 0 plain data parallel | 1 shard optimizer states | 2 + gradients | 3 + parameters
    dtype: str = "bf16"             # compute dtype of parameters and gradients: "fp32" | "bf16" | "fp16"
    lr: float = 3e-4                # AdamW learning rate (engine.lr changes it between steps)
    betas: tuple = (0.9, 0.95)      # AdamW moment decay rates
    eps: float = 1e-8               # AdamW denominator epsilon
    weight_decay: float = 0.1       # decoupled weight decay, on parameters with >= 2 dims only
    grad_clip: float = 1.0          # clip the global gradient norm to this; 0 turns clipping off
    accum_steps: int = 1            # micro-batches (backward calls) per optimizer step
    checkpoint: object = False      # recompute activations: False | True (every unit) | k (every k-th unit)
    offload: bool = False           # ZeRO-Offload: master weights, Adam moments, grad shard on the host (stages 1-3)
    prefetch: bool = True           # stage 3: start the next unit's all-gather while this one computes
    loss_scale: float = 2.0 ** 16   # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000   # fp16: clean steps before the scale doubles
    hysteresis: int = 2             # fp16: overflows tolerated before the scale starts halving
    min_loss_scale: float = 1.0     # fp16: the scale never drops below this
    timeout_s: float = 300.0        # a collective that blocks longer than this raises instead of hanging

    def validate(self):
        def bad(what, fix):
            raise ValueError(f"zero.Config: {what}; {fix}")
        if self.stage not in (0, 1, 2, 3):
            bad(f"stage={self.stage!r} does not exist", "use 0 (plain DP), 1, 2 or 3")
        if self.dtype not in DTYPES:
            bad(f"dtype={self.dtype!r} is not supported", f"use one of {list(DTYPES)}")
        if not (isinstance(self.accum_steps, int) and self.accum_steps >= 1):
            bad(f"accum_steps={self.accum_steps!r}", "use an integer >= 1 (1 = no accumulation)")
        if not isinstance(self.checkpoint, bool) and not (isinstance(self.checkpoint, int) and self.checkpoint >= 1):
            bad(f"checkpoint={self.checkpoint!r}", "use False, True, or an int k >= 1 (every k-th unit)")
        if self.offload and self.stage == 0:
            bad("offload=True needs sharded optimizer states", "use stage 1, 2 or 3 with offload")
        if not (self.lr >= 0 and self.eps > 0 and self.weight_decay >= 0 and self.grad_clip >= 0):
            bad("lr, weight_decay and grad_clip must be >= 0 and eps > 0", "check the values")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad(f"betas={self.betas!r}", "use two numbers in [0, 1), e.g. (0.9, 0.95)")
        if self.hysteresis < 1 or self.loss_scale_window < 1 or self.min_loss_scale <= 0:
            bad("hysteresis and loss_scale_window must be >= 1, min_loss_scale > 0", "check the fp16 settings")
        if self.timeout_s <= 0:
            bad(f"timeout_s={self.timeout_s!r}", "use a positive number of seconds")
        return self


# -----------------------------------------------------------------------------
# 2. Distributed setup and collectives
#
# Three collectives carry all of ZeRO: all-reduce (stage 0's gradients), reduce-scatter (a gradient
# summed over ranks, each rank keeping its slice) and all-gather (each rank's slice of the parameters
# to every rank). All three act on one flat buffer per unit, so there is one call per unit, not per
# parameter. With one process they turn into copies (or nothing), so the same code runs.

def init_distributed(timeout_s=300.0):
    """Join the torchrun job described by RANK/WORLD_SIZE/LOCAL_RANK; one process when they are absent."""
    cuda = torch.cuda.is_available()
    # no torchrun: one process, and every collective below is skipped (world size 1)
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)   # before NCCL starts, or every rank talks through GPU 0
    # the group's own timeout bounds the waits we do not make ourselves (init, barriers, objects)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


# torch 2.13 renamed the flat collectives; older releases (>= 2.4) have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """The engine's collectives. Every call is asynchronous, waited on with a timeout, and
    recorded in a ledger of what this rank sends, counted as the ring algorithms do:
    all-reduce 2M(N-1)/N, reduce-scatter and all-gather M(N-1)/N for M elements in all."""

    def __init__(self, timeout_s):
        self.dist = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.dist else 1
        self.rank = dist.get_rank() if self.dist else 0
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ledger = {}

    def _log(self, kind, t, ring_factor):
        # what a ring sends from this rank: each of N-1 hops carries 1/N of the tensor (twice for all-reduce);
        # units are padded to a multiple of N, so this is exact
        calls, elems, nbytes = self.ledger.get(kind, (0, 0, 0))
        e = t.numel() * ring_factor * (self.world - 1) // self.world
        self.ledger[kind] = (calls + 1, elems + e, nbytes + e * t.element_size())

    def wait(self, work):
        # a bounded wait: a dead or diverged rank becomes an error here, not a hang
        if work is not None and not work.wait(self.timeout):
            raise RuntimeError(f"zero: a collective did not finish in {self.timeout}; another rank died or "
                               "took another code path (raise Config.timeout_s if it is just slow)")

    def all_reduce(self, t, op=dist.ReduceOp.SUM, kind="all_reduce", sync=True):
        self._log(kind, t, 2)
        # async always: callers overlap it with backward, or wait at once (sync=True)
        work = dist.all_reduce(t, op=op, async_op=True) if self.world > 1 else None
        return self.wait(work) if sync else work

    def reduce_scatter(self, out, inp, kind="reduce_scatter", sync=True):
        # out may be inp's own slice [rank*S, (rank+1)*S): NCCL and gloo both reduce in place
        return self._flat(_reduce_scatter, out, inp, inp, kind, sync)

    def all_gather(self, out, inp, kind="all_gather", sync=True):
        # inp may be out's own slice: an in-place gather straight into the parameters' storage
        return self._flat(_all_gather, out, inp, out, kind, sync)

    def _flat(self, collective, out, inp, whole, kind, sync):
        self._log(kind, whole, 1)
        if self.world == 1:                 # one rank: its slice is the whole tensor
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        work = collective(out, inp, async_op=True)
        return self.wait(work) if sync else work

    def broadcast(self, t, src=0):
        if self.world > 1:
            self.wait(dist.broadcast(t, src, async_op=True))


# -----------------------------------------------------------------------------
# 3. Loss scaler
#
# fp16 keeps 5 exponent bits: gradients under ~6e-8 flush to zero. Multiplying the loss by a large
# scale lifts them into range; a too-large scale overflows to inf, which the step detects (the
# gradient norm is not finite), skips, and answers with a smaller scale.

class LossScaler:
    """Dynamic loss scale for fp16 (DeepSpeed's rule): double after `window` clean steps;
    on overflow skip the step, and once `hysteresis` overflows are used up, halve the scale."""

    def __init__(self, cfg):
        self.enabled = cfg.dtype == "fp16"
        self.scale = cfg.loss_scale if self.enabled else 1.0
        self.window, self.hysteresis, self.floor = cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale
        self.clean_steps, self.hysteresis_left = 0, cfg.hysteresis

    def update(self, overflow):
        if not self.enabled:
            return
        # clean step: count towards doubling, since a scale that never grows wastes fp16's range
        if not overflow:
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.scale, self.clean_steps, self.hysteresis_left = self.scale * 2, 0, self.hysteresis
            return
        # overflow: the step was skipped; a lone overflow (hysteresis) costs no halving, the next ones do
        self.clean_steps = 0
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
        elif self.scale <= self.floor:
            # halving cannot help any more: keep skipping so nothing is corrupted, and say so
            warnings.warn(f"zero: fp16 gradients overflow at the minimum loss scale {self.floor}; the step is "
                          "skipped again. The model produces inf/nan: lower the lr, check the data, or use bf16.")
        else:
            self.scale = max(self.scale / 2, self.floor)

    def state_dict(self):
        return dict(scale=self.scale, clean_steps=self.clean_steps, hysteresis_left=self.hysteresis_left)

    def load_state_dict(self, sd):
        self.scale, self.clean_steps, self.hysteresis_left = sd["scale"], sd["clean_steps"], sd["hysteresis_left"]


# -----------------------------------------------------------------------------
# 4. AdamW
#
# The update runs on this rank's fp32 slice only: master weights, exp_avg and exp_avg_sq, 12 bytes
# per parameter (the K of the paper). PyTorch's fused AdamW kernel does the whole update in one pass
# per tensor, on CPU and CUDA; the same function serves the device and the offload worker, so offload
# changes where the update runs, not what it computes.

CONVERT_CHUNK = 1 << 22  # elements of a 16-bit gradient converted to fp32 at a time
_scratch = {}             # device -> the fp32 buffer they are converted into, reused across calls


def adamw_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
               grad_mult=1.0, out=None):
    """AdamW (decoupled weight decay) on 1-D fp32 master/moment tensors with PyTorch's fused
    kernel (vectorised, multi-threaded, on CPU and CUDA). A 16-bit gradient is converted to fp32
    chunk by chunk; grad_mult (loss unscale and clip) is applied inside the kernel. `out`, if
    given, receives the updated master in its own (16-bit) dtype."""
    n = master.numel()
    # an fp32 gradient goes in one kernel call: cache-sized chunks were measured slower on a busy CPU,
    # where every parallel region waits for its slowest thread. A 16-bit one goes in large chunks
    # through a reused buffer: a fresh fp32 copy of the whole range costs more in page faults than
    # the update itself (measured 0.18x the fused kernel's speed at 50M parameters)
    chunk = n if grad.dtype == torch.float32 else CONVERT_CHUNK
    steps = torch.zeros((), device=master.device)
    # the kernel divides by grad_scale, as AMP's unscale does
    inv_mult = torch.full((), 1.0 / grad_mult, device=master.device) if grad_mult != 1.0 else None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        g = grad[a:b]
        if g.dtype != torch.float32:
            buf = _scratch.get(master.device)
            if buf is None or buf.numel() < b - a:
                buf = _scratch[master.device] = torch.empty(chunk, device=master.device)
            g = buf[:b - a].copy_(g)
        steps.fill_(step - 1)           # the kernel increments it to `step`
        functional_adam([master[a:b]], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [steps], fused=True,
                        grad_scale=inv_mult, decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
                        beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    if out is not None:
        out.copy_(master)


# -----------------------------------------------------------------------------
# 5. Units and flat buffers
#
# A unit is the grain of every collective and of stage 3's gathering: small enough that holding one
# or two whole units costs little, large enough that each call moves many bytes. The default, one
# unit per transformer block plus a root for the rest, is what FSDP users wrap by hand.

def find_units(model):
    """Default units: every element of each outermost nn.ModuleList (a transformer block).
    Lists nested inside a block stay part of it: units never nest."""
    units = []

    def visit(module):
        # depth first, stopping at the first ModuleList on each path, so units never nest
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)
    visit(model)
    return units


class Unit:
    """Parameters that share one flat buffer, one collective and one shard.

    flat        the whole unit in the compute dtype, padded to a multiple of the world size;
                every parameter is a view into it (stage 3: storage freed between uses)
    lo, hi      the range of flat this rank's optimizer owns (stage 0: all of it)
    shard       stage 3: this rank's persistent slice of the parameters (the all-gather input)
    grad        the whole gradient (stages 0-1: kept; stages 2-3: only while it is reduced)
    grad_shard  the owned slice of the reduced gradient (host with offload)
    master, exp_avg, exp_avg_sq   fp32 owned slice and Adam moments (host with offload)
    """

    def __init__(self, index, module, named_params, world, rank, stage):
        self.index, self.module = index, module
        # the layout: parameter i lives at flat[offsets[i] : offsets[i] + numel], in named_parameters order
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        # padding to a multiple of N gives every rank an equal shard, as the collectives require
        self.padded = -(-off // world) * world
        size = self.padded // world
        self.lo, self.hi = (0, self.padded) if stage == 0 else (rank * size, (rank + 1) * size)
        # owned ranges with and without weight decay (decay on >= 2-dim params only), merged when adjacent
        # a shard cuts across parameters, so AdamW runs once per run of equal decay inside it
        self.decay_runs = []
        for p, o in zip(self.params, self.offsets):
            a, b = max(o, self.lo), min(o + p.numel(), self.hi)
            if a < b:
                self.add_run(a - self.lo, b - self.lo, p.dim() >= 2)
        if self.padded > self.numel and self.numel < self.hi:  # padding is zero and stays zero
            self.add_run(max(self.numel, self.lo) - self.lo, self.hi - self.lo, False)
        # the tensors themselves are made by Zero._build, which knows the stage, dtype and device
        self.flat = self.shard = self.grad = self.grad_shard = None
        self.master = self.exp_avg = self.exp_avg_sq = None
        self.staging = None         # offload on CUDA: pinned 16-bit copy of the owned slice
        self.gather_work = None     # the all-gather in flight, if any
        self.gathered = True        # flat holds every rank's current values
        self.seen = set()           # params whose gradient arrived in this accumulation window
        self.arrived = 0            # gradients that arrived in this micro-batch
        self.reduced = False        # this micro-batch's collective was launched
        self.updated = threading.Event()   # offload: the host update of this unit is done
        self.updated.set()

    def add_run(self, a, b, decay):
        # adjacent runs with the same decay merge: fewer, longer kernel calls
        if self.decay_runs and self.decay_runs[-1][1] == a and self.decay_runs[-1][2] == decay:
            a = self.decay_runs.pop()[0]
        self.decay_runs.append((a, b, decay))


# -----------------------------------------------------------------------------
# 6. Engine
#
# What each stage keeps whole, and the model states it leaves per rank (Ψ params, N ranks, 16-bit
# compute with K = 12 bytes of fp32 Adam state per parameter):
#
#   stage  parameters              gradients                         master + Adam   bytes per rank
#   0      whole                   whole, all-reduced in backward    whole           (2 + 2 + K) Ψ
#   1      whole                   whole, reduce-scattered at step   sharded         4Ψ + KΨ/N
#   2      whole                   reduce-scattered in backward      sharded         2Ψ + (2 + K)Ψ/N
#   3      gathered per unit       reduce-scattered in backward      sharded         (2 + 2 + K)Ψ/N
#
# One step: forward (stage 3 gathers each unit before it runs and frees it after) -> backward
# (each unit's gradient is reduced as soon as it is complete; stage 3 gathers again first) ->
# step (global norm, overflow check, clip, AdamW on the owned slice, 16-bit slice rewritten,
# stages 1-2 all-gather it). Every stage difference in the code below is an `if` on cfg.stage.

class Zero:
    """Wraps a model: shards it in place into units, hooks its forward and backward, and
    steps AdamW on this rank's shard. Call it like the model, then backward(loss), then step()."""

    def __init__(self, model, cfg=None, units=None):
        # a bad config fails here, before any collective or allocation
        self.cfg = cfg = (cfg or Config()).validate()
        self.net = Comm(cfg.timeout_s)
        self.rank, self.world = self.net.rank, self.net.world
        self.dtype = DTYPES[cfg.dtype]
        self.device = _engine_device()
        self.module = model
        self.scaler = LossScaler(cfg)
        # the caller may change lr between steps (a schedule); step_count counts applied steps only
        self.lr, self.step_count, self.grad_norm = cfg.lr, 0, 0.0
        self.micro = 0                      # backward calls since the last step
        self.in_flight = []                 # gradient collectives launched and not yet finished
        self.peak_gathered_bytes = 0        # stage 3: the most bytes of whole units held at once
        self.last_comm = {}
        # units in the order the forward ran them: prefetching and the offload update follow it
        self.fwd_order, self.last_fwd_order = [], []
        # where the shard state (master, moments, gradient shard) lives: the device, or the host with offload
        self.host = torch.device("cpu") if cfg.offload else self.device
        self.pin = cfg.offload and torch.cuda.is_available()  # pinning needs CUDA; same code path without it
        # fp32 compute without offload: the parameters are the master weights, no second copy
        self.master_is_param = self.dtype == torch.float32 and not cfg.offload

        # -- which parameter goes to which unit: a parameter used by several units goes to the root
        unit_modules = list(units) if units is not None else find_units(model)
        # ownership by identity, so a parameter reached under two names (tied weights) counts once
        owners = {}
        for i, m in enumerate(unit_modules):
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(i)
        # frozen parameters get no gradient and no optimizer state, so they join no unit
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("zero.Zero: the model has no trainable parameters (requires_grad=True); "
                             "pass the model you mean to train")
        groups = [[] for _ in unit_modules] + [[]]     # the last group is the root unit
        # named_parameters() yields each tensor once, under its first name: that name is the one we use
        for n, p in trainable:
            o = owners.get(id(p), set())
            groups[next(iter(o)) if len(o) == 1 else -1].append((n, p))
        modules = unit_modules + [model]
        self.units = []
        for m, g in zip(modules, groups):
            if g:                           # a block with only frozen parameters is no unit
                self.units.append(Unit(len(self.units), m, g, self.world, self.rank, cfg.stage))
        self.root = self.units[-1] if groups[-1] else None
        # before the first collective that depends on the layout: mismatched ranks would hang in it
        self._check_ranks_agree(model)

        # -- frozen parameters and buffers: cast, move, and take rank 0's values
        # (they are not model states of the formula: they stay whole on every rank, in the compute dtype)
        for m in model.modules():
            for n, p in m.named_parameters(recurse=False):
                if not p.requires_grad:
                    p.data = p.data.to(self.device, self.dtype if p.is_floating_point() else p.dtype)
                    self.net.broadcast(p.data)
            for n, b in m.named_buffers(recurse=False):
                m._buffers[n] = b.to(self.device, self.dtype if b.is_floating_point() else b.dtype)
                self.net.broadcast(m._buffers[n])

        # -- flat buffers and this rank's shard state, built unit by unit from rank 0's fp32 weights
        for u in self.units:
            self._build(u)

        # -- hooks
        # a gradient hook per parameter (fires once per backward, after autograd summed all its uses);
        # forward hooks per unit, for stage 3 gathering, offload waits and the forward order
        for u in self.units:
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u, i))
            if u is not self.root or cfg.stage == 3 or cfg.offload:
                u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u))
                u.module.register_forward_hook(functools.partial(self._post_forward, u))
        # recompute every k-th block unit (the root holds embeddings and head: nothing worth recomputing)
        k = 1 if cfg.checkpoint is True else cfg.checkpoint
        if k:
            for j, u in enumerate(x for x in self.units if x is not self.root):
                if j % k == 0:
                    # non-reentrant recompute keeps dropout's RNG state and runs inside the unit's hooks,
                    # so at stage 3 the unit is gathered again before its recompute
                    u.module.forward = functools.partial(recompute, u.module.forward, use_reentrant=False)
        self.ledger_reset()
        self.worker = self.worker_error = None

    def _check_ranks_agree(self, model):
        """Ranks that disagree on the config or the model would hang in mismatched collectives:
        compare a fingerprint of both first, and name what differs."""
        if self.world == 1:
            return
        c = self.cfg
        layout = ";".join(f"{u.index}:{n}:{tuple(p.shape)}" for u in self.units for n, p in zip(u.names, u.params))
        fields_ = dict(stage=c.stage, dtype=list(DTYPES).index(c.dtype), accum_steps=c.accum_steps,
                       offload=int(c.offload), checkpoint=int(c.checkpoint), units=len(self.units),
                       params=sum(u.numel for u in self.units), layout=zlib.crc32(layout.encode()),
                       config=zlib.crc32(repr(asdict(c)).encode()))
        mine = torch.tensor(list(fields_.values()), dtype=torch.int64, device=self.device)
        every = torch.empty(self.world * len(mine), dtype=torch.int64, device=self.device)
        self.net.all_gather(every, mine, kind="setup")
        every = every.view(self.world, -1).tolist()
        for r, row in enumerate(every):
            diff = [f"{k}: rank 0 has {a}, rank {r} has {b}" for k, a, b in zip(fields_, every[0], row) if a != b]
            if diff:
                raise ValueError("zero.Zero: ranks disagree (" + "; ".join(diff) + "); launch every rank with "
                                 "the same model and the same zero.Config")

    def _build(self, u):
        cfg, dev = self.cfg, self.device
        # one whole unit in fp32 at a time: the master weights start from the model's own fp32 values,
        # not from their 16-bit rounding
        full = torch.zeros(u.padded, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for p, o in zip(u.params, u.offsets):
                full[o:o + p.numel()].copy_(p.detach().reshape(-1))
        self.net.broadcast(full)           # every rank starts from rank 0's weights
        u.flat = full.to(self.dtype) if self.dtype != torch.float32 else full
        # re-point each parameter into the flat buffer: the model's code sees ordinary parameters, while
        # a collective on the flat buffer moves all of them at once
        for p, o in zip(u.params, u.offsets):
            p.data = u.flat[o:o + p.numel()].view(p.shape)
        pin = dict(pin_memory=True) if self.pin else {}

        def state(src=None):
            t = torch.empty(u.hi - u.lo, dtype=torch.float32, device=self.host, **pin)
            return t.copy_(src) if src is not None else t.zero_()
        u.master = None if self.master_is_param else state(full[u.lo:u.hi])
        u.exp_avg, u.exp_avg_sq = state(), state()
        if cfg.stage == 3:                  # the owned slice stays, the whole buffer goes
            u.shard = u.flat[u.lo:u.hi].clone()
            self._free(u)
        if self.master_is_param:
            u.master = self._owned_params(u)
        if self.pin:                        # offload on CUDA: the worker writes 16-bit weights here first
            u.staging = torch.empty(u.hi - u.lo, dtype=self.dtype, pin_memory=True)
        if cfg.stage <= 1:                  # the whole gradient stays; stage 1 owns a slice of it
            u.grad = torch.zeros(u.padded, dtype=self.dtype, device=dev)
            u.grad_shard = u.grad[u.lo:u.hi]
        if cfg.stage >= 2 or cfg.offload:
            # offload keeps it in fp32: converted as it arrives during backward, not in the update's path
            gdt = torch.float32 if cfg.offload else self.dtype
            u.grad_shard = torch.zeros(u.hi - u.lo, dtype=gdt, device=self.host, **pin)
        del full

    # -- stage 3 gathering: the flat buffer's storage is resized, the parameter views stay valid

    def _start_gather(self, u):
        if u.gathered or u.gather_work is not None:
            return
        if self.cfg.stage == 3:
            # storage back to full size, then the gather writes straight into it: no copy in or out
            u.flat.untyped_storage().resize_(u.padded * u.flat.element_size())
            held = sum(x.flat.untyped_storage().nbytes() for x in self.units)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)
        # stage 3 gathers from its shard; offload at stages 1-2 from the freshly updated owned slice
        u.gather_work = self.net.all_gather(u.flat, self._owned_params(u), sync=False)
        if u.gather_work is None:
            u.gathered = True

    def _gather(self, u):
        # start it (if no prefetch did) and wait for it: after this, u's parameters are whole and current
        self._start_gather(u)
        if u.gather_work is not None:
            self.net.wait(u.gather_work)
            u.gather_work, u.gathered = None, True

    def _free(self, u):
        assert u.gather_work is None
        # the memory goes back; the parameters (and autograd's saved references) keep pointing at this storage
        u.flat.untyped_storage().resize_(0)
        u.gathered = False

    def _neighbour(self, u, delta, order):
        # the unit that ran just after (delta=+1) or before (-1) u in a recorded forward: the one to prefetch
        if u.index in order:
            j = order.index(u.index) + delta
            if 0 <= j < len(order):
                return self.units[order[j]]
        return None

    # -- forward hooks

    def _pre_forward(self, u, module, args):
        if u.index in self.fwd_order:       # a new forward: keep the last one's order for prefetching
            self.last_fwd_order, self.fwd_order = self.fwd_order, []
        self.fwd_order.append(u.index)
        if self.cfg.offload:
            self._wait_update(u)
        if self.cfg.stage == 3 or self.cfg.offload:
            self._gather(u)
            # start the next unit's gather now, so it travels while this unit computes (with offload,
            # only if the worker is done with it: waiting here would undo the overlap)
            nxt = self._neighbour(u, +1, self.last_fwd_order)
            if self.cfg.prefetch and nxt is not None and nxt.updated.is_set():
                self._start_gather(nxt)

    def _post_forward(self, u, module, args, output):
        if self.cfg.stage != 3:
            return                          # stages 0-2 keep whole parameters
        if torch.is_grad_enabled():
            # gather again just before this unit's backward (and its recompute, if any)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
            if u is self.root:
                return                      # the root stays gathered until its backward is done
        self._free(u)

    def _pre_backward(self, u):
        # runs when the gradient of u's output is ready, before any of u's own backward (or its recompute)
        self._gather(u)
        # backward runs the forward's units in reverse, except the root (embeddings and head), which
        # ran first and is the first back: after it comes the forward's last block
        if u is self.root:
            prev = self.units[self.fwd_order[-1]] if self.fwd_order else None
        else:
            prev = self._neighbour(u, -1, self.fwd_order)
        if self.cfg.prefetch and prev is not None and prev is not self.root:
            self._start_gather(prev)

    # -- backward: gradients are copied into the unit's flat gradient as they arrive

    def _on_grad(self, u, i, p):
        # autograd's .grad is a fresh tensor per parameter; moving it into the flat gradient at once
        # keeps one copy, and lets a single collective reduce the whole unit
        if p.grad is None:
            return
        o, n = u.offsets[i], u.params[i].numel()
        if u.grad is None:                  # stages 2-3: a whole-unit gradient for this micro-batch only
            u.grad = torch.empty(u.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            if i in u.seen:
                u.grad[o:o + n].add_(p.grad.view(-1))
            else:
                u.grad[o:o + n].copy_(p.grad.view(-1))
                u.seen.add(i)
        p.grad = None                       # autograd's copy is freed at once
        u.arrived += 1
        # the unit's last gradient: launch its collective now, while backward goes on to earlier units
        if u.arrived == len(u.params) and self._reduces_now():
            self._reduce(u)

    def _reduces_now(self):
        # whether this micro-batch's backward launches collectives (accumulation defers stages 0-1)
        # stage 0 all-reduces on the last micro-batch, stage 1 reduce-scatters in step(), 2-3 every time
        last = self.micro == self.cfg.accum_steps - 1
        return self.cfg.stage >= 2 or (self.cfg.stage == 0 and last)

    def _reduce(self, u):
        """Launch u's gradient collective; at most two stay in flight, so whole-unit gradients
        of stages 2-3 are freed as backward goes on."""
        g = u.grad
        if g is None:                       # no parameter of u took part in this micro-batch
            g = u.grad = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
        for i, (p, o) in enumerate(zip(u.params, u.offsets)):
            if i not in u.seen:             # unused this window: zero, not last window's values
                g[o:o + p.numel()].zero_()
                u.seen.add(i)
        g[u.numel:].zero_()
        # the mean over ranks and micro-batches, taken before the sum so that fp16 cannot overflow in it
        g.mul_(1.0 / (self.world * self.cfg.accum_steps))
        u.reduced = True
        if self.cfg.stage == 0:
            work = self.net.all_reduce(g, sync=False)
        else:
            work = self.net.reduce_scatter(g[u.lo:u.hi], g, sync=False)
        self.in_flight.append((u, work))
        # finishing the oldest keeps memory bounded without stalling backward on the newest
        while len(self.in_flight) > 2:
            self._finish_reduce(*self.in_flight.pop(0))
        if self.cfg.stage == 3 and u is not self.root:
            self._free(u)                   # its backward is done: the parameters are not needed again

    def _finish_reduce(self, u, work):
        self.net.wait(work)
        # the reduced owned slice becomes (or is added to) the gradient shard: on the host with offload,
        # copied while backward still runs
        if self.cfg.stage >= 2 or self.cfg.offload:
            mine = u.grad[u.lo:u.hi]
            if self.micro == 0 or self.cfg.stage <= 1:
                u.grad_shard.copy_(mine, non_blocking=self.pin)
            else:
                u.grad_shard.add_(mine.to(u.grad_shard.device))
        if self.cfg.stage >= 2:
            u.grad, u.seen = None, set()    # stages 2-3 keep no whole gradient between micro-batches

    def __call__(self, *args, **kwargs):
        # the parameters are in the compute dtype, so float inputs must be too
        cast = functools.partial(_cast_floats, dtype=self.dtype)
        return self.module(*cast(args), **cast(kwargs))

    def backward(self, loss):
        """Backward of this micro-batch's mean loss; returns when its gradients are reduced."""
        if self.micro >= self.cfg.accum_steps:
            raise RuntimeError(f"zero: backward() called {self.micro + 1} times without step(); "
                               f"Config.accum_steps={self.cfg.accum_steps}")
        self._settle()                      # units the forward skipped are made current too
        self.in_flight = []
        # fp16: scale the loss up so small gradients survive in 16 bits; step() divides it out
        (loss.float() * self.scaler.scale if self.scaler.enabled else loss).backward()
        if self._reduces_now():
            for u in self.units:            # units with unused parameters, and the root
                if not u.reduced:
                    self._reduce(u)
        for item in self.in_flight:
            self._finish_reduce(*item)
        self.in_flight = []
        # stage 3: whatever is still whole (the root, units whose gradients never came) goes now
        for u in self.units:
            u.reduced, u.arrived = False, 0
            if self.cfg.stage == 3 and u.gathered:
                self._free(u)
        self.micro += 1

    # -- step

    def step(self):
        """AdamW on this rank's shard, then the updated parameters go back to every rank.
        Returns False when the gradients were not finite (fp16 overflow: the step is skipped)."""
        cfg = self.cfg
        if self.micro != cfg.accum_steps:
            raise RuntimeError(f"zero: step() after {self.micro} backward() calls; "
                               f"Config.accum_steps={cfg.accum_steps} asks for exactly that many")
        self.micro = 0
        # from here to the update, every rank runs the same collectives in the same order
        if cfg.stage == 1:                  # stage 1 reduce-scatters once, now
            self.in_flight = []
            for u in self.units:
                self._reduce(u)
            for item in self.in_flight:
                self._finish_reduce(*item)
        self._settle()
        if self.pin:
            torch.cuda.current_stream().synchronize()   # the gradient shards' copies to the host landed
        # the global norm of the unscaled gradient: one scalar all-reduce; inf or nan means overflow
        # (padding is zero and counts nothing; fp32 accumulation, as clip_grad_norm_ does)
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for u in self.units:
            sq += torch.linalg.vector_norm(u.grad_shard, dtype=torch.float32).to(self.device) ** 2
        # stage 0 holds the whole gradient on every rank: MAX only makes the ranks agree on overflow
        self.net.all_reduce(sq, op=dist.ReduceOp.SUM if cfg.stage else dist.ReduceOp.MAX, kind="scalar")
        # the gradients were computed from loss * scale: divide it out of the norm
        norm = sq.sqrt().item() / self.scaler.scale
        self.grad_norm = norm
        for u in self.units:
            u.seen = set()                  # the next window starts a new accumulation
        # every rank sees the same norm, so every rank takes the same branch: no rank can step alone
        if not math.isfinite(norm):
            self.scaler.update(overflow=True)
            self.ledger_reset()
            if self.scaler.enabled:
                return False
            raise FloatingPointError(
                f"zero: the gradient norm is {norm} at step {self.step_count + 1} in {cfg.dtype}; nothing was "
                "updated. The loss or the data produced inf/nan: lower the lr, check the inputs, or use fp16 "
                "with loss scaling only if the cause is range")
        # clip_grad_norm_'s rule; unscale and clip are one multiplier, applied inside the Adam kernel
        clip = min(1.0, cfg.grad_clip / (norm + 1e-6)) if cfg.grad_clip > 0 else 1.0
        mult = clip / self.scaler.scale
        self.step_count += 1
        self.scaler.update(overflow=False)
        # with offload the update happens behind the next forward; without, right here
        if cfg.offload:
            self._start_updates(mult)
        else:
            for u in self.units:
                self._update(u, mult, self._param_slice(u), self.lr, self.step_count)
            # stages 1-2 keep whole parameters: every rank's updated slice goes to every rank, in place
            if cfg.stage in (1, 2):
                works = [self.net.all_gather(u.flat, u.flat[u.lo:u.hi], sync=False) for u in self.units]
                for w in works:
                    self.net.wait(w)
        self.ledger_reset()
        return True

    def _update(self, u, mult, out, lr, step):
        """AdamW on u's owned range; `out` receives the updated weights in the compute dtype."""
        b1, b2 = self.cfg.betas
        for a, b, decay in u.decay_runs:
            adamw_step(u.master[a:b], u.grad_shard[a:b], u.exp_avg[a:b], u.exp_avg_sq[a:b], step,
                       lr, b1, b2, self.cfg.eps, self.cfg.weight_decay if decay else 0.0,
                       grad_mult=mult, out=None if out is None else out[a:b])

    def _owned_params(self, u):
        """This rank's owned range of the parameters: the shard (stage 3) or its slice of the flat buffer."""
        return u.shard if self.cfg.stage == 3 else u.flat[u.lo:u.hi]

    def _param_slice(self, u):
        """Where an update writes the new parameters: nowhere when the master weights are the parameters."""
        return None if self.master_is_param else self._owned_params(u)

    # -- ZeRO-Offload: a worker thread updates unit by unit in forward order, while the caller
    #    goes on to the next forward, which waits only for the unit it is about to run

    def _start_updates(self, mult):
        # one long-lived worker per engine; jobs go through a queue, one job per step
        if self.worker is None:
            self.jobs, self.worker_error = queue.Queue(), None
            self.worker = threading.Thread(target=self._worker, daemon=True, name="zero-offload-adam")
            self.worker.start()
            # a daemon thread killed inside a kernel at exit aborts the process: let it finish first
            atexit.register(lambda: [u.updated.wait(self.cfg.timeout_s) for u in self.units])
        # forward order first (the next forward needs those units first), then any unit it skipped
        order = list(dict.fromkeys((self.fwd_order or self.last_fwd_order) + [u.index for u in self.units]))
        for i in order:
            self.units[i].updated.clear()
            if self.cfg.stage in (1, 2):
                self.units[i].gathered = False   # the other ranks' slices are last step's until gathered
        # lr and step as they are now: the caller may set the next step's lr while the worker runs
        self.jobs.put((order, mult, self.lr, self.step_count))

    def _worker(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)   # the current GPU is per thread
        while True:
            order, mult, lr, step = self.jobs.get()
            for i in order:
                u = self.units[i]
                try:
                    dest = self._param_slice(u)
                    if u.staging is not None:   # CUDA: 16-bit result to pinned memory, then to the device
                        self._update(u, mult, u.staging, lr, step)
                        dest.copy_(u.staging, non_blocking=True)
                    else:
                        self._update(u, mult, dest, lr, step)
                    # no collective here: the caller's thread gathers, in its forward, so the order of
                    # collectives is the program's own on every rank
                except BaseException as e:  # handed to the caller at its next wait
                    self.worker_error = e
                u.updated.set()

    def _wait_update(self, u):
        # a bounded wait, and a failure in the worker is raised here, in the caller's thread
        if not u.updated.wait(self.cfg.timeout_s):
            raise RuntimeError("zero: the offload worker did not finish a unit in time")
        if self.worker_error is not None:
            err, self.worker_error = self.worker_error, None
            raise RuntimeError("zero: the offload update failed") from err

    def _settle(self):
        """Every unit's update done and (stages 1-2 with offload) gathered: the state is this step's."""
        for u in self.units:
            self._wait_update(u)
        if self.cfg.offload and self.cfg.stage in (1, 2):
            for u in self.units:
                self._gather(u)

    # -- what the engine tells its user

    def ledger_reset(self):
        # called at the end of each step: what one step moved, from the forward to the update
        self.last_comm = {k: dict(calls=c, elements=e, bytes=b) for k, (c, e, b) in self.net.ledger.items()}
        self.net.ledger = {}

    def comm(self):
        return self.last_comm

    @property
    def loss_scale(self):
        return self.scaler.scale

    def memory(self):
        """Bytes of model state this rank really holds, by kind, on the device and on the host,
        counted from the tensors' storages (each storage once)."""
        out = {w: dict(params=0, grads=0, master=0, optim=0) for w in ("device", "host")}
        seen = set()                        # views share storage (stage 1's shard, fp32 masters): count once

        def add(t, kind, where):
            if t is None:
                return
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                return
            seen.add(st.data_ptr())
            out[where][kind] += st.nbytes()
        host = "host" if self.cfg.offload else "device"
        # (on a CPU-only machine "device" and "host" are one memory: the split is by role, as on a GPU)
        for u in self.units:
            add(u.flat, "params", "device")
            add(u.shard, "params", "device")
            add(u.grad, "grads", "device")
            add(u.grad_shard, "grads", host)
            add(u.master, "master", host)
            add(u.exp_avg, "optim", host)
            add(u.exp_avg_sq, "optim", host)
            add(u.staging, "params", "host")
        return out

    def num_params(self, padded=False):
        # Ψ of the formulas: trainable parameters (padded: as the flat buffers hold them)
        return sum(u.padded if padded else u.numel for u in self.units)

    def full_state_dict(self):
        """The whole model as a plain fp32 state_dict, on every rank (a collective): one unit's
        master weights are gathered at a time, so memory never holds more than the result and one unit."""
        self._settle()
        # keys and order from the model's own state_dict: tied names, buffers and frozen params included
        values = {}
        for u in self.units:
            full = self._gather_master(u)
            for p, o in zip(u.params, u.offsets):
                values[id(p)] = full[o:o + p.numel()].view(p.shape).clone()
            del full
        sd = {}
        for k, t in self.module.state_dict(keep_vars=True).items():
            v = values.get(id(t))
            if v is None:
                v = t.detach().clone()
                v = v.float() if v.is_floating_point() else v
            sd[k] = v.cpu()
        return sd

    def _gather_master(self, u):
        # fp32 master weights, not the 16-bit parameters: the state_dict keeps full precision
        if self.cfg.stage == 0:
            return u.master.to(self.device, torch.float32)
        full = torch.empty(u.padded, dtype=torch.float32, device=self.device)
        # its own ledger kind: a state_dict is not training traffic
        self.net.all_gather(full, u.master.to(self.device, torch.float32), kind="state_dict")
        return full


def _engine_device():
    # the device init_distributed set for this rank (or the CPU)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tensors(x):
    # every tensor in a module's output: a tensor, or tuples, lists and dicts of them
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _cast_floats(x, dtype):
    # float tensors anywhere in the arguments to the compute dtype; token ids and masks stay as they are
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_floats(y, dtype) for y in x)
    if isinstance(x, dict):
        return {k: _cast_floats(v, dtype) for k, v in x.items()}
    return x


# -----------------------------------------------------------------------------
# 7. Checkpoints
#
# path/latest               the name of the newest complete checkpoint, replaced atomically, last
# path/step_00001000/       one checkpoint: meta.json (layout, config, step, scaler, checksums),
#                           written after every rank's rank_00000.pt ... (fp32 master and Adam
#                           moments of the rank's shard of each unit, as slices of the unpadded layout)
# Every file is written under a temporary name and renamed into place, so a crash at any moment
# leaves `latest` pointing at the previous checkpoint, whole. Loading slices the flat layout, so a
# checkpoint loads onto any world size and stage.

FORMAT = "zero.py-checkpoint-1"


def _write_atomic(path, write):
    # a reader sees the old file or the new one, never half of one: rename is atomic within a filesystem,
    # and fsync first makes sure the bytes are on disk before the name points at them
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _layout(engine):
    """Every trainable parameter: its unit, offset and shape; every other state_dict entry by name."""
    # all names of each tensor, so a tied weight comes back under each of its state_dict keys
    aliases = {}
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    units = [dict(numel=u.numel, params=[dict(name=n, shape=list(p.shape), offset=o, aliases=aliases[id(p)])
                                         for n, p, o in zip(u.names, u.params, u.offsets)]) for u in engine.units]
    return units, list(engine.module.state_dict().keys())


def save(engine, path):
    """Write a sharded checkpoint of `engine` under directory `path` (every rank calls it)."""
    engine._settle()              # offload: the shard state must be this step's
    net, rank, world = engine.net, engine.rank, engine.world
    # rank 0 picks a fresh directory and tells the others: a save never writes into a complete checkpoint
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        name = f"step_{engine.step_count:08d}"
        k = 0
        while os.path.exists(os.path.join(path, name + (f"_{k}" if k else ""))):
            k += 1                          # never write into an existing checkpoint
        name += f"_{k}" if k else ""
        os.makedirs(os.path.join(path, name))
    else:
        name = None
    name = _broadcast_object(net, name)
    d = os.path.join(path, name)
    # this rank's slice [rank*S, (rank+1)*S) of every unit's unpadded layout, whatever the stage
    # the same layout whatever the stage (stage 0 owns everything but saves only its slice), so that any
    # run can find element i of a unit in file i // S
    shards = []
    for u in engine.units:
        size = u.padded // world
        a, b = rank * size, min((rank + 1) * size, u.numel)
        lo = a - u.lo                       # where that slice sits in this rank's owned range
        shards.append({k: getattr(u, k)[lo:lo + max(b - a, 0)].to("cpu", torch.float32).clone()
                       for k in ("master", "exp_avg", "exp_avg_sq")})
    # each rank's RNG too: dropout continues the same stream after a resume on the same ranks
    blob = dict(units=shards, rng=torch.get_rng_state())
    if torch.cuda.is_available():
        blob["cuda_rng"] = torch.cuda.get_rng_state()
    # buffers and frozen parameters are the same on every rank: rank 0 saves them, as the model holds them
    if rank == 0:
        trained = {id(p) for u in engine.units for p in u.params}
        blob["extra"] = {k: v.detach().cpu() for k, v in engine.module.state_dict(keep_vars=True).items()
                         if id(v) not in trained}
    fname = os.path.join(d, f"rank_{rank:05d}.pt")
    _write_atomic(fname, lambda f: torch.save(blob, f))
    # meta.json records every file's checksum, so it can only be written once every rank has written
    sums = _all_gather_object(net, _sha256(fname))
    if rank == 0:
        units, keys = _layout(engine)
        meta = dict(format=FORMAT, world_size=world, stage=engine.cfg.stage, dtype=engine.cfg.dtype,
                    config=asdict(engine.cfg), step=engine.step_count, scaler=engine.scaler.state_dict(),
                    units=units, state_dict_keys=keys, sha256={f"rank_{r:05d}.pt": s for r, s in enumerate(sums)})
        _write_atomic(os.path.join(d, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        # the commit point: until this rename, `latest` names the previous checkpoint, which is whole
        _write_atomic(os.path.join(path, "latest"), lambda f: f.write(name.encode()))
        # older checkpoints go only once the new one is complete (a crash here leaves an extra, never none)
        for old in os.listdir(path):
            if old.startswith("step_") and old != name:
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    _all_gather_object(net, None)           # nobody returns before the checkpoint is whole


def _resolve(path):
    """A checkpoint directory from `path`: the directory itself, or what its `latest` names."""
    # `latest` is read once: a save finishing meanwhile does not mix two checkpoints
    if os.path.isfile(os.path.join(path, "latest")):
        with open(os.path.join(path, "latest")) as f:
            path = os.path.join(path, f.read().strip())
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise FileNotFoundError(f"zero: {path!r} is not a zero.py checkpoint (no meta.json, no 'latest'); "
                                "pass the directory given to zero.save")
    try:
        with open(meta_file) as f:
            meta = json.load(f)
        assert meta.get("format") == FORMAT
    except (ValueError, AssertionError) as e:
        raise ValueError(f"zero: {meta_file} is corrupt or of another format; use an earlier checkpoint") from e
    return path, meta


def _open_rank(d, meta, r):
    """Rank r's file, checked against its checksum, memory-mapped (nothing is read that is not used)."""
    fname = f"rank_{r:05d}.pt"
    full = os.path.join(d, fname)
    # each failure names the file, what is wrong with it, and what to do
    if not os.path.isfile(full):
        raise FileNotFoundError(f"zero: checkpoint {d} lacks {fname} (it was saved by {meta['world_size']} ranks); "
                                "the files were lost or copied in part: copy them all, or use an earlier checkpoint")
    if _sha256(full) != meta["sha256"][fname]:
        raise ValueError(f"zero: {full} is truncated or corrupted (its sha256 does not match meta.json); "
                         "use an earlier checkpoint")
    # weights_only: a checkpoint is data, never code; mmap: only the slices we index are read
    return torch.load(full, map_location="cpu", weights_only=True, mmap=True)


def _by_name(meta):
    """name -> (unit, offset, numel, shard size at save time) in the saved layout."""
    # the shard size follows from the unit's size and the world size at save time, as in Unit
    out = {}
    for i, u in enumerate(meta["units"]):
        size = -(-u["numel"] // meta["world_size"])
        for p in u["params"]:
            out[p["name"]] = (i, p["offset"], math.prod(p["shape"]), size, p["shape"])
    return out


def _read_range(files, meta, saved, start, n, key):
    """Elements [start, start+n) of a saved parameter, assembled from the rank files that hold them."""
    i, offset, _, size, _ = saved
    # walk the saved unit's layout from file to file: element e of the unit is in file e // size
    out, a = [], offset + start
    while a < offset + start + n:
        r = a // size
        b = min(offset + start + n, (r + 1) * size)
        out.append(files(r)["units"][i][key][a - r * size:b - r * size])
        a = b
    return torch.cat(out) if len(out) > 1 else out[0]


def load(engine, path):
    """Restore a checkpoint into `engine` (every rank calls it): its own world size and stage, or any
    other. Nothing in the engine changes unless every rank read everything it needs."""
    engine._settle()
    # phase 1, on every rank: check everything and read this rank's new state into fresh tensors;
    # any failure is caught, so that all ranks learn of it below instead of hanging
    try:
        d, meta = _resolve(path)
        saved = _by_name(meta)
        mine = [(n, tuple(p.shape)) for u in engine.units for n, p in zip(u.names, u.params)]
        missing = [n for n, _ in mine if n not in saved]
        extra = [n for n in saved if n not in dict(mine)]
        shapes = [f"{n} {list(s)} vs {saved[n][4]}" for n, s in mine if n in saved and list(s) != saved[n][4]]
        if missing or extra or shapes:
            raise ValueError("zero: the checkpoint is of another model: " + "; ".join(
                x for x in (f"not in checkpoint: {missing}" if missing else "",
                            f"not in model: {extra}" if extra else "",
                            f"shapes differ: {shapes}" if shapes else "") if x))
        cache = {}
        files = lambda r: cache[r] if r in cache else cache.setdefault(r, _open_rank(d, meta, r))
        new = []                            # this rank's new state, kept apart until all ranks succeed
        # by name, not by unit: a parameter may sit in another unit, offset or shard than when saved
        for u in engine.units:
            st = {k: torch.zeros(u.hi - u.lo, dtype=torch.float32) for k in ("master", "exp_avg", "exp_avg_sq")}
            for n, p, o in zip(u.names, u.params, u.offsets):
                a, b = max(o, u.lo), min(o + p.numel(), u.hi)
                if a < b:
                    for k in st:
                        st[k][a - u.lo:b - u.lo] = _read_range(files, meta, saved[n], a - o, b - a, k)
            new.append(st)
        for r in range(meta["world_size"]):
            files(r)                        # every file is checked, also those this rank needs no slice of
        rng = files(engine.rank) if meta["world_size"] == engine.world else None
        error = None
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        error = e
    # phase 2: every rank learns whether every rank succeeded; only then is the engine touched
    failed = _all_gather_object(engine.net, repr(error) if error else None)
    if error is not None:
        raise error
    if any(failed):
        raise RuntimeError(f"zero: another rank could not load {path}: {[f for f in failed if f][0]}")
    # phase 3: the shard state in place, then the 16-bit parameters rebuilt from it, as step() does
    for u, st in zip(engine.units, new):
        for k, v in st.items():
            getattr(u, k).copy_(v)
        out = engine._param_slice(u)
        if out is not None:
            out.copy_(u.master)
        if engine.cfg.stage in (1, 2):
            engine.net.all_gather(u.flat, u.flat[u.lo:u.hi], kind="load")
    engine.step_count = meta["step"]
    engine.scaler.load_state_dict(meta["scaler"])
    # the same ranks again: each continues its own random stream (dropout), as if never stopped
    if rng is not None:
        torch.set_rng_state(rng["rng"])
        if "cuda_rng" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda_rng"])
    extra = files(0)["extra"]               # buffers and frozen parameters
    with torch.no_grad():
        for k, v in engine.module.state_dict(keep_vars=True).items():
            if k in extra:
                v.copy_(extra[k])
    return meta


def consolidate(path):
    """A sharded checkpoint as one plain fp32 state_dict that the unwrapped model loads; memory holds
    the result and the rank files' memory maps, nothing else."""
    d, meta = _resolve(path)
    saved = _by_name(meta)
    cache = {}
    files = lambda r: cache[r] if r in cache else cache.setdefault(r, _open_rank(d, meta, r))
    # parameter by parameter: each is assembled from its slices in the rank files and cloned out
    values = {}
    for u in meta["units"]:
        for p in u["params"]:
            t = _read_range(files, meta, saved[p["name"]], 0, math.prod(p["shape"]), "master")
            t = t.clone().view(p["shape"])
            for a in p["aliases"]:
                values[a] = t
    extra = files(0)["extra"]
    return {k: values[k] if k in values else (extra[k].float() if extra[k].is_floating_point() else extra[k]).clone()
            for k in meta["state_dict_keys"]}


def _all_gather_object(net, obj):
    # small Python objects between ranks (checksums, error messages); world size 1 needs no group
    if net.world == 1:
        return [obj]
    out = [None] * net.world
    dist.all_gather_object(out, obj)
    return out


def _broadcast_object(net, obj):
    if net.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -----------------------------------------------------------------------------
# 8. Memory estimator and the command line
#
# The paper's formula, in the same kinds as Zero.memory(): a test holds the two equal on a real model,
# and `python zero.py estimate` prints the paper's 7.5B-parameter, 64-GPU example.

def estimate_memory(num_params, world_size, stage, dtype="fp16", offload=False):
    """The ZeRO paper's model-state bytes per rank: params and grads in the compute dtype,
    fp32 master (none in fp32 compute) and two fp32 Adam moments, each sharded by the stage."""
    if dtype not in DTYPES:
        raise ValueError(f"estimate_memory: dtype={dtype!r}; use one of {list(DTYPES)}")
    psi, n = num_params, world_size
    # bytes per parameter: p for the 16-bit (or fp32) params and grads, 4 for the master, 4+4 for Adam
    p = DTYPES[dtype].itemsize
    master = 0 if dtype == "fp32" and not offload else 4
    # each stage divides one more kind by N: 1 the optimizer states, 2 the gradients, 3 the parameters
    dev = dict(params=p * psi / (n if stage >= 3 else 1), grads=p * psi / (n if stage >= 2 else 1),
               master=master * psi / (n if stage >= 1 else 1), optim=8 * psi / (n if stage >= 1 else 1))
    host = dict(params=0, grads=0, master=0, optim=0)
    # offload moves the gradient shard (as fp32), master and moments to the host; stage 1 still keeps
    # its whole gradient on the device
    if offload:
        host.update(grads=4 * psi / n, master=dev["master"], optim=dev["optim"])
        dev.update(master=0, optim=0, grads=dev["grads"] if stage == 1 else 0)
    r = lambda d: {k: int(round(v)) for k, v in d.items()}
    return dict(device=r(dev), host=r(host))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="zero.py", description=__doc__.split("\n")[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate", help="model-state memory per rank for each stage (the ZeRO paper's formula)")
    e.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 7.5e9")
    e.add_argument("--world-size", type=int, required=True)
    e.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    c = sub.add_parser("consolidate", help="a sharded checkpoint to one plain fp32 state_dict file")
    c.add_argument("ckpt")
    c.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "estimate":
        # the per-rank table of the ZeRO paper's Figure 1 (one row per stage)
        print(f"model states per rank, {a.params:.4g} params, {a.world_size} ranks, {a.dtype} + fp32 Adam (GB = 1e9 B)")
        print(f"{'stage':>5} {'params':>9} {'grads':>9} {'master':>9} {'optim':>9} {'total':>9}")
        for s in range(4):
            d = estimate_memory(a.params, a.world_size, s, a.dtype)["device"]
            print(f"{s:>5} " + " ".join(f"{d[k] / 1e9:>9.4g}" for k in ("params", "grads", "master", "optim"))
                  + f" {sum(d.values()) / 1e9:>9.1f}")
    elif a.cmd == "consolidate":
        # no processes, no GPU: the rank files are read straight from disk
        torch.save(consolidate(a.ckpt), a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
