"""Pipeline parallel for models whose forward is not a plain sequence of their layers: split with
torch.distributed.pipelining's tracer (runtime/pipeline.py), and the planner told which cuts the
tracer can make (planner/profile/split.py).

- Parity: a tiny Hugging Face GPT-2 (blocks take mask/position arguments; lm_head tied to the token
  embedding across the two ends of the pipeline) under pp=2 with 1F1B, interleaved 1F1B (2 chunks
  a rank), GPipe with full recompute (2 ranks, one launch) and pp2 x dp2 with FSDP ZeRO-3 (4 ranks),
  fp32, SGD, 5 steps: losses within 1e-5 relative and final parameters within 1e-5 of one
  process on the whole batch; one launch per world size. A tiny Hugging Face Llama as its config
  comes (use_cache on, rotary embeddings passed to every block, a loss on `.logits`) under pp=2
  1F1B in the same 2-rank launch, against one process running it as built; a tiny ViT likewise
  (strided hand-overs: a mask expanded from one row, the class token's slice), a plain
  sequence of layers returning transposed views and an nn.TransformerEncoder (its layers called
  with their forward's defaults beside the tensor), both split as layers. An encoder-decoder (T5)
  traced without the inference caches of both its configs, refused in one line where a later stage
  reads a model input.
- Profile: GPT-2's cuts are valid (split "traced", every tensor crossing counted); a model with
  data-dependent control flow in forward keeps them invalid with the tracer's reason, and
  `plan --pp 2` refuses it with one line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from planner.cli import main
from planner.model_file import load_model_file
from planner.profile import profile_model
from planner.search.space import Fixed
from tests.distributed.reference import assert_matches, make_plans, run_by_world, single_process

STEPS = 5
GLOBAL_BATCH = 8

HF_MODEL = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=95, eos_token_id=95)


def build_model():
    return GPT2LMHeadModel(CONFIG)


def sample_batch(batch_size):
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.n_positions + 1))
    return {"input_ids": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()
"""

# A Llama from transformers as its config comes, use_cache on: every forward returns a DynamicCache
# (no pytree), which the tracer cannot split unless it is off in what is traced
# (planner.profile.split.without_inference_cache); rotary position embeddings made once and passed
# to every block.
HF_LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)


def build_model():
    return LlamaForCausalLM(CONFIG)


def sample_batch(batch_size):
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, 17))
    return {"input_ids": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()


def loss_fn(outputs, targets):  # as users write it: on the model output's .logits
    return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())
"""

# A ViT from transformers: its blocks take an attention mask expanded from one row (stride 0) made
# before them, and its classifier reads the class token sliced out of the last norm's output: what
# its cuts hand over are strided views, which the schedules' send and receive refuse unless made
# contiguous (planner.profile.split.contiguous_handovers).
HF_VIT = """
import torch
from transformers import ViTConfig, ViTForImageClassification

CONFIG = ViTConfig(image_size=32, patch_size=16, num_channels=3, hidden_size=32, num_hidden_layers=4,
                   num_attention_heads=4, intermediate_size=64, num_labels=10)


def build_model():
    return ViTForImageClassification(CONFIG)


def sample_batch(batch_size):
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32)}, torch.randint(0, 10, (batch_size,))
"""

# Not traced: a plain sequence of layers whose outputs are transposed views (a patch embedding's
# flatten(2).transpose(1, 2), and the residual additions that keep its layout), split as layers
# (runtime/pipeline.py build_stage_module), in the same launch.
STRIDED = """
import torch
from torch import nn


class Patch(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Conv2d(3, d, 4, 4)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(x)


class Head(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 10)

    def forward(self, x):
        return self.fc(x.mean(1))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList([Patch(d), Block(d), Block(d), Head(d)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model():
    return Net()


def sample_batch(batch_size):
    return torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,))
"""

# nn.TransformerEncoder calls its layers with src_mask=None, is_causal=False and
# src_key_padding_mask=None beside the tensor: their forward's defaults, so the layers run in
# sequence (split as layers); FLAGGED passes a flag that is not a default, which needs the tracer.
ENCODER = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab=64, d=16, n=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, n, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


def build_model():
    return Net()


def sample_batch(batch_size):
    tokens = torch.randint(0, 64, (batch_size, 8))
    return tokens, tokens
"""

FLAGGED = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, scale=1.0):
        return x + self.fc(x) * scale


