"""`onebit generate --input ... --ray ADDRESS`: the batch on a Ray cluster (onebit.apps.cluster),
with one progress bar and, with --stats, a table per worker."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from onebit.errors import UsageError


def check_ray_args(input: Optional[str], model: Optional[str], ctx: Optional[int], trace: Optional[str],
                   predict) -> None:
    """Refuse what --ray cannot do before anything is opened; Ray itself must be installed."""
    from onebit.apps.cluster import import_ray

    if input is None:
        raise UsageError("--ray runs a prompts file: give --input (and --output)")
    if trace is not None or (predict is not None and predict.out is not None):
        raise UsageError("--trace and --moe-predict-out write one file per process: run them without --ray")
    import_ray()
    if ctx is not None:
        from .options import _check_ctx, default_model_path

        _check_ctx(model or default_model_path(), ctx)


def generate_on_ray(address: str, workers: Optional[int], worker_cpus: float, stats: bool, input: str,
                    input_format: str, results, on_error: str, done: set[str], spec, work: dict) -> None:
    """The batch on Ray, every worker loading the model as `spec` (a LoadSpec) says."""
    import dataclasses

    from tqdm import tqdm

    from onebit.apps import batch, cluster
    from onebit.formats.gguf_file import GGUFFile

    if spec.path is not None:  # (a worker's working directory is Ray's)
        spec = dataclasses.replace(spec, path=os.path.abspath(spec.path))
    path = spec.model_path()
    GGUFFile(path)  # a file the driver cannot read is refused here, before a cluster starts
    reference = cluster.Fingerprint.of(path)
    stream, total = batch.open_prompts(input)

    def say(msg: str) -> None:
        tqdm.write(f"onebit: {msg}", file=sys.stderr)

    with cluster.RayBatch(address, spec, cluster.Work(**work), workers, worker_cpus, say=say) as rb:
        rb.start(reference)
        with tqdm(total=total, unit="prompt", file=sys.stderr, disable=None, dynamic_ncols=True) as bar:
            run = batch.BatchRun(results, input, on_error, done, tick=bar.update,
                                 warn=lambda msg: say(f"warning: {msg}"))

            def progress(p: cluster.Progress) -> None:
                bar.set_postfix_str(f"{p.tokens_per_s:.1f} tok/s, workers {p.alive}/{p.workers}", refresh=False)

            rb.run(run, run.pending(stream, input_format), progress)
        if stats:
            rb.collect_stats()
            typer.echo(rb.table(), err=True)
    for line in run.summary():
        typer.echo(line, err=True)
