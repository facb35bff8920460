"""Where configuration values come from: the file's folder, the environment, secret files."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from trio_broker_daemons.config.structure import load_config
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.config import ExecserverConfig, TlsConfig
from trio_broker_daemons.fylr.config import FylrConfig

NOOP = "services:\n  probe: {builtin: noop}\n"


def write(folder: Path, text: str, name: str = "exec.yml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A working directory that is not the configuration's folder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        yield cwd
    finally:
        os.chdir(old)


def load(path: Path, environ: Mapping[str, str] | None = None) -> ExecserverConfig:
    return ExecserverConfig.from_yaml(path, environ=environ)


def error(path: Path, environ: Mapping[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, environ)
    return str(info.value)


# -- paths relative to the file ------------------------------------------------------


def test_relative_paths_are_relative_to_the_file(tmp_path: Path, elsewhere: Path) -> None:
    """temp_dir and the TLS files written relative resolve against the file's folder."""
    folder = tmp_path / "etc"
    path = write(folder, "temp_dir: jobs\ntls: {cert: tls/c.pem, key: /abs/k.pem}\n" + NOOP)
    config = load(Path(os.path.relpath(path, elsewhere)))
    assert config.temp_dir == folder / "jobs"
    assert config.tls == TlsConfig(cert=folder / "tls/c.pem", key=Path("/abs/k.pem"))


def test_config_dir_in_argv_is_the_files_folder(tmp_path: Path, elsewhere: Path) -> None:
    """{config_dir} becomes the file's folder; {{config_dir}} stays literal text."""
    folder = tmp_path / "with {braces}"
    path = write(
        folder,
        """
        services:
          convert:
            argv: [python3, "{config_dir}/convert.py", "{{config_dir}}", "{size}", rel/x.py]
        """,
    )
    argv = load(path).services["convert"].argv
    assert argv is not None
    assert argv.fill({"size": "9"}) == (
        "python3",
        f"{folder}/convert.py",
        "{config_dir}",
        "9",
        "rel/x.py",
    )
    assert argv.placeholders == {"size"}


def test_config_dir_may_name_the_program(tmp_path: Path) -> None:
    """argv[0] may be {config_dir}/tool: the program is still fixed by the configuration."""
    path = write(tmp_path, 'services:\n  tool: {argv: ["{config_dir}/bin/tool", "-v"]}\n')
    argv = load(path).services["tool"].argv
    assert argv is not None
    assert argv.fill({})[0] == f"{tmp_path}/bin/tool"


def test_a_document_not_from_a_file_keeps_paths_and_uses_the_working_directory(
    elsewhere: Path,
) -> None:
    """from_mapping keeps relative paths as written; {config_dir} is the working directory."""
    config = ExecserverConfig.from_mapping(
        {"temp_dir": "jobs", "services": {"s": {"argv": ["{config_dir}/run"]}}}
    )
    assert config.temp_dir == Path("jobs")
    argv = config.services["s"].argv
    assert argv is not None
    assert argv.fill({}) == (f"{elsewhere}/run",)


# -- the environment ----------------------------------------------------------------------


def test_variables_override_the_file(tmp_path: Path) -> None:
    """TRIO_BROKER_<KEY> wins over the file; nested keys use __; text stays text."""
    path = write(
        tmp_path,
        """
        slots: 2
        broker_token: from-file
        services:
          Video: {argv: [ffmpeg], max_slots: 1}
        """,
    )
    config = load(
        path,
        {
            "TRIO_BROKER_SLOTS": "4",
            "TRIO_BROKER_BROKER_TOKEN": "123456",
            "TRIO_BROKER_DRAIN_TIMEOUT": "5m",
            "TRIO_BROKER_TLS__CERT": "c.pem",
            "TRIO_BROKER_TLS__KEY": "/k.pem",
            "TRIO_BROKER_SERVICES__VIDEO__MAX_SLOTS": "3",
            "TRIO_BROKER_ENV__LANG": "C.UTF-8",
            "TRIO_BROKER_SERVER": "fylr:7400",  # the upload command's: not a key here
            "OTHER_SLOTS": "9",
        },
    )
    assert config.slots == 4
    assert config.broker_token == "123456"  # a text key: not read as the number 123456
    assert config.drain_timeout == 300.0
    assert config.tls == TlsConfig(cert=tmp_path / "c.pem", key=Path("/k.pem"))
    assert config.services["Video"].max_slots == 3
    assert config.env == {"LANG": "C.UTF-8"}


