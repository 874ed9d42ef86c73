"""
zero.py: ZeRO data parallelism for PyTorch in one file.

Stages 0-3 of "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(Rajbhandari et al., 2020) by reduce-scatter / all-gather over torch.distributed, with
fp16/bf16 compute and fp32 master weights, dynamic loss scaling, activation recompute,
ZeRO-Offload's CPU Adam (Ren et al., 2021), hybrid sharding across nodes, frozen parameters
sharded like the rest (LoRA), models built on the meta device, torch's optimizers, param groups
and LR schedulers, sharded checkpoints, and a memory and communication ledger. The same code
runs on CUDA with NCCL and on CPU with gloo.

    import zero
    rank, world_size, device = zero.init_distributed()
    model = zero.Zero(model, zero.Config(stage=3, dtype="bf16"), optimizer=opt)   # opt: your torch AdamW
    loss = model(x, y); model.backward(loss); model.step()     # the engine is called like the model
    with torch.device("meta"): big = Model()                   # shapes only: built unit by unit in Zero
    engine = zero.Zero(big, cfg); engine.load_state_dict(torch.load(f, mmap=True))

    torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3
    python zero.py estimate --params 7.5e9 --world-size 64 [--shard-group 8] [--frozen-params 3e10]
    python zero.py consolidate CKPT_DIR OUT.pt

Sections, in the order data flows:
  1. Config
  2. Distributed setup and collectives (with the ledger)
  3. Loss scaler
  4. AdamW (one kernel for device and host)
  5. Units and flat buffers
  6. Engine: building, gathering, hooks, backward, step, the offload worker, state_dicts
  7. Checkpoints
  8. Memory estimator and the command line
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
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import tempfile
import threading
import warnings
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

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


@dataclass
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
    timeout_s: float = 300.0        # every process group the engine makes ends a hang after this many seconds
    waits: str = "auto"             # "nccl": stream-ordered waits, the CPU runs ahead of the device | "gloo": timed
                                    # waits on the CPU | "auto": those of the process group's backend

    def validate(self):
        def bad(what, fix):
            raise ValueError(f"zero.Config: {what}; {fix}")
        name = lambda x: _DTYPE_NAMES.get(x) if isinstance(x, (str, torch.dtype)) else None   # noqa: E731
        if self.stage not in (0, 1, 2, 3):
            bad(f"stage={self.stage!r} does not exist", "use 0 (plain DP), 1, 2 or 3")
        if name(self.dtype) is None:
            bad(f"dtype={self.dtype!r} is not supported", f"use one of {list(DTYPES)}, or torch's names for them")
        self.dtype = name(self.dtype)
        for k in ("reduce_dtype", "frozen_dtype"):    # "" and dtype itself mean the same: nothing extra
            v = getattr(self, k)
            if v not in ("", None) and name(v) not in ("fp32", self.dtype):
                bad(f"{k}={v!r}", '"" (the compute dtype) or "fp32"')
            setattr(self, k, "fp32" if v not in ("", None) and name(v) != self.dtype else "")
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
            bad(f"shard_group={self.shard_group!r} at stage {self.stage}", "use 0 (all ranks), or k >= 1 ranks per "
                "shard group at stages 1-3 (stage 0 shards nothing)")
        if self.timeout_s <= 0 or self.waits not in ("auto", "nccl", "gloo"):
            bad(f"timeout_s={self.timeout_s!r}, waits={self.waits!r}", 'use seconds > 0 and "auto", "nccl" or "gloo"')
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
    if "RANK" not in os.environ:            # one process: every collective below is skipped
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


# torch 2.13 renamed the flat collectives; older releases (>= 2.4) have only the old names. The engine calls
# these four names, looked up at call time, so a test can wrap them (the suite's NCCL-semantics harness does)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce, _broadcast = dist.all_reduce, dist.broadcast
_GROUPS = {}   # (ranks, purpose, world, timeout) -> process group, made once per process, shared by its engines
CALLS = ("forward", "backward", "step", "full_state_dict", "load_state_dict", "save", "load")
EVERY_RANK = ("Every rank must call forward (at stage 3, or with offload), backward, step, full_state_dict, "
              "load_state_dict, zero.save and zero.load together: evaluate and save on every rank, not on rank 0 "
              "only, under conditions every rank agrees on (rank 0's loss, broadcast); with Hugging Face's "
              "generate() at stage 3 pass synced_gpus=True")


def _device(backend):
    # the engine computes where its process group talks: NCCL ranks on their GPU, gloo ranks on the CPU
    if not torch.cuda.is_available() or (backend is not None and "nccl" not in backend):
        return torch.device("cpu")
    want = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())) % torch.cuda.device_count()
    if torch.cuda.current_device() != want:
        raise RuntimeError(f"zero: this rank's current CUDA device is cuda:{torch.cuda.current_device()}, but "
                           f"LOCAL_RANK gives cuda:{want}; call torch.cuda.set_device({want}) first "
                           "(zero.init_distributed does)")
    return torch.device("cuda", want)


class Comm:
    """The engine's collectives, each on a process group of its own purpose, all made with Config.timeout_s:

      gather    all-gathers of the parameters, inside the rank's shard group
      reduce    reduce-scatters of the gradients (stage 0: all-reduces), inside the shard group
      replica   the reduced gradient shard summed across shard groups, once per step (hybrid sharding)
      world     every rank of the engine: the step's scalars, the setup's broadcasts
      control   the same ranks on gloo, on the CPU: small Python objects, and agree(), which checks that every
                rank makes the same collective-taking call before its first collective

    The collectives of a step are launched in one order on every rank, over all the groups (the engine's
    schedules make it so); each is asynchronous, and recorded in a ledger of what this rank sends, counted as
    ring algorithms do (all-reduce 2M(n-1)/n, reduce-scatter and all-gather M(n-1)/n, for M elements on n
    ranks), and in a trace of (kind, unit) whose fingerprint the step compares across ranks."""

    def __init__(self, cfg, group=None):
        self.timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.ledger, self.trace, self.calls = {}, [], 0   # bytes per kind; launches; agree() calls made
        up = dist.is_available() and dist.is_initialized()
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if up else [0]
        self.world, self.rank = len(self.ranks), self.ranks.index(dist.get_rank()) if up else 0
        backend = str(dist.get_backend(group)) if up else None
        self.device = _device(backend)
        # NCCL's wait orders streams and lets the CPU go on (a timed one would block the CPU until the device is
        # done); gloo's blocks the CPU anyway, with a timeout. Config.waits picks either, for tests of the other
        self.stream_waits = (backend or "gloo") if cfg.waits == "auto" else cfg.waits
        self.stream_waits = "nccl" in self.stream_waits
        k = (cfg.shard_group if cfg.stage else 0) or self.world
        if self.world % k:
            raise ValueError(f"zero.Config: shard_group={k} does not divide the {self.world} ranks; use a divisor "
                             "(the ranks of one node, LOCAL_WORLD_SIZE, is the usual choice)")
        # shard group: k consecutive ranks that together hold one copy of the model states; replica group:
        # the ranks holding the same shard, one in each shard group
        self.shards, self.shard_rank, self.replica, self.replicas = k, self.rank % k, self.rank // k, self.world // k
        shard_sets = [self.ranks[i:i + k] for i in range(0, self.world, k)]
        sets = dict(gather=shard_sets, reduce=shard_sets, replica=[self.ranks[j::k] for j in range(k)],
                    world=[self.ranks], control=[self.ranks])
        self.groups = {}
        for purpose, subsets in sets.items():
            for s in subsets:
                if len(s) > 1:              # every rank makes every group, in one order (new_group is collective)
                    key = (tuple(s), purpose, id(dist.group.WORLD), cfg.timeout_s)
                    if key not in _GROUPS:
                        _GROUPS[key] = dist.new_group(list(s), timeout=self.timeout, use_local_synchronization=
                                                      group is not None, backend="gloo" if purpose == "control" else None)
                if self.ranks[self.rank] in s:
                    self.groups[purpose] = (_GROUPS[key] if len(s) > 1 else None, len(s))

    def count(self, kind, elems, elem_size):
        calls, e, b = self.ledger.get(kind, (0, 0, 0))
        self.ledger[kind] = (calls + 1, e + elems, b + elems * elem_size)

    def wait(self, work):
        # the end of a collective: a failure, a dead or stalled rank (the group's timeout) or a timed-out gloo
        # wait becomes this error, never a hang
        try:
            done = work is None or (work.wait() if self.stream_waits else work.wait(self.timeout))
        except RuntimeError as e:           # gloo raises on a timeout, on sizes that do not match, on a dead peer
            done = e
        if done is not True:
            raise RuntimeError(f"zero: a collective failed or did not finish in {self.timeout}: another rank died, "
                               "stalled or ran other collectives (raise Config.timeout_s if it is just slow). "
                               + EVERY_RANK) from (done or None)

    def _launch(self, collective, purpose, kind, t, ring, tag, sync, *tensors):
        pg, n = self.groups.get(purpose, (None, 1))
        # what a ring sends from this rank: n-1 hops of 1/n of the tensor (twice for all-reduce); exact, as
        # units are padded to a multiple of n
        self.count(kind, t.numel() * ring * (n - 1) // n, t.element_size())
        self.trace.append((kind, tag))
        if n == 1:                          # one rank: its slice is the whole tensor
            if len(tensors) == 2 and tensors[0].data_ptr() != tensors[1].data_ptr():
                tensors[0].copy_(tensors[1])
            return None
        work = collective(*tensors, group=pg, async_op=True)
        return self.wait(work) if sync else work

    def all_reduce(self, t, purpose="world", kind="scalar", sync=True, tag=None):
        return self._launch(_all_reduce, purpose, kind, t, 2, tag, sync, t)

    def reduce_scatter(self, out, inp, sync=True, tag=None):
        # out may be inp's own slice [r*S, (r+1)*S): NCCL and gloo both reduce in place
        return self._launch(_reduce_scatter, "reduce", "reduce_scatter", inp, 1, tag, sync, out, inp)

    def all_gather(self, out, inp, kind="all_gather", sync=True, tag=None):
        # inp may be out's own slice: an in-place gather straight into the parameters' storage
        return self._launch(_all_gather, "gather", kind, out, 1, tag, sync, out, inp)

    def broadcast(self, t):
        # from the engine's first rank to all of its ranks (setup: every rank starts from the same values)
        pg, n = self.groups.get("world", (None, 1))
        if n > 1:
            self.wait(_broadcast(t, self.ranks[0], group=pg, async_op=True))

    def agree(self, what):
        """Every rank is making the same collective-taking call (`what`, the n-th of this engine): checked on the
        CPU before any data collective of the call, so that a call made on some ranks only is this error within
        seconds, never a hang, a gloo abort or the wrong collectives paired."""
        if self.world == 1:
            return
        self.calls += 1
        every = [torch.zeros(2, dtype=torch.long) for _ in range(self.world)]
        try:
            dist.all_gather(every, torch.tensor([CALLS.index(what), self.calls]), group=self.groups["control"][0])
        except RuntimeError as e:
            raise RuntimeError(f"zero: {what}(): the other ranks did not make this call in {self.timeout}. "
                               + EVERY_RANK) from e
        if any((x != every[0]).any() for x in every):
            calls = "; ".join(f"rank {r}: {CALLS[a]}() #{b}" for r, (a, b) in enumerate(x.tolist() for x in every))
            raise RuntimeError(f"zero: the ranks made different calls ({calls}). " + EVERY_RANK)

    def all_gather_object(self, obj):
        # small Python objects between the engine's ranks (checksums, errors, traces), on the CPU
        out = [obj] * self.world
        if self.world > 1:
            dist.all_gather_object(out, obj, group=self.groups["control"][0])
        return out

    def broadcast_object(self, obj):
        box = [obj]
        if self.world > 1:
            dist.broadcast_object_list(box, src=self.ranks[0], group=self.groups["control"][0])
        return box[0]


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
# The update runs on this rank's fp32 slice only: master weights, exp_avg and exp_avg_sq, 12 bytes per
# parameter (the K of the paper). It is memory-bound, so what counts is the bytes it moves. On CUDA,
# PyTorch's fused AdamW kernel does it in one pass. On the CPU (ZeRO-Offload's host update, and CPU
# training) a short C kernel does what torch's does, operation for operation, in one pass that also
# reads a bf16 gradient and writes the bf16 copy of the weights: 28-30 bytes per parameter, where
# torch's kernel plus a copy makes two passes. It is built once with the system's C compiler (about a
# second) into ~/.cache/zero_py; without one, zero warns once and uses torch's kernel.

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
    """Compile ADAMW_C once per source, compiler and CPU (a binary built for -march=native must never
    reach another CPU through a shared home) into the user's cache, and load it."""
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
    # the cores this process may run on, shared by the node's ranks: under torchrun OMP_NUM_THREADS=1 holds
    # torch to one thread however many cores are idle
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _parallel(fn, n, args):
    """fn(*args) on this thread and, for a large call, on up to _host_threads() - 1 pool threads: Python
    threads (the kernel releases the GIL), not OpenMP, as torch brings its own OpenMP runtime."""
    k, helpers = min(_host_threads(), n // MIN_PER_THREAD), []
    if k > 1:
        with contextlib.suppress(RuntimeError):   # no new threads at interpreter exit: this one does it all
            pool = _pools.get(os.getpid()) or _pools.setdefault(os.getpid(), ThreadPoolExecutor(os.cpu_count()))
            helpers = [pool.submit(fn, *args) for _ in range(k - 1)]
    fn(*args)                       # the threads share the blocks: whichever of them run, the call completes
    for h in helpers:
        h.result()
    return k


def adamw_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
               grad_mult=1.0, out=None):
    """AdamW (decoupled weight decay) on 1-D fp32 master/moment tensors, as torch's fused kernel computes
    it; grad_mult (loss unscale and clip) is applied inside, and `out`, if given, receives the updated
    master in its own dtype. On the CPU one pass of the C kernel (fp32 or bf16 grad and out); on CUDA,
    for fp16, or without a compiler, torch's fused kernel, then out.copy_(master)."""
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
        ptrs = [t.data_ptr() for t in ts] + [None] * (out is None)
        return _parallel(fn, n, (kind, n, ctypes.addressof(next_block), *ptrs, consts))
    _torch_adamw(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult, out)


