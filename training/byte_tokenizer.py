"""The tokenizer files of a byte-level checkpoint (`glm5-lab train`: token =
byte, id = the byte's value), so that transformers' AutoTokenizer and the
serving engine's tokenizer loading find one beside the weights.

    write_byte_tokenizer(checkpoint_dir)     # tokenizer.json + tokenizer_config.json

A byte-level BPE without merges: GPT-2's byte-to-character table maps every
byte to one printable character, whose id is the byte itself, so any text
encodes to its UTF-8 bytes and any id sequence decodes back (the ids from
256 up that the vocabulary may hold beyond the bytes are never produced).
"""
from __future__ import annotations

import json
import os


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: byte b -> a printable character, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_byte_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
                   "clean_up_tokenization_spaces": False}, f, indent=1)
