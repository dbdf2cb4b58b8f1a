"""End to end on tiny random models: exactness of speculative decoding, KV rollback, sampling."""
import numpy as np
import pytest

from dspark_runtime.errors import InputError

pytest.importorskip("torch")

PROMPTS = ["def add(a, b):", "Write a function that sorts a list of numbers. " * 4, "x"]


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from dspark_runtime import Engine

    return Engine.load(tiny_engine_dir, threads=1)


@pytest.mark.parametrize("gamma", [1, 3, 4, 7, "auto"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_greedy_equals_target_only(engine, prompt, gamma):
    ref = engine.generate(prompt, max_new_tokens=48, draft=None)
    spec = engine.generate(prompt, max_new_tokens=48, draft="draft", draft_length=gamma)
    assert spec.token_ids == ref.token_ids
    assert spec.text == ref.text
    s = spec.stats
    assert s.drafter == "lm" and s.num_rounds < len(ref.token_ids) - 1  # speculation saved target steps
    assert 0 < s.accepted <= s.proposed
    assert s.accepted_length_mean == pytest.approx((len(spec.token_ids) - 1) / s.num_rounds)
    assert s.acceptance_rate == pytest.approx(s.accepted / s.proposed)


def test_rollback_is_exercised(engine):
    """With a long block, some drafts of the noisy-copy draft are rejected: KV rollback runs on both
    caches, and the output is still exact."""
    ref = engine.generate(PROMPTS[1], max_new_tokens=64, draft=None)
    spec = engine.generate(PROMPTS[1], max_new_tokens=64, draft="draft", draft_length=7)
    assert 0 < spec.stats.accepted < spec.stats.proposed
    assert spec.token_ids == ref.token_ids


def test_target_only_matches_torch_greedy(engine, tiny_pair):
    """The ORT loop (prefill + KV-cached steps) reproduces transformers' own greedy generate."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = engine.encode_prompt(PROMPTS[0])
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    ours = engine.generate(PROMPTS[0], max_new_tokens=24, draft=None)
    n = len(ours.token_ids)  # ours stops at EOS; transformers was told not to
    assert ours.token_ids == out[0, len(ids):len(ids) + n].tolist()


def test_sampled_speculative_is_seeded_and_reproducible(engine):
    a = engine.generate(PROMPTS[0], max_new_tokens=32, temperature=0.8, top_p=0.9, seed=7)
    b = engine.generate(PROMPTS[0], max_new_tokens=32, temperature=0.8, top_p=0.9, seed=7)
    c = engine.generate(PROMPTS[0], max_new_tokens=32, temperature=0.8, top_p=0.9, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.stats.proposed > 0


def test_first_token_distribution_matches_target(engine):
    """Sampled speculative output's first draft-verified token follows the target's processed p.

    The second generated token is the first one decided by rejection sampling; over many seeds its
    empirical distribution must match the target's p at that position (given the first token)."""
    from dspark_runtime.decoding.sampling import SamplingParams, process_logits

    prompt = PROMPTS[0]
    params = SamplingParams(temperature=1.0, top_k=4)
    ids = engine.encode_prompt(prompt)
    runner = engine.runner("target")
    runner.reset()
    first_logits = runner.prefill(ids)
    first_p = process_logits(first_logits, params)
    x0 = int(np.argmax(first_p))
    p2 = process_logits(runner.step([x0])[-1], params)
    counts = np.zeros_like(p2)
    n = 0
    for seed in range(400):
        r = engine.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed, draft_length=2)
        if r.token_ids[0] == x0 and len(r.token_ids) > 1:
            counts[r.token_ids[1]] += 1
            n += 1
    assert n > 60
    assert np.all(counts[p2 == 0] == 0)  # never a token the target's top-k excludes
    # total variation between empirical and exact, with a generous sampling-noise bound
    tv = 0.5 * np.abs(counts / n - p2).sum()
    assert tv < 0.15, tv


def test_stop_string_and_streaming(engine):
    ref = engine.generate(PROMPTS[0], max_new_tokens=40, draft=None)
    assert len(ref.text) > 6
    stop = ref.text[3:6]
    pieces = []
    r = engine.generate(PROMPTS[0], max_new_tokens=40, stop=[stop], stream=pieces.append)
    assert r.finish_reason == "stop"
    assert r.text == ref.text[: ref.text.find(stop)]
    assert ref.token_ids[: len(r.token_ids)] == r.token_ids
    assert "".join(pieces) == r.text  # streamed text never includes the stop string


def test_streamable_length_holds_back_possible_stop_prefixes():
    from dspark_runtime.decoding.request import cut_at_stop, streamable_length

    assert streamable_length("abc</s", ["</stop>"]) == 3  # "</s" may become "</stop>"
    assert streamable_length("abc</stop> more", ["</stop>"]) == 3
    assert streamable_length("abcdef", ["xyz"]) == 6
    assert streamable_length("abcdef", None) == 6
    assert cut_at_stop("abc</stop> more</s>", ["</s>", "</stop>"]) == "abc" and cut_at_stop("abc", None) == "abc"


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "draft_length": 0}, "draft_length must be a positive integer"),
    ({"prompt": "hi", "draft": "medusa"}, "unknown draft 'medusa'"),
    ({"prompt": [], }, "message list is empty"),
])
def test_bad_generation_arguments(engine, kwargs, message):
    prompt = kwargs.pop("prompt")
    with pytest.raises(InputError, match=message):
        engine.generate(prompt, **kwargs)


