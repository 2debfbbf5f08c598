"""The systemd examples in deploy/systemd/ are valid, not just plausible.

Each unit parses as a strict INI file with the sections and keys systemd needs; every
`ExecStart` runs memcached or one of our console scripts; our CLIs accept the
arguments (their real argparse parsers); memcached accepts its arguments for real
(started with them); the example cluster file loads with `load_config`; and, where the
machine has it, `systemd-analyze verify` finds nothing to say.
"""

from __future__ import annotations

import configparser
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lookup_table.config import TOKEN_ENV, load_config
from lookup_table.ops.localcluster import (
    LRU_OPTIONS,
    REQUESTS_PER_EVENT,
    free_port,
    hashpower_for,
    memcached_binary,
)
from tests.conftest import assert_lru_options, memcached_settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CLUSTER_FILE = "/etc/lookup-table/cluster.toml"


def _unit(path: Path) -> configparser.ConfigParser:
    """A unit file as systemd reads it: no interpolation (%i, ${X}), keys case-sensitive."""
    parser = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text(), source=str(path))
    return parser


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile (comments and blank lines skipped)."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        assert match, f"{path.name}:{n}: not KEY=VALUE: {line!r}"
        out[match.group(1)] = match.group(2)
    return out


def _exec_start(path: Path) -> list[str]:
    argv = shlex.split(_unit(path)["Service"]["ExecStart"])
    argv[0] = argv[0].lstrip("-@:+!")  # systemd's ExecStart= prefixes
    return argv


def _expand(argv: list[str], env: dict[str, str], instance: str) -> list[str]:
    """systemd's expansion: %i, ${X} as one word, $X split on white space."""
    out: list[str] = []
    for word in argv:
        word = word.replace("%i", instance)
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            out += env.get(whole.group(1), "").split()
            continue
        out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m.group(1)], word))
    return out


def _env_files(path: Path) -> list[Path]:
    """The example files of the unit's EnvironmentFile= (installed under /etc/lookup-table)."""
    value = _unit(path)["Service"].get("EnvironmentFile", "")
    files = []
    for name in value.split():
        name = name.lstrip("-")
        assert name.startswith("/etc/lookup-table/"), name
        files.append(SYSTEMD / Path(name).name)
    return files


def test_the_examples_are_there() -> None:
    names = {p.name for p in SYSTEMD.iterdir()}
    assert {
        "lookup-table-memcached@.service",
        "lookup-table-optimizer@.service",
        "cluster.toml",
        "memcached.env",
        "optimizer.env",
        "README.md",
    } <= names


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_has_the_sections_and_keys_systemd_needs(path: Path) -> None:
    unit = _unit(path)
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    assert unit["Unit"]["Description"]
    assert "network-online.target" in unit["Unit"]["After"].split()
    service = unit["Service"]
    assert service["Type"] == "simple"
    assert service["User"] == service["Group"] == "lookup-table"  # never root
    assert service["ExecStart"].startswith("/")  # absolute path, as systemd requires
    assert service["Restart"] in ("always", "on-failure")
    assert service["NoNewPrivileges"] == "yes"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert path.name.endswith("@.service")  # templates: the instance is the port or replica
    for env in _env_files(path):
        assert env.is_file(), f"{path.name}: no example for {env.name}"


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_exec_start_runs_memcached_or_one_of_our_console_scripts(path: Path) -> None:
    program = Path(_exec_start(path)[0]).name
    assert program == "memcached" or program in SCRIPTS, program


@pytest.mark.parametrize(
    "path", [p for p in UNITS if Path(_exec_start(p)[0]).name in SCRIPTS], ids=lambda p: p.name
)
def test_our_cli_accepts_its_arguments(path: Path) -> None:
    argv = _exec_start(path)
    env = {k: v for f in _env_files(path) for k, v in _env_file(f).items()}
    args = _expand(argv[1:], env, "0")
    module, _, _ = SCRIPTS[Path(argv[0]).name].partition(":")
    parser = importlib.import_module(module)._parser()
    try:
        parsed = parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{Path(argv[0]).name} rejects {args}: exit {exc.code}")
    assert parsed.config == CLUSTER_FILE
    if Path(argv[0]).name == "lookup-table-optimizer":
        assert parsed.replica == 0
        assert "--replica %i" in _unit(path)["Service"]["ExecStart"]


def test_the_optimizer_gets_the_token_from_its_environment_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = SYSTEMD / "lookup-table-optimizer@.service"
    assert _unit(path)["Service"]["Restart"] == "always"
    env = {k: v for f in _env_files(path) for k, v in _env_file(f).items()}
    assert set(env) == {TOKEN_ENV}
    assert env[TOKEN_ENV]
    monkeypatch.setenv(TOKEN_ENV, env[TOKEN_ENV])
    config = load_config(SYSTEMD / "cluster.toml")
    assert config.token == env[TOKEN_ENV]  # the file's `token` is empty: the env's is used


