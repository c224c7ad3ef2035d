"""Headless matplotlib for every figure fivefold writes (loss curves, pipeline timelines, planner plots).

`pyplot()` imports pyplot on the non-interactive Agg backend (no display on clusters or CI);
`save_figure` writes a figure to a PNG, creating its folder, and frees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use: matplotlib is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Write `fig` to `path` (folders created), close it, and return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
