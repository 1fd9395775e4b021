"""Models larger than one device: built on the meta device, each rank makes real only its share, from the
model's own initialisers, an ``init=`` function or a checkpoint -- and trains equal to one device.

The one-device twin is built here without usc: the same Hugging Face / torch model built normally, each
module re-initialised by its own initialiser under ``torch.manual_seed`` of the documented per-module
seed (the first 8 bytes of sha256("seed:path"), little-endian, shifted right once), then trained
with plain torch and SGD.

Default suite: simulated meshes (cheap). ``USC_DEEP_TIER=1`` adds real gloo worlds: a meta-built model
on 4 and on 8 processes whose peak live tensor bytes per rank are measured (a TorchDispatchMode that
counts every storage an op allocates while it lives, independent of usc's own estimates).
"""

from __future__ import annotations

import gc
import hashlib
import os
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import usc

transformers = pytest.importorskip("transformers")

DEEP = os.environ.get("USC_DEEP_TIER") == "1"
deep = pytest.mark.skipif(not DEEP, reason="deep tier: set USC_DEEP_TIER=1")
SEED = 7
SHAPE = dict(vocab_size=62, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _seed_of(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little") >> 1


def _config(**sizes) -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(**{**SHAPE, **sizes}, use_cache=False)


def _meta_llama(**sizes) -> nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_config(**sizes))


def _one_device_llama(seed: int = SEED, **sizes) -> nn.Module:
    """Built normally, then every module re-initialised as Hugging Face does (``_init_weights``) under
    its per-module seed, in named_modules() order."""
    model = transformers.LlamaForCausalLM(_config(**sizes))
    with torch.no_grad():
        for path, module in model.named_modules():
            torch.manual_seed(_seed_of(seed, path))
            model._init_weights(module)
    return model


def _batches(vocab: int = 62, count: int = 2, rows: int = 4, seq: int = 9) -> list[dict]:
    out = []
    for s in range(count):
        ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(100 + s))
        out.append({"input_ids": ids, "labels": ids})
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _one_device_run(model: nn.Module, batches: list[dict], optimizer=None) -> list[float]:
    opt = (optimizer or _sgd)(model.parameters())
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _max_diff(full: dict, reference: dict) -> float:
    assert set(reference) <= set(full), sorted(set(reference) - set(full))
    return max((full[k] - v).abs().max().item() for k, v in reference.items())


# ---------------------------------------------------------------------------------------- simulated
@pytest.mark.parametrize("plan", [pytest.param("tp=2 pp=2 mb=2", marks=deep), "dp=2 zero=3 tp=2"])  # pp: ~12 s
def test_meta_model_starts_from_the_one_device_values_and_trains_equal(plan):
    """Every rank's slices equal the one-device initialisation; two SGD steps later too."""
    batches = _batches()
    reference = _one_device_llama()
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    expected = _one_device_run(reference, batches)
    sim = usc.simulate(_meta_llama(), plan, example_inputs=batches[0], optimizer=_sgd, init_seed=SEED)
    assert _max_diff(sim.full_state_dict(), initial) == 0.0  # the same ops on the same values: bitwise
    share = max(sum(t.numel() for t in sim.rank_state(r).values()) for r in range(4))
    assert share * 3 < sum(t.numel() for t in initial.values())  # a rank holds about a quarter
    losses = [sim.step(b) for b in batches]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert _max_diff(sim.full_state_dict(), reference.state_dict()) < 1e-5


def test_tied_weights_take_the_last_owners_init_and_dropout_compiles_on_meta():
    """GPT-2 ties lm_head to wte: both modules' initialisers run on the one tensor, in module order
    (the last one wins, as model.apply leaves it); its dropout, traced on meta, runs on the CPU."""
    config = transformers.GPT2Config(vocab_size=62, n_positions=16, n_embd=24, n_layer=2, n_head=4, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.1, embd_pdrop=0.1)
    reference = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for path, module in reference.named_modules():
            torch.manual_seed(_seed_of(3, path))
            reference._init_weights(module)
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(config)
    batch = _batches()[0]
    sim = usc.simulate(meta, "dp=2 tp=2", example_inputs=batch, init_seed=3, optimizer=_sgd)
    full = sim.full_state_dict()
    assert _max_diff(full, reference.state_dict()) == 0.0
    assert torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])
    with torch.no_grad():
        expected = reference.eval()(**batch).loss.item()
    assert sim.eval_step(batch) == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(torch.tensor(sim.step(batch)))


