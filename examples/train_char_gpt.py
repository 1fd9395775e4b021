"""Train a small character-level GPT on text every Python install ships (the standard library's own
source files) on 4 local gloo processes, and draw its loss curve over the same run on one device.

    python examples/train_char_gpt.py            # a few minutes on a laptop CPU

The loop is the one people write: AdamW with weight decay off for norms, biases and embeddings,
linear warmup then cosine decay, gradient clipping at 1.0, an evaluation every EVAL_EVERY steps, a
progress line per step. Half-way it saves a sharded checkpoint under plan A, the processes exit,
and a new set of processes resumes from it under plan B (another parallelism: the checkpoint
does not care). The one-device run is plain PyTorch with the same recipe.
"""

import importlib
import inspect
import os
import tempfile

import torch

import usc
from usc.runtime.launch import launch_local
from usc.testing.models import GPT2Config, TinyGPT2

PLAN_A, PLAN_B = "dp=2 tp=2", "pp=2 tp=2 mb=2"
STEPS, RESUME_AT, EVAL_EVERY = 120, 60, 20
BATCH, SEQ = 8, 64
LR, WARMUP, WEIGHT_DECAY, MAX_NORM = 3e-3, 12, 0.1, 1.0
SOURCES = ["textwrap", "string", "difflib", "heapq", "bisect", "fractions", "calendar", "shlex"]
PICTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "train_char_gpt.png")


# ------------------------------------------------------------------------------------- data
def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, held-out ids, vocabulary size): characters of some stdlib modules' source."""
    text = "".join(inspect.getsource(importlib.import_module(name)) for name in SOURCES)
    chars = sorted(set(text))
    vocab = -(-len(chars) // 8) * 8  # a multiple of 8: the vocabulary splits over tp
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], vocab


def batch_at(ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH windows of SEQ + 1 characters at random offsets: (input, next character)."""
    starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=torch.Generator().manual_seed(seed))
    windows = torch.stack([ids[s: s + SEQ + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def build_model(vocab: int) -> TinyGPT2:
    torch.manual_seed(0)
    return TinyGPT2(GPT2Config(vocab=vocab, hidden=64, heads=4, layers=2, max_seq=SEQ))


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln_" in name or name.startswith(("ln_", "wte", "wpe"))


# ------------------------------------------------------------------------------ on the mesh
def train_on_mesh(plan: str, first: int, last: int, checkpoint: str) -> dict:
    """One rank's part of steps [first, last) (every rank runs this; rank 0 reports)."""
    torch.set_num_threads(1)
    train, held_out, vocab = corpus()
    # usc.training.NO_DECAY (biases, norms, embeddings) names the same weights as no_decay() below
    optimizer = usc.training.param_groups(lambda groups: torch.optim.AdamW(groups, lr=LR), weight_decay=WEIGHT_DECAY)
    step = usc.compile(build_model(vocab), plan, example_inputs=batch_at(train, 0), optimizer=optimizer,
                       lr_scheduler=usc.training.warmup_cosine(warmup=WARMUP, total=STEPS))
    if first > 0:
        step.load(checkpoint)  # weights, AdamW state, schedule position: all from the checkpoint
    rank0 = int(os.environ["RANK"]) == 0
    losses, evals = [], {}
    for i in range(first, last):
        losses.append(step.step(*batch_at(train, i), max_grad_norm=MAX_NORM))
        if rank0:
            print(f"[{plan}] {step.metrics}", flush=True)
        if (i + 1) % EVAL_EVERY == 0:
            evals[i + 1] = step.eval_step(*batch_at(held_out, 10_000))
            if rank0:
                print(f"[{plan}] step {i + 1}: held-out loss {evals[i + 1]:.4f}", flush=True)
    if last < STEPS:
        step.save(checkpoint)
    return {"losses": losses, "evals": evals}


# ---------------------------------------------------------------------------- on one device
def train_on_one_device() -> dict:
    train, held_out, vocab = corpus()
    model = build_model(vocab)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if not no_decay(n)], "weight_decay": WEIGHT_DECAY},
                                   {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}], lr=LR)
    scheduler = usc.training.warmup_cosine(warmup=WARMUP, total=STEPS)(optimizer)
    losses, evals = [], {}
    for i in range(STEPS):
        loss = model(*batch_at(train, i))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (i + 1) % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                evals[i + 1] = model(*batch_at(held_out, 10_000)).item()
            model.train()
    return {"losses": losses, "evals": evals}


def draw(mesh: dict, single: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no loss curve drawn")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = range(1, STEPS + 1)
    ax.plot(steps, single["losses"], color="black", linewidth=3, alpha=0.35, label="one device (plain PyTorch)")
    ax.plot(steps[:RESUME_AT], mesh["losses"][:RESUME_AT], color="tab:blue", linewidth=1,
            label=f'usc "{PLAN_A}" (4 gloo processes)')
    ax.plot(steps[RESUME_AT:], mesh["losses"][RESUME_AT:], color="tab:orange", linewidth=1,
            label=f'usc "{PLAN_B}", resumed from the checkpoint')
    ax.scatter(list(single["evals"]), list(single["evals"].values()), color="black", alpha=0.35, s=60,
               label="held-out loss, one device")
    ax.scatter(list(mesh["evals"]), list(mesh["evals"].values()), color="tab:red", marker="x", s=40,
               label="held-out loss, usc (eval_step)")
    ax.axvline(RESUME_AT, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("char-level GPT on the standard library's source: warmup + cosine, clip 1.0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    checkpoint = os.path.join(tempfile.mkdtemp(prefix="usc-char-gpt-"), "ckpt")
    print(f'steps 0-{RESUME_AT} under "{PLAN_A}", then a checkpoint and new processes under "{PLAN_B}"')
    first = launch_local(train_on_mesh, 4, PLAN_A, 0, RESUME_AT, checkpoint)[0]
    second = launch_local(train_on_mesh, 4, PLAN_B, RESUME_AT, STEPS, checkpoint)[0]
    mesh = {"losses": first["losses"] + second["losses"], "evals": {**first["evals"], **second["evals"]}}
    single = train_on_one_device()
    worst = max(abs(a - b) for a, b in zip(mesh["losses"], single["losses"]))
    worst_eval = max(abs(mesh["evals"][k] - single["evals"][k]) for k in single["evals"])
    print(f"\nfinal loss: usc {mesh['losses'][-1]:.4f}, one device {single['losses'][-1]:.4f}")
    print(f"largest |difference| over {STEPS} steps: training loss {worst:.2e}, held-out loss {worst_eval:.2e}")
    if draw(mesh, single, os.path.abspath(PICTURE)):
        print(f"loss curve: {os.path.abspath(PICTURE)}")


if __name__ == "__main__":
    main()
