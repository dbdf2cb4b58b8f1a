"""``dspark-export``: the command group of the offline toolchain and its console entry point (``main``).

The commands live in :mod:`dspark_export.commands` by subject; this module only assembles them. Importing it
loads no torch (``dspark-export --help`` stays fast): the modules that need torch are imported by the commands
that run them.
"""
from __future__ import annotations

import click

from dspark_runtime.cli import run_cli

from dspark_export.commands import drafter, engine, fit, models, precision


@click.group()
@click.version_option(package_name="dspark")
def cli():
    """DSpark offline toolchain: fetch models, export and validate graphs, write the manifest."""


for _command in (models.fetch, models.list_models, models.list_recipes,
                 engine.build, engine.build_trt_cmd, engine.build_cuda_cmd, engine.add_draft,
                 engine.add_prompt_graph_cmd, engine.pack,
                 drafter.train_draft,
                 fit.calibrate, fit.profile, fit.compare,
                 precision.calibrate_quant, precision.quantize):
    cli.add_command(_command)


def main(argv=None):
    """Console entry point of ``dspark-export``: user errors print one line and exit 2."""
    run_cli(cli, argv)


if __name__ == "__main__":
    main()
