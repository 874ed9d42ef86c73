"""
zero.py: ZeRO data parallelism for PyTorch in one file.

ZeRO stages 0-3 (Rajbhandari et al., 2020) over torch.distributed, one code path for CUDA/NCCL and CPU/gloo:
fp16/bf16 compute on fp32 master weights, loss scaling, activation recompute, ZeRO-Offload's CPU Adam (Ren et
al., 2021), hybrid sharding, frozen parameters (LoRA), meta-device models, torch's optimizers and schedulers,
sharded checkpoints, a ledger of memory and communication.

    rank, world_size, device = zero.init_distributed()
    model = zero.Zero(model, zero.Config(stage=3, dtype="bf16"), optimizer=opt)   # opt: your torch AdamW
    loss = model(x, y); model.backward(loss); opt.step()   # the engine is called, and read, like the model

    torchrun --standalone --nproc_per_node=2 train_gpt.py --stage=3
    python zero.py estimate --params 7.5e9 --world-size 64 [--shard-group 8] [--frozen-params 3e10]
    python zero.py consolidate CKPT_DIR OUT.pt

Sections: 1. Config, Plan  2. Collectives  3. Loss scaler  4. AdamW  5. Flat buffers, units  6. The schedule
7. The engine  8. Checkpoints  9. Memory estimator, command line
"""

import argparse, atexit, collections, contextlib, ctypes, dataclasses, datetime  # noqa: E401
import functools, hashlib, heapq, itertools, json, math, mmap, os, platform, queue, shutil  # noqa: E401
import subprocess, tempfile, threading, time, warnings, weakref, zlib  # noqa: E401
from concurrent.futures import ThreadPoolExecutor

import torch, torch.distributed as dist, torch.nn as nn  # noqa: E401
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint as recompute

# -----------------------------------------------------------------------------
# 1. Config, and the Plan made from it

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch's names and dtypes are taken too (nanoGPT's dtype="bfloat16", torch.float16)
_DTYPE_NAMES = {**{k: k for k in DTYPES}, "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                **{v: k for k, v in DTYPES.items()}}


def _dtype_name(x):
    # zero's name of a dtype given by zero's name, torch's name or a torch.dtype; None for anything else
    if isinstance(x, (str, torch.dtype)):
        return _DTYPE_NAMES.get(x)
    return None


@dataclasses.dataclass
class Config:
    stage: int = 2                  # 0 plain DP | 1 shard optimizer states | 2 + gradients | 3 + parameters
    dtype: str = "bf16"             # compute: "fp32" | "bf16" | "fp16"
    reduce_dtype: str = ""          # gradient reductions and sums: "" = dtype | "fp32"
    frozen_dtype: str = ""          # frozen parameters: "" = dtype | "fp32" (cast when gathered)
    lr: float = 3e-4                # AdamW's (a scheduler on engine.optimizer changes it)
    betas: tuple = (0.9, 0.95)      # AdamW's
    eps: float = 1e-8               # AdamW's
    weight_decay: float = 0.1       # decoupled; with no param groups, on parameters of >= 2 dims only
    grad_clip: float = 1.0          # the global gradient norm's limit; 0 = none
    accum_steps: int = 1            # micro-batches (backward calls) per optimizer step
    checkpoint: object = False      # recompute activations: False | True (every unit) | k (every k-th unit)
    offload: bool = False           # ZeRO-Offload: master, Adam moments, grad shard on the host (stages 1-3)
    shard_group: int = 0            # hybrid: shard in groups of this many ranks, replicate across; 0 = all
    prefetch: bool = True           # all-gather the next unit while this one computes
    loss_scale: float = 2.0 ** 16   # fp16: initial dynamic loss scale
    loss_scale_window: int = 1000   # fp16: clean steps before the scale doubles
    hysteresis: int = 2             # fp16: overflows tolerated before it starts halving
    min_loss_scale: float = 1.0     # fp16: its floor
    timeout_s: float = 300.0        # every process group the engine makes ends a hang after this
    waits: str = "auto"             # "nccl": stream-ordered | "gloo": timed CPU waits | "auto": the backend's
    check_calls: bool = False       # check each call across ranks (or TORCH_DISTRIBUTED_DEBUG=DETAIL)

    def validate(self):
        """A ValueError naming the fix for the first bad field; dtypes by zero's names from here on."""
        dtype, stage, k, g = _dtype_name(self.dtype), self.stage, self.checkpoint, self.shard_group
        extra = {f: getattr(self, f) or "" for f in ("reduce_dtype", "frozen_dtype")}
        for bad, what in (
                (stage not in (0, 1, 2, 3), f"stage={stage!r}: use 0 (plain DP), 1, 2 or 3"),
                (dtype is None, f"dtype={self.dtype!r}: use one of {list(DTYPES)}, or torch's names"),
                (any(v and _dtype_name(v) not in ("fp32", dtype) for v in extra.values()),
                 f'{extra}: use "" or "fp32"'),
                (not (isinstance(self.accum_steps, int) and self.accum_steps >= 1),
                 f"accum_steps={self.accum_steps!r}: use an integer >= 1"),
                (not isinstance(k, bool) and not (isinstance(k, int) and k >= 1),
                 f"checkpoint={k!r}: use False, True, or k >= 1 (every k-th unit)"),
                (self.offload and stage == 0, "offload=True needs stage 1, 2 or 3"),
                (not (self.lr >= 0 and self.eps > 0 and self.weight_decay >= 0 and self.grad_clip >= 0),
                 "lr, weight_decay and grad_clip must be >= 0, eps > 0"),
                (len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas),
                 f"betas={self.betas!r}: use two numbers in [0, 1)"),
                (self.hysteresis < 1 or self.loss_scale_window < 1 or self.min_loss_scale <= 0,
                 "hysteresis and loss_scale_window must be >= 1, min_loss_scale > 0"),
                (not (isinstance(g, int) and g >= 0) or (stage == 0 and g),
                 f"shard_group={g!r} at stage {stage}: use 0 (all ranks), or k ranks at stages 1-3"),
                (self.timeout_s <= 0 or self.waits not in ("auto", "nccl", "gloo"),
                 f"timeout_s={self.timeout_s!r}, waits={self.waits!r}: use seconds > 0; auto, nccl or gloo")):
            if bad:
                raise ValueError(f"zero.Config: {what}")
        self.dtype = dtype
        for f, v in extra.items():          # "fp32", or "": the compute dtype (given by its name too)
            setattr(self, f, "fp32" if v and _dtype_name(v) != dtype else "")
        return self


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the stages differ in, one name each, with the dtypes and devices: made once from the Config and
    the process group, the only place a stage number is read. Model states per rank for Ψ parameters on N
    ranks (the shard group's with hybrid sharding), 16-bit compute, K = 12 bytes of fp32 master and Adam:

      stage  parameters          gradients                        master + Adam   bytes per rank
      0      whole               whole, all-reduced in backward   whole           (2 + 2 + K) Ψ
      1      whole               whole, reduce-scattered          sharded         4Ψ + KΨ/N
      2      whole               reduce-scattered, then freed     sharded         2Ψ + (2 + K)Ψ/N
      3      gathered per unit   reduce-scattered, then freed     sharded         (2 + 2 + K)Ψ/N

    When a unit's gradient is reduced follows from shards_grads: in every micro-batch's backward where the
    whole gradient is freed after it (2-3), else in the last micro-batch's (0-1). Frozen parameters (no
    gradient, no optimizer state) are whole at stages 0-2, sharded at stage 3."""
    shards_optim: bool              # fp32 master and Adam moments: this rank's shard (stages 1-3)
    shards_grads: bool              # gradients reduce-scattered in each backward, the whole ones freed (2-3)
    shards_params: bool             # parameters gathered per unit for each use, freed after (3)
    regathers: bool                 # whole parameters: updated slices all-gathered after an update (1-2)
    gathers_lazily: bool            # forwards gather (stage 3; offload: the slices the host update wrote)
    offload: bool                   # master, moments and the gradient shard on the host
    pin: bool                       # offload on CUDA: the gradient shard and a 16-bit staging copy pinned
    master_is_param: bool           # fp32 compute without offload: the owned parameters are the master
    frozen_fp32: bool               # frozen parameters held in fp32, cast when gathered
    prefetch: bool
    accum: int                      # micro-batches per step
    dtype: torch.dtype              # compute
    grad_dtype: torch.dtype         # gradient reductions and sums
    device: torch.device
    host: torch.device              # where master, moments and the gradient shard live
    replicas: int                   # hybrid: copies of the model states (shard groups)
    shards: int                     # the buffers are padded to, and owned in, this many slices ...
    shard_rank: int                 # ... of which this rank owns this one (stage 0: all of them)
    divide: tuple                   # the mean over ranks x micro-batches: a divide before the sum, one after

    @staticmethod
    def of(cfg, net):
        stage, dtype = cfg.stage, DTYPES[cfg.dtype]
        return Plan(shards_optim=stage >= 1, shards_grads=stage >= 2, shards_params=stage == 3,
                    regathers=stage in (1, 2), gathers_lazily=stage == 3 or cfg.offload, offload=cfg.offload,
                    pin=cfg.offload and net.device.type == "cuda",
                    master_is_param=dtype == torch.float32 and not cfg.offload,
                    frozen_fp32=bool(cfg.frozen_dtype), prefetch=cfg.prefetch, accum=cfg.accum_steps,
                    dtype=dtype, grad_dtype=DTYPES[cfg.reduce_dtype or cfg.dtype], device=net.device,
                    host=torch.device("cpu") if cfg.offload else net.device, replicas=net.replicas,
                    shards=net.shards, shard_rank=net.shard_rank,
                    divide=divide_factors(net.world * cfg.accum_steps))


def divide_factors(n):
    """The mean over n gradients as a divide by `pre` before the sum and by n / pre after, pre the power of
    two nearest below sqrt(n) (as FSDP): fp16 parts lose log2(pre) bits of range to underflow, not log2(n)."""
    pre = 1 << (math.isqrt(n).bit_length() - 1)
    return pre, n / pre

# -----------------------------------------------------------------------------
# 2. Distributed setup and collectives
#
# All-reduce (stage 0's gradients), reduce-scatter (a sum over ranks, each keeping its slice) and all-gather
# (each rank's slice to all) carry ZeRO, one call per unit's flat buffer; on one process they are copies.

def init_distributed(timeout_s=300.0):
    """Join the torchrun job of RANK/WORLD_SIZE/LOCAL_RANK; one process when they are absent."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if cuda:                                # a process shown one GPU (CUDA_VISIBLE_DEVICES per rank) takes it
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)       # before NCCL starts, or every rank talks through GPU 0
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


# torch 2.13's names (>= 2.4 has the old ones); looked up at each call, so that a test can wrap them
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce
_broadcast = dist.broadcast


def _reduce_scatter(out, inp, group=None, async_op=True):
    # out is inp's own slice. gloo's (CPU tensors) runs inside its wait, which ignores the timeout, at a third of
    # its all-reduce's speed (measured): there, an all-reduce in place, which leaves the sum in out too
    if inp.is_cpu:
        return dist.all_reduce(inp, group=group, async_op=async_op)
    return _torch_reduce_scatter(out, inp, group=group, async_op=async_op)


_GROUPS = {}    # (ranks, purpose, world, timeout) -> process group, made once per process, shared by engines
_SERIALS = {}   # ranks -> a counter of the engines made on them, the same on each
POLL_S = 1.0    # a CPU wait this long compares the ranks' calls through the store (a call one rank made alone)
RARE = ("full_state_dict", "load_state_dict", "save", "load")   # calls a script may make on one rank only
CALLS = ("forward", "no_grad forward", "backward", "step") + RARE
EVERY_RANK = ("every rank calls forward (stage 3 or offload), backward, step, full_state_dict, "
              "load_state_dict, save and load together (HF generate() at stage 3: synced_gpus=True)")


def fingerprint(key):
    """Any value's repr as 4 integers of 12 bits: summed over N ranks with their squares in fp64, all ranks
    agree iff N * sum(c^2) == sum(c)^2 for each, exactly while N < 2^29."""
    h = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=6).digest(), "little")
    return [(h >> (12 * i)) & 0xFFF for i in range(4)]


def _device_of(group):
    # NCCL ranks compute on their GPU, gloo ranks on the CPU (the backend config of a group made without a
    # backend says which the GPU's tensors take)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if group is not None:
        conf = str(dist.get_backend_config(group)) if hasattr(dist, "get_backend_config") else ""
        if "nccl" not in conf + str(dist.get_backend(group)):
            return torch.device("cpu")
    want = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())) % torch.cuda.device_count()
    if torch.cuda.current_device() != want:
        raise RuntimeError(f"zero: the current CUDA device is not LOCAL_RANK's: call "
                           f"torch.cuda.set_device({want}) first (zero.init_distributed does)")
    return torch.device("cuda", want)


