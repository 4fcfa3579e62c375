"""FrozenLake as a text environment: seeded random maps, slippery moves, a shortest-path solver.

Design choices:
- Behaviour follows RAGEN's FrozenLake (gymnasium's `FrozenLakeEnv` on a map from RAGEN's
  `generate_random_map`): a square map of frozen cells and holes; the player starts on S and must reach G;
  stepping into a hole or onto the goal ends the episode; a move off the board leaves the player in place.
  The one reward component is `goal` (1 on reaching the goal, else 0), gymnasium's reward. Defaults mirror
  RAGEN's CoordFrozenLake tag (4x4, 90 % frozen cells, success rate 0.8, grid_coord).
- Maps: every cell is frozen with probability `frozen_prob`, else a hole; start and goal are two distinct
  cells drawn uniformly at random (RAGEN draws both and redraws when they coincide; we draw the goal among
  the other cells, the same distribution); a map without a 4-neighbour path from start to goal around the
  holes is thrown away and redrawn. Attempt k of seed s draws from `random.Random(f"frozenlake/{s}/{k}")`
  through `Random.random()` only, so every process and machine builds the same map (RAGEN reseeds a failed
  reset with Python's salted `hash`, which is not reproducible).
- Slips (gymnasium's rule, generalised by a success rate as in RAGEN and gymnasium >= 1.1): a move goes in
  the intended direction with probability `success_rate`, and to each of the two perpendicular directions
  with probability (1 - success_rate) / 2. The outcomes are ordered as in gymnasium's transition table:
  the direction one step clockwise in (Left, Down, Right, Up) order, the intended one, the one step
  counter-clockwise; `transitions` gives the resulting next-cell distribution (tests compare it with
  gymnasium's `P`). A step draws u = `random.Random(f"frozenlake/{seed}/slip/{k}").random()` for its k-th
  env step and takes the intended direction when u < success_rate, else the clockwise one when
  u < success_rate + (1 - success_rate) / 2, else the counter-clockwise one. The draw is a function of
  (seed, step) only, so a rollout is reproducible, and, as in RAGEN (whose gymnasium RNG is seeded by the
  reset seed), all trajectories of a group share their draws: two members that make the same moves land
  on the same cells.
- Renderings (RAGEN's symbols): P player, _ frozen (the start cell too), O hole, G goal, X player in a hole,
  √ player on the goal. The coord rendering lists each shown cell under exactly one heading, mirroring the
  grid: Holes, Goal, Player / Player on goal / Player in hole. RAGEN lists Start, Goal, Player, Holes; we
  leave out the start (the grid does not show it either) and put the holes first, so that goal and player
  sit at fixed offsets from the end of the text.
- `solve` is a breadth-first shortest path to the goal that ignores slips (the optimal plan at success
  rate 1; a plan that replanning after every move keeps on track otherwise), for the tiny model's warm start.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rldynamics.envs.base import StepResult, int_at_least, probability, randbelow
from rldynamics.envs.grid import cell_coordinates, check_observation_format, compose, coord_text

Cell = tuple[int, int]

# Gymnasium's action order (LEFT=0, DOWN=1, RIGHT=2, UP=3): a slip turns index a into a - 1 or a + 1 (mod 4).
ACTIONS: tuple[str, ...] = ("Left", "Down", "Right", "Up")
DELTAS: dict[str, Cell] = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
MAP_LETTERS = frozenset("SFHG")  # gymnasium's map letters: start, frozen, hole, goal
MAX_ATTEMPTS = 1000

_SYMBOL_LEGEND = "P: player, _: ice, O: hole, G: goal, X: player in hole, √: player on goal"


@dataclass(frozen=True)
class FrozenLakeState:
    """A map (gymnasium's letters, one string per row) and the player's cell; immutable.

    Invariants (checked on construction): rows of equal length, letters from S F H G, exactly one S and
    one G, the player on the board.
    """

    desc: tuple[str, ...]
    player: Cell
    num_env_steps: int = 0

    def __post_init__(self) -> None:
        if not self.desc or len({len(row) for row in self.desc}) != 1 or not self.desc[0]:
            raise ValueError(f"map rows must be non-empty and of equal length, got {list(self.desc)}")
        unknown = sorted({ch for row in self.desc for ch in row} - MAP_LETTERS)
        if unknown:
            raise ValueError(f"unknown map letters {unknown}; allowed: S (start), F (frozen), H (hole), G (goal)")
        for letter in "SG":
            count = sum(row.count(letter) for row in self.desc)
            if count != 1:
                raise ValueError(f"the map must contain exactly one {letter}, found {count}")
        if not (0 <= self.player[0] < self.shape[0] and 0 <= self.player[1] < self.shape[1]):
            raise ValueError(f"player {self.player} is off the {self.shape[0]}x{self.shape[1]} board")

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.desc), len(self.desc[0])

    def letter(self, cell: Cell) -> str:
        return self.desc[cell[0]][cell[1]]

    def cells(self, letter: str) -> list[Cell]:
        """Every cell holding `letter`, in row-major order."""
        return [(r, c) for r, row in enumerate(self.desc) for c, ch in enumerate(row) if ch == letter]

    def is_terminal(self) -> bool:
        """True when the player is in a hole or on the goal."""
        return self.letter(self.player) in "HG"


def parse_map(desc: Sequence[str] | str) -> FrozenLakeState:
    """A state at the start of a map in gymnasium's letters (`["SFFF", "FHFH", ...]` or one string with
    newlines); S start, F frozen, H hole, G goal."""
    rows = tuple(desc.strip("\n").split("\n") if isinstance(desc, str) else desc)
    starts = [(r, row.index("S")) for r, row in enumerate(rows) if "S" in row]
    return FrozenLakeState(desc=rows, player=starts[0] if starts else (0, 0))


# ----------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------


def _symbol(state: FrozenLakeState, cell: Cell) -> str:
    letter = state.letter(cell)
    if cell == state.player:
        return {"H": "X", "G": "√"}.get(letter, "P")
    return {"H": "O", "G": "G"}.get(letter, "_")


def render_grid(state: FrozenLakeState) -> str:
    """One line per row, one symbol per cell (see `_SYMBOL_LEGEND`)."""
    rows, cols = state.shape
    return "\n".join("".join(_symbol(state, (r, c)) for c in range(cols)) for r in range(rows))


def render_coord(state: FrozenLakeState) -> str:
    """Board size line, then Holes, Goal and Player (or Player on goal / Player in hole) coordinates.

    Goal and player come last, so they sit at the same token offsets from the end of the observation
    whatever the number of holes (a small model finds them there far sooner)."""
    player, letter = {state.player}, state.letter(state.player)
    categories = (
        ("Holes", set(state.cells("H")) - player),
        ("Goal", set(state.cells("G")) - player),
        ("Player", player if letter in "SF" else set()),
        ("Player on goal", player if letter == "G" else set()),
        ("Player in hole", player if letter == "H" else set()),
    )
    return coord_text(state.shape, categories)


def render(state: FrozenLakeState, observation_format: str) -> str:
    """Render `state` as `grid`, `coord` or `grid_coord`."""
    return compose(observation_format, render_grid(state), render_coord(state))


# ----------------------------------------------------------------------------------------------------
# Dynamics
# ----------------------------------------------------------------------------------------------------


def _move(state: FrozenLakeState, cell: Cell, action: str) -> Cell:
    """The cell one move from `cell` (unchanged at the board's edge)."""
    (r, c), (dr, dc) = cell, DELTAS[action]
    rows, cols = state.shape
    return min(max(r + dr, 0), rows - 1), min(max(c + dc, 0), cols - 1)


def outcomes(action: str, success_rate: float) -> list[tuple[str, float]]:
    """The directions a move in `action` can take and their probabilities, in gymnasium's order:
    one step clockwise in `ACTIONS` order, the intended direction, one step counter-clockwise."""
    i, side = ACTIONS.index(action), (1.0 - success_rate) / 2
    return [(ACTIONS[(i - 1) % 4], side), (action, success_rate), (ACTIONS[(i + 1) % 4], side)]


def transitions(state: FrozenLakeState, action: str, success_rate: float) -> dict[Cell, float]:
    """Next-cell distribution of `action` from the player's cell (a terminal cell stays put)."""
    if state.is_terminal():
        return {state.player: 1.0}
    out: dict[Cell, float] = {}
    for direction, prob in outcomes(action, success_rate):
        if prob > 0:
            cell = _move(state, state.player, direction)
            out[cell] = out.get(cell, 0.0) + prob
    return out


def slip_direction(action: str, success_rate: float, u: float) -> str:
    """The direction a move takes for the uniform draw `u` in [0, 1) (see the module docstring)."""
    (clockwise, side), _, (counter, _) = outcomes(action, success_rate)
    if u < success_rate:
        return action
    return clockwise if u < success_rate + side else counter


# ----------------------------------------------------------------------------------------------------
# Generation and solver
# ----------------------------------------------------------------------------------------------------


def shortest_path(state: FrozenLakeState) -> list[str] | None:
    """Fewest moves from the player to the goal around the holes, ignoring slips; None when there is none."""
    if state.letter(state.player) == "G":
        return []
    if state.letter(state.player) == "H":
        return None
    parents: dict[Cell, tuple[Cell, str] | None] = {state.player: None}
    frontier = deque([state.player])
    while frontier:
        cell = frontier.popleft()
        for action in ACTIONS:
            nxt = _move(state, cell, action)
            if nxt in parents or state.letter(nxt) == "H":
                continue
            parents[nxt] = (cell, action)
            if state.letter(nxt) == "G":
                path = []
                while parents[nxt] is not None:
                    nxt, step = parents[nxt]  # type: ignore[misc]
                    path.append(step)
                return path[::-1]
            frontier.append(nxt)
    return None


def _try_generate(size: int, frozen_prob: float, rng: random.Random) -> FrozenLakeState | None:
    """One map attempt (RAGEN's scheme); None when the goal cannot be reached from the start."""
    cells = ["F" if rng.random() < frozen_prob else "H" for _ in range(size * size)]
    start = randbelow(rng, size * size)
    goal = randbelow(rng, size * size - 1)
    goal += goal >= start  # uniform over the cells other than the start
    cells[start], cells[goal] = "S", "G"
    state = FrozenLakeState(desc=tuple("".join(cells[r * size:(r + 1) * size]) for r in range(size)),
                            player=divmod(start, size))
    return state if shortest_path(state) is not None else None


def generate_map(size: int, frozen_prob: float, seed: int) -> FrozenLakeState:
    """Deterministic solvable map for `seed` (the same in every process and on every machine)."""
    for attempt in range(MAX_ATTEMPTS):
        state = _try_generate(size, frozen_prob, random.Random(f"frozenlake/{seed}/{attempt}"))
        if state is not None:
            return state
    raise RuntimeError(f"no solvable {size}x{size} FrozenLake map with frozen_prob={frozen_prob} for seed {seed} "
                       f"after {MAX_ATTEMPTS} attempts; raise frozen_prob or lower size")


# ----------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------


@dataclass
class FrozenLakeConfig:
    """FrozenLake's keys (`env.frozenlake.<key>`); defaults are RAGEN's CoordFrozenLake tag."""

    size: int = 4
    """Board side (the map is size x size)."""
    frozen_prob: float = 0.9
    """Probability that a cell is frozen rather than a hole (RAGEN's p)."""
    success_rate: float = 0.8
    """Probability that a move goes where intended, else to either side, half each (RAGEN's slip rate = 1 - it)."""
    max_steps: int = 100
    """Env steps before the env itself ends the episode."""
    observation_format: str = "grid_coord"
    """grid | coord | grid_coord."""


class FrozenLakeEnv:
    """FrozenLake with RAGEN's maps, slips and renderings; see the module docstring.

    Args: the fields of `FrozenLakeConfig`.
    """

    Config = FrozenLakeConfig
    actions: tuple[str, ...] = ACTIONS
    reward_names: tuple[str, ...] = ("goal",)
    reward_weights: dict[str, float] = {}

    def __init__(self, size: int = 4, frozen_prob: float = 0.9, success_rate: float = 0.8, max_steps: int = 100,
                 observation_format: str = "grid_coord") -> None:
        self.size = int_at_least("size", size, 2)
        self.frozen_prob = probability("frozen_prob", frozen_prob)
        self.success_rate = probability("success_rate", success_rate)
        self.max_steps = int_at_least("max_steps", max_steps)
        self.observation_format = check_observation_format(observation_format)
        self._state: FrozenLakeState | None = None
        self._seed = 0

    def instructions(self) -> str:
        """Rules, slip rule, symbol legend and actions, for the system prompt (kept short: it is in every
        sequence)."""
        slips = "Moves never slip." if self.success_rate == 1.0 else (
            f"The ice is slippery: a move slips sideways with probability {1 - self.success_rate:.2g}.")
        text = (f"You are solving FrozenLake. Reach the goal; a hole ends the episode. {slips} "
                f"Moving off the board does nothing.\nSymbols: {_SYMBOL_LEGEND}.\n")
        if "coord" in self.observation_format:
            text += "Coordinates are (row, col); Up decreases the row.\n"
        return text + f"Actions: {', '.join(self.actions)}."

    def reset(self, seed: int) -> str:
        """Generate the map for `seed` (an integer >= 0), start a new episode, return the observation."""
        self._seed = int_at_least("seed", seed, 0)
        self._state = generate_map(self.size, self.frozen_prob, self._seed)
        return self.render()

    def reset_from_map(self, desc: Sequence[str] | str, seed: int = 0) -> str:
        """Start a new episode on a hand-built map (see `parse_map`); `seed` keys the slip draws."""
        self._seed = int_at_least("seed", seed, 0)
        self._state = parse_map(desc)
        return self.render()

    def step(self, action: str) -> StepResult:
        """Apply one move (with a slip as drawn for this seed and step); `goal` = 1 on reaching the goal."""
        state = self.get_state()
        if self.done():
            raise RuntimeError("the episode is over (goal, hole or max_steps reached); call reset() first")
        if not isinstance(action, str) or action not in DELTAS:
            raise ValueError(f"unknown action {action!r}; allowed: {', '.join(self.actions)}")
        u = random.Random(f"frozenlake/{self._seed}/slip/{state.num_env_steps}").random()
        direction = slip_direction(action, self.success_rate, u)
        player = _move(state, state.player, direction)
        self._state = replace(state, player=player, num_env_steps=state.num_env_steps + 1)
        info = {"action_is_effective": float(player != state.player), "action_is_valid": 1.0,
                "success": float(self.success()), "slipped": float(direction != action)}
        return StepResult(self.render(), {"goal": float(self.success())}, self.done(), info)

    def success(self) -> bool:
        """True when the player is on the goal."""
        state = self.get_state()
        return state.letter(state.player) == "G"

    def done(self) -> bool:
        """True on the goal, in a hole, or after `max_steps` env steps."""
        state = self.get_state()
        return state.is_terminal() or state.num_env_steps >= self.max_steps

    def render(self, observation_format: str | None = None) -> str:
        """Text of the current state, in `observation_format` (default: the env's format)."""
        return render(self.get_state(), observation_format or self.observation_format)

    def solve(self) -> list[str]:
        """Shortest move sequence from the current state to the goal, ignoring slips (see `shortest_path`);
        ValueError when the player is in a hole."""
        path = shortest_path(self.get_state())
        if path is None:
            raise ValueError("no path to the goal: the player is in a hole")
        return path

    def corpus_extras(self) -> list[str]:
        """Extra tokenizer-corpus texts: every cell coordinate as observations write it (after a space), often
        enough to become one token each. (At 50 copies, 5 of the 16 coordinates of a 4x4 board stayed two tokens,
        row and column, so goal and player sat at varying offsets from the end of the prompt.)"""
        return [" " + cell_coordinates(self.size, self.size)] * 200

    def get_state(self) -> FrozenLakeState:
        """The current (immutable) state; pass it to `set_state` to restore it later."""
        if self._state is None:
            raise RuntimeError("no episode yet; call reset(seed) or reset_from_map(desc) first")
        return self._state

    def set_state(self, state: FrozenLakeState) -> None:
        """Restore a state returned by `get_state` (slip draws continue from its step count)."""
        if not isinstance(state, FrozenLakeState):
            raise ValueError(f"state must be a FrozenLakeState, got {type(state).__name__}")
        self._state = state
