"""The ``dspark-export`` commands by subject (models, engine directories, the drafter, precision, what is fitted to
a built engine); :mod:`dspark_export.cli` assembles them into one command group.
"""
