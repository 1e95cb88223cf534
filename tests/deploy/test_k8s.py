"""deploy/k8s/: every overlay renders with `kubectl kustomize` and every rendered document
validates against the Kubernetes JSON schemas (kubernetes-validate, offline), plus checks of
what the manifests promise: only the router is reachable from outside, workers drain within
their grace period, GPUs go to workers only, separate prefill/decode Deployments and HPAs,
the API key, the cluster token and etcd's passwords from Secrets the operator's own untracked
files generate (never committed, never on argv), etcd's users made by a Job (`pdserve
etcd-users`), the router and the workers each with its own etcd user. Overlays render from a
copy of deploy/k8s/ holding test key, token and password files. The base's files are also
validated without kubectl."""

from __future__ import annotations

import argparse
import base64
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import crd_schemas
import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e .[test])"
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
ALL_OVERLAYS = sorted(
    p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists()
)
LWS_OVERLAYS = {"lws"}  # workers as LeaderWorkerSets, not Deployments: tests/deploy/test_lws.py
OVERLAYS = [o for o in ALL_OVERLAYS if o not in LWS_OVERLAYS]
K8S_VERSION = "1.32.0"  # schemas checked against (strict: unknown fields are errors)
KUBECTL = shutil.which("kubectl")
CRD_GROUPS = {
    "inference.networking.k8s.io",
    "gateway.networking.k8s.io",
    "keda.sh",
    "leaderworkerset.x-k8s.io",
}
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not on PATH: cannot render the kustomize overlays"
)
WORKERS = ("prefill", "decode")
KEY_FILE = "base/api-key.txt"  # git-ignored: the operator creates it (docs/kubernetes.md)
TEST_KEY = "test-key-0123456789abcdef"
TOKEN_FILE = "base/cluster-token.txt"  # likewise
TEST_TOKEN = "test-cluster-token-0123456789abcdef"
ETCD_PASSWORD_FILES = {  # likewise: etcd user -> (file, test password)
    "root": ("base/etcd-root-password.txt", "test-etcd-root-0123456789abcdef"),
    "pdserve-worker": ("base/etcd-worker-password.txt", "test-etcd-worker-0123456789abcdef"),
    "pdserve-router": ("base/etcd-router-password.txt", "test-etcd-router-0123456789abcdef"),
}
OPERATOR_FILES = (
    "api-key.txt",
    "cluster-token.txt",
    *(Path(f).name for f, _ in ETCD_PASSWORD_FILES.values()),
)


