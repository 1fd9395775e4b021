"""Peak bytes each rank allocates while saving a checkpoint, against its own share of the state.

    python benchmarks/checkpoint_save_memory.py

A 4-layer Llama under "dp=4 tp=2 zero=3" (8 simulated ranks: each holds 1/8 of parameters and
AdamW state, the model is 8x one rank's share). Every tensor a torch op allocates inside the
rank's save is counted while it lives (views of existing tensors allocate nothing); the peak
over the save is reported per rank.
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


def main() -> None:
    import tempfile

    torch.manual_seed(0)
    batch = token_batch(128, 8, 16)
    model = TinyLlama(LlamaConfig(layers=4))
    sim = usc.simulate(model, PLAN, example_inputs=batch)
    sim.step(*batch)
    share = max(sum(r.memory_bytes().values()) for r in sim.ranks)
    total = sum(p.numel() * 4 for p in model.parameters()) * 3  # params + exp_avg + exp_avg_sq
    largest = max(p.numel() * 4 for p in model.parameters())
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
