"""deploy/k8s/components/keda: one KEDA ScaledObject per role, each on Prometheus queries of
gauges the router really exports (router/metrics.py, rendered from a live registry), prefill on
seconds of queued prefill work, decode on KV usage and waiting requests, with scale-up and
scale-down policies; a ScaledObject's target exists in the overlay, and no overlay has both a
ScaledObject and a plain HPA for one workload (KEDA owns an HPA of its own)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import crd_schemas
import yaml
from test_k8s import ALL_OVERLAYS, K8S, needs_kubectl, of_kind, render

SCALED = K8S / "components" / "keda" / "scaledobjects.yaml"
WORKLOAD_KINDS = {"Deployment", "LeaderWorkerSet"}


def scaled_objects(path: Path = SCALED) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def router_metric_names() -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import RouterMetrics

    return {f.name for f in text_string_to_metric_families(RouterMetrics().render().decode())}


def queried(trigger: dict) -> set[str]:
    return set(re.findall(r"\b(pdserve_\w+)\{", trigger["metadata"]["query"]))


def test_each_role_scales_on_router_gauges_with_policies():
    objects = scaled_objects()
    assert set(objects) == {"prefill", "decode"}
    exported = router_metric_names()
    by_role = {}
    for role, so in objects.items():
        assert crd_schemas.errors(so) == []
        spec = so["spec"]
        assert spec["scaleTargetRef"]["name"] == role
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]  # never to zero: cold loads
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["policies"] and behavior["scaleDown"]["policies"], role
        assert (
            behavior["scaleDown"]["stabilizationWindowSeconds"]
            > behavior["scaleUp"]["stabilizationWindowSeconds"]
        ), role
        for t in spec["triggers"]:
            assert t["type"] == "prometheus" and float(t["metadata"]["threshold"]) > 0
            assert t["metadata"]["serverAddress"].startswith("http")
            names = queried(t)
            assert names and names <= exported, (role, names - exported)
        by_role[role] = {t["metricType"]: queried(t) for t in spec["triggers"]}
    prefill = {n for names in by_role["prefill"].values() for n in names}
    assert prefill == {"pdserve_router_prefill_backlog_seconds"}
    # Value: desired = current x backlog / threshold (a pool-wide figure, not per pod)
    assert by_role["prefill"]["Value"] == prefill
    decode = {n for names in by_role["decode"].values() for n in names}
    assert {"pdserve_router_decode_kv_usage", "pdserve_router_decode_waiting_requests"} <= decode


def test_a_broken_scaled_object_fails_validation():
    so = scaled_objects()["prefill"]
    no_trigger = copy.deepcopy(so)
    del no_trigger["spec"]["triggers"]
    assert any("triggers" in e for e in crd_schemas.errors(no_trigger))
    misplaced = copy.deepcopy(so)
    misplaced["spec"]["behavior"] = misplaced["spec"]["advanced"].pop(
        "horizontalPodAutoscalerConfig"
    )["behavior"]
    assert any("behavior" in e for e in crd_schemas.errors(misplaced))
    bad_policy = copy.deepcopy(so)
    bad_policy["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"][
        "policies"
    ][0]["value"] = "two"
    assert crd_schemas.errors(bad_policy)


@needs_kubectl
def test_targets_exist_and_keda_never_meets_an_hpa_of_the_same_workload():
    with_keda = 0
    for overlay in ALL_OVERLAYS:
        docs = render(overlay)
        scaled = of_kind(docs, "ScaledObject")
        hpa_targets = {
            h["spec"]["scaleTargetRef"]["name"]
            for h in of_kind(docs, "HorizontalPodAutoscaler").values()
        }
        for so in scaled.values():
            ref = so["spec"]["scaleTargetRef"]
            assert ref["kind"] in WORKLOAD_KINDS, (overlay, ref)
            assert ref["name"] in of_kind(docs, ref["kind"]), (overlay, ref)
            target = of_kind(docs, ref["kind"])[ref["name"]]
            assert target["apiVersion"] == ref["apiVersion"], (overlay, ref)
            assert ref["name"] not in hpa_targets, (overlay, ref["name"])
        with_keda += bool(scaled)
    assert with_keda >= 2  # gateway and lws
