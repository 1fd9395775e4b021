"""The fake-CUDA tier: every plan kind's rank programs on a device this machine does not have.

Rank 0 and the last rank of each plan (the first and the last coordinate of every axis; every rank
with USC_DEEP_TIER=1) run on fake tensors (no memory, no GPU) with peerless collectives that
refuse tensors off the program's device (as NCCL refuses host tensors); the model and the batch
are built on the CPU, as users build them, so the runtime must move them. A rank fails the test if
any op mixes devices (FakeTensor raises) or the runtime creates a tensor off the device (the
DeviceWatch records it, 0-dim tensors included). The ranks run on the Python-registered
accelerator "fakegpu": in a CPU-only build fake ``cuda`` tensors cannot take part in autograd nor
be copied (torch asks the missing CUDA device guard); on ``cuda:0`` each rank's bound program is
checked as a graph. See usc/testing/fake_device.py. USC_DEEP_TIER=1 also adds heavier plans (DEEP_PLANS).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import usc
from usc.runtime.errors import CollectiveError
from usc.runtime import pipeline as pipeline_module
from usc.runtime.executor import bind_graph
from usc.runtime.mesh import shape_mesh
from usc.testing.fake_device import fake_accelerator, run_fake_rank
from usc.testing.models import DropoutNet, MoEConfig, TinyLlama, TinyMixtral, token_batch

# Autograd sizes its per-device queues at the first backward of a process, so the Python-registered
# accelerator must exist before any backward runs: the tier runs in a fresh pytest process of its own
# (one test below starts it; inside it, the tier's tests run and that one is skipped).
IN_FRESH_PROCESS = os.environ.get("USC_FAKE_DEVICE_TIER") == "1"
_tier = pytest.mark.skipif(not IN_FRESH_PROCESS, reason="runs in its own process (see "
                           "test_the_tier_passes_in_a_fresh_process)")


@pytest.mark.skipif(IN_FRESH_PROCESS, reason="this is the fresh process")
def test_the_tier_passes_in_a_fresh_process():
    env = dict(os.environ, USC_FAKE_DEVICE_TIER="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout

# (plan, model kind): every parallelism and every runtime path that makes tensors of its own
PLANS = [
    ("dp=2", "llama"),
    ("tp=2", "llama"),
    ("dp=3 tp=2 sp=on", "llama"),
    ("cp=2 cp_mode=ring", "llama"),
    ("cp=2 cp_mode=zigzag", "llama"),
    ("cp=2 cp_mode=ulysses", "llama"),
    ("pp=2 mb=2 schedule=1f1b", "llama"),
    ("pp=2 mb=4 schedule=interleaved v=2", "llama"),
    ("pp=2 mb=2 schedule=zb", "llama"),
    ("dp=2 zero=1", "llama"),
    ("dp=2 mb=2 zero=2", "llama"),  # reduce-scattered in every microbatch, the slices summed
    ("dp=2 zero=1 dtype=bf16", "llama"),  # the updated slices gathered in bf16, then a save's float32 gather
    ("dp=2 zero=3", "llama"),
    ("dp=2 mb=2 dtype=bf16", "llama"),
    ("dp=2 recompute=selective", "llama"),
    ("dp=4 ep=2", "moe"),
    ("dp=2 ep=2", "moe"),
    ("dp=2 pp=2 mb=2 schedule=gpipe", "llama"),  # the dp reduction overlapping the pipeline's backward
    ("dp=2 mb=2", "dropout"),  # random draws keyed on the device, per microbatch, each rank its rows
    ("dp=2 recompute=full", "dropout"),  # the masks drawn again in backward from the kept key
    ("dp=2 mb=2", "z_loss"),  # the step's token count, summed on the device before the first microbatch
    ("pp=2 mb=2", "z_loss"),
]
# Heavier combinations, run with USC_DEEP_TIER=1 (8 ranks, or paths the plans above already reach)
DEEP_PLANS = [
    ("dp=2 fuse=on", "llama"),
    ("dp=2 pp=2 mb=2 zero=1", "llama"),
    ("dp=2 ep=2 tp=2", "moe"),
    ("dp=2 tp=2 cp=2 cp_mode=ring", "llama"),
]
if os.environ.get("USC_DEEP_TIER") == "1":
    PLANS += DEEP_PLANS


class ZLossTagger(torch.nn.Module):
    """A masked token mean beside a z-loss over every token: divides by the step's count."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)

    def forward(self, ids, labels):
        z = self.head(torch.relu(self.mid(self.emb(ids)))).reshape(-1, 32)
        y = labels.reshape(-1)
        counted = (y != 0).to(z.dtype)
        per_token = torch.nn.functional.cross_entropy(z, y, reduction="none")
        return (per_token * counted).sum() / counted.sum() + 1e-3 * torch.logsumexp(z, -1).pow(2).mean()


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "z_loss":
        return ZLossTagger(), token_batch(32, 8, 6)
    if kind == "moe":
        return TinyMixtral(MoEConfig()), token_batch(MoEConfig().vocab, 4, 12)
    if kind == "dropout":
        return DropoutNet(0.3), token_batch(32, 8, 6)
    return TinyLlama(), token_batch(128, 12, 12)


