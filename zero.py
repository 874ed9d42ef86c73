"""
zero.py: ZeRO data parallelism for PyTorch in one file.

Stages 0-3 of "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(Rajbhandari et al., 2020) by reduce-scatter / all-gather over torch.distributed, with
fp16/bf16 compute and fp32 master weights, dynamic loss scaling, activation recompute,
ZeRO-Offload's CPU Adam (Ren et al., 2021), hybrid sharding across nodes, models built on
the meta device, torch's param groups and LR schedulers, sharded checkpoints, and a memory
and communication ledger. The same code runs on CUDA with NCCL and on CPU with gloo.

    import zero
    rank, world_size, device = zero.init_distributed()
    engine = zero.Zero(model, zero.Config(stage=3, dtype="bf16"))
    loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()
    with torch.device("meta"): big = Model()          # bigger than one rank: built unit by unit in Zero
    engine = zero.Zero(big, cfg, init_fn=big.init_weights); engine.load_state_dict(torch.load(f, mmap=True))

    torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3
    python zero.py estimate --params 7.5e9 --world-size 64 [--shard-group 8]
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
import datetime
import functools
import hashlib
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
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
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
        if not (isinstance(self.shard_group, int) and self.shard_group >= 0) or (self.stage == 0 and self.shard_group):
            bad(f"shard_group={self.shard_group!r} at stage {self.stage}", "use 0 (all ranks), or k >= 1 ranks per "
                "shard group at stages 1-3 (stage 0 shards nothing)")
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
_GROUPS = {}   # (ranks, purpose, world) -> process group, made once per process and shared by its engines


def _new_group(ranks, purpose, local):
    key = (tuple(ranks), purpose, id(dist.group.WORLD))
    if key not in _GROUPS:
        # an engine on the whole world: every rank makes every group, in one order (dist.new_group is a
        # collective); an engine on a group the user gave: only that group's ranks take part
        _GROUPS[key] = dist.new_group(list(ranks), use_local_synchronization=local)
    return _GROUPS[key]


class Comm:
    """The engine's collectives, each on the process group of its purpose:

      gather    all-gathers of the parameters, inside the rank's shard group
      reduce    reduce-scatters of the gradients (stage 0: all-reduces), inside the shard group
      replica   the reduced gradient shard summed across shard groups, once per step (hybrid sharding)
      world     every rank of the engine: the step's scalars, setup, broadcasts and checks

    Gathers and reductions get process groups of their own, so that each kind keeps one order on every
    rank even where ranks finish their gradients at different times (a reduction launched late on one
    rank can then never pair with another rank's gather). Every call is asynchronous, waited on with a
    timeout, and recorded in a ledger of what this rank sends, counted as ring algorithms do:
    all-reduce 2M(n-1)/n, reduce-scatter and all-gather M(n-1)/n, for M elements on n ranks."""

    def __init__(self, timeout_s, group=None, shard_group=0):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ledger = {}
        up = dist.is_available() and dist.is_initialized()
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if up else [0]
        self.world = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank()) if up else 0
        k = shard_group or self.world
        if self.world % k:
            raise ValueError(f"zero.Config: shard_group={k} does not divide the {self.world} ranks; use a divisor "
                             "(the ranks of one node, LOCAL_WORLD_SIZE, is the usual choice)")
        # shard group: k consecutive ranks that together hold one copy of the model states; replica group:
        # the ranks holding the same shard, one in each shard group
        self.shards, self.shard_rank, self.replica, self.replicas = k, self.rank % k, self.rank // k, self.world // k
        self.groups = {"world": (group, self.world)}
        shard_sets = [self.ranks[i:i + k] for i in range(0, self.world, k)]
        sets = dict(gather=shard_sets, reduce=shard_sets, replica=[self.ranks[j::k] for j in range(k)])
        for purpose, subsets in sets.items():
            for s in subsets:
                pg = _new_group(s, purpose, group is not None) if len(s) > 1 else None
                if self.ranks[self.rank] in s:
                    self.groups[purpose] = (pg, len(s))

    def _log(self, kind, t, ring_factor, n):
        # what a ring sends from this rank: each of n-1 hops carries 1/n of the tensor (twice for all-reduce);
        # units are padded to a multiple of n, so this is exact
        self.count(kind, t.numel() * ring_factor * (n - 1) // n, t.element_size())

    def count(self, kind, elems, elem_size):
        calls, e, b = self.ledger.get(kind, (0, 0, 0))
        self.ledger[kind] = (calls + 1, e + elems, b + elems * elem_size)

    def wait(self, work):
        # a bounded wait: a dead or diverged rank becomes an error here, not a hang
        try:
            done = work is None or work.wait(self.timeout)
        except RuntimeError as e:   # gloo raises on a timeout, on sizes that do not match, on a dead peer
            done = e
        if done is not True:
            raise RuntimeError(f"zero: a collective failed or did not finish in {self.timeout}: another rank died, "
                               "or ran other collectives (at stage 3: called a unit a different number of times; "
                               "raise Config.timeout_s if it is just slow)") from (done or None)

    def all_reduce(self, t, purpose="world", kind="scalar", sync=True):
        pg, n = self.groups[purpose]
        self._log(kind, t, 2, n)
        # async always: callers overlap it with backward, or wait at once (sync=True)
        work = dist.all_reduce(t, group=pg, async_op=True) if n > 1 else None
        return self.wait(work) if sync else work

    def reduce_scatter(self, out, inp, kind="reduce_scatter", sync=True):
        # out may be inp's own slice [r*S, (r+1)*S): NCCL and gloo both reduce in place
        return self._flat(_reduce_scatter, out, inp, inp, "reduce", kind, sync)

    def all_gather(self, out, inp, kind="all_gather", sync=True, purpose="gather"):
        # inp may be out's own slice: an in-place gather straight into the parameters' storage
        return self._flat(_all_gather, out, inp, out, purpose, kind, sync)

    def _flat(self, collective, out, inp, whole, purpose, kind, sync):
        pg, n = self.groups[purpose]
        self._log(kind, whole, 1, n)
        if n == 1:                          # one rank: its slice is the whole tensor
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        work = collective(out, inp, group=pg, async_op=True)
        return self.wait(work) if sync else work

    def broadcast(self, t):
        # from the engine's first rank to all of its ranks
        pg, n = self.groups["world"]
        if n > 1:
            self.wait(dist.broadcast(t, self.ranks[0], group=pg, async_op=True))


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
typedef struct { float decay, scale, w, b2, w2, nstep, bc2s, eps; } hyper;  /* as adamw_step fills them */
/* one parameter, as ATen's fused CPU AdamW computes it (built with -ffp-contract=off: only these fmaf fuse) */
static inline __attribute__((always_inline)) float update(int bg, int div, int64_t i, float *p, const void *g,
    float *m, float *v, hyper h) {
  const int near = fabsf(h.w) < 0.5f; const float wl = near ? h.w : h.w - 1;  /* torch's lerp, exact at both ends */
  float gi = bg ? bf16_in(((const uint16_t *)g)[i]) : ((const float *)g)[i];
  if (div) gi /= h.scale;
  float mi = fmaf(wl, gi - m[i], near ? m[i] : gi), vi = fmaf(h.w2 * gi, gi, v[i] * h.b2);
  float pi = p[i] * h.decay + h.nstep * mi / (sqrtf(vi) / h.bc2s + h.eps);
  p[i] = pi; m[i] = mi; v[i] = vi;
  return pi;
}
static inline __attribute__((always_inline)) void body(int bg, int ob, int div, int64_t i, int64_t b,
    float *restrict p, const void *restrict g, float *restrict m, float *restrict v, uint16_t *restrict out, hyper h) {
#ifdef __SSE2__
  if (ob) {  /* out is only written: whole 64-byte lines go by streaming stores, which skip reading them first */
    for (; i < b && (uintptr_t)(out + i) % 64; i++) out[i] = bf16_out(update(bg, div, i, p, g, m, v, h));
    for (uint16_t t[32] __attribute__((aligned(64))); i + 32 <= b; i += 32) {
      for (int j = 0; j < 32; j++) t[j] = bf16_out(update(bg, div, i + j, p, g, m, v, h));
      for (int j = 0; j < 4; j++) _mm_stream_si128((__m128i *)(out + i) + j, _mm_load_si128((__m128i *)t + j));
    }
  }
#endif
  for (; i < b; i++) {
    float pi = update(bg, div, i, p, g, m, v, h);
    if (ob) out[i] = bf16_out(pi);
  }
}
/* kind: bit 0 a bf16 grad, bit 1 a bf16 out, bit 2 a loss scale or clip to divide by; each its own loop */
#define K(k) case k: body(k & 1, k >> 1 & 1, k >> 2, a, b, p, g, m, v, out, h); break;
/* the threads share *next and take a block at a time until none is left: one held up does less of the work */
void adamw(int kind, int64_t n, int64_t *next, float *p, const void *g, float *m, float *v, uint16_t *out,
           const hyper *hp) {
  const hyper h = *hp;
  for (int64_t a, b; (a = __atomic_fetch_add(next, 1 << 16, __ATOMIC_RELAXED)) < n;) {
    b = a + (1 << 16) < n ? a + (1 << 16) : n;
    switch (kind) { K(0) K(1) K(2) K(3) K(4) K(5) K(6) K(7) }
  }
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


def _parallel(fn, n, args):
    """fn(*args) on this thread and, for a large call, on up to torch.get_num_threads() - 1 pool threads:
    Python threads (the kernel releases the GIL), not OpenMP, as torch brings its own OpenMP runtime."""
    k, helpers = min(torch.get_num_threads(), n // MIN_PER_THREAD), []
    if k > 1:
        with contextlib.suppress(RuntimeError):   # no new threads at interpreter exit: this one does it all
            pool = _pools.get(os.getpid()) or _pools.setdefault(os.getpid(), ThreadPoolExecutor(os.cpu_count()))
            helpers = [pool.submit(fn, *args) for _ in range(k - 1)]
    fn(*args)                       # the threads share the blocks: whichever of them run, the call completes
    for h in helpers:
        h.result()


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
        consts = (ctypes.c_float * 8)(1 - lr * weight_decay, 1 / grad_mult, 1 - beta1, beta2, 1 - beta2,
                                      -lr / bc1, math.sqrt(bc2), eps)
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

    flat        the whole unit in the compute dtype, padded to a multiple of the shard group's size;
                every parameter is a view into it (stage 3: storage freed between uses)
    lo, hi      the range of flat this rank's optimizer owns (stage 0: all of it)
    shard       stage 3: this rank's persistent slice of the parameters (the all-gather input)
    grad        the whole gradient (stages 0-1: kept; stages 2-3: only while it is reduced)
    grad_shard  the owned slice of the reduced gradient (host with offload)
    master, exp_avg, exp_avg_sq   fp32 owned slice and Adam moments (host with offload)
    segments    (a, b, i): the owned piece [a, b) of parameter i, relative to lo
    steps       AdamW steps per parameter: one without a gradient anywhere skips the step, as in torch
    group       index of each parameter's param group (its lr, betas, eps, weight decay)
    """

    def __init__(self, index, module, named_params, shards, shard_rank, stage):
        self.index, self.module = index, module
        # the layout: parameter i lives at flat[offsets[i] : offsets[i] + numel], in named_parameters order
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        # padding to a multiple of the shard group gives every rank an equal shard, as the collectives require
        self.padded = -(-off // shards) * shards
        size = self.padded // shards
        self.lo, self.hi = (0, self.padded) if stage == 0 else (shard_rank * size, (shard_rank + 1) * size)
        self.segments = [(max(o, self.lo) - self.lo, min(o + p.numel(), self.hi) - self.lo, i)
                         for i, (p, o) in enumerate(zip(self.params, self.offsets))
                         if max(o, self.lo) < min(o + p.numel(), self.hi)]
        self.steps, self.group = [0] * len(self.params), [0] * len(self.params)
        # the tensors themselves are made by Zero._build, which knows the stage, dtype and device
        self.flat = self.shard = self.grad = self.grad_shard = None
        self.master = self.exp_avg = self.exp_avg_sq = None
        self.staging = None         # offload on CUDA: pinned 16-bit copy of the owned slice
        self.gather_work = None     # the all-gather in flight, if any
        self.gathered = True        # flat holds every rank's current values
        self.keep = False           # stage 3: a parameter is used outside the unit's forward: whole until backward ends
        self.written = set()        # params whose gradient is in `grad` (the first copies, later ones add)
        self.got = set()            # params that got a gradient in this accumulation window
        self.expected = self.arrived = 0   # gradients this backward waits for / has had
        self.ready = False          # all expected gradients are in: the unit may launch its collective
        self.updated = threading.Event()   # offload: the host update of this unit is done
        self.updated.set()


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
# One step: forward (stage 3 gathers each unit before it runs and frees it after) -> backward
# (each unit's gradient is reduced as soon as it is complete; stage 3 gathers again first) ->
# step (global norm, overflow check, clip, AdamW on the owned slice, 16-bit slice rewritten,
# stages 1-2 all-gather it). Every stage difference in the code below is an `if` on cfg.stage.
#
# One order of collectives on every rank, whatever the data: a rank whose batch skips a block or
# reaches fewer experts must still pair each collective with the same one on every other rank.
# So units are gathered in a fixed schedule (`order`: the forward's; reversed for the backward), a
# unit this rank skipped being gathered and freed at once in its turn, and reductions launch in a
# fixed order too, each once all before it have launched. The step compares a fingerprint of every
# rank's collectives before anything changes.
#
# The engine is four classes along the data flow: Gathering (whole parameters where the forward and
# backward use them), Reducing (backward: gradients in, collectives out), Offload (the host update),
# and Zero, which builds the units, registers the others' hooks, steps, and takes the model in and out.
# Zero.__init__ is the place to start reading.

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


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
                           "shards, not here: save and restore it with zero.save(engine, dir) / zero.load(engine, "
                           "dir), which also keep every param group's values")

    load_state_dict = state_dict


class Gathering:
    """Whole parameters where they are used: stage 3 gathers each unit into its flat buffer just before
    its forward and its backward and frees it after; offload at stages 1-2 gathers the updated shards in
    the next forward. The gathers follow one schedule on every rank, whatever the data."""

    # the flat buffer's storage is resized: the parameter views (and autograd's saved references) stay valid

    def _start_gather(self, u):
        if u.gathered or u.gather_work is not None:
            return
        if self.cfg.stage == 3:
            # storage back to full size, then the gather writes straight into it: no copy in or out
            u.flat.untyped_storage().resize_(u.padded * u.flat.element_size())
            held = sum(x.flat.untyped_storage().nbytes() for x in self.units)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)
        self.trace["gather"].append(u.index)
        # stage 3 gathers from its shard; offload at stages 1-2 from the freshly updated owned slice
        u.gather_work = self.net.all_gather(u.flat, self._owned_params(u), sync=False)
        if u.gather_work is None:
            u.gathered = True

    def _gather(self, u):
        # start it (if no prefetch did) and wait for it: after this, u's parameters are whole and current
        if u.gathered:
            return
        self._wait_update(u)
        self._start_gather(u)
        if u.gather_work is not None:
            self.net.wait(u.gather_work)
            u.gather_work, u.gathered = None, True

    def _prefetch(self, u):
        # start u's gather now, so it travels while the current unit computes (with offload, only if the
        # worker is done with u: waiting here would undo the overlap)
        if self.cfg.prefetch and u.updated.is_set():
            self._start_gather(u)

    def _free(self, u):
        # the memory goes back; the parameters (and autograd's saved references) keep pointing at this storage
        assert u.gather_work is None
        u.flat.untyped_storage().resize_(0)
        u.gathered = False

    def _release(self, u):
        # stage 3: a unit done with for now is freed, unless it must stay whole (the root, escaped parameters)
        if self.cfg.stage == 3 and u.gathered and u is not self.root and not u.keep:
            self._free(u)

    def _gather_to(self, u, back=False):
        """The gather schedule: the units of `order`, reversed for the backward. Every unit before u that
        this rank did not run is gathered (and freed) in its turn, as the ranks that do run it gather it;
        then u, and the next one's gather starts (prefetch). u=None: to the end of the schedule."""
        order = self.rorder if back else self.order
        end = len(order) - 1 if u is None else u.rpos if back else u.pos
        while self.cursor[back] <= end:
            v = order[self.cursor[back]]
            self.cursor[back] += 1
            self._gather(v)
            if v is not u:
                self._release(v)
        if u is not None:
            if not u.gathered:              # out of turn: a unit run twice in a forward, or its turn passed
                self._gather(u)
            if self.cursor[back] < len(order):
                self._prefetch(order[self.cursor[back]])

    # -- forward hooks (stage 3 and offload)

    def _enter(self, module, args):
        self.depth += 1
        if self.depth == 1:
            self._begin_forward()

    def _exit(self, module, args, output):
        self.depth -= 1
        if self.depth == 0:
            self._end_forward()

    def _begin_forward(self):
        if self.last_ran is not None:       # a block called on its own since the last forward
            self._release(self.last_ran)
        self.cursor[0], self.last_ran = 0, None
        # the root, and units whose parameters are used outside their forward, stay whole through backward
        for u in [u for u in self.units if u is self.root or u.keep]:
            self._gather(u)
        if not self.checked:
            self.check = _OutOfPlaceUse(self)
            self.check.__enter__()

    def _pre_forward(self, u, module, args, kwargs):
        if self.last_ran is not None and self.last_ran is not u:
            self._release(self.last_ran)    # freed once another unit starts: a unit run twice in a row stays
        self._gather_to(u)
        self.running = self.last_ran = u
        self.ran.append(u.index)

    def _post_forward(self, u, module, args, kwargs, output):
        self.running = None
        if self.cfg.stage != 3 or not torch.is_grad_enabled():
            return
        inputs = {id(t) for t in _tensors((args, kwargs))}
        storage = u.flat.untyped_storage().data_ptr()
        for t in _tensors(output):
            if t.untyped_storage().data_ptr() == storage:
                u.keep = True               # a parameter returned to the caller: whole until its backward is done
            elif t.requires_grad and id(t) not in inputs:
                # gather again just before this unit's backward (and its recompute, if any); a tensor the unit
                # only passed through is not hooked: its gradient says nothing about this unit's backward
                t.register_hook(functools.partial(self._pre_backward, u))

    def _end_forward(self):
        if self.check is not None:
            self.check.__exit__(None, None, None)
            self.check, self.checked = None, True
        if self.last_ran is not None:
            self._release(self.last_ran)
            self.last_ran = None
        self._gather_to(None)              # units after the last one this rank ran
        if not torch.is_grad_enabled():     # no backward follows (evaluation, generation)
            for u in self.units:
                if u.gathered and self.cfg.stage == 3:
                    self._free(u)

    def _pre_backward(self, u, grad):
        # runs when the gradient of u's output is ready, before any of u's own backward (or its recompute);
        # a unit whose gradients are all in is never gathered again in this backward
        if u.arrived < len(u.params):
            self._gather_to(u, back=True)

    def _owned_params(self, u):
        """This rank's owned range of the parameters: the shard (stage 3) or its slice of the flat buffer."""
        return u.shard if self.cfg.stage == 3 else u.flat[u.lo:u.hi]

    def _param_slice(self, u):
        """Where an update writes the new parameters: nowhere when the master weights are the parameters."""
        return None if self.master_is_param else self._owned_params(u)