class Net(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.out(x)


def build_model():
    return Net()


def sample_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randn(batch_size, 1)
"""

# An encoder-decoder from transformers: its decoder keeps a config of its own (use_cache on there
# too), and the labels it is given are read only by the decoder, after the first stage.
HF_T5 = """
import torch
from transformers import T5Config, T5ForConditionalGeneration

CONFIG = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                  dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


def build_model():
    return T5ForConditionalGeneration(CONFIG)


def sample_batch(batch_size):
    labels = torch.randint(1, 64, (batch_size, 8))
    return {"input_ids": torch.randint(1, 64, (batch_size, 8)), "labels": labels}, labels
"""

# Blocks take a mask made by glue (so no cut hands over one layer's output alone) and the forward
# branches on tensor values: the tracer (torch.export) cannot capture it.
UNTRACEABLE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, mask):
        return x + torch.relu(self.fc(x)) * mask


class Net(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        mask = torch.ones_like(h)
        for b in self.blocks:
            h = b(h, mask)
            if h.sum() > 0:
                h = h * 0.5
        return self.out(h)


def build_model():
    return Net()


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 1)
"""

# name -> (world size, Fixed); one launch per world size runs its plans in turn
CONFIGS = {
    "hf_pp_1f1b": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="none", schedule="1f1b")),
    "hf_pp_interleaved": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="none",
                                   schedule="interleaved", virtual_stages=2)),
    # recompute wraps the traced stage's layer submodules (the tracer keeps them as modules)
    "hf_pp_gpipe_recompute": (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="full", schedule="gpipe")),
    # FSDP2 replaces the traced stage's parameters by sharded ones; the tied weight's copies are summed
    "hf_pp_dp_fsdp": (4, Fixed(dp=2, tp=1, pp=2, zero=3, micro_batch=2, recompute="none", schedule="1f1b")),
}