_compiled: dict[tuple[str, str], object] = {}


def _compile(plan: str, kind: str):
    if (plan, kind) not in _compiled:
        model, batch = _model(kind)
        _compiled[(plan, kind)] = usc.compile(model, plan, example_inputs=batch)
    return _compiled[(plan, kind)]


# Recompute's backward re-runs forward inside torch.utils.checkpoint, which aborts the process on
# the Python-registered accelerator (a C++ terminate in the autograd device thread): forward only.
TRAINED = [(p, k) for p, k in PLANS if "recompute" not in p]


def _first_and_last(world: int) -> tuple[int, ...]:
    """Rank 0 (coordinate 0 of every axis: the rank that writes checkpoints, a pipeline's first
    stage) and the last rank (the last coordinate of every axis: the last stage, the last tp and dp
    shard). The ranks between run the same program at other coordinates; the deep tier runs them."""
    if os.environ.get("USC_DEEP_TIER") == "1":
        return tuple(range(world))
    return tuple(sorted({0, world - 1}))


@_tier
@pytest.mark.parametrize("plan,kind", TRAINED, ids=[f"{p} ({k})" for p, k in TRAINED])
def test_the_first_and_last_rank_train_on_the_accelerator_without_a_host_tensor(plan, kind):
    compiled = _compile(plan, kind)
    device = fake_accelerator()
    for rank in _first_and_last(compiled.plan.world_size):
        report = run_fake_rank(compiled, rank, device=device, steps=2)
        assert report.steps == 2
        assert report.wrong == [], f"rank {rank}: " + "; ".join(map(str, report.wrong))
        assert report.state_devices == {device}  # parameters and loaded optimizer state
        assert report.saved_devices <= {device}  # a replica writes nothing (coordinate 0 does)


@_tier
@pytest.mark.parametrize("plan,kind", PLANS, ids=[f"{p} ({k})" for p, k in PLANS])
def test_every_rank_program_creates_its_tensors_on_cuda(plan, kind):
    """torch.export bakes the tracing device (the CPU) into the graph's factory calls; each rank's
    bound program creates them on its device instead (checked on the graph: fake CUDA tensors
    cannot even be copied in a CPU-only build)."""
    compiled = _compile(plan, kind)
    program = compiled.program
    cuda = torch.device("cuda", 0)
    traced = _factory_devices(program.gm)
    bound = _factory_devices(bind_graph(program.gm, shape_mesh(program.mesh.axes, program.mesh.shape, 0, cuda)))
    assert len(bound) == len(traced)
    assert set(bound) <= {cuda}, bound


def _factory_devices(gm) -> list[torch.device]:
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return [n.kwargs["device"] for g in graphs for n in g.nodes
            if n.op == "call_function" and isinstance(n.kwargs.get("device"), torch.device)]


@_tier
def test_a_moe_program_traced_on_the_cpu_has_factories_to_move():
    """The check above is not vacuous: the MoE program's router builds tensors with arange."""
    traced = _factory_devices(_compile("dp=2 ep=2", "moe").program.gm)
    assert traced and set(traced) == {torch.device("cpu")}


@_tier
def test_a_pipeline_buffer_made_on_the_host_is_caught(monkeypatch):
    """The tier can fail: a receive buffer created without the program's device is reported
    with the line that made it."""
    def host_recv(self, message, peer):
        direction, kind, mb = message
        shape, dtype, _ = self.specs[kind[0]].outputs[kind[2]]
        return self._post([(torch.empty(shape, dtype=self._wire(dtype)), peer)])[0]

    monkeypatch.setattr(pipeline_module.PipelineMixin, "_recv", host_recv)
    compiled = _compile("pp=2 mb=2 schedule=1f1b", "llama")
    with pytest.raises(CollectiveError, match=r"a cpu tensor \[\d+, 12, \d+\] handed to a collective of a program "
                                              r"on fakegpu:0"):
        run_fake_rank(compiled, 1, device=fake_accelerator(), steps=1)


@_tier
def test_a_host_scalar_is_caught(monkeypatch):
    """A 0-dim tensor on the host mixes silently with device tensors (CUDA allows it), so only the
    watch sees it: the pipeline's loss count made without the device."""
    original = pipeline_module.PipelineMixin._pipeline_global

    def host_count(self, total, count):
        torch.tensor(1.0, dtype=torch.float64)  # what the runtime used to do
        return original(self, total, count)

    monkeypatch.setattr(pipeline_module.PipelineMixin, "_pipeline_global", host_count)
    compiled = _compile("pp=2 mb=2 schedule=1f1b", "llama")
    report = run_fake_rank(compiled, 0, device=fake_accelerator(), steps=1, checkpoint=False)
    assert [w.op for w in report.wrong] and all("test_fake_cuda.py" in w.where for w in report.wrong)