class Reducing:
    """Backward: each gradient moves into its unit's flat gradient as it arrives; each unit's collective
    launches once its gradients are in, in one order on every rank."""

    def _on_grad(self, u, i, p):
        # autograd's .grad is a fresh tensor per parameter; moving it into the flat gradient at once
        # keeps one copy, and lets a single collective reduce the whole unit
        if p.grad is None:
            return
        o, n = u.offsets[i], u.params[i].numel()
        if u.grad is None:                  # stages 2-3: a whole-unit gradient for this micro-batch only
            u.grad = torch.empty(u.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            if i in u.written:
                u.grad[o:o + n].add_(p.grad.view(-1))
            else:
                u.grad[o:o + n].copy_(p.grad.view(-1))
                u.written.add(i)
        p.grad = None                       # autograd's copy is freed at once
        u.got.add(i)
        u.arrived += 1
        if u.arrived == u.expected:         # every trainable parameter's gradient: u may launch its collective
            u.ready = True
            self._launch_ready()
        if u.arrived == len(u.params):      # nothing in this backward reads u's parameters any more
            self._release(u)

    def _reduces_now(self):
        # whether this micro-batch's backward launches collectives (accumulation defers stages 0-1)
        # stage 0 all-reduces on the last micro-batch, stage 1 reduce-scatters in step(), 2-3 every time
        last = self.micro == self.cfg.accum_steps - 1
        return self.cfg.stage >= 2 or (self.cfg.stage == 0 and last)

    def _launch_ready(self):
        # in launch order only, each unit once every unit before it has launched: a rank whose gradients
        # come late (an expert without tokens) delays its launches, never reorders them
        while self._reduces_now() and self.launch_next < len(self.launch_order) \
                and self.launch_order[self.launch_next].ready:
            self.launch_next += 1
            self._reduce(self.launch_order[self.launch_next - 1])

    def _reduce(self, u):
        """Launch u's gradient collective; finished ones are collected as backward goes on, so the
        whole-unit gradients of stages 2-3 are freed early."""
        g = u.grad
        if g is None:                       # no parameter of u took part in this micro-batch
            g = u.grad = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
        for i, (p, o) in enumerate(zip(u.params, u.offsets)):
            if i not in u.written:          # unused this window: zero, not last window's values
                g[o:o + p.numel()].zero_()
                u.written.add(i)
        g[u.numel:].zero_()
        # the mean over ranks and micro-batches, taken before the sum so that fp16 cannot overflow in it
        g.mul_(1.0 / (self.world * self.cfg.accum_steps))
        self.trace["reduce"].append(u.index)
        if self.cfg.stage == 0:
            work = self.net.all_reduce(g, "reduce", kind="all_reduce", sync=False)
        else:
            work = self.net.reduce_scatter(g[u.lo:u.hi], g, sync=False)
        self.in_flight.append((u, work))
        # collect what has finished, oldest first, without waiting: a wait here could block on a rank that
        # launches later, while it waits for this rank's next gather
        while self.in_flight and (self.in_flight[0][1] is None or self.in_flight[0][1].is_completed()):
            self._finish_reduce(*self.in_flight.pop(0))

    def _finish_reduce(self, u, work):
        self.net.wait(work)
        # the reduced owned slice becomes (or is added to) the gradient shard: on the host with offload,
        # copied while backward still runs, in the compute dtype (the paper's minimal traffic)
        if self.cfg.stage >= 2 or self.cfg.offload:
            mine = u.grad[u.lo:u.hi]
            if self.cfg.offload:
                self.net.count("d2h", mine.numel(), mine.element_size())
            if self.micro == 0 or self.cfg.stage <= 1:
                u.grad_shard.copy_(mine, non_blocking=self.pin)
            else:
                u.grad_shard.add_(mine.to(u.grad_shard.device))
        if self.cfg.stage >= 2:
            u.grad, u.written = None, set()   # stages 2-3 keep no whole gradient between micro-batches

    def backward(self, loss):
        """Backward of this micro-batch's mean loss; returns when its gradients are reduced."""
        if self.micro >= self.cfg.accum_steps:
            raise RuntimeError(f"zero: backward() called {self.micro + 1} times without step(); "
                               f"Config.accum_steps={self.cfg.accum_steps}")
        self._settle()
        # a parameter frozen after wrapping sends no gradient: its unit does not wait for it
        for u in self.units:
            u.expected, u.arrived = sum(p.requires_grad for p in u.params), 0
            u.ready = u.expected == 0
        self.in_flight, self.launch_next, self.cursor[1] = [], 0, 0
        self._launch_ready()
        if self.cfg.stage == 3 and self.rorder:
            self._prefetch(self.rorder[0])  # the forward's last block is the first one back
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
        if self.cfg.stage == 3:
            self._gather_to(None, back=True)         # units this rank's backward never reached, gathered in their turn
        if self._reduces_now():
            for u in self.launch_order[self.launch_next:]:   # units with missing gradients, and the root
                u.ready = True
            self._launch_ready()
        for item in self.in_flight:
            self._finish_reduce(*item)
        self.in_flight = []
        # stage 3: whatever is still whole (the root, units whose gradients never all came) goes now
        for u in self.units:
            if self.cfg.stage == 3 and u.gathered:
                self._free(u)
        self.micro += 1


class Offload:
    """ZeRO-Offload: a worker thread updates unit by unit in forward order, while the caller goes on to
    the next forward, which waits only for the unit it is about to run."""

    def _start_updates(self, mult, plans):
        # one long-lived worker per engine; jobs go through a queue, one job per step
        if self.worker is None:
            self.jobs, self.worker_error = queue.Queue(), None
            self.worker = threading.Thread(target=self._worker, daemon=True, name="zero-offload-adam")
            self.worker.start()
            # a daemon thread killed inside a kernel at exit aborts the process: let it finish first
            atexit.register(lambda: [u.updated.wait(self.cfg.timeout_s) for u in self.units])
        for u in self.units:
            u.updated.clear()
            if self.cfg.stage in (1, 2):
                u.gathered = False          # the other ranks' slices are last step's until gathered
            # the updated 16-bit slice goes back to the device (on a CPU machine: into the parameters)
            self.net.count("h2d", u.hi - u.lo, u.flat.element_size())
        # the forward's order: the root first, then the blocks (the next forward needs them in that order)
        self.jobs.put(((self.root,) * bool(self.root) + tuple(self.order), mult, plans))

    def _worker(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)   # the current GPU is per thread
        while True:
            units, mult, plans = self.jobs.get()
            for u in units:
                try:
                    dest = self._param_slice(u)
                    if u.staging is not None:   # CUDA: 16-bit result to pinned memory, then to the device
                        self._update(u, mult, u.staging, plans[u.index])
                        dest.copy_(u.staging, non_blocking=True)
                    else:
                        self._update(u, mult, dest, plans[u.index])
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


class Zero(Gathering, Reducing, Offload):
    """Wraps a model: shards it in place into units, hooks its forward and backward, and
    steps AdamW on this rank's shard. Call it like the model, then backward(loss), then step()."""

    def __init__(self, model, cfg=None, units=None, init_fn=None, param_groups=None, group=None):
        # a bad config fails here, before any collective or allocation
        self.cfg = cfg = (cfg or Config()).validate()
        self.net = Comm(cfg.timeout_s, group, cfg.shard_group)
        self.rank, self.world = self.net.rank, self.net.world
        self.dtype = DTYPES[cfg.dtype]
        self.device = _engine_device()
        self.module = model
        self.scaler = LossScaler(cfg)
        self.step_count, self.grad_norm = 0, 0.0   # step_count counts applied steps only
        self.micro = 0                      # backward calls since the last step
        self.in_flight = []                 # gradient collectives launched and not yet finished
        self.peak_gathered_bytes = 0        # stage 3: the most bytes of whole units held at once
        self.last_comm = {}
        self.cursor, self.launch_next = [0, 0], 0   # the schedules' places: forward, backward; launches
        self.running = self.last_ran = self.check = None
        self.depth = 0                      # modules outside the units now running, one inside the other
        # where the shard state (master, moments, gradient shard) lives: the device, or the host with offload
        self.host = torch.device("cpu") if cfg.offload else self.device
        self.pin = cfg.offload and torch.cuda.is_available()  # pinning needs CUDA; same code path without it
        # fp32 compute without offload: the parameters are the master weights, no second copy
        self.master_is_param = self.dtype == torch.float32 and not cfg.offload
        self.names = {id(m): n for n, m in model.named_modules()}

        # -- which parameter goes to which unit: a parameter used by several units goes to the root
        unit_modules = list(units) if units is not None else find_units(model)
        # ownership by identity, so a parameter reached under two names (tied weights) counts once
        owners = {}
        for i, m in enumerate(unit_modules):
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(i)
        # frozen parameters get no gradient and no optimizer state, so they join no unit
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        if not trainable:
            raise ValueError("zero.Zero: the model has no trainable parameters (requires_grad=True); "
                             "pass the model you mean to train")
        groups = [[] for _ in unit_modules] + [[]]     # the last group is the root unit
        # named_parameters() yields each tensor once, under its first name: that name is the one we use
        for n, p in trainable:
            o = owners.get(id(p), set())
            groups[next(iter(o)) if len(o) == 1 else -1].append((n, p))
        shards, shard_rank = (self.net.shards, self.net.shard_rank) if cfg.stage else (self.world, self.rank)
        self.units, unit_of = [], {}
        for m, g in zip(unit_modules + [model], groups):
            if g:                           # a block with only frozen parameters is no unit
                unit_of[id(m)] = Unit(len(self.units), m, g, shards, shard_rank, cfg.stage)
                self.units.append(unit_of[id(m)])
        self.root = self.units[-1] if groups[-1] else None
        # the schedules: blocks in forward order, reversed for backward; reductions end with the root
        self.order = [u for u in self.units if u is not self.root]
        self.rorder = self.order[::-1]
        self.launch_order = self.rorder + ([self.root] if self.root else [])
        for j, u in enumerate(self.order):
            u.pos, u.rpos = j, len(self.order) - 1 - j
        self.optimizer = self._make_optimizer(param_groups)
        # before the first collective that depends on the layout: mismatched ranks would hang in it
        self._check_ranks_agree()

        # -- one unit at a time: a model built on the meta device becomes real here, then its unit is
        # sharded and the rest freed, so no rank ever holds the whole model
        stop, self.made, self.placed = {id(m) for m in unit_modules}, set(), {}
        for m in unit_modules + [model]:
            mods = list(_post_order(m, stop - {id(m)}))   # the root: every module outside the units
            self._materialize(mods, init_fn)
            self._place_frozen(mods)
            if id(m) in unit_of:
                self._build(unit_of[id(m)])
        outside = mods                      # the last: the model's modules outside every unit

        # -- hooks
        # a gradient hook per parameter (fires once per backward, after autograd summed all its uses);
        # forward hooks per unit, for stage 3 gathering and offload waits
        for u in self.units:
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u, i))
        if cfg.stage == 3 or cfg.offload:
            # a forward begins when the first module outside the units starts (the model, or a part of it
            # called directly, as Hugging Face's generate() calls the encoder) and ends when it returns
            for m in outside:
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
        model.state_dict, model.load_state_dict = self._refuse_state_dict, self.load_state_dict
        self.ledger_reset()
        self.worker = self.worker_error = None
        self.checked = cfg.stage != 3       # stage 3 checks its first forward for parameters used out of place

    def _make_optimizer(self, param_groups):
        """torch's param groups, each parameter's group index recorded in its unit. Parameters in no
        group take Config's values, with weight decay on those of >= 2 dims only (two more groups)."""
        c = self.cfg
        defaults = dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay)
        where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}
        name = {id(p): n for n, p in self.module.named_parameters()}
        groups = list(param_groups or [])
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]  # a plain list of parameters: one group, as torch takes it
        out, seen = [], {}
        for j, g in enumerate(groups):
            extra = set(g) - {"params", *GROUP_KEYS}
            if extra:
                raise ValueError(f"zero.Zero: param_groups[{j}] has unknown keys {sorted(extra)}; zero's AdamW "
                                 f"takes {['params', *GROUP_KEYS]}")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:
                if id(p) not in where:
                    what = f"'{name[id(p)]}', which does not require grad" if id(p) in name else \
                        f"a tensor of shape {tuple(p.shape)} that is not a parameter of the model"
                    raise ValueError(f"zero.Zero: param_groups[{j}] holds {what}; list only the model's "
                                     "trainable parameters")
                if id(p) in seen and seen[id(p)] != j:
                    raise ValueError(f"zero.Zero: parameter '{name[id(p)]}' is in param_groups {seen[id(p)]} and "
                                     f"{j}; give each parameter one group")
                seen[id(p)] = j
            out.append(dict(g, params=list(dict.fromkeys(ps))))
        rest = [u.params[i] for u, i in where.values() if id(u.params[i]) not in seen]
        out += [dict(params=[p for p in rest if p.dim() >= 2]),
                dict(params=[p for p in rest if p.dim() < 2], weight_decay=0.0)]
        out = out[:len(groups)] + [g for g in out[len(groups):] if g["params"]]
        for j, g in enumerate(out):
            for p in g["params"]:
                u, i = where[id(p)]
                u.group[i] = j
        return ZeroOptimizer(self, out, defaults)

    def _check_ranks_agree(self):
        """Ranks that disagree on the config or the model would hang in mismatched collectives:
        compare a fingerprint of both first, and name what differs."""
        if self.world == 1:
            return
        c = self.cfg
        layout = ";".join(f"{u.index}:{n}:{tuple(p.shape)}:{u.group[i]}" for u in self.units
                          for i, (n, p) in enumerate(zip(u.names, u.params)))
        fields_ = dict(stage=c.stage, dtype=list(DTYPES).index(c.dtype), accum_steps=c.accum_steps,
                       offload=int(c.offload), checkpoint=int(c.checkpoint), shard_group=c.shard_group,
                       units=len(self.units), params=sum(u.numel for u in self.units),
                       layout=zlib.crc32(layout.encode()), config=zlib.crc32(repr(asdict(c)).encode()))
        every = _all_gather_object(self.net, list(fields_.values()))
        for r, row in enumerate(every):
            diff = [f"{k}: rank 0 has {a}, rank {r} has {b}" for k, a, b in zip(fields_, every[0], row) if a != b]
            if diff:
                raise ValueError("zero.Zero: ranks disagree (" + "; ".join(diff) + "); launch every rank with "
                                 "the same model and the same zero.Config")

    # -- building: meta tensors made real, frozen parameters and buffers placed, units sharded

    def _materialize(self, mods, init_fn):
        """Parameters and buffers of `mods` on the meta device become real tensors on the engine's device
        (the same Python objects, so tied weights stay tied), initialized by init_fn(module) for each module,
        or by each module's own reset_parameters(). Anything left uninitialized is an error."""
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
        if not made:
            return
        with torch.no_grad():
            for m in dict.fromkeys(m for m, _ in made) if init_fn is None else mods:
                if init_fn is not None:
                    init_fn(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        for m, n in made:
            t = getattr(m, n)
            if t.is_meta or (t.is_floating_point() and t.isnan().any()) or \
                    (t.dtype != torch.bool and not t.is_floating_point() and (t == torch.iinfo(t.dtype).min).all()):
                how = "init_fn did not initialize it" if init_fn else \
                    f"{type(m).__name__} has no reset_parameters() that does"
                raise ValueError(f"zero.Zero: '{self._name(m, n)}' was built on the meta device and {how}; pass "
                                 "init_fn=fn, called as fn(module) on every module of the model, that sets it")

    def _place_frozen(self, mods):
        # frozen parameters and buffers are not model states of the formula: they stay whole on every rank,
        # in the compute dtype, with rank 0's values (each tensor once, however many modules share it)
        cast = lambda t: t.to(self.device, self.dtype if t.is_floating_point() else t.dtype)
        for m in mods:
            for n, p in m.named_parameters(recurse=False):
                if not p.requires_grad and id(p) not in self.placed:
                    p.data = cast(p.data)
                    self.net.broadcast(p.data)
                    self.placed[id(p)] = p
            for n, b in m.named_buffers(recurse=False):
                if id(b) not in self.placed:
                    self.placed[id(b)] = new = cast(b)
                    self.placed[id(new)] = new
                    self.net.broadcast(new)
                m._buffers[n] = self.placed[id(b)]

    def _name(self, module, attr):
        prefix = self.names.get(id(module), "")
        return f"{prefix}.{attr}" if prefix else attr

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

        def state(src=None, dtype=torch.float32):
            t = torch.empty(u.hi - u.lo, dtype=dtype, device=self.host, **pin)
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
        if cfg.stage >= 2 or cfg.offload:   # in the compute dtype, as the paper counts it (host with offload)
            u.grad_shard = state(dtype=self.dtype)
        del full

    def __call__(self, *args, **kwargs):
        # the parameters are in the compute dtype, so float inputs must be too
        cast = functools.partial(_cast_floats, dtype=self.dtype)
        return self.module(*cast(args), **cast(kwargs))

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
        late = [n for n, p in self.frozen if p.requires_grad]
        if late:
            raise RuntimeError(f"zero: {late} were frozen when zero.Zero wrapped the model and require grad now; "
                               "the engine holds no shard or optimizer state for them. Make them trainable before "
                               "zero.Zero(model) and freeze them after (a frozen parameter is left untouched)")
        self.micro = 0
        # from here to the update, every rank runs the same collectives in the same order
        if cfg.stage == 1:                  # stage 1 reduce-scatters once, now
            self.in_flight = []
            for u in self.launch_order:
                self._reduce(u)
            for item in self.in_flight:
                self._finish_reduce(*item)
        self._settle()
        if self.pin:
            torch.cuda.current_stream().synchronize()   # the gradient shards' copies to the host landed
        if self.net.replicas > 1:
            self._sum_replicas()
        # one all-reduce carries the step's agreement, in fp64 (exact for these integers): the squared norm
        # of the unscaled gradient, counted once per shard (inf or nan: overflow); a fingerprint of each
        # rank's collectives f, as f and f^2 (sum^2 = N * sum of squares only if all are equal); and which
        # parameters got a gradient on any rank
        stats = torch.zeros(3 + sum(len(u.params) for u in self.units), dtype=torch.float64, device=self.device)
        for u in self.units:
            stats[0] += torch.linalg.vector_norm(u.grad_shard, dtype=torch.float32).to(self.device) ** 2
        # a copy held by several ranks (stage 0's whole gradient, hybrid replicas) counts once; the others
        # add 0 * their sum, which is nan if theirs is not finite, so an overflow anywhere skips everywhere
        stats[0] *= float((self.net.replica if cfg.stage else self.rank) == 0)
        f = zlib.crc32(repr(self.trace).encode()) % (1 << 21)
        stats[1:3] = torch.tensor([f, f * f], dtype=torch.float64)
        stats[3:] = torch.tensor([i in u.got for u in self.units for i in range(len(u.params))], dtype=torch.float64)
        self.net.all_reduce(stats, kind="scalar")
        sq, fsum, fsq, *got = stats.tolist()
        for u in self.units:
            u.written, u.got = set(), set()   # the next window starts a new accumulation
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
        plans, k = [], 0
        for u in self.units:
            used, k = got[k:k + len(u.params)], k + len(u.params)
            u.steps = [s + 1 if used[i] else s for i, s in enumerate(u.steps)]
            plans.append(self._runs(u, used, hyper))
        # with offload the update happens behind the next forward; without, right here
        if cfg.offload:
            self._start_updates(mult, plans)
        else:
            for u, runs in zip(self.units, plans):
                self._update(u, mult, self._param_slice(u), runs)
            # stages 1-2 keep whole parameters: every rank's updated slice goes to every rank, in place
            if cfg.stage in (1, 2):
                works = [self.net.all_gather(u.flat, u.flat[u.lo:u.hi], sync=False) for u in self.units]
                for w in works:
                    self.net.wait(w)
        self.ledger_reset()
        return True

    def _sum_replicas(self):
        # hybrid sharding: the shard group's reduced shard, summed with the same shard of every other group,
        # once per step (a host shard visits the device for it: NCCL reduces device memory)
        works = []
        for u in self.units:
            t = u.grad_shard.to(self.device)
            works.append((u, t, self.net.all_reduce(t, "replica", kind="replica_all_reduce", sync=False)))
        for u, t, work in works:
            self.net.wait(work)
            if t is not u.grad_shard:
                u.grad_shard.copy_(t)
                for kind in ("h2d", "d2h"):
                    self.net.count(kind, t.numel(), t.element_size())

    def _runs(self, u, used, hyper):
        """AdamW calls for u's owned range: one per run of adjacent parameters with equal hyperparameters
        and step count (a shard cuts across parameters), skipping parameters without a gradient."""
        runs = []
        for a, b, i in u.segments:
            if used[i]:
                key = (u.group[i], u.steps[i])
                if runs and runs[-1][1] == a and runs[-1][2] == key:
                    runs[-1][1] = b
                else:
                    runs.append([a, b, key])
        return [(a, b, *hyper[g], step) for a, b, (g, step) in runs]

    def _update(self, u, mult, out, runs):
        """AdamW on u's owned range; `out` receives the updated weights in the compute dtype."""
        for a, b, lr, b1, b2, eps, wd, step in runs:
            adamw_step(u.master[a:b], u.grad_shard[a:b], u.exp_avg[a:b], u.exp_avg_sq[a:b], step,
                       lr, b1, b2, eps, wd, grad_mult=mult, out=None if out is None else out[a:b])

    def _diverged(self):
        """The ranks' collectives differed in this step: say which, change nothing, and stop."""
        traces = _all_gather_object(self.net, (self.trace, self.ran))
        (t0, _), diff = traces[0], "?"
        for (r, (t, _)), kind in itertools.product(enumerate(traces), t0):
            a, b = t0[kind], t[kind]
            if a != b:
                j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                name = lambda s: self._unit_name(s[j]) if j < len(s) else "nothing"
                diff = f"{kind} #{j}: rank 0's was of {name(a)}, rank {r}'s of {name(b)}"
                break
        ran = "; ".join(f"rank {r}: {[self._unit_name(i) for i in x]}" for r, (_, x) in enumerate(traces))
        self.ledger_reset()
        raise RuntimeError(f"zero: the ranks ran different collectives in this step ({diff}); nothing was updated. "
                           f"Units each rank's forwards ran: {ran}. At stage 3 a unit called a different number of "
                           "times on different ranks does this: call every unit equally often, or use stage 2")

    def _unit_name(self, i):
        return self.names.get(id(self.units[i].module), "") or "root"

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
        # each process group's own sequence: gathers and reductions may interleave differently on each rank
        self.net.ledger, self.trace, self.ran = {}, dict(gather=[], reduce=[]), []

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

    # -- the whole model in and out, one unit at a time

    def full_state_dict(self, rank0_only=False):
        """The whole model as a plain fp32 state_dict of CPU tensors (a collective: every rank calls it).
        One unit's master weights are gathered at a time and moved to the CPU at once, so the device never
        holds more than a unit; rank0_only=True: only rank 0 keeps the result, the others get {}."""
        self._settle()
        keep = not rank0_only or self.rank == 0
        values = {}
        for u in self.units:
            full = self._gather_master(u)
            for p, o in zip(u.params, u.offsets) if keep else ():
                values[id(p)] = full[o:o + p.numel()].view(p.shape).to("cpu", copy=True)
            del full
        # keys and order from the model's own state_dict: tied names, buffers and frozen params included
        sd = {}
        for k, t in _model_state(self.module).items() if keep else ():
            v = values.get(id(t))
            sd[k] = v if v is not None else t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype,
                                                           copy=True)
        return sd

    def _gather_master(self, u):
        # fp32 master weights, not the 16-bit parameters: the state_dict keeps full precision
        if self.cfg.stage == 0:
            return u.master.to(self.device, torch.float32)
        full = torch.empty(u.padded, dtype=torch.float32, device=self.device)
        # its own ledger kind: a state_dict is not training traffic
        self.net.all_gather(full, u.master.to(self.device, torch.float32), kind="state_dict")
        return full

    def load_state_dict(self, state_dict, strict=True):
        """Weights from a plain state_dict (model.state_dict() names; tied aliases fine) into every stage's
        copies: master weights, 16-bit parameters, buffers and frozen parameters. Each rank reads only the
        slices it owns (a memory-mapped file reads only those pages); Adam's moments start fresh. Missing,
        unexpected and wrongly shaped entries are one error; with strict=False they are skipped and returned."""
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
        _restore(self, lambda: (read, extra), "load the state_dict")
        for u in self.units:
            u.steps = [0] * len(u.params)
        return LoadResult(missing, unexpected, shapes)

    def _refuse_state_dict(self, *args, **kwargs):
        raise RuntimeError("zero: model.state_dict() after zero.Zero(model) would not hold the trained weights "
                           "(the fp32 master weights are sharded across ranks; at stage 3 the parameters too). Use "
                           "engine.full_state_dict() (every rank calls it; rank0_only=True keeps it on rank 0 only) "
                           "or zero.save(engine, dir)")




