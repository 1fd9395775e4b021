"""Property-based equivalence: random small Llama/GPT-2 shapes x the foundation plans, simulated.

Run in float64 with tight tolerances: with random shapes, float32 rounding noise amplified by
AdamW (on parameters whose gradients nearly cancel) can reach the float32 bound by chance, and a
float64 run separates "the algorithm is exact" from "the rounding is the same". The fixed-model
tests check the float32 bounds. Examples are bounded (CI profile); `--hypothesis-profile=deep`
runs more.
"""

from hypothesis import given
from hypothesis import strategies as st

from usc.testing import assert_equivalent
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, shifted_batch, token_batch

FLOAT64 = {"rtol": 1e-10, "atol": 1e-12, "param_atol": 1e-9}
PLANS = st.sampled_from(["dp=2", "tp=2", "dp=2 tp=2", "tp=4"])


@st.composite
def llama_shapes(draw):
    head_dim = draw(st.sampled_from([4, 8]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    return LlamaConfig(vocab=draw(st.sampled_from([32, 64, 96])), hidden=heads * head_dim, heads=heads,
                       kv_heads=kv_heads, mlp=draw(st.sampled_from([16, 32, 48])),
                       layers=draw(st.integers(1, 2)), max_seq=16)


@st.composite
def gpt2_shapes(draw):
    heads = draw(st.sampled_from([2, 4]))
    return GPT2Config(vocab=draw(st.sampled_from([32, 64])), hidden=heads * draw(st.sampled_from([4, 8])),
                      heads=heads, layers=draw(st.integers(1, 2)), max_seq=16)


@given(cfg=llama_shapes(), plan=PLANS, seq=st.sampled_from([4, 8]))
def test_random_llama_shapes(cfg, plan, seq):
    batch = token_batch(cfg.vocab, 4, seq)
    assert_equivalent(lambda: TinyLlama(cfg).double(), plan, [batch], steps=2, **FLOAT64)


@given(cfg=gpt2_shapes(), plan=PLANS, seq=st.sampled_from([4, 8]))
def test_random_gpt2_shapes(cfg, plan, seq):
    batch = shifted_batch(cfg.vocab, 4, seq)
    assert_equivalent(lambda: TinyGPT2(cfg).double(), plan, [batch], steps=2, **FLOAT64)
