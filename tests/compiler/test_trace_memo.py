"""The trace memo the test suite turns on (compiler/trace_memo.py): a reused trace is the trace a fresh
one would be, and anything that could change a trace (an attribute, a value, an input, global state)
traces again; a model the key cannot describe is traced every time."""

import warnings

import pytest
import torch
from torch import nn

import usc.compiler.trace as trace_module
from usc.compiler import trace_memo
from usc.compiler.trace import trace
from usc.testing.models import LlamaConfig, TinyLlama, token_batch


class Scaled(nn.Module):
    """A loss whose graph depends on a plain attribute (``scale``) and a flag (``squared``)."""

    def __init__(self, scale=2.0, squared=False, hook=None):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.scale, self.squared = scale, squared
        self.register_buffer("shift", torch.arange(3.0))
        if hook is not None:
            self.hook = hook

    def forward(self, x):
        y = self.lin(x) * self.scale + self.shift
        if self.squared:
            y = y * y
        return y.sum()


@pytest.fixture
def memo(monkeypatch):
    """The memo, fresh, and a count of the traces that really ran."""
    trace_memo.memoize_traces(True)
    real = trace_module._trace
    ran = []

    def counted(*args, **kwargs):
        ran.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_module, "_trace", counted)
    yield ran
    trace_memo.memoize_traces(True)  # the suite's own setting (conftest), emptied


def _code(traced) -> str:
    return traced.gm.code


def _x(seed=0):
    return (torch.randn(7, 5, generator=torch.Generator().manual_seed(seed)),)


def test_a_reused_trace_is_the_trace_a_fresh_one_would_be(memo):
    config = LlamaConfig(vocab=61, hidden=24, heads=3, kv_heads=1, mlp=40, layers=2, max_seq=16)
    batch = token_batch(61, 3, 7)
    torch.manual_seed(0)
    first = trace(TinyLlama(config), batch)
    torch.manual_seed(0)
    again = trace(TinyLlama(config), batch)
    assert len(memo) == 1  # the second came from the memo
    trace_memo.memoize_traces(False)
    torch.manual_seed(0)
    fresh = trace(TinyLlama(config), batch)
    assert _code(again) == _code(fresh) == _code(first)
    assert again.state == fresh.state and again.user_inputs == fresh.user_inputs
    assert again.module_types == fresh.module_types


@pytest.mark.parametrize("change", ["attribute", "flag", "buffer", "parameter", "input", "dtype", "grad mode"])
def test_anything_that_could_change_the_trace_traces_again(memo, change):
    torch.manual_seed(0)
    first = trace(Scaled(), _x())
    torch.manual_seed(0)
    model, inputs = Scaled(), _x()
    if change == "attribute":
        model.scale = 3.0
    elif change == "flag":
        model.squared = True
    elif change == "buffer":
        model.shift.add_(1.0)
    elif change == "parameter":
        with torch.no_grad():
            model.lin.weight[0, 0] += 1.0
    elif change == "input":
        inputs = _x(seed=1)
    if change == "dtype":
        model, inputs = model.double(), (inputs[0].double(),)
    if change == "grad mode":
        with torch.no_grad():
            second = trace(model, inputs)
    else:
        second = trace(model, inputs)
    assert len(memo) == 2
    if change == "flag":
        assert _code(second) != _code(first)
    if change == "attribute":
        assert "3.0" in _code(second) and "3.0" not in _code(first)


def test_a_model_the_key_cannot_describe_is_traced_every_time(memo):
    def make_hook(offset):
        return lambda x: x + offset  # a closure: what it computes is not in the key

    for _ in range(2):
        torch.manual_seed(0)
        trace(Scaled(hook=make_hook(1)), _x())
    torch.manual_seed(0)
    hooked = Scaled()
    hooked.lin.register_forward_hook(lambda module, args, out: out * 2)
    trace(hooked, _x())
    trace(hooked, _x())
    assert len(memo) == 4


def test_a_model_a_program_took_over_is_still_keyed(memo):
    """usc's own guard on a compiled model (usc/handover.py) stands aside in traces: it does not make
    the model unkeyable, where any other hook does."""
    from usc.handover import watch

    class Program:
        state_version = 0

    program = Program()
    torch.manual_seed(0)
    model = Scaled()
    watch(model, program)
    trace(model, _x())
    trace(model, _x())
    assert len(memo) == 1
    model.register_forward_pre_hook(lambda module, args: None)
    trace(model, _x())
    assert len(memo) == 2


def test_prints_and_warnings_of_the_model_are_replayed_on_reuse(memo, capfd):
    class Talks(Scaled):
        def forward(self, x):
            print("tracing Talks")
            warnings.warn("Talks warns", UserWarning)
            return super().forward(x)

    for _ in range(2):
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match="Talks warns"):
            trace(Talks(), _x())
        assert "tracing Talks" in capfd.readouterr().err
    assert len(memo) == 1


def test_per_compile_fields_do_not_leak_between_reuses(memo):
    torch.manual_seed(0)
    first = trace(Scaled(), _x())
    first.batch_probe = "probe of the first compile"
    torch.manual_seed(0)
    second = trace(Scaled(), _x())
    assert len(memo) == 1 and second.batch_probe is None
    node = next(n for n in first.gm.graph.nodes if n.target is torch.ops.aten.sum.default)
    node.target = torch.ops.aten.mean.default  # a caller editing its own graph
    torch.manual_seed(0)
    third = trace(Scaled(), _x())
    code = third.gm.graph.python_code("self").src
    assert len(memo) == 1 and "aten.sum" in code and "aten.mean" not in code


def test_the_memo_is_off_unless_turned_on(memo):
    trace_memo.memoize_traces(False)
    for _ in range(2):
        torch.manual_seed(0)
        trace(Scaled(), _x())
    assert len(memo) == 2 and not trace_memo.enabled()


def test_a_hugging_face_model_is_keyed_and_reused(memo):
    """transformers' models carry their PretrainedConfig and GenerationConfig: the key reads both."""
    transformers = pytest.importorskip("transformers")
    from usc.model_call import trainable

    config = transformers.LlamaConfig(vocab_size=67, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=16)
    tokens = torch.randint(0, 67, (2, 7), generator=torch.Generator().manual_seed(0))

    def model():
        torch.manual_seed(0)
        wrapped = trainable(transformers.LlamaForCausalLM(config))
        return wrapped, wrapped.flatten({"input_ids": tokens, "labels": tokens})

    first = trace(*model())
    again = trace(*model())
    assert len(memo) == 1
    trace_memo.memoize_traces(False)
    assert _code(again) == _code(trace(*model())) == _code(first)