class Comm:
    """The engine's process groups, made with timeout_s: `shard` (gathers and reductions on one communicator,
    as FSDP2: one order, trivially), `replica` (hybrid: the reduced shard summed across shard groups), `world`
    (the step's all-reduce, the setup, objects; the shard group without hybrid). Launches are asynchronous,
    counted in the ledger as a ring sends them and traced for the step's agreement. The ranks agree through
    agree() (one all-reduce, an explanation only where they differ) and, for a call one rank may make alone,
    through the store (call())."""

    def __init__(self, cfg, group=None):
        up = dist.is_available() and dist.is_initialized()
        self.timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.ledger = {}                    # kind -> (calls, elements, bytes) since the last step
        self.trace = []                     # (kind, unit) of every launch and call since the last step
        self.held = 0                       # bytes of parameter buffers allocated now ...
        self.peak = 0                       # ... and at most
        self.calls = collections.Counter()  # this rank's calls (forward, backward, step, ...) by name
        self.log = collections.deque(maxlen=64)   # the last of them, (n, name): the n-th call made
        self.posted = 0                     # the n of the last call this rank posted to the store (a long wait)
        self.check_calls = cfg.check_calls or os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if up else [0]
        self.world = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank()) if up else 0
        self.device = _device_of((group or dist.group.WORLD) if up else None)
        # NCCL's untimed wait orders streams and lets the CPU run ahead; gloo's blocks the CPU, with a timeout
        self.stream_waits = cfg.waits == "nccl" or cfg.waits == "auto" and self.device.type == "cuda"
        k = cfg.shard_group or self.world  # (stage 0: 0, all ranks)
        if self.world % k:
            raise ValueError(f"zero.Config: shard_group={k} does not divide the {self.world} ranks; "
                             "use a divisor")
        self.shards = k                     # shard groups: k consecutive ranks, one copy of the model states
        self.replicas = self.world // k     # replica groups: one rank of each shard group
        self.replica = self.rank // k       # this rank's shard group ...
        self.shard_rank = self.rank % k     # ... and its place in it
        self.groups = self._make_groups(group, cfg.timeout_s)   # purpose -> (process group, size)
        self.prefix = f"zero/{'-'.join(map(str, self.ranks))[:64]}/" \
                      f"{next(_SERIALS.setdefault(tuple(self.ranks), itertools.count()))}"   # store keys
        self.store = None                   # the default group's store, where calls are checked
        if self.world > 1:
            with contextlib.suppress(Exception):
                self.store = dist.distributed_c10d._get_default_store()
            # NCCL makes a communicator at its first call: here, not at peak memory
            for pg in {id(g): g for g, n in self.groups.values() if n > 1}.values():   # (None: one rank)
                self.wait(_all_reduce(torch.zeros(1, device=self.device), group=pg, async_op=True))

    def _make_groups(self, group, timeout_s):
        # NCCL splits sub-groups from a device-bound default group, which all its ranks must join
        k, hybrid = self.shards, self.shards < self.world
        bound = group is not None and getattr(dist.group.WORLD, "bound_device_id", None) is not None
        if bound and hybrid:
            raise ValueError("zero.Zero: hybrid sharding on group= under init_process_group(device_id=...): "
                             "init without device_id, or pass no group")
        sets = {"shard": [self.ranks[i:i + k] for i in range(0, self.world, k)]}
        if hybrid:
            sets.update(replica=[self.ranks[j::k] for j in range(k)], world=[self.ranks])
        groups = {}
        for purpose, members in sets.items():
            for s in members:               # new_group is collective: every rank makes each, in order
                key = (tuple(s), purpose, id(dist.group.WORLD), timeout_s)
                if len(s) > 1 and key not in _GROUPS and not bound:
                    _GROUPS[key] = dist.new_group(list(s), timeout=self.timeout,
                                                  use_local_synchronization=group is not None)
                if self.ranks[self.rank] in s:      # bound: the user's group itself
                    groups[purpose] = (group if bound and len(s) > 1 else _GROUPS.get(key), len(s))
        groups.setdefault("world", groups["shard"])
        return groups

    def count(self, kind, elems, elem_size):
        calls, e, b = self.ledger.get(kind, (0, 0, 0))
        self.ledger[kind] = (calls + 1, e + elems, b + elems * elem_size)

    def count_held(self, nbytes):           # parameter buffer bytes allocated (> 0) or freed (< 0)
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def wait(self, work, cpu=False):
        """The collective done: on NCCL the stream waits and the CPU goes on, unless `cpu` (its values are read
        next); elsewhere the CPU waits, in slices that compare the ranks' calls (see until). A failure, a dead
        or a stalled rank (the group's timeout ends the collective) becomes this error."""
        error = work if isinstance(work, Exception) else None
        why = None                          # "": the timeout; else how the ranks' calls differ
        try:
            if work is None or error is not None:
                pass
            elif self.stream_waits:
                work.wait()
                if cpu and self.device.type == "cuda":   # an event polled, not a sync that hangs unbounded
                    event = torch.cuda.Event()
                    event.record()
                    why = self.until(functools.partial(_event_done, event))
            else:
                why = self.until(functools.partial(_work_done, work))
        except RuntimeError as e:           # gloo raises on a timeout, on sizes that differ, on a dead peer
            error = e
        if why:
            raise RuntimeError(f"zero: a collective waits for ranks that made other calls ({why}); {EVERY_RANK}")
        if error is not None or why is not None:
            raise RuntimeError(f"zero: a collective failed or did not finish in {self.timeout}: another rank "
                               f"died, stalled or made other calls ({self.report()}); if slow, raise "
                               f"Config.timeout_s; {EVERY_RANK}") from error

    def until(self, done):
        """Wait for done(seconds) -> finished within them, up to timeout_s, in slices of POLL_S: after each the
        calls this rank made are posted to the store and ranks 0 and 1's read, so that ranks whose n-th calls
        differ (one made a call alone) learn it in seconds, whatever timeout_s is. Returns None when done, ""
        at the timeout, else how the calls differ. A wait shorter than POLL_S touches no store."""
        end = time.monotonic() + self.timeout.total_seconds()
        while not done(min(POLL_S, max(end - time.monotonic(), 0.01))):
            if time.monotonic() >= end:
                return ""
            differ = self.compare()
            if differ is not None:
                return differ
        return None

    def _launch(self, collective, purpose, kind, t, ring, tag, sync, *tensors):
        pg, n = self.groups.get(purpose, (None, 1))
        self.count(kind, t.numel() * ring * (n - 1) // n, t.element_size())   # exact: units pad to n
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

    def reduce_scatter(self, out, inp, sync=True, tag=None):   # out is inp's own slice
        return self._launch(_reduce_scatter, "shard", "reduce_scatter", inp, 1, tag, sync, out, inp)

    def all_gather(self, out, inp, kind="all_gather", sync=True, tag=None):   # inp may be out's own slice
        return self._launch(_all_gather, "shard", kind, out, 1, tag, sync, out, inp)

    def broadcast(self, t):                 # the setup: every rank starts from the first rank's values
        pg, n = self.groups["world"]
        if n > 1:
            self.wait(_broadcast(t, self.ranks[0], group=pg, async_op=True))

    def all_gather_object(self, obj):       # Python objects (the setup's, the first backward's, a save's)
        out = [obj] * self.world
        if self.world > 1:
            try:
                dist.all_gather_object(out, obj, group=self.groups["world"][0])
            except RuntimeError as e:       # a stalled, dead or diverged rank, as in wait()
                self.wait(e)
        return out

    def agree(self, key, explain, extra=None):
        """The ranks' one primitive of agreement (the setup's config, the step, a load): `key`'s fingerprint
        and its squares summed in one fp64 all-reduce, beside `extra` (a float64 tensor on the device, whose
        sums come back). Where some rank's key differs, every rank's explain() is gathered too, for the caller
        to say who differs; else that list is None."""
        digits = fingerprint(key)
        head = torch.tensor(digits + [d * d for d in digits], dtype=torch.float64)
        if self.device.type == "cuda":      # one host-to-device copy, behind the work queued so far
            head = head.pin_memory().to(self.device, non_blocking=True)
        stats = head if extra is None else torch.cat([head, extra])
        self.all_reduce(stats, kind="scalar")
        sums = stats.tolist()
        if all(a * a == self.world * q for a, q in zip(sums[:4], sums[4:8])):
            return sums[8:], None
        return sums[8:], self.all_gather_object(explain())

    def call(self, what, check=False):
        """A collective-taking call, counted and traced. RARE ones, those after evaluation forwards (`check`)
        and, with check_calls, all are first checked through the store, each rank counting itself in at key n:
        a collective made on one rank alone would pair with another's (gloo aborts, NCCL hangs)."""
        self.calls[what] += 1
        n = sum(self.calls.values())
        self.log.append((n, what))
        self.trace.append((what, None))
        if self.store is None or not (what in RARE or check or self.check_calls):
            return
        key = f"{self.prefix}/call{n}"
        try:
            if self.store.add(f"{key}/{what}", 1) == self.world:
                self.store.set(f"{key}/all", what)
            why = self.until(functools.partial(_stored, self.store, f"{key}/all"))
        except Exception:                   # the store gone: its host rank died
            why = ""
        if why:
            raise RuntimeError(f"zero: {what}() #{n}: the ranks made other calls ({why}); {EVERY_RANK}")
        if why is not None:
            raise RuntimeError(f"zero: {what}() #{n}: the other ranks did not make this call within "
                               f"{self.timeout} ({self.report()}); {EVERY_RANK}")

    def post(self):
        # this rank's counts and last calls, where the others read them (a long wait, an error's report)
        if self.store is not None and self.posted != sum(self.calls.values()):
            self.store.set(f"{self.prefix}/last/{self.rank}", json.dumps([dict(self.calls), list(self.log)]))
            self.posted = sum(self.calls.values())

    def read(self, r):
        # what rank r posted, or None
        key = f"{self.prefix}/last/{r}"
        if self.store.check([key]):
            return json.loads(self.store.get(key))
        return None

    def compare(self):
        # this rank's calls against those ranks 0 and 1 posted (whoever made a call alone waits, or makes others
        # wait, with one of them): the first n-th call that differs, with both ranks' counts, or None
        if self.store is None:
            return None
        with contextlib.suppress(Exception):    # the store gone (its host rank died): nothing more to learn
            self.post()
            mine = dict(self.log)
            for r in {0, 1} - {self.rank}:
                theirs = self.read(r)
                for n, what in theirs[1] if theirs else ():
                    if n in mine and mine[n] != what:
                        more = _more_calls({self.rank: self.calls, r: theirs[0]})
                        lo, hi = sorted([(self.rank, mine[n]), (r, what)])
                        return "; ".join(more + [f"rank {lo[0]}: {lo[1]}() #{n}, rank {hi[0]}: {hi[1]}() #{n}"])
        return None

    def report(self):
        # what each rank called: this rank's counts and last calls posted to the store, the others' read
        if self.store is None:
            return f"rank {self.rank} called " + ", ".join(f"{w}() #{n}" for n, w in self.log)
        seen, deadline = {}, time.monotonic() + min(3.0, self.timeout.total_seconds() / 2)
        with contextlib.suppress(Exception):    # the store gone (its host rank died): what was read so far
            self.post()
            while len(seen) < self.world and time.monotonic() < deadline:
                for r in set(range(self.world)) - set(seen):
                    posted = self.read(r)
                    if posted is not None:
                        seen[r] = posted
                time.sleep(0.05 * (len(seen) < self.world))
        logs = {r: [f"{w}() #{n}" for n, w in log] for r, (_, log) in seen.items()}
        last = "; ".join(f"rank {r}: {log[-1]} (after {', '.join(log[-3:-1]) or 'nothing'})"
                         for r, log in sorted(logs.items())[:8] if log)
        return "; ".join(_more_calls({r: c for r, (c, _) in seen.items()}) + [last or "no rank said more"])


def _work_done(work, seconds):
    # a gloo work finished within `seconds`; a wait that timed out leaves it running (only a failure completes it)
    try:
        return work.wait(datetime.timedelta(seconds=seconds)) is not False
    except RuntimeError:
        if work.is_completed():
            raise
        return False


def _event_done(event, seconds):
    # a CUDA event reached within `seconds`, polled: a stream that never gets there cannot hang the CPU
    end = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > end:
            return False
        time.sleep(1e-4)
    return True


def _stored(store, key, seconds):
    # the store has `key` within `seconds`, polled (the store's own timed wait logs a warning at each timeout)
    end, pause = time.monotonic() + seconds, 1e-3
    while not store.check([key]):
        if time.monotonic() > end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return True


def _more_calls(counts):
    # "rank 1 made 1 forward() more than rank 0", from each rank's counts of its calls
    out = []
    for what in CALLS:
        c = {r: n.get(what, 0) for r, n in counts.items()}
        lo = min(c, key=c.get, default=None)
        out += [f"rank {r} made {k - c[lo]} {what}() more than rank {lo}" for r, k in c.items() if k > c[lo]]
    return out[:4]

# -----------------------------------------------------------------------------
# 3. Loss scaler
#
# fp16 flushes gradients under ~6e-8 to zero: a loss scale lifts them into range; one too large overflows to
# inf, which the step detects (the norm is not finite) and skips.

class LossScaler:
    """DeepSpeed's rule: double after `window` clean steps; on overflow skip the step, and once `hysteresis`
    overflows are used up, halve the scale."""

    def __init__(self, cfg):
        self.enabled = cfg.dtype == "fp16"
        self.scale = cfg.loss_scale if self.enabled else 1.0
        self.window = cfg.loss_scale_window     # clean steps before the scale doubles
        self.hysteresis = cfg.hysteresis        # overflows tolerated before it starts halving
        self.floor = cfg.min_loss_scale
        self.clean_steps = 0                    # since the last change or overflow
        self.hysteresis_left = cfg.hysteresis

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
            warnings.warn(f"zero: fp16 gradients overflow at the minimum loss scale {self.floor}; the step "
                          "is skipped again: lower the lr, check the data, or use bf16")
        else:
            self.scale = max(self.scale / 2, self.floor)

    def state_dict(self):
        return dict(scale=self.scale, clean_steps=self.clean_steps, hysteresis_left=self.hysteresis_left)

    def load_state_dict(self, sd):
        self.scale = sd["scale"]
        self.clean_steps = sd["clean_steps"]
        self.hysteresis_left = sd["hysteresis_left"]

# -----------------------------------------------------------------------------
# 4. AdamW
#
# The update is memory-bound on this rank's fp32 slice (master, exp_avg, exp_avg_sq). On CUDA torch's fused
# AdamW runs it; on the CPU a C kernel (built once into ~/.cache/zero_py; with no compiler, a warning and
# torch's) does torch's operations in one pass that also reads a bf16 gradient and writes the bf16 weights.
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
CONVERT_CHUNK = 1 << 22     # elements of a 16-bit gradient converted to fp32 at a time, into _scratch[device]
_kernel, _kernel_lock, _pools, _scratch = [], threading.Lock(), {}, {}   # _kernel: [] untried, [fn] or [None]


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


def _host_threads():
    # the cores this process may run on, shared by the node's ranks (under torchrun torch has only one thread)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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


def adamw_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult=1.0,
               out=None):
    """AdamW on 1-D fp32 tensors as torch's fused kernel computes it, grad_mult (unscale, clip) inside, the
    new master also into `out`: on the CPU one pass of the C kernel (fp32/bf16 grad and out), else torch's."""
    if not _c_takes(master, grad, exp_avg, exp_avg_sq, out):
        return _torch_adamw(master, grad, exp_avg, exp_avg_sq,
                            [(0, master.numel(), lr, beta1, beta2, eps, weight_decay, step)], grad_mult, out)
    if out is not None and out.dtype == torch.float32:   # fp32 compute with offload
        adamw_step(master, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_mult)
        return out.copy_(master)
    ts = [master, grad, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    n, next_block = master.numel(), ctypes.c_int64(0)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step   # in double, then rounded to float, as torch does
    consts = (ctypes.c_float * 10)(1 - lr * weight_decay, 1 / grad_mult, 1 - beta1, beta2, 1 - beta2,
                                   -lr / bc1, math.sqrt(bc2), eps)   # the kernel sets the last two
    kind = (grad.dtype == torch.bfloat16) + 2 * (out is not None) + 4 * (grad_mult != 1.0)
    ptrs = [t.data_ptr() for t in ts] + [None] * (out is None)
    return _parallel(_cpu_kernel(), n, (kind, n, ctypes.addressof(next_block), *ptrs, consts))


def adamw_runs(master, grad, exp_avg, exp_avg_sq, runs, grad_mult=1.0, out=None):
    """adamw_step on each run (a, b, lr, beta1, beta2, eps, weight_decay, step) of these tensors: the C kernel
    a run at a time; else torch's fused kernel, a multi-tensor call per hyperparameters (an entry per run)."""
    if not _c_takes(master, grad, exp_avg, exp_avg_sq, out):
        return _torch_adamw(master, grad, exp_avg, exp_avg_sq, runs, grad_mult, out)
    for a, b, lr, beta1, beta2, eps, weight_decay, step in runs:
        adamw_step(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step, lr, beta1, beta2, eps,
                   weight_decay, grad_mult, None if out is None else out[a:b])


def _c_takes(master, grad, exp_avg, exp_avg_sq, out):
    # the C kernel's tensors (CPU, fp32 state, an fp32 or bf16 gradient, a bf16 out or an fp32 one copied
    # after, 1-D of one length), and the kernel built
    ts = [master, grad, exp_avg, exp_avg_sq] + ([] if out is None else [out])
    takes = (torch.float32, torch.bfloat16)
    if grad.dtype not in takes or out is not None and out.dtype not in takes:
        return False
    if not master.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32:
        return False
    if not all(t.is_cpu and t.is_contiguous() and t.numel() == master.numel() for t in ts):
        return False
    return _cpu_kernel() is not None


def _torch_adamw(master, grad, exp_avg, exp_avg_sq, runs, grad_mult=1.0, out=None):
    # torch's fused kernel (torch >= 2.4's signature) on the runs (a, b, lr, beta1, beta2, eps, weight_decay,
    # step): one multi-tensor call per hyperparameters, a list entry and a step count per run. A 16-bit
    # gradient is converted to fp32 once: on a device all of it (a transient), on a CPU in chunks through
    # _scratch (a fresh fp32 copy costs more in page faults than the update), a call per chunk
    if not runs:
        return
    dev = master.device
    lo, hi = min(r[0] for r in runs), max(r[1] for r in runs)    # the span the runs cover
    chunk = CONVERT_CHUNK if grad.dtype != torch.float32 and dev.type == "cpu" else hi - lo
    inv_mult = torch.full((), 1.0 / grad_mult, device=dev) if grad_mult != 1.0 else None   # divides g
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


# -----------------------------------------------------------------------------
# 5. Flat buffers and units
#
# A unit is the grain of every collective and of stage 3's gathering: a transformer block, and a root for the
# rest, as FSDP users wrap by hand. Its parameters are views into flat buffers that one collective moves.

def find_units(model):
    """Default units: the elements (blocks) of every outermost nn.ModuleList, depth first."""
    return [u for c in model.children() for u in (c if isinstance(c, nn.ModuleList) else find_units(c))]


class Flat:
    """A unit's trainable, or its frozen, parameters as views into one flat buffer.
    dtype: the buffer's, the compute dtype (frozen tensors that are not floats: their own, never cast)
    cast: frozen floats held in fp32 (Config.frozen_dtype), cast to the compute dtype when gathered
    flat: the buffer (padded to equal shards; stage 3 frees its storage between uses)
    offsets, numel, end, padded: each parameter's start (on 16 bytes), their elements, where the last ends,
    the buffer's length (equal shards, each starting on 16 bytes); gaps: the elements no parameter holds
    lo, hi, owned: the range this rank owns, its values (stage 3: shard, kept; None if frozen fp32)
    state: what checkpoints hold: master (fp32; frozen: as held), exp_avg, exp_avg_sq (offload: on host)
    out: where an update writes the owned values (None: the master is them)
    grad: the whole gradient (stages 2-3: while reduced); grad_shard: its reduced owned slice (on host)
    acc, norm: offload: that summed over micro-batches (stages 2-3), its squared norm
    staging: offload on CUDA: the pinned 16-bit owned slice the update writes first
    segments: (a, b, i): parameter i's owned piece [a, b), from lo
    steps, group, written, got: per parameter: AdamW steps, param group; gradient in grad / came this step"""

    def __init__(self, named_params, trainable, plan, sharded, dtype=None):
        self.trainable, self.state = trainable, {}
        self.dtype = dtype or plan.dtype
        self.cast = dtype is None and not trainable and plan.frozen_fp32
        self.names, self.params = [n for n, _ in named_params], [p for _, p in named_params]
        sizes = [p.numel() for p in self.params]
        # every parameter's view, and every rank's slice, starts on 16 bytes: one odd size would misalign all
        # the views after it (cuBLAS's slower paths, torch.compile's recompiles); the gaps hold zeros
        align, self.offsets, self.end = max(1, 16 // self.dtype.itemsize), [], 0
        for n in sizes:
            self.offsets.append(-(-self.end // align) * align)
            self.end = self.offsets[-1] + n
        self.numel = sum(sizes)
        grain = plan.shards * align         # equal shards, as collectives want, each on 16 bytes
        self.padded = -(-self.end // grain) * grain
        self.gaps = torch.cat([torch.arange(o + n, nxt) for o, n, nxt in
                               zip(self.offsets, sizes, self.offsets[1:] + [self.padded])]).to(plan.device)
        rank, size = (plan.shard_rank, self.padded // plan.shards) if sharded else (0, self.padded)
        self.lo, self.hi = rank * size, (rank + 1) * size
        self.segments = [(max(o, self.lo) - self.lo, min(o + n, self.hi) - self.lo, i)
                         for i, (o, n) in enumerate(zip(self.offsets, sizes))
                         if max(o, self.lo) < min(o + n, self.hi)]
        self.steps, self.group, self.written, self.got = [0] * len(sizes), [0] * len(sizes), set(), set()
        self.flat = self.shard = self.owned = self.out = self.grad = self.grad_shard = None
        self.acc = self.norm = self.staging = None

    def build(self, full, plan, state):
        """The buffers from `full`, the fp32 values (or the frozen ones' own); state(kind, n, dtype, src) makes
        host state. Returns the frozen parameters that the compute dtype changes."""
        self.flat, mine, n = full.to(self.dtype), full[self.lo:self.hi], self.hi - self.lo
        for p, o in zip(self.params, self.offsets):
            p.data = self.flat[o:o + p.numel()].view(p.shape)
        self.owned = self.flat[self.lo:self.hi]
        if plan.shards_params:
            self.owned = self.shard = None if self.cast else self.owned.clone()
        if self.trainable:
            self.state = dict(master=self.owned if plan.master_is_param else state("master", n, src=mine),
                              exp_avg=state("exp_avg", n), exp_avg_sq=state("exp_avg_sq", n))
            if not plan.shards_grads:       # the whole gradient stays; stage 1 owns a slice of it
                self.grad = torch.zeros(self.padded, dtype=plan.grad_dtype, device=plan.device)
                self.grad_shard = self.grad[self.lo:self.hi]
            if plan.shards_grads or plan.offload:
                self.grad_shard = state("grad_shard", n, plan.grad_dtype)
            if plan.offload and plan.shards_grads and (plan.accum > 1 or plan.replicas > 1):
                self.acc = torch.zeros(n, dtype=plan.grad_dtype, device=plan.device)
            if plan.pin:
                self.staging = state("staging", n, plan.dtype)
        else:                               # frozen fp32: exact, cast when gathered
            self.state = dict(master=mine.clone() if self.cast else self.owned)
        self.out = None if self.state["master"] is self.owned else self.owned
        return [] if self.trainable or self.cast or not self.dtype.is_floating_point else [
            n for n, p, o in zip(self.names, self.params, self.offsets)
            if not torch.equal(full[o:o + p.numel()], self.flat[o:o + p.numel()].float())]

    def runs(self, used, hyper):
        # AdamW calls: one per run of adjacent parameters with a gradient, equal hyperparameters and steps
        runs = []
        for a, b, i in (seg for seg in self.segments if used[seg[2]]):
            key = (self.group[i], self.steps[i])
            if runs and runs[-1][1:] == [a, key]:
                runs[-1][1] = b
            else:
                runs.append([a, b, key])
        return [(a, b, *hyper[g], step) for a, b, (g, step) in runs]


FREED, GATHERING, WHOLE = "freed", "gathering", "whole"


class Unit:
    """A block (an element of the outermost ModuleList) or the root (the rest): its Flats (train: the
    trainable one) and lifecycle. phase: FREED (stage 3 between uses; offload at stages 1-2: others' slices
    stale) -> GATHERING (works in flight) -> WHOLE; the root and units with a parameter used outside their
    forward (keep) stay WHOLE to the backward's end. reduced: the micro-batch's reduction launched;
    replica_work: hybrid's sum across groups; worker, updated, d2h, h2d: offload's thread, its update done,
    the events of its copies (Copies) to the host and back; grad_out: an output requires grad (None: never
    ran); call: the schedule's node."""

    def __init__(self, index, module, name, flats, plan, net, is_root):
        self.index, self.module, self.name, self.flats, self.is_root = index, module, name, flats, is_root
        self.plan, self.net, self.params = plan, net, [p for f in flats for p in f.params]
        self.train = next((f for f in flats if f.trainable), None)
        self.phase, self.works, self.keep, self.reduced = WHOLE, [], False, False
        self.grad_out = self.call = self.replica_work = self.worker = self.d2h = self.h2d = None
        self.updated = threading.Event()
        self.updated.set()

    def unshard(self, wait=True):
        # all-gathers launched (stage 3: from the shards; offload: from the host update's), then waited
        if self.phase == FREED:
            if self.worker:
                self.worker.wait(self)
            for f in self.flats if self.plan.shards_params else [self.train]:
                st = f.flat.untyped_storage()
                if self.plan.shards_params and not st.nbytes():
                    st.resize_(f.padded * f.flat.element_size())
                    self.net.count_held(st.nbytes())
                src = f.shard if f.shard is not None else f.flat[f.lo:f.hi] if f.trainable else \
                    f.state["master"].to(self.plan.dtype)
                kind = "all_gather" if f.trainable else "frozen_all_gather"
                self.works.append(self.net.all_gather(f.flat, src, kind, sync=False, tag=self.index))
            self.phase = GATHERING
        if wait and self.phase == GATHERING:
            for w in self.works:
                self.net.wait(w)
            self.works, self.phase = [], WHOLE
            self.mark(False)
        return self

    def reshard(self):
        # stage 3: the storage goes back (the views, and autograd's references, stay valid)
        for f in self.flats if self.plan.shards_params else ():
            self.net.count_held(-f.flat.untyped_storage().nbytes())
            f.flat.untyped_storage().resize_(0)
        if torch.is_autocast_enabled(self.plan.device.type):
            torch.clear_autocast_cache()    # its casts of these weights would answer for them once freed
        self.phase = FREED
        self.mark(True)

    def stale(self):                        # the owned slices changed: gather before the next use
        self.phase = FREED
        return self

    def mark(self, freed):
        # a unit not WHOLE has _Sharded parameters: a read is an error or a gather, not a crash
        ps = self.params if self.plan.shards_params or not freed else self.train.params if self.train else ()
        for p in ps:
            if type(p) in (nn.Parameter, _Sharded):
                p.__class__ = _Sharded if freed else nn.Parameter

    def release(self):                      # stage 3: done with for now, and not kept whole
        if self.plan.shards_params and self.phase == WHOLE and not self.keep and not self.is_root:
            self.reshard()

    def hold(self):
        self.keep = True

    def in_turn(self, agreed):
        # kept whole on this rank alone (a parameter escaped since the ranks agreed): gathered in turn, as
        # the ranks that freed it do
        if self.plan.shards_params and self.phase == WHOLE and self.keep and not agreed:
            self.phase = FREED
        return self

    def take_grad(self, i, p):
        # autograd's .grad into the flat one at once (stages 2-3: one for this micro-batch only)
        f, o, n = self.train, self.train.offsets[i], p.numel()
        if f.grad is None:
            f.grad = torch.empty(f.padded, dtype=self.plan.grad_dtype, device=self.plan.device)
        with torch.no_grad():
            (f.grad[o:o + n].add_ if i in f.written else f.grad[o:o + n].copy_)(p.grad.view(-1))
        f.written.add(i)
        f.got.add(i)
        p.grad = None

    def reduce(self):
        # stage 0 all-reduces, the rest reduce-scatter; unused gradients are zero, not last window's; part
        # of the mean before the sum, the rest in the step
        f, plan = self.train, self.plan
        g = f.grad if f.grad is not None else torch.zeros(f.padded, dtype=plan.grad_dtype, device=plan.device)
        for i, (p, o) in enumerate(zip(f.params, f.offsets)):
            if i not in f.written:
                g[o:o + p.numel()].zero_()
        g.index_fill_(0, f.gaps, 0)         # and the gaps between parameters: torch.empty's, never written
        f.grad, f.written, self.reduced = g, set(range(len(f.params))), True
        g.mul_(1.0 / plan.divide[0])
        if plan.shards_optim:
            return self.net.reduce_scatter(g[f.lo:f.hi], g, sync=False, tag=self.index)
        return self.net.all_reduce(g, "shard", kind="all_reduce", sync=False, tag=self.index)

    def finish_reduce(self, work, micro):
        # summed over micro-batches; the step's last: hybrid sums across groups, offload sends it off
        self.net.wait(work)
        f, plan = self.train, self.plan
        last, mine = micro == plan.accum - 1 or not plan.shards_grads, f.grad[f.lo:f.hi]
        dev = f.acc if f.acc is not None else mine if plan.offload else f.grad_shard
        if plan.shards_grads and dev is not mine:
            dev.copy_(mine) if micro == 0 else dev.add_(mine)
        if last and plan.replicas > 1:
            work = self.net.all_reduce(dev, "replica", "replica_all_reduce", False, self.index)
            self.replica_work = dev, work
        elif last and plan.offload:
            self.to_host(dev)
        if plan.shards_grads:
            f.grad, f.written = None, set()

    def finish_replica(self):
        if self.replica_work is not None:
            (dev, work), self.replica_work = self.replica_work, None
            self.net.wait(work)
            if self.plan.offload:
                self.to_host(dev)

    def to_host(self, dev):
        # once a step (the paper's minimal traffic); the norm first, on the compute stream, so that the step
        # need not wait; the copy on a stream of its own, which the host update waits for
        self.train.norm = torch.linalg.vector_norm(dev, dtype=torch.float32) ** 2
        self.d2h = self.worker.copies.to_host(self.train.grad_shard, dev)
        self.net.count("d2h", dev.numel(), dev.element_size())

    def sq_norm(self):
        if self.plan.offload:
            return self.train.norm
        g = self.train.grad_shard
        if self.plan.shards_optim:
            return torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        # stage 0: the whole gradient's as the sum over the slices stages 1-3 own, in fp64 as theirs is: the
        # norm's rounding, which the clip carries into every update, does not depend on the stage
        pieces = [torch.linalg.vector_norm(p, dtype=torch.float32) ** 2 for p in g.view(self.plan.shards, -1)]
        return torch.stack(pieces).double().sum()

    def update(self, mult, runs):
        # AdamW on the owned slice; no collective (offload: on its thread; the next forward gathers)
        assert self.phase == FREED or not self.plan.shards_params, f"{self.name} is whole across an update"
        f, st = self.train, self.train.state
        if self.worker is not None:         # its gradient on the host; the last copy out of staging done
            self.worker.copies.wait(self.d2h, self.h2d)
        out = f.staging if f.staging is not None else f.out
        adamw_runs(st["master"], f.grad_shard, st["exp_avg"], st["exp_avg_sq"], runs, mult, out)
        if f.staging is not None:           # runs only: a parameter without a gradient keeps its value
            self.h2d = self.worker.copies.to_device([(f.out[a:b], f.staging[a:b]) for a, b, *_ in runs])


def _regather(units):
    # stages 1-2 after an update or a load: the owned slices to every rank, all launched before any wait
    for wait in (False, True):
        for u in units:
            u.unshard(wait)


def _tree_map(fn, x, rebuild=True):
    """fn on every tensor in tuples (named too), lists, dicts, dataclasses (Hugging Face's ModelOutput),
    rebuilt around fn's results (rebuild=False: only visited)."""
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
    """The identity on a unit's inputs: its backward runs once all their gradients are in, when the unit's
    backward is done (FSDP2's post-backward signal)."""

    @staticmethod
    def forward(ctx, sched, unit, key, *xs):
        ctx.sched, ctx.unit, ctx.key = sched, unit, key
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.sched.post_backward(ctx.unit, ctx.key)
        return (None, None, None, *grads)


# torch calls that read no values of a tensor
METADATA = {"__get__", "__set__", "requires_grad_", "size", "dim", "numel", "stride", "element_size",
            "is_contiguous", "is_floating_point", "register_hook", "register_post_accumulate_grad_hook",
            "untyped_storage", "data_ptr", "storage_offset"}
_PLAIN = nn.Parameter.__torch_function__    # torch's dispatch, as for any nn.Parameter


class _Sharded(nn.Parameter):
    """A parameter's class while its unit is not WHOLE (and, in the first forward, not running). Read in a
    forward, it is used outside its block: its unit is gathered and kept whole. Outside one: an error."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name, attr = getattr(func, "__name__", ""), getattr(getattr(func, "__self__", None), "__name__", "")
        for t in _tensors((args, kwargs)) if name not in METADATA or attr == "data" else ():
            sched = t._zero_owner[0]() if type(t) is _Sharded else None
            if sched is None:               # its engine was dropped: the plain tensor it is
                continue
            sched.read_outside(sched.units[t._zero_owner[1]], t._zero_name)
        return _PLAIN(func, types, args, kwargs or {})


def _on_grad(sched, j, i, p):
    # torch holds the hook, unseen by the collector: the schedule weakly, the unit by number, or never freed
    if (s := sched()) is not None:
        s.on_grad(s.units[j], i, p)

# -----------------------------------------------------------------------------
# 6. The schedule: one order of collectives on every rank
#
# A rank whose batch skips a block or reaches fewer experts must still pair each collective with the same one
# everywhere (one order across communicators, too, for NCCL): all walk one order, gathering what they skip.

def _merge(seqs, extra=()):
    """One order of the nodes (segment, occurrence, unit) of every rank's calls, consistent with each rank's
    own; ties, and `extra` nodes nobody ran, by the node itself; rank 0's order where the orders clash."""
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
    """The one order of a micro-batch's gathers and reductions, the same on every rank whatever the data, and
    the hooks that walk it. A place is one call: the k-th of unit u in a micro-batch's s-th forward (its
    segment) is node (s, k, u). Forwards walk their segment of `places`, the backward them reversed (`back`),
    gathering each unit (stage 3); past a unit's last place its reduction launches, in `launch` order.
    Invariant: every rank launches the same collectives in the same order, so every wait is for one all
    launched; waiting for the reduction two launches back keeps three whole-unit gradients alive at most."""

    def __init__(self, units, plan, net):
        self.units, self.plan, self.net = units, plan, net
        self.order = [u for u in units if not u.is_root]   # the blocks: as registered, then as first called
        # modules outside the units now running (nested); the unit whose forward ran last; units run this step
        self.depth, self.last_ran, self.ran = 0, None, []
        # the running forward's segment (None: none runs), its next place, its end, its calls of each unit
        self.walk, self.pos, self.end, self.count = None, 0, 0, collections.Counter()
        # calls (nodes) with a backward to come, in `segments` forwards; forwards without one since the last
        # with one; backward calls since the last step
        self.calls, self.segments, self.evals, self.micro = [], 0, 0, 0
        self.checked = self.learned = False  # the first forward ran; the first backward learned the order
        self.in_backward = False            # inside engine.backward: a bare loss.backward() is refused
        self.arrange([self.order])

    def arrange(self, segments, without=frozenset(), keep=frozenset()):
        # the backward's places are the forwards' reversed, less the units whose forward made nothing that
        # requires grad; the units in `keep` are whole, and reduced last
        self.segs, self.without, self.keep = segments, without, frozenset(keep)
        self.places, self.node, self.ends = [], {}, []
        for s, seg in enumerate(segments):
            for k, u in enumerate(seg):
                self.node[(s, seg[:k].count(u), u.index)] = len(self.places) + k
            self.places += seg
            self.ends.append(len(self.places))
        self.back = [j for j in reversed(range(len(self.places))) if self.places[j].index not in without]
        self.bpos = {j: k for k, j in enumerate(self.back)}
        last = {self.places[j].index: k for j, k in self.bpos.items()}   # a unit's last backward place
        self.last = {i: k for i, k in last.items() if i not in self.keep}
        self.launch = sorted((u for u in self.units if u.train), key=lambda u: self.last.get(u.index, END))
        self.order = list(dict.fromkeys(self.places + self.order))
        for i in self.keep:
            self.units[i].hold()
        self.start_backward()

    def start_backward(self):
        self.done = self.gathered = self.launched = 0   # backward places done / gathered; units launched
        self.in_flight = collections.deque()            # (unit, work) of reductions launched, not waited for
        for u in self.units:
            u.reduced = False

    def learn(self):
        """The first backward: the ranks agree on the order their forwards called the blocks in (maybe not the
        order registered, maybe one twice), on the units kept whole, and on those with no backward."""
        seen = {u.index: u.grad_out for u in self.order if u.grad_out is not None}
        ends = [(s, END, END) for s in range(self.segments)]
        mine = sorted(self.calls + ends, key=lambda x: (x[0], x[1] == END))
        every = self.net.all_gather_object((mine, [u.index for u in self.units if u.keep], seen))
        grads = [(i, g) for *_, s in every for i, g in s.items()]
        without = {i for i, g in grads if not g} - {i for i, g in grads if g}
        segments = [[]]
        for _, k, i in _merge([s for s, _, _ in every], [(0, 0, u.index) for u in self.order]):
            segments[-1].append(self.units[i]) if k != END else segments.append([])   # an end starts the next
        self.arrange(segments[:-1] or segments, without, {i for _, k, _ in every for i in k})
        self.learned = True

    def read_outside(self, u, name):
        """A parameter of u read where u is not gathered (outside its block). In the first forward, which every
        rank runs alike, u is gathered and kept whole from then on; later, gathering it here would be this
        rank's collective alone (a hang, or a wrong pairing): refused."""
        if self.depth == 0:
            raise RuntimeError(f"zero: '{name}' was read outside the model's forward, where its unit is not "
                               "gathered: read weights from engine.full_state_dict()")
        if self.checked:
            raise RuntimeError(f"zero: '{name}' was read outside its block '{u.name}' after the first forward, "
                               "which did not read it so: gathering it now would be this rank's collective "
                               "alone. Read it in every forward from the first, or pass zero.Zero(..., "
                               "units=[...]) without its block")
        u.hold()
        u.unshard().mark(False)

    def alone(self, u, what):
        """u gathered outside the walk (called out of turn, or more often than its places). Before the first
        backward learned the order every rank does the same; after it, where u is not whole, the gather would
        be this rank's alone: refused by name."""
        if self.learned and u.phase != WHOLE:
            raise RuntimeError(f"zero: '{u.name}' was {what} than in the first step, which gathering it would "
                               "make this rank's collective alone: call the blocks as in the first step")
        u.unshard()

    def before_update(self):
        """Nothing is whole across an update, which the step relies on: a forward nobody backwarded (a loss for
        a log line) left its root and kept units whole with the weights the update is about to change; they
        are freed (stage 3), and its calls forgotten."""
        self.calls, self.segments = [], 0
        for u in self.units if self.plan.shards_params else ():
            if u.phase != FREED:
                u.unshard().reshard()       # (a gather in flight finishes first)

    def agree_keep(self, keep):
        # units whose parameters escaped on a rank since the last agreement: whole, reduced last, from now on
        if self.learned and not keep <= self.keep:
            self.arrange(self.segs, self.without, keep | self.keep)

    # -- walking the places
    def take(self, u, nxt, back):
        # u gathered, and the next unit's gather started to travel while u computes (with offload only once
        # the host update is done with it: waiting here would undo the overlap)
        u.in_turn(u.index in self.keep).unshard()
        if nxt is not None and nxt is not u and self.plan.prefetch and \
                (back or self.plan.gathers_lazily) and nxt.updated.is_set():
            nxt.in_turn(nxt.index in self.keep).unshard(wait=False)

    def forward_to(self, j):
        """The forward's walk up to place j (None: its segment's end), gathering and freeing the places this
        rank did not call, then j's: skipping B of A, B, C, it gathers A, then as C starts B (freed) and C."""
        at = lambda p: self.places[p] if p < self.end else None   # noqa: E731
        for p in range(self.pos, self.end if j is None else j + 1):
            u = self.places[p]
            self.take(u, at(p + 1), False)
            self.pos = p + 1
            if p != j and at(p + 1) is not u:   # j's unit stays whole for its call, as does one next
                u.release()

    def backward_to(self, k, gather=False):
        """The backward's walk up to backward place k, as forward_to's, launching the reductions of the units
        past their last place; with gather, k's unit gathered too and the next one's gather started."""
        at = lambda k: self.places[self.back[k]] if k < len(self.back) else None   # noqa: E731
        for d in range(self.done, min(k + gather, len(self.back))):
            u = at(d)
            if self.plan.shards_params and self.gathered <= d:
                self.take(u, at(d + 1), True)
                self.gathered = d + 1
            if d < k:
                self.done = d + 1
                self.launch_ready()
                if at(d + 1) is not u:      # the same unit next: it stays whole
                    u.release()

    def launch_ready(self, end=False):
        # in launch order, each unit once the backward is past its last place (end: all the rest), as on every
        # rank; in every micro-batch's backward where the whole gradients are freed (2-3), else in the last's
        plan = self.plan
        now = plan.shards_grads or self.micro == plan.accum - 1
        while now and self.launched < len(self.launch):
            u = self.launch[self.launched]
            if not end and self.last.get(u.index, END) >= self.done:
                return
            self.launched += 1
            self.reduce(u)

    def reduce(self, u):
        # u's reduction launched; at stages 2-3 the one two launches back waited for (stream-ordered on NCCL)
        self.in_flight.append((u, u.reduce()))
        self.drain(2 if self.plan.shards_grads else len(self.in_flight))

    def drain(self, keep=0):
        # the oldest reductions in flight finished, all but `keep`
        while len(self.in_flight) > keep:
            u, work = self.in_flight.popleft()
            u.finish_reduce(work, self.micro)

    # -- forward hooks: opaque to torch.compile, whose graphs break where a unit begins or ends
    @torch.compiler.disable
    def enter(self):
        # a forward starts with the first module outside the units (the model, or a part, e.g. an encoder)
        self.depth += 1
        if self.depth > 1:
            return
        grad = torch.is_grad_enabled()
        if self.plan.gathers_lazily:        # after evaluation forwards: checked that every rank made as many
            self.net.call("forward" if grad else "no_grad forward", check=self.evals and grad)
            self.evals = 0 if grad else self.evals + 1
        if self.last_ran is not None:       # a block called on its own since the last forward
            self.last_ran.release()
        # a forward without a backward to come (evaluation, a metric, a teacher) walks the first segment,
        # leaving the training walk where it was. One past the learned segments follows forwards nobody
        # backwarded (a loss for a log line, a refused loss.backward()): it walks them again from the first
        s, b = self.segments if grad else 0, [0, *self.ends]
        if self.learned:
            s %= len(self.segs)
        self.walk, self.pos, self.end = s, b[min(s, len(b) - 1)], b[min(s + 1, len(b) - 1)]
        self.count, self.last_ran = collections.Counter(), None
        self.segments += grad
        # the root and the units the ranks agree to keep stay whole through the backward (a unit kept on this
        # rank alone is gathered in its turn, as the others gather it); in the first forward the others are
        # _Sharded while they do not run, so that a parameter used out of its block is seen (see _Sharded)
        for u in self.units:
            if u.is_root or u.index in self.keep:
                u.unshard()
            elif not self.checked:
                u.mark(True)

    @torch.compiler.disable
    def exit(self, module, args, output):
        self.depth -= 1
        if self.depth:
            return
        if self.last_ran is not None:
            self.last_ran.release()
        self.last_ran = None
        if self.walk is None:               # no forward began (enter() raised, or never ran)
            return
        self.forward_to(None)               # places after the last one this rank called
        # no backward follows (evaluation, generation): freed, but what a backward to come needs
        self.walk, free = None, self.plan.shards_params and not torch.is_grad_enabled()
        for u in self.units:
            if u.phase == WHOLE and free and not (self.calls and (u.is_root or u.keep)):
                u.reshard()
            elif u.phase == WHOLE and not self.checked:
                u.mark(False)               # the first forward's marks go
        self.checked = True

    @torch.compiler.disable
    def pre_forward(self, u, module, args, kwargs):
        if self.last_ran is not None and self.last_ran is not u:
            self.last_ran.release()         # freed once another unit starts: a unit run twice in a row stays
        key = None if self.walk is None else (self.walk, self.count[u.index], u.index)   # None: called alone
        self.count[u.index] += 1
        if self.plan.shards_params and self.plan.dtype == torch.float32 and torch.is_grad_enabled() and \
                torch.is_autocast_enabled(self.plan.device.type):
            raise RuntimeError("zero: torch.autocast around a stage-3 forward in fp32 keeps a 16-bit copy of "
                               "every weight it gathers until the backward (the whole model): drop the autocast "
                               "and use Config(dtype='bf16') (16-bit compute on fp32 masters, as autocast's)")
        j = self.node.get(key)              # out of turn (called more often, or its place passed): alone
        if j is not None and self.pos <= j < self.end:
            self.forward_to(j)
        elif key is None:                   # a block the script calls on its own, as every rank does
            u.unshard()
        else:
            self.alone(u, "called in a forward more often, or in another order,")
        u.mark(False)
        self.last_ran, u.call = u, key
        self.ran.append(u.index)
        xs = [t for t in _tensors((args, kwargs)) if t.requires_grad] if torch.is_grad_enabled() else []
        if torch.is_grad_enabled() and key is not None:
            self.calls.append(key)
        if xs:                              # their backward ends this call's: _PostBackward says when
            ys = dict(zip(map(id, xs), _PostBackward.apply(self, u, key, *xs)))
            return _tree_map(lambda t: ys.get(id(t), t), (args, kwargs))

    @torch.compiler.disable
    def post_forward(self, u, module, args, kwargs, output):
        if not self.checked and not u.keep:
            u.mark(True)                    # the first forward: used out of its forward from here on?
        if not torch.is_grad_enabled():
            return
        outs, inputs = _tensors(output), {id(t) for t in _tensors((args, kwargs))}
        u.grad_out = bool(u.grad_out) or any(t.requires_grad for t in outs)
        storages = {f.flat.untyped_storage().data_ptr() for f in u.flats}
        for t in outs if self.plan.shards_params else ():
            if t.untyped_storage().data_ptr() in storages:
                u.hold()                    # a parameter returned to the caller: whole until its backward
            elif t.requires_grad and id(t) not in inputs:
                # gathered again just before this call's backward (and recompute); a tensor it only passed
                # along is not hooked: its gradient says nothing about this unit's backward
                t.register_hook(functools.partial(self.pre_backward, u, u.call))

    # -- backward hooks
    def outside(self):
        if not self.in_backward:
            raise RuntimeError("zero: a backward ran outside engine.backward(loss) (loss.backward(), or a "
                               "GradScaler's): call engine.backward(loss), then engine.step()")

    @torch.compiler.disable
    def pre_backward(self, u, key, grad):
        # a call's backward (or its recompute) starts: u whole, the schedule past the places before it
        self.post_backward(u, key, start=True)

    def post_backward(self, u, key, start=False):
        # a call's backward ends (start: begins, u gathered): the schedule past its place; out of turn u alone
        self.outside()
        k = self.bpos.get(self.node.get(key))
        if k is not None and k >= self.done:
            self.backward_to(k if start else k + 1, gather=start)
        elif start and key is None:
            u.unshard()
        elif start:
            self.alone(u, "backwarded more often, or in another order,")

    def on_grad(self, u, i, p):
        if p.grad is None:
            return
        if not self.in_backward or u.reduced:
            p.grad = None                   # nothing of it is kept for the next step
            self.outside()
            raise RuntimeError(f"zero: the gradient of '{u.train.names[i]}' came after its unit '{u.name}' "
                               "was reduced (a use outside its block the first forward did not show, or "
                               "another order of blocks): pass zero.Zero(..., units=[...]) without its block")
        u.take_grad(i, p)

    def end_backward(self):
        self.backward_to(len(self.back))    # what this rank's backward did not reach, in its turn
        self.launch_ready(end=True)         # the units that stay whole, and the root
        self.drain()
        for u in self.units:                # stage 3: what is still whole (the root, escaped units) goes now
            if self.plan.shards_params and u.phase == WHOLE:
                u.reshard()
        self.calls, self.segments = [], 0
        self.micro += 1


# -----------------------------------------------------------------------------
# 7. The engine
#
# A step: forward (stage 3 gathers each unit before it runs, frees it after) -> backward (a unit's gradient is
# reduced once its backward is done; stage 3 gathers it again first) -> step (norm, overflow check, clip,
# AdamW on the owned slice, its 16-bit rounding written, stages 1-2 all-gather it). The units do each part,
# the schedule says when; the engine builds them, glues the hooks, and runs backward and step.

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
# torch's Adam/AdamW keys that zero's AdamW honours at these values only (TORCH_ANY: at any value)
TORCH_DEFAULTS = dict(amsgrad=False, maximize=False, capturable=False, differentiable=False)
TORCH_ANY = {"foreach", "fused", "decoupled_weight_decay", "initial_lr"}
_ENGINES = weakref.WeakSet()        # every live engine: for the check of torch optimizers, and the exit
_torch_clip, _torch_compile = torch.nn.utils.clip_grad_norm_, torch.compile


class ZeroOptimizer(torch.optim.Optimizer):
    """torch's face of the engine's AdamW: the param_groups that LR schedulers and user code write, read by
    every step; step() is engine.step(). Made from torch's param groups, or from a torch Adam/AdamW, whose
    groups it shares (its schedulers drive the engine) and whose step() becomes the engine's."""

    def __init__(self, engine, param_groups=None, optimizer=None):
        self.engine, c, adopt = engine, engine.cfg, optimizer is not None
        where = {id(p): (u.train, i) for u in engine.units if u.train for i, p in enumerate(u.train.params)}
        name = {id(p): n for n, p in engine.module.named_parameters()}
        if adopt and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"zero.Zero: optimizer={type(optimizer).__name__}; zero steps AdamW: pass a "
                             "torch.optim.AdamW (or Adam), or none")
        groups = optimizer.param_groups if adopt else list(param_groups or [])
        groups = [dict(params=groups)] if groups and not isinstance(groups[0], dict) else groups  # one group
        out, seen = [], {}
        for j, g in enumerate(groups):
            unknown = sorted(set(g) - {"params", *GROUP_KEYS, *TORCH_DEFAULTS, *TORCH_ANY})
            bad = [f"{k}={g[k]}" for k, v in TORCH_DEFAULTS.items() if g.get(k, v) != v]
            if type(optimizer) is torch.optim.Adam and g["weight_decay"] and \
                    not g.get("decoupled_weight_decay"):
                bad.append(f"weight_decay={g['weight_decay']} as Adam's L2 penalty")
            if unknown or bad:
                raise ValueError(f"zero.Zero: param_groups[{j}] " + (
                    f"has unknown keys {unknown}; zero's AdamW takes {['params', *GROUP_KEYS]}" if unknown
                    else f"sets {bad}, which zero's AdamW cannot do") + " (other keys at torch's defaults)")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            # an adopted optimizer may hold frozen parameters: they get no gradient
            for p in ps:
                if id(p) not in where and (not adopt or id(p) not in name):
                    what = f"'{name[id(p)]}', which does not require grad" if id(p) in name else \
                        f"a tensor of shape {tuple(p.shape)} that is not a parameter of the model"
                    raise ValueError(f"zero.Zero: param_groups[{j}] holds {what}; list trainable parameters")
                if seen.setdefault(id(p), j) != j:
                    raise ValueError(f"zero.Zero: '{name[id(p)]}' is in param_groups {seen[id(p)]} and {j}")
            out.append(g if adopt else dict(g, params=list(dict.fromkeys(ps))))
        rest = [f.params[i] for f, i in where.values() if id(f.params[i]) not in seen]
        if adopt and rest:
            raise ValueError(f"zero.Zero: {[name[id(p)] for p in rest][:5]} require grad but are in no param "
                             "group of the optimizer; add them to it, or freeze them before zero.Zero")
        # parameters in no group: Config's values, weight decay on >= 2-D ones only
        out += [g for g in (dict(params=[p for p in rest if p.dim() >= 2]),
                            dict(params=[p for p in rest if p.dim() < 2], weight_decay=0.0)) if g["params"]]
        for j, g in enumerate(out):         # each parameter's group, in its flat buffer
            for f, i in (where[id(p)] for p in g["params"] if id(p) in where):
                f.group[i] = j
        super().__init__(out, dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay))
        if adopt:                           # the script's optimizer, driven by the engine from now on
            def step(closure=None):
                optimizer._opt_called = True    # what torch's LR schedulers look for
                return engine.step()
            step._wrapped_by_lr_sched = True
            optimizer.step, optimizer.zero_grad = step, self.zero_grad
            optimizer.state_dict = optimizer.load_state_dict = self.state_dict

    def step(self, closure=None):
        return self.engine._step()

    def zero_grad(self, set_to_none=True):
        """Nothing to do: the engine moves each gradient into its flat buffer as it arrives."""

    def state_dict(self, *args, **kwargs):
        raise RuntimeError("zero: the optimizer's state is in the engine's shards: use zero.save/zero.load")

    load_state_dict = state_dict


def _foreign_step(opt, args, kwargs):
    # a torch optimizer stepping an engine's parameters changes nothing: the engine takes their gradients
    if not isinstance(opt, ZeroOptimizer) and any(id(p) in e.owned for e in _ENGINES for g in opt.param_groups
                                                  for p in g["params"]):
        raise RuntimeError(f"zero: a torch.optim.{type(opt).__name__} is stepping parameters zero.Zero owns, "
                           "which changes nothing: pass it as zero.Zero(model, cfg, optimizer=opt)")


@functools.wraps(_torch_clip)
def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    # DDP's clip of an engine's parameters, whose gradients are in its shards: the engine's clip, as under DDP
    ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = next((e for e in _ENGINES for p in ps[:1] if id(p) in e.owned), None)
    if owner is None:
        return _torch_clip(ps, max_norm, norm_type, error_if_nonfinite, foreach)
    if {id(p) for p in ps if p.requires_grad} != {id(p) for u in owner.units if u.train
                                                   for p in u.train.params}:
        raise ValueError("zero: clip_grad_norm_ takes all the engine's parameters: pass model.parameters()")
    return owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


def _compile(model=None, **kwargs):
    # torch.compile(engine) compiles the model inside it (as if before wrapping) and returns the engine
    if isinstance(model, Zero):
        model._forward = _torch_compile(model._forward, **kwargs)
        return model
    return _torch_compile(**kwargs) if model is None else _torch_compile(model, **kwargs)


register_optimizer_step_pre_hook(_foreign_step)
torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_
torch.compile = functools.wraps(_torch_compile)(_compile)


@atexit.register
def _close_groups():
    # at exit, wait for what is in flight and destroy the process groups so that their gloo threads end before
    # Python finalizes: one dropping a finished collective's tensors then aborts the process ("terminate
    # called without an active exception")
    engines = list(_ENGINES)
    try:
        for w in [w for e in engines for u in e.units for w in u.works] + [w for e in engines for _, w in
                                                                          e.sched.in_flight]:
            if w is not None:               # (one rank: nothing was launched)
                w.wait(datetime.timedelta(seconds=5))
    except RuntimeError:                    # a collective that failed or never ends: joining could hang
        return
    for e in engines:
        e.sched.in_flight, e.net.groups = collections.deque(), {}
        for u in e.units:
            u.works = []
    while _GROUPS:                          # dropping each one's last reference joins its threads
        with contextlib.suppress(Exception):   # one the script destroyed already
            dist.destroy_process_group(_GROUPS.popitem()[1])


class Zero:
    """Wraps a model: shards it in place into units, hooks its forward and backward, and steps AdamW on this
    rank's shard. Call it like the model (whose other attributes it lends), then backward(loss), step()."""

    def __init__(self, model, cfg=None, units=None, init_fn=None, param_groups=None, group=None,
                 optimizer=None):
        self.cfg = cfg = (cfg or Config()).validate()   # a bad config fails here, before any collective
        self.module, self._forward = getattr(model, "_orig_mod", model), model   # compiled: its own names
        self.net = net = Comm(cfg, group)
        self.plan = plan = Plan.of(cfg, net)
        self.rank, self.world, self.device, self.dtype = net.rank, net.world, net.device, plan.dtype
        # steps applied (an fp16 overflow skips one), the last norm, clip_grad_norm_'s max_norm, which
        # parameters got a gradient; offload: the update thread
        self.scaler, self.step_count, self.grad_norm = LossScaler(cfg), 0, 0.0
        self.clip = self.got = self.worker = None
        # meta tensors nothing initialized; offload on CUDA: kind -> [block, used, pinned]; the last ledger
        self.unfilled, self.pinned, self.last_comm = set(), {}, {}
        self.names = {id(m): n for n, m in self.module.named_modules()}
        # each parameter, by identity (a tied weight has several names), to the one unit that holds it
        unit_modules = list(units) if units is not None else find_units(self.module)
        owner = {}                          # a parameter in several units (a tied weight) goes to the root
        for i, p in ((i, p) for i, m in enumerate(unit_modules) for p in m.parameters()):
            owner[id(p)] = i if owner.get(id(p), i) == i else -1
        named = list(self.module.named_parameters())   # each tensor once, under its first name
        if not any(p.requires_grad for _, p in named):
            raise ValueError("zero.Zero: the model has no trainable parameters (requires_grad=True)")
        members = [[] for _ in unit_modules] + [[]]    # the last: the root
        for n, p in named:
            members[owner.get(id(p), -1)].append((n, p))
        unit_of, self.units = {}, []
        for m, ps in zip(unit_modules + [self.module], members):
            # trainable and frozen parameters in flat buffers of their own: frozen ones are never reduced
            # frozen ones that are not floats (a quantized base's int8) in buffers of their own dtype
            split = {(True, None): [], (False, None): []}
            for n, p in ps:
                split.setdefault((p.requires_grad, None if p.is_floating_point() else p.dtype), []).append((n, p))
            flats = [Flat(part, tr, plan, plan.shards_params or (tr and plan.shards_optim), dtype)
                     for (tr, dtype), part in split.items() if part]
            if flats:                       # a block without parameters is no unit
                self.units.append(Unit(len(self.units), m, self.names.get(id(m)) or "root", flats, plan, net,
                                       m is self.module))
                unit_of[id(m)] = self.units[-1]
        self.root = unit_of.get(id(self.module))
        self.owned = {id(p) for u in self.units for p in u.params}
        self.sched = s = Schedule(self.units, plan, net)
        self.optimizer = ZeroOptimizer(self, param_groups, optimizer)
        self._check_ranks_agree()           # before the first collective that depends on the layout
        # one unit at a time: a meta model becomes real, then the unit is sharded and the rest freed, so that
        # no rank ever holds the whole model
        stop, self.made, self.placed, rounded = {id(m) for m in unit_modules}, set(), {}, []
        for m in unit_modules + [self.module]:
            mods = list(_post_order(m, stop - {id(m)}))   # the root: every module outside the units
            self._materialize(mods, init_fn)
            rounded += self._build(unit_of[id(m)]) if id(m) in unit_of else []
        self._warn_rounded(rounded)
        # hooks: each trainable parameter's gradient (after autograd summed its uses); a forward starts with
        # the first module outside the units and ends when it returns; each unit's forward. Every k-th block
        # (not the root) recomputes: non-reentrant (dropout's RNG kept), inside the hooks (stage 3 gathers)
        for u in (u for u in self.units if u.train):
            for i, p in enumerate(u.train.params):
                p.register_post_accumulate_grad_hook(functools.partial(_on_grad, weakref.ref(s), u.index, i))
        for m in mods:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(s.exit, always_call=True)
        k = 1 if cfg.checkpoint is True else cfg.checkpoint
        for j, u in enumerate(s.order):
            u.module.register_forward_pre_hook(functools.partial(s.pre_forward, u), with_kwargs=True)
            u.module.register_forward_hook(functools.partial(s.post_forward, u), with_kwargs=True)
            if k and j % k == 0:
                u.module.forward = functools.partial(recompute, u.module.forward, use_reentrant=False)
        # the model's own state_dict would hold shards or stale 16-bit copies: both go through the engine
        self.module.state_dict, self.module.load_state_dict = self._refuse_state_dict, self.load_state_dict
        if cfg.offload:                     # the thread ends with the engine, or at exit after its jobs
            self.worker = HostWorker(self.device, cfg.timeout_s)
            weakref.finalize(self, self.worker.close)
            for u in self.units:
                u.worker = self.worker
        self.ledger_reset()
        _ENGINES.add(self)

    def _check_ranks_agree(self):
        # ranks that disagree on the config or model would hang in mismatched collectives: say what differs
        c = self.cfg
        layout = ";".join(f"{u.index}:{n}:{tuple(p.shape)}:{f.group[i]}:{f.trainable}:{f.dtype}" for u in self.units
                          for f in u.flats for i, (n, p) in enumerate(zip(f.names, f.params))).encode()
        mine = dict(stage=c.stage, dtype=c.dtype, accum_steps=c.accum_steps, offload=c.offload,
                    units=len(self.units), params=sum(f.numel for u in self.units for f in u.flats),
                    layout=zlib.crc32(layout), config=zlib.crc32(repr(dataclasses.asdict(c)).encode()))
        _, every = self.net.agree(mine, lambda: mine)   # what each rank has, only where they differ
        for r, row in enumerate(every or ()):
            diff = [f"{k}: rank 0 has {a}, rank {r} has {row[k]}" for k, a in every[0].items() if a != row[k]]
            if diff:
                raise ValueError("zero.Zero: ranks disagree (" + "; ".join(diff) + "); launch every rank "
                                 "with the same model and the same zero.Config")

    def _materialize(self, mods, init_fn):
        """Meta tensors of `mods` made real on the device (the same objects: ties hold), then init_fn(module)
        or reset_parameters(); what nothing wrote is unfilled (load_state_dict fills it). Then the buffers:
        whole on every rank, floats in the compute dtype, rank 0's values, each tensor once."""
        def marker(t):                      # a value no initializer writes (a bool tensor holds none)
            return float("nan") if t.is_floating_point() or t.is_complex() else \
                0 if t.dtype == torch.bool else torch.iinfo(t.dtype).min
        made = []
        for m in mods:
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if t.is_meta and id(t) not in self.made:
                    new = torch.empty_like(t, device=self.device)   # with a marker no initializer writes
                    new.fill_(marker(t))
                    torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad)
                                             if isinstance(t, nn.Parameter) else new)
                    made.append((m, n))
                    self.made.add(id(t))
        # init_fn sees every module (it may fill a module's own tensors); reset_parameters() only the
        # modules with a made tensor, as it would overwrite real ones
        with torch.no_grad():
            for m in dict.fromkeys(m for m, _ in made) if init_fn is None else mods if made else ():
                if init_fn or callable(getattr(m, "reset_parameters", 0)):
                    init_fn(m) if init_fn else m.reset_parameters()
        for m, n in made:                   # a marker left: nothing initialized the tensor
            t, prefix = getattr(m, n), self.names.get(id(m), "")
            if t.isnan().any() if t.is_floating_point() or t.is_complex() else \
                    t.dtype != torch.bool and bool((t == marker(t)).all()):
                self.unfilled.add(f"{prefix}.{n}" if prefix else n)
        for m in mods:
            for n, b in m.named_buffers(recurse=False):
                if id(b) not in self.placed:
                    new = b.to(self.device, self.dtype if b.is_floating_point() else b.dtype).contiguous()
                    self.net.broadcast(new)
                    self.placed[id(b)] = self.placed[id(new)] = new
                m._buffers[n] = self.placed[id(b)]

    def _state(self, kind, n, dtype=torch.float32, src=None):
        # shard state, zeros or src's copy. Offload on CUDA pins what crosses the bus each step (PINNED;
        # master and moments stay pageable), carved from one block per kind registered at its size: torch's
        # pinned allocator rounds up to a power of two (and it cannot be swapped)
        if not (self.plan.pin and kind in PINNED):
            t = torch.empty(n, dtype=dtype, device=self.plan.host)
        else:
            if kind not in self.pinned:
                total = sum(u.train.hi - u.train.lo for u in self.units if u.train)
                block, pinned = _pinned_block(total, dtype)
                if not pinned and all(p for _, _, p in self.pinned.values()):   # the first refusal only
                    warnings.warn("zero: CUDA did not pin the offload's host buffers (cudaHostRegister "
                                  "refused; see ulimit -l): they stay pageable, their copies synchronous")
                self.pinned[kind] = [block, 0, pinned]
            block, used, _ = self.pinned[kind]
            t, self.pinned[kind][1] = block[used:used + n], used + n
        return t.copy_(src) if src is not None else t.zero_()

    def _build(self, u):
        # one flat buffer whole at a time, in fp32, with rank 0's values; returns the frozen parameters whose
        # values the compute dtype changes
        rounded = []
        for f in u.flats:
            full = torch.zeros(f.padded, dtype=_wide(f.dtype), device=self.device)
            for n, p, o in zip(f.names, f.params, f.offsets):
                full[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p._zero_name, p._zero_owner = n, (weakref.ref(self.sched), u.index)
            self.net.broadcast(full)
            rounded += [n for n in f.build(full, self.plan, self._state) if n not in self.unfilled]
            self.net.count_held(f.flat.untyped_storage().nbytes())
            del full
        if self.plan.shards_params:
            u.reshard()
        return rounded

    def _warn_rounded(self, names):
        # once per build or load: a frozen base that the compute dtype rounds is not the one the user gave
        if names:
            warnings.warn(f"zero: frozen parameters {names[:8]}{' ...' * (len(names) > 8)} change when "
                          f"rounded to {self.cfg.dtype}, in which zero holds them; "
                          "Config(frozen_dtype='fp32') keeps them exact")

    def __call__(self, *args, **kwargs):
        # float inputs in the compute dtype, as the parameters
        args, kwargs = _tree_map(lambda t: t.to(self.dtype) if t.is_floating_point() else t, (args, kwargs))
        return self._forward(*args, **kwargs)

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

    @torch.compiler.disable
    def _enter(self, module, args):
        # a forward's first module: no forward runs on tensors that nothing initialized
        if self.unfilled and not self.sched.depth:
            self.sched.depth += 1           # (the exit hook runs all the same, and counts it out)
            raise RuntimeError(f"zero: {sorted(self.unfilled)[:8]} were built on the meta device and nothing "
                               "initialized them: call engine.load_state_dict(sd), or pass init_fn=fn")
        self.sched.enter()

    def backward(self, loss):
        """Backward of this micro-batch's plain mean loss (the engine divides by accum_steps); returns when
        its gradients are reduced."""
        cfg, s = self.cfg, self.sched
        if s.micro >= cfg.accum_steps:
            raise RuntimeError(f"zero: backward() called {s.micro + 1} times without step(); "
                               f"Config.accum_steps={cfg.accum_steps}")
        # DDP's habit, loss / accum_steps, would divide twice; (a + b) / 2 is two halves' mean
        fn = getattr(loss, "grad_fn", None)
        if cfg.accum_steps > 1 and fn is not None and fn.name() in ("DivBackward0", "MulBackward0") and \
                "Add" not in str(fn.next_functions[0][0]):
            d = getattr(fn, "_saved_other", None)
            if isinstance(d, torch.Tensor) and d.numel() == 1 and d.device.type == "cpu" and math.isclose(
                    (1 / d if fn.name() == "MulBackward0" else d).item(), cfg.accum_steps, rel_tol=1e-6):
                raise ValueError(f"zero: the loss is divided by accum_steps={cfg.accum_steps}: pass the "
                                 "plain mean loss; engine.backward divides by accum_steps itself")
        # every rank calls backward (checked through the store after evaluation forwards); the first learns
        # the units' order; the last step's host update lands before new gradients do
        self.net.call("backward", check=s.evals)
        s.evals = 0
        if not s.learned:
            s.learn()
        self.settle()
        s.start_backward()
        if self.plan.shards_params and s.back and cfg.prefetch:
            s.places[s.back[0]].unshard(wait=False)   # the forward's last block is the first one back
        s.in_backward = True
        try:                                # fp16: the loss scaled up so small gradients survive in 16 bits
            (loss.float() * self.scaler.scale if self.scaler.enabled else loss).backward()
        except torch.utils.checkpoint.CheckpointError as e:
            raise RuntimeError("zero: activation recompute replayed a different forward (see above), as a "
                               "key/value cache does: pass use_cache=False, or use the model's own "
                               "gradient_checkpointing_enable() and Config(checkpoint=False)") from e
        finally:
            s.in_backward = False
        s.end_backward()

    def step(self):
        """AdamW on this rank's shard, the updated parameters back to every rank. Returns False when the
        gradients were not finite (fp16 overflow: the step is skipped)."""
        return self.optimizer.step()        # through the optimizer, so that LR schedulers see the step

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ of the engine's gradients (torch's, given them, calls this), between
        the last backward and step(): returns the global norm of the unscaled mean gradient, and the step
        clips at max_norm instead of Config.grad_clip."""
        if float(norm_type) != 2.0:
            raise ValueError(f"zero: clip_grad_norm_(norm_type={norm_type}): zero clips the L2 norm; use 2.0")
        norm = self._agree_step()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"zero: the total norm of the gradients is {norm} (error_if_nonfinite=True)")
        self.clip = float(max_norm)
        return torch.tensor(norm)

    def _agree_step(self):
        """The step up to the update, once (clip_grad_norm_ may run it first): the last reductions and the
        step's one all-reduce of agreement; returns the global gradient norm."""
        cfg, s, plan = self.cfg, self.sched, self.plan
        if s.micro == cfg.accum_steps + 1:  # agreed already
            return self.grad_norm
        if s.micro != cfg.accum_steps:
            raise RuntimeError(f"zero: step() after {s.micro} backward() calls; Config.accum_steps="
                               f"{cfg.accum_steps} asks for exactly that many")
        late = [n for u in self.units for f in u.flats if not f.trainable for n, p in zip(f.names, f.params)
                if p.requires_grad]
        if late:
            raise RuntimeError(f"zero: {late} were frozen when zero.Zero wrapped the model and require grad "
                               "now; make them trainable before zero.Zero(model) (and freeze them after)")
        self.net.call("step")
        s.drain()
        self.settle()
        trained = [u for u in self.units if u.train]
        for u in trained:
            u.finish_replica()
        # one fp64 all-reduce (exact for these integers) agrees on: the squared gradient norm (inf or nan:
        # overflow), the fingerprint of each rank's collectives and calls with its squares, the units kept
        # whole, the parameters with a gradient on any rank
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for u in trained:
            sq += u.sq_norm()
        # a copy several ranks hold (stage 0, hybrid replicas) counts once: the others add 0 times theirs (nan
        # if not finite: an overflow anywhere skips everywhere)
        sq *= float((self.net.replica if plan.shards_optim else self.rank) == 0)
        host = torch.tensor([u.keep for u in self.units] +
                            [i in u.train.got for u in trained for i in range(len(u.train.params))],
                            dtype=torch.float64)
        explain = lambda: (self.net.trace, self.sched.ran, dict(self.net.calls))   # noqa: E731
        (sq, *rest), every = self.net.agree(self.net.trace, explain, torch.cat([sq.view(1), host.to(self.device)]))
        keep, got = rest[:len(self.units)], rest[len(self.units):]
        for u in trained:
            u.train.written, u.train.got = set(), set()  # the next window starts a new accumulation
        if every is not None:
            self._diverged(every)
        s.agree_keep({u.index for u, k in zip(self.units, keep) if k})
        s.micro, self.got = cfg.accum_steps + 1, got
        # the gradients are of loss * scale, summed over ranks and micro-batches after a divide by divide[0]
        self.grad_norm = math.sqrt(sq) / (self.scaler.scale * plan.divide[1])
        return self.grad_norm

    def _step(self):
        """step() through the optimizer: AdamW with the agreed norm, or, where it is not finite, the skip."""
        cfg, plan, norm = self.cfg, self.plan, self._agree_step()
        clip = self.clip if self.clip is not None else cfg.grad_clip
        got, self.clip, self.sched.micro = self.got, None, 0
        if not math.isfinite(norm):         # every rank sees the same norm: no rank steps alone
            self.scaler.adjust(overflow=True)
            self.ledger_reset()
            if self.scaler.enabled:
                return False
            raise FloatingPointError(f"zero: the gradient norm is {norm} at step {self.step_count + 1} in "
                                     f"{cfg.dtype}; nothing was updated: lower the lr, or check the inputs")
        # clip_grad_norm_'s rule; unscale and clip are one multiplier, applied inside the Adam kernel
        mult = (min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0) / (self.scaler.scale * plan.divide[1])
        self.step_count += 1
        self.scaler.adjust(overflow=False)
        self.sched.before_update()
        # the groups' hyperparameters as they are now (schedulers set them); a parameter without a gradient
        # on any rank is left untouched, its step count too, as torch's AdamW does
        hyper = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in self.optimizer.param_groups]
        runs, k, trained = {}, 0, [u for u in self.units if u.train]
        for u in trained:
            used, k = got[k:k + len(u.train.params)], k + len(u.train.params)
            u.train.steps = [s + 1 if g else s for s, g in zip(u.train.steps, used)]
            runs[u.index] = u.train.runs(used, hyper)
        if cfg.offload:
            # the update runs on the worker behind the next forward, in its order; until that gathers, the
            # others' slices are last step's; the 16-bit slices go to the device
            jobs = []
            for u in (u for u in [self.root, *self.sched.order] if u is not None and u.train):
                jobs.append((u, functools.partial(u.update, mult, runs[u.index])))
                if plan.regathers and u.phase == WHOLE:
                    u.reshard()
                self.net.count("h2d", u.train.hi - u.train.lo, u.train.flat.element_size())
            self.worker.submit(jobs)
        else:
            for u in trained:
                u.update(mult, runs[u.index])
            _regather([u.stale() for u in trained] if plan.regathers else [])
        self.ledger_reset()
        return True

    def settle(self):
        """Every unit's host update done and (stages 1-2 with offload) gathered: the state is this step's."""
        for u in self.units if self.worker else ():   # each wait bounded by Config.timeout_s
            self.worker.wait(u)
        _regather(self.units if self.plan.offload and self.plan.regathers else [])

    def _diverged(self, every):
        # the ranks' collectives or calls differed in this step: say which, change nothing, and stop
        t0, diff, name = every[0][0], "?", lambda i: self.units[i].name if isinstance(i, int) else "the step"
        for r, (t, _, _) in enumerate(every):
            if t != t0:
                j = next((j for j, (x, y) in enumerate(zip(t0, t)) if x != y), min(len(t0), len(t)))
                of = lambda s: f"{s[j][0]} of {name(s[j][1])}" if j < len(s) else "nothing"   # noqa: E731
                diff = f"#{j}: rank 0's was {of(t0)}, rank {r}'s {of(t)}"
                break
        ran = "; ".join(f"rank {r}: {[name(i) for i in x]}" for r, (_, x, _) in enumerate(every[:4]))
        self.ledger_reset()
        more = _more_calls({r: c for r, (_, _, c) in enumerate(every)})
        raise RuntimeError(f"zero: the ranks ran different collectives in this step "
                           f"({'; '.join(more + [diff])}); nothing was updated. Units each rank's forwards "
                           f"ran: {ran}. At stage 3 call every unit equally often on every rank, or stage 2")

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
        self.last_comm = {k: dict(calls=c, elements=e, bytes=b) for k, (c, e, b) in self.net.ledger.items()}
        self.net.ledger, self.net.trace, self.sched.ran = {}, [], []

    def comm(self):
        """What the last step moved, by kind: calls, elements and bytes."""
        return self.last_comm

    @property
    def loss_scale(self):
        """fp16's dynamic loss scale (1.0 in bf16 and fp32)."""
        return self.scaler.scale

    @property
    def peak_gathered_bytes(self):
        """The most bytes of parameter buffers (in the compute dtype) this rank held at once."""
        return self.net.peak

    def memory(self):
        """Bytes of model state this rank holds, by kind, on the device and the host, from the tensors'
        storages, each once (on a CPU-only machine "device" and "host" are one memory, split by role); of the
        host's, pinned_memory() says what is pinned."""
        out = {w: dict.fromkeys(("params", "grads", "master", "optim", "frozen"), 0)
               for w in ("device", "host")}
        seen, host = set(), "host" if self.cfg.offload else "device"
        for f in (f for u in self.units for f in u.flats):
            for t, kind, where in ((f.flat, "params", "device"), (f.shard, "params", "device"),
                                   (f.grad, "grads", "device"), (f.acc, "grads", "device"),
                                   (f.grad_shard, "grads", host), (f.staging, "params", "host"),
                                   *((v, "master" if k == "master" else "optim", host)
                                     for k, v in f.state.items())):
                st = t.untyped_storage() if t is not None else None
                if st is not None and st.nbytes() and st.data_ptr() not in seen:   # views share a storage
                    seen.add(st.data_ptr())
                    out[where if f.trainable else "device"][kind if f.trainable else "frozen"] += st.nbytes()
        return out

    def pinned_memory(self):
        """The host bytes of memory() that CUDA has page-locked, by kind: with offload on CUDA the gradient
        shard (grads) and the 16-bit staging copy (params), which cross the bus every step; nothing else."""
        out = dict.fromkeys(("params", "grads", "master", "optim", "frozen"), 0)
        for kind, (block, used, pinned) in self.pinned.items():
            if pinned:
                out[PINNED[kind]] += used * block.element_size()
        return out

    def num_params(self, padded=False, frozen=False):
        # Ψ of the formulas: trainable parameters (or the frozen ones), as given or as the buffers hold them
        return sum(f.padded if padded else f.numel for u in self.units for f in u.flats
                   if f.trainable != frozen)

    def full_state_dict(self, rank0_only=False):
        """The whole model as a plain fp32 state_dict of CPU tensors (every rank calls it), gathered a flat
        buffer at a time and moved to the CPU at once. rank0_only=True: the others get {}."""
        self.net.call("full_state_dict")
        self.settle()
        keep, values = not rank0_only or self.rank == 0, {}
        for f in (f for u in self.units for f in u.flats):
            full = f.state["master"].to(self.device, _wide(f.dtype))   # full precision where there is a master
            if f.hi - f.lo < f.padded:      # not whole here (stage 0 and frozen ones at stages 0-2 are)
                mine, full = full, torch.empty(f.padded, dtype=full.dtype, device=self.device)
                self.net.all_gather(full, mine, kind="state_dict")   # its own kind: not training traffic
            for p, o in zip(f.params, f.offsets) if keep else ():
                values[id(p)] = full[o:o + p.numel()].view(p.shape).to("cpu", copy=True)
            del full
        return {k: values[id(t)] if id(t) in values else    # the model's own keys: tied names, buffers
                t.detach().to("cpu", _wide(t.dtype), copy=True)
                for k, t in (_model_state(self.module).items() if keep else ())}

    def load_state_dict(self, state_dict, strict=True):
        """Weights from a plain state_dict (model.state_dict() names, tied aliases too) into every copy the
        engine keeps, each rank reading only its slices; Adam starts fresh. Missing, unexpected and wrongly
        shaped entries are one error (strict=False: skipped, and returned)."""
        self.net.call("load_state_dict")
        self.settle()
        # each parameter is read under the first of its names that the state_dict has
        want, aliases = _model_state(self.module), _aliases(self.module)
        slot = {id(p): next((a for a in aliases[id(p)] if a in state_dict), None) for u in self.units
                for p in u.params}
        missing = [k for k, t in want.items() if k not in state_dict and not slot.get(id(t))]
        unexpected = [k for k in state_dict if k not in want]
        bad = dict.fromkeys(k for k in state_dict if k in want and state_dict[k].shape != want[k].shape)
        shapes = [f"{k}: {list(state_dict[k].shape)} vs the model's {list(want[k].shape)}" for k in bad]
        if strict:
            _mismatch("load_state_dict:", missing, unexpected, shapes)
        use = {i: k for i, k in slot.items() if k is not None and k not in bad}

        def read(name, p, start, n, key):   # the master weights only
            if key == "master" and id(p) in use:
                return state_dict[use[id(p)]].reshape(-1)[start:start + n]
        bufs = {k: v for k, v in state_dict.items() if k in want and k not in bad and id(want[k]) not in slot}
        filled = {a for i in use for a in aliases[i]}
        self._warn_rounded(_restore(self, lambda: (read, bufs), "load the state_dict", filled | set(bufs)))
        for f in (f for u in self.units for f in u.flats):
            f.steps = [0] * len(f.params)
        return LoadResult(missing, unexpected, shapes)

    def _refuse_state_dict(self, *args, **kwargs):
        raise RuntimeError("zero: model.state_dict() after zero.Zero(model) holds shards or stale copies: "
                           "use engine.full_state_dict() (every rank calls it) or zero.save(engine, dir)")


LoadResult = collections.namedtuple("LoadResult", "missing_keys unexpected_keys wrong_shapes")


class Copies:
    """Offload's copies between the device and the host, the one place with CUDA streams and events. On CUDA a
    gradient shard goes to the host on a stream of its own once the current stream's work so far (its
    reduction) is done, and the host update waits for that unit's copy alone; the updated 16-bit slices come
    back on another, which the next forward's stream waits for. On a CPU: plain copies in order, no events."""

    def __init__(self, device):
        cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if cuda else None     # gradient shards to the host
        self.h2d = torch.cuda.Stream(device) if cuda else None     # updated slices back to the device

    def to_host(self, dst, src):
        # dst (pinned) <- src after the current stream's work so far; the event to wait for before reading dst
        if self.d2h is None:
            dst.copy_(src)
            return None
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        # src is a slice of f.grad (dropped right after at stages 2-3) or of f.acc: its memory is not handed
        # out again before this stream's copy has read it
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
    def wait(*events):                      # the host waits: a copy to it landed, one from it has read it
        for event in events:
            if event is not None:
                event.synchronize()

    @staticmethod
    def order(event):                       # the current stream's later work waits; the host does not
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class HostWorker:
    """ZeRO-Offload's update thread: one step's jobs (unit, fn) in the forward's order while the caller goes
    on to the next forward, which waits only for the unit it is about to run. A failure is raised in the
    caller at its next wait; at exit the thread finishes its jobs (a daemon killed in a kernel aborts)."""

    def __init__(self, device, timeout_s):
        self.jobs, self.error, self.timeout = queue.Queue(), None, timeout_s
        self.copies = Copies(device)        # its units' copies to the host and back
        self.thread = threading.Thread(target=self._run, args=(device,), daemon=True,
                                       name="zero-offload-adam")
        self.thread.start()

    def submit(self, jobs):
        # cleared before the jobs are queued: a wait never takes the last step's flag for this one's
        for u, _ in jobs:
            u.updated.clear()
        self.jobs.put(jobs)

    def _run(self, device):
        if device.type == "cuda":
            torch.cuda.set_device(device)   # the current GPU is per thread
        while self._do(self.jobs.get()):
            pass

    def _do(self, jobs):
        # one step's jobs, none referenced here after (the engine can be freed); a failure is the caller's
        for u, fn in jobs or ():
            try:
                fn()
            except BaseException as e:
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
        self.copies.order(u.h2d)

    def close(self):
        # the jobs queued before are done first; bounded, so that a hung update cannot hang the exit
        self.jobs.put(None)
        self.thread.join(self.timeout)


def _mismatch(what, missing, unexpected, shapes):
    # one error for all that does not fit: names the model lacks, names it has that the weights lack, shapes
    parts = [f"{k} {v}" for k, v in (("missing", missing), ("unexpected", unexpected),
                                     ("shapes differ:", shapes)) if v]
    if parts:
        raise ValueError(f"zero: {what} " + "; ".join(parts))


PINNED = {"grad_shard": "grads", "staging": "params"}   # offload's state that is pinned: memory()'s kind


def _pinned_block(n, dtype):
    # n elements of host memory on pages of their own (an anonymous mapping: page-aligned, whole pages, so
    # that no two blocks share a page, which CUDA would refuse to register twice), page-locked with CUDA until
    # the block is dropped. Returns the block and whether CUDA pinned it (if not, it is pageable)
    nbytes = n * dtype.itemsize
    if not nbytes:
        return torch.empty(0, dtype=dtype), True
    pages = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    block = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype)   # (it holds the mapping)
    if not _host_register(block.data_ptr(), len(pages)):
        return block, False
    weakref.finalize(block, _host_unregister, block.data_ptr())
    return block, True


