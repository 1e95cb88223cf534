"""--allowed-model-paths confines the LoRA adapters a caller can make the worker read — by
LoadLoRAAdapter or by naming one in a Generate — and the refusal says nothing about whether
the path exists; adapters the worker already serves (--lora-modules) stay usable."""

import asyncio

import pytest
from decode_fakes import Harness

from proto import pdserve_pb2 as pb
from worker_runtime.grpc_errors import PermissionDenied

pytestmark = pytest.mark.timeout(30)


def test_adapters_outside_the_roots_are_refused_before_they_are_looked_at(tmp_path):
    root = tmp_path / "adapters"
    (root / "ok").mkdir(parents=True)

    async def main():
        h = Harness(allowed_model_paths=(str(root),))
        try:
            answers = set()
            for path in ("/etc", "/no/such/dir", str(root / ".." / "elsewhere")):
                with pytest.raises(PermissionDenied, match="outside --allowed-model-paths") as exc:
                    await h.rt.adapters.load("x", path)
                answers.add(str(exc.value).replace(repr(path), "P"))
            assert len(answers) == 1 and h.rt.adapters.by_name == {}

            task = h.generate("r", lora=pb.LoRAAdapter(name="x", path="/etc"))
            await h.spin()
            with pytest.raises(Exception, match="outside --allowed-model-paths"):
                await task
            assert h.calls == [] and h.engine.allocated == {} and h.rt.streams == {}

            h.rt.adapters.by_name["served"] = (
                "/opt/served"  # what --lora-modules serves is not re-checked
            )
            task = h.generate("s", lora=pb.LoRAAdapter(name="served", path="/opt/served"))
            await h.spin_until(lambda: h.calls)
            assert len(h.calls) == 1
            task.cancel()
            await h.spin()
        finally:
            h.close()

    asyncio.run(main())
