"""
zero.py: ZeRO data parallelism for PyTorch in one file.

Stages 0-3 of "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (Rajbhandari et al., 2020)
by reduce-scatter / all-gather over torch.distributed: fp16/bf16 compute on fp32 master weights, dynamic loss
scaling, activation recompute, ZeRO-Offload's CPU Adam (Ren et al., 2021), hybrid sharding, frozen parameters
sharded like the rest (LoRA), models built on the meta device, torch's optimizers and LR schedulers, sharded
checkpoints, and a ledger of memory and communication. The same code runs on CUDA/NCCL and on CPU/gloo.

    import zero
    rank, world_size, device = zero.init_distributed()
    model = zero.Zero(model, zero.Config(stage=3, dtype="bf16"), optimizer=opt)   # opt: your torch AdamW
    loss = model(x, y); model.backward(loss); opt.step()   # the engine is called, and read, like the model
    with torch.device("meta"): big = Model()               # shapes only: built unit by unit in Zero
    engine = zero.Zero(big, cfg); engine.load_state_dict(torch.load(f, mmap=True))

    torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3
    python zero.py estimate --params 7.5e9 --world-size 64 [--shard-group 8] [--frozen-params 3e10]
    python zero.py consolidate CKPT_DIR OUT.pt

Sections, in the order data flows: 1. Config  2. Distributed setup and collectives (with the ledger)
3. Loss scaler  4. AdamW (one kernel for device and host)  5. Units and flat buffers  6. Engine: building,
gathering, hooks, backward, step, offload, state_dicts  7. Checkpoints  8. Memory estimator, command line
"""

import argparse
import atexit
import collections
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import hashlib
import heapq
import itertools
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint as recompute

# -----------------------------------------------------------------------------
# 1. Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch's names and dtypes are taken too (nanoGPT's dtype="bfloat16", torch.float16)
_DTYPE_NAMES = {**{k: k for k in DTYPES}, "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                **{v: k for k, v in DTYPES.items()}}


@dataclasses.dataclass
class Config:
    stage: int = 2                  # 0 plain data parallel | 1 shard optimizer states | 2 + gradients | 3 + parameters
    dtype: str = "bf16"             # compute dtype of parameters and gradients: "fp32" | "bf16" | "fp16"
    reduce_dtype: str = ""          # gradient reductions and their sum over micro-batches: "" = dtype | "fp32"
    frozen_dtype: str = ""          # frozen parameters: "" = held in dtype | "fp32": exact, cast when gathered
    lr: float = 3e-4                # AdamW learning rate (a scheduler on engine.optimizer changes it)
    betas: tuple = (0.9, 0.95)      # AdamW moment decay rates
    eps: float = 1e-8               # AdamW denominator epsilon
    weight_decay: float = 0.1       # decoupled weight decay (parameters in no param group: those of >= 2 dims)
    grad_clip: float = 1.0          # clip the global gradient norm to this; 0 turns clipping off
    accum_steps: int = 1            # micro-batches (backward calls) per optimizer step
    checkpoint: object = False      # recompute activations: False | True (every unit) | k (every k-th unit)
    offload: bool = False           # ZeRO-Offload: master weights, Adam moments, grad shard on the host (stages 1-3)
    shard_group: int = 0            # hybrid sharding: shard across groups of this many consecutive ranks (a node),
                                    # replicate across the groups; 0 = all ranks (stages 1-3)
    prefetch: bool = True           # stage 3: start the next unit's all-gather while this one computes
    loss_scale: float = 2.0 ** 16   # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000   # fp16: clean steps before the scale doubles
    hysteresis: int = 2             # fp16: overflows tolerated before the scale starts halving
    min_loss_scale: float = 1.0     # fp16: the scale never drops below this
    timeout_s: float = 300.0        # every process group the engine makes ends a hang (and its setup) after this
    waits: str = "auto"             # "nccl": stream-ordered waits, the CPU runs ahead of the device | "gloo": timed
                                    # waits on the CPU | "auto": those of the process group's backend
    check_calls: bool = False       # every forward/backward/step checked across ranks at once (a store round trip
                                    # each; also TORCH_DISTRIBUTED_DEBUG=DETAIL); default: by the step's fingerprint

    def validate(self):
        def bad(what, fix):
            raise ValueError(f"zero.Config: {what}; {fix}")
        name = lambda x: _DTYPE_NAMES.get(x) if isinstance(x, (str, torch.dtype)) else None   # noqa: E731
        if self.stage not in (0, 1, 2, 3):
            bad(f"stage={self.stage!r} does not exist", "use 0 (plain DP), 1, 2 or 3")
        if name(self.dtype) is None:
            bad(f"dtype={self.dtype!r} is not supported", f"use one of {list(DTYPES)}, or torch's names")
        self.dtype = name(self.dtype)
        for k in ("reduce_dtype", "frozen_dtype"):    # "", or the compute dtype itself: nothing extra
            v = getattr(self, k) or ""
            if v and name(v) not in ("fp32", self.dtype):
                bad(f"{k}={v!r}", 'use "" (the compute dtype) or "fp32"')
            setattr(self, k, "fp32" if v and name(v) != self.dtype else "")
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
        if not (isinstance(self.shard_group, int) and self.shard_group >= 0) or (self.stage == 0 and self.shard_group):
            bad(f"shard_group={self.shard_group!r} at stage {self.stage}", "use 0 (all ranks), or k ranks per shard "
                "group at stages 1-3")
        if self.timeout_s <= 0 or self.waits not in ("auto", "nccl", "gloo"):
            bad(f"timeout_s={self.timeout_s!r}, waits={self.waits!r}", 'use seconds > 0 and "auto", "nccl" or "gloo"')
        return self


# -----------------------------------------------------------------------------
# 2. Distributed setup and collectives
#
# All-reduce (stage 0's gradients), reduce-scatter (a gradient summed over ranks, each keeping its slice) and
# all-gather (each rank's slice of the parameters to all) carry ZeRO, one call per unit's flat buffer. With one
# process they turn into copies, or nothing: the same code runs.

def init_distributed(timeout_s=300.0):
    """Join the torchrun job described by RANK/WORLD_SIZE/LOCAL_RANK; one process when they are absent."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    # LOCAL_RANK counts the node's GPUs; a process shown one GPU (CUDA_VISIBLE_DEVICES per rank) takes that one
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)       # before NCCL starts, or every rank talks through GPU 0
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


# torch 2.13 renamed the flat collectives (>= 2.4 has the old names); looked up at each call, so that a test can
# wrap them (the suite's NCCL-like harness does)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce, _broadcast = dist.all_reduce, dist.broadcast
_GROUPS = {}   # (ranks, purpose, world, timeout) -> process group, made once per process, shared by its engines
RARE = ("full_state_dict", "load_state_dict", "save", "load")   # calls a script may make on one rank only
EVERY_RANK = ("every rank must call forward (at stage 3, or with offload), backward, step, full_state_dict, "
              "load_state_dict, zero.save and zero.load together (evaluate and save on every rank; Hugging Face's "
              "generate() at stage 3: synced_gpus=True)")


def _device(pg):
    # the engine computes where its process group talks: NCCL ranks on their GPU, gloo ranks on the CPU (a group
    # made without a backend has both: its device types say which the GPU's tensors take)
    config = str(dist.get_backend_config(pg)) if pg is not None and hasattr(dist, "get_backend_config") else ""
    if not torch.cuda.is_available() or (pg is not None and "nccl" not in config + str(dist.get_backend(pg))):
        return torch.device("cpu")
    want = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())) % torch.cuda.device_count()
    if torch.cuda.current_device() != want:
        raise RuntimeError(f"zero: this rank's CUDA device is cuda:{torch.cuda.current_device()}, LOCAL_RANK gives "
                           f"cuda:{want}: call torch.cuda.set_device({want}) first (zero.init_distributed does)")
    return torch.device("cuda", want)


def fingerprint(trace):
    """A step's collectives and calls as 4 integers of 12 bits: summed over N ranks with their squares in fp64,
    all ranks agree iff N * sum(c^2) == sum(c)^2 for each, exactly while N < 2^29 (sums below 2^53)."""
    h = int.from_bytes(hashlib.blake2b(repr(trace).encode(), digest_size=6).digest(), "little")
    return [(h >> (12 * i)) & 0xFFF for i in range(4)]


def divide_factors(n):
    """The mean over n gradients (ranks x micro-batches) as a divide by `pre` before the sum and by n / pre after,
    pre the power of two nearest below sqrt(n) (FSDP divides so too): fp16 parts lose log2(pre) bits of range to
    underflow, not log2(n), and their sum, ~n / pre times a part, stays as far from overflow."""
    pre = 1 << (math.isqrt(n).bit_length() - 1)
    return pre, n / pre


class Comm:
    """The engine's collectives, all on process groups made with Config.timeout_s: `shard` (all-gathers of
    parameters, reductions of gradients: one communicator, as FSDP2, so that one order is trivially merged),
    `replica` (hybrid: the reduced shard summed across shard groups) and `world` (the step's one all-reduce, the
    setup's broadcasts, Python objects; the shard group itself without hybrid). Each launch is asynchronous,
    counted in a ledger as a ring sends it (all-reduce 2M(n-1)/n, reduce-scatter and all-gather M(n-1)/n elements
    for M on n ranks) and traced as (kind, unit) for the step's fingerprint. No call is checked across ranks per
    forward or backward: the step's fingerprint does that (Config.check_calls: every call, at once)."""

    def __init__(self, cfg, group=None):
        self.timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.ledger, self.trace = {}, []    # bytes per kind; launches and calls since the step
        up = dist.is_available() and dist.is_initialized()
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if up else [0]
        self.world, self.rank = len(self.ranks), self.ranks.index(dist.get_rank()) if up else 0
        self.device = _device(group or dist.group.WORLD if up else None)
        # NCCL's untimed wait orders streams and lets the CPU go on (a timed one blocks it until the device is
        # done); gloo's blocks the CPU anyway, with a timeout. Config.waits picks either, to test the other
        self.stream_waits = self.device.type == "cuda" if cfg.waits == "auto" else cfg.waits == "nccl"
        k = (cfg.shard_group if cfg.stage else 0) or self.world
        if self.world % k:
            raise ValueError(f"zero.Config: shard_group={k} does not divide the {self.world} ranks; use a divisor "
                             "(the ranks of one node, LOCAL_WORLD_SIZE)")
        # a user's group on a default group bound to a device: NCCL splits sub-groups from the parent, which
        # every parent rank must then join
        bound = group is not None and getattr(dist.group.WORLD, "bound_device_id", None) is not None
        if bound and k < self.world:
            raise ValueError("zero.Zero: hybrid sharding on group= needs sub-groups, which NCCL splits from a "
                             "default group bound to a device (init_process_group(device_id=...)): every rank "
                             "would have to build the engine. Init without device_id, or pass no group")
        # shard group: k consecutive ranks holding one copy of the model states; replica group: the ranks holding
        # the same shard, one per shard group
        self.shards, self.shard_rank, self.replica, self.replicas = k, self.rank % k, self.rank // k, self.world // k
        subsets = dict(shard=[self.ranks[i:i + k] for i in range(0, self.world, k)],
                       replica=[self.ranks[j::k] for j in range(k)] if k < self.world else [],
                       world=[self.ranks] if k < self.world else [])
        self.groups = {}
        for purpose, sets in subsets.items():
            for s in sets:                  # every rank makes every group, in one order (new_group is collective)
                key = (tuple(s), purpose, id(dist.group.WORLD), cfg.timeout_s)
                if len(s) > 1 and key not in _GROUPS and not bound:
                    _GROUPS[key] = dist.new_group(list(s), timeout=self.timeout,
                                                  use_local_synchronization=group is not None)
                if self.ranks[self.rank] in s:      # (bound: the user's group itself, with its own timeout)
                    self.groups[purpose] = (group if bound and len(s) > 1 else _GROUPS.get(key), len(s))
        self.groups.setdefault("world", self.groups["shard"])
        # per-call records, for the error that says what each rank called; the store, where torch has one
        self.calls, self.log = collections.Counter(), collections.deque(maxlen=6)
        self.check_calls = cfg.check_calls or os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
        serial = _SERIALS.setdefault(tuple(self.ranks), itertools.count())
        self.prefix = f"zero/{'-'.join(map(str, self.ranks))[:64]}/{next(serial)}"
        self.store = None
        if self.world > 1:
            with contextlib.suppress(Exception):
                self.store = dist.distributed_c10d._get_default_store()
            # NCCL makes a communicator at its first call: here, not at peak memory
            for pg, n in {id(g): (g, n) for g, n in self.groups.values()}.values():
                self.wait(_all_reduce(torch.zeros(1, device=self.device), group=pg, async_op=True))

    def count(self, kind, elems, elem_size):
        calls, e, b = self.ledger.get(kind, (0, 0, 0))
        self.ledger[kind] = (calls + 1, e + elems, b + elems * elem_size)

    def wait(self, work):
        # a failure, a dead or a stalled rank (the group's timeout ends the collective) becomes this error
        try:
            done = True if work is None else work if isinstance(work, Exception) else \
                work.wait() if self.stream_waits else work.wait(self.timeout)
        except RuntimeError as e:           # gloo raises on a timeout, on sizes that differ, on a dead peer
            done = e
        if done is not True:
            raise RuntimeError(f"zero: a collective failed or did not finish in {self.timeout}: another rank died, "
                               f"stalled or made other calls ({self.report()}); if just slow, raise "
                               f"Config.timeout_s; {EVERY_RANK}") from (done or None)

    def _launch(self, collective, purpose, kind, t, ring, tag, sync, *tensors):
        pg, n = self.groups.get(purpose, (None, 1))
        self.count(kind, t.numel() * ring * (n - 1) // n, t.element_size())   # exact: units pad to n
        self.trace.append((kind, tag))
        if n == 1:                          # one rank: its slice is the whole tensor
            if len(tensors) == 2 and tensors[0].data_ptr() != tensors[1].data_ptr():
                tensors[0].copy_(tensors[1])
            return None
        work = collective(*tensors, group=pg, async_op=True)
        return self.wait(work) if sync else work

    def all_reduce(self, t, purpose="world", kind="scalar", sync=True, tag=None):
        return self._launch(_all_reduce, purpose, kind, t, 2, tag, sync, t)

    def reduce_scatter(self, out, inp, sync=True, tag=None):   # out may be inp's own slice: reduced in place
        return self._launch(_reduce_scatter, "shard", "reduce_scatter", inp, 1, tag, sync, out, inp)

    def all_gather(self, out, inp, kind="all_gather", sync=True, tag=None):   # inp may be out's own slice
        return self._launch(_all_gather, "shard", kind, out, 1, tag, sync, out, inp)

    def broadcast(self, t):                 # the setup: every rank starts from the first rank's values
        pg, n = self.groups["world"]
        if n > 1:
            self.wait(_broadcast(t, self.ranks[0], group=pg, async_op=True))

    def same(self, h):
        # whether every rank has the same integer h (< 2^62): one tiny all-reduce, MAX of h and of -h
        pg, n = self.groups["world"]
        t = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        if n > 1:
            self.wait(_all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True))
        return bool(t[0] == -t[1])

    def all_gather_object(self, obj):       # Python objects (the setup's, the first backward's, a save's)
        out = [obj] * self.world
        if self.world > 1:
            try:
                dist.all_gather_object(out, obj, group=self.groups["world"][0])
            except RuntimeError as e:       # (a stalled, dead or diverged rank, as in wait())
                self.wait(e)
        return out

    def agree(self, what, check=False):
        """A collective-taking call (the engine's n-th): recorded, and counted in the step's fingerprint. The
        calls a script may make on one rank only, those after evaluation forwards (an evaluation split unevenly
        over the ranks: `check`), and every call with Config.check_calls are checked before their collectives,
        through the store: each rank counts itself in at key n under its call; all go on once one call has all.
        (A collective one rank makes alone would pair with another's: gloo aborts, NCCL hangs or mixes them.)"""
        self.calls[what] += 1
        n = sum(self.calls.values())
        self.log.append(f"{what}() #{n}")
        self.trace.append((what, None))
        if self.store is None or not (what in RARE or check or self.check_calls):
            return
        key = f"{self.prefix}/call{n}"
        try:
            self.store.set(f"{key}/{self.rank}", what)
            if self.store.add(f"{key}/{what}", 1) == self.world:
                self.store.set(f"{key}/all", what)
            self.store.wait([f"{key}/all"], self.timeout)
        except Exception as e:              # (the store's timeout)
            raise RuntimeError(f"zero: {what}() #{n}: the other ranks did not make this call within {self.timeout} "
                               f"({self.report()}); {EVERY_RANK}") from e

    def report(self):
        # what each rank called, from the store: this rank's last calls written, the others' read (those that
        # failed too write theirs), with how many of each call each made where they differ
        if self.store is None:
            return f"rank {self.rank} called " + ", ".join(self.log)
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}/last/{self.rank}", json.dumps([dict(self.calls), list(self.log)]))
        seen, deadline = {}, time.monotonic() + min(3.0, self.timeout.total_seconds() / 2)
        while len(seen) < self.world and time.monotonic() < deadline:
            for r in range(self.world):
                k = f"{self.prefix}/last/{r}"
                with contextlib.suppress(Exception):
                    if r not in seen and self.store.check([k]):
                        seen[r] = json.loads(self.store.get(k))
            time.sleep(0.05 * (len(seen) < self.world))
        more = []
        for what in CALLS:                  # "rank 1 made 1 forward() more than rank 0"
            counts = {r: c.get(what, 0) for r, (c, _) in seen.items()}
            if len(set(counts.values())) > 1:
                lo = min(counts, key=counts.get)
                more += [f"rank {r} made {c - counts[lo]} {what}() more than rank {lo}" for r, c in counts.items()
                         if c > counts[lo]][:4]
        last = "; ".join(f"rank {r}: {log[-1]} (after {', '.join(log[-3:-1]) or 'nothing'})" for r, (_, log) in
                         sorted(seen.items())[:8] if log)
        return "; ".join(more + [last or "no other rank said what it called"])


