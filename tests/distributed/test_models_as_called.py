"""Models as people call them, compiled with no wrapper class: Hugging Face models fed a collator's
dict batch (``model(**batch)``, the loss in ``output.loss``), nanoGPT's ``(logits, loss)``, autocast /
no_grad / gradient-checkpointing regions inside forward. Each plan equals one device (SGD steps, so a
uniformly scaled gradient would show); odd sizes (hidden 24, vocab 98, 3 heads in nanoGPT)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import usc
from nanogpt import GPT, GPTConfig
from usc.model_call import BatchError
from usc.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

VOCAB = 98
COMMON = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, pad_token_id=0)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
}


def collated(seed: int, rows: int = 4, seq: int = 6) -> dict:
    """What a causal-LM collator hands the training loop (no padding)."""
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2", "dp=2 zero=3"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hf_families_with_dict_batches_equal_one_device(name, plan):
    result = assert_equivalent(FAMILIES[name], plan, [collated(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6


def test_hf_cache_is_off_while_training_and_the_config_is_untouched():
    model = FAMILIES["llama"]()
    assert model.config.use_cache is True
    sim = usc.simulate(model, "dp=2", example_inputs=collated(0))
    sim.step(collated(1))
    assert model.config.use_cache is True
    no_cache = FAMILIES["llama"]()
    no_cache.config.use_cache = False
    expected = usc.simulate(no_cache, "dp=2", example_inputs=collated(0))
    assert len(sim._traced.gm.graph.nodes) == len(expected._traced.gm.graph.nodes)  # no cache is built


def test_all_ones_attention_mask_costs_nothing():
    batch = collated(0)
    with_mask = usc.simulate(FAMILIES["llama"](), "dp=2", example_inputs=batch)
    without = usc.simulate(FAMILIES["llama"](), "dp=2", example_inputs={k: v for k, v in batch.items()
                                                                          if k != "attention_mask"})
    assert len(with_mask._traced.gm.graph.nodes) == len(without._traced.gm.graph.nodes)
    assert with_mask._traced.user_inputs == without._traced.user_inputs


def test_a_padding_mask_after_an_all_ones_one_is_refused_by_name():
    sim = usc.simulate(FAMILIES["llama"](), "dp=2", example_inputs=collated(0))
    padded = collated(1)
    padded["attention_mask"][0, -2:] = 0
    with pytest.raises(BatchError, match="attention_mask"):
        sim.step(padded)


@pytest.mark.parametrize("plan", ["dp=2", "mb=2", "dp=2 mb=2", "pp=2 mb=2"])
def test_a_token_count_in_the_batch_is_every_microbatchs(plan):
    """transformers' training loop passes ``num_items_in_batch`` (a 0-d count of the step's labelled
    tokens): the model then sums its token losses and divides by it. A 0-d input has no samples to
    split: every microbatch and rank gets it whole (microbatching crashed: 'chunk expects at least a
    1-dimensional tensor')."""
    def with_count(seed):
        batch = collated(seed)
        batch["labels"][0, :3] = -100
        batch["num_items_in_batch"] = (batch["labels"][:, 1:] != -100).sum()
        return batch

    result = assert_equivalent(FAMILIES["llama"], plan, [with_count(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6


def clip():
    text = transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=16, projection_dim=16)
    vision = transformers.CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=12, patch_size=4, projection_dim=16)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                          projection_dim=16))


