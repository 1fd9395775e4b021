"""Rank-side functions for the gloo tests (module level, so the harness can pickle them)."""

import io
import os
import time

import torch

import usc
from usc.testing.equivalence import adamw, as_float64, check_equivalent
from usc.testing.models import TinyDeepSeek, TinyGPT2, TinyLlama, TinyMixtral, shifted_batch, token_batch

MODELS = {
    "llama": (TinyLlama, lambda seed: token_batch(128, 4, 16, seed=seed)),
    "gpt2": (TinyGPT2, lambda seed: shifted_batch(128, 4, 16, seed=seed)),
}
# mixture-of-experts models: their own table, so the dense-model suites do not run them
MOE_MODELS = {
    "mixtral": (TinyMixtral, lambda seed: token_batch(128, 4, 16, seed=seed)),
    "deepseek": (TinyDeepSeek, lambda seed: token_batch(128, 4, 16, seed=seed)),
    # float64: dp=4 leaves one sequence per rank, where AdamW amplifies float32 rounding past 1e-5
    "deepseek64": (lambda: TinyDeepSeek().double(), lambda seed: token_batch(128, 4, 16, seed=seed)),
}

# The optimizer each model trains with in the equivalence tests. GPT-2's key bias has a gradient that
# is zero in exact arithmetic (softmax ignores what is added to every key of a row): AdamW divides its
# float32 rounding by its own square root and moves the bias by whole steps, so under AdamW every
# GPT-2 case misses float32 and needs the float64 opinion. SGD with momentum moves a parameter by lr
# times its gradient: the rounding stays rounding, a gradient reduced twice (which AdamW's scale
# invariance hides) shows at once, and its momentum buffer is optimizer state for ZeRO to shard.
# TinyDeepSeek at dp=2 ep=2 misses the same way on a near-zero element of an attention projection
# (AdamW: 2e-5 off after three steps; SGD: 7e-9). The other models train with AdamW (torch's
# defaults), the optimizer users train with; the float64 DeepSeek case too.
_SGD = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
OPTIMIZERS = {"gpt2": _SGD, "deepseek": _SGD}


def optimizer_for(model_name: str):
    return OPTIMIZERS.get(model_name, adamw)


def train_cases(rank: int, world_size: int, cases: list[tuple[str, str]], steps: int, float64: bool = False) -> list:
    """Every rank builds the same model from the same seed and passes the same global batches
    (float64: the model and batches in float64, the equivalence check's second opinion)."""
    torch.set_num_threads(1)
    out = []
    for model_name, plan in cases:
        factory, batch = {**MODELS, **MOE_MODELS}[model_name]
        torch.manual_seed(0)
        model = factory().double() if float64 else factory()
        batches = [as_float64(batch(seed)) if float64 else batch(seed) for seed in range(steps)]
        step = usc.compile(model, plan, example_inputs=batches[0], optimizer=optimizer_for(model_name))
        losses = [step.step(*b) for b in batches]
        # Bytes travel by value; tensors would travel as shared memory of an exiting process.
        buffer = io.BytesIO()
        torch.save({k: v.detach().clone() for k, v in step.full_state_dict().items()}, buffer)
        out.append((losses, buffer.getvalue() if rank == 0 else None))
    return out


def outcome(results: list, index: int) -> tuple[list[float], dict]:
    """(losses, full state) of case ``index`` of a train_cases world, after checking the ranks agree."""
    per_rank = [r[index][0] for r in results]
    assert all(losses == per_rank[0] for losses in per_rank), f"case {index}: ranks disagree on the loss"
    return per_rank[0], torch.load(io.BytesIO(results[0][index][1]))


def check_case(results: list, index: int, world: int, case: tuple[str, str], steps: int, **tolerances):
    """Case ``index`` of a train_cases world against one device; where float32 misses, the same
    case again on ``world`` gloo processes in float64 decides (usc.testing.equivalence)."""
    return check_cases(results, world, {index: case}, steps, **tolerances)[index]


class _Deferred(Exception):
    """A float32 miss whose float64 opinion runs later, in one world with the other misses."""


def check_cases(results: list, world: int, cases: "dict[int, tuple[str, str]] | list", steps: int, **tolerances):
    """Every case of a train_cases world (``cases``: index -> (model, plan), or the world's list)
    against one device. The cases float32 misses (AdamW turns rounding noise of a gradient that is
    zero in exact arithmetic into whole steps) get their float64 opinion
    together: one more world of ``world`` gloo processes runs all of them in float64, instead of one
    world per miss; each must then equal one device to FLOAT64_TOL. Returns index -> result."""
    from harness import run_world

    cases = dict(enumerate(cases)) if isinstance(cases, list) else dict(cases)
    missed: list[int] = []

    def defer(index):
        def rerun(model, batches):
            missed.append(index)
            raise _Deferred
        return rerun

    def judge(index, rerun):
        name, plan = cases[index]
        factory, batch = {**MODELS, **MOE_MODELS}[name]
        return check_equivalent(factory, [batch(s) for s in range(steps)], outcome(results, index), rerun=rerun,
                                optimizer=optimizer_for(name), what=f"{name} '{plan}' on gloo", **tolerances)

    out = {}
    for index in cases:
        try:
            out[index] = judge(index, defer(index))
        except _Deferred:
            pass
    if missed:
        again = run_world(train_cases, world, [cases[i] for i in missed], steps, True, timeout=300)
        for k, index in enumerate(missed):
            out[index] = judge(index, lambda model, batches, k=k: outcome(again, k))
    return out