CALLS = ("forward", "no_grad forward", "backward", "step") + RARE
_SERIALS = {}                               # ranks -> a counter of the engines made on them, the same on each


# -----------------------------------------------------------------------------
# 3. Loss scaler
#
# fp16 keeps 5 exponent bits: gradients under ~6e-8 flush to zero. A large loss scale lifts them into range; a
# too-large one overflows to inf, which the step detects (the norm is not finite), skips, and answers.

class LossScaler:
    """Dynamic loss scale for fp16 (DeepSpeed's rule): double after `window` clean steps; on overflow skip the
    step, and once `hysteresis` overflows are used up, halve the scale."""

    def __init__(self, cfg):
        self.enabled = cfg.dtype == "fp16"
        self.scale = cfg.loss_scale if self.enabled else 1.0
        self.window, self.hysteresis, self.floor = cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale
        self.clean_steps, self.hysteresis_left = 0, cfg.hysteresis

    def update(self, overflow):
        if not self.enabled:
            return
        if not overflow:                    # a scale that never grows wastes fp16's range
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.scale, self.clean_steps, self.hysteresis_left = self.scale * 2, 0, self.hysteresis
        elif self.hysteresis_left > 1:      # a lone overflow (hysteresis) costs no halving, the next ones do
            self.clean_steps, self.hysteresis_left = 0, self.hysteresis_left - 1
        elif self.scale <= self.floor:      # halving cannot help: keep skipping, and say so
            self.clean_steps = 0
            warnings.warn(f"zero: fp16 gradients overflow at the minimum loss scale {self.floor}; the step is "
                          "skipped again. The model produces inf/nan: lower the lr, check the data, or use bf16.")
        else:
            self.clean_steps, self.scale = 0, max(self.scale / 2, self.floor)

    def state_dict(self):
        return dict(scale=self.scale, clean_steps=self.clean_steps, hysteresis_left=self.hysteresis_left)

    def load_state_dict(self, sd):
        self.scale, self.clean_steps, self.hysteresis_left = sd["scale"], sd["clean_steps"], sd["hysteresis_left"]


# -----------------------------------------------------------------------------
# 4. AdamW
#
# The update runs on this rank's fp32 slice: master, exp_avg, exp_avg_sq, 12 bytes per parameter (the paper's
# K). It is memory-bound: the bytes it moves are its cost. On CUDA torch's fused AdamW does it in one pass; on
# the CPU (ZeRO-Offload's host update, CPU training) a short C kernel does what torch's does, operation for
# operation, in one pass that also reads a bf16 gradient and writes the bf16 copy of the weights (28-30 bytes
# per parameter; torch's kernel and a copy make two passes). Built once with the system's C compiler into
# ~/.cache/zero_py; without one, zero warns once and uses torch's kernel.

ADAMW_C = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
static inline float bf16_in(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_out(float f) {  /* round to nearest even; NaN stays NaN, as torch's .to() */
  uint32_t u; memcpy(&u, &f, 4); return f != f ? 0xffff : (u + 0x7fff + ((u >> 16) & 1)) >> 16; }
typedef struct { float decay, scale, w, b2, w2, nstep, bc2s, eps, hi, lo; } hyper;  /* adamw_step fills 8, adamw 2 */
/* one parameter, as ATen's fused CPU AdamW computes it (built with -ffp-contract=off: only these fmaf fuse) */
static inline __attribute__((always_inline)) float update(int bg, int div, int64_t i, float *p, const void *g,
    float *m, float *v, hyper h) {
  const int near = fabsf(h.w) < 0.5f; const float wl = near ? h.w : h.w - 1;  /* torch's lerp, exact at both ends */
  float gi = bg ? bf16_in(((const uint16_t *)g)[i]) : ((const float *)g)[i];
  if (div) gi /= h.scale;
  float mi = fmaf(wl, gi - m[i], near ? m[i] : gi), vi = fmaf(h.w2 * gi, gi, v[i] * h.b2);
  /* sqrt(vi) / bc2s, no divide (the divider bounds this loop): q within an ulp, Markstein's fma step rounds it */
  float s = sqrtf(vi), q = fmaf(s, h.hi, s * h.lo), r = fmaf(-q, h.bc2s, s);   /* s: 0, normal, inf or NaN */
  float pi = p[i] * h.decay + h.nstep * mi / ((s < INFINITY ? fmaf(r, h.hi, q) : s) + h.eps);
  p[i] = pi; m[i] = mi; v[i] = vi; return pi;
}
static inline __attribute__((always_inline)) void body(int bg, int ob, int div, int64_t i, int64_t b,
    float *restrict p, const void *restrict g, float *restrict m, float *restrict v, uint16_t *restrict out, hyper h) {
#ifdef __SSE2__  /* out is only written: whole 64-byte lines go by streaming stores, which skip reading them first */
  for (; ob && i < b && (uintptr_t)(out + i) % 64; i++) out[i] = bf16_out(update(bg, div, i, p, g, m, v, h));
  for (uint16_t t[32] __attribute__((aligned(64))); i + 32 <= b; i += 32) {
    for (int j = 512; j < 544; j += 16)  /* 2 KB ahead: more lines in flight than the hardware prefetcher keeps */
      __builtin_prefetch(p + i + j, 1), __builtin_prefetch(m + i + j, 1), __builtin_prefetch(v + i + j, 1),
      __builtin_prefetch((const char *)g + (i + j) * (bg ? 2 : 4), 0);
    for (int j = 0; j < 32; j++) t[j] = bf16_out(update(bg, div, i + j, p, g, m, v, h));
    for (int j = 0; ob && j < 4; j++) _mm_stream_si128((__m128i *)(out + i) + j, _mm_load_si128((__m128i *)t + j));
  }
#endif
  for (; i < b; i++) { float pi = update(bg, div, i, p, g, m, v, h); if (ob) out[i] = bf16_out(pi); }
}
/* kind: bit 0 a bf16 grad, bit 1 a bf16 out, bit 2 a loss scale or clip to divide by; each its own loop */
#define K(k) case k: body(k & 1, k >> 1 & 1, k >> 2, a, b, p, g, m, v, out, h); break;
/* the threads share *next and take a block at a time until none is left: one held up does less of the work */
void adamw(int kind, int64_t n, int64_t *next, float *p, const void *g, float *m, float *v, uint16_t *out,
           const hyper *hp) {
  hyper h = *hp; h.hi = 1 / h.bc2s, h.lo = (float)((1 - (double)h.bc2s * h.hi) / h.bc2s);  /* hi + lo: 1 / bc2s */
  for (int64_t a, b; (a = __atomic_fetch_add(next, 1 << 16, __ATOMIC_RELAXED)) < n;)
    switch (b = a + (1 << 16) < n ? a + (1 << 16) : n, kind) { K(0) K(1) K(2) K(3) K(4) K(5) K(6) K(7) }
#ifdef __SSE2__
  _mm_sfence();  /* streaming stores are weakly ordered: all visible before the caller goes on */
#endif
}
"""
# -fno-math-errno lets sqrtf vectorise; no -ffast-math, which changes rounding and NaNs
ADAMW_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
MIN_PER_THREAD = 1 << 17    # parameters: waking another thread for fewer costs more than it saves
_kernel, _kernel_lock, _pools = [], threading.Lock(), {}   # _kernel: [] untried, [fn], or [None] (failed)


def _build_kernel():
    """Compile ADAMW_C once per source, compiler and CPU (a -march=native binary must never reach another CPU
    through a shared home) into the user's cache, and load it."""
    cc, cpu = os.environ.get("CC", "cc"), platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:   # what -march=native sees
        cpu = next((line for line in f if line.startswith(("flags", "Features"))), cpu)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([ADAMW_C, *ADAMW_FLAGS, version, cpu]).encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zero_py")
    so = os.path.join(cache, f"adamw-{key}.so")
    if not os.path.exists(so):       # processes starting together each build in a directory of their own
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, "adamw.c")
            with open(src, "w") as f:
                f.write(ADAMW_C)
            r = subprocess.run([cc, *ADAMW_FLAGS, "-o", src + ".so", src], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-300:]}")
            os.replace(src + ".so", so)
    fn = ctypes.CDLL(so).adamw
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 7, None
    return fn


def _cpu_kernel():
    # the C kernel, or None where it cannot be built, with one warning saying why: slower, never fatal
    with _kernel_lock:
        if not _kernel:
            try:
                _kernel.append(_build_kernel())
            except Exception as e:
                _kernel.append(None)
                warnings.warn(f"zero: no C AdamW kernel ({type(e).__name__}: {e}); using torch's fused AdamW, "
                              "slower on the CPU when the gradient or the copy of the weights is 16-bit")
    return _kernel[0]


def _host_threads():
    # the cores this process may run on, shared by the node's ranks (torchrun's OMP_NUM_THREADS=1 holds torch to
    # one thread, however many cores are idle)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _parallel(fn, n, args):
    # fn(*args) here and, for a large call, on up to _host_threads() - 1 pool threads: Python threads (the kernel
    # releases the GIL), not OpenMP, as torch brings its own OpenMP
    k, helpers = min(_host_threads(), n // MIN_PER_THREAD), []
    if k > 1:
        with contextlib.suppress(RuntimeError):   # no new threads at interpreter exit: this one does it all
            pool = _pools.get(os.getpid()) or _pools.setdefault(os.getpid(), ThreadPoolExecutor(os.cpu_count()))
            helpers = [pool.submit(fn, *args) for _ in range(k - 1)]
    fn(*args)                       # the threads share the blocks: whichever run, the call completes
    for h in helpers:
        h.result()


def adamw_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult=1.0,
               out=None):
    """AdamW (decoupled weight decay) on 1-D fp32 master/moment tensors as torch's fused kernel computes it;
    grad_mult (loss unscale and clip) applied inside; `out`, if given, receives the updated master in its dtype.
    On the CPU one pass of the C kernel (fp32 or bf16 grad and out); on CUDA, for fp16 or without a compiler,
    torch's fused kernel, then out.copy_(master)."""
    ts = [master, grad, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    fn = _cpu_kernel() if master.is_cpu else None
    if fn is not None and out is not None and out.dtype == torch.float32:   # fp32 compute with offload
        adamw_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult)
        return out.copy_(master)
    if fn is not None and grad.dtype in (torch.float32, torch.bfloat16) and master.dtype == exp_avg.dtype == \
            exp_avg_sq.dtype == torch.float32 and (out is None or out.dtype == torch.bfloat16) and \
            all(t.is_cpu and t.is_contiguous() and t.numel() == master.numel() for t in ts):
        n, next_block = master.numel(), ctypes.c_int64(0)
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step   # in double, then rounded to float, as torch does
        consts = (ctypes.c_float * 10)(1 - lr * weight_decay, 1 / grad_mult, 1 - beta1, beta2, 1 - beta2,
                                       -lr / bc1, math.sqrt(bc2), eps)   # the kernel fills the last two
        kind = (grad.dtype == torch.bfloat16) + 2 * (out is not None) + 4 * (grad_mult != 1.0)
        return _parallel(fn, n, (kind, n, ctypes.addressof(next_block), *[t.data_ptr() for t in ts],
                                 *[None] * (out is None), consts))
    _torch_adamw(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult, out)


CONVERT_CHUNK = 1 << 22  # elements of a 16-bit gradient converted to fp32 at a time
_scratch = {}             # device -> the fp32 buffer they are converted into, reused across calls


def _torch_adamw(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult, out):
    # torch's fused kernel (its functional AdamW has this signature from torch 2.4 on). A 16-bit gradient goes
    # in chunks through a reused fp32 buffer: on a CPU a fresh fp32 copy costs more in page faults than the update
    n, steps = master.numel(), torch.zeros((), device=master.device)
    chunk = n if grad.dtype == torch.float32 else CONVERT_CHUNK
    inv_mult = torch.full((), 1.0 / grad_mult, device=master.device) if grad_mult != 1.0 else None   # divided by
    for a in range(0, n, chunk):
        b, g = min(n, a + chunk), grad[a:a + chunk]
        if g.dtype != torch.float32:
            buf = _scratch.get(master.device)
            if buf is None or buf.numel() < b - a:
                buf = _scratch[master.device] = torch.empty(chunk, device=master.device)
            g = buf[:b - a].copy_(g)
        steps.fill_(step - 1)           # the kernel counts it to `step`
        functional_adamw([master[a:b]], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [steps], fused=True,
                         grad_scale=inv_mult, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                         weight_decay=weight_decay, eps=eps, maximize=False)
    if out is not None:
        out.copy_(master)


