"""find_tp_plan on the examples, Hugging Face models and hand-made blocks (all built on meta)."""

import pytest
import torch
from torch import nn

from planner.model_file import load_model_file
from planner.profile.tp_plan import TPPlan, find_tp_plan, tp_param_count
from tests.conftest import EXAMPLES


def _example(name: str) -> nn.Module:
    return load_model_file(EXAMPLES / name).build_model("meta")


def test_gpt_block():
    model = _example("gpt.py")
    plan = find_tp_plan(model.blocks[0], model, "blocks.0")
    assert plan is not None and plan.source == "names"
    assert plan.colwise == ("attn.q", "attn.k", "attn.v", "mlp.up")
    assert plan.rowwise == ("attn.proj", "mlp.down")
    assert plan.num_allreduces == 2
    assert model.cfg.n_head in plan.divisors
    assert plan.legal(2) and plan.legal(3) and plan.legal(6) and not plan.legal(4)
    h = model.cfg.n_embd
    # q, k, v, up with biases; proj and down weights only (their biases stay replicated).
    assert tp_param_count(model.blocks[0], plan) == 3 * (h * h + h) + (4 * h * h + 4 * h) + h * h + 4 * h * h


def test_llama_decoder_layer():
    model = _example("llama.py")
    layer = model.layers[1]
    plan = find_tp_plan(layer, model)  # the name is looked up in the model
    assert plan is not None and plan.source == "names"
    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert plan.colwise == (*attn, "mlp.gate_proj", "mlp.up_proj")
    assert plan.rowwise == ("self_attn.o_proj", "mlp.down_proj")
    assert {model.cfg.n_heads, model.cfg.n_kv_heads} <= set(plan.divisors)
    assert plan.legal(1) and plan.legal(2) and not plan.legal(3)
    assert not plan.legal(4)  # 4 divides 8 heads but not 2 kv heads
    assert plan.max_tp == 2
    assert tp_param_count(layer, plan) == sum(
        m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear)
    )


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=128,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def test_hf_llama_uses_its_tp_plan():
    model = _hf_llama()
    has_plan = bool(getattr(model, "_tp_plan", None) or model.config.base_model_tp_plan)
    layer = model.model.layers[0]
    # The name relative to the whole model, to the base model, or looked up.
    for plan in (find_tp_plan(layer, model, "model.layers.0"), find_tp_plan(layer, model, "layers.0"),
                 find_tp_plan(layer, model)):
        assert plan is not None
        assert plan.source == ("hf_tp_plan" if has_plan else "names")
        assert set(plan.colwise) == {f"self_attn.{p}_proj" for p in "qkv"} | {"mlp.gate_proj", "mlp.up_proj"}
        assert set(plan.rowwise) == {"self_attn.o_proj", "mlp.down_proj"}
        assert {8, 4} <= set(plan.divisors)
        assert plan.legal(4) and not plan.legal(8)


def test_hf_llama_non_layers_have_no_plan():
    model = _hf_llama()
    assert find_tp_plan(model.lm_head, model, "lm_head") is None  # colwise_gather_output: not a pair
    assert find_tp_plan(model.model.embed_tokens, model, "model.embed_tokens") is None
    assert find_tp_plan(model.model.norm, model, "model.norm") is None


def test_hf_gpt2_shards_no_conv1d():
    model = _example("hf_gpt2.py")
    block = model.transformer.h[0]
    plan = find_tp_plan(block, model, "transformer.h.0")
    modules = dict(block.named_modules())
    if plan is not None:
        assert all(isinstance(modules[n], nn.Linear) for n in plan.colwise + plan.rowwise)


@pytest.mark.parametrize("example", ["mlp.py", "resnet.py"])
def test_non_transformer_layers_have_no_plan(example):
    model = _example(example)
    for name, module in model.named_modules():
        if name.count(".") <= 1:  # the model, its children and theirs (ResNet blocks)
            assert find_tp_plan(module, model, name) is None, name


class _Odd(nn.Module):
    def __init__(self, h: int = 16, f: int = 48):
        super().__init__()
        self.num_heads = 4
        self.foo = nn.Linear(h, f)
        self.act = nn.ReLU()
        self.bar = nn.Linear(f, h)

    def forward(self, x):
        return self.bar(self.act(self.foo(x)))


def test_structure_fallback():
    with torch.device("meta"):
        block = nn.Sequential(nn.LayerNorm(16), _Odd())
    plan = find_tp_plan(block)
    assert plan == TPPlan(("1.foo",), ("1.bar",), (4,), (48, 48), "structure")
    assert tp_param_count(block, plan) == 16 * 48 + 48 + 48 * 16
    assert plan.legal(4) and not plan.legal(8)


def test_unpaired_or_fused_linears_have_no_plan():
    with torch.device("meta"):
        only_col = nn.ModuleDict({"q": nn.Linear(8, 8), "k": nn.Linear(8, 8)})
        fused = nn.ModuleDict({"qkv": nn.Linear(8, 24), "proj": nn.Linear(8, 8)})  # 24 != 8
        norm_between = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    assert find_tp_plan(only_col) is None
    assert find_tp_plan(fused) is None
    assert find_tp_plan(norm_between) is None
