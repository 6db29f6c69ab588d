"""A tiny random chat target for benchmark smoke runs (`--target tiny`): the tiny Llama of
adaptive_eagle.targets with a word-level tokenizer and a trivial chat template, so the gateway and
the openai client can talk to it. Owns: that construction only."""

from __future__ import annotations

from dataclasses import replace


def tiny_chat_target(seed: int = 3, vocab_size: int = 64):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from adaptive_eagle.targets import tiny_target

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return replace(tiny_target(seed=seed, vocab_size=vocab_size, num_layers=6, initializer_range=0.15,
                               max_position_embeddings=512), tokenizer=fast)
