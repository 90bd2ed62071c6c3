"""The progress bar `recalibrate` and its callback draw."""


class ProgressBar:
    """A rich progress bar on stderr (rich comes with Keras): "<layer> ━━━ 3/8 0:00:01".

    Where stderr is not a terminal (a log file, CI), rich draws the final state once. A
    context manager: the bar stops on leaving the block.

    Args:
        enabled: draw it; when False nothing is drawn.
    """

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("recalibrate {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task("", total=None)
        self._total: int | None = 0  # None once some part's length is unknown

    def add_total(self, steps: int | None) -> None:
        """Count `steps` more steps in the total; None (a part of unknown length) makes the
        total unknown."""
        self._total = None if self._total is None or steps is None else self._total + steps
        self._progress.update(self._task, total=self._total)

    def __enter__(self) -> "ProgressBar":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def set_description(self, description: str) -> None:
        """Name the layer being recalibrated."""
        self._progress.update(self._task, description=description)

    def update(self, steps: int) -> None:
        """Advance by `steps`."""
        self._progress.advance(self._task, steps)
