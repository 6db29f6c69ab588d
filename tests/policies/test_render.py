"""policies.render: the on-call table (every column filled from the evidence) and JSON lines."""

from __future__ import annotations

import io
import json

from rich.console import Console

from policies.log import PromotionEvent
from policies.render import event_table, json_lines, mean_cell, n_cell, tail_cell, versions_cell


def text(table) -> str:
    console = Console(file=io.StringIO(), width=250, no_color=True)
    console.print(table)
    return console.file.getvalue()


GATE = {"gate": "canary", "metric": "accept_length", "quantile": 0.05, "tail_champion": 1.412, "tail_candidate": 1.465,
        "ci_low": 0.021, "ci_high": 0.088, "mean_champion": 1.9, "mean_candidate": 1.95, "n_champion": 410,
        "n_candidate": 402}
COLD = {**GATE, "metric": "tpot_s", "quantile": 0.95, "tail_champion": 0.0412, "tail_candidate": 0.033,
        "ci_low": 0.0021, "ci_high": 0.0097, "mean_champion": 0.035, "mean_candidate": 0.03}


def test_cells():
    assert tail_cell(GATE) == "p5 1.412→1.465 [+0.021,+0.088]"
    assert tail_cell(COLD) == "P95 TPOT 41.2→33.0ms [+2.1,+9.7]"
    assert tail_cell({**GATE, "ci_low": 0.4, "ci_high": -0.05}) == "p5 1.412→1.465 [+0.400,-0.050]"
    assert mean_cell(GATE) == "1.900→1.950" and mean_cell(COLD) == "35.0→30.0ms"
    assert n_cell(GATE) == "410/402" and n_cell({"n_live": 25}) == "25" and n_cell({}) == ""
    assert tail_cell({}) == "" and mean_cell({"mean_accept_length": 1.02}) == "1.020"
    assert versions_cell(PromotionEvent(event="promoted", candidate="v2", champion="v1")) == "v1→v2"
    assert versions_cell(PromotionEvent(event="pinned", candidate="v1", champion="v0")) == "v1"
    assert versions_cell(PromotionEvent(event="rolled_back", candidate="v2", champion="v1")) == "v2→v1"


def test_table_has_one_row_per_event_with_the_reason():
    events = [PromotionEvent(time="2026-03-01T10:00:00.000Z", event="canary_started", candidate="v2",
                             champion="v1", reason="offline gate passed.", evidence=GATE),
              PromotionEvent(time="2026-03-01T10:05:00.000Z", event="rolled_back", candidate="v2", champion="v1",
                             by="on-call", reason="collapse.")]
    out = text(event_table(events, title="promotions"))
    for word in ("2026-03-01 10:00:00", "canary_started", "v1→v2", "p5 1.412→1.465", "410/402",
                 "offline gate passed.", "rolled_back", "on-call", "collapse."):
        assert word in out, word
    assert out.index("canary_started") < out.index("rolled_back")


def test_json_lines_are_the_stored_lines():
    e = PromotionEvent(event="promoted", candidate="v2", evidence=GATE)
    (line,) = json_lines([e])
    assert json.loads(line) == e.model_dump()
