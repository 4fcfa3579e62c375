"""Text renderings shared by the grid envs (Sokoban, FrozenLake): the three observation formats.

- `grid`: one line per row, one symbol per cell (each env has its own symbols).
- `coord`: a board-size line, then one line per non-empty category of zero-indexed (row, col) cells.
- `grid_coord`: the coordinates block, then the grid (RAGEN's layout).
"""

from __future__ import annotations

from collections.abc import Iterable

Cell = tuple[int, int]

OBSERVATION_FORMATS: tuple[str, ...] = ("grid", "coord", "grid_coord")


def check_observation_format(observation_format: str) -> str:
    """`observation_format` if it is one of `OBSERVATION_FORMATS`, else ValueError listing them."""
    if observation_format not in OBSERVATION_FORMATS:
        allowed = ", ".join(OBSERVATION_FORMATS)
        raise ValueError(f"unknown observation_format {observation_format!r}; allowed: {allowed}")
    return observation_format


def coord_text(shape: tuple[int, int], categories: Iterable[tuple[str, Iterable[Cell]]]) -> str:
    """Board size line, then `Name: (r, c), ...` for each category with cells (sorted; empty ones omitted)."""
    lines = [f"Board size: {shape[0]} rows x {shape[1]} cols (zero-indexed)."]
    for name, cells in categories:
        listed = ", ".join(f"({r}, {c})" for r, c in sorted(cells))
        if listed:
            lines.append(f"{name}: {listed}")
    return "\n".join(lines)


def compose(observation_format: str, grid: str, coord: str) -> str:
    """The observation text of `observation_format` from the grid and coordinate renderings."""
    check_observation_format(observation_format)
    if observation_format == "grid":
        return grid
    if observation_format == "coord":
        return coord
    return "Coordinates: \n" + coord + "\nGrid Map: \n" + grid


def cell_coordinates(rows: int, cols: int) -> str:
    """Every cell coordinate of the board, for the tiny tokenizer's corpus (each becomes one token)."""
    return " ".join(f"({r}, {c})" for r in range(rows) for c in range(cols))