CONVERT_CHUNK = 1 << 22  # elements of a 16-bit gradient converted to fp32 at a time
_scratch = {}             # device -> the fp32 buffer they are converted into, reused across calls


def _torch_adamw(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult, out):
    # PyTorch's fused kernel. A 16-bit gradient goes in large chunks through a reused fp32 buffer: a fresh
    # fp32 copy of the whole range costs more in page faults than the update itself on a CPU
    n = master.numel()
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
        # torch's functional AdamW, whose signature is the same from torch 2.4 on
        functional_adamw([master[a:b]], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [steps], fused=True,
                         grad_scale=inv_mult, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                         weight_decay=weight_decay, eps=eps, maximize=False)
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


class Flat:
    """The parameters of a unit that train (or those that are frozen), as views into one flat buffer.

    flat        the whole buffer in the compute dtype, padded to a multiple of the shard group's size; every
                parameter is a view into it (stage 3: its storage is freed between uses)
    lo, hi      the range of flat this rank owns (stage 0, and frozen parameters at stages 0-2: all of it)
    shard       stage 3: this rank's persistent slice of flat, the all-gather's input
    master      the owned slice in fp32 (trainable; frozen with frozen_dtype="fp32"); for fp32 compute without
                offload, the owned parameters themselves
    grad        trainable: the whole gradient, in the reduce dtype (stages 0-1: kept; 2-3: while it is reduced)
    grad_shard  the owned slice of the reduced gradient (host with offload); acc: its device-side sum over
                micro-batches, with offload and accumulation at stages 2-3
    exp_avg, exp_avg_sq   Adam's moments of the owned slice (host with offload)
    staging     offload on CUDA: the pinned 16-bit owned slice that the host update writes first
    segments    (a, b, i): the owned piece [a, b) of parameter i, relative to lo
    steps, group          per parameter: AdamW steps taken (none without a gradient anywhere), param group
    written, got          parameters whose gradient is in `grad` / came in this accumulation window
    """

    def __init__(self, named_params, trainable, shards, shard_rank, sharded):
        self.trainable = trainable
        # the layout: parameter i lives at flat[offsets[i] : offsets[i] + numel], in named_parameters order
        self.names, self.params = [n for n, _ in named_params], [p for _, p in named_params]
        self.offsets = [sum(p.numel() for p in self.params[:i]) for i in range(len(self.params))]
        self.numel = sum(p.numel() for p in self.params)
        # padding to a multiple of the shard group gives every rank an equal shard, as the collectives require
        self.padded = -(-self.numel // shards) * shards
        size = self.padded // shards
        self.lo, self.hi = (shard_rank * size, (shard_rank + 1) * size) if sharded else (0, self.padded)
        self.segments = [(max(o, self.lo) - self.lo, min(o + p.numel(), self.hi) - self.lo, i)
                         for i, (p, o) in enumerate(zip(self.params, self.offsets))
                         if max(o, self.lo) < min(o + p.numel(), self.hi)]
        self.steps, self.group = [0] * len(self.params), [0] * len(self.params)
        self.written, self.got = set(), set()
        # the tensors are made by Zero._build, which knows the stage, dtype and device
        self.flat = self.shard = self.master = self.grad = self.grad_shard = self.acc = None
        self.exp_avg = self.exp_avg_sq = self.staging = None


FREED, GATHERING, WHOLE = "freed", "gathering", "whole"


class Unit:
    """A block of the model (an element of its outermost ModuleList) or the root (everything else), with its
    flat buffers: the grain of the schedules. Its phase says where the buffers stand: FREED (stage 3 between
    uses: storage freed; stages 1-2 with offload: the others' slices not yet gathered after the update) ->
    GATHERING (all-gathers in flight) -> WHOLE. Two verbs move it, Zero._unshard and Zero._reshard; the root
    and units whose parameters are used outside their forward (keep) stay WHOLE through the backward."""

    def __init__(self, index, module, name, flats):
        self.index, self.module, self.name, self.flats = index, module, name, flats
        self.train = next((f for f in flats if f.trainable), None)   # the trainable Flat, if any
        self.params = [p for f in flats for p in f.params]
        self.phase, self.works = WHOLE, []  # where the buffers stand; the all-gathers in flight
        self.keep = False                   # a parameter is used outside the unit's forward: whole until backward ends
        self.pos = self.rpos = None         # places in the forward and backward schedules (rpos None: no backward)
        self.grad_out = None                # the forward made an output that requires grad (None: never seen)
        self.calls = self.posts = 0         # this micro-batch: forwards with a backward to come / backwards done
        self.reduced = False                # this micro-batch's gradient collective has been launched
        self.updated = threading.Event()    # offload: the host update of this unit is done
        self.updated.set()
        self.h2d = None                     # offload on CUDA: an event after the worker's copy to the device


def _tree_map(fn, x, rebuild=True):
    """fn on every tensor in a module's inputs or outputs: tuples (named ones too), lists, dicts and dataclasses
    (Hugging Face's ModelOutput among them); rebuilt around fn's results, or (rebuild=False) only visited."""
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
    """The identity on a unit's inputs. Its backward runs once all of their gradients are in, which is when
    the unit's own backward is done (FSDP2's post-backward signal): its reduction may launch, its memory go."""

    @staticmethod
    def forward(ctx, engine, unit, *xs):
        ctx.engine, ctx.unit = engine, unit
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._post_backward(ctx.unit)
        return (None, None, *grads)


_PLAIN = nn.Parameter.__torch_function__    # torch's own dispatch, as for any nn.Parameter


class _Sharded(nn.Parameter):
    """The class of a parameter while its unit is not WHOLE (stage 3 between uses, offload before the next
    forward's gather): its memory is freed or stale. A torch call reading it inside a forward gathers the unit
    and keeps it whole from then on (a parameter used outside its block); outside a forward it is an error,
    where reading it would crash or mislead. The unit's gather turns it back into an nn.Parameter."""

    FREE = {"__get__", "__set__", "requires_grad_", "size", "dim", "numel", "stride", "element_size", "is_contiguous",
            "is_floating_point", "register_hook", "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr",
            "storage_offset"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in cls.FREE or getattr(getattr(func, "__self__", None), "__name__", "") == "data":
            for t in _tensors((args, kwargs)):
                if type(t) is _Sharded:
                    engine, unit = t._zero_owner
                    if engine.depth == 0:
                        raise RuntimeError(f"zero: '{t._zero_name}' was read outside the model's forward, where its "
                                           "unit is not gathered (stage 3 between uses, or offload before the next "
                                           "forward); read weights with engine.full_state_dict() (every rank calls "
                                           "it), or inside the forward")
                    unit.keep = True
                    engine._unshard(unit)
        return _PLAIN(func, types, args, kwargs or {})


class _OutOfPlaceUse(torch.overrides.TorchFunctionMode):
    """The first forward: a parameter that a torch call reads outside its unit's forward (a parent reading a
    block's weight, one block reading another's) would be read freed (stage 3) or stale (offload), and its
    gradient could come after the unit's reduction. Its unit is gathered on the spot and kept whole from then
    on, as the root is, and reduced with the root."""

    METADATA = {"__get__", "size", "dim", "numel", "stride", "element_size", "is_floating_point", "register_hook"}

    def __init__(self, engine):
        super().__init__()
        self.engine, self.owner = engine, {id(p): u for u in engine.units for p in u.params}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        e = self.engine
        if getattr(func, "__name__", "") not in self.METADATA:
            for t in _tensors((args, kwargs or {})):
                u = self.owner.get(id(t))
                if u is not None and u is not e.running and u is not e.root and not u.keep:
                    u.keep = True
                    e._unshard(u)
        return func(*args, **(kwargs or {}))


def _merge_orders(seqs, units):
    """One order of `units` (indices) consistent with every rank's observed order of them (each a part of the
    true one where ranks skip different blocks): ties, and units no rank ran, by index; `units` if they clash."""
    after, before = {u: set() for u in units}, dict.fromkeys(units, 0)
    for s in seqs:
        for a, b in zip(s, s[1:]):
            if b not in after[a]:
                after[a].add(b)
                before[b] += 1
    ready, out = [u for u in units if before[u] == 0], []
    heapq.heapify(ready)
    while ready:
        out.append(heapq.heappop(ready))
        for b in after[out[-1]]:
            before[b] -= 1
            if before[b] == 0:
                heapq.heappush(ready, b)
    return out if len(out) == len(units) else list(units)


# -----------------------------------------------------------------------------
# 6. Engine
#
# What each stage keeps whole, and the model states it leaves per rank (Ψ params, N ranks, 16-bit
# compute with K = 12 bytes of fp32 Adam state per parameter; with hybrid sharding N is the shard group):
#
#   stage  parameters              gradients                         master + Adam   bytes per rank
#   0      whole                   whole, all-reduced in backward    whole           (2 + 2 + K) Ψ
#   1      whole                   whole, reduce-scattered at step   sharded         4Ψ + KΨ/N
#   2      whole                   reduce-scattered in backward      sharded         2Ψ + (2 + K)Ψ/N
#   3      gathered per unit       reduce-scattered in backward      sharded         (2 + 2 + K)Ψ/N
#
# Frozen parameters (Ψf, no gradient, no optimizer state) are whole at stages 0-2 and sharded at stage 3:
# 2Ψf or 2Ψf/N. Each stage's difference is one named condition in Zero.__init__ (shards_optim, shards_grads,
# shards_params, regathers, gathers_lazily); the code below tests the names, never the stage number.
#
# One step: forward (stage 3 gathers each unit before it runs and frees it after) -> backward (each
# unit's gradient is reduced as soon as its backward is done; stage 3 gathers again first) -> step
# (global norm, overflow check, clip, AdamW on the owned slice, 16-bit slice rewritten, stages 1-2
# all-gather it).
#
# One order of collectives on every rank, over all the process groups, whatever the data: a rank whose
# batch skips a block or reaches fewer experts must still pair each collective with the same one on every
# other rank, and NCCL wants operations on different communicators submitted in one order everywhere. So
# the backward moves along a schedule, the same on every rank: place by place, the unit there is gathered
# (a unit this rank skipped too, in its turn), and once the backward is past a place its reduction launches
# and its memory goes. Since every wait is for a collective every rank launched before anything launched
# since, waits cannot deadlock, and the engine waits for the reduction two launches back: at most three
# whole-unit gradients are alive, however far the device lags. The step compares a fingerprint of every
# rank's collectives before anything changes.

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
# torch's Adam/AdamW group keys that zero's AdamW honours only at these values (foreach, fused: any value)
TORCH_DEFAULTS = dict(amsgrad=False, maximize=False, capturable=False, differentiable=False)
TORCH_ANY = {"foreach", "fused", "decoupled_weight_decay", "initial_lr"}
_ENGINES = weakref.WeakSet()        # every live engine, for the check of foreign optimizers below


class ZeroOptimizer(torch.optim.Optimizer):
    """torch's face of the engine's AdamW: param_groups that LR schedulers and user code read and
    write (the engine reads them at every step); step() is engine.step(); zero_grad() has nothing to do."""

    def __init__(self, engine, groups, defaults):
        self.engine = engine
        super().__init__(groups, defaults)

    def step(self, closure=None):
        return self.engine._step()

    def zero_grad(self, set_to_none=True):
        pass                                # the engine moves each gradient into its flat buffer as it arrives

    def state_dict(self):
        raise RuntimeError("zero: the optimizer's state (fp32 master weights, Adam moments) lives in the engine's "
                           "shards: save and restore it with zero.save(engine, dir) / zero.load(engine, dir), which "
                           "keep every param group's values too")

    load_state_dict = state_dict


def _foreign_step(opt, args, kwargs):
    # a torch optimizer stepping parameters an engine owns would change nothing: the engine takes their gradients
    if not isinstance(opt, ZeroOptimizer) and any(id(p) in e.owned for e in _ENGINES for g in opt.param_groups
                                                  for p in g["params"]):
        raise RuntimeError(f"zero: a torch.optim.{type(opt).__name__} is stepping parameters that zero.Zero owns, "
                           "which changes nothing; pass it as zero.Zero(model, cfg, optimizer=opt), whose step() "
                           "is then the engine's, or call engine.step()")


register_optimizer_step_pre_hook(_foreign_step)


@atexit.register
def _close_groups():
    """At exit, before Python finalizes: what is in flight is waited for (briefly) and the engines' process groups
    are destroyed, so that their gloo threads end now. A gloo thread drops a finished collective's tensors after
    wait() returned, and dropping one that has a Python object once finalization began aborts the process
    ("terminate called without an active exception", torch 2.13); a group left to the interpreter's teardown does."""
    engines = list(_ENGINES)
    try:
        for w in [w for e in engines for u in e.units for w in u.works] + [w for e in engines for _, w in e.in_flight]:
            w.wait(datetime.timedelta(seconds=5))
    except RuntimeError:                    # a collective that failed or never ends: joining its thread could hang
        return
    for e in engines:
        e.in_flight, e.net.groups = collections.deque(), {}
        for u in e.units:
            u.works = []
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    while groups:
        with contextlib.suppress(Exception):   # a group the script destroyed already
            dist.destroy_process_group(groups[-1])
        del groups[-1]                      # its last reference: the group's threads are joined here


class Zero:
    """Wraps a model: shards it in place into units, hooks its forward and backward, and steps AdamW on this
    rank's shard. Call it like the model (its other attributes and methods are the model's), then
    backward(loss), then step()."""

    def __init__(self, model, cfg=None, units=None, init_fn=None, param_groups=None, group=None, optimizer=None):
        # a bad config fails here, before any collective or allocation
        self.cfg = cfg = (cfg or Config()).validate()
        # a model compiled before wrapping: its own modules and names, its compiled forward
        self.module, self._forward = getattr(model, "_orig_mod", model), model
        self.net = Comm(cfg, group)
        self.rank, self.world, self.device = self.net.rank, self.net.world, self.net.device
        self.dtype = DTYPES[cfg.dtype]
        self.grad_dtype = torch.float32 if cfg.reduce_dtype else self.dtype   # gradient reductions and sums
        self.scaler = LossScaler(cfg)
        # -- what the stages differ in, one name each
        self.shards_optim = cfg.stage >= 1          # fp32 master weights and Adam moments: this rank's shard
        self.shards_grads = cfg.stage >= 2          # gradients reduce-scattered in backward, the whole ones freed
        self.shards_params = cfg.stage == 3         # parameters gathered per unit for each use, freed after
        self.regathers = cfg.stage in (1, 2)        # parameters whole: the updated slices all-gathered after an update
        self.gathers_lazily = self.shards_params or cfg.offload   # forwards gather (offload: the host update's slices)
        self.host = torch.device("cpu") if cfg.offload else self.device   # where master, moments, grad shard live
        self.pin = cfg.offload and self.device.type == "cuda"             # pinned host memory, a staging copy
        self.master_is_param = self.dtype == torch.float32 and not cfg.offload   # fp32: no second copy
        # -- progress through a step
        self.step_count, self.grad_norm = 0, 0.0    # applied steps (an fp16 overflow skips one); the last norm
        self.micro = 0                              # backward calls since the last step
        self.in_backward = False                    # inside engine.backward: a bare loss.backward() is refused
        self.depth = 0                              # modules outside the units now running, one inside the other
        self.running = self.last_ran = None         # the unit whose forward runs now / ran last
        self.ran = []                               # units whose forward ran since the last step, in order
        self.cursor = [0, 0]                        # next place to gather in the forward / backward schedule
        self.done_to = 0                            # backward schedule places whose backward is over
        self.launch_next = 0                        # next unit of launch_order to reduce
        self.in_flight = collections.deque()        # (unit, work) of reductions launched and not yet waited for
        self.learned = False                        # the first backward has learned the forward order
        self.check = self.worker = None             # the first forward's out-of-place check; the offload thread
        self.checked = False                        # that check is done
        self.unfilled = set()                       # names built on the meta device that nothing initialized
        self.pinned = {}                            # offload on CUDA: kind -> [pinned block of host state, used]
        self.peak_gathered_bytes = 0                # stage 3: the most bytes of whole units held at once
        self.last_comm = {}                         # the last step's ledger
        self.names = {id(m): n for n, m in self.module.named_modules()}

        # -- which parameter goes to which unit: one used by several units goes to the root
        unit_modules = list(units) if units is not None else find_units(self.module)
        owners = {}                         # by identity, so a parameter under two names (tied weights) counts once
        for i, m in enumerate(unit_modules):
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(i)
        named = list(self.module.named_parameters())   # each tensor once, under its first name: the one we use
        if not any(p.requires_grad for _, p in named):
            raise ValueError("zero.Zero: the model has no trainable parameters (requires_grad=True); "
                             "pass the model you mean to train")
        members = [[] for _ in unit_modules] + [[]]    # the last: the root
        for n, p in named:
            o = owners.get(id(p), ())
            members[next(iter(o)) if len(o) == 1 else -1].append((n, p))
        net, unit_of = self.net, {}
        self.units = []
        for m, ps in zip(unit_modules + [self.module], members):
            # trainable and frozen parameters in separate flat buffers: frozen ones are gathered, never reduced;
            # at stages 0-2 they stay whole, and so do stage 0's trainable ones
            flats = [Flat(part, tr, net.shards if cfg.stage else self.world, net.shard_rank if cfg.stage else
                          self.rank, self.shards_params or (tr and self.shards_optim)) for tr, part in
                     ((True, [x for x in ps if x[1].requires_grad]), (False, [x for x in ps if not x[1].requires_grad]))
                     if part]
            if flats:                       # a block without parameters is no unit
                unit_of[id(m)] = Unit(len(self.units), m, self.names.get(id(m)) or "root", flats)
                self.units.append(unit_of[id(m)])
        self.root = unit_of.get(id(self.module))
        self.owned = {id(p) for u in self.units for p in u.params}
        self._schedule([u for u in self.units if u is not self.root], {u.index for u in self.units})
        self.optimizer = self._make_optimizer(param_groups, optimizer)
        self._check_ranks_agree()           # before the first collective that depends on the layout

        # -- one unit at a time: a model built on the meta device becomes real here, then its unit is
        # sharded and the rest freed, so no rank ever holds the whole model
        stop, self.made, self.placed, rounded = {id(m) for m in unit_modules}, set(), {}, []
        for m in unit_modules + [self.module]:
            mods = list(_post_order(m, stop - {id(m)}))   # the root: every module outside the units
            self._materialize(mods, init_fn)
            self._place_buffers(mods)
            if id(m) in unit_of:
                rounded += self._build(unit_of[id(m)])
        self._warn_rounded(rounded)

        # -- hooks: one per trainable parameter for its gradient (it fires once per backward, after autograd
        # summed all its uses); a forward begins with the first module outside the units to start (the model,
        # or a part of it called on its own, as Hugging Face's generate() calls an encoder) and ends when it
        # returns; each unit's forward and backward are hooked for the schedules
        for u in self.units:
            for i, p in enumerate(u.train.params if u.train else ()):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u, i))
        for m in mods:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._exit, always_call=True)
        for u in self.order:
            u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u), with_kwargs=True)
            u.module.register_forward_hook(functools.partial(self._post_forward, u), with_kwargs=True)
        # recompute every k-th block unit (the root holds embeddings and head: nothing worth recomputing)
        k = 1 if cfg.checkpoint is True else cfg.checkpoint
        for j, u in enumerate(self.order if k else []):
            if j % k == 0:
                # non-reentrant recompute keeps dropout's RNG state and runs inside the unit's hooks,
                # so at stage 3 the unit is gathered again before its recompute
                u.module.forward = functools.partial(recompute, u.module.forward, use_reentrant=False)
        # the model's own state_dict would hold shards or stale 16-bit copies: both go through the engine
        self.module.state_dict, self.module.load_state_dict = self._refuse_state_dict, self.load_state_dict
        if cfg.offload:
            self.worker = HostWorker(self.device, cfg.timeout_s)
        self.ledger_reset()
        _ENGINES.add(self)

    def _schedule(self, order, needs):
        """The schedules, the same on every rank: the forward gathers the blocks in `order`, the backward those of
        `needs` in reverse; reductions launch in the backward's order, then the units that stay whole, the root last."""
        self.order = order
        self.rorder = [u for u in reversed(order) if u.index in needs]
        for u in self.units:
            u.pos = u.rpos = None
        for j, u in enumerate(self.order):
            u.pos = j
        for j, u in enumerate(self.rorder):
            u.rpos = j
        first = [u for u in self.rorder if u.train and not u.keep]
        self.launch_order = first + [u for u in self.units if u.train and u not in first]

    def _make_optimizer(self, param_groups, optimizer):
        """torch's param groups, each parameter's group index recorded in its flat buffer. Parameters in no
        group take Config's values, with weight decay on those of >= 2 dims only (two more groups). A torch
        optimizer given instead lends its groups (the same dicts) and hands its step() to the engine."""
        c = self.cfg
        defaults = dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay)
        where = {id(p): (u.train, i) for u in self.units if u.train for i, p in enumerate(u.train.params)}
        name = {id(p): n for n, p in self.module.named_parameters()}
        groups = optimizer.param_groups if optimizer is not None else list(param_groups or [])
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]  # a plain list of parameters: one group, as torch takes it
        if optimizer is not None and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"zero.Zero: optimizer={type(optimizer).__name__}; zero steps AdamW: pass a "
                             "torch.optim.AdamW (or Adam), or none")
        out, seen = [], {}
        for j, g in enumerate(groups):
            unknown = sorted(set(g) - {"params", *GROUP_KEYS, *TORCH_DEFAULTS, *TORCH_ANY})
            if unknown:
                raise ValueError(f"zero.Zero: param_groups[{j}] has unknown keys {unknown}; zero's AdamW takes "
                                 f"{['params', *GROUP_KEYS]} (and torch's AdamW keys at their defaults)")
            bad = [f"{k}={g[k]}" for k, v in TORCH_DEFAULTS.items() if g.get(k, v) != v]
            if type(optimizer) is torch.optim.Adam and g["weight_decay"] and not g.get("decoupled_weight_decay"):
                bad += [f"weight_decay={g['weight_decay']} as Adam's L2 penalty"]
            if bad:
                raise ValueError(f"zero.Zero: param_groups[{j}] sets {bad}, which zero's AdamW cannot do; use "
                                 "torch.optim.AdamW with those at their defaults")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:
                if id(p) not in where and (optimizer is None or id(p) not in name):
                    what = f"'{name[id(p)]}', which does not require grad" if id(p) in name else \
                        f"a tensor of shape {tuple(p.shape)} that is not a parameter of the model"
                    raise ValueError(f"zero.Zero: param_groups[{j}] holds {what}; list only the model's "
                                     "trainable parameters")
                if id(p) in seen and seen[id(p)] != j:
                    raise ValueError(f"zero.Zero: parameter '{name[id(p)]}' is in param_groups {seen[id(p)]} and "
                                     f"{j}; give each parameter one group")
                seen[id(p)] = j
            # a torch optimizer's own dicts, so that its schedulers and its user's code drive the engine
            out.append(g if optimizer is not None else dict(g, params=list(dict.fromkeys(ps))))
        rest = [f.params[i] for f, i in where.values() if id(f.params[i]) not in seen]
        if optimizer is not None and rest:
            raise ValueError(f"zero.Zero: {[name[id(p)] for p in rest][:5]} require grad but are in no param group "
                             "of the optimizer; add them to it, or freeze them before zero.Zero")
        out += [dict(params=[p for p in rest if p.dim() >= 2]),
                dict(params=[p for p in rest if p.dim() < 2], weight_decay=0.0)]
        out = out[:len(groups)] + [g for g in out[len(groups):] if g["params"]]
        for j, g in enumerate(out):
            for p in g["params"]:
                if id(p) in where:
                    f, i = where[id(p)]
                    f.group[i] = j
        zopt = ZeroOptimizer(self, out, defaults)
        if optimizer is not None:           # from now on the script's optimizer is driven by the engine
            def step(closure=None):
                optimizer._opt_called = True    # what torch's LR schedulers look for
                return self.step()
            step._wrapped_by_lr_sched = True
            optimizer.step, optimizer.zero_grad = step, zopt.zero_grad
            optimizer.state_dict = optimizer.load_state_dict = zopt.state_dict
        return zopt

    def _check_ranks_agree(self):
        """Ranks that disagree on the config or the model would hang in mismatched collectives:
        compare a fingerprint of both first, and name what differs."""
        if self.world == 1:
            return
        c = self.cfg
        layout = ";".join(f"{u.index}:{n}:{tuple(p.shape)}:{f.group[i]}:{f.trainable}" for u in self.units
                          for f in u.flats for i, (n, p) in enumerate(zip(f.names, f.params)))
        fields_ = dict(stage=c.stage, dtype=list(DTYPES).index(c.dtype), accum_steps=c.accum_steps,
                       offload=int(c.offload), checkpoint=int(c.checkpoint), shard_group=c.shard_group,
                       units=len(self.units), params=sum(f.numel for u in self.units for f in u.flats),
                       layout=zlib.crc32(layout.encode()), config=zlib.crc32(repr(asdict(c)).encode()))
        every = self.net.all_gather_object(list(fields_.values()))
        for r, row in enumerate(every):
            diff = [f"{k}: rank 0 has {a}, rank {r} has {b}" for k, a, b in zip(fields_, every[0], row) if a != b]
            if diff:
                raise ValueError("zero.Zero: ranks disagree (" + "; ".join(diff) + "); launch every rank with "
                                 "the same model and the same zero.Config")

    # -- building: meta tensors made real, buffers placed, units sharded

    def _materialize(self, mods, init_fn):
        """Parameters and buffers of `mods` on the meta device become real tensors on the engine's device
        (the same Python objects, so tied weights stay tied), initialized by init_fn(module) for each module,
        or by each module's own reset_parameters(). What nothing initialized is marked unfilled: a later
        load_state_dict fills it, and a forward or a step before that is an error that names it."""
        made = []
        for m in mods:
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if t.is_meta and id(t) not in self.made:
                    new = torch.empty_like(t, device=self.device)
                    # a marker that no initializer writes: what still holds it afterwards was never initialized
                    if t.is_floating_point():
                        new.fill_(float("nan"))
                    elif t.dtype != torch.bool:
                        new.fill_(torch.iinfo(t.dtype).min)
                    torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter)
                                             else new)
                    made.append((m, n))
                    self.made.add(id(t))
        with torch.no_grad():
            for m in dict.fromkeys(m for m, _ in made) if init_fn is None else mods if made else ():
                if init_fn is not None:
                    init_fn(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        for m, n in made:
            t = getattr(m, n)
            if (t.is_floating_point() and t.isnan().any()) or \
                    (t.dtype != torch.bool and not t.is_floating_point() and (t == torch.iinfo(t.dtype).min).all()):
                self.unfilled.add(self._name(m, n))

    def _place_buffers(self, mods):
        # buffers (norm statistics, masks, position tables) stay whole on every rank, floats in the compute dtype,
        # with rank 0's values (each tensor once, however many modules share it)
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

    def _state(self, kind, n, dtype=torch.float32, src=None, where=None):
        # a shard-state tensor of n elements, zeros or a copy of src; offload on CUDA carves it from one block per
        # kind for every unit, registered with CUDA at its exact size (torch's pinned allocator rounds each block
        # up to a power of two, up to twice what memory() counts, and pinned memory cannot be swapped)
        where = where or self.host
        if not (self.pin and where.type == "cpu"):
            t = torch.empty(n, dtype=dtype, device=where)
        else:
            if kind not in self.pinned:
                total = sum(f.hi - f.lo for u in self.units if u.train for f in [u.train])
                block = torch.empty(total, dtype=dtype)
                if torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.nbytes, 0) != 0:
                    block = block.pin_memory()    # registration refused: torch's allocator, rounded up
                self.pinned[kind] = [block, 0]
            block, used = self.pinned[kind]
            t, self.pinned[kind][1] = block[used:used + n], used + n
        return t.copy_(src) if src is not None else t.zero_()

    def _build(self, u):
        cfg = self.cfg
        frozen = []
        for f in u.flats:
            # one whole flat buffer in fp32 at a time: master weights start from the model's own fp32 values, not
            # from their 16-bit rounding
            full = torch.zeros(f.padded, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for p, o in zip(f.params, f.offsets):
                    full[o:o + p.numel()].copy_(p.detach().reshape(-1))
            self.net.broadcast(full)        # every rank starts from rank 0's values
            f.flat = full.to(self.dtype) if self.dtype != torch.float32 else full
            # re-point each parameter into the flat buffer: the model's code sees ordinary parameters, while
            # a collective on the flat buffer moves all of them at once
            for n, p, o in zip(f.names, f.params, f.offsets):
                p.data = f.flat[o:o + p.numel()].view(p.shape)
                p._zero_name, p._zero_owner = n, (self, u)
            if f.trainable:
                f.master = None if self.master_is_param else self._state("master", f.hi - f.lo, src=full[f.lo:f.hi])
                f.exp_avg, f.exp_avg_sq = self._state("exp_avg", f.hi - f.lo), self._state("exp_avg_sq", f.hi - f.lo)
                if cfg.stage <= 1:          # the whole gradient stays; stage 1 owns a slice of it
                    f.grad = torch.zeros(f.padded, dtype=self.grad_dtype, device=self.device)
                    f.grad_shard = f.grad[f.lo:f.hi]
                if self.shards_grads or cfg.offload:    # reduce dtype (the compute dtype, as the paper counts it)
                    f.grad_shard = self._state("grad_shard", f.hi - f.lo, self.grad_dtype)
                if cfg.offload and self.shards_grads and cfg.accum_steps > 1:   # summed on the device, sent once
                    f.acc = torch.zeros(f.hi - f.lo, dtype=self.grad_dtype, device=self.device)
                if self.pin:                # the host update writes 16-bit weights here first
                    f.staging = self._state("staging", f.hi - f.lo, self.dtype)
            elif cfg.frozen_dtype:          # frozen in fp32, exact: the compute copy is made when gathered
                f.master = full[f.lo:f.hi].clone()
            else:
                frozen += [n for n, p, o in zip(f.names, f.params, f.offsets) if n not in self.unfilled and
                           not torch.equal(full[o:o + p.numel()], f.flat[o:o + p.numel()].float())]
            if self.shards_params and (f.trainable or f.master is None):
                f.shard = f.flat[f.lo:f.hi].clone()     # the owned slice stays, the whole buffer goes
            if self.master_is_param and f.trainable:
                f.master = self._owned(f)
            del full
        if self.shards_params:
            u.phase = WHOLE
            self._reshard(u)
        return frozen                       # frozen parameters whose values the compute dtype changes

    def _warn_rounded(self, names):
        if names:
            warnings.warn(f"zero: frozen parameters {names[:8]}{' ...' if len(names) > 8 else ''} change when rounded "
                          f"to {self.cfg.dtype}, in which zero holds them; pass Config(frozen_dtype='fp32') to keep "
                          "them exact (4 bytes each per shard; cast when gathered)")

    def _owned(self, f):
        """This rank's owned range of f's held values: the shard (stage 3) or its slice of the flat buffer."""
        return f.shard if self.shards_params else f.flat[f.lo:f.hi]

    def _param_out(self, f):
        """Where an update (or a load) writes the owned values: nowhere when the master weights are the values."""
        out = self._owned(f)
        return None if out is None or (f.master is not None and out.data_ptr() == f.master.data_ptr()) else out

    def __call__(self, *args, **kwargs):
        # the parameters are in the compute dtype, so float inputs must be too
        cast = lambda t: t.to(self.dtype) if t.is_floating_point() else t   # noqa: E731
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

    # -- a unit's two verbs

    def _unshard(self, u, wait=True):
        """FREED -> GATHERING: the all-gathers launched (at stage 3 straight into the flat buffers' storage, from
        the shards; with offload, from the slices the host update wrote) -> WHOLE, once they are waited for."""
        if u.phase == FREED:
            if self.worker:
                self.worker.wait(u)
            for f in u.flats if self.shards_params else [u.train]:
                if self.shards_params:
                    f.flat.untyped_storage().resize_(f.padded * f.flat.element_size())
                src = f.shard if f.shard is not None else f.flat[f.lo:f.hi] if f.master is None or f.trainable \
                    else f.master.to(self.dtype)
                kind = "all_gather" if f.trainable else "frozen_all_gather"   # the formulas count Ψ, Ψf apart
                u.works.append(self.net.all_gather(f.flat, src, kind, sync=False, tag=u.index))
            u.phase = GATHERING
            held = sum(f.flat.untyped_storage().nbytes() for v in self.units for f in v.flats)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)
        if wait and u.phase == GATHERING:
            for w in u.works:
                self.net.wait(w)
            u.works, u.phase = [], WHOLE
            for p in u.params:              # ordinary parameters again
                if type(p) is _Sharded:
                    p.__class__ = nn.Parameter

    def _reshard(self, u):
        """WHOLE -> FREED: at stage 3 the storage goes back (the parameter views, and autograd's saved references
        to them, stay valid for the next gather); with offload at stages 1-2 the others' slices are stale."""
        assert u.phase == WHOLE
        for f in u.flats if self.shards_params else ():
            f.flat.untyped_storage().resize_(0)
        u.phase = FREED
        for p in u.params if self.shards_params else u.train.params:
            if type(p) is nn.Parameter:     # a read now is an error, not a crash (see _Sharded)
                p.__class__ = _Sharded

    def _release(self, u):
        # stage 3: a unit done with for now is freed, unless it stays whole (the root, escaped parameters)
        if self.shards_params and u.phase == WHOLE and not u.keep and u is not self.root:
            self._reshard(u)

    def _take(self, u, back):
        # u's place in a schedule: gathered, and the next unit's gather started so that it travels while u computes
        # (with offload, only once the host update is done with it: waiting here would undo the overlap)
        order = self.rorder if back else self.order
        self._unshard(u)
        self.cursor[back] = (u.rpos if back else u.pos) + 1
        nxt = order[self.cursor[back]] if self.cursor[back] < len(order) else None
        if nxt is not None and self.cfg.prefetch and (back or self.gathers_lazily) and nxt.updated.is_set():
            self._unshard(nxt, wait=False)

    def _forward_to(self, u):
        """The forward's gather schedule: every unit before u that this rank did not run is gathered (and freed)
        in its turn, as the ranks that run it gather it; then u. u=None: to the end of the schedule.

        Three blocks A, B, C, and rank 1 skips B: rank 0 gathers A, B, C as each starts (each prefetching the
        next); rank 1 gathers A, then, as C starts, B (freed at once) and C: the same three gathers in the same
        order. In the backward both gather C, B, A the same way, rank 1 reducing B's zeros in B's turn."""
        end = len(self.order) if u is None else u.pos
        while self.cursor[0] < end:
            v = self.order[self.cursor[0]]
            self._take(v, 0)
            self._release(v)
        if u is not None:
            if self.cursor[0] == u.pos:
                self._take(u, 0)
            else:                           # out of turn: a unit run twice in a forward (the same on every rank)
                self._unshard(u)

    def _backward_to(self, place, gather=False):
        """The backward schedule up to `place`: every unit before it is done (its reduction may launch and its
        memory go; one this rank skipped is gathered in its turn first, as the ranks that ran it gathered it);
        with gather, the unit at `place` is gathered too, and the next one's gather starts."""
        while self.done_to < place:
            v = self.rorder[self.done_to]
            if self.shards_params and self.cursor[1] <= v.rpos:
                self._take(v, 1)
            self.done_to += 1
            self._launch_ready()
            self._release(v)
        if gather and self.shards_params and self.cursor[1] <= place < len(self.rorder):
            self._take(self.rorder[place], 1)

    # -- forward hooks

    @torch.compiler.disable
    def _enter(self, module, args):
        self.depth += 1
        if self.depth == 1:
            self._begin_forward()

    @torch.compiler.disable
    def _exit(self, module, args, output):
        self.depth -= 1
        if self.depth == 0:
            self._end_forward()

    def _begin_forward(self):
        if self.unfilled:
            raise RuntimeError(f"zero: {sorted(self.unfilled)[:8]} were built on the meta device and nothing "
                               "initialized them: fill them with engine.load_state_dict(sd), or pass init_fn=fn "
                               "(called as fn(module) on every module) to zero.Zero")
        if self.gathers_lazily:
            self.net.agree("forward")
        if self.last_ran is not None:       # a block called on its own since the last forward
            self._release(self.last_ran)
        self.cursor[0], self.last_ran = 0, None
        for u in self.units:                # the root and escaped units stay whole through the backward
            if u is self.root or u.keep:
                self._unshard(u)
        if not self.checked:
            self.check = _OutOfPlaceUse(self)
            self.check.__enter__()

    @torch.compiler.disable
    def _pre_forward(self, u, module, args, kwargs):
        if self.last_ran is not None and self.last_ran is not u:
            self._release(self.last_ran)    # freed once another unit starts: a unit run twice in a row stays
        self._forward_to(u)
        self.running = self.last_ran = u
        self.ran.append(u.index)
        xs = [t for t in _tensors((args, kwargs)) if t.requires_grad] if torch.is_grad_enabled() else []
        if xs:                              # their backward ends u's backward: signalled by _PostBackward
            u.calls += 1
            ys = dict(zip(map(id, xs), _PostBackward.apply(self, u, *xs)))
            return _tree_map(lambda t: ys.get(id(t), t), (args, kwargs))

    @torch.compiler.disable
    def _post_forward(self, u, module, args, kwargs, output):
        self.running = None
        if not torch.is_grad_enabled():
            return
        outs, inputs = _tensors(output), {id(t) for t in _tensors((args, kwargs))}
        u.grad_out = bool(u.grad_out) or any(t.requires_grad for t in outs)
        storages = {f.flat.untyped_storage().data_ptr() for f in u.flats}
        for t in outs if self.shards_params else ():
            if t.untyped_storage().data_ptr() in storages:
                u.keep = True               # a parameter returned to the caller: whole until its backward is done
            elif t.requires_grad and id(t) not in inputs:
                # gathered again just before this unit's backward (and its recompute); a tensor the unit only
                # passed through is not hooked: its gradient says nothing about this unit's backward
                t.register_hook(functools.partial(self._pre_backward, u))

    def _end_forward(self):
        if self.check is not None:
            self.check.__exit__(None, None, None)
            self.check, self.checked = None, True
        if self.last_ran is not None:
            self._release(self.last_ran)
            self.last_ran = None
        self._forward_to(None)              # units after the last one this rank ran
        if not torch.is_grad_enabled():     # no backward follows (evaluation, generation)
            for u in self.units:
                if self.shards_params and u.phase == WHOLE:
                    self._reshard(u)

    # -- backward

    def _refuse_outside(self):
        if not self.in_backward:
            raise RuntimeError("zero: a backward ran outside engine.backward(loss) (loss.backward(), or "
                               "scaler.scale(loss).backward()): call engine.backward(loss), which reduces the "
                               "gradients, and engine.step() (or the optimizer given to zero.Zero) for the update")

    @torch.compiler.disable
    def _pre_backward(self, u, grad):
        # u's backward (or its recompute) starts: it must be whole, and the schedule is past the units before it
        self._refuse_outside()
        if u.rpos is None:                  # not in the backward schedule: out of turn (the same on every rank)
            self._unshard(u)
        elif u.rpos >= self.done_to:
            self._backward_to(u.rpos, gather=True)

    def _post_backward(self, u):
        # u's backward is done once every forward call's is: the schedule moves past it
        self._refuse_outside()
        u.posts += 1
        if u.posts == u.calls:
            if u.rpos is not None:
                self._backward_to(u.rpos + 1)
            else:
                self._release(u)

    def _on_grad(self, u, i, p):
        # autograd's .grad is a fresh tensor per parameter; moving it into the flat gradient at once keeps one
        # copy, and lets a single collective reduce the whole unit
        if p.grad is None:
            return
        if not self.in_backward or u.reduced:
            p.grad = None                   # nothing of it is kept for the next step
            self._refuse_outside()
            raise RuntimeError(f"zero: the gradient of '{u.train.names[i]}' came after the reduction of its unit "
                               f"'{u.name}' was launched: it is used outside its block in a way the first forward "
                               "did not show, or the blocks run in another order than in the first step; put the "
                               "parameter in the root (pass zero.Zero(..., units=[...]) without its block)")
        f, o, n = u.train, u.train.offsets[i], p.numel()
        if f.grad is None:                  # stages 2-3: a whole-unit gradient for this micro-batch only
            f.grad = torch.empty(f.padded, dtype=self.grad_dtype, device=self.device)
        with torch.no_grad():
            if i in f.written:
                f.grad[o:o + n].add_(p.grad.view(-1))
            else:
                f.grad[o:o + n].copy_(p.grad.view(-1))
                f.written.add(i)
        p.grad = None                       # autograd's copy is freed at once
        f.got.add(i)

    def _reduces_now(self):
        # stage 0 all-reduces on the last micro-batch, stage 1 reduce-scatters in step(), 2-3 every time
        return self.shards_grads or (self.cfg.stage == 0 and self.micro == self.cfg.accum_steps - 1)

    def _launch_ready(self, end=False):
        # in launch order, each unit once the backward schedule is past it (end: every unit left), as on every rank
        while self._reduces_now() and self.launch_next < len(self.launch_order):
            u = self.launch_order[self.launch_next]
            if not end and (u.keep or u.rpos is None or u.rpos >= self.done_to):
                return
            self.launch_next += 1
            self._reduce(u)

    def _reduce(self, u):
        """Launch u's gradient collective; at stages 2-3 wait (stream-ordered on NCCL) for the one two launches
        back, so that however far the device lags only three whole-unit gradients are alive."""
        f = u.train
        g = f.grad
        if g is None:                       # no parameter of u took part in this micro-batch
            g = f.grad = torch.zeros(f.padded, dtype=self.grad_dtype, device=self.device)
        for i, (p, o) in enumerate(zip(f.params, f.offsets)):
            if i not in f.written:          # unused this window: zero, not last window's values
                g[o:o + p.numel()].zero_()
                f.written.add(i)
        g[f.numel:].zero_()
        # the mean over ranks and micro-batches, taken before the sum so that fp16 cannot overflow in it
        g.mul_(1.0 / (self.world * self.cfg.accum_steps))
        u.reduced = True
        if self.cfg.stage == 0:
            work = self.net.all_reduce(g, "reduce", kind="all_reduce", sync=False, tag=u.index)
        else:
            work = self.net.reduce_scatter(g[f.lo:f.hi], g, sync=False, tag=u.index)
        self.in_flight.append((u, work))
        while self.shards_grads and len(self.in_flight) > 2:
            self._finish_reduce(*self.in_flight.popleft())

    def _finish_reduce(self, u, work):
        self.net.wait(work)
        f = u.train
        if self.shards_grads or self.cfg.offload:
            # the reduced owned slice becomes (or is added to) the gradient shard; with offload it goes to the
            # host once per step, in the reduce dtype (the paper's minimal traffic), summed on the device before
            mine, last = f.grad[f.lo:f.hi], self.micro == self.cfg.accum_steps - 1 or not self.shards_grads
            dst = f.acc if f.acc is not None else f.grad_shard
            if self.micro == 0 or not self.shards_grads:
                dst.copy_(mine, non_blocking=self.pin)
            else:
                dst.add_(mine)
            if f.acc is not None and last:
                f.grad_shard.copy_(f.acc, non_blocking=self.pin)
            if self.cfg.offload and (last or f.acc is None):
                self.net.count("d2h", mine.numel(), mine.element_size())
        if self.shards_grads:
            f.grad, f.written = None, set()  # stages 2-3 keep no whole gradient between micro-batches

    def backward(self, loss):
        """Backward of this micro-batch's plain mean loss (the engine divides by accum_steps itself); returns
        when its gradients are reduced."""
        cfg = self.cfg
        if self.micro >= cfg.accum_steps:
            raise RuntimeError(f"zero: backward() called {self.micro + 1} times without step(); "
                               f"Config.accum_steps={cfg.accum_steps}")
        fn, d = getattr(loss, "grad_fn", None), None  # DDP's habit, loss / accum_steps: divided twice, silently
        if cfg.accum_steps > 1 and fn is not None and fn.name() in ("DivBackward0", "MulBackward0"):
            d = getattr(fn, "_saved_other", None)
            d = 1 / d if fn.name() == "MulBackward0" and isinstance(d, torch.Tensor) and d.numel() == 1 else d
        if isinstance(d, torch.Tensor) and d.numel() == 1 and d.device.type == "cpu" and \
                math.isclose(d.item(), cfg.accum_steps, rel_tol=1e-6):
            raise ValueError(f"zero: the loss is divided by accum_steps={cfg.accum_steps}: pass the plain mean loss "
                             "of the micro-batch; engine.backward divides by Config.accum_steps itself")
        self.net.agree("backward")
        if not self.learned:
            self._learn()
        self._settle()
        self.in_flight, self.launch_next, self.done_to, self.cursor[1] = collections.deque(), 0, 0, 0
        for u in self.units:
            u.posts, u.reduced = 0, False
        if self.shards_params and self.rorder and cfg.prefetch:
            self._unshard(self.rorder[0], wait=False)   # the forward's last block is the first one back
        self.in_backward = True
        try:
            # fp16: scale the loss up so small gradients survive in 16 bits; step() divides it out
            (loss.float() * self.scaler.scale if self.scaler.enabled else loss).backward()
        except torch.utils.checkpoint.CheckpointError as e:
            raise RuntimeError(
                "zero: activation recompute (Config.checkpoint) replayed a forward that differs from the "
                "original (see torch's message above). A model that changes state in its forward does this; "
                "Hugging Face models fill a key/value cache: pass use_cache=False (or set model.config."
                "use_cache = False), or use the model's own gradient_checkpointing_enable() with "
                "checkpoint=False") from e
        finally:
            self.in_backward = False
        self._backward_to(len(self.rorder))  # what this rank's backward did not reach, in its turn
        self._launch_ready(end=True)        # the units that stay whole, and the root
        while self.in_flight:
            self._finish_reduce(*self.in_flight.popleft())
        for u in self.units:                # stage 3: what is still whole (the root, escaped units) goes now
            u.calls = 0
            if self.shards_params and u.phase == WHOLE:
                self._reshard(u)
        self.micro += 1

    def _learn(self):
        """The first backward: the ranks agree on the order their forwards ran the blocks in (a model may run
        them in another order than it registers them), on the units that stay whole, and on those with no
        backward (nothing before them requires grad); the schedules follow them from now on."""
        seen = {u.index: u.grad_out for u in self.order if u.grad_out is not None}
        every = self.net.all_gather_object((list(dict.fromkeys(self.ran)), [u.index for u in self.units if u.keep],
                                            seen))
        keep = {i for _, k, _ in every for i in k}
        with_grad = {i for *_, s in every for i, g in s.items() if g}
        without = {i for *_, s in every for i, g in s.items() if not g} - with_grad
        for u in self.units:
            u.keep = u.keep or u.index in keep
        order = _merge_orders([s for s, _, _ in every], [u.index for u in self.order])
        self._schedule([self.units[i] for i in order], {u.index for u in self.units} - without)
        self.learned = True

    # -- step

    def step(self):
        """AdamW on this rank's shard, then the updated parameters go back to every rank.
        Returns False when the gradients were not finite (fp16 overflow: the step is skipped)."""
        return self.optimizer.step()        # through the optimizer, so LR schedulers see the step

    def _step(self):
        cfg = self.cfg
        if self.micro != cfg.accum_steps:
            raise RuntimeError(f"zero: step() after {self.micro} backward() calls; "
                               f"Config.accum_steps={cfg.accum_steps} asks for exactly that many")
        if self.unfilled:
            raise RuntimeError(f"zero: step() while {sorted(self.unfilled)[:8]} were never initialized")
        late = [n for u in self.units for f in u.flats if not f.trainable
                for n, p in zip(f.names, f.params) if p.requires_grad]
        if late:
            raise RuntimeError(f"zero: {late} were frozen when zero.Zero wrapped the model and require grad now; "
                               "the engine holds no optimizer state for them. Make them trainable before "
                               "zero.Zero(model) and freeze them after (a frozen parameter is left untouched)")
        self.net.agree("step")
        self.micro = 0
        # from here to the update, every rank runs the same collectives in the same order
        if cfg.stage == 1:                  # stage 1 reduce-scatters once, now
            self.in_flight = collections.deque()
            for u in self.launch_order:
                self._reduce(u)
            while self.in_flight:
                self._finish_reduce(*self.in_flight.popleft())
        self._settle()
        if self.pin:
            torch.cuda.synchronize(self.device)    # the gradient shards' copies to the host have landed
        if self.net.replicas > 1:
            self._sum_replicas()
        # one all-reduce carries the step's agreement, in fp64 (exact for these integers): the squared norm of
        # the unscaled gradient, counted once per shard (inf or nan: overflow); a fingerprint of each rank's
        # collectives f, as f and f^2 (sum^2 = N * sum of squares only if all are equal); and which parameters
        # got a gradient on any rank
        flats = [u.train for u in self.units if u.train]
        stats = torch.zeros(3 + sum(len(f.params) for f in flats), dtype=torch.float64, device=self.device)
        for f in flats:
            stats[0] += torch.linalg.vector_norm(f.grad_shard, dtype=torch.float32).to(self.device) ** 2
        # a copy held by several ranks (stage 0's whole gradient, hybrid replicas) counts once; the others
        # add 0 * their sum, which is nan if theirs is not finite, so an overflow anywhere skips everywhere
        stats[0] *= float((self.net.replica if self.shards_optim else self.rank) == 0)
        fp = zlib.crc32(repr(self.net.trace).encode()) % (1 << 21)
        stats[1:3] = torch.tensor([fp, fp * fp], dtype=torch.float64)
        stats[3:] = torch.tensor([i in f.got for f in flats for i in range(len(f.params))], dtype=torch.float64)
        self.net.all_reduce(stats, kind="scalar")
        sq, fsum, fsq, *got = stats.tolist()
        for f in flats:
            f.written, f.got = set(), set()  # the next window starts a new accumulation
        if fsum * fsum != self.world * fsq:
            self._diverged()
        # the gradients were computed from loss * scale: divide it out of the norm
        norm = math.sqrt(sq) / self.scaler.scale
        self.grad_norm = norm
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
        # each group's hyperparameters as they are now (a scheduler sets them between steps); a parameter
        # without a gradient on any rank is left untouched, and its step count with it, as torch's AdamW does
        hyper = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in self.optimizer.param_groups]
        plans, k = {}, 0
        for f in flats:
            used, k = got[k:k + len(f.params)], k + len(f.params)
            f.steps = [s + 1 if used[i] else s for i, s in enumerate(f.steps)]
            plans[id(f)] = self._runs(f, used, hyper)
        if cfg.offload:                     # the update happens behind the next forward, on the worker
            self._start_updates(mult, plans)
        else:
            for f in flats:
                self._update(f, mult, self._param_out(f), plans[id(f)])
            self._regather()
        self.ledger_reset()
        return True

    def _regather(self, units=None):
        # stages 1-2: every rank's updated slices to every rank, in place, each unit's gathers launched before
        # any is waited for (stage 3 gathers them at their next use)
        units = [u for u in units or self.units if u.train] if self.regathers else []
        for u in units:
            u.phase = FREED
        for u in units:
            self._unshard(u, wait=False)
        for u in units:
            self._unshard(u)

    def _sum_replicas(self):
        # hybrid sharding: the shard group's reduced shard, summed with the same shard of every other group,
        # once per step (a host shard visits the device for it: NCCL reduces device memory)
        works = []
        for u in self.units:
            if u.train:
                t = u.train.grad_shard.to(self.device)
                works.append((u.train, t, self.net.all_reduce(t, "replica", "replica_all_reduce", False, u.index)))
        for f, t, work in works:
            self.net.wait(work)
            if t is not f.grad_shard:
                f.grad_shard.copy_(t)
                for kind in ("h2d", "d2h"):
                    self.net.count(kind, t.numel(), t.element_size())

    def _runs(self, f, used, hyper):
        """AdamW calls for f's owned range: one per run of adjacent parameters with equal hyperparameters
        and step count (a shard cuts across parameters), skipping parameters without a gradient."""
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
        """AdamW on f's owned range; `out` receives the updated weights in the compute dtype."""
        for a, b, lr, b1, b2, eps, wd, step in runs:
            adamw_step(f.master[a:b], f.grad_shard[a:b], f.exp_avg[a:b], f.exp_avg_sq[a:b], step,
                       lr, b1, b2, eps, wd, grad_mult=mult, out=None if out is None else out[a:b])

    def _start_updates(self, mult, plans):
        # the forward's order: the root first, then the blocks (the next forward needs them in that order)
        jobs = []
        for u in ([self.root] if self.root else []) + self.order:
            if u.train:
                jobs.append((u, functools.partial(self._host_update, u, mult, plans[id(u.train)])))
                if self.regathers and u.phase == WHOLE:
                    self._reshard(u)        # the others' slices are last step's until the next forward gathers
                # the updated 16-bit slice goes back to the device (on a CPU machine: into the parameters)
                self.net.count("h2d", u.train.hi - u.train.lo, u.train.flat.element_size())
        self.worker.submit(jobs)

    def _host_update(self, u, mult, runs):
        # on the worker thread; no collective here: the caller's thread gathers, in its forward, so the order of
        # collectives is the program's own on every rank
        f = u.train
        dest = self._param_out(f)
        if f.staging is None:
            return self._update(f, mult, dest, runs)
        if u.h2d is not None:
            u.h2d.synchronize()             # last step's copy out of the staging buffer has finished
        self._update(f, mult, f.staging, runs)
        for a, b, *_ in runs:               # only what was updated: a parameter without a gradient keeps its value
            dest[a:b].copy_(f.staging[a:b], non_blocking=True)
        if dest.is_cuda:                    # the next forward's stream waits for this event, not for the thread
            u.h2d = torch.cuda.Event()
            u.h2d.record()

    def _settle(self):
        """Every unit's host update done and (stages 1-2 with offload) gathered: the state is this step's."""
        for u in self.units if self.worker else ():
            self.worker.wait(u)
        for u in self.units if self.cfg.offload and self.regathers else ():
            self._unshard(u)

    def _diverged(self):
        """The ranks' collectives differed in this step: say which, change nothing, and stop."""
        traces = self.net.all_gather_object((self.net.trace, self.ran))
        (t0, _), diff = traces[0], "?"
        for r, (t, _) in enumerate(traces):
            if t != t0:
                j = next((j for j, (x, y) in enumerate(zip(t0, t)) if x != y), min(len(t0), len(t)))
                name = lambda s: f"{s[j][0]} of {self._unit_name(s[j][1])}" if j < len(s) else "nothing"  # noqa
                diff = f"collective #{j}: rank 0's was {name(t0)}, rank {r}'s {name(t)}"
                break
        ran = "; ".join(f"rank {r}: {[self._unit_name(i) for i in x]}" for r, (_, x) in enumerate(traces))
        self.ledger_reset()
        raise RuntimeError(f"zero: the ranks ran different collectives in this step ({diff}); nothing was updated. "
                           f"Units each rank's forwards ran: {ran}. At stage 3 a unit called a different number of "
                           "times on different ranks does this: call every unit equally often, or use stage 2")

    def _unit_name(self, i):
        return self.units[i].name if isinstance(i, int) else "the step"

    @property
    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        for g in self.optimizer.param_groups:   # a schedule set by hand: every group gets it
            g["lr"] = value

    # -- what the engine tells its user

    def ledger_reset(self):
        # called at the end of each step: what one step moved, from the forward to the update
        self.last_comm = {k: dict(calls=c, elements=e, bytes=b) for k, (c, e, b) in self.net.ledger.items()}
        self.net.ledger, self.net.trace, self.ran = {}, [], []

    def comm(self):
        return self.last_comm

    @property
    def loss_scale(self):
        return self.scaler.scale

    def memory(self):
        """Bytes of model state this rank really holds, by kind, on the device and on the host,
        counted from the tensors' storages (each storage once)."""
        out = {w: dict(params=0, grads=0, master=0, optim=0, frozen=0) for w in ("device", "host")}
        seen = set()                        # views share storage (stage 1's shard, fp32 masters): count once

        def add(t, kind, where):
            st = t.untyped_storage() if t is not None else None
            if st is not None and st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out[where][kind] += st.nbytes()
        host = "host" if self.cfg.offload else "device"
        # (on a CPU-only machine "device" and "host" are one memory: the split is by role, as on a GPU)
        for u in self.units:
            for f in u.flats:
                if not f.trainable:
                    for t in (f.flat, f.shard, f.master):
                        add(t, "frozen", "device")
                    continue
                add(f.flat, "params", "device")
                add(f.shard, "params", "device")
                add(f.grad, "grads", "device")
                add(f.acc, "grads", "device")
                add(f.grad_shard, "grads", host)
                add(f.master, "master", host)
                add(f.exp_avg, "optim", host)
                add(f.exp_avg_sq, "optim", host)
                add(f.staging, "params", "host")
        return out

    def num_params(self, padded=False, frozen=False):
        # Ψ of the formulas: trainable parameters (frozen=True: frozen ones; padded: as the flat buffers hold them)
        return sum(f.padded if padded else f.numel for u in self.units for f in u.flats if f.trainable != frozen)

    # -- the whole model in and out, one unit at a time

    def full_state_dict(self, rank0_only=False):
        """The whole model as a plain fp32 state_dict of CPU tensors (a collective: every rank calls it).
        One flat buffer is gathered at a time and moved to the CPU at once, so the device never holds more
        than a unit; rank0_only=True: only rank 0 keeps the result, the others get {}."""
        self.net.agree("full_state_dict")
        self._settle()
        keep = not rank0_only or self.rank == 0
        values = {}
        for u in self.units:
            for f in u.flats:
                full = self._whole(f)
                for p, o in zip(f.params, f.offsets) if keep else ():
                    values[id(p)] = full[o:o + p.numel()].view(p.shape).to("cpu", copy=True)
                del full
        # keys and order from the model's own state_dict: tied names and buffers included
        sd = {}
        for k, t in _model_state(self.module).items() if keep else ():
            v = values.get(id(t))
            sd[k] = v if v is not None else t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype,
                                                           copy=True)
        return sd

    def _whole(self, f):
        # f's whole values in fp32: the master weights (full precision) where there are, else the held values
        src = (f.master if f.master is not None else self._owned(f)).to(self.device, torch.float32)
        if f.hi - f.lo == f.padded:         # whole here: stage 0, frozen parameters at stages 0-2
            return src
        full = torch.empty(f.padded, dtype=torch.float32, device=self.device)
        self.net.all_gather(full, src, kind="state_dict")   # its own ledger kind: not training traffic
        return full

    def load_state_dict(self, state_dict, strict=True):
        """Weights from a plain state_dict (model.state_dict() names; tied aliases fine) into every copy the
        engine keeps: master weights, 16-bit and frozen parameters, buffers. Each rank reads only the slices it
        owns (a memory-mapped file reads only those pages); Adam's moments start fresh. Missing, unexpected and
        wrongly shaped entries are one error; with strict=False they are skipped and returned."""
        self.net.agree("load_state_dict")
        self._settle()
        want = _model_state(self.module)
        aliases = _aliases(self.module)
        slot = {id(p): next((a for a in aliases[id(p)] if a in state_dict), None) for u in self.units for p in u.params}
        missing = [k for k, t in want.items() if k not in state_dict and not (id(t) in slot and slot[id(t)])]
        unexpected = [k for k in state_dict if k not in want]
        shapes = [f"{k}: {list(state_dict[k].shape)} vs the model's {list(want[k].shape)}" for k in state_dict
                  if k in want and tuple(state_dict[k].shape) != tuple(want[k].shape)]
        if strict and (missing or unexpected or shapes):
            raise ValueError("zero: load_state_dict: " + "; ".join(x for x in (
                f"missing {missing}" if missing else "", f"unexpected {unexpected}" if unexpected else "",
                f"shapes differ: {shapes}" if shapes else "") if x))
        bad = {k.split(":")[0] for k in shapes}

        def read(name, p, start, n, key):
            k = slot[id(p)]
            if key != "master" or k is None or k in bad:   # Adam starts fresh; a skipped entry keeps its value
                return None
            return state_dict[k].reshape(-1)[start:start + n]
        extra = {k: v for k, v in state_dict.items() if k in want and k not in bad and id(want[k]) not in slot}
        filled = {a for u in self.units for p in u.params if slot[id(p)] not in (None, *bad) for a in aliases[id(p)]}
        self._warn_rounded(_restore(self, lambda: (read, extra), "load the state_dict", filled | set(extra)))
        for u in self.units:
            for f in u.flats:
                f.steps = [0] * len(f.params)
        return LoadResult(missing, unexpected, shapes)

    def _refuse_state_dict(self, *args, **kwargs):
        raise RuntimeError("zero: model.state_dict() after zero.Zero(model) would not hold the trained weights "
                           "(the fp32 master weights are sharded across ranks; at stage 3 the parameters too). Use "
                           "engine.full_state_dict() (every rank calls it; rank0_only=True keeps it on rank 0 only) "
                           "or zero.save(engine, dir)")