# -----------------------------------------------------------------------------
# 5. Units and flat buffers
#
# A unit is the grain of every collective and of stage 3's gathering: small enough that a few whole ones cost
# little, large enough that each call moves many bytes. The default, a unit per transformer block and a root for
# the rest, is what FSDP users wrap by hand.

def find_units(model):
    """Default units: every element of each outermost nn.ModuleList (a block); units never nest."""
    units = []

    def visit(module):              # depth first, stopping at the first ModuleList on each path
        for child in module.children():
            units.extend(child) if isinstance(child, nn.ModuleList) else visit(child)
    visit(model)
    return units


class Flat:
    """The parameters of a unit that train, or those that are frozen, as views into one flat buffer.

    flat        the whole buffer in the compute dtype, padded to a multiple of the shard group's size (stage 3:
                its storage is freed between uses)
    lo, hi      the range this rank owns (stage 0, and frozen ones at stages 0-2: all of it)
    shard       stage 3: this rank's persistent slice of flat, the all-gather's input
    master      the owned slice in fp32 (frozen ones: only with frozen_dtype="fp32"); fp32 compute without
                offload: the owned parameters themselves
    grad        the whole gradient, in the reduce dtype (stages 0-1: kept; 2-3: only while it is reduced)
    grad_shard  the reduced owned slice (host with offload); acc: its sum over micro-batches on the device
                (offload with accumulation at stages 2-3: sent to the host once per step)
    exp_avg, exp_avg_sq, staging   Adam's moments of the owned slice (host with offload); offload on CUDA: the
                pinned 16-bit owned slice the host update writes first
    segments    (a, b, i): the owned piece [a, b) of parameter i, relative to lo
    steps, group, written, got     AdamW steps taken by each parameter (none without a gradient anywhere), its
                param group; those whose gradient is in `grad` / came in this accumulation window"""

    def __init__(self, named_params, trainable, shards, shard_rank, sharded):
        self.trainable = trainable
        self.names, self.params = [n for n, _ in named_params], [p for _, p in named_params]
        self.offsets = [sum(p.numel() for p in self.params[:i]) for i in range(len(self.params))]   # in flat
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // shards) * shards     # an equal shard for every rank, as collectives want
        size = self.padded // shards
        self.lo, self.hi = (shard_rank * size, (shard_rank + 1) * size) if sharded else (0, self.padded)
        self.segments = [(max(o, self.lo) - self.lo, min(o + p.numel(), self.hi) - self.lo, i)
                         for i, (p, o) in enumerate(zip(self.params, self.offsets))
                         if max(o, self.lo) < min(o + p.numel(), self.hi)]
        self.steps, self.group, self.written, self.got = [0] * len(self.params), [0] * len(self.params), set(), set()
        self.flat = self.shard = self.master = self.grad = self.grad_shard = self.acc = None   # made by Zero._build
        self.exp_avg = self.exp_avg_sq = self.staging = None


FREED, GATHERING, WHOLE = "freed", "gathering", "whole"


class Unit:
    """A block of the model (an element of its outermost ModuleList) or the root (everything else) with its flat
    buffers: the grain of the schedules. Its phase: FREED (stage 3 between uses, storage freed; stages 1-2 with
    offload, the others' slices stale after the host update) -> GATHERING (all-gathers in flight) -> WHOLE,
    moved by Zero._unshard and Zero._reshard. The root and units used outside their forward (keep) stay WHOLE
    from their forward to the end of the backward."""

    def __init__(self, index, module, name, flats):
        self.index, self.module, self.name, self.flats = index, module, name, flats
        self.train = next((f for f in flats if f.trainable), None)   # the trainable Flat, if any
        self.params = [p for f in flats for p in f.params]
        self.phase, self.works = WHOLE, []  # where the buffers stand; their all-gathers in flight
        self.keep = False                   # a parameter used outside the unit's forward: whole until backward ends
        self.grad_out = None                # its forward made an output that requires grad (None: never ran)
        self.call = None                    # the schedule's node of its running call (None: out of a forward)
        self.reduced = False                # this micro-batch's gradient collective was launched
        self.updated = threading.Event()    # offload: the host update of this unit is done
        self.updated.set()
        self.h2d = None                     # offload on CUDA: an event after the update's copy to the device


