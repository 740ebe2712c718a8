"""vLLM's sampling and output fields, served (before, they were named back as ignored):
`allowed_token_ids` and `bad_words` (greedy answers token for token against transformers with
vLLM's rules applied by hand, and different from the plain answer, so the field did something),
`truncate_prompt_tokens`, `return_token_ids` (whole and streamed: every token's id, the held
back ones too), `return_tokens_as_token_ids`, `cache_salt` (a cached prefix is shared only
within its salt), `priority` (only 0: a 400 otherwise, as vLLM
without priority scheduling) and `documents` (named back: this model's template never reads
them). Against the package's live `tandem serve`, prompts on both paths (local, remote)."""

from __future__ import annotations

from urllib.parse import unquote

import openai
import pytest

from .reference import Processing
from .test_openai_chat import USER

PROMPTS = pytest.mark.parametrize(
    "prompt",
    [
        "The weather today",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "walked down to the harbour every morning before the sun came up",
    ],
    ids=["local", "remote"],
)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _extra(**fields) -> dict:
    return {"extra_body": {"ignore_eos": True, **fields}}


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def vllm_bad_words(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's SamplingParams.update_from_tokenizer, written out: the word alone, and after a
    space where that makes another first token of the same length."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = tuple(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        out.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


@PROMPTS
def test_allowed_token_ids_equal_the_masked_reference(client, model_name, reference, prompt):
    ids = reference.encode(prompt)
    plain = [s.token for s in reference.greedy(ids, 8)]
    allowed = tuple(t for t in range(3, 200, 7) if t not in plain)  # plain's answer is out
    answer = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=8, temperature=0,
        **_extra(allowed_token_ids=list(allowed), return_token_ids=True),
    )  # fmt: skip
    got = _ids(answer.choices[0])
    assert got == [s.token for s in reference.greedy(ids, 8, Processing(allowed=allowed))]
    assert set(got) <= set(allowed)


@PROMPTS
def test_bad_words_follow_vllm_and_change_the_answer(client, model_name, reference, prompt):
    ids = reference.encode(prompt)
    plain = [s.token for s in reference.greedy(ids, 12)]
    # A word of one token the plain answer writes, and a pair of tokens it writes later.
    words = [reference.token_str(plain[2]), reference.text(plain[6:8], False)]
    words = [w for w in words if w.strip()]
    bad = vllm_bad_words(reference.tokenizer, words)
    want = [s.token for s in reference.greedy(ids, 12, Processing(bad_words=bad))]
    answer = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=12, temperature=0,
        **_extra(bad_words=words, return_token_ids=True),
    )  # fmt: skip
    assert _ids(answer.choices[0]) == want
    assert want != plain  # the words were in the plain answer: banning them changed it


@PROMPTS
def test_return_token_ids_whole_answers(client, model_name, reference, prompt):
    ids = reference.encode(prompt)
    answer = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, **GREEDY | _extra(return_token_ids=True)
    )
    (choice,) = answer.choices
    assert choice.model_extra["prompt_token_ids"] == ids
    assert _ids(choice) == [s.token for s in reference.greedy(ids, 6)]
    assert reference.text(_ids(choice)) == choice.text

    chat = client.chat.completions.create(
        model=model_name, messages=USER, max_tokens=5, n=2, temperature=1.0, seed=4,
        **_extra(return_token_ids=True),
    )  # fmt: skip
    assert chat.model_extra["prompt_token_ids"] == reference.chat_ids(USER)
    for c in chat.choices:
        assert len(_ids(c)) == 5 and reference.text(_ids(c)) == c.message.content
    assert chat.usage.completion_tokens == 10


@PROMPTS
def test_return_token_ids_streamed_holds_every_token(client, model_name, reference, prompt):
    ids = reference.encode(prompt)
    whole = [s.token for s in reference.greedy(ids, 10)]
    # A stop string made of the answer's last token holds its text back: its id still comes.
    stream = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=10, stream=True,
        **GREEDY | _extra(return_token_ids=True),
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.model_extra["token_ids"]] == whole

    stream = client.chat.completions.create(
        model=model_name, messages=USER, max_tokens=6, stream=True, n=2, temperature=1.0,
        seed=5, **_extra(return_token_ids=True),
    )  # fmt: skip
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    roles = 0
    for chunk in stream:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles += 1
            assert chunk.model_extra["prompt_token_ids"] == reference.chat_ids(USER)
        per_choice[choice.index] += choice.model_extra.get("token_ids") or []
    assert roles == 2 and [len(v) for v in per_choice.values()] == [6, 6]


def test_a_token_held_by_a_stop_string_still_shows_its_id(client, model_name, reference):
    prompt = "The weather today"
    ids = reference.encode(prompt)
    steps = reference.greedy(ids, 8)
    stop = reference.text([s.token for s in steps[3:5]])
    stream = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=8, stream=True, stop=[stop],
        **GREEDY | _extra(return_token_ids=True),
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream]
    got = [t for c in chunks for t in c.model_extra["token_ids"]]
    assert chunks[-1].finish_reason == "stop" and stop not in "".join(c.text for c in chunks)
    # The tokens up to the one that completes the stop string all came, though the text of
    # the stop string's tokens never did (held back, then cut).
    tokens = [s.token for s in steps]
    completes = next(k for k in range(1, 9) if stop in reference.text(tokens[:k]))
    assert len(got) >= completes and got == tokens[: len(got)]


