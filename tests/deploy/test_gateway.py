"""deploy/k8s/overlays/gateway: the router as a Gateway API Inference Extension endpoint picker.
The InferencePool (inference.networking.k8s.io/v1) selects the router pods on their HTTP port;
its endpointPickerRef reaches the routers' picker port through a Service; the routers run the
picker with flags the router's own parser accepts, advertising their pod IP; the HTTPRoute
sends the Gateway's traffic to the pool; custom resources validate against the vendored CRD
schemas (tests/deploy/crd_schemas.py), which refuse a broken one."""

from __future__ import annotations

import argparse
import copy

import crd_schemas
import pytest
from test_k8s import _args, _env, _selects, container, needs_kubectl, of_kind, render

_docs: list[dict] = []


def gateway() -> list[dict]:
    if not _docs:
        _docs.extend(render("gateway"))
    return _docs


def _port(c: dict, ref) -> int:
    """A container port by number or by name."""
    for p in c["ports"]:
        if ref in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    raise AssertionError(f"no container port {ref!r} in {c['ports']}")


@needs_kubectl
def test_the_pool_is_the_routers_and_its_picker_is_their_picker_port():
    docs = gateway()
    [pool] = of_kind(docs, "InferencePool").values()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    pods = {
        n: d["spec"]["template"]["metadata"]["labels"]
        for n, d in of_kind(docs, "Deployment").items()
    }
    assert {
        n
        for n, labels in pods.items()
        if _selects({"matchLabels": spec["selector"]["matchLabels"]}, labels)
    } == {"router"}
    router = container(of_kind(docs, "Deployment")["router"])
    args = _args(router)
    assert [p["number"] for p in spec["targetPorts"]] == [int(args["port"])]
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailClose"
    svc = of_kind(docs, "Service")[ref["name"]]
    assert _selects({"matchLabels": svc["spec"]["selector"]}, pods["router"])
    [port] = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "kubernetes.io/h2c"  # gRPC
    assert _port(router, port["targetPort"]) == int(args["endpoint-picker-port"])
    # The endpoint it answers with: this pod's IP and HTTP port (a pool endpoint).
    host, _, http = args["endpoint-picker-endpoint"].rpartition(":")
    assert host == "$(POD_IP)" and int(http) == int(args["port"])
    assert _env(router)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert of_kind(docs, "Deployment")["router"]["spec"]["replicas"] >= 2


@needs_kubectl
def test_the_routers_arguments_parse_with_the_routers_own_parser():
    from router.cli import config_from_args, register

    docs = gateway()
    c = container(of_kind(docs, "Deployment")["router"])
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    pod_cidr = of_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_POD_CIDR"]
    env = {
        "$(PDSERVE_ETCD)": "etcd:2379",
        "$(PDSERVE_CLUSTER)": "default",
        "$(POD_IP)": "10.1.2.3",
        "$(PDSERVE_POD_CIDR)": pod_cidr,
    }
    argv = [c["command"][1]]
    for a in c["args"]:
        for k, v in env.items():
            a = a.replace(k, v)
        argv.append(a)
    config = config_from_args(parser.parse_args(argv))
    assert config.endpoint_picker.port == 9002
    assert config.endpoint_picker.endpoint == "10.1.2.3:8000"
    # registrations are trusted from the pod network only (the value the operator gives)
    assert [str(n) for n in config.allowed_worker_cidrs] == [pod_cidr] == ["10.244.0.0/16"]


@needs_kubectl
def test_the_route_sends_the_gateways_traffic_to_the_pool():
    docs = gateway()
    [route] = of_kind(docs, "HTTPRoute").values()
    [pool] = of_kind(docs, "InferencePool")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}
    ]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"
    assert any(
        m["path"]["value"] == "/v1" for rule in route["spec"]["rules"] for m in rule["matches"]
    )


@needs_kubectl
def test_the_picker_port_is_open_to_the_gateway():
    pols = of_kind(gateway(), "NetworkPolicy").values()
    assert any(
        {"port": 9002, "protocol": "TCP"} in rule.get("ports", [])
        and _selects(p["spec"]["podSelector"], {"app.kubernetes.io/name": "router"})
        for p in pols
        for rule in p["spec"].get("ingress", [])
    )


POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "p"},
    "spec": {
        "selector": {"matchLabels": {"app": "router"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "router", "port": {"number": 9002}},
    },
}


def test_the_vendored_schemas_are_pinned_and_refuse_broken_resources():
    assert crd_schemas.errors(POOL) == []
    for api, kind in (
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ):
        doc = crd_schemas.load(api, kind)
        assert doc["tag"].startswith("v") and len(doc["commit"]) == 40, (kind, doc["tag"])
    misspelt = copy.deepcopy(POOL)
    misspelt["spec"]["endpointPickerRefs"] = misspelt["spec"].pop("endpointPickerRef")
    assert any("endpointPickerRefs" in e for e in crd_schemas.errors(misspelt))
    no_ports = copy.deepcopy(POOL)
    del no_ports["spec"]["targetPorts"]
    assert any("targetPorts" in e for e in crd_schemas.errors(no_ports))
    bad_mode = copy.deepcopy(POOL)
    bad_mode["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    assert crd_schemas.errors(bad_mode)
    with pytest.raises(KeyError):
        crd_schemas.load("inference.networking.x-k8s.io/v1alpha2", "InferencePool")


def test_custom_resources_as_written_validate_without_kubectl():
    """The pure-Python path for the custom resources' files (the overlays render them too)."""
    import yaml
    from test_k8s import K8S

    files = [
        K8S / "overlays" / "gateway" / "inferencepool.yaml",
        K8S / "overlays" / "gateway" / "httproute.yaml",
        K8S / "overlays" / "lws" / "leaderworkersets.yaml",
        K8S / "components" / "keda" / "scaledobjects.yaml",
    ]
    kinds = []
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            assert crd_schemas.errors(doc) == [], path
            kinds.append(doc["kind"])
    assert sorted(set(kinds)) == ["HTTPRoute", "InferencePool", "LeaderWorkerSet", "ScaledObject"]