LoadResult = collections.namedtuple("LoadResult", "missing_keys unexpected_keys wrong_shapes")


class HostWorker:
    """ZeRO-Offload's update thread: it takes one step's jobs (unit, fn) in the forward's order and runs them,
    while the caller goes on to the next forward, which waits only for the unit it is about to run. A failure is
    raised in the caller's thread at its next wait; at exit the thread finishes its jobs (a daemon thread killed
    inside a kernel aborts the process)."""

    def __init__(self, device, timeout_s):
        self.jobs, self.error, self.timeout = queue.Queue(), None, timeout_s
        self.thread = threading.Thread(target=self._run, args=(device,), daemon=True, name="zero-offload-adam")
        self.thread.start()
        atexit.register(self.close)

    def submit(self, jobs):
        for u, _ in jobs:
            u.updated.clear()
        self.jobs.put(jobs)

    def _run(self, device):
        if device.type == "cuda":
            torch.cuda.set_device(device)   # the current GPU is per thread
        for jobs in iter(self.jobs.get, None):
            for u, fn in jobs:
                try:
                    fn()
                except BaseException as e:  # handed to the caller at its next wait
                    self.error = e
                u.updated.set()

    def wait(self, u):
        # a bounded wait for u's update; the forward's stream then waits for its copy to the device
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
# path/step_00001000/       one checkpoint: meta.json (layout, config, step, scaler, param groups,
#                           checksums), written after every rank's rank_00000.pt ... (its RNG; and for
#                           one copy of the shards, a slice of every flat buffer's unpadded layout: fp32
#                           master and Adam moments of the trained parameters, frozen ones as held; rank 0:
#                           the buffers and the script's own `extra`)
# Every file is written under a temporary name and renamed into place, so a crash at any moment
# leaves `latest` pointing at the previous checkpoint, whole. Loading slices the flat layout, so a
# checkpoint loads onto any world size and stage.

