"""Hand-written PyTorch-native versions of the plans benchmarks/native_comparison.py times.

Each builder takes the full model (built from the same seed on every rank), this rank's number
and the global batch, applies PyTorch's own parallelism API the way its tutorials and torchtitan
do, and returns a `NativeTrainer` whose `step(batch)` runs one AdamW step and returns the global
mean loss (as `usc.Compiled.step` does), and whose `state_bytes` holds this rank's parameter +
gradient + optimizer bytes measured at the gradient peak (after backward, before the update).

What each side shards (the usc side finds the same split itself, see its report):

| plan        | native                                                                            |
|-------------|-----------------------------------------------------------------------------------|
| dp=4        | `DistributedDataParallel` (25 MiB buckets, as usc's default `bucket_mb=25`)       |
| tp=4        | `parallelize_module` on a 1-D mesh: q/k/v, gate/up `ColwiseParallel`; o, down     |
|             | `RowwiseParallel`; embedding `RowwiseParallel` (vocab-split); lm head             |
|             | `ColwiseParallel(output_layouts=Shard(-1))` + `loss_parallel()` (vocab-parallel   |
|             | cross-entropy, logits never gathered); norms replicated                           |
| dp=2 tp=2   | TP as above on mesh["tp"] + `replicate` (FSDP2-style DDP, `torch.distributed.     |
|             | _composable.replicate_with_fsdp`, works on DTensor parameters) per layer and root |
|             | on mesh["dp"]                                                                     |
| zero=3 dp=4 | FSDP2 `fully_shard` per decoder layer, then the root (reshard after forward)      |
| pp=4        | the model cut by hand into 4 stages (embedding + layer 0 | layer 1 | layer 2 |    |
|             | layer 3 + norm + lm head), `PipelineStage` + `Schedule1F1B`, loss on the last     |
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def tensor_bytes(tensors) -> int:
    """Bytes of the local storage of tensors (DTensors: their local shard), each storage once."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.dim() > 0:
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    grads = [p.grad for p in params]
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(states)


@dataclass
class NativeTrainer:
    """forward_backward(batch) -> local loss tensor (backward done); global_loss(local) -> float."""

    forward_backward: Callable[[tuple], torch.Tensor]
    global_loss: Callable[[torch.Tensor], float]
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer = field(init=False)
    state_bytes: int = 0

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(self.params)  # usc's default optimizer: AdamW, its defaults

    def step(self, batch: tuple) -> float:
        loss = self.forward_backward(batch)
        self.state_bytes = state_bytes(self.params, self.optimizer)
        value = self.global_loss(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value


def _dp_slice(batch: tuple, dp: int, coord: int) -> tuple:
    return tuple(t.chunk(dp, 0)[coord] for t in batch)


def _mean_over(group, size: int):
    """The global mean loss of equal-sized shards: all-reduce of the local means / size."""
    def reduce(loss: torch.Tensor) -> float:
        value = loss.detach().clone()
        dist.all_reduce(value, group=group)
        return float(value) / size
    return reduce


# ----------------------------------------------------------------------------------------- dp
def build_ddp(model: nn.Module, rank: int, world: int) -> NativeTrainer:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, bucket_cap_mb=25)

    def forward_backward(batch):
        loss = ddp(*_dp_slice(batch, world, rank))
        loss.backward()
        return loss

    return NativeTrainer(forward_backward, _mean_over(None, world), list(ddp.parameters()))


# ----------------------------------------------------------------------------------------- tp
def megatron_plan(model: nn.Module) -> dict:
    """Megatron pairs per decoder layer, vocab-split embedding and lm head (torchtitan's Llama plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    for layer in model.layers:  # the attention reshapes see local heads (as torchtitan adjusts them)
        layer.self_attn.heads //= tp
        layer.self_attn.kv_heads //= tp
    return parallelize_module(model, tp_mesh, megatron_plan(model))


def _tp_forward_backward(model: nn.Module, slicer: Callable[[tuple], tuple]):
    from torch.distributed.tensor.parallel import loss_parallel

    def forward_backward(batch):
        with loss_parallel():  # vocab-parallel cross-entropy on the Shard(-1) logits
            loss = model(*slicer(batch))
            loss.backward()
        return loss.to_local().detach()
    return forward_backward


def build_tp(model: nn.Module, rank: int, world: int) -> NativeTrainer:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = apply_tp(model, mesh)
    return NativeTrainer(_tp_forward_backward(model, lambda b: b), lambda loss: float(loss),
                         list(model.parameters()))


def build_dp_tp(model: nn.Module, rank: int, world: int, *, dp: int = 2) -> NativeTrainer:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    model = apply_tp(model, mesh["tp"])
    for layer in model.layers:
        replicate(layer, mesh=mesh["dp"])
    replicate(model, mesh=mesh["dp"])
    coord = mesh.get_coordinate()[0]
    slicer = lambda b: _dp_slice(b, dp, coord)  # noqa: E731
    return NativeTrainer(_tp_forward_backward(model, slicer), _mean_over(mesh["dp"].get_group(), dp),
                         list(model.parameters()))


# ------------------------------------------------------------------------------------ zero=3
def build_fsdp(model: nn.Module, rank: int, world: int) -> NativeTrainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def forward_backward(batch):
        loss = model(*_dp_slice(batch, world, rank))
        loss.backward()
        return loss

    return NativeTrainer(forward_backward, _mean_over(None, world), list(model.parameters()))


# ---------------------------------------------------------------------------------------- pp
class Stage(nn.Module):
    """A contiguous piece of TinyLlama: [embedding] + layers [+ norm + lm head]."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cos, sin = self.rope_cos[: x.shape[1]], self.rope_sin[: x.shape[1]]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TinyLlama's own loss: next-token cross-entropy, labels shifted inside."""
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_pp(model: nn.Module, rank: int, world: int, *, microbatches: int) -> NativeTrainer:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    per_stage = len(model.layers) // world
    layers = range(rank * per_stage, (rank + 1) * per_stage)
    first, last = rank == 0, rank == world - 1
    module = Stage(copy.copy(model), layers, first=first, last=last)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, microbatches, loss_fn=shifted_cross_entropy)

    def forward_backward(batch):
        tokens, labels = batch
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(tokens)
        elif last:
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
        # equal microbatches: the global token mean is the mean of the microbatch means
        return torch.stack(losses).mean().detach() if last else torch.zeros(())

    def global_loss(loss: torch.Tensor) -> float:
        value = loss.clone()
        dist.broadcast(value, src=world - 1)
        return float(value)

    return NativeTrainer(forward_backward, global_loss, list(module.parameters()))