def test_a_variable_adds_a_whole_mapping(tmp_path: Path) -> None:
    """A value that is not text is YAML: a whole mapping can come from one variable."""
    path = write(tmp_path, "listen: 127.0.0.1:7000\n")
    config = load(path, {"TRIO_BROKER_SERVICES": "{probe: {builtin: noop}}"})
    assert set(config.services) == {"probe"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (
            {"TRIO_BROKER_SLOTS": "two"},
            "slots: expected an integer, got 'two' (from TRIO_BROKER_SLOTS)",
        ),
        (
            {"TRIO_BROKER_TLS__CA": "x"},
            "tls.ca: unknown key (from TRIO_BROKER_TLS__CA)",
        ),
        (
            {"TRIO_BROKER_SLOTS": "[1"},
            "slots: invalid YAML at line 1, column 3:",
        ),
        (
            {"TRIO_BROKER_TLS____CERT": "x"},
            "TRIO_BROKER_TLS____CERT: empty key between '__' separators",
        ),
        (
            {"TRIO_BROKER_SERVICES__PROBE__MAX_SLOTS": "-1"},
            "services.probe.max_slots: expected an integer >= 0, got -1"
            " (from TRIO_BROKER_SERVICES__PROBE__MAX_SLOTS)",
        ),
    ],
    ids=["type", "unknown-nested-key", "yaml", "empty-key", "nested-range"],
)
def test_a_bad_variable_names_itself(
    tmp_path: Path, environ: Mapping[str, str], expected: str
) -> None:
    """A problem with a value from the environment names the key and the variable."""
    path = write(tmp_path, NOOP)
    assert error(path, environ).startswith(expected)


def test_without_environ_the_environment_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """from_yaml without environ reads the file alone, whatever the process has."""
    monkeypatch.setenv("TRIO_BROKER_SLOTS", "7")
    assert load(write(tmp_path, NOOP)).slots == 0
    assert load(write(tmp_path, NOOP), os.environ).slots == 7


# -- secret files -------------------------------------------------------------------------


def test_broker_token_file_is_read_relative_to_the_file(tmp_path: Path, elsewhere: Path) -> None:
    """broker_token_file reads the token next to the configuration, without its newline."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("s3cret\n")
    config = load(write(tmp_path, "broker_token_file: secrets/token\n" + NOOP))
    assert config.broker_token == "s3cret"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "broker_token: a\nbroker_token_file: t\n",
            "broker_token_file: expected either broker_token or broker_token_file, got both",
        ),
        ("broker_token_file: missing\n", "broker_token_file: cannot read '"),
        ("broker_token_file: empty\n", "broker_token_file: expected a non-empty secret, '"),
        ("broker_token_file: 5\n", "broker_token_file: expected the path of a file, got 5"),
    ],
    ids=["both", "missing", "empty", "not-a-path"],
)
def test_a_bad_secret_file_is_one_line(tmp_path: Path, text: str, expected: str) -> None:
    """Both keys, a missing, empty or non-path file: one line naming the key."""
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "t").write_text("x")
    message = error(write(tmp_path, text + NOOP))
    assert message.startswith(expected)
    if "missing" in text:
        assert message.endswith(f"{tmp_path / 'missing'}': No such file or directory")


def test_a_token_variable_overrides_the_files_secret_file(tmp_path: Path) -> None:
    """TRIO_BROKER_BROKER_TOKEN replaces broker_token_file (env over file), and the reverse."""
    (tmp_path / "token").write_text("from-secret-file")
    path = write(tmp_path, "broker_token_file: token\n" + NOOP)
    assert load(path, {"TRIO_BROKER_BROKER_TOKEN": "from-env"}).broker_token == "from-env"
    path = write(tmp_path, "broker_token: from-file\n" + NOOP)
    config = load(path, {"TRIO_BROKER_BROKER_TOKEN_FILE": "token"})
    assert config.broker_token == "from-secret-file"


def test_the_fylr_configuration_loads_through_the_same_steps(tmp_path: Path) -> None:
    """load_config serves any configuration class: the fylr's gets the environment too."""
    path = write(tmp_path, "execservers: []\n", name="fylr.yml")
    config = load_config(
        path,
        FylrConfig,
        environ={"TRIO_BROKER_EXECSERVERS": "[exec:7000]", "TRIO_BROKER_STATE_DIR": "state"},
    )
    assert config.execservers == ("exec:7000",)
    assert config.state_dir == tmp_path / "state"


def test_the_reference_configuration_loads() -> None:
    """daemons/execserver.example.yml, every key shown, loads; {config_dir} is its folder."""
    example = Path(__file__).resolve().parents[2] / "daemons" / "execserver.example.yml"
    config = ExecserverConfig.from_yaml(example)
    argv = config.services["script"].argv
    assert argv is not None
    assert argv.fill({"size": "1"})[1] == f"{example.parent}/convert.py"
