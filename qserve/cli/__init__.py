"""The `qserve` command line: one module per command group, each command a few lines over the library."""

from __future__ import annotations

import sys

import typer

from qserve.cli import checkpoint, evaluate, gate, matrix, quantize, run, serve, tools, tune
from qserve.cli._common import user_errors as _user_errors  # noqa: F401  (tests drive it directly)

app = typer.Typer(
    name="qserve",
    help="Quantize an LLM, gate its accuracy with lm-eval, and serve it on vLLM with matched arguments.\n\n"
    "One command: `qserve run recipes/w8a8-int8.yaml --tasks gsm8k_ppl --limit 150` (quantize -> eval -> serve, "
    "reusing finished steps).\n\n"
    "Step by step: `qserve quantize recipes/w8a8-int8.yaml` -> `qserve eval --tasks gsm8k_ppl --limit 150` -> "
    "`qserve serve out-w8a8-int8`.\n\n"
    "Also: `qserve doctor` (what runs here), `qserve inspect CKPT`, `qserve reproduce CKPT`, `qserve sign CKPT`, "
    "`qserve compare recipes/*.yaml`, `qserve tune RECIPE` (the smallest per-layer mix that passes), "
    "`qserve bench CKPT` (or `--suite`), `qserve gate BASE_RUN QUANT_RUN` (the gate on two lm-eval runs), "
    "`qserve gate-levels` (what the gate guarantees at each n), `qserve matrix` (architectures x schemes, run for real).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


# Extra arguments only after `--` (they go to vLLM); an unknown option before it is a typo, not a pass-through.
PASS_THROUGH = {"allow_extra_args": True}

# `eval` and `run` take lm-eval's --apply-chat-template bare or with =NAME (evaluate.LmEvalCommand).
app.command("run", context_settings=PASS_THROUGH, cls=evaluate.LmEvalCommand)(run.run)
app.command("quantize")(quantize.quantize)
app.command("eval", cls=evaluate.LmEvalCommand)(evaluate.eval_)
app.command("serve", context_settings=PASS_THROUGH)(serve.serve)
app.command("reproduce")(quantize.reproduce)
app.command("inspect")(checkpoint.inspect)
app.command("sign")(checkpoint.sign)
app.command("compare")(tools.compare)
app.command("tune")(tune.tune)
app.command("bench")(serve.bench)
app.command("doctor")(tools.doctor)
app.command("gate")(gate.gate)
app.command("gate-levels")(gate.gate_levels)
app.command("matrix")(matrix.matrix)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
