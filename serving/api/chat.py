"""Chat messages -> the prompt: the template rendered with Jinja as
transformers' apply_chat_template does, system-prompt re-injection, and
dropping the oldest turns when the conversation outgrows the context.

    chat = ChatRenderer(tokenizer, reinject_system_every=5)
    r = chat.render(messages, max_prompt_tokens=4000)
    r.text, r.token_ids, r.dropped_turns, r.reinjected_before

A turn is a user message and the replies after it (assistant, tool) up to the
next user message; turns are numbered 1, 2, ... as the client sent them.
- Re-injection: with N > 0 the (first) system prompt is repeated, as a system
  message, before user turns N, 2N, ... (long dialogues drift from their
  instructions; repeating them is the seed's advice). Numbering follows the
  client's turns, so a turn keeps its copy when older turns are dropped.
- Context: while the rendered prompt is longer than max_prompt_tokens the
  oldest turns are dropped (never the system prompt, never the last turn);
  when even that does not fit, ValueError naming "messages".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class RenderedChat:
    text: str
    token_ids: list[int]
    dropped_turns: int = 0                                       # oldest turns left out to fit the context
    reinjected_before: list[int] = field(default_factory=list)  # user turns (1-based) the system prompt precedes


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """As transformers: sandboxed, trim_blocks + lstrip_blocks, loop controls,
    tojson, raise_exception and strftime_now."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def normalise_messages(messages) -> list[dict]:
    """[{role, content}] with content a str (text parts joined); ValueError naming the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}] must be a text part {{type: text, text: str}} "
                                     f"(this server reads text only)")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


class ChatRenderer:
    def __init__(self, tokenizer, *, reinject_system_every: int = 5, template: str | None = None):
        if isinstance(reinject_system_every, bool) or not isinstance(reinject_system_every, int) \
                or reinject_system_every < 0:
            raise ValueError(f"reinject_system_every must be an int >= 0 (0: never), got {reinject_system_every!r}")
        self.tokenizer = tokenizer
        self.reinject_system_every = reinject_system_every
        self.template = compile_template(template or tokenizer.chat_template)

    def render(self, messages, *, max_prompt_tokens: int, add_generation_prompt: bool = True) -> RenderedChat:
        messages = normalise_messages(messages)
        system = messages[0] if messages[0]["role"] == "system" else None
        turns = _split_turns(messages[1:] if system else messages)
        fits = lambda r: len(r.token_ids) <= max_prompt_tokens      # noqa: E731
        best = self._render(system, turns, 0, add_generation_prompt)
        if fits(best) or len(turns) <= 1:
            if not fits(best):
                raise self._too_long(best, max_prompt_tokens)
            return best
        # Dropping more turns never lengthens the prompt: binary search the fewest to drop.
        lo, hi = 1, len(turns) - 1
        last = self._render(system, turns, hi, add_generation_prompt)
        if not fits(last):
            raise self._too_long(last, max_prompt_tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            r = self._render(system, turns, mid, add_generation_prompt)
            if fits(r):
                hi, last = mid, r
            else:
                lo = mid + 1
        return last                    # rendered with hi == lo turns dropped

    @staticmethod
    def _too_long(r: RenderedChat, limit: int) -> ValueError:
        return ValueError(f"messages: the system prompt and the last turn alone render to {len(r.token_ids)} "
                          f"tokens, more than the {limit} the context leaves for the prompt")

    def _render(self, system, turns, drop: int, add_generation_prompt: bool) -> RenderedChat:
        out = [system] if system else []
        reinjected = []
        n = self.reinject_system_every
        for number, turn in turns[drop:]:
            if system and n and number and number % n == 0 and out and out[-1] is not system:
                out.append(system)
                reinjected.append(number)
            out.extend(turn)
        text = self.template.render(messages=out, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "")
        return RenderedChat(text, self.tokenizer.encode(text, add_special_tokens=False), drop, reinjected)


def _split_turns(messages: list[dict]) -> list[tuple[int, list[dict]]]:
    """[(user turn number, messages)]: a new turn at each user message; replies
    before the first user message form turn 0."""
    turns: list[tuple[int, list[dict]]] = []
    number = 0
    for m in messages:
        if m["role"] == "user" or not turns:
            if m["role"] == "user":
                number += 1
            turns.append((number, []))
        turns[-1][1].append(m)
    return turns
