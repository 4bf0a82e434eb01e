"""Console progress for process 0: a rich live panel on a terminal, plain lines elsewhere.

On a TTY it shows a training progress bar and the latest metrics grouped by prefix
(`rewards/...`, `logps/...`, eval metrics) like TRL's RichProgressCallback. Until the first step
of a run (or of a resumed run) ends, the bar says it is compiling: XLA traces and compiles the
jitted step then, which can take minutes while the bar would otherwise sit at its start. Without a TTY (CI,
log files) or with `disable_tqdm=True` it prints one line per `on_log` instead.
"""

from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import Progress
from rich.table import Table

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState


def _format(value) -> str:
    return (
        f"{value:.4g}"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else str(value)
    )


def group_metrics(logs: dict) -> dict[str, dict]:
    """{"rewards/chosen": 1, "loss": 2, "eval_loss": 3} -> {"rewards": {"chosen": 1},
    "train": {"loss": 2}, "eval": {"loss": 3}}; eval keys keep their own sub-groups."""
    groups: dict[str, dict] = {}
    for key, value in logs.items():
        is_eval = key.startswith("eval_")
        group, slash, name = key.removeprefix("eval_").partition("/")
        if not slash:
            group, name = "", group
        label = " ".join(part for part in ("eval" if is_eval else "", group) if part) or "train"
        groups.setdefault(label, {})[name] = value
    return groups


COMPILING = "[yellow]Compiling the first step"
TRAINING = "[blue]Training"


class RichProgressCallback(TrainerCallback):
    """Live progress bar + metrics tables on world process zero; plain prints without a TTY."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self._live: Live | None = None
        self._bar: Progress | None = None
        self._task = None
        self._tables: dict[str, dict] = {}

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero or args.disable_tqdm or not self.console.is_terminal:
            return
        self._bar = Progress(console=self.console)
        self._task = self._bar.add_task(COMPILING, total=state.max_steps)
        self._bar.update(self._task, completed=state.global_step)
        self._live = Live(self._render(state), console=self.console, refresh_per_second=4)
        self._live.start()

    def on_step_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if self._live is not None:
            self._bar.update(self._task, completed=state.global_step, description=TRAINING)

    def on_log(self, args, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        # The step is shown in the title/prefix; a `step` key in logs would repeat it.
        logs = {key: value for key, value in (logs or {}).items() if key != "step"}
        if self._live is None:
            metrics = " ".join(f"{key}={_format(value)}" for key, value in logs.items())
            self.console.print(
                f"step {state.global_step}/{state.max_steps} {metrics}", highlight=False
            )
            return
        for group, metrics in group_metrics(logs).items():
            self._tables.setdefault(group, {}).update(metrics)
        self._live.update(self._render(state))

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if self._live is not None:
            self._bar.update(self._task, completed=state.global_step)
            self._live.update(self._render(state))
            self._live.stop()
        self._live = self._bar = self._task = None
        self._tables = {}

    def _render(self, state: TrainerState) -> Panel:
        panels = []
        for group, metrics in self._tables.items():
            table = Table(title=f"[bold blue]{group}[/]", box=None, header_style="bold magenta")
            table.add_column("Metric", no_wrap=True)
            table.add_column("Value", justify="right")
            for name, value in metrics.items():
                table.add_row(name, _format(value))
            panels.append(Panel(table, border_style="cyan", padding=(0, 1)))
        body = Columns(panels, expand=True) if panels else "Nothing logged yet ..."
        title = f"[bold green]Step {state.global_step}/{state.max_steps}[/]"
        return Panel(Group(self._bar, Panel(body, title=title, border_style="green")))