def die_mid_training(rank: int, world_size: int, plan: str) -> str:
    torch.manual_seed(0)
    model = TinyLlama()
    batch = token_batch(128, 4, 16)
    step = usc.compile(model, plan, example_inputs=batch)
    step.step(*batch)
    if rank == 1:
        os._exit(1)  # a rank dies between steps
    start = time.monotonic()
    try:
        step.step(*batch)
    except usc.CollectiveError as err:
        return f"{time.monotonic() - start:.1f}|{err}"
    return "no error"


def save_after_two_steps(rank: int, world_size: int, plan: str, path: str) -> list[float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLlama()
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    step = usc.compile(model, plan, example_inputs=batches[0])
    losses = [step.step(*b) for b in batches]
    step.save(path)
    return losses


def die_inside_a_step_after_a_checkpoint(rank: int, world_size: int, plan: str, path: str) -> str:
    """Step 1, save (a complete checkpoint), then rank 1 dies halfway through step 2's collectives.

    The death is placed by counting step 1's all-reduces: rank 1 exits on the first one issued
    after half of step 2's have gone through, so its peers are left inside the step's backward.
    """
    from usc.runtime.comm import ProcessGroupComm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLlama()
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    step = usc.compile(model, plan, example_inputs=batches[0])
    calls = {"n": 0}
    original = ProcessGroupComm._all_reduce

    def counting(self, t, op, async_op):
        calls["n"] += 1
        if calls.get("die_at") == calls["n"]:
            os._exit(1)
        return original(self, t, op, async_op)

    ProcessGroupComm._all_reduce = counting
    step.step(*batches[0])
    per_step = calls["n"]  # step 1's all-reduces (the save below issues its own)
    step.save(path)
    if rank == 1:
        calls.update(n=0, die_at=per_step // 2 + 1)
    start = time.monotonic()
    try:
        step.step(*batches[1])
    except usc.CollectiveError as err:
        return f"{time.monotonic() - start:.1f}|{err}"
    return "no error"


def losses_twice(rank: int, world_size: int, model_name: str, plan: str, steps: int) -> list[list[float]]:
    """The same seed and plan trained twice in one world: the loss sequences of both runs."""
    torch.set_num_threads(1)
    return [[loss for loss in train_cases(rank, world_size, [(model_name, plan)], steps)[0][0]] for _ in range(2)]


def train_from_state(rank: int, world_size: int, family: str, cfg, state: bytes, plan: str,
                     batches: list) -> tuple[list[float], bytes | None]:
    """Train a model of `family` built from `cfg` and loaded with `state` (float64) on this rank."""
    from usc.testing.models import TinyDeepSeek, TinyGPT2, TinyLlama, TinyMixtral

    torch.set_num_threads(1)
    os.environ["TRITON_INTERPRET"] = "0"  # fused regions run their eager ops (see _check)
    families = {"llama": TinyLlama, "gpt2": TinyGPT2, "mixtral": TinyMixtral, "deepseek": TinyDeepSeek}
    model = families[family](cfg).double()
    model.load_state_dict(torch.load(io.BytesIO(state)))
    step = usc.compile(model, plan, example_inputs=batches[0])
    losses = [step.step(*b) for b in batches]
    buffer = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in step.full_state_dict().items()}, buffer)
    return losses, buffer.getvalue() if rank == 0 else None


# ----------------------------------------------------------------- losses and models as users write them
def written_case(case: str):
    """(model factory, batches) of a loss or model users write (tests/distributed/test_cross_entropy_options.py,
    test_losses_as_written.py, test_seq2seq_models.py), float64."""
    if case == "cross_entropy_weight_smoothing":
        from test_cross_entropy_options import TokenClassifier, batch
        return (lambda: TokenClassifier(dict(weight=True, label_smoothing=0.1)).double()), [batch()] * 2
    if case == "masked_mean_all_ignored_microbatch":
        from test_losses_as_written import IGNORED, Tagger, batch
        ids, labels = batch()
        labels[:3] = IGNORED
        return (lambda: Tagger("masked_mean").double()), [(ids, labels)] * 2
    if case in ("unmasked_plus_regularizer", "clamped"):
        from test_losses_as_written import Denominators, empty_start
        return (lambda: Denominators(case).double()), [empty_start()] * 2
    if case in ("z_loss_every_token", "two_masks"):
        from test_losses_counted_first import Tagger as Counted, batch as counted_batch
        return (lambda: Counted(case).double()), [counted_batch(s) for s in range(2)]
    if case == "bart":
        from test_seq2seq_models import bart, batch
        return (lambda: bart().double()), [batch(s) for s in range(2)]
    raise KeyError(case)


def train_written(rank: int, world_size: int, case: str, plan: str):
    """(losses, full state as bytes on rank 0) after SGD steps of ``case`` under ``plan``, from seed 0."""
    factory, batches = written_case(case)
    torch.manual_seed(0)
    step = usc.compile(factory(), plan, example_inputs=batches[0],
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    losses = [step.step(b) if isinstance(b, dict) else step.step(*b) for b in batches]
    buffer = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in step.full_state_dict().items()}, buffer)
    return losses, buffer.getvalue() if rank == 0 else None
