"""Attention masks under context parallelism: causal masks proven (never guessed), explicit masks
sliced by the query/key blocks of ring, zig-zag and Ulysses, packed documents across cp shards.

Every model case takes SGD steps on the simulator against the same model on one device
(``assert_equivalent``: float32 first, float64 as the second opinion where float32 misses).
``USC_DEEP_TIER=1`` adds the heavier Hugging Face cases.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import usc
from usc.compiler.ir import MeshSpec
from usc.passes.attention_masks import SDPA, attention_masks_pass, equals_causal, sdpa_args, sdpa_mask
from usc.runtime.layout import zigzag_index
from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.runtime.ring_attention import Call, RingAttention, _mask_calls, masked_schedule, ring_attention
from usc.testing import assert_equivalent

DEEP = os.environ.get("USC_DEEP_TIER") == "1"
deep = pytest.mark.skipif(not DEEP, reason="heavier Hugging Face cases: set USC_DEEP_TIER=1")
SEQ, BATCH, VOCAB = 12, 3, 37  # 12: cp=2 zig-zag needs 4 | S, cp=3 ring 3 | S
CP_PLANS = ("cp=2", "cp=2 cp_mode=zigzag", "cp=2 cp_mode=ulysses")


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def ring_nodes(program) -> list[RingAttention]:
    gm = program.gm
    return [gm.get_submodule(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), RingAttention)]


def train_like_one_device(factory, plan: str, batches, programs: list | None = None):
    """SGD steps on the simulator equal to one device; the mesh program is kept in ``programs``."""
    def runner(model, plan, batches, optimizer):
        sim = usc.simulate(model, plan, example_inputs=batches[0], optimizer=optimizer)
        if programs is not None:
            programs.append(sim.program)
        return [sim.step(*b) for b in batches], sim.full_state_dict()
    return assert_equivalent(factory, plan, batches, optimizer=_sgd, runner=runner)


# ============================================================ the proof: constant masks, evaluated

def _positions(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(s)
    return i[:, None], i[None, :]


MASKS = {  # name: (builder of a [.., S, S] mask from S, causal?)
    "bool tril [1,1,S,S]": (lambda s: (_positions(s)[1] <= _positions(s)[0])[None, None], True),
    "bool tril [S,S]": (lambda s: torch.ones(s, s, dtype=torch.bool).tril(), True),
    "additive -inf": (lambda s: torch.full((s, s), float("-inf")).triu(1)[None, None], True),
    "additive finfo.min (eager)": (lambda s: torch.full((s, s), torch.finfo(torch.float32).min).triu(1)
                                   .expand(BATCH, 1, s, s), True),
    "tril & all-ones padding": (lambda s: torch.ones(s, s, dtype=torch.bool).tril()[None, None]
                                & torch.ones(BATCH, 1, 1, s, dtype=torch.bool), True),
    "one future key": (lambda s: (_positions(s)[1] <= _positions(s)[0] + 1)[None, None], False),
    "one entry hidden": (lambda s: ((_positions(s)[1] <= _positions(s)[0])
                                    & ~((_positions(s)[0] == 7) & (_positions(s)[1] == 3)))[None, None], False),
    "sliding window 4": (lambda s: ((_positions(s)[1] <= _positions(s)[0])
                                    & (_positions(s)[0] - _positions(s)[1] < 4))[None, None], False),
    "additive -1e9 (not -inf)": (lambda s: torch.full((s, s), -1e9).triu(1)[None, None], False),
    "one row broadcast": (lambda s: torch.ones(1, s, dtype=torch.bool)[None, None], False),
    "all visible": (lambda s: torch.ones(s, s, dtype=torch.bool), False),
}


class ConstantMaskAttention(nn.Module):
    """Attention whose mask is built inside forward from shapes only (as Hugging Face builds it)."""

    def __init__(self, make_mask, dim: int = 15, heads: int = 3) -> None:
        super().__init__()
        self.make_mask, self.heads = make_mask, heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, ids, labels):
        b, s = ids.shape
        x = self.embed(ids)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(s).to(x.device))
        logits = self.out(y.transpose(1, 2).reshape(b, s, -1) + x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def token_batches(n: int = 2, seq: int = SEQ):
    out = []
    for seed in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))
        out.append((ids, ids.roll(-1, 1)))
    return out


def _sdpa_after_pass(make_mask):
    exported = torch.export.export(ConstantMaskAttention(make_mask), token_batches(1)[0], strict=False)
    gm = attention_masks_pass(exported.graph_module, SimpleNamespace(mesh=MeshSpec(("cp",), (2,))))
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)


@pytest.mark.parametrize("name", list(MASKS))
def test_a_mask_takes_the_causal_path_only_when_it_is_causal(name):
    make, causal = MASKS[name]
    assert equals_causal(make(SEQ), SEQ) is causal  # the value check itself, against the definition
    node = _sdpa_after_pass(make)
    has_mask = len(node.args) > 3 and node.args[3] is not None
    assert has_mask is not causal
    assert bool(node.args[5] if len(node.args) > 5 else False) is causal


def test_a_mask_built_from_the_batch_is_never_folded():
    """A mask computed from an input has no value at compile time: it stays an explicit mask."""
    class FromInput(ConstantMaskAttention):
        def forward(self, ids, labels):
            self.make_mask = lambda s: (ids[:, None, :, None] >= 0) & torch.ones(s, s, dtype=torch.bool).tril()
            return super().forward(ids, labels)
    exported = torch.export.export(FromInput(None), token_batches(1)[0], strict=False)
    gm = attention_masks_pass(exported.graph_module, SimpleNamespace(mesh=MeshSpec(("cp",), (2,))))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert node.args[3] is not None


@pytest.mark.parametrize("name", ["one entry hidden", "sliding window 4"])
def test_an_almost_causal_mask_trains_like_one_device_through_the_masked_ring(name):
    programs: list = []
    train_like_one_device(lambda: ConstantMaskAttention(MASKS[name][0]), "cp=2", token_batches(), programs)
    assert [(r.causal, r.masked) for r in ring_nodes(programs[0])] == [(False, True)]


def test_a_causal_mask_trains_like_one_device_on_the_causal_ring():
    programs: list = []
    make = MASKS["additive finfo.min (eager)"][0]
    train_like_one_device(lambda: ConstantMaskAttention(make), "cp=2 cp_mode=zigzag", token_batches(), programs)
    assert [(r.causal, r.masked, r.layout) for r in ring_nodes(programs[0])] == [(True, False, "zigzag")]


# ============================================================ the ring kernel with an explicit mask

def _ring_with_mask(mask, layout: str, n: int = 3):
    """Each of n simulated ranks attends its rows (in `layout`) with its rows of `mask`; returns the
    largest difference from torch's sdpa on the whole sequence, outputs and all gradients (float64)."""
    g = torch.Generator().manual_seed(1)
    b, h, s, d = 2, 3, mask.shape[-1], 5
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    leaves = (q, k, v) + ((mask,) if mask.is_floating_point() else ())
    leaves = tuple(t.clone().requires_grad_() for t in leaves)
    ref = F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3] if len(leaves) > 3 else mask)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    order = zigzag_index(s, n) if layout == "zigzag" else torch.arange(s)

    def rank(mesh):
        rows = order.chunk(n)[mesh.rank]
        mine = tuple(t.detach()[:, :, rows].clone().requires_grad_() for t in leaves)
        local_mask = mine[3] if len(mine) > 3 else mask[..., rows, :]
        out = ring_attention(*mine[:3], mesh.comm("cp"), causal=False, scale=None, layout=layout, mask=local_mask)
        return rows, out, torch.autograd.grad(out, mine, dout[:, :, rows])

    worst = 0.0
    for rows, out, grads in run_in_threads(simulated_meshes(("cp",), (n,), timeout=30.0), rank, timeout=60.0):
        pairs = [(out, ref)] + list(zip(grads, ref_grads))
        worst = max([worst] + [(a - e.detach()[:, :, rows]).abs().max().item() for a, e in pairs])
    return worst


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_with_a_random_bool_mask_equals_sdpa(layout):
    mask = torch.rand(2, 1, 18, 18, generator=torch.Generator().manual_seed(2)) < 0.4
    mask[0, 0, 3] = False  # a row that sees no key at all: sdpa gives 0 there, and so must the ring
    assert _ring_with_mask(mask, layout) < 1e-12


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_with_an_additive_per_head_mask_equals_sdpa_and_its_gradient(layout):
    mask = torch.randn(1, 3, 18, 18, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert _ring_with_mask(mask, layout) < 1e-12


def _document_mask(docs: list[int]) -> torch.Tensor:
    doc, pos = torch.tensor(docs), torch.arange(len(docs))
    return ((doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]


def test_ring_attention_skips_hidden_blocks_and_gives_visible_ones_to_the_kernel():
    """Documents of 12 and 6 tokens on 3 ranks of 6: rank 1 meets its own block (causal inside one
    document: tile math with the mask), rank 0's block (all visible: one unmasked kernel call) and
    rank 2's (the future, another document: skipped)."""
    mask = _document_mask([0] * 12 + [1] * 6)
    assert _ring_with_mask(mask, "contiguous") < 1e-12
    schedule = masked_schedule("contiguous", 1, 3, 6)
    blocks = [torch.arange(6, 12), torch.arange(0, 6), torch.arange(12, 18)]
    calls = _mask_calls(mask[..., 6:12, :], schedule, blocks)
    assert calls == [[None], [[Call(0, 6, 0, 6, False)]], [[]]]
    assert _mask_calls(mask[..., 6:12, :], schedule, blocks, kernel_ok=False) == [[None], [None], [[]]]


def test_ring_attention_with_documents_crossing_zigzag_chunks_equals_sdpa():
    assert _ring_with_mask(_document_mask([0] * 5 + [1] * 9 + [2] * 4), "zigzag") < 1e-12


def test_zigzag_chunk_pairs_are_classified_one_by_one():
    """cp=2, S=16, documents [0, 8) and [8, 16): rank 0 holds chunks 0-3 and 12-15; of the other
    rank's block (4-7, 8-11) only 12-15 against 8-11 is visible, whole; its own block is causal
    on the diagonal pairs and hidden across documents."""
    mask = _document_mask([0] * 8 + [1] * 8)
    rows = zigzag_index(16, 2)[:8]
    schedule = masked_schedule("zigzag", 0, 2, 8)
    blocks = [zigzag_index(16, 2)[:8], zigzag_index(16, 2)[8:]]
    assert _mask_calls(mask[..., rows, :], schedule, blocks) == [
        [None, [], [], None], [[], [], [], [Call(4, 8, 4, 8, False)]]]
    assert _ring_with_mask(mask, "zigzag", n=2) < 1e-12


def test_long_chunks_are_cut_into_pieces_each_classified():
    """S=256 on 2 ranks: each 128-row block is cut into 2 x 2 pieces of 64; documents [0, 40) and
    [40, 256) make rank 1's own block (positions 128-255, one document) causal: the piece above the
    diagonal is skipped, the one below runs on the kernel, the two diagonal ones use the mask."""
    mask = _document_mask([0] * 40 + [1] * 216)
    assert _ring_with_mask(mask, "contiguous", n=2) < 1e-12
    schedule = masked_schedule("contiguous", 1, 2, 128)
    assert [(t.q_lo, t.q_hi, t.k_lo, t.k_hi) for t in schedule[0]] == [
        (0, 64, 0, 64), (0, 64, 64, 128), (64, 128, 0, 64), (64, 128, 64, 128)]
    calls = _mask_calls(mask[..., 128:, :], schedule, [torch.arange(128, 256), torch.arange(128)])
    assert calls[0] == [None, [], [Call(64, 128, 0, 64, False)], None]


# ============================================================ explicit masks from the batch

class MaskedAttentionLM(nn.Module):
    """Two attention layers taking a [B, S, S] boolean mask (True: attend) from the batch; 6 heads of
    5 so that Ulysses at cp=2 and cp=3 splits them."""

    def __init__(self, dim: int = 30, heads: int = 6) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.out = nn.Linear(dim, VOCAB)

    def attend(self, x, mask, qkv):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, -1))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, -1)

    def forward(self, ids, mask, labels):
        x = self.embed(ids)
        mask = mask.unsqueeze(1)  # one [B, 1, S, S] mask for every layer, as Hugging Face builds it
        for qkv in self.layers:
            x = self.attend(x, mask, qkv)
        return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def random_mask_batches(n: int = 2):
    out = []
    for seed in range(n):
        g = torch.Generator().manual_seed(10 + seed)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.rand(BATCH, SEQ, SEQ, generator=g) < 0.5
        mask |= torch.eye(SEQ, dtype=torch.bool)  # every row sees a key (an empty row is tested above)
        out.append((ids, mask, ids.roll(-1, 1)))
    return out


