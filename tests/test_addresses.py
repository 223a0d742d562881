"""HOST:PORT parsing and the loopback check."""

import pytest

from rpc_reading_service.addresses import distinct_servers, format_address, is_loopback_host, parse_address, server_key
from rpc_reading_service.errors import ConfigurationError


@pytest.mark.parametrize(
    "text, expected",
    [("cpu-1:29600", ("cpu-1", 29600)), ("10.0.0.2:1", ("10.0.0.2", 1)), ("[::1]:8080", ("::1", 8080))],
)
def test_parse_and_format(text, expected):
    assert parse_address(text) == expected
    assert parse_address(format_address(*expected)) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty"),
        ("cpu-1", "no port"),
        ("cpu-1:http", "not a number"),
        ("cpu-1:70000", "outside"),
        (":29600", "no host"),
        ("::1:80", "brackets"),
        ("[::1:80", "unclosed"),
        # typos int() would accept, or a port nobody can dial
        ("host:0", "port 0, outside 1-65535"),
        ("host:+1", "port '\\+1', which is not a number"),
        ("host:-1", "port '-1', which is not a number"),
        ("host:\u0663", "which is not a number \\(digits 0-9 only\\)"),
        ("host:1_0", "which is not a number"),
        (" host:1", "contains spaces: write it as HOST:PORT, e.g. 'host:1'"),
        ("host:1\n", "contains spaces"),
        ("host :1", "contains spaces"),
        ("[::1]: 1", "contains spaces"),
    ],
)
def test_parse_errors_say_how_to_fix(text, match):
    with pytest.raises(ConfigurationError, match=match):
        parse_address(text)


def test_loopback():
    assert is_loopback_host("localhost") and is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert is_loopback_host("127.1.2.3")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.0.0.1") and not is_loopback_host("example.org")


def test_port_zero_only_where_it_picks_a_free_port():
    assert parse_address("127.0.0.1:0", any_port=True) == ("127.0.0.1", 0)
    with pytest.raises(ConfigurationError, match="outside 1-65535"):
        parse_address("127.0.0.1:0", what="store address")


def test_one_server_under_two_spellings_is_listed_once():
    assert server_key("localhost:29600") == server_key("127.0.0.1:29600") == ("127.0.0.1", 29600)
    spellings = ["localhost:29600", "127.0.0.1:29600", "127.0.0.1:29601", "unix:@a", "unix:@a"]
    assert distinct_servers(spellings) == ["localhost:29600", "127.0.0.1:29601", "unix:@a"]
