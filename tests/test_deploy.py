"""The deployment kit (deploy/) agrees with the daemons it deploys.

No container runtime runs here, so these tests check what can be checked without
one: the systemd units with ``systemd-analyze verify``, the HAProxy file with
``haproxy -c``, and the compose file, the Dockerfile and the Kubernetes manifests
loaded with PyYAML against the real command-line parser and configuration
classes: every command parses, every ``TRIO_BROKER_`` variable names a key, every
configuration loads with the environment it is given, and ports, probes, grace
periods and secrets line up. A renamed flag or key fails here.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from trio_broker_daemons.commands.cli import build_parser
from trio_broker_daemons.config.sources import ENV_PREFIX, keys_of
from trio_broker_daemons.config.structure import load_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.config import FylrConfig

from trio_broker.trio.pages import health_pages

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
IMAGE_CONFIG = "/etc/trio-broker/"
"""Where the image has deploy/config/ (the Dockerfile's COPY)."""
CLASSES: dict[str, type[Any]] = {"execserver": ExecserverConfig, "fylr": FylrConfig}
PROBES = {path.path for path in health_pages(lambda: False)}


def parse(argv: list[str]) -> argparse.Namespace:
    """The daemon's own parser on a deployed command (an unknown flag fails the test)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"trio-broker does not accept {argv}")


def local_config(path: str) -> Path:
    """The file in deploy/config/ that the image has at ``path``."""
    assert path.startswith(IMAGE_CONFIG), path
    local = DEPLOY / "config" / path.removeprefix(IMAGE_CONFIG)
    assert local.is_file(), local
    return local


def filled(environ: Mapping[str, Any]) -> dict[str, str]:
    """The environment with compose's ``${NAME:?…}`` interpolations filled with a value."""
    return {name: re.sub(r"\$\{[^}]*\}", "x", str(value)) for name, value in environ.items()}


def check_environment(command: str, environ: Mapping[str, str]) -> None:
    """Every TRIO_BROKER_ variable names a key of the daemon's configuration."""
    keys = {key.lower() for key in keys_of(CLASSES[command])}
    for name in environ:
        if name.startswith(ENV_PREFIX):
            first = name.removeprefix(ENV_PREFIX).split("__")[0].lower()
            assert first in keys, f"{name} names no key of the {command} configuration"


SECRETS = "/run/secrets/"
"""Where compose and the Kubernetes manifest mount the secrets; systemd's are ``%d/``."""

SECRET_FILES = {
    "broker_token": "a-token",
    "fylr_upload_token": "an-upload-token",
    "fylr_read_token": "a-read-token",
    "fylr_operator_token": "an-operator-token",
    "fylr_link_key": "a-link-key-of-at-least-32-characters",
}
"""The secret files a deployment mounts, and what the stand-ins hold."""


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder standing in for the mounted secrets (and systemd's credentials, ``%d``)."""
    folder = tmp_path_factory.mktemp("secrets")
    for name, text in SECRET_FILES.items():
        (folder / name).write_text(text + "\n")
    return folder


def secret_paths(document: Mapping[str, Any], keys: tuple[str, ...] = ()) -> dict[str, str]:
    """Every ``*_file`` key of a configuration document, as the variable that sets it → path."""
    found = {}
    for key, value in document.items():
        if isinstance(value, Mapping):
            found.update(secret_paths(value, (*keys, key)))
        elif key.endswith("_file") and isinstance(value, str):
            found[ENV_PREFIX + "__".join(k.upper() for k in (*keys, key))] = value
    return found


def load(command: str, config: str, environ: Mapping[str, str], secrets: Path) -> Any:
    """The deployed configuration, loaded with the deployed environment.

    The secret files are read from ``secrets`` instead of ``/run/secrets`` (or
    systemd's ``%d``), which only exist where the daemon is deployed.
    """
    check_environment(command, environ)
    local = local_config(config)
    environ = {name: value.replace("%d/", f"{secrets}/") for name, value in environ.items()}
    document = yaml.safe_load(local.read_text())
    for variable, deployed in secret_paths(document).items():
        if variable not in environ:
            assert deployed.startswith(SECRETS), deployed
            environ[variable] = str(secrets / deployed.removeprefix(SECRETS))
    return load_config(local, CLASSES[command], environ=environ)


def check_fylr_secrets(config: FylrConfig, where: str) -> None:
    """A deployed fylr: every role's token, the broker token and the link key from the files."""
    assert config.tokens.missing == (), where
    assert not config.insecure_open_api, where
    assert (config.tokens.upload, config.tokens.read, config.tokens.operator) == (
        SECRET_FILES["fylr_upload_token"],
        SECRET_FILES["fylr_read_token"],
        SECRET_FILES["fylr_operator_token"],
    ), where
    assert config.link_key == SECRET_FILES["fylr_link_key"], where
    assert config.broker_token == SECRET_FILES["broker_token"], where


def fylr_secret_names() -> set[str]:
    """The secret files deploy/config/fylr.yml reads from /run/secrets."""
    document = yaml.safe_load((DEPLOY / "config" / "fylr.yml").read_text())
    return {path.removeprefix(SECRETS) for path in secret_paths(document).values()}


def listen_port(config: Any) -> int:
    port: int = config.port
    return port


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", text)
    assert match is not None, text
    return float(match[1]) * (60 if match[2] == "min" else 1)


# -- the Dockerfile ---------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    lines: list[tuple[str, str]] = []
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
    return lines


def test_the_image_is_multi_stage_non_root_and_runs_the_cli(secrets: Path) -> None:
    """Two stages; the last runs as a non-root user; ENTRYPOINT + CMD is a valid command."""
    lines = dockerfile()
    assert sum(1 for word, _ in lines if word == "FROM") >= 2
    final = lines[max(i for i, (word, _) in enumerate(lines) if word == "FROM") :]
    (user,) = [rest for word, rest in final if word == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    entrypoint = [yaml.safe_load(rest) for word, rest in final if word == "ENTRYPOINT"][-1]
    cmd = [yaml.safe_load(rest) for word, rest in final if word == "CMD"][-1]
    assert entrypoint == ["trio-broker"]
    args = parse(cmd)
    config = load(args.command, args.config, {}, secrets)
    exposed = {int(port) for word, rest in final if word == "EXPOSE" for port in rest.split()}
    assert listen_port(config) in exposed
    for word, rest in lines:
        if word == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"


def test_the_deployed_commands_exist_in_the_image(secrets: Path) -> None:
    """Every absolute program or script a deployed service names is copied into the image."""
    copied = {rest.split()[-1] for word, rest in dockerfile() if word == "COPY"}
    config = load("execserver", IMAGE_CONFIG + "execserver.yml", {}, secrets)
    for name, service in config.services.items():
        assert service.argv is not None
        for element in service.argv:
            if element.startswith("/opt/"):
                assert element in copied, f"service {name}: {element} is not in the image"


# -- systemd ---------------------------------------------------------------------------


def units() -> Iterator[Path]:
    yield from sorted((DEPLOY / "systemd").glob("*.service"))


def directives(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("unit", list(units()), ids=lambda unit: unit.name)
def test_the_systemd_unit_verifies_and_drains(unit: Path, tmp_path: Path, secrets: Path) -> None:
    """systemd-analyze verify is silent; KillMode=mixed; TimeoutStopSec above drain_timeout."""
    found = directives(unit)
    (exec_start,) = found["ExecStart"]
    program, *argv = shlex.split(exec_start)
    args = parse(argv)
    environ = dict(item.split("=", 1) for item in found.get("Environment", []))
    config = load(args.command, args.config, environ, secrets)
    credentials = {line.split(":", 1)[0] for line in found.get("LoadCredential", [])}
    for variable, value in environ.items():
        if value.startswith("%d/"):  # a credential the unit loads
            assert value.removeprefix("%d/") in credentials, variable
    if args.command == "fylr":
        check_fylr_secrets(config, unit.name)
        assert credentials == fylr_secret_names()
    assert found["KillMode"] == ["mixed"]
    (stop,) = found["TimeoutStopSec"]
    if args.command == "execserver":
        assert seconds(stop) > config.drain_timeout
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify needs the program to exist: the installed console script stands in for its path
    installed = Path(sys.executable).parent / "trio-broker"
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace(program, str(installed)))
    result = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


# -- compose and HAProxy ----------------------------------------------------------------


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return document


def daemons_of(services: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for name, service in services.items():
        if service.get("image", "").startswith("trio-broker"):
            yield name, service


def test_the_compose_daemons_agree_with_the_cli_and_their_configuration(secrets: Path) -> None:
    """Each daemon's command parses, its variables name keys, its configuration loads."""
    services = compose()["services"]
    seen = {"execserver": 0, "fylr": 0}
    for name, service in daemons_of(services):
        args = parse(service["command"])
        environ = filled(service.get("environment", {}))
        config = load(args.command, args.config, environ, secrets)
        seen[args.command] += 1
        assert config.name == name
        grace = seconds(service["stop_grace_period"])
        if args.command == "execserver":
            assert grace > config.drain_timeout, name
            assert "broker_token" in service["secrets"]
            assert config.broker_token == "a-token"  # read from the mounted secret
        else:
            check_fylr_secrets(config, name)
            assert set(service["secrets"]) == fylr_secret_names(), name
        assert set(service.get("secrets", [])) <= set(compose()["secrets"]), name
        healthcheck = " ".join(service["healthcheck"]["test"])
        (url,) = re.findall(r"http://[^'\" ]+", healthcheck)
        assert url.endswith(tuple(PROBES)), url
        assert f":{listen_port(config)}/" in url
    assert seen == {"execserver": 2, "fylr": 2}


def test_haproxy_fronts_every_execserver_on_their_port(secrets: Path) -> None:
    """HAProxy's servers are the execserver services on their listen port; the fylrs dial it."""
    services = compose()["services"]
    text = (DEPLOY / "haproxy.cfg").read_text()
    servers = set(re.findall(r"^\s*server \S+ (\S+:\d+)", text, re.MULTILINE))
    (bind,) = re.findall(r"^\s*bind :(\d+)", text, re.MULTILINE)
    assert "option httpchk GET /readyz" in text
    expected = set()
    for name, service in daemons_of(services):
        args = parse(service["command"])
        config = load(args.command, args.config, filled(service.get("environment", {})), secrets)
        if args.command == "execserver":
            expected.add(f"{name}:{listen_port(config)}")
        else:
            assert config.execservers == (f"haproxy:{bind}",)
    assert servers == expected
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed")
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Configuration file is valid" in result.stdout


# -- Kubernetes ------------------------------------------------------------------------


def manifests() -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in manifests() if d.get("kind") == kind]


def env_value(item: Mapping[str, Any]) -> str:
    """A container variable's value: its own, its Secret's, or a pod name for a fieldRef."""
    if "value" in item:
        return str(item["value"])
    source = item["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        (secret,) = [s for s in of_kind("Secret") if s["metadata"]["name"] == ref["name"]]
        return str(secret["stringData"][ref["key"]])
    assert source["fieldRef"]["fieldPath"] == "metadata.name"
    return "pod-0"


def test_the_kustomization_lists_every_manifest() -> None:
    """kubectl apply -k applies every file of the folder."""
    (kustomization,) = of_kind("Kustomization")
    listed = set(kustomization["resources"])
    present = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


@pytest.mark.parametrize("component", ["execserver", "fylr"])
def test_the_kubernetes_deployment_agrees_with_the_daemon(component: str, secrets: Path) -> None:
    """Args parse, the ConfigMap is deploy/config's file, ports, probes, grace and secrets agree."""
    (deployment,) = [
        d
        for d in of_kind("Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = parse(container["args"])
    assert args.command == component
    environ = {item["name"]: env_value(item) for item in container.get("env", [])}
    config = load(component, args.config, environ, secrets)
    # the ConfigMap holds exactly deploy/config's file, mounted where the args look
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (config_volume,) = [n for n, path in mounts.items() if args.config.startswith(path + "/")]
    (config_map,) = [
        m
        for m in of_kind("ConfigMap")
        if m["metadata"]["name"] == volumes[config_volume]["configMap"]["name"]
    ]
    file_name = args.config.rsplit("/", 1)[1]
    assert config_map["data"][file_name] == local_config(args.config).read_text()
    # ports and probes
    (port,) = container["ports"]
    assert port["containerPort"] == listen_port(config)
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"/livez", "/readyz"} <= PROBES
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == port["name"]
    name = deployment["metadata"]["name"]
    (service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == name]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # non-root, as the image's user
    user = [rest for word, rest in dockerfile() if word == "USER"][-1]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == user.split(":")[0]
    # secrets exist with the keys used
    (secret,) = of_kind("Secret")
    keys = set(secret["stringData"])
    for item in container.get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert (ref["name"], ref["key"]) in {(secret["metadata"]["name"], k) for k in keys}
    if component == "execserver":
        assert pod["terminationGracePeriodSeconds"] > config.drain_timeout
        secret_volume = volumes[next(n for n, p in mounts.items() if p == "/run/secrets")]
        assert secret_volume["secret"]["secretName"] == secret["metadata"]["name"]
        paths = {item["path"] for item in secret_volume["secret"]["items"]}
        token_file = local_config(args.config).read_text()
        assert "broker_token_file: /run/secrets/broker_token" in token_file
        assert "broker_token" in paths
    else:
        check_fylr_secrets(config, "kubernetes")
        secret_volume = volumes[next(n for n, p in mounts.items() if p == "/run/secrets")]
        assert secret_volume["secret"]["secretName"] == secret["metadata"]["name"]
        items = secret_volume["secret"]["items"]
        assert {item["path"] for item in items} == fylr_secret_names()
        assert {item["key"] for item in items} <= keys
        (fylr_target,) = config.execservers
        host, _, target_port = fylr_target.rpartition(":")
        (exec_service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == host]
        assert exec_service["spec"]["ports"][0]["port"] == int(target_port)
