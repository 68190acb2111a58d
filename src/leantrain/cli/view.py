"""`leantrain view RUN_DIR`: the run as one self-contained HTML page (telemetry/view.py), or,
with `--serve`, the same page live on 127.0.0.1 while the run is still going."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from leantrain.cli.common import console, user_errors_exit_2
from leantrain.errors import LeantrainError


def register(app: typer.Typer) -> None:
    app.command()(view)


@user_errors_exit_2
def view(
    run_dir: Annotated[Path, typer.Argument(help="Run folder (--out of a run).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write the page (RUN_DIR/view.html).")
    ] = None,
    serve: Annotated[
        bool, typer.Option(help="Serve the page live, redrawn as the run grows, until Ctrl-C.")
    ] = False,
    host: Annotated[
        str, typer.Option(help="Address to serve on (--serve); keep 127.0.0.1 unless you mean it.")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(help="Port to serve on (--serve); 0 picks a free one.")
    ] = 8765,
    refresh: Annotated[
        float, typer.Option(help="Seconds between the live page's refreshes (--serve).")
    ] = 5.0,
) -> None:
    """One HTML page of a run: rollout timeline, trainer time, lengths, rewards, completions."""
    from leantrain.telemetry.view import make_server, write_page

    if not 0 <= port <= 65535:
        raise LeantrainError(f"--port must be in 0..65535, got {port}")
    if refresh <= 0:
        raise LeantrainError(f"--refresh must be > 0 seconds, got {refresh}")
    if not serve:
        console.print(f"wrote {write_page(run_dir, out)}")
        return
    try:
        server = make_server(run_dir, host, port, refresh)
    except OSError as e:
        raise LeantrainError(f"cannot serve on {host}:{port}: {e}") from None
    bound_host, bound_port = server.server_address[:2]
    console.print(f"serving {run_dir} live at http://{bound_host}:{bound_port}/ (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
