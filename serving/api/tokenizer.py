"""Text <-> token ids for the server, and the chat template to render.

    tok = load_tokenizer(checkpoint_dir, vocab_size)   # checkpoint_dir None: the byte tokenizer
    ids = tok.encode("hello"); text = tok.decode(ids)

A checkpoint laid out as Hugging Face does gives its own: tokenizer.json
(read with the `tokenizers` library), the chat template from
chat_template.jinja or tokenizer_config.json's "chat_template", and the
end-of-sequence ids from generation_config.json (else the eos_token).
Without tokenizer.json (and for --preset) the lab's byte-level tokenizer
serves: ids 0-255 are the UTF-8 bytes, then GLM's special tokens, and
DEFAULT_CHAT_TEMPLATE (GLM-4's layout) renders chats.
"""
from __future__ import annotations

import json
import os
import re
import sys

# GLM-4's special tokens, in GLM-4's order, from id 256 on.
SPECIAL_TOKENS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                  "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
# As GLM-4's generation_config: a turn ends at end-of-text, or where the model starts the next user / tool turn.
BYTE_EOS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# GLM-4's chat layout: [gMASK]<sop>, then <|role|>\ncontent per message; the
# reply is prompted by <|assistant|>\n. The tool role renders as <|observation|>.
DEFAULT_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% set role = 'observation' if message['role'] == 'tool' else message['role'] %}"
    "<|{{ role }}|>\n{{ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, SPECIAL_TOKENS from 256; ids above those decode
    as <|reserved_N|> (special: skipped by default)."""

    chat_template = DEFAULT_CHAT_TEMPLATE
    bos_token, eos_token = "[gMASK]", "<|endoftext|>"
    name = "byte-level"

    def __init__(self, vocab_size: int):
        need = 256 + len(SPECIAL_TOKENS)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < need:
            raise ValueError(f"vocab_size must be an int >= {need} for the byte-level tokenizer "
                             f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}")
        self.vocab_size = vocab_size
        self._special_id = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
        self.eos_token_ids = tuple(self._special_id[t] for t in BYTE_EOS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in self._split.split(text):
            if piece in self._special_id:
                ids.append(self._special_id[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if not skip_special_tokens:
                out.append(SPECIAL_TOKENS[i - 256] if i - 256 < len(SPECIAL_TOKENS) else f"<|reserved_{i}|>")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes of one token (the chat API's logprobs "bytes")."""
        if 0 <= token_id < 256:
            return [token_id]
        return list(self.decode([token_id], skip_special_tokens=False).encode("utf-8"))


class HFTokenizer:
    """A checkpoint's tokenizer.json through the `tokenizers` library."""

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        self.name = os.path.basename(os.path.normpath(directory))
        self._tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _chat_template(directory, config)
        if self.chat_template is None:
            print(f"[serve] {directory} has no chat template: chats use the default (GLM-4 layout)", file=sys.stderr)
            self.chat_template = DEFAULT_CHAT_TEMPLATE
        eos = _read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
        if eos is None and self.eos_token is not None:
            eos = self._tok.token_to_id(self.eos_token)
        self.eos_token_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.decode([token_id], skip_special_tokens=False).encode("utf-8"))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value):
    """tokenizer_config writes a token as "text" or as {"content": "text", ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(directory: str, config: dict) -> str | None:
    path = os.path.join(directory, "chat_template.jinja")       # transformers >= 4.43 saves it here
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):      # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(checkpoint: str | None, vocab_size: int):
    """The checkpoint's tokenizer when it has tokenizer.json, else the byte-level one."""
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        tok = HFTokenizer(checkpoint)
        if tok.vocab_size > vocab_size:
            print(f"[serve] the tokenizer knows {tok.vocab_size} ids, the model {vocab_size}: "
                  f"prompts holding the extra ids are refused", file=sys.stderr)
        return tok
    return ByteTokenizer(vocab_size)
