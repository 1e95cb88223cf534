"""`pdserve up --prefill 1 --decode 1 --planner` end to end: under streaming load that misses
the decode pool's ITL SLO (1 ms: no CPU decode step meets it, so decode is the bottleneck by
construction, whatever the machine's speed) while the prefill worker idles, the planner
switches the prefill worker to decode in place (Worker.SetRole: same process, same PID), etcd
then lists 0 prefill + 2 decode workers, the supervisor's slot takes the decode role, no
request fails, and the planner does not move it back; SIGKILLed, the switched worker is
restarted as a decode worker."""

import os
import signal
import time

import pytest
from up_cluster import Load, Up

from local_cluster.run_file import control_request

pytestmark = pytest.mark.slow


def test_planner_moves_the_idle_prefill_worker_to_the_saturated_decode_pool(tmp_path):
    started = time.monotonic()
    # ITL SLO 1 ms: always missed. High load 0.3: what 4 streaming chats keep a 2-core host's
    # decode pool at, so the moved worker stays (at 0.85, a window measuring the pool at
    # 0.4-0.7 after the move reads as local-prefill interference and moves one back: 3 of 12
    # runs here).
    up = Up(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--planner",
        "--itl-slo-ms",
        "1",
        "--planner-interval",
        "1",
        "--planner-window",
        "4",
        "--planner-cooldown",
        "5",
        "--planner-high-load",
        "0.3",
    )
    try:
        prefill_pid = up.children()["prefill"][0]
        load = Load(up.url)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            roles = sorted(w.role for w in up.workers() if not w.draining)
            if roles == ["decode", "decode"]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(
                "the planner did not move the prefill worker:\n" + "".join(up.output[-30:])
            )
        time.sleep(8)  # several more rounds past the cooldown: it stays where it is
        load.stop()

        assert load.failed == 0, load.errors[:5]
        assert load.ok > 0
        assert sorted(w.role for w in up.workers()) == ["decode", "decode"]
        slot = up.slots()["prefill-1"]
        assert slot["role"] == "decode" and slot["pid"] == prefill_pid and slot["restarts"] == 0
        planner = up.control()["planner"]
        assert [(m["slot"], m["from_role"], m["to_role"], m["ok"]) for m in planner["moves"]] == [
            ("prefill-1", "prefill", "decode", True)
        ], planner
        assert planner["pools"] == {"prefill": 0, "decode": 2}
        metrics = control_request(up.run, "/metrics").decode()
        assert 'pdserve_planner_moves_total{from_role="prefill",to_role="decode"} 1.0' in metrics
        assert 'pdserve_planner_moves_total{from_role="decode",to_role="prefill"} 0.0' in metrics
        assert any("planner: moving prefill-1" in line for line in up.output)
        status = up.cli("status")
        assert "planner: prefill 0" in status and "decode 2" in status, status

        # The switched worker crashes: its slot restarts it in the role it had, decode.
        os.kill(prefill_pid, signal.SIGKILL)
        slot = up.wait_slot("prefill-1", "ready", timeout=60, restarts=1)
        assert slot["role"] == "decode" and slot["pid"] != prefill_pid
        deadline = time.monotonic() + 20
        while (
            sorted(w.role for w in up.workers()) != ["decode", "decode"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert sorted(w.role for w in up.workers()) == ["decode", "decode"], "".join(
            up.output[-20:]
        )
    finally:
        assert up.stop() == 0
    print("".join(line for line in up.output if "planner:" in line))
    print(f"planner e2e took {time.monotonic() - started:.1f}s")