def test_return_tokens_as_token_ids_names_every_logprob_token(client, model_name, reference):
    answer = client.completions.create(
        model=model_name, prompt="The weather today", max_tokens=4, logprobs=3,
        **GREEDY | _extra(return_tokens_as_token_ids=True, return_token_ids=True),
    )  # fmt: skip
    (choice,) = answer.choices
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in _ids(choice)]
    assert all(all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=model_name, messages=USER, max_tokens=3, logprobs=True, top_logprobs=2,
        **GREEDY | _extra(return_tokens_as_token_ids=True, return_token_ids=True),
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in _ids(chat.choices[0])]
    assert all(bytes(c.bytes).decode() == c.token for c in content)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, model_name, reference):
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman"
    ids = reference.encode(prompt)
    answer = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=5, echo=True,
        **GREEDY | _extra(truncate_prompt_tokens=10, return_token_ids=True),
    )  # fmt: skip
    (choice,) = answer.choices
    assert choice.model_extra["prompt_token_ids"] == ids[-10:]
    assert answer.usage.prompt_tokens == 10
    assert _ids(choice) == [s.token for s in reference.greedy(ids[-10:], 5)]
    assert choice.text.startswith(reference.text(ids[-10:], False))


def test_truncation_serves_a_prompt_longer_than_the_window(client, model_name):
    window = client.models.list().data[0].model_extra["max_model_len"]
    too_long = [5 + i % 500 for i in range(window + 40)]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=too_long, max_tokens=4)
    answer = client.completions.create(
        model=model_name, prompt=too_long, max_tokens=4,
        **_extra(truncate_prompt_tokens=window - 4),
    )  # fmt: skip
    assert answer.usage.prompt_tokens == window - 4 and answer.usage.completion_tokens == 4


def test_priority_other_than_zero_is_refused(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model_name, prompt="hi", max_tokens=2, extra_body={"priority": 2}
        )
    assert e.value.body["param"] == "priority" and "first served" in e.value.body["message"]
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt="hi", max_tokens=2, extra_body={"priority": 0}
    )
    assert raw.headers.get("X-Tandem-Ignored-Fields") is None


def test_documents_are_named_when_the_template_never_reads_them(client, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=USER, max_tokens=2,
        extra_body={"documents": [{"title": "t", "text": "Paris is sunny."}]},
    )  # fmt: skip
    assert unquote(raw.headers["X-Tandem-Ignored-Fields"]).split(",") == ["documents"]


@pytest.mark.parametrize("length", [20, 60], ids=["local", "remote"])
def test_cache_salt_keeps_cached_prefixes_apart(client, model_name, length):
    """vLLM's cache_salt: a prompt cached under one salt is a prefix-cache hit for that salt
    only (not for another salt, not unsalted), on the worker that prefills either path."""
    prompt = [(7919 * (i + length) + 13) % 1000 + 3 for i in range(length)]  # seen nowhere else

    def cached(salt: str | None) -> int:
        answer = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=2,
            extra_body={"cache_salt": salt} if salt else {},
        )  # fmt: skip
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 16  # its whole blocks, from the cache
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-b") >= 16 and cached(None) >= 16


def test_return_token_ids_for_a_batch_of_prompts(client, model_name, reference):
    """Each choice carries its own prompt's ids (index order: prompt-major, then n)."""
    prompts = ["The weather today", "Once upon a time, in a small village by the sea"]
    answer = client.completions.create(
        model=model_name, prompt=prompts, max_tokens=3, n=2, temperature=1.0, seed=9,
        **_extra(return_token_ids=True),
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for c in answer.choices:
        assert c.model_extra["prompt_token_ids"] == reference.encode(prompts[c.index // 2])
        assert len(_ids(c)) == 3 and reference.text(_ids(c)) == c.text


def test_bad_words_hold_in_every_sampled_streamed_choice(client, model_name, reference):
    """Three sampled choices, streamed: the token the same seed samples most often without
    the ban (a one-token word) never comes with it."""

    def sampled(**fields) -> dict[int, list[int]]:
        stream = client.completions.create(
            model=model_name, prompt="The weather today", max_tokens=12, n=3, temperature=1.5,
            seed=2, stream=True, **_extra(return_token_ids=True, **fields),
        )  # fmt: skip
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for chunk in stream:
            seen[chunk.choices[0].index] += chunk.choices[0].model_extra["token_ids"]
        return seen

    def bans(t: int) -> bool:  # the token's text as a bad word masks the token itself
        text = reference.token_str(t)
        return bool(text.strip()) and (t,) in vllm_bad_words(reference.tokenizer, [text])

    free = [t for v in sampled().values() for t in v]
    token = max((t for t in set(free) if bans(t)), key=free.count)
    word = reference.token_str(token)
    banned = {w[0] for w in vllm_bad_words(reference.tokenizer, [word]) if len(w) == 1}
    held = sampled(bad_words=[word])
    assert all(len(v) == 12 and not banned & set(v) for v in held.values())
