"""The optional extras a built-in plug-in runs (reasoning-gym, textarena, OpenEnv's websockets client): the line
that says one is missing, and the version manifests record of one installed."""

from __future__ import annotations

from rlkit.errors import RlkitError


def missing_extra(who: str, package: str, install: str, e: ImportError) -> RlkitError:
    """The one line for `who` (e.g. 'task reasoning-gym') whose `package` did not import: what is missing and the
    install command."""
    return RlkitError(f"{who} needs the {package} package, which is not installed ({e.name} is missing): {install}")


def library_version(distribution: str) -> str:
    """The installed version of a distribution ('unknown' when it has none): what manifests record for the library
    an adapter runs (reasoning-gym, textarena, websockets)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"
