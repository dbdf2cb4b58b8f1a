"""dspark_runtime.decoding.grammar: response_format JSON / JSON-schema constraints through llguidance, on the tiny
byte-level BPE tokenizer of the test models (every byte is a token; specials 0..2, EOS <|im_end|> = 2 and
<|endoftext|> = 0) with a model vocabulary wider than the tokenizer."""
import json
import sys

import numpy as np
import pytest

pytest.importorskip("llguidance")

from dspark_runtime.decoding.grammar import Grammar, GrammarCompiler, GrammarError  # noqa: E402
from dspark_runtime.errors import DSparkError, InputError  # noqa: E402
from tests.fixtures.tiny_models import make_tokenizer  # noqa: E402

VOCAB = 400  # the model's logits width; the tokenizer has 320 ids
EOS = [2, 0]

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "status": {"enum": ["open", "closed", "stale"]},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    },
    "required": ["id", "status", "owner", "tags", "score"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    assert make_tokenizer(d) == 320
    return d


@pytest.fixture(scope="module")
def compiler(tok_dir):
    return GrammarCompiler(tok_dir / "tokenizer.json", VOCAB, EOS)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def _walk(g: Grammar, limit: int = 400):
    """Greedy walk to the end of the grammar: the forced tokens when there are some, else the lowest allowed id.
    Returns (tokens, the allowed() mask before each token)."""
    out, masks = [], []
    while not g.finished:
        assert len(out) < limit, "the walk does not end"
        a = g.allowed()
        assert not a[EOS].any(), "EOS is allowed before the grammar is finished"
        f = g.forced(4)
        t = f[0] if f else int(np.flatnonzero(a)[0])
        assert g.allows(t) and a[t]
        masks.append(a)
        g.consume([t])
        out.append(t)
    return out, masks


def _check_ticket(doc):
    """SCHEMA by hand (and by jsonschema where installed)."""
    assert set(doc) == {"id", "status", "owner", "tags", "score"}
    assert isinstance(doc["id"], int) and 1 <= doc["id"] <= 999
    assert doc["status"] in ("open", "closed", "stale")
    assert set(doc["owner"]) == {"name", "admin"} and isinstance(doc["owner"]["admin"], bool)
    assert isinstance(doc["owner"]["name"], str) and 1 <= len(doc["owner"]["name"]) <= 6
    assert 1 <= len(doc["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 3 for t in doc["tags"])
    assert doc["score"] is None or (isinstance(doc["score"], int) and 0 <= doc["score"] <= 5)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(doc, SCHEMA)


def test_greedy_walk_produces_json_that_follows_the_schema(compiler, hf_tok):
    g = compiler.compile(RF)
    assert g.vocab_size == VOCAB and g.allowed().shape == (VOCAB,) and g.allowed().dtype == bool
    toks, masks = _walk(g)
    text = hf_tok.decode(toks)
    _check_ticket(json.loads(text))
    # finished: exactly the EOS ids are allowed, nothing is forced
    assert np.array_equal(np.flatnonzero(g.allowed()), sorted(EOS)) and g.forced(8) == []
    assert g.masks_computed == len(masks) + 1 and g.mask_seconds > 0 and g.tokens_consumed == len(toks)


def test_forced_tokens_are_allowed_and_consumable(compiler):
    g = compiler.compile(RF)
    f = g.forced(100)
    assert f and g.allows(f[0]) and g.forced(1) == f[:1] and g.forced(0) == []
    seen = 0
    while not g.finished:
        f = g.forced(16)
        if f:
            seen += 1
            assert g.allows(f[0])
            h = g.fork()
            h.consume(f)  # the whole run is accepted in order
            assert h.tokens_consumed == len(f)
        g.consume([f[0] if f else int(np.flatnonzero(g.allowed())[0])])
    assert seen >= 5  # keys, enum tails, closing brackets


def test_rollback_restores_the_mask_exactly(compiler):
    g = compiler.compile(RF)
    toks, masks = _walk(g)
    n = len(toks)
    for k in (1, 3, 7, n // 2):
        g.rollback(k)
        assert not g.finished and np.array_equal(g.allowed(), masks[n - k])
        g.consume(toks[n - k:])  # the same tokens lead back to the end
        assert g.finished
    g.rollback(0)
    assert g.finished
    g.rollback(n)
    assert np.array_equal(g.allowed(), masks[0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens, 0 consumed"):
        g.rollback(1)
    g.consume(toks)  # a block consumed at once, as the loop does with a draft
    assert g.finished


def test_eos_only_where_the_grammar_may_end(compiler, hf_tok):
    g = compiler.compile(RF)
    _walk(g)  # asserts EOS is never allowed before the end
    assert g.allows(2) and g.allows(0) and not g.allows(5)
    g.consume([2])  # an accepted EOS (the loop may consume one in a draft block) ...
    assert g.finished and g.allows(2)
    g.consume([0, 2])
    g.rollback(3)  # ... rolls back like any token
    assert g.finished and g.tokens_consumed >= 3
    g.rollback(1)
    assert not g.finished and not g.allowed()[EOS].any()
    with pytest.raises(DSparkError, match="token 7 .position 1"):
        g.fork().consume([int(np.flatnonzero(g.allowed())[0]), 7])  # nothing but EOS after the end
    # a grammar that may end or go on (an integer): EOS is allowed beside the digits
    n = compiler.compile({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    n.consume(hf_tok.encode("7").ids)
    a = n.allowed()
    assert a[EOS].all() and a[hf_tok.token_to_id("3")] and not n.finished
    n.consume([2])
    assert n.finished
    n.rollback(1)
    assert not n.finished and n.allowed()[hf_tok.token_to_id("3")]


def test_json_object_accepts_any_object_and_nothing_else(compiler, hf_tok):
    doc = '{"a": [1, 2.5, {"b": null}], "c": "x\\ny", "d": true}'
    toks = hf_tok.encode(doc).ids
    assert hf_tok.decode(toks) == doc
    g = compiler.compile({"type": "json_object"})
    assert not g.allows(hf_tok.token_to_id("[")) and not g.allows(hf_tok.token_to_id("1"))
    for t in toks:
        assert g.allows(t) and not g.finished, hf_tok.id_to_token(t)
        g.consume([t])
    assert g.finished and g.tokens_consumed == len(toks)


def test_ids_the_tokenizer_lacks_are_never_allowed(compiler, hf_tok):
    g = compiler.compile({"type": "json_object"})
    g.consume(hf_tok.encode('{"k": "').ids)  # inside a free string: nearly every token is allowed
    a = g.allowed()
    assert a[3:320].sum() > 200 and not a[320:].any() and not g.allows(350) and not g.allows(VOCAB)
    with pytest.raises(DSparkError, match="token 350"):
        g.consume([350])
    with pytest.raises(DSparkError, match="token 400 is outside"):
        g.consume([400])
    assert np.array_equal(g.allowed(), a)  # refused tokens leave the state as it was
    assert compiler.tokenizer_size == 320


def test_placeholder_vocabulary_rows_are_never_allowed(tok_dir, tmp_path, hf_tok):
    """A tokenizer.json padded to the model's width with literal vocabulary entries (as the Qwen2.5 engines'
    [PAD151665]..[PAD151935]): llguidance alone would allow them inside strings; the compiler drops them."""
    import llguidance
    import llguidance.numpy as lln

    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    tok["model"]["vocab"].update({f"[PAD{i}]": i for i in range(320, VOCAB)})
    text = json.dumps(tok)
    (tmp_path / "tokenizer.json").write_text(text)
    prefix = hf_tok.encode('{"k": "').ids

    plain = llguidance.LLMatcher(llguidance.LLTokenizer(text, n_vocab=VOCAB, eos_token=EOS),
                                 llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}), log_level=0)
    assert plain.consume_tokens(prefix)
    bits = lln.allocate_token_bitmask(1, VOCAB)
    lln.fill_next_token_bitmask(plain, bits)
    raw = np.unpackbits(bits.view(np.uint8), count=VOCAB, bitorder="little").astype(bool)
    assert raw[320:].all()  # the danger the compiler removes

    c = GrammarCompiler(tmp_path / "tokenizer.json", VOCAB, EOS)
    assert c.tokenizer_size == 320
    g = c.compile({"type": "json_object"})
    g.consume(prefix)
    assert not g.allowed()[320:].any() and np.array_equal(g.allowed()[:320], raw[:320])


def test_mask_logits_in_place(compiler, hf_tok):
    rng = np.random.default_rng(0)
    at_start, in_string = compiler.compile(RF), compiler.compile({"type": "json_object"})
    in_string.consume(hf_tok.encode('{"k": "').ids)
    for g in (at_start, in_string):  # few allowed / most allowed (both ways of masking)
        row = rng.standard_normal(VOCAB).astype(np.float32)
        x = row.copy()
        g.mask_logits(x)
        a = g.allowed()
        assert np.array_equal(np.isfinite(x), a) and np.array_equal(x[a], row[a]) and np.all(x[~a] == -np.inf)
    assert at_start.allowed().sum() * 8 < VOCAB < in_string.allowed().sum() * 8
    with pytest.raises(ValueError, match=r"float \[400\] row"):
        g.mask_logits(np.zeros(VOCAB - 1, np.float32))


def test_fork_and_compile_give_independent_states(compiler):
    hits = compiler.cache_hits
    a = compiler.compile(RF)
    reordered = {"type": "json_schema", "json_schema": {"schema": dict(reversed(list(SCHEMA.items()))), "name": "x"}}
    b = compiler.compile(reordered)  # the same schema, keys in another order: the cached matcher
    assert compiler.cache_hits == hits + 2
    start = a.allowed().copy()
    toks, _ = _walk(a)
    assert np.array_equal(b.allowed(), start)
    mid = len(toks) // 2
    b.consume(toks[:mid])
    f = b.fork()
    b.consume(toks[mid:])
    assert b.finished and not f.finished and f.masks_computed == 0
    f.rollback(mid)  # a fork keeps the history before it
    assert np.array_equal(f.allowed(), start)


def test_consume_is_all_or_nothing(compiler, hf_tok):
    g = compiler.compile(RF)
    ok = g.forced(2)
    before = g.allowed()
    bad = hf_tok.token_to_id("[")
    with pytest.raises(DSparkError, match=rf"token {bad} \(position {len(ok)} of"):
        g.consume(ok + [bad])
    assert np.array_equal(g.allowed(), before) and g.tokens_consumed == 0
    g.consume(ok)
    assert g.tokens_consumed == len(ok)


@pytest.mark.parametrize("rf, field", [
    ({"type": "xml"}, r"response_format\.type: 'xml' is not supported"),
    ({"type": "text"}, r"response_format\.type: 'text' needs no grammar"),
    ({"type": "json_schema"}, r"response_format\.json_schema: missing"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, r"response_format\.json_schema\.schema: missing"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
     r"response_format\.json_schema\.schema: must be a JSON Schema object, got list"),
    ({"type": "json_schema", "json_schema": "x"}, r"response_format\.json_schema: must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}},
     r"response_format\.json_schema\.schema: llguidance refuses the schema: Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/$defs/nope"}}},
     r"response_format\.json_schema\.schema: llguidance refuses the schema: .*nope"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "(("}}},
     r"response_format\.json_schema\.schema: llguidance refuses the schema: regex parse error"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "number", "minimum": float("nan")}}},
     r"response_format\.json_schema\.schema: not plain JSON"),
    ({"type": "json_object", "schema": {}}, r"response_format: unknown key\(s\) \['schema'\]"),
    ({"type": "json_object", "json_schema": {}}, r"response_format\.json_schema: only with type 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
     r"response_format\.json_schema\.strict: must be true, false or null"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "format": 1}},
     r"response_format\.json_schema: unknown key\(s\) \['format'\]"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, r"response_format\.json_schema\.name"),
    ("json_object", r"response_format must be an object"),
])
def test_bad_response_format_names_the_field(compiler, rf, field):
    with pytest.raises(GrammarError, match=field) as e:
        compiler.compile(rf)
    assert isinstance(e.value, InputError) and "\n" not in str(e.value)


def test_compiler_arguments_and_missing_llguidance(tok_dir, monkeypatch):
    path = tok_dir / "tokenizer.json"
    with pytest.raises(InputError, match="vocab size too small"):
        GrammarCompiler(path, 100, EOS)
    with pytest.raises(InputError, match="eos_ids"):
        GrammarCompiler(path, VOCAB, [])
    with pytest.raises(InputError, match="not found"):
        GrammarCompiler(tok_dir / "nope.json", VOCAB, EOS)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(InputError, match=r"pip install 'dspark\[grammar\]'"):
        GrammarCompiler(path, VOCAB, EOS)