def image_text(seed: int, return_loss=True) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (6, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "return_loss": return_loss,
            "pixel_values": torch.randn(6, 3, 12, 12, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("plan", ["dp=2", "dp=3", "tp=2", "pp=2"])
def test_a_python_value_in_the_batch_dict_is_compiled_in(plan):
    """CLIP's contrastive loss with ``return_loss=True`` in the batch dict (a bool among the tensors):
    compile crashed building the program ("'bool' object has no attribute 'shape'"). The loss couples
    the batch (every image against every text): dp gathers the embeddings, microbatches refuse it."""
    result = assert_equivalent(lambda: clip().double(), plan, [image_text(s) for s in range(2)], optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_a_python_value_that_changes_between_steps_is_refused():
    """The trace computes with the value it saw: a later batch holding another would train with the
    first one. Refused, naming the input; a count that changes belongs in a tensor."""
    sim = usc.simulate(clip().double(), "dp=2", example_inputs=image_text(0))
    with pytest.raises(usc.BadInput, match="input 'return_loss' is False but the program was compiled with True"):
        sim.step(image_text(1, return_loss=False))

    def with_count(seed, count):
        return {**collated(seed), "num_items_in_batch": count}

    sim = usc.simulate(FAMILIES["llama"](), "dp=2", example_inputs=with_count(0, 20))
    sim.step(with_count(0, 20))
    with pytest.raises(usc.BadInput, match="input 'num_items_in_batch' is 17 .* or a tensor"):
        sim.step(with_count(1, 17))
    with pytest.raises(usc.BadInput, match="input 'num_items_in_batch' is tensor.20. but the program was compiled "
                                           "with 20"):
        sim.step(with_count(1, torch.tensor(20)))
    with pytest.raises(usc.BadInput, match="input 'labels' is None but the program was compiled for a "
                                           "torch.int64 tensor of shape .4, 6.; pass a tensor"):
        sim.step({**with_count(1, 20), "labels": None})


def test_a_batch_forward_cannot_take_is_a_batch_error_with_the_signature():
    """Not a trace error telling the user to rewrite their forward: the batch is what is wrong."""
    ids = collated(0)["input_ids"]
    with pytest.raises(BatchError, match=r"GPT\.forward\(idx, targets=None\) cannot take the batch "
                                         r"\(3 positional values\): too many positional arguments"):
        usc.simulate(GPT(GPTConfig()), "dp=2", example_inputs=(ids, ids, ids))
    with pytest.raises(BatchError, match=r"cannot take the batch \(keys 'tokens'\): missing a required "
                                         r"argument: 'idx'"):
        usc.lint(GPT(GPTConfig()), "dp=2", example_inputs={"tokens": ids})
    with pytest.raises(BatchError, match="cannot take the batch less its target"):
        usc.lint(GPT(GPTConfig()), "dp=2", example_inputs=(ids,), loss_fn=lambda logits, target: logits.sum())
    # a collator's dict inside a tuple, for a forward that takes other names: the model fails on
    # it, and the error says which argument got the dict and how to pass its keys instead
    with pytest.raises(usc.CompileError, match=r"note: the batch passes a dict as forward's 'idx'; if forward takes "
                                               r"the dict's keys as arguments of their own, pass the dict itself"):
        usc.lint(GPT(GPTConfig()), "mb=2", example_inputs=(collated(0),))
    # nothing in the batch has a dim for microbatches to split: the batch is named, not the plan's mb
    with pytest.raises(BatchError, match=r"mb=2 splits dim 0 of the batch's tensors, but the batch holds none "
                                         r"with a batch dim \(it holds Tensor, int\)"):
        usc.lint(GPT(GPTConfig()), "mb=2", example_inputs=(torch.tensor(3), 4))


def padded(seed: int) -> dict:
    """A collator's padded batch: left padding on one row, right padding on another."""
    batch = collated(seed)
    batch["attention_mask"][1, :2] = 0  # left padding: the later tokens must not see these
    batch["attention_mask"][3, -3:] = 0
    batch["labels"][batch["attention_mask"] == 0] = -100
    return batch


@pytest.mark.parametrize("plan", ["tp=2", "dp=2", "pp=2 mb=2", "dp=2 tp=2 pp=2 mb=2", "cp=2"])
def test_padding_masks_are_passed_to_the_model(plan):
    """Hugging Face indexes the mask with an arange over the whole batch (padding_mask[batch_idx,
    kv_idx]): read as picking each row of its own batch, it stays batch-local, so dp gathers nothing
    and microbatches (mb, pp) run it."""
    result = assert_equivalent(FAMILIES["llama"], plan, [padded(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6
    torch.manual_seed(0)
    unpadded = FAMILIES["llama"]()(**{k: v for k, v in padded(0).items() if k != "attention_mask"}).loss.item()
    assert abs(result.losses[0] - unpadded) > 1e-3  # the mask was honoured


def test_nanogpt_as_it_is():
    def batch(seed):
        idx = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(seed))
        return idx, torch.roll(idx, -1, 1)
    for plan in ("dp=2", "tp=2", "pp=2 mb=2", "dp=2 zero=3"):
        result = assert_equivalent(GPT, plan, [batch(s) for s in range(2)], optimizer=sgd)
        assert result.max_param_diff <= 1e-6, plan


def test_a_single_tensor_batch():
    class AutoEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Linear(10, 3), nn.Linear(3, 10)

        def forward(self, x):
            return ((self.dec(torch.tanh(self.enc(x))) - x) ** 2).mean()

    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = AutoEncoder()
    expected = model(x).item()
    sim = usc.simulate(model, "dp=2", example_inputs=x)
    assert abs(sim.step(x) - expected) <= 1e-6


def test_a_model_without_a_loss_gets_an_error_listing_what_it_returned():
    model = FAMILIES["llama"]()
    batch = collated(0)
    del batch["labels"]
    with pytest.raises(usc.CompileError) as err:
        usc.simulate(model, "dp=2", example_inputs=batch)
    text = str(err.value)
    assert "LlamaForCausalLM.forward returned CausalLMOutputWithPast(logits=Tensor[4, 6, 98] float32)" in text
    assert "labels" in text and "loss_fn" in text


def test_a_tuple_with_two_scalars_is_ambiguous():
    class TwoScalars(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y.sum(), y.mean()

    with pytest.raises(usc.CompileError, match=r"returned tuple\(Tensor\[\] float32, Tensor\[\] float32\)"):
        usc.simulate(TwoScalars(), "dp=2", example_inputs=torch.randn(4, 4))


def test_loss_fn_with_a_dict_batch_takes_the_labels():
    model = FAMILIES["llama"]()
    batch = collated(0)

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

    expected = model(**batch).loss.item()
    sim = usc.simulate(model, "dp=2", example_inputs=batch, loss_fn=loss_fn)
    assert abs(sim(batch) - expected) <= 1e-6


def test_eval_mode_is_respected():
    """nanoGPT with dropout 0.5: in eval() no dropout runs, on one device and on the mesh."""
    def make():
        from nanogpt import GPTConfig
        return GPT(GPTConfig(dropout=0.5)).eval()

    idx = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    result = assert_equivalent(make, "dp=2", [(idx, idx)] * 2, optimizer=sgd)
    assert result.max_param_diff <= 1e-6


# ------------------------------------------------------------------ regions inside forward
class RegionNet(nn.Module):
    """An autocast (bf16) island with a disabled island inside it, a no_grad statistic subtracted
    from the activations (its gradient must not flow), and a checkpointed block."""

    def __init__(self, autocast: bool = True) -> None:
        super().__init__()
        self.autocast = autocast
        self.emb, self.a, self.b = nn.Embedding(30, 12), nn.Linear(12, 20), nn.Linear(20, 12)
        self.head = nn.Linear(12, 30)

    def forward(self, x, y):
        h = self.emb(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            g = self.a(h)
            with torch.autocast("cpu", enabled=False):
                g = g.float() * 2
        with torch.no_grad():
            c = g.mean(-1, keepdim=True)
        h = h + torch.utils.checkpoint.checkpoint(lambda t: F.gelu(self.b(t - c)), g, use_reentrant=False)
        return F.cross_entropy(self.head(h).reshape(-1, 30), y.reshape(-1))


def region_batch(seed: int):
    x = torch.randint(0, 30, (6, 5), generator=torch.Generator().manual_seed(seed))
    return x, x


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_no_grad_and_checkpoint_regions_equal_one_device(plan):
    result = assert_equivalent(lambda: RegionNet(autocast=False), plan, [region_batch(s) for s in range(2)],
                               optimizer=sgd)
    assert result.max_param_diff <= 1e-6


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_autocast_regions_equal_one_device(plan):
    """The bf16 matmul's weight gradient is rounded to bf16 per rank (or microbatch) before the float32
    sum, so parameters agree to bf16 rounding of one SGD step (lr 0.1 x |grad| x 2^-8), not float32's.
    The autocast is honoured: the loss differs from the same model in float32 by far more."""
    batches = [region_batch(s) for s in range(2)]
    result = assert_equivalent(RegionNet, plan, batches, optimizer=sgd, rtol=1e-4, param_atol=1e-4)
    first = result.reference_losses[0]
    assert abs(result.losses[0] - first) <= 1e-6 * first  # the forward is row by row: float32 agreement
    torch.manual_seed(0)
    float32 = RegionNet(autocast=False)(*batches[0]).item()
    assert abs(first - float32) > 10 * 1e-6 * first


def test_autocast_region_becomes_explicit_casts():
    sim = usc.simulate(RegionNet(), "dp=2", example_inputs=region_batch(0))
    targets = [n.target for n in sim._traced.gm.graph.nodes if n.op == "call_function"]
    assert not any("wrap_with" in str(t) for t in targets)
    casts = [n for n in sim._traced.gm.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    assert {n.kwargs.get("dtype") for n in casts} >= {torch.bfloat16, torch.float32}


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_hf_gradient_checkpointing_equals_one_device(plan):
    def make():
        model = FAMILIES["llama"]()
        model.activation_checkpointing_enable()  # transformers 5 name of gradient_checkpointing_enable
        return model.train()

    result = assert_equivalent(make, plan, [collated(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6


def test_torchtitan_style_llama_with_loss_fn():
    """torchtitan's Llama returns logits and its trainer applies loss_fn: compiled as it is, with
    ``loss_fn=``. The one-device reference applies the same loss_fn around the same model."""
    from users_models import TitanTrain, loss_fn

    def run(model, plan, batches, optimizer):
        sim = usc.simulate(model.model, plan, example_inputs=batches[0], loss_fn=loss_fn, optimizer=optimizer)
        return [sim.step(b) for b in batches], {f"model.{k}": v for k, v in sim.full_state_dict().items()}

    def batch(seed):
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(seed))
        return ids, torch.roll(ids, -1, 1)

    for plan in ("dp=2", "tp=2"):
        result = assert_equivalent(TitanTrain, plan, [batch(s) for s in range(2)], optimizer=sgd, runner=run)
        assert result.max_param_diff <= 1e-6, plan


def test_hf_gradient_checkpointing_becomes_recompute_of_those_layers():
    model = FAMILIES["llama"]()
    model.activation_checkpointing_enable()  # transformers 5 name of gradient_checkpointing_enable
    model.train()
    sim = usc.simulate(model, "dp=2", example_inputs=collated(0))
    assert [str(r) for r in sim.plan.rules] == ["model.layers.0: recompute", "model.layers.1: recompute"]
    plain = usc.simulate(FAMILIES["llama"](), "dp=2", example_inputs=collated(0))
    assert sim.activation_bytes(collated(0))[0] < plain.activation_bytes(collated(0))[0]
    model.eval()  # Hugging Face checkpoints only while training
    assert not usc.simulate(model, "dp=2", example_inputs=collated(0)).plan.rules


class NoGradWithWrites(nn.Module):
    """A no_grad statistic and an in-place write in one forward (the write makes the tracer
    functionalize the program, which must keep the no_grad region's meaning)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(7, 9), nn.Linear(9, 7)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            scale = h.abs().mean(-1, keepdim=True) + 1.0
        h = h / scale
        h.add_(0.5)  # in place
        return (self.b(torch.tanh(h)) ** 2).mean()


@pytest.mark.parametrize("plan", ["dp=2", "tp=2"])
def test_no_grad_region_with_in_place_writes_equals_one_device(plan):
    batches = [(torch.randn(6, 7, generator=torch.Generator().manual_seed(s)),) for s in range(2)]
    result = assert_equivalent(NoGradWithWrites, plan, batches, optimizer=sgd)
    assert result.max_param_diff <= 1e-6


def test_only_the_loss_leaves_the_graph():
    """Logits and Mixtral's router logits are read by the loss but are no graph outputs: nothing
    keeps them alive after backward or sends them anywhere."""
    cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=True)
    sim = usc.simulate(transformers.MixtralForCausalLM(cfg), "dp=2 ep=2", example_inputs=collated(0))
    (output,) = [n for n in sim._traced.gm.graph.nodes if n.op == "output"]
    values = [v for v in output.args[0] if v is not None]
    assert len(values) == 1 and values[0].meta["val"].dim() == 0


def test_local_slice_of_a_dict_batch():
    batch = collated(0)
    step = usc.compile(FAMILIES["llama"](), "dp=2", example_inputs=batch)  # compiles in one process
    second = usc.data.local_slice(step, batch, coord=(1,))
    assert sorted(second) == sorted(batch)
    assert all(torch.equal(second[k], batch[k][2:]) for k in batch)


class LitLlama(nn.Module):
    """A training module in Lightning's style: forward takes the whole batch dict as one argument
    and wraps a Hugging Face model."""

    def __init__(self):
        super().__init__()
        self.lm = FAMILIES["llama"]()

    def forward(self, batch):
        return self.lm(input_ids=batch["tokens"], labels=batch["labels"]).loss


def dict_argument(seed: int, rows: int = 6, seq: int = 7) -> tuple:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return ({"tokens": ids, "labels": ids.clone()},)


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2", "dp=2 zero=3"])
def test_a_forward_taking_the_batch_dict_as_one_argument_equals_one_device(plan):
    """A tuple batch whose element is a dict: the program's inputs are its tensors (dp slices,
    mb chunks each), the model is called with the dict rebuilt."""
    result = assert_equivalent(LitLlama, plan, [dict_argument(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6


def test_a_forward_taking_the_batch_dict_steps_on_the_dict_itself_and_names_its_inputs():
    torch.manual_seed(0)
    model = LitLlama()
    (batch,) = dict_argument(0)
    expected = model(batch).item()
    sim = usc.simulate(model, "dp=2", example_inputs=(batch,))
    assert abs(sim(batch) - expected) <= 1e-6  # step(batch) for the one dict forward takes
    assert abs(sim((batch,)) - expected) <= 1e-6
    with pytest.raises(usc.BadInput, match=r"input batch\[0\]\['labels'\] has shape \[6, 6\] but the global "
                                           r"batch was compiled as \[6, 7\]"):
        sim.step(({"tokens": batch["tokens"], "labels": batch["labels"][:, :6]},))
    with pytest.raises(BatchError, match=r"compiled for a batch holding \[0\]\['tokens'\], \[0\]\['labels'\] but "
                                         r"this batch holds \[0\]\['tokens'\]: pass batches of one structure"):
        sim.step(({"tokens": batch["tokens"]},))


def test_loss_fn_with_a_dict_argument_takes_the_last_element():
    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = FAMILIES["llama"]()

        def forward(self, inputs):
            return self.lm(input_ids=inputs["tokens"]).logits

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, VOCAB), target["next"].reshape(-1))

    ids = torch.randint(0, VOCAB, (6, 7), generator=torch.Generator().manual_seed(1))
    batch = ({"tokens": ids}, {"next": torch.roll(ids, -1, 1)})
    torch.manual_seed(0)
    model = Logits()
    expected = loss_fn(model(batch[0]), batch[1]).item()
    for plan in ("dp=2", "tp=2"):
        sim = usc.simulate(model, plan, example_inputs=batch, loss_fn=loss_fn)
        assert abs(sim(batch) - expected) <= 1e-6, plan


def test_a_collators_dict_inside_a_tuple_is_a_batch_error_naming_the_fix():
    """model(batch_dict) where forward takes the dict's keys as its own arguments: the batch is
    wrong, not the model (before, the trace failed inside the embedding)."""
    with pytest.raises(BatchError, match=r"LlamaForCausalLM\.forward\(.*\) takes 'input_ids', 'attention_mask', "
                                         r"'labels' as arguments of their own, but the batch passes a dict of them "
                                         r"as forward's 'input_ids': pass the dict itself \(example_inputs=batch"):
        usc.lint(FAMILIES["llama"](), "dp=2", example_inputs=(collated(0),))
    with pytest.raises(BatchError, match="takes 'input_ids', 'attention_mask', 'labels' as arguments of their own"):
        usc.plan(FAMILIES["llama"](), "gpus=2", example_inputs=(collated(0),))
    # and the other way round: the dict as keywords for a forward that takes it as one argument
    with pytest.raises(BatchError, match=r"LitLlama\.forward\(batch\) cannot take the batch \(keys 'tokens', "
                                         r"'labels'\).*gets it inside a tuple \(example_inputs=\(batch,\)\)"):
        usc.lint(LitLlama(), "dp=2", example_inputs=dict_argument(0)[0])


def test_local_slice_and_the_planner_read_a_dict_argument():
    ids = torch.randint(0, VOCAB, (8, 7), generator=torch.Generator().manual_seed(2))
    inputs, target = {"tokens": ids}, {"next": torch.roll(ids, -1, 1)}
    step = usc.compile(LitLlama(), "dp=2", example_inputs=dict_argument(0, rows=8))  # compiles in one process
    first, second = usc.data.local_slice(step, inputs, target, coord=(1,))
    assert torch.equal(first["tokens"], ids[4:]) and torch.equal(second["next"], target["next"][4:])
    chosen = usc.plan(LitLlama(), "gpus=2 dtype=fp32", example_inputs=dict_argument(0))
    assert chosen.world_size == 2 and chosen.search.best.estimate.memory["activations"] > 0
    with pytest.raises(usc.CompileError, match=r"the planner needs an example input shaped \[batch, sequence, \.\.\.\] "
                                               r"\(token ids\), but the example holds Tensor\[6\]"):
        usc.plan(nn.Linear(6, 1), "gpus=2", example_inputs=(torch.randn(6),), loss_fn=lambda out, t: out.sum())
