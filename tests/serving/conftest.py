"""Serving fixtures: a tiny random Llama target with a word-level tokenizer and a chat template
(built offline), a head registry holding two tiny heads, and reference-backend replicas over them.
Everything runs in float64 so speculative greedy output equals plain greedy output exactly."""

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.targets import tiny_target
from serving.backend import ReferenceBackend
from serving.capture import CapturePolicy
from serving.server import DecodeServer

VOCAB = 64
ENGINE = EngineConfig(depth=4, topk=3, num_draft_tokens=10, cost_aware=False, prompt_lookup=False,
                      suffix_drafting=False, calibration_dir="")  # nothing persisted into the user's cache
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_head(target, seed):
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=VOCAB, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(seed)
    head = Eagle3DraftHead(cfg)
    init_weights(head, std=0.1)
    head.embed_tokens.weight.data.copy_(target.input_embeddings())
    return head.to(target.dtype)


@dataclass
class Stack:
    target: object
    registry: HeadRegistry

    def engine(self, version="v1", config=ENGINE):
        head = self.registry.load(version, self.target) if version != "none" else None
        return SpeculativeEngine(self.target, head, config, head_version=None if version == "none" else version)

    def backend(self, version="v1", max_prompt_tokens=40):
        return ReferenceBackend(self.engine(version), self.registry, max_prompt_tokens)

    def server(self, version="v1", name="replica-0", capture=None, writer=None):
        return DecodeServer(self.backend(version), capture or CapturePolicy(enabled=False), writer, name=name)

    def plain_text(self, messages, max_tokens):
        """Plain greedy decoding of the same prompt, as the gateway would return it."""
        backend = ReferenceBackend(self.engine("none"), None)
        from serving.messages import DecodeRequest

        server = DecodeServer(backend)
        return server.generate(DecodeRequest(request_id="plain", messages=tuple(messages), max_tokens=max_tokens))


def make_target():
    """The same tiny target in every process (seeded). Ray actors build it themselves: a transformers 5
    model unpickled in a fresh process returns no hidden states until a model class is constructed."""
    target = tiny_target(seed=3, dtype=torch.float64, vocab_size=VOCAB, num_layers=6, initializer_range=0.15,
                         max_position_embeddings=512)
    return replace(target, tokenizer=word_tokenizer())


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    target = make_target()
    root = Path(tmp_path_factory.mktemp("registry"))
    registry = HeadRegistry.create(root)
    for version, seed in (("v1", 11), ("v2", 12)):
        registry.register(tiny_head(target, seed), HeadMeta.new(version, target.name, target.fingerprint),
                          dtype=torch.float32)
    return Stack(target, registry)
