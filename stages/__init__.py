"""One module per rlkit command. Each has a frozen config dataclass, a pure `run(cfg)` and a thin
typer `command` that maps flags to the config. Heavy imports happen inside `run`."""
