"""The profiler's shortcut for stacks of identical blocks (planner/profile/repeats.py): tracing a few
blocks and copying their figures gives exactly the profile of a trace of every block, and a model
whose "identical" blocks behave differently is traced whole."""

import logging
from dataclasses import fields

import pytest
import torch
from torch import nn

from planner.model_file import load_model_file
from planner.profile import ModelProfile, profile_model
from planner.profile import repeats
from tests.conftest import EXAMPLES

LOGGER = "planner.profile.repeats"


def _profile(path, reuse_min_blocks, **kw) -> ModelProfile:
    kw.setdefault("batch_size", 2)
    return profile_model(load_model_file(path), measure=False, force_meta=True, check_split=False,
                         reuse_min_blocks=reuse_min_blocks, **kw)


def assert_same_profile(fast: ModelProfile, full: ModelProfile) -> None:
    """Field by field (all but the profiling time), then layer by layer, so a failure names it."""
    for f in fields(ModelProfile):
        if f.name not in ("profile_s", "layers"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name
    assert len(fast.layers) == len(full.layers)
    for a, b in zip(fast.layers, full.layers):
        for f in fields(a):
            assert getattr(a, f.name) == getattr(b, f.name), f"layer {a.index} ({a.name}): {f.name}"


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _shortcut_taken(caplog) -> bool:
    messages = _messages(caplog)
    assert not any("tracing every block" in m for m in messages), messages
    return any("traced 4 of" in m for m in messages)


# -- the examples: the shortcut is taken and changes nothing --------------------------------
@pytest.mark.parametrize("example", ["gpt.py", "llama.py", "hf_gpt2.py"])
def test_shortcut_equals_the_whole_trace(example, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    fast = _profile(EXAMPLES / example, reuse_min_blocks=4)
    assert _shortcut_taken(caplog)
    full = _profile(EXAMPLES / example, reuse_min_blocks=None)
    assert_same_profile(fast, full)
    blocks = [layer for layer in full.layers if layer.name.split(".")[-1].isdigit()]
    assert len(blocks) >= 4 and len({b.kind for b in blocks}) == 1


def test_shortcut_is_the_default_for_long_stacks(caplog):
    """gpt_1b.py's 16 blocks reach MIN_BLOCKS: the default profile takes the shortcut."""
    assert repeats.MIN_BLOCKS <= 16
    caplog.set_level(logging.INFO, logger=LOGGER)
    handle = load_model_file(EXAMPLES / "gpt_1b.py")
    fast = profile_model(handle, measure=False, force_meta=True)
    assert _shortcut_taken(caplog)
    full = profile_model(handle, measure=False, force_meta=True, reuse_min_blocks=None)
    assert_same_profile(fast, full)


FIRST_BLOCK_MAKES_A_BIAS = """
    import torch, torch.nn as nn

    class Block(nn.Module):
        '''T5's layout: the first block makes a positional bias, the others take it and pass it on.'''
        def __init__(self, i, h=32, s=16):
            super().__init__()
            self.layer_idx = i
            self.norm = nn.LayerNorm(h)
            self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
            self.rel = nn.Embedding(2 * s, 1) if i == 0 else None
            self.s = s

        def forward(self, x, bias=None):
            if self.rel is not None:
                pos = torch.arange(self.s, device=x.device)
                bias = self.rel(pos[:, None] - pos[None, :] + self.s)[..., 0]
            y = self.norm(x).cumprod(dim=-1)  # an op with no FLOP formula: reported as uncounted
            att = torch.softmax(self.q(y) @ self.k(y).transpose(1, 2) + bias, dim=-1)
            return x + self.o(att @ self.v(y)), bias

    class Model(nn.Module):
        def __init__(self, n=7):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList(Block(i) for i in range(n))
            self.head = nn.Linear(32, 64)

        def forward(self, idx):
            x, bias = self.emb(idx), None
            for block in self.blocks:
                x, bias = block(x, bias)
            return self.head(x)

    def build_model():
        return Model()

    def sample_batch(b):
        g = torch.Generator().manual_seed(0)
        t = torch.randint(0, 64, (b, 17), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
"""


def test_first_block_that_differs_and_a_tensor_every_block_reads(model_file, caplog):
    """Only the interior must be alike: the first block (with its bias table) is traced itself,
    and the bias it makes, read and returned by every block, reaches the copies too."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = model_file(FIRST_BLOCK_MAKES_A_BIAS)
    fast = _profile(path, reuse_min_blocks=4)
    assert _shortcut_taken(caplog)
    full = _profile(path, reuse_min_blocks=None)
    assert_same_profile(fast, full)
    assert len({layer.kind for layer in full.layers[2:-2]}) == 1
    assert any(op.startswith("cumprod") for op in full.uncounted_ops)


# -- blocks that are not copies of each other: traced whole, figures exact -------------------
LOOKALIKES = {
    "index_branch": """
        class Block(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.index = i
                self.fc = nn.Linear(16, 16)
                self.extra = nn.Linear(16, 16)
            def forward(self, x):
                x = x + self.fc(x)
                return x + self.extra(x) if self.index % 2 == 0 else x   # every other block works more
        def run(self, x):
            for block in self.blocks:
                x = block(x)
            return x
    """,
    "glue_counts_blocks": """
        class Block(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.fc = nn.Linear(16, 16)
            def forward(self, x):
                return x + self.fc(x)
        def run(self, x):
            outs = []
            for block in self.blocks:
                x = block(x)
                outs.append(x)
            return torch.stack(outs).mean(0)   # its size depends on the number of blocks
    """,
    "indexes_the_stack": """
        class Block(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.fc = nn.Linear(16, 16)
            def forward(self, x):
                return x + self.fc(x)
        def run(self, x):
            for i in range(N):
                x = self.blocks[i](x)
            return x
    """,
    "tied_weights": """
        class Block(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.fc = nn.Linear(16, 16)
            def forward(self, x):
                return x + self.fc(x)
        def setup(model):
            # blocks 2 and 4 share a weight: the later backward adds its gradient to the other's
            model.blocks[2].fc.weight = model.blocks[4].fc.weight
        def run(self, x):
            for block in self.blocks:
                x = block(x)
            return x
    """,
    "inputs_grow": """
        class Block(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.fc = nn.Linear(16, 16)
            def forward(self, x):
                return torch.cat([x, self.fc(x[:, -1:])], dim=1)   # one more position per block
        def run(self, x):
            for block in self.blocks:
                x = block(x)
            return x[:, :8]
    """,
}


def _lookalike(model_file, body: str):
    return model_file(
        """
        import torch, torch.nn as nn
        N = 6
        """
        + body
        + """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(8, 16)
                self.blocks = nn.ModuleList(Block(i) for i in range(N))
                self.out = nn.Linear(16, 4)
                globals().get("setup", lambda model: None)(self)
            def forward(self, x):
                return self.out(run(self, self.inp(x)))
        def build_model():
            return Model()
        def sample_batch(b):
            g = torch.Generator().manual_seed(0)
            return torch.randn(b, 8, 8, generator=g), torch.randn(b, 8, 4, generator=g)
        """
    )


@pytest.mark.parametrize("case", sorted(LOOKALIKES))
def test_blocks_that_differ_are_traced_whole(case, model_file, caplog):
    """Each is either no stack (tied weights) or caught by the check of one more traced block."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = _lookalike(model_file, LOOKALIKES[case])
    fast = _profile(path, reuse_min_blocks=4, dtype="fp32")
    messages = _messages(caplog)
    if case == "tied_weights":
        assert messages == []
    else:
        assert any("tracing every block" in m for m in messages), messages
    full = _profile(path, reuse_min_blocks=None, dtype="fp32")
    assert_same_profile(fast, full)


def test_the_check_is_what_catches_a_block_that_reads_its_index(model_file, monkeypatch):
    """Without the check of one more traced block, copying the representative would be wrong
    here: the test above relies on the check, not on luck."""
    path = _lookalike(model_file, LOOKALIKES["index_branch"])
    full = _profile(path, reuse_min_blocks=None, dtype="fp32")
    monkeypatch.setattr(repeats, "trace_key", lambda trace: ())
    unchecked = _profile(path, reuse_min_blocks=4, dtype="fp32")
    assert unchecked.totals.fwd_flops < full.totals.fwd_flops


@pytest.mark.parametrize(
    "attrs, alike",
    [
        ({"layer_idx": [0, 1, 2, 3]}, True),  # an index: different in every block
        ({"heads": [4, 4, 4, 4]}, True),
        ({"use_rope": [1, 0, 1, 1]}, False),  # a per-block flag stored as an int
        ({"sliding": [True, False, True, False]}, False),
        ({"drop_rate": [0.0, 0.1, 0.2, 0.3]}, False),  # stochastic depth
        ({"act": ["gelu", "gelu", "relu", "gelu"]}, False),
    ],
)
def test_which_blocks_are_interchangeable(attrs, alike):
    blocks = []
    for i in range(4):
        block = nn.Linear(4, 4)
        for name, values in attrs.items():
            setattr(block, name, values[i])
        blocks.append(block)
    assert repeats.interchangeable(blocks) is alike


class _Wrap(nn.Module):
    def __init__(self, fc: nn.Linear):
        super().__init__()
        self.fc = fc


def test_stacks_need_alike_interiors_and_their_own_linears():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(
        nn.ModuleList([nn.Linear(4, 4) for _ in range(5)]),  # a stack
        nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]),  # too short
        nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 4)]),  # interior differs
        nn.ModuleList([_Wrap(shared) for _ in range(2)] + [_Wrap(nn.Linear(4, 4)) for _ in range(3)]),  # shares a Linear
        nn.ModuleList([_Wrap(nn.Linear(4, 4)) for _ in range(5)]),  # ties a weight
    )
    model[4][2].fc.weight = model[4][3].fc.weight
    from planner.profile.layers import find_units

    units = find_units(model)
    stacks = repeats.find_stacks(model, units, min_blocks=4)
    assert [units[s.members[0]].name for s in stacks] == ["0.0"]
    assert len(stacks[0].members) == 5 and stacks[0].mid == 2


def test_a_shortcut_leaves_the_model_whole(model_file):
    """The runs cut each stack down in place: afterwards every block is back, in order."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.profile import materialize as mat
    from planner.profile.layers import find_units

    handle = load_model_file(EXAMPLES / "gpt.py")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = mat.build_fake(handle, torch.bfloat16, mode)
    before = list(model.blocks)
    units = find_units(model)
    stacks = repeats.find_stacks(model, units, min_blocks=4)
    inputs, targets = handle.sample_batch(1)
    with mode:
        trace = repeats.trace_with_repeats(handle, model, units, stacks, mat.fake_batch(inputs, mode),
                                           mat.fake_batch(targets, mode))
    assert trace is not None and list(model.blocks) == before
    assert [units[i].name for i in trace.order if units[i].name.startswith("blocks.")] == [
        f"blocks.{i}" for i in range(len(before))
    ]
