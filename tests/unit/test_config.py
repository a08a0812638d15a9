"""Options: keyword beats environment beats default; bad values fail clearly."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from ddpscope import config
from ddpscope.config import OPTIONS, ConfigError, Options, derive_control_endpoint, load
from tests.support.torchrun import ROOT


def test_defaults_are_loopback_and_automatic_checksums() -> None:
    opts = load(env={})
    assert opts.endpoint.startswith("tcp://127.0.0.1:")
    assert opts.checksum_every == 0 and not opts.disable and opts.record == ""


def test_environment_is_read_and_keywords_win() -> None:
    env = {"DDPSCOPE_CHECKSUM_EVERY": "10", "DDPSCOPE_RECORD": "/tmp/x", "DDPSCOPE_DISABLE": "0"}
    opts = load({"checksum_every": 3}, env=env)
    assert opts.checksum_every == 3 and opts.record == "/tmp/x" and opts.disable is False


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="DDPSCOPE_HEARTBEAT_S"):
        load(env={"DDPSCOPE_HEARTBEAT_S": "fast"})
    with pytest.raises(ConfigError, match="DDPSCOPE_DISABLE"):
        load(env={"DDPSCOPE_DISABLE": "maybe"})


def test_unknown_keyword_lists_known_options() -> None:
    with pytest.raises(TypeError, match="unknown option 'checksums'.*checksum_every"):
        load({"checksums": 1}, env={})


def test_out_of_range_values_are_rejected() -> None:
    with pytest.raises(ConfigError):
        load({"checksum_budget": 2.0}, env={})
    with pytest.raises(ConfigError):
        load({"endpoint": "udp://x:1"}, env={})


def test_control_endpoint_is_derived_from_the_data_endpoint() -> None:
    assert derive_control_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert derive_control_endpoint("ipc:///tmp/s") == "ipc:///tmp/s.control"


def test_every_option_has_a_variable_and_is_documented() -> None:
    names = {f.name for f in dataclasses.fields(Options)}
    assert names == set(OPTIONS)
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for var, _ in OPTIONS.values():
        assert var in doc, f"{var} missing from docs/configuration.md"


def test_keys_that_cannot_be_used_are_errors_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="DDPSCOPE_SERVER_KEY"):
        load(env={"DDPSCOPE_SERVER_KEY": str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match="DDPSCOPE_SERVER_KEY"):
        load({"server_key": "x" * 39 + "\u00e9"}, env={})
    with pytest.raises(ConfigError, match="DDPSCOPE_CLIENT_KEY is set"):
        load(env={"DDPSCOPE_CLIENT_KEY": str(tmp_path / "c.key_secret")})
    z85 = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a well-formed CURVE public key
    opts = load({"server_key": z85}, env={})
    keys = opts.client_keys()
    assert keys is not None and keys.server_public == z85.encode()


#: A DDPSCOPE_* environment name (``DDPSCOPE_*`` itself, the family, is not one).
VARIABLE = re.compile(r"DDPSCOPE_[A-Z0-9_]*[A-Z0-9]")
#: Runs at the start of every Python process of a `ddpscope run` job, before ddpscope
#: may even be importable, so it imports nothing of ddpscope and spells its one name.
BOOTSTRAP = ROOT / "ddpscope" / "_bootstrap" / "sitecustomize.py"


def _config_variables() -> dict[str, str]:
    """config's ``*_VAR`` constants: constant name -> variable."""
    return {
        name: value
        for name, value in vars(config).items()
        if name.endswith("_VAR") and isinstance(value, str)
    }


def _string_literals(path: Path) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_config_names_every_variable_once_and_options_use_those_names() -> None:
    variables = _config_variables()
    assert all(VARIABLE.fullmatch(v) for v in variables.values()), variables
    assert len(set(variables.values())) == len(variables), "two constants name one variable"
    assert {var for var, _ in OPTIONS.values()} <= set(variables.values())
    assert set(config.RANK_KEY_VARS) == {config.SERVER_KEY_VAR, config.CLIENT_KEY_VAR}


def test_no_module_but_config_spells_a_variable_name_as_a_string_of_its_own() -> None:
    # Names inside messages and help text are fine (the next test checks they exist);
    # a string that is only the name is a second definition of it.
    spelled = []
    for path in sorted((ROOT / "ddpscope").rglob("*.py")):
        if path in (ROOT / "ddpscope" / "config.py", BOOTSTRAP):
            continue
        for line, text in _string_literals(path):
            if VARIABLE.fullmatch(text):
                spelled.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not spelled, "use the ddpscope.config constant instead:\n" + "\n".join(spelled)


def test_the_bootstrap_spells_only_the_autoattach_variable_config_names() -> None:
    spelled = {text for _, text in _string_literals(BOOTSTRAP) if VARIABLE.fullmatch(text)}
    assert spelled == {config.AUTOATTACH_VAR}
    assert set(VARIABLE.findall(BOOTSTRAP.read_text())) == {config.AUTOATTACH_VAR}


def test_every_variable_the_package_and_its_docs_mention_is_one_config_defines() -> None:
    known = set(_config_variables().values())
    files = [*(ROOT / "ddpscope").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    unknown = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in set(VARIABLE.findall(path.read_text()))
        if name not in known
    )
    assert not unknown, unknown


def test_every_variable_is_documented_in_the_configuration_page() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [var for var in _config_variables().values() if f"`{var}" not in doc]
    assert not missing, f"missing from docs/configuration.md: {missing}"
