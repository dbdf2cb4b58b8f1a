"""`dspark serve` with what production clients send beyond text, through the official openai client, on a tiny fp32
engine in the scatter layout speculating with its DSpark drafter: logprobs (chat, completions, streamed) equal to
target-only decoding's, ``n`` choices reproducible from the seed, penalties and JSON-schema output identical to
target-only decoding, their /metrics counters, and the 400s of bad formats."""
import json

import pytest

pytest.importorskip("torch")  # the tiny engine is exported from torch models
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "tiny"  # the engine's name (conftest.py tiny_scatter_engine_dir)
MESSAGES = [{"role": "user", "content": "Write a function that sorts a list."}]
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb", "ccc"]}},
     "required": ["ok", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}, "maxItems": 3}},
     "required": ["xs"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"flag": {"type": "boolean"}},
                                                "required": ["flag"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(tiny_scatter_engine_dir):
    from dspark_runtime import Engine

    return Engine.load(tiny_scatter_engine_dir, threads=1)


@pytest.fixture(scope="module")
def server(engine):
    from tests.runtime.serving.test_server import _start

    app, srv = _start(engine, draft="dspark", draft_length=3, max_batch=4, max_queue=8)
    srv.app = app
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_logprobs_equal_target_only_streamed_or_not(engine, client):
    ref = engine.generate(MESSAGES, max_new_tokens=16, draft=None, logprobs=3)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    tok = engine.tokenizer
    for c, e in zip(content, ref.logprobs):
        assert bytes(c.bytes) == tok.token_bytes(e.token)
        assert abs(c.logprob - e.logprob) < 1e-4  # unpadded fp32: a row in a block differs by ~1e-5
        assert [bytes(t.bytes) for t in c.top_logprobs] == [tok.token_bytes(t) for t, _ in e.top]
    streamed = []
    for ch in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                             logprobs=True, top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert r.choices[0].message.content == ref.text


def test_completion_logprobs(engine, client):
    ref = engine.generate("def add(a, b):", max_new_tokens=12, draft=None, raw=True, logprobs=2)
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ref.token_ids) and len(lp.top_logprobs[0]) <= 2
    assert max(abs(a - e.logprob) for a, e in zip(lp.token_logprobs, ref.logprobs)) < 1e-4
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_n_choices_are_reproducible_from_the_seed(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.9, n=3, seed=1234)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens > 12 and a.usage.prompt_tokens == b.usage.prompt_tokens
    streamed = {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_penalties_equal_target_only(engine, client):
    pen = dict(presence_penalty=1.0, frequency_penalty=0.5)
    ref = engine.generate(MESSAGES, max_new_tokens=24, draft=None, repetition_penalty=8.0, **pen)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                       extra_body={"repetition_penalty": 8.0}, **pen)
    assert r.choices[0].message.content == ref.text
    assert ref.text != engine.generate(MESSAGES, max_new_tokens=24, draft=None).text


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "array", "nested"])
def test_json_schema_output_equals_target_only(engine, client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    ref = engine.generate(MESSAGES, max_new_tokens=200, draft=None, response_format=fmt)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == "stop"
    assert set(json.loads(ref.text)) == set(schema["required"])
    assert ref.stats.forced_tokens > 0  # separators, keys and enum tails are forced


def test_metrics_and_bad_formats(server, client):
    fmt = {"type": "json_object"}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, response_format=fmt)
    text = httpx.get(server.url + "/metrics").text
    counters = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert counters["dspark_constrained_requests_total"] >= 1
    assert "dspark_forced_tokens_total" in counters and "dspark_masked_draft_tokens_total" in counters
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "required": 5}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, response_format=bad)
    assert e.value.body["param"] == "response_format" and "schema" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