def _tree_map(fn, x, rebuild=True):
    """fn on every tensor of a module's inputs or outputs: tuples (named ones too), lists, dicts, dataclasses
    (Hugging Face's ModelOutput among them), rebuilt around fn's results (rebuild=False: only visited)."""
    go = functools.partial(_tree_map, fn, rebuild=rebuild)
    if isinstance(x, torch.Tensor):
        return fn(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        new = {f.name: go(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        return dataclasses.replace(x, **new) if rebuild else x
    if isinstance(x, dict):
        new = {k: go(v) for k, v in x.items()}
        return type(x)(new) if rebuild else x
    if isinstance(x, (list, tuple)):
        new = [go(v) for v in x]
        return (type(x)(*new) if hasattr(x, "_fields") else type(x)(new)) if rebuild else x
    return x


def _tensors(x):
    out = []
    _tree_map(out.append, x, rebuild=False)
    return out


class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs. Its backward runs once all their gradients are in, which is when the
    unit's own backward is done (FSDP2's post-backward signal): its reduction may launch, its memory go."""

    @staticmethod
    def forward(ctx, engine, unit, key, *xs):
        ctx.engine, ctx.unit, ctx.key = engine, unit, key
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._post_backward(ctx.unit, ctx.key)
        return (None, None, None, *grads)


# torch calls that read no values of a tensor
METADATA = {"__get__", "__set__", "requires_grad_", "size", "dim", "numel", "stride", "element_size", "is_contiguous",
            "is_floating_point", "register_hook", "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr",
            "storage_offset"}
_PLAIN = nn.Parameter.__torch_function__    # torch's dispatch, as for any nn.Parameter


class _Sharded(nn.Parameter):
    """The class of a parameter while its unit is not WHOLE (freed at stage 3, stale with offload before the
    next forward's gather), and in the first forward while it is not running. A torch call that reads it inside a
    forward is a parameter used outside its block: its unit is gathered and kept whole from then on, as the root
    is, and reduced with the root (its gradient may come late). Outside a forward the read would crash or
    mislead: it is an error. The unit's gather makes it an nn.Parameter again."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name, attr = getattr(func, "__name__", ""), getattr(getattr(func, "__self__", None), "__name__", "")
        for t in _tensors((args, kwargs)) if name not in METADATA or attr == "data" else ():
            if type(t) is _Sharded:
                engine = t._zero_owner[0]()
                if engine is None:          # (its engine was dropped: the plain tensor it is)
                    continue
                unit = engine.units[t._zero_owner[1]]
                if engine.depth == 0:
                    raise RuntimeError(f"zero: '{t._zero_name}' was read outside the model's forward, where its unit "
                                       "is not gathered (stage 3 between uses, offload before the next forward): read "
                                       "weights from engine.full_state_dict() (every rank calls it), or in the forward")
                unit.keep = True
                engine._unshard(unit)
                engine._mark(unit, False)
        return _PLAIN(func, types, args, kwargs or {})


def _on_grad(engine, j, i, p):
    # a gradient hook, held by torch's C++ side, where the collector cannot see it: it holds the engine weakly and
    # its unit by number, or the engine (and the model's memory) could never be freed
    if engine() is not None:
        engine()._on_grad(engine().units[j], i, p)


def _merge(seqs, extra=()):
    """One order of the nodes (segment, occurrence, unit) of every rank's calls, consistent with each rank's own
    order (a part of the true one where ranks skip different calls); ties, and `extra` nodes nobody ran, by the
    node itself; rank 0's order where the orders clash (a cycle)."""
    nodes = list(dict.fromkeys([x for s in seqs for x in s] + list(extra)))
    after, before = {x: set() for x in nodes}, dict.fromkeys(nodes, 0)
    for a, b in {(a, b) for s in seqs for a, b in zip(s, s[1:])}:
        after[a].add(b)
        before[b] += 1
    ready, out = [x for x in nodes if not before[x]], []
    heapq.heapify(ready)
    while ready:
        out.append(heapq.heappop(ready))
        for b in after[out[-1]]:
            before[b] -= 1
            if not before[b]:
                heapq.heappush(ready, b)
    return out if len(out) == len(nodes) else list(dict.fromkeys(list(seqs[0]) + nodes))


END = 1 << 30                               # a segment's end node sorts after its calls


class Schedule:
    """The one order of a micro-batch's gathers and reductions, the same on every rank whatever the data.

    A place is one call of a unit: the k-th call of unit u in the s-th forward of a micro-batch is the node
    (s, k, u), and `places` lists them in the order the forwards run them (a unit called twice has two places;
    two forwards before one backward are two segments). Forwards walk their segment, the backward walks the
    places in reverse (`back`): place by place, the unit there is gathered (at stage 3; one this rank did not
    call, in its turn, as the ranks that called it gather it), and once the backward is past a unit's last place
    its reduction may launch, in `launch` order. The invariant: every rank launches the same collectives in the
    same order, so that every wait is for a collective every rank has launched. The first backward learns the
    places from every rank's calls (before it: each unit once, in the order registered)."""

    def __init__(self, units, segments, without=frozenset(), keep=frozenset()):
        self.segments, self.without = segments, without
        self.places, self.node, self.ends = [], {}, []
        for s, seg in enumerate(segments):
            seen = collections.Counter()
            for u in seg:
                self.node[(s, seen[u.index], u.index)] = len(self.places)
                seen[u.index] += 1
                self.places.append(u)
            self.ends.append(len(self.places))
        # backward places (forward places in reverse), without units whose forward made nothing requiring grad
        self.back = [j for j in reversed(range(len(self.places))) if self.places[j].index not in without]
        self.bpos = {j: k for k, j in enumerate(self.back)}
        last = {self.places[j].index: k for k, j in enumerate(self.back)}   # a unit's last backward place
        self.keep = frozenset(keep)         # units whole from their forward to the end of the backward
        first = sorted((u for u in units if u.train and u.index in last and u.index not in self.keep),
                       key=lambda u: last[u.index])
        self.launch = first + [u for u in units if u.train and u not in first]
        self.last = {u.index: (last[u.index] if u in first else None) for u in self.launch}
        self.order = list(dict.fromkeys(self.places))   # units, as first called
        self.start_backward()

    def start_backward(self):
        self.done = self.gathered = self.launched = 0   # backward places done / gathered; units launched
        self.in_flight = collections.deque()            # (unit, work) of reductions launched, not yet waited for

    def next_launch(self, end):
        # the next unit to reduce, once the backward is past its last place (end: all the rest)
        if self.launched < len(self.launch):
            u = self.launch[self.launched]
            if end or (self.last[u.index] is not None and self.last[u.index] < self.done):
                self.launched += 1
                return u
        return None


class Walk:
    """A forward's progress along its segment of the schedule (an evaluation forward's: along the first)."""

    def __init__(self, sched, seg):
        self.seg, self.count = seg, collections.Counter()   # this forward's calls of each unit so far
        self.pos = sched.ends[seg - 1] if 0 < seg <= len(sched.ends) else 0
        self.end = sched.ends[seg] if seg < len(sched.ends) else self.pos   # a segment past the schedule: empty

    def place(self, sched, u):
        # the place of u's next call in this segment: None out of turn (called more often, or already passed)
        key = (self.seg, self.count[u.index], u.index)
        self.count[u.index] += 1
        j = sched.node.get(key)
        return key, (j if j is not None and self.pos <= j < self.end else None)


# -----------------------------------------------------------------------------
# 6. Engine
#
# What each stage keeps whole, and the model states it leaves per rank (Ψ params, N ranks, 16-bit compute,
# K = 12 bytes of fp32 master and Adam moments per parameter; with hybrid sharding N is the shard group):
#
#   stage  parameters              gradients                         master + Adam   bytes per rank
#   0      whole                   whole, all-reduced in backward    whole           (2 + 2 + K) Ψ
#   1      whole                   whole, reduce-scattered at step   sharded         4Ψ + KΨ/N
#   2      whole                   reduce-scattered in backward      sharded         2Ψ + (2 + K)Ψ/N
#   3      gathered per unit       reduce-scattered in backward      sharded         (2 + 2 + K)Ψ/N
#
# Frozen parameters (Ψf: no gradient, no optimizer state) are whole at stages 0-2, sharded at stage 3: 2Ψf or
# 2Ψf/N. Each difference of the stages is a named condition (shards_optim, shards_grads, shards_params,
# regathers, gathers_lazily), tested by name, never by stage number.
#
# A step: forward (stage 3 gathers each unit before it runs, frees it after) -> backward (a unit's gradient is
# reduced once its backward is done; stage 3 gathers it again first) -> step (norm, overflow check, clip, AdamW
# on the owned slice, its 16-bit rounding written, stages 1-2 all-gather it).
#
# One order of collectives on every rank, over all the process groups, whatever the data: a rank whose batch
# skips a block or reaches fewer experts must still pair each collective with the same one everywhere, and
# NCCL wants operations on different communicators submitted in one order. So forward and backward move along
# schedules that are the same on every rank: place by place the unit there is gathered (one this rank skipped
# too, in its turn), and once the backward is past a place that unit's reduction launches and its memory goes.
# Every wait is then for a collective every rank launched before anything launched since: no wait can
# deadlock, and the engine waits for the reduction two launches back, so that three whole-unit gradients are
# alive at most, however far the device lags. The step compares a fingerprint of the ranks' collectives.

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
# torch's Adam/AdamW group keys that zero's AdamW honours only at these values (foreach, fused: any value)
TORCH_DEFAULTS = dict(amsgrad=False, maximize=False, capturable=False, differentiable=False)
TORCH_ANY = {"foreach", "fused", "decoupled_weight_decay", "initial_lr"}
_ENGINES = weakref.WeakSet()        # every live engine: for the check of torch optimizers, and the exit


class ZeroOptimizer(torch.optim.Optimizer):
    """torch's face of the engine's AdamW: param_groups that LR schedulers and user code read and write (every
    step reads them); step() is engine.step(); zero_grad() has nothing to do."""

    def __init__(self, engine, groups, defaults):
        self.engine = engine
        super().__init__(groups, defaults)

    def step(self, closure=None):
        return self.engine._step()

    def zero_grad(self, set_to_none=True):
        pass                                # the engine moves each gradient into its flat buffer as it arrives

    def state_dict(self):
        raise RuntimeError("zero: the optimizer's state (fp32 master weights, Adam moments) lives in the engine's "
                           "shards: save and restore it with zero.save(engine, dir) / zero.load(engine, dir)")

    load_state_dict = state_dict


def _foreign_step(opt, args, kwargs):
    # a torch optimizer stepping parameters an engine owns changes nothing: the engine takes their gradients
    if not isinstance(opt, ZeroOptimizer) and any(id(p) in e.owned for e in _ENGINES for g in opt.param_groups
                                                  for p in g["params"]):
        raise RuntimeError(f"zero: a torch.optim.{type(opt).__name__} is stepping parameters that zero.Zero owns, "
                           "which changes nothing: pass it as zero.Zero(model, cfg, optimizer=opt) (its step() is "
                           "then the engine's), or call engine.step()")


register_optimizer_step_pre_hook(_foreign_step)
_torch_clip, _torch_compile = torch.nn.utils.clip_grad_norm_, torch.compile


@functools.wraps(_torch_clip)
def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    # a DDP script's torch.nn.utils.clip_grad_norm_(model.parameters(), c) on an engine's parameters, whose
    # gradients live in its shards (torch's would see none and return 0): the engine's, as under DDP
    ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = next((e for e in _ENGINES for p in ps[:1] if id(p) in e.owned), None)
    if engine is None:
        return _torch_clip(ps, max_norm, norm_type, error_if_nonfinite, foreach)
    if {id(p) for p in ps if p.requires_grad} != {id(p) for u in engine.units if u.train for p in u.train.params}:
        raise ValueError("zero: clip_grad_norm_ of some of the engine's parameters: zero clips all of them together; "
                         "pass model.parameters()")
    return engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


def _compile(model=None, **kwargs):
    # torch.compile(engine): the model inside it is compiled (as if compiled before wrapping), the engine returned
    if isinstance(model, Zero):
        model._forward = _torch_compile(model._forward, **kwargs)
        return model
    return _torch_compile(**kwargs) if model is None else _torch_compile(model, **kwargs)


torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_
torch.compile = functools.wraps(_torch_compile)(_compile)


@atexit.register
def _close_groups():
    # at exit, before Python finalizes, what is in flight is waited for and the engines' process groups destroyed,
    # so that their gloo threads end now: one dropping a finished collective's tensors once finalization began
    # aborts the process ("terminate called without an active exception"), as groups left to the teardown did
    engines = list(_ENGINES)
    try:
        for w in [w for e in engines for u in e.units for w in u.works] + [w for e in engines for _, w in
                                                                          e.sched.in_flight]:
            if w is not None:               # (one rank: nothing was launched)
                w.wait(datetime.timedelta(seconds=5))
    except RuntimeError:                    # a collective that failed or never ends: joining its thread could hang
        return
    for e in engines:
        e.sched.in_flight, e.net.groups = collections.deque(), {}
        for u in e.units:
            u.works = []
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    while groups:
        with contextlib.suppress(Exception):   # one the script destroyed already
            dist.destroy_process_group(groups[-1])
        del groups[-1]                      # its last reference: its threads are joined here


class Zero:
    """Wraps a model: shards it in place into units, hooks its forward and backward, and steps AdamW on this
    rank's shard. Call it like the model (its other attributes and methods are the model's), then backward(loss),
    then step()."""

    def __init__(self, model, cfg=None, units=None, init_fn=None, param_groups=None, group=None, optimizer=None):
        self.cfg = cfg = (cfg or Config()).validate()   # a bad config fails here, before any collective
        self.module, self._forward = getattr(model, "_orig_mod", model), model   # compiled first: its own names
        self.net = Comm(cfg, group)
        self.rank, self.world, self.device = self.net.rank, self.net.world, self.net.device
        self.dtype = DTYPES[cfg.dtype]
        self.grad_dtype = torch.float32 if cfg.reduce_dtype else self.dtype   # gradient reductions and sums
        self.scaler = LossScaler(cfg)
        self.divide = divide_factors(self.world * cfg.accum_steps)   # the mean: a divide before the sum, one after
        # -- what the stages differ in, one name each
        self.shards_optim = cfg.stage >= 1          # fp32 master weights and Adam moments: this rank's shard
        self.shards_grads = cfg.stage >= 2          # gradients reduce-scattered in backward, the whole ones freed
        self.shards_params = cfg.stage == 3         # parameters gathered per unit for each use, freed after
        self.regathers = cfg.stage in (1, 2)        # parameters whole: updated slices all-gathered after an update
        self.gathers_lazily = self.shards_params or cfg.offload   # forwards gather (offload: the host update's)
        self.host = torch.device("cpu") if cfg.offload else self.device   # where master, moments, grad shard live
        self.pin = cfg.offload and self.device.type == "cuda"             # pinned host memory, a staging copy
        self.master_is_param = self.dtype == torch.float32 and not cfg.offload   # fp32: no second copy
        # -- progress through a step
        self.step_count, self.grad_norm = 0, 0.0    # applied steps (an fp16 overflow skips one); the last norm
        self.clip = self.got = None                 # this step's clip_grad_norm_ max_norm; parameters with a grad
        self.micro = 0                              # backward calls since the last step
        self.in_backward = False                    # inside engine.backward: a bare loss.backward() is refused
        self.depth = 0                              # modules outside the units now running, one inside the other
        self.last_ran = None                        # the unit whose forward ran last
        self.ran = []                               # units whose forward ran since the last step, in order
        self.calls = []                             # this micro-batch's calls with a backward to come: nodes
        self.walk = None                            # the running forward's progress along the schedule
        self.segments = 0                           # forwards with a backward to come since the last backward
        self.evals = 0                              # forwards without one since the last with one (stage 3)
        self.learned = self.checked = False         # the first backward learned the order; the first forward ran
        self.worker = None                          # the offload thread
        self.norms = []                             # offload: the gradient shards' squared norms, on the device
        self.replica_works = []                     # hybrid: (flat, shard, work) of the replica sums in flight
        self.d2h = None                             # offload on CUDA: an event after the shards' copies to the host
        self.unfilled = set()                       # names built on the meta device that nothing initialized
        self.pinned = {}                            # offload on CUDA: kind -> [pinned block of host state, used]
        self.peak_gathered_bytes = 0                # stage 3: the most bytes of whole units held at once
        self.last_comm = {}                         # the last step's ledger
        self.names = {id(m): n for n, m in self.module.named_modules()}

        # -- which parameter goes to which unit: one of several units (a tied weight) goes to the root
        unit_modules = list(units) if units is not None else find_units(self.module)
        owners = {}                         # by identity: a parameter under two names counts once
        for i, m in enumerate(unit_modules):
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(i)
        named = list(self.module.named_parameters())   # each tensor once, under its first name
        if not any(p.requires_grad for _, p in named):
            raise ValueError("zero.Zero: the model has no trainable parameters (requires_grad=True); "
                             "pass the model you mean to train")
        members = [[] for _ in unit_modules] + [[]]    # the last: the root
        for n, p in named:
            o = owners.get(id(p), ())
            members[next(iter(o)) if len(o) == 1 else -1].append((n, p))
        net, unit_of, self.units = self.net, {}, []
        shards, shard_rank = (net.shards, net.shard_rank) if self.shards_optim else (self.world, self.rank)
        for m, ps in zip(unit_modules + [self.module], members):
            # trainable and frozen parameters in flat buffers of their own: frozen ones are gathered, never reduced
            flats = [Flat(part, tr, shards, shard_rank, self.shards_params or (tr and self.shards_optim))
                     for tr, part in ((True, [x for x in ps if x[1].requires_grad]),
                                      (False, [x for x in ps if not x[1].requires_grad])) if part]
            if flats:                       # a block without parameters is no unit
                unit_of[id(m)] = Unit(len(self.units), m, self.names.get(id(m)) or "root", flats)
                self.units.append(unit_of[id(m)])
        self.root = unit_of.get(id(self.module))
        self.owned = {id(p) for u in self.units for p in u.params}
        self.order = [u for u in self.units if u is not self.root]   # the blocks, as registered
        self.sched = Schedule(self.units, [self.order])
        self.optimizer = self._make_optimizer(param_groups, optimizer)
        self._check_ranks_agree()           # before the first collective that depends on the layout

        # -- one unit at a time: a model on the meta device becomes real here, then its unit is sharded and the
        # rest freed, so that no rank ever holds the whole model
        stop, self.made, self.placed, rounded = {id(m) for m in unit_modules}, set(), {}, []
        for m in unit_modules + [self.module]:
            mods = list(_post_order(m, stop - {id(m)}))   # the root: every module outside the units
            self._materialize(mods, init_fn)
            self._place_buffers(mods)
            rounded += self._build(unit_of[id(m)]) if id(m) in unit_of else []
        self._warn_rounded(rounded)

        # -- hooks: one per trainable parameter's gradient (once per backward, after autograd summed its uses); a
        # forward begins with the first module outside the units to start (the model, or a part called on its own,
        # as Hugging Face's generate() calls an encoder) and ends when it returns; each unit's forward
        for u in self.units:
            for i, p in enumerate(u.train.params if u.train else ()):
                p.register_post_accumulate_grad_hook(functools.partial(_on_grad, weakref.ref(self), u.index, i))
        for m in mods:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._exit, always_call=True)
        for u in self.order:
            u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u), with_kwargs=True)
            u.module.register_forward_hook(functools.partial(self._post_forward, u), with_kwargs=True)
        k = 1 if cfg.checkpoint is True else cfg.checkpoint   # recompute every k-th block (not the root's head)
        for j, u in enumerate(self.order if k else []):
            if j % k == 0:   # non-reentrant: dropout's RNG kept, inside the hooks (stage 3 gathers before it)
                u.module.forward = functools.partial(recompute, u.module.forward, use_reentrant=False)
        # the model's own state_dict would hold shards or stale 16-bit copies: both go through the engine
        self.module.state_dict, self.module.load_state_dict = self._refuse_state_dict, self.load_state_dict
        self.worker = HostWorker(self.device, cfg.timeout_s) if cfg.offload else None
        if self.worker:                     # the thread ends with the engine, or at exit after its jobs
            weakref.finalize(self, self.worker.close)
        self.ledger_reset()
        _ENGINES.add(self)

    def _make_optimizer(self, param_groups, optimizer):
        """torch's param groups, each parameter's group recorded in its flat buffer; parameters in none take
        Config's values, weight decay on >= 2-D ones only. A torch Adam/AdamW given instead lends its groups (the
        same dicts: its schedulers drive the engine), and its step() becomes the engine's."""
        c = self.cfg
        where = {id(p): (u.train, i) for u in self.units if u.train for i, p in enumerate(u.train.params)}
        name = {id(p): n for n, p in self.module.named_parameters()}
        if optimizer is not None and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"zero.Zero: optimizer={type(optimizer).__name__}; zero steps AdamW: pass a "
                             "torch.optim.AdamW (or Adam), or none")
        groups = optimizer.param_groups if optimizer is not None else list(param_groups or [])
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]  # a plain list of parameters: one group, as torch takes it
        out, seen = [], {}
        for j, g in enumerate(groups):
            unknown = sorted(set(g) - {"params", *GROUP_KEYS, *TORCH_DEFAULTS, *TORCH_ANY})
            bad = [f"{k}={g[k]}" for k, v in TORCH_DEFAULTS.items() if g.get(k, v) != v]
            if type(optimizer) is torch.optim.Adam and g["weight_decay"] and not g.get("decoupled_weight_decay"):
                bad.append(f"weight_decay={g['weight_decay']} as Adam's L2 penalty")
            if unknown or bad:
                raise ValueError(f"zero.Zero: param_groups[{j}] " + (f"has unknown keys {unknown}; zero's AdamW "
                                 f"takes {['params', *GROUP_KEYS]}" if unknown else f"sets {bad}, which zero's AdamW "
                                 "cannot do") + " (torch AdamW's other keys at their defaults)")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:                    # a torch optimizer may hold frozen parameters: they get no gradient
                if id(p) not in where and (optimizer is None or id(p) not in name):
                    what = f"'{name[id(p)]}', which does not require grad" if id(p) in name else \
                        f"a tensor of shape {tuple(p.shape)} that is not a parameter of the model"
                    raise ValueError(f"zero.Zero: param_groups[{j}] holds {what}; list the trainable parameters")
                if seen.setdefault(id(p), j) != j:
                    raise ValueError(f"zero.Zero: parameter '{name[id(p)]}' is in param_groups {seen[id(p)]} and "
                                     f"{j}; give each parameter one group")
            out.append(g if optimizer is not None else dict(g, params=list(dict.fromkeys(ps))))
        rest = [f.params[i] for f, i in where.values() if id(f.params[i]) not in seen]
        if optimizer is not None and rest:
            raise ValueError(f"zero.Zero: {[name[id(p)] for p in rest][:5]} require grad but are in no param group "
                             "of the optimizer; add them to it, or freeze them before zero.Zero")
        out += [g for g in (dict(params=[p for p in rest if p.dim() >= 2]),
                            dict(params=[p for p in rest if p.dim() < 2], weight_decay=0.0)) if g["params"]]
        for j, g in enumerate(out):
            for f, i in (where[id(p)] for p in g["params"] if id(p) in where):
                f.group[i] = j
        zopt = ZeroOptimizer(self, out, dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay))
        if optimizer is not None:           # from now on the script's optimizer is driven by the engine

            def step(closure=None):
                optimizer._opt_called = True    # what torch's LR schedulers look for
                return self.step()
            step._wrapped_by_lr_sched = True
            optimizer.step, optimizer.zero_grad = step, zopt.zero_grad
            optimizer.state_dict = optimizer.load_state_dict = zopt.state_dict
        return zopt

    def _check_ranks_agree(self):
        # ranks that disagree on the config or the model would hang in mismatched collectives: say what differs
        c = self.cfg
        layout = ";".join(f"{u.index}:{n}:{tuple(p.shape)}:{f.group[i]}:{f.trainable}" for u in self.units
                          for f in u.flats for i, (n, p) in enumerate(zip(f.names, f.params)))
        mine = dict(stage=c.stage, dtype=c.dtype, accum_steps=c.accum_steps, offload=c.offload, units=len(self.units),
                    params=sum(f.numel for u in self.units for f in u.flats), layout=zlib.crc32(layout.encode()),
                    config=zlib.crc32(repr(dataclasses.asdict(c)).encode()))
        if self.net.same(zlib.crc32(repr(mine).encode())):
            return
        every = self.net.all_gather_object(mine)    # only when they differ: what each rank has
        for r, row in enumerate(every):
            diff = [f"{k}: rank 0 has {a}, rank {r} has {row[k]}" for k, a in every[0].items() if a != row[k]]
            if diff:
                raise ValueError("zero.Zero: ranks disagree (" + "; ".join(diff) + "); launch every rank with "
                                 "the same model and the same zero.Config")

    # -- building: meta tensors made real, buffers placed, units sharded

    def _materialize(self, mods, init_fn):
        """Meta tensors of `mods` become real on the engine's device (the same Python objects: tied weights stay
        tied), initialized by init_fn(module) for each module or by each module's own reset_parameters(). What
        nothing initialized is marked unfilled: load_state_dict fills it; a forward or step before is an error."""
        made = []
        for m in mods:
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if t.is_meta and id(t) not in self.made:
                    new = torch.empty_like(t, device=self.device)   # with a marker no initializer writes
                    new.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min
                              if t.dtype != torch.bool else 0)
                    torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter)
                                             else new)
                    made.append((m, n))
                    self.made.add(id(t))
        with torch.no_grad():
            for m in dict.fromkeys(m for m, _ in made) if init_fn is None else mods if made else ():
                init_fn(m) if init_fn else m.reset_parameters() if callable(getattr(m, "reset_parameters", 0)) else 0
        for m, n in made:
            t = getattr(m, n)
            if t.isnan().any() if t.is_floating_point() else t.dtype != torch.bool and bool(
                    (t == torch.iinfo(t.dtype).min).all()):
                self.unfilled.add(self._name(m, n))

    def _place_buffers(self, mods):
        # buffers (norm statistics, masks, position tables) stay whole on every rank, floats in the compute dtype,
        # with rank 0's values, each tensor once however many modules share it
        for m in mods:
            for n, b in m.named_buffers(recurse=False):
                if id(b) not in self.placed:
                    new = b.to(self.device, self.dtype if b.is_floating_point() else b.dtype).contiguous()
                    self.net.broadcast(new)
                    self.placed[id(b)] = self.placed[id(new)] = new
                m._buffers[n] = self.placed[id(b)]

    def _name(self, module, attr):
        prefix = self.names.get(id(module), "")
        return f"{prefix}.{attr}" if prefix else attr

    def _state(self, kind, n, dtype=torch.float32, src=None):
        # shard state, zeros or a copy of src. Offload on CUDA carves it from one block per kind, registered with
        # CUDA at its exact size: torch's pinned allocator rounds each block up to a power of two, up to twice
        # what memory() counts (and pinned memory cannot be swapped)
        if not self.pin:
            t = torch.empty(n, dtype=dtype, device=self.host)
        else:
            if kind not in self.pinned:
                block = torch.empty(sum(u.train.hi - u.train.lo for u in self.units if u.train), dtype=dtype)
                self.pinned[kind] = [_pinned(block), 0]
            block, used = self.pinned[kind]
            t, self.pinned[kind][1] = block[used:used + n], used + n
        return t.copy_(src) if src is not None else t.zero_()

    def _build(self, u):
        cfg, rounded = self.cfg, []
        for f in u.flats:
            # one whole flat buffer in fp32 at a time: master weights start from the model's own values
            full = torch.zeros(f.padded, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for p, o in zip(f.params, f.offsets):
                    full[o:o + p.numel()].copy_(p.detach().reshape(-1))
            self.net.broadcast(full)        # every rank starts from rank 0's values
            f.flat, owned, n = full.to(self.dtype), full[f.lo:f.hi], f.hi - f.lo
            for name, p, o in zip(f.names, f.params, f.offsets):   # the model sees its parameters, as views
                p.data = f.flat[o:o + p.numel()].view(p.shape)     # into the buffer that one collective moves
                p._zero_name, p._zero_owner = name, (weakref.ref(self), u.index)
            if f.trainable:
                f.master = None if self.master_is_param else self._state("master", n, src=owned)
                f.exp_avg, f.exp_avg_sq = self._state("exp_avg", n), self._state("exp_avg_sq", n)
                if not self.shards_grads:   # the whole gradient stays; stage 1 owns a slice of it
                    f.grad = torch.zeros(f.padded, dtype=self.grad_dtype, device=self.device)
                    f.grad_shard = f.grad[f.lo:f.hi]
                if self.shards_grads or cfg.offload:
                    f.grad_shard = self._state("grad_shard", n, self.grad_dtype)
                if cfg.offload and self.shards_grads and (cfg.accum_steps > 1 or self.net.replicas > 1):
                    f.acc = torch.zeros(n, dtype=self.grad_dtype, device=self.device)
                f.staging = self._state("staging", n, self.dtype) if self.pin else None
            elif cfg.frozen_dtype:          # frozen in fp32, exact: the compute copy is made when gathered
                f.master = owned.clone()
            else:
                rounded += [n for n, p, o in zip(f.names, f.params, f.offsets) if n not in self.unfilled and
                            not torch.equal(full[o:o + p.numel()], f.flat[o:o + p.numel()].float())]
            if self.shards_params and (f.trainable or f.master is None):
                f.shard = f.flat[f.lo:f.hi].clone()     # the owned slice stays, the whole buffer goes
            if self.master_is_param and f.trainable:
                f.master = self._owned(f)
            del full, owned
        if self.shards_params:
            self._reshard(u)
        return rounded                      # frozen parameters whose values the compute dtype changes

    def _warn_rounded(self, names):
        if names:
            warnings.warn(f"zero: frozen parameters {names[:8]}{' ...' * (len(names) > 8)} change when rounded to "
                          f"{self.cfg.dtype}, in which zero holds them; pass Config(frozen_dtype='fp32') to keep "
                          "them exact (4 bytes each per shard, cast when gathered)")

    def _owned(self, f):
        # this rank's owned range of f's held values: the shard (stage 3) or its slice of the flat buffer
        return f.shard if self.shards_params else f.flat[f.lo:f.hi]

    def _param_out(self, f):
        # where an update (or a load) writes the owned values: nowhere when the master weights are the values
        out = self._owned(f)
        return None if out is None or (f.master is not None and out.data_ptr() == f.master.data_ptr()) else out

    def __call__(self, *args, **kwargs):
        cast = lambda t: t.to(self.dtype) if t.is_floating_point() else t   # noqa: E731 -- float inputs, as params
        return self._forward(*_tree_map(cast, args), **_tree_map(cast, kwargs))

    def __getattr__(self, name):
        # what a script asks of its model (generate(), config, parameters(), its own methods) is the model's
        if name.startswith("__") or "module" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["module"], name)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- a unit's two verbs, and the schedules

    def _unshard(self, u, wait=True):
        """FREED -> GATHERING: the all-gathers launched (stage 3: from the shards, straight into the buffers'
        storage; offload: from the slices the host update wrote) -> WHOLE, once waited for."""
        if u.phase == FREED:
            if self.worker:
                self.worker.wait(u)
            for f in u.flats if self.shards_params else [u.train]:
                if self.shards_params:
                    f.flat.untyped_storage().resize_(f.padded * f.flat.element_size())
                src = f.shard if f.shard is not None else f.master.to(self.dtype) if not f.trainable and \
                    f.master is not None else f.flat[f.lo:f.hi]
                kind = "all_gather" if f.trainable else "frozen_all_gather"   # the formulas count Ψ and Ψf apart
                u.works.append(self.net.all_gather(f.flat, src, kind, sync=False, tag=u.index))
            u.phase = GATHERING
            held = sum(f.flat.untyped_storage().nbytes() for v in self.units for f in v.flats)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)
        if wait and u.phase == GATHERING:
            for w in u.works:
                self.net.wait(w)
            u.works, u.phase = [], WHOLE
            self._mark(u, False)

    def _reshard(self, u):
        """WHOLE -> FREED: at stage 3 the storage goes back (the parameter views, and autograd's references to
        them, stay valid for the next gather); with offload at stages 1-2 the others' slices are stale."""
        for f in u.flats if self.shards_params else ():
            f.flat.untyped_storage().resize_(0)
        u.phase = FREED
        self._mark(u, True)

    def _mark(self, u, freed):
        # a parameter of a unit not WHOLE is a _Sharded: a read is then an error or a gather, never a crash
        for p in u.params if self.shards_params or not freed else u.train.params if u.train else ():
            if type(p) in (nn.Parameter, _Sharded):
                p.__class__ = _Sharded if freed else nn.Parameter

    def _release(self, u):
        # stage 3: a unit done with for now is freed, unless it stays whole (the root, escaped parameters)
        if self.shards_params and u.phase == WHOLE and not u.keep and u is not self.root:
            self._reshard(u)

    def _take(self, u, nxt, back):
        # u gathered, and the next unit's gather started to travel while u computes (with offload only once the
        # host update is done with it: waiting here would undo the overlap)
        self._unshard(self._in_turn(u))
        if nxt is not None and nxt is not u and self.cfg.prefetch and (back or self.gathers_lazily) and \
                nxt.updated.is_set():
            self._unshard(self._in_turn(nxt), wait=False)

    def _in_turn(self, u):
        # a unit whole on this rank alone (its parameters escaped here since the ranks last agreed) is gathered
        # again in its turn all the same, as the ranks that freed it gather it: the gathers stay one order
        if self.shards_params and u.phase == WHOLE and u.keep and u.index not in self.sched.keep:
            u.phase = FREED
        return u

    def _forward_to(self, w, j):
        """A forward's walk along its segment up to place j (None: to its end): every place before j that this
        rank did not call is gathered (and freed) in its turn, as the ranks that call it gather it; then j's.

        Blocks A, B, C, and rank 1 skips B: rank 0 gathers A, B, C as each starts (each prefetching the next);
        rank 1 gathers A, then, as C starts, B (freed at once) and C: the same gathers in the same order. In the
        backward both gather C, B, A the same way, rank 1 reducing B's zeros in B's turn."""
        places = self.sched.places
        at = lambda p: places[p] if p < w.end else None   # noqa: E731
        while w.pos < (w.end if j is None else j):
            u = places[w.pos]
            self._take(u, at(w.pos + 1), False)
            w.pos += 1
            if at(w.pos) is not u:
                self._release(u)
        if j is not None:
            self._take(places[j], at(j + 1), False)
            w.pos = j + 1

    def _backward_to(self, k, gather=False):
        """The backward's walk up to backward place k: every place before it is done (a unit past its last place
        may launch its reduction; one this rank did not call is gathered in its turn first, as the ranks that
        called it gathered it); with gather, the unit at k is gathered too and the next one's gather starts."""
        s = self.sched
        at = lambda k: s.places[s.back[k]] if k < len(s.back) else None   # noqa: E731
        while s.done < k:
            u = at(s.done)
            if self.shards_params and s.gathered <= s.done:
                self._take(u, at(s.done + 1), True)
                s.gathered = s.done + 1
            s.done += 1
            self._launch_ready()
            if at(s.done) is not u:         # the same unit next: it stays whole
                self._release(u)
        if gather and self.shards_params and s.gathered <= k < len(s.back):
            self._take(at(k), at(k + 1), True)
            s.gathered = k + 1

    # -- forward hooks: opaque to torch.compile, whose graphs break where a unit begins or ends

    @torch.compiler.disable
    def _enter(self, module, args):
        self.depth += 1
        if self.depth > 1:
            return
        if self.unfilled:
            raise RuntimeError(f"zero: {sorted(self.unfilled)[:8]} were built on the meta device and nothing "
                               "initialized them: fill them with engine.load_state_dict(sd), or pass init_fn=fn "
                               "(called as fn(module) on every module) to zero.Zero")
        if self.gathers_lazily:             # after evaluation forwards: checked that every rank made as many
            self.net.agree("forward" if torch.is_grad_enabled() else "no_grad forward",
                           check=self.evals and torch.is_grad_enabled())
            self.evals = 0 if torch.is_grad_enabled() else self.evals + 1
        if self.last_ran is not None:       # a block called on its own since the last forward
            self._release(self.last_ran)
        self.last_ran = None
        # a forward with a backward to come walks its segment; one without (evaluation, a metric, a teacher),
        # the first segment, leaving the training walk where it was
        grad = torch.is_grad_enabled()
        self.walk = Walk(self.sched, self.segments if grad else 0)
        self.segments += grad
        for u in self.units:                # the root and escaped units stay whole through the backward; in the
            if u is self.root or u.keep:    # first forward the others are _Sharded while they do not run, so that
                self._unshard(u)            # a parameter used out of its block is seen (see _Sharded)
            elif not self.checked:
                self._mark(u, True)

    @torch.compiler.disable
    def _exit(self, module, args, output):
        self.depth -= 1
        if self.depth:
            return
        if self.last_ran is not None:
            self._release(self.last_ran)
            self.last_ran = None
        self._forward_to(self.walk, None)   # places after the last one this rank called
        self.walk = None
        pending = bool(self.calls)          # a backward is to come: what it needs stays whole
        for u in self.units:
            if u.phase == WHOLE and self.shards_params and not torch.is_grad_enabled() and not (
                    pending and (u is self.root or u.keep)):
                self._reshard(u)            # no backward follows (evaluation, generation)
            elif u.phase == WHOLE and not self.checked:
                self._mark(u, False)        # the first forward's marks go
        self.checked = True

    @torch.compiler.disable
    def _pre_forward(self, u, module, args, kwargs):
        if self.last_ran is not None and self.last_ran is not u:
            self._release(self.last_ran)    # freed once another unit starts: a unit run twice in a row stays
        key, j = self.walk.place(self.sched, u) if self.walk is not None else (None, None)   # None: a block
        self._forward_to(self.walk, j) if j is not None else self._unshard(u)   # called alone; out of turn
        self._mark(u, False)
        self.last_ran, u.call = u, key
        self.ran.append(u.index)
        xs = [t for t in _tensors((args, kwargs)) if t.requires_grad] if torch.is_grad_enabled() else []
        if torch.is_grad_enabled() and key is not None:
            self.calls.append(key)
        if xs:                              # their backward ends this call's backward: _PostBackward says when
            ys = dict(zip(map(id, xs), _PostBackward.apply(self, u, key, *xs)))
            return _tree_map(lambda t: ys.get(id(t), t), (args, kwargs))

    @torch.compiler.disable
    def _post_forward(self, u, module, args, kwargs, output):
        if not self.checked and not u.keep:
            self._mark(u, True)             # the first forward: used out of its forward from here on?
        if not torch.is_grad_enabled():
            return
        outs, inputs = _tensors(output), {id(t) for t in _tensors((args, kwargs))}
        u.grad_out = bool(u.grad_out) or any(t.requires_grad for t in outs)
        storages = {f.flat.untyped_storage().data_ptr() for f in u.flats}
        key = u.call
        for t in outs if self.shards_params else ():
            if t.untyped_storage().data_ptr() in storages:
                u.keep = True               # a parameter returned to the caller: whole until its backward is done
            elif t.requires_grad and id(t) not in inputs:
                # gathered again just before this call's backward (and recompute); a tensor it only passed along
                # is not hooked: its gradient says nothing about this unit's backward
                t.register_hook(functools.partial(self._pre_backward, u, key))

    # -- backward

    def _refuse_outside(self):
        if not self.in_backward:
            raise RuntimeError("zero: a backward ran outside engine.backward(loss) (loss.backward(), or "
                               "scaler.scale(loss).backward()): call engine.backward(loss), which reduces the "
                               "gradients, and engine.step() (or the optimizer given to zero.Zero) for the update")

    def _back_place(self, key):
        # the backward place of the call `key`; None: out of turn (not in the schedule, or already passed)
        k = self.sched.bpos.get(self.sched.node.get(key)) if key is not None else None
        return k if k is not None and k >= self.sched.done else None

    @torch.compiler.disable
    def _pre_backward(self, u, key, grad):
        # a call's backward (or its recompute) starts: u must be whole, and the schedule past the places before it
        self._refuse_outside()
        k = self._back_place(key)
        self._backward_to(k, gather=True) if k is not None else self._unshard(u)

    def _post_backward(self, u, key):
        # a call's backward is done: the schedule moves past its place
        self._refuse_outside()
        k = self._back_place(key)
        self._backward_to(k + 1) if k is not None else None

    def _on_grad(self, u, i, p):
        # autograd's .grad is a fresh tensor per parameter: moved into the flat gradient at once, one copy stays,
        # and one collective reduces the whole unit
        if p.grad is None:
            return
        if not self.in_backward or u.reduced:
            p.grad = None                   # nothing of it is kept for the next step
            self._refuse_outside()
            raise RuntimeError(f"zero: the gradient of '{u.train.names[i]}' came after its unit '{u.name}' was "
                               "reduced: it is used outside its block in a way the first forward did not show, or "
                               "the blocks run in another order than in the first step; put it in the root (pass "
                               "zero.Zero(..., units=[...]) without its block)")
        f, o, n = u.train, u.train.offsets[i], p.numel()
        if f.grad is None:                  # stages 2-3: a whole-unit gradient for this micro-batch only
            f.grad = torch.empty(f.padded, dtype=self.grad_dtype, device=self.device)
        with torch.no_grad():
            f.grad[o:o + n].add_(p.grad.view(-1)) if i in f.written else f.grad[o:o + n].copy_(p.grad.view(-1))
        f.written.add(i)
        f.got.add(i)
        p.grad = None                       # autograd's copy is freed at once

    def _launch_ready(self, end=False):
        # in launch order, each unit once the backward schedule is past it (end: all the rest), as on every rank;
        # stage 0 all-reduces in the last micro-batch's backward, stage 1 reduce-scatters in step(), 2-3 every time
        while (self.shards_grads or not self.shards_optim and self.micro == self.cfg.accum_steps - 1) and \
                (u := self.sched.next_launch(end)) is not None:
            self._reduce(u)

    def _reduce(self, u):
        """Launch u's gradient collective; at stages 2-3 wait (stream-ordered on NCCL) for the one two launches
        back, so that however far the device lags three whole-unit gradients are alive at most."""
        f = u.train
        g = f.grad if f.grad is not None else torch.zeros(f.padded, dtype=self.grad_dtype, device=self.device)
        for i, (p, o) in enumerate(zip(f.params, f.offsets)):
            if i not in f.written:          # unused this window: zero, not last window's values
                g[o:o + p.numel()].zero_()
        g[f.numel:].zero_()
        f.grad, f.written, u.reduced = g, set(range(len(f.params))), True
        g.mul_(1.0 / self.divide[0])        # a part of the mean before the sum, the rest in the step (fp16's range)
        work = self.net.all_reduce(g, "shard", kind="all_reduce", sync=False, tag=u.index) if not self.shards_optim \
            else self.net.reduce_scatter(g[f.lo:f.hi], g, sync=False, tag=u.index)
        self.sched.in_flight.append((u, work))
        self._drain(2 if self.shards_grads else len(self.sched.in_flight))

    def _drain(self, keep=0):
        # the oldest reductions in flight waited for, all but `keep`
        while len(self.sched.in_flight) > keep:
            self._finish_reduce(*self.sched.in_flight.popleft())

    def _finish_reduce(self, u, work):
        self.net.wait(work)
        f, cfg = u.train, self.cfg
        last = self.micro == cfg.accum_steps - 1 or not self.shards_grads   # u's last reduction of the step
        mine = f.grad[f.lo:f.hi]            # the reduced owned slice, on the device
        dev = f.acc if f.acc is not None else mine if cfg.offload else f.grad_shard   # where it is summed
        if self.shards_grads and dev is not mine:
            dev.copy_(mine) if self.micro == 0 else dev.add_(mine)
        if last and self.net.replicas > 1:  # hybrid: summed with the same shard of the other shard groups
            self.replica_works.append((f, dev, self.net.all_reduce(dev, "replica", "replica_all_reduce", False,
                                                                   u.index)))
        elif last and cfg.offload:
            self._to_host(f, dev)
        if self.shards_grads:
            f.grad, f.written = None, set()  # stages 2-3 keep no whole gradient between micro-batches

    def _to_host(self, f, dev):
        # offload: the step's gradient shard to the host once, in the reduce dtype (the paper's minimal traffic);
        # its norm taken on the device first, so that the step need not wait for the copy
        self.norms.append(torch.linalg.vector_norm(dev, dtype=torch.float32) ** 2)
        f.grad_shard.copy_(dev, non_blocking=self.pin)
        self.net.count("d2h", dev.numel(), dev.element_size())

    def backward(self, loss):
        """Backward of this micro-batch's plain mean loss (the engine divides by accum_steps itself); returns when
        its gradients are reduced."""
        cfg = self.cfg
        if self.micro >= cfg.accum_steps:
            raise RuntimeError(f"zero: backward() called {min(self.micro, cfg.accum_steps) + 1} times without step(); "
                               f"Config.accum_steps={cfg.accum_steps}")
        fn, d = getattr(loss, "grad_fn", None), None  # DDP's habit, loss / accum_steps: divided twice, silently
        if cfg.accum_steps > 1 and fn is not None and fn.name() in ("DivBackward0", "MulBackward0") and \
                "Add" not in str(fn.next_functions[0][0]):   # (a + b) / 2: two halves' mean, not DDP's habit
            d = getattr(fn, "_saved_other", None)
            d = 1 / d if fn.name() == "MulBackward0" and isinstance(d, torch.Tensor) and d.numel() == 1 else d
        if isinstance(d, torch.Tensor) and d.numel() == 1 and d.device.type == "cpu" and \
                math.isclose(d.item(), cfg.accum_steps, rel_tol=1e-6):
            raise ValueError(f"zero: the loss is divided by accum_steps={cfg.accum_steps}: pass the micro-batch's "
                             "plain mean loss; engine.backward divides by Config.accum_steps itself")
        self.net.agree("backward", check=self.evals)
        self.evals = 0
        if not self.learned:
            self._learn()
        self._settle()
        s = self.sched
        s.start_backward()
        for u in self.units:
            u.reduced = False
        if self.shards_params and s.back and cfg.prefetch:
            self._unshard(s.places[s.back[0]], wait=False)   # the forward's last block is the first one back
        self.in_backward = True
        try:                                # fp16: the loss scaled up so small gradients survive in 16 bits
            (loss.float() * self.scaler.scale if self.scaler.enabled else loss).backward()
        except torch.utils.checkpoint.CheckpointError as e:
            raise RuntimeError("zero: activation recompute (Config.checkpoint) replayed a forward that differs from "
                               "the original (see torch's message above), as a model that changes state in its "
                               "forward does (Hugging Face models filling a key/value cache: pass use_cache=False), "
                               "or use the model's own gradient_checkpointing_enable() with checkpoint=False") from e
        finally:
            self.in_backward = False
        self._backward_to(len(s.back))      # what this rank's backward did not reach, in its turn
        self._launch_ready(end=True)        # the units that stay whole, and the root
        self._drain()
        for u in self.units:                # stage 3: what is still whole (the root, escaped units) goes now
            if self.shards_params and u.phase == WHOLE:
                self._reshard(u)
        self.calls, self.segments = [], 0
        self.micro += 1

    def _learn(self):
        # the first backward: the ranks agree on the order their forwards called the blocks in (a model may call
        # them in another order than it registers them, or call one twice), on the units that stay whole, and
        # on those with no backward (nothing before them requires grad); the schedule follows that from then on
        seen = {u.index: u.grad_out for u in self.order if u.grad_out is not None}
        ends = [(s, END, END) for s in range(self.segments)]
        mine = sorted(self.calls + ends, key=lambda x: (x[0], x[1] == END))   # each segment ends after its calls
        every = self.net.all_gather_object((mine, [u.index for u in self.units if u.keep], seen))
        with_grad = {i for *_, s in every for i, g in s.items() if g}
        without = {i for *_, s in every for i, g in s.items() if not g} - with_grad
        keep = {i for _, k, _ in every for i in k}
        for u in self.units:
            u.keep = u.keep or u.index in keep
        nodes = _merge([s for s, _, _ in every], [(0, 0, u.index) for u in self.order])
        segments = [[]]
        for _, k, i in nodes:               # a segment's end starts the next forward's
            segments[-1].append(self.units[i]) if k != END else segments.append([])
        self.sched = Schedule(self.units, segments[:-1] if len(segments) > 1 else segments, without, keep)
        self.order = self.sched.order + [u for u in self.order if u not in self.sched.order]
        self.learned = True

    # -- step

    def step(self):
        """AdamW on this rank's shard, then the updated parameters go back to every rank. Returns False when the
        gradients were not finite (fp16 overflow: the step is skipped)."""
        return self.optimizer.step()        # through the optimizer, so that LR schedulers see the step

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ of the engine's gradients, between the last backward and step(): the
        global norm (of the unscaled mean gradient, every rank the same) is returned and the step clips at
        max_norm instead of Config.grad_clip. torch's own function, given the engine's parameters, calls this."""
        if float(norm_type) != 2.0:
            raise ValueError(f"zero: clip_grad_norm_(norm_type={norm_type}): zero clips the L2 norm; use 2.0")
        norm = self._agree_step()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"zero: the total norm of the gradients is {norm} (error_if_nonfinite=True)")
        self.clip = float(max_norm)
        return torch.tensor(norm)

    def _agree_step(self):
        """The step up to the update, once per step (clip_grad_norm_ may run it first): the last reductions, and
        the one all-reduce of the step's agreement; returns the global gradient norm."""
        cfg = self.cfg
        if self.micro == cfg.accum_steps + 1:   # agreed already
            return self.grad_norm
        if self.micro != cfg.accum_steps:
            raise RuntimeError(f"zero: step() after {self.micro} backward() calls; "
                               f"Config.accum_steps={cfg.accum_steps} asks for exactly that many")
        late = [n for u in self.units for f in u.flats if not f.trainable for n, p in zip(f.names, f.params)
                if p.requires_grad]
        if late:
            raise RuntimeError(f"zero: {late} were frozen when zero.Zero wrapped the model and require grad now; "
                               "the engine holds no optimizer state for them. Make them trainable before "
                               "zero.Zero(model) and freeze them after (a frozen parameter is left untouched)")
        self.net.agree("step")
        for u in self.sched.launch if self.shards_optim and not self.shards_grads else ():   # stage 1: once, now
            self._reduce(u)
        self._drain()
        self._settle()
        for f, dev, work in self.replica_works:
            self.net.wait(work)
            if self.cfg.offload:
                self._to_host(f, dev)
        self.replica_works = []
        if self.pin:                        # the worker waits for the gradient shards' copies to the host
            self.d2h = torch.cuda.Event()
            self.d2h.record()
        # one all-reduce carries the step's agreement, in fp64 (exact for these integers): the gradient's squared
        # norm, once per shard (inf or nan: overflow); the fingerprint of each rank's collectives and calls, with
        # its squares; which parameters got a gradient on any rank. One copy to the device, one sync back
        flats = [u.train for u in self.units if u.train]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in self.norms if self.cfg.offload else (torch.linalg.vector_norm(f.grad_shard, dtype=torch.float32) ** 2
                                                      for f in flats):
            sq += t
        self.norms = []
        # a copy several ranks hold (stage 0's gradient, hybrid replicas) counts once: the others add 0 times their
        # sum, nan if theirs is not finite, so that an overflow anywhere skips everywhere
        sq *= float((self.net.replica if self.shards_optim else self.rank) == 0)
        fp = fingerprint(self.net.trace)
        host = torch.tensor(fp + [c * c for c in fp] + [u.keep for u in self.units] +
                            [i in f.got for f in flats for i in range(len(f.params))], dtype=torch.float64)
        cuda = self.device.type == "cuda"
        stats = torch.cat([sq.view(1), (host.pin_memory() if cuda else host).to(self.device, non_blocking=cuda)])
        self.net.all_reduce(stats, kind="scalar")
        sq, *rest = stats.tolist()
        sums, squares, keep, got = rest[:4], rest[4:8], rest[8:8 + len(self.units)], rest[8 + len(self.units):]
        for f in flats:
            f.written, f.got = set(), set()  # the next window starts a new accumulation
        if any(s * s != self.world * q for s, q in zip(sums, squares)):
            self._diverged()
        keep = {u.index for u, k in zip(self.units, keep) if k}
        if self.learned and not keep <= self.sched.keep:   # parameters that escaped on some rank since: whole,
            for u in self.units:            # and reduced last, on every rank from the next step on
                u.keep = u.keep or u.index in keep
            self.sched = Schedule(self.units, self.sched.segments, self.sched.without, keep | self.sched.keep)
        self.micro, self.got = cfg.accum_steps + 1, got
        # the gradients are of loss * scale, summed over ranks and micro-batches after a divide by divide[0]
        self.grad_norm = math.sqrt(sq) / (self.scaler.scale * self.divide[1])
        return self.grad_norm

    def _step(self):
        cfg, norm = self.cfg, self._agree_step()
        clip, got, self.clip, self.micro = self.clip if self.clip is not None else cfg.grad_clip, self.got, None, 0
        flats = [u.train for u in self.units if u.train]
        if not math.isfinite(norm):         # every rank sees the same norm: no rank steps alone
            self.scaler.update(overflow=True)
            self.ledger_reset()
            if self.scaler.enabled:
                return False
            raise FloatingPointError(f"zero: the gradient norm is {norm} at step {self.step_count + 1} in {cfg.dtype}; "
                                     "nothing was updated. The loss or the data produced inf/nan: lower the lr, check "
                                     "the inputs, or use fp16 with loss scaling only if the cause is range")
        # clip_grad_norm_'s rule; unscale and clip are one multiplier, applied inside the Adam kernel
        mult = (min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0) / (self.scaler.scale * self.divide[1])
        self.step_count += 1
        self.scaler.update(overflow=False)
        # each group's hyperparameters as they are now (schedulers set them between steps); a parameter without a
        # gradient on any rank is left untouched, its step count too, as torch's AdamW does
        hyper = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in self.optimizer.param_groups]
        plans, k = {}, 0
        for f in flats:
            used, k = got[k:k + len(f.params)], k + len(f.params)
            f.steps = [s + 1 if used[i] else s for i, s in enumerate(f.steps)]
            plans[id(f)] = self._runs(f, used, hyper)
        if cfg.offload:                     # the update runs behind the next forward, on the worker
            jobs = []
            for u in [u for u in [self.root, *self.order] if u is not None and u.train]:   # the forward's order
                jobs.append((u, functools.partial(self._host_update, u, mult, plans[id(u.train)], self.d2h)))
                if self.regathers and u.phase == WHOLE:
                    self._reshard(u)        # the others' slices are last step's until the next forward gathers
                self.net.count("h2d", u.train.hi - u.train.lo, u.train.flat.element_size())   # the 16-bit slice
            self.worker.submit(jobs)
        else:
            for f in flats:
                self._update(f, mult, self._param_out(f), plans[id(f)])
            self._regather()
        self.ledger_reset()
        return True

    def _regather(self):
        # stages 1-2: every rank's updated slices to every rank, in place, all launched before any is waited for
        # (stage 3 gathers them at their next use; with offload the forward does, unit by unit)
        units = [u for u in self.units if u.train] if self.regathers else []
        for u in units:
            u.phase = FREED
        for wait in (False, True):
            for u in units:
                self._unshard(u, wait)

    def _runs(self, f, used, hyper):
        # AdamW calls for f's owned range: one per run of adjacent parameters with equal hyperparameters and step
        # count (a shard cuts across parameters), skipping parameters without a gradient
        runs = []
        for a, b, i in f.segments:
            if used[i]:
                key = (f.group[i], f.steps[i])
                if runs and runs[-1][1] == a and runs[-1][2] == key:
                    runs[-1][1] = b
                else:
                    runs.append([a, b, key])
        return [(a, b, *hyper[g], step) for a, b, (g, step) in runs]

    def _update(self, f, mult, out, runs):
        # AdamW on f's owned range; `out` receives the updated weights in the compute dtype
        for a, b, lr, b1, b2, eps, wd, step in runs:
            adamw_step(f.master[a:b], f.grad_shard[a:b], f.exp_avg[a:b], f.exp_avg_sq[a:b], step,
                       lr, b1, b2, eps, wd, grad_mult=mult, out=None if out is None else out[a:b])

    def _host_update(self, u, mult, runs, d2h=None):
        # on the worker thread; no collective here: the caller's thread gathers, in its forward, so that the
        # order of collectives is the program's own on every rank
        f, dest = u.train, self._param_out(u.train)
        if d2h is not None:
            d2h.synchronize()               # the gradient shards have reached the host
        if f.staging is None:
            return self._update(f, mult, dest, runs)
        if u.h2d is not None:
            u.h2d.synchronize()             # last step's copy out of the staging buffer has finished
        self._update(f, mult, f.staging, runs)
        for a, b, *_ in runs:               # only what was updated: a parameter without a gradient keeps its value
            dest[a:b].copy_(f.staging[a:b], non_blocking=True)
        if dest.is_cuda:                    # the next forward's stream waits for this, not for the thread
            u.h2d = torch.cuda.Event()
            u.h2d.record()

    def _settle(self):
        # every unit's host update done and (stages 1-2 with offload) gathered: the state is this step's
        for u in self.units if self.worker else ():
            self.worker.wait(u)
        for u in self.units if self.cfg.offload and self.regathers else ():
            self._unshard(u)

    def _diverged(self):
        # the ranks' collectives or calls differed in this step: say which, change nothing, and stop
        every = self.net.all_gather_object((self.net.trace, self.ran, dict(self.net.calls)))
        (t0, _, c0), diff, name = every[0], "?", lambda i: self.units[i].name if isinstance(i, int) else "the step"
        for r, (t, _, _) in enumerate(every):
            if t != t0:
                j = next((j for j, (x, y) in enumerate(zip(t0, t)) if x != y), min(len(t0), len(t)))
                of = lambda s: f"{s[j][0]} of {name(s[j][1])}" if j < len(s) else "nothing"   # noqa: E731
                diff = f"#{j}: rank 0's was {of(t0)}, rank {r}'s {of(t)}"
                break
        more = [f"rank {r} made {c.get(k, 0) - c0.get(k, 0)} {k}() more than rank 0" for r, (_, _, c) in
                enumerate(every) for k in CALLS if c.get(k, 0) > c0.get(k, 0)][:4]
        ran = "; ".join(f"rank {r}: {[name(i) for i in x]}" for r, (_, x, _) in enumerate(every[:4]))
        self.ledger_reset()
        raise RuntimeError(f"zero: the ranks ran different collectives in this step ({'; '.join(more + [diff])});"
                           f" nothing was updated. Units each rank's forwards ran: {ran}. At stage 3 a unit called a "
                           "different number of times on different ranks does this: call every unit equally often, "
                           "or use stage 2")

    @property
    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        for g in self.optimizer.param_groups:   # a schedule set by hand: every group gets it
            g["lr"] = value

    # -- what the engine tells its user

    def ledger_reset(self):                 # at the end of a step: what it moved, from forward to update
        self.last_comm = {k: dict(calls=c, elements=e, bytes=b) for k, (c, e, b) in self.net.ledger.items()}
        self.net.ledger, self.net.trace, self.ran = {}, [], []

    def comm(self):
        return self.last_comm

    @property
    def loss_scale(self):
        return self.scaler.scale

    def memory(self):
        """Bytes of model state this rank holds, by kind, on the device and the host, from the tensors' storages,
        each once (on a CPU-only machine "device" and "host" are one memory, split by role)."""
        out, seen, host = {w: dict.fromkeys(("params", "grads", "master", "optim", "frozen"), 0)
                           for w in ("device", "host")}, set(), "host" if self.cfg.offload else "device"
        for f in (f for u in self.units for f in u.flats):
            for t, kind, where in ((f.flat, "params", "device"), (f.shard, "params", "device"),
                                   (f.grad, "grads", "device"), (f.acc, "grads", "device"),
                                   (f.grad_shard, "grads", host), (f.master, "master", host),
                                   (f.exp_avg, "optim", host), (f.exp_avg_sq, "optim", host),
                                   (f.staging, "params", "host")):
                st = t.untyped_storage() if t is not None else None
                if st is not None and st.nbytes() and st.data_ptr() not in seen:   # views share a storage
                    seen.add(st.data_ptr())
                    out[where if f.trainable else "device"][kind if f.trainable else "frozen"] += st.nbytes()
        return out

    def num_params(self, padded=False, frozen=False):
        # Ψ of the formulas: trainable parameters (frozen=True: the frozen ones; padded: as the buffers hold them)
        return sum(f.padded if padded else f.numel for u in self.units for f in u.flats if f.trainable != frozen)

    # -- the whole model in and out, one unit at a time

    def full_state_dict(self, rank0_only=False):
        """The whole model as a plain fp32 state_dict of CPU tensors (every rank calls it). A flat buffer is
        gathered at a time and moved to the CPU at once: the device never holds more than a unit. rank0_only=True:
        only rank 0 keeps the result, the others get {}."""
        self.net.agree("full_state_dict")
        self._settle()
        keep, values = not rank0_only or self.rank == 0, {}
        for f in (f for u in self.units for f in u.flats):
            # f's whole values in fp32: the master weights (full precision) where there are, else the held values
            full = (f.master if f.master is not None else self._owned(f)).to(self.device, torch.float32)
            if f.hi - f.lo < f.padded:      # not whole here (stage 0 and frozen ones at stages 0-2 are)
                mine, full = full, torch.empty(f.padded, dtype=torch.float32, device=self.device)
                self.net.all_gather(full, mine, kind="state_dict")   # its own ledger kind: not training traffic
            for p, o in zip(f.params, f.offsets) if keep else ():
                values[id(p)] = full[o:o + p.numel()].view(p.shape).to("cpu", copy=True)
            del full
        return {k: values[id(t)] if id(t) in values else    # the model's own keys: tied names, buffers
                t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True)
                for k, t in (_model_state(self.module).items() if keep else ())}

    def load_state_dict(self, state_dict, strict=True):
        """Weights from a plain state_dict (model.state_dict() names; tied aliases fine) into every copy the engine
        keeps, each rank reading only the slices it owns (of a memory-mapped file, only those pages); Adam starts
        fresh. Missing, unexpected and wrongly shaped entries are one error (strict=False: skipped and returned)."""
        self.net.agree("load_state_dict")
        self._settle()
        want, aliases = _model_state(self.module), _aliases(self.module)
        slot = {id(p): next((a for a in aliases[id(p)] if a in state_dict), None) for u in self.units for p in u.params}
        missing = [k for k, t in want.items() if k not in state_dict and not slot.get(id(t))]
        unexpected = [k for k in state_dict if k not in want]
        shapes = [f"{k}: {list(state_dict[k].shape)} vs the model's {list(want[k].shape)}" for k in state_dict
                  if k in want and tuple(state_dict[k].shape) != tuple(want[k].shape)]
        if strict:
            _mismatch("load_state_dict:", missing, unexpected, shapes)
        bad = {k.split(":")[0] for k in shapes}
        ok = lambda k: k is not None and k not in bad   # noqa: E731 -- a skipped entry keeps its value

        def read(name, p, start, n, key):   # Adam starts fresh
            return state_dict[slot[id(p)]].reshape(-1)[start:start + n] if key == "master" and ok(slot[id(p)]) \
                else None
        extra = {k: v for k, v in state_dict.items() if k in want and ok(k) and id(want[k]) not in slot}
        filled = {a for u in self.units for p in u.params if ok(slot[id(p)]) for a in aliases[id(p)]}
        self._warn_rounded(_restore(self, lambda: (read, extra), "load the state_dict", filled | set(extra)))
        for f in (f for u in self.units for f in u.flats):
            f.steps = [0] * len(f.params)
        return LoadResult(missing, unexpected, shapes)

    def _refuse_state_dict(self, *args, **kwargs):
        raise RuntimeError("zero: model.state_dict() after zero.Zero(model) would not hold the trained weights (the "
                           "fp32 masters are sharded; at stage 3 the parameters too): use engine.full_state_dict() "
                           "(every rank calls it; rank0_only=True keeps it on rank 0 only) or zero.save(engine, dir)")


