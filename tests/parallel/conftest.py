import pytest

from tests.parallel.tiny_models import write_tiny


@pytest.fixture(scope="session")
def tiny_model(model_dir, tmp_path_factory):
    """`tiny_model(name)`: the path of tiny checkpoint `name`, written on first use."""
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = write_tiny(name, model_dir, tmp_path_factory.mktemp(name))
        return written[name]

    return get
