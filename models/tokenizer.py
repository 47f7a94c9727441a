"""Tokenizer (HF `tokenizers`) and the Qwen3 chat format.

One class, `Tokenizer`, wraps either a released model's tokenizer.json (e.g. Qwen3's) or a
byte-level BPE trained here by `train_bpe` (the no-download default). Both carry the Qwen3
special tokens, looked up by string:

    <|endoftext|>  pad_id           <|im_start|> / <|im_end|>  turn delimiters, eos_id = <|im_end|>
    <tool_call> </tool_call>  <tool_response> </tool_response>  <think> </think>

Chat rendering follows Qwen3's chat_template (tokenizer_config.json). For
`render_chat([{"role": "system", "content": S}, {"role": "user", "content": U},
{"role": "assistant", "content": A, "tool_calls": [{"name": N, "arguments": {...}}]},
{"role": "tool", "content": R}], tools=[T1, T2], add_generation_prompt=True)`:

    <|im_start|>system\\n
    S\\n\\n
    # Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n
    You are provided with function signatures within <tools></tools> XML tags:\\n
    <tools>\\n{T1 json}\\n{T2 json}\\n</tools>\\n\\n
    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:\\n<tool_call>\\n
    {"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\nU<|im_end|>\\n
    <|im_start|>assistant\\nA\\n
    <tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\nR\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n

(line breaks above are only for reading; "\\n" marks the real newlines; the sentence
"For each function call ... XML tags:" is one line). JSON is `json.dumps(x,
ensure_ascii=False)`; consecutive tool messages share one user turn; without tools the
system turn is `<|im_start|>system\\nS<|im_end|>\\n`. One deliberate difference from the
HF template: assistant text is rendered verbatim (the HF template strips or injects
`<think>` blocks around the turns after the last user query), because in
token-in-token-out rollouts the tokens the policy generated are the tokens trained on.

Incremental pieces for rollouts, whose concatenation with the generated turns (each ending
in <|im_end|>) is the full rendering without its final "\\n":

    prompt_ids(S, U, tools)   = render_chat([system S, user U], tools, add_generation_prompt)
    tool_response_ids(R)      = "\\n<|im_start|>user\\n<tool_response>\\nR\\n</tool_response>"
                                "<|im_end|>\\n<|im_start|>assistant\\n"
    user_ids(U)               = "\\n<|im_start|>user\\nU<|im_end|>\\n<|im_start|>assistant\\n"

Special-token strings split the text before BPE, and the pre-tokenizer splits at newlines,
so these pieces tokenize exactly as the same spans of the full rendering do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
THINK, THINK_END = "<think>", "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE,
                  TOOL_RESPONSE_END, THINK, THINK_END)

# The Qwen2/Qwen3 pre-tokenizer split: letters with one leading non-letter, single digits,
# punctuation runs, newline runs, other whitespace.
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                 "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
                 "\n<tools>")
_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name "
                 "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _json(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def render_tool_call(call: dict[str, Any]) -> str:
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`; arguments given as a
    string are inserted verbatim, otherwise as JSON."""
    call = call.get("function", call)
    args = call["arguments"]
    args = args if isinstance(args, str) else _json(args)
    return f'{TOOL_CALL}\n{{"name": "{call["name"]}", "arguments": {args}}}\n{TOOL_CALL_END}'


def _system_turn(system: str | None, tools: Sequence[dict] | None) -> str:
    if not tools:
        return "" if system is None else _turn("system", system)
    prefix = "" if system is None else system + "\n\n"
    listed = "".join("\n" + _json(tool) for tool in tools)
    return _turn("system", prefix + _TOOLS_HEADER + listed + _TOOLS_FOOTER)


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None,
                add_generation_prompt: bool = False) -> str:
    """Qwen3 chat text of `messages` (roles system/user/assistant/tool), see module doc."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    out = [_system_turn(system, tools)]
    for i, msg in enumerate(messages):
        role, content = msg["role"], msg.get("content") or ""
        if role in ("user", "system"):
            out.append(_turn(role, content))
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            text = content + "".join(("\n" if content or j else "") + render_tool_call(call)
                                     for j, call in enumerate(calls))
            out.append(_turn("assistant", text))
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n{TOOL_RESPONSE}\n{content}\n{TOOL_RESPONSE_END}")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append(f"{IM_END}\n")
        else:
            raise ValueError(f"message {i} has unknown role {role!r}")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


class Tokenizer:
    """Text <-> ids with the Qwen3 special tokens and chat pieces."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self._tok = tokenizer
        ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
        missing = [token for token, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks the Qwen3 special tokens {missing}")
        self.special_ids: dict[str, int] = ids
        self.eos_id = ids[IM_END]
        self.pad_id = ids[ENDOFTEXT]
        self.im_start_id = ids[IM_START]

    @classmethod
    def from_file(cls, path: str) -> Tokenizer:
        """Loads a tokenizer.json (or a directory holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return cls(tokenizers.Tokenizer.from_file(path))

    def save(self, path: str) -> None:
        """Writes tokenizer.json to `path` (a file, or a directory to create it in)."""
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self._tok.save(path)

    def to_str(self) -> str:
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings inside it become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def chat_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None,
                 add_generation_prompt: bool = False) -> list[int]:
        return self.encode(render_chat(messages, tools, add_generation_prompt))

    def prompt_ids(self, system: str | None, user: str,
                   tools: Sequence[dict] | None = None) -> list[int]:
        """First piece of a rollout: system (+ tools) and user turns, then the assistant header."""
        messages = [{"role": "user", "content": user}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return self.chat_ids(messages, tools, add_generation_prompt=True)

    def tool_response_ids(self, results: str | Sequence[str]) -> list[int]:
        """Piece after an assistant turn that ended in <|im_end|>: tool result(s) as one user
        turn, then the next assistant header."""
        results = [results] if isinstance(results, str) else list(results)
        body = "".join(f"\n{TOOL_RESPONSE}\n{r}\n{TOOL_RESPONSE_END}" for r in results)
        return self.encode(f"\n{IM_START}user{body}{IM_END}\n{IM_START}assistant\n")

    def user_ids(self, text: str) -> list[int]:
        """Piece after an assistant turn that ended in <|im_end|>: a plain user turn, then the
        next assistant header."""
        return self.encode(f"\n{IM_START}user\n{text}{IM_END}\n{IM_START}assistant\n")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on `texts` with the Qwen3 pre-tokenizer and special tokens.

    Deterministic for the same texts and vocab_size. Every byte is in the base alphabet, so
    any string round-trips (no normalizer, unlike Qwen3's NFC). Special tokens take ids
    0..8 in SPECIAL_TOKENS order.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the {len(alphabet)} bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return Tokenizer(tok)
