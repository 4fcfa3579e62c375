"""Guess-the-number served over OpenEnv's WebSocket protocol, for tests/test_openenv.py.

    python tests/openenv_guess_server.py PORT_FILE [--openenv] [--max-sessions N] [--lifetime S]

The game (`Game`): `reset(seed, top=4)` draws a number in 1..top from the seed; each step takes a
guess (the action's `message`): a right guess earns reward 1 and ends the episode, a wrong one is
told higher or lower, and the third wrong guess ends it. Observation fields: `text`, `guesses`.

With --openenv the game is an openenv-core `Environment` (its `Action` and `Observation` models,
the action's message at most 8 characters) served by openenv-core's own app (`create_app`,
uvicorn). Without, a minimal server of the same protocol written with websockets: the `/ws`
endpoint's reset / step / state / close messages, and openenv-core 0.3.0's replies and error codes
(VALIDATION_ERROR for a message that is not a string of at most 8 characters, CAPACITY_REACHED
past --max-sessions sessions). Either binds 127.0.0.1 on a free port, writes the port to
PORT_FILE, and exits after --lifetime seconds (or when killed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import threading
import time

MAX_MESSAGE = 8  # characters of a guess; longer ones fail the action model's validation


class Game:
    """The state of one guessing game (one session's environment)."""

    def __init__(self) -> None:
        self.top, self.number, self.guesses = 4, 1, 0

    def reset(self, seed: int | None = None, top: int = 4) -> tuple[dict, float, bool]:
        self.top, self.guesses = int(top), 0
        self.number = 1 + int(random.Random(seed).random() * self.top)
        text = f"Game {seed}: guess my number from 1 to {self.top}."
        return {"text": text, "guesses": 0}, 0.0, False

    def step(self, message: str) -> tuple[dict, float, bool]:
        self.guesses += 1
        guess = message.strip()
        if guess == str(self.number):
            return {"text": f"Right, it is {self.number}.", "guesses": self.guesses}, 1.0, True
        hint = "a number" if not guess.isdigit() else (
            "higher" if int(guess) < self.number else "lower")
        done = self.guesses >= 3
        text = f"It was {self.number}." if done else f"Wrong: {hint}."
        return {"text": text, "guesses": self.guesses}, 0.0, done


# ---------------------------------------------------------------- the minimal protocol server


def observation_reply(fields: dict, reward: float, done: bool) -> str:
    data = {"observation": fields, "reward": reward, "done": done}
    return json.dumps({"type": "observation", "data": data})


def error_reply(message: str, code: str, **extra) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def handle(connection, game: Game) -> None:
    """Answer one session's messages until it closes."""
    for raw in connection:
        message = json.loads(raw)
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "close":
            return
        if kind == "reset":
            connection.send(observation_reply(*game.reset(data.get("seed"), data.get("top", 4))))
        elif kind == "step":
            text = data.get("message")
            valid = isinstance(text, str) and len(text) <= MAX_MESSAGE
            if set(data) - {"message", "metadata"} or not valid:
                connection.send(error_reply("Invalid message", "VALIDATION_ERROR"))
            else:
                connection.send(observation_reply(*game.step(text)))
        elif kind == "state":
            connection.send(json.dumps({"type": "state", "data": {"step_count": game.guesses}}))
        else:
            connection.send(error_reply(f"Unknown message type: {kind}", "UNKNOWN_TYPE"))


def serve_minimal(sock: socket.socket, max_sessions: int) -> None:
    from websockets.sync.server import serve

    lock, active = threading.Lock(), [0]

    def session(connection) -> None:
        if connection.request.path != "/ws":
            connection.close(1008, "no such endpoint")
            return
        with lock:
            full = active[0] >= max_sessions
            active[0] += not full
        if full:
            connection.send(error_reply("capacity", "CAPACITY_REACHED",
                                        active_sessions=max_sessions, max_sessions=max_sessions))
            return
        try:
            handle(connection, Game())
        finally:
            with lock:
                active[0] -= 1

    serve(session, sock=sock).serve_forever()


# ---------------------------------------------------------------- openenv-core's own server


def openenv_app(max_sessions: int):
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        message: str = Field(max_length=MAX_MESSAGE)

    class GuessObservation(Observation):
        text: str
        guesses: int

    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.game = Game()

        def reset(self, seed=None, episode_id=None, top: int = 4, **kwargs) -> GuessObservation:
            fields, reward, done = self.game.reset(seed, top)
            return GuessObservation(**fields, reward=reward, done=done)

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
            fields, reward, done = self.game.step(action.message)
            return GuessObservation(**fields, reward=reward, done=done)

        @property
        def state(self) -> State:
            return State(step_count=self.game.guesses)

    return create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                      max_concurrent_envs=max_sessions)


def serve_openenv(sock: socket.socket, max_sessions: int) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(openenv_app(max_sessions), log_level="warning"))
    server.run(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file")
    parser.add_argument("--openenv", action="store_true")
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--lifetime", type=float, default=300)
    args = parser.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    serve = serve_openenv if args.openenv else serve_minimal
    threading.Thread(target=serve, args=(sock, args.max_sessions), daemon=True).start()
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(args.port_file + ".tmp", args.port_file)
    time.sleep(args.lifetime)
    os._exit(0)


if __name__ == "__main__":
    main()
