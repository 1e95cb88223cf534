"""The committed generated code must be what the committed .proto generates."""

from pathlib import Path

from proto.generate import REPO, generate


def test_generated_code_matches_the_proto(tmp_path: Path):
    generate(tmp_path)
    for fresh in sorted((tmp_path / "proto").glob("*_pb2*.py*")):
        committed = REPO / "proto" / fresh.name
        assert committed.is_file(), f"{fresh.name} is not committed: run python -m proto.generate"
        assert committed.read_text() == fresh.read_text(), (
            f"proto/{fresh.name} drifted from the .proto: run python -m proto.generate"
        )


def test_generated_modules_import_package_qualified():
    from proto import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert "from proto import pdserve_pb2" in Path(pdserve_pb2_grpc.__file__).read_text()