LoadResult = collections.namedtuple("LoadResult", "missing_keys unexpected_keys wrong_shapes")


class HostWorker:
    """ZeRO-Offload's update thread: it runs one step's jobs (unit, fn) in the forward's order while the caller
    goes on to the next forward, which waits only for the unit it is about to run. A failure is raised in the
    caller's thread at its next wait; at exit the thread finishes its jobs (a daemon thread killed inside a kernel
    aborts the process)."""

    def __init__(self, device, timeout_s):
        self.jobs, self.error, self.timeout = queue.Queue(), None, timeout_s
        self.thread = threading.Thread(target=self._run, args=(device,), daemon=True, name="zero-offload-adam")
        self.thread.start()

    def submit(self, jobs):
        for u, _ in jobs:
            u.updated.clear()
        self.jobs.put(jobs)

    def _run(self, device):
        # on CUDA the copies to the device go on a stream of their own, not behind the forward's kernels
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)   # the current GPU is per thread
        with torch.cuda.stream(torch.cuda.Stream(device)) if cuda else contextlib.nullcontext():
            while self._do(self.jobs.get()):
                pass

    def _do(self, jobs):
        # one step's jobs; nothing of them stays referenced here after (the engine can be freed)
        for u, fn in jobs or ():
            try:
                fn()
            except BaseException as e:      # handed to the caller at its next wait
                self.error = e
            u.updated.set()
        return jobs is not None

    def wait(self, u):
        # a bounded wait for u's update; then the caller's stream waits for its copy to the device
        if not u.updated.wait(self.timeout):
            raise RuntimeError("zero: the offload worker did not finish a unit in time")
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError("zero: the offload update failed") from err
        if u.h2d is not None:
            torch.cuda.current_stream().wait_event(u.h2d)

    def close(self):
        self.jobs.put(None)
        self.thread.join(self.timeout)