LoadResult = collections.namedtuple("LoadResult", "missing_keys unexpected_keys wrong_shapes")


class _OutOfPlaceUse(torch.overrides.TorchFunctionMode):
    """Stage 3, first forward: a parameter that a torch call reads outside its unit's forward (a parent
    reading a block's weight, one block reading another's) would be read after its memory was freed. Its
    unit is gathered on the spot and kept whole from then on, as the root is."""

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
                    e._gather(u)
        return func(*args, **(kwargs or {}))


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
# path/step_00001000/       one checkpoint: meta.json (layout, config, step, scaler, param groups,
#                           checksums), written after every rank's rank_00000.pt ... (its RNG; and for
#                           one copy of the shards, the fp32 master and Adam moments of each unit, as
#                           slices of the unpadded layout)
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
    """Every trainable parameter: its unit, offset, shape and AdamW step; every other state_dict entry by name."""
    # all names of each tensor, so a tied weight comes back under each of its state_dict keys
    aliases = _aliases(engine.module)
    units = [dict(numel=u.numel, params=[dict(name=n, shape=list(p.shape), offset=o, aliases=aliases[id(p)], step=s)
                                         for n, p, o, s in zip(u.names, u.params, u.offsets, u.steps)])
             for u in engine.units]
    return units, list(_model_state(engine.module).keys())


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
    # one copy of the shards: file r holds slice [r*S, (r+1)*S) of every unit's unpadded layout, S the
    # shard size, whatever the stage (stage 0 owns everything but saves only its slice), so that any run
    # finds element i of a unit in file i // S. With hybrid sharding the first shard group writes them.
    shards, n_files = [], engine.units[0].padded // (engine.units[0].hi - engine.units[0].lo) \
        if engine.cfg.stage else world
    r = rank if engine.cfg.stage == 0 else engine.net.shard_rank
    for u in engine.units if engine.net.replica == 0 else ():
        size = u.padded // n_files
        a, b = r * size, min((r + 1) * size, u.numel)
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
        blob["extra"] = {k: v.detach().cpu() for k, v in _model_state(engine.module).items() if id(v) not in trained}
    fname = os.path.join(d, f"rank_{rank:05d}.pt")
    _write_atomic(fname, lambda f: torch.save(blob, f))
    # meta.json records every file's checksum, so it can only be written once every rank has written
    sums = _all_gather_object(net, _sha256(fname))
    if rank == 0:
        units, keys = _layout(engine)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
        meta = dict(format=FORMAT, world_size=world, shards=n_files, stage=engine.cfg.stage, dtype=engine.cfg.dtype,
                    config=asdict(engine.cfg), step=engine.step_count, scaler=engine.scaler.state_dict(),
                    param_groups=groups, units=units, state_dict_keys=keys,
                    sha256={f"rank_{r:05d}.pt": s for r, s in enumerate(sums)})
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
    """name -> (unit, offset, numel, shard size at save time, shape) in the saved layout."""
    # the shard size follows from the unit's size and the number of shard files, as in Unit
    out = {}
    for i, u in enumerate(meta["units"]):
        size = -(-u["numel"] // meta.get("shards", meta["world_size"]))
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
    got = {}

    def prepare():
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
        for r in range(meta["world_size"]):
            files(r)                        # every file is checked, also those this rank needs no slice of
        got.update(meta=meta, rng=files(engine.rank) if meta["world_size"] == engine.world else None,
                   steps={p["name"]: p.get("step", meta["step"]) for u in meta["units"] for p in u["params"]})
        # by name, not by unit: a parameter may sit in another unit, offset or shard than when saved
        read = lambda name, p, start, n, key: _read_range(files, meta, saved[name], start, n, key)
        return read, files(0)["extra"]      # buffers and frozen parameters
    _restore(engine, prepare, f"load {path}")
    meta = got["meta"]
    for u in engine.units:
        u.steps = [got["steps"][n] for n in u.names]
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
    return meta


def _restore(engine, prepare, what):
    """Put new weights (and Adam moments, where `read` has them) into every copy the engine keeps.
    prepare() -> (read(name, param, start, n, key) -> fp32 elements or None, {state_dict key: tensor} of
    buffers and frozen parameters). Phase 1 reads this rank's owned slices into fresh tensors; phase 2
    has every rank learn whether every rank succeeded; only then, phase 3 changes the engine."""
    try:
        read, extra = prepare()
        new = []
        for u in engine.units:
            # a slice `read` does not have: the master keeps its value, a moment starts at zero
            st = {"master": u.master.to("cpu", torch.float32, copy=True)}
            st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(st["master"]), torch.zeros_like(st["master"])
            for n, p, o in zip(u.names, u.params, u.offsets):
                a, b = max(o, u.lo), min(o + p.numel(), u.hi)
                for k in st if a < b else ():
                    piece = read(n, p, a - o, b - a, k)
                    if piece is not None:
                        st[k][a - u.lo:b - u.lo] = piece
            new.append(st)
        error = None
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        error = e
    # phase 2: any failure is raised on every rank, instead of a hang in the collectives below
    failed = _all_gather_object(engine.net, repr(error) if error else None)
    if error is not None:
        raise error
    if any(failed):
        raise RuntimeError(f"zero: another rank could not {what}: {[f for f in failed if f][0]}")
    # phase 3: the shard state in place, then the 16-bit parameters rebuilt from it, as step() does
    for u, st in zip(engine.units, new):
        for k, v in st.items():
            getattr(u, k).copy_(v)
        out = engine._param_slice(u)
        if out is not None:
            out.copy_(u.master)
        if engine.cfg.stage in (1, 2):
            engine.net.all_gather(u.flat, u.flat[u.lo:u.hi], kind="load")
    with torch.no_grad():
        for k, v in _model_state(engine.module).items():
            if k in extra:
                v.copy_(extra[k])


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
    # small Python objects between the engine's ranks (checksums, error messages); one rank needs no group
    if net.world == 1:
        return [obj]
    out = [None] * net.world
    dist.all_gather_object(out, obj, group=net.groups["world"][0])
    return out


def _broadcast_object(net, obj):
    if net.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=net.ranks[0], group=net.groups["world"][0])
    return box[0]


