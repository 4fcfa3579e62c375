"""An OpenEnv environment server as an rldynamics env: `env.name=openenv env.openenv.url=URL`.

OpenEnv (openenv-core, the protocol TRL, SkyRL and Unsloth speak) serves an `Environment` over
HTTP and a WebSocket. Its HTTP `/reset` and `/step` build a fresh environment for every request
(openenv-core 0.3.0), so an episode of several steps lives in a WebSocket session: `URL/ws`, one
session (and one server-side environment) per connection. This client speaks that protocol with
the `websockets` library alone (openenv-core is not imported):

    send {"type": "reset", "data": {"seed": s, ...}}        -> {"type": "observation", "data": D}
    send {"type": "step", "data": {<action fields>}}         -> {"type": "observation", "data": D}
    send {"type": "close"}
    D = {"observation": {<observation fields>}, "reward": float | null, "done": bool}
    an error: {"type": "error", "data": {"message": ..., "code": ...}}

Design choices:
- A session per episode: `reset` opens one (closing the env's previous one), the step that ends
  the episode closes it, and an env dropped mid-episode closes it when collected. A rollout holds
  one per trajectory at once, so the server must allow that many sessions (openenv-core:
  `max_concurrent_envs` and `SUPPORTS_CONCURRENT_SESSIONS = True`); a full server is an error
  that says so. The constructor does not connect (config validation builds the env).
- Actions: with `actions` (action words) the rollout parses the reply into words as for every env
  with action words (`rollout.parse`), and each word is sent as `{action_field: word}` (its index
  with `action_index`); without, the whole answer text is sent. `action_fields` adds fixed
  fields. An action the server's action model rejects (its code `VALIDATION_ERROR`) is an
  invalid action: the state stays, no reward, counted in the metric `invalid_actions`; any other
  server error stops the run with the server's message.
- The text the model sees: the observation's `observation_field` (a string as it is, anything
  else as JSON), or with no field named every field as one JSON object (sorted keys).
- Reward: the one component `reward` (null counts 0); an episode ends when the server says done
  and succeeds when its return reaches `success_threshold`.
- Seeds: `reset(seed)` sends `seed` (openenv-core passes it to the environment's `reset` when
  that takes a `seed`), plus `reset_fields`. The held-out split (`val.held_out`) hashes the first
  observation's text, as for every env.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rldynamics.envs.base import StepResult
from rldynamics.rollout.parse import _action_lookup

INSTALL = 'pip install "rldynamics[openenv]" (websockets)'
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
CLOSE_WAIT = 2.0  # seconds a closing session waits for the server to close it
MAX_MESSAGE = 100 * 2**20  # openenv-core's client allows 100 MB observations (screenshots, pages)


@dataclass
class OpenEnvConfig:
    """The OpenEnv client's keys (`env.openenv.<key>`)."""

    url: str = ""
    """The OpenEnv server, e.g. http://127.0.0.1:8000 (its WebSocket URL/ws; https, ws, wss too)."""
    action_field: str = "message"
    """The action field that carries the answer (the action word, its index, or the text)."""
    actions: list[str] = field(default_factory=list)
    """Action words the reply is parsed into, e.g. [Left, Right] ([] = the whole answer text)."""
    action_index: bool = False
    """Send an action word's index (0, 1, ...) instead of the word."""
    action_fields: dict[str, Any] = field(default_factory=dict)
    """Fixed fields sent with every action, e.g. {tool: guess}."""
    observation_field: str | None = None
    """The observation field the model sees (None: every field, as JSON)."""
    reset_fields: dict[str, Any] = field(default_factory=dict)
    """Fields sent with every reset besides the seed (keyword arguments of the env's reset)."""
    instructions: str | None = None
    """Task description in the system prompt (None: one naming the actions)."""
    success_threshold: float = 1.0
    """An episode succeeds when its return reaches this."""
    timeout: float = 60.0
    """Seconds to wait for the connection and for each reply."""


class InvalidAction(Exception):
    """The server's action model rejected an action (its error code VALIDATION_ERROR)."""


