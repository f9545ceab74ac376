import pytest


@pytest.fixture(scope="session")
def gloo_ranks(tmp_path_factory) -> list[dict]:
    """What each of 3 gloo ranks saw in the data-parallel scenarios (tests/sensors/gloo_ranks.py)."""
    from tests.sensors import gloo_ranks

    return gloo_ranks.run(str(tmp_path_factory.mktemp("gloo")))
