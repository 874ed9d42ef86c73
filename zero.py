"""
zero.py: ZeRO data parallelism for PyTorch in one file.

ZeRO stages 0-3 (Rajbhandari et al., 2020) over torch.distributed, one code path for CUDA/NCCL and CPU/gloo:
fp16/bf16 compute on fp32 master weights, loss scaling, activation recompute, ZeRO-Offload's CPU Adam (Ren et
al., 2021); then hybrid sharding, frozen parameters (LoRA), meta-device models, torch's optimizers and
schedulers, Muon and other matrix rules, sharded checkpoints, a ledger of memory and communication.

    rank, world_size, device = zero.init_distributed()
    model = zero.Zero(model, zero.Config(stage=3, dtype="bf16"), optimizer=opt)   # opt: your torch AdamW
    loss = model(x, y); model.backward(loss); opt.step()   # the engine is called, and read, like the model

    torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3
    python zero.py estimate --params 7.5e9 --world-size 64 [--shard-group 8] [--frozen-params 3e10]
    python zero.py consolidate CKPT_DIR OUT.pt

Part I, the core, is what a stage 1-3 step with fp16, recompute and offload runs, in the order data flows:

  1 Config, Plan       Plan.of(cfg) says what the stage shards, the only place a stage number is read:
                       shards_optim (1-3), shards_grads (2-3), shards_params (3), regathers (1-2),
                       gathers_lazily (3, offload).
  2 Comm               the process groups; all-gather, reduce-scatter, all-reduce, launched asynchronously;
                       waits bounded by timeout_s; agree(): one fp64 all-reduce the ranks agree through.
  3 LossScaler         fp16's dynamic loss scale.
  4 RULES              the update-rule table; AdamW's entry steps a Flat's owned slice (torch's fused kernel).
  5 Flat, Unit         Zero(model, cfg) makes each block (an element of the outermost nn.ModuleList) and the
                       root (the rest) a Unit, its parameters views into Flat buffers (one per rule, one of
                       frozen ones), each rank owning a slice. Unit.unshard and Unit.free gather and release
                       it (stage 3); Unit.reduce all-reduces (stage 0) or reduce-scatters (1-3) its gradient.
  6 Table, Schedule    one Table per forward and one for the backward, made once from the order all ranks
                       agreed on: at each place the gathers, frees and reductions every rank runs whatever it
                       ran; the forward and backward hooks only move a cursor. Config(prefetch=k): k ahead.
  7 Zero               builds the units and hooks; backward(); step(): _agree (one all-reduce: the norm, an
                       overflow, every rank's collectives' fingerprint), each rule on the owned slices, at
                       stages 1-2 an all-gather of them (stage 3 gathers at the next forward).
  8 HostWorker, Copies offload: the update on a host thread behind the next forward, copies on CUDA streams.

Part II, the extensions, a section each, reached from Part I at one call (the seam, in brackets):

  9  rank-dependent orders: _merge [Schedule.learn]; a parameter read outside its block [Unit.mark]
  10 hybrid sharding: Replica, the sums across shard groups [Unit.finish_reduce, Zero._agree]
  11 update rules beyond AdamW: Muon, MatrixStep [Zero.__init__: _matrix_steps; Zero._step]
  12 parameter groups and torch's face: _param_groups [Zero.__init__], ZeroOptimizer [Zero.step],
     clip_grad_norm_, torch.compile and an optimizer pre-hook patched at import [torch's own calls]
  13 the meta build and the state dicts: _materialize [Zero.__init__, for a meta tensor];
     full_state_dict, load_state_dict [the engine's methods]
  14 call checks through the store: Calls [Comm.call, Comm.until], _diverged [Zero._agree]; the exit
  15 the ledgers: Ledger [Comm._launch], memory(), pinned_memory(), num_params() [the engine's methods]
  16 checkpoints: save, load, read_extra, consolidate [the script's calls]
  17 the C AdamW kernel [AdamW's step on the CPU, where it takes the tensors]
  18 launching (init_distributed), the memory estimator and the command line

A stage-3 micro-batch on a model of blocks A, B and the root R, at prefetch=1: the tables say [A, B] forward
and [B, A] backward. enter() gathers R (kept: used before and after the blocks) and the table's first point
launches A's and B's gathers; pre_forward(A) moves the cursor to A's place and waits for A; pre_forward(B) to
B's: A freed there (Unit.free), B awaited; exit() to the end: B freed. The backward likewise: B's and A's
gathers leave at its start, B's reduce-scatter once B's backward is done (_PostBackward), then B is freed;
A's likewise; end_backward() launches R's last and frees it. A rank that skips B gathers and frees it all
the same, where the table says: every rank launches the same collectives in the same order.
"""

import argparse, atexit, collections, contextlib, ctypes, dataclasses, datetime  # noqa: E401
import functools, hashlib, heapq, itertools, json, math, mmap, os, platform, queue, shutil  # noqa: E401
import subprocess, tempfile, threading, time, warnings, weakref, zlib  # noqa: E401
from concurrent.futures import Future, ThreadPoolExecutor

import torch, torch.distributed as dist, torch.nn as nn  # noqa: E401
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint as recompute


# =============================================================================
# Part I: the core. What a stage 1-3 step with fp16, recompute and offload runs, in the order data flows
# =============================================================================


