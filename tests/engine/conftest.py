"""Fixtures of the engine tests: the small hybrid (loaded once a module) and, beside it, the
test-only third architecture, as one parametrised ``model``."""

import pytest

from small_hybrid import make_small_hybrid
from tandem.models.hybrid import HybridModel
from tandem.models.third import ThirdModel


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> HybridModel:
    return HybridModel.load(make_small_hybrid(tmp_path_factory.mktemp("small"), tokenizer=False))


@pytest.fixture(params=["hybrid", "third"])
def model(request, hybrid):
    return hybrid if request.param == "hybrid" else ThirdModel()
