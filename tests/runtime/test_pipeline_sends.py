"""A pipeline rank lets go of each send once it has finished, not at the end of the step: on NCCL a
send's Work keeps its buffer until waited, so held to the end every microbatch's sent activations
and gradients would pile up (mb of each per cut)."""

import torch

import usc
from usc.testing.models import LlamaConfig, TinyLlama, token_batch


def test_finished_sends_are_released_during_the_step():
    config = LlamaConfig(layers=4)
    torch.manual_seed(0)
    batch = token_batch(config.vocab, 16, 32)
    sim = usc.simulate(TinyLlama(config), "pp=2 mb=8", example_inputs=batch)
    held = []
    for rank in sim.ranks:
        wait_sends = rank._wait_sends

        def counted(rank=rank, wait_sends=wait_sends):
            held.append(len(rank._pending))  # sends still held when the schedule has run
            return wait_sends()

        rank._wait_sends = counted
    sim.step(*batch)
    assert len(held) == 2 and max(held) <= 1  # the simulator's sends finish at once: only the last is held