# -----------------------------------------------------------------------------
# 1. Config, and the Plan made from it

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# torch's names and dtypes are taken too (nanoGPT's dtype="bfloat16", torch.float16)
_DTYPE_NAMES = {**{k: k for k in DTYPES}, "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                **{v: k for k, v in DTYPES.items()}}


def _dtype_name(x):
    # zero's name of a dtype given by its name, torch's or a torch.dtype; None for anything else
    if isinstance(x, (str, torch.dtype)):
        return _DTYPE_NAMES.get(x)
    return None


@dataclasses.dataclass
class Config:
    stage: int = 2                  # 0 plain DP | 1 shard optimizer state | 2 + grads | 3 + params
    dtype: str = "bf16"             # compute: "fp32" | "bf16" | "fp16"
    reduce_dtype: str = ""          # gradient reductions and sums: "" = dtype | "fp32"
    frozen_dtype: str = ""          # frozen parameters: "" = dtype | "fp32" (cast when gathered)
    update: str = "adamw"           # a rule of RULES: "adamw" | "muon" (a matrix rule: AdamW on the rest)
    lr: float = 3e-4                # the update's (a scheduler on engine.optimizer changes it)
    adamw_lr: float = 3e-4          # update=a matrix rule ("muon"): the lr of the AdamW groups
    betas: tuple = (0.9, 0.95)      # AdamW's
    eps: float = 1e-8               # AdamW's
    weight_decay: float = 0.1       # decoupled; with no param groups, on parameters of >= 2 dims
    grad_clip: float = 1.0          # the global gradient norm's limit; 0 = none
    accum_steps: int = 1            # micro-batches (backward calls) per optimizer step
    checkpoint: object = False      # recompute activations: False | True (every unit) | k (k-th)
    offload: bool = False           # ZeRO-Offload (stages 1-3): master, moments, grads on the host
    shard_group: int = 0            # hybrid: shard in groups of this many ranks; 0 = all ranks
    prefetch: int = 1               # units all-gathered ahead of the one computing (True: 1, False: 0)
    loss_scale: float = 2.0 ** 16   # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000   # fp16: clean steps before the scale doubles
    hysteresis: int = 2             # fp16: overflows tolerated before it starts halving
    min_loss_scale: float = 1.0     # fp16: its floor
    timeout_s: float = 300.0        # every process group the engine makes ends a hang after this
    check_calls: bool = False       # compare calls across ranks (or TORCH_DISTRIBUTED_DEBUG=DETAIL)

    def validate(self):
        """A ValueError naming the fix for the first bad field; then dtypes by zero's names."""
        dtype = _dtype_name(self.dtype)
        stage = self.stage
        k = self.checkpoint
        g = self.shard_group
        extra = {f: getattr(self, f) or "" for f in ("reduce_dtype", "frozen_dtype")}
        checks = (  # (bad, the fix)
            (stage not in (0, 1, 2, 3), f"stage={stage!r}: use 0 (plain DP), 1, 2 or 3"),
            (dtype is None, f"dtype={self.dtype!r}: use one of {list(DTYPES)}, or torch's names"),
            (any(v and _dtype_name(v) not in ("fp32", dtype) for v in extra.values()),
             f'{extra}: use "" or "fp32"'),
            (not (isinstance(self.accum_steps, int) and self.accum_steps >= 1),
             f"accum_steps={self.accum_steps!r}: use an integer >= 1"),
            (not isinstance(k, bool) and not (isinstance(k, int) and k >= 1),
             f"checkpoint={k!r}: use False, True, or k >= 1 (every k-th unit)"),
            (self.offload and stage == 0, "offload=True needs stage 1, 2 or 3"),
            (self.update not in RULES, f"update={self.update!r}: use {' or '.join(map(repr, RULES))}"),
            (not (min(self.lr, self.adamw_lr, self.weight_decay, self.grad_clip) >= 0 and self.eps > 0),
             "lr, adamw_lr, weight_decay and grad_clip must be >= 0, eps > 0"),
            (len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas),
             f"betas={self.betas!r}: use two numbers in [0, 1)"),
            (self.hysteresis < 1 or self.loss_scale_window < 1 or self.min_loss_scale <= 0,
             "hysteresis and loss_scale_window must be >= 1, min_loss_scale > 0"),
            (not (isinstance(g, int) and g >= 0) or (stage == 0 and g),
             f"shard_group={g!r} at stage {stage}: use 0 (all ranks), or k ranks at stages 1-3"),
            (not (isinstance(self.prefetch, int) and self.prefetch >= 0),
             f"prefetch={self.prefetch!r}: use an integer >= 0, the units gathered ahead "
             "(True: 1, False: 0)"),
            (not self.timeout_s > 0, f"timeout_s={self.timeout_s!r}: use seconds > 0"))
        for bad, what in checks:
            if bad:
                raise ValueError(f"zero.Config: {what}")
        self.dtype = dtype
        self.prefetch = int(self.prefetch)  # True and False are 1 and 0
        for f, v in extra.items():          # "": the compute dtype, given by any of its names
            setattr(self, f, "")
            if v and _dtype_name(v) != dtype:
                setattr(self, f, "fp32")
        return self


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the stages differ in, one name each, with dtypes and devices: made once from the Config
    and the process group, the only place a stage number is read. Model states per rank (Ψ
    parameters, N ranks in a shard group, 16-bit compute, K = 12 bytes of fp32 master and Adam):

      stage  parameters          gradients                        master + Adam   bytes per rank
      0      whole               whole, all-reduced in backward   whole           (2 + 2 + K) Ψ
      1      whole               whole, reduce-scattered          sharded         4Ψ + KΨ/N
      2      whole               reduce-scattered, then freed     sharded         2Ψ + (2 + K)Ψ/N
      3      gathered per unit   reduce-scattered, then freed     sharded         (2 + 2 + K)Ψ/N

    A unit's gradient is reduced in every micro-batch's backward where the whole one is freed after
    it (shards_grads: 2-3), else in the last one's (0-1). Frozen parameters (no gradient, no
    optimizer state) are whole at stages 0-2, sharded at stage 3."""
    shards_optim: bool              # fp32 master and optimizer state: this rank's shard (stages 1-3)
    shards_grads: bool              # grads reduce-scattered in each backward, whole freed (2-3)
    shards_params: bool             # parameters gathered per unit for each use, freed after (3)
    regathers: bool                 # whole parameters: the updated slices all-gathered (1-2)
    gathers_lazily: bool            # forwards gather (stage 3; offload: the slices the host wrote)
    offload: bool                   # master, moments and the gradient shard on the host
    pin: bool                       # offload on CUDA: grad shard and a 16-bit staging copy pinned
    master_is_param: bool           # fp32 compute, no offload: the owned parameters are the master
    frozen_fp32: bool               # frozen parameters held in fp32, cast when gathered
    prefetch: int                   # units whose all-gathers run ahead of the one computing
    accum: int                      # micro-batches per step
    dtype: torch.dtype              # compute
    grad_dtype: torch.dtype         # gradient reductions and sums
    device: torch.device            # where the model computes
    host: torch.device              # where master, moments and the gradient shard live
    replicas: int                   # hybrid: copies of the model states (shard groups)
    shards: int                     # the buffers are padded to, and owned in, this many slices ...
    shard_rank: int                 # ... of which this rank owns this one (stage 0: all of them)
    divide: tuple                   # the mean over ranks x micro-batches: divide before, after sum

    @staticmethod
    def of(cfg, net):
        stage = cfg.stage
        dtype = DTYPES[cfg.dtype]
        grad_dtype = DTYPES[cfg.reduce_dtype or cfg.dtype]
        host = torch.device("cpu") if cfg.offload else net.device
        return Plan(shards_optim=stage >= 1, shards_grads=stage >= 2, shards_params=stage == 3,
                    regathers=stage in (1, 2), gathers_lazily=stage == 3 or cfg.offload,
                    offload=cfg.offload, pin=cfg.offload and net.device.type == "cuda",
                    master_is_param=dtype == torch.float32 and not cfg.offload,
                    frozen_fp32=bool(cfg.frozen_dtype), prefetch=cfg.prefetch,
                    accum=cfg.accum_steps, dtype=dtype, grad_dtype=grad_dtype, device=net.device,
                    host=host, replicas=net.replicas, shards=net.shards, shard_rank=net.shard_rank,
                    divide=divide_factors(net.world * cfg.accum_steps))


def divide_factors(n):
    """The mean over n gradients as a divide by `pre` before the sum, by n / pre after; pre, the
    largest power of two <= sqrt(n) (as FSDP), costs fp16 log2(pre) bits of range, not log2(n)."""
    pre = 1 << (math.isqrt(n).bit_length() - 1)
    return pre, n / pre


# -----------------------------------------------------------------------------
# 2. Distributed setup and collectives
#
# All-reduce (stage 0's gradients), reduce-scatter (a sum over ranks, each keeping its slice) and
# all-gather (each rank's slice to all) carry ZeRO, one call per flat buffer; on one rank, copies.

# torch 2.13's names (>= 2.4 has the old ones); looked up at each call, so that a test can wrap them
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce
_broadcast = dist.broadcast
_all_to_all = dist.all_to_all_single


def _reduce_scatter(out, inp, group=None, async_op=True):
    # out is inp's own slice. gloo's (CPU tensors) runs inside its wait, which ignores the timeout,
    # at a third of its all-reduce's speed (measured): there, an all-reduce in place (out: the sum)
    if inp.is_cpu:
        return dist.all_reduce(inp, group=group, async_op=async_op)
    return _torch_reduce_scatter(out, inp, group=group, async_op=async_op)

_GROUPS = {}    # (ranks, purpose, world, timeout) -> process group, made once per process, shared
_SERIALS = {}   # ranks -> a counter of the engines made on them, the same on each
STREAM_WAITS = False    # True: stream-ordered waits on gloo too, as NCCL's (the suite's NCCL harness)
EVERY_RANK = (
    "every rank calls forward (stage 3 or offload), backward, step, full_state_dict, "
    "load_state_dict, save and load together (HF generate() at stage 3: synced_gpus=True)")


def fingerprint(key):
    """Any value's repr as 4 integers of 12 bits: summed over N ranks with their squares in fp64,
    all ranks agree iff N * sum(c^2) == sum(c)^2 for each, exactly while N < 2^29."""
    h = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=6).digest(), "little")
    return [(h >> (12 * i)) & 0xFFF for i in range(4)]


def _device_of(group):
    # NCCL ranks compute on their GPU, gloo ranks on the CPU (the backend config of a group made
    # without a backend says which the GPU's tensors take)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if group is not None and "nccl" not in str(dist.get_backend_config(group)) + str(dist.get_backend(group)):
        return torch.device("cpu")
    gpu = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())) % torch.cuda.device_count()
    if torch.cuda.current_device() != gpu:
        raise RuntimeError(f"zero: the current CUDA device is not LOCAL_RANK's: call "
                           f"torch.cuda.set_device({gpu}) first (zero.init_distributed does)")
    return torch.device("cuda", gpu)


class Comm:
    """The engine's process groups, made with timeout_s: `shard` (gathers and reductions on one
    communicator, as FSDP2: one order, trivially), `replica` (hybrid: the reduced shard summed
    across shard groups), `world` (the step's all-reduce, the setup, objects; the shard group
    without hybrid). Launches are asynchronous, counted in the ledger (section 15) as a ring sends
    them and traced for the step's agreement. The ranks agree through agree() (one all-reduce, an
    explanation only where they differ); a wait that runs long compares the ranks' calls (section 14)."""

    def __init__(self, cfg, group=None):
        self.timeout = datetime.timedelta(seconds=cfg.timeout_s)   # of each group made, each wait
        self.trace = []                     # (kind, unit) of each launch and call since last step
        self.held = 0                       # bytes of parameter buffers allocated now ...
        self.peak = 0                       # ... and at most
        self.ranks = [0]                    # the group's ranks, global numbers
        self.rank = 0                       # this rank's place in them
        parent = None                       # the group (None: the default one), once initialized
        if dist.is_available() and dist.is_initialized():
            parent = group or dist.group.WORLD
            self.ranks = dist.get_process_group_ranks(parent)
            self.rank = self.ranks.index(dist.get_rank())
        self.world = len(self.ranks)        # how many ranks
        self.device = _device_of(parent)    # where the collectives' tensors live
        # NCCL's untimed wait orders streams, the CPU runs ahead; gloo's blocks the CPU, timed
        self.stream_waits = STREAM_WAITS or self.device.type == "cuda"
        k = cfg.shard_group or self.world   # (stage 0: 0, all ranks)
        if self.world % k:
            raise ValueError(f"zero.Config: shard_group={k} does not divide the {self.world} "
                             "ranks; use a divisor")
        self.shards = k                     # k consecutive ranks, one copy of the model states
        self.replicas = self.world // k     # replica groups: one rank of each shard group
        self.replica = self.rank // k       # this rank's shard group ...
        self.shard_rank = self.rank % k     # ... and its place in it
        self.groups = self._make_groups(group, cfg.timeout_s)   # purpose -> (process group, size)
        self.ledger = Ledger()              # what each kind of collective moved (section 15)
        self.calls = Calls(self, cfg)       # this rank's calls, compared with the others' (section 14)
        # NCCL makes a communicator at its first call: here, not at peak memory (each once)
        for pg in {id(g): g for g, n in self.groups.values() if n > 1}.values():
            self.wait(_all_reduce(torch.zeros(1, device=self.device), group=pg, async_op=True))

    def _make_groups(self, group, timeout_s):
        # NCCL splits sub-groups from a device-bound default group, which all its ranks must join
        k = self.shards
        hybrid = k < self.world
        bound = group is not None and getattr(dist.group.WORLD, "bound_device_id", None) is not None
        if bound and hybrid:
            raise ValueError("zero.Zero: hybrid sharding on group= under init_process_group("
                             "device_id=...): init without device_id, or pass no group")
        sets = {"shard": [self.ranks[i:i + k] for i in range(0, self.world, k)]}
        if hybrid:                          # section 10
            sets.update(replica=[self.ranks[j::k] for j in range(k)], world=[self.ranks])
        groups = {}
        for purpose, members in sets.items():
            for s in members:               # new_group is collective: all ranks make each, in order
                key = (tuple(s), purpose, id(dist.group.WORLD), timeout_s)
                if len(s) > 1 and key not in _GROUPS and not bound:
                    _GROUPS[key] = dist.new_group(list(s), timeout=self.timeout,
                                                  use_local_synchronization=group is not None)
                if self.ranks[self.rank] in s:
                    groups[purpose] = (_GROUPS.get(key), len(s))
        if bound and self.world > 1:        # (no hybrid) the user's group itself
            groups["shard"] = (group, self.world)
        groups.setdefault("world", groups["shard"])
        return groups

    def drop_groups(self):                  # at exit: the process groups are destroyed next
        self.groups = {}

    def new_step(self):
        # what the step moved, by kind (comm()); the ledger and the trace start again
        self.trace = []
        return self.ledger.new_step()

    def count_held(self, nbytes):           # parameter buffer bytes allocated (> 0) or freed (< 0)
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def call(self, what, check=False):
        # a collective-taking call (forward, backward, step, save ...): traced for the step's
        # agreement, counted apart in the ledger where it is a rare one, checked where asked
        self.trace.append((what, None))
        self.ledger.call(what)
        self.calls.call(what, check)

    def wait(self, work, cpu=False):
        """The collective done: on NCCL the stream waits and the CPU goes on, unless `cpu` (its
        values are read next); elsewhere the CPU waits, in slices that compare the ranks' calls (see
        until). A failure or a dead or stalled rank (ended by the group's timeout) raises here."""
        error = None                        # given (all_gather_object's), or raised by the wait
        why = None                          # "": the timeout; else how the ranks' calls differ
        if isinstance(work, Exception):
            error = work
        elif work is not None:
            try:
                if self.stream_waits:
                    work.wait()
                    if cpu and self.device.type == "cuda":
                        event = torch.cuda.Event()  # polled, not a sync that could hang unbounded
                        event.record()
                        why = self.until(_Poll(event.query, 1e-4, 1e-4))
                else:
                    why = self.until(functools.partial(_work_done, work))
            except RuntimeError as e:       # gloo's: a timeout, sizes that differ, a dead peer
                error = e
        if why:
            raise RuntimeError(f"zero: a collective waits for ranks that made other calls ({why}); "
                               f"{EVERY_RANK}")
        if error is not None or why is not None:
            raise RuntimeError(f"zero: a collective failed or did not finish in {self.timeout}: "
                               f"another rank died, stalled or made other calls "
                               f"({self.calls.report()}); if slow, raise Config.timeout_s; "
                               f"{EVERY_RANK}") from error

    def until(self, done):
        """Wait for done(seconds) -> finished within them, up to timeout_s, in slices: after each the
        ranks' calls are compared (Calls.compare), so that ranks whose n-th calls differ (one made a
        call alone) learn it in seconds. Returns None when done, "" at the timeout, else how the
        calls differ. A wait shorter than a slice touches no store."""
        end = time.monotonic() + self.timeout.total_seconds()
        while not done(min(self.calls.slice(), max(end - time.monotonic(), 0.01))):
            if time.monotonic() >= end:
                return ""
            differ = self.calls.compare()
            if differ is not None:
                return differ
        return None

    def _launch(self, collective, purpose, kind, t, ring, tag, sync, *tensors):
        pg, n = self.groups.get(purpose, (None, 1))
        self.ledger.count(kind, t.numel() * ring * (n - 1) // n, t.element_size())   # exact: padded to n
        self.trace.append((kind, tag))
        if n == 1:                          # one rank: its slice is the whole tensor
            if len(tensors) == 2 and tensors[0].data_ptr() != tensors[1].data_ptr():
                tensors[0].copy_(tensors[1])
            return None
        work = collective(*tensors, group=pg, async_op=True)
        if sync:
            return self.wait(work, cpu=True)
        return work

    def all_reduce(self, t, purpose="world", kind="scalar", sync=True, tag=None):
        return self._launch(_all_reduce, purpose, kind, t, 2, tag, sync, t)

    def reduce_scatter(self, out, inp, kind="reduce_scatter", sync=True, tag=None):   # out: inp's slice
        return self._launch(_reduce_scatter, "shard", kind, inp, 1, tag, sync, out, inp)

    def all_gather(self, out, inp, kind="all_gather", sync=True, tag=None):   # inp may be in out
        return self._launch(_all_gather, "shard", kind, out, 1, tag, sync, out, inp)

    def all_to_all(self, out, inp, out_splits, in_splits, kind):
        # uneven pieces to and from each rank of the shard group (a matrix rule's exchange with the
        # matrices' owners, section 11), counted as this rank sends them: all but its own piece
        group = self.groups["shard"]        # (process group, size)
        self.ledger.count(kind, sum(in_splits) - in_splits[self.shard_rank], inp.element_size())
        self.trace.append((kind, None))
        if group[1] == 1:
            out.copy_(inp)
            return None
        return _all_to_all(out, inp, out_splits, in_splits, group=group[0], async_op=True)

    def broadcast(self, t):                 # the setup: every rank starts from the first's values
        pg, n = self.groups["world"]
        if n > 1:
            self.wait(_broadcast(t, self.ranks[0], group=pg, async_op=True))

    def all_gather_object(self, obj):       # Python objects (the setup's, a backward's, a save's)
        out = [obj] * self.world
        if self.world > 1:
            try:
                dist.all_gather_object(out, obj, group=self.groups["world"][0])
            except RuntimeError as e:       # a stalled, dead or diverged rank, as in wait()
                self.wait(e)
        return out

    def agree(self, key, explain, flags=(), extra=None):
        """The ranks' one primitive of agreement (the setup's config, the step, a load): `key`'s
        fingerprint and its squares summed in one fp64 all-reduce, beside `flags` (numbers on the
        host) and `extra` (a float64 tensor on the device), whose sums come back in that order. Where
        some rank's key differs, every rank's explain() is gathered too, for the caller to say who
        differs; else that list is None."""
        digits = fingerprint(key)
        head = torch.tensor(digits + [d * d for d in digits] + list(flags), dtype=torch.float64)
        # what the host gives goes as one tensor, in one copy (on CUDA pinned, not blocking: the
        # step's one host sync is then the read of the sums, after the polled wait)
        stats = _to_device(head, self.device)
        if extra is not None:
            stats = torch.cat([stats, extra])
        self.all_reduce(stats, kind="scalar")
        sums = stats.tolist()
        if all(a * a == self.world * q for a, q in zip(sums[:4], sums[4:8])):
            return sums[8:], None
        return sums[8:], self.all_gather_object(explain())


def _to_device(host, device):
    # a host tensor on `device`: on CUDA pinned first, then copied behind the work queued so far without
    # blocking the CPU (a pageable copy is a stream synchronize); on the CPU the tensor itself
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _work_done(work, seconds):
    # a gloo work done in `seconds`; a wait timed out leaves it running (only a failure ends it)
    try:
        return work.wait(datetime.timedelta(seconds=seconds)) is not False
    except RuntimeError:
        if work.is_completed():
            raise
        return False


# -----------------------------------------------------------------------------
# 3. Loss scaler
#
# fp16 flushes gradients under ~6e-8 to zero: a loss scale lifts them into range; one too large
# overflows to inf, which the step detects (the norm is not finite) and skips.

class LossScaler:
    """DeepSpeed's rule: double after `window` clean steps; on overflow skip the step, and once
    `hysteresis` overflows are used up, halve the scale."""

    def __init__(self, cfg):
        self.enabled = cfg.dtype == "fp16"      # only fp16 needs a scale
        self.scale = cfg.loss_scale if self.enabled else 1.0    # the loss's multiplier
        self.window = cfg.loss_scale_window     # clean steps before the scale doubles
        self.hysteresis = cfg.hysteresis        # overflows tolerated before it starts halving
        self.floor = cfg.min_loss_scale         # the scale's minimum
        self.clean_steps = 0                    # since the last change or overflow
        self.hysteresis_left = cfg.hysteresis   # overflows left before the next halving

    def adjust(self, overflow):
        if not self.enabled:
            return
        if not overflow:                    # a scale that never grows wastes fp16's range
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.scale *= 2
                self.clean_steps = 0
                self.hysteresis_left = self.hysteresis
            return
        self.clean_steps = 0
        if self.hysteresis_left > 1:        # a lone overflow costs no halving, the next ones do
            self.hysteresis_left -= 1
        elif self.scale <= self.floor:      # halving cannot help: keep skipping, and say so
            warnings.warn(f"zero: fp16 gradients overflow at the minimum loss scale {self.floor}; "
                          "the step is skipped again: lower the lr, check the data, or use bf16")
        else:
            self.scale = max(self.scale / 2, self.floor)

    def state_dict(self):                   # what a checkpoint keeps, and a load sets again
        return {k: getattr(self, k) for k in ("scale", "clean_steps", "hysteresis_left")}

    def load_state_dict(self, sd):
        for k in self.state_dict():
            setattr(self, k, sd[k])


# -----------------------------------------------------------------------------
# 4. Update rules: the optimizer table, and AdamW
#
# An update rule is one entry of RULES (Rule): the state it keeps beside each fp32 master, its param group
# keys, their checks, and its step on a Flat's owned slice. AdamW's step, memory-bound on that slice, is
# torch's fused AdamW on CUDA and the C kernel of section 17 on the CPU. Matrix rules (Muon): section 11.

CONVERT_CHUNK = 1 << 22     # elements of a 16-bit gradient converted to fp32 at a time, into _scratch[device]
_scratch = {}               # device -> the fp32 buffer torch's AdamW converts a CPU's 16-bit gradient into


def _host_threads():
    # the cores this process may run on (under torchrun torch has only one thread), shared by the node's ranks
    # unless the launcher bound each rank to cores of its own: then this rank's mask is narrower than the
    # launcher's (a container's cpuset narrows both, and its ranks still share it)
    cores = os.cpu_count() or 1             # this process's mask (the machine's where there are none) ...
    launcher = cores                        # ... and the parent's (the machine's where it cannot be read)
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
        with contextlib.suppress(OSError):
            launcher = len(os.sched_getaffinity(os.getppid()))
    if cores < launcher:                    # bound: these cores are this rank's alone
        return cores
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _adamw(f, runs, groups, mult, out):
    # AdamW's step on a Flat's owned slice, each run (a, b, group, step) with its group's values now
    hyper = []
    for a, b, j, step in runs:
        g = groups[j]
        hyper.append((a, b, g["lr"], *g["betas"], g["eps"], g["weight_decay"], step))
    st = f.state
    adamw_step(st["master"], f.grad_shard, st["exp_avg"], st["exp_avg_sq"], hyper, mult, out)


def adamw_step(master, grad, exp_avg, exp_avg_sq, runs, grad_mult=1.0, out=None):
    """AdamW on the runs (a, b, lr, beta1, beta2, eps, weight_decay, step) of 1-D fp32 tensors as torch's
    fused kernel computes it, grad_mult (unscale, clip) inside, the new master also into `out`; the one
    place that picks the kernel: the C kernel (section 17) run by run where it takes the tensors, else
    torch's."""
    tensors = [t for t in (master, grad, exp_avg, exp_avg_sq, out) if t is not None]
    # the C kernel's: CPU tensors of one length, fp32 states, an fp32 or bf16 gradient and out
    c_takes = all(t.is_cpu and t.is_contiguous() and t.numel() == master.numel() for t in tensors)
    c_takes = c_takes and {master.dtype, exp_avg.dtype, exp_avg_sq.dtype} == {torch.float32}
    c_takes = c_takes and {t.dtype for t in tensors} <= {torch.float32, torch.bfloat16}
    if not c_takes or _cpu_kernel() is None:
        return _torch_adamw(master, grad, exp_avg, exp_avg_sq, runs, grad_mult, out)
    for run in runs:
        _c_adamw(master, grad, exp_avg, exp_avg_sq, out, *run, grad_mult)


def _torch_adamw(master, grad, exp_avg, exp_avg_sq, runs, grad_mult=1.0, out=None):
    # torch's fused kernel (torch >= 2.4's signature; CUDA, an fp16 gradient, no compiler): one multi-tensor
    # call per hyperparameters, a list entry and a step count per run. A 16-bit gradient is converted to fp32
    # once: on a device all of it (a transient), on a CPU in chunks through _scratch (a fresh fp32 copy costs
    # more in page faults than the update), a call per chunk
    if not runs:
        return
    dev = master.device
    lo = min(r[0] for r in runs)            # the span the runs cover
    hi = max(r[1] for r in runs)
    chunk = hi - lo                         # elements converted at a time (a CPU's 16-bit gradient)
    if grad.dtype != torch.float32 and dev.type == "cpu":
        chunk = CONVERT_CHUNK
    inv_mult = None                         # what the kernel divides the gradient by
    if grad_mult != 1.0:
        inv_mult = torch.full((), 1.0 / grad_mult, device=dev)
    groups = {}
    for a, b, *hyper, step in runs:
        groups.setdefault(tuple(hyper), []).append((a, b, step))
    for c in range(lo, hi, chunk):
        d = min(hi, c + chunk)
        g = grad[c:d]
        if g.dtype != torch.float32 and dev.type == "cpu":
            if dev not in _scratch or _scratch[dev].numel() < d - c:
                _scratch[dev] = torch.empty(chunk, device=dev)
            g = _scratch[dev][:d - c].copy_(g)
        elif g.dtype != torch.float32:
            g = g.float()
        for (lr, beta1, beta2, eps, weight_decay), rs in groups.items():
            rs = [(max(a, c), min(b, d), step) for a, b, step in rs if max(a, c) < min(b, d)]
            if not rs:
                continue
            # the kernel counts each to its run's step; one fill, and one more per run that missed steps
            steps = torch.full((len(rs),), rs[0][2] - 1.0, device=dev)
            for k, (_, _, step) in enumerate(rs):
                if step != rs[0][2]:
                    steps[k].fill_(step - 1)
            functional_adamw([master[a:b] for a, b, _ in rs], [g[a - c:b - c] for a, b, _ in rs],
                             [exp_avg[a:b] for a, b, _ in rs], [exp_avg_sq[a:b] for a, b, _ in rs], [],
                             list(steps), fused=True, grad_scale=inv_mult, amsgrad=False, beta1=beta1,
                             beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    if out is not None:
        for a, b, *_ in runs:
            out[a:b].copy_(master[a:b])


@dataclasses.dataclass(frozen=True)
class Rule:
    """An update rule: all the engine knows of an optimizer, in one place. An elementwise rule is one
    function on 1-D fp32 slices of the owned shard, writing in place: step(master, grad, state, group,
    step), `state` its named states' slices; on the CPU compiled, the group's floats and the step then
    0-dim float64 tensors (Python's math on them breaks the graph). A matrix rule is one function on each
    whole matrix, whole(matrix, state, group, step) -> update, run by the rank that owns the matrix
    (MatrixStep: the engine's assignment, exchange, views and owner state), with elementwise parts on the
    slices before it (what the owner gets) and after it (the master updated); they also take the matrix's
    (rows, cols), on which a scale often depends. A new optimizer is one entry and its functions."""
    name: str                       # a param group's "update", Config.update; checkpoints record it
    states: tuple                   # fp32 states shaped as the parameters, sharded as the master is
    keys: tuple                     # the param group keys it reads, besides "params" and "update"
    defaults: object                # Config -> the values of those keys, for groups that omit them
    check: object = None            # group -> what is wrong with its values ("sets k=v: use ..."), or None
    step: object = None             # elementwise: step(master, grad, state, group, step)
    flat_step: object = None        # (flat, runs, groups, mult, out): a faster form of step (AdamW's)
    whole: object = None            # matrix: whole(matrix, state, group, step) -> update, on its owner
    before: object = None           # matrix: (master, grad, state, group, step, shape) -> what is sent
    after: object = None            # matrix: (master, update, state, group, step, shape), in place
    owner_states: object = None     # matrix: (rows, cols) -> {name: shape} of fp32 state its owner keeps
    sends: tuple = (torch.bfloat16, torch.float32)   # matrix: dtypes to the owners, and updates back
    offload: bool = True            # runs on offload's host thread (False: offload=True is refused)

    @property
    def matrices(self):             # a matrix rule: whole matrices, each stepped by its owner
        return self.whole is not None

    @property
    def state_bytes(self):          # per parameter, for estimate_memory (owner state: a few per matrix)
        return 4 * len(self.states)


def _nonnegative(g, keys):
    # "sets lr=-1: use values >= 0" for those of these keys below 0, else None
    bad = [f"{k}={g[k]}" for k in keys if not g[k] >= 0]
    if bad:
        return f"sets {', '.join(bad)}: use values >= 0"
    return None


def _adamw_defaults(cfg):
    lr = cfg.lr                         # (update= a matrix rule: Config.lr is that rule's)
    if RULES[cfg.update].matrices:
        lr = cfg.adamw_lr
    return dict(lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def _adamw_check(g):
    betas = g["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        return f"sets betas={betas!r}: use two numbers in [0, 1)"
    if not g["eps"] > 0:
        return f"sets eps={g['eps']}: use eps > 0"
    return _nonnegative(g, ("lr", "weight_decay"))

RULES = {"adamw": Rule("adamw", ("exp_avg", "exp_avg_sq"), ("lr", "betas", "eps", "weight_decay"),
                       _adamw_defaults, _adamw_check, flat_step=_adamw)}


def _check_group(prefix, j, g):
    # a group's values as its rule checks them: at the build, and at each step (a scheduler's writes)
    rule = RULES[g.get("update", "adamw")]
    problem = None
    if rule.check is not None:
        problem = rule.check(g)
    if problem:
        raise ValueError(f"{prefix}: param_groups[{j}] {problem}")


# -----------------------------------------------------------------------------
# 5. Flat buffers and units
#
# A unit is a transformer block, or the root (the rest), as FSDP users wrap by hand: the grain of
# every collective and of stage 3's gathering. Its parameters are views into flat buffers.

def find_units(model):
    """Default units: the elements (blocks) of every outermost nn.ModuleList, depth first."""
    return [u for c in model.children()
            for u in (c if isinstance(c, nn.ModuleList) else find_units(c))]


class Flat:
    """A unit's trainable parameters of one update rule, or its frozen ones, as views into one flat
    buffer padded to equal shards for the collectives that move it. build() fills it and makes the
    tensors beside it (TENSORS: what memory() counts each as); its methods are their only writers."""

    def __init__(self, named_params, plan, rule=None, groups=None, sharded=False, dtype=None, views=None):
        self.plan = plan                    # what the stage keeps, and where
        self.rule = rule                    # the update rule of its parameters (None: frozen)
        self.trainable = rule is not None   # holds trainable parameters, or frozen ones
        self.dtype = dtype or plan.dtype    # the buffer's: the compute dtype, or a non-float's own
        # frozen floats held in fp32 (Config.frozen_dtype), cast to the compute dtype when gathered
        self.cast = dtype is None and rule is None and plan.frozen_fp32
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        sizes = [p.numel() for p in self.params]
        # every parameter's view, and every rank's slice, starts on 16 bytes: one odd size would
        # misalign all the views after it (cuBLAS's slower paths, torch.compile's recompiles)
        align = max(1, 16 // self.dtype.itemsize)
        self.offsets = []                   # each parameter's start
        self.end = 0                        # where the last one ends
        for n in sizes:
            self.offsets.append(-(-self.end // align) * align)
            self.end = self.offsets[-1] + n
        self.numel = sum(sizes)             # the parameters' elements
        grain = plan.shards * align         # equal shards, each on 16 bytes
        self.padded = -(-self.end // grain) * grain     # the buffer's length
        ends = [o + n for o, n in zip(self.offsets, sizes)]
        # the slice this rank owns, [lo, hi): one of plan.shards, or all (stage 0; frozen at 1-2)
        self.lo = 0
        self.hi = self.padded
        if sharded:
            self.lo = plan.shard_rank * (self.padded // plan.shards)
            self.hi = self.lo + self.padded // plan.shards
        self.pieces = []                    # (a, b, i): parameter i's owned piece [a, b), from lo
        for i, (o, e) in enumerate(zip(self.offsets, ends)):
            if max(o, self.lo) < min(e, self.hi):
                self.pieces.append((max(o, self.lo) - self.lo, min(e, self.hi) - self.lo, i))
        # per parameter
        self.steps = [0] * len(sizes)       # the rule's steps (AdamW's bias correction)
        self.group = list(groups or [0] * len(sizes))   # its param group
        self.used = [False] * len(sizes)    # a gradient came on some rank for this step
        self.matrices = _matrices(self, views or [])   # a matrix rule's, in order (section 11)
        self.written = set()                # those whose gradient is in grad
        self.got = set()                    # those whose gradient came since the last step
        # what build() makes
        self.flat = None                    # the buffer (stage 3 frees its storage between uses)
        self.owned = None                   # this rank's values: flat[lo:hi], or shard
        self.shard = None                   # stage 3: them, kept (frozen fp32: None)
        # checkpointed: master (fp32; frozen: as held), then the rule's states (offload: host)
        self.state = {}
        self.out = None                     # where an update writes (None: the master is owned)
        self.grad = None                    # the whole gradient (stages 2-3: while reduced)
        self.grad_shard = None              # its reduced owned slice (offload: on the host)
        self.acc = None                     # offload, stages 2-3: that summed over micro-batches
        self.staging = None                 # offload on CUDA: the pinned slice updates write first
        self.norm = None                    # offload: the squared norm of what went to the host
        self.d2h_event = None               # offload on CUDA: its copy to the host done ...
        self.h2d_event = None               # ... and the updated slice's copy back

    def build(self, full, state):
        """The buffers from `full`, the fp32 values (or the frozen ones' own); state(kind, n, dtype,
        src) makes shard state where TENSORS puts it. Returns the frozen parameters that the compute
        dtype changes."""
        plan = self.plan
        self.flat = full.to(self.dtype)
        for p, o in zip(self.params, self.offsets):
            p.data = self.flat[o:o + p.numel()].view(p.shape)
        mine = full[self.lo:self.hi]
        n = self.hi - self.lo
        self.owned = self.flat[self.lo:self.hi]
        if plan.shards_params and self.cast:
            self.owned = None               # stage 3 keeps the master alone
        elif plan.shards_params:
            self.shard = self.owned.clone()
            self.owned = self.shard
        self.state = {"master": self.owned}
        if self.cast:                       # frozen fp32: exact, cast when gathered
            self.state["master"] = mine.clone()
        if self.trainable:
            if not plan.master_is_param:    # fp32 apart from the 16-bit (or offloaded) parameters
                self.state["master"] = state("master", n, src=mine)
            for k in self.rule.states:
                self.state[k] = state(k, n)
            if not plan.shards_grads:       # the whole gradient stays; stage 1 owns a slice of it
                self.grad = torch.zeros(self.padded, dtype=plan.grad_dtype, device=plan.device)
                self.grad_shard = self.grad[self.lo:self.hi]
            if plan.shards_grads or plan.offload:
                self.grad_shard = state("grad_shard", n, plan.grad_dtype)
            if plan.offload and plan.shards_grads and (plan.accum > 1 or plan.replicas > 1):
                self.acc = torch.zeros(n, dtype=plan.grad_dtype, device=plan.device)
            if plan.pin:
                self.staging = state("staging", n, plan.dtype)
        if self.state["master"] is not self.owned:
            self.out = self.owned
        if self.trainable or self.cast or not self.dtype.is_floating_point:
            return []
        return [name for name, p, o in zip(self.names, self.params, self.offsets)
                if not torch.equal(full[o:o + p.numel()], self.flat[o:o + p.numel()].float())]

    def take_grad(self, i, p):
        # parameter i's .grad into the whole gradient at once (stages 2-3: this micro-batch's only),
        # made zeros: the gaps between the parameters stay zero through every reduction
        if self.grad is None:
            self.grad = torch.zeros(self.padded, dtype=self.plan.grad_dtype, device=self.plan.device)
        o = self.offsets[i]
        dst = self.grad[o:o + p.numel()]
        with torch.no_grad():
            if i in self.written:           # summed with the one already there
                dst.add_(p.grad.view(-1))
            else:
                dst.copy_(p.grad.view(-1))
        self.written.add(i)
        self.got.add(i)
        p.grad = None

    def to_reduce(self):
        # the whole gradient as the reduction takes it: zero where none came (not last window's),
        # divided by the part of the mean that comes before the sum
        if self.grad is None:
            self.grad = torch.zeros(self.padded, dtype=self.plan.grad_dtype, device=self.plan.device)
        for i, (p, o) in enumerate(zip(self.params, self.offsets)):
            if i not in self.written:
                self.grad[o:o + p.numel()].zero_()
        self.written = set(range(len(self.params)))
        return self.grad.mul_(1.0 / self.plan.divide[0])

    def reduced(self, micro):
        # the reduced owned slice summed over micro-batches, on the device: the gradient shard, or
        # with offload the accumulator (or this micro-batch's alone); stages 2-3 free the whole one
        plan = self.plan
        mine = self.grad[self.lo:self.hi]
        dev = self.acc
        if dev is None and plan.offload:
            dev = mine
        elif dev is None:
            dev = self.grad_shard
        if plan.shards_grads and dev is not mine and micro == 0:
            dev.copy_(mine)
        elif plan.shards_grads and dev is not mine:
            dev.add_(mine)
        if plan.shards_grads:
            self.grad = None
            self.written = set()
        return dev

    def to_host(self, dev, copies):
        # offload, once a step (the paper's minimal traffic): the squared norm first, on the compute
        # stream, which the step reads; then the copy, on a stream the host update waits for
        self.norm = torch.linalg.vector_norm(dev, dtype=torch.float32) ** 2
        self.d2h_event = copies.to_host(self.grad_shard, dev)

    def sq_norm(self):
        # the squared norm of the gradient slice this rank owns
        if self.plan.offload:
            return self.norm
        mine = self.grad_shard
        if not self.plan.shards_optim:
            # stage 0: the slice stages 1-3 would own, its square summed over ranks in the step's fp64
            # all-reduce as theirs is (the norm's rounding, which the clip carries into every update, is
            # every stage's), one kernel per rank, not one per rank's slice on every rank
            mine = mine.view(self.plan.shards, -1)[self.plan.shard_rank]
        return torch.linalg.vector_norm(mine, dtype=torch.float32) ** 2

    # -- the step
    def new_window(self):                   # the step is agreed: the next accumulation starts
        self.written = set()
        self.got = set()

    def step_runs(self, used):
        # `used`, per parameter, whether a rank had its gradient: their step counts advance (the rest
        # are left alone, as torch's optimizers leave them). Returns the rule's calls, one per run of
        # adjacent parameters with a gradient, the same group and step count: (a, b, group, step)
        self.used = [bool(g) for g in used]
        self.steps = [step + g for step, g in zip(self.steps, self.used)]
        runs = []
        for a, b, i in self.pieces:
            key = [self.group[i], self.steps[i]]
            if not used[i]:
                continue
            if runs and runs[-1][1] == a and runs[-1][2:] == key:
                runs[-1][1] = b
            else:
                runs.append([a, b, *key])
        return [tuple(r) for r in runs]

    def set_steps(self, steps):
        self.steps = list(steps)

    def update(self, runs, groups, mult, copies):
        # an elementwise rule's step on the owned slice; offload on CUDA writes the pinned staging copy
        # first, then copies the runs to the device (a parameter without a gradient keeps its value)
        if copies is not None:              # its gradient on the host; the last copy out of staging
            copies.sync(self.d2h_event, self.h2d_event)
        out = self.out
        if self.staging is not None:
            out = self.staging
        if self.rule.flat_step is not None:
            self.rule.flat_step(self, runs, groups, mult, out)
        else:
            _elementwise(self, runs, groups, mult, out)
        if self.staging is not None:
            self.h2d_event = copies.to_device([(self.out[a:b], self.staging[a:b]) for a, b, _, _ in runs])

FREED, STALE, GATHERING, WHOLE = "freed", "stale", "gathering", "whole"     # a unit's phases


class Unit:
    """A block (an element of the outermost ModuleList) or the root (the rest): its Flats and their
    phases as the walk sees them, the same on every rank: FREED (stage 3) or STALE (values not this
    step's: stages 1-2 after an update, offload) -> GATHERING (all-gathers in flight) -> WHOLE. Apart
    from the phase, this rank may hold the storage (`held`: a parameter used outside its forward) until
    the backward that needs it ends: the walk frees and gathers such a unit as every rank does."""

    def __init__(self, index, module, name, flats, plan, net, worker, is_root):
        self.index = index                  # its place in the engine's units
        self.module = module
        self.name = name                    # the module's, for messages
        self.is_root = is_root              # the model's parameters outside every block
        self.flats = flats                  # the trainable Flats (one per rule), then the frozen
        self.plan = plan
        self.net = net                      # the engine's Comm
        self.worker = worker                # offload: the HostWorker that updates it
        self.params = [p for f in flats for p in f.params]
        self.trains = [f for f in flats if f.trainable]
        # the Flats a gather fills: stage 3's all, stages 1-2's trainable ones (updates change them)
        self.to_gather = [f for f in flats if f.trainable or plan.shards_params]
        self.phase = WHOLE                  # FREED, STALE, GATHERING or WHOLE
        self.works = []                     # the all-gathers in flight (GATHERING)
        self.held = is_root                 # this rank keeps its storage while a backward is pending
        self.replica = None                 # hybrid: its sums across shard groups (section 10)
        if plan.replicas > 1:
            self.replica = Replica(self)
        self.updating = None                # offload: the Future of its host update

    # -- the phases
    def unshard(self, wait=True):
        # all-gathers launched (stage 3: from the shards; offload: the host update's), then waited
        if self.phase in (FREED, STALE):
            self.wait_update()
            for f in self.to_gather:
                st = f.flat.untyped_storage()
                if self.plan.shards_params and not st.nbytes():
                    st.resize_(f.padded * f.flat.element_size())
                    self.net.count_held(st.nbytes())
                src = f.owned
                if src is None:             # frozen fp32, cast
                    src = f.state["master"].to(self.plan.dtype)
                kind = "all_gather" if f.trainable else "frozen_all_gather"
                work = self.net.all_gather(f.flat, src, kind, sync=False, tag=self.index)
                self.works.append(work)
            self.phase = GATHERING
        if wait and self.phase == GATHERING:
            for w in self.works:
                self.net.wait(w)
            self.works = []
            self.phase = WHOLE
            self.mark(False)
        return self

    def free(self, pending):
        """The one rule of when a unit's whole parameters go (stage 3), called by the walk at the places
        its table says (the same on every rank) and at the ends of backwards and steps: the walk sees it
        FREED; its storage goes too, unless this rank holds it (a parameter escaped its forward) and a
        backward that needs it is `pending`. The step frees with pending=False: nothing whole across an
        update. Held storage the walk gathers again takes the same values: the collective is every rank's."""
        if not self.plan.shards_params:
            return
        if self.phase == GATHERING:         # a gather in flight finishes first
            self.unshard()
        self.phase = FREED
        resident = any(f.flat.untyped_storage().nbytes() for f in self.flats)
        if resident and not (self.held and pending):
            self.reshard()

    def reshard(self):
        # stage 3: the storage goes back (the views, and autograd's references, stay valid)
        for f in self.flats:
            self.net.count_held(-f.flat.untyped_storage().nbytes())
            f.flat.untyped_storage().resize_(0)
        # autocast's casts of these weights would answer for them once freed
        if torch.is_autocast_enabled(self.plan.device.type):
            torch.clear_autocast_cache()
        self.mark(True)

    def stale(self):                        # the owned slices changed: gather before the next use
        self.phase = STALE
        self.mark(True)
        return self

    def mark(self, freed):
        # a unit whose storage is not this step's has _Sharded parameters: a read is an error or a
        # gather, not a crash
        params = self.params
        if freed:
            params = [p for f in self.to_gather for p in f.params]
        for p in params:
            if type(p) in (nn.Parameter, _Sharded):
                p.__class__ = _Sharded if freed else nn.Parameter

    def hold(self):
        self.held = True

    def drop_works(self):                   # at exit, once they finished
        self.works = []

    # -- the reduction
    def reduce(self):
        # each trainable Flat's gradient: stage 0 all-reduces it, the rest reduce-scatter it
        works = []
        for f in self.trains:
            g = f.to_reduce()
            if self.plan.shards_optim:
                works.append(self.net.reduce_scatter(g[f.lo:f.hi], g, sync=False, tag=self.index))
            else:
                works.append(self.net.all_reduce(g, "shard", "all_reduce", False, self.index))
        return works

    def finish_reduce(self, works, micro):
        # the reductions awaited and summed over micro-batches; in the step's last, hybrid sums
        # across groups, offload sends the sum to the host
        last = micro == self.plan.accum - 1 or not self.plan.shards_grads
        for f, work in zip(self.trains, works):
            self.net.wait(work)
            dev = f.reduced(micro)
            if last and self.replica is not None:   # summed across shard groups first
                self.replica.launch(f, dev)
            elif last and self.plan.offload:
                self.to_host(f, dev)

    def to_host(self, f, dev):
        f.to_host(dev, self.worker.copies)
        self.net.ledger.count("d2h", dev.numel(), dev.element_size())

    # -- the update
    def update(self, mult, runs, groups):
        # the elementwise rules' steps on the owned slices, no collective (offload: on the worker's
        # thread); the engine's MatrixStep steps the matrix rules' Flats, all units' at once
        whole = self.plan.shards_params and self.phase not in (FREED, STALE)
        assert not whole, f"{self.name} is whole across an update"
        copies = self.worker.copies if self.worker is not None else None
        for f, rs in zip(self.trains, runs):
            if not f.rule.matrices:
                f.update(rs, groups, mult, copies)

    def start_update(self, mult, runs, groups):
        # offload: the update queued on the worker's thread; the next gather of this unit waits
        self.updating = self.worker.submit(functools.partial(self.update, mult, runs, groups))

    def update_done(self):
        # offload: no update pending (a prefetch does not wait for one that still runs)
        return self.updating is None or self.updating.done()

    def wait_update(self):
        # offload: the host update done (bounded by timeout_s) and its failure raised here; the
        # current stream then waits for the updated slices' copy to the device
        if self.updating is None:
            return
        future = self.updating
        self.updating = None
        try:
            future.result(self.worker.timeout)
        except TimeoutError:
            raise RuntimeError("zero: the offload worker did not finish a unit in time") from None
        except Exception as e:
            raise RuntimeError("zero: the offload update failed") from e
        for f in self.trains:
            self.worker.copies.order(f.h2d_event)


def _regather(units):
    # stages 1-2, after an update or a load: owned slices to all ranks, launched before any wait
    for wait in (False, True):
        for u in units:
            u.unshard(wait)


def _tree_map(fn, x, rebuild=True):
    """fn on every tensor in tuples (named too), lists, dicts, dataclasses (Hugging Face's
    ModelOutput), rebuilt around fn's results (rebuild=False: only visited)."""
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
        if rebuild and hasattr(x, "_fields"):   # a named tuple takes its fields one by one
            return type(x)(*new)
        return type(x)(new) if rebuild else x
    return x


def _tensors(x):
    out = []
    _tree_map(out.append, x, rebuild=False)
    return out


class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs: its backward runs once all their gradients are in, when the
    unit's backward is done (FSDP2's post-backward signal)."""

    @staticmethod
    def forward(ctx, when_done, *xs):
        ctx.when_done = when_done           # the schedule's post_backward for this call
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.when_done()
        return (None, *grads)


def _on_grad(sched, j, k, i, p):
    # held by torch where gc cannot see: the schedule weakly, the unit and Flat by number, or never
    # freed; parameter i of unit j's k-th trainable Flat
    s = sched()
    if s is not None:
        s.on_grad(s.units[j], k, i, p)


# -----------------------------------------------------------------------------
# 6. The schedule: one table every rank walks
#
# A rank whose batch skips a block or reaches fewer experts must still pair each collective with
# the same one everywhere (in one order across communicators, for NCCL): all walk one table.

END = 1 << 30                               # a segment's end node sorts after its calls
Op = collections.namedtuple("Op", "point kind unit due")   # one step of a walk (see Table)


class Table:
    """One walk over `units` (the unit at each place), computed once from the order all ranks agreed on,
    so that every rank launches the same gathers and reductions in the same order whatever it ran (FSDP2
    lists its prefetches explicitly, for the same reason). Point i is "place i is about to run", point n
    "past the last place", point n + 1 the walk's end (the backward's: what reaches no place, or the kept
    units, reduced last). At each point, in this order: the reductions of the units whose last place
    passed (`reduce`: (unit, point), in launch order); the frees of the units whole but needed at none of
    places i .. i + prefetch; the gathers of those of them not whole, each `due` at the place that needs
    it first. The `kept` units are whole throughout (gathered when a forward starts) and in no op."""

    def __init__(self, units, kept, prefetch, gathers, frees, reduce=()):
        self.n = len(units)                 # the point past the last place
        self.end = self.n + 1               # the walk's end (a point)
        self.ops = []                       # the Ops, in the order every rank runs them
        at = collections.defaultdict(list)  # point -> the units reduced there
        for u, point in reduce:
            at[point].append(u)
        whole = []                          # the units whole as the walk sees them
        for i in range(self.end + 1):
            self.ops += [Op(i, "reduce", u, i) for u in at[i]]
            ahead = units[i:i + prefetch + 1]
            for u in list(whole):
                if frees and u not in ahead:
                    self.ops.append(Op(i, "free", u, i))
                    whole.remove(u)
            for j, u in enumerate(ahead):
                if gathers and u not in whole and u.index not in kept:
                    self.ops.append(Op(i, "gather", u, i + j))
                    whole.append(u)
            # what the walk keeps true where it frees (stage 3): at most prefetch + 1 units whole at once
            assert not frees or len(whole) <= prefetch + 1, (len(whole), prefetch)


class Schedule:
    """The one order of a micro-batch's gathers and reductions, the same on every rank whatever the
    data, and the hooks that walk it. A place is one call: the k-th of unit u in a micro-batch's s-th
    forward (its segment) is node (s, k, u). arrange() makes a Table of each segment's forward and one of
    the backward (the places reversed, `back`); a rank's own calls only move a cursor through the table
    it walks, and a place it skips is gathered and freed all the same. What it keeps true:

    - every rank launches the same collectives in the same order, so every wait is for one that all
      launched: a gather comes from a table, from enter()'s gather of the units all ranks agreed to keep
      whole (`kept`), or, before the first backward learned the order (when all ranks run alike), from
      a call out of turn, read_outside() or a block called on its own; after it, one a table lacks is
      refused by name (alone(), read_outside());
    - a unit's phase changes by the walk and the ends of backwards and steps alone, so it is every
      rank's: a rank that holds a unit's storage (an escaped parameter) still sees it freed, and gathers
      it again where the table says, as the others do;
    - at most prefetch + 1 units besides the kept ones are whole at once (asserted on each Table);
    - waiting for the reduction two launches back keeps three whole-unit gradients alive at most;
    - nothing is whole across an update (before_update frees all)."""

    def __init__(self, units, plan, net):
        self.units = units                  # every unit, by index (the root among them)
        self.plan = plan                    # what the stage does
        self.net = net                      # the collectives
        self.order = [u for u in units if not u.is_root]   # blocks: as registered, then as called
        self.depth = 0                      # modules outside the units now running (nested)
        self.loose = []                     # units gathered outside a table, freed at the next call
        self.ran = []                       # indices of the units run this step
        self.walk = None                    # the running forward's segment (None: none runs)
        self.start = 0                      # its first place
        self.count = collections.Counter()  # its calls of each unit, by index
        self.keys = {}                      # unit index -> the node of its running call
        self.calls = []                     # calls (nodes) with a backward to come ...
        self.forwards = 0                   # ... in this many forwards
        self.evals = 0                      # forwards without a backward since the last with one
        self.grad_out = {}                  # unit index -> an output of its required grad
        self.micro = 0                      # backward calls since the last step
        self.checked = False                # the first forward ran
        self.learned = False                # the first backward learned the order
        self.in_backward = False            # in engine.backward (a bare loss.backward() is refused)
        # the order, set by arrange()
        self.segments = []                  # the units each forward calls, in order
        self.without = frozenset()          # units whose forward made nothing that requires grad
        self.kept = frozenset()             # units every rank keeps whole, reduced last
        self.places = []                    # the segments end to end
        self.node = {}                      # node (segment, occurrence, unit index) -> its place
        self.ends = []                      # each segment's end (a place)
        self.back = []                      # the backward's: `places` reversed, less `without`
        self.bpos = {}                      # place -> its index in `back`
        self.forward_tables = []            # each segment's Table, then an empty one (see enter)
        self.backward_table = None          # the backward's Table, over `back`
        self.launch = []                    # the trained units, in the order they are reduced
        # the walk in progress: a forward's or the backward's
        self.table = None                   # the Table it walks (None: none)
        self.next_op = 0                    # the index of its next Op
        self.point = -1                     # the last point it reached
        self.deferred = collections.deque()     # (unit, due) of gathers reached, not launched yet
        self.reduced = set()                # units whose reduction launched
        self.in_flight = collections.deque()    # (unit, works) of reductions launched, not awaited
        self.arrange([self.order], kept={u.index for u in units if u.held})

    def arrange(self, segments, without=frozenset(), kept=frozenset()):
        # the order of these forwards and of their backward, and the tables every rank walks; the units
        # in `kept` held from now on
        self.segments = segments
        self.without = without
        self.kept = frozenset(kept)
        self.places = []
        self.node = {}
        self.ends = []
        for s, seg in enumerate(segments):
            for k, u in enumerate(seg):
                self.node[(s, seg[:k].count(u), u.index)] = len(self.places) + k
            self.places += seg
            self.ends.append(len(self.places))
        self.back = [j for j, u in reversed(list(enumerate(self.places))) if u.index not in without]
        self.bpos = {j: k for k, j in enumerate(self.back)}
        last = {self.places[j].index: k for j, k in self.bpos.items()}   # a unit's last in `back`
        # forwards gather at stage 3 and with offload (the host's slices); the backward at stage 3
        plan = self.plan
        k = plan.prefetch
        self.forward_tables = [Table(seg, self.kept, k, plan.gathers_lazily, plan.shards_params)
                               for seg in segments + [[]]]
        # each trained unit reduced once the backward is past its last place; the kept ones (whole to
        # the end) and those it never reaches when it ends
        reduce = []
        for u in self.units:
            point = len(self.back) + 1
            if u.index in last and u.index not in self.kept:
                point = last[u.index] + 1
            if u.trains:
                reduce.append((u, point))
        reduce.sort(key=lambda r: r[1])     # (stable: ties by unit)
        self.launch = [u for u, _ in reduce]
        back = [self.places[j] for j in self.back]
        self.backward_table = Table(back, self.kept, k, plan.shards_params, plan.shards_params, reduce)
        self.order = list(dict.fromkeys(self.places + self.order))
        for i in self.kept:
            self.units[i].hold()

    def learn(self):
        """The first backward: the ranks agree on the order their forwards called the blocks in (not
        always as registered, maybe one twice), the units held whole, and those with no backward."""
        ends = [(s, END, END) for s in range(self.forwards)]
        mine = sorted(self.calls + ends, key=lambda x: (x[0], x[1] == END))
        held = [u.index for u in self.units if u.held]
        every = self.net.all_gather_object((mine, held, self.grad_out))
        grads = [(i, g) for _, _, theirs in every for i, g in theirs.items()]
        without = {i for i, g in grads if not g} - {i for i, g in grads if g}
        segments = [[]]
        for _, k, i in _merge([s for s, _, _ in every], [(0, 0, u.index) for u in self.order]):
            if k == END:                    # an end starts the next segment
                segments.append([])
            else:
                segments[-1].append(self.units[i])
        self.arrange(segments[:-1] or segments, without, {i for _, kept, _ in every for i in kept})
        # a unit some rank held in the first forward is whole on every rank from now on, as the
        # tables assume: gathered here, by all, in unit order
        for i in sorted(self.kept):
            self.units[i].unshard()
        self.learned = True

    def alone(self, u, what):
        """u called where its walk has no place for it (out of turn, or more often than its places).
        Before the first backward learned the order all ranks do the same, and u is gathered; after
        it, where u is not whole, the gather would be this rank's alone: refused by name."""
        if self.learned and u.phase != WHOLE:
            raise RuntimeError(f"zero: '{u.name}' was {what} than in the first step, which "
                               "gathering it would make this rank's collective alone: call the "
                               "blocks as in the first step")
        self.gather_loose(u)

    def gather_loose(self, u):
        # u gathered outside the tables (every rank calls it alike), freed once another unit starts
        if u.phase != WHOLE:
            self.loose.append(u)
        u.unshard()

    def free_loose(self, keep=None):
        # the units gathered outside the tables go, but `keep` (called again)
        for u in self.loose:
            if u is not keep:
                u.free(pending=True)
        self.loose = [u for u in self.loose if u is keep]

    def before_update(self):
        """Nothing is whole across an update, which the step relies on: a forward nobody backwarded
        (a loss for a log line) left the held units whole with the weights the update is about to
        change; they are freed, and its calls forgotten."""
        self.calls = []
        self.forwards = 0
        for u in self.units:
            u.free(pending=False)

    def agree_kept(self, held):
        # units whose parameters escaped on a rank since the last agreement: held, reduced last
        if self.learned and not held <= self.kept:
            self.arrange(self.segments, self.without, held | self.kept)

    def new_step(self):
        # a step ended (or was skipped): the micro-batches and the units run count again
        self.micro = 0
        self.ran = []

    # -- walking a table
    def begin_walk(self, table):
        # a walk starts before its first point; with prefetch, its first gathers leave at once
        self.table = table
        self.next_op = 0
        self.point = -1
        self.deferred = collections.deque()
        if self.plan.prefetch and table.n:
            self.advance(0)

    def advance(self, i):
        """The walk's Ops up to point i, in the table's order, whatever this rank ran: a place it
        skipped is gathered and freed all the same. A gather ahead of its place waits while its host
        update runs (offload: waiting would undo the overlap), and the gathers after it wait too."""
        ops = self.table.ops
        while self.next_op < len(ops) and ops[self.next_op].point <= i:
            op = ops[self.next_op]
            self.next_op += 1
            if op.kind == "gather":
                self.deferred.append((op.unit, op.due))
                continue
            self.launch_gathers(op.point)
            if op.kind == "free":
                op.unit.free(pending=True)
            else:
                self.launch_reduce(op.unit)
        self.launch_gathers(i)
        self.point = max(self.point, i)

    def launch_gathers(self, i):
        # the gathers the walk reached, in its order: those due by place i, then those ahead of their
        # place, until one whose host update still runs
        while self.deferred:
            u, due = self.deferred[0]
            if due > i and not u.update_done():
                return
            self.deferred.popleft()
            u.unshard(wait=False)

    def launch_reduce(self, u):
        # u's reductions launched, in every micro-batch's backward where the whole gradients are freed
        # (2-3), else in the last's; at stages 2-3 the ones two launches back awaited (stream-ordered on
        # NCCL), at stages 0-1 all in drain(). (No gather waits here: the backward runs no host update.)
        if not (self.plan.shards_grads or self.micro == self.plan.accum - 1):
            return
        assert not self.deferred, "a reduction would pass a gather its table put first"
        self.reduced.add(u.index)
        self.in_flight.append((u, u.reduce()))
        if self.plan.shards_grads:
            self.drain(2)

    def drop_in_flight(self):               # at exit, once they finished
        self.in_flight = collections.deque()

    def drain(self, leave=0):
        # the oldest reductions in flight finished, all but `leave`
        while len(self.in_flight) > leave:
            u, works = self.in_flight.popleft()
            u.finish_reduce(works, self.micro)

    # -- forward hooks: opaque to torch.compile, whose graphs break where a unit begins or ends
    @torch.compiler.disable
    def enter(self, refuse=None):
        # a forward starts with the first module outside the units (the model, or a part of it);
        # `refuse`: why it may not run (its exit hook runs all the same, and counts it out)
        self.depth += 1
        if refuse:
            raise RuntimeError(refuse)
        if self.depth > 1:
            return
        grad = torch.is_grad_enabled()
        if self.plan.gathers_lazily and grad:   # after evaluations: checked all made as many
            self.net.call("forward", check=self.evals)
            self.evals = 0
        elif self.plan.gathers_lazily:
            self.net.call("no_grad forward")
            self.evals += 1
        self.free_loose()                   # a block called on its own since the last forward
        # what the tables assume: at stage 3 only the kept units are whole between forwards
        stray = [u.name for u in self.units if u.phase == WHOLE and u.index not in self.kept]
        assert not (self.plan.shards_params and stray), f"whole between forwards: {stray}"
        # a forward with no backward to come (evaluation, a metric, a teacher) walks the first
        # segment, the training walk left where it was; one past the learned segments (after
        # forwards nobody backwarded: a log line's loss, a refused loss.backward()) wraps round
        s = 0                               # the segment this forward walks
        if grad:
            s = self.forwards
        if self.learned:
            s %= len(self.segments)
        n = len(self.ends)                  # s >= n (a 2nd forward before learning): an empty walk
        self.walk = s
        self.start = ([0, *self.ends])[min(s, n)]
        self.count = collections.Counter()
        self.forwards += grad
        # the units all ranks keep (the root among them) stay whole through the backward; in the first
        # forward the others are _Sharded while they do not run, to see a parameter used out of its block
        for u in self.units:
            if u.index in self.kept:
                u.unshard()
            elif not self.checked:
                u.mark(True)
        self.begin_walk(self.forward_tables[min(s, n)])

    @torch.compiler.disable
    def exit(self, module, args, output):
        self.depth -= 1
        if self.depth:
            return
        self.free_loose()
        if self.walk is None:               # no forward began (enter() raised, or never ran)
            return
        self.advance(self.table.end)        # the places after the last one this rank called
        self.table = None
        self.walk = None
        # what no table freed (gathered outside one before the order was learned) goes; a forward no
        # backward follows (evaluation, generation) frees what a backward to come would need
        for u in self.units:
            if u.index not in self.kept:
                u.free(pending=True)
            elif not torch.is_grad_enabled():
                u.free(pending=bool(self.calls))
            if u.phase == WHOLE and not self.checked:
                u.mark(False)               # the first forward's marks go
        self.checked = True

    @torch.compiler.disable
    def pre_forward(self, u, module, args, kwargs):
        self.free_loose(keep=u)
        key = None                          # the call's node (None: called outside a forward)
        if self.walk is not None:
            key = (self.walk, self.count[u.index], u.index)
        self.count[u.index] += 1
        fp32 = self.plan.shards_params and self.plan.dtype == torch.float32
        if fp32 and torch.is_grad_enabled() and torch.is_autocast_enabled(self.plan.device.type):
            raise RuntimeError("zero: torch.autocast around a stage-3 forward in fp32 keeps a "
                               "16-bit copy of every weight it gathers until the backward (the "
                               "whole model): drop the autocast and use Config(dtype='bf16') "
                               "(16-bit compute on fp32 masters, as autocast's)")
        j = self.node.get(key)              # its place (None: none in the walk)
        if j is not None and self.point <= j - self.start < self.table.n:
            self.advance(j - self.start)
            u.unshard()
        elif key is None:                   # a block the script calls on its own, as all ranks do
            self.gather_loose(u)
        else:                               # out of turn: called more often, or its place passed
            self.alone(u, "called in a forward more often, or in another order,")
        u.mark(False)
        self.keys[u.index] = key
        self.ran.append(u.index)
        if not torch.is_grad_enabled():
            return
        if key is not None:
            self.calls.append(key)
        xs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if xs:                              # their backward ends this call's (_PostBackward)
            done = functools.partial(self.post_backward, u, key)
            ys = dict(zip(map(id, xs), _PostBackward.apply(done, *xs)))
            return _tree_map(lambda t: ys.get(id(t), t), (args, kwargs))

    @torch.compiler.disable
    def post_forward(self, u, module, args, kwargs, output):
        if not self.checked and not u.held:
            u.mark(True)                    # the first forward: used out of its forward later?
        if not torch.is_grad_enabled():
            return
        outs = _tensors(output)
        grad_out = any(t.requires_grad for t in outs)
        self.grad_out[u.index] = self.grad_out.get(u.index, False) or grad_out
        if not self.plan.shards_params:
            return
        inputs = {id(t) for t in _tensors((args, kwargs))}
        storages = {f.flat.untyped_storage().data_ptr() for f in u.flats}
        for t in outs:
            if t.untyped_storage().data_ptr() in storages:
                u.hold()                    # a parameter returned: its storage stays to its backward
            elif t.requires_grad and id(t) not in inputs:
                # gathered again just before this call's backward (and recompute); a tensor it only
                # passed along is not hooked: its gradient says nothing about this unit's backward
                t.register_hook(functools.partial(self.pre_backward, u, self.keys[u.index]))

    # -- backward hooks
    def begin_backward(self):
        # every rank calls backward (checked through the store after evaluation forwards); the
        # first learns the units' order
        self.net.call("backward", check=self.evals)
        self.evals = 0
        if not self.learned:
            self.learn()

    def start_backward(self):
        # the backward's walk from its start: the forward's last block is the first one back
        self.reduced = set()
        self.in_flight = collections.deque()
        self.in_backward = True
        self.begin_walk(self.backward_table)

    def stop_backward(self):
        self.in_backward = False

    def outside(self):
        if not self.in_backward:
            raise RuntimeError("zero: a backward ran outside engine.backward(loss) "
                               "(loss.backward(), or a GradScaler's): call engine.backward(loss), "
                               "then engine.step()")

    @torch.compiler.disable
    def pre_backward(self, u, key, grad):
        # a call's backward (or recompute) starts: u whole, the walk at its place
        self.post_backward(u, key, start=True)

    def post_backward(self, u, key, start=False):
        # a call's backward ends (start: begins): the walk past its place (to it); out of turn, u alone
        self.outside()
        k = self.bpos.get(self.node.get(key))   # its point in the backward's table
        if k is not None and k >= self.point and start:
            self.advance(k)
            u.unshard()
        elif k is not None and k >= self.point:
            self.advance(k + 1)
        elif start and key is None:
            self.gather_loose(u)
        elif start:
            self.alone(u, "backwarded more often, or in another order,")

    def on_grad(self, u, k, i, p):
        if p.grad is None:
            return
        if not self.in_backward or u.index in self.reduced:
            p.grad = None                   # nothing of it is kept for the next step
            self.outside()
            raise RuntimeError(f"zero: the gradient of '{u.trains[k].names[i]}' came after its "
                               f"unit '{u.name}' was reduced (a use outside its block the first "
                               "forward did not show, or another order of blocks): pass "
                               "zero.Zero(..., units=[...]) without its block")
        u.trains[k].take_grad(i, p)

    def end_backward(self):
        # what this rank's backward did not reach, in its turn; the kept units' reductions last
        self.advance(self.backward_table.end)
        self.table = None
        self.drain()
        self.loose = []
        for u in self.units:                # stage 3: what is whole goes (the kept, escaped units)
            u.free(pending=False)
        self.calls = []
        self.forwards = 0
        self.micro += 1


# -----------------------------------------------------------------------------
# 7. The engine
#
# A step: forward (stage 3 gathers each unit before it runs, frees it after) -> backward (a unit's
# gradient is reduced once its backward is done; stage 3 gathers it again first) -> step (norm,
# overflow check, clip, the update rules on the owned slice, its 16-bit rounding written, stages 1-2
# all-gather it). The units do each part, the schedule says when; the engine builds them and glues
# the hooks.

_ENGINES = weakref.WeakSet()  # every live engine: for the check of torch optimizers, and the exit


class Zero:
    """Wraps a model: shards it into units in place, hooks forward and backward, steps the update rules
    on this rank's shard. Call it like the model (it lends the model's attributes); backward(), step()."""

    def __init__(self, model, cfg=None, units=None, init_fn=None, param_groups=None, group=None,
                 optimizer=None):
        self.cfg = cfg = (cfg or Config()).validate()   # validated here, before any collective
        self.module = getattr(model, "_orig_mod", model)   # the model (compiled: the one inside)
        self._forward = model               # what a call runs: the model, compiled or not
        self.net = net = Comm(cfg, group)   # the process group's collectives, and their ledger
        self.plan = plan = Plan.of(cfg, net)   # what the stage shards, with the dtypes and devices
        self.rank = net.rank                # this process, in the group
        self.world = net.world              # the group's size
        self.device = net.device            # where the model computes
        self.dtype = plan.dtype             # the compute dtype
        self.scaler = LossScaler(cfg)       # fp16's dynamic loss scale
        self.step_count = 0                 # steps applied (an fp16 overflow skips one)
        self.grad_norm = 0.0                # the global gradient norm the ranks agreed on
        self.agreed = False                 # the ranks agreed on this step (clip_grad_norm_, step)
        self.clip = None                    # clip_grad_norm_'s max_norm, for this step only
        self.used = []                      # per trained parameter, whether any rank had a gradient
        self.worker = None                  # offload: the update thread, ended with the engine
        if cfg.offload:
            self.worker = HostWorker(self.device, cfg.timeout_s)
            weakref.finalize(self, self.worker.close)
        self.unfilled = set()               # names of meta tensors nothing initialized
        self.pinned = {}                    # offload on CUDA: kind -> [block, used, pinned]
        self.last_comm = {}                 # what the last step moved: comm()
        self.placed = {}                    # each buffer, by identity, to its copy on the device
        self.names = {id(m): n for n, m in self.module.named_modules()}   # each module's name
        # each parameter, by identity (a tied weight has several names), to the one unit holding it
        unit_modules = list(units) if units is not None else find_units(self.module)
        owner = {}                          # one in several units (a tied weight) goes to the root
        for i, m in enumerate(unit_modules):
            for p in m.parameters():
                if owner.setdefault(id(p), i) != i:
                    owner[id(p)] = -1
        named = list(self.module.named_parameters())   # each tensor once, under its first name
        if not any(p.requires_grad for _, p in named):
            raise ValueError("zero.Zero: the model has no trainable parameters "
                             "(requires_grad=True)")
        groups, group_of, views = _param_groups(self.module, cfg, param_groups, optimizer)
        members = [[] for _ in unit_modules] + [[]]    # the last: the root
        for n, p in named:
            members[owner.get(id(p), -1)].append((n, p))
        unit_of = {}                        # each module that is a unit, by identity, to its unit
        self.units = []                     # the blocks with parameters, then the root
        for m, ps in zip(unit_modules + [self.module], members):
            # trainable parameters in a flat buffer per update rule, frozen ones in their own (never
            # reduced), those that are not floats (a quantized base's int8) by their own dtype
            split = {}                      # (rule, dtype) -> [(name, parameter)]; None: frozen, ...
            for n, p in ps:
                rule = None
                if p.requires_grad:
                    rule = RULES[groups[group_of[id(p)]].get("update", "adamw")]
                dtype = None                # ... the compute dtype
                if not p.is_floating_point():
                    dtype = p.dtype
                split.setdefault((rule, dtype), []).append((n, p))
            flats = []
            for (rule, dtype), part in sorted(split.items(), key=lambda kv: kv[0][0] is None):
                sharded = plan.shards_params or (rule is not None and plan.shards_optim)
                part_groups = [group_of.get(id(p), 0) for _, p in part]
                part_views = None           # a matrix rule's: how each parameter is matrices
                if rule is not None and rule.matrices:
                    part_views = [views[id(p)] for _, p in part]
                flats.append(Flat(part, plan, rule, part_groups, sharded, dtype, part_views))
            if flats:                       # a block without parameters is no unit
                name = self.names.get(id(m)) or "root"
                u = Unit(len(self.units), m, name, flats, plan, net, self.worker, m is self.module)
                unit_of[id(m)] = u
                self.units.append(u)
        self.root = unit_of.get(id(self.module))   # the root's unit, or None
        self.trained = [u for u in self.units if u.trains]   # the units with trainable parameters
        self.matrix_steps = _matrix_steps(self.trained, plan, net)     # section 11: Muon's
        self.owned = {id(p) for u in self.units for p in u.params}   # every parameter, by identity
        self.sched = s = Schedule(self.units, plan, net)   # the one order of the collectives
        self.optimizer = ZeroOptimizer(self, groups, optimizer)   # torch's face of the rules
        self._check_ranks_agree()           # before the first collective that depends on the layout
        # one unit at a time: a meta model becomes real, then the unit is sharded and the rest
        # freed, so that no rank ever holds the whole model
        stop = {id(m) for m in unit_modules}
        rounded = []                        # frozen parameters the compute dtype changes
        for m in unit_modules + [self.module]:
            mods = list(_post_order(m, stop - {id(m)}))   # the root: every module outside the units
            if any(t.is_meta for x in mods for t in (*x.parameters(False), *x.buffers(False))):
                self.unfilled |= _materialize(mods, init_fn, self.device, self.names)   # section 13
            self._place_buffers(mods)
            if id(m) in unit_of:
                rounded += self._build(unit_of[id(m)])
        _warn_rounded(rounded, cfg.dtype)                # section 13
        # hooks: each trainable parameter's gradient (after autograd summed its uses); a forward
        # starts at the root's first module (`mods`), ends when it returns; each unit's forward.
        # Every k-th block recomputes non-reentrant (dropout's RNG kept) within the gathering hooks
        for u in self.units:
            for k, f in enumerate(u.trains):
                for i, p in enumerate(f.params):
                    hook = functools.partial(_on_grad, weakref.ref(s), u.index, k, i)
                    p.register_post_accumulate_grad_hook(hook)
        for m in mods:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(s.exit, always_call=True)
        k = int(cfg.checkpoint)             # True: 1; False: 0, none
        for j, u in enumerate(s.order):
            m = u.module
            m.register_forward_pre_hook(functools.partial(s.pre_forward, u), with_kwargs=True)
            m.register_forward_hook(functools.partial(s.post_forward, u), with_kwargs=True)
            if k and j % k == 0:
                m.forward = functools.partial(recompute, m.forward, use_reentrant=False)
        # the model's own state_dict would hold shards or stale 16-bit copies: the engine's instead
        self.module.state_dict = _refuse_state_dict
        self.module.load_state_dict = self.load_state_dict
        self.ledger_reset()
        _ENGINES.add(self)

    def _check_ranks_agree(self):
        # ranks that differ in config or model hang in mismatched collectives: say what differs
        c = self.cfg
        layout = ";".join(f"{u.index}:{n}:{tuple(p.shape)}:{f.group[i]}:{f.trainable}:{f.dtype}"
                          for u in self.units for f in u.flats
                          for i, (n, p) in enumerate(zip(f.names, f.params)))
        mine = dict(stage=c.stage, dtype=c.dtype, accum_steps=c.accum_steps, offload=c.offload,
                    units=len(self.units), params=sum(f.numel for u in self.units for f in u.flats),
                    layout=zlib.crc32(layout.encode()),
                    config=zlib.crc32(repr(dataclasses.asdict(c)).encode()))
        _, every = self.net.agree(mine, lambda: mine)   # what each rank has, only where they differ
        for r, row in enumerate(every or ()):
            diff = [f"{k}: rank 0 has {a}, rank {r} has {row[k]}"
                    for k, a in every[0].items() if a != row[k]]
            if diff:
                raise ValueError(f"zero.Zero: ranks disagree ({'; '.join(diff)}); launch every "
                                 "rank with the same model and the same zero.Config")

    def _place_buffers(self, mods):
        # the buffers of `mods`: whole on every rank, floats in the compute dtype, rank 0's values,
        # each once (a buffer shared by modules stays one tensor)
        for m in mods:
            for n, b in m.named_buffers(recurse=False):
                if id(b) not in self.placed:
                    dtype = self.dtype if b.is_floating_point() else b.dtype
                    new = b.to(self.device, dtype).contiguous()
                    self.net.broadcast(new)
                    self.placed[id(b)] = self.placed[id(new)] = new
                m._buffers[n] = self.placed[id(b)]

    def _state(self, kind, n, dtype=torch.float32, src=None):
        # shard state, zeros or src's copy. Offload on CUDA pins what crosses the bus each step
        # (PINNED; master and moments stay pageable), carved from one block per kind registered at
        # its size: torch's pinned allocator rounds up to a power of two (and cannot be swapped)
        if not (self.plan.pin and kind in PINNED):
            t = torch.empty(n, dtype=dtype, device=self.plan.host)
        else:
            if kind not in self.pinned:
                total = sum(f.hi - f.lo for u in self.units for f in u.trains)
                block, pinned = _pinned_block(total, dtype)
                if not pinned and all(ok for _, _, ok in self.pinned.values()):  # the first refusal
                    warnings.warn("zero: CUDA did not pin the offload's host buffers "
                                  "(cudaHostRegister refused; see ulimit -l): they stay pageable, "
                                  "their copies synchronous")
                self.pinned[kind] = [block, 0, pinned]
            block, used, _ = self.pinned[kind]
            t = block[used:used + n]
            self.pinned[kind][1] = used + n
        if src is None:
            return t.zero_()
        return t.copy_(src)

    def _build(self, u):
        # one flat buffer whole at a time, in fp32, with rank 0's values; returns the frozen
        # parameters whose values the compute dtype changes
        rounded = []
        for f in u.flats:
            full = torch.zeros(f.padded, dtype=_wide(f.dtype), device=self.device)
            for n, p, o in zip(f.names, f.params, f.offsets):
                full[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p._zero_name = n
                p._zero_owner = (weakref.ref(self.sched), u.index)
            self.net.broadcast(full)
            rounded += [n for n in f.build(full, self._state) if n not in self.unfilled]
            self.net.count_held(f.flat.untyped_storage().nbytes())
            del full
        u.free(pending=False)               # stage 3: the shards alone stay
        return rounded

    def __call__(self, *args, **kwargs):
        # float inputs in the compute dtype, as the parameters
        args, kwargs = _tree_map(lambda t: t.to(self.dtype) if t.is_floating_point() else t,
                                 (args, kwargs))
        return self._forward(*args, **kwargs)

    def _compiled(self, **kwargs):          # torch.compile(engine): the model inside it compiled
        self._forward = _torch_compile(self._forward, **kwargs)
        return self

    def __getattr__(self, name):
        # what a script asks of its model (generate(), config, parameters()) is the model's
        if name.startswith("__") or "module" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["module"], name)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @torch.compiler.disable
    def _enter(self, module, args):
        # a forward's first module: no forward runs on tensors that nothing initialized
        refuse = None
        if self.unfilled and not self.sched.depth:
            refuse = (f"zero: {sorted(self.unfilled)[:8]} were built on the meta device and nothing "
                      "initialized them: call engine.load_state_dict(sd), or pass init_fn=fn")
        self.sched.enter(refuse)

    def backward(self, loss):
        """Backward of this micro-batch's plain mean loss (the engine divides by accum_steps);
        returns when its gradients are reduced."""
        cfg = self.cfg
        s = self.sched
        if s.micro >= cfg.accum_steps:
            raise RuntimeError(f"zero: backward() called {s.micro + 1} times without step(); "
                               f"Config.accum_steps={cfg.accum_steps}")
        fn = getattr(loss, "grad_fn", None)     # DDP's habit, loss / accum_steps: section 12
        if cfg.accum_steps > 1 and fn is not None and fn.name() in ("DivBackward0", "MulBackward0"):
            _refuse_divided(fn, cfg.accum_steps)
        s.begin_backward()
        self.settle()                       # the last step's host update lands before new gradients
        s.start_backward()
        try:
            if self.scaler.enabled:         # fp16: scaled so small gradients survive in 16 bits
                loss = loss.float() * self.scaler.scale
            loss.backward()
        except torch.utils.checkpoint.CheckpointError as e:
            raise RuntimeError("zero: activation recompute replayed a different forward (see "
                               "above), as a key/value cache does: pass use_cache=False, or use the "
                               "model's own gradient_checkpointing_enable() and "
                               "Config(checkpoint=False)") from e
        finally:
            s.stop_backward()
        s.end_backward()

    def step(self):
        """The update rules on this rank's shard, the updated parameters back to every rank. Returns
        False when the gradients were not finite (fp16 overflow: the step is skipped)."""
        return self.optimizer.step()        # through the optimizer, which LR schedulers watch

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        # torch.nn.utils.clip_grad_norm_ of the engine's gradients (section 12): the global norm, and
        # the step clips at max_norm instead of Config.grad_clip
        norm = _clip_norm(self, norm_type, error_if_nonfinite)
        self.clip = float(max_norm)
        return norm

    def _agree(self):
        """The step up to the update, once (clip_grad_norm_ may run it first): one fp64 all-reduce
        (exact for these integers) agrees on the squared gradient norm (inf or nan: an overflow),
        the fingerprint of each rank's collectives and calls, the units held whole, the parameters
        with a gradient on any rank. Returns the global gradient norm."""
        if self.agreed:
            return self.grad_norm
        if self.sched.micro != self.cfg.accum_steps:
            raise RuntimeError(f"zero: step() after {self.sched.micro} backward() calls; "
                               f"Config.accum_steps={self.cfg.accum_steps} asks for exactly that many")
        late = [n for u in self.units for f in u.flats if not f.trainable
                for n, p in zip(f.names, f.params) if p.requires_grad]
        if late:
            raise RuntimeError(f"zero: {late} were frozen when zero.Zero wrapped the model and "
                               "require grad now; make them trainable before zero.Zero(model) (and "
                               "freeze them after)")
        self.net.call("step")
        trained = self.trained
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for u in trained:
            if u.replica is not None:       # hybrid: its sums across shard groups awaited
                u.replica.finish()
            for f in u.trains:
                sq += f.sq_norm()
        # a copy several hybrid replicas hold counts once: the others add 0 times theirs (nan if not
        # finite: an overflow anywhere skips everywhere); stage 0's ranks each add their own slice's
        sq *= float(self.net.replica == 0)
        flags = [u.held for u in self.units]
        flags += [i in f.got for u in trained for f in u.trains for i in range(len(f.params))]
        mine = (self.net.trace, self.sched.ran, dict(self.net.calls.counts))   # gathered if they differ
        # the flags go with the fingerprint in one host tensor; the norm stays on the device
        (*rest, global_sq), every = self.net.agree(self.net.trace, lambda: mine, flags, sq.view(1))
        held = rest[:len(self.units)]       # per unit: held whole on some rank
        for u in trained:                   # the next window starts a new accumulation
            for f in u.trains:
                f.new_window()
        if every is not None:
            _diverged(self, every)          # section 14: raises
        self.sched.agree_kept({u.index for u, h in zip(self.units, held) if h})
        self.used = rest[len(self.units):]  # per trained parameter: ranks that had a gradient
        # gradients of loss * scale, summed over ranks and micro-batches after a divide by divide[0]
        self.grad_norm = math.sqrt(global_sq) / (self.scaler.scale * self.plan.divide[1])
        self.agreed = True
        return self.grad_norm

    def _step(self):
        """optimizer.step(): the update rules with the agreed norm, or, where it is not finite, the
        skip."""
        norm = self._agree()
        self.agreed = False                 # the next step agrees anew
        clip = self.cfg.grad_clip           # clip_grad_norm_'s max_norm instead, for this step
        if self.clip is not None:
            clip = self.clip
        self.clip = None
        if not math.isfinite(norm):         # every rank sees the same norm: no rank steps alone
            self.scaler.adjust(overflow=True)
            self.ledger_reset()
            if self.scaler.enabled:
                return False
            raise FloatingPointError(
                f"zero: the gradient norm is {norm} at step {self.step_count + 1} in "
                f"{self.cfg.dtype}; nothing was updated: lower the lr, or check the inputs")
        # clip_grad_norm_'s rule; unscale and clip: one multiplier, applied inside the update
        mult = 1.0
        if clip > 0:
            mult = min(1.0, clip / (norm + 1e-6))
        mult /= self.scaler.scale * self.plan.divide[1]
        # the groups' values as they are now, each checked by its rule before anything changes (a
        # scheduler's bad value is named): a scheduler changes them once step() returns, before
        # offload's update runs. A parameter without a gradient on any rank is left untouched, its
        # step count too, as torch's optimizers leave it
        groups = [dict(g) for g in self.optimizer.param_groups]
        for j, g in enumerate(groups):
            _check_group("zero", j, g)
        self.step_count += 1
        self.scaler.adjust(overflow=False)
        self.sched.before_update()
        used = iter(self.used)              # per trained parameter, Flat by Flat
        trained = self.trained
        runs = {}                           # unit index -> each trainable Flat's calls
        for u in trained:
            runs[u.index] = [f.step_runs(list(itertools.islice(used, len(f.params))))
                             for f in u.trains]
        if self.cfg.offload:
            # the updates run on the worker behind the next forward, in its order; until that
            # gathers, the others' slices are last step's; the 16-bit slices go to the device
            for u in [self.root, *self.sched.order]:
                if u is None or not u.trains:
                    continue
                if self.plan.regathers:     # before it is queued: the worker may start at once
                    u.stale()
                u.start_update(mult, runs[u.index], groups)
                for f in u.trains:
                    self.net.ledger.count("h2d", f.hi - f.lo, f.flat.element_size())
        else:
            for u in trained:
                u.update(mult, runs[u.index], groups)
            for m in self.matrix_steps:     # the matrix rules: every unit's matrices at once
                m.step(groups, mult)
            if self.plan.regathers:
                _regather([u.stale() for u in trained])
        self.ledger_reset()
        return True

    def settle(self):
        """Offload: every unit's host update done and (stages 1-2) gathered: this step's state."""
        if self.worker is not None:
            for u in self.units:            # each wait bounded by Config.timeout_s
                u.wait_update()
            if self.plan.regathers:
                _regather(self.units)

    @property
    def lr(self):
        """The first group's lr; set, every group's."""
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        for g in self.optimizer.param_groups:   # a schedule set by hand: every group gets it
            g["lr"] = value

    def ledger_reset(self):
        """At the end of a step: what it moved, from the forward to the update, becomes comm()'s."""
        self.last_comm = self.net.new_step()
        self.sched.new_step()

    def comm(self):
        """What the last step moved, by kind: calls, elements and bytes; under "between_steps" (where
        there were any), what the calls between it and the step before (full_state_dict,
        load_state_dict, save, load) moved, by kind."""
        return self.last_comm

    @property
    def loss_scale(self):
        """fp16's dynamic loss scale (1.0 in bf16 and fp32)."""
        return self.scaler.scale

    @property
    def peak_gathered_bytes(self):
        """The most bytes of parameter buffers (in the compute dtype) this rank held at once."""
        return self.net.peak

    def _resume(self, step_count, steps):
        # the counters a load sets: the steps taken, each parameter's rule steps (by name)
        self.step_count = step_count
        for f in (f for u in self.units for f in u.flats):
            f.set_steps([steps.get(n, 0) for n in f.names])
        for m in self.matrix_steps:         # the owner state starts fresh (load() then reads it)
            m.load({})

    def _filled(self, names):
        # what a load filled no longer counts as uninitialized (None: everything)
        if names is None:
            names = set(self.unfilled)
        self.unfilled -= names

    # -- what the extensions add to the engine's face, each a call into its section
    def full_state_dict(self, rank0_only=False):       # section 13
        return _full_state_dict(self, rank0_only)

    def load_state_dict(self, state_dict, strict=True):     # section 13
        return _load_state_dict(self, state_dict, strict)

    def memory(self):                       # section 15
        return _memory(self)

    def pinned_memory(self):                # section 15
        return _pinned_memory(self)

    def num_params(self, padded=False, frozen=False):     # section 15
        return _num_params(self, padded, frozen)


def _wide(dtype):
    # what a value is exported and rebuilt in: fp32 for floats, its own dtype for the rest
    return torch.float32 if dtype.is_floating_point else dtype


def _post_order(module, stop):
    # module and its descendants, children first (as nn.Module.apply visits), not entering `stop`
    for child in module.children():
        if id(child) not in stop:
            yield from _post_order(child, stop)
    yield module


# -----------------------------------------------------------------------------
# 8. Offload: the host update's thread, its copies and pinned buffers

class Copies:
    """Offload's copies to the host and back, the one place with CUDA streams and events. On CUDA a
    gradient shard goes to the host on its own stream once the current stream's work so far (its
    reduction) is done; the host update waits for that unit's copy alone; the updated 16-bit slices
    come back on another, which the next forward's stream waits for. On a CPU: plain copies."""

    def __init__(self, device):
        cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if cuda else None     # gradient shards to the host
        self.h2d = torch.cuda.Stream(device) if cuda else None     # updated slices to the device

    def to_host(self, dst, src):
        # dst (pinned) <- src after the current stream's work so far; the event its readers wait for
        if self.d2h is None:
            dst.copy_(src)
            return None
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        # src is a slice of f.grad (dropped right after at stages 2-3) or of f.acc: its memory is
        # not handed out again before this stream's copy has read it
        src.record_stream(self.d2h)
        return self._event(self.d2h)

    def to_device(self, pairs):
        # each (dst, src) copied from the host; the event the device's next use of dst waits for
        if self.h2d is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.h2d):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return self._event(self.h2d)

    @staticmethod
    def _event(stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def sync(*events):                      # the host waits: a copy to it landed, one from it read
        for event in events:
            if event is not None:
                event.synchronize()

    @staticmethod
    def order(event):                       # the current stream's later work waits, not the host
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class HostWorker:
    """ZeRO-Offload's update thread: a one-thread executor of the units' host updates, in the order
    submitted, while the caller runs the next forward; each submit() returns the update's Future,
    which the unit awaits (bounded by timeout_s) before its next gather. At exit the updates queued
    end first, bounded too (a daemon thread killed inside a kernel aborts the process)."""

    def __init__(self, device, timeout_s):
        self.jobs = queue.SimpleQueue()     # (fn, Future) in order; None: the thread ends
        self.timeout = timeout_s            # seconds a wait (and the exit's join) may take
        self.copies = Copies(device)        # its units' copies to the host and back
        ready = threading.Event()           # its torch thread count set, the default put back
        self.thread = threading.Thread(target=self._run, args=(device, ready), daemon=True,
                                       name="zero-offload-adam")
        self.thread.start()
        ready.wait()

    def submit(self, fn):
        # the Future the unit keeps: its result, or the update's exception, at the unit's next wait
        future = Future()
        self.jobs.put((fn, future))
        return future

    def _run(self, device, ready):
        if device.type == "cuda":
            torch.cuda.set_device(device)   # the current GPU is per thread
        # torch's ops here (the update without the C kernel, Muon on the host) take the rank's cores, not
        # torch's count (1 under torchrun). With OpenMP the count is per thread once a thread has used it,
        # but a set is also the default that threads starting later take: a throwaway thread puts that
        # back while the caller waits (it may not have used its count yet)
        try:
            default = torch.get_num_threads()
            torch.set_num_threads(_host_threads())
            restore = threading.Thread(target=torch.set_num_threads, args=(default,))
            restore.start()
            restore.join()
        finally:
            ready.set()
        for fn, future in iter(self.jobs.get, None):
            try:
                future.set_result(fn())
            except BaseException as e:      # raised in the caller, at the unit's next wait
                future.set_exception(e)
            del fn, future                  # nothing of the engine held here between jobs

    def close(self):
        self.jobs.put(None)
        self.thread.join(self.timeout)

PINNED = {"grad_shard": "grads", "staging": "params"}   # offload's pinned state: its memory() kind


def _pinned_block(n, dtype):
    # n elements of host memory on pages of their own (an anonymous mapping: page-aligned, whole
    # pages, so no two blocks share a page, which CUDA would refuse to register twice), page-locked
    # with CUDA until the block is dropped. Returns the block and whether CUDA pinned it
    nbytes = n * dtype.itemsize
    if not nbytes:
        return torch.empty(0, dtype=dtype), True
    pages = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    block = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype)   # holds the map
    if not _host_register(block.data_ptr(), len(pages)):
        return block, False
    weakref.finalize(block, _host_unregister, block.data_ptr())
    return block, True


def _host_register(ptr, nbytes):
    # page-locks [ptr, ptr + nbytes) through torch's own binding: True if CUDA did. A refusal leaves
    # CUDA's last error set, and torch.cuda.cudart() binds no cudaGetLastError (torch 2.4-2.13):
    # torch's check after its next kernel launch would raise it there, so one launched here takes it
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0:
        return True
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device=torch.device("cuda", torch.cuda.current_device())).fill_(1)
    return False


def _host_unregister(ptr):
    torch.cuda.cudart().cudaHostUnregister(ptr)


# =============================================================================
# Part II: the extensions, a section each. Part I reaches each at one named seam
# =============================================================================


# -----------------------------------------------------------------------------
# 9. Rank-dependent orders: the blocks each rank called, merged into one order; a parameter used
# outside its block

def _merge(seqs, extra=()):
    """One order of the nodes (segment, occurrence, unit) of every rank's calls, consistent with
    each rank's; ties, and `extra` nodes nobody ran, by the node; where they clash, rank 0's."""
    nodes = list(dict.fromkeys([x for s in seqs for x in s] + list(extra)))
    after = {x: set() for x in nodes}       # the nodes some rank called right after x
    before = dict.fromkeys(nodes, 0)        # how many pairs end at x, not placed yet
    for a, b in {(a, b) for s in seqs for a, b in zip(s, s[1:])}:
        after[a].add(b)
        before[b] += 1
    ready = [x for x in nodes if not before[x]]
    heapq.heapify(ready)
    out = []
    while ready:
        out.append(heapq.heappop(ready))
        for b in after[out[-1]]:
            before[b] -= 1
            if not before[b]:
                heapq.heappush(ready, b)
    if len(out) != len(nodes):              # a cycle: the orders clash
        return list(dict.fromkeys(list(seqs[0]) + nodes))
    return out

# torch calls that read no values of a tensor
METADATA = {"__get__", "__set__", "requires_grad_", "size", "dim", "numel", "stride",
            "element_size", "is_contiguous", "is_floating_point", "register_hook",
            "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr", "storage_offset"}
_PLAIN = nn.Parameter.__torch_function__    # torch's dispatch, as for any nn.Parameter


class _Sharded(nn.Parameter):
    """A parameter's class while its unit is not WHOLE (first forward: not running). Read in a
    forward, it is used outside its block: its unit is gathered and kept whole; else, an error."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", "")   # a __get__'s property
        if name not in METADATA or prop == "data":      # the call reads values
            for t in _tensors((args, kwargs)):
                if type(t) is not _Sharded:
                    continue
                sched = t._zero_owner[0]()
                if sched is not None:       # (None: its engine was dropped: the plain tensor it is)
                    _read_outside(sched, sched.units[t._zero_owner[1]], t._zero_name)
        return _PLAIN(func, types, args, kwargs or {})


def _read_outside(sched, u, name):
    """A parameter of u read where u is not gathered (outside its block). In the first forward,
    which all ranks run alike, u is gathered and held whole from then on; later, gathering it
    here would be this rank's collective alone (a hang, or a wrong pairing): refused."""
    if sched.depth == 0:
        raise RuntimeError(f"zero: '{name}' was read outside the model's forward, where its "
                           "unit is not gathered: read weights from engine.full_state_dict()")
    if sched.checked:
        raise RuntimeError(f"zero: '{name}' was read outside its block '{u.name}' after the "
                           "first forward, which did not read it so: gathering it now would be "
                           "this rank's collective alone. Read it in every forward from the "
                           "first, or pass zero.Zero(..., units=[...]) without its block")
    u.hold()
    u.unshard().mark(False)


# -----------------------------------------------------------------------------
# 10. Hybrid sharding
#
# Config(shard_group=k): the model states are sharded over groups of k consecutive ranks (Comm's "shard"
# groups) and replicated across them; a reduced gradient shard is then summed across the shard groups
# (the "replica" group: the ranks holding the same shard) once per step, in its last backward.

class Replica:
    """A unit's sums across shard groups: each trainable Flat's reduced shard all-reduced in the replica
    group as its reduce-scatter lands (Unit.finish_reduce), awaited by the step (Zero._agree); offload
    then sends the sum to the host."""

    def __init__(self, unit):
        self.unit = unit                    # whose Flats it sums
        self.works = []                     # (flat, reduced shard, work) in flight

    def launch(self, f, dev):
        net = self.unit.net
        self.works.append((f, dev, net.all_reduce(dev, "replica", "replica_all_reduce", False,
                                                  self.unit.index)))

    def finish(self):
        for f, dev, work in self.works:
            self.unit.net.wait(work)
            if self.unit.plan.offload:
                self.unit.to_host(f, dev)
        self.works = []


# -----------------------------------------------------------------------------
# 11. Update rules beyond AdamW: Muon, and matrix rules

# An elementwise rule's one function, run by run on a Flat's owned slice; on the CPU a long run's compiled
# (op by op, torch's CPU kernels take 5-10x the C AdamW kernel's one pass; compiled, 1.1-1.4x)
MIN_COMPILED = 1 << 16      # elements: a shorter run takes less op by op than a compiled call's ~70 us
_compiled = []              # _run compiled for the CPU: [] untried, [fn], or [None] (it failed)


def _elementwise(f, runs, groups, mult, out):
    # the rule on each run (_run), with its states' slices, its group's values as they are now, its step count
    master = f.state["master"]
    for a, b, j, step in runs:
        state = {k: f.state[k][a:b] for k in f.rule.states}
        out_run = None
        if out is not None:
            out_run = out[a:b]
        args = (master[a:b], f.grad_shard[a:b], state, groups[j], step, mult, out_run)
        if not (master.is_cpu and b - a >= MIN_COMPILED and _compiled_run(f.rule, *args)):
            _run(f.rule.step, *args)


def _run(rule_step, master, grad, state, group, step, mult, out):
    # one run: the gradient in fp32 times the multiplier (a new tensor: the rule may write into it), the
    # rule's step, the new master into `out`
    grad = grad.float() * mult
    rule_step(master, grad, state, group, step)
    if out is not None:
        out.copy_(master)


def _compiled_run(rule, master, grad, state, group, step, mult, out):
    # _run compiled once (dynamic shapes), one pass over the run; the group's floats, the step and the
    # multiplier go in as 0-dim float64 tensors: a scheduler's new lr compiles nothing. False where it
    # cannot compile (no compiler, an older torch), after one warning: the caller runs it op by op
    if not _compiled:                       # (it keeps a graph for each rule, dtype and out it meets)
        _compiled.append(_torch_compile(_run, dynamic=True, backend=_hoisted))
    if _compiled[0] is None:
        return False
    numbers = {k: _number(group[k]) for k in rule.keys}
    try:
        _compiled[0](rule.step, master, grad, state, numbers, _number(float(step)), _number(mult), out)
    except Exception as e:                  # raised before anything ran: compiling is all or nothing
        _compiled[0] = None
        warnings.warn(f"zero: rule {rule.name!r} runs op by op, not compiled ({type(e).__name__}: {e})"[:300])
    return _compiled[0] is not None


def _number(value):
    # a float (a tuple's too) as a 0-dim float64 tensor: a compiled rule's input, not a constant of its code
    if isinstance(value, (tuple, list)):
        return type(value)(map(_number, value))
    if isinstance(value, float):
        return torch.scalar_tensor(value, dtype=torch.float64, device="cpu")
    return value


def _hoisted(gm, example_inputs):
    # torch.compile's backend for _run: inductor's CPU kernels compute 0-dim arithmetic (a bias correction's
    # pow) again for every vector of elements, 2x the time; that part of the graph is compiled apart.
    # (inductor's compile is torch's private path: a failure here falls back op by op, see _compiled_run)
    from torch._inductor import compile as inductor     # on first use: importing it takes a second
    from torch.fx.passes.split_module import split_module
    scalar = set()                          # the nodes of 0-dim values made of 0-dim values alone
    for node in gm.graph.nodes:
        if getattr(node.meta.get("example_value"), "dim", int)() == 0 and set(node.all_input_nodes) <= scalar:
            scalar.add(node)
    split = split_module(gm, None, lambda node: int(node not in scalar))
    for node in split.graph.nodes:          # each part inductor's, called by a function of ours (FX's code
        if node.op == "call_module":        # would call torch's by a path into torch)
            part = getattr(split, node.target)
            inputs = [n.meta["example_value"] for n in part.graph.nodes if n.op == "placeholder"]
            if list(part.graph.nodes)[-1].op != "output":   # (torch < 2.5: a part returning nothing)
                part.graph.output(())
                part.recompile()
            # compiled in its inputs' fake mode, not the caller's (torch 2.4's differ)
            with torch._guards.tracing(None):
                fn = inductor(part, inputs)
            node.op = "call_function"
            node.target = lambda *args, fn=fn: fn(*args)
    split.recompile()
    return split


def newton_schulz(g, steps=5):
    """muon.py's zeropower_via_newtonschulz5: the quintic iteration on g / ||g||_F in bf16, on the
    transpose where g has more rows than columns."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        m = x @ x.mT
        x = a * x + (b * m + c * m @ m) @ x
    if g.size(-2) > g.size(-1):
        x = x.mT
    return x


def _muon_before(master, grad, state, group, step, shape):
    # the momentum, and its Nesterov blend: what the owner orthogonalizes
    m = state["momentum_buffer"]
    m.lerp_(grad, 1 - group["momentum"])
    if group["nesterov"]:
        return grad.lerp_(m, group["momentum"])
    return m


def _muon_whole(matrix, state, group, step):
    u = newton_schulz(matrix, group["ns_steps"])
    u *= max(1, u.size(-2) / u.size(-1)) ** 0.5     # muon.py's: in bf16, as it returns
    return u


def decoupled_update(master, update, state, group, step, shape):
    """A matrix rule's `after` as Muon's: decoupled weight decay, then the update at -lr."""
    master.mul_(1 - group["lr"] * group["weight_decay"])
    master.add_(update, alpha=-group["lr"])


def _muon_defaults(cfg):
    return dict(lr=cfg.lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=cfg.weight_decay)


def _muon_check(g):
    steps = g["ns_steps"]
    if not (0 <= g["momentum"] < 1 and isinstance(steps, int) and steps >= 1):
        return (f"sets momentum={g['momentum']}, ns_steps={steps}: use a momentum in [0, 1) and "
                "ns_steps >= 1")
    return _nonnegative(g, ("lr", "weight_decay"))

RULES["muon"] = Rule("muon", ("momentum_buffer",), ("lr", "momentum", "nesterov", "ns_steps", "weight_decay"),
                     _muon_defaults, _muon_check, whole=_muon_whole, before=_muon_before,
                     after=decoupled_update, sends=(torch.bfloat16, torch.bfloat16), offload=False)

# One matrix of a matrix rule: parameter i of `flat`, laid out as `shape` from element `start` of its
# buffer (transposed: the matrix the rule sees is its transpose, as an (in, out) layout asks); `name`
# keys its owner state in a checkpoint
Matrix = collections.namedtuple("Matrix", "flat i start shape transposed name")


def _matrices(f, views):
    # Flat f's matrices, in order: each parameter's view (matrices, rows, cols, transposed) as laid out
    # (_param_groups), one Matrix per matrix of it (an expert tensor's one per expert)
    out = []
    for i, (count, rows, cols, transposed) in enumerate(views):
        if rows * cols == 0:                # a parameter of no elements: no matrix
            continue
        for e in range(count):
            name = f.names[i]
            if count > 1:
                name = f"{name}[{e}]"
            out.append(Matrix(f, i, f.offsets[i] + e * rows * cols, (rows, cols), transposed, name))
    return out


def ns_cost(rows, cols):
    """A Newton-Schulz iteration's multiply-adds on a rows x cols matrix, m the smaller side and n the
    larger: X Xᵀ (m·m·n), its square (m³), that times X (m·m·n)."""
    m = min(rows, cols)
    return m * m * (2 * max(rows, cols) + m)


def assign_matrices(costs, ranks):
    """Each matrix (by its cost) to one of `ranks`, the largest first, each to the rank with the least
    work so far (LPT: within 4/3 of the best balance); ties go to the lower rank, the same everywhere."""
    loads = [(0, r) for r in range(ranks)]      # a heap of (work so far, rank)
    owners = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        least = heapq.heappop(loads)
        owners[k] = least[1]
        heapq.heappush(loads, (least[0] + costs[k], least[1]))
    return owners


def _oriented(m):
    # the (rows, cols) a rule sees of matrix m
    if m.transposed:
        return m.shape[::-1]
    return m.shape


def _matrix_steps(units, plan, net):
    # each matrix rule's step over the whole model: its matrices, all units', assigned to the shard ranks
    by_rule = {}                            # rule name -> its Flats, in unit order
    for f in (f for u in units for f in u.trains if f.rule.matrices):
        by_rule.setdefault(f.rule.name, []).append(f)
    return [MatrixStep(fs[0].rule, fs, plan, net) for fs in by_rule.values()]


class MatrixStep:
    """A matrix rule's step over the whole model, once a step. Each matrix is owned by one rank of the
    shard group (assign_matrices over all the model's matrices, by Newton-Schulz cost), which keeps its
    owner state and runs the rule's `whole` on it. Every rank runs `before` on its slices of the
    matrices; one all-to-all sends each owner its pieces (in the rule's dtype: bf16); the owners run
    `whole`; one all-to-all sends each rank its pieces of the updates; every rank runs `after`. A rank
    of N with a slice of S matrix elements sends (2 + 4) bytes x S x (N - 1)/N or so (Muon: 2 + 2),
    waits for no unit's slowest rank, and holds its slices and the matrices it owns. Stage 0 (and one
    rank): every matrix is whole in the rank's slice; each rank steps all of them, one at a time, as it
    runs AdamW on the whole model (no exchange; the owner state on every rank, as all of stage 0's)."""

    def __init__(self, rule, flats, plan, net):
        self.rule = rule
        self.plan = plan
        self.net = net                      # the shard group's all-to-all, counted in the ledger
        self.matrices = [m for f in flats for m in f.matrices]  # the model's, one order on every rank
        self.owner = assign_matrices([ns_cost(*m.shape) for m in self.matrices], plan.shards)
        self.exchange = plan.shards_optim and plan.shards > 1   # else every matrix is this rank's
        me = plan.shard_rank
        self.send_splits = [0] * plan.shards    # elements this rank sends each rank ...
        self.recv_splits = [0] * plan.shards    # ... and gets from each
        pieces = []                         # (k, a, b, owner, offset in what goes to it)
        parts = {}                          # k -> [(source rank, offset in what comes from it, n)]
        for k, m in enumerate(self.matrices):
            f = m.flat
            end = m.start + m.shape[0] * m.shape[1]
            owner = me
            bounds = [(me, m.start, end)]   # (rank, a, b): the matrix's [a, b) in that rank's slice
            if self.exchange:
                owner = self.owner[k]
                size = f.hi - f.lo          # each rank's slice of the buffer
                ranks = range(m.start // size, (end - 1) // size + 1)
                bounds = [(r, max(m.start, r * size), min(end, r * size + size)) for r in ranks]
            for r, a, b in bounds:
                if r == me:                 # this rank's piece, to the owner
                    pieces.append((k, a - f.lo, b - f.lo, owner, self.send_splits[owner]))
                    self.send_splits[owner] += b - a
                if owner == me:             # the owner's, from rank r
                    parts.setdefault(k, []).append((r, self.recv_splits[r], b - a))
                    self.recv_splits[r] += b - a
        sent = [0, *itertools.accumulate(self.send_splits)]     # where each rank's part starts
        got = [0, *itertools.accumulate(self.recv_splits)]
        self.pieces = [(k, a, b, sent[r] + at) for k, a, b, r, at in pieces]   # (k, a, b, offset)
        self.parts = {k: [(got[r] + at, n) for r, at, n in ps] for k, ps in parts.items()}
        self.owned = {}                     # k -> the owner state of each matrix this rank steps
        for k in self.parts:
            shapes = {}
            if rule.owner_states is not None:
                shapes = rule.owner_states(*_oriented(self.matrices[k]))
            self.owned[k] = {n: torch.zeros(s, device=plan.device) for n, s in shapes.items()}

    def step(self, groups, mult):
        """The rule on every matrix with a gradient, with the groups' values as they are now and the
        step's multiplier (unscale, clip). A matrix no rank had a gradient for is left alone, its state
        too, as torch's optimizers leave a parameter whose .grad is None."""
        rule = self.rule
        pieces = [(k, a, b, at) for k, a, b, at in self.pieces if self._used(k)]
        if not self.exchange:               # each matrix whole here: one at a time, nothing in flight
            for k, a, b, _ in pieces:
                sent = self._before(k, a, b, groups, mult).to(rule.sends[0], copy=True)
                update = self._whole(k, sent, groups)
                self._after(k, a, b, update.to(rule.sends[1]), groups)
            return
        send = torch.zeros(sum(self.send_splits), dtype=rule.sends[0], device=self.plan.device)
        for k, a, b, at in pieces:
            send[at:at + b - a] = self._before(k, a, b, groups, mult)
        recv = torch.empty(sum(self.recv_splits), dtype=send.dtype, device=send.device)
        work = self.net.all_to_all(recv, send, self.recv_splits, self.send_splits, "matrix_to_owners")
        self.net.wait(work)
        updates = torch.zeros(len(recv), dtype=rule.sends[1], device=recv.device)
        for k, parts in self.parts.items():
            if not self._used(k):
                continue
            update = self._whole(k, torch.cat([recv[at:at + n] for at, n in parts]), groups)
            # back where each piece came from
            for (at, n), piece in zip(parts, update.split([n for _, n in parts])):
                updates[at:at + n] = piece
        back = torch.empty(len(send), dtype=updates.dtype, device=send.device)
        work = self.net.all_to_all(back, updates, self.send_splits, self.recv_splits, "matrix_from_owners")
        self.net.wait(work)
        for k, a, b, at in pieces:
            self._after(k, a, b, back[at:at + b - a], groups)

    def _used(self, k):                     # a gradient came for matrix k on some rank this step
        m = self.matrices[k]
        return m.flat.used[m.i]

    def _before(self, k, a, b, groups, mult):
        # what this rank sends the owner of matrix k from its piece [a, b): the gradient (a new tensor:
        # the rule may write into it), or what the rule's `before` makes of it
        grad = self.matrices[k].flat.grad_shard[a:b].float() * mult
        if self.rule.before is None:
            return grad
        return self._on_slices(self.rule.before, k, a, b, grad, groups)

    def _whole(self, k, x, groups):
        # the rule's `whole` on matrix k from its elements as laid out; its update, flat, as laid out
        m = self.matrices[k]
        x = x.view(m.shape)
        if m.transposed:
            x = x.mT
        update = self.rule.whole(x, self.owned[k], groups[m.flat.group[m.i]], m.flat.steps[m.i])
        if m.transposed:
            update = update.mT
        return update.reshape(-1)

    def _after(self, k, a, b, update, groups):
        # the rule's `after` on this rank's piece [a, b) of matrix k, then the 16-bit copy written
        f = self.matrices[k].flat
        self._on_slices(self.rule.after, k, a, b, update.float(), groups)
        if f.out is not None:
            f.out[a:b].copy_(f.state["master"][a:b])

    def _on_slices(self, part, k, a, b, x, groups):
        # `before` or `after` on the piece [a, b) of matrix k: its master's and states' slices, the
        # gradient or the update (x), its group, its step count and the (rows, cols) the rule sees
        m = self.matrices[k]
        f = m.flat
        state = {n: f.state[n][a:b] for n in self.rule.states}
        return part(f.state["master"][a:b], x, state, groups[f.group[m.i]], f.steps[m.i], _oriented(m))

    def held(self):                         # the owner state's tensors (memory() counts them)
        return [t for state in self.owned.values() for t in state.values()]

    def files(self):
        # which rank's checkpoint file holds each matrix's owner state: its owner's in shard group 0
        if self.rule.owner_states is None:
            return {}
        return {m.name: self.owner[k] for k, m in enumerate(self.matrices)}

    def to_save(self):
        # this rank's owner states by matrix name, for its checkpoint file (stage 0: of the matrices
        # assigned to it, of which every rank holds a copy)
        me = self.plan.shard_rank
        return {self.matrices[k].name: {n: t.cpu() for n, t in state.items()}
                for k, state in self.owned.items() if state and self.owner[k] == me}

    def read(self, files):
        """The owner state of each matrix this rank steps, by name, from the checkpoint file its saver
        wrote it in (at any world size: a matrix's state goes to its new owner)."""
        where = files.meta.get("matrices", {})
        out = {}
        for k, state in self.owned.items():
            name = self.matrices[k].name
            if not state:
                continue
            saved = {}
            if name in where:
                saved = files.get(where[name], "matrices", name)   # checked as read
            shapes = {n: list(t.shape) for n, t in saved.items()}
            if shapes != {n: list(t.shape) for n, t in state.items()}:
                raise ValueError(f"zero: the checkpoint's {self.rule.name} state of '{name}' is "
                                 f"{shapes or 'missing'}, the engine's {list(state)} of "
                                 f"{_oriented(self.matrices[k])}: load it with the view it was saved with")
            out[k] = saved
        return out

    def load(self, saved):
        # each owned matrix's state from read()'s, or fresh (load_state_dict: the rules start again)
        for k, state in self.owned.items():
            for n, t in state.items():
                if k in saved:
                    t.copy_(saved[k][n])
                else:
                    t.zero_()

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _module_views(model):
    """Which parameters are matrices, as their modules say: id(p) -> ((matrices, rows, cols, transposed)
    as laid out, whether a matrix rule takes it by default). An nn.Linear's weight is (out, in); a
    convolution's filters (out, in·∏k); nn.MultiheadAttention's input projections a matrix; Hugging
    Face's Conv1D (GPT-2) weight (in, out), transposed; a tensor of >= 3 dims of no convolution a batch
    of matrices over its leading dims (stacked experts). Not by default: the embeddings, the head (the
    last nn.Linear) and what is tied to them, a tensor whose leading dim is 1 (ViT's pos_embed and
    cls_token), 2-dim tensors that are no module's weight (gpt-oss's expert biases, Mamba's A_log)."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    skip.update(id(m.weight) for m in linears[-1:])     # the head
    out = {}
    for m in model.modules():
        for n, p in m.named_parameters(recurse=False):
            shape = p.shape
            if id(p) in out or p.dim() < 2:
                continue
            weight = n == "weight" or isinstance(m, nn.MultiheadAttention) and n.endswith("proj_weight")
            view = (math.prod(shape[:-2]), shape[-2], shape[-1], False)   # a batch, or one matrix
            default = (p.dim() >= 3 and shape[0] != 1) or (p.dim() == 2 and weight)
            if isinstance(m, CONVS) and n == "weight":
                view = (1, shape[0], p.numel() // shape[0], False)
                default = True
            elif type(m).__name__ == "Conv1D" and n == "weight":   # transformers' (in, out) Linear
                view = (1, shape[0], shape[1], True)
            out[id(p)] = (view, default and id(p) not in skip)
    return out


def _matrix_view(j, g, p, module_view, name, rule):
    """How a matrix rule's parameter is matrices: (matrices, rows, cols, transposed) as laid out. Its
    group's "view" ("matrix": (dim 0, the rest); "batch": a batch over the leading dims; a shape of its
    elements, its last two the matrix), else its module's (_module_views), else a batch (2 dims: one);
    "transposed": True for an (in, out) layout."""
    view = g.get("view")
    shape = list(p.shape)
    out = None
    if view is None and module_view is not None:
        out = module_view[0]
    elif view in (None, "batch") and len(shape) >= 2:
        out = (math.prod(shape[:-2]), shape[-2], shape[-1], False)
    elif view == "matrix" and len(shape) >= 2:
        out = (1, shape[0], p.numel() // shape[0], False)
    elif isinstance(view, (tuple, list)) and len(view) >= 2 and math.prod(view) == p.numel():
        out = (math.prod(view[:-2]), view[-2], view[-1], False)
    if out is None and view is None:
        raise ValueError(f"zero.Zero: param_groups[{j}] is {rule.name}'s, which steps matrices, but "
                         f"holds ['{name}'] of fewer than 2 dims: give them an AdamW group")
    if out is None:
        raise ValueError(f"zero.Zero: param_groups[{j}] sets view={view!r}, which does not fit "
                         f"'{name}' of shape {shape}: use 'matrix', 'batch' or a shape of "
                         f"{p.numel()} elements")
    transposed = g.get("transposed", out[3])
    if not isinstance(transposed, bool):
        raise ValueError(f"zero.Zero: param_groups[{j}] sets transposed={transposed!r}: use True "
                         "for an (in, out) layout, else False")
    return (*out[:3], transposed)


# -----------------------------------------------------------------------------
# 12. Parameter groups, adopting a torch optimizer, and torch's patches

# torch's Adam/AdamW keys that zero's AdamW honours at these values only (TORCH_ANY: at any value)
TORCH_DEFAULTS = dict(amsgrad=False, maximize=False, capturable=False, differentiable=False)
TORCH_ANY = {"foreach", "fused", "decoupled_weight_decay", "initial_lr"}
_torch_clip, _torch_compile = torch.nn.utils.clip_grad_norm_, torch.compile   # before our patches


def _param_groups(model, cfg, param_groups, optimizer):
    """torch's param groups over the model's trainable parameters, checked: each parameter in one
    group, each group with the keys of its rule (its "update": RULES), the rest from Config, and its
    values as the rule checks them; then groups of Config's rule for the parameters in none. Made
    from param_groups, or shared with a torch Adam/AdamW (its schedulers then drive the engine).
    Returns the groups, each parameter's group, and each matrix rule parameter's view (_matrix_view),
    by identity."""
    adopt = optimizer is not None
    if adopt and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"zero.Zero: optimizer={type(optimizer).__name__}; zero steps AdamW: "
                         "pass a torch.optim.AdamW (or Adam), or none")
    if adopt and cfg.update != "adamw":
        raise ValueError(f"zero.Zero: update={cfg.update!r} with optimizer=: a torch Adam/AdamW's "
                         f"groups leave nothing to {cfg.update}; pass param_groups with 'update': "
                         f"{cfg.update!r}, or no optimizer")
    name = {id(p): n for n, p in model.named_parameters()}
    groups = list(param_groups or [])       # ours to edit
    if adopt:
        groups = optimizer.param_groups     # the same dicts: a change to either is the other's
    if groups and not isinstance(groups[0], dict):   # a list of tensors: one group
        groups = [dict(params=groups)]
    group_of = {}                           # each listed parameter, by identity, to its group
    for j, g in enumerate(groups):
        rule = RULES.get(g.get("update", "adamw"))
        if rule is None:
            raise ValueError(f"zero.Zero: param_groups[{j}] has update={g['update']!r}; use one "
                             f"of {list(RULES)}")
        keys = list(rule.keys)
        if rule.matrices:                   # its group may say how its tensors are matrices
            keys += ["view", "transposed"]
        unknown = sorted(set(g) - {"params", "update", *keys, *TORCH_DEFAULTS, *TORCH_ANY})
        if unknown:
            raise ValueError(f"zero.Zero: param_groups[{j}] has unknown keys {unknown}; zero's "
                             f"{rule.name} takes {['params', *keys]} (other keys at torch's "
                             "defaults)")
        bad = [f"{k}={g[k]}" for k, v in TORCH_DEFAULTS.items() if g.get(k, v) != v]
        adam_l2 = type(optimizer) is torch.optim.Adam and not g.get("decoupled_weight_decay")
        if adam_l2 and g["weight_decay"]:
            bad.append(f"weight_decay={g['weight_decay']} as Adam's L2 penalty")
        if bad:
            raise ValueError(f"zero.Zero: param_groups[{j}] sets {bad}, which zero's AdamW "
                             "cannot do (other keys at torch's defaults)")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            # an adopted optimizer may hold frozen parameters: they get no gradient
            if id(p) not in name or not p.requires_grad and not adopt:
                what = f"a tensor of shape {tuple(p.shape)} that is not a parameter of the model"
                if id(p) in name:
                    what = f"'{name[id(p)]}', which does not require grad"
                raise ValueError(f"zero.Zero: param_groups[{j}] holds {what}; "
                                 "list trainable parameters")
            if group_of.setdefault(id(p), j) != j:
                raise ValueError(f"zero.Zero: '{name[id(p)]}' is in param_groups "
                                 f"{group_of[id(p)]} and {j}")
        if not adopt:                       # torch's copy: each parameter once
            groups[j] = dict(g, params=list(dict.fromkeys(ps)))
        for k, v in rule.defaults(cfg).items():
            groups[j].setdefault(k, v)
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in group_of]
    if adopt and rest:
        names = [name[id(p)] for p in rest[:5]]
        raise ValueError(f"zero.Zero: {names} require grad but are in no param group of the "
                         "optimizer; add them to it, or freeze them before zero.Zero")
    # parameters in no group: Config's rule with Config's values, weight decay on >= 2-D ones only; a
    # matrix rule on the matrices _module_views takes by default, AdamW at adamw_lr on the rest
    main = RULES[cfg.update]
    module_views = {}                       # (asked of the modules for a matrix rule only)
    if main.matrices or any(RULES[g.get("update", "adamw")].matrices for g in groups):
        module_views = _module_views(model)
    elementwise = main                      # the rule of the rest
    matrices = dict(params=[], update=main.name, **main.defaults(cfg))
    if main.matrices:
        matrices["params"] = [p for p in rest if module_views.get(id(p), (None, False))[1]]
        rest = [p for p in rest if not module_views.get(id(p), (None, False))[1]]
        elementwise = RULES["adamw"]
    decayed = dict(params=[p for p in rest if p.dim() >= 2], **elementwise.defaults(cfg))
    if elementwise.name != "adamw":         # (AdamW's groups need no "update")
        decayed["update"] = elementwise.name
    not_decayed = dict(decayed, params=[p for p in rest if p.dim() < 2])
    if "weight_decay" in not_decayed:
        not_decayed["weight_decay"] = 0.0
    for g in (matrices, decayed, not_decayed):
        if g["params"]:
            groups.append(g)
            group_of.update(dict.fromkeys(map(id, g["params"]), len(groups) - 1))
    views = {}                              # id(p) -> its view, for a matrix rule's parameters
    for j, g in enumerate(groups):
        rule = RULES[g.get("update", "adamw")]
        if cfg.offload and not rule.offload:
            raise ValueError(f"zero.Zero: {rule.name!r} with offload=True: that rule runs on the "
                             "device only; use offload=False, or another update rule")
        _check_group("zero.Zero", j, g)
        if rule.matrices:
            for p in g["params"]:
                views[id(p)] = _matrix_view(j, g, p, module_views.get(id(p)), name[id(p)], rule)
    return groups, group_of, views


class ZeroOptimizer(torch.optim.Optimizer):
    """torch's face of the engine's update rules: the param_groups that LR schedulers and user code
    write, which every step reads (_param_groups made them); step() is engine.step(). An adopted
    torch Adam/AdamW shares the groups, and its step() becomes the engine's."""

    def __init__(self, engine, groups, optimizer=None):
        self.engine = engine                # whose step this step() is
        super().__init__(groups, {})        # torch would give every group these: each has its rule's keys
        self.defaults = RULES["adamw"].defaults(engine.cfg)   # what torch's cyclic schedulers look for
        if optimizer is not None:           # the script's optimizer, now driven by the engine
            def step(closure=None):
                optimizer._opt_called = True    # what torch's LR schedulers look for
                return engine.step()
            step._wrapped_by_lr_sched = True
            optimizer.step = step
            optimizer.zero_grad = self.zero_grad
            optimizer.state_dict = optimizer.load_state_dict = self.state_dict

    def step(self, closure=None):
        return self.engine._step()

    def zero_grad(self, set_to_none=True):
        """Nothing to do: the engine moves each gradient into its flat buffer as it arrives."""

    def state_dict(self, *args, **kwargs):
        raise RuntimeError("zero: the optimizer's state is in the engine's shards: "
                           "use zero.save/zero.load")

    load_state_dict = state_dict


def _refuse_divided(fn, accum):
    # DDP's habit, loss / accum_steps (fn: the loss's grad_fn, a divide or a multiply), would divide
    # twice (engine.backward divides): refused by name; (a + b) / 2 is two halves' mean
    if "Add" in str(fn.next_functions[0][0]):
        return
    d = getattr(fn, "_saved_other", None)
    one = isinstance(d, torch.Tensor) and d.numel() == 1 and d.device.type == "cpu"
    if one and fn.name() == "MulBackward0":
        d = 1 / d                           # loss * (1 / accum_steps)
    if one and math.isclose(d.item(), accum, rel_tol=1e-6):
        raise ValueError(f"zero: the loss is divided by accum_steps={accum}: pass the plain mean "
                         "loss; engine.backward divides by accum_steps itself")


def _foreign_step(opt, args, kwargs):
    # a torch optimizer's step of an engine's parameters changes nothing: the engine has the grads
    ps = (p for g in opt.param_groups for p in g["params"])   # read only if opt is not the engine's
    if not isinstance(opt, ZeroOptimizer) and any(id(p) in e.owned for p in ps for e in _ENGINES):
        raise RuntimeError(f"zero: a torch.optim.{type(opt).__name__} is stepping parameters "
                           "zero.Zero owns, which changes nothing: pass it as "
                           "zero.Zero(model, cfg, optimizer=opt)")


@functools.wraps(_torch_clip)
def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    # DDP's clip of the engine's parameters, whose gradients are in its shards: the engine's clip
    ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = next((e for e in _ENGINES for p in ps[:1] if id(p) in e.owned), None)
    if owner is None:
        return _torch_clip(ps, max_norm, norm_type, error_if_nonfinite, foreach)
    trainable = {id(p) for u in owner.units for f in u.trains for p in f.params}
    if {id(p) for p in ps if p.requires_grad} != trainable:
        raise ValueError("zero: clip_grad_norm_ takes all the engine's parameters: "
                         "pass model.parameters()")
    return owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


def _clip_norm(engine, norm_type, error_if_nonfinite):
    """torch.nn.utils.clip_grad_norm_ of an engine's gradients (torch's, given them, calls it), between
    the last backward and step(): the global norm of the unscaled mean gradient (the step's agreement,
    run early), as a tensor; the engine's step then clips at the max_norm it was given."""
    if float(norm_type) != 2.0:
        raise ValueError(f"zero: clip_grad_norm_(norm_type={norm_type}): zero clips the L2 norm; use 2.0")
    norm = engine._agree()
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"zero: the total norm of the gradients is {norm} (error_if_nonfinite=True)")
    return torch.tensor(norm)


def _compile(model=None, **kwargs):
    # torch.compile(engine) compiles the model inside it (as if before wrapping), returns the engine
    if isinstance(model, Zero):
        return model._compiled(**kwargs)
    return _torch_compile(model, **kwargs)  # (model=None: torch's decorator form)

register_optimizer_step_pre_hook(_foreign_step)
torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_
torch.compile = functools.wraps(_torch_compile)(_compile)


# -----------------------------------------------------------------------------
# 13. The meta-device build and the state dicts

LoadResult = collections.namedtuple("LoadResult", "missing_keys unexpected_keys wrong_shapes")


def _mismatch(what, missing, unexpected, shapes):
    # one error for all that does not fit: the names either side lacks, the shapes that differ
    parts = [f"{k} {v}" for k, v in (("missing", missing), ("unexpected", unexpected),
                                     ("shapes differ:", shapes)) if v]
    if parts:
        raise ValueError(f"zero: {what} " + "; ".join(parts))


def _model_state(model):
    # the model's own state_dict (its `state_dict` attribute is the engine's refusal after wrapping)
    return nn.Module.state_dict(model, keep_vars=True)


def _aliases(model):
    # every name of each parameter: a tied weight is one tensor under several state_dict keys
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def _materialize(mods, init_fn, device, names):
    """Meta tensors of `mods` made real on `device` (same objects: ties hold), then init_fn(m) or
    reset_parameters(). Returns the names (`names`: each module's) of those nothing wrote: a forward
    is refused until load_state_dict fills them."""
    def marker(t):                      # a value no initializer writes (a bool tensor has none)
        if t.is_floating_point() or t.is_complex():
            return float("nan")
        if t.dtype == torch.bool:
            return 0
        return torch.iinfo(t.dtype).min
    made = []
    for m in mods:
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.is_meta:               # (a tied tensor made real already is not)
                new = torch.full_like(t, marker(t), device=device)
                if isinstance(t, nn.Parameter):
                    new = nn.Parameter(new, t.requires_grad)
                torch.utils.swap_tensors(t, new)
                made.append((m, n))
    # init_fn sees every module (it may fill a module's own tensors), reset_parameters() only
    # the modules with a made tensor, as it would overwrite real ones
    with torch.no_grad():
        if init_fn is None:
            for m in dict.fromkeys(m for m, _ in made):
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        elif made:
            for m in mods:
                init_fn(m)
    unfilled = set()
    for m, n in made:                   # a marker left: nothing initialized the tensor
        t = getattr(m, n)
        if t.is_floating_point() or t.is_complex():
            left = t.isnan().any()
        else:
            left = t.dtype != torch.bool and (t == marker(t)).all()
        if left:
            prefix = names.get(id(m), "")
            unfilled.add(f"{prefix}.{n}" if prefix else n)
    return unfilled


def _warn_rounded(names, dtype):
    # once per build or load: a frozen base that the compute dtype rounds is not the one given
    if names:
        warnings.warn(f"zero: frozen parameters {names[:8]}{' ...' * (len(names) > 8)} change "
                      f"when rounded to {dtype}, in which zero holds them; "
                      "Config(frozen_dtype='fp32') keeps them exact")


def _full_state_dict(engine, rank0_only=False):
    """The whole model as a plain fp32 state_dict of CPU tensors (every rank calls it), gathered
    and moved to the CPU a flat buffer at a time. rank0_only=True: the others get {}."""
    engine.net.call("full_state_dict")
    engine.settle()
    returns = not rank0_only or engine.rank == 0   # this rank gets the values
    values = {}                         # id(parameter) -> its value on the CPU
    for f in (f for u in engine.units for f in u.flats):
        full = f.state["master"].to(engine.device, _wide(f.dtype))   # fp32 master, or as held
        if f.hi - f.lo < f.padded:      # sharded (at stage 0, and frozen at 0-2, it is whole)
            mine, full = full, torch.empty(f.padded, dtype=full.dtype, device=engine.device)
            engine.net.all_gather(full, mine, kind="state_dict")   # not training traffic
        for p, o in zip(f.params, f.offsets):
            if returns:                 # (rank0_only: the others only gather)
                values[id(p)] = full[o:o + p.numel()].view(p.shape).to("cpu", copy=True)
        del full
    if not returns:
        return {}
    out = {}                            # the model's own keys: tied names, buffers
    for k, t in _model_state(engine.module).items():
        out[k] = values.get(id(t))
        if out[k] is None:              # not a parameter: a buffer
            out[k] = t.detach().to("cpu", _wide(t.dtype), copy=True)
    return out


def _load_state_dict(engine, state_dict, strict=True):
    """Weights from a plain state_dict (model.state_dict() names, tied aliases too) into every
    copy the engine keeps, each rank reading only its slices; Adam starts fresh. Missing,
    unexpected and wrongly shaped entries are one error (strict=False: skipped, returned)."""
    engine.net.call("load_state_dict")
    engine.settle()
    want = _model_state(engine.module)
    aliases = _aliases(engine.module)
    # each parameter is read under the first of its names that the state_dict has
    slot = {id(p): next((a for a in aliases[id(p)] if a in state_dict), None)
            for u in engine.units for p in u.params}
    missing = [k for k, t in want.items() if k not in state_dict and not slot.get(id(t))]
    unexpected = [k for k in state_dict if k not in want]
    bad = [k for k, v in state_dict.items() if k in want and v.shape != want[k].shape]
    shapes = [f"{k}: {list(state_dict[k].shape)} vs the model's {list(want[k].shape)}" for k in bad]
    if strict:
        _mismatch("load_state_dict:", missing, unexpected, shapes)
    use = {i: k for i, k in slot.items() if k is not None and k not in bad}

    def read(name, p, start, n, key):   # the master weights only
        if key == "master" and id(p) in use:
            return state_dict[use[id(p)]].reshape(-1)[start:start + n]
    bufs = {k: v for k, v in state_dict.items() if k in want and k not in bad and id(want[k]) not in slot}
    filled = {a for i in use for a in aliases[i]} | set(bufs)
    _warn_rounded(_restore(engine, lambda: (read, bufs), "load the state_dict", filled), engine.cfg.dtype)
    engine._resume(engine.step_count, {})   # the rules start fresh
    return LoadResult(missing, unexpected, shapes)


def _refuse_state_dict(*args, **kwargs):
    raise RuntimeError("zero: model.state_dict() after zero.Zero(model) holds shards or stale copies: "
                       "use engine.full_state_dict() (every rank calls it) or zero.save(engine, dir)")


def _restore(engine, prepare, what, filled=None):
    """New weights (and optimizer state, where read() has them) into every copy the engine keeps;
    prepare() -> (read(name, param, start, n, key) -> elements or None, {state_dict key: buffer});
    `filled`: the names it fills (None: all). Returns the frozen ones the compute dtype rounds."""
    error = None                            # this rank's failure in phase 1
    new = []                                # (flat buffer, its new shard state)
    rounded = []                            # frozen parameters the compute dtype does not hold
    try:                                    # phase 1: this rank's owned slices into fresh tensors
        read, buffers = prepare()
        for f in (f for u in engine.units for f in u.flats):
            master = f.state["master"]      # a slice read() does not have keeps its value ...
            moments = {k: torch.zeros(v.shape) for k, v in f.state.items() if k != "master"}
            st = {"master": master.to("cpu", _wide(master.dtype), copy=True), **moments}
            as_held = not f.trainable and not f.cast and f.dtype.is_floating_point
            for a, b, i in f.pieces:
                for k in st:
                    piece = read(f.names[i], f.params[i], a + f.lo - f.offsets[i], b - a, k)
                    if piece is None:
                        continue
                    st[k][a:b] = piece
                    # a frozen value the compute dtype cannot hold exactly: the caller warns
                    if as_held and not torch.equal(piece.float(), piece.to(engine.dtype).float()):
                        rounded.append(f.names[i])
            new.append((f, st))
    except Exception as e:                  # a missing or corrupt file, another model: no change
        error = e
    # phase 2: a failure is raised on every rank, not a hang in the collectives below; zero's own
    # message (a file that fails its checksum) before what reading that file gave another rank
    mine = f"{type(error).__name__}: {error}" if error else None
    _, every = engine.net.agree(mine, lambda: mine)     # every rank's message, where they differ
    failed = [m for m in every or [mine] if m]
    first = ([m for m in failed if "zero:" in m] or failed or [None])[0]
    if error is not None and ("zero:" in str(error) or mine == first):
        raise error
    if first:
        raise RuntimeError(f"zero: another rank could not {what}: {first}")
    for f, st in new:                       # phase 3: shard state in place, 16-bit values from it
        for k, v in st.items():
            f.state[k].copy_(v)
        if f.out is not None:
            f.out.copy_(st["master"])
    if engine.plan.regathers:
        _regather([u.stale() for u in engine.trained])
    with torch.no_grad():
        for k, v in _model_state(engine.module).items():
            if k in buffers:
                v.copy_(buffers[k])
    engine._filled(filled)
    return rounded


# -----------------------------------------------------------------------------
# 14. Call checks through the store, and the exit

POLL_S = 1.0    # a CPU wait this long compares the ranks' calls in the store (a call made alone)
STORE_RATE = 2000   # requests a second to the store that all ranks' long waits make together, at most (one
                    # TCPStore, torchrun's rendezvous store too, served about 22k a second here)
RARE = ("full_state_dict", "load_state_dict", "save", "load")   # calls one rank may make alone
CALLS = ("forward", "no_grad forward", "backward", "step") + RARE


@atexit.register
def _close_groups():
    # at exit, wait for what is in flight and destroy the process groups so that their gloo threads
    # end before Python finalizes: one dropping a finished collective's tensors then aborts the
    # process ("terminate called without an active exception")
    engines = list(_ENGINES)
    works = [w for e in engines for u in e.units for w in u.works]
    works += [w for e in engines for _, ws in e.sched.in_flight for w in ws]
    try:
        for w in works:
            if w is not None:               # (one rank: nothing was launched)
                w.wait(datetime.timedelta(seconds=5))
    except RuntimeError:                    # a collective that failed or never ends: joining hangs
        return
    for e in engines:
        e.sched.drop_in_flight()
        e.net.drop_groups()
        for u in e.units:
            u.drop_works()
    while _GROUPS:                          # dropping each one's last reference joins its threads
        with contextlib.suppress(Exception):   # one the script destroyed already
            dist.destroy_process_group(_GROUPS.popitem()[1])


def _diverged(engine, every):
    # the ranks' collectives or calls differed in this step: say which, change nothing, and stop
    names = {u.index: u.name for u in engine.units}  # a collective's tag (None: the step's)
    # each rank's trace in words, "nothing" past its end
    said = [[f"{k} of {names.get(i, 'the step')}" for k, i in t] + ["nothing"] for t, _, _ in every]
    t0 = every[0][0]
    diff = "?"
    for r, (t, _, _) in enumerate(every):
        if t != t0:
            j = next((j for j, (x, y) in enumerate(zip(t0, t)) if x != y), min(len(t0), len(t)))
            diff = f"#{j}: rank 0's was {said[0][j]}, rank {r}'s {said[r][j]}"
            break
    ran = [f"rank {r}: {[names[i] for i in x]}" for r, (_, x, _) in enumerate(every[:4])]
    engine.ledger_reset()
    more = _more_calls({r: c for r, (_, _, c) in enumerate(every)})
    raise RuntimeError(f"zero: the ranks ran different collectives in this step "
                       f"({'; '.join(more + [diff])}); nothing was updated. Units each rank's "
                       f"forwards ran: {'; '.join(ran)}. At stage 3 call every unit equally "
                       "often on every rank, or stage 2")


class Calls:
    """This rank's calls that take collectives (forward, backward, step, the rare ones), counted and
    logged, and compared with the other ranks' through torch's store: the rare calls (RARE), those
    after evaluation forwards (`check`) and, with Config(check_calls=True) or
    TORCH_DISTRIBUTED_DEBUG=DETAIL, every call, before their first collective; and, in a wait that
    runs long (Comm.until), the last calls ranks 0 and 1 posted: a call one rank made alone is named in
    seconds, never a hang or a step on mismatched shards (asking the store at most STORE_RATE a second)."""

    def __init__(self, net, cfg):
        self.net = net                      # the engine's Comm: its world, timeout and waits
        self.counts = collections.Counter() # this rank's calls by name (forward, backward, ...)
        self.log = collections.deque(maxlen=64)   # the last of them, (n, name): the n-th call made
        self.posted = 0                     # n of the last call posted to the store (long waits)
        self.checked = []                   # the store keys of the last call checked there
        debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
        self.check_all = cfg.check_calls or debug   # every call checked through the store
        serial = next(_SERIALS.setdefault(tuple(net.ranks), itertools.count()))
        self.prefix = f"zero/{'-'.join(map(str, net.ranks))[:64]}/{serial}"   # of the store keys
        self.store = None                   # the default group's store, where calls are checked
        if net.world > 1:
            with contextlib.suppress(Exception):
                self.store = dist.distributed_c10d._get_default_store()

    def call(self, what, check=False):
        # counted and logged, then checked where asked (each rank counts in at key n): a collective
        # one rank made alone would pair with another one (gloo aborts, NCCL hangs)
        self.counts[what] += 1
        n = sum(self.counts.values())
        self.log.append((n, what))
        if self.store is None or not (what in RARE or check or self.check_all):
            return
        key = f"{self.prefix}/call{n}"
        # polled from 1 ms on, doubling to twice the pace (the other half is compare()'s)
        ready = _Poll(functools.partial(self.store.check, [f"{key}/all"]), 1e-3, 2 * self.pace())
        try:
            if self.store.add(f"{key}/{what}", 1) == self.net.world:
                self.store.set(f"{key}/all", what)
                for old in self.checked:    # every rank is past the call checked before: its keys
                    with contextlib.suppress(Exception):    # go (a store that cannot delete keeps them)
                        self.store.delete_key(old)
            why = self.net.until(ready)
        except Exception:                   # the store gone: its host rank died
            why = ""
        self.checked = [f"{key}/{what}", f"{key}/all"]
        if why:
            raise RuntimeError(f"zero: {what}() #{n}: the ranks made other calls ({why}); "
                               f"{EVERY_RANK}")
        if why is not None:
            raise RuntimeError(f"zero: {what}() #{n}: the other ranks did not make this call "
                               f"within {self.net.timeout} ({self.report()}); {EVERY_RANK}")

    def pace(self):
        """Seconds between a waiting rank's store requests, on average: at most STORE_RATE a second
        from N ranks waiting at once, whatever N (20 a second from each of a few)."""
        return max(0.05, self.net.world / STORE_RATE)

    def slice(self):
        # the seconds a wait runs between comparisons: POLL_S, longer past STORE_RATE / 8 ranks (a
        # comparison asks the store up to 4 times: a post, two checks, a read)
        return max(POLL_S, 8 * self.pace())

    def post(self):
        # this rank's counts and last calls, for the others to read (a long wait, an error's report)
        n = sum(self.counts.values())
        if self.store is not None and self.posted != n:
            value = json.dumps([dict(self.counts), list(self.log)])
            self.store.set(f"{self.prefix}/last/{self.net.rank}", value)
            self.posted = n

    def read(self, ranks):
        # what each of `ranks` posted, of those that did: a check per key, then one read of them all
        # where the store has multi_get (newer torch)
        keys = {r: f"{self.prefix}/last/{r}" for r in ranks}
        there = [r for r, key in keys.items() if self.store.check([key])]
        if there and hasattr(self.store, "multi_get"):
            values = self.store.multi_get([keys[r] for r in there])
        else:
            values = [self.store.get(keys[r]) for r in there]
        return {r: json.loads(v) for r, v in zip(there, values)}

    def compare(self):
        # this rank's calls against those ranks 0 and 1 posted (a call made alone waits for, or
        # holds, one of them): the first n-th call that differs, with both ranks' counts, or None
        if self.store is None:
            return None
        with contextlib.suppress(Exception):    # the store gone: its host rank died
            self.post()
            mine = dict(self.log)
            for r, (calls, log) in self.read({0, 1} - {self.net.rank}).items():
                for n, what in log:
                    if n in mine and mine[n] != what:
                        more = _more_calls({self.net.rank: self.counts, r: calls})
                        lo, hi = sorted([(self.net.rank, mine[n]), (r, what)])
                        first = f"rank {lo[0]}: {lo[1]}() #{n}, rank {hi[0]}: {hi[1]}() #{n}"
                        return "; ".join(more + [first])
        return None

    def report(self):
        # what each rank called: this rank's counts and last calls posted; rank 0 reads every rank's,
        # the others ranks 0 and 1's (N ranks each reading N keys would ask the store N^2 times)
        if self.store is None:
            return f"rank {self.net.rank} called " + ", ".join(f"{w}() #{n}" for n, w in self.log)
        want = {0, 1, self.net.rank}
        readers = self.net.world                # the ranks that may be reading keys like these at once
        if self.net.rank == 0:
            want = set(range(self.net.world))
            readers = 1
        # a round reads what is missing; rank 0 alone, and the others together, at most STORE_RATE
        # keys a second
        pause = max(0.05, len(want) * readers / STORE_RATE)
        seen = {}                           # rank -> what it posted
        deadline = time.monotonic() + min(3.0, self.net.timeout.total_seconds() / 2)
        with contextlib.suppress(Exception):    # the store gone (its host rank died): what was read
            self.post()
            while len(seen) < len(want) and time.monotonic() < deadline:
                seen.update(self.read(want - set(seen)))
                if len(seen) < len(want):
                    time.sleep(pause)
        logs = {r: [f"{w}() #{n}" for n, w in log] for r, (_, log) in seen.items()}
        last = "; ".join(f"rank {r}: {log[-1]} (after {', '.join(log[-3:-1]) or 'nothing'})"
                         for r, log in sorted(logs.items())[:8] if log)
        more = _more_calls({r: c for r, (c, _) in seen.items()})
        return "; ".join(more + [last or "no rank said more"])


class _Poll:
    """ready() polled, as until() calls it: each call waits up to `seconds` for it, the pause between
    checks doubling from `pause` to `most` over the whole wait, not from `pause` again at each call.
    A CUDA event never reached cannot hang the CPU; the store's own timed wait logs a warning at each
    timeout."""

    def __init__(self, ready, pause, most):
        self.ready = ready                  # the check: True once done
        self.pause = pause                  # the next pause ...
        self.most = most                    # ... doubling up to this
        self.due = 0.0                      # when the next check is due (time.monotonic)

    def __call__(self, seconds):
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            if now >= self.due:
                if self.ready():
                    return True
                self.due = now + self.pause
                self.pause = min(2 * self.pause, self.most)
            if self.due > end:              # the next check falls in the next call
                time.sleep(max(0.0, end - now))
                return False
            time.sleep(self.due - now)


def _more_calls(counts):
    # "rank 1 made 1 forward() more than rank 0", from each rank's counts of its calls
    out = []
    for what in CALLS:
        c = {r: n.get(what, 0) for r, n in counts.items()}
        lo = min(c, key=c.get, default=None)
        out += [f"rank {r} made {k - c[lo]} {what}() more than rank {lo}"
                for r, k in c.items() if k > c[lo]]
    return out[:4]


# -----------------------------------------------------------------------------
# 15. The ledgers: memory() and comm()

class Ledger:
    """What each kind of collective moved since the last step (calls, elements, bytes as a ring sends
    them); the collectives of the calls between steps (full_state_dict, load_state_dict, save, load)
    apart, reported with the step after them under "between_steps"."""

    def __init__(self):
        self.kinds = {}                     # kind -> (calls, elements, bytes) since the last step
        self.apart = {}                     # the same, of the calls between steps (RARE) since then
        self.between = False                # the collectives counted now are a RARE call's

    def call(self, what):                   # counted apart until the next training call
        self.between = what in RARE

    def count(self, kind, elems, elem_size):
        ledger = self.kinds
        if self.between:                    # a state dict's, a save's, a load's: not the step's
            ledger = self.apart
        calls, e, b = ledger.get(kind, (0, 0, 0))
        ledger[kind] = (calls + 1, e + elems, b + elems * elem_size)

    def new_step(self):
        # what the step moved, by kind, as comm() reports it (the calls before it apart); both start again
        moved = {k: dict(calls=c, elements=e, bytes=b) for k, (c, e, b) in self.kinds.items()}
        if self.apart:
            moved["between_steps"] = {k: dict(calls=c, elements=e, bytes=b)
                                      for k, (c, e, b) in self.apart.items()}
        self.kinds = {}
        self.apart = {}
        return moved

# Flat's tensors beside the state: memory()'s kind, and whether offload holds them on the host
TENSORS = {"flat": ("params", False), "shard": ("params", False), "grad": ("grads", False),
           "acc": ("grads", False), "grad_shard": ("grads", True), "staging": ("params", True)}
KINDS = ("params", "grads", "master", "optim", "frozen")     # memory()'s kinds of model state


def _memory(engine):
    """Bytes of model state this rank holds, by kind, on the device and the host, from the
    tensors' storages, each once (on a CPU-only machine "device" and "host" are one memory,
    split by role); of the host's, pinned_memory() says what is pinned."""
    out = {w: dict.fromkeys(KINDS, 0) for w in ("device", "host")}
    seen = set()                        # storages counted: views share one
    for f in (f for u in engine.units for f in u.flats):
        # each tensor the buffer has now, its kind, and whether offload holds it on the host
        held = [(getattr(f, name), kind, host) for name, (kind, host) in TENSORS.items()]
        held += [(t, "optim", True) for k, t in f.state.items() if k != "master"]
        held.append((f.state.get("master"), "master", True))
        for t, kind, host in held:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                where = "device"
                if not f.trainable:         # frozen: on the device, whatever its role
                    kind = "frozen"
                elif host and f.plan.offload:
                    where = "host"
                out[where][kind] += st.nbytes()
    for m in engine.matrix_steps:         # a matrix rule's owner state, of the matrices it owns
        out["device"]["optim"] += sum(t.untyped_storage().nbytes() for t in m.held())
    return out


def _pinned_memory(engine):
    """The host bytes of memory() that CUDA has page-locked, by kind: with offload on CUDA the
    gradient shard (grads) and the 16-bit staging copy (params), crossing the bus each step."""
    out = dict.fromkeys(KINDS, 0)
    for kind, (block, used, pinned) in engine.pinned.items():
        if pinned:
            out[PINNED[kind]] += used * block.element_size()
    return out


def _num_params(engine, padded=False, frozen=False):
    # Ψ of the formulas: trainable (or frozen) parameters, as given or as the buffers hold them
    flats = [f for u in engine.units for f in u.flats if f.trainable != frozen]
    if padded:
        return sum(f.padded for f in flats)
    return sum(f.numel for f in flats)


# -----------------------------------------------------------------------------
# 16. Checkpoints
#
# path/latest            the newest complete checkpoint's name, replaced atomically, last
# path/step_00001000/    meta.json (layout, config, step, scaler, param groups, checksums), written
#                        after every rank's rank_00000.pt ... (its RNG; for one copy of the shards,
#                        its slice of every Flat.state, unpadded; rank 0: buffers and `extra`; what
#                        it holds, each tensor's CRC-32, which a load checks where it reads)
# Each file is written under a temporary name, then renamed: a crash at any moment leaves `latest`
# naming the previous checkpoint, whole. Loads slice the layout: any world size and stage loads it.

FORMAT = "zero.py-checkpoint-5"             # 5: tensors checksummed in each file; matrix owner state
OLD = ("zero.py-checkpoint-4", "zero.py-checkpoint-3", "zero.py-checkpoint-2")   # checked whole at load
READS = (FORMAT, *OLD)                      # 4: each buffer's update rule; 3: AdamW; 2: no alignment


def _write_atomic(path, write):
    # a reader sees the old file or the new: rename is atomic, fsync puts the bytes on disk first
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path):
    # block by block: a rank file need not fit in memory (format 2-4's check at load)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


class _Hashing:
    """A file that hashes what torch.save writes to it, as it writes: a save never reads a file back."""

    def __init__(self, f, digest):
        self.f = f                          # the file written
        self.digest = digest                # hashlib's, given every byte written

    def write(self, data):
        self.digest.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def _leaves(x, path=()):
    # (path, value) of each leaf of nested dicts, lists and tuples, in their order
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, (*path, i))
    else:
        yield path, x


def _crc(t):
    # CRC-32 of a tensor's elements as bytes, in order (3 GB/s here; sha256 1.8); `extra`'s may be on a GPU
    return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


def save(engine, path, extra=None):
    """A sharded checkpoint of `engine` in directory `path` (every rank calls it), with `extra`, the
    script's tensors and values (load() returns it in meta["extra"], read_extra() alone)."""
    net = engine.net
    flats = [f for u in engine.units for f in u.flats]
    net.call("save")
    engine.settle()                         # offload: the shard state must be this step's
    name = None                             # the new checkpoint's directory, which rank 0 picks
    if net.rank == 0:                       # a fresh one, never a complete checkpoint's
        again = (f"step_{engine.step_count:08d}_{k}" for k in itertools.count(1))
        name = f"step_{engine.step_count:08d}"
        while os.path.exists(os.path.join(path, name)):     # saved again at this step: _1, _2 ...
            name = next(again)
        os.makedirs(os.path.join(path, name))
    name = net.all_gather_object(name)[0]
    d = os.path.join(path, name)
    # one copy of the shards, so that any run finds element e of buffer i in file e // S (S: shard
    # size) of shard group i % R: this rank's slice [a, b) of the unpadded layout, f.state's indices
    n_files = engine.plan.shards
    shards = [None] * len(flats)            # per flat buffer: this rank's slice of its state
    for i in range(net.replica, len(flats), net.replicas):
        f = flats[i]
        size = f.padded // n_files
        a = engine.plan.shard_rank * size - f.lo
        b = max(a, min(a + size, f.end - f.lo))
        dtype = torch.float32 if f.trainable else None      # (None: as held)
        shards[i] = {k: v[a:b].to("cpu", dtype, copy=True) for k, v in f.state.items()}
    blob = dict(flats=shards, rng=torch.get_rng_state())   # each rank's RNG: dropout goes on
    if net.replica == 0:                    # matrix rules' owner state, in its owners' files
        blob["matrices"] = {n: v for m in engine.matrix_steps for n, v in m.to_save().items()}
    if engine.device.type == "cuda":        # (a CPU engine makes no CUDA context)
        blob["cuda_rng"] = torch.cuda.get_rng_state(engine.device)
    if net.rank == 0:                       # the buffers are the same on every rank
        blob["extra"] = extra
        blob["buffers"] = {k: v.detach().cpu() for k, v in _model_state(engine.module).items()
                           if id(v) not in engine.owned}
    # what a load checks where it reads; the whole file's sha256 (for meta.json) is taken as it is written
    blob["sums"] = json.dumps({repr(p): _crc(t) for p, t in _leaves(blob) if isinstance(t, torch.Tensor)})
    digest = hashlib.sha256()
    _write_atomic(os.path.join(d, f"rank_{net.rank:05d}.pt"), lambda f: torch.save(blob, _Hashing(f, digest)))
    sums = net.all_gather_object(digest.hexdigest())
    if net.rank == 0:
        cfg = engine.cfg
        aliases = _aliases(engine.module)
        groups = []                         # each param group's rule and its values
        for g in engine.optimizer.param_groups:
            keys = {"update", "initial_lr", *RULES[g.get("update", "adamw")].keys}
            groups.append({k: v for k, v in g.items() if k in keys})
        layout = []                         # per flat buffer: its length, shard size and parameters
        for f in flats:
            params = [dict(name=n, shape=list(p.shape), offset=o, aliases=aliases[id(p)], step=t)
                      for n, p, o, t in zip(f.names, f.params, f.offsets, f.steps)]
            update = f.rule.name if f.trainable else None   # the rule whose state it holds
            layout.append(dict(numel=f.end, shard=f.padded // n_files, frozen=not f.trainable,
                               update=update, params=params))
        meta = dict(format=FORMAT, world_size=engine.world, shards=n_files, replicas=net.replicas,
                    stage=cfg.stage, dtype=cfg.dtype, config=dataclasses.asdict(cfg),
                    step=engine.step_count, scaler=engine.scaler.state_dict(), param_groups=groups,
                    flats=layout, state_dict_keys=list(_model_state(engine.module)),
                    matrices={n: r for m in engine.matrix_steps for n, r in m.files().items()},
                    sha256={f"rank_{r:05d}.pt": s for r, s in enumerate(sums)})
        text = json.dumps(meta, indent=1).encode()
        _write_atomic(os.path.join(d, "meta.json"), lambda f: f.write(text))
        # the commit point: until this rename, `latest` names the previous, whole checkpoint
        _write_atomic(os.path.join(path, "latest"), lambda f: f.write(name.encode()))
    _delete_old(path, name, net)


def _delete_old(path, newest, net):
    """The checkpoints under `path` but `newest`: rank 0 removes their meta.json (a directory without
    one is no checkpoint) before a barrier, then each rank its own rank files, in parallel."""
    old = [os.path.join(path, o) for o in os.listdir(path) if o.startswith("step_") and o != newest]
    if net.rank == 0:
        for d in old:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(d, "meta.json"))
    net.all_gather_object(None)             # (also: nobody returns before the checkpoint is whole)
    for d in old:
        with contextlib.suppress(OSError):  # up to the first rank file not there
            for r in range(net.rank, 1 << 20, net.world):
                os.remove(os.path.join(d, f"rank_{r:05d}.pt"))
        if net.rank == 0:                   # then the rest
            shutil.rmtree(d, ignore_errors=True)


_Saved = collections.namedtuple("_Saved", "flat offset size shape rule")   # a parameter in a checkpoint


class _Files:
    """A checkpoint (its directory, or its parent's `latest`): its meta, its rank files opened once,
    memory-mapped. Each tensor is checked against its file's checksums the first time get() reads it;
    older formats' files check[0], check[0] + check[1] ... are checked whole when opened."""

    def __init__(self, path, check):
        if os.path.isfile(os.path.join(path, "latest")):
            with open(os.path.join(path, "latest")) as f:
                path = os.path.join(path, f.read().strip())
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise FileNotFoundError(f"zero: {path!r} is not a zero.py checkpoint (no meta.json, no "
                                    "'latest'); pass the directory given to zero.save")
        try:
            with open(os.path.join(path, "meta.json")) as f:
                self.meta = json.load(f)    # meta.json's contents
            if self.meta.get("format") not in READS:
                raise ValueError(self.meta.get("format"))
        except ValueError as e:
            raise ValueError(f"zero: {path}/meta.json is corrupt or of another format; use another "
                             "checkpoint") from e
        self.d = path                       # the checkpoint's directory
        self.open = {}                      # rank -> its file's contents, loaded memory-mapped
        self.sums = {}                      # rank -> its file's tensors' checksums, by path
        self.checked = set()                # (rank, path) of each tensor checked
        world = self.meta["world_size"]     # of the save
        for r in range(check[0], world, check[1]):
            name = f"rank_{r:05d}.pt"
            fname = os.path.join(path, name)
            if not os.path.isfile(fname):
                raise FileNotFoundError(f"zero: checkpoint {path} lacks {name} (saved by {world} "
                                        "ranks): copy all its files, or use another")
            if self.meta["format"] in OLD and _sha256(fname) != self.meta["sha256"][name]:
                raise ValueError(f"zero: {fname} is truncated or corrupted (its sha256 does not "
                                 "match meta.json); use an earlier checkpoint")
        # name -> _Saved: its buffer, offset, the buffer's shard size (format 2 has no gaps, and shards of
        # the unpadded length's share), shape, and rule (None: frozen; before format 4, AdamW)
        flats = self.meta["flats"]
        sizes = [f.get("shard", -(-f["numel"] // self.meta["shards"])) for f in flats]
        rules = [None if f["frozen"] else f.get("update", "adamw") for f in flats]
        self.saved = {p["name"]: _Saved(i, p["offset"], sizes[i], p["shape"], rules[i])
                      for i, f in enumerate(flats) for p in f["params"]}

    def get(self, r, *path):
        # file r's value at `path` (keys, indices), its tensors checked; None where there is no such key
        fname = os.path.join(self.d, f"rank_{r:05d}.pt")
        if r not in self.open:              # weights_only: a checkpoint is data, never code
            try:                            # format 5: each tensor's CRC-32, checked below
                self.open[r] = torch.load(fname, map_location="cpu", weights_only=True, mmap=True)
                if self.meta["format"] not in OLD:
                    self.sums[r] = json.loads(self.open[r].pop("sums"))
            except Exception as e:          # cut short (no zip directory), bytes changed
                raise ValueError(f"zero: {fname} is truncated or corrupted (reading it raised "
                                 f"{type(e).__name__}); use an earlier checkpoint") from e
        x = self.open[r]
        for k in path:
            if isinstance(x, dict):
                x = x.get(k)
            else:
                x = x[k]
        for sub, t in _leaves(x, path):
            key = repr(sub)
            if r not in self.sums or not isinstance(t, torch.Tensor) or (r, key) in self.checked:
                continue
            if _crc(t) != self.sums[r].get(key):
                raise ValueError(f"zero: {fname} is truncated or corrupted (the CRC-32 of {key} differs "
                                 "from the save's); use an earlier checkpoint")
            self.checked.add((r, key))
        return x

    def read(self, name, start, n, key):
        # elements [start, start+n) of a saved parameter, from the files that hold them (see save())
        if n == 0:                          # a 0-element parameter
            return torch.zeros(0)
        i, offset, size, _, rule = self.saved[name]
        if key != "master" and (rule is None or key not in RULES[rule].states):
            return None                     # saved frozen, or by a rule without this state
        first = (i % self.meta.get("replicas", 1)) * self.meta["shards"]   # that group's first file
        out = []
        a, end = offset + start, offset + start + n   # the elements [a, end) in the saved layout
        while a < end:
            r = a // size
            b = min(end, (r + 1) * size)
            out.append(self.get(first + r, "flats", i, key)[a - r * size:b - r * size])
            a = b
        return torch.cat(out) if len(out) > 1 else out[0]


def load(engine, path):
    """Restore a checkpoint of any world size and stage into `engine` (every rank calls it): all or
    nothing; on as many ranks as saved it, each rank's RNG too. Returns meta.json, with `extra`."""
    engine.net.call("load")
    engine.settle()
    f = None                                # the checkpoint, once prepare() opened it
    owned = []                              # per MatrixStep, this rank's matrices' owner state

    def prepare():                          # its errors reach every rank through _restore
        nonlocal f
        f = _Files(path, (engine.rank, engine.world))
        mine = {n: list(p.shape) for u in engine.units for x in u.flats
                for n, p in zip(x.names, x.params)}
        shapes = [f"{n} {s} vs {f.saved[n].shape}" for n, s in mine.items()
                  if n in f.saved and s != f.saved[n].shape]
        _mismatch("the checkpoint is of another model:", [n for n in mine if n not in f.saved],
                  [n for n in f.saved if n not in mine], shapes)
        for x in (x for u in engine.units for x in u.trains):
            for n in x.names:               # a state is the rule's that wrote it: never another's
                saved = f.saved[n].rule
                if saved is not None and saved != x.rule.name:
                    raise ValueError(f"zero: the checkpoint's '{n}' was trained with {saved}, the "
                                     f"engine's with {x.rule.name}: give it the checkpoint's "
                                     "update rule, or load the weights alone with "
                                     "engine.load_state_dict(zero.consolidate(path))")
        if f.meta["world_size"] == engine.world:   # read after the restore: checked before it
            f.get(engine.rank, "rng")
            f.get(engine.rank, "cuda_rng")
        f.get(0, "extra")
        owned.extend(m.read(f) for m in engine.matrix_steps)   # by name, from any file
        # by name: a parameter may sit in another unit, offset or shard than when saved
        return (lambda name, p, start, n, key: f.read(name, start, n, key),
                {k: v for k, v in f.get(0, "buffers").items() if k not in f.saved})
    _restore(engine, prepare, f"load {path}")
    meta = f.meta
    # the rules' step counts per parameter (AdamW's bias correction), by name like the values
    steps = {p["name"]: p["step"] for x in meta["flats"] for p in x["params"]}
    engine._resume(meta["step"], steps)
    for m, saved in zip(engine.matrix_steps, owned):
        m.load(saved)
    engine.scaler.load_state_dict(meta["scaler"])
    groups = engine.optimizer.param_groups
    if len(meta["param_groups"]) == len(groups):   # each group's values as saved
        for g, saved in zip(groups, meta["param_groups"]):
            g.update(saved)
            if "betas" in saved:            # (JSON made it a list)
                g["betas"] = tuple(saved["betas"])
    else:
        warnings.warn(f"zero: the checkpoint has {len(meta['param_groups'])} param groups, the "
                      f"engine {len(groups)}: the engine's hyperparameters are kept")
    if meta["world_size"] == engine.world:  # the same ranks again: each goes on with its own stream
        torch.set_rng_state(f.get(engine.rank, "rng"))
        cuda_rng = f.get(engine.rank, "cuda_rng")   # (None: saved without CUDA)
        if cuda_rng is not None and engine.device.type == "cuda":
            torch.cuda.set_rng_state(cuda_rng, engine.device)
    return dict(meta, extra=f.get(0, "extra"))


def read_extra(path):
    """The script's `extra` of a checkpoint, read without an engine (to rebuild the model first)."""
    return _Files(path, (0, 1 << 30)).get(0, "extra")


def consolidate(path):
    """A sharded checkpoint as one plain fp32 state_dict that the unwrapped model loads; memory
    holds the result and the rank files' memory maps, nothing else."""
    f = _Files(path, (0, 1))
    values = {k: v.to(_wide(v.dtype), copy=True) for k, v in f.get(0, "buffers").items()}
    for p in (p for x in f.meta["flats"] for p in x["params"]):   # from its slices in the files
        t = f.read(p["name"], 0, math.prod(p["shape"]), "master")
        whole = t.to(_wide(t.dtype), copy=True).view(p["shape"])
        values.update(dict.fromkeys(p["aliases"], whole))
    return {k: values[k] for k in f.meta["state_dict_keys"]}


# -----------------------------------------------------------------------------
# 17. The C AdamW kernel
#
# AdamW's step on the CPU (section 4's adamw_step calls it where it takes the tensors): built once
# into ~/.cache/zero_py (with no compiler: a warning, and torch's fused kernel), torch's operations in one
# pass that also reads a bf16 gradient and writes the bf16 weights.
ADAMW_C = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#define INLINE static inline __attribute__((always_inline))
static inline float bf16_in(uint32_t h) { h <<= 16; float f; memcpy(&f, &h, 4); return f; }
static inline uint16_t bf16_out(float f) {  /* to nearest even, NaN stays NaN: torch's .to() */
  uint32_t u; memcpy(&u, &f, 4); return f != f ? 0xffff : (u + 0x7fff + ((u >> 16) & 1)) >> 16; }
typedef struct { float decay, scale, w, b2, w2, nstep, bc2s, eps, hi, lo; } hyper;  /* adamw sets hi, lo */
/* one parameter as ATen's fused CPU AdamW computes it (-ffp-contract=off: only these fmaf fuse) */
INLINE float update(int bg, int div, int64_t i, float *p, const void *g, float *m, float *v, hyper h) {
  const int near = fabsf(h.w) < 0.5f; const float wl = near ? h.w : h.w - 1;  /* torch's lerp */
  float gi = bg ? bf16_in(((const uint16_t *)g)[i]) : ((const float *)g)[i];  if (div) gi /= h.scale;
  float mi = fmaf(wl, gi - m[i], near ? m[i] : gi), vi = fmaf(h.w2 * gi, gi, v[i] * h.b2);
  /* sqrt(vi) / bc2s with no divide (it bounds the loop): q within an ulp, Markstein's fma step rounds it */
  float s = sqrtf(vi), q = fmaf(s, h.hi, s * h.lo), r = fmaf(-q, h.bc2s, s);   /* s: 0, normal, inf or NaN */
  float pi = p[i] * h.decay + h.nstep * mi / ((s < INFINITY ? fmaf(r, h.hi, q) : s) + h.eps);
  p[i] = pi; m[i] = mi; v[i] = vi; return pi; }
INLINE void body(int bg, int ob, int div, int64_t i, int64_t b, float *restrict p, const void *restrict g,
    float *restrict m, float *restrict v, uint16_t *restrict out, hyper h) {
#ifdef __SSE2__  /* out is only written: whole 64-byte lines go by streaming stores, which skip reading */
  for (; ob && i < b && (uintptr_t)(out + i) % 64; i++) out[i] = bf16_out(update(bg, div, i, p, g, m, v, h));
  for (uint16_t t[32] __attribute__((aligned(64))); i + 32 <= b; i += 32) {
    for (int j = 512; j < 544; j += 16)  /* 2 KB ahead: more lines in flight than the hardware keeps */
      __builtin_prefetch(p + i + j, 1), __builtin_prefetch(m + i + j, 1), __builtin_prefetch(v + i + j, 1),
      __builtin_prefetch((const char *)g + (i + j) * (bg ? 2 : 4), 0);
    for (int j = 0; j < 32; j++) t[j] = bf16_out(update(bg, div, i + j, p, g, m, v, h));
    for (int j = 0; ob && j < 4; j++)
      _mm_stream_si128((__m128i *)(out + i) + j, _mm_load_si128((__m128i *)t + j));
  }
#endif
  for (; i < b; i++) { float pi = update(bg, div, i, p, g, m, v, h); if (ob) out[i] = bf16_out(pi); } }
/* kind: bit 0 a bf16 grad, 1 a bf16 out, 2 a grad_mult, each its own loop; *next: the next block to take */
#define K(k) case k: body(k & 1, k >> 1 & 1, k >> 2, a, b, p, g, m, v, out, h); break;
void adamw(int kind, int64_t n, int64_t *next, float *p, const void *g, float *m, float *v, uint16_t *out,
           const hyper *hp) {
  hyper h = *hp; h.hi = 1 / h.bc2s, h.lo = (float)((1 - (double)h.bc2s * h.hi) / h.bc2s);  /* 1 / bc2s */
  for (int64_t a, b; (a = __atomic_fetch_add(next, 1 << 16, __ATOMIC_RELAXED)) < n;)
    switch (b = a + (1 << 16) < n ? a + (1 << 16) : n, kind) { K(0) K(1) K(2) K(3) K(4) K(5) K(6) K(7) }
#ifdef __SSE2__
  _mm_sfence();  /* streaming stores are weakly ordered: all visible before the caller goes on */
#endif
}
"""

# -fno-math-errno, -fno-trapping-math vectorise sqrtf and the selects (4x on AVX2); unlike -ffast-math, exact
ADAMW_FLAGS = "-O3 -march=native -fno-math-errno -fno-trapping-math -ffp-contract=off -shared -fPIC".split()
MIN_PER_THREAD = 1 << 17    # parameters: waking another thread for fewer costs more than it saves
_kernel, _kernel_lock, _pools = [], threading.Lock(), {}   # _kernel: [] untried, [fn] or [None]


def _build_kernel():
    # compile ADAMW_C into the user's cache once per source, compiler and CPU (a shared home must never hand a
    # -march=native binary to another CPU), and load it
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
            r = subprocess.run([cc, *ADAMW_FLAGS, "-o", f"{tmp}/a.so", "-x", "c", "-"], input=ADAMW_C,
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-300:]}")
            os.replace(f"{tmp}/a.so", so)
    fn = ctypes.CDLL(so).adamw
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 7, None
    return fn


def _cpu_kernel():
    # the C kernel, or None where it cannot be built, after one warning saying why: slower, never fatal
    with _kernel_lock:
        if not _kernel:
            try:
                _kernel.append(_build_kernel())
            except Exception as e:
                _kernel.append(None)
                warnings.warn(f"zero: no C AdamW kernel ({type(e).__name__}: {e}); using torch's (slower)")
    return _kernel[0]


def _parallel(fn, n, args):
    # fn(*args) here and, for a large n, on pool threads (Python's: the kernel releases the GIL, torch has its
    # own OpenMP). They take blocks until none is left: one held up does less, and whichever run, all are done
    k, helpers = min(_host_threads(), n // MIN_PER_THREAD), []
    if k > 1:
        with contextlib.suppress(RuntimeError):   # no new threads at interpreter exit: this one does it all
            pool = _pools.get(os.getpid()) or _pools.setdefault(os.getpid(),
                                                                ThreadPoolExecutor(os.cpu_count()))
            helpers = [pool.submit(fn, *args) for _ in range(k - 1)]
    fn(*args)
    for h in helpers:
        h.result()


def _c_adamw(master, grad, exp_avg, exp_avg_sq, out, a, b, lr, beta1, beta2, eps, weight_decay, step,
             grad_mult):
    # elements [a, b) of adamw_step (section 4) in one pass of the kernel on _parallel's threads, which also
    # writes a bf16 out; an fp32 one (fp32 compute with offload) is copied after
    bc1 = 1 - beta1 ** step                 # in double, then rounded to float, as torch does
    bc2 = 1 - beta2 ** step
    consts = (ctypes.c_float * 10)(1 - lr * weight_decay, 1 / grad_mult, 1 - beta1, beta2, 1 - beta2,
                                   -lr / bc1, math.sqrt(bc2), eps)   # the kernel sets the last two
    writes_out = out is not None and out.dtype == torch.bfloat16
    kind = (grad.dtype == torch.bfloat16) + 2 * writes_out + 4 * (grad_mult != 1.0)
    ptrs = [t.data_ptr() for t in (master, grad, exp_avg, exp_avg_sq)] + [None]   # out's, where written
    if writes_out:
        ptrs[-1] = out.data_ptr()
    next_block = ctypes.c_int64(a)          # the next block of 2^16 elements a thread takes, up to b
    _parallel(_cpu_kernel(), b - a, (kind, b, ctypes.addressof(next_block), *ptrs, consts))
    if out is not None and not writes_out:
        out[a:b].copy_(master[a:b])


# -----------------------------------------------------------------------------
# 18. Launching, the memory estimator and the command line
#
# The paper's formula in Zero.memory()'s kinds (a test holds the two equal on a real model);
# `python zero.py estimate` prints the paper's 7.5B-parameter, 64-GPU example.

def init_distributed(timeout_s=300.0):
    """Join the torchrun job of RANK/WORLD_SIZE/LOCAL_RANK; one process when they are absent."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ and cuda:
        return 0, 1, torch.device("cuda", torch.cuda.current_device())
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if cuda:                                # (mod: a process shown one GPU takes it)
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)       # before NCCL starts, or every rank talks through GPU 0
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def estimate_memory(num_params, world_size, stage, dtype="fp16", offload=False, shard_group=0,
                    frozen_params=0, reduce_dtype="", frozen_dtype="", accum_steps=1, num_tensors=0,
                    device="cuda", muon_params=0, rule_params=None):
    """The ZeRO paper's model-state bytes per rank: params and grads in the compute dtype (grads in
    fp32 with reduce_dtype="fp32"), fp32 master (none in fp32 compute) and two fp32 Adam moments,
    each sharded by the stage across the shard group; frozen parameters in the compute dtype
    (frozen_dtype="fp32": in fp32, plus a compute copy at stages 0-2), sharded at stage 3 only.
    num_params as the engine holds them (num_params(padded=True)) is exact; as the model has them,
    num_tensors (trainable tensors) adds the padding's bound: < 16 bytes before each tensor, N x 16
    after each unit. Offload on CUDA (device="cuda") pins the owned 16-bit slice on the host too.
    rule_params: {rule name: of num_params, those it steps}, each rule's state_bytes a parameter (the
    rest AdamW's); muon_params: Muon's (one fp32 state, not AdamW's two)."""
    c = Config(stage, dtype, reduce_dtype, frozen_dtype).validate()
    n = (stage and shard_group) or world_size   # the ranks a stage shards over: the shard group's
    p = DTYPES[c.dtype].itemsize            # bytes per parameter
    g = DTYPES[c.reduce_dtype or c.dtype].itemsize      # per gradient
    master = 0 if c.dtype == "fp32" and not offload else 4    # per fp32 master value
    align = 16 // p                         # elements (see Flat)
    psi = num_params + num_tensors * (align - 1 + n * align - 1)
    per = [n if stage >= s else 1 for s in range(4)]   # each stage divides one more kind by N
    stepped = dict(rule_params or {})       # rule name -> parameters; AdamW steps the rest
    if muon_params:
        stepped["muon"] = muon_params
    state = RULES["adamw"].state_bytes * (psi - sum(stepped.values()))   # the rules' fp32 state
    for rule, k in stepped.items():
        state += RULES[rule].state_bytes * k
    dev = dict(params=p * psi / per[3], grads=g * psi / per[2], master=master * psi / per[1],
               optim=state / per[1], frozen=p * frozen_params / per[3])
    if c.frozen_dtype:                      # in fp32, and at stages 0-2 a compute copy beside
        dev["frozen"] = 4 * frozen_params / n if stage == 3 else 6 * frozen_params
    host = dict.fromkeys(dev, 0)
    if offload:                             # the gradient shard, master and moments on the host
        host.update(grads=g * psi / n, master=dev["master"], optim=dev["optim"])
        if device == "cuda":                # the staging copy (a CPU engine's host is its device)
            host.update(params=p * psi / n)
        dev.update(master=0, optim=0)
        # the device keeps stage 1's whole gradient, or the shard's sum (accumulation, and hybrid:
        # summed across the shard groups there)
        if stage != 1:
            dev["grads"] = 0
        if stage != 1 and (accum_steps > 1 or n < world_size):
            dev["grads"] = g * psi / n
    return dict(device={k: int(round(v)) for k, v in dev.items()},
                host={k: int(round(v)) for k, v in host.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(prog="zero.py", description=__doc__.split("\n")[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate", help="model-state memory per rank, by stage (ZeRO's formula)")
    e.add_argument("--params", type=float, required=True, help="trainable parameters, e.g. 7.5e9")
    e.add_argument("--world-size", type=int, required=True)
    e.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    e.add_argument("--shard-group", type=int, default=0, help="hybrid: ranks per shard group")
    e.add_argument("--frozen-params", type=float, default=0, help="frozen parameters (LoRA's base)")
    c = sub.add_parser("consolidate", help="a sharded checkpoint to one plain fp32 state_dict file")
    c.add_argument("ckpt")
    c.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "consolidate":              # no processes, no GPU: the rank files read from disk
        torch.save(consolidate(a.ckpt), a.out)
        print(f"wrote {a.out}")
        return
    kinds = ["params", "grads", "master", "optim"]     # the ZeRO paper's Figure 1, a row per stage
    title = f"model states per rank, {a.params:.4g} params"
    if a.frozen_params:
        kinds.append("frozen")
        title += f" + {a.frozen_params:.4g} frozen"
    title += f", {a.world_size} ranks"
    if a.shard_group:
        title += f", shard groups of {a.shard_group}"
    print(f"{title}, {a.dtype} + fp32 Adam (GB = 1e9 B)")
    print(f"{'stage':>5}", *(f"{k:>9}" for k in kinds), f"{'total':>9}")
    for s in range(4):
        d = estimate_memory(a.params, a.world_size, s, a.dtype, shard_group=a.shard_group,
                            frozen_params=a.frozen_params)["device"]
        print(f"{s:>5}", *(f"{d[k] / 1e9:>9.4g}" for k in kinds), f"{sum(d.values()) / 1e9:>9.1f}")

if __name__ == "__main__":
    main()
