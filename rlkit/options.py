"""Option types shared by the stage commands (typer `Annotated` aliases), so flags read the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

OutDir = Annotated[Path, typer.Option("--out", "-o", help="Output directory (written atomically).")]
OutTable = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Output table (.arrow). Omitted or '-': stream to stdout (must be a pipe)."),
]
InTable = Annotated[
    str | None,
    typer.Option("--in", "-i", help="Input table (.arrow), or '-' for stdin. Omitted: read stdin when it is a pipe."),
]
PolicyDir = Annotated[Path, typer.Option("--policy", help="Policy checkpoint directory (Hugging Face layout).")]
Task = Annotated[
    str,
    typer.Option("--task", help="Task spec NAME[:key=value,...], e.g. 'arithmetic' or 'arithmetic:terms=2-5,max=20'."),
]
Seed = Annotated[int, typer.Option("--seed", help="Random seed; same seed and inputs give the same result.")]
Force = Annotated[bool, typer.Option("--force", help="Rerun even when --out is up to date with these inputs and settings.")]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow model code from the checkpoint (off unless asked for).")
]
PromptColumn = Annotated[str, typer.Option("--prompt-column", help="Column of the data that holds the prompt.")]
AnswerColumn = Annotated[str, typer.Option("--answer-column", help="Column of the data that holds the gold answer.")]