def test_memcached_unit_passes_the_no_eviction_flag_and_its_settings() -> None:
    path = SYSTEMD / "lookup-table-memcached@.service"
    argv = _exec_start(path)
    assert Path(argv[0]).name == "memcached"
    assert "-M" in argv
    pairs = dict(zip(argv[1:], argv[2:], strict=False))
    assert pairs["-p"] == "%i"
    assert pairs["-U"] == "0"
    assert pairs["-m"] == "${MEMCACHED_MEMORY_MB}"
    assert pairs["-l"] == "${MEMCACHED_LISTEN}"
    assert pairs["-c"] == "${MEMCACHED_MAX_CONNECTIONS}"
    assert pairs["-R"] == "${MEMCACHED_REQUESTS_PER_EVENT}"
    assert pairs["-o"] == f"hashpower=${{MEMCACHED_HASHPOWER}},{LRU_OPTIONS}"
    env = _env_file(SYSTEMD / "memcached.env")
    assert int(env["MEMCACHED_MEMORY_MB"]) > 0
    # the hash table sized for the example's memory, as local nodes are
    assert env["MEMCACHED_HASHPOWER"] == str(hashpower_for(int(env["MEMCACHED_MEMORY_MB"])))
    assert int(env["MEMCACHED_MAX_CONNECTIONS"]) > 0
    assert int(env["MEMCACHED_THREADS"]) > 0


@pytest.mark.integration  # starts a real memcached
@pytest.mark.timeout(30)
def test_memcached_accepts_the_unit_arguments_for_real() -> None:
    """Start memcached with the unit's command line (small -m, local address, free port)."""
    path = SYSTEMD / "lookup-table-memcached@.service"
    env = {
        **_env_file(SYSTEMD / "memcached.env"),
        "MEMCACHED_MEMORY_MB": "32",
        "MEMCACHED_HASHPOWER": str(hashpower_for(32)),
        "MEMCACHED_LISTEN": "127.0.0.1",
    }
    port = free_port()
    argv = _expand(_exec_start(path), env, str(port))
    argv[0] = memcached_binary()
    settings = memcached_settings(argv, port)  # the unit runs as User=lookup-table
    assert settings["evictions"] == "off"  # -M
    assert settings["maxbytes"] == str(32 * 2**20)
    assert settings["tcpport"] == str(port)
    assert settings["udpport"] == "0"
    assert settings["maxconns"] == env["MEMCACHED_MAX_CONNECTIONS"]
    assert settings["num_threads"] == env["MEMCACHED_THREADS"]
    assert settings["reqs_per_event"] == env["MEMCACHED_REQUESTS_PER_EVENT"]
    assert env["MEMCACHED_REQUESTS_PER_EVENT"] == str(REQUESTS_PER_EVENT)
    assert settings["hashpower_init"] == env["MEMCACHED_HASHPOWER"]
    assert_lru_options(settings)


def test_the_example_cluster_file_loads_and_matches_the_units() -> None:
    config = load_config(SYSTEMD / "cluster.toml")  # tomllib and our validation
    assert config.token == "" or os.environ.get(TOKEN_ENV)  # no secret in the file
    assert len(config.memcached) >= 2 and len(config.optimizers) >= 2
    assert all(not node.host.startswith("127.") for node in config.memcached)  # a real fleet
    assert {t.id_type for t in config.tables} == {"int64", "string"}
    raw = tomllib.loads((SYSTEMD / "cluster.toml").read_text())
    assert raw["token"] == ""


@pytest.mark.integration  # runs systemd-analyze
@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_finds_nothing(path: Path, tmp_path: Path) -> None:
    """As an instance (a template itself cannot be verified), with programs that exist here."""
    program = Path(_exec_start(path)[0]).name
    if program == "memcached":
        real = memcached_binary()
    else:
        real = shutil.which(program, path=str(Path(sys.executable).parent)) or shutil.which(program)
        if real is None:
            pytest.skip(f"{program} is not installed here (pip install -e .)")
    text = path.read_text()
    text = re.sub(rf"^ExecStart=\S*{re.escape(program)}\b", f"ExecStart={real}", text, flags=re.M)
    instance = tmp_path / path.name.replace("@.", "@0.")
    instance.write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(instance)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if instance.name in ln]
    assert proc.returncode == 0 and ours == [], proc.stdout + proc.stderr


def test_the_demo_cluster_file_points_to_pages_that_exist() -> None:
    """Issue: deploy/demo.toml sent readers to a README section that does not exist."""
    text = (ROOT / "deploy" / "demo.toml").read_text()
    pages = re.findall(r"docs/[\w./-]+\.md", text)
    assert "docs/configuration.md" in pages
    assert all((ROOT / page).is_file() for page in pages), pages
    assert "README" not in text
    load_config(ROOT / "deploy" / "demo.toml")
