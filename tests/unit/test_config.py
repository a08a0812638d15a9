"""Options: keyword beats environment beats default; bad values fail clearly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddpscope.config import OPTIONS, ConfigError, Options, derive_control_endpoint, load


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
    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
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
