"""Tokenizer: byte-level round trips, deterministic training, Qwen3 chat strings and pieces."""

import json
import random

import pytest
import tokenizers

from models.tokenizer import SPECIAL_TOKENS, Tokenizer, render_chat, train_bpe

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Traceback (most recent call last):\n  File \"x.py\", line 3\nValueError: bad\n",
    "Run the tests with `pytest -q` and fix the failing ones. 修复错误 🐛\n",
    '{"name": "bash", "arguments": {"cmd": "ls -la"}}\n',
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_bpe(CORPUS, vocab_size=300)


def _random_text(rng, n):
    ranges = [(0x00, 0x7F), (0x80, 0x7FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
              (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_round_trip_arbitrary_unicode(tok):
    rng = random.Random(0)
    texts = [_random_text(rng, rng.randint(0, 40)) for _ in range(200)]
    texts += ["", "\x00\x01\x1b[31m\t\r\n", "😀👍🏽👨‍👩‍👧", "中文和日本語のテキスト",
              "e\u0301 vs é", " leading  and trailing  ", "<|im_end|>inside<tool_call>text"]
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_training_is_deterministic(tok):
    again = train_bpe(CORPUS, vocab_size=300)
    assert again.to_str() == tok.to_str()
    assert tok.vocab_size == 300


def test_special_tokens(tok, tmp_path):
    assert [tok.encode(s) for s in SPECIAL_TOKENS] == [[i] for i in range(len(SPECIAL_TOKENS))]
    assert tok.eos_id == tok.encode("<|im_end|>")[0]
    assert tok.pad_id == tok.encode("<|endoftext|>")[0]
    tok.save(str(tmp_path))
    loaded = Tokenizer.from_file(str(tmp_path))
    assert loaded.to_str() == tok.to_str()
    assert loaded.special_ids == tok.special_ids


def test_tokenizer_without_special_tokens_is_rejected():
    bare = tokenizers.Tokenizer(tokenizers.models.BPE())
    with pytest.raises(ValueError, match="<\\|im_end\\|>"):
        Tokenizer(bare)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(CORPUS, vocab_size=100)


TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a command",
                                      "parameters": {"type": "object",
                                                     "properties": {"cmd": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish"}},
]
MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in app.py."},
    {"role": "assistant", "content": "Let me look.",
     "tool_calls": [{"name": "bash", "arguments": {"cmd": "cat app.py"}}]},
    {"role": "tool", "content": "print(1/0)"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"function": {"name": "bash",
                                  "arguments": '{"cmd": "sed -i s/0/1/ app.py"}'}}]},
    {"role": "tool", "content": ""},
    {"role": "assistant", "content": "Fixed.", "tool_calls": [{"name": "submit", "arguments": {}}]},
]
EXPECTED = (
    "<|im_start|>system\nYou are a coding agent.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "bash", "description": "Run a command", '
    '"parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}\n'
    '{"type": "function", "function": {"name": "submit", "description": "Finish"}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nFix the bug in app.py.<|im_end|>\n"
    "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
    '{"name": "bash", "arguments": {"cmd": "cat app.py"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nprint(1/0)\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "bash", "arguments": {"cmd": "sed -i s/0/1/ app.py"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nFixed.\n<tool_call>\n"
    '{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>\n'
)


def test_render_chat_matches_qwen3_format():
    assert render_chat(MESSAGES, TOOLS) == EXPECTED
    assert render_chat(MESSAGES[:2], TOOLS, add_generation_prompt=True) == \
        EXPECTED[:EXPECTED.index("<|im_start|>assistant")] + "<|im_start|>assistant\n"


def test_render_chat_without_tools_and_grouped_tool_results():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "tool", "content": "r1"},
                {"role": "tool", "content": "r2"}, {"role": "user", "content": "ünï"}]
    assert render_chat(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nünï<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        render_chat([{"role": "robot", "content": "x"}])


def _assistant_text(message):
    return render_chat([message])[len("<|im_start|>assistant\n"):-len("<|im_end|>\n")]


def test_incremental_pieces_concatenate_to_full_rendering(tok):
    ids = tok.prompt_ids(MESSAGES[0]["content"], MESSAGES[1]["content"], TOOLS)
    for message in MESSAGES[2:]:
        if message["role"] == "assistant":
            # The policy's generation, ending in the eos token it stopped on.
            ids += tok.encode(_assistant_text(message)) + [tok.eos_id]
        else:
            ids += tok.tool_response_ids(message["content"])
    assert tok.decode(ids) == EXPECTED[:-1]
    assert ids == tok.encode(EXPECTED[:-1])
    assert tok.chat_ids(MESSAGES, TOOLS) == ids + tok.encode("\n")


def test_user_and_grouped_tool_pieces(tok):
    head = tok.prompt_ids(None, "task")
    assert tok.decode(head) == "<|im_start|>user\ntask<|im_end|>\n<|im_start|>assistant\n"
    rest = tok.encode("A") + [tok.eos_id] + tok.tool_response_ids(["r1", "r2"]) \
        + tok.encode("B") + [tok.eos_id] + tok.user_ids("no tool call found")
    messages = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "A"},
                {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                {"role": "assistant", "content": "B"},
                {"role": "user", "content": "no tool call found"}]
    assert tok.decode(head + rest) == render_chat(messages, add_generation_prompt=True)


def test_tool_arguments_are_json_with_unicode():
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"name": "write", "arguments": {"text": "héllo \"x\"\n"}}]}
    body = _assistant_text(message)
    call = json.loads(body[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert call == {"name": "write", "arguments": {"text": "héllo \"x\"\n"}}
    assert "héllo" in body
