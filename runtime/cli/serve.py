"""``mbert-run serve``: a real tritonserver on a bundle's Triton repository (see
:mod:`mbert.runtime.serve.server`). Only click is imported at the top, so ``mbert-run --help`` stays
instant.

The server runs on a private serving folder (``$TMPDIR/mbert-serve-*``): the repository's configs,
its files hard-linked from the verified bundle, and Triton's own log (``tritonserver.log``, whose
tail is shown when the server fails). The folder is marked as this tool's (:mod:`mbert.bundle.owner`)
and removed when the command ends; the folders of serve commands that were killed (``kill -9``) are
removed by the next one, with their shared-memory segments. Ports default to Triton's 8000 (HTTP),
8001 (gRPC) and 8002 (metrics); a taken port is named before the server starts.
"""
from __future__ import annotations

import signal
from pathlib import Path

import click

from mbert.bundle.names import TRITON_ENCODERS

LOG = "tritonserver.log"


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--http-port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="0: a free port.")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=8001, show_default=True,
              help="0: a free port.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=8002, show_default=True,
              help="0: a free port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the endpoints bind (0.0.0.0: every interface).")
@click.option("--encoder", type=click.Choice(TRITON_ENCODERS), default=None,
              help="Route the ensemble to this encoder instead of the one chosen at export (the bundle stays "
                   "as it is: the server always runs on a private copy of the repository's configs).")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for the models to load.")
def serve(bundle, http_port, grpc_port, metrics_port, host, encoder, ready_timeout):
    """Serve BUNDLE's Triton repository with a real tritonserver until Ctrl-C / SIGTERM."""
    from mbert.bundle import open_bundle
    from mbert.bundle.errors import MbertError
    from mbert.runtime.serve.folder import serve_folder
    from mbert.runtime.serve.repository import ensemble_models, serving_copy
    from mbert.runtime.serve.server import TritonServer, check_port

    try:
        for option, port in (("--http-port", http_port), ("--grpc-port", grpc_port),
                             ("--metrics-port", metrics_port)):
            if port:
                check_port(host, port, option)
        with serve_folder() as workdir, open_bundle(bundle) as opened:
            repo = serving_copy(opened, encoder, workdir)
            opened.close()  # the copy holds the verified files; an export may replace the bundle now
            if encoder:
                click.echo(f"the ensemble routes to the {encoder} encoder", err=True)
            unreadable: list[str] = []
            models = ensemble_models(repo, unreadable)
            for problem in unreadable:
                click.echo(f"warning: skipped {problem}", err=True)
            server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                                  host=host, models=models, log=workdir / LOG, ready_timeout=ready_timeout)
            code, stopping = _run(server, repo, models)
    except MbertError as exc:
        raise click.ClickException(str(exc)) from exc
    if code not in (0, None) and not stopping:
        raise click.ClickException(f"tritonserver exited with status {code}")


def _run(server, repo: Path, models: list[str]) -> tuple[int | None, list[int]]:
    """Start ``server``, print its endpoints once it is ready, forward Ctrl-C and SIGTERM (a second one
    kills it); (its exit status, the signals that stopped it)."""
    from mbert.runtime.serve.repository import curl_example, ensembles, first_output

    server.start()
    stopping: list[int] = []

    def forward(signum, _frame):
        stopping.append(signum)
        server.signal(signum if len(stopping) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.wait_ready()
        name = sorted(ensembles(repo, []))[0]
        click.echo(f"\nTriton serving {repo.parent.name} with {server.install.origin}\n"
                   f"  models   {', '.join(models)}\n"
                   f"  HTTP     http://{server.http_url}\n  gRPC     {server.grpc_url}\n"
                   f"  metrics  {server.metrics_url}\n"
                   f"  log      {server.log_path}\n"
                   f"  try      {curl_example(server.http_url, name, first_output(repo, name))}\n"
                   "Ctrl-C stops it.", err=True)
        server.process.wait()
    finally:
        code = server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, stopping