def _mismatch(what, missing, unexpected, shapes):
    # one error for all that does not fit: names the model lacks, names it has that the weights lack, shapes
    if missing or unexpected or shapes:
        parts = (f"missing {missing}" * bool(missing), f"unexpected {unexpected}" * bool(unexpected),
                 f"shapes differ: {shapes}" * bool(shapes))
        raise ValueError(f"zero: {what} " + "; ".join(x for x in parts if x))


def _pinned(block):
    # block registered with CUDA as it is (unregistered when freed, as torch pairs them), or, refused, a copy from
    # torch's pinned allocator, rounded up; the refusal's CUDA error is cleared, or the next kernel reports it
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(block.data_ptr(), block.nbytes, 0) == 0:
        weakref.finalize(block, cudart.cudaHostUnregister, block.data_ptr())
        return block
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libcudart.so" + next((f".{v}" for v in ("12", "13", "11") if torch.version.cuda.startswith(v)),
                                          "")).cudaGetLastError()
    return block.pin_memory()


def _post_order(module, stop):
    # module and its descendants, children first (as nn.Module.apply visits them), not entering `stop`
    for child in module.children():
        if id(child) not in stop:
            yield from _post_order(child, stop)
    yield module


def _model_state(model):
    # the model's own state_dict (its `state_dict` attribute is the engine's refusal after wrapping)
    return nn.Module.state_dict(model, keep_vars=True)


