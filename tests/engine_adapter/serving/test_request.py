"""Stop strings, API keys and error bodies: the HTTP front's pure parts."""

from __future__ import annotations

import pytest

from engine_adapter.serving.api_keys import ApiKeys
from engine_adapter.serving.request import Request, StopMatcher
from kvstore.errors import InvalidArgument, PermissionDenied


def _feed(stops: list[str], deltas: list[str]) -> tuple[list[str], StopMatcher]:
    matcher = StopMatcher(stops)
    shown = [matcher.feed(d) for d in deltas]
    return shown, matcher


def test_stop_string_split_over_deltas_is_never_shown():
    shown, matcher = _feed(["o W"], ["Hel", "lo", " W", "orld"])
    assert "".join(shown) == "Hell" and matcher.stopped
    assert shown[1] == "l", "text that may start the stop string must be held back"


def test_held_back_text_is_released_when_it_is_no_stop():
    shown, matcher = _feed(["STOP"], ["a S", "T", "x", "y"])
    assert shown == ["a ", "", "STx", "y"] and not matcher.stopped
    shown, matcher = _feed(["STOP"], ["end ST"])
    assert matcher.flush() == "ST" and matcher.text == "end ST"


def test_first_of_several_stops_wins():
    shown, matcher = _feed(["bb", "a"], ["xxbba"])
    assert "".join(shown) == "xx" and matcher.text == "xx"


def test_api_keys(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[keys]\n"sk-acme" = "acme"\n"sk-acme-2" = "acme"\n"sk-globex" = "globex"\n')
    keys = ApiKeys.load(path)
    assert keys.tenant("Bearer sk-acme") == keys.tenant("bearer sk-acme-2") == "acme"
    assert keys.tenant("Bearer sk-globex") == "globex"
    for header in (None, "", "Bearer", "Bearer sk-nope", "Basic sk-acme"):
        with pytest.raises(PermissionDenied):
            keys.tenant(header)
    assert ApiKeys.load(None).tenant(None) == "default", "no key file: no auth, one tenant"


@pytest.mark.parametrize(
    "text", ["keys = 1", '[keys]\n"k" = ""', '[keys]\n"k" = 3', "[other]\n", "not toml ["]
)
def test_bad_api_key_files_are_refused(tmp_path, text):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgument):
        ApiKeys.load(path)


def test_an_empty_request_id_gets_one_id_that_the_wire_message_keeps() -> None:
    request = Request(tenant="acme", traffic_class="chat", token_ids=[1, 2], request_id="")
    assert request.request_id, "an empty request_id must be replaced by a generated one"
    assert request.to_proto().request_id == request.request_id, "router and workers differ"
    assert Request.from_proto(request.to_proto()).request_id == request.request_id
