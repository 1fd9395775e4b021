"""Feeding each rank only its own shard of the data.

Under a plan the global batch's rows are split over the data-parallel ranks (dp, and ep, which is
carved from dp); tp, cp and pp peers of a rank consume the same rows. So a data pipeline needs
one shard per dp x ep rank, not one per process:

    step = usc.compile(model, "dp=4 tp=2", example_inputs=global_example)
    sampler = usc.data.sampler(dataset, step)            # DistributedSampler over the 4 data shards
    loader = DataLoader(dataset, batch_size=global_batch // usc.data.shard(step)[1], sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for tokens, labels in loader:
            step.step(tokens, labels, local=True)        # this rank's rows only

The loss keeps its global meaning: the program sums token counts over every data shard, so the
step's loss and gradients are those of one device on the union of the shards (with microbatches,
shard r's microbatch m is its m-th chunk: ``local_slice`` shows which rows of a global batch that is).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch.utils.data import Dataset, DistributedSampler
from torch.utils._pytree import tree_map

from usc.runtime.training import data_shard


def _rank_coord(step) -> tuple:
    if not hasattr(step, "_rank"):  # usc.simulate runs every rank: which one is meant must be said
        raise TypeError("usc.simulate runs every rank in this process: pass coord= (one of "
                        "usc.data.shard_coords(sim)) to say which rank's shard")
    return step._rank().mesh.coord


def shard_coords(step) -> list[tuple]:
    """One mesh coordinate per data shard, in shard order: the ranks whose batches a simulated
    ``step(..., local=True)`` takes (``local_slice(sim, *batch, coord=c)`` for each)."""
    if step.program is None:
        raise RuntimeError("compile with example_inputs= first: the batch layout decides the data shards")
    mesh = step.program.mesh
    coords = {}
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        coords.setdefault(shard(step, coord=coord)[0], coord)
    return [coords[i] for i in sorted(coords)]


def shard(step, *, coord: tuple | None = None) -> tuple[int, int]:
    """(index, count): this rank's data shard among the dp x ep shards of the batch."""
    if step.program is None:
        raise RuntimeError("compile with example_inputs= first: the batch layout decides the data shards")
    return data_shard(step.program.inputs[0], step.program.mesh, coord if coord is not None else _rank_coord(step))


def sampler(dataset: Dataset, step, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
            ) -> DistributedSampler:
    """A torch DistributedSampler over this rank's data group: replicas = dp x ep shards, rank = this
    rank's shard (its tp/cp/pp peers get the same samples)."""
    index, count = shard(step)
    return DistributedSampler(dataset, num_replicas=count, rank=index, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


def local_slice(step, *batch, coord: tuple | None = None):
    """The rows of a global batch that ``step.step(..., local=True)`` on this rank (or the rank at
    ``coord``) stands for: microbatch by microbatch, this shard's part of each. A dict batch
    (``local_slice(step, batch_dict)``) gives a dict of the same keys."""
    index, count = shard(step, coord=coord)
    mb = int(step.plan.get("mb"))

    def rows(v):
        return torch.cat([m.chunk(count)[index] for m in v.chunk(mb)]) if isinstance(v, torch.Tensor) and v.dim() \
            else v
    if len(batch) == 1 and isinstance(batch[0], Mapping):
        return {k: rows(v) for k, v in batch[0].items()}
    return tree_map(rows, tuple(batch))  # a dict or list inside the tuple: each of its tensors