def _aliases(model):
    # every name of each parameter: a tied weight is one tensor under several state_dict keys
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


# -----------------------------------------------------------------------------
# 7. Checkpoints
#
# path/latest               the name of the newest complete checkpoint, replaced atomically, last
# path/step_00001000/       one checkpoint: meta.json (layout, config, step, scaler, param groups, checksums),
#                           written after every rank's rank_00000.pt ... (its RNG, and for one copy of the shards
#                           a slice of every flat buffer's unpadded layout: the fp32 master and Adam moments of
#                           trained parameters, frozen ones as held; rank 0: the buffers, the script's extra)
# Every file is written under a temporary name and renamed into place: a crash at any moment leaves `latest`
# naming the previous checkpoint, whole. Loading slices the layout: any world size and stage loads it.

FORMAT = "zero.py-checkpoint-2"


def _write_atomic(path, write):
    # a reader sees the old file or the new one, never half of one: rename is atomic within a filesystem, and
    # fsync first puts the bytes on disk before the name points at them
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


def save(engine, path, extra=None):
    """Write a sharded checkpoint of `engine` under directory `path` (every rank calls it). `extra`, the script's
    own state (step, best loss, model args: tensors and plain Python values), is committed in the same atomic
    step; load() returns it as meta["extra"], read_extra() before there is an engine."""
    net, rank = engine.net, engine.rank
    net.agree("save")
    engine._settle()                        # offload: the shard state must be this step's
    name = None                             # rank 0 picks a fresh directory, never a complete checkpoint's
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        name = next(n for k in itertools.count() for n in [f"step_{engine.step_count:08d}" + (f"_{k}" if k else "")]
                    if not os.path.exists(os.path.join(path, n)))
        os.makedirs(os.path.join(path, name))
    name = net.all_gather_object(name)[0]
    d = os.path.join(path, name)
    # one copy of the shards: slice s, [s*S, (s+1)*S), of every flat buffer's unpadded layout (S the shard size,
    # whatever the stage: stage 0 holds all, saves its slice), so that any run finds element e of buffer i in slice
    # e // S, in the file of the rank that wrote it: with hybrid sharding, shard group i % R (of R) writes buffer i
    flats, (n_files, s), replicas = [f for u in engine.units for f in u.flats], \
        (net.shards, net.shard_rank) if engine.shards_optim else (engine.world, rank), net.replicas
    shards = []
    for i, f in enumerate(flats):
        a, b = s * (f.padded // n_files), min((s + 1) * (f.padded // n_files), f.numel)
        held = dict(master=f.master if f.master is not None else engine._owned(f),
                    **(dict(exp_avg=f.exp_avg, exp_avg_sq=f.exp_avg_sq) if f.trainable else {}))
        shards.append({k: v[a - f.lo:a - f.lo + max(b - a, 0)].to("cpu", torch.float32 if f.trainable else v.dtype)
                       .clone() for k, v in held.items()} if i % replicas == net.replica else None)
    blob = dict(flats=shards, rng=torch.get_rng_state())   # each rank's RNG too: dropout's stream goes on
    if engine.device.type == "cuda":        # (a CPU engine makes no CUDA context)
        blob["cuda_rng"] = torch.cuda.get_rng_state(engine.device)
    if rank == 0:                           # the buffers are the same on every rank
        blob.update(extra=extra, buffers={k: v.detach().cpu() for k, v in _model_state(engine.module).items()
                                          if id(v) not in engine.owned})
    fname = os.path.join(d, f"rank_{rank:05d}.pt")
    _write_atomic(fname, lambda f: torch.save(blob, f))
    sums = net.all_gather_object(_sha256(fname))   # meta.json records each file's checksum: written after all
    if rank == 0:
        aliases = _aliases(engine.module)
        layout = [dict(numel=f.numel, frozen=not f.trainable, params=[
            dict(name=n, shape=list(p.shape), offset=o, aliases=aliases[id(p)], step=s)
            for n, p, o, s in zip(f.names, f.params, f.offsets, f.steps)]) for f in flats]
        groups = [{k: v for k, v in g.items() if k in GROUP_KEYS or k == "initial_lr"}
                  for g in engine.optimizer.param_groups]
        meta = dict(format=FORMAT, world_size=engine.world, shards=n_files, replicas=replicas, stage=engine.cfg.stage,
                    dtype=engine.cfg.dtype, config=dataclasses.asdict(engine.cfg), step=engine.step_count,
                    scaler=engine.scaler.state_dict(), param_groups=groups, flats=layout,
                    state_dict_keys=list(_model_state(engine.module)),
                    sha256={f"rank_{r:05d}.pt": s for r, s in enumerate(sums)})
        _write_atomic(os.path.join(d, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        # the commit point: until this rename, `latest` names the previous checkpoint, which is whole
        _write_atomic(os.path.join(path, "latest"), lambda f: f.write(name.encode()))
    net.all_gather_object(None)             # nobody returns before the checkpoint is whole
    # older ones go once the new one is complete (an extra, never none): each rank its own files, in parallel,
    # rank 0 then the rest of what it finds (one left half-deleted is no checkpoint: it has no meta.json)
    for old in (o for o in os.listdir(path) if o.startswith("step_") and o != name):
        d = os.path.join(path, old)
        if rank == 0:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(d, "meta.json"))
        for r in range(rank, 1 << 20, engine.world):
            try:
                os.remove(os.path.join(d, f"rank_{r:05d}.pt"))
            except OSError:
                break
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)


class _Files:
    """A checkpoint, from its directory or its parent's `latest` (read once: a save finishing meanwhile mixes
    nothing): its meta, and its rank files, each opened once, memory-mapped (only the slices read are read) and
    checked against its checksum by one rank: this one checks files check[0], check[0] + check[1] ..."""

    def __init__(self, path, check):
        if os.path.isfile(os.path.join(path, "latest")):
            with open(os.path.join(path, "latest")) as f:
                path = os.path.join(path, f.read().strip())
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise FileNotFoundError(f"zero: {path!r} is not a zero.py checkpoint (no meta.json, no 'latest'); pass "
                                    "the directory given to zero.save")
        try:
            with open(os.path.join(path, "meta.json")) as f:
                self.meta = json.load(f)
            assert self.meta.get("format") == FORMAT
        except (ValueError, AssertionError) as e:
            raise ValueError(f"zero: {path}/meta.json is corrupt or of another format; use another checkpoint") from e
        self.d, self.open, meta = path, {}, self.meta
        for r in range(check[0], meta["world_size"], check[1]):
            fname = os.path.join(path, f"rank_{r:05d}.pt")
            if not os.path.isfile(fname):
                raise FileNotFoundError(f"zero: checkpoint {path} lacks rank_{r:05d}.pt (it was saved by "
                                        f"{meta['world_size']} ranks); the files were lost or copied in part: copy "
                                        "them all, or use an earlier checkpoint")
            if _sha256(fname) != meta["sha256"][f"rank_{r:05d}.pt"]:
                raise ValueError(f"zero: {fname} is truncated or corrupted (its sha256 does not match meta.json); "
                                 "use an earlier checkpoint")
        # name -> (flat, offset, shard size at save time, shape) in the saved layout
        self.saved = {p["name"]: (i, p["offset"], -(-f["numel"] // meta["shards"]), p["shape"])
                      for i, f in enumerate(meta["flats"]) for p in f["params"]}
        self.writer = lambda i, s: (i % meta.get("replicas", 1)) * meta["shards"] + s   # the file of slice s

    def __call__(self, r):                  # weights_only: a checkpoint is data, never code
        if r not in self.open:
            self.open[r] = torch.load(os.path.join(self.d, f"rank_{r:05d}.pt"), map_location="cpu",
                                      weights_only=True, mmap=True)
        return self.open[r]

    def read(self, name, start, n, key):
        # elements [start, start+n) of a saved parameter, from the files that hold them: element e of a saved
        # buffer is in file e // size
        i, offset, size, _ = self.saved[name]
        out, a = [], offset + start
        while a < offset + start + n:
            r = a // size
            b = min(offset + start + n, (r + 1) * size)
            out.append(self(self.writer(i, r))["flats"][i][key][a - r * size:b - r * size])
            a = b
        return torch.cat(out) if len(out) > 1 else out[0]


def load(engine, path):
    """Restore a checkpoint into `engine` (every rank calls it): its own world size and stage, or any other;
    nothing changes unless every rank read everything it needs. On as many ranks as saved it, each rank's random
    state comes back too (dropout goes on as if never stopped: seed after load() for a stream of your own).
    Returns its meta.json, with the script's `extra` given to save()."""
    engine.net.agree("load")
    engine._settle()
    files = []

    def prepare():
        files.append(_Files(path, (engine.rank, engine.world)))
        f = files[0]
        mine = [(n, tuple(p.shape)) for u in engine.units for x in u.flats for n, p in zip(x.names, x.params)]
        missing, extra = [n for n, _ in mine if n not in f.saved], [n for n in f.saved if n not in dict(mine)]
        shapes = [f"{n} {list(s)} vs {f.saved[n][3]}" for n, s in mine if n in f.saved and list(s) != f.saved[n][3]]
        _mismatch("the checkpoint is of another model:", missing, extra, shapes)
        # by name: a parameter may sit in another unit, offset or shard than when saved
        return (lambda name, p, start, n, key: f.read(name, start, n, key),
                {k: v for k, v in f(0)["buffers"].items() if k not in f.saved})
    _restore(engine, prepare, f"load {path}")
    f, meta = files[0], files[0].meta
    steps = {p["name"]: p["step"] for x in meta["flats"] for p in x["params"]}
    for x in (x for u in engine.units for x in u.flats):
        x.steps = [steps.get(n, 0) for n in x.names]
    engine.step_count = meta["step"]
    engine.scaler.load_state_dict(meta["scaler"])
    groups = engine.optimizer.param_groups
    if len(meta["param_groups"]) == len(groups):   # each group's lr, betas, eps, decay as saved
        for g, s in zip(groups, meta["param_groups"]):
            g.update(s, betas=tuple(s["betas"]))
    else:
        warnings.warn(f"zero: the checkpoint has {len(meta['param_groups'])} param groups, the engine "
                      f"{len(groups)}: the engine's hyperparameters are kept")
    if meta["world_size"] == engine.world:  # the same ranks again: each goes on with its own random stream
        torch.set_rng_state(f(engine.rank)["rng"])
        if "cuda_rng" in f(engine.rank) and engine.device.type == "cuda":
            torch.cuda.set_rng_state(f(engine.rank)["cuda_rng"], engine.device)
    return dict(meta, extra=f(0).get("extra"))


def read_extra(path):
    """The script's `extra` of a checkpoint, read without an engine (a script rebuilds its model from it first)."""
    return _Files(path, (0, 1 << 30))(0).get("extra")


def _restore(engine, prepare, what, filled=None):
    """New weights (and Adam moments, where `read` has them) into every copy the engine keeps. prepare() ->
    (read(name, param, start, n, key) -> elements or None, {state_dict key: tensor} of buffers). Phase 1 reads
    this rank's owned slices into fresh tensors; phase 2 has every rank learn whether every rank succeeded; only
    then phase 3 changes the engine. `filled`: the names it fills (None: all). Returns the frozen parameters whose
    loaded values change when rounded to the compute dtype."""
    try:
        read, extra = prepare()
        new, rounded = [], []
        for f in (f for u in engine.units for f in u.flats):
            # a slice `read` does not have keeps its value; a moment starts at zero
            st = {"master": (f.master if f.master is not None else engine._owned(f)).to("cpu", torch.float32,
                                                                                         copy=True)}
            if f.trainable:
                st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(st["master"]), torch.zeros_like(st["master"])
            for n, p, o in zip(f.names, f.params, f.offsets):
                a, b = max(o, f.lo), min(o + p.numel(), f.hi)
                for k in st if a < b else ():
                    piece = read(n, p, a - o, b - a, k)
                    if piece is not None:
                        st[k][a - f.lo:b - f.lo] = piece
                        if f.master is None and not f.trainable and not torch.equal(piece.float(),
                                                                                    piece.to(engine.dtype).float()):
                            rounded.append(n)
            new.append((f, st))
        error = None
    except Exception as e:                  # a missing or corrupt file, another model: nothing has changed yet
        error = e
    # phase 2: a failure is raised on every rank, not a hang in the collectives below; zero's own message (a file
    # that fails its checksum) before what reading that file gave another rank
    failed = engine.net.all_gather_object(f"{type(error).__name__}: {error}" if error else None)
    named = [f for f in failed if f and "zero:" in f] or [f for f in failed if f]
    if error is not None and ("zero:" in str(error) or f"{type(error).__name__}: {error}" == named[0]):
        raise error
    if named:
        raise RuntimeError(f"zero: another rank could not {what}: {named[0]}")
    for f, st in new:                       # phase 3: the shard state in place, the 16-bit values from it
        for k, v in st.items():
            if getattr(f, k) is not None:
                getattr(f, k).copy_(v)
        out = engine._param_out(f)
        if out is not None:
            out.copy_(st["master"])
    engine._regather()
    with torch.no_grad():
        for k, v in _model_state(engine.module).items():
            if k in extra:
                v.copy_(extra[k])
    engine.unfilled -= engine.unfilled if filled is None else filled
    return rounded


def consolidate(path):
    """A sharded checkpoint as one plain fp32 state_dict that the unwrapped model loads; memory holds the result
    and the rank files' memory maps, nothing else."""
    f, values = _Files(path, (0, 1)), {}
    for p in (p for x in f.meta["flats"] for p in x["params"]):   # each from its slices in the rank files
        values.update(dict.fromkeys(p["aliases"], f.read(p["name"], 0, math.prod(p["shape"]), "master")
                                    .float().clone().view(p["shape"])))
    bufs = f(0)["buffers"]
    return {k: values[k] if k in values else (bufs[k].float() if bufs[k].is_floating_point() else bufs[k]).clone()
            for k in f.meta["state_dict_keys"]}


# -----------------------------------------------------------------------------
# 8. Memory estimator and the command line
#
# The paper's formula in Zero.memory()'s kinds (a test holds the two equal on a real model); `python zero.py
# estimate` prints the paper's 7.5B-parameter, 64-GPU example.

def estimate_memory(num_params, world_size, stage, dtype="fp16", offload=False, shard_group=0, frozen_params=0,
                    reduce_dtype="", frozen_dtype="", accum_steps=1):
    """The ZeRO paper's model-state bytes per rank: params and grads in the compute dtype (grads in fp32 with
    reduce_dtype="fp32"), fp32 master (none in fp32 compute) and two fp32 Adam moments, each sharded by the stage
    across the shard group; frozen parameters in the compute dtype (frozen_dtype="fp32": in fp32, and at stages
    0-2 a compute copy beside them), sharded at stage 3 only."""
    c = Config(stage=stage, dtype=dtype, reduce_dtype=reduce_dtype, frozen_dtype=frozen_dtype).validate()
    psi, fz, n = num_params, frozen_params, shard_group if stage and shard_group else world_size
    p, g = DTYPES[c.dtype].itemsize, 4 if c.reduce_dtype else DTYPES[c.dtype].itemsize   # bytes per parameter
    master = 0 if c.dtype == "fp32" and not offload else 4
    per = lambda s: n if stage >= s else 1  # noqa: E731 -- each stage divides one more kind by N
    dev = dict(params=p * psi / per(3), grads=g * psi / per(2), master=master * psi / per(1), optim=8 * psi / per(1),
               frozen=(4 * fz / n if stage == 3 else 6 * fz) if c.frozen_dtype else p * fz / per(3))
    host = dict.fromkeys(dev, 0)
    if offload:     # the gradient shard, master and moments on the host; on the device stage 1's whole gradient,
        host.update(grads=g * psi / n, master=dev["master"], optim=dev["optim"])   # or the shard's sum (accum,
        dev.update(master=0, optim=0, grads=dev["grads"] if stage == 1 else g * psi / n if accum_steps > 1 or
                   n < world_size else 0)   # and hybrid: summed across the shard groups on the device)
    return {w: {k: int(round(v)) for k, v in d.items()} for w, d in (("device", dev), ("host", host))}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="zero.py", description=__doc__.split("\n")[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate", help="model-state memory per rank for each stage (the ZeRO paper's formula)")
    e.add_argument("--params", type=float, required=True, help="number of trainable parameters, e.g. 7.5e9")
    e.add_argument("--world-size", type=int, required=True)
    e.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    e.add_argument("--shard-group", type=int, default=0, help="hybrid sharding: ranks per shard group (a node)")
    e.add_argument("--frozen-params", type=float, default=0, help="frozen parameters (a LoRA fine-tune's base)")
    c = sub.add_parser("consolidate", help="a sharded checkpoint to one plain fp32 state_dict file")
    c.add_argument("ckpt")
    c.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "estimate":                 # the per-rank table of the ZeRO paper's Figure 1, a row per stage
        kinds = ("params", "grads", "master", "optim") + ("frozen",) * bool(a.frozen_params)
        print(f"model states per rank, {a.params:.4g} params" + f" + {a.frozen_params:.4g} frozen" *
              bool(a.frozen_params) + f", {a.world_size} ranks" + f", shard groups of {a.shard_group}" *
              bool(a.shard_group) + f", {a.dtype} + fp32 Adam (GB = 1e9 B)\n{'stage':>5} " +
              " ".join(f"{k:>9}" for k in kinds) + f" {'total':>9}")
        for s in range(4):
            d = estimate_memory(a.params, a.world_size, s, a.dtype, shard_group=a.shard_group,
                                frozen_params=a.frozen_params)["device"]
            print(f"{s:>5} " + " ".join(f"{d[k] / 1e9:>9.4g}" for k in kinds) + f" {sum(d.values()) / 1e9:>9.1f}")
    else:                                   # no processes, no GPU: the rank files are read straight from disk
        torch.save(consolidate(a.ckpt), a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
