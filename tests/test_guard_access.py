"""The access layer's parts, without servers: token sources, the bearer check, the audit line and
where a server may listen (``guard.tokens``, ``guard.access``, ``guard.exposure``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.access import REFUSALS_PER_WINDOW, WINDOW_S, Audit, Refusal, bearer, check
from guard.exposure import ExposureError, is_loopback, listen_host
from guard.tokens import StaticToken, TokenError, TokenFile, credentials_of, principal_id

pytestmark = pytest.mark.timeout(30)
TOKEN = "s3cret-token-0123"


@pytest.mark.parametrize("content, words", [
    (b"", "is empty"), (b"  \n\n", "is empty"), (b"two words\n", "holds 2 words"),
    (b"short\n", "shorter than 8"), (b"\xff\xfe-not-utf8", "not UTF-8")])
def test_a_token_file_that_cannot_be_used_is_one_line_naming_it(
        tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "token"
    path.write_bytes(content)
    with pytest.raises(TokenError) as err:
        TokenFile(path)
    assert words in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_token_file_says_it_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="cannot be read"):
        TokenFile(tmp_path / "nope")


def test_a_rotated_token_file_is_taken_and_a_broken_version_keeps_the_last_token(
        tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    source = TokenFile(path)
    assert source.credentials().match(TOKEN) is not None
    path.write_text("another-token-456\n")
    os.utime(path, (1, 1))  # a different stamp, even within one clock tick
    source.refresh()
    assert source.credentials().match(TOKEN) is None
    assert source.credentials().match("another-token-456") is not None
    assert source.token() == "another-token-456"
    path.write_text("")  # broken: the last good token stays
    source.refresh()
    assert source.token() == "another-token-456"
    path.unlink()  # gone (a Secret being swapped): the last good token stays
    source.refresh()
    assert source.token() == "another-token-456"


def test_a_kubernetes_secret_swap_is_seen_through_its_symlink(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    (tmp_path / "v1" / "token").write_text(TOKEN)
    (tmp_path / "v2" / "token").write_text("rotated-token-789")
    os.symlink("v1", tmp_path / "..data")
    os.symlink("..data/token", tmp_path / "token")
    source = TokenFile(tmp_path / "token")
    os.symlink("v2", tmp_path / "..data_new")
    os.replace(tmp_path / "..data_new", tmp_path / "..data")  # as the kubelet does
    source.refresh()
    assert source.token() == "rotated-token-789"


def test_a_principal_is_named_by_a_digest_prefix_never_by_its_token() -> None:
    found = credentials_of([TOKEN]).match(TOKEN)
    assert found is not None and found.id == principal_id(TOKEN)
    assert found.id.startswith("sha256:") and len(found.id) == 15 and TOKEN not in found.id


@given(st.text(max_size=40))
def test_no_other_string_passes_for_the_token(guess: str) -> None:
    creds = StaticToken(TOKEN).credentials()
    assert (creds.match(guess) is not None) == (guess == TOKEN)


@pytest.mark.parametrize("headers, reason", [
    ([], "no_token"), (["Basic " + TOKEN], "not_bearer"), (["Bearer"], "no_token"),
    (["Bearer   "], "no_token"), ([TOKEN], "not_bearer"), (["Token " + TOKEN], "not_bearer"),
    ([f"Bearer {TOKEN}", f"Bearer {TOKEN}"], "two_headers"),
    (["Bearer " + TOKEN.upper()], "wrong_token"), (["Bearer " + TOKEN[:-1]], "wrong_token"),
    ([f"Bearer {TOKEN}, Bearer {TOKEN}"], "wrong_token"), ([f"Bearer {TOKEN} x"], "wrong_token")])
def test_every_malformed_or_wrong_header_is_a_401_that_names_no_token(
        headers: list[str], reason: str) -> None:
    found = check(credentials_of([TOKEN]), headers, "agent")
    assert isinstance(found, Refusal) and found.status == 401 and found.reason == reason
    assert TOKEN not in found.message and TOKEN.upper() not in found.message


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN} ",
                                    f" Bearer {TOKEN}\t"])
def test_the_scheme_is_read_without_case_and_spaces_around_the_token_are_not_part_of_it(
        header: str) -> None:
    assert bearer([header])[0] == TOKEN
    assert not isinstance(check(credentials_of([TOKEN]), [header], "agent"), Refusal)


def test_audit_lines_are_json_and_a_flood_of_refusals_is_capped(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    audit = Audit("reconciler", clock=lambda: now[0])
    refusal = Refusal(401, "x", "no_token")
    with caplog.at_level(logging.INFO, logger="audit"):
        audit.accepted("POST", "/v1/x\naudit {\"forged\": 1}", "10.0.0.7", None, 202)
        for _ in range(REFUSALS_PER_WINDOW + 25):
            audit.refused("POST", "/v1/routes/m/wake", "10.0.0.7", refusal)
        now[0] += WINDOW_S
        audit.refused("POST", "/v1/routes/m/wake", "10.0.0.7", refusal)
    lines = [r.getMessage() for r in caplog.records]
    assert all(line.startswith("audit {") and "\n" not in line for line in lines)
    first = json.loads(lines[0].removeprefix("audit "))
    assert first == {"server": "reconciler", "method": "POST",
                     "path": "/v1/x\naudit {\"forged\": 1}", "client": "10.0.0.7",
                     "principal": "anonymous", "result": 202, "reason": None}
    assert len(lines) == 1 + REFUSALS_PER_WINDOW + 2  # the capped window, its count, the next
    assert json.loads(lines[-2].removeprefix("audit "))["refusals_not_logged"] == 25


@pytest.mark.parametrize("host, token, insecure, expected", [
    (None, False, False, "127.0.0.1"), (None, True, False, "0.0.0.0"),
    (None, False, True, "0.0.0.0"), ("127.0.0.1", False, False, "127.0.0.1"),
    ("::1", False, False, "::1"), ("localhost", False, False, "localhost"),
    ("0.0.0.0", True, False, "0.0.0.0"), ("0.0.0.0", False, True, "0.0.0.0")])
def test_a_server_without_a_token_listens_on_loopback_unless_told_otherwise(
        host: str | None, token: bool, insecure: bool, expected: str) -> None:
    assert listen_host(host, token, insecure) == expected


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3", "no-such-host.invalid"])
def test_another_address_without_a_token_is_refused_with_what_to_do(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ExposureError) as err:
        listen_host(host, False, False)
    assert "--insecure-no-auth" in str(err.value) and "--token-file" in str(err.value)


def test_a_known_principal_asking_for_what_it_may_not_use_is_the_one_403() -> None:
    from aiohttp import web

    from guard.access import forbidden, refusal_response
    from guard.tokens import Principal

    refusal = forbidden(Principal("sha256:1a2b3c4d", frozenset({"a"})), "b", "door")
    assert refusal.status == 403 and refusal.reason == "not_allowed"
    assert "sha256:1a2b3c4d" in refusal.message and "'b'" in refusal.message
    answer = refusal_response(refusal, "door", lambda s, m: web.json_response({"m": m}, status=s))
    assert answer.status == 403 and "WWW-Authenticate" not in answer.headers