def test_stopper_ignores_tokens_past_max_new_tokens():
    """A speculative round can commit more tokens than max_new_tokens allows: an EOS or a stop
    string in the overshoot must not count."""
    from dspark_runtime.decoding.request import Stopper

    dec = lambda ids: "".join(chr(97 + i) for i in ids)  # 0 -> "a", 1 -> "b", ...
    st = Stopper(eos_ids=[9], max_new_tokens=3, stop=["cd"], decode=dec)
    assert st.check([0, 1, 2, 3, 9], 0) == (3, "length")  # "cd" and EOS lie past token 3
    assert st.check([0, 9, 2], 0) == (2, "eos")
    st2 = Stopper(eos_ids=[], max_new_tokens=10, stop=["cd"], decode=dec)
    assert st2.check([0, 1], 0) == (2, None)
    assert st2.check([0, 1, 2, 3, 4], 2) == (4, "stop")


def test_draft_confidence_threshold_shortens_blocks_and_stays_exact(engine):
    ref = engine.generate(PROMPTS[1], max_new_tokens=48, draft=None)
    full = engine.generate(PROMPTS[1], max_new_tokens=48, draft="lm", draft_length=6)
    short = engine.generate(PROMPTS[1], max_new_tokens=48, draft="lm", draft_length=6, draft_confidence=0.999)
    assert short.token_ids == ref.token_ids == full.token_ids
    # a threshold near 1 stops most blocks after their first token
    assert short.stats.proposed / short.stats.num_rounds < full.stats.proposed / full.stats.num_rounds
    assert set(full.stats.draft_length_histogram) <= {"1", "2", "3", "4", "5", "6"}
    sampled = engine.generate(PROMPTS[1], max_new_tokens=24, temperature=1.0, seed=1, draft_confidence=0.5)
    assert sampled.token_ids == engine.generate(PROMPTS[1], max_new_tokens=24, temperature=1.0, seed=1,
                                                draft_confidence=0.5).token_ids
    with pytest.raises(InputError, match="draft_confidence must be a probability"):
        engine.generate("hi", draft_confidence=1.5)


def test_lm_drafter_proposes_when_its_cache_already_holds_the_whole_context(engine):
    """A router can commit exactly the tokens the draft LM had drafted and cached (it sent an n-gram block, the
    target accepted it and the bonus token was the LM's next draft): the LM must still re-feed the anchor."""
    from types import SimpleNamespace

    from dspark_runtime.drafting.drafters import LMDrafter
    from dspark_runtime.runners.factory import batch_runner
    from dspark_runtime.decoding.sampling import SamplingParams

    def lm_over_its_own_runner():
        return LMDrafter(batch_runner(engine.graph_backend(engine.lm_graph), max_requests=1))

    prompt = engine.encode_prompt("def add(a, b):")
    req = SimpleNamespace(rid=0, prompt=list(prompt), out=[], params=SamplingParams(), rng=None)
    lm = lm_over_its_own_runner()
    lm.begin(req)
    first = lm.propose_batch([req], [4])[0].tokens
    # commit the first three drafts: the context now ends with a token the LM has already cached
    req.out = first[:3]
    assert lm._cached[0][-1] == req.out[-1]
    again = lm.propose_batch([req], [2])[0].tokens
    assert again[0] == first[3]  # the same greedy continuation, from the re-fed anchor
    fresh = lm_over_its_own_runner()
    ctx = SimpleNamespace(rid=0, prompt=list(prompt) + first[:3], out=[], params=SamplingParams(), rng=None)
    fresh.begin(ctx)
    assert fresh.propose_batch([ctx], [2])[0].tokens == again