@pytest.mark.parametrize("plan", CP_PLANS)
def test_a_random_bool_mask_from_the_batch_trains_like_one_device(plan):
    programs: list = []
    train_like_one_device(MaskedAttentionLM, plan, random_mask_batches(), programs)
    rings = ring_nodes(programs[0])
    assert all(r.masked and not r.causal for r in rings) and len(rings) == (0 if "ulysses" in plan else 2)


class DocumentLM(MaskedAttentionLM):
    """Packed documents given as a document id per token: causal within a document only."""

    def forward(self, ids, doc, labels):
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device)
        mask = (doc[:, :, None] == doc[:, None, :]) & (pos[None, :] <= pos[:, None])
        return super().forward(ids, mask, labels)


def document_batches(n: int = 2):
    """Document boundaries at 5 and 9 (row 0), 7 (row 1), none (row 2): with S=12 they cross the cp=2
    boundary at 6 and the zig-zag chunk boundaries at 3 and 9."""
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 7 + [1] * 5, [0] * 12])
    return [(ids, docs, labels) for ids, _, labels in random_mask_batches(n)]


@pytest.mark.parametrize("plan", CP_PLANS + ("cp=3",))
def test_packed_documents_by_id_train_like_one_device(plan):
    train_like_one_device(DocumentLM, plan, document_batches())


