"""The command line: ``nbtune demo``, ``nbtune train``, ``nbtune ladder`` (``main``)."""
