"""`onebit` entry point (typer)."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer

from onebit import __version__
from onebit.errors import OnebitError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Run GGUF mixture-of-experts models.")


def _fail(msg: str, code: int) -> None:
    typer.echo(f"onebit: error: {msg}", err=True)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"onebit {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


@app.command()
def generate(
    model: str = typer.Option(..., "--model", "-m", help="GGUF model file."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (raw, no chat template)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "--temp", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min-p x the best one."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="Repetition penalty (1 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    backend: str = typer.Option("numpy", "--backend", help="Compute backend."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text and tokens."),
) -> None:
    """Generate text from a prompt."""
    import onebit

    m = onebit.load(model, backend=backend)
    if not prompt:
        raise OnebitError("the prompt is empty")
    text, tokens, last = [], [], None
    for r in m.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, repetition_penalty=repeat_penalty, seed=seed, stop=stop):
        text.append(r.text)
        if r.token is not None:
            tokens.append(r.token)
        if not as_json:
            sys.stdout.write(r.text)
            sys.stdout.flush()
        last = r
    if as_json:
        out = {
            "text": "".join(text), "tokens": tokens, "finish_reason": last.finish_reason,
            "prompt_tokens": last.prompt_tokens, "generation_tokens": last.generation_tokens,
            "prompt_tps": round(last.prompt_tps, 3), "generation_tps": round(last.generation_tps, 3),
        }
        typer.echo(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")


def main() -> None:
    try:
        app(standalone_mode=False)
    except OnebitError as e:
        _print_error(str(e), e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("onebit: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # click usage errors and anything unexpected: one line, no traceback
        import click

        if isinstance(e, click.exceptions.UsageError):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if os.environ.get("ONEBIT_DEBUG"):
            raise
        _print_error(f"internal error: {type(e).__name__}: {e} (set ONEBIT_DEBUG=1 for a traceback)", 1)


def _print_error(msg: str, code: int) -> None:
    sys.stderr.write(f"onebit: error: {msg}\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
