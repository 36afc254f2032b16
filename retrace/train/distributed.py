"""Data-parallel plumbing of the trainers under `torchrun` (one process per device).

`torchrun --nproc-per-node N --no-python retrace train ...` sets RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/PORT; :func:`session` joins the process group (gloo on CPU, nccl on CUDA, one GPU per local
rank) and leaves it at the end. Without those variables everything here is the single-process identity.

Rules the trainers follow: only the main rank (0) writes files, logs and progress bars; every rank takes
the same decisions from the same (gathered) data, so a bad input fails on all ranks with the same
RetraceError instead of leaving the others waiting in a collective; gradients are averaged by DDP (or
sharded by FSDP) over the trainable parameters only (the target and the shared embedding / LM head are
frozen and never wrapped).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from retrace.errors import RetraceError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def all_gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank (small picklable Python objects only)."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """The main rank's obj on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def sum_stats(self, stats: dict) -> dict:
        """Sum a dict of numbers over the ranks (the training stats are sums, so this merges them exactly)."""
        if not self.active or not stats:
            return stats
        keys = sorted(stats)
        t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def main_first(self, fn):
        """fn() on the main rank (e.g. preparing the output directory), then its result or its RetraceError
        on every rank."""
        res, err = None, None
        if self.is_main:
            try:
                res = fn()
            except RetraceError as e:
                err = str(e)
        res, err = self.broadcast((res, err))
        if err is not None:
            raise RetraceError(err)
        return res


def from_env() -> Dist:
    """The torchrun layout of this process (single process when WORLD_SIZE is unset or 1)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise RetraceError("RANK / WORLD_SIZE / LOCAL_RANK must be integers (set by torchrun)") from None
    if world < 1 or not 0 <= rank < world:
        raise RetraceError(f"RANK {rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {world})")
    return Dist(rank, world, local)


def device_for(device: str | None, d: Dist) -> torch.device:
    """The training device of this rank: "auto"/"cuda" under torchrun -> cuda:LOCAL_RANK."""
    from retrace.train.common import resolve_device

    dev = resolve_device(device)
    if d.active and dev.type == "cuda" and dev.index is None:
        if d.local_rank >= torch.cuda.device_count():
            raise RetraceError(f"LOCAL_RANK {d.local_rank} but only {torch.cuda.device_count()} CUDA devices")
        dev = torch.device("cuda", d.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


@contextlib.contextmanager
def session(device: str | None) -> Iterator[tuple[Dist, torch.device]]:
    """Join the torchrun process group for the duration of a training run (no-op for one process)."""
    d = from_env()
    dev = device_for(device, d)
    started = False
    if d.active and not torch.distributed.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RetraceError("WORLD_SIZE > 1 but MASTER_ADDR / MASTER_PORT are not set: start with torchrun")
        torch.distributed.init_process_group(backend, rank=d.rank, world_size=d.world,
                                             timeout=datetime.timedelta(minutes=60),
                                             **({"device_id": dev} if dev.type == "cuda" else {}))
        started = True
    ok = False
    try:
        yield d, dev
        ok = True
    finally:
        if started:
            if ok:  # no rank tears gloo down while another still talks to it (SIGABRT at exit otherwise)
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def end_worker(d: Dist) -> None:
    """Exit a torchrun worker whose run has finished and whose output is written, without interpreter
    finalization (no-op in one process).

    What still holds the gloo process group after :func:`session` destroyed it (FSDP's device mesh, autograd
    hooks in reference cycles) is otherwise freed during finalization, where gloo's threads can abort the rank
    (SIGABRT, "terminate called without an active exception") and turn a finished run into a failed one: seen
    in CI under load, twice in a row."""
    if d.active:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def grad_accum_for(batch_size: int, grad_accum: int | None, global_batch: int | None, world: int) -> int:
    """--grad-accum, or the one that makes --global-batch = batch_size x grad_accum x world (which must divide)."""
    if batch_size < 1:
        raise RetraceError(f"--batch-size must be positive, got {batch_size}")
    if grad_accum is not None and grad_accum < 1:
        raise RetraceError(f"--grad-accum must be positive, got {grad_accum}")
    if global_batch is None:
        return grad_accum or 1
    per_step = batch_size * world
    if global_batch < 1 or global_batch % per_step:
        raise RetraceError(f"--global-batch {global_batch} is not a multiple of --batch-size {batch_size} x world size "
                           f"{world} = {per_step}")
    if grad_accum is not None and grad_accum * per_step != global_batch:
        raise RetraceError(f"--global-batch {global_batch} != --batch-size {batch_size} x --grad-accum {grad_accum} x "
                           f"world size {world}")
    return global_batch // per_step


def strided(n: int, d: Dist) -> list[int]:
    """This rank's share of range(n): every world-th index from its rank."""
    return list(range(d.rank, n, d.world))


def wrap(module: torch.nn.Module, d: Dist, device: torch.device, fsdp: bool = False):
    """DDP over `module`'s trainable parameters, or with --fsdp their FSDP2 shards (retrace.train.fsdp: in place,
    so build the optimizer from the module's parameters after this); the module itself for one process.
    Returns the wrapped module; call it, never the inner module, for forwards that take gradients."""
    if not d.active:
        return module
    if fsdp:
        from retrace.train import fsdp as fs

        return fs.shard(module, d.world, device)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(model, last: bool):
    """Skip the gradient all-reduce (DDP) / reduce-scatter (FSDP) on all but the last micro-batch of a step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


__all__ = ["Dist", "from_env", "session", "device_for", "strided", "wrap", "no_sync"]