class OpenEnvEnv:
    """A client of an OpenEnv server; see the module docstring.

    Args: the fields of `OpenEnvConfig`.
    """

    Config = OpenEnvConfig
    actions: tuple[str, ...] = ()
    actions_help = "the words of env.openenv.actions, else the answer text"  # `rldyn envs`
    reward_names: tuple[str, ...] = ("reward",)
    reward_weights: dict[str, float] = {}

    def __init__(self, url: str = "", action_field: str = "message",
                 actions: list[str] | tuple = (), action_index: bool = False,
                 action_fields: dict[str, Any] | None = None,
                 observation_field: str | None = None, reset_fields: dict[str, Any] | None = None,
                 instructions: str | None = None, success_threshold: float = 1.0,
                 timeout: float = 60.0) -> None:
        self.url = ws_url(url)
        self.actions = tuple(actions)
        if self.actions:
            _action_lookup(self.actions)  # the rollout's own checks of action words
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.action_field, self.action_index = action_field, bool(action_index)
        self.action_fields, self.reset_fields = dict(action_fields or {}), dict(reset_fields or {})
        self.observation_field, self._instructions = observation_field, instructions
        self.success_threshold, self.timeout = float(success_threshold), float(timeout)
        self._session: _Session | None = None
        self._episode: dict[str, float] | None = None

    def instructions(self) -> str:
        """`env.openenv.instructions`, else a line naming the actions."""
        if self._instructions:
            return self._instructions
        act = (f"Actions: {', '.join(self.actions)}." if self.actions
               else "Answer with your action as text.")
        return f"You are acting in an OpenEnv environment. {act}"

    def reset(self, seed: int) -> str:
        """Open a session and reset its environment with `seed`; the first observation's text."""
        self.close()
        self._session = _Session(self.url, self.timeout)
        data = self._session.request("reset", {**self.reset_fields, "seed": int(seed)})
        self._episode = {"return": 0.0, "done": float(bool(data.get("done"))),
                         "invalid_actions": 0.0}
        self._text = self._to_text(data)
        return self._text

    def step(self, action: str) -> StepResult:
        """Send one action; component `reward` (the server's reward, null = 0)."""
        episode = self._current()
        if episode["done"] or self._session is None:
            raise RuntimeError("the episode is over (the server said done); call reset() first")
        try:
            data = self._session.request("step", self._payload(action))
        except InvalidAction:
            episode["invalid_actions"] += 1
            info = {"action_is_effective": 0.0, "action_is_valid": 0.0,
                    "success": float(self.success())}
            return StepResult(self._text, {"reward": 0.0}, False, info)
        reward, done = float(data.get("reward") or 0.0), bool(data.get("done"))
        episode["return"] += reward
        episode["done"] = float(done)
        before, self._text = self._text, self._to_text(data)
        if done:
            self.close()
        info = {"action_is_effective": float(self._text != before), "action_is_valid": 1.0,
                "success": float(self.success())}
        return StepResult(self._text, {"reward": reward}, done, info)

    def success(self) -> bool:
        """The episode's return reached `success_threshold`."""
        return self._current()["return"] >= self.success_threshold

    def metrics(self) -> dict[str, float]:
        """Per-episode diagnostics: whether the server ended the episode; invalid actions."""
        return {k: v for k, v in self._current().items() if k != "return"}

    def close(self) -> None:
        """Close the current session (a no-op without one)."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def _current(self) -> dict[str, float]:
        if self._episode is None:
            raise RuntimeError("no episode yet; call reset(seed) first")
        return self._episode

    def _payload(self, action: str) -> dict[str, Any]:
        if not self.actions:
            return {**self.action_fields, self.action_field: action}
        if action not in self.actions:
            raise ValueError(f"unknown action {action!r}; allowed: {', '.join(self.actions)}")
        value = self.actions.index(action) if self.action_index else action
        return {**self.action_fields, self.action_field: value}

    def _to_text(self, data: dict[str, Any]) -> str:
        observation = data.get("observation")
        if not isinstance(observation, dict):
            raise RuntimeError(f"the OpenEnv server at {self.url} sent no observation fields: "
                               f"{data!r:.200}")
        if self.observation_field is None:
            return json.dumps(observation, sort_keys=True, ensure_ascii=False)
        if self.observation_field not in observation:
            raise RuntimeError(f"env.openenv.observation_field={self.observation_field!r}: the "
                               f"observation has the fields {', '.join(sorted(observation))}")
        value = observation[self.observation_field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True,
                                                                ensure_ascii=False)


def ws_url(url: str) -> str:
    """The WebSocket endpoint of an OpenEnv server URL (`http://h:p` -> `ws://h:p/ws`);
    ValueError naming the key when the URL is empty or not http(s) / ws(s)."""
    if not url:
        raise ValueError("set env.openenv.url to the OpenEnv server, e.g. "
                         "env.openenv.url=http://127.0.0.1:8000")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ValueError(f"env.openenv.url={url!r} is not an http(s):// or ws(s):// server address")
    path = parts.path.rstrip("/")
    return f"{scheme}://{parts.netloc}{path if path.endswith('/ws') else path + '/ws'}"


class _Session:
    """One WebSocket session (a server-side environment of its own), closed by `close()` or when
    collected."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout
        self.connection = _connect(url, timeout)
        self._finalizer = weakref.finalize(self, _close_quietly, self.connection)

    def request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message and return the data of the server's observation (errors raise)."""
        try:
            reply = self._exchange(kind, data)
        except TimeoutError as e:
            raise RuntimeError(f"the OpenEnv server at {self.url} sent no reply to a {kind} within "
                               f"{self.timeout:g} s (env.openenv.timeout)") from e
        except Exception as e:  # noqa: BLE001 (the connection's errors: closed, protocol, bad JSON)
            raise RuntimeError(f"the OpenEnv session at {self.url} failed during a {kind}: "
                               f"{e.__class__.__name__}: {e}") from e
        if reply.get("type") == "error":
            _raise_error(self.url, kind, reply.get("data") or {})
        if reply.get("type") != "observation" or not isinstance(reply.get("data"), dict):
            raise RuntimeError(f"the OpenEnv server at {self.url} answered a {kind} with "
                               f"{reply!r:.200}")
        return reply["data"]

    def _exchange(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        try:
            self.connection.send(json.dumps({"type": kind, "data": data}))
        except ConnectionClosed:
            pass  # the server closed the session: the error it sent first is still to be read
        return json.loads(self.connection.recv(timeout=self.timeout))

    def close(self) -> None:
        self._finalizer()


def _connect(url: str, timeout: float):
    try:
        from websockets.sync.client import connect
    except ImportError as e:
        raise RuntimeError(f"env.name=openenv needs websockets: {INSTALL}") from e
    local = urlsplit(url).hostname in LOCAL_HOSTS
    try:
        connection = connect(url, open_timeout=timeout, max_size=MAX_MESSAGE,
                             proxy=None if local else True)
    except Exception as e:  # noqa: BLE001 (refused, timed out, not a WebSocket endpoint, ...)
        raise ConnectionError(f"cannot open a session with the OpenEnv server at {url} "
                              f"(env.openenv.url): {e.__class__.__name__}: {e}") from e
    return connection.__enter__()  # what `with connect(...)` does (websockets >= 17.1 asks for it)


def _raise_error(url: str, kind: str, error: dict[str, Any]) -> None:
    """Raise the exception for the server's error reply to a `kind` message."""
    code, message = error.get("code", "UNKNOWN"), error.get("message", "")
    if kind == "step" and code == "VALIDATION_ERROR":
        raise InvalidAction(message)
    if code == "CAPACITY_REACHED":
        raise RuntimeError(f"the OpenEnv server at {url} is full ({error.get('active_sessions')} "
                           f"of {error.get('max_sessions')} sessions): a rollout holds one session "
                           "per trajectory (env groups x group size), so start the server with at "
                           "least that many (openenv-core: max_concurrent_envs, "
                           "SUPPORTS_CONCURRENT_SESSIONS = True)")
    raise RuntimeError(f"the OpenEnv server at {url} refused a {kind}: {message} (code {code})")


def _close_quietly(connection) -> None:
    """Say goodbye, let the server close first (openenv-core's server logs an error when the client
    closes before it), then close (best effort: the server may be gone)."""
    try:
        connection.send(json.dumps({"type": "close"}))
        connection.recv(timeout=CLOSE_WAIT)  # returns only if the server answers instead of closing
    except Exception:  # noqa: BLE001, S110 (closed by the server, as expected, or gone)
        pass
    try:
        connection.close()
    except Exception:  # noqa: BLE001, S110
        pass