class Mlp(nn.Module):
    """torch built-in modules only: their reset_parameters() are the initialisers."""

    def __init__(self, width: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(14, width)
        self.up = nn.Linear(width, 3 * width)
        self.norm = nn.LayerNorm(3 * width)
        self.down = nn.Linear(3 * width, 14)

    def forward(self, ids, labels):
        logits = self.down(self.norm(torch.relu(self.up(self.embed(ids)))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _mlp_batch():
    ids = torch.randint(0, 14, (6, 5), generator=torch.Generator().manual_seed(3))
    return ids, ids.roll(1, 1)


def _reinit(model: nn.Module, init, seed: int) -> nn.Module:
    for path, module in model.named_modules():
        torch.manual_seed(_seed_of(seed, path))
        init(module)
    return model


def _own_reset(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _small_normal(module: nn.Module) -> None:
    """An init= function as model.apply takes it."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.3)
        if getattr(module, "bias", None) is not None:
            nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


@pytest.mark.parametrize("init", [None, _small_normal], ids=["reset_parameters", "init=fn"])
def test_torch_modules_initialise_per_module_under_their_seed(init):
    with torch.device("meta"):
        meta = Mlp()
    sim = usc.simulate(meta, "dp=3 tp=2", example_inputs=_mlp_batch(), optimizer=_sgd, init=init, init_seed=11)
    with torch.no_grad():
        reference = _reinit(Mlp(), init or _own_reset, 11)
    assert _max_diff(sim.full_state_dict(), reference.state_dict()) == 0.0
    loss = sim.step(*_mlp_batch())
    expected = reference(*_mlp_batch())
    assert loss == pytest.approx(expected.item(), rel=1e-6)


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(7, 5), nn.Linear(5, 7))
    model[1].weight = model[0].weight  # tied: the Linear's init runs last and wins
    return model


def test_materialize_gives_the_one_device_twin_with_ties_kept():
    with torch.device("meta"):
        meta = _tied()
    twin = usc.materialize(meta, seed=4)
    with torch.no_grad():
        reference = _reinit(_tied(), _own_reset, 4)
    assert twin[1].weight is twin[0].weight and twin[0].weight.device.type == "cpu"
    assert _max_diff(twin.state_dict(), reference.state_dict()) == 0.0


def test_a_different_seed_gives_different_values_and_the_user_model_stays_meta():
    with torch.device("meta"):
        meta = Mlp()
    a = usc.simulate(meta, "tp=2", example_inputs=_mlp_batch(), init_seed=1).full_state_dict()
    b = usc.simulate(meta, "tp=2", example_inputs=_mlp_batch(), init_seed=2).full_state_dict()
    assert not torch.equal(a["up.weight"], b["up.weight"])
    assert all(p.device.type == "meta" for p in meta.parameters())  # materialised copies, never the user's


def test_init_from_a_checkpoint_saved_under_another_plan(tmp_path):
    """init='path': nothing is initialised, every tensor (and the optimizer state) comes from the checkpoint."""
    batches = _batches(count=3)
    torch.manual_seed(0)
    trained = usc.simulate(_one_device_llama(), "dp=2 tp=2", example_inputs=batches[0],
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    trained.step(batches[0])
    trained.save(tmp_path / "ckpt")
    expected = [trained.step(b) for b in batches[1:]]
    resumed = usc.simulate(_meta_llama(), "pp=2 tp=2", example_inputs=batches[0],
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), init=tmp_path / "ckpt")
    assert [resumed.step(b) for b in batches[1:]] == pytest.approx(expected, rel=1e-5)
    assert _max_diff(resumed.full_state_dict(), trained.full_state_dict()) < 1e-5


def test_a_module_without_initialiser_is_refused_by_name():
    with torch.device("meta"):
        model = Scaled()
    batch = _scaled_batch()
    with pytest.raises(usc.InitError, match=r"module '<root>' \(Scaled\) holds meta tensors \(scale\)"):
        usc.simulate(model, "dp=2", example_inputs=batch)
    # an init= function that covers it works; one that leaves it unset is named
    usc.simulate(model, "dp=2", example_inputs=batch, init=lambda m: _fill(m, "scale"))
    with pytest.raises(usc.InitError, match="left 'scale' unset"):
        usc.simulate(model, "dp=2", example_inputs=batch, init=lambda m: _own_reset(m))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.scale = nn.Parameter(torch.ones(6))  # a bare parameter: no reset_parameters covers it

    def forward(self, x, y):
        return ((self.lin(x) * self.scale - y) ** 2).mean()


def _scaled_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 4, generator=g), torch.randn(6, 6, generator=g)


@pytest.mark.parametrize("how", ["load", "init"])
def test_compile_fills_a_meta_model_from_a_checkpoint_without_initialising_it(tmp_path, how):
    """A model no initialiser covers: only the checkpoint can fill it; step.load right after compile
    and init='path' both do, and training continues as the saved run does."""
    torch.manual_seed(0)
    saved = usc.simulate(Scaled(), "dp=2", example_inputs=_scaled_batch(), optimizer=_sgd)
    saved.step(*_scaled_batch())
    saved.save(tmp_path / "ckpt")
    expected = saved.step(*_scaled_batch())
    with torch.device("meta"):
        model = Scaled()
    init = tmp_path / "ckpt" if how == "init" else None
    step = usc.compile(model, "dp=1", example_inputs=_scaled_batch(), optimizer=_sgd, init=init)
    if how == "load":
        step.load(tmp_path / "ckpt")
    assert step.step(*_scaled_batch()) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(usc.InitError, match="'<root>' \\(Scaled\\) holds meta tensors \\(scale\\)"):
        usc.compile(model, "dp=1", example_inputs=_scaled_batch()).step(*_scaled_batch())


def _fill(module: nn.Module, name: str) -> None:
    _own_reset(module)
    if name in module._parameters:
        nn.init.constant_(module._parameters[name], 0.5)


def test_init_is_refused_for_a_model_with_real_weights():
    with pytest.raises(TypeError, match="holds no meta tensors"):
        usc.simulate(Mlp(), "dp=2", example_inputs=_mlp_batch(), init=_small_normal)


def test_the_compiled_object_does_not_keep_the_users_model_alive():
    """After compile the rank holds copies of its share; dropping the model frees it and its tensors."""
    model = Mlp()
    model_ref, weight_ref = weakref.ref(model), weakref.ref(model.up.weight)
    step = usc.compile(model, "dp=1", example_inputs=_mlp_batch(), optimizer=_sgd)
    del model
    gc.collect()
    assert model_ref() is None and weight_ref() is None
    assert isinstance(step.step(*_mlp_batch()), float) and "up.weight" in step.full_state_dict()
    with torch.device("meta"):
        meta = Mlp()
    meta_ref = weakref.ref(meta)
    step = usc.compile(meta, "dp=1", example_inputs=_mlp_batch(), init=_small_normal)
    del meta
    gc.collect()
    assert meta_ref() is None
    model = Mlp()
    model_ref = weakref.ref(model)
    sim = usc.simulate(model, "dp=2", example_inputs=_mlp_batch())
    del model
    gc.collect()
    assert model_ref() is None and isinstance(sim.step(*_mlp_batch()), float)


# ---------------------------------------------------------------------------------------- gloo (deep)
class LiveBytes(TorchDispatchMode):
    """Bytes of every storage an op allocates, counted while it lives (views allocate nothing); the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self._alive = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.untyped_storage()._cdata in inputs:
                continue
            key = t.untyped_storage()._cdata
            if key not in self._alive:
                self._alive[key] = t.untyped_storage().nbytes()
                self.live += self._alive[key]
                self.peak = max(self.peak, self.live)
                weakref.finalize(t.untyped_storage(), self._free, key)
        return out

    def _free(self, key) -> None:
        self.live -= self._alive.pop(key, 0)


BIG = dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
           num_key_value_heads=2)


def _momentum(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)  # optimizer state for the checkpoint to carry


def _train_meta_on_world(rank: int, world: int, plan: str, resume_plan: str, sizes: dict, steps: int,
                         path: str) -> dict:
    torch.manual_seed(1234 + rank)  # init must not depend on the rank's own RNG
    batches = _batches(sizes["vocab_size"], count=steps + 1, rows=4, seq=16)
    step = usc.compile(_meta_llama(**sizes), plan, example_inputs=batches[0], optimizer=_momentum, init_seed=SEED)
    with LiveBytes() as built:  # what every rank held before: the whole model, built on the CPU
        transformers.LlamaForCausalLM(_config(**sizes))
    with LiveBytes() as whole:
        with LiveBytes() as made:  # the rank materialises its share (the model's own initialisers)
            step.optimizer
        losses = [step.step(b) for b in batches[:steps]]
    with LiveBytes() as saving:
        step.save(path)
    held = sum(t.numel() * t.element_size() for t in step._rank().local_state().values())
    # another plan, the model again on meta, filled from the checkpoint (weights and momentum)
    resumed = usc.compile(_meta_llama(**sizes), resume_plan, example_inputs=batches[0], optimizer=_momentum, init=path)
    losses.append(resumed.step(batches[steps]))
    devices = {str(t.device) for s in resumed.optimizer.state.values() for t in s.values()}
    full = resumed.full_state_dict()
    return {"losses": losses, "built": built.peak, "made": made.peak, "whole": whole.peak,
            "save": saving.peak, "held": held, "optimizer_devices": devices,
            "full": {k: v.numpy() for k, v in full.items()} if rank == 0 else None}  # by value: ranks exit at once


@deep
@pytest.mark.parametrize("plan, resume_plan, world, ratio", [("dp=2 zero=3 tp=2", "tp=2 pp=2 mb=2", 4, 4),
                                                             ("tp=2 pp=2 mb=2", "dp=2 zero=3 tp=2", 4, 4),
                                                             ("dp=4 zero=3 tp=2", "dp=2 tp=2 pp=2", 8, 8)])
def test_meta_model_larger_than_a_rank_trains_on_gloo_equal_to_one_device(tmp_path, plan, resume_plan, world, ratio):
    """Two steps from the model's own initialisers, a save, and a third step under another plan on a
    meta model filled from that checkpoint: every loss and the final weights equal one device."""
    from harness import run_world

    steps = 2
    reference = _one_device_llama(**BIG)
    model_bytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    largest = max(sum(t.numel() * t.element_size() for t in m.parameters(recurse=False)) for m in reference.modules())
    expected = _one_device_run(reference, _batches(BIG["vocab_size"], count=steps + 1, rows=4, seq=16), _momentum)
    results = run_world(_train_meta_on_world, world, plan, resume_plan, BIG, steps, str(tmp_path / "ckpt"),
                        timeout=600)
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
        assert r["optimizer_devices"] == {"cpu"}  # the program's device (gloo: the CPU)
    assert _max_diff({k: torch.from_numpy(v) for k, v in results[0]["full"].items()}, reference.state_dict()) < 1e-5
    held = max(r["held"] for r in results)
    mib = lambda n: f"{n / 2**20:.3f} MiB"  # noqa: E731
    print(f"\n{plan} on {world} gloo processes (resumed under {resume_plan}): model state {mib(model_bytes)} = "
          f"{model_bytes / held:.1f}x the "
          f"largest rank's share ({mib(held)}); largest module {mib(largest)}")
    for rank, r in enumerate(results):
        print(f"  rank {rank}: peak live tensor bytes: building the model on the CPU {mib(r['built'])}; usc "
              f"materialising its share {mib(r['made'])} ({r['made'] / model_bytes:.2f}x the model), then with "
              f"{steps} SGD steps (momentum 0.9) {mib(r['whole'])} ({r['whole'] / model_bytes:.2f}x); "
              f"saving {mib(r['save'])}")
    assert model_bytes / held > ratio * 0.9  # the model is about `ratio` times one rank's share
    assert max(r["made"] for r in results) <= held + 2 * largest  # its share and one module at a time
    assert max(r["whole"] for r in results) < model_bytes  # no rank ever held the whole model
    assert min(r["built"] for r in results) >= model_bytes  # (which building it on the CPU does)
    assert max(r["save"] for r in results) < held  # saving gathers nothing