def _kustomize(root: Path, overlay: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KUBECTL, "kustomize", str(root / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def render(overlay: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "k8s"
        shutil.copytree(K8S, root, ignore=shutil.ignore_patterns(*OPERATOR_FILES))
        (root / KEY_FILE).write_text(TEST_KEY + "\n")
        (root / TOKEN_FILE).write_text(TEST_TOKEN + "\n")
        for path, password in ETCD_PASSWORD_FILES.values():
            (root / path).write_text(password + "\n")
        out = _kustomize(root, overlay)
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{out.stderr}"
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, f"overlays/{overlay} rendered nothing"
    return docs


_cache: dict[str, list[dict]] = {}


@pytest.fixture(
    params=OVERLAYS, ids=lambda o: f"overlay-{o}"
)  # not "gpu": conftest skips that keyword
def rendered(request) -> tuple[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl not on PATH: cannot render the kustomize overlays")
    if request.param not in _cache:
        _cache[request.param] = render(request.param)
    return request.param, _cache[request.param]


def of_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deploy: dict) -> dict:
    cs = deploy["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1, deploy["metadata"]["name"]
    return cs[0]


def validate(doc: dict) -> None:
    """Core kinds against the Kubernetes schemas; custom resources (InferencePool, HTTPRoute,
    ScaledObject, LeaderWorkerSet) against their vendored CRD schemas (crd_schemas.py)."""
    if doc["apiVersion"].split("/")[0] in CRD_GROUPS:
        problems = crd_schemas.errors(doc)
        assert not problems, "\n".join(problems)
        return
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_overlays_exist():
    assert {"cpu", "gpu", "external-etcd"} <= set(OVERLAYS)


def test_base_files_validate_without_kubectl():
    """The pure-Python path: the base's and components' resource files as written."""
    files = [p for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml"]
    files += [K8S / "components" / "autoscaling" / "hpa.yaml"]
    n = 0
    for p in files:
        for doc in yaml.safe_load_all(p.read_text()):
            if doc:
                validate(doc)
                n += 1
    assert n >= 12


@needs_kubectl
def test_renders_and_validates(rendered):
    name, docs = rendered
    for doc in docs:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "pdserve", (
                name,
                doc["kind"],
                doc["metadata"]["name"],
            )


def test_a_broken_manifest_fails_validation():
    """The validator is really strict (guards the test above against passing vacuously)."""
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "two", "selector": {}, "template": {}, "bogus": 1},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@needs_kubectl
def test_separate_worker_deployments(rendered):
    name, docs = rendered
    deps = of_kind(docs, "Deployment")
    assert {"router", *WORKERS} <= set(deps), name
    for role in WORKERS:
        c = container(deps[role])
        assert c["command"][:2] == ["pdserve", role], (name, role, c["command"])
        labels = deps[role]["spec"]["selector"]["matchLabels"]
        others = [r for r in WORKERS if r != role]
        tmpl = deps[others[0]]["spec"]["template"]["metadata"]["labels"]
        assert not all(tmpl.get(k) == v for k, v in labels.items()), (
            f"{name}: {role}'s selector also matches {others[0]}'s pods"
        )


def _args(c: dict) -> dict[str, str]:
    out = {}
    for a in c.get("args", []):
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out[k] = v
    return out


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


@needs_kubectl
def test_workers_advertise_pod_ip_and_drain_in_grace_period(rendered):
    name, docs = rendered
    deps = of_kind(docs, "Deployment")
    for role in WORKERS:
        spec = deps[role]["spec"]["template"]["spec"]
        c = container(deps[role])
        args = _args(c)
        assert args.get("host") == "0.0.0.0", (name, role)
        m = re.fullmatch(r"\$\((\w+)\)", args.get("advertise-host", ""))
        assert m, f"{name}/{role}: --advertise-host is not an env var: {args.get('advertise-host')}"
        src = _env(c)[m.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]
        assert src == "status.podIP", (name, role, src)
        drain = float(args.get("drain-timeout", 30.0))  # pdserve's default
        grace = spec.get("terminationGracePeriodSeconds", 30)
        assert grace > drain, (
            f"{name}/{role}: terminationGracePeriodSeconds {grace} <= --drain-timeout {drain}"
        )
        assert c["command"][0] == "pdserve", (
            f"{name}/{role}: SIGTERM must reach pdserve (no shell wrapper)"
        )
        ports = {p["containerPort"] for p in c["ports"]}
        assert {int(args["port"]), int(args["metrics-port"])} <= ports, (name, role)
        assert c.get("readinessProbe") and c.get("livenessProbe"), (name, role)


@needs_kubectl
def test_speculative_config_on_decode_workers_only_off_by_default(rendered):
    name, docs = rendered
    deps = of_kind(docs, "Deployment")
    c = container(deps["decode"])
    m = re.fullmatch(r"\$\((\w+)\)", _args(c).get("speculative-config", ""))
    assert m, f"{name}: decode --speculative-config is not an env var"
    assert _env(c)[m.group(1)]["value"] == "", (
        name
    )  # defined (else $(...) stays literal), empty: off
    assert "speculative-config" not in _args(container(deps["prefill"])), name


@needs_kubectl
def test_kv_cache_dtype_is_one_setting_for_workers_of_both_roles(rendered):
    name, docs = rendered
    deps = of_kind(docs, "Deployment")
    [config] = [
        m for m in of_kind(docs, "ConfigMap").values() if "PDSERVE_ETCD" in m.get("data", {})
    ]
    for role in WORKERS:
        c = container(deps[role])
        assert _args(c).get("kv-cache-dtype") == "$(PDSERVE_KV_CACHE_DTYPE)", (name, role)
        assert any(
            ref.get("configMapRef", {}).get("name") == config["metadata"]["name"]
            for ref in c.get("envFrom", [])
        ), (name, role)
    assert config["data"]["PDSERVE_KV_CACHE_DTYPE"] == "auto", name


@needs_kubectl
def test_router_ready_on_health_and_key_from_secret(rendered):
    name, docs = rendered
    deps = of_kind(docs, "Deployment")
    c = container(deps["router"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
    secrets = of_kind(docs, "Secret")
    # The router reads PDSERVE_API_KEY itself (router/http/auth.py): the key is in its environment
    # from the Secret, never on its command line (visible in `ps`).
    ref = _env(c)["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] in secrets, (name, ref, sorted(secrets))
    data = secrets[ref["name"]]["data"]
    value = base64.b64decode(data[ref["key"]]).decode()
    assert value == TEST_KEY + "\n", name  # the file's bytes, its newline included ...
    from router.config import RouterConfig
    from router.http.auth import Keys, resolve_keys

    resolved = resolve_keys(RouterConfig(etcd="etcd:2379"), {"PDSERVE_API_KEY": value})
    assert resolved == Keys.of([TEST_KEY]), name  # ... which the router does not take as key
    for dname, d in deps.items():
        for cc in d["spec"]["template"]["spec"]["containers"]:
            for a in cc.get("args", []) + cc.get("command", []):
                assert "api-key" not in a and "API_KEY" not in a, (
                    f"{name}/{dname}: key on argv: {a}"
                )
            for e in cc.get("env", []):
                if "key" in e["name"].lower():
                    assert "value" not in e, f"{name}/{dname}: env {e['name']} is a literal"


@needs_kubectl
def test_the_router_and_every_worker_get_the_cluster_token_from_one_secret(rendered):
    from cluster.grpc_security import GrpcSecurity, resolve

    name, docs = rendered
    deps, secrets = of_kind(docs, "Deployment"), of_kind(docs, "Secret")
    refs = set()
    for dname in ("router", *WORKERS):
        c = container(deps[dname])
        ref = _env(c)["PDSERVE_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
        assert not any(
            "cluster-token" in a or "CLUSTER_TOKEN" in a
            for a in c.get("args", []) + c.get("command", [])
        ), (name, dname)
    [(secret, key)] = refs  # one token for the whole cluster
    value = base64.b64decode(secrets[secret]["data"][key]).decode()
    assert value == TEST_TOKEN + "\n", name  # the file's bytes; its newline is not the token's
    assert resolve(GrpcSecurity(), {"PDSERVE_CLUSTER_TOKEN": value}).token == TEST_TOKEN


def _secret_value(docs: list[dict], ref: dict) -> str:
    secrets = of_kind(docs, "Secret")
    assert ref["name"] in secrets, (ref, sorted(secrets))
    return base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()


@needs_kubectl
def test_a_job_makes_etcds_users_with_every_password_from_a_secret(rendered):
    """`pdserve etcd-users` against the cluster's etcd (the bundled one or yours), before
    which the router's and the workers' users do not exist."""
    from cluster.etcd_users_config import (
        ROOT_PASSWORD_ENV,
        ROUTER_PASSWORD_ENV,
        WORKER_PASSWORD_ENV,
        EtcdUsersConfig,
    )
    from engine.flags import add_flags, from_args

    name, docs = rendered
    job = of_kind(docs, "Job")["etcd-users"]
    spec = job["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert c["command"] == ["pdserve", "etcd-users"], name
    assert _args(c) == {"etcd": "$(PDSERVE_ETCD)", "cluster": "$(PDSERVE_CLUSTER)"}, name
    parser = argparse.ArgumentParser()  # the command's own parser takes the arguments
    add_flags(parser, EtcdUsersConfig)
    config = from_args(
        EtcdUsersConfig,
        parser.parse_args([a.replace("$(PDSERVE_ETCD)", "etcd:2379") for a in c["args"]]),
    )
    env = _env(c)
    plan = config.plan(
        {
            variable: _secret_value(docs, env[variable]["valueFrom"]["secretKeyRef"])
            for variable in (ROOT_PASSWORD_ENV, WORKER_PASSWORD_ENV, ROUTER_PASSWORD_ENV)
        }
    )
    passwords = {u.name: u.password for u in plan.users} | {"root": plan.root_password}
    assert passwords == {user: pw for user, (_, pw) in ETCD_PASSWORD_FILES.items()}, name
    assert spec["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 5, name
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve"
    assert any(r.get("configMapRef", {}).get("name") == "pdserve-config" for r in c["envFrom"])
    assert "password" not in " ".join(c["command"] + c["args"]).lower(), name


@needs_kubectl
def test_the_router_and_every_worker_get_their_own_etcd_user_from_a_secret(rendered):
    from cluster.etcd_security import PASSWORD_ENV, EtcdSecurity

    name, docs = rendered
    deps = of_kind(docs, "Deployment")
    root_secret = _env(container(of_kind(docs, "Job")["etcd-users"]))["PDSERVE_ETCD_ROOT_PASSWORD"][
        "valueFrom"
    ]["secretKeyRef"]["name"]
    for dname, user in (
        ("router", "pdserve-router"),
        ("prefill", "pdserve-worker"),
        ("decode", "pdserve-worker"),
    ):
        c = container(deps[dname])
        assert _args(c).get("etcd-user") == user, (name, dname)
        ref = _env(c)[PASSWORD_ENV]["valueFrom"]["secretKeyRef"]
        value = _secret_value(docs, ref)
        assert value == ETCD_PASSWORD_FILES[user][1] + "\n", (name, dname)  # the file's bytes
        credentials = EtcdSecurity(user).resolve({PASSWORD_ENV: value})
        assert credentials.password == ETCD_PASSWORD_FILES[user][1], (name, dname)
        assert ref["name"] != root_secret, (name, dname)
        assert not any("password" in a.lower() for a in c.get("args", []) + c["command"]), dname
    for kind in ("Deployment", "StatefulSet"):  # root's password reaches the Job alone
        for dname, d in of_kind(docs, kind).items():
            for cc in d["spec"]["template"]["spec"]["containers"]:
                refs = [
                    e["valueFrom"]["secretKeyRef"]["name"]
                    for e in cc.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})
                ]
                assert root_secret not in refs, (name, dname)
    sts = of_kind(docs, "StatefulSet").get("etcd")
    if sts is not None:  # the bundled etcd: the hashes' cost from the ConfigMap (10)
        [etcd] = sts["spec"]["template"]["spec"]["containers"]
        assert "--bcrypt-cost=$(PDSERVE_ETCD_BCRYPT_COST)" in etcd["command"], name
        assert (
            of_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_ETCD_BCRYPT_COST"] == "10"
        ), name


def test_the_repository_ships_no_key():
    """No committed Secret value (the old base shipped `api-key: "replace-me"` and restored it
    on every apply): the key and token files are git-ignored and no manifest holds a Secret's
    data."""
    repo = K8S.parents[1]
    tracked = subprocess.run(
        ["git", "ls-files", "deploy/k8s"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.split()
    for operators in (KEY_FILE, TOKEN_FILE, *(f for f, _ in ETCD_PASSWORD_FILES.values())):
        assert "deploy/k8s/" + operators not in tracked
        ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/k8s/" + operators], cwd=repo)
        assert ignored.returncode == 0, f"deploy/k8s/{operators} is not git-ignored"
    for path in tracked:
        if path.endswith(".yaml"):
            for doc in yaml.safe_load_all((repo / path).read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "Secret":
                    assert not doc.get("data") and not doc.get("stringData"), path
    text = (K8S / "base" / "kustomization.yaml").read_text()
    assert "api-key=api-key.txt" in text and "replace-me" not in text
    assert "cluster-token=cluster-token.txt" in text
    for path, _ in ETCD_PASSWORD_FILES.values():
        assert f"password={Path(path).name}" in text


@needs_kubectl
@pytest.mark.parametrize("missing", OPERATOR_FILES)
def test_rendering_without_the_key_or_token_file_fails_naming_it(tmp_path, missing):
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns(*OPERATOR_FILES))
    for present in OPERATOR_FILES:
        if present != missing:
            (root / "base" / present).write_text("0123456789abcdef0123456789abcdef\n")
    out = _kustomize(root, "cpu")
    assert out.returncode != 0 and missing in out.stderr, out.stderr


def _selects(selector: dict, labels: dict) -> bool:
    if selector.get("matchExpressions"):
        raise AssertionError("matchExpressions not handled by this test")
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _is_outside(peer_list) -> bool:
    """An ingress rule's `from` admits sources outside the namespace."""
    if not peer_list:
        return True  # no `from`: everyone
    return any("namespaceSelector" in p or "ipBlock" in p for p in peer_list)


@needs_kubectl
def test_only_router_reachable_from_outside(rendered):
    name, docs = rendered
    pols = list(of_kind(docs, "NetworkPolicy").values())
    assert any(
        p["spec"]["podSelector"] == {}
        and p["spec"].get("policyTypes") == ["Ingress"]
        and not p["spec"].get("ingress")
        for p in pols
    ), f"{name}: no default-deny ingress policy"
    pods = {
        n: d["spec"]["template"]["metadata"]["labels"]
        for n, d in {**of_kind(docs, "Deployment"), **of_kind(docs, "StatefulSet")}.items()
    }
    metrics_ports = {}
    for n, d in of_kind(docs, "Deployment").items():
        if n in WORKERS:
            metrics_ports[n] = {int(_args(container(d))["metrics-port"]), "metrics"}
    reachable = set()
    for p in pols:
        for rule in p["spec"].get("ingress", []):
            if not _is_outside(rule.get("from")):
                continue
            for pod, labels in pods.items():
                if not _selects(p["spec"]["podSelector"], labels):
                    continue
                ports = {x.get("port") for x in rule.get("ports", [])}
                if (
                    pod in metrics_ports
                    and ports
                    and ports <= metrics_ports[pod]
                    and all(
                        "namespaceSelector" in f
                        and "podSelector" not in f
                        and f["namespaceSelector"]
                        for f in rule["from"]
                    )
                ):
                    continue  # Prometheus in a named namespace scraping /metrics only
                reachable.add(pod)
    assert reachable == {"router"}, (
        f"{name}: reachable from outside the namespace: {sorted(reachable)}"
    )
    # and the router Service is the only Service selecting a reachable pod / leaving the cluster
    for sname, svc in of_kind(docs, "Service").items():
        sel = svc["spec"]["selector"]
        hits = {pod for pod, labels in pods.items() if _selects({"matchLabels": sel}, labels)}
        if sname != "router":
            assert not hits & reachable, (name, sname)
            assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", (name, sname)
        else:
            assert hits == {"router"}, (name, hits)


@needs_kubectl
def test_gpu_only_on_workers(rendered):
    name, docs = rendered
    want = name in ("gpu", "gpu-tp")
    for kind in ("Deployment", "StatefulSet"):
        for dname, d in of_kind(docs, kind).items():
            for c in d["spec"]["template"]["spec"]["containers"]:
                res = c.get("resources", {})
                assert res.get("requests") and res.get("limits"), (
                    f"{name}/{dname}: no requests/limits"
                )
                gpu = "nvidia.com/gpu" in res.get("limits", {})
                expect = want and dname in WORKERS
                assert gpu == expect, (
                    f"{name}/{dname}: nvidia.com/gpu {'missing' if expect else 'requested'}"
                )
                if expect:
                    assert "--device=cuda" in c["args"]
                sc = {
                    **d["spec"]["template"]["spec"].get("securityContext", {}),
                    **c.get("securityContext", {}),
                }
                assert (
                    sc.get("runAsNonRoot") is True and sc.get("allowPrivilegeEscalation") is False
                ), (name, dname)
    if want:
        cm = of_kind(docs, "ConfigMap")["pdserve-config"]["data"]
        assert "rc" in cm["UCX_TLS"].split(",") and "cuda_ipc" in cm["UCX_TLS"].split(","), cm


@needs_kubectl
def test_tensor_parallel_decode_pods_get_a_gpu_per_rank_and_prefill_pods_stay_at_one():
    docs = _cache.get("gpu-tp") or render("gpu-tp")
    deployments = of_kind(docs, "Deployment")
    decode, prefill = container(deployments["decode"]), container(deployments["prefill"])
    assert "--tensor-parallel-size=2" in decode["args"] and "--device=cuda" in decode["args"]
    for res in (decode["resources"]["requests"], decode["resources"]["limits"]):
        assert res["nvidia.com/gpu"] == "2"
    # the overlay keeps prefill pods at one GPU (a -tp 2 prefill worker would work too)
    assert not any(a.startswith("--tensor-parallel-size") for a in prefill["args"])
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "1"
    from pdserve.worker_main import add_args

    parser = argparse.ArgumentParser()  # the worker's own parser takes the arguments
    add_args(parser)
    values = {"PDSERVE_KV_CACHE_DTYPE": "auto", "SPECULATIVE_CONFIG": ""}  # the rest: any string
    args = [
        re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), "x"), a) for a in decode["args"]
    ]
    parsed = parser.parse_args(args)
    # on CUDA a tensor-parallel worker refuses to start without an explicit KV budget
    assert parsed.tensor_parallel_size == 2 and parsed.kv_cache_memory


@needs_kubectl
def test_hpas_scale_each_pool_on_worker_metrics():
    docs = _cache.get("gpu") or render("gpu")
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    targets = {h["spec"]["scaleTargetRef"]["name"]: h for h in hpas.values()}
    assert set(targets) == set(WORKERS), sorted(targets)
    exported = set(
        re.findall(r'\(\s*"(\w+)",', (K8S.parents[1] / "worker_runtime" / "metrics.py").read_text())
    )
    names = {}
    for role, h in targets.items():
        assert h["apiVersion"] == "autoscaling/v2"
        names[role] = {
            m["pods"]["metric"]["name"] for m in h["spec"]["metrics"] if m["type"] == "Pods"
        }
        for n in names[role]:
            assert (
                n.startswith("pdserve_worker_") and n.removeprefix("pdserve_worker_") in exported
            ), n
    assert "pdserve_worker_queued_prefill_tokens" in names["prefill"]
    assert {"pdserve_worker_kv_usage", "pdserve_worker_running"} & names["decode"]


@needs_kubectl
def test_external_etcd_drops_the_statefulset():
    docs = _cache.get("external-etcd") or render("external-etcd")
    assert not of_kind(docs, "StatefulSet") and "etcd" not in of_kind(docs, "Service")
    assert of_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_ETCD"] != "etcd:2379"
    full = _cache.get("cpu") or render("cpu")
    sts = of_kind(full, "StatefulSet")["etcd"]
    assert sts["spec"]["volumeClaimTemplates"], "bundled etcd without a PVC"


# ---- hardening (issue 51): what a pod may do beyond its job -------------------------------


def _pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Every workload's pod template, by "<kind>/<name>"."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            out[f"{d['kind']}/{d['metadata']['name']}"] = d["spec"]["template"]
    return out


@needs_kubectl
def test_every_pod_is_hardened(rendered):
    """No service-account token in any pod (no pdserve process talks to the Kubernetes API),
    read-only root filesystems with a size-limited /tmp, no moving image tags, and no process
    that talks to etcd without its own user."""
    name, docs = rendered
    templates = _pod_templates(docs)
    assert {"Deployment/router", "StatefulSet/etcd", "Job/etcd-users"} & set(templates)
    for where, tmpl in templates.items():
        pod = tmpl["spec"]
        assert pod.get("automountServiceAccountToken") is False, (name, where)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {
            c["metadata"]["name"]
            for d in docs
            if d["kind"] == "StatefulSet" and f"StatefulSet/{d['metadata']['name']}" == where
            for c in d["spec"].get("volumeClaimTemplates", [])
        }
        assert volumes.get("tmp", {}).get("emptyDir", {}).get("sizeLimit"), (name, where)
        for c in pod["containers"]:
            assert c["securityContext"].get("readOnlyRootFilesystem") is True, (name, where)
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get("/tmp") == "tmp", (name, where)
            assert set(mounts.values()) <= set(volumes) | claims, (name, where)  # all exist
            image = c["image"]
            tag = image.rpartition(":")[2] if ":" in image else ""
            assert tag and tag not in ("latest", "cuda"), (name, where, image)
            args = " ".join(c.get("command", []) + c.get("args", []))
            if "--etcd=" in args and "etcd-users" not in args:
                assert "--etcd-user=" in args, (name, where)  # never an anonymous etcd client


@needs_kubectl
def test_the_router_trusts_registrations_from_the_pod_network_only(rendered):
    name, docs = rendered
    router = container(of_kind(docs, "Deployment")["router"])
    assert "--allowed-worker-cidrs=$(PDSERVE_POD_CIDR)" in router["args"], name
    cidr = of_kind(docs, "ConfigMap")["pdserve-config"]["data"]["PDSERVE_POD_CIDR"]
    from router.placement.allowed_workers import parse_network

    network = parse_network(cidr)  # a value the operator gives: a network, never "any"
    assert network.prefixlen > 0 and network.is_private, cidr


def _dns_only(rule: dict) -> bool:
    ports = {(p.get("port"), p.get("protocol", "TCP")) for p in rule.get("ports", [])}
    return bool(ports) and ports <= {(53, "UDP"), (53, "TCP")}


@needs_kubectl
def test_egress_goes_to_pdserve_pods_dns_and_etcd_only(rendered):
    """Before: no egress policy, so a pod could send the cluster token, a prompt or KV to any
    address (a forged registration's, the internet)."""
    name, docs = rendered
    pols = list(of_kind(docs, "NetworkPolicy").values())
    assert any(
        p["spec"]["podSelector"] == {}
        and p["spec"].get("policyTypes") == ["Egress"]
        and not p["spec"].get("egress")
        for p in pols
    ), f"{name}: no default-deny egress policy"
    for p in pols:
        for rule in p["spec"].get("egress", []):
            peers = rule.get("to")
            assert peers, (name, p["metadata"]["name"], "egress to everyone")
            for peer in peers:
                assert "ipBlock" not in peer or peer["ipBlock"]["cidr"] not in (
                    "0.0.0.0/0",
                    "::/0",
                ), (name, p["metadata"]["name"])
                inside = "namespaceSelector" not in peer and "ipBlock" not in peer
                etcd_port = {x.get("port") for x in rule.get("ports", [])} == {2379}
                assert inside or _dns_only(rule) or etcd_port, (name, p["metadata"]["name"], rule)
    if name == "external-etcd":
        assert "pdserve-to-external-etcd" in of_kind(docs, "NetworkPolicy"), name
