"""deploy/k8s/overlays/lws: the workers as LeaderWorkerSets (leaderworkerset.x-k8s.io/v1). The
rendered overlay validates (LeaderWorkerSet against its vendored CRD schema); its worker pods
pass every check the Deployment overlays pass (test_k8s.py's, run on a view of each
LeaderWorkerSet's pod template as a Deployment); and what the overlay adds holds: one rank per
group until pdserve's tensor parallelism lands, whole-group restarts, startup probes that wait
for long weight loads, in-memory /dev/shm, the model cache volume with PDSERVE_CACHE on it, and
KEDA scaling the LeaderWorkerSets with no worker Deployment or HPA left."""

from __future__ import annotations

import pytest
import test_k8s as k8s
from test_k8s import _args, _env, container, needs_kubectl, of_kind, render

_docs: list[dict] = []


def lws() -> list[dict]:
    if not _docs:
        _docs.extend(render("lws"))
    return _docs


def deployment_view(docs: list[dict]) -> list[dict]:
    """Each LeaderWorkerSet as the Deployment of its group's pod template (size 1: the leader
    runs the worker template), so the Deployment checks apply to its pods."""
    out = []
    for d in docs:
        if d["kind"] != "LeaderWorkerSet":
            out.append(d)
            continue
        tmpl = d["spec"]["leaderWorkerTemplate"]
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": d["metadata"],
                "spec": {
                    "selector": {"matchLabels": {"app.kubernetes.io/name": d["metadata"]["name"]}},
                    "template": tmpl.get("leaderTemplate") or tmpl["workerTemplate"],
                },
            }
        )
    return out


@needs_kubectl
@pytest.mark.parametrize(
    "check",
    [
        k8s.test_renders_and_validates,
        k8s.test_separate_worker_deployments,
        k8s.test_workers_advertise_pod_ip_and_drain_in_grace_period,
        k8s.test_speculative_config_on_decode_workers_only_off_by_default,
        k8s.test_kv_cache_dtype_is_one_setting_for_workers_of_both_roles,
        k8s.test_router_ready_on_health_and_key_from_secret,
        k8s.test_the_router_and_every_worker_get_the_cluster_token_from_one_secret,
        k8s.test_a_job_makes_etcds_users_with_every_password_from_a_secret,
        k8s.test_the_router_and_every_worker_get_their_own_etcd_user_from_a_secret,
        k8s.test_only_router_reachable_from_outside,
        k8s.test_every_pod_is_hardened,
        k8s.test_the_router_trusts_registrations_from_the_pod_network_only,
        k8s.test_egress_goes_to_pdserve_pods_dns_and_etcd_only,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_the_worker_groups_pass_the_deployment_checks(check):
    docs = lws() if check is k8s.test_renders_and_validates else deployment_view(lws())
    check(("lws", docs))


@needs_kubectl
def test_gpus_on_the_worker_groups_only():
    k8s.test_gpu_only_on_workers(("gpu", deployment_view(lws())))  # "gpu": GPUs expected


@needs_kubectl
def test_groups_are_one_rank_restarted_whole_and_patient_with_weight_loads():
    sets = of_kind(lws(), "LeaderWorkerSet")
    assert set(sets) == set(k8s.WORKERS)
    assert not set(k8s.WORKERS) & set(of_kind(lws(), "Deployment"))
    assert not of_kind(lws(), "HorizontalPodAutoscaler")
    config = of_kind(lws(), "ConfigMap")["pdserve-config"]["data"]
    for role, s in sets.items():
        tmpl = s["spec"]["leaderWorkerTemplate"]
        assert tmpl["size"] == 1, role  # single rank until tensor parallelism lands
        assert tmpl["restartPolicy"] == "RecreateGroupOnPodRestart", role
        pod = tmpl["workerTemplate"]["spec"]
        c = container({"spec": {"template": tmpl["workerTemplate"]}})
        assert c["image"] == "pdserve:0.1.0-cuda", role
        probe = c["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60, role
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"], role
        cache = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
        assert cache in of_kind(lws(), "PersistentVolumeClaim"), role
        assert config["PDSERVE_CACHE"].startswith("/models/"), config
        assert _args(c)["model"] == "$(PDSERVE_MODEL)" and "PDSERVE_MODEL" in config, role
        assert pod["securityContext"]["fsGroup"] == 10001, role
        assert _env(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    router = container(of_kind(lws(), "Deployment")["router"])
    assert _args(router)["model"] == "$(PDSERVE_MODEL)"  # the workers' tokenizer
    pvc = of_kind(lws(), "PersistentVolumeClaim")["pdserve-model-cache"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


@needs_kubectl
def test_keda_scales_the_leaderworkersets():
    for role, so in of_kind(lws(), "ScaledObject").items():
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": role,
        }


@needs_kubectl
def test_the_router_reads_the_model_volume_and_cannot_write_it():
    router = of_kind(lws(), "Deployment")["router"]
    pod = router["spec"]["template"]["spec"]
    c = container(router)
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
    assert mount["readOnly"] is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PDSERVE_CACHE"].startswith("/tmp/")  # what it prepares goes to its scratch
