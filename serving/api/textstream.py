"""One completion's text as its tokens arrive: incremental detokenisation and stop strings.

    s = TextStream(tokenizer, stop=["\\n\\n"])
    delta = s.add(new_token_ids)        # text safe to send now ("" while a character or a stop string is incomplete)
    s.stopped                           # a stop string appeared: the text ends before it; abort the request
    tail = s.finish()                   # what was held back, at the end

A byte-level (or BPE) token can end mid-character: the text is only sent once
it no longer ends in U+FFFD (vLLM's prefix/read offsets, so each token is
decoded a bounded number of times). The last len(longest stop) - 1 characters
are held back, so a stop string split over tokens is never half sent.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""                  # decoded so far (after a stop string: cut before it)
        self.sent = 0                   # characters of text already returned
        self.stopped: str | None = None  # the stop string that ended it
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        for t in token_ids:
            if self.stopped is not None:
                break
            self.token_ids.append(t)
            self._decode_new()
        return self._releasable(final=self.stopped is not None)

    def finish(self) -> str:
        return self._releasable(final=True)

    def _decode_new(self) -> None:
        ids = self.token_ids
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            start = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        if not self.stop:
            return
        # A stop string may begin up to len(s) - 1 characters before the new text.
        search_from = max(0, start - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            i, s = min(hits)
            self.text, self.stopped = self.text[:i], s

    def _releasable(self, final: bool) -> str:
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        if final and self.stopped is None and self._read_offset < len(self.token_ids):
            # Tokens that never completed a character: send them as they decode (U+FFFD and all).
            full = self.tokenizer.decode(self.token_ids[self._prefix_offset:])
            prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset])
            start = len(self.text)
            self.text += full[len(prefix):]
            self._read_offset = len(self.token_ids)
            self._check_stop(start)
            end = len(self.text)
        delta = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta
