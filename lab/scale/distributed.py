"""Several processes on one sweep: ``torchrun --nproc-per-node N -m observers run ...``.

Ranks divide the work one of two ways (``RankSplit``; ``lab.scale.sweep`` picks, ``--split`` overrides):

- **layers**: layer ``i`` of the sweep goes to rank ``i % world_size`` (``owner``), which analyses
  it completely, running every calibration batch itself; every observer then sees exactly what
  it sees in one process and gives bit-identical qparams.
- **batches** (the default when activations are captured): every rank analyses every layer on a
  consecutive share of the calibration batches, and the activation observers merge their
  statistics with ``Ranks.reduce`` (all-reduce MIN/MAX/SUM, an all-gather for per-token qparams;
  ``observers.shared`` and each observer's ``merge_rule`` say how exact); weights are still split
  by layer. Each rank runs 1/N of every calibration pass instead of all of it.

Rank 0 gathers the finished records (``gather_object``) and is the only one that writes files.
The process group comes from torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``): gloo on CPU, nccl on CUDA with ``LOCAL_RANK`` picking the GPU.
Starting waits at most ``START_TIMEOUT`` (a rank that never comes is an error, not a hang);
the work itself then runs in a group with a long timeout, since a rank may wait minutes for a
slower one. Ranks started with different arguments are refused on every rank (``check_same``)
before any work; an error on one rank stops every rank (``agree`` before collectives that a failed
rank would skip, and ``lab.scale.sweep`` between chunks).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch

from observers.shared import Op, agree

START_TIMEOUT = timedelta(seconds=60)
WORK_TIMEOUT = timedelta(hours=6)
MISMATCH = "ranks were started with different arguments"


class RankSplit(StrEnum):
    """What several ranks divide between them."""

    LAYERS = "layers"
    """Each layer is analysed whole by one rank (every rank runs every calibration batch): every
    observer's result is bit for bit that of one process."""
    BATCHES = "batches"
    """Every rank captures a share of the calibration batches for every layer and the activation
    observers merge their statistics (``observers.shared``; each observer's ``merge_rule`` says
    whether exactly); weights are still split by layer. Each rank runs 1/N of the calibration."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks; the single-process default needs no process group
    (``group`` None), so one code path serves both."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None
    device: str = "cpu"
    """Where this rank's collectives run (nccl needs the rank's GPU)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that reads and writes files and draws progress."""
        return self.rank == 0

    def device_for(self, device: str) -> str:
        """The device this rank works on (``rank_device``); a single process keeps ``device``."""
        return device if self.group is None else rank_device(device, self.local_rank)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (in rank order); None on the other ranks."""
        if self.group is None:
            return [value]
        import torch.distributed as dist

        found: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, found, dst=0, group=self.group)
        return found

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what other ranks pass is ignored)."""
        if self.group is None:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def reduce(self, tensor: torch.Tensor, op: Op) -> torch.Tensor:
        """``tensor`` combined over every rank (``observers.shared.Reduce``): all-reduce MIN/MAX/SUM
        of a copy, or for CAT the ranks' tensors concatenated along dim 0 in rank order, their
        sizes first shared so that unequal parts can travel padded to one size."""
        if self.group is None:
            return tensor
        import torch.distributed as dist

        if op != Op.CAT:
            result = tensor.detach().clone()
            how = {Op.MIN: dist.ReduceOp.MIN, Op.MAX: dist.ReduceOp.MAX, Op.SUM: dist.ReduceOp.SUM}[op]
            dist.all_reduce(result, op=how, group=self.group)
            return result
        sizes = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([tensor.shape[0]], device=tensor.device), group=self.group)
        longest = max(int(size) for size in sizes)
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[: int(size)] for part, size in zip(parts, sizes, strict=True)], dim=0)

    def agree(self, error: Exception | None) -> None:
        """Raise on every rank when any rank failed (this rank's own error where it failed), so no
        rank goes on to a collective that a failed rank will never join."""
        if self.group is not None:
            agree(error, self.reduce, self.device)
        elif error is not None:
            raise error

    def check_same(self, text: str) -> None:
        """Refuse, on every rank alike, ranks whose ``text`` (their parsed arguments) differs:
        they would split layers of different runs into one file."""
        if self.group is None:
            return
        import torch.distributed as dist

        digest = hashlib.sha256(text.encode()).hexdigest()
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, digest, group=dist.group.WORLD)
        if len(set(every)) > 1:
            raise ValueError(MISMATCH)


SINGLE = Ranks()


def owner(index: int, world_size: int) -> int:
    """The rank that analyses layer ``index`` of a sweep: round robin, so neighbouring layers
    (often of one shape and cost, e.g. a block's q/k/v) land on different ranks and loads stay even."""
    return index % world_size


def world_size() -> int:
    """``WORLD_SIZE`` of the environment (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_device(device: str, local_rank: int) -> str:
    """The device a rank works on: ``cuda`` (or ``auto`` with a GPU) becomes ``cuda:LOCAL_RANK``,
    so the ranks of one node use one GPU each; an explicit ``cuda:K`` or ``cpu`` is kept."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{local_rank}" if device == "cuda" else device


def _start(device: str) -> Ranks:
    import torch.distributed as dist

    size = world_size()
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        own_device = rank_device(device, local)
        cuda = own_device.startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size, timeout=START_TIMEOUT)
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"could not start the process group of {size} ranks: {err}") from None
    return Ranks(rank, size, local, dist.new_group(timeout=WORK_TIMEOUT), own_device)


@contextmanager
def ranks_for(device: str) -> Iterator[Ranks]:
    """The ranks of this process: ``SINGLE`` outside torchrun, else a started process group,
    destroyed on the way out (errors included)."""
    if world_size() <= 1:
        yield SINGLE
        return
    ranks = _start(device)
    try:
        yield ranks
    finally:
        _leave_together()


def _leave_together() -> None:
    """Meet the other ranks, then take the process group down: a rank that tears its connections
    down while another still talks to it can abort (gloo's threads see the peer go) instead of
    exiting with its error. The meeting waits at most the start timeout, so a rank that died
    cannot keep the others."""
    import torch.distributed as dist

    try:
        dist.barrier()
    except (RuntimeError, ValueError):  # a rank is gone: nothing to wait for
        pass
    dist.destroy_process_group()
