"""Chat rendering and text streaming, without a server: the system prompt
re-injected before every Nth user turn; the oldest turns dropped (system
prompt kept) when the chat outgrows the context; a checkpoint's tokenizer.json
and chat template render as transformers' apply_chat_template does; stop
strings and multi-byte characters split over tokens; `glm5-lab serve`'s
arguments build a working app."""
import json

import httpx
import pytest

from serving.api.chat import ChatRenderer, _split_turns, normalise_messages
from serving.api.textstream import TextStream
from serving.api.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

SYS = "You are a careful assistant."


def _chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": SYS}]
    for i in range(1, turns + 1):
        messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return messages


def test_twelve_turns_reinject_the_system_prompt_before_turns_5_and_10():
    r = ChatRenderer(ByteTokenizer(512), reinject_system_every=5).render(_chat(12), max_prompt_tokens=10_000)
    assert r.reinjected_before == [5, 10] and r.dropped_turns == 0
    block = f"<|system|>\n{SYS}"
    assert r.text.startswith(f"[gMASK]<sop>{block}<|user|>\nquestion 1")
    assert r.text.count(block) == 3
    for n in (5, 10):
        assert f"answer {n - 1}{block}<|user|>\nquestion {n}<|assistant|>" in r.text
    assert r.text.endswith("<|user|>\nquestion 12<|assistant|>\nanswer 12<|assistant|>\n")
    assert r.token_ids == ByteTokenizer(512).encode(r.text)
    never = ChatRenderer(ByteTokenizer(512), reinject_system_every=0).render(_chat(12), max_prompt_tokens=10_000)
    assert never.text.count(block) == 1 and never.reinjected_before == []


def test_a_chat_longer_than_the_context_drops_oldest_turns_and_keeps_the_system_prompt():
    renderer = ChatRenderer(ByteTokenizer(512), reinject_system_every=5)
    full = renderer.render(_chat(30), max_prompt_tokens=100_000)
    budget = len(full.token_ids) // 3
    r = renderer.render(_chat(30), max_prompt_tokens=budget)
    assert len(r.token_ids) <= budget and r.dropped_turns > 0
    assert r.text.startswith(f"[gMASK]<sop><|system|>\n{SYS}<|user|>\nquestion {r.dropped_turns + 1}<|")
    assert "question 30" in r.text and f"question {r.dropped_turns}<" not in r.text
    # the fewest turns dropped: one turn fewer would not fit
    msgs = normalise_messages(_chat(30))
    one_fewer = renderer._render(msgs[0], _split_turns(msgs[1:]), r.dropped_turns - 1, True)
    assert len(one_fewer.token_ids) > budget
    # turn numbers stay the client's: the copies before 25 and 30 are still there
    assert [n for n in r.reinjected_before if n > r.dropped_turns + 1] == [n for n in (5, 10, 15, 20, 25, 30)
                                                                            if n > r.dropped_turns + 1]
    with pytest.raises(ValueError, match="messages"):
        renderer.render([{"role": "system", "content": SYS}, {"role": "user", "content": "x" * 500}],
                        max_prompt_tokens=100)


def test_bad_messages_name_the_message():
    renderer = ChatRenderer(ByteTokenizer(512))
    with pytest.raises(ValueError, match=r"messages\[1\].role"):
        renderer.render([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], max_prompt_tokens=99)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]"):
        renderer.render([{"role": "user", "content": [{"type": "image_url"}]}], max_prompt_tokens=99)
    with pytest.raises(ValueError, match="reinject_system_every"):
        ChatRenderer(ByteTokenizer(512), reinject_system_every=-1)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("ckpt")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, a careful assistant answers questions"] * 20, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def test_checkpoint_tokenizer_and_template_render_as_transformers(hf_checkpoint):
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(str(hf_checkpoint), vocab_size=1000)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (tok._tok.token_to_id("<|im_end|>"),)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_checkpoint / "tokenizer.json"), eos_token="<|im_end|>")
    ref.chat_template = CHATML
    messages = _chat(3)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = ChatRenderer(tok, reinject_system_every=0).render(messages, max_prompt_tokens=10_000)
    assert r.text == want
    assert r.token_ids == ref(want, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)


def test_text_stream_holds_split_characters_and_stop_strings():
    tok = ByteTokenizer(512)
    ids = tok.encode("né👍 ok STOP after")
    s = TextStream(tok, stop=["STOP"])
    deltas = [s.add([i]) for i in ids]
    assert "".join(deltas) + s.finish() == "né👍 ok "
    assert all("\ufffd" not in d for d in deltas) and s.stopped == "STOP"
    assert "S" not in "".join(deltas)            # the stop string's first letters were never sent
    eos = tok.eos_token_ids[0]
    s = TextStream(tok)
    assert s.add(tok.encode("hi") + [eos]) + s.finish() == "hi"     # special tokens are not text


def test_serve_cli_arguments_build_a_working_app():
    from profiling.cli import build_parser
    from profiling.serve_cmd import build_app
    from server_helpers import running_server

    args = build_parser().parse_args(["serve", "--preset", "tiny", "--kv-cache-memory", "16MiB", "--page-size", "16",
                                      "--max-model-len", "128", "--api-key", "k", "--served-model-name", "tiny-x"])
    app = build_app(args)
    with running_server(app) as srv:
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(srv.url + "/v1/models", headers=headers).json()["data"][0]["max_model_len"] == 128
        r = httpx.post(srv.url + "/v1/chat/completions", headers=headers, timeout=30,
                       json={"model": "tiny-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
