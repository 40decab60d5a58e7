"""One module per ``workbench`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
