"""``mbert-run serve``: a real tritonserver on a bundle's Triton repository (see
:mod:`mbert.runtime.serve`). Only click is imported here, so ``mbert-run --help`` stays instant.

Wiring into ``mbert-run``: ``main.add_command(serve)`` in ``runtime/cli.py``.
"""
from __future__ import annotations

import signal
from pathlib import Path

import click

ENCODERS = ("python", "onnx", "trt")


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--http-port", type=click.IntRange(0, 65535), default=0, help="Default: a free port.")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=0, help="Default: a free port.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, help="Default: a free port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the endpoints bind (0.0.0.0: every interface).")
@click.option("--encoder", type=click.Choice(ENCODERS), default=None,
              help="Route the ensemble to this encoder instead of the one chosen at export (the bundle stays "
                   "as it is: the server always runs on a private copy of the repository's configs).")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for the models to load.")
def serve(bundle, http_port, grpc_port, metrics_port, host, encoder, ready_timeout):
    """Serve BUNDLE's Triton repository with a real tritonserver until Ctrl-C / SIGTERM."""
    import tempfile

    from mbert.modeling.errors import MbertError

    from .serve import TritonServer, curl_example, ensemble_models, ensembles, first_output, \
        repository_of, serving_copy

    workdir = tempfile.TemporaryDirectory(prefix="mbert-serve-")
    try:
        repo = serving_copy(repository_of(bundle), encoder, workdir.name)  # the sealed bundle stays untouched
        if encoder:
            click.echo(f"the ensemble routes to the {encoder} encoder", err=True)
        unreadable: list[str] = []
        models = ensemble_models(repo, unreadable)
        for problem in unreadable:
            click.echo(f"warning: skipped {problem}", err=True)
        server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                              host=host, models=models, log="-", ready_timeout=ready_timeout)
        server.start()
        stopping = []

        def forward(signum, _frame):
            stopping.append(signum)
            server.signal(signum if len(stopping) == 1 else signal.SIGKILL)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.wait_ready()
            name = sorted(ensembles(repo, []))[0]
            click.echo(f"\nTriton serving {repo} with {server.install.origin}\n"
                       f"  models   {', '.join(models)}\n"
                       f"  HTTP     http://{server.http_url}\n  gRPC     {server.grpc_url}\n"
                       f"  metrics  {server.metrics_url}\n"
                       f"  try      {curl_example(server, name, first_output(repo, name))}\n"
                       "Ctrl-C stops it.", err=True)
            code = server.process.wait()
        finally:
            code = server.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
    except MbertError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        workdir.cleanup()
    if code not in (0, None) and not stopping:
        raise click.ClickException(f"tritonserver exited with status {code}")