def _host_register(ptr, nbytes):
    # page-locks [ptr, ptr + nbytes) through torch's own binding: True if CUDA did. A refusal leaves CUDA's
    # last error set, and torch.cuda.cudart() binds no cudaGetLastError (torch 2.4-2.13: GetErrorString,
    # Profiler*, HostRegister, HostUnregister, StreamCreate/Destroy, MemGetInfo); torch's check after its
    # next kernel launch would raise it there, so one launched here takes it
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0:
        return True
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device=torch.device("cuda", torch.cuda.current_device())).fill_(1)
    return False


def _host_unregister(ptr):
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _wide(dtype):
    # what a value is exported and rebuilt in: fp32 for floats, its own dtype for the rest (never cast)
    return torch.float32 if dtype.is_floating_point else dtype


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
# 8. Checkpoints
#
# path/latest            the name of the newest complete checkpoint, replaced atomically, last
# path/step_00001000/    meta.json (layout, config, step, scaler, param groups, checksums), written after
#                        every rank's rank_00000.pt ... (its RNG; for one copy of the shards a slice of every
#                        flat buffer's unpadded layout, its Flat.state; rank 0: buffers, the script's extra)
# Each file is written under a temporary name and renamed into place: a crash at any moment leaves `latest`
# naming the previous checkpoint, whole. Loading slices the layout: any world size and stage loads it.

