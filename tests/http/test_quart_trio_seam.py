"""The quart-trio seam (http/server.py): the per-request nursery connection copies upstream's
``TrioASGIHTTPConnection.__call__`` around Quart's private ``_create_request_from_scope``.
Every member it relies on is checked before an app is built, as the Hypercorn seam is
(tests/http/test_hypercorn_seam.py); a quart-trio without one fails by name and version. Both
seams are pinned in pyproject.toml to the versions tested, and the installed ones are those."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path
from typing import Any

import pytest
import quart.app
from packaging.requirements import Requirement
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

from hydra_trio.http import server
from hydra_trio.http.plumbing import connections
from hydra_trio.http.server import QuartTrioSeamError

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_quart_trio_has_every_member_the_app_relies_on() -> None:
    assert server._quart_trio_seam_missing() == []
    server.check_quart_trio_seam()


async def _extra(self: Any, receive: Any, send: Any) -> None:  # upstream grew a step we lack
    request = self._create_request_from_scope(send)
    await self.app.startup_hook(request)


async def _coroutine(self: Any, send: Any) -> None:
    return None


async def _old_messages(self: Any, request: Any, receive: Any) -> None:  # no nursery argument
    return None


def _plain(self: Any, nursery: Any, request: Any, send: Any) -> None:
    return None


async def _asgi_app(self: Any, scope: Any, receive: Any, send: Any) -> None:  # another lookup
    return None


@pytest.mark.parametrize(
    ("owner", "name", "value", "named"),
    [
        (TrioASGIHTTPConnection, "__call__", _extra, "TrioASGIHTTPConnection.__call__"),
        (TrioASGIHTTPConnection, "_create_request_from_scope", None, "_create_request_from_scope"),
        (TrioASGIHTTPConnection, "_create_request_from_scope", _coroutine, "_create_request_from_scope"),
        (TrioASGIHTTPConnection, "handle_messages", _old_messages, "TrioASGIHTTPConnection.handle_messages"),
        (TrioASGIHTTPConnection, "handle_request", _plain, "TrioASGIHTTPConnection.handle_request"),
        (QuartTrio, "asgi_http_class", object, "QuartTrio.asgi_http_class"),
        (quart.app.Quart, "asgi_app", _asgi_app, "Quart.asgi_app"),
    ],
)
def test_a_quart_trio_without_a_member_is_refused_by_name(
    monkeypatch: Any, owner: Any, name: str, value: Any, named: str
) -> None:
    if value is None:  # the member lives on Quart's base class: remove it where it is defined
        owner = next(k for k in owner.__mro__ if name in k.__dict__)
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, value)
    monkeypatch.setattr(server, "_version", lambda dist: "9.9.9")
    with pytest.raises(QuartTrioSeamError) as err:
        server.check_quart_trio_seam()
    message = str(err.value)
    assert "quart-trio 9.9.9" in message and named in message, message
    assert server.QUART_TRIO_TESTED in message and server.QUART_TESTED in message


def test_an_app_is_not_built_on_a_changed_quart_trio(monkeypatch: Any) -> None:
    monkeypatch.setattr(TrioASGIHTTPConnection, "__call__", _extra)
    with pytest.raises(QuartTrioSeamError):
        server.create_app(None)  # type: ignore[arg-type]  # refused before the state is read


def _pins() -> dict[str, Requirement]:
    deps = tomllib.loads(_PYPROJECT.read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps}


@pytest.mark.parametrize(
    "tested", [connections.HYPERCORN_TESTED, server.QUART_TRIO_TESTED, server.QUART_TESTED]
)
def test_each_seam_is_pinned_to_the_versions_tested(tested: str) -> None:
    want = Requirement(tested)
    pin = _pins()[want.name]
    assert pin.specifier == want.specifier, f"pyproject.toml pins {pin}, the seam says {want}"
    installed = importlib.metadata.version(want.name)
    assert want.specifier.contains(installed), f"{want.name} {installed} is installed, not {want}"
