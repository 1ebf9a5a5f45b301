"""Fixtures of the disk tier's file tests: the small hybrid with long recurrent memory (loaded
once a module, with its checkpoint folder for the fingerprint), the third architecture beside it,
and a tier folder."""

from pathlib import Path

import pytest

from small_hybrid import make_small_hybrid
from tandem.io.tierfile import TierFiles
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir) -> HybridModel:
    return HybridModel.load(hybrid_dir)


@pytest.fixture(params=["hybrid", "third"])
def model(request, hybrid):
    return hybrid if request.param == "hybrid" else ThirdModel()


@pytest.fixture
def files(tmp_path):
    with TierFiles(tmp_path / "tier") as f:
        yield f
