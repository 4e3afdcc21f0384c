"""A GLM-style tokenizer for the lab's random checkpoints, so llama.cpp's
converter (which reads a Hugging Face tokenizer next to config.json) accepts them.

Layout: tokenizer.json (byte-level BPE over GPT-2's byte-to-unicode alphabet, as
GLM's tokenizer: the 256 byte tokens, a few merges, since llama.cpp refuses a BPE
vocabulary without any) followed by GLM's special tokens, plus tokenizer_config.json. The comparisons feed token ids directly, so
the tokenizer only has to be valid and carry the special tokens the converter
looks up by name ([gMASK], <|user|>, <|endoftext|>, <|observation|>).
"""
from __future__ import annotations

import json
import os

GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
    "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>",
    "<|end_of_transcription|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "/nothink",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|begin_of_box|>", "<|end_of_box|>",
    "<|image|>", "<|video|>",
)
N_BYTE_TOKENS = 256
MERGES = (("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġt", "he"))


def tokenizer_size() -> int:
    return N_BYTE_TOKENS + len(MERGES) + len(GLM_SPECIAL_TOKENS)


def write_glm_tokenizer(path: str, vocab_size: int) -> dict[str, int]:
    """Writes tokenizer.json + tokenizer_config.json into the checkpoint folder `path`;
    returns the special tokens' ids. vocab_size: the checkpoint's, at least tokenizer_size()."""
    if not os.path.isdir(path):
        raise ValueError(f"path must be an existing checkpoint folder, got {path!r}")
    if not isinstance(vocab_size, int) or vocab_size < tokenizer_size():
        raise ValueError(f"vocab_size must be an int >= {tokenizer_size()} (the tokenizer's size), got {vocab_size!r}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()          # the 256 byte symbols, in no particular order
    byte_symbols = sorted(alphabet, key=_byte_of)
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(GLM_SPECIAL_TOKENS))
    tok.save(os.path.join(path, "tokenizer.json"))
    specials = {t: tok.token_to_id(t) for t in GLM_SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for t, i in specials.items()},
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return specials


def _byte_of(symbol: str) -> int:
    """GPT-2's byte-to-unicode map, inverted: printable bytes stand for themselves,
    the others were moved to 256 + k in order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cp = ord(symbol)
    if cp in printable:
        return cp
    others = [b for b in range(256) if b not in printable]
    return others[cp - 256]
