"""Process groups of ``torchrun`` runs: each process calls :func:`init_from_env` and gets its share of the row
chunks; without ``WORLD_SIZE`` the run is a single process and nothing is initialized."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    """This process's place in the job."""

    rank: int = 0  # rank 0 creates the store and writes attributes
    world_size: int = 1
    local_rank: int = 0  # index on this node (picks the GPU)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every process (no-op for a single process)."""
        if self.world_size > 1:
            torch.distributed.barrier()


def init_from_env() -> Dist:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on GPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Dist()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend=backend)
    return Dist(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")))
