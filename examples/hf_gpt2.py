"""A Hugging Face ``transformers`` GPT-2 (``GPT2LMHeadModel``) built from a small config: nothing is
downloaded, the weights are random. Needs ``pip install transformers``.

Sizes: 4 layers, 4 heads, width 256, 256 positions, vocab 8192, dropout 0.0; the lm_head is tied to
the token embedding (GPT-2's default), about 5.3 M parameters. Inputs are a dict
``{"input_ids": (B, 256) token ids}`` (keyword arguments to the model's forward); targets are the
next tokens, and the default loss (cross-entropy on ``outputs.logits``) applies.

Note: transformers' mask code makes a data-dependent check, so the forward runs on real tensors and
under ``FakeTensorMode``, but not on plain ``meta`` tensors (``Tensor.item() cannot be called on meta
tensors``); building under ``torch.device("meta")`` works.

    plan profile examples/hf_gpt2.py --batch-size 8
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(
    vocab_size=8192,
    n_positions=256,
    n_embd=256,
    n_layer=4,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    use_cache=False,
    bos_token_id=8191,  # GPT-2's <|endoftext|> is the last id of its vocabulary; keep it inside ours
    eos_token_id=8191,
)


def build_model() -> torch.nn.Module:
    return GPT2LMHeadModel(CONFIG)


def sample_batch(batch_size: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.n_positions + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()