# Other models' pp2 1F1B plans, run in turn in the same 2-rank launch as GPT-2's: name -> (model
# file, split as layers rather than traced)
OTHER_MODELS = {
    "hf_llama_pp_1f1b": ("hf_llama.py", False),  # traced without its inference cache; a loss on .logits
    "hf_vit_pp_1f1b": ("hf_vit.py", False),  # strided hand-overs (the expanded mask, the class token)
    "strided_pp_1f1b": ("strided.py", True),  # layers that return transposed views
    "encoder_pp_1f1b": ("encoder.py", True),  # layers called with their forward's defaults beside the tensor
}
OTHER_CONFIGS = {
    name: (2, Fixed(dp=1, tp=1, pp=2, zero=0, micro_batch=2, recompute="none", schedule="1f1b")) for name in OTHER_MODELS
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tracer")
    (path / "hf_tiny.py").write_text(HF_MODEL)
    (path / "untraceable.py").write_text(UNTRACEABLE)
    (path / "hf_llama.py").write_text(HF_LLAMA)
    (path / "hf_vit.py").write_text(HF_VIT)
    (path / "strided.py").write_text(STRIDED)
    (path / "encoder.py").write_text(ENCODER)
    (path / "flagged.py").write_text(FLAGGED)
    (path / "hf_t5.py").write_text(HF_T5)
    return path


@pytest.fixture(scope="module")
def plans(workdir) -> dict[str, Path]:
    out = make_plans(workdir / "hf_tiny.py", CONFIGS, workdir, GLOBAL_BATCH)
    for name, (model, _) in OTHER_MODELS.items():
        out.update(make_plans(workdir / model, {name: OTHER_CONFIGS[name]}, workdir, GLOBAL_BATCH))
    return out


@pytest.fixture(scope="module")
def reference(plans):
    return single_process(plans["hf_pp_1f1b"], STEPS)


@pytest.fixture(scope="module")
def runs(plans, workdir):
    def traced(result, names):
        log = (result.run_dir / "launch.log").read_text(errors="replace")
        want = len([n for n in names if not OTHER_MODELS.get(n, ("", False))[1]])
        assert log.count("split by the pipelining tracer") == want, "the runs did not take the tracer path"

    return run_by_world(plans, {**CONFIGS, **OTHER_CONFIGS}, workdir, STEPS, traced)


def test_plans_are_pipelined(plans):
    from planner.plan import Plan

    inter = Plan.load(plans["hf_pp_interleaved"])
    assert inter.parallel.pp == 2 and all(len(s.chunks) == 2 for s in inter.stages)
    assert Plan.load(plans["hf_pp_1f1b"]).parallel.schedule == "1f1b"
    assert all(s.recompute_layers for s in Plan.load(plans["hf_pp_gpipe_recompute"]).stages)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_gpt2_matches_single_process(name, runs, reference):
    report, params_path = runs[name]
    assert_matches(name, report.measured.losses, params_path, reference)


def test_hf_gpt2_cuts_valid_by_tracer(workdir):
    """On fake tensors (what a laptop profiles large models on) the blocks run as on real ones, SDPA
    with is_causal and no mask (planner.profile.materialize.one_sequence_per_row): the tracer makes
    every cut valid, and a block's cut hands over its hidden state alone."""
    profile = profile_model(load_model_file(workdir / "hf_tiny.py"), batch_size=2, dtype="fp32",
                            force_meta=True, measure=False)
    assert profile.pipeline_split == "traced" and profile.pipeline_split_note is None
    assert all(layer.cut_after_ok for layer in profile.layers[:-1])
    block = next(layer for layer in profile.layers if layer.name == "transformer.h.1")
    hidden = 2 * 16 * 32 * 4
    assert block.output_bytes == hidden
    again = type(profile).from_dict(__import__("json").loads(profile.to_json()))
    assert again.pipeline_split == "traced"


def test_hf_llama_as_configured_pipelines(workdir, capsys):
    """A Hugging Face causal LM with its config's default use_cache: traced without the inference
    cache, it splits between its decoder layers, and `plan --pp 2` plans two stages where it used
    to refuse with the tracer's pytree error. The model as built keeps its cache (transformers
    takes the jumps in context parallelism's position ids for packed sequences without one)."""
    handle = load_model_file(workdir / "hf_llama.py")
    assert handle.module.CONFIG.use_cache, "transformers' default changed: the test no longer covers it"
    assert handle.build_model().config.use_cache is True
    profile = profile_model(handle, batch_size=2, dtype="fp32", force_meta=True, measure=False)
    assert profile.pipeline_split == "traced" and profile.pipeline_split_note is None
    assert all(layer.cut_after_ok for layer in profile.layers[:-1])
    out = workdir / "llama_pp2.json"
    assert main([str(workdir / "hf_llama.py"), "--gpu", "cpu", "--gpus", "2", "--pp", "2", "--global-batch", "4",
                 "-o", str(out)]) == 0, capsys.readouterr().err
    from planner.plan import Plan

    assert Plan.load(out).parallel.pp == 2


@pytest.mark.parametrize("name", list(OTHER_MODELS))
def test_other_models_match_single_process(name, runs, plans):
    """Each split as its profile says (traced, or as layers), against one process running the model
    as built (the Llama with its inference cache)."""
    from planner.plan import Plan

    split = Plan.load(plans[name]).model.pipeline_split
    assert split == ("sequential" if OTHER_MODELS[name][1] else "traced"), split
    report, params_path = runs[name]
    assert_matches(name, report.measured.losses, params_path, single_process(plans[name], STEPS))


def test_called_alone_takes_defaults_not_flags(workdir):
    """Beside the tensor a layer runs on, arguments equal to its forward's defaults leave a cut
    plain; a flag that is not one does not (the tracer splits the model, baking it in)."""
    from planner.profile.trace import called_alone, forward_signature

    sig = forward_signature(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    x = torch.zeros(1, 4, 8)
    assert called_alone(sig, (x,), {"src_mask": None, "is_causal": False, "src_key_padding_mask": None})
    assert not called_alone(sig, (x,), {"is_causal": True})
    assert not called_alone(sig, (x, None, None, True), {})
    assert not called_alone(sig, (None,), {})
    profile = profile_model(load_model_file(workdir / "flagged.py"), batch_size=2, dtype="fp32", measure=False)
    before_block = [a for a, b in zip(profile.layers, profile.layers[1:]) if b.name.startswith("blocks.")]
    assert before_block and not any(layer.cut_plain for layer in before_block)
    assert profile.layers[-2].cut_plain  # the head takes the last block's output alone
    assert profile.pipeline_split == "traced", profile.pipeline_split_note


def test_encoder_decoder_traced_without_caches_and_refused_in_one_line(workdir, capsys):
    """Every config the model holds gets use_cache off in what is traced (T5's decoder has its own
    copy); what then stops the split, the labels read only by a later stage (the schedules feed the
    model's inputs to the first stage), is the tracer's one-line reason, and `plan --pp 2` says it."""
    from planner.profile.split import without_inference_cache

    handle = load_model_file(workdir / "hf_t5.py")
    model = handle.build_model()
    assert model.decoder.config is not model.config and model.decoder.config.use_cache
    without_inference_cache(model)
    assert not any(getattr(getattr(m, "config", None), "use_cache", False) for m in model.modules())
    profile = profile_model(handle, batch_size=2, dtype="fp32", force_meta=True, measure=False)
    assert "labels is read only after the first stage" in (profile.pipeline_split_note or ""), profile.pipeline_split_note
    assert main([str(workdir / "hf_t5.py"), "--gpu", "cpu", "--gpus", "2", "--pp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "labels is read only after the first stage" in err and "\n" not in err, err


def test_strided_handovers_made_contiguous(workdir):
    """Cut before the classifier, the class token slice crosses; cut between blocks, the mask
    expanded from one row: each leaves its stage contiguous, and the next stage expects it so."""
    from planner.profile.split import trace_split

    handle = load_model_file(workdir / "hf_vit.py")
    inputs, _ = handle.sample_batch(2)
    for cut in ("classifier", "vit.layers.2"):
        pipe = trace_split(handle.build_model(), inputs, [cut])
        subs = [pipe.split_gm.get_submodule(str(n.target)) for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
        sent = next(n for n in subs[0].graph.nodes if n.op == "output").args[0]
        sent = sent if isinstance(sent, (tuple, list)) else (sent,)
        assert any(n.op == "call_method" and n.target == "contiguous" for n in sent), cut
        assert all(n.meta["val"].is_contiguous() for n in sent)
        assert all(n.meta["val"].is_contiguous() for n in subs[1].graph.nodes if n.op == "placeholder")


def test_untraceable_model_keeps_cuts_invalid_and_plan_refuses_pp(workdir, capsys):
    path = workdir / "untraceable.py"
    profile = profile_model(load_model_file(path), batch_size=2, dtype="fp32", measure=False)
    assert profile.pipeline_split == "none"
    assert "pipelining tracer failed" in profile.pipeline_split_note and "Net" in profile.pipeline_split_note
    assert not any(layer.cut_after_ok for layer in profile.layers)
    assert main([str(path), "--gpu", "cpu", "--gpus", "2", "--pp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--pp 2: untraceable cannot be split into pipeline stages" in err and "pipelining tracer failed" in err, err
    assert "\n" not in err


def test_old_profile_without_split_field_loads(workdir):
    import json

    from planner.profile.types import ModelProfile

    profile = profile_model(load_model_file(workdir / "untraceable.py"), batch_size=1, dtype="fp32", measure=False,
                            check_split=False)
    data = json.loads(profile.to_json())
    del data["pipeline_split"], data["pipeline_split_note"]
    old = ModelProfile.from_dict(data)
    assert old.pipeline_split == "sequential" and old.pipeline_split_note is None


def test_traced_stages_talk_to_neighbours_only(workdir):
    """The mask made before the first block is relayed stage to stage (the schedules send between
    adjacent stages only); run in sequence, the stages give the model's logits."""
    import operator

    from planner.profile.split import trace_split

    handle = load_model_file(workdir / "hf_tiny.py")
    torch.manual_seed(0)
    model = handle.build_model()
    inputs, _ = handle.sample_batch(2)
    want = model(**inputs).logits
    pipe = trace_split(model, inputs, ["transformer.h.1", "transformer.h.2", "transformer.h.3"])
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k, call in enumerate(calls[1:], 1):
        for arg in call.args:
            source = arg.args[0] if arg.op == "call_function" and arg.target is operator.getitem else arg
            assert source is calls[k - 1], f"stage {k} takes {arg.name} from {source.name}"
    out = pipe.get_stage_module(0)(inputs["input_ids"])
    for k in range(1, pipe.num_stages):
        out = pipe.get_stage_module(k)(*out)
    assert torch.equal(out, want)
