"""adaptive_eagle_cli: the `adaptive-eagle` program, the one place that composes every package's
commands. It sits above all of them; none of them imports it.

Top level: the core's commands (adaptive_eagle.cli: generate, target-info, export-head,
import-head), the trainer's (trainer.cli: train-head, eval-head, data-stats) and the demo
(adaptive_eagle_cli.demo); `store ...` is the feature store's sub-app (feature_store.cli) and
`heads ...` the head registry's (adaptive_eagle.heads_cli).
The policy's commands (policies.cli: promotions, rollback, pin, unpin) are at top level too; they
differ from `heads pin/unpin` in that they also write the promotion log. The loop's `up` (loop.cli)
starts the whole loop as a local service.
"""

from __future__ import annotations

import typer

from adaptive_eagle.cli import app as core_app
from adaptive_eagle.heads_cli import heads_app
from adaptive_eagle_cli.demo import demo_app
from feature_store.cli import store_app
from loop.cli import loop_app
from policies.cli import policies_app
from trainer.cli import trainer_app

app = typer.Typer(
    help="adaptive-eagle: EAGLE-3 speculative decoding whose draft heads keep adapting to live traffic.\n\n"
    "Run the whole loop (`demo` on drifting traffic, `up` as a service: OpenAI-compatible gateway, near-line "
    "trainer, promotion policy), decode with EAGLE-3 (hot-swappable heads, lossless), train and evaluate draft "
    "heads, inspect the feature store of captured traffic, read the promotion log and roll back, pin or unpin "
    "heads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
# added without a name: their commands appear at top level, not nested
app.add_typer(trainer_app)
app.add_typer(core_app)
app.add_typer(demo_app)
app.add_typer(policies_app)
app.add_typer(loop_app)
app.add_typer(store_app, name="store")
app.add_typer(heads_app, name="heads")


def main() -> None:  # pragma: no cover
    app()
