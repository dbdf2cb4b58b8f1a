import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): tiny random Qwen2 models sharing a byte-level BPE tokenizer."""
    pytest.importorskip("torch")
    from tiny_models import make_pair

    return make_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_pair, tmp_path_factory):
    """An engine directory built from the tiny pair (in-process export)."""
    from dspark_export.build import Recipe, build_engine

    tdir, ddir = tiny_pair
    out = tmp_path_factory.mktemp("engines") / "tiny"
    build_engine(Recipe(name="tiny", target=str(tdir), draft=str(ddir), target_feature_layers=[-1, 0],
                        draft_length=4), out, isolate=False, log=lambda *a: None)
    return out
