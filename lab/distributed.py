"""Several processes on one sweep: ``torchrun --nproc-per-node N -m observers run ...``.

Ranks split the layers: layer ``i`` of the sweep goes to rank ``i % world_size``, and each rank
analyses its layers completely. For activation kinds every rank runs the calibration forward
itself over all calibration batches, so every observer sees exactly what it sees in a single
process and gives bit-identical qparams (a moving average or a running histogram depends on the
order of its batches, which merged per-rank statistics could not promise). The price: every rank
holds the model and runs every calibration pass of its chunks. Splitting the calibration batches
between ranks and merging the observers' statistics is not implemented yet.

Rank 0 gathers the finished records (``gather_object``) and is the only one that writes files.
The process group comes from torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``): gloo on CPU, nccl on CUDA with ``LOCAL_RANK`` picking the GPU.
Starting waits at most ``START_TIMEOUT`` (a rank that never comes is an error, not a hang);
the work itself then runs in a group with a long timeout, since a rank may wait minutes for a
slower one to finish its layers. Ranks started with different arguments are refused on every
rank (``check_same``) before any work, and an error on one rank stops every rank (``lab.sweep``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

START_TIMEOUT = timedelta(seconds=60)
WORK_TIMEOUT = timedelta(hours=6)
MISMATCH = "ranks were started with different arguments"


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks; the single-process default needs no process group
    (``group`` None), so one code path serves both."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None

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
        cuda = rank_device(device, local).startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size, timeout=START_TIMEOUT)
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"could not start the process group of {size} ranks: {err}") from None
    return Ranks(rank, size, local, dist.new_group(timeout=WORK_TIMEOUT))


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
        import torch.distributed as dist

        dist.destroy_process_group()