@pytest.mark.parametrize("plan", ["cp=2", "cp=2 cp_mode=zigzag"])
def test_an_explicit_mask_costs_one_host_read_per_step_not_per_layer(plan):
    """The tile classification reads the mask on the host once per step, not once per layer (both
    layers share it). (On the CPU nothing waits; counted as a GPU would sync.)"""
    from collections import Counter

    from usc.testing.host_syncs import record_host_syncs

    batch = document_batches(1)[0]
    sim = usc.simulate(DocumentLM(), plan, example_inputs=batch, optimizer=_sgd)
    sim.step(*batch)
    with record_host_syncs() as syncs:
        sim.step(*batch)
    reads = Counter(s.thread for s in syncs if s.where.startswith("runtime/ring_attention.py"))
    assert sorted(reads.values()) == [1, 1], "\n".join(map(str, syncs))


# the vocabulary (37) is odd: tp splits the attention, the embedding and head stay whole
WHOLE_VOCAB = "; embed: replicate; out: replicate"


@pytest.mark.parametrize("plan", ["dp=3 cp=2", "cp=2 recompute=full", "cp=2 pp=2 mb=3", "cp=2 tp=2 sp=on" + WHOLE_VOCAB,
                                  "cp=2 cp_mode=zigzag tp=2" + WHOLE_VOCAB, "cp=2 cp_mode=ulysses tp=2" + WHOLE_VOCAB])