# -----------------------------------------------------------------------------
# 8. Memory estimator and the command line
#
# The paper's formula, in the same kinds as Zero.memory(): a test holds the two equal on a real model,
# and `python zero.py estimate` prints the paper's 7.5B-parameter, 64-GPU example.

def estimate_memory(num_params, world_size, stage, dtype="fp16", offload=False, shard_group=0):
    """The ZeRO paper's model-state bytes per rank: params and grads in the compute dtype,
    fp32 master (none in fp32 compute) and two fp32 Adam moments, each sharded by the stage
    across the shard group (all ranks, or shard_group of them with hybrid sharding)."""
    if dtype not in DTYPES:
        raise ValueError(f"estimate_memory: dtype={dtype!r}; use one of {list(DTYPES)}")
    psi, n = num_params, shard_group if stage and shard_group else world_size
    # bytes per parameter: p for the 16-bit (or fp32) params and grads, 4 for the master, 4+4 for Adam
    p = DTYPES[dtype].itemsize
    master = 0 if dtype == "fp32" and not offload else 4
    # each stage divides one more kind by N: 1 the optimizer states, 2 the gradients, 3 the parameters
    dev = dict(params=p * psi / (n if stage >= 3 else 1), grads=p * psi / (n if stage >= 2 else 1),
               master=master * psi / (n if stage >= 1 else 1), optim=8 * psi / (n if stage >= 1 else 1))
    host = dict(params=0, grads=0, master=0, optim=0)
    # offload moves the gradient shard (in the compute dtype), master and moments to the host; stage 1
    # still keeps its whole gradient on the device
    if offload:
        host.update(grads=p * psi / n, master=dev["master"], optim=dev["optim"])
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
    e.add_argument("--shard-group", type=int, default=0, help="hybrid sharding: ranks per shard group (a node)")
    c = sub.add_parser("consolidate", help="a sharded checkpoint to one plain fp32 state_dict file")
    c.add_argument("ckpt")
    c.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "estimate":
        # the per-rank table of the ZeRO paper's Figure 1 (one row per stage)
        group = f", shard groups of {a.shard_group}" if a.shard_group else ""
        print(f"model states per rank, {a.params:.4g} params, {a.world_size} ranks{group}, {a.dtype} + fp32 Adam "
              "(GB = 1e9 B)")
        print(f"{'stage':>5} {'params':>9} {'grads':>9} {'master':>9} {'optim':>9} {'total':>9}")
        for s in range(4):
            d = estimate_memory(a.params, a.world_size, s, a.dtype, shard_group=a.shard_group)["device"]
            print(f"{s:>5} " + " ".join(f"{d[k] / 1e9:>9.4g}" for k in ("params", "grads", "master", "optim"))
                  + f" {sum(d.values()) / 1e9:>9.1f}")
    elif a.cmd == "consolidate":
        # no processes, no GPU: the rank files are read straight from disk
        torch.save(consolidate(a.ckpt), a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