FORMAT = "zero.py-checkpoint-2"     # -1 (frozen parameters whole, with the buffers) still loads


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


def save(engine, path, extra=None):
    """Write a sharded checkpoint of `engine` under directory `path` (every rank calls it). `extra`, the
    script's own state (step, best loss, model args: tensors and plain Python values), is committed with it,
    in the same atomic step, and load() returns it as meta["extra"]."""
    net, rank, world = engine.net, engine.rank, engine.world
    net.agree("save")
    engine._settle()                        # offload: the shard state must be this step's
    # rank 0 picks a fresh directory and tells the others: a save never writes into a complete checkpoint
    name = None
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        k, base = 0, f"step_{engine.step_count:08d}"
        while os.path.exists(os.path.join(path, base + (f"_{k}" if k else ""))):
            k += 1
        name = base + (f"_{k}" if k else "")
        os.makedirs(os.path.join(path, name))
    name = net.broadcast_object(name)
    d = os.path.join(path, name)
    # one copy of the shards: file r holds slice [r*S, (r+1)*S) of every flat buffer's unpadded layout, S the
    # shard size, whatever the stage (stage 0 holds everything but saves only its slice), so that any run
    # finds element i of a buffer in file i // S. With hybrid sharding the first shard group writes them.
    flats = [f for u in engine.units for f in u.flats]
    n_files, r = (net.shards, net.shard_rank) if engine.shards_optim else (world, rank)
    shards = []
    for f in flats if net.replica == 0 else ():
        size = f.padded // n_files
        a, b = r * size, min((r + 1) * size, f.numel)
        held = {"master": f.master if f.master is not None else engine._owned(f)}
        if f.trainable:
            held.update(exp_avg=f.exp_avg, exp_avg_sq=f.exp_avg_sq)
        lo = a - f.lo                       # where that slice sits in this rank's owned range
        shards.append({k: v[lo:lo + max(b - a, 0)].to("cpu", torch.float32 if f.trainable else v.dtype).clone()
                       for k, v in held.items()})
    # each rank's RNG too: dropout continues the same stream after a resume on the same ranks
    blob = dict(flats=shards, rng=torch.get_rng_state())
    if torch.cuda.is_available():
        blob["cuda_rng"] = torch.cuda.get_rng_state()
    if rank == 0:                           # the buffers are the same on every rank: rank 0 saves them
        blob["buffers"] = {k: v.detach().cpu() for k, v in _model_state(engine.module).items() if id(v) not in
                           engine.owned}
        blob["extra"] = extra
    fname = os.path.join(d, f"rank_{rank:05d}.pt")
    _write_atomic(fname, lambda f: torch.save(blob, f))
    # meta.json records every file's checksum, so it can only be written once every rank has written
    sums = net.all_gather_object(_sha256(fname))
    if rank == 0:
        aliases = _aliases(engine.module)
        layout = [dict(numel=f.numel, frozen=not f.trainable, params=[
            dict(name=n, shape=list(p.shape), offset=o, aliases=aliases[id(p)], step=s)
            for n, p, o, s in zip(f.names, f.params, f.offsets, f.steps)]) for f in flats]
        groups = [{k: v for k, v in g.items() if k in GROUP_KEYS or k == "initial_lr"}
                  for g in engine.optimizer.param_groups]
        meta = dict(format=FORMAT, world_size=world, shards=n_files, stage=engine.cfg.stage, dtype=engine.cfg.dtype,
                    config=asdict(engine.cfg), step=engine.step_count, scaler=engine.scaler.state_dict(),
                    param_groups=groups, flats=layout, state_dict_keys=list(_model_state(engine.module)),
                    sha256={f"rank_{r:05d}.pt": s for r, s in enumerate(sums)})
        _write_atomic(os.path.join(d, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        # the commit point: until this rename, `latest` names the previous checkpoint, which is whole
        _write_atomic(os.path.join(path, "latest"), lambda f: f.write(name.encode()))
        # older checkpoints go only once the new one is complete (a crash here leaves an extra, never none)
        for old in os.listdir(path):
            if old.startswith("step_") and old != name:
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    net.all_gather_object(None)             # nobody returns before the checkpoint is whole


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
        assert meta.get("format") in (FORMAT, "zero.py-checkpoint-1")
    except (ValueError, AssertionError) as e:
        raise ValueError(f"zero: {meta_file} is corrupt or of another format; use an earlier checkpoint") from e
    meta.setdefault("flats", meta.get("units"))
    return path, meta


class _Files:
    """A checkpoint's rank files, each opened once, memory-mapped (only the slices read are read), and checked
    against its checksum by one rank: `check` is this rank's share (a failure there is raised on every rank by
    the caller)."""

    def __init__(self, d, meta, check):
        self.d, self.meta, self.open = d, meta, {}
        for r in check:
            fname = os.path.join(d, f"rank_{r:05d}.pt")
            # each failure names the file, what is wrong with it, and what to do
            if not os.path.isfile(fname):
                raise FileNotFoundError(f"zero: checkpoint {d} lacks rank_{r:05d}.pt (it was saved by "
                                        f"{meta['world_size']} ranks); the files were lost or copied in part: copy "
                                        "them all, or use an earlier checkpoint")
            if _sha256(fname) != meta["sha256"][f"rank_{r:05d}.pt"]:
                raise ValueError(f"zero: {fname} is truncated or corrupted (its sha256 does not match meta.json); "
                                 "use an earlier checkpoint")

    def __call__(self, r):
        if r not in self.open:              # weights_only: a checkpoint is data, never code
            blob = torch.load(os.path.join(self.d, f"rank_{r:05d}.pt"), map_location="cpu", weights_only=True,
                              mmap=True)
            blob.setdefault("flats", blob.get("units"))
            blob.setdefault("buffers", blob.get("extra") if "units" in blob else None)
            self.open[r] = blob
        return self.open[r]

    def read(self, saved, start, n, key):
        """Elements [start, start+n) of a saved parameter, assembled from the rank files that hold them;
        `saved` is (flat, offset, numel, shard size, shape) from _by_name."""
        i, offset, _, size, _ = saved
        if i is None:                       # format 1: a frozen parameter, whole in rank 0's buffers
            return self(0)["buffers"][offset].reshape(-1)[start:start + n] if key == "master" else None
        # walk the saved buffer's layout from file to file: element e is in file e // size
        out, a = [], offset + start
        while a < offset + start + n:
            r = a // size
            b = min(offset + start + n, (r + 1) * size)
            out.append(self(r)["flats"][i][key][a - r * size:b - r * size])
            a = b
        return torch.cat(out) if len(out) > 1 else out[0]


def _by_name(meta):
    """name -> (flat, offset, numel, shard size at save time, shape) in the saved layout."""
    out = {}
    for i, f in enumerate(meta["flats"]):
        size = -(-f["numel"] // meta.get("shards", meta["world_size"]))   # as in Flat
        for p in f["params"]:
            out[p["name"]] = (i, p["offset"], math.prod(p["shape"]), size, p["shape"])
    return out


def load(engine, path):
    """Restore a checkpoint into `engine` (every rank calls it): its own world size and stage, or any
    other. Nothing in the engine changes unless every rank read everything it needs. On as many ranks as saved
    it, each rank's random state comes back too (dropout goes on as if never stopped; seed after load() for a
    stream of your own). Returns its meta.json, with the script's `extra` given to save()."""
    engine.net.agree("load")
    engine._settle()
    got = {}

    def prepare():
        d, meta = _resolve(path)
        saved = _by_name(meta)
        files = _Files(d, meta, range(engine.rank, meta["world_size"], engine.world))
        if meta["format"] != FORMAT:        # format 1: frozen parameters whole, among rank 0's buffers
            saved.update({k: (None, k, 0, 0, list(v.shape)) for k, v in files(0)["buffers"].items() if k not in saved})
        mine = [(n, tuple(p.shape)) for u in engine.units for f in u.flats for n, p in zip(f.names, f.params)]
        missing = [n for n, _ in mine if n not in saved]
        extra = [n for n in saved if n not in dict(mine) and saved[n][0] is not None]
        shapes = [f"{n} {list(s)} vs {saved[n][4]}" for n, s in mine if n in saved and list(s) != saved[n][4]]
        if missing or extra or shapes:
            raise ValueError("zero: the checkpoint is of another model: " + "; ".join(
                x for x in (f"not in checkpoint: {missing}" if missing else "",
                            f"not in model: {extra}" if extra else "",
                            f"shapes differ: {shapes}" if shapes else "") if x))
        got.update(meta=meta, rng=files(engine.rank) if meta["world_size"] == engine.world else None,
                   steps={p["name"]: p.get("step", meta["step"]) for f in meta["flats"] for p in f["params"]},
                   extra=files(0).get("extra"))
        # by name, not by position: a parameter may sit in another unit, offset or shard than when saved
        read = lambda name, p, start, n, key: files.read(saved[name], start, n, key)   # noqa: E731
        return read, files(0)["buffers"]
    _restore(engine, prepare, f"load {path}")
    meta = got["meta"]
    for u in engine.units:
        for f in u.flats:
            f.steps = [got["steps"].get(n, 0) for n in f.names]
    engine.step_count = meta["step"]
    engine.scaler.load_state_dict(meta["scaler"])
    groups = engine.optimizer.param_groups
    if len(meta.get("param_groups", groups)) == len(groups):    # each group's lr, betas, eps, decay as saved
        for g, s in zip(groups, meta.get("param_groups", ())):
            g.update(s, betas=tuple(s["betas"]))
    else:
        warnings.warn(f"zero: the checkpoint has {len(meta['param_groups'])} param groups, the engine "
                      f"{len(groups)}: the engine's hyperparameters are kept")
    # the same ranks again: each continues its own random stream (dropout), as if never stopped
    if got["rng"] is not None:
        torch.set_rng_state(got["rng"]["rng"])
        if "cuda_rng" in got["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(got["rng"]["cuda_rng"])
    return dict(meta, extra=got["extra"])


def read_extra(path):
    """The script's `extra` of a checkpoint, read without an engine (a script rebuilds its model from it first)."""
    d, meta = _resolve(path)
    return _Files(d, meta, [0])(0).get("extra")


def _restore(engine, prepare, what, filled=None):
    """Put new weights (and Adam moments, where `read` has them) into every copy the engine keeps.
    prepare() -> (read(name, param, start, n, key) -> elements or None, {state_dict key: tensor} of buffers).
    Phase 1 reads this rank's owned slices into fresh tensors; phase 2 has every rank learn whether every rank
    succeeded; only then, phase 3 changes the engine. `filled`: the names this fills (None: all). Returns the
    frozen parameters whose loaded slices change when rounded to the compute dtype."""
    try:
        read, extra = prepare()
        new, rounded = [], []
        for u in engine.units:
            for f in u.flats:
                # a slice `read` does not have keeps its value; a moment starts at zero
                held = f.master if f.master is not None else engine._owned(f)
                st = {"master": held.to("cpu", torch.float32, copy=True)}
                if f.trainable:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(st["master"]), torch.zeros_like(st["master"])
                for n, p, o in zip(f.names, f.params, f.offsets):
                    a, b = max(o, f.lo), min(o + p.numel(), f.hi)
                    for k in st if a < b else ():
                        piece = read(n, p, a - o, b - a, k)
                        if piece is not None:
                            st[k][a - f.lo:b - f.lo] = piece
                            if f.master is None and not f.trainable and not torch.equal(
                                    piece.float(), piece.to(engine.dtype).float()):
                                rounded.append(n)
                new.append((f, st))
        error = None
    except Exception as e:                  # a missing or corrupt file, another model: nothing has changed yet
        error = e
    # phase 2: any failure is raised on every rank, instead of a hang in the collectives below; zero's own
    # message (a file that fails its checksum) before what reading that file gave another rank
    failed = engine.net.all_gather_object(f"{type(error).__name__}: {error}" if error else None)
    named = [f for f in failed if f and "zero:" in f] or [f for f in failed if f]
    if error is not None and ("zero:" in str(error) or f"{type(error).__name__}: {error}" == named[0]):
        raise error
    if named:
        raise RuntimeError(f"zero: another rank could not {what}: {named[0]}")
    # phase 3: the shard state in place, then the 16-bit parameters rebuilt from it, as step() does
    for f, st in new:
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
    """A sharded checkpoint as one plain fp32 state_dict that the unwrapped model loads; memory holds
    the result and the rank files' memory maps, nothing else."""
    d, meta = _resolve(path)
    saved = _by_name(meta)
    files = _Files(d, meta, range(meta["world_size"]))
    # parameter by parameter: each is assembled from its slices in the rank files and cloned out
    values = {}
    for f in meta["flats"]:
        for p in f["params"]:
            t = files.read(saved[p["name"]], 0, math.prod(p["shape"]), "master").float().clone().view(p["shape"])
            for a in p["aliases"]:
                values[a] = t
    bufs = files(0)["buffers"]
    return {k: values[k] if k in values else (bufs[k].float() if bufs[k].is_floating_point() else bufs[k]).clone()
            for k in meta["state_dict_keys"]}


# -----------------------------------------------------------------------------
# 8. Memory estimator and the command line
#
# The paper's formula, in the same kinds as Zero.memory(): a test holds the two equal on a real model,
# and `python zero.py estimate` prints the paper's 7.5B-parameter, 64-GPU example.

def estimate_memory(num_params, world_size, stage, dtype="fp16", offload=False, shard_group=0, frozen_params=0,
                    reduce_dtype="", frozen_dtype="", accum_steps=1):
    """The ZeRO paper's model-state bytes per rank: params and grads in the compute dtype (grads in fp32 with
    reduce_dtype="fp32"), fp32 master (none in fp32 compute) and two fp32 Adam moments, each sharded by the
    stage across the shard group (all ranks, or shard_group of them); frozen parameters in the compute dtype
    (frozen_dtype="fp32": fp32, and a compute copy beside it at stages 0-2), sharded at stage 3 only."""
    c = Config(stage=stage, dtype=dtype, reduce_dtype=reduce_dtype, frozen_dtype=frozen_dtype).validate()
    psi, fz, n = num_params, frozen_params, shard_group if stage and shard_group else world_size
    # bytes per parameter: p for the 16-bit (or fp32) params, g for grads, 4 for the master, 4+4 for Adam
    p, g = DTYPES[c.dtype].itemsize, 4 if c.reduce_dtype else DTYPES[c.dtype].itemsize
    master = 0 if c.dtype == "fp32" and not offload else 4
    per = lambda s: n if stage >= s else 1  # noqa: E731 -- each stage divides one more kind by N
    frozen = (4 * fz / n if stage == 3 else 6 * fz) if c.frozen_dtype else p * fz / per(3)
    dev = dict(params=p * psi / per(3), grads=g * psi / per(2), master=master * psi / per(1), optim=8 * psi / per(1),
               frozen=frozen)
    host = dict(params=0, grads=0, master=0, optim=0, frozen=0)
    # offload moves the gradient shard, master and moments to the host; the device keeps stage 1's whole
    # gradient, and with accumulation at stages 2-3 the shard's sum over micro-batches
    if offload:
        host.update(grads=g * psi / n, master=dev["master"], optim=dev["optim"])
        dev.update(master=0, optim=0, grads=dev["grads"] if stage == 1 else g * psi / n if accum_steps > 1 else 0)
    r = lambda d: {k: int(round(v)) for k, v in d.items()}   # noqa: E731
    return dict(device=r(dev), host=r(host))


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
    if a.cmd == "estimate":
        # the per-rank table of the ZeRO paper's Figure 1 (one row per stage)
        group = f", shard groups of {a.shard_group}" if a.shard_group else ""
        frozen = f" + {a.frozen_params:.4g} frozen" if a.frozen_params else ""
        print(f"model states per rank, {a.params:.4g} params{frozen}, {a.world_size} ranks{group}, {a.dtype} + fp32 "
              "Adam (GB = 1e9 B)")
        kinds = ("params", "grads", "master", "optim") + ("frozen",) * bool(a.frozen_params)
        print(f"{'stage':>5} " + " ".join(f"{k:>9}" for k in kinds) + f" {'total':>9}")
        for s in range(4):
            d = estimate_memory(a.params, a.world_size, s, a.dtype, shard_group=a.shard_group,
                                frozen_params=a.frozen_params)["device"]
            print(f"{s:>5} " + " ".join(f"{d[k] / 1e9:>9.4g}" for k in kinds) + f" {sum(d.values()) / 1e9:>9.1f}")
    elif a.cmd == "consolidate":
        # no processes, no GPU: the rank files are read straight from disk
        torch.save(consolidate(a.ckpt), a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