def test_a_document_mask_composes_with_the_other_dimensions(plan):
    train_like_one_device(DocumentLM, plan, document_batches())


class GroupedQueryLM(nn.Module):
    """6 query heads sharing 2 key/value heads through sdpa's own enable_gqa, causal."""

    def __init__(self, dim: int = 30, heads: int = 6, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim // heads * kv_heads)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, ids, labels):
        b, s = ids.shape
        x = self.embed(ids)
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, -1).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        logits = self.out(x + y.transpose(1, 2).reshape(b, s, -1))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("plan", CP_PLANS + ("cp=2 tp=2" + WHOLE_VOCAB,))
def test_grouped_query_attention_trains_like_one_device_under_cp(plan):
    train_like_one_device(GroupedQueryLM, plan, token_batches())


class ViewAfterAttention(GroupedQueryLM):
    """nanoGPT's ``y.transpose(1, 2).contiguous().view(B, T, C)``: export drops the contiguous (the
    kernel's output is stored [B, S, H, D]), so the view needs the attention output in that layout."""

    def __init__(self) -> None:
        super().__init__(kv_heads=6)

    def forward(self, ids, labels):
        b, s = ids.shape
        x = self.embed(ids)
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, s, -1)
        return F.cross_entropy(self.out(x + y).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("plan", CP_PLANS)
def test_cp_attention_output_keeps_the_attention_kernels_memory_layout(plan):
    train_like_one_device(ViewAfterAttention, plan, token_batches())


# ============================================================ Hugging Face decoders

def _hf(config_name: str, model_name: str, **extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=44, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False, **extra)
    for name, value in list(vars(config).items()):
        if "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.0)
    return getattr(transformers, model_name)(config)


class HFLoss(nn.Module):
    """The model's own causal-LM loss; `position_ids` when the batch carries them (packed documents)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids, *rest):
        if len(rest) == 2:
            return self.m(input_ids=ids, position_ids=rest[0], labels=rest[1]).loss
        return self.m(input_ids=ids, labels=rest[0]).loss


HF = {
    "llama": lambda: HFLoss(_hf("LlamaConfig", "LlamaForCausalLM")),
    "qwen2": lambda: HFLoss(_hf("Qwen2Config", "Qwen2ForCausalLM")),
    "mistral_window4": lambda: HFLoss(_hf("MistralConfig", "MistralForCausalLM", sliding_window=4)),
    "gemma2_eager": lambda: HFLoss(_hf("Gemma2Config", "Gemma2ForCausalLM", head_dim=6,
                                       attn_implementation="eager")),
    "gpt_neox": lambda: HFLoss(_gpt_neox()),
}


def _gpt_neox():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                                        num_attention_heads=6, rotary_pct=0.5, use_parallel_residual=True,
                                        max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
                                        attention_dropout=0.0, hidden_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(config)


def hf_batches(n: int = 2):
    return [(ids, labels) for ids, labels in token_batches(n)]


def packed_batches(n: int = 2):
    """position_ids restarting at 0 per document (transformers then builds a packed-sequence mask)."""
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(4), torch.arange(3)]),
                       torch.cat([torch.arange(7), torch.arange(5)]), torch.arange(12)])
    return [(ids, pos, labels) for ids, labels in token_batches(n)]


def test_hugging_face_llama_mask_is_proven_causal_under_cp():
    programs: list = []
    train_like_one_device(HF["llama"], "cp=2", hf_batches(), programs)
    assert [(r.causal, r.masked) for r in ring_nodes(programs[0])] == [(True, False)] * 2


@pytest.mark.parametrize("plan", ["dp=2", "pp=2 mb=2"])
def test_hugging_face_llama_mask_is_proven_causal_without_cp(plan):
    """Eager transformers gives sdpa no mask when nothing is padded; traced, it keeps a [B, 1, S, S]
    mask, which every layer's sdpa would copy to float and save. Proven causal, it is gone."""
    programs: list = []
    gen = torch.Generator().manual_seed(0)
    batches = [(ids, ids.roll(-1, 1)) for ids in (torch.randint(0, VOCAB, (4, SEQ), generator=gen) for _ in range(2))]
    train_like_one_device(HF["llama"], plan, batches, programs)
    attention = [n for n in programs[0].gm.graph.nodes if n.target is SDPA]
    attention += [n for sub in programs[0].gm.modules() if isinstance(sub, torch.fx.GraphModule)
                  and sub is not programs[0].gm for n in sub.graph.nodes if n.target is SDPA]
    assert attention and all(sdpa_mask(n) is None and sdpa_args(n)["is_causal"] for n in attention)


def test_hugging_face_llama_packed_documents_cross_zigzag_shards():
    programs: list = []
    train_like_one_device(HF["llama"], "cp=2 cp_mode=zigzag", packed_batches(), programs)
    assert [(r.causal, r.masked) for r in ring_nodes(programs[0])] == [(False, True)] * 2


class PaddedLoss(nn.Module):
    """Hugging Face Llama called with a padding `attention_mask` (padded labels are -100)."""

    def __init__(self) -> None:
        super().__init__()
        self.m = _hf("LlamaConfig", "LlamaForCausalLM")

    def forward(self, ids, attention_mask, labels):
        return self.m(input_ids=ids, attention_mask=attention_mask, labels=labels).loss


def padded_batches(*, left: bool, n: int = 2):
    """Rows 0 and 1 padded by 5 and 2 tokens (left: the first query rows see no key at all)."""
    out = []
    for ids, labels in token_batches(n):
        keep = torch.ones(BATCH, SEQ, dtype=torch.long)
        for row, pad in ((0, 5), (1, 2)):
            keep[row, :pad] = 0 if left else 1
            keep[row, SEQ - pad:] = 1 if left else 0
        out.append((ids, keep, labels.masked_fill(keep == 0, -100)))
    return out


def test_hugging_face_left_padding_trains_like_one_device_on_the_zigzag_ring():
    programs: list = []
    train_like_one_device(PaddedLoss, "cp=2 cp_mode=zigzag", padded_batches(left=True), programs)
    assert [(r.causal, r.masked) for r in ring_nodes(programs[0])] == [(False, True)] * 2


@deep
@pytest.mark.parametrize("plan", CP_PLANS + ("cp=3",))
@pytest.mark.parametrize("left", [False, True])
def test_hugging_face_padding_trains_like_one_device(plan, left):
    train_like_one_device(PaddedLoss, plan, padded_batches(left=left))


@deep
@pytest.mark.parametrize("plan", CP_PLANS + ("cp=3",))
@pytest.mark.parametrize("family", list(HF))
def test_hugging_face_decoders_train_like_one_device_under_cp(family, plan):
    programs: list = []
    train_like_one_device(HF[family], plan, hf_batches(), programs)
    if "ulysses" not in plan:
        assert {(r.causal, r.masked) for r in ring_nodes(programs[0])} == RING_KIND[family]


# what each family's attention becomes on the ring: proven causal, an explicit (sliding-window)
# mask, or no ring at all (Gemma2 eager is matmul + softmax: the cp sharding rules run it as before)
RING_KIND = {"llama": {(True, False)}, "qwen2": {(True, False)}, "gpt_neox": {(True, False)},
             "mistral_window4": {(False, True)}, "gemma2_eager": set()}


def test_eager_attention_keeps_working_under_cp():
    programs: list = []
    train_like_one_device(HF["gemma2_eager"], "cp=2", hf_batches(), programs)
    assert ring_nodes(programs[0]) == []


def test_a_meta_hugging_face_llama_lints_under_cp_with_its_mask_proven_causal():
    """Plan-only: the mask's constant subgraph is evaluated on the CPU although the model is on meta;
    causal work grows along the contiguous ring (an explicit mask would cost every rank the same)."""
    with torch.device("meta"):
        model = HF["llama"]()
    flops = usc.lint(model, "cp=3", example_inputs=hf_batches(1)[0]).attention_flops["cp"]
    assert flops[0] < flops[1] < flops[2]


@deep
@pytest.mark.parametrize("plan", CP_PLANS + ("cp=3", "dp=3 cp=2"))
def test_hugging_face_llama_packed_documents_train_like_one_device(plan):
    train_like_one_device(HF["llama"], plan, packed_batches())


# ============================================================ on gloo processes (deep tier)

def _train_documents_on_gloo(rank: int, world_size: int, plans: list[str], float64: bool = False) -> list:
    """Each rank compiles DocumentLM for each plan and takes SGD steps; rank 0 returns the state."""
    import io

    torch.set_num_threads(1)
    out = []
    for plan in plans:
        torch.manual_seed(0)
        model = DocumentLM().double() if float64 else DocumentLM()
        batches = document_batches()
        step = usc.compile(model, plan, example_inputs=batches[0], optimizer=_sgd)
        losses = [step.step(*b) for b in batches]
        buffer = io.BytesIO()
        torch.save({k: v.detach().clone() for k, v in step.full_state_dict().items()}, buffer)
        out.append((losses, buffer.getvalue() if rank == 0 else None))
    return out


@deep
@pytest.mark.distributed
def test_document_masks_train_like_one_device_on_gloo():
    from gloo_cases import outcome
    from harness import run_world
    from usc.testing.equivalence import check_equivalent

    plans = list(CP_PLANS)
    results = run_world(_train_documents_on_gloo, 2, plans, timeout=300)
    for index, plan in enumerate(plans):
        def rerun(model, batches, plan=plan):  # the float64 second opinion, on gloo too
            return outcome(run_world(_train_documents_on_gloo, 2, [plan], True, timeout=300), 0)
        check_equivalent(DocumentLM, document_batches(), outcome(results, index), rerun=rerun, optimizer=_sgd,
                         what=f"'{plan}' on gloo")
