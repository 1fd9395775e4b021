"""Peak bytes each rank allocates while saving a checkpoint, against its own share of the state.

    python benchmarks/checkpoint_save_memory.py                  # usc's 4-layer TinyLlama
    python benchmarks/checkpoint_save_memory.py --model hf-llama  # Hugging Face Llama, 8 layers, built on meta

Under "dp=4 tp=2 zero=3" (8 simulated ranks: each holds 1/8 of parameters and AdamW state, the
model is 8x one rank's share). Every tensor a torch op allocates inside the rank's save is counted
while it lives (views of existing tensors allocate nothing); the peak over the save is reported per
rank. ``--model hf-llama`` builds the model on the meta device and lets each rank materialise its
share (a tree without that builds it on the CPU: the save does not depend on how the model was made).
"""

import torch

import usc
from usc.testing.memory_counters import PeakAllocations
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

PLAN = "dp=4 tp=2 zero=3"


def measure(sim, save_rank) -> list[int]:
    """save_rank(rank) runs one rank's part of the save inside the measuring mode."""
    from usc.runtime.mesh import run_in_threads

    def one(mesh):
        with PeakAllocations() as mode:
            save_rank(sim.ranks[mesh.rank])
        return mode.peak

    return run_in_threads(sim.meshes, one, timeout=300)


class LossOf(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids, labels):
        return self.m(input_ids=ids, labels=labels).loss


def hf_llama(device: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    with torch.device(device):
        return LossOf(transformers.LlamaForCausalLM(config))


def simulated(name: str):
    """(simulated mesh after one step, parameter bytes, largest parameter bytes)."""
    torch.manual_seed(0)
    if name == "tiny":
        batch = token_batch(128, 8, 16)
        model = TinyLlama(LlamaConfig(layers=4))
        sim = usc.simulate(model, PLAN, example_inputs=batch)
    else:
        batch = token_batch(512, 8, 16)
        sizes = [p.numel() * 4 for p in hf_llama("meta").parameters()]
        try:
            sim = usc.simulate(hf_llama("meta"), PLAN, example_inputs=batch, init_seed=0)
        except TypeError:  # a tree that cannot materialise a meta-built model
            sim = usc.simulate(hf_llama("cpu"), PLAN, example_inputs=batch)
    sim.step(*batch)
    sizes = [p.numel() * 4 for p in model.parameters()] if name == "tiny" else sizes
    return sim, sum(sizes), max(sizes)


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "hf-llama"), default="tiny")
    sim, params, largest = simulated(parser.parse_args().model)
    share = max(sum(r.memory_bytes().values()) for r in sim.ranks)
    total = params * 3  # params + exp_avg + exp_avg_sq
    path = tempfile.mkdtemp()
    try:
        from usc.runtime import checkpoint_state  # the sharded save

        meta = sim.ranks[0].checkpoint_meta()
        peaks = measure(sim, lambda rank: checkpoint_state.save(rank, f"{path}/ckpt", meta))
        how = "sharded save (each rank writes its pieces)"
    except ImportError:  # the save before sharding: full tensors gathered on every rank, rank 0 writes
        from usc.runtime import checkpoint

        def old(rank):
            tensors, meta = rank.checkpoint_state()
            if rank.mesh.rank == 0:
                checkpoint.write(f"{path}/ckpt", tensors, meta)

        peaks = measure(sim, old)
        how = "full-tensor save (gather, rank 0 writes)"
    print(f"{PLAN}: {how}")
    print(f"  state (params + AdamW) of the model: {total / 2**20:.2f} MiB; one rank's share: {share / 2**20:.3f} MiB; "
          f"largest parameter: {largest / 2**10:.0f} KiB")
    print(f"  peak bytes allocated while saving, per rank: {', '.join(f'{p / 2**10:.1f} KiB' for p in peaks)}")
    print(f"  max / share = {max(peaks) / share:.2f}   max / model state = {max(peaks) / total:.3f}")


if __name__ == "__main__":
    main()
