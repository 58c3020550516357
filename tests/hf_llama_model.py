"""A Hugging Face ``transformers`` Llama (``LlamaForCausalLM``, random weights from a tiny config;
nothing is downloaded), as users bring one: its decoder layers take the rotary tables, the mask and
the positions beside the hidden states, and the model computes those from the embeddings' sequence
length, so sequence parallelism takes each rank's shard at the first layer's input
(TPRole.shard_at) rather than at the embeddings, and the attention gets its hidden states by keyword
(TPRole.gather_kwargs). `batch_with_positions` also gives the position ids (one sequence per row),
which context parallelism shards with the tokens. tests/distributed/test_parity.py (tp_hf_llama,
tp_cp_hf_llama) trains it against one process."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
SEQ = 16


def build_model():
    return LlamaForCausalLM(CONFIG)


def sample_batch(batch_size):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # new data each step
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ + 1), generator=g)
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def batch_with_positions(batch_size, positions=None):
    """sample_batch with the position ids too (0 .. SEQ - 1 in every row unless given)."""
    inputs, targets = sample_batch(batch_size)
    inputs["position_ids"] = (torch.arange(SEQ) if positions is None else positions).expand(batch_size, SEQ)
    return inputs, targets
