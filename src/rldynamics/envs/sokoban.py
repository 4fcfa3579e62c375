"""Sokoban as a text environment, with our own seeded puzzle generator and an optimal solver.

Design choices:
- Behaviour follows RAGEN's Sokoban (docs/reference/ragen_behaviour.md §7): push dynamics; −0.1 per step,
  +1 / −1 when the number of boxes on targets goes up / down, +10 when every box is on a target, reported
  as the named reward components `step`, `box` and `solved` (their sum is RAGEN's reward); `done`
  when solved or after `max_steps` env steps; the grid / coord / grid_coord renderings. Defaults mirror
  RAGEN's CoordSokoban tag (6×6, 1 box, 100 steps, grid_coord).
- The generator is ours. Topology: a random walk that carves 3×3 floor masks inside a wall border. Boxes
  start on their targets; a breadth-first reverse play (player moves and box *pulls*, at most
  `search_depth` moves and `MAX_REVERSE_STATES` states) then picks, uniformly at random, one of the
  reachable states with the largest total box displacement (Manhattan distance of each box from the
  target it started on) among those with no box on any target (gym_sokoban's rule: a start with a box on
  a target would score its first step differently, since RAGEN's env counts boxes on targets from 0).
  Forward pushes undo the pulls, so every puzzle is solvable and never already solved. RAGEN multiplies
  the displacement by a box-switch count and random-walks the player afterwards; picking among all best
  states already varies the player cell.
- Determinism: each attempt draws from `random.Random(f"sokoban/{seed}/{attempt}")` and only ever calls
  `Random.random()`, the one stream Python guarantees across versions. No `hash()`, no global RNG, so
  the retry after a failed topology is reproducible too (RAGEN's fallback reseed is not).
- In the coord rendering each cell appears under exactly one heading, mirroring the grid symbols:
  "Targets" lists free targets (O); a target under a box or the player is listed under
  "Boxes on target" (√) or "Player on target" (S). Empty headings are omitted; walls are not listed.
- State is an immutable `SokobanState` of (row, col) tuples, so copy/restore is `get_state` / `set_state`.
  Search code uses flat cell indices (row * width + col); the wall border means neighbours never wrap.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rldynamics.envs.base import StepResult, int_at_least, randbelow
from rldynamics.envs.grid import cell_coordinates, check_observation_format, compose, coord_text

Cell = tuple[int, int]

ACTIONS: tuple[str, ...] = ("Up", "Down", "Left", "Right")
DELTAS: dict[str, Cell] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}

STEP_PENALTY = -0.1
BOX_ON_TARGET_REWARD = 1.0
BOX_OFF_TARGET_PENALTY = -1.0
SOLVED_REWARD = 10.0

# Generator knobs (RAGEN/gym_sokoban values where one exists).
WALK_STEPS_PER_SIDE = 1.7  # random-walk length = int(1.7 * (rows + cols))
P_CHANGE_DIRECTION = 0.35
MAX_ATTEMPTS = 64
MAX_REVERSE_STATES = 300_000
MAX_SOLVER_STATES = 2_000_000

# Floor masks carved around the walker, as (row, col) offsets from its cell.
_MASKS: tuple[tuple[Cell, ...], ...] = (
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
    ((-1, 0), (0, -1), (0, 0)),
    ((0, 0), (0, 1), (1, 0), (1, 1)),
)

_SYMBOL_LEGEND = "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target"
_GRID_SYMBOLS = frozenset("#_O√XPS")


@dataclass(frozen=True)
class SokobanState:
    """A complete, immutable Sokoban state; cells are (row, col), zero-indexed from the top-left.

    Invariants (checked on construction): the border is wall; boxes, targets and the player lie inside
    the room and off walls; the player is not on a box; there are as many boxes as targets (at least one).
    """

    shape: tuple[int, int]
    walls: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell
    num_env_steps: int = 0

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if rows < 3 or cols < 3:
            raise ValueError(f"room shape must be at least 3x3, got {self.shape}")
        pieces = self.boxes | self.targets | {self.player}
        if any(not (0 <= r < rows and 0 <= c < cols) for r, c in pieces):
            raise ValueError(f"boxes, targets and the player must lie inside the {rows}x{cols} room")
        border = {(r, c) for r in range(rows) for c in (0, cols - 1)}
        border |= {(r, c) for r in (0, rows - 1) for c in range(cols)}
        if not border <= self.walls:
            raise ValueError(f"room border must be all wall; open border cells: {sorted(border - self.walls)}")
        if not self.targets or len(self.boxes) != len(self.targets):
            raise ValueError(f"need as many boxes as targets (>= 1), got {len(self.boxes)} and {len(self.targets)}")
        if pieces & self.walls:
            raise ValueError("boxes, targets and the player must not be on walls")
        if self.player in self.boxes:
            raise ValueError(f"player and a box share cell {self.player}")

    def is_solved(self) -> bool:
        """True when every box is on a target."""
        return self.boxes == self.targets


def parse_grid(grid: str) -> SokobanState:
    """Build a state from grid text using the rendering symbols (one row per line).

    Symbols: # wall, _ empty, O target, √ box on target, X box, P player, S player on target.
    Leading/trailing blank lines are ignored; rows must have equal length and exactly one player.
    """
    rows = grid.strip("\n").split("\n")
    if len({len(row) for row in rows}) != 1:
        raise ValueError(f"grid rows must all have the same length, got lengths {[len(row) for row in rows]}")
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    unknown = sorted({ch for ch in cells.values() if ch not in _GRID_SYMBOLS})
    if unknown:
        raise ValueError(f"unknown grid symbols {unknown}; allowed: {' '.join(sorted(_GRID_SYMBOLS))}")
    players = [cell for cell, ch in cells.items() if ch in "PS"]
    if len(players) != 1:
        raise ValueError(f"grid must contain exactly one player (P or S), found {len(players)}")
    return SokobanState(
        shape=(len(rows), len(rows[0])),
        walls=frozenset(cell for cell, ch in cells.items() if ch == "#"),
        targets=frozenset(cell for cell, ch in cells.items() if ch in "O√S"),
        boxes=frozenset(cell for cell, ch in cells.items() if ch in "X√"),
        player=players[0],
    )


# ----------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------


def _symbol(state: SokobanState, cell: Cell) -> str:
    on_target = cell in state.targets
    if cell in state.walls:
        return "#"
    if cell in state.boxes:
        return "√" if on_target else "X"
    if cell == state.player:
        return "S" if on_target else "P"
    return "O" if on_target else "_"


def render_grid(state: SokobanState) -> str:
    """One line per row, one symbol per cell (see `parse_grid` for the symbols)."""
    rows, cols = state.shape
    return "\n".join("".join(_symbol(state, (r, c)) for c in range(cols)) for r in range(rows))


def render_coord(state: SokobanState) -> str:
    """Board size line, then one line per non-empty category of zero-indexed (row, col) coordinates."""
    player = {state.player}
    categories = (
        ("Targets", state.targets - state.boxes - player),
        ("Boxes", state.boxes - state.targets),
        ("Boxes on target", state.boxes & state.targets),
        ("Player", player - state.targets),
        ("Player on target", player & state.targets),
    )
    return coord_text(state.shape, categories)


def render(state: SokobanState, observation_format: str) -> str:
    """Render `state` as `grid`, `coord`, or `grid_coord` (coordinates block, then the grid)."""
    return compose(observation_format, render_grid(state), render_coord(state))


# ----------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------


def _random_floor(rows: int, cols: int, rng: random.Random) -> list[int]:
    """Carve floor by a random walk of 3×3 masks; return sorted flat indices of interior floor cells."""
    floor: set[int] = set()
    r, c = 1 + randbelow(rng, rows - 2), 1 + randbelow(rng, cols - 2)
    dr, dc = DELTAS[ACTIONS[randbelow(rng, 4)]]
    for _ in range(int(WALK_STEPS_PER_SIDE * (rows + cols))):
        if rng.random() < P_CHANGE_DIRECTION:
            dr, dc = DELTAS[ACTIONS[randbelow(rng, 4)]]
        r, c = min(max(r + dr, 1), rows - 2), min(max(c + dc, 1), cols - 2)
        for mr, mc in _MASKS[randbelow(rng, len(_MASKS))]:
            if 0 < r + mr < rows - 1 and 0 < c + mc < cols - 1:
                floor.add((r + mr) * cols + c + mc)
    return sorted(floor)


def _sample(cells: list[int], k: int, rng: random.Random) -> list[int]:
    """k distinct cells by a partial Fisher-Yates shuffle."""
    pool = list(cells)
    for i in range(k):
        j = i + randbelow(rng, len(pool) - i)
        pool[i], pool[j] = pool[j], pool[i]
    return pool[:k]


def _displacement(boxes: tuple[int, ...], origins: tuple[int, ...], cols: int) -> int:
    """Total Manhattan distance of each box from the target it started on (boxes keep their order)."""
    total = 0
    for box, origin in zip(boxes, origins, strict=True):
        (br, bc), (orow, ocol) = divmod(box, cols), divmod(origin, cols)
        total += abs(br - orow) + abs(bc - ocol)
    return total


def _reverse_successors(player: int, boxes: tuple[int, ...], floor: frozenset[int], steps: tuple[int, ...]):
    """Yield reverse-play states: walk to a free neighbour, optionally pulling the box behind the player."""
    for step in steps:
        dest = player + step
        if dest not in floor or dest in boxes:
            continue
        yield dest, boxes
        if player - step in boxes:
            yield dest, tuple(player if box == player - step else box for box in boxes)


def _reverse_play(
    floor: frozenset[int], cols: int, player: int, targets: tuple[int, ...], search_depth: int, rng: random.Random
) -> tuple[int, tuple[int, ...]] | None:
    """Breadth-first reverse play from the solved state; a random maximum-displacement state with every box
    off every target, or None."""
    steps = (-cols, cols, -1, 1)
    solved = frozenset(targets)
    seen = {(player, solved)}
    frontier = [(player, targets)]
    best_score, best = 0, []
    for _ in range(search_depth):
        next_frontier = []
        for p, boxes in frontier:
            for state in _reverse_successors(p, boxes, floor, steps):
                key = (state[0], frozenset(state[1]))
                if key in seen:
                    continue
                seen.add(key)
                next_frontier.append(state)
                score = 0 if key[1] & solved else _displacement(state[1], targets, cols)
                if score > best_score:
                    best_score, best = score, [state]
                elif score == best_score and score > 0:
                    best.append(state)
        frontier = next_frontier
        if not frontier or len(seen) >= MAX_REVERSE_STATES:
            break
    return best[randbelow(rng, len(best))] if best else None


def _try_generate(rows: int, cols: int, num_boxes: int, search_depth: int, rng: random.Random) -> SokobanState | None:
    """One generation attempt; None when the topology is too small or no reachable state has every box off
    target."""
    floor = _random_floor(rows, cols, rng)
    if len(floor) < num_boxes + 1:
        return None
    picks = _sample(floor, num_boxes + 1, rng)
    found = _reverse_play(frozenset(floor), cols, picks[0], tuple(picks[1:]), search_depth, rng)
    if found is None:
        return None
    player, boxes = found
    floor_cells = {divmod(i, cols) for i in floor}
    return SokobanState(
        shape=(rows, cols),
        walls=frozenset((r, c) for r in range(rows) for c in range(cols) if (r, c) not in floor_cells),
        targets=frozenset(divmod(t, cols) for t in picks[1:]),
        boxes=frozenset(divmod(b, cols) for b in boxes),
        player=divmod(player, cols),
    )


def generate_puzzle(dim_room: tuple[int, int], num_boxes: int, search_depth: int, seed: int) -> SokobanState:
    """Deterministic, solvable, unsolved puzzle for `seed` (same result in every process and machine)."""
    rows, cols = dim_room
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"sokoban/{seed}/{attempt}")
        state = _try_generate(rows, cols, num_boxes, search_depth, rng)
        if state is not None:
            return state
    raise RuntimeError(
        f"could not generate a {rows}x{cols} Sokoban room with {num_boxes} boxes for seed {seed} after "
        f"{MAX_ATTEMPTS} attempts; use a larger dim_room or fewer boxes"
    )


# ----------------------------------------------------------------------------------------------------
# Solver
# ----------------------------------------------------------------------------------------------------


def _backtrack(parents: dict, key: tuple) -> list[str]:
    path = []
    while parents[key] is not None:
        key, action = parents[key]
        path.append(action)
    return path[::-1]


def solve(state: SokobanState, max_states: int = MAX_SOLVER_STATES) -> list[str]:
    """Shortest action-word sequence that solves `state` (breadth-first search over player and boxes).

    Returns [] for a solved state. Raises ValueError when the state is unsolvable (e.g. a box pushed
    into a corner) or the search exceeds `max_states` states.
    """
    rows, cols = state.shape
    floor = frozenset(r * cols + c for r in range(rows) for c in range(cols) if (r, c) not in state.walls)
    targets = frozenset(r * cols + c for r, c in state.targets)
    moves = tuple((name, dr * cols + dc) for name, (dr, dc) in DELTAS.items())
    start = (state.player[0] * cols + state.player[1], frozenset(r * cols + c for r, c in state.boxes))
    if start[1] == targets:
        return []
    parents: dict = {start: None}
    frontier = deque([start])
    while frontier and len(parents) <= max_states:
        key = frontier.popleft()
        player, boxes = key
        for name, step in moves:
            dest = player + step
            if dest not in floor:
                continue
            if dest in boxes:
                if dest + step not in floor or dest + step in boxes:
                    continue
                new_key = (dest, (boxes - {dest}) | {dest + step})
            else:
                new_key = (dest, boxes)
            if new_key in parents:
                continue
            parents[new_key] = (key, name)
            if new_key[1] == targets:
                return _backtrack(parents, new_key)
            frontier.append(new_key)
    reason = "it is unsolvable" if not frontier else f"the search exceeded max_states={max_states}"
    raise ValueError(f"no solution found for the Sokoban state: {reason}")


# ----------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------


def _dim_room(value: object) -> tuple[int, int]:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"dim_room must be a (rows, cols) pair, got {value!r}")
    return int_at_least("dim_room[0]", value[0], 3), int_at_least("dim_room[1]", value[1], 3)


@dataclass
class SokobanConfig:
    """Sokoban's keys (`env.sokoban.<key>`); defaults are RAGEN's CoordSokoban tag."""

    dim_room: list[int] = field(default_factory=lambda: [6, 6])
    """Room size [rows, cols], border included."""
    num_boxes: int = 1
    """Boxes (and targets) per room."""
    max_steps: int = 100
    """Env steps before the env itself ends the episode."""
    search_depth: int = 300
    """Depth of the reverse-play search that scrambles the solved room."""
    observation_format: str = "grid_coord"
    """grid | coord | grid_coord."""
    step_penalty: float = STEP_PENALTY
    """Reward component `step` of every action (RAGEN: -0.1)."""


class SokobanEnv:
    """Sokoban with RAGEN's rewards and text renderings; see the module docstring for the generator.

    Args: the fields of `SokobanConfig`.
    """

    Config = SokobanConfig
    actions: tuple[str, ...] = ACTIONS
    reward_names: tuple[str, ...] = ("step", "box", "solved")
    reward_weights: dict[str, float] = {}

    def __init__(
        self,
        dim_room: Sequence[int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        search_depth: int = 300,
        observation_format: str = "grid_coord",
        step_penalty: float = STEP_PENALTY,
    ) -> None:
        self.dim_room = _dim_room(dim_room)
        self.num_boxes = int_at_least("num_boxes", num_boxes)
        self.max_steps = int_at_least("max_steps", max_steps)
        self.search_depth = int_at_least("search_depth", search_depth)
        interior = (self.dim_room[0] - 2) * (self.dim_room[1] - 2)
        if interior < self.num_boxes + 1:
            raise ValueError(f"dim_room {self.dim_room} has {interior} inner cells, too few for {num_boxes} boxes")
        self.observation_format = check_observation_format(observation_format)
        self.step_penalty = float(step_penalty)
        self._state: SokobanState | None = None

    def instructions(self) -> str:
        """Rules, symbol legend and available actions, for the system prompt (kept short: it is in every
        sequence)."""
        text = (
            "You are solving Sokoban. Push every box onto a target; you can push a box, never pull it.\n"
            f"Symbols: {_SYMBOL_LEGEND}.\n"
        )
        if "coord" in self.observation_format:
            text += "Coordinates are (row, col); Up decreases the row.\n"
        return text + f"Actions: {', '.join(self.actions)}."

    def reset(self, seed: int) -> str:
        """Generate the puzzle for `seed` (an integer >= 0), start a new episode, return the observation."""
        seed = int_at_least("seed", seed, 0)
        self._state = generate_puzzle(self.dim_room, self.num_boxes, self.search_depth, seed)
        return self.render()

    def reset_from_grid(self, grid: str) -> str:
        """Start a new episode on a hand-built room (see `parse_grid`); return the observation."""
        self._state = parse_grid(grid)
        return self.render()

    def step(self, action: str) -> StepResult:
        """Apply one action word with push semantics and RAGEN's rewards."""
        state = self.get_state()
        if self.done():
            raise RuntimeError("the episode is over (solved or max_steps reached); call reset() first")
        if not isinstance(action, str) or action not in DELTAS:
            raise ValueError(f"unknown action {action!r}; allowed: {', '.join(self.actions)}")
        player, boxes = _push(state, DELTAS[action])
        self._state = replace(state, player=player, boxes=boxes, num_env_steps=state.num_env_steps + 1)
        before, after = len(state.boxes & state.targets), len(boxes & state.targets)
        box = BOX_ON_TARGET_REWARD if after > before else BOX_OFF_TARGET_PENALTY if after < before else 0.0
        reward = {"step": self.step_penalty, "box": box, "solved": SOLVED_REWARD if self.success() else 0.0}
        info = {"action_is_effective": float(player != state.player), "action_is_valid": 1.0}
        info["success"] = float(self.success())
        return StepResult(observation=self.render(), reward=reward, done=self.done(), info=info)

    def success(self) -> bool:
        """True when every box is on a target."""
        return self.get_state().is_solved()

    def done(self) -> bool:
        """True when solved or after `max_steps` env steps."""
        state = self.get_state()
        return state.is_solved() or state.num_env_steps >= self.max_steps

    def render(self, observation_format: str | None = None) -> str:
        """Text of the current state, in `observation_format` (default: the env's format)."""
        return render(self.get_state(), observation_format or self.observation_format)

    def solve(self) -> list[str]:
        """Shortest action sequence from the current state (see `solve`)."""
        return solve(self.get_state())

    def corpus_extras(self) -> list[str]:
        """Extra tokenizer-corpus texts: every cell coordinate, often enough to become one token each."""
        rows, cols = self.dim_room
        return [cell_coordinates(rows, cols)] * 50

    def get_state(self) -> SokobanState:
        """The current (immutable) state; pass it to `set_state` to restore it later."""
        if self._state is None:
            raise RuntimeError("no episode yet; call reset(seed) or reset_from_grid(grid) first")
        return self._state

    def set_state(self, state: SokobanState) -> None:
        """Restore a state returned by `get_state` (or built with `parse_grid`)."""
        if not isinstance(state, SokobanState):
            raise ValueError(f"state must be a SokobanState, got {type(state).__name__}")
        self._state = state


def _push(state: SokobanState, delta: Cell) -> tuple[Cell, frozenset[Cell]]:
    """Player and boxes after one push-style move (unchanged when blocked)."""
    (r, c), (dr, dc) = state.player, delta
    dest, beyond = (r + dr, c + dc), (r + 2 * dr, c + 2 * dc)
    if dest in state.walls:
        return state.player, state.boxes
    if dest in state.boxes:
        if beyond in state.walls or beyond in state.boxes:
            return state.player, state.boxes
        return dest, (state.boxes - {dest}) | {beyond}
    return dest, state.boxes
