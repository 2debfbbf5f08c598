"""The Kubernetes manifests in deploy/k8s/ are valid, not just plausible.

Every object against the Kubernetes 1.28 and 1.30 schemas, offline and strict; every
command line of ours through our real argparse parsers, once per pod, with `$(VAR)`
expanded as the kubelet does; memcached's flags, the ConfigMap's cluster file, the counts
that must agree, the trainers' wait for the fleet and the Dockerfile. docs/kubernetes.md
lists what each check covers.
"""

from __future__ import annotations

import copy
import http.server
import importlib
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from lookup_table.config import TOKEN_ENV, ClusterConfig, load_config
from lookup_table.ops.localcluster import (
    REQUESTS_PER_EVENT,
    free_port,
    hashpower_for,
    memcached_binary,
    memcached_options,
)
from tests.conftest import assert_lru_options, memcached_settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSIONS = ("1.28", "1.30")
BY_HAND = ("restore-job.yaml",)  # applied by hand, not listed in the kustomization
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
IMAGE = f"lookup-table:{PYPROJECT['project']['version']}"
SECRET = ("lookup-table-token", "token")  # the Secret (name, key) that holds the token

Obj = dict[str, Any]


def _documents(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _objects() -> dict[tuple[str, str], Obj]:
    """Every object of every manifest, by (kind, name); a name used twice is an error."""
    out: dict[tuple[str, str], Obj] = {}
    for path in MANIFESTS:
        for doc in _documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{path.name}: {key} is defined twice"
            out[key] = doc
    return out


OBJECTS = _objects()


def _one(kind: str, name: str) -> Obj:
    assert (kind, name) in OBJECTS, f"no {kind} {name} in deploy/k8s"
    return OBJECTS[(kind, name)]


def _cluster_file() -> str:
    text: str = _one("ConfigMap", "lookup-table-cluster")["data"]["cluster.toml"]
    return text


def _config(tmp_path: Path) -> ClusterConfig:
    path = tmp_path / "cluster.toml"
    path.write_text(_cluster_file())
    return load_config(path)


# ---------------------------------------------------------------- pods as controllers make them


def _pod_template(obj: Obj) -> Obj:
    spec = obj["spec"]
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template: Obj = spec["template"]
    return template


def _pods(obj: Obj) -> Iterator[tuple[int, Obj]]:
    """(index, pod metadata) of each pod the controller creates: name, labels, annotations.

    StatefulSet pods are `<name>-<ordinal>` labelled `apps.kubernetes.io/pod-index`; the
    pods of an Indexed Job carry the completion index as an annotation (and label), every
    Job's pods `batch.kubernetes.io/job-name`; a CronJob's Job is `<name>-<minute>`.
    """
    template = _pod_template(obj)
    labels = dict(template.get("metadata", {}).get("labels", {}))
    annotations = dict(template.get("metadata", {}).get("annotations", {}))
    name = obj["metadata"]["name"]
    kind = obj["kind"]
    if kind == "StatefulSet":
        for i in range(obj["spec"]["replicas"]):
            pod_labels = {
                **labels,
                "apps.kubernetes.io/pod-index": str(i),
                "statefulset.kubernetes.io/pod-name": f"{name}-{i}",
            }
            yield i, {"name": f"{name}-{i}", "labels": pod_labels, "annotations": annotations}
        return
    job_name = f"{name}-29180520" if kind == "CronJob" else name
    spec = obj["spec"]["jobTemplate"]["spec"] if kind == "CronJob" else obj["spec"]
    indexed = spec.get("completionMode") == "Indexed"
    for i in range(spec.get("completions", 1)):
        pod_labels = {**labels, "batch.kubernetes.io/job-name": job_name, "job-name": job_name}
        pod_annotations = dict(annotations)
        if indexed:
            pod_labels["batch.kubernetes.io/job-completion-index"] = str(i)
            pod_annotations["batch.kubernetes.io/job-completion-index"] = str(i)
        yield (
            i,
            {"name": f"{job_name}-{i}-x7k2p", "labels": pod_labels, "annotations": pod_annotations},
        )


def _containers(obj: Obj) -> list[Obj]:
    spec = _pod_template(obj)["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion: $(VAR) from env, $$ is a literal $, unknown refs stay."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(one, text)


_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def _env(container: Obj, pod: Obj) -> dict[str, str]:
    """The container's environment in that pod (secrets as placeholders)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var:
            env[name] = _expand(var["value"], env)  # refers to the vars before it only
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path in ("metadata.name", "metadata.namespace"):
                env[name] = pod["name"] if path == "metadata.name" else "default"
                continue
            match = _FIELD.fullmatch(path)
            assert match, f"{container['name']}: unsupported fieldPath {path}"
            where, key = match.groups()
            # the kubelet would give "" for a missing one: a wrong key must fail here
            assert key in pod[where], f"{container['name']}: the pod has no {where[:-1]} {key}"
            env[name] = pod[where][key]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[name] = f"<secret {ref['name']}/{ref['key']}>"
        else:
            raise AssertionError(f"{container['name']}: unsupported env source {source}")
    return env


def _argv(container: Obj, pod: Obj) -> list[str]:
    env = _env(container, pod)
    return [_expand(str(word), env) for word in [*container["command"], *container.get("args", [])]]


def _ours() -> list[tuple[Obj, Obj]]:
    """(object, container) of every container that runs one of our console scripts."""
    return [
        (obj, c)
        for obj in OBJECTS.values()
        if obj["kind"] in ("StatefulSet", "Job", "CronJob")
        for c in _containers(obj)
        if c.get("command") and c["command"][0] in SCRIPTS
    ]


def _id(pair: tuple[Obj, Obj]) -> str:
    return f"{pair[0]['metadata']['name']}/{pair[1]['name']}"


def _parse(argv: list[str]) -> Any:
    module, _, _ = SCRIPTS[argv[0]].partition(":")
    parser = importlib.import_module(module)._parser()
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{argv[0]} rejects {argv[1:]}: exit {exc.code}")


def _parsed(obj: Obj, name: str) -> list[Any]:
    """The parsed command line of container `name` in each pod of `obj`."""
    container = next(c for c in _containers(obj) if c["name"] == name)
    return [_parse(_argv(container, pod)) for _, pod in _pods(obj)]


def _mib(quantity: str) -> float:
    """A Kubernetes memory quantity in MiB (binary or decimal suffixes)."""
    units = {"Ki": 2**-10, "Mi": 1, "Gi": 2**10, "Ti": 2**20, "k": 1e3, "M": 1e6, "G": 1e9}
    units.update({k: v / 2**20 for k, v in units.items() if k in ("k", "M", "G")})
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / 2**20  # plain bytes


# ---------------------------------------------------------------- the files


def test_the_kustomization_lists_every_manifest_but_the_by_hand_ones() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert set(resources) == {p.name for p in MANIFESTS} - set(BY_HAND)
    assert all((K8S / name).is_file() for name in BY_HAND)
    assert "namePrefix" not in kustomization and "nameSuffix" not in kustomization
    [image] = kustomization["images"]
    assert f"{image['name']}:{image['newTag']}" == IMAGE


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here")
@pytest.mark.timeout(60)
def test_kustomize_builds_every_listed_object() -> None:
    proc = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=50, check=False
    )
    assert proc.returncode == 0, proc.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(proc.stdout) if d}
    listed = {key for p in MANIFESTS if p.name not in BY_HAND for key in _keys(p)}
    assert built == listed


def _keys(path: Path) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in _documents(path)}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_object_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    for doc in _documents(path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {where}: {exc}")


def test_the_schema_check_rejects_what_the_api_server_would() -> None:
    """The validation used above is strict: an unknown field or a wrong type fails."""
    good = _one("StatefulSet", "lookup-table-memcached")
    kubernetes_validate.validate(good, KUBERNETES_VERSIONS[0], strict=True)
    typo = copy.deepcopy(good)
    typo["spec"]["template"]["spec"]["containers"][0]["imagee"] = "memcached"
    string = copy.deepcopy(good)
    string["spec"]["replicas"] = "2"
    for bad in (typo, string):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[0], strict=True)


# ---------------------------------------------------------------- our command lines


@pytest.mark.parametrize("pair", _ours(), ids=_id)
def test_our_console_scripts_accept_their_arguments_in_every_pod(
    pair: tuple[Obj, Obj],
) -> None:
    obj, container = pair
    assert container["image"] == IMAGE
    for _, pod in _pods(obj):
        argv = _argv(container, pod)
        assert not any("$(" in word for word in argv), f"unresolved reference in {argv}"
        parsed = _parse(argv)
        assert parsed.config == "/etc/lookup-table/cluster.toml"


@pytest.mark.parametrize("pair", _ours(), ids=_id)
def test_the_config_file_each_command_reads_is_the_configmap(pair: tuple[Obj, Obj]) -> None:
    obj, container = pair
    _, pod = next(_pods(obj))
    config = Path(_parse(_argv(container, pod)).config)
    [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config.parent]
    assert mount.get("readOnly") is True
    volumes = {v["name"]: v for v in _pod_template(obj)["spec"]["volumes"]}
    configmap = volumes[mount["name"]]["configMap"]["name"]
    assert config.name in _one("ConfigMap", configmap)["data"]


def test_the_optimizer_replica_index_is_the_pod_ordinal(tmp_path: Path) -> None:
    sts = _one("StatefulSet", "lookup-table-optimizer")
    replicas = [args.replica for args in _parsed(sts, "optimizer")]
    assert replicas == list(range(sts["spec"]["replicas"]))
    # ... and partition K listens where the cluster file says replica K is
    config = _config(tmp_path)
    service = sts["spec"]["serviceName"]
    for k, url in enumerate(config.optimizers):
        assert urlsplit(url).hostname == f"{sts['metadata']['name']}-{k}.{service}"


def test_the_indexed_job_maps_the_completion_index_to_the_worker_index() -> None:
    job = _one("Job", "lookup-table-train")
    assert job["spec"]["completionMode"] == "Indexed"
    trainer = next(c for c in _containers(job) if c["name"] == "trainer")
    args = trainer["args"]
    assert args[args.index("--worker-index") + 1] == "$(JOB_COMPLETION_INDEX)"
    parsed = _parsed(job, "trainer")
    assert [a.worker_index for a in parsed] == list(range(job["spec"]["completions"]))
    from trainer.cli import _check_args

    for a in parsed:
        _check_args(a)  # the trainer's own check: 0 <= worker index < workers


def test_the_trainer_count_agrees_everywhere(tmp_path: Path) -> None:
    job = _one("Job", "lookup-table-train")
    workers = _config(tmp_path).workers
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == workers
    assert {a.num_workers for a in _parsed(job, "trainer")} == {workers}


def test_the_trainers_find_a_table_for_every_column_of_their_data(tmp_path: Path) -> None:
    from trainer.cli import _source

    config = _config(tmp_path)
    args = _parsed(_one("Job", "lookup-table-train"), "trainer")[0]
    schema = _source(args.data, args).schema
    columns = {**schema.categorical, **schema.multivalued}
    assert columns
    for name, id_type in columns.items():
        assert config.table(name).id_type == id_type


def test_the_checkpoints_go_to_a_new_directory_on_the_volume_per_scheduled_run() -> None:
    cron = _one("CronJob", "lookup-table-checkpoint")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    [container] = _containers(cron)
    spec = _pod_template(cron)["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    [(_, pod)] = list(_pods(cron))
    parsed = _parse(_argv(container, pod))
    assert parsed.command == "save"
    directory = Path(parsed.dir)
    assert directory.name == pod["labels"]["batch.kubernetes.io/job-name"]
    [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == directory.parent]
    assert not mount.get("readOnly", False)
    _one("PersistentVolumeClaim", claims[mount["name"]])
    # the restore Job reads from the same volume
    restore = _one("Job", "lookup-table-restore")
    claims_r = [
        v["persistentVolumeClaim"]["claimName"]
        for v in _pod_template(restore)["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims_r == [claims[mount["name"]]]
    assert _parsed(restore, "restore")[0].command == "restore"


# ---------------------------------------------------------------- the cluster file


def test_the_configmap_cluster_file_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    config = _config(tmp_path)
    assert config.token == ""  # no secret in a ConfigMap
    assert tomllib.loads(_cluster_file())["token"] == ""
    monkeypatch.setenv(TOKEN_ENV, "from-the-secret")
    assert _config(tmp_path).token == "from-the-secret"


def test_the_memcached_nodes_are_the_statefulset_pods_by_their_stable_names(tmp_path: Path) -> None:
    sts = _one("StatefulSet", "lookup-table-memcached")
    config = _config(tmp_path)
    service = sts["spec"]["serviceName"]
    [container] = _containers(sts)
    port = container["ports"][0]["containerPort"]
    expected = [
        f"{sts['metadata']['name']}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])
    ]
    assert list(config.node_addresses) == expected


@pytest.mark.parametrize("name", ["lookup-table-memcached", "lookup-table-optimizer"])
def test_each_statefulset_has_its_headless_service(name: str) -> None:
    sts = _one("StatefulSet", name)
    service = _one("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = _pod_template(sts)["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert service["spec"]["selector"].items() <= labels.items()
    [container] = sts["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]


def test_the_optimizer_listens_on_its_url_port_with_probes_and_metrics(tmp_path: Path) -> None:
    sts = _one("StatefulSet", "lookup-table-optimizer")
    config = _config(tmp_path)
    [container] = _containers(sts)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {urlsplit(url).port for url in config.optimizers} == {ports["http"]}
    for args in _parsed(sts, "optimizer"):
        assert args.host == "0.0.0.0" and args.port in (None, ports["http"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["port"] in ("http", ports["http"])
    assert "httpGet" not in container["livenessProbe"]  # a memcached outage is no reason to restart
    annotations = _pod_template(sts)["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_token_comes_from_the_secret_wherever_the_service_is_called() -> None:
    needs = {
        ("lookup-table-optimizer", "optimizer"),
        ("lookup-table-train", "trainer"),
        ("lookup-table-checkpoint", "checkpoint"),
        ("lookup-table-restore", "restore"),
    }
    seen = set()
    for obj in OBJECTS.values():
        if obj["kind"] not in ("StatefulSet", "Job", "CronJob"):
            continue
        for container in _containers(obj):
            env = {v["name"]: v for v in container.get("env", [])}
            if TOKEN_ENV in env:
                ref = env[TOKEN_ENV]["valueFrom"]["secretKeyRef"]  # never a literal value
                assert (ref["name"], ref["key"]) == SECRET
                assert not ref.get("optional", False)
                seen.add((obj["metadata"]["name"], container["name"]))
    assert seen == needs


# ---------------------------------------------------------------- memcached


def _memcached() -> tuple[Obj, list[str]]:
    sts = _one("StatefulSet", "lookup-table-memcached")
    [container] = _containers(sts)
    return container, [*container["command"], *container["args"]]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_memcached_runs_the_official_image_with_no_eviction_and_room_for_its_memory() -> None:
    container, argv = _memcached()
    assert container["image"].startswith("memcached:1.6")  # the meta protocol needs >= 1.6
    assert argv[0] == "memcached"
    assert "-M" in argv
    memory_mb = int(_flag(argv, "-m"))
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    # RSS is up to 1.28 x what -m holds (docs/operations.md), plus buffers
    assert _mib(limits["memory"]) >= 1.28 * memory_mb + 64
    assert requests["memory"] == limits["memory"]
    assert int(_flag(argv, "-p")) == container["ports"][0]["containerPort"]
    assert _flag(argv, "-U") == "0"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"]["port"] in ("memcached", int(_flag(argv, "-p")))


def test_memcached_is_never_restarted_or_evicted_behind_the_operators_back() -> None:
    """A restarted node is an empty node: no rolling update, no voluntary eviction."""
    sts = _one("StatefulSet", "lookup-table-memcached")
    assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"
    [pdb] = [o for o in OBJECTS.values() if o["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 0
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


@pytest.mark.integration  # starts a real memcached
@pytest.mark.timeout(30)
def test_memcached_accepts_the_manifest_arguments_for_real() -> None:
    """memcached with the manifest's command line (on a free local port)."""
    _, argv = _memcached()
    port = free_port()
    argv = [memcached_binary(), *argv[1:]]
    argv[argv.index("-p") + 1] = str(port)
    assert "-l" not in argv  # the pod listens on its own address
    argv += ["-l", "127.0.0.1"]
    settings = memcached_settings(argv, port)  # the image runs as its memcache user
    assert settings["evictions"] == "off"  # -M
    assert settings["maxbytes"] == str(int(_flag(argv, "-m")) * 2**20)
    assert settings["maxconns"] == _flag(argv, "-c")
    assert settings["num_threads"] == _flag(argv, "-t")
    assert settings["reqs_per_event"] == _flag(argv, "-R") == str(REQUESTS_PER_EVENT)
    assert settings["udpport"] == "0"
    # the hash table sized at start for the node's -m, as local nodes are
    assert _flag(argv, "-o") == memcached_options(int(_flag(argv, "-m")))
    assert settings["hashpower_init"] == str(hashpower_for(int(_flag(argv, "-m"))))
    assert_lru_options(settings)


# ---------------------------------------------------------------- the trainers' wait


class _Healthz(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.timeout(30)
def test_the_trainers_wait_until_the_replicas_are_healthy(tmp_path: Path) -> None:
    """The init container's script, run here against a stand-in /healthz: 503, then 200."""
    job = _one("Job", "lookup-table-train")
    [wait] = _pod_template(job)["spec"]["initContainers"]
    _, pod = next(_pods(job))
    argv = _argv(wait, pod)
    assert argv[:2] == ["python", "-c"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cluster = tmp_path / "cluster.toml"
    text = re.sub(
        r"(?s)optimizers = \[.*?\]",
        f'optimizers = ["http://127.0.0.1:{server.server_address[1]}"]',
        _cluster_file(),
    )
    cluster.write_text(text)
    assert argv[3] == "/etc/lookup-table/cluster.toml"
    argv = [sys.executable, *argv[1:3], str(cluster)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    _Healthz.status = 503
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out = proc.stdout.readline() if proc.stdout else b""  # blocks until it has tried
        assert b"waiting for the optimizer replicas" in out, out
        assert proc.poll() is None
        _Healthz.status = 200
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- pods and the image


def test_every_pod_runs_as_a_non_root_user_without_privileges() -> None:
    for obj in OBJECTS.values():
        if obj["kind"] not in ("StatefulSet", "Job", "CronJob"):
            continue
        security = _pod_template(obj)["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
        for container in _containers(obj):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "memory" in container["resources"]["limits"]
            if container["image"] == IMAGE:
                assert security["runAsUser"] == _dockerfile_uid()


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def _dockerfile_uid() -> int:
    [user] = [rest for instruction, rest in _dockerfile() if instruction == "USER"]
    return int(user.split(":")[0])


def _glob(pattern: str) -> str:
    """A .dockerignore pattern as a regex: * and ? stop at /, **/ is any directories."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in "*?":
            out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob(pattern.lstrip("!").strip("/"))
        if any(re.fullmatch(regex, c) for c in candidates):
            ignored = not negate
    return ignored


def test_the_image_builds_the_package_from_what_the_context_holds() -> None:
    steps = _dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(rest for instruction, rest in steps if instruction == "RUN")
    assert 'pip install ".[train]"' in runs
    copied = {
        src
        for instruction, rest in steps
        if instruction == "COPY"
        for src in rest.split()[:-1]
        if not src.startswith("--")
    }
    packages = {
        p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], *packages}
    assert needed <= copied, f"the Dockerfile does not COPY {needed - copied}"
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not _dockerignored(src, patterns), f".dockerignore leaves {src} out"
    for package in packages:
        for file in (ROOT / package).rglob("*.py"):
            rel = file.relative_to(ROOT).as_posix()
            assert not _dockerignored(rel, patterns), f".dockerignore leaves {rel} out"
    for kept_out in (
        ".venv/bin/python",
        ".git/HEAD",
        "run/node.log",
        "lookup_table/__pycache__/x.pyc",
    ):
        assert _dockerignored(kept_out, patterns), kept_out


def test_only_our_pods_may_reach_memcached() -> None:
    """The NetworkPolicy selects the memcached pods and admits every pod that uses them."""
    policy = _one("NetworkPolicy", "lookup-table-memcached")
    sts = _one("StatefulSet", "lookup-table-memcached")
    labels = _pod_template(sts)["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    [rule] = policy["spec"]["ingress"]
    [source] = rule["from"]
    allowed = source["podSelector"]["matchLabels"]
    [port] = rule["ports"]
    assert port["port"] == int(_flag(_memcached()[1], "-p"))
    clients = [obj for obj, _ in _ours()]
    assert {o["metadata"]["name"] for o in clients} >= {
        "lookup-table-optimizer",
        "lookup-table-train",
        "lookup-table-init",
        "lookup-table-checkpoint",
        "lookup-table-restore",
    }
    for obj in clients:
        pod_labels = _pod_template(obj)["metadata"]["labels"]
        assert allowed.items() <= pod_labels.items(), obj["metadata"]["name"]