FORMAT = "zero.py-checkpoint-3"             # 3: aligned layouts, each buffer's shard size in meta.json
READS = (FORMAT, "zero.py-checkpoint-2")     # 2: parameters back to back


def _write_atomic(path, write):
    # a reader sees the old file or the new one: rename is atomic, and fsync puts the bytes on disk first
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path):
    # block by block: a rank file need not fit in memory
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def save(engine, path, extra=None):
    """A sharded checkpoint of `engine` under directory `path` (every rank calls it), with `extra`, the
    script's own tensors and values: load() returns it as meta["extra"], read_extra() without an engine."""
    net, rank, flats, name = engine.net, engine.rank, [f for u in engine.units for f in u.flats], None
    net.call("save")
    engine.settle()                         # offload: the shard state must be this step's
    if rank == 0:                           # a fresh directory, never a complete checkpoint's
        base = f"step_{engine.step_count:08d}"
        name = next(n for n in (base + f"_{k}" * (k > 0) for k in itertools.count())
                    if not os.path.exists(os.path.join(path, n)))
        os.makedirs(os.path.join(path, name))
    name = net.all_gather_object(name)[0]
    d = os.path.join(path, name)
    # one copy of the shards, so that any run finds element e of buffer i in file e // S (S the shard size)
    # of shard group i % R (of R): this rank's slice [a, b) of the unpadded layout, in f.state's coordinates
    n_files, s, shards = engine.plan.shards, engine.plan.shard_rank, []
    for i, f in enumerate(flats):
        a = s * (f.padded // n_files) - f.lo
        b = max(a, min(a + f.padded // n_files, f.end - f.lo))
        shards.append({k: v[a:b].to("cpu", torch.float32 if f.trainable else v.dtype).clone()
                       for k, v in f.state.items()} if i % net.replicas == net.replica else None)
    blob = dict(flats=shards, rng=torch.get_rng_state())   # each rank's RNG too: dropout's stream goes on
    if engine.device.type == "cuda":        # (a CPU engine makes no CUDA context)
        blob["cuda_rng"] = torch.cuda.get_rng_state(engine.device)
    if rank == 0:                           # the buffers are the same on every rank
        blob.update(extra=extra, buffers={k: v.detach().cpu() for k, v in _model_state(engine.module).items()
                                          if id(v) not in engine.owned})
    fname = os.path.join(d, f"rank_{rank:05d}.pt")
    _write_atomic(fname, lambda f: torch.save(blob, f))
    sums = net.all_gather_object(_sha256(fname))
    if rank == 0:
        aliases, cfg = _aliases(engine.module), engine.cfg
        meta = dict(format=FORMAT, world_size=engine.world, shards=n_files, replicas=net.replicas,
                    stage=cfg.stage, dtype=cfg.dtype, config=dataclasses.asdict(cfg), step=engine.step_count,
                    scaler=engine.scaler.state_dict(),
                    param_groups=[{k: v for k, v in g.items() if k in GROUP_KEYS or k == "initial_lr"}
                                  for g in engine.optimizer.param_groups],
                    flats=[dict(numel=f.end, shard=f.padded // n_files, frozen=not f.trainable, params=[
                        dict(name=n, shape=list(p.shape), offset=o, aliases=aliases[id(p)], step=t)
                        for n, p, o, t in zip(f.names, f.params, f.offsets, f.steps)]) for f in flats],
                    state_dict_keys=list(_model_state(engine.module)),
                    sha256={f"rank_{r:05d}.pt": s for r, s in enumerate(sums)})
        _write_atomic(os.path.join(d, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        # the commit point: until this rename, `latest` names the previous checkpoint, which is whole
        _write_atomic(os.path.join(path, "latest"), lambda f: f.write(name.encode()))
    net.all_gather_object(None)             # nobody returns before the checkpoint is whole
    # then the older ones go, meta.json first (one half-deleted is no checkpoint): each rank its own files up
    # to the first it does not find, in parallel, then rank 0 the rest
    for old in (os.path.join(path, o) for o in os.listdir(path) if o.startswith("step_") and o != name):
        with contextlib.suppress(OSError):
            if rank == 0:
                os.remove(os.path.join(old, "meta.json"))
            for r in range(rank, 1 << 20, engine.world):
                os.remove(os.path.join(old, f"rank_{r:05d}.pt"))
        if rank == 0:
            shutil.rmtree(old, ignore_errors=True)


class _Files:
    """A checkpoint (its directory, or its parent's `latest`): its meta, and its rank files, each opened once,
    memory-mapped; this rank checks the checksums of files check[0], check[0] + check[1] ..."""

    def __init__(self, path, check):
        if os.path.isfile(os.path.join(path, "latest")):
            with open(os.path.join(path, "latest")) as f:
                path = os.path.join(path, f.read().strip())
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise FileNotFoundError(f"zero: {path!r} is not a zero.py checkpoint (no meta.json, no "
                                    "'latest'); pass the directory given to zero.save")
        try:
            with open(os.path.join(path, "meta.json")) as f:
                self.meta = meta = json.load(f)
            assert meta.get("format") in READS
        except (ValueError, AssertionError) as e:
            raise ValueError(f"zero: {path}/meta.json is corrupt or of another format; use another "
                             "checkpoint") from e
        self.d, self.open = path, {}
        for r in range(check[0], meta["world_size"], check[1]):
            fname = os.path.join(path, f"rank_{r:05d}.pt")
            if not os.path.isfile(fname):
                raise FileNotFoundError(f"zero: checkpoint {path} lacks rank_{r:05d}.pt (saved by "
                                        f"{meta['world_size']} ranks): copy all its files, or use another")
            if _sha256(fname) != meta["sha256"][f"rank_{r:05d}.pt"]:
                raise ValueError(f"zero: {fname} is truncated or corrupted (its sha256 does not match "
                                 "meta.json); use an earlier checkpoint")
        # name -> (flat, offset, shard size at save time, shape) in the saved layout (format 2 has no gaps and
        # shards of the unpadded length's share)
        self.saved = {p["name"]: (i, p["offset"], f.get("shard", -(-f["numel"] // meta["shards"])),
                                  p["shape"]) for i, f in enumerate(meta["flats"]) for p in f["params"]}

    def __call__(self, r):                  # weights_only: a checkpoint is data, never code
        if r not in self.open:
            self.open[r] = torch.load(os.path.join(self.d, f"rank_{r:05d}.pt"), map_location="cpu",
                                      weights_only=True, mmap=True)
        return self.open[r]

    def read(self, name, start, n, key):
        # elements [start, start+n) of a saved parameter; element e of buffer i is in slice r = e // size
        i, offset, size, _ = self.saved[name]
        group, out, a, end = i % self.meta.get("replicas", 1), [], offset + start, offset + start + n
        while a < end:
            r, b = a // size, min(end, (a // size + 1) * size)
            out.append(self(group * self.meta["shards"] + r)["flats"][i][key][a - r * size:b - r * size])
            a = b
        return torch.cat(out) if len(out) > 1 else out[0] if out else torch.zeros(0)   # (a 0-element one)


def load(engine, path):
    """Restore a checkpoint saved at any world size and stage into `engine` (every rank calls it): all or
    nothing; on as many ranks as saved it, each rank's random state too. Returns meta.json, with `extra`."""
    engine.net.call("load")
    engine.settle()
    files = [None]                          # prepare()'s errors reach every rank through _restore

    def prepare():
        f = files[0] = _Files(path, (engine.rank, engine.world))
        mine = {n: list(p.shape) for u in engine.units for x in u.flats for n, p in zip(x.names, x.params)}
        shapes = [f"{n} {s} vs {f.saved[n][3]}" for n, s in mine.items()
                  if n in f.saved and s != f.saved[n][3]]
        _mismatch("the checkpoint is of another model:", [n for n in mine if n not in f.saved],
                  [n for n in f.saved if n not in mine], shapes)
        # by name: a parameter may sit in another unit, offset or shard than when saved
        return (lambda name, p, start, n, key: f.read(name, start, n, key),
                {k: v for k, v in f(0)["buffers"].items() if k not in f.saved})
    _restore(engine, prepare, f"load {path}")
    f, meta = files[0], files[0].meta
    # AdamW's step count per parameter (its bias correction), by name like the values
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
    """The script's `extra` of a checkpoint, read without an engine (to rebuild the model from it first)."""
    return _Files(path, (0, 1 << 30))(0).get("extra")


def _restore(engine, prepare, what, filled=None):
    """New weights (and Adam moments, where read() has them) into every copy the engine keeps; prepare() ->
    (read(name, param, start, n, key) -> elements or None, {state_dict key: buffer}); `filled`: the names it
    fills (None: all). Returns the frozen parameters whose values change when rounded to the compute dtype."""
    error, new, rounded = None, [], []
    try:                                    # phase 1: this rank's owned slices into fresh tensors
        read, extra = prepare()
        for f in (f for u in engine.units for f in u.flats):
            # a slice read() does not have keeps its value; a moment starts at zero
            st = {k: v.to("cpu", _wide(v.dtype), copy=True) if k == "master" else torch.zeros(v.shape)
                  for k, v in f.state.items()}
            for a, b, i in f.segments:
                for k in st:
                    piece = read(f.names[i], f.params[i], a + f.lo - f.offsets[i], b - a, k)
                    if piece is not None:
                        st[k][a:b] = piece
                        # a frozen value the compute dtype cannot hold exactly: the caller warns
                        if not f.trainable and not f.cast and f.dtype.is_floating_point and \
                                not torch.equal(piece.float(), piece.to(engine.dtype).float()):
                            rounded.append(f.names[i])
            new.append((f, st))
    except Exception as e:                  # a missing or corrupt file, another model: nothing changed yet
        error = e
    # phase 2: a failure is raised on every rank, not a hang in the collectives below; zero's own message (a
    # file that fails its checksum) before what reading that file gave another rank
    mine = f"{type(error).__name__}: {error}" if error else None
    _, every = engine.net.agree(mine, lambda: mine)     # every rank's message, where they differ
    failed = [m for m in every or [mine] if m]
    first = ([m for m in failed if "zero:" in m] or failed or [None])[0]
    if error is not None and ("zero:" in str(error) or mine == first):
        raise error
    if first:
        raise RuntimeError(f"zero: another rank could not {what}: {first}")
    for f, st in new:                       # phase 3: the shard state in place, the 16-bit values from it
        for k, v in st.items():
            f.state[k].copy_(v)
        if f.out is not None:
            f.out.copy_(st["master"])
    _regather([u.stale() for u in engine.units if u.train] if engine.plan.regathers else [])
    with torch.no_grad():
        for k, v in _model_state(engine.module).items():
            if k in extra:
                v.copy_(extra[k])
    engine.unfilled -= engine.unfilled if filled is None else filled
    return rounded


def consolidate(path):
    """A sharded checkpoint as one plain fp32 state_dict that the unwrapped model loads; memory holds the
    result and the rank files' memory maps, nothing else."""
    f = _Files(path, (0, 1))
    values = {k: v.to(_wide(v.dtype), copy=True) for k, v in f(0)["buffers"].items()}
    for p in (p for x in f.meta["flats"] for p in x["params"]):   # each from its slices in the rank files
        t = f.read(p["name"], 0, math.prod(p["shape"]), "master")
        values.update(dict.fromkeys(p["aliases"], t.to(_wide(t.dtype), copy=True).view(p["shape"])))
    return {k: values[k] for k in f.meta["state_dict_keys"]}


# -----------------------------------------------------------------------------
# 9. Memory estimator and the command line
#
# The paper's formula in Zero.memory()'s kinds (a test holds the two equal on a real model); `python zero.py
# estimate` prints the paper's 7.5B-parameter, 64-GPU example.

def estimate_memory(num_params, world_size, stage, dtype="fp16", offload=False, shard_group=0,
                    frozen_params=0, reduce_dtype="", frozen_dtype="", accum_steps=1, num_tensors=0,
                    device="cuda"):
    """The ZeRO paper's model-state bytes per rank: params and grads in the compute dtype (grads in fp32 with
    reduce_dtype="fp32"), fp32 master (none in fp32 compute) and two fp32 Adam moments, each sharded by the
    stage across the shard group; frozen parameters in the compute dtype (frozen_dtype="fp32": in fp32, and
    at stages 0-2 a compute copy beside them), sharded at stage 3 only. num_params as the engine holds them
    (num_params(padded=True)) is exact; given as the model has them, num_tensors (the trainable tensors)
    adds the engine's padding at its bound: under 16 bytes before each tensor, N x 16 after each unit. Offload
    on CUDA (device="cuda") also keeps the owned 16-bit slice on the host, pinned, where the update writes it."""
    c = Config(stage=stage, dtype=dtype, reduce_dtype=reduce_dtype, frozen_dtype=frozen_dtype).validate()
    fz, n = frozen_params, shard_group if stage and shard_group else world_size
    p, master = DTYPES[c.dtype].itemsize, 0 if c.dtype == "fp32" and not offload else 4   # bytes per param
    align = max(1, 16 // p)                 # elements (see Flat): a unit ends with one of its tensors at most
    psi = num_params + num_tensors * (align - 1 + n * align - 1)
    g = 4 if c.reduce_dtype else p
    per = [n if stage >= s else 1 for s in range(4)]   # each stage divides one more kind by N
    dev = dict(params=p * psi / per[3], grads=g * psi / per[2], master=master * psi / per[1],
               optim=8 * psi / per[1],
               frozen=(4 * fz / n if stage == 3 else 6 * fz) if c.frozen_dtype else p * fz / per[3])
    host = dict.fromkeys(dev, 0)
    if offload:     # the gradient shard, master and moments on the host; on the device stage 1's whole
        # gradient, or the shard's sum (accumulation, and hybrid: summed across the shard groups there)
        host.update(grads=g * psi / n, master=dev["master"], optim=dev["optim"])
        if device == "cuda":                # the staging copy (a CPU engine's host is its device: none)
            host.update(params=p * psi / n)
        dev.update(master=0, optim=0, grads=dev["grads"] if stage == 1 else
                   g * psi / n if accum_steps > 1 or n < world_size else 0)
    return {w: {k: int(round(v)) for k, v in d.items()} for w, d in (("device", dev), ("host", host))}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="zero.py", description=__doc__.split("\n")[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate", help="model-state memory per rank per stage (the ZeRO paper's formula)")
    e.add_argument("--params", type=float, required=True, help="number of trainable parameters, e.g. 7.5e9")
    e.add_argument("--world-size", type=int, required=True)
    e.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    e.add_argument("--shard-group", type=int, default=0, help="hybrid sharding: ranks per shard group")
    e.add_argument("--frozen-params", type=float, default=0, help="frozen parameters (a LoRA's base)")
    c = sub.add_parser("consolidate", help="a sharded checkpoint to one plain fp32 state_dict file")
    c.add_argument("ckpt")
    c.add_argument("out")
    a = ap.parse_args(argv)
    if a.cmd == "estimate":                 # the per-rank table of the ZeRO paper's Figure 1, a row per stage
        fz, sg = a.frozen_params, a.shard_group
        kinds = ("params", "grads", "master", "optim") + ("frozen",) * bool(fz)
        print(f"model states per rank, {a.params:.4g} params" + f" + {fz:.4g} frozen" * bool(fz) +
              f", {a.world_size} ranks" + f", shard groups of {sg}" * bool(sg) + f", {a.dtype} + fp32 Adam "
              f"(GB = 1e9 B)\n{'stage':>5}", *(f"{k:>9}" for k in kinds), f"{'total':>9}")
        for s in range(4):
            d = estimate_memory(a.params, a.world_size, s, a.dtype, shard_group=sg,
                                frozen_params=fz)["device"]
            print(f"{s:>5}", *(f"{d[k] / 1e9:>9.4g}" for k in kinds), f"{sum(d.values()) / 1e9:>9.1f}")
    else:                                   # no processes, no GPU: the rank files are read straight from disk
        torch.save(consolidate(a.ckpt), a.out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
